"""One DeiT-S attention with the eq. 4 scores on the CPU, three ways, timed in one run.

    python benchmarks/attention_with_scores_cpu.py > docs/data/cpu/2026-11-26_joint-attention/joint_attention.txt

q, k, v are strided views of one (B, T, 3, H, D) tensor, as the models make them; batch 64, 6 heads,
T = 197, head dim 64, 2 threads. Each call of a variant follows a call of the fused attention alone
(paired, 2 warm-up and 7 timed pairs); the figure is the median of the per-pair time ratios, so
above 1 is slower than the fused attention alone. ``--smoke``: batch 2 and one timed pair, to check that
the script runs (its figures then mean nothing).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.models import significance as sig


def variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The fused attention alone, then the three ways to get the attention output and the scores."""
    scale = q.shape[-1] ** -0.5

    def fused_alone():
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    def fused_then_scores():  # two passes over the logits: what the CUDA path runs
        return fused_alone(), sig.significance_torch(q, k, None, scale)

    def joint_one_chunk():
        previous, sig._CHUNK_BYTES = sig._CHUNK_BYTES, 1 << 62
        try:
            return sig.attention_and_significance_torch(q, k, v, None, scale)
        finally:
            sig._CHUNK_BYTES = previous

    def joint_chunked():  # what the CPU path runs
        return sig.attention_and_significance_torch(q, k, v, None, scale)

    return {"fused_alone": fused_alone, "fused_then_scores": fused_then_scores, "joint_one_chunk": joint_one_chunk,
            "joint_chunked": joint_chunked}


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="batch 2, one timed pair: checks that it runs")
    args = parser.parse_args()
    torch.set_num_threads(2)
    batch, warmup, timed = (2, 0, 1) if args.smoke else (64, 2, 7)
    heads, tokens, dim = 6, 197, 64
    q, k, v = torch.randn(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    fns = variants(q, k, v)
    with torch.no_grad():
        for name in ("fused_then_scores", "joint_one_chunk", "joint_chunked"):
            pairs = [(seconds(fns["fused_alone"]), seconds(fns[name])) for _ in range(warmup + timed)][warmup:]
            ratio = statistics.median(t / base for base, t in pairs)
            print(f"{name:18s} {statistics.median(t for _, t in pairs) * 1e3:6.1f} ms, "
                  f"{ratio:.2f}x the fused attention alone ({statistics.median(b for b, _ in pairs) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
