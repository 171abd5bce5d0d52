"""How a training step runs: MindSpore's runtime settings, what keeps a step from compiling, and the step's
functions — forward + backward eager or compiled, or the whole step (clip and AdamW update included) as compiled
graphs (``CompiledStep``). The trainer calls what ``build_step_functions`` chose; validation compiles its forward
where the training step's compiles (``compile_blockers``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from training.config import ConfigError, TrainConfig
from training.model import GPTModel
from training.model_parts import WholeModel
from training.monitor import TrainStateMonitor
from training.optim import AdamW, clip_grad_norm_in_graph, for_each
from training.parallel import comm
from training.parallel.fsdp import GradientReduction, Parallelism
from training.parallel.mesh import ParallelDims
from training.recompute import RecomputedLayers, compiled_recompute, compiled_recompute_problems


def configure_runtime(config: TrainConfig) -> None:
    """Mode, device, memory cap and determinism; MindSpore requires them before ``communication.init()``."""
    if config.fast_step.compile:
        refuse_compile_cache()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device(config.context.device_target)
    if config.context.caps_device_memory:
        ms.runtime.set_memory(max_size=config.context.max_device_memory)
    if config.training.deterministic:
        ms.set_context(deterministic="ON")
    if config.context.device_target == "CPU":
        lower_kernel_pool_priority()


def refuse_compile_cache() -> None:
    """MindSpore's compile cache (MS_COMPILER_CACHE_ENABLE=1, or ``set_context(enable_compile_cache=True)``)
    hands back the graph compiled in the same place in the process's order of compiles, checking only that the
    Python sources are unchanged, not what the graph computes: a run with another ``model.rms_norm_eps``, or one
    layer fewer, trained the cached graph (docs/training.md, The fast step). A compiled step refuses it."""
    enabled = ms.get_context("enable_compile_cache")
    if enabled is None:  # the context left unset: MindSpore reads the environment
        enabled = os.environ.get("MS_COMPILER_CACHE_ENABLE") == "1"
    if enabled:
        raise ConfigError("MS_COMPILER_CACHE_ENABLE=1 (or set_context(enable_compile_cache=True)): MindSpore's compile "
                          "cache returns graphs by the order they compile in, not by what they compute, so a "
                          "changed config can train a stale graph; unset it, or set fast_step.compile: false")


# MindSpore's CPU runtime runs kernels on a thread pool (ActorThread_*, KernelThread_*) whose threads spin on
# sched_yield between kernels. When processes outnumber cores (msrun workers on a small machine, tests in parallel),
# each spinning thread still takes its fair share of a core from the threads doing the work; at a lower priority it
# takes only what nobody else wants (figures: docs/training.md, The fast step).
KERNEL_POOL_THREADS = ("ActorThread_", "KernelThread_")
KERNEL_POOL_NICENESS = 10


def lower_kernel_pool_priority(timeout: float = 2.0) -> None:
    """Give MindSpore's kernel-pool threads of this process niceness ``KERNEL_POOL_NICENESS`` (Linux; elsewhere a
    no-op). The pool starts with the first kernel, and each thread names itself once running, so this runs a kernel
    and waits (up to ``timeout`` seconds) until a thread of each kind has its name."""
    threads = Path("/proc/self/task")
    if not threads.is_dir():
        return
    (Tensor(0.0) + 0).asnumpy()
    deadline = time.monotonic() + timeout
    while True:
        pool = {}
        for thread in threads.iterdir():
            try:
                name = (thread / "comm").read_text()
            except FileNotFoundError:  # the thread ended in between
                continue
            if name.startswith(KERNEL_POOL_THREADS):
                pool[int(thread.name)] = name
        if all(any(name.startswith(kind) for name in pool.values()) for kind in KERNEL_POOL_THREADS) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for tid in pool:
        try:  # never below the niceness the process started with: an unprivileged process cannot lower it
            os.setpriority(os.PRIO_PROCESS, tid, max(KERNEL_POOL_NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
        except ProcessLookupError:
            continue


def compile_blockers(config: TrainConfig, dims: ParallelDims, model: GPTModel) -> list[str]:
    """Why this run's forward + backward cannot be one compiled graph (fast_step.compile); empty when it can.
    A graph is traced once, so whatever the step keeps on the host between calls would be frozen in it."""
    reasons = []
    if not config.fast_step.compile:
        reasons.append("fast_step.compile is false")
    if model.config.hidden_dropout > 0:
        reasons.append("model.hidden_dropout > 0: dropout masks come from Kiln's host-side mask stream (so a "
                       "resume draws the same masks), which a graph would replay as constants")
    reasons += compiled_recompute_problems(model, config.recompute, dims.pp)
    if config.kiln.train_state.max_attention_logit:
        reasons.append("kiln.train_state.max_attention_logit: the per-head maxima are gathered on the host")
    return reasons


class ScaledLoss(nn.Cell):
    """The micro-batch loss scaled for its backward (``Parallelism.loss_scale``), whose gradients then sum over
    micro-batches and ranks into the global batch's mean; then the loss and its parts (``loss_part_names``), all
    in one flat tuple (a graph cannot return the empty tuple of a model without parts)."""

    def __init__(self, model: GPTModel, scale: float):
        super().__init__(auto_prefix=False)  # the model's parameter names stay its own
        self.model = model
        self.scale = scale
        model.set_loss_scale(scale)

    def construct(self, input_ids, labels, loss_mask, position_ids=None, attention_mask=None):
        loss, parts = self.model.loss_and_parts(input_ids, labels, loss_mask, position_ids, attention_mask)
        return (loss * self.scale, loss) + parts


def degrees(dims: ParallelDims) -> str:
    """The layout as the logs name it: every parallelism's degree, data parallel's first."""
    return f"dp={dims.dp}, tp={dims.tp}, pp={dims.pp}, cp={dims.cp}, ep={dims.ep}"


def whole_step_blockers(config: TrainConfig, dims: ParallelDims, monitor: TrainStateMonitor,
                        optimizer: AdamW) -> list[str]:
    """Why the clip and the AdamW update of a compiled step stay outside its graphs (run eagerly after them);
    empty when the whole step compiles (``CompiledStep``; data parallelism's gradient reduction runs in its graph
    too when ``fast_step.compile_reduction`` asks for it)."""
    reasons = []
    if dims.world > 1 and not config.fast_step.compile_reduction:
        reasons.append(f"{dims.world} workers ({degrees(dims)}): fast_step.compile_reduction is false (the gradient "
                       f"reduction across them, clip and update in the graph measured no faster on CPU: "
                       f"benchmarks/context_parallel.py)")
    if monitor.local_norm or monitor.device_norm:
        reasons.append("monitor.train_state.local_norm/device_norm read gradients on the host")
    low_precision = [name for name, param in zip(optimizer.names, optimizer.params) if param.dtype != ms.float32]
    if low_precision:
        reasons.append(f"{len(low_precision)} parameter(s) not float32 (e.g. {low_precision[0]}): the update goes "
                       f"through fp32 master copies made on the host")
    return reasons


class CompiledStep(nn.Cell):
    """A whole training step as compiled graphs. With one micro-batch, ``construct`` runs its forward and backward,
    then the global-norm clip of the gradients and the AdamW update, applied only when the loss and the gradient
    norm are finite (the host then counts, skips or stops exactly as ``SkipStepOnNaN`` decides after an eager step,
    from the same values). With several, ``accumulate`` runs each micro-batch's forward and backward and adds its
    gradients and loss to buffers, and ``apply_sums`` clips and applies the sums the same way: one forward and
    backward graph for every micro-batch, not a second one for the last (compiling it again cost as much as the
    first). The sums run in the eager step's order, so they are the same bits.
    Under data parallelism ``reduction`` reduces the summed gradients over the ranks in the graph, as
    ``Parallelism.reduce_gradients`` does eagerly, and sums the loss over them, so every rank applies or skips
    the update alike."""

    def __init__(self, loss: ScaledLoss, params: list, optimizer: AdamW, max_norm: float, accumulation: int,
                 reduction: GradientReduction | None = None, recomputed: RecomputedLayers | None = None):
        super().__init__(auto_prefix=False)  # parameter names stay the model's and the optimizer's
        self.loss = loss
        self.recomputed = recomputed  # the forward and backward when layers recompute (training.recompute)
        self.params = ParameterTuple(params)
        self.update = optimizer.compiled_update()
        self.max_norm = max_norm
        self.accumulation = accumulation
        self.reduction = reduction
        # buffers only when there is something to sum: reading and zeroing them costs a pass over every gradient
        self.grad_sums = ParameterTuple(
            [Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"grad_sum.{p.name}", requires_grad=False)
             for p in params] if accumulation > 1 else [])
        self.loss_sum = (Parameter(Tensor(0.0, ms.float32), name="grad_sum.loss", requires_grad=False)
                         if accumulation > 1 else None)

    def _gradients(self, input_ids, labels, loss_mask, position_ids, attention_mask):
        if self.recomputed is not None:
            outputs, grads = self.recomputed(input_ids, labels, loss_mask, position_ids, attention_mask)
        else:
            outputs, grads = ms.value_and_grad(self.loss, None, self.params, has_aux=True)(
                input_ids, labels, loss_mask, position_ids, attention_mask)
        return outputs[1], outputs[2:], grads

    def accumulate(self, input_ids, labels, loss_mask, position_ids=None, attention_mask=None):
        """One of several micro-batches: its gradients and loss added to the buffers; returns its loss, then the
        loss's parts."""
        loss, parts, grads = self._gradients(input_ids, labels, loss_mask, position_ids, attention_mask)
        for_each(ops.assign_add, self.grad_sums, grads)
        ops.assign_add(self.loss_sum, loss)
        return (loss,) + parts

    def construct(self, lr, eps, decay, input_ids, labels, loss_mask, position_ids=None, attention_mask=None):
        """The only micro-batch and the update; returns its loss, each gradient's sum of squares and the global
        gradient norm before clipping, then the loss's parts."""
        loss, parts, grads = self._gradients(input_ids, labels, loss_mask, position_ids, attention_mask)
        return (loss,) + self._apply(grads, loss, lr, eps, decay) + parts

    def apply_sums(self, lr, eps, decay):
        """The update from the micro-batches ``accumulate`` summed, the buffers zeroed for the next step; returns
        each gradient's sum of squares and the global gradient norm before clipping."""
        grads = for_each(_copy, self.grad_sums)  # values read before the buffers are zeroed
        loss_sum = self.loss_sum * 1
        applied = self._apply(grads, loss_sum, lr, eps, decay)
        for_each(_zero, self.grad_sums)
        ops.assign(self.loss_sum, ops.zeros_like(self.loss_sum))
        return applied

    def _apply(self, grads, loss_sum, lr, eps, decay):
        whole_squares = None
        if self.reduction is not None:
            grads = self.reduction(grads)
            loss_sum = self.reduction.loss_total(loss_sum)
            whole_squares = self.reduction.whole_squares
        clipped, squares, grad_norm = clip_grad_norm_in_graph(grads, self.max_norm, whole_squares)
        if ops.logical_and(ops.isfinite(loss_sum), ops.isfinite(grad_norm)):
            self.update(clipped, lr, eps, decay)
        return squares, grad_norm


def _copy(tensor):
    return tensor * 1


def _zero(buffer):
    return ops.assign(buffer, ops.zeros_like(buffer))


@dataclass
class StepFunctions:
    """What computes a run's steps: the micro-batch loop calls ``grad_fn`` (forward + backward, compiled when
    ``forward_compiled``) unless ``compiled`` runs the whole step; ``mode`` says which, and why not more."""
    grad_fn: Callable
    compiled: CompiledStep | None
    forward_compiled: bool
    mode: str


def build_step_functions(config: TrainConfig, dims: ParallelDims, model: GPTModel, parallel: Parallelism,
                         model_parts: WholeModel, optimizer: AdamW, monitor: TrainStateMonitor, accumulation: int,
                         blockers: list[str]) -> StepFunctions:
    """The fastest step this run allows: the whole step compiled, else its forward and backward, else eager (what
    ``compile_blockers`` gave: ``blockers``; ``whole_step_blockers``); pipeline stages compile apart
    (``model_parts.compile``)."""
    dispatch = ("synchronous dispatch" if os.environ.get("MS_DEV_HOST_BLOCKING_RUN") == "1"
                else "threaded dispatch (fast_step.host_blocking_dispatch takes effect through training.run)")
    scaled_loss = ScaledLoss(model, parallel.loss_scale())
    grad_fn = ms.value_and_grad(scaled_loss, None, parallel.model_params, has_aux=True)
    if blockers:
        return StepFunctions(grad_fn, None, False,
                             f"forward+backward eager, {dispatch}; not compiled: {'; '.join(blockers)}")
    parallel.gather_in_layers()  # ZeRO-3: each layer gathers its own chunks inside the graph
    comm.for_graph(model)  # tensor, expert, context parallelism's and ZeRO-3's collectives, as all-reduces
    if model.config.has_moe and dims.ep_enabled:  # the compiled modes' lines end with how tokens reach their experts
        dispatch += ("; expert parallel: all-gather token dispatch in the graph (the ep group's tokens and their "
                     "routing gathered, this rank's experts on their rows, outputs reduce-scattered back)")
    if dims.cp_enabled:
        dispatch += ("; context parallel: attention's ring steps and Ulysses exchanges in the graph (comm's Cells, "
                     "all-reduces of zero-padded buffers on CPU)")
    compiled_apart = model_parts.compile()  # pipeline stages: their own graphs, the schedule on the host
    if compiled_apart:
        return StepFunctions(grad_fn, None, True, f"{compiled_apart}, {dispatch}")
    # after the layers' in-graph gathers and collectives: the recomputing stages run what they made
    recomputed = compiled_recompute(model, config.recompute, parallel.model_params, scaled_loss.scale)
    if recomputed is not None:
        dispatch += (f"; the first {len(recomputed.forwards)} decoder layers recomputed in the backward (each keeps "
                     f"its input only)")
    outside = whole_step_blockers(config, dims, monitor, optimizer)
    if outside:
        return StepFunctions(ms.jit(grad_fn if recomputed is None else recomputed.construct), None, True,
                             f"forward+backward compiled (mindspore.jit), clip and update eager, {dispatch}; not in "
                             f"the graph: {'; '.join(outside)}")
    compiled = CompiledStep(scaled_loss, parallel.model_params, optimizer, config.training.max_norm, accumulation,
                            parallel.compiled_reduction() if dims.world > 1 else None, recomputed)
    compiled.construct = ms.jit(compiled.construct)
    compiled.accumulate = ms.jit(compiled.accumulate)
    compiled.apply_sums = ms.jit(compiled.apply_sums)
    reduced = ", gradient reduction over the ranks" if dims.world > 1 else ""
    return StepFunctions(grad_fn, compiled, True,
                         f"whole step compiled (mindspore.jit: forward, backward{reduced}, clip, AdamW), {dispatch}")
