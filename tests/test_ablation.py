"""Data ablations: each blend variant trains the proxy model for the same tokens with two seeds, each run scored on
the tasks; the ablation_run partition of a variant runs it in a process of its own, and ablation_ranking orders
the variants by the tasks' bits per byte with the spread over seeds."""
import json

import dagster as dg
import pytest

from conftest import write_random_documents
from resources.tokenizer import SPECIAL_IDS
from test_downstream import train_tokenizer
from training.ablation import AblationSpec, rank, run_variant
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset
from training.data.manifest import build_manifest


@pytest.fixture
def data(tmp_path):
    """Two sources of random documents, a tokenizer of the micro model's 512 pieces and their blend manifest."""
    root = tmp_path / "data"
    (root / "tokenizer").mkdir(parents=True)
    train_tokenizer(root / "tokenizer" / "kiln")
    sources = []
    for name, seed in (("stdlib_code", 1), ("stdlib_docs", 2)):
        prefix = write_random_documents(root / "shards" / name / name, seed=seed, documents=150)
        sources.append({"name": name, "weight": 0.5, "shards": [{
            "prefix": str(prefix), "tokens": IndexedDataset(prefix).num_tokens,
            **{f"{ext}_sha256": sha256_file(f"{prefix}.{ext}") for ext in ("bin", "idx")}}]})
    manifest = build_manifest(sources=sources, tokenizer={
        "path": str(root / "tokenizer/kiln.model"), "sha256": sha256_file(root / "tokenizer/kiln.model"),
        "special_ids": {**SPECIAL_IDS, "eod": SPECIAL_IDS["eos"]}}, seq_length=32, split="90,10,0", seed=1234,
        data_root=root)
    (root / "blend").mkdir()
    (root / "blend" / "manifest.json").write_text(json.dumps(manifest))
    spec = tmp_path / "ablation.yaml"
    spec.write_text("proxy_config: tests/configs/qwen3_micro.yaml\ntokens: 384\nseeds: [1, 2]\ntasks: [arc_easy]\n"
                    "task_limit: 4\nvariants:\n  code_heavy: {stdlib_code: 0.8, stdlib_docs: 0.2}\n"
                    "  docs_only: {stdlib_docs: 1.0}\n")
    return root, tmp_path / "runs", spec, manifest


def test_a_variant_is_trained_per_seed_and_the_ranking_orders_by_task_bits_per_byte(data, monkeypatch):
    import assets.ablation
    from assets.ablation import ablation_ranking, ablation_run
    from pipelines.definitions import resources
    from resources.storage import KilnStorage

    root, runs, spec_path, manifest = data
    monkeypatch.setattr(assets.ablation, "ABLATION_SPEC", str(spec_path))
    storage = KilnStorage(data_root=str(root), runs_root=str(runs))
    with dg.instance_for_test() as instance:
        # code_heavy through its partition (a process of its own), docs_only here
        result = dg.materialize([ablation_run], partition_key="code_heavy", instance=instance,
                                resources=resources(storage=storage))
        (event,) = result.asset_materializations_for_node("ablation_run")
        run_variant(AblationSpec.load(spec_path), "docs_only", manifest, root, runs.resolve())
        ranked = dg.materialize([ablation_ranking], instance=instance, resources=resources(storage=storage))
    code_heavy = json.loads((runs / "ablation/code_heavy/result.json").read_text())
    seeds = code_heavy["seeds"]
    assert [s["seed"] for s in seeds] == [1, 2] and all(s["steps"] == 3 for s in seeds)  # 384 / (4 x 32)
    assert seeds[0]["final_loss"] != seeds[1]["final_loss"]  # the seeds differ
    assert event.metadata["tasks_bpb"].value == pytest.approx((seeds[0]["tasks_bpb"] + seeds[1]["tasks_bpb"]) / 2)
    # the variant's blend: code 0.8, docs 0.2, in a manifest its runs' lineage names
    variant = json.loads((root / "blend/ablation/code_heavy.json").read_text())
    assert [round(s["weight"], 6) for s in variant["sources"]] == [0.8, 0.2]
    lineage = json.loads((runs / "ablation/code_heavy/seed1/checkpoints/iteration_00000003/lineage.json").read_text())
    assert "inputs" in lineage or lineage["manifest"]["path"] == "blend/ablation/code_heavy.json"
    # the ranking: both variants, best (lowest mean task bpb) first, with the spread over seeds
    results = [code_heavy, json.loads((runs / "ablation/docs_only/result.json").read_text())]
    rows = rank(results)
    assert [r["tasks_bpb"] for r in rows] == sorted(r["tasks_bpb"] for r in rows)
    assert rows[[r["variant"] for r in rows].index("code_heavy")]["tasks_bpb_spread"] == pytest.approx(
        abs(seeds[0]["tasks_bpb"] - seeds[1]["tasks_bpb"]))
    (event,) = ranked.asset_materializations_for_node("ablation_ranking")
    table = event.metadata["ranking"].value
    assert table.splitlines()[2].startswith(f"| 1 | {rows[0]['variant']} | 2 | {rows[0]['tasks_bpb']:.4f} (")
    assert event.metadata["not_run"].value == "balanced"  # the shipped spec's partitions: one not run here


def test_a_variant_naming_a_source_the_blend_lacks_is_refused(data):
    root, runs, spec_path, manifest = data
    spec = AblationSpec.load(spec_path)
    spec.variants["typo"] = {"stdlib_cod": 1.0}
    with pytest.raises(ValueError, match=r"variant typo: source\(s\) stdlib_cod are not in the blend manifest "
                                         r"\(its sources: stdlib_code, stdlib_docs\)"):
        run_variant(spec, "typo", manifest, root, runs)
