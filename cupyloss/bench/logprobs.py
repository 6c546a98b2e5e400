"""Benchmark per-token log-probabilities and entropy of the LLM head (post-training's primitive).

    python -m cupyloss.bench.logprobs [--rows 8192] [--budgets 256,4608] [--temperature 0.9]
                                      [--reps 10] [--json out.json]

Hidden (BT, 4096) bfloat16, weight (128256, 4096) bfloat16, int64 tokens, advantages A (BT,)
float32; the objective of a policy-gradient step with an entropy bonus,
``-(A * logp).mean() - 0.01 * entropy.mean()``, forward + backward with the gradients of hidden
and weight, logp and entropy of softmax(logits / T):

  torch eager      logits = (h @ W.T).float() / T; log_softmax, gather, entropy (verl's,
                   TRL's unfused formula)
  torch.compile    the same function compiled
  verl fused       verl.utils.kernel.linear_cross_entropy (when importable: its kernels alone)
  cupyloss         cupyloss.torch.linear_log_probs at each workspace budget (MiB): autograd
                   differentiates the objective, so backward forms the logits again
  cupyloss 1 pass  cupyloss.linear_log_probs_value_and_grad with the objective's upstream
                   gradients given (-A / BT, -0.01 / BT): one pass, three products, for an
                   objective whose upstream gradient is known before the head runs

Each row: median ms, the peak memory above the inputs (GiB, gradients included) and beyond the
gradients, and the largest error of logp and of the entropy against float64 logits of the same
bfloat16 operands.  Never used as a test.
"""

from __future__ import annotations

from cupyloss.bench import _timing
from cupyloss.bench.linear import H, V, _inputs


def _reference(torch, h, w, t, temperature):
    """float64 (logp, entropy) of softmax(h W^T / T), in row chunks."""
    wd = w.double()
    lps, ents = [], []
    for r in range(0, h.shape[0], 1024):
        z = (h[r:r + 1024].double() @ wd.T) / temperature
        lp = z.log_softmax(-1)
        lps.append(lp.gather(-1, t[r:r + 1024, None])[:, 0])
        ents.append(-(lp.exp() * lp).sum(-1))
        del z, lp
    return torch.cat(lps), torch.cat(ents)


def _candidates(torch, budgets, temperature):
    import cupyloss
    import cupyloss.torch as CF

    def unfused(h, w, t):
        logits = (h @ w.T).float() / temperature
        lp = logits.log_softmax(-1)
        ent = torch.logsumexp(logits, -1) - (lp.exp() * logits).sum(-1)
        return lp.gather(-1, t[:, None])[:, 0], ent

    # cupyloss first: what the others leave behind (compiled graphs, verl's side stream) must
    # not count in its peak
    out = {}
    for mib in budgets:
        out[f"cupyloss {mib} MiB"] = (lambda b: lambda h, w, t: CF.linear_log_probs(
            h, w, t, temperature=temperature, return_entropy=True,
            max_workspace_bytes=b))(mib << 20)
    def one_pass(b):
        def run(h, w, t, adv):
            n = t.numel()
            (lp, ent), (gx, gw) = cupyloss.linear_log_probs_value_and_grad(
                h.detach(), w.detach(), t, grad_output=(-adv / n).contiguous(),
                grad_entropy=-0.01 / n, temperature=temperature, return_entropy=True,
                max_workspace_bytes=b)
            h.grad, w.grad = gx, gw
            return lp, ent
        run.one_pass = True
        return run

    for mib in budgets:
        out[f"cupyloss 1 pass {mib} MiB"] = one_pass(mib << 20)
    out["torch eager"] = unfused
    out["torch.compile"] = torch.compile(unfused)
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl

        out["verl fused"] = lambda h, w, t: verl(h, w, t, temperature)
    except Exception:   # not installed, or its package needs what this machine lacks
        pass
    return out


def _measure(torch, fn, h, w, t, adv, reps):
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        hl.grad = wl.grad = None
        if getattr(fn, "one_pass", False):
            return fn(hl, wl, t, adv)
        logp, ent = fn(hl, wl, t)
        (-(adv * logp).mean() - 0.01 * ent.mean()).backward()
        return logp.detach(), ent.detach()

    got = step()
    step()

    def forget():
        hl.grad = wl.grad = None

    ms, peak, _ = _timing.torch_steps(torch, step, reps, forget)
    forget()
    return ms, peak, got


def main(argv=None) -> list[dict]:
    ap = _timing.arguments("python -m cupyloss.bench.logprobs", __doc__, 10)
    ap.add_argument("--rows", default="8192", help="BT values, comma-separated")
    ap.add_argument("--budgets", default="256,4608",
                    help="cupyloss workspace budgets in MiB, comma-separated")
    ap.add_argument("--temperature", type=float, default=0.9)
    args = ap.parse_args(argv)
    torch, device = _timing.torch_gpu(ap.prog)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    rows_out = []
    for bt in (int(r) for r in args.rows.split(",")):
        h, w, t = _inputs(torch, bt)
        t = t.clamp(min=0)
        gen = torch.Generator(device="cuda").manual_seed(1)
        adv = torch.randn(bt, device="cuda", generator=gen)
        ref_lp, ref_h = _reference(torch, h, w, t, args.temperature)
        grads = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**30
        torch.cuda.empty_cache()
        print(f"{device}: hidden ({bt}, {H}), weight ({V}, {H}) bf16, T = {args.temperature}, "
              f"gradients {grads:.3f} GiB")
        print(f"{'implementation':22} {'ms':>8} {'peak GiB':>9} {'beyond':>7} {'logp err':>9} "
              f"{'H err':>9}")
        for name, fn in _candidates(torch, budgets, args.temperature).items():
            _timing.head_row(
                torch, rows_out, name, grads,
                lambda: _measure(torch, fn, h, w, t, adv, args.reps),
                lambda got: {"logp_err": float((got[0].double() - ref_lp).abs().max()),
                             "entropy_err": float((got[1].double() - ref_h).abs().max())},
                device=device, rows=bt, temperature=args.temperature)
        h = w = t = None            # freed before the next size
        _timing.next_size(torch)
    return _timing.save(args.json, rows_out)


if __name__ == "__main__":
    main()
