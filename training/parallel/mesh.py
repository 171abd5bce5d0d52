"""The world as MindFormers factorises it, and the named process groups every strategy communicates over.

``ParallelDims`` is pure arithmetic (no MindSpore): the degrees of ``world = pp × dp_replicate × dp_shard ×
cp × tp`` (docs/parallelism.md), rank ↔ coordinates, and the ranks of every named group.
``DeviceMesh`` is one rank's view of it under msrun: it creates each MindSpore communicator this rank
belongs to once and hands out ``Group`` objects, which ``training.parallel.comm`` takes.

Rank order is C-order over ``AXES`` (pp outermost, tp innermost), MindFormers' dense mesh, so
``rank = (((pp·R + r)·S + s)·C + c)·T + t``. Group names:

- one per axis: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` — the ranks differing only there;
- ``dp`` = dp_replicate × dp_shard: the ranks reading different samples (MindFormers' "batch" axis of its
  data-loading mesh); a rank's position in it is its data shard;
- ``fsdp`` = dp_shard × cp: what FSDP shards parameters over (MindFormers folds CP into the FSDP axis: CP
  ranks see different tokens of the same samples, so their gradients differ and are reduced like DP's);
- ``batch`` and ``loss`` (the same ranks) = dp_replicate × dp_shard × cp: every rank holding a different
  part of the global batch's tokens, over which losses and token counts are summed;
- ``ep`` / ``efsdp``: expert parallelism carved out of the dp_shard × cp × tp block (MindFormers' sparse
  mesh (pp, dp_replicate, efsdp, ep), ep innermost); ``expert_dp`` = dp_replicate × efsdp: the ranks holding
  the same experts with other tokens, over which expert weights' gradients are summed;
- ``dense_shard`` / ``dense_replicate``: what FSDP cuts dense weights over (``dense_fsdp_shard_size``
  consecutive ranks of the dp_shard × cp block; the whole block by default) and the ranks holding the same
  chunk (dp_replicate × the rest of the block);
- ``world``: every rank.
Members of a group are listed in ascending rank order, which is also the C-order of its axes: a rank's
index in a group is its flattened coordinate on those axes.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Optional

from training.config import ConfigError, ParallelismConfig, TrainingConfig

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # rank order, outermost first
# group name -> the axes its members differ on (ep/efsdp are not unions of axes: see ParallelDims.group_key)
AXIS_GROUPS = {
    "pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",), "tp": ("tp",),
    "dp": ("dp_replicate", "dp_shard"), "fsdp": ("dp_shard", "cp"),
    "batch": ("dp_replicate", "dp_shard", "cp"), "loss": ("dp_replicate", "dp_shard", "cp"),
    "world": AXES,
}
GROUP_NAMES = (*AXIS_GROUPS, "ep", "efsdp", "expert_dp", "dense_shard", "dense_replicate")


def launched_by_msrun() -> bool:
    return "MS_ROLE" in os.environ


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` workers (a process not started by msrun is rank 0 of 1)."""
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


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of each parallelism; ``world == pp · dp_replicate · dp_shard · cp · tp``, ``ep`` divides
    ``dp_shard · cp · tp`` and ``dense_shard`` (None: all of it) divides ``dp_shard · cp``. Build it with
    ``from_config`` (which checks and explains) or directly."""
    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dense_shard: Optional[int] = None

    def __post_init__(self):
        sizes = self.axis_sizes
        if any(size < 1 for size in (*sizes, self.ep)) or math.prod(sizes) != self.world:
            raise ValueError(f"ParallelDims: pp {self.pp} × dp_replicate {self.dp_replicate} × dp_shard "
                             f"{self.dp_shard} × cp {self.cp} × tp {self.tp} = {math.prod(sizes)}, "
                             f"not the world size {self.world}")
        if (self.dp_shard * self.cp * self.tp) % self.ep:
            raise ValueError(f"ParallelDims: ep {self.ep} does not divide dp_shard {self.dp_shard} × cp "
                             f"{self.cp} × tp {self.tp} = {self.dp_shard * self.cp * self.tp}")
        if self.dense_shard is not None and (self.dense_shard < 1 or (self.dp_shard * self.cp) % self.dense_shard):
            raise ValueError(f"ParallelDims: dense_shard {self.dense_shard} does not divide dp_shard "
                             f"{self.dp_shard} × cp {self.cp} = {self.dp_shard * self.cp}")

    @classmethod
    def from_config(cls, parallelism: ParallelismConfig, world_size: int) -> "ParallelDims":
        """MindFormers' factorisation: dp = world / (tp·pp·cp); ``data_parallel_shard`` -1 shards over all of
        dp (dp_replicate 1), k > 0 shards over k and replicates over dp / k (HSDP)."""
        p = parallelism
        degrees = {"tensor_parallel": p.tensor_parallel, "pipeline_parallel": p.pipeline_parallel,
                   "context_parallel": p.context_parallel, "expert_parallel": p.expert_parallel}
        for name, degree in degrees.items():
            if degree < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {degree}")
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        model_parallel = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
        product = (f"tensor_parallel {p.tensor_parallel} × pipeline_parallel {p.pipeline_parallel} × "
                   f"context_parallel {p.context_parallel}")
        if world_size % model_parallel:
            raise ConfigError(f"parallelism: {product} = {model_parallel} does not divide the {world_size} workers")
        dp = world_size // model_parallel
        if p.data_parallel_shard == -1:
            dp_shard = dp
        elif p.data_parallel_shard > 0 and dp % p.data_parallel_shard == 0:
            dp_shard = p.data_parallel_shard
        else:
            raise ConfigError(f"parallelism.data_parallel_shard {p.data_parallel_shard} does not divide the "
                              f"data-parallel degree {dp} = {world_size} workers / ({product})")
        shard_block = dp_shard * p.context_parallel * p.tensor_parallel
        if shard_block % p.expert_parallel:
            raise ConfigError(f"parallelism.expert_parallel {p.expert_parallel} does not divide data-parallel "
                              f"shards {dp_shard} × context_parallel {p.context_parallel} × tensor_parallel "
                              f"{p.tensor_parallel} = {shard_block}")
        dense = p.dense_fsdp_shard_size
        if dense is not None and (dense < 1 or (dp_shard * p.context_parallel) % dense):
            raise ConfigError(f"parallelism.dense_fsdp_shard_size {dense} does not divide data-parallel shards "
                              f"{dp_shard} × context_parallel {p.context_parallel} = {dp_shard * p.context_parallel}")
        return cls(world=world_size, pp=p.pipeline_parallel, dp_replicate=dp // dp_shard, dp_shard=dp_shard,
                   cp=p.context_parallel, tp=p.tensor_parallel, ep=p.expert_parallel, dense_shard=dense)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def dp(self) -> int:
        """Ranks reading different samples: dp_replicate · dp_shard."""
        return self.dp_replicate * self.dp_shard

    # whether each parallelism is on (its degree above 1), so callers ask by name instead of comparing degrees
    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def describe(self) -> str:
        """The factorisation in one line, e.g. "4 workers = pp 1 × dp_replicate 2 × dp_shard 2 × cp 1 × tp 1"."""
        return f"{self.world} workers = " + " × ".join(f"{axis} {size}" for axis, size in zip(AXES, self.axis_sizes))

    def check_batch(self, training: TrainingConfig) -> int:
        """The micro-batches per step (gradient accumulation steps): global_batch_size / (local_batch_size ·
        dp), which must be a whole number."""
        per_step = training.local_batch_size * self.dp
        if training.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={training.global_batch_size} is not divisible by "
                f"training.local_batch_size={training.local_batch_size} × data_parallel={self.dp} = {per_step} "
                f"(data_parallel = {self.world} workers / (tensor_parallel {self.tp} × pipeline_parallel "
                f"{self.pp} × context_parallel {self.cp}))")
        return training.global_batch_size // per_step

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each of ``AXES``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")
        coords = {}
        for axis, size in reversed(tuple(zip(AXES, self.axis_sizes))):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at ``coords``, one keyword per axis of ``AXES``."""
        if set(coords) != set(AXES):
            raise ValueError(f"rank_of needs exactly the coordinates {AXES}, got {tuple(coords)}")
        rank = 0
        for axis, size in zip(AXES, self.axis_sizes):
            if not 0 <= coords[axis] < size:
                raise ValueError(f"coordinate {axis}={coords[axis]} is outside 0..{size - 1}")
            rank = rank * size + coords[axis]
        return rank

    def group_key(self, name: str, rank: int) -> tuple[int, ...]:
        """What members of group ``name`` share: ``rank``'s group is every rank with the same key."""
        c = self.coords(rank)
        if name in AXIS_GROUPS:
            return tuple(c[axis] for axis in AXES if axis not in AXIS_GROUPS[name])
        if name in ("ep", "efsdp", "expert_dp"):
            # index in the dp_shard × cp × tp block, C-order; ep takes its innermost factor
            block = (c["dp_shard"] * self.cp + c["cp"]) * self.tp + c["tp"]
            if name == "expert_dp":
                return c["pp"], block % self.ep
            return c["pp"], c["dp_replicate"], block // self.ep if name == "ep" else block % self.ep
        if name in ("dense_shard", "dense_replicate"):
            # index in the dp_shard × cp block, C-order; the dense shard group takes its innermost factor
            block, size = c["dp_shard"] * self.cp + c["cp"], self.dense_shard or self.dp_shard * self.cp
            if name == "dense_shard":
                return c["pp"], c["dp_replicate"], block // size, c["tp"]
            return c["pp"], block % size, c["tp"]
        raise ValueError(f"unknown group {name!r}; the groups are {', '.join(GROUP_NAMES)}")

    def group_ranks(self, name: str, rank: int) -> tuple[int, ...]:
        """The members of ``rank``'s group ``name``, ascending."""
        key = self.group_key(name, rank)
        return tuple(r for r in range(self.world) if self.group_key(name, r) == key)

    def group_index(self, name: str, rank: int) -> int:
        """``rank``'s index in its group ``name`` (the chunk it holds of what that group shards)."""
        return self.group_ranks(name, rank).index(rank)

    def data_shard_index(self, rank: int) -> int:
        """Which of the ``data_shard_count`` shards of each global batch ``rank`` reads: its position in the
        ``dp`` group, MindFormers' (rank mod world/pp) // (tp·cp)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    @property
    def data_shard_count(self) -> int:
        return self.dp


@dataclass(frozen=True)
class Group:
    """A process group as ``training.parallel.comm`` uses it.

    ``name`` is the mesh's name for it ("tp", "dp", ...), ``ranks`` its members (global ranks, ascending),
    ``rank`` this process's index among them. ``backend_name`` is the MindSpore group the collectives run
    on: the world group when the group is the whole world, a group made with ``create_group`` for a proper
    sub-group, and None for a group of one, on which every collective is the identity.
    """
    name: str
    ranks: tuple[int, ...]
    rank: int
    backend_name: Optional[str]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]


def world_group(world: World) -> Group:
    """The group of every rank (no communicator for a world of one)."""
    backend_name = None
    if world.size > 1:
        from mindspore.communication import GlobalComm

        backend_name = GlobalComm.WORLD_COMM_GROUP
    return Group("world", tuple(range(world.size)), world.rank, backend_name)


# MindSpore's communicators of this process by member ranks: a process may build several meshes (one per training
# run), and MindSpore refuses a group name created twice; the name comes from the members, the same on each
_COMMUNICATORS: dict[tuple[int, ...], str] = {}


class DeviceMesh:
    """One rank's named groups over ``dims``; every communicator it needs is created here, once.

    MindSpore 2.10 on CPU (measured under msrun, 4 workers): ``create_group`` must be called by the members
    of a group and only by them — a non-member's call raises "Communicator of group ... inited: failed" and
    can leave the process's communication unusable; members need not create it in step with each other
    (it returns before the others have called it), nor with ranks outside it. So each rank creates only its
    own groups. Groups with the same members (e.g. "dp" and "loss" when cp = 1) share one communicator,
    named after its members — the same name on every member, and in every mesh of the process.
    """

    def __init__(self, dims: ParallelDims, rank: int):
        self.dims, self.rank = dims, rank
        self._groups = {name: self._make_group(name, dims.group_ranks(name, rank)) for name in GROUP_NAMES}

    def group(self, name: str) -> Group:
        if name not in self._groups:
            raise ValueError(f"unknown group {name!r}; the mesh has {', '.join(self._groups)}")
        return self._groups[name]

    def pair(self, peer: int) -> Group:
        """The 2-rank group of this rank and ``peer``, for point-to-point transfers (``comm.send_recv``);
        both ranks must call this."""
        if peer == self.rank or not 0 <= peer < self.dims.world:
            raise ValueError(f"rank {self.rank} cannot pair with rank {peer} in a world of {self.dims.world}")
        ranks = tuple(sorted((self.rank, peer)))
        return self._make_group("pair", ranks)

    def sub_group(self, name: str, ranks: tuple[int, ...]) -> Group:
        """A group of ``ranks`` (ascending, this rank among them) that is no union of axes, e.g. context
        parallelism's Ulysses and ring groups inside ``cp``; every member must call this."""
        if self.rank not in ranks or list(ranks) != sorted(set(ranks)):
            raise ValueError(f"rank {self.rank} cannot make group {name!r} of ranks {ranks}")
        return self._make_group(name, tuple(ranks))

    @property
    def data_shard_index(self) -> int:
        return self.dims.data_shard_index(self.rank)

    @property
    def data_shard_count(self) -> int:
        return self.dims.data_shard_count

    def _make_group(self, name: str, ranks: tuple[int, ...]) -> Group:
        return Group(name, ranks, ranks.index(self.rank), self._communicator(ranks))

    def _communicator(self, ranks: tuple[int, ...]) -> Optional[str]:
        if len(ranks) == 1:
            return None  # MindSpore refuses a group of one; nothing to communicate
        if len(ranks) == self.dims.world:
            return world_group(World(self.rank, self.dims.world)).backend_name
        if ranks not in _COMMUNICATORS:  # one per member set and process, whichever mesh asks first
            from mindspore.communication import create_group

            # named by a digest of the members: short whatever the group's size (HCCL caps name length)
            _COMMUNICATORS[ranks] = "kiln_" + hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
            create_group(_COMMUNICATORS[ranks], list(ranks))
        return _COMMUNICATORS[ranks]
