"""Ascend's fused kernels, selectable and never required: FlashAttentionScore for attention
(``model.use_flash_attention``) and the fused cross-entropy (``fast_step.fused_cross_entropy``).

Neither has a CPU kernel, so on CPU (and GPU) the plain path runs and the trainer's ``training step:`` line says
why. Written against MindSpore 2.10's documented API (``ops.flash_attention_score``,
``mint.nn.functional.cross_entropy``) and checked here against CPU stand-ins written from those docstrings
(tests/test_ascend.py); not run on an Ascend device.
"""
from __future__ import annotations

import functools

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, nn, ops

from training.config import require

# the module's references to the fused ops (the tests put CPU stand-ins here)
flash_attention_score = ops.flash_attention_score
fused_cross_entropy = mint.nn.functional.cross_entropy

FLASH_DTYPES = (ms.float16, ms.bfloat16)  # FlashAttentionScore has no float32 kernel
# sparse_mode 2 (causal from the top-left corner) reads its pattern from a fixed 2048 x 2048 mask, whatever seq is
CAUSAL_MODE, FULL_MASK_MODE, CAUSAL_TILE = 2, 0, 2048


def on_ascend() -> bool:
    return ms.get_context("device_target") == "Ascend"


def check_config(config, path: str) -> None:
    """The model config's fused-attention request against this device (GPTConfig.check calls it): on Ascend the
    kernel takes float16/bfloat16 only. An error rather than a quiet fallback: on Ascend the request is for the
    kernel's memory (no [seq, seq] scores kept), and plain attention in float32 could run out of it."""
    if config.use_flash_attention and on_ascend():
        require(config.dtype("compute_dtype") in FLASH_DTYPES,
                f"{path}.use_flash_attention = True needs {path}.compute_dtype float16 or bfloat16 on Ascend "
                f"(FlashAttentionScore has no float32 kernel), got {config.compute_dtype!r}: set {path}.compute_dtype: "
                f"bfloat16, or {path}.use_flash_attention: False for the plain attention")


def flash_attention_blocker(config) -> str | None:
    """Why the attention layers of a model of ``config`` do not run FlashAttentionScore although
    ``model.use_flash_attention`` asks for it; None when they do (or when it is not asked for). One answer for the
    layers and the trainer's log line: the query/key head size is the config's (``attention_dims``)."""
    if not config.use_flash_attention:
        return None
    qk_head_dim = config.attention_dims()[1]
    if not on_ascend():
        return (f"FlashAttentionScore is an Ascend kernel and this run's device is "
                f"{ms.get_context('device_target')}")
    if qk_head_dim % 16 or qk_head_dim > 512:
        return f"FlashAttentionScore takes head sizes that are multiples of 16 up to 512, these heads are {qk_head_dim}"
    return None


def flash_attention(config) -> "FlashAttention | None":
    """The fused attention for an attention layer of ``config`` (None: the plain path)."""
    asked_and_possible = config.use_flash_attention and flash_attention_blocker(config) is None
    return FlashAttention() if asked_and_possible else None


@functools.cache
def _causal_tile() -> Tensor:
    return Tensor(np.triu(np.ones((CAUSAL_TILE, CAUSAL_TILE), np.uint8), k=1))  # 1 = discard


class FlashAttention(nn.Cell):
    """``SelfAttention._causal_attention`` by FlashAttentionScore, same arguments and result: q [batch, groups,
    per_group, seq, dim], k [batch, groups, seq, dim], v [batch, groups, seq, dim_v], the mask as the model makes
    it (causal_mask or additive_mask, stacked per_group times).

    * q is already scaled (Kiln folds 1/√dim into q's rotary tables, MLA multiplies q), so ``scalar_value`` is 1.
    * GQA: Kiln stacks a group's query heads along the query axis; the kernel takes N1 = groups·per_group query
      heads (BNSD) and N2 = groups key heads instead, query head n reading key head n // per_group, which is
      Kiln's head order (q head g·per_group + j is KV group g). MindSpore's docstring says only that N2 divides
      N1; this grouping is the one GQA kernels use.
    * The kernel takes value shaped as key: MLA's narrower value heads are padded with zeros to q's width and
      the output cut back (zero value columns give zero output columns).
    * Masks: the 2-D causal mask becomes the kernel's causal mode (sparse_mode 2 and its 2048 x 2048 tile, so no
      [seq, seq] mask is read); the dataset's per-sample masks ([batch, 1, seq, seq], block-causal) go in whole
      (sparse_mode 0), one copy of the stacked additive mask turned back into 1 = discard."""

    def __init__(self):
        super().__init__()
        self.causal_tile = _causal_tile()

    def construct(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        batch, groups, per_group, seq, dim = q.shape
        values = v.shape[-1]
        if values < dim:
            v = ops.cat((v, ops.zeros((*v.shape[:-1], dim - values), v.dtype)), axis=-1)
        if mask.ndim == 2:
            attn_mask, sparse_mode = self.causal_tile, CAUSAL_MODE
        else:
            first_copy = ops.slice(mask, (0, 0, 0, 0), (mask.shape[0], 1, seq, seq))
            attn_mask, sparse_mode = (first_copy < 0).astype(ms.uint8), FULL_MASK_MODE
        heads = groups * per_group
        out = flash_attention_score(q.reshape(batch, heads, seq, dim), k, v, heads, attn_mask=attn_mask,
                                    scalar_value=1.0, input_layout="BNSD", sparse_mode=sparse_mode)
        out = out.reshape(batch, groups, per_group, seq, dim)
        if values < dim:
            out = ops.slice(out, (0, 0, 0, 0, 0), (batch, groups, per_group, seq, values))
        return out


def fused_token_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """``layers.token_cross_entropy`` by Ascend's fused kernel: per-token -log p(label) for logits [tokens,
    vocab] and labels [tokens], unreduced (the model masks and averages)."""
    return fused_cross_entropy(logits, labels, reduction="none")  # labels int32 or int64, as the kernel takes


def select_kernels(model, config, dims) -> list[str]:
    """Puts the fused cross-entropy into ``model`` when this run allows it (``fast_step.fused_cross_entropy``, on
    Ascend, without tensor parallelism's vocab-parallel loss, which replaced ``model.token_loss`` already) and
    says, for the trainer's ``training step:`` line, what each fused kernel asked for does in this run.

    ``model.use_flash_attention`` was applied when the attention layers were built (``flash_attention``); a
    layer still attends plainly under context parallelism (its ring / Ulysses attention is Kiln's own) and
    while max-attention-logit tracking reads the scores, which the fused kernel does not return."""
    notes = []
    model_config = model.config
    if model_config.use_flash_attention:
        blocker = flash_attention_blocker(model_config)
        blockers = [blocker] if blocker else []
        if dims.cp_enabled:
            blockers.append("context parallel runs its own ring/Ulysses attention")
        if config.kiln.train_state.max_attention_logit:
            blockers.append("kiln.train_state.max_attention_logit reads the attention scores, which "
                            "FlashAttentionScore does not return")
        notes.append("attention: plain masked softmax, not FlashAttentionScore (model.use_flash_attention asks for "
                     f"it): {'; '.join(blockers)}" if blockers else
                     "attention: FlashAttentionScore (model.use_flash_attention)")
    if on_ascend():
        if not config.fast_step.fused_cross_entropy:
            notes.append("cross-entropy: log_softmax + gather (fast_step.fused_cross_entropy is false)")
        elif dims.tp_enabled:
            notes.append("cross-entropy: tensor parallelism's vocab-parallel loss, not the fused kernel")
        else:
            model.token_loss = fused_token_cross_entropy
            notes.append("cross-entropy: fused (mint.nn.functional.cross_entropy, fast_step.fused_cross_entropy)")
    return notes
