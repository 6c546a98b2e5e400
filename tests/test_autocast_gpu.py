"""GPU tests of the fused head inside torch.autocast: the products in the autocast dtype as
F.linear's there, the gradients in each argument's own dtype (a float32 master weight's formed in
float32), eager, compiled and CUDA-graphed alike; and compute_dtype from CuPy.

References: float64 autograd on the operands rounded to the autocast dtype, and torch's own
autocast head, ``F.cross_entropy(F.linear(h, W, b).float(), t)`` inside the same region.  Both
heads round the logits and dZ to the autocast dtype; torch also rounds its gradients (16-bit
gradients cast back), cupyloss does not.  So each result must be as near the float64 one as
torch's (within a factor 2: the two round dZ at different scales), and near torch's within the
dtype's rounding where no sum over classes intervenes (the loss).
"""

import pytest

pytestmark = pytest.mark.gpu

N_SEQ, T_SEQ, H, V = 3, 100, 64, 1000     # 300 rows: 128-row chunks leave a 44-row tail
ROUNDING = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
# None: the default plan (one chunk of 16-bit logits); 128 rows a chunk of them; 1 byte: slices
BUDGETS = {"default": None, "128rows": 128 * V * 2, "slices": 1}


def _case(torch, bias=False, hidden_dtype="float32", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(N_SEQ, T_SEQ, H, device="cuda", generator=gen) * 0.5)
    w = torch.randn(V, H, device="cuda", generator=gen) * 0.5
    b = torch.randn(V, device="cuda", generator=gen) if bias else None
    t = torch.randint(0, V, (N_SEQ, T_SEQ), device="cuda", generator=gen)
    t[:, ::7] = -100
    return h.to(getattr(torch, hidden_dtype)), w, b, t


def _torch_head(torch, h, w, b, t, reduction):
    logits = torch.nn.functional.linear(h, w, b)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), t.flatten(),
                                             reduction=reduction)


def _run(torch, fn, tensors, t, reduction, adtype, up):
    leaves = [None if a is None else a.clone().requires_grad_() for a in tensors]
    with torch.autocast("cuda", adtype):
        loss = fn(*leaves, t, reduction)
    loss.backward(up.reshape(loss.shape))
    return loss.detach(), [None if a is None else a.grad for a in leaves]


def _err(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _reference(torch, tensors, t, reduction, adtype, up):
    """Loss and gradients by float64 autograd on the operands rounded to `adtype`."""
    leaves = [None if a is None else a.to(adtype).double().requires_grad_() for a in tensors]
    loss = _torch_head(torch, *leaves, t, reduction)
    loss.backward(up.reshape(loss.shape).double())
    return loss.detach(), [None if a is None else a.grad for a in leaves]


def _check(torch, mine, theirs, ref, tensors):
    """Each of mine as near the float64 reference as torch's (module docstring), in its
    argument's dtype."""
    (got, grads), (want, wgrads), (exact, rgrads) = mine, theirs, ref
    assert got.dtype == torch.float32
    got, want = got.reshape(exact.shape), want.reshape(exact.shape)
    assert _err(got, exact) <= 2 * _err(want, exact) + 1e-6
    for g, wg, rg, a in zip(grads, wgrads, rgrads, tensors):
        if a is not None:
            assert g.dtype == a.dtype
            assert _err(g, rg) <= 2 * _err(wg, rg) + 1e-6


@pytest.mark.parametrize("adtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_eager_matches_torch_autocast_head(adtype, reduction, bias, budget):
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, b, t = _case(torch, bias)
    dt = getattr(torch, adtype)
    up = (torch.randn(t.shape, device="cuda") if reduction == "none"
          else torch.tensor(1.5, device="cuda"))
    theirs = _run(torch, lambda *a: _torch_head(torch, *a), (h, w, b), t, reduction, dt, up)
    mine = _run(torch, lambda h, w, b, t, r: CF.linear_cross_entropy(
        h, w, t, b, reduction=r, max_workspace_bytes=BUDGETS[budget]), (h, w, b), t,
        reduction, dt, up)
    _check(torch, mine, theirs, _reference(torch, (h, w, b), t, reduction, dt, up), (h, w, b))
    assert _err(mine[0].reshape(theirs[0].shape), theirs[0]) <= ROUNDING[adtype]
    if b is None and adtype == "bfloat16":
        # the master weight's gradient: torch's within bfloat16's rounding (float16's dZ is
        # formed at another scale than torch's: the 2^k of linear.py)
        assert _err(mine[1][1], theirs[1][1]) <= ROUNDING[adtype]
    assert all(g is None or g.dtype == torch.float32 for g in mine[1])   # never 16 bits


def test_weight_gradient_is_not_a_rounded_16_bit_one():
    """dW = dZ^T X comes out of cuBLAS in float32: nearer the float64 product of the same
    16-bit dZ and X than torch's bfloat16 gradient cast back, and not on the bfloat16 grid."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, _, t = _case(torch)
    up = torch.tensor(1.0, device="cuda")
    _, (_, gw, _) = _run(torch, lambda h, w, b, t, r: CF.linear_cross_entropy(h, w, t),
                         (h, w, None), t, "mean", torch.bfloat16, up)
    _, (_, tw, _) = _run(torch, lambda *a: _torch_head(torch, *a), (h, w, None), t, "mean",
                         torch.bfloat16, up)
    assert not torch.equal(gw, gw.bfloat16().float())
    assert torch.equal(tw, tw.bfloat16().float())
    # float64 reference: dZ from float64 logits of the rounded operands
    hb, wb = h.flatten(0, 1).bfloat16().double(), w.bfloat16().double()
    z = (hb @ wb.T).requires_grad_()
    torch.nn.functional.cross_entropy(z, t.flatten()).backward()
    ref = z.grad.T @ hb
    assert _err(gw, ref) < _err(tw, ref)


def test_compiled_and_graphed_equal_eager():
    """torch.compile(fullgraph=True) and a captured CUDA graph give eager's loss and gradients
    bitwise under autocast (the same op, the same plan)."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, b, t = _case(torch, bias=True)

    def head(h, w, b, t):
        with torch.autocast("cuda", torch.bfloat16):
            return CF.linear_cross_entropy(h, w, t, b, max_workspace_bytes=128 * V * 2)

    def grads_of(fn):
        leaves = [a.clone().requires_grad_() for a in (h, w, b)]
        loss = fn(*leaves, t)
        (loss * 0.75).backward()
        return [loss.detach(), *(a.grad for a in leaves)]

    eager = grads_of(head)
    compiled = grads_of(torch.compile(head, fullgraph=True))
    for e, c in zip(eager, compiled):
        assert c.dtype == e.dtype and torch.equal(c, e)
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for a in leaves:
                a.grad = None
            (head(*leaves, t) * 0.75).backward()
    torch.cuda.current_stream().wait_stream(side)
    for a in leaves:
        a.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = head(*leaves, t)
        (loss * 0.75).backward()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, [loss, *(a.grad for a in leaves)]):
        assert torch.equal(c, e)


def test_mixed_dtypes_follow_their_arguments():
    """bfloat16 hidden states (an autocast layer's output) and a float32 weight: each gradient
    in its argument's dtype, as F.linear's under autocast."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, _, t = _case(torch, hidden_dtype="bfloat16")
    up, dt = torch.tensor(1.0, device="cuda"), torch.bfloat16
    theirs = _run(torch, lambda *a: _torch_head(torch, *a), (h, w, None), t, "mean", dt, up)
    mine = _run(torch, lambda h, w, b, t, r: CF.linear_cross_entropy(h, w, t), (h, w, None),
                t, "mean", dt, up)
    assert mine[1][0].dtype == torch.bfloat16 and mine[1][1].dtype == torch.float32
    _check(torch, mine, theirs, _reference(torch, (h, w, None), t, "mean", dt, up),
           (h, w, None))


def test_vocab_parallel_form_under_autocast():
    """The vocab-parallel linear form on one rank (group None) runs its products in the
    autocast dtype too, its gradients in the arguments' dtypes."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, _, t = _case(torch)
    up, dt = torch.tensor(1.0, device="cuda"), torch.bfloat16
    theirs = _run(torch, lambda *a: _torch_head(torch, *a), (h, w, None), t, "mean", dt, up)
    mine = _run(torch, lambda h, w, b, t, r: CF.vocab_parallel_linear_cross_entropy(h, w, t),
                (h, w, None), t, "mean", dt, up)
    _check(torch, mine, theirs, _reference(torch, (h, w, None), t, "mean", dt, up),
           (h, w, None))


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_compute_dtype_from_cupy(compute):
    """cupyloss.linear_cross_entropy_value_and_grad(compute_dtype=...) on float32 CuPy arrays:
    float32 gradients near float64 autograd of the rounded operands."""
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    import cupyloss

    h, w, _, t = _case(torch)
    x, wc, tc = (cupy.from_dlpack(a.contiguous()) for a in (h.flatten(0, 1), w, t.flatten()))
    loss, (gx, gw) = cupyloss.linear_cross_entropy_value_and_grad(x, wc, tc,
                                                                  compute_dtype=compute)
    assert gx.dtype == gw.dtype == cupy.float32
    dt = getattr(torch, compute)
    hd = h.flatten(0, 1).to(dt).double().requires_grad_()
    wd = w.to(dt).double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hd @ wd.T, t.flatten())
    ref.backward()
    assert abs(float(loss) - float(ref)) / float(ref) <= ROUNDING[compute]
    assert _err(torch.from_dlpack(gx), hd.grad) <= ROUNDING[compute]
    assert _err(torch.from_dlpack(gw), wd.grad) <= ROUNDING[compute]
