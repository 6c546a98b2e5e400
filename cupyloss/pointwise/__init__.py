"""Pointwise losses with torch.nn.functional's names, arguments and semantics.

Each loss ``f`` comes as ``f(input, target, ...)``, ``f_backward(grad_output, input, target,
...)`` and ``f_value_and_grad(input, target, ..., grad_output=1.0, wrt=...)``; a loss with other
array arguments takes them where torch does (``margin_ranking_loss(input1, input2, target)``,
``gaussian_nll_loss(input, target, var)``, ``binary_cross_entropy(input, target, weight=None)``).

Common rules:
  * The array arguments are GPU arrays of one framework, one dtype (float16, bfloat16, float32
    or float64) and one device: cupy.ndarrays, torch CUDA tensors (requires_grad or not), JAX
    GPU arrays, or anything else with a CUDA __dlpack__.  They are read in place (no copy), of
    any shapes that broadcast together (NumPy/torch rules, each broadcast on its own without
    being materialised), contiguous or not (negative and zero strides included), empty or 0-d.
    Results come back in the caller's framework: torch tensors from torch's caching allocator
    on torch's current stream, cupy.ndarrays from CuPy's pool on CuPy's current stream, JAX
    arrays for JAX inputs (cupy.ndarrays for other DLPack producers).
  * reduction: 'none' returns the elementwise loss in the broadcast shape; 'sum' and 'mean' a
    0-d array ('mean' of an empty tensor is NaN, 'sum' is 0); kl_div also takes 'batchmean',
    the sum divided by input.shape[0] (by 1 for 0-d input).  The result has the inputs' dtype;
    16-bit inputs are accumulated in float32.
  * grad_output: a Python number, a 0-d array of the loss's dtype and the inputs' framework
    (read on the device, never synchronised), or for reduction='none' an array of the loss's
    shape.
  * wrt selects the gradients by torch's argument names: by default every array argument
    given, as a tuple in argument order (``(g_input, g_target)`` for most losses, with
    ``g_weight`` after them when a weight is given); a name such as ``"input"`` returns that
    gradient alone, and a one-name tuple a one-element tuple.  Gradients not named are neither
    computed nor allocated.  Each gradient has its argument's shape and dtype; a broadcast
    argument's gradient is summed over the broadcast dims, deterministically.  An optional
    argument left out (None) has no gradient, nor does a number given where torch takes one.
  * Reductions are deterministic: the same inputs on the same device give bitwise the same
    results on every run.  Nothing is copied back to the host.
  * Where torch insists on equal shapes (binary_cross_entropy and its logits form) or equal
    dims (margin_ranking_loss), cupyloss broadcasts instead; shapes torch accepts give torch's
    results.
"""

from __future__ import annotations

import numbers

from cupyloss._core import docs as _docs
from cupyloss._types import Any, Array, Sequence
from cupyloss._core import validate as _validate
from cupyloss.pointwise._family import SPECS, evaluate

def _value(spec, arrays, reduction, params):
    return evaluate(spec, arrays, reduction=reduction, params=params, want_value=True,
                    want_grads=spec.no_grads)[0]


_PICKS: dict = {}   # (loss, wrt) -> (picked, single, want) of losses whose arrays are all given


def _grads(spec, arrays, reduction, params, grad_output, wrt, want_value):
    names = spec.operands
    if wrt is None and spec.fixed:
        picked, single, want = names, False, spec.all_grads
    elif spec.fixed and (wrt.__class__ is str or wrt.__class__ is tuple):
        try:
            hit = _PICKS.get((spec.name, wrt))
        except TypeError:   # an unhashable name: check_wrt says what is wrong with it
            hit = None
        if hit is None:
            picked, single = _validate.check_wrt(wrt, names, names)
            hit = _PICKS[spec.name, wrt] = (picked, single, tuple(n in picked for n in names))
        picked, single, want = hit
    else:
        given = tuple(n for n, a in zip(names, arrays)
                      if a is not None and a.__class__ is not float)
        if wrt is None:
            picked, single = given, False
        else:
            picked, single = _validate.check_wrt(wrt, names, given)
        want = tuple(n in picked for n in names)
    out = evaluate(spec, arrays, reduction=reduction, params=params, want_value=want_value,
                   want_grads=want, grad_output=grad_output)
    if single:
        grads = out[1 + names.index(picked[0])]
    elif picked is names:
        grads = tuple(out[1:])
    else:
        grads = tuple(out[1 + names.index(n)] for n in picked)
    return (out[0], grads) if want_value else grads


(_MSE, _KL, _HINGE, _L1, _SMOOTH_L1, _HUBER, _BCE, _BCE_LOGITS, _SOFT_MARGIN, _HINGE_EMBEDDING,
 _MARGIN_RANKING, _POISSON, _GAUSSIAN, _SQUARED_HINGE, _FOCAL, _LOG_COSH) = (
    SPECS[name] for name in (
        "mse_loss", "kl_div", "hinge_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "soft_margin_loss",
        "hinge_embedding_loss", "margin_ranking_loss", "poisson_nll_loss", "gaussian_nll_loss",
        "squared_hinge_loss", "sigmoid_focal_loss", "log_cosh_loss"))


# --- mse_loss ---------------------------------------------------------------------------------

def mse_loss(input: Array, target: Array, reduction: str = "mean") -> Array:
    """Mean squared error, as torch.nn.functional.mse_loss.

    ``l_i = (input_i - target_i)^2``, then reduced.

    Args:
      input: GPU array (CuPy, torch, JAX, DLPack) of any shape; float16, bfloat16, float32 or
        float64.
      target: array of the same framework broadcastable with input, same dtype.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d for 'mean'/'sum', the broadcast shape for 'none'; input's dtype.

    Example:
      >>> x = cupy.array([1.0, 2.0, 3.0], dtype=cupy.float32)
      >>> cupyloss.mse_loss(x, cupy.zeros(3, cupy.float32))      # (1 + 4 + 9) / 3
      array(4.6666665, dtype=float32)
    """
    return _value(_MSE, (input, target), reduction, ())


def mse_loss_backward(grad_output: Array | float, input: Array, target: Array,
                      reduction: str = "mean", *, wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of mse_loss: ``d/dinput = 2 (input - target) g``, ``d/dtarget = -d/dinput``.

    ``g`` is grad_output times 1/n for 'mean' (1 otherwise).

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      input, target, reduction: as for mse_loss.
      wrt: which gradients (see the module docstring).

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in, g_t = cupyloss.mse_loss_backward(1.0, x, cupy.zeros(3, cupy.float32))
    """
    return _grads(_MSE, (input, target), reduction, (), grad_output, wrt, False)


def mse_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean", *,
                            grad_output: Array | float = 1.0,
                            wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """mse_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, (g_in, g_t) = cupyloss.mse_loss_value_and_grad(x, y)
      >>> loss, g_in = cupyloss.mse_loss_value_and_grad(x, y, wrt="input")
    """
    return _grads(_MSE, (input, target), reduction, (), grad_output, wrt, True)


# --- kl_div -----------------------------------------------------------------------------------

def kl_div(input: Array, target: Array, reduction: str = "mean", log_target: bool = False,
           log_input: bool = True) -> Array:
    """Kullback-Leibler divergence, as torch.nn.functional.kl_div.

    With x = input (log-probabilities) and t = target:
      log_target=False: ``l = xlogy(t, t) - t x``  (a target of 0 contributes 0)
      log_target=True:  ``l = exp(t) (t - x)``
    log_input=False (a cupyloss extension) takes probabilities p as input and uses x = log p
    inside the kernel, so ``kl_div(p, q, log_input=False)`` equals ``kl_div(log(p), q)`` without
    materialising ``log(p)``.  'batchmean' divides the sum by input.shape[0], as torch's
    KLDivLoss recommends; 'mean' divides by the element count.  In float32 (and for 16-bit
    inputs, which are evaluated in float32) ``log t`` of the ``t log t`` term is computed
    without ``logf``'s lean (its ln 2 is 1.9e-9 too large, so its roundings of neighbouring t
    lean one way): a Newton step on the fast log for t outside (1/4, 4), ``logf`` inside.  A
    sum of millions of such terms then does not drift: at 16384^2 the 'batchmean' loss is within
    the float32 rounding of the float64 truth (8.5e-9 relative, torch 5.2e-8; H100).

    Args:
      input: GPU array, log-probabilities (or probabilities with log_input=False).
      target: array of the same framework broadcastable with input, same dtype; probabilities, or
        log-probabilities with log_target=True.
      reduction: 'none' | 'mean' | 'sum' | 'batchmean'.
      log_target: the target holds log-probabilities.
      log_input: the input holds log-probabilities (the default, torch's); False: probabilities.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> p = cupy.random.rand(4, 10, dtype=cupy.float32); p /= p.sum(-1, keepdims=True)
      >>> q = cupy.random.rand(4, 10, dtype=cupy.float32); q /= q.sum(-1, keepdims=True)
      >>> cupyloss.kl_div(cupy.log(p), q, reduction="batchmean")
      >>> cupyloss.kl_div(p, q, reduction="batchmean", log_input=False)   # same value
    """
    return _value(_KL, (input, target), reduction, (bool(log_target), bool(log_input)))


def kl_div_backward(grad_output: Array | float, input: Array, target: Array,
                    reduction: str = "mean", log_target: bool = False, log_input: bool = True, *,
                    wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of kl_div, equal to torch autograd's.

    log_target=False: ``d/dx = -t g``, ``d/dt = (log t + 1 - x) g``.  At t == 0 torch's xlogy
    backward gives ``0 + 0/0``, so the target gradient is NaN there; cupyloss matches it.
    log_target=True: ``d/dx = -exp(t) g``, ``d/dt = exp(t) (t - x + 1) g``.
    log_input=False: ``d/dp = (d/dx) / p`` and x = log p in d/dt.
    ``g`` is grad_output times 1/n for 'mean', 1/input.shape[0] for 'batchmean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in, g_t = cupyloss.kl_div_backward(1.0, cupy.log(p), q, reduction="batchmean")
    """
    return _grads(_KL, (input, target), reduction, (bool(log_target), bool(log_input)),
                  grad_output, wrt, False)


def kl_div_value_and_grad(input: Array, target: Array, reduction: str = "mean",
                          log_target: bool = False, log_input: bool = True, *,
                          grad_output: Array | float = 1.0, wrt: str | Sequence[str] | None = None
                          ) -> tuple[Array, Any]:
    """kl_div and its gradients from one pass over input and target.


    Example:
      >>> loss, (g_in, g_t) = cupyloss.kl_div_value_and_grad(cupy.log(p), q, "batchmean")
      >>> loss, g_p = cupyloss.kl_div_value_and_grad(p, q, "batchmean", log_input=False,
      ...                                            wrt="input")
    """
    return _grads(_KL, (input, target), reduction, (bool(log_target), bool(log_input)),
                  grad_output, wrt, True)


# --- hinge_loss -------------------------------------------------------------------------------

def hinge_loss(input: Array, target: Array, margin: float = 1.0, reduction: str = "mean") -> Array:
    """Hinge loss ``l = max(0, margin - input * target)``.

    With margin=1 and 'mean' this is ``torch.mean(torch.clamp(1 - input * target, min=0))``.
    A NaN product gives a NaN loss (torch's clamp propagates NaN).

    Args:
      input: GPU array of scores.
      target: array of the same framework broadcastable with input (e.g. labels of shape (C,)
        against input (N, C): target lines up with the last axis, as in torch), same dtype.
      margin: Python float.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> s = cupy.random.randn(8, 5).astype(cupy.float32)
      >>> y = cupy.sign(cupy.random.randn(5)).astype(cupy.float32)
      >>> cupyloss.hinge_loss(s, y)
    """
    return _value(_HINGE, (input, target), reduction, (float(margin),))


def hinge_loss_backward(grad_output: Array | float, input: Array, target: Array,
                        margin: float = 1.0, reduction: str = "mean", *,
                        wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of hinge_loss, as torch autograd gives for clamp(margin - x t, min=0).

    ``d/dx = -t g [margin - x t >= 0]``, ``d/dt = -x g [margin - x t >= 0]``: at the tie
    ``margin == x t`` the gradient passes (torch's clamp does), where the product is NaN it is
    blocked.  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_s, g_y = cupyloss.hinge_loss_backward(1.0, s, y)
    """
    return _grads(_HINGE, (input, target), reduction, (float(margin),),
                  grad_output, wrt, False)


def hinge_loss_value_and_grad(input: Array, target: Array, margin: float = 1.0,
                              reduction: str = "mean", *, grad_output: Array | float = 1.0,
                              wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """hinge_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_s = cupyloss.hinge_loss_value_and_grad(s, y, wrt="input")
    """
    return _grads(_HINGE, (input, target), reduction, (float(margin),),
                  grad_output, wrt, True)


# --- l1_loss ----------------------------------------------------------------------------------

def l1_loss(input: Array, target: Array, reduction: str = "mean") -> Array:
    """Mean absolute error, as torch.nn.functional.l1_loss.

    ``l_i = |input_i - target_i|``, then reduced.

    Args:
      input: GPU array of any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d for 'mean'/'sum', the broadcast shape for 'none'; input's dtype.

    Example:
      >>> x = cupy.array([1.0, -2.0, 3.0], dtype=cupy.float32)
      >>> cupyloss.l1_loss(x, cupy.zeros(3, cupy.float32))      # (1 + 2 + 3) / 3
      array(2., dtype=float32)
    """
    return _value(_L1, (input, target), reduction, ())


def l1_loss_backward(grad_output: Array | float, input: Array, target: Array,
                     reduction: str = "mean", *, wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of l1_loss, as torch autograd gives them.

    ``d/dx = sign(x - t) g = -d/dt``: 0 at the tie ``x == t`` and, as torch's sgn, where
    ``x - t`` is NaN.  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in, g_t = cupyloss.l1_loss_backward(1.0, x, cupy.zeros(3, cupy.float32))
    """
    return _grads(_L1, (input, target), reduction, (), grad_output, wrt, False)


def l1_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean", *,
                           grad_output: Array | float = 1.0, wrt: str | Sequence[str] | None = None
                           ) -> tuple[Array, Any]:
    """l1_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_in = cupyloss.l1_loss_value_and_grad(x, y, wrt="input")
    """
    return _grads(_L1, (input, target), reduction, (), grad_output, wrt, True)


# --- smooth_l1_loss ---------------------------------------------------------------------------

def _beta(beta):
    beta = float(beta)
    if beta < 0:
        raise ValueError("smooth_l1_loss does not support negative values for beta.")
    return (beta,)


def smooth_l1_loss(input: Array, target: Array, reduction: str = "mean", beta: float = 1.0
                   ) -> Array:
    """Smooth L1 loss, as torch.nn.functional.smooth_l1_loss.

    With ``d = input - target`` and ``z = |d|``: ``l = z^2 / (2 beta)`` where ``z < beta`` and
    ``z - beta / 2`` elsewhere; ``beta = 0`` is l1_loss (torch dispatches to it).

    Args:
      input: GPU array of any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype.
      reduction: 'none' | 'mean' | 'sum'.
      beta: Python float >= 0 (ValueError otherwise, with torch's message).

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> x = cupy.random.randn(32768, 32768, dtype=cupy.float32)   # KernelBench problem 96
      >>> y = cupy.random.randn(32768, 32768, dtype=cupy.float32)
      >>> cupyloss.smooth_l1_loss(x, y)
    """
    return _value(_SMOOTH_L1, (input, target), reduction, _beta(beta))


def smooth_l1_loss_backward(grad_output: Array | float, input: Array, target: Array,
                            reduction: str = "mean", beta: float = 1.0, *,
                            wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of smooth_l1_loss, as torch's smooth_l1_loss_backward.

    ``d/dx = -d/dt = g`` times -1 where ``d <= -beta``, 1 where ``d >= beta`` (the ties
    ``|d| == beta`` take the constant) and ``d / beta`` in between (0 at ``d == 0``);
    ``beta = 0`` gives ``sign(d)``.  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in, g_t = cupyloss.smooth_l1_loss_backward(1.0, x, y, beta=0.5)
    """
    return _grads(_SMOOTH_L1, (input, target), reduction, _beta(beta), grad_output, wrt, False)


def smooth_l1_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean",
                                  beta: float = 1.0, *, grad_output: Array | float = 1.0,
                                  wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """smooth_l1_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, (g_in, g_t) = cupyloss.smooth_l1_loss_value_and_grad(x, y)
    """
    return _grads(_SMOOTH_L1, (input, target), reduction, _beta(beta), grad_output, wrt, True)


# --- huber_loss -------------------------------------------------------------------------------

def _delta(delta):
    delta = float(delta)
    if not delta > 0:
        raise ValueError("huber_loss does not support non-positive values for delta.")
    return (delta,)


def huber_loss(input: Array, target: Array, reduction: str = "mean", delta: float = 1.0) -> Array:
    """Huber loss, as torch.nn.functional.huber_loss.

    With ``z = |input - target|``: ``l = z^2 / 2`` where ``z < delta``, ``delta (z - delta / 2)``
    elsewhere (``smooth_l1_loss`` with ``beta = delta``, times delta).

    Args:
      input: GPU array of any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype.
      reduction: 'none' | 'mean' | 'sum'.
      delta: Python float > 0 (ValueError otherwise, with torch's message).

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> cupyloss.huber_loss(x, y, delta=0.5)
    """
    return _value(_HUBER, (input, target), reduction, _delta(delta))


def huber_loss_backward(grad_output: Array | float, input: Array, target: Array,
                        reduction: str = "mean", delta: float = 1.0, *,
                        wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of huber_loss, as torch's huber_loss_backward.

    ``d/dx = -d/dt = g`` times -delta where ``d <= -delta``, delta where ``d >= delta`` and
    ``d`` in between.  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in = cupyloss.huber_loss_backward(1.0, x, y, wrt="input")
    """
    return _grads(_HUBER, (input, target), reduction, _delta(delta), grad_output, wrt, False)


def huber_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean",
                              delta: float = 1.0, *, grad_output: Array | float = 1.0,
                              wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """huber_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, (g_in, g_t) = cupyloss.huber_loss_value_and_grad(x, y, delta=2.0)
    """
    return _grads(_HUBER, (input, target), reduction, _delta(delta), grad_output, wrt, True)


# --- binary_cross_entropy ---------------------------------------------------------------------

def binary_cross_entropy(input: Array, target: Array, weight: Array | None = None,
                         reduction: str = "mean") -> Array:
    """Binary cross entropy of probabilities, as torch.nn.functional.binary_cross_entropy.

    ``l = -w (t max(log x, -100) + (1 - t) max(log(1 - x), -100))`` with x = input,
    t = target and w = weight (1 when None): each log is clamped at -100 as torch does, so
    ``x = 0`` and ``x = 1`` give finite values.  Torch stops with an error (a device assert on
    the GPU) for x outside [0, 1]; cupyloss never checks, and such an x gives a NaN loss (the
    log of a negative number); the input gradient there is the formula below, finite.

    Args:
      input: GPU array of probabilities, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework and dtype, broadcastable with input (torch requires
        input's shape), values in [0, 1].
      weight: None or an array broadcastable with them, e.g. (C,) against (N, C).
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> p = cupy.random.rand(8, 5, dtype=cupy.float32)
      >>> y = (cupy.random.rand(8, 5) > 0.5).astype(cupy.float32)
      >>> cupyloss.binary_cross_entropy(p, y)
    """
    return _value(_BCE, (input, target, weight), reduction, ())


def binary_cross_entropy_backward(grad_output: Array | float, input: Array, target: Array,
                                  weight: Array | None = None, reduction: str = "mean", *,
                                  wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of binary_cross_entropy, with torch's backward formulas.

    ``d/dx = w (x - t) / max(x (1 - x), 1e-12) g`` (torch's binary_cross_entropy_backward),
    ``d/dt = w (log(1 - x) - log x) g`` (torch's target backward, not clamped: inf at x = 0 and
    -inf at x = 1) and ``d/dw`` = the unweighted loss times g (torch has no weight gradient).
    ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt (by default input's, target's, and weight's when given), each
      of its argument's shape and dtype.

    Example:
      >>> g_p, g_y = cupyloss.binary_cross_entropy_backward(1.0, p, y)
    """
    return _grads(_BCE, (input, target, weight), reduction, (), grad_output, wrt, False)


def binary_cross_entropy_value_and_grad(input: Array, target: Array, weight: Array | None = None,
                                        reduction: str = "mean", *,
                                        grad_output: Array | float = 1.0,
                                        wrt: str | Sequence[str] | None = None
                                        ) -> tuple[Array, Any]:
    """binary_cross_entropy and its gradients from one pass over the arrays.


    Example:
      >>> loss, g_p = cupyloss.binary_cross_entropy_value_and_grad(p, y, wrt="input")
    """
    return _grads(_BCE, (input, target, weight), reduction, (), grad_output, wrt, True)


# --- binary_cross_entropy_with_logits ---------------------------------------------------------

def binary_cross_entropy_with_logits(input: Array, target: Array, weight: Array | None = None,
                                     reduction: str = "mean", pos_weight: Array | None = None
                                     ) -> Array:
    """Binary cross entropy of logits, as torch.nn.functional.binary_cross_entropy_with_logits.

    Torch's ``w ((1 - t) x - (1 + (q - 1) t) log_sigmoid(x))`` with x = input, t = target,
    w = weight and q = pos_weight (each 1 when None), evaluated as the equal
    ``w ((1 - t) softplus(x) + q t softplus(-x))``: no exp overflows and no digits are lost at
    large ``|x|`` (``softplus(z) = max(z, 0) + log1p(exp(-|z|))``).

    Args:
      input: GPU array of logits, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework and dtype broadcastable with input (torch requires
        input's shape), usually in [0, 1].
      weight: None or an array broadcastable with them.
      reduction: 'none' | 'mean' | 'sum'.
      pos_weight: None or an array broadcastable with them; (C,) lines up with the last dim of
        (N, C), one weight per class, as in torch.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> z = cupy.random.randn(8, 5).astype(cupy.float32)
      >>> y = (cupy.random.rand(8, 5) > 0.5).astype(cupy.float32)
      >>> w_pos = cupy.full(5, 3.0, cupy.float32)       # positives count three times
      >>> cupyloss.binary_cross_entropy_with_logits(z, y, pos_weight=w_pos)
    """
    return _value(_BCE_LOGITS, (input, target, weight, pos_weight), reduction, ())


def binary_cross_entropy_with_logits_backward(grad_output: Array | float, input: Array,
                                              target: Array, weight: Array | None = None,
                                              reduction: str = "mean",
                                              pos_weight: Array | None = None, *,
                                              wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of binary_cross_entropy_with_logits, equal to torch's formulas.

    ``d/dx = w ((1 - t) sigmoid(x) - q t sigmoid(-x)) g`` (torch's
    ``((q t + 1 - t) sigmoid(x) - q t) w``), ``d/dt = w (q softplus(-x) - softplus(x)) g``
    (``-w x g`` without pos_weight), ``d/dw`` = the unweighted loss times g and
    ``d/dq = w t softplus(-x) g`` (torch differentiates neither weight nor pos_weight).
    ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt (by default input's, target's, then weight's and pos_weight's
      when given), each of its argument's shape and dtype.

    Example:
      >>> g_z, g_y = cupyloss.binary_cross_entropy_with_logits_backward(1.0, z, y)
    """
    return _grads(_BCE_LOGITS, (input, target, weight, pos_weight), reduction, (), grad_output,
                  wrt, False)


def binary_cross_entropy_with_logits_value_and_grad(input: Array, target: Array,
                                                    weight: Array | None = None,
                                                    reduction: str = "mean",
                                                    pos_weight: Array | None = None, *,
                                                    grad_output: Array | float = 1.0,
                                                    wrt: str | Sequence[str] | None = None
                                                    ) -> tuple[Array, Any]:
    """binary_cross_entropy_with_logits and its gradients from one pass over the arrays.


    Example:
      >>> loss, g_z = cupyloss.binary_cross_entropy_with_logits_value_and_grad(z, y, wrt="input")
    """
    return _grads(_BCE_LOGITS, (input, target, weight, pos_weight), reduction, (), grad_output,
                  wrt, True)


# --- soft_margin_loss -------------------------------------------------------------------------

def soft_margin_loss(input: Array, target: Array, reduction: str = "mean") -> Array:
    """Soft margin loss, as torch.nn.functional.soft_margin_loss.

    ``l = log(1 + exp(-input * target))``, evaluated as ``softplus(-x t)``: equal to torch's
    ``log1p(exp(-x t))`` wherever that is finite, and finite (about ``-x t``) where torch's exp
    overflows to inf (``-x t`` past about 88 in float32, 709 in float64).

    Args:
      input: GPU array of scores, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype (labels +-1).
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> s = cupy.random.randn(8, 5).astype(cupy.float32)
      >>> y = cupy.sign(cupy.random.randn(8, 5)).astype(cupy.float32)
      >>> cupyloss.soft_margin_loss(s, y)
    """
    return _value(_SOFT_MARGIN, (input, target), reduction, ())


def soft_margin_loss_backward(grad_output: Array | float, input: Array, target: Array,
                              reduction: str = "mean", *, wrt: str | Sequence[str] | None = None
                              ) -> Any:
    """Gradients of soft_margin_loss.

    ``d/dx = -t sigmoid(-x t) g`` (torch's ``-t z / (1 + z)``, ``z = exp(-x t)``, which turns
    NaN once z overflows; this stays ``-t g``) and ``d/dt = -x sigmoid(-x t) g`` (torch has no
    target gradient).  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_s = cupyloss.soft_margin_loss_backward(1.0, s, y, wrt="input")
    """
    return _grads(_SOFT_MARGIN, (input, target), reduction, (), grad_output, wrt, False)


def soft_margin_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean", *,
                                    grad_output: Array | float = 1.0,
                                    wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """soft_margin_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, (g_s, g_y) = cupyloss.soft_margin_loss_value_and_grad(s, y)
    """
    return _grads(_SOFT_MARGIN, (input, target), reduction, (), grad_output, wrt, True)


# --- hinge_embedding_loss ---------------------------------------------------------------------

def hinge_embedding_loss(input: Array, target: Array, margin: float = 1.0, reduction: str = "mean"
                         ) -> Array:
    """Hinge embedding loss, as torch.nn.functional.hinge_embedding_loss.

    ``l = x`` where ``t == 1`` and ``max(0, margin - x)`` where ``t == -1``; like torch (two
    ``where``s), a target that is neither takes both terms, ``max(0, margin - x) + x``.

    Args:
      input: GPU array (usually distances), any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype; labels +-1.
      margin: Python float.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> d = cupy.random.rand(8).astype(cupy.float32)
      >>> y = cupy.array([1, -1] * 4, dtype=cupy.float32)
      >>> cupyloss.hinge_embedding_loss(d, y, margin=0.5)
    """
    return _value(_HINGE_EMBEDDING, (input, target), reduction, (float(margin),))


def hinge_embedding_loss_backward(grad_output: Array | float, input: Array, target: Array,
                                  margin: float = 1.0, reduction: str = "mean", *,
                                  wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of hinge_embedding_loss, as torch autograd gives them.

    ``d/dx = ([t != -1] - [t != 1][margin - x >= 0]) g`` (the clamp passes its tie and blocks
    NaN) and ``d/dt = 0``: the target only picks branches (torch returns no gradient for it).
    ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_d = cupyloss.hinge_embedding_loss_backward(1.0, d, y, wrt="input")
    """
    return _grads(_HINGE_EMBEDDING, (input, target), reduction, (float(margin),), grad_output,
                  wrt, False)


def hinge_embedding_loss_value_and_grad(input: Array, target: Array, margin: float = 1.0,
                                        reduction: str = "mean", *,
                                        grad_output: Array | float = 1.0,
                                        wrt: str | Sequence[str] | None = None
                                        ) -> tuple[Array, Any]:
    """hinge_embedding_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_d = cupyloss.hinge_embedding_loss_value_and_grad(d, y, wrt="input")
    """
    return _grads(_HINGE_EMBEDDING, (input, target), reduction, (float(margin),), grad_output,
                  wrt, True)


# --- margin_ranking_loss ----------------------------------------------------------------------

def margin_ranking_loss(input1: Array, input2: Array, target: Array, margin: float = 0.0,
                        reduction: str = "mean") -> Array:
    """Margin ranking loss, as torch.nn.functional.margin_ranking_loss.

    ``l = max(0, -target * (input1 - input2) + margin)``: target 1 asks input1 to rank above
    input2 by margin, -1 below.

    Args:
      input1, input2: GPU arrays of scores of one framework and dtype (float16, bfloat16,
        float32 or float64), broadcastable together (torch also requires equal dims).
      target: array broadcastable with them, same dtype; labels +-1.
      margin: Python float.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input1's dtype.

    Example:
      >>> a, b = cupy.random.randn(2, 64).astype(cupy.float32)
      >>> y = cupy.sign(cupy.random.randn(64)).astype(cupy.float32)
      >>> cupyloss.margin_ranking_loss(a, b, y, margin=0.1)
    """
    return _value(_MARGIN_RANKING, (input1, input2, target), reduction, (float(margin),))


def margin_ranking_loss_backward(grad_output: Array | float, input1: Array, input2: Array,
                                 target: Array, margin: float = 0.0, reduction: str = "mean", *,
                                 wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of margin_ranking_loss, as torch autograd gives them.

    With ``pass = [-t (x1 - x2) + margin >= 0]`` (ties pass, NaN blocks):
    ``d/dx1 = -t pass g``, ``d/dx2 = t pass g``, ``d/dt = -(x1 - x2) pass g``.  ``g`` is
    grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt (by default input1's, input2's and target's), each of its
      argument's shape and dtype.

    Example:
      >>> g_a, g_b = cupyloss.margin_ranking_loss_backward(1.0, a, b, y, wrt=("input1", "input2"))
    """
    return _grads(_MARGIN_RANKING, (input1, input2, target), reduction, (float(margin),),
                  grad_output, wrt, False)


def margin_ranking_loss_value_and_grad(input1: Array, input2: Array, target: Array,
                                       margin: float = 0.0, reduction: str = "mean", *,
                                       grad_output: Array | float = 1.0,
                                       wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """margin_ranking_loss and its gradients from one pass over the three arrays.


    Example:
      >>> loss, (g_a, g_b, g_y) = cupyloss.margin_ranking_loss_value_and_grad(a, b, y)
    """
    return _grads(_MARGIN_RANKING, (input1, input2, target), reduction, (float(margin),),
                  grad_output, wrt, True)


# --- poisson_nll_loss -------------------------------------------------------------------------

def _poisson(log_input, full, eps):
    return (bool(log_input), bool(full), float(eps))


def poisson_nll_loss(input: Array, target: Array, log_input: bool = True, full: bool = False,
                     eps: float = 1e-8, reduction: str = "mean") -> Array:
    """Poisson negative log likelihood, as torch.nn.functional.poisson_nll_loss.

    With x = input and t = target: ``l = exp(x) - t x`` when log_input (x is the log rate),
    else ``l = x - t log(x + eps)``.  full adds the Stirling term
    ``t log t - t + log(2 pi t) / 2`` where ``t > 1`` (0 where ``t <= 1``, as torch).

    Args:
      input: GPU array of any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype; counts.
      log_input: True: input is the log-rate (exp(input) - target input); False: the rate
        (input - target log(input + eps)).
      full: add Stirling's approximation of log(target!) for target > 1.
      eps: the floor of the rate inside the log (log_input=False).
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> log_rate = cupy.random.randn(64).astype(cupy.float32)
      >>> counts = cupy.random.poisson(2.0, 64).astype(cupy.float32)
      >>> cupyloss.poisson_nll_loss(log_rate, counts, full=True)
    """
    return _value(_POISSON, (input, target), reduction, _poisson(log_input, full, eps))


def poisson_nll_loss_backward(grad_output: Array | float, input: Array, target: Array,
                              log_input: bool = True, full: bool = False, eps: float = 1e-8,
                              reduction: str = "mean", *, wrt: str | Sequence[str] | None = None
                              ) -> Any:
    """Gradients of poisson_nll_loss, as torch autograd gives them.

    log_input: ``d/dx = (exp(x) - t) g``, ``d/dt = -x g``; otherwise
    ``d/dx = (1 - t / (x + eps)) g``, ``d/dt = -log(x + eps) g``.  full adds to d/dt torch's
    backward of the masked Stirling term: ``(log t + 1 / (2 t)) g`` where ``t > 1``, 0 for
    ``0 < t <= 1``, NaN where ``t <= 0`` (torch's ``0 * log 0``).  ``g`` is grad_output times
    1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g = cupyloss.poisson_nll_loss_backward(1.0, log_rate, counts, wrt="input")
    """
    return _grads(_POISSON, (input, target), reduction, _poisson(log_input, full, eps),
                  grad_output, wrt, False)


def poisson_nll_loss_value_and_grad(input: Array, target: Array, log_input: bool = True,
                                    full: bool = False, eps: float = 1e-8,
                                    reduction: str = "mean", *, grad_output: Array | float = 1.0,
                                    wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """poisson_nll_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g = cupyloss.poisson_nll_loss_value_and_grad(log_rate, counts, wrt="input")
    """
    return _grads(_POISSON, (input, target), reduction, _poisson(log_input, full, eps),
                  grad_output, wrt, True)


# --- gaussian_nll_loss ------------------------------------------------------------------------

def _gaussian_var(var, check_var):
    """var as the engine takes it: an array (checked on the device when asked), or a float."""
    if isinstance(var, numbers.Real) and not isinstance(var, bool):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        return float(var)
    if check_var:
        _check_nonnegative(var)
    return var


def _check_nonnegative(var):
    """torch's ``torch.any(var < 0)`` check: reads one flag back, so it synchronises."""
    import cupy

    from cupyloss._core import dispatch as _dispatch

    frame = _dispatch.frame_of(var, "var")
    op = frame.operand(var, "var")
    stream = cupy.cuda.Stream.from_external(_dispatch.RawStream(frame.stream(op.device)))
    with cupy.cuda.Device(op.device), stream, frame.scratch_allocator():
        negative = bool((frame.cupy_view(op) < 0).any())
    if negative:
        raise ValueError("var has negative entry/entries")


def gaussian_nll_loss(input: Array, target: Array, var: Array | float, full: bool = False,
                      eps: float = 1e-6, reduction: str = "mean", *, check_var: bool = False
                      ) -> Array:
    """Gaussian negative log likelihood, as torch.nn.functional.gaussian_nll_loss.

    ``l = (log v + (input - target)^2 / v) / 2`` with ``v = max(var, eps)``, plus
    ``log(2 pi) / 2`` when full.  var takes torch's shapes: input's shape; input's shape
    without its last dim (one variance per row: a trailing 1 is added); the same number of dims
    with one dim of size 1 where input's differs; or a Python number (var everywhere; no
    gradient).  Other shapes raise ``ValueError("var is of incorrect size")``.

    Torch checks ``var < 0`` on the host, which synchronises with the device; cupyloss does
    not: a negative var is clamped to eps like any var below eps (the loss of variance eps).
    ``check_var=True`` runs torch's check and raises its ValueError, at the cost of that sync;
    a negative Python number always raises.

    Args:
      input: GPU array of predicted means, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype.
      var: array of the same framework and dtype (shapes above), or a Python number.
      full: add the constant 0.5 log(2 pi).
      eps: the floor of var (var is clamped to at least eps).
      reduction: 'none' | 'mean' | 'sum'.
      check_var: raise ValueError for a negative var (synchronises).

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> mu = cupy.random.randn(16, 3).astype(cupy.float32)
      >>> y = cupy.random.randn(16, 3).astype(cupy.float32)
      >>> var = cupy.random.rand(16).astype(cupy.float32) + 0.1     # one variance per row
      >>> cupyloss.gaussian_nll_loss(mu, y, var)
    """
    return _value(_GAUSSIAN, (input, target, _gaussian_var(var, check_var)), reduction,
                  (bool(full), float(eps)))


def gaussian_nll_loss_backward(grad_output: Array | float, input: Array, target: Array,
                               var: Array | float, full: bool = False, eps: float = 1e-6,
                               reduction: str = "mean", *, check_var: bool = False,
                               wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of gaussian_nll_loss, as torch autograd gives them.

    With ``v = max(var, eps)``: ``d/dx = (x - t) / v g = -d/dt`` and
    ``d/dvar = (1 / v - (x - t)^2 / v^2) / 2 g``; torch clamps under no_grad, so var's gradient
    is this formula even where the clamp acts.  A Python number var has no gradient.  ``g`` is
    grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt (by default input's, target's and var's when it is an array),
      each of its argument's shape and dtype.

    Example:
      >>> g_mu, g_y, g_var = cupyloss.gaussian_nll_loss_backward(1.0, mu, y, var)
    """
    return _grads(_GAUSSIAN, (input, target, _gaussian_var(var, check_var)), reduction,
                  (bool(full), float(eps)), grad_output, wrt, False)


def gaussian_nll_loss_value_and_grad(input: Array, target: Array, var: Array | float,
                                     full: bool = False, eps: float = 1e-6,
                                     reduction: str = "mean", *, check_var: bool = False,
                                     grad_output: Array | float = 1.0,
                                     wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """gaussian_nll_loss and its gradients from one pass over the arrays.


    Example:
      >>> loss, (g_mu, g_var) = cupyloss.gaussian_nll_loss_value_and_grad(
      ...     mu, y, var, wrt=("input", "var"))
    """
    return _grads(_GAUSSIAN, (input, target, _gaussian_var(var, check_var)), reduction,
                  (bool(full), float(eps)), grad_output, wrt, True)


# --- squared_hinge_loss -----------------------------------------------------------------------

def squared_hinge_loss(input: Array, target: Array, margin: float = 1.0, reduction: str = "mean"
                       ) -> Array:
    """Squared hinge loss ``l = max(0, margin - input * target)^2`` (no torch counterpart).

    The square of hinge_loss: smooth at the margin, and it penalises large violations more.
    A NaN product gives a NaN loss.

    Args:
      input: GPU array of scores, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype; labels +-1.
      margin: Python float.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> s = cupy.random.randn(8, 5).astype(cupy.float32)
      >>> y = cupy.sign(cupy.random.randn(5)).astype(cupy.float32)
      >>> cupyloss.squared_hinge_loss(s, y)
    """
    return _value(_SQUARED_HINGE, (input, target), reduction, (float(margin),))


def squared_hinge_loss_backward(grad_output: Array | float, input: Array, target: Array,
                                margin: float = 1.0, reduction: str = "mean", *,
                                wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of squared_hinge_loss, as torch autograd gives for clamp(m - x t, min=0)^2.

    With ``h = margin - x t`` where that is >= 0 and 0 elsewhere (NaN blocked):
    ``d/dx = -2 h t g`` and ``d/dt = -2 h x g``.  ``g`` is grad_output times 1/n for 'mean',
    1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_s, g_y = cupyloss.squared_hinge_loss_backward(1.0, s, y)
    """
    return _grads(_SQUARED_HINGE, (input, target), reduction, (float(margin),), grad_output,
                  wrt, False)


def squared_hinge_loss_value_and_grad(input: Array, target: Array, margin: float = 1.0,
                                      reduction: str = "mean", *, grad_output: Array | float = 1.0,
                                      wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """squared_hinge_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_s = cupyloss.squared_hinge_loss_value_and_grad(s, y, wrt="input")
    """
    return _grads(_SQUARED_HINGE, (input, target), reduction, (float(margin),), grad_output,
                  wrt, True)


# --- sigmoid_focal_loss -----------------------------------------------------------------------

def sigmoid_focal_loss(input: Array, target: Array, alpha: float = 0.25, gamma: float = 2.0,
                       reduction: str = "none") -> Array:
    """Sigmoid focal loss, as torchvision.ops.sigmoid_focal_loss (no torch.nn.functional one).

    With p = sigmoid(input), t = target: ``l = a ce (1 - p_t)^gamma`` where
    ``ce = binary_cross_entropy_with_logits(input, t)``, ``p_t = p t + (1 - p)(1 - t)`` and
    ``a = alpha t + (1 - alpha)(1 - t)`` (1 when alpha < 0).  ``1 - p_t`` is evaluated as
    ``p (1 - t) + sigmoid(-x) t``: equal, without torchvision's cancellation for large |x|.
    The default reduction is 'none', as torchvision's.

    Args:
      input: GPU array of logits, any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype; in [0, 1].
      alpha: the positive class's weight (1 - alpha the negative's); < 0 turns the weighting
        off.
      gamma: the focusing exponent, >= 0.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: the broadcast shape for 'none', else 0-d; input's dtype.

    Example:
      >>> z = cupy.random.randn(8, 80).astype(cupy.float32)
      >>> y = (cupy.random.rand(8, 80) > 0.9).astype(cupy.float32)
      >>> cupyloss.sigmoid_focal_loss(z, y, reduction="sum")
    """
    return _value(_FOCAL, (input, target), reduction, (float(alpha), float(gamma)))


def sigmoid_focal_loss_backward(grad_output: Array | float, input: Array, target: Array,
                                alpha: float = 0.25, gamma: float = 2.0, reduction: str = "none",
                                *, wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of sigmoid_focal_loss, as torch autograd gives them through torchvision's code.

    With ``q = 1 - p_t``, ``r = sigmoid(-x)`` and ``dq = gamma q^(gamma - 1)`` (0 when
    gamma == 0): ``d/dx = a ((p (1 - t) - r t) q^gamma + ce dq p r (1 - 2 t)) g`` and
    ``d/dt = (a' ce q^gamma + a (-x q^gamma + ce dq (r - p))) g`` with ``a' = 2 alpha - 1``
    (0 when alpha < 0).  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_z = cupyloss.sigmoid_focal_loss_backward(1.0, z, y, reduction="sum", wrt="input")
    """
    return _grads(_FOCAL, (input, target), reduction, (float(alpha), float(gamma)), grad_output,
                  wrt, False)


def sigmoid_focal_loss_value_and_grad(input: Array, target: Array, alpha: float = 0.25,
                                      gamma: float = 2.0, reduction: str = "none", *,
                                      grad_output: Array | float = 1.0,
                                      wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """sigmoid_focal_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_z = cupyloss.sigmoid_focal_loss_value_and_grad(z, y, reduction="mean",
      ...                                                        wrt="input")
    """
    return _grads(_FOCAL, (input, target), reduction, (float(alpha), float(gamma)), grad_output,
                  wrt, True)


# --- log_cosh_loss ----------------------------------------------------------------------------

def log_cosh_loss(input: Array, target: Array, reduction: str = "mean") -> Array:
    """Log-cosh loss ``l = log(cosh(input - target))`` (no torch counterpart).

    About ``d^2 / 2`` for small ``d = input - target`` and ``|d| - log 2`` for large: evaluated
    as ``log1p(2 sinh(|d| / 2)^2)`` below ``|d| = 1`` and ``|d| - log 2 + log1p(exp(-2 |d|))``
    above, so neither small differences lose digits nor large ones overflow cosh.

    Args:
      input: GPU array of any shape; float16, bfloat16, float32 or float64.
      target: array of the same framework broadcastable with input, same dtype.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> cupyloss.log_cosh_loss(x, y)
    """
    return _value(_LOG_COSH, (input, target), reduction, ())


def log_cosh_loss_backward(grad_output: Array | float, input: Array, target: Array,
                           reduction: str = "mean", *, wrt: str | Sequence[str] | None = None
                           ) -> Any:
    """Gradients of log_cosh_loss: ``d/dx = tanh(x - t) g = -d/dt``.

    ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_in, g_t = cupyloss.log_cosh_loss_backward(1.0, x, y)
    """
    return _grads(_LOG_COSH, (input, target), reduction, (), grad_output, wrt, False)


def log_cosh_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean", *,
                                 grad_output: Array | float = 1.0,
                                 wrt: str | Sequence[str] | None = None) -> tuple[Array, Any]:
    """log_cosh_loss and its gradients from one pass over input and target.


    Example:
      >>> loss, g_in = cupyloss.log_cosh_loss_value_and_grad(x, y, wrt="input")
    """
    return _grads(_LOG_COSH, (input, target), reduction, (), grad_output, wrt, True)


_docs.derive(globals(), SPECS)
