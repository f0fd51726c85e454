"""Config loading: defaults, file, --set overrides, strict errors that name the key and its source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import CONFIG_DIR, Config, ConfigError, config_hash, load_config, write_resolved
from tests.processes import ROOT

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))  # experiment configs; configs/sparsity/ has its own schema


def test_configs_exist():
    assert SHIPPED, "configs/ should hold at least one YAML file"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_shipped_config_loads(path: Path):
    config = load_config(path)
    raw = yaml.safe_load(path.read_text()) or {}
    # Every value the file sets is what the resolved config holds.
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert getattr(getattr(config, section), key) == value
        else:
            assert getattr(config, section) == values


def test_defaults_without_a_file():
    config = load_config()
    assert config == Config()
    assert config.pooling.method == "wkmedoids" and config.pooling.method_options()["iters"] == 5


def test_file_then_overrides(tmp_path: Path):
    path = tmp_path / "exp.yaml"
    path.write_text("seed: 3\npooling:\n  method: kmeans\n  options: {kmeans: {iters: 2, init: random}}\n")
    config = load_config(path, ["pooling.options.kmeans.iters=7", "bench.keep=[10, 20]", "bench.threads=null"])
    assert config.seed == 3
    assert config.pooling.method == "kmeans"  # from the file
    assert config.pooling.method_options() == {"iters": 7, "init": "random", "cluster_on": "tokens",
                                               "significance": "eq4"}  # the override wins, the file's init stays
    assert config.bench.keep == [10, 20]
    assert config.bench.threads is None


def test_unknown_key_names_key_file_and_allowed(tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text("pooling:\n  iter: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "pooling.iter" in message
    assert "allowed keys here: carry, keep, level, method, options" in message


def test_unknown_section(tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text("poolin:\n  iters: 3\n")
    allowed = "bench, bench_loop, bench_throughput, data, experiment, kernels, model, pooling, recipe, seed, train"
    with pytest.raises(ConfigError, match=rf"typo.yaml: poolin: unknown key; allowed keys here: {allowed}"):
        load_config(path)


@pytest.mark.parametrize(("override", "key", "allowed"), [
    # under an optional
    ("experiment.base.nosuch=1", "experiment.base.nosuch", "epochs, lr, seed, sweep, warmup_epochs"),
    ("experiment.select.nosuch=1", "experiment.select.nosuch", "check_cap_s, cost, tie_margin"),
    # --set splits a space's dotted key (recipe.lr): the range at the key "recipe" has no field lr
    ("experiment.base.sweep.space.recipe.lr=1", "experiment.base.sweep.space.recipe.lr",
     "choice, loguniform, randint, uniform"),
    ('experiment.prepare=[{"nosuch": 1}]', "experiment.prepare.0.nosuch", "limit, max_res, mode, out, source"),
])
def test_an_unknown_key_lists_its_sections_keys_through_optional_sections_and_dicts(override, key, allowed):
    hpo = ROOT / "configs" / "experiments" / "fmnist_hpo.yaml"
    with pytest.raises(ConfigError, match=rf"--set {re.escape(override)}: {re.escape(key)}: unknown key; allowed keys "
                                          rf"here: {allowed}$"):
        load_config(hpo, [override])


def test_a_check_across_keys_is_one_line_without_pydantics_prefix():
    """A check of the whole config (heads against every width) has no key of its own: its line is everything the
    config was made of (the file and the overrides) and the message, which names the keys, without pydantic's
    "Value error, "."""
    demo = ROOT / "configs" / "experiments" / "demo.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(demo, ["model.num_heads=7", "seed=3"])
    assert str(err.value) == (f"invalid config:\n  {demo}, --set model.num_heads=7, --set seed=3: model.num_heads 7 "
                              "does not divide the width 32 of experiment.embed_dims (M32): give heads that divide "
                              "every width, or experiment.num_heads per width")


def test_wrong_type_from_override_names_the_override():
    with pytest.raises(ConfigError, match=r"--set pooling.options.kmeans.iters=three: pooling.options: "
                       r"pooling.options.kmeans.iters takes a value of type int \(its default is 5\), got 'three'"):
        load_config(None, ["pooling.options.kmeans.iters=three"])


def test_strict_types_refuse_coercion(tmp_path: Path):
    path = tmp_path / "types.yaml"
    path.write_text("pooling:\n  options: {kmedoids: {iters: '5'}}\nbench:\n  batch: 2.5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "pooling.options.kmedoids.iters takes a value of type int" in str(err.value)
    assert "bench.batch" in str(err.value)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("pooling.method=kmodes", "pooling.method: unknown downsampling method 'kmodes'; choose one of"),
        ("pooling.options.wkmedoids.iters=0", "pooling.options.wkmedoids.iters is at least 1, got 0"),
        ("bench.keep=[98, 0]", "every K must be >= 1"),
        ("pooling.options.kmeans.init=kmeans++",
         "pooling.options.kmeans.init is one of 'topk', 'random', got 'kmeans++'"),
    ],
)
def test_impossible_values(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


def test_a_method_option_is_checked_against_the_method_it_is_set_for():
    with pytest.raises(ConfigError, match="pooling.options.powerbert: method 'powerbert' has no option 'cluster_on'; "
                       "it takes: significance"):
        load_config(None, ["pooling.method=powerbert", "pooling.options.powerbert.cluster_on=metric"])
    with pytest.raises(ConfigError, match="pooling.options.tome: method 'tome' has no option 'significance'"):
        load_config(None, ["pooling.options.tome.significance=cls"])
    with pytest.raises(ConfigError, match="pooling.options.powerbert.significance is one of 'eq4', 'cls', got 'evit'"):
        load_config(None, ["pooling.options.powerbert.significance=evit"])
    config = load_config(None, ["pooling.method=powerbert", "pooling.options.powerbert.significance=cls"])
    assert config.pooling.method_options() == {"significance": "cls"}


@pytest.mark.parametrize("method,message", [
    ("wkmedoids", "pooling.iters is a method's option: use pooling.options.wkmedoids.iters"),
    ("random", "pooling.iters is a method's option, and 'random' does not take it: set it as "
               "pooling.options.METHOD.iters for a method that does (kmeans, wkmeans, wkmedoids, kmedoids)"),
])
def test_a_method_option_at_the_top_of_pooling_names_its_new_place(tmp_path: Path, method, message):
    path = tmp_path / "old.yaml"
    path.write_text(f"pooling:\n  method: {method}\n  iters: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("item", ["pooling.iters", "pooling..iters=3", "=3"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, [item])


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match=r"--set seed.x=1: seed: Input should be a valid integer"):
        load_config(None, ["seed.x=1"])
    with pytest.raises(ConfigError, match="seed is a value, not a section"):
        load_config(None, ["seed=1", "seed.x=1"])


def test_missing_and_malformed_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml; the shipped configs are: configs/"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pooling: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listing)


def test_resolved_config_round_trips(tmp_path: Path):
    config = load_config(None, ["pooling.method=tome", "seed=9"])
    path = write_resolved(config, tmp_path / "run")
    text = path.read_text()
    assert text.startswith("# resolved config; git ")
    assert config_hash(config) in text
    assert load_config(path) == config
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_hash_tracks_content():
    assert config_hash(load_config()) == config_hash(load_config())
    assert config_hash(load_config()) != config_hash(load_config(None, ["seed=1"]))


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "sparsity").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sparsity_file_loads(path: Path):
    from pipeline.models import effective_keep
    from pipeline.sparsity import load_sparsity

    table = load_sparsity(path)
    assert sorted(table.levels) == list(range(8))
    for row in table.levels.values():
        effective_keep(row.keep, depth=12, num_tokens=196)  # valid for a 12-block, 196-token DeiT


def test_bad_sparsity_file(tmp_path: Path):
    from pipeline.sparsity import load_sparsity

    path = tmp_path / "bad.yaml"
    path.write_text("model: x\nlevels:\n  0: {keep: [1], powerbert: 1.0, kmedoid: 2.0}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: levels.0.kmedoids: Field required; levels.0.kmedoid: Extra"):
        load_sparsity(path)


def test_scientific_notation_without_a_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) alone reads 2e-3 as the string '2e-3'; configs and --set read it as a number.
    import yaml

    assert yaml.safe_load("2e-3") == "2e-3"
    path = tmp_path / "c.yaml"
    path.write_text("recipe:\n  lr: 2e-3\n  min_lr: 1E-5\n")
    config = load_config(path, ["recipe.warmup_lr=5e-7"])
    assert (config.recipe.lr, config.recipe.min_lr, config.recipe.warmup_lr) == (2e-3, 1e-5, 5e-7)


def _with_line(text: str, after: str, line: str) -> tuple[str, int, int]:
    """``text`` with ``line`` inserted after the first line that starts with ``after``; the 1-based numbers of
    that line and of the inserted one."""
    lines = text.splitlines()
    first = next(i for i, existing in enumerate(lines) if existing.startswith(after))
    lines.insert(first + 1, line)
    return "\n".join(lines) + "\n", first + 1, first + 2


def test_a_key_given_twice_in_a_training_config_is_refused_naming_it_and_both_lines(tmp_path):
    # PyYAML alone keeps the later value: the run would train 50 epochs where the file first says 10.
    source = CONFIG_DIR / "train" / "fmnist_base.yaml"
    assert yaml.safe_load(_with_line(source.read_text(), "  epochs:", "  epochs: 50")[0])["recipe"]["epochs"] == 50
    text, first, second = _with_line(source.read_text(), "  epochs:", "  epochs: 50")
    path = tmp_path / "base.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: line {second}: the key 'epochs' is given twice in one mapping (first on line "
                              f"{first}); YAML would keep the later value silently: keep one")


def test_a_section_given_twice_in_an_experiment_config_is_refused(tmp_path):
    source = CONFIG_DIR / "experiments" / "tiny.yaml"
    text = source.read_text()
    first = text.splitlines().index("experiment:") + 1
    path = tmp_path / "tiny.yaml"
    path.write_text(text + "experiment:\n  name: other\n")
    with pytest.raises(ConfigError, match=rf"tiny.yaml: line {len(text.splitlines()) + 1}: the key 'experiment' is "
                                          rf"given twice in one mapping \(first on line {first}\)"):
        load_config(path)


def test_a_level_given_twice_in_a_sparsity_file_is_refused(tmp_path):
    from pipeline.sparsity import load_sparsity

    path = tmp_path / "s.yaml"
    path.write_text("model: x\nlevels:\n  0: {keep: [1], powerbert: 1.0, kmedoids: 2.0}\n"
                    "  0: {keep: [2], powerbert: 1.0, kmedoids: 2.0}\n")
    with pytest.raises(ConfigError, match=r"s.yaml: line 4: the key 0 is given twice .*first on line 3"):
        load_sparsity(path)


def test_merge_keys_may_be_overridden_and_repeated_overrides_keep_the_later():
    from pipeline.config.loading import parse_yaml

    assert parse_yaml("a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n", "t") == {"a": {"k": 1, "j": 2},
                                                                           "b": {"k": 3, "j": 2}}
    assert load_config(None, ["seed=1", "model.drop_path=0.2", "seed=4", "model.drop_path=0.3"]).seed == 4
    assert load_config(None, ["model.drop_path=0.2", "model.drop_path=0.3"]).model.drop_path == 0.3
    with pytest.raises(ConfigError, match=r"--set 'bench.keep=\{a: 1, a: 2\}': line 1: the key 'a' is given twice"):
        load_config(None, ["bench.keep={a: 1, a: 2}"])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_yaml_under_configs_loads_with_the_one_loader(path: Path):
    """No shipped file gives a key twice, and each one's sections all reach its typed config."""
    from pipeline.config.loading import parse_yaml
    from pipeline.sparsity import load_sparsity

    loaded = load_sparsity(path) if path.parent.name == "sparsity" else load_config(path)
    raw = parse_yaml(path.read_text(), str(path))
    assert raw and set(raw) <= loaded.model_fields_set


def test_normalised_queries_and_keys_are_the_models_setting():
    """model.qk_norm / model.alpha; the pooling section's old keys get one line naming the new ones."""
    for key, value in (("qk_norm", "learned"), ("alpha", "2")):
        with pytest.raises(ConfigError, match=rf"pooling.{key} is now model.{key}: the model's setting, honoured by "
                                              r"every stage \(the base and the K search too\); set it there"):
            load_config(None, [f"pooling.{key}={value}"])
    with pytest.raises(ConfigError, match="model.alpha=2 scales normalised queries and keys: set model.qk_norm"):
        load_config(None, ["model.alpha=2"])
