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
