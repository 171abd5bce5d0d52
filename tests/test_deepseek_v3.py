"""DeepSeek-V3 GPTModel: names and layer specs, numerics against an independent numpy DeepSeek-V3 (MLA with
YaRN, group-limited sigmoid routing, shared experts, MTP, sequence aux loss), expert-bias balancing,
config errors, and training under msrun with 2 workers."""
import json
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import PROJECT_ROOT, assert_adam_weights_close, run_under_msrun, shard_data
from training.parallel.comm import Collectives
from training.parallel.mesh import World
from training.config import ConfigError
from training.model import DeepseekV3Config, build_model
from training.model.gpt import GPTModel
from training.model.layers import Init, merge_heads
from training.model.moe import GroupedExperts, MoELayer, TopKRouter
from training.model.spec import ModuleSpec, build_module
from training.model.transformer import MLP
from training.model.mla import split_heads, yarn_parameters

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
            mtp_loss_scaling_factor=0.3, moe_aux_loss_coeff=0.01, seq_length=16, max_position_embeddings=64,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.8,
                              mscale_all_dim=0.6), compute_dtype="float32", qk_layernorm=True)
SECTION = dict(model_type="deepseek_v3", architectures="DeepseekV3ForCausalLM", **TINY)


def tiny_model(seed=0, **overrides) -> GPTModel:
    return GPTModel(DeepseekV3Config.from_dict({**TINY, **overrides}), seed=seed)


def random_ids(batch=2, seq=16, seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, TINY["vocab_size"], (batch, seq)).astype(np.int32)


def test_parameter_names_and_shapes():
    model = tiny_model()
    shapes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    attention = {"input_layernorm.weight": (32,), "self_attention.linear_qkv.weight": (24 + 16 + 4, 32),
                 "self_attention.q_layernorm.weight": (24,), "self_attention.linear_qb.weight": (2 * 12, 24),
                 "self_attention.k_layernorm.weight": (16,), "self_attention.linear_kvb.weight": (2 * 16, 16),
                 "self_attention.linear_proj.weight": (32, 16), "pre_mlp_layernorm.weight": (32,)}
    moe = {"mlp.router.weight": (8, 32), "mlp.expert_bias": (8,), "mlp.tokens_per_expert": (8,),
           "mlp.experts.weight1": (8, 32, 32), "mlp.experts.weight2": (8, 16, 32),
           "mlp.shared_experts.linear_fc1.weight": (32, 32), "mlp.shared_experts.linear_fc2.weight": (32, 16)}
    expected = {"embedding.word_embeddings.weight": (128, 32), "decoder.final_layernorm.weight": (32,),
                "output_layer.weight": (128, 32), "mtp.layers.0.enorm.weight": (32,),
                "mtp.layers.0.hnorm.weight": (32,), "mtp.layers.0.eh_proj.weight": (32, 64),
                "mtp.layers.0.final_layernorm.weight": (32,),
                "decoder.layers.0.mlp.linear_fc1.weight": (128, 32), "decoder.layers.0.mlp.linear_fc2.weight": (32, 64)}
    for prefix in ("decoder.layers.0.", "decoder.layers.1.", "mtp.layers.0.transformer_layer."):
        expected.update({prefix + k: v for k, v in attention.items()})
    for prefix in ("decoder.layers.1.", "mtp.layers.0.transformer_layer."):
        expected.update({prefix + k: v for k, v in moe.items()})
    assert shapes == expected
    assert {p.name for p in model.trainable_params()} == set(expected) - {
        n for n in expected if n.endswith(("expert_bias", "tokens_per_expert"))}


def test_no_q_lora_fuses_full_queries_into_linear_qkv():
    model = tiny_model(q_lora_rank=None)
    names = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"] == (2 * 12 + 16 + 4, 32)
    assert not any("linear_qb" in n or "q_layernorm" in n for n in names)


@pytest.mark.parametrize("overrides, moe_layers", [
    (dict(num_hidden_layers=4, first_k_dense_replace=1), [1, 2, 3]),
    (dict(num_hidden_layers=4, first_k_dense_replace=0, moe_layer_freq=2), [0, 2]),
    (dict(num_hidden_layers=4, first_k_dense_replace=0, moe_layer_freq=[0, 1, 1, 0]), [1, 2]),
    (dict(num_hidden_layers=4, first_k_dense_replace=4), []),
])
def test_layer_specs_pick_dense_or_moe_per_layer(overrides, moe_layers):
    model = tiny_model(num_nextn_predict_layers=0, **overrides)
    assert [name for name, _ in model.moe_layers()] == [f"decoder.layers.{i}" for i in moe_layers]


def test_moe_layer_is_assembled_from_its_spec():
    config = DeepseekV3Config.from_dict({**TINY, "num_nextn_predict_layers": 0})
    spec = config.decoder_layer_specs()[1].submodules["mlp"]
    assert (spec.module, {name: sub.module for name, sub in spec.submodules.items()}) == (
        MoELayer, {"router": TopKRouter, "experts": GroupedExperts, "shared_experts": MLP})
    assert spec.submodules["shared_experts"].params == {"ffn_size": 16}

    class BiasFreeRouter(TopKRouter):  # a spec swaps one part and keeps the rest
        def construct(self, tokens, expert_bias):
            return super().construct(tokens, expert_bias * 0)

    swapped = ModuleSpec(MoELayer, {**spec.submodules, "router": ModuleSpec(BiasFreeRouter)})
    moe = build_module(swapped, Init(0, config.initializer_range), config)
    assert isinstance(moe.router, BiasFreeRouter) and isinstance(moe.experts, GroupedExperts)
    moe.expert_bias.set_data(Tensor(np.array([0, 0, 0, 0, 0, 10, 0, 0], np.float32)))
    moe.keep_routing(moe(Tensor(np.random.RandomState(0).randn(1, 10, 32).astype(np.float32)))[1])
    assert moe.take_counts()[5] < 10  # the bias no longer forces expert 5 on every token


def test_eager_dispatch_sorts_on_the_host_and_equals_the_compiled_static_one():
    """An eager forward routes through the host-sorted dispatch, a compiled one through the static block dispatch
    (which an eager call never reaches): the same output, load-balancing loss, tokens per expert and gradients
    (input and every weight: rtol 1e-5, atol 1e-6 of fp32), with one expert left idle and one taking most rows
    so that empty experts and padded blocks are exercised."""
    from unittest import mock

    from mindspore import nn

    moe = tiny_model(num_nextn_predict_layers=0).decoder.layers[1].mlp
    moe.expert_bias.set_data(Tensor(np.array([0, 0.3, 0, 0, 0, 0, -9, 0], np.float32)))
    rng = np.random.RandomState(0)
    x, probe = (Tensor(rng.randn(2, 16, 32).astype(np.float32)) for _ in range(2))

    class Objective(nn.Cell):
        def construct(self, inputs):
            out, routing = moe(inputs)
            moe.keep_routing(routing)
            return (out * probe).sum() + moe.aux_loss

    grad_fn = ms.value_and_grad(Objective(), 0, moe.trainable_params())
    with mock.patch.object(GroupedExperts, "dispatch", side_effect=AssertionError("static dispatch ran eagerly")):
        eager = grad_fn(x)
    eager_counts = moe.take_counts()
    compiled = ms.jit(grad_fn)(x)
    assert eager_counts[6] == 0 and eager_counts[1] > 16
    np.testing.assert_array_equal(moe.take_counts(), eager_counts)
    (eager_loss, (eager_input_grad, eager_grads)), (loss, (input_grad, grads)) = eager, compiled
    np.testing.assert_allclose(loss.asnumpy(), eager_loss.asnumpy(), rtol=1e-5)
    for name, got, want in [("input", input_grad, eager_input_grad),
                            *zip([p.name for p in moe.trainable_params()], grads, eager_grads)]:
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("overrides, width", [
    (dict(n_shared_experts=2), 32), (dict(n_shared_experts=2, moe_shared_expert_intermediate_size=24), 24),
    (dict(n_shared_experts=0), None)])
def test_shared_experts_width(overrides, width):
    moe = tiny_model(num_nextn_predict_layers=0, **overrides).decoder.layers[1].mlp
    assert (moe.shared_experts.linear_fc2.weight.shape == (32, width)) if width else moe.shared_experts is None


# ---- an independent numpy DeepSeek-V3 (HF modeling_deepseek_v3 semantics) -----------------------------

def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _yarn_rope(x, dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim):
    """HF's YaRN written out per frequency: interpolate slow frequencies, keep fast ones."""
    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    inv = []
    for i in range(dim // 2):
        extra = base ** (-2 * i / dim)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        inv.append(extra / factor * ramp + extra * (1 - ramp))
    get = lambda m: 0.1 * m * math.log(factor) + 1.0
    attention_factor = get(mscale) / get(mscale_all_dim)
    angles = np.outer(np.arange(x.shape[-2]), inv)
    cos = np.cos(np.concatenate([angles, angles], -1)) * attention_factor
    sin = np.sin(np.concatenate([angles, angles], -1)) * attention_factor
    half = dim // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _mla(w, x, c):
    heads, nope, rope, vd = 2, 8, 4, 8
    b, s, _ = x.shape
    down = x @ w["self_attention.linear_qkv.weight"].T
    q_lat, kv_lat, k_pe = down[..., :24], down[..., 24:40], down[..., 40:]
    q = (_rms(q_lat, w["self_attention.q_layernorm.weight"]) @ w["self_attention.linear_qb.weight"].T)
    q = q.reshape(b, s, heads, nope + rope).transpose(0, 2, 1, 3)
    kv = (_rms(kv_lat, w["self_attention.k_layernorm.weight"]) @ w["self_attention.linear_kvb.weight"].T)
    kv = kv.reshape(b, s, heads, nope + vd).transpose(0, 2, 1, 3)
    rs = c["rope_scaling"]
    args = (rope, 10000.0, rs["factor"], rs["original_max_position_embeddings"], 32.0, 1.0, rs["mscale"],
            rs["mscale_all_dim"])
    q_pe = _yarn_rope(q[..., nope:], *args)
    k_pe = _yarn_rope(k_pe[:, None], *args)
    query = np.concatenate([q[..., :nope], q_pe], -1)
    key = np.concatenate([kv[..., :nope], np.repeat(k_pe, heads, axis=1)], -1)
    m_all = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0
    scores = query @ key.transpose(0, 1, 3, 2) / math.sqrt(nope + rope) * m_all ** 2
    scores = scores + np.triu(np.full((s, s), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ kv[..., nope:]).transpose(0, 2, 1, 3).reshape(b, s, heads * vd)
    return out @ w["self_attention.linear_proj.weight"].T


def _moe(w, x, aux: list, bias, c):
    """Token by token: sigmoid (or softmax) scores; the best `topk_group` of `n_group` groups, each scored
    by the sum of its top-2 biased scores; the top-k experts among them; gates from the unbiased scores."""
    b, s, h = x.shape
    experts, groups, k = c["n_routed_experts"], c["n_group"], c["num_experts_per_tok"]
    size = experts // groups
    out = np.zeros_like(x)
    chosen_all = np.zeros((b, s, k), int)
    scores_all = np.zeros((b, s, experts))
    for bi in range(b):
        for t in range(s):
            token = x[bi, t]
            logits = w["mlp.router.weight"] @ token
            if c.get("moe_router_score_function", "sigmoid") == "sigmoid":
                scores = 1 / (1 + np.exp(-logits))
            else:
                scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            biased = scores + bias
            group_scores = [sorted(biased[g * size:(g + 1) * size])[-2:] for g in range(groups)]
            best_groups = np.argsort([-sum(top2) for top2 in group_scores], kind="stable")[:c["topk_group"]]
            masked = np.full(experts, -np.inf)
            for g in best_groups:
                masked[g * size:(g + 1) * size] = biased[g * size:(g + 1) * size]
            chosen = np.argsort(-masked, kind="stable")[:k]
            gates = scores[chosen] / (scores[chosen].sum() if c.get("norm_topk_prob", True) else 1.0)
            for e, gate in zip(chosen, gates * c["routed_scaling_factor"]):
                w1, w2 = w["mlp.experts.weight1"][e], w["mlp.experts.weight2"][e]
                gate_up = token @ w1
                out[bi, t] += gate * ((_silu(gate_up[:16]) * gate_up[16:]) @ w2)
            chosen_all[bi, t], scores_all[bi, t] = chosen, scores
    fc1 = w["mlp.shared_experts.linear_fc1.weight"].reshape(16, 2, -1)
    out += (_silu(x @ fc1[:, 0].T) * (x @ fc1[:, 1].T)) @ w["mlp.shared_experts.linear_fc2.weight"].T
    # balancing: sum_i f_i * P_i with f_i = E/(k*T) * count_i and P_i the mean normalised score, per
    # sequence then averaged (seq_aux_loss), or over the micro-batch's tokens at once (aux_loss)
    probs = scores_all / scores_all.sum(-1, keepdims=True)
    balancing = c.get("moe_router_load_balancing_type", "seq_aux_loss")
    rows = ([(chosen_all[bi], probs[bi]) for bi in range(b)] if balancing == "seq_aux_loss"
            else [(chosen_all, probs.reshape(-1, experts))] if balancing == "aux_loss" else [])
    if rows:
        aux.append(c["moe_aux_loss_coeff"] * np.mean([
            (np.bincount(chosen.ravel(), minlength=experts) * experts / chosen.size * p.mean(0)).sum()
            for chosen, p in rows]))
    return out


def _dense(w, x):
    fc1 = w["mlp.linear_fc1.weight"].reshape(64, 2, -1)
    return (_silu(x @ fc1[:, 0].T) * (x @ fc1[:, 1].T)) @ w["mlp.linear_fc2.weight"].T


def _layer(w, x, moe: bool, aux, c):
    x = x + _mla(w, _rms(x, w["input_layernorm.weight"]), c)
    h = _rms(x, w["pre_mlp_layernorm.weight"])
    return x + (_moe(w, h, aux, w["mlp.expert_bias"], c) if moe else _dense(w, h))


def _ce(logits, labels, mask):
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return (token * mask).sum() / mask.sum()


def numpy_deepseek_loss(weights, ids, labels, mask, c):
    """(lm loss, [loss of each MTP depth], balancing loss). Depth k reads the embedding of the tokens k
    ahead and depth k-1's normed output (the decoder's for k = 1)."""
    sub = lambda prefix: {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    aux = []
    x = weights["embedding.word_embeddings.weight"][ids]
    x = _layer(sub("decoder.layers.0."), x, False, aux, c)
    x = _layer(sub("decoder.layers.1."), x, True, aux, c)
    hidden = _rms(x, weights["decoder.final_layernorm.weight"])
    lm = _ce(hidden @ weights["output_layer.weight"].T, labels, mask)
    shift = lambda a: np.concatenate([a[:, 1:], np.zeros_like(a[:, :1])], 1)
    depth_losses = []
    for depth in range(c["num_nextn_predict_layers"]):
        ids, labels, mask = shift(ids), shift(labels), shift(mask)
        mtp = sub(f"mtp.layers.{depth}.")
        h = np.concatenate([_rms(weights["embedding.word_embeddings.weight"][ids], mtp["enorm.weight"]),
                            _rms(hidden, mtp["hnorm.weight"])], -1) @ mtp["eh_proj.weight"].T
        hidden = _rms(_layer(sub(f"mtp.layers.{depth}.transformer_layer."), h, True, aux, c),
                      mtp["final_layernorm.weight"])
        depth_losses.append(_ce(hidden @ weights["output_layer.weight"].T, labels, mask))
    return lm, depth_losses, sum(aux)


@pytest.mark.parametrize("overrides", [
    {},  # 4 groups of 2, the best 2 kept, top-3; sequence aux loss; one MTP depth
    # 2 groups of 4, one kept: a group's top-2 sum differs from its total and the top-2 pick inside it matters;
    # the micro-batch aux loss; two MTP depths (the second reads the first's output)
    dict(n_group=2, topk_group=1, num_experts_per_tok=2, moe_router_load_balancing_type="aux_loss",
         num_nextn_predict_layers=2),
    # softmax scores, no group limit, raw gates; no balancing loss
    dict(n_group=1, topk_group=1, moe_router_score_function="softmax", norm_topk_prob=False,
         moe_router_load_balancing_type="none"),
], ids=["groups_of_2", "groups_of_4_aux_loss_mtp2", "softmax_no_balancing_loss"])
def test_loss_matches_numpy_deepseek_v3(overrides):
    config = {**TINY, **overrides}
    model = tiny_model(seed=3, **overrides)
    rng = np.random.RandomState(7)
    for _, p in model.parameters_and_names():  # non-trivial norms and expert biases
        if p.name.endswith("layernorm.weight") or p.name.endswith("norm.weight"):
            p.set_data(Tensor(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
        if p.name.endswith("expert_bias"):
            p.set_data(Tensor(rng.uniform(-0.05, 0.05, p.shape).astype(np.float32)))
    weights = {name: p.asnumpy().astype(np.float64) for name, p in model.parameters_and_names()}
    ids, labels = random_ids(seed=1), random_ids(seed=2)
    mask = (np.random.RandomState(3).rand(*ids.shape) > 0.2).astype(np.float32)
    loss, parts = model.loss_and_parts(Tensor(ids), Tensor(labels), Tensor(mask))
    loss, parts = float(loss.asnumpy()), model.named_parts(parts)
    lm, depths, aux = numpy_deepseek_loss(weights, ids, labels, mask, config)
    assert parts["lm_loss"] == pytest.approx(lm, rel=1e-4)
    assert {k: v for k, v in parts.items() if k.startswith("mtp_")} == {
        f"mtp_{k + 1}_loss": pytest.approx(depth, rel=1e-4) for k, depth in enumerate(depths)}
    if aux:
        assert parts["load_balancing_loss"] == pytest.approx(aux, rel=1e-4)
    else:
        assert "load_balancing_loss" not in parts
    assert loss == pytest.approx(lm + 0.3 * np.mean(depths) + aux, rel=1e-5)


def test_every_trainable_parameter_gets_a_gradient():
    model = tiny_model()
    ids = random_ids()
    _, grads = ms.value_and_grad(model, None, model.trainable_params())(
        Tensor(ids), Tensor(ids), Tensor(np.ones(ids.shape, np.float32)))
    assert [p.name for p, g in zip(model.trainable_params(), grads) if not np.any(g.asnumpy())] == []


def test_expert_bias_steers_the_choice_but_not_the_gate():
    model = tiny_model(n_group=1, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False)
    router = model.decoder.layers[1].mlp.router
    tokens = Tensor(np.random.RandomState(0).randn(10, 32).astype(np.float32))
    bias = np.zeros(8, np.float32)
    bias[5] = 10.0
    scores, chosen, gates = router(tokens, Tensor(bias))
    assert (chosen.asnumpy() == 5).all()
    np.testing.assert_allclose(gates.asnumpy()[:, 0], scores.asnumpy()[:, 5] * 2.5, rtol=1e-6)


def test_after_step_moves_biases_toward_balance_and_resets_counts():
    model = tiny_model(moe_router_bias_update_rate=0.01)
    ids = random_ids()
    model(Tensor(ids), Tensor(ids), Tensor(np.ones(ids.shape, np.float32)))
    moe = dict(model.moe_layers())["decoder.layers.1"]
    counts = moe.token_counts.copy()
    assert counts.sum() == ids.size * 3
    reported = model.after_step(Collectives(World(rank=0, size=1)))
    assert reported["decoder.layers.1"] == counts.tolist()
    np.testing.assert_allclose(moe.expert_bias.asnumpy(), 0.01 * np.sign(counts.mean() - counts), atol=1e-7)
    np.testing.assert_array_equal(moe.tokens_per_expert.asnumpy(), counts)
    assert moe.token_counts.sum() == 0
    model.after_step(Collectives(World(rank=0, size=1)), applied=False)  # a skipped step leaves biases alone
    np.testing.assert_allclose(moe.expert_bias.asnumpy(), 0.01 * np.sign(counts.mean() - counts), atol=1e-7)


@pytest.mark.parametrize("compiled", [False, True])
def test_heads_split_and_merge_move_values_and_gradients_as_the_transposes_do(compiled):
    """MLA's head layout changes are pure data movement (a split and stacks, unstack and a concat), so values and
    gradients must equal the reshape + transpose they replace exactly, eager and under jit."""
    rng = np.random.default_rng(3)
    batch, seq, heads, widths = 2, 5, 3, [4, 2]
    x = rng.standard_normal((batch, seq, heads * sum(widths))).astype(np.float32)
    by_head = x.reshape(batch, seq, heads, sum(widths)).transpose(0, 2, 1, 3)
    expected = [by_head[..., :4], by_head[..., 4:]]
    weights = [rng.standard_normal(part.shape).astype(np.float32) for part in expected]

    def split_loss(t):
        first, second = split_heads(t, widths, heads)
        return (first * Tensor(weights[0])).sum() + (second * Tensor(weights[1])).sum(), first, second

    def merge_loss(t):
        merged = merge_heads(t)
        return (merged * Tensor(x)).sum(), merged

    run = ms.jit if compiled else (lambda f: f)
    (_, first, second), grad = run(ms.value_and_grad(split_loss, has_aux=True))(Tensor(x))
    np.testing.assert_array_equal(first.asnumpy(), expected[0])
    np.testing.assert_array_equal(second.asnumpy(), expected[1])
    np.testing.assert_array_equal(grad.asnumpy(), np.concatenate(weights, -1).transpose(0, 2, 1, 3).reshape(x.shape))
    (_, merged), grad = run(ms.value_and_grad(merge_loss, has_aux=True))(Tensor(by_head.copy()))
    np.testing.assert_array_equal(merged.asnumpy(), x)
    np.testing.assert_array_equal(grad.asnumpy(), by_head)


def test_yarn_keeps_fast_frequencies_and_stretches_slow_ones():
    inv_freq, magnitude = yarn_parameters(64, 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    plain = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv_freq[:5], plain[:5])
    np.testing.assert_allclose(inv_freq[-5:], plain[-5:] / 40.0)
    assert magnitude == 1.0  # mscale == mscale_all_dim: the tables keep their size, the softmax scale grows
    assert DeepseekV3Config.from_dict({**TINY, "rope_scaling": dict(type="yarn", factor=40.0, mscale_all_dim=1.0)}
                                      ).softmax_scale() == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(12))


@pytest.mark.parametrize("overrides, fragments", [
    (dict(n_routed_expert=8), ["model.n_routed_expert", "n_routed_experts"]),
    (dict(n_group=3), ["model.n_routed_experts", "model.n_group"]),
    (dict(topk_group=5), ["model.topk_group"]),
    (dict(num_experts_per_tok=5), ["model.num_experts_per_tok"]),
    (dict(moe_layer_freq=[1, 0, 1]), ["model.moe_layer_freq"]),
    (dict(moe_router_score_function="relu"), ["model.moe_router_score_function"]),
    (dict(moe_router_load_balancing_type="sub_seq_aux_loss"), ["model.moe_router_load_balancing_type"]),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), ["model.rope_scaling.rope_type", "yarn"]),
    (dict(rope_scaling=dict(type="yarn", factr=2.0)), ["model.rope_scaling.factr", "factor"]),
    (dict(qk_rope_head_dim=5), ["model.qk_rope_head_dim"]),
    (dict(architectures="Qwen3ForCausalLM"), ["model.architectures", "DeepseekV3ForCausalLM"]),
])
def test_config_errors_name_the_field(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        build_model({**SECTION, **overrides}, seed=0)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_moe_monitor_reports_every_interval_for_the_target_layers():
    from training.config import MoeMonitorConfig
    from training.monitor import MoeMonitor

    names = ["decoder.layers.1", "decoder.layers.2", "decoder.layers.3", "mtp.layers.0"]
    counts = {name: [i, i + 1] for i, name in enumerate(names)}
    monitor = MoeMonitor(MoeMonitorConfig(save_tokens_per_expert_interval=3, target_layers=[2]), names)
    assert monitor.record(2, counts) == {}
    assert monitor.record(6, counts) == {"tokens_per_expert": {"decoder.layers.2": [1, 2], "mtp.layers.0": [3, 4]}}
    first_two = MoeMonitor(MoeMonitorConfig(save_tokens_per_expert_interval=1, target_layers=2), names)
    assert list(first_two.record(1, counts)["tokens_per_expert"]) == ["decoder.layers.1", "mtp.layers.0"]
    assert MoeMonitor(MoeMonitorConfig(), names).record(10, counts) == {}  # off by default
    with pytest.raises(ConfigError, match="monitor.moe_monitor.save_tokens_per_expert_interval.*no MoE layers"):
        MoeMonitor(MoeMonitorConfig(save_tokens_per_expert_interval=1), [])


def test_the_compiled_step_equals_the_eager_one_and_resumes_bit_identically(tmp_path, shard, monkeypatch):
    """MLA, MoE (static dispatch, group-limited routing, sequence aux loss, expert biases) and MTP in one compiled
    graph per step: the same losses and loss parts (rtol 1e-5), routing (tokens per expert, expert biases: equal),
    grad norms (rtol 1e-5) and weights (atol 1e-6, with conftest's rule for near-zero gradients under Adam) as the
    eager step, and a resume from its checkpoint repeats its losses bit for bit. One MoE layer and one MTP depth keep
    the graph's compile time down. The two MoE layers (the decoder's and the MTP depth's) share one parsed layer
    graph (MindSpore's lazy_inline, keyed by TransformerLayer.graph_key): their routing statistics leave it as
    outputs, which the caller keeps per layer, so each layer's tokens per expert and the balancing loss still equal
    the eager step's."""
    from mindspore.graph._parse.parser import Parser

    from training.config import load_config
    from training.reporting import Reporter
    from training.step import configure_runtime
    from training.trainer import Trainer

    def trainer(name, *overrides):
        config = load_config(PROJECT_ROOT / "tests/configs/deepseek_v3_micro.yaml", [
            *shard_data(shard), "training.steps=3", "training.global_batch_size=2",
            "model.num_hidden_layers=1", "model.first_k_dense_replace=0", "checkpoint.save_interleaved_steps=1",
            "monitor.moe_monitor.save_tokens_per_expert_interval=1",
            f"checkpoint.save_path={tmp_path / name / 'checkpoints'}", *overrides])
        configure_runtime(config)
        return Trainer(config, World(rank=0, size=1), tmp_path / name,
                       Reporter(tmp_path / name / "metrics.jsonl", enabled=True))

    def records(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    parsed = []
    parse = Parser.__init__

    def counting_parse(self, fn, *args, **kwargs):
        parsed.append(getattr(fn, "__qualname__", None))
        return parse(self, fn, *args, **kwargs)

    compiled = trainer("compiled", "fast_step.compile=true")
    assert compiled.step_mode.startswith("whole step compiled"), compiled.step_mode
    assert len(compiled.model.moe_layers()) == 2
    with monkeypatch.context() as patched:
        patched.setattr(Parser, "__init__", counting_parse)
        compiled.train()
    assert (parsed.count("TransformerLayer.construct"), parsed.count("MoELayer._dispatch_in_graph")) == (1, 1)
    eager = trainer("eager")
    eager.train()
    parts = ["loss", "lm_loss", "mtp_1_loss", "load_balancing_loss", "grad_norm"]
    for name in parts:
        np.testing.assert_allclose([r[name] for r in records("compiled")], [r[name] for r in records("eager")],
                                   rtol=1e-5, err_msg=name)
    assert [r["tokens_per_expert"] for r in records("compiled")] == [r["tokens_per_expert"] for r in records("eager")]
    for got, want in zip(compiled.model.get_parameters(), eager.model.get_parameters()):
        assert_adam_weights_close(got.asnumpy(), want.asnumpy(), 1e-6, got.name)

    resumed = trainer("resumed", "fast_step.compile=true",
                      f"checkpoint.load_path={tmp_path / 'compiled/checkpoints/iteration_00000002'}")
    from safetensors.numpy import load_file  # expert biases are saved and loaded with the weights
    saved = load_file(next((tmp_path / "compiled/checkpoints/iteration_00000002").glob("*-model-*.safetensors")))
    bias = dict(resumed.model.moe_layers())["decoder.layers.0"].expert_bias.asnumpy()
    assert np.abs(bias).max() > 0
    np.testing.assert_array_equal(bias, saved["decoder.layers.0.mlp.expert_bias"])
    resumed.train()
    assert [r["loss"] for r in records("resumed")] == [r["loss"] for r in records("compiled")][2:]
    assert all(np.array_equal(a.asnumpy(), b.asnumpy())
               for a, b in zip(compiled.model.get_parameters(), resumed.model.get_parameters()))


# ---- training under msrun ------------------------------------------------------------------------------

def write_learnable_documents(prefix, used=64, documents=120):
    """Documents counting up through ``used`` of the 512 ids by a per-document stride: predictable next
    tokens from a small alphabet, so the loss falls within a few steps."""
    from training.data.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(documents):
            start, stride, length = rng.integers(0, used), rng.integers(1, 4), rng.integers(20, 60)
            body = 4 + (start + stride * np.arange(length)) % used
            writer.add_document(np.append(body, 2).astype(np.uint16))
    return prefix


@pytest.mark.msrun
def test_trains_under_msrun_with_two_workers(tmp_path):
    shard = write_learnable_documents(tmp_path / "shard")
    run_dir = tmp_path / "run"
    overrides = [*shard_data(shard), f"checkpoint.save_path={run_dir / 'checkpoints'}", "training.steps=6",
                 "lr_scheduler.learning_rate=1.0e-2", "checkpoint.save_interleaved_steps=6"]
    script = ["-m", "training.run", "--config", str(PROJECT_ROOT / "tests/configs/deepseek_v3_micro.yaml"),
              "--output-dir", str(run_dir), *[a for o in overrides for a in ("--set", o)]]
    run_under_msrun(script, tmp_path / "logs", workers=2, timeout=600)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert metrics[-1]["lm_loss"] < metrics[0]["lm_loss"] - 0.5
    assert metrics[-1]["mtp_1_loss"] < metrics[0]["mtp_1_loss"]
    for m in metrics:
        assert m["loss"] == pytest.approx(m["lm_loss"] + 0.3 * m["mtp_1_loss"] + m["load_balancing_loss"], rel=1e-4)
    # monitor.moe_monitor every 2 steps: each step's tokens summed over both ranks (2 micro-batches of 2 x 32)
    tokens = [m["tokens_per_expert"] for m in metrics if "tokens_per_expert" in m]
    assert [m["step"] for m in metrics if "tokens_per_expert" in m] == [2, 4, 6]
    for record in tokens:
        assert set(record) == {"decoder.layers.1", "mtp.layers.0"}
        assert all(sum(counts) == 4 * 32 * 2 for counts in record.values())
    # both ranks applied the same bias updates: the checkpoint's biases moved, identically in every file
    from safetensors.numpy import load_file
    files = sorted((run_dir / "checkpoints" / "iteration_00000006").glob("*-model-*.safetensors"))
    biases = [load_file(f)["decoder.layers.1.mlp.expert_bias"] for f in files]
    assert np.abs(biases[0]).max() > 0
    for other in biases[1:]:
        np.testing.assert_array_equal(other, biases[0])


def test_flops_per_token_count_only_the_experts_a_token_visits():
    """6 x the weights a token passes through, counted by hand for TINY, + the attention score matmuls."""
    attention = 32 * (24 + 16 + 4) + 24 * 2 * 12 + 16 * 2 * 16 + 16 * 32 + (32 + 24 + 16 + 32)  # + its norms
    dense = 32 * 2 * 64 + 64 * 32
    moe = 8 * 32 + 3 * (32 * 2 * 16 + 16 * 32) + (32 * 2 * 16 + 16 * 32)  # router, top-3 of 8, shared expert
    output = 128 * 32  # the untied output layer; the input embedding is a lookup
    mtp = 32 + 32 + 2 * 32 * 32 + 32 + attention + moe + output  # enorm, hnorm, eh_proj, norm, layer, head again
    visited = attention + dense + attention + moe + 32 + output + mtp
    scores = 6 * 3 * 2 * (12 + 8) * 16  # 3 attention layers x 2 heads x (qk 12 + v 8) x seq 16
    assert tiny_model().flops_per_token(16) == 6 * visited + scores
