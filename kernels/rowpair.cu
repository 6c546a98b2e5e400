// Row-pair losses: losses of two or three arrays of one shape, each row (the last axis) reduced
// to a few sums, then the loss of the row and the gradient of every array from those sums and the
// row's own elements.  The row is held in registers between the two, so value_and_grad reads each
// input once and writes each gradient once.
//
// triplet_margin_loss (anchor a, positive b, negative n; torch's pairwise_distance):
//   u = a - b + eps,  v = a - n + eps,  w = b - n + eps      (elementwise, in the row)
//   d(x) = ||x||_p = (sum_c |x_c|^p)^(1/p);   d_ap = d(u), d_an = d(v), d_pn = d(w)
//   swap: D = min(d_an, d_pn), else D = d_an;   z = margin + d_ap - D;   loss = max(z, 0)
//   (NaN stays NaN, as torch's clamp_min).  Where z >= 0 (torch's clamp_min passes the tie), with
//   g the row's upstream gradient and phi(x) = sign(x) |x|^(p-1) (0 at x = 0):
//     dd(x)/dx_c = phi(x_c) d(x)^(1-p)      (0 where d(x) = 0, as torch's norm backward)
//     c_ap = g d_ap^(1-p),  c_an = g w_an d_an^(1-p),  c_pn = g w_pn d_pn^(1-p)
//     w_an = 1, w_pn = 0 without swap; with swap w_an = [d_an < d_pn] + [d_an == d_pn] / 2
//     (torch's minimum splits a tie), w_pn = 1 - w_an
//     dl/da = c_ap phi(u) - c_an phi(v);  dl/db = -c_ap phi(u) - c_pn phi(w);
//     dl/dn = c_an phi(v) + c_pn phi(w)
// cosine_embedding_loss (input1 x, input2 y, target t in {1, -1, other}; torch's EPSILON = 1e-12):
//   m_x = sum x^2 + 1e-12,  m_y = sum y^2 + 1e-12,  r = sqrt(m_x m_y),  cos = sum x y / r
//   loss = 1 - cos (t == 1);  max(cos - margin, 0) (t == -1);  0 otherwise
//   k = -g (t == 1);  g [cos - margin >= 0] (t == -1);  0 otherwise
//   dl/dx = k (y / r - cos x / m_x),  dl/dy = k (x / r - cos y / m_y)
//
// Kernel rowpair_rows: rows of `cols` elements, a team of tpr threads per row (from the table in
// cupyloss/_launch.py:pair_launch), rows to teams in a grid-stride loop.  A row is cut into a head
// (up to the first 16-byte boundary of the first array), chunks of VEC elements and a tail; a
// chunk is one 16-byte load of each array whose row is 16-byte aligned there with unit stride,
// else VEC strided scalar loads.  With the gradient the chunks pass through dynamic shared
// memory, hv (at most _launch.PAIR_VECS) of each array a thread a unit, in PAIR_STAGES stages:
// cp.async copies the next unit in while the current one is summed and its gradients stored, so
// reads, arithmetic and gradient writes overlap within a block (one block an SM with KernelBench
// 99's rows).  A row the team holds (tpr * hv chunks) is read once for the loss and its
// gradients; a longer one streams through twice (the second time mostly from L2).  The loss
// alone streams each row once through registers.  The row's sums: per thread in the accumulator
// type, then a fixed butterfly within a warp and the warps' sums in warp order (deterministic).
// The 0-d loss is finished in the same launch (grid_sum_out's last-block ticket; the rows'
// losses summed in double across threads and blocks), except by the wide form of the loss alone
// (a block a row, no grid-stride loop), whose rows' losses a second one-block launch,
// rowpair_finish, adds in double in a fixed order.  Indices within a row are 32-bit
// (cols < 2^31, checked on the host); row offsets are 64-bit.
#include "common.cuh"

namespace cupyloss {

enum : long long {
    PAIR_GO_DEVICE = 1,   // grad_output is read from go[0]
    PAIR_GO_ROWS = 2,     // grad_output is read per row (reduction 'none')
    PAIR_SWAP = 4,        // triplet: the distance swap
    PAIR_T_INT32 = 8,     // cosine: the target is int32 (else int64 with PAIR_T_INT64, else T)
    PAIR_T_INT64 = 16,
};

constexpr int PAIR_BLOCK = 256;      // threads a block (_launch.PAIR_BLOCK)
constexpr int PAIR_STAGES = 2;       // units in shared memory at once (_launch.PAIR_STAGES)
// The loss alone: registers of a thread's tile of loads, as accumulator values (16-bit inputs
// take twice their size once converted), so that 4 blocks of 256 threads (64 registers a thread)
// fit an SM without spilling (double's triplet does spill a little, for its general-p pow).
constexpr int PAIR_STREAM_REGS = 32;
// The wide form of the loss alone (WIDE: a block a row) takes its tile's registers and its
// blocks an SM from the loss (Op::WIDE_REGS, Op::WIDE_BLOCKS), measured on KernelBench 99's
// rows: the triplet, three arrays, 64 / 2 (tiles of 5 chunks of each array), and cosine, two,
// 36 / 3 (tiles of 4) (docs/tuning.md, "The kernels' code").
constexpr int PAIR_WARPS = 32;       // at most 1024 threads a block
constexpr int PAIR_FINISH_BLOCK = 1024;  // threads of rowpair_finish (_launch.PAIR_FINISH_BLOCK)

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float pw(float b, float e) { return powf(b, e); }
__device__ __forceinline__ double pw(double b, double e) { return pow(b, e); }
__device__ __forceinline__ float sq(float v) { return sqrtf(v); }
__device__ __forceinline__ double sq(double v) { return sqrt(v); }

// What every row of a launch shares.  pk: 2 (p == 2), 1 (p == 1), else 0 (any other p > 0).
template <typename A>
struct PairArgs {
    A p, eps, margin;
    int pk;
    bool swap;
};

// triplet_margin_loss: arrays (anchor, positive, negative); sums (S_ap, S_an, S_pn).
struct TripletOp {
    static constexpr int N = 3;
    static constexpr int S = 3;
    static constexpr bool TARGET = false;
    // p and swap are options read at run time; TripletP2Op below is the instance for p = 2
    // without swap (torch's defaults, KernelBench 99), where they are constants.
    static constexpr bool NORM = true;
    static constexpr bool P2 = false;
    static constexpr int WIDE_REGS = 64;    // the wide form's tile and blocks an SM (above)
    static constexpr int WIDE_BLOCKS = 2;

    template <typename A>
    __device__ static __forceinline__ A power(A v, const PairArgs<A>& pa) {  // |v|^p
        return pa.pk == 2 ? v * v : pa.pk == 1 ? fabs(v) : pw(fabs(v), pa.p);
    }
    template <typename A>
    __device__ static __forceinline__ A phi(A v, const PairArgs<A>& pa) {  // sign(v) |v|^(p-1)
        if (pa.pk == 2) return v;
        if (v == A(0)) return A(0);
        const A mag = pa.pk == 1 ? A(1) : pw(fabs(v), pa.p - A(1));
        return v < A(0) ? -mag : v > A(0) ? mag : v;  // NaN stays NaN
    }
    template <typename A>
    __device__ static __forceinline__ A norm(A s, const PairArgs<A>& pa) {
        return pa.pk == 2 ? sq(s) : pa.pk == 1 ? s : pw(s, A(1) / pa.p);
    }
    template <typename A>
    __device__ static __forceinline__ A inv(A d, const PairArgs<A>& pa) {  // d^(1-p), 0 at d == 0
        if (d == A(0)) return A(0);
        return pa.pk == 2 ? A(1) / d : pa.pk == 1 ? A(1) : pw(d, A(1) - pa.p);
    }

    template <typename A>
    __device__ static __forceinline__ void elem(const A (&x)[N], A (&s)[S],
                                                const PairArgs<A>& pa) {
        s[0] += power((x[0] - x[1]) + pa.eps, pa);
        s[1] += power((x[0] - x[2]) + pa.eps, pa);
        if (pa.swap) s[2] += power((x[1] - x[2]) + pa.eps, pa);
    }

    // The row's loss, and in c the coefficients of its gradient (times g, the upstream).
    template <typename A>
    __device__ static __forceinline__ A row(const A (&s)[S], long long /*target*/, A g,
                                            A (&c)[S], const PairArgs<A>& pa) {
        const A d_ap = norm(s[0], pa);
        const A d_an = norm(s[1], pa);
        A w_an = A(1), dn = d_an, d_pn = A(0);
        if (pa.swap) {
            d_pn = norm(s[2], pa);
            w_an = d_an < d_pn ? A(1) : d_an == d_pn ? A(0.5) : A(0);
            dn = d_an < d_pn ? d_an : d_pn;
            if (d_an != d_an) dn = d_an;  // NaN propagates, as in torch's minimum
        }
        const A z = (pa.margin + d_ap) - dn;
        const A gz = z >= A(0) ? g : A(0);
        c[0] = gz * inv(d_ap, pa);
        c[1] = gz * w_an * inv(d_an, pa);
        c[2] = pa.swap ? gz * (A(1) - w_an) * inv(d_pn, pa) : A(0);
        return z < A(0) ? A(0) : z;
    }

    template <typename A>
    __device__ static __forceinline__ void grad(const A (&x)[N], const A (&c)[S], A (&o)[N],
                                                const PairArgs<A>& pa) {
        const A fu = c[0] * phi((x[0] - x[1]) + pa.eps, pa);
        const A fv = c[1] * phi((x[0] - x[2]) + pa.eps, pa);
        const A fw = pa.swap ? c[2] * phi((x[1] - x[2]) + pa.eps, pa) : A(0);
        o[0] = fu - fv;
        o[1] = -fu - fw;
        o[2] = fv + fw;
    }
};

// triplet_margin_loss with p = 2 and no swap: its own instantiation, so that each compiles
// one loop (the two in one kernel took twice as long to compile).
struct TripletP2Op : TripletOp {
    static constexpr bool P2 = true;
};

// cosine_embedding_loss: arrays (input1, input2); sums (S_xy, S_xx, S_yy); a target per row.
struct CosineOp {
    static constexpr int N = 2;
    static constexpr int S = 3;
    static constexpr bool TARGET = true;
    static constexpr bool NORM = false;
    static constexpr bool P2 = false;
    static constexpr int WIDE_REGS = 36;
    static constexpr int WIDE_BLOCKS = 3;

    template <typename A>
    __device__ static __forceinline__ void elem(const A (&x)[N], A (&s)[S],
                                                const PairArgs<A>&) {
        s[0] += x[0] * x[1];
        s[1] += x[0] * x[0];
        s[2] += x[1] * x[1];
    }

    // c = (k / r, k cos / m_x, k cos / m_y).  t: 1, -1 or anything else (loss 0).
    template <typename A>
    __device__ static __forceinline__ A row(const A (&s)[S], long long t, A g, A (&c)[S],
                                            const PairArgs<A>& pa) {
        const A mx = s[1] + A(1e-12);
        const A my = s[2] + A(1e-12);
        const A r = sq(mx * my);
        const A cos = s[0] / r;
        const A h = cos - pa.margin;
        A loss = A(0), k = A(0);
        if (t == 1) {
            loss = A(1) - cos;
            k = -g;
        } else if (t == -1) {
            loss = h < A(0) ? A(0) : h;
            k = h >= A(0) ? g : A(0);
        }
        c[0] = k / r;
        c[1] = k * cos / mx;
        c[2] = k * cos / my;
        return loss;
    }

    template <typename A>
    __device__ static __forceinline__ void grad(const A (&x)[N], const A (&c)[S], A (&o)[N],
                                                const PairArgs<A>&) {
        o[0] = c[0] * x[1] - c[1] * x[0];
        o[1] = c[0] * x[0] - c[2] * x[1];
    }
};

// The target of row r as a long long compared with 1 and -1: class-like values (int32, int64),
// or T values, of which only exact 1 and -1 count (a fractional value maps to 0, "other").
template <typename T>
__device__ __forceinline__ long long pair_target(const void* t, long long off, long long flags) {
    if (flags & PAIR_T_INT32) return (long long)static_cast<const int*>(t)[off];
    if (flags & PAIR_T_INT64) return static_cast<const long long*>(t)[off];
    const acc_t<T> v = to_acc(static_cast<const T*>(t)[off]);
    return v == acc_t<T>(1) ? 1 : v == acc_t<T>(-1) ? -1 : 0;
}

// Sums of S values over each team of tpr consecutive threads, in every thread of the team.  Every
// thread of the block calls it.  red: [PAIR_WARPS][S] shared.
template <typename A, int S>
__device__ __forceinline__ void team_sum(A (&s)[S], int tpr, A (*red)[S]) {
    const int width = tpr < 32 ? tpr : 32;
    for (int o = width >> 1; o > 0; o >>= 1) {
        #pragma unroll
        for (int q = 0; q < S; ++q) s[q] += __shfl_xor_sync(0xffffffffu, s[q], o);
    }
    if (tpr <= 32) return;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // red may still be read by the previous row
    if ((threadIdx.x & 31) == 0) {
        #pragma unroll
        for (int q = 0; q < S; ++q) red[warp][q] = s[q];
    }
    __syncthreads();
    const int per_team = tpr >> 5;
    const int first = warp / per_team * per_team;
    #pragma unroll
    for (int q = 0; q < S; ++q) {
        A v = red[first][q];
        for (int w = first + 1; w < first + per_team; ++w) v += red[w][q];
        s[q] = v;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> pair_load(const T* p, long long stride, bool vec) {
    if (vec) {
        const int4 raw = __ldcs(reinterpret_cast<const int4*>(p));
        return *reinterpret_cast<const Vec<T, VEC>*>(&raw);
    }
    Vec<T, VEC> v;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = p[e * stride];
    return v;
}

// A row's place in the arrays: its first element in each, the head (elements up to the first
// 16-byte boundary of the first array's row, unit stride only), nv chunks of VEC elements, the
// tail, and which arrays' chunks are single 16-byte loads.
template <typename T, int N>
struct PairRow {
    const T* x[N];
    int h, nv, tail;
    bool vec[N];

    // Chunk j of array k (element stride cs).
    __device__ __forceinline__ const T* at(int k, int j, long long cs) const {
        return x[k] + (long long)(h + j * (16 / (int)sizeof(T))) * cs;
    }
};

template <typename T, int N>
__device__ __forceinline__ PairRow<T, N> pair_row(const T* const (&xs)[3],
                                                  const long long (&rs)[3],
                                                  const long long (&cs)[3], long long r,
                                                  int ncols) {
    constexpr int VEC = 16 / sizeof(T);
    PairRow<T, N> w;
    #pragma unroll
    for (int k = 0; k < N; ++k) w.x[k] = xs[k] + r * rs[k];
    const int mis = cs[0] == 1
        ? (int)((reinterpret_cast<unsigned long long>(w.x[0]) & 15ull) / sizeof(T)) : 0;
    w.h = mis ? min(ncols, VEC - mis) : 0;
    w.nv = (ncols - w.h) / VEC;
    w.tail = ncols - w.h - w.nv * VEC;
    #pragma unroll
    for (int k = 0; k < N; ++k) w.vec[k] = cs[k] == 1 && aligned16(w.x[k] + w.h);
    return w;
}

// Add one chunk of every array (its VEC elements in order) to the row's sums.
template <typename Op, typename T, int VEC, int N, int S, typename A>
__device__ __forceinline__ void pair_add(const Vec<T, VEC> (&x)[N], A (&s)[S],
                                         const PairArgs<A>& pa) {
    #pragma unroll
    for (int e = 0; e < VEC; ++e) {
        A xe[N];
        #pragma unroll
        for (int k = 0; k < N; ++k) xe[k] = to_acc(x[k].v[e]);
        Op::elem(xe, s, pa);
    }
}

// The gradients of one chunk, stored at element `at` of each gradient row asked for.
template <typename Op, typename T, int VEC, int N, int S, typename A>
__device__ __forceinline__ void pair_grad(const Vec<T, VEC> (&x)[N], const A (&c)[S],
                                          T* const (&gr)[N], const bool (&gvec)[N], int at,
                                          const PairArgs<A>& pa) {
    A out[N][VEC];
    #pragma unroll
    for (int e = 0; e < VEC; ++e) {
        A xe[N], o[N];
        #pragma unroll
        for (int k = 0; k < N; ++k) xe[k] = to_acc(x[k].v[e]);
        Op::grad(xe, c, o, pa);
        #pragma unroll
        for (int k = 0; k < N; ++k) out[k][e] = o[k];
    }
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        if (gr[k] != nullptr) store_any<T, VEC>(gr[k] + at, out[k], gvec[k]);
    }
}

// cp.async (sm_80 and later): 16 bytes from global memory to shared memory without passing
// through registers, cached in L2 only; the copies a thread issues between two commits form a
// group, and wait<n> returns once at most n of the thread's latest groups are still in flight.
// Before sm_80 the copy is a load and a store, done when it returns.
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
    *static_cast<int4*>(dst) = __ldcg(static_cast<const int4*>(src));
#endif
}
__device__ __forceinline__ void copies_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int PENDING>
__device__ __forceinline__ void copies_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// GRAD: the gradients are written.  A row group (a row a team) passes through dynamic shared
// memory in units of hv chunks of each array a thread (a tile of tpr * hv chunks a row;
// ntiles = ceil((cols / VEC) / (tpr * hv)) tiles, the same for every row), copied into one of
// PAIR_STAGES stages PAIR_STAGES - 1 units ahead of the one computed on (cp.async: the copies
// stream in while the row before is summed and its gradients stored).  The units of a row group:
// its tiles for the sums; with ntiles > 1, its tiles once more for the gradients (the second
// time mostly from L2); with ntiles == 1 the row is held, and its one unit serves both.  A thread
// reads only the slots it copied into; a unit's stage is released (the unit PAIR_STAGES on
// copied over it) once its values are used, after a warp barrier that orders those reads before
// the copies.
// At most 128 registers a thread (2 blocks an SM by registers; the stages of KernelBench 99's
// rows, 192 KiB, leave room for one).
// Else the loss alone: nothing is held, and the row streams through registers in tiles of NS
// chunks of each array a thread, all of a tile's loads in flight at once, with 4 blocks an SM
// (64 registers a thread); with 16-bit inputs the next tile is prefetched into L2 meanwhile.
// The shapes tried against this one, Triton's among them: docs/tuning.md, "The kernels' code".
// Either way a thread adds its head element, its tail element, then its chunks in increasing
// order, so the loss's sums are bitwise value_and_grad's.
// WIDE (the loss alone of long float32 rows, _launch.pair_wide): a block a row group (the
// grid-stride loop only past the grid's limit), tiles of Op::WIDE_REGS, each row's loss written
// to partials[r] for rowpair_finish instead of a block's sum and a last-block ticket (the runs:
// docs/tuning.md, "The kernels' code").  The rows' sums are the persistent form's, in the same
// order: the rows' losses are bitwise the same.
// The streaming read of a row's chunks without a gradient (rowpair_rows): tiles of NS chunks of
// each array a thread, all loads of a tile in flight, added to the row's sums s.
template <typename Op, int NS, bool PREFETCH, typename T, int N, int S, typename A>
__device__ __forceinline__ void pair_stream(A (&s)[S], const PairRow<T, N>& w,
                                            const long long (&cs)[3], int lane, int t,
                                            const PairArgs<A>& pa) {
    constexpr int VEC = 16 / sizeof(T);
    using V = Vec<T, VEC>;
    for (int vb = lane; vb < w.nv; vb += t * NS) {
        if constexpr (PREFETCH) {
            #pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int j = vb + (NS + i) * t;
                if (j >= w.nv) continue;
                #pragma unroll
                for (int k = 0; k < N; ++k) {
                    if (w.vec[k]) prefetch_l2(w.at(k, j, cs[k]));
                }
            }
        }
        V xv[NS][N];
        #pragma unroll
        for (int i = 0; i < NS; ++i) {
            const int j = vb + i * t;
            if (j >= w.nv) continue;
            #pragma unroll
            for (int k = 0; k < N; ++k)
                xv[i][k] = pair_load<T, VEC>(w.at(k, j, cs[k]), cs[k], w.vec[k]);
        }
        #pragma unroll
        for (int i = 0; i < NS; ++i) {
            if (vb + i * t < w.nv) pair_add<Op>(xv[i], s, pa);
        }
    }
}

// A row's gradients (rowpair_rows, c its factors): the head and tail scalars from xh and xt,
// then its chunks from the stages, unit u on (slot: a thread's place of a chunk in a stage;
// release(u): unit u is used, the stage takes the next).  The gradients are C-contiguous: row r
// at r * cols.
template <typename Op, typename T, int N, int S, typename A, typename Slot, typename Release>
__device__ __forceinline__ void pair_row_grads(
        const A (&xh)[N], const A (&xt)[N], const A (&c)[S], const PairRow<T, N>& w,
        T* const (&gs)[3], long long r, long long cols, bool active, bool has_head,
        bool has_tail, int c_tail, int lane, int t, int nh, int ntiles, bool twice,
        long long& u, const Slot& slot, const Release& release, const PairArgs<A>& pa) {
    constexpr int VEC = 16 / sizeof(T);
    using V = Vec<T, VEC>;
    T* gr[N];
    bool gvec[N];
    #pragma unroll
    for (int k = 0; k < N; ++k) {
        gr[k] = gs[k] != nullptr && active ? gs[k] + r * cols : nullptr;
        gvec[k] = gr[k] != nullptr && aligned16(gr[k] + w.h);
    }
    A o[N];
    if (has_head) {
        Op::grad(xh, c, o, pa);
        #pragma unroll
        for (int k = 0; k < N; ++k) if (gr[k] != nullptr) gr[k][lane] = from_acc<T>(o[k]);
    }
    if (has_tail) {
        Op::grad(xt, c, o, pa);
        #pragma unroll
        for (int k = 0; k < N; ++k) if (gr[k] != nullptr) gr[k][c_tail] = from_acc<T>(o[k]);
    }
    const int span = t * nh;
    for (int tile = 0; tile < ntiles; ++tile, ++u) {
        if (twice) copies_wait<PAIR_STAGES - 1>();
        const int st = (int)(u % PAIR_STAGES);
        for (int i = 0; active && i < nh; ++i) {
            const int j = tile * span + lane + i * t;
            if (j >= w.nv) break;
            V xv[N];
            #pragma unroll
            for (int k = 0; k < N; ++k) xv[k] = *slot(st, k, i);
            pair_grad<Op>(xv, c, gr, gvec, w.h + j * VEC, pa);
        }
        release(u);
    }
}

template <typename T, typename Op, bool GRAD, bool WIDE>
__global__ void __launch_bounds__(PAIR_BLOCK, GRAD ? 2 : WIDE ? Op::WIDE_BLOCKS : 4)
rowpair_rows(
        const T* __restrict__ x0,            // [rows, cols]: element (r, c) at r * rs0 + c * cs0
        const T* __restrict__ x1,            // the same with rs1, cs1
        const T* __restrict__ x2,            // the same with rs2, cs2 (unused by 2-array losses)
        const void* __restrict__ tgt,        // [rows] at r * t_rs (losses with a target)
        const T* __restrict__ go,            // [rows] at r * go_rs, [1], or unused
        const long long rows, const long long cols,
        const long long rs0, const long long rs1, const long long rs2,
        const long long cs0, const long long cs1, const long long cs2,
        const long long t_rs, const long long go_rs,
        const long long flags,
        const long long tpr,                 // threads per row: a power of two, 1..blockDim.x
        const long long hv,                  // GRAD: chunks of each array a thread a unit
        const double p, const double eps, const double margin,
        const double go_value, const double grad_scale, const double divisor,
        T* __restrict__ loss,                // [rows] or null
        T* __restrict__ g0,                  // [rows, cols] contiguous, or null (each gradient
        T* __restrict__ g1,                  // asked for separately)
        T* __restrict__ g2,
        T* __restrict__ value,               // [1] or null (unused by WIDE)
        acc_t<T>* __restrict__ partials,     // [gridDim.x] when value and gridDim.x > 1; WIDE:
                                             // [rows], the rows' losses for rowpair_finish
        unsigned int* __restrict__ ticket) { // (unused by WIDE)
    using A = acc_t<T>;
    constexpr int N = Op::N;
    constexpr int S = Op::S;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int NS = cmax(1, (WIDE ? Op::WIDE_REGS : PAIR_STREAM_REGS)
                                   / (N * VEC * (int)sizeof(A) / 4));              // chunks
    // 16-bit inputs: the next tile's lines are fetched into L2 while this one loads (float32
    // lost with it; docs/tuning.md, "The kernels' code").
    constexpr bool PREFETCH = !GRAD && sizeof(T) == 2;
    using V = Vec<T, VEC>;
    __shared__ A red[PAIR_WARPS][S];
    extern __shared__ int4 stages[];         // [PAIR_STAGES][N][hv][blockDim.x] chunks

    PairArgs<A> args;
    args.p = A(p);
    args.eps = A(eps);
    args.margin = A(margin);
    args.pk = p == 2.0 ? 2 : p == 1.0 ? 1 : 0;
    args.swap = (flags & PAIR_SWAP) != 0;
    const T* const xs[3] = {x0, x1, x2};
    const long long rs[3] = {rs0, rs1, rs2};
    const long long cs[3] = {cs0, cs1, cs2};
    T* const gs[3] = {g0, g1, g2};
    const bool want_g = GRAD && (g0 != nullptr || g1 != nullptr || g2 != nullptr);
    const bool go_rows = (flags & PAIR_GO_ROWS) != 0;
    A g_all = A(0);
    if (want_g && !go_rows)
        g_all = ((flags & PAIR_GO_DEVICE) ? to_acc(go[0]) : A(go_value)) * A(grad_scale);

    const int ncols = (int)cols;
    const int t = (int)tpr;
    const int nh = GRAD ? (int)hv : 1;
    const int lane = threadIdx.x & (t - 1);
    const int teams = blockDim.x / t;
    const int team = threadIdx.x / t;
    const int span = t * nh;                                 // chunks of a tile
    const int ntiles = max(1, (ncols / VEC + span - 1) / span);
    const bool twice = want_g && ntiles > 1;                 // the gradients stream again
    const int units = twice ? 2 * ntiles : ntiles;           // units of a row group
    const long long first = (long long)blockIdx.x * teams;   // this block's first row group
    const long long step = (long long)gridDim.x * teams;
    Compensated<A> lacc;

    // This thread's slot for chunk i of array k in stage st.
    auto slot = [&](int st, int k, int i) {
        return reinterpret_cast<V*>(stages + ((st * N + k) * nh + i) * (int)blockDim.x
                                    + threadIdx.x);
    };
    // Copy this thread's chunks of unit u of the block into its stage: one commit group (empty
    // past the last row).  An array whose chunks are not 16-byte loads is read and stored here.
    auto fetch = [&](long long u) {
        const long long g = u / units;
        const int tile = (int)(u - g * units) % ntiles;
        const long long r = first + g * step + team;
        if (r < rows) {
            const PairRow<T, N> w = pair_row<T, N>(xs, rs, cs, r, ncols);
            const int st = (int)(u % PAIR_STAGES);
            for (int i = 0; i < nh; ++i) {
                const int j = tile * span + lane + i * t;
                if (j >= w.nv) break;
                #pragma unroll
                for (int k = 0; k < N; ++k) {
                    if (w.vec[k]) copy_async16(slot(st, k, i), w.at(k, j, cs[k]));
                    else *slot(st, k, i) = pair_load<T, VEC>(w.at(k, j, cs[k]), cs[k], false);
                }
            }
        }
        copies_commit();
    };
    // Unit u's values are used: copy unit u + PAIR_STAGES over them.
    auto release = [&](long long u) {
        __syncwarp();
        fetch(u + PAIR_STAGES);
    };

    // The row groups with the options pa (a copy with the arguments of the fast path as
    // constants, where they apply, so that the compiler folds the branches on them).
    auto run = [&](const PairArgs<A>& pa) {
        long long u = 0;  // the unit computed on next
        if constexpr (GRAD) {
            #pragma unroll
            for (int st = 0; st < PAIR_STAGES; ++st) fetch(st);
        }
        for (long long r0 = first; r0 < rows; r0 += step) {
            const long long r = r0 + team;
            const bool active = r < rows;
            const PairRow<T, N> w = pair_row<T, N>(xs, rs, cs, active ? r : 0, ncols);
            const int c_tail = w.h + w.nv * VEC + lane;
            const bool has_head = active && lane < w.h;
            const bool has_tail = active && lane < w.tail;

            A s[S];
            #pragma unroll
            for (int q = 0; q < S; ++q) s[q] = A(0);
            A xh[N], xt[N];
            if (has_head) {
                #pragma unroll
                for (int k = 0; k < N; ++k) xh[k] = to_acc(w.x[k][lane * cs[k]]);
                Op::elem(xh, s, pa);
            }
            if (has_tail) {
                #pragma unroll
                for (int k = 0; k < N; ++k) xt[k] = to_acc(w.x[k][c_tail * cs[k]]);
                Op::elem(xt, s, pa);
            }
            if constexpr (GRAD) {
                for (int tile = 0; tile < ntiles; ++tile, ++u) {
                    copies_wait<PAIR_STAGES - 1>();  // unit u, this thread's part of it
                    const int st = (int)(u % PAIR_STAGES);
                    for (int i = 0; active && i < nh; ++i) {
                        if (tile * span + lane + i * t >= w.nv) break;
                        V xv[N];
                        #pragma unroll
                        for (int k = 0; k < N; ++k) xv[k] = *slot(st, k, i);
                        pair_add<Op>(xv, s, pa);
                    }
                    if (!want_g || twice) release(u);
                }
            } else if (active) {
                pair_stream<Op, NS, PREFETCH>(s, w, cs, lane, t, pa);
            }
            team_sum<A, S>(s, t, red);
            long long target = 0;
            if (Op::TARGET && active) target = pair_target<T>(tgt, r * t_rs, flags);
            const A g = want_g && active
                ? (go_rows ? to_acc(go[r * go_rs]) * A(grad_scale) : g_all) : A(0);
            A c[S];
            const A l = Op::row(s, target, g, c, pa);
            if (active && lane == 0) {
                if (loss != nullptr) loss[r] = from_acc<T>(l);
                if (WIDE) {
                    if (partials != nullptr) partials[r] = l;
                } else {
                    lacc.add(l);
                }
            }
            if (!GRAD || !want_g) continue;

            if (!twice) --u;  // the held unit, once more
            pair_row_grads<Op>(xh, xt, c, w, gs, r, cols, active, has_head, has_tail, c_tail, lane, t,
                               nh, ntiles, twice, u, slot, release, pa);
        }
    };
    if constexpr (Op::P2) {  // the host launches this instance for p = 2 without swap alone
        PairArgs<A> fast = args;
        fast.pk = 2;
        fast.swap = false;
        run(fast);
    } else {
        run(args);
    }
    if constexpr (GRAD) copies_wait<0>();
    if constexpr (!WIDE) {
        const double v[1] = {lacc.wide()};
        T* const outs[1] = {value};
        const double div[1] = {divisor};
        grid_sum_out<T, 1>(v, outs, div, partials, ticket, blockIdx.x, gridDim.x);
    }
}

// value[0] = (the sum of a WIDE launch's rows' losses) / divisor, in one block of
// PAIR_FINISH_BLOCK threads.  Thread i adds the 16-byte vectors i, i + blockDim.x, ... of the
// losses, PAIR_FINISH_LOADS of them in flight at once, then the scalars past the last whole
// vector, in double (a float32 loss is exact there, and a thread adds at most rows / blockDim.x
// of them: the sum carries far less than one unit of the result); then block_sum, a fixed order,
// so the result depends on the rows alone.  The persistent launches add each thread's rows, then
// blocks' partials, also in double: the two agree to within the rounding of the result.
// About 3-4 us (docs/tuning.md, "The kernels' code").
constexpr int PAIR_FINISH_LOADS = 8;

template <typename T>
__global__ void __launch_bounds__(PAIR_FINISH_BLOCK) rowpair_finish(
        const acc_t<T>* __restrict__ partials,  // [rows], 16-byte aligned
        const long long rows, const double divisor,
        T* __restrict__ value) {                // [1]
    using A = acc_t<T>;
    constexpr int W = 16 / sizeof(A);
    using V = Vec<A, W>;
    const V* vecs = reinterpret_cast<const V*>(partials);
    const long long nvec = rows / W;
    const long long span = (long long)PAIR_FINISH_LOADS * blockDim.x;
    double acc = 0.0;
    for (long long base = threadIdx.x; base < nvec; base += span) {
        V v[PAIR_FINISH_LOADS];
        #pragma unroll
        for (int i = 0; i < PAIR_FINISH_LOADS; ++i) {
            const long long j = base + (long long)i * blockDim.x;
            if (j < nvec) {
                v[i] = vecs[j];
            } else {
                #pragma unroll
                for (int e = 0; e < W; ++e) v[i].v[e] = A(0);
            }
        }
        #pragma unroll
        for (int i = 0; i < PAIR_FINISH_LOADS; ++i) {
            #pragma unroll
            for (int e = 0; e < W; ++e) acc += double(v[i].v[e]);
        }
    }
    for (long long r = nvec * W + threadIdx.x; r < rows; r += blockDim.x)
        acc += double(partials[r]);
    const double total = block_sum(acc, wide_scratch());
    if (threadIdx.x == 0) value[0] = from_acc<T>(A(total / divisor));
}

}  // namespace cupyloss
