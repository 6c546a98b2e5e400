"""Train a toy language model with DPO on cupyloss.torch.linear_dpo_loss.

    python examples/dpo_step.py [--steps 40]

A toy model (each position's hidden state from its own token, an LM head of 512 tokens) and a
frozen copy as the reference.  Each batch holds 8 preference pairs of 32 tokens: a prompt of 8
random tokens (labels ignore_index, as TRL's collators mark them), then a chosen completion of
tokens below 256 or a rejected one of tokens from 256 up.  The loss is TRL's sigmoid DPO (beta
0.1) of the pairs' summed completion log-probs against the reference head's, computed with the
logits never whole (the reference's under no gradient); every step evaluates the unfused formula
on float32 logits on the same parameters and batch.  Runs on a GPU or on the CPU (torch's
operations).  Exits non-zero unless the loss curves agree to 1e-5 of their scale, the gradients
to 1e-2 of theirs, and the reward margin grew.
"""

from _gpu import agreement, finish, policy_and_reference, step_both, steps_argument, torch_anywhere

VOCAB, HIDDEN, PAIRS, PROMPT, LENGTH, BETA = 512, 64, 8, 8, 32, 0.1


def batch(torch, gen, device):
    """(inputs, labels) of 2 PAIRS sequences: chosen rows first, then the rejected ones."""
    prompt = torch.randint(0, VOCAB, (PAIRS, PROMPT), device=device, generator=gen)
    good = torch.randint(0, 256, (PAIRS, LENGTH - PROMPT), device=device, generator=gen)
    bad = torch.randint(256, VOCAB, (PAIRS, LENGTH - PROMPT), device=device, generator=gen)
    seq = torch.cat([torch.cat([prompt, good], 1), torch.cat([prompt, bad], 1)])
    labels = seq[:, 1:].clone()
    labels[:, :PROMPT - 1] = -100
    return seq[:, :-1], labels


def unfused(torch, policy, reference, inputs, labels):
    """TRL's sigmoid DPO loss on float32 logits."""
    def seq_logps(model):
        lp = model["head"](model["body"](inputs)).float().log_softmax(-1)
        lp = lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (lp * (labels != -100)).sum(-1)

    pi = seq_logps(policy)
    with torch.no_grad():
        ref = seq_logps(reference)
    z = (pi[:PAIRS] - pi[PAIRS:]) - (ref[:PAIRS] - ref[PAIRS:])
    return -torch.nn.functional.logsigmoid(BETA * z).mean()


def main():
    steps = steps_argument(__doc__)
    torch, CF, device = torch_anywhere()
    policy, reference, params, opt, gen = policy_and_reference(torch, VOCAB, HIDDEN, device,
                                                               lr=3e-3)
    curves, gaps, margins = ([], []), [], []
    for step in range(steps):
        inputs, labels = batch(torch, gen, device)
        _, metrics = step_both(
            torch, opt, params,
            lambda: CF.linear_dpo_loss(policy["body"](inputs), policy["head"].weight, labels,
                                       ref_hidden=reference["body"](inputs),
                                       ref_weight=reference["head"].weight, beta=BETA),
            lambda: unfused(torch, policy, reference, inputs, labels), curves, gaps)
        margins.append(float(metrics["rewards_margins"]))
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}: cupyloss {curves[0][-1]:.6f}   unfused {curves[1][-1]:.6f}   "
                  f"margin {margins[-1]:+.3f}   accuracy "
                  f"{float(metrics['rewards_accuracies']):.2f}")
    worst, gap = agreement(curves, gaps, device)
    finish(worst < 1e-5 and gap < 1e-2 and margins[-1] > margins[0])


if __name__ == "__main__":
    main()
