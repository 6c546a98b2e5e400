"""Float64 NumPy references for the cupyloss row-wise losses and their gradients: cross_entropy
and nll_loss along a class axis; triplet_margin_loss, cosine_embedding_loss, multi_margin_loss,
multilabel_soft_margin_loss and Liger-Kernel's generalised JSD along the last axis (at the end).

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


def _items(reduction, divisor, num_items):
    """(reduction, divisor) with num_items, which divides the sum for 'mean' and 'sum' alike."""
    if num_items is None:
        return reduction, divisor
    return "mean", float(_f64(num_items))


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0, num_items=None):
    """torch.nn.functional.cross_entropy in float64, with lse_square_scale and softcap.

    Per row: ``-sum_c g_c log_softmax(z)_c + lse_square_scale * lse**2`` with
    ``g = (1 - eps) w_y onehot(y) + (eps / C) w`` (class index, 0 on ignored rows) or
    ``g = w ((1 - eps) t + eps / C)`` (probabilities).  'mean' divides by the summed w_y of
    counted rows (indices) or by the number of rows (probabilities).
    """
    loss, _, _, _, _, _, divisor, _, _ = _terms(input, target, weight, ignore_index,
                                                label_smoothing, lse_square_scale, softcap,
                                                nll=False)
    return _reduce(loss, np.shape(input), *_items(reduction, divisor, num_items))


def nll_loss(input, target, weight=None, ignore_index=-100, reduction="mean", num_items=None):
    """torch.nn.functional.nll_loss in float64: ``-w_y input[y]`` per row, 0 on ignored rows."""
    loss, _, _, _, _, _, divisor, _, _ = _terms(input, target, weight, ignore_index, 0.0, 0.0,
                                                0.0, nll=True)
    return _reduce(loss, np.shape(input), *_items(reduction, divisor, num_items))


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
                        grad_output=1.0, num_items=None):
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
    g = _upstream(grad_output, shape, *_items(reduction, divisor, num_items), len(x))[:, None]
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
                   grad_output=1.0, num_items=None):
    """d/dinput of :func:`nll_loss` times grad_output: ``-w_y g`` at y, 0 elsewhere, 0 on ignored
    rows, NaN on an out-of-range row."""
    x = to_rows(_f64(input))
    wy, counted, y = _row_weights(target, x.shape[1], weight, ignore_index)
    divisor = np.sum(wy[counted])
    g = _upstream(grad_output, np.shape(input), *_items(reduction, divisor, num_items), len(x))
    dx = np.zeros_like(x)
    rows = np.arange(len(x))
    with np.errstate(all="ignore"):
        dx[rows, y] = np.where(counted, -wy * g, 0.0)
    dx[np.isnan(wy) & counted] = np.nan
    return from_rows(dx, np.shape(input))


# --- pairwise and margin losses along the last axis -------------------------------------------
# Rows are the last axis of (N, D) inputs (or one (D,) row); the loss has shape (N,) (or ()).

def _reduce_rows(loss, reduction):
    if reduction == "none":
        return loss
    return np.float64(np.sum(loss) if reduction == "sum" else np.mean(loss))


def _row_scale(grad_output, loss_shape, reduction):
    """Per-row upstream gradient: grad_output (elementwise for 'none'), over N for 'mean'."""
    go = _f64(grad_output)
    if reduction == "none":
        return np.broadcast_to(go, loss_shape)[..., None]
    n = max(int(np.prod(loss_shape, dtype=np.int64)), 1) if reduction == "mean" else 1
    return np.broadcast_to(go / n, loss_shape)[..., None]


def _pnorm_grad(v, p):
    """(||v||_p over the last axis, d||v||_p / dv), with torch's norm backward where the norm is
    0 (a zero gradient) and where an element is 0 (sign 0)."""
    with np.errstate(all="ignore"):
        if p == 1:
            return np.sum(np.abs(v), axis=-1), np.sign(v)
        if p == 2:
            norm = np.sqrt(np.sum(v * v, axis=-1))
        else:
            norm = np.sum(np.abs(v) ** p, axis=-1) ** (1.0 / p)
        phi = np.where(v == 0, 0.0, np.sign(v) * np.abs(v) ** (p - 1))
        scale = np.where(norm == 0, 0.0, norm ** (1.0 - p))
        return norm, phi * scale[..., None]


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False,
                        reduction="mean"):
    """torch.nn.functional.triplet_margin_loss: ``max(d(a, p) - d(a, n) + margin, 0)`` per row with
    ``d(x, y) = ||x - y + eps||_p``; with swap, d(a, n) is ``min(d(a, n), d(p, n))``."""
    a, pos, neg = _f64(anchor), _f64(positive), _f64(negative)
    d_ap, _ = _pnorm_grad(a - pos + eps, p)
    d_an, _ = _pnorm_grad(a - neg + eps, p)
    if swap:
        d_an = np.minimum(d_an, _pnorm_grad(pos - neg + eps, p)[0])
    return _reduce_rows(np.maximum(margin + d_ap - d_an, 0.0), reduction)


def triplet_margin_loss_grads(anchor, positive, negative, margin=1.0, p=2, eps=1e-6,
                              swap=False, reduction="mean", grad_output=1.0):
    """(d/danchor, d/dpositive, d/dnegative) of :func:`triplet_margin_loss` times grad_output.

    Where the hinge is active (``margin + d(a, p) - d(a, n) >= 0``, torch's clamp_min passes the
    tie): ``d/da = g_ap - g_an``, ``d/dp = -g_ap``, ``d/dn = g_an`` with g_xy the gradient of the
    p-norm of its difference; with swap and d(p, n) the smaller, the negative term moves to
    (p, n) (a tie splits it evenly, as torch's minimum does).
    """
    a, pos, neg = _f64(anchor), _f64(positive), _f64(negative)
    d_ap, g_ap = _pnorm_grad(a - pos + eps, p)
    d_an, g_an = _pnorm_grad(a - neg + eps, p)
    w_an = np.ones_like(d_an)
    g_pn = np.zeros_like(a)
    w_pn = np.zeros_like(d_an)
    if swap:
        d_pn, g_pn = _pnorm_grad(pos - neg + eps, p)
        w_an = np.where(d_an < d_pn, 1.0, np.where(d_an == d_pn, 0.5, 0.0))
        w_pn = 1.0 - w_an
        d_an = np.minimum(d_an, d_pn)
    active = (margin + d_ap - d_an >= 0).astype(np.float64)
    g = _row_scale(grad_output, np.shape(d_ap), reduction) * active[..., None]
    ga = g * (g_ap - w_an[..., None] * g_an)
    gp = g * (-g_ap - w_pn[..., None] * g_pn)
    gn = g * (w_an[..., None] * g_an + w_pn[..., None] * g_pn)
    return ga, gp, gn


_COS_EPS = 1e-12  # torch's EPSILON in cosine_embedding_loss


def cosine_embedding_loss(input1, input2, target, margin=0.0, reduction="mean"):
    """torch.nn.functional.cosine_embedding_loss: ``1 - cos`` where target is 1,
    ``max(0, cos - margin)`` where it is -1, 0 elsewhere, with
    ``cos = x1.x2 / sqrt((|x1|^2 + 1e-12) (|x2|^2 + 1e-12))`` per row."""
    x1, x2, y = _f64(input1), _f64(input2), _f64(target)
    m1 = np.sum(x1 * x1, axis=-1) + _COS_EPS
    m2 = np.sum(x2 * x2, axis=-1) + _COS_EPS
    cos = np.sum(x1 * x2, axis=-1) / np.sqrt(m1 * m2)
    loss = np.where(y == 1, 1 - cos, 0.0) + np.where(y == -1, np.maximum(cos - margin, 0.0), 0.0)
    return _reduce_rows(loss, reduction)


def cosine_embedding_loss_grads(input1, input2, target, margin=0.0, reduction="mean",
                                grad_output=1.0):
    """(d/dinput1, d/dinput2): ``dcos/dx1 = x2 / sqrt(m1 m2) - cos x1 / m1`` (and symmetric),
    times -1 where target is 1 and times [cos - margin >= 0] where it is -1."""
    x1, x2, y = _f64(input1), _f64(input2), _f64(target)
    m1 = np.sum(x1 * x1, axis=-1) + _COS_EPS
    m2 = np.sum(x2 * x2, axis=-1) + _COS_EPS
    root = np.sqrt(m1 * m2)
    cos = np.sum(x1 * x2, axis=-1) / root
    coef = np.where(y == 1, -1.0, 0.0) + np.where((y == -1) & (cos - margin >= 0), 1.0, 0.0)
    g = _row_scale(grad_output, np.shape(cos), reduction) * coef[..., None]
    g1 = g * (x2 / root[..., None] - cos[..., None] * x1 / m1[..., None])
    g2 = g * (x1 / root[..., None] - cos[..., None] * x2 / m2[..., None])
    return g1, g2


def _margin_rows(input, target, weight):
    """(x rows, y with out-of-range indices at 0, w_y with NaN out of range) of multi_margin."""
    x = np.atleast_2d(_f64(input))
    y = np.atleast_1d(np.asarray(target)).astype(np.int64).reshape(-1)
    cols = x.shape[-1]
    oor = (y < 0) | (y >= cols)
    safe = np.where(oor, 0, y)
    w = np.ones(cols) if weight is None else _f64(weight)
    return x, safe, np.where(oor, np.nan, w[safe])


def multi_margin_loss(input, target, p=1, margin=1.0, weight=None, reduction="mean"):
    """torch.nn.functional.multi_margin_loss: per row
    ``sum_{c != y} w_y max(0, margin - x_y + x_c)^p / C`` (p is 1 or 2); an out-of-range index
    gives its row a NaN loss (cupyloss's defined result; torch raises)."""
    x, y, wy = _margin_rows(input, target, weight)
    rows = np.arange(len(y))
    cols = x.shape[-1]
    z = margin - x[rows, y][:, None] + x
    h = np.where(z > 0, z if p == 1 else z * z, 0.0)
    h[rows, y] = 0.0
    loss = wy * np.sum(h, axis=-1) / cols
    with np.errstate(all="ignore"):
        return _reduce_rows(loss.reshape(np.shape(target)), reduction)


def multi_margin_loss_grads(input, target, p=1, margin=1.0, weight=None, reduction="mean",
                            grad_output=1.0):
    """d/dinput of :func:`multi_margin_loss`: ``w_y (p == 1 ? 1 : 2 z_c) / C`` at each c != y with
    z_c > 0 (torch's strict test), minus their sum at y; a NaN row for an out-of-range index."""
    x, y, wy = _margin_rows(input, target, weight)
    rows = np.arange(len(y))
    cols = x.shape[-1]
    z = margin - x[rows, y][:, None] + x
    d = np.where(z > 0, 1.0 if p == 1 else 2 * z, 0.0) * (wy / cols)[:, None]
    d[rows, y] = 0.0
    d[rows, y] = -np.sum(d, axis=-1)
    g = _row_scale(grad_output, np.shape(target), reduction).reshape(-1, 1)
    return (g * d).reshape(np.shape(input))


def _margin_rows_of(input, target):
    """(x rows, [(row, its targets before the first -1, the classes outside them, or None for a
    row with an index outside [-1, C))]) of multilabel_margin_loss."""
    x = _f64(input).reshape(-1, np.shape(input)[-1] if np.ndim(input) else 1)
    y = np.asarray(target).astype(np.int64).reshape(x.shape)
    cols = x.shape[-1]
    rows = []
    for r, row in enumerate(y):
        if not np.all((row >= -1) & (row < cols)):
            rows.append((r, None, None))
            continue
        ends = np.nonzero(row < 0)[0]
        ys = row[:ends[0] if len(ends) else cols]
        rows.append((r, ys, np.setdiff1d(np.arange(cols), ys)))
    return x, rows


def multilabel_margin_loss(input, target, reduction="mean"):
    """torch.nn.functional.multilabel_margin_loss: per row
    ``sum_{j < L} sum_{c not in S} max(0, 1 - x_{y_j} + x_c) / C`` over the targets y_0 ..
    y_{L-1} before the first -1 (S their set); a row with an index outside [-1, C) is NaN
    (cupyloss's defined result; torch raises); 'mean' over no rows is 0, as torch."""
    x, rows = _margin_rows_of(input, target)
    loss = np.zeros(len(x))
    for r, ys, others in rows:
        loss[r] = np.nan if ys is None else sum(
            np.sum(np.maximum(0.0, 1.0 - x[r, y] + x[r, others])) for y in ys)
    loss /= x.shape[-1]
    shape = np.shape(input)[:-1]
    if reduction == "none":
        return loss.reshape(shape)
    if len(loss) == 0:
        return np.float64(0.0)
    return np.float64(np.sum(loss) if reduction == "sum" else np.mean(loss))


def multilabel_margin_loss_grads(input, target, reduction="mean", grad_output=1.0):
    """d/dinput of :func:`multilabel_margin_loss`: ``#{j : z_jc > 0} / C`` at each c outside S,
    minus ``#{c not in S : z_jc > 0} / C`` at y_j for each j (torch's strict test); a NaN row for
    an out-of-range index."""
    x, rows = _margin_rows_of(input, target)
    d = np.zeros_like(x)
    for r, ys, others in rows:
        if ys is None:
            d[r] = np.nan
        for y in () if ys is None else ys:
            on = (1.0 - x[r, y] + x[r, others]) > 0
            d[r, others] += on
            d[r, y] -= np.sum(on)
    d /= x.shape[-1]
    g = _row_scale(grad_output, np.shape(input)[:-1], reduction).reshape(-1, 1)
    return (g * d).reshape(np.shape(input))


def _log_sigmoid(v):
    with np.errstate(all="ignore"):
        return np.minimum(v, 0) - np.log1p(np.exp(-np.abs(v)))


def multilabel_soft_margin_loss(input, target, weight=None, reduction="mean"):
    """torch.nn.functional.multilabel_soft_margin_loss: per row
    ``-sum_c w_c (y_c log sigmoid(x_c) + (1 - y_c) log sigmoid(-x_c)) / C``."""
    x, t = _f64(input), _f64(target)
    w = 1.0 if weight is None else _f64(weight)
    terms = -(t * _log_sigmoid(x) + (1 - t) * _log_sigmoid(-x)) * w
    return _reduce_rows(np.sum(terms, axis=-1) / x.shape[-1], reduction)


def multilabel_soft_margin_loss_grads(input, target, weight=None, reduction="mean",
                                      grad_output=1.0):
    """(d/dinput, d/dtarget): ``w_c (sigmoid(x_c) - y_c) / C`` and ``-w_c x_c / C``."""
    x, t = _f64(input), _f64(target)
    w = 1.0 if weight is None else _f64(weight)
    g = _row_scale(grad_output, x.shape[:-1], reduction) * w / x.shape[-1]
    with np.errstate(all="ignore"):
        sig = np.exp(_log_sigmoid(x))
    return g * (sig - t), g * -x


def _jsd_counted(x, shift_labels, ignore_index):
    return (np.ones(len(x), bool) if shift_labels is None
            else np.atleast_1d(np.asarray(shift_labels)).reshape(-1) != ignore_index)


def jsd(input, target, beta=0.5, shift_labels=None, ignore_index=-100, reduction="mean"):
    """Liger-Kernel's generalised Jensen-Shannon divergence of log-probability rows (last axis).

    With Q = exp(input) (the student), P = exp(target) (the teacher) and M = beta P + (1 - beta) Q:
    ``beta KL(P || M) + (1 - beta) KL(Q || M)`` per row, 0 on rows whose shift_labels entry is
    ignore_index; beta = 0 is KL(P || Q) and beta = 1 is KL(Q || P).  'mean' (Liger's) sums the
    counted rows over their count, 0 when none counts (Liger's kernel never divides then);
    'sum' adds them; 'none' gives the loss per row (input.shape[:-1]).
    """
    shape = np.shape(input)
    x = _f64(input).reshape(-1, shape[-1])
    y = _f64(target).reshape(-1, shape[-1])
    counted = _jsd_counted(x, shift_labels, ignore_index)
    with np.errstate(all="ignore"):
        q, p = np.exp(x), np.exp(y)
        if beta == 0:
            terms = p * (y - x)
        elif beta == 1:
            terms = q * (x - y)
        else:
            m = beta * p + (1 - beta) * q
            terms = beta * p * y + (1 - beta) * q * x - m * np.log(m)
        per_row = np.where(counted, np.sum(terms, axis=-1), 0.0)
    if reduction == "none":
        return per_row.reshape(shape[:-1])
    total = np.sum(per_row)
    if reduction == "sum":
        return np.float64(total)
    n = np.sum(counted)
    return np.float64(total / n if n else 0.0)


def jsd_grads(input, target, beta=0.5, shift_labels=None, ignore_index=-100, reduction="mean",
              grad_output=1.0):
    """(d/dinput, d/dtarget) of :func:`jsd` times grad_output: ``d/dx = (1 - beta) Q (x - log M)``
    and ``d/dy = beta P (y - log M)`` (beta = 0: ``-P`` and ``P (y - x + 1)``; beta = 1:
    ``Q (x - y + 1)`` and ``-Q``), 0 on ignored rows."""
    shape = np.shape(input)
    x = _f64(input).reshape(-1, shape[-1])
    y = _f64(target).reshape(-1, shape[-1])
    counted = _jsd_counted(x, shift_labels, ignore_index)
    with np.errstate(all="ignore"):
        q, p = np.exp(x), np.exp(y)
        if beta == 0:
            gx, gy = -p, p * (y - x + 1)
        elif beta == 1:
            gx, gy = q * (x - y + 1), -q
        else:
            log_m = np.log(beta * p + (1 - beta) * q)
            gx, gy = (1 - beta) * q * (x - log_m), beta * p * (y - log_m)
        go = _f64(grad_output)
        if reduction == "none":
            scale = np.broadcast_to(go, shape[:-1]).reshape(-1, 1)
        elif reduction == "sum":
            scale = go
        else:
            n = np.sum(counted)
            scale = go / n if n else go * 0.0
        mask = counted[:, None]
        return (np.where(mask, gx * scale, 0.0).reshape(shape),
                np.where(mask, gy * scale, 0.0).reshape(shape))


# --- per-token log-probabilities and entropy of the fused head -----------------------------------

def log_probs(z, target, temperature=1.0, ignore_index=-100):
    """(logp, entropy, log_softmax) of softmax(z / T) per row of logits z (N, V), float64:
    logp 0 where the target is ignore_index, the entropy of every row."""
    z = _f64(z) / temperature
    m = z.max(axis=1, keepdims=True)
    logp_all = z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))
    t = np.asarray(target)
    counted = t != ignore_index
    rows = np.arange(len(t))
    logp = np.where(counted, logp_all[rows, np.where(counted, t, 0)], 0.0)
    ent = -(np.exp(logp_all) * logp_all).sum(axis=1)
    return logp, ent, logp_all


def log_probs_logits_grad(z, target, temperature=1.0, g=None, e=None, ignore_index=-100):
    """d/dz of sum_i g_i logp_i + e_i H_i (log_probs'), float64: (g (onehot - p) - e p (log p +
    H)) / T, g taken as 0 on ignored rows; g, e None for 0, a number, or (N,)."""
    _, ent, logp_all = log_probs(z, target, temperature, ignore_index)
    t = np.asarray(target)
    n = len(t)
    g = np.zeros(n) if g is None else np.broadcast_to(_f64(g), (n,))
    e = np.zeros(n) if e is None else np.broadcast_to(_f64(e), (n,))
    counted = t != ignore_index
    p = np.exp(logp_all)
    onehot = np.zeros_like(p)
    onehot[np.arange(n), np.where(counted, t, 0)] = 1.0
    dz = np.where(counted, g, 0.0)[:, None] * (onehot - p) \
        - e[:, None] * p * (logp_all + ent[:, None])
    return dz / temperature
