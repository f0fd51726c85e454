"""The project's own errors. ``python -m pipeline`` prints any ``PipelineError`` as one line and exits 2;
every other exception (a bug here, in torch, in Ray) keeps its traceback.

Each class also derives from the builtin its callers caught before (ValueError, RuntimeError,
FileNotFoundError), so ``except ValueError`` around the library keeps working.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every error this project raises on purpose: bad input, missing files, failed jobs."""


class InputError(PipelineError, ValueError):
    """An argument, tensor or option the operators and models cannot use; the message says which and why."""


class MissingFileError(PipelineError, FileNotFoundError):
    """A file or folder the command needs does not exist; the message says how to make it."""


class JobError(PipelineError, RuntimeError):
    """A training job, sweep or device that did not do what was asked (after its retries)."""


class PipelineWarning(UserWarning):
    """Something the run goes on without (a plugin that does not load); ``python -m pipeline`` prints it as
    one line, ``warning: ...``."""


class LossNotFiniteError(PipelineError, FloatingPointError):
    """The training loss became NaN or infinite: a learning rate too high for the run, usually."""


# Where Ray keeps the error a worker, task or actor raised: a task's error (``RayTaskError.cause``), Ray Train's
# controller (``ControllerError.controller_failure``), a health check (``health_check_failure``) and a worker's
# error with its traceback string (``UserExceptionWithTraceback._base_exc``); ``WorkerGroupError.worker_failures``
# holds one per failed rank. Read by name, so that this module imports no Ray.
_RAY_WRAPPERS = ("cause", "controller_failure", "health_check_failure", "_base_exc")


def project_error(error: BaseException | None) -> PipelineError | None:
    """The project's own error that a Ray Train worker, Tune trial or Ray task raised under Ray's wrappers (or
    ``error`` itself where it is one), else None: a real bug, whose traceback the console keeps."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        failures = getattr(error, "worker_failures", None)
        if isinstance(failures, dict) and failures:
            found = [project_error(failures[rank]) for rank in sorted(failures)]
            return next((e for e in found if e is not None), None)
        inner = next((getattr(error, name) for name in _RAY_WRAPPERS
                      if isinstance(getattr(error, name, None), BaseException)), None)
        if inner is None:
            return error if isinstance(error, PipelineError) else None
        error = inner
    return None
