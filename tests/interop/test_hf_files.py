"""Reading Hugging Face directories as published: sharded with an index, tied checkpoints that still store
lm_head, unreadable files named. No torch needed."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import kiln_model, model_section
from training.hf import HFConversionError, hf_to_kiln_state, kiln_to_hf_config, kiln_to_hf_state, write_hf_dir

CONFIG = "tests/configs/qwen3_micro.yaml"


def exported(tmp_path, **overrides):
    section = model_section(CONFIG, **overrides)
    _, weights = kiln_model(section, seed=12)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))
    return tmp_path / "hf", section, weights


def test_sharded_directory_is_read_through_its_index(tmp_path):
    path, section, weights = exported(tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file_name, file_names in shards.items():
        save_file({n: tensors[n] for n in file_names}, path / file_name)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, file_names in shards.items() for n in file_names}}))
    state = hf_to_kiln_state(path, section)
    assert state.keys() == weights.keys() and all(np.array_equal(state[n], weights[n]) for n in state)


def test_tied_checkpoint_storing_lm_head_is_accepted(tmp_path):
    path, section, weights = exported(tmp_path, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, path / "model.safetensors")
    state = hf_to_kiln_state(path, section)
    assert "output_layer.weight" not in state
    embedding = "embedding.word_embeddings.weight"
    np.testing.assert_array_equal(state[embedding], weights[embedding])


def test_unreadable_file_is_named(tmp_path):
    path, section, _ = exported(tmp_path)
    (path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(HFConversionError, match=r"model\.safetensors: not a readable safetensors file"):
        hf_to_kiln_state(path, section)
