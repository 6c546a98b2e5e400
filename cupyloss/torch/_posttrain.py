"""Post-training objectives on the fused head for torch (cupyloss.posttrain has the formulas).

GRPO's family on real CUDA tensors runs fused (cupyloss.linear_grpo_loss_value_and_grad: its
gradients formed with its value, three products a chunk, held by ctx and scaled by the upstream
gradient in backward); traced (torch.compile, torch.func) or on the CPU it is composed from
linear_log_probs' registered op and grpo_objective in torch operations, which torch's autograd
differentiates.  The preference losses are always composed so: their gradients need whole
sequences' sums first (cupyloss.posttrain's docstring).
"""

from __future__ import annotations

import torch

from cupyloss import posttrain

_OPS = posttrain.Ops(torch, stop=torch.Tensor.detach)
_GRADS = ("hidden", "weight", "bias")
# What this module takes from the adapter (cupyloss.torch), which imports it and hands them
# over at its end (use()): its differentiable linear_log_probs and its in-place gradient
# scaling.
_ADAPTER: dict = {}


def use(linear_log_probs, scale) -> None:
    """The adapter's linear_log_probs and gradient scaling (grads *= grad_output in place)."""
    _ADAPTER.update(linear_log_probs=linear_log_probs, scale=scale)


def _log_probs(hidden, weight, target, bias, temperature, ignore_index, budget=None):
    return _ADAPTER["linear_log_probs"](hidden, weight, target, bias, temperature=temperature,
                                        return_entropy=True, ignore_index=ignore_index,
                                        max_workspace_bytes=budget)


class _LinearGRPO(torch.autograd.Function):
    """Eager calls on CUDA tensors: loss, metrics and gradients in one pass; backward scales the
    held gradients by the loss's upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, advantages, mask, old, ref, kwargs):
        names = tuple(n for n, need in zip(_GRADS, ctx.needs_input_grad[:3]) if need)
        ctx.names = names
        if names:
            loss, metrics, grads = posttrain.linear_grpo_loss_value_and_grad(
                hidden, weight, target, advantages, bias, mask=mask, old_log_probs=old,
                ref_log_probs=ref, wrt=names, **kwargs)
            ctx.grads = (grads,) if len(names) == 1 else tuple(grads)
        else:
            loss, metrics = posttrain.linear_grpo_loss(
                hidden, weight, target, advantages, bias, mask=mask, old_log_probs=old,
                ref_log_probs=ref, **kwargs)
            ctx.grads = ()
        values = tuple(metrics[k] for k in posttrain.METRICS)
        ctx.mark_non_differentiable(*values)
        return (loss, *values)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("linear_grpo_loss's gradients were formed with its value and "
                               "are spent: backward through it runs once (no retain_graph)")
        grads = list(grads)
        _ADAPTER["scale"](grad_loss, grads)
        got = dict(zip(ctx.names, grads))
        return (got.get("hidden"), got.get("weight"), got.get("bias"), *(None,) * 6)


def linear_grpo_loss(hidden, weight, target, advantages, bias=None, *, mask=None,
                     old_log_probs=None, ref_log_probs=None, loss_type="dapo", epsilon_low=0.2,
                     epsilon_high=None, beta=0.0, entropy_weight=0.0, temperature=1.0,
                     max_completion_length=None, num_items=None, ignore_index=-100,
                     max_workspace_bytes=None):
    """GRPO's clipped policy-gradient loss (and DAPO's, Dr. GRPO's, BNPO's) on the fused head,
    with autograd: ``sum_i w_i (-min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i)
    + beta k3_i - entropy_weight H_i)``, rho_i = exp(logp_i - old_i) (cupyloss.linear_grpo_loss
    has every term and the weights of each loss_type).

    On CUDA tensors outside a tracer the gradients are formed with the value in one pass (three
    matrix products a chunk) and scaled in backward; under torch.compile or torch.func, and on
    the CPU, the loss is composed from linear_log_probs in torch operations (the same values;
    four products a chunk).  Inside ``torch.autocast("cuda")`` the products run in the autocast
    dtype.

    Args:
      hidden: (B, T, H); weight: (V, H); target: (B, T) sampled tokens; bias: None or (V,).
      advantages: (B,) or (B, T).  mask: None or (B, T) completion mask.
      old_log_probs, ref_log_probs: None or (B, T) (no gradient flows into them).
      loss_type, epsilon_low, epsilon_high, beta, entropy_weight, temperature,
        max_completion_length, num_items, ignore_index, max_workspace_bytes: as for
        cupyloss.linear_grpo_loss.

    Returns:
      ``(loss, metrics)``: loss a 0-d float32 tensor; metrics a dict of 0-d tensors without
      gradients ('kl', 'entropy', 'clip_ratio_low', 'clip_ratio_high', 'clip_ratio').

    Example:
      >>> loss, metrics = cupyloss.torch.linear_grpo_loss(h, model.lm_head.weight, tokens,
      ...                                                 advantages, old_log_probs=old)
      >>> loss.backward()
    """
    from cupyloss import linear
    from cupyloss.torch import _amp

    options = dict(loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                   beta=beta, entropy_weight=entropy_weight, temperature=temperature,
                   max_completion_length=max_completion_length, num_items=num_items,
                   ignore_index=ignore_index)
    tensors = (hidden, weight, target, bias, advantages, mask, old_log_probs, ref_log_probs)
    traced = (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or any(
        t is not None and (type(t) is not torch.Tensor or torch._is_functional_tensor(t))
        for t in tensors))
    if traced or hidden.device.type == "cpu":
        return posttrain.grpo_loss(
            _OPS, lambda *a: _log_probs(*a, max_workspace_bytes), hidden, weight, target,
            advantages, bias, mask=mask, old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs, **options)
    posttrain.check_grpo(loss_type, epsilon_low, epsilon_high, beta, ref_log_probs,
                         max_completion_length)
    options["temperature"] = linear._temperature(temperature)
    compute = _amp.linear_compute(hidden, weight, bias)
    out = _LinearGRPO.apply(hidden, weight, bias, target, advantages, mask, old_log_probs,
                            ref_log_probs, dict(options, max_workspace_bytes=max_workspace_bytes,
                                                compute_dtype=compute))
    return out[0], dict(zip(posttrain.METRICS, out[1:]))


def _preference(kind, hidden, weight, target, bias, max_workspace_bytes, **options):
    return posttrain.preference_loss(
        _OPS, lambda *a: _log_probs(*a, max_workspace_bytes), kind, hidden, weight, target,
        bias, **options)


def linear_dpo_loss(hidden, weight, target, bias=None, *, ref_log_probs=None, ref_hidden=None,
                    ref_weight=None, ref_bias=None, beta=0.1, loss_type="sigmoid",
                    label_smoothing=0.0, ignore_index=-100, max_workspace_bytes=None):
    """DPO on the fused head (TRL's DPOTrainer): rows 0 .. B/2 - 1 chosen, B/2 .. B - 1 their
    rejected completions; with c, r the chosen and rejected sequences' summed log-probs (means
    for 'ipo') and c0, r0 the reference's, ``z = (c - r) - (c0 - r0)`` and the mean over pairs
    of ``-log sigma(beta z)`` ('sigmoid', with label_smoothing e: ``-(1 - e) log sigma(beta z)
    - e log sigma(-beta z)``), ``(z - 1/(2 beta))^2`` ('ipo') or ``max(0, 1 - beta z)``
    ('hinge').

    The log-probs come from linear_log_probs (logits never whole; the reference head's under no
    gradient); torch's autograd differentiates the per-sequence terms, and backward forms the
    policy's logits again chunk by chunk.

    Args:
      hidden: (B, T, H); weight: (V, H); target: (B, T) with ignore_index on prompt and padding
        tokens; bias: None or (V,).
      ref_log_probs: the reference's log-probs, (B, T) per token or (B,) per sequence; or
        ref_hidden (B, T, H'), ref_weight (V, H') and ref_bias: a reference head.
      beta, loss_type, label_smoothing: as above.  ignore_index, max_workspace_bytes: as for
        linear_log_probs.

    Returns:
      ``(loss, metrics)``: loss 0-d float32; metrics (no gradients) 'rewards_chosen',
      'rewards_rejected', 'rewards_margins', 'rewards_accuracies' (TRL's: beta (c - c0) etc.,
      means over pairs).

    Example:
      >>> loss, m = cupyloss.torch.linear_dpo_loss(h, lm_head.weight, labels,
      ...                                          ref_log_probs=ref_logps, beta=0.1)
    """
    return _preference("dpo", hidden, weight, target, bias, max_workspace_bytes,
                       ref_log_probs=ref_log_probs, ref_hidden=ref_hidden,
                       ref_weight=ref_weight, ref_bias=ref_bias, beta=beta,
                       loss_type=loss_type, label_smoothing=label_smoothing,
                       ignore_index=ignore_index)


def linear_orpo_loss(hidden, weight, target, bias=None, *, beta=0.1, ignore_index=-100,
                     max_workspace_bytes=None):
    """ORPO on the fused head (TRL's ORPOTrainer): with c, r the chosen and rejected sequences'
    mean log-probs, ``loss = nll_chosen - beta mean log sigma((c - r) - (log(1 - e^c) -
    log(1 - e^r)))``, nll_chosen the chosen rows' mean -logp over their counted tokens.

    Args:
      hidden (B, T, H), weight (V, H), target (B, T) (chosen rows first), bias: as for
        linear_dpo_loss.  beta: the odds ratio's weight.

    Returns:
      ``(loss, metrics)``: metrics as linear_dpo_loss's (rewards beta c and beta r) plus
      'log_odds_ratio', 'log_odds_chosen' and 'nll_loss'.

    Example:
      >>> loss, m = cupyloss.torch.linear_orpo_loss(h, lm_head.weight, labels, beta=0.1)
    """
    return _preference("orpo", hidden, weight, target, bias, max_workspace_bytes, beta=beta,
                       ignore_index=ignore_index)


def linear_cpo_loss(hidden, weight, target, bias=None, *, beta=0.1, alpha=1.0,
                    loss_type="sigmoid", label_smoothing=0.0, ignore_index=-100,
                    max_workspace_bytes=None):
    """CPO on the fused head (TRL's CPOTrainer): with c, r the chosen and rejected sequences'
    summed log-probs, the mean over pairs of ``-log sigma(beta (c - r))`` ('sigmoid', label
    smoothing as DPO's) or ``max(0, 1 - beta (c - r))`` ('hinge'), plus ``alpha nll_chosen``.

    Args:
      hidden, weight, target, bias: as for linear_dpo_loss.  beta, alpha, loss_type,
        label_smoothing: as above.

    Returns:
      ``(loss, metrics)``: metrics as linear_dpo_loss's (rewards beta c, beta r) and
      'nll_loss'.

    Example:
      >>> loss, m = cupyloss.torch.linear_cpo_loss(h, lm_head.weight, labels, alpha=1.0)
    """
    return _preference("cpo", hidden, weight, target, bias, max_workspace_bytes, beta=beta,
                       alpha=alpha, loss_type=loss_type, label_smoothing=label_smoothing,
                       ignore_index=ignore_index)


def linear_simpo_loss(hidden, weight, target, bias=None, *, beta=0.1, gamma=0.5, alpha=0.0,
                      label_smoothing=0.0, ignore_index=-100, max_workspace_bytes=None):
    """SimPO on the fused head (TRL's CPOTrainer with loss_type='simpo'): with c, r the chosen
    and rejected sequences' mean log-probs, the mean over pairs of ``-log sigma(beta (c - r) -
    gamma)`` (label smoothing as DPO's), plus ``alpha nll_chosen`` (0 by default: SimPO).

    Args:
      hidden, weight, target, bias: as for linear_dpo_loss.  beta, gamma (the target reward
        margin), alpha, label_smoothing: as above.

    Returns:
      ``(loss, metrics)``: as linear_cpo_loss's.

    Example:
      >>> loss, m = cupyloss.torch.linear_simpo_loss(h, lm_head.weight, labels, gamma=0.5)
    """
    return _preference("simpo", hidden, weight, target, bias, max_workspace_bytes, beta=beta,
                       gamma=gamma, alpha=alpha, label_smoothing=label_smoothing,
                       ignore_index=ignore_index)


def linear_kto_loss(hidden, weight, target, desirable, bias=None, *, ref_log_probs=None,
                    ref_hidden=None, ref_weight=None, ref_bias=None, kl=None, beta=0.1,
                    desirable_weight=1.0, undesirable_weight=1.0, ignore_index=-100,
                    max_workspace_bytes=None):
    """KTO on the fused head (TRL's KTOTrainer): each row a completion labelled desirable or
    not; with s its summed log-probs, s0 the reference's and kl the batch's KL estimate (no
    gradient; 0 when None), the mean over rows of ``desirable_weight (1 - sigma(beta (s - s0 -
    kl)))`` for desirable rows and ``undesirable_weight (1 - sigma(beta (kl - s + s0)))`` for
    the others.

    Args:
      hidden, weight, target, bias, ref_*: as for linear_dpo_loss.  desirable: (B,) bool.
      kl: None or a 0-d tensor.  beta, desirable_weight, undesirable_weight: as above.

    Returns:
      ``(loss, metrics)``: 'rewards_chosen' and 'rewards_rejected' (mean beta (s - s0) of the
      desirable and of the undesirable rows) and 'rewards_margins'.

    Example:
      >>> loss, m = cupyloss.torch.linear_kto_loss(h, lm_head.weight, labels, is_good,
      ...                                          ref_log_probs=ref_logps)
    """
    return _preference("kto", hidden, weight, target, bias, max_workspace_bytes,
                       desirable=desirable, ref_log_probs=ref_log_probs, ref_hidden=ref_hidden,
                       ref_weight=ref_weight, ref_bias=ref_bias, kl=kl, beta=beta,
                       desirable_weight=desirable_weight,
                       undesirable_weight=undesirable_weight, ignore_index=ignore_index)


POSTTRAIN = ("linear_grpo_loss", "linear_dpo_loss", "linear_orpo_loss", "linear_cpo_loss",
             "linear_simpo_loss", "linear_kto_loss")
