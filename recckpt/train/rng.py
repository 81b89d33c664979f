"""Every random number generator a training step may draw from, as per-worker IO state.

New HashTable ids are initialised from torch's global RNG, dropout draws from it, readers and samplers
often use Python's `random` or NumPy's global generator; a resumed run reproduces an uninterrupted one
only if all of them resume where they were. Saved per worker (IO state), since each worker's generators
differ. Stored as plain integers and tensors, never pickled.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from ..errors import InvalidArgumentError


class RNGState:
    """`dump_io_state()`/`load_io_state()` over Python `random`, NumPy's global RNG, torch's CPU
    generator and, where CUDA is initialised, every CUDA device's generator."""

    def dump_io_state(self) -> dict:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {"kind": kind, "keys": np.array(keys, copy=True), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
        }
        # Only when CUDA is already in use: querying it would otherwise initialise a device.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_io_state(self, state: dict) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if len(cuda) != torch.cuda.device_count():
                raise InvalidArgumentError(f"RNG state holds {len(cuda)} CUDA generators but this process sees "
                                 f"{torch.cuda.device_count()} devices; resume with the same device layout")
            torch.cuda.set_rng_state_all(cuda)

    @staticmethod
    def reseed(step: int, rank: int) -> None:
        """Seed every generator from (global step, rank): what a restore onto another number of workers
        does instead of loading per-worker state that cannot be split or merged. Deterministic, so a
        resized run is reproducible, and different per rank, so workers do not draw the same numbers."""
        seed = int.from_bytes(hashlib.blake2b(f"recckpt-rng/{step}/{rank}".encode(), digest_size=8).digest(),
                              "little") & ((1 << 63) - 1)
        random.seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        torch.manual_seed(seed)   # also seeds every CUDA device's generator


__all__ = ["RNGState"]
