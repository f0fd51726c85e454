"""Token Pooling (Marin et al., Algorithm 1 and Appendix A): K-Means and K-Medoids, optionally weighted.

Exact semantics, which the brute-force references in ``tests/`` follow step by step:

1. Initial centres: the K tokens with the highest ``init_scores`` (``init="topk"``), or K distinct
   tokens drawn uniformly (``init="random"``).
2. ``iters`` rounds of Algorithm 1's loop body: assign every token to its nearest centre (eq. 6,
   ties to the lowest index; a K-Medoids medoid always joins its own cluster), then update the
   centres. K-Means: the weighted mean of each cluster (eq. 7 and 13); an empty cluster keeps its
   centre. K-Medoids: the member ``i`` minimising ``sum_{i' in cluster} w_i' ||f_i - f_i'||^2``
   (eq. 8 and 14, with the weights that make it minimise the weighted objective; lowest index on
   ties), taken only when its cost is lower than the current medoid's by more than a relative
   1e-4, so that the objective never increases and rounding never swaps tied medoids.
3. The output is the weighted mean of each cluster of the last assignment (Algorithm 1, last
   line), so the last round's centre update never reaches the output and is skipped. No K-Medoids
   cluster is ever empty; an empty K-Means cluster outputs the token its centre started from, with
   size 0.

A converged iteration changes nothing, so the loop runs a fixed number of times and never asks the
device whether it has converged (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.errors import InputError
from pipeline.pooling import native
from pipeline.pooling.common import (
    Partition,
    PoolResult,
    augmented,
    batch_offset,
    check_k,
    check_metric,
    check_per_token,
    check_tokens,
    gather_rows,
    identity_result,
    one_hot,
    segment_means,
    uniform_noise,
    use_dense,
    work_dtype,
)
from pipeline.pooling.merge import pool_segments
from pipeline.runtime import KernelChoice, exporting, note_dispatch

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch path
    from pipeline.pooling.kmeans_triton import kmeans_fused_triton
    from pipeline.pooling.kmedoids_triton import kmedoids_fused_triton, kmedoids_triton
except ImportError:  # pragma: no cover - depends on the install
    kmedoids_triton = kmedoids_fused_triton = kmeans_fused_triton = None

CLUSTER_METHODS = ("kmeans", "kmedoids")
INITS = ("topk", "random")
# Floor for normalised weights: keeps every weighted mean defined (an all-zero-weight cluster
# averages its members uniformly) without moving results for weights within 1e12 of the largest.
_WEIGHT_FLOOR = 1e-12
# A medoid is replaced only by a member cheaper by more than this relative margin. Two-member
# clusters tie exactly (unweighted), and float32 rounding must not flip a tie into a swap.
SWAP_RTOL = 1e-4
DEFAULT_KERNELS = KernelChoice()


def gram(x: Tensor) -> Tensor:
    """The Gram matrices X X^T, (B, N, D) -> (B, N, N): one batched matmul, the only (B, N, D) read of an
    iteration's inputs (K-Means and K-Medoids both iterate on it)."""
    return torch.bmm(x, x.transpose(1, 2))


def dists_from_gram(g: Tensor) -> Tensor:
    """Squared distances ||x_i - x_j||^2 = (G_ii + G_jj) - 2 G_ij from the Gram matrices g (B, N, N).

    The diagonal is exactly 0, and the Triton kernel that reads g instead of the distances
    (``kmedoids_triton._dist``) rounds in the same order, so both see the same distances.
    """
    diag = g.diagonal(dim1=1, dim2=2)  # (B, N)
    return torch.sub(diag.unsqueeze(2) + diag.unsqueeze(1), g, alpha=2.0)


def sq_dists(x: Tensor) -> Tensor:
    """All pairwise squared distances ||x_i - x_j||^2, (B, N, D) -> (B, N, N), as K-Medoids sees them."""
    return dists_from_gram(gram(x))


def effective_weights(tokens: Tensor, weights: Tensor | None, sizes: Tensor | None) -> Tensor | None:
    """Per-token weights w_i * size_i, scaled to a maximum of 1 per sample and floored, (B, N).

    None when neither is given: every token weighs the same, and the callers skip the products.
    """
    if weights is None and sizes is None:
        return None
    dtype = work_dtype(tokens)
    if weights is None:
        w = sizes.to(dtype)
    elif sizes is None:
        w = weights.to(dtype)
    else:
        w = weights.to(dtype) * sizes.to(dtype)
    # Weighted means and medoids are scale-invariant, so the scaling changes no result.
    w = w / w.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return w.clamp_min(_WEIGHT_FLOOR)


def initial_indices(k: int, *, init: str, init_scores: Tensor | None, tokens: Tensor,
                    generator: torch.Generator | None) -> Tensor:
    """Indices (B, K) of the tokens (B, N, M) that start as cluster centres."""
    if init == "topk":
        return init_scores.topk(k, dim=-1).indices
    return uniform_noise(tokens[..., 0], generator).topk(k, dim=-1).indices


def _kmeans(x: Tensor, w: Tensor | None, start: Tensor, iters: int, gram: bool | None = None,
            kernels: KernelChoice = DEFAULT_KERNELS) -> Tensor:
    """Lloyd iterations from the tokens at ``start``: x (B, N, D), w (B, N) or None, start (B, K) token
    indices -> last assignment (B, N); ``kernels`` picks the Gram form's implementation.

    Two forms of the same iterations, by shape (``gram`` forces one, for the tests):

    - ``_kmeans_gram`` when N <= 2 D (the tokens of a ViT: N <= 197, D >= 192): every iteration is one
      (K, N) x (N, N) product against the Gram matrix, computed once;
    - ``_kmeans_features`` otherwise (a narrow metric, such as the keys averaged over heads): two
      (K, N) x (N, D) products an iteration, the distances and the new centres.
    """
    if gram is None:
        gram = x.shape[1] <= 2 * x.shape[2]
    if gram:
        return _kmeans_gram(x, w, start, iters, kernels)
    note_dispatch("kmeans", "torch", x.shape[1])  # the feature form: torch ops on every device
    return _kmeans_features(x, w, gather_rows(x, start), iters)


def _kmeans_features(x: Tensor, w: Tensor | None, centres: Tensor, iters: int) -> Tensor:
    """Lloyd iterations on explicit centres (B, K, D); see ``_kmeans``.

    The nearest centre of x_i minimises ||c_j||^2 - 2 x_i . c_j (||x_i||^2 is the same for every j).
    """
    b, _, _ = x.shape
    k = centres.shape[1]
    x_t = x.transpose(1, 2)  # (B, D, N)
    rows = augmented(x, w)  # (B, N, D + 1), for the weighted means
    offset = None if use_dense(x) else batch_offset(b, k, x.device)

    def nearest(c: Tensor) -> Tensor:
        return torch.baddbmm((c * c).sum(-1).unsqueeze(-1), c, x_t, alpha=-2.0).argmin(1)  # (B, K, N) -> (B, N)

    assign = nearest(centres)
    for _ in range(iters - 1):
        means, total = segment_means(Partition(assign, k, dtype=x.dtype, offset=offset), rows, x.shape[-1])
        centres = torch.where(total > 0, means, centres)  # an empty cluster keeps its centre
        assign = nearest(centres)
    return assign


def _kmeans_gram(x: Tensor, w: Tensor | None, start: Tensor, iters: int, kernels: KernelChoice = DEFAULT_KERNELS
                 ) -> Tensor:
    """Lloyd iterations with every centre kept as its coefficients over the tokens: c_k = sum_j a_kj x_j,
    a (B, K, N) the weighted, normalised membership (one-hot at ``start`` to begin with). With G = X X^T
    (B, N, N), computed once, ``c_k . x_i = (a G)_ki`` and ``||c_k||^2 = sum_j a_kj (a G)_kj``, so an
    iteration is one (K, N) x (N, N) product, where the feature form takes two (K, N) x (N, D) products and
    reads the (B, N, D) tokens twice. See ``_kmeans``.

    The iterations are one custom op, ``tokenpool::kmeans_gram``: on CUDA one Triton kernel that runs every
    iteration of an image in one program (``kmeans_fused_triton``), native code on the CPU
    (``native.kmeans_gram``: its update costs N^2 where the dense product costs K N^2, unless
    ``kernels.native`` is ``torch``), and the torch iterations (``kmeans_gram_iterations``) where neither is
    at hand. ``kernels.kmeans: torch`` runs the torch iterations outside the op on every device, for
    ``torch.compile`` to trace (what the last GPU figures ran, docs/benchmarks.md), so that
    ``jobs/gpu/checks.sh`` can time the two; they are also the device self-check's reference.
    """
    g = gram(x)
    if exporting():  # traced for another runtime: no torch kernel runs, none is noted
        return kmeans_gram_iterations(g, w, start, iters)
    if kernels.kmeans == "torch":
        note_dispatch("kmeans", "torch", x.shape[1])
        return kmeans_gram_iterations(g, w, start, iters)
    return _kmeans_gram_op(g, w, start, iters, kernels.native != "torch")



def kmeans_gram_iterations(gram: Tensor, w: Tensor | None, start: Tensor, iters: int) -> Tensor:
    """The Gram-form iterations in torch ops: gram (B, N, N), w (B, N) or None, start (B, K) -> (B, N)."""
    b, n, _ = gram.shape
    k = start.shape[1]

    def nearest(proj: Tensor, coef: Tensor) -> Tensor:  # proj = coef G, (B, K, N) -> (B, N)
        centre_sq = (proj * coef).sum(-1, keepdim=True)  # (B, K, 1)
        return centre_sq.sub(proj, alpha=2.0).argmin(1)  # ||c||^2 - 2 c . x_i; ties to the lowest centre

    coef = one_hot(start, n, gram.dtype).transpose(1, 2)  # (B, K, N): centre k is token start[k]
    assign = nearest(gram.gather(1, start.unsqueeze(-1).expand(b, k, n)), coef)
    for _ in range(iters - 1):
        member = one_hot(assign, k, gram.dtype)  # (B, K, N)
        if w is not None:
            member = member * w.unsqueeze(1)
        total = member.sum(-1, keepdim=True)  # (B, K, 1)
        coef = torch.where(total > 0, member / total, coef)  # an empty cluster keeps its centre
        assign = nearest(torch.bmm(coef, gram), coef)
    return assign


@torch.library.custom_op("tokenpool::kmeans_gram", mutates_args=())
def _kmeans_gram_op(gram: Tensor, w: Tensor | None, start: Tensor, iters: int, use_native: bool = True) -> Tensor:
    """K-Means' Gram-form iterations (``_kmeans_gram``) as one opaque op: one Triton kernel on CUDA, native
    code on the CPU (``use_native``: the config's ``kernels.native``), the torch iterations on any other device.
    Each device's kernel notes the path it took (``runtime.note_dispatch``)."""
    note_dispatch("kmeans", "torch", gram.shape[1])
    return kmeans_gram_iterations(gram, w, start, iters)


@_kmeans_gram_op.register_kernel("cuda")
def _kmeans_gram_cuda(gram: Tensor, w: Tensor | None, start: Tensor, iters: int, use_native: bool = True) -> Tensor:
    if kmeans_fused_triton is None or gram.dtype != torch.float32:  # the kernel sums in float32
        note_dispatch("kmeans", "torch", gram.shape[1])
        return kmeans_gram_iterations(gram, w, start, iters)
    note_dispatch("kmeans", "triton-fused", gram.shape[1])
    return kmeans_fused_triton(gram, w, start, iters)


@_kmeans_gram_op.register_kernel("cpu")
def _kmeans_gram_cpu(gram: Tensor, w: Tensor | None, start: Tensor, iters: int, use_native: bool = True) -> Tensor:
    lib = native.for_tensor(gram, use_native)
    note_dispatch("kmeans", "torch" if lib is None else "native-c", gram.shape[1])
    if lib is None:
        return kmeans_gram_iterations(gram, w, start, iters)
    return native.kmeans_gram(lib, gram, w, start, iters)


@_kmeans_gram_op.register_fake
def _kmeans_gram_fake(gram: Tensor, w: Tensor | None, start: Tensor, iters: int, use_native: bool = True) -> Tensor:
    return start.new_empty(gram.shape[0], gram.shape[1])


def _kmedoids(x: Tensor, w: Tensor | None, medoids: Tensor, iters: int, kernels: KernelChoice = DEFAULT_KERNELS
              ) -> tuple[Tensor, Tensor]:
    """Voronoi iterations on the token distance matrix, in the implementation ``kernels`` picks.

    x (B, N, D), w (B, N) or None (uniform), medoids (B, K) token indices
    -> (medoids (B, K), last assignment (B, N)).

    With d the (B, N, N) distances, the cost of token i as the medoid of cluster c is
    ``sum_{i' in c} w_i' d(i', i)``. The iterations are one custom op on the tokens, ``tokenpool::kmedoids``: on
    CUDA the Gram matrix and one Triton kernel that derives the distances as it reads them (``kmedoids_fused_triton``;
    ``kernels.kmedoids: tiled``: two launches an iteration), native code on the CPU (``native.kmedoids``, one call
    for all of them, which takes the starting medoids' columns of the distances from a matmul of half the Gram
    matrix's size at K = N / 2 and computes the few others it reads, unless ``kernels.native`` is ``torch``), and the
    torch iterations (``kmedoids_dense`` on ``sq_dists``) where neither is at hand or ``kernels.kmedoids`` is
    ``torch``.
    """
    if exporting():
        return kmedoids_dense(sq_dists(x), w, medoids, iters)
    g = None if x.device.type == "cpu" else gram(x)  # see _kmedoids_op
    return _kmedoids_op(x, g, w, medoids, iters, kernels.kmedoids, kernels.native != "torch")


def _reach(d: Tensor) -> Tensor:
    """d with -inf on the diagonal: in the assignment a medoid always joins its own cluster, even when a
    duplicate token ties with it."""
    own = torch.eye(d.shape[-1], dtype=torch.bool, device=d.device)
    return d.masked_fill(own, -torch.inf)  # not an in-place fill of the diagonal, which torch.export cannot trace


def kmedoids_dense(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int) -> tuple[Tensor, Tensor]:
    """The iterations in dense torch ops: the (B, N, K) costs are one batched matmul of the
    column-weighted d against the one-hot membership, ``log(one-hot)`` putting +inf off the members.
    What runs without the Triton or the native kernel (the op's default), and the reference that
    ``bench kernels`` times them against."""
    b, n, _ = d.shape
    k = medoids.shape[1]
    reach = _reach(d)
    rows = d if w is None else d * w.unsqueeze(1)
    med = medoids.unsqueeze(1)  # (B, 1, K)
    assign = reach.gather(2, med.expand(b, n, k)).argmin(-1)  # (B, N)
    for _ in range(iters - 1):
        member = torch.zeros(b, n, k, device=d.device, dtype=d.dtype).scatter_(2, assign.unsqueeze(-1), 1.0)
        med = _swap(torch.baddbmm(member.log(), rows, member, beta=-1.0), med)
        assign = reach.gather(2, med.expand(b, n, k)).argmin(-1)
    return med.squeeze(1), assign


def _swap(cost: Tensor, med: Tensor) -> Tensor:
    """Each cluster's cheapest member from costs (B, N, K) (+inf off the members), taken where it beats
    the current medoid (B, 1, K) by the relative margin; ties to the lowest index. -> (B, 1, K)."""
    best_cost, best = cost.min(1, keepdim=True)
    current = cost.gather(1, med)  # the current medoid is a member of its cluster
    return torch.where(best_cost < current * (1.0 - SWAP_RTOL), best, med)


@torch.library.custom_op("tokenpool::kmedoids", mutates_args=())
def _kmedoids_op(x: Tensor, g: Tensor | None, w: Tensor | None, medoids: Tensor, iters: int, kernel: str = "auto",
                 use_native: bool = True) -> tuple[Tensor, Tensor]:
    """K-Medoids iterations on the tokens x (B, N, D): one opaque op for ``torch.compile``, which launches one
    kernel on CUDA. g: the Gram matrices (B, N, N) (``gram``), computed outside the op where the device's kernel reads
    them (CUDA's), or None: the CPU's native kernel takes a matmul of the starting medoids' columns alone, and the
    torch iterations compute them. ``kernel`` is the config's ``kernels.kmedoids``, ``use_native`` its
    ``kernels.native`` (not ``torch``). Each device's kernel notes the path it took (``runtime.note_dispatch``)."""
    note_dispatch("kmedoids", "torch", x.shape[1])
    return _kmedoids_dense_owned(dists_from_gram(_gram_of(x, g)), w, medoids, iters)


def _gram_of(x: Tensor, g: Tensor | None) -> Tensor:
    return gram(x) if g is None else g


@_kmedoids_op.register_kernel("cuda")
def _kmedoids_cuda(x: Tensor, g: Tensor | None, w: Tensor | None, medoids: Tensor, iters: int, kernel: str = "auto",
                   use_native: bool = True) -> tuple[Tensor, Tensor]:
    """Triton on CUDA: ``kmedoids_fused_triton`` (one program an image for every iteration, reading the Gram
    matrix: one launch), or with ``kernel="tiled"`` the distances and ``kmedoids_triton`` (two launches an
    iteration over (B, tiles) grids, the kernel behind the last GPU figures, kept so that
    ``jobs/gpu/checks.sh`` can time the two against each other); ``"torch"``: the dense torch iterations."""
    g = _gram_of(x, g)
    if kmedoids_triton is None or g.dtype != torch.float32 or kernel == "torch":  # the kernels sum in float32
        note_dispatch("kmedoids", "torch", g.shape[1])
        return _kmedoids_dense_owned(dists_from_gram(g), w, medoids, iters)
    if kernel == "tiled":
        note_dispatch("kmedoids", "triton-tiled", g.shape[1])
        return kmedoids_triton(dists_from_gram(g), w, medoids, iters, SWAP_RTOL)
    note_dispatch("kmedoids", "triton-fused", g.shape[1])
    return kmedoids_fused_triton(g, w, medoids, iters, SWAP_RTOL, gram=True)


@_kmedoids_op.register_kernel("cpu")
def _kmedoids_cpu(x: Tensor, g: Tensor | None, w: Tensor | None, medoids: Tensor, iters: int, kernel: str = "auto",
                  use_native: bool = True) -> tuple[Tensor, Tensor]:
    lib = native.for_tensor(x, use_native and kernel != "torch")
    note_dispatch("kmedoids", "torch" if lib is None else "native-c", x.shape[1])
    if lib is None:
        return _kmedoids_dense_owned(dists_from_gram(_gram_of(x, g)), w, medoids, iters)
    return native.kmedoids(lib, x, w, medoids, iters, SWAP_RTOL)  # the distances it reads, an image at a time


def _kmedoids_dense_owned(d: Tensor, w: Tensor | None, medoids: Tensor, iters: int) -> tuple[Tensor, Tensor]:
    """``kmedoids_dense`` with medoids the op owns: with iters=1 they are a view of the input, which a
    custom op may not return."""
    med, assign = kmedoids_dense(d, w, medoids, iters)
    return med.clone(), assign


@_kmedoids_op.register_fake
def _kmedoids_fake(x: Tensor, g: Tensor | None, w: Tensor | None, medoids: Tensor, iters: int, kernel: str = "auto",
                   use_native: bool = True) -> tuple[Tensor, Tensor]:
    b, n, _ = x.shape
    return medoids.new_empty(b, medoids.shape[1]), medoids.new_empty(b, n)


def _check_options(method: str, init: str, iters: object, init_scores: Tensor | None) -> None:
    if method not in CLUSTER_METHODS:
        raise InputError(f"method must be one of {CLUSTER_METHODS}, got {method!r}")
    if init not in INITS:
        raise InputError(f"init must be one of {INITS}, got {init!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise InputError(f"iters must be a positive integer, got {iters!r}")
    if init == "topk" and init_scores is None:
        raise InputError(
            "init='topk' needs init_scores or weights (for example the significance scores of eq. 4); "
            "pass one of them, or use init='random'"
        )


def token_pool(
    tokens: Tensor,
    k: int,
    *,
    method: str = "kmedoids",
    weights: Tensor | None = None,
    init: str = "topk",
    init_scores: Tensor | None = None,
    iters: int = 5,
    sizes: Tensor | None = None,
    generator: torch.Generator | None = None,
    metric: Tensor | None = None,
    validate: bool = True,
    kernels: KernelChoice | None = None,
) -> PoolResult:
    """Downsamples (B, N, M) tokens to (B, K, M) cluster means (Token Pooling, Algorithm 1).

    Args:
        tokens: (B, N, M) non-prefix tokens; prefix tokens (CLS, ...) are the caller's to keep.
        k: target number of tokens K. ``k >= N`` returns the input unchanged.
        method: ``"kmeans"`` or ``"kmedoids"``.
        weights: (B, N) non-negative token weights; makes the method WK-Means / WK-Medoids.
        init: ``"topk"`` (the K highest ``init_scores``) or ``"random"`` (uses ``generator``).
        init_scores: (B, N) scores for ``"topk"``; default ``weights``.
        iters: rounds of assignment and centre update (Algorithm 1's loop), at least 1.
        sizes: (B, N) carried cluster sizes (Appendix E); they weight the means and add up.
        generator: random source for ``init="random"``.
        metric: (B, N, D) features to cluster on instead of ``tokens`` (for example the attention
            keys averaged over heads); the output still averages ``tokens``.
        validate: check values (NaN, inf, negative weights) at a cost of one host sync.
        kernels: the implementation of each fused step (the config's ``kernels`` section); default ``auto``.

    Returns:
        PoolResult with tokens (B, K, M), sizes (B, K), assign (B, N).
    """
    check_tokens(tokens, finite=validate)
    k = check_k(k)
    if init_scores is None:
        init_scores = weights
    _check_options(method, init, iters, init_scores)
    check_per_token(weights, tokens, name="weights", nonnegative=True, values=validate)
    check_per_token(init_scores, tokens, name="init_scores", values=validate)
    check_per_token(sizes, tokens, name="sizes", nonnegative=True, values=validate)
    check_metric(metric, tokens, finite=validate)
    b, n, _ = tokens.shape
    if k >= n:
        return identity_result(tokens, sizes)

    dtype = work_dtype(tokens)  # distances in float32 even for bf16 / fp16 tokens
    x = tokens.to(dtype)
    space = x if metric is None else metric.to(dtype)
    w = effective_weights(tokens, weights, sizes)
    start = initial_indices(k, init=init, init_scores=init_scores, tokens=tokens, generator=generator)
    kernels = kernels or DEFAULT_KERNELS
    with torch.no_grad():  # the assignments are constants; gradients flow through the means below
        if method == "kmeans":
            assign = _kmeans(space, w, start, iters, kernels=kernels)
        else:
            medoids, assign = _kmedoids(space, w, start, iters, kernels)
    # No K-Medoids cluster is empty; an empty K-Means cluster outputs the token its centre started from.
    in_sizes = None if sizes is None else sizes.to(dtype)
    pooled, out_sizes = pool_segments(x, w, in_sizes, assign, k, start if method == "kmeans" else None,
                                      kernels.merge, kernels.native != "torch")
    index = medoids if method == "kmedoids" else None
    return PoolResult(tokens=pooled.to(tokens.dtype), sizes=out_sizes, assign=assign, index=index)

