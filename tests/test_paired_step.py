"""benchmarks.paired_step: two checkouts' training steps taking turns (used for the figures of docs/training.md's
table of the model's ops)."""
import math
import subprocess
import sys

import pytest

from benchmarks.paired_step import WARM_STEPS, compare
from conftest import PROJECT_ROOT

BENCH = "configs/qwen3_bench.yaml"
SMALL = ["model.num_hidden_layers=1", "model.seq_length=64", "train_dataset.dataloader.config.seq_length=64",
         "training.local_batch_size=1", "training.global_batch_size=1", "fast_step.compile=false"]


def test_one_checkout_on_both_sides_trains_the_same_steps_and_reports_each_side():
    result = compare(PROJECT_ROOT, PROJECT_ROOT, BENCH, SMALL, rounds=2, steps=1)
    base, new = result["base"], result["new"]
    # the same code and data on both sides: the same losses, bit for bit, over the warm-up and both turns
    assert len(base["losses"]) == WARM_STEPS + 2 and base["losses"] == new["losses"]
    for side in (base, new):
        assert side["wall_per_step"] > 0 and side["cpu_per_step"] > 0 and side["peak_mib"] > 100
    assert math.isfinite(result["wall_ratio"]) and math.isfinite(result["cpu_ratio"])


def test_a_side_that_cannot_build_is_named_and_a_directory_not_a_checkout_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"^base: its process ended \(exit status 1\)"):
        compare(PROJECT_ROOT, PROJECT_ROOT, BENCH, [*SMALL, "training.no_such_key=1"], rounds=1, steps=1)
    finished = subprocess.run([sys.executable, "-m", "benchmarks.paired_step", str(tmp_path)], cwd=PROJECT_ROOT,
                              capture_output=True, text=True)
    assert finished.returncode == 2 and f"{tmp_path} is not a Kiln checkout" in finished.stderr
