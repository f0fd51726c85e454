"""The merge op's gradients (``tokenpool::cluster_means``): its closed-form backward against finite differences,
and against autograd through the torch ops it stands for (``index_add_`` sums, the one-hot product)."""

from __future__ import annotations

import pytest
import torch

from pipeline.pooling.merge import cluster_means, means_dense, means_partition, pool_segments


def _inputs(b: int, n: int, m: int, k: int, seed: int, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, m, generator=g, dtype=dtype)
    w = torch.rand(b, n, generator=g, dtype=dtype) + 0.1
    assign = torch.randint(0, k - 1, (b, n), generator=g)  # cluster k - 1 empty
    start = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b)])
    return x, w, assign, start


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("with_start", [True, False])
def test_the_backward_matches_finite_differences(weighted, with_start):
    x, w, assign, start = _inputs(2, 9, 5, 4, seed=1)
    x.requires_grad_()
    w = w.requires_grad_() if weighted else None
    if with_start:
        inputs = (x, w, assign, 4, start)
    else:  # without a start an empty cluster is 0 / 0: only the filled ones have a gradient to check
        inputs = (x, w, assign, 3, None)
    assert torch.autograd.gradcheck(cluster_means, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("reference,k", [(means_partition, 7), (means_dense, 6)])
def test_the_op_has_autograds_gradients_through_the_torch_ops(reference, k):
    """pool_segments (the op: the CPU's native means, the closed-form backward) against autograd through the torch
    ops it stands for, outside the op (index_add_ sums, the CPU's torch path, with cluster 6 empty; the one-hot
    product, the CUDA path's reference, whose autograd an empty cluster's 0 / 0 would turn to NaN: no cluster
    empty): the same means and the same gradients for the tokens and the weights."""
    x, w, assign, start = _inputs(3, 30, 16, 7, seed=2, dtype=torch.float32)
    start = start[:, :k]
    if k == 6:
        assign[:, :6] = torch.arange(6)  # every cluster has a member
    target = torch.randn(3, k, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for means_of in (lambda xd, wd: pool_segments(xd, wd, None, assign, k, start)[0],
                     lambda xd, wd: reference(xd, wd, assign, k, start)):
        xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
        means = means_of(xd, wd)
        (means * target).sum().backward()
        results.append((means.detach(), xd.grad, wd.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    sizes = pool_segments(x, w, None, assign, k, start)[1]()
    assert ((sizes == 0).any(-1) == (k == 7)).all() and results[0][1].abs().sum() > 0  # empty or not, real gradients


def test_pool_segments_means_and_summed_sizes_written_out_on_every_path():
    """Weighted means and carried sizes of each segment, written out per segment: the op on the CPU (its native code,
    or with ``kernels.merge: torch`` or ``kernels.native: torch`` the index_add_ sums) and the torch paths it stands
    for (the one-hot product: the CUDA path's reference); a segment whose members weigh under one in all is their
    mean like any other, and only an empty one takes its start token. Each path notes what ran
    (``runtime.dispatched``)."""
    from pipeline.runtime import dispatched, forget_dispatches

    x = torch.arange(2 * 6 * 3, dtype=torch.float64).reshape(2, 6, 3)
    w = torch.tensor([[0.5, 0.25, 2.0, 1.0, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    sizes = torch.tensor([[1.0, 2.0, 3.0, 1.0, 1.0, 4.0], [2.0, 2.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    assign = torch.tensor([[0, 0, 1, 1, 1, 3], [2, 2, 2, 0, 0, 0]])  # sample 0: segment 2 empty; 1: segment 1 and 3
    start = torch.tensor([[0, 2, 4, 5], [3, 1, 0, 5]])
    members = [[[i for i in range(6) if int(assign[s, i]) == j] for j in range(4)] for s in range(2)]

    def mean(s: int, j: int) -> list[float]:
        if not members[s][j]:
            return x[s, int(start[s, j])].tolist()
        total = sum(float(w[s, i]) for i in members[s][j])
        return [sum(float(w[s, i] * x[s, i, c]) for i in members[s][j]) / total for c in range(3)]

    want_means = torch.tensor([[mean(s, j) for j in range(4)] for s in range(2)], dtype=torch.float64)
    want_sizes = [[sum(float(sizes[s, i]) for i in members[s][j]) for j in range(4)] for s in range(2)]
    want_counts = [[float(len(members[s][j])) for j in range(4)] for s in range(2)]
    assert float(w[0, 0] + w[0, 1]) < 1  # segment 0 of sample 0 weighs 0.75: still a mean, not its start token
    for kernel, use_native, ran in [("auto", True, "native-c"), ("torch", True, "torch"), ("auto", False, "torch")]:
        forget_dispatches()  # the CPU: its native code, or index_add_ sums
        means, summed = pool_segments(x, w, sizes, assign, 4, start, kernel, use_native)
        counted = pool_segments(x, w, None, assign, 4, start, kernel, use_native)[1]
        torch.testing.assert_close(means, want_means)
        assert summed().shape == (2, 4) and summed().dtype == torch.float32
        assert summed().tolist() == want_sizes and counted().tolist() == want_counts
        assert dispatched() == {("merge", ran, 6)}
    # the torch paths the op's kernels stand for, called as the CUDA path's reference and the CPU's fallback
    torch.testing.assert_close(means_dense(x, w, assign, 4, start), want_means)
    full = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 0, 0]])  # no segment empty: no start needed
    members = [[[i for i in range(6) if int(full[s, i]) == j] for j in range(4)] for s in range(2)]
    for weights in (w, None):
        want = torch.tensor([[[sum(float((1 if weights is None else w[s, i]) * x[s, i, c]) for i in members[s][j])
                               / sum(float(1 if weights is None else w[s, i]) for i in members[s][j])
                               for c in range(3)] for j in range(4)] for s in range(2)], dtype=torch.float64)
        for means_of in (means_dense, means_partition):
            torch.testing.assert_close(means_of(x, weights, full, 4, None), want)
        torch.testing.assert_close(pool_segments(x, weights, None, full, 4, None, "torch")[0], want)
