"""The engine behind every pointwise loss: plan a launch, allocate, launch, reduce.

`evaluate` is the one entry point.  It validates on the host, builds (and caches) a Plan from
shapes, strides and alignment alone, then issues at most four launches on CuPy's current stream:
the pointwise kernel, `finalize` for 0-d results, and `sum_rows` per broadcast operand gradient.
Nothing is read back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from cupyloss import _dtypes, _launch, _reduction, _source, _validate

# Flag bits, mirrored from the enum in kernels/pointwise.cu.
FLAG_LOG_TARGET = 1
FLAG_PROB_INPUT = 2
FLAG_GO_DEVICE = 4
FLAG_GO_ELEMENTWISE = 8
FLAG_GX_SCALAR = 16
FLAG_GT_SCALAR = 32

_NULL = numpy.uint64(0)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered pointwise loss: its functor in kernels/losses.cuh and the reductions it takes."""

    name: str
    functor: str
    reductions: tuple = ("none", "mean", "sum")


# The registry: one line per pointwise loss.
SPECS = {
    "mse_loss": LossSpec("mse_loss", "MseOp"),
    "kl_div": LossSpec("kl_div", "KlDivOp", ("none", "mean", "sum", "batchmean")),
    "hinge_loss": LossSpec("hinge_loss", "HingeOp"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about a call that depends only on shapes, strides, dtype and alignment."""

    kind: str                  # "flat" or "rows"
    n: int                     # elements of the broadcast shape
    out_shape: tuple
    vec: int
    modes: tuple               # per operand (input, target): "direct", "scalar", "bcast" or "row"
    geometry: object           # packed Geometry (flat) or None
    rows: int = 0
    cols: int = 0
    launch: object = None
    kernel: str = ""           # name expression in kernels/pointwise.cu


def _ptr(a) -> numpy.uint64:
    return _NULL if a is None else numpy.uint64(a.data.ptr)


def _elem_strides(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def _mode(size: int, n: int) -> str:
    if size == n:
        return "direct"
    return "scalar" if size == 1 else "bcast"


@functools.lru_cache(maxsize=1024)
def _plan(functor, x_shape, x_strides, t_shape, t_strides, go_layout, dtype, aligned,
          device_id) -> Plan:
    info = _dtypes.lookup(dtype)
    limits = _launch.device_limits(device_id)
    acc = info.acc.itemsize
    out_shape = _validate.broadcast_shape(x_shape, t_shape)
    n = math.prod(out_shape)
    strides = [_launch.broadcast_strides(x_shape, x_strides, out_shape),
               _launch.broadcast_strides(t_shape, t_strides, out_shape)]
    if go_layout is not None:
        strides.append(go_layout)
    shape, cstrides = _launch.coalesce(out_shape, strides)
    modes = (_mode(math.prod(x_shape), n), _mode(math.prod(t_shape), n))
    if n == 0:  # nothing to launch but finalize (evaluate fills the results)
        return Plan("empty", 0, out_shape, 1, modes, None)

    if len(shape) == 2:
        rows, cols = shape
        full, row = (cols, 1), (0, 1)
        kinds = [st == full or st == row for st in cstrides[:2]]
        if (all(kinds) and (cstrides[0] == row) != (cstrides[1] == row)
                and (go_layout is None or cstrides[2] == full)):
            vec = info.vec if (cols % info.vec == 0 and aligned) else 1
            modes = tuple("row" if st == row else m for st, m in zip(cstrides[:2], modes))
            name = _source.pointwise_name("rows", info.ctype, functor, vec, modes[0] == "row")
            per_sm = _resident(name, max(_launch.BLOCK * vec, _launch.BLOCK // 32) * acc,
                               limits)
            return Plan("rows", n, out_shape, vec, modes, None, rows, cols,
                        _launch.rows_launch(rows, cols, vec, acc, limits, per_sm), name)

    if len(shape) > _launch.MAX_DIMS:  # the caller makes the operands contiguous and retries
        return Plan("too_many_dims", n, out_shape, 1, modes, None)
    vec = 1
    if len(shape) == 1 and aligned and all(st[0] in (0, 1) for st in cstrides) \
            and "bcast" not in modes:
        vec = info.vec
    while len(cstrides) < 3:
        cstrides.append((0,) * len(shape))
    geo = _launch.geometry(shape, cstrides)
    name = _source.pointwise_name("flat", info.ctype, functor, vec)
    per_sm = _resident(name, _launch.BLOCK // 32 * acc, limits)
    return Plan("flat", n, out_shape, vec, modes, geo,
                launch=_launch.flat_launch(n, vec, acc, limits, per_sm), kernel=name)


def _resident(name: str, shared: int, limits) -> int:
    """Blocks per SM of pointwise kernel `name`, from its compiled register count."""
    attrs = _source.function("pointwise.cu", name).attributes
    return _launch.resident_blocks(attrs["num_regs"], shared, limits)


def _aligned(*arrays) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def _kl_flags(options: dict) -> int:
    flags = 0
    if options.get("log_target", False):
        flags |= FLAG_LOG_TARGET
    if not options.get("log_input", True):
        flags |= FLAG_PROB_INPUT
    return flags


def _sum_to_shape(ws, plan: Plan, out, info) -> None:
    """Write into `out` the accumulator-typed gradient `ws` summed over out's broadcast dims."""
    import cupy

    operand_shape = out.shape
    if plan.kind == "rows":
        rows, cols = ws.shape
    else:
        ndim = len(plan.out_shape)
        padded = (1,) * (ndim - len(operand_shape)) + tuple(operand_shape)
        reduced = [d for d in range(ndim) if padded[d] == 1 and plan.out_shape[d] != 1]
        kept = [d for d in range(ndim) if d not in reduced]
        ws = cupy.ascontiguousarray(ws.reshape(plan.out_shape).transpose(reduced + kept))
        cols = math.prod(operand_shape)
        rows = plan.n // cols
    limits = _launch.device_limits(ws.device.id)
    cfg = _launch.sum_rows_launch(cols, limits)
    kernel = _source.function("reduce.cu", _source.reduce_name("sum_rows", info.ctype))
    kernel(cfg.grid, cfg.block, (_ptr(ws), numpy.int64(rows), numpy.int64(cols), _ptr(out)),
           shared_mem=cfg.shared)


def evaluate(spec: LossSpec, input, target, *, reduction: str, options: dict,
             want_value: bool, wrt: tuple, grad_output=1.0, empty=None):
    """Loss value (or None) and gradients for the names in `wrt` (others None), in one pass.

    `empty(shape, dtype)` allocates every returned array (cupy.empty by default); scratch space
    always comes from CuPy's pool.
    """
    import cupy

    info = _validate.check_array(input, "input")
    _validate.check_array(target, "target")
    _validate.check_same_dtype(input, target, "input", "target")
    _validate.check_same_device(input, target, "input", "target")
    _reduction.check_reduction(reduction, spec.reductions)
    out_shape = _validate.broadcast_shape(input.shape, target.shape)
    device_id = input.device.id
    go_kind, go = "host", 1.0
    if wrt:
        go_kind, go = _validate.check_grad_output(grad_output, out_shape, reduction, info.dtype,
                                                  device_id)
    empty = empty or cupy.empty
    want_gx, want_gt = "input" in wrt, "target" in wrt
    go_array = go if go_kind == "array" else None

    with cupy.cuda.Device(device_id):
        go_layout = None
        if go_array is not None:
            go_layout = _launch.broadcast_strides(go_array.shape, _elem_strides(go_array),
                                                  out_shape)
        plan = _plan(spec.functor, input.shape, _elem_strides(input), target.shape,
                     _elem_strides(target),
                     go_layout, info.dtype, _aligned(input, target, go_array), device_id)
        if plan.kind == "too_many_dims":
            input, target = cupy.ascontiguousarray(input), cupy.ascontiguousarray(target)
            if go_array is not None:
                go_array = go = cupy.ascontiguousarray(go_array)
                go_layout = _launch.broadcast_strides(go.shape, _elem_strides(go), out_shape)
            plan = _plan(spec.functor, input.shape, _elem_strides(input), target.shape,
                         _elem_strides(target), go_layout, info.dtype,
                         _aligned(input, target, go_array), device_id)
        return _run(spec, plan, info, input, target, reduction, options, want_value,
                    want_gx, want_gt, go_kind, go, empty)


def _run(spec, plan, info, input, target, reduction, options, want_value, want_gx, want_gt,
         go_kind, go, empty):
    import cupy

    n = plan.n
    value = loss = partials = None
    if want_value and reduction == "none":
        loss = value = empty(plan.out_shape, info.dtype)
    elif want_value:
        value = empty((), info.dtype)

    # Gradient buffers: the operand's own array for direct/scalar modes, plus accumulator
    # workspaces for broadcast ones.
    grads, ws = [None, None], [None, None]
    for k, (want, operand) in enumerate(((want_gx, input), (want_gt, target))):
        if want:
            grads[k] = empty(operand.shape, info.dtype)
    if n == 0:
        for g in grads:
            if g is not None:
                g.data.memset_async(0, g.nbytes)
        if value is not None and reduction != "none":
            _finalize(plan, info, None, 0, reduction, input, value, None, None)
        return value, grads[0], grads[1]

    scalar_grad = [grads[k] is not None and plan.modes[k] == "scalar" for k in range(2)]
    if value is not None and reduction != "none" or any(scalar_grad):
        nblocks = math.prod(plan.launch.grid)
        partials = cupy.empty((3, nblocks), info.acc)
    flags = _kl_flags(options)
    if go_kind == "device":
        flags |= FLAG_GO_DEVICE
    elif go_kind == "array":
        flags |= FLAG_GO_ELEMENTWISE
    direct = [None, None]
    for k in range(2):
        if grads[k] is None:
            continue
        mode = plan.modes[k]
        if mode == "direct":
            direct[k] = grads[k]
        elif mode == "scalar":
            flags |= (FLAG_GX_SCALAR, FLAG_GT_SCALAR)[k]
        elif mode == "row":
            ws[k] = cupy.empty((plan.launch.grid[1], plan.cols), info.acc)
        else:
            ws[k] = cupy.empty((n,), info.acc)
    go_value = go if go_kind == "host" else 0.0
    scale = _reduction.grad_scale(reduction, n, input.shape)
    go_ptr = _ptr(go) if go_kind in ("device", "array") else _NULL
    common = (numpy.float64(options.get("margin", 1.0)), numpy.int64(flags),
              numpy.float64(go_value), numpy.float64(scale), _ptr(loss), _ptr(partials))
    cfg = plan.launch
    if plan.kind == "rows":
        row = 0 if plan.modes[0] == "row" else 1
        args = (_ptr(input), _ptr(target), go_ptr, numpy.int64(plan.rows),
                numpy.int64(plan.cols), numpy.int64(cfg.rows_per_block), numpy.int64(cfg.tx)
                ) + common + (_ptr(direct[1 - row]), _ptr(ws[row]))
    else:
        args = (_ptr(input), _ptr(target), go_ptr, plan.geometry, numpy.int64(n)) + common + (
            _ptr(direct[0]), _ptr(direct[1]), _ptr(ws[0]), _ptr(ws[1]))
    _source.function("pointwise.cu", plan.kernel)(cfg.grid, cfg.block, args, shared_mem=cfg.shared)

    if partials is not None:
        out_value = value if reduction != "none" else None
        out_g = [grads[k] if scalar_grad[k] else None for k in range(2)]
        _finalize(plan, info, partials, partials.shape[1], reduction, input, out_value, *out_g)
    for k in range(2):
        if ws[k] is not None:
            _sum_to_shape(ws[k], plan, grads[k], info)
    return value, grads[0], grads[1]


def _finalize(plan, info, partials, nparts, reduction, input, out0, out1, out2):
    limits = _launch.device_limits(input.device.id)
    cfg = _launch.finalize_launch(info.acc.itemsize, limits)
    kernel = _source.function("reduce.cu", _source.reduce_name("finalize", info.ctype))
    divisor = _reduction.divisor(reduction, plan.n, input.shape)
    kernel(cfg.grid, cfg.block,
           (_ptr(partials), numpy.int64(nparts), numpy.float64(divisor),
            _ptr(out0), _ptr(out1), _ptr(out2)), shared_mem=cfg.shared)
