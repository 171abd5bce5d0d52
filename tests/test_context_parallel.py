"""Context parallelism (ring / Ulysses / hybrid): the sequence split, the online-softmax merge against plain
attention and float64 finite differences, the model's attention with the context-parallel core (eager and
compiled), the config's refusals; and, under msrun with 4 CPU workers (one launch, tests/cp_cases.py), every
method, eager and compiled, and the ring with tensor parallelism, trains as one process does (losses, grad norms,
final weights), its sharded checkpoint resuming in one process."""
import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import (MICRO_CONFIG, assert_adam_weights_close, run_under_msrun, validate_as_one_process,
                      write_random_documents)
from cp_cases import CASES, DEEPSEEK_CASES, VALIDATE_ONCE
from fsdp_cases import DEEPSEEK, STEPS, case_config
from test_fsdp import single_process
from training.checkpoint import load_checkpoint
from training.config import ConfigError
from training.model import build_model, model_config
from training.model.gpt import roll_each_left
from training.model.layers import causal_mask
from training.parallel.context_parallel import (ContextAttention, ContextParallelPlan, MoveLeftAcrossSegments,
                                                RingAttention, block_mask, check_context_parallel, token_positions)
from training.parallel.mesh import DeviceMesh, ParallelDims, World
from training.reporting import Reporter, is_step_record, read_records
from training.trainer import Trainer

# fp32; the online softmax and the cp ranks' sums add in another order than one process. Losses and grad norms
# within 1e-6 relative (measured: 3e-7); final weights as conftest.assert_adam_weights_close says (measured: 1 of
# 32768 embedding entries 2.7e-6 apart)
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 2e-6


def assert_weights_match(actual: np.ndarray, expected: np.ndarray, name: str) -> None:
    assert_adam_weights_close(actual, expected, WEIGHT_ATOL, name)


# ---------------------------------------------------------------------------------------------------------
# under msrun (first: its fixture sets MindSpore's device, which must happen before any kernel runs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    shard = write_random_documents(root / "data/random")
    references = {config: single_process(root, shard, config) for config in (MICRO_CONFIG, DEEPSEEK)}
    run_under_msrun(["tests/cp_cases.py", root / "cases", shard], root / "msrun_log", workers=4)
    return root, references


@pytest.mark.msrun
@pytest.mark.parametrize("case", [*CASES, *DEEPSEEK_CASES])
def test_context_parallel_trains_as_one_process(runs, case):
    root, references = runs
    single, expected = references[DEEPSEEK if case in DEEPSEEK_CASES else MICRO_CONFIG]
    split = [m for m in read_records(root / "cases" / case / "metrics.jsonl") if is_step_record(m)]
    assert [m["step"] for m in split] == [m["step"] for m in single] == list(range(1, STEPS + 1))
    parts = [key for key in ("lm_loss", "mtp_1_loss", "load_balancing_loss") if key in single[0]]  # DeepSeek-V3
    for key in ("loss", "grad_norm", *parts):
        assert [m[key] for m in split] == pytest.approx([m[key] for m in single], rel=LOSS_RTOL), key
    weights = load_checkpoint(root / "cases" / case / f"checkpoints/iteration_{STEPS:08d}").model
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert_weights_match(weights[name], value, name)


@pytest.mark.msrun
@pytest.mark.parametrize("case", [*CASES, *DEEPSEEK_CASES])
def test_each_case_runs_the_step_its_name_says(runs, case):
    """The compiled cases compiled forward and backward, the context-parallel collectives in the graph; the others
    (ZeRO-3, or the micro config's own fast_step.compile false) ran eagerly."""
    mode = (runs[0] / "cases" / case / "step_mode.txt").read_text()
    if case.endswith("compiled"):
        assert mode.startswith("forward+backward compiled"), mode
        assert ("decoder layers recomputed in the backward" in mode) == ("recompute.mode=full" in CASES[case]), mode
        assert "context parallel: attention's ring steps and Ulysses exchanges in the graph" in mode
    else:
        assert mode.startswith("forward+backward eager"), mode


@pytest.mark.msrun
def test_validation_in_a_context_parallel_run_is_one_process_validation(runs):
    """ring_cp2_dp2 validates after its last step: each rank's held-out loss sums over its chunks add up to one
    process's validation of the same weights (the run's final checkpoint)."""
    root, _ = runs
    logged = [m for m in read_records(root / "cases/ring_cp2_dp2/metrics.jsonl") if not is_step_record(m)]
    assert [m["step"] for m in logged] == [STEPS]
    config = case_config(str(root / "data/random"), VALIDATE_ONCE)
    checkpoint = root / "cases/ring_cp2_dp2" / f"checkpoints/iteration_{STEPS:08d}"
    assert logged[0]["val_loss"] == pytest.approx(validate_as_one_process(config, checkpoint), rel=LOSS_RTOL)


@pytest.mark.msrun
def test_a_context_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    root, references = runs
    single, expected = references[MICRO_CONFIG]
    checkpoint = root / "cases/ring_cp2_dp2/checkpoints/iteration_00000002"
    state = json.loads((checkpoint / "metadata.json").read_text())["state_dict_metadata"]
    assert state["embedding.word_embeddings.weight"]["axis_fragmentations"] == [4, 1]  # dp_shard × cp chunks
    config = case_config(str(root / "data/random"), [f"checkpoint.load_path={checkpoint}"])
    resumed = Trainer(config, World(0, 1), tmp_path, Reporter(tmp_path / "metrics.jsonl", enabled=True))
    assert resumed.step == 2
    resumed.train()
    assert read_records(tmp_path / "metrics.jsonl")[0]["loss"] == pytest.approx(single[-1]["loss"], rel=LOSS_RTOL)
    for param in resumed.model.get_parameters():
        assert_weights_match(param.asnumpy(), expected[param.name], param.name)


# ---------------------------------------------------------------------------------------------------------
# in one process


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("load_balance", [False, True])
def test_the_ranks_positions_cover_the_sequence_once(cp, load_balance):
    parts = [token_positions(32, cp, r, load_balance) for r in range(cp)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(32))
    # causal (query, key) pairs per rank: the zig-zag split evens them out, contiguous chunks do not
    work = [int(sum(p + 1)) for p in parts]
    assert (len(set(work)) == 1) == load_balance


def test_a_sequence_that_does_not_split_names_the_fields():
    with pytest.raises(ConfigError, match=r"context_parallel × 2 \(context_parallel_load_balance\) = 4 .* "
                                          r"train_dataset.dataloader.config.seq_length to a multiple of 4"):
        token_positions(30, 2, 0, True)


def _dense_attention(q, k, v, query_positions, repeats):
    """softmax(q·kᵀ + causal mask)·v in numpy float64, q stacked [batch, groups, repeats·queries, dim], and each
    row's log-sum-exp of its scores."""
    future = np.tile(np.arange(k.shape[2])[None, :] > query_positions[:, None], (repeats, 1))
    scores = np.where(future, -np.inf, np.einsum("bgqd,bgkd->bgqk", q, k))
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - top)
    sums = weights.sum(-1, keepdims=True)
    return np.einsum("bgqk,bgkd->bgqd", weights / sums, v), top + np.log(sums)


class SimulatedRing:
    """What the ring brings one rank, from one process: the blocks of the other members in ring order (step j:
    member rank - j's) in the forward and again in the backward, where the gradients it passes on are recorded
    per block and the other members are taken to add nothing."""

    def __init__(self, blocks: list[np.ndarray]):
        self.blocks, self.width = blocks, blocks[0].shape[-1]
        self.step, self.passed_on = 0, []

    def __call__(self, x):
        if x.shape[-1] == self.width:  # the forward's K/V, or the backward's last gradient, going home
            if self.step == len(self.blocks) - 1 and len(self.passed_on) == self.step:
                self.passed_on.append(x.asnumpy())
                return x
            self.step += 1
            return Tensor(self.blocks[self.step])
        self.passed_on.append(x.asnumpy()[..., self.width:])  # the backward: (block, its gradient so far)
        self.step = len(self.passed_on)
        return Tensor(np.concatenate([self.blocks[self.step], np.zeros_like(self.blocks[self.step])], -1))


def test_ring_attention_is_attention_and_its_backward_matches_finite_differences():
    """Rank 1 of a zig-zag ring of 3 over 12 tokens in float64: its own K/V block, then member 0's (partly in
    its future), then member 2's; GQA-stacked queries (2 heads per group). The outputs are attention over the
    whole sequence and its log-sum-exp; the gradients of q and of every block, of an objective reading both,
    match central differences of plain attention."""
    rng = np.random.default_rng(0)
    cp, seq, repeats, dim, v_dim = 3, 12, 2, 4, 3
    positions = [token_positions(seq, cp, r, True) for r in range(cp)]
    order = [1, 0, 2]
    q = rng.normal(size=(1, 2, repeats * 4, dim))
    k, v = rng.normal(size=(1, 2, seq, dim)), rng.normal(size=(1, 2, seq, v_dim))
    blocks = [np.concatenate([k[:, :, positions[r]], v[:, :, positions[r]]], -1) for r in order]
    masks = [block_mask(positions[1], positions[r], repeats) for r in order]

    expected, expected_lse = _dense_attention(q, k, v, positions[1], repeats)
    out, lse = RingAttention(masks, ms.float64, SimulatedRing(blocks))(Tensor(q), Tensor(blocks[0]))
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.asnumpy(), expected_lse, rtol=0, atol=1e-12)

    probe, probe_lse = rng.normal(size=expected.shape), rng.normal(size=expected_lse.shape)

    def dense(q, k, v):  # Σ probe·out + Σ probe_lse·lse: the backward's dout and dlse terms both count
        out, lse = _dense_attention(q, k, v, positions[1], repeats)
        return (out * probe).sum() + (lse * probe_lse).sum()

    def objective(q, kv):
        out, lse = attention(q, kv)
        return (out * Tensor(probe)).sum() + (lse * Tensor(probe_lse)).sum()

    ring = SimulatedRing(blocks)
    attention = RingAttention(masks, ms.float64, ring)
    dq, _ = ms.grad(objective, grad_position=(0, 1))(Tensor(q), Tensor(blocks[0]))
    # the gradient of block order[j] leaves with the ring step after it: the last one is the one going home
    block_grads = ring.passed_on
    assert len(block_grads) == cp
    eps = 1e-6

    def central(array, where, inputs):
        """The central difference of Σ probe·attention at ``array[where]``; ``inputs(array)``: (q, k, v)."""
        shifted = array.copy()
        shifted[where] += eps
        up = dense(*inputs(shifted))
        shifted[where] -= 2 * eps
        return (up - dense(*inputs(shifted))) / (2 * eps)

    for flat in rng.choice(q.size, size=10, replace=False):
        where = np.unravel_index(flat, q.shape)
        assert dq.asnumpy()[where] == pytest.approx(central(q, where, lambda x: (x, k, v)), rel=1e-6, abs=1e-8)
    for j, member in enumerate(order):
        for flat in rng.choice(block_grads[j].size, size=6, replace=False):
            b, g, token, channel = np.unravel_index(flat, block_grads[j].shape)
            if channel < dim:
                array, where, inputs = k, (b, g, positions[member][token], channel), lambda x: (q, x, v)
            else:
                array, where, inputs = v, (b, g, positions[member][token], channel - dim), lambda x: (q, k, x)
            assert block_grads[j][b, g, token, channel] == pytest.approx(central(array, where, inputs), rel=1e-6,
                                                                         abs=1e-8)


def test_a_block_wholly_in_the_queries_future_is_skipped():
    assert block_mask(np.arange(0, 4), np.arange(4, 8), 1) is None
    assert block_mask(np.arange(4, 8), np.arange(0, 4), 2).shape == (8, 4)


@pytest.mark.parametrize("model_path", [MICRO_CONFIG, DEEPSEEK])
def test_attention_with_the_context_parallel_core_on_one_rank_is_the_attention(model_path, shard):
    """Qwen3's GQA and DeepSeek-V3's MLA layer: the core's layout changes and its online softmax (one block)
    give the plain attention's output and gradients (input and weights), eagerly and, for Qwen3, compiled
    (mindspore.jit: ~9 s of compiling at load 8 per model, so MLA's compiled core is left to a by-hand msrun run);
    per-sample rotary tables, as the core's inputs always carry position ids."""
    config = case_config(str(shard), [], model_config=model_path)
    model = build_model(config.model, seed=3)
    attention = model.decoder.layers[0].self_attention
    x = Tensor(np.random.default_rng(1).normal(size=(2, 32, model.config.hidden_size)).astype(np.float32))
    mask = causal_mask(32, model.mask_repeats)
    plan = ContextParallelPlan(DeviceMesh(ParallelDims(world=1), 0), "colossal", 1, load_balance=True, seq_length=32)
    core = ContextAttention(plan, attention.softmax_dtype, getattr(attention, "heads_per_group", 1))
    results = []
    variants = ((None, False), (core, False)) + (((core, True),) if model_path == MICRO_CONFIG else ())
    for context_attention, compiled in variants:
        attention.context_attention = context_attention
        positions = None if context_attention is None else Tensor(np.tile(np.arange(32, dtype=np.int32), (2, 1)))
        cos, sin = model.rotary.tables(32, positions)

        def squares(x, cos, sin):
            return (attention(x, cos, sin, mask) ** 2).sum()
        grad_fn = ms.value_and_grad(squares, 0, attention.trainable_params())
        out, grads = (ms.jit(grad_fn) if compiled else grad_fn)(x, cos, sin)
        results.append([out.asnumpy(), grads[0].asnumpy(), *(g.asnumpy() for g in grads[1])])
    for cored in results[1:]:
        for plain, value in zip(results[0], cored):
            np.testing.assert_allclose(value, plain, rtol=1e-5, atol=1e-6)


def test_a_sequence_length_other_than_the_masks_names_the_field():
    plan = ContextParallelPlan(DeviceMesh(ParallelDims(world=1), 0), "colossal", 1, load_balance=False, seq_length=32)
    q = Tensor(np.zeros((1, 2, 2, 16, 4), np.float32))
    kv = Tensor(np.zeros((1, 2, 16, 4), np.float32))
    with pytest.raises(ValueError, match=r"16 tokens on this rank, but its masks were built for 32 "
                                         r"\(train_dataset.dataloader.config.seq_length 32\)"):
        ContextAttention(plan, ms.float32, 2)(q, kv, kv)


def test_mtps_move_left_on_one_rank_is_the_models():
    plan = ContextParallelPlan(DeviceMesh(ParallelDims(world=1), 0), "colossal", 1, load_balance=True, seq_length=8)
    move = MoveLeftAcrossSegments(plan)
    ids = Tensor(np.arange(1, 17, dtype=np.int32).reshape(2, 8))
    mask = Tensor(np.tile(np.array([1, 1, 0, 1, 1, 1, 1, 0], np.float32), (2, 1)))
    for moved_by in (move, ms.jit(move.construct)):
        for moved, expected in zip(moved_by(ids, mask), roll_each_left(ids, mask)):
            assert moved.dtype == expected.dtype
            np.testing.assert_array_equal(moved.asnumpy(), expected.asnumpy())


def _config(shard, *overrides, model_path=MICRO_CONFIG):
    config = case_config(str(shard), list(overrides), model_config=model_path)
    return config, model_config(config.model)


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.context_parallel_method=ulysses", "parallelism.context_parallel=4"],
     r"model.num_attention_heads \(4\) and model.num_key_value_heads \(2\) .* not both divisible"),
    (["parallelism.context_parallel_method=hybrid", "parallelism.context_parallel=4",
      "parallelism.ulysses_degree_in_cp=4"], r"ulysses_degree_in_cp = 4: .* strictly between 1 and"),
    (["parallelism.context_parallel=2", "parallelism.ulysses_degree_in_cp=2"],
     r"ulysses_degree_in_cp = 2 is read only by context_parallel_method 'hybrid'"),
    (["parallelism.context_parallel=2", "parallelism.context_parallel_async=true"],
     r"context_parallel_async.*collectives on CPU block"),
])
def test_config_errors_name_the_fields(shard, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config, model = _config(shard, *overrides)
        check_context_parallel(config, model)


def test_what_context_parallelism_does_not_split_is_refused_with_its_field(shard):
    config, model = _config(shard, "parallelism.context_parallel=2", "kiln.train_state.max_attention_logit=true",
                            model_path=DEEPSEEK)
    with pytest.raises(ConfigError) as refused:
        check_context_parallel(config, model)
    assert [p.split(" ")[0] for p in refused.value.problems] == ["kiln.train_state.max_attention_logit"]
    config, model = _config(shard, "parallelism.context_parallel=2")
    plan = ContextParallelPlan(DeviceMesh(ParallelDims(world=1), 0), "colossal", 1, load_balance=False,
                               seq_length=8)
    ids = Tensor(np.zeros((1, 8), np.int32))
    with pytest.raises(ConfigError, match="reset_attention_mask and create_compressed_eod_mask to false"):
        plan.shard_inputs((ids, ids, ids, None, Tensor(np.zeros((1, 1, 8, 8), np.uint8))))
