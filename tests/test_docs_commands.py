"""The commands README.md and docs/ show work on a fresh demo: `make demo`'s chain (python -m pipelines.demo) into a
scratch project directory, then every shell command of their ```bash blocks run there as shown. A command is
either run or listed in SKIPPED with the reason, so a command added to the docs is classified before it ships."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
# a command shown -> why the test does not run it
SKIPPED = {
    "make demo": "what builds the state the others run on (pipelines.demo, run by the fixture)",
    "make test": "the test suite itself",
    "make ui": "starts a webserver and daemon that run until stopped (tests/test_browser_ui.py covers the UI)",
    "kiln preprocess": "its inputs (a.jsonl, b.parquet) are the reader's own files, not the demo's",
    "kiln merge": "its input, data/shards/web, is a source of the reader's, not the demo's",
    "kiln clean": "its input, corpus.jsonl, is the reader's file, not the demo's (test_cleaning runs kiln clean)",
    "python -m training.launch \"python -m training.run": "two msrun workers for 20 steps: not a cheap command "
                                                           "(test_resume covers launching through training.launch)",
    "python -m training.launch \"<command>\"": "a template (<command>, WORKER_NUM ...)",
}


def shown_commands() -> list[tuple[str, str]]:
    """(file, command) for every command of a ```bash block, continuation lines joined, comments dropped."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(), re.S):
            for command in re.sub(r"\\\n\s*", " ", block).splitlines():
                command = re.sub(r"\s+#.*$", "", command).strip()
                if command and not command.startswith("#"):
                    found.append((doc.name, command))
    return found


def skip_reason(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.removeprefix(".venv/bin/").startswith(start)), None)


def runnable(command: str) -> str:
    """The command as a shell runs it: optional arguments shown in [brackets] left out."""
    return re.sub(r"\s\[[^\]]*\]", "", command)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict]:
    """A scratch directory laid out as the project after `make demo`: data/, runs/, the Dagster home, and links to
    the project's .venv and configs."""
    root = tmp_path_factory.mktemp("demo")
    for name in (".venv", "configs", "pipelines", "assets", "resources", "training", "workspace.yaml"):
        (root / name).symlink_to(PROJECT_ROOT / name)
    (root / ".dagster_home").mkdir()
    env = {**os.environ, "KILN_DATA_ROOT": str(root / "data"), "KILN_RUNS_ROOT": str(root / "runs"),
           "DAGSTER_HOME": str(root / ".dagster_home"), "PYTHONPATH": str(PROJECT_ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-m", "pipelines.demo"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root, env


def test_every_command_shown_is_run_or_skipped_with_a_reason():
    unclassified = [c for _, c in shown_commands() if not c.removeprefix(".venv/bin/").startswith(
        ("kiln ", "python -m ")) and skip_reason(c) is None]
    assert unclassified == []


@pytest.mark.msrun
def test_the_commands_the_docs_show_work_on_a_fresh_demo(demo):
    root, env = demo
    failures = []
    for doc, command in shown_commands():
        if skip_reason(command):
            continue
        done = subprocess.run(runnable(command), shell=True, cwd=root, env=env, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            failures.append(f"{doc}: {command}\n  exit {done.returncode}: {(done.stderr or done.stdout)[-600:]}")
    assert not failures, "\n".join(failures)
