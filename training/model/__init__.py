"""Model registry: the YAML ``model:`` section picks a model by ``model_type`` + ``architectures``,
as MindFormers does; every other key in the section configures that model."""
from __future__ import annotations

from training.config import ConfigError
from training.model.deepseek_v3 import DeepseekV3Config
from training.model.gpt import GPTModel
from training.model.qwen3 import Qwen3Config

# model_type -> (architecture, config class)
SUPPORTED = {"qwen3": ("Qwen3ForCausalLM", Qwen3Config),
             "deepseek_v3": ("DeepseekV3ForCausalLM", DeepseekV3Config)}


def _architecture(value) -> str:
    """MindFormers accepts a string or a one-element list (HF config.json style)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ConfigError(f"model.architectures: expected a string or a one-element list, got {value!r}")
    return value


def build_model(model_section: dict, seed: int | None = None) -> GPTModel:
    """Build the model named by ``model.model_type``/``model.architectures`` from the YAML ``model:`` dict."""
    settings = dict(model_section)
    model_type = settings.pop("model_type", None)
    architecture = _architecture(settings.pop("architectures", None))
    supported = ", ".join(f"{t} ({a})" for t, (a, _) in SUPPORTED.items())
    if model_type not in SUPPORTED:
        raise ConfigError(f"model.model_type = {model_type!r} is not supported; supported: {supported}")
    expected_architecture, config_class = SUPPORTED[model_type]
    if architecture != expected_architecture:
        raise ConfigError(f"model.architectures = {architecture!r} does not match model_type {model_type!r}; "
                          f"supported: {supported}")
    return GPTModel(config_class.from_dict(settings, "model"), seed=seed)


__all__ = ["DeepseekV3Config", "GPTModel", "Qwen3Config", "build_model"]
