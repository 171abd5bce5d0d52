"""Verified loads: a checkpoint file changed in place (a NaN, one flipped bit, q/k/v scaled by 1.5) or swapped for a
symlink to another step's file is refused by resume, `kiln export-hf` and `kiln eval`, naming the file; a checkpoint
without lineage.json loads only on purpose, and says so; a descendant's audit fails when an ancestor is tampered."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_trainer import make_trainer
from training.checkpoint import CheckpointError
from training.cli import main as kiln
from training.safetensors_io import ITEMSIZE, read_header

RUN = "a"
MODEL_FILE = "checkpoint-model-0000000-0000001.safetensors"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run ``a``: steps 1 and 2 saved."""
    root = tmp_path_factory.mktemp("verified")
    from conftest import write_random_documents

    shard = write_random_documents(root / "data" / "shard", documents=64)
    make_trainer(root, shard, RUN, "training.steps=2", "checkpoint.save_interleaved_steps=1").train()
    return root, shard


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run (a test tampers with it), and its data shard."""
    root, shard = trained
    shutil.copytree(root / RUN, tmp_path / RUN)
    return tmp_path, shard


def tensor_bytes(path: Path, match: str) -> tuple[int, int, str]:
    """Where the first tensor whose name contains ``match`` lies in the file: (begin, end, dtype)."""
    header, start = read_header(path)
    name = next(n for n in header if match in n)
    begin, end = header[name]["data_offsets"]
    return start + begin, start + end, header[name]["dtype"]


def nan(path: Path) -> None:
    begin, _, dtype = tensor_bytes(path, "word_embeddings")
    assert ITEMSIZE[dtype] == 4
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(np.array([np.nan], np.float32).tobytes())


def flipped_bit(path: Path) -> None:
    begin, _, _ = tensor_bytes(path, "norm")
    with open(path, "r+b") as f:
        f.seek(begin + 1)
        byte = f.read(1)[0]
        f.seek(begin + 1)
        f.write(bytes([byte ^ 0x01]))


def scaled_qkv(path: Path) -> None:
    begin, end, dtype = tensor_bytes(path, "linear_qkv")
    with open(path, "r+b") as f:
        f.seek(begin)
        values = np.frombuffer(f.read(end - begin), np.float32) * np.float32(1.5)
        f.seek(begin)
        f.write(values.astype(np.float32).tobytes())


def symlink_to_step_1(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent.parent / "iteration_00000001" / path.name)


TAMPERS = {"nan": nan, "flipped_bit": flipped_bit, "scaled_qkv": scaled_qkv, "symlink": symlink_to_step_1}
REFUSALS = {"nan": "sha256 .* is not the .* lineage.json recorded", "flipped_bit": "sha256 .* is not the",
            "scaled_qkv": "sha256 .* is not the", "symlink": "a symlink to .*iteration_00000001.*outside"}


def resume(root: Path, shard: Path, load_path: Path, *extra, **kwargs):
    return make_trainer(root, shard, "b", "training.steps=4", "checkpoint.save_interleaved_steps=1",
                        f"checkpoint.load_path={load_path}", *extra, **kwargs)


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
@pytest.mark.parametrize("consumer", ["resume", "weights_only", "export-hf", "eval"])
def test_a_tampered_checkpoint_file_is_refused_naming_it(run, tamper, consumer, capsys):
    root, shard = run
    checkpoint = root / RUN / "checkpoints" / "iteration_00000002"
    TAMPERS[tamper](checkpoint / MODEL_FILE)
    expected = f"{MODEL_FILE}: {REFUSALS[tamper]}"
    if consumer in ("resume", "weights_only"):
        extra = ["checkpoint.no_load_optim=true"] if consumer == "weights_only" else []
        with pytest.raises(CheckpointError, match=expected):
            resume(root, shard, checkpoint, *extra)
        return
    args = ["export-hf", str(checkpoint), str(root / "hf")] if consumer == "export-hf" else ["eval", str(checkpoint)]
    assert kiln(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and MODEL_FILE in err
    assert __import__("re").search(expected, err), err
    assert not (root / "hf").exists()


def test_descendant_audit_fails_when_an_ancestor_is_tampered_or_its_lineage_rewritten(run, capsys):
    root, shard = run
    parent = root / RUN / "checkpoints" / "iteration_00000002"
    resume(root, shard, parent).train()
    child = root / "b" / "checkpoints" / "iteration_00000004"
    recorded = json.loads((child / "lineage.json").read_text())["run"]["parent"]
    assert recorded["verified"] and recorded["run_path"] == f"{RUN}/checkpoints/iteration_00000002"
    assert kiln(["audit", str(child)]) == 0
    out = capsys.readouterr().out
    assert f"ok        ancestor    {RUN}/checkpoints/iteration_00000002/{MODEL_FILE}" in out
    # trained without --lineage: OK, and the report says what that leaves unverified
    assert "note: no upstream lineage (trained without --lineage" in out

    lineage_path = parent / "lineage.json"
    intact = lineage_path.read_text()
    scaled_qkv(parent / MODEL_FILE)  # after the child loaded it
    assert kiln(["audit", str(child)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH  ancestor    {RUN}/checkpoints/iteration_00000002/{MODEL_FILE} changed" in out
    # the forger also rewrites the parent's lineage.json to the new file's sha256: the child recorded the old one
    forged = json.loads(intact)
    from training.data.hashing import sha256_file

    for record in forged["checkpoint"]["files"]:
        if record["name"] == MODEL_FILE:
            record["sha256"] = sha256_file(parent / MODEL_FILE)
    lineage_path.write_text(json.dumps(forged))
    assert kiln(["audit", str(child)]) == 1
    assert "lineage.json changed since training" in capsys.readouterr().out


def test_a_checkpoint_without_lineage_loads_only_on_purpose_and_the_child_says_so(run, capsys):
    root, shard = run
    checkpoint = root / RUN / "checkpoints" / "iteration_00000002"
    (checkpoint / "lineage.json").unlink()
    with pytest.raises(CheckpointError, match="has no lineage.json, so its files cannot be verified .*--load-unverified"):
        resume(root, shard, checkpoint)
    trainer = resume(root, shard, checkpoint, load_unverified=True)
    assert "loaded UNVERIFIED (--load-unverified)" in capsys.readouterr().out
    trainer.train()
    child = root / "b" / "checkpoints" / "iteration_00000004"
    parent = json.loads((child / "lineage.json").read_text())["run"]["parent"]
    assert parent["verified"] is False and MODEL_FILE in parent["files_read"]
    assert kiln(["audit", str(child)]) == 0
    out = capsys.readouterr().out
    assert "UNVERIFIED ancestor" in out and "ancestor" in out.splitlines()[-2] + out.splitlines()[-1]
    config = ["--config", str(next((root / "b").glob("config-*.yaml")))]
    assert kiln(["export-hf", str(checkpoint), str(root / "hf")]) == 2
    assert "pass the model section (--config), and --allow-unverified" in capsys.readouterr().err
    assert kiln(["export-hf", str(checkpoint), str(root / "hf"), *config]) == 2
    assert "cannot be verified" in capsys.readouterr().err
    assert kiln(["export-hf", str(checkpoint), str(root / "hf"), "--allow-unverified", *config]) == 0
    record = json.loads((root / "hf" / "kiln_export.json").read_text())
    assert record["source"]["verified"] is False


def test_an_export_is_verified_when_imported_again(run, capsys):
    root, _ = run
    checkpoint = root / RUN / "checkpoints" / "iteration_00000002"
    assert kiln(["export-hf", str(checkpoint), str(root / "hf")]) == 0
    flipped_bit(root / "hf" / "model.safetensors")
    assert kiln(["import-hf", str(root / "hf"), str(root / "imported")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: sha256" in err and "kiln_export.json recorded" in err
