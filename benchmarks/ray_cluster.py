"""A Ray cluster of real nodes on 127.0.0.1, for the cleaning's Ray test and benchmark: `ray start --head` and
`ray start --address` for each further node, each run with --block as a process group of its own, which is all
that is ended afterwards (never `ray stop`, which ends every Ray process of the machine)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> subprocess.Popen:
    ray_bin = Path(sys.executable).with_name("ray")
    # no draining on SIGTERM: a node that has run a task otherwise asks the head to drain it and waits ~30 s before
    # it ends (Ray's default, for serving clusters; measured with Ray 2.60 here)
    return subprocess.Popen([str(ray_bin), "start", "--block", "--num-cpus=1", "--disable-usage-stats",
                             "--node-ip-address=127.0.0.1", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})


@contextlib.contextmanager
def local_ray_cluster(nodes: int = 2, timeout: float = 180):
    """Yields the head's address once ``nodes`` nodes (one CPU each) have joined; the driver is connected."""
    import ray

    port = free_port()
    temp = Path(f"/tmp/kr{os.getpid()}")  # short: Ray's unix sockets live under it
    processes = [_start(["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}"])]
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Ray head on {address} did not start in {timeout} s") from None
                time.sleep(1)
        processes += [_start([f"--address={address}"]) for _ in range(nodes - 1)]
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
        while len([n for n in ray.nodes() if n["Alive"]]) < nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(ray.nodes())} of {nodes} Ray nodes joined in {timeout} s")
            time.sleep(1)
        yield address
    finally:
        ray.shutdown()
        for process in reversed(processes):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
