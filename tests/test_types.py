"""The public signatures are typed (cupyloss._types.Array for every array argument), and a type
checker finds the public modules consistent with them (mypy, the test extra's)."""

import inspect
import subprocess
import sys

import pytest

import cupyloss

PUBLIC = ["cupyloss", "cupyloss.pointwise", "cupyloss.rowwise", "cupyloss.rowclass",
          "cupyloss.rowpair", "cupyloss.linear", "cupyloss.tools.precompile", "cupyloss._types",
          "cupyloss.torch", "cupyloss.jax"]   # cupyloss.torch as its stub, torch.pyi


def test_every_public_function_is_annotated():
    bare = [f"{name}({p.name})" for name in cupyloss.__all__
            if callable(getattr(cupyloss, name))
            for p in inspect.signature(getattr(cupyloss, name)).parameters.values()
            if p.annotation is inspect.Parameter.empty]
    unreturned = [name for name in cupyloss.__all__ if callable(getattr(cupyloss, name))
                  and inspect.signature(getattr(cupyloss, name)).return_annotation
                  is inspect.Signature.empty]
    assert not bare and not unreturned, (bare, unreturned)


# A user's module: correct calls of cupyloss.torch's built functions and classes, and one
# wrong call that a type checker must report from the stub.
USER = """\
import torch
import cupyloss.torch as CF

x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
a: torch.Tensor = CF.cross_entropy(x, y, label_smoothing=0.1, reduction="sum")
b: torch.Tensor = CF.CrossEntropyLoss(ignore_index=0)(x, y)
c: torch.Tensor = CF.linear_cross_entropy(x, torch.randn(5, 3), y, max_workspace_bytes=1 << 20)
d = CF.mse_loss(x, x, reduction=1)
"""


def test_mypy_finds_the_public_modules_consistent(tmp_path):
    """mypy over the public modules as a user's type checker sees them (the installed package,
    typed by its py.typed, where it is installed, else this checkout), and over a user's module
    calling cupyloss.torch's functions built at import: only its wrong call is reported."""
    pytest.importorskip("mypy")
    import os
    import pathlib

    root = pathlib.Path(cupyloss.__file__).resolve().parent.parent
    env = dict(os.environ)
    if not root.name.endswith("-packages"):
        env["MYPYPATH"] = str(root)
    modules = [arg for name in PUBLIC for arg in ("-m", name)]
    (tmp_path / "cupyloss_user.py").write_text(USER)
    done = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports",
                           "--follow-imports=silent", "--no-incremental", *modules,
                           "-m", "cupyloss_user"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    wrong = USER.splitlines().index("d = CF.mse_loss(x, x, reduction=1)") + 1
    assert len(errors) == 1 and errors[0].startswith(f"cupyloss_user.py:{wrong}:") \
        and '"reduction"' in errors[0], done.stdout + done.stderr
