"""Stage records in MLflow: how the DAG knows what already finished, and what it produced.

A stage is done when an MLflow run carries ``pipeline.stage_id = ID`` and ``pipeline.done = 1``;
its result (checkpoint, keep list, metrics) is the JSON tag ``pipeline.result``. The record is
written only after the stage's work is complete, so a stage killed halfway is simply rerun (its
training resumes from Ray's checkpoints), and each stage id is counted once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mlflow.tracking import MlflowClient

from pipeline.config.identity import IDENTITY_VERSION
from pipeline.errors import InputError
from pipeline.tracking import RUN_KEY_TAG, experiment_id, log_batch

STAGE_ID = "pipeline.stage_id"
STAGE_KIND = "pipeline.stage"
DONE = "pipeline.done"
RESULT = "pipeline.result"
DAG = "pipeline.dag"
IDENTITY_TAG = "pipeline.identity_version"  # on a DAG's parent run and its stage runs: ``IDENTITY_VERSION``
# On a DAG's parent run: experiment.select.tie_margin as configured, and the relative margin the speed front used.
TIE_MARGIN_CHOICE, TIE_MARGIN = "pipeline.tie_margin_choice", "pipeline.tie_margin"
TRAINED_RUN = "pipeline.trained_run"  # on an evaluate run: the finetune run of its model (or the base's, below)
FINETUNED = "pipeline.finetuned"  # "false" on an evaluate run of a base with a method inserted (no_finetune)
# On an evaluate run: the model's latency measured against a table (the select stage, K-search targets), and the
# table's sha256.
LATENCY_METRIC, LATENCY_TABLE_TAG = "latency_ms", "pipeline.latency_table"
LATENCY_HIGH = "latency_ms_high"  # the ratio's 95% interval's upper end x the measured reference ms
LATENCY_PREDICTED = "latency_ms_predicted"  # the table's prediction at the model's keep list (not a measurement)
SCALED_RATE, RATE_LOW, RATE_HIGH = "images_per_s_scaled", "images_per_s_low", "images_per_s_high"  # the select stage's


def find_done(client: MlflowClient, exp_id: str, stage_id: str) -> tuple[dict[str, Any], str] | None:
    """The recorded result of a finished stage and the id of its run, or None."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{STAGE_ID}` = '{stage_id}' and tags.`{DONE}` = '1'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    return json.loads(runs[0].data.tags[RESULT]), runs[0].info.run_id


def mark_done(client: MlflowClient, run_id: str, *, stage_id: str, kind: str, result: dict[str, Any]) -> None:
    """Records the result on the stage's run; the ``done`` tag goes last."""
    log_batch(client, run_id, tags={STAGE_ID: stage_id, STAGE_KIND: kind, RESULT: json.dumps(result),
                                    IDENTITY_TAG: str(IDENTITY_VERSION)})
    client.set_tag(run_id, DONE, "1")


def supersede(client: MlflowClient, exp_id: str, dag_id: str, kinds: list[str]) -> int:
    """Retires this DAG's runs of ``kinds`` (for ``--force``): they are no longer found as done or resumed."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    count = 0
    for kind in kinds:
        query = f"tags.`{DAG}` = '{dag_id}' and tags.`{STAGE_KIND}` = '{kind}'"
        runs = client.search_runs([exp_id], filter_string=query,
                                  max_results=10000)
        for run in runs:
            tags = {DONE: "superseded"}
            if RUN_KEY_TAG in run.data.tags:
                tags[RUN_KEY_TAG] = f"{run.data.tags[RUN_KEY_TAG]}#superseded-{stamp}"
            log_batch(client, run.info.run_id, tags=tags)
            count += 1
    return count


def open_child(client: MlflowClient, exp_id: str, parent_id: str, *, name: str, kind: str, stage_id: str,
               dag_id: str) -> str:
    """A child run of the DAG's parent run, for stages that do not train (evaluate)."""
    tags = {"mlflow.parentRunId": parent_id, STAGE_KIND: kind, STAGE_ID: stage_id, DAG: dag_id,
            IDENTITY_TAG: str(IDENTITY_VERSION)}
    return client.create_run(exp_id, run_name=name, tags=tags).info.run_id


def open_parent(uri: str, experiment: str, artifact_root: str | None, dag_id: str, name: str
                ) -> tuple[MlflowClient, str, str]:
    """The parent run of this DAG (one per experiment config), reused by reruns; returns client, exp id, run id."""
    client = MlflowClient(tracking_uri=uri)
    exp_id = experiment_id(client, experiment, artifact_root)
    check_identity_version(client, exp_id, uri, experiment)
    runs = client.search_runs([exp_id], filter_string=f"tags.`{DAG}` = '{dag_id}' and tags.`{STAGE_KIND}` = 'dag'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if runs:
        run_id = runs[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {DAG: dag_id, STAGE_KIND: "dag", IDENTITY_TAG: str(IDENTITY_VERSION)}
        run_id = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    return client, exp_id, run_id


def check_identity_version(client: MlflowClient, exp_id: str, uri: str, experiment: str) -> None:
    """Refuses an MLflow experiment whose DAG runs were recorded under another ``IDENTITY_VERSION`` (a run
    without the tag is version 1, the only one before it): their stage ids are not this version's, so none
    would be reused and new records would sit beside them under the same experiment. Nothing is changed."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{STAGE_KIND}` = 'dag'", max_results=10000)
    other = sorted({run.data.tags.get(IDENTITY_TAG, "1") for run in runs} - {str(IDENTITY_VERSION)})
    if other:
        raise InputError(f"train.experiment {experiment!r} in {uri} holds stages recorded under identity version "
                         f"{', '.join(other)}; this pipeline's is {IDENTITY_VERSION}, whose stage ids differ, so none "
                         "of them would be reused: give a new train.experiment (or train.tracking_uri) and rerun")
