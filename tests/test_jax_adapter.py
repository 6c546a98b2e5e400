"""cupyloss.jax without a GPU: what is generated and the custom_vjp wiring, with the kernels
swapped for tests/reference.py on JAX's CPU backend (buffer_callback runs there too).

`reference_engine` gives the callbacks NumPy views of XLA's CPU buffers and the float64
references, so jit, grad, value_and_grad, symbolic zeros and vmap are exercised for real; the
kernels' numbers are checked in test_jax_gpu.py.
"""

import inspect
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import cupyloss  # noqa: E402
import cupyloss.jax as JL  # noqa: E402
import reference  # noqa: E402
from cupyloss._pointwise import SPECS  # noqa: E402


class ReferenceEngine:
    """The callbacks' engine on CPU buffers through tests/reference.py, recording each call."""

    def __init__(self):
        self.calls = []

    def view(self, buffer):
        return np.asarray(buffer)

    def stream(self, ctx, buffer):
        import contextlib

        return contextlib.nullcontext()

    def write(self, out, result):
        np.asarray(out)[...] = np.asarray(result).astype(np.asarray(out).dtype)

    def value(self, name, arrays, reduction, options):
        self.calls.append(("value", name, ()))
        return reference.loss(name, *arrays, reduction=reduction, **options)

    def _grads(self, name, arrays, reduction, options, wrt, grad_output):
        every = reference.grads(name, *arrays, reduction=reduction, grad_output=grad_output,
                                **options)
        index = {a: k for k, a in enumerate(SPECS[name].arrays)}
        return tuple(every[index[w]] for w in wrt)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        self.calls.append(("value_and_grad", name, wrt))
        return (reference.loss(name, *arrays, reduction=reduction, **options),
                self._grads(name, arrays, reduction, options, wrt, 1.0))

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        self.calls.append(("backward", name, wrt))
        return self._grads(name, arrays, reduction, options, wrt, grad_output)


@pytest.fixture
def engine(monkeypatch):
    e = ReferenceEngine()
    monkeypatch.setattr(JL, "_engine", e)
    JL._function.cache_clear()
    return e


def _arguments(name, shape=(4, 5), target_shape=None, seed=0):
    rng = np.random.default_rng(seed)
    target_shape = shape if target_shape is None else target_shape
    if name == "kl_div":
        return (np.log(rng.uniform(0.1, 0.9, shape)).astype(np.float32),
                rng.uniform(0.1, 0.9, target_shape).astype(np.float32))
    if name == "hinge_loss":
        t = rng.uniform(0.5, 1.5, target_shape) * rng.choice([-1.0, 1.0], target_shape)
        z = rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
        return ((1.0 - z) / t).astype(np.float32), t.astype(np.float32)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(target_shape).astype(np.float32))


CASES = [(n, r) for n in SPECS for r in SPECS[n].reductions]


def test_import_cupyloss_jax_imports_no_torch():
    code = "import sys, cupyloss.jax; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_registered_loss_is_generated_with_the_core_signature():
    assert set(JL.LOSSES) == set(SPECS)
    for name in SPECS:
        assert getattr(JL, name) is JL.LOSSES[name]
        ours = inspect.signature(JL.LOSSES[name]).parameters.values()
        core = inspect.signature(getattr(cupyloss, name)).parameters.values()
        assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in core]
        doc = inspect.getdoc(JL.LOSSES[name])
        assert "Example (JAX)" in doc and ">>>" in doc


def test_errors_are_raised_while_tracing():
    x, t = _arguments("mse_loss")
    with pytest.raises(ValueError, match=r"'avg' is not a valid value for reduction"):
        JL.mse_loss(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"do not broadcast"):
        jax.jit(JL.mse_loss)(x, t[:, :3])
    with pytest.raises(TypeError, match=r"dtype float32 but target has dtype float16"):
        JL.mse_loss(x, t.astype(np.float16))
    with pytest.raises(TypeError, match=r"static value"):
        JL.hinge_loss(x, t, margin=jnp.float32(1.0))


@pytest.mark.parametrize("name, reduction", CASES)
def test_values_and_gradients_under_jit(engine, name, reduction):
    x, t = _arguments(name)
    f = jax.jit(lambda a, b: JL.LOSSES[name](a, b, reduction=reduction))
    np.testing.assert_allclose(np.asarray(f(x, t)),
                               reference.loss(name, x, t, reduction=reduction), rtol=1e-6)
    w = np.random.default_rng(1).standard_normal(np.shape(f(x, t))).astype(np.float32)

    def scalar(a, b):
        return jnp.sum(JL.LOSSES[name](a, b, reduction=reduction) * w)

    gx, gt = jax.jit(jax.grad(scalar, argnums=(0, 1)))(x, t)
    want = reference.grads(name, x, t, reduction=reduction, grad_output=w)
    np.testing.assert_allclose(np.asarray(gx), want[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gt), want[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(SPECS))
def test_only_differentiated_arguments_get_gradients(engine, name):
    x, t = _arguments(name)
    reduction = SPECS[name].reductions[-1]
    jax.grad(lambda a, b: JL.LOSSES[name](a, b, reduction=reduction))(x, t)
    assert engine.calls == [("value_and_grad", name, ("input",))]
    engine.calls.clear()
    jax.grad(lambda a, b: jnp.sum(JL.LOSSES[name](a, b, reduction="none")), argnums=1)(x, t)
    assert engine.calls == [("value", name, ()), ("backward", name, ("target",))]


def test_broadcast_target_gradient(engine):
    x, t = _arguments("hinge_loss", shape=(6, 5), target_shape=(5,))
    g = jax.grad(JL.hinge_loss, argnums=1)(x, t, 1.0, "sum")
    want = reference.grads("hinge_loss", x, t, reduction="sum")[1]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)


def test_cotangent_scales_saved_gradients(engine):
    x, t = _arguments("mse_loss")
    _, pullback = jax.vjp(lambda a: JL.mse_loss(a, t), x)
    (g,) = pullback(jnp.float32(2.5))
    want = reference.grads("mse_loss", x, t, grad_output=2.5)[0]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)


def test_vmap_runs_per_element(engine):
    x, t = _arguments("mse_loss", shape=(3, 4, 5))
    got = jax.vmap(lambda a, b: JL.mse_loss(a, b, reduction="sum"))(x, t)
    want = [reference.loss("mse_loss", a, b, reduction="sum") for a, b in zip(x, t)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_cpu_arrays_are_refused_by_the_kernels():
    x, t = _arguments("mse_loss")
    with pytest.raises(Exception, match=r"runs on CUDA devices"):
        JL.mse_loss(jnp.asarray(x), jnp.asarray(t)).block_until_ready()
