"""Tensor parallelism (Megatron-style), with MindFormers' sequence parallelism, applied to a built model
(docs/parallelism.md). Parallelize after building: the full model is built from the seed
in every process, so each rank's shards are exactly the single-process weights' slices.

``apply_tensor_parallel(model, mesh, sequence_parallel)`` works over ``mesh.group("tp")``: the model says what
is cut (its ``parallelize_tensor(tp)``, each module of it its own part), with the tools of ``TensorParallel``:

- ``cut``: a rank keeps the chunk at its index in the tp group, an even split along one dim;
  ``column_parallel`` cuts a linear's output rows (dim 0, and its bias) and gathers its input,
  ``row_parallel`` its input columns (dim 1), its partial outputs summed; everything not cut is replicated;
- the collectives a module sets where it needs them: ``enter``/``leave`` around column- and row-parallel
  linears, the gather of every head's value (max attention logits: every rank must pop them), the sum over
  sequence shards (MoE balancing statistics), the vocab-parallel cross-entropy (max, sum of exponentials and
  label logit all-reduced over tp; the full logits never exist on one rank);
- ``applied_to_local_heads``: replicated parameters whose gradient is this rank's part (Qwen3's q/k norms).

Kiln's models (training/model: GPTModel, TransformerLayer, SelfAttention, MLASelfAttention, MLP, MoELayer,
VocabEmbedding) cut the vocabulary rows of the embedding and the output layer (a tied output layer uses the
embedding's chunk); column-parallel: GQA ``linear_qkv`` by whole KV groups, MLA ``linear_qb`` and
``linear_kvb``, dense MLP ``linear_fc1`` (gate/up pairs stay together); row-parallel: ``linear_proj`` and dense
``linear_fc2``; the rest (norms, MLA's down-projection, MoE routers and experts, shared experts, MTP's
``eh_proj``) stays whole.

Activations between blocks: with ``sequence_parallel`` (MindFormers' only mode when tp > 1) each rank
holds ``seq / tp`` consecutive positions of every sample ([batch, seq/tp, hidden]: dim 1); column-parallel
linears all-gather their input along it, row-parallel ones reduce-scatter their output onto it, and norms,
routers, experts and residual adds run on the shard. Without it, activations are replicated (copy into a
column-parallel linear, whose backward all-reduces; all-reduce out of a row-parallel one). Every rank
computes the same loss; ``model.logits`` returns this rank's vocabulary slice.

It returns a ``TensorParallelPlan``: every parameter's ``TensorLayout`` over the world (checkpoints record
and reshard from it), and ``grads_to_all_reduce_over_tp``: the replicated parameters whose gradient is only
this rank's part — used on a sequence shard (every replicated parameter under sequence parallelism) or on
this rank's heads — which the gradient reduction must sum over tp before anything else.

What the caller keeps in mind: sharded parameters are new ``Parameter`` objects under the same names (build
the optimizer and FSDP after this); a gradient norm counts a sharded tensor's squares summed over tp and a
replicated one's once; under sequence parallelism MoE ``tokens_per_expert`` counts this rank's tokens, so
``GPTModel.after_step`` must sum them over the ranks holding distinct tokens (dp × tp); dropout masks must
differ between sequence shards (per-rank streams do) but would have to agree across tp on the replicated
activations of plain TP, which is why plain TP refuses hidden dropout. FSDP applied afterwards sees the
tp-local shapes: its dim-0 chunks of a tp chunk are still an even grid of the global tensor (dim 0 cut into
tp · dp_shard for a column-parallel weight, dim 0 into dp_shard × dim 1 into tp for a row-parallel one).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.config import ConfigError
from training.parallel import comm
from training.parallel.layout import TensorLayout
from training.parallel.mesh import DeviceMesh, Group

SEQUENCE_DIM = 1  # activations are [batch, seq, hidden]


@dataclass(frozen=True)
class TensorParallelPlan:
    """What ``apply_tensor_parallel`` did; ``sequence_parallel`` is false at tp 1 (whole sequences)."""
    sequence_parallel: bool
    layouts: dict[str, TensorLayout]  # every parameter of the model (buffers included), by name
    grads_to_all_reduce_over_tp: tuple[str, ...]  # replicated parameters whose local gradient is a part

    @property
    def sharded(self) -> tuple[str, ...]:
        return tuple(name for name, layout in self.layouts.items() if layout.is_sharded)


class VocabParallelCrossEntropy(nn.Cell):
    """Per-token -log p(label) for ``logits`` [tokens, local vocab] holding the vocabulary ids ``vocab_start``
    onwards, labels [tokens] over the whole vocabulary. The row maximum (only for stability, no gradient), the
    sum of exponentials and the label's logit (from the rank holding it) are summed over ``group``; the
    backward of that sum is the identity, so each rank's logits get their softmax minus the one-hot."""

    def __init__(self, vocab_start: int, group: Group):
        super().__init__()
        self.vocab_start = vocab_start
        self.gather_maxima = comm.AllGather(group, 0)
        self.sum_over_ranks = comm.ReduceFromGroup(group)

    def construct(self, logits, labels):
        row_max = ops.stop_gradient(self.gather_maxima(logits.amax(-1).expand_dims(0)).amax(0))
        shifted = logits - row_max.expand_dims(-1)
        local_labels = labels - self.vocab_start
        here = ops.logical_and(local_labels >= 0, local_labels < logits.shape[-1])
        label_logit = ops.gather_elements(shifted, 1, ops.where(here, local_labels, 0).reshape(-1, 1)).reshape(-1)
        sums = self.sum_over_ranks(ops.stack((ops.exp(shifted).sum(-1), label_logit * here.astype(logits.dtype))))
        return ops.log(sums[0]) - sums[1]


class TensorParallelRequirements:
    """What a model's ``check_tensor_parallel(tp)`` asks of a tensor-parallel degree: ``require_divisible`` and
    ``refuse`` gather every problem, so one error names them all. A model answers from its config alone (its
    modules' classes check the widths their specs would build), so a launch checks a layout before any model
    or collective exists (``tensor_parallel_problems``)."""

    def __init__(self, size: int, sequence_parallel: bool):
        self.size, self.sequence_parallel = size, sequence_parallel
        self.problems: list[str] = []

    def require_divisible(self, count: int, field: str, what: str) -> None:
        if count % self.size:
            self.refuse(f"parallelism.tensor_parallel ({self.size}) must divide {field} ({count}): {what}")

    def refuse(self, problem: str) -> None:
        if problem not in self.problems:  # layers built from one spec ask the same
            self.problems.append(problem)


def tensor_parallel_problems(model_config, size: int, sequence_parallel: bool) -> list[str]:
    """What tensor parallelism of degree ``size`` cannot split in the model ``model_config`` describes (empty: it
    can), from the config's own ``check_tensor_parallel``, without building the model."""
    if size == 1:
        return []
    requirements = TensorParallelRequirements(size, sequence_parallel)
    model_config.check_tensor_parallel(requirements)
    return requirements.problems


class TensorParallel(TensorParallelRequirements):
    """What a model's tensor-parallel plan cuts with over the tp ``group``: the cuts (each recording the parameter's
    layout over the world), the collectives around column- and row-parallel linears (``enter``, ``leave``: one
    Cell for every call site, as they hold no state, so ``comm.for_graph`` switches them all at once), and the
    record of replicated parameters applied to this rank's heads only. The model's ``check_tensor_parallel(tp)``
    names what it cannot split (``require_divisible``, ``refuse``), then its ``parallelize_tensor(tp)`` cuts."""

    def __init__(self, mesh: DeviceMesh, group: Group, sequence_parallel: bool):
        super().__init__(group.size, sequence_parallel)
        self.group, self.rank = group, group.rank
        self.world = mesh.dims.world
        self.tp_index_of_rank = tuple(mesh.dims.coords(r)["tp"] for r in range(self.world))
        self.layouts: dict[str, TensorLayout] = {}
        self.head_local: set[str] = set()

    # made when first set, after the model's checks: what cannot be split is refused before any collective exists
    @functools.cached_property
    def enter(self) -> nn.Cell:
        """Into a column-parallel linear: the whole sequence gathered (sequence parallel), or a copy."""
        return comm.AllGather(self.group, SEQUENCE_DIM) if self.sequence_parallel else comm.CopyToGroup(self.group)

    @functools.cached_property
    def leave(self) -> nn.Cell:
        """Out of a row-parallel linear: the partial outputs reduce-scattered onto the sequence shards, or summed."""
        return (comm.ReduceScatter(self.group, SEQUENCE_DIM) if self.sequence_parallel
                else comm.ReduceFromGroup(self.group))

    def cut(self, cell: nn.Cell, attr: str, dim: int) -> None:
        """Replace ``cell.<attr>`` by this rank's chunk along ``dim`` (a new Parameter of the same name)."""
        param = cell._params[attr]
        layout = TensorLayout.split(tuple(param.shape), dim, self.tp_index_of_rank, self.size)
        chunk = param.asnumpy()[layout.chunk_slices(self.rank)]
        cell._params[attr] = Parameter(Tensor(np.ascontiguousarray(chunk)), name=param.name,
                                       requires_grad=param.requires_grad)
        self.layouts[param.name] = layout

    def column_parallel(self, linear: nn.Cell) -> None:
        """A linear (``weight`` [out, in], optional ``bias``, ``input_comm``) computing this rank's output rows."""
        self.cut(linear, "weight", 0)
        if linear.bias is not None:
            self.cut(linear, "bias", 0)
        linear.input_comm = self.enter

    def row_parallel(self, linear: nn.Cell) -> None:
        """A linear (``weight`` [out, in], ``output_comm``) reading this rank's input columns, its partial outputs
        summed over the group."""
        if linear.bias is not None:
            raise ValueError("a row-parallel linear carries no bias: it would be added once per rank")
        self.cut(linear, "weight", 1)
        linear.output_comm = self.leave

    def applied_to_local_heads(self, *params: Parameter) -> None:
        """Replicated parameters applied to this rank's heads only: their gradients are parts, summed over tp."""
        self.head_local |= {p.name for p in params}

    def gather_heads(self) -> nn.Cell:
        """The collective stacking every rank's per-head values (max attention logits) in head order."""
        return comm.AllGather(self.group, 0)

    def sum_over_sequence_shards(self) -> nn.Cell | None:
        """Under sequence parallelism, the sum over the ranks holding the other parts of the sequences (forward
        all-reduce, backward identity); None when every rank sees whole sequences."""
        return comm.ReduceFromGroup(self.group) if self.sequence_parallel else None

    def vocab_parallel_cross_entropy(self, vocab_start: int) -> nn.Cell:
        """The per-token loss over logits holding this rank's vocabulary from ``vocab_start``."""
        return VocabParallelCrossEntropy(vocab_start, self.group)


def apply_tensor_parallel(model: nn.Cell, mesh: DeviceMesh, sequence_parallel: bool) -> TensorParallelPlan:
    """Shard ``model`` over ``mesh.group("tp")`` in place, as its ``parallelize_tensor`` says (see the module
    docstring for the contract)."""
    group = mesh.group("tp")
    tp = TensorParallel(mesh, group, sequence_parallel and group.size > 1)  # a group of one holds whole sequences
    if group.size > 1:
        model.check_tensor_parallel(tp)
        if tp.problems:
            raise ConfigError(*tp.problems)
        model.parallelize_tensor(tp)
    layouts = {p.name: tp.layouts.get(p.name, TensorLayout.replicated(tuple(p.shape), tp.world))
               for p in model.get_parameters()}
    # under sequence parallelism every replicated weight saw only this rank's positions
    partial_grads = [p.name for p in model.trainable_params()
                     if (tp.sequence_parallel and not layouts[p.name].is_sharded) or p.name in tp.head_local]
    return TensorParallelPlan(tp.sequence_parallel, layouts, tuple(partial_grads))
