"""Float64 NumPy references for the cupyloss pointwise losses and their gradients.

Every function takes NumPy arrays of any floating dtype (float16, bfloat16 from ml_dtypes,
float32, float64), upcasts them to float64 exactly, broadcasts its array arguments against each
other with NumPy's rules (the same rules torch uses) and computes in float64. The semantics are
those of ``torch.nn.functional`` (``torchvision.ops`` for the focal loss) evaluated in float64 on
a CPU, including its NaN, inf, tie and zero edge cases; where a loss is evaluated in a more
accurate form than torch's, its docstring says so. ``tests/test_reference.py`` checks all of it
against torch and against finite differences.

``loss(name, *arrays, reduction, **options)`` and ``grads(name, *arrays, reduction, grad_output,
**options)`` reduce the elementwise functions the way torch does; each elementwise ``<loss>_grads``
returns one partial derivative per array argument, in the broadcast shape.

This module never imports cupyloss, CuPy or torch: it is the independent side of every comparison.
"""

import math

import numpy as np

REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _f64(a):
    """Return ``a`` as a float64 NumPy array (an exact upcast for every narrower float dtype)."""
    return np.asarray(a).astype(np.float64)


def _broadcast(input, target):
    """Upcast both arguments to float64 and broadcast them to their common shape."""
    return np.broadcast_arrays(_f64(input), _f64(target))


def mse(input, target):
    """Elementwise squared error, as ``torch.nn.functional.mse_loss(..., reduction='none')``.

    ``loss = (x - t)**2`` in the broadcast shape of ``input`` (x) and ``target`` (t), float64. NaN
    in either argument gives NaN, and ``inf - inf`` gives NaN.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        d = x - t
        return d * d


def mse_grads(input, target):
    """Elementwise gradients of :func:`mse`: ``d/dx = 2 (x - t)`` and ``d/dt = -2 (x - t)``.

    Both are float64 arrays of the broadcast shape (not yet summed back to each argument's shape;
    :func:`grads` does that).
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        d = 2.0 * (x - t)
        return d, -d


def _xlogx(t):
    """``xlogy(t, t)``: ``t * log(t)``, 0 where ``t == 0``, NaN where ``t`` is NaN or negative."""
    with np.errstate(all="ignore"):
        return np.where(t == 0, 0.0, t * np.log(t))


def kl_div(input, target, log_target=False, log_input=True):
    """Elementwise KL divergence terms, as ``torch.nn.functional.kl_div(..., reduction='none')``.

    With ``x`` the log-probability input (``x = input`` when ``log_input`` is true, else
    ``x = log(input)``, the input being the probability ``p``) and ``t`` the target:
    ``loss = xlogy(t, t) - t * x`` when ``log_target`` is false (``xlogy(0, y) = 0`` unless ``y`` is
    NaN), and ``loss = exp(t) * (t - x)`` when it is true. The formula is kept literal, so
    ``t = 0`` with ``x = -inf`` (``p = 0``) gives ``0 - 0 * (-inf) = NaN``, a negative ``t`` gives
    NaN through ``log``, and ``log_target`` with ``t = -inf`` gives ``0 * (-inf) = NaN``, exactly
    as torch does. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        if not log_input:
            x = np.log(x)
        if log_target:
            return np.exp(t) * (t - x)
        return _xlogx(t) - t * x


def kl_div_grads(input, target, log_target=False, log_input=True):
    """Elementwise gradients of :func:`kl_div`, with torch autograd's NaN pattern.

    ``log_target`` false: ``d/dx = -t`` and ``d/dt = (t != 0 ? log(t) : 0) + t / t - x`` (the
    backward of ``xlogy(t, t)``), which is NaN where ``t == 0`` and where ``t < 0``.
    ``log_target`` true: ``d/dx = -exp(t)`` and ``d/dt = exp(t) * (t - x) + exp(t)``.
    With ``log_input`` false the input is ``p`` and ``x = log(p)``, so ``d/dp = (d/dx) / p``
    (``-t / p`` or ``-exp(t) / p``) and ``d/dt`` uses ``x = log(p)``. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        p = x
        if not log_input:
            x = np.log(p)
        if log_target:
            e = np.exp(t)
            g_x = -e
            g_t = e * (t - x) + e
        else:
            g_x = -t
            g_t = np.where(t != 0, np.log(t), 0.0) + t / t - x
        if not log_input:
            g_x = g_x / p
        return g_x, g_t


def hinge(input, target, margin=1.0):
    """Elementwise hinge loss, as ``torch.clamp(margin - x * t, min=0)``.

    ``loss = max(0, margin - x * t)`` in the broadcast shape, float64. NaN propagates: a NaN in
    ``x * t`` gives NaN, not 0.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        return np.maximum(margin - x * t, 0.0)


def hinge_grads(input, target, margin=1.0):
    """Elementwise gradients of :func:`hinge`, as torch's ``clamp(min=0)`` backward gives them.

    With ``mask = (margin - x * t >= 0)`` (ties pass the gradient; NaN does not):
    ``d/dx = -t * mask`` and ``d/dt = -x * mask``. The product is literal, so a NaN ``t`` still
    gives a NaN ``d/dx`` where the mask is 0, as in torch. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        mask = (margin - x * t >= 0).astype(np.float64)
        return -t * mask, -x * mask


def _broadcast_all(*arrays):
    """Upcast every argument to float64 and broadcast them all to their common shape."""
    return np.broadcast_arrays(*(_f64(a) for a in arrays))


def _sign(d):
    """``sign(d)`` with ``sign(0) = 0`` and, as ``torch.sgn``, ``sign(NaN) = 0``."""
    return np.where(d > 0, 1.0, np.where(d < 0, -1.0, 0.0))


def _softplus(z):
    """``log(1 + exp(z))`` without overflow: ``max(z, 0) + log1p(exp(-|z|))``."""
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


def _sigmoid(z):
    """``1 / (1 + exp(-z))`` without overflow; ``1 - sigmoid(z)`` is ``sigmoid(-z)``, exactly."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def l1(input, target):
    """Elementwise absolute error, as ``torch.nn.functional.l1_loss(..., reduction='none')``.

    ``loss = |x - t|``, float64, broadcast shape; NaN propagates and ``inf - inf`` is NaN.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        return np.abs(x - t)


def l1_grads(input, target):
    """Elementwise gradients of :func:`l1` as torch's ``abs`` backward gives them.

    ``d/dx = sign(x - t)`` and ``d/dt = -sign(x - t)``, with ``sign(0) = 0`` (the tie ``x == t``
    has gradient 0) and ``sign(NaN) = 0`` (torch's ``sgn``), so a NaN difference has gradient 0.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        s = _sign(x - t)
        return s, -s


def _check_beta(beta):
    """Torch's check on smooth_l1_loss's beta (a RuntimeError there, a ValueError here)."""
    if beta < 0:
        raise ValueError("smooth_l1_loss does not support negative values for beta.")


def smooth_l1(input, target, beta=1.0):
    """Elementwise smooth L1, as ``torch.nn.functional.smooth_l1_loss(..., reduction='none')``.

    With ``d = x - t`` and ``z = |d|``: ``loss = 0.5 z**2 / beta`` where ``z < beta`` and
    ``z - 0.5 beta`` elsewhere (the tie ``z == beta`` takes the linear branch; both give
    ``0.5 beta`` there). ``beta == 0`` is exactly :func:`l1` (torch dispatches to l1_loss).
    ``beta < 0`` raises ValueError. NaN propagates.
    """
    _check_beta(beta)
    if beta == 0:
        return l1(input, target)
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        z = np.abs(x - t)
        return np.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)


def smooth_l1_grads(input, target, beta=1.0):
    """Elementwise gradients of :func:`smooth_l1`, as torch's smooth_l1_loss_backward.

    ``d/dx = -1`` where ``d <= -beta``, ``1`` where ``d >= beta`` (ties take the constant), and
    ``d / beta`` in between (so 0 at ``d == 0`` and NaN for a NaN ``d``); ``d/dt = -d/dx``.
    ``beta == 0`` gives :func:`l1_grads` (``sign(d)``, 0 at ``d == 0``).
    """
    _check_beta(beta)
    if beta == 0:
        return l1_grads(input, target)
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        d = x - t
        g = np.where(d <= -beta, -1.0, np.where(d >= beta, 1.0, d / beta))
        return g, -g


def _check_delta(delta):
    """Torch's check on huber_loss's delta (a RuntimeError there, a ValueError here)."""
    if not delta > 0:
        raise ValueError("huber_loss does not support non-positive values for delta.")


def huber(input, target, delta=1.0):
    """Elementwise Huber loss, as ``torch.nn.functional.huber_loss(..., reduction='none')``.

    With ``z = |x - t|``: ``loss = 0.5 z**2`` where ``z < delta``, ``delta (z - 0.5 delta)``
    elsewhere; ``delta <= 0`` raises ValueError. NaN propagates.
    """
    _check_delta(delta)
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        z = np.abs(x - t)
        return np.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))


def huber_grads(input, target, delta=1.0):
    """Elementwise gradients of :func:`huber`, as torch's huber_loss_backward.

    ``d/dx = -delta`` where ``d <= -delta``, ``delta`` where ``d >= delta``, ``d`` in between;
    ``d/dt = -d/dx``.
    """
    _check_delta(delta)
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        d = x - t
        g = np.where(d <= -delta, -delta, np.where(d >= delta, delta, d))
        return g, -g


# Torch's EPSILON in binary_cross_entropy_backward: the float literal 1e-12f, used as a double.
BCE_EPSILON = float(np.float32(1e-12))


def _bce_unweighted(x, t):
    """``-(t max(log x, -100) + (1 - t) max(log(1 - x), -100))``, NaN-propagating clamps."""
    return (t - 1.0) * np.maximum(np.log1p(-x), -100.0) - t * np.maximum(np.log(x), -100.0)


def binary_cross_entropy(input, target, weight=None):
    """Elementwise binary cross entropy, as ``torch.nn.functional.binary_cross_entropy``.

    ``loss = -w (t max(log x, -100) + (1 - t) max(log(1 - x), -100))``, each log clamped at -100
    as torch does (so ``x = 0`` or ``x = 1`` give finite values, and ``0 * log 0`` terms are 0).
    ``w`` is ``weight`` (1 when None). Torch rejects ``x`` outside [0, 1]; here such an ``x``
    gives NaN (the log of a negative number); a NaN anywhere propagates. Float64, the broadcast
    shape of every array given.
    """
    arrays = [input, target] + ([weight] if weight is not None else [])
    x, t, *w = _broadcast_all(*arrays)
    with np.errstate(all="ignore"):
        loss = _bce_unweighted(x, t)
        return loss * w[0] if w else loss


def binary_cross_entropy_grads(input, target, weight=None):
    """Elementwise gradients of :func:`binary_cross_entropy`, as torch's backward formulas.

    ``d/dx = w (x - t) / max((1 - x) x, 1e-12f)`` (torch's binary_cross_entropy_backward; finite
    at ``x = 0`` and ``x = 1``), ``d/dt = -w logit(x) = w log((1 - x) / x)`` (torch's
    binary_cross_entropy_target_backward, unclamped: ``+-inf`` at ``x = 0, 1``) and, for the
    weight, ``d/dw`` = the unweighted loss (torch does not differentiate weight). Returns the
    partials of input, target and (when given) weight.
    """
    arrays = [input, target] + ([weight] if weight is not None else [])
    x, t, *w = _broadcast_all(*arrays)
    with np.errstate(all="ignore"):
        scale = w[0] if w else 1.0
        g_x = scale * (x - t) / np.maximum((1.0 - x) * x, BCE_EPSILON)
        g_t = scale * -np.log(x / (1.0 - x))
        if not w:
            return g_x, g_t
        return g_x, g_t, _bce_unweighted(x, t)


def _bce_logits_parts(input, target, weight, pos_weight):
    """Broadcast (x, t, w, p) with w = 1 and p = 1 standing in for absent arrays."""
    arrays = [input, target] + [a for a in (weight, pos_weight) if a is not None]
    x, t, *rest = _broadcast_all(*arrays)
    w = rest.pop(0) if weight is not None else 1.0
    p = rest.pop(0) if pos_weight is not None else 1.0
    return x, t, w, p


def binary_cross_entropy_with_logits(input, target, weight=None, pos_weight=None):
    """Elementwise BCE on logits, as ``torch.nn.functional.binary_cross_entropy_with_logits``.

    Torch's ``w ((1 - t) x - (1 + (p - 1) t) log_sigmoid(x))`` is evaluated in the equal form
    ``w ((1 - t) softplus(x) + p t softplus(-x))``, a sum of non-negative terms for t in [0, 1], so
    large ``|x|`` lose no precision (``softplus(z) = max(z, 0) + log1p(exp(-|z|))``). ``w`` is
    ``weight`` and ``p`` is ``pos_weight`` (each 1 when None); ``pos_weight`` broadcasts like the
    others, so a (C,) array lines up with the last dim of (N, C). Float64, broadcast shape.
    """
    x, t, w, p = _bce_logits_parts(input, target, weight, pos_weight)
    with np.errstate(all="ignore"):
        return w * ((1.0 - t) * _softplus(x) + p * t * _softplus(-x))


def binary_cross_entropy_with_logits_grads(input, target, weight=None, pos_weight=None):
    """Elementwise gradients of :func:`binary_cross_entropy_with_logits`.

    ``d/dx = w ((1 - t) sigmoid(x) - p t sigmoid(-x))`` (torch's
    ``(p t + 1 - t) sigmoid(x) - p t``),
    ``d/dt = w (p softplus(-x) - softplus(x))`` (torch's ``log_sigmoid(-x) - p log_sigmoid(x)``,
    ``-x`` without pos_weight), ``d/dw`` = the unweighted loss and
    ``d/dp = w t softplus(-x)`` (torch differentiates neither weight nor pos_weight). Returns the
    partials of input, target, then weight and pos_weight when given.
    """
    x, t, w, p = _bce_logits_parts(input, target, weight, pos_weight)
    with np.errstate(all="ignore"):
        sp, sn = _softplus(x), _softplus(-x)
        out = [w * ((1.0 - t) * _sigmoid(x) - p * t * _sigmoid(-x)), w * (p * sn - sp)]
        if weight is not None:
            out.append((1.0 - t) * sp + p * t * sn)
        if pos_weight is not None:
            out.append(w * t * sn)
        return tuple(out)


def soft_margin(input, target):
    """Elementwise soft margin loss ``log(1 + exp(-x t))``, as torch's soft_margin_loss.

    Evaluated as ``softplus(-x t)``: equal to torch's ``log1p(exp(-x t))`` wherever that is finite,
    and finite (about ``-x t``) where torch's ``exp`` overflows to inf (``-x t`` past ~709 in
    float64, ~88 in float32). NaN propagates.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        return _softplus(-x * t)


def soft_margin_grads(input, target):
    """Elementwise gradients of :func:`soft_margin`: ``d/dx = -t sigmoid(-x t)``,
    ``d/dt = -x sigmoid(-x t)``.

    Torch computes ``-t z / (1 + z)`` with ``z = exp(-x t)``, which is NaN once ``z`` overflows;
    here it stays ``-t``. Torch does not differentiate the target.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        s = _sigmoid(-x * t)
        return -t * s, -x * s


def hinge_embedding(input, target, margin=1.0):
    """Elementwise hinge embedding loss, as torch's hinge_embedding_loss.

    ``loss = [t != 1] max(0, margin - x) + [t != -1] x``: ``x`` for ``t == 1``,
    ``max(0, margin - x)`` for ``t == -1``, and both terms for any other target (torch's two
    ``where``s). The clamp propagates NaN. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        return (np.where(t != 1, np.maximum(margin - x, 0.0), 0.0)
                + np.where(t != -1, x, 0.0))


def hinge_embedding_grads(input, target, margin=1.0):
    """Elementwise gradients of :func:`hinge_embedding`.

    ``d/dx = [t != -1] - [t != 1] [margin - x >= 0]`` (clamp passes ties, blocks NaN) and
    ``d/dt = 0``: the target only selects branches (torch returns no gradient for it).
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        g = (np.where(t != -1, 1.0, 0.0)
             - np.where((t != 1) & (margin - x >= 0), 1.0, 0.0))
        return g, np.zeros_like(t)


def margin_ranking(input1, input2, target, margin=0.0):
    """Elementwise margin ranking loss ``max(0, -t (x1 - x2) + margin)``, as torch's.

    Float64 in the broadcast shape of the three arrays; the clamp propagates NaN.
    """
    x1, x2, t = _broadcast_all(input1, input2, target)
    with np.errstate(all="ignore"):
        return np.maximum(-t * (x1 - x2) + margin, 0.0)


def margin_ranking_grads(input1, input2, target, margin=0.0):
    """Elementwise gradients of :func:`margin_ranking`, as torch's ``clamp_min`` backward.

    With ``mask = (-t (x1 - x2) + margin >= 0)`` (ties pass, NaN blocks): ``d/dx1 = -t mask``,
    ``d/dx2 = t mask``, ``d/dt = -(x1 - x2) mask``; the products are literal, so a NaN factor
    still gives NaN where the mask is 0, as in torch.
    """
    x1, x2, t = _broadcast_all(input1, input2, target)
    with np.errstate(all="ignore"):
        d = x1 - x2
        mask = (-t * d + margin >= 0).astype(np.float64)
        return -t * mask, t * mask, -d * mask


def _stirling(t):
    """Torch's Stirling term ``t log t - t + 0.5 log(2 pi t)``, replaced by 0 where ``t <= 1``."""
    with np.errstate(all="ignore"):
        s = t * np.log(t) - t + 0.5 * np.log(2 * np.pi * t)
        return np.where(t <= 1, 0.0, s)


def poisson_nll(input, target, log_input=True, full=False, eps=1e-8):
    """Elementwise Poisson NLL, as ``torch.nn.functional.poisson_nll_loss(..., reduction='none')``.

    ``log_input``: ``exp(x) - t x``; otherwise ``x - t log(x + eps)``. ``full`` adds the Stirling
    term ``t log t - t + 0.5 log(2 pi t)`` where ``t > 1`` (0 where ``t <= 1``, as torch's
    masked_fill, so the loss jumps by about -0.08 at ``t = 1``). Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        loss = np.exp(x) - t * x if log_input else x - t * np.log(x + eps)
        return loss + _stirling(t) if full else loss


def poisson_nll_grads(input, target, log_input=True, full=False, eps=1e-8):
    """Elementwise gradients of :func:`poisson_nll`, as torch autograd gives them.

    ``log_input``: ``d/dx = exp(x) - t``, ``d/dt = -x``; otherwise ``d/dx = 1 - t / (x + eps)``,
    ``d/dt = -log(x + eps)``. ``full`` adds to ``d/dt`` torch's backward of the masked Stirling
    term, ``m log t + (m t) / t - m + 0.5 m / t`` with ``m = [t > 1]`` evaluated literally:
    ``log t + 0.5 / t`` where ``t > 1``, 0 where ``0 < t <= 1``, and NaN where ``t <= 0`` (``0 *
    log 0`` and ``0 / 0`` survive the mask in torch).
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        if log_input:
            g_x, g_t = np.exp(x) - t, -x
        else:
            g_x, g_t = 1.0 - t / (x + eps), -np.log(x + eps)
        if full:
            m = np.where(t <= 1, 0.0, 1.0)
            g_t = g_t + (m * np.log(t) + (m * t) / t - m + (0.5 * m / (2 * np.pi * t)) * 2 * np.pi)
        return g_x, g_t


def gaussian_var_shape(input_shape, var_shape):
    """The shape torch's gaussian_nll_loss gives ``var`` before broadcasting, or ValueError.

    Equal to the input's shape: kept. The input's shape without its last dim: a trailing 1 is
    added (one variance per row). Same number of dims with exactly one mismatched dim, where var
    has size 1 (torch sums var's sizes over the mismatched dims and asks for 1): kept. Anything
    else raises ``ValueError("var is of incorrect size")``.
    """
    input_shape, var_shape = tuple(input_shape), tuple(var_shape)
    if var_shape == input_shape:
        return var_shape
    if input_shape[:-1] == var_shape:
        return var_shape + (1,)
    if (len(input_shape) == len(var_shape)
            and sum(v for i, v in zip(input_shape, var_shape) if i != v) == 1):
        return var_shape
    raise ValueError("var is of incorrect size")


def _gaussian_parts(input, target, var, eps):
    """Broadcast x, t and the clamped variance ``max(var, eps)`` (NaN stays NaN)."""
    if isinstance(var, (int, float)):
        var = np.full(np.shape(input), float(var))  # torch: var * ones_like(input)
    var = _f64(var).reshape(gaussian_var_shape(np.shape(input), np.shape(var)))
    x, t, v = _broadcast_all(input, target, var)
    return x, t, np.maximum(v, eps)


def gaussian_nll(input, target, var, full=False, eps=1e-6):
    """Elementwise Gaussian NLL, as ``torch.nn.functional.gaussian_nll_loss(..., 'none')``.

    ``loss = 0.5 (log v + (x - t)**2 / v)`` plus ``0.5 log(2 pi)`` when ``full``, with
    ``v = max(var, eps)``. ``var`` takes torch's shapes (:func:`gaussian_var_shape`) or is a
    Python float. Torch raises ValueError for a negative var; here it is clamped to eps like any
    var below eps. Float64, broadcast shape.
    """
    x, t, v = _gaussian_parts(input, target, var, eps)
    with np.errstate(all="ignore"):
        loss = 0.5 * (np.log(v) + (x - t) ** 2 / v)
        return loss + 0.5 * np.log(2 * np.pi) if full else loss


def gaussian_nll_grads(input, target, var, full=False, eps=1e-6):
    """Elementwise gradients of :func:`gaussian_nll`, as torch autograd gives them.

    ``d/dx = (x - t) / v``, ``d/dt = -(x - t) / v`` and ``d/dvar = 0.5 (1 / v - (x - t)**2 / v**2)``
    with ``v = max(var, eps)``: torch clamps under ``no_grad``, so the gradient reaches var even
    where the clamp is active. A Python float var has no gradient (None).
    """
    x, t, v = _gaussian_parts(input, target, var, eps)
    with np.errstate(all="ignore"):
        d = x - t
        g_v = 0.5 * (1.0 / v - d * d / (v * v))
        return d / v, -d / v, None if isinstance(var, (int, float)) else g_v


def squared_hinge(input, target, margin=1.0):
    """Elementwise squared hinge loss ``max(0, margin - x t)**2`` (no torch counterpart).

    The square of :func:`hinge`; NaN propagates. Float64, broadcast shape.
    """
    return hinge(input, target, margin) ** 2


def squared_hinge_grads(input, target, margin=1.0):
    """Elementwise gradients of :func:`squared_hinge`, as torch autograd gives them for
    ``clamp(margin - x t, min=0) ** 2``.

    With ``h = margin - x t`` where ``h >= 0`` and 0 elsewhere (clamp's backward blocks NaN):
    ``d/dx = -2 h t`` and ``d/dt = -2 h x``; continuous at the kink, where both are 0. The
    products are literal, so a NaN factor still gives NaN.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        v = margin - x * t
        h = np.where(v >= 0, v, 0.0)
        return -2.0 * h * t, -2.0 * h * x


def _focal_parts(x, t, alpha, gamma):
    """Shared pieces of the focal loss: p, 1 - p, ce, q = 1 - p_t, q**gamma, alpha_t."""
    p, r = _sigmoid(x), _sigmoid(-x)
    ce = (1.0 - t) * _softplus(x) + t * _softplus(-x)
    q = p * (1.0 - t) + r * t
    mod = q ** gamma
    alpha_t = alpha * t + (1.0 - alpha) * (1.0 - t) if alpha >= 0 else np.ones_like(x)
    return p, r, ce, q, mod, alpha_t


def sigmoid_focal(input, target, alpha=0.25, gamma=2.0):
    """Elementwise sigmoid focal loss, as ``torchvision.ops.sigmoid_focal_loss(..., 'none')``.

    ``loss = alpha_t ce (1 - p_t)**gamma`` with ``p = sigmoid(x)``,
    ``ce = binary_cross_entropy_with_logits(x, t)``, ``p_t = p t + (1 - p)(1 - t)`` and
    ``alpha_t = alpha t + (1 - alpha)(1 - t)`` (1 when ``alpha < 0``). ``1 - p_t`` is evaluated
    as ``p (1 - t) + sigmoid(-x) t`` and ``ce`` as ``(1 - t) softplus(x) + t softplus(-x)``: equal
    to torchvision's forms, without their cancellation at large ``|x|``. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        _, _, ce, _, mod, alpha_t = _focal_parts(x, t, alpha, gamma)
        return alpha_t * ce * mod


def sigmoid_focal_grads(input, target, alpha=0.25, gamma=2.0):
    """Elementwise gradients of :func:`sigmoid_focal` (torch autograd through torchvision's code).

    With ``q = 1 - p_t`` and ``dmod = gamma q**(gamma - 1)`` (0 when ``gamma == 0``, as torch's
    pow backward): ``d/dx = alpha_t ((p (1 - t) - (1 - p) t) q**gamma + ce dmod p (1 - p)(1 - 2t))``
    and ``d/dt = a' ce q**gamma + alpha_t (-x q**gamma + ce dmod ((1 - p) - p))`` with
    ``a' = 2 alpha - 1`` (0 when ``alpha < 0``).
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        p, r, ce, q, mod, alpha_t = _focal_parts(x, t, alpha, gamma)
        dmod = gamma * q ** (gamma - 1.0) if gamma != 0 else np.zeros_like(q)
        g_x = alpha_t * ((p * (1.0 - t) - r * t) * mod + ce * dmod * (p * r) * (1.0 - 2.0 * t))
        d_alpha = 2.0 * alpha - 1.0 if alpha >= 0 else 0.0
        g_t = d_alpha * ce * mod + alpha_t * (-x * mod + ce * dmod * (r - p))
        return g_x, g_t


LOG2 = np.log(2.0)


def log_cosh(input, target):
    """Elementwise ``log(cosh(x - t))`` (no torch counterpart), accurate for every ``d = x - t``.

    ``|d| < 1``: ``log1p(2 sinh(|d| / 2)**2)`` (no cancellation near 0, where the loss is
    ``d**2 / 2``); otherwise ``|d| - log 2 + log1p(exp(-2 |d|))`` (no overflow of cosh). NaN
    propagates; ``+-inf`` gives inf. Float64, broadcast shape.
    """
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        a = np.abs(x - t)
        small = np.log1p(2.0 * np.sinh(a / 2) ** 2)
        large = a - LOG2 + np.log1p(np.exp(-2.0 * a))
        return np.where(a < 1, small, large)


def log_cosh_grads(input, target):
    """Elementwise gradients of :func:`log_cosh`: ``d/dx = tanh(x - t)``, ``d/dt = -d/dx``."""
    x, t = _broadcast(input, target)
    with np.errstate(all="ignore"):
        g = np.tanh(x - t)
        return g, -g


class _Loss:
    """A registered loss: elementwise value and gradients, and its array arguments.

    ``arrays`` are the required array arguments in torch's order (passed positionally),
    ``optional`` the array arguments that default to None (passed by keyword), ``reshape`` maps
    an array's name to a function ``(input_shape, shape) -> shape`` giving the shape torch views
    it as before broadcasting (gaussian_nll's var).
    """

    def __init__(self, value, grads, arrays=("input", "target"), optional=(), reshape=None,
                 reduction="mean"):
        self.value, self.grads = value, grads
        self.arrays, self.optional = arrays, optional
        self.reshape = reshape or {}
        self.reduction = reduction


# name -> registered loss; options are passed through as keywords.
_LOSSES = {
    "mse_loss": _Loss(mse, mse_grads),
    "kl_div": _Loss(kl_div, kl_div_grads),
    "hinge_loss": _Loss(hinge, hinge_grads),
    "l1_loss": _Loss(l1, l1_grads),
    "smooth_l1_loss": _Loss(smooth_l1, smooth_l1_grads),
    "huber_loss": _Loss(huber, huber_grads),
    "binary_cross_entropy": _Loss(binary_cross_entropy, binary_cross_entropy_grads,
                                  optional=("weight",)),
    "binary_cross_entropy_with_logits": _Loss(
        binary_cross_entropy_with_logits, binary_cross_entropy_with_logits_grads,
        optional=("weight", "pos_weight")),
    "soft_margin_loss": _Loss(soft_margin, soft_margin_grads),
    "hinge_embedding_loss": _Loss(hinge_embedding, hinge_embedding_grads),
    "margin_ranking_loss": _Loss(margin_ranking, margin_ranking_grads,
                                 arrays=("input1", "input2", "target")),
    "poisson_nll_loss": _Loss(poisson_nll, poisson_nll_grads),
    "gaussian_nll_loss": _Loss(gaussian_nll, gaussian_nll_grads,
                               arrays=("input", "target", "var"),
                               reshape={"var": gaussian_var_shape}),
    "squared_hinge_loss": _Loss(squared_hinge, squared_hinge_grads),
    "sigmoid_focal_loss": _Loss(sigmoid_focal, sigmoid_focal_grads, reduction="none"),
    "log_cosh_loss": _Loss(log_cosh, log_cosh_grads),
}
LOSS_NAMES = tuple(_LOSSES)


def _loss_spec(name):
    """Return the registered loss ``name``, raising ValueError if unknown."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {LOSS_NAMES}") from None


def array_names(name):
    """The array arguments of loss ``name``: required ones in order, then optional ones."""
    spec = _loss_spec(name)
    return spec.arrays + spec.optional


def _split(name, args, kwargs, trailing):
    """Split a call's arguments into (spec, arrays by name, trailing positionals, options).

    The first ``len(spec.arrays)`` positionals are the required arrays; up to ``len(trailing)``
    more fill the names in ``trailing`` (``reduction``, then ``grad_output``), which may also come
    as keywords with the defaults in ``trailing``; optional arrays come as keywords.
    """
    spec = _loss_spec(name)
    k = len(spec.arrays)
    if len(args) < k or len(args) > k + len(trailing):
        raise TypeError(f"{name} takes the arrays {spec.arrays} and up to {len(trailing)} more "
                        f"positional arguments, got {len(args)}")
    arrays = dict(zip(spec.arrays, args[:k]))
    opts = dict(kwargs)
    for extra in spec.optional:
        arrays[extra] = opts.pop(extra, None)
    rest = list(args[k:])
    values = {}
    for key, default in trailing.items():
        if rest:
            if key in opts:
                raise TypeError(f"{name}: {key} given twice")
            values[key] = rest.pop(0)
        else:
            values[key] = opts.pop(key, default)
    if values["reduction"] is None:
        values["reduction"] = spec.reduction
    return spec, arrays, values, opts


def _check_reduction(reduction):
    """Raise ValueError unless ``reduction`` is one of :data:`REDUCTIONS`."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")


def _batch(input):
    """Torch's batchmean divisor: ``input.shape[0]``, or 1 (no division) for a 0-d input."""
    shape = np.shape(input)
    return shape[0] if shape else 1


def reduce(values, reduction, batch=None):
    """Reduce elementwise loss values in float64, with torch's empty-tensor results.

    ``'none'`` returns ``values``; ``'sum'`` returns ``sum(values)`` (0 when empty); ``'mean'``
    returns ``sum(values) / values.size`` (NaN when empty); ``'batchmean'`` returns
    ``sum(values) / batch``, where ``batch`` defaults to ``values.shape[0]`` (or 1 for a 0-d array).
    Torch divides by the *input's* first dimension, which can differ from the broadcast shape's:
    :func:`loss` passes it. A divisor of 0 gives NaN (``0 / 0``). Returns a float64 scalar, or the
    float64 array for ``'none'``.
    """
    _check_reduction(reduction)
    values = _f64(values)
    if reduction == "none":
        return values
    total = np.sum(values)
    if reduction == "sum":
        return total
    if reduction == "mean":
        count = values.size
    else:
        count = batch if batch is not None else _batch(values)
    with np.errstate(all="ignore"):
        return total / np.float64(count)


def loss(name, *args, **kwargs):
    """Reduced float64 value of loss ``name``: ``loss(name, *arrays, reduction, **options)``.

    The loss's required arrays come first, in torch's order (``input, target`` for most,
    ``input1, input2, target`` for margin_ranking_loss, ``input, target, var`` for
    gaussian_nll_loss), then optionally the reduction (positional or keyword; default the loss's
    own, 'mean' except sigmoid_focal_loss's 'none'). Optional arrays (``weight``, ``pos_weight``)
    and options (``margin``, ``beta``, ...) are keywords.

    ``reduce(elementwise(...), reduction, batch)`` with ``batch = input.shape[0]`` when the first
    array has a dim and 1 otherwise, which is torch's ``'batchmean'`` (``sum / input.size(0)``, or
    the plain sum for a 0-d input). Torch accepts ``'batchmean'`` only for ``kl_div``; this helper
    accepts it for every loss.
    """
    spec, arrays, values, opts = _split(name, args, kwargs, {"reduction": None})
    elementwise = spec.value(**arrays, **opts)
    first = arrays[spec.arrays[0]]
    return reduce(elementwise, values["reduction"], batch=_batch(first))


def _scale(reduction, count, batch):
    """Factor the reduction applies to every element's gradient: 1, ``1/count`` or ``1/batch``."""
    with np.errstate(all="ignore"):
        if reduction == "mean":
            return 1.0 / np.float64(count)
        if reduction == "batchmean":
            return 1.0 / np.float64(batch)
    return np.float64(1.0)


def _sum_to(a, shape):
    """Sum ``a`` over the dimensions that broadcasting added to ``shape`` (torch's sum_to_size).

    The summed dims are moved last and made one contiguous axis, along which NumPy adds
    pairwise (error O(eps log n) of the sum of |terms|); over any other axis it adds row by row,
    O(eps n), which for 10^5 equal terms is 2e-12 of the sum: more than the float64 tests allow
    a kernel whose sums are compensated.
    """
    a = np.asarray(a, dtype=np.float64)
    padded = (1,) * (a.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, size in enumerate(padded) if size == 1 and a.shape[i] != 1)
    if axes:
        kept = tuple(i for i in range(a.ndim) if i not in axes)
        moved = np.ascontiguousarray(a.transpose(kept + axes))
        m = math.prod(a.shape[i] for i in axes)
        a = moved.reshape(moved.shape[:len(kept)] + (m,)).sum(axis=-1)
    return a.reshape(shape)


def grads(name, *args, **kwargs):
    """Float64 gradients of :func:`loss`: ``grads(name, *arrays, reduction, grad_output, **opts)``.

    Arguments as :func:`loss`, with ``grad_output`` after the reduction (positional or keyword,
    default 1). Returns one gradient per array argument given, in order (the required arrays,
    then ``weight`` and ``pos_weight`` when given), each of its argument's shape; None for an
    argument that is not an array (gaussian_nll_loss's float var).

    ``g_a = sum_to(d/da * grad_output * scale, a.shape)`` where ``d/da`` is the elementwise
    partial in the broadcast shape, ``scale`` is 1 for ``'none'``/``'sum'``, ``1/n`` for ``'mean'``
    (n elements of the broadcast shape) and ``1/input.shape[0]`` for ``'batchmean'`` (1 for a 0-d
    input), and ``sum_to`` sums over the broadcast dimensions (to the shape torch views the
    argument as, then back to the argument's own shape). ``grad_output`` is a scalar, or for
    ``'none'`` also an array of the broadcast shape.
    """
    spec, arrays, values, opts = _split(name, args, kwargs,
                                        {"reduction": None, "grad_output": 1.0})
    reduction, grad_output = values["reduction"], values["grad_output"]
    _check_reduction(reduction)
    partials = spec.grads(**arrays, **opts)
    given = [n for n in spec.arrays + spec.optional if arrays[n] is not None]
    shape = spec.value(**arrays, **opts).shape
    upstream = _f64(grad_output)
    if upstream.ndim and (reduction != "none" or upstream.shape != shape):
        expected = f"a scalar or an array of shape {shape}" if reduction == "none" else "a scalar"
        raise ValueError(
            f"grad_output of shape {upstream.shape} for reduction {reduction!r}; "
            f"expected {expected}"
        )
    first = arrays[spec.arrays[0]]
    out = []
    with np.errstate(all="ignore"):
        upstream = upstream * _scale(reduction, math.prod(shape), _batch(first))
        for arg, partial in zip(given, partials):
            if partial is None:
                out.append(None)
                continue
            own = np.shape(arrays[arg])
            viewed = spec.reshape[arg](np.shape(first), own) if arg in spec.reshape else own
            full = np.broadcast_to(partial * upstream, shape)
            out.append(_sum_to(full, viewed).reshape(own))
    return tuple(out)
