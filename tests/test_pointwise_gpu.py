"""GPU tests of the pointwise losses against the float64 references in tests/reference.py."""

import math
import warnings
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
import strategies
from gpu_util import DTYPES, RTOL, assert_close, assert_same, to_device, to_host

pytestmark = pytest.mark.gpu


class Case(NamedTuple):
    """A loss variant: name, options, and the optional arrays (weight, pos_weight) it gets."""

    name: str
    opts: dict = {}
    extras: tuple = ()


# Every loss, and each option that switches a formula inside the kernel.
CASES = [
    Case("mse_loss"),
    Case("kl_div", {"log_target": False, "log_input": True}),
    Case("kl_div", {"log_target": True, "log_input": True}),
    Case("kl_div", {"log_target": False, "log_input": False}),
    Case("kl_div", {"log_target": True, "log_input": False}),
    Case("hinge_loss", {"margin": 1.0}),
    Case("l1_loss"),
    Case("smooth_l1_loss", {"beta": 1.0}),
    Case("smooth_l1_loss", {"beta": 0.0}),
    Case("huber_loss", {"delta": 0.5}),
    Case("binary_cross_entropy"),
    Case("binary_cross_entropy", {}, ("weight",)),
    Case("binary_cross_entropy_with_logits"),
    Case("binary_cross_entropy_with_logits", {}, ("weight", "pos_weight")),
    Case("binary_cross_entropy_with_logits", {}, ("pos_weight",)),
    Case("soft_margin_loss"),
    Case("hinge_embedding_loss", {"margin": 1.0}),
    Case("margin_ranking_loss", {"margin": 0.5}),
    Case("poisson_nll_loss", {"log_input": True, "full": False}),
    Case("poisson_nll_loss", {"log_input": False, "full": True}),
    Case("gaussian_nll_loss", {"full": False}),
    Case("gaussian_nll_loss", {"full": True, "eps": 0.5}),
    Case("squared_hinge_loss", {"margin": 1.0}),
    Case("sigmoid_focal_loss", {"alpha": 0.25, "gamma": 2.0}),
    Case("sigmoid_focal_loss", {"alpha": -1.0, "gamma": 1.5}),
    Case("log_cosh_loss"),
]
LOSSES = tuple(dict.fromkeys(case.name for case in CASES))
BATCHMEAN = ("kl_div",)  # the only loss with 'batchmean'


def _reductions(name):
    return ("none", "mean", "sum", "batchmean") if name in BATCHMEAN else ("none", "mean", "sum")


def _cl():
    import cupyloss

    return cupyloss


def _call(name, kind, *args, **kw):
    suffix = {"value": "", "backward": "_backward", "vag": "_value_and_grad"}[kind]
    fn = getattr(_cl(), name + suffix)
    return fn(*args, **kw)


def _required(name):
    return [a for a in reference.array_names(name) if a not in ("weight", "pos_weight")]


def _case_id(case):
    return "-".join([case.name] + [f"{k}={v}" for k, v in sorted(case.opts.items())]
                    + ["+" + e for e in case.extras])


def _shapes(case, input_shape, target_shape, extra="trailing", var="same"):
    """Shapes of a case's arrays from a broadcast pair: margin_ranking_loss's pair is (input1,
    input2) and its target the broadcast shape's last dim; weight and pos_weight are that last
    dim ('trailing'), the broadcast shape ('full') or 0-d ('scalar'); gaussian_nll_loss's var
    is input's shape ('same') or input's shape without its last dim ('rows')."""
    out = np.broadcast_shapes(input_shape, target_shape)
    if case.name == "margin_ranking_loss":
        return {"input1": input_shape, "input2": target_shape, "target": out[-1:]}
    shapes = {"input": input_shape, "target": target_shape}
    if case.name == "gaussian_nll_loss":
        shapes["var"] = input_shape[:-1] if var == "rows" and input_shape else input_shape
    for e in case.extras:
        shapes[e] = {"trailing": out[-1:], "full": out, "scalar": ()}[extra]
    return shapes


def _operands(case, rng, shapes, special=False):
    """float64 host values in each loss's usual domain, edges included (exact 0 and 1
    probabilities, large logits, zero counts, variances below eps)."""
    name, o = case.name, case.opts
    normal = lambda key, s=2.0: rng.standard_normal(shapes[key]) * s  # noqa: E731
    uniform = lambda key, a, b: rng.uniform(a, b, shapes[key])  # noqa: E731
    labels = lambda key: np.where(rng.random(shapes[key]) < 0.5, -1.0, 1.0)  # noqa: E731
    sometimes = lambda key, p: rng.random(shapes[key]) < p  # noqa: E731
    if name == "kl_div":
        x = np.log(uniform("input", 0.05, 1.0)) if o["log_input"] else uniform("input", 0.05, 1)
        t = uniform("target", 0.0, 1.0)
        if o["log_target"]:
            t = np.log(t + 0.05)
        else:  # exact zeros: value 0, target gradient NaN (torch's xlogy backward)
            t = np.where(sometimes("target", 0.05), 0.0, t)
        a = {"input": x, "target": t}
    elif name in ("hinge_loss", "squared_hinge_loss", "soft_margin_loss"):
        a = {"input": normal("input"), "target": labels("target")}
    elif name == "binary_cross_entropy":
        x = uniform("input", 0.0, 1.0)
        x = np.where(sometimes("input", 0.03), 0.0, np.where(sometimes("input", 0.03), 1.0, x))
        t = np.where(sometimes("target", 0.5), np.round(uniform("target", 0, 1)),
                     uniform("target", 0, 1))
        a = {"input": x, "target": t}
    elif name in ("binary_cross_entropy_with_logits", "sigmoid_focal_loss"):
        x = np.where(sometimes("input", 0.02), normal("input", 40.0), normal("input", 3.0))
        t = np.where(sometimes("target", 0.7), np.round(uniform("target", 0, 1)),
                     uniform("target", 0, 1))
        a = {"input": x, "target": t}
    elif name == "hinge_embedding_loss":
        a = {"input": np.abs(normal("input")), "target": labels("target")}
    elif name == "margin_ranking_loss":
        a = {"input1": normal("input1"), "input2": normal("input2"), "target": labels("target")}
    elif name == "poisson_nll_loss":
        x = normal("input", 1.0) if o["log_input"] else np.abs(normal("input"))
        a = {"input": x, "target": rng.poisson(3.0, shapes["target"]).astype(np.float64)}
    elif name == "gaussian_nll_loss":
        var = uniform("var", 0.0, 2.0)
        a = {"input": normal("input"), "target": normal("target"),
             "var": np.where(sometimes("var", 0.05), 0.0, var)}
    else:
        a = {"input": normal("input"), "target": normal("target")}
    for e in case.extras:
        a[e] = uniform(e, 0.5, 3.0)
    if special:
        first = _required(name)[0]
        a[first] = np.where(sometimes(first, 0.02), np.nan, a[first])
    return {k: np.asarray(v, dtype=np.float64) for k, v in a.items()}


def _args(case, arrays):
    """(positional arrays, keyword arrays and options) of a call of the case's loss."""
    return ([arrays[n] for n in _required(case.name)],
            {**{e: arrays[e] for e in case.extras}, **case.opts})


def _ref(case, host, reduction, grad_output=None):
    """Reference value, or with grad_output the gradients as name -> array."""
    pos, kw = _args(case, host)
    if grad_output is None:
        return reference.loss(case.name, *pos, reduction, **kw)
    names = _required(case.name) + list(case.extras)
    return dict(zip(names, reference.grads(case.name, *pos, reduction, grad_output, **kw)))


def _view(draw, dev):
    """The same values as `dev`, sometimes as a non-contiguous view (transposed or strided)."""
    import cupy

    kind = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    if kind == "strided" and dev.ndim >= 1:
        big = cupy.zeros(dev.shape[:-1] + (dev.shape[-1] * 2,), dev.dtype)
        big[..., ::2] = dev
        return big[..., ::2]
    if kind == "transposed" and dev.ndim >= 2:
        return cupy.ascontiguousarray(dev.swapaxes(-1, -2)).swapaxes(-1, -2)
    return dev


def _sum_scale(values, reduction, divisor):
    """The magnitude a reduced value is built from: sum |l_i| / divisor."""
    total = np.nansum(np.abs(values))
    return total / divisor if divisor else total


# Units of the accumulator's rounding, times the sum of the partials' magnitudes, that a
# broadcast operand's summed gradient may be off by: each partial is formed in the accumulator
# type (float32 for 16-bit inputs) to within a few of its own units, and the sum adds no more.
SUM_ULPS = 16


def _grad_scales(case, host, dtype, reduction, grad_output, grads):
    """name -> the scale assert_close takes for each gradient (None: the mean |reference|).

    The gradient of a broadcast operand sums the partials over its broadcast axes; when they
    cancel, its error is relative to the sum of their magnitudes (the same partials taken with
    every operand expanded to the common shape, |.| summed back to the operand's shape), not to
    the result: the scale is the larger of the mean |reference| and SUM_ULPS units of the
    accumulator's rounding of that sum, over the dtype's relative tolerance.
    """
    scales = dict.fromkeys(grads)
    views = {k: np.shape(v) for k, v in host.items()}
    if case.name == "gaussian_nll_loss" and "var" in views:  # var's own rule, then broadcasting
        views["var"] = reference.gaussian_var_shape(views["input"], views["var"])
    try:
        expanded = dict(zip(host, np.broadcast_arrays(
            *(np.reshape(v, views[k]) for k, v in host.items()))))
    except ValueError:  # operands that do not broadcast together
        return scales
    full = _ref(case, {k: np.ascontiguousarray(v) for k, v in expanded.items()}, reduction,
                grad_output)
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    unit = SUM_ULPS * np.finfo(acc).eps / 2 / RTOL[np.dtype(dtype)]
    for arg, ref in grads.items():
        g = np.abs(np.asarray(full[arg], np.float64)).reshape(expanded[arg].shape)
        view = views[arg]
        if g.shape == view:
            continue
        lead = g.ndim - len(view)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(view) if n == 1 and g.shape[lead + i] != 1)
        r = np.abs(np.asarray(ref, np.float64))
        mean = np.mean(r[np.isfinite(r)]) if np.isfinite(r).any() else 0.0
        scales[arg] = np.maximum(mean, unit * np.nansum(g, axis=axes).reshape(ref.shape))
    return scales


def _magnitude(case, host):
    """Elementwise size of the terms a loss element is formed from, in the broadcast shape.

    A loss element that is a difference of terms (margin - x t, t log t - t x, exp(x) - t x,
    log v + d^2 / v, ...) rounds relative to those terms, not to the small difference, whichever
    way it is evaluated; losses built from non-negative terms round relative to themselves.
    """
    name, o = case.name, case.opts
    arrays = {k: np.asarray(v, np.float64) for k, v in host.items()}
    with np.errstate(all="ignore"):
        if name == "margin_ranking_loss":
            x1, x2, t = np.broadcast_arrays(arrays["input1"], arrays["input2"], arrays["target"])
            return np.abs(o["margin"]) + np.abs(x1) + np.abs(x2)
        if name == "gaussian_nll_loss":
            var = arrays["var"].reshape(reference.gaussian_var_shape(arrays["input"].shape,
                                                                     arrays["var"].shape))
            x, t, v = np.broadcast_arrays(arrays["input"], arrays["target"],
                                          np.maximum(var, o.get("eps", 1e-6)))
            return 0.5 * (np.abs(np.log(v)) + (x - t) ** 2 / v) + (1.0 if o["full"] else 0.0)
        x, t = np.broadcast_arrays(arrays["input"], arrays["target"])
        if name in ("hinge_loss", "squared_hinge_loss"):
            h = np.maximum(o["margin"] - x * t, 0.0)
            size = np.where(h > 0, abs(o["margin"]) + np.abs(x * t), 0.0)
            return size if name == "hinge_loss" else 2 * h * size + h * h
        if name == "hinge_embedding_loss":
            return abs(o["margin"]) + np.abs(x)
        if name == "kl_div":
            lx = x if o["log_input"] else np.log(x)
            if o["log_target"]:
                return np.abs(np.exp(t) * t) + np.abs(np.exp(t) * lx)
            return np.abs(np.where(t == 0, 0.0, t * np.log(t))) + np.abs(t * lx)
        if name == "poisson_nll_loss":
            size = (np.exp(x) + np.abs(t * x) if o["log_input"]
                    else np.abs(x) + np.abs(t * np.log(x + 1e-8)))
            if o["full"]:
                size = size + np.where(t > 1, np.abs(t * np.log(t)) + t
                                       + np.abs(0.5 * np.log(2 * np.pi * t)), 0.0)
            return size
    return np.abs(_ref(case, host, "none"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pair=strategies.broadcast_pairs(max_elements=100_000),
       seed=strategies.seeds())
def test_value_and_grads_match_reference(data, pair, seed):
    """Every loss x reduction x dtype x broadcast of each array x layout: value, backward and
    value_and_grad, against the float64 reference on the same (rounded) values."""
    draw = data.draw
    case = draw(st.sampled_from(CASES), label="case")
    reduction = draw(st.sampled_from(_reductions(case.name)), label="reduction")
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    extra = draw(st.sampled_from(["trailing", "full", "scalar"]), label="extras")
    var = draw(st.sampled_from(["same", "rows"]), label="var")
    rng = np.random.default_rng(seed)
    host64 = _operands(case, rng, _shapes(case, *pair, extra, var))
    dev, host = {}, {}
    for k, v in host64.items():
        d, host[k] = to_device(v, dtype)
        dev[k] = _view(draw, d)

    ref_v = _ref(case, host, reduction)
    out_shape = np.shape(_ref(case, host, "none"))
    n = math.prod(out_shape)
    if reduction == "none":
        go, ref_go = to_device(rng.standard_normal(out_shape), dtype)
    else:
        go = ref_go = float(rng.standard_normal())
    ref_g = _ref(case, host, reduction, ref_go)

    pos, kw = _args(case, dev)
    value = _call(case.name, "value", *pos, reduction=reduction, **kw)
    assert value.dtype == dtype and value.shape == np.shape(ref_v)
    first = host[_required(case.name)[0]]
    divisor = {"mean": n, "batchmean": first.shape[0] if first.ndim else 1}.get(reduction, 1)
    terms = _magnitude(case, host)
    scale = terms if reduction == "none" else _sum_scale(terms, reduction, divisor)
    assert_close(to_host(value), ref_v, dtype, scale, "value")

    grads = _call(case.name, "backward", go, *pos, reduction=reduction, **kw)
    v2, grads2 = _call(case.name, "vag", *pos, reduction=reduction, grad_output=go, **kw)
    assert len(grads) == len(ref_g) == len(grads2)
    grad_scales = _grad_scales(case, host, dtype, reduction, ref_go, ref_g)
    for got, (arg, ref) in zip(grads, ref_g.items()):
        assert got.dtype == dtype and got.shape == ref.shape, arg
        assert_close(to_host(got), ref, dtype, grad_scales[arg], f"d/d{arg}")
    # One pass or two, the numbers are the same ones.
    assert_same(to_host(v2), to_host(value), "value, value_and_grad against the forward")
    for a, b, arg in zip(grads2, grads, ref_g):
        assert_same(to_host(a), to_host(b), f"d/d{arg}, value_and_grad against backward")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("layout", ["flat", "rows", "scalar", "column"])
def test_bitwise_deterministic(case, layout):
    """Ten runs give bitwise the same value and gradients (no atomics anywhere)."""
    shapes = {"flat": ((1000, 1037), (1000, 1037)), "rows": ((4099, 1024), (1024,)),
              "scalar": ((1 << 20) + 3, ()), "column": ((1000, 777), (1000, 1))}[layout]
    rng = np.random.default_rng(1)
    host = _operands(case, rng, _shapes(case, *shapes))
    dev = {k: to_device(v, np.float32)[0] for k, v in host.items()}
    pos, kw = _args(case, dev)
    first = None
    for _ in range(10):
        v, grads = _call(case.name, "vag", *pos, reduction="sum", **kw)
        now = [a.get().tobytes() for a in (v, *grads)]
        if first is None:
            first = now
        assert now == first


@pytest.mark.parametrize("dtype", DTYPES)
def test_hinge_tie_passes_gradient(dtype):
    """At margin == x t exactly, torch's clamp passes the gradient: d/dx = -t, d/dt = -x."""
    x, _ = to_device([0.5, 0.5, 2.0, -1.0], dtype)
    t, _ = to_device([2.0, 4.0, 0.5, -1.0], dtype)   # x t = 1, 2, 1, 1
    gx, gt = _call("hinge_loss", "backward", 1.0, x, t, reduction="sum")
    np.testing.assert_array_equal(to_host(gx), [-2.0, 0.0, -0.5, 1.0])
    np.testing.assert_array_equal(to_host(gt), [-0.5, 0.0, -2.0, 1.0])
    v = _call("hinge_loss", "value", x, t, reduction="none")
    np.testing.assert_array_equal(to_host(v), [0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_torchs_side(dtype):
    """Exact ties, every dtype: l1's gradient is 0 at x == t; smooth_l1 and huber take the
    constant at |d| == beta (delta); margin_ranking and hinge_embedding pass their clamp's tie."""
    zero, _ = to_device([0.0, 0.0, 0.0, 0.0], dtype)
    d, _ = to_device([0.0, 0.5, -0.5, 0.25], dtype)
    g = _call("l1_loss", "backward", 1.0, d, zero, reduction="sum", wrt="input")
    np.testing.assert_array_equal(to_host(g), [0.0, 1.0, -1.0, 1.0])
    g = _call("smooth_l1_loss", "backward", 1.0, d, zero, reduction="sum", beta=0.5,
              wrt="input")
    np.testing.assert_array_equal(to_host(g), [0.0, 1.0, -1.0, 0.5])
    g = _call("huber_loss", "backward", 1.0, d, zero, reduction="sum", delta=0.5, wrt="input")
    np.testing.assert_array_equal(to_host(g), [0.0, 0.5, -0.5, 0.25])
    one, _ = to_device([1.0, 1.0, 1.0, 1.0], dtype)
    g1, g2, gt = _call("margin_ranking_loss", "backward", 1.0, d, zero, one, reduction="sum")
    np.testing.assert_array_equal(to_host(g1), [-1.0, 0.0, -1.0, 0.0])   # tie at d == 0 passes
    np.testing.assert_array_equal(to_host(g2), [1.0, 0.0, 1.0, 0.0])
    minus, _ = to_device([-1.0, -1.0, -1.0, -1.0], dtype)
    x, _ = to_device([1.0, 0.5, 2.0, 0.0], dtype)
    g = _call("hinge_embedding_loss", "backward", 1.0, x, minus, reduction="sum", wrt="input")
    np.testing.assert_array_equal(to_host(g), [-1.0, -1.0, 0.0, -1.0])   # margin - x == 0 passes


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(case, dtype):
    """NaN in the first array gives NaN values and NaN-or-blocked gradients exactly where the
    reference has them."""
    rng = np.random.default_rng(2)
    host64 = _operands(case, rng, _shapes(case, (257, 33), (257, 33)), special=True)
    dev, host = {}, {}
    for k, v in host64.items():
        dev[k], host[k] = to_device(v, dtype)
    pos, kw = _args(case, dev)
    for reduction in ("none", "sum"):
        got = to_host(_call(case.name, "value", *pos, reduction=reduction, **kw))
        ref = _ref(case, host, reduction)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        if reduction == "sum":
            assert np.isnan(got)
    grads = _call(case.name, "backward", 1.0, *pos, reduction="sum", **kw)
    for got, (arg, ref) in zip(grads, _ref(case, host, "sum", 1.0).items()):
        assert np.array_equal(np.isnan(to_host(got)), np.isnan(ref)), arg


def test_saturated_and_out_of_range_probabilities():
    """bce: log 0 is clamped at -100; x outside [0, 1] gives NaN (documented), not a crash."""
    x, xr = to_device([0.0, 1.0, 0.0, 1.5, -0.5, 0.25], np.float32)
    t, tr = to_device([0.0, 1.0, 1.0, 0.5, 0.5, 0.5], np.float32)
    v = to_host(_call("binary_cross_entropy", "value", x, t, reduction="none"))
    np.testing.assert_array_equal(v[:3], [0.0, 0.0, 100.0])
    assert np.isnan(v[3]) and np.isnan(v[4])
    assert_close(v[5:], reference.loss("binary_cross_entropy", xr, tr, "none")[5:], np.float32)
    gx, gt = _call("binary_cross_entropy", "backward", 1.0, x, t, reduction="sum")
    rgx, rgt = reference.grads("binary_cross_entropy", xr, tr, "sum")
    assert_close(to_host(gx), rgx, np.float32)
    assert_close(to_host(gt), rgt, np.float32)   # +-inf at 0 and 1, NaN outside [0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_losses_stay_finite_at_large_logits(dtype):
    """Logits far past exp's range: bce_with_logits, soft_margin, focal give the reference's
    finite values where the literal formulas overflow (torch's soft margin gives inf)."""
    x, xr = to_device([80.0, -80.0, 300.0, -300.0, 0.0], dtype)
    t, tr = to_device([1.0, 0.0, 0.0, 1.0, 0.5], dtype)
    for name in ("binary_cross_entropy_with_logits", "soft_margin_loss", "sigmoid_focal_loss"):
        v, (gx, gt) = _call(name, "vag", x, t, reduction="none", grad_output=1.0)
        rv = reference.loss(name, xr, tr, "none")
        rgx, rgt = reference.grads(name, xr, tr, "none", np.ones(5))
        scale = np.abs(rv) + np.abs(xr)   # the loss is about |x| where it is large
        assert_close(to_host(v), rv, dtype, scale, name)
        assert_close(to_host(gx), rgx, dtype, None, name)
        assert_close(to_host(gt), rgt, dtype, None, name)


def test_pos_weight_and_weight_broadcast_per_class():
    """bce_with_logits: pos_weight (C,) lines up with the last dim of (N, C), as in torch; its
    gradient and weight's are summed over the rows (the rows kernel, in registers)."""
    import cupy

    rng = np.random.default_rng(3)
    z, zr = to_device(rng.standard_normal((4099, 96)) * 3, np.float32)
    y, yr = to_device((rng.random((4099, 96)) < 0.3).astype(np.float64), np.float32)
    pw, pwr = to_device(rng.uniform(0.5, 4.0, 96), np.float32)
    w, wr = to_device(rng.uniform(0.5, 2.0, 96), np.float32)
    loss, grads = _call("binary_cross_entropy_with_logits", "vag", z, y, weight=w,
                        pos_weight=pw)
    assert len(grads) == 4 and [g.shape for g in grads] == [z.shape, y.shape, (96,), (96,)]
    ref = reference.loss("binary_cross_entropy_with_logits", zr, yr, weight=wr,
                         pos_weight=pwr)
    assert_close(to_host(loss), ref, np.float32)
    want = reference.grads("binary_cross_entropy_with_logits", zr, yr, weight=wr,
                           pos_weight=pwr)
    for got, ref_g in zip(grads, want):
        assert_close(to_host(got), ref_g, np.float32)
    g_pw = _call("binary_cross_entropy_with_logits", "backward", 1.0, z, y, pos_weight=pw,
                 wrt="pos_weight")
    assert g_pw.shape == (96,)
    assert_close(to_host(g_pw), reference.grads("binary_cross_entropy_with_logits", zr, yr,
                                                pos_weight=pwr)[2], np.float32)
    with pytest.raises(ValueError, match="wrt names 'weight', which is not an array"):
        _call("binary_cross_entropy_with_logits", "backward", 1.0, z, y, wrt="weight")
    assert cupy.isfinite(loss)


@pytest.mark.parametrize("input_shape,var_shape", [
    ((64, 3), (64, 3)), ((64, 3), (64,)), ((64, 3), (64, 1)), ((4, 2, 3), (4, 1, 3)), ((3,), ())])
def test_gaussian_var_shapes(input_shape, var_shape):
    """gaussian_nll_loss takes torch's var shapes; var's gradient has var's own shape."""
    rng = np.random.default_rng(4)
    x, xr = to_device(rng.standard_normal(input_shape), np.float64)
    t, tr = to_device(rng.standard_normal(input_shape), np.float64)
    var, vr = to_device(rng.uniform(0.1, 2.0, var_shape), np.float64)
    loss, (gx, gt, gv) = _call("gaussian_nll_loss", "vag", x, t, var)
    assert gv.shape == var_shape
    assert_close(to_host(loss), reference.loss("gaussian_nll_loss", xr, tr, vr), np.float64)
    for got, want in zip((gx, gt, gv), reference.grads("gaussian_nll_loss", xr, tr, vr)):
        assert_close(to_host(got), want, np.float64)


def test_gaussian_var_checks():
    """Shapes torch rejects raise its ValueError; a negative var is clamped unless check_var,
    which raises torch's error; a Python number var works and has no gradient."""
    import cupy

    x = cupy.zeros((4, 3), cupy.float32)
    with pytest.raises(ValueError, match="var is of incorrect size"):
        _call("gaussian_nll_loss", "value", x, x, cupy.ones(3, cupy.float32))
    var = cupy.array([1.0, -1.0, 2.0, 0.5], cupy.float32)
    v = _call("gaussian_nll_loss", "value", x, x, var, reduction="none")
    assert_close(to_host(v[1]), np.full(3, 0.5 * math.log(1e-6)), np.float32)
    with pytest.raises(ValueError, match="var has negative entry"):
        _call("gaussian_nll_loss", "value", x, x, var, check_var=True)
    _call("gaussian_nll_loss", "value", x, x, cupy.abs(var), check_var=True)
    with pytest.raises(ValueError, match="var has negative entry"):
        _call("gaussian_nll_loss", "value", x, x, -0.5)
    loss, grads = _call("gaussian_nll_loss", "vag", x + 1, x, 0.5)
    assert len(grads) == 2   # input and target: a number has no gradient
    assert_close(to_host(loss), reference.loss("gaussian_nll_loss", np.ones((4, 3)),
                                               np.zeros((4, 3)), 0.5), np.float32)
    with pytest.raises(ValueError, match="wrt names 'var'"):
        _call("gaussian_nll_loss", "vag", x, x, 0.5, wrt="var")


def test_focal_default_reduction_is_none():
    import cupy

    x = cupy.zeros((3, 4), cupy.float32)
    assert _call("sigmoid_focal_loss", "value", x, x).shape == (3, 4)
    assert _call("sigmoid_focal_loss", "value", x, x, reduction="mean").shape == ()


def test_kl_zero_target_gradient_is_nan_like_torch():
    """kl_div: a zero target contributes 0 to the loss and has a NaN gradient (torch's xlogy)."""
    x, _ = to_device(np.log([0.25, 0.75]), np.float32)
    t, _ = to_device([0.0, 1.0], np.float32)
    v = _call("kl_div", "value", x, t, reduction="none")
    assert to_host(v)[0] == 0.0
    gx, gt = _call("kl_div", "backward", 1.0, x, t, reduction="sum")
    assert to_host(gx)[0] == 0.0 and np.isnan(to_host(gt)[0]) and np.isfinite(to_host(gt)[1])


def test_kl_log_input_false_equals_log_input():
    """kl_div(p, q, log_input=False) == kl_div(log p, q), and d/dp = d/d(log p) / p."""
    import cupy

    rng = np.random.default_rng(3)
    p, pr = to_device(rng.uniform(0.01, 1, (64, 1000)), np.float64)
    q, _ = to_device(rng.uniform(0.01, 1, (64, 1000)), np.float64)
    v1, (g1, _) = _call("kl_div", "vag", cupy.log(p), q, reduction="batchmean")
    v2, (g2, _) = _call("kl_div", "vag", p, q, reduction="batchmean", log_input=False)
    assert_close(to_host(v2), to_host(v1), np.float64, None, "value")
    assert_close(to_host(g2), to_host(g1) / pr, np.float64, None, "grad")


def test_kl_log_input_false_ratios_past_float32_take_the_literal_formula():
    """kl_div(p, t, log_input=False) for values beyond probabilities whose ratio t / p over- or
    underflows float32: the loss and d/dt stay finite and as torch's (t (log t - log p), log t -
    log p + 1), not log(0) or log(inf) of a rounded ratio."""
    x, xr = to_device([5e37, 2e-38, 1e10, 0.5, 3.0], np.float32)
    t, tr = to_device([1.2e-38, 3e37, 1e-30, 0.25, 2e-38], np.float32)
    v, (gx, gt) = _call("kl_div", "vag", x, t, reduction="none", log_input=False)
    assert np.all(np.isfinite(to_host(gt))), to_host(gt)
    # past float32's range the reference rounds to inf, as the kernel and torch do
    assert_close(to_host(v), tr * (np.log(tr) - np.log(xr)), np.float32, None, "value")
    assert_close(to_host(gt), np.log(tr) - np.log(xr) + 1, np.float32, None, "d/dt")
    assert_close(to_host(gx), -tr / xr, np.float32, None, "d/dp")


def test_fp16_sum_of_4096_ones_is_exact():
    """4096 ones in fp16 sum to 4096 exactly (fp32 accumulation; fp16 alone would stall at 2048)."""
    import cupy

    x = cupy.ones(4096, cupy.float16)
    z = cupy.zeros(4096, cupy.float16)
    assert float(_call("mse_loss", "value", x, z, reduction="sum").get()) == 4096.0
    assert float(_call("mse_loss", "value", x, z, reduction="mean").get()) == 1.0
    assert float(_call("l1_loss", "value", x, z, reduction="sum").get()) == 4096.0


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_empty(case, shape):
    """Torch's rules: mean of empty is NaN, sum is 0, none is empty; gradients are empty or 0."""
    host = _operands(case, np.random.default_rng(0), _shapes(case, shape, shape[-1:]))
    dev = {k: to_device(v, np.float32)[0] for k, v in host.items()}
    pos, kw = _args(case, dev)
    assert np.isnan(float(_call(case.name, "value", *pos, reduction="mean", **kw).get()))
    assert float(_call(case.name, "value", *pos, reduction="sum", **kw).get()) == 0.0
    assert _call(case.name, "value", *pos, reduction="none", **kw).shape == shape
    grads = _call(case.name, "backward", 1.0, *pos, reduction="sum", **kw)
    names = _required(case.name) + list(case.extras)
    for g, name in zip(grads, names):
        assert g.shape == dev[name].shape and not g.get().any(), name


def test_zero_dim():
    """0-d operands: the loss of one element; batchmean of 0-d input is the sum."""
    import cupy

    x = cupy.array(0.25, cupy.float64)
    t = cupy.array(0.5, cupy.float64)
    assert float(_call("kl_div", "value", x, t, reduction="batchmean").get()) == pytest.approx(
        float(reference.loss("kl_div", 0.25, 0.5, "batchmean")), rel=1e-14)
    gx, gt = _call("mse_loss", "backward", cupy.array(3.0), x, t, reduction="mean")
    assert gx.shape == () and float(gx.get()) == pytest.approx(2 * (0.25 - 0.5) * 3.0)
    g1, g2, g3 = _call("margin_ranking_loss", "backward", 1.0, x, t, cupy.array(1.0))
    assert float(g1.get()) == -1.0 and float(g2.get()) == 1.0   # -(x1 - x2) = 0.25 >= 0 passes
    assert float(g3.get()) == 0.25


def test_grad_output_forms_and_wrt():
    """grad_output as host scalar, 0-d device array, elementwise; wrt picks what is computed."""
    import cupy

    rng = np.random.default_rng(4)
    x, xr = to_device(rng.standard_normal((33, 65)), np.float32)
    t, tr = to_device(rng.standard_normal((65,)), np.float32)
    g_host = _call("mse_loss", "backward", 2.5, x, t, wrt="input")
    g_dev = _call("mse_loss", "backward", cupy.array(2.5, cupy.float32), x, t, wrt="input")
    assert np.array_equal(g_host.get(), g_dev.get())
    ref_gx, ref_gt = reference.grads("mse_loss", xr, tr, "mean", 2.5)
    assert_close(to_host(g_host), ref_gx, np.float32)
    loss, (gt_only,) = _call("mse_loss", "vag", x, t, wrt=("target",), grad_output=2.5)
    assert_close(to_host(gt_only), ref_gt, np.float32)
    go, gor = to_device(rng.standard_normal((33, 65)), np.float32)
    gx, gt = _call("mse_loss", "backward", go, x, t, reduction="none")
    rx, rt = reference.grads("mse_loss", xr, tr, "none", gor)
    assert_close(to_host(gx), rx, np.float32)
    assert_close(to_host(gt), rt, np.float32)
    # Three arrays, named as torch names them, in the order asked for.
    y, yr = to_device(np.sign(rng.standard_normal((33, 1))), np.float32)
    gy, g1 = _call("margin_ranking_loss", "backward", 1.0, x, t, y, wrt=("target", "input1"))
    r1, _, ry = reference.grads("margin_ranking_loss", xr, tr, yr)
    assert gy.shape == (33, 1) and g1.shape == (33, 65)
    assert_close(to_host(gy), ry, np.float32)
    assert_close(to_host(g1), r1, np.float32)
    with pytest.raises(ValueError, match="wrt names 'input'; it takes 'input1', 'input2'"):
        _call("margin_ranking_loss", "backward", 1.0, x, t, y, wrt="input")


def test_many_dims_non_contiguous():
    """Ten non-mergeable dims (more than the kernel's 8) still give the reference's answer."""
    import cupy

    rng = np.random.default_rng(5)
    base = cupy.asarray(rng.standard_normal((3,) * 10))
    x = base[(slice(None, None, 2),) * 10]          # (2,)*10, every dim strided
    t = cupy.asarray(rng.standard_normal((2,) * 10)).transpose(tuple(range(9, -1, -1)))
    v, (gx, gt) = _call("mse_loss", "vag", x, t, reduction="sum")
    xr, tr = x.get(), t.get()
    assert_close(to_host(v), reference.loss("mse_loss", xr, tr, "sum"), np.float64)
    rx, rt = reference.grads("mse_loss", xr, tr, "sum")
    assert_close(to_host(gx), rx, np.float64)
    assert_close(to_host(gt), rt, np.float64)
    var = cupy.asarray(rng.uniform(0.5, 1.0, (2,) * 10))[..., ::-1]
    v, grads = _call("gaussian_nll_loss", "vag", x, t, var, reduction="sum")
    want = reference.grads("gaussian_nll_loss", xr, tr, var.get(), "sum")
    for got, ref in zip(grads, want):
        assert_close(to_host(got), ref, np.float64)


def test_many_dims_torch_tensors():
    """The same with torch tensors, an elementwise grad_output among them: the contiguous copies
    read through CuPy, the results torch tensors of the operands' shapes, C-contiguous."""
    torch = pytest.importorskip("torch")
    import cupyloss

    gen = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn((3,) * 10, device="cuda", dtype=torch.float64, generator=gen)
    x = base[(slice(None, None, 2),) * 10]
    t = torch.randn((2,) * 10, device="cuda", dtype=torch.float64,
                    generator=gen).permute(*range(9, -1, -1))
    go = torch.randn((2,) * 10, device="cuda", dtype=torch.float64, generator=gen)[..., [1, 0]]
    loss, (gx, gt) = cupyloss.mse_loss_value_and_grad(x, t, reduction="none", grad_output=go)
    for got in (loss, gx, gt):
        assert isinstance(got, torch.Tensor) and got.shape == x.shape and got.is_contiguous()
    xr, tr, gr = (a.cpu().numpy() for a in (x, t, go))
    assert_close(loss.cpu().numpy(), (xr - tr) ** 2, np.float64)
    assert_close(gx.cpu().numpy(), 2 * (xr - tr) * gr, np.float64)
    assert_close(gt.cpu().numpy(), -2 * (xr - tr) * gr, np.float64)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_no_host_sync_under_graph_capture(case):
    """value_and_grad records into a CUDA graph: a host-device sync would break the capture."""
    import cupy

    rng = np.random.default_rng(6)
    host = _operands(case, rng, _shapes(case, (512, 1024), (1024,)))
    dev, rounded = {}, {}
    for k, v in host.items():
        dev[k], rounded[k] = to_device(v, np.float32)
    pos, kw = _args(case, dev)
    go = cupy.array(1.5, cupy.float32)
    _call(case.name, "vag", *pos, reduction="mean", grad_output=go, **kw)  # compile, warm pool
    # The operands were written on the legacy stream, which a non-blocking stream does not wait
    # for: without this the replay can read them before their copies land.
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = _call(case.name, "vag", *pos, reduction="mean", grad_output=go, **kw)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    terms = _magnitude(case, rounded)
    assert_close(to_host(out[0]), _ref(case, rounded, "mean"), np.float32,
                 _sum_scale(terms, "mean", terms.size), case.name)


def test_bad_input_raises_before_launch():
    import cupy

    cl = _cl()
    x = cupy.ones((4, 3), cupy.float32)
    with pytest.raises(ValueError, match="'abc' is not a valid value for reduction"):
        cl.mse_loss(x, x, reduction="abc")
    with pytest.raises(ValueError, match="batchmean"):
        cl.mse_loss(x, x, reduction="batchmean")
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4,\)"):
        cl.mse_loss(x, cupy.ones(4, cupy.float32))
    with pytest.raises(ValueError, match=r"input1 shape \(4, 3\), input2 shape \(4, 3\) and "
                                         r"target shape \(2,\) do not broadcast"):
        cl.margin_ranking_loss(x, x, cupy.ones(2, cupy.float32))
    with pytest.raises(TypeError, match="int32"):
        cl.mse_loss(x.astype(cupy.int32), x)
    with pytest.raises(TypeError, match="bool"):
        cl.hinge_loss(x, x.astype(bool))
    with pytest.raises(TypeError, match="complex64"):
        cl.kl_div(x.astype(cupy.complex64), x)
    with pytest.raises(TypeError, match="float64"):
        cl.mse_loss(x, x.astype(cupy.float64))
    with pytest.raises(TypeError, match="input has dtype float32 but weight has dtype float64"):
        cl.binary_cross_entropy(x / 2, x, weight=x.astype(cupy.float64))
    with pytest.raises(TypeError, match="cupy.asarray"):
        cl.mse_loss(np.ones(3, np.float32), x)
    with pytest.raises(TypeError, match="grad_output has dtype float64"):
        cl.mse_loss_backward(cupy.array(1.0), x, x)
    with pytest.raises(ValueError, match="grad_output shape"):
        cl.mse_loss_backward(cupy.ones((3, 4), cupy.float32), x, x, reduction="none")
    with pytest.raises(ValueError, match="must be 0-d"):
        cl.mse_loss_backward(cupy.ones((4, 3), cupy.float32), x, x, reduction="sum")
    with pytest.raises(ValueError, match="wrt"):
        cl.mse_loss_value_and_grad(x, x, wrt="weights")
    with pytest.raises(ValueError, match="smooth_l1_loss does not support negative values"):
        cl.smooth_l1_loss(x, x, beta=-1.0)
    with pytest.raises(ValueError, match="huber_loss does not support non-positive values"):
        cl.huber_loss(x, x, delta=0.0)
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            y = cupy.ones((4, 3), cupy.float32)
        with pytest.raises(ValueError, match="device"):
            cl.mse_loss(x, y)
        with pytest.raises(ValueError, match="device"):
            cl.binary_cross_entropy_with_logits(x, x, pos_weight=y)


def _torch_forms(torch):
    """name -> (torch function on tensors, reduction): torch's own loss, or the composite it
    stands for (torchvision's focal loss, the hinge and log-cosh formulas)."""
    F = torch.nn.functional

    def focal(a, b):
        p = torch.sigmoid(a)
        ce = F.binary_cross_entropy_with_logits(a, b, reduction="none")
        p_t = p * b + (1 - p) * (1 - b)
        return ((0.25 * b + 0.75 * (1 - b)) * ce * (1 - p_t) ** 2).mean()

    return {
        "mse_loss": (lambda a, b: F.mse_loss(a, b), "mean"),
        "kl_div": (lambda a, b: F.kl_div(a, b, reduction="batchmean"), "batchmean"),
        "hinge_loss": (lambda a, b: torch.mean(torch.clamp(1 - a * b, min=0)), "mean"),
        "l1_loss": (lambda a, b: F.l1_loss(a, b), "mean"),
        "smooth_l1_loss": (lambda a, b: F.smooth_l1_loss(a, b), "mean"),
        "huber_loss": (lambda a, b: F.huber_loss(a, b, delta=0.5), "mean"),
        "binary_cross_entropy": (lambda a, b: F.binary_cross_entropy(a, b), "mean"),
        "binary_cross_entropy_with_logits":
            (lambda a, b: F.binary_cross_entropy_with_logits(a, b), "mean"),
        "soft_margin_loss": (lambda a, b: F.soft_margin_loss(a, b), "mean"),
        "hinge_embedding_loss": (lambda a, b: F.hinge_embedding_loss(a, b), "mean"),
        "poisson_nll_loss": (lambda a, b: F.poisson_nll_loss(a, b), "mean"),
        "squared_hinge_loss": (lambda a, b: torch.mean(torch.clamp(1 - a * b, min=0) ** 2),
                               "mean"),
        "sigmoid_focal_loss": (focal, "mean"),
        "log_cosh_loss": (lambda a, b: torch.mean(torch.log(torch.cosh(a - b))), "mean"),
    }


@pytest.mark.parametrize("name", [n for n in LOSSES
                                  if n not in ("margin_ranking_loss", "gaussian_nll_loss")])
def test_matches_torch_on_gpu(name):
    """Values and autograd gradients of torch on the GPU, torch tensors in (read as they are,
    requires_grad and all), with the target broadcast along the rows where torch allows it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    fn, reduction = _torch_forms(torch)[name]
    case = next(c for c in CASES if c.name == name)
    opts = {"huber_loss": {"delta": 0.5}, "kl_div": {}}.get(name, {})
    same = name in ("binary_cross_entropy", "binary_cross_entropy_with_logits",
                    "soft_margin_loss", "sigmoid_focal_loss")   # torch asks for equal shapes
    rng = np.random.default_rng(7)
    host = _operands(case, rng, {"input": (300, 257), "target": (300, 257) if same else (257,)})
    if name == "binary_cross_entropy":   # torch's CUDA kernel asserts outside (0, 1)'s closure
        host["input"] = np.clip(host["input"], 1e-3, 1 - 1e-3)
    no_target_grad = name == "soft_margin_loss"   # torch refuses a target that requires grad
    tx = torch.tensor(host["input"], dtype=torch.float32, device="cuda", requires_grad=True)
    tt = torch.tensor(host["target"], dtype=torch.float32, device="cuda",
                      requires_grad=not no_target_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch warns when a loss broadcasts
        want = fn(tx, tt)
    wanted = (tx,) if no_target_grad or name == "hinge_embedding_loss" else (tx, tt)
    rgrads = torch.autograd.grad(want, wanted)
    vag = getattr(_cl(), name + "_value_and_grad")
    loss, grads = vag(tx, tt, reduction=reduction, **opts)
    assert isinstance(loss, torch.Tensor) and loss.device == tx.device
    for got, ref in zip((loss, *grads), (want, *rgrads)):
        ref = ref.detach().double().cpu().numpy()
        assert_close(got.double().cpu().numpy(), ref, np.float32, None, name)


def test_three_array_losses_match_torch_on_gpu():
    """margin_ranking_loss and gaussian_nll_loss (var one per row) against torch on the GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    F = torch.nn.functional
    rng = np.random.default_rng(8)
    t = lambda a: torch.tensor(a, dtype=torch.float32, device="cuda", requires_grad=True)  # noqa
    a, b, y = t(rng.standard_normal((300, 257))), t(rng.standard_normal((300, 257))), t(
        np.sign(rng.standard_normal((300, 257))))
    want = F.margin_ranking_loss(a, b, y, margin=0.5)
    rgrads = torch.autograd.grad(want, (a, b, y))
    loss, grads = _cl().margin_ranking_loss_value_and_grad(a, b, y, margin=0.5)
    mu, x, var = t(rng.standard_normal((300, 257))), t(rng.standard_normal((300, 257))), t(
        rng.uniform(0.1, 2.0, 300))
    want2 = F.gaussian_nll_loss(mu, x, var, full=True)
    rgrads2 = torch.autograd.grad(want2, (mu, x, var))
    loss2, grads2 = _cl().gaussian_nll_loss_value_and_grad(mu, x, var, full=True)
    assert grads2[2].shape == (300,)
    for got, ref in zip((loss, *grads, loss2, *grads2), (want, *rgrads, want2, *rgrads2)):
        ref = ref.detach().double().cpu().numpy()
        assert_close(got.double().cpu().numpy(), ref, np.float32, None)


def test_interop_is_zero_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from cupyloss import interop

    a = torch.arange(6.0, device="cuda")
    c = interop.from_torch(a)
    assert c.data.ptr == a.data_ptr()
    assert interop.to_torch(c).data_ptr() == a.data_ptr()
    with pytest.raises(TypeError, match="CUDA tensor"):
        interop.from_torch(torch.ones(2))


@pytest.mark.slow
def test_more_than_2_31_elements():
    """64-bit indexing: 2^31 + 2^20 + 3 elements (flat) and a rows-broadcast past 2^31."""
    import cupy

    n = 2**31 + 2**20 + 3                 # odd: the last elements take the scalar tail path
    x = cupy.ones(n, cupy.float32)        # float32: a sum of 2^31 overflows fp16's 65504
    x[-1] = 3.0
    t = cupy.zeros(n, cupy.float32)
    v, (gx, gt) = _call("mse_loss", "vag", x, t, reduction="sum")
    assert float(v.get()) == pytest.approx(n - 1 + 9, rel=1e-6)
    assert float(gx[-1].get()) == 6.0 and float(gx[-2].get()) == 2.0
    assert float(gt[-1].get()) == -6.0
    del x, t, gx, gt
    rows, cols = 2**16 + 1, 2**15
    s = cupy.ones((rows, cols), cupy.float32)   # float32: column sums of 65537 overflow fp16
    s[-1, -1] = -1.0
    y = cupy.ones(cols, cupy.float32)
    v, (gs, gy) = _call("hinge_loss", "vag", s, y, reduction="sum")
    assert float(v.get()) == 2.0                          # only the last element: 1 - (-1)
    assert float(gs[-1, -1].get()) == -1.0 and float(gs[-1, -2].get()) == -1.0  # tie passes
    assert float(gy[-1].get()) == -(rows - 2)
    assert float(gy[0].get()) == -rows
    del s, gs
    x1 = cupy.ones(n, cupy.float32)
    zero, one = cupy.zeros((), cupy.float32), cupy.ones((), cupy.float32)
    v, (g1, g2, gt) = _call("margin_ranking_loss", "vag", x1, zero, one, margin=2.0,
                            reduction="sum")  # three operands, two of them 0-d
    assert float(v.get()) == pytest.approx(n, rel=1e-6)   # each element: -(1 - 0) + 2 = 1
    assert float(g1[-1].get()) == -1.0
    assert float(g2.get()) == pytest.approx(n, rel=1e-6)
    assert float(gt.get()) == pytest.approx(-n, rel=1e-6)
