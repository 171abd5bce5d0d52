"""The bad-input matrix: one table of (bad input, what the error must say), so none of them comes back. Each
input is a config file's text, or the micro config with overrides; every case must end in one ConfigError whose
report holds the fragment (a regular expression), before anything is built."""
import time

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
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_bad_input_is_one_report_naming_what_is_wrong(case, tmp_path):
    (content, sets), fragment = CASES[case]
    path = tmp_path / "qwen3_micro_case.yaml"
    path.write_text(content)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as raised:
        load_config(path, sets, model_check=model_config)
    message = str(raised.value)
    assert time.perf_counter() - started < 30  # refused before anything big is built (a bound, not a target)
    assert len(message) < 4000, message[:4000]
    assert __import__("re").search(fragment, message), message
