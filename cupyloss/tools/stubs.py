"""The type stub of cupyloss.torch, written from the module as it is built at import.

    python -m cupyloss.tools.stubs            # writes cupyloss/torch/__init__.pyi
    python -m cupyloss.tools.stubs --check    # exits 1 when the file differs from what it would write

cupyloss.torch builds most of its public functions and nn.Module classes from the loss registry
at import, so a type checker or an IDE reading its source would see none of them.  The stub
declares every name of its ``__all__`` with the signature the built object has (inspect's), and
types each parameter from its role: a required argument is a Tensor, an optional array a
``Tensor | None``, an option the type of its default.  tests/test_stubs.py writes the stub again
and compares it with the committed file, so a new loss or option that leaves it stale fails CI.
"""

from __future__ import annotations

import inspect
import pathlib
import sys

# Parameters whose default is None, by what they take.
_OPTIONAL_TENSORS = frozenset({"weight", "pos_weight", "bias", "class_weight", "shift_labels",
                               "b", "mask", "old_log_probs", "ref_log_probs", "ref_hidden",
                               "ref_weight", "ref_bias", "kl", "target", "student_bias",
                               "teacher_bias"})
_OPTIONAL_BOOLS = frozenset({"size_average", "reduce"})
_OPTIONAL_INTS = frozenset({"class_offset", "classes", "max_workspace_bytes",
                            "max_completion_length"})
_OPTIONAL_FLOATS = frozenset({"epsilon_high"})
_GROUPS = frozenset({"group", "mean_group"})      # a process group, its name, or None
_COUNTS = frozenset({"num_items"})                # an int or a 0-d integer tensor, or None
# Integer defaults of options torch takes as floats.
_FLOATS = frozenset({"margin", "p"})
# Values of __all__ that are not functions or classes, with their types.
_VALUES = {"gradients_in_forward": "bool",
           "LOSSES": "dict[str, Callable[..., Tensor]]",
           "MODULES": "dict[str, type[torch.nn.Module]]",
           "SKIPPED": "dict[str, str]"}
_RETURNS = {"scale_by_grad_output": "None"}
PATH = pathlib.Path(__file__).resolve().parent.parent / "torch" / "__init__.pyi"


def _annotation(p: inspect.Parameter) -> str:
    default = p.default
    if default is inspect.Parameter.empty:
        return "Tensor"
    if default is None:
        if p.name in _OPTIONAL_TENSORS:
            return "Tensor | None"
        if p.name in _OPTIONAL_BOOLS:
            return "bool | None"
        if p.name in _OPTIONAL_INTS:
            return "int | None"
        if p.name in _OPTIONAL_FLOATS:
            return "float | None"
        if p.name in _GROUPS:
            return "Any"
        if p.name in _COUNTS:
            return "Tensor | int | None"
        raise TypeError(f"no stub type for parameter {p.name!r} (default None): name it in "
                        f"cupyloss.tools.stubs")
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "float" if p.name in _FLOATS else "int"
    if isinstance(default, (float, str)):
        return type(default).__name__
    raise TypeError(f"no stub type for parameter {p.name!r} (default {default!r})")


def _parameters(signature: inspect.Signature, skip_self: bool = False) -> str:
    parts, star = [], False
    for p in signature.parameters.values():
        if skip_self and p.name == "self":
            parts.append("self")
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = f"{p.name}: {_annotation(p)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    return ", ".join(parts)


def _def(name: str, params: str, returns: str, indent: str = "") -> list[str]:
    line = f"{indent}def {name}({params}) -> {returns}: ..."
    if len(line) <= 100:
        return [line]
    # the parameters packed into lines of at most 100 characters (one a line would repeat the
    # same runs of lines in every loss sharing torch's legacy arguments)
    out, line = [f"{indent}def {name}("], f"{indent}   "
    for part in params.split(", "):
        if len(line) + len(part) + 2 > 100:
            out.append(line)
            line = f"{indent}   "
        line += f" {part},"
    out += [line, f"{indent}) -> {returns}: ..."]
    return out


def render() -> str:
    """The stub's text for the cupyloss.torch of this process."""
    import cupyloss.torch as module

    lines = ['"""Type stub of cupyloss.torch (written by python -m cupyloss.tools.stubs; do not edit:',
             'the functions and classes are built from the loss registry at import)."""', "",
             "from collections.abc import Callable", "from typing import Any", "",
             "import torch", "from torch import Tensor", "",
             "__all__ = ["]
    lines += [f"    {n!r}," for n in module.__all__]
    lines += ["]", ""]
    for name in module.__all__:
        obj = getattr(module, name)
        if name in _VALUES:
            lines += [f"{name}: {_VALUES[name]}", ""]
        elif inspect.isclass(obj):
            lines.append(f"class {name}(torch.nn.Module):")
            lines += _def("__init__", _parameters(inspect.signature(obj.__init__), True), "None",
                          "    ")
            lines += _def("forward", _parameters(inspect.signature(obj.forward), True), "Tensor",
                          "    ")
            lines.append("")
        elif callable(obj):
            lines += _def(name, _parameters(inspect.signature(obj)),
                          _RETURNS.get(name, "Tensor"))
            lines.append("")
        else:
            raise TypeError(f"cupyloss.torch.{name}: no stub for a {type(obj).__name__}; name "
                            f"its type in cupyloss.tools.stubs._VALUES")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        same = PATH.exists() and PATH.read_text() == text
        if not same:
            print(f"{PATH} is stale: run python -m cupyloss.tools.stubs")
        return 0 if same else 1
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
