"""Mixture of experts (DeepSeek-V3 style): top-k router with group-limited routing and an aux-loss-free
expert bias, routed experts as stacked weights, optional shared experts, optional load-balancing loss.

Two dispatches, chosen by whether the forward is being compiled (``compiling``):
- compiled (``GroupedExperts.dispatch``), every shape fixed by the micro-batch: each (token, choice) row gets a
  slot in a buffer cut into blocks of rows/(2E) rows; each expert's rows fill whole blocks of their own, in
  expert order, the rest of its last block zero. Each block then runs through its expert's weights (gathered
  per block) in one batched matmul, and each (token, choice) reads its output back from its slot. Slots come
  from a running count per expert (a cumsum of the choices' one-hots), so no sort and no host round trip.
  Under expert parallelism (``MoELayer.graph_dispatcher``, the all-gather dispatcher of
  ``training.parallel.expert_parallel``) the rows are the ep group's, gathered with their choices and gates; the
  block dispatch runs this rank's experts on the rows routed to them (the others get no slot and read zero),
  and the gated sums go back to the tokens' ranks with a reduce-scatter.
- eager (``MoELayer._dispatch_on_host``): the router's choices go to the host and are sorted by expert (numpy);
  the rows, grouped by expert, go to the layer's experts (``GroupedExperts.construct``: one batched matmul
  padded to the busiest expert's count) or, under expert parallelism, to the all-to-all dispatcher of
  ``training.parallel.expert_parallel``, and the outputs are scatter-added back per token. Run op by op it is
  the faster of the two (``python -m benchmarks.moe_dispatch`` compares them; docs/models.md has its figures):
  fewer ops, no per-block weight copies, padding only up to the busiest expert's count. Under a graph its host
  round trip and routing-dependent shapes cannot be.
Both compute the same values within fp32 rounding (tests/test_deepseek_v3.py). Layouts (MindFormers' grouped
GEMM): ``experts.weight1`` [E, hidden, 2·ffn] with the gate in the first half of the last axis and up in the
second, ``experts.weight2`` [E, ffn, hidden] (input-major: the transpose of an HF Linear weight).

What a step needs besides the output (tokens per expert for the expert-bias update, the load-balancing loss
for the loss and its log) the layer returns with it, its ``routing``, and its caller keeps in the layer's
``RoutingStats`` buffers (``MoELayer.keep_routing``): they are not model parameters (not saved, not sharded).
Kept by the caller, not written by the layer's forward, so that compiled, every MoE layer of one shape can share
one graph (``TransformerLayer.graph_key``): a graph writing buffers of its own would write the first layer's.
"""
from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.primitive import constexpr

from training.model.layers import Init, _matmul_transpose_b, cast, expand
from training.model.spec import ModuleSpec, build_module

LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")


@constexpr(check=False)
def _is_none(value) -> bool:
    return value is None


def compiling() -> bool:
    """True while ``mindspore.jit`` traces the caller, a constant of the graph; False when it runs eagerly. A graph
    hands a constexpr no Python function objects (they arrive as None); MindSpore's own recompute asks the same
    way (``mindspore.graph.api._run_in_jit``, whose body does not parse inside a jit)."""
    return _is_none(compiling)


def scale_rows(rows: Tensor, weights: Tensor) -> Tensor:
    """rows [n, width] times weights [n], row by row, the weights broadcast to the rows' shape first: on CPU a Mul
    with a [n, 1] operand keeps two int64 index maps of its output for as long as its graph lives. BroadcastTo
    rather than ``layers.expand``'s Tile, whose gradient is slow for a [n, 1] operand (figures: docs/training.md,
    The model's ops)."""
    return rows * ops.broadcast_to(weights.reshape(-1, 1), rows.shape)


class TopKRouter(nn.Cell):
    """Scores every expert for every token (fp32); picks top-k by score + expert bias within the best
    ``topk_group`` of ``n_group`` groups (a group's score: the sum of its top-2); gates come from the
    unbiased scores, renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.weight = init.normal(config.n_routed_experts, config.hidden_size)
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.score_function = config.moe_router_score_function
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight_gather = None  # ZeRO-3 in a compiled step: the scores' product from this rank's rows

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        """ZeRO-3 in a compiled step (``gathers``: training.parallel.fsdp.WeightGathers): the scores' product."""
        return {"weight_gather": gathers.matrix()}

    def construct(self, tokens: Tensor, expert_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [T, hidden] → (scores [T, E] fp32, chosen experts [T, k], gates [T, k])."""
        tokens = cast(tokens, ms.float32)
        logits = (_matmul_transpose_b(tokens, cast(self.weight, ms.float32)) if self.weight_gather is None
                  else self.weight_gather(tokens, self.weight))
        scores = ops.sigmoid(logits) if self.score_function == "sigmoid" else ops.softmax(logits, axis=-1)
        selection = ops.stop_gradient(scores) + expand(expert_bias, scores)
        if self.n_group > 1:
            grouped = selection.reshape(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = ops.topk(grouped, 2)[0].sum(-1)                          # [T, n_group]
            _, kept = ops.topk(group_scores, self.topk_group)
            keep = ops.one_hot(kept, self.n_group, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)).sum(1)
            keep = expand(keep.expand_dims(-1), grouped).reshape(selection.shape)
            selection = ops.where(keep > 0, selection, Tensor(float(np.finfo(np.float32).min), ms.float32))
        _, chosen = ops.topk(selection, self.top_k)
        gates = ops.gather_elements(scores, 1, chosen)
        if self.norm_topk_prob:
            gates = gates / expand(gates.sum(-1, keepdims=True) + 1e-20, gates)
        return scores, chosen, gates * self.scaling


def _swiglu_experts(x: Tensor, weight1: Tensor, weight2: Tensor) -> Tensor:
    """[n, rows, hidden] through n SwiGLU experts' stacked weights ([n, hidden, 2·ffn], [n, ffn, hidden])."""
    gate, up = ops.chunk(ops.bmm(x, cast(weight1, x.dtype)), 2, axis=-1)
    return ops.bmm(ops.silu(gate) * up, cast(weight2, x.dtype))


class GroupedExperts(nn.Cell):
    """E SwiGLU experts as two stacked weights (see the module docstring for the layout), experts along dim 0:
    what expert parallelism cuts."""

    STACKED_WEIGHTS = ("weight1", "weight2")

    def __init__(self, init: Init, config):
        super().__init__()
        experts, hidden, ffn = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.ffn = ffn
        self.weight1 = init.normal(experts, hidden, 2 * ffn)
        self.weight2 = init.normal(experts, ffn, hidden)
        # ZeRO-3 in a compiled step: the weights of given experts from this rank's chunks of experts
        self.weight1_gather = None
        self.weight2_gather = None

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        """ZeRO-3 in a compiled step: the rows (experts) a dispatch reads, gathered from this rank's chunk."""
        return {f"{attr}_gather": gathers.rows()}

    def _weights_of(self, experts: Tensor) -> tuple[Tensor, Tensor]:
        """Both stacked weights of ``experts`` [n] int32, one [n, ...] slice per entry."""
        if self.weight1_gather is None:
            return ops.gather(self.weight1, experts, 0), ops.gather(self.weight2, experts, 0)
        return self.weight1_gather(self.weight1, experts), self.weight2_gather(self.weight2, experts)

    def dispatch(self, tokens: Tensor, expert_of_row: Tensor, one_hot: Tensor, counts: Tensor,
                 top_k: int) -> Tensor:
        """Every (token, choice) row through its expert, in static shapes (module docstring): ``tokens``
        [T, hidden]; ``expert_of_row`` [T·k] int32, row t·k + j being token t's j-th choice; ``one_hot``
        [T·k, E] its one-hot (fp32) and ``counts`` [E] its column sums. Returns [T·k, hidden].

        Blocks of ``rows / (2·E)`` rows (at least 1) keep the padding under half the rows and the per-block
        weight copies under 3·E experts' worth; fed the busiest expert's count instead, one batch per expert
        would need a shape known only on the host.

        Under expert parallelism these E are this rank's experts, and a row chosen for another rank's expert has
        an all-zero one-hot (and ``expert_of_row`` 0): it gets no slot and its output is zero. The last slot is
        then free (the slots outnumber the rows routed here by more than the padding), so such rows read it, and
        it holds the zero row, which a SwiGLU expert maps to exactly zero, with zero weight gradients."""
        rows, hidden = one_hot.shape[0], tokens.shape[1]
        experts = one_hot.shape[1]
        block = max(rows // (2 * experts), 1)
        blocks = -(-(rows + experts * (block - 1)) // block)       # enough for any counts summing to ``rows``
        blocks_of_expert = ops.ceil(counts / block)
        block_end = ops.cumsum(blocks_of_expert, 0)
        rank = ((ops.cumsum(one_hot, 0) - one_hot) * one_hot).sum(1)   # earlier rows choosing the same expert
        slot = (ops.gather(block_end - blocks_of_expert, expert_of_row, 0) * block + rank).astype(ms.int32)
        routed_here = one_hot.sum(1) > 0
        # a row for no expert here reads the last slot, which then holds the zero row: its output is exactly zero
        slot = ops.where(routed_here, slot, ops.fill(ms.int32, (rows,), blocks * block - 1))
        token_of_slot = ops.tensor_scatter_elements(               # unused slots read the zero row (index T)
            ops.fill(ms.int32, (blocks * block,), tokens.shape[0]), slot,
            ops.where(routed_here, ops.arange(rows, dtype=ms.int32) // top_k,
                      ops.fill(ms.int32, (rows,), tokens.shape[0])))
        padded = ops.gather(ops.cat([tokens, ops.zeros((1, hidden), tokens.dtype)], 0), token_of_slot, 0)
        block_index = ops.arange(blocks, dtype=ms.float32).expand_dims(1)
        ended = (ops.tile(block_end.expand_dims(0), (blocks, 1)) <= ops.tile(block_index, (1, experts))
                 ).astype(ms.float32).sum(1)                       # experts ended before the block
        expert_of_block = ops.minimum(ended, experts - 1).astype(ms.int32)  # blocks past the last hold zeros
        out = _swiglu_experts(padded.reshape(blocks, block, hidden), *self._weights_of(expert_of_block))
        return ops.gather(out.reshape(blocks * block, hidden), slot, 0)

    def construct(self, x_sorted: Tensor, counts: np.ndarray) -> Tensor:
        """x_sorted: [assignments, hidden], grouped by expert in expert order with ``counts[e]`` rows each, counted
        on the host (the eager dispatch's rows, or the expert-parallel dispatcher's).

        All experts run as one batched matmul over [E, capacity, hidden], capacity = the busiest expert's
        count, padding rows zero: in PyNative every op costs its dispatch, and a per-expert loop
        (split, unstack, 5 ops per expert, cat) took several times longer forward+backward than the padded
        compute (figures: docs/training.md, The model's ops)."""
        assignments, hidden = x_sorted.shape
        experts = len(counts)
        capacity = max(int(counts.max()), 1)
        starts = np.cumsum(counts) - counts
        rank = np.arange(assignments) - np.repeat(starts, counts)        # position within its expert
        slot = (np.repeat(np.arange(experts), counts) * capacity + rank).astype(np.int32)
        rows = np.full(experts * capacity, assignments, np.int32)        # padding reads the zero row
        rows[slot] = np.arange(assignments, dtype=np.int32)
        padded = ops.gather(ops.cat([x_sorted, ops.zeros((1, hidden), x_sorted.dtype)], 0), Tensor(rows), 0)
        weights = ((self.weight1, self.weight2) if self.weight1_gather is None
                   else self._weights_of(Tensor(np.arange(experts, dtype=np.int32))))
        out = _swiglu_experts(padded.reshape(experts, capacity, hidden), *weights)
        return ops.gather(out.reshape(experts * capacity, hidden), Tensor(slot), 0)


_stats_ids = itertools.count()


class RoutingStats:
    """What a MoE layer's forwards leave for the host, in buffers its callers write (``MoELayer.keep_routing``):
    tokens per expert summed since the last ``take_counts`` and the last forward's load-balancing loss. A plain
    object, so the buffers are no Cell parameters: not in checkpoints, not sharded, no gradients."""

    def __init__(self, num_experts: int):
        number = next(_stats_ids)  # a graph needs its parameters' names distinct
        self.tokens = Parameter(Tensor(np.zeros(num_experts, np.float32)), name=f"routing_stats.{number}.tokens",
                                requires_grad=False)
        self.aux_loss = Parameter(Tensor(0.0, ms.float32), name=f"routing_stats.{number}.aux_loss",
                                  requires_grad=False)


class AuxLossGradient(nn.Cell):
    """Passes the layer's output through, and gives the load-balancing loss the gradient it gets as a term of the
    scaled training loss (``loss_scale``, the trainer's ``ScaledLoss.scale``): the loss is added to the model's
    loss as a value read from ``RoutingStats``, so its gradient has to enter here (Megatron's
    MoEAuxLossAutoScaler does the same)."""

    def __init__(self):
        super().__init__()
        self.loss_scale = 1.0

    def construct(self, x: Tensor, aux_loss: Tensor) -> Tensor:
        return x

    def bprop(self, x: Tensor, aux_loss: Tensor, out: Tensor, dout: Tensor):
        return dout, ops.ones_like(aux_loss) * self.loss_scale


class MoELayer(nn.Cell):
    """Routed experts (+ shared experts) in place of the dense MLP; the router, the routed experts and
    the shared experts (None: none) come from the spec. Counts how many tokens each expert received
    (``take_counts``; ``tokens_per_expert`` keeps the last step's for the checkpoint), and its load-balancing
    loss of the last forward is ``aux_loss`` (None when moe_aux_loss_coeff is 0 or the type is 'none').
    ``construct`` returns the output and its ``routing`` (module docstring), which the caller passes to
    ``keep_routing``."""

    def __init__(self, init: Init, config, router: ModuleSpec, experts: ModuleSpec,
                 shared_experts: ModuleSpec | None = None):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.router = build_module(router, init, config)
        self.experts = build_module(experts, init, config)
        self.shared_experts = build_module(shared_experts, init, config) if shared_experts else None
        self.expert_bias = Parameter(Tensor(np.zeros(self.num_experts, np.float32)), requires_grad=False)
        self.tokens_per_expert = Parameter(Tensor(np.zeros(self.num_experts, np.float32)), requires_grad=False)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.balancing = config.moe_router_load_balancing_type
        self.aux_coeff = config.moe_aux_loss_coeff
        self.has_aux_loss = self.balancing != "none" and self.aux_coeff != 0
        self.stats = RoutingStats(self.num_experts)
        self.aux_loss_gradient = AuxLossGradient()
        # sequence parallel: sums the loss statistics over the ranks holding the other parts of the sequences
        # (forward all-reduce, backward identity); None when this rank sees whole sequences
        self.sequence_shard_sum = None
        # context parallelism: 1/cp. Each cp rank's loss is its part of its samples' loss, and every cp rank
        # computes the whole balancing loss (from statistics summed over cp), so each adds its share
        self.aux_loss_share = 1.0
        # expert parallelism: (rows grouped by expert, counts over all experts) -> the experts' outputs in the same
        # order, through its all-to-all dispatch; None: this layer's own experts take the rows
        self.token_dispatcher = None
        # expert parallelism in a graph: the Cell that all-gathers the ep group's routed rows for this rank's experts
        # and reduce-scatters their outputs back (training.parallel.expert_parallel.AllGatherDispatcher)
        self.graph_dispatcher = None

    @property
    def aux_loss(self) -> Tensor | None:
        """The last forward's load-balancing loss as a value (its gradient comes through ``AuxLossGradient``)."""
        return self.stats.aux_loss if self.has_aux_loss else None

    def construct(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """x [batch, seq, hidden] → (output, routing: this forward's tokens per expert [E] and, with a balancing
        loss, that loss's value)."""
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        scores, chosen, gates = self.router(tokens, self.expert_bias)
        expert_of_row = chosen.reshape(-1)                         # [T·k], token t's j-th choice at t·k + j
        one_hot = ops.one_hot(expert_of_row, self.num_experts, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        counts = one_hot.sum(0)
        if compiling():
            out = self._dispatch_in_graph(tokens, expert_of_row, one_hot, counts, chosen, gates)
        else:
            out = self._dispatch_on_host(tokens, chosen, gates)
        out = out.reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if not self.has_aux_loss:
            return out, (counts,)
        aux_loss = self._load_balancing_loss(scores, one_hot.reshape(batch, seq * self.top_k, self.num_experts))
        return self.aux_loss_gradient(out, aux_loss), (counts, ops.stop_gradient(aux_loss))

    def keep_routing(self, routing: tuple[Tensor, ...]) -> None:
        """Adds a forward's tokens per expert to the counts and keeps its load-balancing loss (``construct``'s
        ``routing``), outside the graph a compiled layer shares with the others."""
        ops.assign_add(self.stats.tokens, routing[0])
        if self.has_aux_loss:
            ops.assign(self.stats.aux_loss, routing[1])

    def _dispatch_in_graph(self, tokens: Tensor, expert_of_row: Tensor, one_hot: Tensor, counts: Tensor,
                           chosen: Tensor, gates: Tensor) -> Tensor:
        """The compiled path (module docstring): the block dispatch through this layer's experts, each (token, choice)
        output times its gate and summed per token; under expert parallelism over the ep group's gathered rows,
        the sums going back to the tokens' ranks."""
        if self.graph_dispatcher is not None:
            tokens, expert_of_row, one_hot, counts, gates = self.graph_dispatcher(tokens, chosen, gates)
        routed = self.experts.dispatch(tokens, expert_of_row, one_hot, counts, self.top_k)
        out = scale_rows(routed, cast(gates, tokens.dtype)).reshape(-1, self.top_k, tokens.shape[1]).sum(1)
        return out if self.graph_dispatcher is None else self.graph_dispatcher.combine(out)

    def _dispatch_on_host(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Tensor:
        """The eager path (module docstring): rows sorted by expert on the host, through the expert-parallel
        dispatcher or this layer's experts, outputs scatter-added back."""
        choices = chosen.asnumpy().reshape(-1)
        order = np.argsort(choices, kind="stable")
        token_of = Tensor((order // self.top_k).astype(np.int32))
        gate_sorted = cast(ops.gather(gates.reshape(-1), Tensor(order.astype(np.int32)), 0), tokens.dtype)
        experts = self.experts if self.token_dispatcher is None else self.token_dispatcher
        routed = experts(ops.gather(tokens, token_of, 0), np.bincount(choices, minlength=self.num_experts))
        return ops.unsorted_segment_sum(scale_rows(routed, gate_sorted), token_of, tokens.shape[0])

    def _load_balancing_loss(self, scores: Tensor, one_hot: Tensor) -> Tensor:
        """coeff · Σ_i f_i·P_i: f_i = E/(k·T)·(tokens choosing expert i), P_i = mean routing probability of
        expert i (scores normalised per token), over each sequence ('seq_aux_loss', then averaged) or over
        the whole micro-batch ('aux_loss'); ``one_hot`` [batch, seq·k, E] are the choices. Under sequence
        parallelism the counts and probability sums are summed over the sequence's shards first (one
        collective), as MindFormers' router does."""
        batch = one_hot.shape[0]
        probs = scores / expand(scores.sum(-1, keepdims=True), scores)
        if self.balancing == "aux_loss":
            one_hot, probs = one_hot.reshape(1, -1, self.num_experts), probs.reshape(1, -1, self.num_experts)
        else:
            probs = probs.reshape(batch, -1, self.num_experts)
        rows = one_hot.shape[0]
        counts = one_hot.sum(1)
        prob_sums = probs.sum(1)
        if self.sequence_shard_sum is not None:
            counts, prob_sums = ops.split(self.sequence_shard_sum(ops.cat((counts, prob_sums))), rows)
        choices_per_row = counts.sum(-1, keepdims=True)  # k·tokens per row
        fraction = counts * self.num_experts / expand(choices_per_row, counts)
        mean_probs = prob_sums / expand(choices_per_row / self.top_k, prob_sums)
        return (fraction * mean_probs).sum(-1).mean() * self.aux_coeff * self.aux_loss_share

    # ---- parallel plan ----
    @staticmethod
    def check_tensor_parallel(config, tp, **submodules) -> None:
        """Nothing to require: tensor parallelism cuts nothing here."""

    def parallelize_tensor(self, tp) -> None:
        """Router, experts and shared experts stay whole under tensor parallelism; under sequence parallelism the
        balancing loss's statistics are summed over the sequence's shards."""
        self.sequence_shard_sum = tp.sum_over_sequence_shards()

    def parallelize_experts(self, ep) -> None:
        """Expert parallelism: the routed experts cut over the ep ranks, the rows reaching them through its
        dispatchers (eager and compiled)."""
        ep.cut_experts(self.experts, GroupedExperts.STACKED_WEIGHTS)
        self.token_dispatcher, self.graph_dispatcher = ep.dispatchers(self.experts, self.num_experts)

    def parallelize_context(self, cp) -> None:
        """Context parallelism: the balancing loss's statistics over the whole sequences, each rank adding its
        share. Under sequence parallelism each cp segment is cut again over tp: the statistics are summed over tp
        first, then over cp, each sum differentiating as its own axis needs."""
        over_cp = cp.sum_over_cp()
        self.sequence_shard_sum = over_cp if self.sequence_shard_sum is None else nn.SequentialCell(
            [self.sequence_shard_sum, over_cp])
        self.aux_loss_share = 1.0 / cp.cp

    # ---- between steps ----
    @property
    def token_counts(self) -> np.ndarray:
        """Tokens per expert since the last ``take_counts`` (a pipeline stage saves and restores them around a
        replayed forward)."""
        return self.stats.tokens.asnumpy().astype(np.int64)

    @token_counts.setter
    def token_counts(self, counts: np.ndarray) -> None:
        ops.assign(self.stats.tokens, Tensor(np.asarray(counts, np.float32)))

    def take_counts(self) -> np.ndarray:
        """Tokens per expert since the last call (all micro-batches of the step); resets them."""
        counts = self.token_counts
        self.token_counts = np.zeros(self.num_experts)
        return counts

    def update_expert_bias(self, counts: np.ndarray) -> None:
        """Aux-loss-free balancing: bias += rate · sign(mean count − count), from the step's counts summed
        over the ranks (``GPTModel.after_step``); ``tokens_per_expert`` keeps those counts for the checkpoint. Written in place
        (``ops.assign``): a compiled step reads the buffers it was compiled with, which ``set_data`` replaces."""
        ops.assign(self.tokens_per_expert, Tensor(counts.astype(np.float32)))
        if self.enable_expert_bias:
            step = self.bias_update_rate * np.sign(counts.mean() - counts)
            ops.assign(self.expert_bias, Tensor((self.expert_bias.asnumpy() + step).astype(np.float32)))

    def expert_parameters(self) -> int:
        return int(np.prod(self.experts.weight1.shape) + np.prod(self.experts.weight2.shape))
