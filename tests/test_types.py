"""The public signatures are typed (cupyloss._types.Array for every array argument), and a type
checker finds the public modules consistent with them (mypy, the test extra's)."""

import inspect
import subprocess
import sys

import pytest

import cupyloss

PUBLIC = ["cupyloss", "cupyloss.pointwise", "cupyloss.rowwise", "cupyloss.rowclass",
          "cupyloss.rowpair", "cupyloss.linear", "cupyloss.precompile", "cupyloss._types"]


def test_every_public_function_is_annotated():
    bare = [f"{name}({p.name})" for name in cupyloss.__all__
            if callable(getattr(cupyloss, name))
            for p in inspect.signature(getattr(cupyloss, name)).parameters.values()
            if p.annotation is inspect.Parameter.empty]
    unreturned = [name for name in cupyloss.__all__ if callable(getattr(cupyloss, name))
                  and inspect.signature(getattr(cupyloss, name)).return_annotation
                  is inspect.Signature.empty]
    assert not bare and not unreturned, (bare, unreturned)


def test_mypy_finds_the_public_modules_consistent(tmp_path):
    """mypy over the public modules as a user's type checker sees them: the installed package
    (typed by its py.typed) where it is installed, else this checkout."""
    pytest.importorskip("mypy")
    import os
    import pathlib

    root = pathlib.Path(cupyloss.__file__).resolve().parent.parent
    env = dict(os.environ)
    if not root.name.endswith("-packages"):
        env["MYPYPATH"] = str(root)
    modules = [arg for name in PUBLIC for arg in ("-m", name)]
    done = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports",
                           "--follow-imports=silent", "--no-incremental", *modules],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
