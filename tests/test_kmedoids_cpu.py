"""K-Medoids' native CPU kernel (pipeline/pooling/kmedoids_cpu.c): against the brute-force reference and
the torch iterations, and its build, cache and fallback."""

from __future__ import annotations

import logging
import subprocess

import numpy as np
import pytest
import torch

from pipeline.pooling import kmedoids_cpu, token_pool
from pipeline.pooling.clustering import _SWAP_RTOL, _kmedoids_dense, _kmedoids_op, sq_dists
from tests import reference as ref

# (B, N, M, K), weighted, iterations, kind of tokens
CASES = [
    ((2, 12, 4, 3), True, 5, "random"),
    ((3, 30, 8, 7), False, 3, "random"),
    ((2, 49, 16, 12), True, 1, "random"),
    ((2, 70, 8, 40), True, 4, "random"),
    ((1, 196, 16, 147), True, 5, "random"),
    ((2, 65, 6, 64), False, 5, "random"),  # N and K not multiples of the 4 rows an assignment step takes
    ((2, 48, 3, 10), False, 5, "ties"),  # small integers, every token twice: many exact ties
    ((2, 48, 3, 30), True, 3, "ties"),
    ((2, 64, 16, 20), False, 5, "negative"),  # rounding gives distances below zero
]


def _case(b: int, n: int, m: int, k: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(b, n, m, generator=g), torch.rand(b, n, generator=g) + 0.1
    if kind == "ties":
        x = torch.randint(-2, 3, (b, n // 2, m), generator=g).float().repeat(1, 2, 1)
    if kind == "negative":
        x = (torch.randn(b, n // 2, m, generator=g) * 30).repeat(1, 2, 1)
    return x, w, w.topk(k, dim=-1).indices


@pytest.fixture(scope="module")
def lib():
    built = kmedoids_cpu.library()
    assert built is not None, "the native kernel must build wherever the tests run (a C compiler is needed)"
    return built


@pytest.mark.parametrize("shape,weighted,iters,kind", CASES)
def test_the_native_kernel_matches_the_reference_and_the_torch_iterations(lib, shape, weighted, iters, kind):
    b, n, m, k = shape
    x, w, start = _case(b, n, m, k, kind, seed=n + k)
    w = w / w.amax(-1, keepdim=True) if weighted else None
    d = sq_dists(x)
    med, assign = kmedoids_cpu.kmedoids_native(lib, d, w, start, iters, _SWAP_RTOL)
    torch_med, torch_assign = _kmedoids_dense(d, w, start, iters)
    assert torch.equal(med, torch_med) and torch.equal(assign, torch_assign)  # the same bits
    if kind == "negative":  # float64 has no such rounding: the reference breaks these ties differently
        assert (d < 0).any(), "the case must reach negative distances"
        return
    for s in range(b):
        ws = w[s].double().numpy() if weighted else np.ones(n)
        assert (med[s].tolist(), assign[s].tolist()) == ref.kmedoids(x[s].double().numpy(), ws, start[s].tolist(),
                                                                      iters)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_float64_kernel_matches_the_reference(lib, weighted):
    x, w, start = _case(3, 40, 6, 9, "random", seed=5)
    x = x.double()
    w = w.double() / w.amax() if weighted else None
    med, assign = kmedoids_cpu.kmedoids_native(lib, sq_dists(x), w, start, 4, _SWAP_RTOL)
    for s in range(3):
        ws = w[s].numpy() if weighted else np.ones(40)
        assert (med[s].tolist(), assign[s].tolist()) == ref.kmedoids(x[s].numpy(), ws, start[s].tolist(), 4)


def test_the_op_runs_the_native_kernel_on_the_cpu_and_owns_its_outputs(lib, monkeypatch):
    x, w, start = _case(2, 30, 5, 7, "random", seed=1)
    calls = []
    native = kmedoids_cpu.kmedoids_native
    monkeypatch.setattr(kmedoids_cpu, "kmedoids_native", lambda *a: calls.append(a) or native(*a))
    med, assign = _kmedoids_op(sq_dists(x), w, start, 1)
    assert len(calls) == 1
    # one iteration: the medoids are the starting ones, in a tensor of the op's own
    assert torch.equal(med, start) and med.data_ptr() != start.data_ptr()
    assert kmedoids_cpu.kmedoids_native(lib, sq_dists(x)[:0], None, start[:0], 3, _SWAP_RTOL)[0].shape == (0, 7)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and no loaded library; restores the loaded one afterwards."""
    monkeypatch.setenv("PIPELINE_NATIVE_CACHE", str(tmp_path))
    kmedoids_cpu.library.cache_clear()
    yield tmp_path
    kmedoids_cpu.library.cache_clear()


def test_the_library_is_built_once_and_then_loaded_from_the_cache(fresh, monkeypatch):
    assert kmedoids_cpu.library() is not None
    built = list(fresh.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary file left behind
    kmedoids_cpu.library.cache_clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"compiled again: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert kmedoids_cpu.library() is not None


def test_other_flags_build_another_library(fresh, monkeypatch):
    compiler = kmedoids_cpu._compiler()
    first = kmedoids_cpu.library_path(compiler)
    monkeypatch.setattr(kmedoids_cpu, "FLAGS", (*kmedoids_cpu.FLAGS, "-O2"))
    assert kmedoids_cpu.library_path(compiler) != first


def _reference_pool(tokens, k, weights):
    return token_pool(tokens, k, method="kmedoids", weights=weights, validate=False)


@pytest.mark.parametrize("how", ["turned off", "no compiler", "failed build"])
def test_without_the_native_kernel_the_torch_iterations_give_the_same_result(fresh, monkeypatch, caplog, how):
    x, w, _ = _case(2, 40, 6, 9, "random", seed=3)
    want = _reference_pool(x, 9, w)  # with the native kernel, built into the fresh cache
    before = set(fresh.iterdir())
    kmedoids_cpu.library.cache_clear()
    if how == "turned off":
        monkeypatch.setenv("PIPELINE_NATIVE", "0")
    elif how == "no compiler":
        monkeypatch.setenv("CC", "no-such-compiler-here")
    else:
        monkeypatch.setenv("CC", "false")  # exists, exits 1
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.kmedoids_cpu"):
        assert kmedoids_cpu.library() is None
        got = _reference_pool(x, 9, w)
    assert torch.equal(got.index, want.index) and torch.equal(got.assign, want.assign)
    torch.testing.assert_close(got.tokens, want.tokens, rtol=0, atol=0)
    messages = " ".join(r.getMessage() for r in caplog.records)
    expected = {"turned off": "", "no compiler": "no C compiler (no-such-compiler-here) found",
                "failed build": "exited with 1"}[how]
    assert expected in messages and (how == "turned off") == (messages == "")
    assert set(fresh.iterdir()) == before  # a failed build leaves nothing half-written
