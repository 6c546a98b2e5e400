"""Connectionist temporal classification with torch.nn.functional's name, arguments and
semantics: ctc_loss, ctc_loss_backward and ctc_loss_value_and_grad.

Common rules:
  * log_probs is a GPU array (cupy.ndarray, torch CUDA tensor, JAX GPU array or any CUDA DLPack
    array) of float16, bfloat16, float32 or float64, read in place with any strides and never
    written; 16-bit inputs accumulate in float32.
  * targets, input_lengths and target_lengths are int32 or int64 arrays of log_probs'
    framework on its device, or host values (Python ints and sequences, NumPy arrays, CPU
    tensors: checked on the host with torch's errors, then copied to the device with the
    caller's stream, without a sync).  Lengths on the device are checked there: a sequence whose
    lengths or labels are out of range gets a NaN loss and gradient instead of torch's error
    (which reads them back).
  * Results have log_probs' dtype and come back in the caller's framework, allocated by it, on
    its current stream.  Nothing is read back to the host, nothing is added with atomics: the
    same inputs on the same device give bitwise the same results.
  * Memory besides the results: a value per sequence, and with a gradient alpha at every step
    and position, T (2 S + 1) accumulators a sequence (padded targets; concatenated ones keep
    T (2 tl + 1) each), as torch keeps it.
"""

from __future__ import annotations

from cupyloss._core import docs as _docs
from cupyloss._core import validate as _validate
from cupyloss._types import Any, Array, Sequence
from cupyloss.ctc._family import SPECS, evaluate

_WRT = ("log_probs",)


def ctc_loss(log_probs: Array, targets: Array | Sequence[int], input_lengths: Array | Sequence[int],
             target_lengths: Array | Sequence[int], blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> Array:
    """Connectionist temporal classification loss, as torch.nn.functional.ctc_loss.

    For a sequence n with input length T_n, target l of length S_n and the extended target
    l' = (blank, l_1, blank, ..., l_S, blank), the loss is minus the log-probability of every
    alignment that collapses to l (repeats merged, then blanks removed):

      ``loss_n = -log sum_{pi in B^-1(l)} prod_{t < T_n} exp(log_probs[t, n, pi_t])``

    computed by the forward recursion in log space (kernels/ctc.cu has it).  'mean' divides
    each loss_n by max(S_n, 1), then takes the mean over the batch; 'sum' adds them.  A target
    that needs more frames than T_n (its labels plus a blank between each repeated pair) has
    loss inf; zero_infinity=True makes such losses (and their gradients) 0.

    Args:
      log_probs: (T, N, C) log-probabilities (a log_softmax over C), or (T, C) unbatched; any
        strides; float16, bfloat16, float32, float64.
      targets: padded (N, S) or concatenated (sum(target_lengths),) class indices, never the
        blank, int32 or int64; (S,) unbatched.
      input_lengths: (N,) frames of each sequence, each at most T; () unbatched.
      target_lengths: (N,) labels of each target, each at most S; () unbatched.
      blank: the blank's class, in [0, C).
      reduction: 'none' | 'mean' | 'sum'.
      zero_infinity: replace infinite losses and their gradients by 0.

    Returns:
      The loss: (N,) for 'none' (0-d unbatched), else 0-d; log_probs' dtype.

    Example:
      >>> lp = cupy.random.randn(1000, 32, 1024, dtype=cupy.float32)
      >>> lp -= cupy.log(cupy.exp(lp).sum(-1, keepdims=True))
      >>> tg = cupy.random.randint(1, 1024, (32, 200))
      >>> cupyloss.ctc_loss(lp, tg, [1000] * 32, [200] * 32)
    """
    return evaluate(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                    zero_infinity)[0]


def ctc_loss_backward(grad_output: Array | float, log_probs: Array,
                      targets: Array | Sequence[int], input_lengths: Array | Sequence[int],
                      target_lengths: Array | Sequence[int], blank: int = 0,
                      reduction: str = "mean", zero_infinity: bool = False, *,
                      wrt: str | Sequence[str] | None = "log_probs") -> Any:
    """The gradient of ctc_loss with respect to log_probs, as torch returns it.

    With alpha and beta the forward and backward variables of sequence n (each holding
    log_probs at its own step), nll_n its loss and g its upstream gradient (grad_output, over
    N max(S_n, 1) for 'mean'), for t < T_n:

      ``grad[t, n, c] = g (exp(lp[t, n, c]) - exp(lse_{s: l'_s = c}(alpha_t(s) + beta_t(s)) + nll_n - lp[t, n, c]))``

    and 0 for t >= T_n.  This is torch's CTC gradient: the derivative with respect to the
    logits of the log_softmax that made log_probs (the plain derivative with respect to
    log_probs lacks the exp(lp) term); through log_softmax's own backward both give the same
    logits gradient (docs/differences.md).  An infinite loss gives NaN for t < T_n, as torch's
    does, or 0 with zero_infinity.

    Args:
      grad_output: a Python number, a 0-d array of log_probs' dtype and framework, or for
        'none' an (N,) array.
      log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity: as
        for ctc_loss.
      wrt: "log_probs" (the gradient alone, the default) or ("log_probs",) (a 1-tuple).

    Returns:
      The gradient: log_probs' shape and dtype, C-contiguous.

    Example:
      >>> g = cupyloss.ctc_loss_backward(1.0, lp, tg, [1000] * 32, [200] * 32)
    """
    names, single = _validate.check_wrt(wrt, _WRT)
    grad = evaluate(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                    zero_infinity, want_value=False, want_grad=bool(names),
                    grad_output=grad_output)[1]
    return grad if single else (grad,) * len(names)


def ctc_loss_value_and_grad(log_probs: Array, targets: Array | Sequence[int],
                            input_lengths: Array | Sequence[int],
                            target_lengths: Array | Sequence[int], blank: int = 0,
                            reduction: str = "mean", zero_infinity: bool = False, *,
                            grad_output: Array | float = 1.0,
                            wrt: str | Sequence[str] | None = "log_probs") -> tuple[Array, Any]:
    """ctc_loss and its gradient from one forward recursion.

    alpha is kept from the loss's recursion for the gradient's: the loss costs no second
    forward pass.

    Args:
      log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity: as
        for ctc_loss.
      grad_output, wrt: as for ctc_loss_backward.

    Example:
      >>> loss, g = cupyloss.ctc_loss_value_and_grad(lp, tg, [1000] * 32, [200] * 32)
    """
    names, single = _validate.check_wrt(wrt, _WRT)
    loss, grad = evaluate(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                          zero_infinity, want_value=True, want_grad=bool(names),
                          grad_output=grad_output)
    return loss, (grad if single else (grad,) * len(names))


_docs.derive(globals(), SPECS)
