"""Context parallelism (docs/parallelism.md): the ``cp`` ranks of a sample each hold a part
of its sequence, and attention stays exactly causal across the parts.

- Inputs: each cp rank takes its tokens of input_ids, labels, loss_mask and position_ids (made 0..seq-1 when
  the data has none: positions are mandatory, a segment does not start at 0). MindFormers cuts each sequence in
  cp contiguous segments, rank r taking segment r; ``kiln.parallelism.context_parallel_load_balance`` gives it
  segments r and 2·cp-1-r of 2·cp instead (the zig-zag split), so every rank has as many causal (query, key)
  pairs to compute: with contiguous segments the last rank's queries see the whole sequence and the first's only
  its own segment.
- Attention (``ContextAttention``, one per layer): ``ulysses`` exchanges sequence parts for head parts with an
  all-to-all (each rank then attends over the whole sequence with 1/cp of the KV groups) and back; ``colossal`` keeps
  the heads and passes the K/V blocks around the cp ring, one block per step, merged with an online softmax;
  ``hybrid`` does Ulysses inside groups of ``ulysses_degree_in_cp`` consecutive cp ranks and the ring across
  the groups. Masks come from the global token positions of the queries and of each key block, so any split
  is exact; a key block entirely in a query block's future is skipped.
- Loss: each rank's loss is its tokens' loss sum over the token count of the whole micro-batch (summed over
  cp), so the cp ranks' losses, and their gradients, add up to the single-process micro-batch mean. MTP's
  one-token moves of ids, labels and mask take the next segment's first token from the rank holding it; a MoE
  balancing loss is computed from statistics summed over cp, each rank adding 1/cp of it.
- Gradients: cp ranks saw different tokens of the same samples, so their gradients add up; they are reduced
  over dp_shard × cp (the ``fsdp`` group, MindFormers' folding of cp into the FSDP axis) and averaged over dp
  only (training/parallel/fsdp.py).

Compiling: the attention core, the token count and MTP's move are Cells built once (masks and gather columns
fixed by the split), their collectives ``comm``'s Cells, so a context-parallel step runs eagerly or compiled
(``mindspore.jit`` after ``comm.for_graph``) with the same code. The ring's K/V pass (``comm.RingShift``) is an
all-gather on CPU, where MindSpore's send/recv do not work: each step then brings cp − 1 blocks where a true ring
brings one (the benchmark counts both); compiled, that all-gather and Ulysses' all-to-all are all-reduces of
zero-padded buffers (the only collective a CPU graph runs on a sub-group).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from training.config import ConfigError, TrainConfig
from training.model.layers import _bmm, _bmm_transpose_b, _row_sums, cast, expand
from training.parallel import comm
from training.parallel.mesh import DeviceMesh, Group

MASKED = float(np.finfo(np.float32).min)
_bmm_transpose_a = ops.BatchMatMul(transpose_a=True)
_slice = ops.Slice()


def token_positions(seq_length: int, cp: int, rank: int, load_balance: bool) -> np.ndarray:
    """The sequence positions (ascending) cp rank ``rank`` holds of a ``seq_length``-token sample."""
    parts = 2 * cp if load_balance else cp
    if seq_length % parts:
        field = "context_parallel × 2 (context_parallel_load_balance)" if load_balance else "context_parallel"
        raise ConfigError(f"the sequence length {seq_length} does not split into parallelism.{field} = {parts} "
                          f"equal segments: set train_dataset.dataloader.config.seq_length to a multiple of {parts}")
    size = seq_length // parts
    segments = (rank, parts - 1 - rank) if load_balance else (rank,)
    return np.concatenate([np.arange(s * size, (s + 1) * size) for s in segments])


def block_mask(query_positions: np.ndarray, key_positions: np.ndarray, repeats: int) -> np.ndarray | None:
    """Additive causal mask [repeats·queries, keys] (0 = attend), stacked like ``causal_mask``; None when no
    query may attend any of the keys."""
    future = key_positions[None, :] > query_positions[:, None]
    if future.all():
        return None
    return np.tile(np.where(future, MASKED, 0.0).astype(np.float32), (repeats, 1))


class RingAttention(nn.Cell):
    """softmax(q·kᵀ + mask)·v over the key blocks that pass through this rank, merged one at a time (online
    softmax), and each row's log-sum-exp, both as outputs: ``(q, kv) -> (out, lse)``.

    q: [batch, groups, rows, dim] (rows = heads per group × queries, stacked like the masks); ``kv``: this rank's
    block, k and v concatenated on the last axis; ``shift(block)`` returns the next block (a ring step: a
    ``comm.RingShift``, or None on a ring of one); ``masks[j]``: the additive mask of the j-th block (None:
    skipped, though still passed on), fixed when built. The first block (this rank's own) must let every row
    attend something. Per row: running maximum m, running sum l of exp(s − m) and running output o, rescaled by
    exp(m_old − m_new) when the maximum grows.

    The backward is hand-written (FlashAttention's, block by block): autograd of the merge would keep every
    block's probabilities, and it would differentiate a ring step only on the ranks whose queries use the block
    it brings, leaving the others out of that step's collective. It reads the log-sum-exp from the outputs, as a
    graph's bprop sees only inputs, outputs and output gradients."""

    def __init__(self, masks: list[np.ndarray | None], softmax_dtype, shift: Callable[[Tensor], Tensor] | None):
        super().__init__()
        if masks[0] is None:
            raise ValueError("ring attention: the first key block (this rank's own) must be attended")
        self.masks = tuple(None if mask is None else Tensor(mask, softmax_dtype) for mask in masks)
        self.softmax_dtype, self.shift = softmax_dtype, shift

    def _scores(self, q: Tensor, k: Tensor, j: int) -> Tensor:
        scores = cast(_bmm_transpose_b(q, k), self.softmax_dtype)
        return scores + expand(self.masks[j], scores)

    @staticmethod
    def _split_channels(block: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """The first ``dim`` channels of ``block`` and the rest, as Slices: ops.split (a function with Python
        argument checks) did not compile in a bprop."""
        *leading, width = block.shape
        corner = (0,) * len(leading)
        return (_slice(block, corner + (0,), tuple(leading) + (dim,)),
                _slice(block, corner + (dim,), tuple(leading) + (width - dim,)))

    def construct(self, q, kv):
        dim = q.shape[-1]
        k, v = self._split_channels(kv, dim)
        scores = self._scores(q, k, 0)
        m = scores.max(axis=-1, keepdims=True)
        p = ops.exp(scores - expand(m, scores))
        l, o = _row_sums(p), _bmm(cast(p, v.dtype), v)
        block = kv
        for j in range(1, len(self.masks)):
            block = self.shift(block)
            if self.masks[j] is not None:
                k, v = self._split_channels(block, dim)
                scores = self._scores(q, k, j)
                new_m = ops.maximum(m, scores.max(axis=-1, keepdims=True))
                p = ops.exp(scores - expand(new_m, scores))
                rescale = ops.exp(m - new_m)
                l = l * rescale + _row_sums(p)
                o = o * expand(cast(rescale, o.dtype), o) + _bmm(cast(p, v.dtype), v)
                m = new_m
            else:  # a block nobody here attends still takes its ring step: a graph would drop the unused collective
                o = ops.depend(o, block)
        return o / expand(cast(l, o.dtype), o), m + ops.log(l)

    def bprop(self, q, kv, out, dout):
        """With P = exp(s − lse): dv = Pᵀ·dout, dP = dout·vᵀ, ds = P ∘ (dP − rowsum(dout ∘ out) + dlse),
        dq = Σ ds·k, dk = dsᵀ·q. The key blocks go round the ring again, each with the gradient accumulated for
        it so far, which every rank adds its queries' part to; one more step brings each block's gradient home."""
        (o, lse), (do, dlse) = out, dout
        dim = q.shape[-1]
        delta = cast(_row_sums(do * o), self.softmax_dtype) - dlse
        dq = ops.zeros_like(q)
        block, grad = kv, ops.zeros_like(kv)
        for j in range(len(self.masks)):
            if j:  # the block and its gradient so far travel together: one collective per step
                block, grad = self._split_channels(self.shift(ops.cat((block, grad), axis=-1)), kv.shape[-1])
            if self.masks[j] is not None:
                k, v = self._split_channels(block, dim)
                scores = self._scores(q, k, j)
                p = ops.exp(scores - expand(lse, scores))
                dp = cast(_bmm_transpose_b(do, v), self.softmax_dtype)
                ds = cast(p * (dp - expand(delta, dp)), q.dtype)
                dq = dq + _bmm(ds, k)
                dv = _bmm_transpose_a(cast(p, do.dtype), do)
                grad = grad + ops.cat((_bmm_transpose_a(ds, q), cast(dv, q.dtype)), axis=-1)
        return dq, grad if len(self.masks) == 1 else self.shift(grad)


class ContextAttention(nn.Cell):
    """The attention core of one layer under context parallelism: ``(q, k, v) -> out`` in place of
    softmax(q·kᵀ + causal mask)·v, built once per layer (its masks and collectives fixed), so the same Cell runs
    eagerly and in a compiled step (after ``comm.for_graph``).

    q: [batch, groups, heads_per_group, queries, dim], scaled; k: [batch, groups, keys, dim]; v: [batch,
    groups, keys, v_dim]; out: [batch, groups, heads_per_group, queries, v_dim], all on this rank's tokens.
    Qwen3's GQA has groups = KV heads; MLA has groups = heads and one head per group."""

    def __init__(self, plan: "ContextParallelPlan", softmax_dtype, heads_per_group: int):
        super().__init__()
        ulysses, ring = plan.ulysses_group, plan.ring_group
        exchange = ulysses.size > 1  # sequence parts <-> head parts over the Ulysses group
        self.q_to_heads = comm.AllToAll(ulysses, 1, 3) if exchange else None
        self.kv_to_heads = comm.AllToAll(ulysses, 1, 2) if exchange else None
        self.out_to_sequence = comm.AllToAll(ulysses, 3, 1) if exchange else None
        self.ring = RingAttention(plan.ring_masks(heads_per_group), softmax_dtype,
                                  comm.RingShift(ring) if ring.size > 1 else None)
        self.tokens = plan.seq_length // plan.cp  # each rank's, which the masks were built for
        self.seq_length = plan.seq_length

    def construct(self, q, k, v):
        batch, _, per_group, queries, dim = q.shape
        if queries != self.tokens:
            raise ValueError(f"context-parallel attention: {queries} tokens on this rank, but its masks were built "
                             f"for {self.tokens} (train_dataset.dataloader.config.seq_length {self.seq_length})")
        kv = ops.cat((k, v), axis=-1)
        if self.q_to_heads is not None:  # the whole (Ulysses group's) sequence, groups/u heads
            q, kv = self.q_to_heads(q), self.kv_to_heads(kv)
        groups, v_dim = q.shape[1], v.shape[-1]
        out, _ = self.ring(q.reshape(batch, groups, per_group * q.shape[3], dim), kv)
        out = out.reshape(batch, groups, per_group, -1, v_dim)
        if self.out_to_sequence is not None:  # and back: this rank's sequence part, all its groups
            out = self.out_to_sequence(out)
        return out


class LossTokenCount(nn.Cell):
    """The micro-batch's loss token count, summed over the cp ranks holding its other tokens (a constant of the
    data: no gradient flows through it)."""

    def __init__(self, cp_group: Group):
        super().__init__()
        self.sum = comm.AllReduce(cp_group)

    def construct(self, count):
        return ops.stop_gradient(self.sum(count))


class MoveLeftAcrossSegments(nn.Cell):
    """MTP's move of [batch, tokens] data one token left (position p takes p+1's, the last 0) on this rank's
    tokens: the next token of a segment's last is another rank's, so the cp ranks' tokens are gathered (one
    all-gather for all the tensors, as float32: exact for ids below 2**24) and each picks its tokens' next, at
    columns fixed when built."""

    def __init__(self, plan: "ContextParallelPlan"):
        super().__init__()
        seq = plan.seq_length
        held = np.concatenate(plan.positions(seq))            # the global position of each gathered column
        column_of = np.empty(seq + 1, np.int64)
        column_of[held], column_of[seq] = np.arange(seq), seq  # position seq: the zero column appended
        own = token_positions(seq, plan.cp, plan.cp_group.rank, plan.load_balance)
        self.columns = Tensor(column_of[own + 1].astype(np.int32))
        self.gather = comm.AllGather(plan.cp_group, 2) if plan.cp > 1 else None

    def construct(self, *tensors):
        stacked = ops.stack([cast(x, ms.float32) for x in tensors])
        gathered = stacked if self.gather is None else ops.stop_gradient(self.gather(stacked))
        padded = ops.cat((gathered, ops.zeros((len(tensors), gathered.shape[1], 1), ms.float32)), axis=2)
        rolled = ops.unstack(ops.gather(padded, self.columns, 2))
        return tuple([cast(rolled[i], tensors[i].dtype) for i in range(len(tensors))])


class ContextParallelPlan:
    """What context parallelism needs at run time: the cp, Ulysses and ring groups of this rank, which tokens it
    holds, and the slicing of each micro-batch."""

    def __init__(self, mesh: DeviceMesh, method: str, ulysses_degree: int, load_balance: bool, seq_length: int):
        self.cp_group = mesh.group("cp")
        self.cp = self.cp_group.size
        self.load_balance = load_balance
        self.seq_length = seq_length
        u = {"ulysses": self.cp, "colossal": 1, "hybrid": ulysses_degree}[method]
        self.ulysses_degree = u
        members, index = self.cp_group.ranks, self.cp_group.rank
        # Ulysses inside runs of u consecutive cp ranks, the ring across the runs (rank i of every run)
        self.ulysses_group = self._subgroup(mesh, "cp_ulysses", members[index - index % u:index - index % u + u])
        self.ring_group = self._subgroup(mesh, "cp_ring", members[index % u::u])

    def _subgroup(self, mesh: DeviceMesh, name: str, ranks: tuple[int, ...]) -> Group:
        return self.cp_group if len(ranks) == self.cp else mesh.sub_group(name, tuple(ranks))

    def positions(self, seq_length: int) -> list[np.ndarray]:
        """Each cp member's token positions, in cp group order."""
        return [token_positions(seq_length, self.cp, r, self.load_balance) for r in range(self.cp)]

    def ring_positions(self, seq_length: int) -> list[np.ndarray]:
        """The token positions each ring member holds inside attention: after the Ulysses exchange, those of
        its whole Ulysses group (u consecutive cp ranks), in group order."""
        return _ring_positions(seq_length, self.cp, self.ulysses_degree, self.load_balance)

    def ring_masks(self, repeats: int) -> list[np.ndarray | None]:
        """The additive mask of each ring step's key block for this rank's queries (``block_mask``, heads stacked
        ``repeats`` times); ring step j holds the K/V of ring member (rank - j) mod size, step 0 this rank's own
        (its diagonal). Fixed by the split alone: they mask by the tokens' places in the sequence, which the
        split decides, not by the data's position ids (those only turn the rotary tables, and document masks,
        the one thing that would vary per batch, are refused under context parallelism)."""
        positions, ring = self.ring_positions(self.seq_length), self.ring_group
        return [block_mask(positions[ring.rank], positions[(ring.rank - j) % ring.size], repeats)
                for j in range(ring.size)]

    # ---- what a model's context-parallel plan (its ``parallelize_context``) sets in its modules ----
    def attention(self, softmax_dtype, heads_per_group: int) -> ContextAttention:
        """An attention layer's core over the cp ranks' tokens."""
        return ContextAttention(self, softmax_dtype, heads_per_group)

    def loss_token_count(self) -> LossTokenCount:
        return LossTokenCount(self.cp_group)

    def move_left(self) -> MoveLeftAcrossSegments:
        return MoveLeftAcrossSegments(self)

    def sum_over_cp(self) -> nn.Cell:
        """A sum over the cp ranks (forward all-reduce, backward all-reduce: every rank's part feeds the total)."""
        return comm.AllReduce(self.cp_group)

    def shard_inputs(self, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        """This rank's tokens of (input_ids, labels, loss_mask, position_ids, attention_mask) of the whole
        samples; position ids 0..seq-1 when the data has none."""
        input_ids, labels, loss_mask, position_ids, attention_mask = inputs
        if attention_mask is not None:
            raise ConfigError("parallelism.context_parallel > 1 masks attention causally across the segments only, "
                              "but the data carries an attention mask (document boundaries): set "
                              "train_dataset.dataloader.config.reset_attention_mask and "
                              "create_compressed_eod_mask to false")
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = Tensor(np.tile(np.arange(seq, dtype=np.int32), (batch, 1)))
        own = Tensor(token_positions(seq, self.cp, self.cp_group.rank, self.load_balance).astype(np.int32))
        return tuple(ops.gather(x, own, 1) for x in (input_ids, labels, loss_mask, position_ids)) + (None,)


@lru_cache(maxsize=64)
def _ring_positions(seq_length: int, cp: int, u: int, load_balance: bool) -> list[np.ndarray]:
    per_rank = [token_positions(seq_length, cp, r, load_balance) for r in range(cp)]
    return [np.concatenate(per_rank[g * u:(g + 1) * u]) for g in range(cp // u)]


def check_context_parallel(config: TrainConfig, model_config) -> None:
    """Every reason this run's model (its ``GPTConfig``) or data cannot be split along the sequence, each
    naming its field."""
    p, c = config.parallelism, model_config
    problems = []
    method = p.context_parallel_method
    degree = {"ulysses": p.context_parallel, "hybrid": p.ulysses_degree_in_cp}.get(method) or 1
    groups = c.num_key_value_heads // p.tensor_parallel
    heads = c.num_attention_heads // p.tensor_parallel
    if degree > 1 and (groups % degree or heads % degree):
        problems.append(f"parallelism.context_parallel_method = {method!r} splits the attention heads over the "
                        f"Ulysses degree {degree}, but model.num_attention_heads ({c.num_attention_heads}) and "
                        f"model.num_key_value_heads ({c.num_key_value_heads}) per tensor-parallel rank "
                        f"(tensor_parallel {p.tensor_parallel}) are not both divisible by it")
    if config.kiln.train_state.max_attention_logit:
        problems.append("kiln.train_state.max_attention_logit with parallelism.context_parallel > 1: the "
                        "context-parallel attention never holds a layer's whole score matrix")
    loader = config.train_dataset.dataloader
    if getattr(getattr(loader, "config", None), "document_attention", False):
        problems.append("train_dataset.dataloader.config: document attention masks (reset_attention_mask / "
                        "create_compressed_eod_mask) with parallelism.context_parallel > 1: only the causal mask "
                        "is split across segments (as in MindFormers)")
    if problems:
        raise ConfigError(*problems)


def apply_context_parallel(model, mesh: DeviceMesh, config: TrainConfig) -> ContextParallelPlan:
    """Split ``model``'s attention, its losses' token count, MTP's moves and the MoE balancing statistics over the
    cp ranks, as its ``parallelize_context`` says."""
    check_context_parallel(config, model.config)
    p = config.parallelism
    plan = ContextParallelPlan(mesh, p.context_parallel_method, p.ulysses_degree_in_cp or 1,
                               config.kiln.parallelism.context_parallel_load_balance, model.config.seq_length)
    model.parallelize_context(plan)
    return plan
