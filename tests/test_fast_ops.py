"""The model's hand-written backward passes (RMSNorm, softmax), the SwiGLU weight reorder and the causal attention
in query blocks, each against central finite differences of its own forward in float64."""
from types import SimpleNamespace

import mindspore as ms
import numpy as np
from mindspore import Tensor

from training.model import attention
from training.model.attention import SelfAttention
from training.model.layers import Init, RMSNormFunction, Softmax, additive_mask
from training.model.transformer import MLP
from training.optim import clip_grad_norm_in_graph

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")


def finite_differences(loss, arrays: list[np.ndarray], step: float = 1e-6) -> list[np.ndarray]:
    """d loss / d each array, by central differences of ``loss(*arrays) -> float``."""
    grads = []
    for array in arrays:
        grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            saved = array[index]
            array[index] = saved + step
            up = loss(*arrays)
            array[index] = saved - step
            down = loss(*arrays)
            array[index] = saved
            grad[index] = (up - down) / (2 * step)
        grads.append(grad)
    return grads


def check_gradients(function, arrays: list[np.ndarray], seed: int = 0) -> None:
    """MindSpore's gradients of sum(function(...) · R) (R random, so every output element counts differently)
    against finite differences of the same function."""
    out_shape = function(*(Tensor(a) for a in arrays)).shape
    weights = Tensor(np.random.default_rng(seed).standard_normal(out_shape))

    def loss(*tensors):
        return (function(*tensors) * weights).sum()

    analytic = ms.grad(loss, grad_position=tuple(range(len(arrays))))(*(Tensor(a) for a in arrays))
    analytic = analytic if isinstance(analytic, tuple) else (analytic,)
    numeric = finite_differences(lambda *a: float(loss(*(Tensor(x) for x in a)).asnumpy()), arrays)
    for got, expected in zip(analytic, numeric):
        np.testing.assert_allclose(got.asnumpy(), expected, rtol=1e-6, atol=1e-7)


def test_rms_norm_backward_matches_finite_differences_with_a_broadcast_weight():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 3, 4))
    weight = rng.standard_normal((3, 4))  # attention's per-slot q/k norm weights broadcast over batch and seq
    check_gradients(RMSNormFunction(1e-6), [x, weight])
    # and the plain [hidden] weight of a layer norm
    check_gradients(RMSNormFunction(1e-6), [x[0, 0], weight[0]])


def test_softmax_backward_matches_finite_differences_under_a_causal_mask():
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((2, 2, 4, 4))
    mask = np.where(np.triu(np.ones((4, 4), bool), k=1), np.finfo(np.float32).min, 0.0)
    check_gradients(lambda s: Softmax()(s + Tensor(mask)), [scores])


def test_swiglu_reorders_the_interleaved_fc1_rows():
    """linear_fc1 keeps MindFormers' interleaved rows (row 2j gate unit j, 2j+1 up unit j): the output is
    fc2(silu(x·gateᵀ) · x·upᵀ) with those rows, and the weight's gradient reaches the interleaved rows."""
    config = SimpleNamespace(hidden_size=4, intermediate_size=3)
    mlp = MLP(Init(0, 0.5), config)
    for param in mlp.get_parameters():
        param.set_dtype(ms.float64)
    fc2 = mlp.linear_fc2.weight.asnumpy().astype(np.float64)
    rng = np.random.default_rng(3)
    x, fc1 = rng.standard_normal((2, 3, 4)), rng.standard_normal((6, 4))

    mlp.linear_fc2.weight.set_data(Tensor(fc2))
    weight = mlp.linear_fc1.weight
    weight.set_data(Tensor(fc1))
    gate, up = x @ fc1[0::2].T, x @ fc1[1::2].T
    expected = (gate / (1 + np.exp(-gate)) * up) @ fc2.T
    np.testing.assert_allclose(mlp(Tensor(x)).asnumpy(), expected, rtol=1e-12)

    check_gradients(mlp, [x])
    projection = Tensor(rng.standard_normal(expected.shape))
    loss = lambda: (mlp(Tensor(x)) * projection).sum()  # noqa: E731
    analytic = ms.grad(loss, grad_position=None, weights=[weight])()[0].asnumpy()

    def loss_at(fc1):
        weight.set_data(Tensor(fc1))
        return float(loss().asnumpy())

    np.testing.assert_allclose(analytic, finite_differences(loss_at, [fc1.copy()])[0], rtol=1e-6, atol=1e-7)


def test_short_sequences_run_as_one_query_block():
    assert [attention.query_blocks(seq) for seq in (8, 32, 64, 100, 128, 512)] == [1, 1, 1, 1, 4, 4]


def test_causal_attention_in_query_blocks_is_the_full_masked_softmax(monkeypatch):
    """Query blocks read only the keys up to their end: output equal to softmax(q·kᵀ + mask)·v over all keys
    (numpy), and gradients equal to finite differences, under a per-sample block-causal mask (a document
    starting inside a block) with two q heads stacked on their KV group."""
    monkeypatch.setattr(attention, "MIN_QUERY_BLOCK_ROWS", 2)
    batch, groups, per_group, seq, dim = 1, 1, 2, 8, 2  # 4 blocks of 2 queries
    assert attention.query_blocks(seq) == 4
    config = SimpleNamespace(num_attention_heads=groups * per_group, num_key_value_heads=groups, head_dim=dim,
                             hidden_size=4, attention_bias=False, rms_norm_eps=1e-6, use_flash_attention=False,
                             dtype=lambda name: ms.float64)
    layer = SelfAttention(Init(0, 0.1), config)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((batch, groups, per_group, seq, dim))
    k, v = rng.standard_normal((2, batch, groups, seq, dim))
    masked = np.triu(np.ones((batch, seq, seq), bool), k=1)
    masked[:, 3:, :3] = True  # a document starts at position 3
    mask = additive_mask(Tensor(masked[:, None].astype(np.float32)), per_group)

    scores = np.einsum("bgpqd,bgkd->bgpqk", q, k) + np.where(masked, np.finfo(np.float32).min, 0.0)[:, None, None]
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bgpqk,bgkd->bgpqd", probs / probs.sum(-1, keepdims=True), v)
    got = layer._causal_attention(Tensor(q), Tensor(k), Tensor(v), mask).asnumpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    check_gradients(lambda q, k, v: layer._causal_attention(q, k, v, mask), [q, k, v])


def test_the_compiled_clip_sums_squares_and_scales_like_numpy():
    """clip_grad_norm_in_graph's sums of squares (row sums as matmuls against ones) under mindspore.jit, for a
    matrix, a vector and a 3-D gradient, against float64 numpy; the clipped gradients are scaled by
    max_norm / (norm + 1e-6), and a norm under max_norm leaves them as they were (one graph serves both)."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((6, 5), (7,), (2, 3, 4))]
    squares64 = np.array([np.sum(a.astype(np.float64) ** 2) for a in arrays])
    norm = float(np.sqrt(squares64.sum()))

    @ms.jit
    def clip(*grads):
        return clip_grad_norm_in_graph(grads, 1.0)

    clipped, squares, total = clip(*(Tensor(a) for a in arrays))
    np.testing.assert_allclose(squares.asnumpy(), squares64, rtol=1e-6)
    np.testing.assert_allclose(float(total.asnumpy()), norm, rtol=1e-6)
    for got, array in zip(clipped, arrays):
        np.testing.assert_allclose(got.asnumpy(), array * (1.0 / (norm + 1e-6)), rtol=1e-6)
    small = [a / np.float32(2 * norm) for a in arrays]
    unclipped, _, _ = clip(*(Tensor(a) for a in small))
    assert all(np.array_equal(got.asnumpy(), array) for got, array in zip(unclipped, small))
