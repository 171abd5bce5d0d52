"""python -m benchmarks.cleaning — Kiln's cleaning against DataTrove's, on this machine.

- filters: documents/s per core of the FineWeb filter chain (Gopher repetition and quality, C4 without its
  terminal-punctuation rule, FineWeb quality) in Kiln (ChunkFilter, one process) and in DataTrove's
  LocalPipelineExecutor (one task, one worker), on the same documents (the built-in stdlib docstrings, and
  generated prose: sentences of random dictionary-like words), rounds alternating (target >= 1.0x);
- near-dup quality on a generated corpus of planted pairs at measured 5-gram Jaccard similarity (a document and a
  copy whose tail is replaced, so the shared shingles are the prefix's): the share flagged per Jaccard band
  (targets: >= 0.90 at J >= 0.8, <= 0.06 at J <= 0.5), exact-duplicate recall (copies differing in case and
  spacing: target 1.0), and the share of planted pairs both Kiln and DataTrove's MinHash stages at the same
  settings judge alike (target >= 0.99): DataTrove 0.10.1's, and 0.3.0's buckets and clusters stages on the same
  signatures (with their time against Kiln's sorted bands);
- language ID: CLD2's accuracy on paragraphs of the gettext translation catalogs installed on the machine
  (/usr/share/locale/<language>/LC_MESSAGES/*.mo, human translations labelled by their directory);
- Ray: the FineWeb recipe over 4 chunks on a 2-node Ray cluster started on this machine (benchmarks/ray_cluster.py;
  the head alone in a smoke run)
  vs. in one process: time per document, and the outputs compared byte for byte;
- memory: peak RSS of the whole cleaning (FineWeb recipe) on a generated corpus and on 8 times it, each in a
  process of its own (streamed: the ratio should stay near 1).

Kiln installs DataTrove 0.3.0 (its last release on numpy<2) and computes MinHash signatures with its code; its
buckets and clusters stages run here in this process against Kiln's. The current DataTrove (0.10.1) needs numpy
2, which MindSpore cannot load: it is the reference for the filters and for the pairs MinHash flags (its English
words by spaCy), from its own venv, `.kiln/datatrove-venv` (`make test` and `make bench` make it first; a
standalone run makes it when missing: ~1 min, pip from the registry), through benchmarks/cleaning_reference.py.
Timings are taken under benchmarks/contention.py's LoadWatch: under competition from other processes they are
reported as not valid.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_least, at_most, standalone
from training.data.cleaning.minhash import MinHashSettings
from training.data.cleaning.pipeline import ChunkFilter, ChunkStage, Numbering, RawInput, cluster_stages
from training.data.cleaning.recipe import load_recipe
from training.data.cleaning.text import simplify_text

PROJECT_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_VENV = PROJECT_ROOT / ".kiln" / "datatrove-venv"
# the processing extra has the filters' imports; orjson its JSONL reader, spaCy its English word splitter (not in
# the extra); xxhash 4 refuses the str DataTrove's MinHash hashes
REFERENCE_PACKAGES = ["datatrove[processing]==0.10.1", "orjson", "spacy", "xxhash<4"]
FILTER_RECIPE = {"steps": ["gopher_repetition", "gopher_quality", {"c4": {"filter_no_terminal_punct": False}},
                           "fineweb_quality"], "dedup": False}


def reference_python() -> Path:
    python = REFERENCE_VENV / "bin" / "python"
    if not (REFERENCE_VENV / ".installed").is_file():
        print(f"making DataTrove's venv {REFERENCE_VENV} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(REFERENCE_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *REFERENCE_PACKAGES], check=True)
        (REFERENCE_VENV / ".installed").touch()
    return python


def reference(mode: str, source: Path, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    done = subprocess.run([str(reference_python()), str(Path(__file__).with_name("cleaning_reference.py")), mode,
                           str(source), str(work)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"DataTrove's {mode} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def write_jsonl(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": str(i)}) + "\n" for i, t in enumerate(texts)))
    return path


def generated_prose(count: int, rng: random.Random) -> list[str]:
    """Paragraphs of sentences of dictionary-like words with common English stop words among them."""
    vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    stop = ["the", "of", "and", "to", "that", "with", "have", "be"]
    def sentence() -> str:
        words = [rng.choice(stop) if rng.random() < 0.3 else rng.choice(vocab) for _ in range(rng.randint(8, 20))]
        return " ".join(words).capitalize() + "."
    return ["\n".join(" ".join(sentence() for _ in range(rng.randint(3, 6))) for _ in range(rng.randint(3, 8)))
            for _ in range(count)]


def kiln_filters(source: Path, work: Path) -> float:
    recipe = load_recipe(FILTER_RECIPE)
    started = time.perf_counter()
    ChunkFilter(recipe).run([RawInput(source, source.name)], work / "stage")
    return time.perf_counter() - started


def dagster_filters(source: Path, work: Path) -> float:
    """The same filters as a clean_corpus materialization of a one-file source: Dagster's per-step cost included
    (the raw copy before it is not timed)."""
    import dagster as dg
    import yaml

    from assets.chunks import register_source_chunks
    from pipelines.definitions import ALL_ASSETS, resources
    from resources.storage import KilnStorage

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sources = work / "sources.yaml"
    sources.write_text(yaml.safe_dump({"sources": {"bench": {"files": [str(source)], "cleaning": FILTER_RECIPE}}}))
    storage = KilnStorage(data_root=str(work / "data"), runs_root=str(work / "runs"), sources_config=str(sources))
    with dg.instance_for_test() as instance:
        register_source_chunks(instance, storage)
        dg.materialize(ALL_ASSETS, selection=["raw_corpus"], partition_key="bench", instance=instance,
                       resources=resources(storage=storage))
        started = time.perf_counter()
        dg.materialize(ALL_ASSETS, selection=["clean_corpus"], partition_key="bench", instance=instance,
                       resources=resources(storage=storage))
        return time.perf_counter() - started


def filter_speed(bench: Bench, name: str, texts: list[str], work: Path, rounds: int) -> None:
    source = write_jsonl(work / f"{name}_in", texts)
    ours, dagster, theirs = [], [], []
    with LoadWatch(cores=1) as watch:  # one process, one core each
        for _ in range(rounds):  # alternating, so drifting load hits each alike
            ours.append(watch.call("kiln", lambda: kiln_filters(source, work / "kiln"))[1])
            dagster.append(watch.call("clean_corpus step", lambda: dagster_filters(source, work / "dagster"))[1])
            theirs.append(watch.call("DataTrove", lambda: reference("filters", source.parent,
                                                                     work / "datatrove"))[1]["seconds"])
    best_ours, best_dagster, best_theirs = min(ours), min(dagster), min(theirs)
    bench.report(f"filters on {name}, Kiln (1 core)", len(texts) / best_ours, "docs/s", watch=watch)
    bench.report(f"filters on {name}, DataTrove (1 core)", len(texts) / best_theirs, "docs/s", watch=watch)
    bench.report(f"filters on {name}, a clean_corpus step", len(texts) / best_dagster, "docs/s",
                 best_theirs / best_dagster, "DataTrove's speed, Dagster included", target=at_least(1.0), watch=watch)


def planted_pairs(rng: random.Random, per_band: int) -> tuple[list[str], list[tuple[int, int, float, str]]]:
    """Documents and (first, second, Jaccard, kind) pairs: near pairs across Jaccard 0.3-0.95 and exact pairs."""
    vocab = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) for _ in range(50000)]
    texts, pairs = [], []
    settings = MinHashSettings()

    def shingles(text: str) -> set[str]:
        words = simplify_text(text).split()
        return {" ".join(words[i:i + settings.n_grams]) for i in range(len(words) - settings.n_grams + 1)}

    for target in (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95):
        for _ in range(per_band):
            words = [rng.choice(vocab) for _ in range(300)]
            m = len(words) - settings.n_grams + 1
            shared = round(2 * m * target / (1 + target)) + settings.n_grams - 1
            other = words[:shared] + [rng.choice(vocab) for _ in range(len(words) - shared)]
            a, b = " ".join(words), " ".join(other)
            sa, sb = shingles(a), shingles(b)
            texts += [a, b]
            pairs.append((len(texts) - 2, len(texts) - 1, len(sa & sb) / len(sa | sb), "near"))
    for _ in range(per_band):
        words = [rng.choice(vocab) for _ in range(200)]
        texts += [" ".join(words), "  ".join(words).upper()]
        pairs.append((len(texts) - 2, len(texts) - 1, 1.0, "exact"))
    return texts, pairs


def kiln_clusters(source: Path, work: Path, watch: LoadWatch) -> tuple[np.ndarray, float]:
    """Each document's kept copy by Kiln's dedup: signatures (phase 1, no filter), then buckets and clusters (and
    the seconds of those)."""
    recipe = load_recipe({"steps": []})
    watch.time("Kiln signatures", lambda: ChunkFilter(recipe).run([RawInput(source, source.name)], work / "stage"))
    numbering = Numbering([ChunkStage.load("bench", work / "stage")])
    seconds, clusters = watch.call("Kiln buckets+clusters", lambda: cluster_stages(numbering.stages, recipe))
    return clusters.kept, seconds


def datatrove_clusters(source: Path, work: Path, watch: LoadWatch) -> tuple[dict[int, int], float]:
    """DataTrove 0.3.0's own MinHash stages (the release Kiln installs) in this process, its signature stage with
    Kiln's offline word splitter (its English one downloads NLTK's punkt): cluster id by document index (each
    cluster's root left out, as 0.3.0 writes them), and the seconds of the buckets and clusters stages. Its
    signatures are Kiln's, so those stages alone differ."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupSignature)
    from datatrove.pipeline.readers import JsonlReader

    from training.data.cleaning.minhash import SIMPLIFIED, signature_stage

    signature_stage(MinHashSettings())  # registers the word splitter
    config = MinhashConfig()

    def run(name, step, tasks=1):
        LocalPipelineExecutor(pipeline=step, tasks=tasks, workers=1, logging_dir=str(work / name),
                              skip_completed=False).run()

    watch.time("DataTrove signatures", lambda: run("l1", [JsonlReader(str(source.parent)), MinhashDedupSignature(
        str(work / "sigs"), config=config, language=SIMPLIFIED)]))

    def buckets_and_clusters():
        run("l2", [MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)],
            tasks=config.num_buckets)
        run("l3", [MinhashDedupCluster(str(work / "buckets"), str(work / "clusters"), config=config,
                                       save_cluster_id=True)])
    seconds = watch.time("DataTrove buckets+clusters", buckets_and_clusters)
    return {doc: cluster for path in (work / "clusters").glob("*.clusters")
            for doc, cluster in struct.iter_unpack("<II", path.read_bytes())}, seconds


def dedup_quality(bench: Bench, work: Path, rng: random.Random, per_band: int) -> None:
    texts, pairs = planted_pairs(rng, per_band)
    source = write_jsonl(work / "pairs_in", texts)
    with LoadWatch(cores=1) as watch:
        kept, our_seconds = kiln_clusters(source, work / "kiln_pairs", watch)
        installed, their_seconds = datatrove_clusters(source, work / "datatrove_0.3", watch)
    ours = {(a, b): bool(kept[a] == kept[b]) for a, b, _, _ in pairs}
    near = [(j, ours[(a, b)]) for a, b, j, kind in pairs if kind == "near"]
    high = [flag for j, flag in near if j >= 0.8]
    low = [flag for j, flag in near if j <= 0.5]
    exact = [ours[(a, b)] for a, b, _, kind in pairs if kind == "exact"]
    # 14 x 8 bands predict ~0.92-1.0 at J >= 0.8
    bench.report(f"near-dup recall at J >= 0.8 ({len(high)} pairs)", np.mean(high), "of pairs",
                 target=at_least(0.90, of="value"))
    bench.report(f"near-dup flagged at J <= 0.5 ({len(low)} pairs)", np.mean(low), "of pairs",
                 target=at_most(0.06, of="value"))
    for lower, upper in ((0.25, 0.45), (0.45, 0.55), (0.55, 0.65), (0.65, 0.75), (0.75, 0.85), (0.85, 1.0)):
        band = [flag for j, flag in near if lower <= j < upper]
        if band:
            predicted = np.mean([1 - (1 - j ** 8) ** 14 for j, _ in near if lower <= j < upper])
            bench.report(f"  J in [{lower:.2f}, {upper:.2f}) flagged ({len(band)} pairs)", np.mean(band), "of pairs",
                         np.mean(band) / predicted, f"1-(1-J^8)^14's {predicted:.3f}")
    bench.report(f"exact-dup recall ({len(exact)} pairs)", np.mean(exact), "of pairs", target=at_least(1.0, of="value"))
    # its stages have no exact-key links; its .clusters leave out each cluster's root (the copy kept), so a pair is
    # flagged when either copy is listed: planted pairs share no 5-gram with other pairs
    near_pairs = [(a, b) for a, b, _, kind in pairs if kind == "near"]
    bench.report(f"pair agreement with DataTrove 0.3.0's buckets+clusters ({len(near_pairs)} near pairs)",
                 np.mean([ours[(a, b)] == (a in installed or b in installed) for a, b in near_pairs]), "of pairs",
                 target=at_least(0.99, of="value"))
    bench.report(f"buckets+clusters of {len(texts)} docs, Kiln's sorted bands", our_seconds * 1e3, "ms",
                 our_seconds / their_seconds, "DataTrove 0.3.0's stages 2-3", watch=watch)
    theirs = reference("minhash", source.parent, work / "datatrove_pairs")["clusters"]
    current = {int(doc): c for doc, c in theirs.items()}
    agree = [ours[(a, b)] == (a in current and current.get(a) == current.get(b)) for a, b, _, _ in pairs]
    bench.report(f"pair agreement with DataTrove 0.10.1's MinHash ({len(agree)} pairs)", np.mean(agree), "of pairs",
                 target=at_least(0.99, of="value"))


PEAK_RSS = """
import resource, sys
from pathlib import Path
from training.data.cleaning.pipeline import clean_files
from training.data.cleaning.recipe import load_recipe
clean_files([Path(sys.argv[1])], Path(sys.argv[2]), load_recipe("fineweb"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def memory(bench: Bench, work: Path, rng: random.Random, docs: int) -> None:
    """Peak RSS of `kiln clean`'s work (filters, signatures, dedup, outputs) on a corpus and on 8 times it, each in
    a process of its own: the documents are streamed, so it should barely move."""
    texts = generated_prose(docs, rng)
    peaks = {}
    for scale in (1, 8):
        source = work / f"memory_{scale}x" / "docs.jsonl"
        source.parent.mkdir(parents=True)
        with open(source, "w") as stream:
            for _ in range(scale):
                stream.writelines(json.dumps({"text": t + f" {rng.random()}"}) + "\n" for t in texts)
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, str(source), str(source.parent / "out")],
                              capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
        peaks[scale] = int(done.stdout.split()[-1]) / 1024
        print(f"peak RSS cleaning {scale}x ({scale * docs} docs, {source.stat().st_size / 2**20:.1f} MiB): "
              f"{peaks[scale]:.0f} MiB", flush=True)
    bench.report(f"peak RSS cleaning {8 * docs} docs", peaks[8], "MiB", peaks[8] / peaks[1],
                 f"{docs} docs' (streamed: near 1)")


def ray_cost(bench: Bench, work: Path, rng: random.Random, docs: int, nodes: int, chunks: int = 4) -> None:
    """The FineWeb recipe over ``chunks`` chunks on a Ray cluster of ``nodes`` nodes on this machine vs. in this
    process: seconds per document each, and whether the outputs are the same bytes."""
    from benchmarks.ray_cluster import local_ray_cluster
    from training.data.cleaning.runners import LocalRunner, RayRunner, clean_chunks

    recipe = load_recipe("fineweb")
    inputs = []
    for i in range(chunks):
        source = write_jsonl(work / "ray_in" / f"c{i}", generated_prose(docs // chunks, rng))
        inputs.append((f"c{i}", (RawInput(source, f"c{i}/docs.jsonl"),)))
    # Ray's nodes are daemons outside this process tree: the watch counts their CPU as other processes', so the
    # ratio is judged valid only when it stays under LoadWatch's slack
    with LoadWatch() as watch:
        local = watch.time("one process", lambda: clean_chunks(LocalRunner(), recipe, inputs, work / "ray_local"))
        with local_ray_cluster(nodes=nodes) as address:
            remote = watch.time("Ray", lambda: clean_chunks(RayRunner(address), recipe, inputs, work / "ray_cluster"))
    same = all((work / "ray_cluster" / p.relative_to(work / "ray_local")).read_bytes() == p.read_bytes()
               for p in (work / "ray_local" / "clean").rglob("*.*"))
    if not same:
        raise AssertionError("the Ray cluster's cleaned outputs differ from one process's")
    bench.report(f"Ray, {nodes} node(s) of 1 CPU, {docs} docs in {chunks} chunks", remote / docs * 1e3, "ms/doc",
                 remote / local, "one process's time (outputs identical)", watch=watch)


LOCALE_ROOT = Path("/usr/share/locale")
SAMPLE_CHARS = 300  # about a paragraph: translations joined until this long


def translation_samples(per_language: int = 20, min_catalogs: int = 20) -> list[tuple[str, str]]:
    """(language, text) samples from the gettext catalogs (.mo) installed under /usr/share/locale: human
    translations of program messages, labelled by their directory; languages with at least ``min_catalogs``."""
    import gettext

    samples = []
    for directory in sorted(LOCALE_ROOT.glob("*/LC_MESSAGES")):
        language = directory.parent.name.split("_")[0].split("@")[0]
        catalogs = sorted(directory.glob("*.mo"))
        if len(catalogs) < min_catalogs or directory.parent.name != language:
            continue  # few catalogs, or a regional variant (pt_BR, zh_CN...): its base language is enough
        texts, current = [], ""
        for path in catalogs:
            try:
                with open(path, "rb") as stream:
                    catalog = gettext.GNUTranslations(stream)._catalog
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            for key, message in catalog.items():
                if key == "":  # the catalog's header, not a translation
                    continue
                if isinstance(message, str) and len(message.split()) >= 4 and "%" not in message:
                    current += " " + message.strip()
                    if len(current) >= SAMPLE_CHARS:
                        texts.append(current.strip())
                        current = ""
            if len(texts) >= per_language:
                break
        samples += [(language, text) for text in texts[:per_language]]
    return samples


def language_accuracy(bench: Bench, per_language: int) -> None:
    """CLD2's accuracy (training/data/cleaning/filters.py Language) on the machine's translation catalogs."""
    from training.data.cleaning.filters import detect_language

    import pycld2

    known = {code for _, code in pycld2.LANGUAGES}
    everything = translation_samples(per_language)
    samples = [(language, text) for language, text in everything if language in known]
    if not samples:
        print(f"language ID: no gettext catalogs under {LOCALE_ROOT} to measure on", flush=True)
        return
    aliases = {"iw": "he", "no": "nb", "in": "id", "jw": "jv"}  # CLD2's older codes
    right = [aliases.get(code, code) == language
             for code, language in ((detect_language(text)[0].split("-")[0], language) for language, text in samples)]
    english = [ok for (language, _), ok in zip(samples, right) if language == "en"]
    languages = sorted({language for language, _ in samples})
    print(f"({len(everything) - len(samples)} paragraphs in languages CLD2 does not know left out)", flush=True)
    bench.report(f"language ID accuracy (CLD2), {len(samples)} paragraphs, {len(languages)} languages",
                 np.mean(right), "of paragraphs")
    if english:
        bench.report("language ID accuracy, English", np.mean(english), "of paragraphs")
    wrong = {}
    for (language, _), ok in zip(samples, right):
        wrong[language] = wrong.get(language, 0) + (not ok)
    worst = sorted(wrong.items(), key=lambda item: -item[1])[:5]
    print("  most missed: " + ", ".join(f"{language} {count}" for language, count in worst if count), flush=True)


def measure(bench: Bench, docs: int, rounds: int, per_band: int, per_language: int, ray_nodes: int) -> None:
    rng = random.Random(1234)
    from assets.builtin_corpus import write_builtin_source

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (part,) = write_builtin_source("python_stdlib_docstrings", work / "builtin", 2_000_000)
        docstrings = [json.loads(line)["text"] for line in part.read_text().splitlines()][:docs]
        filter_speed(bench, "stdlib docstrings", docstrings, work, rounds)
        filter_speed(bench, "generated prose", generated_prose(docs, rng), work, rounds)
        dedup_quality(bench, work, rng, per_band)
        memory(bench, work, rng, docs * 4)
        ray_cost(bench, work, rng, docs, ray_nodes)
    language_accuracy(bench, per_language)


def run(bench: Bench) -> None:
    if bench.smoke:
        # the Ray head alone: a node joining is Ray's own start-up, which tests/test_cleaning_ray.py's two nodes run
        measure(bench, docs=40, rounds=1, per_band=4, per_language=2, ray_nodes=1)
    else:
        measure(bench, docs=1000, rounds=2, per_band=40, per_language=20, ray_nodes=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents per filter corpus (default 1000)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with standalone("cleaning") as bench:
        measure(bench, args.docs, args.rounds, per_band=40, per_language=20, ray_nodes=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
