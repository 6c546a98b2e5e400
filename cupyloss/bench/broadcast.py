"""Benchmark gradients of broadcast operands: mse_loss_value_and_grad at four patterns.

    python -m cupyloss.bench.broadcast [--reps 20] [--json out.json] [--no-compile] [--family]
                                       [--family-compile]

Patterns (float32, 'mean' reduction, both gradients), x vs t:
  per-channel  (1, 64, 1, 1) vs (256, 64, 56, 56)   x's gradient: pointwise_reduce [M1, O, M2]
  per-row      (8192, 1)     vs (8192, 4096)        pointwise_reduce [O, M]
  row          (4096,)       vs (8192, 4096)        pointwise_rows
  scalar       ()            vs (8192, 4096)        pointwise_flat with a grid sum

Each row of the table: cupyloss value_and_grad, torch eager and torch.compile (static shapes)
forward + backward of mean((x - t) ** 2) asking for both gradients, in milliseconds (medians
of --reps runs after warm-up, CUDA events on torch's current stream, all arrays torch tensors);
the memory limit (x and t read once, both gradients written once, at the copy bandwidth
measured in the same run) and cupyloss's percentage of it; and the relative error of x's
gradient against float64 (max |error| / max |float64 gradient|) for cupyloss and torch eager.
Pools are emptied between patterns.  --family adds a table of every registered pointwise
loss's value_and_grad (every gradient) on the same patterns, its first array broadcast: time and
percentage of the memory limit (each array read once, each gradient written once), and the time
of its backward (grad_output 1);
--family-compile adds torch.compile's forward + backward of the same loss (torch.nn.functional's,
or the formula of a loss torch lacks: _torch_forms) asking the same gradients, and the ratio
of its time to cupyloss's.  Never used as a test.
"""

from __future__ import annotations

from cupyloss.bench import _timing, rowwise as bench_rowwise

PATTERNS = {
    "per-channel": ((1, 64, 1, 1), (256, 64, 56, 56)),
    "per-row": ((8192, 1), (8192, 4096)),
    "row": ((4096,), (8192, 4096)),
    "scalar": ((), (8192, 4096)),
}


def _free(torch):
    import cupy

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def _relative_error(got, ref) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def run_pattern(torch, x_shape, t_shape, reps: int, compile_: bool) -> dict:
    """Times and errors of one pattern (see the module docstring)."""
    import cupyloss

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(x_shape, device="cuda", generator=gen)
    t = torch.randn(t_shape, device="cuda", generator=gen)

    def f(a, b):
        return torch.mean((a - b) ** 2)

    forms = _timing.torch_forms(torch, f, (x, t), (0, 1), compile_)
    out = {"cupyloss": bench_rowwise._timer(
        torch, lambda: cupyloss.mse_loss_value_and_grad(x, t), reps)}
    _, (gx, _) = cupyloss.mse_loss_value_and_grad(x, t)
    tgx, _ = forms["torch eager"][1]()
    for who, (_, fwd_bwd) in forms.items():
        out[who] = bench_rowwise._timer(torch, fwd_bwd, reps)
    # float64 reference of x's gradient: 2 (x - t) / n summed over x's broadcast dims.
    n = t.numel()
    full = (2.0 / n) * (x.double() - t.double())
    ref = full.sum_to_size(x.shape) if x.dim() else full.sum()
    out["err cupyloss"] = _relative_error(gx.reshape(ref.shape), ref)
    out["err torch"] = _relative_error(tgx.reshape(ref.shape), ref)
    out["bytes"] = 2 * (x.numel() + t.numel()) * x.element_size()
    del x, t, forms, gx, tgx, full, ref
    if compile_:
        torch._dynamo.reset()
    _free(torch)
    return out


def _same_shape(fn):
    """fn on its arrays expanded to one shape (views), for torch losses that refuse to
    broadcast; autograd sums the expanded gradients back."""
    def run(*arrays):
        import torch

        return fn(*torch.broadcast_tensors(*arrays))
    return run


def _torch_forms() -> dict:
    """name -> torch function of the family's arrays giving the loss at the options
    bench._family_calls uses (torch.nn.functional's, torchvision's focal loss, and the
    formulas of the losses torch lacks)."""
    import torch

    F = torch.nn.functional

    def hinge(a, b):
        return torch.clamp(1 - a * b, min=0)

    def focal(x, t):   # torchvision.ops.sigmoid_focal_loss, alpha 0.25, gamma 2, then mean
        p = torch.sigmoid(x)
        ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
        p_t = p * t + (1 - p) * (1 - t)
        return ((0.25 * t + 0.75 * (1 - t)) * ce * (1 - p_t) ** 2).mean()

    # torch's binary_cross_entropy and soft_margin_loss have no target gradient, which cupyloss
    # gives: their formulas as torch defines them (each log clamped at -100; log(1 + e^(-x t))).
    def bce(x, t):
        log_x, log_1mx = torch.clamp(torch.log(x), min=-100), torch.clamp(torch.log1p(-x), min=-100)
        return (-(t * log_x + (1 - t) * log_1mx)).mean()

    return {
        "mse_loss": F.mse_loss, "kl_div": F.kl_div, "l1_loss": F.l1_loss,
        "smooth_l1_loss": F.smooth_l1_loss, "huber_loss": F.huber_loss,
        "binary_cross_entropy": bce,
        "binary_cross_entropy_with_logits": _same_shape(F.binary_cross_entropy_with_logits),
        "soft_margin_loss": lambda x, t: torch.log1p(torch.exp(-x * t)).mean(),
        "hinge_embedding_loss": F.hinge_embedding_loss,
        "margin_ranking_loss": _same_shape(F.margin_ranking_loss),
        "poisson_nll_loss": F.poisson_nll_loss,
        "hinge_loss": lambda a, b: hinge(a, b).mean(),
        "squared_hinge_loss": lambda a, b: (hinge(a, b) ** 2).mean(),
        "sigmoid_focal_loss": _same_shape(focal),
        "log_cosh_loss": lambda a, b: torch.log(torch.cosh(a - b)).mean(),
        "gaussian_nll_loss": F.gaussian_nll_loss,
    }


def _compiled_ms(name, arrays, grads, reps: int):
    """torch.compile's forward + backward of loss `name` on the CuPy `arrays` (as torch
    tensors, zero-copy), asking the gradients cupyloss gave (`grads`, None where it gave none)."""
    import warnings

    import torch

    form = _torch_forms().get(name)
    if form is None:
        return None
    ts = [torch.from_dlpack(a).detach().requires_grad_(g is not None)
          for a, g in zip(arrays, grads)]
    wanted = [t for t in ts if t.requires_grad]
    compiled = torch.compile(form, dynamic=False)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # broadcasting targets warn
            return torch.autograd.grad(compiled(*ts), wanted, allow_unused=True)

    ms = bench_rowwise._timer(torch, run, reps)
    torch._dynamo.reset()
    return ms


def family(reps: int, copy_bw: float, device: str, compile_: bool = False) -> list[dict]:
    """Every pointwise loss's value_and_grad and backward on the four patterns, its first array
    broadcast (and with compile_, torch.compile's forward + backward of the same loss);
    gaussian_nll_loss with its var broadcast instead, on the per-row pattern only (var (N, 1):
    torch takes no other broadcast var)."""
    import cupy

    import cupyloss
    from cupyloss.bench import _timing
    from cupyloss.bench import losses as bench

    rows = []
    for pattern, (x_shape, t_shape) in PATTERNS.items():
        rng = cupy.random.default_rng(3)
        full = (rng.standard_normal(t_shape, dtype=cupy.float32),
                rng.standard_normal(t_shape, dtype=cupy.float32),
                rng.random(t_shape, dtype=cupy.float32) * 0.98 + 0.01)
        small = (rng.standard_normal(x_shape, dtype=cupy.float32),
                 rng.random(x_shape, dtype=cupy.float32) * 0.98 + 0.01)
        for name, (arrays, opts) in bench._family_calls(*full).items():
            if name == "gaussian_nll_loss":
                if pattern != "per-row":
                    continue
                arrays = (*arrays[:2], small[1])
            else:
                first = small[1] if arrays[0] is full[2] else small[0]
                arrays = (first, *arrays[1:])
            vag = getattr(cupyloss, name + "_value_and_grad")
            bwd = getattr(cupyloss, name + "_backward")
            ms = _timing.gpu_ms(lambda: vag(*arrays, **opts), reps)
            limit = 2 * sum(a.nbytes for a in arrays) / copy_bw / 1e6
            row = dict(pattern=pattern, loss=name, ms=ms, limit_ms=limit,
                       pct_limit=100 * limit / ms, device=device,
                       backward_ms=_timing.gpu_ms(lambda: bwd(1.0, *arrays, **opts), reps))
            if compile_:
                _, grads = vag(*arrays, **opts)
                row["compile_ms"] = _compiled_ms(name, arrays, grads, reps)
                del grads
                print(f"  {pattern} {name}: {ms:.3f} ms, torch.compile {row['compile_ms']:.3f} ms",
                      flush=True)
            rows.append(row)
        del full, small
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"every pointwise loss's value_and_grad (and backward), first array broadcast, {device}"
          + (" (x: torch.compile's time over cupyloss's)" if compile_ else "") + ":")
    width = 40 if compile_ else 32
    print(f"{'loss':34} " + " ".join(f"{p:>{width}}" for p in PATTERNS))
    for name in dict.fromkeys(r["loss"] for r in rows):
        cells = []
        by_pattern = {r["pattern"]: r for r in rows if r["loss"] == name}
        for pattern in PATTERNS:
            r = by_pattern.get(pattern)
            cell = ("-" if r is None else
                    f"{r['ms']:8.3f} ms {r['pct_limit']:5.1f}% (bwd {r['backward_ms']:.3f})")
            if r is not None and r.get("compile_ms"):
                cell += f" {r['compile_ms'] / r['ms']:6.2f}x"
            cells.append(cell)
        print(f"{name:34} " + " ".join(f"{c:>{width}}" for c in cells))
    return rows


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.broadcast", __doc__, 20, no_compile=True)
    for flag, text in (
            ("--family", "also every pointwise loss on the same patterns (cupyloss alone)"),
            ("--family-compile", "--family with torch.compile's time of each loss beside "
                                 "cupyloss's")):
        ap.add_argument(flag, action="store_true", help=text)
    args = ap.parse_args(argv)
    torch, device = _timing.torch_gpu(ap.prog)

    _, copy_bw = bench_rowwise.bandwidth(torch, args.reps)
    _free(torch)
    print(f"device: {device}; copy {copy_bw:.0f} GB/s (read + write)")
    rows = []
    for name, (x_shape, t_shape) in PATTERNS.items():
        r = run_pattern(torch, x_shape, t_shape, args.reps, not args.no_compile)
        limit = r["bytes"] / copy_bw / 1e6
        rows.append(dict(pattern=name, x=list(x_shape), t=list(t_shape), device=device,
                         copy_gbps=copy_bw, limit_ms=limit, pct_limit=100 * limit / r["cupyloss"],
                         **{k: v for k, v in r.items() if k != "bytes"}))
    print(f"{'pattern':12} {'x vs t':30} {'cupyloss':>9} {'eager':>8} {'compile':>8} "
          f"{'limit':>7} {'%limit':>7} {'err cupyloss':>13} {'err torch':>10}")
    for r in rows:
        shapes = f"{tuple(r['x'])} vs {tuple(r['t'])}"
        compiled = f"{r['torch.compile']:8.3f}" if "torch.compile" in r else f"{'-':>8}"
        print(f"{r['pattern']:12} {shapes:30} {r['cupyloss']:9.3f} {r['torch eager']:8.3f} "
              f"{compiled} {r['limit_ms']:7.3f} {r['pct_limit']:7.1f} "
              f"{r['err cupyloss']:13.2e} {r['err torch']:10.2e}")
    print("ms: value_and_grad of mean((x - t) ** 2) with both gradients; limit: read + write "
          "bytes at the copy bandwidth; err: x's gradient vs float64, max |error| / max |ref|")
    if args.family or args.family_compile:
        _free(torch)
        rows += family(args.reps, copy_bw, device, args.family_compile)
    return _timing.save(args.json, rows)


if __name__ == "__main__":
    main()
