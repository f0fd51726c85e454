"""The test tiers: `make check` (``--inner-loop``) runs every test not marked ``ray``, ``beton``, ``compile``,
``slow``, ``gpu`` or ``alone``, and fails any of them that does what the first three stand for, so the tier cannot
rot; one that takes longer than ``SLOW_S`` is named at the end of the run, to be marked ``slow``.

A pytest plugin, loaded by pyproject's ``addopts`` (``-p tests.tiers``); ``tests/test_tiers.py`` loads it the same
way into a pytest of planted tests, to check that the guard fails them.

- ``ray``: imports or starts Ray in the test's process (a test that starts Ray only in a subprocess, a driver or a
  cluster, is marked too, but only this process is watched);
- ``beton``: FFCV's writer opens its file (the ``.beton``, or the hidden partial file ``write_beton`` renames)
  for writing in the test's process;
- ``compile``: calls ``torch.compile``;
- ``slow``: takes more than ``SLOW_S`` here (2 cores): a script or the CLI in a subprocess, Triton's interpreter.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import pytest

LEFT_OUT = ("ray", "beton", "compile", "slow", "gpu", "alone")
SLOW_S = 5.0  # a `make check` test slower than this (its call, here) is named at the end: mark it slow
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_FFCV = f"{os.sep}ffcv{os.sep}"  # FFCV's installed package: its writer is the only code here that writes betons
_CALLERS = 4  # frames above the hook searched for FFCV's (its writer calls open directly, or numpy's memmap)


class _Seen:
    """What the tests did that the tier forbids since the last test's end, as (mark, what) pairs: the audit hook,
    the compile wrapper and the ray watch fill it. Module and session fixtures count toward the first test that
    asks for them, a fixture's teardown toward the next test."""

    events: list[tuple[str, str]] = []
    guarding = False  # --inner-loop: set once the run is configured


def _audit(event: str, args: tuple) -> None:
    """An audit hook (``sys.addaudithook``): notes a file that FFCV's code opens for writing, its writer's beton
    (``open(name, "wb")``, then ``r+b``), whatever its name. A test's own file named ``.beton`` (a fake one, to be
    refused) is no beton write."""
    if event != "open" or not args:
        return
    path, mode, flags = (list(args) + [None, None, None])[:3]
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITES)
    if not writes or not isinstance(path, (str, bytes, os.PathLike)):
        return
    frame = sys._getframe(1)
    for _ in range(_CALLERS):
        if frame is None:
            return
        if _FFCV in frame.f_code.co_filename:
            _Seen.events.append(("beton", f"writes the beton {os.fsdecode(path)}"))
            return
        frame = frame.f_back


class _RayWatch(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: notes the import of ray (found by the finders after it, as before), and once it
    is imported wraps ``ray.init``, so that a test that starts Ray after another one imported it is named too."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray":
            _Seen.events.append(("ray", "imports ray"))
        return None  # the other finders find it

    @staticmethod
    def wrap_init() -> None:
        ray = sys.modules.get("ray")
        if ray is None or getattr(ray.init, "_watched", False):
            return
        init = ray.init

        def watched_init(*args, **kwargs):
            _Seen.events.append(("ray", "starts Ray (ray.init)"))
            return init(*args, **kwargs)

        watched_init._watched = True
        ray.init = watched_init


def _watch_compile() -> None:
    """``torch.compile`` replaced, for the process, by a wrapper that notes each call and compiles as before."""
    import torch

    compile_ = torch.compile

    def noted_compile(*args, **kwargs):
        _Seen.events.append(("compile", "calls torch.compile"))
        return compile_(*args, **kwargs)

    torch.compile = noted_compile


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--inner-loop", action="store_true",
                     help="make check: leave out the tests marked " + ", ".join(LEFT_OUT) + ", fail any other "
                          "that imports ray, writes a beton or calls torch.compile, and name those slower than "
                          f"{SLOW_S:g} s")


def pytest_configure(config: pytest.Config) -> None:
    """With ``--inner-loop``: the audit hook and the compile wrapper, for the life of the process."""
    if config.getoption("--inner-loop"):
        _Seen.guarding = True
        sys.addaudithook(_audit)  # audit hooks cannot be removed; it notes what no test should do anyway
        sys.meta_path.insert(0, _RayWatch())
        _watch_compile()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--inner-loop``, the tests marked ``ray``, ``beton``, ``compile``, ``slow``, ``gpu`` or ``alone`` are
    deselected;
    a test module that imported ray (or wrote a beton) while it was collected stops the run."""
    if not config.getoption("--inner-loop"):
        return
    if _Seen.events:
        what = "; ".join(dict.fromkeys(text for _, text in _Seen.events))
        raise pytest.UsageError(f"make check: a test module {what} while it was collected; do that inside the "
                                f"tests that need it, and mark them (docs/testing.md)")
    kept, left = [], []
    for item in items:
        (left if any(item.get_closest_marker(name) for name in LEFT_OUT) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(autouse=True)
def inner_loop_guard(request: pytest.FixtureRequest):
    """With ``--inner-loop``: fails the test (at its teardown) that imported ray or started it, had FFCV write a
    beton or called ``torch.compile``, in its body or its fixtures, naming what it did and the mark that moves it
    out of the tier."""
    yield
    if not request.config.getoption("--inner-loop"):
        return
    _RayWatch.wrap_init()
    done, _Seen.events = _Seen.events, []
    if done:
        what = "; ".join(dict.fromkeys(text for _, text in done))
        marks = ", ".join(f"pytest.mark.{mark}" for mark in dict.fromkeys(mark for mark, _ in done))
        pytest.fail(f"{request.node.nodeid} {what}: `make check` runs no such test. Mark it {marks} "
                    f"(docs/testing.md) so that only `make test` runs it", pytrace=False)


_SLOW: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Notes each test whose call took longer than ``SLOW_S`` (xdist hands every worker's reports to the
    controller, which prints the summary)."""
    if _Seen.guarding and report.when == "call" and report.duration > SLOW_S:
        _SLOW.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """With ``--inner-loop``: the unmarked tests slower than ``SLOW_S``, slowest first, to be marked ``slow``."""
    if config.getoption("--inner-loop") and _SLOW:
        terminalreporter.write_sep("-", f"make check: {len(_SLOW)} test(s) took over {SLOW_S:g} s; mark them slow "
                                        "(pytest.mark.slow) to keep the inner loop short")
        for seconds, nodeid in sorted(_SLOW, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
