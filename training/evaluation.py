"""Held-out loss: Megatron-style validation during training (``training.eval_interval``, ``eval_iters``).

The loss is the main LM head's cross entropy summed over the loss-masked tokens of every batch evaluated and
divided by their count once, after the sums of all data-parallel ranks are added (a mean of per-batch means
would weigh a batch with few loss tokens like a full one). Forward only: the model is in evaluation mode (no
dropout, so the training's mask stream does not move) and what a forward leaves for the next optimizer step
(MoE token counts, attention maxima) is dropped, so a run with validation trains exactly like one without.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from mindspore import Tensor

from training.config import SPLITS, BlendedMegatronLoaderConfig, ConfigError, TrainConfig
from training.data.loader import build_dataset, stack_model_inputs

MODEL_INPUTS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask")
# Megatron prints exp(min(20, loss)): an untrained model's perplexity stays a number
_MAX_PPL_EXPONENT = 20.0


def perplexity(loss: float) -> float:
    return math.exp(min(_MAX_PPL_EXPONENT, loss))


@contextmanager
def evaluating(model) -> Iterator[None]:
    """The model in evaluation mode for the block; the training state a forward touches is left as it was."""
    was_training = model.training
    model.set_train(False)
    try:
        yield
    finally:
        for _, moe in model.moe_layers():
            moe.take_counts()  # tokens routed by held-out batches must not move the expert biases
        model.pop_max_attention_logits()
        model.set_train(was_training)


def forward_loss_sums(model, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per sample of ``batch`` (stack_model_inputs): its summed loss over loss-masked tokens and their count."""
    inputs = [None if batch.get(key) is None else Tensor(batch[key]) for key in MODEL_INPUTS]
    sums, tokens = model.sample_loss_sums(*inputs)
    return sums.asnumpy().astype(np.float64), tokens.asnumpy().astype(np.float64)


@dataclass
class ValidationSplit:
    """Where the validation samples come from, for messages: the YAML fields that size that split."""
    config: TrainConfig

    @property
    def needed(self) -> int:
        training = self.config.training
        return training.eval_iters * training.global_batch_size

    def _asked(self) -> str:
        training = self.config.training
        return (f"training.eval_iters = {training.eval_iters} global batches of training.global_batch_size "
                f"{training.global_batch_size} = {self.needed} validation samples")

    def build(self, vocab_size: int | None):
        """The validation split's dataset, holding ``needed`` samples without repeating one; a split too small
        for that is a ConfigError naming ``eval_iters`` and the field that sizes the split."""
        loader = self.config.train_dataset.dataloader
        if not isinstance(loader, BlendedMegatronLoaderConfig):
            raise ConfigError(f"training.eval_interval = {self.config.training.eval_interval}: "
                              f"train_dataset.dataloader.type {loader.type} has no validation split; validation "
                              f"needs a BlendedMegatronDatasetDataLoader (or set training.eval_interval: 0)")
        field = self._split_field(loader)
        sized = self.config.split_samples("valid")
        if sized is not None and sized < self.needed:
            raise ConfigError(f"{self._asked()}, but train_dataset.dataloader.sizes[1] builds {sized}: lower "
                              f"training.eval_iters or raise sizes[1]")
        try:
            dataset = build_dataset(self.config, num_samples=sized or self.needed, split="valid",
                                    vocab_size=vocab_size)
        except ValueError as exc:  # the split gives a source no documents, or too few tokens for a sample
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{self._asked()}, but {field} gives the validation split none: {exc}") from None
        taken = np.bincount(dataset.source_index[:self.needed], minlength=len(dataset.datasets))
        for source, (count, part) in enumerate(zip(taken, dataset.datasets)):
            per_epoch = len(part) if part.num_epochs == 1 else \
                (part.tokens_per_epoch - part._extra_token) // part.seq_length
            if count > per_epoch:
                raise ConfigError(f"{self._asked()}, but {field} gives source {source} ({part.indexed.prefix}) "
                                  f"{per_epoch} validation sample(s) and {count} are needed: the same batches "
                                  f"would repeat samples; lower training.eval_iters or give the validation "
                                  f"split more documents ({field})")
        return dataset

    @staticmethod
    def _split_field(loader: BlendedMegatronLoaderConfig) -> str:
        data = loader.config
        if data.data_path is None and not data.mock:
            return f"train_dataset.dataloader.config.{data.SPLIT_PATHS[SPLITS.index('valid')]}"
        return f"train_dataset.dataloader.config.split ({data.split or '1,0,0'!r})"


class Validation:
    """The same ``eval_iters`` global batches of the validation split at every evaluation, each cut over the
    data-parallel ranks and micro-batches as a training step's batch is (``sample_indices``)."""

    def __init__(self, config: TrainConfig, model, collectives, sample_indices, accumulation: int,
                 use_positions: bool, vocab_size: int | None):
        self.config = config
        self.model = model
        self.collectives = collectives
        self.sample_indices = sample_indices  # (first sample of the batch, micro-batch) -> this rank's indices
        self.accumulation = accumulation
        self.use_positions = use_positions
        self.dataset = ValidationSplit(config).build(vocab_size)

    @staticmethod
    def due(training, step: int) -> bool:
        """Whether ``training`` (the config section) validates after ``step``."""
        return training.eval_interval > 0 and (step % training.eval_interval == 0 or step == training.steps)

    def evaluate(self, step: int) -> dict:
        """``{"step", "val_loss", "val_ppl"}`` over every rank's share of the batches."""
        gbs = self.config.training.global_batch_size
        loss_sum = tokens = 0.0
        with evaluating(self.model):
            for batch_index in range(self.config.training.eval_iters):
                for micro in range(self.accumulation):
                    items = [self.dataset[i] for i in self.sample_indices(batch_index * gbs, micro)]
                    sums, counts = forward_loss_sums(self.model, stack_model_inputs(items, self.use_positions))
                    loss_sum += sums.sum()
                    tokens += counts.sum()
        # every rank of a tensor-parallel group holds the same sums: numerator and denominator count them alike
        loss_sum, tokens = self.collectives.all_reduce_array(np.array([loss_sum, tokens]))
        loss = float(loss_sum / max(tokens, 1.0))
        return {"step": step, "val_loss": loss, "val_ppl": perplexity(loss)}


def validation_line(record: dict) -> str:
    """Megatron's report of an evaluation, framed by dashes as it prints it."""
    text = (f" validation loss at iteration {record['step']} | lm loss value: {record['val_loss']:.6E} | "
            f"lm loss PPL: {record['val_ppl']:.6E} | ")
    rule = "-" * (len(text) + 1)
    return f"[kiln] {rule}\n[kiln] {text}\n[kiln] {rule}"
