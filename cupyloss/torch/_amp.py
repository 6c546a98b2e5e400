"""CUDA autocast's rule for cupyloss.torch's fused linear losses (F.linear's there)."""

from __future__ import annotations

import torch

_autocast_on = torch.is_autocast_enabled


def linear_compute(hidden, weight, bias) -> str | None:
    """The products' dtype of a linear call under CUDA autocast, as F.linear's there: the
    autocast dtype, unless every operand already has it or one is float64 (which autocast
    leaves alone); None outside autocast or on the CPU."""
    if hidden.device.type != "cuda" or not _autocast_on("cuda"):
        return None
    dtype = torch.get_autocast_dtype("cuda")
    floats = [a for a in (hidden, weight, bias) if a is not None]
    if any(a.dtype == torch.float64 for a in floats) or all(a.dtype == dtype for a in floats):
        return None
    return str(dtype).replace("torch.", "")
