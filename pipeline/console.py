"""What reaches the console: the stage, per-epoch progress, sweep counters, failures, evaluations and the
Pareto table. The rest of what Ray, Tune and FFCV say is kept off it, and stays in Ray's log folder.

``PIPELINE_VERBOSE=1`` (or ``--verbose`` on ``pipeline run`` and ``pipeline train``) shows everything again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.errors import project_error

VERBOSE_ENV = "PIPELINE_VERBOSE"
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")  # scheme://user[:password]@


def say(line: str) -> None:
    """One line of rank 0's progress on stdout, flushed.

    Not ``print``: in a Ray Train 2.60 worker ``print`` is patched to log each line and, because Ray's
    workers write through their own ``sys.stdout`` wrapper, also to print it, so the driver showed every
    line twice.
    """
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def redact(text: str) -> str:
    """``text`` with the user and password of every URI in it hidden (``http://user:secret@host:5000`` ->
    ``http://***@host:5000``): the form every message and log line of this project shows."""
    return _USERINFO.sub(r"\1***@", text)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes")


def _log_folder() -> Path:
    """The folder of this Ray worker's own log files (its stderr goes to ``.../logs/worker-*.err``)."""
    try:
        target = Path(os.readlink("/proc/self/fd/2"))
    except OSError:
        target = Path()
    if target.parent.name == "logs":
        return target.parent

    return Path(tempfile.gettempdir())


def ray_log_folder() -> str:
    """The log folder of the Ray session this driver is connected to (each worker's output and the errors it
    raised), or Ray's default place for it."""
    try:
        from ray._private import worker

        return worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - not connected, or Ray moved its private API: name the default
        return f"{tempfile.gettempdir()}/ray/session_latest/logs"


def worker_failure(what: str, error: BaseException, where: str | None = None) -> str:
    """The one line for ``what`` (``training job 'x' failed after 1 restart(s)``) that failed with ``error`` in a
    Ray worker: the project's own error (``pipeline.errors.project_error``) as its message, the tracebacks left
    ``where`` (default: Ray's log folder) or shown with ``--verbose``; anything else (a bug) with Ray's text, its
    traceback included."""
    found = project_error(error)
    if found is None or verbose():
        return f"{what}: {error}"
    return f"{found} ({what}; the tracebacks are in {where or ray_log_folder()}, or rerun with --verbose)"


class ProjectErrorsAside(logging.Filter):
    """Keeps a project error's traceback that Ray logs (the error of a Ray Train worker's training function, of
    a Tune trial) off the console and writes it to ``keep``; the one line the driver prints says the rest. A
    bug's traceback and every other record pass."""

    def __init__(self, keep: logging.Handler | None = None) -> None:
        super().__init__()
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        if verbose() or project_error(error) is None:
            return True
        if self.keep is not None:
            self.keep.handle(record)
        return False


# Ray Train logs the traceback of a worker's failed training function here (in the worker, while it handles it).
TRAIN_FUNCTION_ERRORS = "ray.train.v2._internal.util"
# Tune logs a failed trial's traceback here (in the driver; the trial's error.txt holds it too).
TRIAL_ERRORS = "ray.tune.execution.tune_controller"


def quiet_worker_errors() -> None:
    """Ray worker setup hook: a project error's traceback logged by Ray Train goes to
    ``ray-train-errors-PID.log`` in the worker's log folder, not to the console (``ProjectErrorsAside``)."""
    keep = logging.FileHandler(_log_folder() / f"ray-train-errors-{os.getpid()}.log", delay=True)
    keep.setFormatter(logging.Formatter("%(asctime)s %(levelname)s -- %(message)s"))
    logging.getLogger(TRAIN_FUNCTION_ERRORS).addFilter(ProjectErrorsAside(keep))


def quiet_train_reports() -> None:
    """Ray worker setup hook: Ray Train's "Reporting training result N: TrainingReport(...)" lines (one a
    rank and epoch) go to ``ray-train-reports-PID.log`` in the worker's log folder, not to the console.

    Ray Train logs them from a logger named by its file's path (``logging.getLogger(__file__)`` in
    ``ray/train/v2/_internal/execution/context.py``), so ``LoggingConfig(log_level=...)``, which filters
    the ``ray.train`` loggers, lets them through to the root logger's console handler."""

    if verbose():
        return
    spec = importlib.util.find_spec("ray.train.v2._internal.execution.context")
    if spec is None or spec.origin is None:
        return
    reports = logging.getLogger(spec.origin)
    reports.propagate = False
    keep = logging.FileHandler(_log_folder() / f"ray-train-reports-{os.getpid()}.log", delay=True)
    keep.setFormatter(logging.Formatter("%(asctime)s %(levelname)s -- %(message)s"))
    reports.addHandler(keep)


def quiet_driver() -> None:
    """This process (every command): MLflow's usage telemetry off unless the user set it; numba's known finalizer
    traceback dropped; a failed Tune trial's traceback off the console where its error is the project's own; and,
    unless verbose, Tune's legacy reporter, which prints nothing at ``verbose=0`` (its
    newer one prints each sweep's configuration box and a TensorBoard hint even then), and no progress bar or
    note from MLflow for each model the select stage logs."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    quiet_numba_finalizer()
    trials = logging.getLogger(TRIAL_ERRORS)
    if not any(isinstance(f, ProjectErrorsAside) for f in trials.filters):
        trials.addFilter(ProjectErrorsAside())  # the trial's error.txt keeps it (the sweep's line names it)
    if not verbose():
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar for each file a model logs
        logging.getLogger("mlflow.pyfunc").setLevel(logging.WARNING)  # "Validating input example ...", per model
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial ... tables"


def _from_numba_finalizer(traceback: TracebackType | None) -> bool:
    """Whether a traceback passes through numba's ``Dispatcher`` finalizer."""
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_name == "finalizer" and Path(code.co_filename).parts[-3:] == ("numba", "core", "dispatcher.py"):
            return True
        traceback = traceback.tb_next
    return False


def quiet_numba_finalizer() -> None:
    """Drops one known, harmless traceback from the output.

    When an FFCV loader is garbage-collected in a process that has built more than one (FFCV 1.0.2,
    numba 0.68: build two, drop them, ``gc.collect()``), numba's ``Dispatcher`` finalizer raises
    ``KeyError`` while it unloads the compiled pipeline. Python ignores the exception anyway
    ("Exception ignored in: <finalize object ...>"), but the evaluate stage printed its traceback
    about 20 times a demo. Every other unraisable exception still reaches the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "quiets_numba_finalizer", False):
        return

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is KeyError and _from_numba_finalizer(unraisable.exc_traceback):
            return
        previous(unraisable)

    hook.quiets_numba_finalizer = True
    sys.unraisablehook = hook
