"""What the torch examples share: torch and cupyloss.torch on a CUDA GPU, or one line saying
what is missing and exit status 1.  Imported from beside them (a script's folder is first on
sys.path)."""

import sys


def torch_on_gpu():
    """(torch, cupyloss.torch) where torch sees a CUDA device; else print why and exit 1."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as exc:  # no torch, no driver, or no GPU
        print(f"this example needs torch with an NVIDIA GPU; none is usable here ({exc}).")
        sys.exit(1)
    import cupyloss.torch

    return torch, cupyloss.torch


def torch_anywhere():
    """(torch, cupyloss.torch, device): a CUDA device where torch sees one, else the CPU (where
    cupyloss.torch runs torch's own operations); or print why torch is missing and exit 1."""
    try:
        import torch
    except Exception as exc:  # no torch
        print(f"this example needs torch ({exc}).")
        sys.exit(1)
    import cupyloss.torch

    return torch, cupyloss.torch, "cuda" if torch.cuda.is_available() else "cpu"


def toy_lm(torch, vocab, hidden, device, seed):
    """A toy language model: each position's hidden state from its token alone (an embedding
    and an MLP) and a bias-free LM head; ModuleDict(body, head)."""
    torch.manual_seed(seed)
    nn = torch.nn
    body = nn.Sequential(nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, hidden))
    return nn.ModuleDict({"body": body, "head": nn.Linear(hidden, vocab, bias=False)}).to(device)


def agreement(curves, grad_gaps, what):
    """Print and return the largest gap between two loss curves (of their scale) and between
    the gradients (of theirs) over every step."""
    scale = max(max(abs(v) for v in curves[1]), 1e-30)
    worst = max(abs(a - b) for a, b in zip(*curves)) / scale
    print(f"{what}: largest gap between the loss curves {worst:.1e} of their scale, between the "
          f"gradients {max(grad_gaps):.1e} of theirs")
    return worst, max(grad_gaps)


def grad_gap(params, want):
    """The largest |p.grad - want| over the largest |want|, over the parameters."""
    gap = 0.0
    for p, g in zip(params, want):
        if p.grad is None:
            continue
        gap = max(gap, float((p.grad - g).abs().max()) / max(float(g.abs().max()), 1e-30))
    return gap
