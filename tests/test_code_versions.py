"""assets.versions: the code versions the audit prints, read from the files a recipe names, are the ones
importing the definitions gives, before and after an edit, and the recipe is dropped (the definitions are
imported) whenever the code that chose it may have changed."""
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import assets.versions
from assets.versions import (CODE_DIRS, RecordingFailed, code_fingerprint, current_code_versions, function_source,
                             record_in_subprocess, versions_from_recipe)
from conftest import PROJECT_ROOT


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A copy of the project's code, its definitions imported once: (root, cache, versions)."""
    root = tmp_path_factory.mktemp("project")
    a_minute_ago = time.time_ns() - 60 * 10**9  # a file changed as the import ran is not recorded: none here
    for name in CODE_DIRS:
        shutil.copytree(PROJECT_ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        for path in (root / name).rglob("*"):
            os.utime(path, ns=(a_minute_ago, a_minute_ago))
    cache = root / ".kiln" / "code_versions.json"
    return root, cache, record_in_subprocess(cache, root)


def recipe(cache: Path) -> dict:
    return json.loads(cache.read_text())["recipe"]


def add_statement(path: Path, function: str) -> str:
    """A statement added to the body of the module-level ``function`` (before its last one); the old text."""
    text = path.read_text()
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function]
    last = node.body[-1]
    lines = text.splitlines(keepends=True)
    lines.insert(last.lineno - 1, " " * last.col_offset + "edited = True\n")
    path.write_text("".join(lines))
    return text


def test_the_versions_read_from_the_files_are_the_definitions(recorded, monkeypatch):
    root, cache, versions = recorded
    assert set(versions) == {"raw_corpus", "tokenizer", "token_shards", "blend_manifest", "training_run",
                             "checkpoint", "checkpoint_eval"}
    assert versions_from_recipe(recipe(cache)) == versions
    # token_shards' version hashes its ops' functions (assets/data.py): the recipe names them
    assert ["function", str(root / "assets" / "data.py"), "tokenize_chunks"] in recipe(cache)["assets"]["token_shards"]
    # the audit's way after a change (the cache's fingerprint no longer matches): neither Dagster nor the
    # definitions imported, in this process or another
    cached = json.loads(cache.read_text())
    cache.write_text(json.dumps({**cached, "fingerprint": "before a change"}))
    script = f"""
import importlib.abc, json, sys
from pathlib import Path
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dagster", "sqlalchemy", "pipelines"):
            raise ImportError(f"{{name}} imported")
sys.meta_path.insert(0, Block())
import assets.versions
assets.versions.record_in_subprocess = lambda cache: sys.exit("the definitions imported")
print(json.dumps(assets.versions.current_code_versions(Path({str(cache)!r}))))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == versions
    monkeypatch.setattr(assets.versions, "record_in_subprocess", lambda *args: pytest.fail("imported"))
    assert current_code_versions(cache) == versions
    assert function_source(str(root / "assets" / "data.py"), "no_such_function") is None


def test_an_edited_function_changes_the_versions_as_importing_does(recorded, tmp_path):
    root, cache, before = recorded
    data, evaluation = root / "assets" / "data.py", root / "assets" / "evaluation.py"
    # a body in a module that declares assets, which moves the functions below it, and one in another
    texts = {data: add_statement(data, "figures"), evaluation: add_statement(evaluation, "eval_command")}
    try:
        from_files = versions_from_recipe(recipe(cache))
        imported = record_in_subprocess(tmp_path / "code_versions.json", root)
    finally:
        for path, text in texts.items():
            path.write_text(text)
    assert from_files == imported
    changed = {key for key in before if imported[key] != before[key]}
    assert {"raw_corpus", "token_shards", "checkpoint_eval"} <= changed and "tokenizer" not in changed
    # the edits were made within the second before that import: they may have come after it read the files
    assert recipe(tmp_path / "code_versions.json") is None


def test_the_recipe_is_dropped_when_the_code_choosing_it_may_have_changed(recorded, monkeypatch):
    root, cache, versions = recorded
    data, jobs, sources = root / "assets" / "data.py", root / "pipelines" / "jobs.py", root / "configs" / "sources.yaml"

    def holds() -> bool:
        return versions_from_recipe(recipe(cache)) is not None

    def edited(path: Path, text: str) -> bool:
        """Whether the recipe holds with ``path`` holding ``text``."""
        old = path.read_text()
        path.write_text(text)
        try:
            return holds()
        finally:
            path.write_text(old)

    # the parts an asset hashes
    assert data.read_text().count("@versioned_asset(raw_files, replace_dir, ") == 1
    assert not edited(data, data.read_text().replace("@versioned_asset(raw_files, replace_dir, ",
                                                     "@versioned_asset(raw_files, "))
    # a function that ran while the definitions were built (it builds the schedule), and one that did not
    old = add_statement(jobs, "nightly_schedule")
    assert not holds()
    jobs.write_text(old)
    add_statement(jobs, "all_sources_tags")
    assert holds()
    jobs.write_text(old)
    # a file read while they were built
    assert not edited(sources, sources.read_text() + "# a comment\n")
    # a package that would be imported instead of a module; a new module imports nothing by itself
    package = root / "training" / "data" / "corpus"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert not holds()
    shutil.rmtree(package)
    new_module = root / "training" / "data" / "new_module.py"
    new_module.write_text("")
    assert holds()
    new_module.unlink()  # training_run hashes the package: its version would change
    # a config file only hashed, not read to choose parts (the training config): the recipe reads it again
    training_config = root / "configs" / "qwen3_tiny.yaml"
    assert str(training_config) in {part[1] for part in recipe(cache)["assets"]["training_run"]}
    assert edited(training_config, training_config.read_text() + "# a comment\n")
    # a setting
    monkeypatch.setenv("KILN_AUTO_TRAIN", "1")
    assert not holds()
    monkeypatch.delenv("KILN_AUTO_TRAIN")
    assert versions_from_recipe(recipe(cache)) == versions  # all put back
    # code that does not parse: no recipe holds, and the import names the place
    old = data.read_text()
    data.write_text(old + "def broken(:\n")
    try:
        assert not holds()
        with pytest.raises(RecordingFailed, match=f'(?s)importing the definitions under {root} failed.*{data}", line'):
            record_in_subprocess(root / "unused.json", root)
    finally:
        data.write_text(old)
    # when it does not hold, the audit imports the definitions
    monkeypatch.setenv("KILN_AUTO_TRAIN", "1")
    imported = []
    monkeypatch.setattr(assets.versions, "record_in_subprocess", lambda cache: imported.append(cache) or versions)
    assert current_code_versions(cache) == versions and imported == [cache]


def test_code_versions_are_cached_until_what_they_hash_changes(tmp_path, monkeypatch):
    cache = tmp_path / "code_versions.json"
    monkeypatch.setattr(assets.versions, "CODE_VERSIONS_CACHE", cache)
    computed = []
    monkeypatch.setattr(assets.versions, "record_in_subprocess",
                        lambda cache: computed.append(1) or record_in_subprocess(cache))
    versions = current_code_versions()
    assert versions["checkpoint"] == versions["training_run"] and "blend_manifest" in versions
    assert current_code_versions() == versions and len(computed) == 1  # the second from the cache
    # a setting, such as one naming another config file: not from the cache (nor the recipe: see above)
    fingerprint = code_fingerprint()
    monkeypatch.setenv("KILN_TRAIN_CONFIG", "configs/deepseek_v3_tiny.yaml")
    assert code_fingerprint() != fingerprint

    root = tmp_path / "project"
    (root / "training").mkdir(parents=True)
    module = root / "training" / "step.py"
    module.write_text("lr = 1\n")
    before = code_fingerprint(root)
    module.write_text("lr = 10\n")
    assert code_fingerprint(root) != before
    (root / "training" / "new.py").write_text("")
    assert len({before, code_fingerprint(root)}) == 2
