"""One msrun worker of tests/test_tensor_parallel.py: every case compares a tensor-parallel forward+backward
with the single-process one on the same batch, built from the same seed in this process.

Usage (under msrun): python tests/tensor_parallel_worker.py OUT_DIR DP_REPLICATE
The world is DP_REPLICATE data-parallel replicas × tp = world / DP_REPLICATE; each replica draws its own batch.
Writes OUT_DIR/rank{r}.json: per case the two losses, the largest gradient error relative to the tensor's
largest reference gradient (and which tensor), whether the shards are the reference weights' slices, ...
"""
import json
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import yaml
from mindspore import Tensor

from training.model import build_model
from training.model.layers import token_cross_entropy
from training.parallel import comm
from training.parallel.mesh import DeviceMesh, ParallelDims, init_world
from training.parallel.tensor_parallel import VocabParallelCrossEntropy, apply_tensor_parallel

ROOT = Path(__file__).resolve().parent.parent
ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

SEED = 11


def micro_section(name: str, **changes) -> dict:
    return {**yaml.safe_load((ROOT / f"tests/configs/{name}.yaml").read_text())["model"], **changes}


def batch(section: dict, replica: int, documents: bool, batch_size: int = 2) -> tuple[Tensor, ...]:
    """Random ids, labels and loss mask; with ``documents``, two packed documents per sample (positions
    restarting and attention blocked at the boundary, as the dataset's reset_* options give)."""
    rng = np.random.default_rng(100 + replica)
    seq = section["seq_length"]
    shape = (batch_size, seq)
    ids = rng.integers(0, section["vocab_size"], shape).astype(np.int32)
    labels = rng.integers(0, section["vocab_size"], shape).astype(np.int32)
    mask = (rng.random(shape) > 0.25).astype(np.float32)
    if not documents:
        return Tensor(ids), Tensor(labels), Tensor(mask)
    boundary = seq // 2 - 3
    positions = np.concatenate([np.arange(boundary), np.arange(seq - boundary)]).astype(np.int32)
    document = np.arange(seq) >= boundary
    blocked = np.triu(np.ones((seq, seq), bool), k=1) | (document[:, None] != document[None, :])
    return (Tensor(ids), Tensor(labels), Tensor(mask), Tensor(np.tile(positions, (batch_size, 1))),
            Tensor(np.tile(blocked.astype(np.uint8), (batch_size, 1, 1, 1))))


def loss_and_grads(model, inputs):
    """The loss, each trainable parameter's gradient and the loss's named parts."""
    params = model.trainable_params()
    (loss, parts), grads = ms.value_and_grad(model.loss_and_parts, None, params, has_aux=True)(*inputs)
    return float(loss.asnumpy()), {p.name: g for p, g in zip(params, grads)}, model.named_parts(parts)


def whole(tensor: Tensor, layout, group) -> np.ndarray:
    """The global tensor of this rank's chunk: gathered over tp along the dim the layout splits."""
    if not layout.is_sharded:
        return tensor.asnumpy()
    dim = next(d for d, parts in enumerate(layout.fragmentations) if parts > 1)
    return comm.all_gather(tensor, dim, group).asnumpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def model_case(mesh, section: dict, sequence_parallel: bool, documents: bool = False) -> dict:
    group = mesh.group("tp")
    replica = mesh.dims.coords(mesh.rank)["dp_replicate"]
    inputs = batch(section, replica, documents)
    reference = build_model(section, seed=SEED)
    reference.track_max_attention_logits(True)
    reference_weights = {p.name: p.asnumpy() for p in reference.get_parameters()}
    want_loss, want_grads, reference_components = loss_and_grads(reference, inputs)
    reference_counts = [layer.take_counts() for _, layer in reference.moe_layers()]

    model = build_model(section, seed=SEED)
    plan = apply_tensor_parallel(model, mesh, sequence_parallel)
    model.track_max_attention_logits(True)
    got_loss, grads, components = loss_and_grads(model, inputs)
    max_logits_error = relative_error(model.pop_max_attention_logits(), reference.pop_max_attention_logits())
    # what the lead's gradient reduction does: partial gradients of replicated weights summed over tp
    grads = {name: comm.all_reduce(g, group) if name in plan.grads_to_all_reduce_over_tp else g
             for name, g in grads.items()}
    errors = {name: relative_error(whole(g, plan.layouts[name], group), want_grads[name].asnumpy())
              for name, g in grads.items()}
    worst = max(errors, key=errors.get)
    own_chunks = all(np.array_equal(p.asnumpy(), reference_weights[p.name][
        plan.layouts[p.name].chunk_slices(plan.layouts[p.name].chunk_of_rank[mesh.rank])])
        for p in model.get_parameters())
    counts = [layer.take_counts() for _, layer in model.moe_layers()]
    if sequence_parallel:  # each rank routed its part of the sequences
        counts = [comm.all_reduce_array(c.astype(np.float32), group) for c in counts]
    return {"loss": got_loss, "reference_loss": want_loss, "grad_error": errors[worst], "worst": worst,
            "parameters": len(errors), "reference_parameters": len(want_grads),
            "sharded": list(plan.sharded), "tp_reduced": list(plan.grads_to_all_reduce_over_tp),
            "own_chunks": own_chunks, "layouts_cover_parameters": sorted(plan.layouts) == sorted(reference_weights),
            "max_logits_error": max_logits_error,
            "expert_counts_match": all(np.array_equal(c, r) for c, r in zip(counts, reference_counts)),
            "loss_components": components, "reference_components": reference_components}


def cross_entropy_case(mesh) -> dict:
    """VocabParallelCrossEntropy on this rank's vocabulary slice against token_cross_entropy on all of it:
    per-token losses and the gradient of a weighted sum of them with respect to the logits."""
    group = mesh.group("tp")
    rng = np.random.default_rng(5)
    tokens, vocab = 24, 64
    logits = (rng.normal(size=(tokens, vocab)) * 4).astype(np.float32)
    labels = Tensor(rng.integers(0, vocab, tokens).astype(np.int32))
    weights = Tensor(rng.random(tokens).astype(np.float32))
    local = vocab // group.size
    start = group.rank * local

    def weighted(loss_fn):
        return lambda x: (loss_fn(x, labels) * weights).sum()

    want, want_grad = ms.value_and_grad(weighted(token_cross_entropy))(Tensor(logits))
    parallel = VocabParallelCrossEntropy(start, group)
    got, got_grad = ms.value_and_grad(weighted(parallel))(Tensor(logits[:, start:start + local]))
    per_token = parallel(Tensor(logits[:, start:start + local]), labels).asnumpy()
    return {"loss_error": relative_error(per_token, token_cross_entropy(Tensor(logits), labels).asnumpy()),
            "sum_error": relative_error(got.asnumpy(), want.asnumpy()),
            "grad_error": relative_error(got_grad.asnumpy(), want_grad.asnumpy()[:, start:start + local])}


def main():
    out_dir, dp_replicate = Path(sys.argv[1]), int(sys.argv[2])
    world = init_world()
    mesh = DeviceMesh(ParallelDims(world=world.size, dp_replicate=dp_replicate, tp=world.size // dp_replicate),
                      world.rank)
    qwen3, deepseek = micro_section("qwen3_micro"), micro_section("deepseek_v3_micro")
    results = {
        "qwen3": model_case(mesh, qwen3, sequence_parallel=False),
        "qwen3_sp": model_case(mesh, qwen3, sequence_parallel=True),
        "qwen3_sp_tied_bias_documents": model_case(
            mesh, {**qwen3, "tie_word_embeddings": True, "attention_bias": True}, sequence_parallel=True,
            documents=True),
        "deepseek_v3": model_case(mesh, deepseek, sequence_parallel=False),
        "deepseek_v3_sp": model_case(mesh, deepseek, sequence_parallel=True),
        "cross_entropy": cross_entropy_case(mesh),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{world.rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
