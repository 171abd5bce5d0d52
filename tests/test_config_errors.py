"""Every class of config error names the field it is about (the dotted YAML path) and why."""
import os

import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT
from training.config import ConfigError, TrainConfig, load_config
from training.parallel.mesh import ParallelDims

VALID = ["train_dataset.dataloader.config.data_path=[1.0, /data/a]", "train_dataset.dataloader.config.eod=2",
         "checkpoint.save_path=/tmp/kiln-checkpoints"]


def load(*overrides):
    return load_config(PROJECT_ROOT / MICRO_CONFIG, [*VALID, *overrides])


def test_the_base_config_is_valid():
    assert load().training.steps == 6


@pytest.mark.parametrize("override, message", [
    # unknown keys, with the nearest valid one
    ("training.stepz=3", r"training\.stepz: unknown key; did you mean 'steps'"),
    ("monitor.train_state.local_nrm=true", r"monitor\.train_state\.local_nrm: unknown key; did you mean 'local_norm'"),
    ("parallelism.tensor_paralel=2", r"parallelism\.tensor_paralel: unknown key; did you mean 'tensor_parallel'"),
    # types: path, expected type, value
    ("training.steps=many", r"training\.steps: expected int, got 'many'"),
    ("optimizer.eps=tiny", r"optimizer\.eps: expected float, got 'tiny'"),
    ("training.deterministic=1", r"training\.deterministic: expected bool, got 1"),
    ("checkpoint=[1]", r"checkpoint: expected a mapping"),
    # values
    ("training.steps=0", r"training\.steps must be > 0"),
    ("optimizer.betas=[0.9]", r"optimizer\.betas"),
    ("lr_scheduler.learning_rate=0", r"lr_scheduler\.learning_rate must be > 0"),
    ("lr_scheduler.warmup_ratio=0.1", r"lr_scheduler: set warmup_steps or warmup_ratio, not both"),
    ("checkpoint.save_max=0", r"checkpoint\.save_max must be >= 1"),
    ("context.mode=0", r"context\.mode = 0: graph mode \(0\) is not supported"),
    ("context.device_target=TPU", r"context\.device_target must be Ascend, GPU or CPU"),
    ("context.max_device_memory=lots", r"context\.max_device_memory must look like '59GB'"),
    ("train_dataset.dataloader.config.split=a,b", r"train_dataset\.dataloader\.config\.split must be"),
    ("train_dataset.dataloader.config.data_path=[[]]", r"train_dataset\.dataloader\.config\.data_path: expected"),
    ("train_dataset.dataloader.config.data_path=null", r"train_dataset\.dataloader\.config: no data: set data_path"),
    ("train_dataset.dataloader.config.train_data_path=[/data/t]",
     r"train_dataset\.dataloader\.config: data_path and train_data_path exclude each other"),
    ("train_dataset.dataloader.config.mock=true", r"mock: true trains on Megatron's mock documents, and data_path "
                                                  r"names a blend: set train_dataset\.dataloader\.config\.data_path: null"),
    ("train_dataset.dataloader.type=HFDataLoader", r"train_dataset\.dataloader\.type = 'HFDataLoader' is not supported"),
    # cross-field
    ("profiler.start_step=5", r"profiler: need 0 < start_step <= end_step, got 5 and 1"),
    ("checkpoint.save_path=''", r"checkpoint\.save_path must be set when checkpoint\.enable_save is true"),
    ("model.model_type=null", r"model\.model_type"),
    ("parallelism.tensor_parallel=2",
     r"parallelism\.tensor_parallel = 2 needs parallelism\.sequence_parallel: true \(MindFormers'"),
    # accepted but not implemented: refused at non-default values, never ignored
    ("parallelism.pipeline_parallel_overlap_b_f=true",
     r"parallelism\.pipeline_parallel_overlap_b_f = True is not supported yet \(overlapping pipeline transfers"),
    ("recompute.mode=full", r"recompute\.mode = 'full' needs recompute\.full_recompute_layer"),
    ("recompute.mode=select", r"recompute\.mode = 'select' needs recompute\.select_module"),
    ("recompute.mode=all", r"recompute\.mode = 'all': expected one of None, full, select"),
    ("recompute.full_recompute_layer=[0-3]", r"recompute\.full_recompute_layer is set but recompute\.mode is 'None'"),
    ("recompute={mode: full, full_recompute_layer: ['3-1']}", r"recompute\.full_recompute_layer\[0\] = '3-1': the range ends"),
    ("recompute={mode: full, full_recompute_layer: [a]}", r"recompute\.full_recompute_layer\[0\] = 'a': expected a layer"),
    ("recompute.exclude_op={x: [0]}", r"recompute\.exclude_op = .* is not supported yet \(recomputing a module but"),
    ("swap.enable=true", r"swap\.enable = True is not supported yet"),
    ("lora_config={r: 8}", r"lora_config = .* is not supported yet \(LoRA is not implemented\)"),
])
def test_error_names_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load(override)


@pytest.mark.parametrize("overrides, message", [
    (["train_dataset.dataloader.config.valid_data_path=[/data/v]"],
     r"train_dataset\.dataloader\.config\.train_data_path is missing"),
    (["train_dataset.dataloader.config.train_data_path=[/data/t]", "train_dataset.dataloader.config.split='9,1,0'"],
     r"train_dataset\.dataloader\.config\.split applies to data_path or mock; train_data_path"),
    (["train_dataset.dataloader.config.mock=true"],
     r"train_dataset\.dataloader\.config\.mock: .* model\.vocab_size must be at least 4095, got 512"),
])
def test_data_sources_without_data_path(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PROJECT_ROOT / MICRO_CONFIG, ["train_dataset.dataloader.config.data_path=null",
                                                  "train_dataset.dataloader.config.split=null",
                                                  "train_dataset.dataloader.config.eod=2", *VALID[2:], *overrides])


def test_batch_sizes_are_checked_against_the_world():
    config = load("training.local_batch_size=2", "training.global_batch_size=6")
    assert ParallelDims.from_config(config.parallelism, 1).check_batch(config.training) == 3
    with pytest.raises(ConfigError, match=r"training\.global_batch_size=6 is not divisible by "
                                          r"training\.local_batch_size=2 × data_parallel=2"):
        ParallelDims.from_config(config.parallelism, 2).check_batch(config.training)


def test_a_bad_override_names_itself():
    with pytest.raises(ConfigError, match="override 'training.steps': expected KEY.PATH=VALUE"):
        load("training.steps")
    with pytest.raises(ConfigError, match=r"training\.steps\.x is not a section|training\.steps is not a section"):
        load("training.steps.x=1")


def test_every_problem_is_reported_at_once_unknown_keys_first():
    # a misspelt save_path leaves the real one unset: the typos come first (in file order), then the rest
    with pytest.raises(ConfigError) as raised:
        load_config(PROJECT_ROOT / MICRO_CONFIG, [*VALID[:2], "checkpoint.save_pth=/tmp/kiln-checkpoints",
                                                  "training.steps=many", "optimizer.eps=-1", "swap.enable=true",
                                                  "monitor.train_stat.local_norm=true"])
    assert raised.value.problems == [
        "checkpoint.save_pth: unknown key; did you mean 'save_path'?",
        "monitor.train_stat: unknown key; did you mean 'train_state'?",
        "training.steps: expected int, got 'many'",
        "checkpoint.save_path must be set when checkpoint.enable_save is true",
        "optimizer.eps must be > 0",
        "swap.enable = True is not supported yet (activation swap is not implemented: on CPU the device memory is "
        "host memory, so offloading frees nothing; activation recompute (recompute.mode) lowers the activation memory "
        "instead)",
    ]
    message = str(raised.value)
    assert message.startswith(f"{PROJECT_ROOT / MICRO_CONFIG}: 6 problems:\n  - checkpoint.save_pth: unknown key")


def test_a_missing_required_section_is_named_with_the_other_problems():
    with pytest.raises(ConfigError) as raised:
        TrainConfig.from_dict({"model": {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM"},
                               "train_dataset": {"dataloader": {"type": "MindDataset", "dataset_files": "x"}},
                               "trainin": {}})
    assert raised.value.problems == ["trainin: unknown top-level section; did you mean 'training'?",
                                     "lr_scheduler: required, but missing"]


def test_a_binary_or_unreadable_config_file_is_one_line_naming_it(tmp_path, capsys):
    from training.run import main as run

    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x89\xfe\x00\x01" * 16)
    assert run(["--config", str(binary)]) == 2
    assert capsys.readouterr().err == (f"config error: {binary}: not a text file (byte 0 is not UTF-8); "
                                       f"expected a training YAML\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read the config \(Is a directory\)$"):
        load_config(tmp_path)


@pytest.mark.parametrize("config", ["configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml"])
def test_a_shipped_config_run_as_shipped_says_in_one_line_what_to_train_with(config, capsys):
    from training.run import main as run

    assert run(["--config", config, "--mode", "1"]) == 2
    assert capsys.readouterr().err == (
        f"config error: {config}: train_dataset.dataloader.config.data_path is empty: this config leaves its data "
        f"and checkpoint paths to the training_run asset, which fills them from the blend manifest; train with the "
        f"copy it renders, runs/<run_name>/config.yaml (after `make demo`: python -m training.run --config "
        f"runs/qwen3_tiny/config.yaml --set checkpoint.load_path=runs/qwen3_tiny/checkpoints), or set data_path, "
        f"seq_length, eod and checkpoint.save_path\n")


def test_token_ids_past_the_vocabulary_are_one_line_without_a_traceback(tmp_path):
    import subprocess
    import sys

    from conftest import write_random_documents

    shard = write_random_documents(tmp_path / "wide", high=2000)
    done = subprocess.run([sys.executable, "-m", "training.run", "--config", str(PROJECT_ROOT / MICRO_CONFIG),
                           "--output-dir", str(tmp_path / "run"),
                           "--set", f"train_dataset.dataloader.config.data_path=['{shard}']",
                           "--set", "train_dataset.dataloader.config.eod=2",
                           "--set", f"checkpoint.save_path={tmp_path / 'run/checkpoints'}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "[kiln] not retriable: IndexedDatasetError: train_dataset.dataloader.config.data_path: ")
    assert "model.vocab_size is 512" in done.stderr


def test_a_field_of_the_wrong_type_does_not_hide_the_sections_other_problems():
    with pytest.raises(ConfigError) as raised:
        load(*VALID, "training.steps=many", "training.global_batch_size=0", "lr_scheduler.warmup_steps=x",
             "lr_scheduler.learning_rate=0")
    problems = raised.value.problems
    assert "training.steps: expected int, got 'many'" in problems
    assert "training.global_batch_size must be > 0, got 0" in problems  # before: a second round
    assert "lr_scheduler.learning_rate must be > 0" in problems
    assert not any(p.startswith("training.steps must") for p in problems)  # the default stood in, unreported
