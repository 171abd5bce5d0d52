"""Kiln's Definitions sized for the browser test: a 512-piece tokenizer for the micro model.

Loaded by the workspace the browser test writes; the training YAML default comes from KILN_TRAIN_CONFIG.
"""
from pipelines.definitions import build_definitions, resources
from resources.tokenizer import TokenizerSettings

defs = build_definitions(resources(tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=20_000)))
