"""Loading a config: model defaults, then a YAML file, then dotted ``--set`` overrides (dinov2's order),
with errors that name the key and where it came from; and writing the resolved config beside a run.

``Loader`` is the one YAML loader of the pipeline (configs, experiment files, ``configs/sparsity/``): a key
given twice in one file's mapping is an error, while repeated ``--set`` overrides of one key apply in order,
the later winning."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Hashable
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.base import CONFIG_DIR, ConfigError, error_message
from pipeline.config.root import Config
from pipeline.console import redact


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping (PyYAML alone keeps the later value, silently)."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"line {second}: the key {key!r} is given twice in one mapping (first on line {first}); "
                         "YAML would keep the later value silently: keep one")
        self.key, self.first, self.second = key, first, second


class Loader(yaml.SafeLoader):
    """The YAML loader of every file the pipeline reads: PyYAML's safe loader that refuses a key given twice in
    one mapping (``DuplicateKeyError``, naming the key and both lines), and reads ``1e-3`` as a float (YAML 1.1
    wants ``1.0e-3`` and reads ``1e-3`` as a string). Merge keys (``<<: *base``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML's own error names an unhashable key
            line = key_node.start_mark.line + 1
            if key in lines:
                raise DuplicateKeyError(key, lines[key], line)
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml(text: str, source: str) -> Any:
    """``text`` read with ``Loader``; a ConfigError naming ``source`` (a file, ...) and the line if it is not
    valid YAML or gives a key twice in one mapping."""
    try:
        return _yaml(text)
    except DuplicateKeyError as err:
        raise ConfigError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is read as YAML, so types come out right."""
    if "=" not in item:
        raise ConfigError(f"--set {redact(item)!r}: expected KEY=VALUE with a dotted key, for example "
                          "model.drop_path=0.1")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {redact(item)!r}: the key {key!r} has an empty part")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except DuplicateKeyError as err:
        raise ConfigError(f"--set {redact(item)!r}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {redact(item)!r}: the value is not valid YAML ({err})") from None
    return parts, value


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        shipped = sorted(str(p.relative_to(CONFIG_DIR.parent)) for p in CONFIG_DIR.rglob("*.yaml"))
        raise ConfigError(f"config file not found: {path}; the shipped configs are: {', '.join(shipped)}")
    try:
        data = parse_yaml(path.read_text(), str(path))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a config is YAML text); see configs/ for examples") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _flatten_sources(data: Any, source: str, prefix: tuple[str, ...], out: dict[tuple[str, ...], str]) -> None:
    out[prefix] = source
    if isinstance(data, dict):
        for key, value in data.items():
            _flatten_sources(value, source, prefix + (str(key),), out)


def _set_path(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {redact(item)!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _held(annotation: Any) -> Any:
    """What a field holds, its ``None`` left out: ``ExperimentConfig | None`` is ``ExperimentConfig``."""
    kinds = [arg for arg in get_args(annotation) if arg is not type(None)]
    return kinds[0] if get_origin(annotation) in (Union, UnionType) and len(kinds) == 1 else annotation


def _allowed_keys(loc: tuple[str | int, ...]) -> list[str]:
    """The keys of the section that holds ``loc``'s last part: through optional sections, and past the key of a
    dict-valued field (``experiment.base.sweep.space.KEY``) or the index of a list (``experiment.prepare.0``) to
    their items' fields. Empty where the section is none of these."""
    annotation: Any = Config
    for part in loc[:-1]:
        if get_origin(annotation) in (dict, list):
            annotation = _held(get_args(annotation)[-1])
            continue
        field = annotation.model_fields.get(str(part)) if isinstance(annotation, type) else None
        annotation = _held(getattr(field, "annotation", None))
        if not (get_origin(annotation) in (dict, list) or isinstance(annotation, type)
                and issubclass(annotation, BaseModel)):
            return []
    return sorted(annotation.model_fields) if isinstance(annotation, type) else []


def _describe(err: ValidationError, sources: dict[tuple[str, ...], str], given: str) -> str:
    """The errors a line each, under the source of their key; a check across keys (no key of its own, its message
    names them) under ``given``, everything the config was made of."""
    lines = []
    for item in err.errors():
        loc = tuple(str(p) for p in item["loc"])
        key = ".".join(loc)
        source = next((sources[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in sources), "defaults")
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc)
            message = "unknown key" + (f"; allowed keys here: {', '.join(allowed)}" if allowed else "")
        else:
            shown = "input" in item and item["type"] != "value_error"
            message = f"{error_message(item)} (got {item['input']!r})" if shown else error_message(item)
        lines.append(f"  {source}: {key}: {message}" if loc else f"  {given}: {message}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Merges the model defaults, the YAML file at ``path`` (if any) and ``overrides`` (``"a.b=v"``)."""
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _read_yaml(Path(path))
        _flatten_sources(data, str(path), (), sources)
    for item in overrides:
        parts, value = parse_override(item)
        _set_path(data, parts, value, item)
        for depth in range(1, len(parts)):  # sections the override created come from it too
            sources.setdefault(tuple(parts[:depth]), f"--set {redact(item)}")
        _flatten_sources(value, f"--set {redact(item)}", tuple(parts), sources)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        given = [str(path)] * (path is not None) + [f"--set {redact(item)}" for item in overrides]
        raise ConfigError(_describe(err, sources, ", ".join(given) or "defaults")) from None


def config_hash(config: Config) -> str:
    """A short, stable hash of the resolved config (canonical JSON), for run identities and tags."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def git_sha(cwd: str | Path | None = None) -> str:
    """The checkout's commit, with ``-dirty`` for uncommitted changes; ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def dump_config(config: Config) -> str:
    """The resolved config as YAML, loadable again by ``load_config``."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved(config: Config, directory: str | Path) -> Path:
    """Writes ``config.yaml`` (the resolved config, headed by the git SHA and hash) into ``directory``."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--out {directory} is a file; give the folder to write config.yaml into")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "config.yaml"
    header = f"# resolved config; git {git_sha(Path(__file__).parent)}; hash {config_hash(config)}\n"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(header + dump_config(config))
    tmp.replace(target)
    return target
