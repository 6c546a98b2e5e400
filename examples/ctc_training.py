"""Train a small sequence recognizer with cupyloss.torch.CTCLoss on synthetic "speech".

    python examples/ctc_training.py [--steps 200]

Each utterance is a random string of 3-8 letters from an alphabet of 12; each letter lasts 2-5
frames of its own 24-dim prototype plus noise, with 0-3 frames of silence (noise alone) between
letters, padded to 80 frames.  A 1-D convolution and a bidirectional GRU map frames to 13
log-probabilities (blank + 12 letters), trained with Adam on cupyloss.torch.CTCLoss (padded
targets, lengths as CUDA tensors); torch.nn.CTCLoss is evaluated on the same log-probabilities
at every step.  Prints the loss every 50 steps and the greedy decoding's letter error rate at
the end; exits non-zero unless the loss fell below a fifth of its start, the two losses agree
to 1e-4 at every step, and most letters are decoded.
"""

import argparse
import sys

from _gpu import torch_on_gpu

ALPHABET, FEATURES, FRAMES = 12, 24, 80


def batch(torch, protos, n, gen):
    """(frames (T, N, F), padded targets (N, 8), input lengths, target lengths) on the GPU."""
    x = 0.3 * torch.randn(FRAMES, n, FEATURES, generator=gen)
    targets = torch.zeros(n, 8, dtype=torch.int64)
    il, tl = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    for b in range(n):
        k = int(torch.randint(3, 9, (1,), generator=gen))
        letters = torch.randint(1, ALPHABET + 1, (k,), generator=gen)
        t = int(torch.randint(0, 4, (1,), generator=gen))
        for c in letters.tolist():
            span = int(torch.randint(2, 6, (1,), generator=gen))
            x[t:t + span, b] += protos[c]
            t += span + int(torch.randint(0, 4, (1,), generator=gen))
        targets[b, :k], il[b], tl[b] = letters, min(t, FRAMES), k
    return x.cuda(), targets.cuda(), il.cuda(), tl.cuda()


class Recognizer:
    def __init__(self, torch):
        nn = torch.nn
        self.conv = nn.Conv1d(FEATURES, 64, 5, padding=2)
        self.gru = nn.GRU(64, 64, bidirectional=True)
        self.out = nn.Linear(128, ALPHABET + 1)
        self.modules = nn.ModuleList([self.conv, self.gru, self.out]).cuda()

    def __call__(self, x):
        h = self.conv(x.permute(1, 2, 0)).relu().permute(2, 0, 1)
        return self.out(self.gru(h)[0]).log_softmax(-1)


def greedy_errors(torch, lp, targets, il, tl):
    """Letters wrong or missing in the greedy decoding (best class a frame, repeats merged,
    blanks dropped), and letters in all (a position-by-position count: a cheap error rate)."""
    best = lp.argmax(-1).T.cpu()
    wrong = total = 0
    for b in range(best.shape[0]):
        seq, last = [], 0
        for c in best[b, :il[b]].tolist():
            if c != last and c != 0:
                seq.append(c)
            last = c
        want = targets[b, :tl[b]].tolist()
        wrong += sum(1 for i, c in enumerate(want) if i >= len(seq) or seq[i] != c)
        wrong += max(0, len(seq) - len(want))
        total += len(want)
    return wrong, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch, CF = torch_on_gpu()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    protos = torch.randn(ALPHABET + 1, FEATURES, generator=gen)
    ours = Recognizer(torch)
    crit = CF.CTCLoss(blank=0, zero_infinity=True)
    ref = torch.nn.CTCLoss(blank=0, zero_infinity=True)
    opt = torch.optim.Adam(ours.modules.parameters(), lr=3e-3)
    first = last = None
    worst = 0.0
    for step in range(args.steps):
        x, tg, il, tl = batch(torch, protos, 32, gen)
        opt.zero_grad()
        lp = ours(x)
        loss = crit(lp, tg, il, tl)
        loss.backward()
        opt.step()
        theirs = float(ref(lp.detach(), tg, il, tl))
        worst = max(worst, abs(float(loss) - theirs) / max(abs(theirs), 1e-6))
        first = float(loss) if first is None else first
        last = float(loss)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}: cupyloss {last:.4f}   torch.nn.CTCLoss {theirs:.4f}")
    with torch.no_grad():
        x, tg, il, tl = batch(torch, protos, 64, gen)
        wrong, total = greedy_errors(torch, ours(x), tg, il, tl)
    print(f"loss {first:.3f} -> {last:.3f}; largest relative gap to torch.nn.CTCLoss "
          f"{worst:.1e}; greedy letter errors {wrong}/{total}")
    ok = last < first / 5 and worst < 1e-4 and wrong < total / 2
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
