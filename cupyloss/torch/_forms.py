"""Every registered loss in torch's own operations: what cupyloss.torch computes on CPU tensors.

A loss torch has is torch.nn.functional's, called with the same arguments (its semantics, edge
values, errors and gradients are torch's by construction); cupyloss's options beyond torch's are
formed around it: kl_div's log_input=False takes the log first, cross_entropy's softcap caps the
logits (c tanh(x / c)) and its lse_square_scale adds s lse^2 to each counted row's loss (the
z-loss; 'mean' divides it by the divisor torch divides the loss by).  The host-side checks
(check_targets, check_var) are torch's own on a CPU: an index out of range raises, a negative
variance raises.  A loss torch lacks is its formula (tests/reference.py and
tests/reference_rowwise.py give the same in float64):
  hinge_loss          max(0, margin - x t)
  squared_hinge_loss  max(0, margin - x t)^2
  sigmoid_focal_loss  torchvision.ops.sigmoid_focal_loss: alpha_t ce (1 - p_t)^gamma
  log_cosh_loss       log cosh(x - t), as log1p(2 sinh(|d| / 2)^2) below |d| = 1, else
                      |d| - log 2 + log1p(e^(-2 |d|))
  jsd                 Liger-Kernel's generalised Jensen-Shannon divergence of log-probability
                      rows: beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q
Imports torch: only cupyloss.torch imports this module.
"""

from __future__ import annotations

import math

import torch

from cupyloss._core import validate as _validate

F = torch.nn.functional


def _reduce(per, reduction):
    if reduction == "none":
        return per
    return per.sum() if reduction == "sum" else per.mean()


def _hinge(input, target, margin=1.0, reduction="mean"):
    return _reduce(torch.clamp(margin - input * target, min=0), reduction)


def _squared_hinge(input, target, margin=1.0, reduction="mean"):
    return _reduce(torch.clamp(margin - input * target, min=0) ** 2, reduction)


def _focal(input, target, alpha=0.25, gamma=2.0, reduction="none"):
    ce = F.binary_cross_entropy_with_logits(input, target, reduction="none")
    q = torch.sigmoid(input) * (1 - target) + torch.sigmoid(-input) * target   # 1 - p_t
    per = ce * q ** gamma
    if alpha >= 0:
        per = (alpha * target + (1 - alpha) * (1 - target)) * per
    return _reduce(per, reduction)


def _log_cosh(input, target, reduction="mean"):
    a = (input - target).abs()
    small = torch.log1p(2 * torch.sinh(a.clamp(max=1) / 2) ** 2)   # clamped: finite gradients
    large = a - math.log(2.0) + torch.log1p(torch.exp(-2 * a))
    return _reduce(torch.where(a < 1, small, large), reduction)


def _jsd(input, target, beta=0.5, shift_labels=None, ignore_index=-100, reduction="mean"):
    if not 0.0 <= float(beta) <= 1.0:   # the kernels' path refuses it so (_rowclass)
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    q, p = input.exp(), target.exp()
    if beta == 0:
        terms = p * (target - input)
    elif beta == 1:
        terms = q * (input - target)
    else:
        m = beta * p + (1 - beta) * q
        terms = beta * p * target + (1 - beta) * q * input - m * torch.log(m)
    per = terms.sum(-1)
    counted = torch.tensor(per.numel())
    if shift_labels is not None:
        keep = shift_labels.reshape(per.shape) != ignore_index
        per = torch.where(keep, per, torch.zeros_like(per))
        counted = keep.sum()
    if reduction == "mean":   # Liger's: over the counted rows, 0 when none counts
        return per.sum() / counted.clamp(min=1)
    return _reduce(per, reduction)


def _kl_div(input, target, reduction="mean", log_target=False, log_input=True):
    return F.kl_div(input if log_input else torch.log(input), target, reduction=reduction,
                    log_target=log_target)


def _cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                   label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0, check_targets=False):
    softcap = _validate.check_softcap(softcap, input.dtype)
    z = softcap * torch.tanh(input / softcap) if softcap else input
    if not lse_square_scale:
        return F.cross_entropy(z, target, weight, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    per = F.cross_entropy(z, target, weight, ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    lse = torch.logsumexp(z, dim=0 if z.dim() == 1 else 1)
    if target.is_floating_point():
        counted, divisor = torch.ones_like(per, dtype=torch.bool), per.numel()
    else:
        counted = target != ignore_index
        w = torch.ones(z.shape[0 if z.dim() == 1 else 1], dtype=z.dtype) if weight is None \
            else weight
        divisor = torch.where(counted, w[torch.where(counted, target, 0)],
                              torch.zeros((), dtype=z.dtype)).sum()
    per = per + torch.where(counted, lse_square_scale * lse * lse, torch.zeros_like(per))
    if reduction == "mean":
        return per.sum() / divisor
    return _reduce(per, reduction)


def cross_entropy_logits_grad(input, target, weight=None, ignore_index=-100, reduction="mean",
                              label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0,
                              grad_output=1.0, num_items=None):
    """d/dinput of _cross_entropy for class indices, input (N, C), times grad_output, in torch's
    operations without autograd (for code that runs below it, as a custom op's CPU kernel):

      ``dz = -c + p sum(c) + 2 lse_square_scale lse p``, ``c = (1 - eps) w_y onehot(y) +
      (eps / C) w`` on counted rows (0 on ignored ones), times ``1 - (z / softcap)^2`` with a
      softcap, times the row's upstream gradient (over num_items where given, else over the
      summed w_y of counted rows for 'mean')."""
    classes = input.shape[1]
    z = softcap * torch.tanh(input / softcap) if softcap else input
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    p = torch.exp(z - lse)
    counted = target != ignore_index
    y = torch.where(counted, target, 0)
    w = torch.ones(classes, dtype=z.dtype) if weight is None else weight.to(z.dtype)
    wy = w[y]
    c = (label_smoothing / classes) * w.expand_as(z).clone()
    c.scatter_add_(1, y[:, None], ((1 - label_smoothing) * wy)[:, None])
    dz = p * c.sum(dim=1, keepdim=True) - c
    if lse_square_scale:
        dz = dz + 2 * lse_square_scale * lse * p
    if softcap:
        dz = dz * (1 - (z / softcap) ** 2)
    dz = torch.where(counted[:, None], dz, torch.zeros((), dtype=z.dtype))
    g = torch.as_tensor(grad_output, dtype=z.dtype)
    if reduction == "none":
        return dz * g.reshape(-1, 1)
    if num_items is not None:
        g = g / torch.as_tensor(num_items, dtype=z.dtype)
    elif reduction == "mean":
        g = g / torch.where(counted, wy, torch.zeros((), dtype=z.dtype)).sum()
    return dz * g


_FORMS = {"hinge_loss": _hinge, "squared_hinge_loss": _squared_hinge,
          "sigmoid_focal_loss": _focal, "log_cosh_loss": _log_cosh, "jsd": _jsd,
          "kl_div": _kl_div, "cross_entropy": _cross_entropy}
_HOST_CHECKS = ("check_targets", "check_var")   # torch checks these itself on a CPU


def loss(name: str, arrays, reduction: str, options: dict):
    """Loss `name` of `arrays` (its required arrays, in order) with keyword `options`, in torch's
    operations (differentiable by torch.autograd).  options["num_items"], where given, divides
    the 'sum' ('mean' and 'sum' alike)."""
    if options.get("num_items") is not None:
        items = options["num_items"]
        _validate.check_num_items(items, reduction, torch.Tensor)
        total = loss(name, arrays, "sum", {**options, "num_items": None})
        return total / torch.as_tensor(items, dtype=total.dtype, device=total.device)
    options = {k: v for k, v in options.items() if k != "num_items"}
    form = _FORMS.get(name)
    if form is not None:
        return form(*arrays, reduction=reduction, **options)
    kwargs = {k: v for k, v in options.items() if k not in _HOST_CHECKS}
    return getattr(F, name)(*arrays, reduction=reduction, **kwargs)
