"""Helpers for GPU tests: host<->device conversion of every dtype and tolerances by dtype."""

import numpy as np

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None

DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
if BFLOAT16 is not None:
    DTYPES.insert(1, BFLOAT16)

# Relative tolerance per dtype, for a kernel result against the float64 reference evaluated on the
# same (already rounded) inputs: the result is rounded once to the dtype (half an ulp) after fp32
# arithmetic (fp16/bf16) or after a handful of correctly-rounded-ish operations (fp32, fp64).
RTOL = {np.dtype(np.float16): 1e-3, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
if BFLOAT16 is not None:
    RTOL[BFLOAT16] = 8e-3

# The absolute error of anything tiny: each dtype's subnormal spacing, times 16 for float32 and
# bfloat16 (computed in float32, whose exp and log of a subnormal result are a few of its ulps
# off).  The kernels keep subnormals (no flush to zero), as torch does.
TINY = {np.dtype(np.float16): 2.0**-24, np.dtype(np.float32): 2.0**-145,
        np.dtype(np.float64): 2.0**-1074}
if BFLOAT16 is not None:
    TINY[BFLOAT16] = 2.0**-133


def cupy_module():
    """cupy, imported at the first test that runs (collection needs no GPU)."""
    import cupy

    return cupy


def cupyloss_module():
    """cupyloss, imported at the first test that runs."""
    import cupyloss

    return cupyloss


def to_device(a, dtype):
    """float64 host values -> (device array of dtype, the rounded values as float64 on the host)."""
    import cupy

    host = np.asarray(a, dtype=np.float64).astype(dtype)
    return cupy.asarray(host), host.astype(np.float64)


def to_host(a):
    """A device array of any supported dtype as a float64 NumPy array."""
    return np.asarray(a.get()).astype(np.float64)


def assert_close(got, ref, dtype, scale=None, what=""):
    """|got - ref| <= rtol |ref| + rtol * scale + tiny, NaN where and only where ref is NaN.

    `scale` is the magnitude the result was formed from (the sum of |terms| over the divisor for a
    reduction, the typical element for elementwise results): rounding in the accumulator type is
    relative to it, not to a result that cancellation made small.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    # A result past the dtype's range rounds to +-inf (torch gives the same inf).
    with np.errstate(over="ignore"):
        rounded = ref.astype(dtype).astype(np.float64)
    ref = np.where(np.isinf(rounded) & np.isfinite(ref), rounded, ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    nan_ref, nan_got = np.isnan(ref), np.isnan(got)
    assert np.array_equal(nan_ref, nan_got), f"{what}: NaN at {np.argwhere(nan_ref != nan_got)[:5]}"
    inf_ref = np.isinf(ref)
    assert np.array_equal(got[inf_ref], ref[inf_ref]), f"{what}: infinities differ"
    rtol = RTOL[np.dtype(dtype)]
    finite = ~nan_ref & ~inf_ref
    if scale is None:
        scale = np.mean(np.abs(ref[finite & np.isfinite(ref)])) if np.any(finite) else 0.0
    # A magnitude: per-element terms passed as the scale of a 'none' result may be negative
    # (nll_loss's -w x where a rounded log-probability is above 0).
    scale = np.abs(scale)
    tol = rtol * np.abs(ref) + rtol * scale + TINY[np.dtype(dtype)]
    with np.errstate(invalid="ignore"):
        bad = finite & ~(np.abs(got - ref) <= tol) & ~(got == ref)
    assert not np.any(bad), (
        f"{what}: {np.count_nonzero(bad)} of {ref.size} off; first at "
        f"{np.argwhere(bad)[:3].tolist()}: got {got[bad][:3]} want {ref[bad][:3]}")


def assert_same(got, want, what=""):
    """Bitwise the same values (NaN where NaN), naming the first elements that differ."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    differ = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    assert not np.any(differ), (
        f"{what}: {np.count_nonzero(differ)} of {got.size} differ; first at "
        f"{np.argwhere(differ)[:3].tolist()}: {got[differ][:3].tolist()} against "
        f"{want[differ][:3].tolist()}")
