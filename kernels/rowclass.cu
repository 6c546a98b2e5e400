// Row-wise losses whose gradient needs no row statistic before it is written: multi_margin_loss,
// multilabel_soft_margin_loss and Liger-Kernel's generalised Jensen-Shannon divergence.  Each
// element's loss term and gradient come from that element (and a value or two per row read
// before the row), so one streaming pass reads the row once, writes its gradient and reduces the
// row's loss; nothing is held on chip between a statistic and the gradient.
//
// A row is the last axis of the input: x_c, c in [0, C), row r at x + r * x_rs.
//
// multi_margin_loss (class index y, margin m, p in {1, 2}, weight w over the classes):
//   z_c = (m - x_y) + x_c,   h_c = max(0, z_c)^p,   loss = w_y sum_{c != y} h_c / C
//   dloss/dx_c = w_y (p == 1 ? 1 : 2 z_c) [z_c > 0] / C  for c != y,
//   dloss/dx_y = -sum_{c != y} dloss/dx_c        (torch's strict z > 0 on a tie)
//   The team sums the derivatives while it writes them; the lane that wrote x_y's gradient
//   overwrites it with minus the row's sum after the team reduction (same thread, so in order).
//   An index outside [0, C) is never used as an address: w_y is NaN, so the row's loss and
//   every element of its gradient are NaN (and so is a reduced loss).
// multilabel_soft_margin_loss (targets t_c, weight w broadcast over [rows, C]):
//   loss = sum_c w_c (t_c softplus(-x_c) + (1 - t_c) softplus(x_c)) / C
//        = sum_c w_c (t_c max(-x_c, 0) + (1 - t_c) max(x_c, 0) + log1p(e^-|x_c|)) / C
//   (no cancellation for t in [0, 1], unlike softplus(-x) + (1 - t) x at large -x)
//   dloss/dx_c = w_c (sigmoid(x_c) - t_c) / C,   dloss/dt_c = -w_c x_c / C
// jsd (x = log Q the student, y = log P the teacher, M = beta P + (1 - beta) Q):
//   loss_row = sum_c beta P (y - log M) + (1 - beta) Q (x - log M)
//            = beta KL(P || M) + (1 - beta) KL(Q || M)
//   dloss/dx_c = (1 - beta) Q (x - log M),   dloss/dy_c = beta P (y - log M)
//   With mx = max(x, y), a = e^(y - mx), b = e^(x - mx) (one of them is 1) and
//   s = beta a + (1 - beta) b: log M = mx + log s, P = e^mx a, Q = e^mx b, so P and Q underflow
//   to 0 harmlessly instead of making log M = -inf (log-probabilities of -120 in float32).
//   beta = 0 (forward KL): loss = P (y - x), dx = -P, dy = P (y - x + 1);
//   beta = 1 (reverse KL): loss = Q (x - y), dx = Q (x - y + 1), dy = -Q.
//   A row whose shift label equals ignore_index counts for nothing: loss 0, gradient 0.
//   'mean' divides by the number of counted rows and is 0 when there are none (Liger's rule).
// multilabel_margin_loss (class indices y_0 .. y_{L-1} ended by the first -1 or the row's end;
// S the set of them, a bit mask in shared memory):
//   loss = sum_{j < L} sum_{c not in S} max(0, 1 - x_{y_j} + x_c) / C
//   dloss/dx_c = #{j < L : 1 - x_{y_j} + x_c > 0} / C                       for c not in S
//   dloss/dx_s = -#{j < L : y_j = s} #{c not in S : 1 - x_s + x_c > 0} / C   for s in S
//   (an index given twice counts twice, and a tie z = 0 counts nothing, as torch).  A row
//   holding an index outside [-1, C) anywhere (torch raises) has a NaN loss and gradient.
//   It is not a streaming loss (every element meets every target): a block takes a row, its
//   elements in the first pass, its distinct targets one at a time in the second.
//
// Kernels:
//   rowclass_rows<T, LOSS>  a team of tpr threads (8..256, the row-length table in
//                           cupyloss/_launch.py) streams a row in 16-byte vectors, ROWC_NV of
//                           them in flight a thread; rows go round the grid.
//                           multilabel_margin_loss takes a block a row (margin_set_rows).
//   rowclass_count<T>       the number of counted rows (shift label != ignore_index), the
//                           divisor a 'mean' jsd gradient needs before its launch.
// Indices within a row are 32-bit (C < 2^31, checked on the host); row offsets are 64-bit.
// The 0-d loss is finished in the same launch (last-block ticket), deterministically.
#include "common.cuh"
#include "rows.cuh"

namespace cupyloss {

enum : int { LOSS_MULTI_MARGIN = 0, LOSS_MULTILABEL = 1, LOSS_JSD = 2,
             LOSS_MULTILABEL_MARGIN = 3 };

enum : long long {
    RC_INDEX64 = 1,       // multi_margin's class indices are int64 (else int32)
    RC_LABELS = 2,        // jsd has shift labels
    RC_LABELS64 = 4,      // ... of int64 (else int32)
    RC_GO_DEVICE = 8,     // grad_output is read from go[0]
    RC_GO_ROWS = 16,      // grad_output is read per row (reduction 'none')
    RC_COUNT = 32,        // the 0-d loss is divided by the counted rows (jsd 'mean' with labels)
    RC_ZERO_EMPTY = 64,   // a 0-d loss over a divisor of 0 is 0, not NaN (jsd)
    RC_P2 = 128,          // multi_margin's p == 2
};

constexpr int ROWC_NV = 4;  // 16-byte vectors of each operand a thread loads before using them

__device__ __forceinline__ float lg1p(float v) { return log1pf(v); }
__device__ __forceinline__ double lg1p(double v) { return log1p(v); }

// The sums (a, b) of each team of tpr consecutive threads, in every thread of the team: a fixed
// butterfly within a warp (commutative, so every lane gets the same bits), the warps of a team in
// warp order through scratch[8 warps][2].  Every thread of the block calls it.
template <typename A>
__device__ __forceinline__ void team_sum2(A& a, A& b, int tpr, A* scratch) {
    const int width = tpr < 32 ? tpr : 32;
    for (int o = width >> 1; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (tpr <= 32) return;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if ((threadIdx.x & 31) == 0) {
        scratch[2 * warp] = a;
        scratch[2 * warp + 1] = b;
    }
    __syncthreads();
    const int per_team = tpr >> 5;
    const int first = warp / per_team * per_team;
    a = scratch[2 * first];
    b = scratch[2 * first + 1];
    for (int w = first + 1; w < first + per_team; ++w) {
        a += scratch[2 * w];
        b += scratch[2 * w + 1];
    }
}

// What one row needs before its elements: multi_margin's y, x_y and w_y; jsd's counted flag.
template <typename A>
struct ClassRow {
    long long y;     // multi_margin: the class index (-1 when out of range)
    A xy, wy;        // multi_margin: x_y and w_y (NaN out of range)
    bool counted;    // jsd: the row counts (always true for the other losses)
};

// Shared by every row of a launch.
template <typename A>
struct ClassArgs {
    A margin, beta, one_minus_beta, inv_cols;
    bool p2;
};

// The loss term of element c and its gradients (dloss/dx, dloss/dt) before the row's upstream
// gradient, the 1/C factor and (multi_margin) w_y; `d` is what the team sums besides the loss.
template <int LOSS, typename A>
__device__ __forceinline__ void element(A xv, A tv, A wv, int c, const ClassRow<A>& row,
                                        const ClassArgs<A>& ca, A& loss, A& gx, A& gt) {
    if constexpr (LOSS == LOSS_MULTI_MARGIN) {
        const A z = (ca.margin - row.xy) + xv;
        const bool on = z > A(0) && c != row.y;
        loss = on ? (ca.p2 ? z * z : z) : A(0);
        gx = on ? (ca.p2 ? A(2) * z : A(1)) : A(0);
        gt = A(0);
    } else if constexpr (LOSS == LOSS_MULTILABEL) {
        const A e = fexp(-absv(xv));
        const A l = lg1p(e);
        loss = wv * ((tv * amax(-xv, A(0)) + (A(1) - tv) * amax(xv, A(0))) + l);
        const A sig = xv >= A(0) ? A(1) / (A(1) + e) : e / (A(1) + e);
        gx = wv * (sig - tv);
        gt = -wv * xv;
    } else {
        if (ca.beta == A(0)) {
            const A p = fexp(tv);
            loss = p * (tv - xv);
            gx = -p;
            gt = p * ((tv - xv) + A(1));
        } else if (ca.beta == A(1)) {
            const A q = fexp(xv);
            loss = q * (xv - tv);
            gx = q * ((xv - tv) + A(1));
            gt = -q;
        } else {
            const A mx = amax(xv, tv);
            const A em = fexp(mx);
            const A small = fexp(-absv(xv - tv));      // e^(min - max)
            const A a = tv >= xv ? A(1) : small;       // e^(y - mx)
            const A b = tv >= xv ? small : A(1);       // e^(x - mx)
            const A ls = lg(ca.beta * a + ca.one_minus_beta * b);
            const A p = em * a, q = em * b;
            const A dy = ca.beta * p * ((tv - mx) - ls);
            const A dx = ca.one_minus_beta * q * ((xv - mx) - ls);
            loss = dy + dx;
            gx = dx;
            gt = dy;
        }
    }
}

// Whether class c is one of the row's targets (bit c of the row's mask).
__device__ __forceinline__ bool in_set(const unsigned int* mask, int c) {
    return (mask[c >> 5] >> (c & 31)) & 1u;
}

// multilabel_margin_loss (see the file comment): a block a row, rows going round the grid.
// Pass 1: the row's targets end at the first negative index (L, an integer minimum: any order
// gives it); the set S as a bit mask.  Pass 2: each element outside S against every target (its
// loss terms and its gradient).  Pass 3, with a gradient: each distinct target against the
// elements outside S; its first occurrence writes its gradient after the elements' (a barrier).
template <typename T>
__device__ __forceinline__ void margin_set_rows(
        const T* x, const void* __restrict__ tgt, const T* __restrict__ go,
        const long long rows, const long long cols, const long long x_rs, const long long t_rs,
        const long long go_rs, const long long flags, const double go_value,
        const double grad_scale, T* __restrict__ loss, T* gx, T* __restrict__ value,
        acc_t<T>* __restrict__ partials, unsigned int* __restrict__ ticket,
        const double divisor,
        acc_t<T>* scratch,             // [ROW_SCRATCH]
        unsigned int* mask) {          // [ceil(cols / 32)]: the row's set S
    using A = acc_t<T>;
    __shared__ int first_end;
    const bool idx64 = (flags & RC_INDEX64) != 0;
    const bool go_rows = (flags & RC_GO_ROWS) != 0;
    const int ncols = (int)cols;
    const int nwords = (ncols + 31) >> 5;
    const A inv_cols = A(1) / A(cols);
    A g_all = A(0);
    if (gx != nullptr && !go_rows)
        g_all = ((flags & RC_GO_DEVICE) ? to_acc(go[0]) : A(go_value)) * A(grad_scale);
    Compensated<A> lacc;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * x_rs;
        const long long t0 = r * t_rs;
        for (int w = threadIdx.x; w < nwords; w += blockDim.x) mask[w] = 0u;
        if (threadIdx.x == 0) first_end = ncols;
        __syncthreads();
        bool bad = false;
        for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
            const long long v = read_index<T>(tgt, t0 + c, idx64);
            if (v < 0) atomicMin(&first_end, c);
            bad |= v < -1 || v >= cols;
        }
        bad = __syncthreads_or(bad);
        const int len = bad ? 0 : first_end;
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            const int y = (int)read_index<T>(tgt, t0 + j, idx64);
            atomicOr(&mask[y >> 5], 1u << (y & 31));
        }
        __syncthreads();
        const A g = gx == nullptr ? A(0)
                    : (go_rows ? to_acc(go[r * go_rs]) * A(grad_scale) : g_all) * inv_cols;
        T* gr = gx != nullptr ? gx + r * cols : nullptr;
        Compensated<A> lsum;
        for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
            long long n = 0;
            if (!in_set(mask, c)) {
                const A xc = to_acc(xr[c]);
                for (int j = 0; j < len; ++j) {
                    const A z = (A(1) - to_acc(xr[read_index<T>(tgt, t0 + j, idx64)])) + xc;
                    if (z > A(0)) {
                        lsum.add(z);
                        ++n;
                    }
                }
            }
            if (gr != nullptr) gr[c] = from_acc<T>(bad ? quiet_nan(A(0)) : A(n) * g);
        }
        for (int j = 0; gr != nullptr && j < len; ++j) {
            const long long y = read_index<T>(tgt, t0 + j, idx64);
            const A xy = to_acc(xr[y]);
            double counts[3] = {0.0, 0.0, 0.0};   // earlier occurrences, all, elements it loses to
            for (int k = threadIdx.x; k < len; k += blockDim.x) {
                const bool same = read_index<T>(tgt, t0 + k, idx64) == y;
                counts[0] += same && k < j;
                counts[1] += same;
            }
            for (int c = threadIdx.x; c < ncols; c += blockDim.x)
                counts[2] += !in_set(mask, c) && (A(1) - xy) + to_acc(xr[c]) > A(0);
            double total[3];
            block_sums<3>(counts, total);   // barriers: pass 2's write of x_y's 0 comes first
            if (threadIdx.x == 0 && total[0] == 0.0)
                gr[y] = from_acc<T>(-A(total[1] * total[2]) * g);
        }
        A sum = lsum.value(), unused = A(0);
        team_sum2(sum, unused, blockDim.x, scratch);
        if (threadIdx.x == 0) {
            const A l = bad ? quiet_nan(A(0)) : sum * inv_cols;
            if (loss != nullptr) loss[r] = from_acc<T>(l);
            lacc.add(l);
            if (bad) count_rejected();
        }
        __syncthreads();   // the mask and first_end are the next row's
    }
    finish_ratio<T>(lacc.value(), A(0), value, nullptr, false, (flags & RC_ZERO_EMPTY) != 0,
                    divisor, partials, ticket);
}

// One row's pass over its elements (a team of t threads, lane its thread; the row as h head
// scalars up to x's first 16-byte boundary, nv vectors, tail scalars): each element's loss term
// added to lsum and its gradient written (times g), the input gradients' sum to dsum
// (multi_margin's x_y); an ignored jsd row's gradient is 0.
template <typename T, int LOSS>
__device__ __forceinline__ void class_row(
        Compensated<acc_t<T>>& lsum, acc_t<T>& dsum, const T* xr, const T* tr, const T* wr,
        T* gr, T* gtr, long long w_cs, int ncols, int h, int nv, int tail, int lane, int t,
        bool active, bool want_g, acc_t<T> g, const ClassRow<acc_t<T>>& row,
        const ClassArgs<acc_t<T>>& ca) {
    using A = acc_t<T>;
    constexpr int VEC = 16 / sizeof(T);
    constexpr bool TWO = LOSS != LOSS_MULTI_MARGIN;  // a second operand shaped like the input
    const bool t_vec = TWO && aligned16(tr + h);
    const bool g_vec = gr != nullptr && aligned16(gr + h);
    const bool gt_vec = gtr != nullptr && aligned16(gtr + h);
    const bool work = active && row.counted;

    if (work) {
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int c = s == 0 ? lane : h + nv * VEC + lane;
            if (s == 0 ? lane >= h : lane >= tail) continue;
            const A xv = to_acc(xr[c]);
            const A tv = TWO ? to_acc(tr[c]) : A(0);
            const A wv = wr != nullptr ? to_acc(wr[c * w_cs]) : A(1);
            A l, dx, dt;
            element<LOSS>(xv, tv, wv, c, row, ca, l, dx, dt);
            lsum.add(l);
            dsum += dx;
            if (gr != nullptr) gr[c] = from_acc<T>(dx * g);
            if (gtr != nullptr) gtr[c] = from_acc<T>(dt * g);
        }
        for (int jb = lane; jb < nv; jb += t * ROWC_NV) {
            Vec<T, VEC> xv[ROWC_NV], tv[ROWC_NV];
            #pragma unroll
            for (int i = 0; i < ROWC_NV; ++i) {
                const int j = jb + i * t;
                if (j >= nv) continue;
                xv[i] = load16<T, VEC>(xr + h + j * VEC, false);
                if (TWO) tv[i] = load_any<T, VEC>(tr + h + j * VEC, t_vec);
            }
            #pragma unroll
            for (int i = 0; i < ROWC_NV; ++i) {
                const int j = jb + i * t;
                if (j >= nv) continue;
                const int c0 = h + j * VEC;
                A ox[VEC], ot[VEC];
                #pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const A wv = wr != nullptr ? to_acc(wr[(long long)(c0 + e) * w_cs])
                                               : A(1);
                    A l, dx, dt;
                    element<LOSS>(to_acc(xv[i].v[e]), TWO ? to_acc(tv[i].v[e]) : A(0), wv,
                                  c0 + e, row, ca, l, dx, dt);
                    lsum.add(l);
                    dsum += dx;
                    ox[e] = dx * g;
                    ot[e] = dt * g;
                }
                if (gr != nullptr) store_any<T, VEC>(gr + c0, ox, g_vec);
                if (gtr != nullptr) store_any<T, VEC>(gtr + c0, ot, gt_vec);
            }
        }
    } else if (active && want_g) {
        // An ignored jsd row: its gradient is 0.
        const A zero[VEC] = {};
        for (int c = lane; c < h; c += t) {
            if (gr != nullptr) gr[c] = from_acc<T>(A(0));
            if (gtr != nullptr) gtr[c] = from_acc<T>(A(0));
        }
        for (int j = lane; j < nv; j += t) {
            if (gr != nullptr) store_any<T, VEC>(gr + h + j * VEC, zero, g_vec);
            if (gtr != nullptr) store_any<T, VEC>(gtr + h + j * VEC, zero, gt_vec);
        }
        for (int c = h + nv * VEC + lane; c < ncols; c += t) {
            if (gr != nullptr) gr[c] = from_acc<T>(A(0));
            if (gtr != nullptr) gtr[c] = from_acc<T>(A(0));
        }
    }
}

// One streaming pass over rows of C contiguous elements (see the file comment).  Every thread of
// a block runs the row loop the same number of times (inactive teams take part in the merges).
template <typename T, int LOSS>
__global__ void __launch_bounds__(256) rowclass_rows(
        const T* x,                          // [rows, cols]: row r at x + r * x_rs (may be gx)
        const void* __restrict__ tgt,        // multi_margin: int32/int64 [rows] at r * t_rs;
                                             // else T [rows, cols], row r at r * t_rs
        const T* __restrict__ weight,        // multi_margin: [cols]; multilabel: (r, c) at
                                             // r * w_rs + c * w_cs; or null
        const void* __restrict__ labels,     // jsd: int32/int64 [rows] at r * l_rs, or null
        const T* __restrict__ go,            // [rows] at r * go_rs, [1], or unused
        const acc_t<T>* __restrict__ denom,  // [1] counted rows for a jsd 'mean' gradient, or null
        const long long rows, const long long cols,
        const long long x_rs, const long long t_rs, const long long w_rs, const long long w_cs,
        const long long l_rs, const long long go_rs,
        const long long flags, const long long ignore_index,
        const double option,                 // multi_margin: margin; jsd: beta
        const double go_value, const double grad_scale,
        const long long tpr,                 // threads per row: a power of two, 8..blockDim.x
        T* __restrict__ loss,                // [rows] or null
        T* gx,                               // [rows, cols] contiguous, or null; jsd in place:
                                             // x itself (each element is read by the thread
                                             // that writes its gradient, before it writes it)
        T* __restrict__ gt,                  // [rows, cols] contiguous, or null
        T* __restrict__ value,               // [1] or null
        acc_t<T>* __restrict__ partials,     // [2, gridDim.x] when value and gridDim.x > 1
        unsigned int* __restrict__ ticket,
        const double divisor) {
    using A = acc_t<T>;
    extern __shared__ unsigned char smem_raw[];
    A* scratch = reinterpret_cast<A*>(smem_raw);  // [ROW_SCRATCH]
    if constexpr (LOSS == LOSS_MULTILABEL_MARGIN) {
        margin_set_rows<T>(x, tgt, go, rows, cols, x_rs, t_rs, go_rs, flags, go_value,
                           grad_scale, loss, gx, value, partials, ticket, divisor, scratch,
                           reinterpret_cast<unsigned int*>(smem_raw + ROW_SCRATCH * sizeof(A)));
    } else {
        constexpr int VEC = 16 / sizeof(T);
        constexpr bool TWO = LOSS != LOSS_MULTI_MARGIN;  // a second operand shaped like the input

        ClassArgs<A> ca;
        ca.margin = A(option);
        ca.beta = A(option);
        ca.one_minus_beta = A(1) - ca.beta;
        ca.inv_cols = A(1) / A(cols);
        ca.p2 = (flags & RC_P2) != 0;
        const bool want_g = gx != nullptr || gt != nullptr;
        const bool go_rows = (flags & RC_GO_ROWS) != 0;
        A g_all = A(0);
        if (want_g && !go_rows) {
            g_all = ((flags & RC_GO_DEVICE) ? to_acc(go[0]) : A(go_value)) * A(grad_scale);
            if (denom != nullptr) g_all /= denom[0];
        }
        const int ncols = (int)cols;
        const int t = (int)tpr;
        const int lane = threadIdx.x & (t - 1);
        const int teams = blockDim.x / t;
        const int team = threadIdx.x / t;
        Compensated<A> lacc;
        A cacc = A(0);

        for (long long r0 = (long long)blockIdx.x * teams; r0 < rows;
             r0 += (long long)gridDim.x * teams) {
            const long long r = r0 + team;
            const bool active = r < rows;
            const T* xr = x + (active ? r : 0) * x_rs;
            const T* tr = TWO ? static_cast<const T*>(tgt) + (active ? r : 0) * t_rs : nullptr;

            ClassRow<A> row{-1, A(0), A(1), true};
            if (active && LOSS == LOSS_MULTI_MARGIN) {
                const long long y = read_index<T>(tgt, r * t_rs, (flags & RC_INDEX64) != 0);
                if (y >= 0 && y < cols) {
                    row.y = y;
                    row.xy = to_acc(xr[y]);
                    row.wy = weight != nullptr ? to_acc(weight[y]) : A(1);
                } else {
                    row.wy = quiet_nan(A(0));
                    if (threadIdx.x % t == 0) count_rejected();
                }
            }
            if (active && LOSS == LOSS_JSD && (flags & RC_LABELS))
                row.counted = read_index<T>(labels, r * l_rs, (flags & RC_LABELS64) != 0)
                              != ignore_index;
            // Everything an element's gradient is multiplied by.
            A g = A(0);
            if (want_g && active) {
                g = go_rows ? to_acc(go[r * go_rs]) * A(grad_scale) : g_all;
                if (LOSS != LOSS_JSD) g *= ca.inv_cols;
                if (LOSS == LOSS_MULTI_MARGIN) g *= row.wy;
            }
            const T* wr = LOSS == LOSS_MULTILABEL && weight != nullptr
                          ? weight + (active ? r : 0) * w_rs : nullptr;
            T* gr = gx != nullptr ? gx + (active ? r : 0) * cols : nullptr;
            T* gtr = gt != nullptr ? gt + (active ? r : 0) * cols : nullptr;

            // The row as head scalars (up to x's first 16-byte boundary), vectors, tail scalars.
            const int mis = (int)((reinterpret_cast<unsigned long long>(xr) & 15ull) / sizeof(T));
            const int h = mis ? min(ncols, VEC - mis) : 0;
            const int nv = (ncols - h) / VEC;
            const int tail = ncols - h - nv * VEC;
            Compensated<A> lsum;
            A dsum = A(0);
            class_row<T, LOSS>(lsum, dsum, xr, tr, wr, gr, gtr, w_cs, ncols, h, nv, tail, lane, t,
                               active, want_g, g, row, ca);
            A total = lsum.value();
            team_sum2(total, dsum, t, scratch);
            if (active && lane == 0) {
                A l = total;
                if (LOSS == LOSS_MULTI_MARGIN) l = row.wy * total * ca.inv_cols;
                if (LOSS == LOSS_MULTILABEL) l = total * ca.inv_cols;
                if (loss != nullptr) loss[r] = from_acc<T>(l);
                lacc.add(l);
                if (row.counted) cacc += A(1);
            }
            // multi_margin: x_y's gradient is minus the sum of the others', written by the lane that
            // wrote its element in the pass above (the same thread, so after it).
            if (LOSS == LOSS_MULTI_MARGIN && gr != nullptr && active && row.y >= 0) {
                const int y = (int)row.y;
                int owner;
                if (y < h) owner = y;
                else if (y < h + nv * VEC) owner = ((y - h) / VEC) % t;
                else owner = y - h - nv * VEC;
                if (lane == owner) gr[y] = from_acc<T>(-dsum * g);
            }
        }
        finish_ratio<T>(lacc.value(), cacc, value, nullptr, (flags & RC_COUNT) != 0,
                        (flags & RC_ZERO_EMPTY) != 0, divisor, partials, ticket);
    }
}

// out[0] = the number of rows whose shift label is not ignore_index (jsd's 'mean' divisor).
template <typename T>
__global__ void __launch_bounds__(256) rowclass_count(
        const void* __restrict__ labels,     // int32/int64 [rows] at r * l_rs
        const long long rows, const long long l_rs,
        const long long flags, const long long ignore_index,
        acc_t<T>* __restrict__ out,          // [1]
        acc_t<T>* __restrict__ partials,     // [gridDim.x] when gridDim.x > 1
        unsigned int* __restrict__ ticket) {
    using A = acc_t<T>;
    A acc = A(0);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += stride)
        if (read_index<T>(labels, r * l_rs, (flags & RC_LABELS64) != 0) != ignore_index)
            acc += A(1);
    const double v[1] = {double(acc)};
    A* const outs[1] = {out};
    const double div[1] = {1.0};
    grid_sum_out<A, 1>(v, outs, div, partials, ticket, blockIdx.x, gridDim.x);
}

}  // namespace cupyloss
