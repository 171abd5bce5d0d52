"""Multi-node msrun on loopback: two "nodes" (node_rank 0 and 1, one worker each) form one job and train."""
import os
import socket
import subprocess
import sys
import threading

import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT
from test_chain import metric_losses
from training.checkpoint import load_checkpoint
from training.launch import free_port
from training.run import main as train_main

pytestmark = pytest.mark.msrun


# msrun starts the scheduler on every node that owns the master_addr. Both "nodes" are this machine, so
# node 1 names the master 127.0.0.2 (not an interface address here) and a forwarder stands in for the
# network between the nodes, carrying 127.0.0.2:port to the scheduler on 127.0.0.1:port.
MASTER_ADDR_SEEN_FROM = {0: "127.0.0.1", 1: "127.0.0.2"}


def forward(listen_addr: str, target_addr: str, port: int) -> socket.socket:
    server = socket.create_server((listen_addr, port))

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with source, sink:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:  # the other side went away
                pass

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed by the test
                return
            try:
                upstream = socket.create_connection((target_addr, port))
            except OSError:  # the scheduler is not listening yet: refuse, like the real network would; msrun retries
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def node_command(rank: int, port: int, log_dir, train_command: str) -> list[str]:
    # the launcher's per-node form: WORKER_NUM LOCAL_WORKER MASTER_ADDR MASTER_PORT NODE_RANK LOG_DIR JOIN TIMEOUT
    return [sys.executable, "-m", "training.launch", train_command,
            "2", "1", MASTER_ADDR_SEEN_FROM[rank], str(port), str(rank), str(log_dir), "True", "120"]


def test_two_nodes_on_loopback_train_one_job(tmp_path, shard):
    checkpoints = tmp_path / "run/checkpoints"
    train = (f"python -m training.run --config {MICRO_CONFIG} --output-dir {tmp_path / 'run'} "
             f"--set \"train_dataset.dataloader.config.data_path=[1.0, '{shard}']\" "
             "--set train_dataset.dataloader.config.eod=2 --set train_dataset.dataloader.config.pad=3 "
             f"--set checkpoint.save_path={checkpoints}")
    port = free_port()
    network = forward(MASTER_ADDR_SEEN_FROM[1], MASTER_ADDR_SEEN_FROM[0], port)
    nodes = [subprocess.Popen(node_command(rank, port, tmp_path / f"node{rank}_logs", train), cwd=PROJECT_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        errors = [node.communicate(timeout=240)[1] for node in nodes]
    finally:
        network.close()
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    for rank, (node, err) in enumerate(zip(nodes, errors)):
        assert node.returncode == 0, f"node {rank}: {err[-2000:]}\n" + (
            tmp_path / f"node{rank}_logs/worker_{rank}.log").read_text()[-3000:]
    # each node's msrun ran only its own worker: rank 0 on node 0, rank 1 on node 1
    assert sorted(p.name for p in (tmp_path / "node0_logs").glob("worker_*.log")) == ["worker_0.log"]
    assert sorted(p.name for p in (tmp_path / "node1_logs").glob("worker_*.log")) == ["worker_1.log"]
    loaded = load_checkpoint(checkpoints / "iteration_00000006")
    assert loaded.common["global_step"] == 6 and loaded.state["world_size"] == 2 and loaded.model
    # one job, data parallel across the nodes: the same losses as one process reading the same global batches
    single = tmp_path / "single"
    (config,) = (tmp_path / "run").glob("config-*.yaml")
    assert train_main(["--config", str(config), "--output-dir", str(single),
                       "--set", "checkpoint.enable_save=false"]) == 0
    assert metric_losses(tmp_path / "run") == pytest.approx(metric_losses(single), rel=1e-5)
