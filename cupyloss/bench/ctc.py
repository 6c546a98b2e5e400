"""Benchmark ctc_loss's forward + backward against torch's CUDA CTC, cuDNN's and optax's.

    python -m cupyloss.bench.ctc [--shapes 1000x32x32x100,...] [--reps 7] [--no-jax]
                                 [--json out.json]

Each shape is T x N x C x S: T frames (every input length T, as cuDNN needs), N sequences, C
classes (32: characters; 1024: subwords), padded targets of S labels (lengths drawn in
[0.8 S, S], labels in [1, C), blank 0), float32 log-probabilities, reduction 'mean'.  Timed,
the median of --reps runs of one forward and backward each:
  torch native    F.ctc_loss with cuDNN off, lengths as tuples (no sync)
  torch cudnn     F.ctc_loss where torch can use cuDNN (int32 concatenated targets on the CPU,
                  S <= 256): torch._use_cudnn_ctc_loss says so, else the row is left out
  cupyloss.torch  cupyloss.torch.ctc_loss, lengths as CUDA tensors
  optax           jax.jit(jax.value_and_grad(optax.ctc_loss(...).mean())) on (N, T, C) logits
  cupyloss.jax    the same with cupyloss.jax.optax_ctc_loss
  (the two JAX rows include the log_softmax optax applies; the torch rows take log-probs)
Device time for torch (CUDA events around each call, the stream held until it is queued);
for JAX the wall time of --calls back-to-back calls over --calls.  Peak memory: torch's
allocator peak above the inputs during one call; for JAX the compiled program's temporary and
output bytes (XLA's memory analysis).  Never used as a test.
"""

from __future__ import annotations

import os
import statistics
import time

from cupyloss.bench import _timing

SHAPES = ("1000x32x32x100", "1000x64x1024x200", "4000x32x32x250", "4000x64x1024x400",
          "4000x64x32x400", "1000x32x1024x400")


def _inputs(torch, steps, n, classes, smax, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lp = torch.randn(steps, n, classes, device="cuda", generator=g).log_softmax(-1)
    tl = torch.randint(int(0.8 * smax), smax + 1, (n,), generator=g, device="cuda").cpu()
    tg = torch.randint(1, classes, (n, smax), generator=g, device="cuda")
    return lp, tg, tl


def _torch_rows(torch, shape, reps):
    import cupyloss.torch as CF

    F = torch.nn.functional
    steps, n, classes, smax = shape
    lp, tg, tl = _inputs(torch, *shape)
    il = torch.full((n,), steps, dtype=torch.int64)
    leaf = lp.clone().requires_grad_()
    rows = {}
    stream = torch.cuda.current_stream().cuda_stream

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows[name] = (_timing.gpu_ms(fn, reps, stream=stream), peak)

    il_t, tl_t = tuple(il.tolist()), tuple(tl.tolist())

    def native():
        leaf.grad = None
        with torch.backends.cudnn.flags(enabled=False):
            F.ctc_loss(leaf, tg, il_t, tl_t).backward()

    timed("torch native", native)
    concat = torch.cat([tg[b, :tl[b]] for b in range(n)]).to(torch.int32).cpu()
    if torch._use_cudnn_ctc_loss(leaf, concat, il_t, tl_t, 0):
        def cudnn():
            leaf.grad = None
            F.ctc_loss(leaf, concat, il_t, tl_t).backward()

        timed("torch cudnn", cudnn)
    il_d, tl_d = il.cuda(), tl.cuda()

    def ours():
        leaf.grad = None
        CF.ctc_loss(leaf, tg, il_d, tl_d).backward()

    timed("cupyloss.torch", ours)
    del leaf, lp
    return rows


def _jax_rows(shape, reps, calls):
    import jax
    import jax.numpy as jnp
    import numpy

    import cupyloss.jax as JL

    try:
        import optax
    except ImportError:
        optax = None
    steps, n, classes, smax = shape
    rng = numpy.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((n, steps, classes), numpy.float32))
    tl = rng.integers(int(0.8 * smax), smax + 1, n)
    labels = jnp.asarray(rng.integers(1, classes, (n, smax)), jnp.int32)
    pad = jnp.zeros((n, steps), jnp.float32)
    lpad = jnp.asarray((numpy.arange(smax)[None] >= tl[:, None]).astype(numpy.float32))
    rows = {}
    ways = [("cupyloss.jax", JL.optax_ctc_loss)]
    if optax is not None:
        ways.insert(0, ("optax", optax.ctc_loss))
    for name, loss in ways:
        f = jax.jit(jax.value_and_grad(lambda z, loss=loss: loss(z, pad, labels, lpad).mean()))
        stats = f.lower(logits).compile().memory_analysis()
        peak = (stats.temp_size_in_bytes + stats.output_size_in_bytes) / 2**30 \
            if stats is not None else float("nan")
        jax.block_until_ready(f(logits))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(calls):
                out = f(logits)
            jax.block_until_ready(out)
            times.append(1e3 * (time.perf_counter() - start) / calls)
        rows[name] = (statistics.median(times), peak)
    return rows


def main(argv=None):
    ap = _timing.arguments("python -m cupyloss.bench.ctc", __doc__, reps=7)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="T x N x C x S, comma-separated")
    ap.add_argument("--calls", type=int, default=5, help="JAX calls a timed round")
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    torch, gpu = _timing.torch_gpu(ap.prog)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"{gpu}; ctc_loss forward + backward, float32, reduction='mean': ms (peak GiB)")
    names = ("torch native", "torch cudnn", "cupyloss.torch", "optax", "cupyloss.jax")
    print(f"{'T x N x C x S':>20} " + " ".join(f"{n:>20}" for n in names)
          + f" {'vs native':>10} {'vs optax':>9}")
    out = []
    for shape in shapes:
        rows = _torch_rows(torch, shape, args.reps)
        torch.cuda.empty_cache()
        if not args.no_jax:
            rows.update(_jax_rows(shape, args.reps, args.calls))
        cells = [f"{rows[n][0]:9.3f} ({rows[n][1]:6.2f})" if n in rows else "-" for n in names]
        native = rows["torch native"][0] / rows["cupyloss.torch"][0]
        vs_optax = (rows["optax"][0] / rows["cupyloss.jax"][0]
                    if "optax" in rows and "cupyloss.jax" in rows else float("nan"))
        print(f"{'x'.join(map(str, shape)):>20} " + " ".join(f"{c:>20}" for c in cells)
              + f" {native:9.1f}x {vs_optax:8.1f}x", flush=True)
        out.append({"shape": shape, "gpu": gpu,
                    **{n: {"ms": v[0], "peak_gib": v[1]} for n, v in rows.items()}})
    _timing.save(args.json, out)


if __name__ == "__main__":
    main()
