"""Which TorchRec / FBGEMM versions the integration is tested with, and the error when they are missing."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ...errors import MissingDependencyError

TORCHREC = "1.8.0"
FBGEMM = "1.8.0"
INSTALL_HINT = ("install it with `bash scripts/install_torchrec.sh` (in a recckpt checkout), or with "
                "`pip install 'recckpt[torchrec]'` followed by `pip install --no-deps torchrec==1.8.0`")


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def fbgemm_version() -> str | None:
    """fbgemm_gpu is installed as fbgemm-gpu-cpu (CPU build) or fbgemm-gpu (CUDA build)."""
    return installed("fbgemm-gpu-cpu") or installed("fbgemm-gpu")


def check() -> tuple[str, str]:
    """(torchrec version, fbgemm version), or MissingDependencyError naming the extra and the script."""
    tr, fb = installed("torchrec"), fbgemm_version()
    if tr is None or fb is None:
        missing = " and ".join(n for n, v in (("torchrec", tr), ("fbgemm-gpu-cpu", fb)) if v is None)
        raise MissingDependencyError(
            f"recckpt's TorchRec integration needs {missing}, which is not installed: {INSTALL_HINT}")
    if tr != TORCHREC or fb.split("+")[0] != FBGEMM:
        raise MissingDependencyError(
            f"recckpt's TorchRec integration is tested with torchrec {TORCHREC} and fbgemm-gpu-cpu {FBGEMM}; "
            f"found torchrec {tr} and fbgemm {fb} (fbgemm-gpu-cpu 1.9.0 does not load against torch 2.13): "
            f"{INSTALL_HINT}")
    return tr, fb
