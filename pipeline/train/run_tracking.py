"""What a training job records in MLflow (rank 0 only): params, per-epoch metrics, tags, artifacts."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient
from torch import nn

from pipeline.config import Config, config_hash, dump_config, git_sha
from pipeline.methods import KEEP_ALL, plugin_of
from pipeline.models.selfcheck import kernel_params
from pipeline.runtime import dispatched, forget_dispatches
from pipeline.tracking import flatten, log_batch, open_run


def run_key(config: Config) -> str:
    """A job's identity in MLflow: its Ray storage folder, so that a resumed job continues its run."""
    return f"{config.train.storage_path.rstrip('/')}/{config.train.name}"


@dataclass
class JobTracker:
    client: MlflowClient
    run_id: str
    config: Config

    @classmethod
    def open(cls, config: Config, run_id: str | None = None) -> JobTracker:
        """Continues ``run_id`` (from this job's checkpoint), else starts a run for this job; the params are the
        config. The record of what the fused steps run starts here (``runtime.forget_dispatches``); ``finish``
        logs it (``kernels_run.*``)."""
        train = config.train
        method = config.pooling.method if train.mode == "finetune" else KEEP_ALL
        plugin = plugin_of(method)
        tags = {"git_sha": git_sha(Path(__file__).parent), "config_hash": config_hash(config), "mode": train.mode,
                "method": method, **({} if plugin is None else plugin.tags()), **train.tags}
        client, found, new = open_run(train.tracking_uri, train.experiment, train.artifact_root, run_key(config),
                                      run_name=train.name, tags=tags, parent_run_id=train.parent_run_id,
                                      resume_id=run_id)
        tracker = cls(client, found, config)
        tracker.log_params(flatten(config.model_dump(mode="json")), new)
        forget_dispatches()
        return tracker

    def log_params(self, params: dict[str, str], new: bool = False) -> None:
        """Logs ``params``; MLflow params are immutable, so on a resumed run a value that differs from the logged
        one is recorded as the tag ``resumed.KEY``."""
        if new:
            log_batch(self.client, self.run_id, params=params)
            return
        logged = self.client.get_run(self.run_id).data.params
        log_batch(self.client, self.run_id, params={k: v for k, v in params.items() if k not in logged},
                  tags={f"resumed.{k}": v for k, v in params.items() if logged.get(k, v) != v})

    def log_epoch(self, metrics: dict[str, float], epoch: int) -> None:
        log_batch(self.client, self.run_id, metrics=metrics, step=epoch)

    def record_placement(self, node_ids: list[str]) -> None:
        """The Ray node of each rank, in rank order (the latest attempt's, after a restart)."""
        log_batch(self.client, self.run_id, tags={"ray.node_ids": ",".join(node_ids)})

    def backfill(self, epoch: int, metrics: dict[str, float] | None) -> None:
        """Logs ``epoch``'s metrics from its checkpoint when the job stopped before MLflow had them."""
        logged = {m.step for m in self.client.get_metric_history(self.run_id, "epoch")}
        if metrics is not None and epoch not in logged:
            self.log_epoch(metrics, epoch)

    def finish(self, model: nn.Module, keep: list[int] | None) -> None:
        """Logs what the fused steps' dispatches ran in this process since ``open`` (``kernels_run.*``,
        ``models.selfcheck.kernels_ran``), the resolved config, the keep list and the weights (or their location),
        and closes the run."""
        self.log_params(kernel_params(dispatched()))
        with tempfile.TemporaryDirectory() as tmp:
            config_file = Path(tmp) / "config.yaml"
            config_file.write_text(f"# git {git_sha(Path(__file__).parent)}; hash {config_hash(self.config)}\n"
                                   + dump_config(self.config))
            self.client.log_artifact(self.run_id, str(config_file))
            if keep is not None:
                keep_file = Path(tmp) / "keep.json"
                keep_file.write_text(json.dumps({"keep": keep}) + "\n")
                self.client.log_artifact(self.run_id, str(keep_file))
                log_batch(self.client, self.run_id, tags={"keep": ",".join(map(str, keep))})
            weights = Path(tmp) / "model.pt"
            torch.save(model.state_dict(), weights)
            if weights.stat().st_size <= self.config.train.checkpoint_artifact_mb * 1e6:
                self.client.log_artifact(self.run_id, str(weights), artifact_path="checkpoint")
            else:
                log_batch(self.client, self.run_id, tags={"checkpoint_location": run_key(self.config)})
        self.client.set_terminated(self.run_id, "FINISHED")
