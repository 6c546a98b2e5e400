// Helpers of the row kernels (rowwise.cu, rowclass.cu): the accumulator type's special values and
// math, class-index reads and 16-byte row loads.  One definition each; no kernels here.
#pragma once
#include "common.cuh"

// Rows whose class index was rejected (outside [0, C) and not ignore_index; in vocab-parallel
// cross entropy also a row whose ranks disagree on its class): their loss and gradient are NaN,
// and the row is counted here, once, by the thread that finishes it.  One counter per loaded
// module; the host adds them up (cupyloss.rejected_targets) where a training loop syncs anyway.
// An integer increment on the rare bad row (atomicInc, as the tickets): exact and order-free;
// a module's count wraps after 2^32 - 1 rows.
extern "C" __device__ unsigned int cupyloss_rejected_targets;
__device__ unsigned int cupyloss_rejected_targets = 0;

namespace cupyloss {

constexpr int ROW_SCRATCH = 64;  // accumulator slots of dynamic shared memory (_launch.ROW_SCRATCH)

__device__ __forceinline__ void count_rejected() {
    atomicInc(&cupyloss_rejected_targets, 0xffffffffu);
}

__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) {
    return __longlong_as_double((long long)0xfff0000000000000ull);
}
__device__ __forceinline__ float quiet_nan(float) { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ double quiet_nan(double) {
    return __longlong_as_double(0x7ff8000000000000ll);
}
__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
__device__ __forceinline__ float amax(float a, float b) { return fmaxf(a, b); }
// e^v of the softmax terms: float through exp2f (the ex2 unit: relative error about 2^-22, plus
// the one rounding of v * log2 e), double exactly.  Once per element on every pass, so it
// decides how much arithmetic hides under the memory traffic.
__device__ __forceinline__ float fexp(float v) { return exp2f(v * 1.4426950408889634f); }
__device__ __forceinline__ double fexp(double v) { return exp(v); }
// e^v where the result only enters a row's softmax state (the sum s and its rescalings): the ex2
// unit with subnormal results (and arguments) flushed to 0.  A state's s is at least 1 (its max's
// own term), so a flushed term, below 2^-126, leaves it unchanged; the flush saves the subnormal
// handling of exp2f (a compare and two predicated multiplies an element on sm_90, about 7% of the
// bfloat16 value_and_grad at 8192 x 128256 on an H100).  The gradient's p keeps fexp: flushing it
// too (8% more) would give 0 where torch gives a subnormal gradient.
__device__ __forceinline__ float ex2_ftz(float v) {  // 2^v, subnormals flushed
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ float fexp_sum(float v) { return ex2_ftz(v * 1.4426950408889634f); }
__device__ __forceinline__ double fexp_sum(double v) { return exp(v); }
// fexp_sum(z - m) of a 16-bit logit z as one fused multiply-add, nm = -m log2 e formed once for
// many z: its one rounding (2^-24 of |m| log2 e) is far below a 16-bit logit's own, and an
// element costs one instruction less.  -inf, inf and NaN give what fexp_sum(z - m) gives.
__device__ __forceinline__ float fexp_sum_from(float z, float nm) {
    return ex2_ftz(fmaf(z, 1.4426950408889634f, nm));
}
__device__ __forceinline__ double amax(double a, double b) { return fmax(a, b); }

// Element i of a loss-shaped array (per-row losses, grad_output) held as T, or as the
// accumulator type when `acc` (a float32 loss of 16-bit logits, as torch's autocast returns).
template <typename T>
__device__ __forceinline__ acc_t<T> read_io(const T* p, long long i, bool acc) {
    return acc ? reinterpret_cast<const acc_t<T>*>(p)[i] : to_acc(p[i]);
}
template <typename T>
__device__ __forceinline__ void write_io(T* p, long long i, acc_t<T> v, bool acc) {
    if (acc) {
        reinterpret_cast<acc_t<T>*>(p)[i] = v;
    } else {
        p[i] = from_acc<T>(v);
    }
}

template <typename T>
__device__ __forceinline__ long long read_index(const void* p, long long off, bool idx64) {
    return idx64 ? static_cast<const long long*>(p)[off]
                 : (long long)static_cast<const int*>(p)[off];
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load16(const T* p, bool keep) {
    const int4 raw = keep ? __ldcg(reinterpret_cast<const int4*>(p))
                          : __ldcs(reinterpret_cast<const int4*>(p));
    return *reinterpret_cast<const Vec<T, VEC>*>(&raw);
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_any(const T* p, bool vec) {
    if (vec) return load16<T, VEC>(p, false);
    Vec<T, VEC> v;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = p[e];
    return v;
}

}  // namespace cupyloss
