"""Host-side checks that run before any launch: reductions, shapes, wrt, argument kinds, dtypes.

Nothing here needs a CUDA device: every error must be raised from metadata alone, so on a
machine without a GPU (CI) a wrong argument gives its TypeError or ValueError, not a CUDA error.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyloss
from cupyloss._core import dtypes as _dtypes, reduction as _reduction, validate as _validate

# --- reductions ------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["abc", "Mean", "mean ", "", None, 1])
def test_check_reduction_rejects_unknown_values(reduction):
    with pytest.raises(ValueError,
                       match=f"^{re.escape(repr(reduction))} is not a valid value for reduction$"):
        _reduction.check_reduction(reduction)


def test_check_reduction_wording():
    with pytest.raises(ValueError) as info:
        _reduction.check_reduction("abc")
    assert str(info.value) == "'abc' is not a valid value for reduction"


def test_check_reduction_honours_allowed():
    _reduction.check_reduction("batchmean")
    with pytest.raises(ValueError, match="'batchmean' is not a valid value for reduction"):
        _reduction.check_reduction("batchmean", ("none", "mean", "sum"))


# (reduction, numel of the broadcast shape, input shape, divisor of the summed loss)
DIVISORS = [
    ("none", 12, (3, 4), 1.0),
    ("sum", 12, (3, 4), 1.0),
    ("mean", 12, (3, 4), 12.0),
    ("batchmean", 12, (3, 4), 3.0),  # input.shape[0]
    ("mean", 24, (3, 4), 24.0),  # mean counts the broadcast elements, e.g. (2, 3, 4)
    ("batchmean", 24, (4,), 4.0),  # batchmean reads the input's first dim, not the broadcast's
    ("none", 0, (0, 4), 1.0),  # empty
    ("sum", 0, (0, 4), 1.0),
    ("mean", 0, (0, 4), 0.0),  # 0 / 0 on the device: NaN, as torch
    ("batchmean", 0, (0, 4), 0.0),  # torch: sum / input.size(0) = 0 / 0
    ("batchmean", 0, (4, 0), 4.0),  # empty but a batch of 4
    ("none", 1, (), 1.0),  # 0-d
    ("sum", 1, (), 1.0),
    ("mean", 1, (), 1.0),
    ("batchmean", 1, (), 1.0),  # a 0-d input has no batch dim: divide by 1
]


@pytest.mark.parametrize("reduction, numel, shape, divisor", DIVISORS)
def test_divisor_and_grad_scale(reduction, numel, shape, divisor):
    assert _reduction.divisor(reduction, numel, shape) == divisor
    scale = _reduction.grad_scale(reduction, numel, shape)
    if divisor == 0:
        assert math.isnan(scale)
    else:
        assert scale == 1.0 / divisor


# --- broadcast_shape -------------------------------------------------------------------------

@st.composite
def _shape_pairs(draw):
    """Two shapes of up to 5 dims with sizes 0..3, made to broadcast about half the time."""
    a = draw(st.lists(st.integers(0, 3), max_size=5))
    if draw(st.booleans()):
        b = draw(st.lists(st.integers(0, 3), max_size=5))
    else:  # drop leading dims of a and set some to 1: always broadcasts
        b = [1 if draw(st.booleans()) else size for size in a[draw(st.integers(0, len(a))):]]
    if draw(st.booleans()):
        a, b = b, a
    return tuple(a), tuple(b)


@settings(max_examples=500, deadline=None)
@given(_shape_pairs())
def test_broadcast_shape_matches_numpy(pair):
    a, b = pair
    try:
        want = np.broadcast_shapes(a, b)
    except ValueError:
        with pytest.raises(ValueError) as info:
            _validate.broadcast_shape(a, b)
        assert str(a) in str(info.value) and str(b) in str(info.value)
    else:
        assert _validate.broadcast_shape(a, b) == want


def test_broadcast_shape_error_names_both_arguments():
    with pytest.raises(ValueError, match=r"input shape \(2, 3\) and target shape \(4,\) do not"):
        _validate.broadcast_shape((2, 3), (4,))
    with pytest.raises(ValueError, match=r"grad_output shape \(0,\) and loss shape \(2,\)"):
        _validate.broadcast_shape((0,), (2,), "grad_output", "loss")


# --- wrt -------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrt, names, single", [
    ("input", ("input",), True),
    ("target", ("target",), True),
    (("input", "target"), ("input", "target"), False),
    (("target", "input"), ("target", "input"), False),  # order is the caller's
    (["target"], ("target",), False),  # a one-name sequence returns a one-element tuple
])
def test_check_wrt_accepts(wrt, names, single):
    assert _validate.check_wrt(wrt) == (names, single)


@pytest.mark.parametrize("wrt, message", [
    ("weight", "wrt names 'weight'"),
    (("input", "bias"), "wrt names 'bias'"),
    ("inputs", "wrt names 'inputs'"),
    (("input", "input"), "wrt names an argument twice"),
])
def test_check_wrt_rejects(wrt, message):
    with pytest.raises(ValueError, match=message):
        _validate.check_wrt(wrt)


# --- the dtype table -------------------------------------------------------------------------

def test_dtype_table():
    want = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
    if _dtypes._BFLOAT16 is not None:
        want.add(_dtypes._BFLOAT16)
    assert set(_dtypes.DTYPES) == want
    for dtype, info in _dtypes.DTYPES.items():
        assert info.dtype == dtype
        assert info.vec * dtype.itemsize == 16, f"{dtype}: vector loads must be 16 bytes"
        want_acc = np.float64 if dtype == np.float64 else np.float32
        assert info.acc == np.dtype(want_acc), dtype
        assert _dtypes.lookup(dtype) is info and _dtypes.lookup(dtype.name) is info
    assert _dtypes.CTYPES == tuple(info.ctype for info in _dtypes.DTYPES.values())
    assert len(set(_dtypes.CTYPES)) == len(_dtypes.CTYPES)


def test_bfloat16_is_supported_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert _dtypes.lookup(ml_dtypes.bfloat16).ctype == "__nv_bfloat16"


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.object_,
                                   "not a dtype"])
def test_lookup_of_unsupported_dtypes_is_none(dtype):
    assert _dtypes.lookup(dtype) is None


# --- cross_entropy's softcap -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.float64])
@pytest.mark.parametrize("cap", [0.0, 30.0, 1.0, 3e-39, 1e30])
def test_check_softcap_accepts(dtype, cap):
    assert _validate.check_softcap(cap, dtype) == cap


@pytest.mark.parametrize("cap, dtype", [
    (-1.0, np.float32), (float("nan"), np.float32), (float("inf"), np.float32),
    (1e-40, np.float32), (1e-40, "bfloat16"), (1e39, np.float32), (-1e-300, np.float64),
    (1e-310, np.float64), (float("inf"), np.float64),
])
def test_check_softcap_rejects(cap, dtype):
    """Negative, NaN, infinite, or a cap whose reciprocal (which the kernels multiply by) or
    itself overflows the accumulator: float32 for every dtype but float64."""
    acc = "float64" if np.dtype(dtype) == np.float64 else "float32"
    with pytest.raises(ValueError, match=rf"^softcap must be 0 \(no cap\) or a number from .* "
                                         rf"finite in {acc}\), got "):
        _validate.check_softcap(cap, dtype)


def test_check_softcap_reads_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert _validate.check_softcap(1e-300, torch.float64) == 1e-300
    with pytest.raises(ValueError, match="finite in float32"):
        _validate.check_softcap(1e-300, torch.bfloat16)


def test_distinct_elements_finds_overlapping_views():
    """inplace=True writes each element once only where no two indices share an address: a
    stride of 0 and an as_strided view whose rows overlap are refused, sliced, transposed and
    negative-stride views pass."""
    from cupyloss._core.validate import distinct_elements

    assert distinct_elements((4, 8), (8, 1))            # C order
    assert distinct_elements((4, 8), (1, 4))            # F order
    assert distinct_elements((4, 8), (16, 2))           # sliced
    assert distinct_elements((4, 8), (-8, 1))           # reversed rows
    assert distinct_elements((1, 8), (0, 1))            # a dim of one
    assert not distinct_elements((4, 8), (0, 1))        # broadcast rows
    assert not distinct_elements((4, 8), (4, 1))        # rows that overlap by half
    assert not distinct_elements((4, 8), (8, 2))        # columns running into the next row
    assert not distinct_elements((3, 2, 2), (2, 1, 1))


def test_byte_strides_must_be_whole_elements():
    from cupyloss._core import dispatch as _dispatch

    assert _dispatch.element_strides((32, 4), 4, "input") == (8, 1)
    with pytest.raises(ValueError, match="not multiples of its element size 4"):
        _dispatch.element_strides((32, 6), 4, "input")


def test_fused_and_vocab_parallel_losses_check_targets_like_torch():
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w = torch.randn(4, 3), torch.randn(5, 3)
    t = torch.tensor([0, 4, -100, 7])
    with pytest.raises(IndexError, match="Target 7 is out of bounds."):
        CF.linear_cross_entropy(h, w, t, check_targets=True)
    with pytest.raises(IndexError, match="Target 7 is out of bounds."):
        CF.vocab_parallel_cross_entropy(torch.randn(4, 5), t, check_targets=True)
    with pytest.raises(IndexError, match="Target 7 is out of bounds."):
        CF.vocab_parallel_linear_cross_entropy(h, w, t, check_targets=True)
    t[3] = 1
    assert torch.isfinite(CF.linear_cross_entropy(h, w, t, check_targets=True))


# Every family's _backward with a wrt that names no array of it, or one twice: the same
# ValueError from the one check (cupyloss._core.validate.check_wrt), raised before the arrays
# are read (so these run without a GPU: the arrays are never touched).
_WRT_CALLS = {
    "mse_loss": lambda wrt: cupyloss.mse_loss_backward(1.0, "x", "y", wrt=wrt),
    "cross_entropy": lambda wrt: cupyloss.cross_entropy_backward(1.0, "x", "y", wrt=wrt),
    "multi_margin_loss": lambda wrt: cupyloss.multi_margin_loss_backward(1.0, "x", "y", wrt=wrt),
    "jsd": lambda wrt: cupyloss.jsd_backward(1.0, "x", "y", wrt=wrt),
    "triplet_margin_loss": lambda wrt: cupyloss.triplet_margin_loss_backward(
        1.0, "a", "p", "n", wrt=wrt),
    "linear_cross_entropy": lambda wrt: cupyloss.linear_cross_entropy_backward(
        1.0, "h", "w", "y", wrt=wrt),
}


@pytest.mark.parametrize("loss", sorted(_WRT_CALLS))
def test_wrt_is_checked_one_way_in_every_family(loss):
    call = _WRT_CALLS[loss]
    with pytest.raises(ValueError, match=r"^wrt names 'nothing'; it takes '\w+', .* or a "
                                         r"sequence of them$"):
        call("nothing")
    with pytest.raises(ValueError, match=r"^wrt names 'nothing'; it takes "):
        call(("nothing",))
    first = {"triplet_margin_loss": "anchor", "linear_cross_entropy": "hidden"}.get(loss, "input")
    with pytest.raises(ValueError, match=r"^wrt names an argument twice"):
        call((first, first))
