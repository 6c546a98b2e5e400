"""The fused heads from JAX (cupyloss.jax.linear_cross_entropy and linear_log_probs) under jit
and grad, against XLA's unfused formula on the same float32 logits."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

N, H, V = 256, 64, 1000


def _data(dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    h = (jax.random.normal(k[0], (N, H)) * 0.5).astype(dtype)
    w = (jax.random.normal(k[1], (V, H)) * 0.5).astype(dtype)
    b = (jax.random.normal(k[2], (V,)) * 0.1).astype(dtype)
    t = jax.random.randint(k[3], (N,), 0, V).at[::7].set(-100)
    return h, w, b, t


def _logits(h, w, b):
    return jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32).T,
                   precision=jax.lax.Precision.HIGHEST) + b.astype(jnp.float32)


def _xla_ce(h, w, b, t):
    z = _logits(h, w, b)
    keep = t != -100
    lp = jax.nn.log_softmax(z, -1)
    nll = -jnp.take_along_axis(lp, jnp.where(keep, t, 0)[:, None], -1)[:, 0]
    return jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.sum(keep)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("budget", [None, 40_000])
def test_linear_cross_entropy_value_and_grad_under_jit(dtype, budget):
    import cupyloss.jax as JL

    h, w, b, t = _data(dtype)
    f = jax.jit(jax.value_and_grad(
        lambda h, w, b: JL.linear_cross_entropy(h, w, t, b, max_workspace_bytes=budget),
        argnums=(0, 1, 2)))
    loss, grads = f(h, w, b)
    want, want_g = jax.value_and_grad(_xla_ce, argnums=(0, 1, 2))(h, w, b, t)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-6)
    tol = 2e-5 if dtype == jnp.float32 else 1.6e-2
    for got, ref in zip(grads, want_g):
        assert got.dtype == ref.dtype == dtype
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))
    # a second call replays nothing it should not: the same numbers
    again = f(h, w, b)
    assert float(again[0]) == float(loss)


def test_linear_cross_entropy_none_and_a_cotangent():
    import cupyloss.jax as JL

    h, w, b, t = _data()
    g = jax.random.normal(jax.random.PRNGKey(5), (N,))

    def ours(h, w):
        return jnp.sum(g * JL.linear_cross_entropy(h, w, t, b, reduction="none"))

    def xla(h, w):
        z = _logits(h, w, b)
        keep = t != -100
        nll = -jnp.take_along_axis(jax.nn.log_softmax(z, -1), jnp.where(keep, t, 0)[:, None],
                                   -1)[:, 0]
        return jnp.sum(g * jnp.where(keep, nll, 0.0))

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(h, w)
    want = jax.grad(xla, argnums=(0, 1))(h, w)
    for a, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4,
                                   atol=1e-5 * float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_log_probs_objective_gradients(temperature):
    import cupyloss.jax as JL

    h, w, b, t = _data()
    t = jnp.maximum(t, 0)
    adv = jax.random.normal(jax.random.PRNGKey(3), (N,))

    def ours(h, w, b):
        lp, ent = JL.linear_log_probs(h, w, t, b, temperature=temperature, return_entropy=True)
        return -(adv * lp).mean() - 0.01 * ent.mean()

    def xla(h, w, b):
        lp_all = jax.nn.log_softmax(_logits(h, w, b) / temperature, -1)
        lp = jnp.take_along_axis(lp_all, t[:, None], -1)[:, 0]
        ent = -jnp.sum(jnp.exp(lp_all) * lp_all, -1)
        return -(adv * lp).mean() - 0.01 * ent.mean()

    v, g = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(h, w, b)
    rv, rg = jax.value_and_grad(xla, argnums=(0, 1, 2))(h, w, b)
    np.testing.assert_allclose(float(v), float(rv), rtol=1e-5)
    for a, r in zip(g, rg):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.max(np.abs(a - r)) <= 2e-5 * np.max(np.abs(r))
    # log-probabilities alone (no entropy cotangent)
    only = jax.grad(lambda h: JL.linear_log_probs(h, w, t, b, temperature=temperature).sum())(h)
    ref = jax.grad(lambda h: jnp.take_along_axis(
        jax.nn.log_softmax(_logits(h, w, b) / temperature, -1), t[:, None], -1).sum())(h)
    np.testing.assert_allclose(np.asarray(only), np.asarray(ref), rtol=1e-4,
                               atol=1e-5 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_in_shard_map_equals_one_device(reduction, smoothing):
    """The classes split over every GPU JAX has (two where lent; one still runs the exchange),
    the loss and the logits' gradient against cross entropy of the whole logits on one."""
    from jax.sharding import Mesh, PartitionSpec as P

    import cupyloss.jax as JL

    devices = jax.devices()[:2]
    k = len(devices)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N, 512 * k)), jnp.float32)
    t = rng.integers(0, 512 * k, N)
    t[::5] = -100
    t = jnp.asarray(t, jnp.int32)
    mesh = Mesh(np.array(devices), ("tp",))

    def sharded(x):
        out = jax.shard_map(
            lambda xs, ts: JL.vocab_parallel_cross_entropy(xs, ts, "tp", reduction=reduction,
                                                           label_smoothing=smoothing),
            mesh=mesh, in_specs=(P(None, "tp"), P()),
            out_specs=P())(x, t)
        return out

    def whole(x):
        return JL.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)

    got, want = jax.jit(sharded)(x), whole(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    pick = (lambda f: lambda x: jnp.sum(f(x) * jnp.arange(N))) if reduction == "none" else \
        (lambda f: f)
    g = jax.jit(jax.grad(pick(sharded)))(x)
    g_want = jax.grad(pick(whole))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_want), rtol=1e-5,
                               atol=1e-6 * float(jnp.max(jnp.abs(g_want))))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocab_parallel_linear_cross_entropy_in_shard_map_equals_one_device(reduction):
    """The head's rows split over every GPU JAX has: loss and the gradients of hidden, weight
    and bias against the fused head on the whole weight."""
    from jax.sharding import Mesh, PartitionSpec as P

    import cupyloss.jax as JL

    devices = jax.devices()[:2]
    k = len(devices)
    h, w, b, t = _data()
    w, b = w[:500 * k], b[:500 * k]
    t = jnp.where(t >= 500 * k, t % (500 * k), t)
    mesh = Mesh(np.array(devices), ("tp",))
    weights = jnp.arange(N, dtype=jnp.float32)

    def pick(f):
        return (lambda *a: jnp.sum(f(*a) * weights)) if reduction == "none" else f

    def sharded(h, w, b):
        return jax.shard_map(
            lambda h, w, b, y: JL.vocab_parallel_linear_cross_entropy(
                h, w, y, "tp", bias=b, reduction=reduction, max_workspace_bytes=40_000),
            mesh=mesh, in_specs=(P(), P("tp", None), P("tp"), P()), out_specs=P())(h, w, b, t)

    def whole(h, w, b):
        return JL.linear_cross_entropy(h, w, t, b, reduction=reduction)

    got, want = jax.jit(sharded)(h, w, b), whole(h, w, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    g = jax.jit(jax.grad(pick(sharded), argnums=(0, 1, 2)))(h, w, b)
    g_want = jax.grad(pick(whole), argnums=(0, 1, 2))(h, w, b)
    for a, r in zip(g, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5,
                                   atol=1e-6 * float(jnp.max(jnp.abs(r))))


def test_linear_vocab_parallel_steps_match_the_logits_steps():
    """cupyloss.parallel's fused-head steps on two shares of one weight give the states and
    gradients of the logits' steps (vocab_parallel_stats / backward on h W_i^T).  In float64, so
    that the two paths' different products (chunked, whole) differ by float64 rounding alone."""
    import cupy

    from cupyloss import parallel

    rng = np.random.default_rng(4)
    h = cupy.asarray(rng.standard_normal((N, H)) * 0.5, cupy.float64)
    w = cupy.asarray(rng.standard_normal((V, H)) * 0.5, cupy.float64)
    t = cupy.asarray(rng.integers(0, V, N))
    half = V // 2
    states = []
    for c0 in (0, half):
        got = parallel.linear_vocab_parallel_stats(h, w[c0:c0 + half], t, c0, V,
                                                   max_workspace_bytes=30_000)
        want = parallel.vocab_parallel_stats(h @ w[c0:c0 + half].T, t, c0, V)
        np.testing.assert_allclose(cupy.asnumpy(got[:, :5]), cupy.asnumpy(want[:, :5]),
                                   rtol=1e-11, atol=1e-12)
        states.append(got)
    loss, lse, w_y = parallel.combine_stats(cupy.stack(states), t, V)
    for c0 in (0, half):
        ws = w[c0:c0 + half]
        gx, gw = parallel.linear_vocab_parallel_backward(1.0 / N, h, ws, t, lse, c0, V,
                                                         max_workspace_bytes=30_000)
        dz = parallel.vocab_parallel_backward(cupy.full((N,), 1.0 / N, cupy.float64),
                                              h @ ws.T, t, lse, c0, V)
        np.testing.assert_allclose(cupy.asnumpy(gx), cupy.asnumpy(dz @ ws), rtol=1e-10,
                                   atol=1e-12)
        np.testing.assert_allclose(cupy.asnumpy(gw), cupy.asnumpy(dz.T @ h), rtol=1e-10,
                                   atol=1e-12)
