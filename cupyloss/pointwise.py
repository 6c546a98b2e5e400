"""Pointwise losses with torch.nn.functional's names, arguments and semantics.

Each loss ``f`` comes as ``f(input, target, ...)``, ``f_backward(grad_output, input, target,
...)`` and ``f_value_and_grad(input, target, ..., grad_output=1.0, wrt=...)``.

Common rules:
  * input and target are GPU arrays of one framework, one dtype (float16, bfloat16, float32 or
    float64) and one device: cupy.ndarrays, torch CUDA tensors (requires_grad or not), JAX GPU
    arrays, or anything else with a CUDA __dlpack__.  They are read in place (no copy), of any
    shapes that broadcast (NumPy/torch rules, without materialising the broadcast operand),
    contiguous or not (negative and zero strides included), empty or 0-d.  Results come back
    in the caller's framework: torch tensors from torch's caching allocator on torch's current
    stream, cupy.ndarrays from CuPy's pool on CuPy's current stream, JAX arrays for JAX inputs
    (cupy.ndarrays for other DLPack producers).
  * reduction: 'none' returns the elementwise loss in the broadcast shape; 'sum' and 'mean' a
    0-d array ('mean' of an empty tensor is NaN, 'sum' is 0); kl_div also takes 'batchmean',
    the sum divided by input.shape[0] (by 1 for 0-d input).  The result has the inputs' dtype;
    16-bit inputs are accumulated in float32.
  * grad_output: a Python number, a 0-d array of the loss's dtype and the inputs' framework
    (read on the device, never synchronised), or for reduction='none' an array of the loss's
    shape.
  * wrt selects the gradients: ``("input", "target")`` (default) returns a tuple of both,
    ``"input"`` or ``"target"`` returns that gradient alone, and a one-name tuple a one-element
    tuple.  Gradients not named are neither computed nor allocated.  Each gradient has its
    argument's shape and dtype; a broadcast argument's gradient is summed over the broadcast
    dims, deterministically.
  * Reductions are deterministic: the same inputs on the same device give bitwise the same
    results on every run.  Nothing is copied back to the host.
"""

from __future__ import annotations

from cupyloss import _validate
from cupyloss._pointwise import SPECS, evaluate

_BOTH = ("input", "target")


_NONE = ()


def _value(spec, input, target, reduction, options):
    return evaluate(spec, input, target, reduction=reduction, options=options,
                    want_value=True, wrt=_NONE)[0]


def _grads(spec, input, target, reduction, options, grad_output, wrt, want_value):
    if wrt is _BOTH:
        names, single = _BOTH, False
    else:
        names, single = _validate.check_wrt(wrt)
    value, gx, gt = evaluate(spec, input, target, reduction=reduction, options=options,
                             want_value=want_value, wrt=names, grad_output=grad_output)
    if single:
        grads = gx if names[0] == "input" else gt
    elif names is _BOTH:
        grads = (gx, gt)
    else:
        grads = tuple(gx if k == "input" else gt for k in names)
    return (value, grads) if want_value else grads


_MSE, _KL, _HINGE = SPECS["mse_loss"], SPECS["kl_div"], SPECS["hinge_loss"]


# --- mse_loss ---------------------------------------------------------------------------------

def mse_loss(input, target, reduction="mean"):
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
    return _value(_MSE, input, target, reduction, ())


def mse_loss_backward(grad_output, input, target, reduction="mean", *, wrt=_BOTH):
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
    return _grads(_MSE, input, target, reduction, (), grad_output, wrt, False)


def mse_loss_value_and_grad(input, target, reduction="mean", *, grad_output=1.0, wrt=_BOTH):
    """mse_loss and its gradients from one pass over input and target.

    Returns:
      ``(loss, grads)`` with loss as from mse_loss and grads as from mse_loss_backward.

    Example:
      >>> loss, (g_in, g_t) = cupyloss.mse_loss_value_and_grad(x, y)
      >>> loss, g_in = cupyloss.mse_loss_value_and_grad(x, y, wrt="input")
    """
    return _grads(_MSE, input, target, reduction, (), grad_output, wrt, True)


# --- kl_div -----------------------------------------------------------------------------------

def kl_div(input, target, reduction="mean", log_target=False, log_input=True):
    """Kullback-Leibler divergence, as torch.nn.functional.kl_div.

    With x = input (log-probabilities) and t = target:
      log_target=False: ``l = xlogy(t, t) - t x``  (a target of 0 contributes 0)
      log_target=True:  ``l = exp(t) (t - x)``
    log_input=False (a cupyloss extension) takes probabilities p as input and uses x = log p
    inside the kernel, so ``kl_div(p, q, log_input=False)`` equals ``kl_div(log(p), q)`` without
    materialising ``log(p)``.  'batchmean' divides the sum by input.shape[0], as torch's
    KLDivLoss recommends; 'mean' divides by the element count.

    Args:
      input: GPU array, log-probabilities (or probabilities with log_input=False).
      target: array of the same framework broadcastable with input, same dtype; probabilities, or
        log-probabilities with log_target=True.
      reduction: 'none' | 'mean' | 'sum' | 'batchmean'.

    Returns:
      The loss: 0-d unless reduction='none'; input's dtype.

    Example:
      >>> p = cupy.random.rand(4, 10, dtype=cupy.float32); p /= p.sum(-1, keepdims=True)
      >>> q = cupy.random.rand(4, 10, dtype=cupy.float32); q /= q.sum(-1, keepdims=True)
      >>> cupyloss.kl_div(cupy.log(p), q, reduction="batchmean")
      >>> cupyloss.kl_div(p, q, reduction="batchmean", log_input=False)   # same value
    """
    return _value(_KL, input, target, reduction, (bool(log_target), bool(log_input)))


def kl_div_backward(grad_output, input, target, reduction="mean", log_target=False,
                    log_input=True, *, wrt=_BOTH):
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
    return _grads(_KL, input, target, reduction, (bool(log_target), bool(log_input)),
                  grad_output, wrt, False)


def kl_div_value_and_grad(input, target, reduction="mean", log_target=False, log_input=True, *,
                          grad_output=1.0, wrt=_BOTH):
    """kl_div and its gradients from one pass over input and target.

    Returns:
      ``(loss, grads)`` with loss as from kl_div and grads as from kl_div_backward.

    Example:
      >>> loss, (g_in, g_t) = cupyloss.kl_div_value_and_grad(cupy.log(p), q, "batchmean")
      >>> loss, g_p = cupyloss.kl_div_value_and_grad(p, q, "batchmean", log_input=False,
      ...                                            wrt="input")
    """
    return _grads(_KL, input, target, reduction, (bool(log_target), bool(log_input)),
                  grad_output, wrt, True)


# --- hinge_loss -------------------------------------------------------------------------------

def hinge_loss(input, target, margin=1.0, reduction="mean"):
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
    return _value(_HINGE, input, target, reduction, (float(margin),))


def hinge_loss_backward(grad_output, input, target, margin=1.0, reduction="mean", *,
                        wrt=_BOTH):
    """Gradients of hinge_loss, as torch autograd gives for clamp(margin - x t, min=0).

    ``d/dx = -t g [margin - x t >= 0]``, ``d/dt = -x g [margin - x t >= 0]``: at the tie
    ``margin == x t`` the gradient passes (torch's clamp does), where the product is NaN it is
    blocked.  ``g`` is grad_output times 1/n for 'mean', 1 otherwise.

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype.

    Example:
      >>> g_s, g_y = cupyloss.hinge_loss_backward(1.0, s, y)
    """
    return _grads(_HINGE, input, target, reduction, (float(margin),),
                  grad_output, wrt, False)


def hinge_loss_value_and_grad(input, target, margin=1.0, reduction="mean", *, grad_output=1.0,
                              wrt=_BOTH):
    """hinge_loss and its gradients from one pass over input and target.

    Returns:
      ``(loss, grads)`` with loss as from hinge_loss and grads as from hinge_loss_backward.

    Example:
      >>> loss, g_s = cupyloss.hinge_loss_value_and_grad(s, y, wrt="input")
    """
    return _grads(_HINGE, input, target, reduction, (float(margin),),
                  grad_output, wrt, True)
