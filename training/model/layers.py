"""Building blocks shared by every model: seeded init, linear, RMSNorm, embeddings, rotary tables,
attention masks, the max-logit tracker and the token loss. Activations are [batch, seq, hidden];
Linear weights are stored [out, in]."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

# MindFormers' spellings, short ones included
DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float16": ms.float16,
          "fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}
DTYPE_FIELDS = ("compute_dtype", "params_dtype", "layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype")


class Init:
    """Deterministic parameter initializer: every tensor comes from one seeded numpy RandomState,
    drawn in construction order, so a seed gives the same weights in every process."""

    def __init__(self, seed: int, std: float):
        self.rng = np.random.RandomState(seed)
        self.std = std

    def normal(self, *shape: int) -> Parameter:
        return Parameter(Tensor(self.rng.normal(0.0, self.std, shape).astype(np.float32)))

    @staticmethod
    def ones(*shape: int) -> Parameter:
        return Parameter(Tensor(np.ones(shape, np.float32)))

    @staticmethod
    def zeros(*shape: int) -> Parameter:
        return Parameter(Tensor(np.zeros(shape, np.float32)))


def cast(x: Tensor, dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


_matmul = ops.MatMul()
_matmul_transpose_a = ops.MatMul(transpose_a=True)
_matmul_transpose_b = ops.MatMul(transpose_b=True)


def expand(x: Tensor, like: Tensor) -> Tensor:
    """``x`` repeated to ``like``'s shape (broadcasting rules), for an elementwise op with ``like``. On CPU an
    elementwise kernel whose operands' shapes differ (other than by a scalar) keeps two int64 index maps of its
    output's size for as long as its graph lives, 16 bytes per element per graph node, and it runs slower than Tile
    and the same op on equal shapes (BroadcastTo instead of Tile: slower still for [rows, 1] -> [rows, width];
    figures: docs/training.md, The model's ops)."""
    padding = like.ndim - x.ndim
    repeats = ()
    for axis in range(like.ndim):
        repeats += (like.shape[axis] if axis < padding else like.shape[axis] // x.shape[axis - padding],)
    return ops.tile(x, repeats)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) for weight [out, in]. Flattened to 2-D: MindSpore's CPU MatMul with
    transpose_b is about twice as fast as ops.dense on a 3-D input."""
    out = _matmul_transpose_b(x.reshape(-1, x.shape[-1]), cast(weight, x.dtype))
    if bias is not None:
        out = out + cast(bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def heads_first(x: Tensor) -> Tensor:
    """[batch, seq, heads, dim] → [batch, heads, seq, dim]: the heads unstacked and stacked again rather than
    transposed. In a compiled graph on CPU a Transpose node keeps an int64 index map of its output's size for as
    long as the graph lives; Unstack and Stack keep none. They copy twice, which shows at long sequences
    (docs/training.md, the table of the model's ops: the figures)."""
    return ops.stack(ops.unstack(x, axis=2), axis=1)


def merge_heads(x: Tensor) -> Tensor:
    """[batch, heads, seq, dim] → [batch, seq, heads·dim], the heads concatenated (``heads_first``' reason)."""
    return ops.cat(ops.unstack(x, axis=1), axis=-1)


def gate_up_halves(weight: Tensor) -> Tensor:
    """An MLP's fc1 weight with its rows in gate/up pairs (row 2j gate unit j, row 2j+1 up unit j: MindFormers'
    layout) reordered to [gate units; up units], so the product's output splits in contiguous halves. The even and
    odd rows concatenated, not the weight transposed: in a compiled graph on CPU a Transpose node keeps an int64
    index map of its output's size as long as the graph lives (docs/training.md, The model's ops)."""
    return ops.cat((weight[0::2], weight[1::2]))


def gate_up_pairs(halves: Tensor) -> Tensor:
    """The inverse of ``gate_up_halves``: [gate units; up units] rows back into pairs (a gradient's)."""
    gate, up = ops.split(halves, halves.shape[0] // 2)
    return ops.stack((gate, up), axis=1).reshape(halves.shape)


class Linear(nn.Cell):
    """``input_comm``/``output_comm`` (None: none) are the collectives tensor parallelism puts around the
    matmul: a column-parallel linear gathers its input, a row-parallel one reduces its partial output.

    ``gate_up``: the rows hold an MLP's gate/up pairs, and the output comes as [gate units | up units]
    (``gate_up_halves``). ``weight_gather``/``bias_gather`` (None: the Parameters are whole) are what ZeRO-3
    puts here when the step compiles and the Parameters hold this rank's rows only: the product of x with
    the gathered weight (training.parallel.fsdp.GatheredMatrix) and the gathered bias."""

    def __init__(self, init: Init, in_features: int, out_features: int, bias: bool = False, gate_up: bool = False):
        super().__init__()
        if bias and gate_up:
            raise ValueError("a gate/up linear has no bias (its halves would need the bias reordered too)")
        self.weight = init.normal(out_features, in_features)
        self.bias = init.zeros(out_features) if bias else None
        self.gate_up = gate_up
        self.input_comm = None
        self.output_comm = None
        self.weight_gather = None
        self.bias_gather = None

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        """ZeRO-3 in a compiled step (``gathers``: training.parallel.fsdp.WeightGathers): the product with the
        gathered weight (its rows put in gate/up halves for the product, the gradient's back in pairs), the bias
        gathered whole."""
        if attr == "bias":
            return {"bias_gather": gathers.whole()}
        return {"weight_gather": gathers.matrix(gate_up_halves, gate_up_pairs) if self.gate_up else gathers.matrix()}

    def construct(self, x: Tensor) -> Tensor:
        if self.input_comm is not None:
            x = self.input_comm(x)
        if self.weight_gather is None:
            out = linear(x, gate_up_halves(self.weight) if self.gate_up else self.weight, self.bias)
        else:
            out = self.weight_gather(x, self.weight)
            if self.bias is not None:
                out = out + cast(self.bias_gather(self.bias), out.dtype)
        return out if self.output_comm is None else self.output_comm(out)


def _row_sums(x: Tensor) -> Tensor:
    """Sums over the last axis, keeping it (size 1), as a matmul against a ones vector: MindSpore's CPU
    ReduceSum is several times slower than its MatMul on the same rows (figures: docs/training.md, The model's ops)."""
    width = x.shape[-1]
    sums = _matmul(x.reshape(-1, width), ops.ones((width, 1), x.dtype))
    return sums.reshape(*x.shape[:-1], 1)


class RMSNormFunction(nn.Cell):
    """x / rms(x) · weight over the last axis (``weight`` broadcasting against x's trailing axes), with a
    hand-written backward: autodiff of the rsqrt/mean form costs a ReduceSum/ReduceMean per use and its grad,
    a noticeable part of the throughput benchmark's step. Inputs and output in one dtype."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def _normalized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        inverse_rms = expand(ops.rsqrt(_row_sums(x * x) / x.shape[-1] + self.eps), x)
        return x * inverse_rms, inverse_rms

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        return self._normalized(x)[0] * expand(weight, x)

    def bprop(self, x: Tensor, weight: Tensor, out: Tensor, dout: Tensor):
        normed, inverse_rms = self._normalized(x)
        d_normed = dout * expand(weight, x)
        dx = inverse_rms * (d_normed - normed * expand(_row_sums(d_normed * normed) / x.shape[-1], x))
        # the weight's gradient: dout·normed summed over every row the weight was broadcast to
        rows = (dout * normed).reshape(-1, weight.size)
        dweight = _matmul_transpose_a(rows, ops.ones((rows.shape[0], 1), rows.dtype)).reshape(weight.shape)
        return dx, dweight


class RMSNorm(nn.Cell):
    """RMSNorm over the last axis, computed in ``dtype`` (model.layernorm_compute_dtype) and returned in the
    input's dtype. Hand-written (RMSNormFunction): CPU has no rms_norm kernel. float16 is honoured but
    fragile: rsqrt overflows for small activations, which is why MindFormers' configs keep norms in fp32."""

    def __init__(self, dim: int, eps: float, dtype=ms.float32):
        super().__init__()
        self.weight = Init.ones(dim)
        self.eps = eps
        self.dtype = dtype
        self.function = RMSNormFunction(eps)
        self.weight_gather = None  # ZeRO-3 in a compiled step: the weight gathered from this rank's chunk

    def construct(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.full_weight())

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        """ZeRO-3 in a compiled step: the weight gathered whole (a few KB)."""
        return {"weight_gather": gathers.whole()}

    def full_weight(self) -> Tensor:
        return self.weight if self.weight_gather is None else self.weight_gather(self.weight)

    def normalize(self, x: Tensor, weight: Tensor) -> Tensor:
        """This norm with another ``weight`` broadcasting against x's trailing axes (attention's q/k norms)."""
        return cast(self.function(cast(x, self.dtype), cast(weight, self.dtype)), x.dtype)


class VocabEmbedding(nn.Cell):
    """The [vocab, hidden] lookup table. Under tensor parallelism the table holds the ``vocab_rows`` rows from
    ``vocab_start`` only: other ids look up zeros and ``output_comm`` sums the ranks' lookups.
    ``weight_gather``/``output_gather`` (None: the table is whole) are what ZeRO-3 puts here when the step
    compiles and the table holds this rank's rows only: the lookup and the tied output layer's product from the
    gathered table (training.parallel.fsdp.GatheredRows, GatheredMatrix)."""

    def __init__(self, init: Init, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = init.normal(vocab_size, hidden_size)
        self.vocab_start = 0
        self.vocab_rows = vocab_size  # not the weight's shape: under ZeRO-3 in a graph the weight is a chunk
        self.output_comm = None
        self.weight_gather = None
        self.output_gather = None
        self.is_output_layer = False  # the model's output layer is tied to this table (its owner says)

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism: this rank's rows of the vocabulary; the ranks' lookups summed."""
        tp.cut(self, "weight", 0)
        self.vocab_rows = self.weight.shape[0]
        self.vocab_start = tp.rank * self.vocab_rows
        self.output_comm = tp.leave

    def gathered_weights(self, attr: str, gathers) -> dict[str, nn.Cell]:
        """ZeRO-3 in a compiled step: the lookup from the gathered rows, and the tied output layer's product."""
        tied = {"output_gather": gathers.matrix()} if self.is_output_layer else {}
        return {"weight_gather": gathers.rows(), **tied}

    def construct(self, input_ids: Tensor) -> Tensor:
        if self.output_comm is None:
            return self._rows(input_ids)
        local_ids = input_ids - self.vocab_start
        here = ops.logical_and(local_ids >= 0, local_ids < self.vocab_rows)
        rows = self._rows(ops.where(here, local_ids, 0))
        return self.output_comm(rows * here.expand_dims(-1).astype(rows.dtype))

    def _rows(self, ids: Tensor) -> Tensor:
        return ops.gather(self.weight, ids, 0) if self.weight_gather is None else self.weight_gather(self.weight, ids)

    def as_output_layer(self, hidden: Tensor) -> Tensor:
        """hidden @ table.T: the logits of a model whose output layer is this table (tied)."""
        return linear(hidden, self.weight) if self.output_gather is None else self.output_gather(hidden, self.weight)


class LanguageModelEmbedding(nn.Cell):
    """Holds ``word_embeddings`` so the table is named ``embedding.word_embeddings.weight`` as in Megatron."""

    def __init__(self, init: Init, vocab_size: int, hidden_size: int):
        super().__init__()
        self.word_embeddings = VocabEmbedding(init, vocab_size, hidden_size)

    def construct(self, input_ids: Tensor) -> Tensor:
        return self.word_embeddings(input_ids)


class RotaryEmbedding:
    """cos/sin tables for RoPE in HF's rotate-half convention (frequencies duplicated across both halves).

    HF computes x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1]; the sign is baked into the
    first half of the sin table here, so applying it needs only [x2, x1] (one op fewer per call)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype=ms.float32,
                 inv_freq: np.ndarray | None = None, magnitude: float = 1.0):
        """Tables are computed in float64 and stored in ``dtype`` (model.rotary_dtype), the dtype
        ``apply_rotary`` then works in. ``inv_freq`` (head_dim/2 frequencies) replaces the plain
        theta^(-2i/d) ones and ``magnitude`` scales both tables (YaRN, see ``yarn_parameters``)."""
        if inv_freq is None:
            inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [positions, head_dim/2]
        cos = np.cos(np.concatenate([angles, angles], axis=-1)) * magnitude
        signed_sin = np.sin(np.concatenate([-angles, angles], axis=-1)) * magnitude
        self.cos = cast(Tensor(cos.astype(np.float32)), dtype)
        self.signed_sin = cast(Tensor(signed_sin.astype(np.float32)), dtype)

    def tables(self, seq_len: int, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """[seq, head_dim] for positions 0..seq-1, or [batch, 1, seq, head_dim] for explicit per-sample
        ``position_ids`` [batch, seq] (positions restarting at document boundaries)."""
        if position_ids is None:
            return self.cos[:seq_len], self.signed_sin[:seq_len]
        return (ops.gather(self.cos, position_ids, 0).expand_dims(1),
                ops.gather(self.signed_sin, position_ids, 0).expand_dims(1))


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x: [..., seq, head_dim]; cos/signed_sin: [seq, head_dim] from RotaryEmbedding. Done in the tables'
    dtype (model.rotary_dtype), returned in x's."""
    xr = cast(x, cos.dtype)
    first, second = ops.chunk(xr, 2, axis=-1)
    return cast(xr * expand(cos, xr) + ops.cat((second, first), axis=-1) * expand(signed_sin, xr), x.dtype)


def causal_mask(seq_len: int, repeats: int = 1) -> Tensor:
    """Additive mask, 0 where a query may attend (itself and earlier positions) and a huge negative for
    future positions: [seq, seq], stacked ``repeats`` times along the query axis → [repeats·seq, seq]."""
    future = np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)
    mask = np.where(future, np.finfo(np.float32).min, 0.0).astype(np.float32)
    return Tensor(np.tile(mask, (repeats, 1)))


def additive_mask(attention_mask: Tensor, repeats: int = 1) -> Tensor:
    """Per-sample masks as the dataset gives them ([batch, 1, seq, seq], 1 = masked, e.g. block-causal
    at document ends) → additive [batch, 1, repeats·seq, seq], stacked like ``causal_mask``."""
    additive = cast(attention_mask, ms.float32) * float(np.finfo(np.float32).min)
    return ops.tile(additive, (1, 1, repeats, 1))


class MaxLogitTracker:
    """Running per-head maximum of an attention layer's scaled QKᵀ over unmasked positions (masked
    scores sit near float32 min, and every query sees at least itself), for MaxLogits monitoring.
    A plain object, not a Cell attribute tensor, so it stays out of the graph and the gradients. Under
    tensor parallelism ``heads_comm`` gathers the other ranks' heads when popping (a collective: every rank
    pops)."""

    def __init__(self):
        self.enabled = False
        self.running_max: Tensor | None = None
        self.heads_comm = None

    def update(self, scores: Tensor) -> None:
        """scores: [batch, groups, heads_per_group, ...] → max per head (group-major, as HF numbers heads)."""
        heads = ops.stop_gradient(scores).amax(axis=(0, 3)).reshape(-1)
        self.running_max = heads if self.running_max is None else ops.maximum(self.running_max, heads)

    def pop(self) -> np.ndarray | None:
        out = self.running_max
        self.running_max = None
        if out is None:
            return None
        return (out if self.heads_comm is None else self.heads_comm(out)).asnumpy()


class Softmax(nn.Cell):
    """Softmax over the last axis with a hand-written backward y·(dy − Σ dy·y), its row sums as a matmul:
    MindSpore's own Softmax gradient took about twice as long (compiled) on the benchmark's attention (figures:
    docs/training.md, The model's ops)."""

    def construct(self, x: Tensor) -> Tensor:
        return ops.softmax(x, axis=-1)

    def bprop(self, x: Tensor, out: Tensor, dout: Tensor):
        return (out * (dout - expand(_row_sums(dout * out), out)),)


_bmm = ops.BatchMatMul()
_bmm_transpose_b = ops.BatchMatMul(transpose_b=True)


def token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token -log p(label) for logits [tokens, vocab] and labels [tokens].

    log_softmax + gather: on CPU, MindSpore 2.10's ops.cross_entropy is many times slower forward and backward
    than this (figures: docs/training.md, The model's ops), and mint's has no CPU kernel."""
    log_probs = ops.log_softmax(logits, -1)
    return -ops.gather_elements(log_probs, 1, labels.reshape(-1, 1)).reshape(-1)
