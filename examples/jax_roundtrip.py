"""cupyloss losses inside JAX programs: jax.jit, jax.grad and a small training loop.

    python examples/jax_roundtrip.py

Runs with JAX's own memory settings (it preallocates 75% of the GPU): the kernels write into
XLA's buffers and take nothing from CuPy's memory pool, which the example checks.  For each loss
and reduction, the value and both gradients of cupyloss.jax under jax.jit(jax.value_and_grad(...))
are checked against the same expression written in jax.numpy; then a linear model is fitted by
gradient descent twice, once with cupyloss.jax.mse_loss and once with the jnp formula, and the
two final losses are compared; last, the three losses' jit(value_and_grad) on [8192, 8192]
float32 are timed against XLA's fused jnp versions (cupyloss.bench.jax_adapter has every loss).  Prints
what it checked and exits non-zero if a check fails.
"""

import os
import sys


def _setup():
    try:
        import jax

        if not jax.devices("gpu"):
            raise RuntimeError("JAX sees no GPU")
    except Exception as exc:  # no JAX, no GPU backend, or no GPU
        print(f"this example needs JAX with an NVIDIA GPU; none is usable here ({exc}).")
        sys.exit(1)
    import cupyloss.jax

    return jax, cupyloss.jax


def main() -> int:
    jax, JL = _setup()
    import jax.numpy as jnp
    import numpy as np

    def reference(name, x, t, reduction):
        if name == "mse_loss":
            v = (x - t) ** 2
        elif name == "kl_div":
            v = jax.scipy.special.xlogy(t, t) - t * x
        else:
            v = jnp.maximum(1.0 - x * t, 0.0)
        if reduction == "none":
            return v
        if reduction == "batchmean":
            return jnp.sum(v) / x.shape[0]
        return jnp.sum(v) if reduction == "sum" else jnp.mean(v)

    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 1.0, (256, 1000))
    q = rng.uniform(0.05, 1.0, (256, 1000))
    inputs = {
        "mse_loss": (rng.standard_normal((256, 1000)), rng.standard_normal((256, 1000))),
        "kl_div": (np.log(p / p.sum(-1, keepdims=True)), q / q.sum(-1, keepdims=True)),
        "hinge_loss": (rng.standard_normal((256, 1000)), np.sign(rng.standard_normal(1000))),
    }
    ok = True
    for name, (x, t) in inputs.items():
        x, t = jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32)
        for reduction in ("mean", "sum", "none") + (("batchmean",) if name == "kl_div" else ()):
            w = jnp.asarray(rng.standard_normal((256, 1000) if reduction == "none" else ()),
                            jnp.float32)

            def ours(a, b):
                return jnp.sum(JL.LOSSES[name](a, b, reduction=reduction) * w)

            def theirs(a, b):
                return jnp.sum(reference(name, a, b, reduction) * w)

            got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(x, t)
            want = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1)))(x, t)
            errors = [float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
                      for a, b in zip([got[0], *got[1]], [want[0], *want[1]])]
            good = max(errors) < 1e-4
            ok &= good
            print(f"{name:10s} {reduction:9s} jit(value_and_grad) vs jnp: value {errors[0]:.1e}, "
                  f"d/dinput {errors[1]:.1e}, d/dtarget {errors[2]:.1e} "
                  f"{'ok' if good else 'MISMATCH'}")

    a = jnp.asarray(rng.standard_normal((4096, 64)), jnp.float32)
    w_true = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    y = a @ w_true

    def fit(loss):
        step = jax.jit(lambda w: w - 0.1 * jax.grad(lambda v: loss(a @ v, y))(w))
        w = jnp.zeros((64, 8), jnp.float32)
        for _ in range(200):
            w = step(w)
        return float(loss(a @ w, y))

    final_ours = fit(JL.mse_loss)
    final_theirs = fit(lambda u, v: jnp.mean((u - v) ** 2))
    good = abs(final_ours - final_theirs) <= 1e-3 * max(final_theirs, 1e-6) + 1e-7
    ok &= good
    print(f"linear fit, 200 steps of gradient descent: final loss {final_ours:.6g} (cupyloss) "
          f"{final_theirs:.6g} (jnp) {'ok' if good else 'MISMATCH'}")

    import cupy

    from cupyloss.bench import jax_adapter as bench_jax

    setting = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "unset: JAX preallocated")
    limit = jax.devices()[0].memory_stats().get("bytes_limit", 0)
    pooled = cupy.get_default_memory_pool().total_bytes()
    copies = JL._engine.copies + JL._engine.pooled
    good = pooled == 0 and copies == 0
    ok &= good
    print(f"memory: XLA_PYTHON_CLIENT_PREALLOCATE {setting}, XLA's pool {limit / 2**30:.1f} GiB; "
          f"CuPy's pool {pooled} bytes, results copied or pooled {copies} "
          f"{'ok' if good else 'MISMATCH'}")
    bw = bench_jax.copy_bandwidth(reps=5, calls=10)
    print(f"jit(value_and_grad) on [8192, 8192] float32, ms per call (XLA copy {bw:.0f} GB/s):")
    print(f"{'case':46} {'cupyloss':>8} {'XLA':>8} {'XLA/ours':>8} {'%lim':>6} {'XLA%':>6}")
    elementwise = bench_jax._jnp_losses()
    for name in inputs:
        arrays = bench_jax._pointwise_arrays(name, 8192, jnp.float32, jax.random.key(0))
        bench_jax._case(name, name, arrays, bench_jax._ours(name),
                        bench_jax._theirs_pointwise(elementwise[name]),
                        sum(a.nbytes for a in arrays) + arrays[0].nbytes, bw, reps=5, calls=10)
        del arrays
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
