"""Training-state monitoring (the YAML ``monitor`` section) and checkpoint health.

``monitor.train_state`` and ``kiln.train_state`` (MindFormers names, Kiln semantics where MindFormers' PyNative path has quirks):
  * ``local_norm``: the L2 norm of each selected parameter's gradient for every micro-batch on every
    rank, before accumulation and the cross-rank mean: ``{param: [[rank 0 micro 0, micro 1, …], …]}``.
  * ``device_norm``: the L2 norm of each selected parameter's step gradient as the optimizer receives it
    (accumulated, averaged over ranks, before clipping). MindFormers prints the last micro-batch's
    capture instead, which hides every other micro-batch; with one micro-batch and one rank both agree.
  * ``local_loss``: every rank's per-micro-batch loss, not divided by the accumulation steps.
  * ``device_loss``: the step loss after the cross-rank reduction (what the log line calls ``loss``).
  * ``param_norm`` (Kiln extension, same selector): the L2 norm of each selected parameter after the update.
  * ``max_attention_logit`` (Kiln extension of MindFormers' MaxLogitsMonitor): per layer, the largest
    unmasked QKᵀ·scale of each head over the step's micro-batches and ranks.
A selector is ``true`` (every parameter), a name pattern or a list of them: a pattern with ``*``, ``?``
or ``[`` is matched with fnmatch against the whole name, anything else as a substring (as MindFormers).
Nothing is computed for an option that is off.

``monitor.moe_monitor``: tokens per expert per MoE layer (``MoeMonitor``).

``monitor.tensorboard`` (``TensorBoardWriter``): every ``log_interval`` steps, each scalar of the step's record
against the step and again as ``<name>_vs_samples`` against consumed_samples (MindFormers' "<name> vs samples",
which tensorboardX stores under this name), under MindFormers' names where it
has one (loss, learning-rate, grad-norm, iteration-time, throughput, batch-size); the resolved config as text
at step 0. MindFormers writes from the last rank; Kiln's rank 0 holds the same, already reduced, values.

``monitor.health_checkpoint`` (declared but unused by MindFormers' PyNative trainer; Kiln follows the
graph-mode trainer's checkpoint marking, without its stop/skip actions): a step is abnormal when
  * the embedding table's step gradient norm is >= ``embedding_local_norm_threshold``, or
  * the global gradient norm (before clipping; NaN/Inf included) has been >= ``global_norm_skip_threshold``
    for ``global_norm_skip_time`` consecutive steps (every further step of the same spike counts too).
An abnormal step logs a warning and the next checkpoint saved gets ``ckpt_status: 1`` in ``common.json``
(0 when no step since the previous save was abnormal). Training continues: use
``training.use_skip_step_on_nan`` to skip updates.
"""
from __future__ import annotations

import fnmatch
import math
import sys
from typing import Sequence

import numpy as np

from training.config import ConfigError, TensorboardConfig
from training.optim import tensor_norms
from training.reporting import scalar_metrics

EMBEDDING_PARAM = "embedding.word_embeddings.weight"
NORMAL, ABNORMAL = 0, 1


def select_names(names: Sequence[str], selector) -> list[str]:
    """The names a ``local_norm``-style selector picks, in model order."""
    if selector is True:
        return list(names)
    if not selector:  # False, "" and [] all mean off
        return []
    patterns = [selector] if isinstance(selector, str) else list(selector)

    def matches(name: str, pattern: str) -> bool:
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(name, pattern)
        return pattern in name

    return [n for n in names if any(matches(n, p) for p in patterns)]


def gather_rows(collectives, row: np.ndarray) -> np.ndarray:
    """Every rank's ``row`` stacked by rank ([world, ...]): each rank fills its slot of a zero buffer and
    the buffers are summed (the CPU backend offers AllReduce but no AllGather on subgroups)."""
    world = collectives.world
    buffer = np.zeros((world.size, *row.shape), dtype=np.float32)
    buffer[world.rank] = row
    return collectives.all_reduce_array(buffer).astype(np.float64)


def _rounded(values) -> list:
    return np.round(np.asarray(values, dtype=np.float64), 6).tolist()


class TrainStateMonitor:
    """Collects ``monitor.train_state`` values during a step; ``record()`` returns them for metrics.jsonl."""

    def __init__(self, config, kiln_config, param_names: Sequence[str], collectives):
        self.collectives = collectives
        self.param_names = list(param_names)
        index = {name: i for i, name in enumerate(self.param_names)}
        self.local_norm = [index[n] for n in select_names(self.param_names, config.local_norm)]
        self.device_norm = [index[n] for n in select_names(self.param_names, config.device_norm)]
        self.param_norm = [index[n] for n in select_names(self.param_names, kiln_config.param_norm)]
        self.local_loss = config.local_loss
        self.device_loss = config.device_loss
        self.max_attention_logit = kiln_config.max_attention_logit
        self._micro_losses: list[float] = []
        self._micro_norms: list[np.ndarray] = []

    @property
    def enabled(self) -> bool:
        return bool(self.local_norm or self.device_norm or self.param_norm or self.local_loss
                    or self.device_loss or self.max_attention_logit)

    def micro_batch(self, loss: float, grads: Sequence, loss_scale: float = 1.0) -> None:
        """Called with each micro-batch's loss and raw gradients (before accumulation), which the backward
        computed for the loss times ``loss_scale``."""
        if self.local_loss:
            self._micro_losses.append(loss)
        if self.local_norm:
            self._micro_norms.append(tensor_norms([grads[i] for i in self.local_norm]) / loss_scale)

    def record(self, step_grads: Sequence, params: Sequence, loss: float, max_logits: np.ndarray | None) -> dict:
        """The step's values; collective (every rank calls it, rank 0 reports). ``step_grads`` are the
        averaged gradients before clipping, ``params`` the parameters after the update, ``max_logits``
        this rank's [layers, heads] maxima."""
        out = {}
        if self.local_loss:
            out["local_loss"] = _rounded(gather_rows(self.collectives, np.array(self._micro_losses)))
        if self.local_norm:
            per_rank = gather_rows(self.collectives, np.stack(self._micro_norms, axis=1))  # [rank, param, micro]
            out["local_norm"] = {self.param_names[i]: _rounded(per_rank[:, k])
                                 for k, i in enumerate(self.local_norm)}
        if self.device_norm:
            norms = tensor_norms([step_grads[i] for i in self.device_norm])
            out["device_norm"] = {self.param_names[i]: round(float(v), 6) for i, v in zip(self.device_norm, norms)}
        if self.param_norm:
            norms = tensor_norms([params[i] for i in self.param_norm])
            out["param_norm"] = {self.param_names[i]: round(float(v), 6) for i, v in zip(self.param_norm, norms)}
        if self.device_loss:
            out["device_loss"] = loss
        if self.max_attention_logit:
            out["max_attention_logit"] = _rounded(gather_rows(self.collectives, max_logits).max(axis=0))
        self._micro_losses, self._micro_norms = [], []
        return out


def summary_line(step: int, steps: int, record: dict) -> str:
    """A compact second log line: the extremes of each monitored value (the full values are in metrics.jsonl)."""
    parts = []
    for key in ("local_norm", "device_norm", "param_norm"):
        if key in record:
            name, value = max(((n, float(np.max(v))) for n, v in record[key].items()), key=lambda item: item[1])
            parts.append(f"max {key}: {value:.6f} ({name})")
    if "local_loss" in record:
        losses = np.asarray(record["local_loss"])
        parts.append(f"local_loss: {losses.min():.6f}..{losses.max():.6f}")
    if "device_loss" in record:
        parts.append(f"device_loss: {record['device_loss']:.6f}")
    if "max_attention_logit" in record:
        per_layer = ", ".join(f"{max(heads):.3f}" for heads in record["max_attention_logit"])
        parts.append(f"max_attention_logit per layer: [{per_layer}]")
    return f"{{ step:[{step:>5}/{steps:>5}], {', '.join(parts)} }}"


class MoeMonitor:
    """``monitor.moe_monitor``: every ``save_tokens_per_expert_interval`` steps, the step's tokens per expert
    of each MoE layer (summed over micro-batches and data-parallel ranks) go into metrics.jsonl as
    ``tokens_per_expert: {"decoder.layers.3": [counts…], "mtp.layers.0": […]}``. ``target_layers`` limits
    the decoder layers: an int N keeps layers 0..N-1, a list keeps those indices (MTP layers always kept)."""

    def __init__(self, config, moe_layer_names: Sequence[str], path: str = "monitor.moe_monitor"):
        self.interval = config.save_tokens_per_expert_interval
        if self.interval is not None and not moe_layer_names:
            raise ConfigError(f"{path}.save_tokens_per_expert_interval: the model has no MoE layers to monitor")
        target = config.target_layers
        keep = ((lambda i: True) if target is None else (lambda i: i < target) if isinstance(target, int)
                else (lambda i: i in target))
        self.names = [n for n in moe_layer_names
                      if not n.startswith("decoder.layers.") or keep(int(n.rsplit(".", 1)[1]))]

    def record(self, step: int, tokens_per_expert: dict[str, list[int]]) -> dict:
        if self.interval is None or step % self.interval:
            return {}
        return {"tokens_per_expert": {name: tokens_per_expert[name] for name in self.names}}


class HealthMonitor:
    """``monitor.health_checkpoint``: marks the next checkpoint abnormal after an unhealthy step."""

    def __init__(self, config):
        self.embedding_threshold = config.embedding_local_norm_threshold
        self.global_threshold = config.global_norm_skip_threshold
        self.spike_steps = config.global_norm_skip_time
        self.consecutive_spikes = 0
        self.abnormal_since_save: list[str] = []

    def observe(self, step: int, grad_norm: float, embedding_norm: float | None) -> list[str]:
        """Judge one step; returns the reasons it is abnormal (empty when healthy)."""
        reasons = []
        if embedding_norm is not None and not embedding_norm < self.embedding_threshold:
            reasons.append(f"embedding gradient norm {embedding_norm:.6g} >= "
                           f"monitor.health_checkpoint.embedding_local_norm_threshold ({self.embedding_threshold:g})")
        spiking = not (math.isfinite(grad_norm) and grad_norm < self.global_threshold)
        self.consecutive_spikes = self.consecutive_spikes + 1 if spiking else 0
        if self.consecutive_spikes >= self.spike_steps:
            reasons.append(f"global gradient norm {grad_norm:.6g} >= monitor.health_checkpoint."
                           f"global_norm_skip_threshold ({self.global_threshold:g}) for "
                           f"{self.consecutive_spikes} consecutive steps (global_norm_skip_time "
                           f"{self.spike_steps})")
        self.abnormal_since_save += [f"step {step}: {r}" for r in reasons]
        return reasons

    def checkpoint_status(self) -> int:
        """``ckpt_status`` for a checkpoint saved now; starts a new window for the next one."""
        status = ABNORMAL if self.abnormal_since_save else NORMAL
        self.abnormal_since_save = []
        return status


# Kiln's step-record keys -> the names MindFormers publishes to TensorBoard; the others keep their own name
_TENSORBOARD_NAMES = {"loss": "loss", "lr": "learning-rate", "grad_norm": "grad-norm", "step_time_s": "iteration-time",
                      "tflops_per_device": "throughput", "global_batch_size": "batch-size"}


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without the ``import torch`` its writer module tries (only to
    accept torch tensors as values; Kiln hands it floats). With torch installed (the interop extra) that import
    took 7 of the 10 s of importing tensorboardX at load ~20, and loads torch into a MindSpore training process.
    While ``sys.modules["torch"]`` is None, ``import torch`` raises ImportError, which tensorboardX expects."""
    if "torch" in sys.modules:  # already loaded by someone else: nothing to save
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter:
    """``monitor.tensorboard``: event files in ``output_dir``, written by tensorboardX's SummaryWriter (its
    queue holds ``queue_size`` events before a flush). Called with every step's record."""

    def __init__(self, config: TensorboardConfig, global_batch_size: int, resolved_yaml: str):
        SummaryWriter = _summary_writer_class()  # only when asked for: the engine runs without it otherwise
        self.interval = config.log_interval
        self.global_batch_size = global_batch_size
        self.writer = SummaryWriter(logdir=config.output_dir, max_queue=config.queue_size)
        self.writer.add_text("config", "```yaml\n" + resolved_yaml + "\n```", global_step=0)

    def __call__(self, metrics: dict) -> None:
        step = metrics["step"]
        if step % self.interval:
            return
        samples = metrics["consumed_samples"]
        for key, value in {**scalar_metrics(metrics), "global_batch_size": self.global_batch_size}.items():
            name = _TENSORBOARD_NAMES.get(key, key.replace("_", "-"))
            self.writer.add_scalar(name, value, global_step=step)
            self.writer.add_scalar(f"{name}_vs_samples", value, global_step=samples)

    def evaluation(self, record: dict) -> None:
        """A validation result, under Megatron's names dashed like the others (tensorboardX would turn their
        spaces into underscores); every evaluation is written, they are few."""
        self.writer.add_scalar("lm-loss-validation", record["val_loss"], global_step=record["step"])
        self.writer.add_scalar("lm-loss-validation-ppl", record["val_ppl"], global_step=record["step"])
        if "val_bpb" in record:  # Kiln's: bits per byte of the validation text, with the run's tokenizer known
            self.writer.add_scalar("validation-bpb", record["val_bpb"], global_step=record["step"])

    def close(self) -> None:
        self.writer.close()
