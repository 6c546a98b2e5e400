"""The engine behind the row-wise losses along the last axis (multi_margin_loss,
multilabel_soft_margin_loss, jsd, multilabel_margin_loss): plan once per layout, launch.

`evaluate` is the one entry point.  A row is the input's last axis (kernels/rowclass.cu): the
input is viewed as [rows, C] with the leading dims merged into one row stride and the classes at
stride 1; an operand whose layout does not merge that way is copied first (C-contiguous, by CuPy
on the caller's stream with the caller's allocator).  Everything that depends only on metadata is
a cached Plan with packed parameter words; a call allocates its outputs and launches once, or
twice for a 'mean' jsd gradient with shift labels, whose divisor (the counted rows) a small launch
computes first on the device.  Nothing is read back to the host unless `check_targets` asks.
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
from cupyloss.rowclass import _launch as _rowclass_launch
from cupyloss._core.engine import Launched, Plan

# The loss ids of rowclass_rows<T, LOSS> and the flag bits: the enums of kernels/rowclass.cu.
LOSS_MULTI_MARGIN, LOSS_MULTILABEL, LOSS_JSD, LOSS_MULTILABEL_MARGIN = _source.constants(
    "rowclass.cu", "LOSS_MULTI_MARGIN", "LOSS_MULTILABEL", "LOSS_JSD", "LOSS_MULTILABEL_MARGIN")
(FLAG_INDEX64, FLAG_LABELS, FLAG_LABELS64, FLAG_GO_DEVICE, FLAG_GO_ROWS, FLAG_COUNT,
 FLAG_ZERO_EMPTY, FLAG_P2) = _source.constants(
    "rowclass.cu", "RC_INDEX64", "RC_LABELS", "RC_LABELS64", "RC_GO_DEVICE", "RC_GO_ROWS",
    "RC_COUNT", "RC_ZERO_EMPTY", "RC_P2")
_INT64 = numpy.dtype(numpy.int64)


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    """A registered streaming row-wise loss.

    loss: its kernel (LOSS_*); arrays: the array arguments in torch's order (a gradient may be
    asked for the floating ones); options: the keyword options of the public function, in its
    order; module_name: the nn.Module name the torch adapter gives it when torch has none.  The
    rest is what the family does differently for it, in place of branches on the loss.
    """

    name: str
    loss: int
    check: object                 # check(spec, x, t, is_index, p, w): torch's checks
    arrays: tuple = ("input", "target")
    reductions: tuple = ("none", "mean", "sum")
    options: tuple = ()
    module_name: str | None = None
    option: str | None = None     # the keyword the kernel's option word holds: "margin", "beta"
    index_rows: bool = False      # target: rows of class indices shaped like the input
    shaped_weight: bool = False   # weight broadcast to the input's shape, not one per class
    target_loss_shape: bool = False   # reduction='none' gives the target's shape
    zero_empty: bool = False      # 'mean' over no rows is 0 (torch's), not NaN
    grad_in_place: bool = False   # inplace=True writes the input's gradient into the input
    index_low: int = 0            # check_targets: indices below this are out of range
    range_message: str = "target out of range"   # check_targets: torch's IndexError text

    def loss_shape(self, input_shape: tuple, reduction: str) -> tuple:
        """The loss's shape: () when reduced, else the input's without its last (class) axis
        (multi_margin_loss's 'none' takes its target's shape, which is this one unless a (C,)
        input comes with a (1,) target or a (1, C) input with a 0-d one)."""
        if reduction != "none":
            return ()
        return tuple(input_shape[:-1])



# The kernels' parameter lists, one word each, named as kernels/rowclass.cu names them.
ROWS = _args.Layout(_source.kernel_words("rowclass.cu", "rowclass_rows"))
COUNT = _args.Layout(_source.kernel_words("rowclass.cu", "rowclass_count"))
_ONE = _args.f64_word(1.0)


class Key(NamedTuple):
    """What a rowclass plan depends on: the plan cache's key, passed whole to _build."""

    name: str                # the loss (SPECS)
    reduction: str
    option: float            # multi_margin's margin, jsd's beta
    p2: bool                 # multi_margin's p == 2
    ignore_index: int
    want_value: bool
    want_gx: bool
    want_gt: bool
    go_kind: str             # grad_output: "host", "device" (0-d) or "array" (per row)
    go_rs: int | None        # a per-row grad_output's element stride
    x_shape: tuple
    x_rs: int | None         # the input's row stride (None: it needs a copy)
    t_rs: int | None         # the target's row (or index) stride
    t_dtype: object
    w_strides: object        # the weight's (row, class) strides; False without one, None
                             # when it needs a copy
    l_rs: int | None         # jsd's shift labels' stride, None without them
    l_dtype: object
    loss_shape: tuple        # of a reduction='none' loss
    dtype: object
    device: int
    inplace: bool            # jsd's input gradient written into the input


_PLANS = _plans.Plans()


# --- layout -------------------------------------------------------------------------------------

def _row_strides(shape: tuple, strides: tuple):
    """(row stride, class stride ok) of an array viewed as [rows, shape[-1]]: None when its
    leading dims do not merge into one stride or its classes are not at stride 1 (an empty
    array is walked by nothing: 0, whatever strides its producer gave it)."""
    if len(shape) == 0 or 0 in shape:
        return 0
    if shape[-1] > 1 and strides[-1] != 1:
        return None
    return _launch.merged_stride(shape[:-1], strides[:-1])


def _index_stride(shape: tuple, strides: tuple):
    """The element stride of an index array (any shape) walked as one row index, or None (0
    for an empty one)."""
    return 0 if 0 in shape else _launch.merged_stride(shape, strides)


def _target_stride(spec, t, is_index):
    """The target's row stride (a class index a row: its element stride), or None."""
    if is_index and not spec.index_rows:
        return _index_stride(t.shape, t.strides)
    return _row_strides(t.shape, t.strides)


# --- checks -------------------------------------------------------------------------------------

def _check_scores_and_indices(name, x, t, is_index):
    """torch's check of the margin losses' input (a non-empty vector or matrix, or 0-d), and
    class indices as target."""
    nd = len(x.shape)
    if not ((nd == 2 and x.shape[1] != 0) or (nd == 1 and x.shape[0] != 0) or nd == 0):
        raise ValueError(f"Expected non-empty vector or matrix with optional 0-dim batch size, "
                         f"but got: {list(x.shape)}")
    if not is_index:
        raise TypeError(f"{name} needs class indices (int32 or int64) as target, got dtype "
                        f"{t.dtype}")


def _check_multi_margin(spec, x, t, is_index, p, w):
    _check_scores_and_indices("multi_margin_loss", x, t, is_index)
    nd = len(x.shape)
    nframe = 1 if nd <= 1 else x.shape[0]
    if len(t.shape) > 1 or math.prod(t.shape) != nframe:
        raise ValueError(f"multi_margin_loss: target tensor should be 1-D with size equal to the "
                         f"number of input samples (batch size). Expected target size "
                         f"[{nframe}], but got {list(t.shape)}. Input has shape "
                         f"{list(x.shape)}.")
    if p not in (1, 2) or isinstance(p, bool):
        raise ValueError("only p == 1 and p == 2 supported")
    if w is not None:
        if len(w.shape) != 1:
            raise ValueError("weight must be one-dimensional")
        cols = x.shape[-1] if nd else 1
        if w.shape[0] != cols:
            raise ValueError(f"inconsistent weight size, expected {cols} but got "
                             f"{list(w.shape)}")


def _check_multilabel_margin(spec, x, t, is_index, p, w):
    _check_scores_and_indices("multilabel_margin_loss", x, t, is_index)
    nd = len(x.shape)
    same = tuple(t.shape) == tuple(x.shape) if nd == 2 else \
        (len(t.shape) <= 1 and math.prod(t.shape) == math.prod(x.shape))
    if not same:
        raise ValueError(f"inconsistent target size: {list(t.shape)} for input of size: "
                         f"{list(x.shape)}")


def _check_paired(spec, x, t, is_index, p, w):
    if len(x.shape) == 0:
        raise ValueError(f"{spec.name} needs an input with a class axis (its last dim), got a "
                         f"0-d input")
    if is_index:
        raise TypeError(f"{spec.name} needs a floating target shaped like the input, got class "
                        f"indices of dtype {t.dtype}")
    _validate.check_like_input(x, t, f"{spec.name} needs a target of the input's shape "
                                     f"{tuple(x.shape)}, got {tuple(t.shape)}")


SPECS = {
    "multi_margin_loss": ClassSpec(
        "multi_margin_loss", LOSS_MULTI_MARGIN, _check_multi_margin,
        options=("p", "margin", "weight", "check_targets"), option="margin",
        target_loss_shape=True),
    "multilabel_soft_margin_loss": ClassSpec(
        "multilabel_soft_margin_loss", LOSS_MULTILABEL, _check_paired, options=("weight",),
        shaped_weight=True),
    "jsd": ClassSpec("jsd", LOSS_JSD, _check_paired,
                     options=("beta", "shift_labels", "ignore_index"), module_name="JSDLoss",
                     option="beta", zero_empty=True, grad_in_place=True),
    "multilabel_margin_loss": ClassSpec(
        "multilabel_margin_loss", LOSS_MULTILABEL_MARGIN, _check_multilabel_margin,
        options=("check_targets",), index_rows=True, zero_empty=True, index_low=-1,
        range_message="argument #2 'target' is out of range"),
}


def check_targets(frame, t, cols, stream, low=0, message="target out of range"):
    """Raise IndexError with torch's message if a class index lies outside [low, cols).  Reads a
    flag back to the host (a synchronisation): opt-in."""
    import cupy

    with cupy.cuda.Device(t.device), cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)):
        v = frame.cupy_view(t)
        if bool(((v < low) | (v >= cols)).any()):
            raise IndexError(message)


# --- plans --------------------------------------------------------------------------------------

def _build(key: Key) -> Plan:
    (name, reduction, option, p2, ignore_index, want_value, want_gx, want_gt, go_kind, go_rs,
     x_shape, x_rs, t_rs, t_dtype, w_strides, l_rs, l_dtype, loss_shape, dtype, device,
     inplace) = Key._make(key)
    spec = SPECS[name]
    if (x_rs is None or t_rs is None or go_rs is None or (l_dtype is not None and l_rs is None)
            or w_strides is None
            or (w_strides and not spec.shaped_weight and w_strides[1] not in (0, 1))):
        return None     # an operand needs a copy first (_copies)
    info = _dtypes.DTYPES[dtype]
    acc = info.acc
    limits = _launch.device_limits(device)
    cols = x_shape[-1] if x_shape else 1
    rows = math.prod(x_shape[:-1]) if x_shape else 1
    want_g = want_gx or want_gt
    labels = l_rs is not None
    count_rows = labels and reduction == "mean"   # jsd's shift labels: the rows counted
    divisor = float(rows) if reduction == "mean" else 1.0
    grad_scale = 1.0
    if reduction == "mean" and not count_rows:
        grad_scale = 1.0 / divisor if divisor else math.nan
    flags = 0
    if t_dtype == _INT64:   # class indices
        flags |= FLAG_INDEX64
    if labels:
        flags |= FLAG_LABELS | (FLAG_LABELS64 if l_dtype == _INT64 else 0)
    if go_kind == "device":
        flags |= FLAG_GO_DEVICE
    elif go_kind == "array":
        flags |= FLAG_GO_ROWS
    if count_rows and want_value:
        flags |= FLAG_COUNT
    if spec.zero_empty:
        flags |= FLAG_ZERO_EMPTY
    if p2:
        flags |= FLAG_P2
    name = _source.rowclass_name("rowclass_rows", info.ctype, spec.loss)
    if spec.index_rows:   # the row's target set in shared memory
        shared = _rowclass_launch.set_row_shared(cols, acc.itemsize, limits)
        cfg = _rowclass_launch.set_row_launch(rows, cols, shared, limits,
                                              _source.resident("rowclass.cu", name, shared))
    else:
        shared = _launch.ROW_SCRATCH * acc.itemsize
        cfg = _rowclass_launch.stream_row_launch(rows, cols, dtype.itemsize, acc.itemsize,
                                                 limits,
                                                 _source.resident("rowclass.cu", name, shared))
    w_rs, w_cs = w_strides or (0, 0)
    words = ROWS.template({
        "rows": rows, "cols": cols, "x_rs": x_rs, "t_rs": t_rs, "w_rs": w_rs, "w_cs": w_cs,
        "l_rs": l_rs or 0, "go_rs": go_rs or 0, "flags": flags,
        "ignore_index": _args.i64_word(ignore_index), "option": _args.f64_word(option),
        "go_value": _ONE, "grad_scale": _args.f64_word(grad_scale), "tpr": cfg.tpr,
        "divisor": _args.f64_word(divisor)})
    main = Launched.of(ROWS, "rowclass.cu", name, cfg, words)
    scratch = _engine.Regions()

    if want_value and reduction != "none" and main.grid[0] > 1:
        scratch.add("partials", 2 * main.grid[0])
    count = None
    if count_rows and want_g:
        count = _engine.small_reduction(
            COUNT, "rowclass.cu", _source.rowclass_name("rowclass_count", info.ctype), rows,
            COUNT.template({"rows": rows, "l_rs": l_rs, "flags": flags & FLAG_LABELS64,
                            "ignore_index": _args.i64_word(ignore_index)}),
            limits, scratch, "count_partials")
    ticket = "partials" in scratch or "count_partials" in scratch
    # Operands: (x, target, weight, shift labels); results: (value or loss, gx, gt).
    slot = main.slot
    out = None
    if want_value:
        out = ((slot["value"], (), dtype, "empty") if reduction != "none"
               else (slot["loss"], tuple(loss_shape), dtype, "empty"))
    gx = None
    if want_gx:
        gx = (slot["gx"], None, None, 0) if inplace else (slot["gx"], tuple(x_shape), dtype,
                                                            "empty")
    outputs = (out, gx, (slot["gt"], tuple(x_shape), dtype, "empty") if want_gt else None)
    before = ()
    if count is not None:
        before = (_engine.before_main(count, ((count.slot["labels"], 3),), scratch, "denom",
                                      "count_partials"),)
    return Plan(main, ((slot["x"], 0), (slot["tgt"], 1), (slot["weight"], 2),
                       (slot["labels"], 3)), outputs, acc, scratch, scratch.size, ticket,
                main_regions=((slot["denom"], "denom"),) if "denom" in scratch else (),
                before=before)


def evaluate(spec: ClassSpec, input, target, weight=None, shift_labels=None, *,
             reduction="mean", p=1, margin=1.0, beta=0.5, ignore_index=-100, check=False,
             want_value=True, wrt=(), grad_output=1.0, inplace=False):
    """[loss or None, input gradient or None, target gradient or None] of one call.

    wrt: the names ("input", "target") whose gradients are written.  Arrays come from and go
    back to the caller's framework (see _dispatch).  inplace (jsd): the input's gradient is
    written into the input, which must be C-contiguous, and returned as the input itself.
    """
    frame = _dispatch.frame_of(input, "input")
    if target.__class__ is not input.__class__:   # one class, one framework
        _dispatch.check_same_frame(frame, input, target, "input", "target")
    x = frame.operand(input, "input")
    t, is_index = _engine.target_operand(frame, target)
    dtype, device = x.dtype, x.device
    w = None
    if weight is not None:
        if weight.__class__ is not input.__class__:
            _dispatch.check_same_frame(frame, input, weight, "input", "weight")
        w = frame.operand(weight, "weight")
    spec.check(spec, x, t, is_index, p, w)
    if t.device != device:
        _validate.check_same_device(x, t, "input", "target")
    if w is not None:
        if w.dtype != dtype:
            _validate.check_same_dtype(x, w, "input", "weight")
        if w.device != device:
            _validate.check_same_device(x, w, "input", "weight")
        if spec.shaped_weight:
            shape = _validate.broadcast_shape(x.shape, w.shape, "input", "weight")
            if tuple(shape) != tuple(x.shape):
                raise ValueError(f"weight shape {tuple(w.shape)} must broadcast to the input's "
                                 f"shape {tuple(x.shape)}")
    labels = None
    if shift_labels is not None:
        if "shift_labels" not in spec.options:
            raise ValueError(f"{spec.name} takes no shift_labels")
        _dispatch.check_same_frame(frame, input, shift_labels, "input", "shift_labels")
        labels, label_index = _engine.target_operand(frame, shift_labels)
        if not label_index:
            raise TypeError(f"shift_labels must hold class indices (int32 or int64), got dtype "
                            f"{labels.dtype}")
        if tuple(labels.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"the shape of shift_labels must be {tuple(x.shape[:-1])} (the "
                             f"input's without its last dim), got {tuple(labels.shape)}")
        if labels.device != device:
            _validate.check_same_device(x, labels, "input", "shift_labels")
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    option, p2 = 0.0, spec.option == "margin" and p == 2
    if spec.option == "margin":
        option = float(margin)
    elif spec.option == "beta":
        option = float(beta)
        if not 0.0 <= option <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
    ignore_index = int(ignore_index)
    want_gx, want_gt = "input" in wrt, "target" in wrt
    if inplace:
        contiguous = x.shape[-1:] == () or all(
            st == math.prod(x.shape[i + 1:]) for i, st in enumerate(x.strides) if x.shape[i] > 1)
        if not spec.grad_in_place or not want_gx or not contiguous or frame.name == "jax":
            raise ValueError(f"inplace writes jsd's input gradient into a C-contiguous input "
                             f"(CuPy or torch), got {spec.name} with wrt={tuple(wrt)} and "
                             f"strides {tuple(x.strides)} for shape {tuple(x.shape)}")
    if want_gt and is_index:
        raise ValueError(f"target holds class indices ({t.dtype}): it has no gradient; ask for "
                         f"wrt='input'")
    loss_shape = tuple(t.shape) if spec.target_loss_shape else tuple(x.shape[:-1])
    go_kind, go_value, go = "host", 1.0, None
    if wrt:
        go_kind, go_value, go = _dispatch.classify_grad_output(frame, grad_output, dtype, device,
                                                               loss_shape, reduction)
    stream = frame.stream(device)
    if check and is_index:
        check_targets(frame, t, x.shape[-1] if x.shape else 1, stream, spec.index_low,
                      spec.range_message)
    x_rs = _row_strides(x.shape, x.strides)
    t_rs = _target_stride(spec, t, is_index)
    w_strides = False
    if w is not None:
        if spec.shaped_weight:
            b = _launch.broadcast_strides(w.shape, w.strides, x.shape)
            w_rs = _launch.merged_stride(x.shape[:-1], b[:-1])
            w_strides = None if w_rs is None else (w_rs, b[-1])
        else:
            w_strides = (0, w.strides[0] if w.shape[0] > 1 else 0)
    l_rs = None if labels is None else _index_stride(labels.shape, labels.strides)
    go_rs = _index_stride(go.shape, go.strides) if go_kind == "array" else 0
    key = (spec.name, reduction, option, p2, ignore_index, want_value, want_gx, want_gt, go_kind,
           go_rs, x.shape, x_rs, t_rs, t.dtype, w_strides, l_rs,
           None if labels is None else labels.dtype, loss_shape, dtype, device,
           inplace)   # Key's fields
    return _engine.execute(FAMILY, key, device, frame, stream,
                           ((x, t, w, labels), go, go_value, is_index))


def _copies(frame, stream, key, state):
    """Contiguous copies of the operands whose layout does not merge into rows (a weight
    broadcast the same way materialised), and their key."""
    import cupy

    (x, t, w, labels), go, go_value, is_index = state
    key = Key._make(key)
    spec = SPECS[key.name]
    keep = []
    if _row_strides(x.shape, x.strides) is None:
        x, copy = _engine.contiguous_input(frame, x, "input")
        keep.append(copy)
    if _target_stride(spec, t, is_index) is None:
        t = _engine.contiguous(frame, t, "target")
    if labels is not None and _index_stride(labels.shape, labels.strides) is None:
        labels = _engine.contiguous(frame, labels, "shift_labels")
    if go is not None and go.shape != () and _index_stride(go.shape, go.strides) is None:
        go = _engine.contiguous(frame, go, "grad_output")
    w_strides = False
    if w is not None:
        if spec.shaped_weight:
            b = _launch.broadcast_strides(w.shape, w.strides, x.shape)
            w_rs = _launch.merged_stride(x.shape[:-1], b[:-1])
            if w_rs is None:
                full = cupy.ascontiguousarray(cupy.broadcast_to(frame.cupy_view(w), x.shape))
                w = _dispatch.Operand(full.data.ptr, full.shape,
                                      tuple(s // full.itemsize for s in full.strides),
                                      full.dtype, x.device, full)
                b = w.strides
                w_rs = _launch.merged_stride(x.shape[:-1], b[:-1])
            w_strides = (w_rs, b[-1])
        else:
            if w.shape[0] > 1 and w.strides[0] != 1:
                w = _engine.contiguous(frame, w, "weight")
            w_strides = (0, 1 if w.shape[0] > 1 else 0)
    key = key._replace(
        x_rs=_row_strides(x.shape, x.strides), t_rs=_target_stride(spec, t, is_index),
        l_rs=None if labels is None else _index_stride(labels.shape, labels.strides),
        go_rs=_index_stride(go.shape, go.strides) if key.go_kind == "array" else 0,
        w_strides=w_strides)
    return key, ((x, t, w, labels), go, go_value, is_index), keep


FAMILY = _engine.Family(_PLANS, _build, _copies)
