"""DLPack helpers for torch tensors, for code that wants CuPy views of them.

Every cupyloss function takes torch CUDA tensors directly and returns torch tensors (see
cupyloss._core.dispatch), so these are only needed to mix cupyloss with hand-written CuPy code.
The core never imports this module.
"""

from __future__ import annotations

import contextlib


def from_torch(tensor):
    """A cupy.ndarray viewing `tensor`'s memory (no copy); `tensor` must be on a CUDA device.

    Tensors that require grad are viewed through ``tensor.detach()`` (same memory).

    Example:
      >>> x = cupyloss.interop.from_torch(torch.randn(4, device="cuda"))
    """
    import cupy

    if not getattr(tensor, "is_cuda", False):
        raise TypeError(f"from_torch needs a CUDA tensor, got one on {tensor.device}; move it "
                        f"with tensor.cuda()")
    return cupy.from_dlpack(tensor.detach())


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
      ...     y = cupy.exp(from_torch(a))
    """
    import cupy
    import torch

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(stream.device.index):
        with cupy.cuda.Stream.from_external(stream):
            yield
