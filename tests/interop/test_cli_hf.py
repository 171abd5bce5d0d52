"""``kiln export-hf`` / ``kiln import-hf``: a trained checkpoint's weights survive export → import → export
bit for bit, the imported checkpoint is a weights-only load_path, and bad input exits 2 naming the problem."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from interop.hf_helpers import kiln_model, model_section
from training.checkpoint import load_checkpoint, save_checkpoint
from training.cli import main
from training.parallel.comm import Collectives
from training.parallel.mesh import World

CONFIG = "tests/configs/deepseek_v3_micro.yaml"


@pytest.fixture
def trained(tmp_path):
    """A save root whose checkpoint's lineage names the model section, as the trainer writes it."""
    section = model_section(CONFIG)
    _, weights = kiln_model(section, seed=7)
    world = World(rank=0, size=1)
    save_checkpoint(save_path=tmp_path / "run", step=3, model=weights, optim=None,
                    common={"global_step": 3, "consumed_samples": 12, "global_batch_size": 4},
                    lineage={"run": {"config": {"model": section}}}, prefix=None, save_max=2, world=world,
                    collectives=Collectives(world))
    return tmp_path / "run", weights


def test_export_import_export_is_lossless(trained, tmp_path, capsys):
    save_root, weights = trained
    assert main(["export-hf", str(save_root), str(tmp_path / "hf")]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    assert "checkpoint.no_load_optim=true" in capsys.readouterr().out
    imported = load_checkpoint(tmp_path / "imported" / "iteration_00000000", load_optim=False).model
    assert set(imported) == set(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(imported[name], array, err_msg=name)
    assert main(["export-hf", str(tmp_path / "imported"), str(tmp_path / "hf2")]) == 0
    first, second = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert first.keys() == second.keys() and all(np.array_equal(first[n], second[n]) for n in first)


def test_export_refuses_a_non_empty_directory(trained, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    assert main(["export-hf", str(trained[0]), str(tmp_path / "hf")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


def test_import_names_a_misshaped_tensor_and_writes_nothing(trained, tmp_path, capsys):
    assert main(["export-hf", str(trained[0]), str(tmp_path / "hf")]) == 0
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 2
    assert "model.safetensors: 1104536 bytes, kiln_export.json recorded" in capsys.readouterr().err
    (tmp_path / "hf" / "kiln_export.json").unlink()  # a directory edited outside Kiln: its tensors are checked
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 2
    assert f"model.safetensors: tensor {name} has shape [31, 64]" in capsys.readouterr().err
    assert not (tmp_path / "imported").exists()
