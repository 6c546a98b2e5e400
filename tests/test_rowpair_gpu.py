"""GPU tests of the row-pair losses (triplet_margin_loss, cosine_embedding_loss) against
tests/reference_rowwise.py.

Row lengths are chosen at the kernel's edges: 1 and 7 (head and tail scalars only), one 16-byte
chunk short of and past a team's registers (8 threads x 8 chunks = 256 float32 / 512 16-bit
elements), the block's (256 x 8 chunks = 8192 float32, KernelBench 99's rows) and past it (the
block streams the row twice).  Rows whose hinge lies within rounding of its kink (or, with swap,
whose two negative distances tie within rounding) take either side's gradient legitimately: their
gradients are not compared.
"""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference_rowwise as ref
from gpu_util import (
    assert_close, BFLOAT16, cupy_module as _cupy, cupyloss_module as _cl, DTYPES, RTOL,
    to_device, to_host)

pytestmark = pytest.mark.gpu

COLS = (1, 7, 33, 255, 256, 257, 511, 513, 1000, 2049, 8191, 8192, 8195, 16389)
ROWS = (1, 2, 3, 33, 129)


def _layout(dev, kind):
    """The same values contiguous, with rows starting off 16-byte boundaries, with the last axis
    strided (a transposed copy), or every other element of a wider array."""
    cp = _cupy()
    if kind == "offset":
        big = cp.zeros(dev.shape[:-1] + (dev.shape[-1] + 1,), dev.dtype)
        big[..., 1:] = dev
        return big[..., 1:]
    if kind == "transposed" and dev.ndim == 2:
        return cp.ascontiguousarray(dev.T).T
    if kind == "step2":
        big = cp.zeros(dev.shape[:-1] + (2 * dev.shape[-1],), dev.dtype)
        big[..., ::2] = dev
        return big[..., ::2]
    return dev


def _norm(v, p):
    return np.sum(np.abs(v) ** p, axis=-1) ** (1.0 / p)


def _triplet_rows(a, pos, neg, opts):
    """(per-row size of the terms the loss is formed from, rows whose gradient is ambiguous)."""
    p, eps = opts["p"], opts["eps"]
    d_ap, d_an, d_pn = (_norm(x - y + eps, p) for x, y in ((a, pos), (a, neg), (pos, neg)))
    d_neg = np.minimum(d_an, d_pn) if opts["swap"] else d_an
    terms = opts["margin"] + d_ap + d_an + (d_pn if opts["swap"] else 0)
    return terms, d_ap, d_neg, d_an, d_pn


def _ambiguous(z, terms, dtype, ties=None):
    near = np.abs(z) <= 100 * RTOL[np.dtype(dtype)] * terms
    if ties is not None:
        near |= np.abs(ties) <= 100 * RTOL[np.dtype(dtype)] * terms
    return near


def _masked(g, rows_mask):
    g = np.array(g, np.float64)
    g[rows_mask] = 0.0
    return g


@st.composite
def _cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    name = draw(st.sampled_from(["triplet_margin_loss", "triplet_margin_loss",
                                 "cosine_embedding_loss"]))
    cols = draw(st.sampled_from(COLS))
    shape_kind = draw(st.sampled_from(["2d", "2d", "2d", "1d"] +
                                      (["3d"] if name == "triplet_margin_loss" else [])))
    if shape_kind == "1d":
        shape = (cols,)
    elif shape_kind == "3d":
        shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), min(cols, 300))
    else:
        shape = (max(1, min(draw(st.sampled_from(ROWS)), 2_000_000 // cols)), cols)
    if name == "triplet_margin_loss":
        opts = dict(margin=draw(st.sampled_from([1.0, 0.2, 5.0])),
                    p=draw(st.sampled_from([2.0, 2.0, 1.0, 3.0, 1.5])),
                    eps=draw(st.sampled_from([1e-6, 0.0, 0.1])), swap=draw(st.booleans()))
    else:
        opts = dict(margin=draw(st.sampled_from([0.0, 0.3, -0.4])))
    layouts = ["contiguous", "contiguous", "offset", "step2"] + (
        ["transposed"] if len(shape) == 2 else [])
    return dict(dtype=dtype, name=name, shape=shape, opts=opts,
                reduction=draw(st.sampled_from(["none", "mean", "sum"])),
                layouts=[draw(st.sampled_from(layouts)) for _ in range(3)],
                target=draw(st.sampled_from(["int64", "int32", "float"])),
                go_kind=draw(st.sampled_from(["host", "device"])),
                seed=draw(st.integers(0, 2**32 - 1)))


def _arrays(case, rng):
    """(device arrays in the loss's order, their float64 values, per-row terms, ambiguous rows)."""
    cp = _cupy()
    dtype, shape, opts = case["dtype"], case["shape"], case["opts"]
    rows = shape[:-1]
    if case["name"] == "triplet_margin_loss":
        a = rng.standard_normal(shape)
        spread = np.where(rng.random(rows + (1,)) < 0.5, 0.3, 1.0)
        host = [a, a + 0.7 * rng.standard_normal(shape), a + spread * rng.standard_normal(shape)]
        dev = [to_device(h, dtype) for h in host]
        vals = [v for _, v in dev]
        terms, d_ap, d_neg, d_an, d_pn = _triplet_rows(*vals, opts)
        amb = _ambiguous(opts["margin"] + d_ap - d_neg, terms, dtype,
                         d_an - d_pn if opts["swap"] else None)
        arrays = [_layout(d, k) for (d, _), k in zip(dev, case["layouts"])]
        return arrays, vals, terms, amb
    x1 = rng.standard_normal(shape)
    x2 = np.where(rng.random(rows + (1,)) < 0.3, x1, 0) + rng.standard_normal(shape)
    dev = [to_device(h, dtype) for h in (x1, x2)]
    v1, v2 = (v for _, v in dev)
    y = rng.choice([1, -1, -1, 0], rows)
    if case["target"] == "float":
        t, y = to_device(y, dtype)
    else:
        t = cp.asarray(y.astype(case["target"]))
    m1, m2 = np.sum(v1 * v1, -1) + 1e-12, np.sum(v2 * v2, -1) + 1e-12
    cos = np.sum(v1 * v2, -1) / np.sqrt(m1 * m2)
    terms = 1.0 + np.abs(cos) + abs(opts["margin"])
    amb = (y == -1) & _ambiguous(cos - opts["margin"], terms, dtype)
    arrays = [_layout(d, k) for (d, _), k in zip(dev, case["layouts"])] + [t]
    return arrays, [v1, v2, y], terms, amb


def _refs(name):
    if name == "triplet_margin_loss":
        return ref.triplet_margin_loss, ref.triplet_margin_loss_grads
    return ref.cosine_embedding_loss, ref.cosine_embedding_loss_grads


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_cases())
def test_against_reference(case):
    """value, backward and value_and_grad of every dtype, option, layout and reduction."""
    cl = _cl()
    rng = np.random.default_rng(case["seed"])
    dtype, name, shape, opts = case["dtype"], case["name"], case["shape"], case["opts"]
    reduction = case["reduction"]
    arrays, vals, terms, amb = _arrays(case, rng)
    f, grads_of = _refs(name)
    rows = shape[:-1]
    if reduction == "none" and rows != ():
        go, gor = to_device(rng.standard_normal(rows), dtype)
    elif case["go_kind"] == "device":
        go, gor = to_device(np.float64(0.75), dtype)
    else:
        go, gor = 0.75, 0.75
    want = f(*vals, reduction=reduction, **opts)
    per_row = np.asarray(f(*vals, reduction="none", **opts))
    vscale = np.sum(terms) / (max(per_row.size, 1) if reduction == "mean" else 1)
    label = f"{name} {case}"
    got = getattr(cl, name)(*arrays, reduction=reduction, **opts)
    assert got.dtype == dtype and got.shape == np.shape(want)
    scale = vscale if reduction != "none" else terms
    assert_close(to_host(got), want, dtype, scale, "value " + label)
    g_want = grads_of(*vals, reduction=reduction, grad_output=gor, **opts)
    back = getattr(cl, name + "_backward")(go, *arrays, reduction=reduction, **opts)
    value, both = getattr(cl, name + "_value_and_grad")(*arrays, reduction=reduction,
                                                         grad_output=go, **opts)
    assert_close(to_host(value), want, dtype, scale, "value_and_grad value " + label)
    if reduction == "none":  # the same team adds the same elements in the same order
        assert bool((value == got).all()), label
    amb_rows = np.broadcast_to(amb, rows)
    # The magnitude each gradient is formed from: its own, except a triplet gradient that is a
    # difference of two unit directions, which cancels when they agree (e.g. D = 1): the
    # anchor's (u_an - u_ap; the positive's and the negative's terms) and, with swap, the
    # positive's (u_pn - u_ap; the anchor's and the negative's).
    gscales = [np.mean(np.abs(w)) if w.size else 0.0 for w in g_want]
    if name == "triplet_margin_loss":
        gscales[0] = max(gscales[0], gscales[1] + gscales[2])
        if opts.get("swap"):
            gscales[1] = max(gscales[1], gscales[0] + gscales[2])
    else:
        # d cos / d x1 = x2 / (n1 n2) - cos x1 / n1^2 cancels where x1 and x2 are parallel
        # (e.g. D = 1): each element rounds relative to the two terms' sizes (times |g|).
        v1, v2 = (np.asarray(v, np.float64) for v in vals[:2])
        n1 = np.sqrt(np.sum(v1 * v1, -1, keepdims=True) + 1e-12)
        n2 = np.sqrt(np.sum(v2 * v2, -1, keepdims=True) + 1e-12)
        g_rows = np.abs(np.broadcast_to(gor, rows)) / (
            max(int(np.prod(rows)), 1) if reduction == "mean" else 1)
        g_rows = np.asarray(g_rows)[..., None]
        gscales = [g_rows * (np.abs(v2) / (n1 * n2) + np.abs(v1) / (n1 * n1)),
                   g_rows * (np.abs(v1) / (n1 * n2) + np.abs(v2) / (n2 * n2))]
    for what, grads in (("backward", back), ("value_and_grad", both)):
        assert len(grads) == len(g_want)
        for k, (g, w) in enumerate(zip(grads, g_want)):
            assert g.shape == shape and g.dtype == dtype and g.flags.c_contiguous
            gscale = gscales[k]
            assert_close(_masked(to_host(g), amb_rows), _masked(w, amb_rows), dtype, gscale,
                         f"{what} gradient {k} {label}")
    for g1, g2 in zip(back, both):
        assert bool((g1 == g2).all()), f"backward and value_and_grad differ: {label}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["triplet_margin_loss", "cosine_embedding_loss"])
def test_deterministic_and_one_pass_equals_two(dtype, name):
    """Many blocks (a 0-d loss through partials and the last-block ticket): repeated calls are
    bitwise equal; value_and_grad's gradients are bitwise backward's, its 'none' loss the
    loss's."""
    cl = _cl()
    rng = np.random.default_rng(7)
    case = dict(dtype=dtype, name=name, shape=(3001, 257), layouts=["contiguous"] * 3,
                target="int64", opts=dict(margin=0.5, p=2.0, eps=1e-6, swap=True)
                if name == "triplet_margin_loss" else dict(margin=0.1))
    arrays, *_ = _arrays(case, rng)
    opts = case["opts"]
    first = getattr(cl, name + "_value_and_grad")(*arrays, reduction="mean", **opts)
    for _ in range(3):
        again = getattr(cl, name + "_value_and_grad")(*arrays, reduction="mean", **opts)
        assert bool(again[0] == first[0])
        assert all(bool((a == b).all()) for a, b in zip(again[1], first[1]))
        assert bool(getattr(cl, name)(*arrays, reduction="sum", **opts)
                    == getattr(cl, name)(*arrays, reduction="sum", **opts))
    back = getattr(cl, name + "_backward")(1.0, *arrays, reduction="mean", **opts)
    assert all(bool((a == b).all()) for a, b in zip(back, first[1]))
    loss = getattr(cl, name)(*arrays, reduction="none", **opts)
    value, _ = getattr(cl, name + "_value_and_grad")(*arrays, reduction="none", **opts)
    assert bool((loss == value).all())


@pytest.mark.parametrize("name, cols, layout, opts", [
    # the fast path (p = 2, no swap) on KernelBench 99's row length, rows 16-byte aligned
    ("triplet_margin_loss", 8192, "contiguous", dict(margin=1.0, p=2.0, eps=1e-6, swap=False)),
    # the general path, rows off 16-byte boundaries (head and tail elements), two tiles and a
    # part of a third
    ("triplet_margin_loss", 8195, "offset", dict(margin=0.5, p=1.5, eps=1e-6, swap=True)),
    ("cosine_embedding_loss", 8192, "contiguous", dict(margin=0.1)),
    ("cosine_embedding_loss", 12289, "offset", dict(margin=-0.2)),
])
def test_wide_loss_alone(name, cols, layout, opts):
    """The loss alone of many long float32 rows (rowpair_rows' wide form and rowpair_finish):
    every reduction against the float64 reference, its rows bitwise value_and_grad's, its 0-d
    loss within a rounding of value_and_grad's, and bitwise repeatable."""
    cp = _cupy()
    cl = _cl()
    from cupyloss._core import launch as _launch, tuning as _tuning
    from cupyloss.rowpair import _launch as _rowpair_launch

    limits = _launch.device_limits(cp.cuda.Device().id)
    rows = _tuning.value("PAIR_WIDE_GROUPS", limits.gpu) * limits.sm_count + 3   # past the threshold, not a multiple
    assert _rowpair_launch.pair_wide(rows, cols, 4, False, limits)
    assert not _rowpair_launch.pair_wide(rows, cols, 4, True, limits)
    case = dict(dtype=np.dtype(np.float32), name=name, shape=(rows, cols),
                layouts=[layout] * 3, target="int64", opts=opts)
    arrays, vals, terms, _ = _arrays(case, np.random.default_rng(cols))
    f, _ = _refs(name)
    loss = getattr(cl, name)
    for reduction in ("none", "sum", "mean"):
        want = f(*vals, reduction=reduction, **opts)
        got = loss(*arrays, reduction=reduction, **opts)
        scale = terms if reduction == "none" else np.sum(terms) / (
            rows if reduction == "mean" else 1)
        assert_close(to_host(got), want, np.float32, scale, f"{reduction} {name} {cols}")
        assert bool((loss(*arrays, reduction=reduction, **opts) == got).all())
    both = getattr(cl, name + "_value_and_grad")
    rows_vg, _ = both(*arrays, reduction="none", **opts)
    assert bool((loss(*arrays, reduction="none", **opts) == rows_vg).all())
    for reduction in ("sum", "mean"):
        alone = float(to_host(loss(*arrays, reduction=reduction, **opts)))
        value = float(to_host(both(*arrays, reduction=reduction, **opts)[0]))
        # both add the same float32 rows' losses in double; each rounds once to float32
        assert abs(alone - value) <= np.spacing(np.float32(abs(value))), (alone, value)
    del arrays, rows_vg
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("name", ["triplet_margin_loss", "cosine_embedding_loss"])
def test_wrt_writes_only_what_it_names(name):
    cl = _cl()
    rng = np.random.default_rng(3)
    case = dict(dtype=np.dtype(np.float32), name=name, shape=(65, 513),
                layouts=["contiguous"] * 3, target="int32",
                opts=dict(margin=1.0, p=2.0, eps=1e-6, swap=False)
                if name == "triplet_margin_loss" else dict(margin=0.0))
    arrays, *_ = _arrays(case, rng)
    _, every = getattr(cl, name + "_value_and_grad")(*arrays, **case["opts"])
    first = "anchor" if name == "triplet_margin_loss" else "input1"
    last = "negative" if name == "triplet_margin_loss" else "input2"
    _, g = getattr(cl, name + "_value_and_grad")(*arrays, wrt=last, **case["opts"])
    assert bool((g == every[-1]).all())
    (g,) = getattr(cl, name + "_backward")(1.0, *arrays, wrt=(first,), **case["opts"])
    assert bool((g == every[0]).all())
    bad = "target" if name == "cosine_embedding_loss" else "input"
    with pytest.raises(ValueError, match=f"wrt names '{bad}'"):
        getattr(cl, name + "_backward")(1.0, *arrays, wrt=bad)


@pytest.mark.parametrize("name", ["triplet_margin_loss", "cosine_embedding_loss"])
def test_empty_batches_and_empty_rows(name):
    """N = 0: 'mean' is NaN, 'sum' 0, gradients empty; D = 0: the loss of empty rows."""
    cp = _cupy()
    cl = _cl()
    opts = dict(margin=0.5) if name == "triplet_margin_loss" else {}
    for shape in ((0, 5), (4, 0)):
        xs = [cp.zeros(shape, cp.float32) for _ in range(3 if name == "triplet_margin_loss"
                                                         else 2)]
        if name == "cosine_embedding_loss":
            xs.append(cp.ones(shape[0], cp.int64))
        vals = [cp.asnumpy(a).astype(np.float64) for a in xs]
        f, grads_of = _refs(name)
        for reduction in ("none", "mean", "sum"):
            got = getattr(cl, name)(*xs, reduction=reduction, **opts)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # the mean of no rows
                want = f(*vals, reduction=reduction, **opts)
            assert_close(to_host(got), want, np.float32, None, f"{shape} {reduction}")
            _, grads = getattr(cl, name + "_value_and_grad")(*xs, reduction=reduction, **opts)
            for g in grads:
                assert g.shape == shape and (g.size == 0 or not bool(g.any()))


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    cl = _cl()
    cp = _cupy()
    rng = np.random.default_rng(5)
    a, p, n = (torch.tensor(rng.standard_normal((33, 1000)), device="cuda").float()
               for _ in range(3))
    loss, (ga, gp, gn) = cl.triplet_margin_loss_value_and_grad(a, p, n, swap=True)
    assert isinstance(loss, torch.Tensor) and isinstance(ga, torch.Tensor)
    want, wgrads = cl.triplet_margin_loss_value_and_grad(*(cp.from_dlpack(t) for t in (a, p, n)),
                                                         swap=True)
    assert bool(cp.from_dlpack(loss) == want)
    assert all(bool((cp.from_dlpack(g) == w).all()) for g, w in zip((ga, gp, gn), wgrads))
    leaves = [t.double().requires_grad_() for t in (a, p, n)]
    torch.nn.functional.triplet_margin_loss(*leaves, swap=True).backward()
    for g, leaf in zip((ga, gp, gn), leaves):
        assert_close(g.double().cpu().numpy(), leaf.grad.cpu().numpy(), np.float32, None,
                     "torch autograd")
    x1, x2 = a, p
    y = torch.tensor(rng.choice([1, -1], 33), device="cuda")
    got = cl.cosine_embedding_loss(x1, x2, y, margin=0.2, reduction="none")
    want = torch.nn.functional.cosine_embedding_loss(x1.double(), x2.double(), y, margin=0.2,
                                                     reduction="none")
    assert_close(got.double().cpu().numpy(), want.cpu().numpy(), np.float32, 1.0, "cosine")


def test_inputs_are_never_written():
    cp = _cupy()
    cl = _cl()
    rng = np.random.default_rng(11)
    a, p, n = (cp.asarray(rng.standard_normal((17, 300)), cp.float16) for _ in range(3))
    copies = [x.copy() for x in (a, p, n)]
    cl.triplet_margin_loss_value_and_grad(a, p, n, reduction="none",
                                          grad_output=cp.ones(17, cp.float16))
    cl.triplet_margin_loss_backward(2.0, a, p, n)
    assert all(bool((x == c).all()) for x, c in zip((a, p, n), copies))


def test_errors_before_any_launch():
    cp = _cupy()
    cl = _cl()
    a = cp.ones((4, 8), cp.float32)
    with pytest.raises(TypeError, match="anchor has dtype float32 but negative has dtype float16"):
        cl.triplet_margin_loss(a, a, a.astype(cp.float16))
    with pytest.raises(ValueError, match="margin must be greater than 0"):
        cl.triplet_margin_loss(a, a, a, margin=0.0)
    with pytest.raises(ValueError, match="same number of dimensions"):
        cl.triplet_margin_loss(a, a, a[0])
    with pytest.raises(TypeError, match="target has dtype float16; cosine_embedding_loss takes "
                                        "int32, int64 or the inputs' dtype float32"):
        cl.cosine_embedding_loss(a, a, cp.ones(4, cp.float16))
    with pytest.raises(ValueError, match="1D target tensor expects 2D input tensors"):
        cl.cosine_embedding_loss(a[0], a[0], cp.ones(4, cp.int64))
    with pytest.raises(ValueError, match="'avg' is not a valid value for reduction"):
        cl.cosine_embedding_loss(a, a, cp.ones(4, cp.int64), reduction="avg")
    with pytest.raises(ValueError, match="grad_output shape"):
        cl.triplet_margin_loss_backward(cp.ones(3, cp.float32), a, a, a, reduction="none")


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=str)
def test_kernelbench_99_shape_rows(dtype):
    """KernelBench 99's row length (8192, one block's registers for float32) on a few rows."""
    cl = _cl()
    rng = np.random.default_rng(99)
    case = dict(dtype=np.dtype(dtype), name="triplet_margin_loss", shape=(300, 8192),
                layouts=["contiguous"] * 3, target="int64",
                opts=dict(margin=1.0, p=2.0, eps=1e-6, swap=False))
    arrays, vals, terms, amb = _arrays(case, rng)
    value, grads = cl.triplet_margin_loss_value_and_grad(*arrays, **case["opts"])
    assert_close(to_host(value), ref.triplet_margin_loss(*vals, **case["opts"]), dtype,
                 np.mean(terms), "value")
    for k, (g, w) in enumerate(zip(grads, ref.triplet_margin_loss_grads(*vals, **case["opts"]))):
        assert_close(_masked(to_host(g), amb), _masked(w, amb), dtype, np.mean(np.abs(w)),
                     f"gradient {k}")


@pytest.mark.slow
def test_more_than_2_to_the_31_elements():
    """rows x D > 2^31 (float16, 3 x 4.3 GB in, as much out): the last rows, past every 32-bit
    offset, are right."""
    cp = _cupy()
    cl = _cl()
    rows, cols = 262_200, 8192 + 8
    assert rows * cols > 2**31
    gen = cp.random.default_rng(0)
    a = gen.standard_normal((rows, cols), dtype=cp.float32).astype(cp.float16)
    p = (a + gen.standard_normal((rows, cols), dtype=cp.float32).astype(cp.float16))
    n = (a + gen.standard_normal((rows, cols), dtype=cp.float32).astype(cp.float16))
    loss, grads = cl.triplet_margin_loss_value_and_grad(a, p, n, reduction="none", margin=50.0)
    for r in (0, rows // 2, rows - 2, rows - 1):
        vals = [to_host(x[r:r + 1]) for x in (a, p, n)]
        assert_close(to_host(loss[r:r + 1]), ref.triplet_margin_loss(*vals, margin=50.0,
                                                                     reduction="none"),
                     np.float16, None, f"loss row {r}")
        want = ref.triplet_margin_loss_grads(*vals, margin=50.0, reduction="sum")
        for k, (g, w) in enumerate(zip(grads, want)):
            assert_close(to_host(g[r:r + 1]), w, np.float16, None, f"gradient {k} row {r}")
    del grads, loss, a, p, n
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.slow
def test_wide_loss_alone_past_2_to_the_31_elements():
    """The loss alone in the wide form (float32, 3 x 8.6 GB): the last rows, past every 32-bit
    offset, are right, and the 0-d sum is the rows' sum."""
    cp = _cupy()
    cl = _cl()
    from cupyloss._core import launch as _launch
    from cupyloss.rowpair import _launch as _rowpair_launch

    rows, cols = 262_200, 8200
    assert rows * cols > 2**31
    assert _rowpair_launch.pair_wide(rows, cols, 4, False, _launch.device_limits(cp.cuda.Device().id))
    gen = cp.random.default_rng(1)
    a = gen.standard_normal((rows, cols), dtype=cp.float32)
    p = a + gen.standard_normal((rows, cols), dtype=cp.float32)
    n = a + gen.standard_normal((rows, cols), dtype=cp.float32)
    loss = cl.triplet_margin_loss(a, p, n, reduction="none", margin=50.0)
    total = cl.triplet_margin_loss(a, p, n, reduction="sum", margin=50.0)
    for r in (0, rows // 2, rows - 2, rows - 1):
        vals = [to_host(x[r:r + 1]) for x in (a, p, n)]
        assert_close(to_host(loss[r:r + 1]), ref.triplet_margin_loss(*vals, margin=50.0,
                                                                     reduction="none"),
                     np.float32, None, f"loss row {r}")
    rows_sum = float(cp.sum(loss.astype(cp.float64)))
    assert_close(to_host(total), rows_sum, np.float32, rows_sum, "sum of the rows")
    del loss, total, a, p, n
    cp.get_default_memory_pool().free_all_blocks()
