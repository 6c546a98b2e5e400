"""Trust on a GPU: 2,000 streams from 8 threads with mixed losses equal to one thread's results,
a jitted loss traced from 8 threads at once, the kernel cache healing a damaged entry in a fresh
process, rejected targets counted on the device, and layouts read as they are or refused."""

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
try:
    cp.cuda.runtime.getDeviceCount()
except Exception:  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

import cupyloss  # noqa: E402


def _mixed(seed):
    """Four losses that reduce across blocks (tickets) on arrays of one seed."""
    rs = cp.random.RandomState(seed)
    x = rs.standard_normal((96, 2000), dtype=cp.float32)
    y = rs.standard_normal((96, 2000), dtype=cp.float32)
    t = rs.randint(0, 2000, 96).astype(cp.int64)
    b = rs.standard_normal((2000,), dtype=cp.float32)
    return x, y, t, b


def _run(arrays):
    x, y, t, b = arrays
    out = [cupyloss.mse_loss(x, y), cupyloss.cross_entropy(x, t),
           cupyloss.mse_loss_value_and_grad(x, b)[1][1],            # a row's gradient summed
           cupyloss.huber_loss(x, y, reduction="sum"), cupyloss.kl_div(x, y.clip(0.1, 1),
                                                                     reduction="batchmean")]
    return [o for o in out]


def test_two_thousand_streams_from_eight_threads_equal_one_thread():
    """Every stream its own ticket: 2,000 streams (past the old pool of 1,024, whose stream 1,025
    shared stream 1's counter), 8 threads launching mixed reductions on them at once, every
    result bitwise equal to the same call's on one thread."""
    arrays = [_mixed(s) for s in range(4)]
    want = [[cp.asnumpy(o) for o in _run(a)] for a in arrays]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2000)]

    def work(i):
        bad = []
        for k in range(i, len(streams), 8):
            with streams[k]:
                got = _run(arrays[k % 4])
            streams[k].synchronize()
            for g, w in zip(got, want[k % 4]):
                if not np.array_equal(cp.asnumpy(g), w):
                    bad.append(k)
        return bad

    for _ in range(2):       # the second round: every ticket left at zero by the first
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            bad = sum(pool.map(work, range(8)), [])
        assert bad == []


def test_a_jitted_loss_traced_from_eight_threads():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupyloss.jax as JL

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    keys = jax.random.split(jax.random.PRNGKey(0), 8)

    def one(i):
        x = jax.random.normal(keys[i], (64 + i, 300), jnp.float32)
        t = jnp.arange(64 + i, dtype=jnp.int32) % 300
        f = jax.jit(jax.value_and_grad(lambda a: JL.cross_entropy(a, t, label_smoothing=0.1)))
        loss, g = f(x)
        ref = jax.value_and_grad(lambda a: jnp.mean(
            -jnp.sum(jax.nn.log_softmax(a) * (0.9 * jax.nn.one_hot(t, 300) + 0.1 / 300), -1)))
        want, wg = ref(x)
        return float(abs(loss - want)), float(jnp.max(jnp.abs(g - wg)))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(one, range(8)))
    assert all(e < 1e-5 and ge < 1e-6 for e, ge in errors), errors


def test_a_damaged_cache_entry_heals_in_a_new_process(tmp_path):
    """A truncated cubin in the cache is recompiled by the next process that needs it, and the
    loss is right; a zero-byte mapping likewise."""
    env = dict(os.environ, CUPYLOSS_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    code = textwrap.dedent("""
        import cupy, cupyloss
        x = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
        print(float(cupyloss.mse_loss(x, x * 0)))
    """)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    cubins = sorted(tmp_path.glob("*.cubin"))
    assert cubins
    for k, c in enumerate(cubins):
        if k % 2:
            c.with_suffix(".json").write_bytes(b"")
        else:
            c.write_bytes(c.read_bytes()[:100])
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert float(again.stdout) == float(first.stdout)            # float32 mean of 0..121
    assert abs(float(first.stdout) - np.mean(np.arange(12.0) ** 2)) < 1e-6 * 43
    for c in cubins:
        assert c.stat().st_size > 100 and c.with_suffix(".json").stat().st_size > 0


def test_rejected_targets_are_counted_on_the_device():
    """Out-of-range class indices give NaN rows and are counted once a row, by cross_entropy
    (rows and strided layouts), nll_loss, multi_margin_loss and the fused head; reading the count
    needs no sync until int()."""
    cupyloss.rejected_targets(reset=True)
    assert int(cupyloss.rejected_targets()) == 0
    x = cp.random.standard_normal((64, 1000), dtype=cp.float32)
    t = cp.arange(64, dtype=cp.int64)
    t[[3, 9, 40]] = cp.asarray([1000, -5, 5000])
    t[7] = -100
    loss = cupyloss.cross_entropy(x, t, reduction="none")
    assert int(cp.isnan(loss).sum()) == 3
    assert int(cupyloss.rejected_targets()) == 3
    cupyloss.cross_entropy_value_and_grad(x, t)
    assert int(cupyloss.rejected_targets()) == 6
    cupyloss.nll_loss(x, t)
    assert int(cupyloss.rejected_targets()) == 9
    cupyloss.multi_margin_loss(x, t)            # no ignore_index there: -100 is rejected too
    assert int(cupyloss.rejected_targets()) == 13
    xs = cp.random.standard_normal((4, 10, 6), dtype=cp.float32)    # (N, C, d): the cols kernel
    ts = cp.zeros((4, 6), cp.int64)
    ts[1, 2] = 10
    cupyloss.cross_entropy(xs, ts)
    assert int(cupyloss.rejected_targets(reset=True)) == 14
    assert int(cupyloss.rejected_targets()) == 0
    h = cp.random.standard_normal((64, 32), dtype=cp.float32)
    w = cp.random.standard_normal((1000, 32), dtype=cp.float32)
    assert bool(cp.isnan(cupyloss.linear_cross_entropy(h, w, t)))
    assert int(cupyloss.rejected_targets()) >= 3
    with pytest.raises(IndexError, match="Target 1000 is out of bounds."):
        cupyloss.linear_cross_entropy(h, w, t, check_targets=True)


def test_layouts_are_read_as_they_are_or_refused():
    x = cp.random.standard_normal((8, 16), dtype=cp.float32)
    t = cp.arange(8, dtype=cp.int64)
    # inplace on rows that overlap in memory: refused (it would write some elements twice)
    base = cp.random.standard_normal(8 * 8 + 8, dtype=cp.float32)
    overlapping = cp.lib.stride_tricks.as_strided(base, (8, 16), (32, 4))
    with pytest.raises(ValueError, match="distinct in memory"):
        cupyloss.cross_entropy_value_and_grad(overlapping, t, inplace=True)
    # byte strides that are not whole elements: refused
    raw = cp.zeros(8 * 16 * 4 + 2, cp.uint8)[2:].view(cp.uint8)
    odd = cp.ndarray((8, 16), cp.float32, raw.data, strides=(64, 4))
    odd = cp.lib.stride_tricks.as_strided(odd, (8, 16), (66, 4))
    with pytest.raises(ValueError, match="not multiples of its element size"):
        cupyloss.cross_entropy(odd, t)
    # the fused head: targets of other integer dtypes refused, strided class weights read right
    h = cp.random.standard_normal((8, 4), dtype=cp.float32)
    w = cp.random.standard_normal((16, 4), dtype=cp.float32)
    with pytest.raises(TypeError, match="int32 or int64"):
        cupyloss.linear_cross_entropy(h, w, t.astype(cp.uint8))
    cw = cp.random.uniform(0.5, 1.5, 32).astype(cp.float32)[::2]
    got = cupyloss.linear_cross_entropy(h, w, t, class_weight=cw)
    want = cupyloss.cross_entropy(h @ w.T, t, weight=cp.ascontiguousarray(cw))
    assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))


def test_vocab_parallel_refuses_strided_weights_and_other_target_dtypes():
    from cupyloss import parallel

    x = cp.random.standard_normal((8, 16), dtype=cp.float32)
    t = cp.arange(8, dtype=cp.int64)
    w = cp.ones(64, cp.float32)[::2]
    with pytest.raises(ValueError, match="weight must be contiguous"):
        parallel.vocab_parallel_stats(x, t, 0, 32, w)
    with pytest.raises(ValueError, match="int32 or int64"):
        parallel.vocab_parallel_stats(x, t.astype(cp.int16), 0, 32)


def test_vocab_parallel_rows_whose_slices_disagree_are_nan_and_counted():
    """Two slices on one GPU, as two ranks would compute them, merged by the kernel: a row whose
    ranks were given different classes is NaN, the others equal cross_entropy's."""
    from cupyloss import parallel

    cupyloss.rejected_targets(reset=True)
    x = cp.random.standard_normal((32, 100), dtype=cp.float32)
    t = cp.random.randint(0, 100, 32).astype(cp.int64)
    t1 = t.copy()
    t1[5] = (t[5] + 50) % 100
    s0 = parallel.vocab_parallel_stats(x[:, :60], t, 0, 100)
    s1 = parallel.vocab_parallel_stats(x[:, 60:], t1, 60, 100)
    assert s0.shape == (32, parallel.FIELDS)
    loss, lse, wy = parallel.combine_stats(cp.stack([s0, s1]), t, 100)
    want = cupyloss.cross_entropy(x, t, reduction="none")
    nan = cp.isnan(loss)
    assert nan.tolist() == [k == 5 for k in range(32)]
    np.testing.assert_allclose(cp.asnumpy(loss[~nan]), cp.asnumpy(want[~nan]), rtol=1e-5)
    assert int(cupyloss.rejected_targets()) == 1
    # the same statistics merged on the host (NumPy) agree
    host = parallel.combine_stats(cp.asnumpy(cp.stack([s0, s1])), cp.asnumpy(t), 100)
    assert np.isnan(host[0]).tolist() == nan.tolist()
