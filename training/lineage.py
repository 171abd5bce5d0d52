"""Lineage sidecars and the audit that re-verifies them (docs/architecture.md, Lineage).

Every checkpoint carries ``lineage.json``: the run (resolved config and its sha256) and its own files,
and the upstream chain it trained on, the blend manifest, every shard, the tokenizer and every raw file,
each with its sha256. The upstream part is the same for every checkpoint trained on one blend and grows
with the corpus (300 KB at 1,000 raw files), so it is stored once, content-addressed, in the lineage store
``<runs root>/lineage/<sha256>.json``; each lineage.json points at it by hash (``inputs``). Paths are
stored relative to the data root, so an audit also works after the data root moved (``--data-root``).
The audit needs the checkpoint directory, the store entry it points to (found next to the run, at the
store recorded at training time, or given with ``--lineage-store``: copy it along with a checkpoint) and
whatever files still exist. A run training_run rendered records its runs and data roots once (``run.roots``):
a checkpoint in a copied project tree is audited against the copy's files, never the original's
(training/relocation.py). Lineages written before the store (upstream records inline) read as before.

``kiln lineage --consumers`` reads, per run, ``checkpoints/lineage_index.jsonl`` (one line per saved
checkpoint: its step and the hash of its inputs) and each distinct store entry once, instead of every
checkpoint's lineage.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from training.atomic import write_atomic
from training.data.hashing import sha256_file
from training.data.manifest import read_manifest
from training.relocation import moved_path, moved_roots, rebase

LINEAGE_VERSION = 2  # 2: upstream records in the lineage store, lineage.json points at them (1: inline)
STORE_DIR = "lineage"  # under the runs root
INDEX = "lineage_index.jsonl"  # in a run's save path, next to its iteration_* directories
ITERATION_NAME = re.compile(r"^iteration_(\d{8})$")  # a checkpoint directory's name (training.checkpoint)
EVAL_PREFIX = "eval"  # a checkpoint's evaluation sidecars: eval.json, eval-<split>.json (training/evaluation.py)
EVAL_INDEX = "eval_index.jsonl"  # in a run's save path: one line per evaluation written


def lineage_inputs(manifest_path: str | Path, data_root: str | Path, read: tuple[dict, str] | None = None) -> dict:
    """The upstream part of a checkpoint's lineage, from the blend manifest it trains on: ``read`` (the manifest
    and its sha256, as ``read_manifest`` gave them to a caller that trains on them), else read here."""
    root = Path(data_root).resolve()
    manifest_path = Path(manifest_path).resolve()
    manifest, manifest_sha256 = read or read_manifest(manifest_path, root)
    shards, raw_files, clean_files = [], [], []
    total_weight = sum(source["weight"] for source in manifest["sources"])
    for source in manifest["sources"]:
        # the fraction of training samples drawn from this source (Megatron normalizes the blend weights),
        # split over its shards by tokens and over its raw files by bytes
        share = source["weight"] / total_weight
        source_tokens = sum(shard["tokens"] for shard in source["shards"]) or 1
        for shard in source["shards"]:
            for ext in ("bin", "idx"):
                # a chunked source's shards name their chunk (its raw files carry it from the manifest too)
                shards.append({"source": source["name"], **({"chunk": shard["chunk"]} if "chunk" in shard else {}),
                               "path": f"{shard['prefix']}.{ext}",
                               "sha256": shard[f"{ext}_sha256"],
                               "token_share": share * shard["tokens"] / source_tokens})
        source_bytes = sum(raw.get("bytes", 0) for raw in source["raw_files"]) or 1
        raw_files += [{"source": source["name"], **raw, "token_share": share * raw.get("bytes", 0) / source_bytes}
                      for raw in source["raw_files"]]
        # a cleaned source's shards hold its cleaned files (clean_corpus), named with their recipe's hash
        cleaned = source.get("clean_files") or []
        cleaned_bytes = sum(c["bytes"] for c in cleaned) or 1
        clean_files += [{"source": source["name"], **c, "token_share": share * c["bytes"] / cleaned_bytes}
                        for c in cleaned]
    return {
        "kiln_lineage_version": LINEAGE_VERSION,
        "data_root": str(root),
        "manifest": {"path": manifest_path.relative_to(root).as_posix(), "sha256": manifest_sha256},
        "shards": shards,
        "tokenizer": {"path": manifest["tokenizer"]["path"], "sha256": manifest["tokenizer"]["sha256"]},
        "raw_files": raw_files,
        **({"clean_files": clean_files} if clean_files else {}),
    }


def store_lineage_inputs(runs_root: str | Path, inputs: dict) -> dict:
    """Write ``inputs`` to the lineage store once (a file named by the sha256 of its bytes; an entry already
    there is the same bytes, so it is left alone) and return the pointer a checkpoint's lineage.json holds."""
    data = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    store = Path(runs_root).resolve() / STORE_DIR
    entry = store / f"{digest}.json"
    if not entry.is_file():
        store.mkdir(parents=True, exist_ok=True)
        write_atomic(entry, lambda stream: stream.write(data))
    return {"kiln_lineage_version": LINEAGE_VERSION, "inputs": {"sha256": digest, "store": str(store)}}


class LineageInputsMissing(ValueError):
    pass


def runs_root_now(checkpoint_dir: Path) -> Path | None:
    """The runs root a checkpoint sits in (``<runs root>/<run>/checkpoints/iteration_N``), None when it sits
    elsewhere (copied out on its own)."""
    checkpoint_dir = Path(checkpoint_dir).resolve()
    return checkpoint_dir.parents[2] if checkpoint_dir.parent.name == "checkpoints" else None


def moved(checkpoint_dir: Path, run: dict) -> list[tuple[str, str]]:
    """(recorded, now) for each root the checkpoint's run recorded that moved with it (training.relocation)."""
    return moved_roots(run.get("roots") or {}, runs_root_now(checkpoint_dir))


def relocated(checkpoint_dir: Path, run: dict, recorded: str | Path) -> Path:
    """Where a path recorded (absolute) when the checkpoint was trained is now: under the roots its run recorded,
    where they are now (``moved``). A lineage from before roots were recorded: when its run directory moved (the
    checkpoint sits in ``<run dir>/checkpoints/`` beside the config file run.config_path names, no longer where
    that was written), at its place relative to the run directory if something is there; else as recorded."""
    if run.get("roots"):
        return Path(rebase(str(recorded), moved(checkpoint_dir, run)))
    config_path = run.get("config_path")
    if not config_path:
        return Path(recorded)
    new_run_dir = Path(checkpoint_dir).resolve().parent.parent
    if not (new_run_dir / Path(config_path).name).is_file():
        return Path(recorded)
    return moved_path(Path(config_path).parent, new_run_dir, recorded)


def recorded_data_root(lineage: dict) -> str | None:
    """The data root the checkpoint's run trained on: the one its run recorded (run.roots; a run trained from a
    copied tree shares the original's store entry, which names the original's), else its inputs'."""
    return ((lineage.get("run") or {}).get("roots") or {}).get("data_root") or lineage.get("data_root")


def moved_run(checkpoint_dir: Path, lineage: dict, data_root: str | Path | None = None) -> tuple[dict, dict]:
    """The lineage with ``data_root`` where the data is now, and the run's config with its paths under the recorded
    data root and runs root (or run directory) moved to where they are now: ``data_root`` when given, else where
    the run's move took them (``relocated``). What a forward pass over the run's data needs after a move."""
    run = lineage["run"]
    recorded_root = recorded_data_root(lineage)
    moves = []
    if recorded_root:
        moves.append((recorded_root, str(data_root or relocated(checkpoint_dir, run, recorded_root))))
    if run.get("roots"):
        moves += moved(checkpoint_dir, run)
    elif run.get("config_path"):
        old_run_dir = str(Path(run["config_path"]).parent)
        moves.append((old_run_dir, str(relocated(checkpoint_dir, run, old_run_dir))))
    moves = [(old, new) for old, new in moves if os.path.normpath(old) != os.path.normpath(new)]
    config = {**run["config"], "train_dataset": rebase(run["config"]["train_dataset"], moves)}
    return ({**lineage, "data_root": moves[0][1]} if recorded_root and moves and moves[0][0] == recorded_root
            else lineage), config


def _store_candidates(checkpoint_dir: Path, pointer: dict, lineage_store: str | Path | None,
                      run: dict | None = None) -> list[Path]:
    """Where a checkpoint's inputs entry may be: the store given, the store of the runs root the checkpoint
    sits in (``<runs root>/<run>/checkpoints/iteration_N``), the recorded store where the run moved with it
    (``relocated``), the store recorded when it was trained."""
    stores = [Path(lineage_store)] if lineage_store else []
    stores.append(checkpoint_dir.resolve().parent.parent.parent / STORE_DIR)
    roots = (run or {}).get("roots")
    if roots:  # the store of the runs root it recorded, where that is now: a copied tree's, never the original's
        stores.append(relocated(checkpoint_dir, run, Path(roots["runs_root"]) / STORE_DIR))
    else:
        stores += [relocated(checkpoint_dir, run or {}, pointer["store"]), Path(pointer["store"])]
    return [store / f"{pointer['sha256']}.json" for store in dict.fromkeys(stores)]


def load_inputs_entry(checkpoint_dir: Path, pointer: dict, lineage_store: str | Path | None = None,
                      run: dict | None = None) -> dict:
    """The store entry ``pointer`` names, its sha256 verified; LineageInputsMissing when it is nowhere. ``run``:
    the checkpoint's run record, to find a store that moved with its run directory."""
    candidates = _store_candidates(checkpoint_dir, pointer, lineage_store, run)
    for entry in candidates:
        if entry.is_file():
            actual = sha256_file(entry)
            if actual != pointer["sha256"]:
                raise ValueError(f"{entry}: lineage store entry changed (sha256 {actual[:16]}…, its name and "
                                 f"{checkpoint_dir}/lineage.json say {pointer['sha256'][:16]}…)")
            return json.loads(entry.read_text())
    raise LineageInputsMissing(
        f"the lineage inputs {pointer['sha256'][:16]}… of {checkpoint_dir} are not in "
        f"{', '.join(str(c.parent) for c in candidates)}: copy {pointer['sha256']}.json from the lineage store of "
        f"the runs root it was trained in and pass --lineage-store DIR")


def read_lineage(checkpoint_dir: Path, lineage_store: str | Path | None = None) -> tuple[dict, bool]:
    """A checkpoint's lineage.json with its upstream records in place (loaded from the store when it points
    there), and whether they are missing (the store entry it points to is nowhere to be found)."""
    lineage_path = checkpoint_dir / "lineage.json"
    try:
        lineage = json.loads(lineage_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{lineage_path}: unreadable lineage ({exc})") from None
    pointer = lineage.get("inputs")
    if pointer is None:  # inline upstream records, or a run trained outside Dagster without any
        return lineage, False
    try:
        return {**load_inputs_entry(checkpoint_dir, pointer, lineage_store, lineage.get("run")), **lineage}, False
    except LineageInputsMissing:
        return lineage, True
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{checkpoint_dir}: unreadable lineage inputs ({exc})") from None


def record_in_index(save_path: Path, step: int, lineage: dict) -> None:
    """Append the checkpoint's step and inputs hash to its save path's index (rank 0, once the checkpoint is
    complete). A line cut by a crash is dropped by the next append and skipped by readers; a checkpoint the
    index misses is read from its lineage.json."""
    pointer = lineage.get("inputs")
    if pointer is None:
        return
    from training.reporting import drop_partial_line

    index = Path(save_path) / INDEX
    drop_partial_line(index)
    with open(index, "a") as stream:
        stream.write(json.dumps({"step": step, "inputs": pointer["sha256"], "store": pointer["store"]}) + "\n")
        stream.flush()
        os.fsync(stream.fileno())


PROBLEMS = ("MISMATCH", "missing")  # the statuses that fail an audit; "gone" and "unverified" are notes


@dataclass
class Check:
    link: str      # checkpoint, run config, manifest, shard, tokenizer, raw file, ancestor
    path: str
    expected: str
    actual: str | None
    status: str    # ok | MISMATCH | missing | gone (an ancestor no longer there) | unverified (loaded unverified)

    def line(self) -> str:
        if self.status == "ok":
            return f"  ok        {self.link:<11} {self.path}  sha256 {self.expected[:16]}"
        if self.status == "missing":
            return f"  missing   {self.link:<11} {self.path}  (not found, not verified)"
        if self.status == "gone":
            return (f"  gone      {self.link:<11} {self.path}  (no longer there, rotated or moved: not re-verified; "
                    f"its lineage.json was verified when it was loaded)")
        if self.status == "unverified":
            return (f"  UNVERIFIED {self.link:<10} {self.path}  (loaded on purpose without a lineage.json to verify "
                    f"it against: this chain's trust starts after it)")
        return (f"  MISMATCH  {self.link:<11} {self.path} changed since training "
                f"(sha256 {self.expected[:16]}… → {self.actual[:16]}…)")


UPSTREAM_RECHECK_S = 600.0


class AuditCache:
    """What a training step's audits of the checkpoints it saves share, so that each audit hashes what its
    save added and reuses the rest. A file is hashed once while it stays as it was (same inode, size and
    mtime). The upstream links (one lineage store entry: manifest, shards, tokenizer and raw files, thousands
    of files on a real corpus, the same for every checkpoint of the run) are verified once and their checks
    reused for ``recheck_s`` seconds, then verified again (a stat per file; re-read only if it changed).
    ``kiln audit`` and the check executed from the UI use no cache: they verify every link."""

    def __init__(self, recheck_s: float = UPSTREAM_RECHECK_S):
        self.recheck_s = recheck_s
        self._known: dict[Path, tuple[tuple[int, int, int], str]] = {}
        self._upstream: dict[str, tuple[float, list[Check]]] = {}

    def sha256(self, path: Path) -> str:
        stat = path.stat()
        identity = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        known = self._known.get(path)
        if known is None or known[0] != identity:
            known = self._known[path] = (identity, sha256_file(path))
        return known[1]

    def upstream(self, inputs_sha256: str, verify: Callable[[], list[Check]]) -> list[Check]:
        verified_at, checks = self._upstream.get(inputs_sha256, (None, []))
        if verified_at is None or time.monotonic() - verified_at > self.recheck_s:
            verified_at, checks = self._upstream[inputs_sha256] = (time.monotonic(), verify())
        return checks


def _check(link: str, path: Path, shown: str, expected: str, cache: AuditCache | None) -> Check:
    if not path.is_file():
        return Check(link, shown, expected, None, "missing")
    actual = cache.sha256(path) if cache else sha256_file(path)
    return Check(link, shown, expected, actual, "ok" if actual == expected else "MISMATCH")


def _embedded_config_check(run: dict) -> Check:
    """The resolved config lineage.json carries, re-serialized as the trainer wrote it and re-hashed."""
    from training.config import config_sha256

    actual = config_sha256(yaml.safe_dump(run["config"], sort_keys=False))
    return Check("run config", "lineage.json run.config (config file not found)", run["config_sha256"], actual,
                 "ok" if actual == run["config_sha256"] else "MISMATCH")


def audit_checkpoint(checkpoint_dir: str | Path, data_root: str | Path | None = None,
                     cache: AuditCache | None = None, lineage_store: str | Path | None = None
                     ) -> tuple[dict, list[Check]]:
    """Re-hash every file the checkpoint's lineage names, in chain order from the checkpoint back to raw
    (through ``cache``, when given: see AuditCache). Inputs that cannot be found in the lineage store are one
    missing link: the checkpoint's own files and config are still verified."""
    checkpoint_dir = Path(checkpoint_dir)
    lineage, inputs_missing = read_lineage(checkpoint_dir, lineage_store)
    root = Path(data_root) if data_root else relocated(checkpoint_dir, lineage["run"],
                                                       recorded_data_root(lineage) or ".")
    checks = [_check("checkpoint", checkpoint_dir / f["name"], f["name"], f["sha256"], cache)
              for f in lineage["checkpoint"]["files"]]
    common_path = checkpoint_dir / "common.json"
    if common_path.is_file():
        same = json.loads(common_path.read_text()) == lineage["checkpoint"]["common"]
        checks.append(Check("checkpoint", "common.json", "as recorded", "as recorded" if same else "edited",
                            "ok" if same else "MISMATCH"))
    else:
        checks.append(Check("checkpoint", "common.json", "as recorded", None, "missing"))
    checks += evaluation_checks(checkpoint_dir)
    run = lineage["run"]
    config_path = relocated(checkpoint_dir, run, run["config_path"])
    config_check = _check("run config", config_path, str(config_path), run["config_sha256"], cache)
    if config_check.status == "missing" and "config" in run:
        config_check = _embedded_config_check(run)  # e.g. the checkpoint was copied to another machine
    checks.append(config_check)
    if inputs_missing:  # the manifest, shards, tokenizer and raw files are listed in the entry alone
        pointer = lineage["inputs"]
        checks.append(Check("inputs", f"lineage store entry {pointer['sha256']}.json", pointer["sha256"], None,
                            "missing"))
    pointer = lineage.get("inputs")
    if cache is not None and pointer is not None and not inputs_missing and data_root is None:
        checks += cache.upstream(pointer["sha256"], lambda: _upstream_checks(lineage, root, cache))
    else:
        checks += _upstream_checks(lineage, root, cache)
    checks += _ancestor_checks(checkpoint_dir, lineage, cache)
    return lineage, checks


def _parent_dir(child_dir: Path, child_run: dict, parent: dict) -> Path | None:
    """Where the checkpoint ``parent`` (a child's run.parent record) is now: in the child's runs root under the
    same run and step (the tree moved together), else where it was when loaded (under the child's roots, where
    they are now: a copied tree's, never the original's); None when it is neither."""
    candidates = [child_dir.resolve().parent.parent.parent / parent["run_path"]] if parent.get("run_path") else []
    for candidate in candidates + [relocated(child_dir, child_run, parent["path"])]:
        if (candidate / "lineage.json").is_file():
            return candidate
    return None


def _ancestor_checks(checkpoint_dir: Path, lineage: dict, cache: AuditCache | None) -> list[Check]:
    """The checkpoints this one descends from (run.parent, its parent, ...): each one's lineage.json must be the
    one its child verified the loaded files against (the sha256 the child recorded), and each one's files must
    still be what that lineage.json records, so a tampered ancestor fails the audit of every descendant."""
    checks, seen = [], set()
    child_dir, child_run = checkpoint_dir, lineage.get("run") or {}
    parent = child_run.get("parent")
    while parent:
        shown = parent.get("run_path") or parent["path"]
        if not parent.get("verified"):
            checks.append(Check("ancestor", shown, "verified", "loaded unverified", "unverified"))
            break
        if parent.get("hugging_face"):  # a Kiln export, verified against its kiln_export.json when loaded
            break
        where = _parent_dir(child_dir, child_run, parent)
        if where is None or where.resolve() in seen:
            checks.append(Check("ancestor", shown, parent["lineage_sha256"], None, "gone"))
            break
        seen.add(where.resolve())
        check = _check("ancestor", where / "lineage.json", f"{shown}/lineage.json", parent["lineage_sha256"], cache)
        checks.append(check)
        if check.status != "ok":
            break
        ancestor = json.loads((where / "lineage.json").read_text())
        checks += [_check("ancestor", where / f["name"], f"{shown}/{f['name']}", f["sha256"], cache)
                   for f in ancestor["checkpoint"]["files"]]
        child_dir, child_run = where, ancestor.get("run") or {}
        parent = child_run.get("parent")
    return checks


def _upstream_checks(lineage: dict, root: Path, cache: AuditCache | None) -> list[Check]:
    # a run trained outside Dagster on hand-picked shards has no upstream links to check
    checks = []
    for link, key in (("manifest", "manifest"), ("shard", "shards"), ("tokenizer", "tokenizer"),
                      ("clean file", "clean_files"), ("raw file", "raw_files")):
        records = lineage.get(key) or []
        for record in [records] if isinstance(records, dict) else records:
            checks.append(_check(link, root / record["path"], record["path"], record["sha256"], cache))
    return checks


def audit_report(checkpoint_dir: Path, lineage: dict, checks: list[Check]) -> str:
    run = lineage["run"]
    step = lineage["checkpoint"]["step"]
    lines = [f"checkpoint {checkpoint_dir} (step {step})",
             f"  run: config sha256 {run['config_sha256'][:16]}, {run['world_size']} worker(s), "
             f"started {run['started_at']}" + (f", resumed from {run['resumed_from']}" if run["resumed_from"] else "")]
    lines += [c.line() for c in checks]
    bad = [c for c in checks if c.status == "MISMATCH"]
    missing = [c for c in checks if c.status == "missing"]
    if not any(lineage.get(key) for key in ("manifest", "shards", "inputs")):
        lines.append("  note: no upstream lineage (trained without --lineage, e.g. outside Dagster on hand-picked "
                     "data): the data it trained on is not verified, only the checkpoint and its config")
    if any(c.link == "inputs" for c in missing):
        lines.append(f"  (its upstream links are in the lineage store entry {lineage['inputs']['sha256']}.json, not "
                     f"found next to its runs root nor in {lineage['inputs']['store']}: copy it from there and pass "
                     f"--lineage-store DIR)")
    if bad:
        first = bad[0]
        lines.append(f"FAILED: {first.link} {first.path} changed since training "
                     f"(sha256 {first.expected[:16]}… → {(first.actual or '')[:16]}…)")
    else:
        verified = sum(c.status == "ok" for c in checks)
        notes = [c for c in checks if c.status not in PROBLEMS and c.status != "ok"]
        lines.append(f"OK: {verified} file(s) verified" + (f", {len(missing)} not found" if missing else "")
                     + "".join(f", {c.link} {c.path} {c.status}" for c in notes))
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
    evaluations: list[str]     # its evaluation sidecars (eval.json, eval-<split>.json), which read the same sources


def _matches(record: dict, target: str) -> bool:
    path = record["path"]
    return target in (path, record.get("source"), record.get("chunk")) or path.rsplit(".", 1)[0] == target or \
        target.endswith("/" + path) or _cleaned_with(record, target)


def _cleaned_with(record: dict, target: str) -> bool:
    """A cleaned file's record made by the recipe ``target``: its name, or its sha256 (12 hex digits suffice)."""
    recipe_sha256 = record.get("recipe_sha256") or ""
    return target == record.get("recipe") or (len(target) >= 12 and recipe_sha256.startswith(target))


def _consumed(inputs: dict, target: str) -> tuple[str, float | None] | None:
    """What in a checkpoint's upstream records names ``target`` (a raw file or shard path, a shard prefix, a
    chunk or a source name), and its share of the run's tokens; None when nothing does. A file or shard is
    named with its chunk when its source is chunked."""
    records = [r for key in ("raw_files", "clean_files", "shards") for r in inputs.get(key) or []
               if _matches(r, target)]
    if not records:
        return None
    if all(_cleaned_with(r, target) for r in records):  # a recipe: the cleaned files it made, their token shares
        shares = [r.get("token_share") for r in records]
        return f"recipe {records[0]['recipe']} ({records[0]['recipe_sha256'][:12]})", sum(shares)
    for field in ("source", "chunk"):  # a whole source or chunk: the sum over its shards
        if {r.get(field) == target for r in records} == {True}:
            shares = [r.get("token_share") for r in inputs.get("shards") or [] if r.get(field) == target
                      and r["path"].endswith(".bin")]  # .bin and .idx name the same tokens
            return f"{field} {target}", None if None in shares else sum(shares)
    record = records[0]
    shares, matched = [record.get("token_share")], record["path"]
    if record.get("chunk") not in (None, record["source"]):
        matched += f" (chunk {record['chunk']})"
    return matched, None if None in shares else sum(shares)


def _index_lines(index: Path) -> list[dict]:
    """The lines of an index file (JSONL, appended to by saves and evaluations), in order; none when it does not
    exist; a line cut by a crash is skipped."""
    lines = index.read_text().splitlines() if index.is_file() else []
    try:  # one decode for the whole index (10,000 json.loads took 0.4 s); line by line if one is cut
        return json.loads(f"[{','.join(lines)}]")
    except json.JSONDecodeError:
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return parsed


def _read_index(save_path: Path) -> dict[int, dict]:
    """step -> index line of a save path's lineage index."""
    return {entry["step"]: entry for entry in _index_lines(save_path / INDEX)}


def find_consumers(runs_root: str | Path, target: str) -> list[Consumer]:
    """Every checkpoint under ``runs_root`` whose lineage names ``target``: a raw file or shard path (as
    recorded, relative to the data root, or ending in it), a shard prefix, or a source name. Each run's
    lineage index says which store entry each checkpoint trained on, and each entry is read once; only a
    checkpoint the index does not list (saved by a Kiln before the index) has its lineage.json read."""
    consumers = []
    by_entry: dict[str, tuple[tuple[str, float | None] | None, set[str]]] = {}
    for save_path in sorted(Path(runs_root).glob("*/checkpoints")):
        indexed = _read_index(save_path)
        evaluated = _read_eval_index(save_path)
        # names sorted as strings, and no stat of an indexed step (rank 0 indexes a checkpoint once it is
        # complete): a run of 10,000 checkpoints took 1.4 s in Path sorting and common.json stats
        run = save_path.parent.name
        for name in sorted(name for name in os.listdir(save_path) if ITERATION_NAME.match(name)):
            directory = f"{save_path}{os.sep}{name}"  # a string: one Path per checkpoint cost 0.5 s at 10,000
            step = int(name.removeprefix("iteration_"))
            entry = indexed.get(step)
            if entry is None:
                if not Path(directory, "common.json").is_file():  # incomplete: not a checkpoint yet
                    continue
                lineage, _ = read_lineage(Path(directory))
                found, sources = _consumed(lineage, target), _sources_named(lineage, target)
                step = lineage["checkpoint"]["step"]
            else:
                if entry["inputs"] not in by_entry:
                    pointer = {"sha256": entry["inputs"], "store": entry["store"]}
                    inputs = load_inputs_entry(Path(directory), pointer)
                    by_entry[entry["inputs"]] = _consumed(inputs, target), _sources_named(inputs, target)
                found, sources = by_entry[entry["inputs"]]
            if found is not None:
                # an evaluation reads the sources its split gives samples: one that left the target's out did not
                # consume it (an index line older than the list of sources counts as reading every one)
                evaluations = sorted(sidecar for sidecar, read in evaluated.get(step, {}).items()
                                     if read is None or sources & read)
                consumers.append(Consumer(run=run, step=step, checkpoint=directory,
                                          matched=found[0], token_share=found[1], evaluations=evaluations))
    return consumers


def recorded_names(runs_root: str | Path) -> tuple[set[str], set[str]]:
    """Every name ``find_consumers`` matches in the lineage the indexed checkpoints under ``runs_root`` record
    (sources, chunks, recipes, file paths and shard prefixes: to suggest the near ones for a target that matches
    none), and the data roots they record."""
    entries: dict[str, tuple[Path, str]] = {}
    for save_path in sorted(Path(runs_root).glob("*/checkpoints")):
        for step, line in _read_index(save_path).items():
            entries.setdefault(line["inputs"], (save_path / f"iteration_{step:08d}", line["store"]))
    names: set[str] = set()
    roots: set[str] = set()
    for digest, (directory, store) in entries.items():
        try:
            inputs = load_inputs_entry(directory, {"sha256": digest, "store": store})
        except (OSError, ValueError):
            continue  # an entry that cannot be read names nothing to suggest
        roots.add(inputs.get("data_root") or ".")
        for record in [r for key in ("raw_files", "clean_files", "shards") for r in inputs.get(key) or []]:
            names.update(n for n in (record.get("source"), record.get("chunk"), record.get("recipe"), record["path"],
                                     record["path"].rsplit(".", 1)[0]) if n)
    return names, roots


def _sources_named(inputs: dict, target: str) -> set[str]:
    """The sources of the upstream records ``target`` names (see _consumed)."""
    return {r["source"] for key in ("raw_files", "clean_files", "shards") for r in inputs.get(key) or []
            if _matches(r, target)}


def consumers_report(target: str, consumers: list[Consumer]) -> str:
    if not consumers:
        return f"no checkpoint consumed {target}"
    lines = [f"{len(consumers)} checkpoint(s) consumed {target}:"]
    for c in consumers:
        share = "share unknown" if c.token_share is None else f"{c.token_share:.1%} of the run's tokens"
        lines.append(f"  run {c.run} step {c.step}: {c.matched}, {share}  ({c.checkpoint})")
        lines += [f"    evaluated: {c.checkpoint}/{name}" for name in c.evaluations]
    return "\n".join(lines)


def consumers_json(target: str, consumers: list[Consumer]) -> str:
    return json.dumps({"target": target, "consumers": [asdict(c) for c in consumers]}, indent=2)


# ---- evaluation sidecars ---------------------------------------------------------------------------------------
def results_sha256(record: dict) -> str:
    """The hash an evaluation sidecar carries of everything else in it, which the audit recomputes."""
    body = {k: v for k, v in record.items() if k != "results_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def evaluation_checks(checkpoint_dir: Path) -> list[Check]:
    """Each evaluation sidecar of the checkpoint: its results as they were written (their recorded hash), and
    of this checkpoint as it is now (the hash of its lineage.json, which names every file's, when evaluated)."""
    checks = []
    lineage_now = sha256_file(checkpoint_dir / "lineage.json")
    for path in sorted(checkpoint_dir.glob(f"{EVAL_PREFIX}*.json")):
        try:
            record = json.loads(path.read_text())
            recorded, evaluated_of = record["results_sha256"], record["checkpoint"]["lineage_sha256"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            checks.append(Check("evaluation", path.name, "a readable evaluation record", "unreadable", "MISMATCH"))
            continue
        actual = results_sha256(record)
        checks.append(Check("evaluation", path.name, recorded, actual, "ok" if actual == recorded else "MISMATCH"))
        checks.append(Check("evaluation", f"{path.name}: checkpoint evaluated (lineage.json)", evaluated_of,
                            lineage_now, "ok" if lineage_now == evaluated_of else "MISMATCH"))
    return checks


def record_evaluation_in_index(save_path: Path, step: int, sidecar: str, sources: list[str]) -> None:
    """Append an evaluation written for checkpoint ``step``, and the ``sources`` it evaluated, to its save path's
    EVAL_INDEX (read by consumers)."""
    from training.reporting import drop_partial_line

    index = Path(save_path) / EVAL_INDEX
    drop_partial_line(index)
    with open(index, "a") as stream:
        stream.write(json.dumps({"step": step, "sidecar": sidecar, "sources": sources}) + "\n")


def _read_eval_index(save_path: Path) -> dict[int, dict[str, set[str] | None]]:
    """step -> each evaluation sidecar written for it -> the sources it evaluated, None when its line predates
    that list (lines of EVAL_INDEX, the last of a sidecar written again wins)."""
    evaluated: dict[int, dict[str, set[str] | None]] = {}
    for entry in _index_lines(save_path / EVAL_INDEX):
        sources = entry.get("sources")
        evaluated.setdefault(entry["step"], {})[entry["sidecar"]] = None if sources is None else set(sources)
    return evaluated
