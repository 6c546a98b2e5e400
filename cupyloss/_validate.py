"""Checks on public arguments: TypeError for kinds and dtypes, ValueError for shapes and values.

Every check runs on the host from metadata alone, before any launch, and names what it got.
"""

from __future__ import annotations

import numbers

from cupyloss import _dtypes


def _supported() -> str:
    return ", ".join(str(d) for d in _dtypes.DTYPES)


def check_array(x, name: str):
    """Return the DtypeInfo of `x` if it is a floating cupy.ndarray cupyloss supports, else raise."""
    import cupy

    if not isinstance(x, cupy.ndarray):
        kind = f"{type(x).__module__}.{type(x).__qualname__}"
        if (kind.startswith("numpy.") or hasattr(x, "__array_interface__")
                or isinstance(x, (list, tuple, numbers.Number))):
            hint = f"it is on the host; move it to the GPU first with cupy.asarray({name})"
        elif kind.startswith("torch."):
            hint = ("convert torch tensors with cupyloss.interop.from_torch (zero-copy) or call "
                    "the losses through cupyloss.interop.wrap")
        else:
            hint = "pass a cupy.ndarray (cupy.from_dlpack converts DLPack tensors without a copy)"
        raise TypeError(f"{name} must be a cupy.ndarray, got {kind}: {hint}")
    info = _dtypes.lookup(x.dtype)
    if info is None:
        raise TypeError(f"{name} has dtype {x.dtype}; cupyloss supports {_supported()}")
    return info


def check_same_dtype(a, b, name_a: str, name_b: str) -> None:
    """Raise TypeError unless a and b share a dtype (cupyloss never promotes silently)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} has dtype {a.dtype} but {name_b} has dtype {b.dtype}; "
                        f"cast one of them so both match")


def check_same_device(a, b, name_a: str, name_b: str) -> None:
    """Raise ValueError unless a and b live on the same CUDA device."""
    if a.device.id != b.device.id:
        raise ValueError(f"{name_a} is on device {a.device.id} but {name_b} is on device "
                         f"{b.device.id}")


def broadcast_shape(shape_a: tuple, shape_b: tuple, name_a: str = "input",
                    name_b: str = "target") -> tuple:
    """NumPy/torch broadcast of two shapes, or ValueError naming both."""
    ndim = max(len(shape_a), len(shape_b))
    a = (1,) * (ndim - len(shape_a)) + tuple(shape_a)
    b = (1,) * (ndim - len(shape_b)) + tuple(shape_b)
    out = []
    for da, db in zip(a, b):
        if da != db and da != 1 and db != 1:
            raise ValueError(f"{name_a} shape {tuple(shape_a)} and {name_b} shape "
                             f"{tuple(shape_b)} do not broadcast")
        out.append(db if da == 1 else da)
    return tuple(out)


def check_grad_output(grad_output, loss_shape: tuple, reduction: str, dtype, device_id: int):
    """Classify grad_output as ('host', float) or ('device', 0-d array) or ('array', array)."""
    import cupy

    if isinstance(grad_output, numbers.Real) and not isinstance(grad_output, bool):
        return "host", float(grad_output)
    if not isinstance(grad_output, cupy.ndarray):
        raise TypeError("grad_output must be a Python number or a cupy.ndarray, got "
                        f"{type(grad_output).__module__}.{type(grad_output).__qualname__}")
    if grad_output.dtype != dtype:
        raise TypeError(f"grad_output has dtype {grad_output.dtype} but the loss has dtype "
                        f"{dtype}")
    if grad_output.device.id != device_id:
        raise ValueError(f"grad_output is on device {grad_output.device.id} but the inputs are "
                         f"on device {device_id}")
    if grad_output.ndim == 0:
        return "device", grad_output
    if reduction != "none":
        raise ValueError(f"grad_output of a reduction={reduction!r} loss must be 0-d, got "
                         f"shape {grad_output.shape}")
    if tuple(grad_output.shape) != tuple(loss_shape):
        raise ValueError(f"grad_output shape {grad_output.shape} does not match the loss shape "
                         f"{tuple(loss_shape)}")
    return "array", grad_output


def check_wrt(wrt) -> tuple[tuple[str, ...], bool]:
    """Normalise wrt to a tuple of 'input'/'target' names and whether it was a single name."""
    single = isinstance(wrt, str)
    names = (wrt,) if single else tuple(wrt)
    for name in names:
        if name not in ("input", "target"):
            raise ValueError(f"wrt names {name!r}; it takes 'input', 'target' or a sequence of "
                             f"them")
    if len(set(names)) != len(names):
        raise ValueError(f"wrt names an argument twice: {wrt!r}")
    return names, single
