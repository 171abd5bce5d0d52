"""Pipeline parallelism proven by equivalence: under msrun with 4 CPU workers, the micro Qwen3 in PP2 with each
schedule (gpipe with ZeRO-3, 1f1b with ZeRO-1, the interleaved one with 4 layers in 2 virtual stages per rank and a tied
output layer under ZeRO-3), TP2 × PP2, PP2 × CP2 and PP4 trains as one process reading the same global batches,
and validation through the stages gives one process's validation loss; a PP checkpoint (each stage writing its
tensors) resumes in one process. DeepSeek-V3 (MoE, MTP) under PP is proven in tests/test_expert_parallel.py. The
schedules themselves are checked as arithmetic: order, dependencies, bubble."""
import json
import re

import numpy as np
import pytest

from conftest import (PROJECT_ROOT, assert_resumes_as_one_process, run_under_msrun, train_alone,
                      validate_as_one_process, write_random_documents)
from fsdp_cases import STEPS
from pipeline_cases import CASES, PP2 as PP2_LAYOUT, REFERENCES, VALIDATE_ONCE, reference_config
from test_context_parallel import assert_weights_match
from training.checkpoint import load_checkpoint
from training.config import ConfigError
from training.parallel.pipeline import (BACKWARD, FORWARD, Transfer, Work, analytic_bubble, pipeline_problems,
                                        schedule_programs, stage_layer_ranges, work_order)
from training.reporting import is_step_record, read_records

# fp32 sums in another order than one process's: over the data-parallel ranks, the micro-batches of each stage, and
# (the norm) the stages' squared norms summed in float32. Measured with these cases: losses within 4.2e-7 relative
# (TP2 x PP2, whose loss is vocabulary-parallel; the others within 6e-8), grad norms within 1.2e-7; with 8 samples
# per step (the cases' earlier batch), validation losses within 3.8e-7 and final weights within 1.9e-6 absolute
# after 3 AdamW steps (PP2 x CP2; TP2 x PP2 1.7e-6; the others 1.6e-7). PP2 x CP2's weights follow
# test_context_parallel's rule for near-zero gradients (its ring attention rounds alike)
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 2e-6
CONTEXT_PARALLEL_CASES = {"pp2_cp2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    shard = write_random_documents(root / "data/random")
    references = {name: train_alone(reference_config(str(shard), name), root / f"single-{name}") for name in REFERENCES}
    run_under_msrun([PROJECT_ROOT / "tests/pipeline_cases.py", root / "cases", shard], root / "msrun_log", workers=4)
    return root, references


@pytest.mark.msrun
@pytest.mark.parametrize("case", CASES)
def test_pipeline_layout_trains_as_one_process(runs, case):
    root, references = runs
    single, expected = references[CASES[case][0]]
    staged = [m for m in read_records(root / "cases" / case / "metrics.jsonl") if is_step_record(m)]
    if "fast_step.compile=true" in CASES[case][1]:
        assert (root / "cases" / case / "step_mode.txt").read_text().startswith("pipeline stages compiled")
    assert [m["step"] for m in staged] == [m["step"] for m in single] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in staged] == pytest.approx([m["loss"] for m in single], rel=LOSS_RTOL)
    assert [m["grad_norm"] for m in staged] == pytest.approx([m["grad_norm"] for m in single], rel=LOSS_RTOL)
    # the final checkpoint, each stage having written its own tensors, read back whole
    weights = load_checkpoint(root / "cases" / case / f"checkpoints/iteration_{STEPS:08d}").model
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        if case in CONTEXT_PARALLEL_CASES:
            assert_weights_match(weights[name], value, name)
        else:
            np.testing.assert_allclose(weights[name], value, rtol=0, atol=WEIGHT_ATOL, err_msg=name)


@pytest.mark.msrun
@pytest.mark.parametrize("case", [case for case, (_, overrides) in CASES.items() if VALIDATE_ONCE[0] in overrides])
def test_validation_through_the_stages_is_one_process_validation(runs, case):
    """Validation after the last step, each batch forward through the stages: its loss (from the last stage,
    reported by rank 0) is one process's validation loss of the same weights (the run's final checkpoint)."""
    root, _ = runs
    logged = [m for m in read_records(root / "cases" / case / "metrics.jsonl") if not is_step_record(m)]
    assert [m["step"] for m in logged] == [STEPS]
    config = reference_config(str(root / "data/random"), CASES[case][0], overrides=VALIDATE_ONCE)
    checkpoint = root / "cases" / case / f"checkpoints/iteration_{STEPS:08d}"
    assert logged[0]["val_loss"] == pytest.approx(validate_as_one_process(config, checkpoint), rel=LOSS_RTOL)


@pytest.mark.msrun
@pytest.mark.parametrize("case", [case for case, (_, options) in CASES.items() if "fast_step.compile=true" in options])
def test_compiled_stages_compile_every_graph_before_the_first_exchange(runs, case):
    """Every rank calls (so compiles) each of its stages' graphs before it exchanges anything: no rank waits at an
    exchange for a peer's compile, which on CPU would fail after MS_NODE_TIMEOUT."""
    root, _ = runs
    for rank in range(4):
        calls = json.loads((root / "cases" / case / f"calls_rank{rank}.json").read_text())
        graphs = {call for call in calls if call != "exchange"}
        assert "exchange" in calls and set(calls[:calls.index("exchange")]) == graphs, (rank, calls[:8])


@pytest.mark.msrun
def test_training_state_statistics_cover_every_stage(runs):
    """pp4_1f1b monitors device_norm, param_norm, local_loss and device_loss: rank 0 reports the norms of every
    stage's parameters (the tied embedding once), which make up the step's gradient norm and are the norms of one
    process's final weights; the last stage's parts of the 4 micro-batches' losses average to the step's loss."""
    root, references = runs
    _, expected = references["qwen3_4_layers_tied"]
    staged = [m for m in read_records(root / "cases/pp4_1f1b/metrics.jsonl") if is_step_record(m)]
    for record in staged:
        assert sorted(record["device_norm"]) == sorted(record["param_norm"]) == sorted(expected)
        assert np.sqrt(np.sum(np.square(list(record["device_norm"].values())))) == pytest.approx(
            record["grad_norm"], rel=1e-5)  # the norms are rounded to 6 decimals
        local = np.array(record["local_loss"])  # [rank, micro-batch]: only the last stage holds a part
        assert local.shape == (4, 4) and not local[:3].any()
        assert local[3].mean() == pytest.approx(record["loss"], rel=LOSS_RTOL)
        assert record["device_loss"] == record["loss"]
    for name, norm in staged[-1]["param_norm"].items():
        assert norm == pytest.approx(float(np.linalg.norm(expected[name])), abs=1e-5), name


@pytest.mark.msrun
def test_a_pipeline_checkpoint_resumes_in_one_process(runs, tmp_path):
    root, references = runs
    single, expected = references["qwen3"]
    checkpoint = root / "cases/pp2_1f1b_zero1/checkpoints/iteration_00000002"
    state = json.loads((checkpoint / "metadata.json").read_text())["state_dict_metadata"]
    # the first stage's tensor: written by the two ranks of pipeline rank 0 only; ZeRO-1 cuts its Adam moments
    assert state["embedding.word_embeddings.weight"]["properties"]["replica_id"] == 0
    assert state["adam_m.embedding.word_embeddings.weight"]["properties"]["replica_id"] == [0, 0, None, None]
    assert state["adam_m.output_layer.weight"]["properties"]["replica_id"] == [None, None, 0, 0]
    config = reference_config(str(root / "data/random"), "qwen3", overrides=[f"checkpoint.load_path={checkpoint}"])
    assert_resumes_as_one_process(config, tmp_path, 2, single, expected, LOSS_RTOL, WEIGHT_ATOL)


# ---- schedules and placement: arithmetic, no MindSpore run ------------------------------------------------------

@pytest.mark.parametrize("schedule, pp, micro, interleave", [
    ("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
    ("interleaved_1f1b", 4, 8, 2), ("gpipe", 4, 8, 2)])
def test_every_rank_does_each_forward_and_backward_once_after_its_inputs(schedule, pp, micro, interleave):
    programs, ticks = schedule_programs(schedule, pp, micro, interleave)
    last = pp * interleave - 1
    for rank, program in enumerate(programs):
        works = [step for step in program if isinstance(step, Work)]
        assert sorted((w.kind, w.local_stage, w.micro) for w in works) == sorted(
            (kind, local, m) for kind in (FORWARD, BACKWARD) for local in range(interleave) for m in range(micro))
        arrived = set()
        for step in program:  # an input from another rank is received before the work that reads it
            if isinstance(step, Transfer):
                assert rank in (step.src, step.dst)
                if step.dst == rank:
                    arrived.add((step.kind, step.stage, step.micro))
                continue
            stage = step.local_stage * pp + rank
            if step.kind == FORWARD and stage > 0:
                assert (FORWARD, stage, step.micro) in arrived
            if step.kind == BACKWARD and stage < last:
                assert (BACKWARD, stage, step.micro) in arrived
    # both ends list every transfer in the same order, so the blocking transfers pair up
    for a in range(pp):
        for b in range(pp):
            between = [[s for s in programs[r] if isinstance(s, Transfer) and {s.src, s.dst} == {a, b}] for r in (a, b)]
            assert between[0] == between[1]
    # with forward and backward of equal cost, idle ticks are the analytic bubble
    busy = sum(isinstance(step, Work) for program in programs for step in program)
    assert 1 - busy / (ticks * pp) == pytest.approx(analytic_bubble(pp, micro, interleave))


def test_1f1b_keeps_at_most_pp_minus_rank_micro_batches_in_flight_and_gpipe_all():
    for rank in range(4):
        for schedule, bound in (("1f1b", 4 - rank), ("gpipe", 8)):
            in_flight = peak = 0
            for work in work_order(schedule, 4, rank, 8, 1):
                in_flight += 1 if work.kind == FORWARD else -1
                peak = max(peak, in_flight)
            assert peak == bound


@pytest.mark.parametrize("field", ["monitor.train_state.local_norm", "kiln.train_state.max_attention_logit"])
def test_statistics_a_pipeline_does_not_measure_are_refused_by_name(field):
    config = reference_config("unused", "qwen3", overrides=[*PP2_LAYOUT, f"{field}=true"])
    (problem,) = pipeline_problems(config, num_layers=2, micro_batches=4)
    assert re.match(rf"^{re.escape(field)} with parallelism\.pipeline_parallel > 1 is not implemented: ", problem)


def test_stage_layers_auto_and_ranges():
    assert stage_layer_ranges("auto", 8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(["0-2,5-5", "3-4,6-7"], 8, 2, 2) == [range(0, 3), range(3, 5), range(5, 6),
                                                                   range(6, 8)]
    with pytest.raises(ConfigError, match="'auto' splits the 6 decoder layers equally over .* 4 virtual stages"):
        stage_layer_ranges(None, 6, 2, 2)
    with pytest.raises(ConfigError, match=r"layers_per_stage\[1\] = '3-7' has 1 range\(s\); .*interleave_num is 2"):
        stage_layer_ranges(["0-2,5-5", "3-7"], 8, 2, 2)
    with pytest.raises(ConfigError, match="virtual stage 1 .* starts at layer 4, expected 3"):
        stage_layer_ranges(["0-2", "4-7"], 8, 2, 1)
    with pytest.raises(ConfigError, match="cover layers 0-6; the model has 8"):
        stage_layer_ranges(["0-2", "3-6"], 8, 2, 1)
