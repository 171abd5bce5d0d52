"""Kiln's one Definitions object, loaded by workspace.yaml."""
import dagster as dg

from assets.data import blend_manifest, raw_corpus, token_shards, tokenizer
from assets.training import checkpoint, training_run
from resources.msrun import MsrunResource
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings

ALL_ASSETS = [raw_corpus, tokenizer, token_shards, blend_manifest, training_run, checkpoint]


def resources(**overrides) -> dict:
    """Kiln's resources with their defaults; tests and the demo override single ones."""
    return {"storage": KilnStorage(), "tokenizer_settings": TokenizerSettings(), "msrun": MsrunResource(),
            **overrides}


defs = dg.Definitions(assets=ALL_ASSETS, resources=resources())
