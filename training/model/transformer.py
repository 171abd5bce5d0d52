"""The dense MLP, the transformer layer and the decoder block, each assembled from ModuleSpecs."""
from __future__ import annotations

from mindspore import Tensor, lazy_inline, nn, ops

from training.model.dropout import Dropout
from training.model.layers import Init, Linear, RMSNorm
from training.model.moe import MoELayer
from training.model.spec import ModuleSpec, build_module, check_tensor_parallel


class MLP(nn.Cell):
    """SwiGLU: fc2(silu(gate) * up), with gate/up interleaved in the rows of ``linear_fc1`` (row 2j is gate
    unit j, row 2j+1 up unit j: MindFormers' layout, kept in checkpoints and under tensor parallelism, where a
    rank's rows hold whole pairs). ``ffn_size`` defaults to model.intermediate_size (dense layers); shared
    experts pass their own. Under tensor parallelism ``ffn`` counts this rank's units."""

    def __init__(self, init: Init, config, ffn_size: int | None = None):
        super().__init__()
        self.ffn = ffn_size or config.intermediate_size
        # gate_up: the weight's rows reordered to [gate units; up units] before the matmul, so its output splits in
        # contiguous halves: slicing the interleaved output ([..., 0] / [..., 1]) makes strided copies of a
        # [tokens, 2·ffn] activation and of their gradients, the reorder a copy of the weight (figures:
        # docs/training.md, The model's ops)
        self.linear_fc1 = Linear(init, config.hidden_size, 2 * self.ffn, gate_up=True)
        self.linear_fc2 = Linear(init, self.ffn, config.hidden_size)

    def construct(self, x: Tensor) -> Tensor:
        gate, up = ops.split(self.linear_fc1(x), self.ffn, axis=-1)
        # silu written out: its backward then reuses the forward's sigmoid, where ops.silu's recomputes it
        return self.linear_fc2(gate * ops.sigmoid(gate) * up)

    @staticmethod
    def check_tensor_parallel(config, tp, ffn_size: int | None = None) -> None:
        tp.require_divisible(ffn_size or config.intermediate_size, "model.intermediate_size",
                             "linear_fc1/linear_fc2 split it")

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism: fc1 column-parallel (a rank's rows hold whole gate/up pairs), fc2 row-parallel."""
        tp.column_parallel(self.linear_fc1)
        tp.row_parallel(self.linear_fc2)
        self.ffn //= tp.size


class TransformerLayer(nn.Cell):
    """Pre-norm residual layer: x + dropout(attention(norm(x))), then + dropout(mlp(norm(x))) (dropout:
    model.hidden_dropout, as MindFormers places it); the attention and MLP classes come from the spec (GQA or
    MLA; dense MLP or MoE)."""

    # Compiled, the layers of one ``graph_key`` share one parsed and inferred graph, inlined for each at the front
    # end (MindSpore's lazy_inline; any device): the graph differs only in the Parameters it reads, and compiling
    # costs about half as much per layer, the same losses (python -m benchmarks.compile_time; docs/training.md, The
    # fast step). Eager steps are unaffected.
    @lazy_inline(attrs="graph_key", policy="front")
    def __init__(self, init: Init, config, self_attention: ModuleSpec, mlp: ModuleSpec):
        super().__init__()
        norm_dtype = config.dtype("layernorm_compute_dtype")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_dtype)
        self.self_attention = build_module(self_attention, init, config)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_dtype)
        self.mlp = build_module(mlp, init, config)
        self.hidden_dropout = Dropout(config.hidden_dropout)
        # a MoE layer returns its routing statistics with its output (MoELayer.construct)
        self.routed = isinstance(self.mlp, MoELayer)
        # what the layer's graph depends on. Nothing the forward writes may live outside its inputs and Parameters:
        # a shared graph would write the first layer's (seen, when MoE layers wrote their RoutingStats in the graph:
        # the load-balancing loss of three MoE layers counted one layer's). MoE layers return theirs (``run_layer``)
        self.graph_key = f"{config!r}|{self_attention!r}|{mlp!r}"

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor):
        """The layer's output; a MoE layer's with its routing statistics, (output, routing): ``run_layer``."""
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), cos, sin, mask))
        if not self.routed:
            return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))
        out, routing = self.mlp(self.pre_mlp_layernorm(x))
        return x + self.hidden_dropout(out), routing

    @staticmethod
    def check_tensor_parallel(config, tp, self_attention: ModuleSpec, mlp: ModuleSpec) -> None:
        check_tensor_parallel(self_attention, config, tp)
        check_tensor_parallel(mlp, config, tp)

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism: the attention's and the MLP's own cuts; the norms stay whole."""
        self.self_attention.parallelize_tensor(tp)
        self.mlp.parallelize_tensor(tp)


def run_layer(layer: TransformerLayer, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
    """The layer's output; a MoE layer's routing statistics go to its RoutingStats, written here, in the caller's
    graph, not in the one the layer shares with the others. (A function: a graph cannot call a Cell's ``self``.)
    A layer without ``routed`` (another model's) returns its output alone."""
    if not getattr(layer, "routed", False):
        return layer(x, cos, sin, mask)
    x, routing = layer(x, cos, sin, mask)
    layer.mlp.keep_routing(routing)
    return x


class TransformerBlock(nn.Cell):
    """The decoder: one layer per spec (global indices 0..n-1), then the final RMSNorm."""

    def __init__(self, init: Init, config, layer_specs: list[ModuleSpec]):
        super().__init__()
        self.layers = nn.CellList([build_module(spec, init, config) for spec in layer_specs])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype("layernorm_compute_dtype"))

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = run_layer(layer, x, cos, sin, mask)
        return self.final_layernorm(x)
