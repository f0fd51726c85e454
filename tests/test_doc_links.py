"""The docs send readers only to what a clone has, or to public URLs: every relative link (and every
backticked ``../`` path) in README.md and the Markdown under docs/ and jobs/ resolves to a file or folder
inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "jobs").rglob("*.md"),
               *(ROOT / "docker").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
RELATIVE_CODE = re.compile(r"`(\.\./[^`\s]+)`")  # `../somewhere`, a path a reader would follow
PUBLIC = ("https://", "http://", "mailto:")


def targets(text: str) -> list[str]:
    """Every link target and backticked ``../`` path of a Markdown text, anchors cut off."""
    found = LINK.findall(text) + RELATIVE_CODE.findall(text)
    return [t.split("#", 1)[0] for t in found if not t.startswith(PUBLIC) and not t.startswith("#")]


def test_the_link_finder_sees_links_and_paths():
    text = "[a](../x.md#top) [b](https://example.org/y) [c](#here) `../shared/gpu/README.md` `pipeline/x.py`"
    assert targets(text) == ["../x.md", "../shared/gpu/README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_stays_in_the_repository(doc):
    broken = []
    for target in targets(doc.read_text()):
        path = (doc.parent / target).resolve()
        if not path.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (no such file)")
    assert not broken, f"{doc.relative_to(ROOT)}: " + ", ".join(broken)
