"""Hypothesis strategies shared by the cupyloss tests (CPU references and GPU kernels).

Arrays are drawn as a seed for NumPy's ``Generator``, not element by element: hypothesis' own array
strategy is far too slow at the few-hundred-thousand-element sizes the GPU tests need, while a seed
still replays deterministically and shrinks (towards seed 0 and the smallest shape).
"""

import numpy as np
from hypothesis import strategies as st

# Sizes of one dimension, chosen to straddle the widths a GPU kernel tiles by, where off-by-one bugs
# live: 0 (empty) and 1 (broadcast, degenerate rows); 31/32/33 around a 32-lane warp; 127/128/129,
# 255/256/257 and 1023/1024/1025 around common block sizes and the 1024-thread limit; 3, 5 and 7 are
# odd widths that break 2-, 4- and 8-element vector loads. Listed smallest-first so that hypothesis
# shrinks towards 1.
EDGE_SIZES = (1, 2, 3, 5, 7, 0, 31, 32, 33, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025)

# Cap on elements per drawn shape: room for one 257 x 1025 (263,425 elements, past a 256-block grid)
# while one example stays a few milliseconds on a CPU reference.
MAX_ELEMENTS = 300_000

# Ways one pair of shapes broadcasts; broadcast_pairs draws one of them.
BROADCAST_KINDS = (
    "equal",  # no broadcasting
    "target_trailing",  # target is the input's trailing dims: (N, C) with (C,)
    "input_trailing",  # the input is the broadcast one: (C,) with (N, C)
    "target_ones",  # size-1 dims in the target: (N, C) with (N, 1)
    "input_ones",  # size-1 dims in the input: (N, 1) with (N, C)
    "mixed_ones",  # size-1 dims on both sides and fewer dims on one: (N, 1, C) with (M, 1)
    "target_scalar",  # 0-d target
    "input_scalar",  # 0-d input
)


def seeds():
    """Strategy for seeds of ``numpy.random.default_rng``: integers in ``[0, 2**32)``."""
    return st.integers(0, 2**32 - 1)


def _finfo(dtype):
    """``finfo`` for NumPy floats and for ml_dtypes' (bfloat16, ...), which NumPy's rejects."""
    try:
        return np.finfo(dtype)
    except ValueError:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)


@st.composite
def shapes(draw, min_dims=0, max_dims=4, max_elements=MAX_ELEMENTS, sizes=EDGE_SIZES):
    """Strategy for shapes of ``min_dims`` to ``max_dims`` dims, at most ``max_elements`` elements.

    Each dim is drawn from ``sizes`` (default :data:`EDGE_SIZES`, block and warp edges) or, less
    often, any width up to 300, among those that still fit the element budget; 0 and 1 always fit.
    Returns a tuple of ints.
    """
    ndim = draw(st.integers(min_dims, max_dims))
    shape = []
    budget = max_elements
    for _ in range(ndim):
        fitting = [s for s in sizes if s <= budget]
        size = draw(st.one_of(st.sampled_from(fitting), st.integers(0, min(budget, 300))))
        shape.append(size)
        if size:
            budget //= size
    return tuple(shape)


@st.composite
def broadcast_pairs(draw, min_dims=0, max_dims=4, max_elements=MAX_ELEMENTS):
    """Strategy for ``(input_shape, target_shape)`` pairs that broadcast under NumPy's rules.

    A broadcast shape is drawn with :func:`shapes`, then one of :data:`BROADCAST_KINDS` derives the
    two argument shapes from it: equal shapes, one side being the other's trailing dims (row
    broadcast, either side), size-1 dims on either or both sides, or a 0-d side. The broadcast shape
    of the pair is always the drawn one, so it holds at most ``max_elements`` elements.
    """
    out = draw(shapes(min_dims, max_dims, max_elements))
    kind = draw(st.sampled_from(BROADCAST_KINDS))
    ndim = len(out)

    def trailing():
        return out[draw(st.integers(min(1, ndim), ndim)) :]

    def with_ones():
        ones = draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim))
        return tuple(1 if one else size for one, size in zip(ones, out))

    if kind == "equal":
        return out, out
    if kind == "target_trailing":
        return out, trailing()
    if kind == "input_trailing":
        return trailing(), out
    if kind == "target_ones":
        return out, with_ones()
    if kind == "input_ones":
        return with_ones(), out
    if kind == "target_scalar":
        return out, ()
    if kind == "input_scalar":
        return (), out
    # mixed_ones: each dim is full on both sides or 1 on exactly one side; then one side drops its
    # first `drop` dims, and the other keeps those full so that the broadcast shape stays `out`.
    sides = draw(st.lists(st.sampled_from(("both", "input_one", "target_one")),
                          min_size=ndim, max_size=ndim))
    drop = draw(st.integers(0, ndim))
    input_shape = tuple(1 if side == "input_one" else size for side, size in zip(sides, out))
    target_shape = tuple(1 if side == "target_one" else size for side, size in zip(sides, out))
    if draw(st.booleans()):
        return input_shape[drop:], out[:drop] + target_shape[drop:]
    return out[:drop] + input_shape[drop:], target_shape[drop:]


def _cast(values, dtype):
    """Cast float64 ``values`` to ``dtype`` (NumPy or ml_dtypes), keeping an ndarray for 0-d."""
    return np.asarray(values, dtype=np.float64).astype(dtype)


def finite_arrays(shape, dtype=np.float64, low=-4.0, high=4.0):
    """Strategy for arrays of ``shape`` and ``dtype`` uniform in ``[low, high)``, no NaN or inf.

    Drawn from a seed (see the module docstring), then rounded to ``dtype``; the reference must be
    given the rounded array, never the float64 draw.
    """
    return seeds().map(lambda seed: _cast(np.random.default_rng(seed).uniform(low, high, shape),
                                          dtype))


def special_arrays(shape, dtype=np.float64, fraction=0.1, low=-4.0, high=4.0):
    """Strategy for arrays like :func:`finite_arrays` with about ``fraction`` of elements special.

    The special values are NaN, +inf, -inf, +0.0 and -0.0, placed at random, for propagation tests.
    """

    def build(seed):
        rng = np.random.default_rng(seed)
        values = rng.uniform(low, high, shape)
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])
        where = rng.random(shape) < fraction
        return _cast(np.where(where, specials[rng.integers(0, specials.size, shape)], values),
                     dtype)

    return seeds().map(build)


def _log_softmax_rows(seed, shape, logit_scale):
    """Float64 log-probabilities along the last axis from logits uniform in ``±logit_scale``."""
    logits = np.random.default_rng(seed).uniform(-logit_scale, logit_scale, shape)
    if logits.ndim == 0 or logits.size == 0:
        return np.zeros(shape)  # a 0-d "row" is the one-outcome distribution, log 1 = 0
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def probability_rows(shape, dtype=np.float64, max_logit_scale=4.0):
    """Strategy for positive arrays of ``shape`` whose last axis sums to 1 (rounded to ``dtype``).

    Rows are softmaxes of logits uniform in ``±s``, ``s`` drawn in ``[0, max_logit_scale]`` (0
    gives uniform rows); the default keeps every probability of a 1025-wide row at least
    ``e**-8 / 1025``, above float16's smallest subnormal. Values are rounded to ``dtype`` and
    raised to its smallest positive value where they would round to 0, so the rows stay strictly
    positive; they sum to 1 within ``dtype`` rounding.
    A 0-d shape gives ``1.0``.
    """
    scales = st.floats(0.0, max_logit_scale)

    def build(args):
        seed, scale = args
        p = _cast(np.exp(_log_softmax_rows(seed, shape, scale)), dtype)
        return np.asarray(np.maximum(p, _cast(_finfo(dtype).smallest_subnormal, dtype)))

    return st.tuples(seeds(), scales).map(build)


def log_probability_rows(shape, dtype=np.float64, max_logit_scale=4.0):
    """Strategy for log-probabilities along the last axis (``kl_div``'s input) in ``dtype``.

    The float64 log-softmax of logits drawn as in :func:`probability_rows`, so
    ``logsumexp`` over the last axis is 0 within ``dtype`` rounding; a 0-d shape gives ``0.0``.
    """
    scales = st.floats(0.0, max_logit_scale)
    return st.tuples(seeds(), scales).map(
        lambda args: _cast(_log_softmax_rows(args[0], shape, args[1]), dtype))
