"""Shared test setup."""

# Imported here, before any test starts FFCV's loader threads: CPython 3.11 can fail with "AST
# constructor recursion depth mismatch" when pytest rewrites a module (hypothesis's plugin is
# otherwise imported lazily at the terminal summary) while another thread is compiling.
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import hypothesis  # noqa: F401
import pytest

# One OpenMP thread in each test process and in every process a test starts (drivers, Ray's workers, scripts), unless
# the caller chose a number: `make test` runs two xdist workers on 2 cores, each with its subprocesses, and torch's
# default of a thread per core had their spinning OpenMP threads take the cores from each other. The big non-Ray
# files (fast path, FLOPs, CLI, data, loop, targets, GPU checks) took 303 s instead of 356 s on two workers, the
# FLOP counts half the time (docs/testing.md). Set before torch is imported: it reads the variable once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A speed measurement in a test runs on the real clock only to check *what* it records, never how fast the machine
# is (docs/testing.md, "Wall-clock limits inside tests"): its cap is one only a hang reaches, and its tolerance is loose
# enough that the pilot's 8 blocks plan the fewest blocks after them (8, unless the block ratios spread by over a
# third; 23 at a spread of 0.85), so a paired ratio stops on its own after about 16 blocks however loaded the machine.
# The cap itself is tested on a scripted clock (tests/test_paired.py).
HANG_S = 300.0
LOOSE_TOLERANCE = 0.5

# The marks' plugin: `make check`'s --inner-loop and its guard (tests/tiers.py, docs/testing.md).
pytest_plugins = ["tests.tiers"]


def write_tiny_checkpoint(root: Path, method: str, keep: list[int], *, train: int = 8, val: int = 40) -> Path:
    """``root/ckpt``: a `pipeline train`-format checkpoint of configs/train/tiny_synthetic.yaml finetuned with
    ``method`` at ``keep`` (seeded, untrained weights), over a synthetic pair written into ``root``."""
    import torch

    from pipeline.config import load_config
    from pipeline.train.build import arch_signature, build_model
    from pipeline.train.checkpoint import save_checkpoint

    write_synthetic_pair(root, train=train, val=val)
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "train" / "tiny_synthetic.yaml", [
        f"data.train={root / 'train.beton'}", f"data.val={root / 'val.beton'}", "train.mode=finetune",
        f"pooling.method={method}", f"pooling.keep={keep}"])
    torch.manual_seed(0)
    model = build_model(config)
    directory = root / "ckpt"
    directory.mkdir()
    save_checkpoint(directory, {"model": model.state_dict(), "config": config.model_dump(mode="json"),
                                "arch": arch_signature(model), "keep": keep}, {})
    return directory


def write_synthetic_pair(root, train: int, val: int):
    """``root/train.beton`` and ``root/val.beton``: 4-class 16 px synthetic data (raw pixels)."""
    from pipeline.data import WriteSettings, open_source, write_beton

    raw = WriteSettings(mode="raw", max_res=None)
    write_beton(open_source(f"synthetic:classes=4,count={train},size=16"), root / "train.beton", raw,
                log=lambda _: None)
    write_beton(open_source(f"synthetic:classes=4,count={val},size=16,seed=1"), root / "val.beton", raw,
                log=lambda _: None)
    return root


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory) -> Callable[[int, int], Path]:
    """``synthetic_data(train, val)``: a folder holding ``train.beton`` and ``val.beton`` of that many 4-class
    16 px synthetic images (``write_synthetic_pair``), written once a test process (one per xdist worker) for each
    pair of sizes, and shared by every test that asks for those sizes. Read only: a test writes its runs, stores
    and outputs in its own folder."""
    made: dict[tuple[int, int], Path] = {}

    def pair(train: int, val: int) -> Path:
        if (train, val) not in made:
            made[train, val] = write_synthetic_pair(tmp_path_factory.mktemp(f"data-{train}-{val}"), train, val)
        return made[train, val]

    return pair


def dag_parent(client, exp: str, name: str, version: int | None = None) -> str:
    """A DAG parent run named ``name`` in the MLflow experiment ``exp``, tagged as `pipeline run` tags it (its stage
    kind and ``IDENTITY_VERSION``, or ``version``); its run id."""
    from pipeline.config.identity import IDENTITY_VERSION
    from pipeline.dag.records import IDENTITY_TAG, STAGE_KIND

    tags = {STAGE_KIND: "dag", IDENTITY_TAG: str(IDENTITY_VERSION if version is None else version)}
    return client.create_run(exp, run_name=name, tags=tags).info.run_id


def finished_evaluation(client, exp: str, parent: str, metrics: dict[str, float], *,
                        tags: dict[str, str] | None = None, scaled: bool = True, **params: str) -> str:
    """A finished evaluate run under ``parent`` with ``metrics``, and the params the evaluate stage logs (the method,
    level, device and threads of the timing; ``params`` replace them); with ``scaled``, the select stage's images/s
    (``SCALED_RATE``) and its interval's ends (``RATE_LOW``, ``RATE_HIGH``), each the evaluation's own images/s unless
    ``metrics`` has it. Its run id."""
    from pipeline.dag.records import RATE_HIGH, RATE_LOW, SCALED_RATE

    run = client.create_run(exp, tags={"mlflow.parentRunId": parent, "pipeline.stage": "evaluate",
                                       "pipeline.done": "1", **(tags or {})}).info.run_id
    logged = {"checkpoint": "/ckpt/model", "method": "none", "level": "full", "eval_device": "cpu", "eval_threads": "1",
              "eval_device_name": "Test CPU", "eval_dtype": "fp32", "eval_compile": "none", "eval_batch": "64",
              **params}
    for key, value in logged.items():
        client.log_param(run, key, value)
    scale = {name: metrics["images_per_s"] for name in (SCALED_RATE, RATE_LOW, RATE_HIGH)} if scaled else {}
    for key, value in (scale | metrics).items():
        client.log_metric(run, key, value)
    return run


def one_evaluation_store(root: Path, experiment: str, dag: str, checkpoint: str, metrics: dict[str, float],
                         **params: str) -> str:
    """The URI of an MLflow store in ``root`` that holds, in the MLflow experiment ``experiment``, one DAG parent run
    named ``dag`` and one finished evaluation under it (of ``checkpoint``, with ``metrics`` and ``params``:
    ``finished_evaluation``), as `pipeline select` reads an experiment."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(experiment, artifact_location=(root / "a").as_uri())
    finished_evaluation(client, exp, dag_parent(client, exp, dag), metrics, checkpoint=checkpoint, **params)
    return uri


@pytest.fixture
def restore_threads():
    """torch's thread count as it was before the test (latency measurements set their table's)."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def no_store_in_the_checkout():
    """No code path may fall back to MLflow's default store (``./mlflow.db`` in the working directory), and no test
    may leave its runs in the configs' default places in the checkout (``runs/ray``, ``runs/mlflow.db``,
    ``runs/mlartifacts``, where `make demo` and a user's runs go): each test sets ``train.*`` paths of its own."""
    root = Path(__file__).resolve().parents[1]
    strays = [root / "mlflow.db", root / "runs" / "ray", root / "runs" / "mlflow.db", root / "runs" / "mlartifacts"]
    existed = {stray for stray in strays if stray.exists()}
    yield
    made = [str(stray.relative_to(root)) for stray in strays if stray not in existed and stray.exists()]
    assert not made, f"a test run created {', '.join(made)} in the checkout: some test used a config's default path"


# The files whose tests start Ray (a local one in this process, or Ray clusters and drivers in subprocesses).
RAY_FILES = {"test_cluster.py", "test_dag.py", "test_hpo.py", "test_multinode.py", "test_train.py"}


class RayFirst(OrderedDict):
    """xdist's work queue (scope -> its tests), whose first unit handed out is the Ray files' (scope ``"ray"``).
    pytest-xdist 3.8 hands units out with ``popitem(last=False)``, the largest files first (``--loadscope-reorder``):
    the Ray files' unit, which sets the run's wall time, would otherwise start only once a worker had finished its
    first files. A unit a crashed worker leaves is put back (``update``) and handed out again the same way."""

    def popitem(self, last: bool = True) -> tuple[str, dict[str, bool]]:
        if not last and "ray" in self:
            return "ray", self.pop("ray")
        return super().popitem(last)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which `make test` runs with (-n 2 --dist loadfile)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the files in ``RAY_FILES`` as one unit, handed out first: their tests run one at a
    time in one worker, as in a serial run, and every other file runs whole in either worker (module fixtures are
    built once). Not the ``xdist_group`` mark with ``--dist loadgroup``: with pytest 9.2 that mark is silently
    ignored (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = RayFirst()

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if Path(path).name in RAY_FILES else path

    return RayFilesTogether(config, log)


PLUGIN_MODULE = '''"""A downsampling method of another package, registered by an entry point (pipeline.methods)."""
import os

import torch

from pipeline.methods import MethodSpec
from pipeline.pooling import PoolResult


def firstk(*, offset, iters):
    """Keep K tokens starting at ``offset`` (wrapping), every ``iters``-th, in order: ``iters`` is a name the
    built-in clustering methods use too, with another default. Each build is noted in ``$TP_PLUGIN_LOG``."""
    if os.environ.get("TP_PLUGIN_LOG"):
        with open(os.environ["TP_PLUGIN_LOG"], "a") as log:
            log.write(f"{os.getpid()} offset={offset} iters={iters}\\n")

    def step(tokens, k, *, sizes=None, **_):
        b, n, _ = tokens.shape
        if k >= n:
            return PoolResult(tokens, torch.ones(b, n), torch.arange(n).expand(b, n))
        index = (torch.arange(k, device=tokens.device) * iters + offset) % n
        return PoolResult(tokens[:, index], torch.ones(b, k, device=tokens.device),
                          lambda: torch.full((b, n), -1, device=tokens.device))

    return step


SPEC = MethodSpec("tp_plugin:firstk", "keep K tokens from an offset (a plugin)", options={"offset": 1, "iters": 1})
NOT_A_SPEC = "a string"
'''


def write_package(root: Path, module: str, version: str, entries: dict[str, str], source: str) -> Path:
    """An installed package in ``root`` (put it on PYTHONPATH), as pip leaves one: the module ``module``
    (``source``) and its ``.dist-info`` (distribution ``module`` with ``-`` for ``_``), whose entry points
    in the group ``pipeline.methods`` are ``entries`` (name -> ``"module:attribute"``)."""
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text(source)
    info = root / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: {version}\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[pipeline.methods]\n{lines}")
    return root


def write_plugin(root: Path, value: str = "tp_plugin:SPEC", version: str = "0.1") -> Path:
    """The package ``tp-plugin`` in ``root``: the module ``tp_plugin``, whose entry point ``firstk`` names
    ``value``."""
    return write_package(root, "tp_plugin", version, {"firstk": value}, PLUGIN_MODULE)


@contextmanager
def plugins_from(site: Path) -> Iterator[None]:
    """The packages in ``site`` on this process's path, the method registry read again from them; the
    path, the registry and the imported modules as they were afterwards."""
    from pipeline.methods import METHODS

    modules = set(sys.modules)
    sys.path.insert(0, str(site))
    METHODS.reload_plugins()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        for name in set(sys.modules) - modules:
            if name.split(".")[0] in {p.name for p in site.iterdir()}:
                del sys.modules[name]
        METHODS.reload_plugins()
