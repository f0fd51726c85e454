"""Keep lists: K = [K_1..K_L], the most non-prefix tokens left after each block (the appendix tables)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from pipeline.errors import InputError


def effective_keep(keep: Sequence[object], *, depth: int, num_tokens: int) -> list[int]:
    """Validates a keep list and returns the tokens actually left after each block.

    A value above what a layer still has means "keep all" (the paper's own lists do this, e.g.
    DeiT-e252 level 4 ends ``..., 36, 5, 7, 2, 0``), so the result is clamped to be non-increasing.

    Args:
        keep: L entries, each an integer in [0, num_tokens].
        depth: the model's number of blocks L.
        num_tokens: non-prefix tokens entering the first block (the patch count).

    Raises:
        ValueError naming the first bad entry and why.
    """
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Sequence):
        raise InputError(f"keep must be a list of {depth} integers, got {type(keep).__name__}")
    if len(keep) != depth:
        raise InputError(f"keep has {len(keep)} entries but the model has {depth} blocks; give one K per block")
    out: list[int] = []
    available = num_tokens
    for layer, value in enumerate(keep):
        where = f"keep[{layer}] (block {layer + 1})"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InputError(f"{where} must be an integer, got {value!r}")
        if value < 0:
            raise InputError(f"{where} is {value}: a number of tokens cannot be negative")
        if value > num_tokens:
            raise InputError(f"{where} is {value}, above the model's {num_tokens} patch tokens")
        available = min(available, int(value))
        out.append(available)
    return out


def parse_keep(text: str) -> list[int] | None:
    """Parses ``"196,195,...,0"`` into integers (validated later, against the model, by
    ``effective_keep``); ``"none"`` means no downsampling and gives None."""
    if text.strip().lower() == "none":
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"keep {text!r}: expected comma-separated integers, one per block, e.g. 196,195,...,0") \
            from None
