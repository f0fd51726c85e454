"""The merge op's gradients (``tokenpool::cluster_means``, the CUDA path's merge): its closed-form backward
against finite differences, and against autograd through the CPU path's ``index_add_`` sums."""

from __future__ import annotations

import pytest
import torch

from pipeline.pooling.common import dense_segments
from pipeline.pooling.merge import cluster_means, pool_segments


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


def test_the_cuda_path_has_the_cpu_paths_gradients():
    """pool_segments on the CUDA path (the op) and on the CPU path (index_add_ sums, autograd's own
    backward): the same means and the same gradients for the tokens and the weights."""
    x, w, assign, start = _inputs(3, 30, 16, 7, seed=2, dtype=torch.float32)
    target = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for dense in (True, False):
        xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
        with dense_segments(dense):
            means, sizes = pool_segments(xd, wd, None, assign, 7, start)
        (means * target).sum().backward()
        results.append((means.detach(), xd.grad, wd.grad, sizes()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (results[0][3][:, -1] == 0).all() and results[0][1].abs().sum() > 0  # an empty cluster, real gradients


def test_pool_segments_means_and_summed_sizes_written_out_on_both_paths():
    """Weighted means and carried sizes of each segment, written out per segment, on the CPU path (by device, with
    no override) and on the CUDA path; a segment whose members weigh under one in all is their mean like any other,
    and only an empty one takes its start token. Each path notes what ran (``runtime.dispatched``)."""
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
    for dense in (None, True):  # None: the path of the device (the CPU: index_add_ sums)
        forget_dispatches()
        with dense_segments(dense):
            means, summed = pool_segments(x, w, sizes, assign, 4, start)
            counted = pool_segments(x, w, None, assign, 4, start)[1]
        torch.testing.assert_close(means, want_means)
        assert summed().shape == (2, 4) and summed().dtype == torch.float32
        assert summed().tolist() == want_sizes and counted().tolist() == want_counts
        assert dispatched() == {("merge", "torch", 6)}
