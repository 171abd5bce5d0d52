"""Data parallelism with sharded state: FSDP over the mesh's ``dp_shard`` group, HSDP replicas over
``dp_replicate`` (MindFormers' ``data_parallel_shard``; reference §6.2).

``data_parallel_shard_strategy`` picks what is sharded, each tensor cut along dim 0 into one even chunk per
``dp_shard`` rank (a tensor whose dim 0 does not divide stays replicated):

- ``optim`` (ZeRO-1): the optimizer state. Gradients are all-reduced whole; each rank updates its chunk of
  every parameter and the chunks are all-gathered back into the replicated parameters.
- ``optim_grads`` (ZeRO-2): also the gradients: reduce-scattered, so each rank keeps only its chunk.
- ``optim_grads_params`` (ZeRO-3): also the parameters: the model holds only its chunks, and each unit
  (a decoder layer, an MTP layer, the rest of the model) all-gathers its weights when it runs. The gather's
  backward is a reduce-scatter, so gradients arrive as this rank's chunk, summed over ``dp_shard``.

Every strategy computes the single-process update: the loss is the mean over the global batch, so gradients
are summed over the data-parallel ranks and the micro-batches and divided by their count (before the
reduction with ``disable_gradient_division``, MindFormers' default, after it otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.optim import tensor_norms
from training.parallel import comm
from training.parallel.layout import TensorLayout
from training.parallel.mesh import DeviceMesh


@dataclass
class _Sharded:
    """A parameter cut along dim 0 over ``dp_shard``: ``shard`` is this rank's chunk, the one the optimizer
    updates (for ZeRO-3 also the one the model holds)."""
    name: str
    full_shape: tuple[int, ...]
    shard: Parameter


class _UnitGather:
    """Wraps a unit's forward (ZeRO-3): all-gather the unit's parameter chunks in one collective, hand each
    full tensor to the layer that owns it for the duration of the call, then drop them.

    The full tensors are set as instance attributes over the (chunk) Parameters, which instance lookup
    finds first; autograd sees gather → layer ops, so the chunk's gradient is the gather's backward."""

    def __init__(self, forward, slots: list[tuple[nn.Cell, str, _Sharded]], group):
        self.forward, self.slots, self.group = forward, slots, group

    def __call__(self, *args, **kwargs):
        fulls = gather_chunks([s.shard for _, _, s in self.slots], [s.full_shape for _, _, s in self.slots],
                              self.group)
        for (cell, attr, _), full in zip(self.slots, fulls):
            cell.__dict__[attr] = full
        try:
            return self.forward(*args, **kwargs)
        finally:
            for cell, attr, _ in self.slots:
                del cell.__dict__[attr]


def gather_chunks(chunks: list[Tensor], full_shapes: list[tuple[int, ...]], group) -> list[Tensor]:
    """The full tensors of dim-0 ``chunks`` (one per tensor, this rank's), with ONE all-gather of their flat
    concatenation: a collective's fixed cost dominates for the small tensors of a layer."""
    sizes = [int(np.prod(c.shape)) for c in chunks]
    flat = ops.cat([c.reshape(-1) for c in chunks])
    gathered = comm.all_gather(flat, 0, group).reshape(group.size, -1)  # [rank, this rank's flat chunks]
    parts = ops.split(gathered, sizes, axis=1)
    return [part.reshape(shape) for part, shape in zip(parts, full_shapes)]


class DataParallel:
    """The data-parallel strategy of one run: which tensors the optimizer updates, how gradients are
    reduced, what the checkpoint layouts are. With ``dp_shard == 1`` nothing is sharded (plain data
    parallelism: gradients all-reduced, parameters replicated)."""

    def __init__(self, model: nn.Cell, mesh: DeviceMesh, strategy: str, divide_before_reduction: bool,
                 accumulation: int, unit_cells: list[nn.Cell]):
        self.model, self.mesh = model, mesh
        self.shard_group, self.replicate_group = mesh.group("dp_shard"), mesh.group("dp_replicate")
        self.dp_group = mesh.group("dp")
        self.strategy = strategy
        self.divide_before_reduction = divide_before_reduction
        self.accumulation = accumulation
        self.dp = self.dp_group.size
        shards = self.shard_group.size
        trainable = list(model.trainable_params())
        # ZeRO-3 cuts the model's own parameters, so only tensors it can cut evenly are sharded
        self.sharded: dict[str, _Sharded] = {}
        for param in trainable:
            if shards > 1 and param.shape and param.shape[0] % shards == 0:
                rows = param.shape[0] // shards
                start = self.shard_group.rank * rows
                chunk = Parameter(Tensor(param.asnumpy()[start:start + rows]), name=param.name)
                self.sharded[param.name] = _Sharded(param.name, tuple(param.shape), chunk)
        self.full = {p.name: p for p in trainable}
        if strategy == "optim_grads_params":
            self._shard_model(unit_cells)

    # ---- ZeRO-3: the model holds chunks ------------------------------------------------------------
    def _shard_model(self, unit_cells: list[nn.Cell]) -> None:
        """Replace every sharded Parameter of the model by its chunk, and make each unit gather its chunks
        when it runs. ``unit_cells`` are the units in nesting order, outermost (the model) first: a
        parameter belongs to the innermost unit holding it."""
        owner: dict[str, nn.Cell] = {}
        for unit in unit_cells:
            for param in unit.get_parameters():
                owner[param.name] = unit
        slots: dict[int, list] = {id(u): [] for u in unit_cells}
        for cell_name, cell in self.model.cells_and_names():
            for attr, param in list(cell._params.items()):
                if param is None or param.name not in self.sharded:
                    continue
                sharded = self.sharded[param.name]
                cell._params[attr] = sharded.shard
                slots[id(owner[param.name])].append((cell, attr, sharded))
        for unit in unit_cells:
            if slots[id(unit)]:
                unit.construct = _UnitGather(unit.construct, slots[id(unit)], self.shard_group)
                if unit is self.model and hasattr(unit, "logits"):
                    unit.logits = _UnitGather(unit.logits, slots[id(unit)], self.shard_group)

    # ---- what the trainer differentiates and updates -------------------------------------------------
    @property
    def model_params(self) -> list[Parameter]:
        """The tensors value_and_grad differentiates: the model's own (chunks under ZeRO-3)."""
        return list(self.model.trainable_params())

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
        out: list[Tensor | None] = [None] * len(grads)
        whole, cut, replicate_cut = [], [], []
        for i, (param, grad) in enumerate(zip(self.model_params, grads)):
            if param.name not in self.sharded:
                whole.append(i)
            elif self.strategy == "optim_grads_params":
                replicate_cut.append(i)  # the gather's backward already summed it over dp_shard
            else:
                cut.append(i)
        for i, reduced in zip(whole, self._all_reduce([grads[i] for i in whole], self.dp_group)):
            out[i] = reduced
        if cut:
            if self.strategy == "optim":  # ZeRO-1: the whole gradient is reduced, then this rank's chunk kept
                reduced = self._all_reduce([grads[i] for i in cut], self.dp_group)
                chunks = [self._own_rows(g) for g in reduced]
            else:  # ZeRO-2: only this rank's chunk is kept from the reduction
                chunks = self._reduce_scatter([grads[i] for i in cut])
                chunks = self._all_reduce(chunks, self.replicate_group)
            for i, chunk in zip(cut, chunks):
                out[i] = chunk
        for i, chunk in zip(replicate_cut, self._all_reduce([grads[i] for i in replicate_cut],
                                                             self.replicate_group)):
            out[i] = chunk
        if not self.divide_before_reduction:
            out = [g * (1.0 / self.dp) for g in out]
        return tuple(out)

    def _own_rows(self, tensor: Tensor) -> Tensor:
        rows = tensor.shape[0] // self.shard_group.size
        return tensor[self.shard_group.rank * rows:(self.shard_group.rank + 1) * rows]

    @staticmethod
    def _all_reduce(tensors: list[Tensor], group) -> list[Tensor]:
        """Sums over ``group`` as one flat all-reduce (the identity on a group of one)."""
        if not tensors or group.size == 1:
            return list(tensors)
        flat = comm.all_reduce(ops.cat([t.reshape(-1) for t in tensors]), group)
        return [p.reshape(t.shape) for p, t in zip(ops.split(flat, [int(t.size) for t in tensors]), tensors)]

    def _reduce_scatter(self, tensors: list[Tensor]) -> list[Tensor]:
        """This rank's dim-0 chunk of each tensor summed over ``dp_shard``, as one flat reduce-scatter: the
        buffer is laid out rank-major, so each rank's chunks are one contiguous part."""
        group = self.shard_group
        by_rank = ops.cat([t.reshape(group.size, -1) for t in tensors], axis=1).reshape(-1)
        own = comm.reduce_scatter(by_rank, 0, group)
        sizes = [int(t.size) // group.size for t in tensors]
        return [part.reshape((t.shape[0] // group.size, *t.shape[1:]))
                for part, t in zip(ops.split(own, sizes), tensors)]

    def tensor_norms(self, grads: tuple[Tensor, ...]) -> np.ndarray:
        """The L2 norm of each reduced gradient over its whole tensor: a chunk's squared norm is summed over
        ``dp_shard`` (one all-reduce of the vector), a whole tensor's is its own."""
        squares = np.square(tensor_norms(grads))
        sharded = np.array([name in self.sharded for name, _ in self.optimizer_params], dtype=bool)
        if sharded.any():
            squares[sharded] = comm.all_reduce_array(squares[sharded], self.shard_group)
        return np.sqrt(squares)

    def after_update(self) -> None:
        """ZeRO-1/2: every rank updated its chunks; gather them back into the replicated parameters."""
        if self.strategy == "optim_grads_params" or not self.sharded:
            return
        names = [n for n in self.full if n in self.sharded]
        fulls = gather_chunks([self.sharded[n].shard for n in names], [self.sharded[n].full_shape for n in names],
                              self.shard_group)
        for name, full in zip(names, fulls):
            ops.assign(self.full[name], full.astype(self.full[name].dtype))

    def full_weights(self) -> dict[str, np.ndarray]:
        """Every parameter of the model whole (collective under ZeRO-3, whose chunks are gathered)."""
        weights = {p.name: p.asnumpy() for p in self.model.get_parameters()}
        if self.strategy == "optim_grads_params" and self.sharded:
            names = list(self.sharded)
            fulls = gather_chunks([self.sharded[n].shard for n in names], [self.sharded[n].full_shape for n in names],
                                  self.shard_group)
            weights.update({name: full.asnumpy() for name, full in zip(names, fulls)})
        return weights

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _sharded_param_of(self, key: str) -> str | None:
        """The sharded parameter a state tensor is cut like: the parameter itself, or its optimizer state
        (``adam_m.<name>``, ``adam_v.<name>``, ``main_param.<name>``)."""
        if key in self.sharded:
            return key
        _, _, name = key.partition(".")
        return name if name in self.sharded else None

    def gather_state(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Whole tensors from this rank's (collective): the chunks of sharded ones are gathered."""
        keys = sorted(k for k in arrays if self._sharded_param_of(k) is not None
                      and arrays[k].shape != self.sharded[self._sharded_param_of(k)].full_shape)
        if not keys:
            return dict(arrays)
        fulls = gather_chunks([Tensor(arrays[k]) for k in keys],
                              [self.sharded[self._sharded_param_of(k)].full_shape for k in keys], self.shard_group)
        return {**arrays, **{k: full.asnumpy() for k, full in zip(keys, fulls)}}

    def own_chunks(self, arrays: dict[str, np.ndarray], holds_chunks: bool) -> dict[str, np.ndarray]:
        """This rank's part of whole tensors: its dim-0 chunk of every sharded one when ``holds_chunks``
        (optimizer state, and ZeRO-3's parameters), the tensor itself otherwise."""
        return {k: self._own_rows_array(a) if holds_chunks and self._sharded_param_of(k) is not None else a
                for k, a in arrays.items()}

    def full_shape(self, param: Parameter) -> tuple[int, ...]:
        """The whole shape of a model parameter (of which ZeRO-3's model holds a chunk)."""
        return self.sharded[param.name].full_shape if param.name in self.sharded else tuple(param.shape)

    @property
    def params_are_chunks(self) -> bool:
        return self.strategy == "optim_grads_params"

    def refresh_chunks(self) -> None:
        """ZeRO-1/2: after the replicated parameters were loaded, the optimizer's chunks are cut from them."""
        if self.params_are_chunks:
            return
        for name, sharded in self.sharded.items():
            sharded.shard.set_data(Tensor(self._own_rows_array(self.full[name].asnumpy())))

    def _own_rows_array(self, array: np.ndarray) -> np.ndarray:
        rows = array.shape[0] // self.shard_group.size
        return array[self.shard_group.rank * rows:(self.shard_group.rank + 1) * rows]

    def layouts(self) -> dict[str, TensorLayout]:
        """Every sharded tensor's layout: dim 0 cut over ``dp_shard``, each rank holding the chunk of its
        ``dp_shard`` coordinate, replicas across ``dp_replicate``."""
        chunk_of_rank = tuple(self.mesh.dims.coords(r)["dp_shard"] for r in range(self.mesh.dims.world))
        return {name: TensorLayout.split(s.full_shape, 0, chunk_of_rank, self.shard_group.size)
                for name, s in self.sharded.items()}
