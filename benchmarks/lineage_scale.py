"""Lineage and the UI at the scale of a long run: 10 / 1,000 / 10,000 checkpoints, a source of 10,000 raw files.

How the data is made and recorded, one directory per level (DAGSTER_HOME included), built in a process of
its own and kept under --work for the next run while the code that built it is unchanged (its key hashes
Dagster's version, Kiln's assets, resources and lineage code, this module's builders and the sizes):
- a file source ``stdlib_code`` of RAW_FILES small JSONL files (two generated documents each) next to the
  built-in ``stdlib_docs``; ``raw_corpus``, ``tokenizer``, ``token_shards`` and ``blend_manifest`` are
  materialized by Kiln's own assets into a persistent SQLite instance, ``raw_corpus`` and ``token_shards``
  twice (two events each on their Events tab);
- checkpoints: one small MindFormers-layout directory per step (a 4 KB safetensors-named file,
  metadata.json, kiln_state.json, lineage.json pointing at the run's lineage store entry, common.json, and a
  line in the lineage index), each handed to ``assets.training.CheckpointRecorder``, which ``training_run``
  uses for rank 0's checkpoint messages (audit, partition, materialization, the audit check's evaluation
  when due, rotation sync), inside one Dagster run, as a training run records them; the rows are the same,
  written faster by keeping each SQLite database open (kept_connections). save_max is not applied: every
  checkpoint stays a partition, the worst case for the UI.

Measured at each level: every tab of ``checkpoint``, ``raw_corpus`` and ``token_shards`` in headless
Chromium (Debian's, driven by Playwright, as tests/test_browser_ui.py does) against ``dagster-webserver`` on
that instance: the time from navigation until the page's last GraphQL answer arrived (best of 3 loads),
and its ratio to the same tab on the first level's instance, served by a second webserver at the same time
and loaded alternately (the machine is shared); ``kiln lineage --consumers``, ``kiln audit`` and
``python -m pipelines.audit`` (wall time and peak RSS, from /usr/bin/time; the cross-check hashes the code
versions from the files each time, so one run stands for a first one and one after a code change); the
instance's bytes per checkpoint between levels, and where they go (SQLite's dbstat: pages per table and index,
over the run databases and the index); and the raw-files sensor's cursor at RAW_FILES files. ``--no-ui`` leaves out the
browser.

    python -m benchmarks.lineage_scale [--levels 10,1000,10000] [--raw-files 10000] [--no-ui] [--work DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import MethodType

from benchmarks.contention import LoadWatch
from benchmarks.suite import Bench, at_most, standalone

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RUN_NAME = "long"
ASSET_TABS = {"checkpoint": ("overview", "partitions", "events", "checks", "lineage"),
              "raw_corpus": ("overview", "partitions", "events", "lineage"),
              "token_shards": ("overview", "partitions", "events", "checks", "lineage")}
# docs/long-runs.md: every tab under 2 s and under 2x the first level's; the commands under 1 s and 200 MB
UI_TARGETS = (at_most(2.0, of="value"), at_most(2.0))
COMMAND_TARGET, MEGABYTES_TARGET = at_most(1.0, of="value"), at_most(200, of="value")
# a smoke run: two small levels, the commands timed at the second only, one tab of each asset
SMOKE = {"levels": [1, 2], "raw_files": 10, "command_levels": [2],
         "tabs": {"checkpoint": ("partitions",), "raw_corpus": ("events",), "token_shards": ("checks",)}}
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the events are stored all the same


def _write_sources(work: Path, raw_files: int) -> Path:
    corpus = work / "user_corpus"
    corpus.mkdir(parents=True)
    for i in range(raw_files):
        docs = [{"text": f"def f{i}_{j}(x):\n    return x * {i} + {j}  # generated document {j} of file {i}\n"}
                for j in range(2)]
        (corpus / f"part{i:05d}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    sources = work / "sources.yaml"
    sources.write_text(f"sources:\n  stdlib_code: {{files: ['{corpus}/*.jsonl'], weight: 0.5}}\n"
                       "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 40000, weight: 0.5}\n")
    return sources


def _materialize_data(instance, storage) -> None:
    import dagster as dg

    from assets.chunks import register_source_chunks
    from pipelines.definitions import ALL_ASSETS, resources
    from resources.tokenizer import TokenizerSettings

    res = resources(storage=storage, tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=5_000))
    register_source_chunks(instance, storage)  # the data assets' partitions: one chunk per source, named like it
    steps = [("raw_corpus", "stdlib_code"), ("raw_corpus", "stdlib_docs"), ("tokenizer", None),
             ("token_shards", "stdlib_code"), ("token_shards", "stdlib_docs"), ("raw_corpus", "stdlib_code"),
             ("token_shards", "stdlib_code"), ("blend_manifest", None)]
    for key, partition in steps:
        ops = {"blend_manifest": {"config": {"seq_length": 32}}} if key == "blend_manifest" else {}
        dg.materialize(ALL_ASSETS, selection=[key], partition_key=partition, instance=instance, resources=res,
                       run_config={"ops": ops, **QUIET})


class CheckpointWriter:
    """Small checkpoint directories of run RUN_NAME, as the trainer lays them out, and their messages."""

    def __init__(self, storage, pointer: dict):
        from training.data.hashing import sha256_file

        self.save_path = storage.run_dir(RUN_NAME) / "checkpoints"
        self.save_path.mkdir(parents=True, exist_ok=True)
        self.config = storage.run_dir(RUN_NAME) / "config.yaml"
        self.config.write_text("training: {steps: 1000000}\n")
        self.run = {"config_path": str(self.config), "config_sha256": sha256_file(self.config), "world_size": 1,
                    "started_at": "2026-12-05T00:00:00Z", "resumed_from": None}
        self.pointer = pointer
        self.sha256_file = sha256_file

    def write(self, step: int) -> dict:
        from training.atomic import write_json_atomic
        from training.checkpoint import COMMON, KILN_STATE, LINEAGE, METADATA, iteration_dir
        from training.lineage import record_in_index

        directory = iteration_dir(self.save_path, step)
        directory.mkdir()
        (directory / "model-0000000-0000001.safetensors").write_bytes(os.urandom(4096))
        write_json_atomic(directory / METADATA, {"total_size": 4096, "step": step})
        write_json_atomic(directory / KILN_STATE, {"loss": 3.0, "step": step})
        common = {"global_step": step, "consumed_samples": 8 * step, "global_batch_size": 8}
        files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": self.sha256_file(p)}
                 for p in sorted(directory.iterdir())]
        lineage = {**self.pointer, "run": self.run, "checkpoint": {"step": step, "files": files, "common": common}}
        write_json_atomic(directory / LINEAGE, lineage)
        write_json_atomic(directory / COMMON, common)
        files += [{"name": n, "bytes": (directory / n).stat().st_size, "sha256": self.sha256_file(directory / n)}
                  for n in (LINEAGE, COMMON)]
        record_in_index(self.save_path, step, lineage)
        return {"event": "checkpoint", "path": str(directory), "step": step, "loss": 3.0 - step * 1e-4, "lr": 1e-3,
                "tokens_seen": 256 * step, "consumed_samples": 8 * step, "grad_norm": 1.0, "tokens_per_s": 900.0,
                "samples_per_s": 3.5, "ckpt_status": "ok", "files": sorted(files, key=lambda f: f["name"])}


@contextmanager
def kept_connections(instance):
    """Dagster's SQLite event log opens a database engine for every statement (~10-15 ms each here, several per
    checkpoint); while recording, each database's engine is kept open instead. The rows are the same, written
    by the same storage code one transaction at a time: only the opening is saved."""
    from sqlalchemy import create_engine

    storage, engines = instance.event_log_storage, {}
    opening = type(storage)._connect

    @contextmanager
    def connect(self, shard):
        if shard not in self._initialized_dbs:  # Dagster's own first opening creates the database
            with opening(self, shard):
                pass
        with self._db_lock:
            if shard not in engines:
                engines[shard] = create_engine(self.conn_string_for_shard(shard), connect_args={"timeout": 60})
            with engines[shard].connect() as connection, connection.begin():
                yield connection

    storage._connect = MethodType(connect, storage)
    try:
        yield
    finally:
        del storage._connect
        for engine in engines.values():
            engine.dispose()


def _record_checkpoints(instance, storage, writer: CheckpointWriter, steps: range) -> float:
    """Write and record ``steps`` inside one Dagster run, through training_run's own code; seconds taken."""
    import dagster as dg

    from assets.training import CheckpointRecorder, training_run

    @dg.op
    def record(context) -> None:
        recorder = CheckpointRecorder(context, storage, RUN_NAME, training_run.code_versions_by_key[training_run.key])
        for step in steps:
            recorder.record(writer.write(step))
        recorder.finish()

    started = time.perf_counter()
    with kept_connections(instance):
        assert dg.GraphDefinition("record_checkpoints", node_defs=[record]).to_job().execute_in_process(
            instance=instance, run_config=QUIET).success
    return time.perf_counter() - started


def _timed(command: list[str], env: dict) -> tuple[float, float, float, str]:
    """(seconds, CPU seconds, peak RSS in MB, stdout) of one command."""
    done = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", *command], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True)
    seconds, user, system, kilobytes = done.stderr.strip().splitlines()[-1].split()
    return float(seconds), float(user) + float(system), int(kilobytes) / 1024, done.stdout


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _sqlite_pages(home: Path) -> dict[str, int]:
    """Bytes of pages per table or index, summed over the instance's event log databases (run shards and
    index.db); empty where this SQLite lacks the dbstat table."""
    import sqlite3

    totals: dict[str, int] = {}
    for database in sorted((home / "history" / "runs").glob("*.db")):
        with sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True) as connection:
            try:
                rows = connection.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
            except sqlite3.OperationalError:
                return {}
        for name, size in rows:
            totals[name] = totals.get(name, 0) + size
    return totals


class Webserver:
    """dagster-webserver on the instance, its own process group, stopped by its id."""

    def __init__(self, env: dict, workspace: Path, log: Path):
        from resources.msrun import free_port

        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen([str(BIN / "dagster-webserver"), "-w", str(workspace), "-h", "127.0.0.1",
                                      "-p", str(self.port)], cwd=PROJECT_ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        import urllib.request
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/server_info", timeout=2)
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"dagster-webserver did not come up; see {log}")
                time.sleep(1)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _page_load_seconds(page, url: str) -> float:
    """Navigation to the page's last GraphQL answer (the UI polls later; those are not the load)."""
    finished = []
    listener = lambda request: finished.append(time.perf_counter()) if "graphql" in request.url else None  # noqa: E731
    page.on("requestfinished", listener)
    started = time.perf_counter()
    page.goto(url, wait_until="networkidle", timeout=180_000)
    page.remove_listener("requestfinished", listener)
    return (max(finished) if finished else time.perf_counter()) - started


def _ui_loads(urls: list[str], rounds: int, asset_tabs: dict = ASSET_TABS) -> list[dict[str, float]]:
    """Each tab's load time on each server (best of ``rounds``), the servers' loads alternating tab by tab
    and round by round so that a slow moment of the shared machine falls on both."""
    from playwright.sync_api import sync_playwright

    loads = [{} for _ in urls]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        pages = [browser.new_page(viewport={"width": 1600, "height": 1000}) for _ in urls]
        for page, url in zip(pages, urls):  # warm-up (and the first-visit dialog)
            page.goto(f"{url}/assets/checkpoint", wait_until="networkidle", timeout=180_000)
        for asset, tabs in asset_tabs.items():
            for tab in tabs:
                for _ in range(rounds):
                    for page, url, measured in zip(pages, urls, loads):
                        seconds = _page_load_seconds(page, f"{url}/assets/{asset}?view={tab}")
                        measured[f"{asset} {tab}"] = min(seconds, measured.get(f"{asset} {tab}", seconds))
        browser.close()
    return loads


BUILT = "built.json"  # in a level's directory, written last: what built it and the figures of building it


def build_key(raw_files: int, level: int) -> str:
    """What a built level depends on: Dagster's version, the code that records and audits (Kiln's assets,
    resources and lineage, and this module's builders) and the sizes. A level built by other code is rebuilt."""
    import inspect

    import dagster as dg

    digest = hashlib.sha256(f"{dg.__version__} {raw_files} {level}".encode())
    for builder in (_write_sources, _materialize_data, CheckpointWriter, kept_connections, _record_checkpoints,
                    _build_level):
        digest.update(inspect.getsource(builder).encode())
    for path in sorted([*PROJECT_ROOT.glob("assets/*.py"), *PROJECT_ROOT.glob("resources/*.py"),
                        *PROJECT_ROOT.glob("training/data/*.py"), PROJECT_ROOT / "training/lineage.py",
                        PROJECT_ROOT / "training/checkpoint.py", PROJECT_ROOT / "configs/sources.yaml"]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def level_env(level_dir: Path) -> dict:
    return {**os.environ, "DAGSTER_HOME": str(level_dir / "dagster_home"), "KILN_SOURCES": str(level_dir / "sources.yaml"),
            "KILN_DATA_ROOT": str(level_dir / "data"), "KILN_RUNS_ROOT": str(level_dir / "runs"),
            "KILN_AUTOMATION": "off", "PATH": f"{BIN}:{os.environ['PATH']}"}


def _build_level(level_dir: Path, raw_files: int, level: int) -> None:
    """In a process of its own (the definitions read the sources config when imported): the data chain on a
    source of ``raw_files`` files, the sensor's cursor, then ``level`` checkpoints recorded as training does."""
    import dagster as dg

    from pipelines.sensors import raw_files_sensor
    from resources.storage import KilnStorage
    from training.lineage import lineage_inputs, store_lineage_inputs

    storage = KilnStorage(data_root=str(level_dir / "data"), runs_root=str(level_dir / "runs"),
                          sources_config=os.environ["KILN_SOURCES"])
    built = {"raw_files": raw_files, "level": level}
    with dg.DagsterInstance.from_config(os.environ["DAGSTER_HOME"]) as instance:
        started = time.perf_counter()
        _materialize_data(instance, storage)
        built["data_chain_s"] = time.perf_counter() - started
        context = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        first = raw_files_sensor(context)
        context = dg.build_sensor_context(instance=instance, cursor=first.cursor, resources={"storage": storage})
        started = time.perf_counter()
        raw_files_sensor(context)
        built.update(sensor_cursor_bytes=len(first.cursor), sensor_tick_s=time.perf_counter() - started)
        pointer = store_lineage_inputs(storage.runs_root, lineage_inputs(storage.manifest_path(), storage.root))
        built["record_s"] = _record_checkpoints(instance, storage, CheckpointWriter(storage, pointer),
                                                range(1, level + 1))
    (level_dir / BUILT).write_text(json.dumps(built))


def built_level(work: Path, raw_files: int, level: int) -> tuple[Path, dict]:
    """The directory of a level built by this code (built now when there is none), and its build figures."""
    level_dir = work / f"{raw_files}files-{level}ckpt-{build_key(raw_files, level)}"
    if not (level_dir / BUILT).is_file():
        for stale in work.glob(f"{raw_files}files-{level}ckpt-*"):  # built by other code, or cut short
            shutil.rmtree(stale)
        (level_dir / "dagster_home").mkdir(parents=True)
        (level_dir / "dagster_home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        _write_sources(level_dir, raw_files)
        subprocess.run([sys.executable, "-m", "benchmarks.lineage_scale", "--build", str(level_dir),
                        "--raw-files", str(raw_files), "--levels", str(level)],
                       cwd=PROJECT_ROOT, env=level_env(level_dir), check=True)
    return level_dir, json.loads((level_dir / BUILT).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lineage_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="10,1000,10000", help="checkpoint counts to measure at")
    parser.add_argument("--raw-files", type=int, default=10_000)
    parser.add_argument("--work", default=str(PROJECT_ROOT / ".kiln" / "bench_lineage_scale"),
                        help="where built levels are kept and found again")
    parser.add_argument("--no-ui", action="store_true", help="measure everything but the browser's page loads")
    parser.add_argument("--build", help=argparse.SUPPRESS)  # the level directory a child process builds
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.levels.split(",")]
    if args.build:
        _build_level(Path(args.build), args.raw_files, levels[0])
        return 0
    with standalone("lineage_scale") as bench:
        measure(bench, Path(args.work), levels, args.raw_files, ui=not args.no_ui, ui_rounds=3)
    return 0


def measure(bench: Bench, work: Path, levels: list[int], raw_files: int, ui: bool, ui_rounds: int,
            command_levels: list[int] | None = None, tabs: dict = ASSET_TABS) -> None:
    """The levels built (or found), then at each the instance, the commands (at ``command_levels`` only, if given)
    and the UI's ``tabs`` against the first level's."""
    workspace = work / "workspace.yaml"
    work.mkdir(parents=True, exist_ok=True)
    workspace.write_text("load_from:\n  - python_module:\n      module_name: pipelines.definitions\n"
                         f"      working_directory: {PROJECT_ROOT}\n      location_name: kiln\n")
    dirs, pages = {}, {}
    for level in levels:
        dirs[level], built = built_level(work, raw_files, level)
        print(f"[{level:,} ckpt] built in {dirs[level].name}: recording {built['record_s'] / level * 1e3:,.1f} "
              f"ms/checkpoint (when built)", flush=True)
    print(f"data chain on {raw_files:,} raw files (when built) {built['data_chain_s']:.1f} s; sensor tick, nothing "
          f"changed, {built['sensor_tick_s']:.2f} s (when built)", flush=True)
    bench.report(f"sensor cursor at {raw_files:,} raw files", built["sensor_cursor_bytes"], "bytes")
    for level in levels:
        level_dir, env = dirs[level], level_env(dirs[level])
        home = level_dir / "dagster_home"
        pages[level] = _sqlite_pages(home)
        bench.report(f"[{level:,} ckpt] instance size", _dir_bytes(home) / 1e6, "MB")
        if command_levels is None or level in command_levels:
            _measure_commands(bench, level, level_dir, env, home)
        if ui and level != levels[0]:
            _measure_ui(bench, levels[0], level, level_env(dirs[levels[0]]), env, workspace, work, ui_rounds, tabs)
    _report_growth(bench, levels, pages)


def _measure_commands(bench: Bench, level: int, level_dir: Path, env: dict, home: Path) -> None:
    """The commands' time and peak RSS at ``level`` checkpoints, one at a time, each a process; then the audit and
    the cross-check in this process, imports done."""
    from pipelines.audit import cross_check_instance
    from training.lineage import audit_checkpoint

    newest = level_dir / "runs" / RUN_NAME / "checkpoints" / f"iteration_{level:08d}"
    cross_check_command = [sys.executable, "-m", "pipelines.audit", str(newest), "--dagster-home", str(home)]
    measured = {}
    with LoadWatch(cores=1) as watch:  # one command at a time, each a process
        for name, command in [
                # references: the interpreter's start, and the import floor of reading through Dagster
                ("python -c pass", [sys.executable, "-c", "pass"]),
                ("python -c 'import dagster'", [sys.executable, "-c", "import dagster"]),
                ("kiln lineage --consumers", [str(BIN / "kiln"), "lineage", "--consumers", "stdlib_code",
                                              "--runs-root", str(level_dir / "runs")]),
                # the first reads the raw files from disk, the second from the page cache, as most audits do
                ("kiln audit, first", [str(BIN / "kiln"), "audit", str(newest)]),
                ("kiln audit", [str(BIN / "kiln"), "audit", str(newest)]),
                ("pipelines.audit (cross-check)", cross_check_command)]:
            seconds, cpu_seconds, megabytes, out = _timed(command, env)
            watch.cpu(name, cpu_seconds)
            measured[name] = seconds, megabytes
            # the blend manifest was recorded before every checkpoint
            if name.startswith("pipelines.audit") and "OK: all" not in out:
                print(out[-2000:])
                raise RuntimeError("the cross-check did not find every link")
        started = time.perf_counter()
        lineage, _ = audit_checkpoint(newest)
        links, _ = cross_check_instance(str(home), newest, lineage)
        assert all(link.status in ("recorded", "superseded") for link in links), links
        in_process = time.perf_counter() - started
    for name, (seconds, megabytes) in measured.items():
        judged = not name.startswith("python") and name != "kiln audit, first"  # the targets' commands
        bench.report(f"[{level:,} ckpt] {name}", seconds, "s", target=COMMAND_TARGET if judged else (),
                     watch=watch)
        bench.report(f"[{level:,} ckpt] {name}, peak RSS", megabytes, "MB",
                     target=MEGABYTES_TARGET if judged else ())
    bench.report(f"[{level:,} ckpt] audit + cross-check, imports done", in_process, "s", watch=watch)


def _measure_ui(bench: Bench, reference_level: int, level: int, reference_env: dict, env: dict, workspace: Path,
                work: Path, ui_rounds: int, tabs: dict) -> None:
    """Each UI tab's load time at ``level`` checkpoints against the first level's instance, served next to it and
    loaded alternately."""
    servers = [Webserver(reference_env, workspace, work / "webserver_ref.log"),
               Webserver(env, workspace, work / f"webserver_{level}.log")]
    try:
        with LoadWatch() as watch:  # the browser and both webservers
            reference, loads = _ui_loads([server.url for server in servers], ui_rounds, tabs)
    finally:
        for server in servers:
            server.stop()
    for tab, seconds in loads.items():
        bench.report(f"[{reference_level:,} ckpt] UI {tab}", reference[tab], "s", watch=watch)
        bench.report(f"[{level:,} ckpt] UI {tab}", seconds, "s", seconds / reference[tab],
                     f"at {reference_level:,} checkpoints, alternating", target=UI_TARGETS, watch=watch)


def _report_growth(bench: Bench, levels: list[int], pages: dict) -> None:
    """The instance's growth per checkpoint between consecutive levels, in SQLite pages."""
    for low, high in zip(levels, levels[1:]):
        grown = {name: (pages[high][name] - pages[low].get(name, 0)) / (high - low) for name in pages[high]}
        bench.report(f"instance growth {low:,}..{high:,} checkpoints", sum(grown.values()) / 1e3,
                     "KB/checkpoint (SQLite pages)")
        for name in sorted(grown, key=grown.get, reverse=True):
            if grown[name] >= 10:  # bytes per checkpoint
                bench.report(f"  {name}", grown[name], "bytes/checkpoint")


def run(bench: Bench) -> None:
    """Built levels are kept under .kiln/ and found again; a smoke run builds its small ones in the run's work
    directory. The UI part needs Debian's Chromium (`make chromium`)."""
    ui = Path("/usr/bin/chromium").exists()
    if bench.smoke:
        measure(bench, bench.work / "lineage_scale", ui=ui, ui_rounds=1, **SMOKE)
    else:
        measure(bench, PROJECT_ROOT / ".kiln" / "bench_lineage_scale", [10, 1000, 10_000], 10_000, ui, ui_rounds=3)


if __name__ == "__main__":
    sys.exit(main())
