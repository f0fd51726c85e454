"""``pipeline serve``: a registered image classifier behind MLflow's scoring server, on this machine.

The server runs as ``python -m uvicorn pipeline.serving.app:app`` with this interpreter, so it works
whether or not the virtual environment is activated (``mlflow models serve`` starts ``uvicorn`` from the
``PATH``: "exec: uvicorn: not found" outside the venv). It binds to loopback unless told otherwise, and
prints its URL and a ``curl`` line that sends a real image once it answers.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pipeline.config.serve import ServeConfig
from pipeline.console import redact
from pipeline.errors import InputError, JobError, MissingFileError

DEFAULT_STORE = "sqlite:///runs/mlflow.db"
SERVE_DIR = Path("runs/serve")  # the downloaded models and their example images
_SHORT = re.compile(r"^[A-Za-z0-9_.-]+(@[A-Za-z0-9_.-]+|/\d+)$")  # NAME@ALIAS or NAME/VERSION


def model_uri(model: str) -> str:
    """``NAME@ALIAS`` or ``NAME/VERSION`` of the registry -> ``models:/...``; URIs and folders as they are."""
    if "://" in model or model.startswith(("models:/", "runs:/")) or Path(model).is_dir():
        return model
    if _SHORT.match(model):
        return f"models:/{model}"
    raise InputError(f"{model!r}: give a registered model as NAME@ALIAS (token-pooling-demo@best) or NAME/VERSION, "
                     "a models:/ or runs:/ URI, or a model folder")


RUNTIMES = ("torch", "onnxruntime")


def onnx_model(model: str, tracking_uri: str) -> str:
    """The ONNX classifier registered beside ``model`` (``experiment.register_onnx``): ``NAME@ALIAS`` ->
    ``NAME-onnx@ALIAS``; a version ``NAME/V`` (or ``models:/NAME/V``) -> the version of ``NAME-onnx`` logged on the same
    finetune run. InputError for anything else (a folder, a runs:/ URI), which has no ONNX twin to find."""
    from pipeline.serving.publish import ONNX_SUFFIX

    name = model.removeprefix("models:/")
    if "://" in name or name.startswith("runs:/") or Path(model).is_dir():
        raise InputError(f"{model}: --runtime onnxruntime serves a registered model (NAME@ALIAS or NAME/VERSION); "
                         "export a checkpoint with `python -m pipeline export` instead")
    registered, sep, rest = name.partition("@") if "@" in name else name.partition("/")
    if not sep or not rest:
        raise InputError(f"{model}: give a registered model as NAME@ALIAS or NAME/VERSION")
    if registered.endswith(ONNX_SUFFIX):
        return f"models:/{name}"
    if sep == "@":
        return f"models:/{registered}{ONNX_SUFFIX}@{rest}"
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_model_version(registered, rest).run_id
        twins = client.search_model_versions(f"name = '{registered}{ONNX_SUFFIX}' and run_id = '{run}'")
    except MlflowException as err:
        raise MissingFileError(f"{model}: no such model version ({str(err).splitlines()[0]})") from None
    if not twins:
        raise MissingFileError(f"{model} has no ONNX classifier registered beside it ({registered}{ONNX_SUFFIX}); "
                               "run the DAG with experiment.register_onnx: true")
    return f"models:/{registered}{ONNX_SUFFIX}/{twins[0].version}"


def fetch(uri: str, tracking_uri: str) -> Path:
    """The model's files in a local folder under ``SERVE_DIR`` (downloaded once per model version)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.tracking import store_missing

    if Path(uri).is_dir():
        return Path(uri)
    if store_missing(tracking_uri):
        raise MissingFileError(f"there is no MLflow store at {redact(tracking_uri)}; pass --tracking-uri, or run "
                               "`python -m pipeline run` first")
    mlflow.set_tracking_uri(tracking_uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar a file of the model's code
    try:
        info = mlflow.models.get_model_info(uri)
    except (MlflowException, OSError) as err:
        raise MissingFileError(f"{uri}: no such model in {redact(tracking_uri)} ({str(err).splitlines()[0]}); "
                               "`python -m pipeline select --experiment NAME --max-gflops X` names one") from None
    folder = SERVE_DIR / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{uri}-{info.model_uuid}")
    if not (folder / "MLmodel").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder))
    config = mlflow.models.Model.load(str(folder)).flavors.get("python_function", {}).get("config") or {}
    if "classes" not in config:
        raise InputError(f"{uri} is not an image classifier of this project (its pyfunc config names no classes); "
                         "serve a model that `python -m pipeline run` registered")
    return folder


def example_image(folder: Path) -> Path:
    """The model's input example (a validation image) as a JPEG beside the model, for the ``curl`` line."""
    target = folder / "example.jpg"
    if not target.is_file():
        example = json.loads((folder / "serving_input_example.json").read_text())
        target.write_bytes(base64.b64decode(example["dataframe_split"]["data"][0][0]))
    return target


def curl_line(url: str, image: Path, top_k: int = 3) -> str:
    body = ('{\\"dataframe_split\\": {\\"columns\\": [\\"image\\"], \\"data\\": [[\\"$(base64 -w0 ' + str(image)
            + ')\\"]]}, \\"params\\": {\\"top_k\\": ' + str(top_k) + '}}')
    return f"curl -s {url}/invocations -H 'Content-Type: application/json' -d \"{body}\""


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise JobError(f"the scoring server exited with status {process.returncode} before it answered; its "
                           "output is above")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    process.terminate()
    raise JobError(f"the scoring server did not answer {url}/ping within {timeout:.0f} s")


def start_server(model: str, *, host: str, port: int, workers: int, tracking_uri: str, verbose: bool,
                 limits: ServeConfig | None = None, runtime: str = "torch", log: Callable[[str], None] = print
                 ) -> tuple[subprocess.Popen, str, Path]:
    """Starts the scoring server of ``model`` within ``limits`` (default: ``ServeConfig()``; ``wait_ready``
    waits for it); returns the process, its URL and the model's local folder. ``runtime``: ``torch`` (the model
    itself) or ``onnxruntime`` (its ONNX classifier, ``onnx_model``)."""
    if workers < 1 or not 0 < port < 65536:
        raise InputError(f"--workers {workers} --port {port}: give at least one worker and a port in 1..65535")
    if runtime not in RUNTIMES:
        raise InputError(f"--runtime {runtime}: give one of {', '.join(RUNTIMES)}")
    uri = onnx_model(model, tracking_uri) if runtime == "onnxruntime" else model_uri(model)
    try:
        folder = fetch(uri, tracking_uri)
    except MissingFileError as err:
        if runtime != "onnxruntime":
            raise
        raise MissingFileError(f"{err}; an ONNX twin is registered by `pipeline run` with experiment.register_onnx: "
                               "true, or export one with `python -m pipeline export`") from None
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    command = [sys.executable, "-m", "uvicorn", "--host", host, "--port", str(port), "--workers", str(workers),
               "--log-level", "info" if verbose else "warning", "pipeline.serving.app:app"]
    from pipeline.serving.app import LIMITS_ENV, MODEL_ENV

    limits = limits or ServeConfig()
    env = {**os.environ, MODEL_ENV: str(folder.resolve()), LIMITS_ENV: limits.model_dump_json()}
    log(f"serving {uri} from {folder} on {host}:{port} ({workers} worker(s); per request at most "
        f"{limits.max_images} images of {limits.max_pixels:,} pixels and {limits.max_body_mb:g} MiB) ...")
    process = subprocess.Popen(command, env=env)
    return process, url, folder


def serve(model: str, *, host: str, port: int, workers: int, tracking_uri: str, verbose: bool,
          limits: ServeConfig | None = None, runtime: str = "torch", log: Callable[[str], None] = print) -> int:
    """Serves ``model`` within ``limits`` (default: ``ServeConfig()``) in ``runtime`` until interrupted; returns the
    server's exit status (0 after Ctrl-C)."""
    process, url, folder = start_server(model, host=host, port=port, workers=workers, tracking_uri=tracking_uri,
                                        verbose=verbose, limits=limits, runtime=runtime, log=log)
    try:
        wait_ready(url, process, timeout=300)
        log(f"ready: {url}  (POST {url}/invocations; GET {url}/ping; Ctrl-C stops it)")
        log("send an image:\n  " + curl_line(url, example_image(folder).resolve()))
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log("stopped")
        return 0
