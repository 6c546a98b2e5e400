// Second stage of the reductions that produce arrays: fixed-order sums of per-chunk partials,
// for the launches that have no tickets to finish them themselves (more column blocks or output
// groups than _pointwise._COL_TICKETS).  (0-d results are finished inside the first kernel:
// grid_sum_out in common.cuh.)
//
//   sum_chunks   out[k] = from_acc(sum_c ws[c, k]) in double, one warp per column
//
// The first stage (pointwise_rows, pointwise_reduce) leaves [chunks, cols] float64 partials,
// where chunks is bounded by the device's resident warps (_launch.reduce_launch, rows_launch),
// not by the size of the tensor summed.  No atomics: the order of every addition depends only
// on the sizes, so a run repeats bitwise.
#include "common.cuh"

namespace cupyloss {

// Lane l of the warp of column k adds ws[l, k], ws[l + 32, k], ... in order, then the 32 lane
// sums meet in a fixed butterfly.  Each partial is already a compensated sum carried in double,
// so plain double additions lose nothing that the final rounding to T would show.
template <typename T>
__global__ void __launch_bounds__(256) sum_chunks(
        const double* __restrict__ ws,  // [chunks, cols], contiguous
        const long long chunks, const long long cols,
        T* __restrict__ out) {          // [cols]
    using A = acc_t<T>;
    const long long lane = threadIdx.x & 31;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long k = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < cols;
         k += nwarps) {  // uniform across the warp
        double acc = 0.0;
        for (long long c = lane; c < chunks; c += 32) acc += ws[c * cols + k];
        #pragma unroll
        for (int b = 16; b > 0; b >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, b);
        if (lane == 0) out[k] = from_acc<T>(A(acc));
    }
}

}  // namespace cupyloss
