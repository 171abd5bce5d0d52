"""The run's state parts give and take their own state, and the checkpoint manager saves and restores them all:
what a resume reads is what the save wrote, part by part (training/train_state.py)."""
import json

import mindspore as ms
import numpy as np
import pytest

from test_trainer import losses, make_trainer
from training.checkpoint import KILN_STATE, CheckpointError
from training.train_state import DataPosition, GeneratorStates


def assert_same_state(state, expected, where=""):
    """Nested dicts of arrays and JSON values, equal bit for bit."""
    assert sorted(state) == sorted(expected), where
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same_state(state[key], value, f"{where}.{key}")
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(state[key], value, err_msg=f"{where}.{key}")
            assert state[key].dtype == value.dtype, f"{where}.{key}"
        else:
            assert state[key] == value, f"{where}.{key}"


def test_generator_states_round_trip_through_json():
    ms.manual_seed(11)
    np.random.seed(11)
    np.random.normal(size=3)
    state = json.loads(json.dumps(GeneratorStates(11).state_dict()))
    expected = np.random.normal(size=5)
    ms_expected = ms.get_rng_state().asnumpy()
    ms.manual_seed(99)
    np.random.seed(99)
    GeneratorStates(11).load_state_dict(state)
    np.testing.assert_array_equal(np.random.normal(size=5), expected)
    np.testing.assert_array_equal(ms.get_rng_state().asnumpy(), ms_expected)
    with pytest.raises(CheckpointError, match="field rng has no generator states"):
        GeneratorStates(1).load_state_dict({"seed": 1})
    with pytest.raises(CheckpointError, match="field rng is malformed"):
        GeneratorStates(1).load_state_dict({**state, "numpy_global": {}})


def test_data_position_continues_at_the_saved_sample_under_another_global_batch_size():
    saved = DataPosition(global_batch_size=4, seed=3)
    for _ in range(3):
        saved.advance()
    assert saved.state_dict() == {"global_step": 3, "consumed_samples": 12, "global_batch_size": 4, "seed": 3}
    same = DataPosition(4, 3)
    same.load_state_dict(saved.state_dict())
    assert same.state_dict() == saved.state_dict()
    bigger = DataPosition(8, 3)
    bigger.load_state_dict(saved.state_dict())
    assert (bigger.step, bigger.consumed_samples) == (1, 12)  # 12 samples are one step of 8, rounded down


def test_every_part_resumes_with_the_state_the_save_wrote(tmp_path, shard):
    """Dropout on, so the mask stream is part of the state: after two steps and a save, a trainer resumed from
    that checkpoint holds, part by part, exactly the state of the trainer that saved it."""
    dropout = "model.hidden_dropout=0.1"
    saving = make_trainer(tmp_path, shard, "saving", dropout, "training.steps=2")
    saving.train()
    resumed = make_trainer(tmp_path, shard, "resumed", dropout, "training.steps=2",
                           f"checkpoint.load_path={tmp_path / 'saving/checkpoints/iteration_00000002'}")
    assert sorted(saving.checkpoints.parts) == ["data_position", "lr_schedule", "model", "optimizer", "rng"]
    for name, part in saving.checkpoints.parts.items():
        assert_same_state(resumed.checkpoints.parts[name].state_dict(), part.state_dict(), name)


def test_a_save_before_training_is_a_step_zero_checkpoint_that_trains_as_the_seed_does(tmp_path, shard):
    seeded = make_trainer(tmp_path, shard, "seeded", "training.steps=2")
    seeded.save()  # before train(): the initial weights, optimizer at rest, generators as seeded
    checkpoint = tmp_path / "seeded/checkpoints/iteration_00000000"
    common = json.loads((checkpoint / "common.json").read_text())
    assert (common["global_step"], common["consumed_samples"]) == (0, 0)
    assert json.loads((checkpoint / KILN_STATE).read_text())["loss"] is None
    seeded.train()
    from_zero = make_trainer(tmp_path, shard, "from_zero", "training.steps=2", f"checkpoint.load_path={checkpoint}")
    assert from_zero.step == 0
    from_zero.train()
    assert losses(tmp_path / "from_zero") == {1: losses(tmp_path / "seeded")[1], 2: losses(tmp_path / "seeded")[2]}


def test_a_resume_says_when_the_lr_schedule_gives_another_rate_than_the_saved_run_was_at(tmp_path, shard, capsys):
    make_trainer(tmp_path, shard, "short", "training.steps=3").train()
    load = f"checkpoint.load_path={tmp_path / 'short/checkpoints/iteration_00000003'}"
    capsys.readouterr()
    make_trainer(tmp_path, shard, "same", "training.steps=3", load)
    assert "the LR schedule gives" not in capsys.readouterr().out
    make_trainer(tmp_path, shard, "longer", "training.steps=12", load)  # the cosine now decays over 12 steps
    assert "the LR schedule gives" in capsys.readouterr().out
