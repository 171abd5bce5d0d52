"""The model's forward on a batch of stacked samples (``stack_model_inputs``): the batch as the model's
positional inputs, and each sample's summed loss over its loss-masked tokens — what validation, a checkpoint's
evaluation and downstream scoring all compute (training/evaluation.py, training/downstream.py).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

MODEL_INPUTS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask")


class HeldOutLoss(nn.Cell):
    """``GPTModel.sample_loss_sums`` as a cell, so that it can be one compiled graph (``compiled``): eager, a
    held-out forward of the demo model costs ten times the compiled one (benchmarks/validation.py). It is
    compiled where the training step is (step.compile_blockers), and always called in evaluation mode."""

    def __init__(self, model, compiled: bool):
        super().__init__(auto_prefix=False)  # the model's parameter names stay its own
        self.model = model
        if compiled:
            self.construct = ms.jit(self.construct)

    def construct(self, *inputs):
        return self.model.sample_loss_sums(*inputs)


def model_input_tensors(batch: dict[str, np.ndarray]) -> tuple[Tensor | None, ...]:
    """A batch of ``stack_model_inputs`` as the model's positional inputs (None where the batch has none)."""
    return tuple(None if batch.get(key) is None else Tensor(batch[key]) for key in MODEL_INPUTS)


def forward_loss_sums(loss: HeldOutLoss, batch: dict[str, np.ndarray], shard_inputs=None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Per sample of ``batch`` (stack_model_inputs): its summed loss over loss-masked tokens and their count
    (under context parallelism, ``shard_inputs`` given: over this rank's tokens of the samples)."""
    inputs = model_input_tensors(batch)
    if shard_inputs is not None:
        inputs = shard_inputs(inputs)
    sums, tokens = loss(*inputs)
    return sums.asnumpy().astype(np.float64), tokens.asnumpy().astype(np.float64)


class TargetLosses(nn.Cell):
    """``GPTModel.target_losses`` as a cell (one compiled graph per input shape when ``compiled``, as HeldOutLoss):
    the losses of chosen tokens of a packed batch, downstream scoring's forward. Called in evaluation mode."""

    def __init__(self, model, compiled: bool):
        super().__init__(auto_prefix=False)
        self.model = model
        if compiled:
            self.construct = ms.jit(self.construct)

    def construct(self, input_ids, position_ids, attention_mask, target_index, target_labels):
        return self.model.target_losses(input_ids, position_ids, attention_mask, target_index, target_labels)
