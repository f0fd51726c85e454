"""Starts `pipeline serve token-pooling-demo@best` in each runtime, one after the other (after `make demo` with
experiment.register_onnx on): seconds to the first answer, the scoring process's peak RSS, whether it mapped torch,
and the answers to 16 real Fashion-MNIST test images.

    .venv/bin/python docs/data/cpu/2026-12-07_onnx/serve_compare.py > docs/data/cpu/2026-12-07_onnx/serve_compare.txt
"""

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.data.loaders import read_pixels
from pipeline.serving.model import encode_jpeg

ROOT = Path(__file__).resolve().parents[4]
STORE = f"sqlite:///{ROOT}/runs/mlflow.db"


def request_body() -> bytes:
    pixels = next(read_pixels(str(ROOT / "data/fmnist_test_2k.beton"), 28, 1.0, count=16, batch=16))
    rows = [[base64.b64encode(encode_jpeg(p)).decode()] for p in pixels]
    return json.dumps({"dataframe_split": {"columns": ["image"], "data": rows}, "params": {"top_k": 3}}).encode()


def first_answer(port: int, body: bytes) -> dict:
    while True:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(0.2)


def serve_once(runtime: str, port: int, body: bytes) -> list[tuple[str, float]]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "token-pooling-demo@best", "--port", str(port),
                             "--tracking-uri", STORE, "--runtime", runtime], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    answer = first_answer(port, body)
    ready = time.perf_counter() - start
    child = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    status = Path(f"/proc/{child}/status").read_text().splitlines()
    peak_kib = int(next(line for line in status if line.startswith("VmHWM")).split()[1])
    maps = Path(f"/proc/{child}/maps").read_text()
    print(f"{runtime}: first answer after {ready:.1f} s from `pipeline serve`; scoring process peak RSS "
          f"{peak_kib / 1024:.0f} MiB; torch mapped: {'libtorch_cpu' in maps}; "
          f"onnxruntime mapped: {'onnxruntime' in maps}")
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    return [(p["label"], p["probability"]) for p in answer["predictions"]]


def main() -> None:
    body = request_body()
    torch_answers = serve_once("torch", 5091, body)
    onnx_answers = serve_once("onnxruntime", 5092, body)
    same = sum(a[0] == b[0] for a, b in zip(torch_answers, onnx_answers))
    gap = max(abs(a[1] - b[1]) for a, b in zip(torch_answers, onnx_answers))
    print(f"labels equal on {same} of {len(torch_answers)} images; largest top-1 probability difference {gap:.2e}")
    print("torch:", [(label, round(p, 5)) for label, p in torch_answers[:4]])
    print("onnxruntime:", [(label, round(p, 5)) for label, p in onnx_answers[:4]])


if __name__ == "__main__":
    main()
