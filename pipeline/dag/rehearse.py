"""``pipeline run EXPERIMENT --rehearse``: a dress rehearsal of an experiment's DAG before it spends GPU-hours.

A slice of the DAG runs at the experiment's real shapes (its models, image size, classes, data format,
loader pipeline with Mixup/CutMix, EMA and LR scaling) for a few steps a stage, on ImageNet-like JPEGs
written in the experiment's data format. Resources are scaled down, not shapes: one worker per job, no
GPU, a batch of a few images, the evaluation on the CPU. The slice covers every architecture, every method
and every stage kind: each kind's planned stages pass through ``rehearsal_slicer``, which keeps every
architecture and every variant of the kind (the method of a finetune, the kind of search of a K search)
at least once, spread round-robin. Everything goes to its own folder, MLflow store and experiment names,
so a rehearsal is never mistaken for results. Each rehearsal starts from a clean store (``clear_store``: only
its generated data, which depends on the shapes alone, is kept), so every stage runs on the code of the day:
stage ids hash the config and the upstream ids, not the code, and a record left by an earlier rehearsal
would pass a stage that today's code breaks. Failures do not stop it (the runner's keep-going mode): it
prints a table of every stage (pass, FAIL with its error, skipped, reused or not run) and exits non-zero
unless every stage it was to run ran and passed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.bench.serve import request_body
from pipeline.config import Config, ConfigError, error_message
from pipeline.config.experiment import ParamRange
from pipeline.dag.plan import Stage
from pipeline.errors import InputError
from pipeline.serving.server import example_image, start_server, wait_ready


@dataclass(frozen=True)
class RehearsalSettings:
    """What a rehearsal scales down. ``fail_method``: plants a failure in that method's finetune (its first
    training step raises), to see the rehearsal name it and go on."""

    root: Path = Path("runs/rehearsal")
    steps: int = 2  # training steps a stage (one epoch of steps x batch images)
    batch: int = 8  # images a step (even: Mixup/CutMix pair them)
    workers: int = 1  # Ray Train workers a training job (0 stays 0: in-process training)
    cpus: float = 1.0  # CPUs a worker, a trial and an evaluation task
    # Each evaluation's paired speed at a 5% tolerance, within this many seconds, or the config's
    # experiment.eval.speed_cap_s where that is larger (what a capped measurement's error says to raise): 60 s holds the
    # pilot's blocks (``bench.paired.MIN_BLOCKS``) of the paper's largest model at ``batch`` on one idle CPU
    # thread (DeiT-S: 2.3 s a block on a 2-core Xeon, 18 s a pilot); small models stop at the tolerance.
    speed_cap_s: float = 60.0
    fail_method: str | None = None

    def __post_init__(self) -> None:
        if (self.steps < 1 or self.batch < 2 or self.batch % 2 or self.workers < 0 or self.cpus <= 0
                or not self.speed_cap_s > 0):
            raise InputError(f"rehearsal: steps {self.steps}, batch {self.batch}, workers {self.workers}, cpus "
                             f"{self.cpus}, speed_cap_s {self.speed_cap_s}: give steps >= 1, an even batch >= 2, "
                             "workers >= 0, cpus > 0 and speed_cap_s > 0")


# ---- the folder: its generated data kept, its store cleared ----

MARKER = "rehearsal.json"  # what says a folder is a rehearsal's, so that ``clear_store`` may empty it
STORE = ("mlflow.db", "mlartifacts", "ray", "experiments", "serve")  # what a rehearsal writes besides data/


def clear_store(root: Path, log: Callable[[str], None]) -> None:
    """Empties the store of an earlier rehearsal in ``root`` (its MLflow store and artifacts, Ray storage,
    reports and downloaded models), keeping ``data/``; marks ``root`` as a rehearsal's folder. A folder that
    holds anything else and no marker is refused: it may be an experiment's own store."""
    root.mkdir(parents=True, exist_ok=True)
    entries = sorted(p.name for p in root.iterdir())
    if entries and not (root / MARKER).is_file():
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise InputError(f"--rehearse-dir {root}: it holds {shown} and no {MARKER}, so it is not a rehearsal's "
                         "folder, and a rehearsal empties its store before it starts; give a new or empty folder")
    cleared = sorted(name for name in entries if _stored(name))
    for name in cleared:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if cleared:
        log(f"[rehearse] {root}: cleared the earlier rehearsal's {', '.join(cleared)} (data/ kept): every stage "
            "runs on today's code")
    (root / MARKER).write_text(json.dumps({"kept": ["data"], "cleared_at_start": list(STORE)}) + "\n")


def _stored(name: str) -> bool:
    return name in STORE or name.startswith("mlflow.db-")  # SQLite's journal beside the store


# ---- the data: ImageNet-like JPEGs in the experiment's own data format ----

def data_format(config: Config, log: Callable[[str], None]):
    """How the experiment's training set is stored: its metadata, else the ``experiment.prepare`` item that
    writes it, else ``pipeline data write``'s defaults (jpg, longest side 256, quality 90: the paper's)."""
    from pipeline.data.write import WriteSettings, metadata_path

    train = config.data.train
    if train is not None and metadata_path(train).is_file():
        settings = json.loads(metadata_path(train).read_text())["settings"]
        return WriteSettings(**settings)
    for item in config.experiment.prepare:
        if train is not None and Path(item.out).resolve() == Path(train).resolve():
            return WriteSettings(mode=item.mode, max_res=item.max_res)
    log(f"[rehearse] {train} is not readable here: writing with `data write`'s defaults "
        f"({WriteSettings().as_dict()})")
    return WriteSettings()


def widen_classes(beton: Path, classes: int) -> None:
    """Makes ``beton``'s metadata list ``classes`` classes (``class_000``, ...), its images holding the first
    few: a few steps' images cannot show each of ImageNet's 1,000 classes, and the model's head, the loss
    and the dataset check need the experiment's count. The metadata says so (``rehearsal``)."""
    from pipeline.data.write import metadata_path

    path = metadata_path(beton)
    meta = json.loads(path.read_text())
    names = [f"class_{i:03d}" for i in range(classes)]
    if meta["classes"] != names[:len(meta["classes"])]:
        raise InputError(f"{beton}: its classes {meta['classes'][:3]}... are not class_000, class_001, ...")
    counts = meta["class_counts"] + [0] * (classes - len(meta["classes"]))
    meta.update(num_classes=classes, classes=names, class_to_idx={n: i for i, n in enumerate(names)},
                class_counts=counts, rehearsal=f"synthetic images of the first {len(meta['classes'])} classes")
    path.write_text(json.dumps(meta, indent=1))


def write_data(config: Config, settings: RehearsalSettings, folder: Path, log: Callable[[str], None]
               ) -> tuple[Path, Path]:
    """``train.beton`` (steps x batch x workers images) and ``val.beton`` (a batch a worker) in ``folder``,
    from ImageNet-like JPEGs (``pipeline bench loader --imagenet-like``'s) stored in the experiment's data
    format, listing ``data.num_classes`` classes; reused when present."""
    from pipeline.bench.loader import write_imagenet_like
    from pipeline.data import open_source, write_beton

    store = data_format(config, log)
    shards = max(settings.workers, 1)
    classes = config.data.num_classes
    tag = "_".join(str(v) for v in store.as_dict().values())
    out = {}
    for seed, (split, count) in enumerate((("train", settings.steps * settings.batch * shards),
                                           ("val", settings.batch * shards))):
        jpegs = folder / f"imagenet_like_{split}_{count}_{min(count, classes)}"
        write_imagenet_like(jpegs, count, min(count, classes), seed=seed, log=log)
        out[split] = folder / f"{split}_{count}_{classes}_{tag}.beton"
        if not out[split].exists():
            write_beton(open_source(f"imagefolder:{jpegs}"), out[split], store, log=log)
            widen_classes(out[split], classes)
    return out["train"], out["val"]


# ---- the config: the experiment's shapes, scaled-down resources, its own storage ----

WARMUP = 0.5  # the most warm-up epochs a rehearsal's one-epoch stage keeps


def _short_warmups(param: dict[str, Any]) -> dict[str, Any]:
    """A base sweep's ``recipe.warmup_epochs`` parameter (``config.experiment.ParamRange``'s JSON) whose values
    all fit a one-epoch stage: choices cut to ``WARMUP``; a range that reaches above it, the choice of ``WARMUP``
    (a warm-up that still runs)."""
    swept = ParamRange.model_validate(param)
    if swept.kind == "choice":
        return {"choice": sorted({min(value, WARMUP) for value in swept.choice})}
    return param if swept.values()[-1] <= WARMUP else {"choice": [WARMUP]}


def _scaled(config: Config, settings: RehearsalSettings, train: Path, val: Path) -> dict[str, Any]:
    data = config.model_dump(mode="json")
    root = settings.root.resolve()
    exp = data["experiment"]
    data["data"].update(train=str(train), val=str(val), batch_size=settings.batch,
                        num_workers=min(data["data"]["num_workers"], 1), verify_checksum=False)
    data["train"].update(workers=min(data["train"]["workers"], settings.workers), use_gpu=False,
                         cpus_per_worker=settings.cpus, storage_path=str(root / "ray"),
                         tracking_uri=f"sqlite:///{root / 'mlflow.db'}", artifact_root=str(root / "mlartifacts"),
                         experiment=f"{data['train']['experiment']}-rehearsal", max_failures=0,
                         keep_checkpoints=1, checkpoint_artifact_mb=0, compile="none", progress_bar=False,
                         debug_fail_at_step=None, debug_pause_at_step=None)
    # One epoch a stage, and a warm-up inside it where the experiment has one (the schedule's warm-up still runs):
    # the config refuses a warm-up as long as its stage.
    data["recipe"].update(epochs=1, warmup_epochs=min(data["recipe"]["warmup_epochs"], WARMUP))
    for stage in ("base", "ksearch", "finetune"):
        exp[stage]["epochs"] = 1
        if exp[stage].get("warmup_epochs") is not None:
            exp[stage]["warmup_epochs"] = min(exp[stage]["warmup_epochs"], WARMUP)
    if exp["base"]["sweep"] is not None:
        exp["base"]["sweep"].update(num_samples=1, max_concurrent=1)
        space = exp["base"]["sweep"]["space"]
        if "recipe.warmup_epochs" in space:
            space["recipe.warmup_epochs"] = _short_warmups(space["recipe.warmup_epochs"])
    exp["search"].update(algorithm="grid", num_samples=1, trial_workers=min(exp["search"]["trial_workers"],
                         settings.workers), trial_cpus=settings.cpus, trial_gpus=0.0, max_concurrent=None)
    eval_ = exp["eval"]
    eval_.update(batch=settings.batch, warmup=1, speed_tolerance=0.05, device="cpu", cpus=settings.cpus,
                 speed_cap_s=max(settings.speed_cap_s, eval_["speed_cap_s"]),
                 analysis_images=min(eval_["analysis_images"], 1),
                 analysis_batch=min(eval_["analysis_batch"], settings.batch))
    exp.update(name=f"{exp['name']}-rehearsal", runs_dir=str(root / "experiments"), prepare=[],
               base_checkpoints={})
    return data


def rehearsal_config(config: Config, settings: RehearsalSettings, train: Path, val: Path) -> Config:
    """``config`` at its shapes with the rehearsal's data, resources, storage, MLflow store and names. A scaled
    config that does not validate is the rehearsal's fault, not the experiment's: a ConfigError that says so."""
    try:
        return Config.model_validate(_scaled(config, settings, train, val))
    except ValidationError as err:
        problems = "; ".join(": ".join(part for part in (".".join(map(str, e["loc"])), error_message(e)) if part)
                             for e in err.errors())
        raise ConfigError(f"--rehearse scaled the config to one epoch a stage, and the copy does not validate "
                          f"({problems}); the config itself is valid: run it without --rehearse, and report this "
                          "fault of the rehearsal's scaling (pipeline/dag/rehearse.py)") from None


# ---- the slice ----

def variant(stage: Stage) -> Any:
    """What the rehearsal covers of a kind besides the architecture: a finetune's or evaluation's method (and an
    evaluation without finetuning's carry setting), else which stage settings are set (a K search over lambda, or a
    kind added later with its own)."""
    if stage.meta.method is not None:
        return stage.meta.method, stage.meta.carry
    return tuple(sorted(key for key in stage.meta.identity() if key not in ("given", "sweep")))


def cover(stages: list[Stage]) -> list[Stage]:
    """The fewest stages that hold every architecture and every variant, variants spread round-robin over
    the architectures (the j-th variant on the (j mod A)-th architecture where that one has it)."""
    arch_names = list(dict.fromkeys(s.arch for s in stages))
    variants = list(dict.fromkeys(variant(s) for s in stages))
    chosen: list[Stage] = []
    for j in range(max(len(arch_names), len(variants))):
        arch, kind = arch_names[j % len(arch_names)], variants[j % len(variants)]
        matches = [s for s in stages if variant(s) == kind and s.arch == arch] or \
                  [s for s in stages if variant(s) == kind]
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def ramp_keep(tokens: int, depth: int) -> list[int]:
    """A keep list that downsamples in every block, from ``tokens * depth / (depth + 1)`` down to
    ``tokens / (depth + 1)``: what the rehearsal's finetunes pool to when a few K-search steps kept every
    token (then the methods would pool nothing)."""
    return [max(1, round(tokens * (depth - layer) / (depth + 1))) for layer in range(depth)]


class RehearsalSlicer:
    """The ``pipeline.dag.runner.Slicer`` of a rehearsal: ``cover`` of each kind, ``train.compile`` of the
    experiment in the first base only, the planted failure, and keep lists that pool."""

    def __init__(self, compile_mode: str, fail_method: str | None, log: Callable[[str], None]) -> None:
        self.compile_mode, self.fail_method, self.log = compile_mode, fail_method, log
        self.compiled = compile_mode == "none"
        self.tokens: dict[str, int] = {}

    def __call__(self, stages: list[Stage]) -> list[Stage]:
        return [self.adjust(stage) for stage in cover(stages)]

    def adjust(self, stage: Stage) -> Stage:
        if stage.config is None:
            return stage
        train: dict[str, Any] = {}
        if not self.compiled:
            self.compiled, train["compile"] = True, self.compile_mode
            self.log(f"[rehearse] {stage.label} runs with train.compile {self.compile_mode} (the other stages not)")
        if stage.kind == "finetune" and stage.meta.method == self.fail_method:
            self.fail_method, train["debug_fail_at_step"] = None, 1
            self.log(f"[rehearse] {stage.label}: a failure is planted at its first step")
        pooling = {}
        keep = stage.config.pooling.keep
        if stage.config.train.mode == "finetune" and keep is not None and min(keep) >= self.patch_tokens(stage):
            pooling["keep"] = ramp_keep(self.patch_tokens(stage), len(keep))  # a finetune, or one without training
            self.log(f"[rehearse] {stage.label}: the K search kept every token in its few steps; the model "
                     f"pools to {pooling['keep']} instead, so that the method runs")
        if not train and not pooling:
            return stage
        config = stage.config.model_copy(update={"train": stage.config.train.model_copy(update=train),
                                                 "pooling": stage.config.pooling.model_copy(update=pooling)})
        return dataclasses.replace(stage, config=Config.model_validate(config.model_dump()))

    def patch_tokens(self, stage: Stage) -> int:
        if stage.arch not in self.tokens:
            from pipeline.train.build import build_model

            base = stage.config.model_copy(update={"train": stage.config.train.model_copy(update={"mode": "base"})})
            self.tokens[stage.arch] = int(build_model(base).patch_embed.num_patches)
        return self.tokens[stage.arch]


# ---- the report ----

PASS, FAIL, SKIPPED, REUSED, NOT_RUN = "pass", "FAIL", "skipped", "reused", "not run"
# pass: it ran in this rehearsal and finished; FAIL: it ran and failed; skipped: a stage it needs failed;
# reused: its record was found done and nothing ran (a rehearsal starts from a clean store, so this says the
# store was not clean); not run: the config turns it off (register_models: false). Only "not run" is not a fault.


@dataclass(frozen=True)
class StageReport:
    kind: str
    label: str
    status: str  # one of PASS, FAIL, SKIPPED, REUSED, NOT_RUN
    step_s: float | None = None
    peak_mb: float | None = None
    seconds: float | None = None
    error: str = ""

    def row(self) -> str:
        def num(value: float | None, fmt: str) -> str:
            return "" if value is None else format(value, fmt)
        return (f"| {self.kind} | {self.label} | {self.status} | {num(self.step_s, '.2f')} | "
                f"{num(self.peak_mb, ',.0f')} | {num(self.seconds, '.0f')} | {self.error} |")


def stage_reports(config: Config, summary: dict[str, Any], started_ms: int) -> list[StageReport]:
    """One report per planned stage, from its MLflow record (passed, or reused when the record is older than
    this rehearsal, ``started_ms``), the failures (failed), or neither (skipped: a stage it needs failed)."""
    from mlflow.tracking import MlflowClient

    from pipeline.dag.records import find_done
    from pipeline.tracking import experiment_id

    client = MlflowClient(tracking_uri=config.train.tracking_uri)
    exp_id = experiment_id(client, config.train.experiment, config.train.artifact_root)
    out = []
    for stage in summary["planned"]:
        if stage.label in summary["failures"]:
            out.append(StageReport(stage.kind, stage.label, FAIL, error=summary["failures"][stage.label]))
            continue
        found = find_done(client, exp_id, stage.id)
        if found is None:
            out.append(StageReport(stage.kind, stage.label, SKIPPED, error="a stage it needs failed"))
            continue
        record, run_id = found
        run = client.get_run(run_id)
        if run.info.start_time < started_ms:
            out.append(StageReport(stage.kind, stage.label, REUSED, error=f"done in MLflow run {run_id} before this "
                                   "rehearsal: nothing ran, today's code is not checked"))
            continue
        metrics = run.data.metrics
        step = metrics.get("step_s")
        if stage.kind == "evaluate" and metrics.get("images_per_s"):
            step = config.experiment.eval.batch / metrics["images_per_s"]  # one timed batch
        out.append(StageReport(stage.kind, stage.label, PASS, step, metrics.get("peak_memory_mb"),
                               record.get("seconds")))
    return out


def tail_reports(config: Config, summary: dict[str, Any], served: StageReport) -> list[StageReport]:
    """The select and register stages, and the served request."""
    name = config.experiment.name
    if f"{name}-select" in summary["failures"]:
        return [StageReport("select", f"{name}-select", FAIL, error=summary["failures"][f"{name}-select"]),
                StageReport("register", f"token-pooling-{name}", SKIPPED, error="select failed"), served]
    said = ("no evaluated model" if "rows" not in summary
            else f"speeds in doubt: {summary['speed_warning']}" if summary.get("speed_warning") else "")
    out = [StageReport("select", f"{name}-select", PASS if "rows" in summary else SKIPPED, error=said)]
    if config.experiment.register_models and "rows" not in summary:
        out.append(StageReport("register", f"token-pooling-{name}", SKIPPED, error="select did not run"))
    elif config.experiment.register_models:
        aliases = summary.get("aliases") or []
        out.append(StageReport("register", f"token-pooling-{name}", PASS if aliases else FAIL,
                               error=f"{len(aliases)} alias(es): " + ", ".join(a.rsplit("@", 1)[1] for a in aliases)
                               if aliases else "no model was registered"))
    return [*out, served]


def not_served(config: Config) -> StageReport:
    """The serve row when no request was sent: the config registers nothing (not a fault), or no model was
    registered (a stage it needs failed)."""
    if not config.experiment.register_models:
        return StageReport("serve", "one request", NOT_RUN, error="experiment.register_models is false: no "
                           "registered model to serve")
    return StageReport("serve", "one request", SKIPPED, error="no registered model")


def exit_status(reports: list[StageReport]) -> int:
    """0 when every stage the rehearsal was to run ran in it and passed, else 1."""
    return 0 if all(r.status in (PASS, NOT_RUN) for r in reports) else 1


def count_line(reports: list[StageReport], seconds: float) -> str:
    """``N of M passed in S s``, then what failed, was skipped or reused, and what the config did not run."""
    faults = [r for r in reports if r.status not in (PASS, NOT_RUN)]
    off = [r for r in reports if r.status == NOT_RUN]
    ran = len(reports) - len(off)
    line = f"{ran - len(faults)} of {ran} passed in {seconds:.0f} s"
    for status, said in ((FAIL, "failed"), (SKIPPED, "skipped (a stage they need failed)"),
                         (REUSED, "reused, not run")):
        labels = [r.label for r in faults if r.status == status]
        if labels:
            line += f"; {said}: {', '.join(labels)}"
    if off:
        line += f"; not run (the config turns them off): {', '.join(f'{r.kind} ({r.label})' for r in off)}"
    return line


# ---- one served request ----

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_one(model: str, tracking_uri: str, folder: Path, log: Callable[[str], None]) -> StageReport:
    """Downloads ``model`` into ``folder`` (not ``pipeline serve``'s own folder), starts the scoring server on
    it, sends it one image and stops it."""
    import mlflow

    started = time.perf_counter()
    process = None
    try:
        mlflow.set_tracking_uri(tracking_uri)
        local = folder / model.replace("@", "-")
        if not (local / "MLmodel").is_file():
            mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model}", dst_path=str(local))
        process, url, folder = start_server(str(local), host="127.0.0.1", port=_free_port(), workers=1,
                                            tracking_uri=tracking_uri, verbose=False, log=log)
        wait_ready(url, process, timeout=300)
        request = urllib.request.Request(f"{url}/invocations", data=request_body(
            example_image(folder).read_bytes(), top_k=1), headers={"Content-Type": "application/json"})
        sent = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        label = answer["predictions"][0]["label"]
        return StageReport("serve", f"one request to {model}", PASS, time.perf_counter() - sent, None,
                           time.perf_counter() - started, f"answered {label!r}")
    except Exception as err:  # noqa: BLE001 - the rehearsal reports any failure and goes on
        from pipeline.dag.sweep import one_line

        return StageReport("serve", f"one request to {model}", FAIL, error=one_line(err))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)


# ---- the whole rehearsal ----

def format_table(reports: list[StageReport]) -> str:
    lines = ["| kind | stage | result | s/step | peak MB | seconds | note |", "|---|---|---|---:|---:|---:|---|"]
    return "\n".join(lines + [r.row() for r in reports])


def run_rehearsal(config: Config, settings: RehearsalSettings, *, address: str | None = None,
                  log: Callable[[str], None] = print) -> int:
    """Rehearses ``config``'s experiment from a clean store; prints the table and the projected GPU-hours;
    returns the exit status: 0 when every stage it was to run ran and passed, 1 otherwise."""
    from pipeline.dag.projection import projected_gpu_hours
    from pipeline.dag.runner import run_experiment

    if settings.fail_method is not None and settings.fail_method not in config.experiment.methods:
        raise InputError(f"--rehearse-fail {settings.fail_method!r}: not one of experiment.methods "
                         f"{config.experiment.methods}")
    started = time.perf_counter()
    started_ms = int(time.time() * 1000)
    root = settings.root.resolve()
    clear_store(root, log)
    train, val = write_data(config, settings, root / "data", log)
    rehearsal = rehearsal_config(config, settings, train, val)
    log(f"[rehearse] {config.experiment.name} at its shapes in {settings.root} (MLflow {rehearsal.train.tracking_uri}, "
        f"experiment {rehearsal.train.experiment!r}): {settings.steps} step(s) of {settings.batch} images a stage")
    slicer = RehearsalSlicer(config.train.compile, settings.fail_method, log)
    summary = run_experiment(rehearsal, address=address, log=log, keep_going=True, slicer=slicer)
    best = next((alias for alias in summary.get("aliases") or [] if alias.endswith("@best")), None)
    served = (serve_one(best, rehearsal.train.tracking_uri, root / "serve", log) if best is not None
              else not_served(rehearsal))
    reports = stage_reports(rehearsal, summary, started_ms) + tail_reports(rehearsal, summary, served)
    log(f"\nRehearsal of {config.experiment.name} (real shapes; {settings.steps} step(s) of {settings.batch} "
        "images a stage on this machine's CPUs: step times and memory are this machine's, not a GPU's):\n"
        + format_table(reports))
    log(projected_gpu_hours(config).line())
    log(count_line(reports, time.perf_counter() - started))
    return exit_status(reports)
