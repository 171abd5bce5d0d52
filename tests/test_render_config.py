"""`training_run`'s rendered config takes seq_length, split and seed from the blend manifest, the one place they
are set: a training YAML (or an override) that sets another value is refused naming both."""
import dagster as dg
import pytest
import yaml

from assets.data import BlendConfig
from assets.training import TrainingRunConfig, render_training_config
from conftest import MICRO_CONFIG, PROJECT_ROOT
from resources.storage import KilnStorage
from training.atomic import write_json_atomic
from training.config import load_config
from training.data.manifest import build_manifest, load_manifest

SHIPPED = ["configs/qwen3_tiny.yaml", "configs/deepseek_v3_tiny.yaml"]


def storage_with_manifest(tmp_path, seq_length, split, seed) -> KilnStorage:
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(tmp_path / "sources.yaml"))
    shard = {"prefix": str(storage.root / "shards/a/a_text_document"), "tokens": 1000}
    manifest = build_manifest(
        sources=[{"name": "a", "weight": 1.0, "shards": [shard]}],
        tokenizer={"path": str(storage.root / "tokenizer/kiln.model"), "sha256": "0" * 64,
                   "special_ids": {"pad": 0, "eos": 2, "eod": 2}},
        seq_length=seq_length, split=split, seed=seed, data_root=storage.root)
    storage.manifest_path().parent.mkdir(parents=True)
    write_json_atomic(storage.manifest_path(), manifest)
    return storage


def render(storage, config_path, overrides=()):
    rendered, _ = render_training_config(TrainingRunConfig(config_path=str(config_path), run_name="r",
                                                           overrides=list(overrides)), storage, "CPU",
                                         load_manifest(storage.manifest_path(), storage.root))
    return rendered


@pytest.mark.parametrize("config_path", SHIPPED)
def test_shipped_yamls_train_with_the_manifests_settings(tmp_path, config_path):
    shipped = yaml.safe_load((PROJECT_ROOT / config_path).read_text())
    data = shipped["train_dataset"]["dataloader"]["config"]
    assert not {"seq_length", "split", "seed"} & set(data) and "seq_length" not in shipped["model"]
    storage = storage_with_manifest(tmp_path, 64, "90,10,0", 7)
    rendered = render(storage, config_path)
    assert {k: rendered["train_dataset"]["dataloader"]["config"][k] for k in ("seq_length", "split", "seed")} == {
        "seq_length": 64, "split": "90,10,0", "seed": 7}
    assert rendered["model"]["seq_length"] == 64
    # the rendered file is what the workers load: it validates, with the manifest's values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(rendered))
    loaded = load_config(path).train_dataset.dataloader.config
    assert (loaded.seq_length, loaded.split, loaded.seed) == (64, "90,10,0", 7)


def test_blend_defaults_fit_the_shipped_models(tmp_path):
    """BlendConfig's defaults are what a first run of each shipped config trains with."""
    blend = BlendConfig()
    storage = storage_with_manifest(tmp_path, blend.seq_length, blend.split, blend.seed)
    for config_path in SHIPPED:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(render(storage, config_path)))
        config = load_config(path)
        assert config.train_dataset.dataloader.config.seq_length <= config.model["max_position_embeddings"]


def test_a_yaml_value_equal_to_the_manifests_is_accepted(tmp_path):
    micro = yaml.safe_load((PROJECT_ROOT / MICRO_CONFIG).read_text())  # seq_length 32 twice, split "98,2,0"
    assert micro["model"]["seq_length"] == micro["train_dataset"]["dataloader"]["config"]["seq_length"] == 32
    rendered = render(storage_with_manifest(tmp_path, 32, "98,2,0", 1234), MICRO_CONFIG)
    assert rendered["train_dataset"]["dataloader"]["config"]["seq_length"] == 32


@pytest.mark.parametrize("key, value, manifest_value", [
    ("train_dataset.dataloader.config.seq_length", 256, 128),
    ("model.seq_length", 256, 128),
    ("train_dataset.dataloader.config.split", "90,10,0", "98,2,0"),
    ("train_dataset.dataloader.config.seed", 5, 1234),
])
def test_a_yaml_value_other_than_the_manifests_is_refused_naming_both(tmp_path, key, value, manifest_value):
    data = yaml.safe_load((PROJECT_ROOT / SHIPPED[0]).read_text())
    node = data
    *sections, last = key.split(".")
    for section in sections:
        node = node[section]
    node[last] = value
    config_path = tmp_path / "mine.yaml"
    config_path.write_text(yaml.safe_dump(data))
    storage = storage_with_manifest(tmp_path, 128, "98,2,0", 1234)
    with pytest.raises(dg.Failure) as raised:
        render(storage, config_path)
    message = raised.value.description
    assert message.startswith(f"{config_path}: {key} is {value!r}, but the blend manifest "
                              f"{storage.manifest_path()} was built with ")
    assert f"{manifest_value!r}" in message and f"drop {key} from {config_path}" in message
    assert "re-materialize blend_manifest" in message


def test_an_override_other_than_the_manifests_is_refused(tmp_path):
    storage = storage_with_manifest(tmp_path, 128, "98,2,0", 1234)
    with pytest.raises(dg.Failure, match=r"^training_run config overrides: train_dataset\.dataloader\.config\."
                                         r"seq_length is 64, but the blend manifest .* seq_length 128"):
        render(storage, SHIPPED[0], ["train_dataset.dataloader.config.seq_length=64"])
    assert render(storage, SHIPPED[0], ["train_dataset.dataloader.config.seq_length=128"])
