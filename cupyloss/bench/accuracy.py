"""How close reduced losses and summed gradients come to the float64 truth, next to torch's fp32.

    python -m cupyloss.bench.accuracy [--json out.json]

For each workload the inputs are float32; the truth is the same formula evaluated in float64 on
the GPU from those float32 values (in row chunks, so memory stays bounded).  Reports the relative
error |got - truth| / |truth| of cupyloss's fp32 result and of torch's fp32 result on the same
inputs, and their ratio (below 1: cupyloss is closer), next to the floor: the error of the truth
rounded to float32, which no float32 result can beat (a result at the floor is correctly
rounded).  Workloads:
  mse    mse_loss over [32768, 32768] (2^30 elements, KernelBench 94's size)
  kl     kl_div(log p, q, 'batchmean') over [16384, 16384]
  hinge  mean(clamp(1 - x t, min=0)) over [32768, 32768] with t of shape [32768], and the
         gradient of t (each element a sum of 32768 terms): max relative error over its elements
Never used as a test.
"""

from __future__ import annotations

import argparse

import cupy
import numpy

import cupyloss
from cupyloss.bench import _timing

CHUNK = 2048  # rows per float64 chunk


def _truth(fn64, *arrays) -> float:
    """Sum over row chunks of fn64 applied to float64 copies of the rows."""
    total = 0.0
    for r in range(0, arrays[0].shape[0], CHUNK):
        rows = [a[r:r + CHUNK].astype(cupy.float64) if a.ndim == 2 else a.astype(cupy.float64)
                for a in arrays]
        total += float(fn64(*rows))
    return total


def _rel(got: float, truth: float) -> float:
    return abs(got - truth) / abs(truth)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m cupyloss.bench.accuracy",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    _timing.need(ap.prog, torch=True)
    import torch
    import torch.nn.functional as F

    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    rng = cupy.random.default_rng(0)
    rows = []

    def record(workload, quantity, ours, theirs, truth):
        e_ours, e_torch = _rel(ours, truth), _rel(theirs, truth)
        rows.append(dict(workload=workload, quantity=quantity, device=device,
                         cupyloss_rel_err=e_ours, torch_rel_err=e_torch,
                         floor_rel_err=_rel(float(numpy.float32(truth)), truth),
                         ratio=e_ours / e_torch if e_torch else float("inf")))

    x = rng.standard_normal((32768, 32768), dtype=cupy.float32)
    y = rng.standard_normal((32768, 32768), dtype=cupy.float32)
    truth = _truth(lambda a, b: ((a - b) ** 2).sum(), x, y) / x.size
    record("mse 32768^2", "loss", float(cupyloss.mse_loss(x, y)),
           float(F.mse_loss(torch.from_dlpack(x), torch.from_dlpack(y))), truth)
    del y

    t = cupy.sign(rng.standard_normal((32768,), dtype=cupy.float32))
    truth = _truth(lambda a, b: cupy.maximum(1 - a * b, 0).sum(), x, t) / x.size
    tx, tt = torch.from_dlpack(x), torch.from_dlpack(t)
    record("hinge 32768^2, t (32768,)", "loss", float(cupyloss.hinge_loss(x, t)),
           float(torch.mean(torch.clamp(1 - tx * tt, min=0))), truth)
    # d/dt of sum(max(0, 1 - x t)) = -sum over rows of x where 1 - x t >= 0.
    g_ours = cupyloss.hinge_loss_backward(1.0, x, t, reduction="sum", wrt="target")
    tg = tt.detach().clone().requires_grad_()
    g_torch, = torch.autograd.grad(torch.sum(torch.clamp(1 - tx * tg, min=0)), tg)
    g_true = cupy.zeros(32768, cupy.float64)
    for r in range(0, 32768, CHUNK):
        a = x[r:r + CHUNK].astype(cupy.float64)
        g_true -= cupy.where(1 - a * t.astype(cupy.float64) >= 0, a, 0).sum(axis=0)
    scale = cupy.abs(g_true) + 1e-30
    e_ours = float(cupy.max(cupy.abs(g_ours.astype(cupy.float64) - g_true) / scale))
    e_torch = float(cupy.max(cupy.abs(cupy.from_dlpack(g_torch).astype(cupy.float64) - g_true)
                             / scale))
    e_floor = float(cupy.max(cupy.abs(g_true.astype(cupy.float32).astype(cupy.float64) - g_true)
                             / scale))
    rows.append(dict(workload="hinge 32768^2, t (32768,)", quantity="d/dt (max over elements)",
                     device=device, cupyloss_rel_err=e_ours, torch_rel_err=e_torch,
                     floor_rel_err=e_floor,
                     ratio=e_ours / e_torch if e_torch else float("inf")))
    del x, t, tx, tt, tg, g_ours, g_torch, g_true
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()

    p = rng.random((16384, 16384), dtype=cupy.float32) + 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.random((16384, 16384), dtype=cupy.float32) + 1e-3
    q /= q.sum(-1, keepdims=True)
    lp = cupy.log(p)
    truth = _truth(lambda a, b: (b * (cupy.log(b) - a)).sum(), lp, q) / 16384
    record("kl 16384^2 batchmean", "loss", float(cupyloss.kl_div(lp, q, "batchmean")),
           float(F.kl_div(torch.from_dlpack(lp), torch.from_dlpack(q), reduction="batchmean")),
           truth)
    del lp
    truth = _truth(lambda a, b: (b * (cupy.log(b) - cupy.log(a))).sum(), p, q) / 16384
    tp = torch.from_dlpack(p)
    record("kl 16384^2 probabilities in", "loss",
           float(cupyloss.kl_div(p, q, "batchmean", log_input=False)),
           float(F.kl_div(torch.log(tp), torch.from_dlpack(q), reduction="batchmean")), truth)

    print(f"relative error against float64, fp32 inputs, {device}")
    print(f"{'workload':28} {'quantity':26} {'cupyloss':>10} {'torch':>10} {'ratio':>7} "
          f"{'fp32 floor':>10}")
    for r in rows:
        print(f"{r['workload']:28} {r['quantity']:26} {r['cupyloss_rel_err']:10.2e} "
              f"{r['torch_rel_err']:10.2e} {r['ratio']:7.2f} {r['floor_rel_err']:10.2e}")
    return _timing.save(args.json, rows)


if __name__ == "__main__":
    main()
