"""The trainer in one process (no msrun): a step, a save, a resume, and an audit of what it saved."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from conftest import MICRO_CONFIG, PROJECT_ROOT, shard_data
from training.parallel.mesh import World
from training.config import ConfigError, load_config
from training.lineage import audit_checkpoint, audit_exit_code
from training.checkpoint import KILN_STATE, MINDFORMERS_COMMON_KEYS, CheckpointError, load_checkpoint
from training.reporting import Reporter, read_records
from training.step import configure_runtime
from training.train_state import micro_batch_indices
from training.trainer import Trainer

WORLD = World(rank=0, size=1)


def make_trainer(tmp_path, shard, name, *overrides, lineage=None, **trainer_options):
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        *shard_data(shard), f"checkpoint.save_path={tmp_path / name / 'checkpoints'}", *overrides])
    configure_runtime(config)
    run_dir = tmp_path / name
    return Trainer(config, WORLD, run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True), lineage_inputs=lineage,
                   **trainer_options)


def losses(run_dir):
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_one_step_updates_every_parameter(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "one")
    before = {p.name: p.asnumpy().copy() for p in trainer.params}
    metrics = trainer.train_step()
    assert metrics["step"] == 1 and metrics["consumed_samples"] == 4
    # an untrained model predicts about uniformly over the 512-token vocabulary
    assert abs(metrics["loss"] - np.log(512)) < 0.5
    assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    unchanged = [p.name for p in trainer.params if np.array_equal(before[p.name], p.asnumpy())]
    assert unchanged == []


def test_resume_reproduces_the_uninterrupted_losses(tmp_path, shard):
    full = make_trainer(tmp_path, shard, "full")
    summary = full.train()
    assert summary.end_step == 6 and summary.last_checkpoint.endswith("iteration_00000006")
    assert summary.last_loss < summary.first_loss
    uninterrupted = losses(tmp_path / "full")

    resumed = make_trainer(tmp_path, shard, "resumed",
                           f"checkpoint.load_path={tmp_path / 'full/checkpoints/iteration_00000003'}")
    assert resumed.step == 3 and resumed.data_position.consumed_samples == 12
    assert resumed.train().start_step == 3
    after_resume = losses(tmp_path / "resumed")
    assert sorted(after_resume) == [4, 5, 6]
    assert all(after_resume[s] == uninterrupted[s] for s in after_resume), (after_resume, uninterrupted)


def metric(run_dir, name):
    return [m[name] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


# compiling costs CPU-seconds per graph and grows with the layers: one layer shows the same equivalences
ONE_LAYER = "model.num_hidden_layers=1"
# one micro-batch per step (local = global batch): the whole step (clip and AdamW included) is one graph
WHOLE_STEP = ("fast_step.compile=true", "training.local_batch_size=4", ONE_LAYER)


def assert_same_training(trainer, eager):
    """Weights and optimizer state as the eager step's: the graph sums each gradient's squares in another order
    (fp32), so the norm differs in its last bits and the weights by about that much through the clip factor."""
    for t, e in zip(trainer.params, eager.params):
        np.testing.assert_allclose(t.asnumpy(), e.asnumpy(), rtol=0, atol=1e-6, err_msg=t.name)
    state, eager_state = trainer.optimizer.state_dict(), eager.optimizer.state_dict()
    assert sorted(state) == sorted(eager_state) and state["global_step"] == eager_state["global_step"]
    for name in state:
        np.testing.assert_allclose(state[name], eager_state[name], rtol=0, atol=1e-7, err_msg=name)


def test_the_step_builder_compiles_as_much_as_the_run_allows_and_sums_only_under_accumulation(tmp_path, shard):
    """Building compiles nothing yet (a graph compiles at its first call): the choice and the buffers are checked."""
    whole = make_trainer(tmp_path, shard, "whole", *WHOLE_STEP)  # one micro-batch per step: nothing to sum
    assert whole.accumulation == 1 and whole.compiled_step is not None
    assert whole.compiled_step.loss_sum is None and len(whole.compiled_step.grad_sums) == 0
    accumulating = make_trainer(tmp_path, shard, "accumulating", "fast_step.compile=true", ONE_LAYER)
    assert accumulating.accumulation == 2 and accumulating.compiled_step.loss_sum is not None
    assert len(accumulating.compiled_step.grad_sums) == len(accumulating.params)
    split = make_trainer(tmp_path, shard, "split", *WHOLE_STEP, "monitor.train_state.device_norm=true")
    assert split.compiled_step is None and split.step_mode.startswith("forward+backward compiled"), split.step_mode
    eager = make_trainer(tmp_path, shard, "eager", ONE_LAYER)
    assert eager.compiled_step is None and "fast_step.compile is false" in eager.step_mode


def test_the_compiled_whole_step_equals_the_eager_step_and_resumes_bit_identically(tmp_path, shard):
    compiled = make_trainer(tmp_path, shard, "compiled", *WHOLE_STEP)
    assert compiled.step_mode.startswith("whole step compiled"), compiled.step_mode
    compiled.train()
    resumed = make_trainer(tmp_path, shard, "resumed", *WHOLE_STEP,
                           f"checkpoint.load_path={tmp_path / 'compiled/checkpoints/iteration_00000003'}")
    resumed.train()
    eager = make_trainer(tmp_path, shard, "eager", "training.local_batch_size=4", ONE_LAYER)
    assert eager.step_mode.startswith("forward+backward eager") and "fast_step.compile is false" in eager.step_mode
    eager.train()

    uninterrupted, after_resume = losses(tmp_path / "compiled"), losses(tmp_path / "resumed")
    assert sorted(after_resume) == [4, 5, 6] and all(after_resume[s] == uninterrupted[s] for s in after_resume)
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(compiled.params, resumed.params))
    np.testing.assert_allclose(metric(tmp_path / "compiled", "loss"), metric(tmp_path / "eager", "loss"), rtol=1e-5)
    np.testing.assert_allclose(metric(tmp_path / "compiled", "grad_norm"), metric(tmp_path / "eager", "grad_norm"),
                               rtol=1e-5)
    assert_same_training(compiled, eager)


def test_with_accumulation_the_compiled_whole_step_equals_the_eager_one_through_nan_skips_and_the_stop(tmp_path,
                                                                                                      shard):
    from training.optim import NonFiniteStepError

    def poisoned_trainer(name, *overrides):  # two micro-batches per step; a NaN in the first on steps 2, 4, 5
        trainer = make_trainer(tmp_path, shard, name, ONE_LAYER, "training.use_skip_step_on_nan=true",
                               "training.max_consecutive_skipped_steps=1", *overrides)
        micro_batch = trainer._micro_batch

        def poisoned(micro):  # a NaN loss mask makes the loss and every gradient NaN, as an overflow would
            input_ids, labels, loss_mask, *rest = micro_batch(micro)
            nan = micro == 0 and trainer.step + 1 in (2, 4, 5)
            return (input_ids, labels, loss_mask * float("nan") if nan else loss_mask, *rest)
        trainer._micro_batch = poisoned
        return trainer

    trainer, eager = poisoned_trainer("compiled", "fast_step.compile=true"), poisoned_trainer("eager")
    assert trainer.accumulation == 2 and trainer.step_mode.startswith("whole step compiled"), trainer.step_mode
    steps, eager_steps = [trainer.train_step()], [eager.train_step()]
    weights = {p.name: p.asnumpy().copy() for p in trainer.params}
    optimizer_state = trainer.optimizer.state_dict()
    skipped = trainer.train_step()  # the NaN reaches the update through the summed loss and gradients
    assert skipped["skipped"] and np.isnan(skipped["loss"]) and skipped["lr"] == trainer.lr_schedule(1)
    assert all(np.array_equal(weights[p.name], p.asnumpy()) for p in trainer.params)
    after = trainer.optimizer.state_dict()
    assert all(np.array_equal(optimizer_state[key], after[key]) for key in optimizer_state)  # global_step too

    applied = trainer.train_step()  # the NaN step left nothing in the gradient buffers
    assert not applied["skipped"] and trainer.optimizer.global_step == 2 and applied["lr"] == trainer.lr_schedule(2)
    steps += [skipped, applied, trainer.train_step()]
    eager_steps += [eager.train_step() for _ in range(3)]
    assert [m["skipped"] for m in steps] == [m["skipped"] for m in eager_steps] == [False, True, False, True]
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[name] for m in steps], [m[name] for m in eager_steps], rtol=1e-5)
    assert_same_training(trainer, eager)
    weights = {p.name: p.asnumpy().copy() for p in trainer.params}
    for each in (trainer, eager):
        with pytest.raises(NonFiniteStepError, match=r"step 5: .*2 steps in a row.*max_consecutive_skipped_steps = 1"):
            each.train_step()
    assert all(np.array_equal(weights[p.name], p.asnumpy()) for p in trainer.params)
    assert trainer.optimizer.global_step == 2


def test_gradients_read_on_the_host_keep_the_update_out_of_the_graph_with_the_eager_losses(tmp_path, shard):
    split = make_trainer(tmp_path, shard, "split", "fast_step.compile=true", "training.steps=2", ONE_LAYER,
                         "monitor.train_state.device_norm=true")
    assert split.step_mode.startswith("forward+backward compiled") and "device_norm" in split.step_mode
    split.train()
    eager = make_trainer(tmp_path, shard, "eager", "training.steps=2", ONE_LAYER)
    eager.train()
    np.testing.assert_allclose(metric(tmp_path / "split", "loss"), metric(tmp_path / "eager", "loss"), rtol=1e-5)


def test_a_step_that_cannot_compile_says_why():
    from training.model import build_model
    from training.parallel.mesh import ParallelDims
    from training.step import compile_blockers

    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        "train_dataset.dataloader.config.data_path=['x']", "train_dataset.dataloader.config.eod=2",
        "checkpoint.enable_save=false", "model.hidden_dropout=0.1", "kiln.train_state.max_attention_logit=true"])
    blockers = compile_blockers(config, ParallelDims(world=2, tp=2), build_model(config.model))
    assert [b.split(":")[0].split(" >")[0] for b in blockers] == [
        "fast_step.compile is false", "model.hidden_dropout", "kiln.train_state.max_attention_logit"], blockers


@pytest.mark.parametrize("config, dims", [
    ("tests/configs/deepseek_v3_micro.yaml", dict(world=4, tp=2, ep=2, dp_shard=2)),  # ZeRO-3 with MoE, TP and EP
    (MICRO_CONFIG, dict(world=4, dp_shard=2, cp=2)),  # ZeRO-3 over dp_shard x cp with context parallelism
    (MICRO_CONFIG, dict(world=4, pp=2, dp_shard=2)),  # ZeRO-3 inside pipeline stages
])
def test_every_parallel_layout_compiles(config, dims):
    from training.model import build_model
    from training.parallel.mesh import ParallelDims
    from training.step import compile_blockers

    config = load_config(PROJECT_ROOT / config, [
        "train_dataset.dataloader.config.data_path=['x']", "train_dataset.dataloader.config.eod=2",
        "checkpoint.enable_save=false", "fast_step.compile=true",
        "parallelism.data_parallel_shard_strategy=optim_grads_params"])
    assert compile_blockers(config, ParallelDims(**dims), build_model(config.model)) == []


def saved_steps(run_dir):
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("iteration_*"))


def test_a_resumed_run_saves_on_the_same_global_steps_as_an_uninterrupted_one(tmp_path, shard):
    make_trainer(tmp_path, shard, "full", "training.steps=5", "checkpoint.save_interleaved_steps=1").train()
    resumed = make_trainer(tmp_path, shard, "resumed", "training.steps=7", "checkpoint.save_interleaved_steps=2",
                           f"checkpoint.load_path={tmp_path / 'full/checkpoints/iteration_00000003'}")
    resumed.train()
    assert saved_steps(tmp_path / "resumed") == [4, 6, 7]  # step % 2, and the last; not 5 (3 + 2)


@pytest.mark.parametrize("start", ["weights_only", "older_checkpoint"])
def test_a_start_behind_the_save_paths_checkpoints_is_refused_before_anything_is_written(tmp_path, shard, start):
    full = make_trainer(tmp_path, shard, "run", "checkpoint.save_interleaved_steps=2")
    full.train()
    save_path = tmp_path / "run/checkpoints"
    before = {p: p.read_bytes() for p in save_path.rglob("*") if p.is_file()}
    load = ["checkpoint.no_load_optim=true", f"checkpoint.load_path={save_path}"] if start == "weights_only" else [
        f"checkpoint.load_path={save_path / 'iteration_00000002'}"]
    with pytest.raises(CheckpointError, match=r"holds checkpoints of steps after this run's start \(step "
                                              r"[02]\): (iteration_00000002, )?iteration_00000004, iteration_00000006"):
        make_trainer(tmp_path, shard, "run", *load)
    assert {p: p.read_bytes() for p in save_path.rglob("*") if p.is_file()} == before


def test_a_partial_metrics_line_from_a_killed_run_does_not_swallow_the_next_record(tmp_path, shard):
    metrics = tmp_path / "killed/metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "loss": 6.2}\n{"step": 2, "lo')  # killed while writing step 2
    make_trainer(tmp_path, shard, "killed", "training.steps=2").train()
    assert [m["step"] for m in read_records(metrics)] == [1, 1, 2]
    assert read_records(metrics, offset=len('{"step": 1, "loss": 6.2}\n'))[0]["step"] == 1


def test_common_json_holds_exactly_mindformers_fields_and_kiln_state_is_audited(tmp_path, shard, capsys):
    checkpoint = Path(make_trainer(tmp_path, shard, "mf", "training.steps=3").train().last_checkpoint)
    common = json.loads((checkpoint / "common.json").read_text())
    # MindFormers' CommonInfo takes every key as a constructor argument: one more and its resume raises
    assert sorted(common) == sorted(MINDFORMERS_COMMON_KEYS) and common["global_step"] == 3
    state = json.loads((checkpoint / KILN_STATE).read_text())
    assert {"rng", "data_position", "config_sha256", "loss", "world_size"} <= set(state)
    _, checks = audit_checkpoint(checkpoint)
    assert ("kiln_state.json", "ok") in [(c.path, c.status) for c in checks]

    # MindFormers' form of the same checkpoint, without Kiln's sidecar, resumes at its step from the seed
    mindformers = tmp_path / "mindformers/iteration_00000003"
    shutil.copytree(checkpoint, mindformers)
    (mindformers / KILN_STATE).unlink()
    capsys.readouterr()
    resumed = make_trainer(tmp_path, shard, "from_mf", f"checkpoint.load_path={mindformers}")
    assert resumed.step == 3 and resumed.data_position.consumed_samples == common["consumed_samples"]
    assert f"has no {KILN_STATE} (saved by MindFormers?): the random generators start from training.seed" in (
        capsys.readouterr().out)

    (checkpoint / KILN_STATE).write_text(json.dumps({**state, "loss": 0.0}))
    _, checks = audit_checkpoint(checkpoint)
    assert [(c.path, c.status) for c in checks if c.status != "ok"] == [("kiln_state.json", "MISMATCH")]


def write_safetensors(path, tensors):
    """A safetensors file as MindFormers writes it, bfloat16 included: {name: (dtype code, raw array)}."""
    header, offset = {}, 0
    for name, (code, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": list(raw.shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(r.tobytes() for _, r in tensors.values()))


def to_bfloat16_bits(array):
    """Round-to-nearest-even float32 -> bfloat16 bits, as a bf16 cast does."""
    bits = array.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def mindformers_single_card_save(kiln_checkpoint, target):
    """Kiln's checkpoint as MindFormers saves one card's bf16 training: no metadata.json, no kiln_state.json,
    bfloat16 weights (the embedding table in float32, MindFormers' embedding_params_dtype default) and their
    fp32 masters (main_param.*) beside the moments in the optimizer file."""
    loaded = load_checkpoint(kiln_checkpoint)
    target.mkdir(parents=True)
    model, masters = {}, {}
    for name, weight in loaded.model.items():
        if name == "embedding.word_embeddings.weight":
            model[name] = ("F32", weight)
        else:
            model[name] = ("BF16", to_bfloat16_bits(weight))
            masters[f"main_param.{name}"] = ("F32", weight)
    optim = {name: ("I64" if name == "global_step" else "F32", value) for name, value in loaded.optim.items()}
    write_safetensors(target / "checkpoint-model-0000000-0000001.safetensors", model)
    write_safetensors(target / "checkpoint-opt-0000000-0000001.safetensors", {**optim, **masters})
    (target / "common.json").write_text(json.dumps(loaded.common))
    return loaded


def test_a_mindformers_single_card_bfloat16_checkpoint_resumes_exactly_and_loads_weights_only(
        tmp_path, shard, capsys):
    make_trainer(tmp_path, shard, "full").train()
    uninterrupted = losses(tmp_path / "full")
    mindformers = tmp_path / "mindformers/iteration_00000003"
    kiln = mindformers_single_card_save(tmp_path / "full/checkpoints/iteration_00000003", mindformers)
    capsys.readouterr()
    # MindFormers writes no lineage.json: loaded unverified, on purpose
    resumed = make_trainer(tmp_path, shard, "resumed", f"checkpoint.load_path={mindformers}", load_unverified=True)
    out = capsys.readouterr().out
    assert "loaded UNVERIFIED" in out and "take their fp32 masters (main_param.*)" in out and "stored as BFloat16" not in out
    assert all(np.array_equal(p.asnumpy(), kiln.model[p.name]) for p in resumed.model.get_parameters())
    resumed.train()
    after = losses(tmp_path / "resumed")
    assert sorted(after) == [4, 5, 6] and all(after[s] == uninterrupted[s] for s in after)

    weights_only = make_trainer(tmp_path, shard, "weights", "checkpoint.no_load_optim=true",
                                f"checkpoint.load_path={mindformers}", load_unverified=True)
    assert "tensor(s) stored as BFloat16 loaded as the model's Float32" in capsys.readouterr().out
    embedding = "embedding.word_embeddings.weight"
    for param in weights_only.model.get_parameters():
        expected = kiln.model[param.name] if param.name == embedding else (
            to_bfloat16_bits(kiln.model[param.name]).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(param.asnumpy(), expected)


def test_a_train_size_reads_its_samples_again_from_the_start_once_they_are_used(tmp_path, shard):
    """`sizes[0]` (MindFormers' train sample count) sizes the dataset; past it the data repeats, as
    MindFormers' exhausted iterator restarts."""
    trainer = make_trainer(tmp_path, shard, "sized", "train_dataset.dataloader.sizes=[8, 0, 0]")
    assert len(trainer.dataset) >= 8 and trainer.config.split_samples("train") == 8
    first = [t.asnumpy() for t in trainer._micro_batch(0)[:3]]
    trainer.data_position.consumed_samples = len(trainer.dataset)
    again = [t.asnumpy() for t in trainer._micro_batch(0)[:3]]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    with pytest.raises(ConfigError, match=r"train_dataset.dataloader.sizes\[0\] is the train split's sample count"):
        make_trainer(tmp_path, shard, "unsized", "train_dataset.dataloader.sizes=[0, 8, 0]")


def test_audit_names_the_file_changed_since_training(tmp_path, shard):
    raw = tmp_path / "data/raw/random/part-00000.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text('{"text": "a document"}\n')
    from training.data.hashing import sha256_file
    lineage = {"data_root": str(tmp_path / "data"),
               "raw_files": [{"source": "random", "path": "raw/random/part-00000.jsonl", "sha256": sha256_file(raw)}]}
    trainer = make_trainer(tmp_path, shard, "audited", "training.steps=3", lineage=lineage)
    checkpoint = trainer.train().last_checkpoint
    _, checks = audit_checkpoint(checkpoint)
    assert audit_exit_code(checks) == 0

    raw.write_text('{"text": "a different document"}\n')
    _, checks = audit_checkpoint(checkpoint)
    assert audit_exit_code(checks) == 1
    assert [(c.link, c.path) for c in checks if c.status == "MISMATCH"] == [("raw file", "raw/random/part-00000.jsonl")]


@pytest.mark.parametrize("dp,local_batch_size,global_batch_size", [(1, 8, 8), (2, 2, 8), (4, 1, 8), (2, 4, 8)])
def test_data_parallel_ranks_read_disjoint_slices_in_single_process_order(dp, local_batch_size, global_batch_size):
    accumulation = global_batch_size // (local_batch_size * dp)
    for step in range(3):
        consumed = step * global_batch_size
        per_rank = {rank: [i for micro in range(accumulation)
                           for i in micro_batch_indices(consumed, micro, rank, dp, local_batch_size)]
                    for rank in range(dp)}
        in_read_order = [i for micro in range(accumulation) for rank in range(dp)
                         for i in micro_batch_indices(consumed, micro, rank, dp, local_batch_size)]
        assert in_read_order == list(range(consumed, consumed + global_batch_size))
        assert sum(len(v) for v in per_rank.values()) == len(set().union(*per_rank.values())) == global_batch_size


def test_document_boundaries_change_what_the_model_sees(tmp_path, shard):
    """reset_position_ids + block-causal masks (dense or compressed) + eod_mask_loss reach the model."""
    data = "train_dataset.dataloader.config"
    plain = make_trainer(tmp_path, shard, "plain").train_step()["loss"]
    dense = make_trainer(tmp_path, shard, "dense", f"{data}.reset_position_ids=true",
                         f"{data}.reset_attention_mask=true").train_step()["loss"]
    compressed = make_trainer(tmp_path, shard, "compressed", f"{data}.reset_position_ids=true",
                              f"{data}.reset_attention_mask=true", f"{data}.create_compressed_eod_mask=true",
                              f"{data}.eod_pad_length=32").train_step()["loss"]
    assert dense != plain
    assert compressed == pytest.approx(dense, rel=1e-6)  # the same mask, given two ways
    masked_eod = make_trainer(tmp_path, shard, "eod", f"{data}.eod_mask_loss=true").train_step()["loss"]
    assert masked_eod != plain


def test_trains_from_mindrecord_sources(tmp_path, shard):
    from training.data.mindrecord import convert_to_mindrecord

    convert_to_mindrecord(shard, tmp_path / "records/random.mindrecord", seq_length=32, eod_id=2)
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        "train_dataset.dataloader={type: MindDataset, dataset_files: "
        f"['{tmp_path / 'records/random.mindrecord'}'], shuffle: true}}", "kiln.mindrecord.pad=3",
        "checkpoint.enable_save=false"])
    trainer = Trainer(config, WORLD, tmp_path / "mr", Reporter(None, enabled=False))
    assert trainer.seq_length == 32
    first = trainer.train_step()
    assert abs(first["loss"] - np.log(512)) < 0.5


# ---- NaN/Inf steps ------------------------------------------------------------------------------------

def poison_steps(trainer, steps):
    """Make the loss and every gradient NaN on the given (1-based) steps, as an overflow would."""
    grad_fn = trainer.grad_fn

    def poisoned(*inputs):
        losses, grads = grad_fn(*inputs)  # (the loss its backward used, the loss) and the gradients
        if trainer.step + 1 in steps:
            return tuple(loss * float("nan") for loss in losses), tuple(g * float("nan") for g in grads)
        return losses, grads
    trainer.grad_fn = poisoned


def test_a_nan_step_is_skipped_without_touching_weights_or_optimizer(tmp_path, shard):
    trainer = make_trainer(tmp_path, shard, "skip", "training.use_skip_step_on_nan=true",
                           "training.max_consecutive_skipped_steps=1")
    poison_steps(trainer, {2})
    trainer.train_step()
    weights = {p.name: p.asnumpy().copy() for p in trainer.params}
    optimizer_state = trainer.optimizer.state_dict()

    skipped = trainer.train_step()
    assert skipped["skipped"] and np.isnan(skipped["loss"])
    assert (skipped["step"], skipped["consumed_samples"]) == (2, 8)  # the batch is consumed all the same
    assert all(np.array_equal(weights[p.name], p.asnumpy()) for p in trainer.params)
    after = trainer.optimizer.state_dict()
    assert all(np.array_equal(optimizer_state[key], after[key]) for key in optimizer_state)  # global_step too
    assert skipped["lr"] == trainer.lr_schedule(1)

    resumed = trainer.train_step()
    assert not resumed["skipped"] and np.isfinite(resumed["loss"]) and trainer.optimizer.global_step == 2
    assert resumed["lr"] == trainer.lr_schedule(2)
    assert all(not np.array_equal(weights[p.name], p.asnumpy()) for p in trainer.params)


def test_too_many_nan_steps_in_a_row_stop_training(tmp_path, shard):
    from training.optim import NonFiniteStepError

    trainer = make_trainer(tmp_path, shard, "skips", "training.use_skip_step_on_nan=true",
                           "training.max_consecutive_skipped_steps=2")
    poison_steps(trainer, {2, 3, 4})
    assert [trainer.train_step()["skipped"] for _ in range(3)] == [False, True, True]
    with pytest.raises(NonFiniteStepError, match=r"step 4: .*3 steps in a row.*max_consecutive_skipped_steps = 2"):
        trainer.train_step()
    assert trainer.optimizer.global_step == 1


def test_a_nan_loss_without_skipping_is_an_error_naming_the_step(tmp_path, shard):
    from training.optim import NonFiniteStepError

    trainer = make_trainer(tmp_path, shard, "nan")
    poison_steps(trainer, {1})
    before = {p.name: p.asnumpy().copy() for p in trainer.params}
    with pytest.raises(NonFiniteStepError, match=r"step 1: loss = nan"):
        trainer.train_step()
    assert all(np.array_equal(before[p.name], p.asnumpy()) for p in trainer.params)


# ---- reproducibility and gradient accumulation --------------------------------------------------------

def test_same_seed_gives_bitwise_identical_losses(tmp_path, shard):
    def run(name, seed):
        trainer = make_trainer(tmp_path, shard, name, "training.steps=3", f"training.seed={seed}",
                               "checkpoint.enable_save=false")
        return [trainer.train_step()["loss"] for _ in range(3)]

    first, again, other_seed = run("a", 7), run("b", 7), run("c", 8)
    assert first == again
    assert all(a != b for a, b in zip(first, other_seed))


def test_accumulated_micro_batches_give_the_big_batch_update(tmp_path, shard):
    """lbs 2 × 2 micro-batches and one lbs-4 batch read the same 4 samples: same loss, norm and update.
    optimizer.eps = 1 keeps the first AdamW update about lr·g (with the default eps it is lr·sign(g),
    which fp32 rounding can flip where a gradient is about 0)."""
    def one_step(name, local_batch_size):
        trainer = make_trainer(tmp_path, shard, name, f"training.local_batch_size={local_batch_size}",
                               "training.global_batch_size=4", "optimizer.eps=1.0", "checkpoint.enable_save=false")
        before = {p.name: p.asnumpy().copy() for p in trainer.params}
        metrics = trainer.train_step()
        return trainer.accumulation, metrics, {p.name: p.asnumpy() - before[p.name] for p in trainer.params}

    accumulation, accumulated, accumulated_update = one_step("accumulated", 2)
    single, big_batch, big_batch_update = one_step("big", 4)
    assert (accumulation, single) == (2, 1)
    assert accumulated["loss"] == pytest.approx(big_batch["loss"], rel=1e-6)
    assert accumulated["grad_norm"] == pytest.approx(big_batch["grad_norm"], rel=1e-5)
    for name, update in big_batch_update.items():
        assert np.abs(update).max() > 0
        np.testing.assert_allclose(accumulated_update[name], update, rtol=1e-3, atol=1e-8, err_msg=name)


def test_float16_params_resume_exactly_with_their_fp32_masters(tmp_path, shard):
    half = "model.params_dtype=float16"
    full = make_trainer(tmp_path, shard, "half", half, "training.steps=3", "checkpoint.save_interleaved_steps=1")
    full.train()
    assert {p.dtype for p in full.params} == {ms.float16}
    resumed = make_trainer(tmp_path, shard, "half_resumed", half, "training.steps=3",
                           f"checkpoint.load_path={tmp_path / 'half/checkpoints/iteration_00000002'}")
    resumed.train()
    assert losses(tmp_path / "half_resumed")[3] == losses(tmp_path / "half")[3]
    for a, b in zip(full.params, resumed.params):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_a_shard_with_ids_beyond_the_vocabulary_is_refused_naming_it_and_the_field(tmp_path):
    from conftest import write_random_documents
    from training.data.indexed import IndexedDatasetError

    # the micro model has 512 ids; this shard was tokenized with a 1024-piece vocabulary
    shard = write_random_documents(tmp_path / "big_vocab", low=4, high=1024)
    with pytest.raises(IndexedDatasetError) as raised:
        make_trainer(tmp_path, shard, "run")
    message = str(raised.value)
    assert message.startswith(f"train_dataset.dataloader.config.data_path: {shard}.bin: token ids up to 1023, "
                              f"but model.vocab_size is 512 (first outside [0, 512): ")
    assert message.endswith("or set model.vocab_size to at least 1024")
    assert not (tmp_path / "run/checkpoints").exists()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread priorities are read from Linux's /proc")
def test_on_cpu_the_kernel_pool_threads_yield_to_the_threads_doing_the_work(tmp_path, shard):
    """MindSpore's kernel pool spins between kernels (training.step.lower_kernel_pool_priority): after
    configure_runtime its threads run at a lower priority than this process's own threads, which keep theirs."""
    own_niceness = os.getpriority(os.PRIO_PROCESS, 0)
    make_trainer(tmp_path, shard, "run")
    niceness = {}
    for thread in Path("/proc/self/task").iterdir():
        try:  # a thread may end once listed
            name = (thread / "comm").read_text().strip()
            niceness.setdefault(name.rstrip("0123456789"), set()).add(os.getpriority(os.PRIO_PROCESS, int(thread.name)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    assert niceness["ActorThread_"] == niceness["KernelThread_"] == {max(10, own_niceness)}, niceness
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_niceness


def test_threaded_dispatch_trains_to_the_same_losses_as_synchronous_dispatch(tmp_path, shard):
    """The suite runs every process with synchronous dispatch (conftest); MindSpore's default threaded dispatch,
    which ``fast_step.host_blocking_dispatch: false`` keeps, is this one child process's."""
    overrides = [*shard_data(shard), *WHOLE_STEP, "training.steps=3"]
    threaded = tmp_path / "threaded"
    env = {k: v for k, v in os.environ.items() if k != "MS_DEV_HOST_BLOCKING_RUN"}
    done = subprocess.run(
        [sys.executable, "-m", "training.run", "--config", MICRO_CONFIG, "--output-dir", str(threaded),
         "--set", "fast_step.host_blocking_dispatch=false", "--set", f"checkpoint.save_path={threaded / 'ckpt'}",
         *[arg for override in overrides for arg in ("--set", override)]],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "whole step compiled" in done.stdout and "threaded dispatch" in done.stdout, done.stdout[-2000:]
    synchronous = make_trainer(tmp_path, shard, "synchronous", *WHOLE_STEP, "training.steps=3")
    assert "synchronous dispatch" in synchronous.step_mode
    synchronous.train()
    assert losses(threaded) == losses(tmp_path / "synchronous")


def test_the_logs_name_every_parallel_degree_and_blame_the_layout_it_has(tmp_path, shard, capsys):
    """The start line gives tp, pp, cp and ep beside dp; a compiled step kept from its graph under tensor
    parallelism says so with the layout, not "data parallel"."""
    from types import SimpleNamespace

    from training.parallel.mesh import ParallelDims
    from training.step import whole_step_blockers

    make_trainer(tmp_path, shard, "degrees", "training.steps=1").train()
    assert "on 1 worker(s), dp=1, tp=1, pp=1, cp=1, ep=1, accumulation=2" in capsys.readouterr().out
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, ["train_dataset.dataloader.config.data_path=[1.0, '/d']",
                                                        "train_dataset.dataloader.config.eod=2",
                                                        "checkpoint.save_path=/tmp/unused"])
    fp32 = SimpleNamespace(names=["w"], params=[SimpleNamespace(dtype=ms.float32)])
    reasons = whole_step_blockers(config, ParallelDims(world=2, tp=2), SimpleNamespace(local_norm=False,
                                                                                     device_norm=False), fp32)
    assert reasons and reasons[0].startswith("2 workers (dp=1, tp=2, pp=1, cp=1, ep=1): fast_step.compile_reduction")


def test_a_compiled_step_refuses_the_mindspore_compile_cache(monkeypatch, shard):
    """MindSpore's compile cache returns graphs by the order they compile in (training.step.refuse_compile_cache):
    a run that compiles refuses it and says how to go on; an eager one compiles nothing and is let through."""
    def config(compile_step: bool):
        return load_config(PROJECT_ROOT / MICRO_CONFIG, [
            *shard_data(shard), "checkpoint.enable_save=false", f"fast_step.compile={str(compile_step).lower()}"])

    monkeypatch.setenv("MS_COMPILER_CACHE_ENABLE", "1")
    with pytest.raises(ConfigError, match=r"^MS_COMPILER_CACHE_ENABLE=1 .*unset it, or set fast_step.compile: false$"):
        configure_runtime(config(True))
    configure_runtime(config(False))
    monkeypatch.setenv("MS_COMPILER_CACHE_ENABLE", "0")
    configure_runtime(config(True))
