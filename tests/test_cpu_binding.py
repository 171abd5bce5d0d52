"""CPU workers of one node bound to their own cores (training/cpu_binding.py)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT
from training.cpu_binding import LOCAL_WORKERS, core_share
from training.launch import msrun_environment


@pytest.mark.parametrize("cores, workers, expected", [
    ([0, 1], 4, [[0], [1], [0], [1]]),  # more workers than cores: one core each, round robin
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([4, 5, 6, 7, 8], 2, [[4, 5, 6], [7, 8]]),  # the first block one longer; the cores the process was given
    ([3, 1, 2], 3, [[1], [2], [3]]),
])
def test_each_worker_gets_its_own_share_of_the_cores(cores, workers, expected):
    assert [core_share(cores, workers, rank) for rank in range(workers)] == expected


def _bound(environment: dict) -> dict:
    """What a fresh process started with ``environment`` binds to: its answer and each thread's cores after."""
    probe = ("import json, os, threading\n"
             "from training.cpu_binding import bind_local_worker\n"
             "threading.Thread(target=threading.Event().wait, daemon=True).start()  # a thread started before\n"
             "share = bind_local_worker()\n"
             "print(json.dumps({'share': share, 'threads': [sorted(os.sched_getaffinity(int(t)))\n"
             "                  for t in os.listdir('/proc/self/task')]}))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, env=environment, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding to a share needs two cores to share")
def test_a_worker_binds_every_thread_to_its_share_and_a_process_on_its_own_stays_unbound():
    cores = sorted(os.sched_getaffinity(0))
    environment = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    second_of_two = _bound({**environment, LOCAL_WORKERS: "2", "DEVICE_ID": "1"})
    assert second_of_two["share"] == core_share(cores, 2, 1)
    assert len(second_of_two["threads"]) == 2 and all(t == second_of_two["share"] for t in second_of_two["threads"])
    alone = {k: v for k, v in environment.items() if k not in (LOCAL_WORKERS, "DEVICE_ID")}
    for unbound in (alone, {**alone, "DEVICE_ID": "0"}, {**alone, LOCAL_WORKERS: "1", "DEVICE_ID": "0"}):
        assert _bound(unbound) == {"share": None, "threads": [cores, cores]}


def test_kilns_launchers_tell_the_workers_how_many_share_the_node():
    assert msrun_environment({}, one_machine=True, local_workers=4)[LOCAL_WORKERS] == "4"
    assert LOCAL_WORKERS not in msrun_environment({}, one_machine=True)
