"""Real processes for the cluster tests: free loopback ports, Ray nodes and servers started in their own
process groups, and stopped (or killed) by pid, never by name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Every port of a node explicit: another Ray on this machine (the test session's own) holds the defaults.
NODE_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
              "metrics-export-port", "node-manager-port", "object-manager-port")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check, what: str, seconds: float, every: float = 0.5):
    """Polls ``check()`` until it returns something truthy; returns it, or raises naming ``what``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise TimeoutError(f"{what} did not happen within {seconds:g} s")


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 5):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
        return json.loads(response.read())


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def wait_http(url: str, seconds: float = 120) -> None:
    wait_for(lambda: answers(url), f"{url} answering", seconds)


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the process group this test started, SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def ray_env(**extra: str) -> dict[str, str]:
    """The venv first on PATH, as in the images: a job's `python` is the cluster's interpreter."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}", **extra}


def start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    ports = [f"--{name}={free_port()}" for name in NODE_PORTS]
    with open(log, "ab") as out:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", *ports,
                                 '--resources={"timing": 1}', *args],  # as every node of a cluster (docs/cluster.md)
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class RayCluster:
    """A Ray head with a dashboard on 127.0.0.1, plus worker nodes, each its own process group."""

    env: dict[str, str]
    temp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rc", dir="/tmp")))
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    head: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start_head(self, cpus: int, headers: dict[str, str] | None = None) -> None:
        # Ray's unix sockets live under --temp-dir; pytest's tmp_path is too long for them (108 chars).
        self.head = start_node(["--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
                                f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
                                f"--ray-client-server-port={free_port()}", f"--num-cpus={cpus}",
                                f"--temp-dir={self.temp}"], self.env, self.temp / "head.log")
        wait_for(lambda: self.alive_nodes(headers), "the Ray head answering", 180)

    def add_worker(self, cpus: int, headers: dict[str, str] | None = None) -> str:
        """Starts a node that joins the head; returns its node id once the cluster sees it alive."""
        before = {n["node_id"] for n in self.alive_nodes(headers)}
        # Its own temp dir, as on a separate machine: each node's log monitor forwards only its own workers' logs.
        folder = self.temp / f"w{len(self.workers)}"
        self.workers.append(start_node([f"--address={self.address}", f"--num-cpus={cpus}", f"--temp-dir={folder}"],
                                       self.env, self.temp / f"worker{len(self.workers)}.log"))
        new = wait_for(lambda: [n for n in self.alive_nodes(headers) if n["node_id"] not in before],
                       "the new Ray node registering", 120)
        return new[0]["node_id"]

    def alive_nodes(self, headers: dict[str, str] | None = None) -> list[dict]:
        try:
            nodes = get_json(f"{self.dashboard}/api/v0/nodes?limit=100", headers)["data"]["result"]["result"]
        except OSError:
            return []
        return [n for n in nodes if n["state"] == "ALIVE"]

    def kill_worker(self, index: int = -1) -> int:
        """SIGKILLs a worker node's whole process group (its raylet and every process on it); returns the pgid."""
        proc = self.workers[index]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: not group_alive(proc.pid), "the killed node's processes exiting", 30)
        return proc.pid

    def stop(self) -> None:
        for proc in self.workers:
            stop(proc, grace=10)
        if self.head is not None:
            stop(self.head, grace=10)
        shutil.rmtree(self.temp, ignore_errors=True)


def assert_no_secret(secret_values: list[str], *places: Path | str) -> None:
    """No secret, in any file under the given folders (MLflow's stores and artifacts, Ray's logs) or text."""
    for place in places:
        if isinstance(place, Path):
            files = [place] if place.is_file() else [f for f in place.rglob("*") if f.is_file()]
            for file in files:
                data = file.read_bytes()
                for value in secret_values:
                    assert value.encode() not in data, f"a secret leaked into {file}"
        else:
            for value in secret_values:
                assert value not in place, "a secret leaked into the output"
