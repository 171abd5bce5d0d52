import json

import numpy as np
import pytest

from training.checkpoint import (TRACKER, CheckpointError, CheckpointSaver, SavePlan, _write_safetensors_atomic,
                                 balanced_assignment, is_hf_dir, iteration_dir, load_checkpoint,
                                 resolve_load_path, save_checkpoint, tracked_step)
from training.parallel.comm import Collectives
from training.parallel.mesh import World

WORLD = World(rank=0, size=1)
MODEL_FILE = "checkpoint-model-0000000-0000001.safetensors"
OPT_FILE = "checkpoint-opt-0000000-0000001.safetensors"


def arrays(seed):
    rng = np.random.default_rng(seed)
    model = {"embedding.word_embeddings.weight": rng.normal(size=(16, 4)).astype(np.float32),
             "decoder.layers.0.mlp.linear_fc1.weight": rng.normal(size=(8, 4)).astype(np.float16),
             "decoder.final_layernorm.weight": np.ones(4, np.float32)}
    optim = {f"adam_m.{k}": (v * 0.1).astype(np.float32) for k, v in model.items()} | {
        "global_step": np.array([seed], np.int64)}
    return model, optim


def common(step):
    return {"global_step": step, "consumed_samples": step * 8, "global_batch_size": 8}


def save(root, step, save_max=5):
    model, optim = arrays(step)
    return save_checkpoint(save_path=root, step=step, model=model, optim=optim, common=common(step),
                           lineage={"run": {}}, prefix="checkpoint", save_max=save_max, world=WORLD,
                           collectives=Collectives(WORLD))


def assert_loaded(loaded, step):
    model, optim = arrays(step)
    assert sorted(loaded.model) == sorted(model) and sorted(loaded.optim) == sorted(optim)
    for k in model:
        assert loaded.model[k].dtype == model[k].dtype
        np.testing.assert_array_equal(loaded.model[k], model[k])
    for k in optim:
        np.testing.assert_array_equal(loaded.optim[k], optim[k])


def test_a_save_hashes_its_tensor_files_while_writing_them_and_records_the_bytes_on_disk(tmp_path, monkeypatch):
    """lineage.json's sha256 of a tensor file comes from its writer, not from reading the file back (the audit
    is what reads it); only rank 0's small JSON files are read to be hashed."""
    import training.checkpoint as checkpoint

    read_back, real = [], checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: read_back.append(path.name) or real(path))
    saved = save(tmp_path, 1)
    assert sorted(read_back) == ["common.json", "lineage.json", "metadata.json"]
    recorded = {f["name"]: f["sha256"] for f in saved.files}
    assert recorded == {p.name: real(p) for p in saved.path.iterdir()}  # and no writer's hidden sha256 is left
    lineage = json.loads((saved.path / "lineage.json").read_text())
    assert {f["name"]: f["sha256"] for f in lineage["checkpoint"]["files"]} == {
        name: sha256 for name, sha256 in recorded.items() if name not in ("lineage.json", "common.json")}


def test_round_trip_layout_and_tracker(tmp_path):
    saved = save(tmp_path, 3)
    names = sorted(p.name for p in saved.path.iterdir())
    assert saved.path.name == "iteration_00000003"
    assert names == [MODEL_FILE, OPT_FILE, "common.json", "lineage.json", "metadata.json"]
    assert tracked_step(tmp_path) == 3
    meta = json.loads((saved.path / "metadata.json").read_text())
    entry = meta["state_dict_metadata"]["embedding.word_embeddings.weight"]
    assert entry["global_shape"] == [16, 4] and entry["axis_fragmentations"] == [1, 1]
    assert entry["properties"]["dtype"] == "Float32"
    assert meta["storage_data"]["('global_step', (0,))"][0]["file_name"] == OPT_FILE
    loaded = load_checkpoint(resolve_load_path(tmp_path))
    assert_loaded(loaded, 3)
    assert loaded.common["consumed_samples"] == 24
    lineage = json.loads((saved.path / "lineage.json").read_text())
    assert {f["name"] for f in lineage["checkpoint"]["files"]} == {MODEL_FILE, OPT_FILE, "metadata.json"}


def test_save_max_keeps_newest_and_counts_earlier_runs(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, save_max=2)
    assert sorted(p.name for p in tmp_path.glob("iteration_*")) == ["iteration_00000003", "iteration_00000004"]
    assert (tmp_path / TRACKER).read_text().strip() == "4"


def test_save_max_never_deletes_the_tracked_checkpoint(tmp_path):
    for step in (5, 6):  # an earlier run got further
        save(tmp_path, step, save_max=5)
    save(tmp_path, 2, save_max=1)  # a run resumed from an older checkpoint saves step 2
    assert tracked_step(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.glob("iteration_*")) == ["iteration_00000002", "iteration_00000006"]


def test_async_save_writes_host_copies_and_tracks_only_when_finished(tmp_path):
    saver = CheckpointSaver(save_path=tmp_path, prefix="checkpoint", save_max=5, world=WORLD,
                            collectives=Collectives(WORLD), async_save=True)
    model, optim = arrays(4)
    saver.save(step=4, model=model, optim=optim, common=common(4), lineage={"run": {}})
    saver.before_update()  # what the trainer calls before the optimizer overwrites the parameters in place
    for array in (model | optim).values():
        array[...] = 0
    assert saver.pending is not None and tracked_step(tmp_path) is None
    saver.pending.writer.join()
    assert saver.status().tolist() == [1.0, 0.0]
    saver.settle(saver.status())  # what the trainer does after its per-step all-reduce
    saver.finalizer.join()  # rank 0 finalizes in a thread: metadata, hashes for lineage, common.json, tracker
    assert tracked_step(tmp_path) == 4 and saver.pending is None
    [saved] = saver.take_completed()
    assert saved.step == 4
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 4)

    # the next save first finalizes the pending one; wait() finalizes the last
    saver.save(step=5, model=arrays(5)[0], optim=arrays(5)[1], common=common(5), lineage={"run": {}})
    saver.save(step=6, model=arrays(6)[0], optim=arrays(6)[1], common=common(6), lineage={"run": {}})
    assert tracked_step(tmp_path) == 5
    saver.wait()
    assert tracked_step(tmp_path) == 6 and [s.step for s in saver.take_completed()] == [5, 6]
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 6)


def test_failed_async_write_is_raised_and_never_tracked(tmp_path, monkeypatch):
    saver = CheckpointSaver(save_path=tmp_path, prefix="checkpoint", save_max=5, world=WORLD,
                            collectives=Collectives(WORLD), async_save=True)

    def disk_full(path, arrays):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("training.checkpoint._write_safetensors_atomic", disk_full)
    model, optim = arrays(1)
    saver.save(step=1, model=model, optim=optim, common=common(1), lineage={"run": {}})
    with pytest.raises(CheckpointError, match="iteration_00000001: async save failed on 1 rank.*No space left"):
        saver.wait()
    assert tracked_step(tmp_path) is None and not (iteration_dir(tmp_path, 1) / "common.json").exists()


def files_of(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_saving_a_step_again_is_refused_and_the_complete_checkpoint_is_kept(tmp_path):
    first = save(tmp_path, 3)
    before = files_of(first.path)
    with pytest.raises(CheckpointError, match="iteration_00000003: a complete checkpoint of step 3 is already there"):
        save(tmp_path, 3)
    assert files_of(first.path) == before and tracked_step(tmp_path) == 3
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 3)


@pytest.mark.parametrize("fail_at", ["safetensors", "common.json"])
def test_a_save_that_dies_midway_leaves_no_directory_under_the_final_name(tmp_path, monkeypatch, fail_at):
    """Files are written into a staging directory renamed only once complete: a crash at any point leaves
    the tracked checkpoint as it was, and no iteration directory that a resume or an audit would take."""
    import training.checkpoint as checkpoint

    save(tmp_path, 2)
    crash = OSError(5, "Input/output error")
    if fail_at == "safetensors":
        monkeypatch.setattr(checkpoint, "_write_safetensors_atomic", lambda path, arrays: (_ for _ in ()).throw(crash))
    else:
        real = checkpoint.write_json_atomic

        def dies_on_common(path, payload):
            if path.name == "common.json":
                raise crash
            real(path, payload)
        monkeypatch.setattr(checkpoint, "write_json_atomic", dies_on_common)
    with pytest.raises(OSError, match="Input/output error"):
        save(tmp_path, 4)
    assert not iteration_dir(tmp_path, 4).exists() and tracked_step(tmp_path) == 2
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 2)
    monkeypatch.undo()
    save(tmp_path, 4)  # the same step saves cleanly over what the crash left, which rotation then clears
    assert tracked_step(tmp_path) == 4 and sorted(p.name for p in tmp_path.iterdir()) == [
        "iteration_00000002", "iteration_00000004", TRACKER]


def test_balanced_assignment_gives_each_tensor_to_one_rank_by_bytes():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    owner = balanced_assignment(sizes, dict.fromkeys(sizes, (0, 1)))
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    load = [sum(s for n, s in sizes.items() if owner[n] == r) for r in (0, 1)]
    assert load == [110, 110]
    assert set(balanced_assignment(sizes, dict.fromkeys(sizes, (0, 1, 2))).values()) == {0, 1, 2}
    # MindFormers' order: fewest holders first, whatever their size; each to its least-loaded holder
    owner = balanced_assignment({"big": 100, "only1": 10, "only0": 5}, {"big": (0, 1), "only1": (1,), "only0": (0,)})
    assert owner == {"only1": 1, "only0": 0, "big": 0}


def test_redundancy_free_save_of_four_ranks_loads_from_whichever_file_holds_each_tensor(tmp_path):
    """What four ranks write with remove_redundancy (each rank its files), read back by one process."""
    model, optim = arrays(7)
    tensors = {"model": model, "opt": optim}
    plan = SavePlan.build(tensors, None, "checkpoint", world_size=4, remove_redundancy=True)
    assert all(len(ranks) == 1 for ranks in plan.writers.values())
    meta = plan.metadata()
    target = iteration_dir(tmp_path, 7)
    target.mkdir()
    written = {}
    for rank in range(4):
        for name, part in plan.own_files(tensors, rank).items():
            _write_safetensors_atomic(target / name, part)
            written[name] = sorted(part)
    # every tensor in exactly one file; model and optimizer planned apart, as MindFormers does: 3 model
    # tensors go to ranks 0-2 (largest first, each to an idle rank), so rank 3 writes no model file and the
    # model files are numbered among the 3 ranks writing one; 4 optimizer tensors, one per rank
    assert sorted(n for names in written.values() for n in names) == sorted(model | optim)
    assert sorted(written) == [f"checkpoint-model-{i:07d}-0000003.safetensors" for i in range(3)] + [
        f"checkpoint-opt-{i:07d}-0000004.safetensors" for i in range(4)]
    entry = meta["storage_data"]["('embedding.word_embeddings.weight', (0,))"]
    assert entry == [{"file_name": "checkpoint-model-0000000-0000003.safetensors", "storage_rank": 0,
                      "rank_group": [0, 1, 2, 3]}]
    (target / "metadata.json").write_text(json.dumps(meta))
    (target / "common.json").write_text(json.dumps(common(7)))
    for rank in range(4):  # assembled by hand: no lineage.json to verify against
        assert_loaded(load_checkpoint(target, rank=rank, allow_unverified=True), 7)


def unverifiable(saved):
    """The checkpoint without its lineage.json, as MindFormers writes one: its files are only parsed, not
    verified, so the parser's own errors show."""
    (saved.path / "lineage.json").unlink()
    return saved.path


def test_incomplete_and_corrupt_checkpoints_are_refused(tmp_path):
    saved = save(tmp_path, 2)
    model_file = saved.path / MODEL_FILE
    intact = model_file.read_bytes()
    model_file.write_bytes(intact[:-10])
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}: 606 bytes, lineage.json recorded 616 when it was "
                                              f"written \\(truncated or replaced\\)"):
        load_checkpoint(saved.path)
    model_file.write_bytes(intact)
    (saved.path / "common.json").write_text('{"global_step": 2, "consumed')
    with pytest.raises(CheckpointError, match="iteration_00000002/common.json: unreadable"):
        load_checkpoint(saved.path)
    (saved.path / "common.json").write_text('{"global_step": 2, "global_batch_size": 8}')
    with pytest.raises(CheckpointError, match="common.json: field\\(s\\) consumed_samples differ from what "
                                              "lineage.json recorded"):
        load_checkpoint(saved.path)
    path = unverifiable(saved)
    with pytest.raises(CheckpointError, match="common.json: field consumed_samples must be an integer"):
        load_checkpoint(path, allow_unverified=True)
    (saved.path / "common.json").write_text(json.dumps(common(2)))
    model_file.write_bytes(intact[:-10])
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}: tensor decoder.final_layernorm.weight: data_offsets "
                                              r"\[320, 336\] run past the 326 bytes of data in the file \(truncated"):
        load_checkpoint(path, allow_unverified=True)
    (saved.path / "common.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint, common.json is missing"):
        resolve_load_path(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_load_path(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty directory, nothing to load"):
        resolve_load_path(tmp_path / "empty")


def test_missing_shard_missing_tensor_and_wrong_shape_name_the_file_and_tensor(tmp_path):
    saved = save(tmp_path, 2)
    meta_path = saved.path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["state_dict_metadata"]["decoder.final_layernorm.weight"]["global_shape"] = [5]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="metadata.json: .* bytes, lineage.json recorded"):
        load_checkpoint(saved.path)
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE}: tensor decoder.final_layernorm.weight is "
                                              r"Float32\[4\], metadata.json says Float32\[5\]"):
        load_checkpoint(unverifiable(saved), allow_unverified=True)
    saved = save(tmp_path, 3)
    model, _ = arrays(3)
    del model["decoder.final_layernorm.weight"]
    _write_safetensors_atomic(saved.path / MODEL_FILE, model)
    with pytest.raises(CheckpointError, match="tensor decoder.final_layernorm.weight listed in metadata.json "
                                              "is not in the file"):
        load_checkpoint(unverifiable(saved), allow_unverified=True)
    saved = save(tmp_path, 4)
    (saved.path / OPT_FILE).unlink()
    assert load_checkpoint(saved.path, load_optim=False).optim == {}
    with pytest.raises(CheckpointError, match=f"{OPT_FILE}: missing"):
        load_checkpoint(saved.path)


def test_nothing_is_unpickled(tmp_path):
    """A pickle under a safetensors name is refused as unreadable, never executed."""
    import pickle
    saved = save(tmp_path, 2)
    (saved.path / MODEL_FILE).write_bytes(pickle.dumps({"x": np.zeros(2)}))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(unverifiable(saved), allow_unverified=True)


def test_hugging_face_directory_is_recognised(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert not is_hf_dir(hf)
    _write_safetensors_atomic(hf / "model.safetensors", {"model.norm.weight": np.ones(2, np.float32)})
    assert is_hf_dir(hf) and resolve_load_path(hf) == hf


def die_while_saving(root, step, at):
    """Save ``step`` in a forked process that dies (os._exit: no exception, no cleanup) at ``at``: after the
    first safetensors file, or after the checkpoint's rename but before the tracker names it."""
    import os

    import training.checkpoint as checkpoint

    pid = os.fork()
    if pid == 0:
        try:
            if at == "between files":
                real = checkpoint._write_safetensors_atomic

                def first_file_only(path, tensors):
                    real(path, tensors)
                    os._exit(9)
                checkpoint._write_safetensors_atomic = first_file_only
            else:
                real = checkpoint.write_text_atomic

                def no_tracker(path, text):
                    if path.name == TRACKER:
                        os._exit(9)
                    real(path, text)
                checkpoint.write_text_atomic = no_tracker
            save(root, step)
        finally:
            os._exit(0)  # only if it did not die where asked
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 9


def test_a_process_killed_between_checkpoint_files_leaves_the_tracked_checkpoint_to_resume(tmp_path):
    save(tmp_path, 2)
    die_while_saving(tmp_path, 4, "between files")
    assert sorted(p.name for p in (tmp_path / ".iteration_00000004.partial").iterdir()) == [MODEL_FILE]
    assert not iteration_dir(tmp_path, 4).exists() and tracked_step(tmp_path) == 2
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 2)
    save(tmp_path, 4)  # the resumed run saves the step again; the staging directory goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iteration_00000002", "iteration_00000004", TRACKER]


def test_a_process_killed_before_the_tracker_resumes_from_the_checkpoint_it_completed(tmp_path):
    """The rename completes a checkpoint, the tracker is written after it: a resume takes the newest complete
    checkpoint, not the tracker's older one (whose run would then be refused for the step saved ahead of it)."""
    save(tmp_path, 2)
    die_while_saving(tmp_path, 4, "before tracker")
    assert tracked_step(tmp_path) == 2 and (iteration_dir(tmp_path, 4) / "common.json").exists()
    assert resolve_load_path(tmp_path) == iteration_dir(tmp_path, 4)
    assert_loaded(load_checkpoint(resolve_load_path(tmp_path)), 4)
    save(tmp_path, 6)
    assert tracked_step(tmp_path) == 6


def test_a_resharded_load_keeps_only_the_rows_it_loads_yet_verifies_the_whole_file(tmp_path):
    """Memory bounded by what a rank loads (benchmarks/checkpoint_io.py measures it): rank 1 of a 2-way row cut
    holds its rows in buffers of their size, not views of whole files, and a byte changed in rows it does not
    load still fails the file's sha256."""
    from training.parallel.layout import TensorLayout
    from training.safetensors_io import read_header

    path = save(tmp_path, 1).path
    model, _ = arrays(1)
    layouts = {name: TensorLayout.split(a.shape, 0, (0, 1), 2) for name, a in model.items() if a.ndim == 2}
    loaded = load_checkpoint(path, rank=1, load_optim=False, layouts=layouts)
    for name in layouts:
        rows = model[name][len(model[name]) // 2:]
        np.testing.assert_array_equal(loaded.model[name], rows, err_msg=name)
        assert len(loaded.model[name].base) == rows.nbytes, name  # its own rows' bytes, all that was kept
    header, data_start = read_header(path / MODEL_FILE)
    first_row = data_start + header["embedding.word_embeddings.weight"]["data_offsets"][0]
    data = bytearray((path / MODEL_FILE).read_bytes())
    data[first_row] ^= 1  # rank 0's rows
    (path / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{MODEL_FILE}: sha256 .* is not the"):
        load_checkpoint(path, rank=1, load_optim=False, layouts=layouts)
