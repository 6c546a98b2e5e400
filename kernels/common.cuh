// Shared device helpers for every cupyloss kernel family.
//
//   acc_t<T>          the accumulator type: float for half/bfloat16/float, double for double
//   load_acc / store  conversions between storage and accumulator types
//   Vec<T, N>         an N-element, N*sizeof(T)-aligned register vector for 16-byte accesses
//   widen             a vector's values in the accumulator type
//   store_any         VEC rounded values stored as one 16- or 8-byte vector or element by element
//   prefetch_l2       a 128-byte line fetched into L2 ahead of its loads (a hint)
//   IntDiv            division of 64-bit indices by a run-time constant via multiply-high
//   Geometry<N>       the coalesced broadcast shape and N operands' strides, passed by value
//   Compensated       a per-thread running sum with Kahan's error compensation
//   block_sum         deterministic block-wide sum (fixed shuffle tree, then fixed smem order)
//   block_sums        NQ such sums at once, by the same trees, sharing their barriers
//   grid_sum_out      deterministic grid-wide sums written to 0-d outputs in the same launch
//   finish_ratio      the same for a 0-d L / D whose divisor D may itself be a grid sum
//
// Indices are 64-bit everywhere (long long / unsigned long long).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef CUPYLOSS_MAX_DIMS
#define CUPYLOSS_MAX_DIMS 8
#endif

namespace cupyloss {

template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

// q = floor(n / d) for 1 <= d < 2^63, n < 2^63 (Granlund & Montgomery 1994, fig. 4.1):
//   l = ceil(log2 d), m = floor(2^64 (2^l - d) / d) + 1,
//   t = mulhi(m, n), q = (t + ((n - t) >> s1)) >> s2 with s1 = min(l, 1), s2 = max(l - 1, 0).
// The host computes (m, s1, s2) in cupyloss/_launch.py:divider and tests it against '//'.
struct IntDiv {
    unsigned long long magic;
    long long shift1;
    long long shift2;
    long long divisor;

    __device__ __forceinline__ unsigned long long div(unsigned long long n) const {
        unsigned long long t = __umul64hi(magic, n);
        return (t + ((n - t) >> shift1)) >> shift2;
    }
};

// Two values rounded to a 16-bit pair by one conversion (cvt.rn.bf16x2 / f16x2 on sm_80 and
// later): bitwise the two single conversions, in half the instructions.
__device__ __forceinline__ void round_pair(__nv_bfloat16* d, float lo, float hi) {
    *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(lo, hi);
}
__device__ __forceinline__ void round_pair(__half* d, float lo, float hi) {
    *reinterpret_cast<__half2*>(d) = __floats2half2_rn(lo, hi);
}

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// The VEC values of v in the accumulator type.  bfloat16 pairs are taken apart with a shift and
// a mask a 32-bit word (its bits are a float's upper half), where element-wise extraction takes
// three instructions a pair.  Used where it was measured to help (cross_entropy's loops); jsd's
// loop, widened the same way, lost (docs/tuning.md, "The kernels' code").
template <typename T, int VEC>
__device__ __forceinline__ void widen(const Vec<T, VEC>& v, acc_t<T> (&out)[VEC]) {
    if constexpr (IsBf16<T>::value && VEC % 2 == 0) {
        const unsigned int* w = reinterpret_cast<const unsigned int*>(v.v);
        #pragma unroll
        for (int e = 0; e < VEC; e += 2) {
            out[e] = __uint_as_float(w[e / 2] << 16);
            out[e + 1] = __uint_as_float(w[e / 2] & 0xffff0000u);
        }
    } else {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = to_acc(v.v[e]);
    }
}

// VEC values rounded to T and stored at p: one streaming store of VEC * sizeof(T) bytes (16, or 8
// for a float32 vector's values rounded to 16 bits) when `vec` (p aligned to that size), else
// element by element.  16-bit values are rounded in pairs.
template <typename T, int VEC>
__device__ __forceinline__ void store_any(T* p, const acc_t<T> (&g)[VEC], bool vec) {
    Vec<T, VEC> v;
    if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
        #pragma unroll
        for (int e = 0; e < VEC; e += 2) round_pair(v.v + e, g[e], g[e + 1]);
    } else {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) v.v[e] = from_acc<T>(g[e]);
    }
    if (vec) {  // p aligned to the vector's size: 16 bytes, or 8 (four 16-bit values)
        if constexpr (sizeof(v) == 16) {
            __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
        } else {
            static_assert(sizeof(v) == 8, "store_any stores 16- or 8-byte vectors");
            __stcs(reinterpret_cast<int2*>(p), *reinterpret_cast<const int2*>(&v));
        }
    } else {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = v.v[e];
    }
}

// Fetch the 128-byte line of p into L2; only a hint, nothing waits for it, and a line evicted
// before its use is read again from DRAM.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Whether p may be read or written as 16-byte vectors.
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// The broadcast shape after merging dimensions that every operand walks contiguously, innermost
// last.  stride[k][d] is operand k's stride in elements along dim d (0 where it broadcasts).
// Operands are a loss's N - 1 array arguments in order, then the elementwise grad_output.
// Every field is 64-bit so that the host mirror (_launch.geometry_dtype) has no padding.
template <int N>
struct Geometry {
    long long ndim;
    IntDiv dim[CUPYLOSS_MAX_DIMS];
    long long stride[N][CUPYLOSS_MAX_DIMS];

    // Element offsets of flat (C-order) index i in every operand.
    __device__ __forceinline__ void offsets(long long i, long long (&off)[N]) const {
        #pragma unroll
        for (int k = 0; k < N; ++k) off[k] = 0;
        unsigned long long rest = (unsigned long long)i;
        for (int d = (int)ndim - 1; d >= 0; --d) {
            unsigned long long q = d > 0 ? dim[d].div(rest) : 0ull;
            long long r = (long long)(rest - q * (unsigned long long)dim[d].divisor);
            #pragma unroll
            for (int k = 0; k < N; ++k) off[k] += r * stride[k][d];
            rest = q;
        }
    }
};

// |v|, +0 for -0 (as torch's abs), NaN for NaN.  A select (v < 0 ? -v : v) keeps -0 and costs a
// compare and a select where this is an operand modifier of the instruction that uses it.
__device__ __forceinline__ float absv(float v) { return fabsf(v); }
__device__ __forceinline__ double absv(double v) { return fabs(v); }

// a * b + c rounded once, in every context (the compiler's own contraction depends on how the
// product is used).
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
// A software pipeline over positions p, p + step, ... while more(p): the loads of the next
// position, load(q, next), are issued before the arithmetic of this one, visit(p, cur), so they
// are in flight while it runs.  Buf holds one position's loads (arrays in a struct, so that it
// copies); each position is visited once and in order, as an unpipelined loop would.  Returns
// the first position past the pipeline.
template <typename Buf, typename P, typename More, typename Load, typename Visit>
__device__ __forceinline__ P pipelined(P p, const P step, More&& more, Load&& load,
                                       Visit&& visit) {
    Buf next;
    if (more(p)) load(p, next);
    #pragma unroll 1
    for (; more(p); p += step) {
        Buf cur = next;
        if (more(p + step)) load(p + step, next);
        visit(p, cur);
    }
    return p;
}

// A product rounded on its own, never contracted into an FMA with a later add: a tie such as
// `margin - x*t == 0` must be decided as torch decides it.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
// A sum rounded on its own, likewise: neither operand's product is fused into it.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
// 1 / v correctly rounded for v in [1, 2] (or NaN): the bits of __frcp_rn, branch-free.
// __frcp_rn is the hardware's approximate reciprocal and one Newton step (r + r (1 - v r), both
// FMAs), behind a test of v's exponent that sends v near the ends of the float range to an
// out-of-line slow path; in [1, 2] the test never sends it there, but the branch and the call
// stay in the loop, where they split the logistic losses' gradients into blocks the compiler
// neither interleaves nor moves a broadcast operand's work out of.  Here the fast path alone
// (tests/test_common_gpu.py compares it with __frcp_rn on every float in [1, 2]).
__device__ __forceinline__ float rcp_unit_rn(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return __fmaf_rn(r, -__fmaf_rn(v, r, -1.0f), r);
}
__device__ __forceinline__ double rcp_unit_rn(double v) { return __drcp_rn(v); }
// tanh z for |z| < 0.6: z + z^3 Q(z^2), Q of degree 4 fitted to (tanh z - z) / z^3 for
// relative error.
__device__ __forceinline__ float tanh_poly(float z) {
    const float u = z * z;
    float q = -5.984960590e-03f;
    q = __fmaf_rn(q, u, 2.086814865e-02f);
    q = __fmaf_rn(q, u, -5.380356684e-02f);
    q = __fmaf_rn(q, u, 1.333213300e-01f);
    q = __fmaf_rn(q, u, -3.333330452e-01f);
    return __fmaf_rn(q, u * z, z);
}
// tanh d, branch-free in float: tanh_poly for z = |d| < 0.6, else 1 - 2 e / (1 + e) with
// e = exp(-2 z); 1 + e is in [1, 2], so its reciprocal is rcp_unit_rn's.  tanhf branches on |d|,
// which keeps its work apart from the rest of a loop (log_cosh's value shares e with it).
// Against float64 over 12M d (H100): at most 1.69 ulp, mean signed error within 0.013 ulp in each
// set (tanhf: 1.81 ulp, and +0.60 ulp on average for d near 0.5; the runs: docs/tuning.md, "The
// functors' code").  Double: tanh.
__device__ __forceinline__ float tanh_bf(float d) {
    const float z = absv(d);
    const float e = expf(-2.0f * z);
    const float near0 = tanh_poly(z);
    const float far = __fmaf_rn(-2.0f * e, rcp_unit_rn(1.0f + e), 1.0f);
    return copysignf(z < 0.6f ? near0 : far, d);
}
__device__ __forceinline__ double tanh_bf(double d) { return tanh(d); }
// tanh_bf with e^(-2z) from the ex2 unit (ex2.approx of -2 z log2 e) and 1 / (1 + e) from the
// approximate reciprocal: nine instructions fewer than expf and rcp_unit_rn, at most 1.81 ulp
// against float64 (tanhf: 1.81) and +0.07 ulp on average for d in (0.45, 0.75) (tanhf +0.18,
// tanh_bf 0.01; H200, tests/test_common_gpu.py).  The softcap's tanh, twice in every logit of
// cross entropy, where it bounds the kernel by instructions.  Double: tanh.
__device__ __forceinline__ float tanh_ap(float d) {
    const float z = absv(d);
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -2.8853900817779268f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    const float near0 = tanh_poly(z);
    const float far = __fmaf_rn(-2.0f * e, r, 1.0f);
    return copysignf(z < 0.6f ? near0 : far, d);
}
__device__ __forceinline__ double tanh_ap(double d) { return tanh(d); }
// tanh_ap of each of N values, bitwise: the polynomial for all, then the exponential's form
// only if one of them has |d| >= 0.6 (or is NaN).  Logits capped at c below 0.6 c in magnitude,
// most of a real model's, then cost the polynomial alone, about half of tanh_ap's instructions.
// The polynomial is odd and its roundings symmetric, so tanh_poly(d) is copysign(tanh_poly(|d|),
// d) bit for bit but at d = -0, where it gives +0 (-0 + +0): only the exponential's form takes
// d's sign afterwards.  (The softcap's sums, lse and gradients are the same for either zero.)
template <int N>
__device__ __forceinline__ void tanh_ap_each(float (&d)[N]) {
    bool far = false;
    #pragma unroll
    for (int i = 0; i < N; ++i) far |= !(absv(d[i]) < 0.6f);
    float t[N];
    #pragma unroll
    for (int i = 0; i < N; ++i) t[i] = tanh_poly(d[i]);
    if (far) {
        #pragma unroll
        for (int i = 0; i < N; ++i) {
            const float z = absv(d[i]);
            if (!(z < 0.6f)) {
                float e, r;
                asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -2.8853900817779268f));
                asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
                t[i] = copysignf(__fmaf_rn(-2.0f * e, r, 1.0f), d[i]);
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < N; ++i) d[i] = t[i];
}
template <int N>
__device__ __forceinline__ void tanh_ap_each(double (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) d[i] = tanh(d[i]);
}

// A running sum that carries the rounding error of each addition into the next (Kahan's
// compensated summation): n additions in sequence lose O(eps) instead of O(n eps) of the
// magnitude they add up.  The compensation is dropped once the sum is not finite, so an inf
// stays inf (instead of inf - inf = NaN) and a NaN stays NaN.  Plain adds and subtracts, so
// FMA contraction cannot reassociate them; `add` lets the compiler fuse a v that is a product
// into the first subtraction, `add_rounded` rounds v on its own first (add_rn), so that kernel
// instantiations the compiler contracts differently add the same v.
template <typename A>
struct Compensated {
    A sum = A(0);
    A c = A(0);   // minus the low-order part lost so far
    __device__ __forceinline__ void add(A v) { add_y(v - c); }
    __device__ __forceinline__ void add_rounded(A v) { add_y(add_rn(v, -c)); }
    __device__ __forceinline__ void add_y(A y) {  // y = v - c
        const A t = sum + y;
        c = isfinite(t) ? (t - sum) - y : A(0);
        sum = t;
    }
    __device__ __forceinline__ A value() const { return sum - c; }
    // The same in double, without the last rounding: what a wider sum across threads takes.
    __device__ __forceinline__ double wide() const { return double(sum) - double(c); }
};

// Deterministic sum over the block: a fixed butterfly within each warp, then warp 0 adds the
// per-warp results in warp order.  `scratch` holds blockDim.x / 32 values.  Result valid in
// thread 0.  Every thread of the block must call it.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A total = A(0);
    if (warp == 0) {
        total = lane < nwarps ? scratch[lane] : A(0);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    }
    return total;
}

// Where block_sum's cross-warp values meet when the sum is carried in double: 32 warps at most.
__device__ __forceinline__ double* wide_scratch() {
    __shared__ double wide[32];
    return wide;
}

// block_sums' [NQ][32]: wide_scratch where NQ is 1 (no more static shared memory than before).
template <int NQ>
__device__ __forceinline__ double* sums_scratch() {
    __shared__ double wide[NQ * 32];
    return wide;
}
template <>
__device__ __forceinline__ double* sums_scratch<1>() { return wide_scratch(); }

// block_sum of NQ values at once, each by the same tree, the NQ trees sharing their barriers and
// their shuffles interleaved.  Results valid in thread 0.  Every thread of the block must call it.
template <int NQ>
__device__ __forceinline__ void block_sums(const double (&v)[NQ], double (&total)[NQ]) {
    double* scratch = sums_scratch<NQ>();  // [NQ][32]
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    double w[NQ];
    #pragma unroll
    for (int q = 0; q < NQ; ++q) w[q] = v[q];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        #pragma unroll
        for (int q = 0; q < NQ; ++q) w[q] += __shfl_xor_sync(0xffffffffu, w[q], o);
    }
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
        #pragma unroll
        for (int q = 0; q < NQ; ++q) scratch[q * 32 + warp] = w[q];
    }
    __syncthreads();
    #pragma unroll
    for (int q = 0; q < NQ; ++q) total[q] = 0.0;
    if (warp == 0) {
        #pragma unroll
        for (int q = 0; q < NQ; ++q) total[q] = lane < nwarps ? scratch[q * 32 + lane] : 0.0;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            #pragma unroll
            for (int q = 0; q < NQ; ++q) total[q] += __shfl_xor_sync(0xffffffffu, total[q], o);
        }
    }
}

// Grid-wide sums of per-thread values v[q], written as out[q][0] = from_acc(sum / div[q]) for
// every q whose out[q] is not null (null-ness is uniform across the grid).  Across threads and
// blocks the sums are carried in double: each thread's (compensated) value is exact in double,
// so the 0-d result carries about one rounding of its own type, not one per level of the tree.
// One block: straight from block_sum.  Several: each block writes its sum to
// partials[q * nblocks + block] (rounded to the accumulator type: the rounding errors of the
// partials are independent, so their sum stays far below one unit of the result); the block
// that draws the last ticket adds partials[q, 0..nblocks) in a fixed order (so the result does
// not depend on which block finished last).  atomicInc wraps the ticket from nblocks - 1 back
// to 0, so it is zero again for the next launch on the stream.  The only atomic is that integer
// ticket: the sums are bitwise reproducible.
template <typename T, int NQ>
__device__ __forceinline__ void grid_sum_out(const double (&v)[NQ], T* const (&out)[NQ],
                                             const double (&div)[NQ],
                                             acc_t<T>* __restrict__ partials,  // [NQ, nblocks]
                                             unsigned int* __restrict__ ticket,
                                             long long block, long long nblocks) {
    using A = acc_t<T>;
    bool any = false;
    #pragma unroll
    for (int q = 0; q < NQ; ++q) any |= out[q] != nullptr;
    if (!any) return;
    double total[NQ];
    block_sums(v, total);
    if (nblocks == 1) {
        #pragma unroll
        for (int q = 0; q < NQ; ++q)
            if (out[q] != nullptr && threadIdx.x == 0)
                out[q][0] = from_acc<T>(A(total[q] / div[q]));
        return;
    }
    if (threadIdx.x == 0) {
        #pragma unroll
        for (int q = 0; q < NQ; ++q)
            if (out[q] != nullptr) partials[q * nblocks + block] = A(total[q]);
    }
    __shared__ unsigned int is_last;
    if (threadIdx.x == 0) {
        __threadfence();  // publish this block's partials before taking a ticket
        is_last = atomicInc(ticket, (unsigned int)(nblocks - 1)) == (unsigned int)(nblocks - 1);
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Each thread adds partials j = threadIdx.x, + blockDim.x, ... in that order; LOADS of them
    // are loaded at once, for every q, before any is added (the loads are L2 round trips).
    constexpr int LOADS = 4;
    double acc[NQ];
    #pragma unroll
    for (int q = 0; q < NQ; ++q) acc[q] = 0.0;
    for (long long j = threadIdx.x; j < nblocks; j += LOADS * blockDim.x) {
        A got[NQ][LOADS];
        #pragma unroll
        for (int q = 0; q < NQ; ++q) {
            #pragma unroll
            for (int u = 0; u < LOADS; ++u) {
                const long long i = j + (long long)u * blockDim.x;
                // L2: written by other blocks
                got[q][u] = out[q] != nullptr && i < nblocks ? __ldcg(partials + q * nblocks + i)
                                                             : A(0);
            }
        }
        #pragma unroll
        for (int q = 0; q < NQ; ++q) {
            #pragma unroll
            for (int u = 0; u < LOADS; ++u)
                if (j + (long long)u * blockDim.x < nblocks) acc[q] += double(got[q][u]);
        }
    }
    block_sums(acc, total);
    #pragma unroll
    for (int q = 0; q < NQ; ++q)
        if (out[q] != nullptr && threadIdx.x == 0) out[q][0] = from_acc<T>(A(total[q] / div[q]));
}

// value[0] = L / D for a 0-d loss whose divisor may itself be a sum over the grid: L sums every
// thread's `num`; D is denom[0] when given, else the sum of every thread's `den` when
// `den_is_sum`, else `divisor`; with `zero_empty` a D of 0 gives 0 (else 0 / 0 = NaN).  The sums
// across threads and blocks are carried in double (as grid_sum_out).  Several blocks leave
// partials [2, nblocks]; the block that draws the last ticket adds them in block order.  Every
// thread of the block calls it.  acc_value: value holds the accumulator type, not T.
template <typename T>
__device__ __forceinline__ void finish_ratio(acc_t<T> num, acc_t<T> den, T* __restrict__ value,
                                             const acc_t<T>* __restrict__ denom,
                                             bool den_is_sum, bool zero_empty, double divisor,
                                             acc_t<T>* __restrict__ partials,
                                             unsigned int* __restrict__ ticket,
                                             bool acc_value = false) {
    using A = acc_t<T>;
    if (value == nullptr) return;
    double* wide = wide_scratch();
    __shared__ unsigned int is_last;
    const long long nblocks = gridDim.x;
    double l = block_sum(double(num), wide);
    double w = block_sum(double(den), wide);
    if (nblocks > 1) {
        if (threadIdx.x == 0) {
            partials[blockIdx.x] = A(l);
            partials[nblocks + blockIdx.x] = A(w);
            __threadfence();
            is_last = atomicInc(ticket, (unsigned int)(nblocks - 1))
                      == (unsigned int)(nblocks - 1);
        }
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        double pl = 0.0, pw = 0.0;
        for (long long j = threadIdx.x; j < nblocks; j += blockDim.x) {
            pl += double(__ldcg(partials + j));
            pw += double(__ldcg(partials + nblocks + j));
        }
        l = block_sum(pl, wide);
        w = block_sum(pw, wide);
    }
    if (threadIdx.x == 0) {
        const double d = denom != nullptr ? double(denom[0]) : den_is_sum ? w : divisor;
        const A v = zero_empty && d == 0.0 ? A(0) : A(l / d);
        if (acc_value) {
            reinterpret_cast<A*>(value)[0] = v;
        } else {
            value[0] = from_acc<T>(v);
        }
    }
}

}  // namespace cupyloss
