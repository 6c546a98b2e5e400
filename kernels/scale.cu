// Scale gradients that were computed in the forward pass by the upstream gradient, in place.
//
// The torch adapter (cupyloss/torch.py) computes a reduced loss and its gradients in one pass
// (value_and_grad with grad_output = 1).  In backward the upstream gradient g of the 0-d loss
// arrives as a device scalar; the chain rule needs
//   grad_input  = g * d loss / d input       grad_target = g * d loss / d target
// so each saved gradient is multiplied by g where it lies.  g is read here, on the device (the
// host never looks at it): when g == 1, the plain `loss.backward()`, every thread returns after
// that one load and no gradient byte is read or written.  Skipping is exact: x * 1 == x for
// every x, NaN and infinities included.
//
// a and b are contiguous; either may be empty (n == 0, pointer null).  VEC > 1 uses 16-byte
// loads and stores for both (the host picks it only when both pointers are 16-byte aligned);
// the last n % VEC elements of each go one at a time.
#include "common.cuh"

namespace cupyloss {

template <typename T, int VEC>
__device__ __forceinline__ void scale_span(T* __restrict__ p, const long long n,
                                           const acc_t<T> g, const long long start,
                                           const long long stride) {
    const long long vectors = VEC > 1 ? n / VEC : 0;  // VEC == 1: the loop below does all
    if constexpr (VEC > 1) {
        static_assert(sizeof(Vec<T, VEC>) == sizeof(int4), "vector accesses are 16 bytes");
        for (long long v = start; v < vectors; v += stride) {
            Vec<T, VEC> w = reinterpret_cast<Vec<T, VEC>*>(p)[v];
            #pragma unroll
            for (int j = 0; j < VEC; ++j) w.v[j] = from_acc<T>(to_acc(w.v[j]) * g);
            reinterpret_cast<Vec<T, VEC>*>(p)[v] = w;
        }
    }
    for (long long i = vectors * VEC + start; i < n; i += stride)
        p[i] = from_acc<T>(to_acc(p[i]) * g);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(256) scale_by_grad_output(
        const T* __restrict__ go,               // [] the upstream gradient of the 0-d loss
        T* __restrict__ a, const long long na,  // [na] input's gradient; null when na == 0
        T* __restrict__ b, const long long nb) {  // [nb] target's gradient; null when nb == 0
    using A = acc_t<T>;
    const A g = to_acc(go[0]);
    if (g == A(1)) return;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    scale_span<T, VEC>(a, na, g, start, stride);
    scale_span<T, VEC>(b, nb, g, start, stride);
}

// out[i] = src[i] rounded to T (float16 or bfloat16) for i < n, the float32 gradient of a chunk of
// logits rounded to the inputs' dtype before its matrix products (cupyloss/linear.py).  Eight
// elements a step: two 16-byte loads, one 16-byte store (both pointers 16-byte aligned, which
// the host checks); the last n % 8 one at a time.  Grid-stride, 64-bit indices.
template <typename T>
__global__ void __launch_bounds__(256) narrow(const float* __restrict__ src,
                                              T* __restrict__ out, const long long n) {
    static_assert(sizeof(Vec<T, 8>) == sizeof(int4), "8 narrow elements are 16 bytes");
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vectors = n / 8;
    for (long long v = start; v < vectors; v += stride) {
        const float4 lo = __ldcs(reinterpret_cast<const float4*>(src) + 2 * v);
        const float4 hi = __ldcs(reinterpret_cast<const float4*>(src) + 2 * v + 1);
        const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        Vec<T, 8> w;
        #pragma unroll
        for (int j = 0; j < 8; ++j) w.v[j] = from_acc<T>(f[j]);
        reinterpret_cast<Vec<T, 8>*>(out)[v] = w;
    }
    for (long long i = vectors * 8 + start; i < n; i += stride) out[i] = from_acc<T>(src[i]);
}

}  // namespace cupyloss

namespace cupyloss {

// A float32 sum held in two 16-bit halves (cupyloss/linear.py's split weight-gradient sum): hi[i]
// the top 16 bits of each float32's bit pattern, lo[i] the bottom 16, so that the pair is the
// float32 itself, bit for bit.  hi is the storage of the 16-bit result (the weight's gradient),
// lo a workspace: the sum holds half the bytes of a float32 array beside the result, and every
// addition is a float32 addition, as cuBLAS's beta = 1 would make it.
//
// split_add:    s = src[i] (+ the pair's float32 unless `first`), stored back into the halves.
// split_finish: the pair's float32 rounded to T (float16 or bfloat16, round to nearest even)
//               and written over hi[i]: the result in its dtype.
// Eight elements a step with 16-byte accesses where every pointer is 16-byte aligned (else one
// at a time), the last n % 8 one at a time.  Grid-stride, 64-bit indices; in place.
__device__ __forceinline__ float split_join(const unsigned short hi, const unsigned short lo) {
    return __uint_as_float((unsigned(hi) << 16) | unsigned(lo));
}

__global__ void __launch_bounds__(256) split_add(const float* __restrict__ src,
                                                 unsigned short* __restrict__ hi,
                                                 unsigned short* __restrict__ lo,
                                                 const long long n, const long long first) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool aligned = ((reinterpret_cast<unsigned long long>(src)
                           | reinterpret_cast<unsigned long long>(hi)
                           | reinterpret_cast<unsigned long long>(lo)) & 15) == 0;
    const long long vectors = aligned ? n / 8 : 0;
    for (long long v = start; v < vectors; v += stride) {
        const float4 a = __ldcs(reinterpret_cast<const float4*>(src) + 2 * v);
        const float4 b = __ldcs(reinterpret_cast<const float4*>(src) + 2 * v + 1);
        float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        Vec<unsigned short, 8> h = reinterpret_cast<const Vec<unsigned short, 8>*>(hi)[v];
        Vec<unsigned short, 8> l = reinterpret_cast<const Vec<unsigned short, 8>*>(lo)[v];
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float s = first ? f[j] : split_join(h.v[j], l.v[j]) + f[j];
            const unsigned bits = __float_as_uint(s);
            h.v[j] = (unsigned short)(bits >> 16);
            l.v[j] = (unsigned short)(bits & 0xffffu);
        }
        reinterpret_cast<Vec<unsigned short, 8>*>(hi)[v] = h;
        reinterpret_cast<Vec<unsigned short, 8>*>(lo)[v] = l;
    }
    for (long long i = vectors * 8 + start; i < n; i += stride) {
        const float s = first ? src[i] : split_join(hi[i], lo[i]) + src[i];
        const unsigned bits = __float_as_uint(s);
        hi[i] = (unsigned short)(bits >> 16);
        lo[i] = (unsigned short)(bits & 0xffffu);
    }
}

template <typename T>
__global__ void __launch_bounds__(256) split_finish(unsigned short* __restrict__ hi,
                                                    const unsigned short* __restrict__ lo,
                                                    const long long n) {
    static_assert(sizeof(T) == sizeof(unsigned short), "a 16-bit result");
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool aligned = ((reinterpret_cast<unsigned long long>(hi)
                           | reinterpret_cast<unsigned long long>(lo)) & 15) == 0;
    const long long vectors = aligned ? n / 8 : 0;
    for (long long v = start; v < vectors; v += stride) {
        const Vec<unsigned short, 8> h = reinterpret_cast<const Vec<unsigned short, 8>*>(hi)[v];
        const Vec<unsigned short, 8> l = reinterpret_cast<const Vec<unsigned short, 8>*>(lo)[v];
        Vec<T, 8> out;
        #pragma unroll
        for (int j = 0; j < 8; ++j) out.v[j] = from_acc<T>(split_join(h.v[j], l.v[j]));
        reinterpret_cast<Vec<T, 8>*>(hi)[v] = out;
    }
    for (long long i = vectors * 8 + start; i < n; i += stride)
        reinterpret_cast<T*>(hi)[i] = from_acc<T>(split_join(hi[i], lo[i]));
}

}  // namespace cupyloss
