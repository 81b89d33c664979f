#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. RECCKPT_SLOW=1 also runs the long stress checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The TorchRec integration's tests need torchrec (installed with --no-deps; see the script).
bash scripts/install_torchrec.sh
exec .venv/bin/python -m pytest -q "$@"
