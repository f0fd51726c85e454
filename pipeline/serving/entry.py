"""The served model's code, as MLflow's models-from-code logs it: this file travels with the model and, run
at load time, names the pyfunc (``pipeline.serving.model.ImageClassifier``, importable through the model's
``code_paths``). Nothing is pickled but the network itself."""

import mlflow

from pipeline.serving.model import ImageClassifier

mlflow.models.set_model(ImageClassifier())
