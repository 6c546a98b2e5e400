"""cupyloss.torch without a GPU: what is generated, the signatures, the errors, and the autograd
wiring (paths, gradcheck, opcheck, torch.compile) with the kernels swapped for tests/reference.py.

The adapter's ops call `cupyloss.torch._engine`.  `reference_engine` replaces it with one that
evaluates the float64 NumPy references on CPU tensors, so every test here runs the real ops,
autograd formulas, fakes and compile path; only the numbers come from NumPy instead of the GPU.
The GPU side of the same checks (and the kernels' numbers) is in test_torch_adapter_gpu.py.
"""

import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyloss  # noqa: E402
import cupyloss.torch as CF  # noqa: E402
import reference  # noqa: E402
from cupyloss._pointwise import SPECS  # noqa: E402

F = torch.nn.functional


class ReferenceEngine:
    """The adapter's engine on CPU tensors through tests/reference.py, recording each call."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _np(t):
        return t.detach().to(torch.float64).numpy()

    def _kw(self, name, options):
        return {k: (self._np(v) if isinstance(v, torch.Tensor) else v)
                for k, v in options.items()}

    def value(self, name, arrays, reduction, options):
        self.calls.append(("value", name, reduction, ()))
        v = reference.loss(name, *map(self._np, arrays), reduction=reduction,
                           **self._kw(name, options))
        return torch.tensor(v, dtype=arrays[0].dtype)

    def _grads(self, name, arrays, reduction, options, wrt, grad_output):
        every = reference.grads(name, *map(self._np, arrays), reduction=reduction,
                                grad_output=grad_output, **self._kw(name, options))
        index = {a: k for k, a in enumerate(SPECS[name].arrays)}
        return tuple(torch.tensor(every[index[w]], dtype=arrays[0].dtype) for w in wrt)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        self.calls.append(("value_and_grad", name, reduction, wrt))
        v = reference.loss(name, *map(self._np, arrays), reduction=reduction,
                           **self._kw(name, options))
        return (torch.tensor(v, dtype=arrays[0].dtype),
                self._grads(name, arrays, reduction, options, wrt, 1.0))

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        self.calls.append(("backward", name, reduction, wrt))
        upstream = grad_output if isinstance(grad_output, float) else self._np(grad_output)
        return self._grads(name, arrays, reduction, options, wrt, upstream)

    def scale(self, grad_output, grads):
        self.calls.append(("scale", len(grads)))
        for g in grads:
            g.mul_(grad_output)

    def kinds(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def engine(monkeypatch):
    e = ReferenceEngine()
    monkeypatch.setattr(CF, "_engine", e)
    return e


def _arguments(name, shape=(4, 5), target_shape=None, dtype=torch.float64, seed=0):
    """Inputs inside each loss's smooth region, so finite differences see no kink."""
    g = torch.Generator().manual_seed(seed)
    target_shape = shape if target_shape is None else target_shape
    if name == "kl_div":
        x = torch.rand(shape, generator=g, dtype=dtype) * 0.8 + 0.1      # log-probabilities
        t = torch.rand(target_shape, generator=g, dtype=dtype) * 0.8 + 0.1
        return x.log(), t, {}
    if name == "hinge_loss":
        # margin - x t kept >= 0.1 away from 0: the hinge's kink is never crossed by eps.
        t = (torch.rand(target_shape, generator=g, dtype=dtype) + 0.5) * torch.where(
            torch.rand(target_shape, generator=g) < 0.5, -1.0, 1.0).to(dtype)
        z = (torch.rand(shape, generator=g, dtype=dtype) * 0.9 + 0.1) * torch.where(
            torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(dtype)
        return (1.0 - z) / t, t, {}
    return (torch.randn(shape, generator=g, dtype=dtype),
            torch.randn(target_shape, generator=g, dtype=dtype), {})


def _reductions(name):
    return SPECS[name].reductions


CASES = [(n, r) for n in SPECS for r in SPECS[n].reductions]


# --- what is generated ----------------------------------------------------------------------------

def test_import_cupyloss_imports_neither_adapter_nor_framework():
    code = ("import sys, cupyloss; "
            "print(sorted(m for m in ('torch', 'jax', 'cupyloss.torch', 'cupyloss.jax') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_import_cupyloss_torch_imports_no_jax():
    code = "import sys, cupyloss.torch; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_registered_loss_has_a_function_a_module_and_ops():
    assert set(CF.LOSSES) == set(SPECS) == set(CF.MODULES)
    for name in SPECS:
        assert getattr(CF, name) is CF.LOSSES[name]
        assert getattr(CF, CF.MODULES[name].__name__) is CF.MODULES[name]
        assert issubclass(CF.MODULES[name], torch.nn.Module)
        assert name in CF.__all__ and CF.MODULES[name].__name__ in CF.__all__
        assert hasattr(torch.ops.cupyloss, name) and hasattr(torch.ops.cupyloss, name + "_backward")


def test_module_names_follow_torch():
    assert CF.MODULES["mse_loss"].__name__ == "MSELoss"
    assert CF.MODULES["kl_div"].__name__ == "KLDivLoss"
    assert CF.MODULES["hinge_loss"].__name__ == "HingeLoss"   # torch has no hinge loss
    for name, cls in CF.MODULES.items():
        if hasattr(F, name):
            assert isinstance(getattr(torch.nn, cls.__name__, None), type), name


def _plain(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", list(SPECS))
def test_signature_is_torch_functional_then_cupyloss_options(name):
    ours = inspect.signature(CF.LOSSES[name])
    core = inspect.signature(getattr(cupyloss, name))
    if hasattr(F, name):
        theirs = _plain(inspect.signature(getattr(F, name)))
        assert _plain(ours)[:len(theirs)] == theirs
        extra = _plain(ours)[len(theirs):]
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in extra)
        assert [(n, d) for n, _, d in extra] == [
            (p.name, p.default) for p in core.parameters.values()
            if p.name not in {n for n, _, _ in theirs}]
    else:
        assert _plain(ours) == _plain(core)


@pytest.mark.parametrize("name", [n for n in SPECS if hasattr(torch.nn, CF.MODULES[n].__name__)])
def test_module_constructor_takes_torchs_arguments(name):
    theirs = inspect.signature(getattr(torch.nn, CF.MODULES[name].__name__))
    ours = inspect.signature(CF.MODULES[name]).parameters
    for p in theirs.parameters.values():
        assert p.name in ours and ours[p.name].default == p.default, p.name


def test_every_public_name_has_a_docstring_with_an_example():
    for obj in [*CF.LOSSES.values(), *CF.MODULES.values(), CF.scale_by_grad_output]:
        doc = inspect.getdoc(obj)
        assert doc and "Example" in doc and ">>>" in doc, obj


# --- errors, with the real kernels' engine (no GPU needed: refused before any launch) -----------

def test_cpu_tensors_are_refused_with_a_hint():
    x = torch.randn(3, requires_grad=True)
    for name in SPECS:
        with pytest.raises(TypeError, match=r"input is a torch.Tensor on cpu.*input.cuda\(\)"):
            CF.LOSSES[name](x, torch.randn(3))
        with pytest.raises(TypeError, match=r"on cpu"):
            CF.MODULES[name]()(x, torch.randn(3))


def test_non_tensors_are_refused():
    import numpy

    with pytest.raises(TypeError, match=r"target must be a torch.Tensor, got numpy.ndarray"):
        CF.mse_loss(torch.randn(3), numpy.ones(3))


@pytest.mark.skipif("weight" not in inspect.signature(F.mse_loss).parameters,
                    reason="this torch's mse_loss has no weight")
def test_torch_arguments_cupyloss_lacks_are_refused_unless_default():
    with pytest.raises(ValueError, match=r"does not support weight="):
        CF.mse_loss(torch.randn(3), torch.randn(3), weight=torch.ones(3))


def test_scale_by_grad_output_checks_its_arguments():
    with pytest.raises(ValueError, match=r"0-d"):
        CF.scale_by_grad_output(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"CUDA"):
        CF.scale_by_grad_output(torch.tensor(2.0), torch.ones(2))


def test_bad_options_fail_at_trace_time_like_at_run_time(engine):
    """The checks run on metadata, so torch.compile reports them while tracing (wrapped in its
    own exception type), with the message the eager call gives."""
    x, t, _ = _arguments("mse_loss")
    with pytest.raises(ValueError, match=r"'avg' is not a valid value for reduction"):
        CF.mse_loss(x, t, reduction="avg")
    with pytest.raises(Exception, match=r"'avg' is not a valid value for reduction"):
        torch.compile(lambda a, b: CF.mse_loss(a, b, reduction="avg"), backend="eager",
                      fullgraph=True)(x, t)
    assert engine.calls == []
    with pytest.raises(Exception, match=r"do not broadcast"):
        torch.compile(lambda a, b: CF.mse_loss(a, b), backend="aot_eager",
                      fullgraph=True)(x, torch.randn(3, dtype=x.dtype))


# --- autograd wiring, through the reference engine ------------------------------------------------

@pytest.mark.parametrize("name, reduction", CASES)
def test_gradcheck(engine, name, reduction):
    """float64 finite differences: the first backward (fast path for reduced losses), the later
    ones gradcheck makes through the same graph (rerun path), and a random upstream gradient."""
    x, t, kw = _arguments(name)
    x.requires_grad_()
    t.requires_grad_()
    f = CF.LOSSES[name]
    if reduction == "none":
        w = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
        assert torch.autograd.gradcheck(lambda a, b: (f(a, b, reduction="none", **kw) * w).sum(),
                                        (x, t))
    assert torch.autograd.gradcheck(lambda a, b: f(a, b, reduction=reduction, **kw), (x, t))
    assert torch.autograd.gradcheck(lambda a, b: f(a, b, reduction=reduction, **kw) * 0.37,
                                    (x, t))


def test_gradcheck_broadcast_target(engine):
    x, t, _ = _arguments("hinge_loss", shape=(6, 5), target_shape=(5,))
    assert torch.autograd.gradcheck(lambda a, b: CF.hinge_loss(a, b),
                                    (x.requires_grad_(), t.requires_grad_()))


@pytest.mark.parametrize("name", list(SPECS))
def test_reduced_loss_takes_grads_from_forward_and_scales_them(engine, name):
    x, t, kw = _arguments(name)
    x.requires_grad_()
    loss = CF.LOSSES[name](x, t, reduction="sum", **kw)
    assert engine.calls == [("value_and_grad", name, "sum", ("input",))]
    (loss * 3).backward()
    assert engine.kinds() == ["value_and_grad", "scale"]
    g = reference.grads(name, x.detach().numpy(), t.numpy(), reduction="sum", grad_output=3.0)
    np.testing.assert_allclose(x.grad.numpy(), g[0], rtol=1e-12)
    assert t.grad is None


@pytest.mark.parametrize("name", list(SPECS))
def test_none_reduction_reruns_with_the_elementwise_upstream(engine, name):
    x, t, kw = _arguments(name)
    t.requires_grad_()
    loss = CF.LOSSES[name](x, t, reduction="none", **kw)
    assert engine.calls == [("value", name, "none", ())]
    w = torch.randn(loss.shape, dtype=loss.dtype)
    loss.backward(w)
    assert engine.calls[1] == ("backward", name, "none", ("target",))
    g = reference.grads(name, x.numpy(), t.detach().numpy(), reduction="none",
                        grad_output=w.numpy())
    np.testing.assert_allclose(t.grad.numpy(), g[1], rtol=1e-12)
    assert x.grad is None


def test_retained_graph_reruns_after_the_first_backward(engine):
    x, t, _ = _arguments("mse_loss")
    x.requires_grad_()
    loss = CF.mse_loss(x, t)
    want = reference.grads("mse_loss", x.detach().numpy(), t.numpy())[0]
    grads = []
    for scale in (2.0, 5.0, 1.0):
        (g,) = torch.autograd.grad(loss, x, torch.tensor(scale, dtype=x.dtype),
                                   retain_graph=True)
        grads.append(g.numpy() / scale)
    assert engine.kinds() == ["value_and_grad", "scale", "backward", "scale", "backward", "scale"]
    for g in grads:
        np.testing.assert_allclose(g, want, rtol=1e-12)


def test_gradients_in_forward_off_reruns_every_reduction(engine, monkeypatch):
    monkeypatch.setattr(CF, "gradients_in_forward", False)
    x, t, _ = _arguments("kl_div")
    x.requires_grad_()
    CF.kl_div(x, t, reduction="batchmean").backward()
    assert engine.calls == [("value", "kl_div", "batchmean", ()),
                            ("backward", "kl_div", "batchmean", ("input",))]


def test_no_grad_computes_the_value_alone(engine):
    x, t, _ = _arguments("mse_loss")
    x.requires_grad_()
    with torch.no_grad():
        CF.mse_loss(x, t)
    CF.mse_loss(x.detach(), t)
    assert engine.kinds() == ["value", "value"]


def test_grad_of_one_argument_when_both_require_grad(engine):
    x, t, _ = _arguments("mse_loss")
    x.requires_grad_()
    t.requires_grad_()
    loss = CF.mse_loss(x, t)
    assert engine.calls == [("value_and_grad", "mse_loss", "mean", ("input", "target"))]
    (gt,) = torch.autograd.grad(loss, t)
    np.testing.assert_allclose(gt.numpy(), (-2 * (x - t) / x.numel()).detach().numpy())
    assert x.grad is None and t.grad is None


def test_inputs_are_never_written(engine):
    for name in SPECS:
        for reduction in _reductions(name):
            x, t, kw = _arguments(name)
            x.requires_grad_()
            t.requires_grad_()
            before = [(a.detach().clone(), a._version) for a in (x, t)]
            loss = CF.LOSSES[name](x, t, reduction=reduction, **kw)
            loss.backward(torch.randn(loss.shape, dtype=loss.dtype))
            for a, (copy, version) in zip((x, t), before):
                assert torch.equal(a.detach(), copy) and a._version == version


def test_legacy_size_average_and_reduce_map_like_torch(engine):
    x, t, _ = _arguments("mse_loss")
    with pytest.warns(UserWarning, match="reduction='sum'"):
        got = CF.mse_loss(x, t, size_average=False)
    assert torch.equal(got, CF.mse_loss(x, t, reduction="sum"))
    with pytest.warns(UserWarning, match="reduction='none'"):
        crit = CF.MSELoss(reduce=False)
    assert crit.reduction == "none" and crit(x, t).shape == x.shape


def test_modules_call_the_functions_with_their_options(engine):
    x, t, _ = _arguments("kl_div")
    crit = CF.KLDivLoss(reduction="batchmean", log_target=True)
    assert torch.equal(crit(x, t), CF.kl_div(x, t, reduction="batchmean", log_target=True))
    assert "log_target=True" in repr(crit) and "batchmean" in repr(crit)
    h = CF.HingeLoss(margin=2.0, reduction="sum")
    x, t, _ = _arguments("hinge_loss")
    assert torch.equal(h(x, t), CF.hinge_loss(x, t, margin=2.0, reduction="sum"))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_double_backward_is_refused_when_it_is_asked_for(engine, reduction):
    """create_graph=True works (first-order gradients are right) but differentiating them
    raises instead of silently dropping the loss's second derivative."""
    x, t, _ = _arguments("mse_loss")
    x.requires_grad_()
    (g,) = torch.autograd.grad(CF.mse_loss(x, t, reduction=reduction).sum(), x,
                               create_graph=True)
    scale = 1.0 / x.numel() if reduction == "mean" else 1.0
    torch.testing.assert_close(g.detach(), 2 * (x - t).detach() * scale, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match=r"autograd|derivative|backward"):
        g.sum().backward()


def test_torch_func_transforms_are_refused(engine):
    x, t, _ = _arguments("mse_loss")
    with pytest.raises(NotImplementedError, match=r"torch.func transform"):
        torch.func.grad(lambda a: CF.mse_loss(a, t))(x)
    with pytest.raises(NotImplementedError, match=r"torch.func transform"):
        torch.vmap(lambda a, b: CF.mse_loss(a, b))(x, t)


@pytest.mark.parametrize("name", list(SPECS))
def test_opcheck(engine, name):
    x, t, kw = _arguments(name)
    options = [dict(p for p in CF._GENERATED[name].options)[o] for o, _ in
               CF._GENERATED[name].options]
    forward = getattr(torch.ops.cupyloss, name).default
    backward = getattr(torch.ops.cupyloss, name + "_backward").default
    for reduction in _reductions(name):
        for flags in ((True, True), (True, False), (False, False)):
            args = (x.clone().requires_grad_(flags[0]), t.clone().requires_grad_(flags[1]),
                    reduction, *options, *flags)
            torch.library.opcheck(forward, args)
            shape = () if reduction != "none" else x.shape
            go = torch.randn(shape, dtype=x.dtype)
            torch.library.opcheck(backward, (go, x, t, reduction, *options, *flags))


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 5)).double()


@pytest.mark.parametrize("name", list(SPECS))
def test_compile_fullgraph_matches_eager(engine, name):
    """A model's forward and the loss compile as one graph; the compiled backward (run twice
    through a retained graph) gives eager's gradients."""
    x, t, kw = _arguments(name)
    model = _tiny_model()
    head = (lambda y: y.log_softmax(-1)) if name == "kl_div" else (lambda y: y)

    def step(a, b):
        return CF.LOSSES[name](head(model(a)), b, reduction=_reductions(name)[-1], **kw) * 0.5

    eager = step(x, t)
    want = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(x, t)
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    for _ in range(2):
        got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert "scale" not in engine.kinds()[2:]  # compiled: saved grads times g, out of place
