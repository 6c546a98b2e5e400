"""Post-training objectives on the fused head: policy-gradient RL (GRPO and its family),
preference optimisation (DPO, ORPO, CPO, SimPO, KTO) and distillation between two heads
(linear_jsd, at the end), logits never whole.

Each RL and preference objective is a function of the per-token log-probabilities ``logp`` (and the entropy
``H``) of the output layer (cupyloss.linear.linear_log_probs), so each is written here once, on
those, for any array namespace (`Ops`: torch's and JAX's adapters pass theirs, and autograd or
jax.grad differentiates the few per-token and per-sequence operations; the head's backward
forms the logits again, chunk by chunk).  Masks: a token counts where its target is not
ignore_index (TRL's label convention) and, for GRPO, where `mask` is nonzero.

GRPO (per token i of sequence b; A the advantage, old and ref the old policy's and the
reference's log-probs):

    rho_i = exp(logp_i - old_i),   l_i = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)
                                        + beta (exp(ref_i - logp_i) - (ref_i - logp_i) - 1)
    loss  = sum_i w_i (l_i - c H_i),   w_i = m_i / D_i, by loss_type:
        grpo     D_i = B max(1, sum_{j in b} m_j)   (each sequence's mean, then the batch's)
        bnpo     D = max(1, sum_j m_j)              (the batch's tokens)
        dr_grpo  D = B max_completion_length
        dapo     D = num_items (the global token count; default sum_j m_j, at least 1)

Its per-token gradient depends on that token alone, so linear_grpo_loss forms it in the same
pass as the log-probabilities (logprob.cu's grpo_tokens between their statistics and dZ): three
matrix products a chunk, as cross entropy's.

Preference losses (TRL's trainers): the batch's first half is the chosen completions, the
second half the rejected ones, pair k being rows k and k + B/2.  With s_b = sum_i m_i logp_i over
sequence b (its mean over m where the loss averages, as TRL's ``average_log_prob``), c = s of a
chosen row and r of its rejected one, c0 and r0 the reference's, sigma the logistic function:

    dpo    z = (c - r) - (c0 - r0);  sigmoid: -(1 - e) log sigma(beta z) - e log sigma(-beta z)
                                     ipo (means): (z - 1 / (2 beta))^2;  hinge: max(0, 1 - beta z)
    orpo   (means) nll_chosen - beta log sigma(log odds),
           log odds = (c - r) - (log(1 - e^c) - log(1 - e^r))
    cpo    -(1 - e) log sigma(beta (c - r)) - e log sigma(-beta (c - r)) + alpha nll_chosen
    simpo  (means) -(1 - e) log sigma(beta (c - r) - gamma) - e log sigma(-beta (c - r) + gamma)
           + alpha nll_chosen
    kto    (not pairs: a label a row) desirable: 1 - sigma(beta (s - s0 - kl)),
           undesirable: 1 - sigma(beta (kl - s + s0)), each times its weight

each averaged over pairs (rows for KTO); nll_chosen is the chosen rows' mean of -logp over their
counted tokens.  These need whole sequences' sums before any token's gradient is known.  Each
token's gradient is c_b m_i with c_b = dloss/ds_b one number a sequence, so dZ = c_b (m_i
(onehot - p_i)): linear_preference_loss_value_and_grad takes a group of whole pairs at a time,
keeps its dZ at c = 1 (16-bit, 0.5 GB a pair of 1024 tokens at 128256 classes), forms the
group's c_b from its sums (pair_slopes, kto_slopes: the hand-written derivatives) and scales
each sequence's products by it on the device (linear.group_plan): three matrix products a
chunk, one pass.  Where no group fits the budget, two passes: the log-probabilities (4 bytes a
token kept), then linear_log_probs' backward with each token's c_b m_i (four products).
Traced by torch.compile, on the CPU and in JAX the objectives are composed on linear_log_probs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy

from cupyloss import linear as _linear
from cupyloss._core import args as _args, source as _source
from cupyloss._types import Array

__all__ = ["linear_grpo_loss", "linear_grpo_loss_value_and_grad", "linear_preference_loss",
           "linear_preference_loss_value_and_grad", "linear_jsd",
           "linear_jsd_value_and_grad", "GRPO_LOSS_TYPES",
           "DPO_LOSS_TYPES", "PREFERENCE_LOSSES", "grpo_objective", "preference_objective",
           "Ops"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
CPO_LOSS_TYPES = ("sigmoid", "hinge")
PREFERENCE_LOSSES = ("dpo", "orpo", "cpo", "simpo", "kto")
METRICS = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio")

TOKENS = _args.Layout(_source.kernel_words("logprob.cu", "grpo_tokens"))
STATS = _linear.STATS           # logprob_stats, which the distillation launches on both heads


class Ops:
    """The few array operations the objectives use, over one framework: `xp` its array module
    (torch, jax.numpy, cupy) and `stop` the identity without a gradient.  The methods take
    that framework's arrays."""

    def __init__(self, xp, stop=lambda a: a):
        self.xp, self._stop = xp, stop
        self.torch = xp.__name__ == "torch"

    def stop(self, a):
        # torch's detach as a method call, which torch.compile traces (a stored descriptor
        # it does not)
        return a.detach() if self.torch else self._stop(a)

    def sum(self, a, axis=None):
        if axis is None:
            return a.sum()
        return a.sum(dim=axis) if self.torch else a.sum(axis=axis)

    def at_least(self, a, low):
        return a.clamp(min=low) if self.torch else self.xp.maximum(a, low)

    def clip(self, a, low, high):
        return a.clamp(low, high) if self.torch else self.xp.clip(a, low, high)

    def log_sigmoid(self, a):
        if self.torch:
            return self.xp.nn.functional.logsigmoid(a)
        return -self.xp.logaddexp(self.xp.zeros_like(a), -a)

    def sigmoid(self, a):
        return self.xp.exp(self.log_sigmoid(a))

    def relu(self, a):
        return a.clamp(min=0) if self.torch else self.xp.maximum(a, 0)

    def float(self, a, like):
        """`a` (a mask of any dtype) in `like`'s floating dtype."""
        return a.to(like.dtype) if self.torch else a.astype(like.dtype)


def _masked_mean(ops, a, m):
    return ops.sum(a * m) / ops.at_least(ops.sum(m), 1.0)


def grpo_weights(ops, m, loss_type, max_completion_length=None, num_items=None):
    """Each token's weight w = m / D of the GRPO family (module docstring): m (B, T) float."""
    batch, length = m.shape
    if loss_type == "grpo":
        return m / (ops.at_least(ops.sum(m, 1), 1.0)[:, None] * batch)
    if loss_type == "bnpo":
        return m / ops.at_least(ops.sum(m), 1.0)
    if loss_type == "dr_grpo":
        return m / (batch * (length if max_completion_length is None
                             else max_completion_length))
    if num_items is not None:                     # dapo
        return m / num_items
    return m / ops.at_least(ops.sum(m), 1.0)


def grpo_objective(ops, logp, ent, m, advantages, old_log_probs=None, ref_log_probs=None, *,
                   loss_type="dapo", epsilon_low=0.2, epsilon_high=None, beta=0.0,
                   entropy_weight=0.0, max_completion_length=None, num_items=None):
    """The GRPO family's loss and metrics on per-token log-probabilities (module docstring), in
    `ops`' framework: logp, ent, m (B, T) (m the float mask), advantages (B,) or (B, T).
    Returns (loss, metrics), metrics as METRICS names them (masked means, no gradient)."""
    high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    # weight-0 tokens add nothing, whatever their values (as the fused kernel): their inputs
    # are replaced before use, so that no NaN reaches a gradient through a 0 weight
    live = m != 0
    same = ops.stop(logp)
    adv = ops.xp.where(live, adv, 0.0)
    old = same if old_log_probs is None else ops.xp.where(live, old_log_probs, same)
    if ref_log_probs is not None:
        ref_log_probs = ops.xp.where(live, ref_log_probs, same)
    rho = ops.xp.exp(logp - old)
    rho_c = ops.clip(rho, 1.0 - epsilon_low, 1.0 + high)
    tok = -ops.xp.minimum(rho * adv, rho_c * adv)
    kl = None
    if ref_log_probs is not None:
        d = ref_log_probs - logp
        kl = ops.xp.exp(d) - d - 1.0
        if beta:
            tok = tok + beta * kl
    w = grpo_weights(ops, m, loss_type, max_completion_length, num_items)
    loss = ops.sum(ops.xp.where(live, w * tok, 0.0))
    if entropy_weight:
        loss = loss - entropy_weight * ops.sum(ops.xp.where(live, w * ent, 0.0))
    rho_d, adv_d = ops.stop(rho), ops.stop(adv)
    low = ops.float((rho_d < 1.0 - epsilon_low) & (adv_d < 0), logp)
    up = ops.float((rho_d > 1.0 + high) & (adv_d > 0), logp)
    metrics = {
        "kl": (_masked_mean(ops, ops.stop(kl), m) if kl is not None
               else ops.sum(m) * 0.0),
        "entropy": _masked_mean(ops, ops.stop(ent), m),
        "clip_ratio_low": _masked_mean(ops, low, m),
        "clip_ratio_high": _masked_mean(ops, up, m),
    }
    metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    return loss, metrics


def sequence_log_probs(ops, logp, m, average):
    """Each sequence's sum of its counted tokens' log-probabilities (their mean with
    `average`): logp, m (B, T) -> (B,)."""
    s = ops.sum(logp * m, 1)
    return s / ops.at_least(ops.sum(m, 1), 1.0) if average else s


def averages(kind, loss_type="sigmoid") -> bool:
    """Whether preference loss `kind` compares per-sequence means (else sums)."""
    return kind in ("orpo", "simpo") or (kind in ("dpo", "cpo") and loss_type == "ipo")


def _sigmoid_loss(ops, z, smoothing):
    out = -ops.log_sigmoid(z)
    if smoothing:
        out = out * (1.0 - smoothing) - ops.log_sigmoid(-z) * smoothing
    return out


def preference_objective(ops, kind, logp, m, ref=None, *, beta=0.1, loss_type="sigmoid",
                         label_smoothing=0.0, alpha=0.0, gamma=0.5, desirable=None, kl=None,
                         desirable_weight=1.0, undesirable_weight=1.0):
    """A preference loss and its metrics on per-token log-probabilities (module docstring), in
    `ops`' framework: logp, m (B, T); ref the reference's per-sequence log-probabilities (B,)
    (sums, or means where the loss averages) or None; desirable (B,) bool for 'kto'.
    Returns (loss, metrics): TRL's rewards, margins and accuracies (and ORPO's log odds),
    without gradients."""
    s = sequence_log_probs(ops, logp, m, averages(kind, loss_type))
    if kind == "kto":
        s0 = 0.0 if ref is None else ref
        ratio = s - s0
        k = 0.0 if kl is None else ops.stop(kl)
        good = ops.float(desirable, s)
        per = (good * desirable_weight * (1.0 - ops.sigmoid(beta * (ratio - k)))
               + (1.0 - good) * undesirable_weight * (1.0 - ops.sigmoid(beta * (k - ratio))))
        reward = ops.stop(beta * ratio)
        n_good, n_bad = ops.sum(good), ops.sum(1.0 - good)
        metrics = {"rewards_chosen": ops.sum(reward * good) / ops.at_least(n_good, 1.0),
                   "rewards_rejected": ops.sum(reward * (1.0 - good))
                   / ops.at_least(n_bad, 1.0)}
        metrics["rewards_margins"] = metrics["rewards_chosen"] - metrics["rewards_rejected"]
        return per.mean(), metrics
    pairs = s.shape[0] // 2
    c, r = s[:pairs], s[pairs:]
    nll = None
    if kind in ("orpo", "cpo", "simpo"):
        mc = m[:pairs]
        nll = -ops.sum(logp[:pairs] * mc) / ops.at_least(ops.sum(mc), 1.0)
    metrics = {}
    if kind == "dpo":
        c0, r0 = (0.0, 0.0) if ref is None else (ref[:pairs], ref[pairs:])
        z = (c - r) - (c0 - r0)
        if loss_type == "sigmoid":
            per = _sigmoid_loss(ops, beta * z, label_smoothing)
        elif loss_type == "ipo":
            per = (z - 1.0 / (2.0 * beta)) ** 2
        else:
            per = ops.relu(1.0 - beta * z)
        loss = per.mean()
        chosen, rejected = ops.stop(beta * (c - c0)), ops.stop(beta * (r - r0))
    elif kind == "orpo":
        odds = (c - r) - (ops.xp.log1p(-ops.xp.exp(c)) - ops.xp.log1p(-ops.xp.exp(r)))
        ratio = ops.log_sigmoid(odds)
        loss = nll - beta * ratio.mean()
        chosen, rejected = ops.stop(beta * c), ops.stop(beta * r)
        metrics["log_odds_ratio"] = ops.stop(ratio.mean())
        metrics["log_odds_chosen"] = ops.stop(odds.mean())
    else:                                             # cpo, simpo
        z = beta * (c - r) - (gamma if kind == "simpo" else 0.0)
        per = (_sigmoid_loss(ops, z, label_smoothing) if loss_type == "sigmoid"
               else ops.relu(1.0 - z))
        loss = per.mean() + (alpha * nll if alpha else 0.0)
        chosen, rejected = ops.stop(beta * c), ops.stop(beta * r)
    metrics.update({"rewards_chosen": chosen.mean(), "rewards_rejected": rejected.mean(),
                    "rewards_margins": (chosen - rejected).mean(),
                    "rewards_accuracies": ops.float(chosen > rejected, chosen).mean()})
    if nll is not None:
        metrics["nll_loss"] = ops.stop(nll)
    return loss, metrics


def check_preference(kind, batch, loss_type="sigmoid", beta=0.1, desirable=None,
                     label_smoothing=0.0):
    """Options and the batch of a preference loss, refused before any launch."""
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; expected one of "
                         f"{', '.join(PREFERENCE_LOSSES)}")
    types = DPO_LOSS_TYPES if kind == "dpo" else CPO_LOSS_TYPES if kind == "cpo" else (
        "sigmoid",)
    if loss_type not in types:
        raise ValueError(f"{kind} loss_type must be one of {', '.join(types)}, got "
                         f"{loss_type!r}")
    if not (float(beta) > 0.0 and math.isfinite(float(beta))):
        raise ValueError(f"beta must be a positive finite number, got {beta}")
    if not 0.0 <= float(label_smoothing) <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if kind == "kto":
        if desirable is None:
            raise ValueError("kto needs desirable: one bool a row (a desirable completion)")
        if tuple(desirable.shape) != (batch,):
            raise ValueError(f"desirable must have shape ({batch},) (one a row), got "
                             f"{tuple(desirable.shape)}")
    elif batch % 2:
        raise ValueError(f"a preference batch holds chosen rows then as many rejected ones: "
                         f"an even number of rows, got {batch}")


def check_grpo(loss_type, epsilon_low, epsilon_high, beta, ref_log_probs,
               max_completion_length, num_items=None):
    """The GRPO family's options, refused before any launch (num_items: a positive Python
    number, or a 0-d array whose value is never read on the host)."""
    if num_items is not None:
        if isinstance(num_items, bool):
            raise TypeError("num_items must be a number or a 0-d array (the global count of "
                            "counted tokens), got a bool")
        if isinstance(num_items, (int, float)):
            if not num_items > 0:
                raise ValueError(f"num_items must be positive, got {num_items}")
        elif not hasattr(num_items, "shape"):
            raise TypeError(f"num_items must be a number or a 0-d array (the global count of "
                            f"counted tokens), got {type(num_items).__name__}")
        elif tuple(num_items.shape) != ():
            raise TypeError(f"num_items must be a number or a 0-d array (the global count of "
                            f"counted tokens), got an array of shape {tuple(num_items.shape)}")
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}, got "
                         f"{loss_type!r}")
    for name, eps in (("epsilon_low", epsilon_low), ("epsilon_high", epsilon_high)):
        if eps is not None and not 0.0 <= float(eps) < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {eps}")
    if epsilon_low is not None and float(epsilon_low) >= 1.0:
        raise ValueError(f"epsilon_low must be below 1 (the ratio's lower clip 1 - "
                         f"epsilon_low is positive), got {epsilon_low}")
    if beta and ref_log_probs is None:
        raise ValueError("beta != 0 weighs a KL term to the reference: pass ref_log_probs")
    if max_completion_length is not None and int(max_completion_length) < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")


class _GRPOTokens:
    """linear_grpo_loss's row policy inside a _LogProbs head: after each chunk's statistics,
    grpo_tokens turns its rows' log-probs and entropy into their upstream gradients (and their
    parts of the loss and metrics) before dZ is formed."""

    def __init__(self, advantages, mask, old, ref, options):
        self.arrays = {"advantages": advantages, "mask": mask, "old_log_probs": old,
                       "ref_log_probs": ref}
        self.options = options

    def bind(self, frame, device, shape) -> None:
        """The per-token arrays as CuPy views, each of the target's shape (advantages: also one
        a sequence), refused before any launch otherwise."""
        if len(shape) != 2:
            raise ValueError(f"linear_grpo_loss takes sequences: target (B, T) and hidden "
                             f"(B, T, H), got a target of shape {shape}")
        self.shape = shape
        names = ("advantages", "mask", "old_log_probs", "ref_log_probs")
        adv = self.arrays["advantages"]
        if adv is None or isinstance(adv, (int, float)):
            raise TypeError("advantages must be an array of shape (B,) or (B, T)")
        got = _linear._row_arrays(frame, device, (shape, shape[:1]), (("advantages", adv),))
        got += _linear._row_arrays(frame, device, (shape,), (("mask", self.arrays["mask"]),),
                                   any_dtype=True)
        got += _linear._row_arrays(frame, device, (shape,), [
            (n, self.arrays[n]) for n in names[2:]])
        for name, a in zip(names, got):
            if isinstance(a, float):
                raise TypeError(f"{name} must be an array of shape {shape}, got a number")
        self.arrays = dict(zip(names, got))
        items = self.options["num_items"]
        if items is not None and not isinstance(items, float):      # a 0-d device array
            self.options = dict(self.options, num_items=_linear._row_arrays(
                frame, device, ((),), (("num_items", items),), any_dtype=True)[0])

    def start(self, call, head) -> None:
        import cupy

        n, logit = call.n, call.logit
        batch, length = self.shape
        a = self.arrays
        t = call.t
        m = (t != call.options["ignore_index"]).astype(logit)
        if a["mask"] is not None:
            m = m * (a["mask"].reshape(n) != 0)
        self.m = m
        ops = Ops(cupy)
        o = self.options
        items = o["num_items"]
        if items is not None and not isinstance(items, float):
            items = items.astype(logit)
        self.w = cupy.ascontiguousarray(grpo_weights(
            ops, m.reshape(batch, length), o["loss_type"], o["max_completion_length"],
            items).reshape(n).astype(logit, copy=False))
        adv = a["advantages"]
        self.adv_div = length if adv.ndim == 1 else 1
        self.adv = cupy.ascontiguousarray(adv.reshape(-1), dtype=logit)
        self.old, self.ref = (None if x is None else cupy.ascontiguousarray(x.reshape(n),
                                                                             dtype=logit)
                              for x in (a["old_log_probs"], a["ref_log_probs"]))
        self.tok = cupy.empty((n, 4), logit)
        head.g = [cupy.empty((n,), logit), cupy.empty((n,), logit)]
        info = _linear._dtypes.DTYPES[logit]
        self.fn = TOKENS.bind(_source.function(
            "logprob.cu", f"cupyloss::grpo_tokens<{info.ctype}>").kernel.ptr)

    def rows(self, call, head, r0, r1) -> None:
        m = r1 - r0
        o = self.options
        words = TOKENS.template({
            "logp": head.logp.data.ptr, "ent": head.ent.data.ptr,
            "old": 0 if self.old is None else self.old.data.ptr,
            "ref": 0 if self.ref is None else self.ref.data.ptr,
            "adv": self.adv.data.ptr, "w": self.w.data.ptr, "r0": r0, "rows": m,
            "adv_div": self.adv_div, "eps_low": _args.f64_word(o["epsilon_low"]),
            "eps_high": _args.f64_word(o["epsilon_high"]), "beta": _args.f64_word(o["beta"]),
            "ent_coef": _args.f64_word(o["entropy_weight"]),
            "g_lp": head.g[0].data.ptr, "g_ent": head.g[1].data.ptr,
            "tok": self.tok.data.ptr})
        block = _linear._LP_BLOCK
        _args.launch(self.fn, (min(-(-m // block), head.most), 1, 1), (block, 1, 1), 0,
                     call.stream, words)

    def results(self, head):
        """(loss, metrics) as CuPy arrays (0-d), the sums in a fixed order."""
        import cupy

        live = self.w != 0
        w, tok, ent, m = self.w, self.tok, head.ent, self.m
        loss = cupy.where(live, w * tok[:, 0], 0).sum()
        c = self.options["entropy_weight"]
        if c:
            loss = loss - c * cupy.where(live, w * ent, 0).sum()
        count = cupy.maximum(m.sum(), 1)
        on = m != 0                 # a masked token's values (NaN or not) count for nothing

        def mean(a):
            return cupy.where(on, m * a, 0).sum() / count

        metrics = {"kl": mean(tok[:, 1]), "entropy": mean(ent),
                   "clip_ratio_low": mean(tok[:, 2]), "clip_ratio_high": mean(tok[:, 3])}
        metrics["clip_ratio"] = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
        return loss, metrics


def _grpo(hidden, weight, target, advantages, bias, mask, old_log_probs, ref_log_probs,
          loss_type, epsilon_low, epsilon_high, beta, entropy_weight, temperature,
          max_completion_length, num_items, ignore_index, max_workspace_bytes, compute_dtype,
          names):
    check_grpo(loss_type, epsilon_low, epsilon_high, beta, ref_log_probs,
               max_completion_length, num_items)
    items = float(num_items) if isinstance(num_items, (int, float)) else num_items
    options = dict(loss_type=loss_type, epsilon_low=float(epsilon_low),
                   epsilon_high=float(epsilon_low if epsilon_high is None else epsilon_high),
                   beta=float(beta), entropy_weight=float(entropy_weight),
                   max_completion_length=max_completion_length, num_items=items)
    token = _GRPOTokens(advantages, mask, old_log_probs, ref_log_probs, options)
    head = _linear._LogProbs(_linear._temperature(temperature), True, None, None, token=token)
    _, grads, _ = _linear._run(hidden, weight, target, bias, None, ignore_index, "none", 0.0,
                               0.0, 0.0, max_workspace_bytes, False, names, 1.0, False,
                               compute_dtype=compute_dtype, head=head)
    loss, metrics = head.token_results
    back = _linear._back(head.frame)
    return back(loss), {k: back(v) for k, v in metrics.items()}, tuple(grads[n] for n in names)


def linear_grpo_loss(hidden: Array, weight: Array, target: Array, advantages: Array,
                     bias: Array | None = None, *, mask: Array | None = None,
                     old_log_probs: Array | None = None, ref_log_probs: Array | None = None,
                     loss_type: str = "dapo", epsilon_low: float = 0.2,
                     epsilon_high: float | None = None, beta: float = 0.0,
                     entropy_weight: float = 0.0, temperature: float = 1.0,
                     max_completion_length: int | None = None, num_items: Any = None,
                     ignore_index: int = -100, max_workspace_bytes: int | None = None,
                     compute_dtype: Any = None) -> tuple[Any, dict]:
    """GRPO's clipped policy-gradient loss (and DAPO's, Dr. GRPO's, BNPO's) on a language
    model's head, logits never whole.

    With logp and H the per-token log-probabilities and entropy of softmax((X W^T + b) / T)
    (linear_log_probs), per token i of sequence b:

      ``rho_i = exp(logp_i - old_i)``,
      ``l_i = -min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i) + beta k3_i``,
      ``k3_i = exp(ref_i - logp_i) - (ref_i - logp_i) - 1``,
      ``loss = sum_i w_i (l_i - entropy_weight H_i)``, w_i = m_i / D by loss_type (the module
      docstring: 'grpo' each sequence's mean then the batch's, 'bnpo' the batch's tokens,
      'dr_grpo' B * max_completion_length, 'dapo' num_items),

    as TRL's GRPOTrainer computes it (old_log_probs None: the log-probs themselves without a
    gradient, rho = 1).  m_i is 1 where the target is not ignore_index and `mask` is nonzero;
    a token with m_i = 0 adds nothing to the loss or the gradients.

    Args:
      hidden: (B, T, H) float16, bfloat16, float32 or float64; weight (V, H); bias None or (V,).
      target: (B, T) int32/int64 sampled tokens.
      advantages: (B,) one a sequence, or (B, T); any floating dtype (used in float32).
      mask: None or (B, T) (the completion mask; nonzero counts).
      old_log_probs, ref_log_probs: None or (B, T) per-token log-probs of the sampling policy
        and the reference (ref is needed when beta != 0; given, the KL metric is reported).
      loss_type: 'grpo', 'bnpo', 'dr_grpo' or 'dapo' (the default, as TRL's and
        Liger-Kernel's).
      epsilon_low, epsilon_high: the ratio's clip range (epsilon_high None: epsilon_low).
      beta: the KL penalty's weight.  entropy_weight: an entropy bonus's weight.
      temperature: > 0; the logits are divided by it (the sampler's).
      max_completion_length: D of 'dr_grpo' (default T).
      num_items: D of 'dapo' (default the counted tokens of this call): a positive number, or
        a 0-d array on the device (any numeric dtype), never read back to the host.
      ignore_index, max_workspace_bytes, compute_dtype: as for linear_cross_entropy.

    Returns:
      ``(loss, metrics)``: loss 0-d float32 (float64 for float64 inputs); metrics a dict of
      0-d arrays: 'kl' (mean k3; 0 without ref), 'entropy', 'clip_ratio_low',
      'clip_ratio_high', 'clip_ratio' (TRL's masked means), none of them synchronised.

    Example:
      >>> loss, metrics = cupyloss.linear_grpo_loss(h, w, tokens, advantages,
      ...                                           old_log_probs=old, mask=completion_mask)
    """
    loss, metrics, _ = _grpo(hidden, weight, target, advantages, bias, mask, old_log_probs,
                             ref_log_probs, loss_type, epsilon_low, epsilon_high, beta,
                             entropy_weight, temperature, max_completion_length, num_items,
                             ignore_index, max_workspace_bytes, compute_dtype, ())
    return loss, metrics


def linear_grpo_loss_value_and_grad(hidden: Array, weight: Array, target: Array,
                                    advantages: Array, bias: Array | None = None, *,
                                    mask: Array | None = None,
                                    old_log_probs: Array | None = None,
                                    ref_log_probs: Array | None = None, loss_type: str = "dapo",
                                    epsilon_low: float = 0.2,
                                    epsilon_high: float | None = None, beta: float = 0.0,
                                    entropy_weight: float = 0.0, temperature: float = 1.0,
                                    max_completion_length: int | None = None,
                                    num_items: Any = None, ignore_index: int = -100,
                                    max_workspace_bytes: int | None = None,
                                    wrt: str | Sequence[str] | None = None,
                                    compute_dtype: Any = None) -> tuple[Any, dict, Any]:
    """linear_grpo_loss and its gradients in one pass (three matrix products a chunk): each
    token's dloss/dlogp depends on that token alone, so it is formed between the chunk's
    statistics and its dZ (logprob.cu's grpo_tokens).

    Per token (the module docstring's w_i and rho_i):
      ``dloss/dlogp_i = w_i (-rho_i A_i [rho_i A_i <= clip(rho_i) A_i] + beta (1 - exp(ref_i -
      logp_i)))``, ``dloss/dH_i = -w_i entropy_weight``,
    then linear_log_probs_backward's dZ and products.  No gradient flows to advantages,
    old_log_probs or ref_log_probs.

    Args:
      As linear_grpo_loss; wrt: 'hidden', 'weight', 'bias' or a tuple of them (default hidden
      and weight).

    Returns:
      ``(loss, metrics, grads)``: grads the gradients named by wrt (a tuple, or one array for
      a single name), each of its argument's shape and dtype.

    Example:
      >>> loss, metrics, (g_h, g_w) = cupyloss.linear_grpo_loss_value_and_grad(
      ...     h, w, tokens, advantages, old_log_probs=old, loss_type="dapo")
    """
    names, single = _linear._names(wrt)
    loss, metrics, grads = _grpo(hidden, weight, target, advantages, bias, mask, old_log_probs,
                                 ref_log_probs, loss_type, epsilon_low, epsilon_high, beta,
                                 entropy_weight, temperature, max_completion_length, num_items,
                                 ignore_index, max_workspace_bytes, compute_dtype, names)
    return loss, metrics, grads[0] if single else grads


def _sequences(target, what):
    if len(target.shape) != 2:
        raise ValueError(f"{what} takes sequences: target (B, T) and hidden (B, T, H), got a "
                         f"target of shape {tuple(target.shape)}")


def grpo_loss(ops, log_probs, hidden, weight, target, advantages, bias=None, *, mask=None,
              old_log_probs=None, ref_log_probs=None, loss_type="dapo", epsilon_low=0.2,
              epsilon_high=None, beta=0.0, entropy_weight=0.0, temperature=1.0,
              max_completion_length=None, num_items=None, ignore_index=-100):
    """linear_grpo_loss composed in `ops`' framework: ``log_probs(hidden, weight, target, bias,
    temperature, ignore_index)`` (that framework's differentiable linear_log_probs, returning
    (logp, entropy)) and grpo_objective on them, differentiated by the framework (four matrix
    products a chunk: the log-probs' forward, then their backward)."""
    _sequences(target, "linear_grpo_loss")
    check_grpo(loss_type, epsilon_low, epsilon_high, beta, ref_log_probs,
               max_completion_length, num_items)
    logp, ent = log_probs(hidden, weight, target, bias, temperature, ignore_index)
    if num_items is not None and not isinstance(num_items, (int, float)):
        num_items = ops.stop(ops.float(num_items, logp))
    m = ops.float(target != ignore_index, logp)
    if mask is not None:
        m = m * ops.float(mask != 0, logp)
    cast = (lambda a: None if a is None else ops.stop(ops.float(a, logp)))
    return grpo_objective(ops, logp, ent, m, cast(advantages), cast(old_log_probs),
                          cast(ref_log_probs), loss_type=loss_type, epsilon_low=epsilon_low,
                          epsilon_high=epsilon_high, beta=beta, entropy_weight=entropy_weight,
                          max_completion_length=max_completion_length, num_items=num_items)


def _check_call(kind, target, desirable, ref_log_probs, ref_hidden, ref_weight, options):
    """A preference call's batch, options and reference, refused before any launch."""
    _sequences(target, f"linear_{kind}_loss")
    check_preference(kind, target.shape[0], options.get("loss_type", "sigmoid"),
                     options.get("beta", 0.1), desirable, options.get("label_smoothing", 0.0))
    if ref_log_probs is not None and ref_hidden is not None:
        raise ValueError("pass the reference as ref_log_probs or as ref_hidden and ref_weight, "
                         "not both")
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("a reference head needs both ref_hidden and ref_weight")


def preference_loss(ops, log_probs, kind, hidden, weight, target, bias=None, *,
                    ref_log_probs=None, ref_hidden=None, ref_weight=None, ref_bias=None,
                    ignore_index=-100, desirable=None, **options):
    """A preference loss (PREFERENCE_LOSSES) composed in `ops`' framework: the policy's
    per-token log-probs from ``log_probs(hidden, weight, target, bias, 1.0, ignore_index)``
    ((logp, entropy), differentiable), the reference's per-sequence ones from ref_log_probs
    ((B, T) per token or (B,) per sequence) or from a reference head (ref_hidden, ref_weight,
    ref_bias; no gradient), and preference_objective on them."""
    _check_call(kind, target, desirable, ref_log_probs, ref_hidden, ref_weight, options)
    logp, _ = log_probs(hidden, weight, target, bias, 1.0, ignore_index)
    m = ops.float(target != ignore_index, logp)
    average = averages(kind, options.get("loss_type", "sigmoid"))
    ref = None
    if ref_hidden is not None:
        ref_lp, _ = log_probs(ref_hidden, ref_weight, target, ref_bias, 1.0, ignore_index)
        ref = ops.stop(sequence_log_probs(ops, ops.stop(ref_lp), m, average))
    elif ref_log_probs is not None:
        ref = ops.stop(ops.float(ref_log_probs, logp))
        if tuple(ref.shape) == tuple(target.shape):
            ref = sequence_log_probs(ops, ref, m, average)
        elif tuple(ref.shape) != tuple(target.shape[:1]):
            raise ValueError(f"ref_log_probs must have shape {tuple(target.shape)} (per token) "
                             f"or {tuple(target.shape[:1])} (per sequence), got "
                             f"{tuple(ref.shape)}")
    return preference_objective(ops, kind, logp, m, ref, desirable=desirable, **options)


# --- preference losses in one pass: a group of whole sequences at a time --------------------------

def pair_slopes(ops, kind, c, r, c0=0.0, r0=0.0, *, beta=0.1, loss_type="sigmoid",
                label_smoothing=0.0, gamma=0.5):
    """The hand-written derivatives (d per / dc, d per / dr) of a pair's term `per` of a paired
    preference loss (module docstring: 'dpo', 'orpo', 'cpo', 'simpo'; ORPO's per =
    -beta log sigma(log odds)), at the pairs' sequence log-probs c, r (and the reference's c0,
    r0), as torch's autograd forms them (relu's slope 0 at its kink)."""
    sig = ops.sigmoid
    e = label_smoothing
    if kind == "orpo":
        odds = (c - r) - (ops.xp.log1p(-ops.xp.exp(c)) - ops.xp.log1p(-ops.xp.exp(r)))
        g = -beta * sig(-odds)
        return g / (1.0 - ops.xp.exp(c)), -g / (1.0 - ops.xp.exp(r))
    if kind == "dpo":
        z, scale = (c - r) - (c0 - r0), beta
        if loss_type == "ipo":
            g = 2.0 * (z - 1.0 / (2.0 * beta))
            return g, -g
    else:                                       # cpo, simpo: z already scaled by beta
        z, scale = beta * (c - r) - (gamma if kind == "simpo" else 0.0), 1.0
    bz = scale * z
    if loss_type == "hinge":
        g = -beta * ops.float(1.0 - bz > 0, bz)
    else:
        g = scale * (-(1.0 - e) * sig(-bz) + e * sig(bz)) if e else -scale * sig(-bz)
        if kind != "dpo":
            g = g * beta
    return g, -g


def kto_slopes(ops, s, s0, good, kl, *, beta=0.1, desirable_weight=1.0,
               undesirable_weight=1.0):
    """d per / ds of KTO's per-row term (module docstring) at the rows' summed log-probs s."""
    x = beta * (s - s0 - kl)
    sx = ops.sigmoid(x)
    slope = sx * (1.0 - sx) * beta
    return -good * desirable_weight * slope + (1.0 - good) * undesirable_weight * slope


_NLL = {"orpo": None, "cpo": "alpha", "simpo": "alpha"}
# Rows a side of a preference group holds at most (whole sequences, at least one pair): the
# products' pieces are whole sequences, so short ones share a group and its chunks.
GROUP_ROWS = 1024


class _PreferenceRows:
    """A preference loss's row policy inside a _LogProbs head, under the "group" plan: every
    chunk's dZ is formed at a unit upstream gradient (each counted token's 1, (onehot - p)),
    a group of whole pairs (rows for 'kto') at a time; once a group's log-probs are summed,
    scales() gives each sequence's upstream gradient c_b = dloss/ds_b (times 1 / its length
    where the loss averages; plus the chosen rows' NLL term), by which the products of that
    sequence's rows are scaled on the device (cuBLAS's alpha).  Four matrix products a pair
    with a reference head (its log-probs formed first), three without."""

    entropy = False                     # the head need not form the entropy

    def __init__(self, kind, options, arrays):
        self.kind, self.options, self.arrays = kind, options, arrays

    def bind(self, frame, device, shape) -> None:
        batch, length = shape
        self.shape = shape
        ref = self.arrays["ref_log_probs"]
        got = _linear._row_arrays(frame, device, (shape, shape[:1]), (("ref_log_probs", ref),))
        if isinstance(got[0], float):
            raise TypeError("ref_log_probs must be an array of shape (B, T) or (B,)")
        self.ref = got[0]
        self.desirable = None
        if self.kind == "kto":
            self.desirable = _linear._row_arrays(frame, device, (shape[:1],), (
                ("desirable", self.arrays["desirable"]),), any_dtype=True)[0]
        kl = self.arrays["kl"]
        self.kl = 0.0 if kl is None else kl if isinstance(kl, (int, float)) else \
            _linear._row_arrays(frame, device, ((),), (("kl", kl),))[0]

    def start(self, call, head) -> None:
        import cupy

        self.m = (call.t != call.options["ignore_index"]).astype(call.logit)
        head.g = [self.m, None]                 # the unit upstream gradient of each token
        self.setup(cupy, self.m)

    def setup(self, xp, m) -> None:
        """What the coefficients need, in array module `xp` (cupy; numpy in the CPU tests):
        m the tokens' mask (B T,) of the logits' dtype; self.shape, ref, desirable and kl as
        bind() leaves them."""
        batch, length = self.shape
        self.xp, self.m = xp, m
        m2 = m.reshape(batch, length)
        self.average = averages(self.kind, self.options.get("loss_type", "sigmoid"))
        self.inv = ((1.0 / xp.maximum(m2.sum(1), 1.0)).astype(m.dtype) if self.average
                    else None)
        self.pairs = batch if self.kind == "kto" else batch // 2
        self.s0 = None
        if self.ref is not None:
            ref = self.ref.astype(m.dtype, copy=False)
            self.s0 = (ref if ref.ndim == 1 else
                       sequence_log_probs(Ops(xp), ref, m2, self.average)).astype(m.dtype)
        key = _NLL.get(self.kind, 0)
        weight = 1.0 if key is None else float(self.options.get(key, 0.0)) if key else 0.0
        self.nll = ((-weight / xp.maximum(m2[:self.pairs].sum(), 1.0)).astype(m.dtype)
                    if weight else None)
        self.coef = xp.zeros((batch,), m.dtype)
        self.good = (None if self.desirable is None
                     else (self.desirable.reshape(batch) != 0).astype(m.dtype))

    def rows(self, call, head, r0, r1) -> None:
        pass

    def group_rows(self, call) -> int:
        """Rows of dZ a group holds: its sequences, whole pairs (whole rows for 'kto'), as many
        as GROUP_ROWS rows a side holds, at least one."""
        batch, length = self.shape
        pairs = batch if self.kind == "kto" else batch // 2
        per = max(1, min(pairs, GROUP_ROWS // max(length, 1)))
        return per * length * (1 if self.kind == "kto" else 2)

    def schedule(self, call, rows, capacity):
        """Groups of chunks: each group's sequences (pairs k .. k + g - 1: their chosen rows,
        then their rejected ones), cut into chunks of at most `rows` rows."""
        batch, length = self.shape
        per = max(1, capacity // (length * (1 if self.kind == "kto" else 2)))
        out = []
        for k in range(0, self.pairs, per):
            j = min(self.pairs, k + per)
            blocks = [(k, j)] if self.kind == "kto" else [(k, j), (k + self.pairs,
                                                                  j + self.pairs)]
            chunks = [(r, min(b1 * length, r + rows)) for b0, b1 in blocks
                      for r in range(b0 * length, b1 * length, rows)]
            out.append(chunks)
        return out

    def scales(self, call, group):
        """The group's sequences' upstream gradients (self.coef), then each chunk's pieces
        (rows of one sequence) with theirs, a one-element device array."""
        length = self.shape[1]
        seqs = {b for r0, r1 in group for b in range(r0 // length, -(-r1 // length))}
        firsts = [b for b in seqs if b < self.pairs]        # kto: every row; else chosen ones
        self.coefficients(call.head.logp, min(firsts), max(firsts) + 1)
        out = []
        for r0, r1 in group:
            parts = []
            for b in range(r0 // length, -(-r1 // length)):
                p0, p1 = max(r0, b * length), min(r1, (b + 1) * length)
                parts.append((p0, p1, self.coef[b:b + 1]))
            out.append(parts)
        return out

    def coefficients(self, logp, k, j) -> None:
        """self.coef of pairs k .. j - 1 (rows, for 'kto'), a pair being rows b and b + B/2:
        each sequence's dloss/ds_b, times 1 / its length where the loss averages, plus the NLL
        term's on chosen rows."""
        batch, length = self.shape
        lp = logp.reshape(batch, length)
        m2 = self.m.reshape(batch, length)
        ops = Ops(self.xp)
        o = self.options

        def seq(b0, b1):
            s = (lp[b0:b1] * m2[b0:b1]).sum(1)
            return s * self.inv[b0:b1] if self.average else s

        def ref(b0, b1):
            return 0.0 if self.s0 is None else self.s0[b0:b1]

        if self.kind == "kto":
            slope = kto_slopes(ops, seq(k, j), ref(k, j), self.good[k:j], self.kl,
                               beta=o.get("beta", 0.1),
                               desirable_weight=o.get("desirable_weight", 1.0),
                               undesirable_weight=o.get("undesirable_weight", 1.0)) / self.pairs
            self.coef[k:j] = slope * self.inv[k:j] if self.average else slope
        else:
            dc, dr = pair_slopes(ops, self.kind, seq(k, j), seq(k + self.pairs, j + self.pairs),
                                 ref(k, j), ref(k + self.pairs, j + self.pairs),
                                 beta=o.get("beta", 0.1),
                                 loss_type=o.get("loss_type", "sigmoid"),
                                 label_smoothing=o.get("label_smoothing", 0.0),
                                 gamma=o.get("gamma", 0.5))
            dc, dr = dc / self.pairs, dr / self.pairs
            if self.average:
                dc = dc * self.inv[k:j]
                dr = dr * self.inv[k + self.pairs:j + self.pairs]
            if self.nll is not None:
                dc = dc + self.nll
            self.coef[k:j] = dc
            self.coef[k + self.pairs:j + self.pairs] = dr

    def results(self, head):
        """(loss, metrics) as CuPy arrays (0-d): preference_objective on every sequence."""
        import cupy

        batch, length = self.shape
        o = dict(self.options)
        if self.kind == "kto":
            o.update(desirable=self.good != 0, kl=self.kl)
        return preference_objective(Ops(cupy), self.kind, head.logp.reshape(batch, length),
                                    self.m.reshape(batch, length), self.s0, **o)


def _preference(kind, hidden, weight, target, bias, ref_log_probs, ref_hidden, ref_weight,
                ref_bias, desirable, kl, options, ignore_index, max_workspace_bytes,
                compute_dtype, names):
    """(loss, metrics, grads) of a preference loss: the "group" plan where a group of whole
    sequences fits the budget, else two passes (linear_log_probs, then its backward with each
    token's upstream gradient)."""
    from cupyloss._core import dispatch as _dispatch

    # hidden's framework first (a host array is refused here, under its own name)
    frame = _dispatch.frame_of(hidden, "hidden")
    frame.operand(hidden, "hidden")                 # on a CUDA device, of a float dtype
    for name, a in (("weight", weight), ("target", target)):
        _dispatch.check_same_frame(frame, hidden, a, "hidden", name)
    _check_call(kind, target, desirable, ref_log_probs, ref_hidden, ref_weight, options)
    if ref_hidden is not None:      # the reference's per-token log-probs: one product a chunk
        ref_log_probs = _linear.linear_log_probs(
            ref_hidden, ref_weight, target, ref_bias, ignore_index=ignore_index,
            max_workspace_bytes=max_workspace_bytes, compute_dtype=compute_dtype)
    rows = _PreferenceRows(kind, options, {"ref_log_probs": ref_log_probs,
                                           "desirable": desirable, "kl": kl})

    def run(head, wrt):
        return _linear._run(hidden, weight, target, bias, None, ignore_index, "none", 0.0, 0.0,
                            0.0, max_workspace_bytes, False, wrt, 1.0, False,
                            compute_dtype=compute_dtype, head=head)[1]

    head = _linear._LogProbs(1.0, False, None, None, token=rows)
    try:
        grads = run(head, names)
    except _linear.NoGroupPlan:
        # No group of whole sequences fits: the log-probs first (one product a chunk), every
        # sequence's upstream gradient, then linear_log_probs' backward (three more).
        head = _linear._LogProbs(1.0, False, None, None, token=rows)
        run(head, ())
        rows.coefficients(head.logp, 0, rows.pairs)
        g = (rows.coef[:, None] * rows.m.reshape(rows.shape)).astype(rows.m.dtype)
        grads = run(_linear._LogProbs(1.0, False, _linear._back(head.frame)(g), None), names)
    loss, metrics = head.token_results
    back = _linear._back(head.frame)
    return back(loss), {k: back(v) for k, v in metrics.items()}, tuple(grads[n] for n in names)


_PREFERENCE_DOC_ARGS = """
    Args:
      kind: 'dpo', 'orpo', 'cpo', 'simpo' or 'kto' (PREFERENCE_LOSSES).
      hidden: (B, T, H) float16, bfloat16, float32 or float64; weight (V, H); bias None or (V,).
      target: (B, T) int32/int64 tokens, ignore_index on prompt and padding tokens; rows
        0 .. B/2 - 1 chosen completions, B/2 .. B - 1 their rejected ones (except 'kto').
      ref_log_probs: the reference's log-probs, (B, T) per token or (B,) per sequence (sums,
        or means where the loss averages); or ref_hidden (B, T, H'), ref_weight (V, H') and
        ref_bias: a reference head (no gradient; its log-probs formed first, one product a
        chunk).
      desirable: 'kto' only, (B,) of any dtype (nonzero: a desirable completion).
      kl: 'kto' only: None (0), a number or a 0-d array (no gradient).
      beta, loss_type ('dpo': sigmoid, ipo, hinge; 'cpo': sigmoid, hinge), label_smoothing,
        alpha (the chosen NLL's weight of 'cpo' and 'simpo'), gamma ('simpo'),
        desirable_weight, undesirable_weight ('kto'): the module docstring's.
      ignore_index, max_workspace_bytes, compute_dtype: as for linear_cross_entropy."""


def _pref_call(kind, hidden, weight, target, bias, ref_log_probs, ref_hidden, ref_weight,
               ref_bias, desirable, kl, beta, loss_type, label_smoothing, alpha, gamma,
               desirable_weight, undesirable_weight, ignore_index, max_workspace_bytes,
               compute_dtype, names):
    options = dict(beta=float(beta))
    if kind in ("dpo", "cpo", "simpo"):
        options.update(loss_type=loss_type, label_smoothing=float(label_smoothing))
    if kind in ("cpo", "simpo"):
        options["alpha"] = float(alpha)
    if kind == "simpo":
        options["gamma"] = float(gamma)
    if kind == "kto":
        options.update(desirable_weight=float(desirable_weight),
                       undesirable_weight=float(undesirable_weight))
    elif desirable is not None or kl is not None:
        raise ValueError(f"desirable and kl are kto's; {kind} takes pairs")
    return _preference(kind, hidden, weight, target, bias, ref_log_probs, ref_hidden,
                       ref_weight, ref_bias, desirable, kl, options, ignore_index,
                       max_workspace_bytes, compute_dtype, names)


def linear_preference_loss(kind: str, hidden: Array, weight: Array, target: Array,
                           bias: Array | None = None, *, ref_log_probs: Array | None = None,
                           ref_hidden: Array | None = None, ref_weight: Array | None = None,
                           ref_bias: Array | None = None, desirable: Array | None = None,
                           kl: Any = None, beta: float = 0.1, loss_type: str = "sigmoid",
                           label_smoothing: float = 0.0, alpha: float = 0.0,
                           gamma: float = 0.5, desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0, ignore_index: int = -100,
                           max_workspace_bytes: int | None = None,
                           compute_dtype: Any = None) -> tuple[Any, dict]:
    """A preference loss (DPO, ORPO, CPO, SimPO, KTO: TRL's trainers) on a language model's
    head, logits never whole.

    With s_b the sum over sequence b's counted tokens (target != ignore_index) of
    log softmax(X W^T + b)[target] (linear_log_probs; the mean where the loss averages: 'orpo',
    'simpo', and 'ipo'), c and r a pair's chosen and rejected s, c0 and r0 the reference's:

      ``dpo``    mean over pairs of ``-(1 - e) log sigma(beta z) - e log sigma(-beta z)``
                 ('sigmoid'), ``(z - 1/(2 beta))^2`` ('ipo') or ``max(0, 1 - beta z)``
                 ('hinge'), ``z = (c - r) - (c0 - r0)``;
      ``orpo``   ``nll_chosen - beta mean log sigma((c - r) - (log(1 - e^c) - log(1 - e^r)))``;
      ``cpo``    DPO's 'sigmoid' or 'hinge' on ``z = c - r`` plus ``alpha nll_chosen``;
      ``simpo``  ``-(1 - e) log sigma(beta (c - r) - gamma) - e log sigma(gamma - beta (c - r))``
                 averaged, plus ``alpha nll_chosen``;
      ``kto``    mean over rows of ``desirable_weight (1 - sigma(beta (s - s0 - kl)))`` where
                 desirable, else ``undesirable_weight (1 - sigma(beta (kl - s + s0)))``,

    nll_chosen the chosen rows' mean -logp over their counted tokens (cupyloss.posttrain's
    docstring has them all).
""" + _PREFERENCE_DOC_ARGS + """

    Returns:
      ``(loss, metrics)``: loss 0-d float32 (float64 for float64 inputs); metrics a dict of
      0-d arrays without gradients, TRL's: 'rewards_chosen', 'rewards_rejected',
      'rewards_margins' ('rewards_accuracies' for pairs; 'log_odds_ratio', 'log_odds_chosen'
      for 'orpo'; 'nll_loss' where the loss has it), none of them synchronised.

    Example:
      >>> loss, metrics = cupyloss.linear_preference_loss("dpo", h, w, labels,
      ...                                                 ref_log_probs=ref_logps, beta=0.1)
    """
    loss, metrics, _ = _pref_call(kind, hidden, weight, target, bias, ref_log_probs, ref_hidden,
                                  ref_weight, ref_bias, desirable, kl, beta, loss_type,
                                  label_smoothing, alpha, gamma, desirable_weight,
                                  undesirable_weight, ignore_index, max_workspace_bytes,
                                  compute_dtype, ())
    return loss, metrics


def linear_preference_loss_value_and_grad(
        kind: str, hidden: Array, weight: Array, target: Array, bias: Array | None = None, *,
        ref_log_probs: Array | None = None, ref_hidden: Array | None = None,
        ref_weight: Array | None = None, ref_bias: Array | None = None,
        desirable: Array | None = None, kl: Any = None, beta: float = 0.1,
        loss_type: str = "sigmoid", label_smoothing: float = 0.0, alpha: float = 0.0,
        gamma: float = 0.5, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
        ignore_index: int = -100, max_workspace_bytes: int | None = None,
        wrt: str | Sequence[str] | None = None,
        compute_dtype: Any = None) -> tuple[Any, dict, Any]:
    """linear_preference_loss and its gradients in one pass over the policy's head: three
    matrix products a chunk (four with a reference head), the logits never whole.

    A group of whole pairs (rows for 'kto') at a time: each chunk's logits give its tokens'
    log-probs and dZ at a unit upstream gradient, ``m_i (onehot(y_i) - p_i)``, kept in the
    inputs' dtype for the group; with the group's sums s_b known, each sequence's
    ``c_b = dloss/ds_b`` (times 1 / its length where the loss averages, plus
    ``-alpha / (the chosen rows' counted tokens)`` on chosen rows where there is an NLL term:
    pair_slopes and kto_slopes, the hand-written derivatives) scales the products of its rows
    on the device (cuBLAS's alpha):

      ``d/dhidden_i = c_b dZ_i W``,   ``d/dweight = sum_b c_b dZ_b^T X_b``

    summed in float32 (split in two 16-bit halves where a float32 sum does not fit the
    budget: linear.plan).  Where no group fits, two passes: the log-probs, then
    linear_log_probs_backward with each token's ``c_b m_i``.

    Args:
      As linear_preference_loss; wrt: 'hidden', 'weight', 'bias' or a tuple of them (default
      hidden and weight; the reference gets none).

    Returns:
      ``(loss, metrics, grads)``: grads the gradients named by wrt (a tuple, or one array for
      a single name), each of its argument's shape and dtype.

    Example:
      >>> loss, metrics, (g_h, g_w) = cupyloss.linear_preference_loss_value_and_grad(
      ...     "dpo", h, w, labels, ref_hidden=ref_h, ref_weight=ref_w)
    """
    names, single = _linear._names(wrt)
    loss, metrics, grads = _pref_call(kind, hidden, weight, target, bias, ref_log_probs,
                                      ref_hidden, ref_weight, ref_bias, desirable, kl, beta,
                                      loss_type, label_smoothing, alpha, gamma, desirable_weight,
                                      undesirable_weight, ignore_index, max_workspace_bytes,
                                      compute_dtype, names)
    return loss, metrics, grads[0] if single else grads

# --- distillation: the generalised JSD between two heads ------------------------------------------

DISTILL_STATS = _args.Layout(_source.kernel_words("logprob.cu", "distill_stats"))
DISTILL_GRAD = _args.Layout(_source.kernel_words("logprob.cu", "distill_grad"))


class _Distill:
    """linear_jsd's head in a _Call's passes: each chunk's (or slice's) student logits beside
    the teacher's of the same rows and classes (one more product, no gradient), their
    logsumexps (logprob_stats), each row's divergence and G (distill_stats), then the student's
    dZ (distill_grad).  The plan counts the teacher's float32 logits beside each chunk or
    slice of the student's (`beside`: bytes an element).  A mean over the rows (`mean_rows`):
    float16 dZ is formed call.boost times larger and the products scale it back (as cross
    entropy's 'mean')."""

    mean_rows = True

    def __init__(self, teacher_hidden, teacher_weight, teacher_bias, temperature, beta, hard,
                 counted_all):
        self.teacher = {"teacher_hidden": teacher_hidden, "teacher_weight": teacher_weight,
                        "teacher_bias": teacher_bias}
        self.temperature, self.beta, self.hard = temperature, beta, hard
        self.counted_all = counted_all
        self.beside = 4             # the teacher's logits (8 for float64 inputs: start())

    def bind(self, frame, device, shape) -> None:
        """The teacher's arrays as CuPy views, checked against the student's rows."""
        from cupyloss._core import dispatch as _dispatch

        views = {}
        for name, a in self.teacher.items():
            if a is None:
                views[name] = None
                continue
            _dispatch.check_same_frame(frame, a, a, name, name)
            op = frame.operand(a, name)
            if op.device != device:
                raise ValueError(f"{name} is on CUDA device {op.device} but hidden is on CUDA "
                                 f"device {device}")
            views[name] = _linear._plain(frame.cupy_view(op))
        th, tw, tb = views["teacher_hidden"], views["teacher_weight"], views["teacher_bias"]
        if tuple(th.shape[:-1]) != tuple(shape):
            raise ValueError(f"teacher_hidden must have the student's rows {tuple(shape)} and "
                             f"its own hidden size, got {tuple(th.shape)}")
        if tw.ndim != 2 or tw.shape[1] != th.shape[-1]:
            raise ValueError(f"teacher_weight must be (V, {th.shape[-1]}) (teacher_hidden's "
                             f"last dim), got {tuple(tw.shape)}")
        if tb is not None and tuple(tb.shape) != (tw.shape[0],):
            raise ValueError(f"teacher_bias must be ({tw.shape[0]},), got {tuple(tb.shape)}")
        self.views = views

    def start(self, call) -> None:
        import cupy

        th, tw, tb = (self.views[k] for k in ("teacher_hidden", "teacher_weight",
                                              "teacher_bias"))
        if tw.shape[0] != call.v:
            raise ValueError(f"teacher_weight has {tw.shape[0]} classes and weight {call.v}; "
                             f"the two heads must share the vocabulary")
        for name, a in (("teacher_hidden", th), ("teacher_weight", tw), ("teacher_bias", tb)):
            if a is not None and a.dtype not in (call.dtype, call.result["hidden"]):
                raise TypeError(f"{name} has dtype {a.dtype}; the teacher takes the student's "
                                f"{call.dtype}")
        n, logit = call.n, call.logit
        self.tx = call._round(_linear._contiguous(cupy, th.reshape(n, -1)), call.dtype)
        self.tw = call._round(_linear._contiguous(cupy, tw), call.dtype)
        self.tb = None if tb is None else call._round(tb, call.dtype)
        self.th = self.tx.shape[1]
        self.beside = call.logit.itemsize
        t = call.t
        ignore = int(call.options["ignore_index"])
        counted = (cupy.ones((n,), logit) if self.counted_all
                   else (t != ignore).astype(logit))
        self.counted = counted
        self.count = counted.sum()
        self.scale = None           # formed at the first chunk, once call.boost is known
        for name in ("lse_s", "lse_t", "loss", "gsum", "scratch"):
            setattr(self, name, cupy.empty((n,), logit))
        self.lse_1 = self.logp_1 = None
        self.room = None
        if self.hard:
            self.lse_1, self.logp_1 = cupy.empty((n,), logit), cupy.empty((n,), logit)
        info = _linear._dtypes.DTYPES[logit]
        self.ctype = info.ctype
        self.stats_fn = STATS.bind(_source.function(
            "logprob.cu", f"cupyloss::logprob_stats<{info.ctype}>").kernel.ptr)
        self.dstats_fn = DISTILL_STATS.bind(_source.function(
            "logprob.cu", f"cupyloss::distill_stats<{info.ctype}>").kernel.ptr)
        self.grad_fns: dict = {}
        from cupyloss._core import launch as _launch

        self.most = _launch.device_limits(call.device).sm_count * _linear.LP_BLOCKS_PER_SM
        self.flags = _linear.LP_INDEX64 if t.dtype == numpy.int64 else 0
        self.zt = None

    def lend(self, room) -> None:
        """The workspace the plan left for the teacher's logits (uint8, 256-byte aligned)."""
        self.room, self.zt = room, None

    def _scale(self, call):
        """s of distill_grad: 1 / the counted rows (times call.boost for float16's dZ)."""
        import cupy

        if self.scale is None:
            boost = call.boost if call.unscale is not None else 1.0
            self.scale = (boost / cupy.maximum(self.count, 1)).astype(call.logit).reshape(1)
        return self.scale

    def _teacher(self, call, m, k, r0, c0):
        """The teacher's logits of rows r0 .. r0 + m - 1, classes c0 .. c0 + k - 1 (float32, in
        the workspace the plan left for them: lend)."""
        import cupy

        need = m * k
        if self.zt is None or self.zt.size < need:
            room = self.room
            if room is not None and room.size >= need * call.logit.itemsize:
                self.zt = room[:need * call.logit.itemsize].view(call.logit)
            else:
                self.zt = cupy.empty((need,), call.logit)
        zt = self.zt[:need].reshape(m, k)
        if self.tb is not None:
            zt[...] = self.tb[c0:c0 + k]
        call.blas.gemm(_linear._OP_T, _linear._OP_N, k, m, self.th, self.tw[c0:c0 + k],
                       self.th, self.tx[r0:r0 + m], self.th, zt, k,
                       accumulate=self.tb is not None)
        return zt

    def _stats(self, call, z, t, r0, r1, temperature, lse, logp):
        m, v = z.shape
        words = STATS.template({
            "z": z.data.ptr, "tgt": t.data.ptr, "rows": m, "cols": v,
            "z_rs": z.strides[0] // z.itemsize, "flags": self.flags,
            "ignore_index": _args.i64_word(int(call.options["ignore_index"])),
            "temperature": _args.f64_word(temperature), "logp": logp[r0:r1].data.ptr,
            "ent": 0, "lse": lse[r0:r1].data.ptr})
        _args.launch(self.stats_fn, (min(m, self.most), 1, 1), (_linear._LP_BLOCK, 1, 1), 0,
                     call.stream, words)

    def chunk(self, call, z, dz, r0, r1) -> None:
        m, v = z.shape
        if m == 0:
            return
        self._scale(call)
        zt = self._teacher(call, m, v, r0, 0)
        t = call.t[r0:r1]
        self._stats(call, z, t, r0, r1, self.temperature, self.lse_s, self.scratch)
        self._stats(call, zt, t, r0, r1, self.temperature, self.lse_t, self.scratch)
        if self.hard:
            self._stats(call, z, t, r0, r1, 1.0, self.lse_1, self.logp_1)
        words = DISTILL_STATS.template({
            "zs": z.data.ptr, "zt": zt.data.ptr,
            "tgt": 0 if self.counted_all else t.data.ptr, "rows": m, "cols": v,
            "zs_rs": z.strides[0] // z.itemsize, "zt_rs": zt.strides[0] // zt.itemsize,
            "flags": self.flags,
            "ignore_index": _args.i64_word(int(call.options["ignore_index"])),
            "temperature": _args.f64_word(self.temperature), "beta": _args.f64_word(self.beta),
            "lse_s": self.lse_s[r0:r1].data.ptr, "lse_t": self.lse_t[r0:r1].data.ptr,
            "loss": self.loss[r0:r1].data.ptr, "gsum": self.gsum[r0:r1].data.ptr})
        _args.launch(self.dstats_fn, (min(m, self.most), 1, 1), (_linear._LP_BLOCK, 1, 1), 0,
                     call.stream, words)
        if dz is not None:
            self._grad(call, z, zt, dz, r0, r1, 0)

    def grad(self, call, z, dz, r0, r1, c0) -> None:
        m, k = z.shape
        if m == 0 or k == 0:
            return
        self._grad(call, z, self._teacher(call, m, k, r0, c0), dz, r0, r1, c0)

    def _grad(self, call, z, zt, dz, r0, r1, c0):
        m, k = z.shape
        gtype = _linear._dtypes.DTYPES[dz.dtype].ctype
        fn = self.grad_fns.get(gtype)
        if fn is None:
            fn = self.grad_fns[gtype] = DISTILL_GRAD.bind(_source.function(
                "logprob.cu", f"cupyloss::distill_grad<{self.ctype}, {gtype}>").kernel.ptr)
        words = DISTILL_GRAD.template({
            "zs": z.data.ptr, "zt": zt.data.ptr,
            "tgt": 0 if self.counted_all else call.t[r0:r1].data.ptr, "rows": m, "cols": k,
            "zs_rs": z.strides[0] // z.itemsize, "zt_rs": zt.strides[0] // zt.itemsize,
            "c0": c0, "flags": self.flags,
            "ignore_index": _args.i64_word(int(call.options["ignore_index"])),
            "temperature": _args.f64_word(self.temperature), "beta": _args.f64_word(self.beta),
            "hard": _args.f64_word(self.hard), "lse_s": self.lse_s[r0:r1].data.ptr,
            "lse_t": self.lse_t[r0:r1].data.ptr,
            "lse_1": 0 if self.lse_1 is None else self.lse_1[r0:r1].data.ptr,
            "scale": self.scale.data.ptr, "gsum": self.gsum[r0:r1].data.ptr,
            "dz": dz.data.ptr, "g_rs": dz.strides[0] // dz.itemsize})
        _args.launch(fn, (min(m, self.most), 1, 1), (_linear._LP_BLOCK, 1, 1), 0, call.stream,
                     words)

    def results(self, shape):
        """(loss,): the counted rows' mean divergence plus hard x their mean cross entropy."""
        import cupy

        total = (self.loss * self.counted).sum()
        if self.hard:
            total = total + self.hard * (-self.logp_1 * self.counted).sum()
        return (total / cupy.maximum(self.count, 1).astype(total.dtype),)


def check_distill(beta, temperature, hard_weight, target):
    """The distillation's options, refused before any launch."""
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if not 0.0 <= float(hard_weight) < math.inf:
        raise ValueError(f"hard_weight must be a finite number >= 0, got {hard_weight}")
    if float(hard_weight) and target is None:
        raise ValueError("hard_weight weighs the student's cross entropy on target: pass target")
    _linear._temperature(temperature)


def _jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
         teacher_bias, beta, temperature, hard_weight, ignore_index, max_workspace_bytes,
         names):
    from cupyloss._core import dispatch as _dispatch

    # the student's framework first (a host array is refused here, under its own name)
    frame = _dispatch.frame_of(student_hidden, "student_hidden")
    frame.operand(student_hidden, "student_hidden")      # on a CUDA device, of a float dtype
    for name, a in (("student_weight", student_weight), ("teacher_hidden", teacher_hidden),
                    ("teacher_weight", teacher_weight)):
        _dispatch.check_same_frame(frame, student_hidden, a, "student_hidden", name)
    check_distill(beta, temperature, hard_weight, target)
    counted_all = target is None
    if counted_all:
        target = _zero_targets(student_hidden)
    head = _Distill(teacher_hidden, teacher_weight, teacher_bias,
                    _linear._temperature(temperature), float(beta), float(hard_weight),
                    counted_all)
    (loss,), grads, _ = _linear._run(
        student_hidden, student_weight, target, student_bias, None, ignore_index, "none", 0.0,
        0.0, 0.0, max_workspace_bytes, False, names, 1.0, False, head=head)
    return loss.reshape(()), tuple(grads[n] for n in names)


def _zero_targets(hidden):
    """Class 0 for every row of `hidden` (int32, in its framework): linear_jsd without targets
    counts every row and reads no target."""
    kind = type(hidden).__module__.split(".")[0]
    shape = tuple(hidden.shape[:-1])
    if kind == "torch":
        import torch

        return torch.zeros(shape, dtype=torch.int32, device=hidden.device)
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.zeros(shape, jnp.int32)
    import cupy

    with cupy.cuda.Device(hidden.device.id if hasattr(hidden.device, "id") else hidden.device):
        return cupy.zeros(shape, cupy.int32)


def linear_jsd(student_hidden: Array, student_weight: Array, teacher_hidden: Array,
               teacher_weight: Array, target: Array | None = None, *,
               student_bias: Array | None = None, teacher_bias: Array | None = None,
               beta: float = 0.5, temperature: float = 1.0, hard_weight: float = 0.0,
               ignore_index: int = -100, max_workspace_bytes: int | None = None) -> Any:
    """Knowledge distillation on two language-model heads: the generalised Jensen-Shannon
    divergence between the student's and the teacher's softmax(logits / T), neither head's
    logits ever whole.

    With Q = softmax(Xs Ws^T / T) (the student), P = softmax(Xt Wt^T / T) (the teacher) and
    M = beta P + (1 - beta) Q, per row: ``JSD_beta = beta KL(P || M) + (1 - beta) KL(Q || M)``
    (beta = 0: the forward KL(P || Q); 1: the reverse KL(Q || P)), as Liger-Kernel's
    LigerFusedLinearJSDLoss and cupyloss.jsd define it; the loss is

      ``mean_rows JSD_beta + hard_weight * mean_rows cross_entropy(Xs Ws^T, target)``

    over the counted rows (target != ignore_index; every row without a target), 0 when none
    counts.  The teacher gets no gradient.  Teacher and student may differ in hidden size.

    Args:
      student_hidden: (..., Hs) float16, bfloat16, float32 or float64; student_weight (V, Hs).
      teacher_hidden: (..., Ht), the student's rows; teacher_weight (V, Ht); the student's
        dtype.
      target: None or int32/int64 class indices of the rows' shape (ignore_index: not
        counted).
      student_bias, teacher_bias: None or (V,).
      beta: in [0, 1].  temperature: > 0.  hard_weight: >= 0 (needs target).
      ignore_index, max_workspace_bytes: as for linear_cross_entropy (the teacher's logits
        take half the budget).

    Returns:
      0-d float32 (float64 for float64 inputs).

    Example:
      >>> loss = cupyloss.linear_jsd(h_s, w_s, h_t, w_t, labels, beta=0.5, temperature=2.0)
    """
    return _jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                student_bias, teacher_bias, beta, temperature, hard_weight, ignore_index,
                max_workspace_bytes, ())[0]


def linear_jsd_value_and_grad(student_hidden: Array, student_weight: Array,
                              teacher_hidden: Array, teacher_weight: Array,
                              target: Array | None = None, *, student_bias: Array | None = None,
                              teacher_bias: Array | None = None, beta: float = 0.5,
                              temperature: float = 1.0, hard_weight: float = 0.0,
                              ignore_index: int = -100, max_workspace_bytes: int | None = None,
                              wrt: str | Sequence[str] | None = None) -> tuple[Any, Any]:
    """linear_jsd and its gradients with respect to the student's hidden, weight and bias in
    one pass (three products a chunk for the student, one for the teacher).

    Per element of the student's logits z (x = log Q, g_c = (1 - beta) Q_c (x_c - log M_c),
    G = sum_c g_c; beta = 0: g_c = -P_c; the row's scale s = 1 / counted rows):

      ``dloss/dz_c = s ((g_c - Q_c G) / T + hard_weight (softmax(z)_c - [c == y]))``

    then dZ rounded to the student's dtype and the products of linear_cross_entropy's plans.

    Args:
      As linear_jsd; wrt: 'hidden', 'weight', 'bias' (the student's) or a tuple of them
      (default hidden and weight).

    Returns:
      ``(loss, grads)``: grads as wrt names them (a tuple, or one array for a single name).

    Example:
      >>> loss, (g_h, g_w) = cupyloss.linear_jsd_value_and_grad(h_s, w_s, h_t, w_t, labels)
    """
    names, single = _linear._names(wrt)
    loss, grads = _jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                       student_bias, teacher_bias, beta, temperature, hard_weight, ignore_index,
                       max_workspace_bytes, names)
    return loss, grads[0] if single else grads
