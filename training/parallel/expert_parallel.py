"""Expert parallelism for MoE layers (docs/parallelism.md), applied to a built model after tensor parallelism
and before FSDP.

``apply_expert_parallel(model, mesh, parallelism)`` works over ``mesh.group("ep")`` and, in place, as the model's
``parallelize_experts(ep)`` says (``ExpertParallel`` holds the tools; Kiln's MoELayer uses them all):

- cuts every routed-expert weight (DeepSeek-V3's ``experts.weight1`` [E, hidden, 2·ffn], ``experts.weight2``
  [E, ffn, hidden]) along dim 0: ep rank r keeps experts ``[r·E/ep, (r+1)·E/ep)``, the single-process weights'
  slice (the whole model is built from the seed in every process first);
- gives each MoE layer an ``AllToAllDispatcher`` (``moe_token_dispatcher_type: alltoall``): the layer still
  routes its own tokens over all E experts and sorts the (token, choice) rows by expert, which puts the rows
  for each ep rank's experts next to each other. The per-expert counts are exchanged (one all-reduce of an
  [ep, E] table), the rows go to their experts' ranks with one variable-split all-to-all, are reordered
  from (source rank, expert) to expert-major, run through the local experts, are put back in arrival order
  and return with the reverse all-to-all. Both all-to-alls are differentiable (their backward is the
  reverse exchange), so the experts' gradients arrive on the rank holding them, summed over the ep group's
  tokens; the gate multiply and the scatter-add back to tokens stay in the layer.
- ``expert_parallel_use_safe_tokens``: each rank sends one zero row to every expert in front of its real
  rows, so no expert's batch is empty (MindFormers does so for its grouped matmul). A zero row adds exactly
  zero to the outputs and to every gradient, and is dropped on return; Kiln's padded batched matmul also
  runs an expert with no rows, so either setting trains the same weights.
- gives each MoE layer an ``AllGatherDispatcher`` too, the dispatch of a compiled step (``MoELayer.
  graph_dispatcher``), whose shapes the micro-batch fixes: the all-to-all's splits are counted on the host,
  which a graph cannot do. It all-gathers the ep group's tokens and routing instead, so each rank's block
  dispatch must have room for every row the group could route to its experts: more padded expert compute
  than the all-to-all's, for no host round trip (benchmarks/expert_parallel.py measures both). Safe tokens
  have no part in it.

What expert parallelism leaves alone, and why. The router runs on this rank's tokens over all E experts, so
the load-balancing loss's statistics (the counts and probabilities of this micro-batch's tokens, summed over
sequence shards under sequence parallelism by ``MoELayer.sequence_shard_sum``) and the tokens-per-expert counts
are those of the single-process run's micro-batch; ``GPTModel.after_step`` sums the counts over every rank
holding distinct tokens (the world: it contains the ep group), which feeds the expert biases and the
tokens-per-expert monitor. Expert weights' gradients are the sum over ep (the all-to-all's backward) and
then over ``expert_dp`` (dp_replicate × efsdp: the ranks holding the same experts), which ``Parallelism``
does from the returned plan — together every rank holding tokens, never the tp group on its own (ep may
be carved out of tp, whose ranks then hold different experts). FSDP shards expert weights over ``efsdp``,
each MoE layer's experts gathering as a unit of their own, as MindFormers wraps them on its sparse mesh.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.config import ConfigError, ParallelismConfig
from training.model.layers import expand
from training.parallel import comm
from training.parallel.layout import TensorLayout
from training.parallel.mesh import DeviceMesh, Group


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What ``apply_expert_parallel`` did: each routed-expert weight's layout over the world (cut along dim 0
    over ep), and the experts cells, which FSDP gathers as units of their own over ``efsdp``."""
    layouts: dict[str, TensorLayout]
    expert_cells: tuple[nn.Cell, ...]


class AllToAllDispatcher:
    """One MoE layer's routed experts under expert parallelism (see the module docstring); called with the
    layer's rows grouped by expert and ``counts`` over all E experts, returns the experts' outputs in the
    same order."""

    def __init__(self, experts: nn.Cell, group: Group, num_experts: int, safe_tokens: bool):
        self.experts, self.group = experts, group
        self.num_experts, self.local_experts = num_experts, num_experts // group.size
        self.safe_tokens = safe_tokens
        self.rows_sent_away = 0  # rows this rank's dispatch sent to other ranks' experts since the last reset

    def __call__(self, x_sorted: Tensor, counts: np.ndarray) -> Tensor:
        real_rows = None
        if self.safe_tokens:
            x_sorted, counts, real_rows = _with_safe_tokens(x_sorted, counts)
        ep, me, local = self.group.size, self.group.rank, self.local_experts
        table = np.zeros((ep, self.num_experts), np.float32)  # exact in float32 below 2**24 rows
        table[me] = counts
        sent_to = comm.all_reduce_array(table, self.group).astype(np.int64)  # [source, expert]: rows sent
        send = counts.reshape(ep, local).sum(1).tolist()  # rows for each rank's experts (contiguous: sorted)
        from_source = sent_to[:, me * local:(me + 1) * local]  # [source, local expert]
        receive = from_source.sum(1).tolist()
        self.rows_sent_away += sum(send) - send[me]
        arrived = comm.all_to_all_single(x_sorted, send, receive, self.group)  # source-major, then by expert
        expert_of_row = np.repeat(np.tile(np.arange(local), ep), from_source.reshape(-1))
        by_expert = np.argsort(expert_of_row, kind="stable").astype(np.int32)
        out = self.experts(ops.gather(arrived, Tensor(by_expert), 0), from_source.sum(0))
        in_arrival_order = ops.gather(out, Tensor(np.argsort(by_expert).astype(np.int32)), 0)
        returned = comm.all_to_all_single(in_arrival_order, receive, send, self.group)
        return returned if real_rows is None else ops.gather(returned, Tensor(real_rows), 0)


class AllGatherDispatcher(nn.Cell):
    """One MoE layer's routed experts under expert parallelism inside a compiled step, every shape fixed by the
    micro-batch (Megatron's ``allgather`` token dispatcher): called, it all-gathers the ep group's tokens and their
    routing (top-k choices and gates) and keeps, as a one-hot over this rank's experts, the rows routed to them,
    for ``GroupedExperts.dispatch`` (rows for other ranks' experts get no slot); ``combine`` sums the gated
    outputs over the group and returns each rank its own tokens' (a reduce-scatter). The gather's backward is a
    reduce-scatter and the combine's an all-gather, so each token's gradient is summed over the ranks that ran
    its experts and each expert's weight gradient over the ep group's tokens, as the all-to-all's. Built from
    ``comm``'s Cells, which parse in a graph after ``comm.for_graph`` (on CPU as all-reduces). Both parts are
    Cells called as such: a graph that reached this Cell's own methods through a local variable resolved them
    to ``__init__`` (MindSpore 2.10, under context parallelism)."""

    def __init__(self, group: Group, num_experts: int):
        super().__init__()
        self.gather_rows = comm.AllGather(group, 0)
        self.combine = comm.ReduceScatter(group, 0)
        self.num_experts, self.local_experts = num_experts, num_experts // group.size
        self.first_expert = group.rank * self.local_experts

    def construct(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> tuple[Tensor, ...]:
        """This rank's tokens [T, hidden], their choices [T, k] (int32) and gates [T, k] -> the group's tokens
        [ep·T, hidden]; for each of their (token, choice) rows its expert among this rank's (0 when another
        rank's), the one-hot of that [ep·T·k, E/ep] (all zero when another rank's) and its column sums; the
        group's gates [ep·T, k]."""
        top_k = chosen.shape[1]
        # choices travel as float32 (exact below 2**24; the dtype every CPU collective takes) beside the fp32 gates
        routing = self.gather_rows(ops.cat([ops.stop_gradient(chosen.astype(ms.float32)), gates], 1))
        choices, all_gates = routing[:, :top_k], routing[:, top_k:]
        one_hot = ops.one_hot(choices.reshape(-1).astype(ms.int32), self.num_experts, Tensor(1.0, ms.float32),
                              Tensor(0.0, ms.float32))[:, self.first_expert:self.first_expert + self.local_experts]
        local_index = ops.arange(self.local_experts, dtype=ms.float32)
        expert_of_row = (one_hot * expand(local_index.expand_dims(0), one_hot)).sum(1).astype(ms.int32)
        return self.gather_rows(tokens), expert_of_row, one_hot, one_hot.sum(0), all_gates


def _with_safe_tokens(x_sorted: Tensor, counts: np.ndarray) -> tuple[Tensor, np.ndarray, np.ndarray]:
    """One zero row in front of each expert's rows: (the rows, their counts, where the real rows now are)."""
    rows = x_sorted.shape[0]
    real_rows = (np.arange(rows) + np.repeat(np.arange(len(counts)) + 1, counts)).astype(np.int32)
    source = np.full(rows + len(counts), rows, np.int32)  # index ``rows`` reads the appended zero row
    source[real_rows] = np.arange(rows, dtype=np.int32)
    padded = ops.gather(ops.cat([x_sorted, ops.zeros((1, x_sorted.shape[1]), x_sorted.dtype)]), Tensor(source), 0)
    return padded, counts + 1, real_rows


def check_expert_parallel(parallelism: ParallelismConfig, num_experts: int | None) -> None:
    """Refuse a model this expert parallelism cannot cut, naming the fields (the dispatcher type is checked
    with the parallelism section)."""
    ep = parallelism.expert_parallel
    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"parallelism.expert_parallel is {ep} but the model has no routed experts "
                          "(model.n_routed_experts): expert parallelism shards MoE layers")
    if num_experts % ep:
        raise ConfigError(f"parallelism.expert_parallel ({ep}) must divide model.n_routed_experts ({num_experts}): "
                          "each ep rank holds an equal number of whole experts")


class ExpertParallel:
    """What a model's expert-parallel plan (its ``parallelize_experts``) cuts with over the ep group: the cut of
    stacked expert weights (each recording its layout over the world, the cell becoming an FSDP unit of its own)
    and each MoE layer's dispatchers."""

    def __init__(self, mesh: DeviceMesh, parallelism: ParallelismConfig):
        self.group, self.parallelism = mesh.group("ep"), parallelism
        self.ep_index_of_rank = tuple(mesh.dims.group_index("ep", r) for r in range(mesh.dims.world))
        self.layouts: dict[str, TensorLayout] = {}
        self.cells: list[nn.Cell] = []

    def require_experts(self, num_experts: int | None) -> None:
        check_expert_parallel(self.parallelism, num_experts)

    def cut_experts(self, cell: nn.Cell, attrs: tuple[str, ...]) -> None:
        """Replace each ``cell.<attr>`` (experts along dim 0) by this rank's experts."""
        for attr in attrs:
            param = cell._params[attr]
            layout = TensorLayout.split(tuple(param.shape), 0, self.ep_index_of_rank, self.group.size)
            local = param.asnumpy()[layout.chunk_slices(self.group.rank)]
            cell._params[attr] = Parameter(Tensor(np.ascontiguousarray(local)), name=param.name,
                                           requires_grad=param.requires_grad)
            self.layouts[param.name] = layout
        self.cells.append(cell)

    def dispatchers(self, experts: nn.Cell, num_experts: int) -> tuple[AllToAllDispatcher, AllGatherDispatcher]:
        """The eager dispatch (all-to-all) and the compiled one (all-gather) of a MoE layer's rows to ``experts``."""
        return (AllToAllDispatcher(experts, self.group, num_experts, self.parallelism.expert_parallel_use_safe_tokens),
                AllGatherDispatcher(self.group, num_experts))


def apply_expert_parallel(model: nn.Cell, mesh: DeviceMesh, parallelism: ParallelismConfig) -> ExpertParallelPlan:
    """Cut ``model``'s routed experts over ``mesh.group("ep")`` in place, as its ``parallelize_experts`` says, and
    route their tokens by all-to-all."""
    ep = ExpertParallel(mesh, parallelism)
    model.parallelize_experts(ep)
    return ExpertParallelPlan(ep.layouts, tuple(ep.cells))
