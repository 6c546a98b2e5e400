// CTC loss (torch.nn.functional.ctc_loss): the forward-backward recursion over time and the
// extended labels, in log space, one block a sequence; torch's gradient; the batch's reduction.
//
// With lp[t][c] a sequence's log-probabilities, tl its target length, L = 2 tl + 1 and the
// extended labels l'(s) = blank for even s, the target's label (s - 1) / 2 for odd s:
//   alpha[0][0] = lp[0][blank], alpha[0][1] = lp[0][l'(1)], alpha[0][s > 1] = -inf
//   alpha[t][s] = lp[t][l'(s)] + lse(alpha[t-1][s], alpha[t-1][s-1],
//                                    alpha[t-1][s-2] where s > 1 and l'(s-2) != l'(s))
//   nll = -lse(alpha[il-1][L-1], alpha[il-1][L-2])         (il: the input length)
//   beta[il-1][L-1] = lp[il-1][l'(L-1)], beta[il-1][L-2] = lp[il-1][l'(L-2)], others -inf
//   beta[t][s] = lp[t][l'(s)] + lse(beta[t+1][s], beta[t+1][s+1],
//                                   beta[t+1][s+2] where s + 2 < L and l'(s+2) != l'(s))
// and the gradient torch returns for log_probs (the derivative with respect to the logits of
// a log_softmax that made them: torch's CTC backward), for t < il:
//   grad[t][c] = g (exp(lp[t][c]) - exp(lse_{s: l'(s) = c}(alpha[t][s] + beta[t][s]) + nll - lp[t][c]))
// 0 for t >= il; g = grad_output, over N max(tl, 1) for 'mean'.  An infinite nll (the input too
// short for the target) gives NaN for t < il, as torch's, or 0 everywhere with zero_infinity.
// lse(a, b, c) = m + log(e^(a-m) + e^(b-m) + e^(c-m)), m = max(a, b, c) (-inf if m is), as
// torch forms it.
//
// Four kernels share one parameter list (CTC_PARAMS), so a plan's later launches take the first
// one's words as they are:
//   ctc_alpha   a block a sequence: alpha, kept in `alpha` for the gradient when asked, nll, and
//               for 'none' the loss;
//   ctc_finish  one block: the batch's 'mean' or 'sum', in double, in a fixed order;
//   ctc_beta    a block a sequence: beta, alpha + beta written over the kept alpha, and the
//               sequence's label groups;
//   ctc_grad    a warp a (t, n) row: g exp(lp), then each label's term over it (each (t, c)
//               written by one lane: no atomics).
// Only ctc_alpha and ctc_beta step through time (one barrier a frame); everything the gradient
// adds up over positions runs in ctc_grad, parallel over frames.
// A sequence's lengths or labels out of range (read on the device: no host sync) make its loss
// and gradient NaN.
#include "common.cuh"
#include "rows.cuh"

namespace cupyloss {

enum : long long {
    CTC_CONCAT = 1,          // targets concatenated [sum(tl)], else padded [N, S]
    CTC_TG_INT32 = 2,        // targets int32 (else int64)
    CTC_IL_INT32 = 4,        // input_lengths int32
    CTC_TL_INT32 = 8,        // target_lengths int32
    CTC_ZERO_INFINITY = 16,  // an infinite loss (and its gradient) is 0
    CTC_GO_DEVICE = 32,      // grad_output a 0-d array on the device
    CTC_GO_ROWS = 64,        // grad_output [N] ('none')
    CTC_KEEP_ALPHA = 128,    // ctc_alpha keeps alpha for ctc_beta
    CTC_MEAN = 256,          // reduction 'mean' (else 'sum' or 'none')
};
constexpr int CTC_KMAX = 8;          // extended-label positions a thread holds
constexpr int CTC_BLOCK = 512;       // most threads of a sequence's block (128 registers a thread)
constexpr int CTC_GRAD_BLOCK = 256;
constexpr int CTC_FINISH_BLOCK = 1024;

#define CTC_PARAMS(T)                                                                              \
    const T* __restrict__ lp,                 /* [steps, batch, classes], any strides */            \
    const void* __restrict__ targets,         /* [batch, tg_len] or [tg_len], int32/int64 */        \
    const void* __restrict__ input_lengths,   /* [batch] */                                         \
    const void* __restrict__ target_lengths,  /* [batch] */                                         \
    const long long steps, const long long batch, const long long classes,                         \
    const long long lp_st, const long long lp_sn, const long long lp_sc,                           \
    const long long tg_sn, const long long tg_ss, const long long tg_len,                          \
    const long long il_s, const long long tl_s, const long long blank,                             \
    const long long lcap,                     /* positions of shared memory: L <= lcap */           \
    const long long row,                      /* alpha's row ([batch, steps, row], padded) */       \
    const long long flags,                                                                         \
    acc_t<T>* __restrict__ nll,               /* [batch] */                                         \
    acc_t<T>* __restrict__ alpha,             /* kept alpha (then alpha + beta), or null */         \
    int* __restrict__ groups,                 /* label groups (ctc_beta -> ctc_grad), or null */    \
    T* __restrict__ loss,                     /* [batch] ('none'), or null */                       \
    T* __restrict__ grad,                     /* [steps, batch, classes] contiguous, or null */     \
    T* __restrict__ value,                    /* [1] ('mean', 'sum'), or null */                    \
    const T* __restrict__ go,                 /* grad_output on the device, or null */              \
    const long long go_s,                     /* its element stride ([batch]) */                    \
    const double go_value

// CTC_PARAMS' names, in order: the whole parameter list passed on (ctc_sequence).
#define CTC_ARGS                                                                                   \
    lp, targets, input_lengths, target_lengths, steps, batch, classes, lp_st, lp_sn, lp_sc,       \
    tg_sn, tg_ss, tg_len, il_s, tl_s, blank, lcap, row, flags, nll, alpha, groups, loss, grad,    \
    value, go, go_s, go_value

__device__ __forceinline__ long long ctc_index(const void* p, long long i, bool is32) {
    return is32 ? (long long)static_cast<const int*>(p)[i] : static_cast<const long long*>(p)[i];
}

// lse of a step's three predecessors, the recursions' one piece of arithmetic, with the
// accurate exp and log (the ex2 and lg2 units measured no faster on an H200 at T = 4000 and
// moved float32 results past torch's own error: docs/performance.md).
template <typename A>
__device__ __forceinline__ A ctc_lse3(A a, A b, A c) {
    A m = amax(a, amax(b, c));
    if (m == neg_inf(A(0))) return m;
    return m + lg(exp(a - m) + exp(b - m) + exp(c - m));
}

// One position's step of a recursion through time, D = +1 for alpha (forward: predecessors s,
// s - 1, s - 2), -1 for beta (backward: s, s + 1, s + 2); `first` is the recursion's first step
// (alpha's t = 0: positions 0 and 1; beta's t = il - 1: the last two), lpv the step's
// log-probability of l'(s).  The skip from s -+ 2 needs another label there.
template <int D, typename A>
__device__ __forceinline__ A ctc_step(const A* prev, const int* lab, long long L, long long s,
                                      bool first, A lpv) {
    const A ninf = neg_inf(A(0));
    if (first) return (D > 0 ? s < 2 : s >= L - 2) ? lpv : ninf;
    const long long s1 = s - D, s2 = s - 2 * D;
    const bool in1 = D > 0 ? s1 >= 0 : s1 < L;
    const bool in2 = D > 0 ? s2 >= 0 : s2 < L;
    const A x2 = (in2 && lab[s2] != lab[s]) ? prev[s2] : ninf;
    return ctc_lse3(prev[s], in1 ? prev[s1] : ninf, x2) + lpv;
}

// The prefetch ring of a recursion: cur takes the step's values, c0 the next step's, and c1 is
// free for the load two steps ahead.
template <typename A>
__device__ __forceinline__ void ctc_advance(A (&cur)[CTC_KMAX], A (&c0)[CTC_KMAX],
                                            const A (&c1)[CTC_KMAX]) {
    #pragma unroll
    for (int k = 0; k < CTC_KMAX; ++k) { cur[k] = c0[k]; c0[k] = c1[k]; }
}

// A sequence as its block sees it: lengths, where its alpha lives, whether it is in range.
struct CtcSeq {
    long long n, il, tl, L, base, rowlen;
    bool ok;
};

// Reads sequence blockIdx.x's lengths and extended labels (into lab[0, L)); every thread of
// the block calls it.  Concatenated targets start after the labels of the sequences before:
// a block sum of their lengths (integers: exact in any order).
template <typename T>
__device__ CtcSeq ctc_sequence(CTC_PARAMS(T), int* lab, long long* red) {
    CtcSeq q;
    q.n = blockIdx.x;
    q.il = ctc_index(input_lengths, q.n * il_s, flags & CTC_IL_INT32);
    q.tl = ctc_index(target_lengths, q.n * tl_s, flags & CTC_TL_INT32);
    long long off = 0;
    bool ok = q.il >= 0 && q.il <= steps && q.tl >= 0 && 2 * q.tl + 1 <= lcap;
    if (flags & CTC_CONCAT) {
        long long part = 0;
        bool bad = false;
        for (long long k = threadIdx.x; k < q.n; k += blockDim.x) {
            const long long v = ctc_index(target_lengths, k * tl_s, flags & CTC_TL_INT32);
            bad |= v < 0;
            part += v;
        }
        part = block_sum(part, red);
        bad = __syncthreads_or(bad);
        if (threadIdx.x == 0) red[32] = part;
        __syncthreads();
        off = red[32];
        ok = ok && !bad && off + q.tl <= tg_len;
        q.base = steps * (2 * off + q.n);
        q.rowlen = 2 * q.tl + 1;
    } else {
        ok = ok && q.tl <= tg_len;
        q.base = q.n * steps * row;
        q.rowlen = row;
    }
    q.L = ok ? 2 * q.tl + 1 : 0;
    bool bad = false;
    for (long long s = threadIdx.x; s < q.L; s += blockDim.x) {
        long long c = blank;
        if (s & 1) {
            const long long j = (s - 1) >> 1;
            c = ctc_index(targets, (flags & CTC_CONCAT) ? (off + j) * tg_ss : q.n * tg_sn + j * tg_ss,
                          flags & CTC_TG_INT32);
            bad |= c < 0 || c >= classes;
        }
        lab[s] = (int)c;
    }
    q.ok = ok && !__syncthreads_or(bad);
    return q;
}

// The upstream gradient of sequence n: grad_output (a number, a 0-d array or one per
// sequence), over batch max(tl, 1) for 'mean'.
template <typename T>
__device__ __forceinline__ acc_t<T> ctc_upstream(const T* go, long long go_s, double go_value,
                                                 long long flags, long long n, long long tl,
                                                 long long batch) {
    using A = acc_t<T>;
    A g = (flags & CTC_GO_ROWS) ? to_acc(go[n * go_s]) : (flags & CTC_GO_DEVICE) ? to_acc(go[0])
                                                                          : A(go_value);
    if (flags & CTC_MEAN) g = g / A(batch) / A(tl > 1 ? tl : 1);
    return g;
}

// alpha over a sequence's input, one step a barrier; lp of each thread's positions loaded two
// steps ahead (a gather the step's arithmetic hides).
template <typename T>
__global__ void __launch_bounds__(CTC_BLOCK) ctc_alpha(CTC_PARAMS(T)) {
    using A = acc_t<T>;
    if (blockIdx.x >= batch) return;     // an empty batch's one block
    extern __shared__ __align__(16) unsigned char ctc_smem[];
    A* buf = reinterpret_cast<A*>(ctc_smem);                  // [2][lcap]: alpha at t-1, t
    int* lab = reinterpret_cast<int*>(buf + 2 * lcap);        // [lcap]
    __shared__ long long red[33];
    const CtcSeq q = ctc_sequence<T>(CTC_ARGS, lab, red);
    const A ninf = neg_inf(A(0));
    A result;
    if (!q.ok) {
        result = quiet_nan(A(0));
    } else if (q.il == 0) {
        result = q.tl == 0 ? -A(0) : -ninf;
    } else {
        const long long L = q.L;
        const T* seq = lp + q.n * lp_sn;
        A* kept = (flags & CTC_KEEP_ALPHA) ? alpha + q.base : nullptr;
        A c0[CTC_KMAX], c1[CTC_KMAX], cur[CTC_KMAX];
        auto load = [&](long long t, A (&dst)[CTC_KMAX]) {
            #pragma unroll
            for (int k = 0; k < CTC_KMAX; ++k) {
                const long long s = threadIdx.x + (long long)k * blockDim.x;
                if (s < L && t < q.il) dst[k] = to_acc(seq[t * lp_st + lab[s] * lp_sc]);
            }
        };
        load(0, c0);
        load(1, c1);
        for (long long t = 0; t < q.il; ++t) {
            ctc_advance(cur, c0, c1);
            load(t + 2, c1);
            const A* prev = buf + ((t + 1) & 1) * lcap;
            A* next = buf + (t & 1) * lcap;
            #pragma unroll
            for (int k = 0; k < CTC_KMAX; ++k) {
                const long long s = threadIdx.x + (long long)k * blockDim.x;
                if (s >= L) break;
                const A a = ctc_step<1>(prev, lab, L, s, t == 0, cur[k]);
                next[s] = a;
                if (kept != nullptr) kept[t * q.rowlen + s] = a;
            }
            __syncthreads();
        }
        const A* last = buf + ((q.il - 1) & 1) * lcap;
        const A a1 = last[L - 1], a2 = L > 1 ? last[L - 2] : ninf;
        const A m = amax(a1, a2);
        result = m == ninf ? -ninf : -(m + lg(exp(a1 - m) + exp(a2 - m)));
    }
    if (threadIdx.x == 0) {
        nll[q.n] = result;
        if (loss != nullptr)
            loss[q.n] = from_acc<T>((flags & CTC_ZERO_INFINITY) && result == -ninf ? A(0) : result);
    }
}

// value[0] = the batch's sum of nll (each over max(tl, 1) and the sum over batch for 'mean'),
// an infinite one as 0 with zero_infinity; in double, in a fixed order.
template <typename T>
__global__ void __launch_bounds__(CTC_FINISH_BLOCK) ctc_finish(CTC_PARAMS(T)) {
    using A = acc_t<T>;
    double acc = 0.0;
    for (long long n = threadIdx.x; n < batch; n += blockDim.x) {
        A v = nll[n];
        if ((flags & CTC_ZERO_INFINITY) && v == -neg_inf(A(0))) v = A(0);
        if (flags & CTC_MEAN) {
            const long long tl = ctc_index(target_lengths, n * tl_s, flags & CTC_TL_INT32);
            v = v / A(tl > 1 ? tl : 1);
        }
        acc += double(v);
    }
    const double total = block_sum(acc, wide_scratch());
    if (threadIdx.x == 0)
        value[0] = from_acc<T>(A((flags & CTC_MEAN) ? total / double(batch) : total));
}

// lse over a warp's values: the max by a butterfly, then the sum of e^(v - max) by another
// (fixed orders: the same bits every run).
template <typename A>
__device__ __forceinline__ A ctc_warp_lse(A v) {
    A m = v;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = amax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (m == neg_inf(A(0))) return m;
    A e = exp(v - m);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) e += __shfl_xor_sync(0xffffffffu, e, o);
    return m + lg(e);
}

// A sequence's label groups, written by ctc_beta for ctc_grad: [CTC_GROUP_HEAD ints: alpha's
// base (lo, hi), the number of distinct labels other than the blank][lab: the extended
// labels][link: the next position with the same label, -1 after the last][heads: the first
// position of each distinct label other than the blank, in position order], each lcap ints.
constexpr int CTC_GROUP_HEAD = 3;

// beta backward over a sequence's input; at each step alpha + beta written over the kept alpha
// (ctc_grad forms the gradient from it, in parallel over steps).  One barrier a step, as
// ctc_alpha.  First the label groups: each position finds the next with its label (a scan of
// the odd positions: O(L^2 / threads) once), warp 0 lists the first positions in order.
template <typename T>
__global__ void __launch_bounds__(CTC_BLOCK) ctc_beta(CTC_PARAMS(T)) {
    using A = acc_t<T>;
    if (blockIdx.x >= batch) return;
    extern __shared__ __align__(16) unsigned char ctc_smem[];
    A* buf = reinterpret_cast<A*>(ctc_smem);                  // [2][lcap]: beta at t+1, t
    int* lab = reinterpret_cast<int*>(buf + 2 * lcap);        // [lcap]
    __shared__ long long red[33];
    const CtcSeq q = ctc_sequence<T>(CTC_ARGS, lab, red);
    const A ninf = neg_inf(A(0));
    const A nl = nll[q.n];
    if (!q.ok || q.il == 0 || !(nl < -ninf)) return;     // ctc_grad writes the whole gradient
    const long long L = q.L;
    int* group = groups + q.n * (3 * lcap + CTC_GROUP_HEAD);
    int* glab = group + CTC_GROUP_HEAD;
    int* glink = glab + lcap;
    int* gheads = glink + lcap;
    if (threadIdx.x == 0) {
        group[0] = (int)(q.base & 0xffffffffll);
        group[1] = (int)(q.base >> 32);
    }
    unsigned char* linked = reinterpret_cast<unsigned char*>(buf);   // [lcap], before the loop
    for (long long s = threadIdx.x; s < L; s += blockDim.x) linked[s] = 0;
    __syncthreads();
    for (long long s = threadIdx.x; s < L; s += blockDim.x) {
        int next = -1;
        if ((s & 1) && lab[s] != blank) {
            for (long long u = s + 2; u < L; u += 2) {
                if (lab[u] == lab[s]) { next = (int)u; break; }
            }
        }
        glab[s] = lab[s];
        glink[s] = next;
        if (next >= 0) linked[next] = 1;     // a later position of a label: not its first
    }
    __syncthreads();
    if (threadIdx.x < 32) {      // warp 0: the first position of each label, in order
        int count = 0;
        for (long long base = 0; base < L; base += 32) {
            const long long s = base + threadIdx.x;
            const bool first = s < L && (s & 1) && lab[s] != blank && !linked[s];
            const unsigned ballot = __ballot_sync(0xffffffffu, first);
            if (first) gheads[count + __popc(ballot & ((1u << threadIdx.x) - 1u))] = (int)s;
            count += __popc(ballot);
        }
        if (threadIdx.x == 0) group[2] = count;
    }
    __syncthreads();             // buf is the recursion's from here
    const T* seq = lp + q.n * lp_sn;
    A* kept = alpha + q.base;
    A c0[CTC_KMAX], c1[CTC_KMAX], cur[CTC_KMAX], k0[CTC_KMAX], k1[CTC_KMAX], kcur[CTC_KMAX];
    auto load = [&](long long t, A (&dst)[CTC_KMAX], A (&ka)[CTC_KMAX]) {
        #pragma unroll
        for (int k = 0; k < CTC_KMAX; ++k) {
            const long long s = threadIdx.x + (long long)k * blockDim.x;
            if (s < L && t >= 0) {
                dst[k] = to_acc(seq[t * lp_st + lab[s] * lp_sc]);
                ka[k] = kept[t * q.rowlen + s];
            }
        }
    };
    load(q.il - 1, c0, k0);
    load(q.il - 2, c1, k1);
    for (long long t = q.il - 1; t >= 0; --t) {
        ctc_advance(cur, c0, c1);
        ctc_advance(kcur, k0, k1);
        load(t - 2, c1, k1);
        const A* prev = buf + ((t + 1) & 1) * lcap;
        A* next = buf + (t & 1) * lcap;
        #pragma unroll
        for (int k = 0; k < CTC_KMAX; ++k) {
            const long long s = threadIdx.x + (long long)k * blockDim.x;
            if (s >= L) break;
            const A b = ctc_step<-1>(prev, lab, L, s, t == q.il - 1, cur[k]);
            next[s] = b;
            kept[t * q.rowlen + s] = kcur[k] + b;
        }
        __syncthreads();
    }
}

// The gradient, a warp a (t, n) row: grad = g exp(lp) for t < il, 0 after (a sequence whose
// loss is NaN, or infinite without zero_infinity: NaN for t < il, every t when its lengths are
// out of range; an infinite one with zero_infinity: 0); then, after the warp's barrier, each
// label l'(s) of the row overwritten with its whole term: the blank's lse over its positions
// by the warp (a butterfly), each other label's by one lane walking its positions in order.
template <typename T>
__global__ void __launch_bounds__(CTC_GRAD_BLOCK) ctc_grad(CTC_PARAMS(T)) {
    using A = acc_t<T>;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const long long rows = steps * batch;
    const A ninf = neg_inf(A(0));
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
         r += warps) {
        const long long t = r / batch, n = r - t * batch;
        const long long il = ctc_index(input_lengths, n * il_s, flags & CTC_IL_INT32);
        const long long tl = ctc_index(target_lengths, n * tl_s, flags & CTC_TL_INT32);
        const A v = nll[n];
        const bool inf = v == -ninf;
        // 0: g exp(lp) and the label terms; 1: zero; 2: NaN
        int mode = t < il ? 0 : 1;
        if (inf && (flags & CTC_ZERO_INFINITY)) mode = 1;
        else if ((inf && t < il) || v != v) mode = 2;
        const A g = ctc_upstream<T>(go, go_s, go_value, flags, n, tl, batch);
        const T* in = lp + t * lp_st + n * lp_sn;
        T* out = grad + r * classes;
        for (long long c = lane; c < classes; c += 32) {
            A o = mode == 0 ? g * exp(to_acc(in[c * lp_sc])) : mode == 1 ? A(0) : quiet_nan(A(0));
            out[c] = from_acc<T>(o);
        }
        if (mode != 0) continue;
        __syncwarp();
        const int* group = groups + n * (3 * lcap + CTC_GROUP_HEAD);
        const int* glab = group + CTC_GROUP_HEAD;
        const int* glink = glab + lcap;
        const int* gheads = glink + lcap;
        const long long base = (long long)(unsigned)group[0] | ((long long)group[1] << 32);
        const long long rowlen = (flags & CTC_CONCAT) ? 2 * tl + 1 : row;
        const A* ab = alpha + base + t * rowlen;
        const long long L = 2 * tl + 1;
        A m = ninf, e = A(0);     // the blank: an online lse of this lane's positions
        for (long long s = lane; s < L; s += 32) {
            if (glab[s] != blank) continue;
            const A x = ab[s];
            if (x > m) { e = e * exp(m - x) + A(1); m = x; }
            else if (x != ninf) e += exp(x - m);
        }
        A part = m == ninf ? m : m + lg(e);
        part = ctc_warp_lse(part);
        if (lane == 0) {
            const A lpb = to_acc(in[blank * lp_sc]);
            out[blank] = from_acc<T>(g * (exp(lpb) - exp(part + v - lpb)));
        }
        const int heads = group[2];
        for (int j = lane; j < heads; j += 32) {
            const int head = gheads[j];
            m = ninf;
            e = A(0);
            for (int u = head; u >= 0; u = glink[u]) {
                const A x = ab[u];
                if (x > m) { e = e * exp(m - x) + A(1); m = x; }
                else if (x != ninf) e += exp(x - m);
            }
            const A w = m == ninf ? m : m + lg(e);
            const int c = glab[head];
            const A lpc = to_acc(in[c * lp_sc]);
            out[c] = from_acc<T>(g * (exp(lpc) - exp(w + v - lpc)));
        }
    }
}

}  // namespace cupyloss
