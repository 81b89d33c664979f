#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. RECCKPT_SLOW=1 also runs the long stress checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
