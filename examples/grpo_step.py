"""Train a toy language model with GRPO on cupyloss.torch.linear_grpo_loss.

    python examples/grpo_step.py [--steps 40]

A toy model (each position's hidden state from its own token, an LM head of 512 tokens)
samples groups of 8 completions of 24 tokens from one random first token each; a completion's
reward is the fraction of its tokens below 64.  GRPO's advantages are each reward's distance
from its group's mean over the group's standard deviation; each rollout is optimised twice, so
the second step's ratio to the sampling policy is not 1 and the clip acts; a KL term (beta 0.04)
holds the policy near a frozen reference.  Every step evaluates TRL's unfused formula on float32
logits on the same parameters and batch.  Runs on a GPU (the fused path: each token's gradient
formed with its log-probability) or on the CPU (torch's operations).  Exits non-zero unless the
loss curves agree to 1e-5 of their scale, the gradients to 1e-2 of theirs, and the reward rose.
"""

from _gpu import agreement, finish, policy_and_reference, step_both, steps_argument, torch_anywhere

VOCAB, HIDDEN, GROUPS, GROUP, LENGTH = 512, 64, 4, 8, 24
EPS, BETA = 0.2, 0.04


def rollout(torch, policy, gen, device):
    """Sampled tokens (B, LENGTH), the sampling policy's log-probs of them, and rewards."""
    with torch.no_grad():
        x = torch.randint(0, VOCAB, (GROUPS * GROUP, 1), device=device, generator=gen)
        seq = [x]
        for _ in range(LENGTH):
            logits = policy["head"](policy["body"](seq[-1][:, 0])).float()
            seq.append(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        seq = torch.cat(seq, 1)
    inputs, tokens = seq[:, :-1], seq[:, 1:]
    reward = (tokens < 64).float().mean(1)
    return inputs, tokens, reward


def unfused(torch, policy, ref, inputs, tokens, adv, old):
    """TRL's 'dapo' GRPO loss on float32 logits."""
    lp = policy["head"](policy["body"](inputs)).float().log_softmax(-1)
    lp = lp.gather(-1, tokens[..., None])[..., 0]
    coef = torch.exp(lp - old)
    per = -torch.min(coef * adv[:, None], coef.clamp(1 - EPS, 1 + EPS) * adv[:, None])
    per = per + BETA * (torch.exp(ref - lp) - (ref - lp) - 1)
    return per.mean()


def main():
    steps = steps_argument(__doc__)
    torch, CF, device = torch_anywhere()
    policy, reference, params, opt, gen = policy_and_reference(torch, VOCAB, HIDDEN, device,
                                                               lr=2e-2)
    curves, gaps, rewards = ([], []), [], []
    for step in range(steps):
        if step % 2 == 0:                             # a new rollout every second step
            inputs, tokens, reward = rollout(torch, policy, gen, device)
            r = reward.view(GROUPS, GROUP)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
            with torch.no_grad():
                old = CF.linear_log_probs(policy["body"](inputs), policy["head"].weight, tokens)
                ref = CF.linear_log_probs(reference["body"](inputs), reference["head"].weight,
                                          tokens)
            rewards.append(float(reward.mean()))
        _, metrics = step_both(
            torch, opt, params,
            lambda: CF.linear_grpo_loss(policy["body"](inputs), policy["head"].weight, tokens,
                                        adv, old_log_probs=old, ref_log_probs=ref, beta=BETA,
                                        epsilon_low=EPS, loss_type="dapo"),
            lambda: unfused(torch, policy, ref, inputs, tokens, adv, old), curves, gaps)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}: cupyloss {curves[0][-1]:+.6f}   unfused {curves[1][-1]:+.6f}"
                  f"   reward {rewards[-1]:.3f}   kl {float(metrics['kl']):.2e}   clipped "
                  f"{float(metrics['clip_ratio']):.3f}")
    worst, gap = agreement(curves, gaps, device)
    head = sum(rewards[:3]) / 3
    tail = sum(rewards[-3:]) / 3
    print(f"mean reward {head:.3f} -> {tail:.3f}")
    finish(worst < 1e-5 and gap < 1e-2 and (tail > head or steps < 20))


if __name__ == "__main__":
    main()
