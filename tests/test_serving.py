"""``pipeline serve`` on a real process: a tiny trained model registered as an image classifier, served from a
shell without the virtual environment on its PATH, answering images with class names as the model in this
process does, refusing bad input with HTTP 400 (decompression bombs, images over the pixel cap and requests
with too many images included) and bodies over the cap with 413, staying up, and holding a bounded load.

Every test of a server runs twice: on the registered torch classifier, and with ``--runtime onnxruntime`` on its
ONNX twin (``tiny-serve-onnx``, the same network exported), whose process decodes and preprocesses in PIL and numpy
and runs the network in onnxruntime. Both are held to the torch model in this process, with timm's transform."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from pipeline.config import load_config
from pipeline.data import open_source, write_folder
from tests.processes import ROOT, free_port, stop

TINY = ROOT / "configs" / "train" / "tiny_synthetic.yaml"
NAME = "tiny-serve"
# The served process's limits: small, so that small requests cross them (the defaults are far above).
MAX_IMAGES, MAX_PIXELS, MAX_BODY_MB = 6, 2_000_000, 1


@pytest.fixture(scope="module")
def trained(synthetic_data, tmp_path_factory) -> dict:
    """A tiny model trained one epoch, logged and registered as ``tiny-serve@best`` and, exported to ONNX, as
    ``tiny-serve-onnx@best``, as the select stage does."""
    from pipeline.serving.publish import ONNX_SUFFIX, SERVING, SERVING_TAG, log_model, log_onnx_model
    from pipeline.train import run_training
    from pipeline.train.checkpoint import model_from_checkpoint

    root, data = tmp_path_factory.mktemp("serve"), synthetic_data(128, 32)
    store = f"sqlite:///{root / 'mlflow.db'}"
    config = load_config(TINY, [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                                "train.workers=0", f"train.storage_path={root / 'ray'}", f"train.tracking_uri={store}",
                                f"train.artifact_root={root / 'artifacts'}", "recipe.epochs=1", "train.name=serve"])
    result = run_training(config)
    client = MlflowClient(tracking_uri=store)
    for name, log in ((NAME, log_model), (NAME + ONNX_SUFFIX, log_onnx_model)):
        uri = log(store, result.run_id, result.checkpoint, {"method": "none"})
        client.create_registered_model(name)
        version = client.create_model_version(name, uri, run_id=result.run_id, tags={SERVING_TAG: SERVING},
                                              model_id=uri.rsplit("/", 1)[-1]).version
        client.set_registered_model_alias(name, "best", version)
    write_folder(open_source("synthetic:classes=4,count=8,size=16,seed=1"), root / "jpegs", size=None,
                 log=lambda _: None)
    model, _, _ = model_from_checkpoint(result.checkpoint)
    return {"root": root, "store": store, "model": model, "jpegs": sorted((root / "jpegs").rglob("*.jpg"))}


def expected(model, images: list[Image.Image]) -> torch.Tensor:
    """Class probabilities of the model in this process: the pixels, normalised as its data config says."""
    from timm.data import create_transform, resolve_model_data_config

    transform = create_transform(**resolve_model_data_config(model), is_training=False)
    with torch.no_grad():
        return model(torch.stack([transform(image.convert("RGB")) for image in images])).softmax(-1)


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def server(trained, request):
    """``python -m pipeline serve tiny-serve@best --runtime RUNTIME`` with a PATH that lacks the virtual
    environment."""
    port, log = free_port(), trained["root"] / f"serve-{request.param}.log"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pipeline", "serve", f"{NAME}@best", "--port", str(port),
               "--tracking-uri", trained["store"], "--max-images", str(MAX_IMAGES), "--max-pixels", str(MAX_PIXELS),
               "--max-body-mb", str(MAX_BODY_MB), "--runtime", request.param]
    proc = subprocess.Popen(command, cwd=trained["root"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and "send an image:" not in log.read_text() and proc.poll() is None:
        time.sleep(0.5)
    text = log.read_text()
    assert "send an image:" in text, text[-3000:]
    yield {"url": f"http://127.0.0.1:{port}", "log": log, "proc": proc, "text": text, "runtime": request.param}
    stop(proc, grace=20)


def scoring_process(proc: subprocess.Popen) -> int:
    """The pid of the uvicorn process `pipeline serve` started (its one child: the scoring app runs in it)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_the_onnx_server_runs_without_torch_and_the_torch_server_with_it(server):
    """What the ONNX classifier is for: its scoring process never loads torch's library (read from the process's
    memory maps after it answered), where the torch classifier's does."""
    status, _ = post(server["url"], {"inputs": {"image": [np.zeros((8, 8, 3), dtype=np.uint8).tolist()]}})
    assert status == 200
    maps = Path(f"/proc/{scoring_process(server['proc'])}/maps").read_text()
    assert ("libtorch_cpu" in maps) == (server["runtime"] == "torch")
    assert ("onnxruntime" in maps) == (server["runtime"] == "onnxruntime")


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def images_payload(encoded: list[bytes], top_k: int = 3) -> dict:
    return {"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(b).decode()] for b in encoded]},
            "params": {"top_k": top_k}}


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def check_answers(answers: list[dict], probs: torch.Tensor, classes: list[str], top_k: int = 3) -> None:
    values, indices = probs.topk(top_k, dim=-1)
    assert len(answers) == len(probs)
    for answer, value, index in zip(answers, values.tolist(), indices.tolist()):
        assert [c["index"] for c in answer["top_k"]] == index
        assert [c["label"] for c in answer["top_k"]] == [classes[i] for i in index]
        np.testing.assert_allclose([c["probability"] for c in answer["top_k"]], value, rtol=1e-5, atol=1e-6)
        assert (answer["index"], answer["label"]) == (index[0], classes[index[0]])


CLASSES = [f"class_{i:03d}" for i in range(4)]  # the synthetic source's class names, from the dataset metadata


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_the_printed_curl_line_sends_an_image_and_gets_class_names(server):
    curl = re.search(r"^  (curl .+)$", server["text"], flags=re.M).group(1)
    assert curl.startswith(f"curl -s {server['url']}/invocations ")
    answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, check=True,
                                       timeout=60).stdout)
    assert answer["predictions"][0]["label"] in CLASSES and len(answer["predictions"][0]["top_k"]) == 3


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_jpegs_are_answered_as_the_model_in_this_process_answers(trained, server):
    files = trained["jpegs"][:4]
    status, body = post(server["url"], images_payload([f.read_bytes() for f in files]))
    assert status == 200, body
    check_answers(body["predictions"], expected(trained["model"], [Image.open(f) for f in files]), CLASSES)


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_png_grayscale_and_large_images(trained, server):
    picture = Image.open(trained["jpegs"][0]).convert("RGB")
    gray = picture.convert("L")
    large = picture.resize((1600, 1200), Image.BICUBIC)
    status, body = post(server["url"], images_payload([encode(picture, "PNG"), encode(gray, "PNG"),
                                                       encode(large, "JPEG")]))
    assert status == 200, body
    large_decoded = Image.open(io.BytesIO(encode(large, "JPEG")))
    check_answers(body["predictions"], expected(trained["model"], [picture, gray, large_decoded]), CLASSES)


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_uint8_arrays_and_the_normalised_tensors_of_earlier_clients(trained, server):
    picture = Image.open(trained["jpegs"][1]).convert("RGB")
    pixels, gray = np.asarray(picture), np.asarray(picture.convert("L"))  # (H, W, 3) and (H, W)
    status, body = post(server["url"], {"inputs": {"image": [pixels.tolist(), gray.tolist()]},
                                        "params": {"top_k": 3}})
    assert status == 200, body
    check_answers(body["predictions"], expected(trained["model"], [picture, picture.convert("L")]), CLASSES)
    from timm.data import create_transform, resolve_model_data_config

    tensor = create_transform(**resolve_model_data_config(trained["model"]), is_training=False)(picture)
    status, body = post(server["url"], {"inputs": [tensor.tolist()], "params": {"top_k": 3}})
    assert status == 200, body
    check_answers(body["predictions"], expected(trained["model"], [picture]), CLASSES)


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_a_tensor_style_body_of_base64_images_is_answered(trained, server):
    """``{"inputs": [BASE64, ...]}``, as MLflow users send it to a served model (MLflow hands it over as one row
    holding the list), and the same list as ``instances`` or as the ``image`` column: one answer per string."""
    files = trained["jpegs"][:3]
    encoded = [base64.b64encode(f.read_bytes()).decode() for f in files]
    probs = expected(trained["model"], [Image.open(f) for f in files])
    for body in ({"inputs": encoded}, {"instances": encoded}, {"inputs": {"image": encoded}}):
        status, answer = post(server["url"], {**body, "params": {"top_k": 3}})
        assert status == 200, (body.keys(), answer)
        check_answers(answer["predictions"], probs, CLASSES)
    status, answer = post(server["url"], {"inputs": encoded[:1]})  # one image and no params, as first tried
    assert status == 200, answer
    check_answers(answer["predictions"], probs[:1], CLASSES, top_k=min(5, len(CLASSES)))


def png_1bit(width: int, height: int, truncate: bool = False) -> bytes:
    """A black 1-bit grayscale PNG, written chunk by chunk: a large one is small on disk (its rows compress to
    almost nothing). ``truncate`` cuts the compressed pixels in half, so that decoding it fails."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([1, 0, 0, 0, 0])  # 1 bit, grayscale
    pixels = zlib.compress((b"\0" * (1 + (width + 7) // 8)) * height, 9)  # filter byte + packed row, per row
    if truncate:
        pixels = pixels[: len(pixels) // 2]
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


BOMB = (15000, 15000)  # 225 MP: over PIL's own decompression-bomb error limit (2 x 89.5 MP)
OVER_CAP = (2000, 1200)  # 2.4 MP: over the served cap, under PIL's limits


BAD = [
    (lambda _: images_payload([png_1bit(*BOMB)]), "image 0: a decompression bomb"),
    # The second image is broken past its header: the refusal names its size, so it came before any decoding.
    (lambda jpeg: images_payload([jpeg, png_1bit(*OVER_CAP, truncate=True)]),
     f"image 1: 2000 x 1200 pixels, over the cap of {MAX_PIXELS:,} per image"),
    # None is an image: the count is refused before the first would be found not to be one.
    (images_payload([b"not an image"] * (MAX_IMAGES + 1)), f"{MAX_IMAGES + 1} images in one request, over the cap"),
    (images_payload([b"just some text, not an image"]), "image 0: not an image file"),
    (lambda jpeg: images_payload([jpeg[: len(jpeg) // 2]]), "image 0: a broken image file"),
    ({"dataframe_split": {"columns": ["image"], "data": [["%%% not base64 %%%"]]}}, "a string that is not base64"),
    ({"dataframe_split": {"columns": ["image"], "data": []}}, "no images; send at least one"),
    # A tensor-style body's strings are images each: counted as images, and each checked as one.
    ({"inputs": ["not an image"] * (MAX_IMAGES + 1)}, f"{MAX_IMAGES + 1} images in one request, over the cap"),
    (lambda jpeg: {"inputs": [base64.b64encode(jpeg).decode(), "%%% not base64 %%%"]},
     "image 1: a string that is not base64"),
    ({"inputs": {"image": [[[0.5, 0.2], [0.1, 0.3]]]}}, "image 0: a float array of shape (2, 2)"),
    ({"inputs": {"image": [[[[1, 2, 3, 4, 5]]]]}}, "image 0: an array of shape (1, 1, 5)"),
    ({"inputs": {"image": [[[300, 2], [1, 2]]]}}, "pixel values from 1 to 300"),
    (lambda jpeg: {**images_payload([jpeg]), "params": {"top_k": 99}}, "top_k 99: give 1 to 4"),
]


@pytest.mark.beton  # the module fixture `trained` trains on a beton
@pytest.mark.parametrize(("payload", "says"), BAD, ids=[says.split(":")[0][:30] for _, says in BAD])
def test_bad_input_gets_400_with_one_line_and_the_server_stays_up(trained, server, payload, says):
    jpeg = trained["jpegs"][0].read_bytes()
    status, body = post(server["url"], payload(jpeg) if callable(payload) else payload)
    assert status == 400 and says in body["message"], body
    assert "\n" not in body["message"] and "Failed to predict" not in body["message"], body
    status, body = post(server["url"], images_payload([jpeg]))
    assert status == 200 and body["predictions"][0]["label"] in CLASSES


def test_the_planted_images_are_what_their_tests_say():
    """The refusals above are the server's limits at work: PIL alone reads the bomb's header and refuses it, and
    fails to decode the image over the cap; the bomb is small on disk."""
    bomb = png_1bit(*BOMB)
    assert len(bomb) < 40_000
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(bomb))
    with Image.open(io.BytesIO(png_1bit(*OVER_CAP, truncate=True))) as over:
        assert over.size == OVER_CAP and over.size[0] * over.size[1] > MAX_PIXELS
        with pytest.raises(OSError):
            over.load()


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_as_many_images_as_the_cap_are_answered(trained, server):
    files = (trained["jpegs"] * MAX_IMAGES)[:MAX_IMAGES]
    status, body = post(server["url"], images_payload([f.read_bytes() for f in files]))
    assert status == 200, body
    check_answers(body["predictions"], expected(trained["model"], [Image.open(f) for f in files]), CLASSES)


def raw_post(url: str, declared: int | None, chunks: list[bytes]) -> tuple[int, dict]:
    """POST /invocations with a declared Content-Length (sending none of the body) or, with ``declared=None``,
    the ``chunks`` in chunked encoding."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        connection.putrequest("POST", "/invocations")
        connection.putheader("Content-Type", "application/json")
        if declared is not None:
            connection.putheader("Content-Length", str(declared))
            connection.endheaders()
        else:
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            for piece in chunks:
                connection.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            connection.send(b"0\r\n\r\n")
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_a_body_over_the_cap_gets_413_with_one_line_and_the_server_stays_up(trained, server):
    cap = MAX_BODY_MB * 2**20
    # A client that sends its whole body before it reads (urllib): read to its end, then refused.
    status, body = post(server["url"], {"pad": " " * cap})
    assert status == 413 and f"a request body of {cap + 11:,} bytes, over this server's cap of 1 MiB" \
        in body["message"], body
    assert "\n" not in body["message"], body
    status, body = raw_post(server["url"], None, [b" " * 2**16] * (cap // 2**16 + 1))  # chunked: no length declared
    assert status == 413 and f"{cap + 2**16:,} bytes, over this server's cap" in body["message"], body
    # Declared far over the cap: refused on its header, before a byte of it is sent.
    status, body = raw_post(server["url"], 100 * cap, [])
    assert status == 413 and f"a request body of {100 * cap:,} bytes" in body["message"], body
    jpeg = trained["jpegs"][0].read_bytes()
    status, body = raw_post(server["url"], None, [json.dumps(images_payload([jpeg])).encode()])  # under it: answered
    assert status == 200 and body["predictions"][0]["label"] in CLASSES, body


def test_serve_refuses_limits_it_cannot_keep(capsys):
    from pipeline.cli import main

    assert main(["serve", "x@best", "--max-pixels", "100000000", "--max-images", "0"]) == 2
    error = capsys.readouterr().err
    assert "--max-pixels 100000000: 100000000 is over PIL's decompression-bomb limit" in error
    assert "--max-images 0: Input should be greater than or equal to 1" in error


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_a_bounded_load_is_answered_without_errors_and_always_alike(trained, server):
    image = trained["jpegs"][2]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "bench", "serve", "--url", server["url"], "--image",
                           str(image), "--clients", "4", "--seconds", "3", "--json"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["errors"] == {} and result["requests"] > 4 and result["distinct_answers"] == 1, result
    check_answers(result["answer"]["predictions"], expected(trained["model"], [Image.open(image)]), CLASSES)
    assert result["p99_ms"] >= result["p50_ms"] > 0


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_serve_refuses_what_it_cannot_serve(trained):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    for args, says in ((["nope@best"], "models:/nope@best: no such model"),
                       (["nope@best", "--runtime", "onnxruntime"], "experiment.register_onnx: true"),
                       ([str(trained["root"]), "--runtime", "onnxruntime"],
                        "--runtime onnxruntime serves a registered"),
                       (["a b c"], "give a registered model as NAME@ALIAS"),
                       (["--experiment", "demo"], "--experiment needs a budget")):
        proc = subprocess.run([sys.executable, "-m", "pipeline", "serve", *args, "--tracking-uri", trained["store"],
                               "--port", str(free_port())], cwd=trained["root"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("config", [
    {"input_size": (3, 224, 224), "interpolation": "bicubic", "crop_pct": 0.875, "mean": (0.485, 0.456, 0.406),
     "std": (0.229, 0.224, 0.225), "crop_mode": "center"},  # DeiT's
    {"input_size": (3, 28, 28), "interpolation": "bilinear", "crop_pct": 1.0, "mean": (0.5, 0.5, 0.5),
     "std": (0.5, 0.5, 0.5), "crop_mode": "center"},
    {"input_size": (3, 32, 32), "interpolation": "lanczos", "crop_pct": 0.9, "mean": (0.2, 0.3, 0.4),
     "std": (0.3, 0.2, 0.1)},
])
def test_the_torch_free_preprocessing_is_timms_evaluation_transform(config):
    """``eval_pixels`` (PIL and numpy) against timm's own transform (torchvision), on wide, tall, square, small and
    odd-sized images: the same float32 values."""
    from timm.data import create_transform

    from pipeline.serving.model import check_eval_transform, eval_pixels

    check_eval_transform(config)
    transform = create_transform(**config, is_training=False)
    rng = np.random.default_rng(0)
    for height, width in ((300, 451), (451, 300), (256, 256), (28, 28), (33, 97), (224, 224)):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        np.testing.assert_allclose(eval_pixels(image, config), transform(image).numpy(), rtol=0, atol=1e-6)


def test_the_torch_free_preprocessing_refuses_what_it_does_not_do():
    from pipeline.serving.model import check_eval_transform

    base = {"input_size": (3, 32, 32), "interpolation": "bicubic", "crop_pct": 0.9, "mean": (0.5,) * 3,
            "std": (0.5,) * 3}
    for change, says in (({"crop_mode": "squash"}, "crop_mode 'squash'"), ({"input_size": (3, 32, 48)}, "(3, 32, 48)"),
                         ({"interpolation": "random"}, "interpolation 'random'"), ({"crop_pct": 1.1}, "crop_pct 1.1")):
        with pytest.raises(ValueError, match=re.escape(says)):
            check_eval_transform({**base, **change})


def test_the_onnx_runtime_serves_the_twin_of_an_alias_and_refuses_what_has_none(tmp_path):
    from pipeline.errors import InputError
    from pipeline.serving.server import onnx_model

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert onnx_model("token-pooling-demo@best", store) == "models:/token-pooling-demo-onnx@best"
    assert onnx_model("models:/token-pooling-demo@pareto-2", store) == "models:/token-pooling-demo-onnx@pareto-2"
    assert onnx_model("token-pooling-demo-onnx@best", store) == "models:/token-pooling-demo-onnx@best"
    for given in ("runs:/abc/checkpoint", str(tmp_path), "file:///x"):
        with pytest.raises(InputError, match="--runtime onnxruntime serves a registered model"):
            onnx_model(given, store)
    for given in ("token-pooling-demo", "token-pooling-demo@", "token-pooling-demo/"):
        with pytest.raises(InputError, match="give a registered model as NAME@ALIAS or NAME/VERSION"):
            onnx_model(given, store)


@pytest.mark.beton  # the module fixture `trained` trains on a beton
def test_a_registered_version_finds_its_onnx_twin_by_its_run(trained):
    from pipeline.errors import MissingFileError
    from pipeline.serving.server import onnx_model

    assert onnx_model(f"{NAME}/1", trained["store"]) == f"models:/{NAME}-onnx/1"
    with pytest.raises(MissingFileError, match="no such model version"):
        onnx_model(f"{NAME}/7", trained["store"])
