"""The float-to-float casts a load makes where the model's dtype differs from the checkpoint's
(load_conf 'cast'), with one home for what a narrowing cast may lose."""
from __future__ import annotations

import warnings

import torch


def cast_to(t: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """`t` as `dtype`. A cast into a float type of smaller range (fp32 -> fp16, fp64 -> fp32, ...) turns
    finite values beyond that range into inf, as torch's copy does: that is warned about, naming `where`
    (the same words for every chunk of one slot, so the warning shows once)."""
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if (t.is_floating_point() and dtype.is_floating_point
            and torch.finfo(dtype).max < torch.finfo(t.dtype).max and t.numel()):
        lost = int((torch.isinf(out) & torch.isfinite(t)).sum())
        if lost:
            warnings.warn(f"recckpt: {where}: values beyond {dtype}'s range (|x| > {torch.finfo(dtype).max:g}) became "
                          f"inf in the cast from {t.dtype} (load_conf 'cast'); build the model in the checkpoint's "
                          f"dtype, or pass 'cast': False to refuse such loads", stacklevel=2)
    return out
