"""docker/check_runtime.py: the runtime stages carry every system library the compiled code loads, and
the venv the build stage makes is the one the runtime stage copies and runs.

The libraries come from this host's venv and dpkg database (`ldd`, `dpkg -S`); the faults are planted
in temporary copies of the Dockerfiles."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.processes import ROOT

# docker/ is not a package; the module is registered before it runs, as its dataclasses look themselves up
spec = importlib.util.spec_from_file_location("docker_check_runtime", ROOT / "docker" / "check_runtime.py")
check_runtime = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
spec.loader.exec_module(check_runtime)

DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.gpu"]


@pytest.fixture(scope="module")
def host():
    """The extensions' system libraries and the dpkg database, resolved once for the module."""
    if shutil.which("dpkg") is None or check_runtime.host_release() != check_runtime.DEBIAN_RELEASE:
        pytest.skip(f"needs a Debian {check_runtime.DEBIAN_RELEASE} host (the images' release) with dpkg; "
                    f"this is {check_runtime.host_release()!r}")
    return check_runtime.system_needs(Path(sys.prefix)), check_runtime.Debian.load()


def planted(tmp_path: Path, name: str, runtime_edit) -> Path:
    """A copy of docker/NAME whose runtime stage (the text after the last FROM) went through ``runtime_edit``."""
    text = (ROOT / "docker" / name).read_text()
    cut = text.rindex("\nFROM ")
    path = tmp_path / name
    path.write_text(text[:cut] + runtime_edit(text[cut:]))
    return path


def without_package(package: str):
    return lambda stage: re.sub(rf"(?<=\s){re.escape(package)}(?=\s)", "", stage)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_stages_have_every_library_and_the_venv(host, name):
    needs, debian = host
    assert check_runtime.check(ROOT / "docker" / name, needs, debian) == []


def test_the_extensions_needs_are_resolved_to_their_packages(host):
    # FFCV's setup.py links libturbojpeg and OpenCV's core and imgproc (Debian's sonames for 4.6 are .406).
    needs, _ = host
    ffcv = {(n.library, n.package) for n in needs if n.extension.name.startswith("_libffcv")}
    assert {("libturbojpeg.so.0", "libturbojpeg0"), ("libopencv_core.so.406", "libopencv-core406"),
            ("libopencv_imgproc.so.406", "libopencv-imgproc406")} <= ffcv
    assert any(n.extension.name.startswith("clustering_cpu-") and n.library == "libc.so.6" for n in needs)


@pytest.mark.parametrize("name", DOCKERFILES)
@pytest.mark.parametrize("package, library, extension", [
    ("libturbojpeg0", "libturbojpeg.so.0", "_libffcv"),
    ("libgl1", "libGL.so.1", "cv2"),
])
def test_a_library_removed_from_the_runtime_stage_is_named(host, tmp_path, name, package, library, extension):
    needs, debian = host
    problems = check_runtime.check(planted(tmp_path, name, without_package(package)), needs, debian)
    assert problems, f"{package} removed from {name}'s runtime stage went unnoticed"
    assert all(library in p or package in p for p in problems)
    named = [p for p in problems if library in p]
    assert named and all(package in p and extension in p for p in named), problems


def test_a_package_that_another_one_depends_on_need_not_be_named(host, tmp_path):
    # libopencv-imgproc406 Depends on libopencv-core406 (apt-cache depends), so apt installs it anyway.
    needs, debian = host
    path = planted(tmp_path, "Dockerfile.cpu", without_package("libopencv-core406"))
    assert "libopencv-core406" not in check_runtime.apt_installed(check_runtime.parse_stages(path.read_text())[-1])
    assert check_runtime.check(path, needs, debian) == []


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("COPY --from=build /opt/venv /opt/venv", "COPY --from=build /opt/venv /usr/local/venv"),
     "copies /opt/venv -> /usr/local/venv"),
    (lambda s: s.replace("ENV PATH=/opt/venv/bin:$PATH", "ENV PATH=$PATH:/opt/venv/bin"),
     "runtime stage's PATH does not start with /opt/venv/bin"),
    (lambda s: s.replace("FROM python:3.11-slim-bookworm", "FROM python:3.12-slim-bookworm"),
     "the runtime stage FROM python:3.12-slim-bookworm"),
    (lambda s: s.replace("PIPELINE_NATIVE_CACHE=/opt/venv/share/pipeline-native", "PIPELINE_NATIVE_CACHE=/cache"),
     "PIPELINE_NATIVE_CACHE is '/opt/venv/share/pipeline-native' in the build stage and '/cache'"),
])
def test_venv_paths_that_disagree_are_named(host, tmp_path, edit, message):
    needs, debian = host
    problems = check_runtime.check(planted(tmp_path, "Dockerfile.gpu", edit), needs, debian)
    assert len(problems) == 1 and message in problems[0], problems


def test_apt_install_lines_are_parsed_as_the_shell_runs_them():
    text = """FROM debian:bookworm AS one
# a comment
RUN apt-get update \\
# a comment inside the continued line, which Docker drops
    && DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::=--force-confnew install \\
        --no-install-recommends foo=1.2 bar:amd64 && rm -rf /var/lib/apt/lists/*; apt-get purge baz
RUN ["apt", "install", "-y", "qux"]
RUN --mount=type=cache,target=/var/cache/apt apt-get install -t bookworm-backports quux | tee log
RUN echo apt-get install not-this-one
"""
    stages = check_runtime.parse_stages(text)
    assert [(s.base, s.name) for s in stages] == [("debian:bookworm", "one")]
    assert check_runtime.apt_installed(stages[0]) == {"foo", "bar", "qux", "quux"}


def pod_specs(node):
    """Every pod spec (a mapping with `containers`) in a parsed manifest."""
    if isinstance(node, dict):
        return ([node] if "containers" in node else []) + [s for v in node.values() for s in pod_specs(v)]
    return [s for v in node for s in pod_specs(v)] if isinstance(node, list) else []


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml", "data-job.yaml"])
def test_the_manifests_run_the_images_as_their_non_root_user(manifest):
    specs = [s for doc in yaml.safe_load_all((ROOT / "jobs" / "k8s" / manifest).read_text()) if doc
             for s in pod_specs(doc)]
    assert specs
    for pod in specs:
        image = pod["containers"][0]["image"]
        kind = image.rsplit(":", 1)[1]
        users = check_runtime.parse_stages((ROOT / "docker" / f"Dockerfile.{kind}").read_text())[-1].args("USER")
        assert users and users[-1] != "0" and pod["securityContext"] == {"runAsNonRoot": True,
                                                                          "runAsUser": int(users[-1])}, image
