"""Grid downsampling by a strided 2x2 convolution over the token grid (Appendix D, as in Swin and PiT).

The 2x2 neighbours of the grid are concatenated and mapped back to M features, so one layer turns an
h x w grid into ceil(h/2) x ceil(w/2). An odd side is zero-padded; padding counts as size 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import InputError
from pipeline.pooling.common import PoolResult, check_k, check_per_token, check_tokens, identity_result


def grid_shape(n: int, grid: tuple[int, int] | None) -> tuple[int, int]:
    """The (h, w) token grid: ``grid`` if given, else the square root of ``n``."""
    if grid is not None:
        h, w = grid
        if h * w != n:
            raise InputError(f"grid {grid} holds {h * w} tokens but tokens has N={n}")
        return h, w
    side = math.isqrt(n)
    if side * side != n:
        raise InputError(f"tokens has N={n}, which is no square grid; pass grid=(h, w)")
    return side, side


def pooled_count(n: int, grid: tuple[int, int] | None = None) -> int:
    """Number of tokens after one 2x2 stride-2 layer on N tokens."""
    h, w = grid_shape(n, grid)
    return math.ceil(h / 2) * math.ceil(w / 2)


class GridConvDownsample(nn.Module):
    """A learnable 2x2 stride-2 convolution over the (h, w) token grid, (B, h*w, M) -> (B, ceil(h/2)*ceil(w/2), M)."""

    def __init__(self, dim: int, *, grid: tuple[int, int] | None = None, k: int | None = None) -> None:
        """``grid``: the (h, w) it will see; ``k``: the token count it must produce (checked here)."""
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InputError(f"dim must be a positive integer, got {dim!r}")
        self.dim = dim
        self.grid = grid
        self.conv = nn.Conv2d(dim, dim, kernel_size=2, stride=2)
        if grid is not None and k is not None and k != pooled_count(grid[0] * grid[1], grid):
            h, w = grid
            raise InputError(f"conv downsampling of a {h}x{w} grid gives {pooled_count(h * w, grid)} tokens; use "
                             f"that, or {h * w} to skip the block")

    @property
    def out_grid(self) -> tuple[int, int] | None:
        """The grid of the tokens it outputs (the next block's input)."""
        return None if self.grid is None else (-(-self.grid[0] // 2), -(-self.grid[1] // 2))

    def forward(
        self, tokens: Tensor, k: int, *, sizes: Tensor | None = None, validate: bool = True, **_: object
    ) -> PoolResult:
        """Downsamples when ``k`` equals the pooled grid's size; ``k >= N`` keeps every token."""
        check_tokens(tokens, finite=validate)
        k = check_k(k)
        check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
        b, n, m = tokens.shape
        if m != self.dim:
            raise InputError(f"tokens have M={m} features but this layer was built for dim={self.dim}")
        if k >= n:
            return identity_result(tokens, sizes)
        h, w = grid_shape(n, self.grid)
        expected = pooled_count(n, (h, w))
        if k != expected:
            raise InputError(
                f"conv downsampling maps a {h}x{w} grid to {expected} tokens, so k must be {expected} "
                f"(or >= {n} to skip this layer), got k={k}"
            )
        ph, pw = h % 2, w % 2
        grid = tokens.transpose(1, 2).reshape(b, m, h, w)
        grid = F.pad(grid, (0, pw, 0, ph))
        out = self.conv(grid).flatten(2).transpose(1, 2)  # (B, K, M)
        rows = torch.arange(h, device=tokens.device) // 2
        cols = torch.arange(w, device=tokens.device) // 2
        cell = (rows.unsqueeze(1) * math.ceil(w / 2) + cols.unsqueeze(0)).reshape(-1)  # (N,)
        assign = cell.expand(b, n)
        in_sizes = torch.ones(b, n, device=tokens.device) if sizes is None else sizes.float()
        out_sizes = torch.zeros(b, k, device=tokens.device).index_add(1, cell, in_sizes)
        return PoolResult(tokens=out, sizes=out_sizes, assign=assign)
