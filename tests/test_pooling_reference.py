"""The operators against the brute-force references in tests/reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.pooling import GridConvDownsample, select_importance, select_topk, significance, token_pool, tome_merge
from tests import reference as ref

SHAPES = [(2, 12, 4, 3), (3, 30, 8, 7), (2, 49, 16, 12), (1, 64, 5, 20)]  # (B, N, M, K)


def traced(fn, compiled: bool):
    """``fn``, or its graph as ``torch.compile`` traces it (run eagerly): the traced code ranks by
    comparisons where the eager code sorts (pipeline/pooling/common.py)."""
    if not compiled:
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


def _inputs(b: int, n: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(b, n, m, generator=gen)
    weights = torch.rand(b, n, generator=gen) + 0.1
    return tokens, weights


def _start(scores: np.ndarray, k: int) -> list[int]:
    """Top-K initialisation: cluster j starts from the token with the j-th highest score."""
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


@pytest.mark.parametrize("b,n,m,k", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iters", [1, 2, 5])
def test_kmeans_matches_reference(b, n, m, k, weighted, iters):
    tokens, scores = _inputs(b, n, m, seed=n + k + iters)
    out = token_pool(tokens, k, method="kmeans", weights=scores if weighted else None, init_scores=scores,
                     iters=iters)
    for s in range(b):
        f = tokens[s].double().numpy()
        w = scores[s].double().numpy() if weighted else np.ones(n)
        assign = ref.kmeans(f, w, _start(scores[s].numpy(), k), iters)
        assert out.assign[s].tolist() == assign
        means = ref.cluster_means(f, w, assign, k)
        for j, mean in enumerate(means):
            if mean is not None:
                np.testing.assert_allclose(out.tokens[s, j].numpy(), mean, rtol=1e-4, atol=1e-5)
        obj_ours = ref.weighted_objective(f, w, [t for t in out.tokens[s].double().numpy()], out.assign[s].tolist())
        obj_ref = ref.weighted_objective(f, w, [mu if mu is not None else f[0] for mu in means], assign)
        assert obj_ours == pytest.approx(obj_ref, rel=1e-5)


@pytest.mark.parametrize("b,n,m,k", [*SHAPES, (2, 20, 16, 6), (1, 40, 32, 15), (2, 24, 64, 23)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("gram,dense", [(False, None), (True, None), (True, True)],
                         ids=["features", "gram, cpu path", "gram, cuda path"])
def test_both_forms_of_the_kmeans_iterations_match_reference(b, n, m, k, weighted, gram, dense):
    """The Gram form (centres as coefficients over the tokens, what a ViT's N <= 2D takes) and the
    feature form (explicit centres) each give the reference's assignments; the Gram form on both paths
    (the CPU's op, the CUDA path's torch iterations)."""
    from pipeline.pooling.clustering import _kmeans
    from pipeline.pooling.common import dense_segments

    tokens, scores = _inputs(b, n, m, seed=3 * n + k)
    w = scores / scores.amax(-1, keepdim=True) if weighted else None
    with dense_segments(dense):
        assign = _kmeans(tokens, w, scores.topk(k, dim=-1).indices, 5, gram=gram)
    for s in range(b):
        ws = scores[s].double().numpy() if weighted else np.ones(n)
        assert assign[s].tolist() == ref.kmeans(tokens[s].double().numpy(), ws, _start(scores[s].numpy(), k), 5)


@pytest.mark.parametrize("b,n,m,k", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iters", [1, 3, 5])
def test_kmedoids_matches_reference(b, n, m, k, weighted, iters):
    tokens, scores = _inputs(b, n, m, seed=2 * n + k + iters)
    out = token_pool(tokens, k, method="kmedoids", weights=scores if weighted else None, init_scores=scores,
                     iters=iters)
    for s in range(b):
        f = tokens[s].double().numpy()
        w = scores[s].double().numpy() if weighted else np.ones(n)
        medoids, assign = ref.kmedoids(f, w, _start(scores[s].numpy(), k), iters)
        assert out.index[s].tolist() == medoids
        assert out.assign[s].tolist() == assign
        for j, mean in enumerate(ref.cluster_means(f, w, assign, k)):
            expected = mean if mean is not None else f[medoids[j]]
            np.testing.assert_allclose(out.tokens[s, j].numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("iters", [1, 2, 4])
def test_kmedoids_medoid_constraint(weighted, iters):
    tokens, scores = _inputs(4, 40, 6, seed=3 + iters)
    kwargs = dict(method="kmedoids", weights=scores if weighted else None, init_scores=scores)
    before = token_pool(tokens, 9, iters=iters, **kwargs)
    after = token_pool(tokens, 9, iters=iters + 1, **kwargs)  # one more medoid update from `before`
    for s in range(4):
        f = tokens[s].double().numpy()
        w = scores[s].double().numpy() if weighted else np.ones(40)
        for j in range(9):
            members = [i for i in range(40) if before.assign[s, i] == j]
            medoid, previous = after.index[s, j].item(), before.index[s, j].item()
            # The medoid constraint: the new centre is a token of the cluster it was chosen from...
            assert medoid in members
            # ...the cheapest one under the weighted objective, unless the old medoid was within 1e-4.
            costs = {i: ref.medoid_cost(f, w, i, members) for i in members}
            best = min(costs.values())
            if medoid == previous:
                assert costs[previous] * (1 - 1e-4) <= best * (1 + 1e-9)
            else:
                assert costs[medoid] == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
@pytest.mark.parametrize("weighted", [False, True])
def test_objective_never_increases(method, weighted):
    tokens, scores = _inputs(3, 60, 8, seed=11)
    for s in range(3):
        f = tokens[s].double().numpy()
        w = scores[s].double().numpy() if weighted else np.ones(60)
        previous = np.inf
        for iters in range(1, 9):
            out = token_pool(tokens[s : s + 1], 10, method=method, weights=scores[s : s + 1] if weighted else None,
                             init_scores=scores[s : s + 1], iters=iters)
            assign = out.assign[0].tolist()
            if method == "kmeans":
                # The output tokens are the weighted means of the last assignment: the centres after
                # the last update, whose objective is what Lloyd's iterations decrease.
                centres = [t for t in out.tokens[0].double().numpy()]
            else:
                centres = [f[m] for m in out.index[0].tolist()]
            objective = ref.weighted_objective(f, w, centres, assign)
            assert objective <= previous * (1 + 1e-6), f"objective rose at iteration {iters}"
            previous = objective


def test_significance_matches_reference():
    gen = torch.Generator().manual_seed(0)
    attn = torch.rand(2, 3, 7, 7, generator=gen).softmax(-1)
    got = significance(attn)
    for s in range(2):
        np.testing.assert_allclose(got[s].numpy(), ref.significance(attn[s].double().numpy()), rtol=1e-5)
    # Each query row sums to one, so the scores of a sample sum to H * N.
    assert torch.allclose(got.sum(-1), torch.full((2,), 21.0))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_powerbert_keeps_top_scores(compiled):
    tokens, scores = _inputs(3, 20, 4, seed=5)
    out = traced(select_topk, compiled)(tokens, 6, scores=scores, validate=not compiled)
    for s in range(3):
        expected = sorted(np.argsort(-scores[s].numpy())[:6].tolist())
        assert out.index[s].tolist() == expected
        assert torch.equal(out.tokens[s], tokens[s, expected])
        dropped = [i for i in range(20) if i not in expected]
        assert all(out.assign[s, i] == -1 for i in dropped)


def test_importance_inclusion_matches_exact_probabilities():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 1.0])
    draws = 40000
    tokens = torch.arange(5.0).view(1, 5, 1).expand(draws, 5, 1)
    out = select_importance(tokens, 2, scores=p.expand(draws, 5), generator=torch.Generator().manual_seed(0))
    freq = (out.assign >= 0).double().mean(0).numpy()
    exact = ref.inclusion_probabilities(p.double().numpy(), 2)
    np.testing.assert_allclose(freq, exact, atol=0.012)
    assert np.isclose(exact.sum(), 2.0)


@pytest.mark.parametrize("n,k", [(10, 6), (11, 5), (16, 8), (17, 3), (9, 1)])
@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager: partition"),
                                      pytest.param(True, id="compiled: bipartite merge", marks=pytest.mark.compile)])
@pytest.mark.parametrize("dense", [None, True], ids=["cpu path", "cuda path"])
def test_tome_matches_reference(n, k, carry, ties, compiled, dense):
    from pipeline.pooling.common import dense_segments

    gen = torch.Generator().manual_seed(n * 31 + k)
    tokens = torch.randn(2, n, 5, generator=gen)
    metric = torch.randn(2, n, 3, generator=gen)
    if ties:  # A tokens 0, 2, 4, ... repeat in pairs: their best similarities tie exactly
        metric[:, 2::4] = metric[:, 0 : n - 2 : 4]
    sizes = torch.randint(1, 4, (2, n), generator=gen).float() if carry else None
    with dense_segments(dense):
        out = traced(tome_merge, compiled)(tokens, k, metric=metric, sizes=sizes, validate=not compiled)
    for s in range(2):
        f, m = tokens[s].double().numpy(), metric[s].double().numpy()
        sz = sizes[s].double().numpy() if carry else np.ones(n)
        mapping = list(range(n))
        count = n
        while count > k:
            r = min(count - k, (count + 1) // 2)
            f, sz, m, step = ref.tome_round(f, m, sz, r)
            mapping = [step[i] for i in mapping]
            count -= r
        assert out.assign[s].tolist() == mapping
        np.testing.assert_allclose(out.tokens[s].numpy(), f, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out.sizes[s].numpy(), sz, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_tome_merges_with_the_bipartite_groups_only_when_compiled(compiled, monkeypatch):
    """Compiled graphs take ``BipartiteMerge`` (a quarter of the one-hot product), eager code the
    ``Partition`` of all N tokens (half the ops); the reference test above checks both."""
    from pipeline.pooling import tome

    built = []
    monkeypatch.setattr(tome, "BipartiteMerge", lambda *args: built.append(1) or tome.Partition(
        args[0].assign, args[0].assign.shape[1] - args[1], dtype=args[2]))
    tokens = torch.randn(2, 16, 5, generator=torch.Generator().manual_seed(1))
    traced(tome_merge, compiled)(tokens, 6, validate=False)
    assert bool(built) == compiled


@pytest.mark.parametrize("grid", [(4, 4), (5, 5), (6, 3), (7, 7)])
def test_conv_matches_reference(grid):
    h, w = grid
    torch.manual_seed(0)
    layer = GridConvDownsample(6, grid=grid)
    tokens = torch.randn(2, h * w, 6)
    k = -(-h // 2) * -(-w // 2)
    out = layer(tokens, k)
    weight, bias = layer.conv.weight.detach().double().numpy(), layer.conv.bias.detach().double().numpy()
    for s in range(2):
        expected = ref.conv_grid(tokens[s].double().numpy(), weight, bias, h, w)
        np.testing.assert_allclose(out.tokens[s].detach().numpy(), expected, rtol=1e-4, atol=1e-5)
        for i in range(h * w):
            assert out.assign[s, i] == (i // w // 2) * -(-w // 2) + (i % w) // 2
    assert torch.equal(out.sizes.sum(-1), torch.full((2,), float(h * w)))


@pytest.mark.parametrize("traced_form", [False, True], ids=["eager: sorts", "as traced: compares"])
def test_the_ranks_orders_and_memberships_equal_a_sort_written_out(traced_form, monkeypatch):
    """The shared helpers of pipeline/pooling/common.py against plain Python: stable ranks (ties keep their index
    order), ascending distinct indices, unflagged-then-flagged positions and one-hot memberships. ``traced_form`` runs
    the branch ``torch.compile`` traces (comparisons, no sort) eagerly, by answering ``is_compiling`` with True."""
    from pipeline.pooling import common

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced_form)
    gen = torch.Generator().manual_seed(7)
    values = torch.randint(0, 4, (3, 9), generator=gen).float()  # many ties
    for descending in (False, True):
        got = common.stable_ranks(values, descending=descending).tolist()
        for row, ranks in zip(values.tolist(), got):
            order = sorted(range(len(row)), key=lambda i: (-row[i] if descending else row[i], i))
            assert ranks == [order.index(i) for i in range(len(row))]
    index = torch.stack([torch.randperm(20, generator=gen)[:6] for _ in range(3)])
    assert common.sorted_indices(index).tolist() == [sorted(row) for row in index.tolist()]
    flags = torch.rand(3, 8, generator=gen) < 0.4
    assert common.flagged_last(flags).tolist() == [[i for i, f in enumerate(row) if not f] + [i for i, f in
                                                   enumerate(row) if f] for row in flags.tolist()]
    assign = torch.randint(0, 4, (2, 7), generator=gen)
    member = common.one_hot(assign, 5, torch.float64)
    assert member.dtype == torch.float64 and member.shape == (2, 5, 7)
    assert member.tolist() == [[[1.0 if a == j else 0.0 for a in row] for j in range(5)] for row in assign.tolist()]


def test_segment_sums_means_and_the_helpers_rows_written_out():
    """``Partition`` on both paths, ``augmented`` rows with their weight columns, ``segment_means`` and
    ``gather_rows`` against sums written out per segment."""
    from pipeline.pooling import common

    gen = torch.Generator().manual_seed(3)
    b, n, d, k = 2, 7, 3, 4
    x = torch.randn(b, n, d, generator=gen, dtype=torch.float64)
    w = torch.rand(b, n, generator=gen, dtype=torch.float64) + 0.1
    assign = torch.tensor([[0, 1, 1, 3, 0, 3, 3], [2, 2, 0, 0, 1, 3, 0]])  # segment 2 of sample 0 empty: 0 / 0
    members = [[[i for i in range(n) if int(assign[s, i]) == j] for j in range(k)] for s in range(b)]
    sums = torch.tensor([[[float(sum(x[s, i, c] for i in members[s][j])) for c in range(d)] for j in range(k)]
                         for s in range(b)], dtype=torch.float64)
    totals = torch.tensor([[float(sum(w[s, i] for i in members[s][j])) for j in range(k)] for s in range(b)],
                          dtype=torch.float64)
    counts = torch.tensor([[float(len(members[s][j])) for j in range(k)] for s in range(b)], dtype=torch.float64)
    weighted = torch.tensor([[[float(sum(w[s, i] * x[s, i, c] for i in members[s][j])) for c in range(d)]
                              for j in range(k)] for s in range(b)], dtype=torch.float64)
    assert common.batch_offset(3, 4, torch.device("cpu")).tolist() == [[0], [4], [8]]
    assert common.batch_offset(2, 0, torch.device("cpu")).tolist() == [[0], [0]]  # images of no tokens
    for dense in (True, False):
        part = common.Partition(assign, k, dtype=torch.float64, dense=dense)
        assert part.dense is dense
        torch.testing.assert_close(part.sum(x), sums)
        assert part.total(None).shape == part.total(w).shape == (b, k, 1)
        torch.testing.assert_close(part.total(None).squeeze(-1), counts)
        torch.testing.assert_close(part.total(w).squeeze(-1), totals)
        means, total = part.mean(x, w)
        torch.testing.assert_close(means, weighted / totals.unsqueeze(-1), equal_nan=True)
        torch.testing.assert_close(total.squeeze(-1), totals)
        means, total = part.mean(x, None)
        torch.testing.assert_close(means, sums / counts.unsqueeze(-1), equal_nan=True)
        torch.testing.assert_close(total.squeeze(-1), counts)
        for rows_w, want, want_total in ((w, weighted, totals), (None, sums, counts)):
            rows = common.augmented(x, rows_w)
            assert rows.shape == (b, n, 8)  # d = 3 features and 5 weight columns: a multiple of 8
            means, total = common.segment_means(part, rows, d)
            torch.testing.assert_close(means, want / want_total.unsqueeze(-1), equal_nan=True)
            torch.testing.assert_close(total.squeeze(-1), want_total)
    for dense, device_says in ((None, False), (True, True), (False, False)):  # None: by device (the CPU: index_add_)
        with common.dense_segments(dense):
            assert common.use_dense(x) is device_says
            assert common.Partition(assign, k, dtype=torch.float64).dense is device_says
    assert common.augmented(torch.zeros(1, 2, 8), None).shape == (1, 2, 16)  # 8 features: 8 weight columns more
    assert common.gather_rows(x, torch.tensor([[6, 0], [2, 2]])).tolist() == [[x[0, 6].tolist(), x[0, 0].tolist()],
                                                                             [x[1, 2].tolist(), x[1, 2].tolist()]]
    assert common.work_dtype(x) == torch.float64 and common.work_dtype(x.half()) == torch.float32
    assert common.work_dtype(x.float()) == torch.float32


def test_uniform_noise_is_float32_contiguous_and_the_same_draw_with_or_without_a_generator():
    """(B, N) float32 noise in [0, 1) shaped as the per-token input it is given, contiguous even for a transposed
    one, the same numbers from the global generator (``rand_like``, which compiles) as from a generator in the same
    state (``rand``)."""
    from pipeline.pooling.common import uniform_noise

    like = torch.zeros(6, 3, dtype=torch.float64).t()  # (3, 6), not contiguous
    torch.manual_seed(11)
    drawn = uniform_noise(like, None)
    again = uniform_noise(like, torch.Generator().manual_seed(11))
    for noise in (drawn, again):
        assert noise.shape == (3, 6) and noise.dtype == torch.float32 and noise.is_contiguous()
        assert bool(((noise >= 0) & (noise < 1)).all())
    assert torch.equal(drawn, again)
    assert torch.equal(drawn, torch.rand(3, 6, generator=torch.Generator().manual_seed(11)))
