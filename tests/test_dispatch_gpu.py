"""The dispatch edge on a GPU: CuPy, torch and JAX arrays in and out, zero-copy, on the caller's
stream and allocator, with the same numbers whichever way an array comes in."""

import numpy as np
import pytest

import reference
from gpu_util import assert_close

pytestmark = pytest.mark.gpu

LOSSES = ("mse_loss", "kl_div", "hinge_loss")


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def _cl():
    import cupyloss

    return cupyloss


def _values(rng, shape, name):
    x = rng.standard_normal(shape)
    if name == "kl_div":
        x = np.log(rng.uniform(0.05, 1.0, shape))
    return x


def _all_entry_points(name, x, t, go, **kw):
    """value, backward and value_and_grad of loss `name`, flattened to a list of arrays."""
    cl = _cl()
    v = getattr(cl, name)(x, t, **kw)
    gx, gt = getattr(cl, name + "_backward")(go, x, t, **kw)
    v2, (gx2, gt2) = getattr(cl, name + "_value_and_grad")(x, t, grad_output=go, **kw)
    return [v, gx, gt, v2, gx2, gt2]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_torch_tensors_give_the_cupy_numbers(name, reduction):
    """torch in, torch out, bitwise the numbers CuPy arrays give; requires_grad tensors read."""
    import cupy

    torch = _torch()
    rng = np.random.default_rng(0)
    x64, t64 = _values(rng, (257, 129), name), np.abs(rng.standard_normal((129,)))
    g64 = rng.standard_normal((257, 129)) if reduction == "none" else np.float64(1.7)
    tx = torch.tensor(x64, dtype=torch.float32, device="cuda", requires_grad=True)
    tt = torch.tensor(t64, dtype=torch.float32, device="cuda")
    tg = torch.tensor(g64, dtype=torch.float32, device="cuda")
    cx, ct, cg = (cupy.asarray(a, dtype=cupy.float32) for a in (x64, t64, g64))
    got = _all_entry_points(name, tx, tt, tg, reduction=reduction)
    want = _all_entry_points(name, cx, ct, cg, reduction=reduction)
    for g, w in zip(got, want):
        assert isinstance(g, torch.Tensor) and g.device == tx.device and not g.requires_grad
        assert g.dtype == torch.float32 and tuple(g.shape) == w.shape
        assert np.array_equal(g.cpu().numpy(), w.get(), equal_nan=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_dtypes_and_layouts(dtype):
    """bf16 and every dtype; transposed, sliced and expanded (stride 0) tensors."""
    torch = _torch()
    rng = np.random.default_rng(1)
    tdtype = getattr(torch, dtype)
    base = torch.tensor(rng.standard_normal((64, 96)), device="cuda").to(tdtype)
    views = {
        "transposed": base.t(),                                     # (96, 64), strides (1, 96)
        "sliced": base[::2, 1::3],                                  # (32, 32), odd strides
        "expanded": base[:1].expand(64, 96),                        # stride 0 down the rows
    }
    for what, x in views.items():
        t = torch.tensor(rng.standard_normal(tuple(x.shape)), device="cuda").to(tdtype)
        loss, (gx, gt) = _cl().mse_loss_value_and_grad(x, t, reduction="sum")
        xr, tr = x.double().cpu().numpy(), t.double().cpu().numpy()
        np_dtype = np.dtype(dtype) if dtype != "bfloat16" else _bf16()
        assert_close(loss.double().cpu().numpy(), reference.loss("mse_loss", xr, tr, "sum"),
                     np_dtype, np.sum((xr - tr) ** 2), what)
        rgx, rgt = reference.grads("mse_loss", xr, tr, "sum")
        assert_close(gx.double().cpu().numpy(), rgx, np_dtype, None, what)
        assert_close(gt.double().cpu().numpy(), rgt, np_dtype, None, what)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def test_cupy_negative_strides():
    """CuPy views with negative strides (torch has none) are read where they point."""
    import cupy

    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.standard_normal((33, 65)))[::-1, ::-2]
    t = cupy.asarray(rng.standard_normal((33, 65)))[:, ::-2]
    loss, (gx, gt) = _cl().mse_loss_value_and_grad(x, t, reduction="mean")
    xr, tr = x.get(), t.get()
    assert_close(loss.get(), reference.loss("mse_loss", xr, tr, "mean"), np.float64)
    rgx, rgt = reference.grads("mse_loss", xr, tr, "mean")
    assert_close(gx.get(), rgx, np.float64)
    assert_close(gt.get(), rgt, np.float64)


def test_zero_copy_both_ways():
    """Inputs are read at their own addresses; outputs are the framework's own allocations."""
    from cupyloss._core import dispatch as _dispatch

    torch = _torch()
    x = torch.randn(1000, device="cuda", requires_grad=True)
    frame = _dispatch.frame_of(x, "input")
    assert frame.operand(x, "input").ptr == x.data_ptr()
    out, ptr = frame.empty((3, 4), np.dtype(np.float32), x)
    assert isinstance(out, torch.Tensor) and out.data_ptr() == ptr
    # The loss's outputs are ordinary torch allocations: freed into torch's cache, reused.
    before = torch.cuda.memory_allocated()
    _, (gx, gt) = _cl().mse_loss_value_and_grad(x, x.detach() + 1)
    assert torch.cuda.memory_allocated() >= before + 2 * 1000 * 4


def test_torch_outputs_come_from_torch_and_leave_cupy_pool_alone():
    import cupy

    torch = _torch()
    x = torch.randn(4096, 1024, device="cuda")
    y = torch.randn(4096, 1024, device="cuda")
    _cl().mse_loss_value_and_grad(x, y)          # plan, compile, ticket slots
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, (gx, gy) = _cl().mse_loss_value_and_grad(x, y)
    assert torch.cuda.max_memory_allocated() >= base + 2 * x.numel() * 4
    assert pool.used_bytes() == used, "torch callers' outputs or scratch came from CuPy's pool"


def test_inputs_are_never_written():
    torch = _torch()
    rng = np.random.default_rng(3)
    for name in LOSSES:
        x = torch.tensor(_values(rng, (300, 70), name), dtype=torch.float32, device="cuda")
        t = torch.rand(300, 70, device="cuda")
        go = torch.randn(300, 70, device="cuda")
        copies = [a.clone() for a in (x, t, go)]
        _all_entry_points(name, x, t, go, reduction="none")
        torch.cuda.synchronize()
        for a, c in zip((x, t, go), copies):
            assert torch.equal(a, c), name


def _torch_path(monkeypatch, fast):
    """Read torch tensors through data_ptr() (fast) or DLPack, for this test only.  Frames are
    cached per array type, so the cache starts empty too."""
    from cupyloss._core import dispatch as _dispatch

    monkeypatch.setattr(_dispatch, "torch_fast_path", fast)
    monkeypatch.setattr(_dispatch, "_FRAMES", {})


@pytest.mark.parametrize("fast", [True, False], ids=["data_ptr", "dlpack"])
def test_work_runs_on_torchs_current_stream(fast, monkeypatch):
    """A producer writes the inputs on a side stream behind a long sleep; the loss called on that
    stream must see the new values (both the data_ptr path and the DLPack path)."""
    torch = _torch()
    _torch_path(monkeypatch, fast)
    x = torch.zeros(1 << 16, device="cuda")
    y = torch.zeros(1 << 16, device="cuda")
    _cl().mse_loss(x, y, reduction="sum")         # plan and compile outside the timed part
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)              # ~25 ms of GPU time before the writes
        x.fill_(3.0)
        y.fill_(1.0)
        loss = _cl().mse_loss(x, y, reduction="sum")
        _, (gx, _) = _cl().mse_loss_value_and_grad(x, y, reduction="sum")
    side.synchronize()
    assert loss.item() == 4.0 * x.numel()
    assert torch.all(gx == 4.0)


def test_dlpack_and_data_ptr_paths_agree(monkeypatch):
    torch = _torch()
    x = torch.randn(513, 77, device="cuda", dtype=torch.float16, requires_grad=True)[:, ::2]
    y = torch.randn(39, device="cuda", dtype=torch.float16)
    results = []
    for fast in (True, False):
        _torch_path(monkeypatch, fast)
        out = _all_entry_points("hinge_loss", x, y, 1.5, reduction="mean")
        results.append([o.cpu() for o in out])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cuda_graph_capture_with_torch_tensors():
    """Outputs from torch's allocator land in the graph's private pool; replay gives eager's."""
    torch = _torch()
    x = torch.randn(4096, 300, device="cuda")
    y = torch.randn(300, device="cuda")
    eager = _cl().hinge_loss_value_and_grad(x, y)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _cl().hinge_loss_value_and_grad(x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, (gx, gy) = _cl().hinge_loss_value_and_grad(x, y)
    x.copy_(torch.randn_like(x))
    graph.replay()
    again = _cl().hinge_loss_value_and_grad(x, y)
    torch.cuda.synchronize()
    assert torch.equal(loss, again[0]) and torch.equal(gx, again[1][0])
    assert torch.equal(gy, again[1][1])
    assert not torch.equal(loss, eager[0])


def test_errors_name_the_argument():
    import cupy

    torch = _torch()
    cl = _cl()
    x = torch.ones(4, 3, device="cuda")
    with pytest.raises(TypeError, match=r"input is a torch.Tensor but target is a cupy"):
        cl.mse_loss(x, cupy.ones((4, 3), cupy.float32))
    with pytest.raises(TypeError, match=r"target is a torch.Tensor on cpu"):
        cl.mse_loss(x, torch.ones(4, 3))
    with pytest.raises(TypeError, match=r"input has dtype torch.int32"):
        cl.mse_loss(x.int(), x)
    with pytest.raises(TypeError, match=r"input has dtype float32 but target has dtype float64"):
        cl.mse_loss(x, x.double())
    with pytest.raises(TypeError, match=r"grad_output is a cupy"):
        cl.mse_loss_backward(cupy.ones((), cupy.float32), x, x)
    with pytest.raises(TypeError, match=r"grad_output has dtype float64"):
        cl.mse_loss_backward(torch.ones((), dtype=torch.float64, device="cuda"), x, x)
    with pytest.raises(ValueError, match=r"grad_output shape \(3, 4\)"):
        cl.mse_loss_backward(torch.ones(3, 4, device="cuda"), x, x, reduction="none")
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="CUDA device 0 but target is on CUDA device 1"):
            cl.mse_loss(x, torch.ones(4, 3, device="cuda:1"))


def _jax():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    return jax


def test_jax_arrays_in_and_out():
    """JAX arrays in, JAX arrays out, the numbers CuPy gives; zero-copy both ways."""
    import cupy

    jax = _jax()
    import jax.numpy as jnp

    from cupyloss._core import dispatch as _dispatch

    rng = np.random.default_rng(4)
    p = rng.uniform(0.05, 1, (64, 100)).astype(np.float32)
    q = rng.uniform(0.05, 1, (64, 100)).astype(np.float32)
    jp, jq = jnp.asarray(np.log(p)), jnp.asarray(q)
    got = _cl().kl_div(jp, jq, reduction="batchmean")
    want = _cl().kl_div(cupy.asarray(np.log(p)), cupy.asarray(q), reduction="batchmean")
    assert isinstance(got, jax.Array)
    assert np.asarray(got) == want.get()
    loss, (gx, gt) = _cl().kl_div_value_and_grad(jp, jq, reduction="batchmean")
    assert isinstance(gx, jax.Array) and gx.shape == (64, 100)
    frame = _dispatch.frame_of(jp, "input")
    assert frame.operand(jp, "input").ptr == jp.unsafe_buffer_pointer()
    a, ptr = frame.empty((5,), np.dtype(np.float32), frame.operand(jp, "input").array)
    assert frame.result(a).unsafe_buffer_pointer() == ptr


def test_generic_dlpack_producer_gets_cupy_back():
    """An array type cupyloss does not know, speaking DLPack from the GPU, works."""
    import cupy

    class Foreign:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = cupy.arange(10, dtype=cupy.float32)
    out = _cl().mse_loss(Foreign(x), Foreign(x * 2), reduction="sum")
    assert isinstance(out, cupy.ndarray) and float(out.get()) == float(((x - 2 * x) ** 2).sum())
