"""Activation recompute, MindFormers' ``recompute`` section (config.RecomputeConfig): a recomputed part of the model
keeps only its inputs from the forward to the backward, and its backward runs its forward again to take the
gradients, trading about one more forward of that part for the memory of its activations.

What is recomputed (``recomputed_parts``): mode "full", whole decoder layers (MTP depth k counted as layer
num_hidden_layers + k); mode "select", the sub-modules ``select_module`` names in the layers it gives them, such as
``self_attention.core_attention`` (the attention scores, their softmax and the weighted sum of the values: Megatron's
selective recompute, the activations that grow with the square of the sequence).

How, eagerly (``_Recompute``): the part's forward runs without autograd, its inputs kept; its backward (a Cell
``bprop``) runs the part again under autograd and returns the vector-Jacobian product with the output's gradient,
for the inputs and for the part's parameters. It wraps the part's ``construct`` as found when applied, after the
parallel plans: under ZeRO-3 that is the unit's gather (fsdp._UnitGather), so the backward gathers the weights again
and their gradient reaches the chunks through the gather's backward. What the forward changes besides its output is
replayed alike, as the pipeline's recomputing backward does: the dropout stream is rewound to where the forward
drew its masks (the same masks), and the MoE token counts of the second run are dropped.

Compiled (``mindspore.jit``): not yet. A run that recomputes steps eagerly (``RECOMPUTE_IS_EAGER``, the reason the
trainer logs): the Cell above cannot run in a graph, whose custom backward may not read Parameters, and MindSpore's
own graph recompute (``Cell.recompute``, ``mindspore.recompute``) does not reach into the model's hand-written
backward Cells (RMSNorm, softmax), whose kept inputs are most of a layer's activations. With the decoder layers as
shared lazy_inline graphs, ``Cell.recompute()`` on them does re-run their products in the compiled backward (242
MatMul nodes instead of 202) but leaves the step's peak RSS where it was (``benchmarks/graph_recompute_probe.py``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from training.config import ConfigError, RecomputeConfig, layer_indices
from training.model.gpt import ReplayState

CORE_ATTENTION = "self_attention.core_attention"
RECOMPUTE_IS_EAGER = ("recompute runs eagerly: MindSpore 2.10's graph recompute leaves the model's hand-written backward "
                      "Cells' inputs kept (qwen3_bench, seq 1024, batch 4, full recompute: compiled peak RSS 3.01 -> "
                      "2.75 GB, eager 2.62 -> 1.28 GB)")


@dataclass(frozen=True)
class RecomputedPart:
    """A part of the model recomputed in backward: ``cell`` holds it, ``name`` says where (for the log)."""
    name: str
    cell: nn.Cell


def recomputed_parts(model, config: RecomputeConfig, path: str = "recompute") -> list[RecomputedPart]:
    """The parts of ``model`` that ``config`` recomputes; ConfigError (naming the field) for a layer the model does
    not have or a module no layer has."""
    if config.mode == "None":
        return []
    layers = [(f"decoder.layers.{i}", layer) for i, layer in enumerate(model.decoder.layers)]
    if model.mtp is not None:
        layers += [(f"mtp.layers.{k}.transformer_layer", depth.transformer_layer)
                   for k, depth in enumerate(model.mtp.layers)]
    if config.mode == "full":
        chosen = layer_indices(config.full_recompute_layer, f"{path}.full_recompute_layer", len(layers))
        return [RecomputedPart(name, layer) for i, (name, layer) in enumerate(layers) if i in chosen]
    parts = []
    for module, spec in config.select_module.items():
        chosen = layer_indices(spec, f"{path}.select_module.{module}", len(layers))
        for i, (name, layer) in enumerate(layers):
            if i in chosen:
                parts.append(RecomputedPart(f"{name}.{module}", _module(layer, module, f"{path}.select_module")))
    return parts


class CoreAttention(nn.Cell):
    """An attention's ``_causal_attention``, (q, k, v, mask) -> the heads' weighted values, as a Cell of its own so it
    can be recomputed. It holds no parameters: the attention's projections and norms stay outside."""

    def __init__(self, attention: nn.Cell):
        super().__init__(auto_prefix=False)
        # not a child Cell: the attention holds this core, which must not hold the attention in turn
        object.__setattr__(self, "attention", attention)

    def construct(self, q, k, v, mask):
        return type(self.attention)._causal_attention(self.attention, q, k, v, mask)


def core_attention(attention: nn.Cell) -> nn.Cell:
    """The attention's core as a Cell: context parallelism's (already one), else a ``CoreAttention`` set where the
    attention calls it (an instance attribute over its ``_causal_attention``)."""
    if attention.context_attention is not None:
        return attention.context_attention
    core = attention.__dict__.get("_causal_attention")
    if core is None:
        core = CoreAttention(attention)
        object.__setattr__(attention, "_causal_attention", core)
    return core


def _module(layer: nn.Cell, module: str, path: str) -> nn.Cell:
    if module == CORE_ATTENTION:
        return core_attention(layer.self_attention)
    cell = layer
    for attr in module.split("."):
        cell = cell._cells.get(attr) if isinstance(cell, nn.Cell) else None
        if cell is None:
            names = sorted(n for n, _ in layer.cells_and_names() if n)
            raise ConfigError(f"{path}.{module}: no such module in a decoder layer; expected {CORE_ATTENTION} or one "
                              f"of {', '.join(names)}")
    return cell


class _Recompute(nn.Cell):
    """The eager recompute of one part (see the module's docstring). MindSpore calls it in place of the part's
    ``construct`` when autograd records (``Cell._recompute_cell``, the hook ``Cell.recompute`` sets); a forward
    without autograd (validation, a pipeline stage's first run) is the part's own. Backwards meet the forwards
    newest first, so the kept inputs are a stack."""

    def __init__(self, part: nn.Cell, replay: ReplayState):
        super().__init__(auto_prefix=False)
        self.run = _Rerun(part)
        # the parameters the bprop's dict gives gradients for: MindSpore's PyNative executor reads them from this
        # attribute of a custom-bprop Cell (as its own recompute Cell sets it); without it they get none (measured:
        # zero gradients). A plain attribute: Cell.__setattr__ would check a list of Parameters as its own
        object.__setattr__(self, "internal_params", list(self.run.weights))
        self.replay = replay
        self.kept: list[tuple] = []
        self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

    def construct(self, *args):
        self.kept.append((args, self.replay.capture()))
        with ms._no_grad():
            return self.run.forward(*args)

    def bprop(self, *args):
        inputs, before = self.kept.pop()
        after = self.replay.capture()
        self.replay.rewind(before)
        try:
            input_grads, weight_grads = self.grad(self.run, self.run.weights)(
                *[ops.stop_gradient(x) for x in inputs], args[-1])
        finally:
            self.replay.restore(after)
        return tuple(input_grads), OrderedDict(zip(self.run.weights, weight_grads))


class _Rerun(nn.Cell):
    """The part's forward as found when recompute was applied (after the parallel plans: a ZeRO-3 unit's gather
    included), as a Cell autograd can differentiate with respect to the part's parameters."""

    def __init__(self, part: nn.Cell):
        super().__init__(auto_prefix=False)
        self.forward = part.construct
        # a plain attribute: a Cell adopts a list of Parameters as its own, renaming them
        object.__setattr__(self, "weights", tuple(part.trainable_params()))

    def construct(self, *args):
        return self.forward(*args)


def apply_recompute(model, config: RecomputeConfig) -> list[str]:
    """Make the parts ``config`` names recompute in backward; returns their names."""
    parts = recomputed_parts(model, config)
    replay = ReplayState(model, [moe for _, moe in model.moe_layers()])
    for part in parts:
        # set past Cell.__setattr__, which would adopt the Cell as a child of the part (its cells and names)
        object.__setattr__(part.cell, "_recompute_cell", _Recompute(part.cell, replay))
    return [part.name for part in parts]
