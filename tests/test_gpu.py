"""CUDA paths: the same operators on the GPU agree with the CPU. Skipped where no CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from pipeline.pooling import build_downsampler, token_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clustering_matches_cpu(method, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(8, 196, 64, generator=gen).to(dtype)
    scores = torch.rand(8, 196, generator=gen)
    cpu = token_pool(tokens, 49, method=method, weights=scores)
    gpu = token_pool(tokens.cuda(), 49, method=method, weights=scores.cuda())
    # Float32 distances on both devices: the assignments agree up to rare near-ties.
    assert (gpu.assign.cpu() == cpu.assign).float().mean() > 0.99
    assert gpu.tokens.dtype == dtype


@pytest.mark.parametrize("name", ["powerbert", "random", "importance", "tome", "wkmedoids"])
def test_deterministic_on_gpu(name):
    tokens = torch.randn(4, 196, 32, device="cuda")
    scores = torch.rand(4, 196, device="cuda")
    step = build_downsampler(name)
    runs = [step(tokens, 49, scores=scores, metric=tokens, generator=torch.Generator("cuda").manual_seed(1))
            for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert torch.equal(runs[0].assign, runs[1].assign)
