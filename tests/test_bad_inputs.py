"""The bad-input matrix: one table, BAD_INPUTS, of (bad input, what the refusal must say), so none of them comes
back. An input is a config file's text with overrides ("config"), a parallel layout on a number of workers
("layout"), a name that would leave its root ("name"), or a training.run command line ("run"); each must be
refused before anything is built (an alias bomb is refused on the composed nodes, which alias rather than copy),
in one report holding the fragment (a regular expression), of bounded size.
The sub-tables group the cases by issue point; the one test below runs them all."""
import re

import pytest
import yaml

from conftest import MICRO_CONFIG, PROJECT_ROOT
from training.config import ConfigError, load_config
from training.model import model_config

WIRED = ["train_dataset.dataloader.config.data_path=[1.0, /data/a]", "train_dataset.dataloader.config.eod=2",
         "checkpoint.save_path=/tmp/kiln-checkpoints"]
MICRO = (PROJECT_ROOT / MICRO_CONFIG).read_text()
# 9 levels of 10 aliases each: 10^9 values from 1 KB of YAML
ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))

# 111,110 values from five nested aliases: under the bound, so it is loaded, and an error echoes little of it
NESTED_ALIASES = "[&a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(
    f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 5)) + "]"


def text(*lines: str) -> tuple[str, list[str]]:
    """A case whose file is the micro config followed by ``lines``."""
    return MICRO + "\n".join(lines) + "\n", WIRED


def overrides(*items: str) -> tuple[str, list[str]]:
    return MICRO, [*WIRED, *items]


CASES = {
    # YAML itself (issue 36)
    "a key given twice": (text("training:", "  steps: 4"),
                          r"qwen3_micro_case\.yaml:\d+: training is given twice \(first at line 2\)"),
    "a nested key given twice": (("training:\n  steps: 2\n  steps: 4\n" + MICRO.split("\n", 1)[1], WIRED),
                                 r":3: training\.steps is given twice \(first at line 2\)"),
    "an alias bomb": ((ALIAS_BOMB, []), r"its aliases expand it to [\d,]+ values, more than the 1,000,000"),
    "aliases under the bound, under a checked key": (overrides(f"training.steps={NESTED_ALIASES}"),
                                                       r"training\.steps: expected int, got \[\[.*\(list, cut\)$"),
    "a long value": (overrides("training.steps=" + "9" * 1_000_000 + "x"),
                     r"training\.steps: expected int, got '9{10,}\.\.\.9+x'$"),
    "invalid YAML": (text("training: [1"), r"qwen3_micro_case\.yaml:\d+: invalid YAML"),
    "mappings nested past MindFormers' bound": (text("kiln: " + "{a: " * 11 + "1" + "}" * 11),
                                                r"its mappings nest 12 deep, more than the 10 MindFormers' loader"),
    "lists nested past any reader": (text("callbacks: " + "[" * 5000 + "]" * 5000),
                                     r"nested too deeply for a YAML reader"),
    # numbers past sane bounds, refused before numpy or MindSpore meets them (issue 36)
    "steps 1e30": (overrides("training.steps=1000000000000000000000000000000"),
                   r"training\.steps: 1000000000000000000000000000000 does not fit in 64 bits"),
    "steps 1e12": (overrides("training.steps=1000000000000"),
                   r"training\.steps = 1,000,000,000,000 is more than 1,000,000,000: a billion steps"),
    "steps as a float 1e30": (overrides("training.steps=1.0e+30"), r"training\.steps: expected int, got 1e\+30"),
    "a learning rate of inf": (overrides("lr_scheduler.learning_rate=.inf"),
                               r"lr_scheduler\.learning_rate: expected a finite number, got inf"),
    "hidden 2^40": (overrides(f"model.hidden_size={2**40}"),
                    r"model\.hidden_size = 1,099,511,627,776 is more than 131,072: wider than any model trained"),
    "vocab 1e12": (overrides("model.vocab_size=1000000000000"),
                   r"model\.vocab_size = 1,000,000,000,000 is more than 2,147,483,647: token ids are int32"),
    "a model of petabytes": (overrides("model.hidden_size=131072", "model.intermediate_size=1048576",
                                       "model.num_hidden_layers=4096"),
                             r"model: about [\d.]+e\+15 parameters .* more than 2\.2e\+12"),
    "a seed numpy cannot take": (overrides("training.seed=4294967296"),
                                 r"training\.seed = 4,294,967,296 is more than 4,294,967,295: numpy's seeds are 32-bit"),
    "a billion samples per step": (overrides("training.global_batch_size=1000000000"),
                                   r"training\.global_batch_size = 1,000,000,000 is more than 16,777,216"),
    "too many samples": (overrides("training.steps=1000000000", "training.global_batch_size=1024",
                                   "training.local_batch_size=1024"),
                         r"training\.steps × training\.global_batch_size = 1,024,000,000,000 samples, more than "
                         r"68,719,476,736"),
    "a sample of a billion tokens": (overrides("train_dataset.dataloader.config.seq_length=1000000000",
                                               "model.seq_length=1000000000"),
                                     r"train_dataset\.dataloader\.config\.seq_length = 1,000,000,000 is more than"),
}

# the silent cases of issue 36: an error where the config contradicts itself (with the message), a warning
# where it is allowed but likely not meant (TrainConfig.warnings, logged by training.run and training_run)
SILENT = {
    "lr_end above the learning rate": (["lr_scheduler.lr_end=0.01"], r"lr_scheduler\.lr_end \(0\.01\) is above "
                                       r"lr_scheduler\.learning_rate \(0\.003\): the decay would raise"),
    "warm-up from above the learning rate": (["lr_scheduler.warmup_lr_init=0.01"],
                                             r"warmup_lr_init \(0\.01\) is above .*the warm-up would lower"),
    "runner_config": (["runner_config={epochs: 2}"], r"runner_config: unknown top-level section: a section of MindFormers' graph-mode YAML, "
                                                    r"which its PyNative trainer \(and Kiln\) does not read; its "
                                                    r"settings go in training \(steps"),
    "a typo far from any key": (["training.runner=3"], r"training\.runner: unknown key; valid keys: "),
}
WARNED = {
    "warm-up longer than the run": (["lr_scheduler.warmup_steps=10"], "lr_scheduler.warmup_steps (10) is more than "
                                    "training.steps (6): the run ends in warm-up"),
    "sequence parallel without tensor parallel": (["parallelism.sequence_parallel=true"],
                                                  "parallelism.sequence_parallel: true has no effect"),
}


@pytest.mark.parametrize("case", WARNED, ids=list(WARNED))
def test_a_config_allowed_but_likely_not_meant_is_warned_about(case):
    sets, warning = WARNED[case]
    assert load_config(PROJECT_ROOT / MICRO_CONFIG, WIRED).warnings() == []
    assert [w for w in load_config(PROJECT_ROOT / MICRO_CONFIG, [*WIRED, *sets]).warnings()
            if w.startswith(warning)]


TP2 = ["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=true"]
PP2 = ["parallelism.pipeline_parallel=2"]
INTERLEAVED = [*PP2, "parallelism.pipeline_parallel_interleave_num=2",
               "parallelism.pipeline_parallel_schedule=interleaved_1f1b"]
# (overrides, workers) -> the arithmetic the refusal names; checked as training_run and training.run check it
LAYOUTS = {
    "tp 3 on 2 workers": ((["parallelism.tensor_parallel=3", "parallelism.sequence_parallel=true"], 2),
                          r"tensor_parallel 3 × pipeline_parallel 1 × context_parallel 1 = 3 does not divide the 2 "
                          r"workers"),
    "tp 2 with 1 KV head": (([*TP2, "model.num_key_value_heads=1"], 2),
                            r"parallelism\.tensor_parallel \(2\) must divide model\.num_key_value_heads \(1\): "
                            r"linear_qkv is split by whole query groups"),
    "tp 2 with an odd vocabulary": (([*TP2, "model.vocab_size=511"], 2),
                                    r"must divide model\.vocab_size \(511\)"),
    "interleave 2 on 2 layers": ((INTERLEAVED, 2),
                                 r"'auto' splits the 2 decoder layers equally over pipeline_parallel 2 × "
                                 r"pipeline_parallel_interleave_num 2 = 4 virtual stages"),
    "interleaved 1F1B with 1 micro-batch": (([*INTERLEAVED, "model.num_hidden_layers=4", "training.global_batch_size=2"],
                                             2), r"interleaved_1f1b needs the micro-batches per step \(1: "
                                                 r"global_batch_size / \(local_batch_size × data parallel\)\) to be a "
                                                 r"multiple of pipeline_parallel \(2\)"),
    "interleaved 1F1B without interleaving": (([*PP2, "parallelism.pipeline_parallel_schedule=interleaved_1f1b"], 2),
                                              r"interleaved_1f1b needs pipeline_parallel_interleave_num > 1"),
    # what the trainer refused only once each rank built its pipeline (issue 36)
    "local_norm under a pipeline": (([*PP2, "monitor.train_state.local_norm=true"], 2),
                                    r"^monitor\.train_state\.local_norm with parallelism\.pipeline_parallel > 1 "
                                    r"is not implemented"),
    "max_attention_logit under a pipeline": (([*PP2, "kiln.train_state.max_attention_logit=true"], 2),
                                             r"kiln\.train_state\.max_attention_logit with parallelism\."
                                             r"pipeline_parallel > 1 is not implemented"),
    "interleaving without a pipeline": ((["parallelism.pipeline_parallel_interleave_num=2"], 1),
                                        r"pipeline_parallel_interleave_num = 2 splits .* but "
                                        r"parallelism\.pipeline_parallel is 1"),
    "layer ranges past the model": (([*PP2, "parallelism.pipeline_parallel_layers_per_stage=['0-0', '1-5']"], 2),
                                    r"the stages cover layers 0-5; the model has 2"),
    "layer ranges with a gap": (([*PP2, "parallelism.pipeline_parallel_layers_per_stage=['0-0', '2-2']"], 2),
                                r"virtual stage 1 \(rank 1, local stage 0\) starts at layer 2, expected 1"),
    "cp 3 on a sequence of 32": ((["parallelism.context_parallel=3"], 3),
                                 r"the sequence length 32 does not split into parallelism\.context_parallel = 3"),
    "ep on a dense model": ((["parallelism.expert_parallel=2"], 2),
                            r"parallelism\.expert_parallel is 2 but the model has no routed experts"),
    "a batch the ranks cannot share": ((["training.global_batch_size=6"], 2),
                                       r"training\.global_batch_size=6 is not divisible by training\.local_batch_size=2 "
                                       r"× data_parallel=2"),
    "two layout mistakes at once": (([*TP2, "model.num_key_value_heads=1", "parallelism.expert_parallel=2"], 2),
                                    r"num_key_value_heads \(1\).*\n.*expert_parallel is 2"),
}


@pytest.mark.parametrize("config_path, sets, workers", [
    (MICRO_CONFIG, TP2, 2), (MICRO_CONFIG, PP2, 2), (MICRO_CONFIG, ["parallelism.context_parallel=2"], 2),
    (MICRO_CONFIG, [*INTERLEAVED, "model.num_hidden_layers=4"], 2), (MICRO_CONFIG, ["training.local_batch_size=1"], 4),
    # 1f1b over interleaved stages is interleaved_1f1b, as MindFormers upgrades it (and as the trainer runs it)
    (MICRO_CONFIG, [*INTERLEAVED[:2], "model.num_hidden_layers=4"], 2),
    ("tests/configs/deepseek_v3_micro.yaml", ["parallelism.expert_parallel=2"], 2)])
def test_the_layouts_the_suite_trains_pass_the_check(config_path, sets, workers):
    from training.launch import check_layout

    config = load_config(PROJECT_ROOT / config_path, [*WIRED, *sets], model_check=model_config)
    assert check_layout(config, model_config(config.model), workers).world == workers


def test_training_run_refuses_a_layout_on_every_rank_before_any_communicator_is_built(monkeypatch, capsys):
    from training.run import main as run

    # as msrun starts a worker: a communicator would wait for the other worker, which never comes
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MS_WORKER_NUM", "2")
    sets = [a for o in [*WIRED, "parallelism.tensor_parallel=3", "parallelism.sequence_parallel=true"]
            for a in ("--set", o)]
    monkeypatch.setattr("training.run._die_with_parent", lambda: None)
    assert run(["--config", str(PROJECT_ROOT / MICRO_CONFIG), *sets]) == 2
    assert "= 3 does not divide the 2 workers" in capsys.readouterr().err


# names that would leave their root: each entry point refuses them with the reason
NAMES = {
    "run_name ..": ("run", "..", r"training_run config run_name '\.\.': '\.\.' is the directory above, outside its root"),
    "run_name .": ("run", ".", r"run_name '\.': a name starting with '\.' is the root itself or a hidden directory"),
    "run_name with /": ("run", "a/b", r"run_name 'a/b': '/' would make it a path of several directories"),
    "init_from ../other": ("init_from", "../other", r"init_from '\.\./other': '/' would make it a path"),
    "source ../escape": ("source", "../escape", r"sources\.yaml: source '\.\./escape': '/' would make it a path"),
    "source ..": ("source", "..", r"source '\.\.': '\.\.' is the directory above"),
    "source with /": ("source", "web/news", r"source 'web/news': '/' would make it a path"),
    "source with a space": ("source", "web news", r"source 'web news': use letters, digits"),
    "chunk ../x": ("chunk", "../00001", r"chunk '\.\.': '\.\.' is the directory above"),
    "a run directory ..": ("run_dir", "..", r"run_name '\.\.': '\.\.' is the directory above"),
    "a source named twice": ("sources.yaml", "sources:\n  web: {builtin: stdlib_code}\n  web: {builtin: stdlib_code}\n",
                             r"sources\.yaml:3: sources\.web is given twice \(first at line 2\)"),
}


def _render_as(storage, fields):
    from assets.training import TrainingRunConfig, render_training_config
    from training.data.manifest import load_manifest

    config = TrainingRunConfig(config_path=MICRO_CONFIG, **{"run_name": "r", **fields})
    render_training_config(config, storage, "CPU", load_manifest(storage.manifest_path(), storage.root))


SHIPPED_MOCK = ("config error: configs/qwen3_tiny.yaml: train_dataset.dataloader.config.mock: true on a config that "
                "leaves its data to training_run (data_path: []): also set train_dataset.dataloader.config.data_path: "
                "null (mock data and a blend exclude each other), train_dataset.dataloader.config.seq_length, "
                "train_dataset.dataloader.config.eod and checkpoint.save_path (or checkpoint.enable_save: false)")
# training.run's command lines: the whole report, as the user reads it (issue 39's regressions among them)
RUNS = {
    "an unknown key with a shipped config's empty data_path": (
        ["--config", "configs/qwen3_tiny.yaml", "--set", "training.stepz=3"],
        r"^config error: configs/qwen3_tiny\.yaml: 2 problems:\n  - training\.stepz: unknown key; did you mean "
        r"'steps'\?\n  - train_dataset\.dataloader\.config\.data_path is empty: this config leaves"),
    "model keys in the same report": (
        ["--config", MICRO_CONFIG, *[a for o in WIRED for a in ("--set", o)], "--set", "optimizer.eps=-1",
         "--set", "model.hidden_sise=64", "--set", "model.num_attention_heads=0"],
        r"3 problems:\n  - model\.hidden_sise: unknown key; did you mean 'hidden_size'\?\n  - optimizer\.eps must be "
        r"> 0\n  - model\.num_attention_heads must be > 0, got 0$"),
    "mock data on a shipped config": (
        ["--config", "configs/qwen3_tiny.yaml", "--set", "train_dataset.dataloader.config.mock=true"],
        "^" + re.escape(SHIPPED_MOCK) + "$"),
}

ABLATION = "proxy_config: configs/qwen3_tiny.yaml\ntokens: 512\nvariants:\n  all: {web: 1.0}\n"
# the other YAML Kiln reads, through the training config's reader: an ablation spec, the model config import-hf and
# export-hf take (--config), a cleaning recipe file
OTHER_YAML = {
    "ablation spec: a key given twice": (("ablation", ABLATION + "tokens: 1024\n"),
                                         r"ablation\.yaml:5: tokens is given twice \(first at line 2\)"),
    "ablation spec: an alias bomb": (("ablation", ALIAS_BOMB), r"its aliases expand it to [\d,]+ values"),
    "ablation spec: a long value": (("ablation", ABLATION.replace("512", "9" * 1_000_000 + "x")),
                                    r"tokens must be an integer > 0, got '9{10,}\.\.\.9+x'$"),
    "ablation spec: one seed": (("ablation", ABLATION + "seeds: [1]\n"),
                                r"seeds must list two integers or more \(the spread over seeds\), got \[1\]$"),
    "import-hf --config: a key given twice": (("import-hf", "model:\n  hidden_size: 64\n  hidden_size: 32\n"),
                                              r"^kiln import-hf: .*\.yaml:3: model\.hidden_size is given twice "
                                              r"\(first at line 2\)"),
    "import-hf --config: an alias bomb": (("import-hf", ALIAS_BOMB), r"^kiln import-hf: .*its aliases expand it"),
    "cleaning recipe: a key given twice": (("recipe", "steps: []\nsteps: [{url_blocklist: {}}]\n"),
                                           r"recipe\.yaml:2: steps is given twice \(first at line 1\)"),
}

BAD_INPUTS = {
    **{name: ("config", given, fragment) for name, (given, fragment) in CASES.items()},
    **{name: ("config", overrides(*sets), fragment) for name, (sets, fragment) in SILENT.items()},
    **{name: ("layout", given, fragment) for name, (given, fragment) in LAYOUTS.items()},
    **{name: ("name", (kind, value), fragment) for name, (kind, value, fragment) in NAMES.items()},
    **{name: ("run", argv, fragment) for name, (argv, fragment) in RUNS.items()},
    **{name: ("other yaml", given, fragment) for name, (given, fragment) in OTHER_YAML.items()},
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_a_bad_input_is_refused_before_anything_is_built_naming_what_is_wrong(case, tmp_path, capsys):
    kind, given, fragment = BAD_INPUTS[case]
    message = REFUSALS[kind](given, tmp_path, capsys)
    assert len(message) < 4000, message[:4000]
    assert re.search(fragment, message, re.M), message


def refused_config(given, tmp_path, capsys) -> str:
    content, sets = given
    path = tmp_path / "qwen3_micro_case.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_config(path, sets, model_check=model_config)
    return str(raised.value)


def refused_layout(given, tmp_path, capsys) -> str:
    from training.launch import check_layout

    sets, workers = given
    config = load_config(PROJECT_ROOT / MICRO_CONFIG, [*WIRED, *sets], model_check=model_config)
    with pytest.raises(ConfigError) as raised:
        check_layout(config, model_config(config.model), workers)
    return str(raised.value)


def refused_name(given, tmp_path, capsys) -> str:
    import dagster as dg

    from assets.sources import SourcesConfigError, load_sources
    from resources.storage import KilnStorage
    from test_render_config import storage_with_manifest

    kind, name = given
    storage = KilnStorage(data_root=str(tmp_path / "data"), runs_root=str(tmp_path / "runs"),
                          sources_config=str(tmp_path / "sources.yaml"))
    with pytest.raises((ValueError, SourcesConfigError, dg.Failure)) as raised:
        if kind in ("run", "init_from"):
            fields = {"run_name": name} if kind == "run" else {"init_from": name, "start": "weights_only"}
            _render_as(storage_with_manifest(tmp_path, 32, "98,2,0", 1234), fields)
        elif kind == "source":
            (tmp_path / "sources.yaml").write_text(yaml.safe_dump({"sources": {name: {"builtin": "stdlib_code"}}}))
            load_sources(tmp_path / "sources.yaml")
        elif kind == "sources.yaml":
            (tmp_path / "sources.yaml").write_text(name)
            load_sources(tmp_path / "sources.yaml")
        elif kind == "chunk":
            storage.raw_dir(name)
        else:
            storage.run_dir(name)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    return getattr(raised.value, "description", None) or str(raised.value)


def refused_run(argv, tmp_path, capsys) -> str:
    from training.run import main as run

    assert run(argv) == 2
    return capsys.readouterr().err.rstrip("\n")


def refused_other_yaml(given, tmp_path, capsys) -> str:
    from training.ablation import AblationSpec
    from training.cli import main as kiln

    reader, content = given
    path = tmp_path / f"{reader}.yaml"
    path.write_text(content)
    if reader == "recipe":
        from training.data.cleaning.recipe import load_recipe

        with pytest.raises(ValueError) as raised:
            load_recipe(str(path))
        return str(raised.value)
    if reader == "import-hf":
        assert kiln(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--config", str(path)]) == 2
        return capsys.readouterr().err.rstrip("\n")
    with pytest.raises(ValueError) as raised:
        AblationSpec.load(path)
    return str(raised.value)


REFUSALS = {"config": refused_config, "layout": refused_layout, "name": refused_name, "run": refused_run,
            "other yaml": refused_other_yaml}


def test_what_the_mock_refusal_says_to_set_is_enough(capsys):
    from training.run import main as run

    assert run(["--config", "configs/qwen3_tiny.yaml", "--set", "train_dataset.dataloader.config.mock=true",
                "--set", "train_dataset.dataloader.config.data_path=null", "--set", "checkpoint.enable_save=false",
                "--set", "train_dataset.dataloader.config.seq_length=64", "--set", "train_dataset.dataloader.config.eod=2",
                "--set", "training.steps=0"]) == 2
    assert capsys.readouterr().err == "config error: configs/qwen3_tiny.yaml: training.steps must be > 0, got 0\n"
