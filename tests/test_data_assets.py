"""The data assets in process, on a file source with bad records, two json keys and a shard size limit."""
import json

import dagster as dg
import pytest

import assets.data
from assets.chunks import register_source_chunks
from assets.cleaning import CleanConfig, clean_corpus
from assets.data import (BlendConfig, ChunkStep, blend_manifest, raw_corpus, raw_file_hashes, token_shards,
                         tokenize_chunks, tokenizer)
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset

DATA_ASSETS = [raw_corpus, clean_corpus, tokenizer, token_shards, blend_manifest]


def _write_sources(tmp_path):
    corpus = tmp_path / "user" / "corpus.jsonl"
    corpus.parent.mkdir()
    lines = [json.dumps({"title": f"Title {i}", "body": f"body number {i} " * (1 + i % 7)}) for i in range(300)]
    lines[10] = '{"title": "no body"}'
    lines[20] = '{"title": "x", "body": 3}'
    lines[30] = json.dumps({"title": "", "body": "untitled body"})
    corpus.write_text("\n".join(lines) + "\n")
    sources = tmp_path / "sources.yaml"
    # the partition names are the project's (fixed when assets.data is imported)
    sources.write_text(
        "sources:\n"
        f"  stdlib_code: {{files: ['{corpus}'], json_keys: [title, body], on_bad_line: skip,"
        " max_shard_tokens: 1500, weight: 0.5}\n"
        "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 60000, weight: 0.5}\n")
    return corpus, sources


def _materialize(instance, resources, key, partition=None):
    register_source_chunks(instance, resources["storage"])
    result = dg.materialize(DATA_ASSETS, selection=[key], partition_key=partition, instance=instance,
                            resources=resources)
    (event,) = [m for m in result.asset_materializations_for_node(key) if m.asset_key == dg.AssetKey(key)]
    return {k: v.value for k, v in event.metadata.items()}


def test_token_shards_records_every_shard_and_the_skipped_records(tmp_path, monkeypatch):
    monkeypatch.setattr(assets.data, "TABLE_ROWS", 2)  # events list the first rows; the sidecars list every one
    corpus, sources = _write_sources(tmp_path)
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    resources = {"storage": storage, "tokenizer_settings": TokenizerSettings(vocab_size=512, sample_lines=5_000)}
    with dg.instance_for_test() as instance:
        raw = _materialize(instance, resources, "raw_corpus", "stdlib_code")
        assert raw["skipped"] == 2 and raw["docs"] == 298
        _materialize(instance, resources, "raw_corpus", "stdlib_docs")
        _materialize(instance, resources, "tokenizer")
        shards = _materialize(instance, resources, "token_shards", "stdlib_code")
        _materialize(instance, resources, "token_shards", "stdlib_docs")
        blend = _materialize(instance, resources, "blend_manifest")

    assert shards["skipped"] == 2 and shards["skipped_by_reason"] == {"missing_key": 1, "not_a_string": 1}
    assert shards["empty_docs"] == 1 and shards["docs"] == 298 + 297 and shards["dtype"] == "uint16"
    quarantine = [json.loads(line) for line in open(shards["quarantine"])]
    assert [(q["line"], q["reason"]) for q in quarantine] == [(11, "missing_key"), (21, "not_a_string")]
    assert quarantine[0]["file"].endswith("raw/stdlib_code/part-00000.jsonl")

    assert [row.data for row in shards["shards"].records] == [
        {k: row[k] for k in row if k != "dtype"} for row in json.loads(open(shards["sidecar"]).read())["shards"][:2]]
    rows = json.loads(open(shards["sidecar"]).read())["shards"]
    assert shards["num_shards"] == len(rows) > 2
    assert shards["num_raw_files"] == 1 and "raw_files" not in shards
    raw_files = json.loads(open(raw["sidecar"]).read())["files"]
    assert raw["num_files"] == len(raw_files) == 1 and len(raw["files"].records) == 1
    assert raw_files[0]["path"] == "raw/stdlib_code/part-00000.jsonl" and raw_files[0]["docs"] == 298
    assert {row["key"] for row in rows} == {"title", "body"}
    assert all(row["tokens"] <= 1500 for row in rows)
    assert sum(row["tokens"] for row in rows) == shards["tokens"]
    assert sum(row.data["docs"] for row in shards["length_histogram"].records) == shards["docs"]
    data = tmp_path / "data"
    assert rows[0]["prefix"] == "shards/stdlib_code/stdlib_code_title_document_00000"
    assert IndexedDataset(data / rows[0]["prefix"]).num_tokens == rows[0]["tokens"]

    manifest = json.loads((data / "blend" / "manifest.json").read_text())
    (code,) = [s for s in manifest["sources"] if s["name"] == "stdlib_code"]
    assert [s["prefix"] for s in code["shards"]] == [row["prefix"] for row in rows]
    assert manifest["data_path"][1::2] == [row["prefix"] for row in rows] + [
        "shards/stdlib_docs/stdlib_docs_text_document"]
    assert abs(sum(manifest["data_path"][0::2]) - 1.0) < 1e-9
    assert blend["total_tokens"] == sum(s["tokens"] for s in manifest["sources"])
    assert (f"- `stdlib_code`: weight 50.0%, {code['tokens']:,} tokens "
            f"({code['tokens'] / blend['total_tokens']:.1%}) in {len(rows)} shard(s)") in blend["summary"]

    # token_shards' lineage takes each raw file's sha256 from raw_corpus's sidecar while the file keeps the size
    # and modification time recorded there, and hashes a file that changed since
    raw_file = data / raw_files[0]["path"]
    (lineage_row,) = json.loads(open(shards["sidecar"]).read())["raw_files"]
    assert lineage_row["sha256"] == raw_files[0]["sha256"] == sha256_file(raw_file)
    monkeypatch.setattr(assets.data, "sha256_file", lambda path: pytest.fail(f"{path} hashed again"))
    assert raw_file_hashes(storage, "stdlib_code", [raw_file]) == {raw_file.name: raw_files[0]["sha256"]}
    monkeypatch.undo()
    edited = raw_file.read_bytes().replace(b"body number 1 ", b"body number 9 ", 1)
    raw_file.write_bytes(edited)  # the same size, a later modification time
    assert raw_file_hashes(storage, "stdlib_code", [raw_file]) == {raw_file.name: sha256_file(raw_file)}
    assert sha256_file(raw_file) != raw_files[0]["sha256"]


def _raw_corpus_of_one_user_file(tmp_path, text: str):
    """raw_corpus of stdlib_code materialized from one user file holding ``text``: (the file, the result)."""
    user_file = tmp_path / "user" / "corpus.jsonl"
    user_file.parent.mkdir()
    user_file.write_text(text)
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n"
                       f"  stdlib_code: {{files: ['{user_file}'], weight: 0.5}}\n"
                       "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 60000, weight: 0.5}\n")
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    with dg.instance_for_test() as instance:
        register_source_chunks(instance, storage)
        result = dg.materialize(DATA_ASSETS, selection=["raw_corpus"], partition_key="stdlib_code", instance=instance,
                                resources={"storage": storage, "tokenizer_settings": TokenizerSettings()},
                                raise_on_error=False)
    return user_file, result


def test_a_source_whose_only_file_is_empty_fails_raw_corpus_naming_it(tmp_path):
    """Not a raw_corpus of 0 documents that tokenizes into an empty shard training refuses later."""
    empty, result = _raw_corpus_of_one_user_file(tmp_path, "")
    assert not result.success
    failure = result.get_step_failure_events()[0].step_failure_data.error
    assert f"source stdlib_code: {empty} hold no document (0 empty, 0 skipped)" in failure.message
    assert not (tmp_path / "data" / "raw" / "stdlib_code").exists()


def test_a_bad_record_fails_raw_corpus_with_its_one_line_naming_file_and_line(tmp_path):
    """The asset's error boundary: a user error (here a CorpusError naming file:line) is the step's failure
    message, prefixed with the asset and partition, not an exception's traceback."""
    corpus, result = _raw_corpus_of_one_user_file(tmp_path, '{"text": "fine"}\n{"text": \n')
    error = result.get_step_failure_events()[0].step_failure_data.error
    assert error.cls_name == "Failure"
    assert f"raw_corpus[stdlib_code]: {corpus}:2:" in error.message.splitlines()[0], error.message


def _tokenize_chunks_op(storage, step):
    with dg.build_op_context() as context:
        return tokenize_chunks(context, storage=storage, step=step)


@pytest.mark.parametrize("where", ["tokenizer", "clean_corpus", "token_shards[stdlib_code]", "blend_manifest"])
def test_a_broken_sources_config_fails_each_data_asset_with_one_line_naming_it(tmp_path, where):
    """Each data asset's error boundary (raw_corpus's is above; the assets invoked directly, which costs no run):
    the sources config broken after its chunks were registered is the step's Failure, one line naming the asset
    and the config's field, not a traceback."""
    _, sources = _write_sources(tmp_path)
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    steps = {
        "tokenizer": lambda context: tokenizer(context, storage=storage, tokenizer_settings=TokenizerSettings()),
        "clean_corpus": lambda context: clean_corpus(context, config=CleanConfig(), storage=storage),
        "token_shards[stdlib_code]": lambda _: _tokenize_chunks_op(storage, ChunkStep(("stdlib_code",), 1)),
        "blend_manifest": lambda context: blend_manifest(context, config=BlendConfig(), storage=storage)}
    # in memory, closed with the context: the chunks registered, as a run finds them
    with dg.DagsterInstance.ephemeral() as instance, dg.build_asset_context(
            partition_key="stdlib_code" if where == "clean_corpus" else None, instance=instance) as context:
        register_source_chunks(instance, storage)
        sources.write_text(sources.read_text().replace("weight: 0.5}", "weight: 0.5, colour: red}", 1))
        with pytest.raises(dg.Failure) as failure:
            steps[where](context)
    assert failure.value.description.startswith(
        f"{where}: {sources}: sources.stdlib_code: unknown key(s) ['colour']"), failure.value.description
    assert not failure.value.allow_retries  # a retry would read the same config
