"""What the torch examples share: torch and cupyloss.torch on a CUDA GPU (or, for the
post-training ones, on the CPU too), or one line saying what is missing and exit status 1; and
the post-training examples' toy model, their step against the unfused formula and their
verdict.  Imported from beside them (a script's folder is first on sys.path)."""

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


def steps_argument(doc, default=40):
    """The example's --steps (its docstring's first line as the description)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=default)
    return ap.parse_args().steps


def step_both(torch, opt, params, fused, unfused, curves, gaps):
    """One optimizer step on fused()'s loss (fused returns the loss, or (loss, metrics)), with
    unfused()'s loss and gradients taken first on the same parameters: the two losses go to
    curves, the gradients' gap to gaps.  Returns fused()'s result."""
    theirs = unfused()
    want = torch.autograd.grad(theirs, params)
    opt.zero_grad()
    out = fused()
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    gaps.append(grad_gap(params, want))
    opt.step()
    curves[0].append(float(loss.detach()))
    curves[1].append(float(theirs.detach()))
    return out


def finish(ok):
    """Print the verdict and exit with its status."""
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


def policy_and_reference(torch, vocab, hidden, device, lr):
    """A toy policy (toy_lm, seed 0), a frozen copy of it as the reference, its parameters, an
    Adam optimizer over them at `lr`, and a seeded generator on `device`."""
    import copy

    policy = toy_lm(torch, vocab, hidden, device, seed=0)
    reference = copy.deepcopy(policy).requires_grad_(False)
    params = list(policy.parameters())
    return (policy, reference, params, torch.optim.Adam(params, lr=lr),
            torch.Generator(device=device).manual_seed(1))
