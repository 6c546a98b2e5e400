// Second stage of every deterministic reduction: fixed-order sums of per-block partials.
//
//   finalize   out_q = from_acc(sum_b partials[q, b] / divisor_q) for q = 0, 1, 2 (one block each)
//   sum_rows   out[k] = from_acc(sum_r ws[r, k]) (one thread per column, rows in order)
//
// No atomics: the order of every addition depends only on the sizes, so a run repeats bitwise.
#include "common.cuh"

namespace cupyloss {

// Block q reduces row q of partials and writes the 0-d result out_q (skipped when null).
// divisor is applied to row 0 only (n for mean, batch for batchmean, 1 otherwise; 0/0 gives the
// NaN that torch returns for the mean of an empty tensor).
template <typename T>
__global__ void __launch_bounds__(256) finalize(
        const acc_t<T>* __restrict__ partials,  // [3, nparts]
        const long long nparts,
        const double divisor,
        T* __restrict__ out0, T* __restrict__ out1, T* __restrict__ out2) {  // 0-d each, or null
    using A = acc_t<T>;
    extern __shared__ unsigned char smem_raw[];
    A* scratch = reinterpret_cast<A*>(smem_raw);  // [blockDim.x / 32]
    T* out = blockIdx.x == 0 ? out0 : (blockIdx.x == 1 ? out1 : out2);
    if (out == nullptr) return;  // uniform across the block
    const A* row = partials + (long long)blockIdx.x * nparts;
    A acc = A(0);
    for (long long j = threadIdx.x; j < nparts; j += blockDim.x) acc += row[j];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[0] = from_acc<T>(blockIdx.x == 0 ? acc / A(divisor) : acc);
}

// out[k] = sum over r of ws[r, k], r ascending.
template <typename T>
__global__ void __launch_bounds__(256) sum_rows(
        const acc_t<T>* __restrict__ ws,  // [rows, cols], contiguous
        const long long rows, const long long cols,
        T* __restrict__ out) {            // [cols]
    using A = acc_t<T>;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < cols; k += stride) {
        A acc = A(0);
        for (long long r = 0; r < rows; ++r) acc += ws[r * cols + k];
        out[k] = from_acc<T>(acc);
    }
}

}  // namespace cupyloss
