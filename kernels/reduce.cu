// Second stage of the reductions that produce arrays: fixed-order sums of per-block partials.
// (0-d results are finished inside the first kernel: grid_sum_out in common.cuh.)
//
//   sum_rows   out[k] = from_acc(sum_r ws[r, k]) (one thread per column, rows in order)
//
// No atomics: the order of every addition depends only on the sizes, so a run repeats bitwise.
#include "common.cuh"

namespace cupyloss {

// out[k] = sum over r of ws[r, k], r ascending, carried in double (rows can number in the
// 100,000s; the partials' own roundings are independent, so the result is within about one
// rounding of the exact sum of the partials).
template <typename T>
__global__ void __launch_bounds__(256) sum_rows(
        const acc_t<T>* __restrict__ ws,  // [rows, cols], contiguous
        const long long rows, const long long cols,
        T* __restrict__ out) {            // [cols]
    using A = acc_t<T>;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < cols; k += stride) {
        double acc = 0.0;
        for (long long r = 0; r < rows; ++r) acc += double(ws[r * cols + k]);
        out[k] = from_acc<T>(A(acc));
    }
}

}  // namespace cupyloss
