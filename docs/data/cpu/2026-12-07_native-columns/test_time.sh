#!/bin/bash
# Issue 78's cost in test time: `make test`'s steps at the commit before the issue's first (7657179) and at
# 9a3d19e (its kernels and their tests, before the latency tables' key named the library), one after the other on the
# 2-core AMD EPYC VM, both from a git clone with an existing venv, not a fresh install (pyproject.toml,
# constraints.txt, the Makefile and tests/conftest.py are the same at both commits). Outputs under /tmp/tt78/
# (test_time_*.log in this folder; test_time_durations.md sums the JUnit reports by file). The commits between
# include other issues' tests too.
set -u
PY=/work/main/.venv/bin/python; OUT=/tmp/tt78
run_at() {  # $1 commit, $2 label
  local dir=/tmp/tt78_$2
  rm -rf "$dir"; git clone -q /work/main "$dir" && git -C "$dir" checkout -q "$1"
  cd "$dir" || return
  { git log --oneline -1; date -u; uptime; grep -m1 "model name" /proc/cpuinfo
    export PYTHONPATH=$dir
    time $PY -m ruff check pipeline tests jobs benchmarks
    time $PY tests/floors.py
    time $PY -m pytest -q -n 2 --dist loadfile -m "not alone" -p no:cacheprovider --junitxml=$OUT/report_$2.xml
    time $PY -m pytest -q -m alone -p no:cacheprovider --junitxml=$OUT/report_alone_$2.xml
    date -u; } > $OUT/test_time_$2.log 2>&1
  cd /tmp && rm -rf "$dir"
}
run_at 7657179 before
run_at 9a3d19e after
