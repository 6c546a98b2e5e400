"""Seconds from a new process's first tensor to its first gradient, with every cache empty.

    python -m cupyloss.bench.firstcall [--cases ce_torch,mse_torch] [--losses] [--json out.json]

Each case runs twice in a new Python process: first with empty on-disk caches (cupyloss's kernel
cache, CuPy's, TorchInductor's and Triton's all pointed at a new temporary folder), then again
with the caches the first process left, as a second process on the same machine finds them.
The time is taken inside the process, from before its first tensor is made to after its first
gradient is on the host's side of a device synchronisation (imports excluded); the process's
whole wall time is printed beside it.

Cases: torch eager, torch.compile and (when installed) Liger-Kernel cross entropy against
cupyloss's on torch tensors and on CuPy arrays (bfloat16 logits 512 x 4096), mse_loss through
the torch adapter, three row losses through it, and a script of five losses on CuPy arrays.
--losses adds every registered loss alone (its first value_and_grad on small float32 CuPy
arrays), linear_cross_entropy, and cross_entropy with label smoothing.  Needs a GPU; never used as a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_TORCH = """
import torch, torch.nn.functional as F
t0 = time.perf_counter()
x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
t = torch.randint(0, 4096, (512,), device="cuda")
"""
_CUPY = """
import cupy, ml_dtypes, cupyloss
t0 = time.perf_counter()
rng = cupy.random.default_rng(0)
def randn(*shape):
    return rng.standard_normal(shape, dtype=cupy.float32)
def rand(*shape):
    return rng.random(shape, dtype=cupy.float32)
def labels(n, c):
    return rng.integers(0, c, n, dtype=cupy.int64)
"""
_CE_CUPY = ("x = randn(512, 4096).astype(ml_dtypes.bfloat16)\n"
            "loss, grad = cupyloss.cross_entropy_value_and_grad(x, labels(512, 4096))\n")

CASES = {
    "ce_torch_eager": ("torch eager F.cross_entropy", _TORCH + """
F.cross_entropy(x, t).backward()
"""),
    "ce_torch_compile": ("torch.compile(F.cross_entropy)", _TORCH + """
torch.compile(F.cross_entropy)(x, t).backward()
"""),
    "ce_liger": ("Liger-Kernel liger_cross_entropy", _TORCH + """
from liger_kernel.transformers.functional import liger_cross_entropy
liger_cross_entropy(x, t).backward()
"""),
    "ce_cupyloss_torch": ("cupyloss.torch.cross_entropy", _TORCH + """
import cupyloss.torch as clt
clt.cross_entropy(x, t).backward()
"""),
    "ce_cupyloss_cupy": ("cupyloss.cross_entropy_value_and_grad on CuPy", _CUPY + _CE_CUPY),
    "mse_torch": ("cupyloss.torch.mse_loss", _TORCH + """
import cupyloss.torch as clt
y = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
clt.mse_loss(x, y).backward()
"""),
    "rows_torch": ("cupyloss.torch triplet + jsd + bce_with_logits", _TORCH + """
import cupyloss.torch as clt
a, p, n = (torch.randn(64, 512, device="cuda", requires_grad=True) for _ in range(3))
clt.triplet_margin_loss(a, p, n).backward()
q = torch.randn(64, 1000, device="cuda").log_softmax(-1)
clt.jsd(torch.randn(64, 1000, device="cuda", requires_grad=True).log_softmax(-1), q).backward()
clt.binary_cross_entropy_with_logits(x, torch.rand(512, 4096, device="cuda",
                                     dtype=torch.bfloat16)).backward()
"""),
    "five_cupy": ("five losses on CuPy (ce, mse, triplet, jsd, bce_logits)", _CUPY + _CE_CUPY + """
cupyloss.mse_loss_value_and_grad(randn(4096), randn(4096))
cupyloss.triplet_margin_loss_value_and_grad(randn(64, 512), randn(64, 512), randn(64, 512))
cupyloss.jsd_value_and_grad(randn(64, 1000), randn(64, 1000))
cupyloss.binary_cross_entropy_with_logits_value_and_grad(randn(4096), randn(4096))
"""),
}

# Every loss's first value_and_grad on small float32 CuPy arrays (--losses), made by the random
# generator alone, so that no CuPy kernel besides the generator's is compiled in the timed part.
_ARGS = {
    "cross_entropy": "randn(64, 1000), labels(64, 1000)",
    "nll_loss": "randn(64, 1000), labels(64, 1000)",
    "multi_margin_loss": "randn(64, 100), labels(64, 100)",
    "multilabel_soft_margin_loss": "randn(64, 100), randn(64, 100)",
    "multilabel_margin_loss": "randn(64, 100), labels((64, 100), 100)",
    "jsd": "randn(64, 1000), randn(64, 1000)",
    "triplet_margin_loss": "randn(64, 512), randn(64, 512), randn(64, 512)",
    "cosine_embedding_loss": "randn(64, 512), randn(64, 512), randn(64)",
    "margin_ranking_loss": "randn(4096), randn(4096), randn(4096)",
    "gaussian_nll_loss": "randn(4096), randn(4096), rand(4096)",
    "binary_cross_entropy": "rand(4096), rand(4096)",
}


def loss_cases() -> dict:
    """One case per registered loss, linear_cross_entropy, and cross_entropy with label
    smoothing."""
    from cupyloss._core import registry as _registry

    cases = {}
    for name in _registry.all_losses():
        args = _ARGS.get(name, "randn(4096), randn(4096)")
        cases[f"loss_{name}"] = (f"{name}_value_and_grad alone",
                                 _CUPY + f"cupyloss.{name}_value_and_grad({args})\n")
    cases["loss_linear_cross_entropy"] = (
        "linear_cross_entropy_value_and_grad alone",
        _CUPY + "cupyloss.linear_cross_entropy_value_and_grad(randn(64, 256), randn(1000, 256), "
                "labels(64, 1000))\n")
    cases["loss_cross_entropy_smoothing"] = (
        "cross_entropy_value_and_grad, label_smoothing=0.1",
        _CUPY + f"cupyloss.cross_entropy_value_and_grad({_ARGS['cross_entropy']}, "
                f"label_smoothing=0.1)\n")
    return cases


def _child(body: str) -> str:
    return ("import json, time\n" + body
            + "import cupy\ncupy.cuda.runtime.deviceSynchronize()\n"
            + "print('FIRSTCALL', json.dumps(time.perf_counter() - t0))\n")


def run_case(body: str, caches: str) -> tuple[float, float]:
    """(seconds first tensor -> first gradient, process wall seconds) of `body` in a new
    process whose caches live under `caches`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               CUPYLOSS_CACHE_DIR=os.path.join(caches, "cupyloss"),
               CUPY_CACHE_DIR=os.path.join(caches, "cupy"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _child(body)], env=env, capture_output=True,
                          text=True, cwd=caches)   # cupyloss from the environment, not the cwd
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIRSTCALL ")]
    if done.returncode or not lines:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                           else f"exit status {done.returncode}")
    return json.loads(lines[-1].split(" ", 1)[1]), wall


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m cupyloss.bench.firstcall",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help=f"comma-separated cases (default: all of "
                        f"{', '.join(CASES)})")
    parser.add_argument("--losses", action="store_true",
                        help="also every registered loss alone, and label smoothing")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    from cupyloss.bench import _timing

    _timing.need(parser.prog)
    cases = dict(CASES)
    if args.cases:
        cases = {name: CASES[name] for name in args.cases.split(",")}
    if args.losses:
        cases.update(loss_cases())
    rows = []
    print(f"{'case':58} {'empty caches':>14} {'second process':>15}   (process wall s)")
    for name, (label, body) in cases.items():
        with tempfile.TemporaryDirectory() as caches:
            try:
                cold, cold_wall = run_case(body, caches)
                warm, warm_wall = run_case(body, caches)
            except RuntimeError as exc:
                print(f"{label:58} skipped: {exc}")
                continue
        rows.append({"case": name, "label": label, "cold_s": cold, "warm_s": warm,
                     "cold_wall_s": cold_wall, "warm_wall_s": warm_wall})
        print(f"{label:58} {cold:14.2f} {warm:15.2f}   ({cold_wall:.1f}, {warm_wall:.1f})",
              flush=True)
    return _timing.save(args.json, rows)


if __name__ == "__main__":
    main()
