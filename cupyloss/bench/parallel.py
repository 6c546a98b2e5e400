"""Benchmark vocab-parallel cross entropy over the GPUs of one host.

    python -m cupyloss.bench.parallel [--gpus 2,4] [--rows 8192] [--classes 128256] [--reps 20]

Logits (rows, classes) bfloat16 split in equal slices over k GPUs (NCCL, one process a GPU),
int64 targets with 10% ignore_index, forward + backward of the mean loss
(cupyloss.torch.vocab_parallel_cross_entropy).  Beside it, in the same processes:

  graphed        the same step captured in a CUDA graph and replayed: the GPUs' time
                 without the host's (each eager step's launches and collective calls)
  one GPU        cupyloss.torch.cross_entropy on the whole logits (GPU 0, k = 1)
  all-gather     the exchange alone: every rank's (rows, 5) float32 statistics
  stats, grad    the two kernels alone on a rank's slice (cupyloss.parallel)
  fused linear   vocab_parallel_linear_cross_entropy at --hidden (bfloat16, the weight's rows
                 split), against linear_cross_entropy of the whole weight on one GPU: the
                 TFLOP/s of the three products per GPU; and with sequence_parallel (each
                 rank's block of the hidden rows gathered, its gradient reduce-scattered)

The issue's bound is one GPU's time / k + the all-gather; the floor of a step that must
exchange statistics between its read of the logits and its gradient is three passes over a
rank's slice (read, read, write) against one GPU's two.  Medians of --reps runs of 10 calls
back to back (CUDA events; every rank timed, the slowest rank reported), peak memory above
the inputs.  Never a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile


BURST = 10    # calls back to back between two events: the host queues ahead, as in training


def _median_ms(torch, fn, reps):
    import torch.distributed as dist

    times = []
    for _ in range(3):
        fn()
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(BURST):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / BURST)
    return statistics.median(times)


def _inputs(torch, rows, cols, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16)
    return x


def _targets(torch, rows, classes):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[torch.rand(rows, device="cuda", generator=gen) < 0.1] = -100
    return t


def _rank(rank, k, path, args, results):
    import torch
    import torch.distributed as dist

    import cupyloss.torch as CF
    from cupyloss.torch import _parallel as _torch_parallel
    from cupyloss import parallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=k,
                            device_id=torch.device("cuda", rank))
    try:
        rows, classes = args.rows, args.classes
        cols = classes // k
        x = _inputs(torch, rows, cols, rank).requires_grad_()
        t = _targets(torch, rows, classes)
        group = dist.group.WORLD
        out = {}

        def step():
            x.grad = None
            CF.vocab_parallel_cross_entropy(x, t, group, class_offset=rank * cols,
                                            classes=k * cols).backward()

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out["step"] = _median_ms(torch, step, args.reps)
        out["peak"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        # the same step replayed from a CUDA graph: the GPU's time without the host's
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out["graphed"] = _median_ms(torch, graph.replay, args.reps)
        graph.reset()             # its collectives go before the communicator
        x.grad = None
        stats = torch.empty(rows, parallel.FIELDS, device="cuda")
        every = torch.empty(k * rows, parallel.FIELDS, device="cuda")
        out["gather"] = _median_ms(
            torch, lambda: _torch_parallel._all_gather(every, stats, group=group), args.reps)
        xd = x.detach()
        out["stats"] = _median_ms(torch, lambda: parallel.vocab_parallel_stats(
            xd, t, rank * cols, k * cols), args.reps)
        lse = torch.zeros(rows, device="cuda")
        g = torch.ones(rows, device="cuda")
        out["grad"] = _median_ms(torch, lambda: parallel.vocab_parallel_backward(
            g, xd, t, lse, rank * cols, k * cols), args.reps)
        x = xd = None         # the logits freed before the fused form
        if args.hidden:
            out.update(_linear_rank(torch, CF, rank, k, group, args))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _linear_inputs(torch, rows, hidden, classes, offset=0):
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    gen.manual_seed(2 + offset)
    w = (torch.randn(classes, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    return h.requires_grad_(), w.requires_grad_()


def _linear_rank(torch, CF, rank, k, group, args):
    """The fused linear form on this rank's rows of the weight: (ms, TFLOP/s of its three
    products)."""
    cols = args.classes // k
    h, w = _linear_inputs(torch, args.rows, args.hidden, cols, rank)
    t = _targets(torch, args.rows, args.classes)

    def step():
        h.grad = w.grad = None
        CF.vocab_parallel_linear_cross_entropy(h, w, t, group, class_offset=rank * cols,
                                               classes=k * cols).backward()

    ms = _median_ms(torch, step, max(3, args.reps // 4))
    out = {"linear": ms, "linear_tflops": 6 * args.rows * args.hidden * cols / ms / 1e9}
    per = args.rows // k
    block = h.detach()[rank * per:(rank + 1) * per].clone().requires_grad_()

    def split():
        block.grad = w.grad = None
        CF.vocab_parallel_linear_cross_entropy(block, w, t[:per * k], group,
                                               class_offset=rank * cols, classes=k * cols,
                                               sequence_parallel=True).backward()

    sp = _median_ms(torch, split, max(3, args.reps // 4))
    out.update(sp=sp, sp_tflops=6 * per * k * args.hidden * cols / sp / 1e9)
    return out


def _one_gpu(torch, args):
    """(cross_entropy ms, linear_cross_entropy ms or None) on GPU 0, the whole classes."""
    import cupyloss.torch as CF

    x = _inputs(torch, args.rows, args.classes, 0).requires_grad_()
    t = _targets(torch, args.rows, args.classes)

    def step():
        x.grad = None
        CF.cross_entropy(x, t).backward()

    ms = _median_ms(torch, step, args.reps)
    x.grad = None
    x = None
    linear = None
    if args.hidden:
        h, w = _linear_inputs(torch, args.rows, args.hidden, args.classes)

        def head():
            h.grad = w.grad = None
            CF.linear_cross_entropy(h, w, t).backward()

        linear = _median_ms(torch, head, max(3, args.reps // 4))
        h.grad = w.grad = None
        h = w = None
    torch.cuda.empty_cache()
    return ms, linear


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="2,4", help="GPU counts to run (those present)")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=4096,
                        help="width of the fused linear form (0: skip it)")
    args = parser.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    name = torch.cuda.get_device_name(0)
    have = torch.cuda.device_count()
    one, one_linear = _one_gpu(torch, args)
    logits = args.rows * args.classes * 2
    print(f"{name} x {have}; logits {args.rows} x {args.classes} bfloat16 "
          f"({logits / 2**30:.2f} GiB), mean loss, forward + backward; medians of {args.reps}")
    print(f"one GPU, cupyloss.torch.cross_entropy: {one:.3f} ms "
          f"({2 * logits / one / 1e6:.0f} GB/s of read + write)")
    print(f"{'k':>2} {'step ms':>8} {'graphed':>8} {'stats':>7} {'grad':>7} {'gather':>7} "
          f"{'bound':>7} {'ratio':>6} {'floor':>7} {'peak GiB':>8} {'sent B/rank':>11}")
    for k in [int(v) for v in args.gpus.split(",")]:
        if k > have:
            print(f"{k:>2} skipped: {have} GPUs here")
            continue
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_rank, args=(k, os.path.join(tmp, "rv"), args, results),
                               nprocs=k, join=True, start_method="spawn")
        got = [results.get()[1] for _ in range(k)]
        worst = {key: max(r[key] for r in got) for key in got[0]}
        bound = one / k + worst["gather"]
        floor = 1.5 * one / k + worst["gather"]
        print(f"{k:>2} {worst['step']:8.3f} {worst['graphed']:8.3f} {worst['stats']:7.3f} "
              f"{worst['grad']:7.3f} {worst['gather']:7.3f} {bound:7.3f} "
              f"{worst['step'] / bound:5.2f}x "
              f"{floor:7.3f} {worst['peak']:8.3f} {args.rows * 20:>11}")
        if one_linear is not None:
            rate = min(r["linear_tflops"] for r in got)
            single = 6 * args.rows * args.hidden * args.classes / one_linear / 1e9
            print(f"   fused linear, H={args.hidden}: {worst['linear']:.3f} ms a rank, "
                  f"{rate:.0f} TFLOP/s a GPU; one GPU {one_linear:.3f} ms, {single:.0f} TFLOP/s "
                  f"({rate / single:.0%} of its efficiency)")
            sp = min(r["sp_tflops"] for r in got)
            print(f"   sequence parallel (hidden's rows split too): {worst['sp']:.3f} ms a rank, "
                  f"{sp:.0f} TFLOP/s a GPU ({sp / single:.0%})")


if __name__ == "__main__":
    main()
