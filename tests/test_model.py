"""Qwen3 GPTModel: parameter layout, numerics against an independent numpy Qwen3, causality, config errors."""
import math
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from training.config import ConfigError
from training.model import Qwen3Config, build_model
from training.model.qwen3 import DTYPES, GPTModel

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, seq_length=32, max_position_embeddings=64, compute_dtype="float32",
            hidden_dropout=0.0)
SECTION = dict(model_type="qwen3", architectures="Qwen3ForCausalLM", **TINY)


def tiny_model(seed=0, **overrides) -> GPTModel:
    return GPTModel(Qwen3Config.from_dict({**TINY, **overrides}), seed=seed)


def random_ids(batch=2, seq=32, seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, TINY["vocab_size"], (batch, seq)).astype(np.int32)


def expected_shapes(tied: bool, bias: bool = False) -> dict:
    hidden, ffn, vocab, dim = 64, 96, 256, 16
    qkv_rows = 2 * (2 + 2) * dim  # 2 KV groups × (2 q heads + k + v) × head_dim
    shapes = {"embedding.word_embeddings.weight": (vocab, hidden)}
    for i in range(2):
        prefix = f"decoder.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "self_attention.linear_qkv.weight"] = (qkv_rows, hidden)
        if bias:
            shapes[prefix + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        shapes[prefix + "self_attention.q_layernorm.weight"] = (dim,)
        shapes[prefix + "self_attention.k_layernorm.weight"] = (dim,)
        shapes[prefix + "self_attention.linear_proj.weight"] = (hidden, 4 * dim)
        shapes[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
        shapes[prefix + "mlp.linear_fc1.weight"] = (2 * ffn, hidden)
        shapes[prefix + "mlp.linear_fc2.weight"] = (hidden, ffn)
    shapes["decoder.final_layernorm.weight"] = (hidden,)
    if not tied:
        shapes["output_layer.weight"] = (vocab, hidden)
    return shapes


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_and_shapes(tied):
    model = tiny_model(tie_word_embeddings=tied)
    named = list(model.parameters_and_names())
    assert {name: tuple(p.shape) for name, p in named} == expected_shapes(tied)
    assert [p.name for _, p in named] == [name for name, _ in named]
    assert model.num_parameters() == sum(math.prod(s) for s in expected_shapes(tied).values())


def test_attention_bias_adds_qkv_bias():
    names = {name: tuple(p.shape) for name, p in tiny_model(attention_bias=True).parameters_and_names()}
    assert names == expected_shapes(tied=False, bias=True)


def test_untrained_loss_is_about_ln_vocab():
    model = tiny_model()
    ids = random_ids()
    loss = float(model(Tensor(ids), Tensor(ids), Tensor(np.ones(ids.shape, np.float32))).asnumpy())
    assert abs(loss - math.log(256)) < 0.2


def test_loss_mask_weights_tokens():
    model = tiny_model()
    ids = random_ids()
    logits = model.logits(Tensor(ids)).asnumpy().astype(np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    token_loss = -np.take_along_axis(log_probs, ids[..., None], -1)[..., 0]
    mask = np.zeros(ids.shape, np.float32)
    mask[:, 5:9] = 1
    loss = float(model(Tensor(ids), Tensor(ids), Tensor(mask)).asnumpy())
    assert loss == pytest.approx((token_loss * mask).sum() / mask.sum(), rel=1e-5)
    assert float(model(Tensor(ids), Tensor(ids), Tensor(np.zeros_like(mask))).asnumpy()) == 0.0


def test_causality():
    model = tiny_model()
    ids = random_ids(batch=1)
    changed = ids.copy()
    t = 20
    changed[0, t] = (changed[0, t] + 1) % 256
    before, after = model.logits(Tensor(ids)).asnumpy(), model.logits(Tensor(changed)).asnumpy()
    np.testing.assert_array_equal(before[:, :t], after[:, :t])
    assert not np.allclose(before[:, t:], after[:, t:])


def test_packed_documents_with_reset_positions_and_block_mask_match_separate_runs():
    """Two documents packed in one sequence, positions restarting and attention stopping at the boundary,
    give each document exactly the logits it gets alone: what reset_position_ids + reset_attention_mask mean."""
    from training.data.gpt_dataset import sample_item

    model = tiny_model()
    first, second = random_ids(1, 12, seed=1)[0], random_ids(1, 20, seed=2)[0]
    first[-1] = 2  # EOD ends the first document
    item = sample_item(np.concatenate([first, second, [0]]), eod_id=2, reset_position_ids=True,
                       reset_attention_mask=True, create_attention_mask=True)
    packed = model.logits(Tensor(item["input_ids"][None]), Tensor(item["position_ids"][None]),
                          Tensor(item["attention_mask"][None])).asnumpy()[0]
    alone = [model.logits(Tensor(doc[None])).asnumpy()[0] for doc in (first, second)]
    np.testing.assert_allclose(packed[:12], alone[0], atol=1e-4)
    np.testing.assert_allclose(packed[12:], alone[1], atol=1e-4)
    # and without the reset, the second document does see the first
    plain = model.logits(Tensor(item["input_ids"][None])).asnumpy()[0]
    assert np.abs(plain[12:] - alone[1]).max() > 1e-3


def test_rope_is_applied():
    # rotation is the identity at position 0, so only later positions feel rope_theta
    ids = Tensor(random_ids(batch=1))
    a, b = tiny_model(rope_theta=1e6).logits(ids).asnumpy(), tiny_model(rope_theta=10.0).logits(ids).asnumpy()
    np.testing.assert_allclose(a[:, 0], b[:, 0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 1:], b[:, 1:], atol=1e-4)


@pytest.mark.parametrize("norm", ["q_layernorm", "k_layernorm"])
def test_qk_norm_is_applied(norm):
    # position 0 attends only to itself, so its output does not depend on q or k
    model = tiny_model()
    ids = Tensor(random_ids(batch=1))
    before = model.logits(ids).asnumpy()
    weight = getattr(model.decoder.layers[0].self_attention, norm).weight
    weight.set_data(Tensor(np.full(weight.shape, 3.0, np.float32)))
    after = model.logits(ids).asnumpy()
    np.testing.assert_allclose(before[:, 0], after[:, 0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(before[:, 1:], after[:, 1:], atol=1e-4)


# ---- an independent numpy Qwen3 (HF modeling_qwen3 semantics, separate q/k/v/gate/up weights) -------

def _rms(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope(x, theta):  # x: [batch, heads, seq, dim]
    dim, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = np.outer(np.arange(seq), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotated = np.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return x * cos + rotated * sin


def numpy_qwen3_logits(weights: dict, ids: np.ndarray, heads=4, groups=2, dim=16, ffn=96, theta=1e6,
                       max_logits: list | None = None):
    """Logits; each layer's per-head max attention logit (unmasked) is appended to ``max_logits``."""
    per_group = heads // groups
    batch, seq = ids.shape
    x = weights["embedding.word_embeddings.weight"][ids]
    causal = np.triu(np.full((seq, seq), -np.inf), 1)
    for i in range(2):
        w = {k[len(f"decoder.layers.{i}."):]: v for k, v in weights.items() if k.startswith(f"decoder.layers.{i}.")}
        qkv = w["self_attention.linear_qkv.weight"].reshape(groups, per_group + 2, dim, -1)
        wq, wk, wv = qkv[:, :per_group].reshape(heads * dim, -1), qkv[:, per_group], qkv[:, per_group + 1]
        h = _rms(x, w["input_layernorm.weight"])
        q = _rms((h @ wq.T).reshape(batch, seq, heads, dim), w["self_attention.q_layernorm.weight"])
        k = _rms((h @ wk.reshape(groups * dim, -1).T).reshape(batch, seq, groups, dim),
                 w["self_attention.k_layernorm.weight"])
        v = (h @ wv.reshape(groups * dim, -1).T).reshape(batch, seq, groups, dim)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        q, k = _rope(q, theta), _rope(k, theta)
        k, v = np.repeat(k, per_group, axis=1), np.repeat(v, per_group, axis=1)  # HF repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dim) + causal
        if max_logits is not None:
            max_logits.append(scores.max(axis=(0, 2, 3)))
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, heads * dim)
        x = x + attn @ w["self_attention.linear_proj.weight"].T
        fc1 = w["mlp.linear_fc1.weight"].reshape(ffn, 2, -1)
        h = _rms(x, w["pre_mlp_layernorm.weight"])
        gate, up = h @ fc1[:, 0].T, h @ fc1[:, 1].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp.linear_fc2.weight"].T
    x = _rms(x, weights["decoder.final_layernorm.weight"])
    output = weights.get("output_layer.weight", weights["embedding.word_embeddings.weight"])
    return x @ output.T


@pytest.mark.parametrize("tied", [False, True])
def test_matches_numpy_qwen3(tied):
    model = tiny_model(seed=3, tie_word_embeddings=tied)
    # non-trivial norm weights so a transposed or misplaced norm cannot pass
    rng = np.random.RandomState(7)
    for _, p in model.parameters_and_names():
        if len(p.shape) == 1:
            p.set_data(Tensor(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    weights = {name: p.asnumpy().astype(np.float64) for name, p in model.parameters_and_names()}
    ids = random_ids(batch=2, seq=12)
    np.testing.assert_allclose(model.logits(Tensor(ids)).asnumpy(), numpy_qwen3_logits(weights, ids),
                               rtol=1e-4, atol=1e-4)


def test_max_attention_logits_match_numpy_and_cost_nothing_when_off():
    model = tiny_model(seed=3)
    weights = {name: p.asnumpy().astype(np.float64) for name, p in model.parameters_and_names()}
    ids = random_ids(batch=2, seq=12)
    model.logits(Tensor(ids))
    assert model.pop_max_attention_logits() is None  # not tracked unless asked
    model.track_max_attention_logits(True)
    model.logits(Tensor(ids[:1]))
    model.logits(Tensor(ids[1:]))  # the running max spans calls (micro-batches)
    expected = []
    numpy_qwen3_logits(weights, ids, max_logits=expected)
    np.testing.assert_allclose(model.pop_max_attention_logits(), np.stack(expected), rtol=1e-4, atol=1e-4)
    assert model.pop_max_attention_logits() is None  # popping resets


# ---- initialization ---------------------------------------------------------------------------------

def _param_fingerprint(model) -> float:
    return float(sum(np.abs(p.asnumpy()).astype(np.float64).sum() * (i + 1)
                     for i, (_, p) in enumerate(model.parameters_and_names())))


def test_init_is_deterministic_per_seed():
    a, b, c = tiny_model(seed=5), tiny_model(seed=5), tiny_model(seed=6)
    for (_, pa), (_, pb) in zip(a.parameters_and_names(), b.parameters_and_names()):
        np.testing.assert_array_equal(pa.asnumpy(), pb.asnumpy())
    assert not np.array_equal(a.output_layer.weight.asnumpy(), c.output_layer.weight.asnumpy())
    std = a.decoder.layers[0].mlp.linear_fc1.weight.asnumpy().std()
    assert 0.018 < std < 0.022
    np.testing.assert_array_equal(a.decoder.layers[0].input_layernorm.weight.asnumpy(), np.ones(64, np.float32))


def test_init_is_deterministic_across_processes():
    code = ("import mindspore as ms; ms.set_context(mode=ms.PYNATIVE_MODE); ms.set_device('CPU');"
            "from tests.test_model import tiny_model, _param_fingerprint;"
            "print(repr(_param_fingerprint(tiny_model(seed=5))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert float(out.stdout.strip().splitlines()[-1]) == _param_fingerprint(tiny_model(seed=5))


def test_build_model_follows_mindspore_global_seed():
    ms.set_seed(11)
    a = build_model(SECTION)
    b = build_model(SECTION)
    np.testing.assert_array_equal(a.embedding.word_embeddings.weight.asnumpy(),
                                  b.embedding.word_embeddings.weight.asnumpy())
    np.testing.assert_array_equal(a.embedding.word_embeddings.weight.asnumpy(),
                                  tiny_model(seed=11).embedding.word_embeddings.weight.asnumpy())


# ---- config and build errors --------------------------------------------------------------------------

def test_build_model_accepts_architecture_list():
    model = build_model({**SECTION, "architectures": ["Qwen3ForCausalLM"]}, seed=0)
    assert model.config.hidden_size == 64


@pytest.mark.parametrize("section, fragments", [
    ({**SECTION, "hiden_size": 64}, ["model.hiden_size", "hidden_size"]),
    ({**SECTION, "num_hidden_layers": "2"}, ["model.num_hidden_layers", "int", "'2'"]),
    ({**SECTION, "num_hidden_layers": 2.0}, ["model.num_hidden_layers", "int"]),
    ({**SECTION, "tie_word_embeddings": "true"}, ["model.tie_word_embeddings", "bool"]),
    ({**SECTION, "rms_norm_eps": "tiny"}, ["model.rms_norm_eps", "float"]),
    ({**SECTION, "num_key_value_heads": 3}, ["model.num_attention_heads", "model.num_key_value_heads"]),
    ({**SECTION, "seq_length": 128}, ["model.seq_length", "max_position_embeddings"]),
    ({**SECTION, "compute_dtype": "bfloat16"}, ["model.compute_dtype", "CPU"]),
    ({**SECTION, "model_type": "llama"}, ["model.model_type", "qwen3"]),
    ({**SECTION, "architectures": "LlamaForCausalLM"}, ["model.architectures", "Qwen3ForCausalLM"]),
    ({**SECTION, "architectures": ["Qwen3ForCausalLM", "X"]}, ["model.architectures"]),
])
def test_config_errors_name_the_field(section, fragments):
    with pytest.raises(ConfigError) as info:
        build_model(section, seed=0)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_sequence_longer_than_max_positions_is_an_error():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model().logits(Tensor(np.zeros((1, 65), np.int32)))


def test_config_converts_yaml_numbers():
    config = Qwen3Config.from_dict({**TINY, "rms_norm_eps": "1e-5", "rope_theta": 10000})
    assert config.rms_norm_eps == 1e-5 and isinstance(config.rope_theta, float)


def test_flops_per_token():
    model = tiny_model()
    embedding = 256 * 64
    expected = 6 * (model.num_parameters() - embedding) + 12 * 2 * 4 * 16 * 32
    assert model.flops_per_token(32) == expected
    tied = tiny_model(tie_word_embeddings=True)
    assert tied.flops_per_token(32) == 6 * tied.num_parameters() + 12 * 2 * 4 * 16 * 32


# ---- precision fields -----------------------------------------------------------------------------------

PRECISION_FIELDS = ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype",
                    "rotary_dtype")


@pytest.mark.parametrize("field", PRECISION_FIELDS)
def test_bfloat16_is_refused_on_cpu_naming_the_field(field):
    with pytest.raises(ConfigError, match=rf"model\.{field} = 'bfloat16'.* cannot run on CPU.*set model\.{field}: "
                                          "float32"):
        build_model({**SECTION, field: "bfloat16"}, seed=0)


def spy_dtypes(monkeypatch) -> dict:
    """Record the dtype each kind of op runs in while the model computes."""
    from training.model import attention, layers

    seen = {"matmul": set(), "softmax": set(), "norm": set(), "rotary": set()}

    def spy(kind, fn, dtype_of=lambda *args: args[0].dtype):
        def wrapped(*args, **kwargs):
            seen[kind].add(dtype_of(*args))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(layers, "_matmul_transpose_b", spy("matmul", layers._matmul_transpose_b))
    for name in ("_bmm", "_bmm_transpose_b"):
        monkeypatch.setattr(attention, name, spy("matmul", getattr(attention, name)))
    monkeypatch.setattr(layers.ops, "softmax", spy("softmax", layers.ops.softmax))
    monkeypatch.setattr(layers.ops, "rsqrt", spy("norm", layers.ops.rsqrt))
    monkeypatch.setattr(attention, "apply_rotary", spy("rotary", attention.apply_rotary, lambda x, cos, sin: cos.dtype))
    return seen


@pytest.mark.parametrize("dtypes", [
    dict(compute_dtype="float16", layernorm_compute_dtype="float32", softmax_compute_dtype="float32",
         rotary_dtype="float16"),
    dict(compute_dtype="float32", layernorm_compute_dtype="float16", softmax_compute_dtype="float16",
         rotary_dtype="float32"),
])
def test_each_precision_field_sets_where_its_ops_run(monkeypatch, dtypes):
    seen = spy_dtypes(monkeypatch)
    logits = tiny_model(**dtypes).logits(Tensor(random_ids()))
    field_of = {"matmul": "compute_dtype", "norm": "layernorm_compute_dtype", "softmax": "softmax_compute_dtype",
                "rotary": "rotary_dtype"}
    assert seen == {kind: {DTYPES[dtypes[field]]} for kind, field in field_of.items()}
    assert logits.dtype == ms.float32


def test_float16_compute_trains_on_cpu_close_to_float32():
    """Matmuls, softmax and rotary in float16: the loss moves by fp16 rounding only, and gradients reach the
    fp32 params. (RMSNorm stays fp32, as in MindFormers' configs: in float16 its rsqrt backward overflows
    for activations as small as these.)"""
    ids = random_ids()
    batch = Tensor(ids), Tensor(ids), Tensor(np.ones(ids.shape, np.float32))
    reference = tiny_model()
    half = tiny_model(compute_dtype="float16", softmax_compute_dtype="float16", rotary_dtype="float16")
    loss32, grads32 = ms.value_and_grad(reference, None, reference.trainable_params())(*batch)
    loss16, grads16 = ms.value_and_grad(half, None, half.trainable_params())(*batch)
    assert float(loss16.asnumpy()) != float(loss32.asnumpy())
    assert float(loss16.asnumpy()) == pytest.approx(float(loss32.asnumpy()), rel=1e-2)
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == ms.float32
        np.testing.assert_allclose(g16.asnumpy(), g32.asnumpy(), atol=5e-3 * np.abs(g32.asnumpy()).max() + 1e-6)


def test_params_are_stored_in_params_dtype():
    """float16 storage only: the float32 compute on the stored (rounded) weights gives float32's logits."""
    model = tiny_model(params_dtype="float16")
    assert {p.dtype for p in model.get_parameters()} == {ms.float16}
    reference = tiny_model()
    np.testing.assert_array_equal(model.output_layer.weight.asnumpy(),
                                  reference.output_layer.weight.asnumpy().astype(np.float16))
    for stored, param in zip(model.get_parameters(), reference.get_parameters()):
        assert stored.name == param.name
        param.set_data(Tensor(stored.asnumpy().astype(np.float32)))
    ids = Tensor(random_ids())
    logits = model.logits(ids)
    assert logits.dtype == ms.float32
    np.testing.assert_allclose(logits.asnumpy(), reference.logits(ids).asnumpy(), rtol=0, atol=1e-5)


def _interleaved_to_halves(rows: np.ndarray) -> np.ndarray:
    return np.concatenate([rows[0::2], rows[1::2]])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gate_up_reorder_and_its_inverse_move_rows_and_gradients_exactly(compiled):
    """fc1's gate/up pairs become [gate; up] halves and back, eager and in a graph, gradients included (they are
    concatenated slices, not a Transpose: see layers.gate_up_halves)."""
    from training.model.layers import gate_up_halves, gate_up_pairs

    rng = np.random.RandomState(0)
    pairs, upstream = rng.randn(12, 5).astype(np.float32), rng.randn(12, 5).astype(np.float32)
    halves = _interleaved_to_halves(pairs)

    def weighted_halves(x):
        return (gate_up_halves(x) * Tensor(upstream)).sum()

    def weighted_pairs(x):
        return (gate_up_pairs(x) * Tensor(upstream)).sum()

    wrap = ms.jit if compiled else (lambda f: f)
    np.testing.assert_array_equal(wrap(gate_up_halves)(Tensor(pairs)).asnumpy(), halves)
    np.testing.assert_array_equal(wrap(gate_up_pairs)(Tensor(halves)).asnumpy(), pairs)
    # the gradient of a reorder is the upstream gradient put back in the input's order
    np.testing.assert_array_equal(wrap(ms.grad(weighted_halves))(Tensor(pairs)).asnumpy(),
                                  np.stack(np.split(upstream, 2), axis=1).reshape(12, 5))
    np.testing.assert_array_equal(wrap(ms.grad(weighted_pairs))(Tensor(halves)).asnumpy(),
                                  _interleaved_to_halves(upstream))
