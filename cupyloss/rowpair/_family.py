"""The engine behind the row-pair losses (triplet_margin_loss, cosine_embedding_loss).

Two or three arrays of one shape, each row (the last axis) reduced to a few sums, then the row's
loss and every array's gradient (kernels/rowpair.cu).  `evaluate` is the one entry point.  Arrays
come in through `_dispatch` as Operands; a per-row target (cosine_embedding_loss's) is read as
int32/int64 or as the inputs' dtype (`_engine.target_operand`).  Rows are the leading dims
merged into one stride per array; an array whose leading dims do not merge is copied contiguous
first (off the hot path).  Everything that depends only on metadata is a cached Plan with packed
parameter words; a call allocates its outputs and launches once.  Nothing is read back to the
host.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from cupyloss._core import (
    args as _args, dispatch as _dispatch, dtypes as _dtypes, engine as _engine,
    launch as _launch, plans as _plans, reduction as _reduction, source as _source,
    validate as _validate)
from cupyloss._core.engine import Launched, Plan
from cupyloss.rowpair import _launch as _rowpair_launch

# Flag bits: the enum of kernels/rowpair.cu.
FLAG_GO_DEVICE, FLAG_GO_ROWS, FLAG_SWAP, FLAG_T_INT32, FLAG_T_INT64 = _source.constants(
    "rowpair.cu", "PAIR_GO_DEVICE", "PAIR_GO_ROWS", "PAIR_SWAP", "PAIR_T_INT32", "PAIR_T_INT64")


def _torch_size_error(a_shape, b_shape):
    """torch's broadcasting error for two shapes of one rank that differ, or None if equal."""
    for d, (m, n) in enumerate(zip(a_shape, b_shape)):
        if m != n:
            hint = ("" if m != 1 and n != 1 else
                    "; cupyloss does not broadcast these arguments: expand them to one shape")
            return ValueError(f"The size of tensor a ({m}) must match the size of tensor b ({n}) "
                              f"at non-singleton dimension {d}{hint}")
    return None


def _check_triplet(shapes, target_shape):
    """torch's checks of triplet_margin_loss's shapes: one rank, then one shape (no broadcast)."""
    a, p, n = shapes
    if not len(a) == len(p) == len(n):
        raise ValueError(f"The anchor, positive, and negative tensors are expected to have the "
                         f"same number of dimensions, but got: anchor {len(a)}D, positive "
                         f"{len(p)}D, and negative {len(n)}D inputs")
    if len(a) == 0:
        raise ValueError("triplet_margin_loss needs inputs of shape (D,) or (N, D), got 0-d "
                         "inputs")
    for other in (p, n):
        error = _torch_size_error(a, other)
        if error is not None:
            raise error


def _check_cosine(shapes, target_shape):
    """torch's checks of cosine_embedding_loss's shapes."""
    x1, x2 = shapes
    if len(target_shape) not in (0, 1):
        raise ValueError("0D or 1D target tensor expected, multi-target not supported")
    if len(target_shape) == 1 and not (len(x1) == 2 and len(x2) == 2):
        raise ValueError(f"1D target tensor expects 2D input tensors, but found inputs with "
                         f"sizes {list(x1)} and {list(x2)}.")
    if len(target_shape) == 0 and not (len(x1) == 1 and len(x2) == 1):
        raise ValueError(f"0D target tensor expects 1D input tensors, but found inputs with "
                         f"sizes {list(x1)} and {list(x2)}.")
    error = _torch_size_error(x1, x2)
    if error is not None:
        raise error
    error = _torch_size_error(tuple(target_shape), tuple(x1[:-1]))
    if error is not None:
        raise error


def _triplet_options(margin, p, eps, swap):
    """(margin, p, eps, swap) as the kernel takes them, or ValueError/TypeError."""
    if margin <= 0:
        raise ValueError(f"margin must be greater than 0, got {margin}")
    p = float(p)
    if not (p > 0 and math.isfinite(p)):
        raise ValueError(f"triplet_margin_loss takes a finite norm degree p > 0, got {p}")
    if not isinstance(swap, (bool, int)):
        raise TypeError(f"swap must be a bool, got {type(swap).__name__}")
    return float(margin), p, float(eps), bool(swap)


def _cosine_options(margin):
    return float(margin), 2.0, 0.0, False


@dataclasses.dataclass(frozen=True)
class PairSpec:
    """A registered row-pair loss.

    op: its functor in kernels/rowpair.cu (p2_op: its instance for p = 2 without swap, where
    those are constants); arrays: the array arguments in torch's order;
    differentiable: those that take a gradient (the others, a per-row target, have none);
    target: the name of the per-row target array, if any; options: the keyword options of the
    public function, in its order.
    """

    name: str
    op: str
    arrays: tuple
    differentiable: tuple
    options: tuple
    check: object            # (input shapes, target shape) -> None, or raises torch's error
    parse: object            # options -> (margin, p, eps, swap)
    target: str | None = None
    reductions: tuple = ("none", "mean", "sum")
    p2_op: str | None = None  # the functor's instance for p = 2 without swap, if it has one

    def loss_shape(self, input_shape: tuple, reduction: str) -> tuple:
        """The loss's shape: () when reduced, else the input's without its last dim."""
        if reduction != "none":
            return ()
        return tuple(input_shape[:-1])


SPECS = {
    "triplet_margin_loss": PairSpec(
        "triplet_margin_loss", "TripletOp", ("anchor", "positive", "negative"),
        ("anchor", "positive", "negative"), ("margin", "p", "eps", "swap"), _check_triplet,
        _triplet_options, p2_op="TripletP2Op"),
    "cosine_embedding_loss": PairSpec(
        "cosine_embedding_loss", "CosineOp", ("input1", "input2", "target"),
        ("input1", "input2"), ("margin",), _check_cosine, _cosine_options, target="target"),
}

# The kernels' parameter lists, one word each, named as kernels/rowpair.cu names them.
LAYOUT = _args.Layout(_source.kernel_words("rowpair.cu", "rowpair_rows"))
FINISH_LAYOUT = _args.Layout(_source.kernel_words("rowpair.cu", "rowpair_finish"))
_ONE = _args.f64_word(1.0)

_PLANS = _plans.Plans()


class Key(NamedTuple):
    """What a row-pair plan depends on: the plan cache's key, passed whole to _build."""

    name: str                # the loss (SPECS)
    reduction: str
    options: tuple           # spec.parse's (margin, p, eps, swap)
    want_value: bool
    grads: tuple             # per input: its gradient is written
    go_kind: str             # grad_output: "host", "device" (0-d) or "array" (per row)
    go_rs: int | None        # a per-row grad_output's element stride (None: it needs a copy)
    x_shape: tuple
    geos: tuple              # per input: (row stride, element stride), None: it needs a copy
    t_rs: int                # the target's element stride
    t_dtype: object          # the target's dtype, None without one
    dtype: object
    device: int


def _row_geometry(shape, strides):
    """(rows stride, element stride) of an array viewed as [rows, cols], or None when its leading
    dims do not merge into one stride."""
    if len(shape) == 1:
        return 0, strides[0]
    rs = _launch.merged_stride(shape[:-1], strides[:-1])
    return None if rs is None else (rs, strides[-1])


def _build(key: Key) -> Plan:
    key = Key._make(key)
    spec, reduction, want_value, grads, x_shape, geos = (
        SPECS[key.name], key.reduction, key.want_value, key.grads, key.x_shape, key.geos)
    dtype, go_kind, t_dtype = key.dtype, key.go_kind, key.t_dtype
    margin, p, eps, swap = key.options
    if None in geos or key.go_rs is None:
        return None     # an operand needs a copy first (_copies)
    info = _dtypes.DTYPES[dtype]
    acc = info.acc
    limits = _launch.device_limits(key.device)
    cols = x_shape[-1]
    loss_shape = tuple(x_shape[:-1])
    rows = math.prod(loss_shape)
    grad = any(grads)
    op = spec.p2_op if spec.p2_op and p == 2.0 and not swap else spec.op
    cfg = _rowpair_launch.pair_launch(
        rows, cols, dtype.itemsize, len(geos), grad, limits,
        lambda shared: _source.resident("rowpair.cu", _source.rowpair_name(
            info.ctype, op, grad), shared, _rowpair_launch.PAIR_BLOCK))
    name = _source.rowpair_name(info.ctype, op, grad, cfg.wide)
    divisor = float(rows) if reduction == "mean" else 1.0
    grad_scale = (1.0 / divisor if divisor else math.nan) if reduction == "mean" else 1.0
    flags = FLAG_SWAP if swap else 0
    if go_kind == "device":
        flags |= FLAG_GO_DEVICE
    elif go_kind == "array":
        flags |= FLAG_GO_ROWS
    if t_dtype == _engine.INDEX_DTYPES[0]:
        flags |= FLAG_T_INT32
    elif t_dtype == _engine.INDEX_DTYPES[1]:
        flags |= FLAG_T_INT64
    values = {"rows": rows, "cols": cols, "t_rs": _args.i64_word(key.t_rs),
              "go_rs": _args.i64_word(key.go_rs), "flags": flags, "tpr": cfg.tpr, "hv": cfg.hv,
              "p": _args.f64_word(p), "eps": _args.f64_word(eps),
              "margin": _args.f64_word(margin), "go_value": _ONE,
              "grad_scale": _args.f64_word(grad_scale), "divisor": _args.f64_word(divisor)}
    for k, (rs, cs) in enumerate(geos):
        values[f"rs{k}"] = _args.i64_word(rs)
        values[f"cs{k}"] = _args.i64_word(cs)
    words = LAYOUT.template(values)
    function = LAYOUT.bind(_source.function("rowpair.cu", name).kernel.ptr)  # shared above
    value = want_value and reduction != "none"
    main = Launched(function, cfg.grid, cfg.block, cfg.shared, words, LAYOUT.slot)
    slot = LAYOUT.slot
    n = len(geos)
    # Operands: (the inputs, the target); results: (value or loss, a gradient per input).
    out = None
    if want_value:
        out = ((slot["value"], (), dtype, "empty") if value
               else (slot["loss"], loss_shape, dtype, "empty"))
    outputs = (out, *((slot["g0"] + k, tuple(x_shape), dtype, "empty") if grads[k] else None
                      for k in range(n)))
    scratch, after = _engine.Regions(), ()
    partials = (rows if cfg.wide else cfg.grid[0] if cfg.grid[0] > 1 else 0) if value else 0
    if partials:
        scratch.add("partials", partials)
    if value and cfg.wide:
        # The wide launch writes the rows' losses; rowpair_finish adds them into the 0-d loss.
        finish = Launched(FINISH_LAYOUT.bind(_source.function(
            "rowpair.cu", _source.rowpair_finish_name(info.ctype)).kernel.ptr), (1,),
            (_rowpair_launch.PAIR_FINISH_BLOCK,), 0,
            FINISH_LAYOUT.template({"rows": rows, "divisor": _args.f64_word(divisor)}),
            FINISH_LAYOUT.slot)
        after = ((finish, ((FINISH_LAYOUT.slot["partials"], slot["partials"]),
                           (FINISH_LAYOUT.slot["value"], slot["value"])), ()),)
    return Plan(main, (*((slot["x0"] + k, k) for k in range(n)), (slot["tgt"], n)),
                outputs, acc, scratch, scratch.size, bool(partials) and not after,
                after=after)


def evaluate(spec: PairSpec, arrays, options, *, reduction="mean", want_value=True, wrt=(),
             grad_output=1.0):
    """[loss or None, then one gradient or None per differentiable array] of one call.

    arrays: the array arguments in spec.arrays' order; options: the values of spec.options;
    wrt: the names (of spec.differentiable) whose gradients are written.  Arrays come from and go
    back to the caller's framework (see _dispatch).
    """
    names = spec.arrays
    frame = _dispatch.frame_of(arrays[0], names[0])
    for a, n in zip(arrays[1:], names[1:]):
        _dispatch.check_same_frame(frame, arrays[0], a, names[0], n)
    xs, t, is_index = [], None, False
    for a, n in zip(arrays, names):
        if n == spec.target:
            t, is_index = _engine.target_operand(frame, a)
        else:
            xs.append(frame.operand(a, n))
    inputs = [n for n in names if n != spec.target]
    dtype, device = xs[0].dtype, xs[0].device
    for x, n in zip(xs[1:], inputs[1:]):
        if x.dtype != dtype:
            _validate.check_same_dtype(xs[0], x, inputs[0], n)
        if x.device != device:
            _validate.check_same_device(xs[0], x, inputs[0], n)
    if t is not None:
        if not is_index and t.dtype != dtype:
            raise TypeError(f"{spec.target} has dtype {t.dtype}; {spec.name} takes int32, "
                            f"int64 or the inputs' dtype {dtype}")
        if t.device != device:
            _validate.check_same_device(xs[0], t, inputs[0], spec.target)
    spec.check([tuple(x.shape) for x in xs], None if t is None else tuple(t.shape))
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    parsed = spec.parse(*options)
    cols = xs[0].shape[-1]
    if cols > _launch.ROW_MAX_COLS:
        raise ValueError(f"{spec.name} takes rows of at most {_launch.ROW_MAX_COLS} elements, "
                         f"got shape {tuple(xs[0].shape)}")
    grads = tuple(n in wrt for n in inputs)
    go_kind, go_value, go, go_rs = "host", 1.0, None, 0
    loss_shape = spec.loss_shape(tuple(xs[0].shape), "none")
    if wrt:
        go_kind, go_value, go = _dispatch.classify_grad_output(frame, grad_output, dtype, device,
                                                               loss_shape, reduction)
    stream = frame.stream(device)
    geos = tuple(_row_geometry(x.shape, x.strides) for x in xs)
    t_rs = 0 if t is None or not t.shape else t.strides[0]
    go_rs = 0 if go_kind != "array" else _launch.merged_stride(go.shape, go.strides)
    key = (spec.name, reduction, parsed, want_value, grads, go_kind, go_rs, tuple(xs[0].shape),
           geos, t_rs, None if t is None else t.dtype, dtype, device)   # Key's fields
    return _engine.execute(FAMILY, key, device, frame, stream, ((*xs, t), go, go_value))


def _copies(frame, stream, key, state):
    """Contiguous copies of the inputs whose leading dims do not merge and of a per-row
    grad_output whose dims do not, and their key."""
    ops, go, go_value = state
    key = Key._make(key)
    keep, xs, t = [], list(ops[:-1]), ops[-1]
    for k, x in enumerate(xs):
        if _row_geometry(x.shape, x.strides) is None:
            xs[k], copy = _engine.contiguous_input(frame, x, "input")
            keep.append(copy)
    go_rs = 0
    if key.go_kind == "array":
        go_rs = _launch.merged_stride(go.shape, go.strides)
        if go_rs is None:
            go = _engine.contiguous(frame, go, "grad_output")
            go_rs = _launch.merged_stride(go.shape, go.strides)
    key = key._replace(go_rs=go_rs, geos=tuple(_row_geometry(x.shape, x.strides) for x in xs))
    return key, ((*xs, t), go, go_value), keep


FAMILY = _engine.Family(_PLANS, _build, _copies)
