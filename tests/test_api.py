"""The public API, name by name and signature by signature, against the list in
tests/public_api.json: a rename, a dropped name or a changed parameter fails here on the CPU.

The list records what the package offers (``cupyloss.__all__``, ``cupyloss.torch.__all__``,
``cupyloss.jax.__all__``); an intended change of the API is made by regenerating it,
``python tests/test_api.py --write``, and saying so in the commit.
"""

import importlib
import inspect
import json
import pathlib
import sys

import pytest

LIST = pathlib.Path(__file__).with_name("public_api.json")
MODULES = ("cupyloss", "cupyloss.torch", "cupyloss.jax")


def _describe(obj) -> str:
    if inspect.isclass(obj) or callable(obj):
        try:
            return f"{'class' if inspect.isclass(obj) else 'def'} {inspect.signature(obj)}"
        except (TypeError, ValueError):     # a builtin without a signature
            return "callable"
    return type(obj).__name__


def snapshot(module_name: str) -> dict:
    module = importlib.import_module(module_name)
    return {name: _describe(getattr(module, name)) for name in sorted(module.__all__)}


@pytest.mark.parametrize("module_name", MODULES)
def test_public_api_is_the_recorded_one(module_name):
    pytest.importorskip(module_name.split(".")[-1] if module_name != "cupyloss" else "numpy")
    want = json.loads(LIST.read_text())[module_name]
    got = snapshot(module_name)
    missing = sorted(set(want) - set(got))
    added = sorted(set(got) - set(want))
    changed = {n: (want[n], got[n]) for n in set(want) & set(got) if want[n] != got[n]}
    assert not missing and not added and not changed, (missing, added, changed)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    LIST.write_text(json.dumps({m: snapshot(m) for m in MODULES}, indent=1) + "\n")
