"""clean_corpus in the asset graph: global dedup across chunks, the tokenizer and shards on cleaned text,
lineage through the cleaned files, the removal-share check, a recipe change as a new data version."""
import json
import random

import dagster as dg

from assets.chunks import register_source_chunks
from assets.cleaning import clean_corpus, clean_removals_within_limit
from assets.data import blend_manifest, raw_corpus, token_shards, tokenizer
from resources.storage import KilnStorage
from resources.tokenizer import TokenizerSettings
from test_cleaning import vocabulary, words
from training.data.cleaning.versions import clean_data_version
from training.lineage import _consumed, _upstream_checks, lineage_inputs

ASSETS = [raw_corpus, clean_corpus, tokenizer, token_shards, blend_manifest]
RECIPE = "{steps: [{length: {min_chars: MIN}}], max_removed_share: SHARE}"


def corpus(tmp_path):
    rng = random.Random(11)
    vocab = vocabulary(rng)
    first = [" ".join(words(rng, 120, vocab)) + "." for _ in range(20)]
    near = first[5].split()
    near[60] = "changed"
    second = [" ".join(words(rng, 120, vocab)) + "." for _ in range(10)] + [first[2], " ".join(near), "x"]
    folder = tmp_path / "web"
    folder.mkdir(parents=True, exist_ok=True)
    for name, texts in (("a.jsonl", first), ("b.jsonl", second)):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def setup(tmp_path, minimum=5, share=0.9):
    folder = corpus(tmp_path)
    sources = tmp_path / "sources.yaml"
    recipe = RECIPE.replace("MIN", str(minimum)).replace("SHARE", str(share))
    sources.write_text("sources:\n"
                       f"  web: {{files: ['{folder}/*.jsonl'], files_per_chunk: 1, cleaning: {recipe}}}\n"
                       "  stdlib_docs: {builtin: python_stdlib_docstrings, max_bytes: 30000}\n")
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(sources))
    return storage, {"storage": storage, "tokenizer_settings": TokenizerSettings(vocab_size=400, sample_lines=5000)}


def materialize(instance, resources, key, keys=None, checked=False, **kwargs):
    """``key`` (over the partition range ``keys``), with the removal-share check when ``checked``."""
    tags = None if keys is None else {"dagster/asset_partition_range_start": keys[0],
                                      "dagster/asset_partition_range_end": keys[-1]}
    selection = dg.AssetSelection.assets(key)
    if checked:
        selection = selection | dg.AssetSelection.checks(clean_removals_within_limit)
    return dg.materialize([*ASSETS, clean_removals_within_limit], selection=selection, instance=instance,
                          resources=resources, tags=tags, **kwargs)


def chunk_metadata(result, key, chunk):
    (event,) = result.asset_materializations_for_node(key) if chunk is None else \
        [m for m in result.asset_materializations_for_node(key) if m.partition == chunk]
    return {k: v.value for k, v in event.metadata.items()}


def test_duplicates_across_chunks_and_lineage_through_the_cleaned_files(tmp_path):
    storage, resources = setup(tmp_path)
    with dg.instance_for_test() as instance:
        keys = register_source_chunks(instance, storage)
        assert keys == ["stdlib_docs", "web/00000", "web/00001"]
        materialize(instance, resources, "raw_corpus", keys)
        cleaned = materialize(instance, resources, "clean_corpus", keys, checked=True)
        checks = cleaned.get_asset_check_evaluations()
        assert [c.passed for c in checks] == [True]
        metadata = {k: v.value for k, v in cleaned.asset_materializations_for_node("clean_corpus")[0].metadata.items()}
        assert metadata["docs_in/web/00001"] == 13 and metadata["docs_out/web/00001"] == 10
        assert metadata["docs_out/web/00000"] == 20 and "docs_in/stdlib_docs" not in metadata  # cleaning: none
        removals = [json.loads(line) for line in (storage.root / "clean/web/00001/removals.jsonl").read_text()
                    .splitlines()]
        assert [(e["line"], e.get("step")) for e in removals if not e["kept"]] == [
            (11, "exact_dedup"), (12, "minhash_dedup"), (13, "length")]
        assert removals[10]["duplicate_of"] == {"chunk": "web/00000", "file": "raw/web/00000/part-00000.jsonl",
                                                "raw_sha256": removals[10]["duplicate_of"]["raw_sha256"], "line": 3}
        first = [json.loads(line) for line in (storage.root / "clean/web/00000/removals.jsonl").read_text()
                 .splitlines()]
        assert first[2]["kept"] and first[2]["cluster_size"] == 2 and first[5]["cluster_size"] == 2
        materialize(instance, resources, "tokenizer")
        trained_on = json.loads((storage.root / "tokenizer" / "trained_on.json").read_text())
        assert "clean/web/00001/part-00000.jsonl" in trained_on and "raw/stdlib_docs/part-00000.jsonl" in trained_on
        materialize(instance, resources, "token_shards", keys)
        shards = json.loads((storage.root / "shards/web/00001/web_00001.kiln.json").read_text())
        assert shards["docs"] == 10 and [c["path"] for c in shards["clean_files"]] == ["clean/web/00001/part-00000.jsonl"]
        materialize(instance, resources, "blend_manifest")
    inputs = lineage_inputs(storage.manifest_path(), storage.root)
    assert {c["path"] for c in inputs["clean_files"]} == {"clean/web/00000/part-00000.jsonl",
                                                          "clean/web/00001/part-00000.jsonl"}
    for chunk in ("web/00000", "web/00001"):  # the audit's cross-check finds clean_corpus by this version
        recorded = [c["sha256"] for c in inputs["clean_files"] if c["chunk"] == chunk]
        assert clean_data_version(recorded) == metadata[f"data_version/{chunk}"]
    recipe_sha256 = inputs["clean_files"][0]["recipe_sha256"]
    matched, share = _consumed(inputs, recipe_sha256[:12])
    assert matched.startswith("recipe inline recipe") and 0 < share < 1
    assert all(c.status == "ok" for c in _upstream_checks(inputs, storage.root, None))
    (storage.root / "clean/web/00000/part-00000.jsonl").write_text("{}\n")
    bad = [c for c in _upstream_checks(inputs, storage.root, None) if c.status != "ok"]
    assert [(c.link, c.path) for c in bad] == [("clean file", "clean/web/00000/part-00000.jsonl")]


def test_a_step_removing_too_much_fails_the_check_and_a_new_parameter_is_a_new_data_version(tmp_path):
    storage, resources = setup(tmp_path, minimum=5)
    with dg.instance_for_test() as instance:
        keys = register_source_chunks(instance, storage)
        materialize(instance, resources, "raw_corpus", keys)
        before = materialize(instance, resources, "clean_corpus", keys[1:])
        version = before.asset_materializations_for_node("clean_corpus")[0].metadata["data_version/web/00000"].value
        storage, resources = setup(tmp_path, minimum=5000, share=0.5)  # the same raw files, a new parameter
        after = materialize(instance, resources, "clean_corpus", keys[1:], checked=True,
                            raise_on_error=False)
        (check,) = after.get_asset_check_evaluations()
        assert not check.passed and "web/00000: step length removed 100.0% of 20 documents" in \
            check.metadata["problems"].value
        changed = after.asset_materializations_for_node("clean_corpus")[0].metadata["data_version/web/00000"].value
        assert changed != version


def test_a_chunk_cleaned_before_the_copy_it_holds_was_kept_elsewhere_is_reported_stale(tmp_path):
    storage, resources = setup(tmp_path)
    with dg.instance_for_test() as instance:
        keys = register_source_chunks(instance, storage)
        materialize(instance, resources, "raw_corpus", keys)
        alone = materialize(instance, resources, "clean_corpus", ["web/00001"])
        assert chunk_metadata(alone, "clean_corpus", None)["docs_out"] == 12  # nothing to compare with yet
        first = materialize(instance, resources, "clean_corpus", ["web/00000"])
        assert chunk_metadata(first, "clean_corpus", None)["stale_chunks"] == "web/00001"
        again = materialize(instance, resources, "clean_corpus", ["web/00001"])
        metadata = chunk_metadata(again, "clean_corpus", None)
        assert metadata["docs_out"] == 10 and "stale_chunks" not in metadata
