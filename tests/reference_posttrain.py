"""Float64 NumPy references for the post-training objectives on an output layer: GRPO's family
(TRL's GRPOTrainer: grpo, bnpo, dr_grpo, dapo), DPO (sigmoid, ipo, hinge), ORPO, CPO, SimPO and
KTO (TRL's trainers), written from their papers and TRL's definitions, one sequence and one pair
at a time, and the gradients of any of them with respect to the head's hidden states, weight
and bias.

The head: logits Z = (X W^T + b) / T in float64, log p = log_softmax(Z), H the entropy.  A loss is
a function of the per-token log-probabilities (and entropies); its gradient with respect to them
is taken by central differences in float64 (the losses are smooth away from GRPO's clip
boundaries, which random data does not hit), then carried through log_softmax and the products
in closed form.  It never imports cupyloss, CuPy or torch.
"""

import numpy as np


def _f64(a):
    return np.asarray(a).astype(np.float64)


def head(hidden, weight, target, bias=None, temperature=1.0, ignore_index=-100):
    """(logp (B, T), entropy (B, T), log p of every class (B, T, V)) in float64; logp is 0 where
    the target is ignore_index."""
    x, w = _f64(hidden), _f64(weight)
    z = x @ w.T
    if bias is not None:
        z = z + _f64(bias)
    z = z / temperature
    zmax = z.max(-1, keepdims=True)
    lp_all = z - zmax - np.log(np.exp(z - zmax).sum(-1, keepdims=True))
    t = np.asarray(target)
    counted = t != ignore_index
    safe = np.where(counted, t, 0)
    logp = np.take_along_axis(lp_all, safe[..., None], -1)[..., 0]
    logp = np.where(counted, logp, 0.0)
    ent = -(np.exp(lp_all) * lp_all).sum(-1)
    return logp, ent, lp_all


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def grpo(logp, ent, mask, advantages, old=None, ref=None, loss_type="grpo", eps_low=0.2,
         eps_high=None, beta=0.0, entropy_weight=0.0, max_completion_length=None,
         num_items=None):
    """GRPO's family: (loss, metrics), sequence by sequence."""
    eps_high = eps_low if eps_high is None else eps_high
    logp, ent, mask = _f64(logp), _f64(ent), _f64(mask)
    batch, length = logp.shape
    adv = _f64(advantages)
    adv = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    old = logp if old is None else _f64(old)
    per = np.zeros_like(logp)
    kl = np.zeros_like(logp)
    low = np.zeros_like(logp)
    high = np.zeros_like(logp)
    for b in range(batch):
        for i in range(length):
            ratio = np.exp(logp[b, i] - old[b, i])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            a = adv[b, i]
            per[b, i] = -min(ratio * a, clipped * a)
            if ref is not None:
                d = _f64(ref)[b, i] - logp[b, i]
                kl[b, i] = np.exp(d) - d - 1
                per[b, i] += beta * kl[b, i]
            per[b, i] -= entropy_weight * ent[b, i]
            low[b, i] = float(ratio < 1 - eps_low and a < 0)
            high[b, i] = float(ratio > 1 + eps_high and a > 0)
    per = np.where(mask != 0, per, 0.0)
    total = mask.sum()
    if loss_type == "grpo":
        loss = np.mean([per[b].sum() / max(mask[b].sum(), 1.0) for b in range(batch)])
    elif loss_type == "bnpo":
        loss = per.sum() / max(total, 1.0)
    elif loss_type == "dr_grpo":
        loss = per.sum() / (batch * (max_completion_length or length))
    else:
        loss = per.sum() / (num_items if num_items is not None else max(total, 1.0))
    n = max(total, 1.0)
    metrics = {"kl": (kl * mask).sum() / n, "entropy": (ent * mask).sum() / n,
               "clip_ratio_low": (low * mask).sum() / n,
               "clip_ratio_high": (high * mask).sum() / n}
    metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    return loss, metrics


def _seq(logp, mask, average):
    out = []
    for b in range(logp.shape[0]):
        s = sum(logp[b, i] for i in range(logp.shape[1]) if mask[b, i])
        out.append(s / max(mask[b].sum(), 1.0) if average else s)
    return np.array(out)


def preference(kind, logp, mask, ref_seq=None, beta=0.1, loss_type="sigmoid",
               label_smoothing=0.0, alpha=0.0, gamma=0.5, desirable=None, kl=0.0,
               desirable_weight=1.0, undesirable_weight=1.0):
    """A preference loss: (loss, metrics).  ref_seq: the reference's per-sequence log-probs,
    already reduced as the loss reduces them (sums, or means for ipo, orpo, simpo)."""
    logp, mask = _f64(logp), _f64(mask)
    average = kind in ("orpo", "simpo") or loss_type == "ipo"
    s = _seq(logp, mask, average)
    ref = np.zeros_like(s) if ref_seq is None else _f64(ref_seq)
    if kind == "kto":
        losses, rewards = [], []
        for b in range(len(s)):
            r = s[b] - ref[b]
            if desirable[b]:
                losses.append(desirable_weight * (1 - _sigmoid(beta * (r - kl))))
            else:
                losses.append(undesirable_weight * (1 - _sigmoid(beta * (kl - r))))
            rewards.append(beta * r)
        rewards, good = np.array(rewards), np.asarray(desirable, bool)
        chosen = rewards[good].mean() if good.any() else 0.0
        rejected = rewards[~good].mean() if (~good).any() else 0.0
        return np.mean(losses), {"rewards_chosen": chosen, "rewards_rejected": rejected,
                                 "rewards_margins": chosen - rejected}
    pairs = len(s) // 2
    nll = None
    if kind in ("orpo", "cpo", "simpo"):
        nll = -(logp[:pairs] * mask[:pairs]).sum() / max(mask[:pairs].sum(), 1.0)
    losses, chosen, rejected, extra = [], [], [], {"odds": [], "ratio": []}
    for k in range(pairs):
        c, r = s[k], s[pairs + k]
        if kind == "dpo":
            z = (c - r) - (ref[k] - ref[pairs + k])
            if loss_type == "sigmoid":
                loss = (-(1 - label_smoothing) * _log_sigmoid(beta * z)
                        - label_smoothing * _log_sigmoid(-beta * z))
            elif loss_type == "ipo":
                loss = (z - 1 / (2 * beta)) ** 2
            else:
                loss = max(0.0, 1 - beta * z)
            chosen.append(beta * (c - ref[k]))
            rejected.append(beta * (r - ref[pairs + k]))
        elif kind == "orpo":
            odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
            loss = -beta * _log_sigmoid(odds)
            extra["odds"].append(odds)
            extra["ratio"].append(_log_sigmoid(odds))
            chosen.append(beta * c)
            rejected.append(beta * r)
        else:
            z = beta * (c - r) - (gamma if kind == "simpo" else 0.0)
            if loss_type == "sigmoid":
                loss = (-(1 - label_smoothing) * _log_sigmoid(z)
                        - label_smoothing * _log_sigmoid(-z))
            else:
                loss = max(0.0, 1 - z)
            chosen.append(beta * c)
            rejected.append(beta * r)
        losses.append(loss)
    total = np.mean(losses)
    if kind == "orpo":
        total = total + nll
    elif nll is not None:
        total = total + alpha * nll
    chosen, rejected = np.array(chosen), np.array(rejected)
    metrics = {"rewards_chosen": chosen.mean(), "rewards_rejected": rejected.mean(),
               "rewards_margins": (chosen - rejected).mean(),
               "rewards_accuracies": (chosen > rejected).mean()}
    if kind == "orpo":
        metrics["log_odds_ratio"] = np.mean(extra["ratio"])
        metrics["log_odds_chosen"] = np.mean(extra["odds"])
    if nll is not None:
        metrics["nll_loss"] = nll
    return total, metrics


def token_gradients(objective, logp, ent, step=1e-6):
    """Central differences of objective(logp, ent) -> loss in each token's logp and entropy."""
    logp, ent = _f64(logp).copy(), _f64(ent).copy()
    g_lp, g_ent = np.zeros_like(logp), np.zeros_like(ent)
    for arr, g in ((logp, g_lp), (ent, g_ent)):
        for idx in np.ndindex(arr.shape):
            keep = arr[idx]
            arr[idx] = keep + step
            up = objective(logp, ent)
            arr[idx] = keep - step
            down = objective(logp, ent)
            arr[idx] = keep
            g[idx] = (up - down) / (2 * step)
    return g_lp, g_ent


def head_gradients(hidden, weight, target, g_lp, g_ent, bias=None, temperature=1.0,
                   ignore_index=-100):
    """d/d(hidden, weight, bias) of sum g_lp logp + g_ent H through the head, in float64:
    log_softmax's backward of the one-hot upstream gradient and the entropy's
    (dH/dlogp_c = -p_c (log p_c + 1), then log_softmax's backward), over T, through the
    products."""
    _, ent, lp_all = head(hidden, weight, target, bias, temperature, ignore_index)
    p = np.exp(lp_all)
    t = np.asarray(target)
    counted = t != ignore_index
    up = np.zeros_like(lp_all)                       # d/dlogp_c of the objective
    safe = np.where(counted, t, 0)
    np.put_along_axis(up, safe[..., None], np.where(counted, _f64(g_lp), 0.0)[..., None], -1)
    up += _f64(g_ent)[..., None] * (-p * (lp_all + 1.0))
    dz = (up - p * up.sum(-1, keepdims=True)) / temperature
    x = _f64(hidden)
    grads = {"hidden": dz @ _f64(weight),
             "weight": dz.reshape(-1, dz.shape[-1]).T @ x.reshape(-1, x.shape[-1])}
    if bias is not None:
        grads["bias"] = dz.reshape(-1, dz.shape[-1]).sum(0)
    return grads


def jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None,
        student_bias=None, teacher_bias=None, beta=0.5, temperature=1.0, hard_weight=0.0,
        ignore_index=-100):
    """Distillation (Liger-Kernel's fused linear JSD): (loss, {student gradients}) in float64.

    Per row, Q and P the student's and the teacher's softmax(z / T), M = beta P + (1 - beta) Q:
    l = beta KL(P || M) + (1 - beta) KL(Q || M) (beta 0: KL(P || Q); 1: KL(Q || P)); the loss is
    the counted rows' mean of l plus hard_weight times their mean cross entropy of z (T = 1).
    The gradient goes through the probabilities: dl/dQ_c, then softmax's Jacobian
    Q_c (dl/dQ_c - sum_k Q_k dl/dQ_k) / T."""
    xs = _f64(student_hidden).reshape(-1, np.shape(student_hidden)[-1])
    ws = _f64(student_weight)
    zs = xs @ ws.T + (0 if student_bias is None else _f64(student_bias))
    xt = _f64(teacher_hidden).reshape(-1, np.shape(teacher_hidden)[-1])
    zt = xt @ _f64(teacher_weight).T + (0 if teacher_bias is None else _f64(teacher_bias))

    def log_softmax(z):
        m = z.max(-1, keepdims=True)
        return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))

    log_q, log_p = log_softmax(zs / temperature), log_softmax(zt / temperature)
    q, p = np.exp(log_q), np.exp(log_p)
    if beta == 0.0:
        rows = (p * (log_p - log_q)).sum(-1)
        dq = -p / np.where(q > 0, q, 1.0)
    elif beta == 1.0:
        rows = (q * (log_q - log_p)).sum(-1)
        dq = log_q - log_p + 1.0
    else:
        m = beta * p + (1 - beta) * q
        log_m = np.log(m)
        rows = (beta * p * (log_p - log_m) + (1 - beta) * q * (log_q - log_m)).sum(-1)
        dq = -beta * p * (1 - beta) / m + (1 - beta) * (log_q - log_m) \
            + (1 - beta) * (1 - (1 - beta) * q / m)
    dz = q * (dq - (q * dq).sum(-1, keepdims=True)) / temperature
    n = zs.shape[0]
    t = np.zeros(n, np.int64) if target is None else np.asarray(target).reshape(-1)
    counted = np.ones(n) if target is None else (t != ignore_index).astype(np.float64)
    count = max(counted.sum(), 1.0)
    loss = (rows * counted).sum() / count
    if hard_weight:
        lp1 = log_softmax(zs)
        safe = np.where(counted > 0, t, 0)
        loss += hard_weight * -(np.take_along_axis(lp1, safe[:, None], -1)[:, 0]
                                * counted).sum() / count
        d = np.exp(lp1)
        d[np.arange(n), safe] -= 1.0
        dz = dz + hard_weight * d
    dz = dz * (counted / count)[:, None]
    grads = {"hidden": (dz @ ws).reshape(np.shape(student_hidden)), "weight": dz.T @ xs}
    if student_bias is not None:
        grads["bias"] = dz.sum(0)
    return loss, grads
