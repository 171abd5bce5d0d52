"""AdamW, learning-rate schedules and gradient clipping for the PyNative trainer.

Names and kwargs follow MindFormers' YAML (``optimizer:`` and ``lr_scheduler:`` sections, reference §1.6):
a MindFormers user's config means the same thing here, and unknown keys are errors instead of being ignored.
Optimizer state is exported as ``adam_m.<param>``, ``adam_v.<param>`` and ``global_step`` for checkpoints.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Callable, Iterable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from training.config import ConfigError, unknown_key_error

LrSchedule = Callable[[int], float]


# ---- learning-rate schedules (functions of the optimizer step) ---------------------------------------

class WarmUpLR:
    """Linear warm-up from ``warmup_lr_init`` to ``learning_rate`` over ``warmup_steps`` (or
    ``warmup_ratio`` × total_steps), then ``decay(progress)`` with progress 0 → 1 over the remaining steps."""

    # the YAML keys this schedule takes (besides ``type``), so a key another schedule needs is an error here
    KWARGS = ("learning_rate", "warmup_steps", "warmup_ratio", "warmup_lr_init", "lr_end", "total_steps")

    def __init__(self, learning_rate: float, total_steps: int, warmup_steps: int | None = None,
                 warmup_ratio: float | None = None, warmup_lr_init: float = 0.0, lr_end: float = 0.0):
        if warmup_steps is not None and warmup_ratio is not None:
            raise ConfigError("lr_scheduler: set warmup_steps or warmup_ratio, not both")
        if warmup_ratio is not None:
            warmup_steps = int(total_steps * warmup_ratio)
        self.learning_rate = learning_rate
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps or 0
        self.warmup_lr_init = warmup_lr_init
        self.lr_end = lr_end

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr_init + (self.learning_rate - self.warmup_lr_init) * step / self.warmup_steps
        return self.after_warmup(step)

    def after_warmup(self, step: int) -> float:
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        return self.decay(min(1.0, (step - self.warmup_steps) / decay_steps))

    def decay(self, progress: float) -> float:
        raise NotImplementedError


class ConstantWarmUpLR(WarmUpLR):
    def __init__(self, learning_rate: float, total_steps: int, **kwargs):
        super().__init__(learning_rate, total_steps, **kwargs)
        if self.lr_end != 0.0:
            raise ConfigError("lr_scheduler.lr_end: ConstantWarmUpLR does not decay; remove lr_end")

    def decay(self, progress: float) -> float:
        return self.learning_rate


class LinearWithWarmUpLR(WarmUpLR):
    def decay(self, progress: float) -> float:
        return self.lr_end + (self.learning_rate - self.lr_end) * (1.0 - progress)


class CosineWithWarmUpLR(WarmUpLR):
    """Half a cosine from ``learning_rate`` down to ``lr_end``."""

    def decay(self, progress: float) -> float:
        return self.lr_end + 0.5 * (self.learning_rate - self.lr_end) * (1.0 + math.cos(math.pi * progress))


class WarmUpStableDecayLR(WarmUpLR):
    """Warm-up, then ``learning_rate`` held until ``decay_start_steps`` (or ``decay_start_ratio`` ×
    total_steps), then a straight line down to ``lr_end`` at total_steps (MindFormers' WSD: its
    ``lr_end`` defaults to 1e-7 and must be below ``learning_rate``)."""

    KWARGS = WarmUpLR.KWARGS + ("decay_start_steps", "decay_start_ratio")

    def __init__(self, learning_rate: float, total_steps: int, lr_end: float = 1e-7,
                 decay_start_steps: int | None = None, decay_start_ratio: float | None = None, **kwargs):
        super().__init__(learning_rate, total_steps, lr_end=lr_end, **kwargs)
        if (decay_start_steps is None) == (decay_start_ratio is None):
            raise ConfigError("lr_scheduler: WarmUpStableDecayLR needs decay_start_steps or decay_start_ratio "
                              "(exactly one): where the stable phase ends")
        if decay_start_ratio is not None:
            decay_start_steps = int(total_steps * decay_start_ratio)
        if not self.warmup_steps <= decay_start_steps <= total_steps:
            raise ConfigError(f"lr_scheduler: the decay must start between the end of warm-up "
                              f"({self.warmup_steps}) and training.steps ({total_steps}); "
                              f"decay_start_steps/decay_start_ratio give step {decay_start_steps}")
        if not lr_end < learning_rate:
            raise ConfigError(f"lr_scheduler.lr_end ({lr_end}) must be below lr_scheduler.learning_rate "
                              f"({learning_rate})")
        self.decay_start_steps = decay_start_steps

    def after_warmup(self, step: int) -> float:
        if step < self.decay_start_steps:
            return self.learning_rate
        progress = min(1.0, (step - self.decay_start_steps) / max(1, self.total_steps - self.decay_start_steps))
        return self.learning_rate - (self.learning_rate - self.lr_end) * progress


LR_SCHEDULES = {cls.__name__: cls for cls in (ConstantWarmUpLR, LinearWithWarmUpLR, CosineWithWarmUpLR,
                                              WarmUpStableDecayLR)}


def build_lr_schedule(section: dict, total_steps: int) -> WarmUpLR:
    """From the YAML ``lr_scheduler:`` dict. ``total_steps`` always comes from training.steps (as in
    MindFormers), overriding any value in the section."""
    kwargs = dict(section)
    kind = kwargs.pop("type", None)
    if kind not in LR_SCHEDULES:
        raise ConfigError(f"lr_scheduler.type = {kind!r} is not supported; supported: {', '.join(LR_SCHEDULES)}")
    schedule = LR_SCHEDULES[kind]
    for key in kwargs:
        if key not in schedule.KWARGS:
            raise unknown_key_error(key, schedule.KWARGS, "lr_scheduler")
    kwargs["total_steps"] = total_steps
    return schedule(**kwargs)


# ---- gradient clipping --------------------------------------------------------------------------------

def tensor_norms(tensors) -> np.ndarray:
    """L2 norms of MindSpore tensors in fp32. On CPU ``asnumpy()`` is a cheap host copy and numpy beats
    MindSpore's per-op dispatch by far (measured: 0.2 ms vs 39 ms for qwen3_tiny's 19 gradients); on a
    device the reductions run there and only the norms are transferred."""
    if ms.get_context("device_target") == "CPU":
        flat = (t.asnumpy().astype(np.float32, copy=False).reshape(-1) for t in tensors)
        return np.array([math.sqrt(float(np.dot(a, a))) for a in flat])
    return ops.stack([ops.square(t.astype(ms.float32)).sum() for t in tensors]).sqrt().asnumpy().astype(np.float64)


def global_norm(grads: Sequence[Tensor]) -> float:
    return float(np.sqrt(np.sum(np.square(tensor_norms(grads)))))


def clip_grad_norm(grads: Sequence[Tensor], max_norm: float, norms: np.ndarray | None = None
                   ) -> tuple[tuple[Tensor, ...], float]:
    """Scale all gradients together so their global L2 norm is at most ``max_norm``; returns the norm
    before clipping (what the step log reports). ``norms``: each gradient's norm when the caller knows it
    better than the local tensors do (a sharded gradient's norm is over all its chunks)."""
    total_norm = global_norm(grads) if norms is None else float(np.sqrt(np.sum(np.square(norms))))
    scale = max_norm / (total_norm + 1e-6)
    if scale < 1.0:
        grads = tuple(g * scale for g in grads)
    return tuple(grads), total_norm


# f over tuples element by element inside a graph: the graph compiles f once per distinct input shape, where a Python
# loop compiles it once per tensor (figures: docs/training.md, the fast step's table, optim.for_each)
for_each = ops.HyperMap()


def _sum_of_squares(grad: Tensor) -> Tensor:
    """Σ grad² in a graph as its squares' row sums and their sum, two matmuls against ones: MindSpore's CPU
    ReduceSum took 2-3x as long, and one [1, n]·[n, 1] dot product (no parallel rows) 2x (jit, the
    qwen3_bench gradients: 32-65 ms vs 84-152 ms at load ~10)."""
    rows = grad.reshape(-1, grad.shape[-1]) if grad.ndim > 1 else grad.reshape(1, -1)
    row_sums = ops.matmul(rows * rows, ops.ones((rows.shape[1], 1), rows.dtype))
    return ops.matmul(ops.ones((1, rows.shape[0]), rows.dtype), row_sums).reshape(())


def clip_grad_norm_in_graph(grads: Sequence[Tensor], max_norm: float, whole_squares=None
                            ) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
    """``clip_grad_norm`` inside a compiled graph: the clipped gradients, each gradient's sum of squares (fp32,
    as ``tensor_norms`` sums them) and the global norm (float64, as ``clip_grad_norm`` computes it).
    ``whole_squares`` turns the sums of squares of gradient chunks into their whole tensors' (sharded data
    parallelism)."""
    squares = ops.stack(for_each(_sum_of_squares, grads))
    if whole_squares is not None:
        squares = whole_squares(squares)
    total_norm = ops.sqrt(ops.sqrt(squares.astype(ms.float64)).square().sum())
    scale = ops.minimum(max_norm / (total_norm + 1e-6), 1.0).astype(ms.float32)  # x·1.0 is x, as when unclipped
    return for_each(ops.partial(ops.mul, scale), grads), squares, total_norm


# ---- AdamW ----------------------------------------------------------------------------------------------

_adam_weight_decay = ops.AdamWeightDecay()


def _matches(name: str, rules: Iterable[str]) -> bool:
    """A rule matches an exact name, a substring of it, or a shell wildcard pattern."""
    return any(rule == name or rule in name or fnmatch.fnmatchcase(name, rule) for rule in rules)


def uses_weight_decay(name: str, param: Parameter, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> bool:
    """MindFormers' grouping: include rules win over exclude rules, which win over the default
    (no decay for 1-D tensors — norms, biases — and names ending in ``.bias``)."""
    if _matches(name, include):
        return True
    if _matches(name, exclude):
        return False
    return len(param.shape) > 1 and not name.endswith(".bias")


def _update_tensor(target, m, v, grad, beta1, beta2, lr, eps, decay) -> None:
    """One tensor's AdamW update in place (an eager step and a compiled step's graph run this same code)."""
    _adam_weight_decay(target, m, v, lr, beta1, beta2, eps, decay, grad.astype(ms.float32))


class AdamW:
    """Decoupled-weight-decay Adam on MindSpore Parameters with fp32 moments and bias correction.

    ``step(grads)`` takes the gradient tuple of ``mindspore.value_and_grad(fn, None, weights)`` where
    ``weights`` are the params given here, in the same order. As in MindFormers, a float16/bfloat16 param
    is updated through an fp32 master copy (``main_param.<name>``) and then rounded back, so updates
    smaller than its rounding step accumulate instead of being lost."""

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], *, lr_schedule: LrSchedule,
                 betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01,
                 weight_decay_include: Iterable[str] = (), weight_decay_exclude: Iterable[str] = ()):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.lr_schedule = lr_schedule
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        include, exclude = list(weight_decay_include), list(weight_decay_exclude)
        self.decays = [uses_weight_decay(n, p, include, exclude) for n, p in named_params]
        self.exp_avg = [self._zeros_like(f"adam_m.{n}", p) for n, p in named_params]
        self.exp_avg_sq = [self._zeros_like(f"adam_v.{n}", p) for n, p in named_params]
        self.global_step = 0
        self._master_copies: list[Parameter | None] | None = None

    def _masters(self) -> list[Parameter | None]:
        """The fp32 masters (None for fp32 params). Taken from the params on first use rather than at
        construction, so weights loaded after the optimizer was built (a weights-only resume) are their start."""
        if self._master_copies is None:
            self._master_copies = [None if p.dtype == ms.float32 else
                                   Parameter(p.astype(ms.float32), name=f"main_param.{n}", requires_grad=False)
                                   for n, p in zip(self.names, self.params)]
        return self._master_copies

    @staticmethod
    def _zeros_like(name: str, param: Parameter) -> Parameter:
        return Parameter(Tensor(np.zeros(param.shape, np.float32)), name=name, requires_grad=False)

    @property
    def current_lr(self) -> float:
        """The learning rate of the latest update (of step 0 before any update)."""
        return float(self.lr_schedule(self.global_step))

    def kernel_hyperparameters(self, update: int) -> tuple[float, float, float]:
        """The fused kernel's lr, eps and weight decay for update number ``update`` (1-based). AdamWeightDecay
        has no bias correction, so it is folded into them: lr' = lr·√(1-β2ᵗ)/(1-β1ᵗ), eps' = eps·√(1-β2ᵗ),
        wd' = lr·wd/lr' give exactly PyTorch's AdamW update."""
        lr = float(self.lr_schedule(update))
        sqrt_bias_correction2 = math.sqrt(1.0 - self.beta2 ** update)
        kernel_lr = lr * sqrt_bias_correction2 / (1.0 - self.beta1 ** update)
        kernel_eps = self.eps * sqrt_bias_correction2
        kernel_decay = lr * self.weight_decay / kernel_lr if kernel_lr else 0.0
        return kernel_lr, kernel_eps, kernel_decay

    def step(self, grads: Sequence[Tensor]) -> None:
        """One update: m ← β1·m + (1-β1)·g, v ← β2·v + (1-β2)·g², then
        p ← p·(1 - lr·wd) - lr·m̂ / (√v̂ + eps) with m̂ = m/(1-β1ᵗ), v̂ = v/(1-β2ᵗ) (PyTorch's AdamW).

        Runs as one fused AdamWeightDecay kernel per tensor (several times faster than separate ops in
        PyNative), with ``kernel_hyperparameters``."""
        if len(grads) != len(self.params):
            raise ValueError(f"AdamW.step: got {len(grads)} gradients for {len(self.params)} parameters")
        self.global_step += 1
        lr, eps, decay = self.kernel_hyperparameters(self.global_step)
        for param, master, grad, m, v, decays in zip(self.params, self._masters(), grads, self.exp_avg,
                                                     self.exp_avg_sq, self.decays):
            _update_tensor(param if master is None else master, m, v, grad, self.beta1, self.beta2, lr, eps,
                           decay if decays else 0.0)
            if master is not None:
                ops.assign(param, master.astype(param.dtype))

    def count_applied_update(self) -> None:
        """Count an update that a compiled step applied in its graph (``compiled_update``), with the
        hyperparameters ``kernel_hyperparameters(global_step + 1)`` gave it."""
        self.global_step += 1

    def compiled_update(self) -> AdamWUpdate:
        """The update of ``step`` as a Cell a compiled training step calls inside its graph."""
        return AdamWUpdate(self)

    # ---- checkpoint state ----
    def state_dict(self) -> dict[str, np.ndarray]:
        """The moments, any fp32 masters and the update count, by their checkpoint names."""
        state = {m.name: m.asnumpy() for m in self.exp_avg}
        state.update({v.name: v.asnumpy() for v in self.exp_avg_sq})
        state.update({master.name: master.asnumpy() for master in self._masters() if master is not None})
        state["global_step"] = np.array([self.global_step], np.int64)
        return state

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore exactly what ``state_dict`` produced; a missing, extra or mis-shaped tensor is an error."""
        tensors = self.exp_avg + self.exp_avg_sq + [master for master in self._masters() if master is not None]
        expected = {t.name for t in tensors} | {"global_step"}
        missing = sorted(expected - set(arrays))
        if missing:
            raise ValueError(f"optimizer state is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
        extra = sorted(set(arrays) - expected)
        if extra:
            raise ValueError(f"optimizer state has tensor(s) this model does not: {', '.join(extra[:5])}")
        for tensor in tensors:
            array = np.asarray(arrays[tensor.name])
            if tuple(array.shape) != tuple(tensor.shape):
                raise ValueError(f"optimizer state {tensor.name}: shape {list(array.shape)}, "
                                 f"the model expects {list(tensor.shape)}")
        step = np.asarray(arrays["global_step"])
        if step.size != 1:
            raise ValueError(f"optimizer state global_step: shape {list(step.shape)}, expected [1]")
        for tensor in tensors:
            tensor.set_data(Tensor(np.asarray(arrays[tensor.name], np.float32)))
        self.global_step = int(step.reshape(-1)[0])


class AdamWUpdate(nn.Cell):
    """``AdamW.step``'s update of every tensor, called inside a compiled step's graph: the hyperparameters
    (``AdamW.kernel_hyperparameters``) come as Tensors, so one graph serves every step. Float32 parameters only:
    a low-precision one is updated through a master copy the eager step makes on its first update."""

    def __init__(self, optimizer: AdamW):
        super().__init__(auto_prefix=False)  # the parameters and moments keep their checkpoint names
        low_precision = [n for n, p in zip(optimizer.names, optimizer.params) if p.dtype != ms.float32]
        if low_precision:
            raise ValueError(f"a compiled AdamW update takes float32 parameters only; "
                             f"{', '.join(low_precision[:3])} {'is' if len(low_precision) == 1 else 'are'} not")
        self.params = ParameterTuple(optimizer.params)
        self.exp_avg = ParameterTuple(optimizer.exp_avg)
        self.exp_avg_sq = ParameterTuple(optimizer.exp_avg_sq)
        self.decays = tuple(optimizer.decays)
        self.beta1, self.beta2 = optimizer.beta1, optimizer.beta2

    def construct(self, grads, lr, eps, decay):
        update = ops.partial(_update_in_graph, self.beta1, self.beta2, lr, eps, decay, ops.zeros_like(decay))
        for_each(update, self.params, self.exp_avg, self.exp_avg_sq, grads, self.decays)


def _update_in_graph(beta1, beta2, lr, eps, decay, no_decay, param, m, v, grad, decays):
    _update_tensor(param, m, v, grad, beta1, beta2, lr, eps, decay if decays else no_decay)


_OPTIMIZER_KEYS = ("type", "betas", "eps", "weight_decay", "weight_decay_include", "weight_decay_exclude")


def build_optimizer(section: dict, named_params: Sequence[tuple[str, Parameter]], lr_schedule: LrSchedule) -> AdamW:
    """From the YAML ``optimizer:`` dict (AdamW only for now)."""
    kwargs = dict(section)
    kind = kwargs.pop("type", "AdamW")
    if kind != "AdamW":
        raise ConfigError(f"optimizer.type = {kind!r} is not supported yet; supported: AdamW")
    for key in kwargs:
        if key not in _OPTIMIZER_KEYS:
            raise unknown_key_error(key, _OPTIMIZER_KEYS, "optimizer")
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return AdamW(named_params, lr_schedule=lr_schedule, **kwargs)


# ---- steps with a NaN/Inf loss or gradient norm -----------------------------------------------------------

class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm is NaN/Inf and training must stop rather than learn from it."""


class SkipStepOnNaN:
    """``training.use_skip_step_on_nan`` and ``training.max_consecutive_skipped_steps``: a step whose loss
    or global gradient norm is NaN/Inf is skipped (no update: weights, moments and the optimizer's step
    counter, hence the LR, stay as they were) or, without the flag, stops training. More than
    ``max_consecutive`` skips in a row also stop it (0 = no limit, as in MindFormers)."""

    def __init__(self, enabled: bool, max_consecutive: int):
        self.enabled = enabled
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether step ``step`` must not update; raises NonFiniteStepError when training must stop."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        problem = f"step {step}: loss = {loss}, grad_norm = {grad_norm}"
        if not self.enabled:
            raise NonFiniteStepError(f"{problem}; stopping rather than training on it "
                                     "(training.use_skip_step_on_nan: true would skip such steps)")
        self.consecutive += 1
        self.total += 1
        if self.max_consecutive and self.consecutive > self.max_consecutive:
            raise NonFiniteStepError(f"{problem}: {self.consecutive} steps in a row with NaN/Inf exceed "
                                     f"training.max_consecutive_skipped_steps = {self.max_consecutive}")
        return True
