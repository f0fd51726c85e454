"""The stage DAG: base -> K search -> finetune sweep (Ray Tune) -> evaluate -> select, recorded in MLflow."""

from pipeline.dag.plan import count_plan
from pipeline.dag.runner import run_experiment

__all__ = ["count_plan", "run_experiment"]
