// Pointwise loss functors: the loss of one element and its partial derivatives.
//
// A functor names its array operands' count K (torch's order: input, target, then e.g. weight),
// its parameter struct Params (every field 64-bit: double or long long, mirrored on the host
// next to its registration in cupyloss/_registry.py), and two stateless members working in the
// accumulator type A (float or double):
//   value(v, p)      the loss of one element whose operands are v[0..K)
//   grad(v, p, d)    d[k] = dl/dv[k] for every operand (the kernel keeps the ones asked for)
// or, where some of that work depends on operands that may stay the same across a kernel's loop
// (a log of a broadcast input), the same two as templates on the mask CONST of those operands,
// taking their terms formed once before the loop (pointwise.cu's FixedTerms says how).
// Adding a pointwise loss means one functor here, one registration in cupyloss/_registry.py and
// one reference in tests/reference.py.
#pragma once

namespace cupyloss {

// The parameter struct of a functor without options (a kernel parameter is never empty).
struct NoParams {
    long long unused;
};


// Division by a divisor known to be a normal number of magnitude below 2^126 (or NaN):
// __fdividef's 2 ulp in fp32, for any dividend, instead of the IEEE division's longer sequence
// and its out-of-line slow path, which bound kl_div's forward and binary_cross_entropy's
// gradient by instructions rather than memory.  Written as __fdividef's own reciprocal and
// product, without the scaling it puts in front for divisors below 2^-126 (five instructions
// a division that no divisor here needs): the same bits for every divisor in that range.
__device__ __forceinline__ float div_fast(float a, float b) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
    return __fmul_rn(a, r);
}
__device__ __forceinline__ double div_fast(double a, double b) { return a / b; }
__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
// logf of a positive normal finite v, bitwise: logf's own steps for such v (v = 2^n m with m in
// [2/3, 4/3), log m = f + f^2 P(f) at f = m - 1, then n ln 2 added) without its tests for
// subnormal, zero, infinite and NaN arguments, eight instructions of its thirty.  For arguments
// known to be normal (kl_div's ratio form); tests/test_common_gpu.py compares it with logf on
// every positive normal float.
__device__ __forceinline__ float lg_normal(float v) {
    const int i = __float_as_int(v);
    const int e = (i - 0x3f2aaaab) & (int)0xff800000;
    const float f = __fadd_rn(__int_as_float(i - e), -1.0f);
    const float n = __fmul_rn(__int2float_rn(e), 1.1920928955078125e-07f);  // exact: e / 2^23
    float p = __fmaf_rn(f, -__int_as_float(0x3e055027), __int_as_float(0x3e1039f6));
    p = __fmaf_rn(f, p, __int_as_float(0xbdf8cdcc));
    p = __fmaf_rn(f, p, __int_as_float(0x3e0f2955));
    p = __fmaf_rn(f, p, __int_as_float(0xbe2ad8b9));
    p = __fmaf_rn(f, p, __int_as_float(0x3e4ced0b));
    p = __fmaf_rn(f, p, __int_as_float(0xbe7fff22));
    p = __fmaf_rn(f, p, __int_as_float(0x3eaaaa78));
    p = __fmaf_rn(f, p, -0.5f);
    p = __fmul_rn(f, p);
    return __fmaf_rn(n, __int_as_float(0x3f317218), __fmaf_rn(f, p, f));
}
__device__ __forceinline__ double lg_normal(double v) { return log(v); }
// log v within about an ulp and without logf's lean, for v whose t log t terms are summed by the
// million.  logf is within 1 ulp, but libdevice's ln 2 (0x3f317218, ln 2 + 1.9e-9, times the
// exponent it splits off) makes it lean the same way for neighbouring v: -0.029 ulp on average
// for t near 6e-5, which a sum of millions of t log t terms turns into its main error (kl_div at
// 16384^2: 5.2e-8 relative, as torch's; a CPU emulation of logf gives 5.3e-8, and 6e-11 with a
// correctly rounded log).  Here v = 2^k m with m in [2/3, 4/3) (subnormal v scaled by 2^23
// first), and log v = k ln2_hi + (k ln2_lo + f P(f)), f = m - 1 (exact), P of degree 10 fitted
// to log1p(f) / f for relative error; ln2_hi has 16 significant bits, so k ln2_hi is exact and
// only the last sum rounds.  Branch-free, about 28 instructions (logf: about 28 and a branch;
// the former __logf + Newton step / logf split diverged within a warp wherever t straddled
// (1/4, 4)).  Against float64 over 8M positive floats (uniform in (0, 1), log-uniform over the
// whole range, near 1, near 6e-5): at most 1.5 ulp, mean signed error under 0.004 ulp in each
// of those sets.  v = 0 gives -inf, v < 0 and NaN give NaN, +inf gives +inf, as logf.
__device__ __forceinline__ float lg_fine(float v) {
    const bool sub = v < 1.17549435e-38f;
    const float w = sub ? v * 8388608.0f : v;          // 2^23: a subnormal becomes normal
    const int ix = __float_as_int(w) - 0x3f2aaaab;     // 0x3f2aaaab: 2/3
    const float k = float((ix >> 23) - (sub ? 23 : 0));
    const float f = __int_as_float((ix & 0x007fffff) + 0x3f2aaaab) - 1.0f;
    float q = 1.218187138e-01f;
    q = __fmaf_rn(q, f, -1.304625869e-01f);
    q = __fmaf_rn(q, f, 1.070348248e-01f);
    q = __fmaf_rn(q, f, -1.214159131e-01f);
    q = __fmaf_rn(q, f, 1.430969387e-01f);
    q = __fmaf_rn(q, f, -1.668459624e-01f);
    q = __fmaf_rn(q, f, 1.999937147e-01f);
    q = __fmaf_rn(q, f, -2.499963790e-01f);
    q = __fmaf_rn(q, f, 3.333334029e-01f);
    q = __fmaf_rn(q, f, -0.5f);
    q = __fmaf_rn(q, f, 1.0f);
    const float lo = __fmaf_rn(k, 1.428606765330187e-06f, __fmul_rn(q, f));
    const float r = __fmaf_rn(k, 0.693145751953125f, lo);
    if (v > 0.0f && v < __int_as_float(0x7f800000)) return r;
    return v == 0.0f ? __int_as_float(0xff800000) : (v > 0.0f ? v : __int_as_float(0x7fffffff));
}
__device__ __forceinline__ double lg_fine(double v) { return log(v); }
__device__ __forceinline__ float lg1p(float v) { return log1pf(v); }
__device__ __forceinline__ double lg1p(double v) { return log1p(v); }
// log1p(e) for e in [0, 1] (or NaN): e P(e), P of degree 11 fitted to log1p(e) / e for relative
// error.  12 FMAs where log1pf takes about 33 instructions and a branch, which bound the
// logistic losses' gradients by instructions rather than memory.  Against float64 over
// e = exp(-|x|) of 4M normal x (x ~ N(0, 9)): at most 1.6 float32 ulps, mean signed error
// -0.004 ulp (their sum: -1.1e-9 relative); log1pf is within 1 ulp.  P(0) is exactly 1, so a
// tiny or subnormal e gives e itself (the runs: docs/tuning.md, "The functors' code").
__device__ __forceinline__ float lg1p_unit(float e) {
    float p = -1.280600787e-03f;
    p = __fmaf_rn(p, e, 9.080967866e-03f);
    p = __fmaf_rn(p, e, -3.017254360e-02f);
    p = __fmaf_rn(p, e, 6.400786340e-02f);
    p = __fmaf_rn(p, e, -1.012437716e-01f);
    p = __fmaf_rn(p, e, 1.342654824e-01f);
    p = __fmaf_rn(p, e, -1.645287722e-01f);
    p = __fmaf_rn(p, e, 1.996530294e-01f);
    p = __fmaf_rn(p, e, -2.499661297e-01f);
    p = __fmaf_rn(p, e, 3.333316147e-01f);
    p = __fmaf_rn(p, e, -4.999999702e-01f);
    p = __fmaf_rn(p, e, 1.0f);
    return __fmul_rn(p, e);
}
__device__ __forceinline__ double lg1p_unit(double e) { return log1p(e); }
__device__ __forceinline__ float ex(float v) { return expf(v); }
__device__ __forceinline__ double ex(double v) { return exp(v); }
__device__ __forceinline__ float pw(float b, float e) { return powf(b, e); }
__device__ __forceinline__ double pw(double b, double e) { return pow(b, e); }
// 1 / v for v in [1, 2] (or NaN): float's approximate reciprocal (__fdividef, within 2 ulp for
// a divisor in [2^-126, 2^126]), double's correctly rounded one.
__device__ __forceinline__ float rcp_unit(float v) { return __fdividef(1.0f, v); }
__device__ __forceinline__ double rcp_unit(double v) { return __drcp_rn(v); }
__device__ __forceinline__ float quiet_nan(float) { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ double quiet_nan(double) {
    return __longlong_as_double(0x7ff8000000000000ll);
}

// max(v, 0) that keeps NaN (torch's clamp_min): NaN < 0 is false.
template <typename A>
__device__ __forceinline__ A relu(A v) { return v < A(0) ? A(0) : v; }
// [v >= 0] as 0 or 1 (torch's clamp_min backward: ties pass, NaN is blocked).
template <typename A>
__device__ __forceinline__ A passes(A v) { return v >= A(0) ? A(1) : A(0); }
// sign(v) with sign(0) = 0 and, as torch's sgn, sign(NaN) = 0.
template <typename A>
__device__ __forceinline__ A sign0(A v) { return A(v > A(0)) - A(v < A(0)); }

// Logistic pieces of a logit x that never overflow: with e = exp(-|x|),
//   softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e),   softplus(-x) = max(-x, 0) + log1p(e),
//   sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below, sigmoid(-x) = 1 - sigmoid(x)
//   taken from the same two numbers, so neither loses digits to 1 - (1 - tiny).
// Sigmoids::exact takes 1 / (1 + e) correctly rounded (rcp_unit_rn, the bits of __frcp_rn
// without its branch, which kept a broadcast logit's work in the loop; docs/tuning.md, "The
// functors' code").
// Sigmoids::fast takes rcp_unit (2 ulp in float, fewer instructions), for a loss value.
enum class Sigmoids { none, exact, fast };

template <typename A>
struct Logistic {
    A sp_pos, sp_neg;    // softplus(x), softplus(-x)
    A sg_pos, sg_neg;    // sigmoid(x), sigmoid(-x); with Sigmoids::none, unset

    Logistic() = default;  // unset: a functor's fixed terms of an operand that is not fixed
    __device__ __forceinline__ explicit Logistic(A x, Sigmoids sigmoids = Sigmoids::exact) {
        const A e = ex(-absv(x));
        const A l = lg1p_unit(e);
        sp_pos = (x > A(0) ? x : A(0)) + l;
        sp_neg = (x < A(0) ? -x : A(0)) + l;  // a NaN x makes e, l and so both NaN
        if (sigmoids != Sigmoids::none) {
            const A inv = sigmoids == Sigmoids::fast ? rcp_unit(A(1) + e) : rcp_unit_rn(A(1) + e);
            const A small = e * inv;
            sg_pos = x >= A(0) ? inv : small;
            sg_neg = x >= A(0) ? small : inv;
        }
    }
};

// mse_loss:  l = (x - t)^2,   dl/dx = 2 (x - t),   dl/dt = -2 (x - t)
struct MseOp {
    static constexpr int K = 2;  // input, target
    using Params = NoParams;
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&) {
        const A d = v[0] - v[1];
        return d * d;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&, A (&d)[K]) {
        d[0] = A(2) * (v[0] - v[1]);
        d[1] = A(-2) * (v[0] - v[1]);
    }
};

// kl_div, torch's definition with x = input (log-probabilities) and t = target:
//   log_target=False:  l = xlogy(t, t) - t x          xlogy(0, 0) = 0
//                      dl/dx = -t
//                      dl/dt = xlogy(t != 0, t) + t / t - x    (NaN at t == 0, as torch's autograd)
//   log_target=True:   l = e^t (t - x),   dl/dx = -e^t,   dl/dt = e^t (t - x) + e^t
// log_input=False takes probabilities p and uses x = log p inside, so dl/dp = (dl/dx) / p.
// There, for probabilities (t and p normal numbers at most 1, so that t / p is normal too) the
// kernel evaluates
//   l = t log(t / p),   dl/dt = log(t / p) + 1,   dl/dp = -(t / p)
// with one log and one fast division (div_fast) instead of two logs (the forward pass is
// otherwise bound by logf's instructions, not by memory).  For t / p in (1/2, 2) the loss's log
// is taken of 1 + (t - p) / p with the rounding of that sum added back (t - p is exact there):
// log t / p is small, and the ratio's own rounding would be large against it.  Every other
// value takes the literal formula above, so zeros, subnormals, infinities and NaNs behave
// exactly as kl_div(log(p), t) does in torch.
// The two flags are template arguments (the registry's `modes`), not Params fields: each
// combination is its own kernel, holding only its own formula's code.  With them read at run
// time the kernels held every form and the compiler interleaved them (docs/tuning.md, "The
// functors' code").
template <int MODE>
struct KlDivOp {
    static constexpr int K = 2;  // input, target
    static constexpr bool log_target = (MODE & 1) != 0;  // target holds log-probabilities
    static constexpr bool log_input = (MODE & 2) != 0;   // input holds log-probabilities
    using Params = NoParams;
    template <typename A>
    static __device__ __forceinline__ A log_in(A x, const Params&) {
        if constexpr (log_input) return x;
        else return lg(x);
    }
    // The ratio form's operands: probabilities, normal (at least 2^-126) and at most 1, so that
    // t / x is a normal number too (between 2^-126 and 2^126: div_fast's and lg's exact range;
    // a wider ratio would round to 0 or inf there); every other value takes the literal formula.
    template <typename A>
    static __device__ __forceinline__ bool ratio_form(A x, A t, const Params&) {
        const A lo = A(1.1754943508222875e-38);  // 2^-126
        return !log_input && !log_target && t >= lo && t <= A(1) && x >= lo && x <= A(1);
    }
    // The loss's log(t / p) in the ratio form.  Near 1, log r = log w + (u - (w - 1)) / w with
    // u = (t - p) / p and w = 1 + u rounded: the second term restores what rounding w lost (one
    // log either way).
    template <typename A>
    static __device__ __forceinline__ A ratio_log(A x, A t) {
        const A r = div_fast(t, x);
        const bool near = r > A(0.5) && r < A(2);
        const A u = div_fast(t - x, x);
        const A w = near ? add_rn(A(1), u) : r;
        const A lost = near ? div_fast(add_rn(u, -add_rn(w, A(-1))), w) : A(0);
        return add_rn(lg_normal(w), lost);  // w: in (1/2, 2), or r, normal (ratio_form)
    }
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        const A x = v[0], t = v[1];
        // Every sum and product here is rounded on its own (add_rn, mul_rn): the value-only
        // and the gradient kernels then give the same bits, where the compiler would otherwise
        // fuse a product into a later add in one and not the other.
        if (ratio_form(x, t, p)) return mul_rn(t, ratio_log(x, t));
        const A lx = log_in(x, p);
        if constexpr (log_target) return mul_rn(ex(t), t - lx);
        const A log_t = lg_fine(t);  // taken for every t, 0 included: see grad
        const A xlogy = t == A(0) ? A(0) : mul_rn(t, log_t);
        return add_rn(xlogy, -mul_rn(t, lx));
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A x = v[0], t = v[1];
        if (ratio_form(x, t, p)) {
            // log(ratio), not the value's ratio_log: its division-heavy correction costs more
            // than a second log (docs/tuning.md, "The functors' code").
            const A ratio = div_fast(t, x);
            d[0] = -ratio;
            d[1] = lg_normal(ratio) + A(1);
            return;
        }
        const A dx = log_target ? -ex(t) : -t;
        d[0] = log_input ? dx : dx / x;
        const A lx = log_in(x, p);
        if constexpr (log_target) {
            const A et = ex(t);
            d[1] = et * (t - lx) + et;
        } else {
            // t / t is 1 for every finite nonzero t (subnormals included) and NaN for 0, +-inf
            // and NaN: a compare and a select instead of the division.
            const A t_over_t = t != A(0) && isfinite(t) ? A(1) : quiet_nan(A(0));
            // The value's log: value_and_grad computes it once for both (docs/tuning.md,
            // "The functors' code").
            // lg_fine is taken for every t and the zero selected away afterwards: under a
            // `t != 0` branch here and in value, the two logs sat in two conditional blocks
            // and value_and_grad computed each twice.
            const A log_t = lg_fine(t);
            d[1] = (t != A(0) ? log_t : A(0)) + t_over_t - lx;
        }
    }
};

// hinge_loss:  l = max(0, m - x t)   (NaN stays NaN)
//   torch's clamp(min=0) passes the gradient where m - x t >= 0, ties included, and multiplies
//   it by 0 where m - x t < 0 or is NaN; the chain rule then multiplies by t or x, so a masked
//   NaN or infinite factor still gives NaN, as in torch:
//   dl/dx = -([m - x t >= 0] t),   dl/dt = -([m - x t >= 0] x)
struct HingeOp {
    static constexpr int K = 2;  // input, target
    struct Params {
        double margin;
    };
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        return relu(A(p.margin) - mul_rn(v[0], v[1]));
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A pass = passes(A(p.margin) - mul_rn(v[0], v[1]));
        d[0] = -(pass * v[1]);
        d[1] = -(pass * v[0]);
    }
};

// l1_loss:  l = |x - t|,   dl/dx = sign(x - t) = -dl/dt   (0 at the tie and, as torch's sgn,
// for a NaN difference)
struct L1Op {
    static constexpr int K = 2;  // input, target
    using Params = NoParams;
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&) {
        const A d = v[0] - v[1];
        return absv(d);
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&, A (&d)[K]) {
        d[0] = sign0(v[0] - v[1]);
        d[1] = -d[0];
    }
};

// smooth_l1_loss, d = x - t, z = |d|:
//   l = z^2 / (2 beta) for z < beta, z - beta / 2 otherwise;   beta == 0 is l1_loss (torch)
//   dl/dx = -1 for d <= -beta, 1 for d >= beta, d / beta between = -dl/dt
//   (torch's smooth_l1_loss_backward: the ties |d| == beta take the constant)
// In float the quotients are products with 0.5 / beta and 1 / beta, formed once per launch in
// double and rounded to float (each product then within 1.5 ulp of the quotient).  Those
// factors are normal floats for beta in [2^-64, 2^64]; for a beta outside it (beta == 0 aside,
// where no quotient is taken) the product is taken in double, with 1 / beta correctly rounded
// (__drcp_rn), and rounded to float once: within an ulp of the quotient.  No division: its
// out-of-line slow path and the reconvergence points around it were paid by every element of
// the common case.
// MODE bit 0: beta == 1, torch's default (the registry's `constants`), compiled in: the factors
// are then 0.5 and 1 and the tests on beta fold away, leaving no uniform branch in the loop
// (the same bits: z^2 0.5 and d 1 are the products the general path forms for beta == 1).
// The runs of both: docs/tuning.md, "The functors' code".
template <int MODE>
struct SmoothL1Op {
    static constexpr int K = 2;  // input, target
    static constexpr bool beta_one = (MODE & 1) != 0;
    struct Params {
        double beta;  // >= 0, checked on the host
    };
    static __device__ __forceinline__ double beta_of(const Params& p) {
        return beta_one ? 1.0 : p.beta;
    }
    static __device__ __forceinline__ bool keeps_division(double beta) {
        return beta != 0 && !(beta >= 0x1p-64 && beta <= 0x1p64);
    }
    // z^2 / (2 beta), for z < beta
    static __device__ __forceinline__ float quadratic(float z, double beta) {
        if (keeps_division(beta)) return float(double(z) * double(z) * (0.5 * __drcp_rn(beta)));
        return z * z * float(0.5 / beta);
    }
    static __device__ __forceinline__ double quadratic(double z, double beta) {
        return 0.5 * z * z / beta;
    }
    // d / beta, for |d| < beta
    static __device__ __forceinline__ float ratio(float d, double beta) {
        if (keeps_division(beta)) return float(double(d) * __drcp_rn(beta));
        return d * float(1.0 / beta);
    }
    static __device__ __forceinline__ double ratio(double d, double beta) { return d / beta; }
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        const double b = beta_of(p);
        const A beta = A(b), d = v[0] - v[1];
        const A z = absv(d);
        // beta == 0 (l1_loss) needs no case of its own: z < 0 never holds and z - 0 is z.
        // Both sides are formed for every element and one selected: the branch inside
        // quadratic (on beta alone) is then uniform, and no element diverges around it.
        const A q = quadratic(z, b), lin = z - A(0.5) * beta;
        return z < beta ? q : lin;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const double b = beta_of(p);
        const A beta = A(b), diff = v[0] - v[1];
        if (b == 0) {
            d[0] = sign0(diff);
        } else {  // ratio for every element, then selected (see value)
            const A r = ratio(diff, b);
            d[0] = diff <= -beta ? A(-1) : (diff >= beta ? A(1) : r);
        }
        d[1] = -d[0];
    }
};

// huber_loss, d = x - t, z = |d|:
//   l = z^2 / 2 for z < delta, delta (z - delta / 2) otherwise
//   dl/dx = -delta for d <= -delta, delta for d >= delta, d between = -dl/dt
struct HuberOp {
    static constexpr int K = 2;  // input, target
    struct Params {
        double delta;  // > 0, checked on the host
    };
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        const A delta = A(p.delta), d = v[0] - v[1];
        const A z = absv(d);
        return z < delta ? A(0.5) * z * z : delta * (z - A(0.5) * delta);
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A delta = A(p.delta), diff = v[0] - v[1];
        d[0] = diff <= -delta ? -delta : (diff >= delta ? delta : diff);
        d[1] = -d[0];
    }
};

// binary_cross_entropy, x = input (a probability), t = target, w = weight (1 when absent):
//   l = w ((t - 1) max(log(1 - x), -100) - t max(log x, -100))      (torch clamps each log)
//   dl/dx = w (x - t) / max(x (1 - x), 1e-12f)          (torch's backward formula)
//   dl/dt = w (log(1 - x) - log x) = -w logit(x)         (torch's target backward, unclamped)
//   dl/dw = the unweighted loss
// x outside [0, 1] (torch asserts) gives a NaN loss; the input gradient is the formula's.
// The logs are libdevice's (logf, log1pf).  Branch-free ones (lg_fine, and lg_fine(1 - x) plus
// the rounding 1 - x lost) let the logs of a broadcast x leave the loop but cost the full-size
// forward, bce's common case, a fifth more instructions; branch-free copies of logf and log1pf
// themselves gained at full size but made the compiler evaluate a per-unit x's logs at every
// element.  So the library's stay (docs/tuning.md, "The functors' code").
// MODE bit 0: a weight array is given (the registry's `modes`); without one w is the constant 1,
// so the kernels hold no weight arithmetic.
template <int MODE>
struct BceOp {
    static constexpr int K = 3;  // input, target, weight
    static constexpr bool weighted = (MODE & 1) != 0;
    using Params = NoParams;
    // The input's logs are fixed terms (pointwise.cu's FixedTerms): formed once before the loop
    // where the input is the same for every element a thread visits (CONST bit 0, a broadcast
    // input), per element otherwise.  libdevice's logf and log1pf branch, and the compiler left
    // them in the loops (docs/tuning.md, "The functors' code").
    static constexpr bool fixed_terms = true;
    template <int CONST, typename A>
    struct Fixed {
        A log_x, log_1mx;
    };
    template <int CONST, typename A>
    static __device__ __forceinline__ Fixed<CONST, A> fix(const A (&v)[K], const Params&) {
        if constexpr ((CONST & 1) != 0) return {lg(v[0]), lg1p(-v[0])};
        else return {A(0), A(0)};
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ Fixed<CONST, A> logs(const A (&v)[K],
                                                          const Fixed<CONST, A>& f) {
        if constexpr ((CONST & 1) != 0) return f;
        else return {lg(v[0]), lg1p(-v[0])};
    }
    template <typename A>
    static __device__ __forceinline__ A clamp_log(A v) { return v < A(-100) ? A(-100) : v; }
    template <typename A>
    static __device__ __forceinline__ A unweighted(A log_x, A log_1mx, A t) {
        return (t - A(1)) * clamp_log(log_1mx) - t * clamp_log(log_x);
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&,
                                              const Fixed<CONST, A>& f) {
        const Fixed<CONST, A> lf = logs(v, f);
        const A l = unweighted(lf.log_x, lf.log_1mx, v[1]);
        return weighted ? v[2] * l : l;
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&,
                                                const Fixed<CONST, A>& f, A (&d)[K]) {
        const A x = v[0], t = v[1], w = weighted ? v[2] : A(1);
        const Fixed<CONST, A> lf = logs(v, f);
        const A m = (A(1) - x) * x;
        const A eps = A(1e-12f);
        // The divisor is in [1e-12, 1/4] (or NaN), where __fdividef is within 2 ulp for any
        // dividend; the IEEE division's slow path kept the compiler from overlapping elements
        // (docs/tuning.md, "The functors' code").
        d[0] = w * div_fast(x - t, m < eps ? eps : m);
        d[1] = w * (lf.log_1mx - lf.log_x);
        d[2] = weighted ? unweighted(lf.log_x, lf.log_1mx, t) : A(0);  // no weight: never used
    }
};

// binary_cross_entropy_with_logits, x = logit, t = target, w = weight, q = pos_weight (1 when
// absent).  Torch's w ((1 - t) x - (1 + (q - 1) t) log_sigmoid(x)) is evaluated in the equal form
//   l = w ((1 - t) softplus(x) + q t softplus(-x))
// (non-negative terms for t in [0, 1]: no digits lost at large |x|, and exp never overflows):
//   dl/dx = w ((1 - t) sigmoid(x) - q t sigmoid(-x)),   dl/dt = w (q softplus(-x) - softplus(x))
//   dl/dw = the unweighted loss,                        dl/dq = w t softplus(-x)
// MODE bit 0: a weight array is given, bit 1: a pos_weight array (the registry's `modes`); an
// absent one is the constant 1, so the kernels hold none of its arithmetic.
template <int MODE>
struct BceLogitsOp {
    static constexpr int K = 4;  // input, target, weight, pos_weight
    static constexpr bool weighted = (MODE & 1) != 0, pos_weighted = (MODE & 2) != 0;
    using Params = NoParams;
    // The logit's logistic pieces are fixed terms (pointwise.cu's FixedTerms), as
    // sigmoid_focal_loss's: formed once before the loop where x is fixed (CONST bit 0)
    // (docs/tuning.md, "The functors' code").  Its 16-bit rows kernel is bounded for 2 blocks
    // an SM (the launch table's FUNCTOR_SHAPES).
    static constexpr bool fixed_terms = true;
    template <int CONST, typename A>
    struct Fixed {
        Logistic<A> s;  // unset when x is not fixed
    };
    template <int CONST, typename A>
    static __device__ __forceinline__ Fixed<CONST, A> fix(const A (&v)[K], const Params&) {
        if constexpr ((CONST & 1) != 0) return {Logistic<A>(v[0], Sigmoids::exact)};
        else return {};
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&,
                                              const Fixed<CONST, A>& f) {
        const Logistic<A> s = (CONST & 1) != 0 ? f.s : Logistic<A>(v[0], Sigmoids::none);
        const A qt = pos_weighted ? v[3] * v[1] : v[1];
        const A l = (A(1) - v[1]) * s.sp_pos + qt * s.sp_neg;
        return weighted ? v[2] * l : l;
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&,
                                                const Fixed<CONST, A>& f, A (&d)[K]) {
        const A t = v[1], w = weighted ? v[2] : A(1), q = pos_weighted ? v[3] : A(1);
        const Logistic<A> s = (CONST & 1) != 0 ? f.s : Logistic<A>(v[0], Sigmoids::exact);
        d[0] = w * ((A(1) - t) * s.sg_pos - q * t * s.sg_neg);
        // q softplus(-x) - softplus(x), which is -x without a pos_weight: taken as -x there (as
        // torch takes it), exact, where the difference of the two rounds relative to softplus.
        d[1] = w * (pos_weighted ? q * s.sp_neg - s.sp_pos : -v[0]);
        // An absent weight or pos_weight has no gradient: its slot is never read.
        d[2] = weighted ? (A(1) - t) * s.sp_pos + q * t * s.sp_neg : A(0);
        d[3] = pos_weighted ? w * t * s.sp_neg : A(0);
    }
};

// soft_margin_loss:  l = log(1 + exp(-x t)) = softplus(-x t)   (finite where torch's
// log1p(exp(-x t)) overflows),   dl/dx = -t sigmoid(-x t),   dl/dt = -x sigmoid(-x t)
struct SoftMarginOp {
    static constexpr int K = 2;  // input, target
    using Params = NoParams;
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&) {
        return Logistic<A>(-(v[0] * v[1]), Sigmoids::none).sp_pos;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&, A (&d)[K]) {
        const A s = Logistic<A>(-(v[0] * v[1])).sg_pos;
        d[0] = -v[1] * s;
        d[1] = -v[0] * s;
    }
};

// hinge_embedding_loss:  l = [t != 1] max(0, m - x) + [t != -1] x   (torch's two wheres: a
// target other than +-1 takes both terms)
//   dl/dx = [t != -1] - [t != 1] [m - x >= 0],   dl/dt = 0 (the target only picks branches)
struct HingeEmbeddingOp {
    static constexpr int K = 2;  // input, target
    struct Params {
        double margin;
    };
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        const A x = v[0], t = v[1];
        A l = A(0);
        if (t != A(1)) l += relu(A(p.margin) - x);
        if (t != A(-1)) l += x;
        return l;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A x = v[0], t = v[1];
        d[0] = A(t != A(-1)) - (t != A(1) ? passes(A(p.margin) - x) : A(0));
        d[1] = A(0);
    }
};

// margin_ranking_loss:  l = max(0, -t (x1 - x2) + m)
//   with pass = [-t (x1 - x2) + m >= 0] (ties pass, NaN blocks; the products stay literal):
//   dl/dx1 = -(t pass),   dl/dx2 = t pass,   dl/dt = -((x1 - x2) pass)
struct MarginRankingOp {
    static constexpr int K = 3;  // input1, input2, target
    struct Params {
        double margin;
    };
    template <typename A>
    static __device__ __forceinline__ A margin_term(const A (&v)[K], const Params& p) {
        return mul_rn(-v[2], v[0] - v[1]) + A(p.margin);
    }
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        return relu(margin_term(v, p));
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A pass = passes(margin_term(v, p));
        d[0] = -(v[2] * pass);
        d[1] = v[2] * pass;
        d[2] = -((v[0] - v[1]) * pass);
    }
};

// poisson_nll_loss, x = input, t = target:
//   log_input:   l = e^x - t x,             dl/dx = e^x - t,           dl/dt = -x
//   otherwise:   l = x - t log(x + eps),    dl/dx = 1 - t / (x + eps), dl/dt = -log(x + eps)
//   full adds the Stirling term t log t - t + log(2 pi t) / 2 where t > 1 (0 where t <= 1), and
//   to dl/dt torch's backward of the masked term, m log t + (m t) / t - m + m / (2 t) with
//   m = [t > 1]: NaN where t <= 0 (0 * log 0 and 0 / 0 survive the mask), 0 on (0, 1].
// log_input and full are template arguments (the registry's `modes`), as kl_div's flags.
template <int MODE>
struct PoissonNllOp {
    static constexpr int K = 2;  // input, target
    static constexpr bool log_input = (MODE & 1) != 0;
    static constexpr bool full = (MODE & 2) != 0;
    struct Params {
        double eps;
    };
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        // Each sum and product rounded on its own (add_rn, mul_rn), as kl_div's: with the modes
        // known at compile time the compiler would otherwise fuse differently in the value-only
        // and the gradient kernels, and their losses would differ in the last bit.
        const A x = v[0], t = v[1];
        A l = log_input ? add_rn(ex(x), -mul_rn(t, x))
                        : add_rn(x, -mul_rn(t, lg(add_rn(x, A(p.eps)))));
        if (full && !(t <= A(1))) {
            const A stirling = add_rn(add_rn(mul_rn(t, lg(t)), -t),
                                      mul_rn(A(0.5), lg(mul_rn(A(6.283185307179586), t))));
            l = add_rn(l, stirling);
        }
        return l;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A x = v[0], t = v[1];
        if constexpr (log_input) {
            d[0] = ex(x) - t;
            d[1] = -x;
        } else {
            const A xe = x + A(p.eps);
            d[0] = A(1) - t / xe;
            d[1] = -lg(xe);
        }
        if constexpr (full) {
            const A m = t <= A(1) ? A(0) : A(1);
            d[1] += m * lg(t) + (m * t) / t - m + A(0.5) * m / t;
        }
    }
};

// gaussian_nll_loss, x = input, t = target, s = max(var, eps) (NaN stays NaN; a negative var is
// clamped like any var below eps: torch raises there, after a host sync):
//   l = (log s + (x - t)^2 / s) / 2 (+ log(2 pi) / 2 when full)
//   dl/dx = (x - t) / s = -dl/dt,   dl/dvar = (1 / s - (x - t)^2 / s^2) / 2
//   (torch clamps under no_grad, so var's gradient is this formula even where the clamp acts)
struct GaussianNllOp {
    static constexpr int K = 3;  // input, target, var
    struct Params {
        long long full;
        double eps;
    };
    // log s is a fixed term (pointwise.cu's FixedTerms): formed once before the loop where var
    // is the same for every element a thread visits (CONST bit 2: a per-row or per-channel
    // variance), per element otherwise; libdevice's logf branches, so the compiler kept it in
    // the loop.  IEEE divisions by s remain per element (docs/tuning.md, "The functors' code").
    static constexpr bool fixed_terms = true;
    template <int CONST, typename A>
    struct Fixed {
        A log_s;
    };
    template <typename A>
    static __device__ __forceinline__ A clamped(A var, const Params& p) {
        const A eps = A(p.eps);
        return var < eps ? eps : var;
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ Fixed<CONST, A> fix(const A (&v)[K], const Params& p) {
        if constexpr ((CONST & 4) != 0) return {lg(clamped(v[2], p))};
        else return {A(0)};
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p,
                                              const Fixed<CONST, A>& f) {
        const A s = clamped(v[2], p), diff = v[0] - v[1];
        const A log_s = (CONST & 4) != 0 ? f.log_s : lg(s);
        const A l = A(0.5) * (log_s + diff * diff / s);
        return p.full ? l + A(0.91893853320467274) : l;
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p,
                                                const Fixed<CONST, A>&, A (&d)[K]) {
        const A s = clamped(v[2], p), diff = v[0] - v[1];
        d[0] = diff / s;
        d[1] = -d[0];
        d[2] = A(0.5) * (A(1) / s - diff * diff / (s * s));
    }
};

// squared_hinge_loss:  l = max(0, m - x t)^2
//   with h = m - x t where m - x t >= 0, else 0 (clamp's backward blocks NaN):
//   dl/dx = -2 h t,   dl/dt = -2 h x
struct SquaredHingeOp {
    static constexpr int K = 2;  // input, target
    struct Params {
        double margin;
    };
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p) {
        const A h = relu(A(p.margin) - mul_rn(v[0], v[1]));
        return h * h;
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p, A (&d)[K]) {
        const A u = A(p.margin) - mul_rn(v[0], v[1]);
        const A h = u >= A(0) ? u : A(0);
        d[0] = A(-2) * h * v[1];
        d[1] = A(-2) * h * v[0];
    }
};

// sigmoid_focal_loss (torchvision's), x = logit, t = target, p = sigmoid(x), r = sigmoid(-x):
//   ce = (1 - t) softplus(x) + t softplus(-x)     (bce_with_logits, stable form)
//   q = 1 - p_t = p (1 - t) + r t                  (no 1 - (1 - tiny))
//   a = alpha t + (1 - alpha)(1 - t) = (1 - alpha) + a' t,   a' = 2 alpha - 1
//       (a = 1 and a' = 0 when alpha < 0)
//   l = a ce q^gamma
//   with dq = gamma q^(gamma - 1) (0 when gamma == 0, as torch's pow backward):
//   dl/dx = a ((p (1 - t) - r t) q^gamma + ce dq p r (1 - 2 t))
//   dl/dt = a' ce q^gamma + a (-x q^gamma + ce dq (r - p))
// a is one fma of t with the constants a' and 1 - alpha (1 when alpha < 0).  It differs from
// the literal sum only for an infinite or NaN t, where ce is NaN (-inf + inf, or 0 inf when a
// softplus is 0), so the loss and both partials are NaN either way.
// MODE bit 0: gamma == 2, torchvision's default (the registry's `constants`), compiled in: q^2
// and dq = 2 q with no branch on gamma, whose powf path kept every element's other work in the
// loop (docs/tuning.md, "The functors' code").
template <int MODE>
struct SigmoidFocalOp {
    static constexpr int K = 2;  // input, target
    static constexpr bool gamma_two = (MODE & 1) != 0;
    struct Params {
        double alpha;
        double gamma;
    };
    template <typename A>
    static __device__ __forceinline__ A focus(A q, double gamma) {  // q^gamma
        if constexpr (gamma_two) return q * q;
        else return gamma == 2 ? q * q : (gamma == 1 ? q : pw(q, A(gamma)));
    }
    template <typename A>
    static __device__ __forceinline__ A focus_slope(A q, double gamma) {  // gamma q^(gamma - 1)
        if constexpr (gamma_two) return A(2) * q;
        else return gamma == 0 ? A(0) : (gamma == 2 ? A(2) * q : A(gamma) * focus(q, gamma - 1));
    }
    template <typename A>
    static __device__ __forceinline__ A weight_slope(const Params& p) {  // a'
        return A(p.alpha >= 0 ? 2 * p.alpha - 1 : 0.0);
    }
    // weight, ce and q are formed with explicit roundings (fma_rn, mul_rn): value and grad
    // share weight and ce when both are wanted, and an FMA contracted differently in the two
    // would make the one-pass loss differ from the loss alone.  value's q comes from
    // Sigmoids::fast and grad's from Sigmoids::exact (see Logistic), so the loss is value's
    // alone in either kernel.
    template <typename A>
    static __device__ __forceinline__ A weight(A t, const Params& p) {
        return fma_rn(t, weight_slope<A>(p), A(p.alpha >= 0 ? 1 - p.alpha : 1.0));
    }
    template <typename A>
    static __device__ __forceinline__ A cross_entropy(A t, const Logistic<A>& s) {
        return fma_rn(A(1) - t, s.sp_pos, mul_rn(t, s.sp_neg));
    }
    template <typename A>
    static __device__ __forceinline__ A one_minus_pt(A t, const Logistic<A>& s) {
        return fma_rn(s.sg_pos, A(1) - t, mul_rn(s.sg_neg, t));
    }
    // The logit's logistic pieces are fixed terms (pointwise.cu's FixedTerms): formed once
    // before the loop where x is the same for every element a thread visits (CONST bit 0), per
    // element otherwise.  Left to the compiler, the rows kernel kept half of a broadcast x's
    // exps and reciprocals in its loop.  In 16-bit the rows kernel holds them for vectors of 8
    // elements, which spill at the heavy knobs' 3 blocks an SM: bounded for 2 blocks instead
    // (the launch table's FUNCTOR_SHAPES; the runs of both: docs/tuning.md, "The functors' code").
    static constexpr bool fixed_terms = true;
    template <int CONST, typename A>
    struct Fixed {
        Logistic<A> fast, exact;  // value's and grad's pieces of x (unset when x is not fixed)
    };
    template <int CONST, typename A>
    static __device__ __forceinline__ Fixed<CONST, A> fix(const A (&v)[K], const Params&) {
        if constexpr ((CONST & 1) != 0)
            return {Logistic<A>(v[0], Sigmoids::fast), Logistic<A>(v[0], Sigmoids::exact)};
        else return {};
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params& p,
                                              const Fixed<CONST, A>& f) {
        const A t = v[1];
        const Logistic<A> s = (CONST & 1) != 0 ? f.fast : Logistic<A>(v[0], Sigmoids::fast);
        return weight(t, p) * cross_entropy(t, s) * focus(one_minus_pt(t, s), p.gamma);
    }
    template <int CONST, typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params& p,
                                                const Fixed<CONST, A>& f, A (&d)[K]) {
        const A x = v[0], t = v[1];
        const Logistic<A> s = (CONST & 1) != 0 ? f.exact : Logistic<A>(x, Sigmoids::exact);
        const A ce = cross_entropy(t, s);
        const A q = one_minus_pt(t, s);
        const A mod = focus(q, p.gamma);
        const A dq = focus_slope(q, p.gamma);
        const A a = weight(t, p);
        const A ce_dq = ce * dq;
        d[0] = a * ((s.sg_pos * (A(1) - t) - s.sg_neg * t) * mod
                    + ce_dq * (s.sg_pos * s.sg_neg) * (A(1) - A(2) * t));
        d[1] = weight_slope<A>(p) * ce * mod + a * (-x * mod + ce_dq * (s.sg_neg - s.sg_pos));
    }
};

// log_cosh_loss, d = x - t, z = |d|:
//   l = log(cosh d) = log1p(cosh z - 1) for z < 1 (no cancellation near 0, where it is
//   d^2 / 2), z - log 2 + log1p(exp(-2 z)) otherwise (no overflow of cosh); both branches are
//   formed for every element and one log1p taken of the selected argument, since neighbouring
//   elements usually take different branches.  cosh z - 1 = z^2/2! + z^4/4! + ... is its Taylor
//   polynomial in y = z^2, the y tanh's polynomial takes too (truncation below 4e-9 relative in
//   float, 2e-21 in double).  It replaced 2 sinh(z / 2)^2 with sinh's polynomial, and |d| a
//   select (absv), in a kernel bound by issuing instructions (docs/tuning.md, "The functors'
//   code").
//   The loss against float64, 4M d in each of N(0, 0.1), N(0, 1),
//   U(0, 1.2), N(0, 5): at most 3.64 ulp (3.57 before), above 1 ulp 15.1 / 9.3 / 11.1 / 2.1% of
//   them (19.5 / 12.0 / 14.5 / 2.8 before).
//   dl/dx = tanh(d) = -dl/dt, tanh_bf's (common.cuh): its e^(-2|d|) is value's, which a
//   value_and_grad pass takes once for both.
struct LogCoshOp {
    static constexpr int K = 2;  // input, target
    using Params = NoParams;
    // cosh z - 1 for y = z^2 < 1: y (1/2! + y/4! + y^2/6! + ...), Horner in y.
    static __device__ __forceinline__ float cosh_m1_small(float y) {
        float q = 1.0f / 3628800;                                 // 1 / 10!
        q = __fmaf_rn(q, y, 1.0f / 40320);
        q = __fmaf_rn(q, y, 1.0f / 720);
        q = __fmaf_rn(q, y, 1.0f / 24);
        q = __fmaf_rn(q, y, 0.5f);
        return y * q;
    }
    static __device__ __forceinline__ double cosh_m1_small(double y) {
        double q = 1.0 / 2432902008176640000.0;                   // 1 / 20!
        q = __fma_rn(q, y, 1.0 / 6402373705728000.0);             // 1 / 18!
        q = __fma_rn(q, y, 1.0 / 20922789888000.0);               // 1 / 16!
        q = __fma_rn(q, y, 1.0 / 87178291200.0);                  // 1 / 14!
        q = __fma_rn(q, y, 1.0 / 479001600.0);                    // 1 / 12!
        q = __fma_rn(q, y, 1.0 / 3628800.0);
        q = __fma_rn(q, y, 1.0 / 40320.0);
        q = __fma_rn(q, y, 1.0 / 720.0);
        q = __fma_rn(q, y, 1.0 / 24.0);
        q = __fma_rn(q, y, 0.5);
        return y * q;
    }
    template <typename A>
    static __device__ __forceinline__ A value(const A (&v)[K], const Params&) {
        const A d = v[0] - v[1];
        const A z = absv(d);
        const bool small = z < A(1);
        const A arg = small ? cosh_m1_small(z * z) : ex(A(-2) * z);
        return (small ? A(0) : z - A(0.69314718055994531)) + lg1p_unit(arg);
    }
    template <typename A>
    static __device__ __forceinline__ void grad(const A (&v)[K], const Params&, A (&d)[K]) {
        d[0] = tanh_bf(v[0] - v[1]);
        d[1] = -d[0];
    }
};

}  // namespace cupyloss
