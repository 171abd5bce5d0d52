"""Expert parallelism proven by equivalence: under msrun with 4 CPU workers, the micro DeepSeek-V3 trained with its
routed experts cut over ep ranks (all-to-all dispatch eagerly, all-gather dispatch in a compiled step) equals one
process reading the same global batches — losses and their parts, grad norms, tokens per expert, final weights — an
ep2 checkpoint resumes at ep4 and loads whole in one process, and a PP2 × EP2 checkpoint resumes in PP2 × ZeRO-3 and
in one process. The dispatcher's safe tokens, the block dispatch of one rank's experts and the refusals are checked
in this process."""
import json

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from conftest import PROJECT_ROOT, assert_resumes_as_one_process, run_under_msrun, write_random_documents
from ep_cases import CASES, STEPS, ep_config
from test_context_parallel import assert_weights_match
from training.checkpoint import load_checkpoint
from training.config import ConfigError, ParallelismConfig
from training.model import build_model
from training.parallel.expert_parallel import AllToAllDispatcher, check_expert_parallel
from training.parallel.mesh import World, world_group
from training.reporting import Reporter, read_records
from training.trainer import Trainer

# fp32 sums in another order than one process's (the all-to-all returns each expert's rows to their token, the
from training.step import configure_runtime

# fp32 sums in another order than one process's (the all-to-all returns each expert's rows to their token, the
# gradients are summed over ep, then expert_dp). Measured on these cases: losses, their parts and grad norms within
# 2e-7 relative, final weights within 2e-7 absolute after 2 AdamW steps; test_fsdp's bounds, kept. With context
# parallelism the online softmax rounds differently too, and a near-zero gradient meets Adam's lr/eps gain
# (measured: one embedding entry 1.95e-6 apart, every other weight within 7e-7): test_context_parallel's rule
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 2e-6
CONTEXT_PARALLEL_CASES = {"cp2_ep2_hsdp"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    shard = write_random_documents(root / "data/random")
    run_dir = root / "single"
    config = ep_config(str(shard), [])
    configure_runtime(config)
    reference = Trainer(config, World(0, 1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True))
    reference.train()
    expected = {p.name: p.asnumpy() for p in reference.model.get_parameters()}
    run_under_msrun([PROJECT_ROOT / "tests/ep_cases.py", root / "cases", shard], root / "msrun_log", 4)
    return root, read_records(run_dir / "metrics.jsonl"), expected


@pytest.mark.msrun
@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_trains_as_one_process(runs, case):
    root, single, expected = runs
    sharded = read_records(root / "cases" / case / "metrics.jsonl")
    single = single[-len(sharded):]  # a resumed case starts after the checkpoint's step
    assert [m["step"] for m in sharded] == [m["step"] for m in single] and sharded[-1]["step"] == STEPS
    for key in ("loss", "grad_norm", "lm_loss", "mtp_1_loss", "load_balancing_loss"):
        assert [m[key] for m in sharded] == pytest.approx([m[key] for m in single], rel=LOSS_RTOL), key
    # the router's counts (summed over every rank's tokens) are exact, and move the expert biases alike
    assert [m.get("tokens_per_expert") for m in sharded] == [m.get("tokens_per_expert") for m in single]
    checkpoint = root / "cases" / case / f"checkpoints/iteration_{STEPS:08d}"
    weights = load_checkpoint(checkpoint).model  # each rank wrote its experts' chunks; read back whole
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        if case in CONTEXT_PARALLEL_CASES:
            assert_weights_match(weights[name], value, name)
        else:
            np.testing.assert_allclose(weights[name], value, rtol=0, atol=WEIGHT_ATOL, err_msg=name)


@pytest.mark.msrun
def test_the_compiled_case_runs_its_token_dispatch_in_the_graph(runs):
    root, _, _ = runs
    mode = (root / "cases/ep2_zero1_compiled/step_mode.txt").read_text()
    assert mode.startswith("forward+backward compiled (mindspore.jit)"), mode
    assert "expert parallel: all-gather token dispatch in the graph" in mode, mode


@pytest.mark.msrun
def test_expert_and_dense_weights_are_written_as_each_shards(runs):
    root, _, _ = runs
    expert, dense = "decoder.layers.1.mlp.experts.weight1", "embedding.word_embeddings.weight"  # [4 experts, …]
    fragments = {}
    for case in ("ep2_zero3_dense_shard2", "cp2_ep2_hsdp", "ep4_from_ep2"):
        meta = json.loads((root / "cases" / case / f"checkpoints/iteration_{STEPS:08d}/metadata.json").read_text())
        fragments[case] = tuple(meta["state_dict_metadata"][n]["axis_fragmentations"][0] for n in (expert, dense))
    # ep 2 × ZeRO-3 over efsdp 2, dense weights over 2 of the 4 shard ranks; ep 2 over the cp pair, experts whole
    # per ep rank, dense weights over the fsdp group (dp_shard 1 × cp 2); ep 4 (efsdp 1), dense over all 4
    assert fragments == {"ep2_zero3_dense_shard2": (4, 2), "cp2_ep2_hsdp": (2, 2), "ep4_from_ep2": (4, 4)}


@pytest.mark.msrun
def test_an_expert_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    root, _, expected = runs
    checkpoint = root / "cases/ep2_zero3_dense_shard2/checkpoints" / f"iteration_{STEPS:08d}"
    config = ep_config(str(root / "data/random"), [f"checkpoint.load_path={checkpoint}"])
    resumed = Trainer(config, World(0, 1), tmp_path, Reporter(tmp_path / "metrics.jsonl", enabled=True))
    assert resumed.step == STEPS
    for param in resumed.model.get_parameters():
        np.testing.assert_allclose(param.asnumpy(), expected[param.name], rtol=0, atol=WEIGHT_ATOL, err_msg=param.name)
    moments = {n: a for n, a in resumed.optimizer.state_dict().items() if ".experts." in n}
    assert moments and all(a.shape[0] == 4 for n, a in moments.items() if n.startswith("adam_m.")), moments.keys()


@pytest.mark.msrun
def test_a_pipeline_and_expert_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    """The PP2 × EP2 run's step-1 checkpoint (each stage's ranks writing its tensors, experts cut over ep, ZeRO-1
    moments) trains on in one process as the uninterrupted single-process run did (pp2_zero3_from_ep2_pp2 resumes
    it under msrun into PP2 × ZeRO-3)."""
    root, single, expected = runs
    checkpoint = root / "cases/ep2_pp2_zero1_no_safe_tokens/checkpoints/iteration_00000001"
    config = ep_config(str(root / "data/random"), [f"checkpoint.load_path={checkpoint}"])
    assert_resumes_as_one_process(config, tmp_path, 1, single, expected, LOSS_RTOL, WEIGHT_ATOL)


def test_safe_tokens_change_neither_outputs_nor_gradients():
    """One zero row per expert in front of its rows: same outputs and expert gradients (the rows add zeros),
    including for an expert no token chose. On a group of one the all-to-alls are the identity, so this checks the
    dispatcher's reordering and the safe rows' removal. Equal to a few ulps, not bit for bit: a matmul with more rows
    may take another kernel that sums in another order (on an AMD EPYC, 2 ulps of the expert outputs)."""
    config = ep_config("no-data-read", [])
    configure_runtime(config)
    experts = build_model(config.model).moe_layers()[0][1].experts
    counts = np.array([3, 0, 2, 1])  # expert 1 receives nothing
    rows = Tensor(np.random.default_rng(0).normal(size=(int(counts.sum()), 64)).astype(np.float32))
    weights = experts.trainable_params()
    results = []
    for safe in (False, True):
        dispatcher = AllToAllDispatcher(experts, world_group(World(0, 1)), 4, safe_tokens=safe)
        out, grads = ms.value_and_grad(lambda x: (dispatcher(x, counts) ** 2).sum(), 0, weights)(rows)
        results.append([out.asnumpy(), *(g.asnumpy() for g in grads[1])])
    local = ms.value_and_grad(lambda x: (experts(x, counts) ** 2).sum(), 0, weights)(rows)
    for unsafe, safe, direct in zip(*results, [local[0].asnumpy(), *(g.asnumpy() for g in local[1][1])]):
        for other in (safe, direct):
            np.testing.assert_allclose(other, unsafe, rtol=1e-6, atol=1e-6 * np.abs(unsafe).max())


def test_the_block_dispatch_of_this_ranks_experts_leaves_other_rows_zero():
    """``GroupedExperts.dispatch`` as ``AllGatherDispatcher`` feeds it on ep 2's rank 1 (experts 2-3 of 4): a row
    chosen for expert 0 or 1 reads exactly zero, and gives nothing to any gradient; the rows of experts 2-3 equal
    the eager padded dispatch of just those rows through them, outputs and gradients, compiled and eager. fp32:
    the two paths batch the rows differently, so the matmuls may round differently (rtol 1e-5, atol 1e-6)."""
    config = ep_config("no-data-read", [])
    configure_runtime(config)
    whole = build_model(config.model).moe_layers()[0][1].experts
    local = build_model(config.model).moe_layers()[0][1].experts
    for name in ("weight1", "weight2"):  # what apply_expert_parallel keeps on ep rank 1 of 2
        local._params[name] = Parameter(Tensor(whole._params[name].asnumpy()[2:]), name=name)
    rng = np.random.default_rng(3)
    chosen = np.array([[0, 1], [2, 3], [3, 0], [1, 2], [3, 1], [0, 3], [1, 0]])  # a token with neither, with both
    tokens = Tensor(rng.normal(size=(len(chosen), 64)).astype(np.float32))
    weights_of_output = Tensor(rng.normal(size=(chosen.size, 64)).astype(np.float32))
    one_hot = np.eye(4, dtype=np.float32)[chosen.reshape(-1)][:, 2:]
    here = one_hot.sum(1) > 0
    expert_of_row = Tensor(one_hot.argmax(1).astype(np.int32))

    class BlockDispatch(nn.Cell):
        def __init__(self):
            super().__init__()
            self.experts = local

        def construct(self, x):
            out = self.experts.dispatch(x, expert_of_row, Tensor(one_hot), Tensor(one_hot.sum(0)), 2)
            return (out * weights_of_output).sum(), out

    rows = np.flatnonzero(here)[np.argsort(one_hot[here].argmax(1), kind="stable")]  # rows here, by expert

    def padded_dispatch(x):
        out = local(ops.gather(x, Tensor((rows // 2).astype(np.int32)), 0), one_hot.sum(0).astype(np.int64))
        return (out * ops.gather(weights_of_output, Tensor(rows.astype(np.int32)), 0)).sum(), out

    expected = ms.value_and_grad(padded_dispatch, 0, local.trainable_params(), has_aux=True)(tokens)
    eager, compiled = BlockDispatch(), BlockDispatch()
    compiled.construct = ms.jit(compiled.construct)
    for run in (eager, compiled):
        (total, out), (token_grad, weight_grads) = ms.value_and_grad(run, 0, local.trainable_params(),
                                                                     has_aux=True)(tokens)
        np.testing.assert_array_equal(out.asnumpy()[~here], 0)
        np.testing.assert_allclose(out.asnumpy()[rows], expected[0][1].asnumpy(), rtol=1e-5, atol=1e-6)
        for value, reference in [(total, expected[0][0]), (token_grad, expected[1][0]),
                                 *zip(weight_grads, expected[1][1])]:
            np.testing.assert_allclose(value.asnumpy(), reference.asnumpy(), rtol=1e-5, atol=1e-6)


def test_expert_parallel_refusals_name_the_fields():
    with pytest.raises(ConfigError, match=r"parallelism\.expert_parallel \(3\) must divide model\.n_routed_experts "
                                          r"\(4\)"):
        check_expert_parallel(ParallelismConfig(expert_parallel=3), 4)
    with pytest.raises(ConfigError, match=r"parallelism\.expert_parallel is 2 but the model has no routed experts"):
        check_expert_parallel(ParallelismConfig(expert_parallel=2), None)
    with pytest.raises(ConfigError, match=r"moe_token_dispatcher_type: alltoall_deredundancy is not implemented"):
        ParallelismConfig.from_dict({"moe_token_dispatcher_type": "alltoall_deredundancy"}, "parallelism")
