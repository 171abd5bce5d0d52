"""Device leases: which of this machine's NPUs a training launch may use, so two runs never share one.

The `npu` concurrency pool bounds how many training steps run at once, but Dagster does not say which
slot a step holds, so every step would otherwise get the same ``ASCEND_RT_VISIBLE_DEVICES``. Each
launch therefore leases its devices: one lock file per device in a directory of this machine, held
with ``flock`` for as long as msrun runs. The kernel drops a lock when its holder dies, however it
dies, so a killed run never leaves a device leased.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class DevicesBusy(Exception):
    pass


def _try_lock(path: Path, holder: str):
    """An open file holding the exclusive lock on ``path``, or None if another holder has it."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(holder)
    handle.flush()
    return handle


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextmanager
def lease_devices(devices: list[str], count: int, lease_dir: Path, holder: dict,
                  wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None,
                  poll_s: float = 1.0) -> Iterator[list[str]]:
    """Hold ``count`` of ``devices`` (in their listed order) until the block ends; yields the leased ids.

    Waits up to ``wait_s`` seconds for enough devices to be free (``on_wait`` is told once what it waits
    for), then raises ``DevicesBusy`` naming who holds them. ``holder`` (run id, pid, ...) is written into
    each lock file for that message.
    """
    if count > len(devices):
        raise DevicesBusy(f"{count} devices asked for, but only {len(devices)} are visible ({','.join(devices)})")
    lease_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**holder, "pid": os.getpid()})
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        held: list[tuple[str, object]] = []
        for device in devices:
            handle = _try_lock(lease_dir / f"device-{device}.lock", text)
            if handle is not None:
                held.append((device, handle))
                if len(held) == count:
                    break
        if len(held) == count:
            break
        for _, handle in held:
            handle.close()
        got = {device for device, _ in held}
        busy = {d: _holder(lease_dir / f"device-{d}.lock") for d in devices if d not in got}
        message = (f"{count} of devices {','.join(devices)} wanted, {len(held)} free; leased in {lease_dir}: "
                   + "; ".join(f"device {d} by {who}" for d, who in busy.items()))
        if time.monotonic() >= deadline:
            raise DevicesBusy(message)
        if on_wait and not told:
            on_wait(message)
            told = True
        time.sleep(poll_s)
    try:
        yield [device for device, _ in held]
    finally:
        for _, handle in held:
            handle.close()  # closing the file releases its lock
