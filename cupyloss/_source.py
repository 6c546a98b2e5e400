"""Where kernels/ is, how its sources are expanded, and the cached RawModule per family.

The only module that knows the location of the CUDA sources: inside an installed package they sit
in cupyloss/kernels/, in a source checkout in ../kernels/.  `#include "x.cuh"` lines are expanded
here, so the text CuPy compiles (and hashes for its on-disk cache) is the whole program.
"""

from __future__ import annotations

import functools
import pathlib
import re

from cupyloss import _dtypes

_HERE = pathlib.Path(__file__).resolve().parent
_CANDIDATES = (_HERE / "kernels", _HERE.parent / "kernels")
OPTIONS = ("--std=c++17",)
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> pathlib.Path:
    """The folder holding the .cu/.cuh sources."""
    for path in _CANDIDATES:
        if (path / "common.cuh").is_file():
            return path
    raise FileNotFoundError(
        "cupyloss kernel sources not found in " + " or ".join(map(str, _CANDIDATES)))


@functools.lru_cache(maxsize=None)
def expand(name: str) -> str:
    """Source of kernels/`name` with its local includes inlined (each once, like #pragma once)."""
    seen: set[str] = set()

    def inline(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (kernel_dir() / fname).read_text().replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: inline(m.group(1)), text)

    return inline(name)


# name -> functor for the pointwise family; pointwise.py registers the public losses over these.
POINTWISE_FUNCTORS = ("MseOp", "KlDivOp", "HingeOp")


def pointwise_name(kind: str, ctype: str, functor: str, vec: int, row_is_x: bool = False) -> str:
    """Name expression of pointwise_flat<ctype, functor, vec> or pointwise_rows<..., row_is_x>."""
    if kind == "rows":
        return (f"cupyloss::pointwise_rows<{ctype}, cupyloss::{functor}, {vec}, "
                f"{'true' if row_is_x else 'false'}>")
    return f"cupyloss::pointwise_flat<{ctype}, cupyloss::{functor}, {vec}>"


def reduce_name(kernel: str, ctype: str) -> str:
    """Name expression of a reduce.cu kernel (sum_rows<ctype>)."""
    return f"cupyloss::{kernel}<{ctype}>"


def scale_name(ctype: str, vec: int) -> str:
    """Name expression of scale.cu's scale_by_grad_output<ctype, vec> (the torch adapter's)."""
    return f"cupyloss::scale_by_grad_output<{ctype}, {vec}>"


ROWWISE_KERNELS = ("cross_entropy_rows", "cross_entropy_cols", "class_weight_sum")


def rowwise_name(kernel: str, ctype: str, general: bool = True) -> str:
    """Name expression of a rowwise.cu kernel: cross_entropy_rows<ctype, general>, others<ctype>."""
    if kernel == "cross_entropy_rows":
        return f"cupyloss::{kernel}<{ctype}, {'true' if general else 'false'}>"
    return f"cupyloss::{kernel}<{ctype}>"


def units() -> list[tuple[str, list[str]]]:
    """Every compilation unit: (source file, its name expressions).  CI compiles each."""
    pointwise = [
        pointwise_name(kind, info.ctype, functor, vec, row_is_x)
        for functor in POINTWISE_FUNCTORS
        for info in _dtypes.DTYPES.values()
        for vec in sorted({1, info.vec})
        for kind, row_is_x in (("flat", False), ("rows", True), ("rows", False))
    ]
    reduce = [reduce_name("sum_rows", info.ctype) for info in _dtypes.DTYPES.values()]
    scale = [scale_name(info.ctype, vec) for info in _dtypes.DTYPES.values()
             for vec in sorted({1, info.vec})]
    rowwise = [rowwise_name(kernel, info.ctype, general) for kernel in ROWWISE_KERNELS
               for info in _dtypes.DTYPES.values()
               for general in ((False, True) if kernel == "cross_entropy_rows" else (True,))]
    return [("pointwise.cu", pointwise), ("reduce.cu", reduce), ("scale.cu", scale),
            ("rowwise.cu", rowwise)]


@functools.lru_cache(maxsize=None)
def module(name: str):
    """The cupy.RawModule of kernels/`name` with all its name expressions (compiled lazily)."""
    import cupy

    names = dict(units())[name]
    return cupy.RawModule(code=expand(name), options=OPTIONS, name_expressions=names)


@functools.lru_cache(maxsize=None)
def _function(name: str, expression: str, device_id: int):
    return module(name).get_function(expression)


def function(name: str, expression: str):
    """The kernel `expression` of kernels/`name` on the current device."""
    import cupy

    return _function(name, expression, cupy.cuda.runtime.getDevice())
