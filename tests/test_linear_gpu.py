"""GPU tests of the fused linear cross entropy against float64 references: the logits
X W^T + b formed in float64 from the same (rounded) inputs, cross_entropy and its gradient from
tests/reference_rowwise.py, then dX = dZ W, dW = dZ^T X, db = sum dZ; and against torch's
autograd of ``F.cross_entropy(F.linear(h, W, b).float(), t)``.
"""

import numpy as np
import pytest

import reference_rowwise as ref
from gpu_util import BFLOAT16

pytestmark = pytest.mark.gpu

N, H, V = 300, 64, 1000
# Budgets that give every plan (cupyloss.linear.plan) with several chunks, slices and tiles;
# 16-bit inputs take the named plan, float32 ones sum in place in chunks of the rows it names.
BUDGETS = {
    "default": None,                                   # keep, one chunk
    "keep-128rows": N * V * 2 + 128 * V * 4,           # keep, 128-row chunks
    "sum-128rows": V * H * 4 + 128 * V * 6,            # a float32 dW sum, 128-row chunks
    # a split dW sum (16-bit halves and a 128-class float32 slice), 128-row chunks
    "sum-split": V * H * 2 + 128 * H * 4 + 128 * V * 6,
    "slices": 240_000,                                 # 40-row chunks; 128-class slices of all rows
    "slices-tiles": 13 * V * 6,                        # 13-row chunks; slices in 58-row tiles
    "1byte": 1,                                        # 1-row chunks; slices in 1-row tiles
}
DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 else [])
# Largest |error| / largest |reference|: the logits and loss are float32 sums of exact products;
# a 16-bit gradient rounds dZ to the dtype (as torch's autograd does) and then itself.
TOL_LOSS = {"float32": 2e-6, "float16": 2e-6, "bfloat16": 2e-6}
TOL_GRAD = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _inputs(dtype, bias=False, class_weight=False, seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, H)) * 0.5
    w = rng.standard_normal((V, H)) * 0.5
    t = rng.integers(0, V, N)
    t[::7] = -100
    b = rng.standard_normal(V) if bias else None
    cw = rng.random(V) + 0.5 if class_weight else None
    dev = [None if a is None else cupy.asarray(a.astype(dtype)) for a in (x, w, b, cw)]
    host = [None if a is None else a.astype(dtype).astype(np.float64) for a in (x, w, b, cw)]
    return dev, host, cupy.asarray(t), t


def _reference(host, t, reduction, opts, grad_output=1.0):
    x, w, b, cw = host
    z = x @ w.T + (0 if b is None else b)
    loss = ref.cross_entropy(z, t, cw, reduction=reduction, **opts)
    dz, _ = ref.cross_entropy_grads(z, t, cw, reduction=reduction, grad_output=grad_output,
                                    **opts)
    return loss, dz


def _err(got, want):
    got = np.asarray(got, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"lse_square_scale": 1e-3, "softcap": 3.0},
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("extras", [(False, False), (True, True)], ids=["-", "bias+weight"])
@pytest.mark.parametrize("budget", BUDGETS.values(), ids=BUDGETS.keys())
def test_value_and_grad_against_float64(dtype, reduction, opts, extras, budget):
    import cupy

    import cupyloss

    (x, w, b, cw), host, t, t_host = _inputs(dtype, *extras)
    rng = np.random.default_rng(1)
    go_host = rng.standard_normal(N) if reduction == "none" else 0.75
    go = cupy.asarray(go_host, np.float32) if reduction == "none" else go_host
    wrt = ("hidden", "weight", "bias") if b is not None else ("hidden", "weight")
    loss, grads = cupyloss.linear_cross_entropy_value_and_grad(
        x, w, t, b, cw, reduction=reduction, max_workspace_bytes=budget, grad_output=go,
        wrt=wrt, **opts)
    want_loss, dz = _reference(host, t_host, reduction, opts, go_host)
    assert loss.dtype == np.float32
    assert _err(cupy.asnumpy(loss), want_loss) <= TOL_LOSS[str(dtype)]
    hx, hw = host[0], host[1]
    want = {"hidden": dz @ hw, "weight": dz.T @ hx, "bias": dz.sum(axis=0)}
    for name, g in zip(wrt, grads):
        assert g.dtype == dtype and g.shape == want[name].shape
        assert _err(cupy.asnumpy(g.astype(np.float64)), want[name]) <= TOL_GRAD[str(dtype)], name
    # The loss alone and the gradients alone agree with the one pass.
    alone = cupyloss.linear_cross_entropy(x, w, t, b, cw, reduction=reduction,
                                          max_workspace_bytes=budget, **opts)
    assert _err(cupy.asnumpy(alone), cupy.asnumpy(loss).astype(np.float64)) <= 1e-6
    back = cupyloss.linear_cross_entropy_backward(go, x, w, t, b, cw, reduction=reduction,
                                                  max_workspace_bytes=budget, wrt=wrt, **opts)
    for g, h in zip(grads, back):
        assert cupy.array_equal(g, h)


def test_budgets_give_the_plans_they_name():
    from cupyloss import linear

    for name, budget in BUDGETS.items():
        p = linear.plan(N, V, H, 2, budget)
        assert p.kind == name.split("-")[0] if name not in ("default", "1byte") else True
    assert linear.plan(N, V, H, 2, BUDGETS["sum-128rows"]).cols == 0
    assert linear.plan(N, V, H, 2, BUDGETS["sum-split"]) == linear.Plan(
        "sum", 128, 128, 0, BUDGETS["sum-split"])
    assert linear.plan(N, V, H, 2, BUDGETS["slices"]).tile == N
    assert linear.plan(N, V, H, 2, BUDGETS["slices-tiles"]).tile == 58
    assert linear.plan(N, V, H, 2, 1) == linear.Plan("slices", 1, 128, 1, 128 * H * 4 + 128 * 6)


@pytest.mark.parametrize("gtype", [t for t in DTYPES if t.itemsize == 2], ids=str)
@pytest.mark.parametrize("opts", OPTIONS + [{"label_smoothing": 0.2, "weight": True}],
                         ids=lambda o: ",".join(o) or "plain")
def test_row_kernel_rounds_its_gradient_as_a_second_pass_would(gtype, opts):
    """cross_entropy_rows<float, mode, G> stores what the float32 gradient rounded to G is."""
    import cupy

    import cupyloss
    from cupyloss.rowwise import _family as _rowwise

    rng = np.random.default_rng(5)
    rows, cols = 37, 70_000          # a row over a cluster of blocks, an odd class count
    z = cupy.asarray(rng.standard_normal((rows, cols)) * 3, np.float32)
    t = cupy.asarray(rng.integers(0, cols, rows))
    t[::6] = -100
    opts = dict(opts)
    weight = cupy.asarray(rng.random(cols) + 0.5, np.float32) if opts.pop("weight", 0) else None
    g = cupy.asarray(0.37, np.float32)
    want = cupyloss.cross_entropy_backward(g, z, t, weight, reduction="sum", **opts)
    got = cupy.empty((rows, cols), gtype)
    _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], z, t, weight, reduction="sum",
                      want_value=False, wrt=("input",), grad_output=g, grad_into=got, **opts)
    rounded = cupy.asarray(cupy.asnumpy(want).astype(gtype))      # NumPy rounds to nearest
    assert cupy.array_equal(got.view(np.uint16), rounded.view(np.uint16))


@pytest.mark.parametrize("opts", OPTIONS + [{"label_smoothing": 0.2, "weight": True}],
                         ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("go", ["host", "device", "rows"])
def test_slice_gradient_matches_the_row_kernel(opts, go):
    """cross_entropy_slice_grad over slices of the classes, from the rows kernel's lse, gives
    the rows kernel's gradient (up to the order of a z-loss term's fused multiply-add)."""
    import cupy

    import cupyloss
    from cupyloss.rowwise import _family as _rowwise

    rng = np.random.default_rng(6)
    rows, cols = 45, 3001
    z = cupy.asarray(rng.standard_normal((rows, cols)) * 3, np.float32)
    t = cupy.asarray(rng.integers(0, cols, rows), np.int32)
    t[::6] = -100
    t[7] = cols + 3                                    # out of range: a NaN row
    opts = dict(opts)
    weight = cupy.asarray(rng.random(cols) + 0.5, np.float32) if opts.pop("weight", 0) else None
    reduction = "none" if go == "rows" else "sum"
    g = {"host": 0.37, "device": cupy.asarray(0.37, np.float32),
         "rows": cupy.asarray(rng.standard_normal(rows), np.float32)}[go]
    _, want, lse = cupyloss.cross_entropy_value_and_grad(z, t, weight, reduction=reduction,
                                                         grad_output=g, return_lse=True, **opts)
    got = cupy.full((rows, cols), np.nan, np.float32)
    wsum = weight.sum() if weight is not None else None
    for c0 in range(0, cols, 1024):
        c1 = min(cols, c0 + 1024)
        sl = cupy.ascontiguousarray(z[:, c0:c1])
        out = cupy.empty_like(sl)
        _rowwise.slice_grad(sl, t, lse, out, c0, cols, weight, wsum, g,
                            ignore_index=-100, label_smoothing=opts.get("label_smoothing", 0.0),
                            lse_square_scale=opts.get("lse_square_scale", 0.0),
                            softcap=opts.get("softcap", 0.0),
                            stream=cupy.cuda.get_current_stream().ptr, device=0)
        got[:, c0:c1] = out
    got, want = cupy.asnumpy(got), cupy.asnumpy(want)
    assert np.isnan(got[7]).all() and np.isnan(want[7]).all()
    assert not got[6].any()                            # an ignored row
    keep = np.arange(rows) != 7
    np.testing.assert_allclose(got[keep], want[keep], rtol=4e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_runs_repeat_bitwise_and_chunks_agree(dtype):
    import cupy

    import cupyloss

    (x, w, _, _), _, t, _ = _inputs(dtype)
    one = cupyloss.linear_cross_entropy_value_and_grad(x, w, t)
    again = cupyloss.linear_cross_entropy_value_and_grad(x, w, t)
    chunked = cupyloss.linear_cross_entropy_value_and_grad(x, w, t, max_workspace_bytes=1)
    assert cupy.array_equal(one[0], again[0])
    for a, b in zip(one[1], again[1]):
        assert cupy.array_equal(a, b)
    # cuBLAS picks its algorithm by the shapes, so other chunks round otherwise: close only.
    for a, b in zip(one[1], chunked[1]):
        a, b = cupy.asnumpy(a.astype(np.float64)), cupy.asnumpy(b.astype(np.float64))
        assert _err(b, a) <= TOL_GRAD[str(dtype)]


def test_return_lse_and_empty_batch():
    import cupy

    import cupyloss

    (x, w, _, _), host, t, _ = _inputs(np.dtype(np.float32))
    _, _, lse = cupyloss.linear_cross_entropy_value_and_grad(x, w, t, return_lse=True,
                                                             max_workspace_bytes=1)
    want = ref.lse(host[0] @ host[1].T)
    assert _err(cupy.asnumpy(lse), want) <= 2e-6
    loss, (gx, gw) = cupyloss.linear_cross_entropy_value_and_grad(x[:0], w, t[:0])
    assert np.isnan(float(loss)) and gx.shape == (0, H)
    assert not cupy.any(gw)


def test_errors_before_any_launch():
    import cupy

    import cupyloss

    (x, w, _, _), _, t, _ = _inputs(np.dtype(np.float32))
    with pytest.raises(ValueError, match="ZeRO-3"):
        cupyloss.linear_cross_entropy(x, w[:0], t)
    with pytest.raises(ValueError, match="ZeRO-3"):
        cupyloss.linear_cross_entropy(x, w.reshape(-1), t)
    with pytest.raises(TypeError, match="dtype"):
        cupyloss.linear_cross_entropy(x, w.astype(cupy.float16), t)
    with pytest.raises(ValueError, match="target's shape"):
        cupyloss.linear_cross_entropy(x, w, t[:5])
    with pytest.raises(TypeError, match="class indices"):
        cupyloss.linear_cross_entropy(x, w, t.astype(cupy.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16"])
def test_torch_adapter_matches_torch_autograd(reduction, torch_dtype):
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    dtype = getattr(torch, torch_dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(4, 75, H, device="cuda", generator=gen) * 0.5).to(dtype)
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.5).to(dtype)
    b = torch.randn(V, device="cuda", generator=gen).to(dtype)
    t = torch.randint(0, V, (4, 75), device="cuda", generator=gen)
    t[:, ::5] = -100
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]
    mine = [a.clone().requires_grad_() for a in (h, w, b)]
    # float32 logits from the 16-bit operands, as cupyloss forms them (never rounded to 16 bits)
    want = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(*(a.float() for a in leaves)).flatten(0, 1), t.flatten(),
        reduction=reduction, label_smoothing=0.05)
    got = CF.linear_cross_entropy(mine[0], mine[1], t, mine[2], reduction=reduction,
                                  label_smoothing=0.05, max_workspace_bytes=64 * V * 6)
    assert got.dtype == torch.float32
    up = (torch.randn(want.shape, device="cuda", generator=gen) if reduction == "none"
          else torch.tensor(2.0, device="cuda"))
    want.backward(up.reshape(want.shape))
    got.backward(up.reshape(got.shape))
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=2e-6, atol=1e-6)
    tol = 2e-5 if torch_dtype == "float32" else 1.6e-2
    for a, m in zip(leaves, mine):
        scale = a.grad.double().abs().max()
        assert float((m.grad.double() - a.grad.double()).abs().max() / scale) <= tol
