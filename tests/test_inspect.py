"""`kiln dataset inspect`: the samples it shows are the ones training reads, in training's order."""
import numpy as np
import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT, write_random_documents
from training.cli import main as kiln
from training.parallel.mesh import World
from training.config import load_config
from training.reporting import Reporter
from training.step import configure_runtime
from training.trainer import Trainer


@pytest.fixture
def run_config(tmp_path):
    """A micro run over two sources whose token ranges tell them apart."""
    write_random_documents(tmp_path / "a", seed=0, low=4, high=200, documents=150)
    write_random_documents(tmp_path / "b", seed=1, low=300, high=512, documents=150)
    config = tmp_path / "run.yaml"
    config.write_text((PROJECT_ROOT / MICRO_CONFIG).read_text()
                      .replace("data_path: []", f"data_path: [0.7, '{tmp_path / 'a'}', 0.3, '{tmp_path / 'b'}']\n      eod: 2")
                      .replace("checkpoint:\n", f"checkpoint:\n  save_path: {tmp_path / 'ckpt'}\n"))
    return config


def test_inspect_dumps_what_the_trainer_reads(tmp_path, run_config, capsys):
    dump = tmp_path / "out/samples.npy"
    assert kiln(["dataset", "inspect", "--config", str(run_config), "--num", "8", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    samples = np.load(dump)
    assert samples.shape == (8, 33) and samples.dtype == np.int64
    assert out.count("sample ") == 8 and "(step 1)" in out

    config = load_config(run_config)
    configure_runtime(config)
    trainer = Trainer(config, World(rank=0, size=1), tmp_path / "run", Reporter(None, enabled=False))
    for i, row in enumerate(samples):
        item = trainer.dataset[i]
        np.testing.assert_array_equal(row[:-1], item["input_ids"])
        np.testing.assert_array_equal(row[1:], item["labels"])
        source = "a" if row.max() < 300 else "b"  # b's tokens are all >= 300
        assert f"sample {i} (step {i // 4}) from {tmp_path / source}:" in out


def test_inspect_errors_name_the_problem(tmp_path, run_config, capsys):
    assert kiln(["dataset", "inspect", "--config", str(run_config), "--num", "25"]) == 2
    assert "holds 24 samples" in capsys.readouterr().err
    assert kiln(["dataset", "inspect", "--config", str(run_config), "--set", "training.stepz=3"]) == 2
    assert "training.stepz: unknown key" in capsys.readouterr().err


def test_mindrecord_command_writes_what_a_mind_dataset_reads(tmp_path, run_config, capsys):
    from training.data.mindrecord import read_mindrecord_samples

    out = tmp_path / "records/a.mindrecord"
    args = ["mindrecord", "--input-prefix", str(tmp_path / "a"), "--output", str(out), "--seq-length", "32",
            "--eod", "2", "--num-samples", "20"]
    assert kiln(args) == 0
    assert read_mindrecord_samples(out, "a").shape == (20, 33)
    assert kiln(args) == 2 and "exists" in capsys.readouterr().err


def test_inspect_reads_each_split_from_its_own_blend(tmp_path, run_config, capsys):
    """train_data_path / valid_data_path: each split is its blend read whole, not a cut of data_path."""
    dump = tmp_path / "valid.npy"
    args = ["dataset", "inspect", "--config", str(run_config), "--num", "4", "--split", "valid",
            "--set", "train_dataset.dataloader.config.data_path=null",
            "--set", "train_dataset.dataloader.config.split=null",
            "--set", f"train_dataset.dataloader.config.train_data_path=['{tmp_path / 'a'}']",
            "--set", f"train_dataset.dataloader.config.valid_data_path=['{tmp_path / 'b'}']",
            "--set", "train_dataset.dataloader.sizes=[24, 4, 4]", "--dump", str(dump)]
    assert kiln(args) == 0
    assert capsys.readouterr().out.count(f"from {tmp_path / 'b'}:") == 4
    tokens = np.load(dump)
    assert tokens[tokens != 2].min() >= 300  # only b's tokens besides the eod id
    assert kiln(args[:6] + ["--split", "test"] + args[8:]) == 2
    assert "test_data_path is not set" in capsys.readouterr().err


def test_inspect_shows_mock_data(tmp_path, run_config, capsys):
    dump = tmp_path / "mock.npy"
    assert kiln(["dataset", "inspect", "--config", str(run_config), "--num", "2", "--dump", str(dump),
                 "--set", "train_dataset.dataloader.config.data_path=null",
                 "--set", "train_dataset.dataloader.config.mock=true", "--set", "model.vocab_size=4096"]) == 0
    assert capsys.readouterr().out.count("from mock data:") == 2
    assert np.load(dump).max() < 4096
