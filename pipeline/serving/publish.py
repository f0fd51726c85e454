"""Finetuned models into the MLflow Model Registry as image classifiers (``pipeline.serving.model``), so that a
Pareto pick loads with ``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` and serves with ``pipeline serve``.

The network is the whole ``nn.Module``, pickled (the pooled blocks are this package's classes), with this
package as ``code_paths`` so that a fresh process that never imports the training code can unpickle it:
load models only from a store you trust.
"""

from __future__ import annotations

import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import cloudpickle
import mlflow
import numpy as np
from mlflow.tracking import MlflowClient

from pipeline.errors import InputError
from pipeline.tracking import log_batch

MODEL_ARTIFACT = "model"
ONNX_ARTIFACT = "onnx-model"
# On the finetune run: its logged image classifiers (torch, ONNX), for idempotent reruns.
MODEL_URI_TAG = "pipeline.classifier_uri"
ONNX_URI_TAG = "pipeline.onnx_classifier_uri"
ONNX_SUFFIX = "-onnx"  # the registered model of the ONNX classifiers: NAME-onnx, with NAME's aliases
SERVING_TAG, SERVING = "pipeline.serving", "image-classifier"  # on a registered version: what `pipeline serve` serves
PACKAGE = Path(__file__).resolve().parents[1]
ENTRY = Path(__file__).resolve().with_name("entry.py")  # the pyfunc, as models-from-code
ENTRY_ONNX = Path(__file__).resolve().with_name("entry_onnx.py")  # the ONNX classifier's


def pip_requirements(onnx: bool = False) -> list[str]:
    """The packages the served model needs, at the versions installed here: the ONNX classifier's need no torch."""

    names = ("onnxruntime", "pydantic") if onnx else ("torch", "torchvision", "timm")
    return [f"{name}=={version(name).split('+')[0]}" for name in (*names, "mlflow", "numpy", "pandas", "pillow")]


def model_config(model, classes: list[str]) -> dict[str, Any]:
    """What the served model needs besides its weights: the class names and timm's data config."""
    from pipeline.models import data_config

    data = data_config(model)
    keys = ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode")
    return {"classes": list(classes), **{key: data[key] for key in keys if key in data}}


def _dataset(config, model) -> tuple[list[str], bytes]:
    """The class names and the first validation image (JPEG, at the model's input size) of the data a
    checkpoint was trained on."""
    from pipeline.data.loaders import read_metadata, read_pixels
    from pipeline.models import data_config
    from pipeline.serving.model import encode_jpeg

    classes = read_metadata(config.data.train)["classes"]
    first = next(read_pixels(config.data.val, data_config(model)["input_size"][-1], 1.0, count=1, batch=1))[0]
    return classes, encode_jpeg(first)


def _classifier_parts(checkpoint: str):
    """What both classifiers of a checkpoint are logged with: (its model, its config, the class names, the signature,
    the input example)."""
    from pipeline.serving.model import signature_and_example
    from pipeline.train.checkpoint import model_from_checkpoint

    model, config, _ = model_from_checkpoint(checkpoint)
    classes, example = _dataset(config, model)
    signature, input_example = signature_and_example(example, len(classes))
    return model, config, classes, signature, input_example


def log_model(tracking_uri: str, run_id: str, checkpoint: str, metadata: dict[str, Any]) -> str:
    """Logs the checkpoint's model as an image classifier on ``run_id`` (once; a rerun reuses it).

    Returns its model URI (``models:/m-...``).
    """
    import torch

    client = MlflowClient(tracking_uri=tracking_uri)
    logged = client.get_run(run_id).data.tags.get(MODEL_URI_TAG)
    if logged is not None:
        return logged
    model, _, classes, signature, input_example = _classifier_parts(checkpoint)
    mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp, mlflow.start_run(run_id=run_id):
        # cloudpickle, as mlflow.pytorch pickles: the pooled blocks hold closures (their built operators).
        torch.save(model, Path(tmp) / "model.pt", pickle_module=cloudpickle)
        info = mlflow.pyfunc.log_model(
            name=MODEL_ARTIFACT, python_model=str(ENTRY), artifacts={"model": str(Path(tmp) / "model.pt")},
            model_config=model_config(model, classes), code_paths=[str(PACKAGE)], signature=signature,
            input_example=input_example, pip_requirements=pip_requirements(), metadata=metadata)
    log_batch(client, run_id, tags={MODEL_URI_TAG: info.model_uri})
    return info.model_uri


def log_onnx_model(tracking_uri: str, run_id: str, checkpoint: str, metadata: dict[str, Any], *,
                   check_images: int = 64) -> str:
    """Logs the checkpoint's model exported to ONNX (``pipeline.export``, dynamic batch) as an image classifier
    that runs in ONNX Runtime (``serving.model.OnnxImageClassifier``) on ``run_id``, once. The export is checked
    against torch on the first ``check_images`` validation images first (an ExportError if it differs).

    Returns its model URI (``models:/m-...``)."""
    from pipeline.export import ExportError, check_onnx, export_onnx
    from pipeline.serving.model import check_eval_transform, eval_pixels

    client = MlflowClient(tracking_uri=tracking_uri)
    logged = client.get_run(run_id).data.tags.get(ONNX_URI_TAG)
    if logged is not None:
        return logged
    model, config, classes, signature, input_example = _classifier_parts(checkpoint)
    served = model_config(model, classes)
    try:
        check_eval_transform(served)
    except ValueError as err:
        raise ExportError(f"{checkpoint}: {err}") from None
    images = _check_images(config, served, check_images, eval_pixels)
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(model, Path(tmp) / "model.onnx", label=checkpoint)
        check = check_onnx(model, path, images, label=checkpoint)
        if not check.passed:
            raise ExportError(f"{checkpoint}: the export's logits differ from torch's ({check.line()})")
        mlflow.set_tracking_uri(tracking_uri)
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=ONNX_ARTIFACT, python_model=str(ENTRY_ONNX), artifacts={"onnx": str(path)}, model_config=served,
                code_paths=[str(PACKAGE)], signature=signature, input_example=input_example,
                pip_requirements=pip_requirements(onnx=True),
                metadata={**metadata, "onnx_check": check.line(), "runtime": "onnxruntime"})
    log_batch(client, run_id, tags={ONNX_URI_TAG: info.model_uri})
    return info.model_uri


def _check_images(config, served: dict[str, Any], count: int, preprocess):
    """The first ``count`` validation images of a checkpoint's data, as the ONNX classifier preprocesses them
    (decoded pixels through ``preprocess``) -> (B, 3, R, R) float32 tensor."""
    import torch
    from PIL import Image

    from pipeline.data.loaders import check_dataset, read_pixels

    count = min(count, int(check_dataset(config.data.val)["num_images"]))
    if count < 1:
        raise InputError(f"{config.data.val} holds no images to check the ONNX export on")
    side = served["input_size"][-1]
    pixels = np.concatenate(list(read_pixels(config.data.val, side, 1.0, count=count, batch=count)))
    return torch.from_numpy(np.stack([preprocess(Image.fromarray(p), served) for p in pixels]))
