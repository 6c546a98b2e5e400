"""Benchmark cupyloss.torch's forward + loss.backward() against torch eager and torch.compile.

    python -m cupyloss.bench.torch_adapter [--reps 20] [--scale 1.0] [--small-only]
                                   [--only small,large,compiled,autocast] [--profile]
                                   [--json out.json]

small   1K float32 elements, mse_loss: host microseconds per `loss = f(x, y); loss.backward()`
        (the time the Python thread spends per call, the GPU never being the bottleneck), for
        cupyloss.torch with gradients from the forward pass (the default), with the rerun
        backward (gradients_in_forward=False), torch eager's F.mse_loss, the floor of any
        Python autograd.Function (one that allocates the loss and gradient and launches
        nothing) and the least one that launches cupyloss's kernels (the core value_and_grad
        in forward, scale_by_grad_output in backward); then the forward alone of both and the
        core's value_and_grad without autograd (--profile adds a cProfile of the adapter's
        loop).  The rows take turns batch by batch, so their ratios are measured over the
        same stretch of the machine.
large   the KernelBench sizes, float32, gradients of both arguments asked for:
          mse    mse_loss(x, y), x, y [32768, 32768]
          kl     kl_div(p, q, 'batchmean') of probabilities p, q [16384, 16384] (cupyloss fuses
                 the log with log_input=False; torch is given torch.log(p))
          hinge  hinge_loss(x, t), x [32768, 32768], t [32768] (torch: clamp(1 - x t).mean())
        GPU milliseconds (median of --reps, CUDA events, after warm-up) of forward + backward
        for: cupyloss.torch with gradients from the forward pass, the same with an upstream
        gradient of 0.5 (the scaling kernel then reads and writes the gradients), the rerun
        backward, torch eager and torch.compile; and each one's ratio to cupyloss.torch's.
compiled  inside torch.compile(fullgraph=True), forward + backward of a training step, GPU ms
        and peak GiB beyond the inputs, for:
          mse    mse_loss [32768, 32768] float32
          ce     cross_entropy [8192, 128256] bfloat16 with int64 targets (an LLM's logits)
          kb95   cross_entropy [32768, 4096] float32 (KernelBench 95)
          triplet  triplet_margin_loss of three [32768, 8192] float32 (KernelBench 99)
        each step the loss of ``x * 1.0`` (an intermediate made in the graph; the eager adapter
        is called on the leaf), and
          ce-head  cross_entropy(h @ W.T, t), h [8192, 512], W [128256, 512] bfloat16 (the
                 logits from a product in every case)
        for cupyloss.torch eager and compiled (the cross entropy steps also with
        inplace_backward=True, the eager one then on ``x * 1.0`` too), torch eager,
        torch.compile, and Liger-Kernel's cross entropy where it is installed.
autocast  under torch.autocast("cuda", dtype=torch.bfloat16), forward + backward of cross_entropy
        of bfloat16 logits [8192, 128256] and [32768, 4096] (a float32 loss, a bfloat16
        gradient), GPU ms and peak GiB beyond the inputs, for cupyloss.torch eager and compiled
        (both read the bfloat16 logits as they are), torch eager (which takes a float32 copy)
        and torch.compile.
--scale shrinks every side of the large workloads.  Never used as a test.
"""

from __future__ import annotations

from cupyloss.bench import _timing
from cupyloss.bench.losses import _host_us
from cupyloss.bench.rowwise import _timer

torch = CF = None   # torch and cupyloss.torch, imported by main where they can run


def _free() -> None:
    """Give cached blocks back so one phase's memory does not crowd the next."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    try:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:  # pragma: no cover - cupyloss always has CuPy
        pass


def _fwd_bwd(loss_fn, args, upstream=None):
    """A closure doing forward + backward with fresh .grad (None) each time, as a training step."""
    def run():
        for a in args:
            a.grad = None
        loss = loss_fn(*args)
        if upstream is None:
            loss.backward()
        else:
            loss.backward(upstream)
    return run


def small(profile: bool = False) -> dict:
    import cupyloss

    x = torch.randn(1024, device="cuda", requires_grad=True)
    y = torch.randn(1024, device="cuda")
    F = torch.nn.functional
    rerun = _fwd_bwd(CF.mse_loss, (x, y))

    def rerun_backward():
        CF.gradients_in_forward = False
        try:
            rerun()
        finally:
            CF.gradients_in_forward = True

    class Bare(torch.autograd.Function):
        """The least a Python autograd Function with gradients from its forward can cost: the
        loss and the gradient allocated, no kernel launched, backward hands the gradient on."""

        @staticmethod
        def forward(ctx, a, b):
            ctx.g = torch.empty_like(a)
            return a.new_empty(())

        @staticmethod
        def backward(ctx, grad):
            g, ctx.g = ctx.g, None
            return g, None

    class Least(torch.autograd.Function):
        """The least a Python autograd Function launching cupyloss's kernels can cost: the core
        value_and_grad in forward, the scaling kernel in backward, nothing else."""

        @staticmethod
        def forward(ctx, a, b):
            value, ctx.g = cupyloss.mse_loss_value_and_grad(a, b, wrt="input")
            return value

        @staticmethod
        def backward(ctx, grad):
            g, ctx.g = ctx.g, None
            CF.scale_by_grad_output(grad, g)
            return g, None

    # autograd.Function.apply's C++ part alone, as cupyloss.torch calls it.
    bare, least = (super(torch.autograd.Function, f).apply for f in (Bare, Least))
    sync = torch.cuda.synchronize
    # Where the time goes: the forward alone (graph recorded, then dropped), the core call.
    # The rows take turns batch by batch (bench._host_us), so their ratios compare like with like.
    rows = _host_us({
        "cupyloss.torch fwd+bwd (gradients in forward)": (_fwd_bwd(CF.mse_loss, (x, y)), sync),
        "cupyloss.torch fwd+bwd (rerun backward)": (rerun_backward, sync),
        "torch eager F.mse_loss fwd+bwd": (_fwd_bwd(F.mse_loss, (x, y)), sync),
        "bare autograd.Function fwd+bwd (no kernels)": (_fwd_bwd(bare, (x, y)), sync),
        "least autograd.Function with the kernels": (_fwd_bwd(least, (x, y)), sync),
        "cupyloss.torch forward only": (lambda: CF.mse_loss(x, y), sync),
        "torch eager F.mse_loss forward only": (lambda: F.mse_loss(x, y), sync),
        "core mse_loss_value_and_grad (no autograd)":
            (lambda: cupyloss.mse_loss_value_and_grad(x, y, wrt="input"), sync),
    })
    base = rows["cupyloss.torch fwd+bwd (gradients in forward)"]
    print("1K float32 mse_loss, host us per call:")
    for who, us in rows.items():
        print(f"  {who:46s} {us:8.1f} us")
    ratio = base / rows["torch eager F.mse_loss fwd+bwd"]
    print(f"  cupyloss.torch / torch eager, fwd+bwd = {ratio:.2f} (target <= 0.70)")
    floor = rows["bare autograd.Function fwd+bwd (no kernels)"] / rows[
        "torch eager F.mse_loss fwd+bwd"]
    print(f"  bare autograd.Function / torch eager, fwd+bwd = {floor:.2f} (what any Python "
          f"Function costs)")
    least = rows["least autograd.Function with the kernels"] / rows[
        "torch eager F.mse_loss fwd+bwd"]
    print(f"  least autograd.Function with the kernels / torch eager, fwd+bwd = {least:.2f} "
          f"(the floor of a Python Function launching cupyloss's two kernels)")
    if profile:
        import cProfile
        import pstats

        run = _fwd_bwd(CF.mse_loss, (x, y))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            run()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    return {"host_us": rows, "ratio_to_eager": ratio, "bare_function_ratio": floor,
            "least_function_ratio": least}


def _workloads(scale: float):
    big, mid = int(32768 * scale), int(16384 * scale)
    g = torch.Generator(device="cuda").manual_seed(0)
    F = torch.nn.functional

    def hinge_ref(a, b):
        return torch.clamp(1 - a * b, min=0).mean()

    x = torch.randn(big, big, device="cuda", generator=g, requires_grad=True)
    y = torch.randn(big, big, device="cuda", generator=g, requires_grad=True)
    yield "mse", (x, y), CF.mse_loss, F.mse_loss
    del x, y
    _free()
    p = torch.rand(mid, mid, device="cuda", generator=g) + 1e-3
    p = (p / p.sum(-1, keepdim=True)).requires_grad_()
    q = torch.rand(mid, mid, device="cuda", generator=g) + 1e-3
    q = (q / q.sum(-1, keepdim=True)).requires_grad_()
    yield ("kl", (p, q),
           lambda a, b: CF.kl_div(a, b, reduction="batchmean", log_input=False),
           lambda a, b: F.kl_div(torch.log(a), b, reduction="batchmean"))
    del p, q
    _free()
    s = torch.randn(big, big, device="cuda", generator=g, requires_grad=True)
    t = torch.sign(torch.randn(big, device="cuda", generator=g)).requires_grad_()
    yield "hinge", (s, t), CF.hinge_loss, hinge_ref


class _Table:
    """Each way's GPU ms (median of reps) and peak GiB beyond the inputs of one workload."""

    def __init__(self, reps: int, warm: bool = False):
        self.reps, self.warm = reps, warm   # warm: one call before the peak is reset
        self.times, self.peaks = {}, {}
        self.inputs = torch.cuda.memory_allocated()

    def measure(self, who, fn) -> None:
        _free()
        if self.warm:
            fn()
            torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.times[who] = _timer(torch, fn, self.reps)
        self.peaks[who] = (torch.cuda.max_memory_allocated() - self.inputs) / 2**30

    def report(self, title: str, base: str, relative: str, width: int, digits: int) -> dict:
        print(title)
        for who, ms in self.times.items():
            print(f"  {who:{width}s} {ms:9.3f} ms   ({ms / self.times[base]:.2f}x {relative})  "
                  f"{self.peaks[who]:6.{digits}f} GiB")
        return {"ms": self.times, "peak_gib": self.peaks}


def large(reps: int, scale: float) -> list:
    import torch._dynamo

    rows = []
    half = torch.tensor(0.5, device="cuda")
    for name, args, ours, theirs in _workloads(scale):
        table = _Table(reps)
        measure = table.measure
        measure("cupyloss.torch", _fwd_bwd(ours, args))
        measure("cupyloss.torch, upstream 0.5", _fwd_bwd(ours, args, half))
        CF.gradients_in_forward = False
        try:
            measure("cupyloss.torch, rerun backward", _fwd_bwd(ours, args))
        finally:
            CF.gradients_in_forward = True
        measure("torch eager", _fwd_bwd(theirs, args))
        torch._dynamo.reset()
        measure("torch.compile", _fwd_bwd(torch.compile(theirs), args))
        shape = "x".join(map(str, args[0].shape))
        rows.append({"workload": name, "shape": list(args[0].shape), **table.report(
            f"{name} [{shape}] float32, forward + backward, GPU ms (median of {reps}) and peak "
            f"memory beyond the inputs:", "cupyloss.torch", "cupyloss.torch's time", 34, 2)})
        del args
        _free()
    return rows


def _compiled_workloads(scale: float):
    """(name, arguments, step with cupyloss.torch, step with torch, the eager adapter's call,
    Liger-Kernel's step or None, the cupyloss step with inplace_backward=True or None) of each
    compiled case."""
    g = torch.Generator(device="cuda").manual_seed(0)
    F = torch.nn.functional

    def side(n):
        return max(1, int(n * scale))

    def on_copy(f):         # the loss of an intermediate, as a model's output is
        return lambda a, *rest: f(a * 1.0, *rest)

    x = torch.randn(side(32768), side(32768), device="cuda", generator=g, requires_grad=True)
    y = torch.randn(x.shape, device="cuda", generator=g)
    yield "mse", (x, y), on_copy(CF.mse_loss), on_copy(F.mse_loss), CF.mse_loss, None, None
    del x, y
    _free()
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        liger_cross_entropy = None
    def inplace(a, b):
        return CF.cross_entropy(a, b, inplace_backward=True)

    for name, rows, cols, dtype in (("ce", 8192, 128256, torch.bfloat16),
                                    ("kb95", 32768, 4096, torch.float32)):
        x = torch.randn(side(rows), cols, device="cuda", generator=g).to(dtype).requires_grad_()
        t = torch.randint(0, cols, (side(rows),), device="cuda", generator=g)
        yield (name, (x, t), on_copy(CF.cross_entropy), on_copy(F.cross_entropy),
               CF.cross_entropy, liger_cross_entropy and on_copy(liger_cross_entropy),
               on_copy(inplace))
        del x, t
        _free()
    # An output layer's logits (8192 tokens, hidden 512, 128256 classes, bfloat16): the loss's
    # input comes from a product, as in a model, in every case alike.
    h = (torch.randn(side(8192), 512, device="cuda", generator=g) * 0.5).to(
        torch.bfloat16).requires_grad_()
    w = (torch.randn(128256, 512, device="cuda", generator=g) * 0.05).to(
        torch.bfloat16).requires_grad_()
    t = torch.randint(0, 128256, (side(8192),), device="cuda", generator=g)

    def head(f):
        return lambda a, b, c: f(a @ b.T, c)

    yield ("ce-head", (h, w, t), head(CF.cross_entropy), head(F.cross_entropy),
           head(CF.cross_entropy), liger_cross_entropy and head(liger_cross_entropy),
           head(inplace))
    del h, w, t
    _free()
    a, p, n = (torch.randn(side(32768), side(8192), device="cuda", generator=g,
                           requires_grad=True) for _ in range(3))
    yield ("triplet", (a, p, n), on_copy(CF.triplet_margin_loss),
           on_copy(F.triplet_margin_loss), CF.triplet_margin_loss, None, None)


def compiled(reps: int, scale: float) -> list:
    """The compiled training step's loss (module docstring): ms and peak GiB of each way."""
    import torch._dynamo

    rows = []
    for name, args, ours, theirs, eager_call, liger, inplace in _compiled_workloads(scale):
        table = _Table(reps, warm=True)     # the warm call compiles
        ways = [("cupyloss.torch eager", "cupyloss.torch compiled", eager_call, ours)]
        if inplace is not None:
            ways.append(("cupyloss.torch eager, inplace_backward",
                         "cupyloss.torch compiled, inplace_backward", inplace, inplace))
        ways.append(("torch eager", "torch.compile", theirs, theirs))
        for eager_name, compiled_name, eager_fn, step in ways:
            table.measure(eager_name, _fwd_bwd(eager_fn, args))
            torch._dynamo.reset()
            table.measure(compiled_name, _fwd_bwd(torch.compile(step, fullgraph=True), args))
        if liger is not None:
            table.measure("Liger-Kernel (logits gradient in place)", _fwd_bwd(liger, args))
        torch._dynamo.reset()
        shape = "x".join(map(str, args[0].shape))
        dtype = str(args[0].dtype).removeprefix("torch.")
        rows.append({"workload": name, "shape": list(args[0].shape), **table.report(
            f"{name} [{shape}] {dtype}, forward + backward of the step, GPU ms (median of "
            f"{reps}) and peak memory beyond the inputs:", "cupyloss.torch eager",
            "the eager adapter's", 42, 3)})
        del args
        _free()
    return rows


def autocast(reps: int, scale: float) -> list:
    """cross_entropy under bfloat16 autocast (module docstring): ms and peak GiB of each way."""
    import torch._dynamo

    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, cols in (("ce", 8192, 128256), ("kb95", 32768, 4096)):
        n = max(1, int(n * scale))
        x = torch.randn(n, cols, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, cols, (n,), device="cuda", generator=g)

        def under_autocast(f, x=x, t=t):
            def run():
                x.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = f(x, t)
                loss.backward()
            return run

        table = _Table(reps, warm=True)
        table.measure("cupyloss.torch", under_autocast(CF.cross_entropy))
        torch._dynamo.reset()
        table.measure("cupyloss.torch compiled",
                      under_autocast(torch.compile(CF.cross_entropy, fullgraph=True)))
        table.measure("torch eager", under_autocast(F.cross_entropy))
        torch._dynamo.reset()
        table.measure("torch.compile", under_autocast(torch.compile(F.cross_entropy)))
        torch._dynamo.reset()
        rows.append({"workload": name, "shape": [n, cols], **table.report(
            f"{name} cross_entropy [{n}x{cols}] bfloat16 under autocast, forward + backward, "
            f"GPU ms (median of {reps}) and peak memory beyond the inputs:", "cupyloss.torch",
            "cupyloss.torch's time", 24, 3)})
        del x, t, table
        _free()
    return rows


def main(argv=None) -> dict:
    global torch, CF
    ap = _timing.arguments("python -m cupyloss.bench.torch_adapter", __doc__, 20,
                           json_help="write the results to this file", scale="shrink every side")
    ap.add_argument("--small-only", action="store_true", help="only the 1K-element host cost")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections of small, large, compiled, autocast "
                         "(default: all)")
    ap.add_argument("--profile", action="store_true", help="cProfile the 1K adapter loop")
    args = ap.parse_args(argv)
    torch, device = _timing.torch_gpu(ap.prog)
    import cupyloss.torch as CF
    print(f"device: {device}; torch {torch.__version__}")
    sections = (["small"] if args.small_only
                else args.only.split(",") if args.only
                else ["small", "large", "compiled", "autocast"])
    result = {"device": device}
    if "small" in sections:
        result["small"] = small(args.profile)
        _free()
    if "large" in sections:
        result["large"] = large(args.reps, args.scale)
    if "compiled" in sections:
        result["compiled"] = compiled(args.reps, args.scale)
    if "autocast" in sections:
        result["autocast"] = autocast(args.reps, args.scale)
    return _timing.save(args.json, result)


if __name__ == "__main__":
    main()
