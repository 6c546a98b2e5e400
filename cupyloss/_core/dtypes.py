"""The one table of supported dtypes: NumPy dtype -> C type, accumulator dtype, vector width."""

from __future__ import annotations

import dataclasses

import numpy

try:  # CuPy 14 spells bfloat16 through ml_dtypes
    import ml_dtypes

    _BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes ships with every supported CuPy
    _BFLOAT16 = None


@dataclasses.dataclass(frozen=True)
class DtypeInfo:
    """How one floating dtype is stored, accumulated and vectorised."""

    dtype: numpy.dtype
    ctype: str          # C++ storage type in kernels/
    acc: numpy.dtype    # accumulator: float32 for 16-bit types and float32, float64 for float64
    vec: int            # elements per 16-byte access


def _table():
    rows = [
        DtypeInfo(numpy.dtype(numpy.float16), "__half", numpy.dtype(numpy.float32), 8),
        DtypeInfo(numpy.dtype(numpy.float32), "float", numpy.dtype(numpy.float32), 4),
        DtypeInfo(numpy.dtype(numpy.float64), "double", numpy.dtype(numpy.float64), 2),
    ]
    if _BFLOAT16 is not None:
        rows.append(DtypeInfo(_BFLOAT16, "__nv_bfloat16", numpy.dtype(numpy.float32), 8))
    return {row.dtype: row for row in rows}


DTYPES = _table()
CTYPES = tuple(info.ctype for info in DTYPES.values())


def lookup(dtype) -> DtypeInfo | None:
    """The table row for `dtype`, or None when cupyloss does not support it."""
    try:
        return DTYPES.get(numpy.dtype(dtype))
    except TypeError:
        return None
