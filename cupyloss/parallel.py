"""Vocab-parallel cross entropy: the classes of each row split over GPUs, one exchange of per-row
statistics, never the logits.

Rank i of k holds the logits x_i (N, C_i) of classes c_i .. c_i + C_i - 1 of all C classes (the
slices of a tensor-parallel output layer, even or not) and every row's class index y (N,).  The
loss is cross_entropy on the concatenated logits, with every option of the row-wise kernel
(class weights, ignore_index, label smoothing over all C classes, z-loss, softcap):

  1. ``vocab_parallel_stats``: each rank reads its slice once and forms each row's softmax state
     over it (rowwise.cu's cross_entropy_slice_stats):
        m = max_c z_c,  s = sum_c exp(z_c - m),  a = sum_c u_c (m - z_c),  b = sum_c u_c,
        t = z_y where y falls in the slice, else 0        (u_c = w_c with label smoothing)
     and the slice's claim: the bits of y (31 of them) and whether y falls in the slice.
     (N, 6) numbers of the accumulator type: 24 bytes a row in float32.
  2. The caller all-gathers the k states into (k, N, 6), in rank order (torch.distributed's
     all_gather_into_tensor, NCCL's allGather; cupyloss.torch.vocab_parallel_cross_entropy does
     it through c10d eagerly and torch's functional collectives when traced).  That is the only communication: k * N * 20
     bytes received a rank, against N * C * 2 for the bfloat16 logits.
  3. ``combine_stats`` merges them, in rank order, as the kernel merges its threads' states
        M = max_i m_i,   S = sum_i s_i e^(m_i - M),   lse = M + log S,
        a = sum_i (a_i + b_i (M - m_i)),   b = sum_i b_i,   z_y = sum_i t_i
        loss = (1 - eps) w_y (lse - z_y) + (eps / C) (b log S + a) + zs lse^2
     (0 for an ignored row, NaN for a class index outside [0, C)): every rank gets the same
     losses, bit for bit, and each row's lse.  A row whose ranks were given different class
     indices, or whose class no slice or two slices hold (overlapping or missing slices), is
     NaN in loss, lse and weight, never a wrong number, and is counted with the rejected targets
     (cupyloss.rejected_targets).
  4. ``vocab_parallel_backward``: each rank forms its slice's gradient from lse alone
     (rowwise.cu's cross_entropy_slice_grad): no communication.

Each rank reads its logits twice (statistics, then gradient) and writes the gradient once: a
collective between the read and the gradient's write costs the single-GPU kernel's second
pass over the logits (docs/parallel.md has the bytes and where it stops scaling).  No host
synchronisation; deterministic (fixed merge order, no atomics).
"""

from __future__ import annotations

import math

import numpy

from cupyloss._core import dispatch as _dispatch, dtypes as _dtypes, validate as _validate
from cupyloss.rowwise import _family as _rowwise
from cupyloss.linear import _INDEX_DTYPES, _target_operand

FIELDS = _rowwise.SLICE_FIELDS   # m, s, a, b, t and the slice's claim (rowwise.cu)
_HELD = 1 << 31


def claims(xp, t, inside, acc):
    """The claim field of a slice's states (rowwise.cu's slice_claim): the low 31 bits of each
    row's class index, bit 31 where the slice holds that class, as the bits of an `acc` float
    (numpy or torch arrays, `xp` their module)."""
    key = (t.astype(numpy.int64) if xp is numpy else t.long()) & 0x7FFFFFFF
    word = key | xp.where(inside, _HELD, 0)
    if xp is numpy:
        return (word.astype(numpy.uint32).view(numpy.float32) if acc == numpy.float32
                else word.astype(numpy.int64).view(numpy.float64))
    import torch

    if acc == torch.float32:
        return torch.where(word >= _HELD, word - (1 << 32), word).int().view(torch.float32)
    return word.view(torch.float64)


def _claim_words(xp, field):
    """claims' words back as non-negative integers."""
    if xp is numpy:
        return (field.view(numpy.uint32).astype(numpy.int64) if field.dtype == numpy.float32
                else field.view(numpy.int64) & 0xFFFFFFFF)
    import torch

    if field.dtype == torch.float32:
        return field.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return field.contiguous().view(torch.int64) & 0xFFFFFFFF


def _frame_operands(input, target, weight):
    frame = _dispatch.frame_of(input, "input")
    for x, name in ((target, "target"), (weight, "weight")):
        if x is not None:
            _dispatch.check_same_frame(frame, input, x, "input", name)
    x = frame.operand(input, "input")
    t = _target_operand(frame, target)
    w = frame.operand(weight, "weight") if weight is not None else None
    return frame, x, t, w


def _check(x, t, w, class_offset, classes, label_smoothing=0.0, softcap=0.0):
    if len(x.shape) != 2 or (x.shape[1] > 1 and x.strides[1] != 1):
        raise ValueError(f"input must be (rows, classes of this slice) with contiguous rows, got "
                         f"shape {tuple(x.shape)} strides {tuple(x.strides)}")
    if _dtypes.DTYPES.get(x.dtype) is None:
        raise TypeError(f"vocab-parallel cross entropy has no kernels for dtype {x.dtype}")
    rows, cols = x.shape
    if tuple(t.shape) != (rows,) or t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"target must hold {rows} class indices (int32 or int64), one a row, "
                         f"got shape {tuple(t.shape)} dtype {t.dtype}")
    if len(t.shape) and t.strides[0] != 1 and rows > 1:
        raise ValueError("target must be contiguous")
    if not 0 <= class_offset or class_offset + cols > classes:
        raise ValueError(f"this slice's classes {class_offset} .. {class_offset + cols - 1} lie "
                         f"outside the {classes} classes")
    if w is not None and (tuple(w.shape) != (classes,) or w.dtype != x.dtype):
        raise ValueError(f"weight must hold all {classes} classes' weights in the input's dtype "
                         f"{x.dtype}, got shape {tuple(w.shape)} dtype {w.dtype}")
    if w is not None and classes > 1 and w.strides[0] != 1:
        raise ValueError(f"weight must be contiguous, got stride {w.strides[0]}: pass a "
                         f"contiguous copy")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    _validate.check_softcap(softcap, x.dtype)
    if any(op.device != x.device for op in (t, w) if op is not None):
        raise ValueError("input, target and weight must be on one device")


def vocab_parallel_stats(input, target, class_offset: int, classes: int, weight=None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         softcap: float = 0.0):
    """Each row's softmax state over this rank's slice of the classes (step 1 above).

    Formula: for row r and the slice's classes c (z_c = softcap tanh(x_c / softcap) with a
    softcap, else x_c; u_c = w_c with label smoothing, else 0):
    ``(max z, sum exp(z - max z), sum u (max z - z), sum u, z_y if y is in the slice else 0)``;
    an ignored row's state is (-inf, 0, 0, 0, 0).

    Args:
      input: (N, C_i) logits of classes class_offset .. class_offset + C_i - 1; float16,
        bfloat16, float32 or float64; rows contiguous.
      target: (N,) int32/int64 class indices into all `classes` (the same on every rank).
      class_offset, classes: this slice's first class, and the class count of all slices.
      weight: None or (classes,) class weights of all classes, input's dtype.
      ignore_index, label_smoothing, softcap: as for cross_entropy.

    Returns:
      (N, 6) float32 (float64 for float64 input), in the input's framework: the state and
      the slice's claim on the row's class (its bits, read by combine_stats).

    Example:
      >>> st = cupyloss.parallel.vocab_parallel_stats(x_local, y, rank * 64128, 128256)
      >>> comm.allGather(st.data.ptr, every.data.ptr, st.size, nccl.NCCL_FLOAT32, stream.ptr)
    """
    frame, x, t, w = _frame_operands(input, target, weight)
    _check(x, t, w, int(class_offset), int(classes), label_smoothing, softcap)
    acc = numpy.dtype(_dtypes.DTYPES[x.dtype].acc)
    device = x.device
    stream = frame.stream(device)
    out, out_ptr = frame.empty((x.shape[0], FIELDS), acc, x.array)
    with _on(device):
        _rowwise.slice_stats(_Raw(x), _Raw(t), _Raw.new(out_ptr, (x.shape[0], FIELDS), acc),
                             int(class_offset), int(classes), _Raw.of(w),
                             ignore_index=int(ignore_index),
                             label_smoothing=float(label_smoothing), softcap=float(softcap),
                             stream=stream, device=device)
    return frame.result(out)


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Raw:
    """What the launchers read of an array (its pointer as .data.ptr, shape, byte strides,
    dtype), made from an Operand or an allocation without building a CuPy array."""

    __slots__ = ("data", "shape", "strides", "itemsize", "dtype", "ndim")

    def __init__(self, op, ptr=None, shape=None, dtype=None):
        if op is not None:
            ptr, shape, dtype = op.ptr, tuple(op.shape), op.dtype
            strides = op.strides
        else:
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        self.data = _Ptr(ptr)
        self.shape, self.dtype, self.itemsize = shape, dtype, dtype.itemsize
        self.strides = tuple(st * dtype.itemsize for st in strides)
        self.ndim = len(shape)

    @classmethod
    def new(cls, ptr, shape, dtype):
        """A C-contiguous allocation at `ptr`."""
        return cls(None, ptr, tuple(shape), numpy.dtype(dtype))

    @classmethod
    def of(cls, op):
        return None if op is None else cls(op)


def _contiguous_op(op) -> bool:
    expect = 1
    for n, st in zip(reversed(op.shape), reversed(op.strides)):
        if n > 1 and st != expect:
            return False
        expect *= n
    return True


def _on(device):
    """The CUDA device `device` current for the block (a no-op when it already is): kernels
    load on the current device."""
    import contextlib

    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device)


def _namespace(a):
    root = type(a).__module__.split(".")[0]
    if root == "torch":
        import torch
        return torch
    if root == "cupy":
        import cupy
        return cupy
    return numpy


def combine_stats(stats, target, classes: int, weight=None, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0):
    """Every row's loss from the k ranks' states (step 3 above), the same on every rank.

    Formula: the states merge in rank order (module docstring); then
    ``loss = (1 - eps) w_y (lse - z_y) + (eps / C) sum_c w_c (lse - z_c) + zs lse^2``, 0 for an
    ignored row, NaN for a class index outside [0, C).  Plain array operations on O(k N)
    numbers: NumPy, CuPy or torch arrays (whichever `stats` is), differentiable by none.

    Args:
      stats: (k, N, 6) the ranks' vocab_parallel_stats, in rank order.
      target: (N,) class indices; classes: C; weight: None or (C,) (float, stats' dtype).
      ignore_index, label_smoothing, lse_square_scale: as for cross_entropy.

    Returns:
      ``(loss, lse, row_weight)``, each (N,) of stats' dtype: w_y of a counted row (1 without
      weights), 0 for an ignored one; their sum is the 'mean' divisor.

    Example:
      >>> loss, lse, w = cupyloss.parallel.combine_stats(every.reshape(k, n, 6), y, 128256)
      >>> mean = loss.sum() / w.sum()
    """
    xp = _namespace(stats)
    on_gpu = xp is not numpy and (xp.__name__ == "cupy" or stats.is_cuda)
    if on_gpu:
        return _combine_kernel(stats, target, classes, weight, ignore_index, label_smoothing,
                               lse_square_scale)
    if weight is not None:
        weight = weight.to(stats.dtype) if xp.__name__ == "torch" else weight.astype(stats.dtype)
    if xp is numpy:
        with numpy.errstate(all="ignore"):
            return _combine(xp, stats, target, classes, weight, ignore_index, label_smoothing,
                            lse_square_scale)
    return _combine(xp, stats, target, classes, weight, ignore_index, label_smoothing,
                    lse_square_scale)


def _combine_kernel(stats, target, classes, weight, ignore_index, eps, zs):
    """combine_stats on the GPU: rowwise.cu's cross_entropy_combine (the rows kernel's merge
    and finalize), one launch."""
    import cupy

    frame = _dispatch.frame_of(stats, "stats")
    st = frame.operand(stats, "stats")
    t = _target_operand(frame, target)
    w = frame.operand(weight, "weight") if weight is not None else None
    if len(st.shape) != 3 or st.shape[2] != FIELDS or st.dtype.kind != "f":
        raise ValueError(f"stats must be (k, rows, {FIELDS}) floats, got {tuple(st.shape)}")
    rows = st.shape[1]
    if tuple(t.shape) != (rows,) or t.dtype not in _INDEX_DTYPES or (rows > 1 and
                                                                    t.strides[0] != 1):
        raise ValueError(f"target must hold {rows} contiguous int32 or int64 class indices, got "
                         f"shape {tuple(t.shape)} dtype {t.dtype} strides {tuple(t.strides)}")
    if w is not None and classes > 1 and len(w.shape) == 1 and w.strides[0] != 1:
        raise ValueError(f"weight must be contiguous, got stride {w.strides[0]}: pass a "
                         f"contiguous copy")
    ctype = _dtypes.DTYPES[w.dtype if w is not None else st.dtype].ctype
    if w is not None and (numpy.dtype(_dtypes.DTYPES[w.dtype].acc) != st.dtype
                          or tuple(w.shape) != (classes,)):
        raise ValueError(f"weight must be ({classes},) of a dtype accumulated in {st.dtype}, "
                         f"got {tuple(w.shape)} {w.dtype}")
    device = st.device
    stream = frame.stream(device)
    outs = [frame.empty((rows,), st.dtype, st.array) for _ in range(3)]
    with _on(device):
        if not _contiguous_op(st):
            with cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)), \
                    frame.scratch_allocator():
                copy = cupy.ascontiguousarray(frame.cupy_view(st))
            st = _dispatch.Operand(copy.data.ptr, copy.shape, tuple(
                n // copy.itemsize for n in copy.strides), copy.dtype, device, copy)
        _rowwise.combine(_Raw(st), _Raw(t), _Raw.of(w),
                         *(_Raw.new(ptr, (rows,), st.dtype) for _, ptr in outs), int(classes),
                         ignore_index=int(ignore_index), label_smoothing=float(eps),
                         lse_square_scale=float(zs), ctype=ctype, stream=stream, device=device)
    return tuple(frame.result(o) for o, _ in outs)


def _combine(xp, stats, target, classes, weight, ignore_index, eps, zs):
    ninf = float("-inf")
    m, s, a, b, t = (stats[..., f] for f in range(FIELDS - 1))
    words = _claim_words(xp, stats[..., FIELDS - 1])
    mine = (target.astype(numpy.int64) if xp is numpy else target.long()) & 0x7FFFFFFF
    agree = ((words & 0x7FFFFFFF) == mine).all(0)
    held = (words >= _HELD).sum(0)
    big = xp.amax(m, 0)
    live = s != 0                                 # parts with a finite exponential sum
    s_all = xp.where(live, s * xp.exp(xp.where(live, m - big, 0.0)), 0.0).sum(0)
    moved = (b != 0) & (m != ninf)                # a's shift b (M - m) where the part has one
    a_all = (a + b * (big - xp.where(moved, m, big))).sum(0)
    b_all = b.sum(0)
    z_y = t.sum(0)
    log_s = xp.log(s_all)
    lse = big + log_s
    ignored = target == ignore_index
    outside = ~ignored & ((target < 0) | (target >= classes))
    if weight is None:
        w_y = xp.ones_like(lse)
    else:
        w_y = weight[xp.where(ignored | outside, 0, target)]
    w_y = xp.where(ignored, 0.0, xp.where(outside, float("nan"), w_y))
    bad = ~agree | (~ignored & ~outside & (held != 1))
    loss = (1.0 - eps) * w_y * (log_s + (big - z_y))
    if eps:
        loss = loss + (eps / classes) * (b_all * log_s + a_all)
    if zs:
        loss = loss + zs * lse * lse
    nan = float("nan")
    return (xp.where(bad, nan, xp.where(ignored, 0.0, loss)), xp.where(bad, nan, lse),
            xp.where(bad, nan, w_y))


def vocab_parallel_backward(grad_rows, input, target, lse, class_offset: int, classes: int,
                            weight=None, *, ignore_index: int = -100,
                            label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                            softcap: float = 0.0):
    """The gradient of this rank's slice of the logits (step 4 above), no communication.

    Formula: ``d loss_r / d x_c = g_r ((k p_c - corr_c) + 2 zs lse p_c) dz_c/dx_c`` with
    p_c = exp(z_c - lse_r), k = (1 - eps) w_y + (eps / C) sum_c w_c and
    corr_c = (1 - eps) w_y [c == y] + (eps / C) w_c (0 for an ignored row).

    Args:
      grad_rows: each row's upstream gradient g_r, (N,) or 0-d, float32 (float64 for float64
        input): for 'mean', grad_output over the divisor.
      input, target, class_offset, classes, weight: as for vocab_parallel_stats.
      lse: (N,) from combine_stats.
      ignore_index, label_smoothing, lse_square_scale, softcap: as for cross_entropy.

    Returns:
      (N, C_i) gradient of the input's dtype, in the input's framework.

    Example:
      >>> gx = cupyloss.parallel.vocab_parallel_backward(1.0 / w.sum(), x_local, y, lse,
      ...                                                rank * 64128, 128256)
    """
    import cupy

    frame, x, t, w = _frame_operands(input, target, weight)
    _check(x, t, w, int(class_offset), int(classes), label_smoothing, softcap)
    acc = numpy.dtype(_dtypes.DTYPES[x.dtype].acc)
    device = x.device
    stream = frame.stream(device)
    ops = {}
    for name, a, shapes in (("lse", lse, ((x.shape[0],),)),
                            ("grad_rows", grad_rows, ((), (x.shape[0],)))):
        _dispatch.check_same_frame(frame, input, a, "input", name)
        op = frame.operand(a, name)
        if tuple(op.shape) not in shapes or op.dtype != acc or op.device != x.device:
            raise ValueError(f"{name} must be {' or '.join(map(str, shapes))} {acc} on the "
                             f"input's device, got {tuple(op.shape)} {op.dtype}")
        ops[name] = op
    out, out_ptr = frame.empty(tuple(x.shape), x.dtype, x.array)
    with _on(device):
        wsum = None
        if w is not None and label_smoothing or not all(map(_contiguous_op, ops.values())):
            with cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)), \
                    frame.scratch_allocator():
                if w is not None and label_smoothing:
                    wsum = frame.cupy_view(w).sum(dtype=acc)
                for name, op in list(ops.items()):
                    if not _contiguous_op(op):
                        copy = cupy.ascontiguousarray(frame.cupy_view(op))
                        ops[name] = _dispatch.Operand(copy.data.ptr, copy.shape, tuple(
                            n // copy.itemsize for n in copy.strides), copy.dtype, device, copy)
        _rowwise.slice_grad(_Raw(x), _Raw(t), _Raw(ops["lse"]),
                            _Raw.new(out_ptr, x.shape, x.dtype), int(class_offset),
                            int(classes), _Raw.of(w), wsum, _Raw(ops["grad_rows"]),
                            ignore_index=int(ignore_index),
                            label_smoothing=float(label_smoothing),
                            lse_square_scale=float(lse_square_scale), softcap=float(softcap),
                            stream=stream, device=device)
    return frame.result(out)


# --- the fused head's share of the classes (collectives between two calls) -------------------------

def linear_vocab_parallel_stats(hidden, weight, target, class_offset: int, classes: int,
                                bias=None, class_weight=None, *, ignore_index: int = -100,
                                label_smoothing: float = 0.0, softcap: float = 0.0,
                                max_workspace_bytes: int | None = None, compute_dtype=None):
    """vocab_parallel_stats of the logits ``hidden @ weight.T + bias`` of this rank's classes,
    the logits never whole: the fused head's chunks (cupyloss.linear), each chunk's states
    written as formed.  For a framework whose collectives run between calls (JAX's all_gather
    inside shard_map): gather these states, combine_stats them into each row's loss and lse,
    then linear_vocab_parallel_backward.

    Args:
      hidden: (..., H); weight: (V_i, H) this rank's rows of the head, classes class_offset ..
        class_offset + V_i - 1 of `classes`; target: class indices into all classes, hidden's
        shape without its last dim; bias: None or (V_i,); class_weight: None or (classes,).
      ignore_index, label_smoothing, softcap, max_workspace_bytes, compute_dtype: as for
        cupyloss.linear_cross_entropy.

    Returns:
      (N, 6) float32 (float64 for float64 inputs): vocab_parallel_stats' states, N the rows.

    Example:
      >>> st = cupyloss.parallel.linear_vocab_parallel_stats(h, w_shard, y, rank * 64128, 128256)
    """
    from cupyloss import linear

    head = linear._SliceHead("stats", int(class_offset), int(classes),
                             dict(ignore_index=int(ignore_index),
                                  label_smoothing=float(label_smoothing), lse_square_scale=0.0,
                                  softcap=float(softcap)))
    out, _, _ = linear._run(hidden, weight, target, bias, class_weight, ignore_index, "none",
                            label_smoothing, 0.0, softcap, max_workspace_bytes, False, (), 1.0,
                            False, compute_dtype=compute_dtype, head=head)
    return out[0]


def linear_vocab_parallel_backward(grad_rows, hidden, weight, target, lse, class_offset: int,
                                   classes: int, bias=None, class_weight=None, *,
                                   ignore_index: int = -100, label_smoothing: float = 0.0,
                                   lse_square_scale: float = 0.0, softcap: float = 0.0,
                                   max_workspace_bytes: int | None = None, wrt=None,
                                   compute_dtype=None):
    """The gradients of this rank's share of the fused head from each row's lse over all the
    classes (combine_stats'), the logits formed again chunk by chunk: dZ of this rank's classes
    as vocab_parallel_backward forms it, then ``dX_i = dZ W_i`` (this rank's float32 partial
    sum: add them over the ranks), ``dW_i = dZ^T X`` and ``db_i = sum_rows dZ``.

    Args:
      grad_rows: each row's upstream gradient, a number, 0-d or (N,) (for 'mean': grad_output
        over the divisor).
      lse: (N,) or target's shape, from combine_stats.
      hidden, weight, target, class_offset, classes, bias, class_weight, ignore_index,
        label_smoothing, lse_square_scale, softcap, max_workspace_bytes, compute_dtype: as for
        linear_vocab_parallel_stats.
      wrt: 'hidden', 'weight', 'bias' or a tuple of them (default: hidden and weight).

    Returns:
      The gradients named by wrt (a tuple, or one array for a single name): hidden's in float32
      (float64 for float64 inputs), the others in their arguments' dtypes.

    Example:
      >>> gx_part, gw = cupyloss.parallel.linear_vocab_parallel_backward(
      ...     1.0 / w_y.sum(), h, w_shard, y, lse, rank * 64128, 128256)
    """
    from cupyloss import linear

    names, single = linear._names(wrt)
    head = linear._SliceHead("grad", int(class_offset), int(classes),
                             dict(ignore_index=int(ignore_index),
                                  label_smoothing=float(label_smoothing),
                                  lse_square_scale=float(lse_square_scale),
                                  softcap=float(softcap)), lse, grad_rows)
    _, grads, _ = linear._run(hidden, weight, target, bias, class_weight, ignore_index, "none",
                              label_smoothing, lse_square_scale, softcap, max_workspace_bytes,
                              False, names, 1.0, False, compute_dtype=compute_dtype, head=head)
    out = tuple(grads[name] for name in names)
    return out[0] if single else out
