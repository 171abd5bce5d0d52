"""Blend manifest (docs/architecture.md, Blend manifest): which shards, with which weights, tokenized by which tokenizer.

Paths inside a manifest are relative to the data root, so a data root can move (or sit on shared
storage at another mount point); a path that escapes the root is rejected.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

MANIFEST_VERSION = 1


class ManifestError(ValueError):
    pass


def relative_to_root(path: str | Path, data_root: str | Path) -> str:
    """``path`` as a POSIX path relative to the data root; error when it lies outside."""
    root = Path(data_root).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise ManifestError(f"{path} is outside the data root {root}")
    return resolved.relative_to(root).as_posix()


def build_manifest(*, sources: list[dict], tokenizer: dict, seq_length: int, split: str, seed: int,
                   data_root: str | Path) -> dict:
    """``sources``: ``{"name", "weight", "shards": [{"prefix", "tokens", ...}], "raw_files": [...]}``.

    Weights are normalized over sources; inside a source, its weight is split over its shards in
    proportion to their tokens, so a source split into many shards keeps its share. Every weight in
    ``data_path`` must be > 0 (GPTDataset's blend refuses 0): a source of weight 0 or a shard of no tokens is
    refused here, naming it, rather than in training as a ``data_path[k]`` the user never wrote.
    """
    if not sources:
        raise ManifestError("a blend needs at least one source")
    for source in sources:
        weight = source["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ManifestError(f"source {source['name']!r}: weight must be a number > 0, got {weight!r} "
                                f"(to leave a source out of the blend, leave it out of the sources)")
    total_weight = sum(float(s["weight"]) for s in sources)
    out_sources, data_path = [], []
    for source in sorted(sources, key=lambda s: s["name"]):
        weight = float(source["weight"]) / total_weight
        shards = [{**shard, "prefix": relative_to_root(shard["prefix"], data_root)} for shard in source["shards"]]
        tokens = sum(int(shard["tokens"]) for shard in shards)
        if tokens == 0:
            raise ManifestError(f"source {source['name']!r} has no tokens")
        empty = [shard["prefix"] for shard in shards if int(shard["tokens"]) <= 0]
        if empty:
            raise ManifestError(f"source {source['name']!r}: shard {empty[0]} has no tokens, so no share of the "
                                f"blend (a weight 0 in data_path)")
        for shard in shards:
            data_path += [round(weight * int(shard["tokens"]) / tokens, 12), shard["prefix"]]
        out_sources.append({"name": source["name"], "weight": weight, "tokens": tokens, "shards": shards,
                            "raw_files": source.get("raw_files", []), "clean_files": source.get("clean_files", [])})
    return {"kiln_manifest_version": MANIFEST_VERSION, "seq_length": seq_length, "split": split, "seed": seed,
            "tokenizer": {**tokenizer, "path": relative_to_root(tokenizer["path"], data_root)},
            "sources": out_sources, "data_path": data_path}


def load_manifest(path: str | Path, data_root: str | Path) -> dict:
    return read_manifest(path, data_root)[0]


def read_manifest(path: str | Path, data_root: str | Path) -> tuple[dict, str]:
    """The manifest and the sha256 of the bytes it was parsed from: one read, so what a run takes from the
    manifest and the hash its lineage records cannot come from two versions of the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        manifest = json.loads(raw)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise ManifestError(f"{path}: unreadable manifest ({exc})") from None
    if manifest.get("kiln_manifest_version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: kiln_manifest_version {manifest.get('kiln_manifest_version')!r}, "
                            f"expected {MANIFEST_VERSION}")
    for i, item in enumerate(manifest["data_path"][1::2]):
        try:
            relative_to_root(item, data_root)
        except ManifestError as exc:
            raise ManifestError(f"{path}: data_path[{2 * i + 1}]: {exc}") from None
    return manifest, hashlib.sha256(raw).hexdigest()


def training_data_path(manifest: dict, data_root: str | Path) -> list:
    """The manifest's ``data_path`` with absolute prefixes, as ``train_dataset...config.data_path`` takes it."""
    root = Path(data_root).resolve()
    pairs = zip(manifest["data_path"][::2], manifest["data_path"][1::2])
    return [x for weight, prefix in pairs for x in (weight, str(root / prefix))]
