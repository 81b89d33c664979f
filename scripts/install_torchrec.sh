#!/usr/bin/env bash
# Install the TorchRec integration's dependencies into .venv (idempotent: a second run only checks versions).
#
# Why a script and not only the `recckpt[torchrec]` extra: torchrec 1.8.0's metadata requires `fbgemm-gpu`,
# the CUDA build, which would be pulled next to `fbgemm-gpu-cpu`; both install the same `fbgemm_gpu` module.
# So the extra lists fbgemm-gpu-cpu and torchrec's pure-Python requirements, and torchrec itself is installed
# here with --no-deps. `pip check` then complains about `fbgemm-gpu`: harmless, fbgemm-gpu-cpu provides it.
# fbgemm-gpu-cpu 1.9.0 does not load against torch 2.13 (undefined symbol), hence the pins.
# RECCKPT_SKIP_TORCHREC=1 skips it (the TorchRec tests then skip with that reason).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
TORCHREC=1.8.0
FBGEMM=1.8.0
if [ "${RECCKPT_SKIP_TORCHREC:-0}" = "1" ]; then
  echo "install_torchrec.sh: skipped (RECCKPT_SKIP_TORCHREC=1)"
  exit 0
fi
have() {
  "$VPY" - "$TORCHREC" "$FBGEMM" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
want = {"torchrec": sys.argv[1], "fbgemm-gpu-cpu": sys.argv[2]}
try:
    ok = all(version(name) == v for name, v in want.items())
    for extra in ("tensordict", "torchmetrics", "pyre-extensions", "iopath", "pyvers"):
        version(extra)
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PY
}
if have; then
  exit 0
fi
# The pure-Python requirements first (the same list as the extra in pyproject.toml), then torchrec alone.
"$VPY" -m pip install -q "fbgemm-gpu-cpu==$FBGEMM" "tensordict==0.15.3" "torchmetrics==1.0.3" tqdm \
  pyre-extensions typing-inspect mypy-extensions cloudpickle "pyvers>=0.2,<0.3" packaging \
  lightning-utilities iopath portalocker
"$VPY" -m pip install -q --no-deps "torchrec==$TORCHREC"
have || { echo "install_torchrec.sh: torchrec $TORCHREC / fbgemm-gpu-cpu $FBGEMM not importable after install" >&2; exit 1; }
