"""A run's state as parts that each give and take their own, and the checkpoint manager that saves and restores
that set, so what a checkpoint holds and what a resume reads cannot drift apart.

Every part is ``Stateful``: ``state_dict()`` gives its state, ``load_state_dict(state)`` takes it back. The parts:

=============  ==========================================  ===============================================
part           its state                                   where a checkpoint keeps it
=============  ==========================================  ===============================================
model          this rank's array of each tensor it holds   ``<prefix>-model-*.safetensors``
optimizer      AdamW's moments and its update count        ``<prefix>-opt-*.safetensors`` (MindFormers')
lr_schedule    the learning rate it is at                  kiln_state.json ``lr``
data_position  steps done, samples consumed                common.json (MindFormers' fields), kiln_state.json
                                                           ``data_position``
rng            every random generator the run draws from   kiln_state.json ``rng``
=============  ==========================================  ===============================================

The LR schedule is a function of the optimizer's update count (saved with the optimizer, as MindFormers does), so
restoring the optimizer puts it back where it was; its own state is the rate it was at, which a resume compares
with the rate the schedule gives there now (they differ when lr_scheduler or training.steps changed).
A checkpoint also records what an audit needs (the step's loss, tokens seen, the config's hash, the world size and
MindFormers' bookkeeping fields): ``CheckpointRecord``, written beside the state and never read back into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from training.checkpoint import (KILN_STATE, CheckpointError, CheckpointSaver, complete_steps, is_hf_dir,
                                 iteration_dir, load_checkpoint, load_checkpoint_balanced)
from training.config import TrainConfig


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def micro_batch_indices(consumed_samples: int, micro: int, rank: int, dp: int, local_batch_size: int) -> range:
    """The global sample indices that data-parallel rank ``rank`` reads for micro-batch ``micro`` of the
    step starting at ``consumed_samples``: ranks take disjoint, interleaved slices of the global batch, so
    concatenating (micro 0: rank 0, 1, …; micro 1: …) gives the single-process order."""
    start = consumed_samples + (micro * dp + rank) * local_batch_size
    return range(start, start + local_batch_size)


@dataclass
class DataPosition:
    """Where the run is: ``step`` steps done, ``consumed_samples`` samples of the blend read (sample order is a
    pure function of it and the dataset's ``seed``)."""
    global_batch_size: int
    seed: int
    step: int = 0
    consumed_samples: int = 0

    def advance(self) -> None:
        """One step done: the data is consumed whether or not its update was applied."""
        self.step += 1
        self.consumed_samples += self.global_batch_size

    def state_dict(self) -> dict:
        return {"global_step": self.step, "consumed_samples": self.consumed_samples,
                "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved sample; under another global batch size the step is the samples' count of this
        run's steps, rounded down (the data continues where it stopped, none read twice or skipped)."""
        self.consumed_samples = int(state["consumed_samples"])
        self.step = (int(state["global_step"]) if state["global_batch_size"] == self.global_batch_size
                     else self.consumed_samples // self.global_batch_size)


class GeneratorStates:
    """Every generator a run draws from, as JSON: the dropout mask stream (the model's ``MaskStream``, this
    rank's), MindSpore's default generator (its raw state bytes) and numpy's global MT19937. (Model init draws
    from its own seeded RandomState, and sample order is a pure function of the dataset seed, so neither needs
    saving.)"""

    def __init__(self, seed: int, dropout_masks=None):
        self.seed, self.dropout_masks = seed, dropout_masks

    def state_dict(self) -> dict:
        import mindspore as ms

        name, key, pos, has_gauss, cached = np.random.get_state()
        state = {"seed": self.seed,
                 "mindspore_default_generator": [int(b) for b in ms.get_rng_state().asnumpy().reshape(-1)],
                 "numpy_global": {"bit_generator": name, "key": [int(k) for k in key], "pos": int(pos),
                                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
        if self.dropout_masks is not None:
            state["dropout_masks"] = self.dropout_masks.state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Set the generators back to ``state_dict``'s record. A record without the dropout stream's state (a
        checkpoint from before Kiln saved it) leaves the stream where the seed started it."""
        import mindspore as ms

        if not isinstance(state, dict) or "mindspore_default_generator" not in state:
            raise CheckpointError("field rng has no generator states")
        try:
            ms_state = np.array(state["mindspore_default_generator"], dtype=np.uint8)
            numpy_state = state["numpy_global"]
            np.random.set_state((numpy_state["bit_generator"], np.array(numpy_state["key"], dtype=np.uint32),
                                 numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
            if self.dropout_masks is not None and "dropout_masks" in state:
                self.dropout_masks.set_state(state["dropout_masks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"field rng is malformed ({exc!r})") from None
        ms.set_rng_state(ms.Tensor(ms_state))


class LrSchedulePosition:
    """The learning rate the schedule is at: the schedule of the optimizer's update count (``AdamW.current_lr``)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.saved_lr: float | None = None  # the rate of the checkpoint resumed from

    def state_dict(self) -> dict:
        return {"lr": self.optimizer.current_lr}

    def load_state_dict(self, state: dict) -> None:
        """Keep the saved rate, to compare once the optimizer's update count is restored (``changed``)."""
        self.saved_lr = float(state["lr"])

    def changed(self) -> bool:
        return self.saved_lr is not None and self.saved_lr != self.optimizer.current_lr


@dataclass
class CheckpointRecord:
    """What a checkpoint records beside the state, for MindFormers and for an audit: never read back into it."""
    loss: float | None  # the step's loss (None: saved before the first step)
    tokens_seen: int
    config_sha256: str
    world_size: int
    total_steps: int
    ckpt_status: int  # 1: an unhealthy step since the previous save (monitor.health_checkpoint)


@dataclass
class Restored:
    """What a load took: from where, and the lineage record of what was verified (``CheckpointFiles.origin``)."""
    path: Path
    origin: dict | None


class CheckpointManager:
    """Saves and restores the run's state parts (module docstring) as MindFormers' step checkpoints, through
    ``saver`` (collective: every rank calls ``save`` at the same steps)."""

    def __init__(self, config: TrainConfig, world, collectives, reporter, parts: dict[str, Stateful]):
        ckpt = config.checkpoint
        self.config, self.world, self.collectives, self.reporter = config, world, collectives, reporter
        self.parts = parts
        self.model, self.optimizer = parts["model"], parts["optimizer"]
        self.lr_schedule, self.rng = parts["lr_schedule"], parts["rng"]
        self.data_position = parts["data_position"]
        self.saver = CheckpointSaver(save_path=Path(ckpt.save_path), prefix=ckpt.prefix, save_max=ckpt.save_max,
                                     world=world, collectives=collectives, remove_redundancy=ckpt.remove_redundancy,
                                     async_save=ckpt.async_save)

    # ---- saving --------------------------------------------------------------------------------------
    def save(self, record: CheckpointRecord, lineage: dict) -> None:
        """Every part's state and ``record`` as the checkpoint of the current step."""
        data = self.data_position.state_dict()
        common = {"epoch_num": 1, "step_num": record.total_steps, "global_step": data["global_step"],
                  "loss_scale": 1.0, "global_batch_size": data["global_batch_size"],
                  "consumed_samples": data["consumed_samples"], "ckpt_status": record.ckpt_status}
        kiln_state = {"loss": record.loss, **self.lr_schedule.state_dict(), "tokens_seen": record.tokens_seen,
                      "config_sha256": record.config_sha256,
                      "data_position": {"consumed_samples": data["consumed_samples"], "seed": data["seed"]},
                      "rng": self.rng.state_dict(), "world_size": record.world_size}
        arrays = {"model": self.model.state_dict(),
                  "opt": {} if self.config.checkpoint.no_save_optim else self.optimizer.state_dict()}
        layouts, remote = self.model.save_layouts(arrays, self.collectives)
        self.saver.save(step=data["global_step"], model=arrays["model"], optim=arrays["opt"] or None, common=common,
                        state=kiln_state, lineage=lineage, layouts=layouts, remote=remote)

    def refuse_second_history(self) -> None:
        """A save path holds one run's history: saving from this step beside checkpoints of later steps would
        replace some of them and leave rotation and the tracker mixing two histories."""
        save_path, step = Path(self.config.checkpoint.save_path), self.data_position.step
        later = [s for s in complete_steps(save_path) if s > step]
        if later:
            raise CheckpointError(
                f"checkpoint.save_path {save_path} holds checkpoints of steps after this run's start "
                f"(step {step}): {', '.join(iteration_dir(save_path, s).name for s in later[:5])}"
                f"{' …' if len(later) > 5 else ''}; training from step {step} here would overwrite or mix "
                f"with them: save into a new checkpoint.save_path, or resume from the newest")

    # ---- restoring -----------------------------------------------------------------------------------
    def restore(self, path: Path, load_unverified: bool = False) -> Restored:
        """The parts' state from checkpoint ``path`` (an ``iteration_*`` directory, or a Hugging Face directory:
        weights only); with checkpoint.no_load_optim the weights only. The run then starts at step 0 or where the
        checkpoint's run stopped."""
        if is_hf_dir(path):
            from training.hf import load_hf_weights  # the converter is only needed for this kind of load

            weights, origin = load_hf_weights(path, self.config.model)
            self._load_model(path, self.model.parallel.own_chunks(weights), {})
            self.reporter.info(f"[kiln] loaded Hugging Face weights from {path} (weights only); starting at step 0")
            return Restored(path, origin)
        loaded = self._load(path, load_unverified)
        if not loaded.origin["verified"]:
            self.reporter.warning(f"{path} loaded UNVERIFIED (--load-unverified): it has no lineage.json to check its "
                                  f"files against; this run's lineage records it as unverified, with the sha256 of "
                                  f"each file read")
        if self.config.checkpoint.no_load_optim:
            self._load_model(path, loaded.model, loaded.stored)
            self.reporter.info(f"[kiln] loaded weights only from {path}; starting at step 0")
            return Restored(path, loaded.origin)
        self._load_model(path, *self._masters_as_weights(loaded))
        if not loaded.optim:
            raise CheckpointError(f"{path}: no optimizer state (saved with no_save_optim?); "
                                  f"set checkpoint.no_load_optim to load the weights only")
        self.optimizer.load_state_dict(loaded.optim)
        self._restore_kiln_state(path, loaded)
        self._restore_data(path, loaded.common)
        return Restored(path, loaded.origin)

    def _load(self, path: Path, load_unverified: bool):
        ckpt = self.config.checkpoint
        if ckpt.load_balanced:
            return load_checkpoint_balanced(path, self.world, self.collectives, load_optim=not ckpt.no_load_optim,
                                            readers=ckpt.load_worker_number, layouts=self.model.load_layouts(),
                                            allow_unverified=load_unverified)
        return load_checkpoint(path, rank=self.world.rank, load_optim=not ckpt.no_load_optim,
                               layouts=self.model.load_layouts(), allow_unverified=load_unverified)

    def _load_model(self, path: Path, weights: dict[str, np.ndarray], stored: dict[str, str]) -> None:
        """The model part from ``weights``; the log says which tensors changed dtype (``stored``: their dtype in
        the files), e.g. MindFormers' bfloat16 on CPU."""
        converted = self.model.conversions(weights, stored)
        try:
            self.model.load_state_dict(weights)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        for (was, now), count in sorted(converted.items()):
            self.reporter.info(f"[kiln] {count} tensor(s) stored as {was} loaded as the model's {now}")

    def _masters_as_weights(self, loaded) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The weights to load and their stored dtypes: a low-precision parameter saved with its fp32 master
        (``main_param.<name>``, MindFormers' bf16 training) that is fp32 here takes the master, its exact
        value; the master leaves the optimizer state, which has none for an fp32 parameter."""
        import mindspore as ms

        weights, stored = dict(loaded.model), dict(loaded.stored)
        taken = 0
        for param in self.model.model.get_parameters():
            master = f"main_param.{param.name}"
            if param.dtype == ms.float32 and master in loaded.optim:
                weights[param.name], stored[param.name] = loaded.optim.pop(master), stored.pop(master)
                taken += 1
        if taken:
            self.reporter.info(f"[kiln] {taken} parameter(s) saved in low precision take their fp32 masters "
                               f"(main_param.*) from {loaded.path}: the model trains them in float32 here")
        return weights, stored

    def _restore_kiln_state(self, path: Path, loaded) -> None:
        """The random generators and the LR schedule's rate, from Kiln's sidecar (a MindFormers checkpoint has
        none: the generators then start from the seed)."""
        seed = self.config.training.seed
        if loaded.state is None:
            self.reporter.info(f"[kiln] {path} has no {KILN_STATE} (saved by MindFormers?): the random generators "
                               f"start from training.seed {seed}, not where that run left them")
            return
        rng = loaded.state.get("rng")
        try:
            self.rng.load_state_dict(rng)
        except CheckpointError as exc:
            raise CheckpointError(f"{loaded.state_path}: {exc}") from None
        if "dropout_masks" not in rng:
            self.reporter.info(f"[kiln] {loaded.state_path} has no dropout mask state (saved before Kiln "
                               f"kept one): dropout masks start from training.seed {seed}")
        if "lr" in loaded.state:
            self.lr_schedule.load_state_dict(loaded.state)
            if self.lr_schedule.changed():
                self.reporter.info(f"[kiln] the LR schedule gives {self.optimizer.current_lr:.6e} at update "
                                   f"{self.optimizer.global_step}, where the saved run was at "
                                   f"{self.lr_schedule.saved_lr:.6e} (lr_scheduler or training.steps changed)")

    def _restore_data(self, path: Path, common: dict) -> None:
        self.data_position.load_state_dict({**common, "seed": self.data_position.seed})
        saved_gbs, gbs = common["global_batch_size"], self.data_position.global_batch_size
        consumed, step = self.data_position.consumed_samples, self.data_position.step
        if saved_gbs != gbs:
            self.reporter.info(f"[kiln] global batch size changed {saved_gbs} -> {gbs}: keeping the "
                               f"{consumed} consumed samples, so the data continues at sample "
                               f"{consumed}; step {common['global_step']} × {saved_gbs} samples "
                               f"= step {step} × {gbs} (rounded down); the optimizer's own step, which "
                               f"drives the LR schedule, is kept as saved")
        self.reporter.info(f"[kiln] resumed from {path} at step {step}, {consumed} samples consumed")
