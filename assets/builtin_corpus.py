"""Kiln's built-in corpora: text every Python install carries, so the pipeline runs offline.

* `python_stdlib_code`: each standard-library `.py` file, one JSONL object per file:
  {"text": source, "path": path relative to the stdlib root}.
* `python_stdlib_docstrings`: module, class and function docstrings, read with `ast` (nothing is
  imported): {"text": docstring, "path": ..., "qualname": "<module>" or e.g. "Class.method"}.

Files are visited in sorted order, so the output depends only on the Python installation, `max_bytes` and
`planted_every`. Test suites, test data and installed packages are left out.

With `planted_every: N` (the demo's sources), documents are planted after every Nth one so that cleaning has
something to find: an exact copy of it, half-way between two of those a near copy of the next document of 80+
words (one word in its middle changed: MinHash Jaccard ~0.85-0.95), and a quarter of the way a junk document
(the document's first line repeated 30 times, or a run of symbols). Each carries `"planted"` naming what it is.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from training.atomic import temporary_file

BUILTIN_KINDS = ("python_stdlib_code", "python_stdlib_docstrings")
PART_BYTES = 64 * 1024 * 1024
# Installed packages are not the standard library; test dirs (incl. idlelib/idle_test and
# lib2to3/tests/data) hold deliberately odd or broken code.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_PART_NAME = re.compile(r"part-\d{5}\.jsonl")


def _stdlib_modules(root: Path) -> Iterator[tuple[str, str, ast.Module]]:
    """(relative path, source, syntax tree) of every parseable UTF-8 `.py` file, in sorted order."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _EXCLUDED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(directory, name)
            try:
                source = path.read_bytes().decode("utf-8")
                with warnings.catch_warnings():
                    # Old escape sequences in some modules warn; the text is still what we want.
                    warnings.simplefilter("ignore")
                    tree = ast.parse(source, filename=str(path))
            except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
                continue
            yield path.relative_to(root).as_posix(), source, tree


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(qualname, docstring) in source order; qualnames follow Python's, e.g. `f.<locals>.g`."""
    module_doc = ast.get_docstring(tree)
    if module_doc:
        yield "<module>", module_doc

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                doc = ast.get_docstring(child)
                if doc:
                    yield qualname, doc
                inner = ".<locals>." if not isinstance(child, ast.ClassDef) else "."
                yield from walk(child, qualname + inner)
            else:
                # Definitions also live inside if/try/with blocks.
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _records(kind: str, root: Path) -> Iterator[dict]:
    for relative, source, tree in _stdlib_modules(root):
        if kind == "python_stdlib_code":
            yield {"text": source, "path": relative}
        else:
            for qualname, doc in _docstrings(tree):
                yield {"text": doc, "path": relative, "qualname": qualname}


def _junk(record: dict, number: int) -> dict:
    first_line = record["text"].strip().splitlines()[0] if record["text"].strip() else "junk"
    text = "\n".join([first_line] * 30) if number % 2 else "".join(itertools.islice(itertools.cycle("#=*~<>|"), 2000))
    return {**record, "text": text, "planted": "junk"}


def _near_copy(record: dict) -> dict:
    words = record["text"].split(" ")
    middle = len(words) // 2
    words[middle] = words[middle] + "_changed"
    return {**record, "text": " ".join(words), "planted": "near_copy"}


def _planted(records: Iterator[dict], every: int) -> Iterator[dict]:
    """The records with copies and junk planted among them (module docstring)."""
    near_pending = False
    for number, record in enumerate(records, start=1):
        yield record
        if not every:
            continue
        if near_pending and len(record["text"].split()) >= 80:
            yield _near_copy(record)
            near_pending = False
        if number % every == 0:
            yield {**record, "planted": "exact_copy"}
        elif number % every == every // 2:
            near_pending = True
        elif number % every == max(1, every // 4):
            yield _junk(record, number // every)


def write_builtin_source(
    kind: str, out_dir: str | os.PathLike, max_bytes: int, part_bytes: int = PART_BYTES, planted_every: int = 0
) -> list[Path]:
    """Write the built-in corpus `kind` as `out_dir/part-NNNNN.jsonl`, at most `max_bytes` of text.

    Documents are added in order until the next one would pass `max_bytes` (UTF-8 bytes of the
    texts); each part holds at most `part_bytes` bytes of JSONL. Parts are written under
    temporary names and renamed at the end; parts left from an earlier, larger call are removed.
    Returns the part paths in order. `planted_every`: see the module docstring (0: nothing planted).
    """
    if kind not in BUILTIN_KINDS:
        raise ValueError(f"unknown builtin source kind {kind!r}; expected one of {', '.join(BUILTIN_KINDS)}")
    for name, value in (("max_bytes", max_bytes), ("part_bytes", part_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])

    temporaries: list[Path] = []
    try:
        part, part_size, text_bytes = None, 0, 0
        for record in _planted(_records(kind, root), planted_every):
            try:
                text_size = len(record["text"].encode("utf-8"))
                line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            except UnicodeEncodeError:
                # A docstring literal may spell a lone surrogate ("\udc80"), which UTF-8 cannot hold.
                continue
            if text_bytes + text_size > max_bytes:
                break
            if len(line) > part_bytes:
                raise ValueError(f"{record['path']}: one JSONL line of {len(line)} bytes exceeds part_bytes={part_bytes}")
            if part is None or part_size + len(line) > part_bytes:
                if part is not None:
                    part.close()
                fd, tmp = temporary_file(out, f"part-{len(temporaries):05d}.jsonl.")
                temporaries.append(Path(tmp))
                part, part_size = os.fdopen(fd, "wb"), 0
            part.write(line)
            part_size += len(line)
            text_bytes += text_size
        if part is None:
            raise ValueError(f"max_bytes={max_bytes} is smaller than the first {kind} document")
        part.close()
    except BaseException:
        if part is not None:
            part.close()
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise

    paths = [out / f"part-{number:05d}.jsonl" for number in range(len(temporaries))]
    for tmp, path in zip(temporaries, paths):
        os.replace(tmp, path)
    for stale in out.iterdir():
        if _PART_NAME.fullmatch(stale.name) and stale not in paths:
            stale.unlink()
    return paths
