"""The reference libraries of the interop tests, as fixtures: imported by the tests that use them, not when a
pytest-xdist worker collects the modules (every worker collects every module, and torch, transformers and
olmo_eval took ~7 s of each one's start). Without the interop extra, the tests that use them are skipped."""
import pytest

SKIP_REASON = "the interop extra is not installed (pip install -e '.[interop]': torch==2.13.0, transformers)"


@pytest.fixture(scope="session")
def transformers():
    pytest.importorskip("torch", reason=SKIP_REASON)
    return pytest.importorskip("transformers", reason=SKIP_REASON)


@pytest.fixture(scope="session")
def olmo_eval(transformers):
    """olmo_eval's metrics, tasks and tokenizer interface (its code needs torch, torchmetrics and datasets)."""
    pytest.importorskip("olmo_eval.metrics", reason="olmo_eval's code needs torchmetrics, datasets and "
                                                    "importlib_resources (pip install -e '.[interop]')")
    import olmo_eval.tasks
    import olmo_eval.tokenizer

    return olmo_eval
