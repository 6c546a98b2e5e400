"""Train a small language model with its output layer split over two ranks (tensor parallelism),
and once more on one rank, from the same weights on the same batches.

    python examples/vocab_parallel_training.py [--steps 100] [--vocab 4096]

Each rank holds the whole trunk (an embedding and a two-layer MLP, width 128) and half of the
output layer's rows; its loss is cupyloss.torch.vocab_parallel_cross_entropy of its half of the
logits, the same on both ranks.  The trunk's output feeds both halves, so its gradient is the
sum of the two ranks' (an all-reduce in backward, as tensor-parallel layers do).  The
reference run is one process with the whole output layer and F.cross_entropy.  Two GPUs: NCCL,
one a rank; otherwise two CPU processes over gloo.  Prints both final losses and exits non-zero
when they differ by more than 1e-3 relative (rounding drifts over the steps: the split sums
the logits' products in other orders).
"""

import argparse
import os
import sys
import tempfile


def _model(torch, vocab, width=128):
    torch.manual_seed(0)
    nn = torch.nn
    trunk = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, width), nn.LayerNorm(width))
    head = nn.Linear(width, vocab, bias=False)
    return trunk, head


def _batches(torch, vocab, steps, rows=512):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, vocab, (rows,), generator=g)
        yield x, (x * 7 + 3) % vocab            # a rule to learn


def _rank(rank, world, path, args, out):
    import torch
    import torch.distributed as dist

    import cupyloss.torch as CF

    cuda = args.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"file://{path}", rank=rank,
                            world_size=world)
    trunk, head = _model(torch, args.vocab)
    rows = args.vocab // world
    weight = torch.nn.Parameter(head.weight.detach()[rank * rows:(rank + 1) * rows].clone())
    trunk.to(device)
    weight = torch.nn.Parameter(weight.to(device))
    opt = torch.optim.Adam([*trunk.parameters(), weight], lr=3e-3)

    class SumGrad(torch.autograd.Function):     # identity; backward sums over the ranks
        @staticmethod
        def forward(ctx, h):
            return h.view_as(h)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    loss = None
    for x, y in _batches(torch, args.vocab, args.steps):
        x, y = x.to(device), y.to(device)
        h = SumGrad.apply(trunk(x))
        loss = CF.vocab_parallel_cross_entropy(h @ weight.T, y, dist.group.WORLD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        out.put(float(loss.detach()))
    dist.destroy_process_group()


def _single(torch, args, device):
    trunk, head = _model(torch, args.vocab)
    trunk.to(device)
    head.to(device)
    opt = torch.optim.Adam([*trunk.parameters(), head.weight], lr=3e-3)
    loss = None
    for x, y in _batches(torch, args.vocab, args.steps):
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(head(trunk(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.backend = "nccl" if gpus >= 2 else "gloo"
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "rv"), args, out), nprocs=2,
                           join=True, start_method="spawn")
    split = out.get()
    whole = _single(torch, args, "cuda" if args.backend == "nccl" else "cpu")
    where = "2 GPUs (NCCL)" if args.backend == "nccl" else "2 CPU processes (gloo)"
    print(f"after {args.steps} steps: output layer split over {where}: loss {split:.6f}; "
          f"one process, F.cross_entropy: {whole:.6f}")
    ok = abs(split - whole) <= 1e-3 * abs(whole)
    print("same training" if ok else "the two runs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
