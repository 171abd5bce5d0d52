"""CPU workers of one node, each bound to its own cores.

MindSpore's CPU kernel pool keeps its threads spinning (``sched_yield``) between kernels, on whatever core the
scheduler gives them. When several msrun workers share a node's cores, each worker's spinning threads take CPU from
the others' compute: in ``tests/test_context_parallel.py``'s launch (4 workers on 2 cores, eager but one case) a
quarter of the CPU went to it, most as system time. A worker whose threads all share its own cores spins only while
nothing of its own is ready to run, and yields to it. Kiln's launchers (``python -m training.launch``,
``MsrunResource``, the tests' and benchmarks' launches) export the node's worker count as ``KILN_LOCAL_WORKERS``,
and each worker on a CPU device binds itself (``training.step.configure_runtime``) to its share of the cores it was
started with: a contiguous block when there are cores for every worker, one core, round robin, when there are not. A
worker msrun started without that variable keeps the scheduler's placement. docs/training.md gives the measurements.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

LOCAL_WORKERS = "KILN_LOCAL_WORKERS"
# msrun numbers the workers of a node from 0 in DEVICE_ID (the device each one drives; on CPU, its index)
LOCAL_RANK = "DEVICE_ID"


def core_share(cores: Sequence[int], local_workers: int, local_rank: int) -> list[int]:
    """The cores of ``cores`` that worker ``local_rank`` of ``local_workers`` runs on: the rank's block of an even
    split (the first blocks one core longer when it does not divide), or one core when the workers outnumber them."""
    cores = sorted(cores)
    if local_workers > len(cores):
        return [cores[local_rank % len(cores)]]
    size, longer = divmod(len(cores), local_workers)
    start = local_rank * size + min(local_rank, longer)
    return cores[start:start + size + (local_rank < longer)]


def bind_local_worker(environ: Mapping[str, str] = os.environ) -> Optional[list[int]]:
    """Bind every thread of this process to its worker's share of the cores (``core_share``), when a Kiln launcher
    started it as one of several workers on this node; the cores bound to, or None when it was not."""
    local_workers = int(environ.get(LOCAL_WORKERS, "0"))
    if local_workers < 2 or LOCAL_RANK not in environ:
        return None
    share = core_share(os.sched_getaffinity(0), local_workers, int(environ[LOCAL_RANK]) % local_workers)
    # threads started from here on inherit the binding of the thread that starts them; those MindSpore has started
    # already (its kernel pool) are bound one by one
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), share)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return share
