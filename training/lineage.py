"""Lineage sidecars and the audit that re-verifies them (DESIGN.md 6).

Every checkpoint carries ``lineage.json``: the run (resolved config and its sha256), the blend manifest,
every shard, the tokenizer and every raw file, each with its sha256. Paths are stored relative to the
data root, so an audit also works after the data root moved (``--data-root``). The audit needs nothing
but the checkpoint directory and whatever files still exist.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from training.data.hashing import sha256_file
from training.data.manifest import load_manifest

LINEAGE_VERSION = 1


def lineage_inputs(manifest_path: str | Path, data_root: str | Path) -> dict:
    """The upstream part of a checkpoint's lineage, read from the blend manifest it trains on."""
    root = Path(data_root).resolve()
    manifest_path = Path(manifest_path).resolve()
    manifest = load_manifest(manifest_path, root)
    shards, raw_files = [], []
    total_weight = sum(source["weight"] for source in manifest["sources"])
    for source in manifest["sources"]:
        # the fraction of training samples drawn from this source (Megatron normalizes the blend weights),
        # split over its shards by tokens and over its raw files by bytes
        share = source["weight"] / total_weight
        source_tokens = sum(shard["tokens"] for shard in source["shards"]) or 1
        for shard in source["shards"]:
            for ext in ("bin", "idx"):
                shards.append({"source": source["name"], "path": f"{shard['prefix']}.{ext}",
                               "sha256": shard[f"{ext}_sha256"],
                               "token_share": share * shard["tokens"] / source_tokens})
        source_bytes = sum(raw.get("bytes", 0) for raw in source["raw_files"]) or 1
        raw_files += [{"source": source["name"], **raw, "token_share": share * raw.get("bytes", 0) / source_bytes}
                      for raw in source["raw_files"]]
    return {
        "kiln_lineage_version": LINEAGE_VERSION,
        "data_root": str(root),
        "manifest": {"path": manifest_path.relative_to(root).as_posix(), "sha256": sha256_file(manifest_path)},
        "shards": shards,
        "tokenizer": {"path": manifest["tokenizer"]["path"], "sha256": manifest["tokenizer"]["sha256"]},
        "raw_files": raw_files,
    }


@dataclass
class Check:
    link: str      # checkpoint, run config, manifest, shard, tokenizer, raw file
    path: str
    expected: str
    actual: str | None
    status: str    # ok | MISMATCH | missing

    def line(self) -> str:
        if self.status == "ok":
            return f"  ok        {self.link:<11} {self.path}  sha256 {self.expected[:16]}"
        if self.status == "missing":
            return f"  missing   {self.link:<11} {self.path}  (not found, not verified)"
        return (f"  MISMATCH  {self.link:<11} {self.path} changed since training "
                f"(sha256 {self.expected[:16]}… → {self.actual[:16]}…)")


class FileHashes:
    """sha256 of files, each computed once while the file stays as it was (same inode, size and mtime): a
    training step audits every checkpoint it saves against the same corpus, which need not be re-read."""

    def __init__(self):
        self._known: dict[Path, tuple[tuple[int, int, int], str]] = {}

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        known = self._known.get(path)
        if known is None or known[0] != identity:
            known = self._known[path] = (identity, sha256_file(path))
        return known[1]


def _check(link: str, path: Path, shown: str, expected: str, hashes: FileHashes | None) -> Check:
    if not path.is_file():
        return Check(link, shown, expected, None, "missing")
    actual = hashes.sha256(path) if hashes else sha256_file(path)
    return Check(link, shown, expected, actual, "ok" if actual == expected else "MISMATCH")


def _embedded_config_check(run: dict) -> Check:
    """The resolved config lineage.json carries, re-serialized as the trainer wrote it and re-hashed."""
    from training.config import config_sha256

    actual = config_sha256(yaml.safe_dump(run["config"], sort_keys=False))
    return Check("run config", "lineage.json run.config (config file not found)", run["config_sha256"], actual,
                 "ok" if actual == run["config_sha256"] else "MISMATCH")


def audit_checkpoint(checkpoint_dir: str | Path, data_root: str | Path | None = None,
                     hashes: FileHashes | None = None) -> tuple[dict, list[Check]]:
    """Re-hash every file the checkpoint's lineage names, in chain order from the checkpoint back to raw
    (through ``hashes``, when given, so unchanged files already hashed there are not read again)."""
    checkpoint_dir = Path(checkpoint_dir)
    lineage_path = checkpoint_dir / "lineage.json"
    try:
        lineage = json.loads(lineage_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{lineage_path}: unreadable lineage ({exc})") from None
    root = Path(data_root or lineage.get("data_root", "."))
    checks = [_check("checkpoint", checkpoint_dir / f["name"], f["name"], f["sha256"], hashes)
              for f in lineage["checkpoint"]["files"]]
    common_path = checkpoint_dir / "common.json"
    if common_path.is_file():
        same = json.loads(common_path.read_text()) == lineage["checkpoint"]["common"]
        checks.append(Check("checkpoint", "common.json", "as recorded", "as recorded" if same else "edited",
                            "ok" if same else "MISMATCH"))
    else:
        checks.append(Check("checkpoint", "common.json", "as recorded", None, "missing"))
    run = lineage["run"]
    config_check = _check("run config", Path(run["config_path"]), run["config_path"], run["config_sha256"], hashes)
    if config_check.status == "missing" and "config" in run:
        config_check = _embedded_config_check(run)  # e.g. the checkpoint was copied to another machine
    checks.append(config_check)
    # a run trained outside Dagster on hand-picked shards has no upstream links to check
    for link, key in (("manifest", "manifest"), ("shard", "shards"), ("tokenizer", "tokenizer"),
                      ("raw file", "raw_files")):
        records = lineage.get(key) or []
        for record in [records] if isinstance(records, dict) else records:
            checks.append(_check(link, root / record["path"], record["path"], record["sha256"], hashes))
    return lineage, checks


def audit_report(checkpoint_dir: Path, lineage: dict, checks: list[Check]) -> str:
    run = lineage["run"]
    step = lineage["checkpoint"]["step"]
    lines = [f"checkpoint {checkpoint_dir} (step {step})",
             f"  run: config sha256 {run['config_sha256'][:16]}, {run['world_size']} worker(s), "
             f"started {run['started_at']}" + (f", resumed from {run['resumed_from']}" if run["resumed_from"] else "")]
    lines += [c.line() for c in checks]
    bad = [c for c in checks if c.status == "MISMATCH"]
    missing = [c for c in checks if c.status == "missing"]
    if bad:
        first = bad[0]
        lines.append(f"FAILED: {first.link} {first.path} changed since training "
                     f"(sha256 {first.expected[:16]}… → {(first.actual or '')[:16]}…)")
    else:
        verified = len(checks) - len(missing)
        lines.append(f"OK: {verified} file(s) verified" + (f", {len(missing)} not found" if missing else ""))
    return "\n".join(lines)


def audit_exit_code(checks: list[Check]) -> int:
    """0 all verified, 1 a file changed, 3 nothing changed but some files were not found."""
    if any(c.status == "MISMATCH" for c in checks):
        return 1
    return 3 if any(c.status == "missing" for c in checks) else 0


def audit_json(checkpoint_dir: Path, lineage: dict, checks: list[Check]) -> str:
    return json.dumps({"checkpoint": str(checkpoint_dir), "step": lineage["checkpoint"]["step"],
                       "exit_code": audit_exit_code(checks), "checks": [asdict(c) for c in checks]}, indent=2)


@dataclass
class Consumer:
    run: str
    step: int
    checkpoint: str
    matched: str               # the lineage record that names the file, shard or source
    token_share: float | None  # its share of the run's training tokens; None in lineages older than shares


def _matches(record: dict, target: str) -> bool:
    path = record["path"]
    return target in (path, record.get("source")) or path.rsplit(".", 1)[0] == target or \
        target.endswith("/" + path)


def find_consumers(runs_root: str | Path, target: str) -> list[Consumer]:
    """Every checkpoint under ``runs_root`` whose lineage names ``target``: a raw file or shard path (as
    recorded, relative to the data root, or ending in it), a shard prefix, or a source name."""
    consumers = []
    for lineage_path in sorted(Path(runs_root).glob("*/checkpoints/iteration_*/lineage.json")):
        try:
            lineage = json.loads(lineage_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{lineage_path}: unreadable lineage ({exc})") from None
        records = [r for key in ("raw_files", "shards") for r in lineage.get(key) or [] if _matches(r, target)]
        if not records:
            continue
        by_source = {r["source"] == target for r in records}
        if by_source == {True}:  # a whole source: the sum over its shards (.bin and .idx name the same tokens)
            shares = [r.get("token_share") for r in lineage.get("shards") or [] if r["source"] == target
                      and r["path"].endswith(".bin")]
            matched = f"source {target}"
        else:
            first = records[0]
            shares = [first.get("token_share")]
            matched = first["path"]
        share = None if None in shares else sum(shares)
        checkpoint_dir = lineage_path.parent
        consumers.append(Consumer(run=checkpoint_dir.parent.parent.name, step=lineage["checkpoint"]["step"],
                                  checkpoint=str(checkpoint_dir), matched=matched, token_share=share))
    return consumers


def consumers_report(target: str, consumers: list[Consumer]) -> str:
    if not consumers:
        return f"no checkpoint consumed {target}"
    lines = [f"{len(consumers)} checkpoint(s) consumed {target}:"]
    for c in consumers:
        share = "share unknown" if c.token_share is None else f"{c.token_share:.1%} of the run's tokens"
        lines.append(f"  run {c.run} step {c.step}: {c.matched}, {share}  ({c.checkpoint})")
    return "\n".join(lines)


def consumers_json(target: str, consumers: list[Consumer]) -> str:
    return json.dumps({"target": target, "consumers": [asdict(c) for c in consumers]}, indent=2)
