"""Resuming: a run whose worker, launching step process or msrun is killed with kill -9 leaves no process, and
training_run's retries resume it to the same losses; weight-only, changed batch size and Hugging Face loads; a
checkpoint of one process resumes in two and vice versa."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from conftest import (MICRO_CONFIG, PROJECT_ROOT, run_under_msrun, shard_data, validate_as_one_process,
                      write_random_documents)
from resources.msrun import MsrunResource, free_port
from test_cancel import alive, command_line, descendants
from test_trainer import losses, make_trainer
from training.checkpoint import TRACKER, load_checkpoint, tracked_step
from training.config import load_config
from training.launch import MsrunSettings, msrun_command, msrun_environment
from training.reporting import is_step_record, read_records

STEPS = 8


def run_overrides(shard, save_path, *extra):
    return [*shard_data(shard), f"checkpoint.save_path={save_path}",
            f"training.steps={STEPS}", "checkpoint.save_interleaved_steps=2", *extra]


def training_args(run_dir: Path, overrides: list[str]) -> list[str]:
    args = ["-m", "training.run", "--config", str(PROJECT_ROOT / MICRO_CONFIG), "--output-dir", str(run_dir)]
    for override in overrides:
        args += ["--set", override]
    return args


def start_msrun(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    settings = MsrunSettings(worker_num=2, local_worker_num=2, master_port=free_port(),
                             log_dir=str(run_dir / "msrun_log"), cluster_time_out=300)
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(msrun_command(settings, training_args(run_dir, overrides)),
                            env=msrun_environment(os.environ, one_machine=settings.one_machine), cwd=PROJECT_ROOT,
                            stdout=open(run_dir / "msrun.out", "wb"), stderr=subprocess.STDOUT)


def train_under_msrun(run_dir: Path, overrides: list[str]) -> None:
    proc = start_msrun(run_dir, overrides)
    assert proc.wait(timeout=600) == 0, (run_dir / "msrun.out").read_text()[-3000:]


def worker_pids(msrun_pid: int) -> list[int]:
    """The training workers msrun started (its scheduler process runs the script too, as MS_SCHED)."""
    pids = []
    for pid in sorted(descendants(msrun_pid)):
        try:  # a short-lived process of the launch may have ended since the tree was read
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"MS_ROLE=MS_WORKER" in environ and "training.run" in command_line(pid):
            pids.append(pid)
    return pids


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-worker run of STEPS steps, and its data."""
    root = tmp_path_factory.mktemp("reference")
    shard = write_random_documents(root / "data/shards/random")
    train_under_msrun(root / "run", run_overrides(shard, root / "run/checkpoints"))
    return shard, losses(root / "run")


def wait_for_steps(proc: subprocess.Popen | None, run_dir: Path, count: int) -> None:
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < count:
        assert (proc is None or proc.poll() is None) and time.monotonic() < deadline, (
            (run_dir / "msrun.out").read_text()[-3000:] if (run_dir / "msrun.out").exists() else run_dir)
        time.sleep(0.05)


def kill_9(victim: int, launch: int) -> set[int]:
    """SIGKILL ``victim``; return every process of the launch rooted at ``launch``, taken just before."""
    tree = {launch, *descendants(launch)}
    os.kill(victim, signal.SIGKILL)
    return tree


def assert_all_end(tree: set[int], what: str) -> None:
    """No process of a killed launch is left (workers, msrun's scheduler and `tail -f` helpers included)."""
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in tree):
        assert time.monotonic() < deadline, f"{what}: still alive: {[p for p in tree if alive(p)]}"
        time.sleep(0.1)


# the process that starts msrun as MsrunResource does (its command: setpriv --pdeathsig=INT -- msrun ...), in the
# place of the Dagster step process
STEP_PROCESS = "import subprocess, sys; sys.exit(subprocess.Popen(sys.argv[1:], start_new_session=True).wait())"


@pytest.mark.msrun
def test_kill_9_of_the_step_process_leaves_no_process_and_a_complete_checkpoint(tmp_path, reference):
    """The process that launched msrun (the Dagster step process) killed while async, redundancy-free saves run:
    setpriv hands msrun a SIGINT, msrun kills its workers, nothing is left; the tracked checkpoint is whole and
    every step logged has the uninterrupted loss. (A killed worker and a killed msrun, and the resumes after
    them: the retry test below.)"""
    shard, uninterrupted = reference
    save_path = tmp_path / "checkpoints"
    run_dir = tmp_path / "step_process_killed"
    overrides = run_overrides(shard, save_path, "checkpoint.async_save=true", "checkpoint.remove_redundancy=true")
    command = MsrunResource(worker_num=2, local_worker_num=2).command(training_args(run_dir, overrides),
                                                                       run_dir / "msrun_log", free_port())
    run_dir.mkdir()
    step = subprocess.Popen([sys.executable, "-c", STEP_PROCESS, *command],
                            env=msrun_environment(os.environ, one_machine=True), cwd=PROJECT_ROOT,
                            stdout=open(run_dir / "msrun.out", "wb"), stderr=subprocess.STDOUT)
    wait_for_steps(step, run_dir, 5)
    assert_all_end(kill_9(step.pid, step.pid), "step process killed")
    step.wait()
    tracked = tracked_step(save_path)
    assert tracked in (2, 4, 6) and logged_steps(run_dir) < STEPS, (tracked, logged_steps(run_dir))
    loaded = load_checkpoint(save_path / f"iteration_{tracked:08d}")  # complete: every tensor readable
    assert loaded.common["global_step"] == tracked and loaded.optim
    logged = losses(run_dir)
    assert logged and {s: uninterrupted[s] for s in logged} == logged  # bit for bit


@pytest.mark.msrun
def test_one_process_checkpoint_resumes_in_two_workers(tmp_path, reference):
    shard, uninterrupted = reference
    single = make_trainer(tmp_path, shard, "single", "training.steps=2")
    single.train()
    checkpoint = tmp_path / "single/checkpoints/iteration_00000002"
    train_under_msrun(tmp_path / "two", run_overrides(shard, tmp_path / "two/checkpoints", f"checkpoint.load_path={checkpoint}"))
    after = losses(tmp_path / "two")
    assert sorted(after) == list(range(3, STEPS + 1))
    # one process accumulates what two workers average: equal up to float32 summation order
    assert [after[s] for s in after] == pytest.approx([uninterrupted[s] for s in after], rel=1e-5)


def test_weight_only_init_starts_at_step_zero_with_a_fresh_optimizer(tmp_path, shard):
    first = make_trainer(tmp_path, shard, "first", "training.steps=3")
    first.train()
    weights = {p.name: p.asnumpy() for p in first.model.get_parameters()}
    init = make_trainer(tmp_path, shard, "init", "checkpoint.no_load_optim=true",
                        f"checkpoint.load_path={tmp_path / 'first/checkpoints'}")
    assert init.step == 0 and init.data_position.consumed_samples == 0 and init.optimizer.global_step == 0
    assert all(np.array_equal(p.asnumpy(), weights[p.name]) for p in init.model.get_parameters())
    assert all(not a.any() for n, a in init.optimizer.state_dict().items() if n.startswith("adam_"))


def test_changed_global_batch_size_keeps_consumed_samples(tmp_path, shard, capsys):
    make_trainer(tmp_path, shard, "gbs4", "training.steps=3").train()  # 3 steps x 4 samples
    capsys.readouterr()
    bigger = make_trainer(tmp_path, shard, "gbs8", "training.global_batch_size=8",
                          f"checkpoint.load_path={tmp_path / 'gbs4/checkpoints'}")
    assert bigger.data_position.consumed_samples == 12 and bigger.step == 1
    assert "global batch size changed 4 -> 8" in capsys.readouterr().out
    assert bigger.train_step()["consumed_samples"] == 20  # it read samples 12..19, none again, none skipped


def test_hugging_face_dir_loads_weights_only_through_training_hf(tmp_path, shard):
    """A checkpoint exported to a Hugging Face directory (training/hf.py) loads back as the same weights,
    at step 0 with a fresh optimizer."""
    from training.hf import export_hf

    make_trainer(tmp_path, shard, "donor", "training.steps=2").train()
    checkpoint = tmp_path / "donor/checkpoints/iteration_00000002"
    export_hf(checkpoint, tmp_path / "hf")
    weights = load_checkpoint(checkpoint, load_optim=False).model
    loaded = make_trainer(tmp_path, shard, "from_hf", f"checkpoint.load_path={tmp_path / 'hf'}")
    assert loaded.step == 0 and loaded.optimizer.global_step == 0 and loaded.resumed_from == str(tmp_path / "hf")
    assert all(np.array_equal(p.asnumpy(), weights[p.name]) for p in loaded.model.get_parameters())


def test_missing_or_empty_load_path_is_an_error(tmp_path, shard):
    from training.checkpoint import CheckpointError
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty directory"):
        make_trainer(tmp_path, shard, "x", f"checkpoint.load_path={tmp_path / 'empty'}")
    with pytest.raises(CheckpointError, match="no such directory"):
        make_trainer(tmp_path, shard, "x", f"checkpoint.load_path={tmp_path / 'absent'}")
    assert not (tmp_path / "empty" / TRACKER).exists()


BALANCED_LOAD_SCRIPT = '''
import json, sys
from pathlib import Path
import mindspore as ms
import training.checkpoint as checkpoint
from training.parallel.comm import Collectives
from training.parallel.mesh import init_world

if __name__ == "__main__":
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    world = init_world()
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    plain = checkpoint.load_checkpoint(path, rank=world.rank)
    read, real_read = [], checkpoint.read_regions
    checkpoint.read_regions = lambda f, c, regions, rank: read.extend(regions) or real_read(f, c, regions, rank)
    balanced = checkpoint.load_checkpoint_balanced(path, world, Collectives(world), readers=2)
    same = all(plain_part[n].dtype == got_part[n].dtype and plain_part[n].shape == got_part[n].shape
               and plain_part[n].tobytes() == got_part[n].tobytes()
               for plain_part, got_part in ((plain.model, balanced.model), (plain.optim, balanced.optim))
               for n in plain_part) and sorted(plain.model) == sorted(balanced.model)
    (out / f"rank{world.rank}.json").write_text(json.dumps({"read": read, "identical": same}))
'''


@pytest.mark.msrun
def test_balanced_load_reads_disjoint_subsets_and_equals_a_plain_load(tmp_path):
    from training.checkpoint import save_checkpoint
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World

    rng = np.random.default_rng(0)
    model = {"a.f32": rng.normal(size=(33, 7)).astype(np.float32), "b.f16": rng.normal(size=(5, 3)).astype(np.float16),
             "c.odd": rng.normal(size=3).astype(np.float16), "d.neg_zero": np.array([-0.0, np.nan], np.float32)}
    optim = {"adam_m.a.f32": rng.normal(size=(33, 7)).astype(np.float32), "global_step": np.array([7], np.int64)}
    world = World(rank=0, size=1)
    saved = save_checkpoint(save_path=tmp_path / "ckpt", step=1, model=model, optim=optim,
                            common={"global_step": 1, "consumed_samples": 4, "global_batch_size": 4}, lineage={},
                            prefix="checkpoint", save_max=1, world=world, collectives=Collectives(world))
    script = tmp_path / "balanced_load.py"
    script.write_text(BALANCED_LOAD_SCRIPT)
    run_under_msrun([script, saved.path, tmp_path], tmp_path / "msrun_log", workers=2, timeout=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["identical"] for r in ranks)
    read = [set(r["read"]) for r in ranks]
    assert read[0] and read[1] and not read[0] & read[1] and read[0] | read[1] == set(model) | set(optim)


def storage_for_shard(root: Path, shard: Path) -> "KilnStorage":
    """A data root whose blend manifest holds one source, a copy of ``shard``, with the micro config's seq_length,
    split and seed (what the reference run trained with), and a sentencepiece tokenizer that fits the model."""
    import shutil

    import sentencepiece

    from resources.storage import KilnStorage
    from training.data.hashing import sha256_file
    from training.data.manifest import build_manifest

    storage = KilnStorage(data_root=str(root / "data"), runs_root=str(root / "runs"),
                          sources_config=str(root / "sources.yaml"))
    prefix = storage.shard_prefix("random")
    prefix.parent.mkdir(parents=True)
    for ext in ("bin", "idx"):
        shutil.copyfile(f"{shard}.{ext}", f"{prefix}.{ext}")
    storage.tokenizer_prefix().parent.mkdir(parents=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(f"line {i} of words {i * 7}" for i in range(500)),
        model_prefix=str(storage.tokenizer_prefix()), vocab_size=64, hard_vocab_limit=False)
    tokenizer = f"{storage.tokenizer_prefix()}.model"
    tokens = int(np.fromfile(f"{prefix}.bin", np.uint16).size)
    manifest = build_manifest(
        sources=[{"name": "random", "weight": 1.0, "shards": [
            {"prefix": str(prefix), "tokens": tokens, "bin_sha256": sha256_file(f"{prefix}.bin"),
             "idx_sha256": sha256_file(f"{prefix}.idx")}]}],
        tokenizer={"path": tokenizer, "sha256": sha256_file(tokenizer), "special_ids": {"pad": 3, "eos": 2, "eod": 2}},
        seq_length=32, split="98,2,0", seed=1234, data_root=storage.root)
    storage.manifest_path().parent.mkdir(parents=True)
    storage.manifest_path().write_text(json.dumps(manifest))
    return storage


def training_launches(msrun_pids: list[int], count: int) -> list[int]:
    """Wait for this process's ``count``-th msrun (one per launch of training_run); return each one's pid."""
    deadline = time.monotonic() + 300
    while len(msrun_pids) < count:
        assert time.monotonic() < deadline, f"no msrun launch number {count}"
        msrun_pids += [pid for pid in sorted(descendants(os.getpid())) if pid not in msrun_pids
                       and "bin/msrun " in command_line(pid)]
        time.sleep(0.05)
    return msrun_pids


@pytest.mark.msrun
def test_training_run_retries_a_killed_worker_then_a_killed_msrun_and_ends_as_the_uninterrupted_run(
        tmp_path, reference):
    """kill -9 of a worker after the first checkpoint, then of msrun (the launcher) once the retry trains: Dagster
    retries training_run twice, each attempt resumes from the newest complete checkpoint, and the run ends with
    the uninterrupted run's losses and checkpoint partitions, and its validation loss, leaving no process."""
    from pipelines.definitions import ALL_ASSETS, resources

    shard, uninterrupted = reference
    storage = storage_for_shard(tmp_path, shard)
    run_dir = storage.run_dir("retried")
    trees, msrun_pids, errors = [], [], []

    def kill_a_worker_then_msrun() -> None:
        try:
            kill_in_turn()
        except Exception as exc:  # noqa: BLE001 -- the test's assertion shows it
            errors.append(repr(exc))

    def kill_in_turn() -> None:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints/iteration_00000002").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        (first,) = training_launches(msrun_pids, 1)
        trees.append(kill_9(worker_pids(first)[-1], first))
        second = training_launches(msrun_pids, 2)[1]
        wait_for_steps(None, run_dir, logged_steps(run_dir) + 1)  # the retry trains
        trees.append(kill_9(second, second))
    killer = threading.Thread(target=kill_a_worker_then_msrun, daemon=True)
    killer.start()
    with dg.instance_for_test() as instance:
        result = dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, raise_on_error=False,
                                resources=resources(storage=storage, msrun=MsrunResource(worker_num=2, local_worker_num=2)),
                                run_config={"ops": {"training_run": {"config": {
                                    "config_path": MICRO_CONFIG, "run_name": "retried", "retry_delay_s": 0.5,
                                    # redundancy-free saves, read back balanced across both ranks (not async:
                                    # a checkpoint completed by an async save in the instant before a kill is on
                                    # disk but never sent to Dagster, so it gets no partition)
                                    "overrides": [f"training.steps={STEPS}", "checkpoint.save_interleaved_steps=2",
                                                  "checkpoint.remove_redundancy=true", "checkpoint.load_balanced=true",
                                                  "checkpoint.load_worker_number=2",
                                                  # the split's 4 validation documents hold one global batch
                                                  "kiln.training.eval_interval=4", "kiln.training.eval_iters=1"]}}}})
        partitions = instance.get_dynamic_partitions("checkpoints")
    killer.join(timeout=60)
    assert len(trees) == 2, f"the worker and msrun were not both killed: {errors}"
    assert_all_end(trees[0], "worker killed")
    assert_all_end(trees[1], "msrun killed")  # its workers died with it, the launcher reaped its log tails
    assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert [e.event_type_value for e in result.all_events].count("STEP_UP_FOR_RETRY") == 2
    (run,) = [m for m in result.asset_materializations_for_node("training_run") if m.asset_key.path == ["training_run"]]
    metadata = {k: v.value for k, v in run.metadata.items()}
    history = metadata["attempt_history"].splitlines()[2:]
    assert metadata["attempts"] == 3 and len(history) == 3, metadata["attempt_history"]
    assert history[0] == "| 1 | 0 | retried | msrun exited with code 1 |"  # a worker died: msrun failed the job
    resumed = [int(row.split("|")[2]) for row in history]
    assert resumed[1] in (2, 4) and resumed[1] <= resumed[2] == metadata["resumed_from_step"]
    assert history[1] == f"| 2 | {resumed[1]} | retried | msrun exited with code -9 |"
    assert history[2] == f"| 3 | {resumed[2]} | succeeded | - |"
    # every step any attempt logged has the uninterrupted loss, bit for bit, and every step was logged
    logged = [r for r in read_records(run_dir / "metrics.jsonl") if is_step_record(r)]
    assert {r["step"] for r in logged} == set(range(1, STEPS + 1))
    assert all(r["loss"] == uninterrupted[r["step"]] for r in logged)
    assert metadata["final_loss"] == uninterrupted[STEPS] and metadata["first_step"] == 1
    # the last attempt's validation: one process's of the uninterrupted run's final weights (fp32: 2 ranks' sums
    # against one process's micro-batches of one sample)
    uninterrupted_final = shard.parents[2] / f"run/checkpoints/iteration_{STEPS:08d}"
    assert metadata["validation_step"] == STEPS
    assert metadata["final_val_loss"] == pytest.approx(
        validate_as_one_process(load_config(run_dir / "config.yaml"), uninterrupted_final), rel=1e-6)
    assert sorted(partitions) == [f"retried/iteration_{s:08d}" for s in (2, 4, 6, 8)]
