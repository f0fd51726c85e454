"""The patch embedding as one matmul: the same function and parameters as timm's stride-p convolution.

Why: on CUDA, cuDNN runs the 16x16, stride-16 convolution of a ViT's patch embedding as a slow
implicit GEMM, several times slower than a reshape + matmul of the same patches (``bench kernels``
times both; docs/benchmarks.md): a large share of a compiled DeiT-S forward, paid alike by the
unmodified and the downsampled models. timm has no
switch for it, so ``PatchMatmul`` replaces the convolution module and keeps its parameters
(``patch_embed.proj.weight`` and ``.bias``), so every state dict still loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import InputError

# config.PatchEmbed lists the same choices; models do not import the config layer (as COMPILE_MODES)
PATCH_EMBEDS: tuple[str, ...] = ("conv", "matmul")


class PatchMatmul(nn.Conv2d):
    """A non-overlapping patch convolution (kernel = stride, no padding) computed as one matmul."""

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, E, H // p, W // q): the convolution's output (as a channels-last view).

        Rows and columns past the last whole patch are dropped, as the convolution drops them. Under
        autocast the image is cast before the reshape, so the copy moves half the bytes.
        """
        b, c, h, w = x.shape
        p, q = self.kernel_size
        gh, gw = h // p, w // q
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        patches = x[:, :, :gh * p, :gw * q].reshape(b, c, gh, p, gw, q).permute(0, 2, 4, 1, 3, 5)
        out = F.linear(patches.reshape(b, gh, gw, c * p * q), self.weight.reshape(self.out_channels, -1), self.bias)
        return out.permute(0, 3, 1, 2)  # (B, E, gh, gw), strides of channels-last: flatten(2) needs no copy


def use_patch_embed(model: nn.Module, kind: str) -> None:
    """Makes a timm ViT's ``patch_embed.proj`` compute as ``kind``: ``conv`` leaves timm's module as it is,
    ``matmul`` replaces the convolution by a ``PatchMatmul`` holding the same Parameters (so optimiser
    state and state dicts carry over)."""
    if kind not in PATCH_EMBEDS:
        raise InputError(f"patch_embed must be one of {PATCH_EMBEDS}, got {kind!r}")
    if kind == "conv":
        return
    proj = getattr(getattr(model, "patch_embed", None), "proj", None)
    if not isinstance(proj, nn.Conv2d):
        raise InputError(f"patch_embed='matmul' needs a ViT whose patch_embed.proj is a convolution, "
                         f"got {type(proj).__name__}; use patch_embed='conv'")
    if proj.kernel_size != proj.stride or proj.padding not in ((0, 0), "valid") or proj.dilation != (1, 1) \
            or proj.groups != 1:
        raise InputError(f"patch_embed='matmul' needs non-overlapping patches (kernel = stride, no padding, "
                         f"one group); this model's projection is {proj}: use patch_embed='conv'")
    new = PatchMatmul(proj.in_channels, proj.out_channels, proj.kernel_size, stride=proj.stride,
                      bias=proj.bias is not None, device=proj.weight.device, dtype=proj.weight.dtype)
    new.weight, new.bias = proj.weight, proj.bias
    model.patch_embed.proj = new
