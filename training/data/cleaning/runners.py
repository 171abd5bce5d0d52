"""Where the three phases run: in this process (``LocalRunner``), or as tasks on a Ray cluster (``RayRunner``).

Both run the same jobs on the same files, so their outputs are byte for byte the same: a job is a plain object
(its recipe, its inputs, its stage directory), and on Ray each is a task whose worker reads and writes the data
root, which every node must mount at the same path. Phase 1 is a task per chunk; phase 2 a task per band and
shard of it (``dedup.link_jobs``: the rows of every chunk's signatures whose band hash falls in the shard, as
DataTrove splits its buckets stage by bucket and hash range; the links they return are joined on the driver);
phase 3 a task per chunk. Tasks stream their files, and the shards per band grow with the corpus, so a worker's
memory does not grow with it.

These are Kiln's jobs as plain Ray tasks, not DataTrove's ``RayPipelineExecutor``: the DataTrove release Kiln can
install (0.3.0, the last on numpy<2) has none, and that executor runs DataTrove's own pipeline steps, whose
English filters download NLTK's punkt and which write no removals sidecar.
"""
from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.data.cleaning.dedup import Clusters, LinkJob, components, link_jobs, links
from training.data.cleaning.pipeline import ChunkFilter, ChunkStage, CleaningError, Numbering, RawInput, \
    cluster_stages, finalize_chunk
from training.data.cleaning.recipe import Recipe


@dataclass(frozen=True)
class FilterJob:
    """Phase 1 for one chunk."""
    recipe: Recipe
    inputs: tuple[RawInput, ...]
    stage: Path
    json_keys: tuple[str, ...] = ("text",)
    on_bad_line: str = "error"

    def run(self) -> None:
        ChunkFilter(self.recipe, self.json_keys, self.on_bad_line).run(self.inputs, self.stage)


@dataclass(frozen=True)
class FinalizeJob:
    """Phase 3 for the chunk at ``position`` of ``stages`` (every chunk its dedup compared, in order)."""
    stages: tuple[tuple[str, Path], ...]
    position: int
    out_dir: Path
    stem: str
    json_keys: tuple[str, ...] = ("text",)

    def run(self, clusters: Clusters | None) -> dict:
        numbering = Numbering([ChunkStage.load(key, stage) for key, stage in self.stages])
        return finalize_chunk(numbering, self.position, clusters, self.out_dir, self.stem, self.json_keys)


def _links(stage_dirs: list[Path], recipe: Recipe, job: LinkJob):
    minhash = recipe.minhash
    return links(stage_dirs, job, minhash.rows if minhash else 0, minhash.bands if minhash else 0)


class LocalRunner:
    def filter(self, jobs: Sequence[FilterJob]) -> None:
        for job in jobs:
            job.run()

    def cluster(self, stages: Sequence[ChunkStage], recipe: Recipe) -> Clusters | None:
        return cluster_stages(stages, recipe)

    def finalize(self, jobs: Sequence[FinalizeJob], clusters: Clusters | None) -> list[dict]:
        return [job.run(clusters) for job in jobs]


class RayRunner(LocalRunner):
    """The jobs as Ray tasks on the cluster at ``address`` (``host:port`` of its head, as `ray start --head`
    prints it)."""

    def __init__(self, address: str):
        import ray

        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise CleaningError(f"the Ray cluster at {address!r} is unreachable ({exc}): start it with `ray start "
                                f"--head` or fix the address") from None
        # a cluster on the loopback address registered its nodes under it: the driver must join as it, not as the
        # machine's outward address (Ray's default), or it finds no node of its own to attach to
        local = {"_node_ip_address": host} if host in ("127.0.0.1", "localhost") else {}
        ray.init(address=address, ignore_reinit_error=True, logging_level="ERROR", log_to_driver=False, **local)
        self.ray = ray
        self._run = ray.remote(lambda job, *args: job.run(*args))
        self._links = ray.remote(_links)

    def _gather(self, refs: list) -> list:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as exc:  # the worker's exception, with its message naming file:line
            cause = exc.as_instanceof_cause()
            raise CleaningError(str(cause).splitlines()[-1]) from None

    def filter(self, jobs: Sequence[FilterJob]) -> None:
        self._gather([self._run.remote(job) for job in jobs])

    def cluster(self, stages: Sequence[ChunkStage], recipe: Recipe) -> Clusters | None:
        if not recipe.dedups:
            return None
        stage_dirs = [s.stage for s in stages]
        jobs = link_jobs(stage_dirs, recipe.minhash.bands if recipe.minhash else 0, recipe.exact_dedup,
                         recipe.minhash is not None)
        return components(stage_dirs, self._gather([self._links.remote(stage_dirs, recipe, job) for job in jobs]))

    def finalize(self, jobs: Sequence[FinalizeJob], clusters: Clusters | None) -> list[dict]:
        shared = self.ray.put(clusters)
        return self._gather([self._run.remote(job, shared) for job in jobs])


def runner(ray_address: str | None) -> LocalRunner:
    return RayRunner(ray_address) if ray_address else LocalRunner()


def clean_chunks(run: LocalRunner, recipe: Recipe, chunks: Sequence[tuple[str, tuple[RawInput, ...]]],
                 work: Path) -> list[dict]:
    """Every phase over ``chunks`` (key and raw inputs, in order), deduplicated together: the filter stages in
    ``work/filtered/<key>``, the outputs in ``work/clean/<key>``; each chunk's sidecar."""
    stages = [work / "filtered" / key for key, _ in chunks]
    run.filter([FilterJob(recipe, inputs, stage) for (_, inputs), stage in zip(chunks, stages)])
    loaded = [ChunkStage.load(key, stage) for (key, _), stage in zip(chunks, stages)]
    keys = tuple((s.key, s.stage) for s in loaded)
    jobs = [FinalizeJob(keys, i, work / "clean" / key, key) for i, (key, _) in enumerate(chunks)]
    return run.finalize(jobs, run.cluster(loaded, recipe))
