// Benchmark support, not a loss.
//
// hold_stream keeps its stream busy for `ns` nanoseconds of the GPU's global timer.  A timer
// launches it before recording its start event, so that the host enqueues the timed work while
// the GPU is still busy: the events then time the device's work alone, not the host's launch
// latency (the blocking-kernel method of NVIDIA's nvbench).
//
// streams<R, W> is the plainest kernel of a read/write mix: R float32 arrays read and W written,
// 16-byte vectors, STEPS grid-stride steps at once (all loads issued before any use), no
// sums, no cache hints.  A grid that covers the arrays in one pass gives each block one tile;
// a smaller one walks them grid-stride.  bench_bandwidth times it against cudaMemcpy: what the
// card allows for that mix, and what each schedule leaves of it.
namespace cupyloss {

__global__ void hold_stream(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}


template <int R, int W>
__global__ void streams(const float4* __restrict__ a, const float4* __restrict__ b,
                        float4* __restrict__ c, float4* __restrict__ d, long long n) {
    constexpr int STEPS = 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x * STEPS + threadIdx.x; i < n;
         i += stride * STEPS) {
        float4 x[STEPS], y[STEPS];
        #pragma unroll
        for (int u = 0; u < STEPS; ++u) {
            const long long j = i + (long long)u * blockDim.x;
            if (j < n) {
                x[u] = a[j];
                if (R > 1) y[u] = b[j];
            }
        }
        #pragma unroll
        for (int u = 0; u < STEPS; ++u) {
            const long long j = i + (long long)u * blockDim.x;
            if (j >= n) continue;
            float4 v = x[u];
            if (R > 1) v = make_float4(v.x * y[u].x, v.y * y[u].y, v.z * y[u].z, v.w * y[u].w);
            if (W > 0) c[j] = v;
            if (W > 1) d[j] = make_float4(x[u].x - y[u].x, x[u].y - y[u].y, x[u].z - y[u].z,
                                          x[u].w - y[u].w);
            if (W == 0) acc += v.x + v.y + v.z + v.w;
        }
    }
    if (W == 0 && acc == -1.0f) c[0] = make_float4(acc, acc, acc, acc);  // keeps the loads
}

}  // namespace cupyloss
