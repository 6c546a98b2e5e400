"""Benchmark the post-training objectives on the LLM head: GRPO and DPO, forward + backward.

    python -m cupyloss.bench.posttrain [--families grpo,dpo,dpo-long] [--budgets 256,4608]
                                       [--only cupyloss,Liger] [--reps 5] [--json out.json]

Hidden 4096, vocabulary 128256, bfloat16 hidden states and weight; the gradients of hidden and
weight.  Families (the sizes the post-training issue names):

  grpo       8 sequences x 1024 completion tokens (8192), advantages one a sequence, old and
             reference log-probs given, loss_type 'dapo', beta 0.04, clip 0.2
  dpo        8 pairs x 1024 tokens (16 sequences, the first quarter of each a prompt), the
             reference a frozen head (its own hidden states, the same weight), sigmoid, beta 0.1
  dpo-long   4 pairs x 4096 tokens, as dpo
  orpo, cpo, simpo, kto
             8 pairs x 1024 tokens as dpo, Liger's default options (CPO and SimPO with alpha 1
             times the chosen rows' cross entropy; KTO with a reference head, half the rows
             desirable)
  distill    8 x 1024 tokens, a teacher head of the same shape (its own hidden states and
             weight), 0.5 x (JSD at beta 0.5 + the student's cross entropy), Liger's default mix

Implementations:

  torch eager      logits = (h @ W.T).float(), log_softmax, gather, TRL's formula
  torch.compile    the same function compiled
  Liger-Kernel     liger_kernel.chunked_loss's LigerFusedLinearGRPOLoss, LigerFusedLinearDPOLoss,
                   LigerFusedLinearJSDLoss (when importable; compiled=True, its default chunks)
  cupyloss         cupyloss.torch.linear_grpo_loss / linear_dpo_loss / linear_jsd at each
                   workspace budget (MiB)

Each row: median ms, the peak memory above the inputs (GiB, gradients included) and beyond the
gradients, and the errors of the loss and of the hidden gradient (largest |error| over largest
|value|) against float64 logits of the same bfloat16 operands.  Never used as a test.
"""

from __future__ import annotations

from cupyloss.bench import _timing
from cupyloss.bench.linear import H, V

FAMILIES = {"grpo": (8, 1024), "dpo": (16, 1024), "dpo-long": (8, 4096), "distill": (8, 1024),
            "orpo": (16, 1024), "cpo": (16, 1024), "simpo": (16, 1024), "kto": (16, 1024)}
BETA_GRPO, BETA_DPO = 0.04, 0.1
# The preference losses' options: Liger-Kernel's defaults (SimPO and CPO add alpha = 1 times
# the chosen rows' cross entropy, ORPO its own; DPO and KTO take a reference head).
PREFERENCE = {"dpo": {}, "dpo-long": {}, "orpo": {}, "cpo": {"alpha": 1.0},
              "simpo": {"alpha": 1.0, "gamma": 0.5}, "kto": {}}


def _grpo_formula(torch, lp, t, adv, old, ref):
    """TRL's 'dapo' GRPO loss on per-token log-probs (B, T)."""
    mask = (t != -100).to(lp.dtype)
    coef = torch.exp(lp - old)
    clipped = coef.clamp(0.8, 1.2)
    per = -torch.min(coef * adv[:, None], clipped * adv[:, None])
    per = per + BETA_GRPO * (torch.exp(ref - lp) - (ref - lp) - 1)
    return (per * mask).sum() / mask.sum().clamp(min=1)


def _preference_formula(torch, family, lp, ref_lp, t):
    """The family's preference loss (cupyloss.posttrain's formula, in torch) on per-token
    log-probs (B, T), chosen rows first (KTO: the first half desirable)."""
    from cupyloss import posttrain

    kind = "dpo" if family == "dpo-long" else family
    ops = posttrain.Ops(torch, stop=torch.Tensor.detach)
    mask = (t != -100).to(lp.dtype)
    ref = None
    if ref_lp is not None:
        ref = posttrain.sequence_log_probs(ops, ref_lp.to(lp.dtype), mask,
                                           posttrain.averages(kind))
    desirable = torch.arange(t.shape[0], device=t.device) < t.shape[0] // 2
    return posttrain.preference_objective(ops, kind, lp, mask, ref, beta=BETA_DPO,
                                          desirable=desirable, **PREFERENCE[family])[0]


def _logits_lp(torch, h, w, t, dtype=None):
    logits = (h @ w.T)
    logits = logits.float() if dtype is None else logits.to(dtype)
    lp = logits.log_softmax(-1)
    return lp.gather(-1, t.clamp(min=0)[..., None])[..., 0] * (t != -100)


def _reference(torch, family, h, w, t, extra):
    """(float64 loss, float64 hidden gradient): per-token log-probs of float64 logits in
    chunks of rows, the formula's gradient in them by autograd, then dZ and dX chunk by
    chunk."""
    wd = w.double()
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), t.reshape(-1)

    def logp_of(hh):
        out = []
        for r in range(0, flat_t.numel(), 1024):
            z = hh[r:r + 1024].double() @ wd.T
            lp = z.log_softmax(-1)
            out.append(lp.gather(-1, flat_t[r:r + 1024].clamp(min=0)[:, None])[:, 0]
                       * (flat_t[r:r + 1024] != -100))
        return torch.cat(out).reshape(t.shape)

    if family == "distill":
        return _reference_distill(torch, h, w, t, *extra)
    lp = logp_of(flat_h).requires_grad_()
    if family == "grpo":
        adv, old, ref = extra
        loss = _grpo_formula(torch, lp, t, adv.double(), old.double(), ref.double())
    else:
        ref_lp = logp_of(extra[0].reshape(-1, h.shape[-1])) if extra else None
        loss = _preference_formula(torch, family, lp, ref_lp, t)
    (g,) = torch.autograd.grad(loss, lp)
    g = g.reshape(-1)
    gx = torch.empty(flat_h.shape, dtype=torch.float64, device=h.device)
    for r in range(0, flat_t.numel(), 1024):
        z = flat_h[r:r + 1024].double() @ wd.T
        p = z.softmax(-1)
        tt = flat_t[r:r + 1024]
        gg = torch.where(tt != -100, g[r:r + 1024], 0.0)
        dz = -gg[:, None] * p
        dz.scatter_add_(1, tt.clamp(min=0)[:, None], gg[:, None])
        gx[r:r + 1024] = dz @ wd
    return float(loss), gx.reshape(h.shape)


def _distill_formula(torch, zs, zt, t):
    """0.5 (JSD_0.5 + cross entropy) of float logits (rows, V), Liger's default mix, over the
    counted rows."""
    x, y = zs.log_softmax(-1), zt.log_softmax(-1)
    log_m = torch.logaddexp(x, y) - torch.log(torch.tensor(2.0, device=zs.device))
    per = 0.5 * (y.exp() * (y - log_m) + x.exp() * (x - log_m)).sum(-1)
    counted = t != -100
    n = counted.sum().clamp(min=1)
    ce = -x.gather(-1, t.clamp(min=0)[:, None])[:, 0]
    return 0.5 * ((per * counted).sum() + (ce * counted).sum()) / n


def _reference_distill(torch, h, w, t, th, tw):
    """(float64 loss, float64 student hidden gradient) of _distill_formula, in chunks: the
    formula's gradient in the student's logits by autograd, a chunk at a time."""
    wd, twd = w.double(), tw.double()
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), t.reshape(-1)
    flat_th = th.reshape(-1, th.shape[-1])
    total = 0.0
    gx = torch.empty(flat_h.shape, dtype=torch.float64, device=h.device)
    for r in range(0, flat_t.numel(), 1024):
        zs = (flat_h[r:r + 1024].double() @ wd.T).requires_grad_()
        zt = flat_th[r:r + 1024].double() @ twd.T
        # the formula's own count is the chunk's: scale to the whole batch's
        tt = flat_t[r:r + 1024]
        part = _distill_formula(torch, zs, zt, tt) * tt.ne(-100).sum().clamp(min=1)
        (g,) = torch.autograd.grad(part, zs)
        total += float(part)
        gx[r:r + 1024] = g @ wd
    n = max(int(flat_t.ne(-100).sum()), 1)
    return total / n, (gx / n).reshape(h.shape)


def _candidates(torch, family, budgets):
    import cupyloss.torch as CF

    out = {}
    for mib in budgets:
        if family == "grpo":
            out[f"cupyloss {mib} MiB"] = (lambda b: lambda h, w, t, adv, old, ref: (
                CF.linear_grpo_loss(h, w, t, adv, old_log_probs=old, ref_log_probs=ref,
                                    beta=BETA_GRPO, loss_type="dapo",
                                    max_workspace_bytes=b)[0]))(mib << 20)
        elif family == "distill":
            out[f"cupyloss {mib} MiB"] = (lambda b: lambda h, w, t, th, tw: 0.5 * CF.linear_jsd(
                h, w, th, tw, t, beta=0.5, hard_weight=1.0, max_workspace_bytes=b))(mib << 20)
        else:
            out[f"cupyloss {mib} MiB"] = _cupyloss_preference(CF, family, mib << 20)

    if family == "distill":
        def naive(h, w, t, th, tw):
            with torch.no_grad():
                zt = (th @ tw.T).float().reshape(-1, tw.shape[0])
            zs = (h @ w.T).float().reshape(-1, w.shape[0])
            return _distill_formula(torch, zs, zt, t.reshape(-1))
    elif family == "grpo":
        def naive(h, w, t, adv, old, ref):
            return _grpo_formula(torch, _logits_lp(torch, h, w, t), t, adv, old, ref)
    else:
        def naive(h, w, t, *rh):
            ref_lp = None
            if rh:
                with torch.no_grad():
                    ref_lp = _logits_lp(torch, rh[0], w, t)
            return _preference_formula(torch, family, _logits_lp(torch, h, w, t), ref_lp, t)
    out["torch eager"] = naive
    out["torch.compile"] = torch.compile(naive)
    try:
        from liger_kernel import chunked_loss as liger
    except Exception:     # not installed here
        return out
    out["Liger-Kernel"] = _liger(torch, liger, family)
    return out


def _cupyloss_preference(CF, family, budget):
    kind = "dpo" if family == "dpo-long" else family
    fn = getattr(CF, f"linear_{kind}_loss")
    opts = dict(PREFERENCE[family], beta=BETA_DPO, max_workspace_bytes=budget)

    def run(h, w, t, *rh):
        ref = dict(ref_hidden=rh[0], ref_weight=w.detach()) if rh else {}
        if kind == "kto":
            good = t.new_zeros(t.shape[0], dtype=bool)
            good[:t.shape[0] // 2] = True
            return fn(h, w, t, good, **ref, **opts)[0]
        return fn(h, w, t, **ref, **opts)[0]

    return run


def _liger(torch, liger, family):
    """Liger-Kernel's chunked loss of `family` at its defaults, as a step function."""
    LigerFusedLinearDPOLoss = liger.LigerFusedLinearDPOLoss
    LigerFusedLinearGRPOLoss = liger.LigerFusedLinearGRPOLoss
    LigerFusedLinearJSDLoss = liger.LigerFusedLinearJSDLoss
    if family in ("orpo", "cpo", "simpo"):
        cls = {"orpo": liger.LigerFusedLinearORPOLoss, "cpo": liger.LigerFusedLinearCPOLoss,
               "simpo": liger.LigerFusedLinearSimPOLoss}[family]
        loss_fn = cls(beta=BETA_DPO)

        def run_pref(h, w, t):
            out = loss_fn(w, h, t)
            return out[0] if isinstance(out, tuple) else out
        return run_pref
    if family == "kto":
        kto = liger.LigerFusedLinearKTOLoss(beta=BETA_DPO, use_ref_model=True)

        def run_kto(h, w, t, rh):
            good = t.new_zeros(t.shape[0], dtype=bool)
            good[:t.shape[0] // 2] = True
            out = kto(h, w, t, None, good, rh, w.detach(), None)
            return out[0] if isinstance(out, tuple) else out
        return run_kto
    if family == "distill":
        liger_jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5,
                                            beta=0.5)

        def run_liger(h, w, t, th, tw):
            return liger_jsd(h.reshape(-1, h.shape[-1]), w, th.reshape(-1, th.shape[-1]), tw,
                             t.reshape(-1))
    elif family == "grpo":
        grpo = LigerFusedLinearGRPOLoss(beta=BETA_GRPO, epsilon_low=0.2, epsilon_high=0.2,
                                        loss_type="dapo")

        def run_liger(h, w, t, adv, old, ref):
            return grpo(h, w, t.clamp(min=0), (t != -100).long(), adv,
                         ref_per_token_logps=ref, old_per_token_logps=old)[0]
    else:
        liger_dpo = LigerFusedLinearDPOLoss(beta=BETA_DPO, use_ref_model=True)

        def run_liger(h, w, t, rh):
            out = liger_dpo(w, h, t, None, rh, w.detach(), None)
            return out[0] if isinstance(out, tuple) else out
    return run_liger


def _inputs(torch, family):
    import cupyloss.torch as CF

    batch, length = FAMILIES[family]
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(batch, length, H, device="cuda", generator=gen) * 0.5).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
    t = torch.randint(0, V, (batch, length), device="cuda", generator=gen)
    if family == "grpo":
        adv = torch.randn(batch, device="cuda", generator=gen)
        with torch.no_grad():
            lp = CF.linear_log_probs(h, w, t)
        old = lp + 0.1 * torch.randn(lp.shape, device="cuda", generator=gen)
        ref = lp + 0.1 * torch.randn(lp.shape, device="cuda", generator=gen)
        return h, w, t, (adv, old, ref)
    t[:, :length // 4] = -100                       # prompts
    if family in ("orpo", "cpo", "simpo"):
        return h, w, t, ()
    if family == "distill":
        th = (torch.randn(batch, length, H, device="cuda", generator=gen) * 0.5).bfloat16()
        tw = (torch.randn(V, H, device="cuda", generator=gen) * 0.02).bfloat16()
        return h, w, t, (th, tw)
    rh = (h.float() + 0.05 * torch.randn(h.shape, device="cuda", generator=gen)).bfloat16()
    return h, w, t, (rh,)


def _measure(torch, fn, h, w, t, extra, reps):
    """(median ms, peak GiB, (loss, float64 hidden gradient)) of the training step fn."""
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    got = {}

    def step():
        hl.grad = wl.grad = None
        loss = fn(hl, wl, t, *extra)
        loss.backward()
        got["loss"] = float(loss.detach())

    def forget():
        hl.grad = wl.grad = None

    try:
        step()
        gx = hl.grad.double()
        step()
        ms, peak, _ = _timing.torch_steps(torch, step, reps, forget)
    finally:
        forget()
    return ms, peak, (got["loss"], gx)


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.posttrain", __doc__, 5)
    ap.add_argument("--families", default="grpo,distill,dpo,dpo-long")
    ap.add_argument("--budgets", default="256,4608",
                    help="cupyloss workspace budgets in MiB, comma-separated")
    ap.add_argument("--only", default="",
                    help="run only the implementations whose names hold one of these "
                         "comma-separated words (e.g. cupyloss,Liger)")
    args = ap.parse_args(argv)
    only = [w for w in args.only.split(",") if w]
    torch, device = _timing.torch_gpu(ap.prog)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    rows_out = []
    for family in args.families.split(","):
        h, w, t, extra = _inputs(torch, family)
        want_loss, want_gx = _reference(torch, family, h, w, t, extra)
        grads = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**30
        torch.cuda.empty_cache()
        print(f"{device}: {family}, hidden {tuple(h.shape)}, weight ({V}, {H}) bf16, "
              f"gradients {grads:.3f} GiB")
        print(f"{'implementation':22} {'ms':>8} {'peak GiB':>9} {'beyond':>7} {'loss err':>9} "
              f"{'dX err':>9}")
        for name, fn in _candidates(torch, family, budgets).items():
            if only and not any(word in name for word in only):
                continue
            _timing.head_row(
                torch, rows_out, name, grads,
                lambda: _measure(torch, fn, h, w, t, extra, args.reps),
                lambda got: {"loss_err": abs(got[0] - want_loss) / max(abs(want_loss), 1e-30),
                             "dx_err": float((got[1] - want_gx).abs().max()
                                             / want_gx.abs().max())},
                device=device, family=family, shape=list(h.shape))
        h = w = want_gx = None      # freed before the next family
        _timing.next_size(torch)
    return _timing.save(args.json, rows_out)


if __name__ == "__main__":
    main()
