"""One DeiT-S attention with the eq. 4 scores on the CPU, three ways, timed in one run (2026-11-26).

    python benchmarks/attention_with_scores_cpu.py > docs/data/cpu/2026-11-26_joint-attention/joint_attention.txt

q, k, v are strided views of one (B, T, 3, H, D) tensor, as the models make them; batch 64, 6 heads,
T = 197, head dim 64, 2 threads. Each call of a variant follows a call of the fused attention alone
(paired, 2 warm-up and 7 timed pairs); the figure is the median of the per-pair time ratios, so
above 1 is slower than the fused attention alone.
"""

import statistics
import time

import torch
import torch.nn.functional as F

from pipeline.models import significance as sig

torch.set_num_threads(2)
B, H, T, D = 64, 6, 197, 64
q, k, v = torch.randn(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
scale = D ** -0.5


def fused_alone():
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def fused_then_scores():  # what the CPU ran before 2026-11-26, and what CUDA runs
    return fused_alone(), sig.significance_torch(q, k, None, scale)


def joint_one_chunk():
    previous, sig._CHUNK_BYTES = sig._CHUNK_BYTES, 1 << 62
    try:
        return sig.attention_and_significance_torch(q, k, v, None, scale)
    finally:
        sig._CHUNK_BYTES = previous


def joint_chunked():  # what the CPU runs now
    return sig.attention_and_significance_torch(q, k, v, None, scale)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


with torch.no_grad():
    for fn in (fused_then_scores, joint_one_chunk, joint_chunked):
        pairs = [(seconds(fused_alone), seconds(fn)) for _ in range(9)][2:]
        ratio = statistics.median(t / base for base, t in pairs)
        print(f"{fn.__name__:18s} {statistics.median(t for _, t in pairs) * 1e3:6.1f} ms, "
              f"{ratio:.2f}x the fused attention alone ({statistics.median(b for b, _ in pairs) * 1e3:.1f} ms)")
