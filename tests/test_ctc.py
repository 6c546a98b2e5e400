"""Host-side checks of ctc_loss: the float64 reference (tests/reference_ctc.py) against torch's
CPU CTC, values and gradients; the launch arithmetic; the torch adapter's CPU path.  No GPU
needed."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference_ctc as ref
from cupyloss._core.launch import DeviceLimits
from cupyloss.ctc import _launch as ctc_launch

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _case(rng, steps, n, classes, smax, blank, concat):
    x = rng.standard_normal((steps, n, classes))
    lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    il = rng.integers(0, steps + 1, n)
    tl = rng.integers(0, smax + 1, n)
    labels = [c for c in range(classes) if c != blank]
    tg = rng.choice(labels, (n, max(smax, 1)))
    if smax > 1:
        tg[:, 1] = tg[:, 0]          # a repeated label: the blank between is needed
    if concat:
        tg = np.concatenate([tg[b, :tl[b]] for b in range(n)]).astype(np.int64)
    return lp, tg, il, tl


@needs_torch
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(2, 6), st.integers(0, 5),
       st.sampled_from(["none", "mean", "sum"]), st.booleans(), st.booleans(),
       st.integers(0, 2**31))
def test_reference_is_torchs_ctc(steps, n, classes, smax, reduction, concat, zero_infinity,
                                 seed):
    rng = np.random.default_rng(seed)
    blank = int(rng.integers(0, classes))
    lp, tg, il, tl = _case(rng, steps, n, classes, smax, blank, concat)
    go = rng.uniform(0.5, 1.5, n) if reduction == "none" else 0.75
    want_loss, want_grad = ref.value_and_grad(lp, tg, il, tl, blank, reduction, zero_infinity, go)
    x = torch.tensor(lp, requires_grad=True)
    loss = F.ctc_loss(x, torch.as_tensor(tg), torch.as_tensor(il), torch.as_tensor(tl), blank,
                      reduction, zero_infinity)
    loss.backward(torch.as_tensor(go, dtype=torch.float64).expand_as(loss))
    np.testing.assert_allclose(want_loss, loss.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(want_grad, x.grad.numpy(), rtol=1e-9, atol=1e-12)


@needs_torch
def test_reference_unbatched_is_torchs():
    rng = np.random.default_rng(1)
    lp, tg, il, tl = _case(rng, 7, 1, 4, 3, 0, False)
    il[0], tl[0] = 7, 3       # unbatched targets are concatenated: all of them
    want, want_g = ref.value_and_grad(lp[:, 0], tg[0], il[0], tl[0], reduction="sum")
    x = torch.tensor(lp[:, 0], requires_grad=True)
    loss = F.ctc_loss(x, torch.as_tensor(tg[0]), torch.tensor(il[0]), torch.tensor(tl[0]),
                      reduction="sum")
    loss.backward()
    np.testing.assert_allclose(want, loss.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(want_g, x.grad.numpy(), rtol=1e-9, atol=1e-12)


H100 = DeviceLimits(132, 2**31 - 1, 65535, 48 * 1024, max_shared_optin=227 * 1024)
A100 = DeviceLimits(108, 2**31 - 1, 65535, 48 * 1024, max_shared_optin=163 * 1024)


@pytest.mark.parametrize("limits", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_positions_fit_the_block_and_shared_memory(limits, itemsize):
    most = ctc_launch.max_positions(np.dtype(f"f{itemsize}"), limits)
    assert most % 32 == 0 and most <= ctc_launch.KMAX * ctc_launch.BLOCK
    acc = 8 if itemsize == 8 else 4
    for lcap in (32, 64, 832, 1024, 1056, most):
        cfg = ctc_launch.ctc_launch(lcap, acc, limits)
        assert cfg.block % 32 == 0 and cfg.block <= ctc_launch.BLOCK
        assert -(-lcap // cfg.block) <= ctc_launch.KMAX      # positions a thread
        assert cfg.shared + 2048 <= limits.max_shared_optin


def test_positions_round_to_a_warp():
    assert [ctc_launch.round_positions(p) for p in (1, 32, 33, 801)] == [32, 32, 64, 832]
    assert ctc_launch.grad_grid(0, H100) == 1
    assert ctc_launch.grad_grid(64 * 4000, H100) == 132 * 16
    assert ctc_launch.grad_grid(80, H100) == 10


@needs_torch
def test_torch_adapter_on_cpu_tensors_is_torchs():
    import cupyloss.torch as CF

    rng = np.random.default_rng(2)
    lp, tg, il, tl = _case(rng, 9, 3, 5, 4, 0, False)
    a = torch.tensor(lp, requires_grad=True)
    b = torch.tensor(lp, requires_grad=True)
    mine = CF.ctc_loss(a, torch.as_tensor(tg), il.tolist(), tl.tolist(), reduction="sum")
    theirs = F.ctc_loss(b, torch.as_tensor(tg), torch.as_tensor(il), torch.as_tensor(tl),
                        reduction="sum")
    mine.backward()
    theirs.backward()
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
    assert type(CF.CTCLoss(blank=1)).__name__ == "CTCLoss"
