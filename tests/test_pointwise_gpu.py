"""GPU tests of the pointwise losses against the float64 references in tests/reference.py."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
import strategies
from gpu_util import DTYPES, TINY, assert_close, to_device, to_host

pytestmark = pytest.mark.gpu

LOSSES = ("mse_loss", "kl_div", "hinge_loss")
REDUCTIONS = {"mse_loss": ("none", "mean", "sum"), "hinge_loss": ("none", "mean", "sum"),
              "kl_div": ("none", "mean", "sum", "batchmean")}


def _cl():
    import cupyloss

    return cupyloss


def _call(name, kind, *args, **kw):
    fn = getattr(_cl(), name + {"value": "", "backward": "_backward", "vag": "_value_and_grad"}[kind])
    return fn(*args, **kw)


def _operands(name, rng, x_shape, t_shape, opts, special=False):
    """float64 host values suited to the loss (log-probabilities for kl_div, etc.)."""
    if name == "kl_div":
        if opts.get("log_input", True):
            x = np.log(rng.uniform(0.05, 1.0, x_shape))
        else:
            x = rng.uniform(0.05, 1.0, x_shape)
        t = rng.uniform(0.0, 1.0, t_shape)
        if opts.get("log_target"):
            t = np.log(t + 0.05)
        else:  # exact zeros: value 0, target gradient NaN (torch's xlogy backward)
            t = np.where(rng.random(t_shape) < 0.05, 0.0, t)
    else:
        x = rng.standard_normal(x_shape) * 2
        t = rng.standard_normal(t_shape) * 2
        if name == "hinge_loss":
            t = np.sign(t) + (t == 0)
    if special:
        x = np.where(rng.random(x_shape) < 0.02, np.nan, x)
    return np.asarray(x, dtype=np.float64), np.asarray(t, dtype=np.float64)


def _options(name, draw_bool):
    if name == "kl_div":
        return {"log_target": draw_bool(), "log_input": draw_bool()}
    if name == "hinge_loss":
        return {"margin": 1.0}
    return {}


def _view(draw, dev, rng):
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


def _magnitude(name, x, t, opts):
    """Elementwise size of the terms a loss element is formed from, in the broadcast shape.

    hinge's element is margin - x t, which cancels near the margin; kl_div's element is a difference of two terms (t log t and t x) that cancel where the
    target is close to the input; its rounding error scales with the terms, not with the
    small difference, whichever way the difference is evaluated.
    """
    x, t = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(t, np.float64))
    if name == "hinge_loss":  # margin - x t cancels near the margin
        return np.where(opts["margin"] - x * t > 0, abs(opts["margin"]) + np.abs(x * t), 0.0)
    if name != "kl_div":
        return np.abs(reference.loss(name, x, t, "none", **opts))
    with np.errstate(all="ignore"):
        lx = x if opts.get("log_input", True) else np.log(x)
        if opts.get("log_target"):
            return np.abs(np.exp(t) * t) + np.abs(np.exp(t) * lx)
        return np.abs(np.where(t == 0, 0.0, t * np.log(t))) + np.abs(t * lx)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pair=strategies.broadcast_pairs(max_elements=100_000),
       seed=strategies.seeds())
def test_value_and_grads_match_reference(data, pair, seed):
    """Every loss x reduction x dtype x broadcast x layout: value, backward and value_and_grad."""
    import cupy

    draw = data.draw
    name = draw(st.sampled_from(LOSSES), label="loss")
    reduction = draw(st.sampled_from(REDUCTIONS[name]), label="reduction")
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    opts = _options(name, lambda: draw(st.booleans()))
    x_shape, t_shape = pair
    rng = np.random.default_rng(seed)
    x64, t64 = _operands(name, rng, x_shape, t_shape, opts)
    x, xr = to_device(x64, dtype)
    t, tr = to_device(t64, dtype)
    x, t = _view(draw, x, rng), _view(draw, t, rng)

    ref_v = reference.loss(name, xr, tr, reduction, **opts)
    out_shape = np.broadcast_shapes(x_shape, t_shape)
    n = math.prod(out_shape)
    if reduction == "none":
        g64 = rng.standard_normal(out_shape)
        go, gor = to_device(g64, dtype)
        ref_go = gor
    else:
        go = float(rng.standard_normal())
        ref_go = go
    ref_gx, ref_gt = reference.grads(name, xr, tr, reduction, ref_go, **opts)

    value = _call(name, "value", x, t, reduction=reduction, **opts)
    assert value.dtype == dtype and value.shape == np.shape(ref_v)
    divisor = {"mean": n, "batchmean": x_shape[0] if x_shape else 1}.get(reduction, 1)
    terms = _magnitude(name, xr, tr, opts)
    scale = terms if reduction == "none" else _sum_scale(terms, reduction, divisor)
    assert_close(to_host(value), ref_v, dtype, scale, "value")

    gx, gt = _call(name, "backward", go, x, t, reduction=reduction, **opts)
    v2, (gx2, gt2) = _call(name, "vag", x, t, reduction=reduction, grad_output=go, **opts)
    for got, ref, arg in ((gx, ref_gx, "input"), (gt, ref_gt, "target")):
        assert got.dtype == dtype and got.shape == ref.shape, arg
        assert_close(to_host(got), ref, dtype, None, f"d/d{arg}")
    # One pass or two, the numbers are the same ones.
    assert np.array_equal(to_host(v2), to_host(value), equal_nan=True)
    assert np.array_equal(to_host(gx2), to_host(gx), equal_nan=True)
    assert np.array_equal(to_host(gt2), to_host(gt), equal_nan=True)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("case", ["flat", "rows", "scalar", "column"])
def test_bitwise_deterministic(name, case):
    """Ten runs give bitwise the same value and gradients (no atomics anywhere)."""
    import cupy

    shapes = {"flat": ((1000, 1037), (1000, 1037)), "rows": ((4099, 1024), (1024,)),
              "scalar": ((1 << 20) + 3, ()), "column": ((1000, 777), (1000, 1))}[case]
    rng = np.random.default_rng(1)
    opts = {"kl_div": {"log_input": False}}.get(name, {})
    x64, t64 = _operands(name, rng, *shapes, opts)
    x, _ = to_device(x64, np.float32)
    t, _ = to_device(np.abs(t64) if name == "kl_div" else t64, np.float32)
    first = None
    for _ in range(10):
        v, (gx, gt) = _call(name, "vag", x, t, reduction="sum", **opts)
        now = [a.get().tobytes() for a in (v, gx, gt)]
        if first is None:
            first = now
        assert now == first


@pytest.mark.parametrize("dtype", DTYPES)
def test_hinge_tie_passes_gradient(dtype):
    """At margin == x t exactly, torch's clamp passes the gradient: d/dx = -t, d/dt = -x."""
    import cupy

    x, _ = to_device([0.5, 0.5, 2.0, -1.0], dtype)
    t, _ = to_device([2.0, 4.0, 0.5, -1.0], dtype)   # x t = 1, 2, 1, 1
    gx, gt = _call("hinge_loss", "backward", 1.0, x, t, reduction="sum")
    np.testing.assert_array_equal(to_host(gx), [-2.0, 0.0, -0.5, 1.0])
    np.testing.assert_array_equal(to_host(gt), [-0.5, 0.0, -2.0, 1.0])
    v = _call("hinge_loss", "value", x, t, reduction="none")
    np.testing.assert_array_equal(to_host(v), [0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(name, dtype):
    """A NaN input gives a NaN loss and NaN-or-blocked gradients exactly where the reference does."""
    rng = np.random.default_rng(2)
    opts = {}
    x64, t64 = _operands(name, rng, (257, 33), (257, 33), opts, special=True)
    x64[0, 0] = np.inf
    x, xr = to_device(x64, dtype)
    t, tr = to_device(t64, dtype)
    for reduction in ("none", "sum"):
        v = _call(name, "value", x, t, reduction=reduction)
        ref = reference.loss(name, xr, tr, reduction)
        got = to_host(v)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        if reduction == "sum":
            assert np.isnan(got)
    gx, gt = _call(name, "backward", 1.0, x, t, reduction="sum")
    rgx, rgt = reference.grads(name, xr, tr, "sum")
    assert np.array_equal(np.isnan(to_host(gx)), np.isnan(rgx))
    assert np.array_equal(np.isnan(to_host(gt)), np.isnan(rgt))


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


def test_fp16_sum_of_4096_ones_is_exact():
    """4096 ones in fp16 sum to 4096 exactly (fp32 accumulation; fp16 alone would stall at 2048)."""
    import cupy

    x = cupy.ones(4096, cupy.float16)
    z = cupy.zeros(4096, cupy.float16)
    assert float(_call("mse_loss", "value", x, z, reduction="sum").get()) == 4096.0
    assert float(_call("mse_loss", "value", x, z, reduction="mean").get()) == 1.0


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
def test_empty(shape):
    """Torch's rules: mean of empty is NaN, sum is 0, none is empty; gradients are empty or 0."""
    import cupy

    x = cupy.zeros(shape, cupy.float32)
    assert np.isnan(float(_call("mse_loss", "value", x, x, reduction="mean").get()))
    assert float(_call("mse_loss", "value", x, x, reduction="sum").get()) == 0.0
    assert _call("mse_loss", "value", x, x, reduction="none").shape == shape
    t = cupy.ones(shape[-1:], cupy.float32)
    gx, gt = _call("mse_loss", "backward", 1.0, x, t, reduction="sum")
    assert gx.shape == shape and gt.shape == shape[-1:]
    assert not gt.get().any()


def test_zero_dim():
    """0-d operands: the loss of one element; batchmean of 0-d input is the sum."""
    import cupy

    x = cupy.array(0.25, cupy.float64)
    t = cupy.array(0.5, cupy.float64)
    assert float(_call("kl_div", "value", x, t, reduction="batchmean").get()) == pytest.approx(
        float(reference.loss("kl_div", 0.25, 0.5, "batchmean")), rel=1e-14)
    gx, gt = _call("mse_loss", "backward", cupy.array(3.0), x, t, reduction="mean")
    assert gx.shape == () and float(gx.get()) == pytest.approx(2 * (0.25 - 0.5) * 3.0)


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


def test_no_host_sync_under_graph_capture():
    """value_and_grad records into a CUDA graph: a host-device sync would break the capture."""
    import cupy

    rng = np.random.default_rng(6)
    x, xr = to_device(rng.standard_normal((512, 1024)), np.float32)
    t, tr = to_device(rng.standard_normal((1024,)), np.float32)
    go = cupy.array(1.5, cupy.float32)
    for name in LOSSES:
        _call(name, "vag", x, cupy.abs(t), reduction="mean", grad_output=go)  # compile, warm pool
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            out = _call(name, "vag", x, cupy.abs(t), reduction="mean", grad_output=go)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        ref = reference.loss(name, xr, np.abs(tr), "mean")
        assert_close(to_host(out[0]), ref, np.float32, None, name)


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
    with pytest.raises(TypeError, match="int32"):
        cl.mse_loss(x.astype(cupy.int32), x)
    with pytest.raises(TypeError, match="bool"):
        cl.hinge_loss(x, x.astype(bool))
    with pytest.raises(TypeError, match="complex64"):
        cl.kl_div(x.astype(cupy.complex64), x)
    with pytest.raises(TypeError, match="float64"):
        cl.mse_loss(x, x.astype(cupy.float64))
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
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            y = cupy.ones((4, 3), cupy.float32)
        with pytest.raises(ValueError, match="device"):
            cl.mse_loss(x, y)


@pytest.mark.parametrize("name", LOSSES)
def test_matches_torch_on_gpu(name):
    """Values and autograd gradients of torch on the GPU, torch tensors in, with broadcasting."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import torch.nn.functional as F

    rng = np.random.default_rng(7)
    x64, t64 = _operands(name, rng, (300, 257), (257,), {})
    tx = torch.tensor(x64, dtype=torch.float32, device="cuda", requires_grad=True)
    tt = torch.tensor(t64, dtype=torch.float32, device="cuda", requires_grad=True)
    fns = {"mse_loss": lambda a, b: F.mse_loss(a, b),
           "kl_div": lambda a, b: F.kl_div(a, b, reduction="batchmean"),
           "hinge_loss": lambda a, b: torch.mean(torch.clamp(1 - a * b, min=0))}
    reduction = "batchmean" if name == "kl_div" else "mean"
    ref = fns[name](tx, tt)
    rgx, rgt = torch.autograd.grad(ref, (tx, tt))
    vag = getattr(_cl(), name + "_value_and_grad")
    loss, (gx, gt) = vag(tx, tt, reduction=reduction)   # tensors that require grad, read as-is
    assert isinstance(loss, torch.Tensor) and loss.device == tx.device
    for got, want in ((loss, ref), (gx, rgx), (gt, rgt)):
        want = want.detach().double().cpu().numpy()
        assert_close(got.double().cpu().numpy(), want, np.float32, None, name)


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
