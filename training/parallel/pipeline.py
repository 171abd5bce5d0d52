"""Pipeline parallelism (docs/parallelism.md): the model's layers split into stages over the
mesh's ``pp`` axis, micro-batches (the step's gradient-accumulation steps) flowing through them.

Placement. ``pp × interleave_num`` virtual stages; virtual stage ``v`` runs on pipeline rank ``v mod pp`` as
its local stage ``v // pp``. ``pipeline_parallel_layers_per_stage`` "auto" (or null) gives each virtual stage an equal
run of decoder layers; a list of ``pp`` strings gives each rank ``interleave_num`` inclusive ranges, e.g.
``["0-3,8-11", "4-7,12-15"]``. The first virtual stage also embeds the tokens; the last one runs the final
norm, the output layer, the loss and the MTP depths, with its own copy of the embedding when MTP or a tied
output layer needs it: both copies start equal (every rank builds the whole model from the seed, then keeps
its stage's parameters) and stay equal, their gradients summed over the two stages before the update.

Schedules (``pipeline_parallel_schedule``): ``gpipe`` (every forward, then every backward), ``1f1b`` (after
pp − rank − 1 warm-up forwards, one forward then one backward), ``interleaved_1f1b`` (Megatron's order over
the local stages; micro-batches a multiple of pp). ``schedule_programs`` turns a rank's order of work into a global
plan in ticks: in each tick every rank does the next piece of its order whose inputs have arrived, then the
tick's transfers run in one global order. Every rank follows that order, so the blocking point-to-point
transfers (``comm.send_recv``: a 2-rank broadcast, since send/recv do not work on CPU) never wait on each
other in a cycle.

Backward. MindSpore 2.10's PyNative autograd can only differentiate its most recent forward (measured:
``mindspore.vjp`` closures of three forwards called oldest first fail with "Can not find top cell for
backward"; only newest-first works), and 1F1B backpropagates the oldest micro-batch first. So a stage's
forward runs without autograd, its input kept, and the backward runs the stage again under
``mindspore.value_and_grad`` on ``loss · scale + Σ output · received gradient``: the vector-Jacobian product
with the received output gradient, and with the input gradient to send back (full activation recompute, as
MindFormers' ``recompute``). What a forward changes besides its output is replayed alike: the dropout stream
is rewound to where the forward drew its masks, and MoE token counts from the second run are dropped. The
last stage has nobody to send to, so its forward waits for its backward and runs once.

The loss of each micro-batch exists on the last stage, its load-balancing parts on the stages of their MoE
layers: every rank reports its part and the trainer sums them over the world (``Trainer.train_step``), so
rank 0 logs the step's loss. Validation (``kiln.training.eval_interval``) runs its batch forward only through the
stages in order (``Pipeline.held_out_loss_sums``); its loss sums, on the last stage, are summed over the world
as well.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.config import ConfigError, ParallelismConfig
from training.checkpoint import numpy_dtype
from training.optim import clip_grad_norm
from training.parallel import comm
from training.parallel.layout import TensorLayout
from training.parallel.mesh import DeviceMesh

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
OPTIMIZER_STATE_PREFIXES = ("adam_m", "adam_v", "main_param")  # optimizer tensors named "<prefix>.<parameter>"
FORWARD, BACKWARD = "F", "B"


# ---------------------------------------------------------------------------------------------------------
# Placement


def stage_layer_ranges(layers_per_stage, num_layers: int, pp: int, interleave: int) -> list[range]:
    """The decoder layers of each virtual stage (index ``local stage · pp + rank``), checked to cover
    ``0..num_layers-1`` once, in order."""
    field_name = "parallelism.pipeline_parallel_layers_per_stage"
    virtual = pp * interleave
    if layers_per_stage in (None, "auto"):
        if num_layers % virtual:
            raise ConfigError(f"{field_name}: 'auto' splits the {num_layers} decoder layers equally over "
                              f"pipeline_parallel {pp} × pipeline_parallel_interleave_num {interleave} = {virtual} "
                              f"virtual stages, which does not divide them; give the ranges per stage")
        per = num_layers // virtual
        return [range(v * per, (v + 1) * per) for v in range(virtual)]
    if not isinstance(layers_per_stage, list) or len(layers_per_stage) != pp:
        raise ConfigError(f"{field_name} must be 'auto' or a list of {pp} strings (one per pipeline rank), "
                          f"got {layers_per_stage!r}")
    ranges: dict[int, range] = {}
    for rank, spec in enumerate(layers_per_stage):
        parts = str(spec).split(",") if not isinstance(spec, list) else [f"{spec[0]}-{spec[-1]}"]
        if len(parts) != interleave:
            raise ConfigError(f"{field_name}[{rank}] = {spec!r} has {len(parts)} range(s); "
                              f"pipeline_parallel_interleave_num is {interleave}")
        for local, part in enumerate(parts):
            match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", part)
            if not match or int(match[1]) > int(match[2]):
                raise ConfigError(f"{field_name}[{rank}]: {part.strip()!r} is not an inclusive range 'first-last'")
            ranges[local * pp + rank] = range(int(match[1]), int(match[2]) + 1)
    ordered = [ranges[v] for v in range(virtual)]
    expected = 0
    for v, layers in enumerate(ordered):
        if layers.start != expected:
            raise ConfigError(f"{field_name}: virtual stage {v} (rank {v % pp}, local stage {v // pp}) starts at layer "
                              f"{layers.start}, expected {expected}: the stages must cover the layers in order")
        expected = layers.stop
    if expected != num_layers:
        raise ConfigError(f"{field_name}: the stages cover layers 0-{expected - 1}; the model has {num_layers}")
    return ordered


# ---------------------------------------------------------------------------------------------------------
# Schedules: pure arithmetic


@dataclass(frozen=True)
class Work:
    kind: str  # FORWARD or BACKWARD
    local_stage: int  # which of the rank's virtual stages (virtual stage local_stage · pp + rank)
    micro: int


@dataclass(frozen=True)
class Transfer:
    """A hidden state (forward) or its gradient (backward) of micro-batch ``micro`` going from ``src`` to
    ``dst`` pipeline rank, as the input of virtual stage ``stage`` (forward) or the output gradient of it."""
    kind: str
    stage: int
    micro: int
    src: int
    dst: int


def work_order(schedule: str, pp: int, rank: int, micro_batches: int, interleave: int) -> list[Work]:
    """The order in which pipeline rank ``rank`` does its forwards and backwards."""
    m = micro_batches
    if schedule == "gpipe":
        forwards = [Work(FORWARD, c, i) for c in range(interleave) for i in range(m)]
        return forwards + [Work(BACKWARD, c, i) for c in reversed(range(interleave)) for i in range(m)]
    if schedule == "1f1b":
        if interleave != 1:
            raise ConfigError("parallelism.pipeline_parallel_schedule 1f1b runs one stage per rank; with "
                              "pipeline_parallel_interleave_num > 1 use interleaved_1f1b")
        forwards = [Work(FORWARD, 0, i) for i in range(m)]
        backwards = [Work(BACKWARD, 0, i) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    elif schedule == "interleaved_1f1b":
        if m % pp:
            raise ConfigError(f"parallelism.pipeline_parallel_schedule interleaved_1f1b needs the micro-batches per "
                              f"step ({m}: global_batch_size / (local_batch_size × data parallel)) to be a "
                              f"multiple of pipeline_parallel ({pp})")
        total = m * interleave

        def local_stage_micro(k: int, backward: bool) -> tuple[int, int]:
            local = (k // pp) % interleave
            return (interleave - 1 - local if backward else local), (k // (pp * interleave)) * pp + k % pp
        forwards = [Work(FORWARD, *local_stage_micro(k, False)) for k in range(total)]
        backwards = [Work(BACKWARD, *local_stage_micro(k, True)) for k in range(total)]
        warmup = min((pp - rank - 1) * 2 + (interleave - 1) * pp, total)
    else:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule must be one of {', '.join(SCHEDULES)}, "
                          f"got {schedule!r}")
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup:]


def schedule_ticks(orders: list[list[Work]], pp: int, interleave: int) -> list[dict[int, Work]]:
    """Run the ranks' orders in lock step: in each tick every rank does its next work if its input arrived in
    an earlier tick (a forward needs the previous virtual stage's forward of that micro-batch, a backward
    the next stage's backward). Each tick: pipeline rank -> its work."""
    last = pp * interleave - 1
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, micro)
    position = [0] * pp
    ticks = []
    while any(position[r] < len(orders[r]) for r in range(pp)):
        tick = {}
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            work = orders[rank][position[rank]]
            stage = work.local_stage * pp + rank
            needs = ((FORWARD, stage - 1, work.micro) if work.kind == FORWARD and stage > 0 else
                     (BACKWARD, stage + 1, work.micro) if work.kind == BACKWARD and stage < last else
                     (FORWARD, stage, work.micro) if work.kind == BACKWARD else None)
            if needs is None or needs in done:
                tick[rank] = work
        if not tick:
            stuck = {r: orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])}
            raise RuntimeError(f"pipeline schedule cannot progress: the ranks wait on each other at {stuck}")
        for rank, work in tick.items():
            done.add((work.kind, work.local_stage * pp + rank, work.micro))
            position[rank] += 1
        ticks.append(tick)
    return ticks


def tick_transfers(tick: dict[int, Work], pp: int, interleave: int) -> list[Transfer]:
    """What the tick's work sends, in the global order every rank follows (by sender)."""
    last = pp * interleave - 1
    out = []
    for rank in sorted(tick):
        work = tick[rank]
        stage = work.local_stage * pp + rank
        if work.kind == FORWARD and stage < last:
            out.append(Transfer(FORWARD, stage + 1, work.micro, rank, (stage + 1) % pp))
        elif work.kind == BACKWARD and stage > 0:
            out.append(Transfer(BACKWARD, stage - 1, work.micro, rank, (stage - 1) % pp))
    return out


def schedule_programs(schedule: str, pp: int, micro_batches: int, interleave: int
                      ) -> tuple[list[list[Work | Transfer]], int]:
    """Each pipeline rank's program (its work and the transfers it takes part in, in execution order) and the
    number of ticks the plan takes."""
    orders = [work_order(schedule, pp, r, micro_batches, interleave) for r in range(pp)]
    ticks = schedule_ticks(orders, pp, interleave)
    programs: list[list[Work | Transfer]] = [[] for _ in range(pp)]
    for tick in ticks:
        for rank, work in tick.items():
            programs[rank].append(work)
        for transfer in tick_transfers(tick, pp, interleave):
            programs[transfer.src].append(transfer)
            programs[transfer.dst].append(transfer)
    return programs, len(ticks)


def analytic_bubble(pp: int, micro_batches: int, interleave: int = 1) -> float:
    """The idle fraction of a pipeline with equal forward and backward work per stage: (p − 1) / (v·m + p − 1)
    (v = interleave; v = 1 is GPipe's and 1F1B's (p − 1) / (m + p − 1))."""
    return (pp - 1) / (interleave * micro_batches + pp - 1)


# ---------------------------------------------------------------------------------------------------------
# One rank's stages


class _Stage:
    """One virtual stage on this rank: its index among all of them and the model's stage (``model.pipeline_stage``:
    its cells, forward and loss parts), with the parameters it trains."""

    def __init__(self, model, stage: int, last_stage: int, layers: range):
        self.stage = stage
        self.first, self.last = stage == 0, stage == last_stage
        self.model_stage = model.pipeline_stage(layers, self.first, self.last)
        seen, self.params = set(), []
        for cell in self.model_stage.cells:
            for param in cell.trainable_params():
                if param.name not in seen:
                    seen.add(param.name)
                    self.params.append(param)


class _StageOutput(nn.Cell):
    """A stage's forward before its backward: only the hidden states it sends on (a Cell, so it can compile)."""

    def __init__(self, stage: _Stage):
        super().__init__(auto_prefix=False)
        self.model_stage = stage.model_stage

    def construct(self, x, input_ids, labels, loss_mask, position_ids, attention_mask):
        return self.model_stage.forward(x, input_ids, labels, loss_mask, position_ids, attention_mask)[0]


class _Objective(nn.Cell):
    """What a stage's backward differentiates: its loss part times the loss scale, plus the output's dot product
    with the received output gradient (so the gradients are the vector-Jacobian product with it). Besides, as
    flat outputs (a compiled graph returns no None and no dict): the loss part (zero on a stage without one),
    then its parts in the order of the model stage's ``part_names``."""

    def __init__(self, stage: _Stage, scale: float):
        super().__init__(auto_prefix=False)
        self.model_stage, self.scale = stage.model_stage, scale

    def construct(self, x, output_grad, input_ids, labels, loss_mask, position_ids, attention_mask):
        out, loss, components = self.model_stage.forward(x, input_ids, labels, loss_mask, position_ids,
                                                         attention_mask)
        objective = 0.0 if loss is None else loss * self.scale
        if out is not None:
            objective = objective + (out * output_grad).sum()
        loss = ops.zeros((), ms.float32) if loss is None else ops.stop_gradient(loss)
        return objective, (loss,) + tuple(ops.stop_gradient(components[name]) for name in self.model_stage.part_names)


@dataclass
class PipelineResult:
    """One step's outcome on this rank: gradients of ``Pipeline.params`` (summed over micro-batches, scaled), the
    mean over micro-batches of this rank's part of the loss and of each loss component (0 where the part lives
    on other stages), that part per micro-batch, and what the schedule cost here: seconds computing, seconds in all, and at most how many
    micro-batches were forwarded and not yet backpropagated (whose stage inputs it kept), their bytes, and the
    bytes it sent to other stages."""
    grads: tuple[Tensor, ...]
    loss: float
    components: dict[str, float]
    micro_losses: list[float]  # this rank's part of each micro-batch's loss, by micro-batch (monitor's local_loss)
    busy_s: float = 0.0
    wall_s: float = 0.0
    peak_in_flight: int = 0
    peak_kept_bytes: int = 0
    sent_bytes: int = 0


class Pipeline:
    """This rank's stages and its program of the step (built alike on every rank from the config)."""

    def __init__(self, model, mesh: DeviceMesh, parallelism: ParallelismConfig, micro_batches: int,
                 sequence_parallel: bool):
        dims = mesh.dims
        self.model, self.mesh = model, mesh
        self.pp, self.interleave = dims.pp, parallelism.pipeline_parallel_interleave_num
        self.rank = dims.coords(mesh.rank)["pp"]
        self.schedule = schedule = effective_schedule(parallelism)
        self.ranges = stage_layer_ranges(parallelism.pipeline_parallel_layers_per_stage, model.pipeline_layers,
                                         self.pp, self.interleave)
        self.last_stage = self.pp * self.interleave - 1
        # this rank's virtual stages, by local index (virtual stage local · pp + rank)
        self.stages = [_Stage(model, v, self.last_stage, self.ranges[v])
                       for v in range(self.rank, self.last_stage + 1, self.pp)]
        self.program = schedule_programs(schedule, self.pp, micro_batches, self.interleave)[0][self.rank]
        self.micro_batches = micro_batches
        self.hidden_size, self.dtype = self.stages[0].model_stage.hidden_size, self.stages[0].model_stage.dtype
        self.sequence_shards = dims.tp if sequence_parallel else 1
        self.grad_fns: list = []  # one per local stage, once the loss scale is known (finish)
        self.uncompiled_graphs = False  # set by compile(): the graphs compile in the first step, before its schedule
        # this rank's parameters in the model's order, which the data-parallel reduction and the optimizer follow
        self.param_names = {p.name for stage in self.stages for p in stage.params}
        self.params: list[Parameter] = [p for p in model.trainable_params() if p.name in self.param_names]
        self.trainable_names = {p.name for p in model.trainable_params()}
        # the pipeline rank of every global rank, and the peers this rank exchanges with (same other coordinates)
        self.pp_of_rank = tuple(dims.coords(r)["pp"] for r in range(dims.world))
        coords = dims.coords(mesh.rank)
        self.peer_rank = {p: dims.rank_of(**{**coords, "pp": p}) for p in range(self.pp)}
        self.pairs = {}
        for p in sorted({(self.rank - 1) % self.pp, (self.rank + 1) % self.pp} - {self.rank}):
            self.pairs[p] = mesh.pair(self.peer_rank[p])
        # a tensor two stages hold (GPTModel's embedding on the first and the last: MTP, a tied output layer) has
        # the sum of the copies' gradients: the two ranks must exchange already, as neighbours
        self.holders = self.holding_pipeline_ranks()
        self.shared = {name: sorted(ranks) for name, ranks in self.holders.items() if len(ranks) > 1}
        for name, ranks in self.shared.items():
            if len(ranks) > 2 or (self.pp > 2 and (ranks[1] - ranks[0]) % self.pp not in (1, self.pp - 1)):
                raise ValueError(f"pipeline: {name} is held by pipeline ranks {ranks}; a tensor may be shared by "
                                 "two neighbouring ranks only (their gradients are summed over the pair)")
        # every rank built the whole model from the seed, so its stage starts from the single-process weights; the
        # other stages' weights are dropped (an empty tensor under the same name)
        for param in model.trainable_params():
            if param.name not in self.param_names:
                param.set_data(Tensor(np.zeros((0,), numpy_dtype(param.dtype))), slice_shape=True)

    def finish(self, scale: float) -> None:
        """Once the data-parallel strategy is applied: the stages' parameters as the model now holds them (ZeRO-3
        replaced each sharded one by its chunk, under the same name), and the backward of each stage with
        ``scale`` on each micro-batch's loss (``Parallelism.loss_scale``)."""
        current = {p.name: p for p in self.model.trainable_params()}
        for stage in self.stages:
            stage.params = [current[p.name] for p in stage.params]
        self.params = [current[p.name] for p in self.params]
        self.grad_fns = [ms.value_and_grad(_Objective(stage, scale), None if stage.first else 0, stage.params,
                                           has_aux=True) for stage in self.stages]
        self.forwards = [_StageOutput(stage) for stage in self.stages]

    def compile(self) -> None:
        """Each stage's forward and its recomputing backward as mindspore.jit graphs (fast_step.compile); the
        schedule, the transfers between stages (2-rank broadcasts, which a graph cannot run) and the rewinding of
        the host state around a replay (``_replayed``) stay on the host, between the graphs."""
        self.forwards = [ms.jit(forward) for forward in self.forwards]
        self.grad_fns = [ms.jit(grad_fn) for grad_fn in self.grad_fns]
        self.uncompiled_graphs = True

    # ---- what the trainer asks -------------------------------------------------------------------------
    def holding_pipeline_ranks(self) -> dict[str, set[int]]:
        """Trainable parameter name -> the pipeline ranks holding it (built alike on every rank)."""
        holders: dict[str, set[int]] = {}
        for v, layers in enumerate(self.ranges):
            for param in _Stage(self.model, v, self.last_stage, layers).params:
                holders.setdefault(param.name, set()).add(v % self.pp)
        return holders

    def keeps(self, name: str) -> bool:
        """Whether this rank holds model tensor ``name``: its stage's parameters, and every buffer (MoE expert
        biases and counts, which every rank updates alike from the world's counts)."""
        return name in self.param_names or name not in self.trainable_names

    def holders_of(self, name: str) -> set[int] | None:
        """The pipeline ranks holding tensor ``name`` (a parameter or its optimizer state); None: every rank."""
        kind, _, rest = name.partition(".")
        return self.holders.get(rest if kind in OPTIMIZER_STATE_PREFIXES else name)

    def local_layouts(self, arrays: dict[str, np.ndarray], base: dict[str, TensorLayout]) -> dict[str, TensorLayout]:
        """The layout over the world of every tensor in ``arrays`` (this rank's): ``base`` (tensor/data parallel,
        a replicated tensor when absent) on the ranks of the pipeline ranks holding it, nothing elsewhere."""
        world = len(self.pp_of_rank)
        out = {}
        for name, array in arrays.items():
            layout = base.get(name) or TensorLayout.replicated(tuple(array.shape), world)
            holders = self.holders_of(name)
            out[name] = layout if holders is None else layout.restrict(
                tuple(self.pp_of_rank[r] in holders for r in range(world)))
        return out

    def absent_layouts(self) -> dict[str, TensorLayout]:
        """For loading: a layout for every parameter (and its optimizer state) of other stages, in which this rank
        holds nothing, so the loader skips them (their shapes are this rank's empty placeholders)."""
        world = len(self.pp_of_rank)
        mine = tuple(r != self.mesh.rank for r in range(world))
        return {f"{prefix}{p.name}": TensorLayout.replicated(tuple(p.shape), world).restrict(mine)
                for p in self.model.trainable_params() if p.name not in self.param_names
                for prefix in ("", *(f"{k}." for k in OPTIMIZER_STATE_PREFIXES))}

    def world_layouts(self, arrays: dict[str, dict[str, np.ndarray]], base: dict[str, TensorLayout], collectives
                      ) -> tuple[dict[str, TensorLayout], dict[str, tuple[str, np.dtype]]]:
        """Collective, for saving: every tensor's layout over the world and, for the tensors other stages hold,
        their kind and dtype (what rank 0 needs to describe every file). Each rank sends what it holds."""
        mine = {name: (kind, array.dtype.str, self.local_layouts({name: array}, base)[name])
                for kind, tensors in arrays.items() for name, array in tensors.items()}
        blob = json.dumps({name: [kind, dtype, list(l.global_shape), list(l.fragmentations), list(l.chunk_of_rank)]
                           for name, (kind, dtype, l) in mine.items()}).encode()
        world, rank = collectives.world.size, collectives.world.rank
        lengths = collectives.all_reduce_array(np.eye(world)[rank] * len(blob)).astype(np.int64)
        shared = collectives.share_arrays({str(rank): np.frombuffer(blob, np.uint8)}, {str(r): r for r in range(world)},
                                          {str(r): ((int(lengths[r]),), np.dtype(np.uint8)) for r in range(world)})
        layouts, remote = {}, {}
        for r in range(world):
            for name, (kind, dtype, shape, parts, chunks) in json.loads(shared[str(r)].tobytes()).items():
                layouts[name] = TensorLayout(tuple(shape), tuple(parts), tuple(chunks))
                if name not in mine:
                    remote[name] = (kind, np.dtype(dtype))
        return layouts, remote

    # ---- the step ------------------------------------------------------------------------------------
    def run(self, batches: list[tuple]) -> PipelineResult:
        """Forward and backward of every micro-batch (``batches[m]``: the model's positional inputs) by the
        schedule; collective over the pipeline ranks."""
        if len(batches) != self.micro_batches:
            raise ValueError(f"the pipeline was planned for {self.micro_batches} micro-batches, got {len(batches)}")
        if self.uncompiled_graphs:
            self._compile_graphs(batches[0])
        inputs: dict[tuple[int, int], Tensor | None] = {}  # (virtual stage, micro) -> its input hidden states
        output_grads: dict[tuple[int, int], Tensor] = {}
        outbox: dict[tuple[str, int, int], Tensor] = {}  # (kind, destination stage, micro) -> what to send
        rewind: dict[tuple[int, int], tuple] = {}  # the model stage's host state before a forward
        grads = {p.name: None for p in self.params}
        # the loss parts every rank reports, in one order (zero where they live on other stages)
        components = {name: 0.0 for name in self.model.loss_part_names}
        micro_losses = [0.0] * self.micro_batches
        busy, kept, peak, in_flight, peak_in_flight, sent = 0.0, 0, 0, 0, 0, 0
        started = time.perf_counter()
        for step in self.program:
            if isinstance(step, Transfer):
                sent += self._transfer(step, batches, inputs, output_grads, outbox)
                continue
            stage = self.stages[step.local_stage]
            key = (stage.stage, step.micro)
            t0 = time.perf_counter()
            if step.kind == FORWARD:
                inputs.setdefault(key, None)
                if not stage.last:  # the last stage's forward runs with its backward (nothing to send before)
                    rewind[key] = stage.model_stage.replay.capture()
                    outbox[(FORWARD, stage.stage + 1, step.micro)] = self.forwards[step.local_stage](
                        inputs[key], *batches[step.micro])
                kept += self._nbytes(inputs[key])
                in_flight += 1
            else:
                x = inputs.pop(key)
                dout = output_grads.pop(key, None)
                replayed = rewind.pop(key, None)
                (_, (loss, *parts)), g = self._replayed(stage, replayed, self.grad_fns[step.local_stage],
                                                        x, dout, *batches[step.micro])
                if not stage.first:
                    dx, g = g
                    outbox[(BACKWARD, stage.stage - 1, step.micro)] = dx
                for param, grad in zip(stage.params, g):
                    grads[param.name] = grad if grads[param.name] is None else grads[param.name] + grad
                if stage.model_stage.holds_loss:
                    micro_losses[step.micro] += float(loss.asnumpy())
                for name, value in zip(stage.model_stage.part_names, parts):
                    components[name] += float(value.asnumpy())
                kept -= self._nbytes(x)
                in_flight -= 1
            peak, peak_in_flight = max(peak, kept), max(peak_in_flight, in_flight)
            busy += time.perf_counter() - t0
        ordered = tuple(grads[p.name] if grads[p.name] is not None else ops.zeros_like(p) for p in self.params)
        m = self.micro_batches
        return PipelineResult(ordered, sum(micro_losses) / m, {n: v / m for n, v in components.items()},
                              micro_losses, busy, time.perf_counter() - started, peak_in_flight, peak, sent)

    def _compile_graphs(self, batch: tuple) -> None:
        """Every local stage's graphs run once on ``batch``, zeros for what the stage would receive; the outputs
        are dropped and the host state is put back. mindspore.jit compiles a graph at its first call. Left to the
        schedule, a rank would make that call only after an exchange, with its peer still compiling: the ranks
        would compile one after another, each waiting at the exchange. On CPU a collective waits for its peer
        for at most MS_NODE_TIMEOUT (30 s), and one compile can take longer on a loaded machine. Here, before the
        first exchange, every rank compiles at the same time, and a rank waits at most for the difference."""
        hidden = self._hidden_shape(batch[0])
        for local, stage in enumerate(self.stages):
            before = stage.model_stage.replay.capture()
            x = None if stage.first else ops.zeros(hidden, self.dtype)
            if not stage.last:
                self.forwards[local](x, *batch)
            self.grad_fns[local](x, None if stage.last else ops.zeros(hidden, self.dtype), *batch)
            stage.model_stage.replay.restore(before)
        self.uncompiled_graphs = False

    def _hidden_shape(self, input_ids: Tensor) -> tuple[int, int, int]:
        """The hidden states (or their gradient) a stage passes on for the micro-batch ``input_ids``."""
        return input_ids.shape[0], input_ids.shape[1] // self.sequence_shards, self.hidden_size

    def _transfer(self, transfer: Transfer, batches, inputs, output_grads, outbox) -> int:
        """One hidden-state or gradient transfer between stages; the bytes this rank sent (0 when receiving)."""
        input_ids = batches[transfer.micro][0]
        if transfer.src == self.rank:
            sending = outbox.pop((transfer.kind, transfer.stage, transfer.micro))
            self._exchange(sending, transfer.src, transfer.dst, input_ids)
            return self._nbytes(sending)
        received = self._exchange(None, transfer.src, transfer.dst, input_ids)
        (inputs if transfer.kind == FORWARD else output_grads)[(transfer.stage, transfer.micro)] = received
        return 0

    def _exchange(self, sending: Tensor | None, src: int, dst: int, input_ids: Tensor) -> Tensor | None:
        """Hidden states (or their gradient) of the micro-batch ``input_ids`` from pipeline rank ``src`` to
        ``dst``: what this rank holds after it (the received tensor on ``dst``, ``sending`` on any other rank,
        which takes part only as the sender)."""
        if self.rank not in (src, dst):
            return sending
        pair = self.pairs[dst if src == self.rank else src]
        sender = pair.ranks.index(self.peer_rank[src])
        if src == self.rank:
            comm.send_recv(sending, pair, sender)
            return sending
        return comm.send_recv(ops.zeros(self._hidden_shape(input_ids), self.dtype), pair, sender)

    def held_out_loss_sums(self, input_ids, labels, loss_mask, position_ids=None, attention_mask=None
                           ) -> tuple[Tensor, Tensor]:
        """Validation's forward (``forward.forward_loss_sums``) through the stages: the batch goes through every
        virtual stage in order, each handing its hidden states to the next, with no backward to keep anything for.
        The last stage's ranks return each sample's loss sum and token count (``GPTModel.hidden_loss_sums``), the
        other ranks zeros, which add nothing when validation sums them over the world."""
        sums = counts = ops.zeros(input_ids.shape[:1], ms.float32)
        x = None
        for v in range(self.last_stage + 1):
            if v % self.pp == self.rank:
                stage = self.stages[v // self.pp].model_stage
                x = stage.decode(x, input_ids, position_ids, attention_mask)[0]
                if stage.last:
                    sums, counts = stage.held_out_loss_sums(x, labels, loss_mask)
            if v < self.last_stage:
                x = self._exchange(x, v % self.pp, (v + 1) % self.pp, input_ids)
        return sums, counts

    @staticmethod
    def _replayed(stage: _Stage, before, grad_fn, *args):
        """``grad_fn(*args)``, which runs the stage's forward again when it ran before (``before``: its host state
        then; None when not): the replay draws the forward's dropout masks again, and what else it changes on the
        host (MoE token counts) is put back as it was after the forward."""
        if before is None:
            return grad_fn(*args)
        replay = stage.model_stage.replay
        after = replay.capture()
        replay.rewind(before)
        out = grad_fn(*args)
        replay.restore(after)
        return out

    @staticmethod
    def _nbytes(x: Tensor | None) -> int:
        return 0 if x is None else int(x.size) * x.itemsize

    # ---- after the backward --------------------------------------------------------------------------
    def gradients(self, parallel, batches: list[tuple], max_norm: float
                  ) -> tuple[float, dict[str, float], tuple, tuple, np.ndarray, float]:
        """The trainer's step up to the update: this rank's part of the loss and its parts, the clipped and the
        unclipped reduced gradients of ``params``, their norms, and the global norm over every stage."""
        self.last_result = result = self.run(batches)
        unclipped = self.sum_shared_grads(parallel.reduce_gradients(result.grads))
        norms = parallel.tensor_norms(unclipped)
        own = np.sum(np.square(norms[self.counted_once()]))
        grad_norm = float(np.sqrt(comm.all_reduce_array(np.array([own]), self.mesh.group("pp"))[0]))
        # the global norm given as the norm of one tensor: clip_grad_norm scales every gradient by it
        grads, _ = clip_grad_norm(unclipped, max_norm, np.array([grad_norm]))
        return result.loss, result.components, grads, unclipped, norms, grad_norm

    def gather_monitored(self, record: dict, config) -> dict:
        """Collective over the pipeline ranks: ``TrainStateMonitor.record``'s per-parameter norms (``device_norm``,
        ``param_norm``: each rank selects among its stage's parameters) of every stage, in the model's parameter
        order, so rank 0 reports them all; a tensor two stages hold (the embedding's copy) is the first one's.
        The rest of the record is alike on every stage. ``config`` (the TrainConfig) says which norms every rank
        gathers (a selector may pick none of a stage's parameters)."""
        names = [p.name for p in self.model.trainable_params()]  # every stage's model names every parameter
        out = dict(record)
        asked = {"device_norm": config.monitor.train_state.device_norm, "param_norm": config.kiln.train_state.param_norm}
        for key, selector in asked.items():
            if not selector:
                continue
            values = record.get(key, {})
            rows = np.zeros((2, len(names)))  # each norm, and whether this rank reports it
            for i, name in enumerate(names):
                if name in values and min(self.holders[name]) == self.rank:
                    rows[:, i] = values[name], 1.0
            norms, reported = comm.all_reduce_array(rows, self.mesh.group("pp"))
            out[key] = {name: round(float(norm), 6) for name, norm, held in zip(names, norms, reported) if held}
        return out

    def norm_of(self, name: str, norms: np.ndarray) -> float:
        """The gradient norm of tensor ``name`` (in ``norms``, of ``params``), from the first pipeline rank holding
        it (every rank gets it)."""
        index = next((i for i, p in enumerate(self.params) if p.name == name), None)
        own = float(norms[index]) if index is not None and self.rank == min(self.holders[name]) else 0.0
        return float(comm.all_reduce_array(np.array([own]), self.mesh.group("pp"))[0])

    def sum_shared_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """A tensor two stages hold gets the sum of its copies' gradients on both."""
        out = list(grads)
        for index, param in enumerate(self.params):
            if param.name in self.shared:
                peer = next(p for p in self.shared[param.name] if p != self.rank)
                out[index] = comm.all_reduce(grads[index], self.pairs[peer])
        return tuple(out)

    def counted_once(self) -> np.ndarray:
        """Which of ``params`` count in the global gradient norm: a shared tensor's copy on its first holder only."""
        return np.array([p.name not in self.shared or self.rank == self.shared[p.name][0] for p in self.params],
                        dtype=bool)


def effective_schedule(parallelism: ParallelismConfig) -> str:
    """The schedule a pipeline follows: ``1f1b`` over interleaved stages is ``interleaved_1f1b``, as MindFormers
    upgrades it."""
    schedule = parallelism.pipeline_parallel_schedule
    return "interleaved_1f1b" if schedule == "1f1b" and parallelism.pipeline_parallel_interleave_num > 1 else schedule


def pipeline_problems(config, num_layers: int, micro_batches: int | None) -> list[str]:
    """Every reason a pipeline of ``config`` (parallelism.pipeline_parallel > 1) cannot run ``num_layers`` decoder
    layers in ``micro_batches`` micro-batches a step (None: not known, the batch being wrong already), each naming
    its field and the arithmetic: the stages' layer ranges, the schedule, and the statistics a pipeline does not
    measure. The one check: training.launch.check_layout runs it before launch, build_pipeline on every rank."""
    p, problems = config.parallelism, []
    if config.monitor.train_state.local_norm:
        problems.append("monitor.train_state.local_norm with parallelism.pipeline_parallel > 1 is not implemented: a "
                        "stage adds each micro-batch's gradients into the step's as its backwards run, in the "
                        "schedule's order, and measures no gradient of a single micro-batch")
    if config.kiln.train_state.max_attention_logit:
        problems.append("kiln.train_state.max_attention_logit with parallelism.pipeline_parallel > 1 is not "
                        "implemented: each stage tracks only its own layers' maxima, and the report stacks every "
                        "layer's (GPTModel.pop_max_attention_logits gives none while a layer has not run)")
    schedule, interleave = effective_schedule(p), p.pipeline_parallel_interleave_num
    if schedule == "interleaved_1f1b" and interleave == 1:
        problems.append("parallelism.pipeline_parallel_schedule interleaved_1f1b needs "
                        "pipeline_parallel_interleave_num > 1 (1f1b is the schedule of one stage per rank)")
    checks = [lambda: stage_layer_ranges(p.pipeline_parallel_layers_per_stage, num_layers, p.pipeline_parallel,
                                         interleave)]
    if micro_batches:
        checks.append(lambda: work_order(schedule, p.pipeline_parallel, 0, micro_batches, interleave))
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            problems += exc.problems
    return problems


def build_pipeline(model, mesh: DeviceMesh, config, micro_batches: int, tensor_parallel) -> Pipeline:
    """This rank's stages of ``model`` (already cut for tensor parallelism), or a clear refusal of what a pipeline
    run cannot do here (``pipeline_problems``, which training_run and training.run checked before launch)."""
    problems = pipeline_problems(config, model.pipeline_layers, micro_batches)
    if problems:
        raise ConfigError(*problems)
    sequence_parallel = bool(tensor_parallel and tensor_parallel.sequence_parallel)
    return Pipeline(model, mesh, config.parallelism, micro_batches, sequence_parallel)
