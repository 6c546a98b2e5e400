"""float32 and bfloat16 subnormals are kept, as torch keeps them: the kernels are compiled without
flush-to-zero (cupyloss._core.source.compile_module), so a tiny input is not read as 0 and a tiny loss
does not come out as 0."""

import numpy as np
import pytest

from gpu_util import BFLOAT16, RTOL, TINY, assert_close, to_device, to_host

pytestmark = pytest.mark.gpu

SUBNORMAL = [3e-39, -5e-40, 2.0**-149, -(2.0**-140), 1e-30]


def test_subnormal_inputs_are_read():
    """|x - 0| of float32 subnormals is exact: each comes back unchanged, and its gradient's
    sign is right (flushed, both would be 0)."""
    import cupy

    import cupyloss

    x = cupy.asarray(np.asarray(SUBNORMAL, np.float32))
    y = cupy.zeros_like(x)
    value, (gx, gy) = cupyloss.l1_loss_value_and_grad(x, y, reduction="none")
    assert np.array_equal(value.get(), np.abs(x.get()))
    assert np.array_equal(gx.get(), np.sign(x.get()).astype(np.float32))
    total = cupyloss.l1_loss(x, y, reduction="sum")
    assert float(total) == float(np.abs(x.get().astype(np.float64)).sum().astype(np.float32))


def test_subnormal_results_are_kept():
    """mse of x = 2^-70 is 2^-140, a float32 subnormal, exactly."""
    import cupy

    import cupyloss

    x = cupy.full(4, 2.0**-70, cupy.float32)
    y = cupy.zeros_like(x)
    assert float(cupyloss.mse_loss(x, y)) == 2.0**-140
    assert np.all(cupyloss.mse_loss(x, y, reduction="none").get() == np.float32(2.0**-140))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32)] + ([BFLOAT16] if BFLOAT16 else []),
                         ids=str)
def test_tiny_logistic_losses_match_float64(dtype):
    """binary_cross_entropy_with_logits at logits 86..95 (target 1, pos_weight 4): the loss is
    4 exp(-x), from 2e-37 down into the subnormals; each within the dtype's rounding of the
    float64 value, and of torch's where torch is present (flushed, all but the first are 0)."""
    import cupyloss

    z, zr = to_device(np.array([86.0, 87.5, 88.5, 90.0, 95.0]), dtype)
    t, _ = to_device(np.ones(5), dtype)
    pw, _ = to_device(np.full(5, 4.0), dtype)
    got = to_host(cupyloss.binary_cross_entropy_with_logits(z, t, pos_weight=pw,
                                                            reduction="none"))
    want = 4.0 * np.log1p(np.exp(-zr))
    spacing = TINY[dtype]
    assert np.all(np.abs(got - want) <= RTOL[dtype] * want + spacing), (got, want)
    torch = pytest.importorskip("torch")
    tz, tt, tp = (torch.from_dlpack(a) for a in (z, t, pw))
    ref = torch.nn.functional.binary_cross_entropy_with_logits(tz, tt, pos_weight=tp,
                                                               reduction="none")
    ref = ref.double().cpu().numpy()
    assert np.all(ref[:4] > 0)
    assert np.all(np.abs(got - ref) <= RTOL[dtype] * ref + spacing), (got, ref)


def test_kl_t_log_t_across_the_float32_range():
    """kl_div's t log t (its log is lg_fine, a polynomial on the reduced mantissa, subnormal t
    scaled into the normal range first) against float64 for t from the smallest subnormal to
    10, with a close look at t near 1, where a log's absolute error must shrink with log t, and
    at subnormal t, which an approximate log flushes to 0; and the target gradient log t + 1."""
    import cupy

    import cupyloss

    v = np.concatenate([np.logspace(-45, 1, 200_001), np.linspace(0.2, 5, 100_001),
                        1 + np.linspace(-1e-3, 1e-3, 100_001), [2.0**-149, 2.0**-126]])
    t = cupy.asarray(v.astype(np.float32))
    t = t[t > 0]
    t64 = to_host(t).astype(np.float64)
    x = cupy.zeros_like(t)
    loss = cupyloss.kl_div(x, t, reduction="none")
    # scale 0: each element within RTOL of itself (about 80 float32 ulps), plus TINY.
    assert_close(to_host(loss), t64 * np.log(t64), np.dtype(np.float32), 0.0, "t log t")
    gt = cupyloss.kl_div_backward(1.0, x, t, reduction="none", wrt="target")
    # log t + 1 cancels near t = 1/e: it rounds relative to its terms, |log t| + 1.
    assert_close(to_host(gt), np.log(t64) + 1, np.dtype(np.float32), np.abs(np.log(t64)) + 1,
                 "log t + 1")


def test_logistic_log1p_within_ulps_and_unbiased():
    """The logistic losses' log1p(e), e = exp(-|x|) in [0, 1] (a polynomial, lg1p_unit), seen
    through soft_margin_loss(x, 1) = log1p(exp(-x)) for x >= 0, from x = 0 (log 2) to x = 87
    (e near the smallest normal, returned as e itself), over a million logits: against float64
    log1p of the e the device's expf gives, within 2 float32 ulps and with a mean signed error
    under 0.05 ulp (a lean would add up in a reduction); against float64 log1p(exp(-x)), within
    4 ulps (expf's error comes on top)."""
    import cupy

    import cupyloss

    rng = np.random.default_rng(7)
    v = np.concatenate([np.abs(rng.normal(0.0, 3.0, 1_000_000)), np.linspace(0.0, 87.0, 10_001)])
    x = cupy.asarray(v.astype(np.float32))
    x64 = to_host(x)
    got = to_host(cupyloss.soft_margin_loss(x, cupy.ones_like(x), reduction="none"))

    def ulps(want):
        return (got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)

    poly = ulps(np.log1p(to_host(cupy.exp(-x))))
    worst = np.argmax(np.abs(poly))
    assert np.abs(poly[worst]) <= 2.0, (poly[worst], x64[worst])
    assert abs(np.mean(poly)) < 0.05, np.mean(poly)
    whole = ulps(np.log1p(np.exp(-x64)))
    worst = np.argmax(np.abs(whole))
    assert np.abs(whole[worst]) <= 4.0, (whole[worst], x64[worst], np.mean(whole))
