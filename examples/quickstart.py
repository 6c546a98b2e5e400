"""Quickstart: the three losses on the GPU, checked against NumPy in float64.

    python examples/quickstart.py
"""

import sys

import numpy as np


def main() -> int:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device found")
    except Exception as exc:  # no CuPy, no driver, or no GPU
        print(f"cupyloss needs an NVIDIA GPU with CUDA; none is usable here ({exc}).")
        return 1

    import cupyloss as cl

    rng = np.random.default_rng(0)
    p = rng.random((512, 1000)) + 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.random((512, 1000)) + 1e-3
    q /= q.sum(-1, keepdims=True)
    x = rng.standard_normal((512, 1000))
    y = np.sign(rng.standard_normal(1000))            # one label per column, broadcast over rows
    P, Q, X, Y = (cupy.asarray(a, dtype=cupy.float32) for a in (p, q, x, y))

    checks = [
        ("mse_loss", cl.mse_loss(P, Q), np.mean((p - q) ** 2)),
        ("kl_div(log p, q, batchmean)", cl.kl_div(cupy.log(P), Q, reduction="batchmean"),
         np.sum(q * (np.log(q) - np.log(p))) / p.shape[0]),
        ("kl_div(p, q, log_input=False)", cl.kl_div(P, Q, reduction="batchmean", log_input=False),
         np.sum(q * (np.log(q) - np.log(p))) / p.shape[0]),
        ("hinge_loss", cl.hinge_loss(X, Y), np.mean(np.maximum(0, 1 - x * y))),
    ]
    loss, (g_x, g_y) = cl.hinge_loss_value_and_grad(X, Y)
    mask = (1 - x * y) >= 0
    checks.append(("d hinge / d target", g_y, np.sum(-x * mask, axis=0) / x.size))

    ok = True
    for name, got, want in checks:
        got = cupy.asnumpy(got).astype(np.float64)
        err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
        ok &= err < 1e-4
        print(f"{name:32s} max rel. error vs NumPy float64: {err:.1e}")
    print("all match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
