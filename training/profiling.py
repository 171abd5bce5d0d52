"""The YAML ``profiler`` section: MindSpore's profiler over training steps [start_step, end_step].

Steps are numbered as in the log line (the first step is 1). Each selected rank (``profiler_rank``,
default every rank) writes under ``<output_path>/rank_<id>`` (default output_path: ``<run dir>/profile``),
in MindSpore's layout (``*_ascend_ms/ASCEND_PROFILER_OUTPUT/trace_view.json`` etc., also on CPU).
A run resumed inside the window profiles the rest of it. mindspore.profiler is imported only when
profiling is on.
"""
from __future__ import annotations

from pathlib import Path


class ProfilerError(RuntimeError):
    """MindSpore's profiler cannot run with this config on this device; the message names the field."""


def profile_root(config, run_dir: Path) -> Path:
    """Where every rank's profile goes: ``profiler.output_path`` or ``<run dir>/profile``."""
    return Path(config.profiler.output_path) if config.profiler.output_path else Path(run_dir) / "profile"


class StepProfiler:
    """Call ``before_step(n)`` / ``after_step(n)`` around step n, and ``close()`` when training ends."""

    def __init__(self, section, device_target: str, output_dir: Path):
        self.start_step, self.end_step = section.start_step, section.end_step
        self.output_dir = output_dir
        self._profile = _build(section, device_target, output_dir)
        self._running = False

    def before_step(self, step: int) -> None:
        if not self._running and self.start_step <= step <= self.end_step:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._profile.start()
            self._running = True

    def after_step(self, step: int) -> None:
        if self._running:
            self._profile.step()
            if step >= self.end_step:
                self.close()

    def close(self) -> None:
        """Stop and write the trace (MindSpore parses it on stop)."""
        if self._running:
            self._running = False
            self._profile.stop()


def _build(section, device_target: str, output_dir: Path):
    try:
        from mindspore.profiler import ProfilerActivity, ProfilerLevel, profile, tensorboard_trace_handler
        from mindspore.profiler.experimental_config import _ExperimentalConfig
    except ImportError as exc:
        raise ProfilerError(f"profiler.enable_profiling: MindSpore's profiler cannot be imported ({exc})") from None
    activities = [ProfilerActivity.CPU] if section.profile_cpu else []
    if device_target != "CPU":
        activities.append(ProfilerActivity.NPU if device_target == "Ascend" else ProfilerActivity.GPU)
    if not activities:
        raise ProfilerError("profiler.profile_cpu = false leaves nothing to profile on a CPU device "
                            "(context.device_target = CPU)")
    level = [ProfilerLevel.Level0, ProfilerLevel.Level1, ProfilerLevel.Level2][section.profiler_level]
    try:
        return profile(activities=activities, with_stack=section.with_stack, profile_memory=section.profile_memory,
                       start_profile=False, on_trace_ready=tensorboard_trace_handler(str(output_dir)),
                       experimental_config=_ExperimentalConfig(profiler_level=level, mstx=section.mstx))
    except Exception as exc:  # MindSpore raises several types; the user needs the reason, not a traceback
        raise ProfilerError(f"profiler.enable_profiling: MindSpore's profiler failed to start on "
                            f"{device_target}: {type(exc).__name__}: {exc}") from exc


def build_profiler(config, rank: int, run_dir: Path) -> StepProfiler | None:
    """The rank's profiler, or None when profiling is off or this rank is not in ``profiler_rank``."""
    section = config.profiler
    if not section.enable_profiling or (section.profiler_rank is not None and rank not in section.profiler_rank):
        return None
    return StepProfiler(section, config.context.device_target, profile_root(config, run_dir) / f"rank_{rank}")
