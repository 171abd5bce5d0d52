import os
import sys
from pathlib import Path

import numpy as np
import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MICRO_CONFIG = "tests/configs/qwen3_micro.yaml"

# msrun starts workers with the `python` on PATH: make it this interpreter's
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
# synchronous dispatch, as training.run sets it before MindSpore loads (fast_step.host_blocking_dispatch), for the
# tests' own processes, the msrun workers and every subprocess: MindSpore's dispatch thread busy-waits on a core.
# Measured: test_trainer 175 s threaded, 62 s synchronous; test_pipeline's 4 workers on 2 cores 1604 s vs 82 s
os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")


def write_micro_sources(path: Path) -> Path:
    """Both built-in sources, small enough for a test-sized tokenizer and model."""
    path.write_text(
        "sources:\n"
        "  stdlib_code: {builtin: python_stdlib_code, max_bytes: 150000, weight: 0.6}\n"
        "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 80000, weight: 0.4}\n")
    return path


def run_under_msrun(args: list, log_dir: Path, workers: int, *, timeout: float = 900) -> None:
    """Run ``args`` (a script and its arguments, or ``-m module ...``) under msrun on ``workers`` local CPU workers
    from the project root (as the benchmarks do); a failed launch fails the test with the tail of every worker's
    log (LaunchFailed), one over ``timeout`` seconds with TimeoutError."""
    from training.launch import run_on_local_workers

    run_on_local_workers(args, log_dir, workers, timeout=timeout)


def train_alone(config, run_dir: Path) -> tuple[list[dict], dict]:
    """One process trains ``config`` into ``run_dir``: its step records and final weights, the reference a parallel
    layout's run must equal."""
    from training.parallel.mesh import World
    from training.reporting import Reporter, read_records
    from training.step import configure_runtime
    from training.trainer import Trainer

    configure_runtime(config)
    trainer = Trainer(config, World(0, 1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True))
    trainer.train()
    return read_records(run_dir / "metrics.jsonl"), {p.name: p.asnumpy() for p in trainer.model.get_parameters()}


def validate_as_one_process(config, checkpoint: Path) -> float:
    """The validation loss one process computes (``config``'s validation, micro-batches of one sample as the msrun
    cases read them) of the weights in ``checkpoint``: what a parallel run's validation at that step must equal."""
    from mindspore import Tensor

    from training.checkpoint import load_checkpoint
    from training.evaluation import Validation
    from training.model import build_model
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World
    from training.train_state import micro_batch_indices

    model = build_model(config.model)
    weights = load_checkpoint(checkpoint).model
    for param in model.get_parameters():
        param.set_data(Tensor(weights[param.name]))
    validation = Validation(config, model, Collectives(World(0, 1)), accumulation=config.training.global_batch_size,
                            use_positions=False, vocab_size=model.config.vocab_size,
                            sample_indices=lambda first, micro: micro_batch_indices(first, micro, 0, 1, 1))
    return validation.evaluate(config.training.steps)["val_loss"]


def assert_resumes_as_one_process(config, run_dir: Path, step: int, single: list[dict], expected: dict,
                                  loss_rtol: float, weight_atol: float) -> None:
    """One process resumes ``config`` (its checkpoint.load_path saved at ``step`` by a parallel run) and trains on
    as the uninterrupted single-process run did: the next step's loss (``single``: that run's records) and the
    final weights (``expected``)."""
    from training.parallel.mesh import World
    from training.reporting import Reporter, read_records
    from training.trainer import Trainer

    resumed = Trainer(config, World(0, 1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True))
    assert resumed.step == step
    resumed.train()
    assert read_records(run_dir / "metrics.jsonl")[0]["loss"] == pytest.approx(single[step]["loss"], rel=loss_rtol)
    for param in resumed.model.get_parameters():
        np.testing.assert_allclose(param.asnumpy(), expected[param.name], rtol=0, atol=weight_atol, err_msg=param.name)


def pytest_collection_modifyitems(items):
    """Each file is an xdist group (`make test` runs ``--dist loadgroup``), so it runs whole on one worker: the msrun
    files share one launch per file through module fixtures. A test that names its own group spreads (the benchmark
    smoke tests). The slow groups (a launch of msrun, a Dagster webserver, a browser, or a test marked slow) run
    first: on two workers a long group started last would leave a core idle at the end."""
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    slow = {_group(item) for item in items if any(item.get_closest_marker(m) for m in ("msrun", "ui", "browser", "slow"))}
    items.sort(key=lambda item: _group(item) not in slow)  # stable: each file's tests keep their order


def _group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


@pytest.fixture
def micro_sources(tmp_path) -> Path:
    return write_micro_sources(tmp_path / "sources.yaml")


def write_random_documents(prefix: Path, *, seed: int = 0, low: int = 4, high: int = 512,
                           documents: int = 200) -> Path:
    """A Megatron dataset of random documents (ids in [low, high), 5-59 of them), each ending in EOD (id 2)."""
    from training.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.integers(low, high, size=rng.integers(5, 60)), 2).astype(np.uint16))
    return prefix


@pytest.fixture
def shard(tmp_path) -> Path:
    """Random documents over the micro config's 512-token vocabulary."""
    return write_random_documents(tmp_path / "data/shards/random")
