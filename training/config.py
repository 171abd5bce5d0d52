"""Training config: MindFormers' dynamic-graph YAML layout, one dataclass per top-level section.

Loading is strict where MindFormers is lenient: an unknown key anywhere is an error naming its dotted
path and the nearest valid key, and a field Kiln accepts but does not implement yet is an error as soon
as it leaves its default (``UNSUPPORTED``), so nothing in a user's YAML is silently ignored. The YAML may not
repeat a key nor expand aliases past a bound (``parse_yaml``); numbers that size something are bounded
(``LIMITS``, the model section's ``MODEL_LIMITS``); every problem of a config comes in one ConfigError, unknown
keys first (``parse_config``). Kiln's own settings live in the top-level sections ``fast_step`` and ``kiln``,
which MindFormers' loader ignores, so a YAML Kiln writes loads there unchanged (docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """One or more training config problems; each message names the dotted path of its field.

    A config is checked whole: ``problems`` lists everything wrong with it, unknown keys (the likelier typos,
    whose misspelt value the other problems may stem from) first."""

    def __init__(self, *problems: str, unknown: typing.Sequence[str] = ()):
        self.unknown = [_clipped(u) for u in unknown]
        self.problems = self.unknown + [p for p in map(_clipped, problems) if p not in self.unknown]
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)

    @classmethod
    def merged(cls, errors: typing.Iterable["ConfigError"]) -> "ConfigError":
        errors = list(errors)
        return cls(*(p for e in errors for p in e.problems), unknown=[u for e in errors for u in e.unknown])

    def located(self, where: str) -> "ConfigError":
        """The same problems, said to be in ``where`` (a file)."""
        located = ConfigError.merged([self])
        located.args = (f"{where}: {self._render()}",)
        return located


_PROBLEM_CHARS = 1000  # a problem longer than this echoes a value too long to show: its middle is cut


def _clipped(problem: str) -> str:
    if len(problem) <= _PROBLEM_CHARS:
        return problem
    cut = len(problem) - _PROBLEM_CHARS
    return f"{problem[:_PROBLEM_CHARS - 300]} ...({cut:,} characters cut)... {problem[-300:]}"


# PyYAML follows YAML 1.1, where `1e-5` (no dot) is a string; MindFormers users write it that way.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Check ``value`` against a field annotation and convert nested sections; raise ConfigError."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = typing.get_args(annotation)
        if value is None and type(None) in members:
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(value, member, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{path}: expected {_type_name(annotation)}, got {shown(value)}")
    if hasattr(annotation, "from_dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping (section {annotation.__name__}), got {shown(value)}")
        return annotation.from_dict(value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {shown(value)}")
        (item_type,) = typing.get_args(annotation)[:1] or (Any,)
        return [_coerce(v, item_type, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {shown(value)}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool, got {shown(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {shown(value)}")
        if not -2**63 <= value < 2**63:
            raise ConfigError(f"{path}: {shown(value)} does not fit in 64 bits")
        return value
    if annotation is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {shown(value)}")
        if not math.isfinite(float(value)):
            raise ConfigError(f"{path}: expected a finite number, got {shown(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {shown(value)}")
        return value
    raise TypeError(f"{path}: unsupported annotation {annotation!r}")  # a bug in this module, not in YAML


# Top-level sections of MindFormers' graph-mode YAML (run_mindformer.py), which its PyNative trainer and Kiln
# do not read, and where their settings go in the PyNative layout
GRAPH_MODE_SECTIONS = {
    "runner_config": "training (steps, local_batch_size, global_batch_size) and checkpoint",
    "parallel_config": "parallelism (tensor_parallel, pipeline_parallel, ...)",
    "use_parallel": "parallelism (the degrees; msrun's worker count decides the rest)",
    "runner_wrapper": "training (max_norm) and optimizer",
}
# How close a misspelling must be to a key to be suggested (difflib's ratio; its default 0.6 offered
# lora_config for runner_config, 0.67)
_SUGGEST_CUTOFF = 0.75


def unknown_key_error(key: str, valid: typing.Iterable[str], path: str) -> ConfigError:
    valid = sorted(valid)
    near = difflib.get_close_matches(key, valid, n=1, cutoff=_SUGGEST_CUTOFF)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
    if not path and key in GRAPH_MODE_SECTIONS:
        hint = (f": a section of MindFormers' graph-mode YAML, which its PyNative trainer (and Kiln) does not read; "
                f"its settings go in {GRAPH_MODE_SECTIONS[key]}")
    return ConfigError(unknown=[f"{path}.{key}: unknown key{hint}" if path else
                                f"{key}: unknown top-level section{hint}"])


class Section:
    """Base of every config section: strict ``from_dict`` plus ``UNSUPPORTED`` default-only fields."""

    # field name -> why Kiln refuses a non-default value (accepted and validated, but must stay default).
    # Every field is either read by the code that consumes configs or listed here: tests/test_config_fields.py.
    UNSUPPORTED: typing.ClassVar[dict[str, str]] = {}
    # field name -> values MindFormers' own YAMLs write for "the default" (e.g. null for "auto"), accepted as it
    SAME_AS_DEFAULT: typing.ClassVar[dict[str, tuple]] = {}
    # former Kiln-only key -> where it lives now (the kiln section): named when an old config still has it
    MOVED: typing.ClassVar[dict[str, str]] = {}
    # former key -> why nothing reads it now: named when an old config still has it
    DROPPED: typing.ClassVar[dict[str, str]] = {}
    # field name -> (largest value accepted, why): past it a number would overflow or exhaust memory in numpy or
    # MindSpore, after launch and without naming the field
    LIMITS: typing.ClassVar[dict[str, tuple[int, str]]] = {}

    @classmethod
    def from_dict(cls, data: dict, path: str = "") -> "Section":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path or '<root>'}: expected a mapping, got {shown(data)}")
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        errors: list[ConfigError] = []  # every problem of the section and the sections inside it
        kwargs = {}
        for key, value in data.items():
            if key in cls.MOVED:
                errors.append(ConfigError(unknown=[
                    f"{_join(path, key)} is Kiln's own setting and moved to {cls.MOVED[key]}: MindFormers refuses "
                    f"keys it does not know in {path or 'this section'}, so Kiln keeps its own in the top-level "
                    f"kiln section"]))
                continue
            if key in cls.DROPPED:
                errors.append(ConfigError(unknown=[f"{_join(path, key)} is no longer read: {cls.DROPPED[key]}; "
                                                   f"drop it"]))
                continue
            if key not in names:
                errors.append(unknown_key_error(str(key), names, path))
                continue
            try:
                kwargs[key] = _coerce(value, hints[key], _join(path, key))
            except ConfigError as exc:
                errors.append(exc)
        missing = [f.name for f in fields if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        errors += [ConfigError(f"{_join(path, name)}: required, but missing") for name in missing]
        errors += [ConfigError(f"{_join(path, name)} = {kwargs[name]:,} is more than {high:,}: {why}")
                   for name, (high, why) in cls.LIMITS.items() if _number(kwargs.get(name)) and kwargs[name] > high]
        # the value checks relate fields to each other: a field whose value failed takes its default for them,
        # and what they then say of that field is left out (its own problem is already reported)
        failed = [key for key in data if key in names and key not in kwargs]
        required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if all(name in kwargs for name in required):
            section = cls(**kwargs)
            try:
                section.check(path)
            except ConfigError as exc:
                errors.append(ConfigError(*(p for p in exc.problems
                                            if not any(_names_field(p, _join(path, key)) for key in failed))))
            errors += [e for e in section._unsupported(path) if not failed]
        if errors:
            raise ConfigError.merged(errors)
        return section

    def _unsupported(self, path: str) -> list[ConfigError]:
        fields = {f.name: f for f in dataclasses.fields(self)}
        errors = []
        for name, reason in self.UNSUPPORTED.items():
            f = fields[name]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = getattr(self, name)
            if value != default and value not in self.SAME_AS_DEFAULT.get(name, ()):
                errors.append(ConfigError(f"{_join(path, name)} = {value!r} is not supported yet ({reason})"))
        return errors

    def check(self, path: str) -> None:
        """Per-section value checks; override."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _names_field(problem: str, dotted: str) -> bool:
    """Whether ``problem`` speaks of the field ``dotted`` (or of what is inside it)."""
    return re.search(rf"(?<![\w.]){re.escape(dotted)}(?![\w])", problem) is not None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The bounds of LIMITS, named once
STEPS_LIMIT = (10**9, "a billion steps is past any training run; a larger number is a typo")
SEED_LIMIT = (2**32 - 1, "numpy's seeds are 32-bit")
TOKEN_ID_LIMIT = (2**31 - 1, "token ids are int32 in the samples and the embedding lookup")
BATCH_LIMIT = (2**24, "a step of more samples than that is past any training run")
WORKERS_LIMIT = (2**16, "more threads or workers than any machine runs")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class CheckpointConfig(Section):
    enable_save: bool = True
    save_path: str = ""
    save_max: int = 5
    save_interleaved_steps: int = 1000
    no_save_optim: bool = False
    async_save: bool = False
    prefix: Optional[str] = "checkpoint"
    remove_redundancy: bool = False
    load_path: str = ""
    save_trainable_only: bool = False
    base_load_path: str = ""
    load_balanced: bool = False
    no_load_optim: bool = False
    load_worker_number: int = 1
    save_global_layout_cache: bool = True
    reshard_worker_num: int = 1

    LIMITS = {"save_max": (10**6, "checkpoints kept on disk"), "save_interleaved_steps": STEPS_LIMIT,
              "load_worker_number": WORKERS_LIMIT}
    UNSUPPORTED = {
        "save_trainable_only": "LoRA is not implemented",
        "base_load_path": "LoRA base weights are not implemented",
        "save_global_layout_cache": "Kiln keeps no gathered layout between saves: parameters are replicated, so "
                                    "every rank's layout is the whole tensor",
        "reshard_worker_num": "Kiln reshards a checkpoint in the loading process, one thread per rank",
    }

    def check(self, path):
        require(self.save_max >= 1, f"{path}.save_max must be >= 1, got {self.save_max}")
        require(self.save_interleaved_steps >= 1,
                 f"{path}.save_interleaved_steps must be >= 1, got {self.save_interleaved_steps}")
        require(not (self.enable_save and not self.save_path),
                 f"{path}.save_path must be set when {path}.enable_save is true")
        # MindFormers declares it without a use; in Kiln it is how many ranks read from disk under load_balanced
        require(self.load_worker_number >= 1, f"{path}.load_worker_number must be >= 1, got {self.load_worker_number}")


@dataclass
class TrainingConfig(Section):
    steps: int = 1000
    local_batch_size: int = 1
    global_batch_size: int = 1
    max_norm: float = 1.0
    use_skip_step_on_nan: bool = False
    max_consecutive_skipped_steps: int = 0
    seed: int = 42
    deterministic: bool = False
    rampup_batch_size: Optional[list[int]] = None

    UNSUPPORTED = {"rampup_batch_size": "batch-size ramp-up is not implemented"}
    LIMITS = {"steps": STEPS_LIMIT, "local_batch_size": BATCH_LIMIT, "global_batch_size": BATCH_LIMIT,
              "max_consecutive_skipped_steps": STEPS_LIMIT, "seed": SEED_LIMIT}
    MOVED = {"eval_interval": "kiln.training.eval_interval", "eval_iters": "kiln.training.eval_iters"}

    def check(self, path):
        for name in ("steps", "local_batch_size", "global_batch_size"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        require(self.max_norm > 0, f"{path}.max_norm must be > 0 (it scales gradients), got {self.max_norm}")
        require(self.max_consecutive_skipped_steps >= 0, f"{path}.max_consecutive_skipped_steps must be >= 0")


@dataclass
class ParallelismConfig(Section):
    data_parallel_shard: int = -1
    data_parallel_shard_strategy: str = "optim_grads_params"
    reshard_after_forward_policy: str = "default"
    cpu_offload: bool = False
    disable_gradient_division: bool = True
    dense_fsdp_shard_size: Optional[int] = None
    tensor_parallel: int = 1
    context_parallel: int = 1
    context_parallel_method: str = "colossal"
    context_parallel_async: bool = False
    ulysses_degree_in_cp: Optional[int] = None
    context_parallel_mask_type: str = "causal"
    pipeline_parallel: int = 1
    pipeline_parallel_layers_per_stage: Optional[Union[list[list[int]], list[str], str]] = "auto"
    pipeline_parallel_schedule: str = "1f1b"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_interleave_num: int = 1
    pipeline_parallel_overlap_p2p: bool = False
    pipeline_parallel_overlap_b_f: bool = False
    pipeline_parallel_enable_dxdw_split: bool = False
    pipeline_parallel_p2p_transport: str = "plain"
    sequence_parallel: bool = False
    enable_mc2: bool = False
    enable_loss_parallel: bool = False
    expert_parallel: int = 1
    npu_nums_per_device: int = 8
    moe_token_dispatcher_type: str = "alltoall"
    expert_parallel_async_d2h: bool = False
    expert_parallel_use_safe_tokens: bool = True

    # the options of layouts that do not exist yet are accepted only at their defaults
    _BLOCKING_P2P = ("overlapping pipeline transfers with computation is not implemented: MindSpore's CPU "
                     "collectives, which the stages' point-to-point transfers are built from, block until done")
    UNSUPPORTED = {
        "cpu_offload": "optimizer offload is not implemented",
        "context_parallel_async": "overlapping the Ulysses all-to-all with computation is not implemented: "
                                  "MindSpore's collectives on CPU block until done",
        # MindFormers' CP also knows only the causal mask; a document (EOD) mask is refused with its fields
        "context_parallel_mask_type": "only the causal mask is split across context-parallel chunks",
        # MindFormers overwrites it with the number of micro-batches per step; Kiln derives that number from
        # global_batch_size / (local_batch_size × data parallel) and never reads this field
        "pipeline_parallel_microbatch_size": "the micro-batches per step come from training.global_batch_size / "
                                             "(local_batch_size × data parallel); this field is not read",
        "pipeline_parallel_overlap_p2p": _BLOCKING_P2P,
        "pipeline_parallel_overlap_b_f": _BLOCKING_P2P,
        "pipeline_parallel_enable_dxdw_split": "splitting the backward into input and weight gradients serves only "
                                               "pipeline_parallel_overlap_b_f, which is not implemented",
        "pipeline_parallel_p2p_transport": "stages exchange hidden states as a 2-rank broadcast (send/recv do not "
                                           "work on CPU); no other transport is implemented",
        "enable_mc2": "fused all-gather+matmul / matmul+reduce-scatter kernels (Ascend MC2) are not implemented: "
                      "tensor parallelism runs the collective and the matmul as separate ops",
        # MindFormers reads it nowhere either: its loss is vocabulary-parallel whenever tensor_parallel > 1
        "enable_loss_parallel": "the loss is always vocabulary-parallel when tensor_parallel > 1 (as in "
                                "MindFormers, which reads this field nowhere); leave it false",
        "npu_nums_per_device": "read only by moe_token_dispatcher_type alltoall_deredundancy, which is not "
                               "implemented",
        # the counts are needed on the host before the dispatch (the rows are ordered by expert there)
        "expert_parallel_async_d2h": "the per-expert token counts are copied to the host synchronously: Kiln orders "
                                     "the tokens by expert on the host before the all-to-all, so there is no copy "
                                     "to overlap with the dispatch (and a compiled step, which all-gathers the "
                                     "tokens instead, copies none)",
    }
    # MindFormers' shipped pynative YAMLs write null for the automatic stage split
    SAME_AS_DEFAULT = {"pipeline_parallel_layers_per_stage": (None,)}
    MOVED = {"context_parallel_load_balance": "kiln.parallelism.context_parallel_load_balance"}

    def check(self, path):
        require(self.tensor_parallel >= 1, f"{path}.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        # MindFormers' ParallelismConfig refuses the same: its PyNative tensor parallelism is sequence parallel
        require(self.tensor_parallel == 1 or self.sequence_parallel,
                f"{path}.tensor_parallel = {self.tensor_parallel} needs {path}.sequence_parallel: true "
                "(MindFormers' PyNative tensor parallelism always shards activations along the sequence)")
        require(self.data_parallel_shard == -1 or self.data_parallel_shard > 0,
                 f"{path}.data_parallel_shard must be -1 or > 0, got {self.data_parallel_shard}")
        require(self.data_parallel_shard_strategy in FSDP_STRATEGIES,
                f"{path}.data_parallel_shard_strategy must be one of {', '.join(FSDP_STRATEGIES)}, got "
                f"{self.data_parallel_shard_strategy!r}")
        require(self.reshard_after_forward_policy in ("default", "always", "never"),
                 f"{path}.reshard_after_forward_policy must be default/always/never")
        require(self.context_parallel_method in ("colossal", "ulysses", "hybrid"),
                 f"{path}.context_parallel_method must be colossal/ulysses/hybrid")
        cp, ulysses = self.context_parallel, self.ulysses_degree_in_cp
        if self.context_parallel_method == "hybrid" and cp > 1:
            require(ulysses is not None and 1 < ulysses < cp and cp % ulysses == 0,
                    f"{path}.ulysses_degree_in_cp = {ulysses}: context_parallel_method 'hybrid' needs a Ulysses "
                    f"degree strictly between 1 and {path}.context_parallel ({cp}) that divides it")
        else:
            require(ulysses is None, f"{path}.ulysses_degree_in_cp = {ulysses} is read only by "
                                     f"context_parallel_method 'hybrid' with context_parallel > 1; leave it null")
        require(self.pipeline_parallel_interleave_num >= 1,
                f"{path}.pipeline_parallel_interleave_num must be >= 1, got {self.pipeline_parallel_interleave_num}")
        require(self.pipeline_parallel_schedule in ("1f1b", "interleaved_1f1b", "gpipe"),
                 f"{path}.pipeline_parallel_schedule must be 1f1b/interleaved_1f1b/gpipe")
        require(self.moe_token_dispatcher_type in ("alltoall", "alltoall_deredundancy"),
                 f"{path}.moe_token_dispatcher_type must be alltoall/alltoall_deredundancy")
        require(self.moe_token_dispatcher_type == "alltoall",
                f"{path}.moe_token_dispatcher_type: alltoall_deredundancy is not implemented: it is MindFormers' "
                "two-level dispatch for multi-node Ascend clusters (all-gather across nodes, all-to-all inside a "
                "node of npu_nums_per_device ranks), which saves inter-node bandwidth; Kiln's CPU all-to-all is "
                "built from all-gathers already, so it would save nothing here. Use alltoall")


# ZeRO-1, -2 and -3: what data_parallel_shard_strategy shards (training/parallel/fsdp.py)
FSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


@dataclass
class OptimizerConfig(Section):
    type: str = "AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.01
    weight_decay_include: list[str] = field(default_factory=list)
    weight_decay_exclude: list[str] = field(default_factory=list)

    def check(self, path):
        require(self.type == "AdamW", f"{path}.type = {self.type!r} is not supported yet (AdamW only)")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"{path}.betas must be two numbers in [0, 1), got {self.betas}")
        require(self.eps > 0, f"{path}.eps must be > 0")
        require(self.weight_decay >= 0, f"{path}.weight_decay must be >= 0")


@dataclass
class LrSchedulerConfig(Section):
    type: str
    learning_rate: float = 1e-5
    warmup_steps: Optional[int] = None
    warmup_ratio: Optional[float] = None
    warmup_lr_init: float = 0.0
    lr_end: Optional[float] = None  # unset: the schedule's default (MindFormers' WSD: 1e-7, others: 0)
    decay_start_steps: Optional[int] = None  # WarmUpStableDecayLR: where the stable phase ends
    decay_start_ratio: Optional[float] = None

    SCHEDULES = ("ConstantWarmUpLR", "LinearWithWarmUpLR", "CosineWithWarmUpLR", "WarmUpStableDecayLR")
    LIMITS = {"warmup_steps": STEPS_LIMIT, "decay_start_steps": STEPS_LIMIT}

    def check(self, path):
        require(self.type in self.SCHEDULES,
                 f"{path}.type = {self.type!r} is not supported yet; supported: {', '.join(self.SCHEDULES)}")
        require(self.learning_rate > 0, f"{path}.learning_rate must be > 0")
        require(self.warmup_steps is None or self.warmup_ratio is None,
                 f"{path}: set warmup_steps or warmup_ratio, not both")
        require(self.warmup_ratio is None or 0 <= self.warmup_ratio <= 1, f"{path}.warmup_ratio must be in [0, 1]")
        require(self.warmup_steps is None or self.warmup_steps >= 0, f"{path}.warmup_steps must be >= 0")
        # errors, not warnings: a schedule that rises where it should fall (or the reverse) is no choice of rate
        if self.lr_end is not None and self.lr_end > self.learning_rate:
            raise ConfigError(f"{path}.lr_end ({self.lr_end:g}) is above {path}.learning_rate ({self.learning_rate:g}): "
                              f"the decay would raise the learning rate; set lr_end below it (or leave it unset)")
        if self.warmup_lr_init > self.learning_rate:
            raise ConfigError(f"{path}.warmup_lr_init ({self.warmup_lr_init:g}) is above {path}.learning_rate "
                              f"({self.learning_rate:g}): the warm-up would lower the learning rate")
        if self.type == "WarmUpStableDecayLR":
            require((self.decay_start_steps is None) != (self.decay_start_ratio is None),
                    f"{path}: WarmUpStableDecayLR needs decay_start_steps or decay_start_ratio (exactly one)")
            require(self.decay_start_ratio is None or 0 <= self.decay_start_ratio <= 1,
                    f"{path}.decay_start_ratio must be in [0, 1]")
            require(self.decay_start_steps is None or self.decay_start_steps >= 0,
                    f"{path}.decay_start_steps must be >= 0")
        else:
            for name in ("decay_start_steps", "decay_start_ratio"):
                require(getattr(self, name) is None, f"{path}.{name} applies to WarmUpStableDecayLR only")


_DATA_CONFIG = "train_dataset.dataloader.config"  # where GPTDatasetConfig sits in the YAML
SPLITS = ("train", "valid", "test")  # the dataset splits, in the order of `split` ratios and `sizes`


@dataclass
class GPTDatasetConfig(Section):
    seq_length: int
    # Where samples come from, exactly one of: one blend cut into splits by `split`; a blend per split;
    # or Megatron's mock data. A blend is [weight, prefix, weight, prefix, ...] or [prefix, ...].
    data_path: Optional[list[Union[float, str]]] = None
    train_data_path: Optional[list[Union[float, str]]] = None
    valid_data_path: Optional[list[Union[float, str]]] = None
    test_data_path: Optional[list[Union[float, str]]] = None
    mock: bool = False  # Megatron's mock_data; MindFormers falls back to it silently when no blend is set
    split: Optional[str] = None  # with data_path or mock; unset means "1,0,0"
    seed: int = 1234
    path_to_cache: Optional[str] = None
    eod: int = -1
    pad: int = -1
    num_dataset_builder_threads: int = 1
    mmap_bin_files: Optional[bool] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True  # the model applies the causal mask itself
    create_compressed_eod_mask: bool = False
    eod_pad_length: int = 128
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True

    SPLIT_PATHS = ("train_data_path", "valid_data_path", "test_data_path")
    LIMITS = {"seq_length": (2**24, "16M tokens per sample is past any model's context"), "seed": SEED_LIMIT,
              "eod": TOKEN_ID_LIMIT, "pad": TOKEN_ID_LIMIT, "eod_pad_length": (2**24, "more document ends than "
                                                                                    "tokens in any sample"),
              "num_dataset_builder_threads": WORKERS_LIMIT}

    def check(self, path):
        require(self.seq_length > 0, f"{path}.seq_length must be > 0")
        per_split = [name for name in self.SPLIT_PATHS if getattr(self, name) is not None]
        chosen = (["data_path"] if self.data_path is not None else []) + per_split + (["mock"] if self.mock else [])
        require(chosen, f"{path}: no data: set data_path, train_data_path (with valid_/test_data_path), "
                        f"or mock: true for Megatron's mock data")
        require(not (self.mock and self.data_path is not None),
                f"{path}: mock: true trains on Megatron's mock documents, and data_path names a blend: set "
                f"{path}.data_path: null to train on mock data (a shipped config's data_path: [] too, which "
                f"training_run fills), or drop mock")
        require(len(chosen) == 1 or not (self.data_path is not None or self.mock),
                f"{path}: {' and '.join(chosen)} exclude each other: data_path with split, a blend per split, "
                f"or mock")
        if per_split:
            require(self.split is None,
                    f"{path}.split applies to data_path or mock; {per_split[0]} already names a split's blend")
            require(self.train_data_path is not None, f"{path}.train_data_path is missing: training reads the "
                                                      f"train split")
        for name in ["data_path"] * (self.data_path is not None) + per_split:
            blend = getattr(self, name)
            require(not isinstance(blend, str) and len(blend) > 0,
                    f"{path}.{name} must be a non-empty list [weight, prefix, ...] or [prefix, ...]")
        if self.split is not None:
            ratios = self.split.split(",")
            require(1 <= len(ratios) <= 3 and all(_FLOAT_RE.match(r.strip()) for r in ratios),
                    f"{path}.split must be up to three comma-separated ratios like '99,1,0', got {self.split!r}")
            require(float(ratios[0]) > 0, f"{path}.split gives the training split no documents: {self.split!r}")
        require(self.eod >= 0, f"{path}.eod must be the tokenizer's end-of-document id, got {self.eod}")
        # MindFormers silently ignores reset_attention_mask when no mask is produced; Kiln says so
        require(not self.reset_attention_mask or self.create_attention_mask or self.create_compressed_eod_mask,
                f"{path}.reset_attention_mask needs create_attention_mask or create_compressed_eod_mask")
        require(self.eod_pad_length > 0, f"{path}.eod_pad_length must be > 0")
        require(self.num_dataset_builder_threads >= 1, f"{path}.num_dataset_builder_threads must be >= 1")

    def blend_for(self, split_index: int) -> tuple[Optional[list], str, str]:
        """(blend list or None for mock data, split string, YAML path) that split `split_index` reads.
        A per-split blend is read whole: its split string gives that split every document."""
        if self.data_path is not None or self.mock:
            return self.data_path, self.split or "1,0,0", f"{_DATA_CONFIG}.data_path"
        name = self.SPLIT_PATHS[split_index]
        blend = getattr(self, name)
        if blend is None:
            raise ConfigError(f"{_DATA_CONFIG}.{name} is not set: this config has no "
                              f"{name.split('_')[0]} split")
        return blend, ",".join("1" if k == split_index else "0" for k in range(3)), f"{_DATA_CONFIG}.{name}"

    @property
    def document_attention(self) -> bool:
        """Attention must stop at document ends (the model's plain causal mask is not enough)."""
        return self.create_compressed_eod_mask or (self.create_attention_mask and self.reset_attention_mask)


@dataclass
class BlendedMegatronLoaderConfig(Section):
    """``type: BlendedMegatronDatasetDataLoader``: Megatron .bin/.idx sources blended by weight."""
    type: str
    config: GPTDatasetConfig
    datasets_type: str = "GPTDataset"
    sizes: Optional[list[int]] = None
    shuffle: bool = False
    column_names: list[str] = field(default_factory=lambda: ["input_ids", "labels", "loss_mask", "position_ids"])
    python_multiprocessing: bool = False

    UNSUPPORTED = {
        "shuffle": "sample order comes from GPTDataset's seeded shuffle index",
        "column_names": "Kiln's GPTDataset items always carry input_ids, labels, loss_mask and position_ids "
                        "(plus attention_mask or actual_seq_len when config asks for document masks)",
        "python_multiprocessing": "Kiln reads samples in the training process, not through a MindSpore "
                                  "GeneratorDataset with worker processes",
    }

    def check(self, path):
        require(self.datasets_type == "GPTDataset", f"{path}.datasets_type must be GPTDataset")
        require(self.sizes is None or (len(self.sizes) == 3 and all(n >= 0 for n in self.sizes)),
                f"{path}.sizes must be three sample counts [train, valid, test], got {self.sizes}")
        require(self.sizes is None or self.sizes[0] > 0,
                f"{path}.sizes[0] is the train split's sample count and must be > 0 (leave sizes unset for "
                f"training.steps x training.global_batch_size), got {self.sizes}")


@dataclass
class MindDatasetLoaderConfig(Section):
    """``type: MindDataset``: MindRecord files (``kiln mindrecord`` writes them). The section holds what
    MindFormers' PyNative trainer hands to ``mindspore.dataset.MindDataset`` (column_names as columns_list), so
    the same YAML reads the same files there; several sources are blended as ``kiln.mindrecord`` says
    (training/data/mindrecord.py)."""
    type: str
    dataset_files: Union[str, list[str]]
    shuffle: bool = False  # MindFormers' default
    column_names: list[str] = field(default_factory=lambda: ["input_ids"])
    python_multiprocessing: bool = False

    UNSUPPORTED = {
        "column_names": "Kiln's MindDataset reader takes the input_ids column only and derives labels, "
                        "loss_mask and position_ids from it",
        "python_multiprocessing": "Kiln reads samples in the training process, not through a MindSpore "
                                  "dataset pipeline with worker processes",
    }
    # MindFormers passes every key of this section to mindspore.dataset.MindDataset, which takes none of these
    MOVED = {name: f"kiln.mindrecord.{name}" for name in (
        "dataset_ratios", "samples_count", "nums_per_dataset", "shuffle_buffer_size", "seed", "pad")}
    DROPPED = {"eod": "a MindDataset item's labels, loss mask and positions come from input_ids alone, as in "
                      "MindFormers, so no end-of-document id is read"}


@dataclass
class KilnMindRecordConfig(Section):
    """How a ``MindDataset`` dataloader blends its ``dataset_files`` sources (MindFormers' PyNative trainer reads
    them as one MindDataset; these are MultiSourceDataLoader's keys): per-source counts from ``dataset_ratios`` ×
    ``samples_count`` or ``nums_per_dataset`` (neither: every source whole), interleaved in windows of
    ``shuffle_buffer_size`` when the section's ``shuffle`` is on, every order drawn from ``seed``. ``pad``: the id
    the samples were padded with (masked in the labels; -1: none)."""
    dataset_ratios: Optional[list[float]] = None
    samples_count: Optional[int] = None
    nums_per_dataset: Optional[list[int]] = None
    shuffle_buffer_size: int = 320
    seed: int = 1234
    pad: int = -1

    LIMITS = {"samples_count": (2**40, "past any corpus"), "shuffle_buffer_size": (2**24, "a window past any "
                                                                                          "corpus' sources"),
              "seed": SEED_LIMIT, "pad": TOKEN_ID_LIMIT}

    def check(self, path):
        require(self.shuffle_buffer_size >= 1, f"{path}.shuffle_buffer_size must be >= 1, got "
                                               f"{self.shuffle_buffer_size}")
        require(self.seed >= 0, f"{path}.seed must be >= 0, got {self.seed}")


class DataloaderConfig:
    """``train_dataset.dataloader``: the section's schema is chosen by its ``type``."""
    TYPES = {"BlendedMegatronDatasetDataLoader": BlendedMegatronLoaderConfig, "MindDataset": MindDatasetLoaderConfig}

    @classmethod
    def from_dict(cls, data: dict, path: str):
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in cls.TYPES:
            raise ConfigError(f"{path}.type = {kind!r} is not supported; supported: {', '.join(cls.TYPES)}")
        return cls.TYPES[kind].from_dict(data, path)


@dataclass
class TrainDatasetConfig(Section):
    dataloader: DataloaderConfig
    drop_remainder: bool = True
    num_parallel_workers: int = 8
    prefetch_size: int = 1
    numa_enable: bool = False
    use_distribute_dataset: bool = False
    balance_enabled: bool = False

    _NO_PIPELINE = ("Kiln reads each micro-batch in the training process, not through MindSpore's dataset "
                    "pipeline")
    UNSUPPORTED = {"use_distribute_dataset": "every rank reads its own samples",
                   "balance_enabled": "it needs compressed EOD masks",
                   "drop_remainder": "Kiln reads exactly training.steps × global_batch_size samples, so there "
                                     "is never a partial batch to keep",
                   "num_parallel_workers": _NO_PIPELINE,
                   "prefetch_size": _NO_PIPELINE,
                   "numa_enable": _NO_PIPELINE}


@dataclass
class TrainStateConfig(Section):
    """What each field reports: training/monitor.py."""
    local_norm: Union[bool, str, list[str]] = ""
    device_norm: Union[bool, str, list[str]] = False
    local_loss: bool = False
    device_loss: bool = False

    MOVED = {"param_norm": "kiln.train_state.param_norm", "max_attention_logit": "kiln.train_state.max_attention_logit"}


@dataclass
class HealthCheckpointConfig(Section):
    embedding_local_norm_threshold: float = 100.0
    global_norm_skip_threshold: float = 100.0
    global_norm_skip_time: int = 10

    def check(self, path):
        for name in ("embedding_local_norm_threshold", "global_norm_skip_threshold"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        require(self.global_norm_skip_time >= 1,
                f"{path}.global_norm_skip_time must be >= 1, got {self.global_norm_skip_time}")


@dataclass
class TensorboardConfig(Section):
    """TensorBoard event files (training/monitor.py TensorBoardWriter), written when ``output_dir`` is set.
    ``log_interval`` is also how often a Dagster launch records the step's scalars as an observation."""
    output_dir: str = ""
    log_interval: int = 1
    queue_size: int = 1000

    def check(self, path):
        require(self.log_interval >= 1, f"{path}.log_interval must be >= 1, got {self.log_interval}")
        require(self.queue_size >= 1, f"{path}.queue_size must be >= 1, got {self.queue_size}")


@dataclass
class MoeMonitorConfig(Section):
    save_tokens_per_expert_interval: Optional[int] = None
    target_layers: Optional[Union[int, list[int]]] = None

    def check(self, path):
        require(self.save_tokens_per_expert_interval is None or self.save_tokens_per_expert_interval > 0,
                f"{path}.save_tokens_per_expert_interval must be > 0, got {self.save_tokens_per_expert_interval}")
        layers = self.target_layers
        require(layers is None or (layers > 0 if isinstance(layers, int) else all(i >= 0 for i in layers)),
                f"{path}.target_layers must be a positive count or a list of layer indices, got {layers}")


@dataclass
class MonitorConfig(Section):
    train_state: TrainStateConfig = field(default_factory=TrainStateConfig)
    health_checkpoint: HealthCheckpointConfig = field(default_factory=HealthCheckpointConfig)
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    moe_monitor: MoeMonitorConfig = field(default_factory=MoeMonitorConfig)


@dataclass
class ContextConfig(Section):
    # the device memory cap (mindspore.runtime.set_memory(max_size=...), training/trainer.py); the default
    # sets none, as in MindFormers' pynative trainer, which declares the field and never applies it
    _NO_MEMORY_CAP = "59GB"

    mode: int = 1
    max_device_memory: str = _NO_MEMORY_CAP
    device_target: str = "Ascend"

    def check(self, path):
        require(self.mode == 1, f"{path}.mode = {self.mode}: graph mode (0) is not supported, Kiln runs PyNative (1)")
        require(self.device_target in ("Ascend", "GPU", "CPU"),
                 f"{path}.device_target must be Ascend, GPU or CPU, got {self.device_target!r}")
        require(re.fullmatch(r"\d+(\.\d+)?GB", self.max_device_memory) is not None,
                 f"{path}.max_device_memory must look like '59GB', got {self.max_device_memory!r}")
        require(not self.caps_device_memory or self.device_target != "CPU",
                f"{path}.max_device_memory = {self.max_device_memory!r} has no effect on CPU (MindSpore caps "
                f"device memory on Ascend and GPU only): leave it unset, or set {path}.device_target")

    @property
    def caps_device_memory(self) -> bool:
        """Whether training applies ``max_device_memory`` (set to other than the default)."""
        return self.max_device_memory != self._NO_MEMORY_CAP


@dataclass
class ProfilerConfig(Section):
    enable_profiling: bool = False
    start_step: int = 1
    end_step: int = 1
    output_path: Optional[str] = None
    profiler_rank: Optional[list[int]] = None
    profiler_level: int = 1
    mstx: bool = False
    profile_memory: bool = False
    profile_cpu: bool = True
    with_stack: bool = True

    def check(self, path):
        require(0 < self.start_step <= self.end_step,
                 f"{path}: need 0 < start_step <= end_step, got {self.start_step} and {self.end_step}")
        # MindFormers silently profiles nothing for other levels
        require(self.profiler_level in (0, 1, 2), f"{path}.profiler_level must be 0, 1 or 2, got {self.profiler_level}")
        require(self.profiler_rank is None or all(r >= 0 for r in self.profiler_rank),
                f"{path}.profiler_rank must list ranks >= 0, got {self.profiler_rank}")


@dataclass
class RecomputeConfig(Section):
    """MindFormers' activation recompute (training/recompute.py): the backward runs a part of the forward again
    instead of keeping its activations. ``mode`` "full": each decoder layer ``full_recompute_layer`` names keeps
    only its input (``true``: every layer; an int n: the first n; a list of layer indices and ranges such as
    ``['0-3', 6]``, MTP depth k counted as layer num_hidden_layers + k). "select": the sub-modules
    ``select_module`` maps to layers ({module: layers}; ``self_attention.core_attention``, the scores, softmax
    and weighted sum of the values, is Megatron's selective recompute). "None": every activation is kept."""
    mode: str = "None"
    full_recompute_layer: Optional[Union[bool, int, list[Any]]] = None
    select_module: Optional[dict] = None
    exclude_op: Optional[dict] = None

    MODES = ("None", "full", "select")
    UNSUPPORTED = {"exclude_op": "recomputing a module but some of its ops is not implemented: name the modules "
                                 "to recompute in select_module"}

    def check(self, path: str) -> None:
        require(self.mode in self.MODES, f"{path}.mode = {self.mode!r}: expected one of {', '.join(self.MODES)}")
        if self.mode == "full":
            require(self.full_recompute_layer not in (None, False, [], 0),
                    f"{path}.mode = 'full' needs {path}.full_recompute_layer (true, the first n layers, or a list "
                    f"of layers and ranges such as ['0-3'])")
            layer_indices(self.full_recompute_layer, f"{path}.full_recompute_layer")
        if self.mode == "select":
            require(bool(self.select_module), f"{path}.mode = 'select' needs {path}.select_module "
                                              f"({{module: layers}}, e.g. {{self_attention.core_attention: true}})")
            for module, layers in self.select_module.items():
                layer_indices(layers, f"{path}.select_module.{module}")
        for name in ("full_recompute_layer", "select_module"):
            used = {"full_recompute_layer": "full", "select_module": "select"}[name]
            require(getattr(self, name) in (None, {}, []) or self.mode == used,
                    f"{path}.{name} is set but {path}.mode is {self.mode!r}: it is read only in mode {used!r}")


def layer_indices(spec: Any, path: str, num_layers: Optional[int] = None) -> Optional[set[int]]:
    """The layers a recompute field names: ``true`` every layer (None when ``num_layers`` is not given), an int n
    the first n, a list of indices and inclusive ranges ("2-5", "0-3,8-11"). Raises ConfigError naming ``path``."""
    if spec is True:
        return None if num_layers is None else set(range(num_layers))
    if isinstance(spec, int) and not isinstance(spec, bool):
        require(spec > 0, f"{path} = {spec}: the number of first layers must be > 0")
        layers = set(range(spec))
    elif isinstance(spec, list):
        layers = set()
        for i, item in enumerate(spec):
            parts = [item] if isinstance(item, int) and not isinstance(item, bool) else (
                str(item).split(",") if isinstance(item, str) else None)
            require(parts is not None, f"{path}[{i}] = {shown(item)}: expected a layer index or a range such as '0-3'")
            for part in parts:
                match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(part))
                require(match is not None, f"{path}[{i}] = {shown(item)}: expected a layer index or a range such "
                                           f"as '0-3'")
                first, last = int(match[1]), int(match[2] or match[1])
                require(first <= last, f"{path}[{i}] = {shown(item)}: the range ends before it starts")
                layers.update(range(first, last + 1))
    else:
        raise ConfigError(f"{path} = {shown(spec)}: expected true, a number of first layers or a list of layers")
    if num_layers is not None:
        beyond = sorted(i for i in layers if i >= num_layers)
        if beyond:
            raise ConfigError(f"{path}: layer {beyond[0]} does not exist (the model has {num_layers} decoder and MTP "
                              f"layers, 0-{num_layers - 1})")
    return layers


@dataclass
class RecomputeCommConfig(Section):
    enable: bool = False
    select_module: Optional[dict] = None

    UNSUPPORTED = {"enable": "communication recompute is not implemented",
                   "select_module": "communication recompute is not implemented"}


@dataclass
class SwapConfig(Section):
    enable: bool = False
    default_prefetch: int = 1
    layer_swap: Optional[list[dict]] = None
    op_swap: Optional[list[dict]] = None

    # swap moves activations from device to host memory between forward and backward; on CPU MindSpore's device
    # memory is the process's own RAM, so a swapped activation would be copied within the memory it frees
    _NO_SWAP = ("activation swap is not implemented: on CPU the device memory is host memory, so offloading frees "
                "nothing; activation recompute (recompute.mode) lowers the activation memory instead")
    UNSUPPORTED = {"enable": _NO_SWAP, "default_prefetch": _NO_SWAP, "layer_swap": _NO_SWAP, "op_swap": _NO_SWAP}


@dataclass
class FastStepConfig(Section):
    """Kiln's own top-level ``fast_step`` section (MindFormers keeps unknown top-level keys and ignores them):
    how the training step executes on MindSpore. They change its speed, not what it computes (losses agree with
    the eager step within fp32 rounding)."""
    # forward + backward as one mindspore.jit graph where the model and parallel layout allow it (the trainer
    # logs which, and why not)
    compile: bool = True
    # under data parallelism, the gradient reduction, clip and AdamW in the compiled step's graph too (with
    # ``compile``); off by default: on CPU it was no faster than the reduction outside the graph, and slower under
    # load (docs/parallelism.md, Context parallel; benchmarks/context_parallel.py)
    compile_reduction: bool = False
    # MS_DEV_HOST_BLOCKING_RUN=1 (set by `training.run` before MindSpore loads): single-threaded dispatch; the
    # default dispatch thread busy-waits on a core, which halves matmul speed on a 2-core CPU
    host_blocking_dispatch: bool = True
    # on Ascend, the per-token loss by the fused cross-entropy kernel (mint.nn.functional.cross_entropy) instead of
    # log_softmax + gather; no effect on CPU, which has no kernel for it (training/model/ascend.py)
    fused_cross_entropy: bool = True


@dataclass
class KilnTrainingConfig(Section):
    """Megatron's validation during training (MindFormers' PyNative trainer evaluates nothing): every
    ``eval_interval`` steps and after the last, ``eval_iters`` global batches of the validation split (0 = off)."""
    eval_interval: int = 0
    eval_iters: int = 100

    LIMITS = {"eval_interval": STEPS_LIMIT, "eval_iters": (10**6, "a million batches per evaluation is a typo")}

    def check(self, path):
        require(self.eval_interval >= 0, f"{path}.eval_interval must be >= 0 (0: no validation), got "
                                         f"{self.eval_interval}")
        require(self.eval_iters >= 1, f"{path}.eval_iters must be >= 1, got {self.eval_iters}")


@dataclass
class KilnTrainStateConfig(Section):
    """Monitoring beyond monitor.train_state (what each reports: training/monitor.py): parameter norms, which
    MindFormers has not, and the largest attention logit per layer, which its MaxLogitsMonitor callback gives."""
    param_norm: Union[bool, str, list[str]] = False
    max_attention_logit: bool = False


@dataclass
class KilnParallelismConfig(Section):
    # each cp rank takes chunks r and 2·cp-1-r of 2·cp (zig-zag) instead of chunk r of cp, so the causal
    # attention work is even across the cp ranks (training/parallel/context_parallel.py)
    context_parallel_load_balance: bool = False


@dataclass
class KilnRootsConfig(Section):
    """The roots training_run rendered the config for, recorded once (absolute): the runs root holding its run
    directory and the data root holding its data. A copy of both, side by side as they were (a copied project
    tree), trains from the copied config into the copy on the copy's data (training/relocation.py), and its
    checkpoints' lineage records the roots, so an audit of the copy verifies the copy."""
    runs_root: Optional[str] = None
    data_root: Optional[str] = None


@dataclass
class KilnConfig(Section):
    """Kiln's own settings, in the top-level section ``kiln`` (MindFormers' TrainConfig keeps top-level keys it
    does not know and ignores them, but refuses unknown keys inside its own sections): training, train_state and
    parallelism extend the MindFormers sections of their names, mindrecord a MindDataset dataloader, so a YAML
    Kiln writes loads in MindFormers unchanged."""
    training: KilnTrainingConfig = field(default_factory=KilnTrainingConfig)
    train_state: KilnTrainStateConfig = field(default_factory=KilnTrainStateConfig)
    parallelism: KilnParallelismConfig = field(default_factory=KilnParallelismConfig)
    mindrecord: KilnMindRecordConfig = field(default_factory=KilnMindRecordConfig)
    roots: KilnRootsConfig = field(default_factory=KilnRootsConfig)


@dataclass
class TrainConfig(Section):
    model: dict
    lr_scheduler: LrSchedulerConfig
    train_dataset: TrainDatasetConfig
    run_mode: str = "train"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    recompute_comm: RecomputeCommConfig = field(default_factory=RecomputeCommConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    fast_step: FastStepConfig = field(default_factory=FastStepConfig)
    kiln: KilnConfig = field(default_factory=KilnConfig)
    callbacks: list[dict] = field(default_factory=list)
    lora_config: Optional[dict] = None
    inference: Optional[dict] = None

    UNSUPPORTED = {"run_mode": "only training is implemented", "callbacks": "custom callbacks are not implemented",
                   "lora_config": "LoRA is not implemented", "inference": "inference is not implemented"}

    def check(self, path):
        samples = self.training.steps * self.training.global_batch_size
        require(samples <= MAX_SAMPLES, f"training.steps × training.global_batch_size = {samples:,} samples, more "
                                        f"than {MAX_SAMPLES:,}: the dataset's index holds 16 bytes per sample")
        for key in ("model_type", "architectures"):
            require(key in self.model, f"model.{key} is required")
        require(isinstance(self.model["model_type"], str),
                f"model.model_type: expected a model name such as 'qwen3', got {self.model['model_type']!r}")
        loader = self.train_dataset.dataloader
        # MindFormers' model config carries seq_length too; the samples' length is the dataset's, so a
        # model.seq_length must say the same, and an unset one is resolved to it (the model checks it against
        # max_position_embeddings; its own default, 4096, would say nothing about these samples)
        if isinstance(loader, BlendedMegatronLoaderConfig):
            self.model.setdefault("seq_length", loader.config.seq_length)
            require(self.model["seq_length"] == loader.config.seq_length,
                    f"model.seq_length ({self.model['seq_length']!r}) differs from {_DATA_CONFIG}.seq_length "
                    f"({loader.config.seq_length}), the length of the samples training reads: make them equal "
                    f"or drop model.seq_length")
        if isinstance(loader, BlendedMegatronLoaderConfig) and loader.config.mock:
            from training.data.gpt_dataset import MockIndexedDataset

            largest = max(MockIndexedDataset.MAX_SEQUENCE_LENGTH - 2, loader.config.eod)
            vocab = self.model.get("vocab_size")
            require(isinstance(vocab, int) and vocab > largest,
                    f"{_DATA_CONFIG}.mock: the mock documents hold token ids up to {largest}, so model.vocab_size "
                    f"must be at least {largest + 1}, got {vocab}")

    def warnings(self) -> list[str]:
        """What this config asks for that is allowed but likely not meant (training.run's log and training_run's
        say each): they are warnings, not errors, as a shortened run of a shipped config (training.steps=20 for
        a try) is a sound thing to ask for."""
        found = []
        steps, schedule = self.training.steps, self.lr_scheduler
        if schedule.warmup_steps is not None and schedule.warmup_steps > steps:
            found.append(f"lr_scheduler.warmup_steps ({schedule.warmup_steps}) is more than training.steps ({steps}): "
                         f"the run ends in warm-up, and the learning rate never reaches lr_scheduler.learning_rate")
        if schedule.decay_start_steps is not None and schedule.decay_start_steps >= steps:
            found.append(f"lr_scheduler.decay_start_steps ({schedule.decay_start_steps}) is not before "
                         f"training.steps ({steps}): the learning rate never decays")
        if self.parallelism.sequence_parallel and self.parallelism.tensor_parallel == 1:
            found.append("parallelism.sequence_parallel: true has no effect at tensor_parallel 1 (it splits "
                         "activations across the tensor-parallel group), as in MindFormers")
        return found

    @property
    def data_seed(self) -> int:
        """The seed of the training samples' order: GPTDataset's for Megatron sources, kiln.mindrecord's for
        MindRecord ones."""
        loader = self.train_dataset.dataloader
        return loader.config.seed if isinstance(loader, BlendedMegatronLoaderConfig) else self.kiln.mindrecord.seed

    def split_samples(self, split: str = "train") -> int | None:
        """How many samples ``split``'s dataset is built for (its index, so its shuffle, depends on it): the
        dataloader's ``sizes`` entry when given, as in MindFormers, else steps × global_batch_size for
        training and None (not sized) for the others. Training past a train size reads it again from its
        start, as MindFormers' exhausted iterator restarts."""
        loader = self.train_dataset.dataloader
        sizes = getattr(loader, "sizes", None)
        if sizes:
            return sizes[SPLITS.index(split)]
        return self.training.steps * self.training.global_batch_size if split == "train" else None


MAX_SAMPLES = 2**36
# The model section's widths MindSpore allocates from: bounded here, before a worker asks for petabytes.
MODEL_LIMITS = {
    "vocab_size": TOKEN_ID_LIMIT, "hidden_size": (2**17, "wider than any model trained"),
    "intermediate_size": (2**20, "wider than any model trained"),
    "moe_intermediate_size": (2**20, "wider than any model trained"),
    "num_hidden_layers": (2**12, "deeper than any model trained"), "num_layers": (2**12, "deeper than any model trained"),
    "num_attention_heads": (2**12, "more heads than any model has"), "num_key_value_heads": (2**12, "more heads "
                                                                                                    "than any model has"),
    "head_dim": (2**12, "wider heads than any model has"), "kv_channels": (2**12, "wider heads than any model has"),
    "max_position_embeddings": (2**24, "16M positions is past any model's context"),
    "seq_length": (2**24, "16M tokens per sample is past any model's context"),
    "n_routed_experts": (2**16, "more experts than any model has"),
}
MAX_PARAMETERS = 2**41  # about 2.2 trillion: twice the largest models trained


def _model_size_problems(model: dict) -> list[str]:
    """The model section's widths past MODEL_LIMITS, and a dense size past MAX_PARAMETERS (estimated from the
    embedding and the layers' attention and MLP matrices, experts left out)."""
    problems = [f"model.{name} = {model[name]:,} is more than {high:,}: {why}" for name, (high, why) in
                MODEL_LIMITS.items() if _number(model.get(name)) and model[name] > high]
    sizes = [model.get(name) for name in ("vocab_size", "hidden_size", "intermediate_size")]
    layers = model.get("num_hidden_layers", model.get("num_layers"))
    if all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in [*sizes, layers]):
        vocab, hidden, ffn = sizes
        embeddings = 1 if model.get("tie_word_embeddings") else 2
        parameters = vocab * hidden * embeddings + layers * (4 * hidden * hidden + 3 * hidden * ffn)
        if parameters > MAX_PARAMETERS:
            problems.append(f"model: about {parameters:.3g} parameters (vocab_size × hidden_size × {embeddings} + "
                            f"layers × (4 × hidden_size² + 3 × hidden_size × intermediate_size)), more than "
                            f"{MAX_PARAMETERS:.3g}: check the sizes")
    return problems


def set_field(data: dict, dotted_key: str, value: Any) -> dict:
    """Set ``a.b.c`` in a nested dict, creating sections on the way."""
    node = data
    parts = dotted_key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[:depth + 1])} is not a section (setting {dotted_key})")
        node = child
    node[parts[-1]] = value
    return data


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) before validation."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {shown(item)}: expected KEY.PATH=VALUE")
        set_field(data, key, parse_yaml(raw, f"override {shown(item)}"))
    return data


# Bounds on what a config file may make the loader build: values past them are refused before construction.
# Aliases are references while loading but copies to everything that walks the result (a repr, a dump, a
# recursive check): a few lines of YAML can stand for billions of values (a "billion laughs" document).
MAX_EXPANDED_VALUES = 1_000_000
MAX_MAPPING_NESTING = 10  # MindFormers' check_yaml_depth_before_loading refuses a YAML deeper than this
_SHOWN_CHARS = 200  # of a value in an error message: a message names the value, it does not carry it


def shown(value: Any) -> str:
    """``value``'s repr, cut to a few hundred characters, without first building the whole repr."""
    text = _BOUNDED_REPR.repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({type(value).__name__}, cut)"


def _bounded_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    bounded.maxstring = bounded.maxother = _SHOWN_CHARS
    bounded.maxlist = bounded.maxtuple = bounded.maxdict = 10
    bounded.maxlevel = 3
    return bounded


_BOUNDED_REPR = _bounded_repr()


def _yaml_problems(root: yaml.Node, where: str) -> list[str]:
    """Keys a mapping repeats (YAML keeps the last one silently; Kiln refuses, naming both lines), a document
    that aliases expand past MAX_EXPANDED_VALUES and mappings nested deeper than MindFormers loads, found on the
    composed nodes before anything is built."""
    problems: list[str] = []
    expanded: dict[int, int] = {}  # node id -> values it stands for once its aliases are expanded
    nesting: dict[int, int] = {}  # node id -> mappings nested in it, counted as MindFormers counts (not lists)

    def walk(node: yaml.Node, path: str) -> int:
        if id(node) in expanded:  # an alias: counted again, its duplicates already reported
            return expanded[id(node)]
        expanded[id(node)] = 1  # a recursive alias ends here
        if isinstance(node, yaml.SequenceNode):
            count = 1 + sum(walk(item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            count, first_line = 1, {}
            for key_node, value_node in node.value:
                merge = key_node.tag == "tag:yaml.org,2002:merge"  # `<<: *base` overrides on purpose
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else f"<{key_node.tag}>"
                line = key_node.start_mark.line + 1
                if not merge and key in first_line:
                    problems.append(f"{where}:{line}: {_join(path, key)} is given twice (first at line "
                                    f"{first_line[key]}): YAML would keep the second silently; keep one")
                first_line.setdefault(key, line)
                count += walk(value_node, path if merge else _join(path, key))
            nesting[id(node)] = 1 + max((nesting.get(id(value), 0) for _, value in node.value), default=0)
        else:
            count = 1
        expanded[id(node)] = count
        return count

    if walk(root, "") > MAX_EXPANDED_VALUES:
        problems.append(f"{where}: its aliases expand it to {expanded[id(root)]:,} values, more than the "
                        f"{MAX_EXPANDED_VALUES:,} a training config may hold; write the values out or use fewer "
                        f"nested aliases")
    if nesting.get(id(root), 0) > MAX_MAPPING_NESTING:
        problems.append(f"{where}: its mappings nest {nesting[id(root)]} deep, more than the {MAX_MAPPING_NESTING} "
                        f"MindFormers' loader accepts (a training config needs 4)")
    return problems


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (PyYAML's safe schema), refusing duplicate keys and alias bombs (ConfigError naming
    ``where``, a file, and the lines)."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        problems = _yaml_problems(root, where)
        if problems:
            raise ConfigError(*problems)
        return loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else where
        raise ConfigError(f"{at}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{where}: nested too deeply for a YAML reader (thousands of levels); a training config "
                          f"nests 4") from None
    finally:
        loader.dispose()


def read_yaml_mapping(path: str | Path, what: str = "a training YAML") -> dict:
    """The YAML file at ``path`` (``what`` it should be), a mapping at the top level, read as a training config is
    (parse_yaml); the file's own problems (not found, not text, invalid YAML, duplicate keys, alias bombs) are a
    ConfigError naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8); expected {what}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc.strerror})") from None
    data = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level ({what})")
    return data


def read_config(path: str | Path, overrides: typing.Iterable[str] = ()) -> dict:
    """The training YAML at ``path`` as a dict (read_yaml_mapping), ``overrides`` applied."""
    return apply_overrides(read_yaml_mapping(path), overrides)


def parse_config(data: dict, where: str, model_check: Optional[typing.Callable[[dict], Any]] = None
                 ) -> TrainConfig:
    """``data`` (a config file's dict, ``where``) as a TrainConfig, every problem in one ConfigError: unknown
    keys first, then the rest, then the model section's, checked by ``model_check`` (training.model.model_config,
    which imports MindSpore: processes that must not load it pass none and check the model later)."""
    errors: list[ConfigError] = []
    config = None
    try:
        config = TrainConfig.from_dict(data)
    except ConfigError as exc:
        errors.append(exc)
    if isinstance(data.get("model"), dict) and _model_size_problems(data["model"]):
        # before the model's own checks, which would take the sizes as they are
        errors.append(ConfigError(*_model_size_problems(data["model"])))
    elif model_check is not None and isinstance(data.get("model"), dict):
        # with the samples' length as model.seq_length, as TrainConfig.check resolves it
        model = config.model if config else _model_with_data_seq_length(data)
        try:
            model_check(model)
        except ConfigError as exc:
            # no length known (a shipped config leaves it to training_run): the model's default says nothing
            errors.append(exc if "seq_length" in model else
                          ConfigError(*(p for p in exc.problems if not p.startswith("model.seq_length")),
                                      unknown=exc.unknown))
    wired = _left_to_training_run(data)
    if wired:
        # the shipped configs leave data, eod and save path to training_run: one sentence for them all
        errors = [ConfigError(*(p for p in e.problems if not p.startswith(_WIRED_BY_TRAINING_RUN)),
                              unknown=e.unknown) for e in errors]
        errors.append(ConfigError(_MOCK_ON_WIRED if wired == "mock" else _WIRED_HINT))
    if errors:
        raise ConfigError.merged(errors).located(where)
    return config


def load_config(path: str | Path, overrides: typing.Iterable[str] = (),
                model_check: Optional[typing.Callable[[dict], Any]] = None) -> TrainConfig:
    """The TrainConfig of the YAML at ``path`` with ``overrides``; see read_config and parse_config."""
    return parse_config(read_config(path, overrides), str(path), model_check)


# what a shipped config's empty data_path leaves for training_run to set (the problems its one sentence covers)
_WIRED_BY_TRAINING_RUN = (f"{_DATA_CONFIG}.data_path", f"{_DATA_CONFIG}.seq_length", f"{_DATA_CONFIG}.eod",
                          "checkpoint.save_path", f"{_DATA_CONFIG}: mock: true")
_WIRED_HINT = (f"{_DATA_CONFIG}.data_path is empty: this config leaves its data and checkpoint paths to the "
               f"training_run asset, which fills them from the blend manifest; train with the copy it renders, "
               f"runs/<run_name>/config.yaml (after `make demo`: python -m training.run --config "
               f"runs/qwen3_tiny/config.yaml --set checkpoint.load_path=runs/qwen3_tiny/checkpoints), or set "
               f"data_path, seq_length, eod and checkpoint.save_path")
_MOCK_ON_WIRED = (f"{_DATA_CONFIG}.mock: true on a config that leaves its data to training_run (data_path: []): "
                  f"also set {_DATA_CONFIG}.data_path: null (mock data and a blend exclude each other), "
                  f"{_DATA_CONFIG}.seq_length, {_DATA_CONFIG}.eod and checkpoint.save_path (or "
                  f"checkpoint.enable_save: false)")


def _model_with_data_seq_length(data: dict) -> dict:
    """The raw model section with model.seq_length defaulted to the dataset's, as TrainConfig.check does."""
    model = dict(data["model"])
    node = data
    for key in f"{_DATA_CONFIG}.seq_length".split("."):
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, int) and not isinstance(node, bool):
        model.setdefault("seq_length", node)
    return model


def _left_to_training_run(data: dict) -> str:
    """The shipped configs' ``data_path: []``, wired by training_run: "wired", "mock" when mock: true is asked of
    such a config, else ""."""
    node = data
    for key in _DATA_CONFIG.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    if not (isinstance(node, dict) and node.get("data_path") == []):
        return ""
    return "mock" if node.get("mock") is True else "wired"


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_plain_name(name: Any, what: str) -> str:
    """``name`` if it is one plain path component (letters, digits, '_', '.', '-', not starting with '.'), the
    name of a directory inside its root (a run under the runs root, a source under the data root's raw/ and
    shards/); else ValueError naming ``what`` and why: '/' would nest it, '..' would leave the root, a leading
    '.' would hide it or make it the root itself."""
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name):
        return name
    if not isinstance(name, str) or not name:
        why = "a name must be a non-empty string"
    elif "/" in name or "\\" in name:
        why = "'/' would make it a path of several directories; a name is one"
    elif name.startswith("."):
        why = ("'..' is the directory above, outside its root" if name.startswith("..") else
               "a name starting with '.' is the root itself or a hidden directory")
    else:
        why = "use letters, digits, '_', '.' and '-' only"
    raise ValueError(f"{what} {shown(name)}: {why}")


def config_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
