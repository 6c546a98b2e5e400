"""The one edge where arrays come in and results go out: CuPy, torch, JAX and any DLPack array.

A loss call names its array arguments; `frame_of` finds the framework they come from (a "frame"),
and the frame turns each one into an `Operand` (pointer, shape, element strides, dtype, device),
names the stream the work runs on, allocates outputs and scratch with that framework's allocator,
and hands results back as that framework's arrays.  The kernels' engine (_pointwise) sees only
Operands.  No framework is imported here at module level: torch and JAX are recognised only once
the caller has imported them.

  CuPy arrays       CuPy's current stream and memory pool; results are cupy.ndarrays.
  torch tensors     read in place (data_ptr, shape, stride) on torch's current stream of the
                    tensors' device; results come from torch's caching allocator, so CUDA-graph
                    capture and torch.cuda.max_memory_allocated see them.  Tensors that require
                    grad are read like any other (no autograd graph is recorded here).
  JAX arrays        exchanged through DLPack on CuPy's current stream (the DLPack stream
                    handshake orders it after JAX's producer); results are jax.Arrays.
  other DLPack      any object with __dlpack__ and a CUDA __dlpack_device__; results are
                    cupy.ndarrays.
  given memory      GivenArrays (a cupy.ndarray subclass) on CuPy's current stream; results are
                    placed in buffers the caller owns and scratch is carved from one buffer it
                    gives (a Region: how cupyloss.jax fills XLA's result buffers).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys

import numpy

from cupyloss._core import dtypes as _dtypes, plans as _plans, validate as _validate

_KDLCUDA = 2            # DLPack device types that are CUDA memory the kernels can read
_KDLCUDA_MANAGED = 13


class Operand:
    """What the engine needs of an array: data pointer, shape, element strides, dtype, device."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "array")

    def __init__(self, ptr, shape, strides, dtype, device, array):
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device = device
        self.array = array      # the caller's object, kept alive for the call


def _kind(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


class RawStream:
    """A raw cudaStream_t in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


# --- CuPy ---------------------------------------------------------------------------------------

_ELEMENT_STRIDES = _plans.Plans()   # (byte strides, itemsize) -> element strides


def element_strides(strides: tuple, itemsize: int, name: str) -> tuple:
    """Byte strides in elements, or ValueError where one is not a whole number of elements
    (a view of another dtype's memory cupyloss would read at the wrong offsets)."""
    if any(s % itemsize for s in strides):
        raise ValueError(f"{name} has byte strides {tuple(strides)} that are not multiples of its "
                         f"element size {itemsize}: pass a copy (cupy.ascontiguousarray)")
    return tuple(s // itemsize for s in strides)


class CupyFrame:
    """cupy.ndarray in, cupy.ndarray out, CuPy's current stream and pool."""

    name = "cupy"

    def __init__(self):
        import cupy

        self._cupy = cupy
        self._ndarray = cupy.ndarray
        self._get_stream = cupy.cuda.get_current_stream

    def operand(self, x, name):
        dtype = x.dtype
        if dtype not in _dtypes.DTYPES:
            raise _validate.unsupported_dtype(name, dtype)
        key = (x.strides, dtype.itemsize)
        strides = _ELEMENT_STRIDES.get(key)
        if strides is None:
            strides = _ELEMENT_STRIDES[key] = element_strides(x.strides, dtype.itemsize, name)
        return Operand(x.data.ptr, x.shape, strides, dtype, x.data.device_id, x)

    def stream(self, device):
        return self._get_stream().ptr

    def empty(self, shape, dtype, like):
        """A new C-contiguous array on `like`'s device (the current one), and its pointer."""
        a = self._ndarray(shape, dtype)
        return a, a.data.ptr

    def empty_like(self, a):
        """A new C-contiguous array of `a`'s shape and dtype (`a` is C-contiguous)."""
        out = self._ndarray(a.shape, a.dtype)
        return out, out.data.ptr

    def zeros(self, shape, dtype, like):
        a = self._cupy.zeros(shape, dtype)
        return a, a.data.ptr

    def result(self, a):
        return a

    def scratch_allocator(self):
        return contextlib.nullcontext()

    def cupy_view(self, op: Operand):
        return op.array


# --- torch --------------------------------------------------------------------------------------

class TorchFrame:
    """torch.Tensor in and out, read in place; torch's current stream and caching allocator."""

    name = "torch"

    def __init__(self, torch):
        self._torch = torch
        self._empty_like = torch.empty_like
        self._devices = {}
        self._scalars = {}      # (device, dtype) -> a 0-d tensor, the model of 0-d results
        self._to_numpy = {torch.float16: numpy.dtype("float16"),
                          torch.float32: numpy.dtype("float32"),
                          torch.float64: numpy.dtype("float64")}
        if _dtypes._BFLOAT16 is not None:
            self._to_numpy[torch.bfloat16] = _dtypes._BFLOAT16
        self._to_torch = {v: k for k, v in self._to_numpy.items()}
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw if raw is not None else (
            lambda device: torch.cuda.current_stream(device).cuda_stream)

    def operand(self, x, name):
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch.Tensor on {x.device}; cupyloss runs on CUDA "
                            f"devices: move it with {name}.cuda()")
        dtype = self._to_numpy.get(x.dtype)
        if dtype is None:
            raise _validate.unsupported_dtype(name, x.dtype)
        try:
            strides = x.stride()
        except RuntimeError as exc:  # sparse and other layouts without strides
            raise TypeError(f"{name} has layout {x.layout}; cupyloss reads strided tensors "
                            f"({exc})") from None
        return Operand(x.data_ptr(), tuple(x.shape), strides, dtype, x.get_device(), x)

    def stream(self, device):
        return self._raw_stream(device)

    def _device(self, device):
        d = self._devices.get(device)
        if d is None:
            d = self._devices[device] = self._torch.device("cuda", device)
        return d

    def empty(self, shape, dtype, like):
        """A new contiguous tensor from torch's allocator on `like`'s device, and its pointer."""
        tdtype = self._to_torch[dtype]
        if not shape:   # a reduced loss: empty_like of a kept 0-d tensor costs less than new_empty
            key = (like.get_device(), tdtype)
            model = self._scalars.get(key)
            if model is None:
                model = self._scalars[key] = like.new_empty((), dtype=tdtype)
            t = self._empty_like(model)
        else:
            t = (like.new_empty(shape) if like.dtype is tdtype
                 else like.new_empty(shape, dtype=tdtype))
        return t, t.data_ptr()

    def empty_like(self, a):
        """A new tensor of `a`'s shape and dtype (`a` is contiguous, so the new one is too)."""
        t = self._empty_like(a)
        return t, t.data_ptr()

    def zeros(self, shape, dtype, like):
        t = like.new_zeros(shape, dtype=self._to_torch[dtype])
        return t, t.data_ptr()

    def result(self, t):
        return t

    def scratch_allocator(self):
        """CuPy allocations inside the block come from torch's caching allocator."""
        import cupy

        torch = self._torch

        def allocate(nbytes):
            device = cupy.cuda.runtime.getDevice()
            t = torch.empty(nbytes, dtype=torch.uint8, device=self._device(device))
            mem = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, device)
            return cupy.cuda.MemoryPointer(mem, 0)

        return cupy.cuda.using_allocator(allocate)

    def cupy_view(self, op: Operand):
        return _cupy_view(op)


def _cupy_view(op: Operand):
    """A cupy.ndarray over an operand's memory (no copy), keeping its owner alive."""
    import cupy

    itemsize = op.dtype.itemsize
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(op.shape, op.strides)) if all(
        op.shape) else 0
    low = sum((n - 1) * s for n, s in zip(op.shape, op.strides) if s < 0) if extent else 0
    mem = cupy.cuda.UnownedMemory(op.ptr + low * itemsize, max(extent, 1) * itemsize, op.array,
                                  op.device)
    return cupy.ndarray(op.shape, op.dtype, cupy.cuda.MemoryPointer(mem, -low * itemsize),
                        strides=tuple(s * itemsize for s in op.strides))


# --- JAX and other DLPack producers ---------------------------------------------------------------

class DlpackFrame(CupyFrame):
    """Any CUDA DLPack array, viewed as CuPy through DLPack; results converted back by `back`."""

    def __init__(self, name, back):
        super().__init__()
        self.name = name
        self._back = back

    def operand(self, x, name):
        try:
            device_type, _ = x.__dlpack_device__()
        except Exception as exc:
            raise TypeError(f"{name} ({_kind(x)}) does not say where its memory is "
                            f"(__dlpack_device__ failed: {exc})") from None
        if device_type not in (_KDLCUDA, _KDLCUDA_MANAGED):
            raise TypeError(f"{name} is a {_kind(x)} in DLPack device type {device_type}, not "
                            f"on a CUDA device; move it to the GPU first")
        try:
            view = self._cupy.from_dlpack(x)
        except (BufferError, TypeError, ValueError) as exc:
            raise TypeError(f"{name} ({_kind(x)}) could not be read through DLPack: "
                            f"{exc}") from None
        return super().operand(view, name)

    def result(self, a):
        return self._back(a)


def _jax_back(a):
    import jax.dlpack

    return jax.dlpack.from_dlpack(a)


# --- given memory: results written into buffers the caller owns --------------------------------------

ALIGN = 256     # bytes: every piece carved from a scratch buffer starts on this boundary


def carve(used: int, nbytes: int) -> tuple[int, int]:
    """(offset of a piece of `nbytes` bytes placed after `used` bytes, the bytes used after it):
    pieces start on ALIGN-byte boundaries."""
    offset = -(-used // ALIGN) * ALIGN
    return offset, offset + nbytes


class Region:
    """The memory a call may use (Quack's *_out pattern): its result buffers, in the order the
    caller declared them, and one scratch buffer of `size` bytes at `base` that every other
    allocation of the call is carved from.

    A result the engine allocates takes the first unclaimed buffer of its shape and dtype; what
    matches none is carved from scratch, or, past its end, taken from CuPy's pool and counted in
    `pooled` (the caller sized scratch too small; the numbers are still right).  `dry`: nothing
    behind the pointers (a measuring run whose launches are captured, never run): zeros are not
    written and `used` grows past any size, so that it measures the scratch a call needs."""

    __slots__ = ("outs", "claimed", "base", "size", "used", "device", "owner", "dry", "pooled",
                 "ops")

    def __init__(self, outs, base: int, size: int, device: int, owner=None, dry=False):
        self.outs = list(outs)      # cupy.ndarrays over the result buffers
        self.claimed = [False] * len(self.outs)
        self.base, self.size, self.used = base, size, 0
        self.device, self.owner, self.dry = device, owner, dry
        self.pooled = 0
        self.ops = None             # inside `recording`: the call's launches and zeroings

    def take(self, shape, dtype):
        """A result buffer of this shape and dtype, or None."""
        for k, out in enumerate(self.outs):
            if not self.claimed[k] and out.shape == shape and out.dtype == dtype:
                self.claimed[k] = True
                return out
        return None

    def piece(self, nbytes: int):
        """A cupy MemoryPointer to `nbytes` bytes of scratch (CuPy's pool past its end)."""
        import cupy

        offset, end = carve(self.used, nbytes)
        if not self.dry and end > self.size:
            self.pooled += 1
            return cupy.get_default_memory_pool().malloc(nbytes)
        self.used = end
        memory = cupy.cuda.UnownedMemory(self.base + offset, max(nbytes, 1), self.owner,
                                         self.device)
        return cupy.cuda.MemoryPointer(memory, 0)


class GivenFrame(CupyFrame):
    """CuPy arrays of the GivenArray type in; results placed in the current thread's Region
    (`given`), so that a caller that owns its output memory (XLA) gets results written straight
    into it and nothing is allocated beside it.  Launches go to CuPy's current stream."""

    _local = None

    def __init__(self):
        import threading

        super().__init__()
        GivenFrame._local = threading.local()

    @classmethod
    def region(cls) -> Region:
        region = getattr(cls._local, "region", None)
        if region is None:
            raise RuntimeError("cupyloss: GivenArray operands are read only inside "
                               "_dispatch.given(region)")
        return region

    def empty(self, shape, dtype, like):
        region = self.region()
        out = region.take(tuple(shape), dtype)
        if out is None:
            out = self._ndarray(shape, dtype, region.piece(math.prod(shape) * dtype.itemsize))
        return out, out.data.ptr

    def empty_like(self, a):
        return self.empty(a.shape, a.dtype, a)

    def zeros(self, shape, dtype, like):
        a, ptr = self.empty(shape, dtype, like)
        region = self.region()
        if region.ops is not None:
            region.ops.append(("zeros", ptr, a.nbytes))
        elif not region.dry and a.nbytes:
            self._cupy.cuda.runtime.memsetAsync(ptr, 0, a.nbytes,
                                                self._get_stream().ptr)
        return a, ptr

    def scratch_allocator(self):
        """CuPy allocations inside the block are carved from the region's scratch."""
        return self._cupy.cuda.using_allocator(self.region().piece)


_GIVEN: list = []       # [the GivenArray type], made on first use


def given_array_type():
    """The cupy.ndarray subclass whose instances the engines read through GivenFrame."""
    if not _GIVEN:
        import cupy

        class GivenArray(cupy.ndarray):
            """A CuPy array whose call writes its results into a given Region."""

        _FRAMES[GivenArray] = GivenFrame()
        _GIVEN.append(GivenArray)
    return _GIVEN[0]


def given_view(ptr: int, shape, dtype, device: int, owner=None):
    """A GivenArray over `ptr` (C-contiguous, not owned: `owner` is kept alive with it)."""
    import cupy

    dtype = numpy.dtype(dtype)
    memory = cupy.cuda.UnownedMemory(ptr, max(1, math.prod(shape)) * dtype.itemsize, owner,
                                     device)
    return given_array_type()(tuple(shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


class given:
    """Calls on GivenArrays inside the block place their results in `region` (nests; one
    region per thread)."""

    __slots__ = ("region", "outer")

    def __init__(self, region: Region):
        given_array_type()
        self.region = region

    def __enter__(self) -> Region:
        local = GivenFrame._local
        self.outer = getattr(local, "region", None)
        local.region = self.region
        return self.region

    def __exit__(self, *exc):
        GivenFrame._local.region = self.outer
        return False


class recording:
    """Inside, on this thread, the engines' launches (_args.launch, _args.launch_cooperative) and
    GivenFrame's zeroings are appended to `region.ops` instead of made: ("launch", function,
    grid, block, shared memory, cooperative, words) and ("zeros", pointer, bytes), in order.
    The flag is the thread's own (_args.RECORDING), so other threads' launches go through and
    threads may record at once; recordings nest, the inner one's launches its own."""

    def __init__(self, region: Region):
        self.region = region

    def __enter__(self):
        from cupyloss._core import args as _args

        self.outer = _args.RECORDING.ops
        ops = _args.RECORDING.ops = self.region.ops = []
        return ops

    def __exit__(self, *exc):
        from cupyloss._core import args as _args

        _args.RECORDING.ops = self.outer
        return False


# --- grad_output (every backward's hot path) ----------------------------------------------------

def check_grad_output(frame, grad_output, dtype, device: int):
    """grad_output as a float (a host number) or an Operand of the inputs' frame and dtype."""
    if isinstance(grad_output, numbers.Real) and not isinstance(grad_output, bool):
        return float(grad_output)
    if isinstance(grad_output, bool) or grad_output is None:
        raise TypeError(f"grad_output must be a number or an array like the inputs, got "
                        f"{grad_output!r}")
    go_frame = frame_of(grad_output, "grad_output")
    if go_frame is not frame:
        raise TypeError(f"grad_output is a {type(grad_output).__module__}."
                        f"{type(grad_output).__qualname__} but the inputs are {frame.name} "
                        f"arrays; pass grad_output from the same framework")
    go = frame.operand(grad_output, "grad_output")
    if go.dtype != dtype:
        raise TypeError(f"grad_output has dtype {go.dtype} but the loss has dtype {dtype}")
    if go.device != device:
        raise ValueError(f"grad_output is on CUDA device {go.device} but the inputs are on CUDA "
                         f"device {device}")
    return go


def classify_grad_output(frame, grad_output, dtype, device: int, loss_shape=None,
                         reduction: str = "none"):
    """(kind, host value, Operand or None) of a call's grad_output: ('host', g, None) for a
    number, ('device', 1.0, op) for a 0-d array, ('array', 1.0, op) for an elementwise one,
    whose shape is checked against `loss_shape` when given.  The hot path of every backward."""
    if grad_output.__class__ is float or grad_output.__class__ is int:
        return "host", float(grad_output), None
    go = check_grad_output(frame, grad_output, dtype, device)
    if isinstance(go, float):
        return "host", go, None
    if go.shape == ():
        return "device", 1.0, go
    if loss_shape is not None:
        _validate.check_grad_output_shape(go.shape, loss_shape, reduction)
    return "array", 1.0, go


# --- finding the frame ------------------------------------------------------------------------------

_FRAMES: dict = {}       # type -> frame; filled on first sight of each type
_SINGLETONS: dict = {}


def _singleton(key, make):
    frame = _SINGLETONS.get(key)
    if frame is None:
        frame = _SINGLETONS[key] = make()
    return frame


def _host_hint(x, name):
    return TypeError(f"{name} is a {_kind(x)} in host memory; cupyloss needs arrays on a CUDA "
                     f"device (CuPy, torch, JAX or any CUDA DLPack array): move it with "
                     f"cupy.asarray({name}) or {name}.cuda()")


def _classify(x, name):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if torch_fast_path:
            return _singleton("torch", lambda: TorchFrame(torch))
        return _singleton("torch-dlpack", lambda: TorchDlpackFrame(torch))
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return _singleton("cupy", CupyFrame)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return _singleton("jax", lambda: DlpackFrame("jax", _jax_back))
    if isinstance(x, (numpy.ndarray, numpy.generic, list, tuple, numbers.Number)):
        raise _host_hint(x, name)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _singleton("dlpack", lambda: DlpackFrame("dlpack", lambda a: a))
    if hasattr(x, "__array_interface__"):
        raise _host_hint(x, name)
    raise TypeError(f"{name} must be an array on a CUDA device (CuPy, torch, JAX or anything "
                    f"with __dlpack__), got {_kind(x)}")


def frame_of(x, name):
    """The frame of array argument `x` (called `name` in errors)."""
    t = type(x)
    frame = _FRAMES.get(t)
    if frame is None:
        frame = _classify(x, name)
        if frame.name in ("cupy", "torch"):  # the two whose frame depends on the type alone
            _FRAMES[t] = frame
    return frame


def check_same_frame(frame, x, y, name_x, name_y):
    """Raise TypeError unless argument y comes from `frame`, argument x's framework."""
    if frame_of(y, name_y) is not frame:
        raise TypeError(f"{name_x} is a {_kind(x)} but {name_y} is a {_kind(y)}; pass arrays of "
                        f"one framework (convert with DLPack: cupy.from_dlpack, "
                        f"torch.from_dlpack, jax.dlpack.from_dlpack)")


# Read torch tensors through data_ptr()/stride() (True) or through DLPack (False).  Both give the
# same operands on the same stream; the tests compare them.  Read when a type is first seen:
# clear _FRAMES after changing it.
torch_fast_path = True


class TorchDlpackFrame(TorchFrame):
    """torch tensors read through DLPack (cupy.from_dlpack) instead of data_ptr(): the reference
    path the fast one is tested against.  Work still runs on torch's current stream and results
    still come from torch's allocator."""

    name = "torch-dlpack"

    def operand(self, x, name):
        import cupy

        if not x.is_cuda:
            return super().operand(x, name)
        if self._to_numpy.get(x.dtype) is None:
            raise _validate.unsupported_dtype(name, x.dtype)
        device = x.get_device()
        stream = cupy.cuda.Stream.from_external(self._torch.cuda.current_stream(device))
        with cupy.cuda.Device(device), stream:
            view = cupy.from_dlpack(x.detach())
        op = _singleton("cupy", CupyFrame).operand(view, name)
        op.array = x  # outputs are allocated like the tensor, by torch
        return op
