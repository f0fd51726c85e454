"""The ceiling of token downsampling on a device: timm's DeiT-S, its attention through SDPA and a gather of
the level-3 keep list between attention and MLP, against the unmodified model, bf16 autocast, paired calls.

    python benchmarks/gpu_ceiling.py [--device cuda] [--batch 256] [--repeats 15] [--no-compile] [--smoke]

Two ways to pick the kept tokens: ``random`` (no scores: what dropping tokens can save at best) and ``sig``
(eq. 4 from an explicit softmax(QK^T) beside SDPA, then top-K: what materialising the probabilities costs).
Speed-up = median of the per-pair ratios (unmodified time / pooled time), eager and then compiled.
``pipeline bench throughput`` prints the ``random`` row as its ceiling row (``bench_throughput.ceiling``).
``--smoke``: DeiT-Ti (the same tokens and blocks) on the CPU, one image, one pair, eager only: checks that
the script runs (its figures then mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F

from pipeline.bench.timing import time_paired
from pipeline.sparsity import level_keep

MODEL = "deit_small_patch16_224"


def pooled_forward(model: torch.nn.Module, x: torch.Tensor, keep: list[int], mode: str) -> torch.Tensor:
    """(B, 3, 224, 224) -> (B, classes): the model with ``keep[l]`` patch tokens kept after block l's attention."""
    x = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    for block, k in zip(model.blocks, keep):
        h = block.norm1(x)
        b, n, c = h.shape
        heads = block.attn.num_heads
        q, key, v = block.attn.qkv(h).reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + block.attn.proj(F.scaled_dot_product_attention(q, key, v).transpose(1, 2).reshape(b, n, c))
        if k < n - 1:
            if mode == "random":
                idx = torch.rand(b, n - 1, device=x.device).argsort(-1)[:, :k]
            else:  # eq. 4's column sums of the attention probabilities, class token left out
                s = (q @ key.transpose(-1, -2) * (c // heads) ** -0.5).softmax(-1).sum((1, 2))[:, 1:]
                idx = s.topk(k, dim=-1).indices
            x = torch.cat([x[:, :1], x[:, 1:].gather(1, idx[..., None].expand(-1, -1, c))], 1)
        x = x + block.mlp(block.norm2(x))
    return model.forward_head(model.norm(x))


def row(label: str, pooled: Callable[[], object], base: Callable[[], object], batch: int, repeats: int,
        device: torch.device, warmup: int = 3) -> str:
    bt, pt = time_paired(pooled, base, warmup=warmup, repeats=repeats, device=device)
    return (f"{label}: unmodified {batch / statistics.median(bt):.0f} images/s, pooled "
            f"{batch / statistics.median(pt):.0f}, speed-up {statistics.median(b / p for b, p in zip(bt, pt)):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15, help="timed pairs")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--smoke", action="store_true", help="DeiT-Ti, CPU, one image and pair: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.batch, args.repeats, args.no_compile = "cpu", 1, 1, True
    device = torch.device(args.device)
    model = timm.create_model("deit_tiny_patch16_224" if args.smoke else MODEL).eval().to(device)
    keep = level_keep(MODEL, 3)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
        for mode in ("random", "sig"):
            print(row(f"eager {mode}", lambda mode=mode: pooled_forward(model, x, keep, mode), lambda: model(x),
                      args.batch, args.repeats, device, warmup=0 if args.smoke else 3), flush=True)
        if not args.no_compile:
            compiled = torch.compile(model)
            for mode in ("random", "sig"):
                start = time.time()
                pooled = torch.compile(lambda x, mode=mode: pooled_forward(model, x, keep, mode))
                pooled(x), compiled(x)
                print(row(f"compiled {mode} ({time.time() - start:.0f} s)", lambda p=pooled: p(x),
                          lambda: compiled(x), args.batch, args.repeats, device), flush=True)


if __name__ == "__main__":
    main()
