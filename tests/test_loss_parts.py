"""Every registered loss has every part a loss needs, checked on the CPU.

A loss is registered once, in its family's SPECS (``cupyloss._core.registry.all_losses()``); from
there it needs, besides the registration:

  * its math in the kernels: a pointwise functor (``struct XxxOp`` in kernels/losses.cuh), a
    row-wise kind, a rowclass LOSS_* id or a rowpair functor that the compiled kernels take;
  * its public functions: ``name``, ``name_backward``, ``name_value_and_grad`` in
    ``cupyloss.__all__``;
  * a float64 reference of the value and the gradients in tests/reference*.py: ``name`` and
    ``name_grads`` (pointwise references may drop a ``_loss`` suffix: ``mse``, ``mse_grads``);
  * a CPU form for the torch adapter (torch.nn.functional's, or cupyloss.torch._forms');
  * its torch function and nn.Module, and its JAX function;
  * a row in the README's table of losses and a mention in docs/losses.md.

docs/design.md lists the same steps; this test fails, naming the loss and the part, when one is
missing.
"""

import pathlib
import re

import pytest

import cupyloss
import reference
import reference_ctc
import reference_rowwise
from cupyloss._core import registry as _registry, source as _source

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOSSES = _registry.all_losses()


def _kernel_part(name, spec) -> bool:
    """Whether the kernels hold this loss's math (see the module docstring)."""
    family = type(spec).__module__
    if family == "cupyloss._core.registry":
        text = (ROOT / "kernels" / "losses.cuh").read_text()
        return re.search(rf"\bstruct {re.escape(spec.functor)}\b", text) is not None
    if family == "cupyloss.rowwise._family":
        from cupyloss.rowwise import _family as _rowwise

        modes = {"cross_entropy": _rowwise.MODE_GENERAL, "nll": _rowwise.MODE_NLL}
        return spec.kind in modes
    if family == "cupyloss.rowclass._family":
        return spec.loss in _source.ROWCLASS_LOSSES
    if family == "cupyloss.rowpair._family":
        return spec.op in _source.ROWPAIR_OPS
    if family == "cupyloss.ctc._family":
        text = (ROOT / "kernels" / spec.source).read_text()
        return all(re.search(rf"\b{k}\(CTC_PARAMS", text) for k in _source.CTC_KERNELS)
    return False


def _reference(name):
    for module in (reference_rowwise, reference, reference_ctc):
        for stem in (name, name.removesuffix("_loss")):
            value, grads = getattr(module, stem, None), getattr(module, f"{stem}_grads", None)
            if callable(value) and callable(grads):
                return value, grads
    return None


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_registered_loss_has_every_part(name):
    spec = LOSSES[name]
    missing = []
    if not _kernel_part(name, spec):
        missing.append("its math in the kernels")
    for suffix in ("", "_backward", "_value_and_grad"):
        if name + suffix not in cupyloss.__all__ or not callable(getattr(cupyloss, name + suffix,
                                                                         None)):
            missing.append(f"cupyloss.{name + suffix}")
    if _reference(name) is None:
        missing.append(f"a float64 reference {name} / {name}_grads in tests/reference*.py")
    readme = (ROOT / "README.md").read_text()
    if f"| `{name}` |" not in readme:
        missing.append("a row in the README's table of losses")
    if f"`{name}`" not in (ROOT / "docs" / "losses.md").read_text():
        missing.append("a mention in docs/losses.md")
    assert not missing, f"{name} lacks: {', '.join(missing)}"


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_registered_loss_has_its_adapters(name):
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF
    from cupyloss.torch import _forms as _torch_forms

    missing = []
    if name not in CF.LOSSES or name not in CF.__all__:
        missing.append(f"cupyloss.torch.{name}")
    if name not in CF.MODULES or CF.MODULES[name].__name__ not in CF.__all__:
        missing.append("its nn.Module in cupyloss.torch")
    if name not in _torch_forms._FORMS and not callable(getattr(torch.nn.functional, name, None)):
        missing.append("a CPU form (torch.nn.functional's or cupyloss.torch._forms')")
    try:
        import cupyloss.jax as CJ
    except ImportError:
        CJ = None
    if CJ is not None and name not in CJ.__all__:
        missing.append(f"cupyloss.jax.{name}")
    assert not missing, f"{name} lacks: {', '.join(missing)}"


def test_the_check_finds_a_missing_part(monkeypatch):
    """A loss registered with a functor the kernels lack, and no reference, is named."""
    fake = _registry.LossSpec("made_up_loss", "MadeUpOp")
    assert not _kernel_part("made_up_loss", fake)
    assert _reference("made_up_loss") is None
    assert _reference("mse_loss") == (reference.mse, reference.mse_grads)
    assert _reference("cross_entropy") == (reference_rowwise.cross_entropy,
                                           reference_rowwise.cross_entropy_grads)


@pytest.mark.parametrize("name", list(LOSSES))
def test_backward_and_value_and_grad_docstrings_derive_from_the_loss(name):
    """Each parameter of name_backward and name_value_and_grad is described in its Args, the
    loss's own descriptions carried over word for word; a formula, Returns and Example stay."""
    import inspect

    from cupyloss._core import docs as _docs

    _, theirs = _docs.sections(getattr(cupyloss, name).__doc__)
    base = _docs.entries(theirs["Args"])
    for suffix in ("_backward", "_value_and_grad"):
        function = getattr(cupyloss, name + suffix)
        head, own = _docs.sections(function.__doc__)
        described = _docs.entries(own["Args"])
        params = list(inspect.signature(function).parameters)
        assert list(described) == params, f"{name + suffix}: Args {list(described)}"
        for p in params:
            if p in base and p not in ("grad_output", "wrt", "inplace"):
                assert " ".join(described[p].split()) == " ".join(base[p].split()) or \
                    not described[p].startswith("as for"), f"{name + suffix}: {p}"
        assert "Returns" in own and ">>>" in own.get("Example", ""), name + suffix
        assert head.strip(), name + suffix


def test_a_parameter_nobody_describes_is_an_error():
    from cupyloss._core import docs as _docs

    def loss(input, target, reduction="mean"):
        """A loss.

        Args:
          input: x.
          target: t.
          reduction: r.
        """

    def loss_backward(grad_output, input, target, reduction="mean", *, margin=1.0, wrt=None):
        """Its gradient.

        Returns:
          g.

        Example:
          >>> loss_backward(1.0, x, t)
        """

    with pytest.raises(ValueError, match=r"loss_backward: no description of \['margin'\]"):
        _docs.derived(loss, loss_backward)
    indent = " " * 8     # the docstrings' own, in this nested function
    loss_backward.__doc__ = loss_backward.__doc__.replace(
        f"{indent}Returns:", f"{indent}Args:\n{indent}  margin: m.\n\n{indent}Returns:")
    doc = _docs.derived(loss, loss_backward)
    _, parts = _docs.sections(doc)
    assert list(_docs.entries(parts["Args"])) == ["grad_output", "input", "target", "reduction",
                                                  "margin", "wrt"]
    assert _docs.entries(parts["Args"])["input"] == "x."
