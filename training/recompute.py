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

Compiled (``mindspore.jit``, ``RecomputedLayers``): full recompute of the first n decoder layers. A custom bprop
Cell cannot run in a graph (its backward may not read Parameters) and MindSpore's own graph recompute
(``Cell.recompute``) leaves the step's memory where it was (``benchmarks/graph_recompute_probe.py``), so the step
takes its gradients by hand, in one graph: each recomputed layer is a one-layer pipeline stage (``PipelineStage``;
the first also embeds) run forward without autodiff, keeping only its input; the rest of the model (the other layers,
the final norm, the loss) runs under ``value_and_grad``; then, last layer first, each stage runs again under
``value_and_grad`` of its output's dot product with the gradient received from the stage after it, which gives its
weights' gradients and the gradient to pass back. The re-run's input waits on that gradient (``ops.depend``):
without it the graph may run every re-run forward early and keep all of them (measured: more memory than no
recompute). Same ops on the same values: losses, gradients and weights are bit-identical to the plain compiled step.
What it does not cover steps eagerly, the reason logged (``compiled_recompute_problems``): selective recompute, layers
other than a first n (or MTP depths), MoE layers (their routing statistics, kept where the layer runs, would be
counted twice in one graph) and pipeline parallelism (whose compiled stages recompute already).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mindspore as ms
from mindspore import ParameterTuple, nn, ops

from training.config import ConfigError, RecomputeConfig, layer_indices
from training.model.gpt import ReplayState
from training.model.moe import MoELayer
from training.parallel.pipeline import _Objective, _Stage, _StageOutput

CORE_ATTENTION = "self_attention.core_attention"


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


def apply_recompute(model, config: RecomputeConfig, eager: bool) -> list[str]:
    """Make the parts ``config`` names recompute in an ``eager`` backward; returns their names. A compiled step
    recomputes them itself (``RecomputedLayers``), so they are left as they are."""
    parts = recomputed_parts(model, config)
    replay = ReplayState(model, [moe for _, moe in model.moe_layers()])
    for part in parts if eager else ():
        # set past Cell.__setattr__, which would adopt the Cell as a child of the part (its cells and names)
        object.__setattr__(part.cell, "_recompute_cell", _Recompute(part.cell, replay))
    return [part.name for part in parts]


def compiled_recompute_problems(model, config: RecomputeConfig, pp: int) -> list[str]:
    """Why ``config``'s recompute cannot run in the compiled step (``RecomputedLayers``); empty when it can."""
    if config.mode == "None":
        return []
    eager = "recompute runs eagerly"
    if config.mode != "full":
        return [f"recompute.mode = {config.mode!r}: {eager}; the compiled step recomputes whole layers (mode full) "
                f"only"]
    if pp > 1:
        return [f"recompute under pipeline parallelism: {eager} (the compiled pipeline stages recompute every stage "
                f"but the last already)"]
    decoder = len(model.decoder.layers)
    layers = sorted(layer_indices(config.full_recompute_layer, "recompute.full_recompute_layer",
                                  decoder + (len(model.mtp.layers) if model.mtp is not None else 0)))
    problems = []
    if layers != list(range(len(layers))) or len(layers) > decoder:
        problems.append(f"recompute.full_recompute_layer = {config.full_recompute_layer!r}: {eager}; the compiled "
                        f"step recomputes the first n decoder layers (not MTP depths) only")
    if any(isinstance(model.decoder.layers[i].mlp, MoELayer) for i in layers if i < decoder):
        problems.append(f"recompute of MoE layers: {eager} (a recomputed layer's routing statistics would be kept "
                        f"twice in one graph)")
    return problems


class RecomputedLayers(nn.Cell):
    """The compiled step's forward and backward with the first ``layers`` decoder layers recomputed (the module's
    docstring): called as ``mindspore.value_and_grad(ScaledLoss, None, params, has_aux=True)`` is, it returns the
    scaled loss, the loss and its parts, and the gradients of ``params`` (the step's, in their order). ``scale``
    is the loss's (``ScaledLoss.scale``)."""

    def __init__(self, model, params: list, scale: float, layers: int):
        super().__init__(auto_prefix=False)  # the model's parameter names stay its own
        stages = [_Stage(model, k, layers, range(k, k + 1)) for k in range(layers)]
        stages.append(_Stage(model, layers, layers, range(layers, model.pipeline_layers)))  # the rest, and the loss
        self.forwards = nn.CellList([_StageOutput(stage) for stage in stages[:-1]], auto_prefix=False)
        self.objectives = nn.CellList([_Objective(stage, scale) for stage in stages], auto_prefix=False)
        self.weights = [ParameterTuple(stage.params) for stage in stages]
        # each of params' gradient: the sum of its stages' (a tied embedding's: the first stage's and the last's),
        # the stages counted from the last, in the order the backward reaches them
        places = {}
        for k, stage in enumerate(stages):
            for i, param in enumerate(stage.params):
                places.setdefault(param.name, []).append((layers - k, i))
        self.sources = tuple(tuple(places[param.name]) for param in params)

    def construct(self, input_ids, labels, loss_mask, position_ids=None, attention_mask=None):
        batch = (input_ids, labels, loss_mask, position_ids, attention_mask)
        inputs = [None]  # each stage's input: all the forward keeps
        for forward in self.forwards:
            inputs.append(forward(inputs[-1], *batch))
        (objective, aux), (dx, grads) = ms.value_and_grad(self.objectives[-1], 0, self.weights[-1], has_aux=True)(
            inputs[-1], None, *batch)
        stage_grads = [grads]  # last stage first
        for k in range(len(self.forwards) - 1, 0, -1):
            _, (dx, grads) = ms.value_and_grad(self.objectives[k], 0, self.weights[k], has_aux=True)(
                ops.depend(inputs[k], dx), dx, *batch)
            stage_grads.append(grads)
        _, grads = ms.value_and_grad(self.objectives[0], None, self.weights[0], has_aux=True)(
            None, dx, ops.depend(input_ids, dx), labels, loss_mask, position_ids, attention_mask)
        stage_grads.append(grads)
        summed = []
        for sources in self.sources:
            grad = None
            for stage, index in sources:
                grad = stage_grads[stage][index] if grad is None else grad + stage_grads[stage][index]
            summed.append(grad)
        return (objective,) + aux, tuple(summed)


def compiled_recompute(model, config: RecomputeConfig, params: list, scale: float) -> RecomputedLayers | None:
    """The compiled step's recomputing forward and backward for ``config`` (``compiled_recompute_problems`` found
    none), or None when it recomputes nothing."""
    if config.mode == "None":
        return None
    layers = len(layer_indices(config.full_recompute_layer, "recompute.full_recompute_layer",
                               len(model.decoder.layers)))
    if not layers:
        return None
    for _, layer in model.transformer_layers():  # memory first: layouts as mint.permute where a module offers it
        for _, cell in layer.cells_and_names():
            if hasattr(cell, "permute_layouts"):
                cell.permute_layouts = True
    return RecomputedLayers(model, params, scale, layers)
