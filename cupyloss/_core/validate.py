"""Checks on public arguments: TypeError for kinds and dtypes, ValueError for shapes and values.

Every check runs on the host from metadata alone, before any launch, and names what it got.
Arrays arrive here as _dispatch.Operands (dtype, device index, shape).
"""

from __future__ import annotations


from cupyloss._core import dtypes as _dtypes, reduction as _reduction


# The largest finite float32 and float64.
_FLOAT32_MAX, _FLOAT64_MAX = 3.4028234663852886e38, 1.7976931348623157e308


def check_softcap(softcap, dtype) -> float:
    """cross_entropy's softcap as a float: 0 (no cap), or a finite positive number whose
    reciprocal the accumulator of `dtype` holds (float64 for float64 inputs, else float32: the
    kernels multiply by 1 / softcap).  ValueError for anything else (negative, NaN, infinite,
    or below 1 / the accumulator's largest value, 2.9e-39 for float32).  `dtype` is a NumPy or
    a torch dtype, read by its itemsize or else its name, not through NumPy (so that
    torch.compile traces through it); 0 returns at once (str of a NumPy dtype takes 2 us)."""
    cap = float(softcap)
    if cap == 0.0:
        return cap
    size = getattr(dtype, "itemsize", None)
    wide = size == 8 if type(size) is int else "float64" in str(dtype)
    acc, most = ("float64", _FLOAT64_MAX) if wide else ("float32", _FLOAT32_MAX)
    if not (cap == 0.0 or 1.0 / most <= cap <= most):   # NaN fails both
        raise ValueError(f"softcap must be 0 (no cap) or a number from {1.0 / most:.3g} to "
                         f"{most:.3g} (1 / softcap and softcap finite in {acc}), got {softcap}")
    return cap


def unsupported_dtype(name: str, dtype) -> TypeError:
    """The TypeError for an array argument of a dtype cupyloss has no kernels for."""
    supported = ", ".join(str(d) for d in _dtypes.DTYPES)
    return TypeError(f"{name} has dtype {dtype}; cupyloss supports {supported}")


def check_same_dtype(a, b, name_a: str, name_b: str) -> None:
    """Raise TypeError unless a and b share a dtype (cupyloss never promotes silently)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} has dtype {a.dtype} but {name_b} has dtype {b.dtype}; "
                        f"cast one of them so both match")


def check_same_device(a, b, name_a: str, name_b: str) -> None:
    """Raise ValueError unless operands a and b live on the same CUDA device."""
    if a.device != b.device:
        raise ValueError(f"{name_a} is on CUDA device {a.device} but {name_b} is on CUDA device "
                         f"{b.device}; move them to one device")


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


def broadcast_shapes(shapes: list, names: list) -> tuple:
    """NumPy/torch broadcast of any number of shapes, or ValueError naming every argument."""
    out = tuple(shapes[0])
    for shape in shapes[1:]:
        ndim = max(len(out), len(shape))
        a = (1,) * (ndim - len(out)) + out
        b = (1,) * (ndim - len(shape)) + tuple(shape)
        if any(da != db and da != 1 and db != 1 for da, db in zip(a, b)):
            if len(shapes) == 2:
                broadcast_shape(shapes[0], shapes[1], names[0], names[1])
            described = [f"{n} shape {tuple(s)}" for n, s in zip(names, shapes)]
            raise ValueError(f"{', '.join(described[:-1])} and {described[-1]} do not broadcast")
        out = tuple(db if da == 1 else da for da, db in zip(a, b))
    return out


def check_grad_output_shape(go_shape: tuple, loss_shape: tuple, reduction: str) -> None:
    """Raise ValueError unless a non-0-d grad_output has the shape of a reduction='none' loss."""
    if reduction != "none":
        raise ValueError(f"grad_output of a reduction={reduction!r} loss must be 0-d, got "
                         f"shape {tuple(go_shape)}")
    if tuple(go_shape) != tuple(loss_shape):
        raise ValueError(f"grad_output shape {tuple(go_shape)} does not match the loss shape "
                         f"{tuple(loss_shape)}")


def check_wrt(wrt, names: tuple = ("input", "target"), given: tuple | None = None,
              default=None) -> tuple[tuple[str, ...], bool]:
    """Normalise wrt to a tuple of array argument names and whether it was a single name: the
    one check of wrt for every family and the fused loss, before any launch.

    names: the arguments that may have a gradient; given: those that are arrays in this call
    (an optional one left out, or a number, has no gradient); default: what None stands for
    (the function's default: a name, or a tuple of names), else every name given."""
    if wrt is None:
        wrt = default if default is not None else (given if given is not None else names)
    single = isinstance(wrt, str)
    picked = (wrt,) if single else tuple(wrt)
    for name in picked:
        if name not in names:
            choices = ", ".join(repr(n) for n in names)
            raise ValueError(f"wrt names {name!r}; it takes {choices} or a sequence of them")
        if given is not None and name not in given:
            raise ValueError(f"wrt names {name!r}, which is not an array in this call, so it "
                             f"has no gradient")
    if len(set(picked)) != len(picked):
        raise ValueError(f"wrt names an argument twice: {wrt!r}")
    return picked, single


def distinct_elements(shape, strides) -> bool:
    """Whether a view's elements are distinct in memory (no two indices at one address), so
    that writing every element in place writes each once.  Sufficient test: with the dims of
    more than one element ordered by |stride|, each stride passes the whole extent of the dims
    before it (true of every C- or F-ordered, sliced or transposed view; an as_strided view
    whose rows overlap, or a stride of 0, fails it)."""
    extent = 0
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1),
                       key=lambda d: d[1]):
        if s <= extent:
            return False
        extent += s * (n - 1)
    return True


def check_like_input(x, t, shape_message: str) -> None:
    """A floating target of the input's dtype (TypeError naming both) and shape (ValueError
    with `shape_message`)."""
    if t.dtype != x.dtype:
        check_same_dtype(x, t, "input", "target")
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(shape_message)


def loss_shape(spec, arrays, reduction: str, floating) -> tuple:
    """The shape of a loss from its arrays' metadata alone, with the core's errors (what the
    adapters' fake and abstract evaluations return): ``spec.loss_shape(input_shape, reduction)``
    where the registry entry has one, else the arrays' broadcast shape (0-d when reduced).
    floating(a): whether array a is floating; such an array must have the first's dtype."""
    if reduction not in spec.reductions:
        _reduction.check_reduction(reduction, spec.reductions)
    first, names = arrays[0], spec.arrays
    shape = tuple(first.shape)
    for name, other in zip(names[1:], arrays[1:]):
        if other.dtype != first.dtype and floating(other):
            check_same_dtype(first, other, names[0], name)
        if not hasattr(spec, "loss_shape"):
            shape = broadcast_shape(shape, tuple(other.shape), names[0], name)
    if hasattr(spec, "loss_shape"):
        return tuple(spec.loss_shape(shape, reduction))
    return () if reduction != "none" else shape


_ITEM_DTYPES = ("int32", "int64")


def check_num_items(num_items, reduction: str, array_class=None) -> float | None:
    """A loss's num_items (gradient accumulation's global count of counted rows, the divisor
    of the reduced loss instead of this call's own): a host count (an int, a NumPy integer, a
    CPU tensor) as a float, or None for a device array, whose Operand check_items_operand
    checks (an instance of `array_class`, the input's, is one unless it is a CPU tensor).
    TypeError for any other kind (a float, a bool), ValueError for a negative count or
    reduction='none'."""
    if reduction == "none":
        raise ValueError("num_items divides a reduced loss ('mean' or 'sum'); "
                         "reduction='none' returns each row's loss")
    wrong = TypeError(f"num_items must be an int or a 0-d int32/int64 array on the loss's "
                      f"device (the count of counted rows over all micro-batches), got "
                      f"{type(num_items).__name__}")
    if isinstance(num_items, (bool, float)):
        raise wrong
    if not isinstance(num_items, int):
        device = getattr(num_items, "__dlpack_device__", None)
        if ((num_items.__class__ is array_class and getattr(num_items, "is_cuda", True))
                or hasattr(num_items, "__cuda_array_interface__")
                or getattr(num_items, "is_cuda", False)
                or (device is not None and device()[0] == _KDLCUDA)):
            return None
        try:
            num_items = num_items.__index__()
        except (AttributeError, TypeError, RuntimeError):
            raise wrong from None
    if num_items < 0:
        raise ValueError(f"num_items must be a count, 0 or more, got {num_items}")
    return float(num_items)


_KDLCUDA = 2


def check_items_operand(items, device: int) -> None:
    """num_items given as an array (an Operand): 0-d, int32 or int64, on `device`."""
    if str(items.dtype) not in _ITEM_DTYPES:
        raise TypeError(f"num_items must be an int or a 0-d int32/int64 array, got an array of "
                        f"dtype {items.dtype}")
    if tuple(items.shape) != ():
        raise ValueError(f"num_items must be 0-d (one count), got shape {tuple(items.shape)}")
    if items.device != device:
        raise ValueError(f"num_items is on CUDA device {items.device} but the input is on CUDA "
                         f"device {device}; move it to one device")
