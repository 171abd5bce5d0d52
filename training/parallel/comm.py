"""Every collective Kiln uses, on any ``Group`` of ``training.parallel.mesh``, differentiable.

Differentiable (MindSpore tensors in and out; each backward is the adjoint collective):

    all_reduce(x, group)                 sum over the group              | backward: all_reduce
    copy_to_group(x, group)              identity                        | backward: all_reduce   (Megatron "f")
    reduce_from_group(x, group)          sum over the group              | backward: identity     (Megatron "g")
    all_gather(x, dim, group)            concat of every rank's x        | backward: reduce_scatter
    reduce_scatter(x, dim, group)        sum, then this rank's slice     | backward: all_gather
    scatter_to_group(x, dim, group)      this rank's slice               | backward: all_gather
    broadcast(x, src, group)             the x of group member ``src``   | backward: sum onto src, zero elsewhere
    all_to_all(x, split_dim, concat_dim, group)          equal splits    | backward: the reverse all_to_all
    all_to_all_single(x, send_counts, recv_counts, group)  dim 0, variable splits | backward: the reverse
    send_recv(x, pair, sender)           the sender's x, on a 2-rank group | backward: the receiver's gradient
                                                                           flows back to the sender
    ring_shift(x, group)                 member r-1's x                  | backward: the ring_shift the other way

The first five, ``all_to_all`` and ``ring_shift`` are also Cells (``AllReduce``, ``CopyToGroup``,
``ReduceFromGroup``, ``AllGather``, ``ReduceScatter``, ``AllToAll``, ``RingShift``), which a layer builds once and
calls: the same Cell runs eagerly and, after ``for_graph(model)``, inside a ``mindspore.jit`` graph (tensor and
context parallelism compile so). The others run eagerly.

"This rank's slice" is chunk ``group.rank`` of ``group.size`` equal chunks; gathers concatenate in group
order (ascending global rank). ``src`` / ``sender`` are indices in the group, not global ranks. Host-side
helpers (numpy, not differentiable): ``all_reduce_array``, ``barrier``, ``share_arrays``; ``Collectives`` is
the trainer's world-group façade.

On a group of one every function is the identity and nothing touches MindSpore's communication, so a
process not started by msrun (a world of one) never initialises it.

Backends, chosen in ``_backend()`` alone: on Ascend the native HCCL collectives. On CPU (MindSpore 2.10, as
measured when this was written; tests/test_parallel_comm.py holds each collective to its result) only AllReduce, the list form of
``mint.distributed.all_gather`` and ``mint.distributed.broadcast`` (global source rank) work on sub-groups,
so reduce-scatter is an all-reduce and a slice, and all-to-all an all-gather and a selection; send/recv are
never used (on CPU ``recv`` can silently return its zero buffer). Tensors must be float32 (AllReduce on CPU
takes float32/float16, broadcast float32/int32); a failed collective can leave the communicator unusable,
so nothing here retries.
"""
from __future__ import annotations

from typing import Callable, Sequence

import mindspore as ms
import mindspore.mint.distributed as dist
import numpy as np
from mindspore import Tensor, nn, ops

from training.parallel.mesh import Group, World, world_group


# ---------------------------------------------------------------------------------------------------------
# Backends: forward-only collectives on a group of two or more ranks


def _part_size(x: Tensor, dim: int, group: Group, what: str) -> int:
    """The length along ``dim`` of each of ``group.size`` equal parts of ``x``."""
    if x.shape[dim] % group.size:
        raise ValueError(f"{what} over group {group.name!r} (size {group.size}): dim {dim} of shape "
                         f"{tuple(x.shape)} does not split into {group.size} equal parts")
    return x.shape[dim] // group.size


def _part(x: Tensor, dim: int, index: int, group: Group, what: str) -> Tensor:
    size = _part_size(x, dim, group, what)
    return ops.narrow(x, dim, index * size, size).contiguous()


class _Backend:
    """The collectives both backends run the same way."""

    def __init__(self):
        self._all_reduce_ops: dict[str, ops.AllReduce] = {}

    def all_reduce_primitive(self, group: Group) -> ops.AllReduce:
        """The group's sum, one primitive per group (it parses in a graph as well)."""
        if group.backend_name not in self._all_reduce_ops:
            self._all_reduce_ops[group.backend_name] = ops.AllReduce(ops.ReduceOp.SUM, group.backend_name)
        return self._all_reduce_ops[group.backend_name]

    def all_reduce(self, x: Tensor, group: Group) -> Tensor:
        return self.all_reduce_primitive(group)(x)

    def broadcast(self, x: Tensor, src: int, group: Group) -> Tensor:
        buffer = x.copy()  # broadcast writes in place, and the caller's tensor is not ours to overwrite
        dist.broadcast(buffer, group.ranks[src], group=group.backend_name)  # src: a GLOBAL rank
        return buffer

    def barrier(self, group: Group) -> None:
        dist.barrier(group=group.backend_name)


class _CpuBackend(_Backend):
    """Built from all-reduce, list all-gather and broadcast, the collectives MindSpore 2.10 runs on CPU."""

    def barrier(self, group: Group) -> None:
        # mint.distributed.barrier returns at once on CPU (measured under msrun: a rank passed it while another
        # slept 4 s before its call); an all-reduce completes only once every member has contributed
        self.all_reduce(Tensor(np.ones(1, np.float32)), group).asnumpy()

    def gather_list(self, x: Tensor, group: Group) -> list[Tensor]:
        parts = [ops.zeros_like(x) for _ in group.ranks]
        dist.all_gather(parts, x.contiguous(), group=group.backend_name)
        return parts

    def all_gather(self, x: Tensor, dim: int, group: Group) -> Tensor:
        return ops.cat(self.gather_list(x, group), dim)

    def reduce_scatter(self, x: Tensor, dim: int, group: Group) -> Tensor:
        return _part(self.all_reduce(x, group), dim, group.rank, group, "reduce_scatter")

    def all_to_all_equal(self, blocks: Tensor, group: Group) -> Tensor:
        gathered = self.gather_list(blocks, group)
        return ops.stack([rank_blocks[group.rank] for rank_blocks in gathered])

    def all_to_all_single(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                          group: Group) -> Tensor:
        # every rank's send counts (float32: the dtype every CPU collective takes; exact below 2**24)
        counts = self.gather_list(Tensor(np.asarray(send_counts, np.float32)), group)
        sent = np.stack([c.asnumpy() for c in counts]).astype(np.int64)  # sent[j, k]: rows rank j sends to k
        if sent[:, group.rank].tolist() != list(recv_counts):
            raise ValueError(f"all_to_all_single over group {group.name!r}: rank {group.global_rank} expects "
                             f"{list(recv_counts)} rows but the group sends it {sent[:, group.rank].tolist()}")
        longest = int(sent.sum(axis=1).max())
        padded = x if x.shape[0] == longest else ops.cat([x, ops.zeros((longest - x.shape[0], *x.shape[1:]),
                                                                        x.dtype)])
        gathered = self.gather_list(padded, group)
        starts = np.cumsum(sent, axis=1) - sent
        pieces = [gathered[j][int(starts[j, group.rank]):int(starts[j, group.rank] + sent[j, group.rank])]
                  for j in range(group.size) if sent[j, group.rank]]
        return ops.cat(pieces) if pieces else ops.zeros((0, *x.shape[1:]), x.dtype)


class _AscendBackend(_Backend):
    """HCCL's own collectives (dim 0 only, so other dims are moved there and back)."""

    def all_gather(self, x: Tensor, dim: int, group: Group) -> Tensor:
        rows = ops.moveaxis(x, dim, 0).contiguous()
        out = ops.zeros((group.size * rows.shape[0], *rows.shape[1:]), x.dtype)
        dist.all_gather_into_tensor(out, rows, group=group.backend_name)
        return ops.moveaxis(out, 0, dim).contiguous()

    def reduce_scatter(self, x: Tensor, dim: int, group: Group) -> Tensor:
        rows = ops.moveaxis(x, dim, 0).contiguous()
        out = ops.zeros((_part_size(x, dim, group, "reduce_scatter"), *rows.shape[1:]), x.dtype)
        dist.reduce_scatter_tensor(out, rows, group=group.backend_name)
        return ops.moveaxis(out, 0, dim).contiguous()

    def all_to_all_equal(self, blocks: Tensor, group: Group) -> Tensor:
        out = ops.zeros_like(blocks)
        dist.all_to_all_single(out, blocks.contiguous(), group=group.backend_name)
        return out

    def all_to_all_single(self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                          group: Group) -> Tensor:
        out = ops.zeros((sum(recv_counts), *x.shape[1:]), x.dtype)
        dist.all_to_all_single(out, x.contiguous(), list(recv_counts), list(send_counts), group=group.backend_name)
        return out


_BACKENDS: dict[str, _Backend] = {}


def _backend() -> _Backend:
    """The one switch between the native (Ascend) and the CPU-built collectives."""
    target = ms.get_context("device_target")
    if target not in _BACKENDS:
        _BACKENDS[target] = _AscendBackend() if target == "Ascend" else _CpuBackend()
    return _BACKENDS[target]


# ---------------------------------------------------------------------------------------------------------
# Differentiable collectives


class _WithBackward(nn.Cell):
    """``forward`` with the hand-written ``backward`` as its gradient, as ``GroupCollective`` (why: there). A Cell
    made per call around two Python functions, so it runs eagerly only."""

    def __init__(self, forward: Callable[[Tensor], Tensor], backward: Callable[[Tensor], Tensor]):
        super().__init__()
        self.forward, self.backward = forward, backward

    def construct(self, x):
        return self.forward(x)

    def bprop(self, x, out, dout):
        return (self.backward(dout),)


def _differentiable(x: Tensor, forward: Callable[[Tensor], Tensor], backward: Callable[[Tensor], Tensor]):
    return _WithBackward(forward, backward)(x)


# The collectives tensor parallelism puts between its matmuls, as Cells built once per call site and group: the
# same Cell runs eagerly and inside mindspore.jit, where only primitives parse (benchmarks/compiled_collectives_probe.py:
# ops.AllReduce on any group; mint.distributed not at all; ops.AllGather on the world group only, on CPU). Eagerly
# its gathers and reduce-scatters go through the backend; ``for_graph`` switches them to all-reduce.


class _BackendTransport(nn.Cell):
    """All-gather and reduce-scatter along ``dim`` as the backend runs them eagerly (on CPU the list-form
    all-gather, on Ascend HCCL's own); they do not parse in a graph."""

    def __init__(self, group: Group, dim: int):
        super().__init__()
        self.group, self.dim = group, dim

    def gather(self, x):
        return _backend().all_gather(x, self.dim, self.group)

    def reduce_scatter(self, x):
        return _backend().reduce_scatter(x, self.dim, self.group)

    def exchange(self, x, split_dim, concat_dim):
        return _exchange_blocks(x, split_dim, concat_dim, self.group)

    def shift(self, x, offset):
        return _gather(x.expand_dims(0), 0, self.group)[(self.group.rank + offset) % self.group.size]


class _AllReduceTransport(nn.Cell):
    """The same from the group's all-reduce alone, which parses in a graph on any group: the gather sums a buffer
    that is zero outside this rank's part, so it moves ``size`` times a gather's bytes; the reduce-scatter
    keeps this rank's part of the sum, as the CPU backend does eagerly."""

    def __init__(self, group: Group, dim: int):
        super().__init__()
        self.sum = _backend().all_reduce_primitive(group)
        self.slice = ops.Slice()  # the primitive: ops.narrow's Python argument check failed to compile in a bprop
        self.rank, self.size, self.dim = group.rank, group.size, dim

    def _gather_along(self, x, dim):
        shape = list(x.shape)
        pieces = []
        if self.rank > 0:
            pieces.append(ops.zeros(tuple(shape[:dim] + [self.rank * shape[dim]] + shape[dim + 1:]), x.dtype))
        pieces.append(x)
        if self.rank < self.size - 1:
            pieces.append(ops.zeros(tuple(shape[:dim] + [(self.size - 1 - self.rank) * shape[dim]] + shape[dim + 1:]),
                                    x.dtype))
        return self.sum(ops.cat(pieces, dim))

    def _member(self, stacked, index):
        """``stacked[index]`` of a tensor stacked over the members on axis 0, as a Slice."""
        shape = stacked.shape
        return self.slice(stacked, (index,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])).squeeze(0)

    def gather(self, x):
        return self._gather_along(x, self.dim)

    def exchange(self, x, split_dim, concat_dim):
        """The all-to-all: every member's ``x`` gathered, then of each its block ``rank`` along ``split_dim``."""
        everyone = self._gather_along(x.expand_dims(0), 0)  # [members, *x.shape]
        part = x.shape[split_dim] // self.size
        axes = range(everyone.ndim)
        size = tuple([1 if a == 0 else part if a == split_dim + 1 else everyone.shape[a] for a in axes])
        return ops.cat([self.slice(everyone, tuple([j if a == 0 else self.rank * part if a == split_dim + 1 else 0
                                                    for a in axes]), size).squeeze(0)
                        for j in range(self.size)], concat_dim)

    def shift(self, x, offset):
        return self._member(self._gather_along(x.expand_dims(0), 0), (self.rank + offset) % self.size)

    def reduce_scatter(self, x):
        shape = list(x.shape)
        part = shape[self.dim] // self.size
        begin = [0] * len(shape)
        begin[self.dim] = self.rank * part
        shape[self.dim] = part
        return self.slice(self.sum(x), tuple(begin), tuple(shape))


class GroupCollective(nn.Cell):
    """A differentiable collective over ``group`` (two or more ranks), called like a function; ``backward``, the
    adjoint collective, is its gradient: MindSpore's own backward of its collectives is missing on CPU
    (AllGather's needs ReduceScatter, which has no CPU kernel), and Megatron's pairs (identity forward,
    all-reduce backward) have none. MindSpore never differentiates the bodies, so the slicing in them is safe
    from 2.10's wrong CPU gradient of a permuted split view. ``backward`` reads only the output gradient, never
    the saved input or output (FSDP's saved-tensor hooks drop those)."""

    def __init__(self, group: Group, dim: int = 0):
        super().__init__()
        if group.size < 2:
            raise ValueError(f"{type(self).__name__} over group {group.name!r} of size {group.size}: a group of "
                             "one needs no collective")
        self.sum = _backend().all_reduce_primitive(group)
        self.transport = _BackendTransport(group, dim)

    def bprop(self, x, out, dout):
        return (self.backward(dout),)


class AllReduce(GroupCollective):
    """Sum over the group | backward: all-reduce."""

    def construct(self, x):
        return self.sum(x)

    def backward(self, g):
        return self.sum(g)


class CopyToGroup(GroupCollective):
    """Identity | backward: all-reduce (Megatron's "f": entering a region where each rank computes a part from
    the same ``x``, e.g. a column-parallel linear, whose gradients with respect to ``x`` add up)."""

    def construct(self, x):
        return x

    def backward(self, g):
        return self.sum(g)


class ReduceFromGroup(GroupCollective):
    """Sum over the group | backward: identity (Megatron's "g": leaving such a region by summing the ranks'
    partial results, e.g. after a row-parallel linear)."""

    def construct(self, x):
        return self.sum(x)

    def backward(self, g):
        return g


class AllGather(GroupCollective):
    """Concat of every rank's ``x`` along ``dim`` | backward: reduce-scatter."""

    def construct(self, x):
        return self.transport.gather(x)

    def backward(self, g):
        return self.transport.reduce_scatter(g)


class ReduceScatter(GroupCollective):
    """Sum over the group, then this rank's part along ``dim`` | backward: all-gather."""

    def construct(self, x):
        return self.transport.reduce_scatter(x)

    def backward(self, g):
        return self.transport.gather(g)


class AllToAll(GroupCollective):
    """``x`` split into ``group.size`` equal blocks along ``split_dim``, block k sent to member k, the blocks
    received concatenated along ``concat_dim`` in group order | backward: the reverse all-to-all."""

    def __init__(self, group: Group, split_dim: int, concat_dim: int):
        super().__init__(group)
        self.split_dim, self.concat_dim = split_dim, concat_dim

    def construct(self, x):
        return self.transport.exchange(x, self.split_dim, self.concat_dim)

    def backward(self, g):
        return self.transport.exchange(g, self.concat_dim, self.split_dim)


class RingShift(GroupCollective):
    """Member r-1's ``x`` on member r (member 0 gets the last's) | backward: the shift the other way. From an
    all-gather and a pick on CPU (send/recv do not work there): each member receives every member's ``x``."""

    def construct(self, x):
        return self.transport.shift(x, -1)

    def backward(self, g):
        return self.transport.shift(g, 1)


def for_graph(cell: nn.Cell) -> None:
    """Make every ``GroupCollective`` in ``cell`` parse inside mindspore.jit: gathers, reduce-scatters, all-to-alls
    and ring shifts become all-reduces (a gather then moves group-size times the bytes, an all-to-all group-size
    times its input). Call before compiling; eager calls after it
    stay right, only slower."""
    for _, sub in cell.cells_and_names():
        if isinstance(sub, GroupCollective) and isinstance(sub.transport, _BackendTransport):
            transport = sub.transport
            sub.transport = _AllReduceTransport(transport.group, transport.dim)


def all_reduce(x: Tensor, group: Group) -> Tensor:
    return x if group.size == 1 else AllReduce(group)(x)


def copy_to_group(x: Tensor, group: Group) -> Tensor:
    return x if group.size == 1 else CopyToGroup(group)(x)


def reduce_from_group(x: Tensor, group: Group) -> Tensor:
    return x if group.size == 1 else ReduceFromGroup(group)(x)


def all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    return x if group.size == 1 else AllGather(group, dim)(x)


def reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    return x if group.size == 1 else ReduceScatter(group, dim)(x)


def _gather(x: Tensor, dim: int, group: Group) -> Tensor:
    return _backend().all_gather(x, dim, group)


def scatter_to_group(x: Tensor, dim: int, group: Group) -> Tensor:
    """This rank's slice of an ``x`` every rank holds whole (e.g. its sequence shard)."""
    if group.size == 1:
        return x
    own = lambda t: _part(t, dim, group.rank, group, "scatter_to_group")  # noqa: E731
    return _differentiable(x, own, lambda g: _gather(g, dim, group))


def broadcast(x: Tensor, src: int, group: Group) -> Tensor:
    """Member ``src``'s ``x`` on every member (the others' ``x`` only gives the shape and dtype)."""
    _check_member(src, group, "broadcast")
    if group.size == 1:
        return x

    def backward(g):
        total = _backend().all_reduce(g, group)
        return total if group.rank == src else ops.zeros_like(g)
    return _differentiable(x, lambda t: _backend().broadcast(t, src, group), backward)


def send_recv(x: Tensor, pair: Group, sender: int) -> Tensor:
    """Point-to-point on a 2-rank group (``DeviceMesh.pair``): the receiver gets the sender's ``x`` (its own
    ``x`` gives the shape and dtype); the sender gets its ``x`` back. A broadcast, because send/recv do not
    work on CPU."""
    if pair.size != 2:
        raise ValueError(f"send_recv needs a 2-rank group, got {pair.name!r} with ranks {pair.ranks}")
    return broadcast(x, sender, pair)


def _exchange_blocks(x: Tensor, split_dim: int, concat_dim: int, group: Group) -> Tensor:
    blocks = ops.stack([_part(x, split_dim, k, group, "all_to_all") for k in range(group.size)])
    received = _backend().all_to_all_equal(blocks, group)  # received[j]: rank j's block for this rank
    return ops.cat([received[j] for j in range(group.size)], concat_dim)


def all_to_all(x: Tensor, split_dim: int, concat_dim: int, group: Group) -> Tensor:
    """Split ``x`` into ``group.size`` equal blocks along ``split_dim``, send block k to member k, and
    concatenate the blocks received along ``concat_dim`` in group order (e.g. Ulysses: sequence shards ↔
    head shards)."""
    return x if group.size == 1 else AllToAll(group, split_dim, concat_dim)(x)


def ring_shift(x: Tensor, group: Group) -> Tensor:
    """One step around the ring of ``group``: member r gets member r-1's ``x`` (member 0 the last's), e.g. a
    K/V block of ring attention (``RingShift``)."""
    return x if group.size == 1 else RingShift(group)(x)


def all_to_all_single(x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group) -> Tensor:
    """Send rows ``[sum(send_counts[:k]), sum(send_counts[:k+1]))`` of ``x`` to member k; receive
    ``recv_counts[j]`` rows from member j, concatenated in group order (e.g. MoE token dispatch)."""
    if len(send_counts) != group.size or len(recv_counts) != group.size:
        raise ValueError(f"all_to_all_single over group {group.name!r} (size {group.size}) needs one count per "
                         f"member, got send_counts {list(send_counts)} and recv_counts {list(recv_counts)}")
    if sum(send_counts) != x.shape[0]:
        raise ValueError(f"all_to_all_single over group {group.name!r}: send_counts {list(send_counts)} sum to "
                         f"{sum(send_counts)}, but x has {x.shape[0]} rows")
    if group.size == 1:
        return x
    return _differentiable(x, lambda t: _backend().all_to_all_single(t, send_counts, recv_counts, group),
                           lambda g: _backend().all_to_all_single(g, recv_counts, send_counts, group))


def _check_member(index: int, group: Group, what: str) -> None:
    if not 0 <= index < group.size:
        raise ValueError(f"{what}: member {index} is not in group {group.name!r} of size {group.size}")


# ---------------------------------------------------------------------------------------------------------
# Host-side helpers (numpy), not differentiable


def all_reduce_array(values: np.ndarray, group: Group) -> np.ndarray:
    """The sum of a small numpy array over ``group`` (metrics, flags): float32 when summed, ``values``
    itself on a group of one."""
    if group.size == 1:
        return values
    return _backend().all_reduce(Tensor(np.asarray(values, dtype=np.float32)), group).asnumpy()


def barrier(group: Group) -> None:
    """Every member reaches this point before any continues."""
    if group.size > 1:
        _backend().barrier(group)


def share_arrays(own: dict[str, np.ndarray], owners: dict[str, int],
                 specs: dict[str, tuple[tuple[int, ...], np.dtype]], group: Group) -> dict[str, np.ndarray]:
    """Every member ends with every array of ``specs`` (name -> shape, dtype); ``owners[name]`` is the one
    member (index in ``group``) that has it in ``own``. One broadcast per owning member, of its arrays' raw
    bytes as int32 (each padded to 4 bytes), so any dtype arrives bit for bit."""
    if group.size == 1:
        return dict(own)
    shared = dict(own)
    for root in sorted(set(owners.values())):
        _check_member(root, group, "share_arrays")
        names = sorted(n for n, r in owners.items() if r == root)
        sizes = [int(np.prod(specs[n][0], dtype=np.int64)) * np.dtype(specs[n][1]).itemsize for n in names]
        padded = [-(-size // 4) * 4 for size in sizes]
        buffer = np.zeros(sum(padded), dtype=np.uint8)
        if group.rank == root:
            offset = 0
            for name, size, room in zip(names, sizes, padded):
                buffer[offset:offset + size] = np.ascontiguousarray(own[name]).reshape(-1).view(np.uint8)
                offset += room
        received = _backend().broadcast(Tensor(buffer.view(np.int32)), root, group).asnumpy().view(np.uint8)
        if group.rank != root:
            offset = 0
            for name, size, room in zip(names, sizes, padded):
                shape, dtype = specs[name]
                shared[name] = received[offset:offset + size].copy().view(dtype).reshape(shape)
                offset += room
    return shared


class Collectives:
    """The world-group collectives the trainer, checkpoints and monitors use."""

    def __init__(self, world: World):
        self.world = world
        self.group = world_group(world)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum a MindSpore tensor over every rank (differentiable)."""
        return all_reduce(tensor, self.group)

    def all_reduce_array(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64/float32 numpy array over ranks (metrics, flags)."""
        return all_reduce_array(values, self.group)

    def barrier(self) -> None:
        barrier(self.group)

    def share_arrays(self, own: dict[str, np.ndarray], owners: dict[str, int],
                     specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """``comm.share_arrays`` over the world: ``owners`` are global ranks."""
        return share_arrays(own, owners, specs, self.group)
