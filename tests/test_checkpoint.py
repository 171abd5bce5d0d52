import json

import numpy as np
import pytest

from training.checkpoint import (TRACKER, CheckpointError, load_checkpoint, resolve_load_path, save_checkpoint,
                                 tracked_step)
from training.collectives import Collectives, World

WORLD = World(rank=0, size=1)


def arrays(seed):
    rng = np.random.default_rng(seed)
    model = {"embedding.word_embeddings.weight": rng.normal(size=(16, 4)).astype(np.float32),
             "decoder.final_layernorm.weight": np.ones(4, np.float32)}
    optim = {f"adam_m.{k}": v * 0.1 for k, v in model.items()} | {"global_step": np.array([seed], np.int64)}
    return model, optim


def save(root, step, save_max=5):
    model, optim = arrays(step)
    return save_checkpoint(save_path=root, step=step, model=model, optim=optim,
                           common={"global_step": step, "consumed_samples": step * 8, "global_batch_size": 8},
                           lineage={"run": {}}, prefix="checkpoint", save_max=save_max, world=WORLD,
                           collectives=Collectives(WORLD))


def test_round_trip_layout_and_tracker(tmp_path):
    saved = save(tmp_path, 3)
    names = sorted(p.name for p in saved.path.iterdir())
    assert saved.path.name == "iteration_00000003"
    assert names == ["checkpoint-model-0000000-0000001.safetensors", "checkpoint-opt-0000000-0000001.safetensors",
                     "common.json", "lineage.json", "metadata.json"]
    assert tracked_step(tmp_path) == 3
    meta = json.loads((saved.path / "metadata.json").read_text())
    entry = meta["state_dict_metadata"]["embedding.word_embeddings.weight"]
    assert entry["global_shape"] == [16, 4] and entry["axis_fragmentations"] == [1, 1]
    assert entry["properties"]["dtype"] == "Float32"
    assert meta["storage_data"]["('global_step', (0,))"][0]["file_name"] == "checkpoint-opt-0000000-0000001.safetensors"
    loaded = load_checkpoint(resolve_load_path(tmp_path))
    model, optim = arrays(3)
    for k in model:
        np.testing.assert_array_equal(loaded.model[k], model[k])
    for k in optim:
        np.testing.assert_array_equal(loaded.optim[k], optim[k])
    assert loaded.common["consumed_samples"] == 24
    lineage = json.loads((saved.path / "lineage.json").read_text())
    assert {f["name"] for f in lineage["checkpoint"]["files"]} == {
        "checkpoint-model-0000000-0000001.safetensors", "checkpoint-opt-0000000-0000001.safetensors", "metadata.json"}


def test_save_max_keeps_newest_and_counts_earlier_runs(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, save_max=2)
    assert sorted(p.name for p in tmp_path.glob("iteration_*")) == ["iteration_00000003", "iteration_00000004"]
    assert (tmp_path / TRACKER).read_text().strip() == "4"


def test_incomplete_and_corrupt_checkpoints_are_refused(tmp_path):
    saved = save(tmp_path, 2)
    model_file = saved.path / "checkpoint-model-0000000-0000001.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="checkpoint-model-0000000-0000001.safetensors"):
        load_checkpoint(saved.path)
    (saved.path / "common.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint, common.json is missing"):
        resolve_load_path(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_load_path(tmp_path / "nope")


def test_missing_shard_and_wrong_shape_name_the_file_and_tensor(tmp_path):
    saved = save(tmp_path, 2)
    meta_path = saved.path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["state_dict_metadata"]["decoder.final_layernorm.weight"]["global_shape"] = [5]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="tensor decoder.final_layernorm.weight has shape \\[4\\]"):
        load_checkpoint(saved.path)
    saved = save(tmp_path, 3)
    (saved.path / "checkpoint-opt-0000000-0000001.safetensors").unlink()
    assert load_checkpoint(saved.path, load_optim=False).optim == {}
    with pytest.raises(CheckpointError, match="opt-0000000-0000001.safetensors: missing"):
        load_checkpoint(saved.path)
