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
import threading

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


# CUfunction -> the word slots of its parameters that hold addresses (Layout.bind): what the
# JAX replay may rewrite, and nothing else.
POINTERS: dict = {}


class Layout:
    """The parameter list of one kernel: names in order, each one word or a struct of words,
    and which words hold addresses (`pointers`)."""

    def __init__(self, params):
        self.slot = {}
        self.size = 0
        pointers = []
        for name, words, *pointer in params:
            self.slot[name] = self.size
            if pointer and pointer[0]:
                pointers += range(self.size, self.size + words)
            self.size += words
        self.pointers = frozenset(pointers)

    def bind(self, function: int) -> int:
        """`function` (a CUfunction launched with these words), its address words recorded in
        POINTERS; returned as given."""
        POINTERS[function] = self.pointers
        return function

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


class _Recording(threading.local):
    """Per thread: the list a recording on this thread appends its launches to, else None
    (_dispatch.recording sets it; other threads' launches are never recorded)."""

    ops = None


RECORDING = _Recording()
_driver = None


def launch(function_ptr: int, grid: tuple, block: tuple, shared: int, stream: int,
           words: array.array) -> None:
    """cuLaunchKernel with `words` as the parameter buffer, on `stream`; inside a recording on
    this thread (RECORDING.ops), appended to it instead: ("launch", function, grid, block,
    shared memory, cooperative, a copy of the words)."""
    global _driver
    ops = RECORDING.ops
    if ops is not None:
        ops.append(("launch", function_ptr, tuple(grid), tuple(block), shared, False,
                    array.array("Q", words)))
        return
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
    that share a row wait for each other); `words` and recording as for `launch`."""
    ops = RECORDING.ops
    if ops is not None:
        ops.append(("launch", function_ptr, tuple(grid), tuple(block), shared, True,
                    array.array("Q", words)))
        return
    from cupy_backends.cuda.api import driver

    base = words.buffer_info()[0]
    params = array.array("Q", (base + 8 * i for i in range(len(words))))
    driver.launchCooperativeKernel(function_ptr, grid[0], 1, 1, block[0], 1, 1, shared, stream,
                                   params.buffer_info()[0])
