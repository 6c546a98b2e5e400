"""Fused linear cross entropy: a language model's output layer and its loss, logits never whole.

For hidden states X (N, H), a weight W (V, H) as torch.nn.Linear stores it, an optional bias b
(V,) and class indices t (N,):

    logits  Z = X W^T + b          (float32 accumulation, kept in float32: float64 for float64)
    loss    cross_entropy(Z, t, ...)   exactly as cupyloss.cross_entropy on those logits

The rows are taken in chunks whose float32 logits fit a workspace budget: per chunk one cuBLAS
product forms the logits, the row-wise cross-entropy kernel turns them into their gradient dZ in
place (value and gradient from one read), and two more products give dX = dZ W for the chunk's
rows and add dZ^T X into the weight's gradient.  So a 'mean' or 'sum' call does three matrix
products in all and forms every gradient in the forward pass; the logits and their gradient are
never held for more than one chunk.

  * dZ is rounded to the inputs' dtype before the two gradient products (as torch's autograd does
    through ``(X @ W.T).float()``); every product accumulates in float32 (cuBLAS's
    CUBLAS_COMPUTE_32F; float64 inputs: 64F).
  * The weight's and bias's gradients are summed over the chunks in float32 and rounded to the
    weight's dtype once at the end (never per chunk); for float32 weights the sum is the result.
  * 'mean' divides by the summed class weights of the counted rows (their number without class
    weights), computed on the device: no host synchronisation anywhere.
  * Results are deterministic: cuBLAS's default algorithms have no atomics, and the chunks are
    added in order.

Peak memory beyond the inputs and the results follows from ``max_workspace_bytes``:

  * a budget that holds every row's 16-bit dZ (N x V of the inputs' dtype) and 128 rows of
    float32 logits besides keeps dZ whole, and the weight's gradient is one product at the end
    (k = N, float32 accumulation inside cuBLAS, rounded once): the fastest plan (plan_keeps_dz);
  * a smaller one takes chunks of rows x V float32 logits and their 16-bit copy within it, and
    sums the weight's gradient over the chunks in a float32 V x H array (reads and writes it
    once a chunk), rounded at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy

from cupyloss import _args, _dispatch, _dtypes
from cupyloss._types import Array

__all__ = ["linear_cross_entropy", "linear_cross_entropy_backward",
           "linear_cross_entropy_value_and_grad", "chunk_rows", "plan_keeps_dz",
           "DEFAULT_WORKSPACE_BYTES"]

# The workspace a call may use by default: at 8192 x 4096 bfloat16 hidden states and 128256
# classes it keeps every row's dZ (2 GiB) with 1024-row chunks of logits, the fastest budget
# measured there (bench_linear, H100, forward + backward, ms / peak GiB above the inputs: 1 GiB
# 48.1 / 3.9, 2.5 GiB 41.0 / 3.5, 4 GiB 42.1 / 5.0, 6 GiB 41.1 / 6.9); larger batches take
# chunks within it.
DEFAULT_WORKSPACE_BYTES = 2560 << 20

_REDUCTIONS = ("none", "mean", "sum")
# scale.cu's narrow<T>(src, out, n).
NARROW = _args.Layout([("src", 1), ("out", 1), ("n", 1)])
_GRAD_NAMES = ("hidden", "weight", "bias")

# cuBLAS / CUDA library enums (cublas_api.h, library_types.h).
_OP_N, _OP_T = 0, 1
_CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_COMPUTE_32F, _COMPUTE_64F = 68, 70
_GEMM_DEFAULT = -1


def chunk_rows(n: int, classes: int, itemsize: int, budget: int | None = None) -> int:
    """Rows per chunk for n rows of `classes` logits: as many as fit `budget` bytes (default
    DEFAULT_WORKSPACE_BYTES) of float32 logits plus their copy in the inputs' dtype (none for
    float32; float64 logits for float64 inputs), a multiple of 128 where that leaves at least
    128 (the products' tile), at least 1 and at most n."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else int(budget)
    logit = 8 if itemsize == 8 else 4
    per_row = classes * (logit + (itemsize if itemsize < 4 else 0))
    rows = max(1, budget // max(per_row, 1))
    if rows >= 128:
        rows -= rows % 128
    return max(1, min(rows, n))


def plan_keeps_dz(n: int, classes: int, itemsize: int, budget: int | None = None) -> bool:
    """Whether a call on 16-bit inputs keeps every row's dZ (n x classes of the inputs' dtype)
    and forms the weight's gradient in one product: when `budget` (default
    DEFAULT_WORKSPACE_BYTES) holds them and 128 rows of float32 logits besides."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else int(budget)
    return itemsize == 2 and budget >= n * classes * itemsize + 128 * classes * 4


def _names(wrt) -> tuple[tuple[str, ...], bool]:
    if wrt is None:
        return ("hidden", "weight"), False
    single = isinstance(wrt, str)
    names = (wrt,) if single else tuple(wrt)
    for name in names:
        if name not in _GRAD_NAMES:
            raise ValueError(f"wrt names gradients of {_GRAD_NAMES}, got {name!r}")
    return names, single


def _check(hidden, weight, target, bias, class_weight, reduction, label_smoothing,
           lse_square_scale, softcap, names):
    """Validation before any launch (the arguments are Operands, or None): shapes, dtypes,
    options.  Returns (N, H, V)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if hidden.dtype not in _dtypes.DTYPES:
        raise TypeError(f"hidden has dtype {hidden.dtype}; cupyloss takes float16, bfloat16, "
                        f"float32 and float64")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} and hidden {hidden.dtype}; they must "
                        f"match")
    if len(hidden.shape) < 1:
        raise ValueError("hidden must have at least one dimension (..., H)")
    h = hidden.shape[-1]
    if math.prod(weight.shape) == 0 or len(weight.shape) != 2 or weight.shape[1] != h:
        raise ValueError(
            f"weight must be (V, H) = (classes, {h}) as torch.nn.Linear stores it, got shape "
            f"{tuple(weight.shape)}; an empty or flat weight is usually a sharded parameter "
            f"(ZeRO-3 / FSDP) read outside its gather")
    v = weight.shape[0]
    if target.dtype.kind not in "iu":
        raise TypeError(f"target must hold class indices (int32 or int64), got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target's shape {tuple(target.shape)} must be hidden's without its "
                         f"last dim, {tuple(hidden.shape[:-1])}")
    if bias is not None and (tuple(bias.shape) != (v,) or bias.dtype != hidden.dtype):
        raise ValueError(f"bias must be ({v},) of hidden's dtype, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if class_weight is not None and (tuple(class_weight.shape) != (v,)
                                     or class_weight.dtype != hidden.dtype):
        raise ValueError(f"class_weight must be ({v},) of hidden's dtype, got "
                         f"{tuple(class_weight.shape)} {class_weight.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no cap), got {softcap}")
    if "bias" in names and bias is None:
        raise ValueError("wrt names 'bias' but no bias was given")
    return math.prod(hidden.shape[:-1]), h, v


class _Blas:
    """cuBLAS products C = alpha op(A) op(B) + beta C through CuPy's handle, column-major
    arguments (a row-major (r, c) array is a column-major (c, r) one with ld = c)."""

    def __init__(self, dtype):
        import cupy
        from cupy_backends.cuda.libs import cublas

        self._gemm = cublas.gemmEx
        self._handle = cupy.cuda.device.get_cublas_handle()
        wide = dtype == numpy.float64
        self._compute = _COMPUTE_64F if wide else _COMPUTE_32F
        scalar = numpy.float64 if wide else numpy.float32
        self._one = numpy.ones(1, scalar)
        self._zero = numpy.zeros(1, scalar)

    def gemm(self, ta, tb, m, n, k, a, lda, b, ldb, c, ldc, accumulate=False):
        beta = self._one if accumulate else self._zero
        self._gemm(self._handle, ta, tb, m, n, k, self._one.ctypes.data,
                   a.data.ptr, _CUDA_TYPE[str(a.dtype)], lda,
                   b.data.ptr, _CUDA_TYPE[str(b.dtype)], ldb,
                   beta.ctypes.data, c.data.ptr, _CUDA_TYPE[str(c.dtype)], ldc,
                   self._compute, _GEMM_DEFAULT)


def _narrow(src, out, stream, device) -> None:
    """out[...] = src rounded to out's 16-bit dtype (scale.cu's narrow; contiguous arrays)."""
    from cupyloss import _launch, _source

    n = src.size
    if (src.data.ptr | out.data.ptr) & 15:
        out[...] = src
        return
    info = _dtypes.DTYPES[out.dtype]
    function = _source.function("scale.cu", _source.narrow_name(info.ctype))
    cfg = _launch.flat_launch(n, 8, _launch.device_limits(device))
    _args.launch(function.kernel.ptr, cfg.grid, cfg.block, 0, stream,
                 NARROW.template({"src": src.data.ptr, "out": out.data.ptr, "n": n}))


def _contiguous(cp, a):
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def _run(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
         lse_square_scale, softcap, max_workspace_bytes, want_value, names, grad_output,
         return_lse):
    """The chunked loop (module docstring); returns (loss, {name: grad}, lse) in the caller's
    framework (loss None unless want_value, lse None unless return_lse)."""
    import cupy

    import cupyloss

    frame = _dispatch.frame_of(hidden, "hidden")
    ops = {}
    for name, x in (("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias),
                    ("class_weight", class_weight)):
        if x is None:
            continue
        if _dispatch.frame_of(x, name) is not frame:
            _dispatch.check_same_frame(frame, _dispatch.frame_of(x, name), hidden, x, "hidden",
                                       name)
        ops[name] = frame.operand(x, name) if name != "target" else _target_operand(frame, x)
    n, h, v = _check(ops["hidden"], ops["weight"], ops["target"], ops.get("bias"),
                     ops.get("class_weight"), reduction, label_smoothing, lse_square_scale,
                     softcap, names)
    device = ops["hidden"].device
    if any(op.device != device for op in ops.values()):
        raise ValueError("hidden, weight, target and the optional arrays must be on one device")
    stream = frame.stream(device)
    grad_go = None
    if not isinstance(grad_output, (int, float)):
        grad_go = frame.cupy_view(frame.operand(grad_output, "grad_output"))
    with cupy.cuda.Device(device), \
            cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)), \
            frame.scratch_allocator():
        views = {name: frame.cupy_view(op) for name, op in ops.items()}
        x = _contiguous(cupy, views["hidden"].reshape(n, h))
        w = _contiguous(cupy, views["weight"])
        t = views["target"].reshape(n)
        b = views.get("bias")
        cw = views.get("class_weight")
        dtype = x.dtype
        logit_dtype = numpy.dtype(numpy.float64 if dtype == numpy.float64 else numpy.float32)
        if cw is not None and cw.dtype != logit_dtype:   # the row kernel's, like the logits
            cw = cw.astype(logit_dtype)
        want = {name: name in names for name in _GRAD_NAMES}
        narrow = dtype.itemsize < logit_dtype.itemsize
        # Where the budget holds every row's 16-bit dZ besides a chunk of logits, dZ is kept
        # whole and the weight's gradient is one product at the end (k = N, rounded once by
        # cuBLAS): no float32 sum of V x H read and written per chunk.
        keep = narrow and want["weight"] and plan_keeps_dz(n, v, dtype.itemsize,
                                                           max_workspace_bytes)
        budget = DEFAULT_WORKSPACE_BYTES if max_workspace_bytes is None else max_workspace_bytes
        rows = (chunk_rows(n, v, 4, budget - n * v * dtype.itemsize) if keep
                else chunk_rows(n, v, dtype.itemsize, budget))
        blas = _Blas(dtype)
        logits = cupy.empty((min(rows, max(n, 1)), v), logit_dtype)
        dz16 = (cupy.empty((n, v) if keep else logits.shape, dtype) if narrow and names
                else None)
        gx = cupy.empty((n, h), dtype) if want["hidden"] else None
        # The weight's and bias's gradients, summed over chunks in the logits' precision.
        gw_sum = (cupy.empty((v, h), dtype if keep else logit_dtype) if want["weight"]
                  else None)
        gb_sum = cupy.zeros((v,), logit_dtype) if want["bias"] else None
        # The upstream gradient of each row's loss: grad_output over the 'mean' divisor.
        if reduction == "mean":
            valid = t != ignore_index
            if cw is None:
                divisor = valid.sum(dtype=logit_dtype)
            else:
                divisor = (cw[cupy.where(valid, t, 0)].astype(logit_dtype) * valid).sum()
        else:
            divisor = None
        if reduction == "none":
            scale = grad_go.reshape(n) if grad_go is not None else float(grad_output)
        else:
            g = grad_go.astype(logit_dtype) if grad_go is not None else logit_dtype.type(
                grad_output)
            scale = (g / divisor if divisor is not None else cupy.asarray(g, logit_dtype))
        nchunks = -(-n // rows) if n else 0
        losses = (cupy.empty((nchunks,), logit_dtype) if want_value and reduction != "none"
                  else None)
        loss_rows = cupy.empty((n,), logit_dtype) if want_value and reduction == "none" else None
        lse = cupy.empty((n,), logit_dtype) if return_lse else None
        for i in range(nchunks):
            r0, r1 = i * rows, min(n, (i + 1) * rows)
            m = r1 - r0
            z = logits[:m]
            xc = x[r0:r1]
            if b is not None:
                z[...] = b
            # Z^T (V x m, column-major) = W (H x V col-major)^T X_c (H x m col-major)
            blas.gemm(_OP_T, _OP_N, v, m, h, w, h, xc, h, z, v, accumulate=b is not None)
            go = scale[r0:r1] if reduction == "none" and not isinstance(scale, float) else scale
            out = cupyloss.cross_entropy_value_and_grad(
                z, t[r0:r1], cw, ignore_index, "none" if reduction == "none" else "sum",
                label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap,
                grad_output=go, wrt="input" if names else (), inplace=bool(names),
                return_lse=return_lse)
            if want_value:
                if reduction == "none":
                    loss_rows[r0:r1] = out[0]
                else:
                    losses[i] = out[0]
            if return_lse:
                lse[r0:r1] = out[2]
            if not names:
                continue
            dz = z
            if dz16 is not None:
                dz = dz16[r0:r1] if keep else dz16[:m]
                _narrow(z, dz, stream, device)
            if want["bias"]:
                gb_sum += dz.sum(axis=0, dtype=logit_dtype)
            if want["hidden"]:
                # dX_c^T (H x m) = W (H x V col-major) dZ^T (V x m col-major)
                blas.gemm(_OP_N, _OP_N, h, m, v, w, h, dz, v, gx[r0:r1], h)
            if want["weight"] and not keep:
                # dW^T (H x V) += X_c (H x m col-major) (dZ^T (V x m col-major))^T
                blas.gemm(_OP_N, _OP_T, h, v, m, xc, h, dz, v, gw_sum, h, accumulate=i > 0)
        if keep and n:
            blas.gemm(_OP_N, _OP_T, h, v, n, x, h, dz16, v, gw_sum, h)
        grads = {}
        if want["hidden"]:
            grads["hidden"] = gx.reshape(tuple(ops["hidden"].shape))
        if want["weight"]:
            if n == 0:
                gw_sum[...] = 0
            if gw_sum.dtype != dtype:
                gw = cupy.empty((v, h), dtype)
                _narrow(gw_sum, gw, stream, device)
                gw_sum = gw
            grads["weight"] = gw_sum
        if want["bias"]:
            grads["bias"] = gb_sum if gb_sum.dtype == dtype else gb_sum.astype(dtype)
        loss = None
        if want_value:
            if reduction == "none":
                loss = loss_rows.reshape(tuple(ops["hidden"].shape[:-1]))
            else:
                total = losses.sum(dtype=numpy.float64) if nchunks else cupy.zeros((), "f8")
                if divisor is not None:
                    total = total / divisor
                loss = total.astype(logit_dtype)
        if lse is not None:
            lse = lse.reshape(tuple(ops["hidden"].shape[:-1]))
    back = _back(frame)
    return (back(loss) if loss is not None else None,
            {k: back(a) for k, a in grads.items()},
            back(lse) if lse is not None else None)


def _target_operand(frame, target):
    """Class indices of any integer dtype the frame holds, as an Operand (the rowwise family's
    dtype table has float dtypes only)."""
    if frame.name == "torch":
        return _dispatch.Operand(target.data_ptr(), tuple(target.shape), target.stride(),
                                 numpy.dtype(str(target.dtype).replace("torch.", "")),
                                 target.get_device(), target)
    import cupy

    view = target if isinstance(target, cupy.ndarray) else cupy.from_dlpack(target)
    return _dispatch.Operand(view.data.ptr, view.shape,
                             tuple(s // view.itemsize for s in view.strides), view.dtype,
                             view.data.device_id, view)


def _back(frame):
    if frame.name == "torch":
        import torch

        return torch.from_dlpack
    return frame.result


def linear_cross_entropy(hidden: Array, weight: Array, target: Array, bias: Array | None = None,
                         class_weight: Array | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, *,
                         lse_square_scale: float = 0.0, softcap: float = 0.0,
                         max_workspace_bytes: int | None = None) -> Any:
    """cross_entropy(hidden @ weight.T + bias, target) without the logits in memory.

    ``Z = X W^T + b`` is formed chunk by chunk in float32 (float64 for float64 inputs) and never
    rounded to 16 bits; the loss is cupyloss.cross_entropy's on Z (torch's
    ``F.cross_entropy((hidden @ weight.T + bias).float(), target, ...)``), with its options:

      ``l_i = (1 - eps) w_y (lse_i - z_iy) + (eps / V) sum_c w_c (lse_i - z_ic)
      + lse_square_scale lse_i^2``, 0 where ``y == ignore_index``, then reduced ('mean' over
      the summed w_y of the counted rows).

    Args:
      hidden: (..., H), float16, bfloat16, float32 or float64.
      weight: (V, H) of hidden's dtype, as torch.nn.Linear stores it.
      target: class indices (int32/int64) shaped like hidden without its last dim.
      bias: None or (V,) of hidden's dtype.
      class_weight: None or (V,) of hidden's dtype (cross_entropy's `weight`).
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap: as for
        cupyloss.cross_entropy (class-index targets only).
      max_workspace_bytes: bytes of chunk logits a call may hold (default
        DEFAULT_WORKSPACE_BYTES); the chunk rows follow from it (chunk_rows).

    Returns:
      The loss: 0-d for 'mean'/'sum', else hidden's shape without its last dim; float32
      (float64 for float64 inputs), the logits' precision.

    Example:
      >>> loss = cupyloss.linear_cross_entropy(h, lm_head_weight, labels)
    """
    return _run(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                label_smoothing, lse_square_scale, softcap, max_workspace_bytes, True, (), 1.0,
                False)[0]


def linear_cross_entropy_backward(grad_output: Array | float, hidden: Array, weight: Array,
                                  target: Array, bias: Array | None = None,
                                  class_weight: Array | None = None, ignore_index: int = -100,
                                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                                  lse_square_scale: float = 0.0, softcap: float = 0.0,
                                  max_workspace_bytes: int | None = None,
                                  wrt: str | Sequence[str] | None = None) -> Any:
    """Gradients of linear_cross_entropy (the logits formed again, chunk by chunk).

    With dZ the gradient of cross_entropy at the logits (cupyloss.cross_entropy_backward's, g the
    upstream gradient over the 'mean' divisor), rounded to hidden's dtype:

      ``d/dhidden = dZ W``,   ``d/dweight = dZ^T X``,   ``d/dbias = sum_rows dZ``

    the last two summed over the chunks in float32 and rounded once.

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      hidden, ..., max_workspace_bytes: as for linear_cross_entropy.
      wrt: 'hidden', 'weight', 'bias' or a tuple of them (default: hidden and weight).

    Returns:
      The gradients named by wrt (a tuple, or one array for a single name), each of its
      argument's shape and dtype.

    Example:
      >>> g_hidden, g_weight = cupyloss.linear_cross_entropy_backward(1.0, h, w, labels)
    """
    names, single = _names(wrt)
    _, grads, _ = _run(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                       label_smoothing, lse_square_scale, softcap, max_workspace_bytes, False,
                       names, grad_output, False)
    out = tuple(grads[name] for name in names)
    return out[0] if single else out


def linear_cross_entropy_value_and_grad(hidden: Array, weight: Array, target: Array,
                                        bias: Array | None = None,
                                        class_weight: Array | None = None,
                                        ignore_index: int = -100, reduction: str = "mean",
                                        label_smoothing: float = 0.0, *,
                                        lse_square_scale: float = 0.0, softcap: float = 0.0,
                                        max_workspace_bytes: int | None = None,
                                        grad_output: Array | float = 1.0,
                                        wrt: str | Sequence[str] | None = None,
                                        return_lse: bool = False) -> tuple[Any, ...]:
    """linear_cross_entropy and its gradients in one pass: three matrix products in all.

    Args:
      hidden, ..., max_workspace_bytes: as for linear_cross_entropy.
      grad_output, wrt: as for linear_cross_entropy_backward.
      return_lse: also return each row's logsumexp of the (capped) logits, float32.

    Returns:
      ``(loss, grads)`` or ``(loss, grads, lse)``: loss as from linear_cross_entropy, grads as
      from linear_cross_entropy_backward.

    Example:
      >>> loss, (g_hidden, g_weight) = cupyloss.linear_cross_entropy_value_and_grad(h, w, y)
    """
    names, single = _names(wrt)
    loss, grads, lse = _run(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                            label_smoothing, lse_square_scale, softcap, max_workspace_bytes,
                            True, names, grad_output, return_lse)
    out = tuple(grads[name] for name in names)
    out = out[0] if single else out
    return (loss, out, lse) if return_lse else (loss, out)
