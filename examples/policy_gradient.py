"""Train a toy language policy with REINFORCE on cupyloss.torch.linear_log_probs.

    python examples/policy_gradient.py [--steps 150]

A context id (one of 64) is embedded and passed through a small MLP to hidden states (256);
an LM head (4096 tokens, no bias) samples one token per context at temperature 0.8.  The
reward is 1 for the 1/16 of the tokens that suit the context, else 0.  The objective is
REINFORCE with the batch's mean reward as baseline and an entropy bonus,

    loss = -mean((r - mean r) * log p(a)) - 0.01 * mean(H)

with log p and H of softmax(logits / 0.8).  Two copies of the same policy train side by side on
the same samples with Adam: one computes log p and H with cupyloss.torch.linear_log_probs (the
logits never held), the other with torch's unfused formula on float32 logits.  Prints both
losses every 25 steps; exits non-zero unless the two loss curves agree to 1e-3 at every step
and the mean reward rose well above chance (1/16).
"""

import argparse
import copy
import sys

CONTEXTS, HIDDEN, VOCAB, TEMPERATURE = 64, 256, 4096, 0.8


def _setup():
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as exc:  # no torch, no driver, or no GPU
        print(f"this example needs torch with an NVIDIA GPU; none is usable here ({exc}).")
        sys.exit(1)
    import cupyloss.torch

    return torch, cupyloss.torch


def make_policy(torch):
    nn = torch.nn
    body = nn.Sequential(nn.Embedding(CONTEXTS, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, HIDDEN))
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    return nn.ModuleDict({"body": body, "head": head}).cuda()


def reward(torch, contexts, tokens):
    """1 where the token suits the context ((7 token + context) divisible by 16), else 0."""
    return (((7 * tokens + contexts) % 16) == 0).float()


def fused_objective(CF, policy, contexts, tokens, adv):
    h = policy["body"](contexts)
    logp, ent = CF.linear_log_probs(h, policy["head"].weight, tokens, temperature=TEMPERATURE,
                                    return_entropy=True)
    return -(adv * logp).mean() - 0.01 * ent.mean()


def unfused_objective(torch, policy, contexts, tokens, adv):
    h = policy["body"](contexts)
    logits = torch.nn.functional.linear(h, policy["head"].weight).float() / TEMPERATURE
    lp_all = logits.log_softmax(-1)
    logp = lp_all.gather(-1, tokens[:, None])[:, 0]
    ent = -(lp_all.exp() * lp_all).sum(-1)
    return -(adv * logp).mean() - 0.01 * ent.mean()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    torch, CF = _setup()
    torch.manual_seed(0)
    ours = make_policy(torch)
    ref = copy.deepcopy(ours)
    opts = [torch.optim.Adam(p.parameters(), lr=2e-3) for p in (ours, ref)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    worst, rewards = 0.0, []
    for step in range(args.steps):
        contexts = torch.randint(0, CONTEXTS, (args.batch,), device="cuda", generator=gen)
        with torch.no_grad():       # the rollout: samples of the reference copy
            logits = ref["head"](ref["body"](contexts)).float() / TEMPERATURE
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        r = reward(torch, contexts, tokens)
        adv = r - r.mean()
        losses = []
        for policy, opt, objective in ((ours, opts[0], lambda: fused_objective(
                CF, ours, contexts, tokens, adv)), (ref, opts[1], lambda: unfused_objective(
                torch, ref, contexts, tokens, adv))):
            opt.zero_grad()
            loss = objective()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        gap = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-2)
        worst = max(worst, gap)
        rewards.append(float(r.mean()))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}: cupyloss {losses[0]:+.6f}   unfused {losses[1]:+.6f}   "
                  f"mean reward {rewards[-1]:.3f}")
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"mean reward {start:.3f} -> {end:.3f} (chance 0.0625); largest relative gap between "
          f"the loss curves {worst:.1e}")
    ok = worst < 1e-3 and end > 0.25
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
