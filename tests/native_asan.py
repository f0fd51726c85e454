"""Runs the native kernels' bad-input cases and a few good ones against a library built with AddressSanitizer
(``tests/test_native.py::test_the_bad_input_cases_under_addresssanitizer`` starts it, with libasan preloaded, since
Python itself is not instrumented): each bad call must end in its clean Python error, each good one in the brute
force's result, and ASan must report nothing. Usage: ``python -m tests.native_asan LIBRARY``."""

from __future__ import annotations

import sys

import torch

from pipeline.pooling import native
from pipeline.pooling.clustering import SWAP_RTOL
from tests import reference as ref
from tests.test_native import _bad_calls, _case, _gram


def main(path: str) -> int:
    lib = native.load(path)
    refused = 0
    for what, call, error, _ in _bad_calls(lib):
        try:
            call()
        except (ValueError, TypeError, IndexError) as err:
            assert error is not None and isinstance(err, error), (what, err)
            refused += 1
        else:
            assert error is None, f"{what}: not refused"
    p = lambda t: t.data_ptr()  # noqa: E731
    n, m = 12, 4
    x, w, _ = _case(1, n, m, 3, "random", seed=31)
    x[0, 3] += 50.0  # far from every other token: the first of two equal medoids gets an empty cluster
    start, given = torch.tensor([[3, 7, 3]]), torch.tensor([[3, 7]])
    cols = torch.bmm(x[:, [3, 7]], x.transpose(1, 2))
    med, assign = torch.empty(1, 3, dtype=torch.int64), torch.empty(1, n, dtype=torch.int64)
    for keep in (1.0, 1.0 - SWAP_RTOL, 0.5, -0.5, 0.0, 2.0):  # rtol 0, the default, 0.5; then 1.5, 1, -1 (refused)
        rc = lib.kmedoids_f32(p(x), p(cols), p(given), p(w), p(start), p(med), p(assign), 1, n, m, 2, 3, 4, keep, 1)
        assert rc == (0 if 0 < keep <= 1 else -2), (keep, rc)
        assert rc or bool((med >= 0).all() and (med < n).all()), med
    for b, n, m, k in [(3, 30, 8, 7), (2, 49, 16, 12), (1, 10, 0, 3)]:
        x, w, start = _case(b, n, m, k, "random", seed=n)
        med, assign = native.kmedoids(lib, x, w, start, 4, SWAP_RTOL)
        kmeans = native.kmeans_gram(lib, _gram(x), w, start, 4)
        means = native.cluster_means(lib, x, w, kmeans, k, start)
        for s in range(b):
            f, ws = x[s].double().numpy(), w[s].double().numpy()
            assert (med[s].tolist(), assign[s].tolist()) == ref.kmedoids(f, ws, start[s].tolist(), 4)
            assert kmeans[s].tolist() == ref.kmeans(f, ws, start[s].tolist(), 4)
            for j, mean in enumerate(ref.cluster_means(f, ws, kmeans[s].tolist(), k)):
                want = x[s, start[s, j]].double() if mean is None else torch.from_numpy(mean)
                torch.testing.assert_close(means[s, j].double(), want, rtol=1e-5, atol=1e-5)
    print(f"refused {refused} bad calls, the C refused its own, the good ones matched the brute force")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
