"""CPU tests of the fused linear cross entropy: validation (before any launch), the chunk
arithmetic, and cupyloss.torch's CPU path against the float64 reference."""

import numpy as np
import pytest

import reference_rowwise as ref
from cupyloss import linear
from cupyloss._core.dispatch import Operand


def _op(shape, dtype):
    return Operand(0, tuple(shape), (), np.dtype(dtype), 0, None)


def _check(hidden=((8, 16), "float32"), weight=((10, 16), "float32"), target=((8,), "int64"),
           bias=None, class_weight=None, reduction="mean", label_smoothing=0.0, softcap=0.0,
           names=("hidden",)):
    return linear._check(_op(*hidden), _op(*weight), _op(*target),
                         None if bias is None else _op(*bias),
                         None if class_weight is None else _op(*class_weight), reduction,
                         label_smoothing, 0.0, softcap, names)


def test_check_accepts_and_returns_sizes():
    assert _check() == (8, 16, 10)
    assert _check(hidden=((2, 4, 16), "float32"), target=((2, 4), "int32")) == (8, 16, 10)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"weight": ((0, 16), "float32")}, ValueError, "ZeRO-3"),
    ({"weight": ((160,), "float32")}, ValueError, "ZeRO-3"),
    ({"weight": ((10, 15), "float32")}, ValueError, "ZeRO-3"),
    ({"weight": ((10, 16), "float16")}, TypeError, "must match"),
    ({"hidden": ((8, 16), "int32"), "weight": ((10, 16), "int32")}, TypeError, "takes float16"),
    ({"target": ((8,), "float32")}, TypeError, "class indices"),
    ({"target": ((7,), "int64")}, ValueError, "target's shape"),
    ({"bias": ((9,), "float32")}, ValueError, "bias must be"),
    ({"class_weight": ((10,), "float16")}, ValueError, "class_weight must be"),
    ({"reduction": "batchmean"}, ValueError, "not a valid value for reduction"),
    ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"softcap": 1e-40}, ValueError, "softcap must be 0 .* finite in float32"),
    ({"names": ("bias",)}, ValueError, "no bias"),
])
def test_check_refuses(kwargs, error, match):
    with pytest.raises(error, match=match):
        _check(**kwargs)


V, H = 128256, 4096
GIB = 1 << 30
KEEP_8K = 8192 * V * 2                  # every row's bfloat16 dZ at 8192 rows
SUM = V * H * 4                         # a float32 V x H weight-gradient sum
SPLIT = V * H * 2 + 2048 * H * 4        # a split one: 16-bit halves, a float32 slice


@pytest.mark.parametrize("args, want", [
    # 2.5 GiB: dZ (1.96 GiB) kept, the rest holds 1136 rows of float32 logits -> 1024
    ((8192, V, H, 2, 2560 << 20), linear.Plan("keep", 1024, bytes=KEEP_8K + 1024 * V * 4)),
    # 16384 rows: dZ (3.9 GiB) does not fit, the float32 sum and 757 rows of (4 + 2)-byte
    # logits do -> 640
    ((16384, V, H, 2, 2560 << 20), linear.Plan("sum", 640, bytes=SUM + 640 * V * 6)),
    # 256 MiB: neither; 348 rows -> 256, slices of 268435456 // (8192 x 6) = 5461 -> 5376
    # classes over all rows
    ((8192, V, H, 2, 256 << 20), linear.Plan("slices", 256, 5376, 8192, 8192 * 5376 * 6)),
    # 2 GiB at 16384 rows: neither dZ nor a float32 sum and 128 rows (2.20 GB); a split sum
    # (16-bit halves, 1.05 GB, and a 2048-class float32 slice, 32 MiB) and 1381 rows -> 1024
    ((16384, V, H, 2, 2 * GIB), linear.Plan("sum", 1024, 2048,
                                            bytes=SPLIT + 1024 * V * 6)),
    # a teacher's float32 logits beside each chunk (linear_jsd: 10 bytes a logit in all):
    # 2200 MiB keeps dZ in 128-row chunks or sums in float32 in 128-row ones, both below
    # CHUNK_ROWS_MIN: a split sum's 896-row chunks instead; 2400 MiB keeps dZ in 384-row ones
    ((8192, V, H, 2, 2200 << 20, True, None, None, False, False, 4),
     linear.Plan("sum", 896, 2048, bytes=SPLIT + 896 * V * 10)),
    ((8192, V, H, 2, 2400 << 20, True, None, None, False, False, 4),
     linear.Plan("keep", 384, bytes=KEEP_8K + 384 * V * 8)),
    # 10^6 bytes over 100000 rows of 1000 classes (a float32 sum and 128 rows: 1024000 bytes):
    # a split sum, its slices a quarter of the classes (250 -> 128: 160768 bytes) and
    # (10^6 - 160768) // 6000 = 139 rows -> 128
    ((100000, 1000, 64, 2, 10**6), linear.Plan("sum", 128, 128,
                                                 bytes=1000 * 64 * 2 + 128 * 64 * 4 + 128 * 6000)),
    # 9 x 10^5 bytes: not even that; 150 rows -> 128, 128-class slices in tiles of rows beside
    # a float32 sum of a slice's dW (128 x 64 x 4 bytes): (9 x 10^5 - 32768) // (128 x 6) =
    # 1129 -> 1024
    ((100000, 1000, 64, 2, 9 * 10**5), linear.Plan("slices", 128, 128, 1024,
                                                     32768 + 1024 * 128 * 6)),
])
def test_plan(args, want):
    assert linear.plan(*args) == want


@pytest.mark.parametrize("args, want", [
    # groups of 2048 rows (preference pairs of 1024 tokens): their 16-bit dZ (0.53 GB), a
    # float32 sum and 1024-row chunks of float32 logits by default; at Liger-Kernel's DPO
    # peak + 0.25 GiB (1.88 GB) a split sum and 512-row chunks; none in 256 MiB
    ((16384, V, H, 2, None, True, 2048),
     linear.Plan("group", 1024, 0, 2048, 2048 * V * 2 + SUM + 1024 * V * 4)),
    ((16384, V, H, 2, 1_880_000_000, True, 2048),
     linear.Plan("group", 512, 2048, 2048, 2048 * V * 2 + SPLIT + 512 * V * 4)),
    ((16384, V, H, 2, 256 << 20, True, 2048), None),
    # KTO's groups of one 1024-token row in 1400 MiB: a split sum leaves 236 rows a chunk,
    # fewer than CHUNK_ROWS_MIN: none (two passes); 1500 MiB leaves 440 -> 384
    ((16384, V, H, 2, 1400 << 20, True, 1024), None),
    ((16384, V, H, 2, 1500 << 20, True, 1024),
     linear.Plan("group", 384, 2048, 1024, 1024 * V * 2 + SPLIT + 384 * V * 4)),
    # float32 inputs: their dZ and chunks only (the sum is the result); no weight gradient:
    # no sum
    ((16384, V, H, 4, None, True, 2048),
     linear.Plan("group", 1024, 0, 2048, 2048 * V * 4 + 1024 * V * 4)),
    ((16384, V, H, 2, 1_200_000_000, False, 2048),
     linear.Plan("group", 1024, 0, 2048, 2048 * V * 2 + 1024 * V * 4)),
])
def test_group_plan(args, want):
    assert linear.group_plan(*args) == want


def test_plan_stays_within_its_budget():
    for n, v, h in ((8192, V, H), (16384, V, H), (300, 1000, 64), (100000, 1000, 64)):
        for budget in (1 << 20, 64 << 20, 256 << 20, GIB, 2 * GIB, 3 * GIB, 6 * GIB):
            p = linear.plan(n, v, h, 2, budget)
            if p.rows >= 128 and (p.kind != "slices" or p.tile >= 128):
                assert p.bytes <= budget, (n, v, h, budget, p)


def test_uneven_slices_chunk_their_rows_alike():
    """A vocab-parallel call gathers once a chunk, so ranks holding 1, 1900 and 3099 of 5000
    classes must take the same row chunks whatever their plans' kinds; each plan's bytes are
    those of its own slice with those rows."""
    for n, budget, itemsize in ((300, 300_000, 2), (300, None, 2), (8192, 64 << 20, 2),
                                (8192, 1 << 20, 4), (50, 1, 2)):
        plans = []
        for v in (1, 1900, 3099):
            shard = linear.Shard(0, 5000, None, 3)
            plans.append(linear.shard_plan(n, v, 64, itemsize, budget, True, shard))
        assert len({p.rows for p in plans}) == 1, plans
        even = linear.plan(n, 1667, 64, itemsize, budget, most=3 * linear.CHUNK_ROWS_MAX)
        assert plans[0].rows == even.rows
        for v, p in zip((1, 1900, 3099), plans):
            alone = linear.plan(n, v, 64, itemsize, budget)
            assert p.kind == alone.kind and (p.cols, p.tile) == (alone.cols, alone.tile)
            if p.kind != "slices":
                per_row = v * (8 if itemsize == 8 else 4) + (v * itemsize if
                                                             itemsize < 4 and p.kind == "sum"
                                                             else 0)
                assert p.bytes - p.rows * per_row == alone.bytes - alone.rows * per_row
    assert linear.shard_plan(300, 1900, 64, 2, None, True, None) == linear.plan(300, 1900, 64, 2)


def test_a_shards_chunks_hold_as_many_logits_as_one_gpus():
    """k ranks' chunks take up to k * CHUNK_ROWS_MAX rows (as many logits as one GPU's chunk of
    all classes), where the budget holds them; one GPU keeps CHUNK_ROWS_MAX."""
    n, v, h = 8192, 128256, 4096
    assert linear.shard_plan(n, v, h, 2, None, True, None).rows == linear.CHUNK_ROWS_MAX
    for k in (2, 4, 8):
        p = linear.shard_plan(n, v // k, h, 2, None, True, linear.Shard(0, v, None, k))
        assert p.rows == min(n, k * linear.CHUNK_ROWS_MAX), (k, p)
        assert p.bytes <= linear.DEFAULT_WORKSPACE_BYTES
    tight = linear.shard_plan(n, v // 4, h, 2, 64 << 20, True, linear.Shard(0, v, None, 4))
    assert tight.rows < 4 * linear.CHUNK_ROWS_MAX and tight.bytes <= 64 << 20


def test_wrt_names():
    assert linear._names(None) == (("hidden", "weight"), False)
    assert linear._names("bias") == (("bias",), True)
    with pytest.raises(ValueError, match="wrt names"):
        linear._names(("input",))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "softcap": 4.0,
                                       "lse_square_scale": 1e-3}])
def test_torch_cpu_path_matches_float64(reduction, opts):
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(30, 16, generator=gen, dtype=torch.float64).float().requires_grad_()
    b = torch.randn(30, generator=gen, dtype=torch.float64).float().requires_grad_()
    t = torch.randint(0, 30, (2, 5), generator=gen)
    t[0, 1] = -100
    loss = CF.linear_cross_entropy(h, w, t, b, reduction=reduction, **opts)
    z = h.detach().double().reshape(10, 16).numpy() @ w.detach().double().numpy().T \
        + b.detach().double().numpy()
    want = ref.cross_entropy(z, t.reshape(10).numpy(), reduction=reduction, **opts)
    np.testing.assert_allclose(loss.detach().double().numpy().reshape(np.shape(want)), want,
                               rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    dz, _ = ref.cross_entropy_grads(z, t.reshape(10).numpy(), reduction=reduction, **opts)
    np.testing.assert_allclose(w.grad.double().numpy(), dz.T @ h.detach().double().reshape(
        10, 16).numpy(), rtol=1e-4, atol=1e-6)


def _cpu_case(torch, reduction, bias=True):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 6, 16, generator=gen).requires_grad_()
    w = torch.randn(40, 16, generator=gen).requires_grad_()
    b = torch.randn(40, generator=gen).requires_grad_() if bias else None
    t = torch.randint(0, 40, (2, 6), generator=gen)
    t[1, 2] = -100
    return h, w, b, t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_op_passes_opcheck(reduction, bias):
    torch = pytest.importorskip("torch")
    import cupyloss.torch  # noqa: F401  (registers the ops)

    h, w, b, t = _cpu_case(torch, reduction, bias)
    items = None if reduction == "none" else torch.tensor(40)     # num_items, an op argument
    args = (h, w, t, b, None, -100, reduction, 0.1, 1e-3, 0.0, -1, 0, -1, "", "", items, True,
            True, bias)
    torch.library.opcheck(torch.ops.cupyloss.linear_cross_entropy.default, args)
    go = torch.randn(t.shape) if reduction == "none" else torch.tensor(0.5)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    held = torch.ops.cupyloss.linear_cross_entropy.default(*plain)[1]
    for token in (torch.empty((0,), dtype=torch.uint8), held):
        torch.library.opcheck(torch.ops.cupyloss.linear_cross_entropy_backward.default,
                              (go, token, *plain))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{"label_smoothing": 0.1},
                                  {"softcap": 3.0, "lse_square_scale": 1e-2,
                                   "class_weight": "w"}], ids=["smoothing", "cap+z+weight"])
def test_traced_by_torch_compile_fullgraph(reduction, opts):
    """torch.compile(fullgraph=True) traces the loss as the registered op (no graph break), and
    its loss and gradients (the op's CPU kernel writes them out) are eager's (autograd's)."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    if opts.get("class_weight"):
        opts = dict(opts, class_weight=torch.rand(40, generator=torch.Generator().manual_seed(5))
                    + 0.5)

    def step(h, w, b, t):
        return CF.linear_cross_entropy(h * 1.0, w, t, b, reduction=reduction, **opts).sum()

    h, w, b, t = _cpu_case(torch, reduction)
    eager = step(h, w, b, t)
    want = torch.autograd.grad(eager, (h, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, w, b, t)
    grads = torch.autograd.grad(got, (h, w, b))
    torch.testing.assert_close(got, eager)
    for g, e in zip(grads, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.2, "lse_square_scale": 1e-2,
                                       "softcap": 2.5}], ids=["plain", "options"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_logits_grad_matches_float64(reduction, opts, weighted):
    """The gradient the op's CPU kernel writes out (no autograd) against the float64 reference."""
    torch = pytest.importorskip("torch")
    from cupyloss.torch import _forms as _torch_forms

    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 7)) * 2
    t = rng.integers(0, 7, 9)
    t[3] = -100
    w = rng.random(7) + 0.5 if weighted else None
    go = rng.standard_normal(9) if reduction == "none" else 0.7
    got = _torch_forms.cross_entropy_logits_grad(
        torch.tensor(x), torch.tensor(t), None if w is None else torch.tensor(w),
        reduction=reduction, grad_output=torch.tensor(go, dtype=torch.float64), **opts)
    want, _ = ref.cross_entropy_grads(x, t, w, reduction=reduction, grad_output=go, **opts)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("args, want", [
    # a float32 master weight under autocast: "sum" adds into the result, so a call holds its
    # 16-bit logits alone; chunk rows from NARROW_CHUNK_ROWS by hidden size (4096 at H <= 1024)
    ((8192, 65536, 512, 2, None), linear.Plan("sum", 4096, bytes=4096 * 65536 * 2)),
    ((8192, V, H, 2, None), linear.Plan("sum", 2048, bytes=2048 * V * 2)),
    # 100 MiB: 408 rows of 16-bit logits -> 384 (a multiple of the 128-row tile)
    ((8192, V, H, 2, 100 << 20), linear.Plan("sum", 384, bytes=384 * V * 2)),
])
def test_autocast_plan_sums_into_the_float32_result(args, want):
    got = linear.plan(*args, wide_weight_grad=True, narrow_logits=True)
    assert got == want
    # float32 logits cost 6 bytes an element a chunk and take CHUNK_ROWS_MAX
    wide = linear.plan(*args, wide_weight_grad=True)
    assert wide.kind == "sum" and wide.rows <= linear.CHUNK_ROWS_MAX
    assert wide.bytes == wide.rows * args[1] * 6


def test_autocast_plan_below_a_tile_takes_slices():
    """A budget below 128 rows of logits falls to the slices plan, whose tiles sum their
    slice of dW straight into the float32 result (no V x H workspace)."""
    # 5 x 10^5 bytes hold 83 rows of (4 + 2)-byte logits, fewer than a tile
    p = linear.plan(100000, 1000, 64, 2, 5 * 10**5, wide_weight_grad=True)
    assert p.kind == "slices" and p.rows == 83
    assert p.bytes == max(p.rows * 6000, p.tile * p.cols * 6) <= 5 * 10**5


@pytest.mark.parametrize("dtype, message", [
    ("float32", "float16 or bfloat16"), ("float64", "float16 or bfloat16"),
    ("int8", "float16 or bfloat16")])
def test_compute_dtype_must_be_16_bit(dtype, message):
    with pytest.raises(TypeError, match=message):
        linear._compute(dtype)


def test_compute_dtype_spellings():
    torch = pytest.importorskip("torch")
    for spelling in ("bfloat16", torch.bfloat16, linear._dtypes.lookup("bfloat16").dtype):
        assert linear._compute(spelling) == linear._dtypes.lookup("bfloat16").dtype
    assert linear._compute(None) is None
    assert str(linear._compute(torch.float16)) == "float16"


def test_autocast_dtype_of_a_linear_call(monkeypatch):
    """F.linear's autocast rule: the autocast dtype on CUDA tensors, unless every operand has
    it already or one is float64; never on the CPU or outside autocast."""
    torch = pytest.importorskip("torch")
    from cupyloss.torch import _amp as A

    class Like:          # the metadata linear_compute reads, without a CUDA tensor
        def __init__(self, dtype, device="cuda"):
            self.dtype, self.device = dtype, torch.device(device)

    f32, bf16, f64 = Like(torch.float32), Like(torch.bfloat16), Like(torch.float64)
    monkeypatch.setattr(A, "_autocast_on", lambda device: False)
    assert A.linear_compute(f32, f32, None) is None
    monkeypatch.setattr(A, "_autocast_on", lambda device: True)
    dtype = torch.get_autocast_dtype("cuda")
    name = str(dtype).replace("torch.", "")
    assert A.linear_compute(f32, f32, None) == name
    assert A.linear_compute(bf16, f32, None) == name
    assert A.linear_compute(f64, f64, None) is None
    assert A.linear_compute(Like(torch.float32, "cpu"), f32, None) is None
    same = Like(dtype)
    assert A.linear_compute(same, same, same) is None


def test_check_accepts_mixed_dtypes_only_with_compute():
    import numpy

    op = linear._dispatch.Operand
    bf16 = linear._dtypes.lookup("bfloat16").dtype

    def a(shape, dtype):
        return op(0, shape, (shape[-1], 1) if len(shape) == 2 else (1,), numpy.dtype(dtype), 0,
                  None)

    x, w, t = a((8, 4), "float32"), a((10, 4), "float32"), a((8,), "int64")
    with pytest.raises(TypeError, match="must match"):
        linear._check(a((8, 4), bf16), w, t, None, None, "mean", 0.0, 0.0, 0.0, ())
    assert linear._check(a((8, 4), bf16), w, t, None, None, "mean", 0.0, 0.0, 0.0, (),
                         compute=bf16) == (8, 4, 10)
    with pytest.raises(TypeError, match="compute_dtype"):
        linear._check(a((8, 4), "float64"), w, t, None, None, "mean", 0.0, 0.0, 0.0, (),
                      compute=bf16)
    assert linear._check(x, w, t, a((10,), bf16), None, "mean", 0.0, 0.0, 0.0, ("bias",),
                         compute=bf16) == (8, 4, 10)
