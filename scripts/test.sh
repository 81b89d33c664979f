#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. RECCKPT_SLOW=1 also runs the long stress checks.
# With arguments, runs `pytest -q ARGS` instead (one process, e.g. `bash scripts/test.sh tests/unit -k s3`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The TorchRec integration's tests need torchrec (installed with --no-deps; see the script).
bash scripts/install_torchrec.sh
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# Two parts, so that the suite fits a 2-CPU CI machine's time:
# - the one-process tests (unit/, spec/) on two CPUs at once, a whole file to each (pytest-xdist);
# - then the tests that start worker processes of their own (multiprocess/, torchrec_tests/, stress/),
#   one at a time: their ranks take every CPU, and their time limits are set for an unloaded machine.
# Both parts always run; the suite fails if either does.
rc=0
"${PYTEST[@]}" -n 2 --dist loadfile tests/unit tests/spec || rc=$?
"${PYTEST[@]}" tests/multiprocess tests/torchrec_tests tests/stress || rc=$((rc ? rc : $?))
exit "$rc"
