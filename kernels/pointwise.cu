// One kernel family for every pointwise loss: value, gradients, or both in one pass.
//
// A loss Op (kernels/losses.cuh) takes K array operands v[0..K) in torch's order, each
// broadcast on its own, and its own parameter struct p.  For an element with operands v and
// upstream gradient g (grad_output times the reduction's scale: 1/n for mean, 1/batch for
// batchmean, 1 for sum and none):
//   loss        l   = Op::value(v, p)
//   gradients   g_k = g * dl/dv_k            (Op::grad gives every dl/dv_k)
// An operand whose pointer is null reads as fill[k] everywhere (an optional argument left out,
// or a number where torch takes one) and has no gradient.  When a launch wants both, the loss
// is evaluated right after the partials, in the same block, so the compiler computes what they
// share (a log, an exp) once; the loss's own expression is unchanged, so a one-pass call gives
// bitwise the numbers of separate forward and backward calls (the GPU tests check it).
//
// The gradient of an operand broadcast along some dims is g_k summed over those dims:
//   G_k[o] = sum over m of g_k[o, m]      (o: the operand's own elements, m: the broadcast ones)
//
// What a launch writes is chosen by its non-null output pointers:
//   loss       elementwise loss (reduction 'none')
//   o.value    the 0-d reduced loss: sum l / divisor
//   o.g[k]     the 0-d gradient of operand k when it is one element broadcast everywhere
//   g[k]       gradient of operand k when its shape is the broadcast shape (at the flat index);
//              in the rows and reduce kernels also a broadcast operand's G_k when one block
//              (rows) or one unit (reduce) covers each of its elements
//   ws[k]      float64 partial sums of a broadcast operand's G_k, [chunks, its size]: per row
//              block (rows kernel) or per chunk of m (reduce kernel), added in order by the
//              kernel's last block (rows) or unit (reduce) of each output column or group
//              (col_tickets), or without tickets by reduce.cu's sum_chunks
// The 0-d results are finished in the same launch (grid_sum_out in common.cuh): one block
// writes them directly, several blocks leave per-block partials and the last one adds them.
//
// Three layouts of the broadcast shape:
//   pointwise_flat   any strides, through Geometry (VEC > 1 only for 1-D strides 0 or 1); no
//                    gradient of an operand broadcast along some but not all dims
//   pointwise_rows   [rows, cols] where every operand is a full [rows, cols] array, one row of
//                    `cols` broadcast down the rows, or one element: a row operand is read once
//                    and its gradient is summed down each column in registers, so it costs no
//                    extra pass.
//   pointwise_reduce any strides, split into [O, M]: the dims one broadcast operand keeps (O,
//                    its own shape) and the dims it is broadcast along (M).  A warp ("unit")
//                    takes lanes_o elements o and a chunk of m, so G_k is summed in registers,
//                    then across the warp, in the pass that writes everything else.
// rows and reduce are also compiled per CONST, the operands that stay the same across a thread's
// rows (rows) or a unit (reduce): the functor's arithmetic on them is then shared or hoisted.
// flat and rows come as GRAD = false, a value-only instantiation that never touches a gradient
// (the forward of every loss: fewer registers, more resident blocks), and GRAD = true for
// launches that want any gradient; reduce also takes the loss alone of a layout whose
// gradients it would sum, so that the 0-d loss adds up in one order either way.  A gradient
// launch forms the loss of every element right after its partials, unconditionally, and only its
// store or sum depends on what is wanted (Work): a backward call pays for the loss's arithmetic
// beyond what it shares with the partials, and each kernel holds one loop.  With the loss formed
// in a conditional block the compiler did not share a log between the gradient and the loss
// (kl_div took lg_fine twice), and the loop carried every path's code and registers.
// (libdevice's logf and log1pf keep branches of their own, which the compiler leaves in the
// loop: binary_cross_entropy forms them as fixed terms, FixedTerms below.)  The runs:
// docs/tuning.md, "The kernels' code".
// All loop over 64-bit indices (grid-stride, except that value-only flat gives each block one
// contiguous chunk, and flat's grid grows past one wave for large inputs: the launch table's
// FLAT_STEPS_*);
// every sum has an order fixed by the shapes
// (fixed trees in common.cuh, fixed chunk order in reduce.cu), so a given device and shape give
// bitwise the same results on every run.  No float atomics.
#include "common.cuh"
#include "losses.cuh"

namespace cupyloss {

enum : long long {
    FLAG_GO_DEVICE = 1,       // g is read from go[0] (a 0-d device array) instead of go_value
    FLAG_GO_ELEMENTWISE = 2,  // g is read elementwise from go (the geometry's last operand)
};

// How an operand of pointwise_rows is laid out over [rows, cols].
enum : long long {
    KIND_FULL = 0,    // [rows, cols], contiguous
    KIND_ROW = 1,     // [cols], contiguous, the same row for every row
    KIND_SCALAR = 2,  // one element (or none: the fill value)
};

// The launch-shape macros (CUPYLOSS_FLAT_*, _ROWS_*, _REDUCE_*, _GRAD_HEAVY_SIZES) come from
// cupyloss/_tuning.py's launch table through the compile options (_tuning.kernel_defines(), with
// which every kernel is compiled); there is no default here to disagree with the table.
#if !defined(CUPYLOSS_FLAT_UNROLL_VALUE) || \
    !defined(CUPYLOSS_FLAT_UNROLL_VALUE_CHEAP) || \
    !defined(CUPYLOSS_FLAT_UNROLL_GRAD) || \
    !defined(CUPYLOSS_FLAT_MIN_BLOCKS_GRAD_HEAVY) || \
    !defined(CUPYLOSS_FLAT_UNROLL_GRAD_HEAVY) || \
    !defined(CUPYLOSS_ROWS_MIN_BLOCKS_GRAD) || \
    !defined(CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_CHEAP_16) || \
    !defined(CUPYLOSS_ROWS_STEPS_GRAD_CHEAP_16) || \
    !defined(CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_HEAVY) || \
    !defined(CUPYLOSS_ROWS_STEPS_GRAD_HEAVY) || \
    !defined(CUPYLOSS_REDUCE_STEPS) || \
    !defined(CUPYLOSS_REDUCE_STEPS_HEAVY) || \
    !defined(CUPYLOSS_REDUCE_MIN_BLOCKS) || \
    !defined(CUPYLOSS_REDUCE_MIN_BLOCKS_HEAVY) || \
    !defined(CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_STREAM) || \
    !defined(CUPYLOSS_ROWS_STEPS_GRAD_STREAM) || \
    !defined(CUPYLOSS_REDUCE_MIN_BLOCKS_STREAM) || \
    !defined(CUPYLOSS_REDUCE_STEPS_STREAM) || \
    !defined(CUPYLOSS_GRAD_HEAVY_SIZES)
#error "compile with cupyloss._tuning.kernel_defines()"
#endif
// CUPYLOSS_FLAT_UNROLL_*: grid-stride steps pointwise_flat's vector loop takes at once (loads
// of all issued before any is used), for the value-only instantiation, for that of functors
// marked cheap, and for the gradient one.

// Name<Op>::value: functor Op's static constexpr member `member` where it declares one, else
// `fallback` (the functors' own math: HasFixedTerms below).
#define CUPYLOSS_FUNCTOR_TRAIT(Name, member, type, fallback)           \
    template <typename Op, typename = void>                             \
    struct Name {                                                       \
        static constexpr type value = fallback;                         \
    };                                                                  \
    template <typename Op>                                              \
    struct Name<Op, decltype(void(Op::member))> {                       \
        static constexpr type value = Op::member;                       \
    };

// The functors' places in the schedule: Name<Op>::value, the fallback below unless the launch
// table gives functor Op its own (cupyloss/_tuning.py's FUNCTOR_SHAPES, written in as explicit
// specializations at the line below the traits: a loss's functor is its math alone).
#define CUPYLOSS_SHAPE_TRAIT(Name, type, fallback)                      \
    template <typename Op, typename = void>                             \
    struct Name {                                                       \
        static constexpr type value = fallback;                         \
    };

// A functor's own gradient shape on 4-byte elements (OwnShape32): blocks per SM the rows and
// reduce kernels are bounded for and their steps of loads in flight, 0 for the table's (or, for
// the reduce kernel's blocks, the functor's own reduce_blocks, which holds for every element
// size); and the gradient loops that are software-pipelined (`pipe`), issuing the next step's
// loads before this step's arithmetic, so that a functor bound by its arithmetic's latency keeps
// loads in flight while it computes.  PIPE_FLAT_BROADCAST pipelines only the flat kernels with a
// stride-0 operand compiled in (a 0-d operand broadcast), where PIPE_FLAT pipelines every flat
// gradient kernel.
enum : int { PIPE_ROWS = 1, PIPE_REDUCE = 2, PIPE_FLAT = 4, PIPE_FLAT_BROADCAST = 8 };
struct Shape32 {
    int rows_blocks, rows_steps, reduce_blocks, reduce_steps;
    int pipe = 0;
};

// Whether a functor is cheap (a few instructions a value: bound by memory, not by its
// arithmetic's latency).
CUPYLOSS_SHAPE_TRAIT(IsCheap, bool, false)

// The gradient instantiations' shape, for functors marked cheap and for the rest ("heavy": a
// transcendental, a division or a branch a value, so bound by instructions where cheap ones are
// bound by memory): blocks per SM their registers are bounded for (__launch_bounds__) and steps
// of loads in flight.  A heavy functor trades loads in flight for resident warps, which hide
// its arithmetic's latency (CUPYLOSS_*_HEAVY; the cheap functors' 16-bit rows gradient kernels
// take CUPYLOSS_ROWS_*_CHEAP_16).  CUPYLOSS_*_STREAM: the rows and reduce kernels' shape for
// heavy functors marked streaming, on 4-byte elements: their arithmetic on a broadcast operand
// leaves the loop (the CONST instantiations), so what is left per element is bound by loads in
// flight rather than by the arithmetic's latency.  The heavy shape applies to the element sizes
// set in CUPYLOSS_GRAD_HEAVY_SIZES (bit b: b-byte elements), or in the functor's own
// HeavySizes; other sizes take the cheap shape.  A heavy functor may also have its own
// pointwise_reduce bound (ReduceBlocks*, heavy or streaming, every element size), its own
// 4-byte shape (OwnShape32), and the blocks per SM of its 16-bit pointwise_flat and
// pointwise_rows gradient kernels (FlatBlocks16, RowsBlocks16).
CUPYLOSS_SHAPE_TRAIT(HeavySizes, int, CUPYLOSS_GRAD_HEAVY_SIZES)
CUPYLOSS_SHAPE_TRAIT(ReduceBlocksHeavy, int, CUPYLOSS_REDUCE_MIN_BLOCKS_HEAVY)
CUPYLOSS_SHAPE_TRAIT(ReduceBlocksStream, int, CUPYLOSS_REDUCE_MIN_BLOCKS_STREAM)
CUPYLOSS_SHAPE_TRAIT(StreamShape, bool, false)
CUPYLOSS_SHAPE_TRAIT(OwnShape32, Shape32, (Shape32{0, 0, 0, 0, 0}))
CUPYLOSS_SHAPE_TRAIT(FlatBlocks16, int, 0)
CUPYLOSS_SHAPE_TRAIT(RowsBlocks16, int, 0)

CUPYLOSS_FUNCTOR_SHAPES()

// The kernels compiled per mask CONST of operands that are the same across a unit of work (bit
// k: operand k is broadcast along it, or absent) read the others, which stream: operand k's
// slot among them is stream_slot<K>(CONST, k), and stream_slot<K>(CONST, K) is their number.
// It counts the clear bits of CONST below k in straight-line arithmetic: with a loop over the
// bits, the reduce kernel of margin_ranking_loss (float32, input1 broadcast) kept the loop at run
// time inside its whole-steps loop, once per element, and read the streamed values back from a
// 64-byte stack array at the slot it computed (docs/tuning.md, "The kernels' code").
template <int K>
__host__ __device__ constexpr int stream_slot(int constant, int k) {
    unsigned int x = ~(unsigned int)constant & ((1u << k) - 1u);
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    x = (x + (x >> 4)) & 0x0f0f0f0fu;
    return (int)((x * 0x01010101u) >> 24);
}

template <typename Op, typename T>
struct GradShape {
    static constexpr bool heavy =
        !IsCheap<Op>::value && ((HeavySizes<Op>::value >> sizeof(T)) & 1) != 0;
    static constexpr bool stream = heavy && sizeof(T) == 4 && StreamShape<Op>::value;
    // The functor's own 4-byte shape, where it declares one (zeros elsewhere).
    static constexpr Shape32 own = heavy && sizeof(T) == 4 ? OwnShape32<Op>::value
                                                           : Shape32{0, 0, 0, 0, 0};
    // 16-bit: a functor's own bound where it declares one (flat_blocks_16), else the table's.
    static constexpr int flat_blocks =
        sizeof(T) == 2 && FlatBlocks16<Op>::value ? FlatBlocks16<Op>::value
        : heavy                                   ? CUPYLOSS_FLAT_MIN_BLOCKS_GRAD_HEAVY : 1;
    static constexpr int flat_steps =
        heavy ? CUPYLOSS_FLAT_UNROLL_GRAD_HEAVY : CUPYLOSS_FLAT_UNROLL_GRAD;
    static constexpr bool cheap_16 = sizeof(T) == 2 && IsCheap<Op>::value;
    static constexpr int rows_blocks =
        cheap_16                                    ? CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_CHEAP_16
        : sizeof(T) == 2 && RowsBlocks16<Op>::value ? RowsBlocks16<Op>::value
        : own.rows_blocks                           ? own.rows_blocks
        : stream                                    ? CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_STREAM
        : heavy ? CUPYLOSS_ROWS_MIN_BLOCKS_GRAD_HEAVY : CUPYLOSS_ROWS_MIN_BLOCKS_GRAD;
    static constexpr int rows_steps =
        cheap_16         ? CUPYLOSS_ROWS_STEPS_GRAD_CHEAP_16
        : own.rows_steps ? own.rows_steps
        : stream         ? CUPYLOSS_ROWS_STEPS_GRAD_STREAM
        : heavy          ? CUPYLOSS_ROWS_STEPS_GRAD_HEAVY : 4;
    // Software-pipelined loops (the next step's loads issued before this step's arithmetic),
    // where the functor's own shape asks (Shape32::pipe): flat_pipe(has_const), of the flat
    // kernel with or without stride-0 operands compiled in.
    static constexpr bool rows_pipe = (own.pipe & PIPE_ROWS) != 0;
    static constexpr bool reduce_pipe = (own.pipe & PIPE_REDUCE) != 0;
    __host__ __device__ static constexpr bool flat_pipe(bool has_const) {
        return (own.pipe & PIPE_FLAT) != 0 || (has_const && (own.pipe & PIPE_FLAT_BROADCAST) != 0);
    }
    static constexpr int reduce_blocks =
        own.reduce_blocks ? own.reduce_blocks
        : stream          ? ReduceBlocksStream<Op>::value
        : heavy           ? ReduceBlocksHeavy<Op>::value : CUPYLOSS_REDUCE_MIN_BLOCKS;
    static constexpr int reduce_steps =
        own.reduce_steps ? own.reduce_steps
        : stream         ? CUPYLOSS_REDUCE_STEPS_STREAM
        : heavy          ? CUPYLOSS_REDUCE_STEPS_HEAVY : CUPYLOSS_REDUCE_STEPS;
};

// One value per array operand, passed by value as a kernel parameter.
template <typename P, int K>
struct PerOperand {
    P p[K];
};

// Per-thread running sums of the quantities reduced to 0-d outputs.  A thread adds thousands of
// values in sequence at large sizes, so each sum is compensated; the W values of one visit are
// added plainly first (W <= 8), and their sum goes into the compensated one.
template <typename A, int K>
struct Sums {
    Compensated<A> loss;
    Compensated<A> g[K];
};

template <typename A, int W>
__device__ __forceinline__ A sum_of(const A (&r)[W]) {
    A part = r[0];
    #pragma unroll
    for (int j = 1; j < W; ++j) part += r[j];
    return part;
}

// The loss terms r[0] + ... + r[W-1] into a 0-d loss's running sum, every add rounded on its
// own (add_rn, Compensated::add_rounded): a term that is a product (squared_hinge_loss's h * h)
// is never fused into an FMA with the sum.  The value-only and the gradient instantiations of a
// kernel, which the compiler contracts differently, so add the same terms, and a loss from
// value_and_grad is bitwise the loss alone.  (Gradient terms are rounded on their own where they
// are formed: grads_of.)
template <typename A, int W>
__device__ __forceinline__ void add_loss(Compensated<A>& sum, const A (&r)[W]) {
    A part = r[0];
    #pragma unroll
    for (int j = 1; j < W; ++j) part = add_rn(part, r[j]);
    sum.add_rounded(part);
}

// The 0-d outputs of a launch: the reduced loss and the gradients of 0-d-broadcast operands.
template <typename T, int K>
struct Scalars {
    T* value;             // sum of the loss / divisor, or null
    T* g[K];              // sum of operand k's gradient (one broadcast element), or null
    acc_t<T>* partials;   // [K + 1, nblocks] when the grid has several blocks and any of the above
    unsigned int* ticket; // zero before the launch, zero again after it
    double divisor;       // n for mean, input.shape[0] for batchmean, else 1
};

template <typename T, int K>
__device__ __forceinline__ void finish(const Sums<acc_t<T>, K>& s, const Scalars<T, K>& o,
                                       long long block, long long nblocks) {
    double v[K + 1], div[K + 1];
    T* out[K + 1];
    v[0] = s.loss.wide();
    out[0] = o.value;
    div[0] = o.divisor;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        v[k + 1] = s.g[k].wide();
        out[k + 1] = o.g[k];
        div[k + 1] = 1.0;
    }
    grid_sum_out<T, K + 1>(v, out, div, o.partials, o.ticket, block, nblocks);
}

// VEC consecutive elements from p + i (stride 1, p 16-byte aligned when VEC > 1), or one
// element broadcast (stride 0).
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
__device__ __forceinline__ void store_vec(T* __restrict__ p, long long i,
                                          const acc_t<T> (&in)[VEC]) {
    Vec<T, VEC> v;
    #pragma unroll
    for (int j = 0; j < VEC; ++j) v.v[j] = from_acc<T>(in[j]);
    if constexpr (VEC == 1) {
        *reinterpret_cast<Vec<T, VEC>*>(p + i) = v;
    } else {  // written once, read by a later kernel: a streaming store
        __stcs(reinterpret_cast<int4*>(p + i), *reinterpret_cast<const int4*>(&v));
    }
}

// An operand that is one element everywhere: p[0], or the fill value when p is null.
template <typename T>
__device__ __forceinline__ acc_t<T> read_fixed(const T* p, double fill) {
    return p != nullptr ? to_acc(p[0]) : acc_t<T>(fill);
}

template <typename T>
__device__ __forceinline__ acc_t<T> upstream_scalar(const T* __restrict__ go, double go_value,
                                                    double grad_scale, long long flags) {
    using A = acc_t<T>;
    const A g = (flags & FLAG_GO_DEVICE) ? to_acc(go[0]) : A(go_value);
    return g * A(grad_scale);
}

// What a launch computes per element: the loss alone (the value-only instantiations), or the
// gradients and the loss (the gradient ones, which the host launches only when a gradient is
// wanted).  A gradient launch that wants no loss (backward) still forms it, right after the
// partials, whose logs and exps it shares, and drops it at the store: one loop per kernel.  Two
// loops, one per kind of work, compiled each kernel's body twice, and the extra arithmetic cost
// backward calls nothing measurable (docs/tuning.md, "The kernels' code").
template <bool GRADS>
struct Work {
    static constexpr bool grads = GRADS;
};

// A functor's terms of the operands in CONST alone (the ones that stay the same across a
// thread's loop), formed once before the loop rather than per element.  The compiler moves
// plain arithmetic on such operands out of the loops by itself, but not code with branches of
// its own (libdevice's logf and log1pf): a functor with such terms declares
//   static constexpr bool fixed_terms = true;
//   template <int CONST, typename A> struct Fixed { ... };
//   template <int CONST, typename A> static Fixed<CONST, A> fix(const A (&v)[K], const Params&);
//   value<CONST>(v, p, fixed) and grad<CONST>(v, p, fixed, d),
// forming in fix only what CONST allows and the rest per element; the kernels hold one
// FixedTerms per distinct set of fixed operands (set once, before their loop) and call the
// functor through it.  Functors without them are called as they are.
CUPYLOSS_FUNCTOR_TRAIT(HasFixedTerms, fixed_terms, bool, false)
template <typename Op, int CONST, typename A, bool = HasFixedTerms<Op>::value>
struct FixedTerms {
    using P = typename Op::Params;
    __device__ __forceinline__ void set(const A (&)[Op::K], const P&) {}
    __device__ __forceinline__ A value(const A (&v)[Op::K], const P& p) const {
        return Op::value(v, p);
    }
    __device__ __forceinline__ void grad(const A (&v)[Op::K], const P& p, A (&d)[Op::K]) const {
        Op::grad(v, p, d);
    }
};
template <typename Op, int CONST, typename A>
struct FixedTerms<Op, CONST, A, true> {
    using P = typename Op::Params;
    typename Op::template Fixed<CONST, A> f;
    __device__ __forceinline__ void set(const A (&v)[Op::K], const P& p) {
        f = Op::template fix<CONST, A>(v, p);
    }
    __device__ __forceinline__ A value(const A (&v)[Op::K], const P& p) const {
        return Op::template value<CONST, A>(v, p, f);
    }
    __device__ __forceinline__ void grad(const A (&v)[Op::K], const P& p, A (&d)[Op::K]) const {
        Op::template grad<CONST, A>(v, p, f, d);
    }
};

// The loss of VEC elements whose operands are in registers (val[k][j]: operand k, element j),
// through the fixed terms fx[j] (NF == VEC) or fx[0] (NF == 1: the same for every element).
template <typename Op, typename A, int VEC, typename FX, int NF>
__device__ __forceinline__ void loss_of(const A (&val)[Op::K][VEC], const typename Op::Params& p,
                                        const FX (&fx)[NF], A (&r)[VEC]) {
    #pragma unroll
    for (int j = 0; j < VEC; ++j) {
        A v[Op::K];
        #pragma unroll
        for (int k = 0; k < Op::K; ++k) v[k] = val[k][j];
        r[j] = fx[NF == 1 ? 0 : j].value(v, p);
    }
}

// Upstream times every partial: d[k][j] = g[j] * dl/dv_k at element j, the product rounded on its
// own (mul_rn): a product left free was fused into the sum of a broadcast operand's gradient in
// one loop and not in another the compiler contracted differently (kl_div, float32, a [1, 2, 2]
// input broadcast to [100000, 2, 2]: backward's and value_and_grad's summed gradients, then
// separate loops, differed in their last bits).
template <typename Op, typename A, int VEC, typename FX, int NF>
__device__ __forceinline__ void grads_of(const A (&val)[Op::K][VEC], const A (&g)[VEC],
                                         const typename Op::Params& p, const FX (&fx)[NF],
                                         A (&d)[Op::K][VEC]) {
    #pragma unroll
    for (int j = 0; j < VEC; ++j) {
        A v[Op::K], dj[Op::K];
        #pragma unroll
        for (int k = 0; k < Op::K; ++k) v[k] = val[k][j];
        fx[NF == 1 ? 0 : j].grad(v, p, dj);
        #pragma unroll
        for (int k = 0; k < Op::K; ++k) d[k][j] = mul_rn(g[j], dj[k]);
    }
}

// Flat layout.  With VEC > 1 the host guarantees a 1-D geometry whose strides are 0 or 1 and
// 16-byte aligned pointers; elements past the last whole vector take the VEC == 1 path.
// CONST (bit k; gradient instantiations with VEC > 1 only): operand k has stride 0 (one element,
// or absent) on the vector path, known at compile time, so the functor's arithmetic on it is
// loop-invariant and leaves the loop, or is formed before it (FixedTerms: a 0-d probability's
// logs in binary_cross_entropy).  The host sets it from the strides; 0 reads each operand's
// stride at run time.
template <typename T, typename Op, int VEC, bool GRAD, int CONST = 0>
__global__ void __launch_bounds__(256, GRAD ? GradShape<Op, T>::flat_blocks : 1) pointwise_flat(
        const PerOperand<const T*, Op::K> in,     // operand k through geo.stride[k], or null
        const PerOperand<double, Op::K> fill,     // what a null operand reads as
        const T* __restrict__ go,                 // grad_output: [1] or through geo.stride[K]
        const Geometry<Op::K + 1> geo,            // the broadcast shape, coalesced
        const long long n,                        // elements in the broadcast shape
        const typename Op::Params p,              // the loss's options
        const long long flags,
        const double go_value,                    // grad_output when it is a host scalar
        const double grad_scale,                  // 1/n, 1/batch or 1
        T* __restrict__ loss,                     // [n] or null
        const Scalars<T, Op::K> o,                // 0-d outputs and their partials [K + 1, grid]
        const PerOperand<T*, Op::K> g) {          // per operand: [n] or null
    constexpr int K = Op::K;
    using A = acc_t<T>;
    const bool go_elem = (flags & FLAG_GO_ELEMENTWISE) != 0;
    const A g0 = upstream_scalar<T>(go, go_value, grad_scale, flags);
    const bool want_value = loss != nullptr || o.value != nullptr;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    Sums<A, K> s;

    auto flat_loop = [&](auto work) {
        constexpr bool WANT_GRAD = decltype(work)::grads;
        // Delivers the results of W consecutive elements (W = VEC, or 1 on the strided path) at
        // flat index i to their outputs; val[k][j] is operand k of element j, gv[j] its upstream,
        // fx[0] the functor's fixed terms of the path's compiled-in operands.
        auto visit = [&](const auto& val, const auto& gv, const auto& fx, long long i) {
            constexpr int W = int(sizeof(gv) / sizeof(gv[0]));
            auto deliver_loss = [&](const A (&r)[W]) {
                if (loss != nullptr) {
                    store_vec<T, W>(loss, i, r);
                } else if (want_value) {
                    add_loss<A, W>(s.loss, r);
                }
            };
            if constexpr (!WANT_GRAD) {
                A r[W];
                loss_of<Op, A, W>(val, p, fx, r);
                deliver_loss(r);
            } else {
                A d[K][W];
                grads_of<Op, A, W>(val, gv, p, fx, d);
                {  // after the partials: it reuses what they computed
                    A r[W];
                    loss_of<Op, A, W>(val, p, fx, r);
                    deliver_loss(r);
                }
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (g.p[k] != nullptr) {
                        store_vec<T, W>(g.p[k], i, d[k]);
                    } else if (o.g[k] != nullptr) {
                        s.g[k].add(sum_of<A, W>(d[k]));
                    }
                }
            }
        };

        long long done = 0;
        if constexpr (VEC > 1) {
            A fixed[K];  // stride-0 operands, read once
            #pragma unroll
            for (int k = 0; k < K; ++k)
                fixed[k] = ((CONST >> k) & 1) || geo.stride[k][0] == 0
                               ? read_fixed<T>(in.p[k], fill.p[k]) : A(0);
            FixedTerms<Op, CONST, A> fx[1];
            fx[0].set(fixed, p);
            const long long nvec = n / VEC;
            // One vector of every operand at flat vector index v (and its upstream).
            auto load = [&](long long v, A (&val)[K][VEC], A (&gv)[VEC]) {
                const long long i = v * VEC;
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (((CONST >> k) & 1) || geo.stride[k][0] == 0) {
                        #pragma unroll
                        for (int j = 0; j < VEC; ++j) val[k][j] = fixed[k];
                    } else {
                        load_vec<T, VEC>(in.p[k], i, 1, val[k]);
                    }
                }
                if (go_elem) {
                    load_vec<T, VEC>(go, i, geo.stride[K][0], gv);
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) gv[j] *= A(grad_scale);
                } else {
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) gv[j] = g0;
                }
            };
            // U grid-stride steps at once, every load issued before any use, then one at a
            // time.  (Gradient kernels with more operands or wider vectors hold enough per step
            // already: two steps at once cost them registers and resident warps, e.g.
            // bce_with_logits float 77 -> 109 and bfloat16 121 -> 171.)  The gradient kernel
            // counts the operands it streams (stride-0 ones compiled in hold no loads), up to
            // K * VEC = 24 values a step in all (at 32, bfloat16 bce_with_logits lost); the same
            // count in the rows and reduce kernels' steps spilled (docs/tuning.md, "The kernels'
            // code").
            // Value-only, float32 functors marked cheap (a compare or two and a product a value)
            // take more steps at once than the rest, whose registers the extra steps would crowd.
            constexpr int U = GRAD ? (stream_slot<K>(CONST, K) * VEC <= 8 && K * VEC <= 24
                                          ? GradShape<Op, T>::flat_steps : 1)
                                   : (IsCheap<Op>::value && sizeof(T) == 4 && K * VEC <= 8
                                          ? CUPYLOSS_FLAT_UNROLL_VALUE_CHEAP
                                          : CUPYLOSS_FLAT_UNROLL_VALUE);
            // Value-only: block b takes the contiguous chunk [b per, (b + 1) per) of the
            // vectors, its threads striding by the block; with gradients the whole grid strides
            // together (both measured best, _launch.FLAT_STEPS_*).
            long long v, stride, end;
            if constexpr (GRAD) {
                v = tid, stride = nthreads, end = nvec;
            } else {
                const long long threads = (long long)gridDim.x * blockDim.x;
                // whole blocks' worth: _launch.flat_chunk mirrors it
                const long long per = (nvec + threads - 1) / threads * blockDim.x;
                v = (long long)blockIdx.x * per + threadIdx.x;
                stride = blockDim.x;
                end = min(nvec, v - threadIdx.x + per);
            }
            if constexpr (GRAD && GradShape<Op, T>::flat_pipe(CONST != 0)) {
                struct Steps {
                    A val[U][K][VEC], gv[U][VEC];
                };
                v = pipelined<Steps>(
                    v, U * stride, [&](long long q) { return q + (U - 1) * stride < end; },
                    [&](long long q, Steps& b) {
                        #pragma unroll
                        for (int u = 0; u < U; ++u) load(q + u * stride, b.val[u], b.gv[u]);
                    },
                    [&](long long q, Steps& b) {
                        #pragma unroll
                        for (int u = 0; u < U; ++u)
                            visit(b.val[u], b.gv[u], fx, (q + u * stride) * VEC);
                    });
            } else if constexpr (U > 1) {
                for (; v + (U - 1) * stride < end; v += U * stride) {
                    A val[U][K][VEC], gv[U][VEC];
                    #pragma unroll
                    for (int u = 0; u < U; ++u) load(v + u * stride, val[u], gv[u]);
                    #pragma unroll
                    for (int u = 0; u < U; ++u) visit(val[u], gv[u], fx, (v + u * stride) * VEC);
                }
            }
            #pragma unroll (U == 1 ? 4 : 1)
            for (; v < end; v += stride) {
                A val[K][VEC], gv[VEC];
                load(v, val, gv);
                visit(val, gv, fx, v * VEC);
            }
            done = nvec * VEC;
        }
        for (long long i = done + tid; i < n; i += nthreads) {
            long long off[K + 1];
            geo.offsets(i, off);
            A val[K][1];
            #pragma unroll
            for (int k = 0; k < K; ++k)
                val[k][0] = in.p[k] != nullptr ? to_acc(in.p[k][off[k]]) : A(fill.p[k]);
            const A gv[1] = {go_elem ? to_acc(go[off[K]]) * A(grad_scale) : g0};
            const FixedTerms<Op, 0, A> fx[1] = {};  // every operand read here
            visit(val, gv, fx, i);
        }
    };
    flat_loop(Work<GRAD>{});
    finish<T, K>(s, o, blockIdx.x, gridDim.x);
}

// pointwise_rows' row operands' gradients, summed down the column by each thread (row_grad):
// across the ty lanes in shared memory in lane order (in double), then written to
// ws[k][by, col] or, with one row block, straight to g[k][col].  With col_tickets the row blocks
// of this column block meet here: the one that draws the last ticket adds their partials in
// row-block order (the same order whichever block that is) and writes the gradients, so no
// second launch is needed.
template <typename T, int K, int VEC>
__device__ __forceinline__ void rows_finish_row_grads(
        const Compensated<acc_t<T>> (&row_grad)[K][VEC], const bool (&want_row)[K], double* smem,
        const PerOperand<T*, K>& g, const PerOperand<double*, K>& ws,
        unsigned int* __restrict__ col_tickets, long long cols, long long c, long long lx,
        long long ly, long long tx, long long ty, bool active) {
    using A = acc_t<T>;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!want_row[k]) continue;
        __syncthreads();  // smem may still be read by finish or by the previous operand
        #pragma unroll
        for (int j = 0; j < VEC; ++j) smem[(ly * tx + lx) * VEC + j] = row_grad[k][j].wide();
        __syncthreads();
        if (ly == 0 && active) {
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                double acc = smem[lx * VEC + j];
                for (long long q = 1; q < ty; ++q) acc += smem[(q * tx + lx) * VEC + j];
                if (ws.p[k] != nullptr) ws.p[k][(long long)blockIdx.y * cols + c + j] = acc;
                else g.p[k][c + j] = from_acc<T>(A(acc));
            }
        }
    }
    if (col_tickets == nullptr) return;
    __shared__ unsigned int is_last;
    __threadfence();  // every thread's partials published before the block takes a ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int last = gridDim.y - 1;
        is_last = atomicInc(col_tickets + blockIdx.x, last) == last;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const long long c0 = (long long)blockIdx.x * tx * VEC;
    const long long c1 = min(cols, c0 + tx * VEC);
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!want_row[k] || ws.p[k] == nullptr) continue;
        for (long long col = c0 + threadIdx.x; col < c1; col += blockDim.x) {
            double acc = 0.0;
            #pragma unroll 8
            for (unsigned int by = 0; by < gridDim.y; ++by)
                acc += __ldcg(ws.p[k] + (long long)by * cols + col);  // L2: other blocks'
            g.p[k][col] = from_acc<T>(A(acc));
        }
    }
}

// Rows layout: the broadcast shape is [rows, cols] and kind[k] says how operand k covers it
// (KIND_FULL, KIND_ROW or KIND_SCALAR; the host guarantees at least one row operand).  Block
// (bx, by) covers columns [bx * tx * VEC, (bx + 1) * tx * VEC) of the rows
// [by * rows_per_block, (by + 1) * rows_per_block); its threads form ty = blockDim.x / tx lanes
// down the rows, each taking UNROLL rows per step with all their loads issued before any use.
// Row and scalar operands stay in registers; a row operand's gradient is summed down the
// column in registers (compensated), then across the ty lanes in shared memory in lane order
// (in double), and written to ws[k][by, col] or, with one row block, straight to g[k][col].
// With col_tickets the last row block of each column block to finish adds the row blocks'
// partials into g[k]; without, reduce.cu's sum_chunks does.  A scalar operand's gradient is a
// 0-d sum (grid_sum_out).
// CONST (bit k): operand k is not KIND_FULL (a row, a scalar or absent), so it is the same for
// every row a thread visits; the host sets it from `kind`.  Known at compile time, the functor's
// arithmetic on those operands is loop-invariant and leaves the row loop.
template <typename T, typename Op, int VEC, bool GRAD, int CONST>
__global__ void __launch_bounds__(256, GRAD ? GradShape<Op, T>::rows_blocks : 1) pointwise_rows(
        const PerOperand<const T*, Op::K> in,     // per kind: [rows, cols], [cols], [1] or null
        const PerOperand<double, Op::K> fill,     // what a null operand reads as
        const PerOperand<long long, Op::K> kind,  // KIND_FULL, KIND_ROW or KIND_SCALAR
        const T* __restrict__ go,                 // [rows, cols] with FLAG_GO_ELEMENTWISE, [1]
        const long long rows, const long long cols,
        const long long rows_per_block,
        const long long tx,                       // threads along a row: a power of two, 32..256
        const typename Op::Params p,
        const long long flags,
        const double go_value, const double grad_scale,
        T* __restrict__ loss,                     // [rows, cols] or null
        const Scalars<T, Op::K> o,                // 0-d loss and scalar operands' gradients
        const PerOperand<T*, Op::K> g,            // full: [rows, cols]; row: [cols]; or null
        const PerOperand<double*, Op::K> ws,      // row: [gridDim.y, cols], or null
        unsigned int* __restrict__ col_tickets) { // [gridDim.x] zeros (left zero), or null
    constexpr int K = Op::K;
    constexpr int STEPS = GRAD ? GradShape<Op, T>::rows_steps : 4;
    constexpr int UNROLL = K <= 2 ? STEPS : (STEPS > 1 ? STEPS / 2 : 1);
    constexpr bool PIPE = GRAD && GradShape<Op, T>::rows_pipe;
    using A = acc_t<T>;
    extern __shared__ unsigned char smem_raw[];
    double* smem = reinterpret_cast<double*>(smem_raw);  // [ty * tx * VEC]: lanes' row sums
    const bool go_elem = (flags & FLAG_GO_ELEMENTWISE) != 0;
    const A g0 = upstream_scalar<T>(go, go_value, grad_scale, flags);
    const A gs = A(grad_scale);
    const long long lx = threadIdx.x % tx;
    const long long ly = threadIdx.x / tx;
    const long long ty = blockDim.x / tx;
    const long long c = ((long long)blockIdx.x * tx + lx) * VEC;
    const long long r0 = (long long)blockIdx.y * rows_per_block;
    const long long r1 = min(rows, r0 + rows_per_block);
    const bool active = c < cols;
    const bool want_value = loss != nullptr || o.value != nullptr;
    bool want_row[K];
    #pragma unroll
    for (int k = 0; k < K; ++k)
        want_row[k] = GRAD && (g.p[k] != nullptr || ws.p[k] != nullptr) && kind.p[k] == KIND_ROW;

    Sums<A, K> s;
    A fixed[K][VEC];
    Compensated<A> row_grad[K][VEC];  // a row operand's gradient, summed down the rows
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        #pragma unroll
        for (int j = 0; j < VEC; ++j) fixed[k][j] = A(0);
        if (kind.p[k] == KIND_ROW && active) {
            load_vec<T, VEC>(in.p[k], c, 1, fixed[k]);
        } else if (kind.p[k] == KIND_SCALAR) {
            const A v = read_fixed<T>(in.p[k], fill.p[k]);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) fixed[k][j] = v;
        }
    }
    FixedTerms<Op, CONST, A> fx[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) {
        A v[K];
        #pragma unroll
        for (int k = 0; k < K; ++k) v[k] = fixed[k][j];
        fx[j].set(v, p);
    }

    // UNROLL steps' loads of operands and grad_output for the rows from rb on (ty apart).
    auto load_rows = [&](long long rb, A (&fv)[UNROLL][K][VEC], A (&gv)[UNROLL][VEC]) {
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long ru = rb + u * ty;
            if (ru < r1) {
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    if (!((CONST >> k) & 1))
                        load_vec<T, VEC>(in.p[k], ru * cols + c, 1, fv[u][k]);
                }
                if (go_elem) load_vec<T, VEC>(go, ru * cols + c, 1, gv[u]);
            }
        }
    };
    auto rows_loop = [&](auto work) {
        constexpr bool WANT_GRAD = decltype(work)::grads;
        // The UNROLL steps from row r on, their loads in fv and gv.
        auto visit = [&](long long r, A (&fv)[UNROLL][K][VEC], A (&gv)[UNROLL][VEC]) {
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long ru = r + u * ty;
                if (ru >= r1) break;
                const long long i = ru * cols + c;
                A val[K][VEC];
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j)
                        val[k][j] = ((CONST >> k) & 1) ? fixed[k][j] : fv[u][k][j];
                }
                #pragma unroll
                for (int j = 0; j < VEC; ++j) gv[u][j] = go_elem ? gv[u][j] * gs : g0;
                auto deliver_loss = [&](const A (&lv)[VEC]) {
                    if (loss != nullptr) {
                        store_vec<T, VEC>(loss, i, lv);
                    } else if (want_value) {
                        add_loss<A, VEC>(s.loss, lv);
                    }
                };
                if constexpr (!WANT_GRAD) {
                    A lv[VEC];
                    loss_of<Op, A, VEC>(val, p, fx, lv);
                    deliver_loss(lv);
                } else {
                    A d[K][VEC];
                    grads_of<Op, A, VEC>(val, gv[u], p, fx, d);
                    {  // after the partials: it reuses them
                        A lv[VEC];
                        loss_of<Op, A, VEC>(val, p, fx, lv);
                        deliver_loss(lv);
                    }
                    #pragma unroll
                    for (int k = 0; k < K; ++k) {
                        if (!((CONST >> k) & 1)) {
                            if (g.p[k] != nullptr) store_vec<T, VEC>(g.p[k], i, d[k]);
                        } else if (kind.p[k] == KIND_ROW) {
                            #pragma unroll
                            for (int j = 0; j < VEC; ++j) row_grad[k][j].add(d[k][j]);
                        } else if (o.g[k] != nullptr) {
                            s.g[k].add(sum_of<A, VEC>(d[k]));
                        }
                    }
                }
            }
        };
        long long r = r0 + ly;
        if constexpr (PIPE) {
            struct Steps {
                A fv[UNROLL][K][VEC], gv[UNROLL][VEC];
            };
            pipelined<Steps>(
                r, UNROLL * ty, [&](long long q) { return active && q < r1; },
                [&](long long q, Steps& b) { load_rows(q, b.fv, b.gv); },
                [&](long long q, Steps& b) { visit(q, b.fv, b.gv); });
        } else {
            while (active && r < r1) {
                A fv[UNROLL][K][VEC], gv[UNROLL][VEC];
                load_rows(r, fv, gv);
                visit(r, fv, gv);
                r += UNROLL * ty;
            }
        }
    };
    rows_loop(Work<GRAD>{});

    const long long block = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    finish<T, K>(s, o, block, (long long)gridDim.x * gridDim.y);
    rows_finish_row_grads<T, K, VEC>(row_grad, want_row, smem, g, ws, col_tickets, cols, c, lx,
                                     ly, tx, ty, active);
}

// Reduce layout, for the gradient G_k[o] = sum_m g_k[o, m] of the operands broadcast along the
// same dims (bit k of `reduced`).  The broadcast shape is split into the dims they keep
// (`kept`, n_o elements: their own shape, C order) and the dims they are broadcast along
// (`red`, n_m elements, innermost last); an element (o, m) of operand q sits at
// kept.offsets(o)[q] + red.offsets(m)[q], q = K being grad_output and q = K + 1 the flat index
// of the broadcast shape (where the loss and full-size gradients go).
//
// A unit is one warp: lanes_o = 32 / lanes_m elements o, lanes_m lanes each, over the chunk
// [c * chunk, (c + 1) * chunk) of m, one reduced row at a time (a row: the innermost reduced
// dim, its offsets computed once per row).  In a row the lanes of one o take e = q VEC, then
// every lanes_m VEC further (VEC consecutive m along the innermost dim, whose stride is 0 or 1
// in every operand when VEC > 1), UNROLL steps' loads issued before any use.  A reduced operand
// is read once per lane; its gradient is summed per lane (a vector's VEC values plainly, then
// into a compensated sum, as the 0-d sums), then over the lanes_m
// lanes by a fixed butterfly in double, and written to g[k][o] (one chunk) or ws[k][c, o],
// added in a fixed order by the unit that finishes o's chunks last (col_tickets: a ticket per
// group of lanes_o elements o) or, without tickets, by sum_chunks in reduce.cu.  lanes_m is
// large when the innermost dim is reduced (lanes read along it), 1 when it is kept (lanes read
// 32 neighbouring o); _launch.reduce_launch picks it, chunk and nchunks.  Units are a
// grid-stride loop.  The loss, full-size gradients and 0-d sums are delivered as in
// pointwise_flat, so a call is one read of the data.
// Steps of loads a lane keeps in flight (K <= 2, 4-byte elements) and the blocks per SM the
// registers are bounded for: GradShape (reduce_steps, reduce_blocks).
// CONST (bit k): operand k reads one value per unit, being broadcast along every reduced dim
// (the lead operand always) or absent; the host computes it (_pointwise._reduce_plan), so which
// operands stream and into which slots is known at compile time: no per-element selection, and
// the functor's arithmetic on per-unit values is computed once per vector, not per element.
// k's slot when it streams: stream_slot<K>(CONST, k), above GradShape.

// Where pointwise_reduce's streamed operands start in a reduced row (`off`: each operand's
// offset of the row's first element) and their strides along it: slot f holds the f-th operand
// not in CONST; an empty slot reads nothing.
template <int K, int F, int CONST, typename T>
__device__ __forceinline__ void stream_sources(
        const PerOperand<const T*, K> in, const long long (&off)[K + 2],
        const Geometry<K + 2>& red, const int inner, const T* (&src)[F],
        long long (&src_stride)[F]) {
    #pragma unroll
    for (int f = 0; f < F; ++f) {
        src[f] = nullptr;   // no operand in this slot: nothing read
        src_stride[f] = 0;
        #pragma unroll
        for (int k = 0; k < K; ++k) {
            if (((CONST >> k) & 1) || stream_slot<K>(CONST, k) != f) continue;
            src[f] = in.p[k] + off[k];
            src_stride[f] = red.stride[k][inner];
        }
    }
}

// pointwise_reduce's steps of a row from e0 on, UNROLL steps a group (load_steps, then visit):
// whole, the groups whose last step lies in the row (len: its elements), none checking its
// bounds; else what is left, step by step.  PIPE: the next group's loads issued before this
// group's arithmetic.
template <bool PIPE, int UNROLL, int F, int VEC, typename A, typename Load, typename Visit>
__device__ __forceinline__ void reduce_groups(const bool whole, long long& e0, const long long len,
                                              const long long step, Load& load_steps,
                                              Visit& visit) {
    const long long last = (UNROLL - 1) * step;  // a group's last step from its first
    auto in_row = [&](long long e) { return (whole ? e + last : e) < len; };
    if constexpr (PIPE) {
        // Written out rather than through pipelined(): there its integer bookkeeping came out
        // otherwise, and binary_cross_entropy's per-channel and per-row patterns lost
        // (docs/tuning.md, "The kernels' code").
        A fv[UNROLL][F][VEC];
        if (in_row(e0)) load_steps(whole, e0, fv);
        #pragma unroll 1
        for (; in_row(e0); e0 += UNROLL * step) {
            A cf[UNROLL][F][VEC];
            #pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                #pragma unroll
                for (int f = 0; f < F; ++f) {
                    #pragma unroll
                    for (int v = 0; v < VEC; ++v) cf[j][f][v] = fv[j][f][v];
                }
            }
            if (in_row(e0 + UNROLL * step))
                load_steps(whole, e0 + UNROLL * step, fv);
            visit(whole, e0, cf);
        }
    } else {
        #pragma unroll 1
        for (; in_row(e0); e0 += UNROLL * step) {
            A fv[UNROLL][F][VEC];
            load_steps(whole, e0, fv);
            visit(whole, e0, fv);
        }
    }
}

// The end of a pointwise_reduce unit: each reduced operand's per-lane sums over the lanes_m lanes
// of its o (a fixed butterfly in double), written to g[k][o] (one chunk) or ws[k][c, o].  Where
// o's chunks have column tickets, the unit that draws o's last ticket (`ticket`: its group of
// lanes_o elements o), whichever unit that is, adds their partials in a fixed order and writes
// G_k = g[k][o], so no second launch is needed.
template <typename T, int K>
__device__ __forceinline__ void reduce_unit_end(
        Compensated<acc_t<T>> (&sum)[K], const long long reduced, const long long lanes_m,
        const long long q, const long long lane, const bool active, const long long nchunks,
        const long long n_o, const long long oi, const long long c, const long long ticket,
        const PerOperand<T*, K>& g, const PerOperand<double*, K>& ws,
        unsigned int* col_tickets) {
    using A = acc_t<T>;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!((reduced >> k) & 1)) continue;
        double v = sum[k].wide();
        for (int b = 1; b < lanes_m; b <<= 1) v += __shfl_xor_sync(0xffffffffu, v, b);
        if (q == 0 && active) {
            if (nchunks == 1) g.p[k][oi] = from_acc<T>(A(v));
            else ws.p[k][c * n_o + oi] = v;
        }
    }
    if (nchunks == 1 || col_tickets == nullptr) return;
    __threadfence();  // this unit's partials published before its ticket
    __syncwarp();
    unsigned int last = 0;
    if (lane == 0) {
        const unsigned int end = (unsigned int)(nchunks - 1);
        last = atomicInc(col_tickets + ticket, end) == end;
    }
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!((reduced >> k) & 1)) continue;
        double v = 0.0;
        if (active) {
            for (long long cc = q; cc < nchunks; cc += lanes_m)
                v += __ldcg(ws.p[k] + cc * n_o + oi);  // L2: other units'
        }
        for (int b = 1; b < lanes_m; b <<= 1) v += __shfl_xor_sync(0xffffffffu, v, b);
        if (q == 0 && active) g.p[k][oi] = from_acc<T>(A(v));
    }
}

template <typename T, typename Op, int VEC, int CONST>
__global__ void __launch_bounds__(256, GradShape<Op, T>::reduce_blocks) pointwise_reduce(
        const PerOperand<const T*, Op::K> in,     // operand k through kept/red strides, or null
        const PerOperand<double, Op::K> fill,     // what a null operand reads as
        const T* __restrict__ go,                 // grad_output: [1] or through stride[K]
        const Geometry<Op::K + 2> kept,           // the dims the reduced operands keep [n_o]
        const Geometry<Op::K + 2> red,            // the dims they are broadcast along [n_m]
        const long long n_o, const long long n_m,
        const long long chunk,                    // m per unit: a multiple of lanes_m * VEC
        const long long nchunks,
        const long long lanes_m,                  // lanes per o: a power of two, 1..32
        const long long reduced,                  // bit k: operand k's gradient is G_k
        const typename Op::Params p,
        const long long flags,
        const double go_value, const double grad_scale,
        T* __restrict__ loss,                     // [n] (flat index) or null
        const Scalars<T, Op::K> o,                // 0-d loss and scalar operands' gradients
        const PerOperand<T*, Op::K> g,            // full: [n]; reduced: [n_o] (or null when
                                                  // nchunks > 1 and sum_chunks finishes them)
        const PerOperand<double*, Op::K> ws,      // reduced: [nchunks, n_o] when nchunks > 1
        unsigned int* __restrict__ col_tickets) { // [units_o] zeros (left zero), or null
    constexpr int K = Op::K;
    // Steps whose loads are in flight at once: reduce_steps vectors of 4 elements (K <= 2; half
    // as many for more operands, at least one); 16-bit vectors of 8 take half the steps
    // (registers, not bytes, limit them).
    constexpr int STEPS = GradShape<Op, T>::reduce_steps;
    constexpr int UNROLL_4 = (K <= 2 ? STEPS : STEPS / 2) * 4 / (VEC > 4 ? VEC : 4);
    constexpr int UNROLL = UNROLL_4 > 1 ? UNROLL_4 : 1;
    constexpr bool PIPE = GradShape<Op, T>::reduce_pipe;
    constexpr int OUT = K + 1;                    // the flat index's slot in the geometries
    constexpr int NF = stream_slot<K>(CONST, K);  // operands read per element
    constexpr int F = NF > 0 ? NF : 1;
    using A = acc_t<T>;
    const bool go_elem = (flags & FLAG_GO_ELEMENTWISE) != 0;
    const A g0 = upstream_scalar<T>(go, go_value, grad_scale, flags);
    const A gs = A(grad_scale);
    const bool want_value = loss != nullptr || o.value != nullptr;
    const int inner = (int)red.ndim - 1;          // innermost reduced dim
    const long long lane = threadIdx.x & 31;
    const long long q = lane & (lanes_m - 1);
    const long long lanes_o = 32 / lanes_m;
    const long long units_o = (n_o + lanes_o - 1) / lanes_o;
    const long long units = units_o * nchunks;
    const long long step = lanes_m * VEC;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    // Operands broadcast along every reduced dim (the lead operand the split follows, the
    // operands summed with it, numbers) are one value per o, read once per unit; the others
    // (CONST's clear bits) are read per element.  Slot f holds the f-th of those in operand
    // order, so the loads in flight take F, not K, vectors a step.
    Sums<A, K> s;

    auto reduce_loop = [&]() {
        for (long long u = warp; u < units; u += nwarps) {  // uniform across the warp
            const long long c = u / units_o;
            const long long oi = (u - c * units_o) * lanes_o + lane / lanes_m;
            const bool active = oi < n_o;
            long long base[K + 2];
            kept.offsets(active ? oi : 0, base);
            A fixed[K];
            Compensated<A> sum[K];
            #pragma unroll
            for (int k = 0; k < K; ++k) {
                fixed[k] = in.p[k] == nullptr ? A(fill.p[k]) : A(0);
                if (((CONST >> k) & 1) && in.p[k] != nullptr && active)
                    fixed[k] = to_acc(in.p[k][base[k]]);
            }
            FixedTerms<Op, CONST, A> fx[1];
            fx[0].set(fixed, p);
            const long long m1 = active ? min(n_m, (c + 1) * chunk) : 0;
            const long long n_in = red.dim[inner].divisor;
            long long m = c * chunk;
            while (m < m1) {
                // The reduced row holding m (every reduced dim but the innermost fixed): its
                // offsets are computed once, then the lanes walk it along the innermost dim.
                const long long row = (long long)red.dim[inner].div((unsigned long long)m) * n_in;
                const long long row_end = min(m1, row + n_in);
                long long off[K + 2];
                red.offsets(row, off);
                #pragma unroll
                for (int k = 0; k < K + 2; ++k) off[k] += base[k];
                const T* src[F];
                long long src_stride[F];
                stream_sources<K, F, CONST>(in, off, red, inner, src, src_stride);
                // UNROLL steps' loads from e0 on, and their arithmetic.  whole: every step of
                // the group lies in the row, and the streamed operands and the flat index walk it
                // with stride 1 (grad_output not elementwise), so no step checks its bounds, a
                // stride or a null pointer (a constant at each call, folded once inlined).
                auto load_steps = [&](const bool whole, long long e0, A (&fv)[UNROLL][F][VEC]) {
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const long long e = e0 + j * step;
                        if (!whole && row + e >= row_end) break;
                        #pragma unroll
                        for (int f = 0; f < F; ++f) {
                            if (NF > 0 && (whole || src[f] != nullptr)) {
                                load_vec<T, VEC>(src[f], e, whole ? 1 : src_stride[f], fv[j][f]);
                            } else {
                                #pragma unroll
                                for (int v = 0; v < VEC; ++v) fv[j][f][v] = A(0);
                            }
                        }
                    }
                };
                auto visit = [&](const bool whole, long long e0, const A (&fv)[UNROLL][F][VEC]) {
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const long long e = e0 + j * step;
                        if (!whole && row + e >= row_end) break;
                        const long long at = off[OUT] + (whole ? e : e * red.stride[OUT][inner]);
                        A val[K][VEC];
                        #pragma unroll
                        for (int k = 0; k < K; ++k) {
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) {
                                // k is unrolled: both the test and the slot fold to constants.
                                const int f = stream_slot<K>(CONST, k) < F
                                                  ? stream_slot<K>(CONST, k) : F - 1;
                                val[k][v] = ((CONST >> k) & 1) ? fixed[k] : fv[j][f][v];
                            }
                        }
                        A gv[VEC];  // an elementwise grad_output ('none' backward) is read here
                        if (!whole && go_elem) {
                            load_vec<T, VEC>(go + off[K], e, red.stride[K][inner], gv);
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) gv[v] *= gs;
                        } else {
                            #pragma unroll
                            for (int v = 0; v < VEC; ++v) gv[v] = g0;
                        }
                        A d[K][VEC];
                        grads_of<Op, A, VEC>(val, gv, p, fx, d);
                        {  // after the partials: it reuses them
                            A lv[VEC];
                            loss_of<Op, A, VEC>(val, p, fx, lv);
                            if (loss != nullptr) store_vec<T, VEC>(loss, at, lv);
                            else if (want_value) add_loss<A, VEC>(s.loss, lv);
                        }
                        // An operand in CONST is summed (G_k, or a 0-d gradient); one that
                        // streams has the broadcast shape, its gradient stored elementwise.
                        #pragma unroll
                        for (int k = 0; k < K; ++k) {
                            if ((CONST >> k) & 1) {
                                if ((reduced >> k) & 1) sum[k].add(sum_of<A, VEC>(d[k]));
                                else if (o.g[k] != nullptr) s.g[k].add(sum_of<A, VEC>(d[k]));
                            } else if (g.p[k] != nullptr) {
                                store_vec<T, VEC>(g.p[k], at, d[k]);
                            }
                        }
                    }
                };
                // The groups of whole steps first (while the group's last step is in the row),
                // then what is left of the row step by step; the steps keep their order, so the
                // sums are bitwise the same either way.  The whole groups' loop holds a load and a
                // store a vector and the functor's arithmetic, little else.  (The same split of the
                // rows kernel's loop lost on the row pattern, and was left out; the runs:
                // docs/tuning.md, "The kernels' code".)
                long long e0 = m - row + q * VEC;
                bool fast = !go_elem && red.stride[OUT][inner] == 1;
                #pragma unroll
                for (int f = 0; f < F; ++f) fast = fast && (NF == 0 || src_stride[f] == 1);
                const long long len = row_end - row;
                if (fast)
                    reduce_groups<PIPE, UNROLL, F, VEC, A>(true, e0, len, step, load_steps, visit);
                reduce_groups<PIPE, UNROLL, F, VEC, A>(false, e0, len, step, load_steps, visit);
                m = row_end;
            }
            reduce_unit_end<T, K>(sum, reduced, lanes_m, q, lane, active, nchunks, n_o, oi, c,
                                  u - c * units_o, g, ws, col_tickets);
        }
    };
    reduce_loop();
    finish<T, K>(s, o, blockIdx.x, gridDim.x);
}

}  // namespace cupyloss
