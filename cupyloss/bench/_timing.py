"""Device time of a benchmarked call, with the host's launch latency kept out of it.

Every benchmark times its calls here.  Per run: launch `hold_stream` (kernels/bench.cu), which
keeps the stream busy a little longer than the call takes the host to enqueue; record the start
event; call; record the stop event.  The GPU reaches the start event only after the call's work
is queued behind it, so the events time the device's work alone, as it runs in a training loop
whose host stays ahead of the GPU (the blocking-kernel method of NVIDIA's nvbench).  Host cost per
call is measured separately (cupyloss.bench's small-call table).  Never used as a test.
"""

from __future__ import annotations

import statistics
import time


def gpu_ms(fn, reps: int, warmup: int = 3, stream: int | None = None) -> float:
    """Median milliseconds of device time of fn() over `reps` runs.

    stream: the raw cudaStream_t fn enqueues on (torch callers pass torch's current stream);
    default CuPy's current stream.
    """
    import cupy

    from cupyloss._core import source as _source

    hold = _source.function("bench.cu", "cupyloss::hold_stream")
    s = cupy.cuda.get_current_stream() if stream is None else cupy.cuda.ExternalStream(stream)
    host = []
    for _ in range(max(warmup, 2)):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
    s.synchronize()
    # The first warm-up call may compile or autotune; the others say how long enqueueing takes.
    hold_ns = cupy.uint64(int(1e9 * (2.0 * max(host[1:]) + 50e-6)))
    times = []
    for _ in range(reps):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        hold((1,), (1,), (hold_ns,), stream=s)
        begin.record(s)
        fn()
        end.record(s)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(begin, end))
    return statistics.median(times)


# After device memory goes back to the driver, the next few milliseconds of kernels run slower
# (H100, triplet_margin_loss forward at KernelBench 99: 1.235 ms right after torch.cuda.
# empty_cache() of 4 GiB, 1.037 before and 1.042 five seconds later; torch.compile's kernel,
# timed after it, unaffected).  A benchmark that frees between workloads waits this long.
SETTLE_S = 5.0


def release(torch=None) -> None:
    """Give CuPy's pool (and torch's cache, given torch) back to the driver, then wait SETTLE_S
    seconds so that the next timed call does not pay for it."""
    import cupy

    if torch is not None:
        torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.cuda.Device().synchronize()
    time.sleep(SETTLE_S)


def torch_steps(torch, step, reps: int, forget) -> tuple[float, float, float]:
    """(median device ms, peak GiB above what was allocated before, median host ms) of `reps`
    calls of step(), a training step on torch's current stream, once forget() has dropped what
    the caller's warm-up steps left (their gradients) and torch's cache is given back; CUDA
    events around each step, the host's time queueing it alongside."""
    torch.cuda.synchronize()
    forget()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, hosts = [], []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak, statistics.median(hosts)


def head_row(torch, rows: list, name: str, grads: float, measure, errors, **fields) -> None:
    """One implementation's row of a fused-head benchmark: measure() -> (median ms, peak GiB,
    its result), errors(result) -> {column: error}; printed as ms, peak, peak beyond the
    gradients (`grads` GiB) and the errors, and appended to `rows` with `fields`.  A failure
    (out of memory, a missing kernel) is printed and the benchmark goes on."""
    try:
        ms, peak, got = measure()
    except Exception as exc:  # out of memory or failing: say so, go on
        print(f"{name:22} failed: {type(exc).__name__}: {str(exc)[:160]}")
        torch.cuda.empty_cache()
        return
    errs = errors(got)
    rows.append(dict(fields, name=name, ms=ms, peak_gib=peak, beyond_gib=peak - grads, **errs))
    print(f"{name:22} {ms:8.2f} {peak:9.3f} {peak - grads:7.3f} "
          + " ".join(f"{e:9.2e}" for e in errs.values()), flush=True)
    torch.cuda.empty_cache()


def next_size(torch) -> None:
    """Between a head benchmark's sizes: drop torch.compile's graphs and give torch's cache
    back, so that the next size's peaks start from its inputs."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def need(prog: str, torch: bool = False, jax: bool = False) -> None:
    """Exit with one line saying what is missing when a benchmark cannot run here: a CUDA GPU
    (through CuPy), torch with CUDA when `torch`, JAX with a GPU backend when `jax`."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device found")
    except Exception as exc:  # no CuPy, no driver, or no GPU
        raise SystemExit(f"{prog} needs an NVIDIA GPU with CUDA; none is usable here ({exc})")
    if torch:
        try:
            import torch as torch_module
        except ImportError:
            raise SystemExit(f"{prog} needs PyTorch: pip install 'cupyloss[torch]'") from None
        if not torch_module.cuda.is_available():
            raise SystemExit(f"{prog} needs a CUDA build of PyTorch; torch "
                             f"{torch_module.__version__} sees no GPU")
    if jax:
        try:
            import jax as jax_module
        except ImportError:
            raise SystemExit(f"{prog} needs JAX: pip install 'cupyloss[jax]'") from None
        try:
            gpus = jax_module.devices("gpu")
        except RuntimeError as exc:
            raise SystemExit(f"{prog} needs JAX with a GPU backend; JAX "
                             f"{jax_module.__version__} has none ({exc})") from None
        if not gpus:
            raise SystemExit(f"{prog} needs JAX with a GPU backend; JAX sees no GPU")


def save(path, data):
    """Write a benchmark's results to `path` as JSON (nothing when path is None); return them."""
    if path:
        import json

        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)
    return data


def arguments(prog: str, doc: str, reps: int, json_help: str = "write the rows to this file",
              scale: str | None = None, no_compile: bool = False):
    """A benchmark command's parser (its description the first line of `doc`) with the options
    every benchmark takes: --reps (default `reps`) and --json; --scale (a factor, default 1,
    `scale` its help) and --no-compile where asked for."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    ap.add_argument("--reps", type=int, default=reps, help="timed runs a median is taken of")
    ap.add_argument("--json", default=None, help=json_help)
    if scale is not None:
        ap.add_argument("--scale", type=float, default=1.0, help=scale)
    if no_compile:
        ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    return ap


def torch_gpu(prog: str):
    """(torch, the GPU's name) for a benchmark that times torch on the GPU; exits saying what is
    missing otherwise (`need`)."""
    need(prog, torch=True)
    import torch

    return torch, torch.cuda.get_device_name()


def torch_forms(torch, f, arrays, wrt, compile_: bool = True, compiled=None) -> dict:
    """The loss f(*arrays) as torch runs it: {"torch eager": (forward, forward + backward),
    "torch.compile": the same}, the backward asking the gradients of the arrays at the indices
    `wrt` (of views that require grad).  torch.compile with static shapes where compile_ (or
    `compiled`, given)."""
    leaves = [a.detach().requires_grad_() if k in wrt else a for k, a in enumerate(arrays)]
    picked = [leaves[k] for k in wrt]

    def forms(fn):
        return (lambda: fn(*arrays)), (lambda: torch.autograd.grad(fn(*leaves), picked))

    out = {"torch eager": forms(f)}
    if compile_ or compiled is not None:
        out["torch.compile"] = forms(compiled or torch.compile(f, dynamic=False))
    return out
