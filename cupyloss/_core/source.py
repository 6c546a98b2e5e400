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

from cupyloss._core import (
    dtypes as _dtypes, launch as _launch, registry as _registry, tuning as _tuning)

_HERE = pathlib.Path(__file__).resolve().parent.parent    # the cupyloss package
_CANDIDATES = (_HERE / "kernels", _HERE.parent / "kernels")
# Unannotated functions (the kernels' lambdas) are device functions: NVRTC 13.0 refuses them
# otherwise, where 13.5 accepts them.
_BASE_OPTIONS = ("--std=c++17", "--device-as-default-execution-space")
# What every kernel is compiled with on a GPU without a row in the launch table (_tuning): the
# base options and the default knobs.
OPTIONS = (*_BASE_OPTIONS, *_tuning.kernel_defines())


def options(gpu: str = "") -> tuple[str, ...]:
    """The compile options of the kernels for GPU `gpu` (a _tuning.gpu_key; "": the defaults):
    the base options and that GPU's compile-time knobs."""
    return (*_BASE_OPTIONS, *_tuning.kernel_defines(gpu))
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


_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_DEFINE = re.compile(r"#define\s+(\w+)\([^)]*\)((?:[^\n]*\\\n)*[^\n]*)")
_SCALAR = {"const", "long", "double", "unsigned", "int"}


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside <...> and (...)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += 1 if ch in "<(" else -1 if ch in ">)" else 0
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_SHAPES_AT = re.compile(r"^CUPYLOSS_FUNCTOR_SHAPES\(\)$", re.MULTILINE)


def source(name: str, gpu: str = "") -> str:
    """What NVRTC compiles of kernels/`name` for GPU `gpu` (a _tuning.gpu_key; "": the
    defaults): its expanded source (expand), with the launch table's functor shapes on that GPU
    (_tuning.functor_traits) written in where pointwise.cu's CUPYLOSS_FUNCTOR_SHAPES() line asks
    for them (a line that, left in, fails to compile)."""
    return _source(name, _tuning.own_fields(gpu))


@functools.lru_cache(maxsize=None)
def _source(name: str, own: tuple) -> str:
    """source() of a GPU whose own shape fields are `own` (_tuning.own_fields)."""
    code = expand(name)
    traits = None
    if _SHAPES_AT.search(code):
        traits = _tuning.functor_traits(_registry.functors(), own=own)
    return code if traits is None else _SHAPES_AT.sub(lambda _: traits, code, count=1)


@functools.lru_cache(maxsize=None)
def kernel_params(source: str, kernel: str) -> tuple[tuple[str, str], ...]:
    """(type, name) of each parameter of the __global__ function `kernel` as kernels/`source`
    declares it, parameter-list macros expanded: the one description of the kernel's words,
    which the host's layouts are built from (kernel_words)."""
    text = _COMMENT.sub(" ", expand(source))
    found = re.search(r"__global__[^;{]*?\b" + re.escape(kernel) + r"\s*\(", text)
    if found is None:
        raise LookupError(f"no __global__ function {kernel} in kernels/{source}")
    end, depth = found.end(), 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    body = text[found.end():end - 1]
    for name, expansion in _DEFINE.findall(text):
        body = re.sub(r"\b" + name + r"\s*\([^)]*\)", expansion.replace("\\\n", " "), body)
    params = []
    for decl in _split_top(body):
        name = re.findall(r"\w+", decl)[-1]
        params.append((" ".join(decl[:decl.rfind(name)].split()), name))
    return tuple(params)


_ENUM = re.compile(r"\benum\s*(?::[\w\s]+)?\{([^}]*)\}\s*;")  # unscoped: `enum class` is not
_CONSTEXPR = re.compile(r"^\s*(?:__host__\s+__device__\s+)?constexpr\s+(?:int|long long)\s+(\w+)"
                        r"\s*=\s*(-?\d+)\s*;", re.MULTILINE)
_DEFINE_INT = re.compile(r"^\s*#\s*define\s+(\w+)\s+(-?\d+)\s*$", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def kernel_constants(source: str) -> dict[str, int]:
    """The integer constants kernels/`source` (its includes inlined) names: the members of its
    unscoped enums (flag bits, loss ids, variants), its namespace-scope `constexpr int`s and its
    `#define NAME <integer>`s.  The host reads its flag bits and ids from here, so the two sides
    cannot disagree on a value."""
    text = _COMMENT.sub(" ", expand(source))
    out: dict[str, int] = {}
    for body in _ENUM.findall(text):
        value = -1
        for item in filter(None, (i.strip() for i in body.split(","))):
            name, _, literal = (part.strip() for part in item.partition("="))
            if literal and not re.fullmatch(r"-?\d+", literal):
                raise ValueError(f"kernels/{source}: {name} = {literal} is not an integer literal")
            value = int(literal) if literal else value + 1
            out[name] = value
    for pattern in (_CONSTEXPR, _DEFINE_INT):
        out.update((name, int(v)) for name, v in pattern.findall(text))
    return out


def constants(source: str, *names: str) -> tuple[int, ...]:
    """The values of `names` among kernel_constants(source), in order."""
    known = kernel_constants(source)
    missing = [n for n in names if n not in known]
    if missing:
        raise LookupError(f"kernels/{source} names no constant {', '.join(missing)}")
    return tuple(known[n] for n in names)


@functools.lru_cache(maxsize=None)
def struct_fields(source: str, struct: str) -> tuple[tuple[str, str], ...]:
    """(type, name) of each field of `struct` as kernels/`source` declares it ("T* g[K]" gives
    ("T*", "g"))."""
    text = _COMMENT.sub(" ", expand(source))
    found = re.search(r"\bstruct\s+(?:alignas\([^)]*\)\s*)?" + re.escape(struct) + r"\s*\{",
                      text)
    if found is None:
        raise LookupError(f"no struct {struct} in kernels/{source}")
    body = text[found.end():text.index("}", found.end())]
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        decl = re.sub(r"\[[^]]*\]", "", decl)
        name = re.findall(r"\w+", decl)[-1]
        fields.append((" ".join(decl[:decl.rfind(name)].split()), name))
    return tuple(fields)


def _is_pointer(ctype: str) -> bool:
    return ctype.replace("__restrict__", "").rstrip().endswith("*")


def kernel_words(source: str, kernel: str, sizes: dict | None = None,
                 fields: dict | None = None) -> list[tuple[str, int, bool]]:
    """`kernel`'s parameters as _args.Layout takes them, named as the kernel names them: one
    64-bit word a scalar or pointer; `sizes` gives the words of a struct parameter written as a
    whole, `fields` the (field, words) of one written field by field (named "param.field"),
    checked against the struct's own fields in order.  Each entry says whether its words are
    addresses: a pointer parameter or field, or a struct of pointers (PerOperand<const T*, K>),
    so that code rewriting addresses (the JAX replay) touches nothing else.  A parameter of
    another type named in neither raises: no struct passes for one word."""
    sizes, fields = sizes or {}, fields or {}
    out: list[tuple[str, int, bool]] = []
    for ctype, name in kernel_params(source, kernel):
        if name in fields:
            struct = re.sub(r"^const\s+", "", ctype).partition("<")[0].strip()
            declared = struct_fields(source, struct)
            if [f for f, _ in fields[name]] != [n for _, n in declared]:
                raise TypeError(f"{kernel}'s {name} is a {struct} of fields "
                                f"{[n for _, n in declared]}, not {[f for f, _ in fields[name]]}")
            out += [(f"{name}.{field}", words, _is_pointer(t))
                    for (field, words), (t, _) in zip(fields[name], declared)]
        elif name in sizes:
            args = ctype.partition("<")[2]
            out.append((name, sizes[name], _is_pointer(_split_top(args.rpartition(">")[0])[0])
                        if args else False))
        elif _is_pointer(ctype) or set(ctype.split()) <= _SCALAR:
            out.append((name, 1, _is_pointer(ctype)))
        else:
            raise TypeError(f"{kernel}'s parameter {name} is a {ctype}: give its words")
    unknown = (set(sizes) | set(fields)) - {name for _, name in kernel_params(source, kernel)}
    if unknown:
        raise TypeError(f"{kernel} has no parameter {sorted(unknown)[0]}")
    return out


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


@functools.lru_cache(maxsize=None)
def fixed_terms_functors() -> frozenset:
    """The functors of kernels/losses.cuh that declare fixed terms (``fixed_terms = true``:
    arithmetic on operands that stay the same across a thread's loop, formed once before it)."""
    text = expand("losses.cuh")
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^struct (\w+) \{", text, re.M)]
    bodies = zip(starts, starts[1:] + [(len(text), "")])
    return frozenset(name for (a, name), (b, _) in bodies
                     if "static constexpr bool fixed_terms = true;" in text[a:b])


def flat_masks(functor: str) -> tuple:
    """The stride-0 masks pointwise_flat's vector gradient kernel is compiled for with functor
    `functor`: its masks where it has fixed terms, which the kernel then forms once
    (docs/tuning.md, "The functors' code"), none otherwise: the kernel reads a
    stride-0 operand once either way, and what else the compiler would hoist is arithmetic a
    memory-bound loop hides."""
    if functor.partition("<")[0] not in fixed_terms_functors():
        return ()
    return _registry.reduce_masks(functor)


def pointwise_names(functor: str, info) -> list[str]:
    """Every pointwise kernel of one functor and dtype: flat, scalar and vector, value-only and
    with gradients; the vector flat kernel with gradients for each of its flat_masks; and for
    each of its masks (the operands read once per unit or row) the vector rows kernel,
    value-only and with gradients (rows of whole vectors; the others take reduce), and reduce,
    scalar and vector."""
    vecs = sorted({1, info.vec})
    masks = _registry.reduce_masks(functor)
    return ([pointwise_name("flat", info.ctype, functor, vec, grad)
             for vec in vecs for grad in (False, True)]
            + ([pointwise_name("flat", info.ctype, functor, info.vec, True, const)
                for const in flat_masks(functor)] if info.vec > 1 else [])
            + [pointwise_name("rows", info.ctype, functor, info.vec, grad, const)
               for const in masks for grad in (False, True)]
            + [pointwise_reduce_name(info.ctype, functor, vec, const)
               for const in masks for vec in vecs])


def reduce_name(kernel: str, ctype: str) -> str:
    """Name expression of a reduce.cu kernel (sum_chunks<ctype>)."""
    return f"cupyloss::{kernel}<{ctype}>"


def scale_name(ctype: str, vec: int) -> str:
    """Name expression of scale.cu's scale_by_grad_output<ctype, vec> (the torch adapter's)."""
    return f"cupyloss::scale_by_grad_output<{ctype}, {vec}>"


def narrow_name(ctype: str) -> str:
    """Name expression of scale.cu's narrow<ctype> (float32 rounded to a 16-bit ctype)."""
    return f"cupyloss::narrow<{ctype}>"


def split_names(ctype: str) -> list[str]:
    """Name expressions of scale.cu's split float32 sum (split_add, split_finish<ctype>): the
    weight gradient of a 16-bit ctype summed over chunks of rows (cupyloss.linear)."""
    return ["cupyloss::split_add", f"cupyloss::split_finish<{ctype}>"]


ROWWISE_KERNELS = ("cross_entropy_rows", "cross_entropy_cols", "class_weight_sum",
                   "cross_entropy_slice_stats", "cross_entropy_combine",
                   "cross_entropy_slice_grad")
# cross_entropy_rows's MODEs (_rowwise.MODE_*); the ones with a gradient held over a cluster's
# blocks; the class-index gradients, which may be stored rounded to 16 bits.
ROWWISE_MODES = constants("rowwise.cu", "MODE_FORWARD", "MODE_GRAD", "MODE_GENERAL", "MODE_NLL",
                          "MODE_SMOOTH", "MODE_PROB", "MODE_CAP")
ROWWISE_CLUSTER_MODES = constants("rowwise.cu", "MODE_GRAD", "MODE_GENERAL", "MODE_SMOOTH",
                                  "MODE_PROB", "MODE_CAP")
ROWWISE_NARROW_MODES = constants("rowwise.cu", "MODE_GRAD", "MODE_GENERAL", "MODE_SMOOTH",
                                 "MODE_CAP")


def rowwise_name(kernel: str, ctype: str, mode: int = 2, cluster: int = 1,
                 gtype: str | None = None) -> str:
    """Name expression of a rowwise.cu kernel: cross_entropy_rows<ctype, mode> (0 the class-index
    loss alone, 1 with its gradient, 2 a softcap with label smoothing or probability targets,
    3 nll_loss, 4 class indices with label smoothing, 5 probability targets, 6 class indices
    with a softcap), or with cluster > 1
    cross_entropy_rows_cluster<ctype, mode, cluster> (a cluster of that many blocks a row), either
    with a last argument gtype when the gradient is stored as another type (float32 logits, a
    16-bit gradient); cross_entropy_slice_grad<ctype, gtype>; the others <ctype>."""
    g = f", {gtype}" if gtype is not None and gtype != ctype else ""
    if kernel == "cross_entropy_rows" and cluster > 1:
        return f"cupyloss::cross_entropy_rows_cluster<{ctype}, {mode}, {cluster}{g}>"
    if kernel == "cross_entropy_rows":
        return f"cupyloss::{kernel}<{ctype}, {mode}{g}>"
    if kernel == "cross_entropy_slice_grad":
        return f"cupyloss::{kernel}<{ctype}, {gtype or ctype}>"
    return f"cupyloss::{kernel}<{ctype}>"


ROWCLASS_LOSSES = (0, 1, 2, 3)   # LOSS_MULTI_MARGIN, LOSS_MULTILABEL, LOSS_JSD,
                                 # LOSS_MULTILABEL_MARGIN in rowclass.cu


def rowclass_name(kernel: str, ctype: str, loss: int = 0) -> str:
    """Name expression of a rowclass.cu kernel: rowclass_rows<ctype, loss>, rowclass_count<ctype>."""
    if kernel == "rowclass_rows":
        return f"cupyloss::{kernel}<{ctype}, {loss}>"
    return f"cupyloss::{kernel}<{ctype}>"


ROWPAIR_OPS = ("TripletOp", "TripletP2Op", "CosineOp")


def rowpair_name(ctype: str, op: str, grad: bool, wide: bool = False) -> str:
    """Name expression of rowpair.cu's rowpair_rows<ctype, op, grad, wide>."""
    flag = {True: "true", False: "false"}
    return f"cupyloss::rowpair_rows<{ctype}, cupyloss::{op}, {flag[grad]}, {flag[wide]}>"


def rowpair_finish_name(ctype: str) -> str:
    """Name expression of rowpair.cu's rowpair_finish<ctype>."""
    return f"cupyloss::rowpair_finish<{ctype}>"


CTC_KERNELS = ("ctc_alpha", "ctc_finish", "ctc_beta", "ctc_grad")


def ctc_name(kernel: str, ctype: str) -> str:
    """Name expression of a ctc.cu kernel (ctc_alpha, ctc_finish, ctc_beta, ctc_grad)."""
    return f"cupyloss::{kernel}<{ctype}>"


def units() -> list[tuple[str, list[str]]]:
    """Every instantiation a call can run, by source file: (file, its name expressions)."""
    infos = list(_dtypes.DTYPES.values())
    pointwise = [name for functor in _registry.functors() for info in infos
                 for name in pointwise_names(functor, info)]
    reduce = [reduce_name("sum_chunks", info.ctype) for info in infos]
    scale = [scale_name(info.ctype, vec) for info in infos for vec in sorted({1, info.vec})]
    scale += [narrow_name(info.ctype) for info in infos if info.dtype.itemsize == 2]
    scale += list(dict.fromkeys(name for info in infos if info.dtype.itemsize == 2
                                for name in split_names(info.ctype)))
    rowwise = [name for info in infos for name in rowwise_names(info)]
    rowwise += [name for info in infos for name in linear_names(info)
                if name not in rowwise]
    rowclass = [name for info in infos for loss in ROWCLASS_LOSSES
                for name in rowclass_names(info, loss)]
    rowpair = [name for op in ROWPAIR_OPS for info in infos for name in rowpair_names(info, op)]
    ctc = [ctc_name(kernel, info.ctype) for info in infos for kernel in CTC_KERNELS]
    logprob = list(dict.fromkeys(name for info in infos for name in logprob_names(info)))
    return [("logprob.cu", logprob), ("pointwise.cu", pointwise), ("reduce.cu", reduce), ("scale.cu", scale),
            ("rowwise.cu", rowwise), ("rowclass.cu", list(dict.fromkeys(rowclass))),
            ("rowpair.cu", list(dict.fromkeys(rowpair))), ("ctc.cu", ctc), ("bench.cu", ["cupyloss::hold_stream",
                                          *(bench_streams_name(r, w) for r, w in BENCH_STREAMS)])]


BENCH_STREAMS = ((1, 1), (2, 2), (2, 0))   # bench.bandwidth's mixes: arrays read, written


def bench_streams_name(reads: int, writes: int) -> str:
    """Name expression of bench.cu's streams<reads, writes> (bench_bandwidth)."""
    return f"cupyloss::streams<{reads}, {writes}>"


def rowwise_names(info) -> list[str]:
    """Every rowwise.cu kernel of one dtype (cross_entropy and nll_loss reach them all; the
    slice kernels through vocab-parallel cross entropy, cupyloss.parallel)."""
    names = [rowwise_name(kernel, info.ctype, mode) for kernel in ROWWISE_KERNELS
             for mode in (ROWWISE_MODES if kernel == "cross_entropy_rows" else (2,))]
    return names + [rowwise_name("cross_entropy_rows", info.ctype, mode, kc)
                    for mode in ROWWISE_CLUSTER_MODES for kc in _launch.ROW_CLUSTER_SIZES]


def linear_names(info) -> list[str]:
    """The rowwise.cu kernels the fused linear cross entropy runs on inputs of `info`'s dtype:
    every kernel of its logits' dtype (float32; float64 for float64), the class-index gradients
    stored rounded to a 16-bit input's dtype, and the slice gradient of its low-memory plan."""
    logits = _dtypes.lookup("float64" if info.dtype.itemsize == 8 else "float32")
    names = rowwise_names(logits)
    if info.dtype.itemsize == 2:
        names += [rowwise_name("cross_entropy_rows", logits.ctype, mode, kc, info.ctype)
                  for mode in ROWWISE_NARROW_MODES
                  for kc in (1, *(() if mode == 0 else _launch.ROW_CLUSTER_SIZES))]
    return names + [rowwise_name("cross_entropy_slice_grad", logits.ctype, gtype=info.ctype)]


def logprob_names(info) -> list[str]:
    """The logprob.cu kernels linear_log_probs (and linear_grpo_loss) runs on inputs of
    `info`'s dtype: the statistics of its logits' dtype (float32; float64 for float64), the
    gradient stored in the logits' dtype and, for 16-bit inputs, in theirs, the policy
    objective's per-token step and the distillation's statistics and gradient."""
    logits = "double" if info.dtype.itemsize == 8 else "float"
    grads = dict.fromkeys((logits, info.ctype if info.dtype.itemsize == 2 else logits))
    return [f"cupyloss::logprob_stats<{logits}>",
            *(f"cupyloss::logprob_grad<{logits}, {g}>" for g in grads),
            f"cupyloss::grpo_tokens<{logits}>", f"cupyloss::distill_stats<{logits}>",
            *(f"cupyloss::distill_grad<{logits}, {g}>" for g in grads)]


def rowclass_names(info, loss: int) -> list[str]:
    """The rowclass.cu kernels of one loss (LOSS_*) and dtype."""
    return [rowclass_name("rowclass_rows", info.ctype, loss),
            rowclass_name("rowclass_count", info.ctype)]


def rowpair_names(info, op: str) -> list[str]:
    """The rowpair.cu kernels of one functor and dtype: with and without gradients, and the
    wide form with its finish where the element size takes it."""
    names = [rowpair_name(info.ctype, op, grad) for grad in (False, True)]
    if info.dtype.itemsize in _launch.PAIR_WIDE_ITEMSIZES:
        names += [rowpair_name(info.ctype, op, False, True), rowpair_finish_name(info.ctype)]
    return names


# Losses outside the registry's families, built from their kernels: the fused linear cross
# entropy (cupyloss.linear).
FUSED_LOSSES = ("linear_cross_entropy", "linear_log_probs", "linear_grpo_loss", "linear_jsd",
                "linear_preference_loss")


def reachable(loss: str, dtype) -> list[tuple[str, str]]:
    """(file, name expression) of every kernel a call of `loss` on `dtype` can run, the torch
    adapter's grad_output scaling included: what precompile builds for that loss."""
    info = _dtypes.lookup(dtype)
    if info is None:
        raise TypeError(f"cupyloss has no kernels for dtype {dtype}")
    if loss in FUSED_LOSSES:            # cupyloss.linear: rowwise.cu on float32 logits
        out = ([("rowwise.cu", name) for name in linear_names(info)]
               if loss == "linear_cross_entropy"
               else [("logprob.cu", name) for name in logprob_names(info)])
        if info.dtype.itemsize == 2:
            out.append(("scale.cu", narrow_name(info.ctype)))
            out += [("scale.cu", name) for name in split_names(info.ctype)]
        return out
    losses = _registry.all_losses()
    if loss not in losses:
        raise ValueError(f"unknown loss {loss!r}; the losses are {', '.join(losses)}")
    spec = losses[loss]
    out = [("scale.cu", scale_name(info.ctype, vec)) for vec in sorted({1, info.vec})]
    if loss in _registry.SPECS:
        out.append(("reduce.cu", reduce_name("sum_chunks", info.ctype)))
        out += [("pointwise.cu", name) for functor in spec.instances()
                for name in pointwise_names(functor, info)]
    elif getattr(spec, "source", None) == "ctc.cu":     # ctc_loss (cupyloss.ctc._family)
        out += [("ctc.cu", ctc_name(kernel, info.ctype)) for kernel in CTC_KERNELS]
    elif hasattr(spec, "op"):           # row-pair losses (cupyloss.rowpair._family)
        out += [("rowpair.cu", name) for op in filter(None, (spec.op, spec.p2_op))
                for name in rowpair_names(info, op)]
    elif hasattr(spec, "loss"):         # row-class losses (cupyloss.rowclass._family)
        out += [("rowclass.cu", name) for name in rowclass_names(info, spec.loss)]
    else:                               # cross_entropy, nll_loss (cupyloss.rowwise._family)
        out += [("rowwise.cu", name) for name in rowwise_names(info)]
    return out


def cache_dir() -> pathlib.Path:
    """Where compiled kernels are kept: $CUPYLOSS_CACHE_DIR, else cupyloss/ beside CuPy's own
    kernel cache ($CUPY_CACHE_DIR, default ~/.cupy/kernel_cache)."""
    import os

    env = os.environ.get("CUPYLOSS_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    cupy_dir = os.environ.get("CUPY_CACHE_DIR") or os.path.join("~", ".cupy", "kernel_cache")
    return pathlib.Path(cupy_dir).expanduser() / "cupyloss"


def _nvrtc_options(gpu: str = "") -> tuple[str, ...]:
    """options(gpu) plus the include folders CuPy's RawModule would add (its headers, CCCL's and
    the CUDA toolkit's, for cuda_fp16.h and cuda_bf16.h)."""
    from cupy._core import core

    return core.assemble_cupy_compiler_options(options(gpu))


def _nvrtc(code: str, options: tuple, arch: str, names: list[str]) -> tuple[bytes, dict]:
    """(cubin, {name expression: lowered name}) of `code` built by NVRTC for sm_`arch`.  Needs
    libnvrtc alone, no GPU, so kernels can be built ahead of use on any machine."""
    from cupy.cuda import compiler, nvrtc

    program = nvrtc.createProgram(code, "cupyloss.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, (*options, f"-arch=sm_{arch}"))
        except nvrtc.NVRTCError:
            raise compiler.CompileException(nvrtc.getProgramLog(program), code, "cupyloss.cu",
                                            options, "nvrtc") from None
        mangled = {name: nvrtc.getLoweredName(program, name) for name in names}
        return nvrtc.getCUBIN(program), mangled
    finally:
        nvrtc.destroyProgram(program)


@functools.lru_cache(maxsize=None)
def nvrtc_build() -> str:
    """The NVRTC this process compiles with: its version and the loaded library's file (path,
    size, modification time), so that an update of the library within one major.minor (a new
    wheel, a new toolkit) keys new cache entries."""
    import os

    from cupy.cuda import nvrtc

    version = ".".join(map(str, nvrtc.getVersion()))
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split(None, 5)[-1].strip() for line in maps
                            if "libnvrtc" in line and "builtins" not in line})
    except OSError:
        paths = []
    for path in paths[:1]:
        try:
            st = os.stat(path)
        except OSError:
            continue
        return f"{version} {path} {st.st_size} {st.st_mtime_ns}"
    return version


class CacheWarning(UserWarning):
    """A kernel cache folder or entry was passed over (not owned by this user or root, or
    writable by others)."""


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread):
    /proc/self/status, else the common 0o022."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _safe(st, uid: int) -> bool:
    """A file or folder status that only its owner can write: owned by this user or root, and
    neither group- nor world-writable."""
    import stat

    return st.st_uid in (uid, 0) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


_WARNED: set = set()


def trusted(folder: pathlib.Path) -> bool | None:
    """Whether kernels may be loaded from and written to `folder`: True where it is a folder
    owned by this user or root that no one else can write, None where it does not exist yet
    (this process may make it), False (with a CacheWarning, once a folder) otherwise: a folder
    another user could have planted code in."""
    import os
    import stat
    import warnings

    try:
        st = os.stat(folder)   # a link to a folder: the folder's own owner and mode decide
    except FileNotFoundError:
        return None
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode) and _safe(st, os.getuid()):
        return True
    if folder not in _WARNED:
        _WARNED.add(folder)
        warnings.warn(f"cupyloss: kernel cache folder {folder} is not used: it must be a folder "
                      f"owned by you or root that no one else can write (owner uid {st.st_uid}, "
                      f"mode {stat.filemode(st.st_mode)})", CacheWarning, stacklevel=3)
    return False


def _read_entry(folder: pathlib.Path, key: str) -> tuple[bytes, dict] | None:
    """(cubin, {name: mangled}) of entry `key` in the trusted `folder`, read once each and
    verified against the hash its mapping holds; None where it is absent, unreadable, not a
    plain file owned by this user or root and closed to others' writes, or damaged (a
    truncated or half-written file): the caller compiles it again and rewrites it."""
    import hashlib
    import json
    import os
    import stat

    uid = os.getuid()
    record = None
    try:
        for path in (folder / f"{key}.json", folder / f"{key}.cubin"):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or not _safe(st, uid):
                return None
        record = json.loads((folder / f"{key}.json").read_bytes())
        binary = (folder / f"{key}.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("names"), dict) or \
            record.get("sha256") != hashlib.sha256(binary).hexdigest():
        return None
    return binary, record["names"]


def _write_entry(folder: pathlib.Path, key: str, binary: bytes, mangled: dict) -> None:
    """Entry `key` into `folder`: each file written under a temporary name, flushed to disk and
    renamed into place, the mapping (with the binary's hash) last, so that processes sharing the
    folder find an entry whole or not at all; read by every user the umask lets read it, written
    by its owner alone.  A temporary file left by an error is removed."""
    import hashlib
    import json
    import os
    import tempfile

    mode = 0o666 & ~_umask() & ~0o022
    if trusted(folder) is None:
        folder.mkdir(parents=True, exist_ok=True, mode=mode | 0o111 & ~_umask())
    if not trusted(folder):
        raise PermissionError(13, "not a folder only its owner can write", str(folder))
    record = {"names": mangled, "sha256": hashlib.sha256(binary).hexdigest()}
    for path, data in ((folder / f"{key}.cubin", binary),
                       (folder / f"{key}.json", json.dumps(record).encode())):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fchmod(fh.fileno(), mode)
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _key(file: str, names: list[str], arch: str, gpu: str) -> tuple[str, str, tuple]:
    """(the cache key, the code, its flags) of kernels/`file` holding `names` for sm_`arch`."""
    import hashlib

    code = source(file, gpu)
    flags = _nvrtc_options(gpu)
    key = hashlib.sha256("\0".join([code, *flags, arch, nvrtc_build(), *names]).encode())
    return key.hexdigest(), code, flags


def load(file: str, names: list[str], arch: str, gpu: str = "", *,
         fresh: bool = False) -> tuple[pathlib.Path, bytes, dict]:
    """(where it is kept, the cubin, {name: mangled symbol}) of kernels/`file` holding `names`
    for sm_`arch` with GPU `gpu`'s knobs of the launch table (options(gpu)): read from the cache
    (cache_dir, then private_dir) where a verified entry is there, else compiled and written to
    the first of the two that takes it.  `fresh`: compile and rewrite even where an entry
    verifies (one the driver failed to load).

    The kernels are compiled with the NVRTC CuPy uses but with OPTIONS alone: CuPy's RawModule
    appends -ftz=true, which would read and write float32 subnormals as zero where torch keeps
    them (a bfloat16 loss of 3e-39 would be 0).  The key is the source (source()), the options,
    the architecture, the NVRTC build (nvrtc_build) and the names.  Only folders this user or
    root owns and no one else can write are read or written (trusted); a cache folder that
    cannot be written (a read-only one filled by precompile) is still read, and what it lacks
    goes to private_dir().
    """
    key, code, flags = _key(file, names, arch, gpu)
    folders = [f for f in (cache_dir(), private_dir()) if trusted(f) is not False]
    if not fresh:
        for folder in folders:
            found = _read_entry(folder, key)
            if found is not None:
                return folder / f"{key}.cubin", *found
    binary, mangled = _nvrtc(code, flags, arch, names)
    for folder in folders:   # a shared folder this process cannot write: its own instead
        try:
            _write_entry(folder, key, binary, mangled)
            return folder / f"{key}.cubin", binary, mangled
        except OSError:
            if folder is folders[-1]:
                raise
    raise PermissionError(13, "no kernel cache folder this user alone can write",
                          str(private_dir()))


def cached(file: str, names: list[str], arch: str, gpu: str = "") -> pathlib.Path:
    """Where the cubin of kernels/`file` holding `names` for sm_`arch` is kept, compiled into
    the cache unless a verified entry is there (load); a .json beside it maps the names to
    their mangled symbols and holds the cubin's hash."""
    return load(file, names, arch, gpu)[0]


_PRIVATE: list = []


def private_dir() -> pathlib.Path:
    """This user's own folder for kernels that cache_dir() cannot take (read-only, say a folder
    an image was built with): $XDG_CACHE_HOME/cupyloss (default ~/.cache/cupyloss), or, where
    that is not this user's to write, a folder made for this process by mkdtemp."""
    import os
    import tempfile

    if _PRIVATE:
        return _PRIVATE[0]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = pathlib.Path(base) / "cupyloss"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        ok = trusted(folder) and os.access(folder, os.W_OK)
    except OSError:
        ok = False
    if not ok:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="cupyloss-"))
    _PRIVATE.append(folder)
    return folder


@functools.lru_cache(maxsize=None)
def _function(name: str, expression: str, device_id: int):
    """One instantiation on device `device_id`, compiled on demand as its own NVRTC program (a
    call compiles only the kernels it runs) and loaded from the cache."""
    import cupy

    with cupy.cuda.Device(device_id) as device:
        arch, gpu = device.compute_capability, _launch.device_limits(device_id).gpu
        for fresh in (False, True):
            path, _, mangled = load(name, [expression], arch, gpu, fresh=fresh)
            module = cupy.RawModule(path=str(path))
            kernel = module.get_function(mangled[expression])
            try:
                kernel.kernel          # loads the module now
                if name in COUNTING:
                    COUNTED.append((device_id, module))
                return kernel
            except cupy.cuda.driver.CUDADriverError:
                if fresh:           # verified, built again, and still refused by the driver
                    raise


# The kernel files whose modules count rejected class targets (rows.cuh's
# cupyloss_rejected_targets), and each such module loaded: (device, RawModule).
COUNTING = ("rowwise.cu", "rowclass.cu")
COUNTED: list = []


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
