"""A training run whose checkpoint.load_path is a Hugging Face directory starts from its weights (converted by
training/hf.py, weights only, step 0) and trains; export-hf of its checkpoint (model section from the
checkpoint's lineage) writes the trained weights under the same HF names."""
from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file

from conftest import MICRO_CONFIG
from interop.hf_helpers import kiln_model, model_section
from test_trainer import make_trainer
from training.hf import export_hf, kiln_to_hf_config, kiln_to_hf_state, write_hf_dir


def test_training_starts_from_a_hugging_face_dir(tmp_path, shard):
    section = model_section(MICRO_CONFIG)
    _, weights = kiln_model(section, seed=8)
    write_hf_dir(tmp_path / "hf", kiln_to_hf_state(weights, section), kiln_to_hf_config(section))

    trainer = make_trainer(tmp_path, shard, "from_hf", f"checkpoint.load_path={tmp_path / 'hf'}",
                           "checkpoint.no_load_optim=true", "training.steps=1")
    assert trainer.step == 0 and trainer.optimizer.global_step == 0
    for param in trainer.model.get_parameters():
        np.testing.assert_array_equal(param.asnumpy(), weights[param.name], err_msg=param.name)

    # the step's checkpoint exports to the same tensors, every one moved by the AdamW step
    trainer.train()
    saved = tmp_path / "from_hf" / "checkpoints"
    export_hf(saved, tmp_path / "hf_after")
    exported = load_file(tmp_path / "hf_after" / "model.safetensors")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    changed = [n for n in exported if not np.array_equal(exported[n], original[n])]
    assert len(changed) == len(exported)
