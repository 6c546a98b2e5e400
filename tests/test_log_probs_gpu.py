"""GPU tests of linear_log_probs (per-token log-probabilities and entropy of the fused head)
against a float64 reference: logits X W^T + b formed in float64 from the same rounded inputs,
divided by the temperature, log_softmax, the entropy, and the gradient of
sum_i g_i logp_i + e_i H_i; and against torch's autograd of the unfused formula.
"""

import numpy as np
import pytest

import reference_rowwise as ref
from gpu_util import BFLOAT16
from test_linear_gpu import BUDGETS, DTYPES, TOL_GRAD, H, N, V, _err, _inputs

pytestmark = pytest.mark.gpu

# float32 sums of exact products: the statistics of float32 logits
TOL_STAT = 2e-6


def reference(host, t, temperature, g=None, e=None, ignore_index=-100):
    """(logp, entropy, {name: gradient}) in float64 (reference_rowwise's)."""
    x, w, b, _ = host
    z = x @ w.T + (0 if b is None else b)
    logp, ent, _ = ref.log_probs(z, t, temperature, ignore_index)
    grads = None
    if g is not None or e is not None:
        dz = ref.log_probs_logits_grad(z, t, temperature, g, e, ignore_index)
        grads = {"hidden": dz @ w, "weight": dz.T @ x, "bias": dz.sum(axis=0)}
    return logp, ent, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("upstream", ["logp", "entropy", "both"])
@pytest.mark.parametrize("budget", ["default", "sum-128rows", "slices", "slices-tiles"])
def test_value_and_grad_against_float64(dtype, temperature, upstream, budget):
    import cupy

    import cupyloss

    (x, w, b, _), host, t, t_host = _inputs(dtype, bias=True)
    rng = np.random.default_rng(2)
    g_host = rng.standard_normal(N) if upstream != "entropy" else None
    e_host = rng.standard_normal(N) * 0.1 if upstream != "logp" else None
    g = None if g_host is None else cupy.asarray(g_host, np.float32)
    e = None if e_host is None else cupy.asarray(e_host, np.float32)
    wrt = ("hidden", "weight", "bias")
    (logp, ent), grads = cupyloss.linear_log_probs_value_and_grad(
        x, w, t, b, grad_output=g, grad_entropy=e, temperature=temperature,
        return_entropy=True, max_workspace_bytes=BUDGETS[budget], wrt=wrt)
    want_lp, want_h, want = reference(host, t_host, temperature,
                                      None if g is None else cupy.asnumpy(g).astype(np.float64),
                                      None if e is None else cupy.asnumpy(e).astype(np.float64))
    assert logp.dtype == ent.dtype == np.float32 and logp.shape == ent.shape == (N,)
    assert _err(cupy.asnumpy(logp), want_lp) <= TOL_STAT
    assert _err(cupy.asnumpy(ent), want_h) <= TOL_STAT
    assert np.all(cupy.asnumpy(logp)[t_host == -100] == 0)
    for name, got in zip(wrt, grads):
        assert got.dtype == dtype and got.shape == want[name].shape
        assert _err(cupy.asnumpy(got.astype(np.float64)), want[name]) <= TOL_GRAD[str(dtype)], \
            name
    # the values alone and the gradients alone are the one pass's, bitwise
    alone_lp, alone_h = cupyloss.linear_log_probs(x, w, t, b, temperature=temperature,
                                                  return_entropy=True,
                                                  max_workspace_bytes=BUDGETS[budget])
    assert cupy.array_equal(alone_lp, logp) and cupy.array_equal(alone_h, ent)
    back = cupyloss.linear_log_probs_backward(g, x, w, t, b, grad_entropy=e,
                                              temperature=temperature,
                                              max_workspace_bytes=BUDGETS[budget], wrt=wrt)
    for got, again in zip(grads, back):
        assert cupy.array_equal(got, again)


def test_float64_is_exact_to_rounding_and_numbers_broadcast():
    import cupy

    import cupyloss

    (x, w, b, _), host, t, t_host = _inputs(np.dtype(np.float64), bias=True)
    (logp, ent), (gx, gw) = cupyloss.linear_log_probs_value_and_grad(
        x, w, t, b, grad_output=-0.5, grad_entropy=0.25, temperature=1.3, return_entropy=True)
    want_lp, want_h, want = reference(host, t_host, 1.3, -0.5, 0.25)
    assert _err(cupy.asnumpy(logp), want_lp) <= 1e-13
    assert _err(cupy.asnumpy(ent), want_h) <= 1e-13
    assert _err(cupy.asnumpy(gx), want["hidden"]) <= 1e-12
    assert _err(cupy.asnumpy(gw), want["weight"]) <= 1e-12


def test_against_torch_autograd_of_the_unfused_formula():
    """torch: log_softmax(F.linear(h.float(), W.float()) / T).gather (float32 logits of the
    16-bit operands, as the fused head forms them), the entropy of the same distribution; the
    same objective's gradients through autograd."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as T

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if BFLOAT16 else torch.float16
    h = (torch.randn(N, H, device="cuda", generator=gen) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=gen)
    adv = torch.randn(N, device="cuda", generator=gen)
    temp = 0.8

    def objective(logp, ent):
        return -(adv * logp).mean() - 0.01 * ent.mean()

    logits = (h.float() @ w.float().T) / temp
    logp_all = logits.log_softmax(-1)
    want_lp = logp_all.gather(-1, t[:, None])[:, 0]
    want_h = -(logp_all.exp() * logp_all).sum(-1)
    objective(want_lp, want_h).backward()
    want_g = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    logp, ent = T.linear_log_probs(h, w, t, temperature=temp, return_entropy=True)
    objective(logp, ent).backward()
    torch.testing.assert_close(logp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_h, rtol=1e-5, atol=1e-5)
    for got, want in zip((h.grad, w.grad), want_g):
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= TOL_GRAD[str(dtype).replace("torch.", "")]


def test_bad_arguments_are_refused_before_any_launch():
    import cupy

    import cupyloss

    (x, w, b, _), _, t, _ = _inputs(np.dtype(np.float32))
    for temperature in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            cupyloss.linear_log_probs(x, w, t, temperature=temperature)
    with pytest.raises(ValueError, match="target's shape"):
        cupyloss.linear_log_probs_backward(cupy.ones(N + 1, np.float32), x, w, t)
    with pytest.raises(ValueError, match="weight must be"):
        cupyloss.linear_log_probs(x, cupy.empty((0,), np.float32), t)
