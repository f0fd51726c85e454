"""MLflow tracking through ``MlflowClient`` (explicit run ids, no global active run, safe in Ray workers).

The default store is SQLite (MLflow 3.13+ refuses a plain ``./mlruns`` file store) with artifacts in
a local directory; on a cluster, a tracking server URI.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.console import redact
from pipeline.errors import PipelineError

RUN_KEY_TAG = "pipeline.run_key"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value


class TrackingError(PipelineError, RuntimeError):
    """The tracking store cannot be used; says which URI and how to fix it."""


def refuse_credentials(uri: str) -> None:
    """TrackingError for a URI that carries a user or password: they would be printed and logged with it."""
    if redact(uri) != uri:
        raise TrackingError(f"the tracking URI {redact(uri)} holds a user and password; give it without them and "
                            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials), "
                            "which MLflow reads and this project never prints")


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fails fast when a tracking server does not answer or refuses the credentials, or a SQLite store's
    folder cannot be created; creates nothing (``create_store`` does, once every check passed)."""
    refuse_credentials(uri)
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as response:
                if response.status != 200:
                    raise TrackingError(f"MLflow server {uri} answered {response.status} on /health")
        except (urllib.error.URLError, OSError) as err:
            raise TrackingError(f"MLflow tracking server {uri} is not reachable ({err}); start it, or "
                                "pass another --tracking-uri (the default is a local SQLite store)") from None
        check_credentials(uri)
    elif uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///"):]).parent
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise TrackingError(f"cannot create the MLflow SQLite store {uri}: {existing} is not a writable folder")
    elif uri.startswith(("file:", "./", "/")) or "://" not in uri:
        raise TrackingError(f"tracking URI {uri!r}: MLflow 3.13+ refuses a plain file store; use "
                            "sqlite:///PATH/mlflow.db or an http(s):// tracking server")


def store_missing(uri: str) -> bool:
    """A SQLite store that does not exist (reading it must not create it); servers count as present. Refuses
    a URI with credentials in it (``refuse_credentials``)."""
    refuse_credentials(uri)
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file()


def create_store(uri: str) -> None:
    """Creates a SQLite store's folder and schema, once, after every check passed: workers that open a
    fresh store together race on its migration. Servers need nothing."""
    if uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///"):]).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrackingError(f"cannot create the MLflow SQLite folder {folder}: {err}") from None
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def check_credentials(uri: str) -> None:
    """An authenticated read, so that a server with authentication (``mlflow server --app-name basic-auth``)
    refuses wrong or missing credentials here, before any compute. The password is never printed."""

    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except MlflowException as err:
        if err.error_code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            raise
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        who = f"user {user!r}" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
        verb = "refused the credentials of" if err.error_code == "UNAUTHENTICATED" else "gives no read access to"
        raise TrackingError(f"MLflow tracking server {uri} {verb} {who}; set MLFLOW_TRACKING_USERNAME and "
                            "MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials) to an account of that "
                            "server") from None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists become their string form."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


def experiment_id(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The experiment's id, creating it (with artifacts under ``artifact_root``) if needed."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if artifact_root is not None and "://" not in artifact_root:
        location = (Path(artifact_root).resolve() / name).as_uri()
    elif artifact_root is not None:
        location = f"{artifact_root.rstrip('/')}/{name}"
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - another process created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def find_run(client: MlflowClient, exp_id: str, run_key: str) -> str | None:
    """The id of the newest live run tagged with ``run_key``, if any."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def open_run(uri: str, experiment: str, artifact_root: str | None, run_key: str, *, run_name: str,
             tags: dict[str, str] | None = None, parent_run_id: str | None = None, resume_id: str | None = None
             ) -> tuple[MlflowClient, str, bool]:
    """Resumes run ``resume_id`` (from a checkpoint), or starts a new run for ``run_key``.

    A new run retires earlier runs with the same key that never finished (attempts that died
    before their first checkpoint): they are marked FAILED and keep their data, under a new key.
    Returns the client, the run id and whether the run is new.
    """
    client = MlflowClient(tracking_uri=uri)
    exp_id = experiment_id(client, experiment, artifact_root)
    all_tags = {RUN_KEY_TAG: run_key, **(tags or {})}
    if parent_run_id is not None:
        all_tags["mlflow.parentRunId"] = parent_run_id
    if resume_id is not None:
        client.update_run(resume_id, status="RUNNING")
        log_batch(client, resume_id, tags=all_tags)
        return client, resume_id, False
    stale = find_run(client, exp_id, run_key)
    if stale is not None:
        log_batch(client, stale, tags={RUN_KEY_TAG: f"{run_key}#retired-{int(time.time())}"})
        if client.get_run(stale).info.status == "RUNNING":
            client.set_terminated(stale, "FAILED")
    return client, client.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id, True


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def log_batch(client: MlflowClient, run_id: str, *, params: dict[str, str] | None = None,
              metrics: dict[str, float] | None = None, step: int = 0, tags: dict[str, str] | None = None) -> None:
    """Logs params, metrics (at ``step``) and tags in MLflow's batch-size limits."""
    now = int(time.time() * 1000)
    metric_list = [Metric(k, float(v), now, step) for k, v in (metrics or {}).items()]
    param_list = [Param(k, v) for k, v in (params or {}).items()]
    tag_list = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
    for chunk in _chunks(param_list, 100):
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks(metric_list, 1000):
        client.log_batch(run_id, metrics=chunk)
    for chunk in _chunks(tag_list, 100):
        client.log_batch(run_id, tags=chunk)
