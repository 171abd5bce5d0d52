"""Dropout whose randomness Kiln owns, so a resumed run draws the masks the uninterrupted run drew.

MindSpore 2.10's CPU build has no kernel for ``mint.nn.functional.dropout``, and the streams behind
``ops.dropout``/``ops.uniform``/``ops.bernoulli`` cannot be saved and restored (``get_rng_state`` after
``set_seed`` is 16 zero bytes and setting it back does not repeat the draws). So the keep-masks come from
a numpy Philox generator keyed by (seed, rank), drawn on the host and multiplied in as a tensor; its state
is part of the checkpoint's random state. An Ascend fast path would replace ``MaskStream`` only.
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn

from training.model.layers import cast


class MaskStream:
    """Inverted-dropout keep-masks (kept elements scaled by 1/(1-p)) from one Philox stream per rank."""

    def __init__(self, seed: int = 0, rank: int = 0):
        self.reset(seed, rank)

    def reset(self, seed: int, rank: int) -> None:
        """Start the stream of ``rank`` under ``seed`` (every rank draws its own masks)."""
        self.generator = np.random.Generator(np.random.Philox(key=np.array([seed, rank], dtype=np.uint64)))

    def mask(self, shape: tuple[int, ...], p: float) -> Tensor:
        keep = self.generator.random(shape, dtype=np.float32) >= p
        return Tensor(keep.astype(np.float32) / np.float32(1.0 - p))

    def state(self) -> dict:
        """The generator state as JSON (Philox: key, counter, buffer), for the checkpoint."""
        state = self.generator.bit_generator.state
        return {"bit_generator": state["bit_generator"], "counter": [int(x) for x in state["state"]["counter"]],
                "key": [int(x) for x in state["state"]["key"]], "buffer": [int(x) for x in state["buffer"]],
                "buffer_pos": int(state["buffer_pos"]), "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"])}

    def set_state(self, state: dict) -> None:
        """Back to a ``state()`` record; KeyError/TypeError/ValueError when it is not one."""
        if state["bit_generator"] != "Philox":
            raise ValueError(f"bit_generator {state['bit_generator']!r}, expected 'Philox'")
        self.generator.bit_generator.state = {
            "bit_generator": "Philox",
            "state": {"counter": np.array(state["counter"], dtype=np.uint64),
                      "key": np.array(state["key"], dtype=np.uint64)},
            "buffer": np.array(state["buffer"], dtype=np.uint64), "buffer_pos": int(state["buffer_pos"]),
            "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}


class Dropout(nn.Cell):
    """Zeroes elements with probability ``p`` in training (``set_train(True)``), masks from ``stream`` (set by
    the model that owns the stream); the identity in evaluation or at p = 0."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.stream: MaskStream | None = None

    def construct(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return x * cast(self.stream.mask(tuple(x.shape), self.p), x.dtype)
