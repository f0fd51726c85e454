# One-command setup: `make test` on a fresh machine installs everything, then runs the tests.
# A second `make setup` is a no-op (dpkg checks plus an up-to-date stamp).

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
# FFCV builds against libturbojpeg and OpenCV, and K-Medoids' CPU kernel with the C compiler; the demo
# data is Debian's Fashion-MNIST.
APT_PACKAGES := build-essential libturbojpeg0-dev libopencv-dev pkg-config dataset-fashion-mnist
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup system test check test-under-load demo bench mutation images clean-venv

setup: system $(STAMP)

system:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:" $$missing; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# A new venv takes 7.45 GB (a fresh clone's, `du -sb`; torch's CUDA build among it): a disk with less free than
# VENV_NEEDS_GB under the venv's folder is refused before pip starts, rather than pip stopping half-way with "No space
# left on device" (pip's cache and TMPDIR, on another disk, are not checked). ROOM prints the free GB and the folder.
VENV_NEEDS_GB ?= 8
ROOM = $(PYTHON) -c 'import pathlib, shutil, sys; p = pathlib.Path(sys.argv[1]).absolute(); \
	d = next(q for q in (p, *p.parents) if q.is_dir()); print(shutil.disk_usage(d).free // 10**9, d)'

$(STAMP): pyproject.toml constraints.txt
	@[ -x $(PY) ] || { \
		room=$$($(ROOM) '$(VENV)'); free=$${room%% *}; where=$${room#* }; \
		if [ -n "$$free" ] && [ "$$free" -lt $(VENV_NEEDS_GB) ]; then \
			echo "make setup: a new venv at $(VENV) needs about $(VENV_NEEDS_GB) GB (VENV_NEEDS_GB), and $$where" \
				"has $$free GB free: free some space there, or set VENV to a folder on a disk with room" >&2; \
			exit 1; \
		fi; \
		$(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $(STAMP)

# Two pytest-xdist workers, a test file at a time: the files whose tests start Ray go to one worker as one
# unit, one test at a time (tests/conftest.py), and the other files share both workers.
# TEST_WORKERS=0 runs the suite in this process. The tests marked `alone` (a failed FFCV write ending, Ctrl-C
# during training: processes whose timing another test's load on the 2 cores upsets) run afterwards, by
# themselves. tests/floors.py holds the floors of docs/architecture.md (import-linter) before the tests run.
# The JUnit reports in runs/ give where the time went: `$(PY) -m tests.durations runs/test-report*.xml`.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m ruff check pipeline tests jobs benchmarks
	$(PY) tests/floors.py
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --junitxml=runs/test-report.xml
	$(PY) -m pytest -q -m alone --junitxml=runs/test-report-alone.xml

# The inner loop (docs/testing.md): ruff, the floors, and every test not marked ray, beton, compile, slow, gpu or alone,
# on two workers; tests/tiers.py fails any of them that imports ray, writes a beton or calls torch.compile.
# `make test` is what CI runs.
check: setup
	$(PY) -m ruff check pipeline tests jobs benchmarks
	$(PY) tests/floors.py
	$(PY) -m pytest -q -n $(TEST_WORKERS) --inner-loop

# The tests that time code on the real clock (marked speed, one DAG run among them) with two CPU-bound processes beside
# them, as CI can meet them on a shared machine: no test may depend on how fast the machine is (docs/testing.md).
# Not part of `make test`; about 5 min here. BUSY=N sets the busy processes.
BUSY ?= 2
test-under-load: setup
	$(PY) -m tests.under_load --busy $(BUSY)

# The whole protocol on Fashion-MNIST (writes its data subset first); prints the Pareto table.
demo: setup
	$(PY) -m pipeline run configs/experiments/demo.yaml

bench: setup
	$(PY) -m pipeline bench ops configs/bench_ops.yaml --out runs/bench_ops.md

# Mutation scores of the core modules, each against its own focused tests (docs/reliability.md); not part of
# `make test` or CI: about half an hour on 2 cores. mutmut 3.8.1 runs from .venv-mutmut, made on first use beside the
# venv. MUTATE="cost pareto" runs some modules only.
mutation: setup
	$(PY) tests/mutation.py $(MUTATE)

# The CPU and GPU images with podman or docker (settings: docker/build.sh; an offline base: docker/base-image.sh).
images:
	docker/build.sh

clean-venv:
	rm -rf $(VENV)
