"""Brute-force references for the operators: one sample at a time, plain loops, float64.

They are written from the paper's equations and the documented semantics, independently of
``pipeline.pooling``: nothing here imports the package under test.
"""

from __future__ import annotations

import math

import numpy as np


def sq(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a - b) ** 2).sum())


def nearest(f: np.ndarray, centres: list[np.ndarray]) -> list[int]:
    """Eq. 6: index of the nearest centre for every token; ties go to the lowest index."""
    out = []
    for i in range(len(f)):
        best, best_d = 0, math.inf
        for j, c in enumerate(centres):
            d = sq(f[i], c)
            if d < best_d:
                best, best_d = j, d
        out.append(best)
    return out


def weighted_objective(f: np.ndarray, w: np.ndarray, centres: list[np.ndarray], assign: list[int]) -> float:
    """sum_i w_i ||f_i - c_{a(i)}||^2 (the weighted eq. 2)."""
    return sum(w[i] * sq(f[i], centres[assign[i]]) for i in range(len(f)))


def kmeans(f: np.ndarray, w: np.ndarray, start: list[int], iters: int) -> list[int]:
    """Weighted K-Means (eq. 6 and 13) from the tokens at ``start``; returns the last assignment."""
    centres = [f[i].copy() for i in start]
    assign = nearest(f, centres)
    for _ in range(iters - 1):
        for j in range(len(centres)):
            members = [i for i in range(len(f)) if assign[i] == j]
            if members:
                total = sum(w[i] for i in members)
                centres[j] = sum(w[i] * f[i] for i in members) / total
        assign = nearest(f, centres)
    return assign


def medoid_cost(f: np.ndarray, w: np.ndarray, candidate: int, members: list[int]) -> float:
    return sum(w[i] * sq(f[candidate], f[i]) for i in members)


def kmedoids(f: np.ndarray, w: np.ndarray, start: list[int], iters: int) -> tuple[list[int], list[int]]:
    """Weighted K-Medoids (eq. 6 and 14): returns (medoids, last assignment).

    A medoid always joins its own cluster. The new medoid of a cluster is the member of least
    weighted cost (lowest index on ties), taken only when cheaper than the current one by a relative 1e-4.
    """
    medoids = list(start)

    def assign_to(meds: list[int]) -> list[int]:
        assign = nearest(f, [f[m] for m in meds])
        for j, m in enumerate(meds):  # a medoid always joins its own cluster
            assign[m] = j
        return assign

    assign = assign_to(medoids)
    for _ in range(iters - 1):
        for j in range(len(medoids)):
            members = [i for i in range(len(f)) if assign[i] == j]
            if not members:
                continue
            costs = [medoid_cost(f, w, i, members) for i in members]
            best = members[int(np.argmin(costs))]
            if medoid_cost(f, w, best, members) < medoid_cost(f, w, medoids[j], members) * (1 - 1e-4):
                medoids[j] = best
        assign = assign_to(medoids)
    return medoids, assign


def cluster_means(f: np.ndarray, w: np.ndarray, assign: list[int], k: int) -> list[np.ndarray | None]:
    """Algorithm 1's output: the weighted mean of each cluster (None where a cluster is empty)."""
    out: list[np.ndarray | None] = []
    for j in range(k):
        members = [i for i in range(len(f)) if assign[i] == j]
        out.append(sum(w[i] * f[i] for i in members) / sum(w[i] for i in members) if members else None)
    return out


def significance(attn: np.ndarray) -> np.ndarray:
    """Eq. 4 for one sample: attn (H, N, N) -> s (N,), s_j = sum_h sum_i A_h[i, j]."""
    h, n, _ = attn.shape
    s = np.zeros(n)
    for head in range(h):
        for i in range(n):
            for j in range(n):
                s[j] += attn[head, i, j]
    return s


def tome_round(f: np.ndarray, metric: np.ndarray, sizes: np.ndarray, r: int):
    """One bipartite soft matching round for one sample, written from the ToMe paper.

    Returns (tokens, sizes, metric, mapping) where mapping[i] is the output index of input i.
    """
    n = len(f)
    a_idx = list(range(0, n, 2))
    b_idx = list(range(1, n, 2))

    def cos(u: np.ndarray, v: np.ndarray) -> float:
        return float(u @ v / max(np.linalg.norm(u), 1e-12) / max(np.linalg.norm(v), 1e-12))

    edges = []  # (similarity, position in A, partner position in B)
    for pa, i in enumerate(a_idx):
        sims = [cos(metric[i], metric[j]) for j in b_idx]
        pb = int(np.argmax(sims))
        edges.append((sims[pb], pa, pb))
    # The r most similar edges; equal similarities keep A's order.
    ranked = sorted(edges, key=lambda e: -e[0])
    merged = {pa: pb for _, pa, pb in ranked[:r]}
    kept_a = [pa for pa in range(len(a_idx)) if pa not in merged]
    mapping = [0] * n
    for pos, pa in enumerate(kept_a):
        mapping[a_idx[pa]] = pos
    for pb, j in enumerate(b_idx):
        mapping[j] = len(kept_a) + pb
    for pa, pb in merged.items():
        mapping[a_idx[pa]] = len(kept_a) + pb
    k = len(kept_a) + len(b_idx)
    out_f, out_m, out_s = [], [], []
    for o in range(k):
        members = [i for i in range(n) if mapping[i] == o]
        s = np.array([sizes[i] for i in members])
        out_s.append(s.sum())
        out_f.append(sum(sizes[i] * f[i] for i in members) / s.sum())
        out_m.append(sum(sizes[i] * metric[i] for i in members) / s.sum())
    return np.array(out_f), np.array(out_s), np.array(out_m), mapping


def inclusion_probabilities(p: np.ndarray, k: int) -> np.ndarray:
    """Exact P(token i is among k sequential draws without replacement, P(draw) proportional to p)."""
    n = len(p)
    incl = np.zeros(n)

    def walk(chosen: list[int], prob: float) -> None:
        if len(chosen) == k:
            for i in chosen:
                incl[i] += prob
            return
        rest = [i for i in range(n) if i not in chosen]
        total = sum(p[i] for i in rest)
        for i in rest:
            walk(chosen + [i], prob * p[i] / total)

    walk([], 1.0)
    return incl


def conv_grid(f: np.ndarray, weight: np.ndarray, bias: np.ndarray, h: int, w: int) -> np.ndarray:
    """2x2 stride-2 convolution over an h x w token grid, zero-padded to even sides.

    f (h*w, M), weight (M_out, M, 2, 2), bias (M_out,) -> (ceil(h/2) * ceil(w/2), M_out).
    """
    m = f.shape[1]
    out = []
    for r in range(0, h, 2):
        for c in range(0, w, 2):
            acc = bias.copy()
            for dr in range(2):
                for dc in range(2):
                    rr, cc = r + dr, c + dc
                    token = f[rr * w + cc] if rr < h and cc < w else np.zeros(m)
                    acc = acc + weight[:, :, dr, dc] @ token
            out.append(acc)
    return np.array(out)


def table_cost(table: dict, keep: list[int]) -> float:
    """A keep list's cost from a cost table in its JSON form (docs/benchmarks.md, "Latency tables"): the fixed part
    plus, per block receiving n tokens and keeping k, attn(n) + mlp(k) + pool(n, k) where 0 < k < n. Each curve is
    numpy's interpolation (ends held); the pooling surface interpolates each measured n's curve at k, then in n."""
    def curve(c: dict, x: float) -> float:
        return float(np.interp(x, c["xs"], c["ys"]))

    def pool(n: float, k: float) -> float:
        surface = table["pool"]
        return float(np.interp(n, surface["ns"], [curve(c, k) for c in surface["curves"]]))

    total, n = table["fixed"], table["num_tokens"]
    for k in keep:
        total += curve(table["attn"], n) + curve(table["mlp"], k) + (pool(n, k) if 0 < k < n else 0.0)
        n = k
    return total
