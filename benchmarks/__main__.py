"""python -m benchmarks [--smoke] [--only NAME ...] [--figures PATH] — every benchmark of the suite, each in a
process of its own, then one summary table of every figure against its target.

A benchmark that fails is reported as failed in the summary (with its error) and the others run on; the exit
status is 1 if any failed. A timing taken while other processes competed for the cores is printed and summarized
as not valid (benchmarks/contention.py). How a benchmark joins: benchmarks/__init__.py.

The benchmarks, in order (each module's docstring says what it measures and how):
- tokenizing: `kiln preprocess` vs the fastest bare sentencepiece encoding, prose (target >= 0.9) and code;
- model_flops: tokens/s and model FLOP/s of qwen3_tiny and deepseek_v3_tiny vs this machine's fp32 matmul peak;
- throughput: qwen3_bench, qwen3_tiny and deepseek_v3_bench, Kiln's step vs PyTorch eager and torch.compile and
  the step's compiled GEMMs (targets: Qwen3 bench >= 1.0x eager and torch.compile, deepseek_v3_bench >= 1.0x
  torch.compile (issue 38), tiny >= 0.5x eager, >= 0.75 of the matmul peak; compiled peak RSS <= torch eager's);
- compile_time: the first compiled step at 2, 8 and 16 layers, layers sharing one graph vs a graph per layer;
- recompute_memory: qwen3_bench at seq 2048, activation memory and step time with full and selective recompute vs
  without, eager and compiled (targets, issue 38: full <= 0.4x the memory, <= 1.35x the step time);
- data_index: GPTDataset index build, the blend vs a scalar loop, sample fetching vs training consumption;
- monitoring: the step with every `monitor.train_state` option on vs off;
- validation: one evaluation vs 50 training steps (target <= 5% of training time);
- downstream: the fast task set's evaluation vs the training step, its share of a run evaluating every 50 steps
  (target <= 5%);
- pipes_streaming: one step report streamed to Dagster vs the same without Pipes;
- checkpoint_io: async save stall vs sync save (target <= 0.10), write throughput vs dd (target >= 0.5);
- parallel_memory: per-rank bytes and step time of ZeRO-1/2/3 vs DP at 1, 2 and 4 msrun workers;
- pipeline_bubble: gpipe, 1f1b and interleaved 1F1B's bubble vs the analytic, bytes, step vs DP2;
- expert_parallel: DeepSeek-V3 tiny EP2 vs DP, its all-to-all bytes, compiled vs eager;
- context_parallel: ring, zig-zag and Ulysses CP2 vs DP2, compiled vs eager, bytes vs the analytic count;
- compiled_parallel: TP2, PP2 and ZeRO-3 compiled vs eager and vs DP2, one layer's gather eagerly vs in a graph;
- lineage_scale: lineage commands and every UI tab at 10, 1,000 and 10,000 checkpoints (targets < 1 s; < 2 s and
  < 2x the 10-checkpoint load), ~35 min to build the levels the first time (kept under .kiln/);
- preprocess_memory: peak RSS of `kiln preprocess` on a corpus larger than RAM / 4 vs 600 MiB (~30 min);
- chunked_preprocess: a 16-chunk backfill vs one `kiln preprocess` (target >= 0.9);
- cleaning: the FineWeb filter chain vs DataTrove (its own venv, made on the first run; target >= 1.0), near-dup
  and exact-dup quality on planted pairs and agreement with DataTrove's MinHash, language ID, Ray, memory.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SUITE
from benchmarks.contention import tree_cpu_seconds
from benchmarks.suite import Bench, read_figures, summary

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_one(name: str, work: Path, figures: Path, smoke: bool) -> None:
    """In the benchmark's own process: its ``run(bench)``."""
    importlib.import_module(f"benchmarks.{name}").run(Bench(name, work, figures, smoke))


def run_suite(names: list[str], work: Path, figures: Path, smoke: bool) -> dict[str, str]:
    """Each benchmark in a process of its own; the ones that failed, with the last line of their error."""
    failed = {}
    for name in names:
        print(f"== {name} (load {os.getloadavg()[0]:.1f})", flush=True)
        started, cpu = time.perf_counter(), tree_cpu_seconds()
        process = subprocess.Popen([sys.executable, "-m", "benchmarks", "--run", name, "--work", str(work),
                                    "--figures", str(figures), *(["--smoke"] if smoke else [])],
                                   cwd=PROJECT_ROOT, stderr=subprocess.PIPE, text=True)
        last = ""  # its stderr passes through; its last line names a failure
        for line in process.stderr:
            sys.stderr.write(line)
            last = line.strip() or last
        if process.wait():
            failed[name] = last or f"exit status {process.returncode}"
        print(f"== {name}: {'FAILED' if process.returncode else 'done'} in {time.perf_counter() - started:.0f} s, "
              f"{tree_cpu_seconds() - cpu:.0f} CPU-s (load {os.getloadavg()[0]:.1f})", flush=True)
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every benchmark at its smallest size")
    parser.add_argument("--only", nargs="+", choices=SUITE, help="these benchmarks only")
    parser.add_argument("--figures", type=Path, help="the figures file (JSON lines; default: a temporary one)")
    parser.add_argument("--work", type=Path, help="a directory for the benchmarks' data, kept and reused (the "
                                                  "tokenized shard; default: a temporary one)")
    parser.add_argument("--run", choices=SUITE, help=argparse.SUPPRESS)  # one benchmark, in this process
    args = parser.parse_args(argv)
    if args.run:
        run_one(args.run, args.work, args.figures, args.smoke)
        return 0
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        figures = args.figures or Path(tmp) / "figures.jsonl"
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        failed = run_suite(args.only or list(SUITE), work, figures, args.smoke)
        print("\n" + summary(read_figures(figures), failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
