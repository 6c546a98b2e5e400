"""Float64 NumPy references for the cupyloss pointwise losses and their gradients.

Every function takes NumPy arrays of any floating dtype (float16, bfloat16 from ml_dtypes,
float32, float64), upcasts them to float64 exactly, broadcasts ``input`` against ``target`` with
NumPy's rules (the same rules torch uses) and computes in float64. The semantics are those of
``torch.nn.functional`` evaluated in float64 on a CPU, including its NaN, inf, tie and zero edge
cases; ``tests/test_reference.py`` checks that against torch and against finite differences.

This module never imports cupyloss, CuPy or torch: it is the independent side of every comparison.
"""

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


# name -> (elementwise value, elementwise gradients); options are passed through as keywords.
_LOSSES = {
    "mse_loss": (mse, mse_grads),
    "kl_div": (kl_div, kl_div_grads),
    "hinge_loss": (hinge, hinge_grads),
}
LOSS_NAMES = tuple(_LOSSES)


def _loss_functions(name):
    """Return the (value, grads) pair registered for ``name``, raising ValueError if unknown."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {LOSS_NAMES}") from None


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


def loss(name, input, target, reduction="mean", **opts):
    """Reduced float64 value of loss ``name`` (``'mse_loss'``, ``'kl_div'`` or ``'hinge_loss'``).

    ``reduce(elementwise(input, target, **opts), reduction, batch)`` with ``batch =
    input.shape[0]`` when ``input.ndim >= 1`` and 1 otherwise, which is torch's ``'batchmean'``
    (``sum / input.size(0)``, or the plain sum for a 0-d input). Torch accepts ``'batchmean'`` only
    for ``kl_div``; this helper accepts it for every loss. Options: ``log_target``, ``log_input``
    for ``kl_div``; ``margin`` for ``hinge_loss``.
    """
    value_fn, _ = _loss_functions(name)
    return reduce(value_fn(input, target, **opts), reduction, batch=_batch(input))


def _scale(reduction, count, batch):
    """Factor the reduction applies to every element's gradient: 1, ``1/count`` or ``1/batch``."""
    with np.errstate(all="ignore"):
        if reduction == "mean":
            return 1.0 / np.float64(count)
        if reduction == "batchmean":
            return 1.0 / np.float64(batch)
    return np.float64(1.0)


def _sum_to(a, shape):
    """Sum ``a`` over the dimensions that broadcasting added to ``shape`` (torch's sum_to_size)."""
    lead = a.ndim - len(shape)
    if lead:
        a = a.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, size in enumerate(shape) if size == 1 and a.shape[i] != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return np.asarray(a, dtype=np.float64).reshape(shape)


def grads(name, input, target, reduction="mean", grad_output=1.0, **opts):
    """Float64 gradients of :func:`loss` with respect to ``input`` and ``target``.

    ``g_input = sum_to(d/dinput * grad_output * scale, input.shape)`` and likewise for the target,
    where ``d/dinput``, ``d/dtarget`` are the elementwise gradients in the broadcast shape,
    ``scale`` is 1 for ``'none'``/``'sum'``, ``1/n`` for ``'mean'`` (n elements of the broadcast
    shape) and ``1/input.shape[0]`` for ``'batchmean'`` (1 for a 0-d input), and ``sum_to`` sums
    over the broadcast dimensions. ``grad_output`` is a scalar, or for ``'none'`` also an array of
    the broadcast shape. Returns ``(g_input, g_target)`` with shapes ``input.shape`` and
    ``target.shape``.
    """
    _check_reduction(reduction)
    _, grads_fn = _loss_functions(name)
    g_input, g_target = grads_fn(input, target, **opts)
    shape = g_input.shape
    upstream = _f64(grad_output)
    if upstream.ndim and (reduction != "none" or upstream.shape != shape):
        expected = f"a scalar or an array of shape {shape}" if reduction == "none" else "a scalar"
        raise ValueError(
            f"grad_output of shape {upstream.shape} for reduction {reduction!r}; "
            f"expected {expected}"
        )
    with np.errstate(all="ignore"):
        upstream = upstream * _scale(reduction, g_input.size, _batch(input))
        return (
            _sum_to(g_input * upstream, np.shape(input)),
            _sum_to(g_target * upstream, np.shape(target)),
        )
