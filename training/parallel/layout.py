"""How a tensor is laid out over ranks: the contract between the parallel strategies, which decide it, and
checkpoints, which record it in MindFormers' metadata.json schema (reference §2.4) and reshard from it.

A tensor of ``global_shape`` is cut into an even grid of chunks, ``fragmentations[d]`` along dim ``d``;
chunk ``k`` is the k-th cell of that grid in row-major order (last dim fastest), MindFormers'
``global_offset`` index. Every rank holds exactly one chunk of every tensor it has; ranks holding the same
chunk are its replicas. A replicated tensor is the grid of one chunk held by every rank. A rank may hold
none of a tensor (chunk None: pipeline parallelism places each layer on the ranks of one stage).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorLayout:
    global_shape: tuple[int, ...]
    fragmentations: tuple[int, ...]  # chunks along each dim; each dim divides evenly
    chunk_of_rank: tuple[int | None, ...]  # chunk index held by rank r (None: nothing), for r in range(world size)

    def __post_init__(self):
        if len(self.fragmentations) != len(self.global_shape):
            raise ValueError(f"fragmentations {self.fragmentations} do not match shape {self.global_shape}")
        for size, parts in zip(self.global_shape, self.fragmentations):
            if parts < 1 or size % parts:
                raise ValueError(f"shape {self.global_shape} does not split evenly into {self.fragmentations}")
        if any(k is not None and not 0 <= k < self.num_chunks for k in self.chunk_of_rank):
            raise ValueError(f"chunk indices {self.chunk_of_rank} outside the {self.num_chunks} chunks")

    @classmethod
    def replicated(cls, shape: tuple[int, ...], world_size: int) -> "TensorLayout":
        return cls(tuple(shape), (1,) * len(shape), (0,) * world_size)

    @classmethod
    def split(cls, shape: tuple[int, ...], dim: int, group_rank_of: tuple[int | None, ...], parts: int
              ) -> "TensorLayout":
        """Cut along ``dim`` into ``parts``; rank r holds part ``group_rank_of[r]`` (its index in the group
        that shares the tensor out; ranks of other groups hold the same parts as their counterparts)."""
        fragmentations = tuple(parts if d == dim else 1 for d in range(len(shape)))
        return cls(tuple(shape), fragmentations, tuple(group_rank_of))

    @property
    def held_by_all(self) -> bool:
        return None not in self.chunk_of_rank

    def restrict(self, holds: tuple[bool, ...]) -> "TensorLayout":
        """The same grid held only by the ranks r with ``holds[r]`` (the others hold nothing of it)."""
        return TensorLayout(self.global_shape, self.fragmentations,
                            tuple(k if held else None for k, held in zip(self.chunk_of_rank, holds)))

    @property
    def num_chunks(self) -> int:
        return math.prod(self.fragmentations)

    @property
    def is_sharded(self) -> bool:
        return self.num_chunks > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(size // parts for size, parts in zip(self.global_shape, self.fragmentations))

    def chunk_coordinates(self, chunk: int) -> tuple[int, ...]:
        """The chunk's position in the grid, one index per dim (row-major: the last dim varies fastest)."""
        coords = []
        for parts in reversed(self.fragmentations):
            coords.append(chunk % parts)
            chunk //= parts
        return tuple(reversed(coords))

    def chunk_index(self, coordinates: tuple[int, ...]) -> int:
        """The index of the chunk at ``coordinates`` (the inverse of ``chunk_coordinates``)."""
        index = 0
        for coordinate, parts in zip(coordinates, self.fragmentations):
            index = index * parts + coordinate
        return index

    def refine(self, dim: int, parts: int, part_of_rank: tuple[int, ...]) -> "TensorLayout":
        """Each chunk cut again along ``dim`` into ``parts``, rank r keeping part ``part_of_rank[r]`` of its chunk:
        FSDP's dim-0 chunks of a tensor-parallel shard are still one even grid of the global tensor."""
        fragmentations = tuple(f * parts if d == dim else f for d, f in enumerate(self.fragmentations))
        grid = TensorLayout(self.global_shape, fragmentations, (0,) * len(self.chunk_of_rank))
        chunk_of_rank = []
        for chunk, part in zip(self.chunk_of_rank, part_of_rank):
            if chunk is None:
                chunk_of_rank.append(None)
                continue
            coordinates = list(self.chunk_coordinates(chunk))
            coordinates[dim] = coordinates[dim] * parts + part
            chunk_of_rank.append(grid.chunk_index(tuple(coordinates)))
        return TensorLayout(self.global_shape, fragmentations, tuple(chunk_of_rank))

    def chunk_slices(self, chunk: int) -> tuple[slice, ...]:
        """Where chunk ``chunk`` lies in the global tensor."""
        return tuple(slice(c * n, (c + 1) * n) for c, n in zip(self.chunk_coordinates(chunk), self.local_shape))

    def holders(self) -> list[list[int]]:
        """Each chunk's holders (its replicas), ascending, in one pass over the ranks (a plan is built at every
        save, and a world of N ranks has up to N chunks per tensor)."""
        holders: list[list[int]] = [[] for _ in range(self.num_chunks)]
        for rank, chunk in enumerate(self.chunk_of_rank):
            if chunk is not None:
                holders[chunk].append(rank)
        return holders

    def mindspore_layout(self) -> dict | None:
        """This layout as MindSpore's ``Layout.to_dict()``, the ``layout`` of MindFormers' metadata.json, which its
        resharding loader reads (reference §2.4, §3.6); None for a tensor held whole. The device matrix is the
        replicas, then one axis per cut dim; ``rank_list`` names the rank at each of its positions (row-major),
        so any assignment of chunks to ranks is described exactly. ``tensor_map`` counts device axes from the
        last, as MindSpore does; -1 is an uncut dim."""
        if not self.is_sharded:
            return None
        holders = self.holders()
        replicas = len(holders[0])
        if any(len(ranks) != replicas for ranks in holders):
            raise ValueError(f"chunks of {self.global_shape} have unequal numbers of holders "
                             f"{[len(ranks) for ranks in holders]}: no device matrix describes them")
        cut = [d for d, parts in enumerate(self.fragmentations) if parts > 1]
        return {"device_matrix": [replicas, *(self.fragmentations[d] for d in cut)],
                "tensor_map": [len(cut) - 1 - cut.index(d) if d in cut else -1 for d in range(len(self.global_shape))],
                "interleaved_parallel": False,
                "alias_name": ["replica", *(f"dim{d}" for d in cut)],
                "rank_list": [holders[k][replica] for replica in range(replicas) for k in range(self.num_chunks)]}
