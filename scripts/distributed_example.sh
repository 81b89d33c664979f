#!/usr/bin/env bash
# The distributed example (gloo, CPU): train on 2 workers with a CheckpointManager, SIGKILL the job
# mid-run, resume on 2 and check every loss equals an uninterrupted run's bit for bit, then resume on 3.
# Usage: scripts/distributed_example.sh [output dir] [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist_demo_output}
STEPS=${2:-30}
PY=${PYTHON:-.venv/bin/python}
RUN=("$PY" -m torch.distributed.run --standalone)
rm -rf "$OUT"
"${RUN[@]}" --nproc_per_node=2 examples/distributed_train.py --out "$OUT/whole" --steps "$STEPS" --async
if "${RUN[@]}" --nproc_per_node=2 examples/distributed_train.py --out "$OUT/run" --steps "$STEPS" --async \
    --kill-at $((STEPS / 2 + 2)) >"$OUT.killed.log" 2>&1; then
  echo "the job was meant to be killed" >&2; exit 1
fi
echo "killed on 2 workers after step $((STEPS / 2 + 2))"
"${RUN[@]}" --nproc_per_node=2 examples/distributed_train.py --out "$OUT/run" --steps "$STEPS" --async
"$PY" - "$OUT" <<'PYEOF'
import sys
def losses(path):
    out = {}
    for line in open(path):
        step, value = line.split()
        out[int(step)] = value          # a step run again after the restart: the last one wins
    return out
whole, run = losses(f"{sys.argv[1]}/whole/losses-2.txt"), losses(f"{sys.argv[1]}/run/losses-2.txt")
assert whole == run, "resumed losses differ from the uninterrupted run"
print(f"killed and resumed on 2 workers: all {len(run)} losses equal the uninterrupted run's bit for bit")
PYEOF
"${RUN[@]}" --nproc_per_node=3 examples/distributed_train.py --out "$OUT/run" --steps $((STEPS + 10)) --async
rm -f "$OUT.killed.log"
