"""The paired speed of DeiT-S at a sparsity level, per method, as the evaluate stage measures it (``bench.paired``).

Each method's model at the paper's level is timed against the unmodified timm model (the same weights) in
alternating ABBA blocks: on a GPU with CUDA events (10 calls a sample), on the CPU on the process's CPU clock (one
thread). It prints each method's time ratio with its 95% interval, the blocks and why they stopped, and the
implied speed-up. ``jobs/gpu/checks.sh speed`` runs it on the lent GPU:

    python benchmarks/paired_speed.py --device cuda --methods powerbert,wkmedoids --level 3 --batch 256 \\
        --dtype bf16 --compile default
"""

from __future__ import annotations

import argparse

import torch

from pipeline.bench.paired import SpeedSettings
from pipeline.config import ConfigError
from pipeline.evaluate import speed
from pipeline.models import create_model
from pipeline.runtime import compile_model, cuda_settings
from pipeline.sparsity import level_keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="deit_small_patch16_224")
    parser.add_argument("--methods", default="powerbert,wkmedoids", help="comma-separated")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--compile", default="none", help="torch.compile mode, or none")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--cap-s", type=float, default=60.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    try:
        keep = level_keep(args.model, args.level)
    except ConfigError as err:  # a model or level the paper gives no keep list for: its message, no traceback
        raise SystemExit(f"error: --model {args.model} --level {args.level}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    torch.manual_seed(0)
    base = create_model(args.model).eval().to(device)
    images = torch.randn(args.batch, 3, *base.patch_embed.img_size, device=device)
    settings = SpeedSettings(tolerance=args.tolerance, cap_s=args.cap_s, cap_key="--cap-s")
    print(f"{args.model} level {args.level}, batch {args.batch}, {args.dtype}, compile {args.compile}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU, one thread, CPU clock'}")
    print("| method | time ratio | 95% interval | blocks | stop | speed-up |\n|---|---:|---:|---:|---|---:|")
    with cuda_settings(device):
        reference = compile_model(base, args.compile, device)
        for method in args.methods.split(","):
            model = create_model(args.model, method=method, keep=keep).eval().to(device)
            model.load_state_dict(base.state_dict(), strict=False)
            ratio = speed(compile_model(model, args.compile, device), reference, images, device=device,
                          dtype=args.dtype, compile=args.compile, settings=settings)
            print(f"| {method} | {ratio.ratio:.3f} | [{ratio.low:.3f}, {ratio.high:.3f}] | {ratio.blocks} | "
                  f"{ratio.stop} | {1 / ratio.ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
