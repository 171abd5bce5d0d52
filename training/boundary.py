"""One error boundary per entry point (``python -m training.run``, every ``kiln`` command, ``python -m
pipelines.audit``): a mistake in what the user gave (a config field, a data file, a checkpoint) is one line naming
the place and what to do, on stderr, exit status 2; anything else is a bug and keeps its traceback. ``--debug`` or
KILN_DEBUG=1 shows the traceback of a user error too. Output piped into a reader that stops early (``| head``) ends
quietly instead of with a BrokenPipeError traceback.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

DEBUG_ENV = "KILN_DEBUG"


def user_error_types() -> tuple[type[BaseException], ...]:
    """The errors whose message is the whole story: each names the file, field or tensor at fault."""
    from training.checkpoint_files import CheckpointError
    from training.config import ConfigError
    from training.data.corpus import CorpusError
    from training.data.gpt_dataset import DatasetError
    from training.data.indexed import IndexedDatasetError
    from training.data.manifest import ManifestError
    from training.hf import HFConversionError
    from training.launch import SettingError
    from training.safetensors_io import SafetensorsFileError
    from training.tasks import TaskError

    types = (ConfigError, CheckpointError, CorpusError, DatasetError, IndexedDatasetError, ManifestError,
             HFConversionError, SettingError, SafetensorsFileError, TaskError)
    # training.optim loads MindSpore: an error of its type exists only in a process that imported it already
    optim = sys.modules.get("training.optim")
    return types + ((optim.NonFiniteStepError,) if optim else ())


def is_user_error(exc: BaseException) -> bool:
    """A user error, or an operating system error about a named file (missing, unreadable, a full disk)."""
    return isinstance(exc, user_error_types()) or (isinstance(exc, OSError) and exc.filename is not None)


def debugging(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def quiet_broken_pipe() -> int:
    """After a BrokenPipeError on stdout: point stdout at /dev/null so the interpreter's final flush does not
    raise again, and exit 1 (as Python's documentation advises for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def user_error(prog: str, exc: BaseException, debug: bool = False) -> int:
    """Report ``exc`` as ``prog: message`` and return exit status 2; under --debug / KILN_DEBUG re-raise it."""
    if debugging(debug):
        raise exc
    print(f"{prog}: {exc}", file=sys.stderr, flush=True)
    return 2


def guarded(prog: str, work: Callable[[], int], debug: bool = False) -> int:
    """``work()``'s exit status; a user error it raises is one line (``user_error``), a broken pipe a quiet exit,
    Ctrl-C one line and 130; anything else propagates with its traceback."""
    try:
        return work()
    except BrokenPipeError:
        return quiet_broken_pipe()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it is the user's
        if not is_user_error(exc):
            raise
        return user_error(prog, exc, debug)
