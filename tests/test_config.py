import re

import pytest

from training.config import ConfigError, TrainConfig, apply_overrides, load_config
from training.parallel.mesh import ParallelDims

MINIMAL = {
    "model": {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "compute_dtype": "float32"},
    "lr_scheduler": {"type": "ConstantWarmUpLR"},
    "train_dataset": {"dataloader": {"type": "BlendedMegatronDatasetDataLoader",
                                     "config": {"seq_length": 8, "data_path": [1.0, "/d/a"], "eod": 2}}},
    "checkpoint": {"save_path": "/tmp/x"},
}


def parse(**sections):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in MINIMAL.items()}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return TrainConfig.from_dict(data)


def test_defaults_follow_mindformers():
    cfg = parse()
    assert cfg.checkpoint.save_max == 5 and cfg.checkpoint.prefix == "checkpoint"
    assert cfg.training.seed == 42 and cfg.training.max_norm == 1.0
    assert cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.parallelism.data_parallel_shard == -1
    assert cfg.context.device_target == "Ascend"


def test_unknown_key_names_path_and_nearest():
    with pytest.raises(ConfigError, match=r"training\.global_batchsize: unknown key; did you mean 'global_batch_size'"):
        parse(training={"global_batchsize": 8})
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.config\.seq_len: .*'seq_length'"):
        TrainConfig.from_dict({**MINIMAL, "train_dataset": {"dataloader": {
            "type": "BlendedMegatronDatasetDataLoader", "config": {"seq_len": 8, "data_path": [1, "a"]}}}})
    with pytest.raises(ConfigError, match="traning: unknown top-level section; did you mean 'training'"):
        TrainConfig.from_dict({**MINIMAL, "traning": {}})


def test_type_errors_name_path_type_and_value():
    with pytest.raises(ConfigError, match=r"training\.steps: expected int, got 10\.5"):
        parse(training={"steps": 10.5})
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save: expected bool, got 'yes'"):
        parse(checkpoint={"async_save": "yes"})


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    import yaml
    data = {**MINIMAL, "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": "3e-4"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data).replace("'3e-4'", "3e-4"))
    assert load_config(path).lr_scheduler.learning_rate == pytest.approx(3e-4)


def test_unsupported_non_default_is_an_error():
    with pytest.raises(ConfigError, match=r"parallelism\.pipeline_parallel_overlap_p2p = True is not supported yet"):
        parse(parallelism={"pipeline_parallel_overlap_p2p": True})
    assert not parse(parallelism={"pipeline_parallel_overlap_p2p": False}).parallelism.pipeline_parallel_overlap_p2p


def test_batch_sizes_must_divide():
    cfg = parse(training={"global_batch_size": 8, "local_batch_size": 2})
    assert ParallelDims.from_config(cfg.parallelism, 2).check_batch(cfg.training) == 2
    smaller = parse(training={"global_batch_size": 6, "local_batch_size": 2})
    with pytest.raises(ConfigError, match="global_batch_size=6 is not divisible by .*local_batch_size=2 × data_parallel=4"):
        ParallelDims.from_config(smaller.parallelism, 4).check_batch(smaller.training)


def test_missing_required_model_fields():
    with pytest.raises(ConfigError, match="model.architectures is required"):
        TrainConfig.from_dict({**MINIMAL, "model": {"model_type": "qwen3"}})


def test_overrides_apply_before_validation(tmp_path):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = load_config(path, ["training.steps=20", "optimizer.betas=[0.8, 0.9]"])
    assert cfg.training.steps == 20 and cfg.optimizer.betas == [0.8, 0.9]
    with pytest.raises(ConfigError, match="training.steps: expected int"):
        load_config(path, ["training.steps=many"])
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(path)


def dataloader(section):
    return TrainConfig.from_dict({**MINIMAL, "train_dataset": {"dataloader": section}})


def test_dataloader_schema_follows_its_type():
    from training.config import MindDatasetLoaderConfig

    config = dataloader({"type": "MindDataset", "dataset_files": ["/r/a.mindrecord"], "shuffle": True})
    loader = config.train_dataset.dataloader
    assert isinstance(loader, MindDatasetLoaderConfig) and loader.shuffle is True and config.data_seed == 1234
    assert dataloader({"type": "MindDataset", "dataset_files": "/r"}).train_dataset.dataloader.shuffle is False
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.type = 'HFDataLoader' is not supported"):
        dataloader({"type": "HFDataLoader"})
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.data_path: unknown key"):
        dataloader({"type": "MindDataset", "dataset_files": "/r", "data_path": []})
    # MindFormers' DataloaderConfig types shuffle as bool (MultiSourceDataLoader's mode names are no MindDataset's)
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.shuffle: expected bool, got 'infile'"):
        dataloader({"type": "MindDataset", "dataset_files": "/r", "shuffle": "infile"})


@pytest.mark.parametrize("key, value, new", [("dataset_ratios", [1.0], "kiln.mindrecord.dataset_ratios"),
                                             ("samples_count", 3, "kiln.mindrecord.samples_count"),
                                             ("nums_per_dataset", [3], "kiln.mindrecord.nums_per_dataset"),
                                             ("shuffle_buffer_size", 8, "kiln.mindrecord.shuffle_buffer_size"),
                                             ("seed", 3, "kiln.mindrecord.seed"), ("pad", 0, "kiln.mindrecord.pad")])
def test_a_mind_dataset_section_holds_what_mindspores_mind_dataset_takes(key, value, new):
    with pytest.raises(ConfigError, match=rf"^train_dataset\.dataloader\.{key} is Kiln's own setting and moved to "
                                          rf"{re.escape(new)}: MindFormers refuses keys"):
        dataloader({"type": "MindDataset", "dataset_files": "/r", key: value})
    with pytest.raises(ConfigError, match=r"^train_dataset\.dataloader\.eod is no longer read: a MindDataset item's "
                                          r"labels, loss mask and positions come from input_ids alone"):
        dataloader({"type": "MindDataset", "dataset_files": "/r", "eod": 2})


def test_reset_attention_mask_needs_a_mask():
    config = {"seq_length": 8, "data_path": [1.0, "/d/a"], "eod": 2, "reset_attention_mask": True,
              "create_attention_mask": False}
    with pytest.raises(ConfigError, match=r"config\.reset_attention_mask needs create_attention_mask"):
        dataloader({"type": "BlendedMegatronDatasetDataLoader", "config": config})
    config["create_compressed_eod_mask"] = True
    assert dataloader({"type": "BlendedMegatronDatasetDataLoader", "config": config}
                      ).train_dataset.dataloader.config.document_attention
