"""The parallelize step of the trainer's recipe (mesh → model → parallelize → optimizer → checkpoints): the
model's layers are cut for tensor parallelism first, its attention split along the sequence for context
parallelism, then its state is sharded over the data-parallel (and context-parallel) ranks.

The code here is generic: the model says how each parallelism cuts it, as torchtitan's ``parallelize_<model>``
does (Kiln's GPTModel and its modules in training/model; tests/plain_gpt.py shows a model of its own):

- ``check_tensor_parallel(tp)``: what tensor parallelism cannot split, named (``require_divisible``, ``refuse``);
  Kiln's models answer from their config alone, each module class for the specs it builds, so a launch asks the
  config before msrun starts (``tensor_parallel_problems``) what the built model is asked again;
- ``parallelize_tensor(tp)``, ``parallelize_experts(ep)``, ``parallelize_context(cp)``: the model's cut, each
  module's its own, with the tools ``TensorParallel``, ``ExpertParallel`` and ``ContextParallelPlan`` hand it;
- ``sharding_units(pipelined)``: what FSDP gathers as one, outermost first; ``unit_entry_points(unit)``: the
  model's methods besides ``unit.construct`` reading a unit's weights; each cell holding a chunk, under ZeRO-3 in
  a compiled step: ``gathered_weights(attr, gathers)``, where it reads the gathered weight (``WeightGathers``);
- ``pipeline_layers`` and ``pipeline_stage(layers, first, last)``: how it splits into stages, each stage
  naming its cells, its forward, its loss parts and the state a replayed forward must not change twice;
- ``loss_part_names``: the parts of the loss every rank reports.
"""
from __future__ import annotations

from mindspore import nn

from training.config import TrainConfig
from training.parallel.context_parallel import apply_context_parallel
from training.parallel.expert_parallel import apply_expert_parallel
from training.parallel.fsdp import Parallelism
from training.parallel.mesh import DeviceMesh
from training.parallel.pipeline import build_pipeline
from training.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Cell, mesh: DeviceMesh, config: TrainConfig, accumulation: int) -> Parallelism:
    """Apply every parallelism of ``mesh`` to ``model`` in place, in the recipe's order; what was applied."""
    p = config.parallelism
    tensor_parallel = apply_tensor_parallel(model, mesh, p.sequence_parallel) if mesh.dims.tp_enabled else None
    expert_parallel = apply_expert_parallel(model, mesh, p) if mesh.dims.ep_enabled else None
    # the model's sharding units (outermost first); each layer's routed experts gather as a unit of their own under
    # expert parallelism, as MindFormers wraps them
    units = model.sharding_units(mesh.dims.pp_enabled) + list(expert_parallel.expert_cells if expert_parallel else ())
    context_parallel = apply_context_parallel(model, mesh, config) if mesh.dims.cp_enabled else None
    pipeline = build_pipeline(model, mesh, config, accumulation, tensor_parallel) if mesh.dims.pp_enabled else None
    parallelism = Parallelism(model, mesh, p.data_parallel_shard_strategy,
                              divide_before_reduction=p.disable_gradient_division, accumulation=accumulation,
                              unit_cells=units, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                              # MindFormers' "default" reshards unless pipeline parallel
                              reshard_after_forward=p.reshard_after_forward_policy == "always" or (
                                  p.reshard_after_forward_policy == "default" and not mesh.dims.pp_enabled),
                              context_parallel=context_parallel, pipeline=pipeline)
    if pipeline:
        pipeline.finish(parallelism.loss_scale())
    return parallelism
