"""Every YAML Kiln writes loads in MindFormers 2.1.0's PyNative trainer: its TrainConfig refuses a key it does not
know inside a section that does not keep extras, and type-checks every field (mindformers/pynative/config:
from_dict, validate). Its sections, as its wheel declares them, are in tests/fixtures/mindformers/
config_keys_2_1_0.json (written by config_keys.py there); the checks below read the fixture as MindFormers reads
its dataclasses. Kiln's own settings live in top-level sections, which MindFormers keeps and ignores."""
import ast
import inspect
import json
from pathlib import Path

import pytest
import yaml

from conftest import MICRO_CONFIG, PROJECT_ROOT
from test_render_config import render, storage_with_manifest
from training.config import ConfigError, dump_config, load_config

FIXTURE = json.loads((Path(__file__).parent / "fixtures/mindformers/config_keys_2_1_0.json").read_text())
CLASSES = FIXTURE["classes"]
WIRED = ["train_dataset.dataloader.config.data_path=[1.0, /data/a]", "train_dataset.dataloader.config.eod=2",
         "train_dataset.dataloader.config.seq_length=64", "checkpoint.save_path=/tmp/kiln-checkpoints"]
TRAINING_CONFIGS = ["configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml", "configs/qwen3_bench.yaml",
                    "configs/deepseek_v3_bench.yaml", MICRO_CONFIG, "tests/configs/deepseek_v3_micro.yaml"]
KILN_SETTINGS = ["kiln.training.eval_interval=10", "kiln.training.eval_iters=2", "kiln.train_state.param_norm=true",
                 "kiln.train_state.max_attention_logit=true", "kiln.parallelism.context_parallel_load_balance=true"]


def mindformers_problems(value, annotation: str, path: str) -> list[str]:
    """What MindFormers 2.1.0's from_dict + validate would refuse in ``value`` of a field annotated so."""
    return _problems(value, ast.parse(annotation, mode="eval").body, path)


def _problems(value, node, path: str) -> list[str]:
    if isinstance(node, ast.Subscript):
        kind, args = ast.unparse(node.value), node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if kind in ("Optional", "Union"):
            if value is None:
                return [] if kind == "Optional" or any(ast.unparse(a) == "None" for a in args) else [
                    f"{path}: cannot be None"]
            attempts = [_problems(value, a, path) for a in args if ast.unparse(a) != "None"]
            return [] if any(not p for p in attempts) else [f"{path}: {value!r} is none of {ast.unparse(node)}"]
        if kind in ("List", "list"):
            if not isinstance(value, list):
                return [f"{path}: expected a list, got {type(value).__name__}"]
            return [p for i, item in enumerate(value) for p in _problems(item, args[0], f"{path}[{i}]")]
        if kind in ("Dict", "dict"):
            return [] if isinstance(value, dict) else [f"{path}: expected a mapping"]
        raise AssertionError(f"annotation {ast.unparse(node)} not handled")
    name = ast.unparse(node)
    if name == "Any":
        return []
    if value is None:
        return [f"{path}: cannot be None"]
    if name in CLASSES:
        return section_problems(value, name, path)
    accepted = {"bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                "list": lambda v: isinstance(v, list), "tuple": lambda v: isinstance(v, tuple),
                "dict": lambda v: isinstance(v, dict)}
    return [] if accepted[name](value) else [f"{path}: expected {name}, got {value!r}"]


def section_problems(data, class_name: str, path: str = "") -> list[str]:
    spec = CLASSES[class_name]
    if not isinstance(data, dict):
        return [f"{path}: expected a mapping for {class_name}"]
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key in spec["fields"]:
            problems += mindformers_problems(value, spec["fields"][key], where)
        elif not spec["allow_extra"]:
            problems.append(f"{where}: unknown to MindFormers' {class_name}")
    return problems


def mindformers_dataset_problems(data: dict) -> list[str]:
    """A MindDataset dataloader section as MindFormers' PyNative trainer builds it: every key becomes a keyword
    argument of mindspore.dataset.MindDataset, after it renames column_names to columns_list, drops type and
    python_multiprocessing and adds num_shards, shard_id and num_parallel_workers."""
    from mindspore.dataset import MindDataset

    loader = data["train_dataset"]["dataloader"]
    if loader.get("type") != "MindDataset":
        return []
    accepted = set(inspect.signature(MindDataset).parameters)
    passed = {"columns_list" if k == "column_names" else k for k in loader if k not in ("type", "python_multiprocessing")}
    return [f"train_dataset.dataloader.{key}: not an argument of mindspore.dataset.MindDataset"
            for key in sorted(passed - accepted)]


def written(config_path, *overrides) -> dict:
    """The resolved config the trainer writes next to metrics.jsonl (every field, defaults included)."""
    data = yaml.safe_load((PROJECT_ROOT / config_path).read_text())["train_dataset"]["dataloader"]["config"]
    wiring = [w for w in WIRED if not (data.get("mock") and "data_path" in w or "seq_length" in data and
                                       "seq_length" in w)]
    return yaml.safe_load(dump_config(load_config(PROJECT_ROOT / config_path, [*wiring, *overrides])))


def test_the_fixture_holds_mindformers_sections():
    assert set(CLASSES["TrainConfig"]["fields"]) >= {"training", "parallelism", "monitor", "train_dataset", "model"}
    assert not CLASSES["TrainingConfig"]["allow_extra"] and CLASSES["TrainConfig"]["allow_extra"]
    # the check finds what MindFormers refused in Kiln's YAML before its own settings moved
    assert section_problems({"training": {"steps": 2, "eval_interval": 5}}, "TrainConfig") == [
        "training.eval_interval: unknown to MindFormers' TrainingConfig"]
    assert section_problems({"optimizer": {"eps": "1e-8"}}, "TrainConfig") == [
        "optimizer.eps: expected float, got '1e-8'"]


@pytest.mark.parametrize("config_path", TRAINING_CONFIGS)
def test_a_shipped_config_and_the_resolved_config_kiln_writes_load_in_mindformers(config_path):
    shipped = yaml.safe_load((PROJECT_ROOT / config_path).read_text())
    assert section_problems(shipped, "TrainConfig") == []
    assert section_problems(written(config_path), "TrainConfig") == []


def test_kiln_settings_are_written_where_mindformers_ignores_them():
    data = written(MICRO_CONFIG, *KILN_SETTINGS)
    assert data["kiln"]["training"] == {"eval_interval": 10, "eval_iters": 2}
    assert section_problems(data, "TrainConfig") == []


def test_the_config_training_run_renders_loads_in_mindformers(tmp_path):
    storage = storage_with_manifest(tmp_path, 64, "90,10,0", 7)
    for config_path in ("configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml"):
        assert section_problems(render(storage, config_path, KILN_SETTINGS[:2]), "TrainConfig") == []


@pytest.mark.parametrize("old, new", [("training.eval_interval=5", "kiln.training.eval_interval"),
                                      ("training.eval_iters=5", "kiln.training.eval_iters"),
                                      ("monitor.train_state.param_norm=true", "kiln.train_state.param_norm"),
                                      ("monitor.train_state.max_attention_logit=true",
                                       "kiln.train_state.max_attention_logit"),
                                      ("parallelism.context_parallel_load_balance=true",
                                       "kiln.parallelism.context_parallel_load_balance")])
def test_a_config_with_a_kiln_setting_in_its_old_place_is_told_the_new_one(old, new):
    with pytest.raises(ConfigError) as raised:
        load_config(PROJECT_ROOT / MICRO_CONFIG, [*WIRED, old, "optimizer.eps=-1"])
    key = old.split("=")[0]
    assert raised.value.problems[0] == (
        f"{key} is Kiln's own setting and moved to {new}: MindFormers refuses keys it does not know in "
        f"{key.rsplit('.', 1)[0]}, so Kiln keeps its own in the top-level kiln section")
    assert "optimizer.eps must be > 0" in raised.value.problems


def test_a_mind_dataset_section_kiln_writes_is_a_mindspore_mind_dataset_call_in_mindformers():
    data = written(MICRO_CONFIG, "train_dataset.dataloader={type: MindDataset, dataset_files: [/r/a.mindrecord], "
                                 "shuffle: true}", "kiln.mindrecord.dataset_ratios=[1.0]",
                   "kiln.mindrecord.samples_count=8")
    assert data["kiln"]["mindrecord"]["dataset_ratios"] == [1.0]
    assert section_problems(data, "TrainConfig") == [] and mindformers_dataset_problems(data) == []
    # what the section held before: MindDataset took none of these
    old = {"train_dataset": {"dataloader": {"type": "MindDataset", "dataset_files": "a", "dataset_ratios": [1.0],
                                            "seed": 1, "eod": 2}}}
    assert mindformers_dataset_problems(old) == [
        f"train_dataset.dataloader.{key}: not an argument of mindspore.dataset.MindDataset"
        for key in ("dataset_ratios", "eod", "seed")]
