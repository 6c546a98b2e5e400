"""The types of the public signatures.

`Array` is what every loss takes and gives back: a CuPy array, a torch CUDA tensor, a JAX GPU
array or any other array that speaks DLPack on a CUDA device (results come back in the
caller's framework, so a function's result has its inputs' type).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Any", "Array", "Sequence"]


@runtime_checkable
class Array(Protocol):
    """An array exchanged through DLPack (``__dlpack__`` / ``__dlpack_device__``)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[Any, int]: ...
