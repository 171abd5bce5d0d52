"""The few collectives the trainer needs, behind one small interface.

Under msrun, ``mindspore.communication.init()`` picks the device's collective library. On CPU only
AllReduce, AllGather and Broadcast (world group) work in MindSpore 2.10 — AllReduce for float32/float16
only, Broadcast for float32/int32 — so sums go through AllReduce and bit-exact copies through an
int32 Broadcast; on Ascend the same calls go to HCCL. A single process (no msrun) gets a world of one
and every collective is the identity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np


def launched_by_msrun() -> bool:
    return "MS_ROLE" in os.environ


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world() -> World:
    """Initialise communication when launched by msrun; rank 0 is decided after ``init()``.

    msrun's scheduler process also runs the script (with RANK_ID=0), so only ``get_rank()`` after
    ``init()`` tells the workers apart; the scheduler never returns from ``init()``.
    """
    if not launched_by_msrun():
        return World(rank=0, size=1)
    from mindspore.communication import get_group_size, get_rank, init

    init()
    return World(rank=get_rank(), size=get_group_size())


class Collectives:
    def __init__(self, world: World):
        self.world = world
        if world.size > 1:
            from mindspore import ops

            self._all_reduce_sum = ops.AllReduce(ops.ReduceOp.SUM)

    def all_reduce_sum(self, tensor):
        """Sum a MindSpore tensor over every rank (differentiable)."""
        if self.world.size == 1:
            return tensor
        return self._all_reduce_sum(tensor)

    def average_gradients(self, grads: tuple) -> tuple:
        """Mean of each gradient over ranks, as one AllReduce of one flat buffer: a collective's
        fixed cost (a CPU round trip through the scheduler, an HCCL launch) dominates for small
        tensors, and a model has dozens of them."""
        if self.world.size == 1:
            return grads
        from mindspore import ops

        flat = self._all_reduce_sum(ops.cat([g.reshape(-1) for g in grads])) * (1.0 / self.world.size)
        pieces = ops.split(flat, [int(g.size) for g in grads])
        return tuple(piece.reshape(g.shape) for piece, g in zip(pieces, grads))

    def all_reduce_array(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float64/float32 numpy array over ranks (metrics, flags)."""
        if self.world.size == 1:
            return values
        from mindspore import Tensor

        return self._all_reduce_sum(Tensor(np.asarray(values, dtype=np.float32))).asnumpy()

    def barrier(self) -> None:
        """Every rank reaches this point before any continues (an AllReduce of one element)."""
        self.all_reduce_array(np.ones(1, dtype=np.float32))

    def share_arrays(self, own: dict[str, np.ndarray], owners: dict[str, int],
                     specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """Every rank ends with every array of ``specs`` (name -> shape, dtype); ``owners[name]`` is the one
        rank that has it in ``own``. One Broadcast per owning rank, of its arrays' raw bytes as int32
        (each padded to 4 bytes), so any dtype arrives bit for bit."""
        if self.world.size == 1:
            return dict(own)
        from mindspore import Tensor, ops

        shared = dict(own)
        for root in sorted(set(owners.values())):
            names = sorted(n for n, r in owners.items() if r == root)
            sizes = [int(np.prod(specs[n][0], dtype=np.int64)) * np.dtype(specs[n][1]).itemsize for n in names]
            padded = [-(-size // 4) * 4 for size in sizes]
            buffer = np.zeros(sum(padded), dtype=np.uint8)
            if self.world.rank == root:
                offset = 0
                for name, size, room in zip(names, sizes, padded):
                    buffer[offset:offset + size] = np.ascontiguousarray(own[name]).reshape(-1).view(np.uint8)
                    offset += room
            received = ops.Broadcast(root)((Tensor(buffer.view(np.int32)),))[0].asnumpy().view(np.uint8)
            if self.world.rank != root:
                offset = 0
                for name, size, room in zip(names, sizes, padded):
                    shape, dtype = specs[name]
                    shared[name] = received[offset:offset + size].copy().view(dtype).reshape(shape)
                    offset += room
        return shared
