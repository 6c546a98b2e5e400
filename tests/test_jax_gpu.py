"""cupyloss.jax on a GPU: values and gradients under jax.jit and jax.grad against jax.grad of
jnp references, on XLA's stream, inside larger jitted programs, written into XLA's buffers with
nothing from CuPy's pool, and inside shard_map over two GPUs.

The suite shares each GPU between processes, so JAX does not preallocate here (conftest.py);
test_default_memory_settings runs the example with JAX's defaults in a process of its own."""

import contextlib
import functools
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import cupyloss  # noqa: E402
import cupyloss.jax as JL  # noqa: E402
import operands  # noqa: E402
from operands import SPECS  # noqa: E402

_arguments = operands.float32_arguments
_floating = operands.floating_argnums

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _jax_gpu():
    try:
        devices = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend: {exc}")
    if not devices:
        pytest.skip("JAX sees no GPU")


def _elementwise(name, x, t, **kw):
    """jnp references, written the way torch defines each loss."""
    if name == "mse_loss":
        return (x - t) ** 2
    if name == "kl_div":
        if not kw.get("log_input", True):
            x = jnp.log(x)
        if kw.get("log_target", False):
            return jnp.exp(t) * (t - x)
        return jax.scipy.special.xlogy(t, t) - t * x
    if name == "hinge_loss":
        return jnp.maximum(kw.get("margin", 1.0) - x * t, 0.0)
    raise NotImplementedError(f"no jnp reference for {name} in this test")


def _reference(name, x, t, reduction, **kw):
    values = _elementwise(name, x, t, **kw)
    if reduction == "none":
        return values
    if reduction == "sum":
        return jnp.sum(values)
    if reduction == "batchmean":
        return jnp.sum(values) / x.shape[0]
    return jnp.mean(values)


REFERENCED = ("mse_loss", "kl_div", "hinge_loss")
CASES = [(n, r) for n in REFERENCED for r in SPECS[n].reductions]


def _gpu(a):
    return jax.device_put(jnp.asarray(a), jax.devices("gpu")[0])


@pytest.mark.parametrize("name, reduction", CASES)
def test_jit_grad_matches_jnp_reference(name, reduction):
    x, t = map(_gpu, _arguments(name, shape=(257, 129), target_shape=(129,))[0])
    w = _gpu(np.random.default_rng(2).standard_normal(
        (257, 129) if reduction == "none" else ()).astype(np.float32))

    def ours(a, b):
        return jnp.sum(JL.LOSSES[name](a, b, reduction=reduction) * w)

    def theirs(a, b):
        return jnp.sum(_reference(name, a, b, reduction) * w)

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(x, t)
    want_value, want_grads = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1)))(x, t)
    # fp32 sums of terms of both signs: rounding is relative to the terms, not to the sum.
    terms = float(jnp.sum(jnp.abs(_elementwise(name, x, t) * w)))
    np.testing.assert_allclose(np.asarray(value), np.asarray(want_value), rtol=2e-5,
                               atol=2e-5 * terms / (x.shape[0] if reduction == "batchmean"
                                                    else x.size if reduction == "mean" else 1))
    for g, want in zip(grads, want_grads):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=2e-5,
                                   atol=1e-5 * scale)


@pytest.mark.parametrize("name, with_optional",
                         [(n, False) for n in SPECS] + [(n, True) for n in SPECS
                                                        if operands.optional(n)])
def test_same_numbers_as_the_core_on_cupy(name, with_optional):
    """Every loss of every family: jax.value_and_grad gives the core's value and gradients on
    CuPy bit for bit (weight and pos_weight as operands when given; class indices as int32)."""
    import cupy

    args, kw = _arguments(name, shape=(33, 1025), with_optional=with_optional)
    reduction = SPECS[name].reductions[-1]
    argnums = _floating(args, name)
    loss, grads = jax.value_and_grad(
        lambda *a: JL.LOSSES[name](*a, reduction=reduction,
                                   **{k: _gpu(v) for k, v in kw.items()}),
        argnums=argnums)(*map(_gpu, args))
    wrt = tuple(SPECS[name].arrays[k] for k in argnums)
    v, core = getattr(cupyloss, name + "_value_and_grad")(
        *map(cupy.asarray, args), reduction=reduction, wrt=wrt,
        **{k: cupy.asarray(w) for k, w in kw.items()})
    assert np.asarray(loss) == cupy.asnumpy(v)                 # same kernels, same bits
    for g, c in zip(grads, core):                               # cotangent 1: x * 1 == x
        assert np.array_equal(np.asarray(g), cupy.asnumpy(c))


def test_grad_of_one_argument_and_eager_calls():
    x, t = map(_gpu, _arguments("hinge_loss", shape=(64, 33), target_shape=(33,))[0])
    g = jax.grad(JL.hinge_loss, argnums=1)(x, t, 1.0, "sum")      # no jit
    want = jax.grad(lambda a, b: _reference("hinge_loss", a, b, "sum"), argnums=1)(x, t)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_inputs(dtype):
    (x, t), _ = _arguments("mse_loss", shape=(128, 257))
    a, b = _gpu(x).astype(dtype), _gpu(t).astype(dtype)
    got = jax.jit(JL.mse_loss)(a, b)
    want = _reference("mse_loss", a.astype(jnp.float32), b.astype(jnp.float32), "mean")
    assert got.dtype == a.dtype
    np.testing.assert_allclose(np.asarray(got).astype(np.float32), np.asarray(want), rtol=8e-3)
    g = jax.grad(JL.mse_loss)(a, b)
    assert g.dtype == a.dtype and g.shape == a.shape


def test_inside_a_larger_program_on_xlas_stream():
    """Work before and after the callback in one jitted program: ordering on XLA's stream."""
    x, t = map(_gpu, _arguments("kl_div", shape=(512, 1000))[0])

    def program(a, b):
        a = jax.nn.log_softmax(a * 3.0, axis=-1)
        loss = JL.kl_div(a, b, reduction="batchmean")
        return loss * 2.0 + jnp.sum(a) * 0.0, jnp.exp(a)[0, 0]

    def reference(a, b):
        a = jax.nn.log_softmax(a * 3.0, axis=-1)
        return _reference("kl_div", a, b, "batchmean") * 2.0, jnp.exp(a)[0, 0]

    for _ in range(3):
        got = jax.jit(program)(x, t)
        want = jax.jit(reference)(x, t)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5)
    g = jax.jit(jax.grad(lambda a, b: program(a, b)[0]))(x, t)
    h = jax.jit(jax.grad(lambda a, b: reference(a, b)[0]))(x, t)
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4,
                               atol=1e-5 * float(jnp.max(jnp.abs(h))))


@contextlib.contextmanager
def _nothing_beside_xla():
    """Inside: every CuPy allocation, from any thread, is counted (yielded list of sizes); the
    adapter's copies and pool fallbacks are counted in the engine."""
    import cupy

    pool = cupy.get_default_memory_pool()
    sizes = []

    def allocate(nbytes):
        sizes.append(nbytes)
        return pool.malloc(nbytes)

    before = (JL._engine.copies, JL._engine.pooled)
    cupy.cuda.set_allocator(allocate)
    try:
        yield sizes
    finally:
        cupy.cuda.set_allocator(pool.malloc)
        sizes.append(("copies and pool fallbacks", JL._engine.copies - before[0],
                      JL._engine.pooled - before[1]))


def _in_xla_memory(name, shape, target_shape=None, with_optional=False, replay=True,
                   monkeypatch=None):
    """jit(value_and_grad) of the reduced loss and jit(grad) through reduction='none' (value
    then backward), with every CuPy allocation counted; then the same numbers from the core on
    CuPy, bit for bit.  replay: the three callbacks replay the launches recorded when they were
    traced (else the engine runs each call, as where no replay could be recorded)."""
    import cupy

    if not replay:
        monkeypatch.setattr(JL._engine, "replay", lambda *a: False)
    replayed, ran = JL._engine.replayed, JL._engine.ran

    args, kw = _arguments(name, shape=shape, target_shape=target_shape,
                          with_optional=with_optional)
    argnums = _floating(args, name)
    reduction = SPECS[name].reductions[-1]
    jargs, jkw = list(map(_gpu, args)), {k: _gpu(v) for k, v in kw.items()}
    loss = JL.LOSSES[name]
    f = jax.jit(jax.value_and_grad(lambda *a: loss(*a, reduction=reduction, **jkw),
                                   argnums=argnums))
    none_shape = jax.eval_shape(lambda *a: loss(*a, reduction="none", **jkw), *jargs).shape
    w = _gpu(np.random.default_rng(3).standard_normal(none_shape).astype(np.float32))
    g = jax.jit(jax.grad(lambda *a: jnp.sum(loss(*a, reduction="none", **jkw) * w),
                         argnums=argnums))
    jax.block_until_ready((f(*jargs), g(*jargs)))              # traced and measured
    with _nothing_beside_xla() as allocations:
        value, grads = jax.block_until_ready(f(*jargs))
        elementwise = jax.block_until_ready(g(*jargs))
    assert allocations == [("copies and pool fallbacks", 0, 0)]
    # Two callbacks a run, each run twice (XLA drops g's forward, which grad does not need).
    assert (JL._engine.replayed - replayed, JL._engine.ran - ran) == ((4, 0) if replay else (0, 4))
    wrt = tuple(SPECS[name].arrays[k] for k in argnums)
    cargs, ckw = list(map(cupy.asarray, args)), {k: cupy.asarray(v) for k, v in kw.items()}
    v, core = getattr(cupyloss, name + "_value_and_grad")(*cargs, reduction=reduction, wrt=wrt,
                                                          **ckw)
    assert np.asarray(value) == cupy.asnumpy(v)
    for a, b in zip(grads, core):
        assert np.array_equal(np.asarray(a), cupy.asnumpy(b))
    back = getattr(cupyloss, name + "_backward")(cupy.asarray(np.asarray(w)), *cargs,
                                                 reduction="none", wrt=wrt, **ckw)
    for a, b in zip(elementwise, back):
        assert np.array_equal(np.asarray(a), cupy.asnumpy(b))


@pytest.mark.parametrize("name, with_optional",
                         [(n, False) for n in SPECS] + [(n, True) for n in SPECS
                                                        if operands.optional(n)])
@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "engine"])
def test_results_are_written_into_xlas_buffers(name, with_optional, replay, monkeypatch):
    """Every loss, replayed and run by the engine: no CuPy allocation, no copy, the core's bits
    (33 rows: not a multiple of a warp; 1025 columns: one past a power of two)."""
    _in_xla_memory(name, (33, 1025), with_optional=with_optional, replay=replay,
                   monkeypatch=monkeypatch)


@pytest.mark.parametrize("name, shape, target_shape", [
    ("mse_loss", (4096, 257), (257,)),        # a per-column target: its gradient's partials
    ("mse_loss", (64, 3, 33), (3, 1)),        # a per-channel target: pointwise_reduce's partials
    ("hinge_loss", (1 << 20,), None),         # one long row: many blocks' partials
    ("cross_entropy", (4, 1 << 18), None),    # few rows of many classes: rows split over blocks
])
@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "engine"])
def test_scratch_comes_from_xla(name, shape, target_shape, replay, monkeypatch):
    """Calls whose launches need scratch (partial sums, counters, zeroed in the call): carved
    from the one byte buffer XLA allocates beside the results."""
    _in_xla_memory(name, shape, target_shape, replay=replay, monkeypatch=monkeypatch)


def _devices(n):
    devices = jax.devices("gpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} GPUs; JAX sees {len(devices)}")
    return devices[:n]


@pytest.mark.parametrize("name", ["mse_loss", "cross_entropy", "triplet_margin_loss"])
def test_inside_shard_map_over_two_gpus(name):
    """The batch split over two GPUs with shard_map: each runs its shard's loss on its own
    stream, pmean combines the means, and value and gradients match one GPU's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = _devices(2)
    mesh = Mesh(np.array(devices), ("batch",))
    args, _ = _arguments(name, shape=(64, 1000))
    argnums = _floating(args, name)
    loss = JL.LOSSES[name]
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    spec = tuple(P("batch") for _ in args)

    @functools.partial(shard_map, mesh=mesh, in_specs=spec, out_specs=P())
    def sharded(*a):
        return jax.lax.pmean(loss(*a, reduction="mean"), "batch")

    placed = [jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in args]
    value, grads = jax.jit(jax.value_and_grad(sharded, argnums=argnums))(*placed)
    whole = [jax.device_put(a, devices[0]) for a in args]
    want, want_grads = jax.jit(jax.value_and_grad(
        lambda *a: loss(*a, reduction="mean"), argnums=argnums))(*whole)
    np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=1e-6)
    for g, h in zip(grads, want_grads):
        assert {d.id for d in g.sharding.device_set} == {d.id for d in devices}
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_default_memory_settings():
    """The example with JAX's own memory settings (it preallocates 75% of the GPU): every check
    passes, so nothing needed room beside XLA's.  Slow-marked: it runs alone in the suite."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "jax_roundtrip.py")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "preallocated" in out.stdout and "all checks passed" in out.stdout
