"""GPU tests of gradients summed over broadcast dims (pointwise_reduce and pointwise_rows).

Each output element of a broadcast operand's gradient here is a sum of 10^5 or more terms, the
regime where a sequential fp32 sum visibly drifts; it is checked against the float64 reference
with a tolerance relative to the terms' absolute sum (gpu_util.assert_close's `scale`).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
import strategies
from gpu_util import DTYPES, assert_close, to_device, to_host
from test_pointwise_gpu import (CASES, _args, _call, _case_id, _magnitude, _operands, _ref,
                                _required, _sum_scale, _view)

pytestmark = pytest.mark.gpu

KEPT_SIZES = (2, 3, 5, 7, 8)          # a handful of outputs: each gets many terms
MAX_OUTPUTS = 16                      # keeps the float64 reference at 2 10^6 elements or less
REDUCED_SIZES = (2, 3, 7, 31, 32, 33, 128, 129, 256)   # warp and vector edges, odd widths
MIN_TERMS = 100_000


@st.composite
def broadcast_patterns(draw):
    """(full shape, operand shape): 2 to 4 dims, each kept or broadcast (at least one of
    each, in any order: leading, trailing, middle, several), the broadcast ones multiplying to
    10^5..1.3 10^5 terms per output element; leading broadcast dims sometimes dropped."""
    ndim = draw(st.integers(2, 4))
    mask = draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)
                .filter(lambda m: any(m) and not all(m)))
    reduced = [d for d in range(ndim) if mask[d]]
    full, budget = [], MAX_OUTPUTS
    for b in mask:
        size = 0 if b else draw(st.sampled_from([s for s in KEPT_SIZES if s <= budget] or [1]))
        budget //= max(size, 1)
        full.append(size)
    terms = draw(st.integers(MIN_TERMS, 130_000))
    rest = terms
    for d in reduced[:-1]:
        full[d] = draw(st.sampled_from([s for s in REDUCED_SIZES if s * 2 <= rest] or [2]))
        rest = -(-rest // full[d])
    full[reduced[-1]] = rest
    operand = [1 if b else s for b, s in zip(mask, full)]
    lead = 0
    while lead < ndim and mask[lead] and draw(st.booleans()):
        lead += 1
    return tuple(full), tuple(operand[lead:])


def _broadcast_names(case):
    """The arrays of a case that may take the broadcast shape: gaussian_nll_loss's input and var
    must match each other (torch's rules), so only its target there."""
    if case.name == "gaussian_nll_loss":
        return ["target"]
    return _required(case.name) + list(case.extras)


def _terms_scale(case, host, name, reduction, ref_go, full):
    """sum over the broadcast dims of |term|: the gradient of `name` with `name` expanded to the
    full shape, absolute, summed back to `name`'s shape."""
    shape = host[name].shape
    padded = (1,) * (len(full) - len(shape)) + shape
    expanded = dict(host)
    expanded[name] = np.broadcast_to(host[name].reshape(padded), full).copy()
    terms = _ref(case, expanded, reduction, ref_go)[name]
    axes = tuple(d for d, (a, b) in enumerate(zip(padded, full)) if a == 1 and b != 1)
    with np.errstate(invalid="ignore"):
        return np.nansum(np.abs(terms), axis=axes, keepdims=True).reshape(shape)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pattern=broadcast_patterns(), seed=strategies.seeds())
def test_broadcast_gradients_match_float64(data, pattern, seed):
    """Every loss x dtype x reduction x broadcast pattern x view: the value, the full-size
    gradients and the summed gradient against float64; one pass or two, the same numbers."""
    draw = data.draw
    full, bshape = pattern
    case = draw(st.sampled_from(CASES), label="case")
    name = draw(st.sampled_from(_broadcast_names(case)), label="broadcast operand")
    reduction = draw(st.sampled_from(("none", "mean", "sum")), label="reduction")
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    rng = np.random.default_rng(seed)
    shapes = {n: full for n in _required(case.name) + list(case.extras)}
    shapes[name] = bshape
    host64 = _operands(case, rng, shapes)
    dev, host = {}, {}
    for k, v in host64.items():
        d, host[k] = to_device(v, dtype)
        dev[k] = _view(draw, d)
    out_shape = np.shape(_ref(case, host, "none"))
    assert out_shape == full
    if reduction == "none":
        go, ref_go = to_device(rng.standard_normal(full), dtype)
    else:
        go = ref_go = float(rng.standard_normal())
    ref_v = _ref(case, host, reduction)
    ref_g = _ref(case, host, reduction, ref_go)
    pos, kw = _args(case, dev)
    value, grads = _call(case.name, "vag", *pos, reduction=reduction, grad_output=go, **kw)
    terms = _magnitude(case, host)
    divisor = math.prod(full) if reduction == "mean" else 1
    scale = terms if reduction == "none" else _sum_scale(terms, reduction, divisor)
    assert_close(to_host(value), ref_v, dtype, scale, "value")
    for got, (arg, ref) in zip(grads, ref_g.items()):
        assert got.dtype == dtype and got.shape == ref.shape, arg
        summed = _terms_scale(case, host, arg, reduction, ref_go, full) if arg == name else None
        assert_close(to_host(got), ref, dtype, summed, f"d/d{arg}")
    again = _call(case.name, "backward", go, *pos, reduction=reduction, **kw)
    for a, b in zip(again, grads):
        assert np.array_equal(to_host(a), to_host(b), equal_nan=True)


# (full shape, broadcast operand shape), one per route a summed gradient takes.
PATTERNS = {
    "per_channel": ((16, 64, 56, 56), (1, 64, 1, 1)),   # [M1, O, M2]
    "per_row": ((2048, 1000), (2048, 1)),                # [O, M], M innermost
    "rows": ((4099, 1024), (1024,)),                     # pointwise_rows
    "middle": ((8, 2000, 64), (8, 1, 64)),               # [O1, M, O2], O innermost
    "several": ((6, 7, 64, 5, 33), (1, 7, 1, 5, 1)),     # three broadcast dims
    "two_outputs": ((2, 1 << 21), (2, 1)),               # few outputs, long sums: many chunks
}


@pytest.mark.parametrize("case", [c for c in CASES if c.name in (
    "mse_loss", "binary_cross_entropy_with_logits", "margin_ranking_loss", "gaussian_nll_loss",
    "sigmoid_focal_loss")], ids=_case_id)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_bitwise_deterministic(case, pattern):
    """Ten runs of value_and_grad give bitwise the same value and gradients."""
    full, bshape = PATTERNS[pattern]
    rng = np.random.default_rng(2)
    shapes = {n: full for n in _required(case.name) + list(case.extras)}
    shapes[_broadcast_names(case)[0]] = bshape
    for extra in case.extras:
        shapes[extra] = bshape
    host = _operands(case, rng, shapes)
    dev = {k: to_device(v, np.float32)[0] for k, v in host.items()}
    pos, kw = _args(case, dev)
    first = None
    for _ in range(10):
        v, grads = _call(case.name, "vag", *pos, reduction="mean", **kw)
        now = [a.get().tobytes() for a in (v, *grads)]
        if first is None:
            first = now
        assert now == first


def test_operands_broadcast_along_different_dims():
    """x per channel, t per position, both with gradients: a pass each, the same numbers as
    separate backward calls, each against float64."""
    rng = np.random.default_rng(5)
    x, xr = to_device(rng.standard_normal((1, 64, 1, 1)), np.float32)
    t, tr = to_device(rng.standard_normal((32, 1, 56, 56)), np.float32)
    loss, (gx, gt) = _call("mse_loss", "vag", x, t)
    assert_close(to_host(loss), reference.loss("mse_loss", xr, tr), np.float32)
    want = reference.grads("mse_loss", xr, tr)
    for got, ref in zip((gx, gt), want):
        assert_close(to_host(got), ref, np.float32)
    gx2 = _call("mse_loss", "backward", 1.0, x, t, wrt="input")
    assert to_host(gx2).tobytes() == to_host(gx).tobytes()


def test_summed_gradient_as_exact_as_torch():
    """The issue's case, x (1,7,1,1) against t (2,7,129,64): x's gradient is no further from
    float64 than torch's fp32 one, plus at most one rounding of the result."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(6)
    xh = rng.standard_normal((1, 7, 1, 1)).astype(np.float32)
    th = rng.standard_normal((2, 7, 129, 64)).astype(np.float32)
    x, t = torch.tensor(xh, device="cuda", requires_grad=True), torch.tensor(th, device="cuda")
    torch.mean((x - t) ** 2).backward()
    ref = reference.grads("mse_loss", xh.astype(np.float64), th.astype(np.float64))[0]
    _, (gx, _) = _call("mse_loss", "vag", to_device(xh, np.float32)[0],
                       to_device(th, np.float32)[0])
    ours = np.max(np.abs(to_host(gx) - ref) / np.abs(ref))
    theirs = np.max(np.abs(x.grad.double().cpu().numpy() - ref) / np.abs(ref))
    assert ours <= theirs + 2.0**-24, (ours, theirs)
