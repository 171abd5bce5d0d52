"""The bad-input matrix of the entry points, one table (the config-side matrix is tests/test_bad_inputs.py): each
case feeds `python -m training.run` or a `kiln` command one mistake in its data, checkpoint or arguments, and gets
one line on stderr naming the place, no traceback, and a failing exit status. `--debug` shows the traceback."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT, write_random_documents
from training.cli import main as kiln
from training.data.indexed import IndexedDatasetWriter
from training.run import main as train

MODEL_FILE = "checkpoint-model-0000000-0000001.safetensors"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A good shard and a run of one step saved (``trained/ck``), which each case copies before it breaks it."""
    root = tmp_path_factory.mktemp("bad_inputs")
    good = write_random_documents(root / "good", documents=64)
    assert train(run_args(root, "trained", data_path(good))) == 0
    return root, good


def run_args(root: Path, name: str, *overrides: str) -> list[str]:
    args = ["--config", str(PROJECT_ROOT / MICRO_CONFIG), "--output-dir", str(root / name)]
    for override in ("training.steps=1", f"checkpoint.save_path={root / name / 'ck'}",
                     "train_dataset.dataloader.config.eod=2", "train_dataset.dataloader.config.pad=3", *overrides):
        args += ["--set", override]
    return args


def data_path(*prefixes, weights=None) -> str:
    items = []
    for weight, prefix in zip(weights or [1.0] * len(prefixes), prefixes):
        items += [weight, str(prefix)]
    return "train_dataset.dataloader.config.data_path=" + json.dumps(items).replace("NaN", ".nan")


def copy_of(root: Path, good: Path, name: str, *, bin_from: Path | None = None, idx_bytes: bytes | None = None,
            bin_bytes: bytes | None = None) -> Path:
    prefix = root / name
    Path(f"{prefix}.bin").write_bytes(bin_bytes if bin_bytes is not None else Path(f"{bin_from or good}.bin").read_bytes())
    if idx_bytes is not None or name != "no_idx":
        Path(f"{prefix}.idx").write_bytes(idx_bytes if idx_bytes is not None else Path(f"{good}.idx").read_bytes())
    return prefix


def empty_shard(root: Path, _good: Path) -> Path:
    with IndexedDatasetWriter(root / "empty", np.uint16):
        pass
    return root / "empty"


def broken_checkpoint(root: Path, name: str, breaks) -> Path:
    """A copy of the trained run's save path with its step-1 checkpoint (or tracker) broken by ``breaks``."""
    save_path = root / f"{name}_ck"
    shutil.copytree(root / "trained" / "ck", save_path)
    breaks(save_path / "iteration_00000001")
    return save_path


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def run_case(overrides):
    """A training.run case: its argv, with ``overrides(root, good shard, case name)``."""
    return lambda root, good, name: run_args(root, name, *overrides(root, good, name))


def resume_case(breaks, *extra):
    return lambda root, good, name: run_args(root, name, data_path(good), "training.steps=2", *extra,
                                             f"checkpoint.load_path={broken_checkpoint(root, name, breaks)}")


# id -> (entry point, argv builder, exit status, what the one line must say)
CASES = {
    "blend weight 0": ("run", run_case(lambda r, g, n: [data_path(g, weights=[0.0])]), 1,
                       r"data_path\[0\]: weight 0.0 must be a positive number"),
    # refused with the config's other problems (training/config.py bounds every float): one report
    "blend weight NaN": ("run", run_case(lambda r, g, n: [data_path(g, weights=[float("nan")])]), 2,
                         r"data_path: expected .*got \[nan"),
    "blend weight negative": ("run", run_case(lambda r, g, n: [data_path(g, weights=[-1.0])]), 1,
                              r"data_path\[0\]: weight -1.0 must be a positive number"),
    "missing .idx": ("run", run_case(lambda r, g, n: [data_path(copy_of(r, g, "no_idx"))]), 1,
                     r"data_path\[1\]: .*no_idx.idx not found"),
    "garbage .idx": ("run", run_case(lambda r, g, n: [data_path(copy_of(r, g, n, idx_bytes=b"garbage" * 9))]), 1,
                     r"garbage_idx.idx: bad magic"),
    "truncated .bin": ("run", run_case(lambda r, g, n: [data_path(copy_of(r, g, n, bin_bytes=b"\0" * 100))]), 1,
                       r"truncated_bin.bin: size does not match truncated_bin.idx"),
    "mismatched .bin": ("run", run_case(lambda r, g, n: [data_path(copy_of(
        r, g, n, bin_from=write_random_documents(r / "other", seed=5, documents=10)))]), 1,
        r"mismatched_bin.bin: size does not match"),
    "empty shard": ("run", run_case(lambda r, g, n: [data_path(empty_shard(r, g))]), 1,
                    r"empty: holds no documents .*take it out of the blend"),
    "ids past the vocabulary": ("run", run_case(lambda r, g, n: [data_path(write_random_documents(
        r / "big_ids", documents=64, low=600, high=1000))]), 1, r"big_ids.bin: token ids up to 999, but "
                                                               r"model.vocab_size is 512"),
    "truncated checkpoint file": ("run", resume_case(lambda c: truncate(c / MODEL_FILE, 200)), 1,
                                  rf"{MODEL_FILE}: 200 bytes, lineage.json recorded \d+"),
    "bad safetensors header": ("run", resume_case(lambda c: (c / MODEL_FILE).write_bytes(
        b"\xff" * 8 + (c / MODEL_FILE).read_bytes()[8:])), 1, rf"{MODEL_FILE}: sha256 .* is not the"),
    "broken metadata.json": ("run", resume_case(lambda c: (c / "metadata.json").write_text("{broken")), 1,
                             r"metadata.json: 7 bytes, lineage.json recorded"),
    "another model's checkpoint": ("run", resume_case(lambda c: None, "model.hidden_size=32"), 1,
                                   r"tensor embedding.word_embeddings.weight has shape \[512, 64\], the model "
                                   r"expects \[512, 32\]"),
    "garbage tracker": ("run", resume_case(lambda c: (c.parent / "latest_checkpointed_iteration.txt").write_text(
        "garbage")), 1, r"latest_checkpointed_iteration.txt: expected a step number, found 'garbage'"),
    "checkpoint without lineage": ("run", resume_case(lambda c: (c / "lineage.json").unlink()), 1,
                                   r"has no lineage.json, so its files cannot be verified .*--load-unverified"),
    "inspect --num 0": ("kiln", lambda r, g, n: ["dataset", "inspect", "--config", str(r / "trained" / next(
        p.name for p in (r / "trained").glob("config-*.yaml"))), "--num", "0"], 2,
        r"kiln dataset inspect: --num 0: must be between 1 and 10,000"),
    "inspect --num 1e9": ("kiln", lambda r, g, n: ["dataset", "inspect", "--config", str(next(
        (r / "trained").glob("config-*.yaml"))), "--split", "valid", "--num", "1000000000"], 2,
        r"--num 1000000000: must be between 1 and 10,000"),
    "eval of a tampered checkpoint": ("kiln", lambda r, g, n: ["eval", str(broken_checkpoint(
        r, n, lambda c: truncate(c / MODEL_FILE, 300)) / "iteration_00000001")], 2,
        rf"kiln eval: .*{MODEL_FILE}: 300 bytes, lineage.json recorded"),
    "export-hf of a missing directory": ("kiln", lambda r, g, n: ["export-hf", str(r / "nowhere"), str(r / n)], 2,
                                         r"kiln export-hf: checkpoint.load_path .*nowhere: no such directory"),
    "audit of a directory without lineage": ("kiln", lambda r, g, n: ["audit", str(r)], 2,
                                             r"kiln audit: .*lineage.json: unreadable lineage"),
    "lineage --consumers typo": ("kiln", lambda r, g, n: ["lineage", "--consumers", "goood", "--runs-root",
                                                         str(r)], 1, r"no checkpoint under .* records 'goood'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_line_naming_the_place(world, case, capsys, monkeypatch):
    root, good = world
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    entry, argv_of, status, expected = CASES[case]
    name = re.sub(r"\W+", "_", case).strip("_")
    argv = argv_of(root, good, name)
    capsys.readouterr()
    assert (train if entry == "run" else kiln)(argv) == status
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert not any("Traceback" in line for line in err), err
    if err[0].startswith("config error:"):  # the config's report: every problem of it, one a line
        assert any(re.search(expected, line) for line in err), err
        return
    assert len(err) == 1 and re.search(expected, err[0]), err


def test_debug_shows_the_traceback_of_a_bad_input(world, monkeypatch):
    root, good = world
    from training.data.gpt_dataset import DatasetError

    with pytest.raises(DatasetError, match="weight 0.0 must be a positive number"):
        train(run_args(root, "debug", data_path(good, weights=[0.0])) + ["--debug"])
    monkeypatch.setenv("KILN_DEBUG", "1")
    with pytest.raises(ValueError, match="--num 0"):
        kiln(["dataset", "inspect", "--config", str(next((root / "trained").glob("config-*.yaml"))), "--num", "0"])


@pytest.mark.msrun
def test_under_msrun_a_workers_one_line_heads_the_failure(world, tmp_path):
    """Two workers meet the same bad blend weight: no log holds a traceback, and the failure training_run raises
    leads with the one line of a worker that said it (msrun stops the other once one exits, so which of the two
    gets to say it is a race; test_the_lowest_rank_that_said_its_line_leads_the_failure covers the order)."""
    from resources.msrun import MsrunResource
    from training.launch import LaunchFailed, run_on_local_workers

    root, good = world
    log_dir = tmp_path / "msrun_log"
    with pytest.raises(LaunchFailed):
        run_on_local_workers(["-m", "training.run", *run_args(tmp_path, "msrun", data_path(good, weights=[0.0]))],
                             log_dir, 2, timeout=600)
    for worker in ("worker_0.log", "worker_1.log"):
        assert "Traceback" not in (log_dir / worker).read_text()
    headline = MsrunResource()._failure(1, log_dir)["description"].splitlines()[0]
    line = ("[kiln] not retriable: DatasetError: train_dataset.dataloader.config.data_path[0]: weight 0.0 must be a "
            "positive number")
    said = re.fullmatch(r"msrun exited with code 1; (worker_[01]\.log): (.*)", headline)
    assert said and said[2] == line, headline
    assert line in (log_dir / said[1]).read_text()


@pytest.mark.parametrize("logs, leads", [
    ({"worker_0.log": "[kiln] not retriable: A\n", "worker_1.log": "[kiln] not retriable: B\n"},
     "worker_0.log: [kiln] not retriable: A"),
    ({"worker_0.log": "", "worker_1.log": "[kiln] not retriable: B\n"}, "worker_1.log: [kiln] not retriable: B"),
    ({"worker_0.log": "killed\n", "worker_1.log": "Traceback (most recent call last):\nKeyError: 1\n"},
     "worker_1.log ends with:"),
], ids=["both said it", "rank 0 stopped first", "a bug"])
def test_the_lowest_rank_that_said_its_line_leads_the_failure(tmp_path, logs, leads):
    from resources.msrun import MsrunResource

    for name, text in logs.items():
        (tmp_path / name).write_text(text)
    assert MsrunResource()._failure(1, tmp_path)["description"].splitlines()[0] == f"msrun exited with code 1; {leads}"


def test_output_piped_into_head_ends_without_a_traceback(world):
    """`kiln dataset inspect ... | head -1`: the reader stops after one line; kiln ends quietly."""
    import subprocess
    import sys

    root, _ = world
    config = next((root / "trained").glob("config-*.yaml"))
    done = subprocess.run(f"{sys.executable} -m training.cli dataset inspect --config {config} --set training.steps=1000 --num 2000 | head -1",
                          shell=True, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("sample 0 (step 0)") and len(done.stdout.splitlines()) == 1
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
