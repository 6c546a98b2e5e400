"""Row-pair losses with torch.nn.functional's names, arguments and semantics:
triplet_margin_loss and cosine_embedding_loss, each as ``f``, ``f_backward`` and
``f_value_and_grad``.

Common rules:
  * The inputs are GPU arrays of one framework (cupy.ndarray, torch CUDA tensor, JAX GPU array or
    any CUDA DLPack array), of one shape and one dtype (float16, bfloat16, float32 or float64),
    read in place with any strides and never written.  A row is the last axis; the loss of a row
    comes from sums along it.  Shapes must match exactly: torch would broadcast a size-1 dim,
    cupyloss raises ValueError instead.
  * reduction: 'none' returns the loss per row (the input's shape without its last dim); 'sum'
    and 'mean' a 0-d array ('mean' of no rows is NaN, as in torch).
  * Results have the inputs' dtype (16-bit inputs accumulate in float32) and come back in the
    caller's framework, allocated by it, on its current stream.  Nothing is read back to the host,
    and every sum runs in a fixed order: the same inputs on the same device give bitwise the same
    results.
  * grad_output: a Python number, a 0-d array of the inputs' dtype and framework (read on the
    device), or for reduction='none' an array of the loss's shape.
  * value_and_grad reads every input once: a row's sums are reduced on chip while the row stays
    in registers, and the gradients are written from there in the same launch.
"""

from __future__ import annotations

from cupyloss._core import docs as _docs
from cupyloss._types import Any, Array, Sequence
from cupyloss._core import validate as _validate
from cupyloss.rowpair._family import SPECS, evaluate

_TRIPLET, _COSINE = SPECS["triplet_margin_loss"], SPECS["cosine_embedding_loss"]


def _pick(spec, grads, names, single):
    got = dict(zip([n for n in spec.arrays if n != spec.target], grads))
    picked = tuple(got[n] for n in names)
    return picked[0] if single else picked


# --- triplet_margin_loss ------------------------------------------------------------------------

def triplet_margin_loss(anchor: Array, positive: Array, negative: Array, margin: float = 1.0,
                        p: float = 2.0, eps: float = 1e-6, swap: bool = False,
                        reduction: str = "mean") -> Array:
    """Triplet margin loss, as torch.nn.functional.triplet_margin_loss.

    Per row, with torch's pairwise distance ``d(x, y) = ||x - y + eps||_p`` along the last axis:

      ``l = max(margin + d(a, p) - d(a, n), 0)``

    and with swap=True ``d(a, n)`` is replaced by ``min(d(a, n), d(p, n))`` (the distance swap of
    Balntas et al., 2016).  Sums of ``|.|^p`` run in float32 (float64 for float64 inputs).

    Args:
      anchor, positive, negative: (D,), (N, D) or (N, d1, ..., D), one shape; float16, bfloat16,
        float32, float64.
      margin: > 0 (torch raises ValueError otherwise, and so does this).
      p: the norm degree, a finite p > 0 (p=1, p=2 take fast paths).
      eps: added to every difference before the norm.
      swap: use the distance swap.
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d for 'mean'/'sum', else the inputs' shape without the last dim; their dtype.

    Example:
      >>> a, p, n = (cupy.random.randn(32768, 8192, dtype=cupy.float32) for _ in range(3))
      >>> cupyloss.triplet_margin_loss(a, p, n, margin=1.0)
    """
    return evaluate(_TRIPLET, (anchor, positive, negative), (margin, p, eps, swap),
                    reduction=reduction)[0]


def triplet_margin_loss_backward(grad_output: Array | float, anchor: Array, positive: Array,
                                 negative: Array, margin: float = 1.0, p: float = 2.0,
                                 eps: float = 1e-6, swap: bool = False, reduction: str = "mean",
                                 *, wrt: str | Sequence[str] | None = (
                                     "anchor", "positive", "negative")) -> Any:
    """Gradients of triplet_margin_loss, equal to torch autograd's.

    With u = a - p + eps, v = a - n + eps, w = p - n + eps, phi(x) = sign(x) |x|^(p-1) and g the
    row's upstream gradient (grad_output, over N for 'mean'), where ``margin + d_ap - d_an >= 0``
    (0 elsewhere):

      ``dl/da = c_ap phi(u) - c_an phi(v)``,  ``dl/dp = -c_ap phi(u) - c_pn phi(w)``,
      ``dl/dn = c_an phi(v) + c_pn phi(w)``,  ``c_xy = g w_xy d_xy^(1-p)`` (0 where d_xy = 0)

    with w_ap = w_an = 1, w_pn = 0 without swap; with swap the negative term goes to whichever of
    d(a, n), d(p, n) is smaller (half each on a tie, as torch's minimum).

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      anchor, positive, negative, margin, p, eps, swap, reduction: as for triplet_margin_loss.
      wrt: a name of ("anchor", "positive", "negative") (returns that gradient alone) or a tuple
        of them (returns a tuple; default all three).  Only the gradients named are written.

    Returns:
      The gradients named by wrt, each of the inputs' shape and dtype (C-contiguous).

    Example:
      >>> ga, gp, gn = cupyloss.triplet_margin_loss_backward(1.0, a, p, n)
    """
    names, single = _validate.check_wrt(wrt, _TRIPLET.differentiable)
    got = evaluate(_TRIPLET, (anchor, positive, negative), (margin, p, eps, swap),
                   reduction=reduction, want_value=False, wrt=names, grad_output=grad_output)
    return _pick(_TRIPLET, got[1:], names, single)


def triplet_margin_loss_value_and_grad(anchor: Array, positive: Array, negative: Array,
                                       margin: float = 1.0, p: float = 2.0, eps: float = 1e-6,
                                       swap: bool = False, reduction: str = "mean", *,
                                       grad_output: Array | float = 1.0,
                                       wrt: str | Sequence[str] | None = (
                                           "anchor", "positive", "negative"),
                                       ) -> tuple[Array, Any]:
    """triplet_margin_loss and its gradients from one read of the inputs.

    Each row's norms are reduced on chip while the row stays in registers, then its gradients are
    written in the same launch: the inputs are read once, the gradients written once.

    Args:
      anchor, positive, negative, margin, p, eps, swap, reduction: as for triplet_margin_loss.
      grad_output, wrt: as for triplet_margin_loss_backward.


    Example:
      >>> loss, (ga, gp, gn) = cupyloss.triplet_margin_loss_value_and_grad(a, p, n)
    """
    names, single = _validate.check_wrt(wrt, _TRIPLET.differentiable)
    got = evaluate(_TRIPLET, (anchor, positive, negative), (margin, p, eps, swap),
                   reduction=reduction, want_value=True, wrt=names, grad_output=grad_output)
    return got[0], _pick(_TRIPLET, got[1:], names, single)


# --- cosine_embedding_loss ----------------------------------------------------------------------

def cosine_embedding_loss(input1: Array, input2: Array, target: Array, margin: float = 0.0,
                          reduction: str = "mean") -> Array:
    """Cosine embedding loss, as torch.nn.functional.cosine_embedding_loss.

    Per row, with torch's ``EPSILON = 1e-12`` in the denominator:

      ``cos = sum(x1 x2) / sqrt((sum(x1^2) + 1e-12) (sum(x2^2) + 1e-12))``
      ``l = 1 - cos`` where target is 1, ``max(cos - margin, 0)`` where it is -1, 0 elsewhere.

    Args:
      input1, input2: (N, D) with a (N,) target, or (D,) with a 0-d target; one shape; float16,
        bfloat16, float32, float64.
      target: 1 or -1 per row; int32, int64 or the inputs' dtype (no gradient).
      margin: subtracted from cos for target -1 (torch suggests values in [-1, 1]).
      reduction: 'none' | 'mean' | 'sum'.

    Returns:
      The loss: 0-d for 'mean'/'sum', else (N,) for 2-d inputs; the inputs' dtype.

    Example:
      >>> x1, x2 = cupy.random.randn(2, 64, 128, dtype=cupy.float32)
      >>> y = cupy.where(cupy.random.rand(64) < 0.5, 1, -1)
      >>> cupyloss.cosine_embedding_loss(x1, x2, y, margin=0.2)
    """
    return evaluate(_COSINE, (input1, input2, target), (margin,), reduction=reduction)[0]


def cosine_embedding_loss_backward(grad_output: Array | float, input1: Array, input2: Array,
                                   target: Array, margin: float = 0.0, reduction: str = "mean", *,
                                   wrt: str | Sequence[str] | None = ("input1", "input2")) -> Any:
    """Gradients of cosine_embedding_loss, equal to torch autograd's.

    With m1 = sum(x1^2) + 1e-12, m2 = sum(x2^2) + 1e-12, r = sqrt(m1 m2) and g the row's upstream
    gradient (over N for 'mean'): ``k = -g`` where target is 1, ``k = g [cos - margin >= 0]``
    where it is -1, else 0, and

      ``dl/dx1 = k (x2 / r - cos x1 / m1)``,  ``dl/dx2 = k (x1 / r - cos x2 / m2)``

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      input1, input2, target, margin, reduction: as for cosine_embedding_loss.
      wrt: 'input1' or 'input2' (returns that gradient alone) or a tuple of them (returns a
        tuple; default both).  The target has no gradient.

    Returns:
      The gradients named by wrt, each of the inputs' shape and dtype (C-contiguous).

    Example:
      >>> g1, g2 = cupyloss.cosine_embedding_loss_backward(1.0, x1, x2, y)
    """
    names, single = _validate.check_wrt(wrt, _COSINE.differentiable)
    got = evaluate(_COSINE, (input1, input2, target), (margin,), reduction=reduction,
                   want_value=False, wrt=names, grad_output=grad_output)
    return _pick(_COSINE, got[1:], names, single)


def cosine_embedding_loss_value_and_grad(input1: Array, input2: Array, target: Array,
                                         margin: float = 0.0, reduction: str = "mean", *,
                                         grad_output: Array | float = 1.0,
                                         wrt: str | Sequence[str] | None = ("input1", "input2")
                                         ) -> tuple[Array, Any]:
    """cosine_embedding_loss and its gradients from one read of the inputs (see
    triplet_margin_loss_value_and_grad).


    Example:
      >>> loss, (g1, g2) = cupyloss.cosine_embedding_loss_value_and_grad(x1, x2, y)
    """
    names, single = _validate.check_wrt(wrt, _COSINE.differentiable)
    got = evaluate(_COSINE, (input1, input2, target), (margin,), reduction=reduction,
                   want_value=True, wrt=names, grad_output=grad_output)
    return got[0], _pick(_COSINE, got[1:], names, single)


_docs.derive(globals(), SPECS)
