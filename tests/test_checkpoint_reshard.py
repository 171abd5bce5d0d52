"""Sharded checkpoints: every rank writes only the chunks it holds (one writer per chunk with
remove_redundancy), metadata.json describes them in MindFormers' schema, and a checkpoint saved under one
layout loads, bit for bit, into any other. N ranks are N threads of this process, each with its own
saver, meeting at a real barrier: the file logic is exactly what N processes run."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from training.checkpoint import (CheckpointError, _write_safetensors_atomic, load_checkpoint,
                                 load_checkpoint_balanced, resolve_load_path, save_checkpoint)
from training.parallel.layout import TensorLayout
from training.parallel.mesh import ParallelDims, World

EMB = "embedding.word_embeddings.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"  # column-parallel: rows split over tp
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"  # row-parallel: columns split over tp
NORM = "decoder.final_layernorm.weight"
STEP = "global_step"


def full_tensors() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    model = {EMB: rng.normal(size=(16, 8)).astype(np.float32), QKV: rng.normal(size=(12, 8)).astype(np.float32),
             PROJ: rng.normal(size=(8, 12)).astype(np.float16), NORM: rng.normal(size=8).astype(np.float32)}
    model[EMB][0, :2] = [-0.0, np.nan]  # bit patterns a value comparison would not notice
    optim = {f"adam_m.{n}": rng.normal(size=a.shape).astype(np.float32) for n, a in model.items()}
    return model, {**optim, STEP: np.array([5], np.int64)}


def tp_fsdp_layouts() -> dict[str, TensorLayout]:
    """TP2 x FSDP2 on 4 ranks, tp innermost as in MindFormers' mesh: rank r has tp = r % 2, dp = r // 2.
    FSDP cuts each rank's TP part again along dim 0."""
    tp, dp = [r % 2 for r in range(4)], [r // 2 for r in range(4)]
    rows_of_rows = tuple(2 * t + d for t, d in zip(tp, dp))  # dim 0 in 4: tp's half, then dp's quarter of it
    return {EMB: TensorLayout((16, 8), (4, 1), rows_of_rows), QKV: TensorLayout((12, 8), (4, 1), rows_of_rows),
            PROJ: TensorLayout((8, 12), (2, 2), tuple(2 * d + t for t, d in zip(tp, dp))),  # dp rows, tp columns
            NORM: TensorLayout((8,), (2,), tuple(dp))}


def ep_efsdp_layouts() -> dict[str, TensorLayout]:
    """Expert parallel 2 inside dp_shard 4 (efsdp 2) as ``Parallelism`` lays it out: QKV and PROJ stand for
    expert weights, cut along dim 0 (experts) over ep; QKV also over efsdp (ZeRO-3 of the experts), PROJ held
    whole by its ep rank's efsdp replicas (ZeRO-1's weights); EMB a dense weight over dp_shard 4."""
    dims = ParallelDims(4, dp_shard=4, ep=2)
    ep, efsdp = (tuple(dims.group_index(g, r) for r in range(4)) for g in ("ep", "efsdp"))
    return {EMB: TensorLayout.split((16, 8), 0, tuple(range(4)), 4),
            QKV: TensorLayout.split((12, 8), 0, ep, 2).refine(0, 2, efsdp),
            PROJ: TensorLayout.split((8, 12), 0, ep, 2)}


def layouts_of(name: str) -> tuple[int, dict[str, TensorLayout]]:
    """(world size, layout of every sharded model tensor); the optimizer's moments follow their parameter,
    the step counter is replicated."""
    model, _ = full_tensors()
    if name in ("1", "DP2"):
        return (1 if name == "1" else 2), {}
    if name == "FSDP2":
        world, layouts = 2, {n: TensorLayout.split(a.shape, 0, (0, 1), 2) for n, a in model.items()}
    elif name == "TP2":
        world, layouts = 2, {EMB: TensorLayout.split((16, 8), 0, (0, 1), 2),
                             QKV: TensorLayout.split((12, 8), 0, (0, 1), 2),
                             PROJ: TensorLayout.split((8, 12), 1, (0, 1), 2)}
    elif name == "EP2xEFSDP2":
        world, layouts = 4, ep_efsdp_layouts()
    else:
        world, layouts = 4, tp_fsdp_layouts()
    return world, {**layouts, **{f"adam_m.{n}": layout for n, layout in layouts.items()}}


LAYOUTS = ["1", "DP2", "FSDP2", "TP2", "TP2xFSDP2", "EP2xEFSDP2"]


def local(full: dict[str, np.ndarray], layouts: dict[str, TensorLayout], rank: int) -> dict[str, np.ndarray]:
    """What ``rank`` holds of each tensor."""
    out = {}
    for name, array in full.items():
        layout = layouts.get(name)
        out[name] = array if layout is None else array[layout.chunk_slices(layout.chunk_of_rank[rank])]
    return out


class ThreadCollectives:
    """The collectives of one of N threads standing in for N ranks."""

    def __init__(self, world: World, barrier: threading.Barrier, board: dict):
        self.world, self._barrier, self._board = world, barrier, board

    def barrier(self) -> None:
        self._barrier.wait(timeout=60)

    def all_reduce_array(self, values: np.ndarray) -> np.ndarray:
        self._board[("sum", self.world.rank)] = np.asarray(values)
        self.barrier()
        total = sum(self._board[("sum", r)] for r in range(self.world.size))
        self.barrier()
        return total

    def share_arrays(self, own: dict, owners: dict, specs: dict) -> dict:
        self._board.update(own)
        self.barrier()
        shared = {name: self._board[name].copy() for name in specs}
        self.barrier()
        return shared


def on_ranks(world_size: int, work) -> list:
    """``work(world, collectives)`` on every rank, each in its own thread; the ranks' results, or the
    first error (a failing rank breaks the barrier, so the others stop too)."""
    barrier, board = threading.Barrier(world_size), {}
    results, errors = [None] * world_size, []

    def run(rank: int) -> None:
        world = World(rank=rank, size=world_size)
        try:
            results[rank] = work(world, ThreadCollectives(world, barrier, board))
        except BaseException as exc:  # noqa: BLE001 -- re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


def save_under(root, layout, remove_redundancy: bool, model=None, optim=None, lineage=None):
    """Every rank saves its chunks; ``layout``: a name of ``LAYOUTS`` or (world size, layouts). Returns the
    checkpoint directory."""
    full_model, full_optim = full_tensors() if model is None else (model, optim or {})
    world_size, layouts = layouts_of(layout) if isinstance(layout, str) else layout

    def work(world, collectives):
        return save_checkpoint(save_path=root, step=1, model=local(full_model, layouts, world.rank),
                               optim=local(full_optim, layouts, world.rank) if full_optim else None,
                               common={"global_step": 1, "consumed_samples": 4, "global_batch_size": 4},
                               lineage=lineage or {}, prefix="checkpoint", save_max=3, world=world,
                               collectives=collectives, remove_redundancy=remove_redundancy, layouts=layouts)
    return on_ranks(world_size, work)[0].path


def assert_local_slices(loaded, layouts, rank):
    """Every tensor the rank loaded is its slice of the original, bit for bit, dtype included."""
    model, optim = full_tensors()
    for got, full in ((loaded.model, local(model, layouts, rank)), (loaded.optim, local(optim, layouts, rank))):
        assert sorted(got) == sorted(full)
        for name, want in full.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert got[name].tobytes() == np.ascontiguousarray(want).tobytes(), name


@pytest.mark.parametrize("remove_redundancy", [False, True], ids=["all_copies", "remove_redundancy"])
@pytest.mark.parametrize("source", LAYOUTS)
def test_a_checkpoint_saved_under_any_layout_loads_into_every_layout(tmp_path, source, remove_redundancy):
    path = save_under(tmp_path, source, remove_redundancy)
    for target in LAYOUTS:
        world_size, layouts = layouts_of(target)
        for rank in range(world_size):
            assert_local_slices(load_checkpoint(path, rank=rank, layouts=layouts), layouts, rank)


def test_the_balanced_load_reshards_too(tmp_path):
    """Whole tensors are read once and broadcast; the loading run's sharded ones are read by each rank."""
    path = save_under(tmp_path, "TP2xFSDP2", remove_redundancy=True)
    world_size, layouts = layouts_of("FSDP2")
    loaded = on_ranks(world_size, lambda world, collectives: load_checkpoint_balanced(
        path, world, collectives, layouts=layouts))
    for rank in range(world_size):
        assert_local_slices(loaded[rank], layouts, rank)


def test_each_rank_writes_only_its_chunks(tmp_path):
    path = save_under(tmp_path, "TP2xFSDP2", remove_redundancy=False)
    rank1 = load_file(path / "checkpoint-model-0000001-0000004.safetensors")
    model, _ = full_tensors()
    # rank 1: tp 1, dp 0 -> rows 8:12 of the embedding (chunk 2 of 4), columns 6:12 of linear_proj's rows 0:4
    np.testing.assert_array_equal(rank1[EMB], model[EMB][8:12])
    np.testing.assert_array_equal(rank1[PROJ], model[PROJ][0:4, 6:12])
    np.testing.assert_array_equal(rank1[NORM], model[NORM][0:4])


def test_metadata_json_follows_mindformers_schema(tmp_path):
    """A hand-computed TP2 x FSDP2 example: rank r holds tp = r % 2, dp = r // 2."""
    meta = json.loads((save_under(tmp_path / "all", "TP2xFSDP2", False) / "metadata.json").read_text())
    proj = meta["state_dict_metadata"][PROJ]
    assert proj["global_shape"] == [8, 12] and proj["axis_fragmentations"] == [2, 2]
    assert proj["chunk"] == [{"global_offset": [k], "local_shape": [4, 6]} for k in range(4)]
    assert proj["properties"] == {"dtype": "Float16", "replica_id": [0, 0, 0, 0], "allow_shape_mismatch": False,
                                  "allow_to_save": True}
    # MindSpore's Layout: replicas, then dp rows, then tp columns; each position's rank holds that chunk
    assert proj["layout"] == {"device_matrix": [1, 2, 2], "tensor_map": [1, 0], "interleaved_parallel": False,
                              "alias_name": ["replica", "dim0", "dim1"], "rank_list": [0, 1, 2, 3]}
    # the grid is row-major: chunk 1 is dp row 0, tp column 1, held by rank 1 only
    assert meta["storage_data"][f"('{PROJ}', (1,))"] == [
        {"file_name": "checkpoint-model-0000001-0000004.safetensors", "storage_rank": 1, "rank_group": [1]}]
    norm = meta["state_dict_metadata"][NORM]
    assert norm["axis_fragmentations"] == [2] and norm["properties"]["replica_id"] == [0, 1, 0, 1]
    # the second half of the norm is held by ranks 2 and 3 (dp 1): both write a copy
    assert meta["storage_data"][f"('{NORM}', (1,))"] == [
        {"file_name": f"checkpoint-model-000000{r}-0000004.safetensors", "storage_rank": r, "rank_group": [2, 3]}
        for r in (2, 3)]
    assert norm["layout"]["device_matrix"] == [2, 2] and norm["layout"]["rank_list"] == [0, 2, 1, 3]
    step = meta["state_dict_metadata"][STEP]
    assert step["axis_fragmentations"] == [1] and step["properties"]["replica_id"] == 0 and step["layout"] is None
    assert [e["storage_rank"] for e in meta["storage_data"][f"('{STEP}', (0,))"]] == [0, 1, 2, 3]
    assert len(meta["storage_data"]) == sum(len(e["chunk"]) for e in meta["state_dict_metadata"].values())

    meta = json.loads((save_under(tmp_path / "one", "TP2xFSDP2", True) / "metadata.json").read_text())
    # remove_redundancy: one writer per chunk. Every rank has 272 B of chunks only it holds; the norm's
    # halves (2 holders) then go to the lower rank of each pair, and the optimizer's step counter (4 holders,
    # planned with the optimizer's chunks) to rank 1, the least loaded once adam_m's norm halves went to 0, 2
    assert meta["storage_data"][f"('{NORM}', (1,))"] == [
        {"file_name": "checkpoint-model-0000002-0000004.safetensors", "storage_rank": 2, "rank_group": [2, 3]}]
    assert meta["storage_data"][f"('{STEP}', (0,))"] == [
        {"file_name": "checkpoint-opt-0000001-0000004.safetensors", "storage_rank": 1, "rank_group": [0, 1, 2, 3]}]
    assert all(len(entries) == 1 for entries in meta["storage_data"].values())


def mindspore_slices(layout: dict, shape: list[int], position: int) -> tuple[slice, ...]:
    """The region of a tensor held by the device at ``position`` of a MindSpore layout: the position's
    coordinates in the device matrix (row-major), and per tensor dim the coordinate of the device axis its
    tensor_map names, counted from the last axis (-1: uncut)."""
    matrix, coordinates = layout["device_matrix"], []
    for size in reversed(matrix):
        coordinates.insert(0, position % size)
        position //= size
    slices = []
    for dim, axis in enumerate(layout["tensor_map"]):
        parts = 1 if axis == -1 else matrix[len(matrix) - 1 - axis]
        part = 0 if axis == -1 else coordinates[len(matrix) - 1 - axis]
        slices.append(slice(part * shape[dim] // parts, (part + 1) * shape[dim] // parts))
    return tuple(slices)


@pytest.mark.parametrize("source", ["FSDP2", "TP2", "TP2xFSDP2", "EP2xEFSDP2"])
def test_metadata_layouts_address_the_chunk_each_rank_wrote(tmp_path, source):
    """MindFormers' loader finds a source rank's region from ``layout`` alone (reference §3.6): read as MindSpore
    reads it, each rank of the rank list must be given exactly the array it wrote; MindSpore builds the same
    Layout from it."""
    from mindspore.parallel import Layout

    path = save_under(tmp_path, source, remove_redundancy=False)
    meta = json.loads((path / "metadata.json").read_text())
    model, _ = full_tensors()
    world_size = layouts_of(source)[0]
    files = {rank: load_file(path / f"checkpoint-model-{rank:07d}-{world_size:07d}.safetensors")
             for rank in range(world_size)}
    for name, full in model.items():
        layout = meta["state_dict_metadata"][name]["layout"]
        if layout is None:  # held whole by every rank
            assert meta["state_dict_metadata"][name]["axis_fragmentations"] == [1] * full.ndim
            continue
        for position, rank in enumerate(layout["rank_list"]):
            np.testing.assert_array_equal(files[rank][name], full[mindspore_slices(layout, list(full.shape),
                                                                                   position)], err_msg=name)
        names = ["None" if axis == -1 else layout["alias_name"][len(layout["alias_name"]) - 1 - axis]
                 for axis in layout["tensor_map"]]
        rebuilt = Layout(tuple(layout["device_matrix"]), tuple(layout["alias_name"]), layout["rank_list"])(*names)
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in rebuilt.to_dict().items()} == layout


MINDFORMERS_TP2_DP2 = Path(__file__).parent / "fixtures/mindformers"


def test_a_mindformers_sharded_checkpoint_loads_whole_and_into_kiln_layouts():
    """A 4-rank (tp 2 x dp 2) checkpoint whose metadata.json, shards and file names MindFormers 2.1.0's own code
    decided (tests/fixtures/mindformers/generate.py): bfloat16 weights, a dim cut over two mesh axes, a tensor
    cut along both dims, replicated ones; read whole by one process and as FSDP2's chunks, bit for bit."""
    expected = dict(np.load(MINDFORMERS_TP2_DP2 / "expected.npz"))
    loaded = load_checkpoint(MINDFORMERS_TP2_DP2 / "tp2_dp2/iteration_00000004", allow_unverified=True)
    assert {**loaded.model, **loaded.optim}.keys() == expected.keys()
    for name, value in {**loaded.model, **loaded.optim}.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert loaded.stored[EMB] == "BFloat16" and loaded.common["global_step"] == 4
    layouts = {name: TensorLayout.split(value.shape, 0, (0, 1), 2) for name, value in expected.items()
               if value.shape[0] % 2 == 0}
    for rank in (0, 1):
        chunks = load_checkpoint(resolve_load_path(MINDFORMERS_TP2_DP2 / "tp2_dp2"), rank=rank, layouts=layouts,
                                 allow_unverified=True)  # MindFormers writes no lineage.json
        for name, value in {**chunks.model, **chunks.optim}.items():
            want = expected[name] if name not in layouts else expected[name][layouts[name].chunk_slices(rank)]
            np.testing.assert_array_equal(value, want, err_msg=name)


def test_a_rank_reads_only_the_files_holding_its_chunks(tmp_path):
    path = save_under(tmp_path, "FSDP2", remove_redundancy=False)
    _, layouts = layouts_of("FSDP2")
    for kind in ("model", "opt"):
        (path / f"checkpoint-{kind}-0000001-0000002.safetensors").unlink()
    assert_local_slices(load_checkpoint(path, rank=0, layouts=layouts), layouts, 0)
    with pytest.raises(CheckpointError, match=rf"checkpoint-opt-0000001-0000002.safetensors: missing \(listed in "
                                              rf"metadata.json for tensor adam_m.{NORM}\)"):
        load_checkpoint(path, rank=1, layouts=layouts)


def test_a_damaged_chunk_is_refused_naming_file_and_tensor(tmp_path):
    path = save_under(tmp_path, "FSDP2", remove_redundancy=False)
    model, _ = full_tensors()
    rank1_file = path / "checkpoint-model-0000001-0000002.safetensors"
    _write_safetensors_atomic(rank1_file, {**local(model, layouts_of("FSDP2")[1], 1), EMB: model[EMB][:7]})
    with pytest.raises(CheckpointError, match=rf"{rank1_file.name}: 928 bytes, lineage.json recorded 960"):
        load_checkpoint(path)
    (path / "lineage.json").unlink()  # unverifiable, as MindFormers writes one: the parser's own checks show
    with pytest.raises(CheckpointError, match=rf"{rank1_file.name}: tensor {EMB} is Float32\[7, 8\], metadata.json "
                                              rf"says chunk 1 of Float32\[16, 8\] cut \[2, 1\], Float32\[8, 8\]"):
        load_checkpoint(path, allow_unverified=True)
    # the loading run's layout must have the checkpoint's global shape
    wider = {EMB: TensorLayout.split((32, 8), 0, (0, 1), 2)}
    with pytest.raises(CheckpointError, match=rf"tensor {EMB} is \[16, 8\] in the checkpoint, the loading run's "
                                              rf"layout has it \[32, 8\]"):
        load_checkpoint(path, rank=0, layouts=wider, allow_unverified=True)
    meta_path = path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["storage_data"][f"('{EMB}', (1,))"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"metadata.json: tensor {EMB} is cut \[2, 1\] into 2 chunk\(s\); "
                                              rf"storage_data has no file for chunk\(s\) \[1\]"):
        load_checkpoint(path, allow_unverified=True)


def test_a_layout_that_does_not_fit_the_arrays_is_refused_before_anything_is_written(tmp_path):
    model, _ = full_tensors()
    half = TensorLayout.split((16, 8), 0, (0, 1), 2)
    with pytest.raises(CheckpointError, match=rf"tensor {EMB}: this rank's array is \[16, 8\], its layout's chunk "
                                              rf"is \[8, 8\] \(global \[16, 8\] cut \[2, 1\]\)"):
        on_ranks(2, lambda world, collectives: save_checkpoint(
            save_path=tmp_path, step=1, model={EMB: model[EMB]}, optim=None, common={}, lineage={}, prefix=None,
            save_max=1, world=world, collectives=collectives, layouts={EMB: half}))
    with pytest.raises(CheckpointError, match=rf"tensor {EMB}: chunks \[1\] of its layout are held by no rank"):
        save_under(tmp_path, (2, {EMB: TensorLayout((16, 8), (2, 1), (0, 0))}), False,
                   model={EMB: model[EMB][:8]}, optim={})
    assert not any(tmp_path.iterdir())


def test_export_hf_of_a_sharded_checkpoint_equals_that_of_the_replicated_one(tmp_path):
    from interop.hf_helpers import kiln_model, model_section
    from training.hf import export_hf

    section = model_section("tests/configs/qwen3_micro.yaml")
    _, weights = kiln_model(section, seed=3)
    # TP2 x FSDP2-like: every matrix cut in two along both dims where they divide, vectors along dim 0
    layouts = {}
    for name, array in weights.items():
        cuts = tuple(2 if n % 2 == 0 else 1 for n in array.shape[:2]) + (1,) * (array.ndim - 2)
        grid = TensorLayout(array.shape, cuts, (0,))
        layouts[name] = TensorLayout(array.shape, cuts, tuple(r % grid.num_chunks for r in range(4)))
    lineage = {"run": {"config": {"model": section}}}
    sharded = save_under(tmp_path / "sharded", (4, layouts), True, model=weights, lineage=lineage)
    replicated = save_under(tmp_path / "replicated", "1", False, model=weights, lineage=lineage)
    assert json.loads((sharded / "metadata.json").read_text())["state_dict_metadata"][
        "decoder.layers.0.mlp.linear_fc1.weight"]["axis_fragmentations"] == [2, 2]
    export_hf(sharded, tmp_path / "hf_sharded")
    export_hf(replicated, tmp_path / "hf_replicated")
    assert (sorted(p.name for p in (tmp_path / "hf_sharded").iterdir())
            == sorted(p.name for p in (tmp_path / "hf_replicated").iterdir()))
    for file in (tmp_path / "hf_sharded").iterdir():
        if file.name == "kiln_export.json":  # names the checkpoint each came from; the files' sha256 the same
            assert (json.loads(file.read_text())["files"]
                    == json.loads((tmp_path / "hf_replicated" / file.name).read_text())["files"])
            continue
        assert file.read_bytes() == (tmp_path / "hf_replicated" / file.name).read_bytes(), file.name


def test_the_audit_hashes_every_ranks_files(tmp_path):
    from training.data.hashing import sha256_file
    from training.lineage import audit_checkpoint

    config = tmp_path / "config.yaml"
    config.write_text("training: {}\n")
    path = save_under(tmp_path / "run", "TP2xFSDP2", False,
                      lineage={"run": {"config_path": str(config), "config_sha256": sha256_file(config)}})
    _, checks = audit_checkpoint(path)
    audited = {c.path for c in checks if c.status == "ok"}
    assert {f"checkpoint-{kind}-000000{r}-0000004.safetensors" for kind in ("model", "opt") for r in range(4)
            } | {"metadata.json", "common.json"} <= audited
    with open(path / "checkpoint-opt-0000003-0000004.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 1]))
    _, checks = audit_checkpoint(path)
    assert [c.path for c in checks if c.status != "ok"] == ["checkpoint-opt-0000003-0000004.safetensors"]


def pp2_tp2_layouts() -> dict[str, TensorLayout]:
    """Pipeline 2 × tensor 2 on 4 ranks (rank = 2·pp + tp): the first stage's ranks hold EMB (vocabulary rows over
    tp) and NORM, the second's QKV (rows over tp) and PROJ (columns over tp); no rank holds the other stage's."""
    tp = tuple(r % 2 for r in range(4))
    first, second = tuple(r < 2 for r in range(4)), tuple(r >= 2 for r in range(4))
    layouts = {EMB: TensorLayout.split((16, 8), 0, tp, 2).restrict(first),
               NORM: TensorLayout.replicated((8,), 4).restrict(first),
               QKV: TensorLayout.split((12, 8), 0, tp, 2).restrict(second),
               PROJ: TensorLayout.split((8, 12), 1, tp, 2).restrict(second)}
    return {**layouts, **{f"adam_m.{n}": layout for n, layout in layouts.items()}}


def held(full: dict[str, np.ndarray], layouts: dict[str, TensorLayout], rank: int) -> dict[str, np.ndarray]:
    """What ``rank`` holds of each tensor under layouts where a rank may hold none of one."""
    out = {}
    for name, array in full.items():
        layout = layouts.get(name)
        if layout is None or layout.chunk_of_rank[rank] is not None:
            out[name] = array if layout is None else array[layout.chunk_slices(layout.chunk_of_rank[rank])]
    return out


@pytest.mark.parametrize("remove_redundancy", [False, True], ids=["all_copies", "remove_redundancy"])
def test_a_pipeline_checkpoint_each_stage_writing_its_tensors_loads_into_every_layout(tmp_path, remove_redundancy):
    model, optim = full_tensors()
    layouts = pp2_tp2_layouts()

    def work(world, collectives):
        own_model, own_optim = held(model, layouts, world.rank), held(optim, layouts, world.rank)
        # the tensors only the other stage holds: rank 0 describes their files from their kind and dtype
        remote = {n: (kind, a.dtype) for kind, tensors in (("model", model), ("opt", optim))
                  for n, a in tensors.items() if n not in (own_model if kind == "model" else own_optim)}
        return save_checkpoint(save_path=tmp_path, step=1, model=own_model, optim=own_optim,
                               common={"global_step": 1, "consumed_samples": 4, "global_batch_size": 4},
                               lineage={}, prefix="checkpoint", save_max=3, world=world, collectives=collectives,
                               remove_redundancy=remove_redundancy, layouts=layouts, remote=remote)
    path = on_ranks(4, work)[0].path
    state = json.loads((path / "metadata.json").read_text())["state_dict_metadata"]
    assert state[QKV]["properties"]["replica_id"] == [None, None, 0, 0]  # the first stage holds none of it
    assert state[NORM]["properties"]["replica_id"] == 0 and state[NORM]["axis_fragmentations"] == [1]
    for target in LAYOUTS:
        world_size, target_layouts = layouts_of(target)
        for rank in range(world_size):
            assert_local_slices(load_checkpoint(path, rank=rank, layouts=target_layouts), target_layouts, rank)
    for rank in range(4):  # back into the pipeline layout: each rank reads its stage's tensors only
        loaded = load_checkpoint(path, rank=rank, layouts=layouts)
        for got, full in ((loaded.model, model), (loaded.optim, optim)):
            want = held(full, layouts, rank)
            assert sorted(got) == sorted(want)
            for name, array in want.items():
                assert got[name].tobytes() == np.ascontiguousarray(array).tobytes(), name
