"""Benchmark the LLM head's loss: fused linear cross entropy against what users pick instead.

    python -m cupyloss.bench.linear [--rows 8192,16384] [--budgets 256,1024,2560,4608]
                                    [--reps 10] [--json out.json] [--plot linear.png]
                                    [--shapes 4096x128256] [--autocast --chunk-rows 2048,4096]

Hidden (BT, 4096) bfloat16, weight (128256, 4096) bfloat16 (an nn.Linear's), int64 targets with
10% ignore_index; forward + backward of the loss with the gradients of hidden and weight
(--shapes: other H x V).  --autocast: float32 hidden and weight (a LayerNorm's output and a
master weight), the step inside torch.autocast("cuda", torch.bfloat16), cupyloss at each
--chunk-rows (its 16-bit logits' chunk; linear.NARROW_CHUNK_ROWS) rather than each budget:

  torch eager      F.cross_entropy((h @ W.T).float(), t)
  torch.compile    the same function compiled
  Liger-Kernel     liger_fused_linear_cross_entropy (when installed)
  Cut CE           cut_cross_entropy.linear_cross_entropy (when installed)
  cupyloss         cupyloss.torch.linear_cross_entropy at each workspace budget (MiB)

Each row: median milliseconds of --reps runs (CUDA events on torch's stream), the peak memory
above the inputs (torch.cuda.max_memory_allocated during a run less what was allocated before
it), and beyond the gradients themselves (hidden's and weight's, in their dtype), the achieved
TFLOP/s of the three matrix products (6 BT H V flops in all), the loss's relative error and the
hidden gradient's (largest |error| over largest |value|) against float64 logits from the same
bfloat16 operands, and the host's median
milliseconds queueing a forward + backward (where they near the device's, the call is bound by
its Python, as at bench.train's small widths).  --plot draws
cupyloss's time against its peak memory, with the others as points.  Never used as a test.
"""

from __future__ import annotations

from cupyloss.bench import _timing

H, V = 4096, 128256


def _inputs(torch, rows: int, hidden: int = H, classes: int = V, dtype=None):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = dtype or torch.bfloat16
    h = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.5).to(dtype)
    w = (torch.randn(classes, hidden, device="cuda", generator=gen) * 0.02).to(dtype)
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[torch.rand(rows, device="cuda", generator=gen) < 0.1] = -100
    return h, w, t


def _reference_loss(torch, h, w, t):
    """(mean cross entropy, its hidden gradient) of float64 logits h W^T (of bfloat16
    operands), in row chunks."""
    total, count = 0.0, int((t != -100).sum())
    wd = w.bfloat16().double()
    gx = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    for r in range(0, h.shape[0], 1024):
        z = h[r:r + 1024].bfloat16().double() @ wd.T
        tc = t[r:r + 1024]
        total += float(torch.nn.functional.cross_entropy(z, tc, reduction="sum"))
        p = z.softmax(-1)
        del z
        keep = tc != -100
        p[keep, tc[keep]] -= 1
        p[~keep] = 0
        gx[r:r + 1024] = (p @ wd) / count
        del p
    del wd
    return total / count, gx


def _measure(torch, fn, h, w, t, reps: int, autocast: bool = False):
    """(median ms, peak GiB above what was allocated before, loss, median host ms) of forward +
    backward; the host ms is the time the host spends queueing them (the step syncs nothing)."""
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        hl.grad = wl.grad = None
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = fn(hl, wl, t)
        loss.backward()
        return loss

    loss = float(step().detach())
    gx = hl.grad.detach().clone()
    step()

    def forget():
        hl.grad = wl.grad = None

    ms, peak, host = _timing.torch_steps(torch, step, reps, forget)
    forget()
    return ms, peak, loss, host, gx


def _candidates(torch, budgets, chunk_rows=()):
    import cupyloss.torch as CF

    F = torch.nn.functional

    def eager(h, w, t):
        return F.cross_entropy((h @ w.T).float(), t)

    if chunk_rows:      # --autocast
        from cupyloss import linear

        def rows(r):
            def call(h, w, t):
                linear.NARROW_CHUNK_ROWS = ((None, r),)
                return CF.linear_cross_entropy(h, w, t)
            return call

        table = linear.NARROW_CHUNK_ROWS
        return {"torch.compile": torch.compile(eager),
                **{f"cupyloss rows {r}": rows(r) for r in chunk_rows},
                "cupyloss (table)": lambda h, w, t: (
                    setattr(linear, "NARROW_CHUNK_ROWS", table)
                    or CF.linear_cross_entropy(h, w, t))}

    out = {"torch eager": eager, "torch.compile": torch.compile(eager)}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out["Liger-Kernel"] = lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["Cut CE"] = lambda h, w, t: cce(h, w, t)
    except ImportError:
        pass
    for mib in budgets:
        out[f"cupyloss {mib} MiB"] = (lambda b: lambda h, w, t: CF.linear_cross_entropy(
            h, w, t, max_workspace_bytes=b))(mib << 20)
    return out


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.linear", __doc__, 10)
    ap.add_argument("--rows", default="8192,16384", help="BT values, comma-separated")
    ap.add_argument("--budgets", default="256,1024,2560,4608",
                    help="cupyloss workspace budgets in MiB, comma-separated")
    ap.add_argument("--only", default=None,
                    help="comma-separated names of the candidates to run (default: all)")
    ap.add_argument("--plot", default=None, help="draw time against peak memory to this file")
    ap.add_argument("--shapes", default=f"{H}x{V}", help="H x V pairs, comma-separated")
    ap.add_argument("--autocast", action="store_true",
                    help="float32 operands inside bf16 autocast (module docstring)")
    ap.add_argument("--chunk-rows", default="1024,2048,4096",
                    help="with --autocast: cupyloss's 16-bit logit chunks, comma-separated")
    args = ap.parse_args(argv)
    torch, device = _timing.torch_gpu(ap.prog)

    budgets = [int(b) for b in args.budgets.split(",") if b]
    chunk_rows = [int(r) for r in args.chunk_rows.split(",") if r] if args.autocast else []
    kind = "float32 in bf16 autocast" if args.autocast else "bf16"
    rows_out = []
    for bt, (hs, vs) in ((int(r), tuple(map(int, s.split("x"))))
                         for s in args.shapes.split(",") for r in args.rows.split(",")):
        h, w, t = _inputs(torch, bt, hs, vs, torch.float32 if args.autocast else None)
        ref, ref_gx = _reference_loss(torch, h, w, t)
        scale = float(ref_gx.abs().max())
        grads = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**30
        torch.cuda.empty_cache()
        flops = 6.0 * bt * hs * vs
        print(f"{device}: hidden ({bt}, {hs}), weight ({vs}, {hs}), {kind}, float64 loss "
              f"{ref:.6f}, gradients {grads:.3f} GiB")
        print(f"{'implementation':24} {'ms':>9} {'peak GiB':>9} {'beyond':>7} {'TFLOP/s':>8} "
              f"{'loss rel err':>13} {'dX rel err':>11} {'host ms':>8}")
        for name, fn in _candidates(torch, budgets, chunk_rows).items():
            if args.only and not any(name.startswith(o) for o in args.only.split(",")):
                continue
            try:
                ms, peak, loss, host, gx = _measure(torch, fn, h, w, t, args.reps,
                                                    args.autocast)
            except Exception as exc:  # a candidate out of memory or failing: say so, go on
                print(f"{name:24} failed: {type(exc).__name__}: {str(exc)[:120]}")
                torch.cuda.empty_cache()
                continue
            err = abs(loss - ref) / abs(ref)
            gerr = float((gx.double() - ref_gx).abs().max()) / scale
            del gx
            beyond = peak - grads
            rows_out.append(dict(device=device, rows=bt, hidden=hs, classes=vs, kind=kind,
                                 name=name, ms=ms, peak_gib=peak, beyond_gib=beyond,
                                 tflops=flops / ms / 1e9, loss_rel_err=err,
                                 grad_rel_err=gerr, host_ms=host))
            print(f"{name:24} {ms:9.2f} {peak:9.3f} {beyond:7.3f} {flops / ms / 1e9:8.0f} "
                  f"{err:13.2e} {gerr:11.2e} {host:8.2f}", flush=True)
            torch.cuda.empty_cache()
        del h, w, t, ref_gx
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    if args.plot and rows_out:
        _plot(rows_out, args.plot, device)
    return _timing.save(args.json, rows_out)


def _plot(rows, path, device) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["rows"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, bt in zip(axes[0], sizes):
        mine = [r for r in rows if r["rows"] == bt and r["name"].startswith("cupyloss")]
        ax.plot([r["peak_gib"] for r in mine], [r["ms"] for r in mine], "o-",
                label="cupyloss (workspace budgets)")
        for r in rows:
            if r["rows"] == bt and not r["name"].startswith("cupyloss"):
                ax.plot(r["peak_gib"], r["ms"], "s", label=r["name"])
        ax.set_xlabel("peak memory above the inputs (GiB)")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"BT = {bt}, V = {V}, H = {H}, bf16 ({device})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
