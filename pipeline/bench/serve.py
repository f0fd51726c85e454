"""``pipeline bench serve``: a bounded load test of a running scoring server (``pipeline serve``).

``clients`` threads each send the same image back to back for ``seconds``; every answer is kept, so that
the run says whether the server answered every request and whether all answers were the same. Only the
standard library speaks HTTP here, as a plain client would.
"""

from __future__ import annotations

import base64
import collections
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadResult:
    clients: int
    seconds: float  # wall time of the whole run
    latencies: list[float]  # seconds, of the answered requests
    errors: collections.Counter  # "HTTP 400", "URLError: ..." -> count
    answers: collections.Counter  # the body of each 200 answer -> count

    @property
    def requests(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def median(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")

    def as_dict(self) -> dict:
        return {"clients": self.clients, "seconds": round(self.seconds, 3), "requests": self.requests,
                "requests_per_s": round(self.requests / self.seconds, 2),
                "p50_ms": round(1e3 * self.median(), 2), "p99_ms": round(1e3 * self.percentile(0.99), 2),
                "errors": dict(self.errors), "distinct_answers": len(self.answers),
                "answer": json.loads(next(iter(self.answers))) if len(self.answers) == 1 else None}


def request_body(image: bytes, top_k: int) -> bytes:
    """The JSON a client sends for one encoded image."""
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(image).decode()]]},
                       "params": {"top_k": top_k}}).encode()


def _client(url: str, body: bytes, deadline: float, result: LoadResult, lock: threading.Lock) -> None:
    while time.perf_counter() < deadline:
        request = urllib.request.Request(f"{url}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                answer = response.read().decode()
            with lock:
                result.latencies.append(time.perf_counter() - start)
                result.answers[answer] += 1
        except urllib.error.HTTPError as err:
            with lock:
                result.errors[f"HTTP {err.code}"] += 1
        except (urllib.error.URLError, OSError) as err:
            with lock:
                result.errors[f"{type(err).__name__}: {err}"] += 1


def load_test(url: str, image: bytes, *, clients: int, seconds: float, top_k: int = 3) -> LoadResult:
    """``clients`` concurrent clients for ``seconds``, each sending ``image`` and waiting for the answer."""
    body, lock = request_body(image, top_k), threading.Lock()
    result = LoadResult(clients, 0.0, [], collections.Counter(), collections.Counter())
    start = time.perf_counter()
    threads = [threading.Thread(target=_client, args=(url, body, start + seconds, result, lock))
               for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LoadResult(clients, time.perf_counter() - start, result.latencies, result.errors, result.answers)


def format_load(url: str, result: LoadResult) -> str:
    d = result.as_dict()
    errors = ", ".join(f"{k}: {v}" for k, v in d["errors"].items()) or "none"
    return (f"{url}: {d['clients']} client(s) for {d['seconds']:.1f} s: {d['requests']} requests, "
            f"{d['requests_per_s']:.1f} requests/s, p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms; "
            f"errors: {errors}; "
            f"{d['distinct_answers']} distinct answer(s)")
