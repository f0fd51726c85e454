"""Every bad config is refused before any work, in one line (docs/usage.md, "What is refused before a run").

- A property test over the schema: each leaf of demo.yaml and of the paper's config replaced by a value of a wrong
  type or out of range, removed, or given an unknown sibling key; ``pipeline run FILE --plan`` (in this process, no
  Ray) either plans it or refuses it with the project's error, never with another exception.
- The values that make a run meaningless, each refused (or warned about) at plan time.
- A project error raised under Ray's wrappers is found again, and its one line says where the tracebacks are.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli import build_parser
from pipeline.config import ConfigError, load_config
from pipeline.errors import JobError, LossNotFiniteError, PipelineError, PipelineWarning, project_error
from tests.processes import ROOT

CONFIGS = {"demo": ROOT / "configs" / "experiments" / "demo.yaml",
           "paper": ROOT / "configs" / "experiments" / "paper_deit_imagenet.yaml"}
TINY = ROOT / "configs" / "experiments" / "tiny.yaml"


def leaves(data: Any, path: tuple = ()) -> list[tuple]:
    """Every scalar's path, a list's and each of its items' (``("experiment", "lambdas", 0)``)."""
    if isinstance(data, dict):
        return [leaf for key, value in data.items() for leaf in leaves(value, (*path, key))]
    if isinstance(data, list):
        return [path, *(leaf for i, value in enumerate(data) for leaf in leaves(value, (*path, i)))]
    return [path]


PARSED = {name: yaml.safe_load(file.read_text()) for name, file in CONFIGS.items()}
LEAVES = [(name, path) for name, data in PARSED.items() for path in leaves(data)]
WRONG_TYPES = ["a string", 3, 2.5, True, None, [1, 2], {"key": 1}]
OUT_OF_RANGE = {int: [0, -1, 10**12, -(10**12)], float: [0.0, -1.0, 1e30, -1e30, float("nan"), float("inf")],
                str: ["", " ", "no_such_name", "x" * 300], list: [[]], bool: []}


def bad_changes(value: Any) -> list[tuple[str, Any]]:
    """Each way to break a leaf holding ``value``: a value of another type, one of its type out of any sensible range,
    the key removed, an unknown key beside it."""
    values = [v for v in WRONG_TYPES if type(v) is not type(value)] + OUT_OF_RANGE.get(type(value), [])
    return [("missing", None), ("unknown", None), *(("value", v) for v in values)]


def mutated(data: dict, path: tuple, kind: str, value: Any) -> dict:
    out = copy.deepcopy(data)
    parent = out
    for part in path[:-1]:
        parent = parent[part]
    if kind == "missing":
        del parent[path[-1]]
    elif kind == "unknown":
        (parent if isinstance(parent, dict) else out).setdefault("no_such_key", 1)
    else:
        parent[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def paper_data(tmp_path_factory) -> Path:
    """Stand-ins for the paper's ImageNet betons: the plan reads a beton's metadata (its image count), not the file."""
    folder = tmp_path_factory.mktemp("imagenet")
    for split, images in (("train", 1_281_167), ("val", 50_000)):
        (folder / f"{split}.beton").write_bytes(b"")
        (folder / f"{split}.beton.json").write_text(json.dumps({"num_images": images}))
    return folder


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bad")


PARSER = build_parser()


def plan(file: Path) -> int:
    """``pipeline run FILE --plan`` as the CLI runs it, in this process; a PipelineError is a refusal (2)."""
    args = PARSER.parse_args(["run", str(file), "--plan"])
    try:
        return args.func(args)
    except PipelineError:
        return 2


# The paper config's leaves run in `make test` only (marked slow): a plan of it builds a dozen models, and its leaves
# held `make check` past its 3 minutes; the demo's leaves, the same schema's sections, keep the property in the inner
# loop.
@pytest.mark.parametrize(("name", "path"), [pytest.param(n, p, marks=[pytest.mark.slow] if n == "paper" else [])
                                            for n, p in LEAVES],
                         ids=[f"{n}:{'.'.join(map(str, p))}" for n, p in LEAVES])
# More examples than a leaf has changes (at most 13): Hypothesis stops when it has drawn each one.
@settings(max_examples=20, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(draw=st.data())
def test_a_bad_leaf_is_planned_or_refused_with_the_projects_error(name, path, draw, paper_data, scratch, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(ROOT)  # the configs' relative paths (data, cost tables) are the checkout's
    data = copy.deepcopy(PARSED[name])
    if name == "paper":
        data["data"].update(train=str(paper_data / "train.beton"), val=str(paper_data / "val.beton"))
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    kind, value = draw.draw(st.sampled_from(bad_changes(parent[path[-1]])), label="change")
    file = scratch / f"{name}-{'.'.join(map(str, path))}.yaml"
    file.write_text(yaml.dump(mutated(data, path, kind, value), Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PipelineWarning)
        plan(file)  # anything but a PipelineError fails the test, naming the drawn leaf and value
    capsys.readouterr()


def test_the_property_test_covers_every_leaf_of_both_configs():
    counted = {name: sum(1 for n, _ in LEAVES if n == name) for name in CONFIGS}
    assert counted["demo"] >= 60 and counted["paper"] >= 50, counted
    assert ("demo", ("experiment", "lambdas", 0)) in LEAVES and ("demo", ("model", "num_heads")) in LEAVES


# ---- the two validation tracebacks of the issue, each one line naming its key ----

def test_heads_that_do_not_divide_a_width_name_model_num_heads():
    with pytest.raises(ConfigError, match=r"model\.num_heads 1000000000000 does not divide the width 32 of "
                                          r"experiment\.embed_dims"):
        load_config(CONFIGS["demo"], ["model.num_heads=1000000000000"])
    with pytest.raises(ConfigError, match=r"experiment\.num_heads\[32\] 5 does not divide"):
        load_config(CONFIGS["demo"], ["experiment.num_heads={32: 5}"])


def test_a_negative_lambda_names_experiment_lambdas():
    with pytest.raises(ConfigError, match=r"experiment\.lambdas\.0: Input should be greater than or equal to 0"):
        load_config(CONFIGS["demo"], ["experiment.lambdas=[-1]"])


def test_a_stage_config_that_fails_names_the_experiment_key_behind_it():
    """By construction: what the experiment section passes but a stage config does not (a width below the model's
    minimum) is a ConfigError naming experiment.embed_dims, not pydantic's ValidationError."""
    from pipeline.dag.plan import archs, base_stage

    config = load_config(TINY, ["experiment.embed_dims=[4]", "model.num_heads=1"])
    with pytest.raises(ConfigError, match=r"a base stage's config is not valid: experiment\.embed_dims: Input should "
                                          r"be greater than or equal to 8 \(model\.embed_dim=4\)"):
        base_stage(config, archs(config)[0])


def test_a_trial_setting_that_fails_names_its_key():
    from pipeline.config import with_setting

    with pytest.raises(ConfigError, match=r"recipe\.lr=-1\.0: Input should be greater than 0"):
        with_setting(load_config(TINY), "recipe.lr", -1.0)
    # a validator's own message, without pydantic's "Value error, " before it
    with pytest.raises(ConfigError, match=r"^pooling\.method='kmodes': unknown downsampling method 'kmodes'; choose"):
        with_setting(load_config(TINY), "pooling.method", "kmodes")


# ---- values that make a run meaningless: refused or warned at plan time ----

@pytest.mark.parametrize(("override", "says"), [
    ("recipe.warmup_epochs=1000000", r"the ksearch stage: recipe\.warmup_epochs 1e\+06 is not below "
                                     r"experiment\.ksearch\.epochs 1"),
    ("experiment.base.warmup_epochs=4", r"the base stage: experiment\.base\.warmup_epochs 4 is not below "
                                        r"experiment\.base\.epochs 4"),
    ("experiment.finetune={epochs: 2, warmup_epochs: 3}", r"the finetune stage: experiment\.finetune\.warmup_epochs 3"),
], ids=["recipe", "base", "finetune"])
def test_warmup_as_long_as_the_stage_is_refused_in_each_stage(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config(CONFIGS["demo"], [override])


def test_warmup_as_long_as_a_single_training_is_refused():
    with pytest.raises(ConfigError, match=r"recipe\.warmup_epochs 2 is not below recipe\.epochs 2"):
        load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml", ["recipe.warmup_epochs=2"])
    load_config(ROOT / "configs" / "train" / "tiny_synthetic.yaml", ["recipe.warmup_epochs=1.5"])


@pytest.mark.parametrize(("target", "says"), [
    ("{cost: gflops, fraction: 1.0e30}", r"fraction: Input should be less than or equal to 1"),
    ("{cost: gflops, fraction: 0}", r"fraction: Input should be greater than 0"),
    ("{cost: gflops, fraction: 0.5, methods: []}", r"methods: List should have at least 1 item"),
    ("{cost: gflops, fraction: 0.5, archs: []}", r"archs: List should have at least 1 item"),
], ids=["huge", "zero", "no-method", "no-arch"])
def test_a_target_outside_0_1_or_naming_nothing_is_refused(target, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY, [f"experiment.ksearch_targets=[{target}]"])


def test_an_absolute_target_above_the_unmodified_cost_is_refused_at_plan_time():
    from pipeline.dag.plan import check_targets

    config = load_config(TINY, ["experiment.ksearch_targets=[{cost: gflops, value: 1000}]"])
    with pytest.raises(PipelineError, match=r"above the unmodified model's"):
        check_targets(config)


@pytest.mark.parametrize("lr", ["1e30", "1e-9"])
def test_a_learning_rate_far_outside_timms_recipes_is_warned_about(lr, capsys):
    from pipeline.dag.checks import warn_learning_rates

    with pytest.warns(PipelineWarning, match=rf"recipe\.lr={re.escape(f'{float(lr):g}')} is outside 1e-06 to 50"):
        warn_learning_rates(load_config(TINY, [f"recipe.lr={lr}"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipelineWarning)
        warn_learning_rates(load_config(TINY))  # the tiny config's 2e-3: no warning


def test_an_unknown_optimizer_is_refused_at_load_naming_the_key_and_valid_names():
    with pytest.raises(ConfigError, match=r"recipe\.opt: 'no_such_opt' is not an optimizer of timm; for "
                                          r"example adamw, sgd"):
        load_config(CONFIGS["demo"], ["recipe.opt=no_such_opt"])
    assert load_config(TINY, ["recipe.opt=lookahead_adamw"]).recipe.opt == "lookahead_adamw"
    assert load_config(TINY, ["recipe.opt=adabelief"]).recipe.opt == "adabelief"  # asks timm


def test_the_optimizers_accepted_without_timm_are_timms():
    from timm.optim import list_optimizers

    from pipeline.config.recipe import COMMON_OPTIMIZERS

    assert set(COMMON_OPTIMIZERS) <= set(list_optimizers())


# ---- run --plan: what it can know without running ----

def test_plan_refuses_a_global_batch_larger_than_the_prepared_training_set(monkeypatch, tmp_path):
    """The demo's prepare step, writing to folders of this test (the checkout's data/ may hold the betons already,
    and then the plan counts their images instead)."""
    monkeypatch.chdir(ROOT)
    from pipeline.dag.checks import plan_checks

    train, val = tmp_path / "train.beton", tmp_path / "val.beton"
    prepare = (f"experiment.prepare=[{{source: 'fashion-mnist:train', out: '{train}', limit: 10000}}, "
               f"{{source: 'fashion-mnist:test', out: '{val}', limit: 2000}}]")
    config = load_config(CONFIGS["demo"], ["data.batch_size=1000000000", f"data.train={train}", f"data.val={val}",
                                           prepare])
    with pytest.raises(ConfigError, match=r"data\.batch_size=1000000000 x 2 worker\(s\) \(train\.workers\) is larger "
                                          r"than the training set: .*experiment\.prepare writes 10000 images"):
        plan_checks(config)


def test_plan_refuses_a_batch_larger_than_a_betons_images_less_the_holdout(paper_data):
    from pipeline.dag.checks import check_data_plan

    data = [f"data.train={paper_data / 'train.beton'}", f"data.val={paper_data / 'val.beton'}"]
    check_data_plan(load_config(CONFIGS["paper"], data))
    with pytest.raises(ConfigError, match=r"data\.batch_size=81000 x 8 worker\(s\) \(train\.workers\) .* has 640584 "
                                          r"training image\(s\) less data\.holdout=0\.5"):
        check_data_plan(load_config(CONFIGS["paper"], [*data, "data.batch_size=81000", "data.holdout=0.5"]))


def test_plan_refuses_a_data_path_that_is_neither_there_nor_prepared(monkeypatch):
    from pipeline.dag.checks import check_data_plan

    monkeypatch.chdir(ROOT)
    with pytest.raises(PipelineError, match=r"data\.val: nowhere\.beton does not exist and no experiment\.prepare "
                                            "item writes it"):
        check_data_plan(load_config(CONFIGS["demo"], ["data.val=nowhere.beton"]))
    with pytest.raises(ConfigError, match=r"data\.train is not set"):
        check_data_plan(load_config(TINY))


def test_plan_refuses_what_the_local_cluster_cannot_hold(paper_data, monkeypatch):
    from pipeline.dag import checks

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(checks, "local_resources", lambda gpus: {"CPU": 2.0, "GPU": 0.0})
    paper = load_config(CONFIGS["paper"], [f"data.train={paper_data / 'train.beton'}",
                                           f"data.val={paper_data / 'val.beton'}"])
    with pytest.raises(ConfigError, match=r"train\.use_gpu is true but this machine \(a local Ray\) has no GPU"):
        checks.check_cluster(paper, checks.training_stages(paper), None)
    tiny = load_config(TINY, ["experiment.search.trial_cpus=4"])
    with pytest.raises(ConfigError, match=r"a ksearch trial takes 4 CPU\(s\) .* Tune would wait for them forever"):
        checks.check_cluster(tiny, checks.training_stages(tiny), None)


# ---- a worker's project error: found under Ray's wrappers, and its one line ----

class Wrapper(Exception):
    """Stands for Ray's wrappers, which keep the error they wrap in these attributes (read by name)."""

    def __init__(self, text: str, **inner: Any) -> None:
        super().__init__(text)
        for key, value in inner.items():
            setattr(self, key, value)


def test_a_project_error_is_found_under_rays_wrappers():
    loss = LossNotFiniteError("the training loss is not finite at step 3")
    assert isinstance(loss, FloatingPointError) and project_error(loss) is loss
    group = Wrapper("Training failed due to worker errors:\nTraceback ...",
                    worker_failures={1: loss, 0: Wrapper("gloo: connection closed")})
    assert project_error(group) is loss
    assert project_error(Wrapper("task", cause=Wrapper("controller", controller_failure=group))) is loss
    assert project_error(Wrapper("bug", worker_failures={0: RuntimeError("planted")})) is None
    assert project_error(RuntimeError("planted")) is None


def test_a_worker_failure_is_one_line_naming_the_log_folder_unless_verbose(monkeypatch):
    from pipeline import console

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(console, "ray_log_folder", lambda: "/tmp/ray/session_x/logs")
    error = Wrapper("Training failed due to worker errors:\nTraceback (most recent call last):\n  ...",
                    worker_failures={0: JobError("data.batch_size=64 x 2 workers is larger than the training set")})
    line = console.worker_failure("training job 'tiny' failed after 0 restart(s)", error)
    assert line == ("data.batch_size=64 x 2 workers is larger than the training set (training job 'tiny' failed after "
                    "0 restart(s); the tracebacks are in /tmp/ray/session_x/logs, or rerun with --verbose)")
    bug = Wrapper("Training failed due to worker errors:\nTraceback ...", worker_failures={0: RuntimeError("x")})
    assert "Traceback" in console.worker_failure("training job 'tiny' failed", bug)
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert "Traceback" in console.worker_failure("training job 'tiny' failed", error)


def test_rays_log_record_of_a_project_error_goes_to_the_file_and_a_bugs_stays(tmp_path, monkeypatch):
    from pipeline import console

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    kept = logging.FileHandler(tmp_path / "errors.log")
    aside = console.ProjectErrorsAside(kept)

    def record(error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:  # noqa: BLE001 - the filter reads the exception being handled, as Ray logs it
            return logging.LogRecord("ray", logging.ERROR, __file__, 1, "Error in training function", None,
                                     sys.exc_info())

    assert aside.filter(record(LossNotFiniteError("not finite"))) is False
    assert aside.filter(record(Wrapper("trial", cause=ConfigError("bad")))) is False
    assert aside.filter(record(RuntimeError("planted"))) is True
    kept.close()
    assert (tmp_path / "errors.log").read_text().count("Error in training function") == 2
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert aside.filter(record(LossNotFiniteError("not finite"))) is True
