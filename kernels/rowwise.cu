// Row-wise losses: cross entropy and nll_loss along a class axis, the loss and the gradient of the
// logits from one read of the logits.
//
// One row is the C class scores of one sample (or of one spatial position of a sample).  With
// logits x_c, class weights w_c (1 without a weight), label smoothing eps and z-loss scale zs:
//
//   z_c = softcap * tanh(x_c / softcap) with a softcap, else x_c;   dz_c/dx_c = 1 - (z_c/softcap)^2
//   (x_c / softcap and z_c / softcap taken as products with 1 / softcap, within an ulp of the
//   quotients; tanh as tanh_ap)
//   M = max_c z_c,   S = sum_c exp(z_c - M),   lse = M + log S,   p_c = exp(z_c - lse)
//
// class-index target y (ignored when y == ignore_index: loss 0, gradient 0):
//   loss = (1 - eps) w_y (lse - z_y) + (eps / C) sum_c w_c (lse - z_c) + zs lse^2
//   dloss/dz_c = K p_c - (1 - eps) w_y [c == y] - (eps / C) w_c,
//                K = (1 - eps) w_y + (eps / C) sum_c w_c + 2 zs lse
// probability target t_c, with t'_c = (1 - eps) t_c + eps / C and u_c = w_c t'_c:
//   loss = sum_c u_c (lse - z_c) + zs lse^2
//   dloss/dz_c = K p_c - u_c,  K = sum_c u_c + 2 zs lse;   dloss/dt_c = (1 - eps) w_c (lse - z_c)
// nll_loss (x holds log-probabilities; no softmax, no smoothing, no softcap):
//   loss = -w_y x_y,   dloss/dx_c = -w_y [c == y]
// A class index outside [0, C) that is not ignore_index is never used as an address: the row's
// weight w_y is NaN, so its loss and its whole gradient row are NaN (and a 'mean' over summed
// weights is NaN).
//
// A row's softmax state is the tuple (m, s, a, b, t) over the elements seen so far:
//   m = max z,  s = sum exp(z - m),  a = sum u (m - z),  b = sum u,  t = z_y (one contributor)
// so that sum_c u_c (lse - z_c) = b log S + a.  Every term of a and of log S is >= 0: nothing
// cancels, however large lse and z are.  States of disjoint parts merge exactly, as online softmax:
//   M = max(m1, m2),  s = s1 e^(m1 - M) + s2 e^(m2 - M),  a = (a1 + b1 (M - m1)) + (a2 + b2 (M - m2))
// The merge is symmetric bitwise, so the shuffle butterflies leave every lane the same state.  An
// element z = -inf adds 0 to s and u * inf to a (0 * -inf is NaN, as torch's t * log_softmax is).
//
// Kernels:
//   cross_entropy_rows   classes contiguous.  A team of tpr threads (8..256, from the table in
//                        cupyloss/_launch.py) takes a row; each thread holds ROW_VECS 16-byte
//                        vectors of it in registers, so the gradient is written from registers
//                        after one read.  A row longer than a block's registers is split over k
//                        blocks of one cooperative launch that exchange their states through global
//                        memory (a counter per group, no float atomics), or, on sm_90 and later,
//                        of one thread block cluster that exchange them through distributed
//                        shared memory, one cluster barrier a row (cross_entropy_rows_cluster).
//                        A block's share beyond its registers' tile is kept in dynamic shared
//                        memory (`stash` tiles of blockDim.x * ROW_VECS vectors), so one read of
//                        the logits serves the loss and the gradient; past that (k and stash are
//                        capped) the remaining tiles are streamed twice.
//   cross_entropy_cols   any strides (the class axis at dim 1 of (N, C, d1, ...)): a thread per
//                        row; adjacent threads read adjacent positions, so loads coalesce.
//   class_weight_sum     the 'mean' divisor sum_r w_{y_r} over counted rows, a launch before a
//                        gradient launch that needs it (the gradient is scaled by it).
//   cross_entropy_slice_grad
//                        the gradient over a slice of the classes from each row's lse found
//                        before (the fused linear loss's low-memory plan, vocab-parallel
//                        cross entropy's backward).
//   cross_entropy_slice_stats
//                        the softmax state of a slice of each row's classes (vocab-parallel
//                        cross entropy: the per-row statistics its ranks exchange).
//   cross_entropy_combine
//                        each row's loss and lse from the states of all its slices.
// Indices are 64-bit; the 0-d loss is finished in the same launch (last-block ticket).
#include "common.cuh"
#include "rows.cuh"

namespace cupyloss {

enum : long long {
    ROW_INDEX64 = 1,      // class-index targets are int64 (else int32)
    ROW_PROB = 2,         // targets are probabilities shaped like the input
    ROW_NLL = 4,          // nll_loss: the input holds log-probabilities
    ROW_GO_DEVICE = 8,    // grad_output is read from go[0]
    ROW_GO_ROWS = 16,     // grad_output is read per row (reduction 'none')
    ROW_MEAN_W = 32,      // the 0-d loss is divided by the summed weights of the counted rows
    ROW_ACC_IO = 64,      // loss, value and grad_output are of the accumulator type, not T
                          // (16-bit logits under torch's autocast: a float32 loss)
    ROW_ITEMS32 = 128,    // class_weight_sum's num_items is int32 (else int64)
};

constexpr int ROW_VECS = 8;        // 16-byte vectors of a row a thread holds (_launch.ROW_VECS)
constexpr int ROW_BLOCK = 256;     // threads a block of every launch (_launch.BLOCK)
constexpr int ROW_FIELDS = 5;      // m, s, a, b, t
constexpr int SLICE_FIELDS = 6;    // a slice's state and its claim (slice_claim) on the row's class
constexpr int ROW_EXCHANGE = 8 * ROW_FIELDS;  // scratch slot of a cluster's exchange (after the
                                              // 8 warps' states of team_merge): [2][ROW_FIELDS]
// cross_entropy_rows variants (MODE), each holding only its own code, so each but the general one
// compiles in about a second: the class-index loss alone (no gradient code, half the vectors a
// tile, so twice the resident blocks), with its gradient, a softcap with label smoothing or
// probability targets (its tanh in every element triples the compile time), nll_loss (one
// element a row read; no softmax), class-index targets with label smoothing, probability
// targets, and class-index targets with a softcap (MODE_GRAD's loop and its tanh).
enum : int {
    MODE_FORWARD = 0, MODE_GRAD = 1, MODE_GENERAL = 2, MODE_NLL = 3, MODE_SMOOTH = 4,
    MODE_PROB = 5, MODE_CAP = 6
};


template <bool B>
struct Flag {   // a compile-time bool as an argument (a generic lambda's instance)
    static constexpr bool value = B;
};

template <typename A>
struct RowStat {
    A m, s, a, b, t;
};

template <typename A>
__device__ __forceinline__ RowStat<A> empty_stat() {
    return {neg_inf(A(0)), A(0), A(0), A(0), A(0)};
}

// s e^(m - M): nothing when s == 0 (an empty or all -inf part, whose m may be -inf like M).
template <typename A>
__device__ __forceinline__ A rescaled(A s, A m, A M) {
    return s == A(0) ? A(0) : s * fexp_sum(m - M);
}

// b (M - m): nothing when the part is empty or all -inf (its a already holds u * inf terms).
template <typename A>
__device__ __forceinline__ A shifted(A b, A m, A M) {
    return (b == A(0) || m == neg_inf(A(0))) ? A(0) : b * (M - m);
}

template <typename A>
__device__ __forceinline__ A exp_from(A z, A m) {
    return z == neg_inf(A(0)) ? A(0) : fexp_sum(z - m);
}

template <typename A>
__device__ __forceinline__ A dist_to(A m, A z) { return z == neg_inf(A(0)) ? -neg_inf(A(0)) : m - z; }

// TRACK false, for a variant whose a and b stay 0 (no per-class terms) and whose z_y is held by
// the row's first thread alone: only m and s merge, and a, b and t are x's.  Every merge of such
// a variant takes the first thread's state as x (team_merge, group_merge and cluster_merge merge
// in thread and member order), so t reaches the thread that forms the loss; where t may sit in
// any state (slices of a row), TRACK stays true.
template <bool TRACK = true, typename A>
__device__ __forceinline__ RowStat<A> merge(const RowStat<A>& x, const RowStat<A>& o) {
    RowStat<A> r;
    r.m = amax(x.m, o.m);
    r.s = rescaled(x.s, x.m, r.m) + rescaled(o.s, o.m, r.m);
    if constexpr (TRACK) {
        r.a = (x.a + shifted(x.b, x.m, r.m)) + (o.a + shifted(o.b, o.m, r.m));
        r.b = x.b + o.b;
        r.t = x.t + o.t;
    } else {
        r.a = x.a;
        r.b = x.b;
        r.t = x.t;
    }
    return r;
}

// Move the state's reference max to mb >= m.
template <typename A>
__device__ __forceinline__ void rebase(RowStat<A>& st, A mb) {
    st.s = rescaled(st.s, st.m, mb);
    st.a = st.a + shifted(st.b, st.m, mb);
    st.m = mb;
}

template <typename A>
__device__ __forceinline__ void push(RowStat<A>& st, A z, A u, bool track) {
    if (z > st.m) rebase(st, z);
    st.s += exp_from(z, st.m);
    if (track) {
        st.a += u * dist_to(st.m, z);
        st.b += u;
    }
}

// The state of lane ^ o (TRACK false: its m and s, what merge<false> reads of it).
template <bool TRACK = true, typename A>
__device__ __forceinline__ RowStat<A> shfl_xor(const RowStat<A>& v, int o) {
    if constexpr (!TRACK)
        return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o),
                A(0), A(0), A(0)};
    return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o),
            __shfl_xor_sync(0xffffffffu, v.a, o), __shfl_xor_sync(0xffffffffu, v.b, o),
            __shfl_xor_sync(0xffffffffu, v.t, o)};
}

template <typename A>
__device__ __forceinline__ void store_stat(A* p, const RowStat<A>& v) {
    p[0] = v.m; p[1] = v.s; p[2] = v.a; p[3] = v.b; p[4] = v.t;
}

template <typename A>
__device__ __forceinline__ RowStat<A> load_stat(const A* p) {
    return {p[0], p[1], p[2], p[3], p[4]};
}

template <typename A>
__device__ __forceinline__ RowStat<A> load_stat_cg(const A* p) {  // written by other blocks
    return {__ldcg(p), __ldcg(p + 1), __ldcg(p + 2), __ldcg(p + 3), __ldcg(p + 4)};
}

// The merged state of each team of tpr consecutive threads, in every thread of the team.  Every
// thread of the block calls it.  Within a warp a fixed butterfly; across the warps of a team the
// warps' states in warp order.  scratch: [8 warps][ROW_FIELDS].
template <bool TRACK = true, typename A>
__device__ __forceinline__ RowStat<A> team_merge(RowStat<A> v, int tpr, A* scratch) {
    const int width = tpr < 32 ? tpr : 32;
    for (int o = width >> 1; o > 0; o >>= 1) v = merge<TRACK>(v, shfl_xor<TRACK>(v, o));
    if (tpr <= 32) {
        __syncwarp();  // the team's loads of this row precede any lane's stores (in-place)
        return v;
    }
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) store_stat(scratch + warp * ROW_FIELDS, v);
    __syncthreads();
    const int per_team = tpr >> 5;
    const int first = warp / per_team * per_team;
    RowStat<A> r = load_stat(scratch + first * ROW_FIELDS);
    for (int w = first + 1; w < first + per_team; ++w)
        r = merge<TRACK>(r, load_stat(scratch + w * ROW_FIELDS));
    return r;
}

// The merged state of the k blocks that share a row (a cooperative launch, so all are resident).
// Block `member` publishes its state in exchange[parity][member], counts itself in *counter and
// waits until all k have, then every block merges the k states in member order: the same result
// in every block.  exchange is double-buffered by row parity: a block can be at most one row ahead
// of the slowest, so the buffer it writes was read by all.  `it` counts this group's rows.
template <bool TRACK = true, typename A>
__device__ __forceinline__ RowStat<A> group_merge(const RowStat<A>& v, A* exchange,
                                                  unsigned int* counter, int k, int member,
                                                  long long it) {
    A* slot = exchange + (it & 1) * k * ROW_FIELDS;
    if (threadIdx.x == 0) {
        store_stat(slot + member * ROW_FIELDS, v);
        __threadfence();
        atomicInc(counter, 0xffffffffu);  // + 1 (an integer count: no float atomics)
        const unsigned int target = (unsigned int)((it + 1) * k);
        while (*reinterpret_cast<volatile unsigned int*>(counter) < target) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    RowStat<A> r = load_stat_cg(slot);
    for (int j = 1; j < k; ++j) r = merge<TRACK>(r, load_stat_cg(slot + j * ROW_FIELDS));
    return r;
}

// Thread block clusters (sm_90 and later).  On other architectures the cluster kernels compile
// without their cluster shape and trap: the host never launches them there.
#if __CUDA_ARCH__ >= 900
#define CUPYLOSS_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
#else
#define CUPYLOSS_CLUSTER_DIMS(n)
#endif

// Every thread of the cluster arrives, then waits for all: shared-memory stores before it are
// seen by every block of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#else
    __trap();
#endif
}

// The value at p (in this block's shared memory) in the block of cluster rank `rank`.
template <typename A>
__device__ __forceinline__ A load_cluster(const A* p, unsigned int rank) {
    A v = A(0);
#if __CUDA_ARCH__ >= 900
    unsigned int local = (unsigned int)__cvta_generic_to_shared(p), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    if constexpr (sizeof(A) == 4) {
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    } else {
        asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(remote) : "memory");
    }
#else
    __trap();
#endif
    return v;
}

// The merged state of the KC blocks of a cluster that share a row: each publishes its state in
// its own shared memory (exchange[parity], double-buffered by row parity as group_merge's), the
// cluster synchronises once, and every block merges the KC states in rank order, as group_merge
// does (so both give bitwise the same state).  A block writes slot parity again only after the
// next row's barrier, which every block passes only once it has read this row's states.
template <typename A, int KC, bool TRACK = true>
__device__ __forceinline__ RowStat<A> cluster_merge(const RowStat<A>& v, A* exchange,
                                                    long long it) {
    A* slot = exchange + (it & 1) * ROW_FIELDS;
    if (threadIdx.x == 0) store_stat(slot, v);
    cluster_sync();
    auto state = [&](unsigned int j) -> RowStat<A> {
        return {load_cluster(slot, j), load_cluster(slot + 1, j), load_cluster(slot + 2, j),
                load_cluster(slot + 3, j), load_cluster(slot + 4, j)};
    };
    RowStat<A> r = state(0);
    #pragma unroll
    for (int j = 1; j < KC; ++j) r = merge<TRACK>(r, state(j));
    return r;
}

// What every row of a launch shares.
template <typename A>
struct RowArgs {
    bool prob, nll, idx64, smooth, track, zloss;
    A eps, one_minus_eps, eps_c, cap, inv_cap, zs;
    long long ignore_index, cols;
};

template <typename A>
__device__ __forceinline__ RowArgs<A> row_args(long long flags, long long ignore_index,
                                               double smoothing, double zscale, double softcap,
                                               long long cols) {
    RowArgs<A> ra;
    ra.prob = (flags & ROW_PROB) != 0;
    ra.nll = (flags & ROW_NLL) != 0;
    ra.idx64 = (flags & ROW_INDEX64) != 0;
    ra.eps = A(smoothing);
    ra.one_minus_eps = A(1) - ra.eps;
    ra.eps_c = ra.eps / A(cols);
    ra.smooth = smoothing != 0.0 && !ra.nll;
    ra.track = ra.prob || ra.smooth;
    ra.cap = A(softcap);
    ra.inv_cap = softcap > 0.0 ? A(1.0 / softcap) : A(0);
    ra.zs = A(zscale);
    ra.zloss = zscale != 0.0;
    ra.ignore_index = ignore_index;
    ra.cols = cols;
    return ra;
}

template <typename A>
__device__ __forceinline__ A zval_acc(A v, const RowArgs<A>& ra) {
    return ra.cap > A(0) ? ra.cap * tanh_ap(v * ra.inv_cap) : v;
}
template <typename T, typename A>
__device__ __forceinline__ A zval(T raw, const RowArgs<A>& ra) {
    return zval_acc(to_acc(raw), ra);
}
// zval_acc of a vector's values, bitwise (tanh_ap_each).
template <typename A, int VEC>
__device__ __forceinline__ void zval_each(A (&v)[VEC], const RowArgs<A>& ra) {
    if (!(ra.cap > A(0))) return;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] *= ra.inv_cap;
    tanh_ap_each(v);
    #pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] *= ra.cap;
}

// u_c: the weight of (lse - z_c) in the loss (w_c for smoothing, w_c t'_c for probabilities).
template <typename T, typename A>
__device__ __forceinline__ A elem_u(const T* __restrict__ weight, int c, A tv,
                                    const RowArgs<A>& ra) {
    const A w = weight != nullptr ? to_acc(weight[c]) : A(1);
    return ra.prob ? w * (ra.one_minus_eps * tv + ra.eps_c) : w;
}

// One row's target: the class index and its weight.
template <typename A>
struct RowTarget {
    long long y;
    bool ignored, oor;
    A wy;
};

// A row's target from its class index y.  The slice kernels read y a row ahead: a row's reads
// wait on whether it is ignored, and a load issued a row early hides the latency that one issued
// at the row's start exposes once a row (docs/tuning.md, "The kernels' code"; the rows kernel,
// whose rows are longer, measured the same either way).
template <typename T, typename A>
__device__ __forceinline__ RowTarget<A> target_of(long long y, const T* __restrict__ weight,
                                                  const RowArgs<A>& ra) {
    RowTarget<A> rt{-1, false, false, A(1)};
    if (ra.prob) return rt;
    rt.y = y;
    rt.ignored = rt.y == ra.ignore_index;
    rt.oor = !rt.ignored && (rt.y < 0 || rt.y >= ra.cols);
    rt.wy = rt.ignored ? A(0)
          : rt.oor ? quiet_nan(A(0))
          : weight != nullptr ? to_acc(weight[rt.y]) : A(1);
    return rt;
}

template <typename T, typename A>
__device__ __forceinline__ RowTarget<A> row_target(const void* tgt, long long off,
                                                   const T* __restrict__ weight,
                                                   const RowArgs<A>& ra) {
    return target_of<T, A>(ra.prob ? 0 : read_index<T>(tgt, off, ra.idx64), weight, ra);
}

// The class index of row `r` (at r * rs) if r < rows and targets are indices, else 0.
template <typename T, typename A>
__device__ __forceinline__ long long index_ahead(const void* tgt, long long r, long long rows,
                                                 long long rs, const RowArgs<A>& ra) {
    return !ra.prob && r < rows ? read_index<T>(tgt, r * rs, ra.idx64) : 0;
}

// A row's loss and the factors of its gradient, from its merged state.
template <typename A>
struct RowResult {
    A loss, lse, log_s, m, k, dz, g;   // dloss/dz_c = (k p_c - corr_c) + dz p_c
};

template <typename A>
__device__ __forceinline__ RowResult<A> finalize(const RowStat<A>& st, const RowTarget<A>& rt,
                                                 const RowArgs<A>& ra) {
    RowResult<A> o;
    o.m = st.m;
    o.log_s = lg(st.s);
    o.lse = st.m + o.log_s;
    o.g = A(0);
    const A z2 = ra.zloss ? ra.zs * o.lse * o.lse : A(0);
    o.dz = ra.zloss ? A(2) * ra.zs * o.lse : A(0);
    if (ra.nll) {
        o.loss = rt.ignored ? A(0) : -rt.wy * st.t;
        o.k = A(0);
    } else if (ra.prob) {
        o.loss = st.b * o.log_s + st.a + z2;
        o.k = st.b;
    } else {
        A loss = ra.one_minus_eps * rt.wy * (o.log_s + (st.m - st.t));
        A k = ra.one_minus_eps * rt.wy;
        if (ra.smooth) {
            loss += ra.eps_c * (st.b * o.log_s + st.a);
            k += ra.eps_c * st.b;
        }
        o.loss = rt.ignored ? A(0) : loss + z2;
        o.k = k;
    }
    return o;
}

// dloss/dz_c dz_c/dx_c times the row's upstream gradient g (o.g) of a counted cross-entropy row;
// p = e^(z_c - lse) (fexp, or `probs`); at_y: c is the row's target class; tv, w: t_c and w_c
// where used.
template <typename A>
__device__ __forceinline__ A grad_input(A p, A z, bool at_y, A tv, A w, const RowResult<A>& o,
                                        const RowTarget<A>& rt, const RowArgs<A>& ra) {
    A corr;
    if (ra.prob) {
        corr = w * (ra.one_minus_eps * tv + ra.eps_c);
    } else {
        corr = at_y ? ra.one_minus_eps * rt.wy : A(0);
        if (ra.smooth) corr += ra.eps_c * w;
    }
    // The z-loss term is added after k p - corr, which cancels (to 0 when p == 1 and one class
    // holds all the target's weight): kept apart, it keeps its own relative precision.
    A gz = o.g * ((o.k * p - corr) + o.dz * p);
    if (ra.cap > A(0)) {
        const A q = z * ra.inv_cap;
        gz *= A(1) - q * q;
    }
    return gz;
}

// p_c = e^(z_c - lse) of a vector's classes, bitwise as fexp gives them: the ex2 unit without
// exp2f's subnormal handling when no result can be subnormal (every scaled argument >= -126, as
// for any row whose logits span less than 87), else fexp.  Saves three instructions of about 16
// an element of the bfloat16 gradient.  FUSED (16-bit logits): the argument as fexp_sum_from's,
// z log2 e - lse log2 e in one instruction (one less an element).
template <bool FUSED, int VEC>
__device__ __forceinline__ void probs(const float (&z)[VEC], float lse, float (&p)[VEC]) {
    float v[VEC];
    float lo = 0.0f;
    const float nl = -lse * 1.4426950408889634f;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) {
        v[e] = FUSED ? fmaf(z[e], 1.4426950408889634f, nl) : (z[e] - lse) * 1.4426950408889634f;
        lo = fminf(lo, v[e]);  // a NaN argument is passed over: ex2 gives NaN either way
    }
    if (lo >= -126.0f) {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = ex2_ftz(v[e]);
    } else {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = exp2f(v[e]);
    }
}
template <bool FUSED, int VEC>
__device__ __forceinline__ void probs(const double (&z)[VEC], double lse, double (&p)[VEC]) {
    #pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = fexp(z[e] - lse);
}
// probs of 16-bit logits where no p can be subnormal: the ex2 form alone.
template <int VEC>
__device__ __forceinline__ void probs_normal(const float (&z)[VEC], float lse, float (&p)[VEC]) {
    const float nl = -lse * 1.4426950408889634f;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = ex2_ftz(fmaf(z[e], 1.4426950408889634f, nl));
}
template <int VEC>
__device__ __forceinline__ void probs_normal(const double (&z)[VEC], double lse,
                                             double (&p)[VEC]) {
    probs<false>(z, lse, p);
}

// The pairwise smaller of lo's and a vector's 16-bit values (two to a 32-bit word; a NaN passed
// over, as fminf), and the smaller of the pair at the end.  Other types: unused.
__device__ __forceinline__ unsigned min_word(unsigned a, unsigned b, __nv_bfloat16) {
    const __nv_bfloat162 r = __hmin2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}
__device__ __forceinline__ unsigned min_word(unsigned a, unsigned b, __half) {
    const __half2 r = __hmin2(*reinterpret_cast<const __half2*>(&a),
                              *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}
template <typename T, int VEC>
__device__ __forceinline__ unsigned min_words(unsigned lo, const Vec<T, VEC>& v) {
    if constexpr (sizeof(T) == 2) {
        const unsigned* w = reinterpret_cast<const unsigned*>(v.v);
        return min_word(lo, min_word(min_word(w[0], w[1], T()), min_word(w[2], w[3], T()), T()),
                        T());
    } else {
        return lo;
    }
}
template <typename T>
__device__ __forceinline__ float min_of_words(unsigned lo) {
    if constexpr (sizeof(T) == 2) {
        T a, b;
        a = *reinterpret_cast<const T*>(&lo);
        b = *(reinterpret_cast<const T*>(&lo) + 1);
        return fminf(to_acc(a), to_acc(b));
    } else {
        return 0.0f;
    }
}

// dloss/dt_c times g (probability targets).
template <typename A>
__device__ __forceinline__ A grad_target(A z, A w, const RowResult<A>& o, const RowArgs<A>& ra) {
    return o.g * ra.one_minus_eps * w * (o.log_s + dist_to(o.m, z));
}

// Fetch `vectors` 16-byte vectors from p into L2, a 128-byte line a thread of the block at a
// time (L2::evict_last instead changed nothing measurable).
__device__ __forceinline__ void prefetch_l2_span(const void* p, int vectors) {
    const char* b = static_cast<const char*>(p);
    for (long long o = (long long)threadIdx.x * 128; o < (long long)vectors * 16;
         o += (long long)blockDim.x * 128)
        prefetch_l2(b + o);
}

// The reference absorb's sum terms take from a state's max m: mref = m, 0 while m is -inf
// (z - mref is then -inf, not NaN, for z = -inf); for 16-bit logits -mref log2 e, the constant
// of fexp_sum_from, formed where m changes, not for every vector.
template <typename T, typename A>
__device__ __forceinline__ A sum_ref(A m) {
    const A mref = m == neg_inf(A(0)) ? A(0) : m;
    if constexpr (sizeof(T) == 2) return -mref * A(1.4426950408889634);
    else return mref;
}

// Add one 16-byte vector of a row (classes c0 .. c0 + VEC - 1) to the state: rebase on the
// vector's max if it is new, then add its terms.  tr: the row's probability targets (prob), read
// at the same classes.  ref: sum_ref<T>(st.m), kept up to date here for 16-bit logits.
template <typename T, typename A, int VEC>
__device__ __forceinline__ void absorb(RowStat<A>& st, A& ref, const Vec<T, VEC>& xv, int c0,
                                       const T* tr, bool t_vec, const T* __restrict__ weight,
                                       const RowArgs<A>& ra) {
    A za[VEC];
    widen(xv, za);
    zval_each(za, ra);
    A zmax = za[0];
    #pragma unroll
    for (int e = 1; e < VEC; ++e) zmax = amax(zmax, za[e]);
    if (zmax > st.m) {
        rebase(st, zmax);
        if constexpr (sizeof(T) == 2) ref = sum_ref<T>(st.m);
    }
    // The sum term e^(z - mref): fused for 16-bit logits (fexp_sum_from).  Float and double form
    // mref here: one register fewer across the row's loop (the float gradient variant's 80 are
    // all taken).
    const A mref = sizeof(T) == 2 ? A(0) : sum_ref<T>(st.m);
    auto term = [&](A z) {
        if constexpr (sizeof(T) == 2) return fexp_sum_from(z, ref);
        else return fexp_sum(z - mref);
    };
    if (ra.track && !ra.prob && weight == nullptr) {
        // u_c = 1 (label smoothing without class weights): the terms below with u = 1, bitwise,
        // in two instructions an element instead of five; m - z is dist_to's value wherever m
        // is finite, and m = -inf leaves only z = -inf, whose distance is +inf.
        const bool none = st.m == neg_inf(A(0));
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            st.s += term(za[e]);
            st.a += none ? -neg_inf(A(0)) : st.m - za[e];
        }
        st.b += A(VEC);
        return;
    }
    Vec<T, VEC> tv;
    if (ra.prob) tv = load_any<T, VEC>(tr + c0, t_vec);
    #pragma unroll
    for (int e = 0; e < VEC; ++e) {
        const A z = za[e];
        st.s += term(z);
        if (ra.track) {
            const A u = elem_u<T, A>(weight, c0 + e, ra.prob ? to_acc(tv.v[e]) : A(0), ra);
            st.a += u * dist_to(st.m, z);
            st.b += u;
        }
    }
}

// Classes contiguous: a team of tpr threads per row, or k blocks per row (see the file comment).
// Rows go to teams in a grid-stride loop that every thread of a block runs the same number of
// times (inactive teams take part in the block's merges).  MODE: see MODE_FORWARD.
// Indices within a row are 32-bit (cols < 2^31, checked on the host); row offsets are 64-bit.
// The parameters of every cross_entropy_rows kernel, one 64-bit word each, in this order:
//   x          [rows, cols]: row r at x + r * x_rs
//   tgt        int32/int64 [rows] at r * t_rs, or T probabilities [rows, cols], row r at r * t_rs
//   weight     [cols] or null
//   go         [rows] at r * go_rs, [1], or unused
//   denom      [1] summed weights for a 'mean' gradient, or null
//   tpr        threads per row: a power of two, 8..blockDim.x
//   k          blocks per row; > 1 only with tpr == blockDim.x (the cluster size in a cluster)
//   stash      tiles a block keeps in shared memory after the scratch; > 0 only with
//              tpr == blockDim.x
//   loss, lse  [rows] or null
//   gx         [rows, cols] of G at r * g_rs (may be x when G is T), or null
//   gt         [rows, cols] contiguous, or null
//   value      [1] or null;  partials: [2, gridDim.x] when value and gridDim.x > 1
//   sync       [gridDim.x / k] zeroed counters when k > 1 (cooperative launches only)
//   exchange   [gridDim.x / k, 2, k, ROW_FIELDS] when k > 1 (cooperative launches only)
#define CUPYLOSS_ROWS_PARAMS(T, G)                                                             \
    const T* x, const void* tgt, const T* __restrict__ weight, const T* __restrict__ go,       \
    const acc_t<T>* __restrict__ denom, const long long rows, const long long cols,            \
    const long long x_rs, const long long t_rs, const long long go_rs, const long long g_rs,   \
    const long long flags, const long long ignore_index, const double smoothing,               \
    const double zscale, const double softcap, const double go_value, const double grad_scale, \
    const long long tpr, const long long k, const long long stash, T* __restrict__ loss,       \
    acc_t<T>* __restrict__ lse, G* gx, T* __restrict__ gt, T* __restrict__ value,              \
    acc_t<T>* __restrict__ partials, unsigned int* __restrict__ ticket, const double divisor,  \
    unsigned int* __restrict__ sync, acc_t<T>* __restrict__ exchange
#define CUPYLOSS_ROWS_ARGS                                                                     \
    x, tgt, weight, go, denom, rows, cols, x_rs, t_rs, go_rs, g_rs, flags, ignore_index,       \
    smoothing, zscale, softcap, go_value, grad_scale, tpr, k, stash, loss, lse, gx, gt, value, \
    partials, ticket, divisor, sync, exchange

// A tile's vectors of one thread (NV of them, t vectors apart from vb; those from v1 on are
// outside the block's share) loaded into xv, and stored from xv to its kept copy (dst, one
// vector every ROW_BLOCK int4).
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_tile(Vec<T, VEC> (&xv)[NV], const T* src, long long step,
                                          int vb, int t, int v1, bool again) {
    #pragma unroll
    for (int i = 0; i < NV; ++i) {
        if (vb + i * t < v1) xv[i] = load16<T, VEC>(src + i * step, again);
    }
}

template <typename T, int VEC, int NV>
__device__ __forceinline__ void keep_tile(const Vec<T, VEC> (&xv)[NV], int4* dst, int vb, int t,
                                          int v1) {
    #pragma unroll
    for (int i = 0; i < NV; ++i) {
        if (vb + i * t < v1) dst[i * ROW_BLOCK] = *reinterpret_cast<const int4*>(&xv[i]);
    }
}

// What each variant of cross_entropy_rows compiles in (MODE: see MODE_FORWARD; KC > 1: a
// cluster of KC blocks a row), its policy: the phases below read these and nothing else of MODE.
template <typename T, int MODE, int KC>
struct RowPolicy {
    static constexpr bool PLAIN = MODE == MODE_FORWARD || MODE == MODE_GRAD;  // no per-class terms
    // a and b stay 0 and z_y sits in the row's first thread: merges of m and s alone (merge)
    static constexpr bool TRACK = !(PLAIN || MODE == MODE_NLL || MODE == MODE_CAP);
    static constexpr int VEC = 16 / sizeof(T);
    static constexpr int NV = MODE == MODE_FORWARD ? ROW_VECS / 2 : ROW_VECS;  // vectors a tile
    // gt (the target's gradient) is given only with probability targets (PROB_T): the other
    // variants with a gradient always have gx.
    static constexpr bool PROB_T = MODE == MODE_GENERAL || MODE == MODE_PROB;
    // The variants whose gradient is mostly one form, and 16-bit ones of them without a softcap,
    // which keep their vectors' smallest logit (both: see grad_vector).
    static constexpr bool DEFER = MODE == MODE_GRAD || MODE == MODE_CAP || MODE == MODE_SMOOTH;
    static constexpr bool ROW_MIN = DEFER && MODE != MODE_CAP && sizeof(T) == 2;
    // The plain gradient of a cluster's row takes its kept tiles' loads ahead (see row_load).
    static constexpr bool PIPE = MODE == MODE_GRAD && KC > 1;
};

// How a launch's threads share rows: teams of t threads (t a power of two), or k blocks a row.
struct RowTeam {
    int t, lane, kk, teams, team, member;
    long long unit, units;
    int span, span_log2;   // vectors of a tile (a power of two: a row's tiles by a shift)
    long long step;        // elements from a thread's vector to its next
};

// One row of a team: where it is, its target, and its share of the row as head scalars (up to
// the first 16-byte boundary), vectors and tail scalars; this block's share of the vectors is
// [v0, v1), the head goes to member 0, the tail to k - 1.
template <typename T, typename A>
struct RowPlace {
    long long r;
    bool active, read;
    const T* xr;
    const T* tr;
    RowTarget<A> rt;
    int h, nv, tail, v0, v1, ntiles, kept, c_tail;
    bool has_head, has_tail, t_vec;
};

template <typename T, int MODE, int VEC>
__device__ __forceinline__ RowPlace<T, acc_t<T>> row_place(
        long long r, long long rows, const T* x, long long x_rs, const void* tgt, long long t_rs,
        const T* __restrict__ weight, const acc_t<T>* lse, long long stash, int ncols,
        const RowTeam& tm, const RowArgs<acc_t<T>>& ra) {
    using A = acc_t<T>;
    RowPlace<T, A> p;
    p.r = r;
    p.active = r < rows;
    p.xr = x + (p.active ? r : 0) * x_rs;
    p.tr = ra.prob ? static_cast<const T*>(tgt) + (p.active ? r : 0) * t_rs : nullptr;
    p.rt = RowTarget<A>{-1, false, false, A(1)};
    if (p.active) p.rt = row_target<T, A>(tgt, r * t_rs, weight, ra);
    p.read = p.active && !ra.nll && !(p.rt.ignored && lse == nullptr);
    const int mis = (int)((reinterpret_cast<unsigned long long>(p.xr) & 15ull) / sizeof(T));
    p.h = mis ? min(ncols, VEC - mis) : 0;
    p.nv = (ncols - p.h) / VEC;
    p.tail = ncols - p.h - p.nv * VEC;
    const int cv = tm.kk == 1 ? p.nv : (p.nv + tm.kk - 1) / tm.kk;  // no division where k == 1
    p.v0 = min(p.nv, tm.member * cv);
    p.v1 = min(p.nv, p.v0 + cv);
    p.ntiles = (p.v1 - p.v0 + tm.span - 1) >> tm.span_log2;
    // Tiles 0 .. kept - 1 go to shared memory, the last stays in registers, the ones between
    // are read again from global memory for the gradient (kept in L2 meanwhile).
    p.kept = MODE == MODE_FORWARD ? 0 : min((int)stash, max(p.ntiles - 1, 0));
    p.has_head = tm.member == 0 && tm.lane < p.h;
    p.has_tail = tm.member == tm.kk - 1 && tm.lane < p.tail;
    p.c_tail = p.h + p.nv * VEC + tm.lane;
    p.t_vec = ra.prob && aligned16(p.tr + p.h);
    return p;
}

// The load phase: a row's share read once into its softmax state st, its last tile left in xv,
// its kept tiles in shared memory (held), its head and tail scalars in xh and xt, and (ROW_MIN)
// its vectors' smallest logits in lo2.
template <typename T, int MODE, int KC>
__device__ __forceinline__ void row_load(
        RowStat<acc_t<T>>& st, Vec<T, RowPolicy<T, MODE, KC>::VEC> (&xv)[RowPolicy<T, MODE, KC>::NV],
        T& xh, T& xt, unsigned& lo2, const RowPlace<T, acc_t<T>>& p, const RowTeam& tm,
        const T* __restrict__ weight, int4* held, const RowArgs<acc_t<T>>& ra) {
    using A = acc_t<T>;
    using P = RowPolicy<T, MODE, KC>;
    constexpr int VEC = P::VEC, NV = P::NV;
    const int lane = tm.lane, t = tm.t, span = tm.span, v0 = p.v0, v1 = p.v1, h = p.h;
    const int ntiles = p.ntiles, kept = p.kept;
    const T* xr = p.xr;
    const T* tr = p.tr;
    if (p.has_head) {
        xh = xr[lane];
        push(st, zval(xh, ra),
             ra.track ? elem_u<T, A>(weight, lane, ra.prob ? to_acc(tr[lane]) : A(0), ra)
                      : A(0), ra.track);
    }
    if (p.has_tail) {
        xt = xr[p.c_tail];
        push(st, zval(xt, ra),
             ra.track ? elem_u<T, A>(weight, p.c_tail, ra.prob ? to_acc(tr[p.c_tail]) : A(0),
                                     ra) : A(0), ra.track);
    }
    A ref = sum_ref<T>(st.m);
    // The kept tiles reach shared memory through registers: cp.async copies of all of a
    // row's tiles at once were slower (docs/tuning.md, "The kernels' code").
    if constexpr (P::PIPE) {
        auto fetch = [&](int ti) {
            const int vb = v0 + ti * span + lane;
            const bool again = MODE != MODE_FORWARD && ti >= kept && ti < ntiles - 1;
            load_tile(xv, xr + h + (long long)vb * VEC, tm.step, vb, t, v1, again);
        };
        auto keep = [&](int ti) {
            const int vb = v0 + ti * span + lane;
            keep_tile(xv, held + ti * NV * ROW_BLOCK + threadIdx.x, vb, t, v1);
        };
        // Adds tile ti up, from xv or (HELD) from its kept copy.
        auto add_tile = [&](int ti, auto from_held) {
            constexpr bool HELD = decltype(from_held)::value;
            const int vb = v0 + ti * span + lane;
            const int4* mine = held + ti * NV * ROW_BLOCK + threadIdx.x;
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int j = vb + i * t;
                if (j < v1) {
                    Vec<T, VEC> xi;
                    if constexpr (HELD)
                        *reinterpret_cast<int4*>(&xi) = mine[i * ROW_BLOCK];
                    else xi = xv[i];
                    absorb(st, ref, xi, h + j * VEC, tr, p.t_vec, weight, ra);
                    if constexpr (P::ROW_MIN) lo2 = min_words(lo2, xi);
                }
            }
        };
        // A kept tile, once stored, is added up from shared memory while the next
        // tile's loads are in flight; only the variants this pays for take it
        // (docs/tuning.md, "The kernels' code").
        if (ntiles > 0) fetch(0);
        for (int ti = 0; ti < ntiles; ++ti) {
            if (ti < kept) {
                keep(ti);
                if (ti + 1 < ntiles) fetch(ti + 1);
                add_tile(ti, Flag<true>{});
            } else {
                add_tile(ti, Flag<false>{});
                if (ti + 1 < ntiles) fetch(ti + 1);
            }
        }
    } else {
        // No lambdas here: with the ones above, the softcap's kernel took 114 registers
        // instead of 96.
        for (int ti = 0; ti < ntiles; ++ti) {
            const int vb = v0 + ti * span + lane;
            const bool again = MODE != MODE_FORWARD && ti >= kept && ti < ntiles - 1;
            load_tile(xv, xr + h + (long long)vb * VEC, tm.step, vb, t, v1, again);
            if (ti < kept)
                keep_tile(xv, held + ti * NV * ROW_BLOCK + threadIdx.x, vb, t, v1);
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                const int j = vb + i * t;
                if (j < v1) {
                    absorb(st, ref, xv[i], h + j * VEC, tr, p.t_vec, weight, ra);
                    if constexpr (P::ROW_MIN) lo2 = min_words(lo2, xv[i]);
                }
            }
        }
    }
}

// What a row's gradient phase writes with and to.
template <typename T, typename G>
struct GradRow {
    G* gr;              // the row's input gradient, or null
    T* gtr;             // the row's target gradient, or null
    bool g_vec, gt_vec; // they are 16-byte aligned from the head on
    int jy, ey;         // the target's vector among the row's (-1: none) and its place there
    acc_t<T> gk;        // a non-target element's g k p_c is gk p_c: one multiply an element
};

// A vector's gradient (classes from h + j VEC).  COMMON: the form of a row's vectors but the
// target's where none of its p is subnormal and the gradient row is 16-byte aligned (`common` in
// row_grad), and only that form's code.  For DEFER variants such rows take COMMON in the tiles'
// loop (NV copies) and the target's vector the whole form once after it; other rows take the
// whole form in a loop that is not unrolled, so the variants' code stays small for the
// instruction cache (docs/tuning.md, "The kernels' code").  Other variants take the whole form
// in the tiles' loop.
template <typename T, int MODE, int KC, bool COMMON, typename G>
__device__ __forceinline__ void grad_vector(
        const Vec<T, RowPolicy<T, MODE, KC>::VEC>& xi, int j, const RowPlace<T, acc_t<T>>& p,
        const GradRow<T, G>& gw, const RowResult<acc_t<T>>& o, const T* __restrict__ weight,
        const RowArgs<acc_t<T>>& ra) {
    using A = acc_t<T>;
    using P = RowPolicy<T, MODE, KC>;
    constexpr int VEC = P::VEC;
    const int c0 = p.h + j * VEC;
    const bool y_here = !COMMON && j == gw.jy;  // jy >= 0 then: ey is the target's place
    Vec<T, VEC> tv;
    if (ra.prob) tv = load_any<T, VEC>(p.tr + c0, p.t_vec);
    A z[VEC], pr[VEC], gi[VEC];
    widen(xi, z);
    zval_each(z, ra);
    if constexpr (COMMON && sizeof(T) == 2) {
        probs_normal(z, o.lse, pr);
    } else {
        probs<sizeof(T) == 2>(z, o.lse, pr);
    }
    if ((P::PLAIN || MODE == MODE_CAP) && !y_here) {
        // Not the target's vector: g k p_c (g (k p_c + dz p_c) with a z-loss; times dz_c/dx_c
        // with a softcap), grad_input's value without its selects (k p - 0 is k p), g k formed
        // once a row.
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            gi[e] = ra.zloss ? o.g * fma_rn(o.dz, pr[e], o.k * pr[e]) : gw.gk * pr[e];
            if (MODE == MODE_CAP) {
                const A q = z[e] * ra.inv_cap;
                gi[e] *= A(1) - q * q;
            }
        }
    } else if (MODE == MODE_SMOOTH && !y_here) {
        // Label smoothing, not the target's vector: no compares; w_c only with weights.
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const A w = weight != nullptr ? to_acc(weight[c0 + e]) : A(1);
            gi[e] = grad_input(pr[e], z[e], false, A(0), w, o, p.rt, ra);
        }
    } else if (!COMMON) {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const A w = weight != nullptr && ra.track ? to_acc(weight[c0 + e]) : A(1);
            gi[e] = grad_input(pr[e], z[e], y_here && gw.ey == e,
                               ra.prob ? to_acc(tv.v[e]) : A(0), w, o, p.rt, ra);
        }
    }
    if (!P::PROB_T || gw.gr != nullptr) store_any<G, VEC>(gw.gr + c0, gi, COMMON || gw.g_vec);
    if (P::PROB_T && gw.gtr != nullptr) {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const A w = weight != nullptr ? to_acc(weight[c0 + e]) : A(1);
            gi[e] = grad_target(zval(xi.v[e], ra), w, o, ra);
        }
        store_any<T, VEC>(gw.gtr + c0, gi, gw.gt_vec);
    }
}

// A row with no softmax in its gradient (nll_loss, an ignored row): 0 everywhere (NaN for an
// out-of-range nll target), -w_y g at y.
template <typename T, int VEC, typename G>
__device__ __forceinline__ void grad_no_softmax(const RowPlace<T, acc_t<T>>& p,
                                                const RowTeam& tm, G* gr, bool g_vec,
                                                acc_t<T> g) {
    using A = acc_t<T>;
    const RowTarget<A>& rt = p.rt;
    const A fill = rt.oor ? quiet_nan(A(0)) : A(0);
    const A at_y = rt.ignored ? A(0) : -rt.wy * g;
    if (p.has_head) gr[tm.lane] = from_acc<G>(tm.lane == rt.y ? at_y : fill);
    if (p.has_tail) gr[p.c_tail] = from_acc<G>(p.c_tail == rt.y ? at_y : fill);
    for (int j = p.v0 + tm.lane; j < p.v1; j += tm.t) {
        const int c0 = p.h + j * VEC;
        A gi[VEC];
        #pragma unroll
        for (int e = 0; e < VEC; ++e) gi[e] = c0 + e == rt.y ? at_y : fill;
        store_any<G, VEC>(gr + c0, gi, g_vec);
    }
}

// The gradient phase of a row (o.g its upstream gradient): the head and tail scalars, then its
// vectors, the last tile from the registers (xv) and the others from shared or global memory.
template <typename T, int MODE, int KC, typename G>
__device__ __forceinline__ void row_grad(
        Vec<T, RowPolicy<T, MODE, KC>::VEC> (&xv)[RowPolicy<T, MODE, KC>::NV], T xh, T xt,
        unsigned lo2, const RowPlace<T, acc_t<T>>& p, const RowTeam& tm,
        const RowResult<acc_t<T>>& o, G* gx, T* gt, long long g_rs, long long cols,
        const T* __restrict__ weight, const int4* held, const RowArgs<acc_t<T>>& ra) {
    using A = acc_t<T>;
    using P = RowPolicy<T, MODE, KC>;
    constexpr int VEC = P::VEC, NV = P::NV;
    const int lane = tm.lane, t = tm.t, v0 = p.v0, v1 = p.v1, h = p.h;
    const int ntiles = p.ntiles, kept = p.kept;
    GradRow<T, G> gw;
    gw.gk = o.g * o.k;
    gw.gr = gx != nullptr ? gx + p.r * g_rs : nullptr;
    gw.gtr = gt != nullptr ? gt + p.r * cols : nullptr;
    gw.g_vec = gw.gr != nullptr &&
        (reinterpret_cast<unsigned long long>(gw.gr + h) & (sizeof(Vec<G, VEC>) - 1)) == 0;
    if (ra.nll || p.rt.ignored) {
        grad_no_softmax<T, VEC>(p, tm, gw.gr, gw.g_vec, o.g);
        return;
    }
    gw.gt_vec = gw.gtr != nullptr && aligned16(gw.gtr + h);
    #pragma unroll
    for (int s = 0; s < 2; ++s) {
        if (s == 0 ? !p.has_head : !p.has_tail) continue;
        const int c = s == 0 ? lane : p.c_tail;
        const A z = zval(s == 0 ? xh : xt, ra);
        const A w = weight != nullptr && ra.track ? to_acc(weight[c]) : A(1);
        const A tv = ra.prob ? to_acc(p.tr[c]) : A(0);
        if (gw.gr != nullptr)
            gw.gr[c] = from_acc<G>(grad_input(fexp(z - o.lse), z, c == p.rt.y, tv, w, o, p.rt,
                                              ra));
        if (gw.gtr != nullptr) gw.gtr[c] = from_acc<T>(grad_target(z, w, o, ra));
    }
    // Instructions bound this loop with 16-bit logits, so a vector costs one target compare
    // (jy, ey), no selects away from the target, and one conversion a pair (docs/tuning.md,
    // "The kernels' code").
    const long long yv = p.rt.y - h;
    gw.jy = yv >= 0 && yv < (long long)p.nv * VEC ? (int)(yv / VEC) : -1;
    gw.ey = gw.jy >= 0 ? (int)(yv - (long long)gw.jy * VEC) : -1;
    // A row whose vectors take the common form: its gradient row 16-byte aligned, and for
    // 16-bit logits no p below 2^-126 (e^(z - lse) with z log2 e - lse log2 e >= -126, the
    // fused argument being monotonic in z): z >= the row's smallest (ROW_MIN), or with a
    // softcap z >= -c.  Float32 and float64 rows test each vector (probs).
    bool common = P::DEFER && gw.g_vec;
    if constexpr (P::DEFER && sizeof(T) == 2) {
        const A low = P::ROW_MIN ? min_of_words<T>(lo2) : -ra.cap;
        const float nl = -o.lse * 1.4426950408889634f;   // as probs forms it
        common = common && fmaf(low, 1.4426950408889634f, nl) >= -126.0f;
    }
    if (P::DEFER && !common) {
        // The whole form, a vector at a time, each read again from shared or global memory
        // (no class of the row has been written yet).
        #pragma unroll 1
        for (int ti = 0; ti < ntiles; ++ti) {
            #pragma unroll 1
            for (int i = 0; i < NV; ++i) {
                const int j = v0 + ti * tm.span + lane + i * t;
                if (j >= v1) break;
                Vec<T, VEC> xi;
                if (ti < kept) {
                    const int4 raw = held[(ti * NV + i) * ROW_BLOCK + threadIdx.x];
                    xi = *reinterpret_cast<const Vec<T, VEC>*>(&raw);
                } else {
                    xi = load16<T, VEC>(p.xr + h + (long long)j * VEC, false);
                }
                grad_vector<T, MODE, KC, false>(xi, j, p, gw, o, weight, ra);
            }
        }
        return;
    }
    bool y_mine = false;
    // The last tile first, from the registers; then the others from shared or global memory.
    for (int q = 0; q < ntiles; ++q) {
        const int ti = q == 0 ? ntiles - 1 : q - 1;
        const int vb = v0 + ti * tm.span + lane;
        if (q > 0) {
            const T* src = p.xr + h + (long long)vb * VEC;
            const int4* kept_at = held + ti * NV * ROW_BLOCK + threadIdx.x;
            #pragma unroll
            for (int i = 0; i < NV; ++i) {
                if (vb + i * t >= v1) continue;
                if (ti < kept) {
                    const int4 raw = kept_at[i * ROW_BLOCK];
                    xv[i] = *reinterpret_cast<const Vec<T, VEC>*>(&raw);
                } else {
                    xv[i] = load16<T, VEC>(src + i * tm.step, false);
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int j = vb + i * t;
            if (j >= v1) continue;
            if (P::DEFER && j == gw.jy) {
                y_mine = true;   // done after the row's tiles
                continue;
            }
            grad_vector<T, MODE, KC, P::DEFER>(xv[i], j, p, gw, o, weight, ra);
        }
    }
    // The target's vector, with DEFER: read again (nothing has written its classes yet).
    if (P::DEFER && y_mine)
        grad_vector<T, MODE, KC, false>(load16<T, VEC>(p.xr + h + (long long)gw.jy * VEC, false),
                                        gw.jy, p, gw, o, weight, ra);
}

// The body of every cross_entropy_rows kernel: per row the load phase (row_load), the merge of
// the row's states (team_merge; a cluster's or a group's), its loss, and the gradient phase
// (row_grad).  KC > 1: a thread block cluster of KC blocks takes each row (sm_90 and later),
// exchanging the row states through distributed shared memory instead of global memory and a
// counter.  G: the gradient's type, T's, or a 16-bit type for float32 logits whose gradient is
// wanted rounded (the fused linear loss: one pass writes what a second would otherwise read back
// and round).
template <typename T, int MODE, int KC, typename G>
__device__ __forceinline__ void rows_body(CUPYLOSS_ROWS_PARAMS(T, G)) {
    using A = acc_t<T>;
    using P = RowPolicy<T, MODE, KC>;
    extern __shared__ unsigned char smem_raw[];
    A* scratch = reinterpret_cast<A*>(smem_raw);  // [ROW_SCRATCH]
    // [stash][NV][ROW_BLOCK] vectors: thread-interleaved, conflict-free 16-byte accesses.
    int4* held = reinterpret_cast<int4*>(smem_raw + ROW_SCRATCH * sizeof(A));

    RowArgs<A> ra = row_args<A>(flags, ignore_index, smoothing, zscale, softcap, cols);
    // Constants from here on for every variant but the run-time options it exists for.
    if (MODE != MODE_GENERAL) {
        if (MODE != MODE_CAP) ra.cap = A(0);
        ra.prob = MODE == MODE_PROB;
        if (MODE != MODE_SMOOTH) ra.smooth = false;
        ra.track = ra.prob || ra.smooth;
    }
    ra.nll = MODE == MODE_NLL;
    const bool want_g = MODE != MODE_FORWARD && (gx != nullptr || gt != nullptr);
    const bool go_rows = (flags & ROW_GO_ROWS) != 0;
    const bool mean_w = (flags & ROW_MEAN_W) != 0;
    const bool acc_io = (flags & ROW_ACC_IO) != 0;
    A g_all = A(0);
    if (want_g && !go_rows) {
        g_all = ((flags & ROW_GO_DEVICE) ? read_io(go, 0, acc_io) : A(go_value)) * A(grad_scale);
        if (denom != nullptr) g_all /= denom[0];
    }
    const int ncols = (int)cols;
    RowTeam tm;
    tm.t = (int)tpr;
    tm.lane = threadIdx.x & (tm.t - 1);
    tm.kk = KC > 1 ? KC : (int)k;
    tm.teams = tm.kk > 1 ? 1 : blockDim.x / tm.t;
    tm.team = tm.kk > 1 ? 0 : threadIdx.x / tm.t;
    tm.member = tm.kk > 1 ? blockIdx.x % tm.kk : 0;
    tm.unit = tm.kk > 1 ? blockIdx.x / tm.kk : blockIdx.x;
    tm.units = tm.kk > 1 ? gridDim.x / tm.kk : gridDim.x;
    tm.span = tm.t * P::NV;
    tm.span_log2 = __ffs(tm.span) - 1;
    tm.step = (long long)tm.t * P::VEC;
    A lacc = A(0), wacc = A(0);

    long long it = 0;
    for (long long r0 = tm.unit * tm.teams; r0 < rows; r0 += tm.units * tm.teams, ++it) {
        const RowPlace<T, A> p = row_place<T, MODE, P::VEC>(r0 + tm.team, rows, x, x_rs, tgt,
                                                            t_rs, weight, lse, stash, ncols, tm,
                                                            ra);
        const long long r = p.r;
        RowStat<A> st = empty_stat<A>();
        Vec<T, P::VEC> xv[P::NV];
        T xh = T(), xt = T();
        // ROW_MIN: the smallest logits of this thread's vectors, in pairs (from +inf)
        unsigned lo2 = IsBf16<T>::value ? 0x7f807f80u : 0x7c007c00u;
        if (p.read) row_load<T, MODE, KC>(st, xv, xh, xt, lo2, p, tm, weight, held, ra);
        // A team of the whole block (a row of a block or more): the next row's first tile of
        // this block's share is fetched into L2 now, so that DRAM stays busy through this row's
        // merge, barrier and gradient stores, and the next row's loads start from L2.
        if (MODE != MODE_FORWARD && tm.t == (int)blockDim.x && r + tm.units < rows)
            prefetch_l2_span(x + (r + tm.units) * x_rs + p.h + (long long)p.v0 * P::VEC,
                             min(p.v1 - p.v0, tm.span));
        // z_y from one thread (the group's first block), read before any block of the row stores.
        const bool first = p.active && tm.lane == 0 && tm.member == 0;
        if (first && !ra.prob && !p.rt.ignored && !p.rt.oor)
            st.t = ra.nll ? to_acc(p.xr[p.rt.y]) : zval(p.xr[p.rt.y], ra);
        if (first && p.rt.oor) count_rejected();
        st = team_merge<P::TRACK>(st, tm.t, scratch);
        if constexpr (KC > 1) {
            st = cluster_merge<A, KC, P::TRACK>(st, scratch + ROW_EXCHANGE, it);
        } else if (tm.kk > 1) {
            st = group_merge<P::TRACK>(st, exchange + tm.unit * 2 * tm.kk * ROW_FIELDS,
                                       sync + tm.unit, tm.kk, tm.member, it);
        }
        RowResult<A> o = finalize(st, p.rt, ra);
        if (first) {
            if (loss != nullptr) write_io(loss, r, o.loss, acc_io);
            if (lse != nullptr) lse[r] = o.lse;
            lacc += o.loss;
            if (mean_w && !p.rt.ignored) wacc += p.rt.wy;
        }
        if (!want_g || !p.active) continue;
        o.g = go_rows ? read_io(go, r * go_rs, acc_io) * A(grad_scale) : g_all;
        row_grad<T, MODE, KC>(xv, xh, xt, lo2, p, tm, o, gx, gt, g_rs, cols, weight, held, ra);
    }
    // A block's shared memory must outlive its cluster's last reads of it.
    if constexpr (KC > 1) cluster_sync();
    finish_ratio<T>(lacc, wacc, value, denom, mean_w, false, divisor, partials, ticket, acc_io);
}

// Resident blocks per SM: four for the forward and nll variants (64 registers), three with a
// gradient (80: a few spill, still faster than two blocks of 128), two for the general,
// smoothing, probability and softcap ones; several blocks overlap one row's loads with
// another's stores (docs/tuning.md, "The kernels' code").
#define CUPYLOSS_ROWS_BLOCKS(MODE) \
    (MODE == MODE_FORWARD || MODE == MODE_NLL ? 4 : MODE == MODE_GRAD ? 3 : 2)

// Rows of one block, of a team within a block, or of k blocks of a cooperative launch.
template <typename T, int MODE, typename G = T>
__global__ void __launch_bounds__(256, CUPYLOSS_ROWS_BLOCKS(MODE))
cross_entropy_rows(CUPYLOSS_ROWS_PARAMS(T, G)) {
    rows_body<T, MODE, 1, G>(CUPYLOSS_ROWS_ARGS);
}

// Rows of KC blocks of one thread block cluster (KC == k; compiled on every architecture, run
// only where clusters exist: the host asks for it on sm_90 and later).
template <typename T, int MODE, int KC, typename G = T>
__global__ void __launch_bounds__(256, CUPYLOSS_ROWS_BLOCKS(MODE)) CUPYLOSS_CLUSTER_DIMS(KC)
cross_entropy_rows_cluster(CUPYLOSS_ROWS_PARAMS(T, G)) {
    rows_body<T, MODE, KC, G>(CUPYLOSS_ROWS_ARGS);
}

// Any strides: row r = (n, d) of an input viewed as [N, C, inner]; a thread per row, classes
// walked with stride xc.  The gradient re-reads the row (adjacent threads share cache lines).
template <typename T>
__global__ void __launch_bounds__(256) cross_entropy_cols(
        const T* x,                          // element (n, c, d) at n * xn + c * xc + d * xd
        const void* tgt,                     // index (n, d) at n * tn + d * td, or T probabilities
                                             // (n, c, d) at n * tn + c * tc + d * td
        const T* __restrict__ weight,        // [cols] or null
        const T* __restrict__ go,            // (n, d) at n * gon + d * god, [1], or unused
        const acc_t<T>* __restrict__ denom,  // [1] or null
        const long long rows, const long long cols, const long long inner,  // rows = N * inner
        const long long xn, const long long xc, const long long xd,
        const long long tn, const long long tc, const long long td,
        const long long gon, const long long god,
        const long long gn, const long long gc, const long long gd,  // gx strides (may be x's)
        const long long flags, const long long ignore_index,
        const double smoothing, const double zscale, const double softcap,
        const double go_value, const double grad_scale,
        T* __restrict__ loss,                // [rows] or null
        acc_t<T>* __restrict__ lse,          // [rows] or null
        T* gx,                               // or null
        T* __restrict__ gt,                  // [N, cols, inner] contiguous, or null
        T* __restrict__ value, acc_t<T>* __restrict__ partials,
        unsigned int* __restrict__ ticket, const double divisor) {
    using A = acc_t<T>;
    extern __shared__ unsigned char smem_raw[];
    A* scratch = reinterpret_cast<A*>(smem_raw);
    const RowArgs<A> ra = row_args<A>(flags, ignore_index, smoothing, zscale, softcap, cols);
    const bool want_g = gx != nullptr || gt != nullptr;
    const bool go_rows = (flags & ROW_GO_ROWS) != 0;
    const bool mean_w = (flags & ROW_MEAN_W) != 0;
    const bool acc_io = (flags & ROW_ACC_IO) != 0;
    A g_all = A(0);
    if (want_g && !go_rows) {
        g_all = ((flags & ROW_GO_DEVICE) ? read_io(go, 0, acc_io) : A(go_value)) * A(grad_scale);
        if (denom != nullptr) g_all /= denom[0];
    }
    const T* tp = static_cast<const T*>(tgt);
    A lacc = A(0), wacc = A(0);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += stride) {
        const long long n = r / inner;
        const long long d = r - n * inner;
        const T* xr = x + n * xn + d * xd;
        const T* tr = tp + n * tn + d * td;
        const RowTarget<A> rt = row_target<T, A>(tgt, n * tn + d * td, weight, ra);
        if (rt.oor) count_rejected();
        const bool read = !ra.nll && !(rt.ignored && lse == nullptr);
        RowStat<A> st = empty_stat<A>();
        if (read) {
            // One thread adds the row's cols terms in sequence: the sum of exponentials is
            // compensated (Kahan), its compensation rescaled with it when the max moves, and so
            // are a (its shifts b (M - m) included) and b (uncompensated, b = 1 from 8191
            // smoothed probability terms in float32 left the loss b log S + a 2.5e-5 off).
            A cs = A(0);
            Compensated<A> a, b;
            for (long long c = 0; c < cols; ++c) {
                const A u = ra.track ? elem_u<T, A>(weight, c, ra.prob ? to_acc(tr[c * tc]) : A(0),
                                                    ra) : A(0);
                const A z = zval(xr[c * xc], ra);
                if (z > st.m) {
                    cs = rescaled(cs, st.m, z);
                    if (ra.track) a.add(shifted(b.value(), st.m, z));
                    st.s = rescaled(st.s, st.m, z);
                    st.m = z;
                }
                const A y = exp_from(z, st.m) - cs;
                const A sum = st.s + y;
                cs = isfinite(sum) ? (sum - st.s) - y : A(0);
                st.s = sum;
                if (ra.track) {
                    a.add(u * dist_to(st.m, z));
                    b.add(u);
                }
            }
            st.s -= cs;
            st.a = a.value();
            st.b = b.value();
        }
        if (!ra.prob && !rt.ignored && !rt.oor)
            st.t = ra.nll ? to_acc(xr[rt.y * xc]) : zval(xr[rt.y * xc], ra);
        RowResult<A> o = finalize(st, rt, ra);
        if (loss != nullptr) write_io(loss, r, o.loss, acc_io);
        if (lse != nullptr) lse[r] = o.lse;
        lacc += o.loss;
        if (mean_w && !rt.ignored) wacc += rt.wy;
        if (!want_g) continue;
        o.g = go_rows ? read_io(go, n * gon + d * god, acc_io) * A(grad_scale) : g_all;
        T* gr = gx != nullptr ? gx + n * gn + d * gd : nullptr;
        T* gtr = gt != nullptr ? gt + (n * cols) * inner + d : nullptr;
        if (ra.nll || rt.ignored) {
            const A fill = rt.oor ? quiet_nan(A(0)) : A(0);
            const A at_y = rt.ignored ? A(0) : -rt.wy * o.g;
            for (long long c = 0; c < cols; ++c) gr[c * gc] = from_acc<T>(c == rt.y ? at_y : fill);
            continue;
        }
        for (int c = 0; c < (int)cols; ++c) {
            const A z = zval(xr[c * xc], ra);
            const A w = weight != nullptr && ra.track ? to_acc(weight[c]) : A(1);
            const A tv = ra.prob ? to_acc(tr[c * tc]) : A(0);
            if (gr != nullptr)
                gr[c * gc] = from_acc<T>(grad_input(fexp(z - o.lse), z, c == rt.y, tv, w, o, rt,
                                                    ra));
            if (gtr != nullptr) gtr[c * inner] = from_acc<T>(grad_target(z, w, o, ra));
        }
    }
    finish_ratio<T>(lacc, wacc, value, denom, mean_w, false, divisor, partials, ticket, acc_io);
}

// out[0] = sum over rows (n, d) of the counted rows' weights: 0 for ignore_index, w_y (1 without
// a weight) in range, NaN out of range.  The divisor of a 'mean' over class-index targets.  With
// `items` (num_items on the device, a gradient-accumulation step's count over all its
// micro-batches), out[0] = items[0] instead, read as int32 (ROW_ITEMS32) or int64; rows is 0.
template <typename T>
__global__ void __launch_bounds__(256) class_weight_sum(
        const void* tgt,                     // index (n, d) at n * tn + d * td
        const T* __restrict__ weight,        // [cols] or null
        const long long rows, const long long cols, const long long inner,
        const long long tn, const long long td,
        const long long flags, const long long ignore_index,
        const void* __restrict__ items,      // [1] num_items, or null
        acc_t<T>* __restrict__ out,          // [1]
        acc_t<T>* __restrict__ partials,     // [gridDim.x] when gridDim.x > 1
        unsigned int* __restrict__ ticket) {
    using A = acc_t<T>;
    const RowArgs<A> ra = row_args<A>(flags, ignore_index, 0.0, 0.0, 0.0, cols);
    A acc = A(0);
    if (items != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
        acc = (flags & ROW_ITEMS32) ? A(static_cast<const int*>(items)[0])
                                    : A(static_cast<const long long*>(items)[0]);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += stride) {
        const long long n = r / inner;
        const long long d = r - n * inner;
        const RowTarget<A> rt = row_target<T, A>(tgt, n * tn + d * td, weight, ra);
        if (!rt.ignored) acc += rt.wy;
    }
    const double v[1] = {double(acc)};
    A* const outs[1] = {out};
    const double div[1] = {1.0};
    grid_sum_out<A, 1>(v, outs, div, partials, ticket, blockIdx.x, gridDim.x);
}

// The gradient of cross entropy over a slice of each row's classes, from the row's logsumexp found
// before (the fused linear loss's low-memory plan forms each vocabulary slice of the logits again,
// after a first pass has found every row's lse).  The row's factors come without its other
// classes: for class-index targets
//   k = (1 - eps) w_y + (eps / C) sum_c w_c,   dz = 2 zs lse,   p_c = exp(z_c - lse)
// (finalize's, with sum_c w_c given: C without class weights), and grad_input gives each class
// what cross_entropy_rows writes for it.  An ignored row's slice is 0; a target outside [0, C)
// makes its row NaN, as there.  A block takes a row at a time (rows in a grid-stride loop), its
// threads VEC consecutive classes at a time across the row.
// The parameters, one 64-bit word each, in this order:
//   x          [rows, cols] logits of the slice's classes c0 .. c0 + cols - 1, row r at r * x_rs
//   tgt        int32/int64 [rows]
//   weight     [classes] class weights, or null
//   wsum       [1] sum_c w_c (label smoothing with class weights), or null
//   lse        [rows] each row's logsumexp over all its classes
//   go         [rows] (ROW_GO_ROWS) or [1] (ROW_GO_DEVICE) upstream gradients of the
//              accumulator type (16-bit logits: a 'mean' row's float32 grad_output / divisor
//              unrounded), or unused
//   rows, cols, c0, classes, x_rs, g_rs, flags, ignore_index, smoothing, zscale, softcap,
//   go_value, grad_scale
//   gx         [rows, cols] of G, row r at r * g_rs
template <typename T, typename G>
__global__ void __launch_bounds__(256) cross_entropy_slice_grad(
        const T* __restrict__ x, const void* tgt, const T* __restrict__ weight,
        const acc_t<T>* __restrict__ wsum, const acc_t<T>* __restrict__ lse,
        const acc_t<T>* __restrict__ go, const long long rows, const long long cols, const long long c0,
        const long long classes, const long long x_rs, const long long g_rs,
        const long long flags, const long long ignore_index, const double smoothing,
        const double zscale, const double softcap, const double go_value,
        const double grad_scale, G* __restrict__ gx) {
    using A = acc_t<T>;
    constexpr int VEC = 16 / sizeof(T);
    const RowArgs<A> ra = row_args<A>(flags, ignore_index, smoothing, zscale, softcap, classes);
    const bool go_rows = (flags & ROW_GO_ROWS) != 0;
    const A g_all = go_rows ? A(0)
        : ((flags & ROW_GO_DEVICE) ? to_acc(go[0]) : A(go_value)) * A(grad_scale);
    const A w_sum = ra.smooth ? (wsum != nullptr ? wsum[0] : A(classes)) : A(0);
    long long y_next = index_ahead<T, A>(tgt, blockIdx.x, rows, 1, ra);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const RowTarget<A> rt = target_of<T, A>(y_next, weight, ra);
        y_next = index_ahead<T, A>(tgt, r + gridDim.x, rows, 1, ra);
        RowResult<A> o;
        o.lse = lse[r];
        o.g = go_rows ? to_acc(go[r]) * A(grad_scale) : g_all;
        o.dz = ra.zloss ? A(2) * ra.zs * o.lse : A(0);
        o.k = ra.one_minus_eps * rt.wy;
        if (ra.smooth) o.k += ra.eps_c * w_sum;
        const T* xr = x + r * x_rs;
        G* gr = gx + r * g_rs;
        const bool x_vec = aligned16(xr);
        const bool g_vec =
            (reinterpret_cast<unsigned long long>(gr) & (sizeof(Vec<G, VEC>) - 1)) == 0;
        const long long step = (long long)blockDim.x * VEC;
        for (long long c = (long long)threadIdx.x * VEC; c < cols; c += step) {
            const int n = (int)min((long long)VEC, cols - c);
            A gi[VEC];
            if (rt.ignored) {
                #pragma unroll
                for (int e = 0; e < VEC; ++e) gi[e] = A(0);
            } else {
                Vec<T, VEC> xv;
                if (n == VEC && x_vec) {
                    xv = load16<T, VEC>(xr + c, false);
                } else {
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) xv.v[e] = e < n ? xr[c + e] : T(0);
                }
                #pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const long long cls = c0 + c + e;
                    const A z = zval(xv.v[e], ra);
                    const A w = weight != nullptr && ra.smooth && e < n ? to_acc(weight[cls])
                                                                        : A(1);
                    gi[e] = grad_input(fexp(z - o.lse), z, cls == rt.y, A(0), w, o, rt, ra);
                }
            }
            if (n == VEC && g_vec) {
                store_any<G, VEC>(gr + c, gi, true);
            } else {
                for (int e = 0; e < n; ++e) gr[c + e] = from_acc<G>(gi[e]);
            }
        }
    }
}

// A slice's claim on its row's class, as the last field of its state: the low 31 bits of the
// class index the slice was given (ignore_index included) and, in bit 31, whether that class is
// among the slice's.  The ranks exchange it as bits (an all-gather copies bytes), so combine can
// tell a row whose ranks were given different classes, or whose class no slice or two slices
// hold, and make it NaN instead of a wrong loss.  4 bytes of the field (the low half of a double).
__device__ __forceinline__ unsigned int slice_claim(long long y, bool held) {
    return ((unsigned int)y & 0x7fffffffu) | (held ? 0x80000000u : 0u);
}
template <typename A> __device__ __forceinline__ A claim_word(unsigned int c);
template <> __device__ __forceinline__ float claim_word<float>(unsigned int c) {
    return __uint_as_float(c);
}
template <> __device__ __forceinline__ double claim_word<double>(unsigned int c) {
    return __longlong_as_double((long long)c);
}
__device__ __forceinline__ unsigned int claim_of(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned int claim_of(double v) {
    return (unsigned int)__double_as_longlong(v);
}

// The softmax state (m, s, a, b, t) of a slice of each row's classes, as cross_entropy_rows forms
// a thread's (vocab-parallel cross entropy: each GPU holds classes c0 .. c0 + cols - 1 of
// `classes`).  The states of a row's slices merge into the row's (merge above; in any fixed
// order: cupyloss.parallel.combine_stats), from which its loss and lse follow as in finalize,
// and cross_entropy_slice_grad forms each slice's gradient from that lse.  u_c = w_c with label
// smoothing (over all `classes`), else a and b stay 0; t is z_y where the row's class index y
// lies in the slice, else 0.  An ignored row is not read (its state is empty).  A block takes a
// row at a time (rows in a grid-stride loop), its threads VEC consecutive classes at a time.
// The parameters, one 64-bit word each, in this order:
//   x          [rows, cols] logits of the slice's classes, row r at r * x_rs
//   tgt        int32/int64 [rows] class indices into all `classes`
//   weight     [classes] class weights, or null
//   rows, cols, c0, classes, x_rs, flags, ignore_index, smoothing, softcap
//   stats      [rows, SLICE_FIELDS] of the accumulator type: the state, then the slice's claim
template <typename T>
__global__ void __launch_bounds__(256) cross_entropy_slice_stats(
        const T* __restrict__ x, const void* tgt, const T* __restrict__ weight,
        const long long rows, const long long cols, const long long c0,
        const long long classes, const long long x_rs, const long long flags,
        const long long ignore_index, const double smoothing, const double softcap,
        acc_t<T>* __restrict__ stats) {
    using A = acc_t<T>;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int SLICE_LOADS = 4;   // vectors in flight a thread (see the loop)
    __shared__ A scratch[8 * ROW_FIELDS];
    const RowArgs<A> ra = row_args<A>(flags, ignore_index, smoothing, 0.0, softcap, classes);
    long long y_next = index_ahead<T, A>(tgt, blockIdx.x, rows, 1, ra);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const RowTarget<A> rt = target_of<T, A>(y_next, weight, ra);
        y_next = index_ahead<T, A>(tgt, r + gridDim.x, rows, 1, ra);
        const T* xr = x + r * x_rs;
        // z_y's load issued before the row's (its value is wanted after the merge)
        const long long j = rt.y - c0;
        const bool has_y = threadIdx.x == 0 && !rt.ignored && !rt.oor && j >= 0 && j < cols;
        const T xy = has_y ? xr[j] : T(0);
        RowStat<A> st = empty_stat<A>();
        if (!rt.ignored) {
            const long long step = (long long)blockDim.x * VEC;
            long long c = (long long)threadIdx.x * VEC;
            if (aligned16(xr)) {
                A ref = sum_ref<T>(st.m);
                // SLICE_LOADS vectors in flight a thread: one at a time leaves the loop waiting
                // on each load's latency
                for (; c + (SLICE_LOADS - 1) * step + VEC <= cols; c += SLICE_LOADS * step) {
                    Vec<T, VEC> xv[SLICE_LOADS];
                    #pragma unroll
                    for (int i = 0; i < SLICE_LOADS; ++i)
                        xv[i] = load16<T, VEC>(xr + c + i * step, false);
                    // a vector at a time, as cross_entropy_rows' threads (classes < 2^31)
                    #pragma unroll
                    for (int i = 0; i < SLICE_LOADS; ++i)
                        absorb(st, ref, xv[i], (int)(c0 + c + i * step),
                               static_cast<const T*>(nullptr), false, weight, ra);
                }
            }
            for (; c < cols; c += step) {
                const int n = (int)min((long long)VEC, cols - c);
                for (int e = 0; e < n; ++e) {
                    const A u = weight != nullptr && ra.smooth ? to_acc(weight[c0 + c + e])
                                                               : A(1);
                    push(st, zval(xr[c + e], ra), u, ra.smooth);
                }
            }
        }
        st = team_merge(st, (int)blockDim.x, scratch);
        if (threadIdx.x == 0) {
            if (has_y) st.t = zval(xy, ra);
            store_stat(stats + r * SLICE_FIELDS, st);
            stats[r * SLICE_FIELDS + ROW_FIELDS] = claim_word<A>(slice_claim(rt.y, has_y));
        }
    }
}

// Each row's loss, lse and target weight w_y from the states of all its slices (vocab-parallel
// cross entropy: every rank runs it on the same gathered states, so every rank gets the same
// bits).  The states merge in slice order, then finalize as in cross_entropy_rows.  A thread a row.
// The parameters, one 64-bit word each, in this order:
//   stats      [k, rows, SLICE_FIELDS] of the accumulator type, slice by slice
//   tgt        int32/int64 [rows] class indices into all `classes`
//   weight     [classes] class weights, or null
//   k, rows, classes, flags, ignore_index, smoothing, zscale
//   loss, lse, wy   [rows] of the accumulator type (wy: 0 for an ignored row, NaN outside)
// A row whose slices' claims disagree with this rank's class index, or (a class that is not
// ignored) whose class no slice or more than one slice holds, gets NaN loss, lse and wy, and is
// counted with the rejected targets, as is a class index outside [0, classes).
template <typename T>
__global__ void __launch_bounds__(256) cross_entropy_combine(
        const acc_t<T>* __restrict__ stats, const void* tgt, const T* __restrict__ weight,
        const long long k, const long long rows, const long long classes,
        const long long flags, const long long ignore_index, const double smoothing,
        const double zscale, acc_t<T>* __restrict__ loss, acc_t<T>* __restrict__ lse,
        acc_t<T>* __restrict__ wy) {
    using A = acc_t<T>;
    const RowArgs<A> ra = row_args<A>(flags, ignore_index, smoothing, zscale, 0.0, classes);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += stride) {
        const RowTarget<A> rt = row_target<T, A>(tgt, r, weight, ra);
        const unsigned int mine = slice_claim(rt.y, false);
        RowStat<A> st = load_stat(stats + r * SLICE_FIELDS);
        unsigned int claim = claim_of(stats[r * SLICE_FIELDS + ROW_FIELDS]);
        bool agree = (claim & 0x7fffffffu) == mine;
        int held = (int)(claim >> 31);
        for (long long i = 1; i < k; ++i) {
            const A* si = stats + (i * rows + r) * SLICE_FIELDS;
            st = merge(st, load_stat(si));
            claim = claim_of(si[ROW_FIELDS]);
            agree = agree && (claim & 0x7fffffffu) == mine;
            held += (int)(claim >> 31);
        }
        const bool bad = !agree || (!rt.ignored && !rt.oor && held != 1);
        const RowResult<A> o = finalize(st, rt, ra);
        if (bad || rt.oor) count_rejected();
        loss[r] = bad ? quiet_nan(A(0)) : o.loss;
        lse[r] = bad ? quiet_nan(A(0)) : o.lse;
        wy[r] = bad ? quiet_nan(A(0)) : rt.wy;
    }
}

}  // namespace cupyloss
