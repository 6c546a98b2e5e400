"""Reductions none/sum/mean/batchmean: what divides the value and what scales the gradient."""

from __future__ import annotations

import math

REDUCTIONS = ("none", "mean", "sum", "batchmean")


def check_reduction(reduction, allowed=REDUCTIONS):
    """Raise torch's ValueError for a reduction outside `allowed`."""
    if not isinstance(reduction, str) or reduction not in allowed:
        raise ValueError(f"{reduction!r} is not a valid value for reduction")


def divisor(reduction: str, numel: int, input_shape: tuple) -> float:
    """What the summed loss is divided by: n for mean, input.shape[0] for batchmean (1 for 0-d).

    An empty mean divides 0 by 0 on the device and gives NaN, as torch does.
    """
    if reduction == "mean":
        return float(numel)
    if reduction == "batchmean" and len(input_shape) > 0:
        return float(input_shape[0])
    return 1.0


def grad_scale(reduction: str, numel: int, input_shape: tuple) -> float:
    """The factor every elementwise gradient carries: 1 / divisor (NaN when that divisor is 0)."""
    d = divisor(reduction, numel, input_shape)
    return 1.0 / d if d != 0 else math.nan
