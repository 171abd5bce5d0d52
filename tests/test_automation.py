"""Changed raw files re-ingest their source; eager automation re-shards it and re-blends; training waits."""
import json
import os
import subprocess
import sys
import threading
import time

import dagster as dg

from assets.chunks import register_source_chunks
from assets.training import training_run
from assets.versions import ASSET_PARTS, code_version
from conftest import PROJECT_ROOT
from pipelines.definitions import build_definitions, resources
from pipelines.pools import configure_pools, training_slots
from pipelines.sensors import raw_files_sensor
from resources.msrun import MsrunNode, MsrunResource
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings


# the code source's file of its own; it dedups exactly, as the docstrings' inline recipe does: one dedup group
RECIPE = "steps: [{length: {min_chars: 5, max_chars: 100000}}]\ndedup: {minhash: false}\n"


def _sources(tmp_path):
    corpus = tmp_path / "user" / "code.jsonl"
    corpus.parent.mkdir()
    names = ["".join(chr(ord("a") + int(digit)) for digit in f"{i:03d}") for i in range(200)]  # dedup drops digits
    corpus.write_text("".join(json.dumps({"text": f"def {name}(x):\n    return x + {i}\n"}) + "\n"
                              for i, name in enumerate(names)))
    (tmp_path / "code_recipe.yaml").write_text(RECIPE)
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n"
                       f"  stdlib_code: {{files: ['{corpus}'], weight: 0.5, cleaning: code_recipe.yaml}}\n"
                       "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 40000, weight: 0.5, "
                       "cleaning: {dedup: {minhash: false}}}\n")
    return corpus, sources


def _sensor_tick(instance, storage, cursor):
    """``asset[chunk]`` of each run the sensor requests, and its cursor."""
    context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"storage": storage})
    result = raw_files_sensor(context)
    return ([f"{r.asset_selection[0].to_user_string()}[{r.partition_key}]" for r in result.run_requests],
            result.cursor)


def test_changed_file_reingests_its_source_then_shards_and_manifest_follow(tmp_path, monkeypatch):
    corpus, sources = _sources(tmp_path)
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    res = resources(storage=storage, tokenizer_settings=TokenizerSettings(vocab_size=512, sample_lines=5_000))
    defs = build_definitions(res)
    with dg.instance_for_test() as instance:
        register_source_chunks(instance, storage)
        job = defs.resolve_implicit_global_asset_job_def()
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("raw_corpus")],
                                      partition_key="stdlib_docs").success
        # a docstring both sources hold: the copy kept is stdlib_code's (the lower chunk)
        docs = (storage.root / "raw/stdlib_docs/part-00000.jsonl").read_text().splitlines()
        line, shared = next((n, json.loads(d)["text"]) for n, d in enumerate(docs, 1) if len(json.loads(d)["text"]) > 200)
        with corpus.open("a") as f:
            f.write(json.dumps({"text": shared}) + "\n")
        for key, partition in [("raw_corpus", "stdlib_code"), ("clean_corpus", "stdlib_code"), ("clean_corpus", "stdlib_docs"), ("tokenizer", None),
                               ("token_shards", "stdlib_code"), ("token_shards", "stdlib_docs"),
                               ("blend_manifest", None)]:
            assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey(key)],
                                          partition_key=partition).success

        # first sight records the files; nothing changed since
        requested, cursor = _sensor_tick(instance, storage, None)
        assert requested == []
        baseline = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert baseline.total_requested == 0
        # a new mtime with the same bytes is no change
        os.utime(corpus, ns=(1, 1))
        requested, cursor = _sensor_tick(instance, storage, cursor)
        assert requested == []

        with corpus.open("a") as f:
            f.write(json.dumps({"text": "def added():\n    pass\n"}) + "\n")
        requested, cursor = _sensor_tick(instance, storage, cursor)
        assert requested == ["raw_corpus[stdlib_code]"]
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("raw_corpus")],
                                      partition_key="stdlib_code").success

        after_raw = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=baseline.cursor)
        # one tick requests the chunk's cleaning and its shards: one run, in dependency order
        assert after_raw.get_requested_partitions(dg.AssetKey("clean_corpus")) == {"stdlib_code"}
        assert after_raw.get_requested_partitions(dg.AssetKey("token_shards")) == {"stdlib_code"}
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("clean_corpus")],
                                      partition_key="stdlib_code").success
        assert after_raw.get_num_requested(dg.AssetKey("blend_manifest")) == 0  # waits for the shards
        assert after_raw.get_num_requested(dg.AssetKey("training_run")) == 0
        assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("token_shards")],
                                      partition_key="stdlib_code").success

        after_shards = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=after_raw.cursor)
        assert after_shards.get_num_requested(dg.AssetKey("blend_manifest")) == 1
        assert after_shards.get_num_requested(dg.AssetKey("token_shards")) == 0
        assert after_shards.get_num_requested(dg.AssetKey("training_run")) == 0  # not unless KILN_AUTO_TRAIN=1

        def shared_copy_kept():
            return json.loads((storage.root / "clean/stdlib_docs/removals.jsonl").read_text().splitlines()[line - 1])["kept"]

        def clean(*chunks):
            for chunk in chunks:
                assert job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("clean_corpus")],
                                              partition_key=chunk).success

        # the source's recipe file edited, nothing else: clean_corpus shows stale (its code version), and the sensor
        # re-cleans, without re-ingesting them, the chunks of every source of its dedup group: stdlib_docs too
        monkeypatch.setenv("KILN_SOURCES", str(sources))
        before = {asset: code_version(asset) for asset in ASSET_PARTS}
        (tmp_path / "code_recipe.yaml").write_text(RECIPE.replace("100000", "90000"))  # removes nothing more
        after = {asset: code_version(asset) for asset in ASSET_PARTS}
        assert {asset for asset in before if before[asset] != after[asset]} == {"clean_corpus"}
        requested, cursor = _sensor_tick(instance, storage, cursor)
        assert requested == ["clean_corpus[stdlib_code]", "clean_corpus[stdlib_docs]"]
        assert _sensor_tick(instance, storage, cursor)[0] == []
        clean("stdlib_code", "stdlib_docs")
        # both re-cleaned to the same bytes: the same data versions, so their shards stay fresh
        unchanged = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=after_shards.cursor)
        assert unchanged.total_requested == 0 and not shared_copy_kept()

        # a limit that removes the shared docstring from stdlib_code: stdlib_docs' copy is kept now. Its run comes
        # first and filters stdlib_code's chunk again itself; both chunks' shards follow
        (tmp_path / "code_recipe.yaml").write_text(RECIPE.replace("100000", str(len(shared) - 1)))
        requested, cursor = _sensor_tick(instance, storage, cursor)
        assert requested == ["clean_corpus[stdlib_code]", "clean_corpus[stdlib_docs]"]
        clean("stdlib_docs", "stdlib_code")
        assert shared_copy_kept()
        after_recipe = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=unchanged.cursor)
        assert after_recipe.get_requested_partitions(dg.AssetKey("token_shards")) == {"stdlib_code", "stdlib_docs"}
        assert after_recipe.get_num_requested(dg.AssetKey("clean_corpus")) == 0  # done: not requested again



def test_the_sensor_cursor_holds_digests_per_source_and_rehashes_only_changed_files(tmp_path, monkeypatch):
    import pipelines.sensors

    corpus = tmp_path / "user"
    corpus.mkdir()
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  stdlib_code: {{files: ['{corpus}/*.jsonl']}}\n")
    storage = KilnStorage(data_root=str(tmp_path / "data"), sources_config=str(sources))
    hashed, sha256_file = [], pipelines.sensors.sha256_file
    monkeypatch.setattr(pipelines.sensors, "sha256_file", lambda path: hashed.append(path.name) or sha256_file(path))

    def write(count):
        for i in range(count):
            (corpus / f"part{i:04d}.jsonl").write_text('{"text": "x"}\n')

    instance = dg.DagsterInstance.ephemeral()

    def tick(cursor):
        return _sensor_tick(instance, storage, cursor)

    write(3)
    _, small = tick(None)
    write(300)
    requested, cursor = tick(small)
    assert requested == ["raw_corpus[stdlib_code]"] and len(hashed) == 303
    assert len(cursor) == len(small) < 400  # the same size at 3 files and at 300
    hashed.clear()
    assert tick(cursor) == ([], cursor) and hashed == []  # nothing moved: nothing read
    (corpus / "part0007.jsonl").write_text('{"text": "changed"}\n')
    requested, _ = tick(cursor)
    assert requested == ["raw_corpus[stdlib_code]"] and hashed == ["part0007.jsonl"]

def test_sensors_run_by_default_and_the_pool_follows_the_devices():
    defs = build_definitions(resources())
    assert {s.name: s.default_status for s in defs.sensors} == {
        "raw_files_sensor": dg.DefaultSensorStatus.RUNNING, "kiln_automation": dg.DefaultSensorStatus.RUNNING}
    # the eager assets are under the running sensor, not Dagster's default one (which ships stopped)
    automated = defs.get_sensor_def("kiln_automation").asset_selection.resolve(defs.resolve_asset_graph())
    assert {"clean_corpus", "token_shards", "blend_manifest"} <= {key.to_user_string() for key in automated}
    assert training_slots(MsrunResource(local_worker_num=2)) == 1  # CPU: one run's workers fill the machine
    assert training_slots(MsrunResource(worker_num=2, local_worker_num=2, visible_devices="0,1,2,3,4,5,6,7")) == 4
    assert training_slots(MsrunResource(worker_num=8, local_worker_num=8, visible_devices="0,1,2,3,4,5,6,7")) == 1
    # a cluster: every node's step of a job holds a slot at the same time
    nodes = [MsrunNode(address="10.0.0.5", devices=4, visible_devices="0,1,2,3,4,5,6,7"),
             MsrunNode(address="10.0.0.6", devices=4, visible_devices="0,1,2,3,4,5,6,7")]
    assert training_slots(MsrunResource.for_node(nodes, node_rank=1, master_port=8118)) == 4
    with dg.instance_for_test() as instance:
        assert configure_pools(instance, MsrunResource(local_worker_num=2, visible_devices="0,1,2,3")) == 2
        assert instance.event_log_storage.get_concurrency_info("npu").slot_count == 2
        assert instance.event_log_storage.get_concurrency_info("clean").slot_count == 1  # runs of one recipe change


CODE_VERSIONS = ("from pipelines.definitions import defs; import json; graph = defs.resolve_asset_graph(); "
                 "print(json.dumps({k.to_user_string(): graph.get(k).code_version "
                 "for k in graph.get_all_asset_keys()}))")


def test_assets_code_versions_follow_the_sources_config(tmp_path):
    """What the UI flags as stale after an edit: the code locations as they load, before and after."""
    def versions(sources_text):
        config = tmp_path / "sources.yaml"
        config.write_text(sources_text)
        out = subprocess.run([sys.executable, "-c", CODE_VERSIONS], cwd=PROJECT_ROOT, check=True, capture_output=True,
                             text=True, env={**os.environ, "KILN_SOURCES": str(config)}).stdout
        return json.loads(out.splitlines()[-1])

    base = "sources:\n  docs: {builtin: python_stdlib_docstrings, max_bytes: 40000, weight: 1.0}\n"
    before, same, after = versions(base), versions(base), versions(base.replace("40000", "50000"))
    assert before == same
    changed = {key for key in before if before[key] != after[key]}
    # every asset that reads sources.yaml; training reads the manifest, not the sources
    assert changed == {"raw_corpus", "clean_corpus", "tokenizer", "token_shards", "blend_manifest"}


def test_a_second_training_step_waits_for_the_npu_slot(tmp_path):
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"))
    with dg.instance_for_test() as instance:
        configure_pools(instance, MsrunResource(local_worker_num=2))  # 1 slot
        assert instance.event_log_storage.claim_concurrency_slot("npu", "other-run", "training_run").is_claimed
        outcome = {}

        def train():  # no manifest here: the step fails at once, but only once it holds the slot
            outcome["result"] = dg.materialize(
                [training_run], instance=instance, resources=resources(storage=storage), raise_on_error=False)

        worker = threading.Thread(target=train)
        worker.start()
        deadline = time.monotonic() + 120  # the run's start-up is slow on a busy machine; wait for its step
        while (instance.event_log_storage.get_concurrency_info("npu").pending_step_count == 0
               and worker.is_alive() and time.monotonic() < deadline):
            time.sleep(0.2)
        worker.join(timeout=3)  # queued: it must stay there while the other run holds the slot
        assert worker.is_alive(), "the training step ran while another run held the only npu slot"
        assert instance.event_log_storage.get_concurrency_info("npu").pending_step_count == 1
        instance.event_log_storage.free_concurrency_slots_for_run("other-run")
        worker.join(timeout=600)  # a bound against hanging, not a speed target: the queued step polls for its slot
        assert not worker.is_alive()
        failure = outcome["result"].get_step_failure_events()[0].step_failure_data.error
        assert "unreadable manifest" in failure.message  # it got as far as reading the manifest
