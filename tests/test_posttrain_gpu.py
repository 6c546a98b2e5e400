"""GPU tests of the post-training objectives: the fused GRPO family (cupyloss.linear_grpo_loss,
grpo_tokens between the log-probs' statistics and dZ) against the float64 references of
reference_posttrain.py in every dtype and plan; torch's eager fused path against its composed
one (what torch.compile traces) and compiled; the preference losses on CUDA tensors and from
JAX against the references."""

import functools

import numpy as np
import pytest

import reference_posttrain as ref
from gpu_util import BFLOAT16
from test_linear_gpu import TOL_GRAD, _err

pytestmark = pytest.mark.gpu

# 6 sequences of 50 tokens (300 rows: several 128-row chunks and a partial one), hidden 64,
# vocabulary 1000 (slices of 128 classes and a partial one)
B, T, H, V = 6, 50, 64, 1000
BUDGETS = {"default": None, "sum-128rows": V * H * 4 + 128 * V * 6, "slices": 240_000}
DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + ([BFLOAT16] if BFLOAT16 else [])


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, H)) * 0.5
    w = rng.standard_normal((V, H)) * 0.5
    b = rng.standard_normal(V) * 0.5
    t = rng.integers(0, V, (B, T))
    t[:, :5] = -100                                 # prompts
    t[2, 40:] = -100                                # a shorter completion
    host = [a.astype(dtype).astype(np.float64) for a in (x, w, b)]
    return host, t, rng


def _device(cupy, host, dtype):
    return [cupy.asarray(a.astype(dtype)) for a in host]


def _grpo_case(host, t, rng, temperature, per_token_adv):
    logp0, ent0, _ = ref.head(*host[:2], t, host[2], temperature)
    adv = rng.standard_normal((B, T) if per_token_adv else (B,))
    old = (logp0 + rng.uniform(-0.7, 0.7, (B, T))).astype(np.float32)
    refp = (logp0 + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    mask = np.ones((B, T), bool)
    mask[4, 10:20] = False
    return logp0, ent0, adv.astype(np.float32), old, refp, mask


def _grpo_options(loss_type):
    full = loss_type in ("grpo", "dapo")             # KL, entropy, mask, per-token advantages
    return full, dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                      beta=0.04 if full else 0.0, entropy_weight=0.01 if full else 0.0,
                      max_completion_length=60 if loss_type == "dr_grpo" else None)


@functools.lru_cache(maxsize=None)
def _grpo_reference(dtype_name, loss_type):
    """(inputs, float64 loss, metrics, gradients) of one dtype's rounded inputs: the central
    differences once for every plan."""
    dtype = np.dtype(dtype_name) if dtype_name != "bfloat16" else BFLOAT16
    host, t, rng = _inputs(dtype, seed=len(loss_type))
    full, opts = _grpo_options(loss_type)
    temperature = 0.8 if full else 1.0
    logp0, ent0, adv, old, refp, mask = _grpo_case(host, t, rng, temperature, full)
    m = (t != -100) & (mask if full else True)
    rkw = dict(loss_type=loss_type, eps_low=0.2, eps_high=0.28, beta=opts["beta"],
               entropy_weight=opts["entropy_weight"],
               max_completion_length=opts["max_completion_length"])
    refs = refp.astype(np.float64) if full else None
    want, want_m = ref.grpo(logp0, ent0, m, adv, old, refs, **rkw)
    if not full:
        want_m["kl"] = 0.0
    g_lp, g_ent = ref.token_gradients(
        lambda lp, en: ref.grpo(lp, en, m, adv, old, refs, **rkw)[0], logp0, ent0)
    want_g = ref.head_gradients(*host[:2], t, g_lp, g_ent, host[2], temperature)
    return (host, t, adv, old, refp, mask, temperature), want, want_m, want_g


@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_fused_grpo_against_float64(dtype, budget, loss_type):
    import cupy

    import cupyloss

    (host, t, adv, old, refp, mask, temperature), want, want_m, want_g = _grpo_reference(
        str(dtype), loss_type)
    full, opts = _grpo_options(loss_type)
    x, w, b = _device(cupy, host, dtype)
    wrt = ("hidden", "weight", "bias")
    loss, metrics, grads = cupyloss.linear_grpo_loss_value_and_grad(
        x, w, cupy.asarray(t), cupy.asarray(adv), b, mask=cupy.asarray(mask) if full else None,
        old_log_probs=cupy.asarray(old), ref_log_probs=cupy.asarray(refp) if full else None,
        temperature=temperature, max_workspace_bytes=BUDGETS[budget], wrt=wrt, **opts)
    wide = dtype == np.float64
    assert loss.dtype == (np.float64 if wide else np.float32) and loss.shape == ()
    tol = 1e-12 if wide else 2e-5
    assert abs(float(loss) - want) <= tol * max(abs(want), 1e-3), (float(loss), want)
    for k, v in want_m.items():
        assert abs(float(metrics[k]) - v) <= tol * max(abs(v), 1.0), k
    for name, got in zip(wrt, grads):
        assert got.dtype == dtype and got.shape == want_g[name].shape
        # float64: the reference's central differences (about 1e-9 of the largest) bound it
        limit = 1e-7 if wide else TOL_GRAD[str(dtype)]
        assert _err(cupy.asnumpy(got.astype(np.float64)), want_g[name]) <= limit, name
    # the value alone is the one pass's, bitwise; and a second call gives the same bits
    alone, alone_m = cupyloss.linear_grpo_loss(
        x, w, cupy.asarray(t), cupy.asarray(adv), b, mask=cupy.asarray(mask) if full else None,
        old_log_probs=cupy.asarray(old), ref_log_probs=cupy.asarray(refp) if full else None,
        temperature=temperature, max_workspace_bytes=BUDGETS[budget], **opts)
    assert cupy.array_equal(alone, loss)
    assert all(cupy.array_equal(alone_m[k], metrics[k]) for k in metrics)
    again = cupyloss.linear_grpo_loss_value_and_grad(
        x, w, cupy.asarray(t), cupy.asarray(adv), b, mask=cupy.asarray(mask) if full else None,
        old_log_probs=cupy.asarray(old), ref_log_probs=cupy.asarray(refp) if full else None,
        temperature=temperature, max_workspace_bytes=BUDGETS[budget], wrt=wrt, **opts)[2]
    assert all(cupy.array_equal(a, b) for a, b in zip(grads, again))


def _torch_case(torch, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(B, T, H, device="cuda", generator=gen) * 0.5).to(dtype)
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.5).to(dtype)
    t = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    t[:, :5] = -100
    adv = torch.randn(B, device="cuda", generator=gen)
    old = torch.randn(B, T, device="cuda", generator=gen) * 0.3 - 7.0
    return h, w, t, adv, old


def test_torch_eager_fused_equals_composed_and_scales_by_grad_output():
    """The eager fused Function against the composed formula (linear_log_probs and torch
    operations, what torch.compile and torch.func trace): the same loss, metrics and gradients
    within the gradients' dtype; backward of 4 * loss gives 4 times the gradients, bitwise."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF
    from cupyloss import posttrain
    from cupyloss.torch import _posttrain

    dtype = torch.bfloat16
    h, w, t, adv, old = _torch_case(torch, dtype)
    # a realistic ratio: old log-probs of the policy's own order, shifted
    with torch.no_grad():
        lp = CF.linear_log_probs(h, w, t)
        old = lp + 0.3 * torch.randn_like(lp)
    kw = dict(old_log_probs=old, ref_log_probs=old - 0.1, beta=0.04, entropy_weight=0.01,
              loss_type="grpo", temperature=0.9)
    out = {}
    for how in ("fused", "composed", "scaled"):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        if how == "composed":
            loss, metrics = posttrain.grpo_loss(_posttrain._OPS, _posttrain._log_probs, *leaves,
                                                t, adv, **kw)
        else:
            loss, metrics = CF.linear_grpo_loss(*leaves, t, adv, **kw)
        (loss * (4.0 if how == "scaled" else 1.0)).backward()
        out[how] = (loss.detach(), metrics, [a.grad for a in leaves])
    (lf, mf, gf), (lc, mc, gc), (_, _, gs) = out["fused"], out["composed"], out["scaled"]
    torch.testing.assert_close(lf, lc, rtol=2e-6, atol=1e-7)
    for k in mf:
        torch.testing.assert_close(mf[k], mc[k], rtol=2e-6, atol=1e-7)
    for a, c, s in zip(gf, gc, gs):
        scale = float(c.float().abs().max())
        assert float((a.float() - c.float()).abs().max()) <= TOL_GRAD["bfloat16"] * scale
        assert torch.equal(s, a * 4)


def test_torch_compile_fullgraph_on_cuda_equals_eager():
    """torch.compile(fullgraph=True) with inductor traces GRPO and DPO through the registered
    log-probs op and gives the eager losses and gradients."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF

    h, w, t, adv, old = _torch_case(torch, torch.float32, seed=1)

    def step(h, w):
        g, gm = CF.linear_grpo_loss(h, w, t, adv, old_log_probs=old, loss_type="bnpo")
        d, dm = CF.linear_dpo_loss(h, w, t, ref_log_probs=old)
        return g + d, gm["clip_ratio"], dm["rewards_margins"]

    got = {}
    for name, fn in (("compiled", torch.compile(step, fullgraph=True)), ("eager", step)):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss, clip, margin = fn(*leaves)
        loss.backward()
        got[name] = [loss.detach(), clip, margin, *(a.grad for a in leaves)]
    for a, r in zip(got["compiled"], got["eager"]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def _preference_budget(plan, dtype):
    """The workspace budget of a preference plan at these sizes: 'group' (the default: one
    group of all 300 rows' dZ, a float32 weight-gradient sum), 'group-split' (the group, a
    split sum of 128-class slices and 256-row chunks; float32 inputs: the group summing into
    the result), 'pairs' (the default, a group a pair), 'two-pass' (no group fits)."""
    from cupyloss import linear

    if plan == "group-split":
        return (B * T * V * dtype.itemsize + V * H * 2 + linear.split_cols(V, H) * H * 4
                + linear.CHUNK_ROWS_MIN * V * 4)
    return 1 if plan == "two-pass" else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind, options", [
    ("dpo", dict(loss_type="sigmoid", reference="head")), ("dpo", dict(loss_type="ipo")),
    ("orpo", {}), ("cpo", dict(alpha=1.0)), ("simpo", dict(gamma=0.5)), ("kto", {})])
@pytest.mark.parametrize("plan", ["group", "group-split", "pairs", "two-pass"])
def test_preference_on_cuda_against_float64(kind, options, dtype, plan, monkeypatch):
    """torch's eager calls on CUDA tensors (the one pass, cupyloss.linear_preference_loss_
    value_and_grad) against the float64 references, in each plan."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as CF
    from cupyloss import linear, posttrain

    if plan == "pairs":
        monkeypatch.setattr(posttrain, "GROUP_ROWS", T)
    budget = _preference_budget(plan, dtype)
    want_plan = linear.group_plan(B * T, V, H, dtype.itemsize, budget, True, B * T)
    if plan == "group-split" and dtype.itemsize == 2:
        assert want_plan.kind == "group" and want_plan.cols > 0
    if plan == "two-pass":
        assert want_plan is None
    o = dict(options)
    head_ref = o.pop("reference", None) == "head"
    host, t, rng = _inputs(dtype, seed=3)
    m = t != -100
    tdtype = {"float32": torch.float32, "float16": torch.float16,
              "bfloat16": torch.bfloat16}[str(dtype)]
    h, w, b = (torch.tensor(a, dtype=torch.float32, device="cuda").to(tdtype) for a in host)
    tt = torch.tensor(t, device="cuda")
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    average = kind in ("orpo", "simpo") or o.get("loss_type") == "ipo"
    kw, ref_seq = {}, None
    if kind in ("dpo", "kto"):
        rh = (host[0] + 0.1 * rng.standard_normal(host[0].shape)).astype(dtype).astype(
            np.float64)
        r_lp = ref.head(rh, host[1], t, host[2])[0]
        ref_seq = np.array([r_lp[k][m[k]].sum() / (m[k].sum() if average else 1)
                            for k in range(B)])
        if head_ref:
            kw.update(ref_hidden=torch.tensor(rh, dtype=torch.float32, device="cuda").to(tdtype),
                      ref_weight=w, ref_bias=b)
        else:
            kw["ref_log_probs"] = torch.tensor(r_lp, dtype=torch.float32, device="cuda")
    desirable = np.array([True, False, True, True, False, False])
    fn = getattr(CF, f"linear_{kind}_loss")
    kw["max_workspace_bytes"] = budget
    if kind == "kto":
        loss, metrics = fn(*leaves[:2], tt, torch.tensor(desirable, device="cuda"),
                           leaves[2], **kw)
    else:
        loss, metrics = fn(*leaves[:2], tt, leaves[2], **o, **kw)
    loss.backward()
    logp0, ent0, _ = ref.head(*host[:2], t, host[2])
    rkw = dict(o, desirable=desirable)
    want, want_m = ref.preference(kind, logp0, m, ref_seq, **rkw)
    assert abs(float(loss.detach()) - want) <= 2e-5 * max(abs(want), 1e-2)
    for k, v in want_m.items():
        assert abs(float(metrics[k]) - v) <= 2e-5 * max(abs(v), 1.0), k
    g_lp, g_ent = ref.token_gradients(
        lambda lp, en: ref.preference(kind, lp, m, ref_seq, **rkw)[0], logp0, ent0)
    want_g = ref.head_gradients(*host[:2], t, g_lp, g_ent, host[2])
    for leaf, name in zip(leaves, ("hidden", "weight", "bias")):
        assert leaf.grad.dtype == tdtype
        assert _err(leaf.grad.double().cpu().numpy(), want_g[name]) <= TOL_GRAD[str(dtype)], \
            name


@pytest.mark.parametrize("kind", ["grpo", "dpo", "simpo"])
def test_jax_under_jit_value_and_grad_against_float64(kind):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupyloss.jax as CJ

    host, t, rng = _inputs(np.dtype(np.float32), seed=5)
    m = t != -100
    h, w = (jnp.asarray(a, jnp.float32) for a in host[:2])
    tt = jnp.asarray(t, jnp.int32)
    logp0, ent0, _ = ref.head(host[0], host[1], t)
    if kind == "grpo":
        _, _, adv, old, refp, _ = _grpo_case(host[:2] + [None], t, rng, 1.0, False)
        opts = dict(loss_type="grpo", beta=0.04)

        def f(h, w):
            return CJ.linear_grpo_loss(h, w, tt, jnp.asarray(adv), old_log_probs=jnp.asarray(old),
                                       ref_log_probs=jnp.asarray(refp), **opts)

        def objective(lp, en):
            return ref.grpo(lp, en, m, adv, old, refp.astype(np.float64), loss_type="grpo",
                            beta=0.04)[0]
    else:
        r_lp = (logp0 + rng.normal(0, 0.2, logp0.shape)).astype(np.float32)
        average = kind == "simpo"
        ref_seq = (None if kind == "simpo" else
                   np.array([r_lp[k][m[k]].sum() for k in range(B)]))

        def f(h, w):
            extra = {} if kind == "simpo" else {"ref_log_probs": jnp.asarray(r_lp)}
            return CJ.linear_preference_loss(kind, h, w, tt, **extra)

        def objective(lp, en):
            return ref.preference(kind, lp, m, ref_seq)[0]
        assert average == (kind == "simpo")
    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
    want = objective(logp0, ent0)
    assert abs(float(loss) - want) <= 2e-5 * max(abs(want), 1e-2)
    g_lp, g_ent = ref.token_gradients(objective, logp0, ent0)
    want_g = ref.head_gradients(host[0], host[1], t, g_lp, g_ent)
    for got, name in zip(grads, ("hidden", "weight")):
        assert _err(np.asarray(got, np.float64), want_g[name]) <= TOL_GRAD["float32"], name


@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float64)], ids=str)
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("beta, hard", [(0.5, 0.0), (0.0, 0.3), (1.0, 0.0), (0.2, 0.5)])
def test_fused_jsd_against_float64(dtype, budget, beta, hard):
    """linear_jsd_value_and_grad in every plan (the teacher's logits formed beside the
    student's chunks and slices) against the float64 reference; the value alone is the one
    pass's bitwise; teacher hidden 48 against the student's 64; no target when hard is 0 and
    beta is 0.5 (every row counts)."""
    import cupy

    import cupyloss

    host, t, rng = _inputs(dtype, seed=9)
    ht = (rng.standard_normal((B, T, 48)) * 0.5).astype(dtype).astype(np.float64)
    wt = (rng.standard_normal((V, 48)) * 0.5).astype(dtype).astype(np.float64)
    bt = (rng.standard_normal(V) * 0.5).astype(dtype).astype(np.float64)
    target = None if (beta == 0.5 and not hard) else t
    x, w, b = _device(cupy, host, dtype)
    xt, wtd, btd = _device(cupy, [ht, wt, bt], dtype)
    kw = dict(student_bias=b, teacher_bias=btd, beta=beta, temperature=1.3, hard_weight=hard,
              max_workspace_bytes=BUDGETS[budget])
    tgt = None if target is None else cupy.asarray(target)
    wrt = ("hidden", "weight", "bias")
    loss, grads = cupyloss.linear_jsd_value_and_grad(x, w, xt, wtd, tgt, wrt=wrt, **kw)
    want, want_g = ref.jsd(host[0], host[1], ht, wt, target, host[2], bt, beta, 1.3, hard)
    wide = dtype == np.float64
    assert loss.shape == () and loss.dtype == (np.float64 if wide else np.float32)
    assert abs(float(loss) - want) <= (1e-12 if wide else 2e-5) * max(abs(want), 1e-3)
    for name, got in zip(wrt, grads):
        assert got.dtype == dtype
        limit = 1e-10 if wide else TOL_GRAD[str(dtype)]
        assert _err(cupy.asnumpy(got.astype(np.float64)), want_g[name]) <= limit, name
    assert cupy.array_equal(cupyloss.linear_jsd(x, w, xt, wtd, tgt, **kw), loss)


def test_torch_and_jax_jsd_against_float64():
    """cupyloss.torch.linear_jsd (eager fused, and compiled: the registered op) and
    cupyloss.jax.linear_jsd under jit(grad) against the float64 reference."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupyloss.jax as CJ
    import cupyloss.torch as CF

    host, t, rng = _inputs(np.dtype(np.float32), seed=10)
    ht = rng.standard_normal((B, T, 80)).astype(np.float32) * 0.5
    wt = rng.standard_normal((V, 80)).astype(np.float32) * 0.5
    want, want_g = ref.jsd(host[0], host[1], ht, wt, t, None, None, 0.3, 2.0, 0.25)
    h, w = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in host[:2])
    th, tw = (torch.tensor(a, device="cuda") for a in (ht, wt))
    tt = torch.tensor(t, device="cuda")

    def step(h, w):
        return CF.linear_jsd(h, w, th, tw, tt, beta=0.3, temperature=2.0, hard_weight=0.25)

    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = fn(*leaves)
        loss.backward()
        assert abs(float(loss.detach()) - want) <= 2e-5 * abs(want)
        for leaf, name in zip(leaves, ("hidden", "weight")):
            assert _err(leaf.grad.double().cpu().numpy(), want_g[name]) <= TOL_GRAD["float32"]

    def f(h, w):
        return CJ.linear_jsd(h, w, jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(t, jnp.int32),
                             beta=0.3, temperature=2.0, hard_weight=0.25)

    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(
        *(jnp.asarray(a, jnp.float32) for a in host[:2]))
    assert abs(float(loss) - want) <= 2e-5 * abs(want)
    for got, name in zip(grads, ("hidden", "weight")):
        assert _err(np.asarray(got, np.float64), want_g[name]) <= TOL_GRAD["float32"], name


def test_fused_grpo_num_items_on_the_device_equals_the_number():
    """'dapo' with num_items a 0-d device array (int32, or float32) gives the loss and the
    gradients of the same count given as a Python number, bitwise: the divisor is read on the
    device, never on the host."""
    import cupy

    import cupyloss

    host, t, rng = _inputs(np.dtype(np.float32), seed=11)
    x, w, b = _device(cupy, host, np.dtype(np.float32))
    adv = cupy.asarray(rng.standard_normal(B), cupy.float32)
    out = []
    for items in (200, cupy.asarray(200, cupy.int32), cupy.asarray(200.0, cupy.float32)):
        loss, _, grads = cupyloss.linear_grpo_loss_value_and_grad(
            x, w, cupy.asarray(t), adv, loss_type="dapo", num_items=items)
        out.append([loss, *grads])
    for other in out[1:]:
        assert all(cupy.array_equal(a, r) for a, r in zip(other, out[0]))


def test_split_sum_is_float32_addition_bit_for_bit():
    """scale.cu's split_add and split_finish: the float32 in two 16-bit halves, summed over
    several additions (odd sizes and offsets: the one-at-a-time paths too), equals CuPy's
    float32 sums bit for bit, and its rounding the float32's rounding to float16 and
    bfloat16."""
    import cupy

    from cupyloss import linear

    rng = np.random.default_rng(5)
    for n, offset in ((4096, 0), (1003, 0), (777, 3)):
        parts = [cupy.asarray(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n),
                              np.float32) for _ in range(5)]
        for dtype in DTYPES[1:]:
            hi = cupy.empty(n + offset, np.uint16)[offset:]
            lo = cupy.empty(n + offset, np.uint16)[offset:]
            want = cupy.zeros(n, np.float32)
            stream = cupy.cuda.get_current_stream().ptr
            for k, part in enumerate(parts):
                linear._split_add(part, hi, lo, k == 0, stream, 0)
                want = part.copy() if k == 0 else want + part
                got = ((hi.astype(np.uint32) << 16) | lo.astype(np.uint32)).view(np.float32)
                assert cupy.array_equal(got.view(np.uint32), want.view(np.uint32))
            out = hi.view(dtype)
            linear._split_finish(out, lo, stream, 0)
            expect = cupy.asnumpy(want).astype(dtype)
            assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expect.view(np.uint16))
