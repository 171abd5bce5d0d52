"""DataTrove 0.10.1's side of benchmarks/cleaning.py, run by the Python of its own venv (its releases after 0.3.0
need numpy 2, which Kiln's environment cannot have): ``python cleaning_reference.py filters|minhash INPUT_DIR WORK_DIR``.

filters: the FineWeb filter chain (Gopher repetition, Gopher quality, C4 without the terminal-punctuation rule,
FineWeb quality) in LocalPipelineExecutor, one task on one worker; minhash: DataTrove's signature, buckets and
cluster stages at FineWeb's settings, with cluster ids saved. Prints one JSON line: seconds, documents, and for
minhash the cluster id of each clustered document (by its index in the input).
"""
import json
import struct
import sys
import time
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupSignature)
from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, \
    GopherRepetitionFilter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter


def run(pipeline, logging: Path, tasks: int = 1) -> None:
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(logging),
                          skip_completed=False).run()


def filters(source: Path, work: Path) -> dict:
    started = time.perf_counter()
    run([JsonlReader(str(source)), GopherRepetitionFilter(), GopherQualityFilter(),
         C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter(),
         JsonlWriter(str(work / "kept"))], work / "logs")
    seconds = time.perf_counter() - started
    kept = sum(1 for path in (work / "kept").glob("*.jsonl*") for _ in open(path, "rb"))
    return {"seconds": seconds, "kept": kept}


def minhash(source: Path, work: Path) -> dict:
    config = MinhashConfig()  # FineWeb's: 5-grams, 14 buckets x 8 hashes, 64-bit xxhash
    started = time.perf_counter()
    run([JsonlReader(str(source)), MinhashDedupSignature(str(work / "sigs"), config=config)], work / "l1")
    # a task per bucket (band), as DataTrove requires; one worker runs them in turn
    run([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)], work / "l2",
        tasks=config.num_buckets)
    run([MinhashDedupCluster(str(work / "buckets"), str(work / "clusters"), config=config, save_cluster_id=True)],
        work / "l3")
    seconds = time.perf_counter() - started
    clusters = {}
    for path in (work / "clusters").glob("*.clusters"):
        data = path.read_bytes()
        for doc, cluster in struct.iter_unpack("<II", data):
            clusters[doc] = cluster
    return {"seconds": seconds, "clusters": clusters}


if __name__ == "__main__":
    mode, source, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps({"filters": filters, "minhash": minhash}[mode](source, work)))
