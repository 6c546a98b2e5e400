"""Distil a toy teacher into a smaller student with cupyloss.torch.linear_jsd.

    python examples/distill_step.py [--steps 40]

A frozen teacher (hidden 96) and a student (hidden 48) of the toy kind (each position's hidden
state from its own token, an LM head of 512 tokens) read the same random batches of 16 x 32
tokens.  The loss is the generalised JSD (beta 0.5) of their softmax(logits / 2) plus 0.5 times
the student's cross entropy on the teacher's most likely tokens (hard labels), with neither head's
logits whole; every step evaluates the unfused formula on float32 logits on the same parameters
and batch.  Runs on a GPU (one pass: the student's gradients formed with the loss) or on the CPU
(torch's operations).  Exits non-zero unless the loss curves agree to 1e-5 of their scale, the
gradients to 1e-2 of theirs, and the loss fell.
"""

import math

from _gpu import agreement, finish, step_both, steps_argument, torch_anywhere, toy_lm

VOCAB, ROWS, LENGTH, BETA, TEMPERATURE, HARD = 512, 16, 32, 0.5, 2.0, 0.5


def unfused(torch, student, teacher, inputs, labels):
    """JSD_beta(student || teacher) at TEMPERATURE + HARD x cross entropy, on float32 logits."""
    zs = student["head"](student["body"](inputs)).float()
    with torch.no_grad():
        zt = teacher["head"](teacher["body"](inputs)).float()
    x, y = (zs / TEMPERATURE).log_softmax(-1), (zt / TEMPERATURE).log_softmax(-1)
    log_m = torch.logaddexp(x + math.log(1 - BETA), y + math.log(BETA))
    jsd = (BETA * y.exp() * (y - log_m) + (1 - BETA) * x.exp() * (x - log_m)).sum(-1)
    ce = torch.nn.functional.cross_entropy(zs.transpose(1, 2), labels, reduction="none")
    return jsd.mean() + HARD * ce.mean()


def main():
    steps = steps_argument(__doc__)
    torch, CF, device = torch_anywhere()
    teacher = toy_lm(torch, VOCAB, 96, device, seed=7).requires_grad_(False)
    student = toy_lm(torch, VOCAB, 48, device, seed=0)
    params = list(student.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    gen = torch.Generator(device=device).manual_seed(1)
    curves, gaps = ([], []), []
    for step in range(steps):
        inputs = torch.randint(0, VOCAB, (ROWS, LENGTH), device=device, generator=gen)
        with torch.no_grad():
            labels = teacher["head"](teacher["body"](inputs)).argmax(-1)
        step_both(torch, opt, params,
                  lambda: CF.linear_jsd(student["body"](inputs), student["head"].weight,
                                        teacher["body"](inputs), teacher["head"].weight, labels,
                                        beta=BETA, temperature=TEMPERATURE, hard_weight=HARD),
                  lambda: unfused(torch, student, teacher, inputs, labels), curves, gaps)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}: cupyloss {curves[0][-1]:.6f}   unfused {curves[1][-1]:.6f}")
    worst, gap = agreement(curves, gaps, device)
    finish(worst < 1e-5 and gap < 1e-2 and curves[0][-1] < curves[0][0])


if __name__ == "__main__":
    main()
