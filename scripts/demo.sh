#!/usr/bin/env bash
# Set up (idempotent) and run the demo. Output goes under ./demo_output (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py --out "${1:-demo_output}"
