// Benchmark support, not a loss.
//
// hold_stream keeps its stream busy for `ns` nanoseconds of the GPU's global timer.  A timer
// launches it before recording its start event, so that the host enqueues the timed work while
// the GPU is still busy: the events then time the device's work alone, not the host's launch
// latency (the blocking-kernel method of NVIDIA's nvbench).
namespace cupyloss {

__global__ void hold_stream(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

}  // namespace cupyloss
