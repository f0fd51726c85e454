"""Submit `python -m pipeline run CONFIG` to a Ray cluster as a Ray Job, follow its logs, return its status.

    python jobs/submit.py configs/experiments/paper_deit_imagenet.yaml --address http://HEAD:8265 [--set k=v ...]

The submission id is derived from the experiment's DAG id, so submitting the same experiment
again attaches to the running job (or reports the finished one) instead of starting a duplicate;
after a failed or stopped attempt it submits the next attempt, and the DAG skips every stage that
already finished. This file only launches: the work is in pipeline/.

Clusters that this project deploys run Ray with token authentication (``RAY_AUTH_MODE=token``).
The token is read from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token`` (Ray's own lookup order), and sent as a bearer header; it is never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# The job's working dir is this checkout without bulky local outputs (the data is on shared storage).
EXCLUDES = [".git", ".venv", "runs", "data", "**/__pycache__", ".pytest_cache", ".hypothesis"]


def auth_headers() -> dict[str, str]:
    """The bearer header for a token-authenticated cluster, or none when no token is set up here."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
        token = path.read_text().strip() if path.is_file() else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def connect(address: str):
    """A job client, or a clear exit when the cluster refuses this machine's token (or its lack of one)."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    headers = auth_headers()
    try:
        client = JobSubmissionClient(address, headers=headers)
        client.list_jobs()
    except AuthenticationError:
        why = "this token is not the cluster's" if headers else "no authentication token was found here"
        raise SystemExit(f"error: the Ray cluster at {address} refused the submission: {why}. "
                         "Set RAY_AUTH_TOKEN, or put the cluster's token in the file "
                         "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; docs/cluster.md, 'Ray token "
                         "authentication', says where to get it.") from None
    return client


def submission_base(config_path: str, overrides: list[str]) -> str:
    """The DAG's identity, from the config alone: pydantic and PyYAML, no torch (a laptop that submits)."""
    sys.path.insert(0, str(ROOT))
    from pipeline.config import load_config
    from pipeline.dag.plan import dag_id

    config = load_config(config_path, overrides)
    if config.experiment is None:
        raise SystemExit(f"error: {config_path} has no experiment section; jobs/submit.py runs the DAG")
    return f"token-pooling-{config.experiment.name}-{dag_id(config)[:12]}"


def next_submission(client, base: str) -> tuple[str, bool]:
    """(id, already submitted): the live or finished attempt of ``base``, else a fresh attempt id."""
    attempts = sorted((job for job in client.list_jobs() if (job.submission_id or "").startswith(base)),
                      key=lambda job: job.start_time or 0)
    if attempts:
        last = attempts[-1]
        if str(last.status) not in ("FAILED", "STOPPED"):
            return last.submission_id, True
    return f"{base}-attempt-{len(attempts) + 1}", False


def submit(client, entrypoint: str, submission_id: str, wait_s: float = 120.0) -> None:
    """Submits, retrying while the head's job agent is still starting (a fresh cluster answers 500)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id,
                              runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES,
                                           # Ray Train's per-report lines off the job's log (they stay in Ray's
                                           # log folder); PIPELINE_VERBOSE=1 keeps them
                                           "worker_process_setup_hook": "pipeline.console.quiet_train_reports",
                                           "env_vars": {k: v for k, v in os.environ.items()
                                                        if k == "PIPELINE_VERBOSE"}})
            return
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(2)


async def follow(client, submission_id: str) -> None:
    async for lines in client.tail_job_logs(submission_id):
        print(lines, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
                        help="the Ray dashboard / job server (default: RAY_ADDRESS or http://127.0.0.1:8265)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-follow", action="store_true", help="submit and return without waiting")
    args = parser.parse_args(argv)

    base = submission_base(args.config, args.overrides)
    client = connect(args.address)
    submission_id, existing = next_submission(client, base)
    if existing:
        print(f"attaching to {submission_id} ({client.get_job_status(submission_id)})", flush=True)
    else:
        overrides = [part for item in args.overrides for part in ("--set", item)]
        entrypoint = shlex.join(["python", "-m", "pipeline", "run", args.config, *overrides])
        submit(client, entrypoint, submission_id)
        print(f"submitted {submission_id}: {entrypoint}", flush=True)
    if args.no_follow:
        return 0
    asyncio.run(follow(client, submission_id))
    status = str(client.get_job_status(submission_id))
    print(f"{submission_id}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
