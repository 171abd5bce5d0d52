"""Ascend's fused kernels (training/model/ascend.py) without an Ascend device: CPU stand-ins written from MindSpore
2.10's docstrings of ops.flash_attention_score and mint.nn.functional.cross_entropy take the place of the ops, the
device is said to be Ascend, and Kiln's fused paths must then compute what its plain paths compute: values and
gradients within fp32 rtol 1e-5 / atol 1e-6 (the same products, summed in another order). On CPU a request for the
fused attention runs the plain one and says why."""
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from conftest import MICRO_CONFIG, PROJECT_ROOT, shard_data
from training.config import ConfigError, FastStepConfig, KilnConfig, load_config
from training.model import ascend, build_model, model_config
from training.model.layers import Init, additive_mask, causal_mask, token_cross_entropy
from training.model.mla import MLASelfAttention
from training.parallel.mesh import ParallelDims, World
from training.reporting import Reporter
from training.step import configure_runtime
from training.trainer import Trainer

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

FP32 = dict(rtol=1e-5, atol=1e-6)


def assert_gradients_close(got: np.ndarray, expected: np.ndarray, name: str) -> None:
    """FP32, with atol 1e-6 of the largest entry: a weight's gradient sums terms of about that size, so an entry
    near zero carries their rounding (the kernel and the plain path sum in other orders; measured on an AMD EPYC:
    2.9e-6 on an entry of 0.024 beside entries of 6)."""
    np.testing.assert_allclose(got, expected, rtol=FP32["rtol"], atol=FP32["atol"] * max(1.0, np.abs(expected).max()),
                               err_msg=name)


SEQ = 16
QWEN3 = {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "compute_dtype": "float32", "vocab_size": 64,
         "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "seq_length": SEQ,
         "hidden_dropout": 0.0, "use_flash_attention": True}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": "DeepseekV3ForCausalLM", "compute_dtype": "float32",
               "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
               "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 64,
               "seq_length": SEQ, "first_k_dense_replace": 1, "use_flash_attention": True}


def cpu_flash_attention_score(query, key, value, head_num, real_shift=None, drop_mask=None, padding_mask=None,
                              attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob=1.0,
                              scalar_value=1.0, pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0,
                              input_layout="BSH", sparse_mode=0):
    """ops.flash_attention_score as its docstring states it, BNSD layout only: softmax(Mask(scalar_value ·
    q·kᵀ, attn_mask))·v with attn_mask 1 = discard, value shaped as key, N2 key heads dividing N1 (query head n
    reads key head n // (N1 / N2)); sparse_mode 0 takes a full mask, 2 the causal pattern from the top-left
    corner with a 2048 x 2048 mask. Its float16/bfloat16-only rule is left out so that the paths compare in fp32
    (the config check enforces it)."""
    assert input_layout == "BNSD" and real_shift is None and drop_mask is None and keep_prob == 1.0
    batch, n1, s1, dim = query.shape
    n2, s2 = key.shape[1], key.shape[2]
    assert head_num == n1 and n1 % n2 == 0 and key.shape == value.shape == (batch, n2, s2, dim)
    assert dim % 16 == 0 and dim <= 512 and query.dtype == key.dtype == value.dtype
    assert attn_mask.dtype in (ms.bool_, ms.uint8)
    if sparse_mode == 2:
        assert attn_mask.shape == (2048, 2048)
        np.testing.assert_array_equal(attn_mask.asnumpy(), np.triu(np.ones((2048, 2048)), k=1))
        discard = np.triu(np.ones((s1, s2), bool), k=1)
    else:
        assert sparse_mode == 0 and attn_mask.shape in ((batch, n1, s1, s2), (batch, 1, s1, s2), (s1, s2))
        discard = attn_mask.asnumpy().astype(bool)
    key_heads = Tensor(np.arange(n1) // (n1 // n2), ms.int32)
    key, value = ops.gather(key, key_heads, 1), ops.gather(value, key_heads, 1)
    scores = ops.matmul(query, key.swapaxes(-1, -2)) * scalar_value
    scores = ops.masked_fill(scores, Tensor(np.broadcast_to(discard, scores.shape)), float("-inf"))
    cpu_flash_attention_score.calls.append(sparse_mode)
    return ops.matmul(ops.softmax(scores, axis=-1), value)


def cpu_cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """mint.nn.functional.cross_entropy with class-index targets, as documented: l_n = -log softmax(x_n)[y_n],
    0 where y_n is ignore_index."""
    assert weight is None and label_smoothing == 0.0 and reduction == "none" and input.ndim == 2
    assert target.dtype in (ms.int32, ms.int64) and target.shape == input.shape[:1]
    kept = (target != ignore_index).astype(input.dtype)
    picked = ops.gather_elements(ops.log_softmax(input, -1), 1, (target * (target != ignore_index)).reshape(-1, 1))
    cpu_cross_entropy.calls += 1
    return -picked.reshape(-1) * kept


@pytest.fixture
def on_ascend(monkeypatch):
    """The device said to be Ascend, the fused ops replaced by the stand-ins (each counting its calls)."""
    cpu_flash_attention_score.calls = []
    cpu_cross_entropy.calls = 0
    monkeypatch.setattr(ascend, "on_ascend", lambda: True)
    monkeypatch.setattr(ascend, "flash_attention_score", cpu_flash_attention_score)
    monkeypatch.setattr(ascend, "fused_cross_entropy", cpu_cross_entropy)


def run_config(**train_state):
    return SimpleNamespace(fast_step=FastStepConfig(), kiln=KilnConfig.from_dict({"train_state": train_state}))


def document_batch(batch=2, seq=SEQ, seed=0):
    """Ids, labels, loss mask, positions restarting at each document and the block-causal masks ([batch, 1, seq,
    seq], 1 = masked) of two documents per sample, split at different places."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, (batch, seq)).astype(np.int32)
    labels = rng.integers(0, 64, (batch, seq)).astype(np.int32)
    positions = np.zeros((batch, seq), np.int32)
    masks = np.ones((batch, 1, seq, seq), np.uint8)
    for sample, split in enumerate(rng.integers(3, seq - 3, batch)):
        for start, end in ((0, split), (split, seq)):
            positions[sample, start:end] = np.arange(end - start)
            masks[sample, 0, start:end, start:end] = np.triu(np.ones((end - start, end - start), np.uint8), k=1)
    return ids, labels, np.ones((batch, seq), np.float32), positions, masks


def loss_and_gradients(model, inputs):
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda *x: model(*x), None, params)(*(Tensor(x) for x in inputs))
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "document-masks"])
def test_qwen3_with_flash_attention_and_the_fused_loss_equals_the_plain_model(on_ascend, monkeypatch, documents):
    """GQA (4 query heads over 2 KV groups), the softmax scale in q's rotary tables (so scalar_value 1), 4 causal
    query blocks in the plain path against the kernel's causal mode, or the dataset's document masks. The config
    check (float16/bfloat16 with the kernel on Ascend) is let through to compare in fp32."""
    monkeypatch.setattr(ascend, "check_config", lambda config, path: None)  # fp32 compute, for the comparison
    plain = build_model({**QWEN3, "use_flash_attention": False}, seed=3)
    fused = build_model(QWEN3, seed=3)
    assert fused.decoder.layers[0].self_attention.flash_attention is not None
    notes = ascend.select_kernels(fused, run_config(), ParallelDims(world=1))
    assert notes == ["attention: FlashAttentionScore (model.use_flash_attention)",
                     "cross-entropy: fused (mint.nn.functional.cross_entropy, fast_step.fused_cross_entropy)"]
    ids, labels, loss_mask, positions, masks = document_batch()
    inputs = (ids, labels, loss_mask, positions, masks) if documents else (ids, labels, loss_mask)
    fused_loss, fused_grads = loss_and_gradients(fused, inputs)
    plain_loss, plain_grads = loss_and_gradients(plain, inputs)
    assert cpu_flash_attention_score.calls == [0 if documents else 2] and cpu_cross_entropy.calls == 1
    np.testing.assert_allclose(fused_loss, plain_loss, **FP32)
    for name, grad in plain_grads.items():
        assert_gradients_close(fused_grads[name], grad, name)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "document-masks"])
def test_mla_with_flash_attention_equals_plain_mla(on_ascend, monkeypatch, documents):
    """MLA's value heads (8) are narrower than its query/key heads (8 nope + 8 rope): v goes to the kernel
    zero-padded and the output comes back cut; q carries the softmax scale, one query head per key head."""
    monkeypatch.setattr(ascend, "check_config", lambda config, path: None)
    config = model_config(DEEPSEEK_V3)
    layer = MLASelfAttention(Init(0, 0.2), config)
    assert layer.flash_attention is not None
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((2, SEQ, 32)).astype(np.float32))
    _, _, _, positions, masks = document_batch()
    rotary = config.rotary_embedding()
    cos, sin = rotary.tables(SEQ, Tensor(positions) if documents else None)
    mask = additive_mask(Tensor(masks)) if documents else causal_mask(SEQ)
    weights = Tensor(rng.standard_normal((2, SEQ, 32)).astype(np.float32))
    params = layer.trainable_params()
    grad_fn = ms.value_and_grad(lambda x: (layer(x, cos, sin, mask) * weights).sum(), 0, params)
    (fused, (fused_dx, fused_dw)) = grad_fn(x)
    flash_attention, layer.flash_attention = layer.flash_attention, None
    (plain, (plain_dx, plain_dw)) = grad_fn(x)
    assert flash_attention is not None and cpu_flash_attention_score.calls == [0 if documents else 2]
    np.testing.assert_allclose(fused.asnumpy(), plain.asnumpy(), **FP32)
    np.testing.assert_allclose(fused_dx.asnumpy(), plain_dx.asnumpy(), **FP32)
    for param, got, expected in zip(params, fused_dw, plain_dw):
        assert_gradients_close(got.asnumpy(), expected.asnumpy(), param.name)


def test_the_fused_loss_stand_in_equals_token_cross_entropy_and_its_gradient(on_ascend):
    rng = np.random.default_rng(2)
    logits = Tensor(rng.standard_normal((24, 64)).astype(np.float32) * 3)
    labels = Tensor(rng.integers(0, 64, 24).astype(np.int32))
    weights = Tensor(rng.standard_normal(24).astype(np.float32))
    fused = ms.value_and_grad(lambda x: (ascend.fused_token_cross_entropy(x, labels) * weights).sum())(logits)
    plain = ms.value_and_grad(lambda x: (token_cross_entropy(x, labels) * weights).sum())(logits)
    assert cpu_cross_entropy.calls == 1
    np.testing.assert_allclose(fused[0].asnumpy(), plain[0].asnumpy(), **FP32)
    np.testing.assert_allclose(fused[1].asnumpy(), plain[1].asnumpy(), **FP32)


def test_on_ascend_the_plain_paths_run_where_the_kernels_cannot_and_say_why(on_ascend, monkeypatch):
    monkeypatch.setattr(ascend, "check_config", lambda config, path: None)
    narrow = build_model({**QWEN3, "head_dim": 8}, seed=0)  # the kernel takes head sizes of multiples of 16
    assert narrow.decoder.layers[0].self_attention.flash_attention is None
    (attention, loss) = ascend.select_kernels(narrow, run_config(), ParallelDims(world=2, tp=2))
    assert "multiples of 16 up to 512, these heads are 8" in attention
    assert loss == "cross-entropy: tensor parallelism's vocab-parallel loss, not the fused kernel"
    assert narrow.token_loss is token_cross_entropy
    model = build_model(QWEN3, seed=0)
    (attention, _) = ascend.select_kernels(model, run_config(max_attention_logit=True), ParallelDims(world=2, cp=2))
    assert "context parallel runs its own ring/Ulysses attention" in attention
    assert "kiln.train_state.max_attention_logit reads the attention scores" in attention
    off = SimpleNamespace(fast_step=FastStepConfig(fused_cross_entropy=False), kiln=KilnConfig())
    assert ascend.select_kernels(build_model({**QWEN3, "use_flash_attention": False}, seed=0), off,
                                 ParallelDims(world=1)) == [
        "cross-entropy: log_softmax + gather (fast_step.fused_cross_entropy is false)"]


def test_on_cpu_use_flash_attention_runs_the_plain_attention_and_the_step_line_says_why(tmp_path):
    from conftest import write_random_documents

    shard = write_random_documents(tmp_path / "data/shards/random")
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [
        *shard_data(shard), f"checkpoint.save_path={tmp_path / 'checkpoints'}",
        "model.use_flash_attention=true"])
    configure_runtime(config)
    trainer = Trainer(config, World(rank=0, size=1), tmp_path, Reporter(tmp_path / "metrics.jsonl", enabled=True))
    assert all(layer.self_attention.flash_attention is None for layer in trainer.model.decoder.layers)
    assert trainer.model.token_loss is token_cross_entropy  # fast_step.fused_cross_entropy: no effect on CPU
    assert trainer.step_mode.endswith(". attention: plain masked softmax, not FlashAttentionScore "
                                      "(model.use_flash_attention asks for it): FlashAttentionScore is an Ascend "
                                      "kernel and this run's device is CPU"), trainer.step_mode


def test_on_ascend_float32_compute_with_flash_attention_is_an_error(on_ascend):
    with pytest.raises(ConfigError, match=r"model\.use_flash_attention = True needs model\.compute_dtype float16 or "
                                          r"bfloat16 on Ascend .* got 'float32'"):
        model_config(QWEN3)
    assert model_config({**QWEN3, "compute_dtype": "float16"}).use_flash_attention


def test_the_switches_type_errors_name_their_fields():
    with pytest.raises(ConfigError, match=r"model\.use_flash_attention: expected bool, got 'yes'"):
        model_config({**QWEN3, "use_flash_attention": "yes"})
    with pytest.raises(ConfigError, match=r"fast_step\.fused_cross_entropy: expected bool, got 1"):
        FastStepConfig.from_dict({"fused_cross_entropy": 1}, "fast_step")
