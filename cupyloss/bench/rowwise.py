"""Benchmark cross_entropy, jsd and triplet_margin_loss against torch eager and torch.compile.

    python -m cupyloss.bench.rowwise [--reps 20] [--scale 1.0] [--json out.json] [--no-compile]
                                     [--workloads kb95,llm,jsd,kb99,options]

Workloads (int64 targets, 'mean' reduction, about 1% of them ignore_index):
  kb95  32768 x 4096 float32 logits (KernelBench level 1, problem 95)
  llm   8192 x 128256 bfloat16 logits (a Llama-3 vocabulary)
  jsd   jsd (beta 0.5, no shift labels) of two 8192 x 128256 bfloat16 log-probability arrays
        (student and teacher, Liger-Kernel's distillation shape); torch runs the same formula,
        Liger's torch reference (float32 upcast, kl_div with log_target), d loss / d student
  kb99  triplet_margin_loss (margin 1, p 2) of three 32768 x 8192 float32 arrays (KernelBench
        level 1, problem 99); value_and_grad writes all three inputs' gradients, so its
        compulsory traffic is the three inputs read and three gradients written
  options  llm's logits with each option of cross_entropy in turn: class weights, z-loss
        (lse_square_scale 1e-4), label_smoothing 0.1, softcap 30; "x cupyloss" is then each
        one's time over the plain loss's.  torch.compile runs the same math (the z-loss as
        1e-4 mean(logsumexp^2) added, the softcap as 30 tanh(x / 30) before the loss).  Not in
        the default list.

Passes: forward (the loss) and value_and_grad (the loss and d loss / d logits written to a new
array; cupyloss also in place, into the logits).  torch's value_and_grad is its forward plus
backward asking for the logits' gradient.  Times are medians of --reps runs (CUDA events, after
warm-up) on torch's current stream, all arrays torch tensors.  GB/s counts compulsory traffic:
the logits and targets read once, the gradient written once.  Percentages are of the device's
bandwidth measured in the same run: a read-only sum for the forward, a copy (read + write) for
value_and_grad.  Between workloads memory goes back to the driver and the run waits for the
device to settle (_timing.release).  --scale shrinks the rows (0.25 on a small GPU).  Never used
as a test.
"""

from __future__ import annotations

import cupyloss
from cupyloss.bench import _timing


def _timer(torch, fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of device time of fn() on torch's current stream (see _timing)."""
    return _timing.gpu_ms(fn, reps, warmup, stream=torch.cuda.current_stream().cuda_stream)


def bandwidth(torch, reps: int) -> tuple[float, float]:
    """(read GB/s of a float32 sum over 4 GiB, read + write GB/s of a 2 GiB copy)."""
    x = torch.ones(2**30, dtype=torch.float32, device="cuda")
    read = 4 * 2**30 / _timer(torch, lambda: x.sum(), reps) / 1e6
    del x
    src = torch.ones(2**29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * 2**31 / _timer(torch, lambda: dst.copy_(src), reps) / 1e6
    del src, dst
    _timing.release(torch)
    return read, copy


def _workload(torch, name, scale):
    rows, cols, dtype = {"kb95": (32768, 4096, torch.float32),
                         "llm": (8192, 128256, torch.bfloat16),
                         "jsd": (8192, 128256, torch.bfloat16)}[name]
    rows = max(1, int(rows * scale))
    gen = torch.Generator(device="cuda").manual_seed(0)
    if name == "jsd":
        x = torch.log_softmax(torch.randn(rows, cols, device="cuda", generator=gen), -1)
        t = torch.log_softmax(torch.randn(rows, cols, device="cuda", generator=gen) * 2, -1)
        return x.to(dtype), t.to(dtype)
    x = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    t = torch.randint(0, cols, (rows,), device="cuda", generator=gen)
    t[torch.rand(rows, device="cuda", generator=gen) < 0.01] = -100
    return x, t


def _triplet_workload(torch, scale):
    rows = max(1, int(32768 * scale))
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(rows, 8192, device="cuda", generator=gen) for _ in range(3))


def _triplet_impls(torch, arrays, compile_: bool):
    """name -> (forward, value_and_grad) callables of triplet_margin_loss."""
    import torch.nn.functional as F

    def f(a, p, n):
        return F.triplet_margin_loss(a, p, n, margin=1.0)

    return {"cupyloss": (lambda: cupyloss.triplet_margin_loss(*arrays),
                         lambda: cupyloss.triplet_margin_loss_value_and_grad(*arrays)),
            **_timing.torch_forms(torch, f, arrays, (0, 1, 2), compile_)}


def _jsd_impls(torch, x, t, compile_: bool):
    """jsd: name -> (forward, value_and_grad) callables (the student's gradient)."""
    import torch.nn.functional as F

    def f(a, b, beta=0.5):
        a, b = a.float(), b.float()
        log_m = torch.log(beta * b.exp() + (1 - beta) * a.exp())
        terms = beta * F.kl_div(log_m, b, reduction="none", log_target=True) + (
            1 - beta) * F.kl_div(log_m, a, reduction="none", log_target=True)
        return (terms.sum() / a.shape[0]).to(x.dtype)

    return {"cupyloss": (lambda: cupyloss.jsd(x, t), lambda: cupyloss.jsd_value_and_grad(x, t)),
            **_timing.torch_forms(torch, f, (x, t), (0,), compile_)}


def _impls(torch, x, t, compile_: bool):
    """name -> (forward, value_and_grad or None) callables."""
    import torch.nn.functional as F

    def f(a, b):
        return F.cross_entropy(a, b)

    # In place: each run overwrites the logits with their gradient, and the next run takes those
    # (finite) values as logits; the work does not depend on the values.
    scratch = x.clone()

    def inplace():
        return cupyloss.cross_entropy_value_and_grad(scratch, t, inplace=True)

    return {"cupyloss": (lambda: cupyloss.cross_entropy(x, t),
                         lambda: cupyloss.cross_entropy_value_and_grad(x, t)),
            "cupyloss inplace": (None, inplace),
            **_timing.torch_forms(torch, f, (x, t), (0,), compile_)}


# cross_entropy's options as the options workload times them: name -> (cupyloss keywords,
# the same loss in torch: f(F, torch, logits, target, weight)).
OPTIONS = {
    "weight": ({"weight": True},
               lambda F, torch, x, t, w: F.cross_entropy(x, t, weight=w)),
    "z-loss": ({"lse_square_scale": 1e-4},
               lambda F, torch, x, t, w: F.cross_entropy(x, t) + 1e-4 * (
                   torch.logsumexp(x.float(), -1)[t != -100] ** 2).mean()),
    "smoothing": ({"label_smoothing": 0.1},
                  lambda F, torch, x, t, w: F.cross_entropy(x, t, label_smoothing=0.1)),
    "softcap": ({"softcap": 30.0},
                lambda F, torch, x, t, w: F.cross_entropy(30.0 * torch.tanh(x.float() / 30.0),
                                                          t)),
}


def _option_impls(torch, x, t, compile_: bool):
    """name -> (forward, value_and_grad) of cross_entropy plain ("cupyloss", the ratios' base)
    and with each of OPTIONS, and torch.compile's of the same."""
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.rand(x.shape[1], device="cuda", generator=gen) + 0.5).to(x.dtype)
    leaf = x.detach().clone().requires_grad_()
    impls = {"cupyloss": (lambda: cupyloss.cross_entropy(x, t),
                          lambda: cupyloss.cross_entropy_value_and_grad(x, t))}
    for name, (kw, torch_form) in OPTIONS.items():
        kw = {k: (w if v is True else v) for k, v in kw.items()}
        impls[f"cupyloss {name}"] = (
            lambda kw=kw: cupyloss.cross_entropy(x, t, **kw),
            lambda kw=kw: cupyloss.cross_entropy_value_and_grad(x, t, **kw))
        if compile_:
            compiled = torch.compile(lambda a, b, f=torch_form: f(F, torch, a, b, w),
                                     dynamic=False)
            impls[f"torch.compile {name}"] = (
                lambda c=compiled: c(x, t),
                lambda c=compiled: torch.autograd.grad(c(leaf, t), (leaf,)))
    return impls


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.rowwise", __doc__, 20,
                           scale="shrink the rows (0.25 on a small GPU)", no_compile=True)
    ap.add_argument("--workloads", default="kb95,llm,jsd,kb99",
                    help="comma-separated, of kb95, llm, jsd, kb99, options (default: all but "
                    "options)")
    args = ap.parse_args(argv)
    torch, device = _timing.torch_gpu(ap.prog)

    read_bw, copy_bw = bandwidth(torch, args.reps)
    print(f"device: {device}; read {read_bw:.0f} GB/s (float32 sum), copy {copy_bw:.0f} GB/s "
          f"(read + write)")
    rows = []
    for name in args.workloads.split(","):
        if name == "kb99":
            t = _triplet_workload(torch, args.scale)
            x = t[0]
            read_bytes = sum(a.numel() * a.element_size() for a in t)
            nbytes = {"forward": read_bytes, "value_and_grad": 2 * read_bytes}
            impls = _triplet_impls(torch, t, not args.no_compile)
        else:
            x, t = _workload(torch, "llm" if name == "options" else name, args.scale)
            read_bytes = x.numel() * x.element_size() + t.numel() * t.element_size()
            nbytes = {"forward": read_bytes,
                      "value_and_grad": read_bytes + x.numel() * x.element_size()}
            make = {"jsd": _jsd_impls, "options": _option_impls}.get(name, _impls)
            impls = make(torch, x, t, not args.no_compile)
        limit = {"forward": read_bw, "value_and_grad": copy_bw}
        times = {}
        for who, (fwd, vag) in impls.items():
            if fwd is not None:
                times[(who, "forward")] = _timer(torch, fwd, args.reps)
            if vag is not None:
                times[(who, "value_and_grad")] = _timer(torch, vag, args.reps)
        for (who, what), ms in times.items():
            gbps = nbytes[what] / ms / 1e6
            rows.append(dict(workload=name, shape=list(x.shape), dtype=str(x.dtype).split(".")[-1],
                             impl=who, pass_=what, ms=ms, gbps=gbps,
                             pct_limit=100 * gbps / limit[what],
                             x_cupyloss=ms / times[("cupyloss", what)], device=device,
                             read_gbps=read_bw, copy_gbps=copy_bw))
        del x, t, impls
        _timing.release(torch)

    print(f"{'workload':8} {'pass':15} {'impl':17} {'ms':>8} {'GB/s':>7} {'%limit':>7} "
          f"{'x cupyloss':>10}")
    for r in rows:
        print(f"{r['workload']:8} {r['pass_']:15} {r['impl']:17} {r['ms']:8.3f} "
              f"{r['gbps']:7.0f} {r['pct_limit']:7.1f} {r['x_cupyloss']:10.2f}")
    print("%limit: forward against the read bandwidth, value_and_grad against the copy "
          "bandwidth")
    return _timing.save(args.json, rows)


if __name__ == "__main__":
    main()
