"""Training on Ray Train: the DeiT recipe, the K search, method finetunes, checkpoints and MLflow."""

from pipeline.train.launch import TrainResult, preflight, run_training

__all__ = ["TrainResult", "preflight", "run_training"]
