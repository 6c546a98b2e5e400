"""Tests of the float64 references in reference.py, and of the shared strategies.

The references are what every GPU test compares against, so they are checked three independent
ways: against central finite differences, against torch's CPU float64 values and autograd gradients
(skipped when torch is not installed), and against invariance properties. Runs on a CPU in CI.
"""

import math
import warnings
from typing import NamedTuple

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

try:
    import mpmath
except ImportError:  # mpmath comes with torch (through sympy); the accuracy tests skip without it
    mpmath = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")
needs_mpmath = pytest.mark.skipif(mpmath is None, reason="mpmath not installed")

# Float64 on both sides with the same formulas: only summation order and operation order differ,
# each a few ulps per element, far below 1e-12 at the magnitudes (<= ~1e3) these tests produce.
RTOL = 1e-12
ATOL = 1e-12


class Case(NamedTuple):
    """A loss variant: its name, its options and the optional arrays (weight, ...) it is given."""

    name: str
    opts: dict = {}
    extras: tuple = ()


# Every loss variant: each option that switches a formula (kl_div's four log_target x log_input
# combinations, beta == 0, log_input, full, alpha < 0, gamma == 0, ...) and each optional array.
LOSS_CASES = [
    Case("mse_loss"),
    Case("kl_div"),
    Case("kl_div", {"log_target": True}),
    Case("kl_div", {"log_input": False}),
    Case("kl_div", {"log_target": True, "log_input": False}),
    Case("hinge_loss"),
    Case("hinge_loss", {"margin": 0.5}),
    Case("l1_loss"),
    Case("smooth_l1_loss"),
    Case("smooth_l1_loss", {"beta": 0.5}),
    Case("smooth_l1_loss", {"beta": 0.0}),  # torch dispatches to l1_loss
    Case("huber_loss"),
    Case("huber_loss", {"delta": 0.5}),
    Case("binary_cross_entropy"),
    Case("binary_cross_entropy", {}, ("weight",)),
    Case("binary_cross_entropy_with_logits"),
    Case("binary_cross_entropy_with_logits", {}, ("weight",)),
    Case("binary_cross_entropy_with_logits", {}, ("pos_weight",)),
    Case("binary_cross_entropy_with_logits", {}, ("weight", "pos_weight")),
    Case("soft_margin_loss"),
    Case("hinge_embedding_loss"),
    Case("hinge_embedding_loss", {"margin": 0.5}),
    Case("margin_ranking_loss"),
    Case("margin_ranking_loss", {"margin": 0.5}),
    Case("poisson_nll_loss"),
    Case("poisson_nll_loss", {"full": True}),
    Case("poisson_nll_loss", {"log_input": False}),
    Case("poisson_nll_loss", {"log_input": False, "full": True, "eps": 0.1}),
    Case("gaussian_nll_loss"),
    Case("gaussian_nll_loss", {"full": True, "eps": 0.5}),  # eps 0.5: the clamp is active
    Case("squared_hinge_loss"),
    Case("squared_hinge_loss", {"margin": 0.5}),
    Case("sigmoid_focal_loss"),
    Case("sigmoid_focal_loss", {"alpha": -1.0, "gamma": 0.0}),  # bce_with_logits
    Case("sigmoid_focal_loss", {"alpha": 0.5, "gamma": 1.5}),
    Case("log_cosh_loss"),
]

# Arguments torch's autograd refuses to differentiate ("not differentiable with respect to
# argument"): their gradients are checked against finite differences and properties only.
TORCH_NO_GRAD = {
    "binary_cross_entropy": {"weight"},
    "binary_cross_entropy_with_logits": {"weight", "pos_weight"},
    "soft_margin_loss": {"target"},
}

# Arguments whose finite differences say nothing: hinge_embedding_loss's target only picks a
# branch (t == 1, t == -1), so moving it by h jumps between branches; its gradient is 0.
NO_FINITE_DIFFERENCES = {"hinge_embedding_loss": {"target"}}


def _case_id(case):
    """Readable pytest id for a LOSS_CASES entry, e.g. ``kl_div-log_target=True``."""
    return "-".join([case.name] + [f"{k}={v}" for k, v in sorted(case.opts.items())]
                    + ["+" + e for e in case.extras])


# Shape pairs (input, target) for the fixed-shape tests, each here for the broadcast path it takes.
SHAPE_PAIRS = [
    pytest.param((3, 4), (3, 4), id="equal"),  # no broadcasting; 12 elements, 3 rows for batchmean
    pytest.param((3, 4), (4,), id="row"),  # (N, C) with (C,): the target gradient sums over rows
    pytest.param((3, 1), (3, 4), id="input-col"),  # the input is the broadcast one, a size-1 dim
    pytest.param((2, 1, 3), (4, 1), id="both"),  # both sides broadcast, to (2, 4, 3)
    pytest.param((), (5,), id="input-0d"),  # 0-d input: batchmean is the plain sum
    pytest.param((5,), (), id="target-0d"),  # 0-d target: its gradient sums every element
]


def _shapes(case, input_shape, target_shape, extra_kind="trailing"):
    """Shapes of every array of ``case`` from an (input, target) pair.

    margin_ranking_loss takes the pair as (input1, input2) and a target of the broadcast shape's
    last dim; gaussian_nll_loss's var has the input's shape (torch's other var shapes have their
    own test); weight and pos_weight are the broadcast shape's last dim ((C,) against (N, C), the
    usual per-class array) for ``extra_kind='trailing'``, the broadcast shape for 'full' and 0-d
    for 'scalar'.
    """
    out = np.broadcast_shapes(input_shape, target_shape)
    if case.name == "margin_ranking_loss":
        return {"input1": input_shape, "input2": target_shape, "target": out[-1:]}
    shapes = {"input": input_shape, "target": target_shape}
    if case.name == "gaussian_nll_loss":
        shapes["var"] = input_shape
    for extra in case.extras:
        shapes[extra] = {"trailing": out[-1:], "full": out, "scalar": ()}[extra_kind]
    return shapes


def _kink_distance(case, a):
    """Distance of every element from the loss's nearest kink or jump (inf for smooth losses)."""
    o = case.opts
    with np.errstate(all="ignore"):
        if case.name in ("hinge_loss", "squared_hinge_loss"):
            x, t = np.broadcast_arrays(a["input"], a["target"])
            return np.abs(o.get("margin", 1.0) - x * t)
        if case.name == "l1_loss":
            return np.abs(np.subtract(a["input"], a["target"]))
        if case.name in ("smooth_l1_loss", "huber_loss"):
            z = np.abs(np.subtract(a["input"], a["target"]))
            knot = o.get("beta", o.get("delta", 1.0))
            return np.minimum(np.abs(z - knot), z) if knot == 0 else np.abs(z - knot)
        if case.name == "hinge_embedding_loss":
            x, t = np.broadcast_arrays(a["input"], a["target"])
            return np.where(t != 1, np.abs(o.get("margin", 1.0) - x), np.inf)
        if case.name == "margin_ranking_loss":
            x1, x2, t = np.broadcast_arrays(a["input1"], a["input2"], a["target"])
            return np.abs(-t * (x1 - x2) + o.get("margin", 0.0))
        if case.name == "poisson_nll_loss" and o.get("full"):
            return np.abs(np.asarray(a["target"]) - 1.0)
    return np.array(np.inf)


def _draw(rng, case, shapes):
    """One draw of float64 arguments of the given shapes in the loss's usual domain."""
    name, o = case.name, case.opts
    u = lambda low, high, key: np.asarray(rng.uniform(low, high, shapes[key]))  # noqa: E731
    if name == "kl_div":
        x = u(-3.0, 0.0, "input") if o.get("log_input", True) else u(0.1, 1.0, "input")
        t = u(-3.0, 0.5, "target") if o.get("log_target", False) else u(0.1, 1.0, "target")
        return {"input": x, "target": t}
    if name == "binary_cross_entropy":
        a = {"input": u(0.02, 0.98, "input"), "target": u(0.0, 1.0, "target")}
    elif name in ("binary_cross_entropy_with_logits", "sigmoid_focal_loss"):
        a = {"input": u(-4.0, 4.0, "input"), "target": u(0.0, 1.0, "target")}
    elif name == "hinge_embedding_loss":
        # Labels -1 and 1, and 0.5: any other value takes both branches (torch's two wheres).
        labels = np.array([-1.0, 1.0, 0.5])
        a = {"input": u(-2.0, 2.0, "input"),
             "target": np.asarray(labels[rng.integers(0, 3, shapes["target"])])}
    elif name == "margin_ranking_loss":
        return {"input1": u(-2.0, 2.0, "input1"), "input2": u(-2.0, 2.0, "input2"),
                "target": u(-1.5, 1.5, "target")}
    elif name == "poisson_nll_loss":
        x = u(-2.0, 1.5, "input") if o.get("log_input", True) else u(0.1, 3.0, "input")
        a = {"input": x, "target": u(0.0, 3.0, "target")}
    elif name == "gaussian_nll_loss":
        return {"input": u(-2.0, 2.0, "input"), "target": u(-2.0, 2.0, "target"),
                "var": u(0.1, 2.0, "var")}
    else:
        a = {"input": u(-2.0, 2.0, "input"), "target": u(-2.0, 2.0, "target")}
    for extra in case.extras:  # weights of either sign would do; positive ones are the usual
        a[extra] = u(0.5, 3.0, extra)
    return a


def _smooth_arguments(rng, case, shapes, kink_gap=0.0):
    """Random float64 arguments (name -> array) in the loss's differentiable region.

    Arguments are redrawn until every element is more than ``kink_gap`` from a kink or jump of
    the loss (``_kink_distance``); finite differences pass 1e-3, a thousand times the step of a
    central difference, and use shapes small enough for that to succeed quickly.
    """
    while True:
        a = _draw(rng, case, shapes)
        if np.all(_kink_distance(case, a) > kink_gap):
            return a


def _required(case):
    """The required array arguments of a case's loss, in torch's order."""
    return [n for n in ref.array_names(case.name) if n not in ("weight", "pos_weight")]


def _ref_loss(case, a, reduction):
    """reference.loss on a case's arrays (name -> array)."""
    extras = {n: a[n] for n in case.extras}
    return ref.loss(case.name, *[a[n] for n in _required(case)], reduction, **extras, **case.opts)


def _ref_grads(case, a, reduction, grad_output):
    """reference.grads on a case's arrays, as name -> gradient."""
    extras = {n: a[n] for n in case.extras}
    g = ref.grads(case.name, *[a[n] for n in _required(case)], reduction, grad_output,
                  **extras, **case.opts)
    return dict(zip(_required(case) + list(case.extras), g))


def _upstream(rng, reduction, shape):
    """A random upstream gradient: an array of the broadcast shape for 'none', else a scalar."""
    if reduction == "none":
        return np.asarray(rng.normal(size=shape))
    return np.float64(rng.normal())


def _out_shape(a):
    """Broadcast shape of every array argument."""
    return np.broadcast_shapes(*(np.shape(v) for v in a.values()))


def _reductions_for(name):
    """Reductions torch offers for ``name``: 'batchmean' only exists for kl_div."""
    return ref.REDUCTIONS if name == "kl_div" else ("none", "sum", "mean")


def _central_differences(f, a, h):
    """Central-difference gradients (name -> array) of the scalar ``f(a)`` for every array."""
    out = {}
    for name, base in a.items():
        g = np.zeros(np.shape(base))
        for idx in np.ndindex(g.shape):
            plus, minus = base.copy(), base.copy()
            plus[idx] += h
            minus[idx] -= h
            g[idx] = (f({**a, name: plus}) - f({**a, name: minus})) / (2 * h)
        out[name] = g
    return out


@pytest.mark.parametrize("input_shape,target_shape", SHAPE_PAIRS)
@pytest.mark.parametrize("reduction", ref.REDUCTIONS)
@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_grads_match_finite_differences(case, reduction, input_shape, target_shape):
    """Analytic gradients, scaled by the reduction and summed to each shape, match differences."""
    rng = np.random.default_rng(0)
    a = _smooth_arguments(rng, case, _shapes(case, input_shape, target_shape), kink_gap=1e-3)
    g = _upstream(rng, reduction, _out_shape(a))

    def objective(args):
        return float(np.sum(g * _ref_loss(case, args, reduction)))

    # h = 1e-6: truncation error ~h^2 |f'''| <= 1e-7 here (|f'''| <= 2.5e5 for log x, x >= 0.02)
    # and rounding ~eps |f| / h <= 1e-8; 1e-6 is above both and far below any wrong scale.
    numeric = _central_differences(objective, a, h=1e-6)
    analytic = _ref_grads(case, a, reduction, g)
    skip = NO_FINITE_DIFFERENCES.get(case.name, set())
    if case.name == "gaussian_nll_loss" and np.any(a["var"] < case.opts.get("eps", 1e-6)):
        # Torch clamps var under no_grad, so where the clamp is active var's gradient is the
        # formula at eps, not the derivative (0); the torch and edge-case tests pin it there.
        skip = {"var"}
    for name, grad in analytic.items():
        assert grad.shape == np.shape(a[name]), name
        if name not in skip:
            np.testing.assert_allclose(grad, numeric[name], rtol=1e-6, atol=1e-6, err_msg=name)


def _torch_reduce(z, reduction, batch):
    """Reduce a torch tensor like torch's losses ('batchmean': sum / input.shape[0])."""
    if reduction == "none":
        return z
    if reduction == "sum":
        return z.sum()
    return z.mean() if reduction == "mean" else z.sum() / batch


def _torch_loss(case, ts, reduction):
    """The torch (or torchvision, written out in torch) value of a case on tensors ``ts``."""
    name, o = case.name, case.opts
    r = reduction
    if name == "mse_loss":
        return F.mse_loss(ts["input"], ts["target"], reduction=r)
    if name == "kl_div":
        x = ts["input"] if o.get("log_input", True) else torch.log(ts["input"])
        return F.kl_div(x, ts["target"], reduction=r, log_target=o.get("log_target", False))
    if name == "l1_loss":
        return F.l1_loss(ts["input"], ts["target"], reduction=r)
    if name == "smooth_l1_loss":
        return F.smooth_l1_loss(ts["input"], ts["target"], reduction=r, beta=o.get("beta", 1.0))
    if name == "huber_loss":
        return F.huber_loss(ts["input"], ts["target"], reduction=r, delta=o.get("delta", 1.0))
    if name == "poisson_nll_loss":
        return F.poisson_nll_loss(ts["input"], ts["target"], log_input=o.get("log_input", True),
                                  full=o.get("full", False), eps=o.get("eps", 1e-8), reduction=r)
    if name == "gaussian_nll_loss":
        return F.gaussian_nll_loss(ts["input"], ts["target"], ts["var"], full=o.get("full", False),
                                   eps=o.get("eps", 1e-6), reduction=r)
    if name == "hinge_embedding_loss":
        return F.hinge_embedding_loss(ts["input"], ts["target"], margin=o.get("margin", 1.0),
                                      reduction=r)
    # The rest need arrays of one shape (torch raises otherwise, or writes in place into the
    # input's shape): broadcast the required arrays; weight and pos_weight broadcast inside.
    required = _required(case)
    full = torch.broadcast_tensors(*[ts[n] for n in required])
    t = dict(zip(required, full))
    if name == "binary_cross_entropy":
        w = ts.get("weight")
        if w is not None:
            w = w.expand(full[0].shape)
        return F.binary_cross_entropy(t["input"], t["target"], weight=w, reduction=r)
    if name == "binary_cross_entropy_with_logits":
        return F.binary_cross_entropy_with_logits(t["input"], t["target"], weight=ts.get("weight"),
                                                  pos_weight=ts.get("pos_weight"), reduction=r)
    if name == "soft_margin_loss":
        return F.soft_margin_loss(t["input"], t["target"], reduction=r)
    if name == "margin_ranking_loss":
        return F.margin_ranking_loss(t["input1"], t["input2"], t["target"],
                                     margin=o.get("margin", 0.0), reduction=r)
    x, y = t["input"], t["target"]
    batch = x.shape[0] if x.dim() else 1
    if name == "hinge_loss":
        z = torch.clamp(o.get("margin", 1.0) - x * y, min=0)
    elif name == "squared_hinge_loss":
        z = torch.clamp(o.get("margin", 1.0) - x * y, min=0) ** 2
    elif name == "log_cosh_loss":
        z = torch.log(torch.cosh(x - y))
    elif name == "sigmoid_focal_loss":  # torchvision.ops.sigmoid_focal_loss, line for line
        alpha, gamma = o.get("alpha", 0.25), o.get("gamma", 2.0)
        p = torch.sigmoid(x)
        ce_loss = F.binary_cross_entropy_with_logits(x, y, reduction="none")
        p_t = p * y + (1 - p) * (1 - y)
        z = ce_loss * ((1 - p_t) ** gamma)
        if alpha >= 0:
            alpha_t = alpha * y + (1 - alpha) * (1 - y)
            z = alpha_t * z
    else:
        raise AssertionError(f"no torch counterpart for {name}")
    return _torch_reduce(z, r, batch)


def _torch_value_and_grads(case, a, reduction, grad_output):
    """Value and autograd gradients (name -> array, None where torch gives none) in float64."""
    no_grad = TORCH_NO_GRAD.get(case.name, set())
    ts = {n: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=n not in no_grad)
          for n, v in a.items()}
    with warnings.catch_warnings():
        # Losses warn when they broadcast, kl_div when reduction is 'mean'; both are intended.
        warnings.simplefilter("ignore", UserWarning)
        out = _torch_loss(case, ts, reduction)
    out.backward(torch.tensor(np.asarray(grad_output, dtype=np.float64)))
    grads = {}
    for n, t in ts.items():
        if n in no_grad:
            grads[n] = None
        else:  # no grad at all (hinge_embedding's target) is a zero gradient
            grads[n] = (t.grad if t.grad is not None else torch.zeros_like(t)).numpy()
    return out.detach().numpy(), grads


def _assert_same(actual, desired, what=""):
    """Same shape, same NaN and inf positions, and values within RTOL/ATOL."""
    assert np.shape(actual) == np.shape(desired), what
    np.testing.assert_allclose(actual, desired, rtol=RTOL, atol=ATOL, equal_nan=True,
                               err_msg=what)


def _assert_matches_torch(case, a, reduction, grad_output):
    """Reference value and gradients equal torch's, NaN pattern included."""
    value, torch_grads = _torch_value_and_grads(case, a, reduction, grad_output)
    _assert_same(_ref_loss(case, a, reduction), value, "value")
    for name, grad in _ref_grads(case, a, reduction, grad_output).items():
        if torch_grads[name] is not None:
            _assert_same(grad, torch_grads[name], f"d/d{name}")


# Every (loss case, reduction) pair that torch offers.
TORCH_CASES = [
    pytest.param(case, reduction, id=f"{_case_id(case)}-{reduction}")
    for case in LOSS_CASES
    for reduction in _reductions_for(case.name)
]


@needs_torch
@pytest.mark.parametrize("input_shape,target_shape", SHAPE_PAIRS)
@pytest.mark.parametrize("case,reduction", TORCH_CASES)
def test_matches_torch(case, reduction, input_shape, target_shape):
    """Values and gradients equal torch's on the fixed shape pairs, with a random upstream."""
    rng = np.random.default_rng(1)
    a = _smooth_arguments(rng, case, _shapes(case, input_shape, target_shape))
    g = _upstream(rng, reduction, _out_shape(a))
    _assert_matches_torch(case, a, reduction, g)


@st.composite
def _drawn_case_arguments(draw, cases, max_elements):
    """(case, arrays) with a broadcast pair from the strategy and extras of a drawn kind."""
    case = draw(st.sampled_from(cases))
    pair = draw(strat.broadcast_pairs(max_elements=max_elements))
    extra_kind = draw(st.sampled_from(("trailing", "full", "scalar")))
    rng = np.random.default_rng(draw(strat.seeds()))
    return case, _smooth_arguments(rng, case, _shapes(case, *pair, extra_kind)), rng


@needs_torch
@settings(max_examples=300, deadline=None)  # deadline off: torch's first call is slow to warm up
@given(
    # 4096 elements still reach every broadcast kind and the 0, 1, 31..33 and 255..257 sizes.
    drawn=_drawn_case_arguments(LOSS_CASES, max_elements=4096),
    reduction=st.sampled_from(ref.REDUCTIONS),
)
def test_matches_torch_on_drawn_broadcast_pairs(drawn, reduction):
    """Values and gradients equal torch's for every kind of broadcast the strategy draws."""
    case, a, rng = drawn
    assume(reduction in _reductions_for(case.name))
    g = _upstream(rng, reduction, _out_shape(a))
    _assert_matches_torch(case, a, reduction, g)


NAN, INF = np.nan, np.inf
E = math.exp(-0.5)
LOG2 = math.log(2.0)
EPS12 = float(np.float32(1e-12))  # torch's EPSILON in binary_cross_entropy_backward, 1e-12f


def _sp(z):
    """softplus in scalar math, for hand-derived table entries."""
    return max(z, 0.0) + math.log1p(math.exp(-abs(z)))


def _sg(z):
    """sigmoid in scalar math."""
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _edge(case, arrays, value, grads, id, torch_agrees=True):
    """One edge case: arrays and the hand-derived elementwise value and partials (name -> list).

    ``torch_agrees`` is False where torch refuses the arguments (bce outside [0, 1], negative
    var) or gives a different number on purpose (its soft margin overflows); those entries are
    pinned against the hand-derived numbers only.
    """
    return pytest.param(case, arrays, value, grads, torch_agrees, id=id)


# Edge cases, each derived by hand from torch's definitions (torchvision's for the focal loss):
# the arrays, the elementwise value and the elementwise partials. Three elements each.
EDGE_CASES = [
    _edge(Case("hinge_loss"), {"input": [0.5, -0.5, 2.0], "target": [2.0, -2.0, 0.5]},
          # x * t == margin exactly: the value is 0 and clamp(min=0) still passes the gradient.
          [0.0, 0.0, 0.0], {"input": [-2.0, 2.0, -0.5], "target": [-0.5, 0.5, -2.0]},
          "hinge-tie-passes-gradient"),
    _edge(Case("hinge_loss", {"margin": 0.0}),
          {"input": [0.0, 1.0, -1.0], "target": [3.0, 0.0, 2.0]},
          # margin 0 ties at x == 0 or t == 0; the third element is plainly inside the margin.
          [0.0, 0.0, 2.0], {"input": [-3.0, -0.0, -2.0], "target": [-0.0, -1.0, 1.0]},
          "hinge-tie-at-zero-margin"),
    _edge(Case("hinge_loss"), {"input": [NAN, 0.5, 3.0], "target": [1.0, NAN, 1.0]},
          # NaN propagates to the value; the NaN mask is 0 but -x * 0 is still NaN for a NaN x.
          [NAN, NAN, 0.0], {"input": [-0.0, NAN, -0.0], "target": [NAN, -0.0, -0.0]},
          "hinge-nan"),
    _edge(Case("mse_loss"), {"input": [NAN, INF, 1.0], "target": [0.0, INF, INF]},
          # NaN propagates, inf - inf is NaN, and 1 - inf squares to inf.
          [NAN, NAN, INF], {"input": [NAN, NAN, -INF], "target": [NAN, NAN, INF]},
          "mse-nan-inf"),
    _edge(Case("kl_div"), {"input": [-1.0, -2.0, -INF], "target": [0.0, 0.5, 0.0]},
          # t == 0 contributes 0 to the value, but its gradient is NaN (log 0 is skipped, t/t is
          # not); t == 0 with x == -inf is 0 - 0 * (-inf) = NaN.
          [0.0, 0.5 * math.log(0.5) + 1.0, NAN],
          {"input": [-0.0, -0.5, -0.0], "target": [NAN, math.log(0.5) + 1.0 + 2.0, NAN]},
          "kl-zero-target"),
    _edge(Case("kl_div"), {"input": [-1.0, NAN, -1.0], "target": [-0.5, 0.5, NAN]},
          # a negative target has a NaN log; NaN in either argument propagates.
          [NAN, NAN, NAN], {"input": [0.5, -0.5, NAN], "target": [NAN, NAN, NAN]},
          "kl-negative-and-nan"),
    _edge(Case("kl_div", {"log_input": False}),
          {"input": [0.0, 0.0, 0.5], "target": [0.0, 0.25, 0.0]},
          # p == 0: log p = -inf. t == 0 gives 0 * -inf = NaN, t > 0 gives inf; d/dp = -t/p.
          [NAN, INF, 0.0], {"input": [NAN, -INF, -0.0], "target": [NAN, INF, NAN]},
          "kl-zero-probability"),
    _edge(Case("kl_div", {"log_target": True}),
          {"input": [-1.0, -INF, 0.0], "target": [-INF, -INF, -0.5]},
          # a zero probability in log space: exp(-inf) * (-inf - x) is 0 * -inf = NaN, not 0.
          [NAN, NAN, -0.5 * E], {"input": [-0.0, -0.0, -E], "target": [NAN, NAN, 0.5 * E]},
          "kl-log-target-minus-inf"),
    _edge(Case("l1_loss"), {"input": [1.0, 2.0, NAN], "target": [1.0, 3.0, 0.0]},
          # the tie x == t has gradient 0 (sign(0)); a NaN difference too (torch's sgn(NaN) = 0).
          [0.0, 1.0, NAN], {"input": [0.0, -1.0, 0.0], "target": [0.0, 1.0, 0.0]},
          "l1-tie-and-nan"),
    _edge(Case("smooth_l1_loss", {"beta": 0.5}),
          {"input": [0.0, 0.5, -0.5], "target": [0.0, 0.0, 0.0]},
          # |d| == beta takes the linear branch and its constant gradient; d == 0 has gradient 0.
          [0.0, 0.25, 0.25], {"input": [0.0, 1.0, -1.0], "target": [0.0, -1.0, 1.0]},
          "smooth-l1-ties"),
    _edge(Case("smooth_l1_loss", {"beta": 0.0}),
          {"input": [0.0, 0.5, -2.0], "target": [0.0, 0.0, 0.0]},
          # beta == 0 is l1_loss, with its 0 gradient at d == 0 (not d / beta = NaN).
          [0.0, 0.5, 2.0], {"input": [0.0, 1.0, -1.0], "target": [0.0, -1.0, 1.0]},
          "smooth-l1-beta-zero"),
    _edge(Case("smooth_l1_loss"), {"input": [NAN, 0.25, 3.0], "target": [0.0, 0.0, 0.5]},
          # NaN fails both comparisons and takes d / beta.
          [NAN, 0.03125, 2.0], {"input": [NAN, 0.25, 1.0], "target": [NAN, -0.25, -1.0]},
          "smooth-l1-nan"),
    _edge(Case("huber_loss", {"delta": 0.5}),
          {"input": [0.5, -0.5, 0.25], "target": [0.0, 0.0, 0.0]},
          # |d| == delta: delta (|d| - delta / 2) and the constant gradient +-delta.
          [0.125, 0.125, 0.03125], {"input": [0.5, -0.5, 0.25], "target": [-0.5, 0.5, -0.25]},
          "huber-ties"),
    _edge(Case("binary_cross_entropy"), {"input": [0.0, 1.0, 0.0], "target": [0.0, 1.0, 1.0]},
          # log 0 is clamped to -100 (so 0 * log 0 is 0); the input gradient divides by
          # max(x (1 - x), 1e-12f), the target gradient -logit(x) is not clamped.
          [0.0, 0.0, 100.0], {"input": [0.0, 0.0, -1.0 / EPS12], "target": [INF, -INF, INF]},
          "bce-saturated"),
    _edge(Case("binary_cross_entropy"), {"input": [1.5, -0.5, 0.5], "target": [0.5, 0.5, 0.5]},
          # outside [0, 1] (torch raises): a log of a negative number is NaN; the input gradient
          # is the formula's (x (1 - x) < 0 takes 1e-12f).
          [NAN, NAN, LOG2], {"input": [1.0 / EPS12, -1.0 / EPS12, 0.0],
                             "target": [NAN, NAN, 0.0]},
          "bce-out-of-range", torch_agrees=False),
    _edge(Case("binary_cross_entropy", {}, ("weight",)),
          {"input": [0.5, 0.25, 0.0], "target": [1.0, 0.0, 0.0], "weight": [2.0, 0.0, 3.0]},
          # d/dw is the unweighted loss; a zero weight zeroes value and gradients.
          [2 * LOG2, 0.0, 0.0],
          {"input": [-4.0, 0.0, 0.0], "target": [0.0, 0.0, INF],
           "weight": [LOG2, -math.log(0.75), 0.0]},
          "bce-weight"),
    _edge(Case("binary_cross_entropy_with_logits"),
          {"input": [800.0, -800.0, 0.0], "target": [1.0, 0.0, 0.5]},
          # saturated logits lose nothing: exp never overflows, 1 - sigmoid is sigmoid(-x).
          [0.0, 0.0, LOG2], {"input": [0.0, 0.0, 0.0], "target": [-800.0, 800.0, 0.0]},
          "bce-logits-saturated"),
    _edge(Case("binary_cross_entropy_with_logits", {}, ("weight", "pos_weight")),
          {"input": [2.0, -1.0, 0.0], "target": [1.0, 1.0, 0.0], "weight": [0.5, 1.0, 2.0],
           "pos_weight": [3.0, 0.5, 2.0]},
          # w ((1 - t) softplus(x) + p t softplus(-x)); pos_weight scales the positive term.
          [0.5 * 3.0 * _sp(-2.0), 0.5 * _sp(1.0), 2.0 * LOG2],
          {"input": [-0.5 * 3.0 * _sg(-2.0), -0.5 * _sg(1.0), 1.0],
           "target": [0.5 * (3.0 * _sp(-2.0) - _sp(2.0)), 0.5 * _sp(1.0) - _sp(-1.0),
                      2.0 * (2.0 * LOG2 - LOG2)],
           "weight": [3.0 * _sp(-2.0), 0.5 * _sp(1.0), LOG2],
           "pos_weight": [0.5 * _sp(-2.0), _sp(1.0), 0.0]},
          "bce-logits-weights"),
    _edge(Case("soft_margin_loss"), {"input": [-800.0, 800.0, 0.0], "target": [1.0, -1.0, 1.0]},
          # softplus(-x t) stays finite where torch's log1p(exp(-x t)) overflows to inf (and its
          # gradient to inf / inf = NaN).
          [800.0, 800.0, LOG2], {"input": [-1.0, 1.0, -0.5], "target": [800.0, -800.0, 0.0]},
          "soft-margin-large", torch_agrees=False),
    _edge(Case("soft_margin_loss"), {"input": [0.5, -2.0, NAN], "target": [1.0, 0.5, 1.0]},
          [_sp(-0.5), _sp(1.0), NAN],
          {"input": [-_sg(-0.5), -0.5 * _sg(1.0), NAN], "target": [-0.5 * _sg(-0.5),
                                                                   2.0 * _sg(1.0), NAN]},
          "soft-margin"),
    _edge(Case("hinge_embedding_loss"), {"input": [0.2, 1.0, 2.0], "target": [-1.0, -1.0, 0.5]},
          # margin - x == 0 passes the clamp's gradient; a target other than +-1 takes both terms.
          [0.8, 0.0, 2.0], {"input": [-1.0, -1.0, 1.0], "target": [0.0, 0.0, 0.0]},
          "hinge-embedding-tie"),
    _edge(Case("hinge_embedding_loss"), {"input": [NAN, NAN, 0.5], "target": [1.0, -1.0, 0.0]},
          # t == 1 passes x (gradient 1, NaN value); t == -1 clamps NaN (value NaN, gradient 0).
          [NAN, NAN, 1.0], {"input": [1.0, 0.0, 0.0], "target": [0.0, 0.0, 0.0]},
          "hinge-embedding-nan"),
    _edge(Case("margin_ranking_loss"),
          {"input1": [0.2, 1.0, 2.0], "input2": [0.2, 0.0, 3.0], "target": [1.0, 1.0, 1.0]},
          # a tie (x1 == x2, margin 0) passes the gradient; a correct ranking blocks it.
          [0.0, 0.0, 1.0], {"input1": [-1.0, -0.0, -1.0], "input2": [1.0, 0.0, 1.0],
                            "target": [-0.0, -0.0, 1.0]},
          "margin-ranking-tie"),
    _edge(Case("poisson_nll_loss", {"full": True}),
          {"input": [0.5, 0.5, 0.5], "target": [0.0, 0.5, 2.0]},
          # Stirling only where t > 1; its masked backward is still NaN at t == 0 (0 * log 0).
          [math.exp(0.5), math.exp(0.5) - 0.25,
           math.exp(0.5) - 1.0 + 2 * LOG2 - 2.0 + 0.5 * math.log(4 * math.pi)],
          {"input": [math.exp(0.5), math.exp(0.5) - 0.5, math.exp(0.5) - 2.0],
           "target": [NAN, -0.5, -0.5 + LOG2 + 0.25]},
          "poisson-full-masks"),
    _edge(Case("poisson_nll_loss", {"log_input": False}),
          {"input": [0.0, 1.0, 2.0], "target": [1.0, 0.0, 2.0]},
          # eps keeps log(x + eps) finite at x == 0.
          [-math.log(1e-8), 1.0, 2.0 - 2.0 * math.log(2.0 + 1e-8)],
          {"input": [1.0 - 1.0 / 1e-8, 1.0, 1.0 - 2.0 / (2.0 + 1e-8)],
           "target": [-math.log(1e-8), -math.log(1.0 + 1e-8), -math.log(2.0 + 1e-8)]},
          "poisson-probability-input"),
    _edge(Case("gaussian_nll_loss"),
          {"input": [0.2, 1.0, 0.0], "target": [0.0, 0.5, 1.0], "var": [1e-9, 0.0, 2.0]},
          # var below eps is clamped to eps, and the gradient still reaches it (torch clamps
          # under no_grad).
          [0.5 * (math.log(1e-6) + 0.04 / 1e-6), 0.5 * (math.log(1e-6) + 0.25 / 1e-6),
           0.5 * (LOG2 + 0.5)],
          {"input": [0.2 / 1e-6, 0.5 / 1e-6, -0.5], "target": [-0.2 / 1e-6, -0.5 / 1e-6, 0.5],
           "var": [0.5 * (1e6 - 0.04e12), 0.5 * (1e6 - 0.25e12), 0.5 * (0.5 - 0.25)]},
          "gaussian-clamped-var"),
    _edge(Case("gaussian_nll_loss", {"full": True}),
          {"input": [0.0, 1.0, NAN], "target": [0.0, 0.0, 0.0], "var": [-1.0, 1.0, 1.0]},
          # a negative var (torch raises, after a host sync) is clamped to eps like any other.
          [0.5 * math.log(1e-6) + 0.5 * math.log(2 * math.pi),
           0.5 + 0.5 * math.log(2 * math.pi), NAN],
          {"input": [0.0, 1.0, NAN], "target": [-0.0, -1.0, NAN],
           "var": [0.5 / 1e-6, 0.0, NAN]},
          "gaussian-negative-var", torch_agrees=False),
    _edge(Case("squared_hinge_loss"), {"input": [0.5, 2.0, NAN], "target": [1.0, 1.0, 1.0]},
          # past the margin both value and gradient are 0; a NaN product is blocked by the clamp
          # in the gradient (0 * t) but not in the value.
          [0.25, 0.0, NAN], {"input": [-1.0, -0.0, 0.0], "target": [-0.5, -0.0, NAN]},
          "squared-hinge"),
    _edge(Case("sigmoid_focal_loss"), {"input": [0.0, 0.0, 2.0], "target": [1.0, 0.0, 1.0]},
          # p = 1/2 at x == 0: q = 1/2, ce = log 2, alpha_t = 0.25 or 0.75.
          [0.25 * LOG2 * 0.25, 0.75 * LOG2 * 0.25, 0.25 * _sp(-2.0) * _sg(-2.0) ** 2],
          {"input": [0.25 * (-0.5 * 0.25 - LOG2 * 1.0 * 0.25),
                     0.75 * (0.5 * 0.25 + LOG2 * 1.0 * 0.25),
                     0.25 * (-_sg(-2.0) ** 3 - _sp(-2.0) * 2 * _sg(-2.0) ** 2 * _sg(2.0))],
           "target": [-0.5 * LOG2 * 0.25 + 0.25 * (0.0 + 0.0),
                      -0.5 * LOG2 * 0.25 + 0.75 * (0.0 + 0.0),
                      -0.5 * _sp(-2.0) * _sg(-2.0) ** 2
                      + 0.25 * (-2.0 * _sg(-2.0) ** 2
                                + _sp(-2.0) * 2 * _sg(-2.0) * (_sg(-2.0) - _sg(2.0)))]},
          "focal"),
    _edge(Case("log_cosh_loss"), {"input": [0.0, 1e-8, 800.0], "target": [0.0, 0.0, 0.0]},
          # d**2 / 2 near 0 (no cancellation), |d| - log 2 far out (no overflow of cosh).
          [0.0, 5e-17, 800.0 - LOG2], {"input": [0.0, 1e-8, 1.0], "target": [-0.0, -1e-8, -1.0]},
          "log-cosh-extremes", torch_agrees=False),
]

# Upstream gradient for the edge cases: not ones, mixed sign, nonzero, exactly representable.
EDGE_UPSTREAM = np.array([1.5, -2.0, 0.25])


@pytest.mark.parametrize("case,arrays,value,partials,torch_agrees", EDGE_CASES)
def test_edge_cases(case, arrays, value, partials, torch_agrees):
    """The reference gives the hand-derived values and gradients, NaN and inf included."""
    a = {n: np.array(v) for n, v in arrays.items()}
    np.testing.assert_allclose(_ref_loss(case, a, "none"), value, rtol=RTOL, atol=0)
    got = _ref_grads(case, a, "none", EDGE_UPSTREAM)
    assert set(got) == set(partials)
    for name, d in partials.items():
        np.testing.assert_allclose(got[name], EDGE_UPSTREAM * np.array(d), rtol=RTOL, atol=0,
                                   err_msg=name)


@needs_torch
@pytest.mark.parametrize("case,arrays,value,partials,torch_agrees", EDGE_CASES)
def test_edge_cases_match_torch(case, arrays, value, partials, torch_agrees):
    """Torch agrees with the reference on every edge case it accepts, for every reduction."""
    if not torch_agrees:
        pytest.skip("torch rejects these arguments or overflows; pinned by test_edge_cases")
    a = {n: np.array(v) for n, v in arrays.items()}
    for reduction in _reductions_for(case.name):
        g = EDGE_UPSTREAM if reduction == "none" else np.float64(0.75)
        _assert_matches_torch(case, a, reduction, g)


@needs_torch
def test_torch_rejects_what_the_reference_extends():
    """The torch_agrees=False edge cases are ones torch refuses or overflows on, as documented."""
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(torch.tensor([1.5]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="var has negative entry"):
        F.gaussian_nll_loss(torch.zeros(2), torch.zeros(2), torch.tensor([-1.0, 1.0]))
    x = torch.tensor([-800.0], dtype=torch.float64, requires_grad=True)
    v = F.soft_margin_loss(x, torch.tensor([1.0], dtype=torch.float64), reduction="sum")
    v.backward()
    assert math.isinf(v.item()) and math.isnan(x.grad.item())
    assert ref.loss("soft_margin_loss", np.array([-800.0]), np.array([1.0]), "sum") == 800.0


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_nan_input_propagates_through_every_reduction(case):
    """One NaN in the first array makes every reduced value NaN."""
    shapes = {n: (2, 3) for n in ref.array_names(case.name)}
    a = _smooth_arguments(np.random.default_rng(2), case, shapes)
    first = _required(case)[0]
    a[first][1, 2] = np.nan
    for reduction in ("sum", "mean", "batchmean"):
        assert np.isnan(_ref_loss(case, a, reduction))
    if torch is not None and case.name != "binary_cross_entropy":  # torch's CPU check raises
        for reduction in _reductions_for(case.name):
            g = np.full((2, 3), 0.5) if reduction == "none" else np.float64(-1.25)
            _assert_matches_torch(case, a, reduction, g)


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_empty_reductions(case):
    """Empty inputs: 'mean' and 'batchmean' are NaN (0 / 0), 'sum' is 0, gradients are empty."""
    a = _draw(np.random.default_rng(0), case, {n: (0, 3) for n in ref.array_names(case.name)})
    assert np.isnan(_ref_loss(case, a, "mean"))
    assert np.isnan(_ref_loss(case, a, "batchmean"))
    assert _ref_loss(case, a, "sum") == 0.0
    assert _ref_loss(case, a, "none").shape == (0, 3)
    for reduction in ref.REDUCTIONS:
        for grad in _ref_grads(case, a, reduction, 1.0).values():
            assert grad.shape == (0, 3)
    if torch is not None:
        for reduction in _reductions_for(case.name):
            g = np.zeros((0, 3)) if reduction == "none" else np.float64(0.5)
            _assert_matches_torch(case, a, reduction, g)


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
    case = Case("kl_div")
    a = _smooth_arguments(rng, case, {"input": input_shape, "target": target_shape})
    expected = math.fsum(ref.kl_div(a["input"], a["target"]).ravel()) / divisor
    assert math.isclose(_ref_loss(case, a, "batchmean"), expected, rel_tol=RTOL)
    if torch is not None:
        _assert_matches_torch(case, a, "batchmean", np.float64(rng.normal()))


@needs_torch
def test_known_divergence_kl_target_grad_over_empty_broadcast():
    """Pins one deliberate difference from torch: an empty broadcast leaves a zero target gradient.

    torch computes ``xlogy(t, t)`` on the target's own shape before broadcasting, so with an input
    of shape (0, 3) and a target (3,) containing 0, the target gradient is ``0 * NaN = NaN`` even
    though no element of the loss depends on it. The reference sums an empty set of elementwise
    gradients and gives 0, the true derivative; tests comparing with torch must avoid this case.
    """
    a = {"input": np.zeros((0, 3)), "target": np.array([0.0, 0.5, 1.0])}
    _, torch_grads = _torch_value_and_grads(Case("kl_div"), a, "sum", np.float64(1.0))
    _, g_t = ref.grads("kl_div", a["input"], a["target"], "sum")
    np.testing.assert_array_equal(np.isnan(torch_grads["target"]), [True, False, False])
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


@settings(max_examples=200, deadline=None)
@given(
    # 20,000 elements: past the 1025 edge in two dims while each example stays a few ms.
    drawn=_drawn_case_arguments(LOSS_CASES, max_elements=20_000),
)
def test_mean_is_sum_over_broadcast_count(drawn):
    """'mean' is the sum over the broadcast shape divided by its size (NaN when empty); its
    gradients are the 'sum' gradients over that size; 'batchmean' times input.shape[0] is 'sum'."""
    case, a, _ = drawn
    elementwise = _ref_loss(case, a, "none")
    assert elementwise.shape == _out_shape(a)
    n = elementwise.size
    mean = _ref_loss(case, a, "mean")
    if n == 0:
        assert np.isnan(mean)
        return
    total = math.fsum(elementwise.ravel())
    # The tolerance is relative to the sum of |terms| (a few ulps of each), not to the total.
    scale = math.fsum(np.abs(elementwise).ravel())
    assert math.isclose(mean * n, total, rel_tol=RTOL, abs_tol=RTOL * scale + ATOL)
    assert math.isclose(_ref_loss(case, a, "sum"), total, rel_tol=RTOL,
                        abs_tol=RTOL * scale + ATOL)
    first = a[_required(case)[0]]
    batch = first.shape[0] if first.ndim else 1
    batchmean = _ref_loss(case, a, "batchmean")
    assert math.isclose(batchmean * batch, total, rel_tol=RTOL, abs_tol=RTOL * scale + ATOL)
    sum_grads = _ref_grads(case, a, "sum", 0.5)
    mean_grads = _ref_grads(case, a, "mean", 0.5)
    for name in sum_grads:
        np.testing.assert_allclose(mean_grads[name] * n, sum_grads[name], rtol=RTOL, atol=ATOL)


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


@settings(max_examples=100, deadline=None)
@given(x=strat.special_arrays((257,)), t=strat.special_arrays((257,)),
       beta=st.floats(0.01, 4.0))
def test_smooth_l1_is_huber_over_beta(x, t, beta):
    """smooth_l1(beta) == huber(delta=beta) / beta, value and gradients, NaN and inf included."""
    np.testing.assert_allclose(ref.smooth_l1(x, t, beta), ref.huber(x, t, beta) / beta,
                               rtol=RTOL, atol=0)
    for g_s, g_h in zip(ref.smooth_l1_grads(x, t, beta), ref.huber_grads(x, t, beta)):
        np.testing.assert_allclose(g_s, g_h / beta, rtol=RTOL, atol=0)


@settings(max_examples=100, deadline=None)
@given(x1=strat.finite_arrays((257,)), x2=strat.finite_arrays((257,)),
       t=strat.finite_arrays((257,)), margin=st.floats(-2.0, 2.0))
def test_margin_ranking_is_hinge_of_the_difference(x1, x2, t, margin):
    """margin_ranking(x1, x2, t, m) == hinge(x1 - x2, t, m); its input gradients are +-hinge's."""
    d = x1 - x2
    np.testing.assert_array_equal(ref.margin_ranking(x1, x2, t, margin), ref.hinge(d, t, margin))
    g1, g2, g_t = ref.margin_ranking_grads(x1, x2, t, margin)
    h_d, h_t = ref.hinge_grads(d, t, margin)
    np.testing.assert_array_equal(g1, h_d)
    np.testing.assert_array_equal(g2, -h_d)
    np.testing.assert_array_equal(g_t, h_t)


@settings(max_examples=100, deadline=None)
@given(x=strat.finite_arrays((257,)), t=strat.finite_arrays((257,)), margin=st.floats(-2.0, 2.0))
def test_squared_hinge_is_hinge_squared(x, t, margin):
    """squared_hinge == hinge**2, and its gradients are 2 hinge times hinge's."""
    h = ref.hinge(x, t, margin)
    np.testing.assert_array_equal(ref.squared_hinge(x, t, margin), h * h)
    for g_s, g_h in zip(ref.squared_hinge_grads(x, t, margin), ref.hinge_grads(x, t, margin)):
        np.testing.assert_allclose(g_s, 2 * h * g_h, rtol=RTOL, atol=0)


@settings(max_examples=100, deadline=None)
@given(x=strat.finite_arrays((257,), low=-30.0, high=30.0), t=strat.finite_arrays((257,), low=0.0,
                                                                                  high=1.0))
def test_focal_without_focus_is_bce_with_logits(x, t):
    """sigmoid_focal_loss with alpha < 0 (no weighting) and gamma = 0 is bce_with_logits."""
    np.testing.assert_allclose(ref.sigmoid_focal(x, t, alpha=-1.0, gamma=0.0),
                               ref.binary_cross_entropy_with_logits(x, t), rtol=RTOL, atol=0)
    for g_f, g_b in zip(ref.sigmoid_focal_grads(x, t, alpha=-1.0, gamma=0.0),
                        ref.binary_cross_entropy_with_logits_grads(x, t)):
        np.testing.assert_allclose(g_f, g_b, rtol=RTOL, atol=ATOL)


@settings(max_examples=100, deadline=None)
@given(x=strat.finite_arrays((257,), low=-8.0, high=8.0),
       t=strat.finite_arrays((257,), low=0.0, high=1.0))
def test_bce_with_logits_is_bce_of_the_sigmoid(x, t):
    """bce_with_logits(x, t) == bce(sigmoid(x), t) away from the clamp, and d/dx is d/dp times
    sigmoid'(x) = p (1 - p)."""
    p = 1.0 / (1.0 + np.exp(-x))
    np.testing.assert_allclose(ref.binary_cross_entropy_with_logits(x, t),
                               ref.binary_cross_entropy(p, t), rtol=1e-9, atol=1e-12)
    g_logit, g_t_logit = ref.binary_cross_entropy_with_logits_grads(x, t)
    g_p, g_t_p = ref.binary_cross_entropy_grads(p, t)
    # The probability side loses digits in 1 - p (p up to 1 - 3e-4): 1e-9 is that, not a fit.
    np.testing.assert_allclose(g_logit, g_p * p * (1.0 - p), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(g_t_logit, g_t_p, rtol=1e-9, atol=1e-12)


def _mp_softplus(z):
    return mpmath.log1p(mpmath.exp(z))


def _mp_sigmoid(z):
    return 1 / (1 + mpmath.exp(-z))


@needs_mpmath
@pytest.mark.parametrize("x", [-745.0, -40.0, -30.0, -4.0, 0.0, 4.0, 30.0, 40.0, 745.0])
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_logit_losses_are_accurate_at_large_logits(x, t):
    """bce_with_logits, sigmoid_focal and soft_margin against 50-digit arithmetic: every value
    and gradient within a few ulps, where torch's forms (``(1 - t) x - log_sigmoid(x)``,
    ``1 - p_t``, ``log1p(exp(-x t))``) lose digits or overflow."""
    mpmath.mp.dps = 50
    X, T = mpmath.mpf(x), mpmath.mpf(t)
    xs, ts = np.array([x]), np.array([t])
    p, r = _mp_sigmoid(X), _mp_sigmoid(-X)
    ce = (1 - T) * _mp_softplus(X) + T * _mp_softplus(-X)
    checks = [
        (ref.binary_cross_entropy_with_logits(xs, ts), ce),
        (ref.binary_cross_entropy_with_logits_grads(xs, ts)[0], (1 - T) * p - T * r),
        (ref.soft_margin(xs, ts), _mp_softplus(-X * T)),
        (ref.soft_margin_grads(xs, ts)[0], -T * _mp_sigmoid(-X * T)),
    ]
    q = p * (1 - T) + r * T
    alpha_t = mpmath.mpf("0.25") * T + mpmath.mpf("0.75") * (1 - T)
    checks.append((ref.sigmoid_focal(xs, ts), alpha_t * ce * q ** 2))
    checks.append((ref.sigmoid_focal_grads(xs, ts)[0],
                   alpha_t * (((1 - T) * p - T * r) * q ** 2 + ce * 2 * q * p * r * (1 - 2 * T))))
    for got, want in checks:
        assert math.isclose(float(got[0]), float(want), rel_tol=1e-13, abs_tol=1e-300), (
            got, want)


@needs_mpmath
@pytest.mark.parametrize("d", [0.0, 1e-10, 1e-4, 0.5, 0.999, 1.0, 1.5, 30.0, 800.0, -3.0])
def test_log_cosh_is_accurate_everywhere(d):
    """log_cosh against 50-digit arithmetic across both branches: no cancellation near 0, no
    overflow far out, and the two formulas agree at the switch |d| = 1."""
    mpmath.mp.dps = 50
    want = mpmath.log(mpmath.cosh(mpmath.mpf(d)))
    got = ref.log_cosh(np.array([d]), np.array([0.0]))[0]
    assert math.isclose(got, float(want), rel_tol=4e-16, abs_tol=0.0), (got, want)
    grad = ref.log_cosh_grads(np.array([d]), np.array([0.0]))[0][0]
    assert math.isclose(grad, float(mpmath.tanh(d)), rel_tol=4e-16, abs_tol=0.0)


GAUSSIAN_VAR_SHAPES = [
    pytest.param((4, 3), (4, 3), id="same"),
    pytest.param((4, 3), (4,), id="one-dim-short"),  # torch adds a trailing 1
    pytest.param((4, 3), (4, 1), id="trailing-1"),
    pytest.param((4, 2, 3), (4, 1, 3), id="one-middle-1"),  # torch 2.x: any one mismatched dim
    pytest.param((3,), (), id="0d-var-of-a-vector"),  # () is (3,)[:-1]: a trailing 1 is added
]


@pytest.mark.parametrize("input_shape,var_shape", GAUSSIAN_VAR_SHAPES)
def test_gaussian_var_shapes(input_shape, var_shape):
    """Torch's var shapes: the loss equals that of var repeated to the input's shape, and var's
    gradient is the repeated var's gradient summed back; torch agrees on each."""
    rng = np.random.default_rng(5)
    x, t = rng.normal(size=input_shape), rng.normal(size=input_shape)
    var = rng.uniform(0.2, 2.0, var_shape)
    viewed = ref.gaussian_var_shape(input_shape, var_shape)
    full = np.broadcast_to(var.reshape(viewed), input_shape).copy()
    np.testing.assert_allclose(ref.gaussian_nll(x, t, var), ref.gaussian_nll(x, t, full),
                               rtol=RTOL, atol=0)
    g = rng.normal(size=input_shape)
    *_, g_var = ref.grads("gaussian_nll_loss", x, t, var, "none", g)
    *_, g_full = ref.grads("gaussian_nll_loss", x, t, full, "none", g)
    assert g_var.shape == var_shape
    np.testing.assert_allclose(g_var.reshape(viewed), ref._sum_to(g_full, viewed),
                               rtol=RTOL, atol=ATOL)
    if torch is not None:
        for reduction in ("none", "mean", "sum"):
            up = g if reduction == "none" else np.float64(0.75)
            _assert_matches_torch(Case("gaussian_nll_loss"),
                                  {"input": x, "target": t, "var": var}, reduction, up)


@pytest.mark.parametrize("input_shape,var_shape", [
    ((4, 3), (3,)),       # the last dim, not the first: torch rejects it
    ((4, 3), (2, 3)),     # a mismatched dim of size 2
    ((4, 2, 3), (4, 1, 1)),  # two mismatched dims
    ((4, 3), (1, 4, 3)),  # more dims than the input
])
def test_gaussian_rejects_other_var_shapes(input_shape, var_shape):
    """Var shapes torch rejects raise ValueError('var is of incorrect size'), here and in torch."""
    x = np.zeros(input_shape)
    with pytest.raises(ValueError, match="var is of incorrect size"):
        ref.gaussian_nll(x, x, np.ones(var_shape))
    if torch is not None:
        with pytest.raises(ValueError, match="var is of incorrect size"):
            F.gaussian_nll_loss(torch.zeros(input_shape), torch.zeros(input_shape),
                                torch.ones(var_shape))


def test_gaussian_float_var_is_a_full_array_without_gradient():
    """A Python float var is torch's ``var * ones_like(input)``, and has no gradient."""
    rng = np.random.default_rng(6)
    x, t = rng.normal(size=(3, 4)), rng.normal(size=(4,))
    np.testing.assert_array_equal(ref.gaussian_nll(x, t, 0.5),
                                  ref.gaussian_nll(x, t, np.full((3, 4), 0.5)))
    g_x, g_t, g_v = ref.grads("gaussian_nll_loss", x, t, 0.5, "sum")
    assert g_v is None and g_x.shape == (3, 4) and g_t.shape == (4,)
    if torch is not None:
        want = F.gaussian_nll_loss(torch.tensor(x), torch.tensor(t).expand(3, 4), 0.5,
                                   reduction="sum")
        assert math.isclose(ref.loss("gaussian_nll_loss", x, t, 0.5, "sum"), want.item(),
                            rel_tol=RTOL)


@settings(max_examples=50, deadline=None)
@given(x=strat.finite_arrays((257,), low=-2.0, high=2.0),
       t=strat.finite_arrays((257,), low=0.0, high=4.0), log_input=st.booleans())
def test_poisson_full_adds_stirling_only_above_one(x, t, log_input):
    """full=True adds t log t - t + log(2 pi t) / 2 exactly where t > 1."""
    if not log_input:
        x = np.abs(x) + 0.1
    diff = ref.poisson_nll(x, t, log_input, full=True) - ref.poisson_nll(x, t, log_input)
    stirling = t * np.log(t) - t + 0.5 * np.log(2 * np.pi * t)
    np.testing.assert_array_equal(diff[t <= 1], 0.0)
    np.testing.assert_allclose(diff[t > 1], stirling[t > 1], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name,option,value,message", [
    ("smooth_l1_loss", "beta", -0.5, "smooth_l1_loss does not support negative values for beta."),
    ("huber_loss", "delta", 0.0, "huber_loss does not support non-positive values for delta."),
    ("huber_loss", "delta", -1.0, "huber_loss does not support non-positive values for delta."),
])
def test_option_errors_use_torchs_words(name, option, value, message):
    """Out-of-range options raise ValueError with torch's message (torch: RuntimeError)."""
    x = np.zeros(3)
    with pytest.raises(ValueError, match=message):
        ref.loss(name, x, x, **{option: value})
    if torch is not None:
        fn = {"smooth_l1_loss": F.smooth_l1_loss, "huber_loss": F.huber_loss}[name]
        with pytest.raises(RuntimeError, match=message):
            fn(torch.zeros(3), torch.zeros(3), **{option: value})


def test_focal_loss_defaults_to_no_reduction():
    """sigmoid_focal_loss's default reduction is 'none' (torchvision's); the others' is 'mean'."""
    x, t = np.array([0.5, -1.0]), np.array([1.0, 0.0])
    assert ref.loss("sigmoid_focal_loss", x, t).shape == (2,)
    assert ref.loss("l1_loss", x, t).shape == ()


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_low_precision_inputs_are_upcast_exactly(case):
    """bfloat16 / float16 / float32 arguments give the float64 results of their exact upcasts."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed")
    rng = np.random.default_rng(4)
    a64 = _smooth_arguments(rng, case, _shapes(case, (4, 5), (5,)))
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        a = {n: v.astype(dtype) for n, v in a64.items()}
        up = {n: v.astype(np.float64) for n, v in a.items()}
        value = _ref_loss(case, a, "none")
        assert value.dtype == np.float64
        np.testing.assert_array_equal(value, _ref_loss(case, up, "none"))
        for name, grad in _ref_grads(case, a, "sum", 1.0).items():
            assert grad.dtype == np.float64
            np.testing.assert_array_equal(grad, _ref_grads(case, up, "sum", 1.0)[name])


def test_rejects_unknown_names_and_bad_upstream_shapes():
    """Unknown losses and reductions, and a grad_output of the wrong shape, raise ValueError."""
    x = t = np.ones((2, 3))
    with pytest.raises(ValueError, match="unknown loss 'l3_loss'"):
        ref.loss("l3_loss", x, t)
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        ref.loss("mse_loss", x, t, "avg")
    with pytest.raises(ValueError, match=r"shape \(3,\) for reduction 'none'"):
        ref.grads("mse_loss", x, t, "none", grad_output=np.ones(3))
    with pytest.raises(ValueError, match=r"shape \(2, 3\) for reduction 'sum'"):
        ref.grads("mse_loss", x, t, "sum", grad_output=np.ones((2, 3)))
    with pytest.raises(TypeError, match="margin_ranking_loss takes the arrays"):
        ref.loss("margin_ranking_loss", x, t)


def test_registry_names_every_case():
    """Every registered loss has a case here, and every case names its loss's arrays."""
    assert {case.name for case in LOSS_CASES} == set(ref.LOSS_NAMES)
    for case in LOSS_CASES:
        assert set(case.extras) <= set(ref.array_names(case.name))


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


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("name", ref.LOSS_NAMES)
def test_broadcast_bench_torch_forms_match_references(name):
    """bench_broadcast times torch.compile on its own torch form of each loss (torch.nn.functional
    where torch has the loss, the formula otherwise): on float64 CPU tensors, with the first
    array broadcast as in the benchmark, each gives the reference's mean loss and gradients, so
    the benchmark compares like with like (gaussian_nll_loss: its var broadcast, (6, 1))."""
    from cupyloss.bench import broadcast as bench_broadcast

    rng = np.random.default_rng(5)
    full = (rng.normal(size=(6, 7)), rng.normal(size=(6, 7)), rng.uniform(0.01, 0.99, (6, 7)))
    small = (rng.normal(size=(6, 1)), rng.uniform(0.01, 0.99, (6, 1)))
    uniform = {"kl_div": (0, 2), "binary_cross_entropy": (2, 2),
               "binary_cross_entropy_with_logits": (0, 2), "margin_ranking_loss": (0, 1, 2),
               "poisson_nll_loss": (0, 2), "sigmoid_focal_loss": (0, 2),
               "gaussian_nll_loss": (0, 1, 2)}
    picks = uniform.get(name, (0, 1))   # bench._family_calls' arrays: x, y, u
    arrays = [full[k] for k in picks]
    if name == "gaussian_nll_loss":
        arrays[2] = small[1]
    else:
        arrays[0] = small[1] if picks[0] == 2 else small[0]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        value = bench_broadcast._torch_forms()[name](*ts)
    got = torch.autograd.grad(value, ts, allow_unused=True)
    assert np.isfinite(value.item())
    np.testing.assert_allclose(value.item(), ref.loss(name, *arrays, "mean"), rtol=1e-12)
    for g, want in zip(got, ref.grads(name, *arrays, "mean", 1.0)):
        g = np.zeros_like(want) if g is None else g.numpy()
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-14)
