"""The engine behind every pointwise loss: plan once per layout, then allocate and launch.

`evaluate` is the one entry point.  Its arguments come through `_dispatch` as Operands (pointer,
shape, strides, dtype, device) whatever framework they belong to.  Everything that depends only
on metadata (shapes, strides, dtype, alignment, device, reduction, options, which outputs) is
computed once and cached as a Plan holding the kernel, its launch configuration and its packed
parameter words.  A call with a cached plan validates, allocates its outputs and launches once:
the 0-d loss is finished inside the same kernel (grid_sum_out in kernels/common.cuh).  Only a
gradient of an operand broadcast along several rows (issue: a per-channel parameter) takes
second launches (`sum_rows`).  Nothing is read back to the host.
"""

from __future__ import annotations

import dataclasses
import math

import numpy

from cupyloss import _args, _dispatch, _dtypes, _launch, _reduction, _source, _validate

# Flag bits, mirrored from the enum in kernels/pointwise.cu.
FLAG_LOG_TARGET = 1
FLAG_PROB_INPUT = 2
FLAG_GO_DEVICE = 4
FLAG_GO_ELEMENTWISE = 8
_ONE = _args.f64_word(1.0)    # the grad_output word every plan starts with


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered pointwise loss: its functor in kernels/losses.cuh and its arguments.

    arrays: the array arguments in torch's order (each has a gradient); options: the names of the
    keyword options the functor reads, in the order the public function passes them.
    """

    name: str
    functor: str
    reductions: tuple = ("none", "mean", "sum")
    arrays: tuple = ("input", "target")
    options: tuple = ()


# The registry: one line per pointwise loss.
SPECS = {
    "mse_loss": LossSpec("mse_loss", "MseOp"),
    "kl_div": LossSpec("kl_div", "KlDivOp", ("none", "mean", "sum", "batchmean"),
                       options=("log_target", "log_input")),
    "hinge_loss": LossSpec("hinge_loss", "HingeOp", options=("margin",)),
}


def _scalar_words(prefix: str) -> list[tuple[str, int]]:
    # struct Scalars<T> in kernels/pointwise.cu: value, gx, gt, partials, ticket, divisor.
    return [(prefix + f, 1) for f in ("value", "gx0", "gt0", "partials", "ticket", "divisor")]


_GEO_WORDS = _launch.GEOMETRY_DTYPE.itemsize // 8
FLAT = _args.Layout([("x", 1), ("t", 1), ("go", 1), ("geo", _GEO_WORDS), ("n", 1),
                     ("margin", 1), ("flags", 1), ("go_value", 1), ("grad_scale", 1),
                     ("loss", 1)] + _scalar_words("")
                    + [("gx", 1), ("gt", 1), ("gx_ws", 1), ("gt_ws", 1)])
ROWS = _args.Layout([("x", 1), ("t", 1), ("go", 1), ("rows", 1), ("cols", 1),
                     ("rows_per_block", 1), ("tx", 1), ("margin", 1), ("flags", 1),
                     ("go_value", 1), ("grad_scale", 1), ("loss", 1)] + _scalar_words("")
                    + [("g_full", 1), ("ws", 1), ("g_row", 1)])
SUM_ROWS = _args.Layout([("ws", 1), ("rows", 1), ("cols", 1), ("out", 1)])


@dataclasses.dataclass
class Plan:
    """Everything about a call that depends only on metadata, ready to launch."""

    function: int            # CUfunction of the pointwise kernel
    grid: tuple
    block: tuple
    shared: int
    words: object            # array('Q'): the packed parameters, pointers left zero
    slot: dict               # parameter name -> word index (the layout's)
    out_shape: tuple
    n: int
    modes: tuple             # per operand (input, target): direct, scalar, bcast or row
    loss: bool               # allocate the elementwise loss
    value: bool              # allocate the 0-d loss
    grads: tuple             # per operand: None or where its gradient goes (see _grad_slot)
    partials: int            # accumulator elements of scratch for several blocks (0: none)
    acc: numpy.dtype
    ws: tuple = (None, None)  # per operand: (rows, cols, permutation or None) of a workspace
    sum_rows: int = 0        # CUfunction of sum_rows for this dtype (when ws is used)
    too_many_dims: bool = False
    shapes: tuple = ()       # the operands' shapes (their gradients' shapes)
    contiguous: tuple = (False, False)  # whether each operand is C-contiguous

    def __post_init__(self):
        # What _run does per call, precomputed: (result index, word slot or -1, shape, how) for
        # every output; result 0 is the loss, 1 and 2 the input and target gradients; how is
        # "empty", "like" (the operand is C-contiguous: the cheapest allocation copies its
        # metadata) or "zeros".
        slot = self.slot
        self.allocs = []
        if self.value:
            self.allocs.append((0, slot["value"], (), "empty"))
        elif self.loss:
            self.allocs.append((0, slot["loss"], self.out_shape, "empty"))
        for k, where in enumerate(self.grads):
            if where is not None:
                in_words = where not in ("zeros", "sum_rows")
                how = "zeros" if where == "zeros" else "like" if self.contiguous[k] else "empty"
                self.allocs.append((k + 1, slot[where] if in_words else -1, self.shapes[k], how))
        self.slow = self.too_many_dims or any(self.ws)
        if slot:
            self.sx, self.st, self.sgo, self.sgov = (slot[k] for k in ("x", "t", "go",
                                                                       "go_value"))
            self.spartials, self.sticket = slot["partials"], slot["ticket"]


_PLANS: dict = {}
_TICKETS: dict = {}          # device -> (base pointer, {stream: slot})
_TICKET_SLOTS = 1024


def _ticket(device: int, stream: int) -> int:
    """A zeroed uint32 on `device` for the last-block ticket of launches on `stream`.

    Each kernel that uses it leaves it zero again (atomicInc wraps it), so launches on one
    stream share one slot.
    The slots are allocated and zeroed once per device (warm up before capturing a CUDA graph).
    """
    import cupy

    entry = _TICKETS.get(device)
    if entry is None:
        with cupy.cuda.Device(device):
            base = cupy.cuda.runtime.malloc(4 * _TICKET_SLOTS)
            cupy.cuda.runtime.memset(base, 0, 4 * _TICKET_SLOTS)
        entry = _TICKETS[device] = (base, {})
    base, slots = entry
    slot = slots.get(stream)
    if slot is None:
        slot = slots[stream] = len(slots) % _TICKET_SLOTS
    return base + 4 * slot


def _mode(size: int, n: int) -> str:
    if size == n:
        return "direct"
    return "scalar" if size == 1 else "bcast"


def _flags(spec: LossSpec, options: tuple, go_kind: str) -> tuple[float, int]:
    """(margin, flags) words of the functor options and the grad_output kind."""
    opts = dict(zip(spec.options, options))
    flags = 0
    if opts.get("log_target", False):
        flags |= FLAG_LOG_TARGET
    if not opts.get("log_input", True):
        flags |= FLAG_PROB_INPUT
    if go_kind == "device":
        flags |= FLAG_GO_DEVICE
    elif go_kind == "array":
        flags |= FLAG_GO_ELEMENTWISE
    return float(opts.get("margin", 1.0)), flags


def _resident(name: str, shared: int, limits) -> int:
    """Blocks per SM of pointwise kernel `name`, from its compiled register count."""
    attrs = _source.function("pointwise.cu", name).attributes
    return _launch.resident_blocks(attrs["num_regs"], shared, limits)


def _make_plan(*args) -> Plan:
    """Build the plan of a call (on its device: kernels are loaded per device)."""
    import cupy

    with cupy.cuda.Device(args[-1]):
        return _build(*args)


def _build(spec, reduction, options, want_value, want_grads, go_kind, go_shape, go_strides,
           x_shape, x_strides, t_shape, t_strides, dtype, aligned, device) -> Plan:
    info = _dtypes.DTYPES[dtype]
    limits = _launch.device_limits(device)
    acc = info.acc.itemsize
    out_shape = _validate.broadcast_shape(x_shape, t_shape)
    if go_kind == "array":
        _validate.check_grad_output_shape(go_shape, out_shape, reduction)
    n = math.prod(out_shape)
    strides = [_launch.broadcast_strides(x_shape, x_strides, out_shape),
               _launch.broadcast_strides(t_shape, t_strides, out_shape)]
    go_layout = None
    if go_kind == "array":
        go_layout = _launch.broadcast_strides(go_shape, go_strides, out_shape)
        strides.append(go_layout)
    shape, cstrides = _launch.coalesce(out_shape, strides)
    modes = (_mode(math.prod(x_shape), n), _mode(math.prod(t_shape), n))
    margin, flags = _flags(spec, options, go_kind)
    scale = _reduction.grad_scale(reduction, n, x_shape)
    divisor = _reduction.divisor(reduction, n, x_shape)
    reduced = reduction != "none"
    common = {"margin": _args.f64_word(margin), "flags": flags, "go_value": _ONE,
              "grad_scale": _args.f64_word(scale), "divisor": _args.f64_word(divisor)}
    shapes = (x_shape, t_shape)
    contiguous = (x_strides == _contiguous_strides(x_shape),
                  t_strides == _contiguous_strides(t_shape))

    if len(shape) == 2 and n > 0:
        rows, cols = shape
        full, row = (cols, 1), (0, 1)
        kinds = [st == full or st == row for st in cstrides[:2]]
        # The row operand must be one row (not a full-size view with a stride-0 dim, whose
        # gradient is full-size too).
        row_operand = 0 if cstrides[0] == row else 1
        if (all(kinds) and (cstrides[0] == row) != (cstrides[1] == row)
                and modes[row_operand] != "direct"
                and (go_layout is None or cstrides[2] == full)):
            vec = info.vec if (cols % info.vec == 0 and aligned) else 1
            modes = tuple("row" if st == row else m for st, m in zip(cstrides[:2], modes))
            row_is_x = modes[0] == "row"
            name = _source.pointwise_name("rows", info.ctype, spec.functor, vec, row_is_x)
            shared = max(_launch.BLOCK * vec, _launch.BLOCK // 32) * acc
            cfg = _launch.rows_launch(rows, cols, vec, acc, limits,
                                      _resident(name, shared, limits))
            nblocks = math.prod(cfg.grid)
            words = ROWS.template({**common, "rows": rows, "cols": cols,
                                   "rows_per_block": cfg.rows_per_block, "tx": cfg.tx})
            grads, ws = [None, None], [None, None]
            for k in range(2):
                if not want_grads[k]:
                    continue
                if modes[k] == "row" and cfg.grid[1] == 1:
                    grads[k] = "g_row"
                elif modes[k] == "row":
                    grads[k] = "sum_rows"
                    ws[k] = (cfg.grid[1], cols, None)
                else:
                    grads[k] = "g_full"
            return Plan(_source.function("pointwise.cu", name).kernel.ptr, cfg.grid, cfg.block,
                        cfg.shared, words, ROWS.slot, out_shape, n, modes,
                        not reduced and want_value, reduced and want_value, tuple(grads),
                        3 * nblocks if nblocks > 1 and reduced and want_value else 0, info.acc,
                        tuple(ws), _sum_rows_function(info) if any(ws) else 0, shapes=shapes,
                        contiguous=contiguous)

    if len(shape) > _launch.MAX_DIMS:  # evaluate makes the operands contiguous and retries
        return Plan(0, (), (), 0, None, {}, out_shape, n, modes, False, False, (), 0, info.acc,
                    too_many_dims=True, shapes=shapes, contiguous=contiguous)
    vec = 1
    if len(shape) == 1 and aligned and all(st[0] in (0, 1) for st in cstrides) \
            and "bcast" not in modes:
        vec = info.vec
    while len(cstrides) < 3:
        cstrides.append((0,) * len(shape))
    name = _source.pointwise_name("flat", info.ctype, spec.functor, vec)
    shared = _launch.BLOCK // 32 * acc
    cfg = _launch.flat_launch(n, vec, acc, limits, _resident(name, shared, limits))
    nblocks = math.prod(cfg.grid)
    words = FLAT.template({**common, "geo": _args.struct_words(_launch.geometry(shape, cstrides)),
                           "n": n})
    grads, ws = [None, None], [None, None]
    for k in range(2):
        if not want_grads[k]:
            continue
        if modes[k] == "direct":
            grads[k] = ("gx", "gt")[k]
        elif modes[k] == "scalar":
            grads[k] = ("gx0", "gt0")[k]
        elif n == 0:
            grads[k] = "zeros"
        else:
            grads[k] = "sum_rows"
            ws[k] = _workspace(out_shape, shapes[k])
    scalars = reduced and want_value or "gx0" in grads or "gt0" in grads
    return Plan(_source.function("pointwise.cu", name).kernel.ptr, cfg.grid, cfg.block,
                cfg.shared, words, FLAT.slot, out_shape, n, modes, not reduced and want_value,
                reduced and want_value, tuple(grads), 3 * nblocks if nblocks > 1 and scalars
                else 0, info.acc, tuple(ws), _sum_rows_function(info) if any(ws) else 0,
                shapes=shapes, contiguous=contiguous)


def _workspace(out_shape: tuple, operand_shape: tuple) -> tuple:
    """(rows, cols, permutation) that sums a full-size gradient down to `operand_shape`."""
    ndim = len(out_shape)
    padded = (1,) * (ndim - len(operand_shape)) + tuple(operand_shape)
    reduced = [d for d in range(ndim) if padded[d] == 1 and out_shape[d] != 1]
    kept = [d for d in range(ndim) if d not in reduced]
    cols = math.prod(operand_shape)
    return (math.prod(out_shape) // cols, cols, tuple(reduced + kept))


def _sum_rows_function(info) -> int:
    return _source.function("reduce.cu", _source.reduce_name("sum_rows", info.ctype)).kernel.ptr


class _RawStream:
    """A raw cudaStream_t as the CUDA stream protocol's object (for Stream.from_external)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def evaluate(spec: LossSpec, input, target, *, reduction: str, options: tuple,
             want_value: bool, wrt: tuple, grad_output=1.0):
    """Loss value (or None) and gradients for the names in `wrt` (others None), in one pass.

    Arrays come from and go back to the caller's framework (see _dispatch).
    """
    frame = _dispatch.frame_of(input, "input")
    other = _dispatch.frame_of(target, "target")
    if other is not frame:
        _dispatch.check_same_frame(frame, other, input, target, "input", "target")
    x = frame.operand(input, "input")
    t = frame.operand(target, "target")
    dtype, device = x.dtype, x.device
    if t.dtype != dtype:
        _validate.check_same_dtype(x, t, "input", "target")
    if t.device != device:
        _validate.check_same_device(x, t, "input", "target")
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    want_grads = ("input" in wrt, "target" in wrt)
    go_kind, go_value, go = "host", 1.0, None
    go_shape = go_strides = None
    if wrt:
        if type(grad_output) is float or type(grad_output) is int:
            go_value = float(grad_output)
        else:
            go = _validate.check_grad_output(frame, grad_output, dtype, device)
            if isinstance(go, float):
                go_value, go = go, None
            else:
                go_kind = "device" if go.shape == () else "array"
                go_shape, go_strides = go.shape, go.strides
    aligned = not ((x.ptr | t.ptr | (go.ptr if go is not None else 0)) & 15)
    key = (spec.name, reduction, options, want_value, want_grads, go_kind, go_shape, go_strides,
           x.shape, x.strides, t.shape, t.strides, dtype, aligned, device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _make_plan(spec, reduction, options, want_value, want_grads,
                                        go_kind, go_shape, go_strides, x.shape, x.strides,
                                        t.shape, t.strides, dtype, aligned, device)
    if plan.slow or _current_device() != device:
        return _run_slow(spec, plan, frame, x, t, go, go_value, reduction, options, want_value,
                         wrt)
    return _run(plan, frame, x, t, go, go_value, frame.stream(device))


def _current_device():
    import cupy

    global _current_device
    _current_device = cupy.cuda.runtime.getDevice
    return _current_device()


def _run(plan: Plan, frame, x, t, go, go_value, stream, like=None):
    """Allocate the outputs, fill the pointer words, launch.  The hot path of every call.

    Outputs are allocated by `frame` like `like` (the caller's input array by default)."""
    words = _args.array.array("Q", plan.words)
    words[plan.sx] = x.ptr
    words[plan.st] = t.ptr
    if go is not None:
        words[plan.sgo] = go.ptr
    elif go_value != 1.0:
        words[plan.sgov] = _args.f64_word(go_value)
    out = [None, None, None]
    post = []
    if like is None:
        like = x.array
    dtype = x.dtype
    for index, slot, shape, how in plan.allocs:
        if how == "like":
            out[index], ptr = frame.empty_like((x, t)[index - 1].array)
        elif how == "empty":
            out[index], ptr = frame.empty(shape, dtype, like)
        else:
            out[index], _ = frame.zeros(shape, dtype, like)
            continue
        if slot >= 0:
            words[slot] = ptr
        else:
            post.append((index - 1, ptr))
    if plan.partials:
        _, words[plan.spartials] = frame.empty((plan.partials,), plan.acc, like)
        words[plan.sticket] = _ticket(x.device, stream)
    if post:
        _launch_with_workspaces(plan, frame, words, post, stream, like)
    else:
        _args.launch(plan.function, plan.grid, plan.block, plan.shared, stream, words)
    result = frame.result
    return [None if a is None else result(a) for a in out]


def _launch_with_workspaces(plan, frame, words, post, stream, like):
    """The main launch with accumulator workspaces for broadcast gradients, then their sums."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    workspaces = []
    for k, out_ptr in post:
        rows, cols, perm = plan.ws[k]
        ws, ws_ptr = frame.empty((rows * cols,), plan.acc, like)
        words[plan.slot["ws"] if "ws" in plan.slot else plan.slot[("gx_ws", "gt_ws")[k]]] = ws_ptr
        workspaces.append((k, ws, out_ptr))
    _args.launch(plan.function, plan.grid, plan.block, plan.shared, stream, words)
    limits = _launch.device_limits(device)
    for k, ws, out_ptr in workspaces:
        rows, cols, perm = plan.ws[k]
        if perm is not None and list(perm) != sorted(perm):
            view = _dispatch._cupy_view(_dispatch.Operand(
                _pointer_of(ws), plan.out_shape, _contiguous_strides(plan.out_shape),
                plan.acc, device, ws))
            ws = cupy.ascontiguousarray(view.transpose(perm))
        cfg = _launch.sum_rows_launch(cols, limits)
        sum_words = SUM_ROWS.template({"ws": _pointer_of(ws), "rows": rows, "cols": cols,
                                       "out": out_ptr})
        _args.launch(plan.sum_rows, cfg.grid, cfg.block, cfg.shared, stream, sum_words)


def _pointer_of(a) -> int:
    if hasattr(a, "data_ptr"):
        return a.data_ptr()
    return a.data.ptr


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _run_slow(spec, plan, frame, x, t, go, go_value, reduction, options, want_value, wrt):
    """Calls off the hot path: another current device, more than MAX_DIMS dims, or
    workspaces that CuPy sums (allocated by the caller's framework, on the caller's stream)."""
    import cupy

    device = x.device
    stream = frame.stream(device)
    like = x.array
    with cupy.cuda.Device(device), \
            cupy.cuda.Stream.from_external(_RawStream(stream)), frame.scratch_allocator():
        if plan.too_many_dims:
            # Contiguous copies coalesce to one dim; results still go to the caller's frame.
            cupy_frame = _dispatch.CupyFrame()
            x = cupy_frame.operand(cupy.ascontiguousarray(frame.cupy_view(x)), "input")
            t = cupy_frame.operand(cupy.ascontiguousarray(frame.cupy_view(t)), "target")
            go_shape = go_strides = None
            go_kind = "host"
            if go is not None:
                go = cupy_frame.operand(cupy.ascontiguousarray(frame.cupy_view(go)),
                                        "grad_output")
                go_kind = "device" if go.shape == () else "array"
                go_shape, go_strides = go.shape, go.strides
            aligned = not ((x.ptr | t.ptr | (go.ptr if go is not None else 0)) & 15)
            plan = _make_plan(spec, reduction, options, want_value,
                              ("input" in wrt, "target" in wrt), go_kind, go_shape, go_strides,
                              x.shape, x.strides, t.shape, t.strides, x.dtype, aligned, device)
        return _run(plan, frame, x, t, go, go_value, stream, like)
