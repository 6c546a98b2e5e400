"""Train a small causal language model twice: with the fused linear cross entropy, and with
lm_head + F.cross_entropy, from the same weights on the same batches.

    python examples/lm_head_training.py [--steps 300] [--vocab 32000] [--device cuda]

A two-layer transformer (width 256, 4 heads) on random token sequences with a repeating
structure (so the loss falls), float32 weights, Adam.  One run computes
the loss as cupyloss.torch.linear_cross_entropy(hidden, lm_head.weight, labels), the logits never
whole; the other as F.cross_entropy(lm_head(hidden).float(), labels).  Prints both final losses and,
on a GPU, the peak memory of each run's steps above what the model and optimiser hold; exits
non-zero when the two final losses differ by more than 1e-3 relative (rounding drifts over the
steps; the first step's losses agree to 1e-5).  Runs on the CPU too (both through torch's
operations there), slowly.
"""

import argparse
import copy
import sys


def _model(torch, vocab, width=256, layers=2, heads=4, context=128):
    torch.manual_seed(0)
    nn = torch.nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.zeros(context, width))
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers)
            self.norm = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def hidden(self, tokens):
            n = tokens.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
            h = self.embed(tokens) + self.pos[:n]
            return self.norm(self.body(h, mask=mask, is_causal=True))

    return Tiny()


def _batches(torch, vocab, device, count=16, batch=16, context=128):
    """Token sequences that repeat a random phrase of 8 tokens with noise: learnable."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        phrase = torch.randint(0, vocab, (batch, 8), generator=g)
        seq = phrase.repeat(1, context // 8 + 1)[:, :context + 1]
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
        out.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("this example needs torch: pip install 'cupyloss[torch]'")
        return 1
    import cupyloss.torch as CF

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    F = torch.nn.functional
    base = _model(torch, args.vocab).to(device)
    batches = _batches(torch, args.vocab, device)

    def fused(model, tokens, labels):
        return CF.linear_cross_entropy(model.hidden(tokens), model.lm_head.weight, labels)

    def plain(model, tokens, labels):
        logits = model.lm_head(model.hidden(tokens)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    results = {}
    for name, loss_fn in (("fused linear_cross_entropy", fused),
                          ("lm_head + F.cross_entropy", plain)):
        model = copy.deepcopy(base)
        opt = torch.optim.Adam(model.parameters(), lr=3e-4)
        first = last = None
        peak = None
        for step in range(args.steps):
            tokens, labels = batches[step % len(batches)]
            if step == 1 and device == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, tokens, labels)
            loss.backward()
            opt.step()
            last = loss.detach().item()
            first = last if first is None else first
        if device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - held) / 2**20
        results[name] = (first, last, peak)
        mem = f", peak {peak:.0f} MiB above the model and optimiser" if peak is not None else ""
        print(f"{name:28s} first loss {first:.5f}, after {args.steps} steps {last:.5f}{mem}",
              flush=True)
    (f0, f1, _), (p0, p1, _) = results.values()
    ok = abs(f0 - p0) <= 1e-5 * abs(p0) and abs(f1 - p1) <= 1e-3 * abs(p1)
    print("the two runs agree" if ok else "MISMATCH between the two runs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
