"""Launch MindSpore's ``msrun`` under a Dagster Pipes session, streaming rank 0's reports live.

The stock ``PipesSubprocessClient.run`` blocks until the process ends, so checkpoint messages would
only arrive after training; this launcher polls the session while msrun runs instead. It also owns
process hygiene: msrun runs in its own process group under ``setpriv --pdeathsig`` (a killed step
process takes msrun down), workers set their own parent-death signal (training/run.py), and an
interrupt (UI cancel) sends SIGINT — msrun's own handler kills every worker — then SIGKILL if needed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import dagster as dg
from pydantic import Field

from resources.devices import DevicesBusy, lease_devices
from resources.storage import PROJECT_ROOT
from training.failures import error_line
from training.reporting import is_report_line
from training.launch import (MsrunSettings, SettingError, check_visible_devices, free_port, msrun_command,
                             msrun_environment, under_parent_death_signal)


def tail(path: Path, lines: int) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# a MindSpore log line, from C++ ("[INFO] DISTRIBUTED(pid,thread,python):...") or Python ("[WARNING] ME(pid:thread,...")
_MINDSPORE_LOG_LINE = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR)\] [A-Z_]+\(\d+[,:]")
_GLOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # GLOG_v 0..3


def echo_msrun_output(stream, out, glog_v: int) -> None:
    """Copy msrun's output (its own lines and its tail of worker 0's log) to ``out``, line by line, without
    two kinds: MindSpore C++ lines below GLOG_v (its RPC threads print '[INFO] DISTRIBUTED ... Event base
    dispatch success!' at exit whatever GLOG_v says), and rank 0's report lines, which reach the Dagster
    log through Pipes (a console showing both would show every step twice). The worker logs keep both."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        level = _MINDSPORE_LOG_LINE.match(line)
        if (level and _GLOG_LEVELS.index(level.group(1)) < glog_v) or is_report_line(line):
            continue
        out.write(line)
        out.flush()


class OrphanedStep(dg.Failure):
    """The run worker that started this step process died (kill -9, the OOM killer). The code server fails its
    run and Dagster's run retries start another, which must not find this step still training; no step retry
    either: nothing is left to run it."""

    def __init__(self, run_worker: int):
        super().__init__(f"the process that started this step (pid {run_worker}, the Dagster run worker) died: "
                         f"msrun stopped, so that no retry of the run trains beside it", allow_retries=False)


class _MessageHandler:
    """Hands rank 0's custom messages to the callback. A callback error is logged and the message kept for
    one retry after msrun exits: recording a checkpoint (instance storage busy, a bug) must not stop a
    healthy training run, which an exception in the polling loop would. One still failing then fails the
    step, after training has finished and with every checkpoint on disk."""

    def __init__(self, context: dg.AssetExecutionContext, callback: Callable[[dict], None]):
        self.context, self.callback = context, callback
        self.handled = 0
        self.failed: list[dict] = []

    def drain(self, session) -> None:
        messages = session.get_custom_messages()
        for message in messages[self.handled:]:
            self.handled += 1
            try:
                self.callback(message)
            except Exception:  # noqa: BLE001 -- logged; retried after msrun exits
                self.context.log.error(f"[msrun] handling rank 0's message {_describe(message)} failed; training "
                                       f"goes on, the message is retried when msrun exits:\n{traceback.format_exc()}")
                self.failed.append(message)

    def retry_failed(self) -> None:
        still_failing = []
        for message in self.failed:
            try:
                self.callback(message)
            except Exception as exc:  # noqa: BLE001 -- collected into the step's failure
                still_failing.append(f"{_describe(message)}: {type(exc).__name__}: {exc}")
        self.failed = []
        if still_failing:
            raise dg.Failure("training finished, but handling these messages from rank 0 failed twice (their "
                             "files are on disk; see the errors logged during the run):\n" + "\n".join(still_failing))


def _describe(message: dict) -> str:
    return f"{message.get('event', '?')} {message.get('path', '')}".strip()


class MsrunNode(dg.Config):
    """One machine of a multi-node job."""

    address: str = Field(description="host name or IP the other nodes reach it at; the first node is the master")
    devices: int = Field(description="workers (NPUs) this node runs")
    visible_devices: Optional[str] = Field(default=None, description="its ASCEND_RT_VISIBLE_DEVICES, e.g. '0,1,2,3'")


class MsrunResource(dg.ConfigurableResource):
    """msrun settings for one node; a multi-node run starts one materialization per node_rank.

    The command comes from ``training.launch.msrun_command``, like the command-line launcher's; msrun
    always joins here, since the Pipes session lives as long as msrun does. A cluster is described by
    ``nodes``; ``for_node`` derives this node's settings from it (``settings`` refuses any that disagree).
    """

    worker_num: int = Field(default=2, description="workers in the whole job")
    local_worker_num: int = Field(default=2, description="workers on this node")
    master_addr: str = "127.0.0.1"
    master_port: int = Field(default=0, description="0 picks a free port for every launch")
    node_rank: int = 0
    cluster_time_out: int = Field(default=600, description="seconds msrun waits for the cluster to form")
    tail_worker_log: int = Field(default=0, description="worker whose log msrun echoes to stdout; -1 all")
    device_target: str = Field(default="CPU", description="CPU, Ascend or GPU; written into context.device_target")
    visible_devices: Optional[str] = Field(default=None, description=(
        "this machine's devices for training, e.g. '0,1,2,3,4,5,6,7'; each launch leases local_worker_num of "
        "them and gets those as ASCEND_RT_VISIBLE_DEVICES"))
    device_lease_dir: Optional[str] = Field(default=None, description=(
        "where this machine's device leases are kept; default: $DAGSTER_HOME/device_leases, else the temp dir"))
    device_wait_s: float = Field(default=3600.0, description="seconds a launch waits for its devices to be free")
    termination_timeout_s: float = 20.0
    failure_tail_lines: int = 40
    nodes: list[MsrunNode] = Field(default=[], description="the cluster, master first; empty: this machine only")

    @classmethod
    def for_node(cls, nodes: list[MsrunNode], node_rank: int, master_port: int, **settings) -> "MsrunResource":
        """The resource of node ``node_rank`` of the cluster ``nodes``: every node gets the same nodes and port."""
        if not 0 <= node_rank < len(nodes):
            raise dg.Failure(f"MsrunResource.node_rank: must index nodes (0..{len(nodes) - 1}), got {node_rank}")
        node = nodes[node_rank]
        return cls(nodes=nodes, node_rank=node_rank, master_port=master_port, master_addr=nodes[0].address,
                   worker_num=sum(n.devices for n in nodes), local_worker_num=node.devices,
                   visible_devices=node.visible_devices, **settings)

    def check_nodes(self) -> None:
        """With ``nodes``, the flat fields must be this node's view of them (as ``for_node`` sets them)."""
        if not self.nodes:
            return
        if not 0 <= self.node_rank < len(self.nodes):
            raise dg.Failure(f"MsrunResource.node_rank: must index nodes (0..{len(self.nodes) - 1}), "
                             f"got {self.node_rank}")
        node = self.nodes[self.node_rank]
        expected = {"worker_num": sum(n.devices for n in self.nodes), "local_worker_num": node.devices,
                    "master_addr": self.nodes[0].address, "visible_devices": node.visible_devices}
        for field, value in expected.items():
            if getattr(self, field) != value:
                raise dg.Failure(f"MsrunResource.{field}: is {getattr(self, field)!r} but nodes give {value!r} "
                                 f"for node_rank {self.node_rank}; build it with MsrunResource.for_node")
        if self.master_port == 0:
            raise dg.Failure("MsrunResource.master_port: a multi-node job needs one fixed port that every node "
                             "knows; 0 (a free port per launch) only works on one machine")

    def settings(self, log_dir: Path, master_port: int) -> MsrunSettings:
        self.check_nodes()
        try:
            return MsrunSettings(worker_num=self.worker_num, local_worker_num=self.local_worker_num,
                                 master_addr=self.master_addr, master_port=master_port, node_rank=self.node_rank,
                                 log_dir=str(log_dir), cluster_time_out=self.cluster_time_out,
                                 tail_worker_log=self.tail_worker_log)
        except SettingError as exc:
            raise dg.Failure(f"MsrunResource.{exc}") from None

    def command(self, script_args: list[str], log_dir: Path, master_port: int) -> list[str]:
        """The same msrun command as ``python -m training.launch`` builds, under setpriv when available."""
        return under_parent_death_signal(msrun_command(self.settings(log_dir, master_port), script_args))

    def environment(self, extra: dict[str, str], visible_devices: Optional[str] = None) -> dict[str, str]:
        try:
            return msrun_environment({**os.environ, **extra}, visible_devices or self.visible_devices,
                                     one_machine=self.local_worker_num == self.worker_num)
        except SettingError as exc:
            raise dg.Failure(f"MsrunResource: {exc}") from None

    def lease_dir(self) -> Path:
        if self.device_lease_dir:
            return Path(self.device_lease_dir)
        home = os.environ.get("DAGSTER_HOME")
        return Path(home) / "device_leases" if home else Path(tempfile.gettempdir()) / "kiln-device-leases"

    @contextmanager
    def devices(self, context: dg.AssetExecutionContext) -> Iterator[Optional[str]]:
        """This launch's ASCEND_RT_VISIBLE_DEVICES, leased for the block (None on CPU: no device list)."""
        if not self.visible_devices:
            yield None
            return
        try:
            check_visible_devices(self.visible_devices)
            lease = lease_devices(self.visible_devices.split(","), self.local_worker_num, self.lease_dir(),
                                  {"run_id": context.run_id}, wait_s=self.device_wait_s,
                                  on_wait=lambda why: context.log.info(f"[msrun] waiting for devices: {why}"))
            with lease as leased:
                context.log.info(f"[msrun] devices {','.join(leased)} leased for this run")
                yield ",".join(leased)
        except (DevicesBusy, SettingError) as exc:
            raise dg.Failure(f"MsrunResource.visible_devices: {exc}") from None

    def run(self, context: dg.AssetExecutionContext, script_args: list[str], log_dir: Path,
            on_custom_message: Callable[[dict], None]) -> list[str]:
        """Run msrun to completion; return the command. Raise ``dg.Failure`` with worker log tails."""
        log_dir.mkdir(parents=True, exist_ok=True)
        port = self.master_port or free_port()
        cmd = self.command(script_args, log_dir, port)
        context.log.info(f"[msrun] {' '.join(cmd)}")
        messages = _MessageHandler(context, on_custom_message)
        with self.devices(context) as visible_devices, dg.open_pipes_session(
                context=context, context_injector=dg.PipesTempFileContextInjector(),
                message_reader=dg.PipesTempFileMessageReader()) as session:
            env = self.environment(session.get_bootstrap_env_vars(), visible_devices)
            proc = subprocess.Popen(cmd, env=env, cwd=PROJECT_ROOT, start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            echo = threading.Thread(target=echo_msrun_output, args=(proc.stdout, sys.stdout, int(env["GLOG_v"])),
                                    daemon=True)
            echo.start()
            started_by = os.getppid()
            try:
                while proc.poll() is None:
                    time.sleep(0.5)
                    messages.drain(session)
                    if os.getppid() != started_by:
                        raise OrphanedStep(started_by)
                context.log.info(f"[msrun] exited with code {proc.returncode}")
            except BaseException:  # UI cancel arrives as DagsterExecutionInterruptedError
                context.log.warning(f"[msrun] interrupted: SIGINT -> msrun pid {proc.pid}")
                self._stop(proc)
                raise
            finally:
                self._kill_group(proc)  # reaps msrun's `tail -f` helpers, which hold the output pipe open
                echo.join(timeout=self.termination_timeout_s)  # EOF once the tails are gone
                proc.stdout.close()
            # the message reader may still hold the last messages until the session closes
        messages.drain(session)
        if proc.returncode != 0:
            raise dg.Failure(**self._failure(proc.returncode, log_dir))
        messages.retry_failed()
        return cmd

    def _stop(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=self.termination_timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group(proc)
            proc.wait()

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _failure(self, returncode: int, log_dir: Path) -> dict:
        logs = sorted(log_dir.glob("worker_*.log"))  # worker_0 (rank 0) first
        # a worker that stopped on a user error said so in one line (training.run's error boundary): rank 0's
        # leads; else the worker that raised is the one with a traceback; the others were killed by msrun
        said = {p: [line for line in p.read_text(errors="replace").splitlines() if error_line(line)] for p in logs}
        failing = ([p for p in logs if said[p]] or [p for p in logs if "Traceback" in p.read_text(errors="replace")]
                   or logs)
        first = failing[0] if failing else log_dir / "worker_0.log"
        excerpt = tail(first, self.failure_tail_lines)
        headline = f"{first.name}: {said[first][-1]}" if said.get(first) else f"{first.name} ends with:"
        return {
            "description": f"msrun exited with code {returncode}; {headline}\n{excerpt}",
            "metadata": {"log_dir": dg.MetadataValue.path(str(log_dir)),
                         **{f"tail_{p.stem}": dg.MetadataValue.md(f"```\n{tail(p, self.failure_tail_lines)}\n```")
                            for p in logs + [log_dir / "scheduler.log"] if p.exists()}},
        }
