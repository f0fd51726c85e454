"""The ONNX classifier's code, as MLflow's models-from-code logs it (``entry.py``'s twin): it names
``pipeline.serving.model.OnnxImageClassifier``, which runs the exported network in ONNX Runtime."""

import mlflow

from pipeline.serving.model import OnnxImageClassifier

mlflow.models.set_model(OnnxImageClassifier())
