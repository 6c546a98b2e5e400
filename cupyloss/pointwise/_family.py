"""The pointwise family: every pointwise loss planned once per layout, then run by the engine.

`evaluate` is the one entry point.  A loss (a LossSpec of _registry) has K array operands, 2 to
4, in torch's order; each comes through `_dispatch` as an Operand (pointer, shape, strides, dtype,
device) whatever framework it belongs to, is broadcast on its own (never materialised) and has
its own gradient on request.  An optional operand left out (None) reads as the spec's fill
value, and a Python number where the public function accepts one reads as that number; neither
has a gradient.  Everything that depends only on metadata (shapes, strides, dtype, alignment,
device, reduction, the functor's options, which outputs) is computed once and cached as a Plan
(an `_engine.Plan`: the kernel, its launch configuration, its packed parameter words with the
functor's Params struct among them, and the tables `_engine.run` fills).  A call with a cached
plan validates, allocates its outputs and launches once: the 0-d loss is finished inside the
same kernel (grid_sum_out in kernels/common.cuh).

The gradient of an operand broadcast along some of the dims (a per-channel or per-row
parameter) is summed in the same pass, in registers (pointwise_rows for one row broadcast down
the rows, pointwise_reduce for every other pattern), into float64 partials no larger than
[resident warps, its size], which the last block of each column block (pointwise_rows) or the
last unit of each group of elements (pointwise_reduce) adds in a fixed order in the same launch
(a ticket each, from a zeroed per-stream pool the kernels leave zero; reduce.cu's `sum_chunks`
only past _engine.COL_TICKETS of them).  No full-size workspace, no atomics on values.
Operands broadcast along different dims that both want a gradient take one pass per pattern:
the first pass computes everything else, each later one (`Plan.rest`) only its operands'
gradients.  Nothing is read back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

from cupyloss._core import (
    args as _args, dispatch as _dispatch, dtypes as _dtypes, engine as _engine,
    launch as _launch, plans as _plans, reduction as _reduction, source as _source,
    tuning as _tuning, validate as _validate)
from cupyloss.pointwise import _launch as _pointwise_launch
from cupyloss._core.registry import SPECS, LossSpec  # noqa: F401  (the adapters read SPECS here)

# Flag bits and operand kinds: the enums of kernels/pointwise.cu.
FLAG_GO_DEVICE, FLAG_GO_ELEMENTWISE, KIND_FULL, KIND_ROW, KIND_SCALAR = _source.constants(
    "pointwise.cu", "FLAG_GO_DEVICE", "FLAG_GO_ELEMENTWISE", "KIND_FULL", "KIND_ROW", "KIND_SCALAR")
_ONE = _args.f64_word(1.0)    # the grad_output word every plan starts with


def _scalars(k: int) -> list[tuple[str, int]]:
    # struct Scalars<T, K> in kernels/pointwise.cu, written field by field ("o.value", ...).
    return [("value", 1), ("g", k), ("partials", 1), ("ticket", 1), ("divisor", 1)]


# Each kernel's parameters as kernels/pointwise.cu declares them (_source.kernel_words), for K
# operands and a Params struct of `params` words.
@functools.lru_cache(maxsize=None)
def flat_layout(k: int, params: int) -> _args.Layout:
    """Parameters of pointwise_flat."""
    geo = _launch.geometry_dtype(k + 1).itemsize // 8
    return _args.Layout(_source.kernel_words(
        "pointwise.cu", "pointwise_flat", {"in": k, "fill": k, "geo": geo, "p": params, "g": k},
        {"o": _scalars(k)}))


@functools.lru_cache(maxsize=None)
def rows_layout(k: int, params: int) -> _args.Layout:
    """Parameters of pointwise_rows."""
    return _args.Layout(_source.kernel_words(
        "pointwise.cu", "pointwise_rows",
        {"in": k, "fill": k, "kind": k, "p": params, "g": k, "ws": k}, {"o": _scalars(k)}))


@functools.lru_cache(maxsize=None)
def reduce_layout(k: int, params: int) -> _args.Layout:
    """Parameters of pointwise_reduce."""
    geo = _launch.geometry_dtype(k + 2).itemsize // 8
    return _args.Layout(_source.kernel_words(
        "pointwise.cu", "pointwise_reduce",
        {"in": k, "fill": k, "kept": geo, "red": geo, "p": params, "g": k, "ws": k},
        {"o": _scalars(k)}))


SUM_CHUNKS = _args.Layout(_source.kernel_words("reduce.cu", "sum_chunks"))


class Key(NamedTuple):
    """What a pointwise plan depends on: the plan cache's key, passed whole to _build."""

    name: str                # the loss (SPECS)
    reduction: str
    params: tuple            # the functor's options, in spec.params' order
    want_value: bool
    want_grads: tuple        # per operand: its gradient is written
    go_kind: str             # grad_output: "host", "device" (0-d) or "array" (elementwise)
    go_shape: tuple | None
    go_strides: tuple | None
    layouts: tuple           # per operand: (shape, strides), None for a number or left out
    dtype: object
    aligned: bool            # every pointer on a 16-byte boundary
    device: int
    copied: bool             # the operands are contiguous copies (results allocated anew)


@dataclasses.dataclass
class Plan(_engine.Plan):
    """A pointwise plan: the engine's tables, and what they were made from."""

    out_shape: tuple = ()
    grads: tuple = ()        # per operand: None or where its gradient goes: "g", "g0", "chunks"
                             # (float64 partials summed by sum_chunks), "fused" ("g", with
                             # float64 partials the kernel itself adds up) or "zeros"
    value: bool = False      # a 0-d loss
    loss: bool = False       # an elementwise loss


_PLANS = _plans.Plans()


def _mode(size: int, n: int) -> str:
    if size == n:
        return "direct"
    return "scalar" if size == 1 else "bcast"


def _resident(name: str, shared: int, limits) -> int:
    """Blocks per SM of pointwise kernel `name`, from its compiled register count."""
    attrs = _source.function("pointwise.cu", name).attributes
    return _launch.resident_blocks(attrs["num_regs"], shared, limits)


def _build(key: Key) -> Plan:
    """The plan of a key; layouts[k] is (shape, strides) of array operand k, else None."""
    key = Key._make(key)
    (name, reduction, params, want_value, want_grads, go_kind, go_shape, go_strides, layouts,
     dtype, aligned, device, copied) = key
    spec = SPECS[name]
    info = _dtypes.DTYPES[dtype]
    limits = _launch.device_limits(device)
    k_ops = len(spec.operands)
    shapes = tuple(lay[0] if lay is not None else None for lay in layouts)
    views = dict(spec.views)
    viewed, vstrides = [], []
    for name, lay in zip(spec.operands, layouts):
        if lay is None:
            viewed.append(())
            vstrides.append(())
            continue
        shape, strides = lay
        if name in views:
            view = views[name](shapes[0], shape)
            strides = tuple(strides) + (0,) * (len(view) - len(shape))
            shape = view
        viewed.append(tuple(shape))
        vstrides.append(tuple(strides))
    present = [k for k in range(k_ops) if layouts[k] is not None]
    out_shape = _validate.broadcast_shapes([viewed[k] for k in present],
                                           [spec.operands[k] for k in present])
    if go_kind == "array":
        _validate.check_grad_output_shape(go_shape, out_shape, reduction)
    n = math.prod(out_shape)
    strides = [_launch.broadcast_strides(viewed[k], vstrides[k], out_shape)
               if layouts[k] is not None else (0,) * len(out_shape) for k in range(k_ops)]
    go_layout = None
    if go_kind == "array":
        go_layout = _launch.broadcast_strides(go_shape, go_strides, out_shape)
    strides.append(go_layout if go_layout is not None else (0,) * len(out_shape))
    shape, cstrides = _launch.coalesce(out_shape, strides)
    modes = tuple(_mode(math.prod(viewed[k]), n) if layouts[k] is not None else "fill"
                  for k in range(k_ops))
    flags = (FLAG_GO_DEVICE if go_kind == "device" else
             FLAG_GO_ELEMENTWISE if go_kind == "array" else 0)
    scale = _reduction.grad_scale(reduction, n, shapes[0])
    divisor = _reduction.divisor(reduction, n, shapes[0])
    reduced = reduction != "none"
    fill = [_args.f64_word(spec.fill)] * k_ops
    # The kernels' functor, with its modes' bits (options, and which optional arrays are given).
    functor = spec.instance(params, tuple(spec.operands[k] for k in present))
    common = {"fill": fill, "p": spec.pack(params), "flags": flags, "go_value": _ONE,
              "grad_scale": _args.f64_word(scale), "o.divisor": _args.f64_word(divisor)}
    contiguous = tuple(lay is not None and tuple(lay[1]) == _contiguous_strides(lay[0])
                       for lay in layouts)
    # Broadcast operands: a pass that delivers the loss is split by the pattern of the first of
    # them, whether or not its gradient is wanted, so that the 0-d loss is summed in the same
    # order by the loss alone and by value_and_grad; a gradient-only pass by the first whose
    # gradient is wanted.  Gradients summed over broadcast dims: this pass takes the operands
    # broadcast like that one; the others go to a later pass (`rest`) that computes only their
    # gradients.
    bcast = [k for k in range(k_ops) if modes[k] == "bcast" and n > 0]
    summed = [k for k in bcast if want_grads[k]]
    lead = bcast[0] if bcast and (want_value or not summed) else (summed or [None])[0]
    rest = None
    if summed:
        pattern = _pointwise_launch.broadcast_pattern(shape, cstrides[lead])
        later = tuple(k in summed and _pointwise_launch.broadcast_pattern(shape, cstrides[k]) != pattern
                      for k in range(k_ops))
        if any(later) and len(shape) <= _launch.MAX_DIMS:
            rest = _build(key._replace(want_value=False, want_grads=later))
            want_grads = tuple(w and not b for w, b in zip(want_grads, later))
            summed = [k for k in summed if not later[k]]

    def plan(function, cfg, words, layout, grads, chunks, scalars):
        slot = layout.slot
        nblocks = math.prod(cfg.grid)
        outputs = [None] * (k_ops + 1)
        if want_value:
            outputs[0] = ((slot["o.value"], (), dtype, "empty") if reduced
                          else (slot["loss"], out_shape, dtype, "empty"))
        wide, after = [], []
        for k, where in enumerate(grads):
            if where is None:
                continue
            word = {"g": slot["g"] + k, "g0": slot["o.g"] + k,
                    "fused": slot["g"] + k}.get(where, -1)   # "chunks": sum_chunks's
            how = ("zeros" if where == "zeros" else ("like", k) if contiguous[k] and not copied
                   else "empty")
            outputs[k + 1] = (word, shapes[k], dtype, how)
            if chunks[k] is not None:
                wide.append((slot["ws"] + k, chunks[k][0]))
            if where == "chunks":
                _, grid, template = chunks[k]
                after.append((_engine.Launched(_sum_chunks_function(info), grid,
                                               (_launch.BLOCK,), 0, template, SUM_CHUNKS.slot),
                              ((SUM_CHUNKS.slot["ws"], slot["ws"] + k),),
                              ((SUM_CHUNKS.slot["out"], k + 1),)))
        scratch = _engine.Regions()
        if nblocks > 1 and scalars:
            scratch.add("partials", (k_ops + 1) * nblocks)
        return Plan(
            _engine.Launched(function, cfg.grid, cfg.block, cfg.shared, words, slot),
            tuple((slot["in"] + k, k) for k in range(k_ops) if shapes[k] is not None),
            tuple(outputs), info.acc, scratch, scratch.size, bool(scratch.size),
            after=tuple(after),
            numbers=tuple((slot["fill"] + k, k) for k in range(k_ops) if shapes[k] is None),
            wide=tuple(wide), col_tickets=slot["col_tickets"] if "fused" in grads else -1,
            ticket_slots=("o.partials", "o.ticket"), rest=rest, out_shape=out_shape,
            grads=tuple(grads), value=reduced and want_value, loss=not reduced and want_value)

    def chunked(nchunks, cols):
        cfg = _pointwise_launch.sum_chunks_launch(cols, limits)
        return (nchunks * cols, cfg.grid,
                SUM_CHUNKS.template({"chunks": nchunks, "cols": cols}))

    if len(shape) == 2 and n > 0:
        rows, cols = shape
        kinds = []
        for k in range(k_ops):
            st = cstrides[k]
            if modes[k] == "fill" or (modes[k] == "scalar" and st == (0, 0)):
                kinds.append(KIND_SCALAR)
            elif modes[k] == "direct" and st == (cols, 1):
                kinds.append(KIND_FULL)
            elif modes[k] == "bcast" and st == (0, 1) and math.prod(viewed[k]) == cols:
                kinds.append(KIND_ROW)
            else:
                kinds.append(None)
        if (None not in kinds and KIND_ROW in kinds   # every broadcast operand is a row
                and (go_layout is None or cstrides[k_ops] == (cols, 1))
                and cols % info.vec == 0 and aligned):   # else the reduce kernel takes it
            vec = info.vec
            # The operands that are not full (rows, scalars, absent): compiled into the kernel.
            # The loss alone has its own instantiation, faster than the gradient kernel's
            # (docs/tuning.md, "pointwise_rows' waves").
            const = sum(1 << k for k, kind in enumerate(kinds) if kind != KIND_FULL)
            name = _source.pointwise_name("rows", info.ctype, functor, vec, any(want_grads),
                                          const)
            shared = _pointwise_launch.rows_shared(vec)
            # The loss alone, reduced to 0-d, takes the split value_and_grad takes (the gradient
            # kernel's residency, one wave), so both add the loss up in the same order: the
            # value-only kernel's own split (more resident blocks, ROWS_WAVES_VALUE waves) gave
            # kl_div sums one ulp apart from value_and_grad's.
            sized = (name if any(want_grads) or not reduced else
                     _source.pointwise_name("rows", info.ctype, functor, vec, True, const))
            summed = any(want_grads) or reduced
            knob = _tuning.values(limits.gpu)
            cfg = _pointwise_launch.rows_launch(rows, cols, vec, limits, _resident(sized, shared, limits),
                                      1 if summed else knob["ROWS_WAVES_VALUE"],
                                      knob["ROWS_TX_SUMMED"] if summed else _launch.BLOCK)
            layout = rows_layout(k_ops, spec.param_words)
            words = layout.template({**common, "kind": kinds, "rows": rows, "cols": cols,
                                     "rows_per_block": cfg.rows_per_block, "tx": cfg.tx})
            grads, chunks = [None] * k_ops, [None] * k_ops
            for k in range(k_ops):
                if not want_grads[k]:
                    continue
                if kinds[k] == KIND_ROW and cfg.grid[1] > 1 and cfg.grid[0] <= _engine.COL_TICKETS:
                    grads[k] = "fused"      # the kernel's last row blocks add the partials
                    chunks[k] = (cfg.grid[1] * cols, None, None)
                elif kinds[k] == KIND_ROW and cfg.grid[1] > 1:
                    grads[k] = "chunks"
                    chunks[k] = chunked(cfg.grid[1], cols)
                else:
                    grads[k] = "g0" if kinds[k] == KIND_SCALAR else "g"
            scalars = reduced and want_value or "g0" in grads
            function = layout.bind(_source.function("pointwise.cu", name).kernel.ptr)
            return plan(function, cfg, words, layout, grads, chunks, scalars)

    if len(shape) > _launch.MAX_DIMS:  # run_slow makes the operands contiguous and retries
        slow = Plan(None, (), (), info.acc, {}, 0, False, out_shape=out_shape)
        slow.slow = True
        return slow
    grads = [None] * k_ops
    for k in range(k_ops):
        if want_grads[k]:
            grads[k] = {"direct": "g", "scalar": "g0"}.get(modes[k], "zeros" if n == 0 else None)
    scalars = reduced and want_value or "g0" in grads
    if bcast:
        return _reduce_plan(spec, functor, info, limits, common, out_shape, strides, lead,
                            summed, aligned, grads, scalars, plan, chunked)
    vec = 1
    if (len(shape) == 1 and aligned and all(st[0] in (0, 1) for st in cstrides)
            and "bcast" not in modes):
        vec = info.vec
    grad = any(want_grads)
    # Operands of stride 0 on the vector path (one element, absent): compiled in with gradients
    # where the functor has fixed terms (_source.flat_masks).
    const = sum(1 << k for k in range(k_ops) if not any(cstrides[k])) if grad and vec > 1 else 0
    if const not in _source.flat_masks(functor):
        const = 0
    name = _source.pointwise_name("flat", info.ctype, functor, vec, grad, const)
    cfg = _launch.flat_launch(n, vec, limits, _resident(name, 0, limits),
                              _tuning.value("FLAT_STEPS_GRAD" if grad else "FLAT_STEPS_VALUE",
                                            limits.gpu))
    layout = flat_layout(k_ops, spec.param_words)
    geo = _launch.geometry(shape, cstrides, k_ops + 1)
    words = layout.template({**common, "geo": _args.struct_words(geo), "n": n})
    function = layout.bind(_source.function("pointwise.cu", name).kernel.ptr)
    return plan(function, cfg, words, layout, grads, [None] * k_ops, scalars)


def _reduce_plan(spec, functor, info, limits, common, out_shape, strides, lead, summed, aligned,
                 grads, scalars, plan, chunked) -> Plan:
    """The pointwise_reduce plan split by the broadcast pattern of operand `lead`, summing the
    gradients of operands `summed` (broadcast like it; none for the loss alone) in the pass
    that delivers every other output."""
    k_ops = len(spec.operands)
    # The flat index of the broadcast shape travels as one more operand (where the loss and
    # full-size gradients go), so it coalesces with the others.
    shape, cstrides = _launch.coalesce(out_shape, strides + [_contiguous_strides(out_shape)])
    split = _pointwise_launch.split_reduced(shape, cstrides, lead)
    # VEC-element steps along the innermost dim: each operand there has stride 1 (read as
    # aligned vectors: its other strides are whole vectors) or 0 (one element).
    vec = 1
    if (split.inner_reduced and aligned and split.inner % info.vec == 0
            and all(st[-1] == 0 or (st[-1] == 1 and all(s % info.vec == 0 for s in st[:-1]))
                    for st in cstrides)):
        vec = info.vec
    # The operands read once per unit: broadcast along every reduced dim (the lead operand
    # always), or absent (a zero stride everywhere): compiled into the kernel.
    const = sum(1 << k for k in range(k_ops) if not any(split.red_strides[k]))
    name = _source.pointwise_reduce_name(info.ctype, functor, vec, const)
    cfg = _pointwise_launch.reduce_launch(split, vec, limits, _resident(name, 0, limits))
    layout = reduce_layout(k_ops, spec.param_words)
    kept = _launch.geometry(split.kept, split.kept_strides, k_ops + 2)
    red = _launch.geometry(split.red, split.red_strides, k_ops + 2)
    words = layout.template({**common, "kept": _args.struct_words(kept),
                             "red": _args.struct_words(red), "n_o": split.n_o,
                             "n_m": split.n_m, "chunk": cfg.chunk, "nchunks": cfg.nchunks,
                             "lanes_m": cfg.lanes_m,
                             "reduced": sum(1 << k for k in summed)})
    chunks = [None] * k_ops
    units_o = _launch._cdiv(split.n_o, _launch.WARP // cfg.lanes_m)
    for k in summed:
        if cfg.nchunks > 1 and units_o <= _engine.COL_TICKETS:
            grads[k] = "fused"      # the unit finishing an o's chunks last adds them
            chunks[k] = (cfg.nchunks * split.n_o, None, None)
        elif cfg.nchunks > 1:
            grads[k] = "chunks"
            chunks[k] = chunked(cfg.nchunks, split.n_o)
        else:
            grads[k] = "g"
    function = layout.bind(_source.function("pointwise.cu", name).kernel.ptr)
    return plan(function, cfg, words, layout, grads, chunks, scalars)


def _sum_chunks_function(info) -> int:
    return SUM_CHUNKS.bind(
        _source.function("reduce.cu", _source.reduce_name("sum_chunks", info.ctype)).kernel.ptr)


def _operands(spec, frame, arrays):
    """(first operand, operands, layouts, pointer bits) of any number of arrays; None and numbers
    (floats) pass through with layout None.  Every framework is compared before any is read."""
    names = spec.operands
    first = arrays[0]
    for k in range(1, len(arrays)):
        a = arrays[k]
        if a is not None and a.__class__ is not float and a.__class__ is not first.__class__:
            _dispatch.check_same_frame(frame, first, a, names[0], names[k])
    x = frame.operand(first, names[0])
    ops = [x]
    layouts = [(x.shape, x.strides)]
    bits = x.ptr
    for k in range(1, len(arrays)):
        a = arrays[k]
        if a is None or a.__class__ is float:
            ops.append(a)
            layouts.append(None)
            continue
        op = frame.operand(a, names[k])
        if op.dtype != x.dtype:
            _validate.check_same_dtype(x, op, names[0], names[k])
        if op.device != x.device:
            _validate.check_same_device(x, op, names[0], names[k])
        ops.append(op)
        layouts.append((op.shape, op.strides))
        bits |= op.ptr
    return x, ops, tuple(layouts), bits


def evaluate(spec: LossSpec, arrays, *, reduction: str, params: tuple, want_value: bool,
             want_grads: tuple, grad_output=1.0):
    """[loss or None, then per operand its gradient or None]: the loss and the gradients of the
    operands with a true `want_grads` entry, from one pass.

    arrays: one entry per spec.operands, each an array, None (an optional operand left out) or
    a float (a number standing for an array; no gradient).  params: the functor's options in
    the order of spec.params.  Arrays come from and go back to the caller's framework (see
    _dispatch).  The hot path of every call: keep it lean.
    """
    names = spec.operands
    first = arrays[0]
    frame = _dispatch.frame_of(first, names[0])
    if spec.fixed and len(arrays) == 2:  # most losses: input and target, straight through
        t = arrays[1]
        if t.__class__ is not first.__class__:   # frameworks compared before any is read
            _dispatch.check_same_frame(frame, first, t, names[0], names[1])
        x = frame.operand(first, names[0])
        op = frame.operand(t, names[1])
        dtype, device = x.dtype, x.device
        if op.dtype != dtype:
            _validate.check_same_dtype(x, op, names[0], names[1])
        if op.device != device:
            _validate.check_same_device(x, op, names[0], names[1])
        ops = (x, op)
        layouts = ((x.shape, x.strides), (op.shape, op.strides))
        bits = x.ptr | op.ptr
    else:
        x, ops, layouts, bits = _operands(spec, frame, arrays)
        dtype, device = x.dtype, x.device
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    go_kind, go_value, go = "host", 1.0, None
    go_shape = go_strides = None
    if True in want_grads:
        go_kind, go_value, go = _dispatch.classify_grad_output(frame, grad_output, dtype, device)
        if go is not None:
            go_shape, go_strides = go.shape, go.strides
            bits |= go.ptr
    key = (spec.name, reduction, params, want_value, want_grads, go_kind, go_shape, go_strides,
           layouts, dtype, not (bits & 15), device, False)   # Key's fields
    return _engine.execute(FAMILY, key, device, frame, frame.stream(device), (ops, go, go_value))



def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _copies(frame, stream, key, state):
    """Where the plan has more than MAX_DIMS dims after coalescing: contiguous copies (one dim
    each; results still allocated like the caller's arrays) and their key.  Else (another
    current device) the operands as they are."""
    plan = _PLANS.get(key)
    if plan is None or not plan.slow:
        return key, state, None
    ops, go, go_value = state
    copies, keep = [], []
    for name, op in zip(SPECS[key[0]].operands, ops):
        if op is None or type(op) is float:
            copies.append(op)
        else:
            copy, kept = _engine.contiguous_input(frame, op, name)
            copies.append(copy)
            keep.append(kept)
    go_shape = go_strides = None
    go_kind = "host"
    bits = 0
    if go is not None:
        go = _engine.contiguous(frame, go, "grad_output")
        go_kind = "device" if go.shape == () else "array"
        go_shape, go_strides, bits = go.shape, go.strides, go.ptr
    layouts = []
    for op in copies:
        if op is None or type(op) is float:
            layouts.append(None)
        else:
            bits |= op.ptr
            layouts.append((op.shape, op.strides))
    key = Key._make(key)._replace(go_kind=go_kind, go_shape=go_shape, go_strides=go_strides,
                                  layouts=tuple(layouts), aligned=not (bits & 15), copied=True)
    return key, (copies, go, go_value), (keep, go)


FAMILY = _engine.Family(_PLANS, _build, _copies)
