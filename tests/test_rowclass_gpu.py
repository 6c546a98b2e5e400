"""GPU tests of the streaming row-wise losses (multi_margin_loss, multilabel_soft_margin_loss, jsd)
against the float64 references in tests/reference_rowwise.py.

Row lengths are chosen at the kernel's edges: 1 (one class), 7 (head and tail scalars only, no
vector), the team sizes of the launch table (8..256 threads, 8 16-byte vectors each: rows of
64..2048 vectors, 256..16384 elements), one past them, and an LLM vocabulary (128256).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference_rowwise as ref
from gpu_util import (
    assert_close, BFLOAT16, cupy_module as _cupy, cupyloss_module as _cl, DTYPES, TINY,
    to_device, to_host)

pytestmark = pytest.mark.gpu

COLS = (1, 2, 7, 31, 33, 255, 256, 257, 1000, 1025, 2049, 4096, 8193, 16385)
ROWS = (0, 1, 2, 3, 31, 33, 64, 129)
LOSSES = ("multi_margin_loss", "multilabel_soft_margin_loss", "jsd")


def _layout(dev, kind):
    """The same values contiguous, with rows off 16-byte boundaries, as a row-strided slice of a
    wider array, or transposed (class axis not contiguous: the engine copies it)."""
    cp = _cupy()
    if dev.ndim == 0:
        return dev
    if kind == "offset":
        big = cp.zeros(dev.shape[:-1] + (dev.shape[-1] + 1,), dev.dtype)
        big[..., 1:] = dev
        return big[..., 1:]
    if kind == "wide":
        big = cp.zeros(dev.shape[:-1] + (dev.shape[-1] + 16,), dev.dtype)
        big[..., :dev.shape[-1]] = dev
        return big[..., :dev.shape[-1]]
    if kind == "transposed" and dev.ndim == 2:
        return cp.ascontiguousarray(dev.T).T
    return dev


def _log_probs(rng, shape, spread=3.0):
    """Log-softmax rows of random logits (some far below float32's exp range with spread 40)."""
    z = rng.standard_normal(shape) * spread
    top = np.max(z, axis=-1, keepdims=True) if shape[-1] else 0
    return z - top - np.log(np.sum(np.exp(z - top), axis=-1, keepdims=True))


def _jsd_scale(x, y, beta, counted):
    """Per row, sum beta P (|y| + |log M|) + (1 - beta) Q (|x| + |log M|): the sizes of what each
    element's term is formed from.  The two parts cancel when P is near Q, and each is a small
    difference (y - log M) of log-probabilities rounded at their own size (a float32 row of two
    classes near 1/2 each is off by an ulp of log 2, 6e-8, in a loss of 1e-3)."""
    with np.errstate(all="ignore"):
        q, p = np.exp(x), np.exp(y)
        if beta == 0:
            parts = p * (np.abs(y) + np.abs(x))
        elif beta == 1:
            parts = q * (np.abs(x) + np.abs(y))
        else:
            lm = np.abs(np.log(beta * p + (1 - beta) * q))
            parts = beta * p * (np.abs(y) + lm) + (1 - beta) * q * (np.abs(x) + lm)
    return np.where(counted, np.sum(parts, axis=-1), 0.0)


def _reference(name, xr, tr, opts, reduction, go):
    """(value, per-row loss, per-row term scale, input gradient, target gradient or None)."""
    if name == "multi_margin_loss":
        value = ref.multi_margin_loss(xr, tr, reduction=reduction, **opts)
        rows = ref.multi_margin_loss(xr, tr, reduction="none", **opts)
        gx = ref.multi_margin_loss_grads(xr, tr, reduction=reduction, grad_output=go, **opts)
        return value, rows, np.abs(rows), gx, None
    if name == "multilabel_soft_margin_loss":
        value = ref.multilabel_soft_margin_loss(xr, tr, reduction=reduction, **opts)
        rows = ref.multilabel_soft_margin_loss(xr, tr, reduction="none", **opts)
        gx, gt = ref.multilabel_soft_margin_loss_grads(xr, tr, reduction=reduction,
                                                       grad_output=go, **opts)
        return value, rows, np.abs(rows), gx, gt
    value = ref.jsd(xr, tr, reduction=reduction, **opts)
    rows = ref.jsd(xr, tr, reduction="none", **opts)
    gx, gt = ref.jsd_grads(xr, tr, reduction=reduction, grad_output=go, **opts)
    x2 = xr.reshape(-1, xr.shape[-1])
    labels = opts.get("shift_labels")
    counted = (np.ones(len(x2), bool) if labels is None
               else np.ravel(labels) != opts.get("ignore_index", -100))
    scale = _jsd_scale(x2, tr.reshape(x2.shape), opts.get("beta", 0.5), counted)
    return value, rows, scale.reshape(rows.shape), gx, gt


def _value_scale(row_scale, reduction, divisor):
    total = np.nansum(row_scale)
    if reduction == "mean" and divisor:
        return total / divisor
    return total


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(LOSSES))
    dtype = draw(st.sampled_from(DTYPES))
    cols = draw(st.sampled_from(COLS))
    kinds = ["2d", "2d", "1d"] + (["0d"] if name == "multi_margin_loss" else ["nd"])
    kind = draw(st.sampled_from(kinds))
    if kind == "0d":
        shape = ()
    elif kind == "1d":
        shape = (cols,)
    elif kind == "nd":
        shape = (draw(st.integers(1, 3)), draw(st.integers(0, 4)), min(cols, 300))
    else:
        rows = draw(st.sampled_from(ROWS))
        shape = (min(rows, max(1, 1_000_000 // cols)), cols)
    opts = {}
    if name == "multi_margin_loss":
        opts["p"] = draw(st.sampled_from([1, 2]))
        opts["margin"] = draw(st.sampled_from([1.0, 0.5, 2.0]))   # exact in every dtype
    elif name == "jsd":
        opts["beta"] = draw(st.sampled_from([0.0, 0.5, 1.0, 0.25]))
    return dict(name=name, dtype=dtype, shape=shape, opts=opts,
                weighted=draw(st.booleans()) and name != "jsd",
                weight_kind=draw(st.sampled_from(["classes", "full", "column"])),
                labels=name == "jsd" and draw(st.booleans()),
                reduction=draw(st.sampled_from(["none", "mean", "sum"])),
                layout=draw(st.sampled_from(["contiguous", "contiguous", "offset", "wide",
                                             "transposed"])),
                go_kind=draw(st.sampled_from(["host", "device"])),
                index64=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


def _operands(case, rng):
    """Device operands and their rounded host values for a drawn case."""
    cp = _cupy()
    name, dtype, shape = case["name"], case["dtype"], case["shape"]
    cols = shape[-1] if shape else 1
    batch = shape[:-1]
    opts = dict(case["opts"])
    if name == "jsd":
        x, xr = to_device(_log_probs(rng, shape, rng.choice([1.0, 3.0, 40.0])), dtype)
        t, tr = to_device(_log_probs(rng, shape), dtype)
        t = _layout(t, case["layout"])
    elif name == "multilabel_soft_margin_loss":
        x, xr = to_device(rng.standard_normal(shape) * 4, dtype)
        soft = rng.random(shape)
        t, tr = to_device(np.where(rng.random(shape) < 0.5, np.round(soft), soft), dtype)
        t = _layout(t, case["layout"])
    else:
        x, xr = to_device(rng.standard_normal(shape) * 2, dtype)
        tr = rng.integers(0, cols, batch if shape else ())
        tr = np.asarray(tr).astype(np.int64 if case["index64"] else np.int32)
        t = cp.asarray(tr)
    x = _layout(x, case["layout"])
    w = None
    if case["weighted"]:
        if name == "multi_margin_loss" or case["weight_kind"] == "classes":
            w, wr = to_device(rng.uniform(0.2, 2.0, cols), dtype)
        elif case["weight_kind"] == "full":
            w, wr = to_device(rng.uniform(0.2, 2.0, shape), dtype)
            w = _layout(w, "wide")
        else:  # one weight per row, broadcast along the classes
            w, wr = to_device(rng.uniform(0.2, 2.0, batch + (1,)), dtype)
        opts["weight"] = wr
    if case["labels"]:
        lab = np.where(rng.random(batch) < 0.3, -100, rng.integers(0, max(cols, 1), batch))
        lab = np.asarray(lab).astype(np.int64 if case["index64"] else np.int32)
        opts["shift_labels"] = lab
        labels = cp.asarray(lab)
    else:
        labels = None
    return x, xr, t, tr, w, labels, opts


def _call_kw(name, w, labels, opts):
    kw = {k: v for k, v in opts.items() if k not in ("weight", "shift_labels")}
    if name == "jsd":
        kw["shift_labels"] = labels
    else:
        kw["weight"] = w
    return kw


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_cases())
def test_against_reference(case):
    """value, backward and value_and_grad of every loss, dtype, option and layout against the
    float64 reference; the one-pass results equal value + backward bit for bit."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(case["seed"])
    name, dtype, reduction = case["name"], case["dtype"], case["reduction"]
    x, xr, t, tr, w, labels, opts = _operands(case, rng)
    kw = _call_kw(name, w, labels, opts)
    ref_opts = {k: v for k, v in opts.items()}
    loss_shape = np.shape(tr) if name == "multi_margin_loss" else xr.shape[:-1]
    if reduction == "none" and loss_shape != ():
        go, gor = to_device(rng.standard_normal(loss_shape), dtype)
    elif case["go_kind"] == "device":
        go, gor = to_device(np.float64(0.75), dtype)
    else:
        go, gor = 0.75, 0.75
    want, per_row, row_scale, gx_want, gt_want = _reference(name, xr, tr, ref_opts, reduction,
                                                            gor)
    if name == "jsd" and "shift_labels" in opts:
        divisor = np.sum(np.ravel(opts["shift_labels"]) != -100)
    else:
        divisor = max(int(np.prod(loss_shape)), 0)
    label = f"{name} {case}"
    fn = getattr(cl, name)
    got = fn(x, t, reduction=reduction, **kw)
    assert got.dtype == dtype and got.shape == np.shape(want), label
    scale = row_scale if reduction == "none" else _value_scale(row_scale, reduction, divisor)
    assert_close(to_host(got), want, dtype, scale, "value " + label)
    wrt = "input" if name == "multi_margin_loss" else ("input", "target")
    grads = getattr(cl, name + "_backward")(go, x, t, reduction=reduction, wrt=wrt, **kw)
    value, grads2 = getattr(cl, name + "_value_and_grad")(x, t, reduction=reduction,
                                                         grad_output=go, wrt=wrt, **kw)
    assert cp.array_equal(value, got, equal_nan=True), "value_and_grad value " + label
    gx_scale = None
    if name == "multilabel_soft_margin_loss":
        # d/dx = g w (sigmoid(x) - y) / C cancels where sigmoid(x) ~ y: it rounds relative to
        # g w (sigmoid(x) + |y|) / C, which is the same formula's gradient at the target -|y|.
        gx_scale = np.abs(ref.multilabel_soft_margin_loss_grads(
            xr, -np.abs(tr), reduction=reduction, grad_output=gor, **ref_opts)[0])
    for what, g in (("backward", grads), ("value_and_grad", grads2)):
        gx = g if isinstance(wrt, str) else g[0]
        assert gx.shape == xr.shape and gx.dtype == dtype and gx.flags.c_contiguous
        assert_close(to_host(gx), gx_want, dtype, gx_scale, f"{what} input gradient {label}")
        if not isinstance(wrt, str):
            assert_close(to_host(g[1]), gt_want, dtype, None, f"{what} target gradient {label}")
    for a, b in zip(grads if isinstance(grads, tuple) else (grads,),
                    grads2 if isinstance(grads2, tuple) else (grads2,)):
        assert cp.array_equal(a, b, equal_nan=True), "backward == value_and_grad " + label


def _long_rows(name, dtype, rows, cols, rng):
    """Device operands of rows x cols built on the device (no host copy of the whole array)."""
    cp = _cupy()
    gen = cp.random.default_rng(int(rng.integers(2**31)))
    x = gen.standard_normal((rows, cols), dtype=cp.float32) * 2
    t = gen.random((rows, cols), dtype=cp.float32)
    if name == "jsd":
        x = x - cp.log(cp.sum(cp.exp(x), axis=-1, keepdims=True))
        t = t * 4 - cp.log(cp.sum(cp.exp(t * 4), axis=-1, keepdims=True))
    elif name == "multi_margin_loss":
        t = gen.integers(0, cols, rows)
    return x.astype(dtype), t if name == "multi_margin_loss" else t.astype(dtype)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype, rows", [(BFLOAT16, 3), (np.float32, 5), (BFLOAT16, 2500)])
def test_llm_vocabulary_rows_and_determinism(name, dtype, rows):
    """Rows of 128256 classes: a whole block streams each of a few rows, a warp each of 2500
    (past a quarter of the resident warps); rows checked against the reference, repeated calls
    give the same bits."""
    cp = _cupy()
    cl = _cl()
    cols = 128256
    x, t = _long_rows(name, dtype, rows, cols, np.random.default_rng(rows))
    kw = {"p": 2} if name == "multi_margin_loss" else {"beta": 0.3} if name == "jsd" else {}
    wrt = "input" if name == "multi_margin_loss" else ("input", "target")
    loss, g = getattr(cl, name + "_value_and_grad")(x, t, reduction="none", wrt=wrt, **kw)
    gx = g if isinstance(wrt, str) else g[0]
    for r in sorted({0, rows // 2, rows - 1}):
        xr = to_host(x[r:r + 1])
        tr = cp.asnumpy(t[r:r + 1]) if name == "multi_margin_loss" else to_host(t[r:r + 1])
        want, _, row_scale, gx_want, gt_want = _reference(name, xr, tr, kw, "none",
                                                          np.ones(1))
        assert_close(to_host(loss[r:r + 1]), want, dtype, row_scale, f"{name} row {r} loss")
        assert_close(to_host(gx[r:r + 1]), gx_want, dtype, None, f"{name} row {r} gradient")
        if gt_want is not None:
            assert_close(to_host(g[1][r:r + 1]), gt_want, dtype, None,
                         f"{name} row {r} target gradient")
    value, g1 = getattr(cl, name + "_value_and_grad")(x, t, wrt=wrt, **kw)
    value2, g2 = getattr(cl, name + "_value_and_grad")(x, t, wrt=wrt, **kw)
    assert cp.array_equal(value, value2)
    for a, b in zip(g1 if isinstance(g1, tuple) else (g1,), g2 if isinstance(g2, tuple)
                    else (g2,)):
        assert cp.array_equal(a, b)
    total = np.sum(to_host(loss))
    assert_close(to_host(value), total / rows, dtype,
                 np.sum(np.abs(to_host(loss))) / rows, f"{name} mean of the rows")


@pytest.mark.parametrize("name", LOSSES)
def test_empty_and_single_class(name):
    """N = 0 ('mean' is NaN, as torch's mean of nothing, except jsd: Liger's 0), C = 1."""
    cp = _cupy()
    cl = _cl()
    cols = 5
    x = cp.zeros((0, cols), cp.float32)
    t = cp.zeros(0, cp.int64) if name == "multi_margin_loss" else cp.zeros((0, cols), cp.float32)
    fn = getattr(cl, name)
    assert fn(x, t, reduction="none").shape == (0,)
    assert to_host(fn(x, t, reduction="sum")) == 0
    mean = to_host(fn(x, t))
    assert (mean == 0) if name == "jsd" else np.isnan(mean)
    value, g = getattr(cl, name + "_value_and_grad")(x, t, reduction="sum")
    assert g.shape == (0, cols) and to_host(value) == 0
    # One class: multi_margin's loss is 0 (no c != y), the others are elementwise.
    rng = np.random.default_rng(3)
    x1, xr1 = to_device(rng.standard_normal((4, 1)), np.float32)
    if name == "multi_margin_loss":
        t1, tr1 = cp.zeros(4, cp.int64), np.zeros(4, np.int64)
    elif name == "jsd":
        x1, xr1 = cp.zeros((4, 1), cp.float32), np.zeros((4, 1))   # log 1: the only class
        t1, tr1 = x1.copy(), xr1
    else:
        t1, tr1 = to_device(rng.random((4, 1)), np.float32)
    want = getattr(ref, name)(xr1, tr1, reduction="none")
    assert_close(to_host(fn(x1, t1, reduction="none")), want, np.float32)


def test_multi_margin_shapes_follow_torch():
    """(C,) with a 0-d or (1,) target, a 0-d input, and the target's shape for 'none'."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(4)
    x, xr = to_device(rng.standard_normal(6), np.float32)
    for tr in (np.int64(2), np.array([2])):
        got = cl.multi_margin_loss(x, cp.asarray(tr), reduction="none")
        assert got.shape == np.shape(tr)
        assert_close(to_host(got), ref.multi_margin_loss(xr, tr, reduction="none"), np.float32)
        g = cl.multi_margin_loss_backward(1.0, x, cp.asarray(tr))
        assert_close(to_host(g), ref.multi_margin_loss_grads(xr, tr), np.float32)
    s = cp.asarray(np.float32(1.5))
    assert to_host(cl.multi_margin_loss(s, cp.asarray(0))) == 0
    assert to_host(cl.multi_margin_loss_backward(1.0, s, cp.asarray(0))) == 0


@pytest.mark.parametrize("check", [False, True])
def test_multi_margin_out_of_range_targets(check):
    cp = _cupy()
    cl = _cl()
    x = cp.asarray(np.random.default_rng(2).standard_normal((4, 6)), cp.float32)
    t = cp.asarray([0, 9, -100, 5])
    if check:
        with pytest.raises(IndexError, match="target out of range"):
            cl.multi_margin_loss(x, t, check_targets=True)
        cl.multi_margin_loss(x, cp.asarray([0, 5, 3, 1]), check_targets=True)  # in range
        return
    loss = to_host(cl.multi_margin_loss(x, t, reduction="none"))
    assert np.all(np.isnan(loss[[1, 2]])) and np.all(np.isfinite(loss[[0, 3]]))
    _, g = cl.multi_margin_loss_value_and_grad(x, t, reduction="sum")
    g = to_host(g)
    assert np.all(np.isnan(g[[1, 2]])) and np.all(np.isfinite(g[[0, 3]]))
    assert np.isnan(to_host(cl.multi_margin_loss(x, t)))
    want = ref.multi_margin_loss_grads(to_host(x), cp.asnumpy(t), reduction="sum")
    assert_close(g, want, np.float32)


def test_jsd_ignored_rows_and_labels():
    """Ignored rows: loss 0, gradient 0 (also where input holds NaN); all ignored: 'mean' is 0."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(5)
    x, xr = to_device(_log_probs(rng, (6, 50)), np.float32)
    t, tr = to_device(_log_probs(rng, (6, 50)), np.float32)
    x[2, 3] = cp.nan
    lab = np.array([1, 7, -100, 3, -100, 0])
    for dtype in (np.int32, np.int64):
        labels = cp.asarray(lab.astype(dtype))
        loss = to_host(cl.jsd(x, t, shift_labels=labels, reduction="none"))
        assert loss[2] == 0 and loss[4] == 0 and np.all(loss[[0, 1, 3, 5]] > 0)
        value, (gx, gt) = cl.jsd_value_and_grad(x, t, shift_labels=labels, wrt=("input",
                                                                                "target"))
        assert not cp.any(gx[[2, 4]]) and not cp.any(gt[[2, 4]])
        xr2 = to_host(x)
        want = ref.jsd(xr2, tr, shift_labels=lab)
        assert_close(to_host(value), want, np.float32)
    labels = cp.full(6, -7)
    value, g = cl.jsd_value_and_grad(x, t, shift_labels=labels, ignore_index=-7)
    assert to_host(value) == 0 and not cp.any(g)


def test_jsd_far_below_exp_range_is_finite():
    """float32 log-probabilities near -120: Q and P underflow, no NaN (a naive log M is -inf)."""
    cp = _cupy()
    cl = _cl()
    x = cp.full((2, 64), -120.0, cp.float32)
    x[:, 0] = 0.0
    t = cp.full((2, 64), -110.0, cp.float32)
    t[:, 1] = 0.0
    for beta in (0.0, 0.3, 1.0):
        value, (gx, gt) = cl.jsd_value_and_grad(x, t, beta=beta, wrt=("input", "target"))
        assert cp.isfinite(value) and cp.all(cp.isfinite(gx)) and cp.all(cp.isfinite(gt))
        assert_close(to_host(value), ref.jsd(to_host(x), to_host(t), beta=beta), np.float32)


def test_argument_errors():
    cp = _cupy()
    cl = _cl()
    x = cp.zeros((4, 5), cp.float32)
    y = cp.zeros(4, cp.int64)
    with pytest.raises(ValueError, match="only p == 1 and p == 2 supported"):
        cl.multi_margin_loss(x, y, p=3)
    with pytest.raises(ValueError, match="weight must be one-dimensional"):
        cl.multi_margin_loss(x, y, weight=cp.ones((1, 5), cp.float32))
    with pytest.raises(ValueError, match="inconsistent weight size, expected 5 but got \\[4\\]"):
        cl.multi_margin_loss(x, y, weight=cp.ones(4, cp.float32))
    with pytest.raises(ValueError, match="Expected target size \\[4\\], but got \\[3\\]"):
        cl.multi_margin_loss(x, y[:3])
    with pytest.raises(ValueError, match="Expected non-empty vector or matrix"):
        cl.multi_margin_loss(cp.zeros((4, 0), cp.float32), y)
    with pytest.raises(TypeError, match="class indices"):
        cl.multi_margin_loss(x, x)
    with pytest.raises(TypeError, match="weight has dtype float64"):
        cl.multi_margin_loss(x, y, weight=cp.ones(5, cp.float64))
    with pytest.raises(ValueError, match="has no gradient"):
        cl.multi_margin_loss_backward(1.0, x, y, wrt="target")
    with pytest.raises(ValueError, match="target of the input's shape"):
        cl.multilabel_soft_margin_loss(x, x[:, :4])
    with pytest.raises(TypeError, match="target has dtype float64"):
        cl.multilabel_soft_margin_loss(x, x.astype(cp.float64))
    with pytest.raises(ValueError, match="must broadcast to the input's shape"):
        cl.multilabel_soft_margin_loss(x, x, weight=cp.ones((2, 4, 5), cp.float32))
    with pytest.raises(ValueError, match="0-d input"):
        cl.multilabel_soft_margin_loss(x[0, 0], x[0, 0])
    with pytest.raises(ValueError, match="beta must be in \\[0, 1\\]"):
        cl.jsd(x, x, beta=1.5)
    with pytest.raises(ValueError, match="the shape of shift_labels must be \\(4,\\)"):
        cl.jsd(x, x, shift_labels=y[:2])
    with pytest.raises(TypeError, match="shift_labels must hold class indices"):
        cl.jsd(x, x, shift_labels=x[:, 0])
    with pytest.raises(ValueError, match="is not a valid value for reduction"):
        cl.jsd(x, x, reduction="batchmean")


def test_inputs_are_never_written():
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(8)
    x, _ = to_device(rng.standard_normal((33, 1000)), np.float16)
    t, _ = to_device(rng.random((33, 1000)), np.float16)
    before = (x.copy(), t.copy())
    cl.multilabel_soft_margin_loss_value_and_grad(x, t, wrt=("input", "target"))
    cl.jsd_value_and_grad(x, t, wrt=("input", "target"))
    cl.multi_margin_loss_value_and_grad(x, cp.zeros(33, cp.int32))
    assert cp.array_equal(x, before[0]) and cp.array_equal(t, before[1])


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors_match_torch(dtype):
    """torch CUDA tensors in and out on torch's stream; values and gradients agree with torch's
    own losses (and jsd with its composition from kl_div) on the same GPU, torch at float32."""
    torch = _torch()
    import torch.nn.functional as F

    cl = _cl()
    cp = _cupy()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tdtype = getattr(torch, dtype)
    rtol = {"float32": 1e-5, "bfloat16": 8e-3}[dtype]
    tiny = TINY[np.dtype(dtype) if dtype != "bfloat16" else BFLOAT16]
    x = (torch.randn(64, 1000, device="cuda", generator=gen) * 2).to(tdtype)
    y = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
    w = (torch.rand(1000, device="cuda", generator=gen) + 0.5).to(tdtype)
    t = torch.rand(64, 1000, device="cuda", generator=gen).to(tdtype)

    def check(ours, theirs, leaves, grads):
        torch.testing.assert_close(ours[0].float(), theirs.detach(), rtol=rtol, atol=rtol)
        want = torch.autograd.grad(theirs, leaves)
        for got, exp in zip(grads, want):
            assert isinstance(got, torch.Tensor) and got.dtype == tdtype
            torch.testing.assert_close(got.float(), exp, rtol=rtol,
                                       atol=rtol * exp.abs().mean() + tiny)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())   # the inputs were made on that one
    with torch.cuda.stream(stream):
        mm = cl.multi_margin_loss_value_and_grad(x, y, p=2, margin=0.5, weight=w)
        ml = cl.multilabel_soft_margin_loss_value_and_grad(x, t, w, wrt=("input", "target"))
    stream.synchronize()
    xf = x.float().requires_grad_()
    tf = t.float().requires_grad_()
    check(mm, F.multi_margin_loss(xf, y, p=2, margin=0.5, weight=w.float()), (xf,), (mm[1],))
    check(ml, F.multilabel_soft_margin_loss(xf, tf, w.float()), (xf, tf), ml[1])
    lq = torch.log_softmax(x.float(), -1).to(tdtype)
    lp = torch.log_softmax(t.float() * 5, -1).to(tdtype)
    labels = torch.where(torch.rand(64, device="cuda", generator=gen) < 0.3, -100, y)
    js = cl.jsd_value_and_grad(lq, lp, beta=0.3, shift_labels=labels)
    a = lq.float().requires_grad_()
    b = lp.float()
    m = torch.log(0.3 * b.exp() + 0.7 * a.exp())
    terms = 0.3 * F.kl_div(m, b, reduction="none", log_target=True) + 0.7 * F.kl_div(
        m, a, reduction="none", log_target=True)
    counted = labels != -100
    check(js, terms[counted].sum() / counted.sum(), (a,), (js[1],))
    # The same bits as CuPy arrays give.
    cv, cg = cl.jsd_value_and_grad(cp.from_dlpack(lq.detach()), cp.from_dlpack(lp.detach()),
                                   beta=0.3,
                                   shift_labels=cp.from_dlpack(labels))
    assert cp.array_equal(cp.from_dlpack(js[0]), cv) and cp.array_equal(cp.from_dlpack(js[1]),
                                                                         cg)


def test_torch_adapter_modules():
    """The generated modules train through autograd: MultiMarginLoss, MultiLabelSoftMarginLoss,
    JSDLoss (torch has no JSD; Liger calls its module LigerJSD)."""
    torch = _torch()
    import cupyloss.torch as CF

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 40, device="cuda", generator=gen, requires_grad=True)
    y = torch.randint(0, 40, (16,), device="cuda", generator=gen)
    t = torch.rand(16, 40, device="cuda", generator=gen)
    for loss in (CF.MultiMarginLoss(margin=0.5)(x, y), CF.MultiLabelSoftMarginLoss()(x, t),
                 CF.JSDLoss(beta=0.2)(torch.log_softmax(x, -1), torch.log_softmax(t, -1))):
        x.grad = None
        loss.backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """rows x classes > 2^31 (float16, 4.3 GB an operand): the last rows, past every 32-bit
    offset, are right."""
    cp = _cupy()
    cl = _cl()
    rows, cols = 16400, 131072 + 7
    assert rows * cols > 2**31
    gen = cp.random.default_rng(0)
    x = gen.standard_normal((rows, cols), dtype=cp.float32).astype(cp.float16)
    t = gen.random((rows, cols), dtype=cp.float32).astype(cp.float16)
    value, g = cl.multilabel_soft_margin_loss_value_and_grad(x, t, reduction="none")
    for r in (0, rows // 2, rows - 2, rows - 1):
        xr, tr = to_host(x[r:r + 1]), to_host(t[r:r + 1])
        assert_close(to_host(value[r:r + 1]), ref.multilabel_soft_margin_loss(
            xr, tr, reduction="none"), np.float16, None, f"loss row {r}")
        gx, _ = ref.multilabel_soft_margin_loss_grads(xr, tr, reduction="none",
                                                      grad_output=np.ones(1))
        assert_close(to_host(g[r:r + 1]), gx, np.float16, None, f"gradient row {r}")
    del g
    lq = x  # any values: the jsd of the last rows against the reference
    value, g = cl.jsd_value_and_grad(lq * 0.01 - 12, t * 0.01 - 12, reduction="none")
    r = rows - 1
    xr, tr = to_host((lq * 0.01 - 12)[r:r + 1]), to_host((t * 0.01 - 12)[r:r + 1])
    assert_close(to_host(g[r:r + 1]), ref.jsd_grads(xr, tr, reduction="none",
                                                    grad_output=np.ones(1))[0],
                 np.float16, None, "jsd gradient of the last row")
    del g
    cp.get_default_memory_pool().free_all_blocks()
