"""Benchmark the seed workloads against torch eager, torch.compile and plain CuPy.

    python -m cupyloss.bench [--scale 1.0] [--reps 20] [--json out.json] [--small-only]
                             [--plot bench.png] [--only mse,smooth_l1] [--family]

First the small-call case: host microseconds per call on 1K-element fp32 inputs (reduced loss,
GPU otherwise idle), cupyloss on CuPy arrays and on torch tensors against torch eager's
F.mse_loss in the same run; the ratio to torch eager is what matters.  Then the large ones.

Times (median of 3 rounds, each the median of --reps device-timed runs, implementations taking
turns; see _timing) the forward and value_and_grad of:
  mse    mse_loss(x, y), x, y float32 [32768, 32768]
  kl     kl_div(p, q, 'batchmean'), probabilities in (cupyloss fuses the log), float32 [16384]^2
  hinge  mean(clamp(1 - x t, min=0)), x float32 [32768, 32768], t float32 [32768]
  smooth_l1  smooth_l1_loss(x, y), x, y float32 [32768, 32768] (KernelBench problem 96)
and reports GB/s of compulsory traffic (each input read once, each output written once) next
to the device's copy bandwidth measured in the same run, and each time's ratio to cupyloss's.
value_and_grad is compared with torch's forward + backward asking for the same gradients.
--plot also sweeps every workload from 1K to 1G elements in steps of 16x ([n / cols, cols],
cols = min(n, 4096)) against the same implementations and writes a PNG of GB/s against size
(matplotlib, if installed) with the copy bandwidth as a line, and the same numbers as a markdown
table beside it.
--only runs the named workloads alone.  --family times every registered pointwise loss (forward
and value_and_grad, every array [32768, 32768] float32) next to mse_loss, and skips the rest.
--scale shrinks every side (0.25 runs on a small GPU).  Never used as a test.
"""

from __future__ import annotations

import statistics
import time

import cupy

import cupyloss
from cupyloss.bench import _timing


def _timer(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of device time of fn() on CuPy's current stream (see _timing)."""
    return _timing.gpu_ms(fn, reps, warmup)


def _host_us(rows: dict, calls: int = 2000, batches: int = 9) -> dict:
    """Median host microseconds per call of each row's fn(), {name: (fn, sync)}.

    The rows take turns, one batch of back-to-back calls each per round, so that every row is
    measured across the same stretch of the machine's state (clocks, other tenants): the ratios
    between rows compare like with like even when the absolute numbers drift from run to run.
    """
    for fn, sync in rows.values():
        for _ in range(200):
            fn()
        sync()
    per_call = {name: [] for name in rows}
    for _ in range(batches):
        for name, (fn, sync) in rows.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - start) / calls * 1e6)
            sync()
    return {name: statistics.median(times) for name, times in per_call.items()}


def _torch():
    """torch, where it is installed with CUDA; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def small_calls(n: int = 1024) -> list[dict]:
    """Host cost per call at n fp32 elements: cupyloss on CuPy and torch vs torch eager."""
    rng = cupy.random.default_rng(0)
    x, y = rng.standard_normal(n, dtype=cupy.float32), rng.standard_normal(n, dtype=cupy.float32)
    sync = cupy.cuda.get_current_stream().synchronize
    rows = {
        "cupyloss.mse_loss (CuPy)": (lambda: cupyloss.mse_loss(x, y), sync),
        "cupyloss.mse_loss_value_and_grad (CuPy)":
            (lambda: cupyloss.mse_loss_value_and_grad(x, y), sync),
        "cupyloss.mse_loss_backward (CuPy)":
            (lambda: cupyloss.mse_loss_backward(1.0, x, y), sync),
    }
    torch = _torch()
    if torch is not None:
        import torch.nn.functional as F

        tx = torch.randn(n, device="cuda", requires_grad=True)
        ty = torch.randn(n, device="cuda", requires_grad=True)
        tsync = torch.cuda.synchronize

        def eager_fwd_bwd():
            F.mse_loss(tx, ty).backward()

        rows = {
            "torch eager F.mse_loss": (lambda: F.mse_loss(tx, ty), tsync),
            "torch eager F.mse_loss + backward()": (eager_fwd_bwd, tsync),
            **rows,
            "cupyloss.mse_loss (torch)": (lambda: cupyloss.mse_loss(tx, ty), tsync),
            "cupyloss.mse_loss_value_and_grad (torch)":
                (lambda: cupyloss.mse_loss_value_and_grad(tx, ty), tsync),
            "cupyloss.mse_loss_backward (torch)":
                (lambda: cupyloss.mse_loss_backward(1.0, tx, ty), tsync),
        }
    out = [{"call": name, "us": us, "n": n} for name, us in _host_us(rows).items()]
    ref = next((r["us"] for r in out if r["call"] == "torch eager F.mse_loss"), None)
    print(f"host time per call, {n} fp32 elements, reduced loss (median of batches):")
    for r in out:
        r["ratio_to_torch_eager"] = r["us"] / ref if ref else None
        ratio = f"{r['ratio_to_torch_eager']:6.2f}x" if ref else ""
        print(f"  {r['call']:45} {r['us']:8.1f} us {ratio}")
    return out


ROUNDS = 3


def _rounds(entries: dict, reps: int) -> dict:
    """{(impl, pass): median ms} of every entry's forward and value_and_grad: ROUNDS rounds, each
    timing every entry once (`reps` runs) in turn, so that all implementations are measured
    across the same stretch of the device's state; the median of the rounds' medians."""
    per_round = {}
    for _ in range(ROUNDS):
        for who, (fwd, vag) in entries.items():
            for what, fn in (("forward", fwd), ("value_and_grad", vag)):
                if fn is not None:
                    per_round.setdefault((who, what), []).append(_timer(fn, reps))
    return {key: statistics.median(ms) for key, ms in per_round.items()}


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written."""
    src = cupy.ones(nbytes // 4, cupy.float32)
    dst = cupy.empty_like(src)
    ms = _timer(lambda: cupy.copyto(dst, src), reps)
    return 2 * src.nbytes / ms / 1e6


def _workloads(scale: float):
    big, mid = int(32768 * scale), int(16384 * scale)
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((big, big), dtype=cupy.float32)
    y = rng.standard_normal((big, big), dtype=cupy.float32)
    yield "mse", x, y
    del x, y
    p = rng.random((mid, mid), dtype=cupy.float32) + 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.random((mid, mid), dtype=cupy.float32) + 1e-3
    q /= q.sum(-1, keepdims=True)
    yield "kl", p, q
    del p, q
    s = rng.standard_normal((big, big), dtype=cupy.float32)
    t = cupy.sign(rng.standard_normal((big,), dtype=cupy.float32))
    yield "hinge", s, t
    del s, t
    x = rng.standard_normal((big, big), dtype=cupy.float32)
    y = rng.standard_normal((big, big), dtype=cupy.float32)
    yield "smooth_l1", x, y


def _cupyloss_fns(name, a, b):
    if name == "mse":
        return (lambda: cupyloss.mse_loss(a, b),
                lambda: cupyloss.mse_loss_value_and_grad(a, b))
    if name == "kl":
        return (lambda: cupyloss.kl_div(a, b, "batchmean", log_input=False),
                lambda: cupyloss.kl_div_value_and_grad(a, b, "batchmean", log_input=False))
    if name == "smooth_l1":
        return (lambda: cupyloss.smooth_l1_loss(a, b),
                lambda: cupyloss.smooth_l1_loss_value_and_grad(a, b))
    return (lambda: cupyloss.hinge_loss(a, b),
            lambda: cupyloss.hinge_loss_value_and_grad(a, b))


def _cupy_fn(name, a, b):
    if name == "mse":
        return lambda: cupy.mean((a - b) ** 2)
    if name == "kl":
        return lambda: cupy.sum(cupy.where(b > 0, b * cupy.log(b), 0) - b * cupy.log(a)) / a.shape[0]
    if name == "smooth_l1":
        def f():
            z = cupy.abs(a - b)
            return cupy.mean(cupy.where(z < 1, 0.5 * z * z, z - 0.5))
        return f
    return lambda: cupy.mean(cupy.maximum(1 - a * b, 0))


def _torch_loss(name):
    """The workload `name` written with torch operations."""
    import torch
    import torch.nn.functional as F

    if name == "mse":
        def f(x, y):
            return F.mse_loss(x, y)
    elif name == "kl":
        def f(x, y):
            return F.kl_div(torch.log(x), y, reduction="batchmean")
    elif name == "smooth_l1":
        def f(x, y):
            return F.smooth_l1_loss(x, y)
    else:
        def f(x, y):
            return torch.mean(torch.clamp(1 - x * y, min=0))
    return f


def _torch_fns(name, a, b, compiled=None):
    """_timing.torch_forms of workload `name` on torch views of a, b (both gradients)."""
    import torch

    f = _torch_loss(name)
    return _timing.torch_forms(torch, f, (torch.from_dlpack(a), torch.from_dlpack(b)), (0, 1),
                               compiled=compiled or torch.compile(f))


def _family_calls(x, y, u):
    """name -> (array arguments, options) of every registered loss on [n, n] float32 arrays:
    x, y standard normal, u uniform in (0, 1) (probabilities, targets, variances)."""
    from cupyloss._core.registry import SPECS

    args = {
        "kl_div": ((x, u), {}),
        "binary_cross_entropy": ((u, u), {}),
        "binary_cross_entropy_with_logits": ((x, u), {}),
        "margin_ranking_loss": ((x, y, u), {}),
        "poisson_nll_loss": ((x, u), {}),
        "gaussian_nll_loss": ((x, y, u), {}),
        "sigmoid_focal_loss": ((x, u), {"reduction": "mean"}),
    }
    return {name: args.get(name, ((x, y), {})) for name in SPECS}


def family(scale: float, reps: int, bw: float, device: str) -> list[dict]:
    """Forward, value_and_grad and backward (every gradient; grad_output 1) of every registered
    loss on [n, n] float32 arrays, n = 32768 * scale, with each time's ratio to mse_loss's and
    GB/s of compulsory traffic (each array read once; the gradient passes also write one
    gradient per array)."""
    n = int(32768 * scale)
    rng = cupy.random.default_rng(2)
    x = rng.standard_normal((n, n), dtype=cupy.float32)
    y = rng.standard_normal((n, n), dtype=cupy.float32)
    u = rng.random((n, n), dtype=cupy.float32) * 0.98 + 0.01
    rows = []
    for name, (arrays, opts) in _family_calls(x, y, u).items():
        fwd = getattr(cupyloss, name)
        vag = getattr(cupyloss, name + "_value_and_grad")
        bwd = getattr(cupyloss, name + "_backward")
        nbytes = sum(a.nbytes for a in arrays)
        for what, fn, traffic in (("forward", lambda: fwd(*arrays, **opts), nbytes),
                                  ("value_and_grad", lambda: vag(*arrays, **opts), 2 * nbytes),
                                  ("backward", lambda: bwd(1.0, *arrays, **opts), 2 * nbytes)):
            ms = _timer(fn, reps)
            rows.append(dict(loss=name, pass_=what, ms=ms, gbps=traffic / ms / 1e6,
                             pct_copy_bw=100 * traffic / ms / 1e6 / bw, arrays=len(arrays),
                             device=device, shape=[n, n]))
        # No pool release between losses: the first kernel after memory went back to the driver
        # runs slow (see _timing.release), which read squared_hinge_loss's forward, timed right
        # after gaussian_nll_loss's gradients were given back, as 1.055x mse's where alternating
        # the two gave 1.000x (H100).  Every loss's outputs fit in the blocks the pool keeps.
    mse = {r["pass_"]: r for r in rows if r["loss"] == "mse_loss"}
    print(f"every loss on [{n}, {n}] float32 arrays, {device} (copy {bw:.0f} GB/s):")
    print(f"{'loss':34} {'pass':15} {'arrays':>6} {'ms':>8} {'GB/s':>6} {'%copy':>6} "
          f"{'x mse time':>10} {'x mse GB/s':>10}")
    for r in rows:
        ref = mse[r["pass_"]]
        r["ratio_to_mse"] = r["ms"] / ref["ms"]
        r["gbps_ratio_to_mse"] = r["gbps"] / ref["gbps"]
        print(f"{r['loss']:34} {r['pass_']:15} {r['arrays']:6d} {r['ms']:8.3f} "
              f"{r['gbps']:6.0f} {r['pct_copy_bw']:6.1f} {r['ratio_to_mse']:10.3f} "
              f"{r['gbps_ratio_to_mse']:10.3f}")
    return rows


SWEEP_SIZES = tuple(4 * 16**k for k in range(2, 8))   # 1K, 16K, ..., 1G elements: one point per 16x


def _sweep_operands(name: str, n: int):
    """Operands of `n` elements for the sweep: [n / cols, cols] with cols = min(n, 4096)."""
    cols = min(n, 4096)
    rows = n // cols
    rng = cupy.random.default_rng(1)
    if name == "kl":
        p = rng.random((rows, cols), dtype=cupy.float32) + 1e-3
        q = rng.random((rows, cols), dtype=cupy.float32) + 1e-3
        p /= p.sum(-1, keepdims=True)
        q /= q.sum(-1, keepdims=True)
        return p, q
    a = rng.standard_normal((rows, cols), dtype=cupy.float32)
    if name == "hinge":
        return a, cupy.sign(rng.standard_normal((cols,), dtype=cupy.float32))
    return a, rng.standard_normal((rows, cols), dtype=cupy.float32)


def sweep(reps: int, bw: float, device: str) -> list[dict]:
    """GB/s of compulsory traffic for every workload, size, implementation and pass."""
    torch = _torch()
    have_torch = torch is not None
    compiled = {}
    if have_torch:
        # One static graph per size: dynamic shapes give inductor reductions that are not split
        # across blocks (tens of GB/s), which is not what a user of torch.compile sees.
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    4 * len(SWEEP_SIZES))
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 16 * len(SWEEP_SIZES))
        compiled = {name: torch.compile(_torch_loss(name), dynamic=False)
                    for name in ("mse", "kl", "hinge")}
    rows = []
    for name in ("mse", "kl", "hinge"):
        for n in SWEEP_SIZES:
            a, b = _sweep_operands(name, n)
            fwd_bytes = a.nbytes + b.nbytes
            entries = {"cupyloss": _cupyloss_fns(name, a, b), "cupy": (_cupy_fn(name, a, b), None)}
            if have_torch:
                entries.update(_torch_fns(name, a, b, compiled[name]))
            for who, (fwd, vag) in entries.items():
                for what, fn in (("forward", fwd), ("value_and_grad", vag)):
                    if fn is None:
                        continue
                    ms = _timer(fn, reps)
                    nbytes = fwd_bytes * (1 if what == "forward" else 2)
                    rows.append(dict(workload=name, n=n, impl=who, pass_=what, ms=ms,
                                     gbps=nbytes / ms / 1e6, copy_gbps=bw, device=device))
            del a, b, entries
            cupy.get_default_memory_pool().free_all_blocks()
            if have_torch:
                torch.cuda.empty_cache()
        print(f"swept {name}", flush=True)
    return rows


def _size_label(n: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div:
            return f"{n // div}{unit}"
    return str(n)


def write_plot(rows: list[dict], path: str) -> str:
    """A PNG of GB/s against size per workload and pass, and a markdown table beside it.

    Returns the markdown table.  Without matplotlib only the table is written, and it says so.
    """
    import pathlib

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    names = list(dict.fromkeys(r["workload"] for r in rows))
    passes = ("forward", "value_and_grad")
    sizes = sorted({r["n"] for r in rows})
    table = {(r["workload"], r["pass_"], r["impl"], r["n"]): r["gbps"] for r in rows}
    device, bw = rows[0]["device"], rows[0]["copy_gbps"]
    lines = [f"GB/s of compulsory traffic on {device} (copy bandwidth {bw:.0f} GB/s, read + "
             f"write), fp32, median of one run", ""]
    for name in names:
        for what in passes:
            present = [i for i in impls if (name, what, i, sizes[0]) in table]
            lines.append(f"**{name} {what}**")
            lines.append("")
            lines.append("| elements | " + " | ".join(present) + " |")
            lines.append("|---|" + "---|" * len(present))
            for n in sizes:
                cells = [f"{table[(name, what, i, n)]:.0f}" for i in present]
                lines.append(f"| {_size_label(n)} | " + " | ".join(cells) + " |")
            lines.append("")
    markdown = "\n".join(lines)
    pathlib.Path(path).with_suffix(".md").write_text(markdown)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: wrote only {pathlib.Path(path).with_suffix('.md')}")
        return markdown
    colors = {impl: f"C{k}" for k, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, what in enumerate(passes):
            ax = axes[row][col]
            for impl in impls:
                pts = [(n, table[(name, what, impl, n)]) for n in sizes
                       if (name, what, impl, n) in table]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=impl, color=colors[impl],
                            lw=2.2 if impl == "cupyloss" else 1.2)
            ax.axhline(bw, color="gray", ls="--", lw=1, label="copy bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [_size_label(n) for n in sizes], fontsize=7)
            ax.set_title(f"{name} {what}", fontsize=10)
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"cupyloss vs torch and CuPy, fp32, {device}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path} and {pathlib.Path(path).with_suffix('.md')}")
    return markdown


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench", __doc__, 20,
                           scale="shrink every side (0.25 on a small GPU)")
    ap.add_argument("--small-only", action="store_true", help="only the small-call host cost")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="sweep sizes 1K..1G, write a plot here and a markdown table beside it")
    ap.add_argument("--only", default=None, help="comma-separated workloads to run alone, of "
                    "mse, kl, hinge, smooth_l1")
    ap.add_argument("--family", action="store_true",
                    help="every registered loss next to mse_loss, and nothing else")
    args = ap.parse_args(argv)
    _timing.need(ap.prog)

    if args.family:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        bw = copy_bandwidth(int(4 * 2**30 * min(args.scale, 1.0) ** 2), args.reps)
        rows = family(args.scale, args.reps, bw, props["name"].decode())
        _timing.save(args.json, {"family": rows})
        return rows

    small = small_calls()
    if args.small_only:
        _timing.save(args.json, {"small_calls": small})
        return small

    torch = _torch()
    have_torch = torch is not None
    stream_ctx = None
    if have_torch:
        from cupyloss import interop
        stream_ctx = interop.torch_stream()
        stream_ctx.__enter__()

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    device = props["name"].decode()
    bw = copy_bandwidth(int(4 * 2**30 * min(args.scale, 1.0) ** 2), args.reps)
    print(f"device: {device}; copy bandwidth {bw:.0f} GB/s (read + write)")
    rows = []
    only = set(args.only.split(",")) if args.only else None
    for name, a, b in _workloads(args.scale):
        if only is not None and name not in only:
            continue
        fwd_bytes = a.nbytes + b.nbytes
        vag_bytes = 2 * fwd_bytes
        ours_fwd, ours_vag = _cupyloss_fns(name, a, b)
        entries = {"cupyloss": (ours_fwd, ours_vag), "cupy": (_cupy_fn(name, a, b), None)}
        if have_torch:
            entries.update(_torch_fns(name, a, b))
        times = _rounds(entries, args.reps)
        for (who, what), ms in times.items():
            nbytes = fwd_bytes if what == "forward" else vag_bytes
            ref = times[("cupyloss", what)]
            rows.append(dict(workload=name, impl=who, pass_=what, ms=ms,
                             gbps=nbytes / ms / 1e6, pct_copy_bw=100 * nbytes / ms / 1e6 / bw,
                             ratio_to_cupyloss=ms / ref, device=device, copy_gbps=bw,
                             shape=list(a.shape), target_shape=list(b.shape)))
        del a, b, entries
        cupy.get_default_memory_pool().free_all_blocks()
        if have_torch:
            torch.cuda.empty_cache()

    swept = sweep(max(5, args.reps // 2), bw, device) if args.plot else []
    if stream_ctx is not None:
        stream_ctx.__exit__(None, None, None)
    if swept:
        write_plot(swept, args.plot)
    print(f"{'workload':8} {'pass':15} {'impl':14} {'ms':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'x cupyloss':>10}")
    for r in rows:
        print(f"{r['workload']:8} {r['pass_']:15} {r['impl']:14} {r['ms']:8.3f} "
              f"{r['gbps']:7.0f} {r['pct_copy_bw']:6.1f} {r['ratio_to_cupyloss']:10.2f}")
    _timing.save(args.json, {"small_calls": small, "large": rows, "sweep": swept})
    return rows


if __name__ == "__main__":
    main()
