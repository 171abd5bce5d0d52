"""Validation during training (kiln.training.eval_interval / eval_iters), in one process: which samples it reads,
what it computes, how it is reported, and that it changes nothing of the training it interrupts."""
import math

import numpy as np
import pytest
from mindspore import Tensor
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import MICRO_CONFIG, PROJECT_ROOT, write_random_documents
from test_trainer import make_trainer
from training.config import ConfigError, TensorboardConfig, load_config
from training.data.loader import build_dataset, stack_model_inputs
from training.evaluation import HeldOutSplit, Validation, perplexity, validation_line
from training.monitor import TensorBoardWriter
from training.reporting import Reporter, is_step_record, read_records
from training.train_state import micro_batch_indices

# a split with room for two global batches of validation samples in the conftest shard (200 documents); dropout
# on, so a validation that drew masks from the training's stream would change the losses after it
VALIDATED = ["train_dataset.dataloader.config.split='80,20,0'", "model.hidden_dropout=0.1", "training.steps=4",
             "checkpoint.save_interleaved_steps=2"]
EVALUATING = ["kiln.training.eval_interval=1", "kiln.training.eval_iters=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run without validation, and the same run resumed from its step-2 checkpoint validating after every step."""
    root = tmp_path_factory.mktemp("runs")
    shard = write_random_documents(root / "data/shards/random")
    plain = make_trainer(root, shard, "plain", *VALIDATED)
    plain.train()
    resumed = make_trainer(root, shard, "resumed", *VALIDATED, *EVALUATING,
                           f"checkpoint.load_path={root / 'plain/checkpoints/iteration_00000002'}")
    resumed.train()
    return root, plain, resumed


def validation_records(run_dir):
    return [r for r in read_records(run_dir / "metrics.jsonl") if not is_step_record(r)]


def read_step_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_records(run_dir / "metrics.jsonl") if is_step_record(r)}


def documents_read(dataset) -> set[tuple[int, int]]:
    """(source, document) of every document any sample of a blended dataset takes tokens from."""
    read = set()
    for source, part in enumerate(dataset.datasets):
        for sample in np.unique(dataset.sample_index[dataset.source_index == source]):
            begin, end = part.sample_index[part.shuffle_index[sample]][0], part.sample_index[
                part.shuffle_index[sample] + 1][0]
            read |= {(source, int(d)) for d in part.document_index[begin:end + 1]}
    return read


def test_validation_samples_come_from_documents_training_never_reads(shard):
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        f"train_dataset.dataloader.config.data_path=[0.7, '{shard}', 0.3, '{shard}']",
        "train_dataset.dataloader.config.eod=2", "train_dataset.dataloader.config.split='90,10,0'",
        "checkpoint.enable_save=false", "training.steps=40", "kiln.training.eval_interval=5", "kiln.training.eval_iters=2"])
    train = build_dataset(config, num_samples=config.split_samples("train"))
    valid = HeldOutSplit(config, "valid", batches=2).build(vocab_size=512).dataset
    trained_on, validated_on = documents_read(train), documents_read(valid)
    assert len(validated_on) > 1 and len(trained_on) > 100
    assert not trained_on & validated_on
    # the documents validation reads lie in the last 10% of each source, as the split cuts them
    assert min(d for _, d in validated_on) >= 180 and max(d for _, d in trained_on) < 180


def test_validation_loss_equals_a_separate_forward_and_is_reported_megatron_style(runs, capsys):
    root, _, trainer = runs
    records = validation_records(root / "resumed")
    assert [r["step"] for r in records] == [3, 4] and all(set(r) == {"step", "val_loss", "val_ppl"} for r in records)
    record = records[-1]
    assert record["val_ppl"] == pytest.approx(math.exp(record["val_loss"]), rel=1e-12)
    # the trained model of step 4 on the validation split's first 2 x 4 samples, with numpy's cross entropy
    valid = build_dataset(trainer.config, num_samples=8, split="valid")
    trainer.model.set_train(False)
    total = tokens = 0.0
    for first in (0, 4):
        batch = stack_model_inputs([valid[i] for i in range(first, first + 4)], use_positions=False)
        logits = trainer.model.logits(Tensor(batch["input_ids"])).asnumpy().astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_probs, batch["labels"][..., None].astype(np.int64), -1)[..., 0]
        total -= (picked * batch["loss_mask"]).sum()
        tokens += batch["loss_mask"].sum()
    assert record["val_loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_validation_leaves_training_unchanged_and_a_resumed_run_validates_bit_identically(runs):
    root, plain, resumed = runs
    # dropout is on: evaluating after step 3 neither draws masks nor touches the optimizer, so step 4 is the plain
    # run's
    plain_losses = read_step_losses(root / "plain")
    assert read_step_losses(root / "resumed") == {s: plain_losses[s] for s in (3, 4)}
    # the uninterrupted run's model at step 4, validated the same way: the same value to the last bit
    uninterrupted = Validation(resumed.config, plain.model, plain.collectives, accumulation=resumed.accumulation,
                               use_positions=False, vocab_size=512,
                               sample_indices=resumed.validation.sample_indices)
    assert validation_records(root / "resumed")[-1] == uninterrupted.evaluate(4)
    # compiled (as where the training step compiles): the same loss within fp32 rounding
    compiled = Validation(resumed.config, plain.model, plain.collectives, accumulation=resumed.accumulation,
                          use_positions=False, vocab_size=512, sample_indices=resumed.validation.sample_indices,
                          compiled=True)
    assert compiled.evaluate(4)["val_loss"] == pytest.approx(uninterrupted.evaluate(4)["val_loss"], rel=1e-6)


class LocalSums:
    """The collectives of one data-parallel rank of two, the other rank's sums given (or recorded, for it)."""

    def __init__(self, other=None):
        self.other, self.local = other, None

    def all_reduce_array(self, values):
        self.local = values
        return values if self.other is None else values + self.other


def test_two_data_parallel_ranks_together_validate_what_one_process_does(runs):
    _, plain, resumed = runs
    config = resumed.config  # global batch 4 = 2 ranks x local batch 2, one micro-batch each

    def rank(index, collectives):
        return Validation(config, plain.model, collectives, accumulation=1, use_positions=False, vocab_size=512,
                          sample_indices=lambda first, micro: micro_batch_indices(first, micro, index, 2, 2))
    second = LocalSums()
    rank(1, second).evaluate(4)
    together = rank(0, LocalSums(other=second.local)).evaluate(4)
    alone = Validation(config, plain.model, LocalSums(), accumulation=resumed.accumulation, use_positions=False,
                       vocab_size=512, sample_indices=resumed.validation.sample_indices).evaluate(4)
    assert together["val_loss"] == pytest.approx(alone["val_loss"], rel=1e-6)


def test_validation_runs_every_eval_interval_steps_and_after_the_last(shard):
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        f"train_dataset.dataloader.config.data_path=['{shard}']", "train_dataset.dataloader.config.eod=2",
        "checkpoint.enable_save=false", "training.steps=5", "kiln.training.eval_interval=2"])
    assert [step for step in range(1, 6) if Validation.due(config, step)] == [2, 4, 5]


@pytest.mark.parametrize("overrides, too_small", [
    (["kiln.training.eval_iters=3"], r"lower kiln.training.eval_iters or give the valid split more documents "
                                r"\(train_dataset.dataloader.config.split \('98,2,0'\)\)"),
    (["train_dataset.dataloader.config.split='100,0,0'"],
     r"split \('100,0,0'\) gives the valid split no sample of any source: train_dataset.dataloader.config."
     r"data_path\[1\] \S+/random: 200 document\(s\), split '100,0,0' gives the valid split none of them"),
])
def test_a_validation_split_too_small_for_eval_iters_is_a_config_error_naming_both(tmp_path, shard, overrides,
                                                                                   too_small):
    with pytest.raises(ConfigError, match=r"kiln.training.eval_iters = \d+ global batches of training.global_batch_size"
                                          r" 4 = \d+ valid samples.*" + too_small):
        make_trainer(tmp_path, shard, "small", "kiln.training.eval_interval=2", *overrides)
    assert not (tmp_path / "small/checkpoints").exists()


def test_validation_leaves_out_a_source_the_split_gives_no_document_and_the_run_log_says_why(tmp_path, shard,
                                                                                              capsys):
    # 98,2,0 of 10 documents rounds the validation split to none of them
    small = write_random_documents(tmp_path / "data/shards/small", seed=1, documents=10)
    trainer = make_trainer(tmp_path, shard, "blend", "kiln.training.eval_interval=2", "kiln.training.eval_iters=1",
                           f"train_dataset.dataloader.config.data_path=[0.7, '{shard}', 0.3, '{small}']")
    assert f"WARNING: validation loss leaves out train_dataset.dataloader.config.data_path[3] {small}: 10 " \
           f"document(s), split '98,2,0' gives the valid split none of them" in capsys.readouterr().out
    # the other source's 4 validation documents (of 200) give every sample, from its last 2%
    dataset = trainer.validation.dataset
    assert [part.indexed.prefix for part in dataset.datasets] == [shard]
    assert {d for _, d in documents_read(dataset)} <= set(range(196, 200))
    assert math.isfinite(trainer.validation.evaluate(0)["val_loss"])


def test_an_evaluation_goes_to_metrics_jsonl_the_log_and_tensorboard(tmp_path, capsys):
    events = tmp_path / "tensorboard"
    writer = TensorBoardWriter(TensorboardConfig(output_dir=str(events), log_interval=5), 8, "")
    reporter = Reporter(tmp_path / "metrics.jsonl", enabled=True, log_interval=5, sinks=[writer])
    record = {"step": 3, "val_loss": 2.5, "val_ppl": perplexity(2.5)}
    reporter.evaluation(record, validation_line(record))
    reporter.close()
    assert read_records(tmp_path / "metrics.jsonl") == [record]
    assert "| lm loss value: 2.500000E+00 | lm loss PPL: 1.218249E+01 |" in capsys.readouterr().out
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("lm-loss-validation")] == [(3, 2.5)]
    assert [(e.step, pytest.approx(e.value)) for e in reader.Scalars("lm-loss-validation-ppl")] == [
        (3, pytest.approx(math.exp(2.5)))]
    assert perplexity(50.0) == math.exp(20.0)  # Megatron's cap: an untrained model's perplexity stays finite
