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
