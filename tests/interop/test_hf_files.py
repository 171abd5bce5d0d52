"""Reading Hugging Face directories as published: sharded with an index, tied checkpoints that still store
lm_head, unreadable files named. No torch needed."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import kiln_model, model_section
from training.hf import (HFConversionError, HFWeights, hf_to_kiln_state, kiln_to_hf_config, kiln_to_hf_state,
                         write_hf_dir)

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


def _rewrite_header(path, edit):
    """``path`` with its JSON header passed through ``edit`` (data bytes unchanged)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def _last_tensor(path) -> str:
    """The tensor whose data ends the file."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def test_truncated_file_names_the_file_and_the_tensor_cut_off(tmp_path):
    path, section, _ = exported(tmp_path)
    file = path / "model.safetensors"
    last = _last_tensor(file)
    file.write_bytes(file.read_bytes()[:-4])
    with pytest.raises(HFConversionError, match=rf"^{file}: tensor {re.escape(last)}: data_offsets \[\d+, \d+\] "
                                                rf"run past the \d+ bytes of data in the file \(truncated\?\)"):
        hf_to_kiln_state(path, section)


def test_corrupt_header_names_the_file_and_the_tensor(tmp_path):
    path, section, _ = exported(tmp_path)
    file = path / "model.safetensors"
    name = "model.norm.weight"

    def shape_too_big(header):
        header[name]["shape"] = [header[name]["shape"][0] * 2]

    _rewrite_header(file, shape_too_big)
    with pytest.raises(HFConversionError, match=rf"^{file}: tensor {re.escape(name)}: data_offsets \[\d+, \d+\] "
                                                rf"hold 256 bytes, its F32 shape \[128\] needs 512"):
        hf_to_kiln_state(path, section)

    path, section, _ = exported(tmp_path / "again")
    file = path / "model.safetensors"

    def overlap(header):  # the second tensor in the data claims the first one's bytes too
        second = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])[1]
        begin, end = header[second]["data_offsets"]
        header[second]["data_offsets"] = [0, end - begin]

    _rewrite_header(file, overlap)
    with pytest.raises(HFConversionError, match=rf"^{file}: tensor .*: data starts at byte \d+, the previous "
                                                rf"tensor's ends at \d+ \(overlapping or misplaced data_offsets\)"):
        hf_to_kiln_state(path, section)


def test_bfloat16_tensors_are_read_widened_to_float32(tmp_path):
    """numpy has no bfloat16: the reader widens the raw 16 bits (the top half of a float32)."""
    values = np.array([[1.0, -2.5], [3.140625, 0.0]], np.float32)  # exact in bfloat16
    file = tmp_path / "model.safetensors"
    save_file({"w": (values.view(np.uint32) >> 16).astype(np.uint16)}, file)
    _rewrite_header(file, lambda header: header["w"].update(dtype="BF16"))
    np.testing.assert_array_equal(HFWeights(tmp_path).get("w"), values)
