"""Faults during training, each with its outcome: the error names the cause, nothing complete is lost or
replaced by an incomplete checkpoint, and the run resumes to the same losses. (Process kills: test_resume,
test_cancel; a death between checkpoint files or before the tracker: test_checkpoint.)"""
import errno
import shutil
import subprocess

import numpy as np
import pytest

from test_trainer import losses, make_trainer
from training.checkpoint import CheckpointError, is_complete, iteration_dir, tracked_step


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2.5 MiB tmpfs: room for one checkpoint of the micro model (1.7 MB with its optimizer), not two."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def assert_only_step_1_is_kept(save_path):
    """Step 1's checkpoint is whole and tracked; step 2 exists at most as a staging directory."""
    assert tracked_step(save_path) == 1 and is_complete(iteration_dir(save_path, 1))
    assert not iteration_dir(save_path, 2).exists()


def test_a_full_disk_and_a_shard_corrupted_after_its_check_keep_the_last_checkpoint_and_resume_to_the_same_losses(
        tmp_path, shard, small_tmpfs):
    """One chain of runs resuming each other on a disk with room for one checkpoint:
    1. the async save of step 2 fails in the writer thread;
    2. the next run's shard passes every check when it builds its dataset (the .idx, the .bin's size, every
       token id against model.vocab_size), then another process overwrites it in place: the first sample read
       fails naming the file and the sample, before any step trains on it;
    3. with the shard restored and space freed, the next run trains step 2 to the loss the first logged.
    After each failure, step 1's checkpoint is the one tracked and whole, and step 2 has no checkpoint."""
    save_path = small_tmpfs / "checkpoints"
    run = ["training.steps=2", "checkpoint.save_interleaved_steps=1", f"checkpoint.save_path={save_path}"]
    resume = [*run, f"checkpoint.load_path={save_path}"]

    full = make_trainer(tmp_path, shard, "full", *run, "checkpoint.async_save=true")
    with pytest.raises(CheckpointError) as raised:
        full.train()
    assert str(raised.value).startswith(f"{save_path}/iteration_00000002: async save failed on 1 rank(s); on this "
                                        f"rank: OSError: [Errno 28] No space left on device: "
                                        f"'{save_path}/.iteration_00000002.partial/checkpoint-")
    assert_only_step_1_is_kept(save_path)
    logged = losses(tmp_path / "full")
    assert sorted(logged) == [1, 2]  # step 2 trained; its save failed

    corrupted = make_trainer(tmp_path, shard, "corrupted", *resume)  # every check passes here
    assert corrupted.step == 1  # the failed save left nothing a resume would pick
    good = tmp_path / "good.bin"
    shutil.copyfile(f"{shard}.bin", good)
    tokens = np.memmap(f"{shard}.bin", mode="r+", dtype=np.uint16)
    tokens[:] = 600  # outside the micro model's 512 ids
    tokens.flush()
    with pytest.raises(ValueError, match=rf"^{shard}\.bin: sample \d+ holds token id 600, outside \[0, 512\) "
                                         rf"\(model\.vocab_size\), though every id was inside when the dataset "
                                         rf"was built: the file changed since"):
        corrupted.train()
    assert losses(tmp_path / "corrupted") == {}  # no step trained on corrupted samples
    assert_only_step_1_is_kept(save_path)

    shutil.copyfile(good, f"{shard}.bin")
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)  # space freed
    resumed = make_trainer(tmp_path, shard, "resumed", *resume)
    assert resumed.step == 1
    resumed.train()
    assert losses(tmp_path / "resumed") == {2: logged[2]}  # bit for bit
    assert tracked_step(save_path) == 2 and not list(save_path.glob(".iteration_*.partial"))


def test_a_full_disk_during_a_sync_save_fails_naming_the_file_and_keeps_the_last_checkpoint(small_tmpfs):
    """The sync save's ENOSPC reaches its caller (the trainer lets it fail the run, as the async one above); the
    step is never tracked and the last checkpoint loads whole, as the resume above needs."""
    from test_checkpoint import arrays, common
    from training.checkpoint import CheckpointSaver, load_checkpoint, resolve_load_path
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World

    world = World(rank=0, size=1)
    saver = CheckpointSaver(save_path=small_tmpfs, prefix="checkpoint", save_max=5, world=world,
                            collectives=Collectives(world), async_save=False)
    big = {"filler": np.zeros(1_500_000 // 4, np.float32)}  # two checkpoints of this do not fit in 2.5 MiB
    model, optim = arrays(1)
    saver.save(step=1, model={**model, **big}, optim=optim, common=common(1), lineage={"run": {}})
    model, optim = arrays(2)
    with pytest.raises(OSError) as raised:
        saver.save(step=2, model={**model, **big}, optim=optim, common=common(2), lineage={"run": {}})
    assert raised.value.errno == errno.ENOSPC and str(raised.value).startswith(
        f"[Errno 28] No space left on device: '{small_tmpfs}/.iteration_00000002.partial/checkpoint-")
    assert_only_step_1_is_kept(small_tmpfs)
    loaded = load_checkpoint(resolve_load_path(small_tmpfs))
    model, optim = arrays(1)
    assert loaded.common["global_step"] == 1
    for name, saved in [*model.items(), *big.items(), *optim.items()]:  # the state a resume starts from, bit for bit
        np.testing.assert_array_equal((loaded.model | loaded.optim)[name], saved, err_msg=name)
