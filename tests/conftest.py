import os
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MICRO_CONFIG = "tests/configs/qwen3_micro.yaml"

# msrun starts workers with the `python` on PATH: make it this interpreter's
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def write_micro_sources(path: Path) -> Path:
    """Both built-in sources, small enough for a test-sized tokenizer and model."""
    path.write_text(
        "sources:\n"
        "  stdlib_code: {builtin: python_stdlib_code, max_bytes: 150000, weight: 0.6}\n"
        "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 80000, weight: 0.4}\n")
    return path


@pytest.fixture
def micro_sources(tmp_path) -> Path:
    return write_micro_sources(tmp_path / "sources.yaml")
