#!/usr/bin/env bash
# The distributed example: train on 2 workers (gloo, CPU) with checkpoints, then resume on 3.
# Usage: scripts/distributed_example.sh [output dir] [steps per phase]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist_demo_output}
STEPS=${2:-30}
PY=${PYTHON:-.venv/bin/python}
rm -rf "$OUT"
"$PY" -m torch.distributed.run --standalone --nproc_per_node=2 examples/distributed_train.py --out "$OUT" --steps "$STEPS"
"$PY" -m torch.distributed.run --standalone --nproc_per_node=3 examples/distributed_train.py --out "$OUT" --steps "$STEPS" --resume
