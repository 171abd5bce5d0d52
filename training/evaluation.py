"""Held-out loss: Megatron-style validation during training (``kiln.training.eval_interval``, ``eval_iters``), and a
checkpoint's evaluation on its run's test (or validation) split, per source (``kiln eval``, checkpoint_eval).

The loss is the main LM head's cross entropy summed over the loss-masked tokens of every batch evaluated and
divided by their count once, after the sums of all data-parallel ranks are added (a mean of per-batch means
would weigh a batch with few loss tokens like a full one). Forward only: the model is in evaluation mode (no
dropout, so the training's mask stream does not move) and what a forward leaves for the next optimizer step
(MoE token counts, attention maxima) is dropped, so a run with validation trains exactly like one without.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np
from mindspore import Tensor

from training.atomic import write_json_atomic
from training.config import SPLITS, BlendedMegatronLoaderConfig, ConfigError, TrainConfig
from training.data.loader import build_dataset, stack_model_inputs
from training.forward import HeldOutLoss, forward_loss_sums

# Megatron prints exp(min(20, loss)): an untrained model's perplexity stays a number
_MAX_PPL_EXPONENT = 20.0


def perplexity(loss: float) -> float:
    return math.exp(min(_MAX_PPL_EXPONENT, loss))


def bits_per_byte(loss_sum: float, text_bytes: float) -> float:
    """Summed cross entropy (nats) over tokens spelling ``text_bytes`` bytes, in bits per byte: a figure that does
    not depend on how the tokenizer cuts the text, unlike the loss per token."""
    return float(loss_sum / math.log(2.0) / max(text_bytes, 1.0))


@contextmanager
def evaluating(model) -> Iterator[None]:
    """The model in evaluation mode for the block; the training state a forward touches is left as it was."""
    was_training = model.training
    model.set_train(False)
    try:
        yield
    finally:
        for _, moe in model.moe_layers():
            moe.take_counts()  # tokens routed by held-out batches must not move the expert biases
        model.pop_max_attention_logits()
        model.set_train(was_training)


@dataclass(frozen=True)
class UnevaluatedSource:
    """A source of the blend that a held-out split gives no sample, and why (for the result and the log)."""
    entry: int  # its position in the split's blend (data_path order)
    prefix: str
    documents: int  # all of the source's documents
    held_out_documents: int  # those the split gives the held-out split
    held_out_tokens: int
    reason: str


@dataclass
class HeldOutSamples:
    """A held-out split's dataset over the sources it gives samples, and the sources it gives none."""
    dataset: object  # BlendedDataset
    entries: list[int]  # the blend entry (data_path position) of each of the dataset's sources (dataset_id)
    unevaluated: list[UnevaluatedSource]


@dataclass
class HeldOutSplit:
    """``batches`` global batches of a held-out split of the run's blend (``split``: valid or test), and the
    setting that asked for them (``asked_by``), for messages."""
    config: TrainConfig
    split: str = "valid"
    batches: int = 1
    asked_by: str = "kiln.training.eval_iters"

    @property
    def needed(self) -> int:
        return self.batches * self.config.training.global_batch_size

    def _asked(self) -> str:
        return (f"{self.asked_by} = {self.batches} global batches of training.global_batch_size "
                f"{self.config.training.global_batch_size} = {self.needed} {self.split} samples")

    def build(self, vocab_size: int | None) -> HeldOutSamples:
        """The split's dataset over the sources it gives at least one sample (a small source may get no held-out
        document: its loss is not evaluated, and the result says why), holding ``needed`` samples without
        repeating one. No source with a sample, or a split too small for ``needed``, is a ConfigError naming
        ``asked_by`` and the field that sizes the split."""
        loader = self.config.train_dataset.dataloader
        if not isinstance(loader, BlendedMegatronLoaderConfig):
            raise ConfigError(f"{self.asked_by}: train_dataset.dataloader.type {loader.type} has no {self.split} "
                              f"split; held-out evaluation needs a BlendedMegatronDatasetDataLoader")
        field = split_field(loader, self.split)
        sized = self.config.split_samples(self.split)
        if sized is not None and sized < self.needed:
            raise ConfigError(f"{self._asked()}, but train_dataset.dataloader.sizes[{SPLITS.index(self.split)}] "
                              f"builds {sized}: lower {self.asked_by} or raise that size")
        try:
            entries, unevaluated, config = self._sources_with_samples(loader)
            if not entries:
                raise ConfigError(f"{self._asked()}, but {field} gives the {self.split} split no sample of any "
                                  f"source: " + "; ".join(source.reason for source in unevaluated))
            dataset = build_dataset(config, num_samples=sized or self.needed, split=self.split,
                                    vocab_size=vocab_size)
        except ValueError as exc:  # a blend entry that cannot be read
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{self._asked()}, but {field}: {exc}") from None
        taken = np.bincount(dataset.source_index[:self.needed], minlength=len(dataset.datasets))
        for entry, count, part in zip(entries, taken, dataset.datasets):
            per_epoch = len(part) if part.num_epochs == 1 else \
                (part.tokens_per_epoch - part._extra_token) // part.seq_length
            if count > per_epoch:
                raise ConfigError(f"{self._asked()}, but {field} gives source {entry} ({part.indexed.prefix}) "
                                  f"{per_epoch} {self.split} sample(s) and {count} are needed: the same batches "
                                  f"would repeat samples; lower {self.asked_by} or give the {self.split} split "
                                  f"more documents ({field})")
        return HeldOutSamples(dataset, entries, unevaluated)

    def _sources_with_samples(self, loader: BlendedMegatronLoaderConfig
                              ) -> tuple[list[int], list[UnevaluatedSource], TrainConfig]:
        """The blend entries whose share of the split holds one sample or more, the others with why, and the
        config whose blend for the split is the former (the run's own when that is every entry)."""
        from training.data.gpt_dataset import parse_data_path, split_document_range
        from training.data.indexed import IndexedDataset

        data = loader.config
        split_index = SPLITS.index(self.split)
        blend, ratios, where = data.blend_for(split_index)
        if blend is None:  # mock data: one source, as long as asked
            return [0], [], self.config
        prefixes, weights = parse_data_path(blend, where)
        sample_tokens = data.seq_length + int(data.add_extra_token_to_sequence)
        entries, unevaluated = [], []
        for entry, prefix in enumerate(prefixes):
            source = IndexedDataset(prefix)
            begin, end = split_document_range(ratios, split_index, source.num_documents)
            tokens = int(source.sequence_lengths[begin:end].sum(dtype=np.int64))
            if tokens >= sample_tokens:
                entries.append(entry)
                continue
            short = (f"fewer than one sample's {sample_tokens} (train_dataset.dataloader.config.seq_length "
                     f"{data.seq_length}{' + 1' if data.add_extra_token_to_sequence else ''})")
            if end <= begin:
                why = f"split {ratios!r} gives the {self.split} split none of them"
            elif data.data_path is None:  # a blend per split reads each source whole
                why = f"{tokens} tokens, {short}"
            else:
                why = f"split {ratios!r} gives the {self.split} split {end - begin} of them, {tokens} tokens, {short}"
            unevaluated.append(UnevaluatedSource(
                entry, str(prefix), source.num_documents, end - begin, tokens,
                f"{where}[{2 * entry + 1 if weights else entry}] {prefix}: {source.num_documents} document(s), "
                f"{why}"))
        if not unevaluated:
            return entries, [], self.config
        kept = [x for entry in entries for x in ((weights[entry], prefixes[entry]) if weights else (prefixes[entry],))]
        return entries, unevaluated, _with_blend(self.config, where.rsplit(".", 1)[1], kept)


def _with_blend(config: TrainConfig, field: str, blend: list) -> TrainConfig:
    """``config`` with ``train_dataset.dataloader.config.<field>`` set to ``blend``."""
    loader = config.train_dataset.dataloader
    dataloader = replace(loader, config=replace(loader.config, **{field: blend}))
    return replace(config, train_dataset=replace(config.train_dataset, dataloader=dataloader))


def split_field(loader: BlendedMegatronLoaderConfig, split: str) -> str:
    """The YAML field that decides which documents ``split`` gets."""
    data = loader.config
    if data.data_path is None and not data.mock:
        return f"train_dataset.dataloader.config.{data.SPLIT_PATHS[SPLITS.index(split)]}"
    return f"train_dataset.dataloader.config.split ({data.split or '1,0,0'!r})"


class Validation:
    """The same ``eval_iters`` global batches of the validation split at every evaluation, each cut over the
    data-parallel ranks as a training step's batch is (``sample_indices``); a rank's micro-batches of one
    global batch go through one forward (no gradients to hold), ``compiled`` or eager (HeldOutLoss), or through
    ``loss_sums`` when given (a pipeline's stages: ``Pipeline.held_out_loss_sums``)."""

    def __init__(self, config: TrainConfig, model, collectives, sample_indices, accumulation: int,
                 use_positions: bool, vocab_size: int | None, shard_inputs=None, compiled: bool = False,
                 loss_sums=None, token_bytes=None):
        self.config = config
        self.token_bytes = token_bytes  # downstream.TokenBytes of the run's tokenizer: val_bpb beside the loss
        self.shard_inputs = shard_inputs  # context parallelism: this rank's tokens of each sample
        self.model = model
        self.loss = loss_sums or HeldOutLoss(model, compiled)
        self.collectives = collectives
        self.sample_indices = sample_indices  # (first sample of the batch, micro-batch) -> this rank's indices
        self.accumulation = accumulation
        self.use_positions = use_positions
        held_out = HeldOutSplit(config, "valid", config.kiln.training.eval_iters).build(vocab_size)
        self.dataset = held_out.dataset
        self.unevaluated = held_out.unevaluated  # sources the validation split gives no sample: the run log says

    @staticmethod
    def due(config, step: int) -> bool:
        """Whether a run of ``config`` validates after ``step``."""
        interval = config.kiln.training.eval_interval
        return interval > 0 and (step % interval == 0 or step == config.training.steps)

    def evaluate(self, step: int) -> dict:
        """``{"step", "val_loss", "val_ppl"}`` over every rank's share of the batches."""
        gbs = self.config.training.global_batch_size
        loss_sum = tokens = text_bytes = text_tokens = 0.0
        with evaluating(self.model):
            for batch_index in range(self.config.kiln.training.eval_iters):
                items = [self.dataset[i] for micro in range(self.accumulation)
                         for i in self.sample_indices(batch_index * gbs, micro)]
                batch = stack_model_inputs(items, self.use_positions)
                sums, counts = forward_loss_sums(self.loss, batch, self.shard_inputs)
                loss_sum += sums.sum()
                tokens += counts.sum()
                if self.token_bytes is not None:
                    text_bytes += self.token_bytes.count(batch["labels"], batch["loss_mask"]).sum()
                    text_tokens += batch["loss_mask"].sum()
        # every rank of a tensor-parallel group holds the same sums: numerator and denominator count them alike;
        # context-parallel ranks hold parts of their samples' sums, which add up; pipeline ranks before the last
        # stage hold zeros. Bytes per token are counted on the host from whole samples by every rank alike (each
        # sample as many times as it has ranks), so their ratio is the evaluated text's
        loss_sum, tokens, text_bytes, text_tokens = self.collectives.all_reduce_array(
            np.array([loss_sum, tokens, text_bytes, text_tokens]))
        loss = float(loss_sum / max(tokens, 1.0))
        return {"step": step, "val_loss": loss, "val_ppl": perplexity(loss),
                **({"val_bpb": bits_per_byte(loss * text_tokens, text_bytes)} if self.token_bytes is not None else {})}


def validation_line(record: dict) -> str:
    """Megatron's report of an evaluation, framed by dashes as it prints it."""
    text = (f" validation loss at iteration {record['step']} | lm loss value: {record['val_loss']:.6E} | "
            f"lm loss PPL: {record['val_ppl']:.6E} | ")
    rule = "-" * (len(text) + 1)
    return f"[kiln] {rule}\n[kiln] {text}\n[kiln] {rule}"


# ---- a checkpoint's evaluation (`kiln eval`, the checkpoint_eval asset) ---------------------------------------
EVAL_VERSION = 1


def eval_sidecar(checkpoint_dir: Path, split: str, run_default: str) -> Path:
    """``eval.json``, the checkpoint's evaluation on its run's default held-out split (what checkpoint_eval
    writes), or ``eval-<split>.json`` for the other split, asked of `kiln eval --split`: a checkpoint may carry
    both, and neither overwrites the other."""
    from training.lineage import EVAL_PREFIX

    return Path(checkpoint_dir) / (f"{EVAL_PREFIX}.json" if split == run_default else f"{EVAL_PREFIX}-{split}.json")


def default_split(config: TrainConfig) -> str:
    """The test split when the run's blend cuts one (or names a test blend), else the validation split."""
    from training.data.gpt_dataset import parse_split

    data = config.train_dataset.dataloader.config
    if data.data_path is None and not data.mock:
        return "test" if data.test_data_path is not None else "valid"
    ratios = parse_split(data.split or "1,0,0")
    return "test" if len(ratios) == 3 and ratios[2] > 0 else "valid"


def _source_names(config: TrainConfig, split: str, lineage: dict) -> list[str]:
    """The source name of each entry of ``split``'s blend, from the lineage's shard records; a shard no record
    names (a run on hand-picked shards) is named by its file."""
    from training.data.gpt_dataset import parse_data_path

    blend, _, where = config.train_dataset.dataloader.config.blend_for(SPLITS.index(split))
    prefixes = parse_data_path(blend, where)[0] if blend is not None else []
    root = Path(lineage.get("data_root", "."))
    by_prefix = {str(root / shard["path"].rsplit(".", 1)[0]): shard["source"] for shard in lineage.get("shards") or []}
    return [by_prefix.get(str(Path(prefix)), Path(prefix).name) for prefix in prefixes] or ["mock"]


def _load_weights(model, path: Path) -> dict:
    """Set the model's weights from the checkpoint, every file verified as it is read; returns what was verified
    (``CheckpointFiles.origin``)."""
    from training.checkpoint import CheckpointError, load_checkpoint, numpy_dtype

    loaded = load_checkpoint(path, load_optim=False)
    for param in model.get_parameters():
        if param.name not in loaded.model:
            raise CheckpointError(f"{path}: tensor {param.name} is missing")
        param.set_data(Tensor(loaded.model[param.name].astype(numpy_dtype(param.dtype), copy=False)))
    return loaded.origin


def evaluate_checkpoint(checkpoint_dir: str | Path, split: str | None = None, batches: int = 10,
                        lineage_store: str | Path | None = None, tasks=None,
                        data_root: str | Path | None = None) -> dict:
    """Held-out loss of a checkpoint in this process: ``batches`` global batches of its run's ``split`` (default:
    test, or valid when the blend has no test split), overall and per source, with what it read (the
    checkpoint, its lineage.json's hash, the shards and their hashes, the split and the sample range); with the
    run's tokenizer known, bits per byte beside each loss, and the downstream scores of ``tasks`` (a
    downstream.TaskRun). The run's data is read under ``data_root`` when given, else where the run directory's
    move took it (``lineage.moved_run``), else where it was."""
    from training.downstream import TokenBytes, checkpoint_tokenizer
    from training.lineage import moved_run, read_lineage, results_sha256
    from training.model import build_model
    from training.parallel.mesh import ParallelDims
    from training.step import compile_blockers, configure_runtime

    checkpoint_dir = Path(checkpoint_dir)
    lineage, _ = read_lineage(checkpoint_dir, lineage_store)
    lineage, config_section = moved_run(checkpoint_dir, lineage, data_root)
    config = TrainConfig.from_dict(config_section)
    split = split or default_split(config)
    if split not in ("valid", "test"):
        raise ConfigError(f"--split {split!r}: evaluate on a held-out split, valid or test")
    processor = checkpoint_tokenizer(lineage, tasks.tokenizer_model if tasks else None, required=bool(tasks))
    token_bytes = TokenBytes(processor) if processor is not None else None
    configure_runtime(config)
    model = build_model(config.model)
    verified = _load_weights(model, checkpoint_dir)
    compiled = not compile_blockers(config, ParallelDims(world=1), model)
    loss = HeldOutLoss(model, compiled)
    held_out = HeldOutSplit(config, split, batches, "--batches").build(model.config.vocab_size)
    names = _source_names(config, split, lineage)
    samples = batches * config.training.global_batch_size
    with evaluating(model):
        per_source = _per_source_sums(loss, config, held_out, samples, len(names), token_bytes)
        scored = tasks.run(model, compiled, processor, config.model["seq_length"], checkpoint_dir) if tasks else {}
    by_name: dict[str, np.ndarray] = {}
    for entry in held_out.entries:
        by_name[names[entry]] = by_name.get(names[entry], np.zeros(4)) + per_source[entry]
    with_bytes = token_bytes is not None
    record = {
        "kiln_eval_version": EVAL_VERSION,
        "checkpoint": {"path": str(checkpoint_dir.resolve()), "step": lineage["checkpoint"]["step"],
                       "lineage_sha256": verified["lineage_sha256"]},
        "split": split, "default_split": default_split(config), "sample_range": [0, samples], "batches": batches,
        "global_batch_size": config.training.global_batch_size, "seq_length": config.model["seq_length"],
        "data_root": lineage.get("data_root"),
        "shards": [{"source": s["source"], "path": s["path"], "sha256": s["sha256"]}
                   for s in lineage.get("shards") or []],
        **_loss_summary(per_source.sum(0), with_bytes),
        "sources": {name: _loss_summary(row, with_bytes) for name, row in by_name.items()},
        # the sources the split gives no sample, and why: a small source may get no held-out document
        "unevaluated_sources": [{"source": names[s.entry], "shard": s.prefix, "documents": s.documents,
                                 "held_out_documents": s.held_out_documents, "held_out_tokens": s.held_out_tokens,
                                 "reason": s.reason} for s in held_out.unevaluated],
        **scored,
        "evaluated_at": datetime.now(timezone.utc).isoformat(),
    }
    return {**record, "results_sha256": results_sha256(record)}


def _per_source_sums(loss: HeldOutLoss, config: TrainConfig, held_out: HeldOutSamples, samples: int, sources: int,
                     token_bytes) -> np.ndarray:
    """Per blend entry: the loss sum, tokens, samples and the tokens' bytes (``token_bytes``, when the run's
    tokenizer is known) of the first ``samples`` samples of ``held_out``, forward in local batches."""
    use_positions = config.train_dataset.dataloader.config.reset_position_ids
    per_source = np.zeros((sources, 4))
    lbs = config.training.local_batch_size
    for first in range(0, samples, lbs):
        items = [held_out.dataset[i] for i in range(first, min(first + lbs, samples))]
        batch = stack_model_inputs(items, use_positions)
        sums, counts = forward_loss_sums(loss, batch)
        text_bytes = token_bytes.count(batch["labels"], batch["loss_mask"]) if token_bytes else np.zeros(len(items))
        for item, loss_sum, tokens, size in zip(items, sums, counts, text_bytes):
            per_source[held_out.entries[item["dataset_id"]]] += (loss_sum, tokens, 1, size)
    return per_source


def _loss_summary(row: np.ndarray, with_bytes: bool) -> dict:
    """A row of ``_per_source_sums`` (or their total) as the record gives it."""
    loss = float(row[0] / max(row[1], 1.0))
    return {"loss": loss, "ppl": perplexity(loss), "tokens": int(row[1]), "samples": int(row[2]),
            **({"bpb": bits_per_byte(row[0], row[3]), "bytes": int(row[3])} if with_bytes else {})}


def write_evaluation(record: dict) -> Path:
    """The record as its checkpoint's evaluation sidecar (``eval_sidecar``; written whole or not at all)."""
    from training.lineage import record_evaluation_in_index

    path = eval_sidecar(Path(record["checkpoint"]["path"]), record["split"], record["default_split"])
    write_json_atomic(path, record)
    record_evaluation_in_index(path.parent.parent, record["checkpoint"]["step"], path.name, list(record["sources"]))
    return path
