"""The engine behind ctc_loss: a dynamic program over time and the extended labels (kernels/ctc.cu).

`evaluate` is the one entry point.  log_probs comes in through `_dispatch` as an Operand, read
in place with any strides; targets and lengths are class-index arrays on the device
(`_engine.target_operand`), or host values (Python sequences, NumPy arrays, CPU tensors),
which are checked here with torch's errors and copied to the device in one transfer (no sync:
a host-to-device copy from pageable memory is staged at once).  Lengths on the device are
checked there: a sequence whose lengths or labels are out of range gets a NaN loss and
gradient (reading them back would synchronise).

A plan is up to four launches of one parameter list (ctc_alpha; ctc_finish for 'mean'/'sum';
ctc_beta and ctc_grad for the gradient) whose later launches take ctc_alpha's words: a call
allocates its results and the scratch (nll per sequence; with a gradient alpha per step and
position, which ctc_beta turns into alpha + beta, and each sequence's label groups) and
launches.  Nothing is read back to the host.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy

from cupyloss._core import (
    args as _args, dispatch as _dispatch, dtypes as _dtypes, engine as _engine,
    launch as _launch, plans as _plans, reduction as _reduction, source as _source)
from cupyloss._core.engine import Launched, Plan
from cupyloss.ctc import _launch as _ctc_launch

(FLAG_CONCAT, FLAG_TG_INT32, FLAG_IL_INT32, FLAG_TL_INT32, FLAG_ZERO_INFINITY, FLAG_GO_DEVICE,
 FLAG_GO_ROWS, FLAG_KEEP_ALPHA, FLAG_MEAN) = _source.constants(
    "ctc.cu", "CTC_CONCAT", "CTC_TG_INT32", "CTC_IL_INT32", "CTC_TL_INT32", "CTC_ZERO_INFINITY",
    "CTC_GO_DEVICE", "CTC_GO_ROWS", "CTC_KEEP_ALPHA", "CTC_MEAN")

_I32, _I64 = _engine.INDEX_DTYPES
_WORD = numpy.dtype(numpy.float64)   # host values travel as 8-byte words (int64 bits)


@dataclasses.dataclass(frozen=True)
class CtcSpec:
    """The registry entry of ctc_loss (the adapters read arrays, reductions, differentiable,
    loss_shape; `sequences`: the arrays a caller may give as Python sequences of ints, which the
    torch adapter turns into CPU tensors)."""

    name: str = "ctc_loss"
    arrays: tuple = ("log_probs", "targets", "input_lengths", "target_lengths")
    differentiable: tuple = ("log_probs",)
    reductions: tuple = ("none", "mean", "sum")
    sequences: tuple = ("input_lengths", "target_lengths")
    source: str = "ctc.cu"

    def loss_shape(self, input_shape: tuple, reduction: str) -> tuple:
        """() when reduced or unbatched, else (N,) of log_probs' (T, N, C)."""
        if reduction != "none" or len(input_shape) != 3:
            return ()
        return (input_shape[1],)


SPECS = {"ctc_loss": CtcSpec()}

# The kernels' one parameter list, named as kernels/ctc.cu names it.
LAYOUT = _args.Layout(_source.kernel_words("ctc.cu", "ctc_alpha"))
# Words a later launch takes from ctc_alpha's: every pointer, and grad_output's number.
_WIRED = tuple(sorted(LAYOUT.pointers)) + (LAYOUT.slot["go_value"],)
_ONE = _args.f64_word(1.0)

_PLANS = _plans.Plans()


class Key(NamedTuple):
    """What a CTC plan depends on: the plan cache's key, passed whole to _build."""

    reduction: str
    want_value: bool
    want_grad: bool
    go_kind: str             # "host", "device" (0-d) or "array" (per sequence)
    go_s: int                # a per-sequence grad_output's element stride
    dtype: object
    shape: tuple             # log_probs' (T, N, C) (unbatched: N = 1)
    batched: bool
    lp_strides: tuple        # (t, n, c) element strides
    concat: bool
    tg: tuple                # targets: (dtype, n stride, label stride, length S or sum(tl))
    lengths: tuple           # (input_lengths' dtype, stride, target_lengths' dtype, stride)
    blank: int
    zero_infinity: bool
    lcap: int                # shared-memory positions: every 2 tl + 1 at most
    device: int


def _host(frame, x):
    """x as a NumPy array when it is host data (a number, a sequence, a NumPy array, a CPU
    tensor), else None (an array on the device)."""
    if isinstance(x, (int, numpy.integer)) and not isinstance(x, bool):
        return numpy.asarray(x)
    if isinstance(x, (list, tuple, numpy.ndarray)):
        return numpy.asarray(x)
    if frame.name in ("torch", "torch-dlpack") and type(x).__module__.startswith("torch") \
            and getattr(x, "device", None) is not None and x.device.type == "cpu":
        return x.numpy()
    return None


def _integral(values: numpy.ndarray, name: str) -> numpy.ndarray:
    if values.dtype.kind not in "iu" and not (values.size == 0 and values.dtype.kind == "f"):
        raise TypeError(f"{name} must be integral, got dtype {values.dtype}")
    return values.astype(numpy.int64)


def _check_host_lengths(values, name, n, upper):
    """torch's checks of host lengths: N of them, each in [0, upper] (upper None: unbounded)."""
    if values.shape != (n,):
        raise ValueError(f"{name} must be of size batch_size")
    if n and values.min() < 0:
        raise ValueError(f"Expected {name} to have value at least 0, but got value "
                         f"{int(values.min())} (while checking arguments for ctc_loss)")
    if upper is not None and n and values.max() > upper:
        raise ValueError(f"Expected {name} to have value at most {upper}, but got value "
                         f"{int(values.max())} (while checking arguments for ctc_loss)")


def evaluate(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
             zero_infinity=False, *, want_value=True, want_grad=False, grad_output=1.0):
    """[loss or None, log_probs' gradient or None] of one call (see cupyloss.ctc_loss for the
    arguments).  Arrays come from and go back to the caller's framework (see _dispatch)."""
    frame = _dispatch.frame_of(log_probs, "log_probs")
    lp = frame.operand(log_probs, "log_probs")
    dtype, device = lp.dtype, lp.device
    if len(lp.shape) not in (2, 3):
        raise ValueError(f"Expected 3-dimensional tensor, but got {len(lp.shape)}-dimensional "
                         f"tensor for argument #1 'log_probs' (while checking arguments for "
                         f"ctc_loss)")
    batched = len(lp.shape) == 3
    steps, classes = lp.shape[0], lp.shape[-1]
    n = lp.shape[1] if batched else 1
    if not (isinstance(blank, (int, numpy.integer)) and 0 <= blank < classes):
        raise ValueError("blank must be in label range")
    if reduction not in SPECS["ctc_loss"].reductions:
        _reduction.check_reduction(reduction, SPECS["ctc_loss"].reductions)
    # The integer arguments: host values (checked here) or device arrays (checked there).
    ops, hosts = {}, {}
    for name, x in (("targets", targets), ("input_lengths", input_lengths),
                    ("target_lengths", target_lengths)):
        values = _host(frame, x)
        if values is not None:
            hosts[name] = _integral(values, name)
            continue
        _dispatch.check_same_frame(frame, log_probs, x, "log_probs", name)
        op, is_index = _engine.target_operand(frame, x)
        if not is_index:
            raise TypeError(f"{name} must be integral (int32 or int64), got dtype {op.dtype}")
        if op.device != device:
            raise ValueError(f"log_probs is on CUDA device {device} but {name} is on CUDA "
                             f"device {op.device}; move them to one device")
        ops[name] = op
    shapes = {k: tuple(v.shape) for k, v in {**ops, **hosts}.items()}
    want_len = (n,) if batched else ()
    for name in ("input_lengths", "target_lengths"):
        if shapes[name] != want_len and not (not batched and shapes[name] == (1,)):
            raise ValueError(f"{name} must be of size batch_size")
    tg_shape = shapes["targets"]
    if batched and len(tg_shape) not in (1, 2) or not batched and len(tg_shape) != 1:
        raise ValueError(f"Expected 1 to 2 dimensions, but got {len(tg_shape)}-dimensional "
                         f"tensor for argument #2 'targets' (while checking arguments for "
                         f"ctc_loss)")
    concat = len(tg_shape) == 1         # unbatched targets too: torch takes all of them
    if batched and not concat and tg_shape[0] != n:
        raise ValueError(f"Expected tensor to have size {n} at dimension 0, but got size "
                         f"{tg_shape[0]} for argument #2 'targets' (while checking arguments for "
                         f"ctc_loss)")
    tg_len = tg_shape[-1]
    il_host, tl_host = hosts.get("input_lengths"), hosts.get("target_lengths")
    if il_host is not None:
        _check_host_lengths(il_host.reshape(-1), "input_lengths", n, steps)
    limit = _ctc_launch.max_positions(dtype, _launch.device_limits(device))
    if tl_host is not None:
        tl_flat = tl_host.reshape(-1)
        _check_host_lengths(tl_flat, "target_lengths", n, None)
        longest = int(tl_flat.max()) if n else 0
        if concat and int(tl_flat.sum()) != tg_len:
            raise ValueError(f"Expected tensor to have size {int(tl_flat.sum())} at dimension 0, "
                             f"but got size {tg_len} for argument #2 'targets' (while checking "
                             f"arguments for ctc_loss)")
        if not concat and longest > tg_len:
            raise ValueError(f"Expected tensor to have size at least {longest} at dimension "
                             f"{1 if batched else 0}, but got size {tg_len} for argument #2 "
                             f"'targets' (while checking arguments for ctc_loss)")
        if 2 * longest + 1 > limit:
            raise ValueError(f"ctc_loss takes targets of at most {(limit - 1) // 2} labels for "
                             f"{dtype} log_probs on this GPU (2 S + 1 positions in shared "
                             f"memory), got a target of {longest}")
    else:
        longest = tg_len
    lcap = min(_ctc_launch.round_positions(2 * longest + 1), limit)
    if hosts:
        ops.update(_to_device(frame, hosts, log_probs, device))
    tg, il, tl = ops["targets"], ops["input_lengths"], ops["target_lengths"]
    tg_strides = tuple(tg.strides) if tg.shape else (0,)
    key = Key(reduction, bool(want_value), bool(want_grad), "host", 0, dtype,
              (steps, n, classes), batched,
              tuple(lp.strides) if batched else (lp.strides[0], 0, lp.strides[1]), concat,
              (tg.dtype, tg_strides[0] if batched and not concat else 0, tg_strides[-1], tg_len),
              (il.dtype, il.strides[0] if il.shape else 0, tl.dtype,
               tl.strides[0] if tl.shape else 0),
              int(blank), bool(zero_infinity), lcap, device)
    go, go_value = None, 1.0
    if want_grad:
        loss_shape = (n,) if batched and reduction == "none" else ()
        go_kind, go_value, go = _dispatch.classify_grad_output(frame, grad_output, dtype, device,
                                                               loss_shape, reduction)
        key = key._replace(go_kind=go_kind,
                           go_s=go.strides[0] if go_kind == "array" and go.shape else 0)
    stream = frame.stream(device)
    return _engine.execute(FAMILY, tuple(key), device, frame, stream,
                           ((lp, tg, il, tl), go, go_value))


def _to_device(frame, hosts: dict, like, device: int) -> dict:
    """Operands on the device for the host values in `hosts` (name -> int64 NumPy array), all
    in one allocation of the caller's framework, filled by one copy on its stream."""
    import cupy

    names = list(hosts)
    if cupy.cuda.runtime.streamIsCapturing(frame.stream(device)):
        raise RuntimeError(f"ctc_loss: {', '.join(names)} given on the host cannot be copied to "
                           f"the GPU inside a CUDA graph capture; pass them as CUDA arrays")
    flat = numpy.concatenate([hosts[k].reshape(-1) for k in names] or [numpy.zeros(0, "i8")])
    words, ptr = frame.empty((max(1, flat.size),), _WORD, like)
    if flat.size:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.memcpyAsync(ptr, flat.ctypes.data, flat.nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice,
                                          frame.stream(device))
    out, at = {}, 0
    for k in names:
        shape = hosts[k].shape
        out[k] = _dispatch.Operand(ptr + 8 * at, shape, tuple(
            int(s) // 8 for s in numpy.empty(shape, "i8").strides), _I64, device, words)
        at += hosts[k].size
    return out


def _build(key) -> Plan:
    key = Key._make(key)
    info = _dtypes.DTYPES[key.dtype]
    acc = info.acc
    steps, n, classes = key.shape
    limits = _launch.device_limits(key.device)
    cfg = _ctc_launch.ctc_launch(key.lcap, acc.itemsize, limits)
    grad = key.want_grad
    flags = (FLAG_CONCAT if key.concat else 0) | (FLAG_ZERO_INFINITY if key.zero_infinity else 0)
    flags |= FLAG_TG_INT32 if key.tg[0] == _I32 else 0
    flags |= FLAG_IL_INT32 if key.lengths[0] == _I32 else 0
    flags |= FLAG_TL_INT32 if key.lengths[2] == _I32 else 0
    flags |= FLAG_MEAN if key.reduction == "mean" else 0
    flags |= FLAG_KEEP_ALPHA if grad else 0
    flags |= {"host": 0, "device": FLAG_GO_DEVICE, "array": FLAG_GO_ROWS}[key.go_kind]
    tg_dtype, tg_sn, tg_ss, tg_len = key.tg
    values = {"steps": steps, "batch": n, "classes": classes,
              "lp_st": _args.i64_word(key.lp_strides[0]),
              "lp_sn": _args.i64_word(key.lp_strides[1]),
              "lp_sc": _args.i64_word(key.lp_strides[2]), "tg_sn": _args.i64_word(tg_sn),
              "tg_ss": _args.i64_word(tg_ss), "tg_len": tg_len,
              "il_s": _args.i64_word(key.lengths[1]), "tl_s": _args.i64_word(key.lengths[3]),
              "blank": key.blank, "lcap": key.lcap, "row": key.lcap, "flags": flags,
              "go_s": _args.i64_word(key.go_s), "go_value": _ONE}
    words = LAYOUT.template(values)
    ctype = info.ctype

    def launched(kernel, grid, block, shared):
        function = LAYOUT.bind(_source.function("ctc.cu", _source.ctc_name(kernel, ctype))
                               .kernel.ptr)
        return Launched(function, grid, block, shared, words, LAYOUT.slot)

    _source.resident("ctc.cu", _source.ctc_name("ctc_alpha", ctype), cfg.shared, cfg.block)
    main = launched("ctc_alpha", (max(1, n),), (cfg.block,), cfg.shared)
    slot = LAYOUT.slot
    scratch = _engine.Regions()
    scratch.add("nll", max(1, n))
    regions = [(slot["nll"], "nll")]
    if grad:
        kept = (steps * (2 * tg_len + n) if key.concat else n * steps * key.lcap)
        scratch.add("alpha", max(1, kept))
        regions.append((slot["alpha"], "alpha"))
        ints = _ctc_launch.group_ints(n, key.lcap)
        scratch.add("groups", -(-ints * 4 // acc.itemsize))    # ints, in accumulator slots
        regions.append((slot["groups"], "groups"))
    wires = tuple((w, w) for w in _WIRED)
    after = []
    reduced = key.reduction != "none"
    if key.want_value and reduced:
        after.append((launched("ctc_finish", (1,), (_ctc_launch.FINISH_BLOCK,), 0), wires, ()))
    if grad:
        _source.resident("ctc.cu", _source.ctc_name("ctc_beta", ctype), cfg.shared, cfg.block)
        after.append((launched("ctc_beta", (max(1, n),), (cfg.block,), cfg.shared), wires, ()))
        grid = _ctc_launch.grad_grid(steps * n, limits)
        after.append((launched("ctc_grad", (grid,), (_ctc_launch.GRAD_BLOCK,), 0), wires, ()))
    out = None
    if key.want_value:
        out = ((slot["value"], (), key.dtype, "empty") if reduced
               else (slot["loss"], (n,) if key.batched else (), key.dtype, "empty"))
    lp_shape = (steps, n, classes) if key.batched else (steps, classes)
    outputs = (out, (slot["grad"], lp_shape, key.dtype, "empty") if grad else None)
    return Plan(main, ((slot["lp"], 0), (slot["targets"], 1), (slot["input_lengths"], 2),
                       (slot["target_lengths"], 3)), outputs, acc, scratch, scratch.size, False,
                main_regions=tuple(regions), after=tuple(after))


def _copies(frame, stream, key, state):
    """Nothing to copy: every operand is read with its strides."""
    return key, state, ()


FAMILY = _engine.Family(_PLANS, _build, _copies)
