"""The cleaning on a Ray cluster of two nodes started as processes on 127.0.0.1 (`ray start --head`, then a
worker node joining it): the same output as a local run, byte for byte; an unreachable address in one line."""
import json
import random
from pathlib import Path

import pytest

pytest.importorskip("ray")

from benchmarks.ray_cluster import free_port, local_ray_cluster  # noqa: E402
from test_cleaning import vocabulary, words  # noqa: E402
from training.data.cleaning.pipeline import CleaningError, RawInput  # noqa: E402
from training.data.cleaning.recipe import load_recipe  # noqa: E402
from training.data.cleaning.runners import LocalRunner, RayRunner, clean_chunks  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(nodes=2) as address:
        yield address


def chunks(tmp_path: Path) -> list[list[Path]]:
    rng = random.Random(5)
    vocab = vocabulary(rng)
    texts = [" ".join(words(rng, 150, vocab)) + "." for _ in range(40)]
    near = texts[7].split()
    near[70] = "changed"
    files = []
    for i, part in enumerate((texts[:20], texts[20:] + [texts[3], " ".join(near), "short"])):
        path = tmp_path / "raw" / f"c{i}" / "part-00000.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        files.append([path])
    return files


def test_ray_cleaning_is_byte_identical_to_local(tmp_path, ray_cluster):
    recipe = load_recipe({"steps": [{"length": {"min_chars": 10}}, "gopher_repetition"]})
    inputs = [(f"c{i}", tuple(RawInput(p, p.name) for p in paths)) for i, paths in enumerate(chunks(tmp_path))]
    clean_chunks(LocalRunner(), recipe, inputs, tmp_path / "local")
    clean_chunks(RayRunner(ray_cluster), recipe, inputs, tmp_path / "ray")
    local = sorted(p.relative_to(tmp_path / "local" / "clean") for p in (tmp_path / "local" / "clean").rglob("*.*"))
    assert len(local) == 6  # per chunk: cleaned JSONL, removals.jsonl, c<i>.kiln.json
    for name in local:
        assert (tmp_path / "ray" / "clean" / name).read_bytes() == (tmp_path / "local" / "clean" / name).read_bytes()
    removed = [json.loads(l) for l in (tmp_path / "ray/clean/c1/removals.jsonl").read_text().splitlines()]
    assert [(e["line"], e.get("step")) for e in removed if not e["kept"]] == [
        (21, "exact_dedup"), (22, "minhash_dedup"), (23, "length")]


def test_an_unreachable_ray_address_is_one_line(tmp_path):
    with pytest.raises(CleaningError) as caught:
        RayRunner(f"127.0.0.1:{free_port()}")
    assert "\n" not in str(caught.value) and "the Ray cluster at '127.0.0.1:" in str(caught.value)


def test_clean_corpus_pointed_at_the_cluster_writes_what_it_writes_locally(tmp_path, ray_cluster):
    import dagster as dg

    from assets.chunks import register_source_chunks
    from test_clean_corpus import materialize, setup

    outputs = {}
    on_ray = {"ops": {"clean_corpus": {"config": {"ray_address": ray_cluster}}}}
    for where, run_config in (("local", None), ("ray", on_ray)):
        storage, resources = setup(tmp_path / where)
        with dg.instance_for_test() as instance:
            keys = register_source_chunks(instance, storage)
            materialize(instance, resources, "raw_corpus", keys)
            assert materialize(instance, resources, "clean_corpus", keys, run_config=run_config).success
        root = storage.root / "clean"
        outputs[where] = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert len(outputs["local"]) == 2 * 3 + 2 * 6  # per chunk: 3 outputs; its filter stage: 6 files
    assert outputs["ray"] == outputs["local"]
