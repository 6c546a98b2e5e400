"""Tests of the float64 references in reference.py, and of the shared strategies.

The references are what every GPU test compares against, so they are checked three independent
ways: against central finite differences, against torch's CPU float64 values and autograd gradients
(skipped when torch is not installed), and against invariance properties. Runs on a CPU in CI.
"""

import math
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import reference as ref
import strategies as strat

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

# Float64 on both sides with the same formulas: only summation order and operation order differ,
# each a few ulps per element, far below 1e-12 at the magnitudes (<= ~1e3) these tests produce.
RTOL = 1e-12
ATOL = 1e-12

# (name, options) of every loss variant; kl_div covers the four log_target x log_input combinations.
LOSS_CASES = [
    ("mse_loss", {}),
    ("kl_div", {}),
    ("kl_div", {"log_target": True}),
    ("kl_div", {"log_input": False}),
    ("kl_div", {"log_target": True, "log_input": False}),
    ("hinge_loss", {}),
    ("hinge_loss", {"margin": 0.5}),
]


def _case_id(case):
    """Readable pytest id for a LOSS_CASES entry, e.g. ``kl_div-log_target``."""
    name, opts = case
    return "-".join([name] + [f"{k}={v}" for k, v in sorted(opts.items())])


# Shape pairs (input, target) for the fixed-shape tests, each here for the broadcast path it takes.
SHAPE_PAIRS = [
    pytest.param((3, 4), (3, 4), id="equal"),  # no broadcasting; 12 elements, 3 rows for batchmean
    pytest.param((3, 4), (4,), id="row"),  # (N, C) with (C,): the target gradient sums over rows
    pytest.param((3, 1), (3, 4), id="input-col"),  # the input is the broadcast one, a size-1 dim
    pytest.param((2, 1, 3), (4, 1), id="both"),  # both sides broadcast, to (2, 4, 3)
    pytest.param((), (5,), id="input-0d"),  # 0-d input: batchmean is the plain sum
    pytest.param((5,), (), id="target-0d"),  # 0-d target: its gradient sums every element
]


def _smooth_arguments(rng, name, opts, input_shape, target_shape, kink_gap=0.0):
    """Random float64 arguments in the loss's differentiable region.

    kl_div gets positive targets (log space: any), log-probability inputs at most 0 and
    probabilities in [0.1, 1]. hinge_loss arguments are redrawn until every ``margin - x * t`` is
    more than ``kink_gap`` from the kink; finite differences pass 1e-3, a thousand times the step
    ``h * |t|`` of a central difference, and use shapes small enough for that to succeed quickly.
    """
    if name == "kl_div":
        if opts.get("log_input", True):
            x = rng.uniform(-3.0, 0.0, input_shape)
        else:
            x = rng.uniform(0.1, 1.0, input_shape)
        if opts.get("log_target", False):
            t = rng.uniform(-3.0, 0.5, target_shape)
        else:
            t = rng.uniform(0.1, 1.0, target_shape)
        return np.asarray(x), np.asarray(t)
    while True:
        x = np.asarray(rng.uniform(-2.0, 2.0, input_shape))
        t = np.asarray(rng.uniform(-2.0, 2.0, target_shape))
        if name != "hinge_loss" or np.all(np.abs(opts.get("margin", 1.0) - x * t) > kink_gap):
            return x, t


def _upstream(rng, reduction, shape):
    """A random upstream gradient: an array of the broadcast shape for 'none', else a scalar."""
    if reduction == "none":
        return np.asarray(rng.normal(size=shape))
    return np.float64(rng.normal())


def _reductions_for(name):
    """Reductions torch.nn.functional offers for ``name``: 'batchmean' only exists for kl_div."""
    return ref.REDUCTIONS if name == "kl_div" else ("none", "sum", "mean")


def _central_differences(f, x, t, h):
    """Central-difference gradients of the scalar ``f(x, t)`` with respect to ``x`` and ``t``."""
    out = []
    for which in (0, 1):
        args = [x, t]
        g = np.zeros(args[which].shape)
        for idx in np.ndindex(args[which].shape):
            plus, minus = args[which].copy(), args[which].copy()
            plus[idx] += h
            minus[idx] -= h
            args[which] = plus
            f_plus = f(*args)
            args[which] = minus
            f_minus = f(*args)
            args[which] = x if which == 0 else t
            g[idx] = (f_plus - f_minus) / (2 * h)
        out.append(g)
    return out


@pytest.mark.parametrize("input_shape,target_shape", SHAPE_PAIRS)
@pytest.mark.parametrize("reduction", ref.REDUCTIONS)
@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_grads_match_finite_differences(case, reduction, input_shape, target_shape):
    """Analytic gradients, scaled by the reduction and summed to each shape, match differences."""
    name, opts = case
    rng = np.random.default_rng(0)
    x, t = _smooth_arguments(rng, name, opts, input_shape, target_shape, kink_gap=1e-3)
    g = _upstream(rng, reduction, np.broadcast_shapes(input_shape, target_shape))

    def objective(x, t):
        return float(np.sum(g * ref.loss(name, x, t, reduction, **opts)))

    # h = 1e-6: truncation error ~h^2 |f'''| <= 1e-9 here (|f'''| <= 2e3 for log(p), p >= 0.1) and
    # rounding ~eps |f| / h <= 1e-8; 1e-6 is two orders above both and far below any wrong scale.
    numeric_x, numeric_t = _central_differences(objective, x, t, h=1e-6)
    g_x, g_t = ref.grads(name, x, t, reduction, grad_output=g, **opts)
    assert g_x.shape == input_shape and g_t.shape == target_shape
    np.testing.assert_allclose(g_x, numeric_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g_t, numeric_t, rtol=1e-6, atol=1e-6)


def _torch_value_and_grads(name, x, t, reduction, grad_output, **opts):
    """Value and autograd gradients from torch.nn.functional in float64 on the CPU, as NumPy."""
    xt = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
    tt = torch.tensor(np.asarray(t, dtype=np.float64), requires_grad=True)
    with warnings.catch_warnings():
        # mse_loss warns when it broadcasts, kl_div when reduction is 'mean'; both are intended.
        warnings.simplefilter("ignore", UserWarning)
        if name == "mse_loss":
            out = F.mse_loss(xt, tt, reduction=reduction)
        elif name == "kl_div":
            log_x = xt if opts.get("log_input", True) else torch.log(xt)
            out = F.kl_div(log_x, tt, reduction=reduction, log_target=opts.get("log_target", False))
        else:
            z = torch.clamp(opts.get("margin", 1.0) - xt * tt, min=0)
            out = {"none": z, "sum": z.sum(), "mean": z.mean()}[reduction]
    out.backward(torch.tensor(np.asarray(grad_output, dtype=np.float64)))
    grad = [a.grad if a.grad is not None else torch.zeros_like(a) for a in (xt, tt)]
    return out.detach().numpy(), grad[0].numpy(), grad[1].numpy()


def _assert_same(actual, desired):
    """Same shape, same NaN and inf positions, and values within RTOL/ATOL."""
    assert np.shape(actual) == np.shape(desired)
    np.testing.assert_allclose(actual, desired, rtol=RTOL, atol=ATOL, equal_nan=True)


def _assert_matches_torch(name, x, t, reduction, grad_output, **opts):
    """Reference value and gradients equal torch's, NaN pattern included."""
    value, g_x, g_t = _torch_value_and_grads(name, x, t, reduction, grad_output, **opts)
    _assert_same(ref.loss(name, x, t, reduction, **opts), value)
    ref_g_x, ref_g_t = ref.grads(name, x, t, reduction, grad_output=grad_output, **opts)
    _assert_same(ref_g_x, g_x)
    _assert_same(ref_g_t, g_t)


# Every (loss case, reduction) pair that torch offers.
TORCH_CASES = [
    pytest.param(case, reduction, id=f"{_case_id(case)}-{reduction}")
    for case in LOSS_CASES
    for reduction in _reductions_for(case[0])
]


@needs_torch
@pytest.mark.parametrize("input_shape,target_shape", SHAPE_PAIRS)
@pytest.mark.parametrize("case,reduction", TORCH_CASES)
def test_matches_torch(case, reduction, input_shape, target_shape):
    """Values and gradients equal torch's on the fixed shape pairs, with a random upstream."""
    name, opts = case
    rng = np.random.default_rng(1)
    x, t = _smooth_arguments(rng, name, opts, input_shape, target_shape)
    g = _upstream(rng, reduction, np.broadcast_shapes(input_shape, target_shape))
    _assert_matches_torch(name, x, t, reduction, g, **opts)


@needs_torch
@settings(max_examples=150, deadline=None)  # deadline off: torch's first call is slow to warm up
@given(
    # 4096 elements still reach every broadcast kind and the 0, 1, 31..33 and 255..257 sizes.
    pair=strat.broadcast_pairs(max_elements=4096),
    case=st.sampled_from(LOSS_CASES),
    reduction=st.sampled_from(ref.REDUCTIONS),
    seed=strat.seeds(),
)
def test_matches_torch_on_drawn_broadcast_pairs(pair, case, reduction, seed):
    """Values and gradients equal torch's for every kind of broadcast pair the strategy draws."""
    name, opts = case
    assume(reduction in _reductions_for(name))
    rng = np.random.default_rng(seed)
    x, t = _smooth_arguments(rng, name, opts, *pair)
    g = _upstream(rng, reduction, np.broadcast_shapes(*pair))
    _assert_matches_torch(name, x, t, reduction, g, **opts)


NAN, INF = np.nan, np.inf
E = math.exp(-0.5)

# Edge cases, each derived by hand from torch's definitions: (name, opts, x, t, elementwise value,
# elementwise d/dx, elementwise d/dt). Three elements each, reduction 'none'.
EDGE_CASES = [
    pytest.param(
        "hinge_loss", {}, [0.5, -0.5, 2.0], [2.0, -2.0, 0.5],
        # x * t == margin exactly: the value is 0 and clamp(min=0) still passes the gradient.
        [0.0, 0.0, 0.0], [-2.0, 2.0, -0.5], [-0.5, 0.5, -2.0],
        id="hinge-tie-passes-gradient",
    ),
    pytest.param(
        "hinge_loss", {"margin": 0.0}, [0.0, 1.0, -1.0], [3.0, 0.0, 2.0],
        # margin 0 ties at x == 0 or t == 0; the third element is plainly inside the margin.
        [0.0, 0.0, 2.0], [-3.0, -0.0, -2.0], [-0.0, -1.0, 1.0],
        id="hinge-tie-at-zero-margin",
    ),
    pytest.param(
        "hinge_loss", {}, [NAN, 0.5, 3.0], [1.0, NAN, 1.0],
        # NaN propagates to the value; the NaN mask is 0 but -x * 0 is still NaN for a NaN x.
        [NAN, NAN, 0.0], [-0.0, NAN, -0.0], [NAN, -0.0, -0.0],
        id="hinge-nan",
    ),
    pytest.param(
        "mse_loss", {}, [NAN, INF, 1.0], [0.0, INF, INF],
        # NaN propagates, inf - inf is NaN, and 1 - inf squares to inf.
        [NAN, NAN, INF], [NAN, NAN, -INF], [NAN, NAN, INF],
        id="mse-nan-inf",
    ),
    pytest.param(
        "kl_div", {}, [-1.0, -2.0, -INF], [0.0, 0.5, 0.0],
        # t == 0 contributes 0 to the value, but its gradient is NaN (log 0 is skipped, t/t is not);
        # t == 0 with x == -inf is 0 - 0 * (-inf) = NaN.
        [0.0, 0.5 * math.log(0.5) + 1.0, NAN], [-0.0, -0.5, -0.0],
        [NAN, math.log(0.5) + 1.0 + 2.0, NAN],
        id="kl-zero-target",
    ),
    pytest.param(
        "kl_div", {}, [-1.0, NAN, -1.0], [-0.5, 0.5, NAN],
        # a negative target has a NaN log; NaN in either argument propagates.
        [NAN, NAN, NAN], [0.5, -0.5, NAN], [NAN, NAN, NAN],
        id="kl-negative-and-nan",
    ),
    pytest.param(
        "kl_div", {"log_input": False}, [0.0, 0.0, 0.5], [0.0, 0.25, 0.0],
        # p == 0: log p = -inf. t == 0 gives 0 * -inf = NaN, t > 0 gives inf; d/dp = -t/p.
        [NAN, INF, 0.0], [NAN, -INF, -0.0], [NAN, INF, NAN],
        id="kl-zero-probability",
    ),
    pytest.param(
        "kl_div", {"log_target": True}, [-1.0, -INF, 0.0], [-INF, -INF, -0.5],
        # a zero probability in log space: exp(-inf) * (-inf - x) is 0 * -inf = NaN, not 0.
        [NAN, NAN, -0.5 * E], [-0.0, -0.0, -E], [NAN, NAN, 0.5 * E],
        id="kl-log-target-minus-inf",
    ),
]

# Upstream gradient for the edge cases: not ones, mixed sign, nonzero, exactly representable.
EDGE_UPSTREAM = np.array([1.5, -2.0, 0.25])


@pytest.mark.parametrize("name,opts,x,t,value,d_x,d_t", EDGE_CASES)
def test_edge_cases(name, opts, x, t, value, d_x, d_t):
    """The reference gives the hand-derived values and gradients, NaN and inf included."""
    x, t = np.array(x), np.array(t)
    np.testing.assert_allclose(ref.loss(name, x, t, "none", **opts), value, rtol=RTOL, atol=0)
    g_x, g_t = ref.grads(name, x, t, "none", grad_output=EDGE_UPSTREAM, **opts)
    np.testing.assert_allclose(g_x, EDGE_UPSTREAM * np.array(d_x), rtol=RTOL, atol=0)
    np.testing.assert_allclose(g_t, EDGE_UPSTREAM * np.array(d_t), rtol=RTOL, atol=0)


@needs_torch
@pytest.mark.parametrize("name,opts,x,t,value,d_x,d_t", EDGE_CASES)
def test_edge_cases_match_torch(name, opts, x, t, value, d_x, d_t):
    """Torch agrees with the reference on every edge case, for every reduction it offers."""
    x, t = np.array(x), np.array(t)
    for reduction in _reductions_for(name):
        g = EDGE_UPSTREAM if reduction == "none" else np.float64(0.75)
        _assert_matches_torch(name, x, t, reduction, g, **opts)


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_nan_input_propagates_through_every_reduction(case):
    """One NaN input element makes every reduced value NaN."""
    name, opts = case
    x, t = _smooth_arguments(np.random.default_rng(2), name, opts, (2, 3), (2, 3))
    x[1, 2] = np.nan
    for reduction in ("sum", "mean", "batchmean"):
        assert np.isnan(ref.loss(name, x, t, reduction, **opts))
    if torch is not None:
        for reduction in _reductions_for(name):
            g = np.full((2, 3), 0.5) if reduction == "none" else np.float64(-1.25)
            _assert_matches_torch(name, x, t, reduction, g, **opts)


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_empty_reductions(case):
    """Empty inputs: 'mean' and 'batchmean' are NaN (0 / 0), 'sum' is 0, gradients are empty."""
    name, opts = case
    x, t = np.zeros((0, 3)), np.full((0, 3), 0.5)
    assert np.isnan(ref.loss(name, x, t, "mean", **opts))
    assert np.isnan(ref.loss(name, x, t, "batchmean", **opts))
    assert ref.loss(name, x, t, "sum", **opts) == 0.0
    assert ref.loss(name, x, t, "none", **opts).shape == (0, 3)
    for reduction in ref.REDUCTIONS:
        g_x, g_t = ref.grads(name, x, t, reduction, **opts)
        assert g_x.shape == (0, 3) and g_t.shape == (0, 3)
    if torch is not None:
        for reduction in _reductions_for(name):
            g = np.zeros((0, 3)) if reduction == "none" else np.float64(0.5)
            _assert_matches_torch(name, x, t, reduction, g, **opts)


@pytest.mark.parametrize(
    "input_shape,target_shape,divisor",
    [
        pytest.param((), (3,), 1, id="0d-input-is-plain-sum"),  # torch skips the division
        pytest.param((4,), (3, 4), 4, id="broadcast-input"),  # input's dim 0, not the result's
        pytest.param((2, 3), (3,), 2, id="broadcast-target"),  # the usual (N, C) with (C,)
        pytest.param((2, 3), (), 2, id="0d-target"),
    ],
)
def test_batchmean_divides_by_input_first_dim(input_shape, target_shape, divisor):
    """kl_div 'batchmean' is the sum over the broadcast shape divided by input.shape[0]."""
    rng = np.random.default_rng(3)
    x, t = _smooth_arguments(rng, "kl_div", {}, input_shape, target_shape)
    expected = math.fsum(ref.kl_div(x, t).ravel()) / divisor
    assert math.isclose(ref.loss("kl_div", x, t, "batchmean"), expected, rel_tol=RTOL)
    if torch is not None:
        _assert_matches_torch("kl_div", x, t, "batchmean", np.float64(rng.normal()))


@needs_torch
def test_known_divergence_kl_target_grad_over_empty_broadcast():
    """Pins one deliberate difference from torch: an empty broadcast leaves a zero target gradient.

    torch computes ``xlogy(t, t)`` on the target's own shape before broadcasting, so with an input
    of shape (0, 3) and a target (3,) containing 0, the target gradient is ``0 * NaN = NaN`` even
    though no element of the loss depends on it. The reference sums an empty set of elementwise
    gradients and gives 0, the true derivative; tests comparing with torch must avoid this case.
    """
    x, t = np.zeros((0, 3)), np.array([0.0, 0.5, 1.0])
    _, _, torch_g_t = _torch_value_and_grads("kl_div", x, t, "sum", np.float64(1.0))
    _, g_t = ref.grads("kl_div", x, t, "sum")
    np.testing.assert_array_equal(np.isnan(torch_g_t), [True, False, False])
    np.testing.assert_array_equal(g_t, [0.0, 0.0, 0.0])


@settings(max_examples=100, deadline=None)
@given(
    # Rows of 1 to 1025 outcomes (the edge sizes), 4096 elements keep each example under 1 ms.
    data=st.data(),
    shape=strat.shapes(min_dims=1, max_dims=3, max_elements=4096),
    log_target=st.booleans(),
    log_input=st.booleans(),
)
def test_kl_of_a_distribution_with_itself_is_zero(data, shape, log_target, log_input):
    """KL(p || p) is exactly 0 elementwise, for every log_target / log_input combination."""
    p = data.draw(strat.probability_rows(shape))
    x = p if not log_input else np.log(p)
    t = p if not log_target else np.log(p)
    opts = {"log_target": log_target, "log_input": log_input}
    assert np.all(ref.loss("kl_div", x, t, "none", **opts) == 0.0)
    assert ref.loss("kl_div", x, t, "sum", **opts) == 0.0


@settings(max_examples=100, deadline=None)
@given(data=st.data(), shape=strat.shapes(min_dims=1, max_dims=3, max_elements=4096))
def test_kl_between_distributions_is_nonnegative_per_row(data, shape):
    """Gibbs' inequality: each row's sum of kl_div(log q, p) is >= 0, up to float64 rounding."""
    p = data.draw(strat.probability_rows(shape))
    log_q = data.draw(strat.log_probability_rows(shape))
    terms = ref.kl_div(log_q, p)
    rows = terms.sum(axis=-1)
    # Rounding of a sum of n terms is at most n * eps * sum |terms|, and the rows sum to 1 only
    # within n * eps; the bound below is that, not a tolerance fitted to results.
    n = shape[-1]
    slack = (n + 1) * np.finfo(np.float64).eps * (np.abs(terms).sum(axis=-1) + 1.0)
    assert np.all(rows >= -slack)


def _drawn_arguments(data, name, opts, max_elements):
    """Draw a broadcast pair and smooth float64 arguments of those shapes for loss ``name``."""
    input_shape, target_shape = data.draw(strat.broadcast_pairs(max_elements=max_elements))
    rng = np.random.default_rng(data.draw(strat.seeds()))
    return _smooth_arguments(rng, name, opts, input_shape, target_shape)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), case=st.sampled_from(LOSS_CASES))
def test_mean_is_sum_over_broadcast_count(data, case):
    """'mean' is the sum over the broadcast shape divided by its size (NaN when empty); its
    gradients are the 'sum' gradients over that size; 'batchmean' times input.shape[0] is 'sum'."""
    name, opts = case
    # 20,000 elements: past the 1025 edge in two dims while each example stays a few ms.
    x, t = _drawn_arguments(data, name, opts, max_elements=20_000)
    elementwise = ref.loss(name, x, t, "none", **opts)
    n = elementwise.size
    mean = ref.loss(name, x, t, "mean", **opts)
    if n == 0:
        assert np.isnan(mean)
        return
    total = math.fsum(elementwise.ravel())
    assert math.isclose(mean, total / n, rel_tol=RTOL, abs_tol=ATOL)
    assert math.isclose(ref.loss(name, x, t, "sum", **opts), total, rel_tol=RTOL, abs_tol=ATOL)
    batch = x.shape[0] if x.ndim else 1
    batchmean = ref.loss(name, x, t, "batchmean", **opts)
    assert math.isclose(batchmean * batch, total, rel_tol=RTOL, abs_tol=ATOL)
    sum_grads = ref.grads(name, x, t, "sum", grad_output=0.5, **opts)
    mean_grads = ref.grads(name, x, t, "mean", grad_output=0.5, **opts)
    for g_mean, g_sum in zip(mean_grads, sum_grads):
        np.testing.assert_allclose(g_mean * n, g_sum, rtol=RTOL, atol=ATOL)


@settings(max_examples=100, deadline=None)
@given(
    x=strat.finite_arrays((257,)),  # 257: one past a 256 block, any length serves the property
    t=strat.finite_arrays((257,)),
    margin=st.floats(-2.0, 2.0),
)
def test_hinge_is_zero_beyond_the_margin(x, t, margin):
    """Where x * t > margin the hinge value and gradients are 0; where x * t < margin the value is
    margin - x * t > 0 and the gradients are -t and -x."""
    value = ref.hinge(x, t, margin)
    g_x, g_t = ref.grads("hinge_loss", x, t, "none", margin=margin)
    beyond, inside = x * t > margin, x * t < margin
    assert np.all(value[beyond] == 0.0)
    assert np.all(g_x[beyond] == 0.0) and np.all(g_t[beyond] == 0.0)
    assert np.all(value[inside] > 0.0)
    np.testing.assert_array_equal(value[inside], (margin - x * t)[inside])
    np.testing.assert_array_equal(g_x[inside], -t[inside])
    np.testing.assert_array_equal(g_t[inside], -x[inside])


def test_low_precision_inputs_are_upcast_exactly():
    """bfloat16 / float16 / float32 arguments give the float64 results of their exact upcasts."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed")
    rng = np.random.default_rng(4)
    x64, t64 = rng.uniform(-3.0, 0.0, (4, 5)), rng.uniform(0.1, 1.0, (5,))
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        x, t = x64.astype(dtype), t64.astype(dtype)
        for name in ref.LOSS_NAMES:
            value = ref.loss(name, x, t, "none")
            assert value.dtype == np.float64
            np.testing.assert_array_equal(
                value, ref.loss(name, x.astype(np.float64), t.astype(np.float64), "none"))
            g_x, g_t = ref.grads(name, x, t, "sum")
            assert g_x.dtype == np.float64 and g_t.dtype == np.float64


def test_rejects_unknown_names_and_bad_upstream_shapes():
    """Unknown losses and reductions, and a grad_output of the wrong shape, raise ValueError."""
    x = t = np.ones((2, 3))
    with pytest.raises(ValueError, match="unknown loss 'l1_loss'"):
        ref.loss("l1_loss", x, t)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        ref.loss("mse_loss", x, t, "avg")
    with pytest.raises(ValueError, match=r"shape \(3,\) for reduction 'none'"):
        ref.grads("mse_loss", x, t, "none", grad_output=np.ones(3))
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for reduction 'sum'"):
        ref.grads("mse_loss", x, t, "sum", grad_output=np.ones((2, 3)))


@settings(max_examples=200, deadline=None)
@given(pair=strat.broadcast_pairs())
def test_broadcast_pairs_broadcast_within_the_element_budget(pair):
    """Every drawn pair broadcasts under NumPy's rules to at most MAX_ELEMENTS elements."""
    shape = np.broadcast_shapes(*pair)
    assert len(shape) <= 4
    assert math.prod(shape) <= strat.MAX_ELEMENTS


@settings(max_examples=50, deadline=None)
@given(data=st.data(), shape=strat.shapes(min_dims=1, max_dims=3, max_elements=20_000))
def test_probability_rows_are_positive_and_normalised(data, shape):
    """Rows are strictly positive and sum to 1 within the rounding of their dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed")
    for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
        p = data.draw(strat.probability_rows(shape, dtype))
        assert p.shape == shape and p.dtype == dtype
        p64 = p.astype(np.float64)
        assert np.all(p64 > 0)
        if shape[-1] == 0:
            continue  # rows of zero outcomes: nothing sums to 1
        # Rounding each element to the dtype moves the row sum by at most eps / 2 (relative to a
        # sum of 1), the subnormal floor adds at most n * smallest_subnormal, and the float64
        # softmax and sum are within n * eps64 of 1: the bound is that rounding, not a fitted one.
        info = strat._finfo(dtype)
        n = shape[-1]
        eps64 = np.finfo(np.float64).eps
        bound = float(info.eps) / 2 + n * (float(info.smallest_subnormal) + eps64)
        np.testing.assert_allclose(p64.sum(axis=-1), 1.0, rtol=0, atol=bound)
