"""The training loop: PyNative training under any of Kiln's parallel layouts, with step checkpoints and live
reporting.

Sample order is a pure function of the step: global step ``s`` consumes samples
``[s·gbs, (s+1)·gbs)`` of the blended dataset, and rank ``r`` takes micro-batch ``m`` from offset
``(m·dp + r)·lbs`` inside that window. So a resumed run reads exactly what an uninterrupted one would.
The run's state (model parts, optimizer, LR schedule, data position, random generators) saves and restores itself
through the checkpoint manager (training/train_state.py).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor

from training.atomic import write_text_atomic
from training.checkpoint import resolve_load_path
from training.config import BlendedMegatronLoaderConfig, TrainConfig, config_sha256, dump_config
from training.data.loader import build_dataset, seq_length_of, stack_model_inputs
from training.downstream import token_bytes_of
from training.evaluation import Validation, validation_line
from training.forward import model_input_tensors
from training.model import ascend, build_model
from training.model_parts import add_loss_parts, model_parts
from training.monitor import HealthMonitor, MoeMonitor, TrainStateMonitor, summary_line
from training.optim import SkipStepOnNaN, build_lr_schedule, build_optimizer
from training.parallel.comm import Collectives
from training.parallel.mesh import DeviceMesh, ParallelDims, World
from training.parallel.parallelize import parallelize
from training.profiling import build_profiler, profile_root
from training.recompute import apply_recompute
from training.reporting import Reporter
from training.step import build_step_functions, compile_blockers, degrees
from training.train_state import (CheckpointManager, CheckpointRecord, DataPosition, GeneratorStates,
                                  LrSchedulePosition, micro_batch_indices)


@dataclass
class TrainSummary:
    start_step: int
    end_step: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None
    last_checkpoint: str | None


def _lr_section(config: TrainConfig) -> dict:
    return {k: v for k, v in config.lr_scheduler.to_dict().items() if v is not None}


class Trainer:
    def __init__(self, config: TrainConfig, world: World, output_dir: Path, reporter: Reporter,
                 lineage_inputs: dict | None = None, command: list[str] | None = None, load_unverified: bool = False):
        self.config, self.world, self.reporter = config, world, reporter
        self.collectives = Collectives(world)
        self.output_dir = Path(output_dir)
        self.mesh = DeviceMesh(ParallelDims.from_config(config.parallelism, world.size), world.rank)
        self.accumulation = self.mesh.dims.check_batch(config.training)
        self.dp = self.mesh.dims.dp
        # how many times the ranks' losses, summed over the world, count the global batch's loss: context-parallel
        # ranks each hold a part of their samples' losses, every other rank a whole copy
        self.loss_copies = world.size // (self.mesh.dims.cp * self.mesh.dims.pp)
        self.resolved_yaml = dump_config(config)
        # named by content: a later invocation in the same run dir (a resume) must not overwrite it
        self.resolved_config_path = (self.output_dir / f"config-{config_sha256(self.resolved_yaml)[:12]}.yaml").resolve()
        self.lineage_inputs = lineage_inputs or {}
        self.command = command or []
        self.started_at = datetime.now(timezone.utc).isoformat()
        self.last_checkpoint: str | None = None
        self.saved_metrics: dict[int, dict] = {}  # rank 0: each pending checkpoint's step record, reported when done
        self.last_metrics: dict | None = None  # the last step's, None before the first

        fused_kernels = self._build_model_and_data()
        self._build_step(fused_kernels)
        self._build_state(load_unverified)

    def _build_model_and_data(self) -> list[str]:
        """The model (seeded, cut for this rank's layout), its parts and the training data; returns the fused
        kernels' lines for the step's description."""
        config, rank = self.config, self.world.rank
        ms.set_seed(config.training.seed)
        np.random.seed(config.training.seed)
        self.model = build_model(config.model)
        self.model.dropout_masks.reset(config.training.seed, rank)  # each rank its own dropout masks
        self.model.set_train(True)  # dropout on
        # the data's sequence length, then the model's size and FLOPs, counted before parallelize leaves each rank
        # only its shards (the dataset draws from its own seeded generators: building it here moves no stream)
        self.dataset = build_dataset(config, num_samples=config.split_samples("train"),
                                     vocab_size=self.model.config.vocab_size)
        self.seq_length = seq_length_of(config, self.dataset)
        self.num_parameters = self.model.num_parameters()
        self.flops_per_token = self.model.flops_per_token(self.seq_length)
        self.parallel = parallelize(self.model, self.mesh, config, self.accumulation)
        fused_kernels = ascend.select_kernels(self.model, config, self.mesh.dims)  # after TP set its own loss
        self.compile_blockers = compile_blockers(config, self.mesh.dims, self.model)
        # after the plans: it wraps what they made
        self.recomputed = apply_recompute(self.model, config.recompute, eager=bool(self.compile_blockers))
        self.model_parts = model_parts(self.model, self.parallel)
        self.params = self.model_parts.params  # under pipeline parallelism: this rank's stages'
        loader = config.train_dataset.dataloader
        self.use_positions = isinstance(loader, BlendedMegatronLoaderConfig) and loader.config.reset_position_ids
        return fused_kernels

    def _build_step(self, fused_kernels: list[str]) -> None:
        """The optimizer, the step's functions, the monitors and validation."""
        config = self.config
        self.lr_schedule = build_lr_schedule(_lr_section(config), config.training.steps)
        self.optimizer = build_optimizer(config.optimizer.to_dict(), self.parallel.optimizer_params, self.lr_schedule)
        self.monitor = TrainStateMonitor(config.monitor.train_state, config.kiln.train_state,
                                         [p.name for p in self.params], self.collectives)
        functions = build_step_functions(config, self.mesh.dims, self.model, self.parallel, self.model_parts,
                                         self.optimizer, self.monitor, self.accumulation, self.compile_blockers)
        self.grad_fn, self.compiled_step = functions.grad_fn, functions.compiled
        self.step_mode = ". ".join([functions.mode, *fused_kernels])
        self.model.track_max_attention_logits(config.kiln.train_state.max_attention_logit)
        self.health = HealthMonitor(config.monitor.health_checkpoint)
        self.loss_parts: list[str] = []  # lm_loss, mtp_k_loss, load_balancing_loss when the model has them
        self.moe_monitor = MoeMonitor(config.monitor.moe_monitor, [name for name, _ in self.model.moe_layers()])
        self.profiler = build_profiler(config, self.world.rank, self.output_dir)
        self.nan_policy = SkipStepOnNaN(config.training.use_skip_step_on_nan,
                                        config.training.max_consecutive_skipped_steps)
        self.validation = self._validation(functions.forward_compiled) if config.kiln.training.eval_interval else None
        for source in self.validation.unevaluated if self.validation else ():
            self.reporter.warning(f"validation loss leaves out {source.reason}")

    def _build_state(self, load_unverified: bool) -> None:
        """The run's state parts and their checkpoint manager; the state restored from checkpoint.load_path."""
        config = self.config
        self.data_position = DataPosition(config.training.global_batch_size, config.data_seed)
        self.checkpoints = CheckpointManager(config, self.world, self.collectives, self.reporter, {
            "model": self.model_parts, "optimizer": self.optimizer, "lr_schedule": LrSchedulePosition(self.optimizer),
            "data_position": self.data_position,
            "rng": GeneratorStates(config.training.seed, self.model.dropout_masks)})
        self.resumed_from: str | None = None
        self.parent: dict | None = None  # the loaded checkpoint as verified (CheckpointFiles.origin)
        if config.checkpoint.load_path:
            restored = self.checkpoints.restore(resolve_load_path(config.checkpoint.load_path), load_unverified)
            self.resumed_from, self.parent = str(restored.path), restored.origin
        if config.checkpoint.enable_save:
            self.checkpoints.refuse_second_history()

    @property
    def step(self) -> int:
        """Steps done (the global step)."""
        return self.data_position.step

    def _validation(self, compiled: bool) -> Validation:
        """The held-out evaluation: this rank's samples and tokens of each micro-batch, as training reads them,
        its forward compiled when the training step's is."""
        return Validation(
            self.config, self.model, self.collectives, accumulation=self.accumulation, use_positions=self.use_positions,
            vocab_size=self.model.config.vocab_size,
            sample_indices=lambda first, micro: micro_batch_indices(first, micro, self.mesh.data_shard_index, self.dp,
                                                                    self.config.training.local_batch_size),
            shard_inputs=self.parallel.context_parallel and self.parallel.context_parallel.shard_inputs,
            compiled=compiled, loss_sums=self.model_parts.held_out_loss_sums,
            token_bytes=token_bytes_of(self.lineage_inputs))

    def saves_at(self, step: int) -> bool:
        """Checkpoints fall on multiples of ``save_interleaved_steps`` and the last step, so a resumed run saves
        the same steps as an uninterrupted one (MindFormers 2.1.0 counts from the resume step instead)."""
        ckpt = self.config.checkpoint
        return ckpt.enable_save and (step % ckpt.save_interleaved_steps == 0 or step == self.config.training.steps)

    # ---- one step ----------------------------------------------------------------------------
    def _micro_batch(self, micro: int) -> tuple[Tensor | None, ...]:
        """The model's positional inputs: input_ids, labels, loss_mask, position_ids, attention_mask
        (the last two None when the model's own positions and causal mask are right)."""
        indices = micro_batch_indices(self.data_position.consumed_samples, micro, self.mesh.data_shard_index, self.dp,
                                      self.config.training.local_batch_size)
        batch = stack_model_inputs([self.dataset[i % len(self.dataset)] for i in indices], self.use_positions)
        inputs = model_input_tensors(batch)
        context = self.parallel.context_parallel
        return inputs if context is None else context.shard_inputs(inputs)  # this rank's tokens of the samples

    def _compiled_whole_step(self) -> tuple[float, dict, np.ndarray, float]:
        """The loss, its parts, each gradient's norm and the global norm of a step that ``CompiledStep`` ran whole,
        its update applied in the graph when both are finite. The host waits for the losses only at the end."""
        hyperparameters = [Tensor(value, ms.float32) for value in
                           self.optimizer.kernel_hyperparameters(self.optimizer.global_step + 1)]
        if self.accumulation == 1:
            self.checkpoints.saver.before_update()  # an async save still copying the parameters must finish first
            loss, squares, grad_norm, *parts = self.compiled_step(*hyperparameters, *self._micro_batch(0))
            micro_outputs = [(loss, *parts)]
        else:
            micro_outputs = [self.compiled_step.accumulate(*self._micro_batch(micro))
                             for micro in range(self.accumulation)]
            self.checkpoints.saver.before_update()
            squares, grad_norm = self.compiled_step.apply_sums(*hyperparameters)
        local_loss, components = 0.0, {}
        for micro_loss, *micro_parts in micro_outputs:
            micro_loss = float(micro_loss.asnumpy())
            local_loss += micro_loss / self.accumulation  # as the eager step sums them
            add_loss_parts(self.model, components, micro_parts, self.accumulation)
            self.monitor.micro_batch(micro_loss, None)  # local_loss (gradients are not read: whole_step_blockers)
        return local_loss, components, np.sqrt(squares.asnumpy().astype(np.float64)), float(grad_norm.asnumpy())

    def train_step(self) -> dict:
        started = time.perf_counter()
        if self.compiled_step is None:
            local_loss, components, grads, unclipped, norms, grad_norm = self.model_parts.gradients(
                self.grad_fn, self._micro_batch, self.accumulation, self.monitor, self.config.training.max_norm)
        else:
            (local_loss, components, norms, grad_norm), unclipped, grads = self._compiled_whole_step(), None, None
        embedding_norm = self.model_parts.embedding_norm(norms)
        # Every rank decides alike: the loss is summed over ranks (a NaN anywhere is NaN everywhere) and
        # the norm is of the all-reduced gradients, which every rank holds identically.
        # the same all-reduce tells every rank whether each rank's async checkpoint writer is done
        saver = self.checkpoints.saver
        totals = self.collectives.all_reduce_array(np.concatenate([[local_loss], saver.status()]))
        loss = float(totals[0]) / self.loss_copies
        saver.settle(totals[1:])
        skipped = self._update(loss, grad_norm, grads)
        # MoE: tokens per expert summed over ranks; expert biases move only when the update was applied
        tokens_per_expert = self.model.after_step(self.collectives, applied=not skipped)
        if components:
            reduced = self.collectives.all_reduce_array(np.array(list(components.values()))) / self.loss_copies
            components = {name: float(value) for name, value in zip(components, reduced)}
        self.loss_parts = list(components)
        abnormal = self.health.observe(self.step + 1, float(grad_norm), embedding_norm)
        monitored = (self.monitor.record(unclipped, self.params, loss, self.model.pop_max_attention_logits())
                     if self.monitor.enabled else {})
        monitored = self.model_parts.gather_monitored(monitored, self.config)
        self.data_position.advance()
        self.last_metrics = {
            **self._step_metrics(loss, grad_norm, skipped, time.perf_counter() - started),
            "embedding_grad_norm": embedding_norm, **components,
            **self.moe_monitor.record(self.step, tokens_per_expert),
            **({"abnormal": abnormal} if abnormal else {}), **monitored}
        return self.last_metrics

    def _update(self, loss: float, grad_norm: float, grads: tuple | None) -> bool:
        """The step's update (already applied in the graph by a compiled whole step), unless the NaN policy skips
        it; returns whether it was skipped."""
        skipped = self.nan_policy.should_skip(self.step + 1, loss, grad_norm)
        if skipped:  # the data is still consumed, as in MindFormers: the next step reads the next batch
            self.reporter.info(f"[kiln] WARNING: step {self.step + 1}: loss {loss}, grad_norm {grad_norm}: update "
                               f"skipped ({self.nan_policy.consecutive} in a row, {self.nan_policy.total} in total)")
        elif self.compiled_step is not None:
            self.optimizer.count_applied_update()  # the graph applied it: the loss and the norm are finite
            self.parallel.after_update()
        else:
            self.checkpoints.saver.before_update()  # an async save still copying the parameters must finish first
            self.optimizer.step(grads)
            self.parallel.after_update()
        return skipped

    def _step_metrics(self, loss: float, grad_norm: float, skipped: bool, elapsed: float) -> dict:
        """The step's record once the data position has advanced past it."""
        gbs, consumed = self.config.training.global_batch_size, self.data_position.consumed_samples
        tokens = gbs * self.seq_length
        # the optimizer's LR, not the schedule at self.step: skipped steps do not advance it
        return {"step": self.step, "loss": loss, "lr": self.optimizer.current_lr, "skipped": skipped,
                "grad_norm": float(grad_norm), "consumed_samples": consumed,
                "tokens_seen": consumed * self.seq_length, "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed, "samples_per_s": gbs / elapsed,
                "tflops_per_device": self.flops_per_token * tokens / elapsed / 1e12 / self.world.size}

    def _log_line(self, m: dict) -> str:
        steps = self.config.training.steps
        line = (f"{{ step:[{m['step']:>5}/{steps:>5}], consumed_samples: {m['consumed_samples']}, "
                f"global_batch_size: {self.config.training.global_batch_size}, loss: {m['loss']:>10.6f}, "
                f"per_step_time: {m['step_time_s'] * 1000:>6.0f}ms, lr: {m['lr']:.6e}, "
                f"grad_norm: {m['grad_norm']:>10.6f}, throughput: {m['tflops_per_device']:.3g}T, "
                + "".join(f"{name}: {m[name]:.6f}, " for name in self.loss_parts) +
                f"tokens_per_s: {m['tokens_per_s']:.0f}, samples_per_s: {m['samples_per_s']:.2f} }}")
        return line + "\n" + summary_line(m["step"], steps, m) if self.monitor.enabled else line

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint the run's state as it is now (collective: every rank calls it). Before ``train``, that is the
        state as built or resumed: a step-0 checkpoint of the initial weights (its loss null), from which a run
        trains as one that started from the seed does."""
        self._write_resolved_config()
        status = self.health.checkpoint_status()
        if status:
            self.reporter.warning(f"checkpoint of step {self.step} is marked abnormal (ckpt_status 1): "
                                  "an unhealthy step since the previous save (see monitor.health_checkpoint)")
        metrics = self.last_metrics or {}
        tokens_seen = self.data_position.consumed_samples * self.seq_length
        if self.world.is_main:  # what rank 0 reports once the checkpoint is complete
            self.saved_metrics[self.step] = {
                "step": self.step, "loss": metrics.get("loss"), "lr": self.optimizer.current_lr,
                "tokens_seen": tokens_seen, "grad_norm": metrics.get("grad_norm"),
                "tokens_per_s": metrics.get("tokens_per_s"), "samples_per_s": metrics.get("samples_per_s"),
                "ckpt_status": status, "consumed_samples": self.data_position.consumed_samples}
        record = CheckpointRecord(loss=metrics.get("loss"), tokens_seen=tokens_seen,
                                  config_sha256=config_sha256(self.resolved_yaml), world_size=self.world.size,
                                  total_steps=self.config.training.steps, ckpt_status=status)
        self.checkpoints.save(record, lineage={**self.lineage_inputs, "run": self._run_record()})
        self._report_saved()

    def _write_resolved_config(self) -> None:
        """The resolved config the checkpoints' lineage names (rank 0; the same content every time)."""
        if self.world.is_main and not self.resolved_config_path.exists():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.resolved_config_path, self.resolved_yaml)

    def _report_saved(self) -> None:
        """Report the checkpoints completed since the last call (an async one completes steps after its save)."""
        for saved in self.checkpoints.saver.take_completed():
            self.last_checkpoint = str(saved.path)
            self.reporter.info(f"[kiln] saved checkpoint {saved.path}")
            self.reporter.checkpoint({**self.saved_metrics.pop(saved.step), "path": str(saved.path),
                                      "files": saved.files})

    def _run_record(self) -> dict:
        return {"config_sha256": config_sha256(self.resolved_yaml), "config": self.config.to_dict(),
                "config_path": str(self.resolved_config_path), "command": self.command,
                "world_size": self.world.size, "started_at": self.started_at, "resumed_from": self.resumed_from,
                "parent": self.parent, "mindspore_version": ms.__version__,
                # where the paths above lie now, recorded once (training/relocation.py): rendered runs only
                **({"roots": {"runs_root": roots.runs_root, "data_root": roots.data_root}}
                   if (roots := self.config.kiln.roots).runs_root else {})}

    # ---- loop --------------------------------------------------------------------------------
    def train(self) -> TrainSummary:
        cfg = self.config
        self._write_resolved_config()
        start_step = self.step
        self.reporter.info(f"[kiln] training {cfg.model['model_type']} ({self.num_parameters:,} parameters) on "
                           f"{self.world.size} worker(s), {degrees(self.mesh.dims)}, accumulation={self.accumulation}, "
                           f"steps {start_step}->{cfg.training.steps}")
        self.reporter.info(f"[kiln] training step: {self.step_mode}")
        if cfg.profiler.enable_profiling:
            self.reporter.info(f"[kiln] profiling steps {cfg.profiler.start_step}-{cfg.profiler.end_step} into "
                               f"{profile_root(cfg, self.output_dir)}/rank_<id>")
        first = last = None
        throughput = []
        while self.step < cfg.training.steps:
            last = self._train_and_report()
            first = last if first is None else first
            if self.step - start_step > 1:  # the first step pays for kernel compilation
                throughput.append(last["tokens_per_s"])
        self.checkpoints.saver.wait()  # the last async save is finalized (and tracked) before training returns
        self._report_saved()
        if self.profiler:  # training ended inside the window
            self.profiler.close()
        if last is None:
            self.reporter.info(f"[kiln] nothing to do: already at step {self.step} of {cfg.training.steps}")
        return TrainSummary(start_step=start_step, end_step=self.step,
                            first_loss=first["loss"] if first else None, last_loss=last["loss"] if last else None,
                            tokens_per_s=float(np.mean(throughput)) if throughput else None,
                            last_checkpoint=self.last_checkpoint)

    def _train_and_report(self) -> dict:
        """One step, its report, and what falls due after it: validation, a checkpoint."""
        if self.profiler:
            self.profiler.before_step(self.step + 1)
        metrics = self.train_step()
        if self.profiler:
            self.profiler.after_step(self.step)
        self.reporter.step(metrics, self._log_line(metrics))
        for reason in metrics.get("abnormal", []):
            self.reporter.warning(f"step {self.step}: {reason}; the next checkpoint will be marked abnormal")
        if self.validation and self.validation.due(self.config, self.step):
            record = self.validation.evaluate(self.step)
            self.reporter.evaluation(record, validation_line(record))
        if self.saves_at(self.step):
            self.save()
        else:
            self._report_saved()
        return metrics


def load_lineage_inputs(path: str | None) -> dict:
    return json.loads(Path(path).read_text()) if path else {}
