"""A run directory moved with its data root trains there: the config training_run rendered (absolute paths into
the run directory and the data root) read from the copy writes checkpoints into the copy and reads the copy's data,
never the original tree."""
import shutil

import yaml

from conftest import MICRO_CONFIG, PROJECT_ROOT, write_random_documents
from training.relocation import moved_rendered_config
from training.run import main as train


def rendered_run(root):
    """<root>/data/shards/s (.bin/.idx) and <root>/runs/r/config.yaml as training_run renders one."""
    shard = write_random_documents(root / "data" / "shards" / "s", documents=64)
    config = yaml.safe_load((PROJECT_ROOT / MICRO_CONFIG).read_text())
    run_dir = root / "runs" / "r"
    config["training"]["steps"] = 1
    config["checkpoint"].update(save_path=str(run_dir / "checkpoints"), save_interleaved_steps=1)
    config["train_dataset"]["dataloader"]["config"].update(
        data_path=[1.0, str(shard)], eod=2, pad=3, path_to_cache=str(run_dir / "index_cache"))
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run_dir / "config.yaml"


def test_a_copied_run_directory_trains_into_itself_on_its_own_data(tmp_path, capsys):
    rendered_run(tmp_path / "original")
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    (tmp_path / "original").rename(tmp_path / "away")  # any read or write of the original tree would fail or show
    config = tmp_path / "copy" / "runs" / "r" / "config.yaml"
    assert train(["--config", str(config)]) == 0
    assert "was rendered for the run directory" in capsys.readouterr().out
    assert (tmp_path / "copy" / "runs" / "r" / "checkpoints" / "iteration_00000001" / "common.json").is_file()
    assert not (tmp_path / "original").exists()


def test_only_a_rendered_config_in_a_run_directory_of_its_name_is_moved(tmp_path):
    config = rendered_run(tmp_path / "original")
    data = yaml.safe_load(config.read_text())
    assert moved_rendered_config(data, config) == (data, None)  # where it was rendered
    elsewhere = tmp_path / "mine.yaml"  # a user's copy to edit, outside any run directory: paths as written
    assert moved_rendered_config(data, elsewhere) == (data, None)
    moved, rendered_for = moved_rendered_config(data, tmp_path / "copy" / "runs" / "r" / "config.yaml")
    assert rendered_for == tmp_path / "original" / "runs" / "r"
    assert moved["checkpoint"]["save_path"] == str(tmp_path / "copy" / "runs" / "r" / "checkpoints")
    # the copy has no data beside it: the data path stays the original's
    assert moved["train_dataset"]["dataloader"]["config"]["data_path"][1] == str(
        tmp_path / "original" / "data" / "shards" / "s")
