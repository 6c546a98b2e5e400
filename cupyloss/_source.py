"""Where kernels/ is, how its sources are expanded, and the cached modules that compile them.

The only module that knows the location of the CUDA sources: inside an installed package they sit
in cupyloss/kernels/, in a source checkout in ../kernels/.  `#include "x.cuh"` lines are expanded
here, so the text NVRTC compiles (and compile_module hashes for its on-disk cache) is the whole
program.
"""

from __future__ import annotations

import functools
import pathlib
import re

from cupyloss import _dtypes, _launch, _registry

_HERE = pathlib.Path(__file__).resolve().parent
_CANDIDATES = (_HERE / "kernels", _HERE.parent / "kernels")
OPTIONS = ("--std=c++17", *_launch.kernel_defines())
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


def pointwise_name(kind: str, ctype: str, functor: str, vec: int, grad: bool,
                   const: int | None = None) -> str:
    """Name expression of pointwise_flat<ctype, functor, vec, grad[, const]> or
    pointwise_rows<ctype, functor, vec, grad, const> (grad: the instantiation that can write
    gradients; the other computes values only; const: the rows kernel's operands that are not
    full, or the flat kernel's with stride 0 compiled in, bit k for operand k; flat without it
    reads every stride at run time)."""
    tail = "" if kind == "flat" and not const else f", {const}"
    return (f"cupyloss::pointwise_{kind}<{ctype}, cupyloss::{functor}, {vec}, "
            f"{'true' if grad else 'false'}{tail}>")


def pointwise_reduce_name(ctype: str, functor: str, vec: int, const: int) -> str:
    """Name expression of pointwise_reduce<ctype, functor, vec, const> (const: the operands
    read once per unit, bit k for operand k)."""
    return f"cupyloss::pointwise_reduce<{ctype}, cupyloss::{functor}, {vec}, {const}>"


def pointwise_names(functor: str, info) -> list[str]:
    """Every pointwise kernel of one functor and dtype: flat, scalar and vector, value-only and
    with gradients; and for each of its masks (the operands read once per unit or row, or of
    stride 0) the vector flat kernel with gradients, rows, likewise, and reduce."""
    vecs = sorted({1, info.vec})
    masks = _registry.reduce_masks(functor)
    return ([pointwise_name("flat", info.ctype, functor, vec, grad)
             for vec in vecs for grad in (False, True)]
            + ([pointwise_name("flat", info.ctype, functor, info.vec, True, const)
                for const in masks] if info.vec > 1 else [])
            + [pointwise_name("rows", info.ctype, functor, vec, grad, const)
               for const in masks for vec in vecs for grad in (False, True)]
            + [pointwise_reduce_name(info.ctype, functor, vec, const)
               for const in masks for vec in vecs])


def reduce_name(kernel: str, ctype: str) -> str:
    """Name expression of a reduce.cu kernel (sum_chunks<ctype>)."""
    return f"cupyloss::{kernel}<{ctype}>"


def scale_name(ctype: str, vec: int) -> str:
    """Name expression of scale.cu's scale_by_grad_output<ctype, vec> (the torch adapter's)."""
    return f"cupyloss::scale_by_grad_output<{ctype}, {vec}>"


ROWWISE_KERNELS = ("cross_entropy_rows", "cross_entropy_cols", "class_weight_sum")


def rowwise_name(kernel: str, ctype: str, mode: int = 2, cluster: int = 1) -> str:
    """Name expression of a rowwise.cu kernel: cross_entropy_rows<ctype, mode> (0 the class-index
    loss alone, 1 with its gradient, 2 everything else), or with cluster > 1
    cross_entropy_rows_cluster<ctype, mode, cluster> (a cluster of that many blocks a row); the
    others <ctype>."""
    if kernel == "cross_entropy_rows" and cluster > 1:
        return f"cupyloss::cross_entropy_rows_cluster<{ctype}, {mode}, {cluster}>"
    if kernel == "cross_entropy_rows":
        return f"cupyloss::{kernel}<{ctype}, {mode}>"
    return f"cupyloss::{kernel}<{ctype}>"


ROWCLASS_LOSSES = (0, 1, 2)   # LOSS_MULTI_MARGIN, LOSS_MULTILABEL, LOSS_JSD in rowclass.cu


def rowclass_name(kernel: str, ctype: str, loss: int = 0) -> str:
    """Name expression of a rowclass.cu kernel: rowclass_rows<ctype, loss>, rowclass_count<ctype>."""
    if kernel == "rowclass_rows":
        return f"cupyloss::{kernel}<{ctype}, {loss}>"
    return f"cupyloss::{kernel}<{ctype}>"


ROWPAIR_OPS = ("TripletOp", "CosineOp")


def rowpair_name(ctype: str, op: str, grad: bool, wide: bool = False) -> str:
    """Name expression of rowpair.cu's rowpair_rows<ctype, op, grad, wide>."""
    flag = {True: "true", False: "false"}
    return f"cupyloss::rowpair_rows<{ctype}, cupyloss::{op}, {flag[grad]}, {flag[wide]}>"


def rowpair_finish_name(ctype: str) -> str:
    """Name expression of rowpair.cu's rowpair_finish<ctype>."""
    return f"cupyloss::rowpair_finish<{ctype}>"


def units() -> list[tuple[str, list[str]]]:
    """Every compilation unit: (source file, its name expressions).  CI compiles each."""
    pointwise = [name for functor in _registry.functors() for info in _dtypes.DTYPES.values()
                 for name in pointwise_names(functor, info)]
    reduce = [reduce_name("sum_chunks", info.ctype) for info in _dtypes.DTYPES.values()]
    scale = [scale_name(info.ctype, vec) for info in _dtypes.DTYPES.values()
             for vec in sorted({1, info.vec})]
    rowwise = [rowwise_name(kernel, info.ctype, mode) for kernel in ROWWISE_KERNELS
               for info in _dtypes.DTYPES.values()
               for mode in ((0, 1, 2) if kernel == "cross_entropy_rows" else (2,))]
    rowwise += [rowwise_name("cross_entropy_rows", info.ctype, mode, kc)
                for info in _dtypes.DTYPES.values() for mode in (1, 2)
                for kc in _launch.ROW_CLUSTER_SIZES]
    rowclass = [rowclass_name("rowclass_rows", info.ctype, loss)
                for info in _dtypes.DTYPES.values() for loss in ROWCLASS_LOSSES]
    rowclass += [rowclass_name("rowclass_count", info.ctype) for info in _dtypes.DTYPES.values()]
    wide = [info for dtype, info in _dtypes.DTYPES.items()
            if dtype.itemsize in _launch.PAIR_WIDE_ITEMSIZES]
    rowpair = [rowpair_name(info.ctype, op, grad) for op in ROWPAIR_OPS
               for info in _dtypes.DTYPES.values() for grad in (False, True)]
    rowpair += [rowpair_name(info.ctype, op, False, True) for op in ROWPAIR_OPS for info in wide]
    rowpair += [rowpair_finish_name(info.ctype) for info in wide]
    return [("pointwise.cu", pointwise), ("reduce.cu", reduce), ("scale.cu", scale),
            ("rowwise.cu", rowwise), ("rowclass.cu", rowclass), ("rowpair.cu", rowpair),
            ("bench.cu", ["cupyloss::hold_stream"])]


@functools.lru_cache(maxsize=None)
def _groups() -> dict:
    """(file, name expression) -> its compilation group: (functor, C type) in pointwise.cu for
    the flat kernels, and (functor, C type, mask) for its rows and reduce kernels and the flat
    ones with a mask.

    A loss's first call compiles only its own functor's kernels for its dtype (a few seconds),
    not every loss's, and a broadcast call only the kernels of its mask; other files are one
    group each."""
    groups = {}
    for functor in _registry.functors():
        for info in _dtypes.DTYPES.values():
            for name in pointwise_names(functor, info):
                group = (functor, info.ctype)
                last = name.rpartition(",")[2].strip(" >")
                if last not in ("true", "false"):   # a mask: rows, reduce, flat with const
                    group += (int(last),)
                groups[("pointwise.cu", name)] = group
    return groups


class Module:
    """A compiled kernels/ file: its functions by name expression (cupy.RawKernel objects)."""

    def __init__(self, raw, mangled: dict):
        self._raw = raw
        self._mangled = mangled

    def get_function(self, expression: str):
        return self._raw.get_function(self._mangled[expression])


def cache_dir() -> pathlib.Path:
    """Where compiled kernels are kept: $CUPYLOSS_CACHE_DIR, else cupyloss/ beside CuPy's own
    kernel cache ($CUPY_CACHE_DIR, default ~/.cupy/kernel_cache)."""
    import os

    env = os.environ.get("CUPYLOSS_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    cupy_dir = os.environ.get("CUPY_CACHE_DIR") or os.path.join("~", ".cupy", "kernel_cache")
    return pathlib.Path(cupy_dir).expanduser() / "cupyloss"


def _nvrtc_options() -> tuple[str, ...]:
    """OPTIONS plus the include folders CuPy's RawModule would add (its headers, CCCL's and the
    CUDA toolkit's, for cuda_fp16.h and cuda_bf16.h)."""
    from cupy._core import core

    return core.assemble_cupy_compiler_options(OPTIONS)


def compile_module(code: str, names: list[str]) -> Module:
    """Compile `code` with NVRTC for the current device and load it, through an on-disk cache.

    CuPy's RawModule appends -ftz=true to every compilation: float32 subnormal inputs and
    results would read and come out as zero, where torch keeps them (a bfloat16 loss of 3e-39
    would be 0).  The kernels are therefore compiled here with the same NVRTC that CuPy uses but
    with OPTIONS alone (IEEE subnormals, as CUDA and torch default to), and the cubin is loaded
    through RawModule(path=...), which compiles nothing.  The cache key is the source, the
    options, the architecture and the NVRTC version; entries are written atomically, so parallel
    processes (precompile) may race on one.
    """
    import hashlib
    import json
    import os
    import tempfile

    import cupy
    from cupy.cuda import compiler

    arch = cupy.cuda.Device().compute_capability
    options = _nvrtc_options()
    key = hashlib.sha256("\0".join(
        [code, *options, arch, str(cupy.cuda.nvrtc.getVersion()), *names]).encode())
    folder = cache_dir()
    cubin = folder / f"{key.hexdigest()}.cubin"
    mapping = cubin.with_suffix(".json")
    if not (cubin.is_file() and mapping.is_file()):
        binary, mangled = compiler.compile_using_nvrtc(code, options, arch,
                                                       name_expressions=names)
        if isinstance(binary, str):  # PTX, where NVRTC cannot build SASS for this device
            binary = binary.encode()
        folder.mkdir(parents=True, exist_ok=True)
        for path, data in ((mapping, json.dumps(mangled or {}).encode()), (cubin, binary)):
            fd, tmp = tempfile.mkstemp(dir=folder)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
    mangled = json.loads(mapping.read_text())
    return Module(cupy.RawModule(path=str(cubin)), mangled)


@functools.lru_cache(maxsize=None)
def module(name: str, group=None) -> Module:
    """The compiled kernels/`name` with the name expressions of `group` (compiled lazily; the
    whole file's when the file is not split into groups)."""
    groups = _groups()
    names = [e for e in dict(units())[name] if groups.get((name, e)) == group]
    return compile_module(expand(name), names)


@functools.lru_cache(maxsize=None)
def _function(name: str, expression: str, device_id: int):
    return module(name, _groups().get((name, expression))).get_function(expression)


def function(name: str, expression: str):
    """The kernel `expression` of kernels/`name` on the current device."""
    import cupy

    return _function(name, expression, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=None)
def _resident(name: str, expression: str, shared: int, block: int, device_id: int) -> int:
    from cupy_backends.cuda.api import driver

    kernel = _function(name, expression, device_id)
    if shared > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = shared
    return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, block,
                                                                    shared))


def resident(name: str, expression: str, shared: int = 0, block: int = _launch.BLOCK) -> int:
    """Blocks per SM of the kernel `expression` of kernels/`name` on the current device, with
    blocks of `block` threads and `shared` bytes of dynamic shared memory (the occupancy API).
    A kernel asked about more than the default 48 KiB is first allowed that much; its allowance
    only ever grows, so every launch planned before stays valid."""
    import cupy

    return _resident(name, expression, shared, block, cupy.cuda.runtime.getDevice())


def _compile_group(job) -> str:
    """Worker of precompile: load one group's module (compiling it into the on-disk cache)."""
    name, group = job
    expression = next(e for e in dict(units())[name] if _groups().get((name, e)) == group)
    module(name, group).get_function(expression)
    return f"{name} {group or ''}"


def precompile(processes: int | None = None) -> int:
    """Compile every kernel for the current GPU ahead of use, in parallel processes.

    compile_module keeps what NVRTC builds on disk (cache_dir), so later processes load the kernels
    instead of compiling them (about a second per name expression) at their first call: a
    warm-up for a test suite, a benchmark or a new machine.  Returns the number of modules.
    """
    import concurrent.futures
    import multiprocessing
    import os

    groups = _groups()
    jobs = [(name, None) for name, _ in units() if name != "pointwise.cu"]
    jobs += sorted({("pointwise.cu", group) for group in groups.values()})
    processes = processes or min(len(jobs), len(os.sched_getaffinity(0)))
    context = multiprocessing.get_context("spawn")  # each worker makes its own CUDA context
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        list(pool.map(_compile_group, jobs))
    return len(jobs)

