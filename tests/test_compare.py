"""Runs side by side: `kiln compare` and the run_comparison asset read each run's metrics.jsonl and evaluations by
tokens seen, print a table of the latest values and draw a panel per metric with a line per run."""
import json
import re

import dagster as dg
import pytest

from training.cli import main as kiln
from training.compare import read_run


def write_run(root, name, tokens_per_step, losses, val=None, evaluation=None):
    """A run directory as the trainer and kiln eval leave it: step records with tokens_seen, validation records,
    and a checkpoint's eval.json."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    lines = []
    for step, loss in enumerate(losses, 1):
        lines.append({"step": step, "loss": loss, "tokens_seen": step * tokens_per_step})
        if val and step in val:
            lines.append({"step": step, "val_loss": val[step][0], "val_ppl": 1.0, "val_bpb": val[step][1]})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if evaluation:
        step, tasks = evaluation
        sidecar = run / "checkpoints" / f"iteration_{step:08d}" / "eval.json"
        sidecar.parent.mkdir()
        sidecar.write_text(json.dumps({
            "checkpoint": {"step": step}, "global_batch_size": 1, "seq_length": tokens_per_step, "loss": 3.0,
            "bpb": 2.5, "sources": {}, "tasks": {n: {"primary": v, "bpb": 1.0} for n, v in tasks.items()},
            "tasks_mean": {"primary": sum(tasks.values()) / len(tasks), "bpb": 1.0}}))
    return run


@pytest.fixture
def runs(tmp_path):
    # a takes 100 tokens a step, b 250: b's step 2 is at 500 tokens, as far as a's step 5
    write_run(tmp_path, "a", 100, [5.0, 4.5, 4.2, 4.0, 3.9], val={5: (4.1, 1.9)},
              evaluation=(5, {"arc_easy": 0.30, "piqa": 0.52}))
    write_run(tmp_path, "b", 250, [5.1, 4.4], val={2: (4.3, 1.7)}, evaluation=(2, {"arc_easy": 0.34, "piqa": 0.50}))
    return tmp_path


def test_runs_line_up_by_tokens_seen(runs):
    a, b = read_run(runs / "a"), read_run(runs / "b")
    assert a.curves["loss"][-1] == (500, 3.9) and b.curves["loss"][-1] == (500, 4.4)
    assert a.curves["val_bpb"] == [(500, 1.9)] and b.curves["val_loss"] == [(500, 4.3)]
    assert a.curves["task arc_easy"] == [(500, 0.30)] and b.curves["tasks mean"] == [(500, pytest.approx(0.42))]


def test_kiln_compare_prints_the_table_and_writes_a_panel_per_metric(runs, capsys):
    out_page = runs / "cmp.html"
    assert kiln(["compare", "a", "b", "--runs-root", str(runs), "--out", str(out_page)]) == 0
    out = capsys.readouterr().out
    assert "| metric | a | b |" in out and "| tokens seen | 500 | 500 |" in out
    assert "| val_bpb | 1.9000 | 1.7000 |" in out and "| task piqa | 0.5200 | 0.5000 |" in out
    page = out_page.read_text()
    panels = re.findall(r"<svg .*?</svg>", page)
    titles = [re.search(r'font-size="12">(.*?)</text>', p).group(1) for p in panels]
    assert titles == ["loss", "val_loss", "val_bpb", "eval_loss", "eval_bpb", "tasks mean", "tasks mean bpb",
                      "task arc_easy", "task piqa"]
    loss_panel = next(p for p in panels if ">loss</text>" in p)
    assert loss_panel.count("<polyline") == 2  # a line per run


def test_kiln_compare_names_a_run_it_cannot_find(runs, capsys):
    assert kiln(["compare", "a", "nope", "--runs-root", str(runs)]) == 2
    assert f"run 'nope': no metrics.jsonl in nope or {runs / 'nope'}" in capsys.readouterr().err


def test_the_run_comparison_asset_carries_the_table_and_plots(runs):
    from assets.evaluation import run_comparison
    from pipelines.definitions import resources
    from resources.storage import KilnStorage

    result = dg.materialize([run_comparison], resources=resources(storage=KilnStorage(runs_root=str(runs))))
    (event,) = result.asset_materializations_for_node("run_comparison")
    metadata = {k: v.value for k, v in event.metadata.items()}
    assert metadata["runs"] == "a, b" and "| task arc_easy | 0.3000 | 0.3400 |" in metadata["table"]
    assert metadata["plots"].count("](data:image/svg+xml;base64,") == 9
    assert (runs / "comparison.html").is_file() and metadata["page"] == str(runs / "comparison.html")
