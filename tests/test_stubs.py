"""cupyloss/torch/__init__.pyi, the type stub of the functions and classes cupyloss.torch builds at
import, is what cupyloss.tools.stubs writes from the module as built now."""

import pytest

pytest.importorskip("torch")


def test_the_stub_is_current():
    from cupyloss.tools import stubs as _stubs

    assert _stubs.PATH.read_text() == _stubs.render(), \
        "cupyloss/torch/__init__.pyi is stale: run python -m cupyloss.tools.stubs"


def test_the_stub_declares_every_public_name():
    import ast

    import cupyloss.torch as CF
    from cupyloss.tools import stubs as _stubs

    tree = ast.parse(_stubs.PATH.read_text())
    declared = {node.name for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    declared |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
    assert declared == set(CF.__all__)
    for name in CF.__all__:
        obj = getattr(CF, name)
        if callable(obj) and not isinstance(obj, type):
            stub = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
            import inspect

            assert [a.arg for a in (*stub.args.args, *stub.args.kwonlyargs)] == \
                list(inspect.signature(obj).parameters), name
