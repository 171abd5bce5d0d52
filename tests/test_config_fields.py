"""No training-config field is silently ignored: every dataclass field of every section reachable from
TrainConfig (both dataloader schemas) is either read by the code that consumes configs, refused at a
non-default value (its section's UNSUPPORTED), or checked to one accepted value.

A new field fails here until it is listed in READ with the module that reads it, or refused."""
import ast
import copy
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from training.config import ConfigError, DataloaderConfig, MindDatasetLoaderConfig, Section, TrainConfig, set_field

ROOT = Path(__file__).resolve().parent.parent
CONSUMER_DIRS = ("training", "assets", "resources", "pipelines")

# dotted field path -> where it is read: a module (the field's name occurs there as an attribute, a keyword or
# parameter name, or a string key, as for sections passed whole as keyword arguments), or "module::Qualname"
# for a config.py helper the consumers call (blend_for, document_attention, the dataloader schema choice)
READ = {
    "model": "training/trainer.py",
    **{f"recompute.{name}": "training/recompute.py" for name in ("mode", "full_recompute_layer", "select_module")},
    **{f"lr_scheduler.{name}": "training/optim.py" for name in (
        "type", "learning_rate", "warmup_steps", "warmup_ratio", "warmup_lr_init", "lr_end", "decay_start_steps",
        "decay_start_ratio")},
    "train_dataset.dataloader.type": "training/config.py::DataloaderConfig.from_dict",
    **{f"train_dataset.dataloader.config.{name}": "training/config.py::GPTDatasetConfig.blend_for" for name in (
        "data_path", "train_data_path", "valid_data_path", "test_data_path", "mock", "split")},
    "train_dataset.dataloader.config.create_attention_mask": "training/config.py::GPTDatasetConfig.document_attention",
    **{f"train_dataset.dataloader.config.{name}": "training/data/loader.py" for name in (
        "seq_length", "seed", "path_to_cache", "eod", "pad", "num_dataset_builder_threads", "mmap_bin_files",
        "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "create_compressed_eod_mask",
        "eod_pad_length", "drop_last_partial_validation_sequence", "add_extra_token_to_sequence")},
    "train_dataset.dataloader.sizes": "training/config.py::TrainConfig.split_samples",
    **{f"train_dataset.dataloader.{name}": "training/data/loader.py" for name in ("dataset_files", "shuffle")},
    **{f"kiln.mindrecord.{name}": "training/data/mindrecord.py" for name in (
        "dataset_ratios", "samples_count", "nums_per_dataset", "shuffle_buffer_size", "seed", "pad")},
    **{f"checkpoint.{name}": "training/trainer.py" for name in ("enable_save", "save_interleaved_steps", "load_path")},
    **{f"checkpoint.{name}": "training/train_state.py" for name in (
        "save_path", "save_max", "no_save_optim", "async_save", "prefix", "remove_redundancy", "load_balanced",
        "no_load_optim", "load_worker_number")},
    **{f"training.{name}": "training/trainer.py" for name in (
        "steps", "local_batch_size", "global_batch_size", "max_norm", "use_skip_step_on_nan",
        "max_consecutive_skipped_steps", "seed")},
    "training.deterministic": "training/step.py",
    **{f"kiln.training.{name}": "training/evaluation.py" for name in ("eval_interval", "eval_iters")},
    **{f"kiln.train_state.{name}": "training/monitor.py" for name in ("param_norm", "max_attention_logit")},
    "kiln.parallelism.context_parallel_load_balance": "training/parallel/context_parallel.py",
    **{f"kiln.roots.{name}": "training/trainer.py" for name in ("runs_root", "data_root")},  # into the lineage
    **{f"optimizer.{name}": "training/optim.py" for name in (
        "type", "betas", "eps", "weight_decay", "weight_decay_include", "weight_decay_exclude")},
    **{f"monitor.train_state.{name}": "training/monitor.py" for name in (
        "local_norm", "device_norm", "local_loss", "device_loss")},
    **{f"monitor.health_checkpoint.{name}": "training/monitor.py" for name in (
        "embedding_local_norm_threshold", "global_norm_skip_threshold", "global_norm_skip_time")},
    **{f"monitor.moe_monitor.{name}": "training/monitor.py" for name in (
        "save_tokens_per_expert_interval", "target_layers")},
    **{f"monitor.tensorboard.{name}": "training/monitor.py" for name in ("output_dir", "log_interval", "queue_size")},
    "context.max_device_memory": "training/step.py",
    "context.device_target": "training/step.py",
    "fast_step.compile": "training/step.py",
    "fast_step.compile_reduction": "training/step.py",
    "fast_step.host_blocking_dispatch": "training/run.py",
    "fast_step.fused_cross_entropy": "training/model/ascend.py",
    "parallelism.data_parallel_shard": "training/parallel/mesh.py",
    **{f"parallelism.{name}": "training/parallel/parallelize.py" for name in (
        "data_parallel_shard_strategy", "disable_gradient_division", "reshard_after_forward_policy")},
    "parallelism.sequence_parallel": "training/parallel/parallelize.py",
    "parallelism.tensor_parallel": "training/parallel/mesh.py",
    "parallelism.context_parallel": "training/parallel/mesh.py",
    **{f"parallelism.{name}": "training/parallel/context_parallel.py" for name in (
        "context_parallel_method", "ulysses_degree_in_cp")},
    "parallelism.expert_parallel": "training/parallel/mesh.py",
    "parallelism.pipeline_parallel": "training/parallel/mesh.py",
    **{f"parallelism.{name}": "training/parallel/pipeline.py" for name in (
        "pipeline_parallel_schedule", "pipeline_parallel_interleave_num", "pipeline_parallel_layers_per_stage")},
    "parallelism.dense_fsdp_shard_size": "training/parallel/mesh.py",
    "parallelism.expert_parallel_use_safe_tokens": "training/parallel/expert_parallel.py",
    **{f"profiler.{name}": "training/profiling.py" for name in (
        "enable_profiling", "start_step", "end_step", "output_path", "profiler_rank", "profiler_level", "mstx",
        "profile_memory", "profile_cpu", "with_stack")},
}

# dotted field path -> a value other than the one its section's check() accepts
SINGLE_VALUED = {"context.mode": 0, "train_dataset.dataloader.datasets_type": "MockGPTDataset",
                 "parallelism.moe_token_dispatcher_type": "alltoall_deredundancy"}

BLENDED = {
    "model": {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "compute_dtype": "float32"},
    "lr_scheduler": {"type": "ConstantWarmUpLR"},
    "train_dataset": {"dataloader": {"type": "BlendedMegatronDatasetDataLoader",
                                     "config": {"seq_length": 32, "data_path": ["shard"], "eod": 0}}},
    "checkpoint": {"enable_save": False},
}
MINDRECORD = {**BLENDED, "train_dataset": {"dataloader": {"type": "MindDataset", "dataset_files": "a.mindrecord"}}}
# non-default values a section's check() accepts, where a made-up one would be refused as invalid instead
VALID_NON_DEFAULT = {
    "parallelism.context_parallel_method": "ulysses",
    "parallelism.pipeline_parallel_schedule": "gpipe",
}


def _sections(annotation) -> list[type]:
    found = []
    for candidate in (annotation, *typing.get_args(annotation)):
        if candidate is DataloaderConfig:
            found += DataloaderConfig.TYPES.values()
        elif isinstance(candidate, type) and issubclass(candidate, Section):
            found.append(candidate)
    return found


def leaf_fields(cls: type = TrainConfig, path: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """(dotted path, section class, field) of every non-section field, recursing into sections."""
    hints = typing.get_type_hints(cls)
    leaves = []
    for f in dataclasses.fields(cls):
        dotted = f"{path}.{f.name}" if path else f.name
        sections = _sections(hints[f.name])
        leaves += [leaf for s in sections for leaf in leaf_fields(s, dotted)] if sections else [(dotted, cls, f)]
    return leaves


def _names(node: ast.AST) -> set[str]:
    """Attribute names, keyword and parameter names, and string constants under ``node``."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            names.add(n.arg)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            names.add(n.value)
    return names


def _child(node: ast.AST, name: str) -> ast.AST:
    return next(n for n in ast.iter_child_nodes(node)
                if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)


def names_read_in(spec: str) -> set[str]:
    """The names in a module, or in a config.py method together with the class constants it uses
    (blend_for picks a split's field by name from SPLIT_PATHS)."""
    module, _, qualname = spec.partition("::")
    tree = ast.parse((ROOT / module).read_text())
    if not qualname:
        return _names(tree)
    class_name, method = qualname.split(".")
    cls = _child(tree, class_name)
    names = _names(_child(cls, method))
    for constant in cls.body:
        if isinstance(constant, ast.Assign) and any(getattr(t, "id", None) in names for t in constant.targets):
            names |= _names(constant)
    return names


def _value_for(annotation, default):
    """A value of ``annotation`` other than ``default``."""
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType")):
        member = next(m for m in typing.get_args(annotation) if m is not type(None))
        return _value_for(member, None)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return [_value_for(item, None)]
    if annotation is bool:
        return not default
    if annotation is int:
        return 2 if default is None else default + 2
    if annotation is float:
        return 2.0 if default is None else default * 2 + 1
    if annotation is str:
        return "kiln-test"
    if annotation is dict or typing.get_origin(annotation) is dict:
        return {"kiln_test": 1}
    raise AssertionError(f"no sample value for {annotation!r}")


LEAVES = leaf_fields()
REFUSED = [(path, cls, f) for path, cls, f in LEAVES if f.name in cls.UNSUPPORTED]


def test_every_field_is_read_refused_or_single_valued():
    unaccounted = sorted(path for path, cls, f in LEAVES
                         if f.name not in cls.UNSUPPORTED and path not in READ and path not in SINGLE_VALUED)
    assert not unaccounted, (f"fields nothing reads and nothing refuses: {unaccounted}; make them take effect "
                             "(and list them in READ) or add them to their section's UNSUPPORTED")
    # a path names one field in each dataloader schema that has it (shuffle: refused in one, read in the other)
    accepted = {path for path, cls, f in LEAVES if f.name not in cls.UNSUPPORTED}
    listed = set(READ) | set(SINGLE_VALUED)
    assert listed <= accepted, f"listed, but no such field or refused: {sorted(listed - accepted)}"


@pytest.mark.parametrize("path", sorted(READ))
def test_a_read_field_is_read_where_listed(path):
    spec = READ[path]
    assert not spec.startswith("training/config.py") or "::" in spec, "config.py itself validates, not consumes"
    assert path.rsplit(".", 1)[-1] in names_read_in(spec), f"{path}: its name does not occur in {spec}"


def test_config_py_helpers_listed_in_read_are_called_by_the_consumers():
    helpers = {spec.rsplit(".", 1)[-1] for spec in READ.values() if "::" in spec} - {"from_dict"}
    outside = set()
    for directory in CONSUMER_DIRS:
        for module in (ROOT / directory).rglob("*.py"):
            if module != ROOT / "training/config.py":
                outside |= _names(ast.parse(module.read_text()))
    assert helpers and helpers <= outside, f"helpers nothing outside config.py calls: {helpers - outside}"


@pytest.mark.parametrize("path,cls,f", REFUSED, ids=[path for path, _, _ in REFUSED])
def test_a_refused_field_at_a_non_default_value_is_an_error_naming_it(path, cls, f):
    base = MINDRECORD if cls is MindDatasetLoaderConfig else BLENDED
    TrainConfig.from_dict(copy.deepcopy(base))  # the default is accepted
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    value = VALID_NON_DEFAULT.get(path, _value_for(typing.get_type_hints(cls)[f.name], default))
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)} = .* is not supported yet \(.+\)"):
        TrainConfig.from_dict(set_field(copy.deepcopy(base), path, value))


@pytest.mark.parametrize("path", sorted(SINGLE_VALUED))
def test_a_single_valued_field_refuses_another_value_naming_it(path):
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}\b"):
        TrainConfig.from_dict(set_field(copy.deepcopy(BLENDED), path, SINGLE_VALUED[path]))


def test_max_device_memory_caps_ascend_memory_and_is_refused_on_cpu():
    base = set_field(copy.deepcopy(BLENDED), "context.max_device_memory", "30GB")
    assert TrainConfig.from_dict(set_field(base, "context.device_target", "Ascend")).context.caps_device_memory
    with pytest.raises(ConfigError, match=r"^context\.max_device_memory = '30GB' has no effect on CPU"):
        TrainConfig.from_dict(set_field(base, "context.device_target", "CPU"))
    assert not TrainConfig.from_dict(copy.deepcopy(BLENDED)).context.caps_device_memory
