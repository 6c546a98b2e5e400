"""Benchmark the weight-gradient sums of the fused head: a float32 sum against the split one.

    python -m cupyloss.bench.split [--rows 8192,16384] [--slices 8,16,32,64] [--reps 5]
                                   [--json out.json]

linear_cross_entropy_value_and_grad on bfloat16 hidden (rows, 4096) and weight (128256, 4096),
its budget picking each plan (cupyloss.linear.plan): "keep" where every row's dZ fits the
default budget, "sum" with a float32 V x H sum, "sum" split into 16-bit halves with float32
slices of each size (MiB: linear.SPLIT_SLICE_BYTES), and "slices" in 256 MiB.  Each row: the
device time (median ms, the host's queueing kept out: _timing.gpu_ms), the wall time of a call
from an idle GPU to its end (median ms: a host that cannot keep ahead shows here) and the
workspace the plan holds (GiB).  Never used as a test.
"""

from __future__ import annotations

import statistics
import time

from cupyloss.bench import _timing
from cupyloss.bench.linear import H, V


def _wall_ms(cupy, fn, reps):
    out = []
    for _ in range(reps):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.split", __doc__, 5)
    ap.add_argument("--rows", default="8192,16384")
    ap.add_argument("--slices", default="8,16,32,64", help="split slices' MiB, comma-separated")
    args = ap.parse_args(argv)
    _timing.need(ap.prog)
    import cupy
    import numpy

    import cupyloss
    from cupyloss import linear
    from cupyloss._core import dtypes as _dtypes

    bf16 = _dtypes.lookup("bfloat16").dtype
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows_out = []
    rng = cupy.random.default_rng(0)
    w = (rng.standard_normal((V, H), numpy.float32) * 0.02).astype(bf16)
    keep_default = linear.SPLIT_SLICE_BYTES
    for n in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((n, H), numpy.float32).astype(bf16)
        t = cupy.asarray(numpy.random.default_rng(1).integers(0, V, n))
        chunk = 1024 * V * 6
        cases = [("keep", None, keep_default),
                 ("sum float32", V * H * 4 + chunk, keep_default)]
        for mib in (int(s) for s in args.slices.split(",")):
            b = mib << 20
            cols = linear._fit(b, H * 4, V, V)
            cases.append((f"sum split {mib} MiB", V * H * 2 + cols * H * 4 + chunk, b))
        cases.append(("slices", 256 << 20, keep_default))
        print(f"{name}: linear_cross_entropy_value_and_grad, hidden ({n}, {H}), weight ({V}, "
              f"{H}) bf16")
        print(f"{'plan':22} {'device ms':>10} {'wall ms':>9} {'workspace GiB':>14}")
        for label, budget, slice_bytes in cases:
            linear.SPLIT_SLICE_BYTES = slice_bytes
            try:
                pl = linear.plan(n, V, H, 2, budget)
                if label != "keep" and label.split()[0] != pl.kind:
                    print(f"{label:22} (the budget gives {pl.kind}: skipped)")
                    continue

                def call():
                    return cupyloss.linear_cross_entropy_value_and_grad(
                        x, w, t, max_workspace_bytes=budget)

                ms = _timing.gpu_ms(call, args.reps)
                wall = _wall_ms(cupy, call, args.reps)
            finally:
                linear.SPLIT_SLICE_BYTES = keep_default
            rows_out.append(dict(device=name, rows=n, plan=label, kind=pl.kind, cols=pl.cols,
                                 ms=ms, wall_ms=wall, workspace_gib=pl.bytes / 2**30))
            print(f"{label:22} {ms:10.2f} {wall:9.2f} {pl.bytes / 2**30:14.3f}", flush=True)
        x = None
        _timing.release()
    return _timing.save(args.json, rows_out)


if __name__ == "__main__":
    main()
