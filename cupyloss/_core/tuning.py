"""The launch table: the kernels' schedule knobs, one value per GPU.

A knob is a launch choice that is not the loss's math: steps of loads in flight, blocks per SM a
kernel's registers are bounded for, a grid's waves.  Each has a default (measured on an H100,
docs/tuning.md gives the runs) and, for a GPU that was tuned, that GPU's own value, read from
``tuning.csv`` beside this file (rows ``gpu,knob,value``; written by ``python -m cupyloss.tools.tune``,
whose measurements are kept under benchmarks/results/).  A GPU is keyed by its name as CUDA
reports it, normalised by gpu_key ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3").

Compile-time knobs reach the kernels as -D macros (kernel_defines), so a GPU with its own row
has its own cubins (the compile options are part of the cache key); run-time knobs are read by
the launch arithmetic from DeviceLimits.gpu.  A loss's own shape (FUNCTOR_SHAPES) is per GPU
too: a row "gpu,<functor template>.<field>,value" (FUNCTOR_FIELDS) replaces that field of its
entry on that GPU, in the functor traits written into pointwise.cu for it (functor_traits).

A tuned GPU's rows also give its traits (TRAITS: compute capability, SMs, DRAM bandwidth as
its memory clock and bus width give it), and a GPU without a row of its own runs the row of
the tuned GPU nearest to it (`nearest_row`): of its compute capability's major version, the
closest in DRAM bandwidth per SM (the bytes an SM must keep in flight scale with it, and the
knobs are loads in flight, blocks an SM and waves).  With none of its major version, or its
traits unknown, it runs the defaults.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import pathlib
import re

__all__ = ["Knob", "KNOBS", "TRAITS", "FunctorShape", "FUNCTOR_SHAPES", "FUNCTOR_FIELDS",
           "gpu_key", "values", "value", "knob", "functor_knob", "functor_shapes", "own_fields",
           "kernel_defines", "functor_traits", "nearest_row", "adopt", "TABLE"]

TABLE = pathlib.Path(__file__).resolve().parent / "tuning.csv"


@dataclasses.dataclass(frozen=True)
class Knob:
    """One schedule choice: its `default`, whether it is compiled into the kernels (a -D macro
    CUPYLOSS_<name>) or read at launch, the values `python -m cupyloss.tools.tune` tries, and what it
    sets."""

    name: str
    default: int
    compiled: bool
    candidates: tuple[int, ...]
    what: str


# The defaults are the values measured best on an H100 (docs/tuning.md, the section named).
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("REDUCE_STEPS", 4, True, (1, 2, 4, 8),
         "pointwise_reduce: VEC steps of loads in flight a lane, cheap functors"),
    Knob("REDUCE_STEPS_HEAVY", 1, True, (1, 2, 4),
         "pointwise_reduce: the same, heavy functors"),
    Knob("REDUCE_MIN_BLOCKS", 2, True, (1, 2, 3, 4),
         "pointwise_reduce: blocks per SM its registers are bounded for, cheap functors"),
    Knob("REDUCE_MIN_BLOCKS_HEAVY", 4, True, (2, 3, 4),
         "pointwise_reduce: the same, heavy functors"),
    Knob("ROWS_MIN_BLOCKS_GRAD", 2, True, (1, 2, 3, 4),
         "pointwise_rows gradient kernels: blocks per SM, cheap functors"),
    Knob("ROWS_MIN_BLOCKS_GRAD_CHEAP_16", 3, True, (2, 3, 4),
         "pointwise_rows: blocks per SM, cheap functors' 16-bit gradients"),
    Knob("ROWS_STEPS_GRAD_CHEAP_16", 1, True, (1, 2, 4),
         "pointwise_rows: row steps in flight, cheap functors' 16-bit gradients"),
    Knob("ROWS_MIN_BLOCKS_GRAD_HEAVY", 3, True, (2, 3, 4),
         "pointwise_rows gradient kernels: blocks per SM, heavy functors"),
    Knob("ROWS_STEPS_GRAD_HEAVY", 1, True, (1, 2, 4),
         "pointwise_rows gradient kernels: row steps in flight, heavy functors"),
    Knob("ROWS_MIN_BLOCKS_GRAD_STREAM", 2, True, (1, 2, 3),
         "pointwise_rows: blocks per SM, streaming functors on 4-byte elements"),
    Knob("ROWS_STEPS_GRAD_STREAM", 4, True, (2, 4, 8),
         "pointwise_rows: row steps in flight, streaming functors on 4-byte elements"),
    Knob("REDUCE_MIN_BLOCKS_STREAM", 2, True, (1, 2, 3),
         "pointwise_reduce: blocks per SM, streaming functors on 4-byte elements"),
    Knob("REDUCE_STEPS_STREAM", 4, True, (2, 4, 8),
         "pointwise_reduce: steps in flight, streaming functors on 4-byte elements"),
    Knob("FLAT_MIN_BLOCKS_GRAD_HEAVY", 4, True, (2, 3, 4),
         "pointwise_flat gradient kernels: blocks per SM, heavy functors"),
    Knob("FLAT_UNROLL_GRAD_HEAVY", 2, True, (1, 2, 4),
         "pointwise_flat gradient kernels: grid-stride steps at once, heavy functors"),
    Knob("GRAD_HEAVY_SIZES", (1 << 2) | (1 << 4) | (1 << 8), True, (),
         "element sizes (bit b: b bytes) whose heavy functors take the heavy shape"),
    Knob("FLAT_UNROLL_VALUE", 2, True, (1, 2, 4, 8),
         "pointwise_flat value-only kernels: grid-stride steps at once"),
    Knob("FLAT_UNROLL_VALUE_CHEAP", 8, True, (2, 4, 8),
         "pointwise_flat value-only float32 kernels of cheap functors: steps at once"),
    Knob("FLAT_UNROLL_GRAD", 2, True, (1, 2, 4),
         "pointwise_flat gradient kernels: grid-stride steps at once, cheap functors"),
    Knob("FLAT_STEPS_VALUE", 32, False, (8, 16, 32, 64),
         "pointwise_flat value-only grid: vectors a thread takes at most"),
    Knob("FLAT_STEPS_GRAD", 16, False, (8, 16, 32),
         "pointwise_flat gradient grid: vectors a thread takes at most"),
    Knob("ROWS_WAVES_VALUE", 4, False, (1, 2, 4, 8),
         "pointwise_rows value-only kernels (not summed): waves of resident blocks"),
    Knob("ROWS_TX_SUMMED", 32, False, (16, 32, 64),
         "pointwise_rows summed launches: threads a block of the row axis"),
    Knob("REDUCE_MIN_STEPS", 16, False, (8, 16, 32),
         "pointwise_reduce: VEC steps a lane makes at least in a unit"),
    Knob("ROW_MAX_SPLIT", 4, False, (2, 4, 8),
         "cross_entropy_rows with a gradient: blocks a row shares at most"),
    Knob("ROW_STASH_TILES", 3, False, (1, 2, 3, 4),
         "cross_entropy_rows with a gradient: tiles a block keeps in shared memory at most"),
    Knob("ROW_ALONE_STASH", 3, False, (1, 2, 3),
         "cross_entropy_rows with a gradient, where a cluster of two blocks may take a row: "
         "tiles a block keeps in shared memory at most when it holds a row alone (a longer row "
         "goes to a pair)"),
    Knob("ROW_PAIR_REREAD", 0, False, (0, 1, 2),
         "cross_entropy_rows with a gradient, a cluster of two blocks a row: tiles a block may "
         "read again from L2 rather than split the row over more blocks"),
    Knob("ROW_CLUSTERS", 1, False, (0, 1),
         "cross_entropy_rows: a row's blocks as a thread block cluster where k is a cluster size"),
    Knob("ROW_GRAD_TILES", 1, False, (1, 2),
         "cross_entropy_rows with a gradient, a row one block holds: tiles a thread takes (one "
         "kept in registers, the others read again)"),
    Knob("ROW_FORWARD_TEAM", 32, False, (16, 32, 64, 128),
         "cross_entropy_rows without a gradient, rowclass_rows: threads a row where rows are "
         "plenty"),
    Knob("PAIR_WIDE_GROUPS", 32, False, (8, 16, 32, 64),
         "rowpair_rows' wide form: row groups an SM at least"),
    Knob("PAIR_WIDE_ROW_BYTES", 32768, False, (8192, 16384, 32768, 65536),
         "rowpair_rows' wide form: bytes a row at least"),
)}


@dataclasses.dataclass(frozen=True)
class FunctorShape:
    """A loss's own place in the pointwise kernels' schedule, where its class's knobs spill or
    starve it (pointwise.cu's GradShape reads it, a loss's functor says nothing of it):

      cheap           a few instructions a value: the cheap functors' knobs (more loads in
                      flight), else the heavy ones' (more resident warps)
      stream          heavy, but its arithmetic on a broadcast operand leaves the loop, so on
                      4-byte elements the rows and reduce kernels take the *_STREAM knobs
      shape_f32       on 4-byte elements: (rows blocks, rows steps, reduce blocks, reduce
                      steps, pipelined loops), 0 for the knob's value; loops among "ROWS",
                      "REDUCE", "FLAT" (every flat gradient kernel), "FLAT_BROADCAST" (those
                      with a stride-0 operand compiled in)
      heavy_sizes     element sizes its heavy shape applies to (else GRAD_HEAVY_SIZES's)
      flat_blocks_16  blocks per SM its 16-bit pointwise_flat gradient kernel is bounded for
      rows_blocks_16  the same of its 16-bit pointwise_rows gradient kernel
      reduce_blocks   pointwise_reduce's bound, every element size (heavy or streaming)
    """

    cheap: bool = False
    stream: bool = False
    shape_f32: tuple = ()
    heavy_sizes: tuple[int, ...] = ()
    flat_blocks_16: int = 0
    rows_blocks_16: int = 0
    reduce_blocks: int = 0


_CHEAP = FunctorShape(cheap=True)
_ALL_LOOPS = ("ROWS", "REDUCE", "FLAT")
# Keyed by the functor template's name (every instantiation of it).  The runs that chose each:
# docs/tuning.md, "The functors' own shapes".
FUNCTOR_SHAPES: dict[str, FunctorShape] = {
    "MseOp": _CHEAP, "HingeOp": _CHEAP, "L1Op": _CHEAP, "SmoothL1Op": _CHEAP, "HuberOp": _CHEAP,
    "HingeEmbeddingOp": _CHEAP, "SquaredHingeOp": _CHEAP,
    # logs of every element whichever operand is broadcast: loads in flight while they run
    "KlDivOp": FunctorShape(shape_f32=(3, 2, 2, 4, ("ROWS", "REDUCE", "FLAT_BROADCAST"))),
    # 16-bit vectors of 8 spill under the heavy bound; unbounded, its 16-bit flat kernel holds
    # one block an SM; at 4 blocks its float64 reduce kernel's two logs spill
    "BceOp": FunctorShape(stream=True, shape_f32=(0, 0, 2, 4, _ALL_LOOPS), heavy_sizes=(4, 8),
                          flat_blocks_16=3, reduce_blocks=3),
    # four operands' bookkeeping spills at 4 blocks (16-bit and float64 reduce)
    "BceLogitsOp": FunctorShape(stream=True, shape_f32=(0, 0, 2, 4, _ALL_LOOPS),
                                rows_blocks_16=2, reduce_blocks=3),
    "SoftMarginOp": FunctorShape(stream=True, shape_f32=(3, 2, 0, 0, ("ROWS", "REDUCE"))),
    "MarginRankingOp": FunctorShape(shape_f32=(0, 0, 2, 4, ("REDUCE",))),
    "PoissonNllOp": FunctorShape(stream=True),
    "GaussianNllOp": FunctorShape(shape_f32=(0, 0, 2, 4, ())),
    "SigmoidFocalOp": FunctorShape(stream=True, shape_f32=(2, 2, 0, 0, ("ROWS", "REDUCE")),
                                   flat_blocks_16=3, rows_blocks_16=2),
    "LogCoshOp": FunctorShape(shape_f32=(2, 2, 2, 4, ("ROWS", "REDUCE", "FLAT_BROADCAST"))),
}


# A loss's own shape on one GPU: a row "gpu,<Template>.<field>,value" of the table puts `value`
# in that field of the template's FUNCTOR_SHAPES entry on that GPU alone (0, as in the entries:
# the class's knob).  The fields and the values python -m cupyloss.tools.tune tries; the _f32 ones are
# shape_f32's four numbers.
FUNCTOR_FIELDS: dict[str, tuple[int, ...]] = {
    "rows_blocks_f32": (0, 1, 2, 3, 4), "rows_steps_f32": (0, 1, 2, 4),
    "reduce_blocks_f32": (0, 1, 2, 3, 4), "reduce_steps_f32": (0, 1, 2, 4, 8),
    "flat_blocks_16": (0, 2, 3, 4), "rows_blocks_16": (0, 2, 3, 4), "reduce_blocks": (0, 2, 3, 4),
}
_F32_FIELDS = ("rows_blocks_f32", "rows_steps_f32", "reduce_blocks_f32", "reduce_steps_f32")


def _shape_field(shape: FunctorShape, field: str) -> int:
    if field in _F32_FIELDS:
        return shape.shape_f32[_F32_FIELDS.index(field)] if shape.shape_f32 else 0
    return getattr(shape, field)


def _with_field(shape: FunctorShape, field: str, v: int) -> FunctorShape:
    if field not in _F32_FIELDS:
        return dataclasses.replace(shape, **{field: v})
    *ints, loops = shape.shape_f32 or (0, 0, 0, 0, ())
    ints[_F32_FIELDS.index(field)] = v
    return dataclasses.replace(shape, shape_f32=(*ints, loops))


def functor_knob(name: str) -> Knob:
    """The Knob of a loss's own shape field, "<Template>.<field>" ("KlDivOp.reduce_blocks_f32"):
    its default is the FUNCTOR_SHAPES entry's value (0 where the entry has none).  ValueError for
    a field FUNCTOR_FIELDS lacks, a malformed template name, or a cheap functor's (the cheap
    knobs shape it whatever its entry says)."""
    template, _, field = name.partition(".")
    if field not in FUNCTOR_FIELDS or not re.fullmatch(r"[A-Z]\w*Op", template):
        raise ValueError(f"{name!r} is not <functor template>.<field> with a field of "
                         f"{', '.join(FUNCTOR_FIELDS)}")
    shape = FUNCTOR_SHAPES.get(template, FunctorShape())
    if shape.cheap:
        raise ValueError(f"{name}: {template} is cheap, so the cheap functors' knobs shape it")
    return Knob(name, _shape_field(shape, field), True, FUNCTOR_FIELDS[field],
                f"{template}'s {field} (FunctorShape)")


def knob(name: str) -> Knob:
    """A knob of the table by name: KNOBS' own, or a loss's shape field (functor_knob)."""
    return KNOBS[name] if name in KNOBS else functor_knob(name)


def own_fields(gpu: str = "") -> tuple[tuple[str, int], ...]:
    """GPU `gpu`'s own shape fields ((name, value), sorted): its row's, or its adopted row's,
    and tune's in this process; () for none."""
    return tuple(sorted((name, v) for name, v in values(gpu).items() if "." in name))


def functor_shapes(gpu: str = "", own: tuple | None = None) -> dict[str, FunctorShape]:
    """FUNCTOR_SHAPES with GPU `gpu`'s own fields (own_fields; or `own`, given) in place."""
    own = own_fields(gpu) if own is None else own
    if not own:
        return FUNCTOR_SHAPES
    shapes = dict(FUNCTOR_SHAPES)
    for name, v in own:
        template, _, field = name.partition(".")
        shapes[template] = _with_field(shapes.get(template, FunctorShape()), field, v)
    return shapes


def functor_traits(functors, gpu: str = "", own: tuple | None = None) -> str:
    """C++ of pointwise.cu's functor traits for each functor name expression in `functors`
    ("KlDivOp<1>") whose template has a FUNCTOR_SHAPES entry: explicit specializations, put
    where pointwise.cu says CUPYLOSS_FUNCTOR_SHAPES() (_source.source), with GPU `gpu`'s own
    fields (functor_shapes; or `own`, given)."""
    out = []
    shapes = functor_shapes(gpu, own)

    def spec(trait, functor, ctype, value):
        out.append(f"template <> struct {trait}<{functor}> {{ static constexpr {ctype} value = "
                   f"{value}; }};")

    for functor in functors:
        shape = shapes.get(functor.partition("<")[0])
        if shape is None:
            continue
        if shape.cheap:
            spec("IsCheap", functor, "bool", "true")
        if shape.stream:
            spec("StreamShape", functor, "bool", "true")
        if shape.shape_f32:
            *ints, loops = shape.shape_f32
            pipe = " | ".join(f"PIPE_{loop}" for loop in loops) or "0"
            spec("OwnShape32", functor, "Shape32",
                 f"Shape32{{{', '.join(map(str, ints))}, {pipe}}}")
        if shape.heavy_sizes:
            spec("HeavySizes", functor, "int", sum(1 << b for b in shape.heavy_sizes))
        if shape.flat_blocks_16:
            spec("FlatBlocks16", functor, "int", shape.flat_blocks_16)
        if shape.rows_blocks_16:
            spec("RowsBlocks16", functor, "int", shape.rows_blocks_16)
        if shape.reduce_blocks:
            spec("ReduceBlocksHeavy", functor, "int", shape.reduce_blocks)
            spec("ReduceBlocksStream", functor, "int", shape.reduce_blocks)
    return "\n".join(out)


def gpu_key(name: str) -> str:
    """A GPU's key in the table from the name CUDA reports: lower case, without the vendor,
    runs of other characters as one '-' ("NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3")."""
    name = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


# A tuned GPU's traits, rows of the table beside its knobs (lower case where knobs are upper):
# compute capability (90 for 9.0), SMs, DRAM bandwidth in GB/s (2 x memory clock x bus width).
TRAITS = ("compute_capability", "sm_count", "memory_gbs")


def _read(path: pathlib.Path) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """({gpu: {knob: value}}, {gpu: {trait: value}}) of a table file; a row naming neither a
    knob nor a trait, or a value the knob cannot take, is refused with the file and line."""
    table: dict[str, dict[str, int]] = {}
    traits: dict[str, dict[str, int]] = {}
    if not path.is_file():
        return table, traits
    with path.open(newline="") as fh:
        for line, row in enumerate(csv.DictReader(fh), 2):
            gpu, name = row["gpu"].strip(), row["knob"].strip()
            got = int(row["value"])
            if name in TRAITS:
                traits.setdefault(gpu, {})[name] = got
                continue
            try:
                knob = KNOBS[name] if "." not in name else functor_knob(name)
            except (KeyError, ValueError) as exc:
                why = exc.args[0] if isinstance(exc, ValueError) else (
                    f"no knob {name!r} (knobs: {', '.join(KNOBS)}; traits: {', '.join(TRAITS)}; "
                    f"a loss's shape: <functor template>.<field>)")
                raise ValueError(f"{path}:{line}: {why}") from None
            if knob.candidates and got not in knob.candidates:
                raise ValueError(f"{path}:{line}: {name} = {got} is not one of "
                                 f"{knob.candidates}")
            table.setdefault(gpu, {})[name] = got
    return table, traits


def read_table(path: pathlib.Path) -> dict[str, dict[str, int]]:
    """{gpu: {knob: value}} of a table file (its traits apart: read_traits)."""
    return _read(path)[0]


def read_traits(path: pathlib.Path) -> dict[str, dict[str, int]]:
    """{gpu: {trait: value}} of a table file."""
    return _read(path)[1]


@functools.lru_cache(maxsize=None)
def _both() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """The shipped table's (knobs, traits), read once (cache_clear to read it again)."""
    return _read(TABLE)


def _table() -> dict[str, dict[str, int]]:
    return _both()[0]


def nearest_row(traits: dict[str, int]) -> str:
    """The tuned GPU whose row a GPU of `traits` (TRAITS' names) runs when it has none: of the
    same compute capability major version, the nearest in DRAM bandwidth per SM (by ratio);
    "" (the defaults) where none has its major version or a trait is missing or 0."""
    def per_sm(t):
        return t.get("memory_gbs", 0) / max(t.get("sm_count", 0), 1)

    if not all(traits.get(t) for t in TRAITS):
        return ""
    mine = per_sm(traits)
    best, gap = "", math.inf
    for gpu, theirs in sorted(_both()[1].items()):
        if gpu not in _table() or not all(theirs.get(t) for t in TRAITS) or \
                theirs["compute_capability"] // 10 != traits["compute_capability"] // 10:
            continue
        d = abs(math.log(per_sm(theirs) / mine))
        if d < gap:
            best, gap = gpu, d
    return best


# GPUs met without a row of their own -> the row they run (adopt; DeviceLimits reads them).
_ADOPTED: dict[str, str] = {}
# In-process values for one GPU that take the place of its row (python -m cupyloss.tools.tune).
_OVERRIDES: dict[str, dict[str, int]] = {}


def adopt(gpu: str, traits: dict[str, int]) -> str:
    """Note GPU `gpu`'s traits: without a row of its own it runs nearest_row(traits)'s from
    now on.  Returns the row it runs ("" for the defaults)."""
    if gpu in _table():
        _ADOPTED.pop(gpu, None)
        return gpu
    _ADOPTED[gpu] = row = nearest_row(traits)
    return row


def values(gpu: str = "") -> dict[str, int]:
    """Every knob's value on GPU `gpu` (a gpu_key; "" for none: the defaults): its row, or the
    row it adopted, and over them what tune set for it in this process."""
    out = {name: knob.default for name, knob in KNOBS.items()}
    out.update(_table().get(_ADOPTED.get(gpu, gpu), {}))
    out.update(_OVERRIDES.get(gpu, {}))
    return out


def value(name: str, gpu: str = "") -> int:
    """Knob `name`'s value on GPU `gpu` (a loss's shape field: its entry's where the GPU's row
    has none)."""
    got = values(gpu)
    return got[name] if name in got else functor_knob(name).default


def kernel_defines(gpu: str = "") -> tuple[str, ...]:
    """The compile options that carry the compile-time knobs of GPU `gpu` into the kernels."""
    got = values(gpu)
    return tuple(f"-DCUPYLOSS_{name}={got[name]}" for name, knob in KNOBS.items()
                 if knob.compiled)
