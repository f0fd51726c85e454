"""The process's signal handlers around code that changes them or needs its own.

Ray Train's ``TorchTrainer.fit`` (ray 2.60, ``train/v2/api/data_parallel_trainer.py``) and Ray Tune's
``Tuner.fit`` (``tune/tune.py: _setup_signal_catching``) install SIGINT (Tune also SIGUSR1) handlers and leave
them installed when they return. After a fit, a Ctrl-C in the same process then calls Ray's handler for a run
that has ended: Train's asks its dead controller to abort and exits with status 0, Tune's sets an event nothing
reads. ``fit`` runs a trainer's or tuner's ``fit`` under ``kept_handlers``, which puts the caller's handlers
back. ``ctrl_c_raises`` makes SIGINT raise ``KeyboardInterrupt`` for a block that is woken by one
(``pipeline.data.write``), whatever was installed before. Both act in the main thread only, the one thread
Python lets set a handler.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol

RAY_FIT_SIGNALS = (signal.SIGINT, signal.SIGUSR1)


class Fittable(Protocol):
    """What ``fit`` runs: a Ray Train trainer or a Ray Tune tuner."""

    def fit(self) -> Any: ...


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def kept_handlers(signums: tuple[int, ...] = RAY_FIT_SIGNALS) -> Iterator[None]:
    """The handlers of ``signums`` as they were before the block, put back after it (also when it raises)."""
    saved = {signum: signal.getsignal(signum) for signum in signums} if _main_thread() else {}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: a handler set outside Python, which Python cannot put back
                signal.signal(signum, handler)


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[bool]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread during the block, also inside a blocking read (a
    handler that only records the signal, such as Ray's, would leave that read waiting). Yields whether it could:
    False outside the main thread, or where the handler in place was set outside Python (it could not be put
    back); the handler in place is then kept."""
    if not _main_thread() or signal.getsignal(signal.SIGINT) is None:  # None: a handler Python cannot put back
        yield False
        return
    with kept_handlers((signal.SIGINT,)):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        yield True


def fit(job: Fittable) -> Any:
    """``job.fit()`` (a Ray Train trainer or a Ray Tune tuner), the caller's SIGINT and SIGUSR1 handlers kept."""
    with kept_handlers():
        return job.fit()
