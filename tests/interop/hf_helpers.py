"""Shared by the Hugging Face interop tests: random Kiln/transformers models and logit comparison.

Weights are redrawn with a large spread (norm weights around 1, not exactly 1; MoE expert biases non-zero)
so a swapped or mis-permuted tensor changes the logits far beyond the 1e-4 tolerance."""
from __future__ import annotations

import numpy as np
import yaml

import mindspore as ms
from mindspore import Tensor

from training.model import build_model

# as the other model tests do: the device must be set before the first kernel runs, and setting the same
# one again later (a Trainer's configure_runtime) is then allowed
ms.set_device("CPU")

TOLERANCE = 1e-4


def model_section(config_yaml: str, **overrides) -> dict:
    with open(config_yaml) as f:
        return {**yaml.safe_load(f)["model"], **overrides}


def random_weights(shapes: dict[str, tuple], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("tokens_per_expert"):
            out[name] = np.zeros(shape, np.float32)
        elif "norm" in name:
            out[name] = (1 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.15 * rng.standard_normal(shape)).astype(np.float32)
    return out


def kiln_model(section: dict, weights: dict[str, np.ndarray] | None = None, seed: int = 0):
    """A Kiln model of ``section`` holding ``weights`` (random ones when None); returns (model, weights)."""
    model = build_model(section, seed=0)
    params = {p.name: p for p in model.get_parameters()}
    if weights is None:
        weights = random_weights({n: tuple(p.shape) for n, p in params.items()}, seed)
    assert set(weights) == set(params)
    for name, param in params.items():
        param.set_data(Tensor(weights[name]))
    return model, weights


def kiln_logits(model, ids: np.ndarray) -> np.ndarray:
    return model.logits(Tensor(ids.astype(np.int32))).asnumpy()


def hf_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def load_hf(model_class, hf_dir):
    """from_pretrained, insisting no weight of the model was left at its initialization."""
    import torch

    model, info = model_class.from_pretrained(hf_dir, output_loading_info=True, torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval(), info


def randomize_hf(hf_model, seed: int) -> None:
    """Redraw every parameter and buffer that is a weight (norms around 1, expert biases non-zero)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(hf_model.named_parameters()) + list(hf_model.named_buffers()):
            if "rotary_emb" in name or not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            tensor.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise)


def random_ids(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq))


def save_yaml(path, data: dict):
    path.write_text(yaml.safe_dump(data))
    return path
