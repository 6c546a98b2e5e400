"""GPU tests of ctc_loss against the float64 recursion in tests/reference_ctc.py, and against
torch's own CUDA CTC (float64) at sizes the reference is too slow for.

Sizes sit at the kernels' edges: 1 frame, 1 class besides the blank, empty targets, targets as
long as the input allows and one label longer (inf), repeated labels (which need the blank
between them), 2 S + 1 = 1 position and past one warp, past 1,024 positions (several a thread),
odd class counts, and lengths both from the host and on the device (int32 and int64).
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference_ctc as ref
from gpu_util import BFLOAT16, assert_close, assert_same, to_host

pytestmark = pytest.mark.gpu

FLOATS = [np.dtype(np.float32), np.dtype(np.float64)]
HALVES = [np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 is not None else [])


def _cp():
    import cupy

    return cupy


def _case(rng, steps, n, classes, smax, blank, concat, repeat=True):
    """(log_probs float64 (T, N, C), targets, input lengths, target lengths) with random lengths,
    labels never the blank, some targets repeating a label (which needs a blank between)."""
    x = rng.standard_normal((steps, n, classes))
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    il = rng.integers(0, steps + 1, n)
    il[0] = steps
    tl = rng.integers(0, smax + 1, n)
    labels = [c for c in range(classes) if c != blank]
    tg = rng.choice(labels, (n, max(smax, 1)))
    if repeat and smax > 1:
        tg[:, 1] = tg[:, 0]
    if concat:
        tg = np.concatenate([tg[b, :tl[b]] for b in range(n)]).astype(np.int64)
    return lp, tg, il, tl


def _device(values, kind):
    """A length or target array as the test's kind: a Python list, or a device array."""
    cp = _cp()
    if kind == "list":
        return values.tolist()
    return cp.asarray(values, dtype=np.int32 if kind == "int32" else np.int64)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.integers(2, 6), st.integers(0, 5),
       st.sampled_from(["none", "mean", "sum"]), st.booleans(), st.booleans(),
       st.sampled_from(["list", "int32", "int64"]), st.sampled_from(FLOATS),
       st.integers(0, 2**31))
def test_matches_the_float64_recursion(steps, n, classes, smax, reduction, concat,
                                       zero_infinity, kind, dtype, seed):
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(seed)
    blank = int(rng.integers(0, classes))
    lp, tg, il, tl = _case(rng, steps, n, classes, smax, blank, concat)
    x = cp.asarray(lp.astype(dtype))
    go = rng.uniform(0.5, 1.5, n) if reduction == "none" else 0.75
    want, want_g = ref.value_and_grad(lp.astype(dtype), tg, il, tl, blank, reduction, zero_infinity, go)
    args = (x, _device(tg, kind), _device(il, kind), _device(tl, kind), blank, reduction,
            zero_infinity)
    got = cupyloss.ctc_loss(*args)
    got2, g = cupyloss.ctc_loss_value_and_grad(
        *args, grad_output=cp.asarray(go.astype(dtype)) if reduction == "none" else go)
    gb = cupyloss.ctc_loss_backward(cp.asarray(go.astype(dtype)) if reduction == "none" else go,
                                    *args)
    assert_close(to_host(got), want, dtype, what="loss")
    assert_same(to_host(got2), to_host(got), "value_and_grad's loss")
    assert_close(to_host(g), want_g, dtype, scale=1.0, what="gradient")
    assert_same(to_host(gb), to_host(g), "backward's gradient")


def _assert_matches(got, g, want, want_g, dtype):
    """The loss and the gradient against the float64 reference's, each in its own scale."""
    assert_close(to_host(got), want, dtype, what="loss")
    assert_close(to_host(g), want_g, dtype, scale=1.0, what="gradient")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_16_bit_inputs_accumulate_in_float32(dtype):
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(3)
    lp, tg, il, tl = _case(rng, 40, 3, 7, 10, 0, False)
    rounded = lp.astype(dtype).astype(np.float64)
    want, want_g = ref.value_and_grad(rounded, tg, il, tl, reduction="none")
    got, g = cupyloss.ctc_loss_value_and_grad(cp.asarray(lp.astype(dtype)), cp.asarray(tg),
                                              cp.asarray(il), cp.asarray(tl), reduction="none")
    assert got.dtype == dtype and g.dtype == dtype
    _assert_matches(got, g, want, want_g, dtype)


def _torch_truth(lp, tg, il, tl, blank=0, reduction="mean", zero_infinity=False, go=None,
                 dtype="float64"):
    """torch's CUDA CTC in float64 (or `dtype`): (loss, gradient) for upstream go (1 or the
    (N,) array), as float64 NumPy arrays."""
    import torch

    x = torch.tensor(lp, dtype=getattr(torch, dtype), device="cuda", requires_grad=True)
    loss = torch.nn.functional.ctc_loss(x, torch.as_tensor(tg, device="cuda"),
                                        torch.as_tensor(il), torch.as_tensor(tl), blank,
                                        reduction, zero_infinity)
    up = torch.ones_like(loss) if go is None else torch.as_tensor(go, device="cuda")
    (g,) = torch.autograd.grad(loss, x, up)
    return loss.detach().double().cpu().numpy(), g.double().cpu().numpy()


# (T, N, C, S): one warp of positions, past it, past a block (2 S + 1 > 1,024: several a thread),
# many classes, and the speech shapes' small cousins.
LARGE = [(64, 5, 29, 15), (300, 3, 40, 100), (1400, 2, 12, 600), (200, 4, 1000, 60),
         (30, 3, 5000, 10)]


@pytest.mark.parametrize("shape", LARGE, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_long_targets_match_torch(shape, dtype):
    """float64 within its own rounding of torch's float64; float32 no further from torch's
    float64 than torch's own float32 kernel is (log-space sums over thousands of frames carry
    an absolute error of a few ulps of |alpha|, in both), or than float32's rounding of it."""
    import cupyloss

    cp = _cp()
    steps, n, classes, smax = shape
    rng = np.random.default_rng(steps)
    lp, tg, il, tl = _case(rng, steps, n, classes, smax, 0, False)
    il[:] = steps            # feasible everywhere: torch's CUDA gradient of an infinite loss
    tl[0] = min(smax, steps // 2)   # is not its CPU one (NaN), which cupyloss follows
    x = lp.astype(dtype)
    want, want_g = _torch_truth(x, tg, il, tl, reduction="sum")
    got, g = cupyloss.ctc_loss_value_and_grad(cp.asarray(x), cp.asarray(tg), il.tolist(),
                                              tl.tolist(), reduction="sum")
    got, g = to_host(got), to_host(g)
    if np.dtype(dtype) == np.float64:
        assert_close(got, want, dtype, what="loss")
        assert_close(g, want_g, dtype, scale=1.0, what="gradient")
        return
    theirs, theirs_g = _torch_truth(x, tg, il, tl, reduction="sum", dtype="float32")
    per = _torch_truth(x, tg, il, tl, reduction="none")[0]
    _no_further_in_norm(got, theirs, want, "loss", steps, want)
    _no_further_in_norm(g, theirs_g, want_g, "gradient", steps, per)


def _no_further_in_norm(got, theirs, truth, what, steps, magnitude):
    """The largest error of got from the float64 truth is at most twice torch's float32 one, or
    the rounding a float32 log-space recursion accumulates: a few ulps of its magnitude (the
    loss, |alpha| at the end: `magnitude`, the float64 loss compared or the sequences' losses
    behind a gradient) a step, adding up as a random walk over the steps, 2^-24 |loss| sqrt(T).  Elementwise the two float32 results cannot be ordered: each gradient
    element carries that error in a pattern set by the order of operations, the same size in
    both."""
    assert np.array_equal(np.isnan(got), np.isnan(truth)), f"{what}: NaN differ"
    ok = np.isfinite(truth)
    mine = np.max(np.abs(got - truth)[ok], initial=0.0)
    torchs = np.max(np.abs(theirs - truth)[ok], initial=0.0)
    walk = 2.0**-24 * np.max(np.abs(magnitude)) * np.sqrt(steps)
    assert mine <= max(2 * torchs, walk), (
        f"{what}: {mine} from float64, torch's float32 {torchs}, random-walk rounding {walk}")


def test_strided_log_probs_and_targets_are_read_in_place():
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(5)
    lp, tg, il, tl = _case(rng, 20, 4, 9, 6, 2, False)
    want, want_g = ref.value_and_grad(lp, tg, il, tl, 2, "none")
    batch_first = cp.asarray(np.ascontiguousarray(lp.transpose(1, 0, 2))).transpose(1, 0, 2)
    wide = cp.zeros((20, 4, 18))
    wide[:, :, ::2] = cp.asarray(lp)
    tg_t = cp.asarray(np.ascontiguousarray(tg.T)).T
    for x in (batch_first, wide[:, :, ::2]):
        got, g = cupyloss.ctc_loss_value_and_grad(x, tg_t, cp.asarray(il), cp.asarray(tl), 2,
                                                  "none")
        _assert_matches(got, g, want, want_g, np.float64)


def test_unbatched_input():
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(6)
    lp, tg, il, tl = _case(rng, 12, 1, 5, 4, 0, False)
    tl[0] = 4                 # unbatched targets are concatenated: all of them
    want, want_g = ref.value_and_grad(lp[:, 0], tg[0], il[0], tl[0], reduction="mean")
    got, g = cupyloss.ctc_loss_value_and_grad(cp.asarray(lp[:, 0]), cp.asarray(tg[0]),
                                              int(il[0]), int(tl[0]))
    assert got.shape == () and g.shape == (12, 5)
    _assert_matches(got, g, want, want_g, np.float64)


def test_infeasible_and_empty_targets():
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(7)
    lp, _, _, _ = _case(rng, 5, 4, 4, 3, 0, False)
    # 3 labels in 3 frames: feasible; repeated pair in 3 frames: needs 4 (inf); empty target;
    # no frames at all with an empty target (loss 0).
    tg = np.array([[1, 2, 3], [2, 2, 1], [1, 1, 1], [1, 1, 1]])
    il, tl = np.array([3, 3, 5, 0]), np.array([3, 3, 0, 0])
    for zero_infinity in (False, True):
        want, want_g = ref.value_and_grad(lp, tg, il, tl, reduction="none",
                                    zero_infinity=zero_infinity)
        got, g = cupyloss.ctc_loss_value_and_grad(cp.asarray(lp), cp.asarray(tg), il.tolist(),
                                                  tl.tolist(), reduction="none",
                                                  zero_infinity=zero_infinity)
        assert np.isinf(want[1]) != zero_infinity
        _assert_matches(got, g, want, want_g, np.float64)


def test_device_lengths_out_of_range_give_nan_without_a_sync():
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(8)
    lp, tg, il, tl = _case(rng, 6, 3, 4, 3, 0, False)
    bad_il = cp.asarray([7, 6, 6])           # beyond T
    bad_tl = cp.asarray([2, -1, 4])          # negative; beyond S
    got = to_host(cupyloss.ctc_loss(cp.asarray(lp), cp.asarray(tg), bad_il, cp.asarray(tl),
                                    reduction="none"))
    assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
    got = to_host(cupyloss.ctc_loss(cp.asarray(lp), cp.asarray(tg), cp.asarray(il), bad_tl,
                                    reduction="none"))
    assert not np.isnan(got[0]) and np.isnan(got[1:]).all()
    bad_tg = cp.asarray(tg).copy()
    bad_tg[2, 0] = 4                         # a class beyond C
    got, g = cupyloss.ctc_loss_value_and_grad(cp.asarray(lp), bad_tg, cp.asarray(il),
                                              cp.asarray(np.array([2, 2, 3])), reduction="none")
    assert np.isnan(to_host(got)[2]) and np.isnan(to_host(g)[:, 2]).all()
    assert not np.isnan(to_host(g)[:, :2]).any()


def test_results_are_bitwise_reproducible():
    import cupyloss

    cp = _cp()
    rng = np.random.default_rng(9)
    lp, tg, il, tl = _case(rng, 300, 6, 30, 80, 0, True)
    args = (cp.asarray(lp.astype(np.float32)), cp.asarray(tg), cp.asarray(il), cp.asarray(tl))
    first = [to_host(a) for a in cupyloss.ctc_loss_value_and_grad(*args)]
    for _ in range(3):
        again = [to_host(a) for a in cupyloss.ctc_loss_value_and_grad(*args)]
        assert_same(again[0], first[0], "loss")
        assert_same(again[1], first[1], "gradient")


# torch's errors (their wording), raised before any launch.
def _torch_error(*args, **kwargs):
    import torch

    with pytest.raises(Exception) as info:
        torch.nn.functional.ctc_loss(*args, **kwargs)
    return str(info.value).split(" (while checking")[0]


BAD = [
    ("il beyond T", dict(il=[7, 5, 4])), ("negative il", dict(il=[-1, 5, 4])),
    ("negative tl", dict(tl=[-1, 2, 3])), ("tl beyond S", dict(tl=[4, 2, 3])),
    ("blank beyond C", dict(blank=5)), ("negative blank", dict(blank=-1)),
    ("il of 2", dict(il=[6, 5])), ("tl of 2", dict(tl=[3, 2])),
    ("targets of 2", dict(tg=2)), ("concatenated short", dict(tg="short")),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_get_torchs_error(case):
    import torch

    import cupyloss

    _, change = case
    rng = np.random.default_rng(0)
    lp = torch.randn(6, 3, 5, dtype=torch.float64).log_softmax(-1)
    tg = torch.randint(1, 5, (3, 3))
    il, tl, blank = change.get("il", [6, 5, 4]), change.get("tl", [3, 2, 3]), change.get("blank", 0)
    if change.get("tg") == 2:
        tg = tg[:2]
    elif change.get("tg") == "short":
        tg = tg.reshape(-1)[:5]
    want = _torch_error(lp, tg, torch.tensor(il), torch.tensor(tl), blank)
    del rng
    with pytest.raises((ValueError, TypeError)) as info:
        cupyloss.ctc_loss(lp.cuda(), tg.cuda(), il, tl, blank)
    assert str(info.value).split(" (while checking")[0] == want


def test_cupyloss_torch_matches_torch_eager_compiled_and_in_a_graph():
    import torch

    import cupyloss.torch as CF

    rng = np.random.default_rng(11)
    lp, tg, il, tl = _case(rng, 50, 4, 20, 12, 0, False)
    il[:] = 50               # feasible (torch's CUDA gradient of an infinite loss is not NaN)
    x = torch.tensor(lp.astype(np.float32), device="cuda")
    tgt = torch.as_tensor(tg, device="cuda")
    il_d, tl_d = torch.as_tensor(il, device="cuda"), torch.as_tensor(tl, device="cuda")
    per = _torch_truth(lp.astype(np.float32), tg, il, tl, reduction="none")[0]
    for reduction in ("mean", "sum", "none"):
        go = np.linspace(0.5, 1.5, 4) if reduction == "none" else None
        want, want_g = _torch_truth(lp.astype(np.float32), tg, il, tl, reduction=reduction,
                                    go=go)
        theirs, theirs_g = _torch_truth(lp.astype(np.float32), tg, il, tl,
                                        reduction=reduction, go=go, dtype="float32")
        up = (torch.linspace(0.5, 1.5, 4, device="cuda") if reduction == "none"
              else torch.ones((), device="cuda"))
        for way in ("eager", "module", "compiled"):
            leaf = x.clone().requires_grad_()
            if way == "eager":
                loss = CF.ctc_loss(leaf, tgt, il.tolist(), tl.tolist(), reduction=reduction)
            elif way == "module":
                loss = CF.CTCLoss(reduction=reduction)(leaf, tgt, il_d, tl_d)
            else:
                f = torch.compile(lambda a: CF.ctc_loss(a, tgt, il_d, tl_d, reduction=reduction),
                                  fullgraph=True)
                loss = f(leaf)
            loss.backward(up)
            what = f"{way} {reduction}"
            _no_further_in_norm(loss.detach().double().cpu().numpy(), theirs, want, what, 50,
                                want)
            _no_further_in_norm(leaf.grad.double().cpu().numpy(), theirs_g, want_g, what, 50,
                                per)
    # a CUDA graph: lengths on the device (host ones are copied in, which capture refuses)
    leaf = x.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            leaf.grad = None
            CF.ctc_loss(leaf, tgt, il_d, tl_d).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    leaf.grad = None
    with torch.cuda.graph(graph):
        loss = CF.ctc_loss(leaf, tgt, il_d, tl_d)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    want, want_g = _torch_truth(lp.astype(np.float32), tg, il, tl)
    theirs, theirs_g = _torch_truth(lp.astype(np.float32), tg, il, tl, dtype="float32")
    _no_further_in_norm(loss.detach().double().cpu().numpy(), theirs, want, "graph", 50, want)
    _no_further_in_norm(leaf.grad.double().cpu().numpy(), theirs_g, want_g, "graph", 50, per)


def test_jax_forms_match_torch_and_optax():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import cupyloss.jax as JL

    rng = np.random.default_rng(12)
    lp, tg, il, tl = _case(rng, 30, 3, 8, 6, 0, False)
    il[:] = 30
    want, want_g = _torch_truth(lp.astype(np.float32), tg, il, tl)
    f = jax.jit(jax.value_and_grad(lambda a: JL.ctc_loss(a, jnp.asarray(tg, jnp.int32),
                                                         jnp.asarray(il, jnp.int32),
                                                         jnp.asarray(tl, jnp.int32))))
    got, g = f(jnp.asarray(lp.astype(np.float32)))
    assert_close(np.asarray(got, np.float64), want, np.float32, scale=10, what="jax loss")
    assert_close(np.asarray(g, np.float64), want_g, np.float32, scale=1, what="jax gradient")
    z = rng.standard_normal((3, 30, 8)).astype(np.float32)
    logits = jnp.asarray(z)
    pad = jnp.asarray((np.arange(30)[None] >= il[:, None]).astype(np.float32))
    lpad = jnp.asarray((np.arange(tg.shape[1])[None] >= tl[:, None]).astype(np.float32))
    labels = jnp.asarray(tg, jnp.int32)

    def mean_of(loss_fn):
        return jax.jit(jax.value_and_grad(lambda a: loss_fn(a, pad, labels, lpad).mean()))

    ours, og = mean_of(JL.optax_ctc_loss)(logits)
    theirs, tg_ = mean_of(optax.ctc_loss)(logits)
    # the truth: torch's float64 CTC of log_softmax(logits), its gradient through log_softmax
    import torch

    x = torch.tensor(z, dtype=torch.float64, device="cuda", requires_grad=True)
    per = torch.nn.functional.ctc_loss(x.log_softmax(-1).transpose(0, 1),
                                       torch.as_tensor(tg, device="cuda"), torch.as_tensor(il),
                                       torch.as_tensor(tl), reduction="none")
    (per.sum() / 3).backward()
    per = per.detach().cpu().numpy()
    want, want_g = np.asarray(per.mean()), x.grad.cpu().numpy()
    _no_further_in_norm(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), want,
                        "optax_ctc_loss", 30, want)
    _no_further_in_norm(np.asarray(og, np.float64), np.asarray(tg_, np.float64), want_g,
                        "optax_ctc_loss gradient", 30, per)
