"""cupyloss.jax without a GPU: what is generated and the custom_vjp wiring, with the kernels
swapped for the float64 references of every family (tests/operands.py) on JAX's CPU backend
(buffer_callback runs there too).

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
if jax.default_backend() != "cpu":
    # These tests drive the wiring with NumPy references on host arrays; where JAX's default
    # backend is a GPU, test_jax_gpu.py checks the same paths with the kernels.
    pytest.skip(f"JAX's default backend is {jax.default_backend()}, not the CPU",
                allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

import cupyloss  # noqa: E402
import cupyloss.jax as JL  # noqa: E402
import operands  # noqa: E402
from operands import SPECS, ref_grads, ref_loss  # noqa: E402


class ReferenceEngine:
    """The callbacks' engine on CPU buffers through the float64 references, recording each call."""

    def __init__(self):
        self.calls = []
        self.measured = []      # (argument shapes, result shapes) of each measuring run
        self.scratch = []       # the scratch buffer's shape each callback got

    def view(self, buffer, dtype, device):
        return np.asarray(buffer).view(dtype)

    def call(self, ctx, first, outs, dtypes, scratch):
        import contextlib

        self.scratch.append(None if scratch is None else np.asarray(scratch).shape)
        return contextlib.nullcontext((None, [self.view(b, d, None) for b, d in
                                              zip(outs, dtypes)]))

    def place(self, out, result):
        np.asarray(out)[...] = np.asarray(result).astype(np.asarray(out).dtype)

    def measure(self, run, arrays, results):
        """A measured size the wiring must pass through (one byte per result); no replays."""
        self.measured.append(([tuple(a.shape) for a in arrays],
                              [tuple(r.shape) for r in results]))
        return len(results), {}

    def value(self, name, arrays, reduction, options):
        self.calls.append(("value", name, ()))
        return ref_loss(name, list(arrays), reduction, **options)

    def _grads(self, name, arrays, reduction, options, wrt, grad_output):
        every = ref_grads(name, list(arrays), reduction, grad_output, **options)
        index = {a: k for k, a in enumerate(SPECS[name].arrays)}
        return tuple(every[index[w]] for w in wrt)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        self.calls.append(("value_and_grad", name, wrt))
        return (ref_loss(name, list(arrays), reduction, **options),
                self._grads(name, arrays, reduction, options, wrt, 1.0))

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        self.calls.append(("backward", name, wrt))
        return self._grads(name, arrays, reduction, options, wrt, grad_output)


@pytest.fixture
def engine(monkeypatch):
    e = ReferenceEngine()
    monkeypatch.setattr(JL, "_engine", e)
    JL._function.cache_clear()
    JL._measured.cache_clear()
    return e


_arguments = operands.float32_arguments
_floating = operands.floating_argnums


CASES = [(n, r) for n in SPECS for r in SPECS[n].reductions]
# Every case, and again with the optional arrays (weight, pos_weight) for the losses that have them.
GRAD_CASES = [(n, r, False) for n, r in CASES] + [(n, r, True) for n, r in CASES
                                                   if operands.optional(n)]


def test_import_cupyloss_jax_imports_no_torch():
    code = "import sys, cupyloss.jax; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_registered_loss_is_generated_with_the_core_signature():
    assert JL.SKIPPED == {}
    assert set(JL.LOSSES) == set(SPECS)
    assert {"cross_entropy", "nll_loss"} <= set(SPECS)      # the row-wise family too
    for name in SPECS:
        assert getattr(JL, name) is JL.LOSSES[name]
        ours = inspect.signature(JL.LOSSES[name]).parameters.values()
        core = inspect.signature(getattr(cupyloss, name)).parameters.values()
        assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in core]
        doc = inspect.getdoc(JL.LOSSES[name])
        assert "Example (JAX)" in doc and ">>>" in doc


def test_errors_are_raised_while_tracing():
    (x, t), _ = _arguments("mse_loss")
    with pytest.raises(ValueError, match=r"'avg' is not a valid value for reduction"):
        JL.mse_loss(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"do not broadcast"):
        jax.jit(JL.mse_loss)(x, t[:, :3])
    with pytest.raises(TypeError, match=r"dtype float32 but target has dtype float16"):
        JL.mse_loss(x, t.astype(np.float16))
    with pytest.raises(TypeError, match=r"static value"):
        JL.hinge_loss(x, t, margin=jnp.float32(1.0))


@pytest.mark.parametrize("name, reduction, with_optional", GRAD_CASES)
def test_values_and_gradients_under_jit(engine, name, reduction, with_optional):
    args, kw = _arguments(name, with_optional=with_optional)
    f = jax.jit(lambda *a: JL.LOSSES[name](*a, reduction=reduction, **kw))
    np.testing.assert_allclose(np.asarray(f(*args)), ref_loss(name, args, reduction, **kw),
                               rtol=1e-6)
    w = np.random.default_rng(1).standard_normal(np.shape(f(*args))).astype(np.float32)

    def scalar(*a):
        return jnp.sum(JL.LOSSES[name](*a, reduction=reduction, **kw) * w)

    argnums = _floating(args, name)
    got = jax.jit(jax.grad(scalar, argnums=argnums))(*args)
    want = ref_grads(name, args, reduction, w, **kw)
    for g, k in zip(got, argnums):
        np.testing.assert_allclose(np.asarray(g), want[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(SPECS))
def test_only_differentiated_arguments_get_gradients(engine, name):
    args, _ = _arguments(name)
    names = SPECS[name].arrays
    reduction = SPECS[name].reductions[-1]
    jax.grad(lambda *a: JL.LOSSES[name](*a, reduction=reduction))(*args)
    assert engine.calls == [("value_and_grad", name, (names[0],))]
    engine.calls.clear()
    k = _floating(args, name)[-1]        # the input where the target holds class indices
    jax.grad(lambda *a: jnp.sum(JL.LOSSES[name](*a, reduction="none")), argnums=k)(*args)
    assert engine.calls == [("value", name, ()), ("backward", name, (names[k],))]


def test_array_options_get_no_gradient(engine):
    args, kw = _arguments("binary_cross_entropy", with_optional=True)
    with pytest.raises(NotImplementedError, match=r"no gradient with respect to weight"):
        jax.grad(lambda w: JL.binary_cross_entropy(*args, weight=w))(kw["weight"])


def test_broadcast_target_gradient(engine):
    (x, t), _ = _arguments("hinge_loss", shape=(6, 5), target_shape=(5,))
    g = jax.grad(JL.hinge_loss, argnums=1)(x, t, 1.0, "sum")
    want = ref_grads("hinge_loss", [x, t], "sum")[1]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)


def test_cotangent_scales_saved_gradients(engine):
    (x, t), _ = _arguments("mse_loss")
    _, pullback = jax.vjp(lambda a: JL.mse_loss(a, t), x)
    (g,) = pullback(jnp.float32(2.5))
    want = ref_grads("mse_loss", [x, t], "mean", 2.5)[0]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)


def test_vmap_runs_per_element(engine):
    (x, t), _ = _arguments("mse_loss", shape=(3, 4, 5))
    got = jax.vmap(lambda a, b: JL.mse_loss(a, b, reduction="sum"))(x, t)
    want = [ref_loss("mse_loss", [a, b], "sum") for a, b in zip(x, t)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_cpu_arrays_are_refused_by_the_kernels():
    (x, t), _ = _arguments("mse_loss")
    with pytest.raises(Exception, match=r"runs on CUDA devices"):
        JL.mse_loss(jnp.asarray(x), jnp.asarray(t)).block_until_ready()


_SHARD_MAP = """
import functools, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import cupyloss.jax as JL
import test_jax_adapter as T
import operands
from operands import ref_grads, ref_loss
JL._engine = T.ReferenceEngine()
mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map
for name in ("mse_loss", "cross_entropy", "triplet_margin_loss"):
    args, _ = operands.float32_arguments(name, shape=(8, 5))
    argnums = operands.floating_argnums(args, name)
    spec = tuple(P("batch") for _ in args)

    @functools.partial(shard_map, mesh=mesh, in_specs=spec, out_specs=P())
    def sharded(*a):
        return jax.lax.pmean(JL.LOSSES[name](*a, reduction="mean"), "batch")

    placed = [jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in args]
    value, grads = jax.jit(jax.value_and_grad(sharded, argnums=argnums))(*placed)
    np.testing.assert_allclose(np.asarray(value), ref_loss(name, list(args), "mean"), rtol=1e-6)
    want = ref_grads(name, list(args), "mean")
    for g, k in zip(grads, argnums):
        np.testing.assert_allclose(np.asarray(g), want[k], rtol=1e-5, atol=1e-8)
    print(name, "ok")
"""


def test_inside_shard_map_over_two_devices():
    """shard_map over two (CPU) devices: each runs the callback on its shard, pmean combines the
    shards' means, and value and gradients are those of the whole batch (JAX refuses symbolic
    zeros there: the adapter falls back to computing every floating array's gradient)."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", _SHARD_MAP.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["mse_loss", "ok", "cross_entropy", "ok",
                                  "triplet_margin_loss", "ok"]


def test_scratch_is_measured_once_per_signature_and_handed_to_the_callback(engine):
    """The engine's measured scratch (here one byte per result) becomes one more XLA result of
    that many bytes, which each callback gets and the caller never sees."""
    (x, t), _ = _arguments("mse_loss")
    f = jax.jit(jax.value_and_grad(JL.mse_loss))
    for _ in range(2):
        loss, g = f(x, t)
        assert g.shape == x.shape
    assert np.shape(JL.mse_loss(x, t)) == ()
    assert np.shape(JL.mse_loss(x, t)) == ()       # eager: traced again, measured once
    assert engine.measured == [([(4, 5), (4, 5)], [(), (4, 5)]), ([(4, 5), (4, 5)], [()])]
    assert engine.scratch == [(2,), (2,), (1,), (1,)]


def test_bfloat16_travels_as_its_bits(engine):
    """bfloat16 arguments and results cross the callback as uint16 (bitcasts XLA does not
    copy for) and come back as bfloat16 with the reference's values."""
    (x, t), _ = _arguments("mse_loss", shape=(6, 7))
    a, b = jnp.asarray(x, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16)
    loss, g = jax.jit(jax.value_and_grad(JL.mse_loss))(a, b)
    assert loss.dtype == g.dtype == jnp.bfloat16
    wide = [np.asarray(a, np.float64), np.asarray(b, np.float64)]
    np.testing.assert_allclose(np.float64(loss), ref_loss("mse_loss", wide, "mean"), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(g, np.float64), ref_grads("mse_loss", wide, "mean")[0],
                               rtol=1e-2, atol=1e-4)
    assert "u16" in str(jax.make_jaxpr(jax.value_and_grad(JL.mse_loss))(a, b))


def test_replay_patches_every_address_of_a_recorded_call(monkeypatch):
    """A measuring run's recorded launch becomes its replay: each address word inside a fake
    buffer is patched with that buffer's index and offset, the measuring stream's tickets become
    the replaying stream's (-2, -1); everything else is kept."""
    import array

    from cupyloss._core import args as _args

    monkeypatch.setitem(_args.POINTERS, 11, frozenset(range(7)))

    structs = [jax.ShapeDtypeStruct((4, 5), jnp.float32)] * 2 + [
        jax.ShapeDtypeStruct((), jnp.float32)]
    bases = list(JL._fake_addresses(structs))        # two arguments, one result, scratch
    assert len(bases) == 4 and bases == sorted(bases)
    assert all(b % 256 == 0 and JL._FAKE_BASE <= b < JL._FAKE_END for b in bases)
    ticket, col = 0x7F0000001000, 0x7F0000002000
    words = array.array("Q", [bases[0], 7, bases[1] + 16, bases[2], bases[3] + 512, ticket, col,
                              bases[0] - 1])
    ops = [("launch", 11, (3,), (256,), 0, False, words), ("zeros", bases[3] + 256, 64)]
    (launch, zeros) = JL._replay(ops, bases, (ticket, col))
    assert launch[:6] == ("launch", 11, (3,), (256,), 0, False)
    assert list(launch[6]) == [0, 7, 0, 0, 0, 0, 0, bases[0] - 1]
    assert launch[7] == ((0, 0, 0), (2, 1, 16), (3, 2, 0), (4, 3, 512), (5, -2, 0), (6, -1, 0))
    assert zeros == ("zeros", 3, 256, 64)


def test_replay_never_rewrites_a_word_that_is_not_an_address(monkeypatch):
    """A float64 option whose bits fall among the fake addresses (softcap or eps near 1e-300) is
    not an address: the recording becomes no replay (the engine runs those calls), rather than
    a replay that writes an address into the option.  A kernel whose address words are unknown
    gives no replay either."""
    import array
    import struct

    from cupyloss._core import args as _args

    structs = [jax.ShapeDtypeStruct((4, 5), jnp.float32)] * 2
    bases = list(JL._fake_addresses(structs))
    tiny = struct.unpack("<Q", struct.pack("<d", 1e-300))[0]
    assert JL._FAKE_BASE <= tiny < JL._FAKE_END and bases[0] <= tiny < JL._FAKE_END
    words = array.array("Q", [bases[0], bases[1], tiny])
    ops = [("launch", 12, (3,), (256,), 0, False, words)]
    monkeypatch.setitem(_args.POINTERS, 12, frozenset({0, 1}))
    assert JL._replay(ops, bases, (1, 2)) is None
    monkeypatch.setitem(_args.POINTERS, 12, frozenset({0, 1, 2}))   # were it an address
    assert JL._replay(ops, bases, (1, 2)) is not None
    assert JL._replay([("launch", 13, (3,), (256,), 0, False, words)], bases, (1, 2)) is None


def test_every_layout_knows_its_address_words():
    """The address words come from the kernels' declarations: pointer parameters, pointer
    fields of a struct written field by field, and structs of pointers; never a double."""
    from cupyloss.pointwise import _family as _pointwise
    from cupyloss.rowwise import _family as _rowwise
    from cupyloss import linear

    layout = _pointwise.flat_layout(2, 3)
    slot = layout.slot
    assert {slot["in"], slot["in"] + 1, slot["go"], slot["loss"], slot["o.value"],
            slot["o.g"], slot["o.g"] + 1, slot["o.partials"], slot["o.ticket"], slot["g"],
            slot["g"] + 1} == layout.pointers
    assert slot["fill"] not in layout.pointers and slot["o.divisor"] not in layout.pointers
    rows = _rowwise.ROWS
    assert {rows.slot[n] for n in ("x", "tgt", "weight", "go", "gx", "ticket")} <= rows.pointers
    assert not {rows.slot[n] for n in ("softcap", "smoothing", "rows", "cols")} & rows.pointers
    assert linear.NARROW.pointers == {0, 1}


def test_fused_heads_refuse_bad_arguments_before_tracing():
    """The JAX heads' checks: a bad temperature, reduction or num_items, and shapes that are no
    head's, refused before any callback is traced."""
    h, w, t = jnp.ones((4, 3)), jnp.ones((5, 3)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="temperature"):
        JL.linear_log_probs(h, w, t, temperature=0.0)
    for f in (JL.vocab_parallel_cross_entropy, JL.vocab_parallel_linear_cross_entropy):
        args = (h @ w.T, t, "tp") if f is JL.vocab_parallel_cross_entropy else (h, w, t, "tp")
        with pytest.raises(ValueError, match="not a valid value for reduction"):
            f(*args, reduction="batchmean")
        with pytest.raises(ValueError, match="reduction='none'"):
            f(*args, reduction="none", num_items=3)
    with pytest.raises(ValueError, match="must be"):
        JL.vocab_parallel_linear_cross_entropy(h, jnp.ones((5, 2)), t, "tp")
