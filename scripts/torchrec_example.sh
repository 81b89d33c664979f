#!/usr/bin/env bash
# The TorchRec example (gloo, CPU): a DLRM sharded table-wise by DistributedModelParallel trains on 2
# workers with CheckpointManager(async_save=True), is SIGKILLed mid-run, resumes on 2 with every loss
# equal to an uninterrupted run's bit for bit, then resumes on 3 workers under a row-wise plan: every
# table's rows and RowWiseAdagrad state after that load equal the checkpoint's, and it trains on.
# Usage: scripts/torchrec_example.sh [output dir] [steps, a multiple of 5] [more steps on 3 workers]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-torchrec_demo_output}
STEPS=${2:-30}
MORE=${3:-20}
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's recckpt, ahead of an installed one
RUN=("$PY" -m torch.distributed.run --standalone)
EX=(examples/torchrec_dlrm.py --async --interval 5)
# run WORLD OUTDIR STEPS ARGS...: one torchrun job, judged by the files its ranks write (a TorchRec rank
# sometimes aborts at exit, after its work is done, and torchrun then exits non-zero).
run() {
  local world=$1 dir=$2 steps=$3; shift 3
  rm -f "$dir"/done-"$world"-rank*
  "${RUN[@]}" --nproc_per_node="$world" "${EX[@]}" --out "$dir" --steps "$steps" "$@" \
    || echo "torchrun exited $? on $world workers; judging by the files the ranks wrote"
  for ((r = 0; r < world; r++)); do
    if [[ "$(cat "$dir/done-$world-rank$r" 2>/dev/null)" != "$steps" ]]; then
      echo "rank $r of $world did not finish step $steps in $dir" >&2; exit 1
    fi
  done
}
rm -rf "$OUT"
mkdir -p "$OUT"
run 2 "$OUT/whole" "$STEPS" --plan tw
KILL=$((STEPS / 2 + 2))
if "${RUN[@]}" --nproc_per_node=2 "${EX[@]}" --out "$OUT/run" --steps "$STEPS" --plan tw --kill-at "$KILL" \
    >"$OUT/killed.log" 2>&1; then
  echo "the job was meant to be killed" >&2; exit 1
fi
if [[ "$(wc -l <"$OUT/run/losses-2.txt")" -ne "$KILL" ]]; then
  echo "the killed job should have logged $KILL steps" >&2; exit 1
fi
echo "killed on 2 workers after step $KILL"
run 2 "$OUT/run" "$STEPS" --plan tw
"$PY" - "$OUT" "$STEPS" <<'PYEOF'
import sys
def losses(path):
    out = {}
    for line in open(path):
        step, value = line.split()
        out[int(step)] = value          # a step run again after the restart: the last one wins
    return out
out, steps = sys.argv[1], int(sys.argv[2])
whole, run = losses(f"{out}/whole/losses-2.txt"), losses(f"{out}/run/losses-2.txt")
assert sorted(whole) == list(range(1, steps + 1)), "the uninterrupted run did not log every step"
assert whole == run, "resumed losses differ from the uninterrupted run"
print(f"killed and resumed on 2 workers: all {len(run)} losses equal the uninterrupted run's bit for bit")
PYEOF
run 3 "$OUT/run" $((STEPS + MORE)) --plan rw --dump-restored "$OUT/restored3"
"$PY" - "$OUT" "$STEPS" "$MORE" <<'PYEOF'
import math, os, sys
import numpy as np, torch, recckpt
out, steps, more = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dump = f"{out}/restored3"
ckpt = os.path.join(out, "run", "ckpt", open(f"{dump}/restored_from").read())
view = recckpt.open(ckpt)
parts = [torch.load(f"{dump}/rank{r}.pt", weights_only=True) for r in range(3)]
for table in view.tables:
    ids, emb, acc = [], [], []
    for i, cols in view.iter_rows(table, ["embedding", "rowwise_adagrad.acc"]):
        ids.append(i); emb.append(cols["embedding"]); acc.append(cols["rowwise_adagrad.acc"])
    order = np.argsort(np.concatenate(ids))
    emb, acc = np.concatenate(emb)[order], np.concatenate(acc)[order]
    n = emb.shape[0]
    got_w, got_m, covered = np.full_like(emb, np.nan), np.full(n, np.nan, acc.dtype), np.zeros(n, int)
    for p in parts:
        for (r0, c0), w in p[table]["weight"]:
            got_w[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w.numpy()
            covered[r0:r0 + w.shape[0]] += 1
        for (r0,), m in p[table]["momentum1"]:
            got_m[r0:r0 + m.shape[0]] = m.numpy()
    assert (covered == 1).all(), f"{table}: the 3-worker shards do not cover every row once"
    assert np.array_equal(got_w, emb), f"{table}: restored embeddings differ from the checkpoint's"
    assert np.array_equal(got_m, acc) and (acc != 0).any(), f"{table}: restored RowWiseAdagrad state differs"
print(f"resumed on 3 workers (row-wise) from {os.path.basename(ckpt)}: {len(view.tables)} tables, every row "
      f"and its RowWiseAdagrad state equal the checkpoint's")
lines = [l.split() for l in open(f"{out}/run/losses-3.txt")]
start = int(os.path.basename(ckpt).rpartition("_")[2])
assert [int(s) for s, _ in lines] == list(range(start + 1, steps + more + 1)), "the 3-worker run's steps"
assert all(math.isfinite(float.fromhex(v)) for _, v in lines), "a non-finite loss on 3 workers"
print(f"trained {len(lines)} more steps on 3 workers, every loss finite")
PYEOF
echo "torchrec example: OK"
