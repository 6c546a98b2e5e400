"""Tests of the float64 row-wise references (reference_rowwise.py) on a CPU.

Three independent checks: torch's float64 values and autograd gradients (skipped without torch),
central finite differences, and invariance properties.  The GPU tests compare the kernels against
these references, so every option that switches a formula is covered here.
"""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_rowwise as ref

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

# Float64 on both sides with the same formulas up to operation order: a few ulps per term at the
# magnitudes here (logits of scale <= 5, <= 200 classes).
RTOL = 1e-10
ATOL = 1e-12

# Input shapes: 1-D (one row), (N, C), and the class axis at dim 1 with one and two trailing dims;
# C = 1 (softmax of one class) and an odd C.
SHAPES = [(7,), (1, 1), (5, 1), (4, 7), (3, 5, 4), (2, 6, 3, 2)]


def _close(got, want, what=""):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=RTOL, atol=ATOL, equal_nan=True, err_msg=what)


def _seed(key) -> int:
    """A seed from a test's parameters, the same in every process (hash() of a str is not)."""
    return zlib.crc32(repr(key).encode())


def _case(rng, shape, prob=False, ignore_frac=0.25, scale=3.0):
    """Logits, a target (indices with some ignore_index, or probabilities) and class weights."""
    x = rng.standard_normal(shape) * scale
    cols = shape[1] if len(shape) > 1 else shape[0]
    if prob:
        t = rng.random(shape)
        t = t / t.sum(axis=1 if len(shape) > 1 else 0, keepdims=True)
    else:
        t = rng.integers(0, cols, ref.batch_shape(shape))
        t = np.where(rng.random(t.shape) < ignore_frac, -100, t)
    w = rng.uniform(0.1, 2.0, cols)
    return x, t, w


def _torch_ce(x, t, w, reduction, eps, zs=0.0, cap=0.0, ignore_index=-100):
    """torch's cross_entropy (plus the z-loss and softcap composed from torch ops), its value and
    input/target gradients under a random upstream gradient."""
    tx = torch.tensor(x, requires_grad=True)
    prob = np.issubdtype(np.asarray(t).dtype, np.floating)
    tt = torch.tensor(t, requires_grad=prob) if prob else torch.tensor(t, dtype=torch.int64)
    tw = None if w is None else torch.tensor(w)
    z = cap * torch.tanh(tx / cap) if cap else tx
    loss = F.cross_entropy(z, tt, tw, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=eps)
    if zs:
        lse = torch.logsumexp(z, dim=1 if z.dim() > 1 else 0)
        if prob:
            counted = torch.ones_like(lse, dtype=torch.bool)
            divisor = torch.tensor(float(lse.numel()), dtype=torch.float64)
        else:
            counted = tt != ignore_index
            wy = (tw if tw is not None else torch.ones(x.shape[1 if x.ndim > 1 else 0],
                                                       dtype=torch.float64))
            divisor = wy[tt.clamp(min=0)][counted].sum()
        extra = torch.where(counted, zs * lse**2, torch.zeros_like(lse))
        loss = loss + (extra if reduction == "none" else
                       extra.sum() / divisor if reduction == "mean" else extra.sum())
    rng = np.random.default_rng(7)
    go = torch.tensor(rng.standard_normal(tuple(loss.shape)))
    inputs = (tx, tt) if prob else (tx,)
    grads = torch.autograd.grad(loss, inputs, go, allow_unused=True)
    return (loss.detach().numpy(), go.numpy(), grads[0].numpy(),
            grads[1].numpy() if prob else None)


@needs_torch
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_cross_entropy_indices_match_torch(shape, reduction, weighted, eps):
    rng = np.random.default_rng(_seed((shape, reduction, weighted, eps)))
    x, t, w = _case(rng, shape)
    w = w if weighted else None
    want, go, gx, _ = _torch_ce(x, t, w, reduction, eps)
    _close(ref.cross_entropy(x, t, w, reduction=reduction, label_smoothing=eps), want, "value")
    got, _ = ref.cross_entropy_grads(x, t, w, reduction=reduction, label_smoothing=eps,
                                     grad_output=go)
    _close(got, gx, "input gradient")


@needs_torch
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_cross_entropy_probabilities_match_torch(shape, reduction, weighted, eps):
    rng = np.random.default_rng(_seed((shape, reduction, weighted, eps, 1)))
    x, t, w = _case(rng, shape, prob=True)
    w = w if weighted else None
    want, go, gx, gt = _torch_ce(x, t, w, reduction, eps)
    _close(ref.cross_entropy(x, t, w, reduction=reduction, label_smoothing=eps), want, "value")
    got_x, got_t = ref.cross_entropy_grads(x, t, w, reduction=reduction, label_smoothing=eps,
                                           grad_output=go)
    _close(got_x, gx, "input gradient")
    _close(got_t, gt, "target gradient")


@needs_torch
@pytest.mark.parametrize("prob", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_z_loss_and_softcap_match_torch_composition(prob, reduction):
    """lse_square_scale adds zs * lse^2 per counted row (same 'mean' divisor); softcap caps first."""
    rng = np.random.default_rng(11)
    x, t, w = _case(rng, (6, 9), prob=prob, scale=8.0)
    opts = dict(label_smoothing=0.1, lse_square_scale=3e-2, softcap=4.0)
    want, go, gx, gt = _torch_ce(x, t, w, reduction, 0.1, zs=3e-2, cap=4.0)
    _close(ref.cross_entropy(x, t, w, reduction=reduction, **opts), want, "value")
    got_x, got_t = ref.cross_entropy_grads(x, t, w, reduction=reduction, grad_output=go, **opts)
    _close(got_x, gx, "input gradient")
    if prob:
        _close(got_t, gt, "target gradient")
    _close(ref.lse(x, 4.0), np.log(np.sum(np.exp(4.0 * np.tanh(x / 4.0)), axis=1)), "lse")


@needs_torch
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_matches_torch(shape, reduction, weighted):
    rng = np.random.default_rng(_seed((shape, reduction, weighted, 2)))
    x, t, w = _case(rng, shape)
    w = w if weighted else None
    tx = torch.tensor(x, requires_grad=True)
    loss = F.nll_loss(tx, torch.tensor(t), None if w is None else torch.tensor(w),
                      reduction=reduction)
    go = torch.tensor(rng.standard_normal(tuple(loss.shape)))
    (gx,) = torch.autograd.grad(loss, (tx,), go)
    _close(ref.nll_loss(x, t, w, reduction=reduction), loss.detach().numpy(), "value")
    _close(ref.nll_loss_grads(x, t, w, reduction=reduction, grad_output=go.numpy()),
           gx.numpy(), "input gradient")


@needs_torch
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_all_ignored_mean_is_nan_with_zero_gradient_as_torch(eps):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5))
    t = np.full(4, -100)
    want, go, gx, _ = _torch_ce(x, t, None, "mean", eps)
    assert np.isnan(want)
    assert np.isnan(ref.cross_entropy(x, t, label_smoothing=eps))
    got, _ = ref.cross_entropy_grads(x, t, label_smoothing=eps, grad_output=go)
    _close(got, gx)
    assert np.all(got == 0)
    tx = torch.tensor(x, requires_grad=True)
    loss = F.nll_loss(tx, torch.tensor(t))
    loss.backward()
    assert np.isnan(loss.item()) and np.isnan(ref.nll_loss(x, t))
    _close(ref.nll_loss_grads(x, t), tx.grad.numpy())


@needs_torch
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_special_logits_match_torch(eps, weighted):
    """-inf logits (masked classes), a NaN and a +inf row: same NaN/inf pattern as torch."""
    rng = np.random.default_rng(5)
    x, t, w = _case(rng, (6, 5), ignore_frac=0.0)
    x[0, 1] = -np.inf                      # a masked class that is not the target
    x[1, t[1]] = -np.inf                   # the target itself masked: loss inf
    x[2, :] = -np.inf                      # every class masked: NaN
    x[3, 0] = np.nan
    x[4, 2] = np.inf
    w = w if weighted else None
    if weighted:
        w[1] = 0.0                          # 0 * inf
    want, go, gx, _ = _torch_ce(x, t, w, "none", eps)
    _close(ref.cross_entropy(x, t, w, reduction="none", label_smoothing=eps), want, "value")
    got, _ = ref.cross_entropy_grads(x, t, w, reduction="none", label_smoothing=eps,
                                     grad_output=go)
    _close(got, gx, "input gradient")


@needs_torch
def test_torch_raises_for_out_of_range_targets():
    """cupyloss defines a NaN row where torch raises; check_targets mirrors torch's CPU error."""
    x = np.zeros((3, 4))
    t = np.array([0, 7, 1])
    with pytest.raises(IndexError, match="Target 7 is out of bounds."):
        F.cross_entropy(torch.tensor(x), torch.tensor(t))
    loss = ref.cross_entropy(x, t, reduction="none")
    assert np.isnan(loss[1]) and not np.isnan(loss[0]) and not np.isnan(loss[2])
    g, _ = ref.cross_entropy_grads(x, t, reduction="sum")
    assert np.all(np.isnan(g[1])) and not np.any(np.isnan(g[[0, 2]]))
    assert np.isnan(ref.cross_entropy(x, t))          # the 'mean' divisor sums a NaN weight
    assert np.all(np.isnan(ref.nll_loss_grads(x, t, reduction="sum")[1]))


@needs_torch
def test_weight_error_message_is_torchs():
    with pytest.raises(RuntimeError, match="weight tensor should be defined either for all 4 "
                                           "classes or no classes but got weight tensor of "
                                           "shape: \\[3\\]"):
        F.cross_entropy(torch.zeros(2, 4), torch.tensor([0, 1]), torch.ones(3))


def _fd(f, x, h=1e-6):
    """Central differences of the scalar f at x (float64)."""
    g = np.zeros_like(x)
    flat = x.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = f(x)
        flat[i] = old - h
        down = f(x)
        flat[i] = old
        g.reshape(-1)[i] = (up - down) / (2 * h)
    return g


@pytest.mark.parametrize("prob", [False, True])
@pytest.mark.parametrize("shape", [(4, 6), (2, 5, 3), (6,)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_match_finite_differences(prob, shape, reduction):
    rng = np.random.default_rng(_seed((prob, shape, reduction)))
    x, t, w = _case(rng, shape, prob=prob, ignore_frac=0.2)
    opts = dict(label_smoothing=0.15, lse_square_scale=0.05, softcap=3.0)
    gx, gt = ref.cross_entropy_grads(x, t, w, reduction=reduction, grad_output=1.3, **opts)
    if not prob and reduction == "mean" and np.all(t == -100):
        # Every target ignored: the mean is 0 / 0 = NaN, which has no finite differences, and
        # torch's gradient is 0.
        assert np.isnan(ref.cross_entropy(x, t, w, reduction=reduction, **opts))
        np.testing.assert_array_equal(gx, np.zeros_like(x))
        return
    fx = _fd(lambda v: 1.3 * ref.cross_entropy(v, t, w, reduction=reduction, **opts), x.copy())
    np.testing.assert_allclose(gx, fx, rtol=1e-6, atol=1e-8)
    if prob:
        ft = _fd(lambda v: 1.3 * ref.cross_entropy(x, v, w, reduction=reduction, **opts),
                 t.copy())
        np.testing.assert_allclose(gt, ft, rtol=1e-6, atol=1e-8)
    if not prob:
        gn = ref.nll_loss_grads(x, t, w, reduction=reduction, grad_output=1.3)
        fn = _fd(lambda v: 1.3 * ref.nll_loss(v, t, w, reduction=reduction), x.copy())
        np.testing.assert_allclose(gn, fn, rtol=1e-6, atol=1e-8)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shift=st.floats(-50, 50), rows=st.integers(1, 6),
       cols=st.integers(1, 40))
def test_shift_invariance_and_mean_is_sum_over_weights(seed, shift, rows, cols):
    """Adding a constant to a row's logits changes neither loss nor gradient; 'mean' is 'sum'
    over the summed weights of counted rows."""
    rng = np.random.default_rng(seed)
    x, t, w = _case(rng, (rows, cols), ignore_frac=0.3)
    a = ref.cross_entropy(x, t, w, reduction="none", label_smoothing=0.1)
    b = ref.cross_entropy(x + shift, t, w, reduction="none", label_smoothing=0.1)
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    ga, _ = ref.cross_entropy_grads(x, t, w, reduction="sum")
    gb, _ = ref.cross_entropy_grads(x + shift, t, w, reduction="sum")
    np.testing.assert_allclose(ga, gb, rtol=1e-9, atol=1e-9)
    counted = t != -100
    total = np.sum(w[t[counted]])
    mean = ref.cross_entropy(x, t, w, reduction="mean")
    if total > 0:
        np.testing.assert_allclose(mean, ref.cross_entropy(x, t, w, reduction="sum") / total,
                                   rtol=1e-12)
    else:
        assert np.isnan(mean)


def test_layout_helpers_round_trip():
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = rng.standard_normal(shape)
        rows = ref.to_rows(x)
        cols = shape[1] if len(shape) > 1 else shape[0]
        assert rows.shape == (int(np.prod(ref.batch_shape(shape), dtype=int)), cols)
        np.testing.assert_array_equal(ref.from_rows(rows, shape), x)


# --- pairwise and margin losses along the last axis -------------------------------------------

def _grads_of(loss, tensors, rng):
    go = torch.tensor(rng.standard_normal(tuple(loss.shape)))
    return go.numpy(), [g.numpy() for g in torch.autograd.grad(loss, tensors, go)]


def _leaves(*arrays):
    return [torch.tensor(a, requires_grad=True) for a in arrays]


@needs_torch
@pytest.mark.parametrize("shape", [(7,), (5, 9)])
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_triplet_margin_loss_matches_torch(shape, p, swap, reduction):
    rng = np.random.default_rng(_seed((shape, p, swap, reduction)))
    a, pos, neg = (rng.standard_normal(shape) for _ in range(3))
    opts = dict(margin=0.7, p=p, eps=1e-6, swap=swap, reduction=reduction)
    ta, tp, tn = _leaves(a, pos, neg)
    loss = F.triplet_margin_loss(ta, tp, tn, **opts)
    go, grads = _grads_of(loss, (ta, tp, tn), rng)
    _close(ref.triplet_margin_loss(a, pos, neg, **opts), loss.detach().numpy(), "value")
    for got, want in zip(ref.triplet_margin_loss_grads(a, pos, neg, grad_output=go, **opts),
                         grads):
        _close(got, want, "gradient")


@needs_torch
@pytest.mark.parametrize("p", [1, 1.5, 2, 3])
def test_triplet_margin_loss_zero_distance_matches_torch(p):
    """eps=0 and positive == anchor in some rows: d(a, p) = 0, where torch's norm backward gives
    a zero gradient (not 0/0); a zero element of a difference has sign 0."""
    rng = np.random.default_rng(_seed(("zero", p)))
    a, neg = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    pos = a + rng.standard_normal((5, 6))
    pos[:2] = a[:2]
    pos[2, :3] = a[2, :3]
    opts = dict(margin=20.0, p=p, eps=0.0, swap=True, reduction="sum")
    ta, tp, tn = _leaves(a, pos, neg)
    loss = F.triplet_margin_loss(ta, tp, tn, **opts)
    go, grads = _grads_of(loss, (ta, tp, tn), rng)
    _close(ref.triplet_margin_loss(a, pos, neg, **opts), loss.detach().numpy(), "value")
    for got, want in zip(ref.triplet_margin_loss_grads(a, pos, neg, grad_output=go, **opts),
                         grads):
        _close(got, want, "gradient")


@needs_torch
@pytest.mark.parametrize("shape", [(7,), (6, 5)])
@pytest.mark.parametrize("margin", [0.0, 0.3, -0.4])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cosine_embedding_loss_matches_torch(shape, margin, reduction):
    rng = np.random.default_rng(_seed((shape, margin, reduction)))
    x1, x2 = rng.standard_normal(shape), rng.standard_normal(shape)
    y = rng.choice([-1.0, 1.0], shape[:-1])
    t1, t2 = _leaves(x1, x2)
    loss = F.cosine_embedding_loss(t1, t2, torch.tensor(y), margin=margin, reduction=reduction)
    go, grads = _grads_of(loss, (t1, t2), rng)
    _close(ref.cosine_embedding_loss(x1, x2, y, margin, reduction), loss.detach().numpy(), "value")
    for got, want in zip(ref.cosine_embedding_loss_grads(x1, x2, y, margin, reduction, go), grads):
        _close(got, want, "gradient")


@needs_torch
@pytest.mark.parametrize("shape", [(7,), (6, 5)])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multi_margin_loss_matches_torch(shape, p, weighted, reduction):
    rng = np.random.default_rng(_seed((shape, p, weighted, reduction)))
    x = rng.standard_normal(shape)
    y = rng.integers(0, shape[-1], shape[:-1])
    w = rng.uniform(0.2, 2.0, shape[-1]) if weighted else None
    (tx,) = _leaves(x)
    loss = F.multi_margin_loss(tx, torch.tensor(y), p=p, margin=0.8,
                               weight=None if w is None else torch.tensor(w), reduction=reduction)
    go, (gx,) = _grads_of(loss, (tx,), rng)
    _close(ref.multi_margin_loss(x, y, p, 0.8, w, reduction), loss.detach().numpy(), "value")
    _close(ref.multi_margin_loss_grads(x, y, p, 0.8, w, reduction, go), gx, "gradient")


@needs_torch
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_soft_margin_loss_matches_torch(weighted, reduction):
    rng = np.random.default_rng(_seed((weighted, reduction)))
    x = rng.standard_normal((6, 5)) * 4
    t = rng.random((6, 5))                       # soft labels: the target gradient is -w x / C
    w = rng.uniform(0.2, 2.0, 5) if weighted else None
    tx, tt = _leaves(x, t)
    loss = F.multilabel_soft_margin_loss(tx, tt, None if w is None else torch.tensor(w),
                                         reduction=reduction)
    go, grads = _grads_of(loss, (tx, tt), rng)
    _close(ref.multilabel_soft_margin_loss(x, t, w, reduction), loss.detach().numpy(), "value")
    for got, want in zip(ref.multilabel_soft_margin_loss_grads(x, t, w, reduction, go), grads):
        _close(got, want, "gradient")


def _torch_jsd(x, y, beta, labels, ignore_index=-100):
    """Liger's generalised JSD composed from torch ops on log-probabilities."""
    q, p = x.exp(), y.exp()
    if beta == 0:
        terms = F.kl_div(x, y, reduction="none", log_target=True)             # P (log P - log Q)
    elif beta == 1:
        terms = F.kl_div(y, x, reduction="none", log_target=True)             # Q (log Q - log P)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        terms = beta * F.kl_div(log_m, y, reduction="none", log_target=True) + (
            1 - beta) * F.kl_div(log_m, x, reduction="none", log_target=True)
    counted = torch.ones(x.shape[0], dtype=torch.bool) if labels is None else (
        torch.tensor(labels) != ignore_index)
    return terms[counted].sum() / counted.sum()


@needs_torch
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("labels", [False, True])
def test_jsd_matches_torch_composition(beta, labels):
    rng = np.random.default_rng(_seed((beta, labels)))
    x = np.log(rng.dirichlet(np.ones(7), 6))
    y = np.log(rng.dirichlet(np.ones(7), 6))
    lab = np.where(rng.random(6) < 0.3, -100, rng.integers(0, 7, 6)) if labels else None
    if labels:
        lab[0] = 3                                  # at least one counted row
    tx, ty = _leaves(x, y)
    loss = _torch_jsd(tx, ty, beta, lab)
    go, grads = _grads_of(loss, (tx, ty), rng)
    _close(ref.jsd(x, y, beta, lab), loss.detach().numpy(), "value")
    for got, want in zip(ref.jsd_grads(x, y, beta, lab, grad_output=go), grads):
        _close(got, want, "gradient")


@pytest.mark.parametrize("name", ["triplet", "cosine", "multi_margin", "multilabel", "jsd"])
def test_pairwise_gradients_match_finite_differences(name):
    rng = np.random.default_rng(_seed(name))
    shape = (4, 6)
    if name == "triplet":
        args = [rng.standard_normal(shape) for _ in range(3)]
        opts = dict(margin=2.0, p=3, swap=True)
        f, g = ref.triplet_margin_loss, ref.triplet_margin_loss_grads
    elif name == "cosine":
        args = [rng.standard_normal(shape) for _ in range(2)] + [np.array([1.0, -1.0, -1.0, 1.0])]
        opts = dict(margin=-0.5)
        f, g = ref.cosine_embedding_loss, ref.cosine_embedding_loss_grads
    elif name == "multi_margin":
        args = [rng.standard_normal(shape), rng.integers(0, 6, 4)]
        opts = dict(p=2, margin=1.5, weight=rng.uniform(0.5, 2, 6))
        f, g = ref.multi_margin_loss, ref.multi_margin_loss_grads
    elif name == "multilabel":
        args = [rng.standard_normal(shape), rng.random(shape)]
        opts = dict(weight=rng.uniform(0.5, 2, 6))
        f, g = ref.multilabel_soft_margin_loss, ref.multilabel_soft_margin_loss_grads
    else:
        args = [np.log(rng.dirichlet(np.ones(6), 4)) for _ in range(2)]
        opts = dict(beta=0.3, shift_labels=np.array([1, -100, 2, 3]))
        f, g = ref.jsd, ref.jsd_grads
    floats = [k for k, a in enumerate(args) if np.issubdtype(np.asarray(a).dtype, np.floating)
              and np.ndim(a) == 2]
    grads = g(*args, grad_output=1.3, **opts)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for k, want in zip(floats, grads):
        def fk(v, k=k):
            a = list(args)
            a[k] = v
            return 1.3 * f(*a, **opts)
        np.testing.assert_allclose(want, _fd(fk, args[k].copy()), rtol=1e-6, atol=1e-8,
                                   err_msg=f"{name} argument {k}")
