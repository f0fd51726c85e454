"""The README's Python examples run as written, against today's code (a moved or renamed name fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.M | re.S)


def test_the_readme_has_python_examples_that_use_the_pipeline():
    assert len(BLOCKS) >= 2 and all("from pipeline" in block for block in BLOCKS), BLOCKS


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_python_block_runs_as_written(block: str):
    import warnings

    with warnings.catch_warnings():
        # The README shows no name that moved away (the warning points at the line that imports it).
        warnings.filterwarnings("error", category=DeprecationWarning, module="readme")
        exec(compile(block, f"{README.name} (python block)", "exec"), {"__name__": "readme"})  # noqa: S102
