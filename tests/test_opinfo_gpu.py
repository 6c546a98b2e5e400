"""torch's own samples of each loss (the OpInfo entries of torch's test suite,
torch.testing._internal.common_methods_invocations.op_db, which needs the `expecttest` package) on
CUDA tensors: cupyloss.torch's value and gradients against torch's, for every dtype both support.
float32 and float64 are held to torch.testing.assert_close's tolerances, and where a reduction
cancels (a sum of large terms of both signs, whose float32 sums in two orders differ by more than
those tolerances) to the rule of 16-bit results.  A 16-bit result is held to the float64 result
of the same (rounded) inputs: cupyloss accumulates in float32 and rounds once, torch's kernels
round some intermediates to 16 bits, so the two differ by an ulp here and there; cupyloss's may
be no further from float64 than torch's own, or than a rounding of it in its dtype.

These are the cases torch tests itself on: 0-d and 1-d inputs, every reduction, the legacy
size_average/reduce arguments, class weights, ignore_index, label smoothing, probability targets.
"""

import functools

import pytest

from cupyloss._core.registry import all_losses

pytestmark = pytest.mark.gpu

_FLOATS = ("float16", "bfloat16", "float32", "float64")


@functools.lru_cache(maxsize=None)
def _op_db():
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as exc:  # torch's test suite needs expecttest
        pytest.skip(f"torch's OpInfo samples are not importable here ({exc})")
    return {op.name: op for op in op_db if op.variant_test_name == ""}


def _leaves(sample, dtype=None):
    """(input, args, kwargs) of a sample with fresh floating leaves that require grad (cast to
    dtype if given), and the leaves."""
    import torch

    leaves = []

    def fresh(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            grad = a.requires_grad
            a = a.detach().clone() if dtype is None else a.detach().to(dtype)
            if grad:
                a.requires_grad_(True)
                leaves.append(a)
        return a

    inp = fresh(sample.input)
    args = tuple(fresh(a) for a in sample.args)
    kwargs = {k: fresh(v) for k, v in sample.kwargs.items()}
    return inp, args, kwargs, leaves


@pytest.mark.parametrize("name", sorted(all_losses()))
def test_torchs_samples(name):
    torch = pytest.importorskip("torch")
    op = _op_db().get(f"nn.functional.{name}")
    if op is None:
        pytest.skip(f"torch has no OpInfo for {name}")
    dtypes = [d for d in op.supported_dtypes("cuda") if str(d).removeprefix("torch.") in _FLOATS]
    import cupyloss.torch

    ours = getattr(cupyloss.torch, name)
    checked = 0
    for dtype in dtypes:
        for sample in op.sample_inputs("cuda", dtype, requires_grad=True):
            wide = dtype in (torch.float32, torch.float64)
            runs = [_run(op.op, sample), _run(ours, sample), _run(op.op, sample, torch.float64)]
            (want, gw), (got, gg) = runs[:2]
            what = f"{name} {dtype} {tuple(sample.input.shape)} {sample.kwargs}"
            pairs = [(got, want, what)] + [(a, b, f"{what} gradient {k}")
                                           for k, (a, b) in enumerate(zip(gg, gw))]
            for k, (a, b, label) in enumerate(pairs):
                if a is None or b is None:
                    assert (a is None or not bool(a.any())) and (b is None or not bool(b.any())), \
                        f"{label}: a gradient on one side only"
                    continue
                truth = runs[2][0] if k == 0 else runs[2][1][k - 1]
                if not (wide and _close(a, b)):
                    (_no_further_in_norm if name in _IN_NORM else _no_further)(a, b, truth,
                                                                                label)
            checked += 1
    assert checked, f"no sample of {name} ran"


def _run(fn, sample, dtype=None):
    """(value, gradients of its floating leaves for an upstream of 0.5, 0.75, 1 in turn, exact
    in every dtype) of fn on the sample, its floating tensors cast to dtype if given."""
    import torch

    inp, args, kwargs, leaves = _leaves(sample, dtype)
    value = fn(inp, *args, **kwargs)
    if not leaves or not value.requires_grad:
        return value.detach(), []
    up = (0.5 + torch.arange(value.numel(), device=value.device).remainder(3) / 4).reshape(
        value.shape).to(value.dtype)
    grads = torch.autograd.grad(value, leaves, up, allow_unused=True)
    return value.detach(), list(grads)


def _close(a, b):
    """Whether torch.testing.assert_close holds."""
    import torch

    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        return False
    return True


# Dynamic programs in log space (ctc_loss): each element of a float32 result carries an absolute
# error of a few ulps of the recursion's magnitude (|alpha|, growing with the frames), in a
# pattern set by the order of operations, the same size in torch's kernel and cupyloss's; the
# two cannot be ordered element by element, so their largest errors are compared.
_IN_NORM = frozenset(("ctc_loss",))


def _no_further_in_norm(got, want, truth, what):
    """max |got - truth| <= max(max |want - truth|, a rounding of truth in got's dtype), NaN
    where truth is (and nowhere else)."""
    import torch

    eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24,
           torch.float64: 2.0**-53}[got.dtype]
    g, w, t = got.double(), want.double(), truth.double()
    nan = torch.isnan(t)
    assert torch.equal(torch.isnan(g), nan), f"{what}: NaN where float64 has none, or none"
    finite = ~nan & torch.isfinite(t)
    if not bool(finite.any()):
        return
    mine = (g - t)[finite].abs().max()
    allowed = max(float((w - t)[finite].abs().max()), eps * float(t[finite].abs().max()))
    assert float(mine) <= allowed * 1.001, (
        f"{what}: {float(mine)} from float64 at most, torch's {allowed}")


def _no_further(got, want, truth, what):
    """|got - truth| <= max(|want - truth|, a rounding of truth in got's dtype), NaN where truth
    is (and nowhere else, whatever torch's own result holds)."""
    import torch

    # half an ulp relative, and half the smallest subnormal (a tiny result's rounding)
    eps, tiny = {torch.float16: (2.0**-11, 2.0**-25), torch.bfloat16: (2.0**-8, 2.0**-134),
                 torch.float32: (2.0**-24, 2.0**-150), torch.float64: (2.0**-53, 0.0)}[got.dtype]
    g, w, t = got.double(), want.double(), truth.double()
    assert g.shape == t.shape, f"{what}: shape {tuple(g.shape)} != {tuple(t.shape)}"
    nan = torch.isnan(t)
    assert torch.equal(torch.isnan(g), nan), f"{what}: NaN where float64 has none, or none"
    finite = ~nan & torch.isfinite(t)
    scale = t[finite].abs().mean() if bool(finite.any()) else torch.zeros((), dtype=t.dtype)
    # fmax: where torch's own 16-bit result is NaN (an overflow inside its kernel), the rounding
    # bound alone
    allowed = torch.fmax((w - t).abs(), eps * t.abs() + eps * scale + tiny) * 1.001
    bad = finite & ~((g - t).abs() <= allowed)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {g.numel()} further from float64 than torch's; got "
        f"{g[bad][:3].tolist()}, torch {w[bad][:3].tolist()}, float64 {t[bad][:3].tolist()}")
