"""Kernel parameters packed into one buffer per plan, and the launch through the CUDA driver.

Every cupyloss kernel parameter is a 64-bit scalar, a pointer or a struct of 64-bit fields, so a
parameter list is a sequence of 8-byte words at 8-byte-aligned offsets, exactly the layout
cuLaunchKernel expects behind CU_LAUNCH_PARAM_BUFFER_POINTER.  A plan builds the words that depend
only on metadata once (`Layout.template`); a call copies them, writes its pointers into their
slots and launches: no per-argument conversion, no NumPy scalars on the hot path.
"""

from __future__ import annotations

import array
import struct

import numpy

_LAUNCH_PARAM_END = 0
_LAUNCH_PARAM_BUFFER_POINTER = 1
_LAUNCH_PARAM_BUFFER_SIZE = 2
_MASK64 = (1 << 64) - 1


def f64_word(value: float) -> int:
    """The 64-bit pattern of a C double."""
    return struct.unpack("<Q", struct.pack("<d", float(value)))[0]


def i64_word(value: int) -> int:
    """The 64-bit pattern of a C long long (two's complement)."""
    return int(value) & _MASK64


def struct_words(record: numpy.ndarray) -> list[int]:
    """The words of a packed NumPy record whose fields are all 64-bit (see _launch.geometry)."""
    raw = record.tobytes()
    if len(raw) % 8:
        raise ValueError(f"a kernel struct of {len(raw)} bytes is not a whole number of words")
    return list(array.array("Q", raw))


class Layout:
    """The parameter list of one kernel: names in order, each one word or a struct of words."""

    def __init__(self, params: list[tuple[str, int]]):
        self.slot = {}
        self.size = 0
        for name, words in params:
            self.slot[name] = self.size
            self.size += words

    def template(self, values: dict) -> array.array:
        """Words with `values` (name -> word or list of words) filled in, the rest zero."""
        words = array.array("Q", bytes(8 * self.size))
        for name, value in values.items():
            at = self.slot[name]
            if isinstance(value, list):
                words[at:at + len(value)] = array.array("Q", value)
            else:
                words[at] = value
        return words


_driver = None


def launch(function_ptr: int, grid: tuple, block: tuple, shared: int, stream: int,
           words: array.array) -> None:
    """cuLaunchKernel with `words` as the parameter buffer, on `stream`."""
    global _driver
    if _driver is None:
        from cupy_backends.cuda.api import driver

        _driver = driver
    address, count = words.buffer_info()
    extra = array.array("Q", (_LAUNCH_PARAM_BUFFER_POINTER, address,
                              _LAUNCH_PARAM_BUFFER_SIZE, 0, _LAUNCH_PARAM_END, 8 * count))
    extra_address = extra.buffer_info()[0]
    extra[3] = extra_address + 40  # points at the size word, extra[5]
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    _driver.launchKernel(function_ptr, gx, gy, 1, block[0], 1, 1, shared, stream, 0,
                        extra_address)


def launch_cooperative(function_ptr: int, grid: tuple, block: tuple, shared: int, stream: int,
                       words: array.array) -> None:
    """cuLaunchCooperativeKernel: every block of the grid resident at once (the groups of blocks
    that share a row wait for each other); `words` as for `launch`."""
    from cupy_backends.cuda.api import driver

    base = words.buffer_info()[0]
    params = array.array("Q", (base + 8 * i for i in range(len(words))))
    driver.launchCooperativeKernel(function_ptr, grid[0], 1, 1, block[0], 1, 1, shared, stream,
                                   params.buffer_info()[0])
