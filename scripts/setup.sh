#!/usr/bin/env bash
# Create .venv (if missing) and install recckpt with its test dependencies.
# torch is installed first and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==${RECCKPT_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q pybind11 setuptools wheel numpy fsspec safetensors pytest hypothesis
# Build the extension in place (no build isolation: pybind11 is already in the venv, torch is not needed).
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
