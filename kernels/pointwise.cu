// One kernel family for every pointwise loss: value, gradients, or both in one pass.
//
// For an element with input x, target t and upstream gradient g (grad_output times the
// reduction's scale: 1/n for mean, 1/batch for batchmean, 1 for sum and none):
//   loss      l   = Op::value(x, t)
//   gradients g_x = g * Op::d_input(x, t),   g_t = g * Op::d_target(x, t)
//
// What a launch writes is chosen by its non-null output pointers:
//   loss       elementwise loss (reduction 'none')
//   value      the 0-d reduced loss: sum l / divisor
//   gx0, gt0   the 0-d gradient of an operand that is one element broadcast everywhere
//   gx, gt     gradients of an operand whose shape is the broadcast shape, at the flat index
//   gx_ws,gt_ws  accumulator-typed gradients of a broadcast operand: per element (flat kernel)
//              or per row block (rows kernel); reduce.cu sums them into the operand's shape
// The 0-d results are finished in the same launch (grid_sum_out in common.cuh): one block
// writes them directly, several blocks leave per-block partials and the last one adds them.
//
// Two layouts of the broadcast shape:
//   pointwise_flat   any strides, through Geometry (VEC > 1 only for 1-D strides 0 or 1)
//   pointwise_rows   [rows, cols] where one operand is a single row broadcast over the rows
//                    (ROW_IS_X: the input; otherwise the target):
//                    that operand's gradient is summed down each column in registers, so the
//                    broadcast operand is read once and its gradient costs no extra pass.
// Both are grid-stride loops over 64-bit indices; block sums use the fixed tree in common.cuh,
// so a given device and shape give bitwise the same results on every run.
#include "common.cuh"
#include "losses.cuh"

namespace cupyloss {

enum : long long {
    FLAG_LOG_TARGET = 1,   // kl_div option
    FLAG_PROB_INPUT = 2,   // kl_div option log_input=False: input holds probabilities
    FLAG_GO_DEVICE = 4,    // g is read from go[0] (a 0-d device array) instead of go_value
    FLAG_GO_ELEMENTWISE = 8,  // g is read elementwise from go (operand 2 of the geometry)
};

template <typename A>
__device__ __forceinline__ LossArgs<A> make_args(double margin, long long flags) {
    LossArgs<A> a;
    a.margin = A(margin);
    a.log_target = (flags & FLAG_LOG_TARGET) != 0;
    a.log_input = (flags & FLAG_PROB_INPUT) == 0;
    return a;
}

// Per-thread running sums of the quantities reduced to 0-d outputs.
template <typename A>
struct Sums {
    A loss = A(0), gx = A(0), gt = A(0);
};

// The 0-d outputs of a launch: the reduced loss and the gradients of 0-d-broadcast operands.
template <typename T>
struct Scalars {
    T* value;             // sum of the loss / divisor, or null
    T* gx;                // sum of the input gradient (input is one broadcast element), or null
    T* gt;                // likewise for the target
    acc_t<T>* partials;   // [3, nblocks] when the grid has several blocks and any of the above
    unsigned int* ticket; // zero before the launch, zero again after it
    double divisor;       // n for mean, input.shape[0] for batchmean, else 1
};

template <typename T>
__device__ __forceinline__ void finish(const Sums<acc_t<T>>& s, const Scalars<T>& o,
                                       long long block, long long nblocks, acc_t<T>* scratch) {
    using A = acc_t<T>;
    const A v[3] = {s.loss, s.gx, s.gt};
    T* const out[3] = {o.value, o.gx, o.gt};
    const A div[3] = {A(o.divisor), A(1), A(1)};
    grid_sum_out<T, 3>(v, out, div, o.partials, o.ticket, block, nblocks, scratch);
}

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, long long i, long long stride,
                                         acc_t<T> (&out)[VEC]) {
    if (VEC == 1 || stride == 0) {
        const acc_t<T> v = to_acc(p[i * stride]);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = v;
        return;
    }
    if constexpr (VEC > 1) {
        // Each element is read once: a streaming (evict-first) 16-byte load.
        static_assert(sizeof(Vec<T, VEC>) == sizeof(int4), "vector loads are 16 bytes");
        const int4 raw = __ldcs(reinterpret_cast<const int4*>(p + i));
        const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(&raw);
        #pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = to_acc(v.v[j]);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ p, long long i, const acc_t<T> (&in)[VEC]) {
    Vec<T, VEC> v;
    #pragma unroll
    for (int j = 0; j < VEC; ++j) v.v[j] = from_acc<T>(in[j]);
    if constexpr (VEC == 1) {
        *reinterpret_cast<Vec<T, VEC>*>(p + i) = v;
    } else {  // written once, read by a later kernel: a streaming store
        __stcs(reinterpret_cast<int4*>(p + i), *reinterpret_cast<const int4*>(&v));
    }
}

template <typename A, int VEC>
__device__ __forceinline__ void store_vec_acc(A* __restrict__ p, long long i, const A (&in)[VEC]) {
    #pragma unroll
    for (int j = 0; j < VEC; ++j) p[i + j] = in[j];
}

// The work on VEC consecutive elements starting at flat index i, whose operands are already in
// registers.  Every output is optional.
template <typename T, typename Op, int VEC>
__device__ __forceinline__ void visit(const acc_t<T> (&x)[VEC], const acc_t<T> (&t)[VEC],
                                      const acc_t<T> (&g)[VEC], const LossArgs<acc_t<T>>& a,
                                      long long i, const Scalars<T>& o,
                                      T* __restrict__ loss, T* __restrict__ gx, T* __restrict__ gt,
                                      acc_t<T>* __restrict__ gx_ws, acc_t<T>* __restrict__ gt_ws,
                                      Sums<acc_t<T>>& s) {
    using A = acc_t<T>;
    A r[VEC];
    if (loss != nullptr || o.value != nullptr) {
        #pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = Op::value(x[j], t[j], a);
        if (loss != nullptr) store_vec<T, VEC>(loss, i, r);
        else {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) s.loss += r[j];
        }
    }
    if (gx != nullptr || gx_ws != nullptr || o.gx != nullptr) {
        #pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = g[j] * Op::d_input(x[j], t[j], a);
        if (gx != nullptr) store_vec<T, VEC>(gx, i, r);
        else if (gx_ws != nullptr) store_vec_acc<A, VEC>(gx_ws, i, r);
        else {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) s.gx += r[j];
        }
    }
    if (gt != nullptr || gt_ws != nullptr || o.gt != nullptr) {
        #pragma unroll
        for (int j = 0; j < VEC; ++j) r[j] = g[j] * Op::d_target(x[j], t[j], a);
        if (gt != nullptr) store_vec<T, VEC>(gt, i, r);
        else if (gt_ws != nullptr) store_vec_acc<A, VEC>(gt_ws, i, r);
        else {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) s.gt += r[j];
        }
    }
}

template <typename T>
__device__ __forceinline__ acc_t<T> upstream_scalar(const T* __restrict__ go, double go_value,
                                                    double grad_scale, long long flags) {
    using A = acc_t<T>;
    const A g = (flags & FLAG_GO_DEVICE) ? to_acc(go[0]) : A(go_value);
    return g * A(grad_scale);
}

// Flat layout.  With VEC > 1 the host guarantees a 1-D geometry whose strides are 0 or 1 and
// 16-byte aligned pointers; elements past the last whole vector take the VEC == 1 path.
template <typename T, typename Op, int VEC>
__global__ void __launch_bounds__(256) pointwise_flat(
        const T* __restrict__ x,       // input, addressed through geo.stride[0]
        const T* __restrict__ t,       // target, addressed through geo.stride[1]
        const T* __restrict__ go,      // grad_output: [1] or addressed through geo.stride[2]
        const Geometry geo,            // the broadcast shape, coalesced
        const long long n,             // elements in the broadcast shape
        const double margin, const long long flags,
        const double go_value,         // grad_output when it is a host scalar
        const double grad_scale,       // 1/n, 1/batch or 1
        T* __restrict__ loss,          // [n] or null
        const Scalars<T> o,            // 0-d outputs and their partials [3, gridDim.x]
        T* __restrict__ gx, T* __restrict__ gt,              // [n] or null
        acc_t<T>* __restrict__ gx_ws, acc_t<T>* __restrict__ gt_ws) {  // [n] or null
    using A = acc_t<T>;
    extern __shared__ unsigned char smem_raw[];
    A* scratch = reinterpret_cast<A*>(smem_raw);  // [blockDim.x / 32]
    const LossArgs<A> a = make_args<A>(margin, flags);
    const bool go_elem = (flags & FLAG_GO_ELEMENTWISE) != 0;
    const A g0 = upstream_scalar<T>(go, go_value, grad_scale, flags);
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    Sums<A> s;

    long long done = 0;
    if (VEC > 1) {
        const long long nvec = n / VEC;
        #pragma unroll 4
        for (long long v = tid; v < nvec; v += nthreads) {
            const long long i = v * VEC;
            A xv[VEC], tv[VEC], gv[VEC];
            load_vec<T, VEC>(x, i, geo.stride[0][0], xv);
            load_vec<T, VEC>(t, i, geo.stride[1][0], tv);
            if (go_elem) {
                load_vec<T, VEC>(go, i, geo.stride[2][0], gv);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) gv[j] *= A(grad_scale);
            } else {
                #pragma unroll
                for (int j = 0; j < VEC; ++j) gv[j] = g0;
            }
            visit<T, Op, VEC>(xv, tv, gv, a, i, o, loss, gx, gt, gx_ws, gt_ws, s);
        }
        done = nvec * VEC;
    }
    for (long long i = done + tid; i < n; i += nthreads) {
        long long off[3];
        geo.offsets(i, off);
        A xv[1] = {to_acc(x[off[0]])};
        A tv[1] = {to_acc(t[off[1]])};
        A gv[1] = {go_elem ? to_acc(go[off[2]]) * A(grad_scale) : g0};
        visit<T, Op, 1>(xv, tv, gv, a, i, o, loss, gx, gt, gx_ws, gt_ws, s);
    }
    finish<T>(s, o, blockIdx.x, gridDim.x, scratch);
}

// Rows layout: the broadcast shape is [rows, cols]; the operand named by ROW_IS_X (input when
// true, target when false) is a single contiguous row of `cols` elements, every other operand
// is a contiguous [rows, cols] array.  Block (bx, by) covers columns
// [bx * tx * VEC, (bx + 1) * tx * VEC) of the rows [by * rows_per_block, (by + 1) * rows_per_block);
// its threads form ty = blockDim.x / tx lanes down the rows, each taking UNROLL rows per step
// with all their loads issued before any use.  The row operand's values stay in registers and
// its gradient is summed down the column in registers, then across the ty lanes in shared
// memory in lane order, and written to ws[by, col]; reduce.cu's sum_rows adds the row blocks.
// A grid of one row block writes the row gradient straight to g_row (one launch in all).
template <typename T, typename Op, int VEC, bool ROW_IS_X>
__global__ void __launch_bounds__(256) pointwise_rows(
        const T* __restrict__ x,       // [rows, cols], or [cols] when ROW_IS_X
        const T* __restrict__ t,       // [rows, cols], or [cols] when !ROW_IS_X
        const T* __restrict__ go,      // [rows, cols] with FLAG_GO_ELEMENTWISE, [1] or unused
        const long long rows, const long long cols,
        const long long rows_per_block,
        const long long tx,            // threads along a row: a power of two, 32..blockDim.x
        const double margin, const long long flags,
        const double go_value, const double grad_scale,
        T* __restrict__ loss,          // [rows, cols] or null
        const Scalars<T> o,            // the 0-d loss (never gradients here) and its partials
        T* __restrict__ g_full,        // gradient of the [rows, cols] operand, or null
        acc_t<T>* __restrict__ ws,     // [gridDim.y, cols] gradient of the row operand, or null
        T* __restrict__ g_row) {       // [cols] gradient of the row operand when gridDim.y == 1
    using A = acc_t<T>;
    constexpr int UNROLL = 4;
    extern __shared__ unsigned char smem_raw[];
    A* smem = reinterpret_cast<A*>(smem_raw);  // [max(ty * tx * VEC, blockDim.x / 32)]
    const LossArgs<A> a = make_args<A>(margin, flags);
    const bool go_elem = (flags & FLAG_GO_ELEMENTWISE) != 0;
    const bool want_row_grad = ws != nullptr || g_row != nullptr;
    const A g0 = upstream_scalar<T>(go, go_value, grad_scale, flags);
    const A gs = A(grad_scale);
    const long long lx = threadIdx.x % tx;
    const long long ly = threadIdx.x / tx;
    const long long ty = blockDim.x / tx;
    const long long c = ((long long)blockIdx.x * tx + lx) * VEC;
    const long long r0 = (long long)blockIdx.y * rows_per_block;
    const long long r1 = min(rows, r0 + rows_per_block);
    const bool active = c < cols;
    const T* full = ROW_IS_X ? t : x;
    T* gx = ROW_IS_X ? nullptr : g_full;
    T* gt = ROW_IS_X ? g_full : nullptr;

    Sums<A> s;
    A row_vals[VEC], row_grad[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) row_grad[j] = A(0);
    if (active) load_vec<T, VEC>(ROW_IS_X ? x : t, c, 1, row_vals);

    long long r = r0 + ly;
    while (active && r < r1) {
        A fv[UNROLL][VEC], gv[UNROLL][VEC];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long ru = r + u * ty;
            if (ru < r1) {
                load_vec<T, VEC>(full, ru * cols + c, 1, fv[u]);
                if (go_elem) load_vec<T, VEC>(go, ru * cols + c, 1, gv[u]);
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long ru = r + u * ty;
            if (ru >= r1) break;
            #pragma unroll
            for (int j = 0; j < VEC; ++j) gv[u][j] = go_elem ? gv[u][j] * gs : g0;
            const A (&xv)[VEC] = ROW_IS_X ? row_vals : fv[u];
            const A (&tv)[VEC] = ROW_IS_X ? fv[u] : row_vals;
            visit<T, Op, VEC>(xv, tv, gv[u], a, ru * cols + c, o, loss, gx, gt,
                              nullptr, nullptr, s);
            if (want_row_grad) {
                #pragma unroll
                for (int j = 0; j < VEC; ++j)
                    row_grad[j] += gv[u][j] * (ROW_IS_X ? Op::d_input(xv[j], tv[j], a)
                                                        : Op::d_target(xv[j], tv[j], a));
            }
        }
        r += UNROLL * ty;
    }

    const long long block = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    finish<T>(s, o, block, (long long)gridDim.x * gridDim.y, smem);
    if (want_row_grad) {
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < VEC; ++j) smem[(ly * tx + lx) * VEC + j] = row_grad[j];
        __syncthreads();
        if (ly == 0 && active) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                A acc = smem[lx * VEC + j];
                for (long long k = 1; k < ty; ++k) acc += smem[(k * tx + lx) * VEC + j];
                if (g_row != nullptr) g_row[c + j] = from_acc<T>(acc);
                else ws[(long long)blockIdx.y * cols + c + j] = acc;
            }
        }
    }
}

}  // namespace cupyloss
