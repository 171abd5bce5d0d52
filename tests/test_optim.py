"""AdamW against a numpy reference, LR schedules, clipping, optimizer state, and a tiny model that learns."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor

from training.config import ConfigError, LrSchedulerConfig
from training.model import Qwen3Config
from training.model.qwen3 import GPTModel
from training.optim import (AdamW, ConstantWarmUpLR, CosineWithWarmUpLR, LinearWithWarmUpLR, NonFiniteStepError,
                            SkipStepOnNaN, WarmUpStableDecayLR, build_lr_schedule, build_optimizer, clip_grad_norm,
                            uses_weight_decay)

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

SHAPES = {"layer.weight": (3, 4), "layer.bias": (3,), "norm.weight": (4,), "special.weight": (2, 2),
          "layer.out_bias_like.bias": (2, 3)}


def make_params(seed=0):
    rng = np.random.RandomState(seed)
    return [(name, Parameter(Tensor(rng.randn(*shape).astype(np.float32)), name=name))
            for name, shape in SHAPES.items()]


def make_grads(seed):
    rng = np.random.RandomState(seed)
    return tuple(Tensor(rng.randn(*shape).astype(np.float32)) for shape in SHAPES.values())


def numpy_adamw(p, g, m, v, step, lr, decay, betas=(0.9, 0.95), eps=1e-8, wd=0.1):
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    if decay:
        p = p * (1 - lr * wd)
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def test_weight_decay_groups():
    params = dict(make_params())
    default = {n: uses_weight_decay(n, p) for n, p in params.items()}
    assert default == {"layer.weight": True, "layer.bias": False, "norm.weight": False, "special.weight": True,
                       "layer.out_bias_like.bias": False}
    p = params["norm.weight"]
    assert uses_weight_decay("norm.weight", p, include=["norm.weight"])      # exact
    assert uses_weight_decay("norm.weight", p, include=["norm"])             # substring
    assert uses_weight_decay("norm.weight", p, include=["*.weight"])         # wildcard
    assert not uses_weight_decay("special.weight", params["special.weight"], exclude=["spec*"])
    assert uses_weight_decay("special.weight", params["special.weight"], include=["special"], exclude=["special"])


def step_alongside_numpy(opt, named, decays: dict) -> dict:
    """Three steps of ``opt`` (lr 0.01·step) and of numpy_adamw on the same gradients; the reference
    (param, m, v) per name."""
    ref = {n: (p.asnumpy().astype(np.float64), 0.0, 0.0) for n, p in named}
    for step in (1, 2, 3):
        grads = make_grads(seed=step)
        opt.step(grads)
        for (name, _), g in zip(named, grads):
            p, m, v = ref[name]
            ref[name] = numpy_adamw(p, g.asnumpy().astype(np.float64), m, v, step, 0.01 * step, decays[name])
        assert opt.global_step == step and opt.current_lr == pytest.approx(0.01 * step)
    return ref


def test_adamw_matches_numpy_reference():
    named = make_params()
    schedule = lambda step: 0.01 * step  # noqa: E731 — distinct lr per step checks the step counter
    opt = AdamW(named, lr_schedule=schedule, weight_decay=0.1,
                weight_decay_include=["norm.*"], weight_decay_exclude=["special"])
    decays = {"layer.weight": True, "layer.bias": False, "norm.weight": True, "special.weight": False,
              "layer.out_bias_like.bias": False}
    ref = step_alongside_numpy(opt, named, decays)
    for name, param in named:
        np.testing.assert_allclose(param.asnumpy(), ref[name][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(opt.state_dict()[f"adam_m.{name}"], ref[name][1], rtol=1e-5, atol=1e-7)


def test_state_round_trip():
    named_a = make_params()
    opt_a = AdamW(named_a, lr_schedule=lambda s: 1e-2)
    for step in (1, 2):
        opt_a.step(make_grads(step))
    state = opt_a.state_dict()
    assert state["global_step"].dtype == np.int64 and state["global_step"].tolist() == [2]
    assert set(state) == {"global_step"} | {f"adam_{k}.{n}" for k in "mv" for n in SHAPES}

    named_b = [(n, Parameter(Tensor(p.asnumpy()), name=n)) for n, p in named_a]
    opt_b = AdamW(named_b, lr_schedule=lambda s: 1e-2)
    opt_b.load_state_dict(state)
    for key, array in opt_b.state_dict().items():
        np.testing.assert_array_equal(array, state[key])
    opt_a.step(make_grads(3))
    opt_b.step(make_grads(3))
    for (_, a), (_, b) in zip(named_a, named_b):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_low_precision_params_update_through_fp32_masters():
    """float16 params: the update is AdamW's on an fp32 master (main_param.<name>, MindFormers' name), and the
    param is the master rounded to float16; fp32 params have no master."""
    named = [(n, Parameter(Tensor(p.asnumpy().astype(np.float32 if n == "layer.weight" else np.float16)), name=n))
             for n, p in make_params()]
    opt = AdamW(named, lr_schedule=lambda step: 0.01 * step, weight_decay=0.1)
    ref = step_alongside_numpy(opt, named, {name: uses_weight_decay(name, param) for name, param in named})
    state = opt.state_dict()
    assert {k for k in state if k.startswith("main_param.")} == {f"main_param.{n}" for n in SHAPES} - {
        "main_param.layer.weight"}
    for name, param in named[1:]:
        master = state[f"main_param.{name}"]
        np.testing.assert_allclose(master, ref[name][0], rtol=1e-5, atol=1e-6)
        assert param.dtype == ms.float16
        np.testing.assert_array_equal(param.asnumpy(), master.astype(np.float16))


def test_updates_below_float16_rounding_accumulate_in_the_master():
    param = Parameter(Tensor(np.ones(4, np.float16)), name="w")
    opt = AdamW([("w", param)], lr_schedule=lambda step: 1e-4, weight_decay=0.0)
    ones = (Tensor(np.ones(4, np.float32)),)
    opt.step(ones)
    assert param.asnumpy().tolist() == [1.0] * 4  # 1 - 1e-4 rounds back to 1 in float16
    for _ in range(9):
        opt.step(ones)
    assert opt.state_dict()["main_param.w"][0] == pytest.approx(1 - 1e-3, rel=1e-5)
    assert param.asnumpy()[0] == np.float16(1 - 1e-3) < 1.0


def test_masters_start_from_weights_loaded_after_the_optimizer_was_built():
    param = Parameter(Tensor(np.ones(4, np.float16)), name="w")
    opt = AdamW([("w", param)], lr_schedule=lambda step: 1e-2, weight_decay=0.0)
    param.set_data(Tensor(np.full(4, 2.0, np.float16)))  # what a weights-only resume does
    opt.step((Tensor(np.ones(4, np.float32)),))
    assert param.asnumpy()[0] == np.float16(2.0 - 1e-2)


def test_load_state_errors_name_the_tensor():
    opt = AdamW(make_params(), lr_schedule=lambda s: 1e-2)
    state = opt.state_dict()
    missing = {k: v for k, v in state.items() if k != "adam_v.norm.weight"}
    with pytest.raises(ValueError, match="adam_v.norm.weight"):
        opt.load_state_dict(missing)
    with pytest.raises(ValueError, match="adam_m.layer.weight"):
        opt.load_state_dict({**state, "adam_m.layer.weight": np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError, match="adam_m.other"):
        opt.load_state_dict({**state, "adam_m.other": np.zeros(1, np.float32)})


# ---- schedules ------------------------------------------------------------------------------------------

def test_linear_schedule():
    lr = LinearWithWarmUpLR(learning_rate=1.0, total_steps=110, warmup_steps=10, lr_end=0.1)
    assert [lr(s) for s in (0, 5, 10)] == pytest.approx([0.0, 0.5, 1.0])
    assert lr(60) == pytest.approx(0.55) and lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)


def test_cosine_schedule_with_warmup_ratio_and_init():
    lr = CosineWithWarmUpLR(learning_rate=1.0, total_steps=100, warmup_ratio=0.1, warmup_lr_init=0.2)
    assert lr.warmup_steps == 10
    assert lr(0) == pytest.approx(0.2) and lr(5) == pytest.approx(0.6) and lr(10) == pytest.approx(1.0)
    assert lr(55) == pytest.approx(0.5) and lr(100) == pytest.approx(0.0)


def test_constant_schedule():
    lr = ConstantWarmUpLR(learning_rate=3e-4, total_steps=100, warmup_steps=4)
    assert lr(2) == pytest.approx(1.5e-4) and lr(4) == lr(99) == pytest.approx(3e-4)
    assert ConstantWarmUpLR(learning_rate=1.0, total_steps=10)(0) == 1.0


def test_build_lr_schedule():
    lr = build_lr_schedule({"type": "CosineWithWarmUpLR", "learning_rate": 1.0, "warmup_steps": 0,
                            "lr_end": 0.0, "total_steps": 5}, total_steps=20)
    assert lr.total_steps == 20  # training.steps wins, as in MindFormers
    with pytest.raises(ConfigError, match=r"lr_scheduler\.warmup_step\b.*warmup_steps"):
        build_lr_schedule({"type": "LinearWithWarmUpLR", "learning_rate": 1.0, "warmup_step": 3}, 10)
    with pytest.raises(ConfigError, match=r"lr_scheduler\.type.*CosineWithWarmUpLR"):
        build_lr_schedule({"type": "PolynomialWithWarmUpLR", "learning_rate": 1.0}, 10)
    with pytest.raises(ConfigError, match="warmup_steps or warmup_ratio"):
        build_lr_schedule({"type": "LinearWithWarmUpLR", "learning_rate": 1.0, "warmup_steps": 1,
                           "warmup_ratio": 0.1}, 10)


def test_build_optimizer():
    opt = build_optimizer({"type": "AdamW", "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.0,
                           "weight_decay_include": [], "weight_decay_exclude": []}, make_params(), lambda s: 1e-3)
    assert (opt.beta1, opt.beta2, opt.eps) == (0.8, 0.9, 1e-6)
    with pytest.raises(ConfigError, match=r"optimizer\.weight_dacay.*weight_decay"):
        build_optimizer({"type": "AdamW", "weight_dacay": 0.1}, make_params(), lambda s: 1e-3)
    with pytest.raises(ConfigError, match=r"optimizer\.type.*AdamW"):
        build_optimizer({"type": "Muon"}, make_params(), lambda s: 1e-3)


# ---- clipping -------------------------------------------------------------------------------------------

def test_clip_grad_norm():
    grads = (Tensor(np.array([3.0, 0.0], np.float32)), Tensor(np.array([[4.0]], np.float32)))
    clipped, norm = clip_grad_norm(grads, max_norm=1.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_allclose(clipped[0].asnumpy(), [0.6, 0.0], rtol=1e-5)
    np.testing.assert_allclose(clipped[1].asnumpy(), [[0.8]], rtol=1e-5)
    unclipped, norm = clip_grad_norm(grads, max_norm=10.0)
    assert norm == pytest.approx(5.0)
    np.testing.assert_array_equal(unclipped[0].asnumpy(), grads[0].asnumpy())


# ---- end to end -----------------------------------------------------------------------------------------

def test_tiny_model_memorizes_a_batch():
    config = Qwen3Config.from_dict(dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, seq_length=32,
                                        max_position_embeddings=32, compute_dtype="float32", hidden_dropout=0.0))
    model = GPTModel(config, seed=0)
    params = model.trainable_params()
    opt = AdamW([(p.name, p) for p in params], lr_schedule=ConstantWarmUpLR(learning_rate=3e-3, total_steps=30))
    grad_fn = ms.value_and_grad(model, None, params)
    tokens = np.random.RandomState(0).randint(0, 256, (4, 33)).astype(np.int32)
    batch = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((4, 32), np.float32))
    losses = []
    for _ in range(30):
        loss, grads = grad_fn(*batch)
        grads, _ = clip_grad_norm(grads, 1.0)
        opt.step(grads)
        losses.append(float(loss.asnumpy()))
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    assert losses[-1] < 0.5 * losses[0], losses


# ---- warm-up, stable, decay -----------------------------------------------------------------------------

def test_warmup_stable_decay_schedule():
    lr = WarmUpStableDecayLR(learning_rate=1.0, total_steps=100, warmup_steps=10, warmup_lr_init=0.2,
                             decay_start_steps=60, lr_end=0.1)
    assert lr(0) == pytest.approx(0.2) and lr(5) == pytest.approx(0.6)          # warm-up
    assert lr(10) == lr(35) == lr(59) == pytest.approx(1.0)                      # stable
    assert lr(60) == pytest.approx(1.0) and lr(80) == pytest.approx(0.55)        # linear decay
    assert lr(100) == pytest.approx(0.1) and lr(150) == pytest.approx(0.1)


def test_warmup_stable_decay_ratios_and_mindformers_default_lr_end():
    lr = WarmUpStableDecayLR(learning_rate=1.0, total_steps=200, warmup_ratio=0.05, decay_start_ratio=0.9)
    assert (lr.warmup_steps, lr.decay_start_steps) == (10, 180)
    assert lr(179) == 1.0 and lr(190) == pytest.approx(0.5 + 0.5e-7) and lr(200) == pytest.approx(1e-7)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "decay_start_steps or decay_start_ratio"),
    ({"decay_start_steps": 50, "decay_start_ratio": 0.5}, "decay_start_steps or decay_start_ratio"),
    ({"decay_start_steps": 5, "warmup_steps": 10}, "between the end of warm-up"),
    ({"decay_start_steps": 101}, "between the end of warm-up"),
    ({"decay_start_steps": 50, "lr_end": 1.0}, r"lr_scheduler\.lr_end"),
])
def test_warmup_stable_decay_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        WarmUpStableDecayLR(learning_rate=1.0, total_steps=100, **kwargs)


def test_build_warmup_stable_decay_and_keys_of_other_schedules():
    lr = build_lr_schedule({"type": "WarmUpStableDecayLR", "learning_rate": 1.0, "decay_start_ratio": 0.5}, 10)
    assert lr.decay_start_steps == 5 and lr.total_steps == 10
    with pytest.raises(ConfigError, match=r"lr_scheduler\.decay_start_steps: unknown key"):
        build_lr_schedule({"type": "CosineWithWarmUpLR", "learning_rate": 1.0, "decay_start_steps": 3}, 10)


def test_lr_scheduler_section_checks_warmup_stable_decay_fields():
    parse = lambda section: LrSchedulerConfig.from_dict(section, "lr_scheduler")  # noqa: E731
    section = parse({"type": "WarmUpStableDecayLR", "decay_start_ratio": 0.8})
    assert section.decay_start_ratio == 0.8 and section.lr_end is None
    with pytest.raises(ConfigError, match=r"lr_scheduler: WarmUpStableDecayLR needs decay_start_steps"):
        parse({"type": "WarmUpStableDecayLR"})
    with pytest.raises(ConfigError, match=r"lr_scheduler\.decay_start_ratio must be in \[0, 1\]"):
        parse({"type": "WarmUpStableDecayLR", "decay_start_ratio": 1.5})
    with pytest.raises(ConfigError, match=r"lr_scheduler\.decay_start_steps applies to WarmUpStableDecayLR only"):
        parse({"type": "CosineWithWarmUpLR", "decay_start_steps": 5})


# ---- NaN/Inf steps --------------------------------------------------------------------------------------

def test_nan_or_inf_stops_training_unless_skipping_is_on():
    with pytest.raises(NonFiniteStepError, match=r"step 7: loss = nan.*use_skip_step_on_nan"):
        SkipStepOnNaN(enabled=False, max_consecutive=0).should_skip(7, float("nan"), 1.0)
    with pytest.raises(NonFiniteStepError, match=r"step 3: loss = 2.0, grad_norm = inf"):
        SkipStepOnNaN(enabled=False, max_consecutive=0).should_skip(3, 2.0, float("inf"))
    assert not SkipStepOnNaN(enabled=False, max_consecutive=0).should_skip(1, 2.0, 1.0)


def test_skips_count_consecutive_steps_and_stop_past_the_limit():
    policy = SkipStepOnNaN(enabled=True, max_consecutive=2)
    assert policy.should_skip(1, float("nan"), 1.0) and policy.should_skip(2, 1.0, float("nan"))
    assert not policy.should_skip(3, 1.0, 1.0) and policy.consecutive == 0  # a good step resets the run
    assert policy.should_skip(4, float("inf"), 1.0) and policy.should_skip(5, float("nan"), float("nan"))
    with pytest.raises(NonFiniteStepError, match=r"step 6: .*3 steps in a row.*max_consecutive_skipped_steps = 2"):
        policy.should_skip(6, float("nan"), 1.0)
    unlimited = SkipStepOnNaN(enabled=True, max_consecutive=0)
    assert all(unlimited.should_skip(step, float("nan"), 1.0) for step in range(1, 50))
    assert unlimited.total == 49
