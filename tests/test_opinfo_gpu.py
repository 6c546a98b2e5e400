"""torch's own samples of each loss (the OpInfo entries of torch's test suite,
torch.testing._internal.common_methods_invocations.op_db, which needs the `expecttest` package) on
CUDA tensors: cupyloss.torch's value and gradients against torch's, for every dtype both support.

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


def _leaves(sample):
    """(input, args, kwargs) of a sample with fresh floating leaves that require grad, and the
    leaves."""
    import torch

    leaves = []

    def fresh(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
            a = a.detach().clone().requires_grad_(True)
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
            inp, args, kwargs, leaves = _leaves(sample)
            want = op.op(inp, *args, **kwargs)
            got_inp, got_args, got_kwargs, got_leaves = _leaves(sample)
            got = ours(got_inp, *got_args, **got_kwargs)
            what = f"{name} {dtype} {tuple(sample.input.shape)} {sample.kwargs}"
            torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
            if leaves and want.requires_grad:
                up = torch.rand_like(want)
                gw = torch.autograd.grad(want, leaves, up, allow_unused=True)
                gg = torch.autograd.grad(got, got_leaves, up, allow_unused=True)
                for a, b in zip(gg, gw):
                    if b is None:
                        continue
                    torch.testing.assert_close(a, b, msg=lambda m: f"{what} gradient: {m}")
            checked += 1
    assert checked, f"no sample of {name} ran"
