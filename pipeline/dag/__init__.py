"""The stage DAG: base -> K search -> finetune sweep (Ray Tune) -> evaluate -> select, recorded in MLflow.

No imports here: `pipeline.dag.plan` (stage identities) must load without torch, Ray or MLflow, for
`jobs/submit.py`; the runner is `pipeline.dag.runner.run_experiment`.
"""
