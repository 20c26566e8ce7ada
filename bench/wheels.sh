#!/usr/bin/env bash
# The bench-only peers a GPU machine's image lacks, as wheels in .whl for bench/gpu.sh to install there
# (Python 3.12, x86-64 Linux): transformers 5.25.0 (bench/hf.py, long_context.py, moe.py), DeepSpeed
# 0.19.8 built with DS_BUILD_OPS=0 (its ALST, ZeRO), torchtitan 0.3.0 (moe.py), and what they import
# that the image has too old or not at all. Run from the repo root where pip reaches PyPI:
#   bash bench/wheels.sh          # then carry .whl (about 30 MB) with the command
set -eu
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
pins=(transformers==5.25.0 "huggingface-hub==2.4.0" kernels==0.19.1 hf-xet==1.8.0 httpx2==2.17.0 httpcore2==2.17.0
      h11==0.16.0 anyio==4.16.0 idna==3.21 truststore==0.10.5 click==8.5.1 tomlkit==0.15.3
      typing-extensions==4.16.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 hjson==3.1.0 torchtitan==0.3.0 torchdata==0.11.0 torch-checkpointing==0.1.1
      spmd-types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
ls .whl
