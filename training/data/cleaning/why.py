"""``kiln why <raw file>:<line>``: what cleaning did with one raw document, from the removals sidecars.

A cleaning sidecar (``<stem>.kiln.json`` beside ``removals.jsonl``) lists the raw files it read by sha256; the
raw file given is hashed, the sidecars that read those bytes are found, and their removals are scanned for the
line. So the answer holds for the bytes as they are now: an edited raw file is reported as never cleaned.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from training.data.hashing import sha256_file


def _sidecars(roots: Iterable[Path]) -> Iterable[tuple[Path, dict]]:
    for root in roots:
        for path in sorted(Path(root).rglob("*.kiln.json")):
            try:
                sidecar = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if "recipe_sha256" in sidecar and "removals" in sidecar:
                yield path, sidecar


def explain(raw_file: Path, line: int, roots: Iterable[Path]) -> list[dict]:
    """Every cleaning's entry for the document (a file cleaned under several recipes has several)."""
    digest = sha256_file(raw_file)
    found = []
    needle = f'"raw_sha256":"{digest}"'.encode()
    for path, sidecar in _sidecars(roots):
        if not any(f["sha256"] == digest for f in sidecar["raw_files"]):
            continue
        with open(path.parent / sidecar["removals"], "rb") as stream:
            for data in stream:
                if needle in data:
                    entry = json.loads(data)
                    if entry["line"] == line:
                        found.append({**entry, "sidecar": str(path), "recipe": sidecar["recipe"]["name"],
                                      "recipe_sha256": sidecar["recipe_sha256"]})
                        break
    return found


def describe(entry: dict) -> str:
    head = f"{entry['file']}:{entry['line']} (recipe {entry['recipe']} {entry['recipe_sha256'][:12]}, " \
           f"{entry['sidecar']}): "
    if entry["kept"]:
        text = "kept"
        if entry.get("cluster_size", 1) > 1:
            text += f", the copy kept of a cluster of {entry['cluster_size']} duplicates"
    elif "duplicate_of" in entry:
        other = entry["duplicate_of"]
        text = (f"removed by {entry['step']}: {entry['reason'].replace('_', ' ')} of {other['file']}:{other['line']}"
                f" (sha256 {other['raw_sha256'][:12]}, chunk {other['chunk']}), kept instead")
        if entry["reason"] == "near_duplicate" and entry.get("value") is not None:
            text += f"; estimated Jaccard similarity {entry['value']:.2f}"
    else:
        text = f"removed by {entry['step']}: {entry['reason']}"
        if entry.get("value") is not None:
            text += f" = {entry['value']}"
            if entry.get("limit") is not None:
                text += f" (limit {entry['limit']})"
        if entry.get("detail"):
            text += f" [{entry['detail']}]"
    if entry.get("contamination"):
        text += "; overlaps evaluation tasks " + ", ".join(f"{t} ({n} n-grams)"
                                                         for t, n in sorted(entry["contamination"].items()))
    return head + text
