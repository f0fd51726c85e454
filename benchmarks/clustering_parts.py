"""Where a clustering step's time goes on the CPU: WK-Medoids and K-Means (Gram form) at one block's shape, part by
part, each part timed paired against the DeiT-S block it would follow (as ``pipeline bench ops`` times whole steps).

    python benchmarks/clustering_parts.py [--batch 64] [--keep 98] [--iters 5] [--threads 1] [--repeats 15] [--smoke]

The parts are those of ``clustering.token_pool``, called as it calls them on the block's own tokens and scores:
the weights (``effective_weights``), the initial centres (top-K by significance), the products the iterations start
from (K-Means: the Gram matrix, one ``bmm``; K-Medoids: the starting medoids' rows times the tokens, one
``index_select`` and one ``bmm``), the iterations (the native kernel; K-Medoids' includes its matmul and computes the
distances the matmul did not give: ``iters=1`` is that and the first assignment alone, the difference to ``iters``
the rest; K-Means' runs on the Gram matrix), and the merge (``pool_segments``: the gather
and the weighted means). First the script checks that the native iterations give the torch path's medoids and
assignments (``same as the torch path``). The whole step (the method's downsampler) is the last row of each method;
the parts add up to about it. Medians of ``--repeats`` pairs; "% of block" is the median of the per-pair ratios.
``--smoke``: a 2-image, 24-token problem and one pair, to check that the script runs (its figures then mean nothing).
"""

import argparse
import platform
import statistics
from collections.abc import Callable

import timm
import torch

from pipeline.bench.ops import block_inputs
from pipeline.bench.timing import time_paired
from pipeline.methods import build_downsampler
from pipeline.pooling import clustering, native
from pipeline.pooling.merge import pool_segments


def parts(method: str, tokens: torch.Tensor, scores: torch.Tensor, k: int, iters: int,
          lib) -> list[tuple[str, Callable[[], object]]]:
    """(part, call) of one ``token_pool`` step of ``method`` (kmedoids or kmeans, weighted) on tokens (B, N, M)."""
    x = tokens.float()
    w = clustering.effective_weights(x, scores, None)
    start = clustering.initial_indices(k, init="topk", init_scores=scores, tokens=x, generator=None)
    g = clustering.gram(x)
    rows = [("weights", lambda: clustering.effective_weights(x, scores, None)),
            ("initial centres (top-K)", lambda: clustering.initial_indices(k, init="topk", init_scores=scores,
                                                                           tokens=x, generator=None))]
    if method == "kmedoids":
        med, assign = native.kmedoids(lib, x, w, start, iters, clustering.SWAP_RTOL)
        want = clustering.kmedoids_dense(clustering.dists_from_gram(g), w, start, iters)
        print(f"same as the torch path: {torch.equal(med, want[0]) and torch.equal(assign, want[1])}")
        flat = (start + torch.arange(len(x)).unsqueeze(1) * x.shape[1]).view(-1)
        rows += [("the starting medoids' columns (index_select, bmm)",
                  lambda: torch.bmm(x.view(-1, x.shape[-1]).index_select(0, flat).view(len(x), k, -1),
                                    x.transpose(1, 2))),
                 ("the columns, the other distances and the first assignment (iterations x1)",
                  lambda: native.kmedoids(lib, x, w, start, 1, clustering.SWAP_RTOL)),
                 (f"iterations x{iters}", lambda: native.kmedoids(lib, x, w, start, iters, clustering.SWAP_RTOL))]
        merge_start = None
    else:
        rows.append(("Gram matrix (bmm)", lambda: clustering.gram(x)))
        assign = native.kmeans_gram(lib, g, w, start, iters)
        print(f"same as the torch path: {torch.equal(assign, clustering.kmeans_gram_iterations(g, w, start, iters))}")
        rows += [("iterations x1 (the first assignment)", lambda: native.kmeans_gram(lib, g, w, start, 1)),
                 (f"iterations x{iters}", lambda: native.kmeans_gram(lib, g, w, start, iters))]
        merge_start = start
    rows.append(("merge (gather and weighted means)", lambda: pool_segments(x, w, None, assign, k, merge_start)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keep", type=int, default=98)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: as the latency tables time)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="a tiny problem and one pair: checks that it runs")
    args = parser.parse_args()
    lib = native.library()
    assert lib is not None, "the native kernels did not build"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = "vit_tiny_patch16_224" if args.smoke else "deit_small_patch16_224"
    net = timm.create_model(model, pretrained=False, **({"img_size": 20, "patch_size": 4} if args.smoke else {}))
    batch, repeats = (2, 1) if args.smoke else (args.batch, args.repeats)
    n = net.patch_embed.num_patches
    keep = min(args.keep, n // 2)
    block = net.blocks[0].eval()
    x = torch.randn(batch, net.num_prefix_tokens + n, net.embed_dim)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s); torch "
          f"{torch.__version__}; the native K-Medoids runs at {native.instruction_set()}, K-Means at the baseline")
    print(f"block: {model} blocks[0] on ({batch}, {x.shape[1]}, {net.embed_dim}); K = {keep}, {args.iters} "
          f"iterations, weighted by significance, top-K initial centres")
    with torch.inference_mode():
        inputs = block_inputs(block, x, net.num_prefix_tokens)
        for method in ("kmedoids", "kmeans"):
            step = build_downsampler(f"w{method}")
            whole = ("whole step (the downsampler)", lambda s=step: s(inputs.tokens, keep, scores=inputs.scores,
                                                                      metric=inputs.keys, validate=False))
            print(f"\n{'WK-Means (Gram form)' if method == 'kmeans' else 'WK-Medoids'}:")
            rows = parts(method, inputs.tokens, inputs.scores, keep, args.iters, lib)  # prints the check first
            print("| part | median ms | % of block |")
            print("|---|---:|---:|")
            for label, call in [*rows, whole]:
                base, own = time_paired(call, lambda: block(x), warmup=1, repeats=repeats, device=torch.device("cpu"))
                share = statistics.median(o / b for o, b in zip(own, base))
                print(f"| {label} | {statistics.median(own) * 1e3:.3f} | {100 * share:.2f} |")


if __name__ == "__main__":
    main()
