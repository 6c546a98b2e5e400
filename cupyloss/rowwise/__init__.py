"""Row-wise losses with torch.nn.functional's names, arguments and semantics: cross_entropy and
nll_loss, each as ``f``, ``f_backward`` and ``f_value_and_grad``.

Common rules:
  * input is a GPU array of one framework (cupy.ndarray, torch CUDA tensor, JAX GPU array or any
    CUDA DLPack array) of dtype float16, bfloat16, float32 or float64, shaped (C,), (N, C) or
    (N, C, d1, ..., dk): the class axis is dim 1 (dim 0 for (C,)).  It is read in place, with
    any strides.  A row is one sample's (or one spatial position's) C scores.
  * target holds class indices (int32 or int64) of the input's shape without the class axis
    ((), (N,) or (N, d1, ..., dk)), or, for cross_entropy, probabilities of the input's shape and
    dtype.  Probabilities get a gradient (``wrt=("input", "target")``); indices do not.
  * weight: None or a (C,) array of the input's dtype, a rescaling weight per class.
  * reduction: 'none' returns the loss per row (the target's shape for indices); 'sum' and 'mean'
    a 0-d array.  'mean' over class indices divides by the summed weights of the rows whose
    target is not ignore_index (their count without a weight), so an all-ignored 'mean' is NaN
    (0 / 0), as in torch; 'mean' over probabilities divides by the number of rows.
  * Out-of-range class indices (outside [0, C) and not ignore_index) are never used as addresses:
    that row's weight is NaN, so its loss and its whole gradient row are NaN, and so is a 'mean'
    (whose divisor sums that weight).  torch raises a device-side assert instead; pass
    ``check_targets=True`` to get torch's CPU error (IndexError "Target 7 is out of bounds.") at
    the cost of a host synchronisation.
  * Results have the input's dtype (16-bit inputs accumulate in float32) and come back in the
    caller's framework, allocated by it, on its current stream.  Nothing is read back to the host
    (except with check_targets), and every sum runs in a fixed order: the same inputs on the same
    device give bitwise the same results.
  * grad_output: a Python number, a 0-d array of the input's dtype and framework (read on the
    device), or for reduction='none' an array of the loss's shape.
"""

from __future__ import annotations

from cupyloss._core import validate as _validate
from cupyloss._core import docs as _docs
from cupyloss._types import Any, Array, Sequence
from cupyloss.rowwise._family import SPECS, evaluate

_CE, _NLL = SPECS["cross_entropy"], SPECS["nll_loss"]


def _names(wrt):
    """wrt of a row loss (its arrays are input and target; None stands for 'input')."""
    return _validate.check_wrt(wrt, ("input", "target"), default="input")


def _grads(names, single, gx, gt):
    picked = tuple(gx if n == "input" else gt for n in names)
    return picked[0] if single else picked


# --- cross_entropy ----------------------------------------------------------------------------

def cross_entropy(input: Array, target: Array, weight: Array | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  *, lse_square_scale: float = 0.0, softcap: float = 0.0,
                  check_targets: bool = False, num_items: Array | int | None = None) -> Array:
    """Cross entropy of softmax(input) along the class axis, as torch.nn.functional.cross_entropy.

    With Liger-Kernel's z-loss and softcap beyond torch.
    For a row of logits x with z = x (or ``softcap * tanh(x / softcap)`` with softcap > 0),
    ``lse = log sum_c exp(z_c)``, label smoothing eps over C classes and weights w (1 without):

      class index y:   ``l = (1 - eps) w_y (lse - z_y) + (eps / C) sum_c w_c (lse - z_c)``
                       ``+ lse_square_scale * lse^2``;  l = 0 where y == ignore_index
      probabilities t: ``l = sum_c w_c ((1 - eps) t_c + eps / C) (lse - z_c)``
                       ``+ lse_square_scale * lse^2``

    then reduced ('mean': over the summed w_y of counted rows for indices, over the rows for
    probabilities).  lse_square_scale (z-loss, PaLM) and softcap (Gemma 2) are beyond torch; with
    their defaults this is torch's cross_entropy.  Sums run in float32 (float64 for float64 input)
    as ``b log S + a`` with every term >= 0, so large logits lose no accuracy.

    Args:
      input: logits, (C,), (N, C) or (N, C, d1, ..., dk); float16, bfloat16, float32, float64.
      target: class indices (int32/int64) shaped (), (N,) or (N, d1, ..., dk), or probabilities
        shaped like input, same dtype.
      weight: None or (C,) of input's dtype.
      ignore_index: class-index value whose rows count for nothing.
      reduction: 'none' | 'mean' | 'sum'.
      label_smoothing: eps in [0, 1].
      lse_square_scale: z-loss coefficient (0: none).
      softcap: > 0 caps the logits with ``softcap * tanh(x / softcap)``; 0: no cap.  A cap
        must be finite with a finite reciprocal in the accumulator (2.9e-39 to 3.4e38 for all
        but float64 inputs); anything else raises ValueError.
      check_targets: raise IndexError for an out-of-range class index (synchronises).
      num_items: None, or the divisor of the summed loss for 'mean' and 'sum' alike: the number
        of counted rows (targets not ignore_index) over every micro-batch of a
        gradient-accumulation step (Hugging Face's ``num_items_in_batch``), so that the
        micro-batches' gradients add up to the whole batch's 'mean' gradient.  An int, or a
        0-d int32/int64 array on the input's device (read there: no synchronisation).

    Returns:
      The loss: 0-d for 'mean'/'sum', else the input's shape without the class axis; input's dtype.

    Example:
      >>> x = cupy.random.randn(8, 1000).astype(cupy.float32)
      >>> y = cupy.random.randint(0, 1000, 8)
      >>> cupyloss.cross_entropy(x, y)
      >>> cupyloss.cross_entropy(x, y, label_smoothing=0.1, lse_square_scale=1e-4)
    """
    return evaluate(_CE, input, target, weight, reduction=reduction, ignore_index=ignore_index,
                    label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                    softcap=softcap, check=check_targets, num_items=num_items)[0]


def cross_entropy_backward(grad_output: Array | float, input: Array, target: Array,
                           weight: Array | None = None, ignore_index: int = -100,
                           reduction: str = "mean", label_smoothing: float = 0.0, *,
                           lse_square_scale: float = 0.0, softcap: float = 0.0,
                           check_targets: bool = False, wrt: str | Sequence[str] | None = "input",
                           num_items: Array | int | None = None) -> Any:
    """Gradients of cross_entropy, equal to torch autograd's.

    With p = softmax(z) along the class axis and g the upstream gradient of the row (grad_output,
    over the 'mean' divisor):

      class index y:   ``dl/dz_c = g (K p_c - (1 - eps) w_y [c == y] - (eps / C) w_c)``,
                       ``K = (1 - eps) w_y + (eps / C) sum_c w_c + 2 lse_square_scale lse``;
                       0 on ignored rows
      probabilities t: ``dl/dz_c = g (K p_c - u_c)``, ``u_c = w_c ((1 - eps) t_c + eps / C)``,
                       ``K = sum_c u_c + 2 lse_square_scale lse``;
                       ``dl/dt_c = g (1 - eps) w_c (lse - z_c)``
      softcap:         ``dl/dx_c = dl/dz_c (1 - (z_c / softcap)^2)``

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      input, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        check_targets, num_items: as for cross_entropy.
      wrt: 'input' (default: returns that gradient alone), 'target' (probability targets) or a
        tuple of names (returns a tuple).

    Returns:
      The gradients named by wrt, each of its argument's shape and dtype (C-contiguous).

    Example:
      >>> g = cupyloss.cross_entropy_backward(1.0, x, y)
    """
    names, single = _names(wrt)
    _, gx, gt, _ = evaluate(_CE, input, target, weight, reduction=reduction,
                            ignore_index=ignore_index, label_smoothing=label_smoothing,
                            lse_square_scale=lse_square_scale, softcap=softcap,
                            check=check_targets, want_value=False, wrt=names,
                            grad_output=grad_output, num_items=num_items)
    return _grads(names, single, gx, gt)


def cross_entropy_value_and_grad(input: Array, target: Array, weight: Array | None = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                                 softcap: float = 0.0, check_targets: bool = False,
                                 grad_output: Array | float = 1.0,
                                 wrt: str | Sequence[str] | None = "input", inplace: bool = False,
                                 return_lse: bool = False,
                                 num_items: Array | int | None = None) -> tuple[Any, ...]:
    """cross_entropy and its gradient from one read of the logits.

    Each row is held on chip while its softmax is reduced, so the logits are read once and the
    gradient written once.

    **inplace=True OVERWRITES THE INPUT: the logits' buffer receives their gradient** and the
    returned gradient is the input array itself.  This halves the peak memory of a large
    vocabulary (no second logits-sized array); the logits are gone afterwards, so use it only
    when nothing else (autograd included) still needs them.  cupy and torch arrays only (JAX
    arrays are immutable).

    Args:
      input, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
        check_targets, num_items: as for cross_entropy.
      grad_output, wrt: as for cross_entropy_backward (wrt=() computes no gradient).
      inplace: write the input gradient into input (see above).
      return_lse: also return the per-row logsumexp of z (shaped like a 'none' loss; float32,
        float64 for float64 input).

    Returns:
      ``(loss, grads)``, or ``(loss, grads, lse)`` with return_lse; loss as from cross_entropy,
      grads as from cross_entropy_backward.

    Example:
      >>> loss, g = cupyloss.cross_entropy_value_and_grad(x, y)
      >>> loss, g = cupyloss.cross_entropy_value_and_grad(x, y, inplace=True)  # g is x
      >>> loss, (), lse = cupyloss.cross_entropy_value_and_grad(x, y, wrt=(), return_lse=True)
    """
    names, single = _names(wrt)
    value, gx, gt, lse = evaluate(_CE, input, target, weight, reduction=reduction,
                                  ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  lse_square_scale=lse_square_scale, softcap=softcap,
                                  check=check_targets, want_value=True, wrt=names,
                                  grad_output=grad_output, inplace=inplace,
                                  want_lse=return_lse, num_items=num_items)
    grads = _grads(names, single, gx, gt)
    return (value, grads, lse) if return_lse else (value, grads)


# --- nll_loss ---------------------------------------------------------------------------------

def nll_loss(input: Array, target: Array, weight: Array | None = None, ignore_index: int = -100,
             reduction: str = "mean", *, check_targets: bool = False,
             num_items: Array | int | None = None) -> Array:
    """Negative log likelihood, as torch.nn.functional.nll_loss.

    ``l = -w_y input[y]`` per row (input holds log-probabilities), 0 where y == ignore_index;
    'mean' divides the sum by the summed w_y of counted rows (NaN when all are ignored).

    Args:
      input: log-probabilities, (C,), (N, C) or (N, C, d1, ..., dk); float16, bfloat16, float32,
        float64.
      target: class indices (int32/int64), the input's shape without the class axis.
      weight, ignore_index, reduction, check_targets, num_items: as for cross_entropy.

    Returns:
      The loss: 0-d for 'mean'/'sum', else the target's shape; input's dtype.

    Example:
      >>> logp = cupy.log(cupy.full((4, 3), 1 / 3, cupy.float32))
      >>> cupyloss.nll_loss(logp, cupy.array([0, 1, 2, 1]))            # log 3
      array(1.0986123, dtype=float32)
    """
    return evaluate(_NLL, input, target, weight, reduction=reduction, ignore_index=ignore_index,
                    check=check_targets, num_items=num_items)[0]


def nll_loss_backward(grad_output: Array | float, input: Array, target: Array,
                      weight: Array | None = None, ignore_index: int = -100,
                      reduction: str = "mean", *, check_targets: bool = False,
                      wrt: str | Sequence[str] | None = "input",
                      num_items: Array | int | None = None) -> Any:
    """Gradient of nll_loss: ``dl/dinput[c] = -w_y g [c == y]``, 0 on ignored rows.

    g is grad_output over the 'mean' divisor (num_items where given).  The gradient is written
    whole (zeros included).

    Returns:
      The input's gradient (or a one-element tuple for a tuple wrt), its shape and dtype.

    Example:
      >>> g = cupyloss.nll_loss_backward(1.0, logp, cupy.array([0, 1, 2, 1]))
    """
    names, single = _names(wrt)
    _, gx, gt, _ = evaluate(_NLL, input, target, weight, reduction=reduction,
                            ignore_index=ignore_index, check=check_targets, want_value=False,
                            wrt=names, grad_output=grad_output, num_items=num_items)
    return _grads(names, single, gx, gt)


def nll_loss_value_and_grad(input: Array, target: Array, weight: Array | None = None,
                            ignore_index: int = -100, reduction: str = "mean", *,
                            check_targets: bool = False, grad_output: Array | float = 1.0,
                            wrt: str | Sequence[str] | None = "input", inplace: bool = False,
                            num_items: Array | int | None = None) -> tuple[Array, Any]:
    """nll_loss and its gradient in one launch.

    **inplace=True OVERWRITES THE INPUT with its gradient** (returned as the input array itself);
    see cross_entropy_value_and_grad.

    Args:
      inplace: write the input gradient into input (see above).


    Example:
      >>> loss, g = cupyloss.nll_loss_value_and_grad(logp, cupy.array([0, 1, 2, 1]))
    """
    names, single = _names(wrt)
    value, gx, gt, _ = evaluate(_NLL, input, target, weight, reduction=reduction,
                                ignore_index=ignore_index, check=check_targets, want_value=True,
                                wrt=names, grad_output=grad_output, inplace=inplace,
                                num_items=num_items)
    return value, _grads(names, single, gx, gt)


def rejected_targets(device: int | None = None, *, reset: bool = False) -> Any:
    """How many rows had a rejected class target on a device since the process began (or since
    the last ``reset=True``), as a 0-d uint64 CuPy array computed on the current stream: read it
    (``int(...)``) at a point where the training loop synchronises anyway.

    A rejected target is a class index outside [0, C) that is not ignore_index, in
    cross_entropy, nll_loss, multi_margin_loss and the fused and vocab-parallel cross entropies,
    or, in the vocab-parallel ones, a row whose ranks were given different class indices or
    whose class no slice or two slices hold.  Such a row's loss and gradient are NaN (never an
    out-of-bounds read); without ``check_targets`` nothing is said at the call, so a
    mixed-precision loop whose GradScaler skips the step on a NaN can ask here why.  Every
    kernel that finishes a row counts it once, with an integer atomic: no cost on rows that are
    fine, no host synchronisation.

    Args:
      device: the CUDA device ordinal; None for the current one.
      reset: set the counters to zero after reading them (on the same stream).

    Returns:
      0-d uint64 CuPy array on that device.

    Example:
      >>> loss = cupyloss.torch.cross_entropy(logits, labels)        # no sync
      >>> if step % 100 == 0 and int(cupyloss.rejected_targets(reset=True)):
      ...     print("labels outside the vocabulary in the last 100 steps")
    """
    import cupy

    from cupyloss._core import source as _source

    device = cupy.cuda.runtime.getDevice() if device is None else int(device)
    with cupy.cuda.Device(device):
        total = cupy.zeros((), cupy.uint64)
        for owner, module in list(_source.COUNTED):
            if owner != device:
                continue
            count = cupy.ndarray((), cupy.uint32, module.get_global("cupyloss_rejected_targets"))
            total += count.astype(cupy.uint64)
            if reset:
                count.fill(0)
    return total


_docs.derive(globals(), SPECS)
