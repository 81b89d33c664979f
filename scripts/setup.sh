#!/usr/bin/env bash
# Create .venv (if missing) and install recckpt with its test dependencies.
# torch is installed first and pinned: a bare `torch` requirement would pull several GB of CUDA wheels.
# A second run with nothing changed only checks stamps: dependencies are reinstalled when pyproject.toml
# changes, the C++ extension is rebuilt when csrc/, setup.py or pyproject.toml change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${RECCKPT_TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp() { cat "$@" 2>/dev/null | sha256sum | cut -d' ' -f1; }
deps_stamp="$(echo "torch==$TORCH" | sha256sum | cut -d' ' -f1)-$(stamp pyproject.toml scripts/setup.sh)"
build_stamp=$(stamp setup.py pyproject.toml $(ls csrc/* | sort))
if [ "$(cat .venv/.recckpt-deps 2>/dev/null)" != "$deps_stamp" ]; then
  $VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # Build requirements of the extension (installed here because the builds below use no isolation).
  $VPY -m pip install -q pybind11 "setuptools>=77" wheel
  # The engine needs no torch to build: it compiles on the CPUs while pip downloads and unpacks.
  rm -f recckpt/_C*.so
  $VPY setup.py -q build_ext --inplace > .venv/build.log 2>&1 &
  build_pid=$!
  $VPY -m pip install -q "torch==$TORCH"
  # The object-store test server first, alone: resolved together with everything else, pip's
  # backtracking has been seen to wander into ancient Python-2-only releases of its dependencies.
  $VPY -m pip install -q "moto[server]>=5.1" "s3fs>=2026.9"
  wait "$build_pid" || { cat .venv/build.log >&2; echo "setup.sh: building the engine failed" >&2; exit 1; }
  so=$(ls recckpt/_C*.so)
  RECCKPT_PREBUILT_EXT="$PWD/$so" $VPY -m pip install -q --no-build-isolation -e ".[test]"
  echo "$deps_stamp" > .venv/.recckpt-deps
  echo "$build_stamp" > .venv/.recckpt-build   # the engine was built above, from these sources
elif [ "$(cat .venv/.recckpt-build 2>/dev/null)" != "$build_stamp" ] || ! ls recckpt/_C*.so >/dev/null 2>&1; then
  $VPY setup.py -q build_ext --inplace >/dev/null
  echo "$build_stamp" > .venv/.recckpt-build
fi
# Bytecode of this tree's modules: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines)
# Python never writes it, and each of the tests' many processes would compile recckpt again (0.6 s to
# import its API, 0.13 s from bytecode). A module edited later is compiled in memory: Python checks each
# file's time and size against its bytecode.
$VPY -m compileall -q -j 0 recckpt tests benchmarks examples >/dev/null 2>&1 || true
