"""Launch N training workers with msrun, using the argument forms of MindFormers' ``msrun_launcher.sh``.

    python -m training.launch "<command>"
    python -m training.launch "<command>" WORKER_NUM
    python -m training.launch "<command>" WORKER_NUM MASTER_PORT LOG_DIR JOIN CLUSTER_TIME_OUT
    python -m training.launch "<command>" WORKER_NUM LOCAL_WORKER MASTER_ADDR MASTER_PORT NODE_RANK \\
                              LOG_DIR JOIN CLUSTER_TIME_OUT

The first three forms run every worker on this node; the last one is run once per node, each with its own
NODE_RANK (with LOCAL_WORKER == WORKER_NUM it is a single node again). ``<command>`` is one quoted
argument: ``python -m training.run --config X.yaml ...`` or a script and its arguments
(``training/run.py --config X.yaml``); msrun starts every worker with the ``python`` on PATH, which the
launcher makes this interpreter's.

Defaults, as in MindFormers: WORKER_NUM 8, LOCAL_WORKER = WORKER_NUM, MASTER_ADDR 127.0.0.1,
MASTER_PORT 8118, NODE_RANK 0, LOG_DIR output/msrun_log, CLUSTER_TIME_OUT 7200 (seconds). Worker i
logs to LOG_DIR/worker_i.log. Differences from MindFormers:
  - JOIN must be True (it is the default here): Kiln's workers die with msrun, so a killed msrun
    leaves no orphans, and with JOIN False msrun exits as soon as it has spawned them. For a detached
    job, run the launcher itself in the background (nohup ... &).
  - WORKER_NUM 1 is refused, as in MindFormers: run the command directly with python.
ASCEND_RT_VISIBLE_DEVICES is passed on to the workers unchanged. The launcher waits for msrun and exits
with its code (128 + N when signal N killed it), leaving none of its processes behind (``run_msrun``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Optional

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# The positional arguments after the command in each accepted form, in MindFormers' order.
FORMS: dict[int, tuple[str, ...]] = {
    1: (),
    2: ("WORKER_NUM",),
    6: ("WORKER_NUM", "MASTER_PORT", "LOG_DIR", "JOIN", "CLUSTER_TIME_OUT"),
    9: ("WORKER_NUM", "LOCAL_WORKER", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOG_DIR", "JOIN",
        "CLUSTER_TIME_OUT"),
}
FIELD_OF = {"WORKER_NUM": "worker_num", "LOCAL_WORKER": "local_worker_num", "MASTER_ADDR": "master_addr",
            "MASTER_PORT": "master_port", "NODE_RANK": "node_rank", "LOG_DIR": "log_dir",
            "CLUSTER_TIME_OUT": "cluster_time_out"}
INTEGER_POSITIONS = {"WORKER_NUM", "LOCAL_WORKER", "MASTER_PORT", "NODE_RANK", "CLUSTER_TIME_OUT"}
PYTHON_NAMES = ("python", "python3")
STOP_GRACE_S = 30  # after SIGINT, msrun's handler kills every worker and exits: seconds it gets to do so


class SettingError(ValueError):
    """An invalid msrun setting; ``field`` names it so each front end can point at its own spelling."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class MsrunSettings:
    """One node's msrun settings; the defaults are MindFormers' launcher defaults."""

    worker_num: int = 8
    local_worker_num: int = 8
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    node_rank: int = 0
    log_dir: str = "output/msrun_log"
    cluster_time_out: int = 7200
    tail_worker_log: int = -1  # msrun's default: echo every local worker's log

    def __post_init__(self):
        if self.worker_num < 1:
            raise SettingError("worker_num", f"must be at least 1, got {self.worker_num}")
        if not 1 <= self.local_worker_num <= self.worker_num:
            raise SettingError("local_worker_num", f"must be between 1 and worker_num ({self.worker_num}), "
                                                   f"got {self.local_worker_num}")
        if not self.master_addr:
            raise SettingError("master_addr", "must be a host name or IP address, got an empty string")
        if not 1024 <= self.master_port <= 65535:
            raise SettingError("master_port", f"must be a port in 1024..65535, got {self.master_port}")
        if self.node_rank < 0:
            raise SettingError("node_rank", f"must be 0 or more, got {self.node_rank}")
        if self.one_machine and self.node_rank != 0:
            raise SettingError("node_rank", f"must be 0 when this node runs all {self.worker_num} workers, "
                                            f"got {self.node_rank}")
        if not self.log_dir:
            raise SettingError("log_dir", "must be a directory, got an empty string")
        if self.cluster_time_out == 0:
            # msrun reads a negative value as "wait forever"; zero would fail before any worker joins
            raise SettingError("cluster_time_out", "must be a number of seconds, or negative to wait forever; got 0")
        if not -1 <= self.tail_worker_log < self.local_worker_num:
            raise SettingError("tail_worker_log", f"must be -1 (all) or a local worker index below "
                                                  f"{self.local_worker_num}, got {self.tail_worker_log}")

    @property
    def one_machine(self) -> bool:
        """Every worker runs on this node."""
        return self.local_worker_num == self.worker_num


def free_port() -> int:
    """A port nobody listens on right now, for a master_port (every msrun needs its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_executable() -> str:
    """The msrun installed next to this interpreter, else whichever is on PATH."""
    return shutil.which("msrun", path=str(Path(sys.executable).parent)) or "msrun"


def msrun_command(settings: MsrunSettings, script_args: list[str]) -> list[str]:
    """The msrun command line for ``settings``; ``script_args`` follow ``python`` (e.g. ``-m training.run ...``)."""
    return [
        msrun_executable(),
        f"--worker_num={settings.worker_num}", f"--local_worker_num={settings.local_worker_num}",
        f"--master_addr={settings.master_addr}", f"--master_port={settings.master_port}",
        f"--node_rank={settings.node_rank}", f"--log_dir={settings.log_dir}",
        # always joined: workers die with msrun (training/run.py), so a detached msrun would take them along
        "--join=True",
        f"--cluster_time_out={settings.cluster_time_out}", f"--tail_worker_log={settings.tail_worker_log}",
        # msrun resolves `python` on PATH for every worker; msrun_environment puts this interpreter first
        "python", *script_args,
    ]


def under_parent_death_signal(command: list[str]) -> list[str]:
    """``command`` under ``setpriv --pdeathsig=INT`` when available: it gets SIGINT when its parent dies (msrun's
    handler then kills every worker), so killing the launching process leaves no msrun running."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig=INT", "--", *command] if setpriv else command


def run_msrun(command: list[str], env: Mapping[str, str], *, cwd: Optional[Path] = None, output: Optional[IO] = None,
              timeout: Optional[float] = None) -> int:
    """Run msrun's ``command`` to its end; return its exit code (negative: the signal that killed it). It runs
    in a process group of its own under the parent-death signal; Ctrl-C here is handed to it (its handler stops
    the workers), and so is a ``timeout`` (seconds), after which TimeoutError is raised; once it has exited,
    whatever is left in its group is killed: msrun's ``tail -f`` helpers, which outlive a msrun killed with
    SIGKILL (its workers die with it by themselves, training/run.py). ``output``: a file for msrun's stdout and
    stderr (its echo of the workers' logs), else this process's."""
    proc = subprocess.Popen(under_parent_death_signal(command), env=dict(env), cwd=cwd, stdout=output,
                            stderr=subprocess.STDOUT if output else None, start_new_session=True)
    try:
        while True:
            try:
                return proc.wait(timeout)
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                raise TimeoutError(f"msrun ran longer than {timeout:g} s and was stopped: {shlex.join(command)}") \
                    from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def world_size_before_init() -> int:
    """The number of workers msrun started this process among (its MS_WORKER_NUM), before any communicator is
    built; 1 for a process started alone."""
    return int(os.environ.get("MS_WORKER_NUM", "1")) if "MS_ROLE" in os.environ else 1


def check_layout(config, model, workers: int):
    """Every reason ``config``'s parallel layout cannot train ``model`` (its GPTConfig, as validate_model_section
    gives it) on ``workers`` workers, in one ConfigError whose problems name the fields and the arithmetic:
    the degrees against the workers, the batch against the data-parallel ranks, tensor parallelism against the
    model's widths, the pipeline's stages and schedule, context parallelism against the sequence, expert
    parallelism against the experts. training_run runs it before msrun starts and training.run before any
    communicator is built, so a mistake is one line before launch, not a C++ stack in a worker log after it.
    Returns the ParallelDims. Loads MindSpore (the parallel package does)."""
    from training.config import ConfigError
    from training.parallel.context_parallel import check_context_parallel, token_positions
    from training.parallel.expert_parallel import check_expert_parallel
    from training.parallel.mesh import ParallelDims
    from training.parallel.pipeline import pipeline_problems
    from training.parallel.tensor_parallel import tensor_parallel_problems

    p, problems = config.parallelism, []

    def attempt(check):
        try:
            return check()
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None

    dims = attempt(lambda: ParallelDims.from_config(p, workers))
    micro_batches = attempt(lambda: dims.check_batch(config.training)) if dims else None
    problems += tensor_parallel_problems(model, p.tensor_parallel, p.sequence_parallel)
    if p.pipeline_parallel > 1:
        problems += pipeline_problems(config, model.num_hidden_layers, micro_batches)
    elif p.pipeline_parallel_interleave_num > 1:
        problems.append(f"parallelism.pipeline_parallel_interleave_num = {p.pipeline_parallel_interleave_num} "
                        f"splits each pipeline rank's layers into chunks, but parallelism.pipeline_parallel is 1")
    if p.context_parallel > 1:
        attempt(lambda: token_positions(model.seq_length, p.context_parallel, 0,
                                        config.kiln.parallelism.context_parallel_load_balance))
        attempt(lambda: check_context_parallel(config, model))
    attempt(lambda: check_expert_parallel(p, getattr(model, "n_routed_experts", None) if model.has_moe else None))
    if problems:
        raise ConfigError(*problems)
    return dims


class LaunchFailed(RuntimeError):
    """A local msrun launch that exited with an error; the message holds the tail of every worker's log."""


def run_on_local_workers(script_args: list, log_dir: Path, workers: int, *, timeout: Optional[float] = None,
                         env: Optional[Mapping[str, str]] = None) -> None:
    """Run ``script_args`` (what follows ``python``: a script or ``-m module``, and its arguments) under msrun on
    ``workers`` workers of this node, from the project root, on a free master port, with logs in ``log_dir``
    (msrun's own output in ``msrun.out``). What the tests and the benchmarks launch: the workers dispatch
    synchronously, as training.run does by default, unless ``env`` (default: this environment) says otherwise.
    A failed launch raises LaunchFailed with the tail of every worker's log."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = MsrunSettings(worker_num=workers, local_worker_num=workers, master_port=free_port(),
                             log_dir=str(log_dir), cluster_time_out=300)
    environment = msrun_environment(os.environ if env is None else env, one_machine=settings.one_machine)
    environment.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
    with open(log_dir / "msrun.out", "w") as output:
        code = run_msrun(msrun_command(settings, [str(a) for a in script_args]), environment, cwd=PROJECT_ROOT,
                         output=output, timeout=timeout)
    if code != 0:
        logs = sorted(log_dir.glob("worker_*.log")) or [log_dir / "msrun.out"]
        tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
        raise LaunchFailed(f"msrun of {shlex.join(map(str, script_args))} on {workers} workers exited with "
                           f"{code}:\n{tails}")


# MindSpore's cluster rendezvous and teardown poll the scheduler at random intervals between MS_RETRY_INTERVAL_LOWER
# and _UPPER seconds, spread so that the nodes of a big cluster do not ask in step. When every worker is on this
# machine the scheduler is a loopback hop away: polling within a second starts and ends each launch seconds sooner
# (docs/training.md, "Training outside Dagster", gives the measurement).
# MS_NODE_TIMEOUT stays at MindSpore's 30 s although a failed launch waits it out (msrun exits only after its
# scheduler has timed out the workers it killed): on CPU it is also how long a collective waits for its peers, and
# a rank waiting on another that is still compiling its graph fails ("Broadcast failed" at 10 s, in a loaded suite;
# pipeline stages therefore compile before their first exchange: Pipeline._compile_graphs).
ONE_MACHINE_POLLING = {"MS_RETRY_INTERVAL_LOWER": "0", "MS_RETRY_INTERVAL_UPPER": "1"}


def msrun_environment(base: Mapping[str, str], visible_devices: Optional[str] = None, *,
                      one_machine: bool) -> dict[str, str]:
    """The environment msrun (and so every worker) gets: this interpreter first on PATH, Kiln importable, and
    with ``one_machine`` (every worker on this node) the scheduler polled within a second, unless ``base`` says
    otherwise.

    ``visible_devices`` sets ASCEND_RT_VISIBLE_DEVICES; without it, the value in ``base`` (if any) stays.
    """
    env = {**(ONE_MACHINE_POLLING if one_machine else {}), **base}
    if visible_devices is not None:
        env["ASCEND_RT_VISIBLE_DEVICES"] = visible_devices
    if "ASCEND_RT_VISIBLE_DEVICES" in env:
        check_visible_devices(env["ASCEND_RT_VISIBLE_DEVICES"])
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ WARNING lines (cluster retries...) would drown the logs
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    # workers may be started from any directory, or as `python training/run.py`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def check_visible_devices(value: str) -> None:
    ids = value.split(",")
    if not all(i.strip().isdigit() for i in ids):
        raise SettingError("ASCEND_RT_VISIBLE_DEVICES", f"must be comma-separated device ids like '0,1,2,3', "
                                                        f"got {value!r}")
    if len({int(i) for i in ids}) != len(ids):
        raise SettingError("ASCEND_RT_VISIBLE_DEVICES", f"lists a device twice: {value!r}")


def script_arguments(command: str) -> list[str]:
    """What follows ``python`` in the workers' command line, from the launcher's quoted command."""
    words = shlex.split(command)
    if not words:
        raise SettingError("argument 1 (command)", "is empty; expected e.g. "
                                                   "'python -m training.run --config X.yaml'")
    if words[0] in PYTHON_NAMES:
        words = words[1:]
        if not words:
            raise SettingError("argument 1 (command)", "runs python with no script or module")
    elif Path(words[0]).name.startswith("python"):
        raise SettingError("argument 1 (command)", f"starts with {words[0]!r}: msrun always starts workers with "
                                                   "the `python` on PATH (this interpreter); write `python ...`")
    return words


def settings_from_positions(values: list[str]) -> MsrunSettings:
    """``values`` are the launcher's arguments after the command, in one of the FORMS."""
    count = len(values) + 1
    if count not in FORMS:
        raise SettingError("arguments", f"expected 1, 2, 6 or 9 arguments (the command first), got {count}")
    names = FORMS[count]
    position = {name: index + 2 for index, name in enumerate(names)}
    fields: dict = {}
    for name, value in zip(names, values):
        where = f"argument {position[name]} ({name})"
        if name == "JOIN":
            if value.lower() != "true":
                raise SettingError(where, f"must be True, got {value!r}: Kiln's workers exit with msrun, so a "
                                          "non-joining msrun would take them down; background the launcher instead")
        elif name in INTEGER_POSITIONS:
            try:
                fields[FIELD_OF[name]] = int(value)
            except ValueError:
                raise SettingError(where, f"must be a whole number, got {value!r}") from None
        else:
            fields[FIELD_OF[name]] = value
    if fields.get("worker_num") == 1:
        raise SettingError("argument 2 (WORKER_NUM)", "is 1: one worker needs no msrun; run the command "
                                                       "directly, e.g. python -m training.run --config X.yaml")
    # forms without LOCAL_WORKER run the whole job on this node
    fields.setdefault("local_worker_num", fields.get("worker_num", MsrunSettings.worker_num))
    try:
        return MsrunSettings(**fields)
    except SettingError as exc:
        names_of = {field: name for name, field in FIELD_OF.items()}
        name = names_of.get(exc.field)
        if name in position:
            raise SettingError(f"argument {position[name]} ({name})", exc.message) from None
        raise


def parse_args(argv: Optional[list[str]] = None) -> tuple[MsrunSettings, list[str], bool]:
    parser = argparse.ArgumentParser(prog="python -m training.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", help="the quoted worker command, e.g. 'python -m training.run --config X.yaml'")
    parser.add_argument("positions", nargs="*", metavar="ARG", help="the settings of one of the forms above")
    parser.add_argument("--dry-run", action="store_true", help="print the msrun command instead of running it")
    args = parser.parse_args(argv)
    try:
        settings = settings_from_positions(args.positions)
        script_args = script_arguments(args.command)
    except SettingError as exc:
        parser.error(str(exc))
    return settings, script_args, args.dry_run


def main(argv: Optional[list[str]] = None) -> None:
    settings, script_args, dry_run = parse_args(argv)
    command = msrun_command(settings, script_args)
    if dry_run:
        print(shlex.join(command))
        return
    try:
        env = msrun_environment(os.environ, one_machine=settings.one_machine)
    except SettingError as exc:
        sys.exit(f"python -m training.launch: {exc}")
    print(f"[kiln] {shlex.join(command)}", file=sys.stderr, flush=True)
    code = run_msrun(command, env)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
