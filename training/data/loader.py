"""The dataset a training config describes, built one way for the trainer and `kiln dataset inspect`.

`train_dataset.dataloader.type` picks the reader: `BlendedMegatronDatasetDataLoader` (Megatron
.bin/.idx sources blended by weight, GPTDataset samples) or `MindDataset` (MindRecord sources, blended as
kiln.mindrecord says). Both give items with `input_ids`, `labels`, `loss_mask` and
`position_ids`, plus `attention_mask` or `actual_seq_len` when document-local attention is asked for.
"""
from __future__ import annotations

import numpy as np

from training.config import SPLITS, BlendedMegatronLoaderConfig, MindDatasetLoaderConfig, TrainConfig
from training.data.gpt_dataset import block_causal_mask_from_actual_seq_len, build_blended_dataset
from training.data.mindrecord import build_mindrecord_train_dataset


def build_dataset(config: TrainConfig, num_samples: int, split: str = "train", vocab_size: int | None = None):
    """``num_samples`` samples of ``split`` in the order training reads them (sample i of step s is
    global sample s·global_batch_size + i). With ``vocab_size`` (the model's), a source (Megatron or
    MindRecord) holding a larger token id is an error naming it, before training rather than in the embedding's
    Gather."""
    loader = config.train_dataset.dataloader
    if isinstance(loader, MindDatasetLoaderConfig):
        if split != "train":
            raise ValueError(f"train_dataset.dataloader: a MindDataset has no {split!r} split")
        return build_mindrecord_train_dataset(loader.dataset_files, shuffle=loader.shuffle, blend=config.kiln.mindrecord,
                                              num_samples=num_samples, vocab_size=vocab_size)
    assert isinstance(loader, BlendedMegatronLoaderConfig)
    c = loader.config
    split_index = SPLITS.index(split)
    blend, split_ratios, where = c.blend_for(split_index)
    return build_blended_dataset(
        blend, seq_length=c.seq_length, num_samples=num_samples, seed=c.seed, split=split_ratios,
        split_index=split_index, eod_id=c.eod, pad_id=c.pad, cache_dir=c.path_to_cache, where=where,
        vocab_size=vocab_size,
        builder_threads=c.num_dataset_builder_threads,
        # unset reads the .bin files without mmap, as in MindFormers (its loader passes None to Megatron's
        # IndexedDataset, whose `if mmap:` then picks the file reader)
        mmap_bin=bool(c.mmap_bin_files),
        drop_last_partial_validation_sequence=c.drop_last_partial_validation_sequence,
        add_extra_token_to_sequence=c.add_extra_token_to_sequence, reset_position_ids=c.reset_position_ids,
        reset_attention_mask=c.reset_attention_mask, eod_mask_loss=c.eod_mask_loss,
        # the model builds the plain causal mask itself: a per-sample mask only when documents must not see
        # each other (a [seq, seq] array per sample is not free)
        create_attention_mask=c.document_attention and not c.create_compressed_eod_mask,
        create_compressed_eod_mask=c.create_compressed_eod_mask, eod_pad_length=c.eod_pad_length)


def seq_length_of(config: TrainConfig, dataset) -> int:
    loader = config.train_dataset.dataloader
    return loader.config.seq_length if isinstance(loader, BlendedMegatronLoaderConfig) else dataset.seq_length


def stack_model_inputs(items: list[dict], use_positions: bool) -> dict[str, np.ndarray]:
    """A micro-batch's model inputs from its items: always input_ids, labels, loss_mask; position_ids
    when positions restart at documents; attention_mask ([batch, 1, seq, seq], 1 = masked) when the
    items carry one, or carry `actual_seq_len` (rebuilt into the same block-causal mask)."""
    batch = {"input_ids": np.stack([i["input_ids"] for i in items]).astype(np.int32),
             "labels": np.stack([i["labels"] for i in items]).astype(np.int32),
             "loss_mask": np.stack([i["loss_mask"] for i in items]).astype(np.float32)}
    if use_positions:
        batch["position_ids"] = np.stack([i["position_ids"] for i in items]).astype(np.int32)
    if "attention_mask" in items[0]:
        batch["attention_mask"] = np.stack([i["attention_mask"] for i in items])
    elif "actual_seq_len" in items[0]:
        size = items[0]["input_ids"].size
        batch["attention_mask"] = np.stack([block_causal_mask_from_actual_seq_len(i["actual_seq_len"], size)
                                            for i in items])
    return batch
