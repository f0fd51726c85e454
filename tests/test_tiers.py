"""The inner-loop guard (tests/tiers.py): `make check` fails a test that imports ray, writes a beton or calls
torch.compile without the mark that leaves it out, and runs the rest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.processes import ROOT

PLANTED = '''
import pytest


def test_imports_ray():
    import ray  # noqa: F401


def test_writes_a_beton(tmp_path):
    from pipeline.data import WriteSettings, open_source, write_beton

    write_beton(open_source("synthetic:classes=2,count=4,size=8"), tmp_path / "train.beton",
                WriteSettings(mode="raw", max_res=None, workers=1), log=lambda _: None)


def test_compiles():
    import torch

    torch.compile(lambda x: x + 1)  # compiling is lazy: the call alone is what counts


def test_writes_a_fake_beton(tmp_path):
    assert (tmp_path / "fake.beton").write_text("not a beton") == 11  # a test's own file: no beton write


@pytest.mark.ray
def test_marked():
    import ray  # noqa: F401
'''


def run_planted(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    """pytest on ``source`` in a fresh process, with the guard's plugin alone (not this suite's conftest, which
    loads the same module by ``pytest_plugins``)."""
    (tmp_path / "test_planted.py").write_text(source)
    command = [sys.executable, "-m", "pytest", "-p", "tests.tiers", "-p", "no:cacheprovider", "-q", "-rA",
               "-W", "ignore::pytest.PytestUnknownMarkWarning", *options, "test_planted.py"]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "1000"})  # summary lines whole


@pytest.mark.slow
def test_the_guard_fails_each_planted_test_by_what_it_did_and_deselects_the_marked_one(tmp_path):
    """One fresh pytest for all five cases (a ray import, a torch.compile call, a beton of four 8 px images: about
    20 s): each failure names what the test did and the one mark that moves it out."""
    proc = run_planted(tmp_path, PLANTED, "--inner-loop")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = {line.split(" ", 2)[1].split("::")[-1]: line for line in proc.stdout.splitlines()
              if line.startswith("ERROR test_planted.py::")}
    assert set(errors) == {"test_imports_ray", "test_writes_a_beton", "test_compiles"}, out
    for name, did, mark in (("test_imports_ray", "imports ray", "ray"), ("test_compiles", "calls torch.compile",
                            "compile"), ("test_writes_a_beton", "writes the beton", "beton")):
        assert did in errors[name] and f"Mark it pytest.mark.{mark} (" in errors[name], errors[name]
    assert ".train.beton.partial-" in errors["test_writes_a_beton"]  # write_beton's hidden file, as FFCV opens it
    assert "PASSED test_planted.py::test_writes_a_fake_beton" in proc.stdout
    assert "1 deselected" in proc.stdout


@pytest.mark.slow
def test_a_module_that_imports_ray_when_collected_stops_make_check(tmp_path):
    """A test module's own top-level ``import ray`` would hide every later import from the guard: the run stops
    while it is collected, saying so, and runs nothing."""
    proc = run_planted(tmp_path, "import ray  # noqa: F401\n\n\ndef test_adds():\n    assert 1 + 1 == 2\n",
                       "--inner-loop")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out  # pytest's usage error
    assert "make check: a test module imports ray while it was collected" in out and "passed" not in out, out
