"""The training loop: data-parallel PyNative training with step checkpoints and live reporting.

Sample order is a pure function of the step: global step ``s`` consumes samples
``[s·gbs, (s+1)·gbs)`` of the blended dataset, and rank ``r`` takes micro-batch ``m`` from offset
``(m·dp + r)·lbs`` inside that window. So a resumed run reads exactly what an uninterrupted one would.
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
from training.checkpoint import (KILN_STATE, CheckpointError, CheckpointSaver, capture_rng_state, complete_steps,
                                 is_hf_dir, iteration_dir, load_checkpoint, load_checkpoint_balanced, numpy_dtype,
                                 resolve_load_path, restore_rng_state)
from training.config import BlendedMegatronLoaderConfig, TrainConfig, config_sha256, dump_config
from training.data.loader import build_dataset, seq_length_of, stack_model_inputs
from training.downstream import token_bytes_of
from training.evaluation import Validation, model_input_tensors, validation_line
from training.model import ascend, build_model
from training.monitor import EMBEDDING_PARAM, HealthMonitor, MoeMonitor, TrainStateMonitor, summary_line
from training.optim import SkipStepOnNaN, build_lr_schedule, build_optimizer, clip_grad_norm
from training.parallel.comm import Collectives
from training.parallel.mesh import DeviceMesh, ParallelDims, World
from training.parallel.parallelize import parallelize
from training.profiling import build_profiler, profile_root
from training.recompute import apply_recompute
from training.reporting import Reporter
from training.step import build_step_functions, degrees


@dataclass
class TrainSummary:
    start_step: int
    end_step: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float | None
    last_checkpoint: str | None


def micro_batch_indices(consumed_samples: int, micro: int, rank: int, dp: int, local_batch_size: int) -> range:
    """The global sample indices that data-parallel rank ``rank`` reads for micro-batch ``micro`` of the
    step starting at ``consumed_samples``: ranks take disjoint, interleaved slices of the global batch, so
    concatenating (micro 0: rank 0, 1, …; micro 1: …) gives the single-process order."""
    start = consumed_samples + (micro * dp + rank) * local_batch_size
    return range(start, start + local_batch_size)


def _lr_section(config: TrainConfig) -> dict:
    return {k: v for k, v in config.lr_scheduler.to_dict().items() if v is not None}


class Trainer:
    def __init__(self, config: TrainConfig, world: World, output_dir: Path, reporter: Reporter,
                 lineage_inputs: dict | None = None, command: list[str] | None = None, load_unverified: bool = False):
        self.config = config
        self.world = world
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
        self.reporter = reporter

        ms.set_seed(config.training.seed)
        np.random.seed(config.training.seed)
        self.model = build_model(config.model)
        self.model.dropout_masks.reset(config.training.seed, world.rank)  # each rank its own dropout masks
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
        self.recomputed = apply_recompute(self.model, config.recompute)  # after the plans: it wraps what they made
        self.params = self.parallel.model_params
        self.pipeline = self.parallel.pipeline  # None unless pipeline parallel: then self.params are its stage's
        self.lr_schedule = build_lr_schedule(_lr_section(config), config.training.steps)
        self.optimizer = build_optimizer(config.optimizer.to_dict(), self.parallel.optimizer_params, self.lr_schedule)
        ckpt = config.checkpoint
        self.saver = CheckpointSaver(save_path=Path(ckpt.save_path), prefix=ckpt.prefix, save_max=ckpt.save_max,
                                     world=world, collectives=self.collectives,
                                     remove_redundancy=ckpt.remove_redundancy, async_save=ckpt.async_save)
        self.monitor = TrainStateMonitor(config.monitor.train_state, config.kiln.train_state,
                                         [p.name for p in self.params], self.collectives)
        functions = build_step_functions(config, self.mesh.dims, self.model, self.parallel, self.optimizer,
                                         self.monitor, self.accumulation)
        self.grad_fn, self.compiled_step = functions.grad_fn, functions.compiled
        self.step_mode = ". ".join([functions.mode, *fused_kernels])

        self.model.track_max_attention_logits(config.kiln.train_state.max_attention_logit)
        self.health = HealthMonitor(config.monitor.health_checkpoint)
        self.loss_parts: list[str] = []  # lm_loss, mtp_k_loss, load_balancing_loss when the model has them
        self.moe_monitor = MoeMonitor(config.monitor.moe_monitor, [name for name, _ in self.model.moe_layers()])
        self.embedding_index = next((i for i, p in enumerate(self.params) if p.name == EMBEDDING_PARAM), None)
        self.profiler = build_profiler(config, world.rank, self.output_dir)
        self.nan_policy = SkipStepOnNaN(config.training.use_skip_step_on_nan,
                                        config.training.max_consecutive_skipped_steps)

        loader = config.train_dataset.dataloader
        self.use_positions = isinstance(loader, BlendedMegatronLoaderConfig) and loader.config.reset_position_ids
        self.validation = self._validation(functions.forward_compiled) if config.kiln.training.eval_interval else None
        for source in self.validation.unevaluated if self.validation else ():
            self.reporter.warning(f"validation loss leaves out {source.reason}")
        self.step = 0
        self.consumed_samples = 0
        self.resumed_from: str | None = None
        self.parent: dict | None = None  # the loaded checkpoint as verified (CheckpointFiles.origin)
        self.load_unverified = load_unverified
        if config.checkpoint.load_path:
            self._resume(resolve_load_path(config.checkpoint.load_path))
        if ckpt.enable_save:
            self._refuse_second_history()

    def _validation(self, compiled: bool) -> Validation:
        """The held-out evaluation: this rank's samples and tokens of each micro-batch, as training reads them,
        its forward compiled when the training step's is."""
        return Validation(
            self.config, self.model, self.collectives, accumulation=self.accumulation, use_positions=self.use_positions,
            vocab_size=self.model.config.vocab_size,
            sample_indices=lambda first, micro: micro_batch_indices(first, micro, self.mesh.data_shard_index, self.dp,
                                                                    self.config.training.local_batch_size),
            shard_inputs=self.parallel.context_parallel and self.parallel.context_parallel.shard_inputs,
            compiled=compiled, loss_sums=self.pipeline and self.pipeline.held_out_loss_sums,
            token_bytes=token_bytes_of(self.lineage_inputs))

    # ---- state -------------------------------------------------------------------------------
    def _model_arrays(self) -> dict[str, np.ndarray]:
        """This rank's array of every model tensor (a chunk of those it holds cut)."""
        return {p.name: p.asnumpy() for p in self.model.get_parameters() if self._holds(p.name)}

    def _holds(self, name: str) -> bool:
        """Whether this rank holds model tensor ``name`` (under pipeline parallelism: its stage's)."""
        return self.pipeline is None or self.pipeline.keeps(name)

    def _load_layouts(self) -> dict:
        """How this rank holds each tensor it loads; another pipeline stage's tensors are not read."""
        layouts = self.parallel.layouts()
        return layouts if self.pipeline is None else {**self.pipeline.absent_layouts(), **layouts}

    def _load_weights(self, path: Path, weights: dict[str, np.ndarray], stored: dict[str, str] | None = None
                      ) -> None:
        """Set every parameter from ``weights``, in the parameter's own dtype; ``stored`` (each tensor's
        dtype in the files) lets the log say which were converted, e.g. MindFormers' bfloat16 on CPU."""
        converted: dict[tuple[str, str], int] = {}
        for param in self.model.get_parameters():
            if not self._holds(param.name):
                continue
            if param.name not in weights:
                raise CheckpointError(f"{path}: tensor {param.name} is missing")
            array = weights[param.name]
            if array.shape != param.shape:
                raise CheckpointError(f"{path}: tensor {param.name} has shape {list(array.shape)}, "
                                      f"the model expects {list(param.shape)}")
            wanted = numpy_dtype(param.dtype)
            was = (stored or {}).get(param.name, str(array.dtype))
            if array.dtype != wanted or was == "BFloat16":
                conversion = (was, str(param.dtype))
                converted[conversion] = converted.get(conversion, 0) + 1
            param.set_data(Tensor(array.astype(wanted, copy=False)))
        extra = sorted(set(weights) - {p.name for p in self.model.get_parameters()})
        if extra:
            raise CheckpointError(f"{path}: tensors not in the model: {', '.join(extra[:5])}")
        for (was, now), count in sorted(converted.items()):
            self.reporter.info(f"[kiln] {count} tensor(s) stored as {was} loaded as the model's {now}")
        self.parallel.refresh_chunks()
        self.resumed_from = str(path)

    def _masters_as_weights(self, loaded) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """The weights to load and their stored dtypes: a low-precision parameter saved with its fp32 master
        (``main_param.<name>``, MindFormers' bf16 training) that is fp32 here takes the master, its exact
        value; the master leaves the optimizer state, which has none for an fp32 parameter."""
        weights, stored = dict(loaded.model), dict(loaded.stored)
        taken = 0
        for param in self.model.get_parameters():
            master = f"main_param.{param.name}"
            if param.dtype == ms.float32 and master in loaded.optim:
                weights[param.name], stored[param.name] = loaded.optim.pop(master), stored.pop(master)
                taken += 1
        if taken:
            self.reporter.info(f"[kiln] {taken} parameter(s) saved in low precision take their fp32 masters "
                               f"(main_param.*) from {loaded.path}: the model trains them in float32 here")
        return weights, stored

    def _resume(self, path: Path) -> None:
        ckpt = self.config.checkpoint
        if is_hf_dir(path):
            from training.hf import load_hf_weights  # the converter is only needed for this kind of load

            weights, self.parent = load_hf_weights(path, self.config.model)
            self._load_weights(path, self.parallel.own_chunks(weights))
            self.reporter.info(f"[kiln] loaded Hugging Face weights from {path} (weights only); starting at step 0")
            return
        if ckpt.load_balanced:
            loaded = load_checkpoint_balanced(path, self.world, self.collectives, load_optim=not ckpt.no_load_optim,
                                              readers=ckpt.load_worker_number, layouts=self._load_layouts(),
                                              allow_unverified=self.load_unverified)
        else:
            loaded = load_checkpoint(path, rank=self.world.rank, load_optim=not ckpt.no_load_optim,
                                     layouts=self._load_layouts(), allow_unverified=self.load_unverified)
        self.parent = loaded.origin
        if not loaded.origin["verified"]:
            self.reporter.warning(f"{path} loaded UNVERIFIED (--load-unverified): it has no lineage.json to check its "
                                  f"files against; this run's lineage records it as unverified, with the sha256 of "
                                  f"each file read")
        self._load_weights(path, *((loaded.model, loaded.stored) if ckpt.no_load_optim
                                   else self._masters_as_weights(loaded)))
        if ckpt.no_load_optim:
            self.reporter.info(f"[kiln] loaded weights only from {path}; starting at step 0")
            return
        if not loaded.optim:
            raise CheckpointError(f"{path}: no optimizer state (saved with no_save_optim?); "
                                  f"set checkpoint.no_load_optim to load the weights only")
        self.optimizer.load_state_arrays(loaded.optim)
        common = loaded.common
        if loaded.state is None:
            self.reporter.info(f"[kiln] {path} has no {KILN_STATE} (saved by MindFormers?): the random generators "
                               f"start from training.seed {self.config.training.seed}, not where that run left them")
        else:
            if not restore_rng_state(loaded.state.get("rng"), loaded.state_path, self.model.dropout_masks):
                self.reporter.info(f"[kiln] {loaded.state_path} has no dropout mask state (saved before Kiln "
                                   f"kept one): dropout masks start from training.seed {self.config.training.seed}")
        saved_gbs = common["global_batch_size"]
        self.consumed_samples = int(common["consumed_samples"])
        gbs = self.config.training.global_batch_size
        self.step = int(common["global_step"])
        if saved_gbs != gbs:
            self.step = self.consumed_samples // gbs
            self.reporter.info(f"[kiln] global batch size changed {saved_gbs} -> {gbs}: keeping the "
                               f"{self.consumed_samples} consumed samples, so the data continues at sample "
                               f"{self.consumed_samples}; step {common['global_step']} × {saved_gbs} samples "
                               f"= step {self.step} × {gbs} (rounded down); the optimizer's own step, which "
                               f"drives the LR schedule, is kept as saved")
        self.reporter.info(f"[kiln] resumed from {path} at step {self.step}, "
                           f"{self.consumed_samples} samples consumed")

    def _refuse_second_history(self) -> None:
        """A save path holds one run's history: saving from step ``self.step`` beside checkpoints of later
        steps would replace some of them and leave rotation and the tracker mixing two histories."""
        save_path = Path(self.config.checkpoint.save_path)
        later = [step for step in complete_steps(save_path) if step > self.step]
        if later:
            raise CheckpointError(
                f"checkpoint.save_path {save_path} holds checkpoints of steps after this run's start "
                f"(step {self.step}): {', '.join(iteration_dir(save_path, s).name for s in later[:5])}"
                f"{' …' if len(later) > 5 else ''}; training from step {self.step} here would overwrite or mix "
                f"with them: save into a new checkpoint.save_path, or resume from the newest")

    def saves_at(self, step: int) -> bool:
        """Checkpoints fall on multiples of ``save_interleaved_steps`` and the last step, so a resumed run saves
        the same steps as an uninterrupted one (MindFormers 2.1.0 counts from the resume step instead)."""
        ckpt = self.config.checkpoint
        return ckpt.enable_save and (step % ckpt.save_interleaved_steps == 0 or step == self.config.training.steps)

    # ---- one step ----------------------------------------------------------------------------
    def _micro_batch(self, micro: int) -> tuple[Tensor | None, ...]:
        """The model's positional inputs: input_ids, labels, loss_mask, position_ids, attention_mask
        (the last two None when the model's own positions and causal mask are right)."""
        indices = micro_batch_indices(self.consumed_samples, micro, self.mesh.data_shard_index, self.dp,
                                      self.config.training.local_batch_size)
        batch = stack_model_inputs([self.dataset[i % len(self.dataset)] for i in indices], self.use_positions)
        inputs = model_input_tensors(batch)
        context = self.parallel.context_parallel
        return inputs if context is None else context.shard_inputs(inputs)  # this rank's tokens of the samples

    def _eager_gradients(self) -> tuple[float, dict, tuple, tuple, np.ndarray, float]:
        """The step's loss on this rank, its loss parts, the clipped and the unclipped reduced gradients, each
        gradient's norm and the global norm, micro-batch by micro-batch (``grad_fn`` compiled or not)."""
        if self.pipeline is not None:  # the micro-batches go through the stages by the pipeline's schedule
            stepped = self.pipeline.gradients(self.parallel, [self._micro_batch(m) for m in range(self.accumulation)],
                                              self.config.training.max_norm)
            for micro_loss in self.pipeline.last_result.micro_losses:  # this rank's part of each (local_loss)
                self.monitor.micro_batch(micro_loss, None)
            return stepped
        grads_sum, local_loss, components = None, 0.0, {}
        for micro in range(self.accumulation):
            outputs, grads = self.grad_fn(*self._micro_batch(micro))
            loss, parts = outputs[1], outputs[2:]
            micro_loss = float(loss.asnumpy())
            local_loss += micro_loss / self.accumulation
            self._add_parts(components, parts)
            self.monitor.micro_batch(micro_loss, grads, self.parallel.loss_scale())
            grads_sum = grads if grads_sum is None else tuple(a + b for a, b in zip(grads_sum, grads))
        unclipped = self.parallel.reduce_gradients(grads_sum)  # what device_norm and the health check judge
        norms = self.parallel.tensor_norms(unclipped)
        grads, grad_norm = clip_grad_norm(unclipped, self.config.training.max_norm, norms)
        return local_loss, components, grads, unclipped, norms, grad_norm

    def _add_parts(self, components: dict[str, float], parts: tuple) -> None:
        """Adds a micro-batch's loss parts (MTP depths, load balancing) to the step's means in ``components``."""
        for name, value in self.model.named_parts(parts).items():
            components[name] = components.get(name, 0.0) + value / self.accumulation

    def _compiled_whole_step(self) -> tuple[float, dict, np.ndarray, float]:
        """The loss, its parts, each gradient's norm and the global norm of a step that ``CompiledStep`` ran whole,
        its update applied in the graph when both are finite. The host waits for the losses only at the end."""
        lr, eps, decay = self.optimizer.kernel_hyperparameters(self.optimizer.global_step + 1)
        last = self.accumulation - 1
        micro_outputs = [self.compiled_step.accumulate(*self._micro_batch(micro)) for micro in range(last)]
        self.saver.before_update()  # an async save still copying the parameters must finish first
        loss, squares, grad_norm, *parts = self.compiled_step(Tensor(lr, ms.float32), Tensor(eps, ms.float32),
                                                             Tensor(decay, ms.float32), *self._micro_batch(last))
        local_loss, components = 0.0, {}
        for micro_loss, *micro_parts in [*micro_outputs, (loss, *parts)]:
            micro_loss = float(micro_loss.asnumpy())
            local_loss += micro_loss / self.accumulation  # as the eager step sums them
            self._add_parts(components, micro_parts)
            self.monitor.micro_batch(micro_loss, None)  # local_loss (gradients are not read: whole_step_blockers)
        return local_loss, components, np.sqrt(squares.asnumpy().astype(np.float64)), float(grad_norm.asnumpy())

    def train_step(self) -> dict:
        started = time.perf_counter()
        if self.compiled_step is None:
            local_loss, components, grads, unclipped, norms, grad_norm = self._eager_gradients()
        else:
            (local_loss, components, norms, grad_norm), unclipped = self._compiled_whole_step(), None
        embedding_norm = (float(norms[self.embedding_index]) if self.pipeline is None
                          else self.pipeline.norm_of(EMBEDDING_PARAM, norms))
        # Every rank decides alike: the loss is summed over ranks (a NaN anywhere is NaN everywhere) and
        # the norm is of the all-reduced gradients, which every rank holds identically.
        # the same all-reduce tells every rank whether each rank's async checkpoint writer is done
        totals = self.collectives.all_reduce_array(np.concatenate([[local_loss], self.saver.status()]))
        loss = float(totals[0]) / self.loss_copies
        self.saver.settle(totals[1:])
        skipped = self.nan_policy.should_skip(self.step + 1, loss, grad_norm)
        if skipped:  # the data is still consumed, as in MindFormers: the next step reads the next batch
            self.reporter.info(f"[kiln] WARNING: step {self.step + 1}: loss {loss}, grad_norm {grad_norm}: update "
                               f"skipped ({self.nan_policy.consecutive} in a row, {self.nan_policy.total} in total)")
        elif self.compiled_step is not None:
            self.optimizer.count_applied_update()  # the graph applied it: the loss and the norm are finite
            self.parallel.after_update()
        else:
            self.saver.before_update()  # an async save still copying the parameters must finish first
            self.optimizer.step(grads)
            self.parallel.after_update()
        # MoE: tokens per expert summed over ranks; expert biases move only when the update was applied
        tokens_per_expert = self.model.after_step(self.collectives, applied=not skipped)
        if components:
            reduced = self.collectives.all_reduce_array(np.array(list(components.values()))) / self.loss_copies
            components = {name: float(value) for name, value in zip(components, reduced)}
        self.loss_parts = list(components)
        abnormal = self.health.observe(self.step + 1, float(grad_norm), embedding_norm)
        monitored = (self.monitor.record(unclipped, self.params, loss, self.model.pop_max_attention_logits())
                     if self.monitor.enabled else {})
        if self.pipeline is not None:  # rank 0 reports every stage's parameter norms
            monitored = self.pipeline.gather_monitored(monitored, self.config)
        self.step += 1
        self.consumed_samples += self.config.training.global_batch_size
        elapsed = time.perf_counter() - started
        tokens = self.config.training.global_batch_size * self.seq_length
        # the optimizer's LR, not the schedule at self.step: skipped steps do not advance it
        return {"step": self.step, "loss": loss, "lr": self.optimizer.current_lr, "skipped": skipped,
                "grad_norm": float(grad_norm), "consumed_samples": self.consumed_samples,
                "tokens_seen": self.consumed_samples * self.seq_length, "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed,
                "samples_per_s": self.config.training.global_batch_size / elapsed,
                "tflops_per_device": self.flops_per_token * tokens
                / elapsed / 1e12 / self.world.size, "embedding_grad_norm": embedding_norm,
                **components, **self.moe_monitor.record(self.step, tokens_per_expert),
                **({"abnormal": abnormal} if abnormal else {}), **monitored}

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
    def save(self, metrics: dict) -> None:
        cfg = self.config
        status = self.health.checkpoint_status()
        if status:
            self.reporter.warning(f"checkpoint of step {self.step} is marked abnormal (ckpt_status 1): "
                                  "an unhealthy step since the previous save (see monitor.health_checkpoint)")
        common = {
            "epoch_num": 1, "step_num": cfg.training.steps, "global_step": self.step, "loss_scale": 1.0,
            "global_batch_size": cfg.training.global_batch_size, "consumed_samples": self.consumed_samples,
            "ckpt_status": status,
        }
        state = {  # Kiln's own: what a bit-identical resume and an audit need
            "loss": metrics["loss"], "lr": metrics["lr"], "tokens_seen": metrics["tokens_seen"],
            "config_sha256": config_sha256(self.resolved_yaml),
            "data_position": {"consumed_samples": self.consumed_samples, "seed": cfg.data_seed},
            "rng": capture_rng_state(cfg.training.seed, self.model.dropout_masks),
            "world_size": self.world.size,
        }
        lineage = {**self.lineage_inputs, "run": self._run_record()}
        if self.world.is_main:  # what rank 0 reports once the checkpoint is complete
            self.saved_metrics[self.step] = {
                "step": self.step, "loss": metrics["loss"], "lr": metrics["lr"], "tokens_seen": metrics["tokens_seen"],
                "grad_norm": metrics["grad_norm"], "tokens_per_s": metrics["tokens_per_s"],
                "samples_per_s": metrics["samples_per_s"], "ckpt_status": status,
                "consumed_samples": self.consumed_samples}
        arrays = {"model": self._model_arrays(),
                  "opt": {} if cfg.checkpoint.no_save_optim else self.optimizer.state_arrays()}
        layouts, remote = self.parallel.layouts(), None
        if self.pipeline is not None:  # rank 0 describes every stage's tensors: each rank tells what it holds
            layouts, remote = self.pipeline.world_layouts(arrays, layouts, self.collectives)
        self.saver.save(step=self.step, model=arrays["model"], optim=arrays["opt"] or None, common=common,
                        state=state, lineage=lineage, layouts=layouts, remote=remote)
        self._report_saved()

    def _report_saved(self) -> None:
        """Report the checkpoints completed since the last call (an async one completes steps after its save)."""
        for saved in self.saver.take_completed():
            self.last_checkpoint = str(saved.path)
            self.reporter.info(f"[kiln] saved checkpoint {saved.path}")
            self.reporter.checkpoint({**self.saved_metrics.pop(saved.step), "path": str(saved.path),
                                      "files": saved.files})

    def _run_record(self) -> dict:
        return {"config_sha256": config_sha256(self.resolved_yaml), "config": self.config.to_dict(),
                "config_path": str(self.resolved_config_path), "command": self.command,
                "world_size": self.world.size, "started_at": self.started_at, "resumed_from": self.resumed_from,
                "parent": self.parent, "mindspore_version": ms.__version__}

    # ---- loop --------------------------------------------------------------------------------
    def train(self) -> TrainSummary:
        cfg = self.config
        self.started_at = datetime.now(timezone.utc).isoformat()
        self.last_checkpoint = None
        self.saved_metrics: dict[int, dict] = {}
        if self.world.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.resolved_config_path, self.resolved_yaml)
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
            if self.profiler:
                self.profiler.before_step(self.step + 1)
            metrics = self.train_step()
            if self.profiler:
                self.profiler.after_step(self.step)
            first = metrics if first is None else first
            last = metrics
            if self.step - start_step > 1:  # the first step pays for kernel compilation
                throughput.append(metrics["tokens_per_s"])
            self.reporter.step(metrics, self._log_line(metrics))
            for reason in metrics.get("abnormal", []):
                self.reporter.warning(f"step {self.step}: {reason}; the next checkpoint will be marked abnormal")
            if self.validation and self.validation.due(cfg, self.step):
                record = self.validation.evaluate(self.step)
                self.reporter.evaluation(record, validation_line(record))
            if self.saves_at(self.step):
                self.save(metrics)
            else:
                self._report_saved()
        self.saver.wait()  # the last async save is finalized (and tracked) before training returns
        self._report_saved()
        if self.profiler:  # training ended inside the window
            self.profiler.close()
        if last is None:
            self.reporter.info(f"[kiln] nothing to do: already at step {self.step} of {cfg.training.steps}")
        return TrainSummary(start_step=start_step, end_step=self.step,
                            first_loss=first["loss"] if first else None, last_loss=last["loss"] if last else None,
                            tokens_per_s=float(np.mean(throughput)) if throughput else None,
                            last_checkpoint=self.last_checkpoint)


def load_lineage_inputs(path: str | None) -> dict:
    return json.loads(Path(path).read_text()) if path else {}
