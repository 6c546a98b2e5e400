"""Run a test's worker in a process a rank (torch.distributed tests) without ever hanging."""

import os
import tempfile
import time


def run_ranks(worker, world, timeout):
    """worker(rank, world, rendezvous path, queue) in a process a rank; the failures they
    report.  Never hangs: ranks that report nothing within `timeout` seconds are a failure, and
    processes still alive after reporting (a stuck teardown) are killed."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    failures, seen = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(rank, world, os.path.join(tmp, "rv"), results))
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(seen) < world:
                rank, got = results.get(timeout=max(1.0, deadline - time.monotonic()))
                seen.add(rank)
                failures += got
        except queue.Empty:
            failures.append(f"ranks {sorted(set(range(world)) - seen)} reported nothing in "
                            f"{timeout} s (exit codes {[p.exitcode for p in procs]})")
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    return failures
