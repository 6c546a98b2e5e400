"""Run a test's worker in a process a rank (torch.distributed tests) without ever hanging."""

import os
import tempfile
import time


def run_ranks(worker, world, timeout):
    """worker(rank, world, rendezvous path, queue) in a process a rank; the failures they
    report.  Never hangs: ranks that exit without reporting, or report nothing within `timeout`
    seconds, are a failure, and processes still alive after reporting (a stuck teardown) are
    killed.  A rank that exits is found at once, so a slow start under load is not taken for
    silence."""
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
                try:
                    rank, got = results.get(timeout=0.5)
                except queue.Empty:
                    missing = [r for r in range(world) if r not in seen]
                    exited = all(procs[r].exitcode is not None for r in missing)
                    if exited:
                        # what a rank put before exiting may still be in the pipe
                        rank, got = results.get(timeout=2.0)
                    elif time.monotonic() > deadline:
                        raise
                    else:
                        continue
                seen.add(rank)
                failures += got
        except queue.Empty:
            missing = sorted(set(range(world)) - seen)
            failures.append(f"ranks {missing} reported nothing (exit codes "
                            f"{[p.exitcode for p in procs]}, limit {timeout} s)")
        finally:
            for rank, p in enumerate(procs):
                p.join(60 if rank in seen else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return failures
