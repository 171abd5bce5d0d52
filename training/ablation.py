"""Data ablations: the same small proxy model trained on each blend variant for the same token budget, with two
seeds or more, each final checkpoint scored on the downstream tasks; a ranking of the variants with the spread
over seeds (FineWeb's method: compare data by what a small model trained on it can do, not by its loss, which
depends on the blend's own held-out text).

An ablation spec (YAML, e.g. configs/ablation.yaml)::

    proxy_config: configs/ablation_proxy.yaml  # the proxy model and optimizer (MindFormers layout)
    tokens: 102400                             # training tokens per run: steps = tokens / (global batch x seq)
    seeds: [1, 2]
    tasks: [fast]                              # training/tasks.py names
    task_limit: 100                            # documents per task
    variants:                                  # name -> source weights (of the blend manifest's sources)
      code_heavy: {stdlib_code: 0.8, stdlib_docs: 0.2}

A variant's blend is the blend manifest's shards under the variant's weights (a source it leaves out is not
read), written as a manifest of its own under ``<data root>/blend/ablation/`` so each run's lineage names it.
``python -m training.ablation SPEC VARIANT`` runs one variant (the ablation_run asset launches it per
partition) and writes ``<runs root>/ablation/<variant>/result.json``; ``rank`` orders the results.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path


ABLATION_DIR = "ablation"  # under the runs root (results, runs) and the data root's blend/ (variant manifests)


@dataclass
class AblationSpec:
    proxy_config: str
    tokens: int
    variants: dict[str, dict[str, float]]
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    tasks: list[str] = field(default_factory=lambda: ["fast"])
    task_limit: int = 100

    @classmethod
    def load(cls, path: str | Path) -> "AblationSpec":
        """The spec at ``path``, read as a training config is (duplicate keys, alias bombs and nesting refused:
        training.config.read_yaml_mapping); every problem of its fields in one ValueError naming them."""
        from training.config import read_yaml_mapping, shown

        data = read_yaml_mapping(path, "an ablation spec")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {shown(sorted(unknown))}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        problems = [f"{path}: {field} {need}, got {shown(data[field])}" for field, (valid, need) in _SPEC_FIELDS.items()
                    if field in data and not valid(data[field])]
        problems += [f"{path}: {field} is required" for field in ("proxy_config", "tokens", "variants")
                     if field not in data]
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**data)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _weight(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


_SPEC_FIELDS = {  # field -> (its check, what it needs)
    "proxy_config": (lambda v: isinstance(v, str) and v != "", "must be a training config's path"),
    "tokens": (_positive_int, "must be an integer > 0"),
    "seeds": (lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(x, int) for x in v),
              "must list two integers or more (the spread over seeds)"),
    "tasks": (lambda v: isinstance(v, list) and v != [] and all(isinstance(x, str) for x in v),
              "must list task names (training/tasks.py)"),
    "task_limit": (_positive_int, "must be an integer > 0"),
    "variants": (lambda v: isinstance(v, dict) and v != {} and all(
        isinstance(weights, dict) and weights != {} and all(isinstance(k, str) and _weight(w) for k, w in weights.items())
        for weights in v.values()), "must map each variant's name to its sources' weights (numbers > 0)"),
}


def variant_manifest(manifest: dict, weights: dict[str, float], data_root: Path, name: str) -> Path:
    """The blend manifest with ``weights`` for its sources (those not named are left out), written to
    ``<data root>/blend/ablation/<name>.json``; a name that is no source of the manifest is a ValueError."""
    from training.atomic import write_json_atomic
    from training.data.manifest import build_manifest

    by_name = {source["name"]: source for source in manifest["sources"]}
    unknown = sorted(set(weights) - set(by_name))
    if unknown:
        raise ValueError(f"variant {name}: source(s) {', '.join(unknown)} are not in the blend manifest "
                         f"(its sources: {', '.join(sorted(by_name))})")
    sources = [{**by_name[source], "weight": weight,
                "shards": [{**s, "prefix": str(data_root / s["prefix"])} for s in by_name[source]["shards"]]}
               for source, weight in weights.items()]
    built = build_manifest(sources=sources, tokenizer={**manifest["tokenizer"],
                                                       "path": str(data_root / manifest["tokenizer"]["path"])},
                           seq_length=manifest["seq_length"], split=manifest["split"], seed=manifest["seed"],
                           data_root=data_root)
    path = data_root / "blend" / ABLATION_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, built)
    return path


def train_and_score(spec: AblationSpec, manifest_path: Path, data_root: Path, run_dir: Path, seed: int) -> dict:
    """One proxy run on the variant's manifest: trained from scratch to the token budget, its last checkpoint
    scored on the spec's tasks (eval.json beside it, as kiln eval writes it)."""
    from training.config import load_config
    from training.data.manifest import read_manifest, training_data_path
    from training.downstream import TaskRun, discard_partial
    from training.evaluation import evaluate_checkpoint, write_evaluation
    from training.lineage import lineage_inputs
    from training.parallel.mesh import World
    from training.reporting import Reporter
    from training.tasks import resolve_names
    from training.step import configure_runtime
    from training.trainer import Trainer

    manifest, digest = read_manifest(manifest_path, data_root)
    special = manifest["tokenizer"]["special_ids"]
    wiring = [f"train_dataset.dataloader.config.data_path={json.dumps(training_data_path(manifest, data_root))}",
              f"train_dataset.dataloader.config.eod={special['eod']}",
              f"train_dataset.dataloader.config.pad={special['pad']}",
              f"train_dataset.dataloader.config.seq_length={manifest['seq_length']}",
              f"model.seq_length={manifest['seq_length']}",
              f"train_dataset.dataloader.config.split='{manifest['split']}'",
              f"train_dataset.dataloader.config.seed={manifest['seed']}", f"training.seed={seed}",
              f"checkpoint.save_path={run_dir / 'checkpoints'}",
              f"train_dataset.dataloader.config.path_to_cache={run_dir / 'index_cache'}"]
    # the token budget in steps of the proxy's global batch
    steps = max(1, spec.tokens // (load_config(spec.proxy_config, wiring).training.global_batch_size
                                   * manifest["seq_length"]))
    config = load_config(spec.proxy_config, [*wiring, f"training.steps={steps}",
                                             f"checkpoint.save_interleaved_steps={steps}"])
    configure_runtime(config)
    trainer = Trainer(config, World(rank=0, size=1), run_dir, Reporter(run_dir / "metrics.jsonl", enabled=True),
                      lineage_inputs=lineage_inputs(manifest_path, data_root, read=(manifest, digest)))
    summary = trainer.train()
    checkpoint = Path(summary.last_checkpoint)
    record = evaluate_checkpoint(checkpoint, batches=1, tasks=TaskRun(resolve_names(spec.tasks), spec.task_limit))
    write_evaluation(record)
    discard_partial(checkpoint)
    return {"seed": seed, "steps": steps, "tokens": steps * config.training.global_batch_size * manifest["seq_length"],
            "final_loss": summary.last_loss, "checkpoint": str(checkpoint),
            "tasks_primary": record["tasks_mean"]["primary"], "tasks_bpb": record["tasks_mean"]["bpb"],
            "tasks": {name: s["primary"] for name, s in record["tasks"].items()}, "held_out_bpb": record.get("bpb")}


def run_variant(spec: AblationSpec, name: str, manifest: dict, data_root: Path, runs_root: Path) -> Path:
    """Every seed of variant ``name``; returns ``<runs root>/ablation/<name>/result.json``."""
    from training.atomic import write_json_atomic

    if name not in spec.variants:
        raise ValueError(f"variant {name!r} is not in the spec (variants: {', '.join(spec.variants)})")
    manifest_path = variant_manifest(manifest, spec.variants[name], data_root, name)
    out = runs_root / ABLATION_DIR / name
    seeds = [train_and_score(spec, manifest_path, data_root, out / f"seed{seed}", seed) for seed in spec.seeds]
    result = {"variant": name, "weights": spec.variants[name], "manifest": str(manifest_path), "seeds": seeds,
              "tasks": spec.tasks, "task_limit": spec.task_limit, "tokens": spec.tokens}
    path = out / "result.json"
    write_json_atomic(path, result)
    return path


def rank(results: list[dict]) -> list[dict]:
    """Per variant the mean over seeds and the spread (max - min) of the tasks' mean bits per byte and mean primary
    score, best first by bits per byte: at proxy scale accuracy sits near chance long after bpb has moved, and
    bpb is measured on the same task text for every variant (a variant's held-out loss is on its own blend)."""
    rows = []
    for result in results:
        bpb = [s["tasks_bpb"] for s in result["seeds"]]
        primary = [s["tasks_primary"] for s in result["seeds"]]
        tasks = sorted(result["seeds"][0]["tasks"])
        rows.append({"variant": result["variant"], "seeds": len(bpb),
                     "tasks_bpb": statistics.mean(bpb), "tasks_bpb_spread": max(bpb) - min(bpb),
                     "tasks_primary": statistics.mean(primary), "tasks_primary_spread": max(primary) - min(primary),
                     "per_task": {t: statistics.mean(s["tasks"][t] for s in result["seeds"]) for t in tasks}})
    return sorted(rows, key=lambda row: row["tasks_bpb"])


def ranking_table(rows: list[dict]) -> str:
    """Markdown: rank, variant, the means ± half the spread, and each task's mean primary score."""
    tasks = sorted({t for row in rows for t in row["per_task"]})
    lines = ["| rank | variant | seeds | tasks bpb (spread) | tasks primary (spread) | " + " | ".join(tasks) + " |",
             "|---|---|---|---|---|" + "---|" * len(tasks)]
    for i, row in enumerate(rows, 1):
        lines.append(f"| {i} | {row['variant']} | {row['seeds']} | {row['tasks_bpb']:.4f} "
                     f"({row['tasks_bpb_spread']:.4f}) | {row['tasks_primary']:.4f} ({row['tasks_primary_spread']:.4f})"
                     " | " + " | ".join(f"{row['per_task'].get(t, float('nan')):.3f}" for t in tasks) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from training.data.manifest import read_manifest

    parser = argparse.ArgumentParser(prog="python -m training.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the ablation spec YAML")
    parser.add_argument("variant")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--runs-root", required=True)
    args = parser.parse_args(argv)
    data_root, runs_root = Path(args.data_root).resolve(), Path(args.runs_root).resolve()
    try:
        spec = AblationSpec.load(args.spec)
        manifest, _ = read_manifest(data_root / "blend" / "manifest.json", data_root)
        path = run_variant(spec, args.variant, manifest, data_root, runs_root)
    except (ValueError, OSError) as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
