"""The parallelize step of the trainer's recipe (mesh → model → parallelize → optimizer → checkpoints): the
model's layers are cut for tensor parallelism first, its attention split along the sequence for context
parallelism, then its state is sharded over the data-parallel (and context-parallel) ranks."""
from __future__ import annotations

from mindspore import nn

from training.config import TrainConfig
from training.parallel.context_parallel import apply_context_parallel
from training.parallel.expert_parallel import apply_expert_parallel
from training.parallel.fsdp import Parallelism
from training.parallel.mesh import DeviceMesh
from training.parallel.pipeline import build_pipeline
from training.parallel.tensor_parallel import apply_tensor_parallel


def sharding_units(model: nn.Cell, pipelined: bool = False) -> list[nn.Cell]:
    """What FSDP gathers as one: each decoder and MTP layer, and the model itself for the rest (embedding, final
    norm, output layer), as MindFormers wraps them; outermost first. A pipeline stage calls the embedding, the
    final norm and the output layer itself, not the model: under pipeline parallelism they are the units."""
    root = [model]
    if pipelined:
        root = [model.embedding, model.decoder.final_layernorm] + (
            [model.output_layer] if model.output_layer is not None else [])
    units = [*root, *model.decoder.layers]
    if model.mtp is not None:
        units += list(model.mtp.layers)
    return units


def parallelize(model: nn.Cell, mesh: DeviceMesh, config: TrainConfig, accumulation: int) -> Parallelism:
    """Apply every parallelism of ``mesh`` to ``model`` in place, in the recipe's order; what was applied."""
    p = config.parallelism
    tensor_parallel = apply_tensor_parallel(model, mesh, p.sequence_parallel) if mesh.dims.tp > 1 else None
    expert_parallel = apply_expert_parallel(model, mesh, p) if mesh.dims.ep > 1 else None
    # each layer's routed experts gather as a unit of their own under expert parallelism, as MindFormers wraps them
    units = sharding_units(model, mesh.dims.pp > 1) + list(expert_parallel.expert_cells if expert_parallel else ())
    context_parallel = apply_context_parallel(model, mesh, config) if mesh.dims.cp > 1 else None
    pipeline = build_pipeline(model, mesh, config, accumulation, tensor_parallel) if mesh.dims.pp > 1 else None
    parallelism = Parallelism(model, mesh, p.data_parallel_shard_strategy,
                              divide_before_reduction=p.disable_gradient_division, accumulation=accumulation,
                              unit_cells=units, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                              # MindFormers' "default" reshards unless pipeline parallel
                              reshard_after_forward=p.reshard_after_forward_policy == "always" or (
                                  p.reshard_after_forward_policy == "default" and mesh.dims.pp == 1),
                              context_parallel=context_parallel, pipeline=pipeline)
    if pipeline:
        pipeline.finish(parallelism.loss_scale())
    return parallelism
