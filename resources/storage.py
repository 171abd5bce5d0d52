"""Where Kiln's files live: one data root for the data assets, one runs root for training runs."""
from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from training.config import check_plain_name

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class KilnStorage(dg.ConfigurableResource):
    """Layout under ``data_root``: ``raw/<source>/``, ``tokenizer/``, ``shards/<source>/``, ``blend/``.

    Defaults come from ``KILN_DATA_ROOT`` / ``KILN_RUNS_ROOT`` / ``KILN_SOURCES`` or sit in the project.
    On a cluster, point both roots at shared storage that every node mounts at the same path.
    """

    data_root: str = os.environ.get("KILN_DATA_ROOT", str(PROJECT_ROOT / "data"))
    runs_root: str = os.environ.get("KILN_RUNS_ROOT", str(PROJECT_ROOT / "runs"))
    sources_config: str = os.environ.get("KILN_SOURCES", str(PROJECT_ROOT / "configs" / "sources.yaml"))

    @property
    def root(self) -> Path:
        return Path(self.data_root).resolve()

    def raw_dir(self, chunk: str) -> Path:
        """`raw/<chunk>/`: `raw/<source>/` for an unchunked source, `raw/<source>/NNNNN/` for a chunk of one."""
        return self.root / "raw" / "/".join(check_plain_name(part, "chunk") for part in chunk.split("/"))

    def tokenizer_prefix(self) -> Path:
        return self.root / "tokenizer" / "kiln"

    def shard_prefix(self, source: str) -> Path:
        return self.root / "shards" / check_plain_name(source, "source") / f"{source}_text_document"

    def manifest_path(self) -> Path:
        return self.root / "blend" / "manifest.json"

    def run_dir(self, run_name: str) -> Path:
        return Path(self.runs_root).resolve() / check_plain_name(run_name, "run_name")
