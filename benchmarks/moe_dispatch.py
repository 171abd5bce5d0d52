"""MoE dispatch formulations, forward + backward of one MoE layer of configs/deepseek_v3_bench.yaml (2,048 tokens,
8 experts, top 2, one shared expert), eager and compiled, rounds alternating, each against the host-sorted
dispatch measured in the same round:

- host: the router's choices sorted by expert on the host, one batched matmul padded to the busiest expert's
  count (the layer's eager path, and its path under expert parallelism; its shapes change with the routing, so it
  cannot compile);
- blocks: the static dispatch (``GroupedExperts.dispatch``): rows/(2E)-row blocks, one expert each (the layer's
  compiled path; eager only here, for the comparison);
- dense: every expert on every token, each (token, choice) reading its expert's row: static too, E/k times the
  routed FLOPs.

Every variant's loss and gradients are checked against the host dispatch's first (fp32: the largest difference
at most 1e-5 of the tensor's largest value).

    python -m benchmarks.moe_dispatch [--rounds N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import numpy as np

CONFIG = Path(__file__).resolve().parents[1] / "configs/deepseek_v3_bench.yaml"


def _variants(layer, x, probe):
    """name -> a call returning (value, gradients) of sum(layer(x)·probe) w.r.t. x and the layer's weights."""
    import mindspore as ms
    from mindspore import nn, ops

    from training.model import moe
    from training.model.moe import GroupedExperts, _swiglu_experts

    class DenseExperts(GroupedExperts):
        def dispatch(self, tokens, expert_of_row, one_hot, counts, top_k):
            """``GroupedExperts.dispatch``'s contract, every expert computing every token."""
            num_experts, (num_tokens, hidden) = one_hot.shape[1], tokens.shape
            out = _swiglu_experts(ops.broadcast_to(tokens, (num_experts, num_tokens, hidden)), self.weight1,
                                  self.weight2)
            rows = expert_of_row * num_tokens + ops.arange(one_hot.shape[0], dtype=expert_of_row.dtype) // top_k
            return ops.gather(out.reshape(num_experts * num_tokens, hidden), rows, 0)

    class Objective(nn.Cell):
        def construct(self, inputs):
            return (layer(inputs)[0] * probe).sum()  # without its routing statistics

    def grad_fn(compiled: bool):
        fn = ms.value_and_grad(Objective(), 0, layer.trainable_params())
        return ms.jit(fn) if compiled else fn

    def variant(experts_class, fn, static_when_eager: bool = False):
        def call():  # a graph keeps the class it was compiled with; eager calls look it up each time
            layer.experts.__class__ = experts_class
            with mock.patch.object(moe, "compiling", return_value=True) if static_when_eager else nullcontext():
                return fn(x)
        return call

    return {"host (eager)": variant(GroupedExperts, grad_fn(False)),
            "blocks (eager)": variant(GroupedExperts, grad_fn(False), static_when_eager=True),
            "blocks (compiled)": variant(GroupedExperts, grad_fn(True)),
            "dense (eager)": variant(DenseExperts, grad_fn(False), static_when_eager=True),
            "dense (compiled)": variant(DenseExperts, grad_fn(True))}


def _flat(result) -> list[np.ndarray]:
    loss, (input_grad, weight_grads) = result
    return [loss.asnumpy(), input_grad.asnumpy(), *[g.asnumpy() for g in weight_grads]]


def run(report=print, rounds: int = 5) -> None:
    os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")  # as training.run: read when MindSpore loads
    import mindspore as ms
    from mindspore import Tensor

    from training.config import load_config
    from training.model import build_model
    from training.model.moe import MoELayer

    config = load_config(CONFIG)
    ms.set_seed(0)
    model = build_model(config.model)
    layer = next(moe for _, moe in model.moe_layers() if isinstance(moe, MoELayer))
    batch, seq = config.training.local_batch_size, config.train_dataset.dataloader.config.seq_length
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch, seq, model.config.hidden_size), dtype=np.float32))
    probe = Tensor(rng.standard_normal((batch, seq, model.config.hidden_size), dtype=np.float32))
    variants = _variants(layer, x, probe)
    reference = _flat(variants["host (eager)"]())
    for name, call in variants.items():  # warm-up and compile, and the same numbers from every formulation
        for got, want in zip(_flat(call()), reference):
            error = np.abs(got - want).max() / np.abs(want).max()
            assert error <= 1e-5, f"{name}: relative error {error:.2g} against the host dispatch"
        layer.take_counts()
    times = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:  # rotate the order
            started = time.perf_counter()
            _flat(variants[name]())
            times[name].append(time.perf_counter() - started)
    host = times["host (eager)"]
    report(f"MoE dispatch, one layer of {CONFIG.name} ({batch * seq} tokens, {layer.num_experts} experts, top "
           f"{layer.top_k}), forward + backward, median of {rounds} rounds:")
    for name, seconds in times.items():
        paired = statistics.median(h / s for h, s in zip(host, seconds))
        report(f"  {name:<18} {statistics.median(seconds) * 1000:7.1f} ms  ({paired:.2f}x the host dispatch, paired)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    run(rounds=parser.parse_args().rounds)
