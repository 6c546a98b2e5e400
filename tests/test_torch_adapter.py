"""cupyloss.torch without a GPU: what is generated, the signatures, the errors, and the autograd
wiring (paths, gradcheck, opcheck, torch.compile) with the kernels swapped for the float64
references of every family (tests/operands.py: tests/reference.py, tests/reference_rowwise.py).

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
import operands  # noqa: E402
from operands import SPECS, ref_grads, ref_loss  # noqa: E402

F = torch.nn.functional


class ReferenceEngine:
    """The adapter's engine on CPU tensors through the float64 references, recording each call."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _np(t):
        t = t.detach()
        return (t.to(torch.float64) if t.is_floating_point() else t).numpy()

    def _kw(self, name, options):
        return {k: (self._np(v) if isinstance(v, torch.Tensor) else v)
                for k, v in options.items()}

    def _value(self, name, arrays, reduction, options):
        v = ref_loss(name, list(map(self._np, arrays)), reduction, **self._kw(name, options))
        return torch.tensor(v, dtype=arrays[0].dtype)

    def value(self, name, arrays, reduction, options):
        self.calls.append(("value", name, reduction, ()))
        return self._value(name, arrays, reduction, options)

    def _grads(self, name, arrays, reduction, options, wrt, grad_output):
        every = ref_grads(name, list(map(self._np, arrays)), reduction, grad_output,
                          **self._kw(name, options))
        index = {a: k for k, a in enumerate(SPECS[name].arrays)}
        return tuple(torch.tensor(every[index[w]], dtype=arrays[0].dtype) for w in wrt)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        self.calls.append(("value_and_grad", name, reduction, wrt))
        return (self._value(name, arrays, reduction, options),
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
def fresh_dynamo():
    """torch.compile's caches emptied before and after a test: dynamo keys them by code object,
    and every case of a parametrized test compiles the same `step` code (a closure over a
    different loss and model each time), so without a reset the cases' guards pile up until
    dynamo's recompile_limit (8) stops the ninth case, which fullgraph=True turns into an error."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def engine(monkeypatch):
    e = ReferenceEngine()
    monkeypatch.setattr(CF, "_engine", e)
    return e


def _arguments(name, shape=(4, 5), target_shape=None, dtype=torch.float64, seed=0,
               with_optional=False):
    """(the loss's required arrays as tensors, keyword arguments): values inside each loss's
    smooth region (tests/operands.py), so finite differences see no kink; class indices stay
    int64; with_optional adds the optional arrays (weight, pos_weight) as keywords."""
    arrays, extras = operands.operands(name, shape, target_shape, with_optional, seed)

    def tensor(a):
        return torch.tensor(a, dtype=dtype if np.issubdtype(a.dtype, np.floating) else None)

    return tuple(map(tensor, arrays)), {k: tensor(v) for k, v in extras.items()}


def _floating(args, name=None):
    """A bool per array: whether it can require grad (class indices cannot) and, given the
    loss's name, whether the loss gives it a gradient (cosine_embedding_loss's target has none)."""
    every = operands.has_gradient(name) if name else (True,) * len(args)
    return tuple(a.is_floating_point() and g for a, g in zip(args, every))


def _checked(name, args, kw, f, reduction, weights=None):
    """(f of the arrays finite differences can check, those arrays requiring grad); the other
    arrays are held fixed.  With weights: the sum of the loss times them."""
    wanted = operands.differentiable(name)
    leaves = tuple(a.detach().clone().requires_grad_() for a, w in zip(args, wanted) if w)

    def call(*xs):
        if name in operands.THROUGH_LOG_SOFTMAX:
            xs = (xs[0].log_softmax(-1), *xs[1:])
        it = iter(xs)
        loss = f(*[next(it) if w else a for a, w in zip(args, wanted)], reduction=reduction, **kw)
        return loss if weights is None else (loss * weights).sum()

    return call, leaves


def _reductions(name):
    return SPECS[name].reductions


CASES = [(n, r) for n in SPECS for r in SPECS[n].reductions]
# Every case, and again with the optional arrays (weight, pos_weight) for the losses that have them.
GRAD_CASES = [(n, r, False) for n, r in CASES] + [(n, r, True) for n, r in CASES
                                                   if operands.optional(n)]


def _case_id(case):
    return "-".join([case[0], case[1]] + (["optional"] if case[2] else []))


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
    assert CF.SKIPPED == {}
    assert set(CF.LOSSES) == set(SPECS) == set(CF.MODULES)
    assert {"cross_entropy", "nll_loss"} <= set(SPECS)      # the row-wise family too
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
    assert CF.MODULES["binary_cross_entropy"].__name__ == "BCELoss"
    assert CF.MODULES["binary_cross_entropy_with_logits"].__name__ == "BCEWithLogitsLoss"
    assert CF.MODULES["cross_entropy"].__name__ == "CrossEntropyLoss"
    assert CF.MODULES["nll_loss"].__name__ == "NLLLoss"
    assert CF.MODULES["sigmoid_focal_loss"].__name__ == "SigmoidFocalLoss"
    for name, cls in CF.MODULES.items():
        if hasattr(F, name):
            assert isinstance(getattr(torch.nn, cls.__name__, None), type), name


def test_an_entry_that_cannot_be_wrapped_is_left_out_with_its_reason(monkeypatch):
    """An incomplete registry entry costs its own loss, not the import; nothing is registered."""
    monkeypatch.setattr(CF, "SKIPPED", {})
    with pytest.warns(RuntimeWarning, match=r"leaves out half_done_loss: .*has no 'reductions'"):
        CF._generate({"half_done_loss": type("Entry", (), {"arrays": ("input", "target")})()})
    assert "has no 'reductions'" in CF.SKIPPED["half_done_loss"]
    assert "half_done_loss" not in CF.LOSSES and not hasattr(torch.ops.cupyloss, "half_done_loss")


def _plain(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", list(SPECS))
def test_signature_is_torch_functional_then_cupyloss_options(name):
    ours = inspect.signature(CF.LOSSES[name])
    core = inspect.signature(getattr(cupyloss, name))
    # the adapter's own option: inplace_backward where the core's value_and_grad can write the
    # input's gradient in place
    adapter = ([("inplace_backward", inspect.Parameter.KEYWORD_ONLY, False)]
               if "inplace" in inspect.signature(
                   getattr(cupyloss, name + "_value_and_grad")).parameters else [])
    if hasattr(F, name):
        theirs = _plain(inspect.signature(getattr(F, name)))
        assert _plain(ours)[:len(theirs)] == theirs
        extra = _plain(ours)[len(theirs):]
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in extra)
        # the core's options torch lacks, then the adapter's own
        assert [(n, d) for n, _, d in extra] == [
            (p.name, p.default) for p in core.parameters.values()
            if p.name not in {n for n, _, _ in theirs}] + [(n, d) for n, _, d in adapter]
    else:
        assert _plain(ours) == _plain(core) + adapter


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

# Options off each loss's defaults that its CPU form computes itself (beyond torch's arguments).
CPU_OPTIONS = [
    ("cross_entropy", {"label_smoothing": 0.1}),
    ("cross_entropy", {"lse_square_scale": 1e-2}),
    ("cross_entropy", {"softcap": 2.0}),
    ("cross_entropy", {"lse_square_scale": 1e-2, "ignore_index": 1}),
    ("kl_div", {"log_input": False}),
    ("jsd", {"beta": 0.0}),
    ("jsd", {"beta": 1.0}),
    ("jsd", {"beta": 0.3}),
    ("sigmoid_focal_loss", {"alpha": -1.0, "gamma": 0.5}),
    ("hinge_loss", {"margin": 0.5}),
]
# torch gives these targets no gradient (it raises when one is asked for).
NO_TORCH_TARGET_GRAD = ("binary_cross_entropy", "soft_margin_loss")


def _cpu_case(name, reduction, options, with_optional):
    """cupyloss.torch.<name> on CPU float64 tensors (torch's own operations, the real engine)
    against the float64 references: the loss and the gradient of every argument torch gives
    one, through loss.backward() with a random upstream gradient."""
    args, kw = _arguments(name, dtype=torch.float64, with_optional=with_optional)
    if name == "kl_div" and not options.get("log_input", True):
        args = (args[0].exp(),) + args[1:]
    kw.update(options)
    wanted = [w and not (name in NO_TORCH_TARGET_GRAD and k == 1)
              for k, w in enumerate(operands.differentiable(name))]
    leaves = [a.detach().clone().requires_grad_(w) for a, w in zip(args, wanted)]
    loss = CF.LOSSES[name](*leaves, reduction=reduction, **kw)
    numpy_kw = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    arrays = [a.numpy() for a in args]
    want = ref_loss(name, arrays, reduction, **numpy_kw)
    np.testing.assert_allclose(loss.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    upstream = torch.rand(loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss.backward(upstream)
    refs = ref_grads(name, arrays, reduction, upstream.numpy(), **numpy_kw)
    for k, (leaf, ref) in enumerate(zip(leaves, refs)):
        if leaf.requires_grad:
            np.testing.assert_allclose(leaf.grad.numpy(), ref, rtol=1e-9, atol=1e-12,
                                       err_msg=f"{name} d/d{SPECS[name].arrays[k]}")


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_cpu_tensors_compute_with_torchs_own_operations(case):
    name, reduction, with_optional = case
    _cpu_case(name, reduction, {}, with_optional)


@pytest.mark.parametrize("name, options", CPU_OPTIONS,
                         ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in CPU_OPTIONS])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cpu_tensors_take_cupylosss_own_options(name, options, reduction):
    _cpu_case(name, reduction, options, False)


def test_cpu_modules_and_shift_labels():
    x = torch.randn(6, 9, dtype=torch.float64).log_softmax(-1).requires_grad_()
    y = torch.randn(6, 9, dtype=torch.float64).log_softmax(-1)
    labels = torch.tensor([0, -100, 2, -100, 4, 5])
    loss = CF.jsd(x, y, shift_labels=labels)
    want = operands.reference_rowwise.jsd(x.detach().numpy(), y.numpy(), shift_labels=labels.numpy())
    np.testing.assert_allclose(loss.detach().numpy(), want, rtol=1e-12)
    loss.backward()
    assert torch.all(x.grad[1] == 0) and torch.all(x.grad[3] == 0)   # ignored rows
    t = torch.randn(6, 9, dtype=torch.float64)
    assert torch.equal(CF.MODULES["mse_loss"](reduction="sum")(x, t), F.mse_loss(x, t, reduction="sum"))


def test_non_tensors_are_refused():
    import numpy

    with pytest.raises(TypeError, match=r"target must be a torch.Tensor, got numpy.ndarray"):
        CF.mse_loss(torch.randn(3), numpy.ones(3))


@pytest.mark.skipif("weight" not in inspect.signature(F.mse_loss).parameters,
                    reason="this torch's mse_loss has no weight")
def test_torch_arguments_cupyloss_lacks_are_refused_unless_default():
    with pytest.raises(ValueError, match=r"does not support weight="):
        CF.mse_loss(torch.randn(3), torch.randn(3), weight=torch.ones(3))


@pytest.mark.parametrize("softcap", [-1.0, 1e-40, float("inf")])
def test_a_bad_softcap_is_refused_on_cpu_tensors_as_on_gpus(softcap):
    """torch's own math runs CPU tensors, with the check the kernels' path makes."""
    x, t = torch.randn(4, 5), torch.arange(4)
    with pytest.raises(ValueError, match=r"softcap must be 0 \(no cap\)"):
        CF.cross_entropy(x, t, softcap=softcap)
    with pytest.raises(ValueError, match=r"softcap must be 0 \(no cap\)"):
        CF.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), t, softcap=softcap)
    assert torch.isfinite(CF.cross_entropy(x, t, softcap=30.0))


@pytest.mark.parametrize("beta", [-0.5, 2.0, float("nan")])
def test_jsd_refuses_a_beta_outside_0_1_on_cpu_tensors_as_on_gpus(beta):
    x = torch.log_softmax(torch.randn(4, 5), -1)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        CF.jsd(x, x.flip(0), beta=beta)


def test_scale_by_grad_output_checks_its_arguments():
    with pytest.raises(ValueError, match=r"0-d"):
        CF.scale_by_grad_output(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"CUDA"):
        CF.scale_by_grad_output(torch.tensor(2.0), torch.ones(2))


def test_bad_options_fail_at_trace_time_like_at_run_time(engine, fresh_dynamo):
    """The checks run on metadata, so torch.compile reports them while tracing (wrapped in its
    own exception type), with the message the eager call gives."""
    (x, t), _ = _arguments("mse_loss")
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

@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_gradcheck(engine, case):
    """float64 finite differences: the first backward (fast path for reduced losses), the later
    ones gradcheck makes through the same graph (rerun path), and a random upstream gradient."""
    name, reduction, with_optional = case
    args, kw = _arguments(name, with_optional=with_optional)
    f = CF.LOSSES[name]
    if reduction == "none":
        shape = ref_loss(name, [a.numpy() for a in args], "none").shape
        w = torch.randn(shape, dtype=args[0].dtype, generator=torch.Generator().manual_seed(1))
        assert torch.autograd.gradcheck(*_checked(name, args, kw, f, "none", w))
    assert torch.autograd.gradcheck(*_checked(name, args, kw, f, reduction))
    call, leaves = _checked(name, args, kw, f, reduction)
    assert torch.autograd.gradcheck(lambda *xs: call(*xs) * 0.37, leaves)


@pytest.mark.parametrize("name, target_shape",
                         [("hinge_loss", (5,)), ("margin_ranking_loss", (5,)),
                          ("binary_cross_entropy_with_logits", (6, 1))])
def test_gradcheck_broadcast_target(engine, name, target_shape):
    args, kw = _arguments(name, shape=(6, 5), target_shape=target_shape)
    assert torch.autograd.gradcheck(*_checked(name, args, kw, CF.LOSSES[name], "sum"))


def test_gradcheck_gaussian_var_per_row(engine):
    """var of the input's shape without its last dim: torch views it as [..., 1]."""
    (x, t, _), _ = _arguments("gaussian_nll_loss", shape=(6, 5))
    var = torch.rand(6, dtype=x.dtype, generator=torch.Generator().manual_seed(3)) + 0.5
    assert torch.autograd.gradcheck(lambda a, b, v: CF.gaussian_nll_loss(a, b, v),
                                    (x.requires_grad_(), t.requires_grad_(),
                                     var.requires_grad_()))


@pytest.mark.parametrize("name", list(SPECS))
def test_reduced_loss_takes_grads_from_forward_and_scales_them(engine, name):
    args, kw = _arguments(name)
    x = args[0].requires_grad_()
    loss = CF.LOSSES[name](*args, reduction="sum", **kw)
    assert engine.calls == [("value_and_grad", name, "sum", (SPECS[name].arrays[0],))]
    (loss * 3).backward()
    assert engine.kinds() == ["value_and_grad", "scale"]
    g = ref_grads(name, [a.detach().numpy() for a in args], "sum", 3.0)
    np.testing.assert_allclose(x.grad.numpy(), g[0], rtol=1e-12)
    assert all(a.grad is None for a in args[1:])


@pytest.mark.parametrize("name", list(SPECS))
def test_none_reduction_reruns_with_the_elementwise_upstream(engine, name):
    """The last array that can have a gradient (the input where the target holds indices)."""
    args, kw = _arguments(name)
    k = max(i for i, f in enumerate(_floating(args, name)) if f)
    args[k].requires_grad_()
    loss = CF.LOSSES[name](*args, reduction="none", **kw)
    assert engine.calls == [("value", name, "none", ())]
    w = torch.randn(loss.shape, dtype=loss.dtype)
    loss.backward(w)
    assert engine.calls[1] == ("backward", name, "none", (SPECS[name].arrays[k],))
    g = ref_grads(name, [a.detach().numpy() for a in args], "none", w.numpy())
    np.testing.assert_allclose(args[k].grad.numpy(), g[k], rtol=1e-12)
    assert all(a.grad is None for i, a in enumerate(args) if i != k)


def test_retained_graph_reruns_after_the_first_backward(engine):
    (x, t), _ = _arguments("mse_loss")
    x.requires_grad_()
    loss = CF.mse_loss(x, t)
    want = ref_grads("mse_loss", [x.detach().numpy(), t.numpy()], "mean")[0]
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
    (x, t), _ = _arguments("kl_div")
    x.requires_grad_()
    CF.kl_div(x, t, reduction="batchmean").backward()
    assert engine.calls == [("value", "kl_div", "batchmean", ()),
                            ("backward", "kl_div", "batchmean", ("input",))]


def test_no_grad_computes_the_value_alone(engine):
    (x, t), _ = _arguments("mse_loss")
    x.requires_grad_()
    with torch.no_grad():
        CF.mse_loss(x, t)
    CF.mse_loss(x.detach(), t)
    assert engine.kinds() == ["value", "value"]


def test_grad_of_one_argument_when_both_require_grad(engine):
    (x, t), _ = _arguments("mse_loss")
    x.requires_grad_()
    t.requires_grad_()
    loss = CF.mse_loss(x, t)
    assert engine.calls == [("value_and_grad", "mse_loss", "mean", ("input", "target"))]
    (gt,) = torch.autograd.grad(loss, t)
    np.testing.assert_allclose(gt.numpy(), (-2 * (x - t) / x.numel()).detach().numpy())
    assert x.grad is None and t.grad is None


def test_inputs_are_never_written(engine):
    for name, reduction, with_optional in GRAD_CASES:
        args, kw = _arguments(name, with_optional=with_optional)
        for a, f in zip(args, _floating(args, name)):
            a.requires_grad_(f)
        given = (*args, *kw.values())
        before = [(a.detach().clone(), a._version) for a in given]
        loss = CF.LOSSES[name](*args, reduction=reduction, **kw)
        loss.backward(torch.randn(loss.shape, dtype=loss.dtype))
        for a, (copy, version) in zip(given, before):
            assert torch.equal(a.detach(), copy) and a._version == version, name


def test_legacy_size_average_and_reduce_map_like_torch(engine):
    (x, t), _ = _arguments("mse_loss")
    with pytest.warns(UserWarning, match="reduction='sum'"):
        got = CF.mse_loss(x, t, size_average=False)
    assert torch.equal(got, CF.mse_loss(x, t, reduction="sum"))
    with pytest.warns(UserWarning, match="reduction='none'"):
        crit = CF.MSELoss(reduce=False)
    assert crit.reduction == "none" and crit(x, t).shape == x.shape


def test_modules_call_the_functions_with_their_options(engine):
    (x, t), _ = _arguments("kl_div")
    crit = CF.KLDivLoss(reduction="batchmean", log_target=True)
    assert torch.equal(crit(x, t), CF.kl_div(x, t, reduction="batchmean", log_target=True))
    assert "log_target=True" in repr(crit) and "batchmean" in repr(crit)
    h = CF.HingeLoss(margin=2.0, reduction="sum")
    (x, t), _ = _arguments("hinge_loss")
    assert torch.equal(h(x, t), CF.hinge_loss(x, t, margin=2.0, reduction="sum"))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_double_backward_is_refused_when_it_is_asked_for(engine, reduction):
    """create_graph=True works (first-order gradients are right) but differentiating them
    raises instead of silently dropping the loss's second derivative."""
    (x, t), _ = _arguments("mse_loss")
    x.requires_grad_()
    (g,) = torch.autograd.grad(CF.mse_loss(x, t, reduction=reduction).sum(), x,
                               create_graph=True)
    scale = 1.0 / x.numel() if reduction == "mean" else 1.0
    torch.testing.assert_close(g.detach(), 2 * (x - t).detach() * scale, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match=r"autograd|derivative|backward"):
        g.sum().backward()


def test_torch_func_transforms_are_refused(engine):
    (x, t), _ = _arguments("mse_loss")
    with pytest.raises(NotImplementedError, match=r"torch.func transform"):
        torch.func.grad(lambda a: CF.mse_loss(a, t))(x)
    with pytest.raises(NotImplementedError, match=r"torch.func transform"):
        torch.vmap(lambda a, b: CF.mse_loss(a, b))(x, t)


def _flag_sets(args, name):
    """Gradient flags to try: every array that can have one, the first alone, none."""
    every = _floating(args, name)
    return every, (True,) + (False,) * (len(args) - 1), (False,) * len(args)


@pytest.mark.parametrize("name, with_optional",
                         [(n, False) for n in SPECS] + [(n, True) for n in SPECS
                                                        if operands.optional(n)])
def test_opcheck(engine, name, with_optional):
    args, kw = _arguments(name, with_optional=with_optional)
    options = [kw.get(o, d) for o, d in CF._GENERATED[name].options]
    forward = getattr(torch.ops.cupyloss, name).default
    backward = getattr(torch.ops.cupyloss, name + "_backward").default
    for reduction in _reductions(name):
        for flags in _flag_sets(args, name):
            given = [a.clone().requires_grad_(f) for a, f in zip(args, flags)]
            torch.library.opcheck(forward, (*given, reduction, *options, *flags))
            shape = ref_loss(name, [a.numpy() for a in args], reduction).shape
            go = torch.randn(shape, dtype=args[0].dtype)
            none = torch.empty((0,), dtype=torch.uint8)
            torch.library.opcheck(backward, (go, none, *args, reduction, *options, *flags))
            held = forward(*args, reduction, *options, *flags)[1]
            torch.library.opcheck(backward, (go, held, *args, reduction, *options, *flags))


def test_forward_op_holds_its_gradients_for_the_backward_op(engine):
    """The forward op returns the loss and a token; the gradients it formed wait in _HELD until
    the backward op scales them in place (one buffer, as eager), or the token dies."""
    import gc

    (x, t), _ = _arguments("mse_loss")
    x.requires_grad_()
    before = len(CF._HELD)
    loss, token = torch.ops.cupyloss.mse_loss.default(x, t, "sum", True, False)
    assert token.shape == (1,) and len(CF._HELD) == before + 1
    want = ref_grads("mse_loss", [x.detach().numpy(), t.numpy()], "sum", -2.0)[0]
    (g,) = torch.autograd.grad(loss, x, torch.tensor(-2.0, dtype=x.dtype))
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)
    assert len(CF._HELD) == before and engine.kinds() == ["value_and_grad", "scale"]
    loss, token = torch.ops.cupyloss.mse_loss.default(x, t, "sum", True, False)
    assert len(CF._HELD) == before + 1
    del loss, token
    gc.collect()
    assert len(CF._HELD) == before                     # no backward: dropped with its token


@pytest.mark.parametrize("name, target_shape", [("hinge_loss", (5,)), ("cross_entropy", None)])
def test_op_with_gradient_flags_at_none_reruns_backward(engine, name, target_shape):
    """reduction='none' with gradients asked of the forward op: backward still applies the
    elementwise upstream through the loss's Jacobian (a broadcast target sums over its rows; a
    row-wise loss mixes a row's classes), not upstream times the saved gradients."""
    args, _ = _arguments(name, target_shape=target_shape)
    args[0].requires_grad_()
    options = [d for _, d in CF._GENERATED[name].options]
    flags = (True,) + (False,) * (len(args) - 1)
    out = getattr(torch.ops.cupyloss, name).default(*args, "none", *options, *flags)
    w = torch.randn(out[0].shape, dtype=out[0].dtype, generator=torch.Generator().manual_seed(2))
    (g,) = torch.autograd.grad(out[0], args[0], w)
    want = ref_grads(name, [a.detach().numpy() for a in args], "none", w.numpy())[0]
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("name", list(SPECS))
def test_compile_fullgraph_on_cpu_tensors_without_an_engine(fresh_dynamo, name):
    """With the default engine, torch.compile(fullgraph=True) of a model and the loss on CPU
    tensors traces torch's own operations (no op: its CPU kernel would run below autograd) and
    gives eager's loss and gradients."""
    if name == "gaussian_nll_loss":
        pytest.skip("torch's own F.gaussian_nll_loss checks var < 0 on the data, which "
                    "fullgraph cannot trace")
    if name == "ctc_loss":
        pytest.skip("torch's own F.ctc_loss is a dynamic-shape op that fullgraph cannot trace "
                    "on CPU tensors (aten._ctc_loss.Tensor); on CUDA tensors the cupyloss op "
                    "traces (tests/test_ctc_gpu.py)")
    if name == "multilabel_margin_loss":
        pytest.skip("torch's own F.multilabel_margin_loss compiles to other values than its "
                    "eager ones on CPU tensors (2/3 eager, 2 compiled for x = [[0, 0, 0]], "
                    "y = [[1, -1, -1]]); the CPU path traces torch's op")
    (x, *rest), kw = _arguments(name)
    model = _tiny_model()
    head = HEADS.get(name, lambda y: y)

    def step(a, *others):
        return CF.LOSSES[name](head(model(a)), *others, reduction=_reductions(name)[-1], **kw)

    eager = step(x, *rest)
    want = torch.autograd.grad(eager, list(model.parameters()))
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x, *rest)
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    got = torch.autograd.grad(loss, list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 5)).double()


# What puts a model's output into a loss's domain: log-probabilities, probabilities.
HEADS = {"kl_div": lambda y: y.log_softmax(-1), "nll_loss": lambda y: y.log_softmax(1),
         "binary_cross_entropy": torch.sigmoid, "jsd": lambda y: y.log_softmax(-1),
         "ctc_loss": lambda y: y.log_softmax(-1)}


@pytest.mark.parametrize("name", list(SPECS))
def test_compile_fullgraph_matches_eager(engine, fresh_dynamo, name):
    """A model's forward and the loss compile as one graph; the compiled backward gives eager's
    gradients, from the forward pass's, scaled in place (as eager); a second backward through
    the retained graph is refused by name, and runs with gradients_in_forward off."""
    (x, *rest), kw = _arguments(name)
    model = _tiny_model()
    head = HEADS.get(name, lambda y: y)

    def step(a, *others):
        return CF.LOSSES[name](head(model(a)), *others, reduction=_reductions(name)[-1],
                               **kw) * 0.5

    eager = step(x, *rest)
    want = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(x, *rest)
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert engine.kinds()[2:] == ["value_and_grad", "scale"]
    with pytest.raises(RuntimeError, match="gradients_in_forward = False"):
        torch.autograd.grad(loss, list(model.parameters()))
    torch._dynamo.reset()
    CF.gradients_in_forward = False
    try:
        loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x, *rest)
        for _ in range(2):
            got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    finally:
        CF.gradients_in_forward = True


def test_inplace_backward_is_refused_where_it_would_lose_something():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (4,))
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        CF.cross_entropy(x, t, inplace_backward=True)
    with pytest.raises(ValueError, match="needs a reduced loss"):
        CF.nll_loss(x * 1.0, t, reduction="none", inplace_backward=True)
    assert "inplace_backward" not in inspect.signature(CF.mse_loss).parameters
    # CPU tensors: torch's operations, the input left as it was
    z = x * 1.0
    kept = z.detach().clone()
    CF.cross_entropy(z, t, inplace_backward=True).backward()
    assert torch.equal(z.detach(), kept) and x.grad is not None


@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss", "jsd"])
def test_compiled_inplace_backward_takes_the_mutating_op(engine, fresh_dynamo, name):
    """Traced, inplace_backward=True runs the op declared as mutating the input
    (<name>_inplace): eager's loss and gradients, the backward a pointwise product of the
    saved input (no scaling call), and the same through the graph a second time."""
    torch.manual_seed(0)
    model = _tiny_model()
    x = torch.randn(4, 5, dtype=torch.float64)
    t = (torch.randint(0, 5, (4,)) if name != "jsd"
         else torch.randn(4, 5, dtype=torch.float64).log_softmax(1))
    # log-probabilities from a head that keeps no copy of its output for backward
    # (log_softmax does, and overwriting it is refused as in eager: below)
    head = ((lambda y: y - y.logsumexp(1, keepdim=True)) if name in ("nll_loss", "jsd")
            else (lambda y: y))

    def step(a, b, inplace=False, head=head):
        return CF.LOSSES[name](head(model(a)), b, inplace_backward=inplace) * 0.5

    eager = step(x, t)
    want = torch.autograd.grad(eager, list(model.parameters()))
    engine.calls.clear()
    loss = torch.compile(lambda a, b: step(a, b, True), backend="aot_eager", fullgraph=True)(x, t)
    torch.testing.assert_close(loss, eager, rtol=1e-12, atol=0)
    for _ in range(2):
        got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    assert engine.kinds() == ["value_and_grad"]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="modified by an inplace operation"):
        torch.compile(lambda a, b: step(a, b, True, torch.tanh), backend="aot_eager",
                      fullgraph=True)(x, t)
    x32 = torch.randn(4, 5, requires_grad=True)
    assert CF._inplace(CF._GENERATED[name], x32 * 1.0, "mean", (True, False), True)
    assert not CF._inplace(CF._GENERATED[name], (x32 * 1.0).T, "mean", (True, False), True)


def test_the_ops_read_wide_however_torch_passes_it(engine, monkeypatch):
    """A compiled graph calls an op with `wide` by keyword, or leaves it out at its default:
    every form reaches the engine with the options as given and `wide` read as given (not the
    last option taken for it, which once turned check_targets on under a CUDA graph capture)."""
    seen = []

    def spy(name, arrays, reduction, options, wrt):
        seen.append(dict(options))
        return arrays[0].new_zeros(()), tuple(torch.zeros_like(arrays[0]) for _ in wrt)

    monkeypatch.setattr(engine, "value_and_grad", spy)
    loss = CF._GENERATED["cross_entropy"]
    defaults = {o: d for o, d in loss.options}
    x = torch.randn(4, 5, dtype=torch.float64)
    base = (torch.tensor([0, 1, 2, 3]), "mean", *defaults.values())
    flags = (True, False)
    ops = torch.ops.cupyloss
    calls = [(lambda: ops.cross_entropy_inplace.default(x.clone(), *base), False),
             (lambda: ops.cross_entropy_inplace.default(x.clone(), *base, False), False),
             (lambda: ops.cross_entropy_inplace.default(x.clone(), *base, wide=True), True),
             (lambda: ops.cross_entropy_inplace.default(x.clone(), *base, True), True),
             (lambda: ops.cross_entropy.default(x, *base, *flags), False),
             (lambda: ops.cross_entropy.default(x, *base, *flags, wide=True), True),
             (lambda: ops.cross_entropy.default(x, *base, *flags, True), True)]
    for call, wide in calls:
        seen.clear()
        call()
        assert seen == [dict(defaults, **({"_wide": True} if wide else {}))]


def test_op_with_its_wide_argument_given_differentiates(engine):
    """The ops' trailing `wide` argument (set under autocast), given explicitly: autograd
    returns a gradient slot for it too."""
    args, _ = _arguments("cross_entropy")
    x = args[0].clone().requires_grad_()
    options = [d for _, d in CF._GENERATED["cross_entropy"].options]
    loss, _ = torch.ops.cupyloss.cross_entropy.default(x, args[1], "mean", *options, True, False,
                                                       False)
    (g,) = torch.autograd.grad(loss, x)
    want = ref_grads("cross_entropy", [a.detach().numpy() for a in args], "mean", 1.0)[0]
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)
