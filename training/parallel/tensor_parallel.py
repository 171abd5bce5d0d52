"""Tensor parallelism (Megatron-style), with MindFormers' sequence parallelism, applied to a built GPTModel
(docs/parallelism.md). Parallelize after building: the full model is built from the seed
in every process, so each rank's shards are exactly the single-process weights' slices.

``apply_tensor_parallel(model, mesh, sequence_parallel)`` works over ``mesh.group("tp")`` and, in place:

- cuts weights (each rank keeps the chunk at its index in the tp group, an even split along one dim):
  vocabulary rows of ``embedding.word_embeddings.weight`` and ``output_layer.weight`` (a tied output layer
  uses the embedding's chunk); column-parallel (rows, dim 0): GQA ``linear_qkv`` (weight and bias) — its
  rows are grouped per KV group, so each rank holds whole query groups —, MLA ``linear_qb`` and
  ``linear_kvb``, dense MLP ``linear_fc1`` (interleaved gate/up rows: pairs stay together); row-parallel
  (dim 1): ``linear_proj`` and dense ``linear_fc2``. Everything else is replicated: norms (the per-head q/k
  norms too), MLA's fused down-projection ``linear_qkv`` and latent norms, MoE routers, routed experts
  (until expert parallelism), shared experts, MTP's ``eh_proj`` and norms;
- sets what modules need to know: local head/group counts (``num_heads``, ``num_groups``) and MLP widths
  (``ffn``), the collectives around column-parallel (``input_comm``) and row-parallel (``output_comm``)
  linears, the vocabulary range of the embedding, MLA's rope-key collective, the MoE loss statistics'
  sum over sequence shards, the gather of every head's max attention logit (``pop_max_attention_logits``
  returns all heads, so every rank must call it), and the model's vocab-parallel cross-entropy (max, sum of
  exponentials and label logit all-reduced over tp; the full logits never exist on one rank).

Activations between blocks: with ``sequence_parallel`` (MindFormers' only mode when tp > 1) each rank
holds ``seq / tp`` consecutive positions of every sample ([batch, seq/tp, hidden]: dim 1); column-parallel
linears all-gather their input along it, row-parallel ones reduce-scatter their output onto it, and norms,
routers, experts and residual adds run on the shard. Without it, activations are replicated (copy into a
column-parallel linear, whose backward all-reduces; all-reduce out of a row-parallel one). Every rank
computes the same loss; ``model.logits`` returns this rank's vocabulary slice.

It returns a ``TensorParallelPlan``: every parameter's ``TensorLayout`` over the world (checkpoints record
and reshard from it), and ``grads_to_all_reduce_over_tp``: the replicated parameters whose gradient is only
this rank's part — used on a sequence shard (every replicated parameter under sequence parallelism) or on
this rank's heads (Qwen3's q/k norms) — which the gradient reduction must sum over tp before anything else.

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

from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.config import ConfigError
from training.model.attention import SelfAttention
from training.model.gpt import GPTModel
from training.model.layers import Linear
from training.model.moe import MoELayer
from training.model.transformer import MLP
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


class _Sharder:
    """Cuts parameters of the model over the tp group and records every parameter's layout."""

    def __init__(self, mesh: DeviceMesh, group: Group):
        self.group = group
        self.world = mesh.dims.world
        self.tp_index_of_rank = tuple(mesh.dims.coords(r)["tp"] for r in range(self.world))
        self.layouts: dict[str, TensorLayout] = {}

    def cut(self, cell: nn.Cell, attr: str, dim: int) -> None:
        """Replace ``cell.<attr>`` by this rank's chunk along ``dim`` (a new Parameter of the same name)."""
        param = cell._params[attr]
        layout = TensorLayout.split(tuple(param.shape), dim, self.tp_index_of_rank, self.group.size)
        chunk = param.asnumpy()[layout.chunk_slices(self.group.rank)]
        cell._params[attr] = Parameter(Tensor(np.ascontiguousarray(chunk)), name=param.name,
                                       requires_grad=param.requires_grad)
        self.layouts[param.name] = layout

    def column_parallel(self, linear: Linear, enter) -> None:
        self.cut(linear, "weight", 0)
        if linear.bias is not None:
            self.cut(linear, "bias", 0)
        linear.input_comm = enter

    def row_parallel(self, linear: Linear, leave) -> None:
        # the bias of a row-parallel linear would be added once per rank: none of these models has one
        assert linear.bias is None, "row-parallel linears carry no bias"
        self.cut(linear, "weight", 1)
        linear.output_comm = leave


def _require_divisible(count: int, field: str, tp: int, what: str) -> None:
    if count % tp:
        raise ConfigError(f"parallelism.tensor_parallel ({tp}) must divide {field} ({count}): {what}")


def _transformer_layers(model: GPTModel) -> list[nn.Cell]:
    """The decoder layers, then each MTP depth's layer (parallelized alike, as in MindFormers)."""
    return list(model.decoder.layers) + ([m.transformer_layer for m in model.mtp.layers] if model.mtp else [])


def _check(model: GPTModel, tp: int, sequence_parallel: bool) -> None:
    c = model.config
    _require_divisible(c.vocab_size, "model.vocab_size", tp, "each rank holds an equal slice of the vocabulary")
    if sequence_parallel:
        _require_divisible(c.seq_length, "model.seq_length", tp, "sequence parallelism gives each rank an equal "
                                                                 "part of every sequence")
    elif c.hidden_dropout > 0:
        raise ConfigError(f"model.hidden_dropout ({c.hidden_dropout}) with tensor parallelism needs "
                          "parallelism.sequence_parallel: true: without it every tp rank holds the same "
                          "activations and would drop different elements of them")
    layers = _transformer_layers(model)
    if isinstance(layers[0].self_attention, SelfAttention):
        _require_divisible(c.num_key_value_heads, "model.num_key_value_heads", tp,
                           "linear_qkv is split by whole query groups")
    else:
        _require_divisible(c.num_attention_heads, "model.num_attention_heads", tp, "MLA splits the heads")
        if not c.q_lora_rank:
            raise ConfigError("model.q_lora_rank is unset: tensor-parallel MLA needs the query compression "
                              "(linear_qb splits the heads), as in MindFormers")
    if any(isinstance(layer.mlp, MLP) for layer in layers):
        _require_divisible(c.intermediate_size, "model.intermediate_size", tp, "linear_fc1/linear_fc2 split it")


def apply_tensor_parallel(model: GPTModel, mesh: DeviceMesh, sequence_parallel: bool) -> TensorParallelPlan:
    """Shard ``model`` over ``mesh.group("tp")`` in place (see the module docstring for the contract)."""
    group = mesh.group("tp")
    sharder = _Sharder(mesh, group)
    sequence_parallel = sequence_parallel and group.size > 1  # a group of one holds whole sequences
    head_local = set()
    if group.size > 1:
        _check(model, group.size, sequence_parallel)
        # one Cell for every call site (it holds no state), so for_graph switches them all at once
        if sequence_parallel:
            enter, leave = comm.AllGather(group, SEQUENCE_DIM), comm.ReduceScatter(group, SEQUENCE_DIM)
        else:
            enter, leave = comm.CopyToGroup(group), comm.ReduceFromGroup(group)
        head_local = _parallelize(model, sharder, enter, leave, sequence_parallel)
    layouts = {p.name: sharder.layouts.get(p.name, TensorLayout.replicated(tuple(p.shape), sharder.world))
               for p in model.get_parameters()}
    # under sequence parallelism every replicated weight saw only this rank's positions
    partial_grads = [p.name for p in model.trainable_params()
                     if (sequence_parallel and not layouts[p.name].is_sharded) or p.name in head_local]
    return TensorParallelPlan(sequence_parallel, layouts, tuple(partial_grads))


def _parallelize(model: GPTModel, sharder: _Sharder, enter, leave, sequence_parallel: bool) -> set[str]:
    """Cut the weights and set the collectives; returns the replicated parameters applied to this rank's
    heads only (their gradients are parts whatever the activations' layout)."""
    group, tp = sharder.group, sharder.group.size
    embedding = model.embedding.word_embeddings
    sharder.cut(embedding, "weight", 0)
    embedding.vocab_rows = embedding.weight.shape[0]
    embedding.vocab_start = group.rank * embedding.vocab_rows
    embedding.output_comm = leave
    if model.output_layer is not None:
        sharder.cut(model.output_layer, "weight", 0)
    model.output_input_comm = enter
    model.token_loss = VocabParallelCrossEntropy(embedding.vocab_start, group)

    head_local = set()
    for layer in _transformer_layers(model):
        attention = layer.self_attention
        if isinstance(attention, SelfAttention):
            sharder.column_parallel(attention.linear_qkv, enter)
            attention.num_groups //= tp
            head_local |= {attention.q_layernorm.weight.name, attention.k_layernorm.weight.name}
        else:  # MLA: the down-projection and latent norms run where the activations are; heads are split
            sharder.column_parallel(attention.linear_qb, enter)
            sharder.column_parallel(attention.linear_kvb, enter)
            attention.rope_key_comm = enter
        attention.num_heads //= tp
        attention.logit_tracker.heads_comm = comm.AllGather(group, 0)
        sharder.row_parallel(attention.linear_proj, leave)
        if isinstance(layer.mlp, MLP):
            sharder.column_parallel(layer.mlp.linear_fc1, enter)
            sharder.row_parallel(layer.mlp.linear_fc2, leave)
            layer.mlp.ffn //= tp
        elif isinstance(layer.mlp, MoELayer) and sequence_parallel:
            layer.mlp.sequence_shard_sum = comm.ReduceFromGroup(group)
    return head_local
