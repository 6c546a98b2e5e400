"""float64 NumPy reference of ctc_loss: the alpha and beta recursions written out step by step
(never imported by cupyloss), the loss torch returns and the gradient torch returns."""

import numpy as np


def _lse(*xs):
    m = max(xs)
    if m == -np.inf:
        return -np.inf
    return m + np.log(sum(np.exp(x - m) for x in xs))


def _extended(target, blank):
    ext = [blank]
    for c in target:
        ext += [int(c), blank]
    return ext


def sequence(lp, target, blank):
    """(nll, grad) of one sequence: lp (il, C) float64 log-probabilities of its own frames,
    target its labels; grad is torch's (il, C) gradient for upstream 1."""
    steps, classes = lp.shape
    ext = _extended(target, blank)
    L = len(ext)
    if steps == 0:
        return (-0.0 if len(target) == 0 else np.inf), np.zeros((0, classes))
    alpha = np.full((steps, L), -np.inf)
    alpha[0, 0] = lp[0, ext[0]]
    if L > 1:
        alpha[0, 1] = lp[0, ext[1]]
    for t in range(1, steps):
        for s in range(L):
            a3 = alpha[t - 1, s - 2] if s > 1 and ext[s - 2] != ext[s] else -np.inf
            a2 = alpha[t - 1, s - 1] if s > 0 else -np.inf
            alpha[t, s] = _lse(alpha[t - 1, s], a2, a3) + lp[t, ext[s]]
    last = [alpha[-1, L - 1]] + ([alpha[-1, L - 2]] if L > 1 else [])
    nll = -_lse(*last)
    beta = np.full((steps, L), -np.inf)
    beta[-1, L - 1] = lp[-1, ext[L - 1]]
    if L > 1:
        beta[-1, L - 2] = lp[-1, ext[L - 2]]
    for t in range(steps - 2, -1, -1):
        for s in range(L):
            b3 = beta[t + 1, s + 2] if s + 2 < L and ext[s + 2] != ext[s] else -np.inf
            b2 = beta[t + 1, s + 1] if s + 1 < L else -np.inf
            beta[t, s] = _lse(beta[t + 1, s], b2, b3) + lp[t, ext[s]]
    grad = np.empty((steps, classes))
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(steps):
            for c in range(classes):
                terms = [alpha[t, s] + beta[t, s] for s in range(L) if ext[s] == c]
                lcab = _lse(*terms) if terms else -np.inf
                grad[t, c] = np.exp(lp[t, c]) - np.exp(lcab + nll - lp[t, c])
    return nll, grad


def value_and_grad(log_probs, targets, input_lengths, target_lengths, blank=0,
                   reduction="mean", zero_infinity=False, grad_output=1.0):
    """(loss, grad) of torch.nn.functional.ctc_loss in float64: log_probs (T, N, C) or (T, C);
    targets padded (N, S) or concatenated; grad_output a number or, for 'none', (N,)."""
    lp = np.asarray(log_probs, np.float64)
    batched = lp.ndim == 3
    if not batched:
        lp = lp[:, None]
        targets = np.asarray(targets).reshape(1, -1)
    il = np.asarray(input_lengths).reshape(-1)
    tl = np.asarray(target_lengths).reshape(-1)
    targets = np.asarray(targets)
    n = lp.shape[1]
    offsets = np.concatenate([[0], np.cumsum(tl)])
    nll = np.empty(n)
    grad = np.zeros_like(lp)
    go = np.broadcast_to(np.asarray(grad_output, np.float64), (n,)) if reduction == "none" \
        else np.full(n, float(grad_output))
    for b in range(n):
        target = (targets[offsets[b]:offsets[b + 1]] if targets.ndim == 1 and batched
                  else targets[b, :tl[b]])
        value, g = sequence(lp[:il[b], b], target, blank)
        scale = go[b] / (n * max(tl[b], 1)) if reduction == "mean" else go[b]
        if zero_infinity and value == np.inf:
            value, g = 0.0, np.zeros_like(g)
        nll[b] = value
        grad[:il[b], b] = g * scale
    if reduction == "none":
        loss = nll if batched else nll[0]
    elif reduction == "sum":
        loss = nll.sum()
    else:
        loss = (nll / np.maximum(tl, 1)).mean()
    return np.asarray(loss), grad if batched else grad[:, 0]


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
             zero_infinity=False):
    """The float64 loss (value_and_grad's first result)."""
    return value_and_grad(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                          zero_infinity)[0]


def ctc_loss_grads(log_probs, targets, input_lengths, target_lengths, blank=0,
                   reduction="mean", zero_infinity=False, grad_output=1.0):
    """(log_probs' gradient,) for upstream grad_output (value_and_grad's second result)."""
    return (value_and_grad(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                           zero_infinity, grad_output)[1],)
