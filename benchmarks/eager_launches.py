"""Kernel-running ops of one eager DeiT-S level-3 forward under one held bf16 autocast context (docs/benchmarks.md)."""

import torch

from pipeline.bench.profiling import OpCounter
from pipeline.models import create_model
from pipeline.pooling.common import dense_segments
from pipeline.runtime import inference
from pipeline.sparsity import level_keep


def launches(name: str) -> bool:  # an op that runs a kernel: not a view ("aten.view.default")
    _, op, overload = name.split(".")
    return op != "_unsafe_view" and not getattr(getattr(torch.ops.aten, op), overload).is_view


x, keep = torch.randn(2, 3, 224, 224), level_keep("deit_small_patch16_224", 3)
for method in ("none", "random", "powerbert", "kmedoids", "wkmedoids", "kmeans", "tome"):
    m = create_model("deit_small_patch16_224", method=method, keep=None if method == "none" else keep,
                     patch_embed="matmul").eval()
    with dense_segments(True), inference("cpu", "bf16"):  # CUDA's code paths, one held context
        m(x)
        with OpCounter() as c:
            m(x)
    print(method, sum(n for name, n in c.ops.items() if name.startswith("aten.") and launches(name)),
          sum(n for name, n in c.ops.items() if not name.startswith("aten.")))
