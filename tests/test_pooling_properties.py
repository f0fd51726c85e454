"""Properties every downsampling method must have, checked on generated inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.methods import METHODS, build_downsampler
from pipeline.pooling import pooled_count, token_pool, tome_merge
from pipeline.pooling.common import Partition

SETTINGS = settings(max_examples=25, deadline=None)
CLUSTERING = ["kmeans", "kmedoids", "wkmeans", "wkmedoids"]
MERGING = CLUSTERING + ["tome"]
SELECTION = ["powerbert", "random", "importance"]


def _batch(seed: int, b: int, n: int, m: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(b, n, m, generator=gen)
    scores = torch.rand(b, n, generator=gen) + 0.01
    metric = torch.randn(b, n, 3, generator=gen)
    return tokens, scores, metric


def _run(name: str, tokens, k, scores, metric, sizes=None, seed=0):
    step = build_downsampler(name, dim=tokens.shape[-1])
    return step(tokens, k, scores=scores, metric=metric, sizes=sizes, generator=torch.Generator().manual_seed(seed))


shapes = st.tuples(st.integers(1, 3), st.integers(2, 40), st.integers(1, 12), st.integers(0, 10_000))


@SETTINGS
@given(shapes, st.sampled_from(sorted(set(METHODS) - {"conv", "none"})), st.data())
def test_shapes_and_sizes(shape, name, data):
    b, n, m, seed = shape
    k = data.draw(st.integers(1, n - 1))
    tokens, scores, metric = _batch(seed, b, n, m)
    out = _run(name, tokens, k, scores, metric)
    assert out.tokens.shape == (b, k, m)
    assert out.sizes.shape == (b, k)
    assert out.assign.shape == (b, n)
    assert torch.isfinite(out.tokens).all()
    kept = out.assign >= 0
    assert (out.assign[kept] < k).all()
    if name in MERGING:
        assert kept.all(), "a merging method assigns every token"
        assert torch.allclose(out.sizes.sum(-1), torch.full((b,), float(n)))
    else:
        assert (kept.sum(-1) == k).all(), "a selection method keeps exactly k tokens"
        assert torch.equal(out.sizes, torch.ones(b, k))


@SETTINGS
@given(shapes, st.sampled_from(MERGING))
def test_carried_sizes_add_up(shape, name):
    b, n, m, seed = shape
    tokens, scores, metric = _batch(seed, b, n, m)
    sizes = torch.randint(0, 5, (b, n), generator=torch.Generator().manual_seed(seed)).float()
    out = _run(name, tokens, max(1, n // 3), scores, metric, sizes=sizes)
    assert torch.allclose(out.sizes.sum(-1), sizes.sum(-1))
    # Each output's size is the sum of its members' sizes.
    for s in range(b):
        for j in range(out.sizes.shape[1]):
            assert out.sizes[s, j] == pytest.approx(float(sizes[s][out.assign[s] == j].sum()))


@SETTINGS
@given(shapes, st.sampled_from(sorted(METHODS)))
def test_k_at_least_n_is_identity(shape, name):
    b, n, m, seed = shape
    tokens, scores, metric = _batch(seed, b, n, m)
    for k in (n, n + 3):
        out = _run(name, tokens, k, scores, metric)
        assert out.tokens is tokens
        assert torch.equal(out.assign, torch.arange(n).expand(b, n))
        assert torch.equal(out.sizes, torch.ones(b, n))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_k_at_least_n_carries_the_sizes_and_points_at_every_token(name):
    """A step that keeps every token passes the carried sizes on (as float32) and points each output at its own
    input token (``index``): the sizes of a model that carries them survive a block that does not pool."""
    tokens, scores, metric = _batch(3, 2, 5, 4)
    sizes = torch.tensor([[1, 2, 3, 1, 4], [2, 2, 1, 1, 5]], dtype=torch.float64)
    for k in (5, 8):
        out = _run(name, tokens, k, scores, metric, sizes=sizes)
        assert out.tokens is tokens and out.sizes.dtype == torch.float32
        assert out.sizes.tolist() == [[1.0, 2.0, 3.0, 1.0, 4.0], [2.0, 2.0, 1.0, 1.0, 5.0]]
        assert out.index.tolist() == [[0, 1, 2, 3, 4]] * 2 and out.assign.tolist() == [[0, 1, 2, 3, 4]] * 2


@SETTINGS
@given(shapes, st.sampled_from(MERGING))
def test_outputs_are_convex_combinations_of_their_members(shape, name):
    b, n, m, seed = shape
    tokens, scores, metric = _batch(seed, b, n, m)
    out = _run(name, tokens, max(1, n // 2), scores, metric)
    for s in range(b):
        for j in range(out.tokens.shape[1]):
            members = tokens[s][out.assign[s] == j]
            if len(members) == 0:
                continue
            # A convex combination lies inside the members' bounding box...
            assert (out.tokens[s, j] >= members.min(0).values - 1e-5).all()
            assert (out.tokens[s, j] <= members.max(0).values + 1e-5).all()
            # ...and is reproduced by non-negative coefficients summing to one (least squares).
            system = torch.cat([members.T.double(), torch.ones(1, len(members), dtype=torch.double)])
            target = torch.cat([out.tokens[s, j].double(), torch.ones(1, dtype=torch.double)])
            coef = torch.linalg.lstsq(system, target.unsqueeze(-1)).solution.squeeze(-1)
            residual = (system @ coef - target).abs().max()
            if len(members) <= m:  # an exactly determined or over-determined system has one solution
                assert residual < 1e-4
                assert (coef > -1e-4).all()


@pytest.mark.parametrize("name", ["kmeans", "kmedoids", "random", "importance"])
def test_same_seed_same_result(name):
    tokens, scores, metric = _batch(0, 4, 50, 8)
    options = {"init": "random"} if name in ("kmeans", "kmedoids") else {}
    step = build_downsampler(name, **options)
    first = step(tokens, 12, scores=scores, generator=torch.Generator().manual_seed(7))
    second = step(tokens, 12, scores=scores, generator=torch.Generator().manual_seed(7))
    other = step(tokens, 12, scores=scores, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first.assign, second.assign)
    assert torch.equal(first.tokens, second.tokens)
    assert not torch.equal(first.assign, other.assign), "a different seed should give a different draw"


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_clusters_in_float32(method, dtype):
    tokens, scores, _ = _batch(1, 3, 60, 16)
    low = tokens.to(dtype)
    out = token_pool(low, 15, method=method, weights=scores)
    # The same values, upcast: float32 distances must give the very same assignment.
    reference = token_pool(low.float(), 15, method=method, weights=scores)
    assert out.tokens.dtype == dtype
    assert torch.equal(out.assign, reference.assign)
    torch.testing.assert_close(out.tokens.float(), reference.tokens, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
def test_gradient_check(method):
    tokens, scores, _ = _batch(2, 2, 10, 3)
    tokens = tokens.double().requires_grad_()
    weights = scores.double().requires_grad_()
    assign = token_pool(tokens.detach(), 4, method=method, weights=weights.detach()).assign

    def pooled(x, w):
        out = token_pool(x, 4, method=method, weights=w)
        assert torch.equal(out.assign, assign), "a gradient step must not move the assignment"
        return out.tokens

    assert torch.autograd.gradcheck(pooled, (tokens, weights), eps=1e-6, atol=1e-5)


def test_tome_gradient_check():
    tokens, _, metric = _batch(3, 2, 9, 3)
    tokens = tokens.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: tome_merge(x, 4, metric=metric).tokens, (tokens,), eps=1e-6, atol=1e-5)


def test_gradients_reach_only_members():
    tokens, scores, _ = _batch(4, 1, 20, 4)
    tokens.requires_grad_()
    out = token_pool(tokens, 5, method="kmeans", weights=scores)
    out.tokens[0, 0].sum().backward()
    touched = tokens.grad[0].abs().sum(-1) > 0
    assert torch.equal(touched, out.assign[0] == 0)


def test_empty_clusters_are_deterministic_and_finite():
    # Duplicate tokens with equal top scores start two clusters on the same point.
    tokens = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, 5.0], [5.1, 5.0], [9.0, 9.0]]])
    scores = torch.tensor([[1.0, 1.0, 0.5, 0.4, 0.3]])
    for method in ("kmeans", "kmedoids"):
        out = token_pool(tokens, 3, method=method, init_scores=scores)
        again = token_pool(tokens, 3, method=method, init_scores=scores)
        assert torch.isfinite(out.tokens).all()
        assert torch.equal(out.tokens, again.tokens)
        assert out.sizes.sum() == 5
    kmeans = token_pool(tokens, 3, method="kmeans", init_scores=scores)
    assert kmeans.sizes.tolist() == [[2.0, 0.0, 3.0]], "the second copy of the duplicate centre stays empty"
    assert torch.equal(kmeans.tokens[0, 1], tokens[0, 1]), "an empty cluster outputs the token it started from"
    kmedoids = token_pool(tokens, 3, method="kmedoids", init_scores=scores)
    assert kmedoids.sizes.tolist() == [[1.0, 1.0, 3.0]], "each duplicate medoid keeps itself"


def test_an_empty_kmeans_cluster_keeps_its_centre_in_both_forms():
    """Two clusters start on duplicate tokens, so the second is empty after the first assignment (ties go
    to the lowest centre) and keeps its centre, (1, 1), while the first moves towards token 5: the
    duplicates then join the kept centre. Off the origin, so that a kept centre's Gram-form projections and
    norm are not zero. The same in the Gram form as in the feature form."""
    from pipeline.pooling.clustering import _kmeans

    tokens = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, 5.0], [5.1, 5.0], [9.0, 9.0], [0.2, 0.1]]]) + 1.0
    start = torch.tensor([[0, 1, 2]])
    for gram in (False, True):
        assert _kmeans(tokens, None, start, 5, gram=gram).tolist() == [[1, 1, 2, 2, 2, 0]], gram
        assert _kmeans(tokens, None, start, 1, gram=gram).tolist() == [[0, 0, 2, 2, 2, 0]], gram


def test_segment_sum_paths_agree():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 17, 5, generator=gen)
    assign = torch.randint(0, 6, (3, 17), generator=gen)
    dense = Partition(assign, 6, dtype=values.dtype, dense=True).sum(values)
    scattered = Partition(assign, 6, dtype=values.dtype, dense=False).sum(values)
    torch.testing.assert_close(dense, scattered)
    for s in range(3):
        for j in range(6):
            torch.testing.assert_close(dense[s, j], values[s][assign[s] == j].sum(0))


def test_cluster_on_metric_uses_the_metric():
    tokens, scores, _ = _batch(5, 2, 30, 6)
    metric = tokens[..., :2].clone()  # clustering on two of the six features only
    on_metric = build_downsampler("kmedoids", cluster_on="metric")(tokens, 8, scores=scores, metric=metric)
    direct = token_pool(tokens[..., :2].contiguous(), 8, init_scores=scores)
    assert torch.equal(on_metric.assign, direct.assign)
    assert on_metric.tokens.shape == (2, 8, 6)


def test_conv_pooled_count_and_skip():
    layer = build_downsampler("conv", dim=4)
    tokens = torch.randn(2, 196, 4)
    assert pooled_count(196) == 49
    assert layer(tokens, 49).tokens.shape == (2, 49, 4)
    assert layer(tokens, 196).tokens is tokens
    with pytest.raises(ValueError, match="k must be 49"):
        layer(tokens, 98)


@pytest.mark.parametrize("name", sorted(set(METHODS) - {"conv"}))
def test_non_contiguous_input_matches_contiguous(name):
    # Models hand over x[:, prefix:], a strided view; the result must not depend on the layout.
    full, scores, metric = _batch(6, 2, 33, 8)
    view = full[:, 1:]
    assert not view.is_contiguous()
    strided = _run(name, view, 10, scores[:, 1:], metric[:, 1:], seed=3)
    packed = _run(name, view.contiguous(), 10, scores[:, 1:].contiguous(), metric[:, 1:].contiguous(), seed=3)
    assert torch.equal(strided.assign, packed.assign)
    torch.testing.assert_close(strided.tokens, packed.tokens)


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
def test_cluster_on_metric_matches_clustering_the_metric_itself(method):
    tokens, scores, _ = _batch(7, 2, 30, 6)
    metric = tokens[..., :2].clone()
    on_metric = token_pool(tokens, 8, method=method, init_scores=scores, metric=metric)
    direct = token_pool(metric, 8, method=method, init_scores=scores)
    assert torch.equal(on_metric.assign, direct.assign)
    # The outputs average the full tokens over the clusters found on the metric.
    for j in range(8):
        members = tokens[0][on_metric.assign[0] == j]
        if len(members):
            torch.testing.assert_close(on_metric.tokens[0, j], members.mean(0))


@pytest.mark.parametrize("weighted", [False, True])
def test_kmedoids_torch_iterations_agree_with_the_native_kernel(weighted):
    # The op's torch default (one-hot matmuls: CUDA without Triton) against what the CPU runs.
    from pipeline.pooling.clustering import _kmedoids, kmedoids_dense, sq_dists

    tokens, scores, _ = _batch(8, 3, 40, 5)
    w = scores / scores.amax(-1, keepdim=True) if weighted else None
    start = scores.topk(9, dim=-1).indices
    dense = kmedoids_dense(sq_dists(tokens), w, start, 5)
    native = _kmedoids(tokens, w, start, 5)
    assert torch.equal(dense[0], native[0]) and torch.equal(dense[1], native[1])
