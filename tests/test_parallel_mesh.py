"""training.parallel.mesh without msrun: MindFormers' factorisation of the world against a brute-force
enumeration, rank <-> coordinates, every named group's members, data shards, and errors naming the fields."""
import itertools

import numpy as np
import pytest

from training.config import ConfigError, ParallelismConfig, TrainingConfig
from training.parallel.mesh import AXES, GROUP_NAMES, DeviceMesh, ParallelDims


def config(tp=1, pp=1, cp=1, ep=1, shard=-1) -> ParallelismConfig:
    return ParallelismConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=ep,
                             data_parallel_shard=shard)


def brute_force(shapes: list, tp: int, pp: int, cp: int, ep: int, shard: int):
    """The (pp, dp_replicate, dp_shard, cp, tp) of ``shapes`` that fit the config (MindFormers' reading:
    shard -1 means dp_replicate 1; ep divides dp_shard·cp·tp)."""
    return [sizes for sizes in shapes if (sizes[0], sizes[3], sizes[4]) == (pp, cp, tp)
            and (sizes[1] == 1 if shard == -1 else sizes[2] == shard) and (sizes[2] * cp * tp) % ep == 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12])
def test_factorisation_matches_a_brute_force_enumeration(world):
    shapes = [s for s in itertools.product(range(1, world + 1), repeat=5) if np.prod(s) == world]
    for tp, pp, cp, ep, shard in itertools.product([1, 2, 3], [1, 2], [1, 2], [1, 2, 4], [-1, 1, 2, 3]):
        found = brute_force(shapes, tp, pp, cp, ep, shard)
        assert len(found) <= 1
        try:
            dims = ParallelDims.from_config(config(tp, pp, cp, ep, shard), world)
        except ConfigError:
            assert not found, (world, tp, pp, cp, ep, shard)
            continue
        assert [dims.axis_sizes] == found and dims.ep == ep and dims.world == world


def test_mindformers_examples():
    assert ParallelDims.from_config(config(tp=2, shard=2), 8) == ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2)
    assert ParallelDims.from_config(config(tp=2), 8) == ParallelDims(8, dp_shard=4, tp=2)  # -1: pure FSDP
    assert ParallelDims.from_config(config(shard=1), 4) == ParallelDims(4, dp_replicate=4)  # plain DP
    dims = ParallelDims.from_config(config(tp=2, pp=2, cp=2, ep=4, shard=1), 16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep, dims.dp) == (2, 2, 1, 2, 2, 4, 2)


def test_each_parallelism_says_whether_it_is_on():
    on = lambda dims: {name for name in ("pp", "dp_shard", "cp", "tp", "ep") if getattr(dims, f"{name}_enabled")}  # noqa: E731
    assert on(ParallelDims(1)) == set()
    assert on(ParallelDims(4, dp_replicate=4)) == set()  # plain DP shards nothing
    assert on(ParallelDims.from_config(config(tp=2, pp=2, cp=2, ep=4, shard=1), 16)) == {"pp", "cp", "tp", "ep"}
    assert on(ParallelDims(8, dp_shard=4, tp=2)) == {"dp_shard", "tp"}


@pytest.mark.parametrize("parallelism, world, message", [
    (config(tp=2), 3, "parallelism: tensor_parallel 2 × pipeline_parallel 1 × context_parallel 1 = 2 does not "
                      "divide the 3 workers"),
    (config(tp=2, pp=2, cp=2), 4, "parallelism: tensor_parallel 2 × pipeline_parallel 2 × context_parallel 2 = 8 "
                                  "does not divide the 4 workers"),
    (config(tp=2, shard=3), 8, "parallelism.data_parallel_shard 3 does not divide the data-parallel degree 4 = 8 "
                               "workers / (tensor_parallel 2 × pipeline_parallel 1 × context_parallel 1)"),
    (config(tp=2, ep=3), 4, "parallelism.expert_parallel 3 does not divide data-parallel shards 2 × "
                            "context_parallel 1 × tensor_parallel 2 = 4"),
    (config(tp=0), 4, "parallelism.tensor_parallel must be >= 1, got 0"),
    (ParallelismConfig(dense_fsdp_shard_size=3), 4, "parallelism.dense_fsdp_shard_size 3 does not divide "
                                                    "data-parallel shards 4 × context_parallel 1 = 4"),
])
def test_errors_name_the_fields_and_show_the_arithmetic(parallelism, world, message):
    with pytest.raises(ConfigError) as error:
        ParallelDims.from_config(parallelism, world)
    assert str(error.value) == message


def test_batch_sizes_must_split_over_the_data_parallel_ranks():
    dims = ParallelDims.from_config(config(tp=2, shard=2), 8)  # dp = 4
    assert dims.check_batch(TrainingConfig(local_batch_size=2, global_batch_size=16)) == 2
    with pytest.raises(ConfigError) as error:
        dims.check_batch(TrainingConfig(local_batch_size=2, global_batch_size=12))
    assert str(error.value) == ("training.global_batch_size=12 is not divisible by training.local_batch_size=2 × "
                                "data_parallel=4 = 8 (data_parallel = 8 workers / (tensor_parallel 2 × "
                                "pipeline_parallel 1 × context_parallel 1))")


SHAPES = [ParallelDims(1), ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2),
          ParallelDims(16, pp=2, dp_replicate=2, cp=2, tp=2, ep=4),
          ParallelDims(24, pp=2, dp_shard=3, cp=2, tp=2, ep=2),
          ParallelDims(12, dp_replicate=3, dp_shard=2, tp=2, ep=4),
          ParallelDims(16, dp_replicate=2, dp_shard=2, cp=2, tp=2, dense_shard=2),
          ParallelDims(12, dp_shard=6, tp=2, ep=4, dense_shard=3)]


@pytest.mark.parametrize("dims", SHAPES, ids=str)
def test_coordinates_are_c_order_and_groups_share_every_other_coordinate(dims):
    grid = np.arange(dims.world).reshape(dims.axis_sizes)  # C-order, first axis outermost
    for rank in range(dims.world):
        coords = dims.coords(rank)
        assert tuple(coords.values()) == tuple(int(i) for i in np.unravel_index(rank, dims.axis_sizes))
        assert dims.rank_of(**coords) == rank
        for name, axes in {"pp": ["pp"], "dp_replicate": ["dp_replicate"], "dp_shard": ["dp_shard"], "cp": ["cp"],
                           "tp": ["tp"], "dp": ["dp_replicate", "dp_shard"], "fsdp": ["dp_shard", "cp"],
                           "batch": ["dp_replicate", "dp_shard", "cp"], "loss": ["dp_replicate", "dp_shard", "cp"],
                           "world": list(AXES)}.items():
            index = tuple(slice(None) if axis in axes else coords[axis] for axis in AXES)
            assert dims.group_ranks(name, rank) == tuple(sorted(grid[index].ravel().tolist())), (name, rank)
        # EP: the dp_shard·cp·tp block of this (pp, dp_replicate), flattened, cut into rows of ep ranks
        block = grid[coords["pp"], coords["dp_replicate"]].ravel().reshape(-1, dims.ep)
        row, column = (int(i) for i in np.argwhere(block == rank)[0])
        assert dims.group_ranks("ep", rank) == tuple(block[row].tolist())
        assert dims.group_ranks("efsdp", rank) == tuple(block[:, column].tolist())
        # the same experts (ep column) in every dp_replicate block of this pp stage
        same_experts = grid[coords["pp"]].reshape(dims.dp_replicate, -1, dims.ep)[:, :, column]
        assert dims.group_ranks("expert_dp", rank) == tuple(sorted(same_experts.ravel().tolist()))
        # dense weights: consecutive runs of dense_shard (default all) in the dp_shard × cp block, same tp
        fsdp_block = grid[coords["pp"], :, :, :, coords["tp"]].reshape(dims.dp_replicate, -1)
        size = dims.dense_shard or dims.dp_shard * dims.cp
        runs = fsdp_block.reshape(dims.dp_replicate, -1, size)
        position = coords["dp_shard"] * dims.cp + coords["cp"]
        assert dims.group_ranks("dense_shard", rank) == tuple(runs[coords["dp_replicate"], position // size].tolist())
        assert dims.group_ranks("dense_replicate", rank) == tuple(sorted(runs[:, :, position % size].ravel().tolist()))
        # MindFormers' data shard id
        assert dims.data_shard_index(rank) == (rank % (dims.world // dims.pp)) // (dims.tp * dims.cp)
        assert dims.data_shard_index(rank) == dims.group_ranks("dp", rank).index(rank)
    assert sorted({dims.data_shard_index(r) for r in range(dims.world)}) == list(range(dims.data_shard_count))


def test_device_mesh_hands_out_groups_by_name():
    mesh = DeviceMesh(ParallelDims(1), 0)
    assert set(GROUP_NAMES) == {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "fsdp", "batch", "loss",
                                "ep", "efsdp", "expert_dp", "dense_shard", "dense_replicate", "world"}
    group = mesh.group("tp")
    assert (group.name, group.ranks, group.rank, group.size, group.backend_name) == ("tp", (0,), 0, 1, None)
    assert (mesh.data_shard_index, mesh.data_shard_count) == (0, 1)
    with pytest.raises(ValueError, match="unknown group 'tensor'; the mesh has pp, dp_replicate"):
        mesh.group("tensor")


def test_rank_and_coordinate_errors():
    dims = ParallelDims(4, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4"):
        dims.coords(4)
    with pytest.raises(ValueError, match="coordinate tp=2 is outside 0..1"):
        dims.rank_of(pp=0, dp_replicate=0, dp_shard=0, cp=0, tp=2)
    with pytest.raises(ValueError, match="not the world size 6"):
        ParallelDims(6, dp_shard=2, tp=2)


def test_refining_a_tensor_parallel_layout_keeps_one_even_grid_of_the_global_tensor():
    from training.parallel.layout import TensorLayout

    full = np.arange(8 * 6).reshape(8, 6)
    tp_of_rank, fsdp_of_rank = (0, 1, 0, 1), (0, 0, 1, 1)  # world 4 = dp_shard 2 x tp 2, tp innermost
    for tp_dim in (0, 1):  # a column-parallel (rows) and a row-parallel (columns) weight
        tp_layout = TensorLayout.split(full.shape, tp_dim, tp_of_rank, 2)
        refined = tp_layout.refine(0, 2, fsdp_of_rank)
        for rank in range(4):
            local = full[tp_layout.chunk_slices(tp_layout.chunk_of_rank[rank])]
            fsdp_chunk = np.split(local, 2)[fsdp_of_rank[rank]]  # what FSDP keeps of this rank's tp shard
            np.testing.assert_array_equal(full[refined.chunk_slices(refined.chunk_of_rank[rank])], fsdp_chunk)
        assert sorted(refined.chunk_of_rank) == [0, 1, 2, 3]
