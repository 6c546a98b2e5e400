"""Benchmark the fused heads from JAX against XLA's unfused formulas, under jit(value_and_grad).

    python -m cupyloss.bench.jax_head [--rows 8192] [--reps 10] [--json out.json]

Hidden (BT, 4096) bfloat16, weight (128256, 4096) bfloat16, int32 targets (10% ignored for the
cross entropy); the gradients of hidden and weight:

  XLA cross entropy   optax.softmax_cross_entropy_with_integer_labels on (h @ W.T) in float32,
                      the counted rows' mean
  cupyloss            cupyloss.jax.linear_cross_entropy
  XLA log-probs       log_softmax((h @ W.T) / T) gathered, and its entropy, in float32; the
                      objective -(A logp).mean() - 0.01 H.mean()
  cupyloss log-probs  cupyloss.jax.linear_log_probs with the same objective
  XLA GRPO            TRL's 'dapo' GRPO loss (beta 0.04, clip 0.2) in jnp on the float32
                      logits' log-probs, the rows as sequences of 1024
  cupyloss GRPO       cupyloss.jax.linear_grpo_loss, the same options
  XLA DPO             TRL's sigmoid DPO (beta 0.1, reference log-probs given per token) in jnp
  cupyloss DPO        cupyloss.jax.linear_preference_loss("dpo", ...)
  XLA distill         the JSD (beta 0.5) of the student's and a teacher head's softmax plus the
                      student's cross entropy, in jnp on both heads' float32 logits
  cupyloss distill    cupyloss.jax.linear_jsd(..., hard_weight=1.0)
  XLA ORPO, CPO, SimPO, KTO
                      cupyloss.posttrain.preference_objective in jnp on the float32 logits'
                      log-probs (CPO and SimPO with alpha 1; KTO with reference log-probs given
                      per token, every other row desirable)
  cupyloss ORPO, ...  cupyloss.jax.linear_preference_loss(kind, ...), the same options

Each row: median ms of the jitted step (block_until_ready), and XLA's own account of the step's
temporary memory (compiled memory_analysis: temp bytes, which hold cupyloss's workspace too).
Never used as a test.
"""

from __future__ import annotations

import statistics
import time


def main(argv=None) -> list[dict]:
    from cupyloss.bench import _timing

    ap = _timing.arguments("python -m cupyloss.bench.jax_head", __doc__, 10)
    ap.add_argument("--rows", default="8192", help="BT values, comma-separated")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--only", default="", help="run only the rows whose names contain one of "
                    "these comma-separated words")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import cupyloss.jax as JL

    device = jax.devices()[0].device_kind
    H, V = 4096, 128256
    temp = args.temperature
    rows_out = []
    for bt in (int(r) for r in args.rows.split(",")):
        k = jax.random.split(jax.random.PRNGKey(0), 4)
        h = (jax.random.normal(k[0], (bt, H)) * 0.5).astype(jnp.bfloat16)
        w = (jax.random.normal(k[1], (V, H)) * 0.02).astype(jnp.bfloat16)
        t = jax.random.randint(k[2], (bt,), 0, V)
        t = jnp.where(jax.random.uniform(k[3], (bt,)) < 0.1, -100, t)
        tp = jnp.maximum(t, 0)
        adv = jax.random.normal(k[3], (bt,))

        def xla_ce(h, w):
            import optax

            z = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
            keep = t != -100
            per = optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(keep, t, 0))
            return jnp.sum(jnp.where(keep, per, 0.0)) / jnp.sum(keep)

        def ours_ce(h, w):
            return JL.linear_cross_entropy(h, w, t)

        def xla_lp(h, w):
            z = jnp.dot(h, w.T, preferred_element_type=jnp.float32) / temp
            lp_all = jax.nn.log_softmax(z, -1)
            lp = jnp.take_along_axis(lp_all, tp[:, None], -1)[:, 0]
            ent = -jnp.sum(jnp.exp(lp_all) * lp_all, -1)
            return -(adv * lp).mean() - 0.01 * ent.mean()

        def ours_lp(h, w):
            lp, ent = JL.linear_log_probs(h, w, tp, temperature=temp, return_entropy=True)
            return -(adv * lp).mean() - 0.01 * ent.mean()

        seqs = (bt // 1024, 1024)
        ts = tp.reshape(seqs)
        adv_s = adv[:seqs[0]]
        old = -11.0 + 0.1 * jax.random.normal(k[2], seqs)
        ref = -11.0 + 0.1 * jax.random.normal(k[1], seqs)

        def logp_xla(h, w, tt):
            z = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), tt.reshape(-1)[:, None], -1)
            return lp[:, 0].reshape(tt.shape)

        def xla_grpo(h, w):
            lp = logp_xla(h, w, ts)
            coef = jnp.exp(lp - old)
            per = -jnp.minimum(coef * adv_s[:, None], jnp.clip(coef, 0.8, 1.2) * adv_s[:, None])
            per = per + 0.04 * (jnp.exp(ref - lp) - (ref - lp) - 1.0)
            return per.mean()

        def ours_grpo(h, w):
            return JL.linear_grpo_loss(h.reshape(*seqs, H), w, ts, adv_s, old_log_probs=old,
                                       ref_log_probs=ref, beta=0.04)[0]

        def xla_dpo(h, w):
            s = logp_xla(h, w, ts).sum(-1)
            s0 = ref.sum(-1)
            half = seqs[0] // 2
            z = (s[:half] - s[half:]) - (s0[:half] - s0[half:])
            return -jax.nn.log_sigmoid(0.1 * z).mean()

        def ours_dpo(h, w):
            return JL.linear_preference_loss("dpo", h.reshape(*seqs, H), w, ts,
                                             ref_log_probs=ref)[0]

        ht = (jax.random.normal(k[2], (bt, H)) * 0.5).astype(jnp.bfloat16)
        wt = (jax.random.normal(k[3], (V, H)) * 0.02).astype(jnp.bfloat16)

        def xla_distill(h, w):
            x = jax.nn.log_softmax(jnp.dot(h, w.T, preferred_element_type=jnp.float32), -1)
            y = jax.nn.log_softmax(jax.lax.stop_gradient(
                jnp.dot(ht, wt.T, preferred_element_type=jnp.float32)), -1)
            log_m = jnp.logaddexp(x, y) - jnp.log(2.0)
            jsd = 0.5 * jnp.sum(jnp.exp(y) * (y - log_m) + jnp.exp(x) * (x - log_m), -1)
            ce = -jnp.take_along_axis(x, tp[:, None], -1)[:, 0]
            return (jsd + ce).mean()

        def ours_distill(h, w):
            return JL.linear_jsd(h, w, ht, wt, tp, beta=0.5, hard_weight=1.0)

        from cupyloss import posttrain

        ops = posttrain.Ops(jnp, stop=jax.lax.stop_gradient)
        mask = jnp.ones(seqs, jnp.float32)
        good = jnp.arange(seqs[0]) % 2 == 0
        options = {"orpo": {}, "cpo": {"alpha": 1.0}, "simpo": {"alpha": 1.0, "gamma": 0.5},
                   "kto": {"desirable": good}}

        def preference_rows(kind):
            o = options[kind]
            ref_seq = ref.sum(-1) if kind == "kto" else None

            def xla(h, w):
                return posttrain.preference_objective(ops, kind, logp_xla(h, w, ts), mask,
                                                      ref_seq, **o)[0]

            def ours(h, w):
                extra = {"ref_log_probs": ref} if kind == "kto" else {}
                return JL.linear_preference_loss(kind, h.reshape(*seqs, H), w, ts, **extra,
                                                 **o)[0]

            label = kind.upper() if kind != "simpo" else "SimPO"
            return [(f"XLA {label}", xla), (f"cupyloss {label}", ours)]

        pref = [row for kind in options for row in preference_rows(kind)]
        print(f"{device}: hidden ({bt}, {H}), weight ({V}, {H}) bf16, jit(value_and_grad)")
        print(f"{'implementation':22} {'ms':>8} {'temp GiB':>9} {'value':>12}")
        for name, fn in (("XLA cross entropy", xla_ce), ("cupyloss", ours_ce),
                         ("XLA log-probs", xla_lp), ("cupyloss log-probs", ours_lp),
                         ("XLA GRPO", xla_grpo), ("cupyloss GRPO", ours_grpo),
                         ("XLA DPO", xla_dpo), ("cupyloss DPO", ours_dpo),
                         ("XLA distill", xla_distill), ("cupyloss distill", ours_distill),
                         *pref):
            if args.only and not any(o in name for o in args.only.split(",")):
                continue
            step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
            try:
                compiled = step.lower(h, w).compile()
                mem = compiled.memory_analysis()
                temp_gib = getattr(mem, "temp_size_in_bytes", float("nan")) / 2**30
                out = step(h, w)
                jax.block_until_ready(out)
                times = []
                for _ in range(args.reps):
                    begin = time.perf_counter()
                    jax.block_until_ready(step(h, w))
                    times.append((time.perf_counter() - begin) * 1e3)
            except Exception as exc:   # out of memory or failing: say so, go on
                print(f"{name:22} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            ms = statistics.median(times)
            value = float(out[0])
            rows_out.append(dict(device=device, rows=bt, name=name, ms=ms, temp_gib=temp_gib,
                                 value=value))
            print(f"{name:22} {ms:8.2f} {temp_gib:9.3f} {value:12.6f}", flush=True)
            del out
    return _timing.save(args.json, rows_out)


if __name__ == "__main__":
    main()
