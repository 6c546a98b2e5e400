"""Fused linear cross entropy: a language model's output layer and its loss, logits never whole.

For hidden states X (N, H), a weight W (V, H) as torch.nn.Linear stores it, an optional bias b
(V,) and class indices t (N,):

    logits  Z = X W^T + b          (float32 accumulation, kept in float32: float64 for float64)
    loss    cross_entropy(Z, t, ...)   exactly as cupyloss.cross_entropy on those logits

The rows are taken in chunks whose float32 logits fit a workspace budget: per chunk one cuBLAS
product forms the logits, the row-wise cross-entropy kernel turns them into the loss and their
gradient dZ in one read (stored in the inputs' dtype by the same pass: rounded once, as torch's
autograd rounds it through ``(X @ W.T).float()``), and a second product gives dX = dZ W for the
chunk's rows.  Every product accumulates in float32 (cuBLAS's CUBLAS_COMPUTE_32F; float64
inputs: 64F).  The weight's gradient dW = dZ^T X needs every row's dZ, and `plan` picks how to
pay for that from the budget, which bounds every byte a call holds besides its results:

  * keep    the budget holds every row's 16-bit dZ (N x V) and a chunk of float32 logits: dW is
            one product at the end (k = N, float32 accumulation inside cuBLAS, rounded once).
            Three products, the fastest plan.
  * sum     it holds a float32 V x H sum and a chunk: dW is summed over the chunks in float32
            (read and written once a chunk) and rounded once.  Three products.  float32 and
            float64 weights always take it, summing into the result itself (no workspace).
            Where a float32 sum does not fit, a split one may: each float32's top 16 bits in
            the 16-bit result's own storage, its bottom 16 in the workspace (scale.cu's
            split_add), the same float32 additions in half the bytes, each chunk's product
            formed a slice of classes at a time into float32 and added from there.
  * slices  none fits (the low-memory plan): the first pass keeps each row's logsumexp; a
            second forms the logits again a slice of the classes at a time (all rows, or tiles
            of rows), the slice's dZ from the stored lse (rowwise.cu's
            cross_entropy_slice_grad), and that slice of dW as one product, rounded once.  Four
            products; the workspace is a chunk or a slice, whichever is larger.
  * group   (group_plan) a head whose rows' upstream gradients are known only a group of rows
            at a time (the preference losses: whole sequences' sums) keeps the group's dZ at a
            unit upstream gradient and scales each sequence's products by its own on the
            device (cuBLAS's alpha), summing dW as "sum" does.  Three products.

Of keep and the sums, the first whose chunks hold CHUNK_ROWS_MIN rows is taken (else the one
with the tallest chunks).

'mean' divides by the summed class weights of the counted rows (their number without class
weights), computed on the device: no host synchronisation anywhere.  Results are deterministic:
cuBLAS's default algorithms have no atomics, and chunks and slices are added in order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy

from cupyloss._core import (
    args as _args, dispatch as _dispatch, dtypes as _dtypes, source as _source,
    validate as _validate)
from cupyloss._types import Array

__all__ = ["linear_cross_entropy", "linear_cross_entropy_backward",
           "linear_cross_entropy_value_and_grad", "linear_log_probs", "linear_log_probs_backward",
           "linear_log_probs_value_and_grad", "plan", "group_plan", "Plan",
           "DEFAULT_WORKSPACE_BYTES"]

# The workspace a call may use by default: enough to keep every row's bfloat16 dZ at 16384 x
# 128256 (3.9 GiB) beside 1024-row chunks, the fastest plan there (docs/performance.md).
DEFAULT_WORKSPACE_BYTES = 4608 << 20

_REDUCTIONS = ("none", "mean", "sum")
NARROW = _args.Layout(_source.kernel_words("scale.cu", "narrow"))
SPLIT_ADD = _args.Layout(_source.kernel_words("scale.cu", "split_add"))
SPLIT_FINISH = _args.Layout(_source.kernel_words("scale.cu", "split_finish"))
_GRAD_NAMES = ("hidden", "weight", "bias")

# cuBLAS / CUDA library enums (cublas_api.h, library_types.h).
_OP_N, _OP_T = 0, 1
_CUDA_TYPE = {dtype: {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}[str(dtype)]
              for dtype in _dtypes.DTYPES}
_COMPUTE_32F, _COMPUTE_64F = 68, 70
_GEMM_DEFAULT = -1
_POINTER_HOST, _POINTER_DEVICE = 0, 1


# Rows of a chunk of logits at most: larger chunks measured no faster and only hold more
# memory (docs/performance.md, "Fused linear cross entropy").
CHUNK_ROWS_MAX = 1024
# Rows a chunk of the "keep" or "sum" plans at least, where a plan holding less (a split sum)
# gives taller chunks: linear_jsd on 8192 x 128256 x 4096 bf16, H200, kept dZ in 128-row
# chunks 111.36 ms, a split sum in 768-row chunks 86.40 (bench.posttrain --families distill
# --budgets 2200,2048, benchmarks/results/posttrain-h200.txt).
CHUNK_ROWS_MIN = 256
# Under compute_dtype, each chunk's logits are held in it (as torch.autocast's F.linear returns
# them) rather than in float32: half the traffic (bench.linear --autocast).
NARROW_LOGITS = True
# Rows a chunk of such 16-bit logits at most, in the workspace-free "sum" plan of a float32
# weight gradient: (hidden size at most, rows), the first row that fits; None for any rows
# (bench.linear --autocast, benchmarks/results/linear-autocast-h200.json: fewer, taller chunks
# pay where the products are small).
NARROW_CHUNK_ROWS: tuple = ((1024, 4096), (None, 2048))
# A cuBLAS tile: chunks and slices are multiples of it where they can be.
TILE = 128
# The split weight-gradient sum (_WeightSum): bytes of the float32 slice of classes its
# products write before scale.cu's split_add adds them in, at most.  On an H200 at 16384 x
# 128256 x 4096 bf16: 8 MiB 162.29 ms, 16 MiB 109.33, 32 MiB 104.37, 64 MiB 105.31 (a float32
# sum 87.86, slices 110.36; python -m cupyloss.bench.split, benchmarks/results/split-h200.txt).
SPLIT_SLICE_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call spends its workspace (module docstring): `kind` ("keep", "sum", "slices" or
    "group"), `rows` of logits a chunk of the first pass, for "slices" `cols` classes a slice of
    the second pass and `tile` rows a tile of a slice, for "sum" and "group" `cols` classes a
    slice of a split weight-gradient sum (0: a float32 one), for "group" `tile` rows of dZ a
    group holds, and the workspace's `bytes` besides the results (the larger of the two
    passes' for "slices")."""

    kind: str
    rows: int
    cols: int = 0
    tile: int = 0
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's slice of the classes (the vocab-parallel fused loss): the weight's V rows are
    classes offset .. offset + V - 1 of `classes`, split over `ranks` ranks; gather(stats)
    returns every rank's (m, 6) statistics of the same m rows as a (k, m, 6) array in rank
    order (a collective queued on the call's stream).  Every rank chunks the rows as the plan
    of an even share of the classes does, so that all make the same gathers however uneven
    their slices; a rank holding more than an even share holds that much more workspace.
    reduce(rows), where given, is called with each chunk's rows of the hidden gradient (this
    rank's float32 partial sums) as soon as the chunk's product is queued: a sum over the ranks
    queued there overlaps the next chunks' products.  Each chunk's statistics are exchanged and combined before its dZ is
    formed (cupyloss.parallel's steps), and the hidden gradient comes back as this rank's
    float32 (float64) partial sum, for the caller to add over the ranks."""

    offset: int
    classes: int
    gather: Any
    ranks: int = 1
    reduce: Any = None


def _fit(budget: int, per_row: int, n: int, most: int | None = None) -> int:
    """As many rows of `per_row` bytes as `budget` holds, a multiple of TILE where that leaves at
    least TILE, at least 1, at most min(n, most) (most: CHUNK_ROWS_MAX unless given)."""
    most = CHUNK_ROWS_MAX if most is None else most
    rows = max(1, budget // max(per_row, 1))
    if rows >= TILE:
        rows -= rows % TILE
    return max(1, min(rows, n, most))


def split_cols(classes: int, hidden: int) -> int:
    """Classes a slice of the split weight-gradient sum's float32 products: SPLIT_SLICE_BYTES,
    at most a quarter of the classes (so that the split sum holds at most 3/4 of a float32
    one's bytes), a multiple of TILE where that leaves at least TILE."""
    room = min(SPLIT_SLICE_BYTES, max(1, classes // 4) * hidden * 4)
    return _fit(room, hidden * 4, classes, classes)


def _split_bytes(classes: int, hidden: int) -> int:
    """Workspace of the split sum: the bottom halves (V x H, 16-bit) and a float32 slice."""
    return classes * hidden * 2 + split_cols(classes, hidden) * hidden * 4


def plan(n: int, classes: int, hidden: int, itemsize: int, budget: int | None = None,
         weight_grad: bool = True, rows: int | None = None, most: int | None = None,
         wide_weight_grad: bool = False, narrow_logits: bool = False,
         beside: int = 0) -> Plan:
    """The plan of a call on n rows, `classes` logits a row and `hidden` features, inputs of
    `itemsize` bytes, within `budget` bytes (default DEFAULT_WORKSPACE_BYTES): keep every row's
    16-bit dZ where it fits, else a float32 weight-gradient sum, else class slices (see the
    module docstring).  A chunk holds float32 logits (float64 for float64 inputs) and, for
    16-bit inputs, their gradient in the inputs' dtype; with `narrow_logits` it holds 16-bit
    logits that their gradient overwrites.  `wide_weight_grad`: the weight's gradient is a
    float32 result (a float32 master weight under autocast), so the "sum" plan adds into it
    and holds no workspace of its own.  `rows`, where given, fixes the rows a chunk of the
    first pass (the ranks of a vocab-parallel call must agree on them) and the bytes follow
    from it.  Where a float32 weight-gradient sum does not fit, a split one (half its bytes,
    _WeightSum) may.  `beside`: bytes a head holds per element of each chunk or slice of
    logits besides them (a teacher's float32 logits of the same rows and classes:
    cupyloss.posttrain's linear_jsd)."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else max(0, int(budget))
    logit = 8 if itemsize == 8 else 4
    narrow = itemsize if itemsize < 4 else 0
    if narrow and narrow_logits:
        logit, chunk = 0, classes * (narrow + beside)
    else:
        chunk = classes * (logit + narrow + beside)

    def fit(room, per_row):
        return _fit(room, per_row, n, most) if rows is None else max(1, min(rows, n))

    if not narrow or not weight_grad:
        r = fit(budget, chunk)
        return Plan("sum", r, bytes=r * chunk)
    if wide_weight_grad and budget >= min(n, TILE) * chunk:
        # summed into the float32 result: no V x H workspace, no dZ kept
        if rows is None:
            if narrow_logits and most is None:
                most = next(r for h, r in NARROW_CHUNK_ROWS if h is None or hidden <= h)
            r = _fit(budget, chunk, n, most)
        else:
            r = max(1, min(rows, n))
        return Plan("sum", r, bytes=r * chunk)
    # keep, a float32 sum, a split sum: the first whose chunks hold CHUNK_ROWS_MIN rows (all
    # of them, if fewer), else the one with the tallest chunks
    fits = []
    keep = n * classes * narrow
    if budget >= keep + TILE * classes * (logit + beside):
        r = fit(budget - keep, classes * (logit + beside)) if logit else fit(budget, chunk)
        fits.append(Plan("keep", r, bytes=keep + r * classes * (logit + beside)))
    total = 0 if wide_weight_grad else classes * hidden * 4
    if budget >= total + TILE * chunk:
        r = fit(budget - total, chunk)
        fits.append(Plan("sum", r, bytes=total + r * chunk))
    split = _split_bytes(classes, hidden)
    if not wide_weight_grad and budget >= split + TILE * chunk:
        r = fit(budget - split, chunk)
        fits.append(Plan("sum", r, split_cols(classes, hidden), bytes=split + r * chunk))
    if fits:
        tall = [p for p in fits if p.rows >= min(n, CHUNK_ROWS_MIN)]
        return tall[0] if tall else max(fits, key=lambda p: p.rows)
    r = fit(budget, chunk)
    # A slice of all n rows where `budget` holds TILE classes of them, else tiles of rows with
    # a float32 sum of the slice's dW.
    element = (logit or 4) + narrow + beside
    cols = min(classes, max(TILE, budget // max(n * element, 1) // TILE * TILE))
    if n * cols * element <= budget:
        tile, second = n, n * cols * element
    else:
        acc = 0 if wide_weight_grad else cols * hidden * 4
        tile = _fit(budget - acc, cols * element, n, n)
        second = acc + tile * cols * element
    return Plan("slices", r, cols, tile, max(r * chunk, second))


def group_plan(n: int, classes: int, hidden: int, itemsize: int, budget: int | None,
               weight_grad: bool, group: int, wide_weight_grad: bool = False) -> Plan | None:
    """The "group" plan of a head whose rows' upstream gradients are known a group of rows at
    a time (whole sequences: cupyloss.posttrain's preference losses): the dZ of `group` rows
    in the inputs' dtype, a chunk of float32 logits (float64 for float64 inputs) and a weight-
    gradient sum (float32, else split; none for float32 and float64 weights or without a
    weight gradient), the most rows a chunk that `budget` leaves; None where none fits with
    chunks of CHUNK_ROWS_MIN rows (all rows, if fewer): KTO's groups of one 1024-token row
    in 1400 MiB, a split sum and 128-row chunks, took 358.82 ms on an H200 where two passes
    in 256 MiB took 193.62 (benchmarks/results/posttrain-h200.txt)."""
    budget = DEFAULT_WORKSPACE_BYTES if budget is None else max(0, int(budget))
    logit = 8 if itemsize == 8 else 4
    kept = min(group, n) * classes * itemsize
    sums = [0] if not weight_grad or itemsize >= 4 or wide_weight_grad else [
        classes * hidden * 4, _split_bytes(classes, hidden)]
    for acc in sums:
        room = budget - kept - acc
        if room >= min(n, CHUNK_ROWS_MIN) * classes * logit:
            r = _fit(room, classes * logit, n)
            cols = split_cols(classes, hidden) if acc and acc != classes * hidden * 4 else 0
            return Plan("group", r, cols, min(group, n), kept + acc + r * classes * logit)
    return None


def shard_plan(n: int, v: int, hidden: int, itemsize: int, budget: int | None,
               weight_grad: bool, shard: Shard | None, **kinds) -> Plan:
    """plan() of a call on v classes; for a rank's slice (`shard`) with the rows a chunk of an
    even share's plan, the same on every rank: each chunk is one gather, and all ranks must
    make the same ones.  A share's chunks may hold CHUNK_ROWS_MAX rows a rank, so that a
    chunk's products are as large as one GPU's (fewer, taller gathers and hidden-gradient sums;
    tuning.md has the k = 4 figures)."""
    rows = None
    if shard is not None:
        rows = plan(n, -(-shard.classes // shard.ranks), hidden, itemsize, budget,
                    weight_grad, most=CHUNK_ROWS_MAX * shard.ranks, **kinds).rows
    return plan(n, v, hidden, itemsize, budget, weight_grad, rows, **kinds)


def _names(wrt) -> tuple[tuple[str, ...], bool]:
    """wrt of the fused loss (None stands for hidden and weight)."""
    return _validate.check_wrt(wrt, _GRAD_NAMES, default=("hidden", "weight"))


def _compute(compute_dtype):
    """compute_dtype as a NumPy dtype (float16 or bfloat16), or None."""
    if compute_dtype is None:
        return None
    name = str(compute_dtype).replace("torch.", "")      # torch's dtypes print so
    info = _dtypes.lookup(name if name in ("float16", "bfloat16") else compute_dtype)
    if info is not None and info.dtype.itemsize != 2:
        info = None
    if info is None:
        raise TypeError(f"compute_dtype must be float16 or bfloat16 (the dtype of the products, "
                        f"as torch.autocast's), got {compute_dtype}")
    return info.dtype


_MIXED = ("float16", "bfloat16", "float32")


def _check(hidden, weight, target, bias, class_weight, reduction, label_smoothing,
           lse_square_scale, softcap, names, shard=None, compute=None):
    """Validation before any launch (the arguments are Operands, or None): shapes, dtypes,
    options.  With `compute` hidden, weight and bias may each be float16, bfloat16 or float32
    (each rounded to `compute` for the products).  Returns (N, H, V)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if hidden.dtype not in _dtypes.DTYPES:
        raise TypeError(f"hidden has dtype {hidden.dtype}; cupyloss takes float16, bfloat16, "
                        f"float32 and float64")
    if compute is not None:
        for name, a in (("hidden", hidden), ("weight", weight), ("bias", bias)):
            if a is not None and str(a.dtype) not in _MIXED:
                raise TypeError(f"{name} has dtype {a.dtype}; with compute_dtype {compute} it "
                                f"must be float16, bfloat16 or float32")
    elif weight.dtype != hidden.dtype:
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
    if target.dtype not in _INDEX_DTYPES:
        raise TypeError(f"target must hold class indices (int32 or int64), got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target's shape {tuple(target.shape)} must be hidden's without its "
                         f"last dim, {tuple(hidden.shape[:-1])}")
    if bias is not None and (tuple(bias.shape) != (v,)
                             or (compute is None and bias.dtype != hidden.dtype)):
        raise ValueError(f"bias must be ({v},) of hidden's dtype, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    classes = v if shard is None else shard.classes
    if shard is not None and not 0 <= shard.offset <= classes - v:
        raise ValueError(f"this rank's classes {shard.offset} .. {shard.offset + v - 1} lie "
                         f"outside the {classes} classes")
    if class_weight is not None and (tuple(class_weight.shape) != (classes,)
                                     or (class_weight.dtype != hidden.dtype
                                         and (compute is None
                                              or str(class_weight.dtype) not in _MIXED))):
        raise ValueError(f"class_weight must be ({classes},) of hidden's dtype, got "
                         f"{tuple(class_weight.shape)} {class_weight.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    _validate.check_softcap(softcap, hidden.dtype)
    if "bias" in names and bias is None:
        raise ValueError("wrt names 'bias' but no bias was given")
    return math.prod(hidden.shape[:-1]), h, v


class _Blas:
    """cuBLAS products C = alpha op(A) op(B) + beta C on CuPy's handle and the call's stream,
    column-major arguments (a row-major (r, c) array is a column-major (c, r) one with ld = c).
    cublasGemmEx is called through ctypes: CuPy's wrapper refuses every call while a stream is
    captured, and these products are capturable (a CUDA graph of a training step)."""

    def __init__(self, dtype, stream):
        import cupy

        self._lib = lib = _cublas()
        self._handle = cupy.cuda.device.get_cublas_handle()
        # the handle's stream set once a call: CuPy sets its own before each of its calls
        _status(lib.cublasSetStream_v2(self._handle, stream), "cublasSetStream")
        wide = dtype == numpy.float64
        self._compute = _COMPUTE_64F if wide else _COMPUTE_32F
        scalar = numpy.float64 if wide else numpy.float32
        self._scalars = (numpy.ones(1, scalar), numpy.zeros(1, scalar))   # held while in use
        self._one, self._zero = (a.ctypes.data for a in self._scalars)
        self._device = None       # 1 and 0 on the device, for products with a device alpha

    def gemm(self, ta, tb, m, n, k, a, lda, b, ldb, c, ldc, accumulate=False, alpha=None):
        """alpha: a one-element float32/float64 host array (its address is read), a CuPy array
        whose first element is alpha (read by cuBLAS on the device, in order on the stream: no
        host synchronisation), or None for 1."""
        lib, handle = self._lib, self._handle
        device = alpha is not None and not isinstance(alpha, numpy.ndarray)
        if device:
            if self._device is None:
                import cupy

                self._device = cupy.empty((2,), self._scalars[0].dtype)
                self._device[0], self._device[1] = 1, 0
            _status(lib.cublasSetPointerMode_v2(handle, _POINTER_DEVICE), "cublasSetPointerMode")
            one, zero = self._device.data.ptr, self._device.data.ptr + self._device.itemsize
            scale = alpha.data.ptr
        else:
            one, zero = self._one, self._zero
            scale = one if alpha is None else alpha.ctypes.data
        try:
            _status(lib.cublasGemmEx(
                handle, ta, tb, m, n, k, scale, a.data.ptr, _CUDA_TYPE[a.dtype], lda,
                b.data.ptr, _CUDA_TYPE[b.dtype], ldb, one if accumulate else zero, c.data.ptr,
                _CUDA_TYPE[c.dtype], ldc, self._compute, _GEMM_DEFAULT), "cublasGemmEx")
        finally:
            if device:
                _status(lib.cublasSetPointerMode_v2(handle, _POINTER_HOST),
                        "cublasSetPointerMode")


_CUBLAS: list = []


def _cublas():
    """The cuBLAS library CuPy loaded (its path read from this process's mappings), with the
    two entry points used here typed for ctypes."""
    if _CUBLAS:
        return _CUBLAS[0]
    import ctypes

    import cupy

    cupy.cuda.device.get_cublas_handle()           # loads the library
    path = None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libcublas.so" in line), None)
    except OSError:
        pass
    lib = ctypes.CDLL(path or "libcublas.so")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetStream_v2.restype = i
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    lib.cublasGemmEx.restype = i
    lib.cublasSetPointerMode_v2.argtypes = [p, i]
    lib.cublasSetPointerMode_v2.restype = i
    _CUBLAS.append(lib)
    return lib


def _status(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed with cuBLAS status {code}")


def _narrow(src, out, stream, device) -> None:
    """out[...] = src rounded to out's 16-bit dtype (scale.cu's narrow; contiguous arrays)."""
    from cupyloss._core import launch as _launch, source as _source

    n = src.size
    if (src.data.ptr | out.data.ptr) & 15:
        out[...] = src
        return
    info = _dtypes.DTYPES[out.dtype]
    function = _source.function("scale.cu", _source.narrow_name(info.ctype))
    cfg = _launch.flat_launch(n, 8, _launch.device_limits(device))
    _args.launch(NARROW.bind(function.kernel.ptr), cfg.grid, cfg.block, 0, stream,
                 NARROW.template({"src": src.data.ptr, "out": out.data.ptr, "n": n}))


def _split_add(src, hi, lo, first, stream, device) -> None:
    """(hi, lo) = src + (hi, lo) as float32, or src itself where `first` (scale.cu's split_add;
    contiguous arrays of one size: src float32, hi and lo 16-bit)."""
    from cupyloss._core import launch as _launch

    n = src.size
    function = _source.function("scale.cu", "cupyloss::split_add")
    cfg = _launch.flat_launch(n, 8, _launch.device_limits(device))
    _args.launch(SPLIT_ADD.bind(function.kernel.ptr), cfg.grid, cfg.block, 0, stream,
                 SPLIT_ADD.template({"src": src.data.ptr, "hi": hi.data.ptr, "lo": lo.data.ptr,
                                     "n": n, "first": int(bool(first))}))


def _split_finish(out, lo, stream, device) -> None:
    """out[...] = the float32 whose halves are (out's bits, lo), rounded to out's dtype."""
    from cupyloss._core import launch as _launch

    n = out.size
    info = _dtypes.DTYPES[out.dtype]
    function = _source.function("scale.cu", _source.split_names(info.ctype)[1])
    cfg = _launch.flat_launch(n, 8, _launch.device_limits(device))
    _args.launch(SPLIT_FINISH.bind(function.kernel.ptr), cfg.grid, cfg.block, 0, stream,
                 SPLIT_FINISH.template({"hi": out.data.ptr, "lo": lo.data.ptr, "n": n}))


class _WeightSum:
    """The weight's gradient summed over groups of rows in float32 (the "sum" and "group"
    plans): into the result where it is float32 or float64; else into a float32 workspace
    rounded once at the end; or, with `cols`, split (scale.cu's split_add): each float32's top
    16 bits in the 16-bit result's own storage, its bottom 16 in a workspace, half the bytes of
    a float32 sum and the same float32 additions.  A split sum's products are formed `cols`
    classes at a time into a float32 slice (SPLIT_SLICE_BYTES) and added from there."""

    def __init__(self, call, ws, at, cols):
        self.call, self.cols, self.first = call, cols, True
        v, h, gw = call.v, call.h, call.gw
        self.acc: Any = None
        self.lo: Any = None
        self.temp: Any = None
        if cols:
            self.lo, at = _carve(ws, at, (v, h), numpy.uint16)
            self.temp, at = _carve(ws, at, (cols, h), numpy.float32)
        elif gw.dtype == call.logit:
            self.acc = gw
        else:
            self.acc, at = _carve(ws, at, (v, h), numpy.float32)
        self.end = at               # the workspace's first byte after the sum's

    def add(self, pieces) -> None:
        """Adds dZ^T X of each (x rows, their dZ (m, V) of leading dimension V, alpha)."""
        call = self.call
        blas, h, v = call.blas, call.h, call.v
        if not self.cols:
            for j, (xc, dz, alpha) in enumerate(pieces):
                # dW^T (H x V) += X_c (H x m col-major) (dZ^T (V x m col-major))^T
                blas.gemm(_OP_N, _OP_T, h, v, xc.shape[0], xc, h, dz, v, self.acc, h,
                          accumulate=not (self.first and j == 0), alpha=alpha)
        else:
            hi = call.gw.view(numpy.uint16)
            for c0 in range(0, v, self.cols):
                c1 = min(v, c0 + self.cols)
                k = c1 - c0
                for j, (xc, dz, alpha) in enumerate(pieces):
                    blas.gemm(_OP_N, _OP_T, h, k, xc.shape[0], xc, h, dz[:, c0:c1], v,
                              self.temp[:k], h, accumulate=j > 0, alpha=alpha)
                _split_add(self.temp[:k], hi[c0:c1], self.lo[c0:c1], self.first, call.stream,
                           call.device)
        self.first = self.first and not pieces

    def finish(self) -> None:
        """The result in its dtype (zeros where nothing was added)."""
        call = self.call
        if self.first:
            call.gw[...] = 0
        elif self.cols:
            _split_finish(call.gw, self.lo, call.stream, call.device)
        elif self.acc is not call.gw:
            _narrow(self.acc, call.gw, call.stream, call.device)


def _plain(a):
    """`a` as a cupy.ndarray itself (a framework's view class, such as JAX's buffers' views,
    would differ from the workspace's class that the row kernels compare it with)."""
    import cupy

    if type(a) is cupy.ndarray:
        return a
    return cupy.ndarray(a.shape, a.dtype, a.data, strides=a.strides)


def _contiguous(cp, a):
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def _carve(buffer, offset, shape, dtype):
    """A C-contiguous view of `shape` and `dtype` at byte `offset` of a uint8 buffer; returns
    (view, the offset after it, rounded up to 256 bytes)."""
    size = math.prod(shape) * numpy.dtype(dtype).itemsize
    view = buffer[offset:offset + size].view(dtype).reshape(shape)
    return view, offset + -(-size // 256) * 256


def _run(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
         lse_square_scale, softcap, max_workspace_bytes, want_value, names, grad_output,
         return_lse, shard=None, check=False, compute_dtype=None, num_items=None, head=None):
    """The chunked passes (module docstring); returns (loss, {name: grad}, lse) in the caller's
    framework (loss None unless want_value, lse None unless return_lse)."""
    compute = _compute(compute_dtype)
    count = None
    if num_items is not None:
        count = _validate.check_num_items(num_items, reduction, hidden.__class__)
    import cupy

    frame = _dispatch.frame_of(hidden, "hidden")
    given = [(name, x) for name, x in (("hidden", hidden), ("weight", weight), ("target", target),
                                        ("bias", bias), ("class_weight", class_weight))
             if x is not None]
    for name, x in given[1:]:   # frameworks compared before any is read
        _dispatch.check_same_frame(frame, hidden, x, "hidden", name)
    ops = {name: frame.operand(x, name) if name != "target" else _target_operand(frame, x)
           for name, x in given}
    if num_items is not None and count is None:
        _dispatch.check_same_frame(frame, hidden, num_items, "hidden", "num_items")
        ops["num_items"] = _target_operand(frame, num_items)
        _validate.check_items_operand(ops["num_items"], ops["hidden"].device)
    n, h, v = _check(ops["hidden"], ops["weight"], ops["target"], ops.get("bias"),
                     ops.get("class_weight"), reduction, label_smoothing, lse_square_scale,
                     softcap, names, shard if shard is not None else
                     (head if isinstance(head, _SliceHead) else None), compute)
    device = ops["hidden"].device
    if any(op.device != device for op in ops.values()):
        raise ValueError("hidden, weight, target and the optional arrays must be on one device")
    stream = frame.stream(device)
    if check:
        from cupyloss.rowwise import _family as _rowwise

        _rowwise.check_targets(frame, ops["target"], v if shard is None else shard.classes,
                               int(ignore_index), stream)
    if head is not None:
        head.bind(frame, ops["hidden"].device, tuple(ops["target"].shape))
    grad_go = None
    if head is None and not isinstance(grad_output, (int, float)):
        grad_go = _plain(frame.cupy_view(frame.operand(grad_output, "grad_output")))
    with cupy.cuda.Device(device), \
            cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)), \
            frame.scratch_allocator():
        views = {name: _plain(frame.cupy_view(op)) for name, op in ops.items()}
        run = _Call(views, n, h, v, ignore_index, reduction, label_smoothing, lse_square_scale,
                    softcap, want_value, names, grad_go, grad_output, return_lse, stream, device,
                    shard, compute, views.get("num_items", count), head)
        pl = run.plan(max_workspace_bytes)
        run.first_pass(pl)
        if pl.kind == "slices" and run.want["weight"]:
            run.second_pass(pl)
        loss, grads, lse = run.results(tuple(ops["hidden"].shape))
        if head is not None:                # (log p, entropy or None) in place of the loss
            loss = head.results(tuple(ops["hidden"].shape[:-1]))
            back = _back(frame)
            return (tuple(None if a is None else back(a) for a in loss),
                    {k: back(a) for k, a in grads.items()}, None)
        # handed back on the call's stream: no event on another one (which a CUDA graph's
        # capture would refuse)
        back = _back(frame)
        return (back(loss) if loss is not None else None,
                {k: back(a) for k, a in grads.items()},
                back(lse) if lse is not None else None)


class _Call:
    """One call's arrays (CuPy views on the caller's stream and allocator) and its passes."""

    def __init__(self, views, n, h, v, ignore_index, reduction, label_smoothing,
                 lse_square_scale, softcap, want_value, names, grad_go, grad_output, return_lse,
                 stream, device, shard=None, compute=None, items=None, head=None):
        import cupy

        self.n, self.h, self.v = n, h, v
        self.stream, self.device = stream, device
        x = _contiguous(cupy, views["hidden"].reshape(n, h))
        w = _contiguous(cupy, views["weight"])
        b = views.get("bias")
        # Under compute (autocast): the operands rounded to it here, the gradients returned in
        # each argument's dtype, formed by cuBLAS in float32 from the 16-bit operands.
        self.result = {"hidden": x.dtype, "weight": w.dtype, "bias": None if b is None
                       else b.dtype}
        if compute is not None:
            x, w = self._round(x, compute), self._round(w, compute)
            b = None if b is None else self._round(b, compute)
        self.x, self.w, self.b = x, w, b
        self.t = _contiguous(cupy, views["target"].reshape(n))
        self.dtype = dtype = self.x.dtype
        self.logit = numpy.dtype(numpy.float64 if dtype == numpy.float64 else numpy.float32)
        cw = views.get("class_weight")
        if cw is not None:   # the row kernel's dtype, like the logits; read contiguous
            cw = cupy.ascontiguousarray(cw, dtype=self.logit)
        self.cw = cw
        self.options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                            lse_square_scale=lse_square_scale, softcap=softcap)
        self.reduction, self.want_value, self.names = reduction, want_value, names
        # num_items: the divisor of 'mean' and 'sum' alike (a float, or a 0-d device array)
        self.items = items
        self.want = {name: name in names for name in _GRAD_NAMES}
        self.narrow = dtype.itemsize < self.logit.itemsize
        # 16-bit logits (torch.autocast's F.linear), overwritten by their gradient: under
        # compute, one GPU, no class weights, no bias (a bias is added to float32 logits:
        # cuBLAS's beta = 1 over 16-bit logits measured less exact than torch's bias epilogue
        # in float16) and NARROW_LOGITS
        self.narrow_logits = (compute is not None and NARROW_LOGITS and shard is None
                              and cw is None and b is None and head is None)
        # the per-token log-probabilities' head (_LogProbs) in place of cross entropy's rows
        self.head = head
        if head is not None:
            head.start(self)
        self.blas = _Blas(dtype, stream)
        # A float16 dZ formed at grad_output 1 (the gradients of a reduced loss formed in the
        # forward pass) would be (p - y) / count, subnormal for large counts: it is formed
        # 2^k times larger and the products take alpha = 2^-k (exact), k = log2 of the rows
        # rounded down, at most 14 (dZ stays below float16's largest, 65504).
        self.unscale = None
        # (a head whose gradient is a mean over the rows says so: `mean_rows`)
        mean_rows = reduction == "mean" or items is not None or getattr(head, "mean_rows", False)
        if (dtype == numpy.float16 and mean_rows and grad_go is None
                and grad_output == 1 and n > 1):
            self.boost = float(2 ** min(14, n.bit_length() - 1))
            self.unscale = numpy.array([1.0 / self.boost], numpy.float32)
        self._upstream = (grad_go, grad_output)
        self._scale = self.divisor = None
        self.shard = shard
        self.c0, self.classes = (0, v) if shard is None else (shard.offset, shard.classes)
        # a shard's hidden gradient: its partial sum over its classes, in the logits' precision
        # a share of the classes (a shard, or a head of a slice's classes): the hidden
        # gradient is this share's partial sum, in the logits' precision
        self.partial = shard is not None or getattr(head, "partial", False)
        gx_dtype = self._grad_dtype("hidden") if not self.partial else self.logit
        self.gx = cupy.empty((n, h), gx_dtype) if self.want["hidden"] else None
        self.gw = cupy.empty((v, h), self._grad_dtype("weight")) if self.want["weight"] else None
        self.gb = cupy.zeros((v,), self.logit) if self.want["bias"] else None
        self.lse = None
        self.losses = self.loss_rows = None
        self.return_lse = return_lse

    def _round(self, a, dtype):
        """`a` in `dtype` (a 16-bit copy on the call's stream), or `a` itself."""
        import cupy

        if a.dtype == dtype:
            return a
        out = cupy.empty(a.shape, dtype)
        if a.dtype == numpy.float32:
            _narrow(a, out, self.stream, self.device)
        else:
            out[...] = a
        return out

    def _grad_dtype(self, name):
        """The dtype cuBLAS writes `name`'s gradient in: its argument's, or float32 where that
        is neither float32 nor the products' dtype (cast at the end)."""
        want = self.result[name]
        return want if want in (self.dtype, self.logit) else self.logit

    def plan(self, budget) -> Plan:
        """This call's plan (shard_plan with its dtypes)."""
        args = (self.n, self.v, self.h, self.dtype.itemsize, budget, self.want["weight"],
                self.shard)
        wide = self.gw is not None and self.gw.dtype == numpy.float32 and self.narrow
        grouped = getattr(self.head, "grouped", None)
        if grouped is not None and self.names:
            pl = group_plan(*args[:6], grouped.group_rows(self), wide_weight_grad=wide)
            if pl is None:
                raise NoGroupPlan(f"a group of {grouped.group_rows(self)} rows' dZ does not fit "
                                  f"{budget} bytes")
            return pl
        beside = getattr(self.head, "beside", 0)
        pl = shard_plan(*args, wide_weight_grad=wide, narrow_logits=self.narrow_logits,
                        beside=beside)
        if pl.kind == "slices" and self.narrow_logits:
            self.narrow_logits = False
            pl = shard_plan(*args, wide_weight_grad=wide, beside=beside)
        return pl

    def _upstream_scale(self):
        """The upstream gradient of each row's loss: grad_output over the 'mean' divisor.
        Formed on first use, after the first chunk's product is queued, so that the device
        starts on it while the host forms these small arrays."""
        import cupy

        if self._scale is not None:
            return self._scale
        (grad_go, grad_output), t, logit = self._upstream, self.t, self.logit
        cw, n, ignore_index = self.cw, self.n, self.options["ignore_index"]
        if self.items is not None:
            self.divisor = cupy.asarray(self.items, logit) if isinstance(self.items, float) \
                else self.items.astype(logit)
        elif self.reduction == "mean":
            valid = t != ignore_index
            if cw is None:
                self.divisor = valid.sum(dtype=logit)
            else:
                self.divisor = (cw[cupy.where(valid, t, 0)].astype(logit) * valid).sum()
        if self.reduction == "none":
            self._scale = (cupy.ascontiguousarray(grad_go.reshape(n)) if grad_go is not None
                           else float(grad_output))
        else:
            g = grad_go.astype(logit) if grad_go is not None else logit.type(grad_output)
            if self.unscale is not None:
                g = logit.type(self.boost)
            self._scale = (g / self.divisor if self.divisor is not None
                           else cupy.asarray(g, logit))
        return self._scale

    def _scale_rows(self, r0, r1):
        s = self._upstream_scale()
        return s[r0:r1] if self.reduction == "none" and not isinstance(s, float) else s

    def _shard_chunk(self, z, dz, r0, r1):
        """A chunk on this rank's classes: the logits' statistics, every rank's through
        shard.gather, their combination (each row's loss and lse, the same on every rank), and
        dZ of these classes from the combined lse.  Returns what evaluate would:
        [loss ('none': the rows', else their sum), None, None, lse]."""
        import cupy

        from cupyloss.rowwise import _family as _rowwise

        m, t, opts = r1 - r0, self.t[r0:r1], self.options
        stats = cupy.empty((m, _rowwise.SLICE_FIELDS), self.logit)
        _rowwise.slice_stats(z, t, stats, self.c0, self.classes, self.cw,
                             ignore_index=opts["ignore_index"],
                             label_smoothing=opts["label_smoothing"], softcap=opts["softcap"],
                             stream=self.stream, device=self.device)
        every = cupy.ascontiguousarray(self.shard.gather(stats))
        loss, lse, wy = (cupy.empty((m,), self.logit) for _ in range(3))
        _rowwise.combine(every, t, self.cw, loss, lse, wy, self.classes,
                         ignore_index=opts["ignore_index"],
                         label_smoothing=opts["label_smoothing"],
                         lse_square_scale=opts["lse_square_scale"],
                         ctype=_dtypes.DTYPES[self.logit].ctype, stream=self.stream,
                         device=self.device)
        if self.names:
            wsum = (self.cw.sum() if self.cw is not None and opts["label_smoothing"] else None)
            _rowwise.slice_grad(z, t, lse, dz, self.c0, self.classes, self.cw, wsum,
                                self._scale_rows(r0, r1), **opts, stream=self.stream,
                                device=self.device)
        value = loss if self.reduction == "none" else loss.sum()
        return [value, None, None, lse]

    def _lend(self, ws, at) -> None:
        """The rest of the workspace from byte `at` to a head that holds arrays beside the
        logits (plan's `beside`: head.lend)."""
        if getattr(self.head, "beside", 0):
            self.head.lend(ws[at:])

    def first_pass(self, pl: Plan) -> None:
        """Row chunks: logits, the loss (and lse), dZ in the inputs' dtype, dX = dZ W, and dW
        per the plan: kept dZ for one product at the end ("keep"), a float32 or split sum
        ("sum"), or nothing here ("slices").  Under the "group" plan the head's groups of
        chunks (head.grouped.schedule) have every chunk's dZ formed first, at a unit upstream
        gradient, and the products after, each piece of rows scaled by its upstream gradient on
        the device (head.grouped.scales)."""
        import cupy

        from cupyloss.rowwise import _family as _rowwise

        n, h, v, x, w = self.n, self.h, self.v, self.x, self.w
        rows = pl.rows
        logit, dtype = self.logit, self.dtype
        want, names = self.want, self.names
        ws = cupy.empty((pl.bytes + 1024,), numpy.uint8)
        keep = pl.kind == "keep" and bool(names)
        grouped = pl.kind == "group"
        narrow_logits = self.narrow_logits
        if narrow_logits:
            # 16-bit logits, their gradient written over them (all rows' for "keep")
            z_all, at = _carve(ws, 0, (n, v) if keep else (min(rows, max(n, 1)), v), dtype)
        else:
            z_all, at = _carve(ws, 0, (min(rows, max(n, 1)), v), logit)
        dz_all: Any = None
        if grouped:
            if names:           # a group's dZ, beside the chunk of logits
                dz_all, at = _carve(ws, at, (max(pl.tile, 1), v), dtype)
        elif narrow_logits:
            dz_all = z_all if names else None
        elif self.narrow and names:
            dz_all, at = _carve(ws, at, (n, v) if keep else z_all.shape, dtype)
        elif (self.shard is not None or isinstance(self.head, _SliceHead)) and names:
            # the slice gradient is not formed in place: a float32 dZ beside the logits
            dz_all = cupy.empty(z_all.shape, logit)
        # The weight's gradient summed over chunks (or groups) in float32.
        wsum = (_WeightSum(self, ws, at, pl.cols)
                if want["weight"] and pl.kind in ("sum", "group") else None)
        self._lend(ws, at if wsum is None else wsum.end)
        reduction = self.reduction
        if self.want_value:
            if reduction == "none":
                self.loss_rows = cupy.empty((n,), logit)
            else:
                self.losses = []       # each chunk's sum (0-d)
        if (self.return_lse or pl.kind == "slices") and self.head is None:
            self.lse = cupy.empty((n,), logit)
        spec = _rowwise.SPECS["cross_entropy"]
        head = self.head
        schedule = (head.grouped.schedule(self, rows, pl.tile) if grouped
                    else [[(r0, min(n, r0 + rows))] for r0 in range(0, n, rows)])
        for group in schedule:
            done = []           # (r0, r1, their rows of X, their dZ) of the group's chunks
            kept = 0
            for r0, r1 in group:
                m = r1 - r0
                z = z_all[r0:r1] if narrow_logits and keep else z_all[:m]
                xc = x[r0:r1]
                if self.b is not None:
                    z[...] = self.b
                # Z^T (V x m, column-major) = W (H x V col-major)^T X_c (H x m col-major)
                self.blas.gemm(_OP_T, _OP_N, v, m, h, w, h, xc, h, z, v,
                               accumulate=self.b is not None)
                # dZ: the logits themselves (float32 inputs), else 16-bit rows of dz_all
                if grouped:
                    dz = dz_all[kept:kept + m] if names else z
                    kept += m
                elif narrow_logits or dz_all is None:
                    dz = z
                else:
                    dz = dz_all[r0:r1] if keep else dz_all[:m]
                if head is not None:
                    head.chunk(self, z, dz if names else None, r0, r1)
                    out = None
                elif self.shard is not None:
                    out = self._shard_chunk(z, dz, r0, r1)
                else:
                    out = _rowwise.evaluate(
                        spec, z, self.t[r0:r1], self.cw,
                        reduction="none" if reduction == "none" else "sum", **self.options,
                        want_value=self.want_value, wrt=("input",) if names else (),
                        grad_output=self._scale_rows(r0, r1), inplace=bool(names) and dz is z,
                        want_lse=self.lse is not None,
                        grad_into=dz if names and dz is not z else None, acc_io=narrow_logits)
                if self.want_value and out is not None:
                    if reduction == "none":
                        self.loss_rows[r0:r1] = out[0]
                    else:
                        self.losses.append(out[0])
                if self.lse is not None and out is not None:
                    self.lse[r0:r1] = out[3]
                if names:
                    done.append((r0, r1, xc, dz))
            if not names:
                continue
            scales = (head.grouped.scales(self, group) if grouped
                      else [[(r0, r1, self.unscale)] for r0, r1, _, _ in done])
            pieces = []
            for (r0, r1, xc, dz), parts in zip(done, scales):
                for p0, p1, alpha in parts:
                    d = dz[p0 - r0:p1 - r0]
                    if want["bias"]:
                        db = d.sum(axis=0, dtype=logit)
                        self.gb += db if alpha is None or isinstance(alpha, numpy.ndarray) \
                            else alpha * db
                    if want["hidden"]:
                        # dX_c^T (H x m) = W (H x V col-major) dZ^T (V x m col-major)
                        self.blas.gemm(_OP_N, _OP_N, h, p1 - p0, v, w, h, d, v,
                                       self.gx[p0:p1], h, alpha=alpha)
                    pieces.append((x[p0:p1], d, alpha))
                if want["hidden"] and self.shard is not None and self.shard.reduce is not None:
                    self.shard.reduce(self.gx[r0:r1])
            if wsum is not None:
                wsum.add(pieces)
        if want["weight"]:
            if wsum is not None:
                wsum.finish()
            elif n == 0:
                self.gw[...] = 0
            elif keep:
                self.blas.gemm(_OP_N, _OP_T, h, v, n, x, h, dz_all, v, self.gw, h,
                               alpha=self.unscale)

    def second_pass(self, pl: Plan) -> None:
        """Class slices (the "slices" plan): each slice's logits again, all rows or tiles of
        them, its dZ from the first pass's lse, and that slice of dW."""
        import cupy

        from cupyloss.rowwise import _family as _rowwise

        n, h, v, x, w = self.n, self.h, self.v, self.x, self.w
        logit, dtype = self.logit, self.dtype
        ws = cupy.empty((pl.bytes + 1024,), numpy.uint8)
        z_all, at = _carve(ws, 0, (pl.tile, pl.cols), logit)
        dz_all, at = _carve(ws, at, (pl.tile, pl.cols), dtype)
        acc = None    # tiles of rows: a float32 sum of the slice's dW (the result if float32)
        if pl.tile < n and self.gw.dtype != numpy.float32:
            acc, at = _carve(ws, at, (pl.cols, h), numpy.float32)
        self._lend(ws, at)
        wsum = None
        if self.cw is not None and self.options["label_smoothing"]:
            wsum = self.cw.sum()
        for c0 in range(0, v, pl.cols):
            c1 = min(v, c0 + pl.cols)
            k = c1 - c0
            for r0 in range(0, n, pl.tile):
                r1 = min(n, r0 + pl.tile)
                m = r1 - r0
                z = z_all.reshape(-1)[:m * k].reshape(m, k)
                dz = dz_all.reshape(-1)[:m * k].reshape(m, k)
                if self.b is not None:
                    z[...] = self.b[c0:c1]
                self.blas.gemm(_OP_T, _OP_N, k, m, h, w[c0:c1], h, x[r0:r1], h, z, k,
                               accumulate=self.b is not None)
                if self.head is not None:
                    self.head.grad(self, z, dz, r0, r1, c0)
                else:
                    _rowwise.slice_grad(z, self.t[r0:r1], self.lse[r0:r1], dz, self.c0 + c0,
                                        self.classes, self.cw, wsum, self._scale_rows(r0, r1),
                                        **self.options, stream=self.stream,
                                        device=self.device)
                if acc is None:
                    # dW[c0:c1]^T (H x k) = X (H x n col-major) dZ_s (k x n col-major)^T
                    self.blas.gemm(_OP_N, _OP_T, h, k, m, x[r0:r1], h, dz, k, self.gw[c0:c1], h,
                                   accumulate=r0 > 0, alpha=self.unscale)
                else:
                    self.blas.gemm(_OP_N, _OP_T, h, k, m, x[r0:r1], h, dz, k, acc[:k], h,
                                   accumulate=r0 > 0, alpha=self.unscale)
            if acc is not None:
                _narrow(acc[:k], self.gw[c0:c1], self.stream, self.device)

    def results(self, hidden_shape):
        import cupy

        grads = {}
        if self.want["hidden"]:
            grads["hidden"] = self.gx.reshape(hidden_shape)
        if self.want["weight"]:
            grads["weight"] = self.gw
        if self.want["bias"]:
            gb = self.gb
            if self.unscale is not None:
                gb *= self.unscale[0]
            grads["bias"] = gb if gb.dtype == self.result["bias"] else gb.astype(
                self.result["bias"])
        for name in ("hidden", "weight") if not self.partial else ("weight",):
            if name in grads and grads[name].dtype != self.result[name]:
                grads[name] = grads[name].astype(self.result[name])
        loss = None
        if self.head is not None:
            return loss, grads, None
        self._upstream_scale()    # the divisor, where no chunk asked for it (no rows)
        if self.want_value:
            if self.reduction == "none":
                loss = self.loss_rows.reshape(hidden_shape[:-1])
            else:
                # one chunk's sum as it is (a division of it in float64 rounds to the same),
                # more summed in float64
                losses = self.losses
                if len(losses) == 1:
                    total = losses[0]
                elif losses:
                    total = losses[0].astype(numpy.float64)
                    for chunk in losses[1:]:
                        total += chunk
                else:
                    total = cupy.zeros((), "f8")
                if self.divisor is not None:
                    total = total / self.divisor
                loss = total.astype(self.logit, copy=False)
        lse = self.lse.reshape(hidden_shape[:-1]) if self.return_lse else None
        return loss, grads, lse


STATS = _args.Layout(_source.kernel_words("logprob.cu", "logprob_stats"))
GRAD = _args.Layout(_source.kernel_words("logprob.cu", "logprob_grad"))
(LP_INDEX64,) = _source.constants("logprob.cu", "LP_INDEX64")
# Blocks a launch of the log-probability kernels at most per SM (a block a row, rows in a
# grid-stride loop beyond them).
LP_BLOCKS_PER_SM = 8


def _row_arrays(frame, device, shapes, named, any_dtype=False) -> list:
    """Each (name, value) of `named` as the heads take it: None, a Python number as a float, or
    an array of one of `shapes` in `frame`'s framework on `device` as a CuPy view (of a
    floating dtype, or with `any_dtype` of any: a mask); a wrong shape or device is refused
    before any launch."""
    got: list = []
    for name, a in named:
        if a is None or (isinstance(a, (int, float)) and not isinstance(a, bool)):
            got.append(None if a is None else float(a))
            continue
        _dispatch.check_same_frame(frame, a, a, name, name)
        op = _target_operand(frame, a) if any_dtype else frame.operand(a, name)
        if tuple(op.shape) not in shapes:
            raise ValueError(f"{name} must have the target's shape {shapes[0]} (one value a "
                             f"token), got {tuple(op.shape)}")
        if op.device != device:
            raise ValueError(f"{name} is on CUDA device {op.device} but hidden is on CUDA "
                             f"device {device}")
        got.append(_plain(frame.cupy_view(op)))
    return got


class NoGroupPlan(Exception):
    """A head's group of rows (plan's `group`) does not fit the call's workspace budget."""


class _LogProbs:
    """The per-token head of linear_log_probs in a _Call's passes: each chunk's (or slice's)
    logits give every row's log p(target), entropy and lse (logprob.cu's logprob_stats), and
    with gradients dZ from them and the upstream gradients (logprob_grad)."""

    def __init__(self, temperature, want_entropy, g_lp, g_ent, token=None):
        self.temperature, self.want_entropy = temperature, want_entropy
        self.g_lp, self.g_ent = g_lp, g_ent     # None, or a Python number or a (rows,) array
        # a row policy (posttrain._GRPOTokens): each chunk's upstream gradients formed from its
        # rows' statistics, between them and dZ, in the same pass
        self.token = token
        self.token_results = None
        # a row policy whose upstream gradients are known a group of rows at a time (the
        # "group" plan: posttrain._PreferenceRows)
        self.grouped = token if hasattr(token, "schedule") else None

    def bind(self, frame, device, shape) -> None:
        """The upstream gradients as numbers or CuPy views of (rows,) arrays: each a Python
        number, or an array of the target's `shape` in `frame`'s framework on `device`."""
        self.frame = frame
        self.g_lp, self.g_ent = _row_arrays(frame, device, (shape,), (
            ("grad_output", self.g_lp), ("grad_entropy", self.g_ent)))
        if self.token is not None:
            self.token.bind(frame, device, shape)

    def start(self, call) -> None:
        """Results and upstream gradients as (rows,) arrays of the logits' dtype."""
        import cupy

        n, logit = call.n, call.logit
        self.logp = cupy.empty((n,), logit)
        self.lse = cupy.empty((n,), logit)
        need_h = (self.want_entropy or self.g_ent is not None
                  or (self.token is not None and getattr(self.token, "entropy", True)))
        self.ent = cupy.empty((n,), logit) if need_h else None
        self.g = [None if g is None else cupy.full((n,), g, logit) if isinstance(g, float)
                  else cupy.ascontiguousarray(g.reshape(n), dtype=logit)
                  for g in (self.g_lp, self.g_ent)]
        if self.token is not None:
            self.token.start(call, self)
        info = _dtypes.DTYPES[logit]
        self.flags = LP_INDEX64 if call.t.dtype == numpy.int64 else 0
        self.stats_fn = STATS.bind(
            _source.function("logprob.cu", f"cupyloss::logprob_stats<{info.ctype}>").kernel.ptr)
        gtype = _dtypes.DTYPES[call.dtype].ctype
        self.grad_fns: dict = {}
        self.grad_name = lambda g: f"cupyloss::logprob_grad<{info.ctype}, {g}>"
        self.gtype = gtype
        from cupyloss._core import launch as _launch

        self.most = _launch.device_limits(call.device).sm_count * LP_BLOCKS_PER_SM

    def _grad_fn(self, dtype):
        ctype = _dtypes.DTYPES[dtype].ctype
        fn = self.grad_fns.get(ctype)
        if fn is None:
            fn = self.grad_fns[ctype] = GRAD.bind(
                _source.function("logprob.cu", self.grad_name(ctype)).kernel.ptr)
        return fn

    def chunk(self, call, z, dz, r0, r1) -> None:
        """A chunk of all the classes: its rows' statistics, then dZ where dz is given."""
        m, v = z.shape
        if m == 0:
            return
        grid = (min(m, self.most), 1, 1)
        words = STATS.template({
            "z": z.data.ptr, "tgt": call.t[r0:r1].data.ptr, "rows": m, "cols": v,
            "z_rs": z.strides[0] // z.itemsize, "flags": self.flags,
            "ignore_index": _args.i64_word(int(call.options["ignore_index"])),
            "temperature": _args.f64_word(self.temperature),
            "logp": self.logp[r0:r1].data.ptr,
            "ent": 0 if self.ent is None else self.ent[r0:r1].data.ptr,
            "lse": self.lse[r0:r1].data.ptr})
        _args.launch(self.stats_fn, grid, (_LP_BLOCK, 1, 1), 0, call.stream, words)
        if self.token is not None:
            self.token.rows(call, self, r0, r1)
        if dz is not None:
            self.grad(call, z, dz, r0, r1, 0)

    def grad(self, call, z, dz, r0, r1, c0) -> None:
        """dZ of rows r0 .. r1 - 1 of classes c0 .. c0 + z.shape[1] - 1."""
        m, k = z.shape
        if m == 0 or k == 0:
            return
        g_lp, g_ent = self.g
        words = GRAD.template({
            "z": z.data.ptr, "tgt": call.t[r0:r1].data.ptr, "rows": m, "cols": k,
            "z_rs": z.strides[0] // z.itemsize, "c0": c0, "classes": call.v,
            "flags": self.flags,
            "ignore_index": _args.i64_word(int(call.options["ignore_index"])),
            "temperature": _args.f64_word(self.temperature),
            "lse": self.lse[r0:r1].data.ptr,
            "ent": 0 if self.ent is None else self.ent[r0:r1].data.ptr,
            "g_lp": 0 if g_lp is None else g_lp[r0:r1].data.ptr,
            "g_ent": 0 if g_ent is None else g_ent[r0:r1].data.ptr,
            "dz": dz.data.ptr, "g_rs": dz.strides[0] // dz.itemsize})
        _args.launch(self._grad_fn(dz.dtype), (min(m, self.most), 1, 1), (_LP_BLOCK, 1, 1), 0,
                     call.stream, words)

    def results(self, shape):
        if self.token is not None:
            self.token_results = self.token.results(self)
        logp = self.logp.reshape(shape)
        return logp, (self.ent.reshape(shape) if self.want_entropy else None)


(_LP_BLOCK,) = _source.constants("logprob.cu", "LP_BLOCK")


class _SliceHead:
    """The head of a weight holding classes c0 .. c0 + V - 1 of `classes` (vocab parallelism
    whose collectives the caller makes between two calls): the "stats" pass writes every row's
    softmax state over these classes (rowwise.cu's cross_entropy_slice_stats, what
    cupyloss.parallel.vocab_parallel_stats gives for logits), the "grad" pass forms their dZ
    from each row's lse over all the classes and its upstream gradient
    (cross_entropy_slice_grad), the hidden gradient coming back as this share's float32 partial
    sum."""

    partial = True

    def __init__(self, kind, c0, classes, options, lse=None, g=None):
        self.kind, self.c0, self.classes, self.options = kind, c0, classes, options
        self.offset = c0            # what _check reads of a share of the classes
        self.lse, self.g = lse, g

    def bind(self, frame, device, shape) -> None:
        """lse and the upstream gradient (a number, or (rows,) of the target's shape) as CuPy
        views; the checks before any launch."""
        shapes = (shape, (math.prod(shape),))
        self.lse, = _row_arrays(frame, device, shapes, (("lse", self.lse),))
        self.g, = _row_arrays(frame, device, shapes + ((),), (("grad_rows", self.g),))

    def start(self, call) -> None:
        import cupy

        n, logit = call.n, call.logit
        if self.kind == "stats":
            from cupyloss.rowwise import _family as _rowwise

            self.stats: Any = cupy.empty((n, _rowwise.SLICE_FIELDS), logit)
            return
        self.stats = None
        if self.lse is None:
            raise ValueError("the gradient of a slice of the classes needs each row's lse")
        self.lse = cupy.ascontiguousarray(self.lse.reshape(n), dtype=logit)
        g = self.g
        self.g = (1.0 if g is None else g if isinstance(g, float)
                  else cupy.ascontiguousarray(g.reshape(-1) if g.ndim else g, dtype=logit))
        self.wsum = (call.cw.sum() if call.cw is not None and self.options["label_smoothing"]
                     else None)

    def chunk(self, call, z, dz, r0, r1) -> None:
        from cupyloss.rowwise import _family as _rowwise

        opts = self.options
        if self.kind == "stats":
            _rowwise.slice_stats(z, call.t[r0:r1], self.stats[r0:r1], self.c0, self.classes,
                                 call.cw, ignore_index=opts["ignore_index"],
                                 label_smoothing=opts["label_smoothing"],
                                 softcap=opts["softcap"], stream=call.stream,
                                 device=call.device)
        elif dz is not None:
            self.grad(call, z, dz, r0, r1, 0)

    def grad(self, call, z, dz, r0, r1, c0) -> None:
        from cupyloss.rowwise import _family as _rowwise

        g = self.g if isinstance(self.g, float) or self.g.ndim == 0 else self.g[r0:r1]
        _rowwise.slice_grad(z, call.t[r0:r1], self.lse[r0:r1], dz, self.c0 + c0, self.classes,
                            call.cw, self.wsum, g, **self.options, stream=call.stream,
                            device=call.device)

    def results(self, shape):
        return (self.stats,)



_INDEX_DTYPES = (numpy.dtype(numpy.int32), numpy.dtype(numpy.int64))


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
                             _dispatch.element_strides(view.strides, view.itemsize, "target"),
                             view.dtype,
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
                         max_workspace_bytes: int | None = None,
                         check_targets: bool = False, compute_dtype: Any = None,
                         num_items: Array | int | None = None) -> Any:
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
      max_workspace_bytes: bytes a call may hold besides its results (default
        DEFAULT_WORKSPACE_BYTES); the plan, chunk rows and class slices follow from it (plan).
      check_targets: raise IndexError for a class index outside [0, V) (synchronises); without
        it such a row's loss and gradients are NaN and counted (cupyloss.rejected_targets).
      compute_dtype: None, or float16 / bfloat16: the products run in it, as torch.autocast's
        F.linear runs them: hidden, weight and bias (each float16, bfloat16 or float32) are
        rounded to it inside the call, and each gradient comes back in its argument's dtype,
        written by cuBLAS in float32 from the 16-bit operands (a float32 master weight's
        gradient is never rounded to 16 bits).
      num_items: None, or the divisor of the summed loss for 'mean' and 'sum' alike: the
        counted rows of every micro-batch of a gradient-accumulation step (an int, or a 0-d
        int32/int64 array on hidden's device, never read back), so that the micro-batches'
        gradients add up to the whole batch's (cupyloss.cross_entropy's num_items).

    Returns:
      The loss: 0-d for 'mean'/'sum', else hidden's shape without its last dim; float32
      (float64 for float64 inputs), the logits' precision.

    Example:
      >>> loss = cupyloss.linear_cross_entropy(h, lm_head_weight, labels)
    """
    return _run(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                label_smoothing, lse_square_scale, softcap, max_workspace_bytes, True, (), 1.0,
                False, check=check_targets, compute_dtype=compute_dtype,
                num_items=num_items)[0]


def linear_cross_entropy_backward(grad_output: Array | float, hidden: Array, weight: Array,
                                  target: Array, bias: Array | None = None,
                                  class_weight: Array | None = None, ignore_index: int = -100,
                                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                                  lse_square_scale: float = 0.0, softcap: float = 0.0,
                                  max_workspace_bytes: int | None = None,
                                  wrt: str | Sequence[str] | None = None,
                                  check_targets: bool = False,
                                  compute_dtype: Any = None,
                                  num_items: Array | int | None = None) -> Any:
    """Gradients of linear_cross_entropy (the logits formed again, chunk by chunk).

    With dZ the gradient of cross_entropy at the logits (cupyloss.cross_entropy_backward's, g the
    upstream gradient over the 'mean' divisor), rounded to hidden's dtype:

      ``d/dhidden = dZ W``,   ``d/dweight = dZ^T X``,   ``d/dbias = sum_rows dZ``

    the last two accumulated in float32 over every row and rounded once (the plans in the
    module docstring).

    Args:
      grad_output: Python number, 0-d array, or for 'none' an array of the loss's shape.
      hidden, ..., max_workspace_bytes, check_targets, compute_dtype, num_items: as for
        linear_cross_entropy.
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
                       names, grad_output, False, check=check_targets,
                       compute_dtype=compute_dtype, num_items=num_items)
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
                                        return_lse: bool = False,
                                        check_targets: bool = False,
                                        compute_dtype: Any = None,
                                        num_items: Array | int | None = None
                                        ) -> tuple[Any, ...]:
    """linear_cross_entropy and its gradients in one pass: three matrix products in all.

    Args:
      hidden, ..., max_workspace_bytes, check_targets, compute_dtype, num_items: as for
        linear_cross_entropy.
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
                            True, names, grad_output, return_lse, check=check_targets,
                            compute_dtype=compute_dtype, num_items=num_items)
    out = tuple(grads[name] for name in names)
    out = out[0] if single else out
    return (loss, out, lse) if return_lse else (loss, out)


def _temperature(temperature) -> float:
    t = float(temperature)
    if not (0.0 < t < math.inf):
        raise ValueError(f"temperature must be a positive finite number (the logits are divided "
                         f"by it), got {temperature}")
    return t


def _log_probs(hidden, weight, target, bias, temperature, return_entropy, ignore_index,
               max_workspace_bytes, compute_dtype, names, g_lp, g_ent, want_value):
    head = _LogProbs(_temperature(temperature), bool(return_entropy), g_lp, g_ent)
    out, grads, _ = _run(hidden, weight, target, bias, None, ignore_index, "none", 0.0, 0.0, 0.0,
                         max_workspace_bytes, False, names, 1.0, False,
                         compute_dtype=compute_dtype, head=head)
    value = (out if return_entropy else out[0]) if want_value else None
    return value, tuple(grads[name] for name in names)


def linear_log_probs(hidden: Array, weight: Array, target: Array, bias: Array | None = None, *,
                     temperature: float = 1.0, return_entropy: bool = False,
                     ignore_index: int = -100, max_workspace_bytes: int | None = None,
                     compute_dtype: Any = None) -> Any:
    """Per-token log-probabilities (and entropy) of a language model's head, logits never whole.

    With ``Z = (X W^T + b) / T`` (T the temperature), formed chunk by chunk in float32 (float64
    for float64 inputs) and never rounded to 16 bits, ``lse_i = log sum_c exp(Z_ic)``:

      ``logp_i = Z_{i, y_i} - lse_i``   (0 where y_i == ignore_index)
      ``H_i = -sum_c p_ic log p_ic = lse_i - sum_c p_ic Z_ic``,   ``p_ic = exp(Z_ic - lse_i)``

    as ``torch.log_softmax(logits.float() / T, -1).gather(-1, y)`` and the entropy of the same
    distribution (the temperature-scaled one, as RL frameworks' policy entropy).  The entropy
    is computed for every row, ignored ones included.  A target outside [0, V) gives that row
    NaN.  Differentiate any objective on them with linear_log_probs_backward.

    Args:
      hidden: (..., H), float16, bfloat16, float32 or float64.
      weight: (V, H) of hidden's dtype, as torch.nn.Linear stores it.
      target: int32/int64 class indices, hidden's shape without its last dim.
      bias: None or (V,) of hidden's dtype.
      temperature: > 0, finite; the logits are divided by it.
      return_entropy: also return the entropy.
      ignore_index: target value whose log-probability is 0.
      max_workspace_bytes, compute_dtype: as for linear_cross_entropy.

    Returns:
      logp, or ``(logp, entropy)``: target's shape, float32 (float64 for float64 inputs).

    Example:
      >>> logp, ent = cupyloss.linear_log_probs(h, lm_head_weight, tokens, temperature=0.7,
      ...                                       return_entropy=True)
    """
    return _log_probs(hidden, weight, target, bias, temperature, return_entropy, ignore_index,
                      max_workspace_bytes, compute_dtype, (), None, None, True)[0]


def linear_log_probs_backward(grad_output: Array | float | None, hidden: Array, weight: Array,
                              target: Array, bias: Array | None = None, *,
                              grad_entropy: Array | float | None = None,
                              temperature: float = 1.0, ignore_index: int = -100,
                              max_workspace_bytes: int | None = None,
                              wrt: str | Sequence[str] | None = None,
                              compute_dtype: Any = None) -> Any:
    """Gradients of ``sum_i g_i logp_i + e_i H_i`` (linear_log_probs' outputs) with respect to
    hidden, weight and bias, the logits formed again chunk by chunk.

    With g the upstream gradient of the log-probabilities (grad_output) and e that of the
    entropy (grad_entropy), per element of Z = logits / T:

      ``dZ_ic = g_i ([c == y_i] - p_ic) - e_i p_ic (log p_ic + H_i)``   (g_i = 0 on ignored rows)

    then ``dlogits = dZ / T`` (rounded to hidden's dtype, as torch's autograd rounds it),
    ``d/dhidden = dlogits W``, ``d/dweight = dlogits^T X``, ``d/dbias = sum_rows dlogits``, each
    product accumulated in float32 (the plans of linear_cross_entropy).

    Args:
      grad_output: the log-probabilities' upstream gradient: None (0), a Python number, or an
        array of target's shape (any floating dtype, cast to float32).
      grad_entropy: the entropy's, the same kinds (None: the entropy is not differentiated).
      hidden, weight, target, bias, temperature, ignore_index, max_workspace_bytes,
        compute_dtype: as for linear_log_probs.
      wrt: 'hidden', 'weight', 'bias' or a tuple of them (default: hidden and weight).

    Returns:
      The gradients named by wrt (a tuple, or one array for a single name), each of its
      argument's shape and dtype.

    Example:
      >>> g_h, g_w = cupyloss.linear_log_probs_backward(-advantages / n, h, w, tokens,
      ...                                               grad_entropy=-0.01 / n)
    """
    names, single = _names(wrt)
    _, grads = _log_probs(hidden, weight, target, bias, temperature, False, ignore_index,
                          max_workspace_bytes, compute_dtype, names, grad_output, grad_entropy,
                          False)
    return grads[0] if single else grads


def linear_log_probs_value_and_grad(hidden: Array, weight: Array, target: Array,
                                    bias: Array | None = None, *,
                                    grad_output: Array | float | None = 1.0,
                                    grad_entropy: Array | float | None = None,
                                    temperature: float = 1.0, return_entropy: bool = False,
                                    ignore_index: int = -100,
                                    max_workspace_bytes: int | None = None,
                                    wrt: str | Sequence[str] | None = None,
                                    compute_dtype: Any = None) -> tuple[Any, Any]:
    """linear_log_probs and the gradients of linear_log_probs_backward in one pass (three
    matrix products in all), for upstream gradients known before the call (a policy gradient's
    advantages, an entropy bonus).

    Args:
      hidden, ..., return_entropy, compute_dtype: as for linear_log_probs.
      grad_output, grad_entropy, wrt: as for linear_log_probs_backward.

    Returns:
      ``(logp, grads)`` or ``((logp, entropy), grads)`` with return_entropy.

    Example:
      >>> logp, (g_h, g_w) = cupyloss.linear_log_probs_value_and_grad(
      ...     h, w, tokens, grad_output=-advantages / n)
    """
    names, single = _names(wrt)
    value, grads = _log_probs(hidden, weight, target, bias, temperature, return_entropy,
                              ignore_index, max_workspace_bytes, compute_dtype, names,
                              grad_output, grad_entropy, True)
    return value, grads[0] if single else grads
