"""Compile cupyloss's kernels ahead of use, into the on-disk cache its calls load them from.

A call compiles the kernels it runs the first time it runs them (about a second each) and keeps
them in the cache folder (``CUPYLOSS_CACHE_DIR``, else ``~/.cupy/kernel_cache/cupyloss``); later
processes load them in milliseconds.  This command fills that folder beforehand, for a container
image, a cluster's shared folder or a CI cache, with the kernels of the losses, dtypes and GPU
architectures you name.  It needs NVRTC but no GPU: without one, name the architectures.
Processes may share one cache folder: entries are written whole and renamed into place.

    python -m cupyloss.tools.precompile                          # every loss, every dtype, this GPU
    python -m cupyloss.tools.precompile --losses cross_entropy,mse_loss --dtypes bfloat16 --arch 90
    CUPYLOSS_CACHE_DIR=/shared/cupyloss python -m cupyloss.tools.precompile --arch 80,90 -j 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

__all__ = ["jobs", "precompile"]


def _dtype_names() -> dict:
    from cupyloss._core import dtypes as _dtypes

    return {str(dtype): dtype for dtype in _dtypes.DTYPES}


def jobs(losses=None, dtypes=None, archs=()) -> list[tuple[str, str, str]]:
    """(file, name expression, arch) of every kernel the named losses can run on the named
    dtypes (all of either when None), once each, for each architecture in `archs`."""
    from cupyloss._core import registry as _registry, source as _source

    names = _dtype_names()
    losses = ([*_registry.all_losses(), *_source.FUSED_LOSSES] if losses is None
              else list(losses))
    if dtypes is None:
        dtypes = list(names.values())
    kernels: dict[tuple[str, str], None] = {}
    for loss in losses:
        for dtype in dtypes:
            for unit in _source.reachable(loss, names.get(dtype, dtype)):
                kernels[unit] = None
    return [(file, name, arch) for arch in archs for file, name in kernels]


def _compile(job) -> float:
    """Worker: one kernel (file, name, arch, gpu) into the cache; its seconds (0 when the cache
    had it)."""
    from cupyloss._core import source as _source

    file, name, arch, gpu = job
    start = time.perf_counter()
    _source.cached(file, [name], arch, gpu)
    return time.perf_counter() - start


def _device() -> tuple[str, str]:
    """(architecture, launch-table key) of the current GPU."""
    import cupy

    from cupyloss._core import launch as _launch

    try:
        device = cupy.cuda.Device()
        return device.compute_capability, _launch.device_limits(device.id).gpu
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise SystemExit(f"no CUDA device to take the architecture from ({exc}); name it with "
                         f"--arch, for example --arch 80,90") from None


def precompile(losses=None, dtypes=None, archs=None, processes=None, progress=None,
               gpu=None) -> int:
    """Compile the kernels of `losses` x `dtypes` (default: all) for `archs` (compute
    capabilities such as "90"; default: the current device's) with GPU `gpu`'s knobs of the
    launch table (a _tuning.gpu_key; default: the current device's without `archs`, else
    the defaults) into the cache, in `processes` worker processes (default: one per available
    core).  `progress(done, total, seconds)` is called as kernels finish.  Returns how many
    kernels were compiled or found cached."""
    if not archs:
        arch, here = _device()
        archs = [arch]
        gpu = here if gpu is None else gpu
    archs = [str(a) for a in archs]
    todo = [(*job, gpu or "") for job in jobs(losses, dtypes, archs)]
    processes = max(1, min(processes or len(os.sched_getaffinity(0)), len(todo) or 1))
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        for done, _ in enumerate(pool.map(_compile, todo, chunksize=4), 1):
            if progress:
                progress(done, len(todo), time.perf_counter() - start)
    return len(todo)


def _reporter(stream):
    """A progress callback: one line rewritten on a terminal, a line per tenth elsewhere."""
    tty = stream.isatty()
    shown = set()

    def report(done, total, seconds):
        tenth = done * 10 // total
        if tty:
            end = "\n" if done == total else ""
            stream.write(f"\r{done}/{total} kernels, {seconds:.0f} s{end}")
            stream.flush()
        elif tenth not in shown or done == total:
            shown.add(tenth)
            stream.write(f"{done}/{total} kernels, {seconds:.0f} s\n")
            stream.flush()

    return report


def main(argv=None) -> int:
    from cupyloss._core import registry as _registry, source as _source

    parser = argparse.ArgumentParser(
        prog="python -m cupyloss.tools.precompile",
        description="Compile cupyloss's kernels into the on-disk cache ahead of use "
                    "(needs NVRTC, not a GPU).",
        epilog=f"The cache folder now: {_source.cache_dir()} (set CUPYLOSS_CACHE_DIR to move "
               f"it).")
    parser.add_argument("--losses", help="comma-separated loss names (default: all); --list "
                        "prints them")
    parser.add_argument("--dtypes", help=f"comma-separated dtypes (default: all of "
                        f"{', '.join(_dtype_names())})")
    parser.add_argument("--arch", help="comma-separated compute capabilities, e.g. 80,90 "
                        "(default: the current GPU's)")
    parser.add_argument("--gpu", help="the launch table's row to compile with, a GPU's key such "
                        "as h200 (default: the current GPU's; with --arch, the defaults)")
    parser.add_argument("-j", "--jobs", type=int, help="worker processes (default: one a core)")
    parser.add_argument("--list", action="store_true", help="print the losses and exit")
    args = parser.parse_args(argv)
    losses = [*_registry.all_losses(), *_source.FUSED_LOSSES]
    if args.list:
        print("\n".join(losses))
        return 0
    chosen = args.losses.split(",") if args.losses else None
    unknown = [name for name in chosen or () if name not in losses]
    if unknown:
        parser.error(f"unknown losses {', '.join(unknown)}; --list prints the names")
    dtypes = args.dtypes.split(",") if args.dtypes else None
    unknown = [name for name in dtypes or () if name not in _dtype_names()]
    if unknown:
        parser.error(f"unknown dtypes {', '.join(unknown)}; choose from "
                     f"{', '.join(_dtype_names())}")
    archs = [a.strip().removeprefix("sm_") for a in args.arch.split(",")] if args.arch else None
    try:
        import cupy  # noqa: F401
    except ImportError:
        parser.error("CuPy is not installed: pip install 'cupyloss[cuda13]' (or [cuda12])")
    start = time.perf_counter()
    count = precompile(chosen, dtypes, archs, args.jobs, _reporter(sys.stderr), args.gpu)
    print(f"{count} kernels in {_source.cache_dir()} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
