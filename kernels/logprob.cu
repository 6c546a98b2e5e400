// Per-token log-probabilities and entropy of softmax(z / T) over rows of logits z (the fused
// head's chunks of float32 logits, cupyloss.linear.linear_log_probs), and their gradient.
//
//   logprob_stats   per row: lse = log sum_c exp(z_c / T), log p(y) = z_y / T - lse (0 on a row
//                   whose target is ignore_index), entropy H = -sum_c p_c log p_c.
//   logprob_grad    per element of a slice of the classes (all of them, or those of the
//                   low-memory plan's slice): the gradient of g_lp log p(y) + g_H H at z,
//                     dz_c = (g_lp ([c == y] - p_c) - g_H p_c (u_c + H)) / T,
//                     u_c = z_c / T - lse, p_c = exp(u_c),
//                   since dH/du_c = -p_c (u_c + H); stored in G (a 16-bit input's dtype: rounded
//                   once, as torch's autograd rounds the logits' gradient of a 16-bit product).
//
// A block takes a row at a time (rows in a grid-stride loop).  The entropy is formed as
// log s - a / s from s = sum exp(z - m) and a = sum exp(z - m) (z - m), both sums of terms of
// one sign (z - m <= 0), merged across threads with the running maximum m: no cancellation.
// A class whose logit is -inf adds nothing (its p log p is 0); a NaN logit makes its row NaN.
// The sums run in a fixed order: the same inputs give bitwise the same results.
#include "common.cuh"

namespace cupyloss {

enum : long long {
    LP_INDEX64 = 1,      // targets are int64 (else int32)
};

__device__ __forceinline__ float lp_ninf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double lp_ninf(double) {
    return __longlong_as_double(0xfff0000000000000LL);
}
__device__ __forceinline__ float lp_nan(float) { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ double lp_nan(double) {
    return __longlong_as_double(0x7ff8000000000000LL);
}

constexpr int LP_BLOCK = 256;   // threads a block (_launch.BLOCK)
constexpr int LP_BATCH = 8;     // logits a thread loads before it folds them into its sums

// m: the running maximum; s = sum exp(z - m); a = sum exp(z - m) (z - m) <= 0.
template <typename A>
struct SoftStat {
    A m, s, a;
};

template <typename A>
__device__ __forceinline__ SoftStat<A> soft_empty() {
    return {lp_ninf(A(0)), A(0), A(0)};
}

// x's sums taken relative to m >= x.m: s' = f s, a' = f (a + (x.m - m) s), f = exp(x.m - m).
template <typename A>
__device__ __forceinline__ void soft_shift(SoftStat<A>& x, A m) {
    if (x.s == A(0) || x.m == m) {
        if (x.s == A(0)) x.a = A(0);
        x.m = m;
        return;
    }
    const A d = x.m - m;
    const A f = exp(d);
    x.a = f * (x.a + d * x.s);
    x.s = f * x.s;
    x.m = m;
}

template <typename A>
__device__ __forceinline__ SoftStat<A> soft_merge(SoftStat<A> x, SoftStat<A> y) {
    if (y.s == A(0) && y.m == lp_ninf(A(0))) return x;
    if (x.s == A(0) && x.m == lp_ninf(A(0))) return y;
    const A m = x.m > y.m ? x.m : y.m;
    if (m != m) return {m, m, m};                     // NaN
    soft_shift(x, m);
    soft_shift(y, m);
    return {m, x.s + y.s, x.a + y.a};
}

// The block's merged SoftStat, in every thread (warp butterflies, then the warps in order).
template <typename A>
__device__ __forceinline__ SoftStat<A> soft_block(SoftStat<A> st) {
    __shared__ A part[3][LP_BLOCK / 32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        SoftStat<A> y;
        y.m = __shfl_xor_sync(0xffffffffu, st.m, o);
        y.s = __shfl_xor_sync(0xffffffffu, st.s, o);
        y.a = __shfl_xor_sync(0xffffffffu, st.a, o);
        st = (threadIdx.x & o) ? soft_merge(y, st) : soft_merge(st, y);
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        part[0][warp] = st.m;
        part[1][warp] = st.s;
        part[2][warp] = st.a;
    }
    __syncthreads();
    SoftStat<A> all = {part[0][0], part[1][0], part[2][0]};
    for (int w = 1; w < warps; ++w) all = soft_merge(all, SoftStat<A>{part[0][w], part[1][w],
                                                                       part[2][w]});
    __syncthreads();                                   // part is reused by the next row
    return all;
}

template <typename A>
__device__ __forceinline__ long long lp_target(const void* tgt, long long r, long long flags) {
    return (flags & LP_INDEX64) ? static_cast<const long long*>(tgt)[r]
                                : (long long)static_cast<const int*>(tgt)[r];
}

// z / T as z times 1 / T (formed in double, rounded once): within a rounding of the quotient.
template <typename A>
__device__ __forceinline__ A lp_scaled(A z, A inv_temp) {
    return z * inv_temp;
}

// The parameters, one 64-bit word each, in this order:
//   z              [rows, cols] logits, row r at r * z_rs
//   tgt            int32/int64 [rows] class indices
//   rows, cols, z_rs, flags (LP_*), ignore_index, temperature (double)
//   logp           [rows] log p(target): 0 where the target is ignore_index, NaN outside
//                  [0, cols)
//   ent            [rows] entropy, or null
//   lse            [rows] logsumexp of z / T, or null
template <typename A>
__global__ void __launch_bounds__(LP_BLOCK) logprob_stats(
        const A* __restrict__ z, const void* __restrict__ tgt, const long long rows,
        const long long cols, const long long z_rs, const long long flags,
        const long long ignore_index, const double temperature, A* __restrict__ logp,
        A* __restrict__ ent, A* __restrict__ lse) {
    const A temp = A(1.0 / temperature);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const A* row = z + r * z_rs;
        SoftStat<A> st = soft_empty<A>();
        for (long long c0 = threadIdx.x; c0 < cols; c0 += (long long)LP_BATCH * blockDim.x) {
            A v[LP_BATCH];
            A m = st.m;
            #pragma unroll
            for (int k = 0; k < LP_BATCH; ++k) {
                const long long c = c0 + (long long)k * blockDim.x;
                v[k] = c < cols ? lp_scaled(__ldcs(row + c), temp) : lp_ninf(A(0));
                m = v[k] > m ? v[k] : m;
            }
            soft_shift(st, m);
            #pragma unroll
            for (int k = 0; k < LP_BATCH; ++k) {
                const A d = v[k] - m;
                const A e = exp(d);
                if (e != A(0) || d != d) {             // -inf adds nothing; NaN poisons the row
                    st.s += e;
                    st.a += e * d;
                }
            }
        }
        st = soft_block(st);
        if (threadIdx.x == 0) {
            const A log_s = log(st.s);
            const A l = st.m + log_s;
            if (lse != nullptr) lse[r] = l;
            if (ent != nullptr) ent[r] = log_s - st.a / st.s;
            const long long y = lp_target<A>(tgt, r, flags);
            A out = A(0);
            if (y != ignore_index) {
                out = (y >= 0 && y < cols) ? lp_scaled(row[y], temp) - l
                                           : lp_nan(A(0));
            }
            logp[r] = out;
        }
    }
}

// The parameters, one 64-bit word each, in this order:
//   z              [rows, cols] logits of classes c0 .. c0 + cols - 1, row r at r * z_rs
//   tgt            int32/int64 [rows] class indices (into all the classes)
//   rows, cols, z_rs, c0, classes (all of them), flags (LP_*), ignore_index,
//   temperature (double)
//   lse, ent       [rows] logprob_stats' (ent may be null when g_ent is)
//   g_lp, g_ent    [rows] upstream gradients of log p(target) and of the entropy, or null (0)
//   dz             [rows, cols] the gradient, row r at r * g_rs (may be z itself when G is A)
template <typename A, typename G>
__global__ void __launch_bounds__(LP_BLOCK) logprob_grad(
        const A* z, const void* __restrict__ tgt, const long long rows, const long long cols,
        const long long z_rs, const long long c0, const long long classes,
        const long long flags, const long long ignore_index, const double temperature,
        const A* __restrict__ lse,
        const A* __restrict__ ent, const A* __restrict__ g_lp, const A* __restrict__ g_ent,
        G* dz, const long long g_rs) {
    const A inv = A(1.0 / temperature);
    const A temp = inv;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long y = lp_target<A>(tgt, r, flags);
        const bool counted = y != ignore_index;
        const A gl = (counted && g_lp != nullptr) ? g_lp[r] : A(0);
        const A gh = g_ent != nullptr ? g_ent[r] : A(0);
        const A l = lse[r];
        const A h = gh != A(0) ? ent[r] : A(0);
        // An out-of-range target: the row is NaN (as its log-probability).
        const A poison = (counted && (y < 0 || y >= classes)) ? lp_nan(A(0)) : A(0);
        const A* row = z + r * z_rs;
        G* out = dz + r * g_rs;
        const long long yc = y - c0;
        #pragma unroll 4
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
            const A u = lp_scaled(row[c], temp) - l;
            const A p = exp(u);
            A v = -p * (gl + gh * (u + h));
            if (c == yc && counted) v += gl;
            v = v * inv + poison;
            out[c] = from_acc<G>(v);
        }
    }
}

// The clipped-surrogate objective of a policy gradient (GRPO and its family, PPO's ratio) per
// token of a chunk, formed from logprob_stats' log p and entropy in the same pass as them, so
// that logprob_grad forms dZ at once:
//   rho = exp(logp - old),  rho_c = clamp(rho, 1 - eps_low, 1 + eps_high)
//   l   = -min(rho A, rho_c A) + beta k3,  k3 = exp(ref - logp) - (ref - logp) - 1
//   dl/dlogp = -rho A where rho A <= rho_c A (the unclipped term, ties included: the min's
//              two gradients are then equal), else 0;  + beta (1 - exp(ref - logp))
// and the token's part of the loss w (l - c H) (w its weight: its mask over the loss type's
// normaliser, c the entropy coefficient), so g_lp = w dl/dlogp and g_ent = -w c.  A token of
// weight 0 adds nothing (its gradients are 0 whatever its values).  old null: the log-probs
// themselves (rho = 1); ref null: no KL term.
//
// The parameters, one 64-bit word each, in this order:
//   logp, ent      [n] logprob_stats' results (all rows of the call)
//   old, ref       [n] the old policy's and the reference's log-probs, or null
//   adv            advantages: token r's is adv[r / adv_div] ([n] with adv_div 1, [n / T]
//                  with adv_div T: one a sequence)
//   w              [n] each token's weight
//   r0, rows       the chunk: tokens r0 .. r0 + rows - 1
//   adv_div, eps_low, eps_high, beta, ent_coef (doubles)
//   g_lp, g_ent    [n] the upstream gradients logprob_grad takes
//   tok            [n, 4] per token: l, k3, rho < 1 - eps_low with A < 0, rho > 1 + eps_high
//                  with A > 0 (1 or 0; the metrics' clipped tokens)
template <typename A>
__global__ void __launch_bounds__(LP_BLOCK) grpo_tokens(
        const A* __restrict__ logp, const A* __restrict__ ent, const A* __restrict__ old,
        const A* __restrict__ ref, const A* __restrict__ adv, const A* __restrict__ w,
        const long long r0, const long long rows, const long long adv_div,
        const double eps_low, const double eps_high, const double beta, const double ent_coef,
        A* __restrict__ g_lp, A* __restrict__ g_ent, A* __restrict__ tok) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = r0 + i;
        const A lp = logp[r];
        const A a = adv[r / adv_div];
        const A rho = old != nullptr ? exp(lp - old[r]) : A(1);
        const A lo = A(1.0 - eps_low), hi = A(1.0 + eps_high);
        const A rho_c = rho < lo ? lo : (rho > hi ? hi : rho);
        const A l1 = rho * a, l2 = rho_c * a;
        A l = -(l1 <= l2 ? l1 : l2);
        A g = l1 <= l2 ? -l1 : A(0);
        A k3 = A(0);
        if (ref != nullptr) {
            const A d = ref[r] - lp;
            const A e = exp(d);
            k3 = e - d - A(1);
            l += A(beta) * k3;
            g += A(beta) * (A(1) - e);
        }
        if (l1 != l1 || l2 != l2) g = l1 + l2;          // NaN stays NaN
        const A wt = w[r];
        g_lp[r] = wt != A(0) ? wt * g : A(0);
        g_ent[r] = wt != A(0) ? -wt * A(ent_coef) : A(0);
        A* t = tok + 4 * r;
        t[0] = l;
        t[1] = k3;
        t[2] = (rho < lo && a < A(0)) ? A(1) : A(0);
        t[3] = (rho > hi && a > A(0)) ? A(1) : A(0);
    }
}

// Distillation (cupyloss.posttrain.linear_jsd): the generalised Jensen-Shannon divergence
// between a student's and a teacher's softmax(logits / T), per row of a chunk (or of a slice of
// the classes) of both heads' float32 logits, with the log-probabilities x = zs / T - lse_s
// (log Q, the student) and y = zt / T - lse_t (log P, the teacher) and M = beta P + (1 - beta) Q
// (the derivation is rowclass.cu's jsd):
//   l   = sum_c beta P_c (y_c - log M_c) + (1 - beta) Q_c (x_c - log M_c)
//   g_c = dl/dx_c = (1 - beta) Q_c (x_c - log M_c)        (beta = 0: -P_c; 1: Q_c (x_c - y_c + 1))
// and through x's log_softmax, dl/dzs_c = (g_c - Q_c sum_k g_k) / T.  With the hard loss's
// weight h (the student's cross entropy at temperature 1 on the target, p1 = softmax(zs)) and
// the row's scale s (1 / the counted rows, read on the device):
//   dz_c = s ((g_c - Q_c G) / T + h (p1_c - [c == y]))
//   distill_stats   per row: l (loss) and G = sum_c g_c (both 0 for a row not counted)
//   distill_grad    dz of the slice's elements from lse_s, lse_t, lse_1 (h != 0) and G
// A row is not counted where tgt is given and its target is ignore_index: its dz is 0.
// The parameters, one 64-bit word each, in this order:
//   zs, zt         [rows, cols] the student's and the teacher's logits of classes c0 .. c0 +
//                  cols - 1 (all of them for distill_stats), row r at r * zs_rs, r * zt_rs
//   tgt            int32/int64 [rows] targets, or null (every row counts)
//   rows, cols, zs_rs, zt_rs, c0, flags (LP_*), ignore_index, temperature, beta, hard (doubles)
//   lse_s, lse_t   [rows] logsumexp of zs / T and zt / T (logprob_stats')
//   lse_1          [rows] logsumexp of zs (temperature 1), read where hard != 0
//   scale          [1] s
//   loss, gsum     [rows] l and G (distill_stats writes them, distill_grad reads G)
//   dz, g_rs       [rows, cols] the student's gradient, row r at r * g_rs (distill_grad)
template <typename A>
__device__ __forceinline__ void jsd_term(A x, A y, double beta, A& l, A& g) {
    if (beta == 0.0) {                                // forward KL(P || Q)
        const A p = exp(y);
        l = p != A(0) ? p * (y - x) : A(0);
        g = -p;
    } else if (beta == 1.0) {                         // reverse KL(Q || P)
        const A q = exp(x);
        l = q != A(0) ? q * (x - y) : A(0);
        g = q != A(0) ? q * (x - y + A(1)) : A(0);
    } else {
        const A mx = x > y ? x : y;
        const A a = exp(y - mx), b = exp(x - mx);
        const A log_m = mx + log(A(beta) * a + A(1.0 - beta) * b);
        const A p = exp(y), q = exp(x);
        const A tp = p != A(0) ? A(beta) * p * (y - log_m) : A(0);
        const A tq = q != A(0) ? A(1.0 - beta) * q * (x - log_m) : A(0);
        l = tp + tq;
        g = tq;
    }
}

template <typename A>
__device__ __forceinline__ A block_sum2(A v, A& w) {
    __shared__ A part[2][LP_BLOCK / 32];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
        w += __shfl_xor_sync(0xffffffffu, w, o);
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        part[0][warp] = v;
        part[1][warp] = w;
    }
    __syncthreads();
    A sv = part[0][0], sw = part[1][0];
    for (int k = 1; k < warps; ++k) {                 // the warps in order: deterministic
        sv += part[0][k];
        sw += part[1][k];
    }
    __syncthreads();
    w = sw;
    return sv;
}

template <typename A>
__global__ void __launch_bounds__(LP_BLOCK) distill_stats(
        const A* __restrict__ zs, const A* __restrict__ zt, const void* __restrict__ tgt,
        const long long rows, const long long cols, const long long zs_rs,
        const long long zt_rs, const long long flags, const long long ignore_index,
        const double temperature, const double beta, const A* __restrict__ lse_s,
        const A* __restrict__ lse_t, A* __restrict__ loss, A* __restrict__ gsum) {
    const A inv = A(1.0 / temperature);
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const bool counted = tgt == nullptr || lp_target<A>(tgt, r, flags) != ignore_index;
        if (!counted) {                               // uniform over the block
            if (threadIdx.x == 0) loss[r] = gsum[r] = A(0);
            continue;
        }
        const A ls = lse_s[r], lt = lse_t[r];
        const A* rs = zs + r * zs_rs;
        const A* rt = zt + r * zt_rs;
        A l_sum = A(0), g_sum = A(0);
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
            A l, g;
            jsd_term(rs[c] * inv - ls, rt[c] * inv - lt, beta, l, g);
            l_sum += l;
            g_sum += g;
        }
        l_sum = block_sum2(l_sum, g_sum);
        if (threadIdx.x == 0) {
            loss[r] = l_sum;
            gsum[r] = g_sum;
        }
    }
}

template <typename A, typename G>
__global__ void __launch_bounds__(LP_BLOCK) distill_grad(
        const A* zs, const A* __restrict__ zt, const void* __restrict__ tgt,
        const long long rows, const long long cols, const long long zs_rs,
        const long long zt_rs, const long long c0, const long long flags,
        const long long ignore_index, const double temperature, const double beta,
        const double hard, const A* __restrict__ lse_s, const A* __restrict__ lse_t,
        const A* __restrict__ lse_1, const A* __restrict__ scale, const A* __restrict__ gsum,
        G* dz, const long long g_rs) {
    const A inv = A(1.0 / temperature);
    const A s = scale[0];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const long long y = tgt != nullptr ? lp_target<A>(tgt, r, flags) : -1;
        const bool counted = tgt == nullptr || y != ignore_index;
        const A ls = lse_s[r], lt = lse_t[r], gs = gsum[r];
        const A l1 = hard != 0.0 ? lse_1[r] : A(0);
        const A* rs = zs + r * zs_rs;
        const A* rt = zt + r * zt_rs;
        G* out = dz + r * g_rs;
        const long long yc = y - c0;
        #pragma unroll 4
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
            A v = A(0);
            if (counted) {
                const A z = rs[c];
                const A x = z * inv - ls;
                A l, g;
                jsd_term(x, rt[c] * inv - lt, beta, l, g);
                v = (g - exp(x) * gs) * inv;
                if (hard != 0.0) {
                    A d = exp(z - l1);
                    if (c == yc) d -= A(1);
                    v += A(hard) * d;
                }
                v *= s;
            }
            out[c] = from_acc<G>(v);
        }
    }
}

}  // namespace cupyloss
