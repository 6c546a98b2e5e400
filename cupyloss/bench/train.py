"""Benchmark the LM head in a real training loop: a small GPT trained with each head, side by side.

    python -m cupyloss.bench.train [--widths 512,1024] [--vocabs 32768,65536,128256]
                                   [--layers 4] [--tokens 8192] [--steps 200]
                                   [--heads torch,cupyloss,cupyloss-eager,liger]
                                   [--mode reduce-overhead]
                                   [--json out.json]

The recipe most users train with: a GPT (learned positions, pre-LayerNorm blocks of causal
attention and a 4x GELU MLP, a final LayerNorm, an untied nn.Linear head without bias), AdamW
(fused) over float32 master weights, the forward pass under ``torch.autocast("cuda",
torch.bfloat16)``, the blocks and each head's loss under ``torch.compile(fullgraph=True)``.
The heads, each from the same initial weights on the same batches:

  torch      F.cross_entropy(lm_head(h).float(), y)      (compiled: inductor's fused loss)
  cupyloss   cupyloss.torch.linear_cross_entropy(h, lm_head.weight, y)
  cupyloss-eager   the same called outside torch.compile (the blocks still compiled): the op's
             eager autograd.Function instead of the traced op and its dispatcher layers
  liger      Liger-Kernel's LigerFusedLinearCrossEntropyLoss (when importable)

The corpus is the Python standard library's sources (every machine has them) as byte pairs: the
V - 256 most frequent pairs of bytes are tokens of their own, every other pair two byte tokens.
Each row: tokens/s over the steps after the first --warmup (compile and allocator warm-up left
out), the peak memory of the steps (torch.cuda.max_memory_allocated: parameters, optimizer state,
activations and every workspace), the mean loss of the first and last 10 steps and the largest
gap between a head's loss curve and torch's.  Never used as a test.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sysconfig
import time

import numpy

HEADS = ("torch", "cupyloss", "cupyloss-eager", "liger")


def corpus(vocab: int, limit: int = 64 << 20) -> numpy.ndarray:
    """Token ids (int64) of the standard library's .py sources as byte pairs (module docstring);
    at most `limit` bytes read."""
    raw = _sources(limit)
    pairs = raw[0::2] * 256 + raw[1::2]
    order = numpy.argsort(-numpy.bincount(pairs, minlength=65536), kind="stable")
    rank = numpy.empty(65536, numpy.int64)
    rank[order] = numpy.arange(65536)
    r = rank[pairs]
    own = r < vocab - 256
    count = numpy.where(own, 1, 2)
    out = numpy.empty(int(count.sum()), numpy.int64)
    at = numpy.cumsum(count) - count
    out[at[own]] = 256 + r[own]
    out[at[~own]] = raw[0::2][~own]
    out[at[~own] + 1] = raw[1::2][~own]
    return out


@functools.lru_cache(maxsize=1)
def _sources(limit: int) -> numpy.ndarray:
    """The standard library's .py sources, an even number of bytes as int64."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py") and size < limit:
                with open(os.path.join(folder, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                size += len(data)
    raw = numpy.frombuffer(b"".join(chunks), numpy.uint8)
    return raw[:raw.size // 2 * 2].astype(numpy.int64)


def model(torch, vocab: int, width: int, layers: int = 4, seq: int = 1024):
    """(body, head) on the GPU: body maps token ids (B, T) to the final LayerNorm's float32
    hidden states (B, T, width), its blocks under body.trunk; head is the nn.Linear(width,
    vocab, bias=False) whose weight the loss takes."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, width // 64, 64).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, width))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Trunk(nn.Module):
        """Embedded tokens -> the final LayerNorm's float32 hidden states (compiled; the same
        graph at every vocabulary, so that inductor's cache serves the later ones)."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.ln(x)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.trunk = Trunk()

        def forward(self, idx):
            return self.trunk(self.embed(idx) + self.pos.weight[:idx.shape[1]])

    body = Body()
    head = nn.Linear(width, vocab, bias=False)
    for p in (*body.parameters(), head.weight):
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return body.cuda(), head.cuda()


def _loss_fn(torch, name: str):
    F = torch.nn.functional
    if name == "torch":
        def loss(h, head, y):
            return F.cross_entropy(head(h).float().flatten(0, 1), y.flatten())
    elif name in ("cupyloss", "cupyloss-eager"):
        import cupyloss.torch as CF

        def loss(h, head, y):
            return CF.linear_cross_entropy(h, head.weight, y)
    else:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fused = LigerFusedLinearCrossEntropyLoss()

        def loss(h, head, y):
            return fused(head.weight, h.flatten(0, 1), y.flatten())
    return loss


def run(torch, width: int, vocab: int, heads, layers: int, tokens: int, steps: int,
        warmup: int, seq: int, lr: float, mode: str | None = None) -> list[dict]:
    """One (width, vocabulary) point: each head trained `steps` steps from the same weights."""
    ids = corpus(vocab)
    gen = numpy.random.default_rng(0)
    batch = max(1, tokens // seq)
    # every batch's offsets on the device up front: no copy from the host (a synchronisation
    # with pageable memory) inside the loop
    starts = torch.from_numpy(gen.integers(0, ids.size - seq - 1, size=(steps, batch))).cuda()
    data = torch.from_numpy(ids).cuda()
    window = torch.arange(seq + 1, device="cuda")
    torch.manual_seed(0)
    body, head = model(torch, vocab, width, layers, seq)
    first = {k: v.clone() for k, v in (*body.state_dict().items(),
                                        *(("head." + k, v) for k, v in head.state_dict().items()))}
    body.trunk.compile(fullgraph=True, mode=mode)
    rows, curves = [], {}
    for name in heads:
        try:
            loss_of = _loss_fn(torch, name)
            if not name.endswith("-eager"):
                loss_of = torch.compile(loss_of, fullgraph=True, mode=mode)
        except ImportError as e:
            print(f"  {name}: skipped ({e})")
            continue
        body.load_state_dict({k: v for k, v in first.items() if not k.startswith("head.")})
        head.load_state_dict({"weight": first["head.weight"]})
        params = [*body.parameters(), head.weight]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
        curve = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        error = None
        try:
            for step in range(steps):
                if step == warmup:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                chunk = data[starts[step][:, None] + window]
                x, y = chunk[:, :-1], chunk[:, 1:]
                if mode in ("reduce-overhead", "max-autotune"):
                    # CUDA graphs (reduce-overhead): a new step's graphs may overwrite the last
                    # one's outputs
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.autocast("cuda", torch.bfloat16):
                    loss = loss_of(body(x), head, y)
                curve.append(loss.detach().clone())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        except Exception as e:  # a head that fails to compile or run is reported, not fatal
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        row = dict(width=width, vocab=vocab, head=name, tokens=batch * seq, steps=steps,
                   device=torch.cuda.get_device_name())
        if error is None:
            losses = [float(v) for v in torch.stack(curve).cpu()]
            curves[name] = losses
            row.update(tokens_per_s=batch * seq * (steps - warmup) / elapsed,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                       loss_first10=statistics.fmean(losses[:10]),
                       loss_last10=statistics.fmean(losses[-10:]), curve=losses)
        else:
            row["error"] = error
        rows.append(row)
        del opt, params, curve
        torch.cuda.empty_cache()
    base = curves.get("torch")
    for row in rows:
        mine = curves.get(row["head"])
        if base is not None and mine is not None:
            row["max_gap"] = max(abs(a - b) for a, b in zip(mine, base))
            row["ratio"] = row["tokens_per_s"] / next(
                r["tokens_per_s"] for r in rows if r["head"] == "torch")
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| width | vocab | head | tokens/s | vs torch | peak GiB | loss first 10 -> last 10 "
             "| max gap to torch |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['width']} | {r['vocab']} | {r['head']} | {r['error']} "
                         f"| | | | |")
            continue
        lines.append(
            f"| {r['width']} | {r['vocab']} | {r['head']} | {r['tokens_per_s'] / 1e3:.0f}k "
            f"| {r.get('ratio', math.nan):.2f}x | {r['peak_gib']:.2f} "
            f"| {r['loss_first10']:.3f} -> {r['loss_last10']:.3f} "
            f"| {r.get('max_gap', math.nan):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m cupyloss.bench.train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="512", help="model widths, comma separated")
    ap.add_argument("--vocabs", default="65536", help="vocabulary sizes, comma separated")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens a sequence")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of tokens/s")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--heads", default=",".join(HEADS))
    ap.add_argument("--mode", default=None,
                    help="torch.compile's mode for the blocks and the heads (e.g. "
                         "reduce-overhead: CUDA graphs)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    from cupyloss.bench import _timing

    _timing.need(ap.prog, torch=True)
    import torch

    heads = [h for h in args.heads.split(",") if h]
    rows = []
    print(f"# {torch.cuda.get_device_name()}, {args.layers} layers, {args.tokens} tokens a step, "
          f"{args.steps} steps (tokens/s after {args.warmup}), bf16 autocast, torch.compile"
          f"{'' if args.mode is None else f' mode={args.mode}'}")
    for width in map(int, args.widths.split(",")):
        for vocab in map(int, args.vocabs.split(",")):
            got = run(torch, width, vocab, heads, args.layers, args.tokens, args.steps,
                      args.warmup, args.seq, args.lr, args.mode)
            rows += got
            print(_table(got).split("\n", 2)[-1] if rows != got else _table(got), flush=True)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
