"""The whole `kiln preprocess` command (interpreter start-up included) against the fastest bare sentencepiece
encoding of the same texts on the same cores (sentencepiece's threads or one process per core, Python lists or
numpy buffers; 1.0 would mean start-up, reading, parsing and writing cost nothing), paired per round: on English
prose (the standard library's docstrings) with a BPE 8k model (target >= 0.9) and on source code with Kiln's
default tokenizer, which encodes ~6x faster per token, so reading and parsing JSONL and start-up weigh far more
(reported for the record).

The shared cores' speed drifts by ±15% over tens of seconds, so every variant runs once per round, in alternating
order, and a round's ratio compares Kiln with the best bare variant of that same round; the figure is the median
over rounds (best-of tokens/s are printed beside it).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_least

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# 100 MB of prose: a real source is gigabytes, and at this size interpreter start-up (~0.25 s) weighs ~3%
SIZES = {"prose": 100_000_000, "code": 20_000_000}
SMOKE_BYTES = 400_000


def _corpus(work: Path, kind: str, corpus_bytes: int) -> list[Path]:
    """The built-in source `kind` (see assets/builtin_corpus.py), its parts written again under new
    names until the files hold `corpus_bytes` (the standard library's docstrings are about 2.5 MB)."""
    from assets.builtin_corpus import write_builtin_source

    files = write_builtin_source(kind, work / "raw" / kind, corpus_bytes)
    originals, size = list(files), sum(p.stat().st_size for p in files)
    while size < corpus_bytes:
        source = originals[len(files) % len(originals)]
        copy = source.with_name(f"again-{len(files):05d}.jsonl")
        shutil.copyfile(source, copy)
        files.append(copy)
        size += copy.stat().st_size
    return files


class _BareProcesses:
    """`workers` warm processes, each holding its share of the texts and the model (loaded untimed). A call
    encodes every share at once and returns the tokens; its wall time (the caller's) is the slowest share's plus a
    round trip to each pool."""

    def __init__(self, files: list[Path], model: str, workers: int) -> None:
        import multiprocessing

        from benchmarks import bare_encode

        self._encode_share = bare_encode.encode_share
        context = multiprocessing.get_context("spawn")
        self._pools = [context.Pool(1, initializer=bare_encode.load_share, initargs=(files, model, i, workers))
                       for i in range(workers)]

    def __call__(self, out_type) -> int:
        results = [pool.apply_async(self._encode_share, (out_type,)) for pool in self._pools]
        return sum(r.get() for r in results)

    def close(self) -> None:
        for pool in self._pools:
            pool.terminate()


def _run_command(command: list[str], prefix: Path) -> int:
    """Run the command to its end; the tokens it wrote."""
    from training.data.indexed import IndexedDataset

    subprocess.run(command, check=True, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL)
    return IndexedDataset(prefix).num_tokens


def bench_tokenizing(bench: Bench, work: Path, kind: str, corpus_bytes: int, settings, rounds: int,
                     target=()) -> None:
    import sentencepiece

    from training.data.corpus import iter_texts
    from training.data.preprocess import tokenize_to_indexed

    files = _corpus(work, kind, corpus_bytes)
    texts = [text for path in files for text in iter_texts(path)]
    size = sum(p.stat().st_size for p in files)
    label = f"{kind} {size / 1e6:.0f} MB, {settings.model_type} {settings.vocab_size}"
    print(f"-- tokenizing {label}", flush=True)
    with LoadWatch(cores=1) as watch:  # the tokenizer trains on one thread
        seconds = watch.time("tokenizer training", lambda: settings.train(texts, work / "tokenizer"))
    bench.report(f"{kind}: tokenizer training ({settings.sample_lines // 1000}k lines)", seconds, "s", watch=watch)

    model = str(work / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    workers = os.cpu_count() or 1
    command = [sys.executable, "-m", "training.cli", "preprocess", *(f"--input={p}" for p in files),
               f"--tokenizer-model={model}", f"--output-prefix={work / 'shard'}", f"--workers={workers}",
               "--append-eod"]
    bare_processes = _BareProcesses(files, model, workers)
    variants = {}
    for out_type in (int, "numpy"):
        name = "int lists" if out_type is int else "numpy buffers"
        variants[f"bare, {workers} threads, {name}"] = lambda out_type=out_type: sum(
            len(ids) + 1 for ids in processor.encode(texts, out_type=out_type, num_threads=workers))
        variants[f"bare, {workers} processes, {name}"] = lambda out_type=out_type: bare_processes(out_type)
    kiln = {
        "kiln preprocess (whole command)": lambda: _run_command(command, work / "shard_text_document"),
        # the same function in this process (which holds the texts): without interpreter start-up
        "  tokenize_to_indexed in process": lambda: tokenize_to_indexed(files, model, work / "in_process",
                                                                         workers=workers)["tokens"],
    }
    measured = {name: [] for name in [*variants, *kiln]}
    try:
        with LoadWatch() as watch:
            for round_ in range(rounds):
                order = [*variants.items(), *kiln.items()]
                for name, encode in order if round_ % 2 == 0 else reversed(order):
                    seconds, tokens = watch.call(name.strip(), encode)
                    measured[name].append(tokens / seconds)
    finally:
        bare_processes.close()
    for name in variants:
        bench.report(f"{kind}: " + name.replace("bare, ", "bare sentencepiece, "), max(measured[name]), "tokens/s",
                     watch=watch)
    reference = max(variants, key=lambda name: max(measured[name]))
    best_per_round = [max(measured[name][r] for name in variants) for r in range(rounds)]
    for name in kiln:
        ratio = statistics.median(k / b for k, b in zip(measured[name], best_per_round))
        bench.report(f"{kind}: {name.strip()}", max(measured[name]), "tokens/s", ratio,
                     f"the round's best bare, median of {rounds}", target=target if name.startswith("kiln") else (),
                     watch=watch)
    print(f"   (best bare variant overall: {reference.replace('bare, ', '')})", flush=True)


def run(bench: Bench) -> None:
    from resources.tokenizer import TokenizerSettings

    lines = 5_000 if bench.smoke else 50_000
    rounds = 1 if bench.smoke else 5
    # the reference setting: English prose with a BPE model of 8k pieces, where sentencepiece encodes
    # about 2.1-2.8M tokens/s on 2 cores
    bench_tokenizing(bench, bench.work / "prose", "python_stdlib_docstrings",
                     SMOKE_BYTES if bench.smoke else SIZES["prose"],
                     TokenizerSettings(model_type="bpe", vocab_size=8192, sample_lines=lines), rounds, at_least(0.9))
    # a smoke corpus holds too few distinct pieces for the default 4096
    code = TokenizerSettings(sample_lines=lines, **({"vocab_size": 1024} if bench.smoke else {}))
    bench_tokenizing(bench, bench.work / "code", "python_stdlib_code", SMOKE_BYTES if bench.smoke else SIZES["code"],
                     code, rounds)
