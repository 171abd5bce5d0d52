"""python -m benchmarks.throughput [--rounds N] [--configs ...] — one full training step (forward, backward,
global-norm clip, AdamW) of Kiln's real Trainer against the same shape in PyTorch, on the same cores.

For each config (default: configs/qwen3_bench.yaml, configs/qwen3_tiny.yaml, configs/deepseek_v3_bench.yaml, all
on Megatron's mock data at seq 512) one warm process per variant:
- kiln: ``Trainer.train_step`` as `training.run` would run it (its ``training.fast_step`` choice included);
- torch eager / torch compile: transformers' model of the same config (``training.hf.kiln_to_hf_config``, the
  `interop` extra) with torch.optim.AdamW and clip_grad_norm_, the same batch size and sequence length;
- matmul peak: MindSpore's compiled (``mindspore.jit``) fp32 matmul on every linear GEMM of the step (forward
  x·Wᵀ, input gradient dY·W, weight gradient dYᵀ·x, at batch × seq tokens), with synchronous dispatch.
After its first step and ``WARMUP_STEPS`` more, the variants take turns, the order rotating each round (the
machine is shared, its speed drifts), and each ratio is the median over rounds of that round's pair (tokens/s ÷
the torch eager tokens/s of the same round). Model FLOP/s use the Kiln model's ``flops_per_token`` for every
variant. With ``--profile`` the Kiln worker also profiles one step with MindSpore's profiler and prints its
op-type table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_EAGER, smoke_model
from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_least, at_most, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("configs/qwen3_bench.yaml", "configs/qwen3_tiny.yaml", "configs/deepseek_v3_bench.yaml")
# steps every variant runs after its first (compiling) one and before the rounds, so that the rounds measure the
# steady state: MindSpore runs a compiled step's first few executions slower (qwen3_bench, 16 single steps in
# one process: 1.36-1.39 s for steps 2-5, 1.21-1.23 s from step 6, in 3 of 4 runs; the same with the learning
# rate near 0, so not the weights), while torch eager and torch.compile were steady from step 2
WARMUP_STEPS = 5
# variant -> (worker kind, its config overrides, its environment)
VARIANTS = {
    "kiln": ("kiln", [], {}),
    # the step as it ran before fast_step: eager forward+backward, threaded dispatch
    "kiln, fast_step off": ("kiln", ["fast_step.compile=false", "fast_step.host_blocking_dispatch=false"],
                            {"MS_DEV_HOST_BLOCKING_RUN": "0"}),
    # the step uncompiled, dispatch as fast_step sets it: what compiling alone gains
    "kiln, compile off": ("kiln", ["fast_step.compile=false"], {}),
    "torch eager": ("torch eager", [], {}),
    "torch compile": ("torch compile", [], {}),
    # DeepSeek-V3 as configured, its MTP depth included (transformers' model has no MTP: not like for like)
    "kiln, with MTP": ("kiln", [], {}),
    # the peak is the compiled matmul without PyNative's dispatch spin (reference §5)
    "matmul peak": ("matmul peak", [], {"MS_DEV_HOST_BLOCKING_RUN": "1"}),
}
# the torch compile worker's torch.compile backend (default inductor); a smoke run sets aot_eager (below)
TORCH_COMPILE_BACKEND = "KILN_BENCH_TORCH_COMPILE_BACKEND"
# torch.compile of the DeepSeek-V3 MoE takes minutes to compile on 2 cores (once per worker, before the rounds)
MODEL_VARIANTS = {"qwen3": ("kiln", "kiln, fast_step off", "torch eager", "torch compile", "matmul peak"),
                  "deepseek_v3": ("kiln", "kiln, with MTP", "kiln, compile off", "torch eager", "torch compile",
                                  "matmul peak")}
# transformers' DeepSeek-V3 has no multi-token prediction: every variant but "kiln, with MTP" runs without it, so
# that the ratios compare the same model (and the FLOP counts, taken from the "kiln" worker, hold for torch's)
MODEL_OVERRIDES = {"deepseek_v3": ["model.num_nextn_predict_layers=0"]}
SEQ_LENGTH = 512
MOCK_EOD = 4095  # the mock documents hold ids up to 4094 (training/data/gpt_dataset.py MockIndexedDataset)


def load(config_path: str, overrides: list[str] = ()):
    """The config on mock data at SEQ_LENGTH, never saving; the tiny configs' data paths are dropped."""
    from training.config import load_config

    data = "train_dataset.dataloader.config"
    return load_config(PROJECT_ROOT / config_path, [
        f"{data}.data_path=null", f"{data}.mock=true", f"{data}.seq_length={SEQ_LENGTH}",
        f"model.seq_length={SEQ_LENGTH}", f"{data}.eod={MOCK_EOD}", f"{data}.pad={MOCK_EOD}",
        "checkpoint.enable_save=false", *overrides])


# ---- the workers: each runs in its own process and answers "steps N" with the seconds N steps took ----

class KilnWorker:
    def __init__(self, config_path: str, overrides: list[str]):
        import tempfile

        from training.run import use_host_blocking_dispatch

        config = load(config_path, overrides)
        use_host_blocking_dispatch(config.fast_step.host_blocking_dispatch)  # as `training.run` does, before MindSpore loads
        from training.parallel.mesh import World
        from training.reporting import Reporter
        from training.step import configure_runtime
        from training.trainer import Trainer

        configure_runtime(config)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kiln-throughput-"))
        self.trainer = Trainer(config, World(rank=0, size=1), self.run_dir, Reporter(None, enabled=False))
        self.tokens_per_step = config.training.global_batch_size * self.trainer.seq_length
        self.flops_per_token = self.trainer.flops_per_token
        self.info = {"params": self.trainer.num_parameters, "flops_per_token": self.flops_per_token,
                     "tokens_per_step": self.tokens_per_step, "fast_step": self.trainer.step_mode}
        self.losses = []

    def steps(self, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            self.losses.append(self.trainer.train_step()["loss"])
        return time.perf_counter() - started

    def profile(self) -> list[tuple[str, float, int]]:
        """(op type, ms, calls) of one step under MindSpore's CPU profiler, slowest first."""
        import csv

        from mindspore.profiler import ProfilerActivity, profile

        out = self.run_dir / "profile"
        with profile(activities=[ProfilerActivity.CPU], on_trace_ready=_trace_handler(out)):
            self.steps(1)
        rows = {}
        for table in out.rglob("cpu_op_type_info*.csv"):  # op_type, type_occurrences, total_compute_time (ms)
            with open(table) as f:
                for row in csv.DictReader(f):
                    ms, calls = rows.get(row["op_type"], (0.0, 0))
                    rows[row["op_type"]] = (ms + float(row["total_compute_time"]), calls + int(row["type_occurrences"]))
        return sorted(((name, ms, calls) for name, (ms, calls) in rows.items()), key=lambda r: -r[1])


def _trace_handler(out: Path):
    from mindspore.profiler import tensorboard_trace_handler

    return tensorboard_trace_handler(str(out))


class TorchWorker:
    def __init__(self, config_path: str, overrides: list[str], compiled: bool):
        import torch
        import transformers

        from training.hf import kiln_to_hf_config

        config = load(config_path, overrides)
        torch.manual_seed(0)
        torch.set_num_threads(os.cpu_count() or 1)
        hf = kiln_to_hf_config(config.model)
        hf_config = transformers.AutoConfig.for_model(**hf)
        hf_config._attn_implementation = "sdpa"
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config)
        self.model.train()
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        no_decay = [p for p in self.model.parameters() if p.ndim <= 1]
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=config.lr_scheduler.learning_rate, betas=tuple(opt.betas), eps=opt.eps)
        self.max_norm = config.training.max_norm
        batch = config.training.global_batch_size
        generator = torch.Generator().manual_seed(0)
        shape = (batch, config.model["seq_length"])
        self.ids = torch.randint(0, config.model["vocab_size"], shape, generator=generator)
        backend = os.environ.get(TORCH_COMPILE_BACKEND, "inductor")
        self.forward = torch.compile(self.model, backend=backend) if compiled else self.model
        self.losses = []

    def steps(self, n: int) -> float:
        import torch

        started = time.perf_counter()
        for _ in range(n):
            loss = self.forward(input_ids=self.ids, labels=self.ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.append(loss.item())
        return time.perf_counter() - started


class MatmulWorker:
    """MindSpore's compiled fp32 matmul on the step's linear GEMMs; ``steps(n)`` runs all of them n times."""

    def __init__(self, config_path: str, overrides: list[str]):
        import mindspore as ms
        import numpy as np
        from mindspore import Tensor, ops

        from training.model import build_model

        config = load(config_path, overrides)
        ms.set_context(mode=ms.PYNATIVE_MODE)
        ms.set_device("CPU")
        model = build_model(config.model)
        tokens = config.training.global_batch_size * config.model["seq_length"]
        rng = np.random.default_rng(0)
        shapes = sorted({tuple(p.shape) for name, p in model.parameters_and_names()
                         if len(p.shape) == 2 and "word_embeddings" not in name and "router" not in name})
        self.gemms, self.flops = [], 0
        for out_features, in_features in shapes:
            x = Tensor(rng.standard_normal((tokens, in_features), dtype=np.float32))
            w = Tensor(rng.standard_normal((out_features, in_features), dtype=np.float32))
            dy = Tensor(rng.standard_normal((tokens, out_features), dtype=np.float32))
            # forward x·Wᵀ, input gradient dY·W, weight gradient dYᵀ·x
            self.gemms += [(ops.MatMul(transpose_b=True), x, w), (ops.MatMul(), dy, w),
                           (ops.MatMul(transpose_a=True), dy, x)]
            self.flops += 3 * 2 * tokens * in_features * out_features
        self.info = {"gemm_shapes": [list(s) for s in shapes], "flops_per_pass": self.flops}
        self.runs = [ms.jit(self._runner(matmul)) for matmul, _, _ in self.gemms]
        self.steps(1)  # compiles

    @staticmethod
    def _runner(matmul):
        def run(a, b):
            return matmul(a, b)
        return run

    def steps(self, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            for run, (_, a, b) in zip(self.runs, self.gemms):
                run(a, b).asnumpy()
        return time.perf_counter() - started


def worker_main(kind: str, config_path: str, overrides: list[str], warmup: int) -> int:
    if kind == "kiln":
        worker = KilnWorker(config_path, overrides)
    elif kind.startswith("torch"):
        worker = TorchWorker(config_path, overrides, compiled=kind == "torch compile")
    else:
        worker = MatmulWorker(config_path, overrides)
    started, cpu_started = time.perf_counter(), time.process_time()
    worker.steps(1)  # kernel compilation, graph compilation, torch.compile
    # the CPU seconds too: on the shared machine the wall time says more about the load than about the compile
    info = {**getattr(worker, "info", {}), "first_step_s": time.perf_counter() - started,
            "first_step_cpu_s": time.process_time() - cpu_started}
    worker.steps(warmup)
    print(json.dumps({"ready": info}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "steps":
            cpu_started = time.process_time()
            seconds = worker.steps(int(args[0]))
            print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu_started,
                              "losses": getattr(worker, "losses", [])[-1:]}), flush=True)
        elif command == "profile":
            print(json.dumps({"profile": worker.profile()}), flush=True)
        elif command == "rss":
            import resource

            print(json.dumps({"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}), flush=True)
        else:
            break
    if kind == "kiln":
        shutil.rmtree(worker.run_dir, ignore_errors=True)
    return 0


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, kind: str, config_path: str, overrides: list[str], env: dict | None = None,
                 warmup: int = WARMUP_STEPS):
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.throughput", "--worker", kind, "--configs", config_path,
             f"--warmup={warmup}", *(f"--set={o}" for o in overrides)], cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True, env={**os.environ, "GLOG_v": "3", **(env or {})})
        self.info = self._answer()["ready"]

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the {self.kind} worker exited with code {self.process.wait()}")

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# issue 38's targets: >= 1.0x torch.compile on both bench configs (DeepSeek-V3 without MTP), compiled peak RSS at
# most torch eager's; the earlier ones: qwen3_bench >= 1.0x torch eager, the tiny config >= 0.5x eager, Kiln's step
# >= 0.75 of the round's compiled matmul peak on qwen3_bench
# (a "vs" figure is itself the paired ratio, so its target is on its value)
TARGETS = {("qwen3_bench", "vs torch eager"): at_least(1.0, of="value"),
           ("qwen3_bench", "vs torch compile"): at_least(1.0, of="value"),
           ("deepseek_v3_bench", "vs torch compile"): at_least(1.0, of="value"),
           ("qwen3_tiny", "vs torch eager"): at_least(0.5, of="value"),
           ("qwen3_bench", "of the matmul peak"): at_least(0.75)}
# a smoke run: each tiny config at 32 tokens and 2 samples, one layer of each kind (DeepSeek-V3's first is dense, the
# second MoE), one round of one step, and each worker kind once: Qwen3 runs Kiln's compiled step beside torch eager,
# torch.compile and the matmul peak; DeepSeek-V3 runs Kiln's step eagerly (benchmarks.SMOKE_EAGER: its compile is
# tests/test_deepseek_v3.py's) beside transformers' model. The variants left out ("fast_step off", "compile off",
# "with MTP") are a Kiln worker with other overrides, and DeepSeek-V3's torch.compile takes minutes. Qwen3's
# torch.compile runs the aot_eager backend: Dynamo's capture and AOT autograd without Inductor's C++ code generation,
# which alone took 24 of a 28 s first step here (36 CPU-s against 4)
SMOKE_BATCH = ["training.local_batch_size=2", "training.global_batch_size=2"]
SMOKE_CONFIGS = {
    "configs/qwen3_tiny.yaml": ([*smoke_model(1), *SMOKE_BATCH],
                                ("kiln", "torch eager", "torch compile", "matmul peak")),
    "configs/deepseek_v3_tiny.yaml": ([*smoke_model(2), *SMOKE_BATCH, SMOKE_EAGER],
                                      ("kiln", "torch eager", "matmul peak"))}


def compare(bench: Bench, config_path: str, rounds: int, steps_per_round: int, overrides: list[str] = (),
            profile: bool = False, warmup: int = WARMUP_STEPS, kinds: tuple[str, ...] = (),
            torch_compile_backend: str = "inductor") -> None:
    """Runs every variant of ``config_path`` (``kinds``; default: its model type's) round by round and reports each
    paired ratio."""
    model_type = load(config_path, overrides).model["model_type"]
    name = Path(config_path).stem
    kinds = kinds or MODEL_VARIANTS[model_type]
    print(f"-- throughput {name}: {', '.join(kinds)}; {rounds} rounds of {steps_per_round} steps", flush=True)
    infos, seconds, rss, table, first_steps, watch = _run_variants(
        kinds, config_path, [*overrides], model_type, warmup, rounds, steps_per_round, profile, torch_compile_backend)
    kiln = infos["kiln"]
    # torch.compile on another backend than Inductor is named so, and no target is judged against it
    label = {kind: kind for kind in kinds}
    judged = torch_compile_backend == "inductor"
    if not judged:
        label["torch compile"] = f"torch compile ({torch_compile_backend})"
    for kind in ("torch compile", "torch eager"):
        if kind in kinds:
            first = infos[kind]["first_step_s"]
            bench.report(f"{name} kiln first step", kiln["first_step_s"], "s", kiln["first_step_s"] / first,
                         f"{label[kind]}'s first step", target=at_most(1.0) if kind == "torch compile" and judged
                         else (), watch=first_steps)
    tokens = kiln["tokens_per_step"] * steps_per_round
    flops = kiln["flops_per_token"] * tokens
    peak_flops = infos["matmul peak"]["flops_per_pass"] * steps_per_round
    peak = statistics.median(peak_flops / s for s in seconds["matmul peak"])
    bench.report(f"{name} matmul peak (jit, step GEMMs)", peak / 1e9, "GFLOP/s", watch=watch)
    for kind in kinds:
        if kind == "matmul peak":
            continue
        rates = [tokens / s for s in seconds[kind]]
        params = infos[kind].get("params", kiln["params"])  # torch's model is the "kiln" worker's
        bench.report(f"{name} {label[kind]} ({params / 1e6:.1f}M)", statistics.median(rates), "tokens/s",
                     watch=watch)
        bench.report(f"{name} {label[kind]} model FLOP/s", statistics.median(flops / s for s in seconds[kind]) / 1e9,
                     "GFLOP/s", statistics.median(flops / s / peak_round for s, peak_round in
                                                  zip(seconds[kind], (peak_flops / p for p in seconds["matmul peak"]))),
                     "the round's compiled matmul peak, median",
                     target=TARGETS.get((name, "of the matmul peak"), ()) if kind == "kiln" else (), watch=watch)
        if kind != "torch eager":
            ratio = statistics.median(e / k for e, k in zip(seconds["torch eager"], seconds[kind]))
            bench.report(f"{name} {label[kind]} vs torch eager", ratio, "×",
                         target=TARGETS.get((name, "vs torch eager"), ()) if kind == "kiln" else (), watch=watch)
    if "torch compile" in kinds:
        ratio = statistics.median(c / k for c, k in zip(seconds["torch compile"], seconds["kiln"]))
        bench.report(f"{name} kiln vs {label['torch compile']}", ratio, "×",
                     target=TARGETS.get((name, "vs torch compile"), ()) if judged else (), watch=watch)
    bench.report(f"{name} kiln peak RSS", rss["kiln"], "GB", rss["kiln"] / rss["torch eager"], "torch eager's",
                 target=at_most(1.0) if name.endswith("_bench") else ())
    print("   peak RSS GB: " + ", ".join(f"{kind} {gb:.2f}" for kind, gb in rss.items()), flush=True)
    if table:
        total = sum(ms for _, ms, _ in table)
        print(f"   kiln one step, MindSpore profiler op types (ms, calls; total {total:.0f} ms):", flush=True)
        for op, ms, calls in table[:15]:
            print(f"     {op:<40} {ms:>9.1f} {calls:>6}", flush=True)


def _run_variants(kinds, config_path: str, overrides: list[str], model_type: str, warmup: int, rounds: int,
                  steps_per_round: int, profile: bool, torch_compile_backend: str) -> tuple:
    """Each variant's worker started one at a time (compilation runs alone), then ``rounds`` rounds of
    ``steps_per_round`` steps, the variants' order rotating each round: each worker's info, the seconds of each
    round per variant, peak RSS, kiln's profiler table (with ``profile``), and the LoadWatch of the first steps
    and of the rounds."""
    workers = {}
    # torch.compile's first step with Inductor's on-disk caches empty, as on a user's first run: an earlier run's
    # kernels in /tmp/torchinductor_<user> made it several times shorter (docs/training.md, The fast step)
    inductor_cache = tempfile.TemporaryDirectory(prefix="kiln-bench-inductor-")
    try:
        with LoadWatch() as first_steps:
            for kind in kinds:
                worker_kind, extra, env = VARIANTS[kind]
                like_torch = [] if kind == "kiln, with MTP" else MODEL_OVERRIDES.get(model_type, [])
                if worker_kind == "torch compile":
                    env = {**env, TORCH_COMPILE_BACKEND: torch_compile_backend,
                           "TORCHINDUCTOR_CACHE_DIR": inductor_cache.name}
                workers[kind] = Worker(worker_kind, config_path, [*like_torch, *overrides, *extra], env, warmup)
                first_steps.cpu(kind, workers[kind].info["first_step_cpu_s"])
        print(f"   kiln fast step: {workers['kiln'].info['fast_step']}", flush=True)
        seconds = {kind: [] for kind in kinds}
        with LoadWatch() as watch:
            for round_ in range(rounds):
                order = list(kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)])
                for kind in order:
                    answer = workers[kind].ask(f"steps {steps_per_round}")
                    seconds[kind].append(answer["seconds"])
                    watch.cpu(kind, answer["cpu_seconds"], steps_per_round)
        rss = {kind: worker.ask("rss")["rss_gb"] for kind, worker in workers.items()}
        table = workers["kiln"].ask("profile")["profile"] if profile else None
    finally:
        for worker in workers.values():
            worker.close()
        inductor_cache.cleanup()
    return {kind: worker.info for kind, worker in workers.items()}, seconds, rss, table, first_steps, watch


def run(bench: Bench) -> None:
    if bench.smoke:
        for config_path, (overrides, kinds) in SMOKE_CONFIGS.items():
            compare(bench, config_path, rounds=1, steps_per_round=1, overrides=overrides, profile=True, warmup=0,
                    kinds=kinds, torch_compile_backend="aot_eager")
    else:
        for config_path in CONFIGS:
            compare(bench, config_path, rounds=5, steps_per_round=2, profile=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of every config (e.g. --set training.fast_step=false)")
    parser.add_argument("--profile", action="store_true", help="print the Kiln step's per-op profile")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps after the first, before the rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.configs[0], args.overrides, args.warmup)
    with standalone("throughput") as bench:
        for config_path in args.configs:
            compare(bench, config_path, args.rounds, args.steps_per_round, args.overrides, args.profile, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
