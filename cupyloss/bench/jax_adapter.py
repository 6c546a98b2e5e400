"""Benchmark cupyloss.jax against XLA's own fused jax.numpy version of each loss.

    python -m cupyloss.bench.jax_adapter [--size 8192] [--only mse_loss,cross_entropy] [--reps 7]
                                 [--calls 50] [--json out.json]

Times jax.jit(jax.value_and_grad(f)) (the gradient of the first argument, as jax.grad gives by
default), with cupyloss.jax's f and with a jnp f written the way torch defines the loss, which
XLA fuses:
  every pointwise loss   [size, size] float32 and bfloat16, reduction='mean'
  cross_entropy          KernelBench 95 ([32768, 4096] float32) and an LLM head's
                         [8192, 128256] bfloat16, int32 targets
  triplet_margin_loss    KernelBench 99 (3 x [32768, 8192] float32)
Each time is the median of --reps rounds, each the wall time of --calls back-to-back calls
divided by --calls (the host queues ahead of the GPU, as in a training loop), the two
implementations taking turns.  The read + write limit of a case is its compulsory traffic (each
argument read once, the loss and the gradient written once) at the copy bandwidth XLA reaches
in the same run (y = x + 1 on 1 GiB, counting bytes read and written).  First, the host cost of
a call: the same loop on [32, 32] float32 mse_loss, where the GPU's work is negligible.  Runs
with JAX's default memory settings.  Never used as a test.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from cupyloss.bench import _timing


def _jnp_losses():
    """name -> jnp elementwise loss of the arrays, as torch defines it (float32 math)."""
    import jax
    import jax.numpy as jnp

    def softplus(z):
        return jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))

    def bce_logits(x, t):
        return softplus(x) - x * t

    def focal(x, t, alpha=0.25, gamma=2.0):
        p = jax.nn.sigmoid(x)
        p_t = p * t + (1 - p) * (1 - t)
        return (alpha * t + (1 - alpha) * (1 - t)) * bce_logits(x, t) * (1 - p_t) ** gamma

    def huber(x, t, delta=1.0):
        d = jnp.abs(x - t)
        return jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))

    return {
        "mse_loss": lambda x, t: (x - t) ** 2,
        "kl_div": lambda x, t: jax.scipy.special.xlogy(t, t) - t * x,
        "hinge_loss": lambda x, t: jnp.maximum(1.0 - x * t, 0.0),
        "l1_loss": lambda x, t: jnp.abs(x - t),
        "smooth_l1_loss": huber,
        "huber_loss": huber,
        "binary_cross_entropy": lambda x, t: -(t * jnp.maximum(jnp.log(x), -100.0)
                                              + (1 - t) * jnp.maximum(jnp.log1p(-x), -100.0)),
        "binary_cross_entropy_with_logits": bce_logits,
        "soft_margin_loss": lambda x, t: softplus(-x * t),
        "hinge_embedding_loss": lambda x, t: jnp.where(t == 1.0, x, 0.0)
        + jnp.where(t == -1.0, jnp.maximum(1.0 - x, 0.0), 0.0),
        "margin_ranking_loss": lambda a, b, t: jnp.maximum(-t * (a - b), 0.0),
        "poisson_nll_loss": lambda x, t: jnp.exp(x) - t * x,
        "gaussian_nll_loss": lambda x, t, v: 0.5 * (jnp.log(jnp.maximum(v, 1e-6))
                                                    + (x - t) ** 2 / jnp.maximum(v, 1e-6)),
        "squared_hinge_loss": lambda x, t: jnp.maximum(1.0 - x * t, 0.0) ** 2,
        "sigmoid_focal_loss": focal,
        "log_cosh_loss": lambda x, t: jnp.abs(x - t) + jnp.log1p(jnp.exp(-2 * jnp.abs(x - t)))
        - math.log(2.0),
    }


def _pointwise_arrays(name, n, dtype, key):
    """The arrays of a pointwise loss on [n, n]: in each loss's domain."""
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (n, n), jnp.float32)
    y = jax.random.normal(k2, (n, n), jnp.float32)
    u = jax.random.uniform(k3, (n, n), jnp.float32, 0.01, 0.99)
    sign = jnp.where(y >= 0, 1.0, -1.0)
    arrays = {
        "kl_div": (-jnp.abs(x), u),
        "hinge_loss": (x, sign), "soft_margin_loss": (x, sign),
        "hinge_embedding_loss": (x, sign), "squared_hinge_loss": (x, sign),
        "binary_cross_entropy": (u, jnp.round(u)),
        "binary_cross_entropy_with_logits": (x, u),
        "sigmoid_focal_loss": (x, jnp.round(u)),
        "margin_ranking_loss": (x, y, sign),
        "poisson_nll_loss": (x, 3.0 * u),
        "gaussian_nll_loss": (x, y, u + 0.5),
    }.get(name, (x, y))
    return tuple(a.astype(dtype) for a in arrays)


def _ours(name):
    import cupyloss.jax as JL

    loss = JL.LOSSES[name]
    return lambda *a: loss(*a, reduction="mean")


def _theirs_pointwise(elementwise):
    import jax.numpy as jnp

    def f(*a):
        return jnp.mean(elementwise(*(x.astype(jnp.float32) for x in a))).astype(a[0].dtype)

    return f


def _theirs_cross_entropy(x, t):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=-1)).astype(x.dtype)


def _theirs_triplet(a, p, n, margin=1.0, eps=1e-6):
    import jax.numpy as jnp

    d_ap = jnp.sqrt(jnp.sum((a - p + eps) ** 2, axis=-1))
    d_an = jnp.sqrt(jnp.sum((a - n + eps) ** 2, axis=-1))
    return jnp.mean(jnp.maximum(d_ap - d_an + margin, 0.0))


def _wall_ms(fn, args, calls: int) -> float:
    """Wall milliseconds per call of `calls` back-to-back calls, waited for at the end."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / calls


def copy_bandwidth(reps: int, calls: int) -> float:
    """GB/s of y = x + 1 on 1 GiB of float32 under jit (bytes read plus written)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 28,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    ms = statistics.median(_wall_ms(f, (x,), calls) for _ in range(reps))
    del x
    return 2 * (1 << 30) / ms / 1e6


def _case(label, name, args, ours, theirs, traffic, bw, reps, calls):
    import jax

    argnums = 0
    fns = {"cupyloss": jax.jit(jax.value_and_grad(ours, argnums=argnums)),
           "xla": jax.jit(jax.value_and_grad(theirs, argnums=argnums))}
    per = {k: [] for k in fns}
    for _ in range(reps):
        for who, fn in fns.items():
            per[who].append(_wall_ms(fn, args, calls))
    ms = {who: statistics.median(v) for who, v in per.items()}
    limit = traffic / bw / 1e6
    row = dict(case=label, loss=name, ms=ms["cupyloss"], xla_ms=ms["xla"],
               xla_over_ours=ms["xla"] / ms["cupyloss"], limit_ms=limit,
               pct_limit=100 * limit / ms["cupyloss"], xla_pct_limit=100 * limit / ms["xla"],
               reps=reps, calls=calls)
    print(f"{label:46} {row['ms']:8.3f} {row['xla_ms']:8.3f} {row['xla_over_ours']:7.2f}x "
          f"{row['pct_limit']:6.1f} {row['xla_pct_limit']:6.1f}", flush=True)
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m cupyloss.bench.jax_adapter",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192, help="side of the pointwise arrays")
    parser.add_argument("--only", default="", help="comma-separated loss names")
    parser.add_argument("--reps", type=int, default=7, help="rounds a median is taken of")
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls a round")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    _timing.need(parser.prog, jax=True)
    import jax
    import jax.numpy as jnp

    only = set(filter(None, args.only.split(",")))
    device = jax.devices()[0].device_kind
    bw = copy_bandwidth(args.reps, args.calls)
    print(f"{device}: XLA copy {bw:.0f} GB/s; jit(value_and_grad), ms per call; "
          f"% of the read + write limit")
    print(f"{'case':46} {'cupyloss':>8} {'XLA':>8} {'XLA/ours':>8} {'%lim':>6} {'XLA%':>6}")
    rows = []
    key = jax.random.key(0)
    small = _pointwise_arrays("mse_loss", 32, jnp.float32, key)
    rows.append(_case("host cost: mse_loss [32, 32] float32", "mse_loss", small,
                      _ours("mse_loss"), _theirs_pointwise(_jnp_losses()["mse_loss"]), 0, bw,
                      args.reps, args.calls))
    n = args.size
    for name, elementwise in _jnp_losses().items():
        if only and name not in only:
            continue
        for dtype in (jnp.float32, jnp.bfloat16):
            arrays = _pointwise_arrays(name, n, dtype, key)
            traffic = sum(a.nbytes for a in arrays) + arrays[0].nbytes
            rows.append(_case(f"{name} [{n}, {n}] {jnp.dtype(dtype).name}", name, arrays,
                              _ours(name), _theirs_pointwise(elementwise), traffic, bw,
                              args.reps, args.calls))
            del arrays
    for label, (r, c), dtype in (("cross_entropy KernelBench 95", (32768, 4096), jnp.float32),
                                 ("cross_entropy LLM head", (8192, 128256), jnp.bfloat16)):
        if only and "cross_entropy" not in only:
            continue
        k1, k2 = jax.random.split(key)
        x = jax.random.normal(k1, (r, c), jnp.float32).astype(dtype)
        t = jax.random.randint(k2, (r,), 0, c, jnp.int32)
        rows.append(_case(f"{label} [{r}, {c}] {jnp.dtype(dtype).name}", "cross_entropy",
                          (x, t), _ours("cross_entropy"), _theirs_cross_entropy,
                          2 * x.nbytes + t.nbytes, bw, args.reps, args.calls))
        del x, t
    if not only or "triplet_margin_loss" in only:
        ks = jax.random.split(key, 3)
        a, p, q = (jax.random.normal(k, (32768, 8192), jnp.float32) for k in ks)
        rows.append(_case("triplet_margin_loss KernelBench 99 3 x [32768, 8192]",
                          "triplet_margin_loss", (a, p, q), _ours("triplet_margin_loss"),
                          _theirs_triplet, 4 * a.nbytes, bw, args.reps, args.calls))
        del a, p, q
    for r in rows:
        r.update(device=device, copy_gbps=bw)
    return _timing.save(args.json, rows)


if __name__ == "__main__":
    main()
