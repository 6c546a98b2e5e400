"""The docstrings of a loss's `_backward` and `_value_and_grad`, derived from the loss's own.

A loss's docstring documents its arguments once (Args: shapes, dtypes, options).  Its backward
and value_and_grad keep what is theirs (the summary, the gradient's formula, Returns, Example)
and take their Args section from here: each parameter of their signature in order, described by
their own docstring where it says something of its own, else by the loss's, else (grad_output,
wrt) by the one description every family shares.  A value_and_grad that returns what they all
return, ``(loss, grads)``, takes that Returns from here too.
"""

from __future__ import annotations

import inspect
import re
import textwrap

_SECTION = re.compile(r"^(Args|Returns|Example|Examples|Raises):[ \t]*$", re.M)
_ENTRY = re.compile(r"^  (\*{0,2}[A-Za-z_][\w, *]*):", re.M)

SHARED = {
    "grad_output": "the upstream gradient: a Python number, a 0-d array of the input's dtype and "
                   "framework (read on the device), or for reduction='none' an array of the "
                   "loss's shape.",
    "wrt": "the arguments whose gradients are returned: a name (that gradient), a tuple of "
           "names (a tuple of gradients, in its order), or None (the family's default, see "
           "its module docstring).",
}


def sections(doc: str) -> tuple[str, dict[str, str]]:
    """(the text before the first section, {section name: its body}) of a Google-style
    docstring, its indentation removed (inspect.cleandoc)."""
    doc = inspect.cleandoc(doc or "")
    marks = list(_SECTION.finditer(doc))
    head = doc[:marks[0].start()] if marks else doc
    bodies = {}
    for k, mark in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(doc)
        bodies[mark.group(1)] = doc[mark.end():end].strip("\n").rstrip()
    return head.rstrip(), bodies


def entries(args: str) -> dict[str, str]:
    """{parameter name: its description, continuation lines included} of an Args body; an entry
    naming several parameters ("input, target: ...") is given to each."""
    out = {}
    marks = list(_ENTRY.finditer(args))
    for k, mark in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(args)
        text = args[mark.end():end].strip()
        for name in mark.group(1).split(","):
            out[name.strip()] = text
    return out


def derived(loss, function) -> str:
    """`function`'s docstring (a backward or value_and_grad of `loss`) with its Args section
    derived as the module docstring says; ValueError naming every parameter nobody
    describes."""
    own_head, own = sections(function.__doc__)
    _, theirs = sections(loss.__doc__)
    mine = entries(own.get("Args", ""))
    base = entries(theirs.get("Args", ""))
    lines, missing = [], []
    for name in inspect.signature(function).parameters:
        text = mine.get(name)
        if text is None or text.startswith("as for "):
            text = base.get(name) or SHARED.get(name) or text
        if text is None:
            missing.append(name)
            continue
        if "\n" in text:     # as written in a docstring: its own line breaks
            first, *rest = text.split("\n")
            lines.append(f"  {name}: {first.strip()}")
            lines += [f"    {line.strip()}" for line in rest if line.strip()]
        else:
            lines += textwrap.wrap(f"{name}: {text}", 92, initial_indent="  ",
                                   subsequent_indent="    ")
    if missing:
        raise ValueError(f"{function.__name__}: no description of {missing} in its docstring, "
                         f"{loss.__name__}'s or the shared ones")
    parts = [own_head, "", "Args:", *lines]
    if "Returns" not in own and function.__name__.endswith("_value_and_grad"):
        own["Returns"] = textwrap.fill(
            f"``(loss, grads)``: loss as from {loss.__name__}, grads as from "
            f"{loss.__name__}_backward.", 92, initial_indent="  ", subsequent_indent="  ")
    for section in ("Returns", "Raises", "Example", "Examples"):
        if section in own:
            parts += ["", f"{section}:", own[section]]
    first, *rest = "\n".join(parts).split("\n")
    return "\n".join([first, *[f"    {line}" if line else "" for line in rest]]) + "\n    "


def derive(namespace: dict, names) -> None:
    """Give `name_backward` and `name_value_and_grad` in `namespace` their derived docstrings,
    for each loss name; ValueError listing every parameter nobody describes."""
    problems = []
    for name in names:
        loss = namespace[name]
        for suffix in ("_backward", "_value_and_grad"):
            function = namespace[name + suffix]
            try:
                function.__doc__ = derived(loss, function)
            except ValueError as exc:
                problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
