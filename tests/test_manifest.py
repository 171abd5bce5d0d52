import json

import pytest

from training.data.manifest import ManifestError, build_manifest, load_manifest, training_data_path


def shard(root, name, tokens):
    return {"prefix": str(root / "shards" / name / f"{name}_text_document"), "tokens": tokens,
            "bin_sha256": "b" * 64, "idx_sha256": "i" * 64}


def make(root, weights=(3, 1), tokens=((100,), (50, 150))):
    sources = [{"name": f"s{i}", "weight": w, "shards": [shard(root, f"s{i}_{j}", t) for j, t in enumerate(ts)],
                "raw_files": [{"path": f"raw/s{i}/part-00000.jsonl", "sha256": "r" * 64}]}
               for i, (w, ts) in enumerate(zip(weights, tokens))]
    return build_manifest(sources=sources, tokenizer={"path": str(root / "tokenizer/kiln.model"), "sha256": "t" * 64},
                          seq_length=32, split="98,2,0", seed=1, data_root=root)


def test_weights_normalized_and_split_over_shards_by_tokens(tmp_path):
    m = make(tmp_path)
    assert [s["weight"] for s in m["sources"]] == [0.75, 0.25]
    assert m["data_path"] == [0.75, "shards/s0_0/s0_0_text_document", 0.0625, "shards/s1_0/s1_0_text_document",
                              0.1875, "shards/s1_1/s1_1_text_document"]
    assert m["tokenizer"]["path"] == "tokenizer/kiln.model"
    assert sum(m["data_path"][::2]) == pytest.approx(1.0)


def test_paths_resolve_against_a_moved_root(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(make(tmp_path)))
    moved = tmp_path / "elsewhere"
    assert training_data_path(load_manifest(path, moved), moved)[1] == str(moved.resolve() / "shards/s0_0/s0_0_text_document")


def test_path_escaping_the_root_is_rejected(tmp_path):
    m = make(tmp_path)
    m["data_path"][3] = "../../etc/passwd"
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"data_path\[3\]: \.\./\.\./etc/passwd is outside the data root"):
        load_manifest(path, tmp_path)
    with pytest.raises(ManifestError, match="outside the data root"):
        build_manifest(sources=[{"name": "x", "weight": 1, "shards": [{"prefix": "/etc/x", "tokens": 1}]}],
                       tokenizer={"path": str(tmp_path / "t.model")}, seq_length=8, split="1", seed=0,
                       data_root=tmp_path)


@pytest.mark.parametrize("weight", [0, 0.0, -1, float("nan"), float("inf"), True, "1"])
def test_a_weight_that_is_not_a_positive_number_is_refused_naming_the_source(tmp_path, weight):
    """Weight 0 beside a positive one would reach training's data_path as a weight 0 it refuses."""
    with pytest.raises(ManifestError, match=rf"^source 's0': weight must be a number > 0, got {weight!r}"):
        make(tmp_path, weights=(weight, 1))


def test_a_shard_without_tokens_is_refused_naming_it(tmp_path):
    """Its share of the source's weight, in proportion to its tokens, would be a weight 0 in data_path."""
    with pytest.raises(ManifestError, match=r"^source 's1': shard shards/s1_0/s1_0_text_document has no tokens"):
        make(tmp_path, tokens=((100,), (0, 150)))
    assert all(w > 0 for w in make(tmp_path, tokens=((100,), (1, 150)))["data_path"][::2])
