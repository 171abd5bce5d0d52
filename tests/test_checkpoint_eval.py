"""A checkpoint's held-out evaluation: `kiln eval` (no Dagster) per source on the test split, its sidecar verified
by `kiln audit` and listed by `kiln lineage --consumers`; the checkpoint_eval asset, partitioned like checkpoint,
requested by its automation condition when a checkpoint partition appears."""
import copy
import json

import dagster as dg
import numpy as np
import pytest
from mindspore import Tensor

from conftest import write_random_documents
from test_trainer import make_trainer
from training.cli import main as kiln
from training.data.hashing import sha256_file
from training.data.indexed import IndexedDataset
from training.data.loader import build_dataset, stack_model_inputs

RUN = "run"
CHECKPOINT = "iteration_00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps on three sources (code 0.5, docs 0.3, notes 0.2) with an 80/10/10 split, which gives the 4
    documents of notes no test document (3 train, 1 valid); lineage names each source's shard."""
    root = tmp_path_factory.mktemp("eval")
    shards = {name: write_random_documents(root / f"data/shards/{name}", seed=seed, documents=documents)
              for name, seed, documents in (("code", 1, 200), ("docs", 2, 200), ("notes", 3, 4))}
    lineage = {"data_root": str(root / "data"), "shards": [
        {"source": name, "path": f"shards/{name}.{ext}", "sha256": sha256_file(f"{prefix}.{ext}")}
        for name, prefix in shards.items() for ext in ("bin", "idx")]}
    trainer = make_trainer(root, shards["code"], RUN,
                           f"train_dataset.dataloader.config.data_path=[0.5, '{shards['code']}', 0.3, "
                           f"'{shards['docs']}', 0.2, '{shards['notes']}']",
                           "train_dataset.dataloader.config.split='80,10,10'",
                           "training.steps=2", "checkpoint.save_interleaved_steps=2", lineage=lineage)
    trainer.train()
    return root, trainer, shards


def numpy_loss(trainer, items):
    """Summed cross entropy over the loss-masked tokens of ``items`` and their count, from the model's logits."""
    batch = stack_model_inputs(items, use_positions=False)
    logits = trainer.model.logits(Tensor(batch["input_ids"])).asnumpy().astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, batch["labels"][..., None].astype(np.int64), -1)[..., 0]
    return -(picked * batch["loss_mask"]).sum(), batch["loss_mask"].sum()


NOTES_LEFT_OUT = "4 document(s), split '80,10,10' gives the test split none of them"


def test_kiln_eval_reports_each_source_on_the_test_split_and_audit_verifies_its_sidecar(trained, capsys):
    root, trainer, shards = trained
    checkpoint = root / RUN / "checkpoints" / CHECKPOINT
    assert kiln(["eval", str(checkpoint), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {checkpoint / 'eval.json'}" in out
    assert f"notes        not evaluated: train_dataset.dataloader.config.data_path[5] {shards['notes']}: " \
           f"{NOTES_LEFT_OUT}" in out
    record = json.loads((checkpoint / "eval.json").read_text())
    assert record["split"] == "test" and record["sample_range"] == [0, 8] and record["checkpoint"]["step"] == 2
    assert {s["path"] for s in record["shards"]} == {f"shards/{n}.{e}" for n in ("code", "docs", "notes")
                                                     for e in ("bin", "idx")}
    # notes has no test document: the result names it, with its document count and the split, and evaluates the
    # others as the blend of their own weights (code 0.5, docs 0.3)
    (notes,) = record["unevaluated_sources"]
    assert notes["source"] == "notes" and notes["shard"] == str(shards["notes"])
    assert (notes["documents"], notes["held_out_documents"], notes["held_out_tokens"]) == (4, 0, 0)
    assert notes["reason"].endswith(NOTES_LEFT_OUT)
    others = copy.deepcopy(trainer.config)
    others.train_dataset.dataloader.config.data_path = [0.5, str(shards["code"]), 0.3, str(shards["docs"])]
    # every source's loss and the overall one, against numpy over the same samples of the trained model
    test = build_dataset(others, num_samples=8, split="test")
    trainer.model.set_train(False)
    sums = {}
    for i in range(8):
        name = ("code", "docs")[test[i]["dataset_id"]]
        loss, tokens = numpy_loss(trainer, [test[i]])
        sums[name] = sums.get(name, np.zeros(2)) + (loss, tokens)
    assert set(record["sources"]) == set(sums) == {"code", "docs"}
    for name, (loss, tokens) in sums.items():
        assert record["sources"][name]["loss"] == pytest.approx(loss / tokens, rel=1e-5)
        assert record["sources"][name]["tokens"] == tokens
    total = sum(sums.values())
    assert record["loss"] == pytest.approx(total[0] / total[1], rel=1e-5)

    assert kiln(["audit", str(checkpoint)]) == 0
    assert "ok        evaluation  eval.json" in capsys.readouterr().out
    assert kiln(["lineage", "--consumers", "docs", "--runs-root", str(root)]) == 0
    assert f"evaluated: {checkpoint}/eval.json" in capsys.readouterr().out
    # notes trained the checkpoint, but the evaluation read nothing of it
    assert kiln(["lineage", "--consumers", "notes", "--runs-root", str(root)]) == 0
    assert f"run {RUN} step 2: source notes" in (out := capsys.readouterr().out) and "evaluated:" not in out
    # an edited result fails the audit
    edited = {**record, "loss": record["loss"] - 1}
    (checkpoint / "eval.json").write_text(json.dumps(edited))
    assert kiln(["audit", str(checkpoint)]) == 1
    assert "MISMATCH  evaluation  eval.json" in capsys.readouterr().out
    (checkpoint / "eval.json").write_text(json.dumps(record))


def test_kiln_eval_of_the_valid_split_leaves_out_a_source_whose_held_out_tokens_make_no_sample(trained, capsys):
    root, _, shards = trained
    checkpoint = root / RUN / "checkpoints" / CHECKPOINT
    assert kiln(["eval", str(checkpoint), "--split", "valid", "--batches", "1"]) == 0
    # the run's default is the test split (eval.json): another split's evaluation goes beside it, under its name
    record = json.loads((checkpoint / "eval-valid.json").read_text())
    assert record["split"] == "valid" and record["default_split"] == "test"
    assert record["sample_range"] == [0, 4] and set(record["sources"]) == {"code", "docs"}
    assert kiln(["audit", str(checkpoint)]) == 0
    assert "ok        evaluation  eval-valid.json" in capsys.readouterr().out
    # 80,10,10 gives the validation split the last of notes' 4 documents, shorter than a sample of 32 + 1 tokens
    tokens = int(IndexedDataset(shards["notes"]).sequence_lengths[3])
    assert tokens < 33
    (notes,) = record["unevaluated_sources"]
    assert (notes["held_out_documents"], notes["held_out_tokens"]) == (1, tokens)
    assert notes["reason"].endswith(f"4 document(s), split '80,10,10' gives the valid split 1 of them, {tokens} "
                                    f"tokens, fewer than one sample's 33 (train_dataset.dataloader.config."
                                    f"seq_length 32 + 1)")


def test_kiln_eval_refuses_more_batches_than_the_split_holds_naming_both(trained, capsys):
    root, _, _ = trained
    assert kiln(["eval", str(root / RUN / "checkpoints" / CHECKPOINT), "--batches", "50"]) == 2
    err = capsys.readouterr().err
    assert "--batches = 50 global batches of training.global_batch_size 4 = 200 test samples" in err
    assert "train_dataset.dataloader.config.split ('80,10,10')" in err


def test_checkpoint_eval_is_requested_for_a_new_checkpoint_and_records_the_evaluation(trained):
    from assets.evaluation import checkpoint_eval
    from assets.training import checkpoint, checkpoint_partitions
    from pipelines.definitions import ALL_ASSETS, resources
    from resources.storage import KilnStorage

    root, _, shards = trained
    key = f"{RUN}/{CHECKPOINT}"
    with dg.instance_for_test() as instance:
        defs = dg.Definitions(assets=[checkpoint, checkpoint_eval], resources=resources())
        before = dg.evaluate_automation_conditions(defs=defs, instance=instance)  # the sensor's previous tick
        instance.add_dynamic_partitions(checkpoint_partitions.name, [key])
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=checkpoint.key, partition=key))
        requested = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
        assert requested.get_requested_partitions(checkpoint_eval.key) == {key}
        result = dg.materialize(ALL_ASSETS, selection=[checkpoint_eval], partition_key=key, instance=instance,
                                resources=resources(storage=KilnStorage(data_root=str(root / "data"),
                                                                        runs_root=str(root))),
                                run_config={"ops": {"checkpoint_eval": {"config": {"batches": 1, "tasks": []}}}})
    (event,) = result.asset_materializations_for_node("checkpoint_eval")
    metadata = {k: v.value for k, v in event.metadata.items()}
    sidecar = json.loads((root / RUN / "checkpoints" / CHECKPOINT / "eval.json").read_text())
    assert metadata["loss"] == sidecar["loss"] and metadata["loss_docs"] == sidecar["sources"]["docs"]["loss"]
    assert metadata["split"] == "test" and metadata["checkpoint"].endswith(CHECKPOINT)
    assert metadata["samples"] == f"0..3 of the test split, {sidecar['tokens']} loss tokens"
    # the Plots tab draws the curves only: no chart of a count
    plotted = {k for k, v in event.metadata.items() if isinstance(v, (dg.FloatMetadataValue, dg.IntMetadataValue))}
    assert plotted == {f"{kind}{source}" for kind in ("loss", "ppl") for source in ("", "_code", "_docs")}
    assert event.tags["dagster/data_version"] == sidecar["results_sha256"]
    # the source without test documents, named with why in a table
    assert f"| notes | 4 | 0 | 0 | train_dataset.dataloader.config.data_path[5] {shards['notes']}: {NOTES_LEFT_OUT} |" \
        in metadata["unevaluated_sources"]


def test_a_run_moved_with_its_data_still_evaluates_and_audits_there(trained, tmp_path, capsys):
    """The run directory and the data root copied together elsewhere, the originals gone: kiln eval reads the
    copy's data and kiln audit verifies the copy's config and files; a copy of the data alone is --data-root."""
    import shutil

    root, _, _ = trained
    moved = tmp_path / "moved"
    shutil.copytree(root, moved, ignore=shutil.ignore_patterns("eval*.json"))
    hidden = root.with_name(root.name + ".away")
    root.rename(hidden)
    try:
        checkpoint = moved / RUN / "checkpoints" / CHECKPOINT
        assert kiln(["eval", str(checkpoint), "--batches", "1"]) == 0
        record = json.loads((checkpoint / "eval.json").read_text())
        assert record["data_root"] == str(moved / "data")
        capsys.readouterr()
        assert kiln(["audit", str(checkpoint)]) == 0
        out = capsys.readouterr().out
        assert f"ok        run config  {moved / RUN}/config-" in out and "missing" not in out
        assert f"ok        shard       shards/code.bin" in out
        # the copy's data is the data audited: a changed copy fails although the original is back in place
        hidden.rename(root)
        (moved / "data" / "shards" / "code.bin").write_bytes(b"changed")
        assert kiln(["audit", str(checkpoint)]) == 1
        capsys.readouterr()
        # data moved on its own: named with --data-root
        shutil.copytree(root / "data", tmp_path / "elsewhere")
        shutil.rmtree(moved / "data")
        assert kiln(["eval", str(checkpoint), "--batches", "1", "--data-root", str(tmp_path / "elsewhere")]) == 0
        assert json.loads((checkpoint / "eval.json").read_text())["data_root"] == str(tmp_path / "elsewhere")
    finally:
        if hidden.exists():
            hidden.rename(root)


def test_checkpoint_eval_scores_the_tasks_every_task_interval_steps_and_at_the_runs_last(tmp_path):
    from assets.evaluation import CheckpointEvalConfig, eval_command, scores_tasks

    def checkpoint(step, steps):
        path = tmp_path / f"iteration_{step:08d}_of_{steps}"
        path.mkdir()
        (path / "lineage.json").write_text(json.dumps({"checkpoint": {"step": step},
                                                       "run": {"config": {"training": {"steps": steps}}}}))
        return path

    default = CheckpointEvalConfig()  # the fast set every 1000 steps
    assert [scores_tasks(checkpoint(step, 150), default) for step in (50, 100, 150)] == [False, False, True]
    assert [scores_tasks(checkpoint(step, 2500), default) for step in (500, 1000, 2000)] == [False, True, True]
    every_50 = CheckpointEvalConfig(task_interval=50)
    assert scores_tasks(tmp_path / "iteration_00000050_of_150", every_50)
    assert not scores_tasks(tmp_path / "iteration_00000150_of_150", CheckpointEvalConfig(tasks=[]))
    unreadable = tmp_path / "no_lineage"
    unreadable.mkdir()
    assert scores_tasks(unreadable, default)  # kiln eval then names what is wrong with the lineage
    assert "--tasks" not in eval_command(unreadable, default, tasks=False)
    assert eval_command(unreadable, default, tasks=True)[-4:] == ["--tasks", "fast", "--task-limit", "200"]
    with pytest.raises(Exception, match="task_interval"):
        CheckpointEvalConfig(task_interval=0)
