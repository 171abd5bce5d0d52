"""`model:` is validated before launch: model.seq_length against the samples' length in load_config, the
model's own fields, its positions and the tokenizer's vocabulary in validate_model_section, which the
training_run asset and `python -m training.run` call before any worker starts."""
from pathlib import Path

import dagster as dg
import pytest
import sentencepiece
import yaml

from conftest import MICRO_CONFIG
from pipelines.chain import config_for, materialize_chain
from pipelines.definitions import ALL_ASSETS
from resources.msrun import MsrunResource
from test_chain import chain_resources, training_config
from training.config import ConfigError, load_config
from training.model import validate_model_section
from training.run import main as train_main

DATA = "train_dataset.dataloader.config"


def micro_config(tmp_path, **model):
    """The micro test config with save path and data filled in, its model section updated by ``model``."""
    data = yaml.safe_load((Path(__file__).resolve().parent.parent / MICRO_CONFIG).read_text())
    data["checkpoint"]["save_path"] = str(tmp_path / "ckpt")
    data["train_dataset"]["dataloader"]["config"].update(data_path=[str(tmp_path / "shard")], eod=0)
    data["model"].update(model)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_micro_config_validates_as_is(tmp_path):
    assert validate_model_section(load_config(micro_config(tmp_path))).vocab_size == 512


def test_model_seq_length_must_equal_the_samples_length_at_load_config(tmp_path):
    with pytest.raises(ConfigError, match=rf"model\.seq_length \(16\) differs from {DATA}\.seq_length \(32\)"):
        load_config(micro_config(tmp_path, seq_length=16))


@pytest.mark.parametrize("model,message", [
    ({"num_hidden_layer": 2}, r"model\.num_hidden_layer: unknown key; did you mean 'num_hidden_layers'\?"),
    ({"hidden_size": "64"}, r"model\.hidden_size: expected int, got '64'"),
    ({"num_key_value_heads": 3}, r"model\.num_attention_heads \(4\) must be a multiple of model\.num_key_value_heads"),
    ({"architectures": "DeepseekV3ForCausalLM"}, r"model\.architectures = 'DeepseekV3ForCausalLM' does not match"),
])
def test_a_bad_model_field_is_named_before_launch(tmp_path, model, message):
    config = load_config(micro_config(tmp_path, **model))
    with pytest.raises(ConfigError, match=message):
        validate_model_section(config)
    assert train_main(["--config", str(micro_config(tmp_path, **model))]) == 2


def test_samples_longer_than_the_model_s_positions_are_refused_naming_both(tmp_path):
    path = micro_config(tmp_path)
    config = load_config(path, [f"{DATA}.seq_length=48", "model.seq_length=48", "model.max_position_embeddings=40"])
    with pytest.raises(ConfigError, match=r"model\.seq_length \(48\) exceeds model\.max_position_embeddings \(40\)"):
        validate_model_section(config)
    # model.seq_length unset: it is the samples' length, bounded by the positions
    data = yaml.safe_load(path.read_text())
    del data["model"]["seq_length"]
    path.write_text(yaml.safe_dump(data))
    config = load_config(path, [f"{DATA}.seq_length=80"])
    assert config.model["seq_length"] == 80
    with pytest.raises(ConfigError, match=r"model\.seq_length \(80\) exceeds model\.max_position_embeddings \(64\)"):
        validate_model_section(config)


def _tokenizer(tmp_path, vocab_size: int):
    lines = [f"line {i} with words {i * 7} and more {i % 13} text" for i in range(2000)]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "spm"),
                                             vocab_size=vocab_size, hard_vocab_limit=True)
    return tmp_path / "spm.model"


def test_a_tokenizer_larger_than_model_vocab_size_is_refused_by_the_cli(tmp_path, capsys):
    tokenizer = _tokenizer(tmp_path, 300)
    config = micro_config(tmp_path, vocab_size=256)
    with pytest.raises(ConfigError, match=r"model\.vocab_size = 256 is smaller than the vocabulary of the tokenizer "
                                          r"the data was tokenized with \(300 ids"):
        validate_model_section(load_config(config), tokenizer)
    assert train_main(["--config", str(config), "--tokenizer-model", str(tokenizer)]) == 2
    assert "model.vocab_size = 256" in capsys.readouterr().err
    validate_model_section(load_config(micro_config(tmp_path, vocab_size=300)), tokenizer)


def test_the_training_run_asset_refuses_a_model_smaller_than_the_tokenizer_before_msrun(tmp_path, micro_sources,
                                                                                         monkeypatch):
    res = chain_resources(tmp_path, micro_sources)  # a 512-id tokenizer
    launched = []
    monkeypatch.setattr(MsrunResource, "run", lambda *args, **kwargs: launched.append(args))
    with dg.instance_for_test() as instance:
        materialize_chain(instance, res, training_config(), through="blend_manifest")
        with pytest.raises(dg.Failure) as failure:
            dg.materialize(ALL_ASSETS, selection=["training_run"], instance=instance, resources=res,
                           run_config=config_for("training_run", training_config(overrides=["model.vocab_size=500"])))
    assert "model.vocab_size = 500 is smaller than the vocabulary of the tokenizer" in failure.value.description
    assert "(512 ids" in failure.value.description
    assert not launched
