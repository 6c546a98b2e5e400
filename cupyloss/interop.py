"""DLPack exchange with torch (and anything else speaking DLPack), zero-copy, stream-aware.

The core never imports this module.  ``wrap(cupyloss.mse_loss)`` gives a function that takes and
returns torch tensors: inputs are viewed through DLPack, the kernels run on torch's current CUDA
stream, and outputs (allocated from CuPy's memory pool) are handed back as torch tensors that
share their memory, without a copy.
"""

from __future__ import annotations

import contextlib
import functools


def from_torch(tensor):
    """A cupy.ndarray viewing `tensor`'s memory (no copy); `tensor` must be on a CUDA device.

    Example:
      >>> x = cupyloss.interop.from_torch(torch.randn(4, device="cuda"))
    """
    import cupy

    if not getattr(tensor, "is_cuda", False):
        raise TypeError(f"from_torch needs a CUDA tensor, got one on {tensor.device}; move it "
                        f"with tensor.cuda()")
    return cupy.from_dlpack(tensor)


def to_torch(array):
    """A torch.Tensor viewing `array`'s memory (no copy).

    Example:
      >>> t = cupyloss.interop.to_torch(cupy.arange(4.0))
    """
    import torch

    return torch.from_dlpack(array)


@contextlib.contextmanager
def torch_stream(device=None):
    """Make CuPy launch on torch's current CUDA stream (of `device`) inside the block.

    Example:
      >>> with cupyloss.interop.torch_stream():
      ...     loss = cupyloss.mse_loss(from_torch(a), from_torch(b))
    """
    import cupy
    import torch

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(stream.device.index):
        with cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index):
            yield


def wrap(fn):
    """Return `fn` taking and returning torch tensors (zero-copy, on torch's current stream).

    Tensor arguments (positional or keyword, including grad_output) are viewed as CuPy arrays;
    array results, also inside tuples, come back as torch tensors sharing their memory.

    Example:
      >>> mse = cupyloss.interop.wrap(cupyloss.mse_loss_value_and_grad)
      >>> loss, (g_in, g_t) = mse(torch_input, torch_target)
    """
    import torch

    def to_cupy(v):
        return from_torch(v) if isinstance(v, torch.Tensor) else v

    def back(v):
        if isinstance(v, tuple):
            return tuple(back(u) for u in v)
        return to_torch(v) if v is not None and hasattr(v, "__dlpack__") else v

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        device = next((a.device for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor)), None)
        with torch_stream(device):
            out = fn(*(to_cupy(a) for a in args), **{k: to_cupy(v) for k, v in kwargs.items()})
        return back(out)

    return wrapped
