"""What the GPU allows a read/write mix, and what each schedule leaves of it.

    python -m cupyloss.bench.bandwidth [--reps 20] [--sizes 33554432,268435456] [--json out.json]

For each mix (float32 arrays of `size` elements: 1 read and 1 written, as a loss's gradient
with a broadcast or fixed partner; 2 and 2, as value_and_grad of a two-array loss; 2 and 0, as
its forward), kernels/bench.cu's `streams` kernel, the plainest code of that mix, runs in two
schedules:
  one pass     a grid that covers the arrays once: each block takes one tile and leaves
  grid-stride  16 waves of resident blocks (8 an SM of 256 threads) walking the arrays
The table gives GB/s (bytes read + written over the median time of --reps runs, CUDA events
after warm-up, _timing.gpu_ms) and the share of cudaMemcpy's device-to-device bandwidth over
2 GiB in the same run (read + write), the figure the loss benchmarks call the limit.  What a
loss's kernel reaches against these says how much of its gap is the card's and how much its
schedule's.  Never used as a test.
"""

from __future__ import annotations

import argparse

# arrays read and written: _source.BENCH_STREAMS
MIXES = {"1 in, 1 out": (1, 1), "2 in, 2 out": (2, 2), "2 in, 0 out": (2, 0)}
STEPS = 8            # vectors a thread takes a pass (STEPS in kernels/bench.cu)
GRID_WAVES = 16      # the grid-stride schedule's waves of resident blocks
SIZES = (8192 * 4096, 16384 * 16384)   # bench.broadcast's patterns; KernelBench's kl_div


def memcpy_gbs(reps: int) -> float:
    """Read + write GB/s of cudaMemcpy device to device over 2 GiB."""
    import cupy

    from cupyloss.bench import _timing

    src = cupy.ones(2**29, cupy.float32)
    dst = cupy.empty_like(src)
    ms = _timing.gpu_ms(lambda: dst.data.copy_from_device(src.data, src.nbytes), reps)
    src = dst = None
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * 2**31 / ms / 1e6


def schedules(n_vec: int, sm_count: int) -> dict[str, int]:
    """Grid of each schedule over n_vec 16-byte vectors (256-thread blocks)."""
    from cupyloss._core import launch as _launch

    tile = _launch.BLOCK * STEPS
    return {"one pass": -(-n_vec // tile),
            "grid-stride": min(-(-n_vec // tile), sm_count * _launch.BLOCKS_PER_SM * GRID_WAVES)}


def run(sizes, reps: int) -> dict:
    import cupy

    from cupyloss._core import launch as _launch, source as _source
    from cupyloss.bench import _timing

    sm_count = _launch.device_limits(cupy.cuda.runtime.getDevice()).sm_count
    out = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "memcpy_gbs": memcpy_gbs(reps), "rows": []}
    for size in sizes:
        n_vec = size // 4
        for mix, (r, w) in MIXES.items():
            kernel = _source.function("bench.cu", _source.bench_streams_name(r, w))
            arrays = [cupy.ones(size, cupy.float32) for _ in range(max(r, 1) + max(w, 1))]
            a, b = arrays[0], arrays[1 if r > 1 else 0]
            c, d = arrays[r], arrays[r + (1 if w > 1 else 0)]
            nbytes = (r + w) * size * 4
            for name, grid in schedules(n_vec, sm_count).items():
                def call(grid=grid):
                    kernel((grid,), (_launch.BLOCK,), (a, b, c, d, cupy.int64(n_vec)))
                ms = _timing.gpu_ms(call, reps)
                gbs = nbytes / ms / 1e6
                out["rows"].append({"size": size, "mix": mix, "schedule": name, "grid": grid,
                                    "ms": ms, "gbs": gbs, "pct": 100 * gbs / out["memcpy_gbs"]})
            arrays = a = b = c = d = None
            cupy.get_default_memory_pool().free_all_blocks()
    return out


def table(result: dict) -> str:
    lines = [f"device: {result['device']}; cudaMemcpy {result['memcpy_gbs']:.0f} GB/s "
             "(read + write, 2 GiB)",
             f"{'elements':>10}  {'mix':12} {'schedule':12} {'grid':>8} {'ms':>8} {'GB/s':>6} "
             f"{'% memcpy':>8}"]
    for row in result["rows"]:
        lines.append(f"{row['size']:>10}  {row['mix']:12} {row['schedule']:12} {row['grid']:>8} "
                     f"{row['ms']:>8.4f} {row['gbs']:>6.0f} {row['pct']:>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cupyloss.bench.bandwidth",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="timed runs a median is taken of")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="comma-separated float32 element counts per array")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    from cupyloss.bench import _timing

    _timing.need(parser.prog)
    result = run([int(s) for s in args.sizes.split(",")], args.reps)
    print(table(result))
    return _timing.save(args.json, result)


if __name__ == "__main__":
    main()
