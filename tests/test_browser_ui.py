"""The Dagster UI in headless Chromium: materialize the chain with clicks, then look at the checkpoints.

Chromium is Debian's (tests/setup/chromium.sh, run by `make test`); Playwright only drives it. The
test skips, saying why, only where Chromium or Playwright is missing. Screenshots land in the test's
output directory (printed).
"""
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from assets.data import BlendConfig
from conftest import MICRO_CONFIG, PROJECT_ROOT
from dagster import DagsterRunStatus
from dagster_dev import dagster_dev, wait_for_run

pytestmark = [pytest.mark.ui, pytest.mark.browser]
CHROMIUM = Path("/usr/bin/chromium")
RUN_NAME = "qwen3_tiny"  # TrainingRunConfig's default run_name: the UI launches with the defaults
STEPS, SAVE_EVERY = 16, 8


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing and tests/setup/chromium.sh could not install it")
    return sync_playwright


def _workspace(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text("load_from:\n  - python_file:\n"
                         f"      relative_path: {PROJECT_ROOT / 'tests/ui_definitions.py'}\n"
                         f"      working_directory: {PROJECT_ROOT}\n      location_name: kiln\n")
    return workspace


def _training_yaml(tmp_path: Path) -> Path:
    """The micro model as a YAML that leaves seq_length, split and seed to the blend manifest, as the shipped
    configs do: the UI launches blend_manifest with its defaults (seq_length 128, the micro YAML's is 32)."""
    data = yaml.safe_load((PROJECT_ROOT / MICRO_CONFIG).read_text())
    for key in ("seq_length", "split", "seed"):
        data["train_dataset"]["dataloader"]["config"].pop(key, None)
    del data["model"]["seq_length"]
    data["model"]["max_position_embeddings"] = BlendConfig().seq_length
    # long enough that the UI can be looked at while it trains
    data["training"]["steps"] = STEPS
    data["checkpoint"]["save_interleaved_steps"] = SAVE_EVERY
    path = tmp_path / "micro_from_manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _dismiss_welcome(page):
    """A first visit shows a "Join the Dagster community" dialog that swallows clicks (when it is not shown,
    waiting for it times out; anything else is an error)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(timeout=15_000)
    except PlaywrightTimeoutError:
        return
    skip.click()


RUNS_QUERY = "{ runsOrError { ... on Runs { results { runId status } } } }"
OBSERVATIONS_QUERY = """{ assetOrError(assetKey: {path: ["training_run"]}) { ... on Asset {
    assetObservations(limit: 1000) { timestamp metadataEntries { label ... on FloatMetadataEntry { floatValue } } }
    assetMaterializations(limit: 1) { timestamp } } } }"""


def _training_events(client) -> tuple[list[dict], list[dict]]:
    asset = client._execute(OBSERVATIONS_QUERY)["assetOrError"]
    return asset.get("assetObservations", []), asset.get("assetMaterializations", [])


def _run_status(client) -> list[str]:
    return [r["status"] for r in client._execute(RUNS_QUERY)["runsOrError"]["results"]]


def _wait_for_observations(client, count: int, timeout: float = 420) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(_training_events(client)[0]) >= count:
            return
        assert "FAILURE" not in _run_status(client)
        time.sleep(1)
    pytest.fail(f"training_run had no {count} step observations after {timeout} s")


def _plot_painted_pixels(page, title: str) -> int:
    """The Plots tab's chart under ``title``: how many of its canvas's pixels are drawn."""
    label = page.get_by_text(title, exact=True).first
    label.wait_for()
    label.scroll_into_view_if_needed()
    canvas = label.locator("xpath=ancestor::*[.//canvas][1]").locator("canvas").first
    canvas.wait_for()
    page.wait_for_timeout(1500)  # the chart animates its first draw
    return canvas.evaluate(PAINTED_PIXELS)


def _wait_for_the_run(client, timeout: float = 420) -> str:
    """The backfill's run: wait until every run ended; it must have succeeded."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = client._execute(RUNS_QUERY)["runsOrError"]["results"]
        if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs):
            assert [r["status"] for r in runs] == ["SUCCESS"], runs
            return runs[0]["runId"]
        time.sleep(2)
    pytest.fail(f"the chain's run did not finish in {timeout} s")


def _step_failures(tmp_path: Path, run_ids: list[str]) -> list[str]:
    import dagster as dg

    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        return [event.message for run_id in run_ids
                for event in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)]


# counts a canvas's non-transparent pixels
PAINTED_PIXELS = """canvas => {
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let painted = 0;
    for (let i = 3; i < data.length; i += 4) painted += data[i] > 0;
    return painted;
}"""


def _sources(tmp_path: Path) -> Path:
    """Two small sources, each with documents for the validation split checkpoint_eval reads. (The micro
    sources' code has 10 files, and the blend's default split 98,2,0 holds out round(0.02 x 10) = 0 of them:
    kiln eval would leave it out, and the charts checked here are per source.) Equal weights: a batch of 4
    samples takes 2 from each."""
    path = tmp_path / "sources.yaml"
    path.write_text("sources:\n"
                    "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 80000}\n"
                    "  stdlib_docs_head: {builtin: python_stdlib_docstrings, max_bytes: 60000}\n")
    return path


def test_materialize_the_chain_in_the_browser(tmp_path):
    sync_playwright = _playwright()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"\nscreenshots: {shots}")
    env = {"KILN_SOURCES": str(_sources(tmp_path)), "KILN_AUTOMATION": "off",
           "KILN_TRAIN_CONFIG": str(_training_yaml(tmp_path))}
    with dagster_dev(tmp_path, env, _workspace(tmp_path)) as (client, url), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)

        # the chain: the preprocess_then_train job's asset graph
        page.goto(f"{url}/locations/kiln/jobs/preprocess_then_train")
        _dismiss_welcome(page)
        page.screenshot(path=shots / "01_chain.png")
        page.get_by_role("button", name=re.compile(r"Materialize all")).click()
        page.get_by_text("Launch runs to materialize 6 assets").wait_for()
        page.get_by_role("button", name="All", exact=True).click()
        page.get_by_text("2 partitions", exact=True).wait_for()  # one per source
        page.screenshot(path=shots / "02_all_partitions.png")
        page.get_by_role("button", name=re.compile(r"Launch backfill")).click()
        page.get_by_text(re.compile(r"Created backfill")).first.wait_for()

        # while it trains: training_run's Plots tab draws the step curves from its per-step observations
        _wait_for_observations(client, 2)
        page.goto(f"{url}/assets/training_run?view=overview")
        page.get_by_role("button", name=re.compile(r"Plots$")).click()
        live = {title: _plot_painted_pixels(page, title) for title in ("loss", "lr", "grad_norm", "tokens_per_s")}
        page.screenshot(path=shots / "03_training_run_live_plots.png")
        print(f"live plots drawn with the run {_run_status(client)}, {len(_training_events(client)[0])} steps in")
        assert all(painted > 200 for painted in live.values()), live
        _wait_for_the_run(client)
        # one observation per step (log_interval 1), every one recorded before training_run's materialization
        observations, (materialization,) = _training_events(client)
        assert len(observations) == STEPS
        assert max(float(o["timestamp"]) for o in observations) < float(materialization["timestamp"])
        losses = [next(e["floatValue"] for e in o["metadataEntries"] if e["label"] == "loss")
                  for o in sorted(observations, key=lambda o: float(o["timestamp"]))]
        metrics = [json.loads(line) for line in (tmp_path / f"runs/{RUN_NAME}/metrics.jsonl").read_text().splitlines()]
        assert losses == pytest.approx([m["loss"] for m in metrics], rel=1e-6)

        # the checkpoint asset: a partition per saved step, and its metadata plotted over them
        page.goto(f"{url}/assets/checkpoint?view=partitions")
        for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
            page.get_by_text(f"{RUN_NAME}/iteration_{step:08d}").first.wait_for()
        page.screenshot(path=shots / "04_checkpoint_partitions.png")
        # each checkpoint's audit result is on its own partition (the audit check itself is unpartitioned)
        page.goto(f"{url}/assets/checkpoint?view=partitions&partition={RUN_NAME}%2Fiteration_{STEPS:08d}")
        page.get_by_text(re.compile(r"^passed: \d+ file\(s\) verified$")).first.wait_for()
        page.screenshot(path=shots / "04b_checkpoint_audit.png")
        page.goto(f"{url}/assets/checkpoint?view=overview")
        page.get_by_role("button", name=re.compile(r"Plots$")).click()
        # the plot under the "loss" title is drawn: its canvas has painted pixels (a line over the partitions)
        painted = _plot_painted_pixels(page, "loss")
        page.screenshot(path=shots / "05_checkpoint_plots.png")
        assert painted > 200, f"the loss plot's canvas has {painted} painted pixels"

        # checkpoint_eval (automation is off here: launched as its sensor would, one run per checkpoint): its
        # Plots tab draws the held-out loss over the checkpoints, overall and per source, and a task's score
        checkpoints = [f"{RUN_NAME}/iteration_{step:08d}" for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
        eval_config = {"batches": 1, "tasks": ["arc_easy"], "task_limit": 5}
        runs = [client.submit_job_execution("__ASSET_JOB", asset_selection=["checkpoint_eval"],
                                            tags={"dagster/partition": key},
                                            run_config={"ops": {"checkpoint_eval": {"config": eval_config}}})
                for key in checkpoints]
        failed = [run for run in runs if wait_for_run(client, run) != DagsterRunStatus.SUCCESS]
        assert not failed, _step_failures(tmp_path, failed)
        sources = sorted(json.loads(next((tmp_path / f"runs/{RUN_NAME}/checkpoints").glob(
            f"iteration_{STEPS:08d}/eval.json")).read_text())["sources"])
        page.goto(f"{url}/assets/checkpoint_eval?view=overview")
        page.get_by_role("button", name=re.compile(r"Plots$")).click()
        curves = {title: _plot_painted_pixels(page, title)
                  for title in ["loss", *(f"loss_{s}" for s in sources), "task_arc_easy", "bpb"]}
        page.screenshot(path=shots / "06_checkpoint_eval_plots.png", full_page=True)
        assert len(sources) == 2 and all(painted > 200 for painted in curves.values()), curves
        browser.close()
    assert (tmp_path / f"runs/{RUN_NAME}/checkpoints/iteration_{STEPS:08d}/common.json").exists()
