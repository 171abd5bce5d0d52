"""The cleaning on a Ray cluster of two nodes started as processes on 127.0.0.1 (`ray start --head`, then a
worker node joining it): the same output as a local run, byte for byte; an unreachable address in one line."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from test_cleaning import vocabulary, words  # noqa: E402
from training.data.cleaning.pipeline import ChunkStage, CleaningError, RawInput  # noqa: E402
from training.data.cleaning.recipe import load_recipe  # noqa: E402
from training.data.cleaning.runners import FilterJob, FinalizeJob, LocalRunner, RayRunner  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head` and a second node, each a process group of its own that only this fixture ends."""
    ray_bin = Path(sys.executable).with_name("ray")
    port = free_port()
    temp = Path(f"/tmp/kr{os.getpid()}")
    common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
    head = subprocess.Popen([str(ray_bin), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--include-dashboard=false", f"--temp-dir={temp}", *common], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        worker = subprocess.Popen([str(ray_bin), "start", f"--address={address}", "--node-ip-address=127.0.0.1",
                                   *common], start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2, "the worker node did not join"
        yield address
    finally:
        import ray

        ray.shutdown()
        for process in (worker, head):
            if process is not None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def chunks(tmp_path: Path) -> list[list[Path]]:
    rng = random.Random(5)
    vocab = vocabulary(rng)
    texts = [" ".join(words(rng, 150, vocab)) + "." for _ in range(40)]
    near = texts[7].split()
    near[70] = "changed"
    files = []
    for i, part in enumerate((texts[:20], texts[20:] + [texts[3], " ".join(near), "short"])):
        path = tmp_path / "raw" / f"c{i}" / "part-00000.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        files.append([path])
    return files


def clean(runner, files: list[list[Path]], out: Path) -> None:
    recipe = load_recipe({"steps": [{"length": {"min_chars": 10}}, "gopher_repetition"]})
    stages = [out / "filtered" / f"c{i}" for i in range(len(files))]
    runner.filter([FilterJob(recipe, tuple(RawInput(p, p.name) for p in paths), stage)
                   for paths, stage in zip(files, stages)])
    loaded = [ChunkStage.load(f"c{i}", stage) for i, stage in enumerate(stages)]
    clusters = runner.cluster(loaded, recipe)
    keys = tuple((s.key, s.stage) for s in loaded)
    runner.finalize([FinalizeJob(keys, i, out / "clean" / f"c{i}", f"c{i}") for i in range(len(files))], clusters)


def test_ray_cleaning_is_byte_identical_to_local(tmp_path, ray_cluster):
    files = chunks(tmp_path)
    clean(LocalRunner(), files, tmp_path / "local")
    clean(RayRunner(ray_cluster), files, tmp_path / "ray")
    local = sorted(p.relative_to(tmp_path / "local" / "clean") for p in (tmp_path / "local" / "clean").rglob("*.*"))
    assert len(local) == 6  # per chunk: cleaned JSONL, removals.jsonl, c<i>.kiln.json
    for name in local:
        assert (tmp_path / "ray" / "clean" / name).read_bytes() == (tmp_path / "local" / "clean" / name).read_bytes()
    removed = [json.loads(l) for l in (tmp_path / "ray/clean/c1/removals.jsonl").read_text().splitlines()]
    assert [(e["line"], e.get("step")) for e in removed if not e["kept"]] == [
        (21, "exact_dedup"), (22, "minhash_dedup"), (23, "length")]


def test_an_unreachable_ray_address_is_one_line(tmp_path):
    with pytest.raises(CleaningError) as caught:
        RayRunner(f"127.0.0.1:{free_port()}")
    assert "\n" not in str(caught.value) and "the Ray cluster at '127.0.0.1:" in str(caught.value)
