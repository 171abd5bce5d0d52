"""Entry point: ``python -m training.run --config X.yaml [--mode 1] [--set a.b=v ...]``.

Runs one process alone, or one worker per device under msrun (any parallel layout across the workers).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path


def _die_with_parent() -> None:
    """msrun starts workers in their own sessions: without this, a killed msrun leaves them orphaned."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.run", description=__doc__)
    parser.add_argument("--config", required=True, help="training YAML (MindFormers dynamic-graph layout)")
    parser.add_argument("--mode", type=int, default=1, help="1 = PyNative (the only supported mode)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field before validation, e.g. --set training.steps=20")
    parser.add_argument("--output-dir", help="where metrics.jsonl and the resolved config go "
                                             "(default: the config file's directory)")
    parser.add_argument("--lineage", help="JSON with the upstream chain (manifest, shards, tokenizer, raw files) "
                                          "to record in every checkpoint's lineage.json")
    parser.add_argument("--tokenizer-model", help="the sentencepiece .model the data was tokenized with: its "
                                                  "vocabulary must fit model.vocab_size")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error in the config, data or checkpoint too (or KILN_DEBUG=1)")
    parser.add_argument("--load-unverified", action="store_true",
                        help="load checkpoint.load_path even though it has no lineage.json to verify its files "
                             "against (e.g. MindFormers' own checkpoint); the log and this run's lineage say so")
    return parser.parse_args(argv)


def require_device_runtime(device_target: str) -> None:
    """MindSpore aborts with a C++ stack when ``ms.set_device`` names a device whose runtime is not installed
    (Ascend without CANN: "libge_runner.so: cannot open shared object file"): refuse it first, naming the field."""
    import mindspore as ms
    from training.config import ConfigError

    if not ms.hal.is_available(device_target):
        default = " (the default when the YAML has no context section)" if device_target == "Ascend" else ""
        raise ConfigError(f"context.device_target = {device_target!r}{default}: MindSpore finds no {device_target} "
                          f"runtime on this machine; set context.device_target to a device it has (e.g. CPU)")


def use_host_blocking_dispatch(enabled: bool) -> None:
    """``fast_step.host_blocking_dispatch``: MindSpore reads MS_DEV_HOST_BLOCKING_RUN when it loads, so it is set
    here, before the first import; a value already in the environment wins (set it to 0 to compare)."""
    if enabled and "mindspore" not in sys.modules:
        os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")


def asks_host_blocking_dispatch(data: dict) -> bool:
    """A config file's ``fast_step.host_blocking_dispatch`` before the config is checked (with the model section,
    which loads MindSpore): anything but an explicit false keeps the default, on."""
    fast_step = data.get("fast_step")
    return not (isinstance(fast_step, dict) and fast_step.get("host_blocking_dispatch") is False)


def main(argv=None) -> int:
    """The error boundary (training.boundary) around ``train``."""
    if "MS_ROLE" in os.environ:
        _die_with_parent()
    args = parse_args(argv)
    from training.boundary import guarded

    return guarded("python -m training.run", lambda: train(args), args.debug)


def train(args: argparse.Namespace) -> int:
    if args.mode != 1:
        print(f"--mode {args.mode}: graph mode is not supported; Kiln trains in PyNative mode (--mode 1)",
              file=sys.stderr)
        return 2
    config = checked_config(args)
    if config is None:
        return 2
    if "ASCEND_RT_VISIBLE_DEVICES" in os.environ and config.context.device_target != "Ascend":
        print(f"note: ASCEND_RT_VISIBLE_DEVICES is set but context.device_target is "
              f"{config.context.device_target}", file=sys.stderr)
    return run_trainer(config, args)


def checked_config(args: argparse.Namespace):
    """The run's config with its overrides, checked whole (the model section, the device and the layout over the
    workers included) before any communicator is built; None once a config error is printed."""
    from training.boundary import debugging
    from training.config import ConfigError, parse_config, read_config
    from training.failures import CONFIG_ERROR
    from training.relocation import MovedConfigError, moved_rendered_config

    try:
        try:
            data, rendered_for = moved_rendered_config(read_config(args.config, args.overrides), Path(args.config))
        except MovedConfigError as exc:
            raise ConfigError(str(exc)) from None
        if rendered_for is not None:
            print(f"[kiln] {args.config} was rendered for the run directory {rendered_for}: its paths under the "
                  f"runs and data roots it recorded (kiln.roots) are taken from this copy's, "
                  f"{Path(args.config).resolve().parent.parent} and "
                  f"{data['kiln']['roots'].get('data_root')}", flush=True)
        use_host_blocking_dispatch(asks_host_blocking_dispatch(data))
        from training.launch import check_layout, world_size_before_init
        from training.model import model_config, validate_model_section  # loads MindSpore

        config = parse_config(data, args.config, model_check=model_config)  # the model's problems in one report
        require_device_runtime(config.context.device_target)
        model = validate_model_section(config, args.tokenizer_model)
        # the layout training_run checked before launch, again on every rank before any communicator is built
        check_layout(config, model, world_size_before_init())
    except ConfigError as exc:
        print(f"{CONFIG_ERROR} {exc}", file=sys.stderr)
        if debugging(args.debug):
            raise
        return None
    return config


def run_reporter(config, world, output_dir: Path):
    """Rank 0's reporter: metrics.jsonl, the log, Dagster Pipes when training_run launched the run, TensorBoard."""
    from training.config import dump_config
    from training.monitor import TensorBoardWriter
    from training.reporting import Reporter

    tensorboard = config.monitor.tensorboard
    sinks = ([TensorBoardWriter(tensorboard, config.training.global_batch_size, dump_config(config))]
             if tensorboard.output_dir and world.is_main else [])
    return Reporter(output_dir / "metrics.jsonl", enabled=world.is_main, log_interval=tensorboard.log_interval,
                    sinks=sinks)


def run_trainer(config, args: argparse.Namespace) -> int:
    """This worker's training, to its exit code: a config error, or an error in the data or a checkpoint, is one
    line on stderr (training_run reads it and does not launch again when a retry would meet it too); a bug, its
    traceback."""
    from training.boundary import debugging, is_user_error
    from training.config import ConfigError
    from training.failures import CONFIG_ERROR, USER_ERROR, not_retriable, not_retriable_line
    from training.parallel.mesh import init_world
    from training.step import configure_runtime
    from training.trainer import Trainer, load_lineage_inputs

    configure_runtime(config)
    world = init_world()
    output_dir = Path(args.output_dir or Path(args.config).parent)
    reporter = run_reporter(config, world, output_dir)
    for warning in config.warnings():
        reporter.info(f"[kiln] warning: {warning}")
    try:
        trainer = Trainer(config, world, output_dir, reporter, lineage_inputs=load_lineage_inputs(args.lineage),
                          command=sys.argv, load_unverified=args.load_unverified)
        summary = trainer.train()
    except ConfigError as exc:  # found while building the run's data (e.g. a validation split too small)
        reporter.close(exc)
        print(f"{CONFIG_ERROR} {exc}", file=sys.stderr)
        if debugging(args.debug):
            raise
        return 2
    except BaseException as exc:
        reporter.close(exc)
        if not is_user_error(exc):
            raise  # a bug: its traceback
        if not_retriable(exc):  # told to training_run, which then does not launch the run again; the message
            print(not_retriable_line(exc), file=sys.stderr, flush=True)  # names the file and what to do
        else:  # a file the machine could not read or write: a retry may find it healed
            print(f"{USER_ERROR} {exc}", file=sys.stderr, flush=True)
        if debugging(args.debug):
            raise
        return 1
    if summary.first_loss is not None:
        reporter.info(f"[kiln] done: steps {summary.start_step}->{summary.end_step}, loss {summary.first_loss:.4f} "
                      f"-> {summary.last_loss:.4f}, {summary.tokens_per_s or 0:.0f} tokens/s")
    reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
