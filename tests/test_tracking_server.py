"""A real MLflow tracking server with basic authentication on loopback, as jobs/compose and jobs/k8s run it:
training refuses wrong or missing credentials before any compute, logs with the right ones, and leaks no secret.
Training here is in-process (``train.workers: 0``): no Ray, so this file runs beside the Ray files."""

from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.processes import BIN, ROOT, assert_no_secret, free_port, get_json, stop, wait_http

# An MLflow server process and a training in this process: 40 s here.
pytestmark = pytest.mark.slow


@dataclass
class MlflowServer:
    uri: str
    proc: subprocess.Popen
    admin_password: str
    folder: Path


@pytest.fixture
def mlflow_server(tmp_path):
    """``mlflow server --app-name basic-auth`` on loopback, as jobs/compose and jobs/k8s run it."""
    port, folder = free_port(), tmp_path / "mlflow-server"
    folder.mkdir()
    (folder / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\nadmin_username = admin\n"
        f"database_uri = sqlite:///{folder / 'auth.db'}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    password = secrets.token_hex(12)
    env = os.environ | {"MLFLOW_AUTH_CONFIG_PATH": str(folder / "basic_auth.ini"),
                        "MLFLOW_AUTH_ADMIN_PASSWORD": password, "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
                             "--port", str(port), "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                             "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"],
                            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{uri}/health", 180)
        yield MlflowServer(uri, proc, password, folder)
    finally:
        stop(proc)


def basic_auth(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.mark.beton
def test_training_needs_the_servers_credentials_and_logs_no_secret(mlflow_server, synthetic_data, tmp_path,
                                                                    monkeypatch, capfd):
    from pipeline.config import load_config
    from pipeline.tracking import TrackingError
    from pipeline.train import run_training

    server, data = mlflow_server, synthetic_data(128, 32)
    overrides = [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}",
                 f"train.storage_path={tmp_path / 'ray'}", f"train.tracking_uri={server.uri}", "train.workers=0",
                 "train.name=served", "train.artifact_root=null"]  # the server's own (proxied) artifact store
    config = load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml", overrides)
    wrong = secrets.token_hex(8)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", wrong)
    started = time.monotonic()
    with pytest.raises(TrackingError, match="refused the credentials of user 'admin'") as refused:
        run_training(config)
    assert wrong not in str(refused.value)
    assert time.monotonic() - started < 30 and not (tmp_path / "ray").exists()  # before any compute
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_USERNAME is not set"):
        run_training(config)

    # The right credentials; a Ray token in the environment too: neither may reach a record or a log.
    token = secrets.token_hex(32)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.admin_password)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    result = run_training(config)
    run = get_json(f"{server.uri}/api/2.0/mlflow/runs/get?run_id={result.run_id}",
                   basic_auth("admin", server.admin_password))["run"]
    assert run["info"]["status"] == "FINISHED"
    assert {m["key"] for m in run["data"]["metrics"]} >= {"val_top1", "train_loss"}
    with pytest.raises(urllib.error.HTTPError, match="401"):  # the server itself refuses anonymous reads
        get_json(f"{server.uri}/api/2.0/mlflow/runs/get?run_id={result.run_id}")
    output = capfd.readouterr()
    assert_no_secret([token, server.admin_password], server.folder / "server.db", server.folder / "artifacts",
                     tmp_path / "ray", json.dumps(run), output.out + output.err)

    stop(server.proc)
    started = time.monotonic()
    with pytest.raises(TrackingError, match="not reachable"):
        run_training(config.model_copy(update={"train": config.train.model_copy(update={"name": "refused"})}))
    assert time.monotonic() - started < 30 and not (tmp_path / "ray" / "refused").exists()
