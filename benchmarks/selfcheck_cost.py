"""Paired timing, CPU: the device self-check (``models.selfcheck.run_checks`` at the model's shapes, what a
model's first build on a device runs once a process, ``check_model``) against one training step of DeiT-S at the
paper's level 3 with WK-Medoids (forward, backward, AdamW; fp32, batch 32), the criterion being <= 1% of one step.

    python benchmarks/selfcheck_cost.py > docs/data/cpu/2026-11-29_selfcheck-cost/selfcheck_cost.txt

Each pair times one uncached self-check and one step back to back; the ratio is check time / step time;
medians and spread over 7 pairs, after one warm-up of each. On the CPU the self-check runs the native
K-Medoids and K-Means kernels against their torch iterations (the Triton kernels run only on CUDA).
``--smoke``: DeiT-Ti, batch 2 and one pair, to check that the script runs (its figures then mean nothing).
"""

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from pipeline.models import create_model
from pipeline.models.selfcheck import kernels_planned, model_shapes, run_checks
from pipeline.runtime import KernelChoice
from pipeline.sparsity import level_keep

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="batch 2, one pair: checks that it runs")
SMOKE = parser.parse_args().smoke
PAIRS, BATCH = (1, 2) if SMOKE else (7, 32)
torch.manual_seed(0)
# --smoke: DeiT-Ti, the same 196 tokens and 12 blocks, so DeiT-S's keep list fits it.
model = create_model("deit_tiny_patch16_224" if SMOKE else "deit_small_patch16_224", method="wkmedoids",
                     keep=level_keep("deit_small_patch16_224", 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, labels = torch.randn(BATCH, 3, 224, 224), torch.randint(0, 1000, (BATCH,))


def step() -> None:
    loss = F.cross_entropy(model(x), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def check() -> None:
    results = run_checks(KernelChoice(), "cpu", shapes=model_shapes(model))  # as check_model: the model's shapes
    assert results and all(r.ok for r in results), results


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


check(), step()  # warm-up: the native library's first load, allocator
pairs = [(seconds(check), seconds(step)) for _ in range(PAIRS)]
ratios = [c / s for c, s in pairs]
print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
print("kernels: " + ", ".join(f"{k}={v}" for k, v in kernels_planned(KernelChoice(), "cpu").items()))
print(f"self-check: median {statistics.median(c for c, _ in pairs) * 1e3:.2f} ms "
      f"(min {min(c for c, _ in pairs) * 1e3:.2f}, max {max(c for c, _ in pairs) * 1e3:.2f})")
print(f"{'DeiT-Ti' if SMOKE else 'DeiT-S'} level-3 WK-Medoids training step, fp32, batch {BATCH}: median "
      f"{statistics.median(s for _, s in pairs):.2f} s (min {min(s for _, s in pairs):.2f}, "
      f"max {max(s for _, s in pairs):.2f})")
print(f"self-check / step: median {statistics.median(ratios) * 100:.3f}% (min {min(ratios) * 100:.3f}%, "
      f"max {max(ratios) * 100:.3f}%) over {PAIRS} pairs")
