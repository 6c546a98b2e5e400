"""Row-wise losses along the last axis: multi_margin_loss, multilabel_soft_margin_loss and
multilabel_margin_loss (torch.nn.functional's names, arguments and semantics) and jsd
(Liger-Kernel's generalised Jensen-Shannon divergence, a distillation loss torch lacks), each as
``f``, ``f_backward`` and ``f_value_and_grad``.

Common rules:
  * input is a GPU array of one framework (cupy.ndarray, torch CUDA tensor, JAX GPU array or any
    CUDA DLPack array) of dtype float16, bfloat16, float32 or float64; a row is its last axis
    (C elements).  Inputs are read in place and never written; a layout whose leading dims do not
    merge into one stride, or whose last axis is not contiguous, is copied first.
  * Results have the input's dtype (16-bit inputs accumulate in float32) and come back in the
    caller's framework, allocated by it, on its current stream.  Nothing is read back to the host
    (except with multi_margin_loss's check_targets) and every sum runs in a fixed order: the same
    inputs on the same device give bitwise the same results.
  * The value and the gradient come from one read of each operand: every element's gradient
    needs only that element (and, for multi_margin_loss, x_y and w_y, read before the row), so
    value_and_grad streams each row once.  multilabel_margin_loss is the exception: every
    element meets every target of its row, so a block holds a row (its targets as a bit mask
    in shared memory) and reads it once per pass.
  * grad_output: a Python number, a 0-d array of the input's dtype and framework (read on the
    device), or for reduction='none' an array of the loss's shape.
  * wrt: 'input' (the default: that gradient alone), 'target' (floating targets) or a tuple of
    names (a tuple of gradients, C-contiguous, of their arguments' shapes and dtype).
"""

from __future__ import annotations

from cupyloss._core import docs as _docs
from cupyloss._types import Any, Array, Sequence
from cupyloss.rowclass._family import SPECS, evaluate
from cupyloss.rowwise import _grads, _names

_MM = SPECS["multi_margin_loss"]
_ML = SPECS["multilabel_soft_margin_loss"]
_JSD = SPECS["jsd"]
_MLM = SPECS["multilabel_margin_loss"]


def _with_grads(spec, want_value, wrt, grad_output, *arrays, **options):
    """(the loss or None, the gradients wrt names: one, or a tuple for a tuple wrt) of a call
    of `spec` from one launch."""
    names, single = _names(wrt)
    value, gx, gt = evaluate(spec, *arrays, want_value=want_value, wrt=names,
                             grad_output=grad_output, **options)
    return value, _grads(names, single, gx, gt)


# --- multi_margin_loss ------------------------------------------------------------------------

def multi_margin_loss(input: Array, target: Array, p: float = 1, margin: float = 1.0,
                      weight: Array | None = None, reduction: str = "mean", *,
                      check_targets: bool = False) -> Array:
    """Multi-class hinge loss, as torch.nn.functional.multi_margin_loss.

    Per sample with scores x (C of them), class index y and class weights w (1 without):

      ``l = sum_{c != y} w_y max(0, margin - x_y + x_c)^p / C``,  p in {1, 2}

    then 'mean' over the samples (NaN for no samples) or 'sum'.  An index outside [0, C) is never
    used as an address: that sample's loss and its whole gradient row are NaN (so is a reduced
    loss); torch raises "target out of range" instead, as ``check_targets=True`` does here at the
    cost of a host synchronisation.

    Args:
      input: scores, (N, C), (C,) or 0-d; float16, bfloat16, float32, float64.
      target: class indices (int32 or int64) with N elements, 1-d or 0-d.
      p: 1 or 2.
      margin: the margin.
      weight: None or (C,) of input's dtype: w_y scales sample's loss.
      reduction: 'none' (the loss per sample, the target's shape) | 'mean' | 'sum'.
      check_targets: raise IndexError for an out-of-range index (synchronises).

    Returns:
      The loss: 0-d for 'mean'/'sum', else the target's shape; input's dtype.

    Example:
      >>> x = cupy.random.randn(8, 10).astype(cupy.float32)
      >>> y = cupy.random.randint(0, 10, 8)
      >>> cupyloss.multi_margin_loss(x, y, p=2, margin=0.5)
    """
    return evaluate(_MM, input, target, weight, reduction=reduction, p=p, margin=margin,
                    check=check_targets)[0]


def multi_margin_loss_backward(grad_output: Array | float, input: Array, target: Array,
                               p: float = 1, margin: float = 1.0, weight: Array | None = None,
                               reduction: str = "mean", *, check_targets: bool = False,
                               wrt: str | Sequence[str] | None = "input") -> Any:
    """Gradient of multi_margin_loss, equal to torch autograd's.

    With z_c = margin - x_y + x_c and g the sample's upstream gradient (over N for 'mean'):

      ``dl/dx_c = g w_y (p == 1 ? 1 : 2 z_c) [z_c > 0] / C`` for c != y,
      ``dl/dx_y = -sum_{c != y} dl/dx_c``

    (a tie z_c = 0 gives 0, as torch).

    Returns:
      The input's gradient (or a one-element tuple for a tuple wrt), its shape and dtype.

    Example:
      >>> g = cupyloss.multi_margin_loss_backward(1.0, x, y)
    """
    return _with_grads(_MM, False, wrt, grad_output, input, target, weight, reduction=reduction,
                       p=p, margin=margin, check=check_targets)[1]


def multi_margin_loss_value_and_grad(input: Array, target: Array, p: float = 1,
                                     margin: float = 1.0, weight: Array | None = None,
                                     reduction: str = "mean", *, check_targets: bool = False,
                                     grad_output: Array | float = 1.0,
                                     wrt: str | Sequence[str] | None = "input"
                                     ) -> tuple[Array, Any]:
    """multi_margin_loss and its gradient from one read of the input (one launch).


    Example:
      >>> loss, g = cupyloss.multi_margin_loss_value_and_grad(x, y, margin=0.5)
    """
    return _with_grads(_MM, True, wrt, grad_output, input, target, weight, reduction=reduction,
                       p=p, margin=margin, check=check_targets)


# --- multilabel_soft_margin_loss --------------------------------------------------------------

def multilabel_soft_margin_loss(input: Array, target: Array, weight: Array | None = None,
                                reduction: str = "mean") -> Array:
    """Multi-label one-versus-all logistic loss, as torch.nn.functional.multilabel_soft_margin_loss.

    Per row of logits x and targets t (C of them, the last axis) and weights w (1 without):

      ``l = -sum_c w_c (t_c log sigmoid(x_c) + (1 - t_c) log sigmoid(-x_c)) / C``

    evaluated as ``w_c (t_c max(-x_c, 0) + (1 - t_c) max(x_c, 0) + log1p(exp(-|x_c|)))``, which
    neither overflows nor cancels for t in [0, 1]; then 'mean' over the rows (NaN for none) or
    'sum'.

    Args:
      input: logits, (..., C) with at least one dim; float16, bfloat16, float32, float64.
      target: the input's shape and dtype (labels in [0, 1], soft labels allowed).
      weight: None or an array of input's dtype that broadcasts to the input's shape (torch
        multiplies it elementwise), typically (C,).
      reduction: 'none' (the input's shape without its last dim) | 'mean' | 'sum'.

    Returns:
      The loss: 0-d for 'mean'/'sum', else input.shape[:-1]; input's dtype.

    Example:
      >>> x = cupy.random.randn(8, 20).astype(cupy.float32)
      >>> t = (cupy.random.rand(8, 20) < 0.2).astype(cupy.float32)
      >>> cupyloss.multilabel_soft_margin_loss(x, t)
    """
    return evaluate(_ML, input, target, weight, reduction=reduction)[0]


def multilabel_soft_margin_loss_backward(grad_output: Array | float, input: Array, target: Array,
                                         weight: Array | None = None, reduction: str = "mean", *,
                                         wrt: str | Sequence[str] | None = "input") -> Any:
    """Gradients of multilabel_soft_margin_loss, equal to torch autograd's.

    With g the row's upstream gradient (over the number of rows for 'mean'):

      ``dl/dx_c = g w_c (sigmoid(x_c) - t_c) / C``,   ``dl/dt_c = -g w_c x_c / C``

    (no gradient for weight).

    Returns:
      The gradients named by wrt ('input', 'target' or a tuple), each of the input's shape and
      dtype.

    Example:
      >>> gx, gt = cupyloss.multilabel_soft_margin_loss_backward(1.0, x, t, wrt=("input", "target"))
    """
    return _with_grads(_ML, False, wrt, grad_output, input, target, weight,
                       reduction=reduction)[1]


def multilabel_soft_margin_loss_value_and_grad(input: Array, target: Array,
                                               weight: Array | None = None,
                                               reduction: str = "mean", *,
                                               grad_output: Array | float = 1.0,
                                               wrt: str | Sequence[str] | None = "input"
                                               ) -> tuple[Array, Any]:
    """multilabel_soft_margin_loss and its gradients from one read of input and target.


    Example:
      >>> loss, g = cupyloss.multilabel_soft_margin_loss_value_and_grad(x, t)
    """
    return _with_grads(_ML, True, wrt, grad_output, input, target, weight, reduction=reduction)


# --- jsd --------------------------------------------------------------------------------------

def jsd(input: Array, target: Array, beta: float = 0.5, shift_labels: Array | None = None,
        ignore_index: int = -100, reduction: str = "mean") -> Array:
    """Generalised Jensen-Shannon divergence of log-probability rows, as Liger-Kernel's LigerJSD.

    A distillation loss torch lacks; its torch adapter module is ``cupyloss.torch.JSDLoss``.
    With Q = exp(input) (the student), P = exp(target) (the teacher), both along the last axis,
    and M = beta P + (1 - beta) Q, per row:

      ``l = beta KL(P || M) + (1 - beta) KL(Q || M)``
      ``  = sum_c beta P_c (y_c - log M_c) + (1 - beta) Q_c (x_c - log M_c)``

    beta = 0 is the forward KL(P || Q), beta = 1 the reverse KL(Q || P), beta = 0.5 the JSD.
    A row whose shift_labels entry equals ignore_index counts for nothing (loss 0, gradient 0).
    'mean' (the default, Liger's only reduction) divides the counted rows' sum by their number,
    and is 0 when no row counts (Liger's rule; cross_entropy follows torch's NaN instead); 'sum'
    adds the counted rows; 'none' returns the loss per row.  log M is formed as
    ``max(x, y) + log(beta e^(y - max) + (1 - beta) e^(x - max))``, so rows with log-probabilities
    far below float32's exp range give no NaN.

    Args:
      input: student log-probabilities, (..., V) with at least one dim (Liger: (BT, V));
        float16, bfloat16, float32, float64.
      target: teacher log-probabilities, the input's shape and dtype.
      beta: in [0, 1].
      shift_labels: None or class indices (int32/int64) of shape input.shape[:-1]; only their
        comparison with ignore_index matters.
      ignore_index: the label of rows that do not count.
      reduction: 'mean' | 'sum' | 'none' (input.shape[:-1]).

    Returns:
      The loss: 0-d for 'mean'/'sum', else input.shape[:-1]; input's dtype.

    Example:
      >>> s = cupy.log(cupy.random.dirichlet(cupy.ones(1000), 16)).astype(cupy.float32)
      >>> t = cupy.log(cupy.random.dirichlet(cupy.ones(1000), 16)).astype(cupy.float32)
      >>> cupyloss.jsd(s, t, beta=0.1)
    """
    return evaluate(_JSD, input, target, None, shift_labels, reduction=reduction, beta=beta,
                    ignore_index=ignore_index)[0]


def jsd_backward(grad_output: Array | float, input: Array, target: Array, beta: float = 0.5,
                 shift_labels: Array | None = None, ignore_index: int = -100,
                 reduction: str = "mean", *, wrt: str | Sequence[str] | None = "input") -> Any:
    """Gradients of jsd (Liger gives the input's; the target's is here too).

    With g the row's upstream gradient (over the counted rows for 'mean'), 0 on ignored rows:

      ``dl/dx_c = g (1 - beta) Q_c (x_c - log M_c)``,   ``dl/dy_c = g beta P_c (y_c - log M_c)``

    (beta = 0: ``-g P_c`` and ``g P_c (y_c - x_c + 1)``; beta = 1: ``g Q_c (x_c - y_c + 1)`` and
    ``-g Q_c``).

    Returns:
      The gradients named by wrt ('input', 'target' or a tuple), each of the input's shape and
      dtype.

    Example:
      >>> g = cupyloss.jsd_backward(1.0, s, t)
    """
    return _with_grads(_JSD, False, wrt, grad_output, input, target, None, shift_labels,
                       reduction=reduction, beta=beta, ignore_index=ignore_index)[1]


def jsd_value_and_grad(input: Array, target: Array, beta: float = 0.5,
                       shift_labels: Array | None = None, ignore_index: int = -100,
                       reduction: str = "mean", *, grad_output: Array | float = 1.0,
                       wrt: str | Sequence[str] | None = "input",
                       inplace: bool = False) -> tuple[Array, Any]:
    """jsd and its gradients from one read of input and target (two launches for a 'mean'
    gradient with shift_labels: the counted rows are counted on the device first).

    **inplace=True OVERWRITES THE INPUT: the student's log-probabilities receive their
    gradient** and the returned input gradient is the input array itself (C-contiguous CuPy or
    torch arrays; wrt must name the input).  No second input-sized array: use it only when
    nothing else still needs the input.

    Args:
      inplace: write the input gradient into input (see above).


    Example:
      >>> loss, g = cupyloss.jsd_value_and_grad(s, t, beta=0.5)
      >>> loss, g = cupyloss.jsd_value_and_grad(s, t, inplace=True)     # g is s
    """
    return _with_grads(_JSD, True, wrt, grad_output, input, target, None, shift_labels,
                       reduction=reduction, beta=beta, ignore_index=ignore_index, inplace=inplace)


# --- multilabel_margin_loss -------------------------------------------------------------------

def multilabel_margin_loss(input: Array, target: Array, reduction: str = "mean", *,
                           check_targets: bool = False) -> Array:
    """Multi-label hinge loss, as torch.nn.functional.multilabel_margin_loss.

    Per sample with scores x (C of them) and a row of class indices y (C of them, the targets
    y_0 .. y_{L-1} ended by the first -1, S the set of them):

      ``l = sum_{j < L} sum_{c not in S} max(0, 1 - x_{y_j} + x_c) / C``

    then 'mean' over the samples (0 for none, as torch) or 'sum'.  An index given twice counts
    twice, as torch's.  A row holding an index outside [-1, C) is never used as an address: its
    loss and its gradient row are NaN (so is a reduced loss); torch raises "argument #2
    'target' is out of range" instead, as ``check_targets=True`` does here at the cost of a host
    synchronisation.  Rows of up to about 390,000 classes (a bit of shared memory a class).

    Args:
      input: scores, (N, C), (C,) or 0-d; float16, bfloat16, float32, float64.
      target: class indices (int32 or int64) of the input's shape, each row ended by -1 unless
        every entry is a target.
      reduction: 'none' (the loss per sample: (N,), or 0-d for a (C,) input) | 'mean' | 'sum'.
      check_targets: raise IndexError for an index outside [-1, C) (synchronises).

    Returns:
      The loss: 0-d for 'mean'/'sum', else input.shape[:-1]; input's dtype.

    Example:
      >>> x = cupy.random.randn(4, 6).astype(cupy.float32)
      >>> y = cupy.array([[3, 0, -1, 1, 1, 1]] * 4)   # classes 3 and 0
      >>> cupyloss.multilabel_margin_loss(x, y)
    """
    return evaluate(_MLM, input, target, reduction=reduction, check=check_targets)[0]


def multilabel_margin_loss_backward(grad_output: Array | float, input: Array, target: Array,
                                    reduction: str = "mean", *, check_targets: bool = False,
                                    wrt: str | Sequence[str] | None = "input") -> Any:
    """Gradient of multilabel_margin_loss, equal to torch autograd's.

    With z_jc = 1 - x_{y_j} + x_c and g the sample's upstream gradient (over N for 'mean'):

      ``dl/dx_c = g #{j < L : z_jc > 0} / C`` for c not in S,
      ``dl/dx_s = -g #{j < L : y_j = s} #{c not in S : z_sc > 0} / C`` for s in S

    (a tie z = 0 gives 0, as torch).

    Returns:
      The input's gradient (or a one-element tuple for a tuple wrt), its shape and dtype.

    Example:
      >>> g = cupyloss.multilabel_margin_loss_backward(1.0, x, y)
    """
    return _with_grads(_MLM, False, wrt, grad_output, input, target, reduction=reduction,
                       check=check_targets)[1]


def multilabel_margin_loss_value_and_grad(input: Array, target: Array, reduction: str = "mean",
                                          *, check_targets: bool = False,
                                          grad_output: Array | float = 1.0,
                                          wrt: str | Sequence[str] | None = "input"
                                          ) -> tuple[Array, Any]:
    """multilabel_margin_loss and its gradient from one launch.


    Example:
      >>> loss, g = cupyloss.multilabel_margin_loss_value_and_grad(x, y)
    """
    return _with_grads(_MLM, True, wrt, grad_output, input, target, reduction=reduction,
                       check=check_targets)


_docs.derive(globals(), SPECS)
