"""Train a toy language policy with REINFORCE on cupyloss.torch.linear_log_probs.

    python examples/policy_gradient.py [--steps 150]

A context id (one of 64) is embedded and passed through a small MLP to hidden states (256);
an LM head (4096 tokens, no bias) samples one token per context at temperature 0.8.  The
reward is 1 for the 1/16 of the tokens that suit the context, else 0.  The objective is
REINFORCE with the batch's mean reward as baseline and an entropy bonus,

    loss = -mean((r - mean r) * log p(a)) - 0.01 * mean(H)

with log p and H of softmax(logits / 0.8).  The policy trains with Adam on the objective
computed by cupyloss.torch.linear_log_probs (the logits never held); at every step torch's
unfused formula on float32 logits is evaluated on the same parameters and samples, loss and
gradients.  Prints both losses every 25 steps; exits non-zero unless the two loss curves agree
to 1e-5 of the curve's scale and the gradients to 1e-2 of theirs at every step (once the policy
is sure, a gradient is mostly 1 - p rounded in float32 by both, 6e-3 apart at most on an H200;
tests/test_log_probs_gpu.py holds the gradients to float64 references), and the mean reward
rose well above chance (1/16).
"""

import argparse
import sys

from _gpu import torch_on_gpu

CONTEXTS, HIDDEN, VOCAB, TEMPERATURE = 64, 256, 4096, 0.8


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
    torch, CF = torch_on_gpu()
    torch.manual_seed(0)
    policy = make_policy(torch)
    params = list(policy.parameters())
    opt = torch.optim.Adam(params, lr=2e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    curves, grad_gap, rewards = ([], []), 0.0, []
    for step in range(args.steps):
        contexts = torch.randint(0, CONTEXTS, (args.batch,), device="cuda", generator=gen)
        with torch.no_grad():       # the rollout: samples of the current policy
            logits = policy["head"](policy["body"](contexts)).float() / TEMPERATURE
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        r = reward(torch, contexts, tokens)
        adv = r - r.mean()
        theirs = unfused_objective(torch, policy, contexts, tokens, adv)
        want = torch.autograd.grad(theirs, params)
        opt.zero_grad()
        loss = fused_objective(CF, policy, contexts, tokens, adv)
        loss.backward()
        for p, g in zip(params, want):
            scale = float(g.abs().max())
            grad_gap = max(grad_gap, float((p.grad - g).abs().max()) / max(scale, 1e-30))
        opt.step()
        losses = (float(loss.detach()), float(theirs.detach()))
        for curve, value in zip(curves, losses):
            curve.append(value)
        rewards.append(float(r.mean()))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}: cupyloss {losses[0]:+.6f}   unfused {losses[1]:+.6f}   "
                  f"mean reward {rewards[-1]:.3f}")
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    scale = max(abs(v) for v in curves[1])
    worst = max(abs(a - b) for a, b in zip(*curves)) / scale
    print(f"mean reward {start:.3f} -> {end:.3f} (chance 0.0625); largest gap between the loss "
          f"curves {worst:.1e} of their scale, between the gradients {grad_gap:.1e} of theirs")
    ok = worst < 1e-5 and grad_gap < 1e-2 and end > 0.25
    print("ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
