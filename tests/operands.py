"""Operands of every registered loss inside its smooth domain, and the float64 references of every
family behind one call, for the adapters' tests (torch and JAX, CPU and GPU).

Finite differences in float64 (torch.autograd.gradcheck's eps is 1e-6) see a loss's derivative
only where the loss is smooth, so every kink, clamp and branch point is kept at least 0.1 away:
hinge-like losses have ``margin - x t`` of magnitude >= 0.1, l1/smooth_l1/huber have
``|x - t|`` >= 0.1 away from 0 and from beta/delta (1), binary_cross_entropy's input lies in
[0.05, 0.95] (its log clamp at -100 is never reached), probability targets lie in [0, 1],
poisson targets are counts, gaussian variances lie in [0.5, 2] (far above eps).  Class-index
targets are int64.
"""

import numpy as np

import reference
import reference_ctc
import reference_rowwise
from cupyloss._core.registry import all_losses

SPECS = all_losses()

# Arrays that only pick a branch of their loss: finite differences of them see a jump, not a
# slope (hinge_embedding_loss compares its +-1 target with 1 and -1), or that are integers.
SELECTORS = {"ctc_loss": ("targets", "input_lengths", "target_lengths"),
             "hinge_embedding_loss": ("target",), "cross_entropy": ("target",),
             "nll_loss": ("target",), "multi_margin_loss": ("target",),
             "multilabel_margin_loss": ("target",),
             "cosine_embedding_loss": ("target",)}
# Losses whose gradient is torch's with respect to the logits of the log_softmax that made their
# input (ctc_loss's, as torch's CTC returns it): finite differences check them through a
# log_softmax of the input (the identity on log-probabilities, so the values are the same).
THROUGH_LOG_SOFTMAX = ("ctc_loss",)
ROWWISE = {"cross_entropy": (reference_rowwise.cross_entropy,
                             reference_rowwise.cross_entropy_grads),
           "nll_loss": (reference_rowwise.nll_loss, reference_rowwise.nll_loss_grads)}
# Row-wise losses along the last axis (the rowclass family), and their optional arrays.
ROWCLASS = {"multi_margin_loss": (reference_rowwise.multi_margin_loss,
                                  reference_rowwise.multi_margin_loss_grads, ("weight",)),
            "multilabel_soft_margin_loss": (reference_rowwise.multilabel_soft_margin_loss,
                                            reference_rowwise.multilabel_soft_margin_loss_grads,
                                            ("weight",)),
            "jsd": (reference_rowwise.jsd, reference_rowwise.jsd_grads, ()),
            "multilabel_margin_loss": (reference_rowwise.multilabel_margin_loss,
                                       reference_rowwise.multilabel_margin_loss_grads, ())}
# Losses of two or three same-shaped arrays along the last axis (the rowpair family), no
# optional arrays.
ROWPAIR = {"triplet_margin_loss": (reference_rowwise.triplet_margin_loss,
                                   reference_rowwise.triplet_margin_loss_grads),
           "cosine_embedding_loss": (reference_rowwise.cosine_embedding_loss,
                                     reference_rowwise.cosine_embedding_loss_grads)}
REFERENCED = {**ROWWISE, **{n: r[:2] for n, r in ROWCLASS.items()}, **ROWPAIR,
              "ctc_loss": (reference_ctc.ctc_loss, reference_ctc.ctc_loss_grads)}
MARGIN = 1.0      # the default margin of hinge_loss, squared_hinge_loss, hinge_embedding_loss


def optional(name) -> tuple:
    """The optional array arguments of a loss (weight, pos_weight), given by keyword."""
    spec = SPECS[name]
    if name in ROWWISE:
        return ("weight",)
    if name in ROWCLASS:
        return ROWCLASS[name][2]
    return tuple(getattr(spec, "optional", ()))


def differentiable(name) -> tuple:
    """A bool per required array: whether finite differences of the loss in it are its gradient
    (a floating array that is not a selector)."""
    return tuple(a not in SELECTORS.get(name, ()) for a in SPECS[name].arrays)


def _either_sign(rng, shape, low=0.1, high=1.0):
    """Magnitudes in [low, high] with random signs."""
    return rng.uniform(low, high, shape) * rng.choice([-1.0, 1.0], shape)


def _labels(rng, shape):
    return rng.choice([-1.0, 1.0], shape)


def _both_branches(rng, shape, kink=1.0):
    """Differences on both sides of |d| == kink, each at least 0.1 from it and from 0."""
    inner = rng.uniform(0.1, kink - 0.1, shape)
    outer = rng.uniform(kink + 0.1, kink + 1.0, shape)
    return np.where(rng.random(shape) < 0.5, inner, outer) * rng.choice([-1.0, 1.0], shape)


def operands(name, shape=(4, 5), target_shape=None, with_optional=False, seed=0):
    """(required arrays in the loss's order, {optional array: values} when with_optional).

    float64 NumPy arrays (int64 class indices).  ``shape`` is the first array's, ``target_shape``
    the target's (it must broadcast to ``shape``; row-wise losses ignore it: class indices have
    the input's shape without the class axis).  Optional arrays have the broadcast shape's last
    dim (pointwise) or the class count (row-wise) and values in [0.5, 2].
    """
    rng = np.random.default_rng(seed)
    ts = shape if target_shape is None else tuple(target_shape)
    out = np.broadcast_shapes(shape, ts)
    normal = rng.standard_normal
    if name == "kl_div":
        a = [np.log(rng.uniform(0.1, 0.9, shape)), rng.uniform(0.1, 0.9, ts)]
    elif name in ("hinge_loss", "squared_hinge_loss"):
        t = rng.uniform(0.5, 1.5, ts) * rng.choice([-1.0, 1.0], ts)
        a = [(MARGIN - _either_sign(rng, shape)) / t, t]      # margin - x t = +-[0.1, 1]
    elif name == "soft_margin_loss":
        a = [normal(shape), _labels(rng, ts)]
    elif name == "l1_loss":
        t = normal(ts)
        a = [t + _either_sign(rng, shape), t]
    elif name in ("smooth_l1_loss", "huber_loss"):
        t = normal(ts)
        a = [t + _both_branches(rng, shape), t]                # beta = delta = 1
    elif name == "binary_cross_entropy":
        t = np.where(rng.random(ts) < 0.3, np.round(rng.random(ts)), rng.random(ts))
        a = [rng.uniform(0.05, 0.95, shape), t]
    elif name in ("binary_cross_entropy_with_logits", "sigmoid_focal_loss"):
        t = np.where(rng.random(ts) < 0.3, np.round(rng.random(ts)), rng.random(ts))
        a = [2.0 * normal(shape), t]
    elif name == "hinge_embedding_loss":
        a = [MARGIN - _either_sign(rng, shape), _labels(rng, ts)]
    elif name == "margin_ranking_loss":
        x1, t = normal(shape), _labels(rng, ts)
        # -t (x1 - x2) + margin (0) = +-[0.1, 1]
        a = [x1, np.broadcast_to(x1 + t * _either_sign(rng, out), out).copy(), t]
    elif name == "poisson_nll_loss":
        a = [0.5 * normal(shape), rng.poisson(3.0, ts).astype(np.float64)]
    elif name == "gaussian_nll_loss":
        a = [normal(shape), normal(ts), rng.uniform(0.5, 2.0, shape)]
    elif name == "multi_margin_loss":
        # margin (1) - x_y + x_c = +-[0.1, 1] for every c != y: no hinge at its kink.
        x = normal(shape)
        y = rng.integers(0, shape[-1], shape[:-1])
        xy = np.take_along_axis(x, y[..., None], -1) if len(shape) > 1 else x[y]
        x = np.where(np.arange(shape[-1]) == (y[..., None] if len(shape) > 1 else y), x,
                     _either_sign(rng, shape) - MARGIN + xy)
        a = [x, y]
    elif name == "multilabel_margin_loss":
        # Targets at 0, the others at -1 +- [0.1, 1]: 1 - x_y + x_c = +-[0.1, 1] for every pair.
        cols = shape[-1]
        y = np.full(shape, -1, np.int64).reshape(-1, cols)
        x = (_either_sign(rng, shape) - 1.0).reshape(-1, cols)
        for r in range(len(y)):
            chosen = rng.permutation(cols)[:rng.integers(1, max(cols - 1, 1) + 1)]
            y[r, :len(chosen)] = chosen
            x[r, chosen] = 0.0
        a = [x.reshape(shape), y.reshape(shape)]
    elif name == "multilabel_soft_margin_loss":
        a = [2.0 * normal(shape), rng.random(shape)]
    elif name in ROWPAIR:
        a = _rowpair_operands(name, rng, shape)
    elif name == "ctc_loss":
        # (T, N, C) = (shape[0] + 4, 2, shape[-1]) log-probabilities; feasible targets of 3 and
        # 2 labels (the second repeating its first: a blank between) in 8 and 6 frames.
        x = normal((shape[0] + 4, 2, shape[-1]))
        labels = rng.integers(1, shape[-1], (2, 3))
        labels[1, 1] = labels[1, 0]
        a = [x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True)), labels,
             np.array([shape[0] + 4, shape[0] + 2]), np.array([3, 2])]
    elif name == "jsd":
        rows = int(np.prod(shape[:-1]))
        a = [np.log(rng.dirichlet(np.ones(shape[-1]), rows)).reshape(shape),
             np.log(rng.dirichlet(np.ones(shape[-1]), rows)).reshape(shape)]
    elif name in ROWWISE:
        x = 2.0 * normal(shape)
        if name == "nll_loss":
            x = x - np.log(np.sum(np.exp(x), axis=1, keepdims=True))   # log_softmax
        rows = (shape[0], *shape[2:]) if len(shape) > 1 else ()
        a = [x, rng.integers(0, shape[1] if len(shape) > 1 else shape[0], rows)]
    else:
        a = [normal(shape), normal(ts)]
    extras = {}
    if with_optional:
        width = shape[1] if name in ROWWISE else shape[-1] if name in ROWCLASS else out[-1]
        extras = {e: rng.uniform(0.5, 2.0, (width,)) for e in optional(name)}
    return tuple(np.asarray(v) for v in a), extras


def _rowpair_operands(name, rng, shape):
    """Rows whose hinge (triplet: margin 1 + d(a, p) - d(a, n); cosine with target -1: cos - 0)
    lies at least 0.1 from its kink: rows are drawn again until every one does."""
    rows = shape[:-1]
    for _ in range(1000):
        if name == "triplet_margin_loss":
            a = rng.standard_normal(shape)
            near = np.where(rng.random(rows + (1,)) < 0.5, 0.2, 2.0)
            arrays = [a, a + 0.5 * rng.standard_normal(shape),
                      a + near * rng.standard_normal(shape)]
            d = [np.linalg.norm(arrays[0] - b + 1e-6, axis=-1) for b in arrays[1:]]
            hinge = 1.0 + d[0] - d[1]
        else:
            # x2 = +-x1 + noise: cos about +-0.9 in any dimension (independent rows would sit
            # within 1 / sqrt(D) of the kink at 0).
            x1 = rng.standard_normal(shape)
            x2 = _either_sign(rng, rows + (1,), 1.0, 1.0) * x1 + 0.5 * rng.standard_normal(shape)
            arrays = [x1, x2, _labels(rng, rows)]
            hinge = np.sum(x1 * x2, -1) / np.sqrt(np.sum(x1 * x1, -1) * np.sum(x2 * x2, -1))
            hinge = np.where(arrays[2] == -1, hinge, 1.0)
        if np.all(np.abs(hinge) >= 0.1):
            return arrays
    raise ValueError(f"no operands of {name} away from its kink for shape {shape}")


def has_gradient(name) -> tuple:
    """A bool per required array: whether the loss gives it a gradient at all (a registry
    entry's `differentiable` names those; class indices, being integers, never have one)."""
    spec = SPECS[name]
    return tuple(a in getattr(spec, "differentiable", spec.arrays) for a in spec.arrays)


def _numeric(options):
    """The core function's options the references take: its host-side checks (check_targets,
    check_var) change no number."""
    return {k: v for k, v in options.items() if k not in ("check_targets", "check_var")}


def ref_loss(name, arrays, reduction, **options):
    """float64 value of any registered loss (options as keywords, optional arrays included)."""
    if name in REFERENCED:
        return np.asarray(REFERENCED[name][0](*arrays, reduction=reduction, **_numeric(options)))
    return np.asarray(reference.loss(name, *arrays, reduction=reduction, **_numeric(options)))


def ref_grads(name, arrays, reduction, grad_output=1.0, **options) -> tuple:
    """float64 gradients of any registered loss: one per required array (None for class indices
    and other arrays without a gradient)."""
    if name in REFERENCED:
        got = REFERENCED[name][1](*arrays, reduction=reduction, grad_output=grad_output,
                               **_numeric(options))
        got = got if isinstance(got, tuple) else (got,)
        return got + (None,) * (len(arrays) - len(got))
    every = reference.grads(name, *arrays, reduction=reduction, grad_output=grad_output,
                            **_numeric(options))
    return tuple(every[:len(SPECS[name].arrays)])


def float32_arguments(name, shape=(4, 5), target_shape=None, seed=0, with_optional=False):
    """(the loss's required arrays, keyword arrays) as float32 NumPy arrays inside each loss's
    smooth region (`operands`); class indices as int32 (JAX's default integer)."""
    arrays, extras = operands(name, shape, target_shape, with_optional, seed)

    def cast(a):
        return a.astype(np.float32 if np.issubdtype(a.dtype, np.floating) else np.int32)

    return tuple(map(cast, arrays)), {k: cast(v) for k, v in extras.items()}


def floating_argnums(args, name=None):
    """Indices of the arrays jax.grad can differentiate (not class indices) and, given the loss's
    name, that the loss gives a gradient (cosine_embedding_loss's target has none)."""
    every = has_gradient(name) if name else (True,) * len(args)
    return tuple(i for i, (a, g) in enumerate(zip(args, every))
                 if np.issubdtype(a.dtype, np.floating) and g)
