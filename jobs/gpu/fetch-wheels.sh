#!/usr/bin/env bash
# Downloads into DIR (default .whl) the pure-Python packages that a bare CUDA image (torch, numpy, PyYAML and
# triton only) lacks but `pipeline.models`, `pipeline.flops` and `pipeline.bench` import, at the versions of
# constraints.txt, as wheels for Python 3.12 on x86-64 Linux (jobs/gpu/README.md says how to use them).
#   bash jobs/gpu/fetch-wheels.sh [DIR]
set -euo pipefail
dir=${1:-.whl}; mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 yacs==0.1.8 termcolor==3.3.0 timm==1.0.31
python3 -m pip wheel -q --no-deps -w "$dir" fvcore==0.1.5.post20221221 iopath==0.1.10   # sdists: built here
ls "$dir"
