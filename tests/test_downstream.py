"""Downstream tasks scored with Kiln's model and tokenizer: each request's log-likelihood from a batched, padded,
compiled forward equals the model's own log-softmax over that request alone; acc / len_norm / bpb follow from
them; `kiln eval --tasks` writes them into eval.json, resumes after a stop and names bad input."""
import json
import math

import numpy as np
import pytest
import sentencepiece as spm
from mindspore import Tensor

from conftest import write_random_documents
from test_trainer import make_trainer
from training.cli import main as kiln
from training.data.hashing import sha256_file
from training.downstream import PARTIAL_DIR, RequestScorer, TokenBytes, encode_task, score_documents, score_tasks
from training.evaluation import evaluating
from training.tasks import TaskError, load_task, task_texts

RUN = "run"
CHECKPOINT = "iteration_00000002"
TASKS = "arc_easy,piqa,hellaswag"  # 4, 2 and 4 choices; hellaswag's prompts are longer than 32 tokens


def train_tokenizer(prefix, byte_fallback=True, vocab_size=512):
    """A sentencepiece model on the tasks' own texts (the settings of resources/tokenizer.py)."""
    lines = [t for texts in task_texts(["fast"], limit=150).values() for t in texts]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
        character_coverage=1.0 if byte_fallback else 0.98, byte_fallback=byte_fallback,
        normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of the micro model; the lineage names a tokenizer trained on the task texts."""
    root = tmp_path_factory.mktemp("downstream")
    (root / "data/tokenizer").mkdir(parents=True)
    processor = train_tokenizer(root / "data/tokenizer/kiln")
    shard = write_random_documents(root / "data/shards/code", seed=1, documents=300)
    lineage = {"data_root": str(root / "data"),
               "tokenizer": {"path": "tokenizer/kiln.model", "sha256": sha256_file(root / "data/tokenizer/kiln.model")},
               "shards": [{"source": "code", "path": f"shards/code.{ext}", "sha256": sha256_file(f"{shard}.{ext}")}
                          for ext in ("bin", "idx")]}
    trainer = make_trainer(root, shard, RUN, "training.steps=2", "checkpoint.save_interleaved_steps=2",
                           "train_dataset.dataloader.config.split='90,10,0'",
                           f"monitor.tensorboard.output_dir={root / 'tensorboard'}", lineage=lineage)
    trainer.train()
    trainer.model.set_train(False)
    return root, trainer, processor


def alone_loglikelihood(model, context_ids, continuation_ids, max_length):
    """The continuation's summed log-probability from the model's logits over this request alone (float64 log
    softmax, no padding), the window cut from the left to ``max_length`` inputs as OLMo's query is."""
    window = (context_ids + continuation_ids)[-(max_length + 1):]
    logits = model.logits(Tensor(np.array([window[:-1]], np.int32))).asnumpy()[0].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    n = len(continuation_ids)
    return sum(log_probs[len(window) - 1 - n + i, continuation_ids[i]] for i in range(n))


def test_packed_compiled_loglikelihoods_equal_each_request_scored_alone(trained, monkeypatch):
    import training.downstream as downstream

    _, trainer, processor = trained
    model, max_length = trainer.model, 64  # the micro model's max_position_embeddings
    # narrow rows and small batches, so that a few documents reach every path: groups split at the sequence
    # length, two row widths, batches shared by the tasks and cut by their answer tokens, a row with more answer
    # tokens than a batch holds
    monkeypatch.setattr(downstream, "PACK_WIDTH", 48)
    monkeypatch.setattr(downstream, "FORWARD_TOKENS", 192)
    monkeypatch.setattr(downstream, "TARGET_SHARE", 0.25)
    shapes, packed_batch = [], downstream.packed_batch
    monkeypatch.setattr(downstream, "packed_batch", lambda rows, requests, width, count, targets: (
        shapes.append((width, len(rows), count, targets, max(len(g.requests) for groups in rows for g in groups))),
        packed_batch(rows, requests, width, count, targets))[1])
    scorer = RequestScorer(model, max_length, compiled=True)
    tasks = [load_task(name) for name in TASKS.split(",")]
    with evaluating(model):
        results = dict((task.name, result) for task, result in score_tasks(tasks, 6, processor, scorer))
    assert {width for width, *_ in shapes} == {48, 64} and max(rows for _, rows, *_ in shapes) > 1
    assert any(targets > int(0.25 * count * width) for width, _, count, targets, _ in shapes)
    assert max(answers for *_, answers in shapes) > 1  # answers shared a prompt
    for task in tasks:
        result = results[task.name]
        documents = [doc for doc in task.instances(6) if doc.doc_id not in result["left_out_too_long"]]
        expected = [alone_loglikelihood(model, processor.encode(context), processor.encode(continuation), max_length)
                    for doc in documents for context, continuation in doc.requests]
        # to float32 rounding: each answer sees what it sees alone (the summed log-probabilities are ~100)
        np.testing.assert_allclose(result["loglikelihoods"], expected, rtol=1e-6, atol=1e-5)
        # the scores, from those log-likelihoods by hand
        ll = iter(expected)
        per_doc = [[next(ll) for _ in doc.requests] for doc in documents]
        answers = [[c for _, c in doc.requests] for doc in documents]
        assert result["acc"] == np.mean([np.argmax(l) == d.label for l, d in zip(per_doc, documents)])
        assert result["len_norm"] == np.mean([np.argmax(np.array(l) / [len(a) for a in ans]) == d.label
                                              for l, ans, d in zip(per_doc, answers, documents)])
        assert result["bpb"] == pytest.approx(np.mean(
            [-l[d.label] / len(a[d.label].encode()) / math.log(2) for l, a, d in zip(per_doc, answers, documents)]),
            abs=1e-5)
        assert result["instances"] == len(documents) and result["requests"] == len(expected)
        assert result["primary"] == result[task.primary_metric]
    # the left cut was exercised: a hellaswag prompt is longer than the window
    assert any(len(processor.encode(c)) > max_length for d in load_task("hellaswag").instances(6) for c, _ in
               d.requests)
    # a document with an answer longer than the model's sequence length is left out, by id
    too_long = [d.doc_id for d in load_task("piqa").instances(6)
                if max(len(processor.encode(a)) for _, a in d.requests) > max_length]
    assert results["piqa"]["left_out_too_long"] == too_long and too_long
    assert not results["arc_easy"]["left_out_too_long"]


def test_a_packed_row_shares_each_prompt_and_keeps_the_answers_apart():
    from training.downstream import EncodedRequests, pack_rows, packed_batch, prompt_groups

    # document 0: prompt [1, 2, 3], answers [4, 5] and [6]; document 1: prompt [7], answer [8, 9, 10]
    encoded = EncodedRequests([np.array([1, 2, 3])] * 2 + [np.array([7])], [np.array([4, 5]), np.array([6]),
                                                                              np.array([8, 9, 10])],
                              np.array([0, 0, 1]), np.array([0, 1, 0]))
    groups = prompt_groups(encoded, max_length=8)
    assert [(g.requests, g.length, g.targets) for g in groups] == [([0, 1], 4, 3), ([2], 3, 3)]
    (row,) = pack_rows(groups, [8])
    assert row[0] == 8 and [g.requests for g in row[1]] == [[0, 1], [2]]
    batch = packed_batch([row[1]], [encoded], 8, row_count=2, target_count=8)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 7, 8, 9, 0] and not batch.input_ids[1].any()
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # the answers' tokens predicted from: the prompt's last token (each answer's first), then the answer's own
    assert batch.target_index.tolist() == [2, 3, 2, 4, 5, 6, 0, 0]
    assert batch.target_labels.tolist() == [4, 5, 6, 8, 9, 10, 0, 0]
    assert batch.target_request.tolist() == [0, 0, 1, 2, 2, 2, -1, -1]
    sees = 1 - batch.attention_mask[0, 0]  # [query, key]
    assert sees[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # answer 0 sees its prompt and itself
    assert sees[5].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]  # document 1 sees nothing of document 0
    # two answers after one prompt: the second sees the prompt, not the first answer
    two = EncodedRequests([np.array([1, 2])] * 2, [np.array([4, 5]), np.array([6, 7])], np.array([0, 0]),
                          np.array([0, 1]))
    (row,) = pack_rows(prompt_groups(two, max_length=8), [8])
    sees = 1 - packed_batch([row[1]], [two], 8, row_count=1, target_count=4).attention_mask[0, 0]
    assert sees[3].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    # a prompt with answers longer together than the sequence length is repeated, each group within it
    assert [g.requests for g in prompt_groups(two, max_length=3)] == [[0], [1]]


def test_ranking_by_length_normalized_likelihood_can_differ_from_raw_likelihood():
    class Doc:
        label = 1
        requests = (("q", " a"), ("q", " a much longer answer"))

    from training.downstream import EncodedRequests

    encoded = EncodedRequests([], [], np.array([0, 0]), np.array([0, 1]))
    scores = score_documents([Doc()], encoded, np.array([-2.0, -6.0]))
    # raw: -2 beats -6 (choice 0, wrong); per character: -6/21 beats -2/2 (choice 1, right)
    assert (scores["acc"], scores["len_norm"]) == (0.0, 1.0)
    assert scores["bpb"] == pytest.approx(6.0 / 21 / math.log(2))


def test_token_bytes_count_the_utf8_bytes_of_the_text_the_tokens_spell(tmp_path):
    processor = train_tokenizer(tmp_path / "tok")
    text = "Question: Which metal is liquid — at 20 °C? Answer: mercury (汞)"
    ids = processor.encode(text)
    # the dummy prefix "▁" spells one space before the text
    assert TokenBytes(processor).count(np.array([ids]), np.ones((1, len(ids))))[0] == len(text.encode()) + 1
    assert any(processor.is_byte(i) for i in ids)  # "汞" is in no task text: it came through byte fallback


def test_a_task_text_the_tokenizer_cannot_encode_names_the_task_documents_and_characters(tmp_path):
    processor = train_tokenizer(tmp_path / "nofallback", byte_fallback=False, vocab_size=300)
    task = load_task("hellaswag")
    with pytest.raises(TaskError) as error:
        encode_task(task, task.instances(200), processor, 64)
    message = str(error.value)
    assert message.startswith("task hellaswag: the checkpoint's tokenizer has no piece for ")
    assert "(no byte fallback), in documents [" in message and str(task.path) in message


def test_kiln_eval_with_tasks_writes_scores_and_held_out_bits_per_byte(trained, capsys):
    root, trainer, processor = trained
    checkpoint = root / RUN / "checkpoints" / CHECKPOINT
    assert kiln(["eval", str(checkpoint), "--split", "valid", "--batches", "1", "--tasks", TASKS,
                 "--task-limit", "4"]) == 0
    out = capsys.readouterr().out
    record = json.loads((checkpoint / "eval.json").read_text())
    assert list(record["tasks"]) == TASKS.split(",")
    assert all(s["instances"] + len(s["left_out_too_long"]) == 4 and 0 <= s["acc"] <= 1 and s["bpb"] > 0
               for s in record["tasks"].values())
    assert record["tasks_mean"]["primary"] == pytest.approx(np.mean([s["primary"] for s in record["tasks"].values()]))
    assert "hellaswag" in out and "requests/s" in out and not (checkpoint / PARTIAL_DIR).exists()
    # held-out bits per byte: the summed loss over the bytes the loss tokens spell
    code = record["sources"]["code"]
    assert code["bpb"] == pytest.approx(code["loss"] * code["tokens"] / math.log(2) / code["bytes"], rel=1e-9)
    assert record["bpb"] == pytest.approx(code["bpb"]) and "bits per byte: all sources" in out
    assert kiln(["audit", str(checkpoint)]) == 0
    assert "ok        evaluation  eval.json" in capsys.readouterr().out
    # TensorBoard: the scores at the checkpoint's step, in the run's monitor.tensorboard.output_dir
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    events = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(root / "tensorboard"))
    events.Reload()
    scalars = {(tag, e.step): e.value for run in events.Runs() for tag in events.Runs()[run]["scalars"]
               for e in events.Scalars(run, tag)}
    assert scalars[("eval/tasks/piqa/len_norm", 2)] == pytest.approx(record["tasks"]["piqa"]["len_norm"])
    assert scalars[("eval/bpb/code", 2)] == pytest.approx(code["bpb"], rel=1e-6)  # stored as float32


class Killed(BaseException):
    """A process killed: nothing after it runs (no handler of Exception or KeyboardInterrupt catches it)."""


def test_an_evaluation_stopped_half_way_writes_no_sidecar_and_resumes_at_the_next_task(trained, monkeypatch, capsys):
    import training.downstream as downstream

    root, _, _ = trained
    checkpoint = root / RUN / "checkpoints" / CHECKPOINT
    sidecar = checkpoint / "eval.json"  # the run has no test split: valid is its default
    sidecar.unlink(missing_ok=True)
    encoded, scored, encode, score = [], [], downstream.encode_task, downstream.score_documents

    def recorded(task, *args):
        encoded.append(task.name)
        return encode(task, *args)

    def stopped_at_the_second(*args):
        scored.append(1)
        if len(scored) == 2:
            raise Killed  # the process stopped once the first task's scores were kept
        return score(*args)

    monkeypatch.setattr(downstream, "encode_task", recorded)
    monkeypatch.setattr(downstream, "score_documents", stopped_at_the_second)
    args = ["eval", str(checkpoint), "--split", "valid", "--batches", "1", "--tasks", "arc_easy,piqa",
            "--task-limit", "3"]
    with pytest.raises(Killed):
        kiln(args)
    assert not sidecar.exists() and (checkpoint / PARTIAL_DIR / "arc_easy.json").is_file()
    assert not (checkpoint / PARTIAL_DIR / "piqa.json").exists()
    assert kiln(args) == 0
    assert encoded == ["arc_easy", "piqa", "piqa"]  # arc_easy was not scored again
    assert set(json.loads(sidecar.read_text())["tasks"]) == {"arc_easy", "piqa"}
    assert not (checkpoint / PARTIAL_DIR).exists()
    capsys.readouterr()


def test_kiln_eval_names_an_unknown_task_and_lists_the_known_ones(trained, capsys):
    root, _, _ = trained
    assert kiln(["eval", str(root / RUN / "checkpoints" / CHECKPOINT), "--tasks", "arc_easy,hellaswog"]) == 2
    err = capsys.readouterr().err
    assert "kiln eval: unknown task(s) hellaswog; known: fast (arc_easy, " in err and "winogrande" in err


def test_validation_during_training_records_bits_per_byte_beside_the_loss(trained, tmp_path):
    from training.evaluation import HeldOutSplit
    from training.reporting import read_records

    root, first, processor = trained
    lineage = {"data_root": str(root / "data"),
               "tokenizer": {"path": "tokenizer/kiln.model", "sha256": sha256_file(root / "data/tokenizer/kiln.model")}}
    shard = root / "data/shards/code"
    trainer = make_trainer(tmp_path, shard, "validated", "training.steps=2", "checkpoint.enable_save=false",
                           "kiln.training.eval_interval=2", "kiln.training.eval_iters=2",
                           "train_dataset.dataloader.config.split='90,10,0'", lineage=lineage)
    trainer.train()
    (record,) = [r for r in read_records(tmp_path / "validated/metrics.jsonl") if "val_loss" in r]
    # the same samples, their target tokens' bytes counted from the pieces' text
    held_out = HeldOutSplit(trainer.config, "valid", 2).build(512).dataset
    items = [held_out[i] for i in range(2 * trainer.config.training.global_batch_size)]
    tokens = sum(item["loss_mask"].sum() for item in items)

    def piece_bytes(t):  # decoding drops the "▁" a text starts with (the dummy prefix): it spells a space
        piece = processor.id_to_piece(t)
        if processor.is_byte(t):
            return 1
        return len(processor.decode_pieces([piece]).encode()) + piece.startswith("\u2581")

    text = sum(piece_bytes(int(t)) for item in items for t, m in zip(item["labels"], item["loss_mask"])
               if m and not processor.is_control(int(t)) and not processor.is_unknown(int(t)))
    assert record["val_bpb"] == pytest.approx(record["val_loss"] * tokens / text / math.log(2), rel=1e-6)


def test_checkpoint_eval_plots_each_task_and_tabulates_the_scores(trained):
    import dagster as dg

    from assets.evaluation import checkpoint_eval
    from assets.training import checkpoint_partitions
    from pipelines.definitions import ALL_ASSETS, resources
    from resources.storage import KilnStorage

    root, _, _ = trained
    key = f"{RUN}/{CHECKPOINT}"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoint_partitions.name, [key])
        result = dg.materialize(
            ALL_ASSETS, selection=[checkpoint_eval], partition_key=key, instance=instance,
            resources=resources(storage=KilnStorage(data_root=str(root / "data"), runs_root=str(root))),
            run_config={"ops": {"checkpoint_eval": {"config": {"batches": 1, "tasks": ["arc_easy", "sciq"],
                                                               "task_limit": 3}}}})
    (event,) = result.asset_materializations_for_node("checkpoint_eval")
    sidecar = json.loads((root / RUN / "checkpoints" / CHECKPOINT / "eval.json").read_text())
    plotted = {k: v.value for k, v in event.metadata.items() if isinstance(v, dg.FloatMetadataValue)}
    assert plotted["task_arc_easy"] == sidecar["tasks"]["arc_easy"]["acc"]  # arc_easy's primary metric
    assert plotted["task_sciq_bpb"] == sidecar["tasks"]["sciq"]["bpb"]
    assert plotted["tasks_mean_primary"] == sidecar["tasks_mean"]["primary"]
    assert plotted["bpb"] == sidecar["bpb"] and plotted["bpb_code"] == sidecar["sources"]["code"]["bpb"]
    table = event.metadata["task_scores"].value
    assert table.startswith("| task | acc | len_norm | bpb | primary |") and "| sciq | " in table
