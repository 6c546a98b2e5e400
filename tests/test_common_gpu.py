"""Device helpers of kernels/common.cuh and kernels/losses.cuh, driven by small test kernels."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

_KERNEL = r"""
extern "C" __global__ void add_all(const float* v, long long n, float* out) {
    cupyloss::Compensated<float> c;
    float plain = 0.0f;
    for (long long i = 0; i < n; ++i) { c.add(v[i]); plain += v[i]; }
    out[0] = c.value();
    out[1] = plain;
}
"""


def _add_all(values):
    import cupy

    from cupyloss._core import source as _source

    kernel = cupy.RawKernel(_source.expand("common.cuh") + _KERNEL, "add_all",
                            options=_source.OPTIONS)
    v = cupy.asarray(np.asarray(values, np.float32))
    out = cupy.zeros(2, cupy.float32)
    kernel((1,), (1,), (v, np.int64(v.size), out))
    return out.get()


def test_compensated_sum_keeps_what_a_plain_sum_drops():
    """1 + 2^20 x 2^-24: each addend is below half an ulp of 1, so a plain fp32 sum stays at 1;
    the compensated one gives the exact 1.0625."""
    compensated, plain = _add_all([1.0] + [2.0**-24] * 2**20)
    assert plain == 1.0
    assert compensated == 1.0 + 2.0**-4


@pytest.mark.parametrize("values, want", [
    ([1.0, np.inf, 1.0, 2.0], np.inf),          # inf stays inf, not inf - inf = NaN
    ([1.0, -np.inf, 3.0], -np.inf),
    ([np.inf, -np.inf, 1.0], np.nan),            # as a plain sum
    ([1.0, np.nan, 2.0], np.nan),
    ([3.0e38, 3.0e38, -1.0], np.inf),            # overflow is inf, as a plain sum
])
def test_compensated_sum_of_non_finite_values_is_the_plain_sums(values, want):
    compensated, plain = _add_all(values)
    np.testing.assert_equal(compensated, np.float32(want))
    np.testing.assert_equal(plain, np.float32(want))


_MATH = r"""
extern "C" __global__ void rcp_pairs(const float* v, long long n, float* ours, float* ref) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    ours[i] = cupyloss::rcp_unit_rn(v[i]);
    ref[i] = __frcp_rn(v[i]);
}
extern "C" __global__ void tanh_each_pairs(const float* v, long long n, float* ours,
                                           float* ref) {
    // eight values a thread (n a multiple of 8): tanh_ap_each on them, tanh_ap on each
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    float d[8];
    for (int k = 0; k < 8; ++k) d[k] = v[i + k];
    cupyloss::tanh_ap_each(d);
    for (int k = 0; k < 8; ++k) {
        ours[i + k] = d[k];
        ref[i + k] = cupyloss::tanh_ap(v[i + k]);
    }
}
extern "C" __global__ void lg_normal_misses(long long n, unsigned long long* misses,
                                            unsigned int* first) {
    // every positive normal float 2^-126 .. below inf: bit patterns 0x00800000 + i
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const unsigned int bits = 0x00800000u + (unsigned int)i;
        const float v = __uint_as_float(bits);
        if (__float_as_uint(cupyloss::lg_normal(v)) != __float_as_uint(logf(v))) {
            atomicAdd(misses, 1ull);
            atomicMin(first, bits);
        }
    }
}
extern "C" __global__ void tanh_pairs(const float* v, long long n, float* ours, float* ref) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    ours[i] = cupyloss::tanh_bf(v[i]);
    ref[i] = tanhf(v[i]);
}
extern "C" __global__ void tanh_ap_pairs(const float* v, long long n, float* ours, float* ref) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    ours[i] = cupyloss::tanh_ap(v[i]);
    ref[i] = tanhf(v[i]);
}
"""


def _math(name, x):
    """Outputs of test kernel `name` over float32 x (one thread per element)."""
    import cupy

    from cupyloss._core import source as _source

    module = cupy.RawModule(code=_source.expand("common.cuh") + _source.expand("losses.cuh")
                            + _MATH, options=_source.OPTIONS)
    xd = cupy.asarray(np.asarray(x, np.float32))
    outs = [cupy.empty_like(xd) for _ in range(2)]
    module.get_function(name)(((xd.size + 255) // 256,), (256,), (xd, np.int64(xd.size), *outs))
    return [o.get() for o in outs]


def test_rcp_unit_rn_is_frcp_rn_on_every_float_in_1_2():
    """The branch-free reciprocal gives __frcp_rn's bits (correctly rounded) for all 2^23 + 1
    floats in [1, 2], and NaN for NaN."""
    v = (np.arange(2**23 + 1, dtype=np.int64) + 0x3F800000).astype(np.int32).view(np.float32)
    ours, ref = _math("rcp_pairs", np.append(v, np.nan))
    assert np.array_equal(ours[:-1].view(np.int32), ref[:-1].view(np.int32))
    assert np.isnan(ours[-1])



def test_lg_normal_is_logf_on_every_positive_normal_float():
    """kl_div's ratio form takes logs of normal numbers with lg_normal, logf's steps without its
    tests for other arguments: the same bits as logf on all 2^31 - 2^24 - 2^23 positive normal
    floats."""
    import cupy

    from cupyloss._core import source as _source

    module = cupy.RawModule(code=_source.expand("common.cuh") + _source.expand("losses.cuh")
                            + _MATH, options=_source.OPTIONS)
    misses = cupy.zeros(1, cupy.uint64)
    first = cupy.full(1, 0xFFFFFFFF, cupy.uint32)
    n = 0x7F800000 - 0x00800000
    module.get_function("lg_normal_misses")((4096,), (256,), (np.int64(n), misses, first))
    assert int(misses.get()[0]) == 0, (int(misses.get()[0]), hex(int(first.get()[0])))


def _ulps(got, want):
    """(got - want) in units of the float32 spacing at want (float64 want)."""
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return (got.astype(np.float64) - want) / spacing


def _tanh_arguments(seed):
    """float32 d on both sides of the tanh helpers' switch at 0.6, near 0 and far out."""
    rng = np.random.default_rng(seed)
    return np.concatenate([
        rng.uniform(-3, 3, 2_000_000), rng.uniform(0.45, 0.75, 1_000_000),
        rng.uniform(-12, 12, 500_000),
        np.exp(rng.uniform(np.log(1e-37), np.log(20), 1_000_000)) * rng.choice([-1, 1], 1_000_000),
    ]).astype(np.float32)


def test_branch_free_tanh_is_within_two_ulps_and_unbiased():
    """The branch-free tanh of log_cosh_loss and the softcap (tanh_bf) against float64 on both
    sides of its switch at 0.6, near 0 and far out: within 2 ulp (tanhf: 1.8 in the same sets) and
    unbiased (mean signed error under 0.02 ulp for |d| in (0.45, 0.55), where tanhf's is
    +0.6).  (The test kernel is built by RawModule, which flushes subnormals; the edge values
    of the next test go through the loss's own kernels, which keep them.)"""
    d = _tanh_arguments(11)
    ours, theirs = _math("tanh_pairs", d)
    want = np.tanh(d.astype(np.float64))
    err, err_tanhf = _ulps(ours, want), _ulps(theirs, want)
    assert np.abs(err).max() <= 2.0, (np.abs(err).max(), d[np.argmax(np.abs(err))])
    near = (np.abs(d) > 0.45) & (np.abs(d) < 0.55)
    assert abs(err[near].mean()) < 0.02, (err[near].mean(), err_tanhf[near].mean())


def test_softcap_tanh_is_within_two_ulps_as_tanhf():
    """The softcap's tanh (tanh_ap: the ex2 unit's exponential and the approximate reciprocal)
    against float64: within 2 ulp everywhere, and leaning less than tanhf near its switch
    (mean signed error under 0.1 ulp for |d| in (0.45, 0.75), where tanhf's is about +0.18);
    tanh(+-0) = +-0, tanh(+-inf) = +-1, NaN stays NaN, a tiny d is d."""
    d = _tanh_arguments(12)
    ours, _ = _math("tanh_ap_pairs", d)
    err = _ulps(ours, np.tanh(d.astype(np.float64)))
    assert np.abs(err).max() <= 2.0, (np.abs(err).max(), d[np.argmax(np.abs(err))])
    near = (np.abs(d) > 0.45) & (np.abs(d) < 0.75)
    assert abs(err[near].mean()) < 0.1, err[near].mean()
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -3e-20], np.float32)
    got, _ = _math("tanh_ap_pairs", edges)
    assert np.array_equal(got[:4], [0.0, -0.0, 1.0, -1.0]) and np.signbit(got[1])
    assert np.isnan(got[4]) and np.array_equal(got[5:], edges[5:])


def test_softcap_tanh_of_a_vector_is_tanh_ap_bit_for_bit():
    """tanh_ap_each (the softcap's vectors: the polynomial on signed d, the exponential's form
    only where |d| >= 0.6, its sign then copied) gives tanh_ap's bits element by element, in
    vectors all near 0, all far, mixed, and with the edge values (+-inf, NaN's sign aside), but
    for a zero's sign: -0 gives +0 (0 either way)."""
    import cupy

    from cupyloss._core import source as _source

    rng = np.random.default_rng(13)
    d = _tanh_arguments(13)
    d = d[: d.size // 8 * 8]
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -3e-20, 0.6, -0.6,
                      np.nextafter(np.float32(0.6), np.float32(0)), -np.float32(0.59999996),
                      2.0**-149, -2.0**-149, 0.3, -0.7, 5.0], np.float32)
    mixed = np.concatenate([d, rng.permutation(edges), edges])
    module = cupy.RawModule(code=_source.expand("common.cuh") + _source.expand("losses.cuh")
                            + _MATH, options=_source.OPTIONS)
    xd = cupy.asarray(mixed)
    ours, ref = cupy.empty_like(xd), cupy.empty_like(xd)
    module.get_function("tanh_each_pairs")(((xd.size // 8 + 255) // 256,), (256,),
                                           (xd, np.int64(xd.size), ours, ref))
    ours, ref = ours.get(), ref.get()
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan], ref[~nan])
    bits = ~nan & (ref != 0)
    assert np.array_equal(ours[bits].view(np.int32), ref[bits].view(np.int32))


def test_log_cosh_gradient_at_edge_values():
    """d/dx log cosh(x - 0) = tanh x through the loss's kernels: tanh(+-0) = +-0,
    tanh(+-inf) = +-1, NaN stays NaN, a tiny or subnormal x is x itself, and both sides of the
    switch at 0.6 are within 2 ulp."""
    import cupy

    import cupyloss

    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-41, 2.0**-149, 0.6,
                  np.nextafter(np.float32(0.6), np.float32(0)), -7.5], np.float32)
    xd = cupy.asarray(x)
    got = cupyloss.log_cosh_loss_backward(cupy.ones_like(xd), xd, cupy.zeros_like(xd),
                                          reduction="none", wrt="input").get()
    assert np.array_equal(got[:4], [0.0, -0.0, 1.0, -1.0])
    assert np.signbit(got[1]) and not np.signbit(got[0])
    assert np.isnan(got[4])
    assert np.array_equal(got[5:8], x[5:8])
    assert np.all(np.abs(_ulps(got[8:], np.tanh(x[8:].astype(np.float64)))) <= 2.0)
