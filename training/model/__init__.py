"""Model registry: the YAML ``model:`` section picks a model by ``model_type`` + ``architectures``,
as MindFormers does; every other key in the section configures that model."""
from __future__ import annotations

import os

from training.config import ConfigError, TrainConfig, require
from training.model.deepseek_v3 import DeepseekV3Config
from training.model import mindformers_keys
from training.model.gpt import GPTConfig, GPTModel
from training.model.qwen3 import Qwen3Config

# model_type -> (architecture, config class)
SUPPORTED = {"qwen3": ("Qwen3ForCausalLM", Qwen3Config),
             "deepseek_v3": ("DeepseekV3ForCausalLM", DeepseekV3Config)}


def register_model(model_type: str, architecture: str, config_class: type[GPTConfig]) -> None:
    """Let ``model.model_type: <model_type>`` (with ``model.architectures: <architecture>``) build a GPTModel of
    ``config_class``: a GPTConfig family whose layer specs name its layers, each declaring how every parallelism
    cuts it (training/parallel/parallelize.py lists what a model declares). tests/plain_gpt.py registers one."""
    if SUPPORTED.get(model_type, (architecture, config_class)) != (architecture, config_class):
        raise ValueError(f"model_type {model_type!r} is registered already ({SUPPORTED[model_type][0]})")
    SUPPORTED[model_type] = (architecture, config_class)


def _architecture(value) -> str:
    """MindFormers accepts a string or a one-element list (HF config.json style)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ConfigError(f"model.architectures: expected a string or a one-element list, got {value!r}")
    return value


def model_config(model_section: dict) -> GPTConfig:
    """The family config (Qwen3Config / DeepseekV3Config) named by ``model.model_type``/``model.architectures``,
    every other key of the YAML ``model:`` dict validated as MindFormers reads it (its other spellings folded
    in, keys it ignores logged, see ``mindformers_keys``); no network is built."""
    if not isinstance(model_section, dict):
        raise ConfigError(f"model: expected a mapping, got {model_section!r}")
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
    return config_class.from_dict(mindformers_keys.resolve(settings, model_type), "model")


def build_model(model_section: dict, seed: int | None = None) -> GPTModel:
    """Build the model named by ``model.model_type``/``model.architectures`` from the YAML ``model:`` dict."""
    return GPTModel(model_config(model_section), seed=seed)


def validate_model_section(config: TrainConfig, tokenizer_model: str | os.PathLike | None = None) -> GPTConfig:
    """Check ``model:`` before launch as the workers will build it (model.seq_length, which load_config sets
    to the samples' length, within max_position_embeddings) and, given the sentencepiece ``tokenizer_model``
    the data was tokenized with, against its vocabulary. Not part of ``load_config``: the model package
    imports MindSpore, which the Dagster process and the CLI load only to launch."""
    model = model_config(config.model)  # with load_config's model.seq_length: the samples' length
    if tokenizer_model is not None:
        import sentencepiece

        try:
            vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model)).vocab_size()
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"{tokenizer_model}: not a readable sentencepiece model ({exc})") from None
        require(vocab <= model.vocab_size,
                f"model.vocab_size = {model.vocab_size} is smaller than the vocabulary of the tokenizer the data "
                f"was tokenized with ({vocab} ids, {tokenizer_model}): ids from {model.vocab_size} up have no "
                f"embedding")
    return model


__all__ = ["DeepseekV3Config", "GPTModel", "Qwen3Config", "build_model", "model_config", "register_model",
           "validate_model_section"]
