"""The public signatures are typed (cupyloss._types.Array for every array argument), and a type
checker finds the public modules consistent with them (mypy, the test extra's)."""

import inspect
import subprocess
import sys

import pytest

import cupyloss

PUBLIC = ["cupyloss/__init__.py", "cupyloss/pointwise.py", "cupyloss/rowwise.py",
          "cupyloss/rowclass.py", "cupyloss/rowpair.py", "cupyloss/precompile.py",
          "cupyloss/_types.py"]


def test_every_public_function_is_annotated():
    bare = [f"{name}({p.name})" for name in cupyloss.__all__
            if callable(getattr(cupyloss, name))
            for p in inspect.signature(getattr(cupyloss, name)).parameters.values()
            if p.annotation is inspect.Parameter.empty]
    unreturned = [name for name in cupyloss.__all__ if callable(getattr(cupyloss, name))
                  and inspect.signature(getattr(cupyloss, name)).return_annotation
                  is inspect.Signature.empty]
    assert not bare and not unreturned, (bare, unreturned)


def test_mypy_finds_the_public_modules_consistent():
    pytest.importorskip("mypy")
    import pathlib

    root = pathlib.Path(cupyloss.__file__).resolve().parent.parent
    files = [str(root / f.replace("cupyloss/", f"{pathlib.Path(cupyloss.__file__).parent.name}/"))
             for f in PUBLIC]
    done = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports",
                           "--follow-imports=silent", "--no-incremental", *files],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
