"""The engine behind the row-wise losses (cross_entropy, nll_loss): plan once per layout, launch.

`evaluate` is the one entry point.  Arrays come in through `_dispatch` as Operands; class-index
targets (int32/int64) are read here the same ways (`_target_operand`), since the pointwise dtypes
table holds only floating types.  The input is viewed as [N, C, inner] with the class axis at
dim 1 (`_rowwise_launch.class_geometry`): when the classes are contiguous and inner == 1 the rows kernel
runs (a team of threads or several blocks per row, the row held in registers, see
kernels/rowwise.cu), otherwise the thread-per-row kernel.  Everything that depends only on
metadata is a cached Plan with packed parameter words; a call allocates its outputs and launches
once, or twice for a 'mean' gradient over class indices, whose divisor (the summed weights of the
counted rows) a small launch computes first on the device.  Nothing is read back to the host
unless `check_targets` asks for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy

from cupyloss._core import (
    args as _args, dispatch as _dispatch, dtypes as _dtypes, engine as _engine,
    launch as _launch, plans as _plans, reduction as _reduction, source as _source,
    validate as _validate)
from cupyloss.rowwise import _launch as _rowwise_launch
from cupyloss._core.engine import Launched, Plan

# Flag bits, and a row state's accumulators in the group exchange: kernels/rowwise.cu's.
(FLAG_INDEX64, FLAG_PROB, FLAG_NLL, FLAG_GO_DEVICE, FLAG_GO_ROWS, FLAG_MEAN_W, FLAG_ACC_IO,
 FLAG_ITEMS32, _FIELDS, SLICE_FIELDS) = _source.constants(
    "rowwise.cu", "ROW_INDEX64", "ROW_PROB", "ROW_NLL", "ROW_GO_DEVICE", "ROW_GO_ROWS",
    "ROW_MEAN_W", "ROW_ACC_IO", "ROW_ITEMS32", "ROW_FIELDS", "SLICE_FIELDS")


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """A registered row-wise loss.

    kind: "cross_entropy" (softmax over the class axis) or "nll" (the input holds
    log-probabilities); arrays: the array arguments in torch's order, those a gradient may be asked
    for (the target's only when it holds probabilities); options: the keyword options of the
    public function, in its order.
    """

    name: str
    kind: str
    reductions: tuple = ("none", "mean", "sum")
    arrays: tuple = ("input", "target")
    options: tuple = ()

    def loss_shape(self, input_shape: tuple, reduction: str) -> tuple:
        """The loss's shape: () when reduced, else the input's without its class axis (dim 1)."""
        if reduction != "none" or len(input_shape) < 2:
            return ()
        return (input_shape[0], *input_shape[2:])


# The registry of row-wise losses, in the shape of _pointwise.SPECS (name, reductions, arrays,
# options) plus loss_shape for an adapter's fake tensors.
SPECS = {
    "cross_entropy": RowSpec("cross_entropy", "cross_entropy",
                             options=("weight", "ignore_index", "label_smoothing",
                                      "lse_square_scale", "softcap", "check_targets",
                                      "num_items")),
    "nll_loss": RowSpec("nll_loss", "nll", options=("weight", "ignore_index", "check_targets",
                                                    "num_items")),
}

# cross_entropy_rows<T, MODE>'s variants: kernels/rowwise.cu's.
(MODE_FORWARD, MODE_GRAD, MODE_GENERAL, MODE_NLL, MODE_SMOOTH, MODE_PROB,
 MODE_CAP) = _source.constants("rowwise.cu", "MODE_FORWARD", "MODE_GRAD", "MODE_GENERAL",
                               "MODE_NLL", "MODE_SMOOTH", "MODE_PROB", "MODE_CAP")

# The kernels' parameter lists, one word each, named as kernels/rowwise.cu names them.
ROWS = _args.Layout(_source.kernel_words("rowwise.cu", "cross_entropy_rows"))
COLS = _args.Layout(_source.kernel_words("rowwise.cu", "cross_entropy_cols"))
WSUM = _args.Layout(_source.kernel_words("rowwise.cu", "class_weight_sum"))
SLICE = _args.Layout(_source.kernel_words("rowwise.cu", "cross_entropy_slice_grad"))
STATS = _args.Layout(_source.kernel_words("rowwise.cu", "cross_entropy_slice_stats"))
COMBINE = _args.Layout(_source.kernel_words("rowwise.cu", "cross_entropy_combine"))
# The modes whose gradient may be stored as another (16-bit) type than float32 logits.
_NARROW_MODES = _source.ROWWISE_NARROW_MODES
_ONE = _args.f64_word(1.0)


class Key(NamedTuple):
    """What a rowwise plan depends on: the plan cache's key, passed whole to _build."""

    name: str                # the loss (SPECS)
    reduction: str
    is_index: bool           # class indices (else probabilities)
    options: tuple           # (ignore_index, label_smoothing, lse_square_scale, softcap)
    want_value: bool
    want_gx: bool
    want_gt: bool
    want_lse: bool
    inplace: bool
    go_kind: str             # grad_output: "host", "device" (0-d) or "array" (per row)
    go_strides: tuple | None # a per-row grad_output's (n, d) strides
    x_shape: tuple
    x_strides: tuple
    t_shape: tuple
    t_strides: tuple
    t_dtype: object
    w_strides: object        # the class weight's strides, False without one
    dtype: object
    device: int
    into: tuple | None       # (dtype, strides) of grad_into, the fused head's gradient
    acc_io: bool             # the loss and grad_output in the accumulator type (autocast)
    items: object = None     # num_items: None, "host" (a number, the words "divisor" and
                             # "grad_scale" filled per call) or its array's dtype (int32/int64)


_PLANS = _plans.Plans()


# --- operands (class-index targets and copies: _engine) ------------------------------------------

def _dense_class_strides(geo) -> tuple:
    """(n, c, d) strides of a C-contiguous array of the input's shape (the gradient's)."""
    return (0 if geo.rows == geo.inner else geo.cols * geo.inner, geo.inner if geo.inner > 1 else 1,
            1 if geo.inner > 1 else 0)


# --- checks ----------------------------------------------------------------------------------------

def _check_shapes(spec, x, t, is_index):
    if len(x.shape) == 0:
        raise ValueError(f"{spec.name} needs an input of shape (C,), (N, C) or (N, C, d1, ...), "
                         f"got a 0-d input")
    cols = x.shape[1] if len(x.shape) > 1 else x.shape[0]
    if cols == 0 or cols > _launch.ROW_MAX_COLS:
        raise ValueError(f"{spec.name} needs 1 to {_launch.ROW_MAX_COLS} classes, got input "
                         f"shape {tuple(x.shape)}")
    if is_index:
        want = () if len(x.shape) == 1 else (x.shape[0], *x.shape[2:])
        if tuple(t.shape) != want:
            raise ValueError(f"Expected target size {list(want)}, got {list(t.shape)} (input "
                             f"shape {tuple(x.shape)}; class indices have the input's shape "
                             f"without dim 1)")
        return
    if spec.kind == "nll":
        raise TypeError(f"nll_loss needs class indices (int32 or int64) as target, got dtype "
                        f"{t.dtype}")
    _validate.check_like_input(x, t, f"probability targets must have the input's shape "
                                     f"{tuple(x.shape)}, got {tuple(t.shape)}")


def _check_weight(w, x, cols):
    if w.dtype != x.dtype:
        _validate.check_same_dtype(x, w, "input", "weight")
    if w.device != x.device:
        _validate.check_same_device(x, w, "input", "weight")
    if tuple(w.shape) != (cols,):
        raise ValueError(f"weight tensor should be defined either for all {cols} classes or no "
                         f"classes but got weight tensor of shape: {list(w.shape)}")


def check_targets(frame, t, cols, ignore_index, stream):
    """Raise IndexError, as torch on the CPU, if a class index lies outside [0, cols) and is not
    ignore_index.  Reads a flag back to the host (a synchronisation): opt-in."""
    import cupy

    with cupy.cuda.Device(t.device), cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)):
        v = frame.cupy_view(t)
        bad = (v != ignore_index) & ((v < 0) | (v >= cols))
        if bool(bad.any()):
            raise IndexError(f"Target {int(v[bad].ravel()[0])} is out of bounds.")


# --- plans -------------------------------------------------------------------------------------------

def _flags(spec, is_index, t_dtype, go_kind, mean_w, acc_io=False) -> int:
    flags = FLAG_ACC_IO if acc_io else 0
    if is_index and t_dtype == _engine.INDEX_DTYPES[1]:
        flags |= FLAG_INDEX64
    if not is_index:
        flags |= FLAG_PROB
    if spec.kind == "nll":
        flags |= FLAG_NLL
    if go_kind == "device":
        flags |= FLAG_GO_DEVICE
    elif go_kind == "array":
        flags |= FLAG_GO_ROWS
    if mean_w:
        flags |= FLAG_MEAN_W
    return flags


def _build(key: Key) -> Plan:
    """The plan of a key (see Key: into is None or the (dtype, strides) of the array the input
    gradient is written to; acc_io: the loss and grad_output in the accumulator type,
    FLAG_ACC_IO)."""
    (name, reduction, is_index, options, want_value, want_gx, want_gt, want_lse, inplace,
     go_kind, go_strides, x_shape, x_strides, t_shape, t_strides, t_dtype, w_strides, dtype,
     device, into, acc_io, items) = Key._make(key)
    spec = SPECS[name]
    ignore_index, smoothing, zscale, softcap = options
    info = _dtypes.DTYPES[dtype]
    acc = info.acc
    limits = _launch.device_limits(device)
    geo = _rowwise_launch.class_geometry(x_shape, x_strides, t_shape, t_strides, not is_index)
    if (geo is None or (w_strides is not False and w_strides != (1,) and geo.cols > 1)
            or (go_kind == "array" and go_strides is None)):
        return None     # an operand needs a copy first (_copies)
    rows, cols = geo.rows, geo.cols
    want_g = want_gx or want_gt
    # The divisor of the 0-d loss: summed weights of counted rows (class indices, 'mean'), the
    # row count (probabilities, 'mean'), else 1.
    # num_items replaces it: a number (words filled per call), or an array read on the device
    # into region "denom" by class_weight_sum, which every launch then divides by.
    mean_w = reduction == "mean" and is_index and items is None
    divisor = float(rows) if reduction == "mean" and not is_index and items is None else 1.0
    grad_scale = 1.0 / divisor if divisor else math.nan
    flags = _flags(spec, is_index, t_dtype, go_kind, mean_w and want_value, acc_io)
    common = {"rows": rows, "cols": cols, "flags": flags,
              "ignore_index": _args.i64_word(ignore_index), "smoothing": _args.f64_word(smoothing),
              "zscale": _args.f64_word(zscale), "softcap": _args.f64_word(softcap),
              "go_value": _ONE, "grad_scale": _args.f64_word(grad_scale),
              "divisor": _args.f64_word(divisor)}
    go_rs = go_strides or (0, 0)
    g_strides = geo.x if inplace else _dense_class_strides(geo)
    gtype = None
    if into is not None:
        g_strides = (into[1][0] if len(into[1]) > 1 else 0, 1, 0)
        gtype = _dtypes.DTYPES[into[0]].ctype
    scratch = _engine.Regions()

    counters = 0
    if geo.contiguous_classes:
        mode = (MODE_NLL if spec.kind == "nll"
                else MODE_CAP if softcap != 0.0 and is_index and smoothing == 0.0
                else MODE_GENERAL if softcap != 0.0
                else MODE_PROB if not is_index else MODE_SMOOTH if smoothing != 0.0
                else MODE_GRAD if want_g else MODE_FORWARD)
        if gtype is not None and mode not in _NARROW_MODES:
            raise ValueError(f"a {gtype} gradient of {info.ctype} logits has no kernel for "
                             f"mode {mode}")
        name = _source.rowwise_name("cross_entropy_rows", info.ctype, mode, 1, gtype)
        cfg = _rowwise_launch.row_launch(
            rows, cols, dtype.itemsize, acc.itemsize, want_g, mode == MODE_NLL, limits,
            lambda shared, kc: _source.resident(
                "rowwise.cu", _source.rowwise_name("cross_entropy_rows", info.ctype, mode, kc,
                                                   gtype), shared))
        words = ROWS.template({**common, "x_rs": geo.x[0], "t_rs": geo.t[0], "go_rs": go_rs[0],
                               "g_rs": g_strides[0], "tpr": cfg.tpr, "k": cfg.k,
                               "stash": cfg.stash})
        if cfg.cluster:
            name = _source.rowwise_name("cross_entropy_rows", info.ctype, mode, cfg.k, gtype)
        main = Launched.of(ROWS, "rowwise.cu", name, cfg, words, cfg.cooperative)
        if cfg.cooperative:
            groups = cfg.grid[0] // cfg.k
            counters = groups
            scratch.add("exchange", groups * 2 * cfg.k * _FIELDS)
    else:
        if gtype is not None:
            raise ValueError("grad_into needs logits whose classes are contiguous")
        name = _source.rowwise_name("cross_entropy_cols", info.ctype)
        shared = _launch.ROW_SCRATCH * acc.itemsize
        cfg = _rowwise_launch.thread_per_row_launch(rows, acc.itemsize, limits,
                                            _source.resident("rowwise.cu", name, shared))
        xn, xc, xd = geo.x
        tn, tc, td = geo.t
        gn, gc, gd = g_strides
        words = COLS.template({**common, "inner": geo.inner, "xn": xn, "xc": xc, "xd": xd,
                               "tn": tn, "tc": tc, "td": td, "gon": go_rs[0], "god": go_rs[1],
                               "gn": gn, "gc": gc, "gd": gd})
        main = Launched.of(COLS, "rowwise.cu", name, cfg, words)
    nblocks = main.grid[0]
    if want_value and nblocks > 1:
        scratch.add("partials", 2 * nblocks)
    wsum = None
    device_items = items is not None and items != "host"
    if (mean_w and want_g) or device_items:
        wsum = _engine.small_reduction(
            WSUM, "rowwise.cu", _source.rowwise_name("class_weight_sum", info.ctype),
            1 if device_items else rows,
            WSUM.template({"rows": 0 if device_items else rows, "cols": cols, "inner": geo.inner,
                           "tn": geo.t[0], "td": geo.t[2],
                           "flags": FLAG_ITEMS32 if items == numpy.dtype(numpy.int32)
                           else flags & FLAG_INDEX64,
                           "ignore_index": _args.i64_word(ignore_index)}),
            limits, scratch, "wsum_partials")
    ticket = (want_value and nblocks > 1) or (wsum is not None and wsum.grid[0] > 1)
    # Operands: (x, target, weight, grad_into); results: (value or loss, gx, gt, lse).
    slot = main.slot
    value_dtype = acc if acc_io else dtype
    out = None
    if want_value:
        out = ((slot["value"], (), value_dtype, "empty") if reduction != "none"
               else (slot["loss"], geo.batch_shape, value_dtype, "empty"))
    gx = None
    if want_gx:
        gx = (slot["gx"], None, None, 3 if into is not None else 0 if inplace else None)
        if gx[3] is None:
            gx = (slot["gx"], tuple(x_shape), dtype, "empty")
    outputs = (out, gx, (slot["gt"], tuple(t_shape), dtype, "empty") if want_gt else None,
               (slot["lse"], geo.batch_shape, acc, "empty") if want_lse else None)
    before = ()
    if wsum is not None:
        wired = ((wsum.slot["items"], 4),) if device_items else (
            (wsum.slot["tgt"], 1), (wsum.slot["weight"], 2))
        before = (_engine.before_main(wsum, wired, scratch, "denom", "wsum_partials"),)
    numbers = ((slot["divisor"], 5), (slot["grad_scale"], 6)) if items == "host" else ()
    return Plan(
        main, ((slot["x"], 0), (slot["tgt"], 1), (slot["weight"], 2)), outputs, acc, scratch,
        scratch.size, ticket,
        main_regions=tuple((slot[r], r) for r in ("exchange", "denom") if r in scratch),
        counters=((slot["sync"], counters),) if counters else (), before=before,
        numbers=numbers)


def evaluate(spec: RowSpec, input, target, weight=None, *, reduction="mean", ignore_index=-100,
             label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0, check=False,
             want_value=True, wrt=(), grad_output=1.0, inplace=False, want_lse=False,
             grad_into=None, acc_io=False, num_items=None):
    """[loss or None, input gradient or None, target gradient or None, lse or None] of one call.

    wrt: the names ("input", "target") whose gradients are written.  Arrays come from and go
    back to the caller's framework (see _dispatch).  grad_into (the fused linear loss's): a
    CuPy array of the input's 2-D shape, rows contiguous, that the input's gradient is written
    to, of the input's dtype or, for float32 logits of class indices, a 16-bit one (rounded in
    the same pass).  acc_io: the loss returned, and grad_output taken, in the accumulator type
    (float32 for 16-bit logits: torch's autocast semantics without a float32 copy).
    num_items: None, or the divisor of a 'mean' or 'sum' (an int, or a 0-d int32/int64 array
    of the input's framework and device, read there).
    """
    frame = _dispatch.frame_of(input, "input")
    if target.__class__ is not input.__class__:   # one class, one framework
        _dispatch.check_same_frame(frame, input, target, "input", "target")
    x = frame.operand(input, "input")
    t, is_index = _engine.target_operand(frame, target)
    _check_shapes(spec, x, t, is_index)
    dtype, device = x.dtype, x.device
    if t.device != device:
        _validate.check_same_device(x, t, "input", "target")
    cols = x.shape[1] if len(x.shape) > 1 else x.shape[0]
    w = None
    if weight is not None:
        if weight.__class__ is not input.__class__:
            _dispatch.check_same_frame(frame, input, weight, "input", "weight")
        w = frame.operand(weight, "weight")
        _check_weight(w, x, cols)
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    softcap = _validate.check_softcap(softcap, dtype)
    zscale = float(lse_square_scale)
    want_gx, want_gt = "input" in wrt, "target" in wrt
    if want_gt and is_index:
        raise ValueError(f"target holds class indices ({t.dtype}): it has no gradient; ask for "
                         f"wrt='input'")
    if inplace:
        if not want_gx:
            raise ValueError("inplace=True writes the input's gradient, but wrt does not name "
                             "'input'")
        if frame.name not in ("cupy", "torch", "torch-dlpack"):
            raise ValueError(f"inplace=True writes into the input's memory; {frame.name} arrays "
                             f"are immutable")
        if not _validate.distinct_elements(x.shape, x.strides):
            raise ValueError(f"inplace=True needs an input whose elements are distinct in memory, "
                             f"got strides {tuple(x.strides)} for shape {tuple(x.shape)}")
    into = into_key = None
    if grad_into is not None:
        into = _dispatch.Operand(grad_into.data.ptr, grad_into.shape,
                                 _dispatch.element_strides(grad_into.strides, grad_into.itemsize,
                                                           "grad_into"),
                                 grad_into.dtype, grad_into.data.device_id, grad_into)
        if (not want_gx or inplace or len(x.shape) != 2 or tuple(into.shape) != tuple(x.shape)
                or into.strides[1] != 1 or into.device != x.device
                or (into.dtype != dtype and (dtype != numpy.float32 or into.dtype.itemsize != 2
                                             or not is_index))):
            raise ValueError(f"grad_into must be a (rows, classes) array of the input's shape "
                             f"{tuple(x.shape)} with contiguous rows, for the input's gradient, "
                             f"got {tuple(into.shape)} {into.dtype} strides {into.strides}")
        into_key = (into.dtype, into.strides)
    go_kind, go_value, go = "host", 1.0, None
    go_strides = None
    if wrt:
        go_kind, go_value, go = _dispatch.classify_grad_output(
            frame, grad_output, _dtypes.DTYPES[dtype].acc if acc_io else dtype, device,
            spec.loss_shape(x.shape, "none"), reduction)
        if go_kind == "array":
            go_strides = _go_strides(go)
    items = items_op = count = None
    if num_items is not None:
        count = _validate.check_num_items(num_items, reduction, input.__class__)
        if count is None:
            items_op, _ = _engine.target_operand(frame, num_items)
            _validate.check_items_operand(items_op, device)
            items = items_op.dtype
        else:
            items = "host"
    stream = frame.stream(device)
    if check and is_index:
        check_targets(frame, t, cols, int(ignore_index), stream)
    options = (int(ignore_index), smoothing if spec.kind != "nll" else 0.0,
               zscale if spec.kind != "nll" else 0.0, softcap if spec.kind != "nll" else 0.0)
    key = (spec.name, reduction, is_index, options, want_value, want_gx, want_gt, want_lse,
           inplace, go_kind, go_strides, x.shape, x.strides, t.shape, t.strides, t.dtype,
           w is not None and w.strides, dtype, device, into_key, acc_io, items)   # Key's fields
    operands = (x, t, w, into) if items is None else (
        x, t, w, into, items_op, count, None if count is None else 1.0 / count if count
        else math.inf)
    return _engine.execute(FAMILY, key, device, frame, stream, (operands, go, go_value))


def _go_strides(go):
    """(n, d) strides of a reduction='none' grad_output, or None if its dims do not merge."""
    if len(go.shape) == 0:
        return (0, 0)
    d = _launch.merged_stride(go.shape[1:], go.strides[1:])
    return None if d is None else (go.strides[0] if go.shape[0] > 1 else 0, d)


def _copies(frame, stream, key, state):
    """Contiguous copies of the operands whose layout the kernels do not walk, and their key."""
    (x, t, w, into, *items), go, go_value = state
    key = Key._make(key)
    is_index = key.is_index
    x_copy = None
    if _rowwise_launch.class_geometry(x.shape, x.strides, t.shape, t.strides,
                                      not is_index) is None:
        if key.inplace or into is not None:
            raise ValueError(f"inplace=True needs an input whose dims after the class axis "
                             f"merge into one stride, got strides {tuple(x.strides)} for "
                             f"shape {tuple(x.shape)}")
        x, x_copy = _engine.contiguous_input(frame, x, "input")
        t = _engine.contiguous(frame, t, "target")
    if w is not None and w.strides != (1,) and w.shape[0] > 1:
        w = _engine.contiguous(frame, w, "weight")
    go_strides = None
    if key.go_kind == "array":
        go_strides = _go_strides(go)
        if go_strides is None:
            go = _engine.contiguous(frame, go, "grad_output")
            go_strides = _go_strides(go)
    key = key._replace(go_strides=go_strides, x_shape=x.shape, x_strides=x.strides,
                       t_shape=t.shape, t_strides=t.strides,
                       w_strides=w is not None and w.strides)
    return key, ((x, t, w, into, *items), go, go_value), x_copy


FAMILY = _engine.Family(_PLANS, _build, _copies)


def slice_grad(x, target, lse, out, c0, classes, weight, wsum, grad_output, *, ignore_index,
               label_smoothing, lse_square_scale, softcap, stream, device) -> None:
    """rowwise.cu's cross_entropy_slice_grad on CuPy arrays (the fused linear loss's second
    pass): out[r, j] = dloss_r/dz[r, c0 + j] times grad_output, from the logits x (rows, cols)
    of classes c0 .. c0 + cols - 1 of `classes`, each row's lse over all of them and its class
    index.  weight: (classes,) of x's dtype or None; wsum: its 0-d sum (label smoothing with
    class weights) or None; grad_output: a Python number, or a 0-d or (rows,) array of the
    accumulator dtype (lse's).  Rows of x and out contiguous; target and lse contiguous."""
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return
    flags = FLAG_INDEX64 if target.dtype == _engine.INDEX_DTYPES[1] else 0
    go_ptr, go_value = 0, 1.0
    if isinstance(grad_output, (int, float)):
        go_value = float(grad_output)
    else:
        flags |= FLAG_GO_ROWS if grad_output.ndim else FLAG_GO_DEVICE
        go_ptr = grad_output.data.ptr
    info = _dtypes.DTYPES[x.dtype]
    name = _source.rowwise_name("cross_entropy_slice_grad", info.ctype,
                                gtype=_dtypes.DTYPES[out.dtype].ctype)
    cfg = _rowwise_launch.slice_launch(rows, _launch.device_limits(device))
    words = SLICE.template({
        "x": x.data.ptr, "tgt": target.data.ptr, "weight": 0 if weight is None else weight.data.ptr,
        "wsum": 0 if wsum is None else wsum.data.ptr, "lse": lse.data.ptr, "go": go_ptr,
        "rows": rows, "cols": cols, "c0": c0, "classes": classes,
        "x_rs": x.strides[0] // x.itemsize, "g_rs": out.strides[0] // out.itemsize,
        "flags": flags, "ignore_index": _args.i64_word(ignore_index),
        "smoothing": _args.f64_word(label_smoothing), "zscale": _args.f64_word(lse_square_scale),
        "softcap": _args.f64_word(softcap), "go_value": _args.f64_word(go_value),
        "grad_scale": _ONE, "gx": out.data.ptr})
    _args.launch(SLICE.bind(_source.function("rowwise.cu", name).kernel.ptr), cfg.grid, cfg.block,
                 0, stream, words)


def slice_stats(x, target, out, c0, classes, weight, *, ignore_index, label_smoothing, softcap,
                stream, device) -> None:
    """rowwise.cu's cross_entropy_slice_stats on CuPy arrays (vocab-parallel cross entropy's
    per-rank pass): out[r] = the softmax state (m, s, a, b, t) of row r's classes c0 ..
    c0 + cols - 1 of `classes`, from the logits x (rows, cols) of those classes, and its claim
    on the row's class.  weight: (classes,) of x's dtype or None; out: (rows, SLICE_FIELDS) of
    the accumulator dtype.  Rows of x contiguous; target and out contiguous."""
    rows, cols = x.shape
    if rows == 0:
        return
    flags = FLAG_INDEX64 if target.dtype == _engine.INDEX_DTYPES[1] else 0
    name = _source.rowwise_name("cross_entropy_slice_stats", _dtypes.DTYPES[x.dtype].ctype)
    cfg = _rowwise_launch.slice_launch(rows, _launch.device_limits(device))
    words = STATS.template({
        "x": x.data.ptr, "tgt": target.data.ptr, "weight": 0 if weight is None else weight.data.ptr,
        "rows": rows, "cols": cols, "c0": c0, "classes": classes,
        "x_rs": x.strides[0] // x.itemsize, "flags": flags,
        "ignore_index": _args.i64_word(ignore_index),
        "smoothing": _args.f64_word(label_smoothing), "softcap": _args.f64_word(softcap),
        "stats": out.data.ptr})
    _args.launch(STATS.bind(_source.function("rowwise.cu", name).kernel.ptr), cfg.grid, cfg.block,
                 0, stream, words)


def combine(stats, target, weight, loss, lse, wy, classes, *, ignore_index, label_smoothing,
            lse_square_scale, ctype, stream, device) -> None:
    """rowwise.cu's cross_entropy_combine on CuPy arrays: loss, lse, wy (rows,) of every row
    from stats (k, rows, SLICE_FIELDS), the states (and claims) of its k slices in order.
    weight: (classes,) of the logits' dtype (C type `ctype`) or None.  All contiguous."""
    k, rows = stats.shape[:2]
    if rows == 0:
        return
    flags = FLAG_INDEX64 if target.dtype == _engine.INDEX_DTYPES[1] else 0
    name = _source.rowwise_name("cross_entropy_combine", ctype)
    cfg = _rowwise_launch.row_thread_launch(rows, _launch.device_limits(device))
    words = COMBINE.template({
        "stats": stats.data.ptr, "tgt": target.data.ptr,
        "weight": 0 if weight is None else weight.data.ptr, "k": k, "rows": rows,
        "classes": classes, "flags": flags, "ignore_index": _args.i64_word(ignore_index),
        "smoothing": _args.f64_word(label_smoothing), "zscale": _args.f64_word(lse_square_scale),
        "loss": loss.data.ptr, "lse": lse.data.ptr, "wy": wy.data.ptr})
    _args.launch(COMBINE.bind(_source.function("rowwise.cu", name).kernel.ptr), cfg.grid, cfg.block,
                 0, stream, words)
