"""The clustering iterations' native CPU kernels (pipeline/pooling/clustering_cpu.c): against the brute-force
references and the torch iterations, and their build, cache and fallback."""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.bench.blocks import kernels_in_use
from pipeline.pooling import native, token_pool
from pipeline.pooling.clustering import (
    SWAP_RTOL,
    _kmeans_gram_op,
    _kmedoids_op,
    kmeans_gram_iterations,
    kmedoids_dense,
    sq_dists,
)
from pipeline.runtime import KernelChoice
from tests import reference as ref

# (B, N, M, K), weighted, iterations, kind of tokens
CASES = [
    ((2, 12, 4, 3), True, 5, "random"),
    ((3, 30, 8, 7), False, 3, "random"),
    ((2, 49, 16, 12), True, 1, "random"),
    ((2, 70, 8, 40), True, 4, "random"),
    ((1, 196, 16, 147), True, 5, "random"),
    ((2, 65, 6, 64), False, 5, "random"),  # N and K odd
    ((2, 40, 37, 9), True, 5, "random"),  # M: two blocks of _dot's 16 lanes and a tail of 5
    ((2, 48, 3, 10), False, 5, "ties"),  # small integers, every token twice: many exact ties
    ((2, 48, 3, 30), True, 3, "ties"),
    ((2, 64, 16, 20), False, 5, "negative"),  # rounding gives distances below zero
]


def _case(b: int, n: int, m: int, k: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(b, n, m, generator=g), torch.rand(b, n, generator=g) + 0.1
    if kind == "ties":
        x = torch.randint(-2, 3, (b, n // 2, m), generator=g).float().repeat(1, 2, 1)
    if kind == "negative":  # near-duplicate pairs: (G_ii + G_jj) - 2 G_ij rounds below zero
        base = torch.randn(b, n // 2, m, generator=g) * 30
        x = torch.cat([base, base + 3e-5 * torch.randn(base.shape, generator=g)], dim=1)
    return x, w, w.topk(k, dim=-1).indices


def _gram(x: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, x.transpose(1, 2))


@pytest.fixture(scope="module")
def lib():
    built = native.library()
    assert built is not None, "the native kernels must build wherever the tests run (a C compiler is needed)"
    return built


def _lane_products(x: torch.Tensor) -> torch.Tensor:
    """x_i . x_j (B, N, N) summed in the kernel's documented order (clustering_cpu.c's _dot), in torch ops: 16
    partial sums (lane l adds the products of features l, l + 16, ... in increasing order, each product rounded
    before the add; zeros pad the last block, which adds nothing), then halved pairwise, lane l plus lane l + h."""
    b, n, m = x.shape
    blocks = torch.nn.functional.pad(x, (0, -m % 16)).view(b, n, -1, 16)
    acc = torch.zeros(b, n, n, 16, dtype=x.dtype)
    for t in range(blocks.shape[2]):
        acc = acc + blocks[:, :, None, t] * blocks[:, None, :, t]
    while acc.shape[-1] > 1:
        h = acc.shape[-1] // 2
        acc = acc[..., :h] + acc[..., h:]
    return acc[..., 0]


def _kernel_distances(x: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The distances the K-Medoids kernel reads, by its documented rules, built in torch: column j = given[c] of d
    from the matmul's products (x_given[c] . x_i), d(i, j) = d(j, i) for a token i not given, and every other
    distance from ``_lane_products``; each (|x_i|^2 + |x_j|^2) - 2 x_i . x_j, with |x_j|^2 from its own column
    where j is given."""
    lane = _lane_products(x)
    cols = torch.bmm(torch.stack([x[s, given[s]] for s in range(len(x))]), x.transpose(1, 2))  # (B, C, N)
    d = torch.empty_like(lane)
    for s, g in enumerate(given):
        norm = lane[s].diagonal().clone()
        norm[g] = cols[s, torch.arange(len(g)), g]
        d[s] = (norm[:, None] + norm[None, :]) - 2 * lane[s]
        column = (norm[:, None] + norm[g][None, :]) - 2 * cols[s].T  # (N, C): d(i, g[c]) from the matmul
        not_given = torch.ones(x.shape[1], dtype=torch.bool)
        not_given[g] = False
        d[s, g] = torch.where(not_given[None, :], column.T, d[s, g])  # d(j, i) = d(i, j) for a token i not given
        d[s, :, g] = column
    return d


@pytest.mark.parametrize("given", ["starting medoids", "none"])
@pytest.mark.parametrize("shape,weighted,iters,kind", CASES)
def test_native_kmedoids_matches_the_reference_and_the_torch_iterations(lib, shape, weighted, iters, kind, given):
    """Against the torch iterations on the distances the kernel is documented to read (``_kernel_distances``): the
    same bits. Against the torch iterations on ``sq_dists`` and the float64 brute force: the same medoids and
    assignments, where no two distances tie within their rounding (every case but ``negative``, whose near-duplicate
    tokens round below zero, and there the matmul's products and the kernel's differ)."""
    b, n, m, k = shape
    x, w, start = _case(b, n, m, k, kind, seed=n + k)
    w = w / w.amax(-1, keepdim=True) if weighted else None
    columns = start if given == "starting medoids" else start[:, :0]
    med, assign = native.kmedoids(lib, x, w, start, iters, SWAP_RTOL, given=columns)
    want = kmedoids_dense(_kernel_distances(x, columns), w, start, iters)
    assert torch.equal(med, want[0]) and torch.equal(assign, want[1])  # the same bits
    if kind == "negative":
        assert (sq_dists(x) < 0).any(), "the case must reach negative distances"
        return
    torch_med, torch_assign = kmedoids_dense(sq_dists(x), w, start, iters)
    assert torch.equal(med, torch_med) and torch.equal(assign, torch_assign)
    for s in range(b):
        ws = w[s].double().numpy() if weighted else np.ones(n)
        assert (med[s].tolist(), assign[s].tolist()) == ref.kmedoids(x[s].double().numpy(), ws, start[s].tolist(),
                                                                      iters)


def test_the_cases_swap_medoids_in_and_read_distances_no_matmul_gave(lib):
    """Where the kernel's own distances come in: a medoid swapped in (its column), two members of a cluster that are
    not its medoid (a cluster of three, after an update). Some case must swap a medoid in and some case must have
    such a cluster, or the test above would not reach them."""
    swapped = shared = False
    for (b, n, m, k), weighted, iters, kind in CASES:
        if iters == 1:  # no update: every distance read is a starting medoid's
            continue
        x, w, start = _case(b, n, m, k, kind, seed=n + k)
        med, assign = native.kmedoids(lib, x, w if weighted else None, start, iters, SWAP_RTOL)
        swapped |= not torch.equal(med.sort(-1).values, start.sort(-1).values)
        sizes = torch.zeros(b, k).scatter_add_(1, assign, torch.ones(b, n))
        shared |= bool((sizes >= 3).any())
    assert swapped and shared


@pytest.mark.parametrize("shape,weighted,iters,kind", [c for c in CASES if c[3] == "random"])
def test_native_kmeans_matches_the_reference_and_the_torch_iterations(lib, shape, weighted, iters, kind):
    b, n, m, k = shape
    x, w, start = _case(b, n, m, k, kind, seed=n + k + 1)
    w = w / w.amax(-1, keepdim=True) if weighted else None
    assign = native.kmeans_gram(lib, _gram(x), w, start, iters)
    assert torch.equal(assign, kmeans_gram_iterations(_gram(x), w, start, iters))
    for s in range(b):
        ws = w[s].double().numpy() if weighted else np.ones(n)
        assert assign[s].tolist() == ref.kmeans(x[s].double().numpy(), ws, start[s].tolist(), iters)


def test_native_kmeans_keeps_the_centre_of_an_empty_cluster(lib):
    # Two centres start on duplicate tokens: the second is empty after the first assignment (ties go to
    # the lowest centre) and keeps its centre while the first moves (as in test_pooling_properties); off the
    # origin, so that the kept centre's projections and norm are not zero.
    x = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [5.0, 5.0], [5.1, 5.0], [9.0, 9.0], [0.2, 0.1]]]) + 1.0
    start = torch.tensor([[0, 1, 2]])
    for iters in (1, 2, 5):
        got = native.kmeans_gram(lib, _gram(x), None, start, iters)
        assert got[0].tolist() == ref.kmeans(x[0].double().numpy(), np.ones(6), [0, 1, 2], iters)
        assert torch.equal(got, kmeans_gram_iterations(_gram(x), None, start, iters))
    assert 1 not in native.kmeans_gram(lib, _gram(x), None, start, 1)[0].tolist(), "the case must empty a cluster"


@pytest.mark.parametrize("weighted", [False, True])
def test_the_float64_kernels_match_the_references(lib, weighted):
    x, w, start = _case(3, 40, 6, 9, "random", seed=5)
    x = x.double()
    w = w.double() / w.amax() if weighted else None
    med, assign = native.kmedoids(lib, x, w, start, 4, SWAP_RTOL)
    means = native.kmeans_gram(lib, _gram(x), w, start, 4)
    for s in range(3):
        ws = w[s].numpy() if weighted else np.ones(40)
        assert (med[s].tolist(), assign[s].tolist()) == ref.kmedoids(x[s].numpy(), ws, start[s].tolist(), 4)
        assert means[s].tolist() == ref.kmeans(x[s].numpy(), ws, start[s].tolist(), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted,with_start", [(True, True), (False, True), (True, False)])
def test_native_cluster_means_give_the_index_add_sums_bits_and_the_reference(lib, weighted, with_start, dtype):
    """The merge: the same bits as ``Partition``'s index_add_ sums (the CPU's torch path), the float64 brute force's
    means within rounding, and an empty cluster's start token (a case with no start has no empty cluster)."""
    from pipeline.pooling.merge import means_partition

    b, n, m, k = 3, 50, 37, 12  # M not a multiple of any vector width
    x, w, start = _case(b, n, m, k, "random", seed=7)
    x, w = x.to(dtype) * 10, (w / w.amax(-1, keepdim=True)).to(dtype) if weighted else None
    assign = torch.randint(0, k, (b, n), generator=torch.Generator().manual_seed(8))
    if with_start:
        assign[0] = assign[0] % (k - 2)  # clusters k - 2 and k - 1 of image 0 are empty
    else:
        assign[:, :k] = torch.arange(k)  # every cluster has a member
    start = start if with_start else None
    got = native.cluster_means(lib, x, w, assign, k, start)
    assert torch.equal(got, means_partition(x, w, assign, k, start))
    for s in range(b):
        ws = w[s].double().numpy() if weighted else np.ones(n)
        for j, mean in enumerate(ref.cluster_means(x[s].double().numpy(), ws, assign[s].tolist(), k)):
            want = x[s, start[s, j]].double() if mean is None else torch.from_numpy(mean)
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(got[s, j].double(), want, rtol=tol, atol=tol)
    assert not with_start or torch.equal(got[0, k - 1], x[0, start[0, k - 1]])


def test_the_kernels_split_the_batch_over_torchs_threads_on_torchs_openmp_runtime(lib):
    """The same bits on 1, 2 and 3 threads (5 images: parts of unequal size), and one
    OpenMP runtime in the process: the library's libgomp.so.1 is the copy torch loaded, whose threads its matmuls use
    (a second runtime would hold a second pool on the same cores)."""
    x, w, start = _case(5, 40, 6, 9, "random", seed=11)
    assign = torch.randint(0, 9, (5, 40), generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((*native.kmedoids(lib, x, w, start, 4, SWAP_RTOL),
                            native.kmeans_gram(lib, _gram(x), w, start, 4),
                            native.cluster_means(lib, x, w, assign, 9, start)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    symbols = subprocess.run(["nm", "-D", lib._name], capture_output=True, text=True, check=True).stdout
    assert "GOMP_parallel" in symbols  # the parallel regions were compiled in (-fopenmp), not left as comments
    runtimes = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert len(runtimes) == 1 and all(Path(r).parent == torch_lib for r in runtimes), runtimes


def test_an_index_out_of_range_is_refused_before_the_kernels_read_or_write_at_it(lib):
    x, w, start = _case(2, 20, 4, 5, "random", seed=13)
    assign = torch.zeros(2, 20, dtype=torch.int64)
    for call, name in [(lambda: native.kmedoids(lib, x, w, start + 20, 3, SWAP_RTOL), "medoids"),
                       (lambda: native.kmeans_gram(lib, _gram(x), w, start - 21, 3), "start"),
                       (lambda: native.cluster_means(lib, x, w, assign + 5, 5, None), "assign")]:
        with pytest.raises(IndexError, match=rf"kernels' {name} must lie in \[0, (20|5)\), got "):
            call()


def test_the_ops_run_the_native_kernels_on_the_cpu_and_own_their_outputs(lib, monkeypatch):
    x, w, start = _case(2, 30, 5, 7, "random", seed=1)
    calls = []

    def counted(name):
        kernel = getattr(native, name)
        return lambda *args: calls.append(name) or kernel(*args)

    for name in ("kmedoids", "kmeans_gram"):
        monkeypatch.setattr(native, name, counted(name))
    med, assign = _kmedoids_op(x, None, w, start, 1)
    _kmeans_gram_op(_gram(x), w, start, 2)
    assert calls == ["kmedoids", "kmeans_gram"]
    # one iteration: the medoids are the starting ones, in a tensor of the op's own
    assert torch.equal(med, start) and med.data_ptr() != start.data_ptr()
    med, assign = native.kmedoids(lib, x[:0], None, start[:0], 3, SWAP_RTOL)
    assert med.shape == (0, 7) and assign.shape == (0, 30)
    assert native.kmeans_gram(lib, _gram(x)[:0], None, start[:0], 3).shape == (0, 30)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and no loaded library; restores the loaded one afterwards."""
    monkeypatch.setenv("PIPELINE_NATIVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


def test_the_library_is_built_once_and_then_loaded_from_the_cache(fresh, monkeypatch):
    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")  # the baseline alone builds in a third of the time
    assert native.library() is not None
    built = list(fresh.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary file left behind
    native.library.cache_clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"compiled again: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    monkeypatch.setenv("CC", "no-such-compiler-here")  # a built library loads without one (Docker runtime)
    assert native.library() is not None


def test_changed_flags_build_another_library(fresh, monkeypatch):
    """Other flags, another library in the same folder (a changed source: the comment-edit test below)."""
    first = native.library_path()
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-O2"))
    assert native.library_path() != first and native.library_path().parent == first.parent == fresh


@pytest.mark.parametrize("method", ["kmedoids", "kmeans"])
@pytest.mark.parametrize("how", ["turned off", "no compiler", "failed build"])
def test_without_the_native_kernels_the_torch_iterations_give_the_same_result(lib, fresh, monkeypatch, caplog, how,
                                                                             method, tmp_path_factory):
    x, w, _ = _case(2, 40, 6, 9, "random", seed=3)
    monkeypatch.setenv("PIPELINE_NATIVE_CACHE", str(Path(lib._name).parent))  # the module's library, built
    native.library.cache_clear()
    assert native.library() is not None
    want = token_pool(x, 9, method=method, weights=w, validate=False)  # native
    empty = tmp_path_factory.mktemp("empty")
    monkeypatch.setenv("PIPELINE_NATIVE_CACHE", str(empty))  # nothing built there
    native.library.cache_clear()
    kernels = KernelChoice(native="torch") if how == "turned off" else None
    if how == "no compiler":
        monkeypatch.setenv("CC", "no-such-compiler-here")
    elif how == "failed build":
        monkeypatch.setenv("CC", "false")  # exists, exits 1
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        assert native.for_tensor(x, enabled=kernels is None) is None
        got = token_pool(x, 9, method=method, weights=w, validate=False, kernels=kernels)
    assert torch.equal(got.assign, want.assign)
    torch.testing.assert_close(got.tokens, want.tokens, rtol=0, atol=0)
    messages = " ".join(r.getMessage() for r in caplog.records)
    expected = {"turned off": "", "no compiler": "no C compiler (no-such-compiler-here) found",
                "failed build": "exited with 1"}[how]
    assert expected in messages and (how == "turned off") == (messages == "")
    assert "same results" not in messages  # K-Medoids' distances are summed in another order: a near-tie may flip
    assert list(empty.iterdir()) == []  # a failed build leaves nothing half-written


def test_a_bad_native_choice_is_refused_with_the_values_it_takes(fresh):
    from pipeline.errors import InputError

    with pytest.raises(InputError, match=r"kernels.native must be one of auto, torch, got '0'"):
        KernelChoice(native="0")
    assert list(fresh.iterdir()) == []  # nothing built


def _lib_built_with(flags: tuple[str, ...], path) -> ctypes.CDLL:
    proc = subprocess.run(["cc", *flags, str(native.SOURCE), "-o", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return native.load(path)


def cpu_level() -> str:
    """This CPU's x86-64 psABI level from /proc/cpuinfo's flags (an independent reading of what the library's
    ``clustering_isa`` asks the CPU)."""
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86-64-v4"
    if {"avx2", "bmi1", "bmi2", "fma", "movbe", "abm"} <= flags:
        return "x86-64-v3"
    return "x86-64"


ON_X86 = native.built_for() != "baseline"


@pytest.mark.skipif(not ON_X86 or cpu_level() == "x86-64", reason="the AVX2 level's code needs an x86-64-v3 CPU")
def test_every_instruction_sets_code_gives_the_same_bits(lib, tmp_path):
    """The library's clones (the one this CPU runs), the baseline alone (-DPIPELINE_NO_CLONES) and the AVX2 level
    built for by hand (-march=x86-64-v3): the same medoids, assignments, K-Means assignments and cluster means, bit
    for bit (no contraction, no reordered sum), on the cases above."""
    others = {"baseline": _lib_built_with((*native.FLAGS, native.NO_CLONES), tmp_path / "baseline.so"),
              "x86-64-v3": _lib_built_with((*native.FLAGS, native.NO_CLONES, "-march=x86-64-v3"), tmp_path / "v3.so")}
    for (b, n, m, k), weighted, iters, kind in CASES:
        x, w, start = _case(b, n, m, k, kind, seed=n)
        w = w if weighted else None
        want = native.kmedoids(lib, x, w, start, iters, SWAP_RTOL), native.kmeans_gram(lib, _gram(x), w, start,
                                                                                             iters)
        means = native.cluster_means(lib, x, w, want[1], k, start)
        for name, other in others.items():
            med, assign = native.kmedoids(other, x, w, start, iters, SWAP_RTOL)
            got = native.kmeans_gram(other, _gram(x), w, start, iters)
            assert torch.equal(med, want[0][0]) and torch.equal(assign, want[0][1]), (name, n, k)
            assert torch.equal(got, want[1]), (name, n, k)
            assert torch.equal(native.cluster_means(other, x, w, want[1], k, start), means), (name, n, k)


def test_the_cache_and_a_tables_key_name_the_instruction_sets_and_a_library_that_says_otherwise_never_loads(
        fresh, monkeypatch, caplog, tmp_path_factory):
    """The library's name holds the instruction sets it was built for, a baseline build (PIPELINE_NATIVE_CLONES=0) is
    another file; a latency table's key (``bench.blocks.kernels_in_use``) names the file and the level its kernels run
    at, so the two builds key two tables, and a step set to its torch iterations names no library; a baseline library
    put in under the clones' name is refused (the torch iterations run) with a line saying what it holds and what to
    do."""
    cpu = torch.device("cpu")
    clones = native.library_path()
    assert native.library() is not None and clones.exists()
    assert kernels_in_use(cpu, KernelChoice(native="torch")) == dict.fromkeys(("kmedoids", "kmeans", "merge",
                                                                              "attention"), "torch")
    if not ON_X86:
        assert native.instruction_set() == "baseline" and "clustering_cpu-baseline-" in clones.name
        assert kernels_in_use(cpu)["native"] == f"{clones.name} at baseline"
        return
    assert native.instruction_set() == cpu_level()  # the clone the loader picked is the CPU's level
    assert clones.name.startswith("clustering_cpu-x86-64-v4+x86-64-v3+x86-64-")
    key = kernels_in_use(cpu)
    assert key["kmedoids"] == key["merge"] == "native-c" and key["native"] == f"{clones.name} at {cpu_level()}"
    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")
    native.library.cache_clear()
    baseline = native.library_path()
    assert baseline != clones and baseline.name.startswith("clustering_cpu-x86-64-")
    assert native.library() is not None and native.instruction_set() == "x86-64"
    assert kernels_in_use(cpu)["native"] == f"{baseline.name} at x86-64"
    monkeypatch.delenv("PIPELINE_NATIVE_CLONES")
    other = tmp_path_factory.mktemp("other")  # a folder of its own: a path loaded before would be the loaded library
    monkeypatch.setenv("PIPELINE_NATIVE_CACHE", str(other))
    clones = native.library_path()
    clones.write_bytes(baseline.read_bytes())  # another build under the clones' name
    native.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        assert native.library() is None
    assert f"the clustering CPU kernels at {clones} cannot be used (it holds kernels for x86-64, not the " \
           "x86-64-v4,x86-64-v3,x86-64 its name says): the torch iterations run instead (slower; they sum some " \
           "distances in another order, so a near-tie may be assigned the other way); delete the file to rebuild it" \
           in caplog.text


@pytest.mark.skipif(not ON_X86, reason="the x86-64 clones exist on x86-64 alone")
def test_a_compiler_that_cannot_build_the_clones_builds_the_baseline(fresh, monkeypatch, caplog):
    """A compiler older than GCC 12 or Clang 18 stops at the source's #error for the clones (simulated: the clones'
    build fails as it would): the baseline alone is built, loaded and named, with one warning."""
    real = native.build

    def old_compiler(compiler, target, clones=None):
        if clones:
            raise OSError("cc exited with 1: #error a clone per x86-64 level needs GCC 12 or Clang 18")
        return real(compiler, target, clones)

    monkeypatch.setattr(native, "build", old_compiler)
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        assert native.library() is not None
    assert native.instruction_set() == "x86-64"
    assert [p.name.split("-")[1:3] for p in fresh.iterdir()] == [["x86", "64"]]  # the baseline's file alone
    assert "could not build the clustering CPU kernels with a clone per x86-64 level (cc exited with 1: #error a " \
           "clone per x86-64 level needs GCC 12 or Clang 18): building the baseline alone" in caplog.text
    # that cache, where no compiler is (an image's runtime stage), loads the baseline's library as it is
    native.library.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native.library() is not None and native.instruction_set() == "x86-64"


# --- arguments refused before any C runs (issue 84)

def _no_c(monkeypatch):
    """Fails the test where a kernel is called: a refused argument must not reach the C."""
    def called(lib, name, *args):
        raise AssertionError(f"the C kernel {name} ran on arguments that should have been refused")
    monkeypatch.setattr(native, "_call", called)


def _bad_calls(lib):
    """(what is wrong, the call, the error and message it must raise) for each kind of argument the kernels would
    read past, index with, or misread: broadcast shapes, a batch of 1 for 16, K = 0, margins out of [0, 1),
    repeated medoids, other dtypes."""
    b, n, m, k = 4, 20, 6, 5
    x, w, start = _case(b, n, m, k, "random", seed=21)
    assign = torch.randint(0, k, (b, n), generator=torch.Generator().manual_seed(22))
    x16, w16, start16 = _case(16, n, m, k, "random", seed=23)
    g = _gram(x)
    shape = r"must be of shape"
    dup = start.clone()
    dup[2, 1] = dup[2, 0]
    return [
        ("K-Medoids weights (1, N)", lambda: native.kmedoids(lib, x, w[:1], start, 3, SWAP_RTOL), ValueError, shape),
        ("K-Medoids medoids of batch 1", lambda: native.kmedoids(lib, x16, w16, start16[:1], 3, SWAP_RTOL),
         ValueError, shape),
        ("K-Medoids given of batch 1", lambda: native.kmedoids(lib, x16, w16, start16, 3, SWAP_RTOL,
                                                               given=start16[:1]), ValueError, shape),
        ("K-Medoids K = 0", lambda: native.kmedoids(lib, x, w, start[:, :0], 3, SWAP_RTOL), ValueError,
         r"K >= 1 medoids, got 0"),
        ("K-Medoids rtol > 1", lambda: native.kmedoids(lib, x, w, start, 3, 1.5), ValueError,
         r"rtol must lie in \[0, 1\), got 1.5"),
        ("K-Medoids rtol = 1", lambda: native.kmedoids(lib, x, w, start, 3, 1.0), ValueError, r"rtol must lie"),
        ("K-Medoids rtol < 0", lambda: native.kmedoids(lib, x, w, start, 3, -0.1), ValueError, r"rtol must lie"),
        ("K-Medoids rtol NaN", lambda: native.kmedoids(lib, x, w, start, 3, float("nan")), ValueError,
         r"rtol must lie"),
        ("K-Medoids repeated medoids", lambda: native.kmedoids(lib, x, w, dup, 3, SWAP_RTOL), ValueError,
         r"medoids must be distinct in each image; image 2 holds one twice"),
        ("K-Medoids float medoids", lambda: native.kmedoids(lib, x, w, start.float(), 3, SWAP_RTOL), TypeError,
         r"medoids must be a CPU tensor of an integer dtype"),
        ("K-Medoids integer weights", lambda: native.kmedoids(lib, x, w.long(), start, 3, SWAP_RTOL), TypeError,
         r"w must be a CPU tensor of a floating dtype"),
        ("K-Medoids float16 tokens", lambda: native.kmedoids(lib, x.half(), w, start, 3, SWAP_RTOL), TypeError,
         r"x must be a \(B, N, M\) float32 or float64 CPU tensor"),
        ("K-Medoids 2-D tokens", lambda: native.kmedoids(lib, x[0], w, start, 3, SWAP_RTOL), TypeError,
         r"x must be a \(B, N, M\)"),
        ("K-Means starts (1, K)", lambda: native.kmeans_gram(lib, g, w, start[:1], 3), ValueError, shape),
        ("K-Means weights (1, N)", lambda: native.kmeans_gram(lib, g, w[:1], start, 3), ValueError, shape),
        ("K-Means Gram (B, N, N - 5)", lambda: native.kmeans_gram(lib, g[:, :, :-5], w, start, 3), ValueError,
         shape),
        ("K-Means starts of batch 1", lambda: native.kmeans_gram(lib, _gram(x16), w16, start16[:1], 3),
         ValueError, shape),
        ("K-Means K = 0", lambda: native.kmeans_gram(lib, g, w, start[:, :0], 3), ValueError,
         r"K >= 1 starting tokens, got 0"),
        ("means weights (B, N - 10)", lambda: native.cluster_means(lib, x, w[:, :-10], assign, k, start),
         ValueError, shape),
        ("means assignment expanded to the batch",
         lambda: native.cluster_means(lib, x16, w16, assign[:1].expand(16, n), k, start16), None, None),
        ("means assignment (1, N)", lambda: native.cluster_means(lib, x16, w16, assign[:1], k, start16),
         ValueError, shape),
        ("means starts (B, K - 1)", lambda: native.cluster_means(lib, x, w, assign, k, start[:, 1:]), ValueError,
         shape),
        ("means k = 0", lambda: native.cluster_means(lib, x, w, assign[:, :0].reshape(b, 0), 0, None), ValueError,
         r"k >= 1 clusters, got 0"),
        ("means float assignment", lambda: native.cluster_means(lib, x, w, assign.float(), k, start), TypeError,
         r"assign must be a CPU tensor of an integer dtype"),
    ]


BAD = [case[0] for case in _bad_calls(None)]


@pytest.mark.parametrize("what", BAD)
def test_a_bad_argument_is_refused_before_any_c_runs(lib, monkeypatch, what):
    """Each bad shape, size, margin, repeat or dtype raises its own error naming the argument, and the C is never
    called (``_call`` fails the test if it is); an expanded (B, N) view, a good shape, is taken."""
    _, call, error, message = next(case for case in _bad_calls(lib) if case[0] == what)
    if error is None:
        assert call().shape == (16, 5, 6)
        return
    _no_c(monkeypatch)
    with pytest.raises(error, match=message):
        call()


def test_the_c_refuses_sizes_and_margins_out_of_range_itself(lib):
    """Behind the wrappers, each kernel returns -2 (and reads nothing at a medoid) for K = 0, K > N, N = 0 or a keep
    factor outside (0, 1] (an rtol outside [0, 1)); every buffer given is large enough, so that the calls are safe
    either way."""
    n, m, k = 6, 3, 2
    x = torch.randn(1, n, m)
    cols = torch.zeros(1, n, n)
    ids = torch.arange(n).view(1, n)
    out_i, out_f = torch.zeros(1, 4 * n, dtype=torch.int64), torch.zeros(1, 4 * n * m)
    p = lambda t: t.data_ptr()  # noqa: E731

    def kmedoids(kk, nn, keep):
        return lib.kmedoids_f32(p(x), p(cols), p(ids), None, p(ids), p(out_i), p(out_i), 1, nn, m, kk, kk, 3, keep, 1)

    assert kmedoids(k, n, 1 - SWAP_RTOL) == 0
    for kk, nn, keep in [(0, n, 1.0), (n + 1, n, 1.0), (k, 0, 1.0), (k, n, -0.5), (k, n, 0.0), (k, n, 1.5),
                         (k, n, float("nan"))]:
        assert kmedoids(kk, nn, keep) == -2, (kk, nn, keep)
    gram = torch.zeros(1, n, n)
    assert lib.kmeans_gram_f32(p(gram), None, p(ids), p(out_i), 1, n, k, 3, 1) == 0
    assert lib.kmeans_gram_f32(p(gram), None, p(ids), p(out_i), 1, n, 0, 3, 1) == -2
    assert lib.cluster_means_f32(p(x), None, p(torch.zeros(1, n, dtype=torch.int64)), None, p(out_f), 1, n, m, 0,
                                 1) == -2
    with pytest.raises(ValueError, match="the clustering CPU kernel kmeans_gram refused its sizes or margin"):
        native._call(lib, "kmeans_gram", gram, None, ids, out_i, 1, n, 0, 3)


@pytest.mark.parametrize("method", ["kmedoids", "kmeans"])
def test_tokens_of_width_zero_pool_as_the_brute_force_does(lib, method):
    """M = 0: every distance is 0, so every token ties and joins the first cluster but the medoids (K-Medoids) and
    the means are empty rows; the native kernels run it (before, K-Medoids' reshape of 0 elements raised)."""
    b, n, k = 2, 10, 3
    x = torch.randn(b, n, 0)
    w = torch.rand(b, n, generator=torch.Generator().manual_seed(3)) + 0.1
    assert native.for_tensor(x) is not None
    got = token_pool(x, k, method=method, weights=w, validate=False)
    start = w.topk(k, dim=-1).indices
    for s in range(b):
        if method == "kmedoids":
            want = ref.kmedoids(x[s].double().numpy(), w[s].double().numpy(), start[s].tolist(), 5)[1]
        else:
            want = ref.kmeans(x[s].double().numpy(), w[s].double().numpy(), start[s].tolist(), 5)
        assert got.assign[s].tolist() == want
    assert got.tokens.shape == (b, k, 0)


# --- the cache that heals (issue 84)

@pytest.mark.skipif(not ON_X86, reason="the x86-64 clones exist on x86-64 alone")
def test_a_process_with_a_compiler_builds_the_clones_beside_a_cached_baseline(lib, fresh, monkeypatch):
    """A baseline library in the cache (built with PIPELINE_NATIVE_CLONES=0, or by an image without the clones) does
    not stop a process that has a compiler from building the clones and running them. (The clones' build is the
    module's library copied in, the file the same compiler and flags built: 4 s of compiling saved.)"""
    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")
    assert native.library() is not None and native.instruction_set() == "x86-64"
    monkeypatch.delenv("PIPELINE_NATIVE_CLONES")
    native.library.cache_clear()
    built = []
    monkeypatch.setattr(native, "build", lambda command, target, clones=None: built.append(clones)
                        or target.write_bytes(Path(lib._name).read_bytes()))
    lib = native.library()
    assert built == [True]
    assert lib is not None and Path(lib._name) == native.library_path(True) and native.library_path(True).exists()
    assert lib.clustering_built().decode() == "x86-64-v4,x86-64-v3,x86-64"
    assert native.instruction_set() == cpu_level()


def test_the_library_is_written_0644_whatever_the_umask(fresh, monkeypatch):
    import os
    import stat

    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")  # the baseline alone builds in a third of the time
    old = os.umask(0o077)
    try:
        assert native.library() is not None
    finally:
        os.umask(old)
    (built,) = fresh.iterdir()
    assert stat.S_IMODE(built.stat().st_mode) == 0o644


def _damaged(good: bytes, how: str) -> bytes:
    if how == "truncated":
        return good[:len(good) // 2]
    if how == "empty":
        return b""
    if how == "another machine's ELF":  # e_machine 183: AArch64 (62 on an AArch64 host)
        other = (62 if good[18:20] == (183).to_bytes(2, "little") else 183).to_bytes(2, "little")
        return good[:18] + other + good[20:]
    if how == "not a shared object":  # e_type 2: an executable
        return good[:16] + (2).to_bytes(2, "little") + good[18:]
    if how == "bad bytes":  # the string the loader decodes (a UnicodeDecodeError escaped, before)
        at = good.index(native.built_for().encode())
        return good[:at] + b"\xff" * 9 + good[at + 9:]
    raise AssertionError(how)


DAMAGE = {  # how -> what damage() says of it
    "truncated": "no digest at its end (truncated, or not written by this build)",
    "empty": "not an ELF file",
    "another machine's ELF": "an ELF file for another machine",
    "not a shared object": "an ELF file that is not a shared object",
    "bad bytes": "its bytes differ from the digest written with them",
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_library_is_found_before_dlopen_and_rebuilt_once_with_one_warning(lib, fresh, monkeypatch, caplog,
                                                                                     how):
    """The library put in the cache (its name, another folder than any loaded: a path loaded before would be the
    loaded library) damaged each way: ``damage`` names what is wrong without loading it, and ``library()`` warns
    once, builds it again in place, and loads kernels that give the brute force's result (the baseline's library:
    it builds in a third of the clones' time)."""
    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")
    target = native.library_path()
    target.write_bytes(_damaged(Path(lib._name).read_bytes(), how))
    assert native.damage(target) == DAMAGE[how]
    builds = []
    real = native.build
    monkeypatch.setattr(native, "build", lambda *args: builds.append(args) or real(*args))
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        healed = native.library()
    assert healed is not None and len(builds) == 1 and native.damage(target) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the clustering CPU kernels at {target} are damaged ({DAMAGE[how]}): building them again"]
    x, w, start = _case(1, 20, 4, 5, "random", seed=41)
    med, assign = native.kmedoids(healed, x, w, start, 3, SWAP_RTOL)
    assert (med[0].tolist(), assign[0].tolist()) == ref.kmedoids(x[0].double().numpy(), w[0].double().numpy(),
                                                                  start[0].tolist(), 3)


def test_a_damaged_library_without_a_compiler_is_never_loaded(lib, fresh, monkeypatch, caplog):
    target = native.library_path()
    target.write_bytes(_damaged(Path(lib._name).read_bytes(), "truncated"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        assert native.library() is None
    assert len(caplog.records) == 1 and "are damaged (no digest at its end" in caplog.text
    assert "no C compiler is at hand to rebuild them" in caplog.text


def test_a_comment_edit_keeps_the_librarys_name_and_a_code_edit_or_another_compiler_changes_it(
        fresh, monkeypatch, tmp_path_factory):
    """The name hashes the source without its comments (a comment edit keeps every latency table keyed by it), the
    flags, and the compiler's version and arguments (a Clang build is not cached under GCC's name)."""
    first = native.library_path()
    folder = tmp_path_factory.mktemp("source")
    text = native.SOURCE.read_text()
    edits = {
        "comment at the end": text + "\n/* edited */\n// and a line comment\n",
        "comment text": text.replace("the levels this library holds a clone for", "the levels held", 1),
        "comment in a macro": text.replace("    /* the swap rule of every cluster, from the costs of its members */",
                                           "    /* the swap rule */ /* of every cluster */", 1),
        "a comment's lines": text.replace("/* the levels this library holds a clone for, highest first */",
                                          "/* the levels this library\n   holds a clone for */\n\n", 1),
    }
    for what, edited in {**edits, "code": text.replace("#define LANES 16", "#define LANES 8", 1)}.items():
        assert edited != text, what
        source = folder / f"{len(what)}.c"
        source.write_text(edited)
        monkeypatch.setattr(native, "SOURCE", source)
        assert (native.library_path() == first) == (what != "code"), what
    monkeypatch.setattr(native, "SOURCE", Path(native.__file__).with_name("clustering_cpu.c"))
    fake = folder / "othercc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "clang version 19.1.7"; exit 0; }\nexec cc "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    other = native.library_path()
    assert other != first and other.name.rsplit("-", 1)[0] == first.name.rsplit("-", 1)[0]
    monkeypatch.setenv("CC", "cc -O3")  # an argument in CC changes what is built
    assert native.library_path() not in (first, other)


def test_a_cc_with_arguments_is_found_and_builds(fresh, monkeypatch, caplog):
    import shutil

    monkeypatch.setenv("CC", "cc -m64" if ON_X86 else "cc -O3")
    monkeypatch.setenv("PIPELINE_NATIVE_CLONES", "0")  # the baseline alone builds in a third of the time
    assert native.compiler() == [shutil.which("cc"), "-m64" if ON_X86 else "-O3"]
    with caplog.at_level(logging.WARNING, logger="pipeline.pooling.native"):
        assert native.library() is not None
    assert caplog.text == ""


@pytest.mark.skipif(not ON_X86, reason="the x86-64 clones exist on x86-64 alone")
@pytest.mark.parametrize("clang,refused", [(14, True), (17, True), (18, False), (19, False)])
def test_the_clones_gate_admits_clang_18_and_later(clang, refused, tmp_path):
    """Clang before 18 refuses the level names in ``__builtin_cpu_supports("x86-64-v4")`` (checked with clang 14, 16
    and 19), so the source's #error must stop it (and native.py build the baseline) rather than let the build fail on
    it: the preprocessor run as Clang of each version would run it."""
    proc = subprocess.run(["cc", "-E", "-D__clang__=1", f"-D__clang_major__={clang}", str(native.SOURCE), "-o",
                           str(tmp_path / "out.i")], capture_output=True, text=True, timeout=120)
    assert (proc.returncode != 0) == refused, proc.stderr
    assert not refused or "a clone per x86-64 level needs GCC 12 or Clang 18" in proc.stderr


def _clangs() -> list[str]:
    import shutil

    return sorted({path for name in ["clang", *(f"clang-{v}" for v in range(11, 30))]
                   if (path := shutil.which(name))})


@pytest.mark.skipif(not ON_X86 or not _clangs(), reason="needs a Clang on x86-64")
def test_a_real_clang_builds_the_clones_or_stops_at_the_gate(tmp_path):
    for clang in _clangs():
        major = int(subprocess.run([clang, "-dumpversion"], capture_output=True, text=True).stdout.split(".")[0])
        proc = subprocess.run([clang, "-fsyntax-only", "-std=c11", str(native.SOURCE)], capture_output=True,
                              text=True, timeout=120)
        if major >= 18:
            assert proc.returncode == 0, (clang, proc.stderr)
        else:
            assert "a clone per x86-64 level needs GCC 12 or Clang 18" in proc.stderr, (clang, proc.stderr)
        base = subprocess.run([clang, "-fsyntax-only", "-std=c11", native.NO_CLONES, str(native.SOURCE)],
                              capture_output=True, text=True, timeout=120)
        assert base.returncode == 0, (clang, base.stderr)


def test_the_self_checks_tolerances_are_the_ones_design_md_states():
    """docs/design.md states the assignment tolerances the self-check applies on the CPU: none for K-Means (its
    native kernel rounds as torch does), 1 token in 100 for K-Medoids (its kernel sums some distances its own way)."""
    from pipeline.models import selfcheck

    cpu = torch.device("cpu")
    choice = KernelChoice()
    checks = selfcheck._clustering_shape(choice, cpu, False, selfcheck.kernels_planned(choice, cpu),
                                         selfcheck.TOLERANCE["native"], 20, 5, 8)
    tolerance = {check.kernel: check.tolerance for check in checks}
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text().split())
    assert tolerance["kmeans"] == 0 and "K-Means' none on the CPU" in doc
    assert tolerance["kmedoids"] == 0.01 and "K-Medoids' 1 token in 100 on every device" in doc


def _asan_runtime() -> list[str]:
    """libasan and libstdc++ from the C compiler (preloaded in that order: Python is not instrumented, and ASan's
    C++ exception hook needs libstdc++ at hand when Triton's import throws), or [] where the compiler has none."""
    found = []
    for name in ("libasan.so", "libstdc++.so.6"):
        proc = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True, text=True)
        path = proc.stdout.strip()
        if proc.returncode or not Path(path).is_absolute() or not Path(path).exists():
            return []
        found.append(path)
    return found


@pytest.mark.slow  # an instrumented build and a process that imports torch under ASan: about 10 s
@pytest.mark.skipif(not _asan_runtime(), reason="the C compiler has no AddressSanitizer runtime")
def test_the_bad_input_cases_under_addresssanitizer(tmp_path):
    """The library built with -fsanitize=address, run by ``tests/native_asan.py`` on every bad call above (each
    refused with its own error), the C given sizes and margins out of range and two equal medoids directly, and good
    cases against the brute force: exit 0 and no AddressSanitizer report."""
    import os
    import sys

    path = tmp_path / "asan.so"
    proc = subprocess.run(["cc", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer", *native.flags(),
                           str(native.SOURCE), "-o", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    env = {**os.environ, "LD_PRELOAD": " ".join(_asan_runtime()), "ASAN_OPTIONS": "detect_leaks=0"}
    run = subprocess.run([sys.executable, "-m", "tests.native_asan", str(path)], cwd=Path(__file__).parents[1],
                         env=env, capture_output=True, text=True, timeout=600)
    assert "AddressSanitizer" not in run.stderr and run.returncode == 0, run.stderr[-4000:]
    assert f"refused {sum(case[2] is not None for case in _bad_calls(None))} bad calls" in run.stdout
