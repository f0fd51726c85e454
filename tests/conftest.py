"""Shared test setup."""

# Imported here, before any test starts FFCV's loader threads: CPython 3.11 can fail with "AST
# constructor recursion depth mismatch" when pytest rewrites a module (hypothesis's plugin is
# otherwise imported lazily at the terminal summary) while another thread is compiling.
from pathlib import Path

import hypothesis  # noqa: F401
import pytest


def write_synthetic_pair(root, train: int, val: int):
    """``root/train.beton`` and ``root/val.beton``: 4-class 16 px synthetic data (raw pixels)."""
    from pipeline.data import WriteSettings, open_source, write_beton

    raw = WriteSettings(mode="raw", max_res=None)
    write_beton(open_source(f"synthetic:classes=4,count={train},size=16"), root / "train.beton", raw,
                log=lambda _: None)
    write_beton(open_source(f"synthetic:classes=4,count={val},size=16,seed=1"), root / "val.beton", raw,
                log=lambda _: None)
    return root


@pytest.fixture(scope="session", autouse=True)
def no_store_in_the_checkout():
    """No code path may fall back to MLflow's default store (``./mlflow.db`` in the working directory)."""
    stray = Path(__file__).resolve().parents[1] / "mlflow.db"
    existed = stray.exists()
    yield
    assert existed or not stray.exists(), "a test run created ./mlflow.db: some MLflow call used the default store"


# The files whose tests start Ray (a local one in this process, or Ray clusters and drivers in subprocesses).
RAY_FILES = {"test_cluster.py", "test_dag.py", "test_hpo.py", "test_multinode.py", "test_train.py"}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which `make test` runs with (-n 2 --dist loadfile)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the files in ``RAY_FILES`` as one unit: their tests run one at a time in one
    worker, as in a serial run, and every other file runs whole in either worker (module fixtures are built
    once). Not the ``xdist_group`` mark with ``--dist loadgroup``: with pytest 9.2 that mark is silently
    ignored (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if Path(path).name in RAY_FILES else path

    return RayFilesTogether(config, log)
