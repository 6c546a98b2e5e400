"""Float64 NumPy references for the cupyloss row-wise losses (cross_entropy, nll_loss) and their
gradients.

Every function takes NumPy arrays (float16, bfloat16 from ml_dtypes, float32 or float64 inputs;
int32/int64 class indices), upcasts floats to float64 exactly and computes in float64 with
torch.nn.functional's semantics: the class axis is dim 1 of (N, C, d1, ...) and dim 0 of (C,);
class-index targets have the input's shape without the class axis; probability targets have the
input's shape.  The gradients follow torch autograd's structure, not the kernels': the gradient of
the loss with respect to log_softmax(z), then log_softmax's backward ``g - p * sum(g)``, so they
are an independent derivation of what the kernels compute in closed form.

Beyond torch (Liger-Kernel's options): ``lse_square_scale`` adds ``lse_square_scale * lse**2`` to
the loss of every counted row, and ``softcap > 0`` replaces the logits by
``softcap * tanh(x / softcap)`` first.  An out-of-range class index (outside [0, C), not
ignore_index) gives its row a NaN weight, so a NaN loss and a NaN gradient row: the defined
result of cupyloss, where torch raises.

``tests/test_reference_rowwise.py`` checks this module against torch on the CPU and against finite
differences.  It never imports cupyloss, CuPy or torch.
"""

import numpy as np


def _f64(a):
    return np.asarray(a).astype(np.float64)


def to_rows(x):
    """(C,) -> (1, C); (N, C, d1, ...) -> (N * d1 * ..., C): one row per sample and position."""
    x = np.asarray(x)
    if x.ndim == 1:
        return x[None, :]
    return np.moveaxis(x, 1, -1).reshape(-1, x.shape[1])


def from_rows(rows, shape):
    """The inverse of :func:`to_rows` for an array of the input's shape."""
    if len(shape) == 1:
        return rows.reshape(shape)
    moved = (shape[0], *shape[2:], shape[1])
    return np.moveaxis(rows.reshape(moved), -1, 1)


def batch_shape(shape):
    """The input's shape without the class axis (a reduction='none' loss's shape)."""
    return () if len(shape) == 1 else (shape[0], *shape[2:])


def _capped(x, softcap):
    with np.errstate(all="ignore"):
        return softcap * np.tanh(x / softcap) if softcap else x


def log_softmax(z):
    """Row-wise log_softmax as torch computes it: ``z - max - log(sum(exp(z - max)))``; NaN for a
    row holding NaN or +inf or only -inf."""
    with np.errstate(all="ignore"):
        m = np.max(np.where(np.isnan(z), -np.inf, z), axis=1, keepdims=True)
        shifted = z - m
        lse = np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))
        return shifted - lse, (m + lse)[:, 0]


def _row_weights(y, cols, weight, ignore_index):
    """(w_y per row, counted mask): 0 for ignore_index, NaN out of range."""
    y = np.asarray(y).astype(np.int64).reshape(-1)
    ignored = y == ignore_index
    oor = ~ignored & ((y < 0) | (y >= cols))
    safe = np.where(ignored | oor, 0, y)
    w = np.ones(cols) if weight is None else _f64(weight)
    wy = np.where(ignored, 0.0, np.where(oor, np.nan, w[safe]))
    return wy, ~ignored, safe


def _reduce(per_row, shape, reduction, divisor):
    if reduction == "none":
        return per_row.reshape(batch_shape(shape))
    total = np.sum(per_row)
    if reduction == "sum":
        return np.float64(total)
    with np.errstate(all="ignore"):
        return np.float64(total / divisor)


def _terms(input, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap,
           nll):
    """Per-row loss, d loss_r / d logp (rows), the 'mean' divisor and what the gradient needs."""
    x = to_rows(_f64(input))
    cols = x.shape[1]
    eps = float(label_smoothing)
    w = np.ones(cols) if weight is None else _f64(weight)
    prob = np.issubdtype(np.asarray(target).dtype, np.floating)
    if nll:
        logp, lse, z = x, None, x
    else:
        z = _capped(x, softcap)
        logp, lse = log_softmax(z)
    with np.errstate(all="ignore"):
        if prob:
            t = to_rows(_f64(target)) * (1 - eps) + eps / cols
            g_logp = -(w * t)
            loss = np.sum(g_logp * logp, axis=1)
            counted = np.ones(len(x), bool)
            divisor = float(len(x))
        else:
            wy, counted, y = _row_weights(target, cols, weight, ignore_index)
            rows = np.arange(len(x))
            # As torch: the nll term at y alone, the smoothing term over every class (so a zero
            # weight times a -inf log-probability is NaN there, as in torch).
            loss = -wy * logp[rows, y]
            if eps:
                loss = (1 - eps) * loss + (eps / cols) * -np.sum(w * logp, axis=1)
            loss = np.where(counted, loss, 0.0)
            g_logp = np.zeros_like(x)
            g_logp[rows, y] = -(1 - eps) * wy
            if eps:
                g_logp -= (eps / cols) * w
            g_logp = np.where(counted[:, None], g_logp, 0.0)
            # The NaN weight of an out-of-range row spreads to its whole gradient row.
            g_logp = np.where(np.isnan(wy)[:, None], np.nan, g_logp)
            divisor = np.sum(wy[counted])
        if lse_square_scale and not nll:
            loss = loss + np.where(counted, lse_square_scale * lse**2, 0.0)
    return loss, g_logp, logp, lse, z, counted, divisor, prob, x


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0):
    """torch.nn.functional.cross_entropy in float64, with lse_square_scale and softcap.

    Per row: ``-sum_c g_c log_softmax(z)_c + lse_square_scale * lse**2`` with
    ``g = (1 - eps) w_y onehot(y) + (eps / C) w`` (class index, 0 on ignored rows) or
    ``g = w ((1 - eps) t + eps / C)`` (probabilities).  'mean' divides by the summed w_y of
    counted rows (indices) or by the number of rows (probabilities).
    """
    loss, _, _, _, _, _, divisor, _, _ = _terms(input, target, weight, ignore_index,
                                                label_smoothing, lse_square_scale, softcap,
                                                nll=False)
    return _reduce(loss, np.shape(input), reduction, divisor)


def nll_loss(input, target, weight=None, ignore_index=-100, reduction="mean"):
    """torch.nn.functional.nll_loss in float64: ``-w_y input[y]`` per row, 0 on ignored rows."""
    loss, _, _, _, _, _, divisor, _, _ = _terms(input, target, weight, ignore_index, 0.0, 0.0,
                                                0.0, nll=True)
    return _reduce(loss, np.shape(input), reduction, divisor)


def lse(input, softcap=0.0):
    """Per-row logsumexp of the (capped) logits, in the shape of a reduction='none' loss."""
    x = to_rows(_f64(input))
    return log_softmax(_capped(x, softcap))[1].reshape(batch_shape(np.shape(input)))


def _upstream(grad_output, shape, reduction, divisor, n_rows):
    go = _f64(grad_output)
    if reduction == "none":
        return np.broadcast_to(go, batch_shape(shape)).reshape(n_rows)
    with np.errstate(all="ignore"):
        scale = go / divisor if reduction == "mean" else go
    return np.full(n_rows, scale)


def cross_entropy_grads(input, target, weight=None, ignore_index=-100, reduction="mean",
                        label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0,
                        grad_output=1.0):
    """(d/dinput, d/dtarget or None) of :func:`cross_entropy` times grad_output, float64.

    Through log_softmax: ``dz = gl - p sum(gl)`` with gl the gradient of the loss with respect to
    log_softmax(z) (ignored rows: 0), plus ``2 lse_square_scale lse p`` on counted rows, times
    ``1 - (z / softcap)**2`` with a softcap.  Probability targets get
    ``d/dt_c = -(1 - eps) w_c log_softmax(z)_c``.
    """
    _, g_logp, logp, lse_r, z, counted, divisor, prob, x = _terms(
        input, target, weight, ignore_index, label_smoothing, lse_square_scale, softcap,
        nll=False)
    shape = np.shape(input)
    g = _upstream(grad_output, shape, reduction, divisor, len(x))[:, None]
    with np.errstate(all="ignore"):
        p = np.exp(logp)
        dz = g_logp - p * np.sum(g_logp, axis=1, keepdims=True)
        if lse_square_scale:
            dz = dz + 2 * lse_square_scale * lse_r[:, None] * p
        if softcap:
            dz = dz * (1 - (z / softcap) ** 2)
        # Ignored rows get 0 whatever g is (also when an all-ignored 'mean' makes g infinite).
        dz = np.where(counted[:, None], dz * g, 0.0)
        gt = None
        if prob:
            w = np.ones(x.shape[1]) if weight is None else _f64(weight)
            gt = from_rows(-(1 - label_smoothing) * w * logp * g, shape)
    return from_rows(dz, shape), gt


def nll_loss_grads(input, target, weight=None, ignore_index=-100, reduction="mean",
                   grad_output=1.0):
    """d/dinput of :func:`nll_loss` times grad_output: ``-w_y g`` at y, 0 elsewhere, 0 on ignored
    rows, NaN on an out-of-range row."""
    x = to_rows(_f64(input))
    wy, counted, y = _row_weights(target, x.shape[1], weight, ignore_index)
    divisor = np.sum(wy[counted])
    g = _upstream(grad_output, np.shape(input), reduction, divisor, len(x))
    dx = np.zeros_like(x)
    rows = np.arange(len(x))
    with np.errstate(all="ignore"):
        dx[rows, y] = np.where(counted, -wy * g, 0.0)
    dx[np.isnan(wy) & counted] = np.nan
    return from_rows(dx, np.shape(input))
