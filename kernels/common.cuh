// Shared device helpers for every cupyloss kernel family.
//
//   acc_t<T>          the accumulator type: float for half/bfloat16/float, double for double
//   load_acc / store  conversions between storage and accumulator types
//   Vec<T, N>         an N-element, N*sizeof(T)-aligned register vector for 16-byte accesses
//   IntDiv            division of 64-bit indices by a run-time constant via multiply-high
//   Geometry          the coalesced broadcast shape and each operand's strides, passed by value
//   block_sum         deterministic block-wide sum (fixed shuffle tree, then fixed smem order)
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

// The broadcast shape after merging dimensions that every operand walks contiguously, innermost
// last.  stride[k][d] is operand k's stride in elements along dim d (0 where it broadcasts).
// Operand order: 0 = input, 1 = target, 2 = elementwise grad_output.  Every field is 64-bit so
// that the host mirror (a NumPy structured scalar) has no padding to get wrong.
struct Geometry {
    long long ndim;
    IntDiv dim[CUPYLOSS_MAX_DIMS];
    long long stride[3][CUPYLOSS_MAX_DIMS];

    // Element offsets of flat (C-order) index i in operands 0 and 1 (and 2 when `with_go`).
    __device__ __forceinline__ void offsets(long long i, long long off[3]) const {
        off[0] = off[1] = off[2] = 0;
        unsigned long long rest = (unsigned long long)i;
        for (int d = (int)ndim - 1; d >= 0; --d) {
            unsigned long long q = d > 0 ? dim[d].div(rest) : 0ull;
            long long r = (long long)(rest - q * (unsigned long long)dim[d].divisor);
            off[0] += r * stride[0][d];
            off[1] += r * stride[1][d];
            off[2] += r * stride[2][d];
            rest = q;
        }
    }
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

}  // namespace cupyloss
