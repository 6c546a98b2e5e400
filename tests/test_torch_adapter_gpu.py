"""cupyloss.torch on a GPU: the kernels' numbers through autograd, gradcheck and opcheck on CUDA,
torch.compile with inductor, CUDA-graph capture, the scaling kernel, streams and inputs,
autocast."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyloss  # noqa: E402
import cupyloss.torch as CF  # noqa: E402
from operands import SPECS  # noqa: E402
from test_torch_adapter import HEADS, _arguments, _checked, _flag_sets, _floating  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [(n, r) for n in SPECS for r in SPECS[n].reductions]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")


def _on_gpu(name, dtype=torch.float64, shape=(33, 129), target_shape=None, seed=0,
            with_optional=False):
    """_arguments on the GPU: floating arrays (and optional arrays) in dtype, indices as int64."""
    args, kw = _arguments(name, shape=shape, target_shape=target_shape, seed=seed,
                          with_optional=with_optional)
    move = lambda a: a.to("cuda", dtype if a.is_floating_point() else a.dtype)  # noqa: E731
    return tuple(map(move, args)), {k: move(v) for k, v in kw.items()}


def _names_with_grads(name, args):
    return tuple(n for n, f in zip(SPECS[name].arrays, _floating(args, name)) if f)


# --- the numbers --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, reduction", CASES)
def test_autograd_gives_the_core_functions_numbers(name, reduction, dtype):
    """loss.backward() (upstream 1): bitwise the core's value_and_grad; an upstream g: the core's
    gradients times g rounded once (exact products of two values of the dtype, rounded to it);
    'none': bitwise the core's backward with the same elementwise upstream."""
    core = getattr(cupyloss, name + "_value_and_grad")
    args, kw = _on_gpu(name, dtype, target_shape=(129,))
    wrt = _names_with_grads(name, args)
    leaves = [a.clone().requires_grad_(f) for a, f in zip(args, _floating(args, name))]
    with_grad = [a for a in leaves if a.requires_grad]
    loss = CF.LOSSES[name](*leaves, reduction=reduction, **kw)
    value, grads = core(*args, reduction=reduction, wrt=wrt, **kw)
    assert torch.equal(loss.detach(), value)
    if reduction == "none":
        w = torch.randn(loss.shape, device="cuda", dtype=dtype)
        loss.backward(w)
        want = getattr(cupyloss, name + "_backward")(w, *args, reduction=reduction, wrt=wrt, **kw)
        assert all(torch.equal(a.grad, g) for a, g in zip(with_grad, want))
        return
    loss.backward()
    assert all(torch.equal(a.grad, g) for a, g in zip(with_grad, grads))
    for a in with_grad:
        a.grad = None
    go = torch.tensor(0.37, device="cuda", dtype=dtype)
    CF.LOSSES[name](*leaves, reduction=reduction, **kw).backward(go)
    for a, g in zip(with_grad, grads):
        assert torch.equal(a.grad, (g.double() * go.double()).to(dtype))


@pytest.mark.parametrize("name, reduction", CASES)
def test_gradcheck_on_cuda(name, reduction):
    args, kw = _on_gpu(name, shape=(7, 33))
    f = CF.LOSSES[name]
    if reduction == "none":
        w = torch.randn(f(*args, reduction="none", **kw).shape, dtype=args[0].dtype,
                        device="cuda")
        assert torch.autograd.gradcheck(*_checked(name, args, kw, f, "none", w))
    assert torch.autograd.gradcheck(*_checked(name, args, kw, f, reduction))
    call, leaves = _checked(name, args, kw, f, reduction)
    assert torch.autograd.gradcheck(lambda *xs: call(*xs) * -1.7, leaves)


@pytest.mark.parametrize("name", ["binary_cross_entropy", "binary_cross_entropy_with_logits",
                                  "cross_entropy", "nll_loss"])
def test_gradcheck_with_optional_arrays_on_cuda(name):
    args, kw = _on_gpu(name, shape=(7, 33), with_optional=True)
    assert torch.autograd.gradcheck(*_checked(name, args, kw, CF.LOSSES[name], "mean"))


def test_gradcheck_broadcast_target_on_cuda():
    (x, t), _ = _on_gpu("hinge_loss", shape=(9, 33), target_shape=(33,))
    assert torch.autograd.gradcheck(lambda p, q: CF.hinge_loss(p, q, reduction="sum"),
                                    (x.requires_grad_(), t.requires_grad_()))


def test_matches_torch_autograd_in_float64():
    F = torch.nn.functional
    (x, t), _ = _on_gpu("kl_div")
    for reduction in ("batchmean", "sum", "none"):
        a, b = x.clone().requires_grad_(), t.clone().requires_grad_()
        mine = CF.kl_div(a, b, reduction=reduction)
        a2, b2 = x.clone().requires_grad_(), t.clone().requires_grad_()
        theirs = F.kl_div(a2, b2, reduction=reduction)
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=0)
        w = torch.randn(mine.shape, dtype=mine.dtype, device="cuda")
        mine.backward(w)
        theirs.backward(w)
        torch.testing.assert_close(a.grad, a2.grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(b.grad, b2.grad, rtol=1e-12, atol=1e-15)
    a, b = x.clone().requires_grad_(), t.clone().requires_grad_()
    crit, ref = CF.MSELoss(reduction="sum"), torch.nn.MSELoss(reduction="sum")
    torch.testing.assert_close(crit(a, b), ref(a, b), rtol=1e-12, atol=0)


def test_retained_graph_gives_each_upstream_its_gradient():
    (x, t), _ = _on_gpu("mse_loss", torch.float32)
    x.requires_grad_()
    loss = CF.mse_loss(x, t)
    _, g1 = cupyloss.mse_loss_value_and_grad(x.detach(), t, wrt="input")
    for c in (1.0, 3.0, 1.0, -0.5):
        (g,) = torch.autograd.grad(loss, x, torch.tensor(c, device="cuda"), retain_graph=True)
        assert torch.equal(g, g1 * c)     # first (fast path) and later (rerun) backward alike


@pytest.mark.parametrize("name", list(SPECS))
def test_opcheck_on_cuda(name):
    args, kw = _on_gpu(name, shape=(5, 7), with_optional=True)
    options = [kw.get(o, d) for o, d in CF._GENERATED[name].options]
    forward = getattr(torch.ops.cupyloss, name).default
    backward = getattr(torch.ops.cupyloss, name + "_backward").default
    for reduction in SPECS[name].reductions:
        for flags in _flag_sets(args, name):
            given = [a.clone().requires_grad_(f) for a, f in zip(args, flags)]
            torch.library.opcheck(forward, (*given, reduction, *options, *flags))
            shape = CF.LOSSES[name](*args, reduction=reduction, **kw).shape
            go = torch.randn(shape, dtype=args[0].dtype, device="cuda")
            none = torch.empty((0,), dtype=torch.uint8, device="cuda")
            torch.library.opcheck(backward, (go, none, *args, reduction, *options, *flags))
            held = forward(*args, reduction, *options, *flags)[1]
            torch.library.opcheck(backward, (go, held, *args, reduction, *options, *flags))
    inplace = CF._GENERATED[name].inplace_op
    for reduction in (r for r in SPECS[name].reductions if inplace is not None and r != "none"):
        torch.library.opcheck(inplace, (args[0].clone(), *args[1:], reduction, *options, False))


@pytest.mark.parametrize("name", sorted(CF._AUTOCAST_DIRECT))
def test_opcheck_of_the_16_bit_autocast_form_on_cuda(name):
    """The ops' `wide` form (16-bit logits, float32 loss and grad_output) under opcheck."""
    args, kw = _on_gpu(name, torch.bfloat16, shape=(5, 7), with_optional=True)
    options = [kw.get(o, d) for o, d in CF._GENERATED[name].options]
    forward = getattr(torch.ops.cupyloss, name).default
    backward = getattr(torch.ops.cupyloss, name + "_backward").default
    for reduction in SPECS[name].reductions:
        flags = (True,) + (False,) * (len(args) - 1)
        x = args[0].clone().requires_grad_()
        torch.library.opcheck(forward, (x, *args[1:], reduction, *options, *flags, True))
        loss = forward(*args, reduction, *options, *flags, True)[0]
        assert loss.dtype == torch.float32
        go = torch.randn(loss.shape, device="cuda")
        none = torch.empty((0,), dtype=torch.uint8, device="cuda")
        torch.library.opcheck(backward, (go, none, *args, reduction, *options, *flags, True))
        if reduction != "none":
            torch.library.opcheck(CF._GENERATED[name].inplace_op,
                                  (args[0].clone(), *args[1:], reduction, *options, True))


# --- compile, graphs, streams ------------------------------------------------------------------

def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(129, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 129)).to("cuda", dtype)


@pytest.mark.parametrize("name", list(SPECS))
def test_torch_compile_fullgraph_with_inductor(name):
    import torch._dynamo

    torch._dynamo.reset()
    (x, *rest), kw = _on_gpu(name, torch.float32)
    head = HEADS.get(name, lambda y: y)
    model = _model()
    reduction = SPECS[name].reductions[-1]

    def step(a, *others):
        return CF.LOSSES[name](head(model(a)), *others, reduction=reduction, **kw)

    eager = step(x, *rest)
    want = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        loss = compiled(x, *rest)
        got = torch.autograd.grad(loss, list(model.parameters()))
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=_grad_atol(name, w))


def _grad_atol(name, w):
    """The absolute tolerance of a parameter gradient, compiled against eager: 1e-6, and for a
    log-space recursion over frames (ctc_loss) 1e-4 of the tensor's largest element: inductor's
    model rounds the loss's inputs differently, and a float32 recursion moves every gradient
    element by about the same absolute amount, its size set by the largest terms."""
    if name in ("ctc_loss",):
        return max(1e-6, 1e-4 * float(w.abs().max()))
    return 1e-6


@pytest.mark.parametrize("name", list(SPECS))
def test_cuda_graph_capture_of_a_training_step(name):
    """Warm up on a side stream, capture forward + loss + backward + SGD step, replay: the
    parameters follow eager training step for step."""
    (x, *rest), kw = _on_gpu(name, torch.float32, shape=(300, 129))
    head = HEADS.get(name, lambda y: y)
    # The mean (batchmean for kl_div): a sum over 38700 elements makes SGD diverge to NaN.
    reduction = "batchmean" if "batchmean" in SPECS[name].reductions else "mean"

    def trainer():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def step(a, b):
            opt.zero_grad(set_to_none=True)
            loss = CF.LOSSES[name](head(model(a)), *b, reduction=reduction, **kw)
            loss.backward()
            opt.step()
            return loss
        return model, step

    _graph_replays_like_eager(trainer, x, rest)


def _graph_replays_like_eager(trainer, x, rest):
    """Five eager steps of one trainer; two warm-up steps of another on a side stream, one step
    captured in a CUDA graph and replayed three times: losses and parameters agree."""
    model_e, step_e = trainer()
    eager = [step_e(x, rest).item() for _ in range(5)]
    model_g, step_g = trainer()
    static_x = x.clone()
    static_rest = [a.clone() for a in rest] if isinstance(rest, list) else rest.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = [step_g(static_x, static_rest).item() for _ in range(2)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step_g(static_x, static_rest)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(static_loss.item())
    np.testing.assert_allclose(warm + replayed, eager, rtol=1e-5)
    for p, q in zip(model_g.parameters(), model_e.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_work_runs_on_torchs_current_stream():
    (x, t), _ = _on_gpu("hinge_loss", torch.float32, shape=(2048, 1031), target_shape=(1031,))
    a = x.clone().requires_grad_()
    CF.hinge_loss(a, t).backward()
    want = a.grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b = x.clone().requires_grad_()
        torch.cuda._sleep(50_000_000)   # a busy side stream: work elsewhere would race ahead
        (CF.hinge_loss(b, t) * 2).backward()
        got = b.grad / 2
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


def test_inputs_are_never_written():
    for name, reduction in CASES:
        args, kw = _on_gpu(name, torch.float32, with_optional=True)
        for a, f in zip(args, _floating(args, name)):
            a.requires_grad_(f)
        given = (*args, *kw.values())
        before = [(a.detach().clone(), a._version) for a in given]
        loss = CF.LOSSES[name](*args, reduction=reduction, **kw)
        loss.backward(torch.randn_like(loss))
        for a, (copy, version) in zip(given, before):
            assert torch.equal(a.detach(), copy) and a._version == version, (name, reduction)


def test_gradients_only_for_arguments_that_require_grad():
    (x, t), _ = _on_gpu("mse_loss", torch.float32)
    x.requires_grad_()
    before = torch.cuda.memory_allocated()
    loss = CF.mse_loss(x, t)
    held = torch.cuda.memory_allocated() - before   # the loss and the input's gradient only
    assert held < x.numel() * 4 + 4096
    loss.backward()
    assert x.grad is not None and t.grad is None


# --- the scaling kernel ------------------------------------------------------------------------

_PAYLOAD_NAN = 0x7FC0BEEF   # a quiet NaN with a payload; any arithmetic returns canonical NaN


@pytest.mark.parametrize("n", [1, 3, 31, 33, 4095, 4097, 1 << 20])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_by_grad_output(n, dtype):
    a = torch.randn(n, device="cuda", dtype=dtype)
    b = torch.randn(n // 2 + 1, device="cuda", dtype=dtype)
    want_a = (a.double() * 0.75).to(dtype)
    want_b = (b.double() * 0.75).to(dtype)
    CF.scale_by_grad_output(torch.tensor(0.75, device="cuda", dtype=dtype), a, b)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)     # 0.75 = 3/4: exact products
    c = torch.randn(n + 1, device="cuda", dtype=dtype)
    tail = c[1:]                             # misaligned: the kernel goes one element at a time
    want = (tail.double() * -3.0).to(dtype)
    CF.scale_by_grad_output(torch.tensor(-3.0, device="cuda", dtype=dtype), tail)
    assert torch.equal(tail, want)


def test_scale_by_one_touches_no_gradient_memory():
    """A NaN with a payload survives only if nothing rewrote it: multiplying by 1 would give the
    canonical NaN.  With g = 2 the same buffer comes back canonical (the probe can see writes)."""
    bits = torch.full((1 << 20,), _PAYLOAD_NAN, dtype=torch.int32, device="cuda")
    grad = bits.view(torch.float32)
    CF.scale_by_grad_output(torch.tensor(1.0, device="cuda"), grad, grad[:5])
    assert torch.equal(bits, torch.full_like(bits, _PAYLOAD_NAN))
    CF.scale_by_grad_output(torch.tensor(2.0, device="cuda"), grad)
    assert not torch.any(bits == _PAYLOAD_NAN)


# --- compiled as eager; autocast ---------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("cross_entropy", torch.bfloat16),
                                         ("mse_loss", torch.float32),
                                         ("triplet_margin_loss", torch.float32)])
def test_compiled_step_holds_one_gradient_and_gives_eagers_bits(name, dtype):
    """Inside torch.compile(fullgraph=True) the loss's gradient is formed in the forward pass and
    scaled in place by backward, as in eager: the same bits, and no second gradient buffer (the
    peak above the inputs stays below two gradients' bytes)."""
    import torch._dynamo

    torch._dynamo.reset()
    (x, *rest), kw = _on_gpu(name, dtype, shape=(1024, 4096))
    leaf = x.clone().requires_grad_()

    def step(a, *others):
        return CF.LOSSES[name](a * 1.0, *others, **kw)

    eager = step(leaf, *rest)
    eager.backward()
    want, leaf.grad = leaf.grad, None
    compiled = torch.compile(step, fullgraph=True)
    for upstream in (None, torch.tensor(0.5, device="cuda", dtype=eager.dtype)):
        compiled(leaf, *rest).backward(upstream)          # warm up (compiles)
        leaf.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = compiled(leaf, *rest)
        loss.backward(upstream)
        peak = torch.cuda.max_memory_allocated() - base
        assert torch.equal(loss, eager)
        expect = want if upstream is None else want * 0.5
        assert torch.equal(leaf.grad, expect) if upstream is None else \
            torch.allclose(leaf.grad, expect, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        # x * 1.0, the held gradient (which becomes .grad), and small change: not two gradients
        assert peak < 2.5 * x.numel() * x.element_size(), (peak, x.numel() * x.element_size())
        leaf.grad = None


@pytest.mark.parametrize("compiled, inplace", [(True, False), (False, True), (True, True)],
                         ids=["compiled", "eager-inplace", "compiled-inplace"])
def test_cuda_graph_capture_of_a_compiled_training_step(compiled, inplace):
    """A compiled step (forward op holding its gradient, backward op scaling it), and a step
    with inplace_backward=True eager or compiled (the gradient written into the logits' buffer
    every replay), captured in a CUDA graph, replays as eager training."""
    import torch._dynamo

    torch._dynamo.reset()
    (x, t), kw = _on_gpu("cross_entropy", torch.float32, shape=(300, 129))

    def trainer():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def loss_of(a, b):
            return CF.cross_entropy(model(a), b, inplace_backward=inplace, **kw)

        if compiled:
            loss_of = torch.compile(loss_of, fullgraph=True)

        def step(a, b):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(a, b)
            loss.backward()
            opt.step()
            return loss
        return model, step

    _graph_replays_like_eager(trainer, x, t)


AUTOCAST = sorted(n for n in CF._AUTOCAST_FP32 if n in SPECS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", AUTOCAST)
def test_autocast_returns_what_torch_returns(name, dtype):
    """Under torch.autocast each loss of torch's float32 list gives torch's loss dtype (checked
    against the torch under test, so the list is too), the float32 loss of the 16-bit
    arguments, and gradients in the arguments' dtypes: autocast's semantics, the loss of
    float32 copies.  (torch's own bfloat16 cross_entropy under autocast is 4e-4 off that.)"""
    F = torch.nn.functional
    args, kw = _on_gpu(name, dtype)
    flags = _floating(args, name)
    ours = [a.clone().requires_grad_(f) for a, f in zip(args, flags)]
    theirs = getattr(F, name)
    fkw = {k: v for k, v in kw.items() if k in inspect.signature(theirs).parameters}
    with torch.autocast("cuda", dtype=dtype):
        got = CF.LOSSES[name](*ours, **kw)
        torch_dtype = theirs(*args, **fkw).dtype
    assert got.dtype == torch_dtype == torch.float32
    # torch's CUDA multilabel_margin_loss backward now and then loses a target's gradient (its
    # last write and its scaling loop touch the same element without a barrier): its CPU kernel
    # is the yardstick there.
    on = "cpu" if name == "multilabel_margin_loss" else "cuda"
    x32 = args[0].float().to(on).requires_grad_()
    want = theirs(x32, *[(a.float() if a.is_floating_point() else a).to(on) for a in args[1:]],
                  **fkw)
    torch.testing.assert_close(got.to(on), want, rtol=2e-5, atol=1e-6)
    got.backward()
    want.backward()
    assert all(a.grad.dtype == dtype for a, f in zip(ours, flags) if f)
    torch.testing.assert_close(ours[0].grad.float().to(on), x32.grad.to(dtype).float(),
                               rtol=2e-2, atol=1e-5)


def test_autocast_cross_entropy_reads_the_16_bit_logits_without_a_float32_copy():
    rows, cols = 2048, 32768
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, cols, (rows,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        CF.cross_entropy(x, t).backward()                     # warm up
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = CF.cross_entropy(x, t, label_smoothing=0.1)
    loss.backward(torch.tensor(2.0, device="cuda"))
    peak = torch.cuda.max_memory_allocated() - base
    assert loss.dtype == torch.float32
    assert peak < 1.1 * x.numel() * 2          # the bfloat16 gradient; no float32 copy (2x that)
    want = torch.nn.functional.cross_entropy(x.detach().float().requires_grad_(), t,
                                             label_smoothing=0.1)
    torch.testing.assert_close(loss, want, rtol=2e-6, atol=1e-6)


def test_compiled_autocast_cross_entropy_reads_the_16_bit_logits():
    """Compiled under autocast, cross_entropy takes the ops' `wide` form: eager's float32 loss
    and bfloat16 gradient bit for bit, and no float32 copy of the logits."""
    import torch._dynamo

    torch._dynamo.reset()
    rows, cols = 2048, 32768
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, cols, (rows,), device="cuda")

    def step(a, b):
        return CF.cross_entropy(a * 1.0, b, label_smoothing=0.1)

    def run(f):
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, t)
        loss.backward(torch.tensor(2.0, device="cuda"))
        return loss.detach(), x.grad

    want = run(step)
    compiled = torch.compile(step, fullgraph=True)
    run(compiled)
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = run(compiled)
    peak = torch.cuda.max_memory_allocated() - base
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    # x * 1.0 and the bfloat16 gradient; a float32 copy of the logits would add twice x
    assert peak < 2.5 * x.numel() * x.element_size(), peak


def test_autocast_binary_cross_entropy_is_refused_like_torchs():
    p = torch.rand(8, 3, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(p, p)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            CF.binary_cross_entropy(p, p)


@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss"])
def test_inplace_backward_writes_the_gradient_into_the_logits(name):
    """inplace_backward=True: the logits' buffer receives their gradient in the forward pass (the
    same bits as without it), backward hands that buffer on; a node that saved the logits, a
    second backward, and a leaf are refused."""
    rows, cols = 1024, 8192
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = torch.randint(0, cols, (rows,), device="cuda")
    f = CF.LOSSES[name]
    plain = f(x * 1.0, t, label_smoothing=0.1) if name == "cross_entropy" else f(x * 1.0, t)
    plain.backward(torch.tensor(0.5, device="cuda", dtype=plain.dtype))
    want, x.grad = x.grad, None
    z = x * 1.0
    opts = {"label_smoothing": 0.1} if name == "cross_entropy" else {}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = f(z, t, inplace_backward=True, **opts)
    grew = torch.cuda.max_memory_allocated() - base
    assert torch.equal(loss, plain.detach())
    assert grew < 1024 * 1024                       # no gradient buffer: z holds it
    loss.backward(torch.tensor(0.5, device="cuda", dtype=loss.dtype))
    assert torch.equal(x.grad, want)
    z = x * 1.0
    loss = f(z, t, inplace_backward=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one plain backward"):
        loss.backward()
    y = torch.tanh(x)                               # tanh saves its output for backward
    loss = f(y, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_jsd_inplace_backward_writes_the_students_gradient_into_its_buffer():
    """jsd with inplace_backward=True: the student's log-probabilities receive their gradient
    (no second buffer), with the bits of the out-of-place path."""
    rows, cols = 1024, 8192
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16,
                    generator=g).requires_grad_()
    teacher = torch.randn(rows, cols, device="cuda", generator=g).log_softmax(1).to(
        torch.bfloat16)

    def student(v):                   # log-probabilities, from a node that keeps no output
        return v - v.float().logsumexp(1, keepdim=True).to(v.dtype)

    plain = CF.jsd(student(x), teacher, beta=0.3)
    plain.backward(torch.tensor(0.5, device="cuda", dtype=plain.dtype))
    want, x.grad = x.grad, None
    z = student(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = CF.jsd(z, teacher, beta=0.3, inplace_backward=True)
    grew = torch.cuda.max_memory_allocated() - base
    assert torch.equal(loss, plain.detach())
    assert grew < 1024 * 1024                       # no gradient buffer: z holds it
    loss.backward(torch.tensor(0.5, device="cuda", dtype=loss.dtype))
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_inplace_backward_writes_into_the_products_buffer(dtype):
    """Compiled, inplace_backward=True takes the op declared as mutating the logits: the
    gradient goes into the product's own buffer (no logits-sized buffer beside it, where the
    out-of-place step holds two), with eager's bits."""
    import torch._dynamo

    torch._dynamo.reset()
    rows, hidden, cols = 1024, 256, 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(rows, hidden, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(cols, hidden, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_()
    t = torch.randint(0, cols, (rows,), device="cuda", generator=g)

    def step(inplace):
        return lambda a, b, c: CF.cross_entropy(a @ b.T, c, label_smoothing=0.1,
                                                inplace_backward=inplace)

    def run(f):
        h.grad = w.grad = None
        loss = f(h, w, t)
        loss.backward(torch.tensor(0.5, device="cuda", dtype=dtype))
        return loss.detach(), h.grad, w.grad

    def peak_of(f):
        run(f)
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run(f)
        return out, torch.cuda.max_memory_allocated() - base

    want = run(step(True))
    got, peak = peak_of(torch.compile(step(True), fullgraph=True))
    torch._dynamo.reset()
    _, out_of_place = peak_of(torch.compile(step(False), fullgraph=True))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    logits = rows * cols * h.element_size()
    grads = (h.numel() + w.numel()) * h.element_size()
    assert peak < 1.5 * logits + grads, (peak, logits)
    assert out_of_place > 1.9 * logits, (out_of_place, logits)
