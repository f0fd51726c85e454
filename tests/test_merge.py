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
