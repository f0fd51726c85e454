"""Kernel-running ops of one eager DeiT-S level-3 forward under one held bf16 autocast context (docs/benchmarks.md).

    python benchmarks/eager_launches.py [--smoke]

Prints per method: the aten ops that run a kernel (views left out) and the custom ops. ``--smoke``: DeiT-Ti
(the same tokens and blocks) and two methods, to check that the script runs.
"""

import argparse

import torch

from pipeline.bench.profiling import OpCounter
from pipeline.models import create_model
from pipeline.pooling.common import dense_segments
from pipeline.runtime import inference
from pipeline.sparsity import level_keep

METHODS = ("none", "random", "powerbert", "kmedoids", "wkmedoids", "kmeans", "tome")


def launches(name: str) -> bool:  # an op that runs a kernel: not a view ("aten.view.default")
    _, op, overload = name.split(".")
    return op != "_unsafe_view" and not getattr(getattr(torch.ops.aten, op), overload).is_view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="DeiT-Ti, two methods: checks that it runs")
    args = parser.parse_args()
    model, methods = ("deit_tiny_patch16_224", ("none", "kmedoids")) if args.smoke else ("deit_small_patch16_224",
                                                                                        METHODS)
    x, keep = torch.randn(1 if args.smoke else 2, 3, 224, 224), level_keep("deit_small_patch16_224", 3)
    for method in methods:
        m = create_model(model, method=method, keep=None if method == "none" else keep, patch_embed="matmul").eval()
        with dense_segments(True), inference("cpu", "bf16"):  # CUDA's code paths, one held context
            m(x)
            with OpCounter() as c:
                m(x)
        print(method, sum(n for name, n in c.ops.items() if name.startswith("aten.") and launches(name)),
              sum(n for name, n in c.ops.items() if not name.startswith("aten.")))


if __name__ == "__main__":
    main()
