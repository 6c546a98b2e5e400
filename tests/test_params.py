"""The host's parameter words against the kernels' declarations, without a GPU.

Every layout the engines pack is built from the kernel's own parameter list in kernels/
(_source.kernel_words), so its words carry the kernel's names in the kernel's order.  Here: the
parser reads those lists as declared, struct parameters written field by field follow the
struct's definition, a struct cannot pass for one word, and every name the engines write into a
layout is one of its names (a word renamed on one side only fails here, not on the GPU).  The
flag bits, loss ids and variants the engines pass are read from the kernels' enums
(_source.constants); the sizes the launch arithmetic shares with them are checked against theirs.
"""

import ast
import inspect
import re

import pytest

from cupyloss._core import launch as _launch, source as _source, tuning as _tuning
from cupyloss.pointwise import _family as _pointwise
from cupyloss.rowclass import _family as _rowclass
from cupyloss.rowpair import _family as _rowpair
from cupyloss.rowwise import _family as _rowwise
from cupyloss import linear, posttrain

# (module, its layouts, where they come from)
LAYOUTS = [
    (_rowwise, {"ROWS": ("rowwise.cu", "cross_entropy_rows"),
                "COLS": ("rowwise.cu", "cross_entropy_cols"),
                "WSUM": ("rowwise.cu", "class_weight_sum"),
                "SLICE": ("rowwise.cu", "cross_entropy_slice_grad"),
                "STATS": ("rowwise.cu", "cross_entropy_slice_stats"),
                "COMBINE": ("rowwise.cu", "cross_entropy_combine")}),
    (_rowclass, {"ROWS": ("rowclass.cu", "rowclass_rows"),
                 "COUNT": ("rowclass.cu", "rowclass_count")}),
    (_rowpair, {"LAYOUT": ("rowpair.cu", "rowpair_rows"),
                "FINISH_LAYOUT": ("rowpair.cu", "rowpair_finish")}),
    (linear, {"NARROW": ("scale.cu", "narrow"), "STATS": ("logprob.cu", "logprob_stats"),
              "GRAD": ("logprob.cu", "logprob_grad"), "SPLIT_ADD": ("scale.cu", "split_add"),
              "SPLIT_FINISH": ("scale.cu", "split_finish")}),
    (posttrain, {"TOKENS": ("logprob.cu", "grpo_tokens"),
                 "STATS": ("logprob.cu", "logprob_stats"),
                 "DISTILL_STATS": ("logprob.cu", "distill_stats"),
                 "DISTILL_GRAD": ("logprob.cu", "distill_grad")}),
    (_pointwise, {"SUM_CHUNKS": ("reduce.cu", "sum_chunks")}),
]
try:    # the torch adapter's own launch: scale_by_grad_output
    import cupyloss.torch as _torch_adapter

    LAYOUTS.append((_torch_adapter, {"SCALE": ("scale.cu", "scale_by_grad_output")}))
except ImportError:
    pass
POINTWISE = {"flat": "pointwise_flat", "rows": "pointwise_rows", "reduce": "pointwise_reduce"}


def _declared(source, kernel):
    """The kernel's parameter names read straight from its source text, a simpler reading than
    _source's: the identifier before each top-level comma of the declaration."""
    text = _source.expand(source)
    text = re.sub(r"//[^\n]*", "", text)
    start = re.search(r"__global__[^;{]*?\b" + kernel + r"\s*\(", text).end()
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    body = text[start:end - 1]
    macro = re.fullmatch(r"\s*(\w+)\(.*\)\s*", body, re.DOTALL)
    if macro:       # a parameter-list macro: its #define
        body = re.search(r"#define\s+" + macro.group(1) + r"\([^)]*\)((?:[^\n]*\\\n)*[^\n]*)",
                         text).group(1)
    names, depth, word = [], 0, ""
    for ch in body + ",":
        depth += ch in "<(" or -(ch in ">)")
        if ch == "," and depth == 0:
            names.append(re.findall(r"\w+", word)[-1])
            word = ""
        else:
            word += ch
    return names


@pytest.mark.parametrize("module, layouts", LAYOUTS, ids=lambda v: getattr(v, "__name__", ""))
def test_every_layout_is_the_kernels_parameter_list(module, layouts):
    for attr, (source, kernel) in layouts.items():
        layout = getattr(module, attr)
        assert list(layout.slot) == _declared(source, kernel), (attr, kernel)
        assert layout.size == len(layout.slot)       # one 64-bit word each


def _struct_fields(source, struct):
    """(name, array extent or None) of each field of `struct` in kernels/`source`."""
    text = re.sub(r"//[^\n]*", "", _source.expand(source))
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", text, re.DOTALL).group(1)
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"(\w+)\s*(?:\[(\w+)\])?\s*;", body)]


@pytest.mark.parametrize("kind", list(POINTWISE))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_pointwise_layouts_follow_the_kernels_and_their_structs(kind, k):
    layout = getattr(_pointwise, f"{kind}_layout")(k, 2)
    names = list(layout.slot)
    # Scalars<T, K>: its fields in order, g[K] K words
    fields = _struct_fields("pointwise.cu", "Scalars")
    assert [(f"o.{name}") for name, _ in fields] == [n for n in names if n.startswith("o.")]
    for name, extent in fields:
        at = names.index(f"o.{name}")
        after = layout.slot[names[at + 1]] if at + 1 < len(names) else layout.size
        assert after - layout.slot[f"o.{name}"] == (k if extent == "K" else 1), name
    # the rest: the declaration's names in its order, each as wide as its type
    declared = _declared("pointwise.cu", POINTWISE[kind])
    assert [n.split(".")[0] for n in names if not n.startswith("o.") or n == "o.value"] == \
        declared
    widths = {"in": k, "fill": k, "kind": k, "g": k, "ws": k, "p": 2,
              "geo": _launch.geometry_dtype(k + 1).itemsize // 8,
              "kept": _launch.geometry_dtype(k + 2).itemsize // 8,
              "red": _launch.geometry_dtype(k + 2).itemsize // 8}
    for at, name in enumerate(names):
        if name.startswith("o."):
            continue
        after = layout.slot[names[at + 1]] if at + 1 < len(names) else layout.size
        assert after - layout.slot[name] == widths.get(name, 1), name


def test_kernel_params_reads_types_and_names():
    params = dict((n, t) for t, n in _source.kernel_params("pointwise.cu", "pointwise_rows"))
    assert params["in"] == "const PerOperand<const T*, Op::K>"
    assert params["o"] == "const Scalars<T, Op::K>"
    assert params["col_tickets"] == "unsigned int* __restrict__"
    rows = dict((n, t) for t, n in _source.kernel_params("rowwise.cu", "cross_entropy_rows"))
    assert rows["gx"] == "G*" and rows["ignore_index"] == "const long long"
    with pytest.raises(LookupError, match="no __global__ function"):
        _source.kernel_params("rowwise.cu", "cross_entropy_row")


def test_a_struct_parameter_cannot_pass_for_one_word():
    with pytest.raises(TypeError, match="parameter in is a const PerOperand"):
        _source.kernel_words("pointwise.cu", "pointwise_flat")
    with pytest.raises(TypeError, match="has no parameter weights"):
        _source.kernel_words("rowwise.cu", "class_weight_sum", {"weights": 1})


def _written_names(module):
    """The constant names `module` writes into parameter words: keys of the dict literals given
    to Layout.template (or spread into one), and subscripts of slot tables; and per layout the
    module names (LAYOUT.template(...)), the keys given to its template."""
    tree = ast.parse(inspect.getsource(module))
    dicts = {}      # variable -> dict literal, per the names assigned in the module
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    dicts[target.id] = node.value
    found, per_layout = set(), {}

    def keys(d, into):
        for key, value in zip(d.keys, d.values):
            if key is None and isinstance(value, ast.Name) and value.id in dicts:
                keys(dicts[value.id], into)
            elif isinstance(key, ast.Constant):
                into.add(key.value)

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "template" and node.args
                and isinstance(node.args[0], ast.Dict)):
            given = set()
            keys(node.args[0], given)
            found |= given
            if isinstance(node.func.value, ast.Name):
                per_layout.setdefault(node.func.value.id, set()).update(given)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, str):
            table = node.value
            if (isinstance(table, ast.Name) and table.id in ("slot", "ws", "cs")) or \
                    (isinstance(table, ast.Attribute) and table.attr == "slot"):
                found.add(node.slice.value)
    return found, per_layout


@pytest.mark.parametrize("module, layouts", LAYOUTS, ids=lambda v: getattr(v, "__name__", ""))
def test_every_word_the_engines_write_is_a_parameter(module, layouts):
    names = set()
    for attr in layouts:
        names |= set(getattr(module, attr).slot)
    if module is _pointwise:
        for kind in POINTWISE:
            names |= set(getattr(_pointwise, f"{kind}_layout")(2, 1).slot)
    written, per_layout = _written_names(module)
    assert written, module.__name__
    assert written <= names, sorted(written - names)
    for attr, given in per_layout.items():
        if attr in layouts:
            assert given <= set(getattr(module, attr).slot), (attr, given)


def test_the_launch_table_sets_every_launch_shape_macro_the_kernels_need():
    """pointwise.cu has no default for its launch-shape macros (it stops with #error without
    them): the set it requires is the set _tuning.kernel_defines passes."""
    required = set(re.findall(r"!defined\((CUPYLOSS_\w+)\)", _source.expand("pointwise.cu")))
    passed = {d[2:].split("=")[0] for d in _tuning.kernel_defines()}
    assert required and required == passed
    assert not re.search(r"#ifndef CUPYLOSS_(FLAT|ROWS|REDUCE|GRAD)_",
                         _source.expand("pointwise.cu"))


def test_kernel_constants_reads_enums_constexprs_and_defines(monkeypatch, tmp_path):
    """Explicit and implicit enum values, a scoped enum passed over, comments ignored, namespace
    constexprs and integer #defines; a value that is not a literal is refused, not guessed."""
    (tmp_path / "common.cuh").write_text("")
    (tmp_path / "k.cu").write_text(
        "enum : long long {\n  A_ONE = 1,  // one\n  A_TWO = 2, /* 3? */ A_THREE,\n};\n"
        "enum class Skip { x, y };\nenum : int { B0, B1, B2 = 8 };\n"
        "constexpr int C_N = 64;  // (x there)\n#define D_MAX 16\n")
    (tmp_path / "bad.cu").write_text("enum : int { E = 1 << 2 };\n")
    monkeypatch.setattr(_source, "kernel_dir", lambda: tmp_path)
    _source.expand.cache_clear()
    _source.kernel_constants.cache_clear()
    try:
        got = _source.kernel_constants("k.cu")
        assert got == {"A_ONE": 1, "A_TWO": 2, "A_THREE": 3, "B0": 0, "B1": 1, "B2": 8,
                       "C_N": 64, "D_MAX": 16}
        assert _source.constants("k.cu", "B2", "A_ONE") == (8, 1)
        with pytest.raises(LookupError, match="names no constant x, A_FOUR"):
            _source.constants("k.cu", "x", "A_FOUR")
        with pytest.raises(ValueError, match="E = 1 << 2 is not an integer literal"):
            _source.kernel_constants("bad.cu")
    finally:
        _source.expand.cache_clear()
        _source.kernel_constants.cache_clear()


@pytest.mark.parametrize("host, file, kernel_name", [
    ("MAX_DIMS", "pointwise.cu", "CUPYLOSS_MAX_DIMS"),
    ("BLOCK", "rowwise.cu", "ROW_BLOCK"),
    ("ROW_VECS", "rowwise.cu", "ROW_VECS"),
    ("ROW_SCRATCH", "rowwise.cu", "ROW_SCRATCH"),
    ("PAIR_BLOCK", "rowpair.cu", "PAIR_BLOCK"),
    ("PAIR_STAGES", "rowpair.cu", "PAIR_STAGES"),
    ("PAIR_FINISH_BLOCK", "rowpair.cu", "PAIR_FINISH_BLOCK"),
])
def test_launch_arithmetic_uses_the_kernels_constants(host, file, kernel_name):
    """The sizes the launch arithmetic shares with the kernels (block, vectors a thread, shared
    slots, stages) have the kernels' values; the flag bits and loss ids need no such check, the
    engines read them from the kernels (_source.constants)."""
    from cupyloss.rowpair import _launch as _rowpair_launch
    from cupyloss.rowwise import _launch as _rowwise_launch

    # the core's shared constant, or the family's own (a family imports the core's)
    values = {getattr(m, host) for m in (_launch, _rowwise_launch, _rowpair_launch)
              if hasattr(m, host)}
    assert values == {_source.kernel_constants(file)[kernel_name]}
