"""JAX versions of every cupyloss loss, differentiable with jax.grad and usable under jax.jit.

    import cupyloss.jax as JL
    jax.jit(jax.grad(lambda a, b: JL.mse_loss(a, b)))(a, b)
    jax.value_and_grad(JL.kl_div, argnums=(0, 1))(jnp.log(p), q, "batchmean")

Generated from cupyloss's registry of every family (`cupyloss._core.registry.all_losses()`: the
pointwise, row-wise, row-class and row-pair losses) when this module is imported: each
loss ``f`` is ``cupyloss.jax.f`` with the core function's signature (``f(input, target, ...,
reduction=...)``), so a loss registered later needs no code here.  A registered loss that cannot
be wrapped is left out with a RuntimeWarning and its reason in ``cupyloss.jax.SKIPPED``.

How it runs: each call is a ``jax.experimental.buffer_callback`` (JAX 0.7 or later): under jit
it is a node of the XLA program that hands the callback XLA's device buffers and XLA's CUDA
stream, and the kernels are launched on that stream, so the loss is ordered with the rest of
the program and the host never waits.  Inputs are read in place and the kernels write their
results straight into XLA's result buffers (_dispatch.GivenFrame); the few bytes of scratch a
call needs (per-block partial sums, counters) are one more XLA result of the callback.  When a
call is traced, the engine runs it once on every GPU JAX has, on fake addresses, its launches
recorded rather than made (and anything else captured into a CUDA graph that is thrown away):
that sizes the scratch, compiles the kernels, and gives each GPU a record that later calls
replay with their own addresses, without the engine or its checks (they ran when tracing).
Nothing comes from CuPy's memory pool, so JAX's default preallocation (75% of the GPU) needs no
setting; the only memory outside XLA's is the last-block tickets, 4 MiB a GPU, allocated once.
Inside ``jax.shard_map`` each device runs its shard on its own stream; the results vary over
the mesh axes their arguments vary over, to be combined with ``jax.lax.pmean`` or ``psum`` as
jnp's would (JAX refuses symbolic zeros there, so every floating argument gets its gradient,
and the array options weight and pos_weight a zero one).

Gradients (jax.custom_vjp, symbolic_zeros=True, so only the arguments being differentiated get
one): for a reduced loss the forward pass runs value_and_grad once and the backward multiplies
the saved gradients by the cotangent (a constant 1 under jax.grad, which XLA folds away); for
reduction='none' the backward runs the gradient kernel with the elementwise cotangent.  vmap
runs the callback once per batch element.  Arguments must be CUDA arrays of one floating dtype
(float16, bfloat16, float32, float64), except class indices (int32 or int64: values work,
jax.grad refuses integer arguments as it does everywhere); options are static Python values,
except array options (weight, pos_weight), which are operands without a gradient.
"""

from __future__ import annotations

import array
import functools
import inspect
import math
import sys
import threading
import warnings

try:
    import jax
except ImportError as exc:
    raise ImportError(f"cupyloss.jax needs JAX, which is not installed "
                      f"({exc}): pip install 'cupyloss[jax]'") from exc
import jax.numpy as jnp
import numpy

import cupyloss
from cupyloss._core import (
    dispatch as _dispatch, dtypes as _dtypes, validate as _validate)
from cupyloss._core import engine as _core_engine
from cupyloss._core.registry import all_losses, unwrappable

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:  # pragma: no cover - JAX older than 0.7
    raise ImportError(f"cupyloss.jax needs jax.experimental.buffer_callback (JAX 0.7 or later); "
                      f"this JAX is {jax.__version__}") from exc

_KDLCUDA = 2

# Every registered loss of every family (cupyloss._core.registry.all_losses).
SPECS = all_losses()


class _Kernels:
    """What the callbacks run: cupyloss's functions on views of XLA's buffers, their results
    placed in XLA's result buffers and their scratch carved from one XLA-allocated buffer
    (_dispatch.Region); each call signature measured once when traced (`measure`), by a run
    whose launches are recorded, and later calls replaying that record (`replay`)."""

    def __init__(self):
        self.copies = 0         # results copied into XLA's buffer instead of written there
        self.pooled = 0         # allocations that fell back to CuPy's pool
        self._streams = threading.local()   # .by_ordinal: this thread's measuring streams
        self._external = {}     # (XLA's stream, device) -> its cupy.cuda.Stream
        self._views = {}        # (pointer, shape, dtype, device) -> GivenArray
        self.replayed = 0       # calls made by replaying a traced call's launches
        self.ran = 0            # calls the engine ran

    def view(self, buffer, dtype, device):
        """A GivenArray of `dtype` over an XLA buffer's memory on CUDA device `device` (no
        copy; XLA hands the same addresses out again and again, so views are kept by address,
        shape and dtype).  bfloat16 travels as uint16 (`_call`): __cuda_array_interface__
        cannot spell it, and reading an address through DLPack waits for XLA's stream."""
        ptr = buffer.__cuda_array_interface__["data"][0]
        key = (ptr, buffer.shape, dtype, device)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 256:
                self._views.clear()
            view = self._views[key] = _dispatch.given_view(ptr, buffer.shape, dtype, device)
        return view

    def call(self, ctx, first, outs, dtypes, scratch):
        """The context of one callback: XLA's stream and its device current for CuPy, and the
        engine's results placed in XLA's result buffers `outs` (of `dtypes`) with its scratch
        carved from the byte buffer `scratch` (None for none).  Entering gives the device and
        the targets `place` fills."""
        import cupy

        self.ran += 1
        device = _cuda_device(first)
        key = (ctx.stream, device)
        stream = self._external.get(key)
        if stream is None:
            with cupy.cuda.Device(device):
                stream = self._external[key] = cupy.cuda.Stream.from_external(
                    _dispatch.RawStream(ctx.stream))
        targets = [self.view(b, d, device) for b, d in zip(outs, dtypes)]
        base, size = (self.view(scratch, _BYTE, device).data.ptr, scratch.shape[0]) \
            if scratch is not None else (0, 0)
        return _Call(self, cupy.cuda.Device(device), stream,
                     _dispatch.Region(targets, base, size, device))

    def place(self, target, result) -> None:
        """Make sure XLA's buffer `target` holds `result`: written there by the kernels, or else
        copied (counted in `copies`)."""
        import cupy

        if result.size == 0 or result.data.ptr == target.data.ptr:
            return
        if target.shape != result.shape or target.dtype != result.dtype:
            raise ValueError(f"cupyloss.jax: the kernels gave {result.dtype}{result.shape} for "
                             f"a result declared {target.dtype}{target.shape}")
        self.copies += 1
        cupy.cuda.runtime.memcpyAsync(target.data.ptr, result.data.ptr, result.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    def measure(self, run, arrays, results):
        """(the scratch bytes `run(views)` needs for arguments and results of these shapes and
        dtypes, {CUDA ordinal: its replay or None}).  On every GPU JAX has, one run on fake
        addresses (a dry Region) with the engines' launches recorded (_dispatch.recording) and
        anything else captured into a CUDA graph that is thrown away; scratch is the most any
        GPU needed.  A run whose every effect was recorded (its graph is empty) and whose results
        went into the result buffers becomes that GPU's replay (`replay`).  Plans are built and
        kernels compiled on the way, so the first real call finds them."""
        import cupy

        need, replays = 0, {}
        streams = getattr(self._streams, "by_ordinal", None)
        if streams is None:
            streams = self._streams.by_ordinal = {}
        for ordinal in _ordinals():
            with cupy.cuda.Device(ordinal), _MEASURING:
                stream = streams.get(ordinal)
                if stream is None:
                    stream = streams[ordinal] = cupy.cuda.Stream(non_blocking=True)
                tickets = (_core_engine.ticket(ordinal, stream.ptr),   # before the capture
                           _core_engine.col_tickets(ordinal, stream.ptr))
                bases = list(_fake_addresses([*arrays, *results]))
                views = [_dispatch.given_view(b, a.shape, a.dtype, ordinal)
                         for b, a in zip(bases, arrays)]
                outs = [_dispatch.given_view(b, r.shape, r.dtype, ordinal)
                        for b, r in zip(bases[len(arrays):], results)]
                region = _dispatch.Region(outs, bases[-1], 0, ordinal, dry=True)
                ran = _captured(stream, run, views, region)
                if ran is None:
                    return 0, {}
                got, empty = ran
            need = max(need, region.used)
            placed = len(got) == len(outs) and all(
                g.data.ptr == o.data.ptr for g, o in zip(got, outs))
            replays[ordinal] = _replay(region.ops, bases, tickets) if empty and placed else None
        return need, replays

    def replay(self, ctx, buffers, outs, replays) -> bool:
        """Make the launches of `replays`' entry for this device with this call's addresses
        (no engine, no validation: both ran when the call was traced): True, or False where
        there is none or an address is not 16-byte aligned as the traced plans assume."""
        from cupyloss._core import args as _args

        device = _cuda_device(buffers[0])
        ops = replays.get(device)
        if ops is None:
            return False
        ptrs = [b.__cuda_array_interface__["data"][0] for b in buffers]
        ptrs += [o.__cuda_array_interface__["data"][0] for o in outs]
        bits = 0
        for p in ptrs:
            bits |= p
        if bits & 15:
            return False
        stream = ctx.stream
        ptrs.append(_core_engine.ticket(device, stream))
        ptrs.append(_core_engine.col_tickets(device, stream))
        runtime = _runtime()
        current = runtime.getDevice()
        if current != device:
            runtime.setDevice(device)
        try:
            for op in ops:
                if op[0] == "zeros":
                    runtime.memsetAsync(ptrs[op[1]] + op[2], 0, op[3], stream)
                    continue
                _, function, grid, block, shared, cooperative, template, patches = op
                words = array.array("Q", template)
                for slot, which, offset in patches:
                    words[slot] = ptrs[which] + offset
                (_args.launch_cooperative if cooperative else _args.launch)(
                    function, grid, block, shared, stream, words)
        finally:
            if current != device:
                runtime.setDevice(current)
        self.replayed += 1
        return True

    def value(self, name, arrays, reduction, options):
        return getattr(cupyloss, name)(*arrays, reduction=reduction, **options)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        return getattr(cupyloss, name + "_value_and_grad")(*arrays, reduction=reduction,
                                                           wrt=wrt, **options)

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        return getattr(cupyloss, name + "_backward")(grad_output, *arrays, reduction=reduction,
                                                     wrt=wrt, **options)


class _Call:
    """_Kernels.call's context: device, stream and Region entered and left together."""

    __slots__ = ("kernels", "device", "stream", "region", "given")

    def __init__(self, kernels, device, stream, region):
        self.kernels, self.device, self.stream, self.region = kernels, device, stream, region
        self.given = _dispatch.given(region)

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()
        self.given.__enter__()
        return self.region.device, self.region.outs

    def __exit__(self, *exc):
        self.given.__exit__(*exc)
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)
        self.kernels.pooled += self.region.pooled
        return False


_BYTE = numpy.dtype(numpy.uint8)
# Held by a measuring run from before its capture begins to after it ends: one at a time, so
# that no capture sees another thread's plan building (a first kernel load, a ticket's zeroing).
_MEASURING = threading.Lock()
# What a dtype travels as through the callback: bfloat16 as its bits (see _Kernels.view).
_WIRE = {numpy.dtype(_dtypes._BFLOAT16): numpy.dtype(numpy.uint16)} if _dtypes._BFLOAT16 \
    is not None else {}


def _captured(stream, run, views, region):
    """run(views) in `region`, the engines' launches recorded in region.ops and anything else
    captured on `stream` and thrown away: (what run returned, whether the capture was empty),
    or None with a RuntimeWarning when the run did something capture forbids (a call that reads
    values back, such as an opt-in check: its scratch then comes from CuPy's pool).  Errors of
    the call itself (bad shapes, options) are raised: they surface while tracing."""
    runtime = _runtime()
    from cupy_backends.cuda.api import driver

    with stream:
        runtime.streamBeginCapture(stream.ptr, runtime.streamCaptureModeRelaxed)
        try:
            with _dispatch.given(region), _dispatch.recording(region):
                got = run(views)
        except (runtime.CUDARuntimeError, driver.CUDADriverError) as exc:
            _end_capture(stream)
            warnings.warn(f"cupyloss.jax could not measure this call's scratch ({exc}); it "
                          f"will take its scratch from CuPy's pool", RuntimeWarning,
                          stacklevel=2)
            return None
        except BaseException:
            _end_capture(stream)
            raise
        return got, _end_capture(stream) == 0


def _end_capture(stream):
    """End `stream`'s capture and destroy what it recorded: the number of nodes it had (None
    when it was invalidated or could not be counted)."""
    runtime = _runtime()
    try:
        graph = runtime.streamEndCapture(stream.ptr)
    except runtime.CUDARuntimeError:
        return None
    nodes = _graph_nodes(graph)
    runtime.graphDestroy(graph)
    return nodes


def _graph_nodes(graph):
    """cuGraphGetNodes's count of a CUDA graph's nodes, or None where the driver library cannot
    be reached."""
    import ctypes

    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_size_t(0)
    if library.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)) != 0:
        return None
    return count.value


def _replay(ops, bases, tickets):
    """A recorded call (region.ops) as replay ops, or None where it cannot be one: each address
    word (_args.POINTERS: the kernel's declared pointer parameters and fields) that held an
    address inside one of the call's fake buffers (`bases`: arguments, results, scratch last,
    which ends nowhere) becomes a patch (slot, buffer index, offset), and the measuring stream's
    tickets (`tickets`) the replaying stream's (indices -2 and -1).  A launch of a kernel whose
    address words are not known, or whose other words (a float64 option, a count) hold what
    reads as a fake address, is no replay: such a word is never rewritten, and the engine runs
    those calls instead."""
    from cupyloss._core import args as _args

    spans = [(b, bases[k + 1] if k + 1 < len(bases) else _FAKE_END, k)
             for k, b in enumerate(bases)]
    ticket, col = tickets

    def where(value):
        if value == ticket:
            return -2, 0
        if value == col:
            return -1, 0
        if _FAKE_BASE <= value < _FAKE_END:
            for begin, end, k in spans:
                if begin <= value < end:
                    return k, value - begin
        return None

    out = []
    for op in ops:
        if op[0] == "zeros":
            which, offset = where(op[1])
            out.append(("zeros", which, offset, op[2]))
            continue
        kind, function, grid, block, shared, cooperative, words = op
        pointers = _args.POINTERS.get(function)
        if pointers is None:
            return None
        patches = []
        for slot, value in enumerate(words):
            at = where(value)
            if at is None:
                continue
            if slot not in pointers:
                return None
            patches.append((slot, *at))
            words[slot] = 0
        out.append((kind, function, grid, block, shared, cooperative, words, tuple(patches)))
    return tuple(out)


def _runtime():
    from cupy_backends.cuda.api import runtime

    return runtime


def _ordinals() -> list:
    """The CUDA ordinals of JAX's local GPUs."""
    ordinals = []
    for d in jax.local_devices():
        if d.platform == "gpu":
            ordinal = getattr(d, "local_hardware_id", None)
            ordinals.append(d.id if ordinal is None else ordinal)
    return ordinals


# Where measuring runs' fake buffers lie: far above any device address, and as words read as
# doubles below 1e-300, a value no kernel parameter takes.
_FAKE_BASE, _FAKE_END = 1 << 56, 1 << 57


def _fake_addresses(structs):
    """Addresses no memory is behind, one per struct and one for scratch, ALIGN-aligned and
    apart, that a measuring run's launches name."""
    at = _FAKE_BASE
    for s in structs:
        yield at
        at = _dispatch.carve(at, max(1, math.prod(s.shape)) * numpy.dtype(s.dtype).itemsize)[1]
        at = _dispatch.carve(at, 0)[0]
    yield at


def _cuda_device(buffer) -> int:
    """The CUDA device ordinal of an XLA buffer, or TypeError when it is not on a GPU."""
    kind, device = buffer.__dlpack_device__()
    if kind != _KDLCUDA:
        raise TypeError(f"cupyloss.jax runs on CUDA devices; this array lives on DLPack device "
                        f"type {kind}: put it on a GPU (jax.device_put)")
    return device


# Swapped by the CPU tests for an engine over NumPy views and tests/reference.py.
_engine = _Kernels()


# --- the callbacks -------------------------------------------------------------------------------

def _split(name, options, extra, views):
    """(the required arrays' views, the options with the array options' views added)."""
    n = len(_HEAD_ARRAYS[name] if name in _HEAD_ARRAYS else SPECS[name].arrays)
    return views[:n], {**dict(options), **dict(zip(extra, views[n:]))}


# The fused heads (cupyloss.linear): their required arrays; bias and class_weight are array
# options (`extra`).
_HEAD_ARRAYS = {"linear_cross_entropy": ("hidden", "weight", "target"),
                "linear_log_probs": ("hidden", "weight", "target"),
                "linear_jsd": ("student_hidden", "student_weight", "teacher_hidden",
                               "teacher_weight")}


def _body(kind, name, reduction, options, extra, wrt):
    """run(views) -> the results in declared order, for one kind of call: "value" (the loss),
    "value_and_grad" (the loss, then the gradients of `wrt`) or "backward" (grad_output first
    among the views; the gradients of `wrt`).  linear_log_probs: "value" gives log-probabilities
    and entropy, "backward" takes both of their cotangents first."""
    if name in ("vocab_parallel_stats", "vocab_parallel_backward", "linear_vp_stats",
                "linear_vp_backward"):
        from cupyloss import parallel

        def run(views):
            kw = dict(options)
            classes = kw.pop("classes")
            if name == "linear_vp_stats":
                h, w, t, *b = views
                return [parallel.linear_vocab_parallel_stats(h, w, t, 0, classes, *b, **kw)]
            if name == "linear_vp_backward":
                g, h, w, t, lse, *b = views
                got = parallel.linear_vocab_parallel_backward(g, h, w, t, lse, 0, classes, *b,
                                                              wrt=wrt, **kw)
                return list(got) if isinstance(got, tuple) else [got]
            if name == "vocab_parallel_stats":
                x, t, *w = views
                return [parallel.vocab_parallel_stats(x, t, 0, classes, *w, **kw)]
            g, x, t, lse, *w = views
            return [parallel.vocab_parallel_backward(g, x, t, lse, 0, classes, *w, **kw)]
        return run
    if name == "linear_jsd":
        def run(views):
            arrays, kw = _split(name, options, extra, views)
            if kind == "value":
                return [cupyloss.linear_jsd(*arrays, **kw)]
            loss, grads = cupyloss.linear_jsd_value_and_grad(*arrays, wrt=wrt, **kw)
            return [loss, *((grads,) if len(wrt) == 1 else grads)]
        return run
    if name == "linear_log_probs":
        def run(views):
            if kind == "value":
                arrays, kw = _split(name, options, extra, views)
                return list(cupyloss.linear_log_probs(*arrays, return_entropy=True, **kw))
            g_lp, g_ent = views[:2]
            arrays, kw = _split(name, options, extra, views[2:])
            got = cupyloss.linear_log_probs_backward(g_lp, *arrays, grad_entropy=g_ent, wrt=wrt,
                                                     **kw)
            return list(got)
        return run

    def run(views):
        go = None
        if kind == "backward":
            go, views = views[0], views[1:]
        arrays, kw = _split(name, options, extra, views)
        if kind == "value":
            return [_engine.value(name, arrays, reduction, kw)]
        if kind == "value_and_grad":
            value, grads = _engine.value_and_grad(name, arrays, reduction, kw, wrt)
            return [value, *grads]
        return list(_engine.backward(name, go, arrays, reduction, kw, wrt))

    return run


@functools.lru_cache(maxsize=4096)
def _measured(kind, name, reduction, options, extra, wrt, arrays, results, engine):
    """_engine.measure of one call signature (arrays, results: (shape, dtype) pairs), once:
    (scratch bytes, {CUDA ordinal: replay})."""
    return _engine.measure(_body(kind, name, reduction, options, extra, wrt),
                           [_struct(*a) for a in arrays], [_struct(*r) for r in results])


def _call(kind, name, reduction, options, extra, wrt, arrays, results):
    """The results (jax.Arrays of `results`' shapes and dtypes) of one buffer_callback running
    `kind` on `arrays`; any scratch it needs is one more XLA result, dropped here."""
    run = _body(kind, name, reduction, options, extra, wrt)
    dtypes = [numpy.dtype(a.dtype) for a in arrays]
    out_dtypes = [numpy.dtype(r.dtype) for r in results]
    scratch, replays = _measured(kind, name, reduction, options, extra, wrt,
                                 tuple((tuple(a.shape), d) for a, d in zip(arrays, dtypes)),
                                 tuple((tuple(r.shape), d) for r, d in zip(results, out_dtypes)),
                                 id(_engine))
    structs = tuple(_struct(r.shape, _WIRE.get(d, d)) for r, d in zip(results, out_dtypes))
    structs += (_struct((scratch,), _BYTE),) if scratch else ()
    n = len(results)

    def callback(ctx, out, *buffers):
        engine = _engine
        if replays and engine.replay(ctx, buffers, out, replays):
            return
        with engine.call(ctx, buffers[0], out[:n], out_dtypes,
                         out[n] if scratch else None) as (device, targets):
            got = run([engine.view(b, d, device) for b, d in zip(buffers, dtypes)])
            for target, result in zip(targets, got):
                engine.place(target, result)

    wired = [jax.lax.bitcast_convert_type(a, _WIRE[d]) if d in _WIRE else a
             for a, d in zip(arrays, dtypes)]
    # vmap runs the callback once per element ("sequential").
    got = buffer_callback(callback, structs, vmap_method="sequential")(*wired)[:n]
    got = [jax.lax.bitcast_convert_type(r, d) if d in _WIRE else r
           for r, d in zip(got, out_dtypes)]
    # Inside shard_map the results vary over the mesh axes their arguments vary over (each
    # device computes its own shard's); the callback's results do not say so themselves.
    axes = tuple(sorted(frozenset().union(*map(_vma, arrays))))
    return [_varying(r, axes) for r in got] if axes else got


def _vma(x) -> frozenset:
    """The mesh axes `x` varies over inside shard_map (its type's vma; empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:     # JAX versions that keep it in the manual axis type
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def _varying(x, axes):
    """`x` marked as varying over the mesh axes `axes` (jax.lax.pcast; pvary before it)."""
    have = _vma(x)
    axes = tuple(a for a in axes if a not in have)
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _loss_shape(name, arrays, reduction):
    """The loss's shape from metadata, with the core's errors, before anything is traced."""
    if _dtypes.lookup(arrays[0].dtype) is None:
        raise _validate.unsupported_dtype(SPECS[name].arrays[0], arrays[0].dtype)
    return _validate.loss_shape(SPECS[name], arrays, reduction,
                                lambda a: jnp.issubdtype(a.dtype, jnp.floating))


@functools.lru_cache(maxsize=None)
def _function(name, reduction, options, extra=(), symbolic=True):
    """The custom_vjp function of the arrays for one loss, reduction and options: the required
    arrays, then the array options named in `extra` (weight, pos_weight), which get no gradient.

    symbolic: the forward pass learns which arrays are differentiated (symbolic zeros) and
    computes only their gradients.  JAX refuses that inside shard_map; there (False) every
    floating array the loss differentiates gets its gradient, and the array options a zero one."""
    names = SPECS[name].arrays
    # Arrays without a gradient (a registry entry's `differentiable` leaves them out) get a zero
    # cotangent.
    differentiable = getattr(SPECS[name], "differentiable", names)
    n = len(names)
    total = n + len(extra)

    def value(*arrays):
        shape = _loss_shape(name, arrays[:n], reduction)
        return _call("value", name, reduction, options, extra, (), arrays,
                     (_struct(shape, arrays[0].dtype),))[0]

    def forward(*primals):
        if symbolic:
            arrays = tuple(p.value for p in primals)
            for option, p in zip(extra, primals[n:]):
                if p.perturbed:
                    raise NotImplementedError(f"cupyloss.jax.{name} has no gradient with respect "
                                              f"to {option}; pass it through "
                                              f"jax.lax.stop_gradient")
            wrt = tuple(a for a, p in zip(names, primals) if p.perturbed and a in differentiable)
        else:
            arrays = primals
            wrt = tuple(a for a, x in zip(names, arrays)
                        if a in differentiable and jnp.issubdtype(x.dtype, jnp.floating))
        if reduction == "none" or not wrt:
            markers = tuple(jnp.zeros((0,), jnp.bool_) if a in wrt else None
                            for a in names)
            return value(*arrays), (None, arrays, markers)
        shape = _loss_shape(name, arrays[:n], reduction)
        index = {a: k for k, a in enumerate(names)}
        structs = (_struct(shape, arrays[0].dtype),
                   *[_struct(arrays[index[w]].shape, arrays[0].dtype) for w in wrt])
        loss, *grads = _call("value_and_grad", name, reduction, options, extra, wrt, arrays,
                             structs)
        grads = iter(grads)
        return loss, (tuple(next(grads) if a in wrt else None for a in names), None, None)

    def backward(residuals, g):
        saved, arrays, markers = residuals
        if symbolic and isinstance(g, jax.custom_derivatives.SymbolicZero):
            return (None,) * total
        if saved is not None:
            return (*[None if s is None else g * s for s in saved], *[None] * len(extra))
        wrt = tuple(a for a, m in zip(names, markers) if m is not None)
        if not wrt:
            return (None,) * total
        structs = tuple(_struct(a.shape, a.dtype) for a, m in zip(arrays, markers)
                        if m is not None)
        grads = iter(_call("backward", name, reduction, options, extra, wrt, (g, *arrays),
                           structs))
        return (*[next(grads) if m is not None else None for m in markers],
                *[None] * len(extra))

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward, symbolic_zeros=symbolic)
    return function


# --- the public functions ------------------------------------------------------------------------

def _make(name):
    spec = SPECS[name]
    core = inspect.signature(getattr(cupyloss, name))
    params = [p.replace(annotation=inspect.Parameter.empty) for p in core.parameters.values()]
    signature = inspect.Signature(params)
    option_names = [p.name for p in params if p.name not in spec.arrays and p.name != "reduction"]
    # Options that default to None take arrays (weight, pos_weight): operands, not static values.
    array_options = {p.name for p in params if p.name in option_names and p.default is None}

    def loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        options, extra, extras = [], [], []
        for option in option_names:
            v = values[option]
            if option in array_options and v is not None:
                extra.append(option)
                extras.append(jnp.asarray(v))
                continue
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise TypeError(f"cupyloss.jax.{name}: option {option} must be a Python "
                                f"bool, int, float or str (a static value), got "
                                f"{type(v).__name__}")
            options.append((option, v))
        arrays = [jnp.asarray(values[a]) for a in spec.arrays]
        key = (name, values["reduction"], tuple(options), tuple(extra))
        try:
            return _function(*key)(*arrays, *extras)
        except NotImplementedError as exc:
            if "shard_map" not in str(exc):
                raise
            return _function(*key, symbolic=False)(*arrays, *extras)

    loss.__name__ = loss.__qualname__ = name
    loss.__module__ = __name__
    loss.__signature__ = signature
    doc = inspect.getdoc(getattr(cupyloss, name)) or ""
    summary, _, body = doc.partition("\n")
    args = ", ".join(spec.arrays)
    loss.__doc__ = (
        f"{summary}\n\nJAX form of cupyloss.{name} for jax.Arrays on a CUDA device: same "
        f"arguments and\nresults (a jax.Array), differentiable with jax.grad and usable "
        f"under jax.jit\n(cupyloss.jax's docstring says how).  Options are static Python "
        f"values.\n{body}\n\nExample (JAX):\n"
        f"  >>> jax.jit(jax.grad(cupyloss.jax.{name}))({args})\n")
    return loss


LOSSES: dict = {}        # name -> the generated function
SKIPPED: dict = {}       # name -> why a registered loss got no function


def _generate(specs: dict) -> None:
    """Generate every wrappable loss of `specs`; record the others in SKIPPED, with a warning."""
    for name, spec in specs.items():
        reason = unwrappable(name, spec, cupyloss)
        if reason is not None:
            SKIPPED[name] = reason
            warnings.warn(f"cupyloss.jax leaves out {name}: {reason}", RuntimeWarning,
                          stacklevel=2)
            continue
        LOSSES[name] = _make(name)
        setattr(sys.modules[__name__], name, LOSSES[name])


_generate(SPECS)


# --- the fused heads (cupyloss.linear) -----------------------------------------------------------

_HEAD_GRADS = ("hidden", "weight", "bias")


def _acc_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


@functools.lru_cache(maxsize=None)
def _head_function(name, reduction, options, extra, symbolic=True):
    """custom_vjp of (hidden, weight, target, *extra) for a fused head: linear_cross_entropy
    (reduced: its gradients formed in the forward pass and scaled by the cotangent; 'none': formed
    again in backward) or linear_log_probs ((logp, entropy); backward forms the logits again with
    both cotangents).  Gradients of hidden, weight and bias (when given, first of `extra`)."""
    grads_of = ("hidden", "weight") + (("bias",) if "bias" in extra else ())
    order = ("hidden", "weight", "target") + extra
    logprobs = name == "linear_log_probs"

    def outs(arrays):
        shape = tuple(arrays[2].shape)
        acc = _acc_dtype(arrays[0])
        if logprobs:
            return (_struct(shape, acc), _struct(shape, acc))
        return (_struct(shape if reduction == "none" else (), acc),)

    def value(*arrays):
        got = _call("value", name, reduction, options, extra, (), arrays, outs(arrays))
        return tuple(got) if logprobs else got[0]

    def wanted(primals):
        if not symbolic:
            return grads_of
        return tuple(a for a, p in zip(order, primals) if a in grads_of and p.perturbed)

    def markers(wrt):
        """wrt as residuals (names are not JAX values): an empty array per name, else None."""
        return tuple(jnp.zeros((0,), jnp.bool_) if a in wrt else None for a in order)

    def forward(*primals):
        arrays = tuple(p.value for p in primals) if symbolic else primals
        wrt = wanted(primals)
        if logprobs or reduction == "none" or not wrt:
            return value(*arrays), (None, arrays, markers(wrt))
        structs = outs(arrays) + tuple(_struct(arrays[order.index(w)].shape,
                                               arrays[order.index(w)].dtype) for w in wrt)
        loss, *grads = _call("value_and_grad", name, reduction, options, extra, wrt, arrays,
                             structs)
        return loss, (dict(zip(wrt, grads)), None, markers(wrt))

    def backward(residuals, g):
        saved, arrays, marked = residuals
        wrt = tuple(a for a, m in zip(order, marked) if m is not None)
        none = (None,) * len(order)
        if not wrt:
            return none
        if saved is None:
            if logprobs:
                zero = jax.custom_derivatives.SymbolicZero
                if all(isinstance(c, zero) for c in g):
                    return none
                g = tuple(jnp.zeros(arrays[2].shape, _acc_dtype(arrays[0]))
                          if isinstance(c, zero) else c for c in g)
            elif symbolic and isinstance(g, jax.custom_derivatives.SymbolicZero):
                return none
            cot = tuple(g) if logprobs else (g,)
            structs = tuple(_struct(arrays[order.index(w)].shape, arrays[order.index(w)].dtype)
                            for w in wrt)
            saved = dict(zip(wrt, _call("backward", name, reduction, options, extra, wrt,
                                        (*cot, *arrays), structs)))
        elif symbolic and isinstance(g, jax.custom_derivatives.SymbolicZero):
            return none
        else:
            saved = {k: (g * v.astype(g.dtype)).astype(v.dtype) for k, v in saved.items()}
        return tuple(saved.get(a) for a in order)

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward, symbolic_zeros=symbolic)
    return function


def _head(name, hidden, weight, target, reduction, options, arrays):
    """Run fused head `name` with static `options` ((name, value) pairs) and the optional arrays
    `arrays` ((name, array or None) pairs)."""
    extra = tuple(k for k, v in arrays if v is not None)
    extras = [jnp.asarray(v) for _, v in arrays if v is not None]
    args = (jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(target), *extras)
    key = (name, reduction, tuple(options), extra)
    try:
        return _head_function(*key)(*args)
    except NotImplementedError as exc:
        if "shard_map" not in str(exc):
            raise
        return _head_function(*key, symbolic=False)(*args)


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None,
                         ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                         lse_square_scale=0.0, softcap=0.0, max_workspace_bytes=None):
    """cross_entropy(hidden @ weight.T + bias, target) without the logits in memory, for JAX.

    JAX form of cupyloss.linear_cross_entropy (its docstring has the formula and the plans):
    float32 logits a chunk at a time, cuBLAS products on XLA's stream inside a
    buffer_callback, the results and the workspace in XLA's buffers.  Differentiable with
    jax.grad with respect to hidden, weight and bias (a reduced loss's gradients are formed in
    the forward pass and scaled by the cotangent), usable under jax.jit and inside shard_map.
    Options are static Python values; bias and class_weight are arrays (class_weight without a
    gradient).

    Returns:
      The loss, float32 (float64 for float64 inputs): 0-d for 'mean'/'sum', else target's shape.

    Example:
      >>> loss, (gh, gw) = jax.jit(jax.value_and_grad(cupyloss.jax.linear_cross_entropy,
      ...                                             argnums=(0, 1)))(h, w, labels)
    """
    options = (("ignore_index", int(ignore_index)), ("label_smoothing", float(label_smoothing)),
               ("lse_square_scale", float(lse_square_scale)), ("softcap", float(softcap)),
               ("max_workspace_bytes", max_workspace_bytes))
    return _head("linear_cross_entropy", hidden, weight, target, reduction, options,
                 (("bias", bias), ("class_weight", class_weight)))


def linear_log_probs(hidden, weight, target, bias=None, *, temperature=1.0,
                     return_entropy=False, ignore_index=-100, max_workspace_bytes=None):
    """Per-token log p(target) (and the entropy) of softmax((hidden @ weight.T + bias) / T), the
    logits never whole, for JAX.

    JAX form of cupyloss.linear_log_probs (its docstring has the formulas): differentiable with
    jax.grad with respect to hidden, weight and bias through both outputs (backward forms the
    logits again with their cotangents), usable under jax.jit.

    Returns:
      logp, or ``(logp, entropy)``: target's shape, float32 (float64 for float64 inputs).

    Example:
      >>> def objective(h, w):
      ...     logp, ent = cupyloss.jax.linear_log_probs(h, w, tokens, return_entropy=True)
      ...     return -(advantages * logp).mean() - 0.01 * ent.mean()
      >>> grads = jax.jit(jax.grad(objective, argnums=(0, 1)))(h, w)
    """
    from cupyloss import linear

    options = (("temperature", linear._temperature(temperature)),
               ("ignore_index", int(ignore_index)),
               ("max_workspace_bytes", max_workspace_bytes))
    logp, ent = _head("linear_log_probs", hidden, weight, target, "none", options,
                      (("bias", bias),))
    return (logp, ent) if return_entropy else logp


# --- vocab-parallel cross entropy inside shard_map ---------------------------------------------------

def _all_gather_invariant(x, axis_name):
    """all_gather over `axis_name` whose result is invariant over it (the same on every device,
    as shard_map's type system sees it): jax.lax.all_gather_invariant where JAX has it."""
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        try:
            from jax._src.lax.parallel import all_gather_invariant as gather
        except ImportError:
            gather = jax.lax.all_gather
    return gather(x, axis_name)


def _vp_combine(every, target, classes, weight, ignore_index, eps, zs):
    """cupyloss.parallel's combine in jnp over (k, N, 6) states in rank order: (loss, lse, w_y)
    per row, 0 for an ignored row, NaN for a class outside [0, classes)."""
    m, s, a, b, t = (every[..., f] for f in range(5))
    big = jnp.max(m, 0)
    live = s != 0
    s_all = jnp.where(live, s * jnp.exp(jnp.where(live, m - big, 0.0)), 0.0).sum(0)
    moved = (b != 0) & (m != -jnp.inf)
    a_all = (a + b * (big - jnp.where(moved, m, big))).sum(0)
    log_s = jnp.log(s_all)
    lse = big + log_s
    ignored = target == ignore_index
    outside = ~ignored & ((target < 0) | (target >= classes))
    w_y = jnp.ones_like(lse) if weight is None else \
        weight.astype(lse.dtype)[jnp.where(ignored | outside, 0, target)]
    w_y = jnp.where(ignored, 0.0, jnp.where(outside, jnp.nan, w_y))
    loss = (1.0 - eps) * w_y * (log_s + (big - t.sum(0)))
    if eps:
        loss = loss + (eps / classes) * (b.sum(0) * log_s + a_all)
    if zs:
        loss = loss + zs * lse * lse
    return jnp.where(ignored, 0.0, loss), lse, w_y


def _vp_loss(stats, t, w, n, acc, classes, options, axis_name, reduction):
    """(the loss, (lse, divisor)) from this device's states: all-gathered over the axis
    (invariant: the same states on every device, so shard_map's out_specs P() holds for the
    loss), merged, NaN where the devices' targets differ, reduced (divisor: num_items `n`,
    the counted rows' weights for 'mean', else None)."""
    ignore_index, eps, zs = options
    every = _all_gather_invariant(stats, axis_name)
    loss, lse, w_y = _vp_combine(every, t, classes, w, ignore_index, eps, zs)
    differ = jax.lax.pmax(t, axis_name) != jax.lax.pmin(t, axis_name)
    loss, lse = jnp.where(differ, jnp.nan, loss), jnp.where(differ, jnp.nan, lse)
    if reduction == "none":
        return loss, (lse, None)
    divisor = (n.astype(acc) if n is not None
               else jnp.sum(w_y) if reduction == "mean" else None)
    total = jnp.sum(loss)
    return (total if divisor is None else total / divisor), (lse, divisor)


def vocab_parallel_cross_entropy(input, target, axis_name, *, weight=None, ignore_index=-100,
                                 reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                                 softcap=0.0, num_items=None):
    """cross_entropy of logits whose classes are split over the mesh axis `axis_name`, inside
    jax.shard_map: each device passes its slice (N, C / k) of the classes, in axis order, and
    gets the loss of all C of them; the gradient of its slice comes back with no communication.

    Formula: cupyloss.parallel's steps.  Each device forms its slice's softmax state per row
    (vocab_parallel_stats, a kernel on XLA's stream), the states are exchanged with
    ``jax.lax.all_gather`` over `axis_name` (24 bytes a row a device in float32, never the
    logits), merged in axis order in jnp (the same on every device, bit for bit) into each row's
    loss and lse, and backward forms the slice's gradient from that lse
    (vocab_parallel_backward).  'mean' divides by the summed w_y of the counted rows, or by
    num_items (an int or a 0-d array) for 'mean' and 'sum' alike.  A row whose target differs
    between devices, or lies outside [0, C) and is not ignore_index, is NaN.

    Args:
      input: (N, C / k) this device's slice of the logits (equal slices in axis order).
      target: (N,) int32 class indices into all C = k * C / k classes, the same on every device.
      axis_name: the shard_map mesh axis the classes are split over.
      weight: None or (C,) class weights of all classes.
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap: as cross_entropy.
      num_items: None, or the divisor of the summed loss (cross_entropy's).

    Returns:
      The loss, float32 (float64 for float64 input): 0-d for 'mean'/'sum', else (N,); the same
      on every device of the axis.

    Example:
      >>> f = jax.shard_map(lambda x, y: cupyloss.jax.vocab_parallel_cross_entropy(x, y, "tp"),
      ...                   mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=P())
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if num_items is not None and reduction == "none":
        raise ValueError("num_items divides a reduced loss ('mean' or 'sum'); "
                         "reduction='none' returns each row's loss")
    x, t = jnp.asarray(input), jnp.asarray(target)
    if x.ndim != 2 or t.shape != x.shape[:1]:
        raise ValueError(f"input must be (N, C / k) and target (N,), got {x.shape} and {t.shape}")
    k = jax.lax.axis_size(axis_name)
    cols = x.shape[1]
    classes = k * cols
    opts = dict(ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
                softcap=float(softcap))
    zs = float(lse_square_scale)
    w = None if weight is None else jnp.asarray(weight)
    return _vp_function(reduction, classes, tuple(opts.items()), zs, w is not None,
                        axis_name, num_items is not None)(
        x, t, w, None if num_items is None else jnp.asarray(num_items))


@functools.lru_cache(maxsize=None)
def _vp_function(reduction, classes, opts, zs, weighted, axis_name, items):
    options = dict(opts)
    ignore_index, eps = options["ignore_index"], options["label_smoothing"]
    stats_opts = (("classes", classes), *opts)
    grad_opts = (("classes", classes), ("ignore_index", ignore_index),
                 ("label_smoothing", eps), ("lse_square_scale", zs),
                 ("softcap", options["softcap"]))

    def local(x, t, w):
        """This slice's target (its class index in the slice, others outside it, the ignored
        ones kept) and class weights, as the kernels take them with class offset 0."""
        offset = jax.lax.axis_index(axis_name) * x.shape[1]
        ignored = t == ignore_index
        tl = jnp.where(ignored, t, jnp.mod(t - offset, classes)).astype(t.dtype)
        wl = None if w is None else jnp.roll(w, -offset)
        return tl, wl

    def run(x, t, w, n):
        acc = _acc_dtype(x)
        tl, wl = local(x, t, w)
        extra = (wl,) if w is not None else ()
        stats = _call("value", "vocab_parallel_stats", "none", stats_opts,
                      ("weight",) if w is not None else (), (), (x, tl, *extra),
                      (_struct((x.shape[0], 6), acc),))[0]
        return _vp_loss(stats, t, w, n, acc, classes, (ignore_index, eps, zs), axis_name,
                        reduction)

    def value(x, t, w, n):
        return run(x, t, w, n)[0]

    def forward(x, t, w, n):
        out, (lse, divisor) = run(x, t, w, n)
        return out, (x, t, w, n, lse, divisor)

    def backward(res, g):
        x, t, w, n, lse, divisor = res
        acc = _acc_dtype(x)
        tl, wl = local(x, t, w)
        g = jnp.asarray(g, acc)
        rows = g if reduction == "none" else jnp.broadcast_to(
            g if divisor is None else g / divisor, t.shape)
        extra = (wl,) if w is not None else ()
        gx = _call("value", "vocab_parallel_backward", "none", grad_opts,
                   ("weight",) if w is not None else (), (),
                   (rows.astype(acc), x, tl, lse, *extra), (_struct(x.shape, x.dtype),))[0]
        return gx, None, None, None

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward)
    return function


def vocab_parallel_linear_cross_entropy(hidden, weight, target, axis_name, *, bias=None,
                                        ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0,
                                        max_workspace_bytes=None, num_items=None):
    """cross_entropy(hidden @ W.T + b, target) with W's rows (the classes) split over the mesh
    axis `axis_name`, inside jax.shard_map, the logits never whole.

    Each device holds its block of rows of W (and of b), in axis order, and the same hidden and
    target.  The forward pass forms each row's softmax state over the device's classes a chunk
    of logits at a time (cupyloss.parallel.linear_vocab_parallel_stats), exchanges the states
    with an all_gather over `axis_name` (24 bytes a row a device), and merges them in jnp into
    each row's loss and lse, the same on every device.  Backward forms the logits again with
    that lse (linear_vocab_parallel_backward): dW and db stay on their device, and the hidden
    gradient's float32 partial sums are added with a psum over the axis.  Four products a row
    chunk in all (the torch form exchanges the states a chunk at a time inside one pass, three).
    'mean' divides by the count of counted rows, or by num_items for 'mean' and 'sum' alike.  A
    row whose target differs between devices or lies outside [0, C) is NaN.

    Args:
      hidden: (N, H), the same on every device; weight: (C / k, H) this device's rows of the
        head; target: (N,) int32 class indices into all C classes; bias: None or (C / k,).
      axis_name: the shard_map mesh axis the classes are split over.
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap, max_workspace_bytes,
        num_items: as for cupyloss.linear_cross_entropy.

    Returns:
      The loss, float32 (float64 for float64 inputs), the same on every device: 0-d for
      'mean'/'sum', else (N,).

    Example:
      >>> f = jax.shard_map(lambda h, w, y: cupyloss.jax.vocab_parallel_linear_cross_entropy(
      ...     h, w, y, "tp"), mesh=mesh, in_specs=(P(), P("tp", None), P()), out_specs=P())
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if num_items is not None and reduction == "none":
        raise ValueError("num_items divides a reduced loss ('mean' or 'sum'); "
                         "reduction='none' returns each row's loss")
    h, w, t = jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(target)
    if h.ndim != 2 or w.ndim != 2 or w.shape[1] != h.shape[1] or t.shape != h.shape[:1]:
        raise ValueError(f"hidden must be (N, H), weight (C / k, H) and target (N,), got "
                         f"{h.shape}, {w.shape} and {t.shape}")
    classes = jax.lax.axis_size(axis_name) * w.shape[0]
    opts = (("ignore_index", int(ignore_index)), ("label_smoothing", float(label_smoothing)),
            ("lse_square_scale", float(lse_square_scale)), ("softcap", float(softcap)),
            ("max_workspace_bytes", max_workspace_bytes))
    return _vpl_function(reduction, classes, opts, axis_name)(
        h, w, None if bias is None else jnp.asarray(bias), t,
        None if num_items is None else jnp.asarray(num_items))


@functools.lru_cache(maxsize=None)
def _vpl_function(reduction, classes, opts, axis_name):
    options = dict(opts)
    ignore_index, eps = options["ignore_index"], options["label_smoothing"]
    zs = options["lse_square_scale"]
    stats_opts = (("classes", classes), *((k, v) for k, v in opts if k != "lse_square_scale"))
    grad_opts = (("classes", classes), *opts)

    def local(w, t):
        """The target as the kernels take it with class offset 0 (module of _vp_function)."""
        offset = jax.lax.axis_index(axis_name) * w.shape[0]
        return jnp.where(t == ignore_index, t, jnp.mod(t - offset, classes)).astype(t.dtype)

    def run(h, w, b, t, n):
        acc = _acc_dtype(h)
        tl = local(w, t)
        extra = ("bias",) if b is not None else ()
        stats = _call("value", "linear_vp_stats", "none", stats_opts, extra, (),
                      (h, w, tl, *((b,) if b is not None else ())),
                      (_struct((h.shape[0], 6), acc),))[0]
        return _vp_loss(stats, t, None, n, acc, classes, (ignore_index, eps, zs), axis_name,
                        reduction)

    def value(h, w, b, t, n):
        return run(h, w, b, t, n)[0]

    def forward(h, w, b, t, n):
        out, (lse, divisor) = run(h, w, b, t, n)
        return out, (h, w, b, t, lse, divisor)

    def backward(res, g):
        h, w, b, t, lse, divisor = res
        acc = _acc_dtype(h)
        tl = local(w, t)
        g = jnp.asarray(g, acc)
        rows = g if reduction == "none" else jnp.broadcast_to(
            g if divisor is None else g / divisor, t.shape)
        wrt = ("hidden", "weight") + (("bias",) if b is not None else ())
        structs = (_struct(h.shape, acc), _struct(w.shape, w.dtype)) + (
            (_struct(b.shape, b.dtype),) if b is not None else ())
        got = _call("value", "linear_vp_backward", "none", grad_opts,
                    ("bias",) if b is not None else (), wrt,
                    (rows.astype(acc), h, w, tl, lse, *((b,) if b is not None else ())),
                    structs)
        gx = jax.lax.psum(got[0], axis_name).astype(h.dtype)
        return gx, got[1], (got[2] if b is not None else None), None, None

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward)
    return function


def optax_ctc_loss(logits, logit_paddings, labels, label_paddings, blank_id=0):
    """CTC loss with optax.ctc_loss's arguments: cupyloss.jax.ctc_loss behind optax's convention.

    ``log_softmax(logits)`` over K, then per sequence b, with T_b = T - sum(logit_paddings[b])
    frames and N_b = N - sum(label_paddings[b]) labels:

      ``loss_b = -log sum_{pi in B^-1(labels[b, :N_b])} prod_{t < T_b} softmax(logits[b, t])[pi_t]``

    Paddings are suffixes (a 1.0 marks a padded frame or label, as optax's), so each sequence is
    its first T_b frames and N_b labels.  The gradient with respect to the logits is
    ``softmax - posterior`` frame by frame, as optax's autodiff gives; a target the frames
    cannot hold has loss inf (optax's is about -log_epsilon times its frames: finite, not a
    probability).

    Args:
      logits: (B, T, K) float16, bfloat16, float32 or float64 (log-probabilities work too).
      logit_paddings: (B, T), 1.0 on padded frames.
      labels: (B, N) int32 or int64 class indices, never blank_id where not padded.
      label_paddings: (B, N), 1.0 on padded labels.
      blank_id: the blank's class, in [0, K).

    Returns:
      (B,) the loss per sequence, the logits' dtype.

    Example:
      >>> loss = cupyloss.jax.optax_ctc_loss(logits, logit_pad, labels, label_pad).mean()
    """
    logits = jnp.asarray(logits)
    frames = (logits.shape[1] - jnp.sum(jnp.asarray(logit_paddings), axis=1)).astype(jnp.int32)
    targets = (labels.shape[1] - jnp.sum(jnp.asarray(label_paddings), axis=1)).astype(jnp.int32)
    log_probs = jnp.swapaxes(jax.nn.log_softmax(logits, axis=-1), 0, 1)
    return LOSSES["ctc_loss"](log_probs, jnp.asarray(labels), frames, targets, blank=blank_id,
                              reduction="none")

# --- post-training objectives on the fused head (cupyloss.posttrain has the formulas) ----------------

def _posttrain_ops():
    from cupyloss import posttrain

    return posttrain.Ops(jnp, stop=jax.lax.stop_gradient)


def _pt_log_probs(budget):
    def log_probs(hidden, weight, target, bias, temperature, ignore_index):
        return linear_log_probs(hidden, weight, target, bias, temperature=temperature,
                                return_entropy=True, ignore_index=ignore_index,
                                max_workspace_bytes=budget)

    return log_probs


def linear_grpo_loss(hidden, weight, target, advantages, bias=None, *, mask=None,
                     old_log_probs=None, ref_log_probs=None, loss_type="dapo", epsilon_low=0.2,
                     epsilon_high=None, beta=0.0, entropy_weight=0.0, temperature=1.0,
                     max_completion_length=None, num_items=None, ignore_index=-100,
                     max_workspace_bytes=None):
    """GRPO's clipped policy-gradient loss (and DAPO's, Dr. GRPO's, BNPO's) on the fused head,
    for JAX: ``sum_i w_i (-min(rho_i A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) A_i) + beta k3_i
    - entropy_weight H_i)`` (cupyloss.linear_grpo_loss has every term), composed from
    linear_log_probs under jit and grad (its backward forms the logits again).

    Args and Returns: as cupyloss.torch.linear_grpo_loss (arrays in place of tensors).

    Example:
      >>> loss_fn = lambda h, w: cupyloss.jax.linear_grpo_loss(h, w, tokens, adv)[0]
      >>> g_h, g_w = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(h, w)
    """
    from cupyloss import posttrain

    return posttrain.grpo_loss(
        _posttrain_ops(), _pt_log_probs(max_workspace_bytes), hidden, weight, target,
        advantages, bias, mask=mask, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        entropy_weight=entropy_weight, temperature=temperature,
        max_completion_length=max_completion_length, num_items=num_items,
        ignore_index=ignore_index)


def linear_preference_loss(kind, hidden, weight, target, bias=None, *, desirable=None,
                           ref_log_probs=None, ref_hidden=None, ref_weight=None, ref_bias=None,
                           ignore_index=-100, max_workspace_bytes=None, **options):
    """A preference loss on the fused head, for JAX: `kind` 'dpo', 'orpo', 'cpo', 'simpo' or
    'kto', with the options and semantics of cupyloss.torch.linear_<kind>_loss (formulas in
    cupyloss.posttrain: rows 0 .. B/2 - 1 chosen, the rest rejected, except for 'kto', which
    takes `desirable` (B,) bool).  Composed from linear_log_probs under jit and grad.

    Returns:
      ``(loss, metrics)``: loss 0-d float32; metrics a dict of 0-d arrays without gradients.

    Example:
      >>> f = lambda h, w: cupyloss.jax.linear_preference_loss("dpo", h, w, labels,
      ...                                                      ref_log_probs=ref)[0]
      >>> g_h, g_w = jax.jit(jax.grad(f, argnums=(0, 1)))(h, w)
    """
    from cupyloss import posttrain

    return posttrain.preference_loss(
        _posttrain_ops(), _pt_log_probs(max_workspace_bytes), kind, hidden, weight, target,
        bias, desirable=desirable, ref_log_probs=ref_log_probs, ref_hidden=ref_hidden,
        ref_weight=ref_weight, ref_bias=ref_bias, ignore_index=ignore_index, **options)


@functools.lru_cache(maxsize=None)
def _jsd_function(options, extra):
    """custom_vjp of linear_jsd over (student_hidden, student_weight, teacher_hidden,
    teacher_weight, *extra): the student's gradients formed with the value (one pass) and
    scaled by the cotangent; the teacher and the target get none."""
    order = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight") + extra
    grads_of = {"student_hidden": "hidden", "student_weight": "weight", "student_bias": "bias"}

    def value(*arrays):
        return _call("value", "linear_jsd", "mean", options, extra, (), arrays,
                     (_struct((), _acc_dtype(arrays[0])),))[0]

    def forward(*arrays):
        wrt = tuple(grads_of[a] for a in order if a in grads_of)
        structs = (_struct((), _acc_dtype(arrays[0])),) + tuple(
            _struct(arrays[i].shape, arrays[i].dtype)
            for i, a in enumerate(order) if a in grads_of)
        loss, *grads = _call("value_and_grad", "linear_jsd", "mean", options, extra, wrt,
                             arrays, structs)
        return loss, tuple(grads)

    def backward(grads, g):
        it = iter((g * v.astype(g.dtype)).astype(v.dtype) for v in grads)
        return tuple(next(it) if a in grads_of else None for a in order)

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward)
    return function


def linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None, *,
               student_bias=None, teacher_bias=None, beta=0.5, temperature=1.0, hard_weight=0.0,
               ignore_index=-100, max_workspace_bytes=None):
    """Knowledge distillation between two heads, the logits never whole, for JAX: the
    generalised JSD of the student's and the teacher's softmax(logits / T) plus hard_weight
    times the student's cross entropy, averaged over the counted rows (cupyloss.linear_jsd has
    the formula).  Differentiable with jax.grad in the student's hidden, weight and bias (their
    gradients formed with the value); the teacher gets none.

    Returns:
      0-d float32 (float64 for float64 inputs).

    Example:
      >>> f = lambda h, w: cupyloss.jax.linear_jsd(h, w, h_teacher, w_teacher, labels)
      >>> g_h, g_w = jax.jit(jax.grad(f, argnums=(0, 1)))(h, w)
    """
    from cupyloss import linear, posttrain

    posttrain.check_distill(beta, temperature, hard_weight, target)
    options = (("beta", float(beta)), ("temperature", linear._temperature(temperature)),
               ("hard_weight", float(hard_weight)), ("ignore_index", int(ignore_index)),
               ("max_workspace_bytes", max_workspace_bytes))
    named = (("target", target), ("student_bias", student_bias),
             ("teacher_bias", teacher_bias))
    extra = tuple(k for k, v in named if v is not None)
    arrays = [jnp.asarray(a) for a in (student_hidden, student_weight, teacher_hidden,
                                       teacher_weight)]
    arrays += [jnp.asarray(v) for _, v in named if v is not None]
    return _jsd_function(options, extra)(*arrays)


__all__ = sorted([*LOSSES, "LOSSES", "SKIPPED", "optax_ctc_loss", "linear_cross_entropy",
                  "linear_log_probs", "vocab_parallel_cross_entropy",
                  "vocab_parallel_linear_cross_entropy", "linear_grpo_loss",
                  "linear_preference_loss", "linear_jsd"])
