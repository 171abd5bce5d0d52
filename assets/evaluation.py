"""``checkpoint_eval``: each checkpoint's held-out loss, perplexity and bits per byte, overall and per source, and
its downstream task scores (by default the fast set, training/tasks.py FAST_TASKS).

One partition per checkpoint partition. It materializes by itself when a checkpoint appears (eager, evaluated
by ``kiln_automation``) and runs ``kiln eval`` in a process of its own, holding a slot of the training pool
(``npu``) and, where the msrun resource lists devices, a device lease: it waits for a free device instead of
sharing one with a training run. The numbers are metadata (plotted across checkpoints in the UI, one series
per source) and a sidecar beside the checkpoint, ``eval.json``, which ``kiln audit`` verifies.
"""
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
from pydantic import Field

from assets.training import TRAINING_POOL, checkpoint, checkpoint_dir, checkpoint_partitions
from assets.versions import versioned_asset
from resources.msrun import MsrunResource
from resources.storage import PROJECT_ROOT, KilnStorage


# Steps between the checkpoints scored on the downstream tasks. The held-out loss is cheap and scored at every
# checkpoint; the fast set (8 tasks x 200 documents) costs tens of the demo model's training steps, its graph's
# compiling included, so at every checkpoint of a run saving every 50 steps it would add most of the training time
# (README.md, Evaluation: the figures of benchmarks/downstream.py). OLMo runs its in-loop downstream evaluation on
# an interval of its own for the same reason; at 1000 steps the fast set is under issue 37's 5% of training time.
# A run's last checkpoint is always scored.
TASK_INTERVAL = 1000


class CheckpointEvalConfig(dg.Config):
    split: str = Field(default="", description="test or valid; empty: test when the run's blend cuts a test "
                                               "split, else valid")
    batches: int = Field(default=10, description="global batches (of the run's global_batch_size) to evaluate")
    tasks: list[str] = Field(default=["fast"], description="downstream tasks (training/tasks.py): fast (the default "
                                                            "set), <task> or <task>:<formulation>; [] for none")
    task_limit: int = Field(default=200, description="the first N documents of each task")
    task_interval: int = Field(default=TASK_INTERVAL, ge=1, description="score the tasks on checkpoints whose step "
                               "is a multiple of this and on the run's last step (training.steps); 1: every checkpoint")


def scores_tasks(path: Path, config: CheckpointEvalConfig) -> bool:
    """Whether the checkpoint at ``path`` is scored on the tasks: some are configured and its step is a multiple of
    ``task_interval`` or its run's last (a lineage that does not say: scored, and kiln eval reports the lineage)."""
    if not config.tasks:
        return False
    try:
        lineage = json.loads((path / "lineage.json").read_text())
        step, last = lineage["checkpoint"]["step"], lineage["run"]["config"]["training"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return step % config.task_interval == 0 or step >= last


def eval_command(path: Path, config: CheckpointEvalConfig, tasks: bool) -> list[str]:
    return [sys.executable, "-m", "training.cli", "eval", str(path), "--batches", str(config.batches),
            *(["--split", config.split] if config.split else []),
            *(["--tasks", ",".join(config.tasks), "--task-limit", str(config.task_limit)] if tasks else [])]


def eval_metadata(record: dict, sidecar: Path) -> dict:
    """The curves as floats, which the UI plots across the partitions, one chart each in the order of their
    names: ``loss``, ``loss_<source>`` for each source, ``ppl``, ``ppl_<source>``. The counts are text, as a
    chart of them says nothing: the step is in the partition key, and every checkpoint of a run is evaluated
    on the same samples, so the same tokens."""
    per_source = {f"{kind}_{name}": dg.MetadataValue.float(values[kind])
                  for name, values in record["sources"].items() for kind in ("loss", "ppl")}
    first, end = record["sample_range"]
    return {"split": record["split"],
            "samples": dg.MetadataValue.text(f"{first}..{end - 1} of the {record['split']} split, "
                                             f"{record['tokens']} loss tokens"),
            "loss": dg.MetadataValue.float(record["loss"]), "ppl": dg.MetadataValue.float(record["ppl"]),
            **per_source,
            "checkpoint": dg.MetadataValue.path(record["checkpoint"]["path"]),
            "sidecar": dg.MetadataValue.path(str(sidecar)),
            "shards": dg.MetadataValue.md("| source | shard | sha256 |\n|---|---|---|\n" + "\n".join(
                f"| {s['source']} | {s['path']} | {s['sha256'][:16]} |" for s in record["shards"])),
            **({"unevaluated_sources": dg.MetadataValue.md(_unevaluated_table(record["unevaluated_sources"]))}
               if record.get("unevaluated_sources") else {}),
            **_bpb_metadata(record), **task_metadata(record)}


def _bpb_metadata(record: dict) -> dict:
    """Held-out bits per byte, overall and per source, when the run's tokenizer was known."""
    if "bpb" not in record:
        return {}
    return {"bpb": dg.MetadataValue.float(record["bpb"]),
            **{f"bpb_{name}": dg.MetadataValue.float(values["bpb"]) for name, values in record["sources"].items()}}


def task_metadata(record: dict) -> dict:
    """Per task its primary metric (``task_<name>``) and bits per byte (``task_<name>_bpb``) as floats, plotted over
    the checkpoints like the losses, their means, and a table of every score."""
    if not record.get("tasks"):
        return {}
    plotted = {}
    for name, s in record["tasks"].items():
        key = "task_" + name.replace(":", "_")
        plotted[key] = dg.MetadataValue.float(s["primary"])
        plotted[f"{key}_bpb"] = dg.MetadataValue.float(s["bpb"])
    rows = "\n".join(f"| {name} | {_score(s['acc'])} | {_score(s['len_norm'])} | {s['bpb']:.4f} | "
                     f"{s['primary_metric']} | {s['instances']} | {s['requests_per_second']:.1f} |"
                     for name, s in record["tasks"].items())
    return {"tasks_mean_primary": dg.MetadataValue.float(record["tasks_mean"]["primary"]),
            "tasks_mean_bpb": dg.MetadataValue.float(record["tasks_mean"]["bpb"]), **plotted,
            "task_scores": dg.MetadataValue.md("| task | acc | len_norm | bpb | primary | instances | requests/s |\n"
                                               "|---|---|---|---|---|---|---|\n" + rows)}


def _score(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _unevaluated_table(sources: list[dict]) -> str:
    """The sources whose held-out split gives no sample (no document of theirs, or too few tokens), and why."""
    rows = "\n".join(f"| {s['source']} | {s['documents']} | {s['held_out_documents']} | {s['held_out_tokens']} | "
                     f"{s['reason']} |" for s in sources)
    return ("| source not evaluated | documents | held-out documents | held-out tokens | why |\n"
            "|---|---|---|---|---|\n" + rows)


def run_leased(context: dg.AssetExecutionContext, msrun: MsrunResource, command: list[str], what: str
               ) -> subprocess.CompletedProcess:
    """``command`` run from the project root holding a device lease of the training pool (when the msrun resource
    lists devices); a non-zero exit is a Failure with ``what`` and the tail of its output."""
    context.log.info(" ".join(command))
    with msrun.devices(context) as visible_devices:
        env = {**os.environ, **({"ASCEND_RT_VISIBLE_DEVICES": visible_devices} if visible_devices else {})}
        done = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise dg.Failure(f"{what} exited with code {done.returncode}:\n"
                         + "\n".join((done.stderr or done.stdout).splitlines()[-20:]), allow_retries=False)
    return done


@versioned_asset(partitions_def=checkpoint_partitions, deps=[checkpoint], group_name="training",
                 kinds={"mindspore"}, owners=["team:kiln"], tags={"stage": "evaluate"}, pool=TRAINING_POOL,
                 automation_condition=dg.AutomationCondition.eager())
def checkpoint_eval(context: dg.AssetExecutionContext, config: CheckpointEvalConfig, storage: KilnStorage,
                    msrun: MsrunResource) -> dg.MaterializeResult:
    """Held-out loss, perplexity and bits per byte of one checkpoint on its run's test split (valid when there is
    none), overall and per source, with the checkpoint, shards and hashes, split and sample range it read; and
    its scores on the configured downstream tasks."""
    path = checkpoint_dir(storage, context.partition_key)
    if not path.is_dir():
        raise dg.Failure(f"checkpoint {context.partition_key}: {path} is gone (rotated by checkpoint.save_max?)",
                         allow_retries=False)
    tasks = scores_tasks(path, config)
    if config.tasks and not tasks:
        context.log.info(f"tasks not scored at this step: checkpoint_eval scores them every {config.task_interval} "
                         f"steps (task_interval) and at the run's last step")
    done = run_leased(context, msrun, eval_command(path, config, tasks), "kiln eval")
    context.log.info(done.stdout)
    written = re.search(r"^wrote (.+)$", done.stdout, re.MULTILINE)
    sidecar = Path(written.group(1))
    record = json.loads(sidecar.read_text())
    return dg.MaterializeResult(metadata=eval_metadata(record, sidecar),
                                data_version=dg.DataVersion(record["results_sha256"]))


class RunComparisonConfig(dg.Config):
    runs: list[str] = Field(default=[], description="run names under the runs root; [] for every run there")


@versioned_asset(group_name="training", kinds={"python"}, owners=["team:kiln"], tags={"stage": "evaluate"})
def run_comparison(context: dg.AssetExecutionContext, config: RunComparisonConfig,
                   storage: KilnStorage) -> dg.MaterializeResult:
    """Runs side by side, by tokens seen (training/compare.py, as `kiln compare`): a table of each run's latest
    loss, validation loss / bits per byte and task scores, and a plot per metric, in the metadata (the
    Dagster UI draws one run's curves at a time; this puts several in one view) and as an HTML page."""
    from training.compare import compare_runs, svg_panel, metrics_of, table, write_html

    root = Path(storage.runs_root)
    names = config.runs or sorted(p.name for p in root.iterdir() if (p / "metrics.jsonl").is_file()) \
        if root.is_dir() else config.runs
    if not names:
        raise dg.Failure(f"no run with a metrics.jsonl under {root}", allow_retries=False)
    try:
        runs = compare_runs(names, root)
    except ValueError as exc:
        raise dg.Failure(str(exc), allow_retries=False) from None
    page = write_html(runs, root / "comparison.html")
    context.log.info(f"compared {', '.join(names)}: {page}")
    plots = "\n\n".join(f"![{metric}](data:image/svg+xml;base64,"
                        f"{base64.b64encode(svg_panel(metric, runs).encode()).decode()})"
                        for metric in metrics_of(runs))
    legend = ", ".join(f"{run.name}: {color}" for run, color in zip(runs, _colors(len(runs))))
    return dg.MaterializeResult(metadata={
        "runs": dg.MetadataValue.text(", ".join(names)), "table": dg.MetadataValue.md(table(runs)),
        "plots": dg.MetadataValue.md(f"line colors: {legend}\n\n{plots}"), "page": dg.MetadataValue.path(str(page))})


def _colors(count: int) -> list[str]:
    from training.compare import COLORS

    return [COLORS[i % len(COLORS)] for i in range(count)]
