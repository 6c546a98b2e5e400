"""CPU tests of linear_log_probs: cupyloss.torch's CPU path and its ops (what torch.compile
traces) against the float64 reference, and the checks made before any launch."""

import numpy as np
import pytest

import reference_rowwise as ref
from cupyloss._core import dtypes as _dtypes, source as _source

torch = pytest.importorskip("torch")
import cupyloss.torch as CF  # noqa: E402

N, H, V = 12, 6, 9


def _case(bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, dtype=torch.float32, generator=gen)
    w = torch.randn(V, H, dtype=torch.float32, generator=gen)
    b = torch.randn(V, dtype=torch.float32, generator=gen) if bias else None
    t = torch.randint(0, V, (N,), generator=gen)
    t[::5] = -100
    return h, w, b, t


def _objective(logp, ent, adv):
    return (adv * logp).sum() + 0.3 * ent.sum()


@pytest.mark.parametrize("temperature, compiled", [(1.0, False), (0.6, False), (0.6, True)],
                         ids=["eager-T1", "eager-T0.6", "compiled-T0.6"])
def test_cpu_path_matches_float64(temperature, compiled):
    h, w, b, t = _case()
    adv = torch.linspace(-1, 1, N)
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]

    def run(h, w, b):
        return CF.linear_log_probs(h, w, t, b, temperature=temperature, return_entropy=True)

    fn = torch.compile(run, fullgraph=True) if compiled else run
    logp, ent = fn(*leaves)
    _objective(logp, ent, adv).backward()
    z = (h.double() @ w.double().T + b.double()).numpy()
    want_lp, want_h, _ = ref.log_probs(z, t.numpy(), temperature)
    dz = ref.log_probs_logits_grad(z, t.numpy(), temperature, adv.double().numpy(), 0.3)
    np.testing.assert_allclose(logp.detach().numpy(), want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent.detach().numpy(), want_h, rtol=1e-5, atol=1e-5)
    assert np.all(logp.detach().numpy()[t.numpy() == -100] == 0)
    want = {"h": dz @ w.double().numpy(), "w": dz.T @ h.double().numpy(), "b": dz.sum(0)}
    for leaf, name in zip(leaves, "hwb"):
        np.testing.assert_allclose(leaf.grad.numpy(), want[name], rtol=1e-4,
                                   atol=1e-5 * np.abs(want[name]).max())


def test_ops_pass_opcheck():
    h, w, b, t = _case()
    args = (h, w, t, b, 0.8, -100, -1, "")
    torch.library.opcheck(torch.ops.cupyloss.linear_log_probs.default, args)
    g, e = torch.randn(N), torch.randn(N)
    for grads in ((g, e), (g, None), (None, e)):
        torch.library.opcheck(torch.ops.cupyloss.linear_log_probs_backward.default,
                              (*grads, *args, True, True, True))


def test_the_value_alone_is_log_softmax_gathered():
    h, w, b, t = _case(bias=False)
    got = CF.linear_log_probs(h, w, t.clamp(min=0), temperature=2.0)
    want = ((h @ w.T) / 2.0).log_softmax(-1).gather(-1, t.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_temperature_is_refused(temperature):
    h, w, b, t = _case()
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        CF.linear_log_probs(h, w, t, temperature=temperature)


def test_every_kernel_a_call_can_reach_is_named():
    """reachable() names the statistics and gradient kernels of each dtype, as units() holds
    them (the precompile list and the CI's NVRTC build)."""
    units = dict(_source.units())["logprob.cu"]
    for info in _dtypes.DTYPES.values():
        names = [n for f, n in _source.reachable("linear_log_probs", info.dtype)
                 if f == "logprob.cu"]
        logits = "double" if info.dtype.itemsize == 8 else "float"
        assert f"cupyloss::logprob_stats<{logits}>" in names
        assert f"cupyloss::logprob_grad<{logits}, {info.ctype}>" in names
        assert set(names) <= set(units)
