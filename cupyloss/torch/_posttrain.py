"""Post-training objectives on the fused head for torch (cupyloss.posttrain has the formulas).

GRPO's family on real CUDA tensors runs fused (cupyloss.linear_grpo_loss_value_and_grad: its
gradients formed with its value, three products a chunk, held by ctx and scaled by the upstream
gradient in backward); traced (torch.compile, torch.func) or on the CPU it is composed from
linear_log_probs' registered op and grpo_objective in torch operations, which torch's autograd
differentiates.  The preference losses likewise: fused in one pass (a group of whole pairs at a
time, cupyloss.linear_preference_loss_value_and_grad) on CUDA tensors, composed when traced or
on the CPU.
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


def _held_grads(ctx, grad, what):
    """(hidden, weight, bias) gradients formed with the value (ctx.grads, named ctx.names),
    scaled in place by the upstream gradient; once only."""
    grads, ctx.grads = ctx.grads, None
    if grads is None:
        raise RuntimeError(f"{what}'s gradients were formed with its value and are spent: "
                           f"backward through it runs once (no retain_graph)")
    grads = list(grads)
    _ADAPTER["scale"](grad, grads)
    got = dict(zip(ctx.names, grads))
    return got.get("hidden"), got.get("weight"), got.get("bias")


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
        return (*_held_grads(ctx, grad_loss, "linear_grpo_loss"), *(None,) * 6)


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
    if _traced(hidden, weight, target, bias, advantages, mask, old_log_probs, ref_log_probs,
               num_items) or hidden.device.type == "cpu":
        return posttrain.grpo_loss(
            _OPS, lambda *a: _log_probs(*a, max_workspace_bytes), hidden, weight, target,
            advantages, bias, mask=mask, old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs, **options)
    posttrain.check_grpo(loss_type, epsilon_low, epsilon_high, beta, ref_log_probs,
                         max_completion_length, num_items)
    options["temperature"] = linear._temperature(temperature)
    compute = _amp.linear_compute(hidden, weight, bias)
    out = _LinearGRPO.apply(hidden, weight, bias, target, advantages, mask, old_log_probs,
                            ref_log_probs, dict(options, max_workspace_bytes=max_workspace_bytes,
                                                compute_dtype=compute))
    return out[0], dict(zip(posttrain.METRICS, out[1:]))


class _LinearPreference(torch.autograd.Function):
    """Eager calls on CUDA tensors: loss, metrics and gradients in one pass over the policy's
    head (cupyloss.linear_preference_loss_value_and_grad); backward scales the held
    gradients.  `keys` (a list) receives the metrics' names."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, kind, keys, kwargs):
        names = tuple(n for n, need in zip(_GRADS, ctx.needs_input_grad[:3]) if need)
        ctx.names = names
        if names:
            loss, metrics, grads = posttrain.linear_preference_loss_value_and_grad(
                kind, hidden, weight, target, bias, wrt=names, **kwargs)
            ctx.grads = (grads,) if len(names) == 1 else tuple(grads)
        else:
            loss, metrics = posttrain.linear_preference_loss(kind, hidden, weight, target, bias,
                                                             **kwargs)
            ctx.grads = ()
        keys.extend(metrics)
        values = tuple(metrics.values())
        ctx.mark_non_differentiable(*values)
        return (loss, *values)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        return (*_held_grads(ctx, grad_loss, "the preference loss"), *(None,) * 4)


def _traced(*tensors) -> bool:
    """Whether a tracer (torch.compile, torch.func, a tensor subclass) sees these tensors."""
    return (torch.compiler.is_compiling() or bool(torch._C._len_torch_dispatch_stack()) or any(
        t is not None and isinstance(t, torch.Tensor)
        and (type(t) is not torch.Tensor or torch._is_functional_tensor(t)) for t in tensors))


def _preference(kind, hidden, weight, target, bias, max_workspace_bytes, **options):
    """A preference loss: fused in one pass on CUDA tensors outside a tracer, else composed
    from linear_log_probs in torch operations."""
    tensors = (hidden, weight, target, bias, *(options.get(k) for k in (
        "ref_log_probs", "ref_hidden", "ref_weight", "ref_bias", "desirable", "kl")))
    if _traced(*tensors) or hidden.device.type == "cpu":
        return posttrain.preference_loss(
            _OPS, lambda *a: _log_probs(*a, max_workspace_bytes), kind, hidden, weight, target,
            bias, **options)
    from cupyloss.torch import _amp

    keys: list = []
    compute = _amp.linear_compute(hidden, weight, bias)
    out = _LinearPreference.apply(hidden, weight, bias, target, kind, keys, dict(
        options, max_workspace_bytes=max_workspace_bytes, compute_dtype=compute))
    return out[0], dict(zip(keys, out[1:]))


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


# --- distillation ---------------------------------------------------------------------------------

def _jsd_cpu(sh, sw, th, tw, target, sb, tb, beta, temperature, hard, ignore_index):
    """linear_jsd in torch's operations on float32 logits (the CPU path, autograd's)."""
    zs = torch.nn.functional.linear(sh.reshape(-1, sh.shape[-1]).float(), sw.float(),
                                    None if sb is None else sb.float())
    with torch.no_grad():
        zt = torch.nn.functional.linear(th.reshape(-1, th.shape[-1]).float(), tw.float(),
                                        None if tb is None else tb.float())
    x, y = (zs / temperature).log_softmax(-1), (zt / temperature).log_softmax(-1)
    if beta == 0.0:
        per = (y.exp() * (y - x)).sum(-1)
    elif beta == 1.0:
        per = (x.exp() * (x - y)).sum(-1)
    else:
        log_m = torch.logaddexp(x + torch.log(torch.tensor(1.0 - beta)),
                                y + torch.log(torch.tensor(beta)))
        per = (beta * y.exp() * (y - log_m) + (1.0 - beta) * x.exp() * (x - log_m)).sum(-1)
    if target is None:
        counted = torch.ones(per.shape, dtype=per.dtype, device=per.device)
    else:
        counted = (target.reshape(-1) != ignore_index).to(per.dtype)
    count = counted.sum().clamp(min=1.0)
    loss = (per * counted).sum() / count
    if hard:
        t = target.reshape(-1)
        lp = zs.log_softmax(-1).gather(-1, torch.where(t != ignore_index, t, 0)[:, None])[:, 0]
        loss = loss + hard * (-(lp * counted).sum() / count)
    return loss


_JSD_GRADS = ("hidden", "weight", "bias")


def _jsd_cpu_grads(grad, sh, sw, th, tw, target, sb, tb, beta, temperature, hard, ignore_index):
    """The student's gradients of _jsd_cpu in closed form (cupyloss.linear_jsd_value_and_grad's
    formula, in torch's operations: inside an op, below autograd)."""
    x2 = sh.reshape(-1, sh.shape[-1]).float()
    zs = torch.nn.functional.linear(x2, sw.float(), None if sb is None else sb.float())
    zt = torch.nn.functional.linear(th.reshape(-1, th.shape[-1]).float(), tw.float(),
                                    None if tb is None else tb.float())
    x, y = (zs / temperature).log_softmax(-1), (zt / temperature).log_softmax(-1)
    q, p = x.exp(), y.exp()
    if beta == 0.0:
        g = -p
    elif beta == 1.0:
        g = q * (x - y + 1.0)
    else:
        log_m = torch.logaddexp(x + torch.log(torch.tensor(1.0 - beta)),
                                y + torch.log(torch.tensor(beta)))
        g = (1.0 - beta) * q * (x - log_m)
    dz = (g - q * g.sum(-1, keepdim=True)) / temperature
    if target is None:
        counted = torch.ones(zs.shape[0])
    else:
        t = target.reshape(-1)
        counted = (t != ignore_index).float()
        if hard:
            d = zs.softmax(-1)
            d.scatter_add_(1, torch.where(t != ignore_index, t, 0)[:, None],
                           -torch.ones(t.shape[0], 1))
            dz = dz + hard * d
    dz = dz * (counted / counted.sum().clamp(min=1.0))[:, None] * grad.float()
    out = [(dz @ sw.float()).reshape(sh.shape).to(sh.dtype), (dz.T @ x2).to(sw.dtype)]
    if sb is not None:
        out.append(dz.sum(0).to(sb.dtype))
    return out


def _jsd_kwargs(beta, temperature, hard, ignore_index, budget):
    return dict(beta=beta, temperature=temperature, hard_weight=hard, ignore_index=ignore_index,
                max_workspace_bytes=None if budget < 0 else budget)


@torch.library.custom_op("cupyloss::linear_jsd", mutates_args=())
def _jsd_op(sh: torch.Tensor, sw: torch.Tensor, th: torch.Tensor, tw: torch.Tensor,
            target: torch.Tensor | None, sb: torch.Tensor | None, tb: torch.Tensor | None,
            beta: float, temperature: float, hard: float, ignore_index: int,
            budget: int) -> torch.Tensor:
    if sh.device.type == "cpu":
        with torch.no_grad():
            return _jsd_cpu(sh, sw, th, tw, target, sb, tb, beta, temperature, hard,
                            ignore_index)
    return posttrain.linear_jsd(sh, sw, th, tw, target, student_bias=sb, teacher_bias=tb,
                                **_jsd_kwargs(beta, temperature, hard, ignore_index, budget))


@_jsd_op.register_fake
def _(sh, sw, th, tw, target, sb, tb, beta, temperature, hard, ignore_index, budget):
    return sh.new_empty((), dtype=torch.float64 if sh.dtype == torch.float64 else torch.float32)


@torch.library.custom_op("cupyloss::linear_jsd_backward", mutates_args=())
def _jsd_backward_op(grad: torch.Tensor, sh: torch.Tensor, sw: torch.Tensor,
                     th: torch.Tensor, tw: torch.Tensor, target: torch.Tensor | None,
                     sb: torch.Tensor | None, tb: torch.Tensor | None, beta: float,
                     temperature: float, hard: float, ignore_index: int,
                     budget: int) -> list[torch.Tensor]:
    names = ("hidden", "weight") + (("bias",) if sb is not None else ())
    if sh.device.type == "cpu":
        return _jsd_cpu_grads(grad, sh, sw, th, tw, target, sb, tb, beta, temperature, hard,
                              ignore_index)
    _, grads = posttrain.linear_jsd_value_and_grad(
        sh, sw, th, tw, target, student_bias=sb, teacher_bias=tb, wrt=names,
        **_jsd_kwargs(beta, temperature, hard, ignore_index, budget))
    grads = list(grads)
    _ADAPTER["scale"](grad, grads)
    return grads


@_jsd_backward_op.register_fake
def _(grad, sh, sw, th, tw, target, sb, tb, *rest):
    return [torch.empty_like(a) for a in (sh, sw, sb) if a is not None]


def _jsd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.options = inputs[7:]


def _jsd_formula(ctx, grad):
    sh, sw, th, tw, target, sb, tb = ctx.saved_tensors
    got = _jsd_backward_op(grad, sh, sw, th, tw, target, sb, tb, *ctx.options)
    return (got[0], got[1], None, None, None, got[2] if sb is not None else None, None,
            *(None,) * len(ctx.options))


_jsd_op.register_autograd(_jsd_formula, setup_context=_jsd_setup)


class _LinearJSD(torch.autograd.Function):
    """Eager calls on CUDA tensors: the loss and the student's gradients in one pass, scaled by
    the upstream gradient in backward."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, target, tb, kwargs):
        names = tuple(n for n, need in zip(_JSD_GRADS, ctx.needs_input_grad[:3]) if need)
        ctx.names = names
        if not names:
            ctx.grads = ()
            return posttrain.linear_jsd(sh, sw, th, tw, target, student_bias=sb,
                                        teacher_bias=tb, **kwargs)
        loss, grads = posttrain.linear_jsd_value_and_grad(
            sh, sw, th, tw, target, student_bias=sb, teacher_bias=tb, wrt=names, **kwargs)
        ctx.grads = (grads,) if len(names) == 1 else tuple(grads)
        return loss

    @staticmethod
    def backward(ctx, grad):
        return (*_held_grads(ctx, grad, "linear_jsd"), *(None,) * 5)


def linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, *,
               student_bias=None, teacher_bias=None, beta=0.5, temperature=1.0, hard_weight=0.0,
               ignore_index=-100, max_workspace_bytes=None):
    """Knowledge distillation between two heads with autograd, logits never whole: the mean
    over the counted rows of ``beta KL(P || M) + (1 - beta) KL(Q || M)`` (Q, P the student's and
    the teacher's softmax(logits / T), M = beta P + (1 - beta) Q; beta 0 the forward KL, 1 the
    reverse) plus ``hard_weight`` times the student's mean cross entropy on target
    (cupyloss.linear_jsd has the gradient).

    On CUDA tensors outside a tracer the student's gradients are formed with the value in one
    pass and scaled in backward; under torch.compile the call is the op
    ``torch.ops.cupyloss.linear_jsd``; on the CPU, torch's operations.  The teacher gets no
    gradient.

    Args:
      student_hidden: (..., Hs); student_weight: (V, Hs); teacher_hidden: (..., Ht) of the same
        rows; teacher_weight: (V, Ht); the student's dtype.
      target: None (every row counts) or class indices of the rows' shape.
      student_bias, teacher_bias: None or (V,).
      beta: in [0, 1].  temperature: > 0.  hard_weight: >= 0 (needs target).
      ignore_index, max_workspace_bytes: as for linear_cross_entropy.

    Returns:
      0-d float32 tensor.

    Example:
      >>> loss = cupyloss.torch.linear_jsd(h, student.lm_head.weight, h_t,
      ...                                  teacher.lm_head.weight, labels, temperature=2.0)
      >>> loss.backward()
    """
    from cupyloss import linear

    posttrain.check_distill(beta, temperature, hard_weight, target)
    temperature = linear._temperature(temperature)
    traced = _traced(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                     student_bias, teacher_bias)
    options = (float(beta), temperature, float(hard_weight), int(ignore_index),
               -1 if max_workspace_bytes is None else int(max_workspace_bytes))
    if student_hidden.device.type == "cpu" and not traced:
        return _jsd_cpu(student_hidden, student_weight, teacher_hidden.detach(),
                        teacher_weight.detach(), target, student_bias,
                        None if teacher_bias is None else teacher_bias.detach(), *options[:4])
    if traced or student_hidden.device.type == "cpu":
        return _jsd_op(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                       student_bias, teacher_bias, *options)
    return _LinearJSD.apply(student_hidden, student_weight, student_bias, teacher_hidden,
                            teacher_weight, target, teacher_bias,
                            _jsd_kwargs(*options))
