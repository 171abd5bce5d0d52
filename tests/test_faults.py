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


def test_a_full_disk_during_an_async_then_a_sync_save_keeps_the_last_checkpoint_and_resumes_to_the_same_losses(
        tmp_path, shard, small_tmpfs):
    """One chain of runs on a disk with room for one checkpoint: an async save of step 2 fails (in the writer
    thread), the run resumed from step 1 fails the same way with a sync save, and once space is freed the next
    resume trains step 2 to the loss both failed runs logged."""
    save_path = small_tmpfs / "checkpoints"
    run = ["training.steps=2", "checkpoint.save_interleaved_steps=1", f"checkpoint.save_path={save_path}"]
    resume = [*run, f"checkpoint.load_path={save_path}"]
    no_space = f"No space left on device: '{save_path}/.iteration_00000002.partial/checkpoint-"

    full_async = make_trainer(tmp_path, shard, "async", *run, "checkpoint.async_save=true")
    with pytest.raises(CheckpointError) as raised:
        full_async.train()
    assert str(raised.value).startswith(f"{save_path}/iteration_00000002: async save failed on 1 rank(s); on this "
                                        f"rank: OSError: [Errno 28] {no_space}")
    assert_only_step_1_is_kept(save_path)
    logged = losses(tmp_path / "async")
    assert sorted(logged) == [1, 2]  # step 2 trained; its save failed

    full_sync = make_trainer(tmp_path, shard, "sync", *resume)
    assert full_sync.step == 1  # the failed async save left nothing a resume would pick
    with pytest.raises(OSError) as raised:
        full_sync.train()
    assert raised.value.errno == errno.ENOSPC and str(raised.value).startswith(f"[Errno 28] {no_space}")
    assert_only_step_1_is_kept(save_path)
    assert losses(tmp_path / "sync") == {2: logged[2]}

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_tmpfs)], check=True)  # space freed
    resumed = make_trainer(tmp_path, shard, "resumed", *resume)
    assert resumed.step == 1
    resumed.train()
    assert losses(tmp_path / "resumed") == {2: logged[2]}  # bit for bit
    assert tracked_step(save_path) == 2 and not list(save_path.glob(".iteration_*.partial"))


def test_a_shard_corrupted_after_its_check_fails_at_the_sample_naming_the_file_and_resumes_once_restored(
        tmp_path, shard):
    """The shard passes every check when the run builds its dataset (the .idx, the .bin's size, every token id
    against model.vocab_size); once step 1 has trained and while its checkpoint is saved, another process
    overwrites the shard in place. Step 2 fails at the first sample it reads, naming the file and the sample,
    before it trains on it; step 1's checkpoint stays the one tracked, and with the shard restored the run
    resumes to the uninterrupted losses."""
    run = ["training.steps=2", "checkpoint.save_interleaved_steps=1"]
    uninterrupted = make_trainer(tmp_path, shard, "uninterrupted", *run, "checkpoint.enable_save=false")
    uninterrupted.train()
    good = tmp_path / "good.bin"
    shutil.copyfile(f"{shard}.bin", good)

    corrupted = make_trainer(tmp_path, shard, "corrupted", *run)  # every check passes here
    train_step = corrupted.train_step

    def train_step_then_corrupt_the_shard():
        metrics = train_step()
        tokens = np.memmap(f"{shard}.bin", mode="r+", dtype=np.uint16)
        tokens[:] = 600  # outside the micro model's 512 ids
        tokens.flush()
        return metrics
    corrupted.train_step = train_step_then_corrupt_the_shard
    with pytest.raises(ValueError, match=rf"^{shard}\.bin: sample \d+ holds token id 600, outside \[0, 512\) "
                                         rf"\(model\.vocab_size\), though every id was inside when the dataset "
                                         rf"was built: the file changed since"):
        corrupted.train()
    save_path = tmp_path / "corrupted/checkpoints"
    assert_only_step_1_is_kept(save_path)
    logged = losses(tmp_path / "corrupted")
    assert sorted(logged) == [1]  # step 2 never trained on the corrupted samples

    shutil.copyfile(good, f"{shard}.bin")
    resumed = make_trainer(tmp_path, shard, "resumed", *run, f"checkpoint.save_path={save_path}",
                           f"checkpoint.load_path={save_path}")
    resumed.train()
    expected = losses(tmp_path / "uninterrupted")
    assert logged == {1: expected[1]} and losses(tmp_path / "resumed") == {2: expected[2]}  # bit for bit
    assert tracked_step(save_path) == 2
