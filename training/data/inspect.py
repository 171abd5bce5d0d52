"""`kiln dataset inspect`: the first samples of a run's dataset, exactly as training reads them."""
from __future__ import annotations

import numpy as np

from training.config import SPLITS, BlendedMegatronLoaderConfig, TrainConfig
from training.data.gpt_dataset import parse_data_path
from training.data.loader import build_dataset


def source_labels(config: TrainConfig, dataset, split: str) -> list[str]:
    loader = config.train_dataset.dataloader
    if isinstance(loader, BlendedMegatronLoaderConfig):
        blend, _, where = loader.config.blend_for(SPLITS.index(split))
        return parse_data_path(blend, where)[0] if blend is not None else ["mock data"]
    return list(dataset.labels)


MAX_SAMPLES = 10_000  # a screenful's worth many times over; building a split for more takes minutes


def inspect_samples(config: TrainConfig, split: str = "train", num: int = 8) -> tuple[np.ndarray, list[str]]:
    """The first ``num`` samples' raw tokens ([num, seq_length + 1] int64) and each one's source.

    The split is built for as many samples as the trainer builds it for (``TrainConfig.split_samples``), so
    the shuffles and the blend are the ones training uses; sample i is read at step i // global_batch_size.
    """
    if not 1 <= num <= MAX_SAMPLES:
        raise ValueError(f"--num {num}: must be between 1 and {MAX_SAMPLES:,} (the samples are printed one by one)")
    total = config.split_samples(split) or num
    if num > total:
        raise ValueError(f"--num {num}: the {split} split of this config holds {total} samples")
    dataset = build_dataset(config, num_samples=total, split=split)
    labels = source_labels(config, dataset, split)
    tokens = np.stack([dataset.sample_tokens(i).astype(np.int64) for i in range(num)])
    return tokens, [labels[dataset.source_of(i)] for i in range(num)]


def render(tokens: np.ndarray, sources: list[str], global_batch_size: int, decode=None, width: int = 16) -> str:
    """One block per sample: index, step, source, the first token ids and, with a tokenizer, the text."""
    lines = []
    for i, (row, source) in enumerate(zip(tokens, sources)):
        head = " ".join(map(str, row[:width].tolist())) + (" …" if row.size > width else "")
        lines.append(f"sample {i} (step {i // global_batch_size}) from {source}: {row.size} tokens")
        lines.append(f"  ids: {head}")
        if decode is not None:
            text = decode(row.tolist())
            lines.append(f"  text: {text[:200]!r}" + (" …" if len(text) > 200 else ""))
    return "\n".join(lines)
