"""pipeline.signals: the caller's handlers survive a Ray fit, and a write blocked in a read wakes on SIGINT."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline import signals


def _records(calls: list[int]):
    def handler(signum, _frame) -> None:  # as Ray's: notes the signal and returns
        calls.append(signum)
    return handler


@pytest.fixture
def planted():
    """A recording handler on SIGINT and SIGUSR1 for the test, the process's own put back after it."""
    calls: list[int] = []
    handler = _records(calls)
    previous = {signum: signal.signal(signum, handler) for signum in signals.RAY_FIT_SIGNALS}
    yield handler, calls
    for signum, old in previous.items():
        signal.signal(signum, old)


class RayLikeJob:
    """A trainer whose fit installs handlers of its own and leaves them, as Ray Train's and Tune's do."""

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises

    def fit(self) -> str:
        for signum in signals.RAY_FIT_SIGNALS:
            signal.signal(signum, lambda *_: None)
        if self.raises:
            raise RuntimeError("the job failed")
        return "result"


def test_fit_returns_the_jobs_result_and_leaves_the_callers_handlers(planted):
    handler, _ = planted
    assert signals.fit(RayLikeJob()) == "result"
    assert [signal.getsignal(s) for s in signals.RAY_FIT_SIGNALS] == [handler, handler]
    with pytest.raises(RuntimeError, match="the job failed"):
        signals.fit(RayLikeJob(raises=True))
    assert [signal.getsignal(s) for s in signals.RAY_FIT_SIGNALS] == [handler, handler]


def _signal_main_thread_after(seconds: float) -> threading.Thread:
    main = threading.main_thread().ident

    def send() -> None:
        time.sleep(seconds)
        signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_raises_wakes_a_blocking_read_although_a_recording_handler_was_installed(planted):
    """Under the recording handler alone, SIGINT interrupts the read, the handler returns and the read goes on
    (PEP 475): the FFCV driver's wait on a dead worker's queue. Under ctrl_c_raises the read ends in
    KeyboardInterrupt, and the recording handler is back after the block."""
    handler, calls = planted
    read_end, write_end = os.pipe()
    unblock = threading.Timer(10.0, os.write, (write_end, b"y"))  # were the read not woken: a failure, no hang
    try:
        sender = _signal_main_thread_after(0.2)
        threading.Timer(1.0, os.write, (write_end, b"x")).start()  # ends the read that is not interrupted
        assert os.read(read_end, 1) == b"x" and calls == [signal.SIGINT]  # signalled, and still read on
        sender.join()
        unblock.start()
        with pytest.raises(KeyboardInterrupt), signals.ctrl_c_raises() as wakeable:
            assert wakeable
            _signal_main_thread_after(0.2)
            os.read(read_end, 1)  # nothing is written before the 10 s: only the signal ends it sooner
        assert signal.getsignal(signal.SIGINT) is handler and calls == [signal.SIGINT]
    finally:
        unblock.cancel()
        os.close(read_end)
        os.close(write_end)


def test_off_the_main_thread_nothing_is_changed(planted):
    handler, _ = planted
    seen: list[object] = []

    def body() -> None:
        with signals.ctrl_c_raises() as wakeable:
            seen.append(wakeable)
            seen.append(signal.getsignal(signal.SIGINT))
        with signals.kept_handlers():
            seen.append("kept")

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [False, handler, "kept"] and signal.getsignal(signal.SIGINT) is handler


def test_a_handler_set_outside_python_is_left_alone(planted, monkeypatch):
    """``signal.getsignal`` gives None for a handler installed from C: ctrl_c_raises could not put it back, so it
    changes nothing and says so."""
    real = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda signum: None if signum == signal.SIGINT else real(signum))
    with signals.ctrl_c_raises() as wakeable:
        assert wakeable is False
        assert real(signal.SIGINT) is planted[0]
    assert real(signal.SIGINT) is planted[0]
