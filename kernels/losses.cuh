// Pointwise loss functors: the loss of one element and its two partial derivatives.
//
// Every functor is stateless and works in the accumulator type A (float or double).  The
// options a loss takes travel in LossArgs.  Adding a pointwise loss means one functor here,
// one registry entry in cupyloss/_registry.py and one reference in tests/reference.py.
#pragma once

namespace cupyloss {

template <typename A>
struct LossArgs {
    A margin;          // hinge_loss
    bool log_target;   // kl_div: target holds log-probabilities
    bool log_input;    // kl_div: input holds log-probabilities (torch's convention)
};

__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
__device__ __forceinline__ float ex(float v) { return expf(v); }
__device__ __forceinline__ double ex(double v) { return exp(v); }
// A product rounded on its own, never contracted into an FMA with a later add: the hinge tie
// `margin - x*t == 0` must be decided as torch decides it.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// mse_loss:  l = (x - t)^2,   dl/dx = 2 (x - t),   dl/dt = -2 (x - t)
struct MseOp {
    template <typename A>
    static __device__ __forceinline__ A value(A x, A t, const LossArgs<A>&) {
        const A d = x - t;
        return d * d;
    }
    template <typename A>
    static __device__ __forceinline__ A d_input(A x, A t, const LossArgs<A>&) {
        return A(2) * (x - t);
    }
    template <typename A>
    static __device__ __forceinline__ A d_target(A x, A t, const LossArgs<A>&) {
        return A(-2) * (x - t);
    }
};

// kl_div, torch's definition with x = input (log-probabilities) and t = target:
//   log_target=False:  l = xlogy(t, t) - t x          xlogy(0, 0) = 0
//                      dl/dx = -t
//                      dl/dt = xlogy(t != 0, t) + t / t - x    (NaN at t == 0, as torch's autograd)
//   log_target=True:   l = e^t (t - x),   dl/dx = -e^t,   dl/dt = e^t (t - x) + e^t
// log_input=False takes probabilities p and uses x = log p inside, so dl/dp = (dl/dx) / p.
// There, for ordinary values (0 < t < inf, 0 < p < inf) the kernel evaluates
//   l = t log(t / p),   dl/dt = log(t / p) + 1,   dl/dp = -(t / p)
// with one log and one division instead of two logs (the forward pass is otherwise bound by
// logf's instructions, not by memory); every other value takes the literal formula above, so
// zeros, infinities and NaNs behave exactly as kl_div(log(p), t) does in torch.
struct KlDivOp {
    template <typename A>
    static __device__ __forceinline__ A log_in(A x, const LossArgs<A>& a) {
        return a.log_input ? x : lg(x);
    }
    template <typename A>
    static __device__ __forceinline__ bool ratio_form(A x, A t, const LossArgs<A>& a) {
        const A inf = A(1) / A(0);
        return !a.log_input && !a.log_target && t > A(0) && t < inf && x > A(0) && x < inf;
    }
    template <typename A>
    static __device__ __forceinline__ A value(A x, A t, const LossArgs<A>& a) {
        if (ratio_form(x, t, a)) return t * lg(t / x);
        const A lx = log_in(x, a);
        if (a.log_target) return ex(t) * (t - lx);
        const A xlogy = t == A(0) ? A(0) : t * lg(t);
        return xlogy - t * lx;
    }
    template <typename A>
    static __device__ __forceinline__ A d_input(A x, A t, const LossArgs<A>& a) {
        if (ratio_form(x, t, a)) return -(t / x);
        const A d = a.log_target ? -ex(t) : -t;
        return a.log_input ? d : d / x;
    }
    template <typename A>
    static __device__ __forceinline__ A d_target(A x, A t, const LossArgs<A>& a) {
        if (ratio_form(x, t, a)) return lg(t / x) + A(1);
        const A lx = log_in(x, a);
        if (a.log_target) {
            const A et = ex(t);
            return et * (t - lx) + et;
        }
        return (t != A(0) ? lg(t) : A(0)) + t / t - lx;
    }
};

// hinge_loss:  l = max(0, m - x t)   (NaN stays NaN)
//   torch's clamp(min=0) passes the gradient where m - x t >= 0, ties included, and multiplies
//   it by 0 where m - x t < 0 or is NaN; the chain rule then multiplies by t or x, so a masked
//   NaN or infinite factor still gives NaN, as in torch:
//   dl/dx = -([m - x t >= 0] t),   dl/dt = -([m - x t >= 0] x)
struct HingeOp {
    template <typename A>
    static __device__ __forceinline__ A pass(A x, A t, const LossArgs<A>& a) {
        return a.margin - mul_rn(x, t) >= A(0) ? A(1) : A(0);
    }
    template <typename A>
    static __device__ __forceinline__ A value(A x, A t, const LossArgs<A>& a) {
        const A v = a.margin - mul_rn(x, t);
        return v < A(0) ? A(0) : v;
    }
    template <typename A>
    static __device__ __forceinline__ A d_input(A x, A t, const LossArgs<A>& a) {
        return -(pass(x, t, a) * t);
    }
    template <typename A>
    static __device__ __forceinline__ A d_target(A x, A t, const LossArgs<A>& a) {
        return -(pass(x, t, a) * x);
    }
};

}  // namespace cupyloss
