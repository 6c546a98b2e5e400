"""CPU tests of the post-training objectives (cupyloss.posttrain): cupyloss.torch's CPU path
(linear_log_probs in torch's operations and the objectives composed on them, what
torch.compile traces on a GPU too) against the float64 references of reference_posttrain.py,
in values, metrics and gradients; and the checks made before any launch."""

import numpy as np
import pytest

import reference_posttrain as ref

torch = pytest.importorskip("torch")
import cupyloss.torch as CF  # noqa: E402

# 4 sequences (2 preference pairs) of 7 tokens, the first two of each a prompt (ignore_index);
# hidden 5, vocabulary 9: small enough for the reference's central differences per token.
B, T, H, V = 4, 7, 5, 9


def _case(seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=gen)
    w = torch.randn(V, H, generator=gen)
    b = torch.randn(V, generator=gen) if bias else None
    t = torch.randint(0, V, (B, T), generator=gen)
    t[:, :2] = -100
    t[1, -1] = -100                               # a shorter sequence
    return h, w, b, t, gen


def _check_grads(leaves, host, t, g_lp, g_ent, temperature=1.0):
    h, w, b = host
    want = ref.head_gradients(h, w, t, g_lp, g_ent, b, temperature)
    for leaf, name in zip(leaves, ("hidden", "weight", "bias")):
        if leaf is None:
            continue
        scale = np.abs(want[name]).max()
        np.testing.assert_allclose(leaf.grad.double().numpy(), want[name], rtol=1e-4,
                                   atol=1e-5 * scale + 1e-7, err_msg=name)


def _metrics_close(got, want):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(old=True, epsilon_low=0.1, epsilon_high=0.3),
    dict(old=True, ref=True, beta=0.04, entropy_weight=0.01, per_token_adv=True, mask=True,
         temperature=0.7),
], ids=["on-policy", "clipped", "kl-entropy-mask-T"])
def test_grpo_cpu_path_matches_float64(loss_type, options):
    h, w, b, t, gen = _case(seed=hash(loss_type) % 97)
    o = dict(options)
    temperature = o.pop("temperature", 1.0)
    adv = torch.randn((B, T) if o.pop("per_token_adv", False) else (B,), generator=gen)
    mask = None
    if o.pop("mask", False):
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[2, 3] = False
    logp0, ent0, _ = ref.head(h.numpy(), w.numpy(), t.numpy(), b.numpy(), temperature)
    # old log-probs near the policy's (ratios 0.5 .. 2: some clipped, none on a clip boundary)
    old = torch.tensor(logp0 + np.random.default_rng(1).uniform(-0.7, 0.7, (B, T)),
                       dtype=torch.float32) if o.pop("old", False) else None
    refp = torch.tensor(logp0 + np.random.default_rng(2).normal(0, 0.3, (B, T)),
                        dtype=torch.float32) if o.pop("ref", False) else None
    kw = dict(loss_type=loss_type, max_completion_length=9 if loss_type == "dr_grpo" else None,
              num_items=40.0 if loss_type == "dapo" else None, **o)
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]
    loss, metrics = CF.linear_grpo_loss(*leaves[:2], t, adv, leaves[2], mask=mask,
                                        old_log_probs=old, ref_log_probs=refp,
                                        temperature=temperature, **kw)
    loss.backward()
    m = (t.numpy() != -100) & (True if mask is None else mask.numpy())
    rkw = dict(loss_type=loss_type, eps_low=kw.get("epsilon_low", 0.2),
               eps_high=kw.get("epsilon_high"), beta=kw.get("beta", 0.0),
               entropy_weight=kw.get("entropy_weight", 0.0),
               max_completion_length=kw["max_completion_length"], num_items=kw["num_items"])
    olds = None if old is None else old.double().numpy()
    refs = None if refp is None else refp.double().numpy()
    want, want_m = ref.grpo(logp0, ent0, m, adv.double().numpy(), olds, refs, **rkw)
    np.testing.assert_allclose(float(loss.detach()), want, rtol=1e-5, atol=1e-6)
    if refp is None:
        want_m["kl"] = 0.0
    _metrics_close(metrics, want_m)

    def objective(lp, en):
        # old None: the ratio's value is 1 but its gradient is the log-prob's own
        return ref.grpo(lp, en, m, adv.double().numpy(), logp0 if olds is None else olds,
                        refs, **rkw)[0]

    g_lp, g_ent = ref.token_gradients(objective, logp0, ent0)
    _check_grads(leaves, (h.numpy(), w.numpy(), b.numpy()), t.numpy(), g_lp, g_ent,
                 temperature)


PREFERENCES = [
    ("dpo", dict(loss_type="sigmoid")),
    ("dpo", dict(loss_type="sigmoid", label_smoothing=0.1)),
    ("dpo", dict(loss_type="ipo")),
    ("dpo", dict(loss_type="hinge", beta=0.5)),
    ("orpo", dict(beta=0.2)),
    ("cpo", dict(alpha=1.0)),
    ("cpo", dict(loss_type="hinge", alpha=0.5)),
    ("simpo", dict(beta=2.0, gamma=0.5)),
    ("simpo", dict(alpha=0.3, label_smoothing=0.2)),
    ("kto", dict(kl=0.05, desirable_weight=1.3)),
]


# ORPO, CPO and SimPO take no reference; DPO and KTO take one as per-token or per-sequence
# log-probs or as a reference head, or none (a zero reference).
CASES = [(k, o, r) for k, o in PREFERENCES
         for r in ((None,) if k in ("orpo", "cpo", "simpo") else ("tokens", "sequences", "head",
                                                                  None))]


@pytest.mark.parametrize("kind, options, reference", CASES,
                         ids=[f"{k}-{'-'.join(map(str, o.values()))}-{r}" for k, o, r in CASES])
def test_preference_cpu_path_matches_float64(kind, options, reference):
    h, w, b, t, gen = _case(seed=len(kind) + len(options))
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]
    o = dict(options)
    average = kind in ("orpo", "simpo") or o.get("loss_type") == "ipo"
    m = t.numpy() != -100
    kw, ref_seq = {}, None
    if reference is not None:
        rh = h + 0.1 * torch.randn(B, T, H, generator=gen)
        r_lp = ref.head(rh.numpy(), w.numpy(), t.numpy(), b.numpy())[0]
        ref_seq = np.array([r_lp[k][m[k]].sum() / (m[k].sum() if average else 1)
                            for k in range(B)])
        if reference == "tokens":
            kw["ref_log_probs"] = torch.tensor(r_lp, dtype=torch.float32)
        elif reference == "sequences":
            kw["ref_log_probs"] = torch.tensor(ref_seq, dtype=torch.float32)
        else:
            kw.update(ref_hidden=rh, ref_weight=w, ref_bias=b)
    fn = {"dpo": CF.linear_dpo_loss, "orpo": CF.linear_orpo_loss, "cpo": CF.linear_cpo_loss,
          "simpo": CF.linear_simpo_loss, "kto": CF.linear_kto_loss}[kind]
    desirable = torch.tensor([True, False, False, True])
    if kind == "kto":
        loss, metrics = fn(*leaves[:2], t, desirable, leaves[2], kl=torch.tensor(o["kl"]),
                           desirable_weight=o["desirable_weight"], **kw)
    else:
        if kind != "dpo":
            kw = {}
        loss, metrics = fn(*leaves[:2], t, leaves[2], **o, **kw)
    loss.backward()
    logp0, ent0, _ = ref.head(h.numpy(), w.numpy(), t.numpy(), b.numpy())
    rkw = dict(o, desirable=desirable.numpy())

    def objective(lp, en):
        return ref.preference(kind, lp, m, ref_seq, **rkw)[0]

    want, want_m = ref.preference(kind, logp0, m, ref_seq, **rkw)
    np.testing.assert_allclose(float(loss.detach()), want, rtol=1e-5, atol=1e-6)
    _metrics_close(metrics, want_m)
    g_lp, g_ent = ref.token_gradients(objective, logp0, ent0)
    assert not g_ent.any()
    _check_grads(leaves, (h.numpy(), w.numpy(), b.numpy()), t.numpy(), g_lp, g_ent)


@pytest.mark.parametrize("kind, options", PREFERENCES,
                         ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in PREFERENCES])
@pytest.mark.parametrize("reference", [True, False], ids=["ref", "noref"])
def test_one_pass_coefficients_are_the_objectives_token_gradients(kind, options, reference):
    """What the GPU's one pass scales each sequence's products by (posttrain._PreferenceRows:
    pair_slopes, kto_slopes, the averages and the NLL term, written by hand) times each
    token's mask equals the float64 reference's gradient in the per-token log-probs (central
    differences), for every loss and option; on NumPy, as the one pass runs it on CuPy."""
    from cupyloss import posttrain

    rng = np.random.default_rng(len(kind) + len(options))
    logp = -rng.uniform(0.05, 3.0, (B, T))
    m = rng.random((B, T)) > 0.25
    # a sequence with no counted token (one for ORPO, whose log(1 - e^0) is infinite)
    m[1, 1 if kind == "orpo" else 0:] = False
    ref_seq = rng.normal(-4.0, 1.0, B) if reference and kind in ("dpo", "kto") else None
    if kind in ("orpo", "simpo") or options.get("loss_type") == "ipo":
        logp = logp / 4.0                         # means: ORPO's log(1 - e^s) stays finite
    desirable = np.array([True, False, False, True])
    o = {k: v for k, v in options.items() if k != "kl"}
    rows = posttrain._PreferenceRows(kind, o, {})
    rows.shape, rows.ref = (B, T), ref_seq
    rows.desirable = desirable if kind == "kto" else None
    rows.kl = options.get("kl", 0.0)
    rows.setup(np, m.reshape(-1).astype(np.float64))
    for k in range(rows.pairs):                   # one group a pair (a row for kto)
        rows.coefficients(logp.reshape(-1), k, k + 1)
    got = rows.coef[:, None] * m
    rkw = dict(options, desirable=desirable)
    g_lp, _ = ref.token_gradients(lambda lp, en: ref.preference(kind, lp, m, ref_seq, **rkw)[0],
                                  logp, np.zeros_like(logp))
    np.testing.assert_allclose(got, g_lp, rtol=1e-6, atol=1e-9 * np.abs(g_lp).max())


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("batch, length, rows, group_rows", [
    (8, 1024, 512, 1024), (16, 50, 128, 1024), (6, 300, 1024, 300), (4, 7, 3, 7)])
def test_one_pass_groups_cover_every_row_once_in_whole_sequences(kind, batch, length, rows,
                                                                 group_rows, monkeypatch):
    """The group plan's schedule (posttrain._PreferenceRows): every row in exactly one chunk of
    at most `rows` rows, each group whole pairs (rows for 'kto': pair k is rows k and k + B/2)
    within the dZ it holds, and scales() pieces that lie in one sequence each, scaled by that
    sequence's coefficient."""
    from types import SimpleNamespace

    from cupyloss import linear, posttrain

    monkeypatch.setattr(posttrain, "GROUP_ROWS", group_rows)
    rows_obj = posttrain._PreferenceRows(kind, {"beta": 0.1}, {})
    rows_obj.shape, rows_obj.ref, rows_obj.kl = (batch, length), None, 0.0
    rows_obj.desirable = np.arange(batch) % 2 == 0 if kind == "kto" else None
    rng = np.random.default_rng(0)
    rows_obj.setup(np, (rng.random(batch * length) > 0.2).astype(np.float64))
    capacity = rows_obj.group_rows(None)
    assert capacity % length == 0 and capacity <= max(group_rows, length) * 2
    pl = linear.group_plan(batch * length, 1000, 64, 2, None, True, capacity)
    assert pl.tile == min(capacity, batch * length)
    head = SimpleNamespace(logp=-rng.uniform(0.1, 2.0, batch * length))
    call = SimpleNamespace(head=head)
    seen = np.zeros(batch * length, int)
    pairs = batch // 2
    for group in rows_obj.schedule(call, rows, capacity):
        assert sum(r1 - r0 for r0, r1 in group) <= capacity
        seqs = {b for r0, r1 in group for b in range(r0 // length, -(-r1 // length))}
        if kind != "kto":
            assert seqs == {b for b in seqs if b < pairs} | {b + pairs for b in seqs
                                                              if b < pairs}
        for (r0, r1), parts in zip(group, rows_obj.scales(call, group)):
            assert 0 < r1 - r0 <= rows
            seen[r0:r1] += 1
            assert [p0 for p0, _, _ in parts][0] == r0 and parts[-1][1] == r1
            for (p0, p1, alpha), nxt in zip(parts, parts[1:] + [(r1, None, None)]):
                assert p1 == nxt[0] and p0 // length == (p1 - 1) // length
                assert alpha.shape == (1,) and alpha[0] == rows_obj.coef[p0 // length]
    assert (seen == 1).all()


def test_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) traces GRPO and DPO through linear_log_probs' registered op
    (no graph break) and gives eager's loss and gradients."""
    h, w, b, t, gen = _case(3)
    adv = torch.randn(B, generator=gen)
    old = torch.randn(B, T, generator=gen) * 0.1 - 2.0

    def step(h, w):
        g, _ = CF.linear_grpo_loss(h, w, t, adv, old_log_probs=old, loss_type="dapo")
        d, _ = CF.linear_dpo_loss(h, w, t, ref_log_probs=old)
        return g + d

    got, want = [], []
    for fn, out in ((torch.compile(step, fullgraph=True, backend="aot_eager"), got),
                    (step, want)):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = fn(*leaves)
        loss.backward()
        out += [loss.detach(), *(a.grad for a in leaves)]
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


def test_masked_tokens_add_nothing_whatever_their_values():
    """A token outside the mask (or ignored) changes neither the loss nor any gradient, even
    with non-finite old or reference log-probs there."""
    h, w, b, t, gen = _case(4)
    adv = torch.randn(B, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4] = False
    old = torch.full((B, T), -2.0)
    refp = torch.full((B, T), -2.5)
    out = []
    for bad in (False, True):
        o, r = old.clone(), refp.clone()
        if bad:
            o[0, 4], r[0, 4], o[1, 0] = float("inf"), float("nan"), float("nan")
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss, _ = CF.linear_grpo_loss(*leaves, t, adv, mask=mask, old_log_probs=o,
                                      ref_log_probs=r, beta=0.1)
        loss.backward()
        out.append([loss.detach(), *(a.grad for a in leaves)])
    for a, r in zip(*out):
        assert torch.equal(a, r)


@pytest.mark.parametrize("call, message", [
    (lambda h, w, t: CF.linear_grpo_loss(h, w, t, torch.ones(B), loss_type="ppo"),
     "loss_type must be one of grpo, bnpo, dr_grpo, dapo"),
    (lambda h, w, t: CF.linear_grpo_loss(h, w, t, torch.ones(B), beta=0.1),
     "pass ref_log_probs"),
    (lambda h, w, t: CF.linear_grpo_loss(h, w, t, torch.ones(B), epsilon_low=1.0),
     "epsilon_low must be below 1"),
    (lambda h, w, t: CF.linear_grpo_loss(h[0], w, t[0], torch.ones(B)),
     "takes sequences"),
    (lambda h, w, t: CF.linear_dpo_loss(h[:3], w, t[:3]), "an even number of rows, got 3"),
    (lambda h, w, t: CF.linear_dpo_loss(h, w, t, loss_type="kto"),
     "dpo loss_type must be one of sigmoid, ipo, hinge"),
    (lambda h, w, t: CF.linear_dpo_loss(h, w, t, beta=0.0), "beta must be a positive"),
    (lambda h, w, t: CF.linear_dpo_loss(h, w, t, ref_log_probs=torch.zeros(3)),
     "ref_log_probs must have shape"),
    (lambda h, w, t: CF.linear_dpo_loss(h, w, t, ref_log_probs=torch.zeros(B), ref_hidden=h,
                                        ref_weight=w), "not both"),
    (lambda h, w, t: CF.linear_dpo_loss(h, w, t, ref_hidden=h), "needs both"),
    (lambda h, w, t: CF.linear_kto_loss(h, w, t, torch.ones(3, dtype=torch.bool)),
     r"desirable must have shape \(4,\)"),
])
def test_bad_input_is_refused(call, message):
    h, w, _, t, _ = _case(5)
    with pytest.raises(ValueError, match=message):
        call(h, w, t)


# Eager: every beta with and without targets and the hard loss; compiled (the registered op
# and its closed-form backward): each beta once, the hard loss on.
JSD_CASES = ([(b, h, t, False) for b in (0.0, 0.3, 0.5, 1.0)
              for h, t in ((0.0, False), (0.0, True), (0.4, True))]
             + [(b, 0.4, True, True) for b in (0.0, 0.3, 0.5, 1.0)])


@pytest.mark.parametrize("beta, hard, with_target, compiled", JSD_CASES)
def test_jsd_cpu_path_matches_float64(beta, hard, with_target, compiled):
    """linear_jsd on CPU tensors: eager (torch's autograd of the formula) and under
    torch.compile (the registered op and its closed-form backward) against the float64
    reference; the teacher's hidden size differs from the student's and gets no gradient."""
    h, w, b, t, gen = _case(7)
    ht = torch.randn(B, T, 3, generator=gen)
    wt = torch.randn(V, 3, generator=gen)
    bt = torch.randn(V, generator=gen)
    target = t if with_target else None
    leaves = [a.clone().requires_grad_() for a in (h, w, b)]
    teacher = [a.clone().requires_grad_() for a in (ht, wt)]

    def run(h, w, b):
        return CF.linear_jsd(h, w, *teacher, target, student_bias=b, teacher_bias=bt,
                             beta=beta, temperature=1.7, hard_weight=hard)

    if compiled:
        torch._dynamo.reset()        # each case's options are constants of its own graph
    fn = torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run
    loss = fn(*leaves)
    (3.0 * loss).backward()
    want, grads = ref.jsd(h.numpy(), w.numpy(), ht.numpy(), wt.numpy(),
                          None if target is None else target.numpy(), b.numpy(), bt.numpy(),
                          beta, 1.7, hard)
    np.testing.assert_allclose(float(loss.detach()), want, rtol=1e-5, atol=1e-6)
    for leaf, name in zip(leaves, ("hidden", "weight", "bias")):
        np.testing.assert_allclose(leaf.grad.double().numpy(), 3.0 * grads[name], rtol=1e-4,
                                   atol=1e-5 * np.abs(grads[name]).max(), err_msg=name)
    assert all(a.grad is None for a in teacher)


@pytest.mark.parametrize("call, message", [
    (lambda h, w, t: CF.linear_jsd(h, w, h, w, t, beta=1.5), r"beta must be in \[0, 1\]"),
    (lambda h, w, t: CF.linear_jsd(h, w, h, w, hard_weight=0.5), "pass target"),
    (lambda h, w, t: CF.linear_jsd(h, w, h, w, t, temperature=0.0),
     "temperature must be a positive"),
])
def test_jsd_bad_input_is_refused(call, message):
    h, w, _, t, _ = _case(8)
    with pytest.raises(ValueError, match=message):
        call(h, w, t)


def test_grpo_num_items_as_a_0d_tensor_equals_the_number():
    """'dapo' over a global count given as a 0-d tensor (int or float, never read back) gives
    the loss and gradients of the same count as a number."""
    h, w, b, t, gen = _case(9)
    adv = torch.randn(B, generator=gen)
    out = []
    for items in (40, torch.tensor(40), torch.tensor(40.0)):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss, _ = CF.linear_grpo_loss(*leaves, t, adv, loss_type="dapo", num_items=items)
        loss.backward()
        out.append([loss.detach(), *(a.grad for a in leaves)])
    for other in out[1:]:
        for a, r in zip(other, out[0]):
            assert torch.equal(a, r)


@pytest.mark.parametrize("items, error, message", [
    (0, ValueError, "num_items must be positive"),
    (True, TypeError, "got a bool"),
    (torch.ones(2), TypeError, r"a 0-d array .*got an array of shape \(2,\)"),
    ("40", TypeError, "num_items must be a number or a 0-d array"),
])
def test_grpo_num_items_of_the_wrong_kind_is_refused(items, error, message):
    h, w, _, t, _ = _case(10)
    with pytest.raises(error, match=message):
        CF.linear_grpo_loss(h, w, t, torch.ones(B), loss_type="dapo", num_items=items)
