"""Faults during training, each with its outcome: the error names the cause, nothing complete is lost or
replaced by an incomplete checkpoint, and the run resumes to the same losses. (Process kills: test_resume,
test_cancel; a death between checkpoint files or before the tracker: test_checkpoint; a shard rewritten
after its check: test_trainer.)"""
import errno
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


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_resumes_to_the_same_losses(
        tmp_path, shard, small_tmpfs):
    save_path = small_tmpfs / "checkpoints"
    run = ["training.steps=2", "checkpoint.save_interleaved_steps=1", f"checkpoint.save_path={save_path}"]
    full = make_trainer(tmp_path, shard, "full", *run)
    with pytest.raises(OSError) as raised:
        full.train()
    assert raised.value.errno == errno.ENOSPC and str(raised.value).startswith(
        f"[Errno 28] No space left on device: '{save_path}/.iteration_00000002.partial/checkpoint-")
    # step 1's checkpoint is whole and tracked; step 2 exists only as a staging directory
    assert tracked_step(save_path) == 1 and is_complete(iteration_dir(save_path, 1))
    assert not iteration_dir(save_path, 2).exists()
    logged = losses(tmp_path / "full")
    assert sorted(logged) == [1, 2]  # step 2 trained; its save failed

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)  # space freed
    resumed = make_trainer(tmp_path, shard, "resumed", *run, f"checkpoint.load_path={save_path}")
    assert resumed.step == 1
    resumed.train()
    assert losses(tmp_path / "resumed") == {2: logged[2]}  # bit for bit
    assert tracked_step(save_path) == 2 and not list(save_path.glob(".iteration_*.partial"))


def test_a_full_disk_during_an_async_save_fails_naming_it_and_never_tracks_the_step(small_tmpfs):
    """The writer thread hits ENOSPC; the save completing it reports the cause and tracks nothing. (The
    trainer-level resume after a failed save is the sync case above: an async save fails the same step.)"""
    from test_checkpoint import arrays, common
    from training.checkpoint import CheckpointSaver, load_checkpoint, resolve_load_path
    from training.parallel.comm import Collectives
    from training.parallel.mesh import World

    world = World(rank=0, size=1)
    saver = CheckpointSaver(save_path=small_tmpfs, prefix="checkpoint", save_max=5, world=world,
                            collectives=Collectives(world), async_save=True)
    big = {"filler": np.zeros(1_500_000 // 4, np.float32)}  # two checkpoints of this do not fit in 2.5 MiB
    for step in (1, 2):
        model, optim = arrays(step)
        saver.save(step=step, model={**model, **big}, optim=optim, common=common(step), lineage={"run": {}})
    with pytest.raises(CheckpointError, match=rf"iteration_00000002: async save failed on 1 rank\(s\); on this "
                                              rf"rank: OSError: \[Errno 28\] No space left on device: "
                                              rf"'{small_tmpfs}/\.iteration_00000002\.partial/checkpoint-"):
        saver.wait()
    assert tracked_step(small_tmpfs) == 1 and not iteration_dir(small_tmpfs, 2).exists()
    loaded = load_checkpoint(resolve_load_path(small_tmpfs))
    assert loaded.common["global_step"] == 1 and loaded.model["filler"].shape == big["filler"].shape
