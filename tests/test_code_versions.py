"""assets.versions: the code versions the audit prints are the ones the definitions give, before and after an
edit, computed without importing Dagster; and the table of parts covers the project code each data asset runs."""
import ast
import cProfile
import json
import shutil
import subprocess
import sys

import dagster as dg
import pytest

import assets.versions
from assets.chunks import register_source_chunks
from assets.versions import ASSET_PARTS, CodePartError, code_version, current_code_versions, part_source
from conftest import PROJECT_ROOT
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from test_data_assets import DATA_ASSETS, _write_sources

# run in a project directory: the definitions' versions, and the audit's with Dagster and the definitions blocked
BOTH_WAYS = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dagster", "sqlalchemy", "pipelines"):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Block())
import assets.versions
audit = assets.versions.current_code_versions()
sys.meta_path.pop(0)
from pipelines.definitions import defs
graph = defs.resolve_asset_graph()
definitions = {key.to_user_string(): graph.get(key).code_version for key in graph.get_all_asset_keys()}
print(json.dumps({"audit": audit, "definitions": definitions}))
"""


def both_ways(root) -> tuple[dict, dict]:
    done = subprocess.run([sys.executable, "-c", BOTH_WAYS], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[-1])
    return answer["audit"], answer["definitions"]


def add_statement(path, function: str) -> None:
    """A statement added to the body of the module-level ``function``."""
    text = path.read_text()
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function]
    last = node.body[-1]
    lines = text.splitlines(keepends=True)
    lines.insert(last.lineno - 1, " " * last.col_offset + "edited = True\n")
    path.write_text("".join(lines))


def test_the_audits_versions_are_the_definitions_before_and_after_edits(tmp_path, monkeypatch):
    root = tmp_path / "project"
    for name in ("assets", "pipelines", "resources", "training", "configs"):
        shutil.copytree(PROJECT_ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(assets.versions, "PROJECT_ROOT", root)
    monkeypatch.delenv("KILN_SOURCES", raising=False)
    monkeypatch.delenv("KILN_TRAIN_CONFIG", raising=False)
    before = current_code_versions()
    assert set(before) == {"raw_corpus", "clean_corpus", "tokenizer", "token_shards", "blend_manifest",
                           "training_run", "checkpoint", "checkpoint_eval", "run_comparison", "ablation_run",
                           "ablation_ranking"}
    assert before["checkpoint"] == before["training_run"]
    # a function two data assets run, one only checkpoint_eval's launch runs, the training package, the sources
    add_statement(root / "assets" / "data.py", "figures")
    add_statement(root / "assets" / "evaluation.py", "eval_command")
    with open(root / "training" / "data" / "hashing.py", "a") as module:
        module.write("\nEDITED = True\n")
    with open(root / "configs" / "sources.yaml", "a") as sources:
        sources.write("# a comment\n")
    audit, definitions = both_ways(root)
    assert audit == current_code_versions()
    assert definitions["checkpoint"] is None  # an external asset: the audit gives it training_run's
    assert audit == {**definitions, "checkpoint": definitions["training_run"]}
    changed = {key for key in before if audit[key] != before[key]}
    # hashing.py is run by every data asset and part of training/; run_comparison and ablation_ranking run none
    # of what changed
    assert changed == set(before) - {"run_comparison", "ablation_ranking"}
    (root / "configs" / "sources.yaml").write_text((PROJECT_ROOT / "configs" / "sources.yaml").read_text())
    shutil.copy(PROJECT_ROOT / "training" / "data" / "hashing.py", root / "training" / "data" / "hashing.py")
    after = current_code_versions()
    assert {key for key in before if after[key] != before[key]} == {"raw_corpus", "clean_corpus", "token_shards",
                                                                    "checkpoint_eval"}
    # what is in no asset's parts: training_run's recording of checkpoints, the schedule, a new module
    add_statement(root / "assets" / "training.py", "audit_summary")
    add_statement(root / "pipelines" / "jobs.py", "nightly_schedule")
    (root / "assets" / "new_module.py").write_text("x = 1\n")
    assert current_code_versions() == after


def test_a_part_that_is_not_there_is_named(tmp_path, monkeypatch):
    with pytest.raises(CodePartError, match=r"asset 'new_asset' has no entry in ASSET_PARTS"):
        code_version("new_asset")
    monkeypatch.setitem(ASSET_PARTS, "tokenizer", ("assets/data.py:no_such_function",))
    with pytest.raises(CodePartError, match=r"tokenizer's code version \(assets/versions.py, "
                       r"ASSET_PARTS\['tokenizer'\], 'assets/data.py:no_such_function'\): .*data.py defines 0 "):
        code_version("tokenizer")
    missing = tmp_path / "sources.yaml"
    monkeypatch.setenv("KILN_SOURCES", str(missing))
    with pytest.raises(CodePartError, match=f"{missing} \\(named by KILN_SOURCES or its default\\) is not a file"):
        current_code_versions()
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    monkeypatch.setattr(assets.versions, "PROJECT_ROOT", tmp_path)
    with pytest.raises(CodePartError, match=f"{broken}, line 1"):
        part_source("broken.py:f")


def covered(parts: tuple[str, ...], file: str, qualname: str) -> bool:
    """Whether a function of ``file`` (relative to the project) named ``qualname`` is in one of ``parts``."""
    for part in parts:
        path, _, name = part.partition(":")
        if path.endswith("/") and file.startswith(path):
            return True
        if path == file and (not name or qualname == name or qualname.startswith(f"{name}.")):
            return True
    return False


def test_each_data_assets_parts_cover_the_project_code_it_runs(tmp_path):
    """Every function of the project a data asset's materialization calls (on a file source with bad records
    and a built-in one, both chunks in one run: the path of a one-chunk run and more) is in its parts: an
    asset calling a new helper fails here until the table names it."""
    _, sources = _write_sources(tmp_path)
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    resources = {"storage": storage, "tokenizer_settings": TokenizerSettings(vocab_size=512, sample_lines=5_000)}
    both_chunks = {"dagster/asset_partition_range_start": "stdlib_code",
                   "dagster/asset_partition_range_end": "stdlib_docs"}
    ran: dict[str, set[tuple[str, str]]] = {}
    with dg.instance_for_test() as instance:
        register_source_chunks(instance, storage)
        for key in ("raw_corpus", "tokenizer", "token_shards", "blend_manifest"):
            profile = cProfile.Profile()
            profile.enable()
            try:
                result = dg.materialize(DATA_ASSETS, selection=[key], instance=instance, resources=resources,
                                        tags=both_chunks if key in ("raw_corpus", "token_shards") else None)
            finally:
                profile.disable()
            assert len(result.asset_materializations_for_node(key)) == (2 if key in ("raw_corpus", "token_shards")
                                                                        else 1)
            ran[key] = {(entry.code.co_filename, entry.code.co_qualname) for entry in profile.getstats()
                        if not isinstance(entry.code, str)}
    project = f"{PROJECT_ROOT}/"
    for key, functions in ran.items():
        in_project = {(file.removeprefix(project), name) for file, name in functions
                      if file.startswith(project) and not file.startswith(f"{project}.venv/")}
        assert {file for file, _ in in_project} >= {"assets/data.py", "training/data/hashing.py"}  # seen at all
        left_out = {f"{file}:{name}" for file, name in in_project if not covered(ASSET_PARTS[key], file, name)}
        assert left_out == set(), key


def test_training_and_evaluation_launch_only_code_of_the_package_they_hash():
    """training_run and checkpoint_eval hash the whole training/ package: what they launch is a module of it, and
    it imports nothing else of the project."""
    from assets.evaluation import CheckpointEvalConfig, eval_command

    assert "training/" in ASSET_PARTS["training_run"] and "training/" in ASSET_PARTS["checkpoint_eval"]
    launched = [eval_command(PROJECT_ROOT, CheckpointEvalConfig(), True)[2]]
    body = ast.parse(part_source("assets/training.py:launch_run").decode().lstrip())
    launched += [node.elts[1].value for node in ast.walk(body) if isinstance(node, ast.List) and len(node.elts) > 1
                 and isinstance(node.elts[0], ast.Constant) and node.elts[0].value == "-m"]
    assert launched == ["training.cli", "training.run"]
    imported = set()
    for path in (PROJECT_ROOT / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert not imported & {"assets", "pipelines", "resources", "benchmarks"}
