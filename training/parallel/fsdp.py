"""Data parallelism with sharded state: FSDP over the mesh's ``dp_shard`` group, HSDP replicas over
``dp_replicate`` (MindFormers' ``data_parallel_shard``; reference §6.2). Under context parallelism the cp
ranks join the shards: "``dp_shard``" below is then the ``fsdp`` group, dp_shard × cp.

``data_parallel_shard_strategy`` picks what is sharded, each tensor cut along dim 0 into one even chunk per
``dp_shard`` rank (a tensor whose dim 0 does not divide stays replicated):

- ``optim`` (ZeRO-1): the optimizer state. Gradients are all-reduced whole; each rank updates its chunk of
  every parameter and the chunks are all-gathered back into the replicated parameters.
- ``optim_grads`` (ZeRO-2): also the gradients: reduce-scattered, so each rank keeps only its chunk.
- ``optim_grads_params`` (ZeRO-3): also the parameters: the model holds only its chunks, and each unit
  (a decoder layer, an MTP layer, the rest of the model) all-gathers its weights when it runs. The gather's
  backward is a reduce-scatter, so gradients arrive as this rank's chunk, summed over ``dp_shard``. When the
  step compiles, each layer gathers its own chunks inside the graph instead (``Parallelism.gather_in_layers``).

Routed experts under expert parallelism (``expert_parallel``: what ``apply_expert_parallel`` did) have a
data-parallel domain of their own, MindFormers' sparse mesh: cut over ``efsdp`` instead of ``dp_shard``,
gradients summed over ``expert_dp`` (dp_replicate × efsdp, the ranks holding the same experts) instead of
over every data-parallel rank; under ZeRO-3 each layer's experts gather as a unit of their own. With
``dense_fsdp_shard_size`` k, dense weights are cut over k consecutive shard ranks only (mesh group
``dense_shard``) and held as HSDP replicas by the rest (``dense_replicate``), so experts and dense weights can
shard differently.

Every strategy computes the single-process update: the loss is the mean over the global batch, so gradients
are summed over the data-parallel ranks and the micro-batches and divided by their count (before the
reduction with ``disable_gradient_division``, MindFormers' default, after it otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.model.layers import _matmul, _matmul_transpose_a, cast, linear
from training.optim import for_each, tensor_norms
from training.parallel import comm
from training.parallel.expert_parallel import ExpertParallelPlan
from training.parallel.layout import TensorLayout
from training.parallel.mesh import DeviceMesh, Group
from training.parallel.tensor_parallel import TensorParallelPlan


@dataclass(frozen=True)
class _Domain:
    """The data-parallel groups of a kind of parameter: FSDP cuts it along dim 0 over ``shard``; its gradient
    is summed over ``reduce`` (every rank holding the same tensor with other tokens); ``replicate`` holds the
    HSDP replicas of each chunk."""
    shard: Group
    reduce: Group
    replicate: Group


@dataclass
class _Sharded:
    """A parameter cut along dim 0 over ``group`` (its domain's shard group): ``shard`` is this rank's chunk,
    the one the optimizer updates (for ZeRO-3 also the one the model holds)."""
    full_shape: tuple[int, ...]
    shard: Parameter
    group: Group


@dataclass(frozen=True)
class _Bucket:
    """One collective of the gradient reduction: the gradients at ``indices`` summed over ``group`` as one flat
    buffer, then cut to this rank's dim-0 chunk over ``keep_rows_of`` when it is set; ``scatter``: only that chunk
    is wanted from the sum (a reduce-scatter where the backend has one)."""
    indices: tuple[int, ...]
    group: Group
    keep_rows_of: Group | None = None
    scatter: bool = False


# Inside a compiled graph only primitives run: measured with benchmarks/compiled_collectives_probe.py (MindSpore
# 2.10, CPU, msrun), AllReduce runs in a mindspore.jit graph on the world and on sub-groups, while comm's per-call
# functions do not parse (only its Cells built beforehand do) and mint.distributed's are not supported in graph
# mode. So the graph's reduce-scatter is an all-reduce and this rank's rows, as comm's CPU backend does eagerly.
class _BucketReduction(nn.Cell):
    """A ``_Bucket`` inside a graph: takes and returns every gradient, replacing those of the bucket."""

    def __init__(self, bucket: _Bucket, shapes: list[tuple[int, ...]]):
        super().__init__()
        self.indices = bucket.indices
        self.shapes = tuple(tuple(shapes[i]) for i in bucket.indices)
        self.sizes = tuple(int(np.prod(shape)) for shape in self.shapes)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, bucket.group.backend_name)
        keep = bucket.keep_rows_of
        self.rows = None if keep is None else tuple(
            (keep.rank * (shape[0] // keep.size), shape[0] // keep.size) for shape in self.shapes)

    def output_shapes(self, shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Every gradient's shape after this bucket (a kept chunk has 1/size of the rows)."""
        out = list(shapes)
        for k, i in enumerate(self.indices):
            out[i] = self.shapes[k] if self.rows is None else (self.rows[k][1], *self.shapes[k][1:])
        return out

    def construct(self, grads):
        flat = self.all_reduce(ops.cat([grads[i].reshape(-1) for i in self.indices]))
        parts = ops.split(flat, self.sizes)
        out = list(grads)
        for k, i in enumerate(self.indices):
            part = parts[k].reshape(self.shapes[k])
            if self.rows is not None:
                part = ops.narrow(part, 0, self.rows[k][0], self.rows[k][1])
            out[i] = part
        return tuple(out)


class _Primitive(nn.Cell):
    """A primitive as a Cell, so several can be held in one CellList."""

    def __init__(self, primitive):
        super().__init__()
        self.primitive = primitive

    def construct(self, x):
        return self.primitive(x)


class GradientReduction(nn.Cell):
    """``Parallelism.reduce_gradients`` for a compiled step (``Parallelism.compiled_reduction``): the same
    buckets, in the same order and flat layout as the eager reduction, so the sums are the same; then
    ``whole_squares`` makes the squared norms of cut gradients those of their whole tensors, and ``loss_total``
    sums the step's loss over the world, so every rank's graph decides alike whether to apply the update."""

    def __init__(self, buckets: list[_Bucket], shapes: list[tuple[int, ...]], scale: float | None,
                 norm_groups: list[tuple[Group, tuple[bool, ...]]], world: Group):
        super().__init__()
        cells = []
        for bucket in buckets:  # a bucket reduces what the ones before it left: chunks after a reduce-scatter
            cells.append(_BucketReduction(bucket, shapes))
            shapes = cells[-1].output_shapes(shapes)
        self.buckets = nn.CellList(cells)
        self.scale = scale  # 1/dp when the gradients are divided after the reduction
        self.norm_masks = tuple(Tensor(np.array(cut)) for _, cut in norm_groups)
        self.norm_sums = nn.CellList([_Primitive(ops.AllReduce(ops.ReduceOp.SUM, group.backend_name))
                                      for group, _ in norm_groups])
        self.world_sum = ops.AllReduce(ops.ReduceOp.SUM, world.backend_name)

    def construct(self, grads):
        for bucket in self.buckets:
            grads = bucket(grads)
        if self.scale is not None:
            grads = for_each(ops.partial(ops.mul, self.scale), grads)
        return grads

    def whole_squares(self, squares):
        """Each reduced gradient's sum of squares (a vector), summed over the groups that cut it."""
        for mask, group_sum in zip(self.norm_masks, self.norm_sums):
            squares = ops.select(mask, group_sum(squares * mask.astype(squares.dtype)), squares)
        return squares

    def loss_total(self, loss):
        return self.world_sum(loss)


class _UnitGather:
    """Wraps a unit's forward (ZeRO-3): all-gather the unit's parameter chunks in one collective, hand each
    full tensor to the layer that owns it for the duration of the call, then drop them.

    The full tensors are set as instance attributes over the (chunk) Parameters, which instance lookup
    finds first; autograd sees gather → layer ops, so the chunk's gradient is the gather's backward.

    With ``reshard_after_forward`` autograd keeps no gathered tensor until the backward (saved-tensor hooks,
    ``_RegatherInBackward``): the unit gathers its weights again when its backward first needs one and drops
    them after the last. Without it, every unit's full weights live from its forward to its backward."""

    def __init__(self, forward, slots: list[tuple[nn.Cell, str, _Sharded]], group, reshard_after_forward: bool):
        self.forward, self.slots, self.group = forward, slots, group
        self.reshard_after_forward = reshard_after_forward

    def _gather(self) -> list[Tensor]:
        return gather_chunks([s.shard for _, _, s in self.slots], [s.full_shape for _, _, s in self.slots],
                             self.group)

    def __call__(self, *args, **kwargs):
        if not self.reshard_after_forward:
            return self._call(self._gather(), args, kwargs)
        hooks = _RegatherInBackward(self._gather)
        with ms.saved_tensors_hooks(hooks.pack, hooks.unpack):
            try:
                return self._call(hooks.gather_for_forward(), args, kwargs)
            finally:
                hooks.current = None  # the forward is done with them: the backward gathers its own

    def _call(self, fulls: list[Tensor], args, kwargs):
        for (cell, attr, _), full in zip(self.slots, fulls):
            cell.__dict__[attr] = full
        try:
            return self.forward(*args, **kwargs)
        finally:
            for cell, attr, _ in self.slots:
                del cell.__dict__[attr]


class _Regathered:
    """What autograd keeps of a full weight: its index in the unit's gather."""

    def __init__(self, index: int):
        self.index = index


class _Unread:
    """What autograd keeps of a tensor the all-gather saved: the collective's backward never reads its saved
    input or output (``comm``'s backward is a function of the output gradient alone), so only the shape."""

    def __init__(self, tensor: Tensor):
        self.shape, self.dtype = tensor.shape, tensor.dtype


class _RegatherInBackward:
    """The saved-tensor hooks of one call of a unit. A full weight is recognised by its values, not its
    identity: MindSpore 2.10 hands the pack hook a copy of the tensor an op saves (measured: same values, another
    buffer). A tensor equal to a full weight is stored as a marker and comes back as an equal one, gathered
    again; the comparison is elementwise over a weight, small beside the matmuls using it."""

    def __init__(self, gather):
        self.gather = gather
        self.gathering = False
        self.current: list[Tensor] | None = None
        self.pending = 0  # markers not yet unpacked: the backward is done with the unit's weights at 0

    def gather_for_forward(self) -> list[Tensor]:
        self.gathering = True
        try:
            self.current = self.gather()
        finally:
            self.gathering = False
        return self.current

    def pack(self, tensor):
        if self.gathering:
            return _Unread(tensor)
        for index, full in enumerate(self.current):
            if tensor.shape == full.shape and tensor.dtype == full.dtype and bool((tensor == full).all()):
                self.pending += 1
                return _Regathered(index)
        return tensor

    def unpack(self, packed):
        if isinstance(packed, _Unread):
            return ops.broadcast_to(Tensor(0, packed.dtype), packed.shape)  # no memory behind it
        if not isinstance(packed, _Regathered):
            return packed
        if self.current is None:
            self.current = self.gather()
        full = self.current[packed.index]
        self.pending -= 1
        if self.pending == 0:
            self.current = None
        return full


# ---- ZeRO-3 in a compiled step: each layer gathers its own weights ---------------------------------------
# A graph's weights are its Parameters, so the eager units' host wrapper (_UnitGather) cannot run in one; instead
# each layer holding chunks is given Cells that gather them where they are read: the layer says which, and where
# (its ``gathered_weights``, from the kinds ``WeightGathers`` makes; Kiln's Linear, RMSNorm, VocabEmbedding and
# MoE's TopKRouter and GroupedExperts have them). A graph keeps whatever its backward reads, so resharding after
# forward takes a hand-written backward that reads only its inputs (x and the chunk) and gathers the weight again:
# MindSpore 2.10's Cell.recompute re-runs a layer's products inside a PyNative mindspore.jit graph but leaves the
# step's memory where it was (benchmarks/graph_recompute_probe.py), so it cannot stand in for that backward.
# Vectors (norm weights, biases) stay gathered until the backward: a few KB per layer.
class GatheredMatrix(nn.Cell):
    """x @ W.T for a linear's (or a tied output layer's) weight W held as this rank's rows: W gathered for the
    product (``view``, when the layer gives one, reorders the gathered rows for it: an MLP's fc1 puts its gate/up
    pairs in halves), the chunk's gradient the reduce-scatter of W's by the gather's own backward. The graph keeps
    the gathered W until the backward (no resharding after forward). ``unview`` is ``view``'s inverse."""

    def __init__(self, group: Group, view=None, unview=None):
        super().__init__()
        self.gather = comm.AllGather(group, 0)
        self.view, self.unview = view, unview

    def _weight(self, full: Tensor) -> Tensor:
        return full if self.view is None else self.view(full)

    def construct(self, x: Tensor, chunk: Tensor) -> Tensor:
        return linear(x, self._weight(self.gather(chunk)))


class RegatheredMatrix(GatheredMatrix):
    """``GatheredMatrix`` resharding after forward: its backward gathers W again instead of keeping it."""

    def bprop(self, x, chunk, out, dout):
        transport = self.gather.transport
        weight = self._weight(transport.gather(chunk))
        rows = dout.reshape(-1, dout.shape[-1])
        dx = _matmul(rows, cast(weight, rows.dtype)).reshape(x.shape)
        dweight = _matmul_transpose_a(rows, x.reshape(-1, x.shape[-1]))
        if self.unview is not None:
            dweight = self.unview(dweight)
        return dx, cast(transport.reduce_scatter(dweight), chunk.dtype)


class GatheredRows(nn.Cell):
    """Rows ``ids`` of a table held as this rank's rows: an embedding's, or the stacked weights of routed experts
    (a row an expert). The gathered table is never kept: the lookup's backward needs only the ids (a row's
    gradient is the sum of the gradients of the places it went), whose sum is then reduce-scattered to the chunk."""

    def __init__(self, group: Group):
        super().__init__()
        self.gather = comm.AllGather(group, 0)
        self.members = group.size

    def construct(self, chunk: Tensor, ids: Tensor) -> Tensor:
        return ops.gather(self.gather.transport.gather(chunk), ids, 0)

    def bprop(self, chunk, ids, out, dout):
        table = ops.unsorted_segment_sum(dout, ids, chunk.shape[0] * self.members)
        return cast(self.gather.transport.reduce_scatter(table), chunk.dtype), ops.zeros_like(ids)


class WeightGathers:
    """The Cells a layer's ``gathered_weights(attr, gathers)`` chooses from, to read its chunk ``attr`` inside a
    compiled step, over the chunk's shard ``group``, resharding after forward or not."""

    def __init__(self, group: Group, reshard: bool):
        self.group, self.reshard = group, reshard

    def matrix(self, view=None, unview=None) -> GatheredMatrix:
        """A linear's product with the gathered weight (``GatheredMatrix``)."""
        return (RegatheredMatrix if self.reshard else GatheredMatrix)(self.group, view, unview)

    def rows(self) -> GatheredRows:
        """Rows of a gathered table (``GatheredRows``): an embedding's lookup, the experts a dispatch reads."""
        return GatheredRows(self.group)

    def whole(self) -> nn.Cell:
        """The tensor gathered whole (a norm's weight, a bias: a few KB)."""
        return comm.AllGather(self.group, 0)


def gather_chunks(chunks: list[Tensor], full_shapes: list[tuple[int, ...]], group) -> list[Tensor]:
    """The full tensors of dim-0 ``chunks`` (one per tensor, this rank's), with ONE all-gather of their flat
    concatenation: a collective's fixed cost dominates for the small tensors of a layer."""
    sizes = [int(np.prod(c.shape)) for c in chunks]
    flat = ops.cat([c.reshape(-1) for c in chunks])
    gathered = comm.all_gather(flat, 0, group).reshape(group.size, -1)  # [rank, this rank's flat chunks]
    parts = ops.split(gathered, sizes, axis=1)
    return [part.reshape(shape) for part, shape in zip(parts, full_shapes)]


class Parallelism:
    """Every parallelism of one run as applied to its model (``parallelize`` builds it): the tensor-, expert- and
    context-parallel plans and the pipeline (None where the layout has none), and what they mean together for
    training, which this module's sharding decides: which tensors the optimizer updates, how gradients are
    reduced, what the checkpoint layouts are. With ``dp_shard == 1`` nothing is sharded (plain data
    parallelism: gradients all-reduced, parameters replicated).

    On a tensor-parallel model (``tensor_parallel``: what ``apply_tensor_parallel`` did), each rank's tensors
    are its tp shards, which FSDP cuts again along their dim 0; the replicated weights tp lists have their
    gradients summed over tp first. Routed experts cut by ``expert_parallel`` are reduced and sharded in the
    experts' domain (module docstring). ``context_parallel`` gives the trainer each rank's tokens of a
    micro-batch; ``pipeline`` runs the step's micro-batches through this rank's stages."""

    def __init__(self, model: nn.Cell, mesh: DeviceMesh, strategy: str, divide_before_reduction: bool,
                 accumulation: int, unit_cells: list[nn.Cell], tensor_parallel: TensorParallelPlan | None = None,
                 reshard_after_forward: bool = True, expert_parallel: ExpertParallelPlan | None = None,
                 context_parallel=None, pipeline=None):
        self.model, self.mesh = model, mesh
        self.tensor_parallel, self.expert_parallel = tensor_parallel, expert_parallel
        self.context_parallel, self.pipeline = context_parallel, pipeline
        self.tp_group, self.ep_group = mesh.group("tp"), mesh.group("ep")
        self.expert_layouts = expert_parallel.layouts if expert_parallel else {}
        # each rank's cut of a tensor: tensor parallel, or expert parallel for routed experts
        self.base_layouts = {**(tensor_parallel.layouts if tensor_parallel else {}), **self.expert_layouts}
        # an expert's gradient already holds the tp ranks' tokens of its ep group, summed by the all-to-all
        self.tp_summed = (set(tensor_parallel.grads_to_all_reduce_over_tp) - set(self.expert_layouts)
                          if tensor_parallel else set())
        # sharded over dp_shard × cp and summed over every rank holding other tokens (dp × cp): context-parallel
        # ranks' losses are parts of their samples' losses, so their gradients add up like data-parallel
        # shards' (MindFormers folds cp into the FSDP axis); only the dp ranks' are averaged
        self.shard_group, self.replicate_group = mesh.group("fsdp"), mesh.group("dp_replicate")
        self.dp_group = mesh.group("batch")
        self.strategy = strategy
        self.divide_before_reduction = divide_before_reduction
        self.accumulation = accumulation
        self.dp = mesh.group("dp").size
        # dense weights: cut over dense_fsdp_shard_size ranks of the shards (all of them by default), replicated
        # over the rest
        self.dense = _Domain(mesh.group("dense_shard"), self.dp_group, mesh.group("dense_replicate"))
        self.experts = _Domain(mesh.group("efsdp"), mesh.group("expert_dp"), self.replicate_group)
        # a pipeline stage trains only its layers' parameters; the rest of the model is other stages'
        trainable = list(model.trainable_params()) if pipeline is None else list(pipeline.params)
        self.domain_of = {p.name: self.experts if p.name in self.expert_layouts else self.dense for p in trainable}
        # ZeRO-3 cuts the model's own parameters, so only tensors it can cut evenly are sharded
        self.sharded: dict[str, _Sharded] = {}
        for param in trainable:
            group = self.domain_of[param.name].shard
            if group.size > 1 and param.shape and param.shape[0] % group.size == 0:
                # ZeRO-1/2's chunks are the optimizer's alone and take a name of their own: a compiled step holds
                # them beside the model's tensors, and a Cell whose parameters share a name has MindSpore rename
                # every one of them by its path on its first call (the checkpoints' names with them)
                name = param.name if strategy == "optim_grads_params" else f"chunk.{param.name}"
                chunk = Parameter(Tensor(_own_rows(param.asnumpy(), group)), name=name)
                self.sharded[param.name] = _Sharded(tuple(param.shape), chunk, group)
        self.full = {p.name: p for p in trainable}
        if strategy == "optim_grads_params":
            self._shard_model(unit_cells, reshard_after_forward)
        # what value_and_grad differentiates: the model's own tensors (its chunks under ZeRO-3)
        self.model_params: list[Parameter] = [p for p in model.trainable_params() if p.name in self.full]

    # ---- ZeRO-3: the model holds chunks ------------------------------------------------------------
    def _shard_model(self, unit_cells: list[nn.Cell], reshard_after_forward: bool) -> None:
        """Replace every sharded Parameter of the model by its chunk, and make each unit gather its chunks
        when it runs. ``unit_cells`` are the units in nesting order, outermost (the model) first: a
        parameter belongs to the innermost unit holding it."""
        owner: dict[str, nn.Cell] = {}
        for unit in unit_cells:
            for param in unit.get_parameters():
                owner[param.name] = unit
        slots: dict[int, list] = {id(u): [] for u in unit_cells}
        self.reshard_after_forward = reshard_after_forward
        self.chunk_slots: list[tuple[nn.Cell, str, _Sharded]] = []  # every (layer, attribute) holding a chunk
        self.unit_wrappers: list[tuple[object, str]] = []  # (object, method) wrapped by _UnitGather
        for _, cell in self.model.cells_and_names():
            for attr, param in list(cell._params.items()):
                if param is None or param.name not in self.sharded:
                    continue
                sharded = self.sharded[param.name]
                cell._params[attr] = sharded.shard
                slots[id(owner[param.name])].append((cell, attr, sharded))
                self.chunk_slots.append((cell, attr, sharded))
        for unit in unit_cells:
            unit_slots = slots[id(unit)]
            # one gather per shard group (a unit holding dense and expert weights would have two)
            for group in {id(s.group): s.group for _, _, s in unit_slots}.values():
                group_slots = [slot for slot in unit_slots if slot[2].group is group]
                unit.construct = _UnitGather(unit.construct, group_slots, group, reshard_after_forward)
                self.unit_wrappers.append((unit, "construct"))
                for entry in self.model.unit_entry_points(unit):
                    setattr(self.model, entry, _UnitGather(getattr(self.model, entry), group_slots, group,
                                                           reshard_after_forward))
                    self.unit_wrappers.append((self.model, entry))

    def gather_in_layers(self) -> None:
        """ZeRO-3, for a compiled step: the units' host wrappers removed, each layer holding chunks given the Cells
        that gather them where it reads them (its ``gathered_weights``), resharding after forward as the units did.
        A no-op for the other strategies."""
        if not self.params_are_chunks:
            return
        for owner, method in self.unit_wrappers:
            owner.__dict__.pop(method, None)  # the class's own method again
        self.unit_wrappers = []
        for cell, attr, sharded in self.chunk_slots:
            if not hasattr(cell, "gathered_weights"):
                raise ValueError(f"ZeRO-3 in a compiled step: {type(cell).__name__}.{attr} is a chunk, and "
                                 f"{type(cell).__name__} declares no gathered_weights (where it reads its gathered "
                                 "weights in a graph)")
            for name, gathering in cell.gathered_weights(attr, WeightGathers(sharded.group,
                                                                             self.reshard_after_forward)).items():
                setattr(cell, name, gathering)

    # ---- what the trainer differentiates and updates -------------------------------------------------
    @property
    def optimizer_params(self) -> list[tuple[str, Parameter]]:
        """(name, tensor) the optimizer updates: the chunk of every sharded parameter, the rest whole."""
        return [(p.name, self.sharded[p.name].shard if p.name in self.sharded else p) for p in self.model_params]

    def loss_scale(self) -> float:
        """The factor on each micro-batch's loss before its backward."""
        return 1.0 / (self.accumulation * (self.dp if self.divide_before_reduction else 1))

    def reduce_gradients(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The step's gradients (summed over micro-batches, each scaled by ``loss_scale``), reduced over the
        data-parallel ranks into what the optimizer updates: a chunk for sharded tensors, else whole."""
        out = list(grads)
        for bucket in self.reduction_buckets():
            tensors = [out[i] for i in bucket.indices]
            if bucket.scatter:
                reduced = self._reduce_scatter(tensors, bucket.group)
            else:
                reduced = self._all_reduce(tensors, bucket.group)
                if bucket.keep_rows_of is not None:
                    reduced = [_own_rows(g, bucket.keep_rows_of) for g in reduced]
            for i, value in zip(bucket.indices, reduced):
                out[i] = value
        return tuple(out if self.divide_before_reduction else [g * (1.0 / self.dp) for g in out])

    def reduction_buckets(self) -> list[_Bucket]:
        """The collectives of ``reduce_gradients``, in order (a bucket may reduce what an earlier one did):
        replicated weights that each tp rank applied to its part of the data (sequence shards, its heads) take
        the sum of the tp ranks' gradients first; then each domain's gradients are summed over the ranks that
        saw other tokens, a sharded one keeping its chunk."""
        index = {p.name: i for i, p in enumerate(self.model_params)}
        buckets = [_Bucket(tuple(i for n, i in index.items() if n in self.tp_summed), self.tp_group)]
        for domain in self._domains():
            names = [n for n in index if self.domain_of[n] is domain]
            whole = tuple(index[n] for n in names if n not in self.sharded)
            cut = tuple(index[n] for n in names if n in self.sharded)
            buckets.append(_Bucket(whole, domain.reduce))
            if self.strategy == "optim":  # ZeRO-1: the whole gradient is reduced, then this rank's chunk kept
                buckets.append(_Bucket(cut, domain.reduce, keep_rows_of=domain.shard))
            elif self.strategy == "optim_grads":  # ZeRO-2: only this rank's chunk is kept from the reduction
                buckets += [_Bucket(cut, domain.shard, keep_rows_of=domain.shard, scatter=True),
                            _Bucket(cut, domain.replicate)]
            else:  # ZeRO-3: the gather's backward already summed the chunk over the shard group
                buckets.append(_Bucket(cut, domain.replicate))
        return [b for b in buckets if b.indices and b.group.size > 1]

    def compiled_reduction(self) -> GradientReduction:
        """``reduce_gradients`` as a Cell a compiled step runs inside its graph."""
        return GradientReduction(self.reduction_buckets(), [tuple(p.shape) for p in self.model_params],
                                 None if self.divide_before_reduction else 1.0 / self.dp,
                                 self._sharded_norm_groups(), self.mesh.group("world"))

    def _domains(self) -> list[_Domain]:
        """The domains of this model's parameters, dense first (the same order on every rank)."""
        return [d for d in (self.dense, self.experts) if d in self.domain_of.values()]

    def _sharded_norm_groups(self) -> list[tuple[Group, tuple[bool, ...]]]:
        """Each group over which some reduced gradients are cut (FSDP's shard group, then tp or ep), and which:
        a cut gradient's squared norm is the sum over that group of its chunks'."""
        names = [name for name, _ in self.optimizer_params]
        cuts = [(domain.shard, [n in self.sharded and self.domain_of[n] is domain for n in names])
                for domain in self._domains()]
        cuts += [(self.tp_group, [n not in self.expert_layouts and n in self.base_layouts
                                  and self.base_layouts[n].is_sharded for n in names]),
                 (self.ep_group, [n in self.expert_layouts for n in names])]
        return [(group, tuple(cut)) for group, cut in cuts if any(cut) and group.size > 1]

    @staticmethod
    def _all_reduce(tensors: list[Tensor], group) -> list[Tensor]:
        """Sums over ``group`` as one flat all-reduce (the identity on a group of one)."""
        if not tensors or group.size == 1:
            return list(tensors)
        flat = comm.all_reduce(ops.cat([t.reshape(-1) for t in tensors]), group)
        return [p.reshape(t.shape) for p, t in zip(ops.split(flat, [int(t.size) for t in tensors]), tensors)]

    @staticmethod
    def _reduce_scatter(tensors: list[Tensor], group: Group) -> list[Tensor]:
        """This rank's dim-0 chunk of each tensor summed over ``group``, as one flat reduce-scatter: the
        buffer is laid out rank-major, so each rank's chunks are one contiguous part."""
        by_rank = ops.cat([t.reshape(group.size, -1) for t in tensors], axis=1).reshape(-1)
        own = comm.reduce_scatter(by_rank, 0, group)
        sizes = [int(t.size) // group.size for t in tensors]
        return [part.reshape((t.shape[0] // group.size, *t.shape[1:]))
                for part, t in zip(ops.split(own, sizes), tensors)]

    def tensor_norms(self, grads: tuple[Tensor, ...]) -> np.ndarray:
        """The L2 norm of each reduced gradient over its whole tensor: a chunk's squared norm is summed over
        each group that cut it (FSDP's shard group, then tp or ep), a tensor held whole is counted once."""
        squares = np.square(tensor_norms(grads))
        for group, cut in self._sharded_norm_groups():
            cut = np.array(cut, dtype=bool)
            squares[cut] = comm.all_reduce_array(squares[cut], group)
        return np.sqrt(squares)

    def after_update(self) -> None:
        """ZeRO-1/2: every rank updated its chunks; gather them back into the replicated parameters."""
        if self.strategy == "optim_grads_params" or not self.sharded:
            return
        for domain in self._domains():
            names = [n for n in self.full if n in self.sharded and self.domain_of[n] is domain]
            if not names:
                continue
            fulls = gather_chunks([self.sharded[n].shard for n in names],
                                  [self.sharded[n].full_shape for n in names], domain.shard)
            for name, full in zip(names, fulls):
                ops.assign(self.full[name], full.astype(self.full[name].dtype))

    # ---- checkpoints ---------------------------------------------------------------------------------
    def layouts(self) -> dict[str, TensorLayout]:
        """The layout of every tensor of the model and its optimizer state that is cut: by tensor or expert
        parallelism, then (``self.sharded``) along dim 0 over its shard group (the experts': ``efsdp``), each
        rank keeping the part of its index there, replicas across ``dp_replicate``. FSDP cuts the optimizer state of a sharded parameter,
        and the parameter itself only under ZeRO-3. A master copy (``main_param.<name>``) of a parameter that
        trains in float32 here is laid out as the parameter, which it becomes when a low-precision checkpoint
        loads (trainer._masters_as_weights)."""
        dims = self.mesh.dims
        index_of_rank = {d.shard.name: tuple(dims.group_index(d.shard.name, r) for r in range(dims.world))
                         for d in self._domains()}
        out = {}
        for name, param in self.full.items():
            base = self.base_layouts.get(name) or TensorLayout.replicated(tuple(param.shape), dims.world)
            shard = self.domain_of[name].shard
            state = base.refine(0, shard.size, index_of_rank[shard.name]) if name in self.sharded else base
            weight = state if self.params_are_chunks else base
            out.update({name: weight, f"adam_m.{name}": state, f"adam_v.{name}": state,
                        f"main_param.{name}": weight if param.dtype == ms.float32 else state})
        return {key: layout for key, layout in out.items() if layout.is_sharded}

    def own_chunks(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's part of whole parameters (a Hugging Face import), as the model holds them."""
        layouts, rank = self.layouts(), self.mesh.rank
        return {k: a[layouts[k].chunk_slices(layouts[k].chunk_of_rank[rank])] if k in layouts else a
                for k, a in arrays.items()}

    @property
    def params_are_chunks(self) -> bool:
        return self.strategy == "optim_grads_params"

    def refresh_chunks(self) -> None:
        """ZeRO-1/2: after the replicated parameters were loaded, the optimizer's chunks are cut from them."""
        if self.params_are_chunks:
            return
        for name, sharded in self.sharded.items():
            sharded.shard.set_data(Tensor(_own_rows(self.full[name].asnumpy(), sharded.group)))


def _own_rows(tensor, group: Group):
    """This rank's dim-0 chunk over ``group`` of a whole tensor (MindSpore or numpy)."""
    rows = tensor.shape[0] // group.size
    return tensor[group.rank * rows:(group.rank + 1) * rows]
