"""Finetuned models as MLflow models: what the Model Registry holds, so that a Pareto pick loads with
``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` and serves with ``mlflow models serve``.

The model is the whole ``nn.Module`` pickled by ``mlflow.pytorch`` (``serialization_format="pickle"``:
the pooled blocks are this package's classes), with this package as ``code_paths`` so that a fresh
process that never imports the training code can unpickle it. Input: float32 images (B, 3, H, W),
normalised as the model's data config says; output: logits (B, classes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from pipeline.tracking import log_batch

MODEL_ARTIFACT = "model"
MODEL_URI_TAG = "pipeline.model_uri"  # on the finetune run: its logged MLflow model, for idempotent reruns
PACKAGE = Path(__file__).resolve().parent
# mlflow.pytorch warns at every pickled model that unpickling runs code; the choice is deliberate (the
# module docstring), so the select stage says it once in its registry line instead of once per model.
_PICKLE_WARNING = "Saving pytorch model by Pickle"


def _not_the_pickle_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_PICKLE_WARNING)


def pip_requirements() -> list[str]:
    """The packages the pickled model needs, at the versions installed here."""
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in ("torch", "timm", "mlflow", "numpy")]


def example_batch(model, images: int = 1):
    """A fixed (images, 3, H, W) float32 batch at the model's input size (seeded, reproducible)."""
    import torch

    from pipeline.models import data_config

    size = data_config(model)["input_size"]
    return torch.randn(images, *size, generator=torch.Generator().manual_seed(0))


def log_model(tracking_uri: str, run_id: str, checkpoint: str, metadata: dict[str, Any]) -> str:
    """Logs the checkpoint's model as an MLflow model on ``run_id`` (once; a rerun reuses it).

    Returns its model URI (``models:/m-...``).
    """
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from pipeline.train.checkpoint import model_from_checkpoint

    client = MlflowClient(tracking_uri=tracking_uri)
    logged = client.get_run(run_id).data.tags.get(MODEL_URI_TAG)
    if logged is not None:
        return logged
    model, _, _ = model_from_checkpoint(checkpoint)
    inputs = example_batch(model)
    with torch.no_grad():
        outputs = model(inputs)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow_logger = logging.getLogger("mlflow.pytorch")
    mlflow_logger.addFilter(_not_the_pickle_warning)
    try:
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(
                model, name=MODEL_ARTIFACT, serialization_format="pickle", code_paths=[str(PACKAGE)],
                signature=infer_signature(inputs.numpy(), outputs.numpy()), input_example=inputs.numpy(),
                pip_requirements=pip_requirements(), metadata=metadata)
    finally:
        mlflow_logger.removeFilter(_not_the_pickle_warning)
    log_batch(client, run_id, tags={MODEL_URI_TAG: info.model_uri})
    return info.model_uri
