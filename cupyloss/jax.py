"""JAX versions of every cupyloss loss, differentiable with jax.grad and usable under jax.jit.

    import cupyloss.jax as JL
    jax.jit(jax.grad(lambda a, b: JL.mse_loss(a, b)))(a, b)
    jax.value_and_grad(JL.kl_div, argnums=(0, 1))(jnp.log(p), q, "batchmean")

Generated from cupyloss's registry of every family (`cupyloss._registry.all_losses()`: the
pointwise losses and the row-wise cross_entropy and nll_loss) when this module is imported: each
loss ``f`` is ``cupyloss.jax.f`` with the core function's signature (``f(input, target, ...,
reduction=...)``), so a loss registered later needs no code here.  A registered loss that cannot
be wrapped is left out with a RuntimeWarning and its reason in ``cupyloss.jax.SKIPPED``.

How it runs: each call is a ``jax.experimental.buffer_callback`` (JAX 0.7 or later): under jit
it is a node of the XLA program that hands the callback XLA's device buffers and XLA's CUDA
stream, and the kernels are launched on that stream, so the loss is ordered with the rest of
the program and the host never waits.  Inputs are read in place (zero-copy); results are
allocated from CuPy's memory pool and copied into XLA's result buffers with one device-to-device
memcpy each (the engine has no entry point yet that writes into given buffers).  With
XLA_PYTHON_CLIENT_PREALLOCATE unset JAX keeps 75% of the GPU for itself: give CuPy room with
XLA_PYTHON_CLIENT_PREALLOCATE=false or XLA_PYTHON_CLIENT_MEM_FRACTION.

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

import functools
import inspect
import math
import sys
import warnings

try:
    import jax
except ImportError as exc:
    raise ImportError(f"cupyloss.jax needs JAX, which is not installed "
                      f"({exc}): pip install 'cupyloss[jax]'") from exc
import jax.numpy as jnp
import numpy

import cupyloss
from cupyloss import _dispatch, _dtypes, _reduction, _validate
from cupyloss._registry import all_losses

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:  # pragma: no cover - JAX older than 0.7
    raise ImportError(f"cupyloss.jax needs jax.experimental.buffer_callback (JAX 0.7 or later); "
                      f"this JAX is {jax.__version__}") from exc

_KDLCUDA = 2

# Every registered loss of every family (cupyloss._registry.all_losses).
SPECS = all_losses()


class _Kernels:
    """What the callbacks run: CuPy views of XLA's buffers, cupyloss's functions, copies back."""

    def view(self, buffer):
        """A cupy.ndarray over an XLA buffer's device memory (no copy)."""
        import cupy

        device = _cuda_device(buffer)
        dtype = numpy.dtype(buffer.dtype)
        try:
            ptr = buffer.__cuda_array_interface__["data"][0]
        except Exception:  # dtypes the interface cannot spell (bfloat16) go through DLPack
            return cupy.from_dlpack(buffer)
        shape = tuple(buffer.shape)
        memory = cupy.cuda.UnownedMemory(ptr, max(1, math.prod(shape)) * dtype.itemsize, buffer,
                                         device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def stream(self, ctx, buffer):
        """A context manager making XLA's stream (and the buffer's device) current for CuPy."""
        import contextlib

        import cupy

        device = _cuda_device(buffer)
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(device))
        stack.enter_context(cupy.cuda.Stream.from_external(_dispatch.RawStream(ctx.stream)))
        return stack

    def write(self, out, result) -> None:
        """Copy a CuPy result into an XLA result buffer on the current stream."""
        import cupy

        if result.size == 0:
            return
        target = self.view(out)
        if target.shape != result.shape or target.dtype != result.dtype:
            raise ValueError(f"cupyloss.jax: the kernels gave {result.dtype}{result.shape} for "
                             f"a result declared {target.dtype}{target.shape}")
        cupy.cuda.runtime.memcpyAsync(target.data.ptr, result.data.ptr, result.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    def value(self, name, arrays, reduction, options):
        return getattr(cupyloss, name)(*arrays, reduction=reduction, **options)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        return getattr(cupyloss, name + "_value_and_grad")(*arrays, reduction=reduction,
                                                           wrt=wrt, **options)

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        return getattr(cupyloss, name + "_backward")(grad_output, *arrays, reduction=reduction,
                                                     wrt=wrt, **options)


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
    n = len(SPECS[name].arrays)
    return views[:n], {**dict(options), **dict(zip(extra, views[n:]))}


def _value_callback(name, reduction, options, extra):
    def callback(ctx, out, *arrays):
        with _engine.stream(ctx, arrays[0]):
            views, kw = _split(name, options, extra, [_engine.view(a) for a in arrays])
            _engine.write(out, _engine.value(name, views, reduction, kw))

    return callback


def _value_and_grad_callback(name, reduction, options, extra, wrt):
    def callback(ctx, out, *arrays):
        with _engine.stream(ctx, arrays[0]):
            views, kw = _split(name, options, extra, [_engine.view(a) for a in arrays])
            value, grads = _engine.value_and_grad(name, views, reduction, kw, wrt)
            _engine.write(out[0], value)
            for buffer, grad in zip(out[1], grads):
                _engine.write(buffer, grad)

    return callback


def _backward_callback(name, reduction, options, extra, wrt):
    def callback(ctx, out, grad_output, *arrays):
        with _engine.stream(ctx, arrays[0]):
            views, kw = _split(name, options, extra, [_engine.view(a) for a in arrays])
            grads = _engine.backward(name, _engine.view(grad_output), views, reduction, kw, wrt)
            for buffer, grad in zip(out, grads):
                _engine.write(buffer, grad)

    return callback


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _loss_shape(name, arrays, reduction):
    """The loss's shape from metadata, with the core's errors, before anything is traced: the
    registry entry's ``loss_shape(input_shape, reduction)`` where it has one, else the
    arguments' broadcast shape.  Floating arguments must share a dtype."""
    spec = SPECS[name]
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    first = arrays[0]
    if _dtypes.lookup(first.dtype) is None:
        raise _validate.unsupported_dtype(spec.arrays[0], first.dtype)
    shape = tuple(first.shape)
    for array_name, other in zip(spec.arrays[1:], arrays[1:]):
        if other.dtype != first.dtype and jnp.issubdtype(other.dtype, jnp.floating):
            _validate.check_same_dtype(first, other, spec.arrays[0], array_name)
        if not hasattr(spec, "loss_shape"):
            shape = _validate.broadcast_shape(shape, tuple(other.shape), spec.arrays[0],
                                              array_name)
    if hasattr(spec, "loss_shape"):   # a registry entry that knows its loss's shape
        return tuple(spec.loss_shape(shape, reduction))
    return () if reduction != "none" else shape


@functools.lru_cache(maxsize=None)
def _function(name, reduction, options, extra=()):
    """The custom_vjp function of the arrays for one loss, reduction and options: the required
    arrays, then the array options named in `extra` (weight, pos_weight), which get no gradient."""
    names = SPECS[name].arrays
    # Arrays without a gradient (a registry entry's `differentiable` leaves them out) get a zero
    # cotangent.
    differentiable = getattr(SPECS[name], "differentiable", names)
    n = len(names)
    total = n + len(extra)

    def value(*arrays):
        shape = _loss_shape(name, arrays[:n], reduction)
        call = buffer_callback(_value_callback(name, reduction, options, extra),
                               _struct(shape, arrays[0].dtype), vmap_method="sequential")
        return call(*arrays)

    def forward(*primals):
        arrays = tuple(p.value for p in primals)
        for option, p in zip(extra, primals[n:]):
            if p.perturbed:
                raise NotImplementedError(f"cupyloss.jax.{name} has no gradient with respect to "
                                          f"{option}; pass it through jax.lax.stop_gradient")
        wrt = tuple(a for a, p in zip(names, primals) if p.perturbed and a in differentiable)
        if reduction == "none" or not wrt:
            markers = tuple(jnp.zeros((0,), jnp.bool_) if a in wrt else None
                            for a in names)
            return value(*arrays), (None, arrays, markers)
        shape = _loss_shape(name, arrays[:n], reduction)
        index = {a: k for k, a in enumerate(names)}
        structs = (_struct(shape, arrays[0].dtype),
                   tuple(_struct(arrays[index[w]].shape, arrays[0].dtype) for w in wrt))
        call = buffer_callback(_value_and_grad_callback(name, reduction, options, extra, wrt),
                               structs, vmap_method="sequential")
        loss, grads = call(*arrays)
        grads = iter(grads)
        return loss, (tuple(next(grads) if a in wrt else None for a in names), None, None)

    def backward(residuals, g):
        saved, arrays, markers = residuals
        if isinstance(g, jax.custom_derivatives.SymbolicZero):
            return (None,) * total
        if saved is not None:
            return (*[None if s is None else g * s for s in saved], *[None] * len(extra))
        wrt = tuple(a for a, m in zip(names, markers) if m is not None)
        if not wrt:
            return (None,) * total
        structs = tuple(_struct(a.shape, a.dtype) for a, m in zip(arrays, markers)
                        if m is not None)
        call = buffer_callback(_backward_callback(name, reduction, options, extra, wrt), structs,
                               vmap_method="sequential")
        grads = iter(call(g, *arrays))
        return (*[next(grads) if m is not None else None for m in markers],
                *[None] * len(extra))

    function = jax.custom_vjp(value)
    function.defvjp(forward, backward, symbolic_zeros=True)
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
        return _function(name, values["reduction"], tuple(options), tuple(extra))(*arrays,
                                                                                  *extras)

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


def _why_not(name, spec):
    """Why loss `name` cannot be wrapped, or None."""
    for field in ("arrays", "reductions"):
        if not hasattr(spec, field):
            return f"its registry entry ({type(spec).__name__}) has no {field!r}"
    for suffix in ("", "_backward", "_value_and_grad"):
        if not callable(getattr(cupyloss, name + suffix, None)):
            return f"cupyloss has no function {name + suffix}"
    return None


LOSSES: dict = {}        # name -> the generated function
SKIPPED: dict = {}       # name -> why a registered loss got no function


def _generate(specs: dict) -> None:
    """Generate every wrappable loss of `specs`; record the others in SKIPPED, with a warning."""
    for name, spec in specs.items():
        reason = _why_not(name, spec)
        if reason is not None:
            SKIPPED[name] = reason
            warnings.warn(f"cupyloss.jax leaves out {name}: {reason}", RuntimeWarning,
                          stacklevel=2)
            continue
        LOSSES[name] = _make(name)
        setattr(sys.modules[__name__], name, LOSSES[name])


_generate(SPECS)

__all__ = sorted([*LOSSES, "LOSSES", "SKIPPED"])
