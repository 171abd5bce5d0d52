"""The model as the trainer sees it on this rank: its parts. Without pipeline parallelism one part, the whole model
(``WholeModel``); with it, this rank's pipeline stages (``PipelineStages``), which run the step by the pipeline's
schedule and hold only their own tensors. The trainer asks the parts and never which kind it has: what this rank
holds, saves and loads, how a step's gradients are computed, and what it reports.

The parts give and take their state as the other parts of a run's state do (``state_dict`` / ``load_state_dict``,
training/train_state.py): this rank's array of every model tensor it holds.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mindspore import Tensor

from training.checkpoint import CheckpointError, numpy_dtype
from training.monitor import EMBEDDING_PARAM, TrainStateMonitor
from training.optim import clip_grad_norm
from training.parallel.layout import TensorLayout


# a step's (loss, loss parts, clipped gradients, unclipped gradients, each gradient's norm, global norm) on this
# rank: the loss is this rank's share, the gradients reduced over the data-parallel ranks
StepGradients = tuple[float, dict, tuple, tuple, np.ndarray, float]


def add_loss_parts(model, components: dict[str, float], parts: tuple, accumulation: int) -> None:
    """Adds a micro-batch's loss parts (MTP depths, load balancing) to the step's means in ``components``."""
    for name, value in model.named_parts(parts).items():
        components[name] = components.get(name, 0.0) + value / accumulation


class WholeModel:
    """The whole model as this rank's one part (no pipeline parallelism): every tensor is held here (a chunk of
    those data, tensor or expert parallelism cut), and the micro-batches run one after another."""

    held_out_loss_sums = None  # validation runs the model's own forward

    def __init__(self, model, parallel):
        self.model, self.parallel = model, parallel
        self.params = parallel.model_params  # trainable, in the order the reduction and the optimizer follow
        self.embedding_index = next((i for i, p in enumerate(self.params) if p.name == EMBEDDING_PARAM), None)

    def holds(self, name: str) -> bool:
        """Whether this rank holds model tensor ``name``."""
        return True

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """This rank's array of every model tensor it holds (a chunk of those it holds cut)."""
        return {p.name: p.asnumpy() for p in self.model.get_parameters() if self.holds(p.name)}

    def load_state_dict(self, weights: dict[str, np.ndarray]) -> None:
        """Set every held tensor from ``weights``, in the tensor's own dtype; a missing, mis-shaped or unknown
        tensor is a CheckpointError naming it."""
        for param in self._held():
            if param.name not in weights:
                raise CheckpointError(f"tensor {param.name} is missing")
            array = weights[param.name]
            if array.shape != param.shape:
                raise CheckpointError(f"tensor {param.name} has shape {list(array.shape)}, "
                                      f"the model expects {list(param.shape)}")
            param.set_data(Tensor(array.astype(numpy_dtype(param.dtype), copy=False)))
        extra = sorted(set(weights) - {p.name for p in self.model.get_parameters()})
        if extra:
            raise CheckpointError(f"tensors not in the model: {', '.join(extra[:5])}")
        self.parallel.refresh_chunks()

    def conversions(self, weights: dict[str, np.ndarray], stored: dict[str, str]) -> dict[tuple[str, str], int]:
        """How many of ``weights`` loading converts, by (dtype in the files, the model's dtype): ``stored`` has each
        tensor's dtype in the files (e.g. MindFormers' bfloat16, which the reader widened)."""
        converted: dict[tuple[str, str], int] = {}
        for param in self._held():
            array = weights.get(param.name)
            if array is None:
                continue
            was = stored.get(param.name, str(array.dtype))
            if array.dtype != numpy_dtype(param.dtype) or was == "BFloat16":
                conversion = (was, str(param.dtype))
                converted[conversion] = converted.get(conversion, 0) + 1
        return converted

    def _held(self) -> list:
        return [p for p in self.model.get_parameters() if self.holds(p.name)]

    def load_layouts(self) -> dict[str, TensorLayout]:
        """How this rank holds each tensor it loads."""
        return self.parallel.layouts()

    def save_layouts(self, arrays: dict[str, dict[str, np.ndarray]], collectives
                     ) -> tuple[dict[str, TensorLayout], dict[str, tuple[str, np.dtype]] | None]:
        """Every saved tensor's layout over the ranks, and the tensors only other ranks hold (none here)."""
        return self.parallel.layouts(), None

    # ---- the step ------------------------------------------------------------------------------------
    def compile(self) -> str | None:
        """Compile what the parts run apart from the trainer's step functions; what was compiled, or None."""
        return None

    def gradients(self, grad_fn: Callable, batch: Callable[[int], tuple], accumulation: int,
                  monitor: TrainStateMonitor, max_norm: float) -> StepGradients:
        """The step's gradients, micro-batch by micro-batch through ``grad_fn`` (compiled or not); ``batch(m)``:
        micro-batch ``m``'s model inputs."""
        grads_sum, local_loss, components = None, 0.0, {}
        for micro in range(accumulation):
            outputs, grads = grad_fn(*batch(micro))
            loss, parts = outputs[1], outputs[2:]
            micro_loss = float(loss.asnumpy())
            local_loss += micro_loss / accumulation
            add_loss_parts(self.model, components, parts, accumulation)
            monitor.micro_batch(micro_loss, grads, self.parallel.loss_scale())
            grads_sum = grads if grads_sum is None else tuple(a + b for a, b in zip(grads_sum, grads))
        unclipped = self.parallel.reduce_gradients(grads_sum)  # what device_norm and the health check judge
        norms = self.parallel.tensor_norms(unclipped)
        grads, grad_norm = clip_grad_norm(unclipped, max_norm, norms)
        return local_loss, components, grads, unclipped, norms, grad_norm

    def embedding_norm(self, norms: np.ndarray) -> float:
        """The embedding gradient's norm (``norms``: each of ``params``' gradient norms)."""
        return float(norms[self.embedding_index])

    def gather_monitored(self, record: dict, config) -> dict:
        """``TrainStateMonitor.record``'s result as rank 0 reports it (``config``: the TrainConfig, whose
        monitor sections say which norms it holds)."""
        return record


class PipelineStages(WholeModel):
    """This rank's pipeline stages (one, or ``pipeline_parallel_interleave_num`` virtual stages): they hold their
    own layers' tensors and every buffer, run the micro-batches by the pipeline's schedule, and report over the
    pipeline ranks what rank 0 prints."""

    def __init__(self, model, parallel):
        super().__init__(model, parallel)
        self.pipeline = parallel.pipeline
        self.held_out_loss_sums = self.pipeline.held_out_loss_sums  # validation's forward through the stages

    def holds(self, name: str) -> bool:
        return self.pipeline.keeps(name)

    def load_layouts(self) -> dict[str, TensorLayout]:
        """Another stage's tensors get a layout that places none of them here, so they are not read."""
        return {**self.pipeline.absent_layouts(), **self.parallel.layouts()}

    def save_layouts(self, arrays, collectives):
        """Collective: rank 0 describes every stage's tensors, so each rank tells what it holds."""
        return self.pipeline.world_layouts(arrays, self.parallel.layouts(), collectives)

    def compile(self) -> str | None:
        self.pipeline.compile()
        return ("pipeline stages compiled (mindspore.jit: each stage's forward and its recomputing backward), "
                "schedule, transfers between stages, clip and update on the host (2-rank broadcasts: a graph cannot "
                "run them)")

    def gradients(self, grad_fn, batch, accumulation, monitor, max_norm) -> StepGradients:
        """The micro-batches through the stages by the pipeline's schedule (the stages' own backward functions,
        not ``grad_fn``)."""
        stepped = self.pipeline.gradients(self.parallel, [batch(m) for m in range(accumulation)], max_norm)
        for micro_loss in self.pipeline.last_result.micro_losses:  # this rank's part of each (local_loss)
            monitor.micro_batch(micro_loss, None)
        return stepped

    def embedding_norm(self, norms: np.ndarray) -> float:
        return self.pipeline.norm_of(EMBEDDING_PARAM, norms)

    def gather_monitored(self, record: dict, config) -> dict:
        """Collective: rank 0 reports every stage's parameter norms."""
        return self.pipeline.gather_monitored(record, config)


def model_parts(model, parallel) -> WholeModel:
    """This rank's parts of ``model`` once ``parallelize`` applied ``parallel``."""
    return WholeModel(model, parallel) if parallel.pipeline is None else PipelineStages(model, parallel)
