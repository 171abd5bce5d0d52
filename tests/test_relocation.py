"""A copied project tree trains, evaluates and audits against the copy: the config training_run rendered records
its runs and data roots once (kiln.roots), every checkpoint's lineage records them, and a copy of both roots, side
by side as they were, is read and written in place of the original, never the original tree."""
import json
import shutil

import pytest
import yaml

from conftest import MICRO_CONFIG, PROJECT_ROOT, write_random_documents
from training.cli import main as kiln
from training.data.hashing import sha256_file
from training.lineage import store_lineage_inputs
from training.relocation import MovedConfigError, moved_rendered_config
from training.run import main as train


def rendered_run(root):
    """<root>/data/shards/s (.bin/.idx, in a blend manifest) and <root>/runs/r/config.yaml as training_run renders
    one, with the lineage inputs it stores (<root>/runs/lineage) pointed at by <root>/runs/r/lineage_inputs.json."""
    data, runs = root / "data", root / "runs"
    shard = write_random_documents(data / "shards" / "s", documents=64)
    (data / "blend").mkdir()
    (data / "blend" / "manifest.json").write_text("{}")
    config = yaml.safe_load((PROJECT_ROOT / MICRO_CONFIG).read_text())
    run_dir = runs / "r"
    config["training"]["steps"] = 1
    config["checkpoint"].update(save_path=str(run_dir / "checkpoints"), save_interleaved_steps=1)
    config["train_dataset"]["dataloader"]["config"].update(
        data_path=[1.0, str(shard)], eod=2, pad=3, split="80,20,0", path_to_cache=str(run_dir / "index_cache"))
    config.setdefault("kiln", {})["roots"] = {"runs_root": str(runs), "data_root": str(data)}
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shards = [{"source": "s", "path": f"shards/s.{ext}", "sha256": sha256_file(f"{shard}.{ext}")} for ext in ("bin", "idx")]
    inputs = {"kiln_lineage_version": 2, "data_root": str(data), "shards": shards, "raw_files": [],
              "manifest": {"path": "blend/manifest.json", "sha256": sha256_file(data / "blend" / "manifest.json")}}
    (run_dir / "lineage_inputs.json").write_text(json.dumps(store_lineage_inputs(runs, inputs)))
    return run_dir / "config.yaml"


def copied_away(root, source: str, copy: str):
    """``source`` copied to ``copy``, then moved away: any read or write of it afterwards would fail or show."""
    shutil.copytree(root / source, root / copy)
    (root / source).rename(root / f"{source}-away")
    return root / copy


def test_a_copied_tree_trains_into_itself_on_its_own_data_and_audits_against_itself(tmp_path, capsys):
    rendered_run(tmp_path / "original")
    copy = copied_away(tmp_path, "original", "copy")
    run_dir = copy / "runs" / "r"
    assert train(["--config", str(run_dir / "config.yaml"), "--lineage", str(run_dir / "lineage_inputs.json")]) == 0
    assert "was rendered for the run directory" in capsys.readouterr().out
    checkpoint = run_dir / "checkpoints" / "iteration_00000001"
    lineage = json.loads((checkpoint / "lineage.json").read_text())
    assert lineage["run"]["roots"] == {"runs_root": str(copy / "runs"), "data_root": str(copy / "data")}
    # the copy moved on as a whole: its audit verifies the copy's config, shards and manifest, found by the roots
    again = copied_away(tmp_path, "copy", "again")
    capsys.readouterr()
    assert kiln(["audit", str(again / "runs" / "r" / "checkpoints" / "iteration_00000001")]) == 0
    report = capsys.readouterr().out
    assert "ok        shard       shards/s.bin" in report and str(again / "runs" / "r" / "config-") in report
    assert "copy" not in report.replace(str(again), "") and "missing" not in report
    # and evaluates on the copy's data, found by the roots; with --data-root, on the data root given
    checkpoint = again / "runs" / "r" / "checkpoints" / "iteration_00000001"
    assert kiln(["eval", str(checkpoint), "--batches", "1"]) == 0
    (again / "data").rename(tmp_path / "elsewhere")
    assert kiln(["eval", str(checkpoint), "--batches", "1"]) == 2
    assert f"{again / 'data' / 'shards' / 's'}.bin not found" in capsys.readouterr().err  # not the original's
    assert kiln(["eval", str(checkpoint), "--batches", "1", "--data-root", str(tmp_path / "elsewhere")]) == 0


def test_only_a_rendered_config_in_a_run_directory_of_its_name_is_moved(tmp_path):
    config = rendered_run(tmp_path / "original")
    data = yaml.safe_load(config.read_text())
    assert moved_rendered_config(data, config) == (data, None)  # where it was rendered
    elsewhere = tmp_path / "mine.yaml"  # a user's copy to edit, outside any run directory: paths as written
    assert moved_rendered_config(data, elsewhere) == (data, None)
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    moved, rendered_for = moved_rendered_config(data, tmp_path / "copy" / "runs" / "r" / "config.yaml")
    assert rendered_for == tmp_path / "original" / "runs" / "r"
    assert moved["checkpoint"]["save_path"] == str(tmp_path / "copy" / "runs" / "r" / "checkpoints")
    assert moved["train_dataset"]["dataloader"]["config"]["data_path"][1] == str(
        tmp_path / "copy" / "data" / "shards" / "s")
    assert moved["kiln"]["roots"] == {"runs_root": str(tmp_path / "copy" / "runs"),
                                      "data_root": str(tmp_path / "copy" / "data")}


def test_a_copy_without_its_data_root_or_roots_is_refused_naming_what_to_do(tmp_path):
    config = rendered_run(tmp_path / "original")
    data = yaml.safe_load(config.read_text())
    shutil.copytree(tmp_path / "original" / "runs", tmp_path / "bare" / "runs")  # the run directory alone
    with pytest.raises(MovedConfigError, match=r"this copy's data root would be .*bare/data .*which does not exist: "
                                               r"copy the data root along"):
        moved_rendered_config(data, tmp_path / "bare" / "runs" / "r" / "config.yaml")
    del data["kiln"]["roots"]  # rendered by a Kiln before the roots were recorded
    with pytest.raises(MovedConfigError, match=r"did not record its roots \(kiln\.roots\).*materialize training_run"):
        moved_rendered_config(data, tmp_path / "bare" / "runs" / "r" / "config.yaml")
