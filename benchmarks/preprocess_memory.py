"""python -m benchmarks.preprocess_memory [--corpus-gib G] [--reference-mib M] — peak memory of `kiln preprocess`
on a corpus larger than a quarter of this machine's RAM, against the same command on a small corpus.

The corpus is the built-in `stdlib_code` source written again and again into one JSONL file until it holds
G GiB (default: RAM / 4, plus 5%). Each run is the whole command in a process of its own, with 2 workers;
its process tree (the command and its forked workers) is sampled every 0.2 s and the largest sum of anonymous
RSS is its peak (an upper bound: forked workers share pages that the sum counts twice); file-backed RSS
(mapped files, which the kernel may drop) is printed beside it. The claim checked is
preprocess.py's: memory does not depend on the corpus size, so the ratio of the two peaks stays near 1.

Measured here (23.5 GiB RAM, 2 shared cores, Kiln's 4096-piece tokenizer): 6.19 GiB of JSONL, 2.08G tokens in
1753 s, peak anonymous RSS 374 MiB (0.016 x RAM; file-backed 38 MiB) vs 372 MiB on 0.59 GiB: 1.01 x.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import Bench, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def ram_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def write_corpus(path: Path, source: list[Path], size: int) -> int:
    """``source`` files' lines, again and again, into ``path`` until it holds ``size`` bytes."""
    written = 0
    with open(path, "wb") as out:
        while written < size:
            for part in source:
                with open(part, "rb") as stream:
                    shutil.copyfileobj(stream, out, 1 << 24)
                written += part.stat().st_size
                if written >= size:
                    break
    return written


def tree_memory(root: int) -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of ``root`` and its descendants: RssAnon is the memory the
    processes hold; RssFile counts pages of files they map, which the kernel can drop at any time."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except OSError:
            continue
    anon = file = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except OSError:
            continue
        anon += int(status.get("RssAnon", "0 kB").split()[0]) * 1024
        file += int(status.get("RssFile", "0 kB").split()[0]) * 1024
    return anon, file


def run_preprocess(corpus: Path, model: Path, out: Path) -> tuple[float, int, int, str]:
    """(seconds, peak anonymous and peak file-backed tree RSS in bytes, the command's summary line) of one
    `kiln preprocess`."""
    command = [sys.executable, "-m", "training.cli", "preprocess", "--input", str(corpus), "--tokenizer-model",
               str(model), "--output-prefix", str(out), "--workers", "2", "--append-eod"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    peak_anon = peak_file = 0
    while proc.poll() is None:
        anon, file = tree_memory(proc.pid)
        peak_anon, peak_file = max(peak_anon, anon), max(peak_file, file)
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    output = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"kiln preprocess exited with {proc.returncode}: {output}")
    return seconds, peak_anon, peak_file, output.splitlines()[0]


def measure(bench: Bench, corpus_gib: float, reference_mib: float, work: Path, source_bytes: int,
            sample_lines: int, vocab_size: int = 4096) -> None:
    from assets.builtin_corpus import write_builtin_source
    from resources.tokenizer import TokenizerSettings
    from training.data.corpus import iter_texts

    source = write_builtin_source("python_stdlib_code", work / "source", source_bytes)
    settings = TokenizerSettings(vocab_size=vocab_size, sample_lines=sample_lines)
    settings.train((text for path in source for text in iter_texts(path)), work / "tokenizer")
    ram = ram_bytes()
    print(f"RAM {ram / 2**30:.1f} GiB; corpus {corpus_gib:.2f} GiB vs reference {reference_mib:.0f} MiB; "
          f"2 workers; {work}", flush=True)
    figures = {}
    for name, size in (("reference", int(reference_mib * 2**20)), ("large", int(corpus_gib * 2**30))):
        corpus = work / f"{name}.jsonl"
        written = write_corpus(corpus, source, size)
        seconds, peak, peak_file, summary = run_preprocess(corpus, work / "tokenizer.model", work / name)
        figures[name] = peak
        print(f"{name:<9} {written / 2**30:6.2f} GiB in {seconds:5.0f} s: peak anonymous RSS {peak / 2**20:5.0f} MiB "
              f"({peak / written:.4f} × corpus, {peak / ram:.4f} × RAM), file-backed {peak_file / 2**20:.0f} MiB; "
              f"{summary}", flush=True)
        bench.report(f"kiln preprocess peak anonymous RSS, {written / 2**30:.2f} GiB", peak / 2**20, "MiB")
        corpus.unlink()
        for shard in work.glob(f"{name}_*"):
            shard.unlink()
    bench.report("peak anonymous RSS, large corpus", figures["large"] / 2**20, "MiB",
                 figures["large"] / figures["reference"], "the reference corpus's (bounded: near 1)")


def run(bench: Bench) -> None:
    if bench.smoke:
        # 1 MiB against 256 KiB, a tokenizer of 512 pieces on a few lines
        measure(bench, 1 / 1024, 0.25, bench.work / "preprocess_memory", 256 << 10, 2_000, vocab_size=512)
    else:
        with tempfile.TemporaryDirectory(prefix="kiln-preprocess-memory-") as tmp:
            measure(bench, ram_bytes() / 4 * 1.05 / 2**30, 600, Path(tmp), 64 << 20, 50_000)


def main(argv=None) -> int:
    ram = ram_bytes()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preprocess_memory", description=__doc__)
    parser.add_argument("--corpus-gib", type=float, default=ram / 4 * 1.05 / 2**30)
    # past workers x TASKS_PER_WORKER x MAX_CHUNK_BYTES (512 MiB with 2 workers) tasks stop growing with the corpus
    parser.add_argument("--reference-mib", type=float, default=600)
    parser.add_argument("--work", help="directory for the corpus and shards (default: a temporary one)")
    args = parser.parse_args(argv)
    with standalone("preprocess_memory") as bench:
        measure(bench, args.corpus_gib, args.reference_mib, Path(args.work) if args.work else bench.work,
                64 << 20, 50_000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
