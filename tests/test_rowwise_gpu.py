"""GPU tests of the row-wise losses (cross_entropy, nll_loss) against tests/reference_rowwise.py.

Class counts are chosen at the kernels' edges: 1 (a one-class softmax), 7 (all head and tail
scalars), the team sizes of the launch table (8..256 threads holding 8 16-byte vectors each:
rows of 64..2048 vectors), a row just past one block's registers (split over 2 and 3 blocks of a
cooperative launch) and a row past every resident block's registers (streamed in tiles).
"""


import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import reference_rowwise as ref
from gpu_util import (
    assert_close, BFLOAT16, cupy_module as _cupy, cupyloss_module as _cl, DTYPES, RTOL, TINY,
    to_device, to_host)

pytestmark = pytest.mark.gpu

# C by the table in cupyloss/_core/launch.py: team edges for float32 (4 elements a vector) and 16-bit
# (8): 8 threads x 8 vectors = 256 / 512 elements, 32 x 8 = 1024 / 2048, 256 x 8 = 8192 / 16384.
COLS = (1, 2, 7, 31, 33, 255, 256, 257, 1000, 1025, 2049, 4096, 8191, 8193, 16385)
ROWS = (1, 2, 3, 31, 33, 64, 129)


def _layout(dev, kind):
    """The same values as a contiguous array, a view whose rows start off 16-byte boundaries,
    or a transposed (class axis not contiguous) view."""
    cp = _cupy()
    if kind == "offset" and dev.ndim >= 1:
        big = cp.zeros(dev.shape[:-1] + (dev.shape[-1] + 1,), dev.dtype)
        big[..., 1:] = dev
        return big[..., 1:]
    if kind == "transposed" and dev.ndim == 2:
        return cp.ascontiguousarray(dev.T).T
    return dev


def _targets(rng, batch, cols, ignore_frac):
    y = rng.integers(0, cols, batch)
    return np.where(rng.random(batch) < ignore_frac, -100, y)


def _terms(xr, per_row, weight, opts):
    """Per row, the size of the terms a cross-entropy loss is formed from: lse - x_t (and the
    smoothing and z-loss terms) cancel when the target's probability is near 1, and rounding in
    the accumulator type is relative to |lse| + max |x| (times the largest weight), not to the
    small difference."""
    axis = 1 if xr.ndim > 1 else 0
    with np.errstate(all="ignore"):
        top = np.max(xr, axis=axis, keepdims=True)
        lse = np.squeeze(top + np.log(np.sum(np.exp(xr - top), axis=axis, keepdims=True)), axis)
        size = np.abs(lse) + np.max(np.abs(xr), axis=axis)
        size = size * (1.0 + opts.get("lse_square_scale", 0.0) * np.abs(lse))
    if weight is not None:
        size = size * np.max(weight)
    return np.where(np.isfinite(size), np.maximum(size, np.abs(per_row)), np.abs(per_row))


def _value_scale(per_row, reduction, divisor):
    """What a reduced value's rounding is relative to: sum |l_r| / divisor."""
    total = np.nansum(np.abs(per_row))
    if reduction == "mean" and divisor and np.isfinite(divisor):
        return total / abs(divisor)
    return total


@st.composite
def _cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["index", "index", "prob", "nll"]))
    shape_kind = draw(st.sampled_from(["2d", "2d", "2d", "1d", "nd"]))
    cols = draw(st.sampled_from(COLS))
    if shape_kind == "1d":
        shape = (cols,)
    elif shape_kind == "nd":
        shape = (draw(st.integers(1, 3)), min(cols, 40), draw(st.integers(1, 5)),
                 draw(st.integers(1, 3)))
    else:
        rows = draw(st.sampled_from(ROWS))
        shape = (max(1, min(rows, 2_000_000 // cols)), cols)
    opts = {}
    if kind != "nll":
        opts["label_smoothing"] = draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]))
        opts["lse_square_scale"] = draw(st.sampled_from([0.0, 0.0, 1e-3]))
        opts["softcap"] = draw(st.sampled_from([0.0, 0.0, 5.0]))
    return dict(dtype=dtype, kind=kind, shape=shape, opts=opts,
                weighted=draw(st.booleans()),
                reduction=draw(st.sampled_from(["none", "mean", "sum"])),
                layout=draw(st.sampled_from(["contiguous", "contiguous", "offset",
                                             "transposed"])),
                go_kind=draw(st.sampled_from(["host", "device"])),
                special=draw(st.sampled_from([False, False, True])),
                index64=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_cases())
# One thread summing 8191 smoothed probability terms (cross_entropy_cols): a's sum compensated.
@example(case=dict(dtype=np.dtype(np.float32), kind="prob", shape=(2, 8191),
                   opts={"label_smoothing": 1.0, "lse_square_scale": 0.0, "softcap": 0.0},
                   weighted=False, reduction="none", layout="transposed", go_kind="host",
                   special=False, index64=False, seed=0))
def test_against_reference(case):
    """value, backward and value_and_grad of every kind, dtype and layout against float64."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(case["seed"])
    dtype, kind, shape, opts = case["dtype"], case["kind"], case["shape"], case["opts"]
    cols = shape[1] if len(shape) > 1 else shape[0]
    batch = ref.batch_shape(shape)
    x64 = rng.standard_normal(shape) * 3
    if case["special"]:  # masked classes and the odd NaN: torch's NaN/inf pattern
        x64 = np.where(rng.random(shape) < 0.05, -np.inf, x64)
        x64 = np.where(rng.random(shape) < 0.002, np.nan, x64)
    if kind == "nll":  # log-probabilities; a row of only -inf becomes NaN, on both sides
        with np.errstate(all="ignore"):
            x64 = x64 - np.log(np.sum(np.exp(np.where(np.isnan(x64), 0, x64)),
                                      axis=1 if len(shape) > 1 else 0, keepdims=True))
    x, xr = to_device(x64, dtype)
    x = _layout(x, case["layout"])
    if kind == "prob":
        p = rng.random(shape)
        t, tr = to_device(p / p.sum(axis=1 if len(shape) > 1 else 0, keepdims=True), dtype)
    else:
        tr = _targets(rng, batch, cols, 0.2).astype(np.int64 if case["index64"] else np.int32)
        t = cp.asarray(tr)
    w = wr = None
    if case["weighted"]:
        w, wr = to_device(rng.uniform(0.2, 2.0, cols), dtype)
    reduction = case["reduction"]
    if reduction == "none" and batch != ():
        go_host = rng.standard_normal(batch)
        go, gor = to_device(go_host, dtype)
    elif case["go_kind"] == "device":
        go, gor = to_device(np.float64(0.75), dtype)
    else:
        go, gor = 0.75, 0.75
    if kind == "nll":
        want = ref.nll_loss(xr, tr, wr, reduction=reduction)
        per_row = ref.nll_loss(xr, tr, wr, reduction="none")
        gx_want, gt_want = ref.nll_loss_grads(xr, tr, wr, reduction=reduction,
                                              grad_output=gor), None
        name = "nll_loss"
    else:
        want = ref.cross_entropy(xr, tr, wr, reduction=reduction, **opts)
        per_row = ref.cross_entropy(xr, tr, wr, reduction="none", **opts)
        gx_want, gt_want = ref.cross_entropy_grads(xr, tr, wr, reduction=reduction,
                                                   grad_output=gor, **opts)
        name = "cross_entropy"
    wrt = ("input", "target") if kind == "prob" else "input"
    label = f"{name} {case}"
    divisor = (np.sum([wr[y] if wr is not None else 1 for y in np.ravel(tr) if y != -100])
               if kind != "prob" else np.prod(batch))
    terms = per_row if kind == "nll" else _terms(xr, per_row, wr, opts)
    vscale = _value_scale(terms, reduction, divisor)
    fn = getattr(cl, name)
    got = fn(x, t, w, reduction=reduction, **opts)
    assert got.dtype == dtype and got.shape == np.shape(want)
    assert_close(to_host(got), want, dtype, vscale if reduction != "none" else terms,
                 "value " + label)
    grads = getattr(cl, name + "_backward")(go, x, t, w, reduction=reduction, wrt=wrt, **opts)
    value, grads2 = getattr(cl, name + "_value_and_grad")(x, t, w, reduction=reduction,
                                                         grad_output=go, wrt=wrt, **opts)
    assert_close(to_host(value), want, dtype, vscale if reduction != "none" else None,
                 "value_and_grad value " + label)
    for what, g in (("backward", grads), ("value_and_grad", grads2)):
        gx = g[0] if kind == "prob" else g
        assert gx.shape == shape and gx.dtype == dtype and gx.flags.c_contiguous
        assert_close(to_host(gx), gx_want, dtype, None, f"{what} input gradient {label}")
        if kind == "prob":
            assert_close(to_host(g[1]), gt_want, dtype, None, f"{what} target gradient {label}")


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_z_loss_gradient_keeps_its_precision_when_softmax_cancels(reduction):
    """One class: p = 1 cancels the target exactly and the gradient is the z-loss term
    2 zs lse alone, which must keep fp32's relative precision (not 1e-7 of p's size)."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(31)
    x, xr = to_device(rng.standard_normal((31, 1)) * 3, np.float32)
    tr = np.zeros(31, dtype=np.int64)
    opts = dict(lse_square_scale=1e-3)
    gx_want, _ = ref.cross_entropy_grads(xr, tr, reduction=reduction, grad_output=1.0, **opts)
    _, gx = cl.cross_entropy_value_and_grad(x, cp.asarray(tr), reduction=reduction, **opts)
    np.testing.assert_allclose(to_host(gx), gx_want, rtol=4e-7, atol=0)


# The plain class-index variant, label smoothing's, and the softcap's (MODE_CAP).
OPTION_SETS = [{}, {"label_smoothing": 0.1}, {"softcap": 20.0}]


@pytest.mark.parametrize("dtype, cols, rows", [
    (np.float32, 8193, 5),          # just past a block's registers: 2 blocks a row
    (np.float32, 20000, 7),         # 3 blocks a row, rows looping over fewer groups
    (BFLOAT16, 128256, 24),         # an LLM vocabulary: 8 blocks a row
    (np.float32, 2**21 + 5, 2),     # past every resident block's registers: streamed in tiles
])
@pytest.mark.parametrize("extra", OPTION_SETS)
def test_long_rows_split_over_blocks(dtype, cols, rows, extra):
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(cols)
    x, xr = to_device(rng.standard_normal((rows, cols)) * 4, dtype)
    tr = _targets(rng, rows, cols, 0.2)
    t = cp.asarray(tr)
    opts = dict(lse_square_scale=1e-4, **extra)
    want = ref.cross_entropy(xr, tr, **opts)
    gx_want, _ = ref.cross_entropy_grads(xr, tr, grad_output=1.0, **opts)
    per_row = ref.cross_entropy(xr, tr, reduction="none", **opts)
    assert_close(to_host(cl.cross_entropy(x, t, **opts)), want, dtype,
                 _value_scale(per_row, "mean", np.sum(tr != -100)), "forward")
    value, gx, lse = cl.cross_entropy_value_and_grad(x, t, return_lse=True, **opts)
    assert_close(to_host(value), want, dtype, _value_scale(per_row, "mean", np.sum(tr != -100)),
                 "value")
    assert_close(to_host(gx), gx_want, dtype, None, "gradient")
    assert lse.dtype == np.float32 and lse.shape == (rows,)
    assert_close(to_host(lse), ref.lse(xr, extra.get("softcap", 0.0)), np.float32, None, "lse")
    # Bitwise reproducible: the blocks' states merge in a fixed order.
    value2, gx2 = cl.cross_entropy_value_and_grad(x, t, **opts)
    assert cp.array_equal(value, value2) and cp.array_equal(gx, gx2)


def _rows_match_the_reference(dtype, cols, rows, extra, check_plan):
    """value_and_grad of random rows (extra: options, and "weights" or "prob" for class weights
    or probability targets) in one plan, which check_plan is given: value, gradient and lse
    against float64, the gradient written into the logits bitwise the same as into a new
    array.  The caller sets the knobs and an empty plan cache."""
    cp = _cupy()
    cl = _cl()
    from cupyloss.rowwise import _family as _rowwise

    rng = np.random.default_rng(cols + rows)
    x, xr = to_device(rng.standard_normal((rows, cols)) * 4, dtype)
    opts = {k: v for k, v in extra.items() if k not in ("weights", "prob")}
    w = wr = None
    if extra.get("weights"):
        w, wr = to_device(rng.uniform(0.2, 2.0, cols), dtype)
    if extra.get("prob"):
        p = rng.random((rows, cols))
        t, tr = to_device(p / p.sum(axis=1, keepdims=True), dtype)
        count = rows
    else:
        tr = _targets(rng, rows, cols, 0.2)
        t = cp.asarray(tr)
        count = np.sum([wr[y] if wr is not None else 1 for y in tr if y != -100])
    want = ref.cross_entropy(xr, tr, wr, **opts)
    per_row = ref.cross_entropy(xr, tr, wr, reduction="none", **opts)
    gx_want, _ = ref.cross_entropy_grads(xr, tr, wr, grad_output=1.0, **opts)
    value, gx, lse = cl.cross_entropy_value_and_grad(x, t, w, return_lse=True, **opts)
    (plan,) = _rowwise._PLANS.values()
    check_plan(plan)
    assert_close(to_host(value), want, dtype,
                 _value_scale(_terms(xr, per_row, wr, opts), "mean", count), "value")
    assert_close(to_host(gx), gx_want, dtype, None, "gradient")
    assert_close(to_host(lse), ref.lse(xr, opts.get("softcap", 0.0)), np.float32, None, "lse")
    if not extra.get("prob"):
        xin = x.copy()
        value2, gx2 = cl.cross_entropy_value_and_grad(xin, t, w, inplace=True, **opts)
        assert gx2 is xin and cp.array_equal(gx2, gx) and cp.array_equal(value2, value)


@pytest.mark.parametrize("dtype, cols, rows", [
    (np.float32, 4096, 300),        # 128 threads hold a row; 64 take it in two tiles
    (BFLOAT16, 16384, 40),          # a block holds it; 128 threads take it
    (np.float16, 2049 * 8 + 3, 9),  # odd length past a block's registers: unchanged (k > 1)
    (np.float32, 1000, 70),         # a warp holds it: unchanged
    (np.float64, 3001, 33),         # head, tail and double states
])
@pytest.mark.parametrize("extra", OPTION_SETS + [{"weights": True}, {"prob": True}])
def test_two_tiles_a_thread_match_the_reference(monkeypatch, dtype, cols, rows, extra):
    """ROW_GRAD_TILES 2: a gradient's team half the holding one (a warp at least) keeps one tile
    in registers and reads the other again; value, gradient and lse against float64, the
    gradient written into the logits bitwise the same as into a new array."""
    cp = _cupy()
    from cupyloss._core import launch as _launch, tuning as _tuning
    from cupyloss.rowwise import _launch as _rowwise_launch

    limits = _launch.device_limits(cp.cuda.Device().id)
    monkeypatch.setitem(_tuning._OVERRIDES, limits.gpu, {"ROW_GRAD_TILES": 2})
    _fresh_plans(monkeypatch)
    held, k = _rowwise_launch.row_team(cols, np.dtype(dtype).itemsize)

    def check_plan(plan):
        tpr = plan.main.words[plan.main.slot["tpr"]]
        assert tpr == (held if k > 1 or held <= 32 else held // 2)

    _rows_match_the_reference(dtype, cols, rows, extra, check_plan)


@pytest.mark.parametrize("dtype, cols, rows", [
    (np.float32, 40000, 300),       # 2 blocks a row, more rows than resident groups
    (BFLOAT16, 128256, 24),         # an LLM vocabulary: 2 blocks a row with 3 tiles each
    (np.float16, 100003, 3),        # odd length: head and tail elements
    (np.float64, 30000, 5),         # double states
])
@pytest.mark.parametrize("extra", OPTION_SETS)
def test_cluster_rows_match_the_cooperative_ones_bitwise(monkeypatch, dtype, cols, rows, extra):
    """The blocks sharing a row as a thread block cluster (sm_90) and as a cooperative launch
    merge their states in one order: bitwise the same value, gradient and lse."""
    cp = _cupy()
    cl = _cl()
    from cupyloss._core import launch as _launch, tuning as _tuning
    from cupyloss.rowwise import _family as _rowwise

    limits = _launch.device_limits(cp.cuda.Device().id)
    if not limits.clusters:
        pytest.skip("this GPU has no thread block clusters (sm_90 and later)")
    rng = np.random.default_rng(cols + rows)
    x, _ = to_device(rng.standard_normal((rows, cols)) * 4, dtype)
    t = cp.asarray(_targets(rng, rows, cols, 0.2))
    opts = dict(lse_square_scale=1e-4, return_lse=True, **extra)
    got = {}
    for clusters in (True, False):
        monkeypatch.setitem(_tuning._OVERRIDES, limits.gpu, {"ROW_CLUSTERS": int(clusters)})
        _fresh_plans(monkeypatch)
        got[clusters] = cl.cross_entropy_value_and_grad(x, t, **opts)
        (plan,) = _rowwise._PLANS.values()
        assert plan.main.cooperative is not clusters
    for a, b in zip(got[True], got[False]):
        assert a.dtype == b.dtype and cp.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("dtype, cols, rows, pair", [
    (BFLOAT16, 65536, 40, True),     # four tiles: a pair, not one block with three kept
    (BFLOAT16, 40000, 40, False),    # three tiles: one block with two kept
    (BFLOAT16, 152064, 20, True),    # past a pair's shared memory by one tile: read again
    (np.float32, 30003, 20, True),   # four tiles, odd length: head and tail elements
])
@pytest.mark.parametrize("extra", OPTION_SETS + [{"prob": True}])
def test_rows_a_pair_takes_match_the_reference(monkeypatch, dtype, cols, rows, pair, extra):
    """ROW_ALONE_STASH 2, ROW_PAIR_REREAD 1 (a cluster of two blocks for rows of four tiles, and
    for rows a pair holds but for a tile): value, gradient and lse against float64; the
    gradient written into the logits bitwise the same as into a new array."""
    cp = _cupy()
    from cupyloss._core import launch as _launch, tuning as _tuning

    limits = _launch.device_limits(cp.cuda.Device().id)
    if not limits.clusters:
        pytest.skip("this GPU has no thread block clusters (sm_90 and later)")
    monkeypatch.setitem(_tuning._OVERRIDES, limits.gpu, {"ROW_ALONE_STASH": 2,
                                                         "ROW_PAIR_REREAD": 1})
    _fresh_plans(monkeypatch)

    def check_plan(plan):
        k = plan.main.words[plan.main.slot["k"]]
        assert (k == 2 and not plan.main.cooperative) is pair and (k == 1) is not pair

    _rows_match_the_reference(dtype, cols, rows, extra, check_plan)


@pytest.mark.parametrize("dtype", [BFLOAT16, np.float16, np.float32])
@pytest.mark.parametrize("cols", [1000, 50257])     # a team's row; a cluster's (2 blocks)
@pytest.mark.parametrize("extra", [{}, {"label_smoothing": 0.1}, {"softcap": 100.0}])
@pytest.mark.parametrize("layout", ["contiguous", "offset"])
def test_gradients_that_reach_the_subnormals(dtype, cols, extra, layout):
    """Rows whose softmax has p below 2^-126 beside rows whose p are all normal, and gradient rows
    off 16-byte boundaries (offset): the rows the common form of the gradient's loop leaves to
    the whole one.  Against float64; the subnormal gradients kept, not flushed (plain and
    softcap); the gradient written into the logits bitwise the same as into a new array."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(cols)
    rows = 6
    cap = extra.get("softcap", 0.0)
    # The (capped) logits: most classes of rows 0, 2, 4 at -100..-88, a few near 0 setting the
    # lse, so most p are float32 subnormals; rows 1, 3, 5 normal.
    zc = rng.uniform(-100.0, -88.0, (rows, cols))
    zc[:, ::37] = rng.uniform(-1.0, 1.0, zc[:, ::37].shape)
    zc[1::2] = rng.standard_normal((rows // 2, cols)) * 3
    x64 = cap * np.arctanh(zc / cap) if cap else zc
    x, xr = to_device(x64, dtype)
    x = _layout(x, layout)
    tr = _targets(rng, rows, cols, 0.0)
    tr[1] = -100
    t = cp.asarray(tr)
    gx_want, _ = ref.cross_entropy_grads(xr, tr, reduction="sum", grad_output=1.0, **extra)
    value, gx = cl.cross_entropy_value_and_grad(x, t, reduction="sum", **extra)
    got = to_host(gx)
    assert_close(got, gx_want, dtype, None, "gradient")
    if np.dtype(dtype).itemsize > 2 or dtype == BFLOAT16:
        small = (np.abs(gx_want) < 2.0**-126) & (gx_want != 0)
        if not extra.get("label_smoothing"):
            assert np.count_nonzero(small) > cols   # the case this test is for
        np.testing.assert_allclose(got[small], gx_want[small], rtol=RTOL[np.dtype(dtype)],
                                   atol=TINY[np.dtype(dtype)])
    # In place the gradient rows share the logits' alignment: the common form where the new
    # array's rows (offset) took the whole one.
    xin = _layout(x.copy(), layout)
    value2, gx2 = cl.cross_entropy_value_and_grad(xin, t, reduction="sum", inplace=True, **extra)
    assert gx2 is xin and cp.array_equal(value2, value) and cp.array_equal(gx2, gx)


@pytest.mark.parametrize("dtype, rows, cols", [
    (np.float32, 2048, 4099),       # rows enough for a warp per row without a gradient
    (BFLOAT16, 1100, 20011),        # a warp streaming a long row in tiles
    (np.float64, 4096, 33),
])
def test_forward_with_many_rows(dtype, rows, cols):
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(rows)
    x, xr = to_device(rng.standard_normal((rows, cols)) * 3, dtype)
    tr = _targets(rng, rows, cols, 0.05)
    t = cp.asarray(tr)
    per_row = ref.cross_entropy(xr, tr, reduction="none")
    assert_close(to_host(cl.cross_entropy(x, t, reduction="none")), per_row, dtype, None, "none")
    assert_close(to_host(cl.cross_entropy(x, t)), ref.cross_entropy(xr, tr), dtype,
                 _value_scale(per_row, "mean", np.sum(tr != -100)), "mean")
    value, _, lse = cl.cross_entropy_value_and_grad(x, t, wrt=(), return_lse=True)
    assert_close(to_host(lse), ref.lse(xr), np.float32 if dtype != np.float64 else dtype, None,
                 "lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [7, 1000, 20000])
def test_inplace_writes_the_gradient_into_the_input(dtype, cols):
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(1)
    x, xr = to_device(rng.standard_normal((9, cols)), dtype)
    tr = _targets(rng, 9, cols, 0.2)
    t = cp.asarray(tr)
    want_value, want_g = cl.cross_entropy_value_and_grad(x, t, label_smoothing=0.05)
    value, g = cl.cross_entropy_value_and_grad(x, t, label_smoothing=0.05, inplace=True)
    assert g is x
    assert cp.array_equal(value, want_value) and cp.array_equal(x, want_g)
    # A view with rows off 16-byte boundaries, written where it points (its rows split into
    # head, vectors and tail elsewhere, so the sums' order, and the last bits, may differ).
    big, _ = to_device(np.concatenate([np.zeros((9, 1)), xr], axis=1), dtype)
    view = big[:, 1:]
    _, g = cl.cross_entropy_value_and_grad(view, t, label_smoothing=0.05, inplace=True)
    assert g is view and cp.all(big[:, 0] == 0)
    want, _ = ref.cross_entropy_grads(xr, tr, label_smoothing=0.05)
    assert_close(to_host(view), want, dtype, None, "in place, misaligned rows")
    # nll_loss too.
    logp = x.astype(cp.float64)
    want = cl.nll_loss_value_and_grad(logp, t)[1]
    assert cp.array_equal(cl.nll_loss_value_and_grad(logp, t, inplace=True)[1], want)


def test_inplace_refusals():
    cp = _cupy()
    cl = _cl()
    x = cp.zeros((1, 5), cp.float32)
    t = cp.zeros(4, cp.int64)
    with pytest.raises(ValueError, match="distinct in memory"):
        cl.cross_entropy_value_and_grad(cp.broadcast_to(x, (4, 5)), t, inplace=True)
    with pytest.raises(ValueError, match="wrt does not name 'input'"):
        cl.cross_entropy_value_and_grad(cp.zeros((4, 5), cp.float32), t, inplace=True, wrt=())


@pytest.mark.parametrize("check", [False, True])
def test_out_of_range_targets(check):
    cp = _cupy()
    cl = _cl()
    x = cp.asarray(np.random.default_rng(2).standard_normal((4, 6)), cp.float32)
    t = cp.asarray([0, 9, -100, 5])
    if check:
        with pytest.raises(IndexError, match="Target 9 is out of bounds."):
            cl.cross_entropy(x, t, check_targets=True)
        with pytest.raises(IndexError, match="Target -3 is out of bounds."):
            cl.nll_loss(x, cp.asarray([0, -3, 1, 2]), check_targets=True)
        cl.cross_entropy(x, cp.asarray([0, 5, -100, 1]), check_targets=True)  # in range
        return
    loss = to_host(cl.cross_entropy(x, t, reduction="none"))
    assert np.isnan(loss[1]) and np.all(np.isfinite(loss[[0, 2, 3]])) and loss[2] == 0
    _, g = cl.cross_entropy_value_and_grad(x, t, reduction="sum")
    g = to_host(g)
    assert np.all(np.isnan(g[1])) and np.all(np.isfinite(g[[0, 2, 3]])) and np.all(g[2] == 0)
    assert np.isnan(to_host(cl.cross_entropy(x, t)))          # the 'mean' divisor is NaN
    _, g = cl.nll_loss_value_and_grad(x, t, reduction="sum")
    assert np.all(np.isnan(to_host(g)[1]))


def test_all_ignored_mean_is_nan_and_gradient_zero():
    cp = _cupy()
    cl = _cl()
    x = cp.ones((5, 300), cp.float32)
    t = cp.full(5, -100)
    for name in ("cross_entropy", "nll_loss"):
        value, g = getattr(cl, name + "_value_and_grad")(x, t)
        assert np.isnan(to_host(value)) and not cp.any(g)


def test_grad_output_forms_and_strided_views():
    """A 0-d device grad_output, a per-row one that is a strided view, and a target view."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(3)
    x, xr = to_device(rng.standard_normal((40, 70)), np.float32)
    tr = _targets(rng, 80, 70, 0.1)
    t = cp.asarray(tr)[::2]
    go_rows = cp.asarray(rng.standard_normal(80), cp.float32)[1::2]
    g = cl.cross_entropy_backward(go_rows, x, t, reduction="none")
    want, _ = ref.cross_entropy_grads(xr, tr[::2], reduction="none",
                                      grad_output=to_host(go_rows))
    assert_close(to_host(g), want, np.float32, None, "per-row grad_output")
    go0 = cp.asarray(0.25, cp.float32)
    g = cl.cross_entropy_backward(go0, x, t)
    want, _ = ref.cross_entropy_grads(xr, tr[::2], grad_output=0.25)
    assert_close(to_host(g), want, np.float32, None, "0-d grad_output")
    with pytest.raises(ValueError, match="must be 0-d"):
        cl.cross_entropy_backward(go_rows, x, t)


def test_nd_layouts_that_need_copies():
    """(N, C, H, W) whose H, W dims do not merge (a transposed spatial view), for input, target
    and grad_output; results land in fresh C-contiguous arrays."""
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(4)
    x64 = rng.standard_normal((2, 5, 3, 4))
    x = cp.asarray(x64.transpose(0, 1, 3, 2).copy(), cp.float32).transpose(0, 1, 3, 2)
    stored = _targets(rng, (2, 4, 3), 5, 0.2)
    tr = stored.transpose(0, 2, 1)                    # (2, 3, 4), strides that do not merge
    t = cp.asarray(stored).transpose(0, 2, 1)
    xr = to_host(x)
    value, g = cl.cross_entropy_value_and_grad(x, t, label_smoothing=0.1)
    assert_close(to_host(value), ref.cross_entropy(xr, tr, label_smoothing=0.1), np.float32)
    want, _ = ref.cross_entropy_grads(xr, tr, label_smoothing=0.1)
    assert_close(to_host(g), want, np.float32)
    go = cp.asarray(rng.standard_normal((2, 4, 3)), cp.float32).transpose(0, 2, 1)
    g = cl.cross_entropy_backward(go, x, t, reduction="none")
    want, _ = ref.cross_entropy_grads(xr, tr, reduction="none", grad_output=to_host(go))
    assert_close(to_host(g), want, np.float32)
    with pytest.raises(ValueError, match="merge into one stride"):
        cl.cross_entropy_value_and_grad(x, t, inplace=True)


def test_argument_errors():
    cp = _cupy()
    cl = _cl()
    x = cp.zeros((4, 5), cp.float32)
    t = cp.zeros(4, cp.int64)
    with pytest.raises(ValueError, match="Expected target size \\[4\\], got \\[3\\]"):
        cl.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="weight tensor should be defined either for all 5"):
        cl.cross_entropy(x, t, cp.ones(4, cp.float32))
    with pytest.raises(TypeError, match="weight has dtype float64"):
        cl.cross_entropy(x, t, cp.ones(5, cp.float64))
    with pytest.raises(ValueError, match="label_smoothing must be between 0.0 and 1.0"):
        cl.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="is not a valid value for reduction"):
        cl.cross_entropy(x, t, reduction="batchmean")
    with pytest.raises(TypeError, match="nll_loss needs class indices"):
        cl.nll_loss(x, x)
    with pytest.raises(ValueError, match="class indices .* has no gradient"):
        cl.cross_entropy_backward(1.0, x, t, wrt="target")
    with pytest.raises(ValueError, match="probability targets must have the input's shape"):
        cl.cross_entropy(x, x[:, :4])
    with pytest.raises(ValueError, match="0-d input"):
        cl.cross_entropy(x[0, 0], t[0])


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(64, 1000), (8, 50257), (4, 21, 8, 8)])
def test_torch_tensors_match_torch(dtype, shape):
    """torch CUDA tensors in, torch tensors out, on torch's current stream; the numbers agree
    with torch's own cross_entropy on the same GPU (torch at fp32 for the 16-bit inputs)."""
    torch = _torch()
    import torch.nn.functional as F

    cl = _cl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tdtype = getattr(torch, dtype)
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(tdtype).requires_grad_()
    batch = (shape[0], *shape[2:])
    t = torch.randint(0, shape[1], batch, device="cuda", generator=gen)
    t[0] = -100
    w = torch.rand(shape[1], device="cuda", generator=gen).to(tdtype) + 0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())   # the inputs were made on that one
    with torch.cuda.stream(stream):
        value, g = cl.cross_entropy_value_and_grad(x, t, w, label_smoothing=0.1)
    stream.synchronize()
    assert isinstance(value, torch.Tensor) and isinstance(g, torch.Tensor)
    assert g.dtype == tdtype and g.shape == x.shape and not g.requires_grad
    xf = x.detach().float().requires_grad_()
    want = F.cross_entropy(xf, t, w.float(), label_smoothing=0.1)
    want.backward()
    rtol = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}[dtype]
    tiny = TINY[np.dtype(dtype) if dtype != "bfloat16" else BFLOAT16]  # subnormal spacing
    torch.testing.assert_close(value.float(), want.detach(), rtol=rtol, atol=rtol)
    torch.testing.assert_close(g.float(), xf.grad, rtol=rtol,
                               atol=rtol * xf.grad.abs().mean() + tiny)
    # The same bits as CuPy arrays give.
    cp = _cupy()
    cv, cg = cl.cross_entropy_value_and_grad(cp.from_dlpack(x.detach()), cp.from_dlpack(t),
                                             cp.from_dlpack(w), label_smoothing=0.1)
    assert cp.array_equal(cp.from_dlpack(value), cv) and cp.array_equal(cp.from_dlpack(g), cg)
    loss = cl.nll_loss(torch.log_softmax(x.detach().float(), 1), t.int(), reduction="none")
    torch.testing.assert_close(loss, F.nll_loss(torch.log_softmax(x.detach().float(), 1), t,
                                                reduction="none"))


def test_torch_inplace_and_allocator():
    torch = _torch()
    cl = _cl()
    x = torch.randn(512, 4096, device="cuda")
    t = torch.randint(0, 4096, (512,), device="cuda")
    want = cl.cross_entropy_backward(1.0, x, t)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _, g = cl.cross_entropy_value_and_grad(x, t, inplace=True)
    assert g is x and torch.equal(x, want)
    assert torch.cuda.memory_allocated() - before < x.numel() * 4 // 8  # no logits-sized array


def _jax():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    return jax


def test_jax_arrays_in_and_out():
    jax = _jax()
    import jax.numpy as jnp

    cl = _cl()
    rng = np.random.default_rng(6)
    x64 = rng.standard_normal((33, 257)).astype(np.float32)
    y = rng.integers(0, 257, 33).astype(np.int32)
    value, g = cl.cross_entropy_value_and_grad(jnp.asarray(x64), jnp.asarray(y))
    assert isinstance(value, jax.Array) and isinstance(g, jax.Array)
    assert_close(np.asarray(value, np.float64), ref.cross_entropy(x64, y), np.float32)
    want, _ = ref.cross_entropy_grads(x64, y)
    assert_close(np.asarray(g, np.float64), want, np.float32)
    with pytest.raises(ValueError, match="immutable"):
        cl.cross_entropy_value_and_grad(jnp.asarray(x64), jnp.asarray(y), inplace=True)


@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """rows x classes > 2^31 (16-bit logits, 4.3 GB and as much for the gradient): the last
    rows, past every 32-bit offset, are right."""
    cp = _cupy()
    cl = _cl()
    rows, cols = 16400, 131072 + 7
    assert rows * cols > 2**31
    x = cp.random.default_rng(0).standard_normal((rows, cols), dtype=cp.float32).astype(
        cp.float16)
    t = cp.asarray(np.random.default_rng(1).integers(0, cols, rows))
    value, g, lse = cl.cross_entropy_value_and_grad(x, t, reduction="sum", return_lse=True)
    for r in (0, rows // 2, rows - 2, rows - 1):
        xr = to_host(x[r:r + 1])
        tr = cp.asnumpy(t[r:r + 1])
        assert_close(to_host(lse[r:r + 1]), ref.lse(xr), np.float32, None, f"lse row {r}")
        want, _ = ref.cross_entropy_grads(xr, tr, reduction="sum")
        assert_close(to_host(g[r:r + 1]), want, np.float16, None, f"gradient row {r}")
    per_row = to_host(lse) - to_host(x[cp.arange(rows), t])
    assert_close(to_host(value), np.sum(per_row), np.float16, np.sum(np.abs(per_row)), "sum")
    del g
    cp.get_default_memory_pool().free_all_blocks()


def _fresh_plans(monkeypatch):
    """An empty plan cache for the rowwise family (the engine's and the module's name)."""
    from cupyloss.rowwise import _family as _rowwise

    plans = {}
    monkeypatch.setattr(_rowwise.FAMILY, "plans", plans)
    monkeypatch.setattr(_rowwise, "_PLANS", plans)
