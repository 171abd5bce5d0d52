"""The few collectives the trainer needs, behind one small interface.

Under msrun, ``mindspore.communication.init()`` picks the device's collective library. On CPU only
AllReduce, AllGather and Broadcast (world group) work in MindSpore 2.10, so everything here is built
from AllReduce; on Ascend the same calls go to HCCL. A single process (no msrun) gets a world of one
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
