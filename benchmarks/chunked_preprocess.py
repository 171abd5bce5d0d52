"""python -m benchmarks.chunked_preprocess [--corpus-mib M | --gib 1] [--rounds R] [--step-mib S ...] — a chunked
source's backfill (the `shard_chunks` job under the multiprocess executor, 2 steps at once, each step tokenizing a
group of contiguous chunks of at least S raw MiB) vs one `kiln preprocess` of the same files, and Dagster's
per-step overhead.

The corpus is the built-in `stdlib_code` source written again and again into 16 JSONL files of M/16 MiB each,
a source with `files_per_chunk: 1`, so 16 chunks. Ingest and the tokenizer are built once, untimed (the
reference has neither). Each round times, as whole processes from start to exit:
- reference: `kiln preprocess` of the 16 files into one dataset (2 tokenizing workers, the CPU count);
- a backfill per `--step-mib` value (default: 0, a step per chunk, and chunks_of_run's default): a process that
  executes `shard_chunks` over the 16 chunks (what a run worker does: it loads the code location, then the
  executor forks each step from a forkserver, 2 at a time, each tokenizing with 1 worker), recording every
  chunk's materialization in a SQLite instance.
The arms run in turn, in reverse order every other round, and each round's ratio is reference seconds / backfill
seconds (target >= 0.9: the backfill at least 0.9x as fast as one process). Per-step overhead: a tokenizing
step's wall time from the executor starting its worker to the step's success, minus the seconds its chunks'
tokenize_to_indexed calls took (also given per chunk: the steps' overhead over the chunks they tokenized).

Each arm's CPU seconds (user + system of its whole process tree, the forkserver and its step processes
included) are printed too: on a loaded machine they vary much less than the wall time.

Figures, and where a step's time goes: docs/data.md, Preprocessing a large corpus.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_least, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 16
FULL_TOKENIZER = {"sample_lines": 50_000}
# a smoke run: 4 chunks of 64 KiB (the step-per-chunk arm still runs a step per chunk, the default's one step takes
# them all), a tokenizer of 512 pieces, one round
SMOKE = {"corpus_bytes": 256 << 10, "rounds": 1, "chunks": 4, "tokenizer": {"vocab_size": 512, "sample_lines": 2_000}}
BACKFILL_CONCURRENCY = 2


def write_corpus(directory: Path, total_bytes: int, chunks: int = CHUNKS) -> list[Path]:
    """``chunks`` JSONL files of the built-in stdlib_code documents, repeated up to total_bytes / chunks each."""
    from assets.builtin_corpus import write_builtin_source

    seed = directory / "seed"
    write_builtin_source("python_stdlib_code", seed, min(40_000_000, total_bytes))
    lines = b"".join(p.read_bytes() for p in sorted(seed.glob("part-*"))).splitlines(keepends=True)
    files, cursor = [], 0
    for i in range(chunks):
        path = directory / f"corpus-{i:02d}.jsonl"
        with open(path, "wb") as out:
            written = 0
            while written < total_bytes // chunks:
                line = lines[cursor % len(lines)]
                out.write(line)
                written += len(line)
                cursor += 1
        files.append(path)
    return files


def _storage_config(root: Path) -> dict:
    return {"data_root": str(root / "data"), "runs_root": str(root / "runs"), "sources_config": str(root / "sources.yaml")}


def prepare(root: Path, files: list[Path], tokenizer: dict) -> list[str]:
    """Sources config, chunks registered, raw chunks ingested and the tokenizer (``tokenizer``: its settings)
    trained; the chunk keys."""
    import dagster as dg

    from assets.chunks import register_source_chunks
    from pipelines.definitions import build_definitions, resources
    from resources.storage import KilnStorage
    from resources.tokenizer import TokenizerSettings

    (root / "sources.yaml").write_text(f"sources:\n  corpus: {{files: {json.dumps([str(f) for f in files])}, "
                                       f"files_per_chunk: 1}}\n")
    storage = KilnStorage(**_storage_config(root))
    res = resources(storage=storage, tokenizer_settings=TokenizerSettings(**tokenizer))
    defs = build_definitions(res)
    (root / "home").mkdir()
    (root / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        keys = register_source_chunks(instance, storage)
        job = defs.resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("raw_corpus")],
                                      tags=_range_tags(keys)).success
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("tokenizer")]).success
    return keys


def _range_tags(keys: list[str]) -> dict:
    return {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}


def backfill(root: Path, keys: list[str], step_mib: float) -> str:
    """In this process (a run worker's part): `shard_chunks` over the chunks, steps of `step_mib` raw MiB;
    returns the run id."""
    import dagster as dg

    from pipelines.definitions import shard_chunks_job
    from pipelines.jobs import CHUNK_EXECUTION

    execution = {**CHUNK_EXECUTION["execution"]["config"], "max_concurrent": BACKFILL_CONCURRENCY}
    run_config = {"execution": {"config": execution}, "resources": {"storage": {"config": _storage_config(root)}},
                  "ops": {"token_shards": {"ops": {"chunks_of_run": {"config": {"step_mib": step_mib}}}}}}
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        result = dg.execute_job(dg.reconstructable(shard_chunks_job), instance, run_config=run_config,
                                tags=_range_tags(keys))
        if not result.success:
            raise SystemExit(f"the backfill run {result.run_id} failed")
        return result.run_id


def step_overheads(root: Path, run_id: str, keys: list[str], step_mib: float) -> list[tuple[float, int]]:
    """Per tokenizing step: (seconds from the executor starting its worker to its success, minus the seconds
    its chunks' tokenize_to_indexed calls took; the number of chunks it tokenized)."""
    import dagster as dg

    from assets.data import chunk_steps
    from resources.storage import KilnStorage

    chunks_of = {f"token_shards.tokenize_chunks[{step.mapping_key}]": step.chunks
                 for step in chunk_steps(KilnStorage(**_storage_config(root)), keys, step_mib)}
    starts, ends = {}, {}
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        for event in instance.all_logs(run_id):
            if not (event.is_dagster_event and event.step_key in chunks_of):
                continue
            if event.dagster_event_type == dg.DagsterEventType.STEP_WORKER_STARTING:
                starts[event.step_key] = event.timestamp
            elif event.dagster_event_type == dg.DagsterEventType.STEP_SUCCESS:
                ends[event.step_key] = event.timestamp
        tokenizing = {}
        for record in instance.fetch_materializations(dg.AssetKey("token_shards"), limit=1000).records:
            if record.run_id == run_id:
                metadata = record.asset_materialization.metadata
                tokenizing.update({key: metadata[f"tokens/{key}"].value / metadata[f"tokens_per_s/{key}"].value
                                   for key in [k.split("/", 1)[1] for k in metadata if k.startswith("tokens/")]})
    return [(ends[step] - starts[step] - sum(tokenizing[key] for key in chunks), len(chunks))
            for step, chunks in chunks_of.items() if step in starts and step in ends]


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants: a process whose parent exits (the forkserver, which
    outlives the backfill process, and the step processes it reaped) is then reaped here, so its CPU time is
    counted in this process's RUSAGE_CHILDREN instead of init's."""
    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds of ``command`` and CPU seconds (user + system) of its whole process tree, every descendant
    reaped (after adopt_orphans): on a loaded machine the CPU seconds vary much less than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    while True:  # the orphans: they exit once they see their parent gone (the forkserver, compute-log watchers)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(bench: Bench, corpus_bytes: int, rounds: int, step_mibs: list[float], chunks: int = CHUNKS,
            tokenizer: dict = FULL_TOKENIZER) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-chunks-bench-") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        files = write_corpus(root / "corpus", corpus_bytes, chunks)
        size = sum(f.stat().st_size for f in files)
        keys = prepare(root, files, tokenizer)
        model = root / "data" / "tokenizer" / "kiln.model"
        commands = {"reference": [sys.executable, "-m", "training.cli", "preprocess", "--tokenizer-model", str(model),
                                  "--output-prefix", str(root / "single" / "corpus"), "--append-eod",
                                  *[arg for f in files for arg in ("--input", str(f))]]}
        for step_mib in step_mibs:
            commands[step_mib] = [sys.executable, "-m", "benchmarks.chunked_preprocess", "--backfill-in", str(root),
                                  "--keys", ",".join(keys), "--step-mib", str(step_mib)]
        print(f"chunked preprocess: {size / 2**20:,.0f} MiB in {len(keys)} chunks, {rounds} rounds, the arms in "
              f"turn (reversed every other round): kiln preprocess, and a backfill with steps of at least "
              f"{', '.join(f'{m:g}' for m in step_mibs)} raw MiB (0: a step per chunk)", flush=True)
        adopt_orphans()
        wall = {arm: [] for arm in commands}
        cpu = {arm: [] for arm in commands}
        overheads = {step_mib: [] for step_mib in step_mibs}
        with LoadWatch() as watch:
            for i in range(rounds):
                for arm in (list(commands) if i % 2 == 0 else list(commands)[::-1]):
                    seconds, cpu_seconds = _timed(commands[arm])
                    wall[arm].append(seconds)
                    cpu[arm].append(cpu_seconds)
                    watch.cpu("kiln preprocess" if arm == "reference" else f"backfill, steps of {arm:g} MiB",
                              cpu_seconds)
                    if arm != "reference":
                        overheads[arm] += step_overheads(root, (root / "last_run_id").read_text(), keys, arm)
                print(f"  round {i + 1}: kiln preprocess {wall['reference'][-1]:.1f} s "
                      f"({cpu['reference'][-1]:.1f} CPU-s); " + "; ".join(
                          f"steps of {m:g} MiB {wall[m][-1]:.1f} s ({cpu[m][-1]:.1f} CPU-s)" for m in step_mibs),
                      flush=True)
    for m in step_mibs:
        steps = overheads[m]
        arm = f"backfill, steps of >= {m:g} MiB ({len(steps) // rounds} steps, {BACKFILL_CONCURRENCY} at once)"
        bench.report(f"{arm}: speed", size / 2**20 / statistics.median(wall[m]), "MiB/s",
                     statistics.median(r / b for r, b in zip(wall["reference"], wall[m])),
                     f"one kiln preprocess's, median of {rounds} paired rounds", target=at_least(0.9), watch=watch)
        # steadier than the wall ratio when other work shares the cores
        bench.report(f"{arm}: CPU time", statistics.median(cpu[m]), "CPU-s",
                     statistics.median(r / b for r, b in zip(cpu["reference"], cpu[m])),
                     "kiln preprocess's CPU time over the backfill's, median", watch=watch)
        bench.report(f"{arm}: per-step overhead (median)", statistics.median(o for o, _ in steps), "s", watch=watch)
        bench.report(f"{arm}: per-step overhead per chunk", sum(o for o, _ in steps) / sum(n for _, n in steps), "s",
                     watch=watch)


def run(bench: Bench) -> None:
    from assets.data import ChunkStepConfig

    if bench.smoke:
        measure(bench, step_mibs=[0.0, ChunkStepConfig().step_mib], **SMOKE)
    else:
        measure(bench, 256 << 20, 2, [0.0, ChunkStepConfig().step_mib])


def main(argv=None) -> int:
    from assets.data import ChunkStepConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mib", type=int, default=256, help="corpus size (default 256 MiB: a few minutes)")
    parser.add_argument("--gib", type=float, help="corpus size in GiB instead (the issue's figure: --gib 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-mib", type=float, nargs="+", default=[0.0, ChunkStepConfig().step_mib],
                        help="backfill arms: raw MiB per step (chunks_of_run's step_mib; default: 0, a step per "
                             "chunk, and the default)")
    parser.add_argument("--backfill-in", type=Path, help=argparse.SUPPRESS)  # one timed backfill (a child)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backfill_in:
        run_id = backfill(args.backfill_in, args.keys.split(","), args.step_mib[0])
        (args.backfill_in / "last_run_id").write_text(run_id)
        return 0
    with standalone("chunked_preprocess") as bench:
        measure(bench, int(args.gib * 2**30) if args.gib else args.corpus_mib * 2**20, args.rounds, args.step_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
