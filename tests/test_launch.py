"""Launch arithmetic of cupyloss._core.launch, checked on the CPU (no GPU, no CuPy).

Everything a kernel trusts the host for is here: the magic numbers of 64-bit division by a
run-time constant, the coalesced broadcast geometry and its packed struct, and the grid, block
and shared-memory sizes, clamped to a fake device's limits.
"""

import dataclasses
import math
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyloss._core import launch as _launch, source as _source, tuning as _tuning
from cupyloss.pointwise import _launch as _pointwise_launch
from cupyloss.rowclass import _launch as _rowclass_launch
from cupyloss.rowpair import _launch as _rowpair_launch
from cupyloss.rowwise import _launch as _rowwise_launch
from cupyloss._core.launch import BLOCK, BLOCKS_PER_SM, MAX_DIMS, WARP, DeviceLimits

# An H100 SXM: 132 SMs, the grid limits every CUDA device since sm_30 has, 48 KiB of static
# shared memory per block.
H100 = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                    max_shared_per_block=49152)

U64 = 2**64 - 1
I64_MAX = 2**63 - 1


def _cdiv(a, b):
    return -(-a // b)


# --- divider / divide ------------------------------------------------------------------------

EDGE_DIVISORS = sorted({
    1,  # l = 0: both shifts 0 and m = 1, t = 0
    2, 3,  # the smallest power of two and the smallest odd divisor past 1
    *(2**k + e for k in (5, 16, 31, 32, 62) for e in (-1, 0, 1)),  # l jumps at every 2**k + 1
    32768,  # 2**15: a typical row width
    2**31 - 1,  # largest int32: where a 32-bit index would overflow
    2**32 + 1,  # just past uint32, so mulhi needs all 64 bits of m
    2**62 + 11,  # l = 63, the largest s2 (62)
    2**63 - 1,  # the largest divisor divider accepts
})


def _numerators(d):
    """n values where floor(n / d) steps, and the ends of [0, 2**63)."""
    top = I64_MAX // d * d
    candidates = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, 2 * d + 1,
                  top - 1, top, top + 1, I64_MAX - 1, I64_MAX}
    return sorted(n for n in candidates if 0 <= n <= I64_MAX)


def _device_divide(n, magic):
    """IntDiv::div of kernels/common.cuh in unsigned 64-bit arithmetic, wrapping like the GPU."""
    m, s1, s2 = magic
    t = (m * n) >> 64  # __umul64hi
    return ((t + (((n - t) & U64) >> s1)) & U64) >> s2


def _check_divider(d, numerators):
    magic = _launch.divider(d)
    m, s1, s2 = magic
    assert 0 <= m <= U64 and s1 in (0, 1) and 0 <= s2 <= 62, (d, magic)
    for n in numerators:
        assert _launch.divide(n, magic) == n // d, (n, d, magic)
        assert _device_divide(n, magic) == n // d, (n, d, magic)


@pytest.mark.parametrize("d", EDGE_DIVISORS)
def test_divider_at_edge_divisors(d):
    _check_divider(d, _numerators(d))


@settings(max_examples=1000, deadline=None)
@given(d=st.one_of(st.integers(1, 4096), st.integers(1, I64_MAX), st.sampled_from(EDGE_DIVISORS)),
       n=st.integers(0, I64_MAX))
def test_divider_matches_floor_division(d, n):
    _check_divider(d, [n, n // d * d, min(n // d * d + d - 1, I64_MAX)])


@pytest.mark.parametrize("d", [0, -1, 2**63, 2**64])
def test_divider_rejects_divisors_outside_its_range(d):
    with pytest.raises(ValueError, match=str(d)):
        _launch.divider(d)


# --- coalesce / offsets ----------------------------------------------------------------------

def _reference_offsets(i, shape, strides):
    index = np.unravel_index(i, shape) if shape else ()
    return [sum(int(k) * s for k, s in zip(index, st)) for st in strides]


@st.composite
def _strides_of(draw, shape):
    """Element strides of one operand read at `shape`, in one of the layouts kernels meet."""
    ndim = len(shape)
    kind = draw(st.sampled_from(["contiguous", "broadcast", "reversed", "transposed", "random"]))
    if kind == "random":
        return tuple(draw(st.lists(st.integers(-40, 40), min_size=ndim, max_size=ndim)))
    if kind == "transposed":
        order = draw(st.permutations(range(ndim)))
        inner = _contiguous(tuple(shape[d] for d in order))
        strides = [0] * ndim
        for pos, d in enumerate(order):
            strides[d] = inner[pos]
        return tuple(strides)
    strides = _contiguous(shape)
    flags = draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim))
    if kind == "broadcast":  # zero stride: the operand repeats along that dim
        return tuple(0 if f else s for f, s in zip(flags, strides))
    if kind == "reversed":  # negative stride: a [::-1] view
        return tuple(-s if f else s for f, s in zip(flags, strides))
    return strides


@st.composite
def _geometries(draw):
    # Up to 6 dims of sizes 0..4 (size 1 is dropped by coalesce, 0 makes the tensor empty), at
    # most 256 elements so that every flat index is checked.
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=6).filter(
        lambda s: math.prod(s) <= 256)))
    operands = draw(st.integers(1, 3))  # input, target, elementwise grad_output
    strides = [draw(_strides_of(shape)) for _ in range(operands)]
    return shape, strides


def _check_coalesce(shape, strides):
    cshape, cstrides = _launch.coalesce(shape, strides)
    n = math.prod(shape)
    assert math.prod(cshape) == n
    assert 1 <= len(cshape) <= max(len(shape), 1)
    assert cshape == (1,) or 1 not in cshape
    assert len(cstrides) == len(strides) and all(len(st) == len(cshape) for st in cstrides)
    for i in range(n):
        assert _launch.offsets(i, cshape, cstrides) == _reference_offsets(i, shape, strides), i
    return cshape


@settings(max_examples=400, deadline=None)
@given(_geometries())
def test_coalesce_keeps_every_offset(geometry):
    _check_coalesce(*geometry)


@pytest.mark.parametrize("shape", [
    (),  # 0-d: becomes (1,)
    (1, 1, 1),  # all size-1 dims dropped
    (7,),  # 1-D, odd
    (3, 1, 5),  # a size-1 dim between two that merge
    (2, 3, 4, 5),  # 4 dims into 1
    (2,) * MAX_DIMS,  # MAX_DIMS dims into 1
])
def test_coalesce_merges_contiguous_operands_to_one_dim(shape):
    strides = [_contiguous(shape)] * 3
    assert _check_coalesce(shape, strides) == (max(math.prod(shape), 1),)


def test_coalesce_keeps_a_broadcast_dim_apart():
    # (4, 5) input against a (5,) target: the target repeats each row, so two dims stay.
    shape = (4, 5)
    strides = [(5, 1), _launch.broadcast_strides((5,), (1,), shape)]
    assert strides[1] == (0, 1)
    assert _check_coalesce(shape, strides) == (4, 5)


@st.composite
def _broadcast_views(draw):
    """A strided NumPy view (maybe transposed, reversed, with size-1 dims) and a shape it
    broadcasts to."""
    out = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    keep = draw(st.integers(0, len(out)))  # the operand has the trailing `keep` dims
    shape = tuple(1 if draw(st.booleans()) else size for size in out[len(out) - keep:])
    n = math.prod(shape)
    base = np.arange(4 * n, dtype=np.float64)
    order = draw(st.permutations(range(len(shape))))  # the order of the dims in memory
    memory = base[::4].reshape(tuple(shape[d] for d in order))  # every 4th element: stride 4
    view = memory.transpose(np.argsort(order))
    for d in range(view.ndim):
        if draw(st.booleans()):
            view = np.flip(view, d)
    return base, view, out


@settings(max_examples=300, deadline=None)
@given(_broadcast_views())
def test_broadcast_offsets_address_numpy_broadcast_to(case):
    # The kernel's view of one operand: its first element's address plus Geometry.offsets.
    base, view, out = case
    strides = _launch.broadcast_strides(view.shape, tuple(s // 8 for s in view.strides), out)
    cshape, (cstrides,) = _launch.coalesce(out, [strides])
    start = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 8
    want = np.broadcast_to(view, out).ravel()
    for i in range(math.prod(out)):
        (off,) = _launch.offsets(i, cshape, [cstrides])
        assert base.ravel()[start + off] == want[i], i


# --- geometry --------------------------------------------------------------------------------

# long long ndim; IntDiv dim[MAX_DIMS] (four 8-byte fields); long long stride[3][MAX_DIMS].
GEOMETRY_BYTES = 8 + 8 * 4 * MAX_DIMS + 3 * 8 * MAX_DIMS


def test_geometry_struct_layout_matches_common_cuh():
    dtype = _launch.GEOMETRY_DTYPE
    assert dtype.itemsize == GEOMETRY_BYTES == 456
    assert dtype.fields["ndim"][1] == 0
    assert dtype.fields["dim"][1] == 8
    assert dtype.fields["stride"][1] == 8 + 8 * 4 * MAX_DIMS


@pytest.mark.parametrize("shape, strides", [
    ((1,), [(0,)]),  # 0-d after coalesce: one operand
    ((4, 5), [(5, 1), (0, 1), (5, 1)]),  # a row broadcast, elementwise grad_output
    ((3, 2**31 + 1), [(-(2**31 + 1), -1), (0, 1)]),  # negative strides, a dim past int32
    (tuple(range(2, 2 + MAX_DIMS)), [tuple(range(MAX_DIMS))] * 3),  # every dim used
])
def test_geometry_packs_the_c_struct(shape, strides):
    g = _launch.geometry(shape, strides)
    assert g.dtype.itemsize == GEOMETRY_BYTES
    fields = [len(shape)]
    for d in range(MAX_DIMS):
        fields += list(_launch.divider(shape[d])) + [shape[d]] if d < len(shape) else [0] * 4
    for k in range(3):
        st = strides[k] if k < len(strides) else ()
        fields += [st[d] if d < len(st) else 0 for d in range(MAX_DIMS)]
    packed = struct.pack("<q" + "Qqqq" * MAX_DIMS + "q" * 3 * MAX_DIMS, *fields)
    assert g.tobytes() == packed


def test_geometry_rejects_more_than_max_dims():
    shape = (2,) * (MAX_DIMS + 1)
    with pytest.raises(ValueError, match=f"{MAX_DIMS + 1} dims exceeds {MAX_DIMS}"):
        _launch.geometry(shape, [_contiguous(shape)])


# --- launch configurations -------------------------------------------------------------------

VECS = (1, 2, 4, 8)  # float64, -, float32, 16-bit types (16-byte loads)

FLAT_SIZES = [
    0,  # empty: one block, which writes the 0-d results (0, or NaN for a mean)
    1, 31, 32, 33,  # around a warp
    255, 256, 257,  # around a block
    BLOCK * 8 - 1, BLOCK * 8 + 1,  # around one block of 8-wide vectors
    _launch.SINGLE_BLOCK_WORK * 8, _launch.SINGLE_BLOCK_WORK * 8 + 1,  # the one-block limit
    H100.sm_count * BLOCKS_PER_SM * BLOCK - 1,  # one element short of a full wave
    H100.sm_count * BLOCKS_PER_SM * BLOCK + 1,  # one element past it
    2**31 - 1, 2**31 + 1, 2**32 + 1,  # around 32-bit indices
    I64_MAX,  # the largest flat index the kernels take
]


def test_block_is_a_legal_cuda_block():
    assert BLOCK % WARP == 0 and BLOCK <= 1024


@pytest.mark.parametrize("n", FLAT_SIZES)
def test_flat_launch_stays_within_the_device(n):
    for vec in VECS:
        launch = _launch.flat_launch(n, vec, H100)
        (grid,) = launch.grid
        work = _cdiv(n, vec)
        work_blocks = _cdiv(work, BLOCK)
        assert launch.block == (BLOCK,)
        assert 1 <= grid <= H100.sm_count * BLOCKS_PER_SM
        assert grid <= max(1, work_blocks), "a block with no work"
        if work <= _launch.SINGLE_BLOCK_WORK:
            assert grid == 1, "a small launch needs partials and a ticket"
        else:
            assert grid > 1, "a large launch on one SM"
        if work_blocks >= H100.sm_count * BLOCKS_PER_SM:
            assert grid == H100.sm_count * BLOCKS_PER_SM, "a large n leaves SMs idle"
        assert launch.shared == 0, "pointwise_flat's block sums use static shared memory"


def test_flat_launch_clamps_to_max_grid_x():
    # A device whose grid limit is below one wave (132 SMs x 8 blocks).
    small = DeviceLimits(sm_count=132, max_grid_x=100, max_grid_y=65535,
                         max_shared_per_block=49152)
    assert _launch.flat_launch(I64_MAX, 1, small).grid == (100,)


ROWS = [
    1, 7, 8, 9,  # around ty = 8 rows of a block with tx = 32
    255, 256, 257,  # around a block
    65535, 65536,  # around max_grid_y
    10**6,
    10**9,  # far more row blocks than max_grid_y allows
]
COLS = [
    1, 7,  # fewer than a warp: tx = 32 anyway
    31, 32, 33,  # around a warp
    255, 256, 257,  # around a block
    1024, 2049,  # several column blocks, one with a single element
    10**6,  # thousands of column blocks
]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_rows_launch_covers_the_matrix(rows, cols):
    for vec in VECS:
        launch = _pointwise_launch.rows_launch(rows, cols, vec, H100)
        col_blocks, row_blocks = launch.grid
        tx, rpb = launch.tx, launch.rows_per_block
        lanes = _cdiv(cols, vec)
        assert launch.block == (BLOCK,)
        assert WARP <= tx <= BLOCK and tx & (tx - 1) == 0
        assert tx >= min(lanes, BLOCK) and (tx == WARP or tx < 2 * lanes), "not the next power"
        assert col_blocks * tx * vec >= cols > (col_blocks - 1) * tx * vec
        assert 1 <= row_blocks <= H100.max_grid_y
        assert row_blocks * rpb >= rows > (row_blocks - 1) * rpb
        assert col_blocks <= H100.max_grid_x
        assert col_blocks * row_blocks <= max(col_blocks, H100.sm_count * BLOCKS_PER_SM)
        if col_blocks == 1 and rows * min(lanes, BLOCK) <= _launch.SINGLE_BLOCK_WORK:
            assert row_blocks == 1, "a small matrix split over blocks"
        assert launch.shared == BLOCK * vec * 8, "a double per thread and vector element"


def test_rows_launch_value_only_grid_holds_whole_waves():
    """KernelBench 100's hinge forward: 32 column blocks, and row blocks for
    ROWS_WAVES_VALUE waves of 3 resident blocks per SM (one wave for the gradient kernel)."""
    one = _pointwise_launch.rows_launch(32768, 32768, 4, H100, 3)
    value = _pointwise_launch.rows_launch(32768, 32768, 4, H100, 3, _tuning.value("ROWS_WAVES_VALUE"))
    assert one.grid == (32, H100.sm_count * 3 // 32)
    assert value.grid == (32, H100.sm_count * 3 * _tuning.value("ROWS_WAVES_VALUE") // 32)
    assert value.grid[1] * value.rows_per_block >= 32768
    # Still never fewer than ty rows a block: 8 rows of 32 lanes are one block however many waves.
    assert _pointwise_launch.rows_launch(8, 32, 1, H100, 3, _tuning.value("ROWS_WAVES_VALUE")).grid == (1, 1)


def test_rows_launch_clamps_to_max_grid_y():
    # 10**5 SMs want 800,000 row blocks for one wave, more than the 65535 a grid's y allows.
    many = DeviceLimits(sm_count=10**5, max_grid_x=2**31 - 1, max_grid_y=65535,
                        max_shared_per_block=49152)
    launch = _pointwise_launch.rows_launch(10**9, 1, 1, many)
    _, row_blocks = launch.grid
    assert row_blocks <= 65535 and row_blocks * launch.rows_per_block >= 10**9


def test_rows_launch_with_no_rows():
    # Input (0, C) against target (C,): no rows, and no division by zero rows per block.
    launch = _pointwise_launch.rows_launch(0, 5, 1, H100)
    assert launch.grid[0] >= 1 and launch.grid[1] >= 1, "CUDA rejects a grid dim of 0"
    assert launch.rows_per_block >= 1


def test_rows_launch_rejects_too_many_column_blocks():
    # 5 column blocks of 256 lanes on a device that allows 4.
    small = DeviceLimits(sm_count=132, max_grid_x=4, max_grid_y=65535,
                         max_shared_per_block=49152)
    with pytest.raises(ValueError, match=r"1280 elements need 5 column blocks.*device's 4"):
        _pointwise_launch.rows_launch(10, 5 * BLOCK, 1, small)


def test_check_shared_allows_exactly_the_limit():
    assert _launch.check_shared(49152, H100, "k") == 49152
    with pytest.raises(ValueError, match=r"k needs 49153 bytes .* allows 49152"):
        _launch.check_shared(49153, H100, "k")


@pytest.mark.parametrize("make, need", [
    # 256 threads x 8-wide vectors x a double each = 16384 bytes.
    (lambda limits: _pointwise_launch.rows_launch(10, 64, 8, limits), 16384),
])
def test_launches_reject_shared_memory_over_the_limit(make, need):
    limits = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                          max_shared_per_block=need - 1)
    with pytest.raises(ValueError, match=rf"needs {need} bytes .* allows {need - 1}"):
        make(limits)
    make(DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                      max_shared_per_block=need))


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 10**9])  # a warp per column, 8 a block; far past
def test_sum_chunks_launch_stays_within_the_device(cols):         # one wave
    (grid,) = _pointwise_launch.sum_chunks_launch(cols, H100).grid
    assert 1 <= grid <= min(_cdiv(cols, BLOCK // WARP), H100.sm_count * BLOCKS_PER_SM)


# --- gradients of broadcast operands (pointwise_reduce) ----------------------------------------

def _split_of(out_shape, operand_shape, other_strides=None):
    """The coalesced split of an operand of `operand_shape` against a contiguous full operand
    and the flat index, as _pointwise builds it."""
    full = _contiguous(out_shape) if other_strides is None else other_strides
    strides = [_launch.broadcast_strides(operand_shape, _contiguous(operand_shape), out_shape),
               full, _contiguous(out_shape)]
    shape, cstrides = _launch.coalesce(out_shape, strides)
    return _pointwise_launch.split_reduced(shape, cstrides, 0)


def _contiguous(shape):
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


# (broadcast shape, operand shape): leading, trailing, middle and several broadcast dims.
BROADCASTS = [
    ((256, 64, 56, 56), (1, 64, 1, 1)),    # per channel: [M1, O, M2]
    ((8192, 4096), (8192, 1)),             # per row: [O, M]
    ((8192, 4096), (4096,)),               # one row down the rows: [M, O]
    ((4, 5, 6, 7), (5, 1, 7)),             # two kept, two broadcast, alternating
    ((3, 1, 5, 2), (3, 1, 1, 2)),          # a size-1 dim dropped, a middle one broadcast
    ((2, 3, 4, 5, 6), (1, 3, 1, 5, 1)),    # three broadcast dims
]


@pytest.mark.parametrize("out_shape,operand_shape", BROADCASTS)
def test_split_reduced_sums_like_numpy(out_shape, operand_shape):
    """Every element (o, m) of the split is one element of the broadcast shape, each exactly
    once, and summing over m gives NumPy's sum over the broadcast axes (o is the operand's
    own C-order index)."""
    if math.prod(out_shape) > 10**5:
        out_shape = tuple(min(size, 6) for size in out_shape)
        operand_shape = tuple(min(size, 6) for size in operand_shape)
    split = _split_of(out_shape, operand_shape)
    assert split.n_o == math.prod(operand_shape)
    assert split.n_o * split.n_m == math.prod(out_shape)
    values = np.random.default_rng(0).standard_normal(out_shape)
    flat = values.ravel()
    got = np.zeros(split.n_o)
    seen = np.zeros(flat.size, int)
    for o in range(split.n_o):
        base = _launch.offsets(o, split.kept, split.kept_strides)
        assert base[0] == o          # the operand's own element o
        for m in range(split.n_m):
            off = _launch.offsets(m, split.red, split.red_strides)
            assert off[0] == 0       # broadcast along every reduced dim
            i = base[2] + off[2]     # the flat index
            seen[i] += 1
            assert base[1] + off[1] == i   # the contiguous full operand agrees
            got[o] += flat[i]
    assert (seen == 1).all()
    pad = (1,) * (len(out_shape) - len(operand_shape)) + tuple(operand_shape)
    axes = tuple(d for d, (a, b) in enumerate(zip(pad, out_shape)) if a == 1 and b != 1)
    np.testing.assert_allclose(got, values.sum(axis=axes, keepdims=True).ravel(), rtol=1e-12)


def test_split_reduced_classifies_the_common_patterns():
    per_channel = _split_of((256, 64, 56, 56), (1, 64, 1, 1))
    assert (per_channel.kept, per_channel.red, per_channel.inner_reduced) == (
        (64,), (256, 3136), True)
    per_row = _split_of((8192, 4096), (8192, 1))
    assert (per_row.kept, per_row.red, per_row.inner) == ((8192,), (4096,), 4096)
    one_row = _split_of((8192, 4096), (4096,))
    assert (one_row.kept, one_row.red, one_row.inner_reduced) == ((4096,), (8192,), False)
    # A transposed full operand keeps the dims apart; the split still follows the operand.
    view = _split_of((6, 8), (6, 1), other_strides=(1, 6))
    assert (view.kept, view.red) == ((6,), (8,))


def test_split_reduced_rejects_an_operand_that_is_not_broadcast():
    with pytest.raises(ValueError, match="not broadcast along some but not all dims"):
        _pointwise_launch.split_reduced((4, 5), [(5, 1), (5, 1)], 0)
    with pytest.raises(ValueError, match="not broadcast along some but not all dims"):
        _pointwise_launch.split_reduced((4, 5), [(0, 0), (5, 1)], 0)


REDUCE_CASES = [(out, op, vec) for out, op in BROADCASTS for vec in (1, 4)] + [
    ((2, 10**8), (2, 1), 4),          # two outputs, each a sum of 10^8: chunks fill the device
    ((10**6, 16), (10**6, 1), 4),     # a million outputs of 16 terms: one chunk, lanes split o
    ((10**7, 3), (1, 3), 1),          # innermost kept, three outputs of 10^7 terms
]


@pytest.mark.parametrize("per_sm", [1, 2, BLOCKS_PER_SM])
@pytest.mark.parametrize("out_shape,operand_shape,vec", REDUCE_CASES)
def test_reduce_launch_covers_m_with_bounded_partials(out_shape, operand_shape, vec, per_sm):
    split = _split_of(out_shape, operand_shape)
    if split.inner_reduced and split.inner % vec:
        vec = 1
    cfg = _pointwise_launch.reduce_launch(split, vec, H100, per_sm)
    lanes = cfg.lanes_m
    assert lanes in (1, 2, 4, 8, 16, 32)
    assert cfg.block == (BLOCK,) and 1 <= cfg.grid[0] <= H100.sm_count * per_sm
    step = lanes * vec
    assert cfg.chunk % step == 0                           # vectors never straddle a chunk
    assert (cfg.nchunks - 1) * cfg.chunk < split.n_m <= cfg.nchunks * cfg.chunk
    units_o = _cdiv(split.n_o, WARP // lanes)
    resident = H100.sm_count * per_sm * BLOCK // WARP
    # Partials are bounded by the device (a wave of warps), never by the tensor's size.
    assert cfg.nchunks == 1 or cfg.nchunks * units_o <= resident
    if cfg.nchunks > 1:   # chunks only where each lane still has REDUCE_MIN_STEPS steps
        assert cfg.chunk >= step * _tuning.value("REDUCE_MIN_STEPS") // 2
    if split.inner_reduced:   # the warp reads along the innermost dim
        assert lanes >= min(WARP, _cdiv(split.inner, vec))
    else:                     # one lane per output element, neighbours in memory
        assert lanes == WARP // min(WARP, 1 << (split.n_o - 1).bit_length())


def test_reduce_launch_of_the_benchmarked_patterns():
    """The splits the benchmark's patterns get on an H100 at 8 and 2 resident blocks an SM."""
    per_channel = _split_of((256, 64, 56, 56), (1, 64, 1, 1))
    cfg = _pointwise_launch.reduce_launch(per_channel, 4, H100, 8)
    assert (cfg.lanes_m, cfg.nchunks, cfg.grid) == (32, 131, (1048,))
    cfg = _pointwise_launch.reduce_launch(per_channel, 4, H100, 2)
    assert (cfg.lanes_m, cfg.nchunks, cfg.grid) == (32, 33, (264,))
    per_row = _split_of((8192, 4096), (8192, 1))
    cfg = _pointwise_launch.reduce_launch(per_row, 4, H100, 8)
    assert (cfg.lanes_m, cfg.nchunks, cfg.chunk) == (32, 1, 4096)   # written directly


# --- row-wise launches (cross_entropy_rows and friends) -------------------------------------------

ITEMSIZES = (2, 4, 8)  # 16-bit, float32, float64: 8, 4 and 2 elements a 16-byte vector


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("cols", [1, 7, 8, 63, 64, 65, 255, 1000, 4096, 8191, 8192, 8193, 16384,
                                  16385, 50257, 128256, 2**20 + 3])
def test_row_team_holds_the_row_with_the_smallest_team(itemsize, cols):
    vec = 16 // itemsize
    vectors = max(1, cols // vec)
    tpr, k = _rowwise_launch.row_team(cols, itemsize)
    assert tpr in _rowwise_launch.ROW_TEAMS and k >= 1
    assert tpr * k * _rowwise_launch.ROW_VECS >= vectors  # the row fits the team's registers
    if k == 1 and tpr > _rowwise_launch.ROW_TEAMS[0]:
        assert (tpr // 2) * _rowwise_launch.ROW_VECS < vectors  # and a smaller team would not hold it
    if k > 1:
        assert tpr == BLOCK and (k - 1) * BLOCK * _rowwise_launch.ROW_VECS < vectors


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("cols", [1, 7, 64, 255, 1000, 2048, 4096, 8191, 8192, 16384, 16385,
                                  128256])
def test_row_team_in_two_tiles_halves_teams_past_a_warp(itemsize, cols):
    # Two tiles a thread: a team past a warp that holds the row becomes half as large, and still
    # covers the row in two tiles; a warp or less, or a row past a block, keeps its team.
    vectors = max(1, cols // (16 // itemsize))
    held, k = _rowwise_launch.row_team(cols, itemsize)
    tpr, k2 = _rowwise_launch.row_team(cols, itemsize, 2)
    assert k2 == k and tpr in _rowwise_launch.ROW_TEAMS
    if k > 1 or held <= 32:
        assert tpr == held
    else:
        assert tpr == held // 2 >= 32 and 2 * tpr * _rowwise_launch.ROW_VECS >= vectors


# An H100 whose kernels may opt in to 227 KiB of shared memory a block.
H100_OPTIN = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                          max_shared_per_block=49152, max_shared_optin=232448)


@pytest.mark.parametrize("limits", [H100, H100_OPTIN], ids=["48K", "optin"])
@pytest.mark.parametrize("cols, itemsize", [(16385, 2), (32000, 2), (50257, 2), (128256, 2),
                                            (128256, 4), (2**21, 4), (2**20 + 3, 8)])
def test_row_hold_takes_the_fewest_blocks_that_hold_the_row(limits, cols, itemsize):
    tile = BLOCK * _rowwise_launch.ROW_VECS
    vectors = cols // (16 // itemsize)
    k, stash = _rowwise_launch.row_hold(cols, itemsize, 4, limits)
    room = (_launch.shared_limit(limits, True) - _launch.ROW_SCRATCH * 4) // (16 * tile)
    split, tiles = _tuning.value("ROW_MAX_SPLIT"), _tuning.value("ROW_STASH_TILES")
    assert 1 <= k <= split and 0 <= stash <= min(tiles, room)
    if k * (1 + stash) * tile >= vectors:
        # Held: registers and stash of k blocks cover the row, no tile left unused, and k - 1
        # blocks would not hold it.
        assert stash == _cdiv(_cdiv(vectors, k), tile) - 1
        most = min(tiles, room)
        assert k == 1 or (k - 1) * (1 + most) * tile < vectors
    else:
        # Too long: the most blocks, the most tiles, the rest streamed.
        assert (k, stash) == (split, min(tiles, room))


@pytest.mark.parametrize("alone, reread", [(3, 0), (2, 1), (1, 2)])
@pytest.mark.parametrize("cols, itemsize", [(16385, 2), (32000, 2), (40000, 2), (65536, 2),
                                            (128256, 2), (152064, 2), (256000, 2), (128256, 4)])
def test_row_hold_gives_a_pair_the_rows_its_knobs_say(monkeypatch, alone, reread, cols,
                                                      itemsize):
    tile = BLOCK * _rowwise_launch.ROW_VECS
    vectors = cols // (16 // itemsize)
    sm90 = dataclasses.replace(H100_OPTIN, clusters=True)
    monkeypatch.setitem(_tuning._OVERRIDES, "", {"ROW_ALONE_STASH": alone,
                                                 "ROW_PAIR_REREAD": reread})
    plain = _rowwise_launch.row_hold(cols, itemsize, 4, H100_OPTIN)
    k, stash = _rowwise_launch.row_hold(cols, itemsize, 4, sm90)
    most = _tuning.value("ROW_STASH_TILES")
    alone_tiles = _cdiv(vectors, tile)
    pair_tiles = _cdiv(_cdiv(vectors, 2), tile)
    # Without clusters the knobs change nothing.
    monkeypatch.setitem(_tuning._OVERRIDES, "", {})
    assert plain == _rowwise_launch.row_hold(cols, itemsize, 4, H100_OPTIN)
    if alone_tiles - 1 <= alone:
        assert (k, stash) == (1, alone_tiles - 1)
    elif pair_tiles - 1 <= most:
        assert (k, stash) == (2, pair_tiles - 1)
    elif pair_tiles - 1 - most <= reread:
        # Past a pair's shared memory by at most `reread` tiles: still a pair, the rest read
        # again from L2.
        assert (k, stash) == (2, most)
    else:
        assert k > 2 and (k, stash) == plain


@pytest.mark.parametrize("rows", [0, 1, 3, 131, 1000, 8192, 32768, 10**7])
@pytest.mark.parametrize("cols, itemsize", [(10, 4), (4096, 4), (128256, 2), (2**21, 4)])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("limits", [H100, H100_OPTIN], ids=["48K", "optin"])
def test_row_launch_stays_within_resident_blocks(rows, cols, itemsize, grad, per_sm, limits):
    asked = []

    def occupancy(shared, cluster):
        asked.append((shared, cluster))
        return per_sm

    cfg = _rowwise_launch.row_launch(rows, cols, itemsize, 4, grad, False, limits, occupancy)
    resident = H100.sm_count * per_sm
    assert 1 <= cfg.grid[0] <= resident and cfg.block == (BLOCK,)
    # The occupancy was asked once, of the kernel launched (the cluster one for a cluster
    # launch, so no other is compiled) with the launch's own shared memory: scratch and stash.
    assert asked == [(cfg.shared, cfg.k if cfg.cluster else 1)]
    assert cfg.shared == _launch.ROW_SCRATCH * 4 + cfg.stash * 16 * BLOCK * _rowwise_launch.ROW_VECS
    assert cfg.shared <= _launch.shared_limit(limits, True)
    tpr, k = _rowwise_launch.row_team(cols, itemsize,
                              _tuning.value("ROW_GRAD_TILES", limits.gpu) if grad else 1)
    if grad and k > 1:
        # A gradient holds its row on chip whatever rows is, over the blocks row_hold gives.
        assert (cfg.k, cfg.stash) == (min(_rowwise_launch.row_hold(cols, itemsize, 4, limits)[0],
                                          resident), _rowwise_launch.row_hold(cols, itemsize, 4, limits)[1])
    else:
        assert cfg.stash == 0   # nothing held past the registers
    if cfg.k > 1:
        # Cooperative: whole groups of k blocks, every block resident at once.
        assert cfg.cooperative and cfg.tpr == BLOCK and cfg.grid[0] % cfg.k == 0
        assert cfg.grid[0] // cfg.k <= max(rows, 1)
        if not grad:
            assert cfg.k == min(k, resident // max(rows, 1))
    else:
        assert not cfg.cooperative
        # Without a gradient, a warp per row once rows fill a quarter of the resident warps.
        warps = not grad and 4 * rows >= resident * (BLOCK // _tuning.value("ROW_FORWARD_TEAM"))
        assert cfg.tpr == (min(tpr, _tuning.value("ROW_FORWARD_TEAM")) if warps else tpr)
        # As many blocks as rows need (BLOCK / tpr rows a block), up to the resident ones.
        assert cfg.grid[0] == max(1, min(_cdiv(max(rows, 1), BLOCK // cfg.tpr), resident))


def test_row_launch_light_rows_and_limits(monkeypatch):
    def per_sm(n):
        return lambda shared, cluster: n

    cfg = _rowwise_launch.row_launch(1000, 128256, 2, 4, False, True, H100, per_sm(2))
    assert cfg.tpr == _rowwise_launch.ROW_TEAMS[0] and cfg.k == 1      # nll_loss forward: one read a row
    assert cfg.grid[0] == _cdiv(1000, BLOCK // cfg.tpr)
    # The two benchmark shapes: KernelBench 95 and a Llama-3 vocabulary in bfloat16.
    assert _rowwise_launch.row_launch(32768, 4096, 4, 4, False, False, H100, per_sm(4)).tpr == 32
    assert _rowwise_launch.row_launch(32768, 4096, 4, 4, True, False, H100, per_sm(3)).tpr == 128
    assert _rowwise_launch.row_launch(8192, 128256, 2, 4, False, False, H100, per_sm(4)).tpr == 32
    # 16032 vectors a row: two blocks of 2048 in registers and 3 tiles (96 KiB) of shared memory
    # each with the opt-in; four blocks with one tile under the default 48 KiB.
    llm = _rowwise_launch.row_launch(8192, 128256, 2, 4, True, False, H100_OPTIN, per_sm(2))
    assert (llm.tpr, llm.k, llm.stash, llm.grid) == (BLOCK, 2, 3, (132 * 2,))
    assert llm.shared == 64 * 4 + 3 * 32768
    llm = _rowwise_launch.row_launch(8192, 128256, 2, 4, True, False, H100, per_sm(3))
    assert (llm.tpr, llm.k, llm.stash, llm.grid) == (BLOCK, 4, 1, (132 * 3 // 4 * 4,))
    assert llm.cooperative and not llm.cluster     # H100 here says it has no clusters
    # With clusters (sm_90), the blocks of a row form one, the gradient launch only; the same
    # grid, now plain (not cooperative).
    sm90 = dataclasses.replace(H100_OPTIN, clusters=True)
    llm = _rowwise_launch.row_launch(8192, 128256, 2, 4, True, False, sm90, per_sm(2))
    assert (llm.k, llm.stash, llm.grid, llm.cluster, llm.cooperative) == (2, 3, (264,), True,
                                                                          False)
    few = _rowwise_launch.row_launch(4, 128256, 2, 4, False, False, sm90, per_sm(4))
    assert few.k > 1 and few.cooperative and not few.cluster
    wide = _rowwise_launch.row_launch(2048, 128256, 4, 4, True, False, sm90, per_sm(2))
    assert wide.k == 4 and wide.cooperative and not wide.cluster   # not in ROW_CLUSTER_SIZES
    monkeypatch.setitem(_tuning._OVERRIDES, "", {"ROW_CLUSTERS": 0})
    llm = _rowwise_launch.row_launch(8192, 128256, 2, 4, True, False, sm90, per_sm(2))
    assert llm.cooperative and not llm.cluster
    # A 32000-class bfloat16 row fits one block with a tile of shared memory: no cooperation.
    mid = _rowwise_launch.row_launch(8192, 32000, 2, 4, True, False, H100_OPTIN, per_sm(3))
    assert (mid.k, mid.stash, mid.cooperative) == (1, 1, False)
    # Two tiles a thread (ROW_GRAD_TILES): KernelBench 95's gradient on 64 threads a row; its
    # forward, nll_loss's gradient and the rows past a block as before.
    monkeypatch.setitem(_tuning._OVERRIDES, "", {"ROW_GRAD_TILES": 2})
    assert _rowwise_launch.row_launch(32768, 4096, 4, 4, True, False, H100, per_sm(3)).tpr == 64
    assert _rowwise_launch.row_launch(32768, 4096, 4, 4, False, False, H100, per_sm(4)).tpr == 32
    assert (_rowwise_launch.row_launch(1000, 4096, 4, 4, True, True, H100, per_sm(3)).tpr
            == _rowwise_launch.row_team(4096, 4)[0])
    mid = _rowwise_launch.row_launch(8192, 32000, 2, 4, True, False, H100_OPTIN, per_sm(3))
    assert (mid.tpr, mid.k, mid.stash) == (BLOCK, 1, 1)
    with pytest.raises(ValueError, match="2147483648 classes"):
        _rowwise_launch.row_launch(1, 2**31, 2, 4, True, False, H100, per_sm(2))
    small = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                         max_shared_per_block=128)
    with pytest.raises(ValueError, match="shared memory"):
        _rowwise_launch.row_launch(10, 10, 4, 4, True, False, small, per_sm(2))


@pytest.mark.parametrize("rows", [0, 1, 3, 131, 1000, 8192, 32768, 10**7])
@pytest.mark.parametrize("cols, itemsize", [(0, 4), (1, 2), (10, 4), (4096, 4), (128256, 2),
                                            (2**21, 4)])
@pytest.mark.parametrize("per_sm", [1, 4])
def test_stream_row_launch_is_the_forward_rule_without_splits(rows, cols, itemsize, per_sm):
    """rowclass_rows: row_team's team (never split over blocks: nothing is held on chip), a warp
    per row once rows fill a quarter of the resident warps, at most the resident blocks."""
    cfg = _rowclass_launch.stream_row_launch(rows, cols, itemsize, 4, H100, per_sm)
    resident = H100.sm_count * per_sm
    tpr, _ = _rowwise_launch.row_team(cols, itemsize)
    warps = 4 * rows >= resident * (BLOCK // _tuning.value("ROW_FORWARD_TEAM"))
    assert cfg.k == 1 and not cfg.cooperative and cfg.block == (BLOCK,)
    assert cfg.tpr == (min(tpr, _tuning.value("ROW_FORWARD_TEAM")) if warps else tpr)
    assert cfg.grid[0] == max(1, min(_cdiv(max(rows, 1), BLOCK // cfg.tpr), resident))
    assert cfg.shared == _launch.ROW_SCRATCH * 4


def test_stream_row_launch_shapes_and_limits():
    # The jsd benchmark shape (Llama-3 vocabulary, bfloat16): a warp streams each row.
    llm = _rowclass_launch.stream_row_launch(8192, 128256, 2, 4, H100, 4)
    assert (llm.tpr, llm.grid) == (32, (132 * 4,))
    # One long row: a whole block streams it.
    assert _rowclass_launch.stream_row_launch(1, 128256, 2, 4, H100, 4).tpr == BLOCK
    with pytest.raises(ValueError, match="2147483648 classes"):
        _rowclass_launch.stream_row_launch(1, 2**31, 2, 4, H100, 2)
    small = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                         max_shared_per_block=128)
    with pytest.raises(ValueError, match="shared memory"):
        _rowclass_launch.stream_row_launch(10, 10, 4, 4, small, 2)


def test_thread_per_row_launch():
    assert _rowwise_launch.thread_per_row_launch(0, 4, H100, 3).grid == (1,)
    assert _rowwise_launch.thread_per_row_launch(1000, 4, H100, 3).grid == (_cdiv(1000, BLOCK),)
    assert _rowwise_launch.thread_per_row_launch(10**9, 8, H100, 3).grid == (132 * 3,)


@pytest.mark.parametrize("shape, strides, want", [
    ((), (), 0),                  # no dims: one position
    ((1, 1), (5, 9), 0),          # only size-1 dims
    ((4, 3), (3, 1), 1),          # C-contiguous
    ((4, 1, 3), (3, 99, 1), 1),   # a size-1 dim in between is skipped
    ((4, 3), (6, 2), 2),          # every other element: merges with stride 2
    ((4, 3), (1, 4), None),       # transposed: C order does not walk it with one stride
    ((4, 3), (4, 1), None),       # padded rows
])
def test_merged_stride(shape, strides, want):
    assert _launch.merged_stride(shape, strides) == want


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_class_geometry_addresses_every_element(data):
    """For views of any layout: element (n, c, d) of the input, and (n, d) or (n, c, d) of the
    target, sit at n * sn + c * sc + d * sd (d the C-order index over dims 2, ...), or the
    geometry is None (those dims do not merge into one stride)."""
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    prob = data.draw(st.booleans())

    def view(shape):
        # A contiguous buffer in a random dim order, then a random step on each dim.
        steps = [data.draw(st.integers(1, 2)) for _ in shape]
        base = np.zeros([n * s for n, s in zip(shape, steps)])
        perm = data.draw(st.permutations(range(len(shape))))
        base = np.ascontiguousarray(base.transpose(perm)).transpose(np.argsort(perm))
        v = base[tuple(slice(None, None, s) for s in steps)]
        return v, tuple(s // v.itemsize for s in v.strides)

    x, xs = view(shape)
    tshape = shape if prob else (() if ndim == 1 else (shape[0], *shape[2:]))
    t, ts = view(tshape) if tshape else (np.zeros(()), ())
    geo = _rowwise_launch.class_geometry(shape, xs, tshape, ts, prob)
    inner_x = _launch.merged_stride(shape[2:], xs[2:])
    inner_t = _launch.merged_stride(shape[2:], ts[2:] if prob else ts[1:])
    if inner_x is None or inner_t is None:
        assert geo is None
        return
    cols = shape[1] if ndim > 1 else shape[0]
    n_count = 1 if ndim == 1 else shape[0]
    assert (geo.rows, geo.cols) == (n_count * geo.inner, cols)
    assert geo.batch_shape == (() if ndim == 1 else (shape[0], *shape[2:]))
    for n in range(n_count):
        for c in range(cols):
            for d in range(geo.inner):
                idx = (c,) if ndim == 1 else (n, c, *np.unravel_index(d, shape[2:]))
                assert _offset(x, idx) == n * geo.x[0] + c * geo.x[1] + d * geo.x[2]
                if prob:
                    assert _offset(t, idx) == n * geo.t[0] + c * geo.t[1] + d * geo.t[2]
                elif ndim > 1:
                    tidx = (n, *np.unravel_index(d, shape[2:]))
                    assert _offset(t, tidx) == n * geo.t[0] + d * geo.t[2]
    rows_kernel = geo.inner == 1 and (cols == 1 or xs[-1 if ndim == 1 else 1] == 1) and (
        not prob or cols == 1 or ts[-1 if ndim == 1 else 1] == 1)
    assert geo.contiguous_classes == rows_kernel


def _offset(a, idx):
    """Element offset of a[idx] from a's first element."""
    return sum(i * s // a.itemsize for i, s in zip(idx, a.strides))


# --- row-pair launches (rowpair_rows) ------------------------------------------------------------

@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("cols", [0, 1, 7, 8, 63, 64, 65, 1000, 4096, 8191, 8192, 8193, 2**20 + 3])
def test_pair_team_holds_the_row_with_the_smallest_team(itemsize, cols):
    chunks = max(1, cols // (16 // itemsize))
    tpr = _rowpair_launch.pair_team(cols, itemsize)
    assert tpr in _rowpair_launch.PAIR_TEAMS
    if tpr < _rowpair_launch.PAIR_BLOCK:
        assert tpr * _rowpair_launch.PAIR_VECS >= chunks          # the team holds the row
    if tpr > _rowpair_launch.PAIR_TEAMS[0]:
        assert (tpr // 2) * _rowpair_launch.PAIR_VECS < chunks    # and a smaller team would not


def test_pair_team_of_kernelbench_99_holds_a_row_in_one_block():
    # 8192 float32 a row: 2048 chunks, 256 threads holding 8 chunks of each of the three inputs
    assert _rowpair_launch.pair_team(8192, 4) == _rowpair_launch.PAIR_BLOCK
    assert _rowpair_launch.PAIR_BLOCK * _rowpair_launch.PAIR_VECS * 4 == 8192


# The H100 with the shared memory a block may opt into (227 KiB, H100_OPTIN above), an sm_86
# GPU's (99 KiB), and the 48 KiB every block may have.
SM86_OPTIN = DeviceLimits(sm_count=84, max_grid_x=2**31 - 1, max_grid_y=65535,
                          max_shared_per_block=49152, shared_per_sm=102400,
                          max_shared_optin=101376)
PAIR_DEVICES = {"h100": H100_OPTIN, "sm86": SM86_OPTIN, "48k": H100}


@pytest.mark.parametrize("device", PAIR_DEVICES)
@pytest.mark.parametrize("narrays", [2, 3])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("cols", [0, 1, 7, 8, 63, 64, 65, 1000, 4096, 8191, 8192, 8193, 16384,
                                  2**20 + 3])
def test_pair_vecs_hold_the_row_where_the_stages_fit(device, narrays, itemsize, cols):
    limits = PAIR_DEVICES[device]
    tpr = _rowpair_launch.pair_team(cols, itemsize)
    hv = _rowpair_launch.pair_vecs(cols, itemsize, narrays, True, limits)
    shared = _rowpair_launch.pair_shared(hv, narrays)
    assert 1 <= hv <= _rowpair_launch.PAIR_VECS
    assert shared == _rowpair_launch.PAIR_STAGES * _rowpair_launch.PAIR_BLOCK * hv * narrays * 16
    allowed = _launch.shared_limit(limits, True)
    assert shared + _rowpair_launch.PAIR_STATIC_SHARED <= allowed
    chunks = cols // (16 // itemsize)
    held = tpr * hv >= chunks
    if tpr * _rowpair_launch.PAIR_VECS >= chunks:                   # the team can hold the row ...
        more = _rowpair_launch.pair_shared(hv + 1, narrays) + _rowpair_launch.PAIR_STATIC_SHARED
        assert held or more > allowed                       # ... and does, where there is room
        assert tpr * (hv - 1) < max(chunks, 1)              # with no chunk slot to spare
    else:
        assert not held and hv == min(_rowpair_launch.PAIR_VECS,
                                      (allowed - _rowpair_launch.PAIR_STATIC_SHARED)
                                      // _rowpair_launch.pair_shared(1, narrays))


def test_pair_vecs_of_kernelbench_99():
    # H100: the three 32 KiB rows in each of two stages, 192 KiB, one block an SM
    assert _rowpair_launch.pair_vecs(8192, 4, 3, True, H100_OPTIN) == _rowpair_launch.PAIR_VECS
    assert _rowpair_launch.pair_shared(_rowpair_launch.PAIR_VECS, 3) == 192 * 1024
    # 99 KiB: four chunks a thread, the row streamed in two tiles; 48 KiB: one chunk
    assert _rowpair_launch.pair_vecs(8192, 4, 3, True, SM86_OPTIN) == 4
    assert _rowpair_launch.pair_vecs(8192, 4, 3, True, H100) == 1


@pytest.mark.parametrize("cols", [1, 8192, 2**20 + 3])
def test_pair_loss_alone_holds_nothing(cols):
    assert _rowpair_launch.pair_vecs(cols, 4, 3, False, H100_OPTIN) == 0
    cfg = _rowpair_launch.pair_launch(1000, cols, 4, 3, False, H100_OPTIN, lambda shared: 4)
    assert cfg.hv == 0 and cfg.shared == 0
    assert cfg.tpr == _rowpair_launch.pair_launch(1000, cols, 4, 3, True, H100_OPTIN,
                                           lambda shared: 1).tpr


def test_pair_vecs_refuse_a_device_without_room_for_one_chunk():
    tiny = DeviceLimits(sm_count=1, max_grid_x=2**31 - 1, max_grid_y=65535,
                        max_shared_per_block=16384)
    with pytest.raises(ValueError, match="rowpair_rows needs 26624 bytes of shared memory per "
                                         "block but the device allows 16384"):
        _rowpair_launch.pair_vecs(8192, 4, 3, True, tiny)


@pytest.mark.parametrize("rows", [0, 1, 3, 131, 1000, 32768, 10**7, 2**33])
@pytest.mark.parametrize("cols, itemsize", [(1, 4), (10, 2), (8192, 4), (2**21, 8)])
@pytest.mark.parametrize("per_sm", [1, 2, 4])
@pytest.mark.parametrize("grad", [False, True])
def test_pair_launch_stays_within_resident_blocks(rows, cols, itemsize, per_sm, grad):
    asked = []

    def occupancy(shared):
        asked.append(shared)
        return per_sm

    cfg = _rowpair_launch.pair_launch(rows, cols, itemsize, 3, grad, H100_OPTIN, occupancy)
    (grid,) = cfg.grid
    block = _rowpair_launch.PAIR_BLOCK
    assert cfg.block == (block,)
    assert cfg.tpr == _rowpair_launch.pair_team(cols, itemsize) and block % cfg.tpr == 0
    assert cfg.hv == _rowpair_launch.pair_vecs(cols, itemsize, 3, grad, H100_OPTIN)
    assert cfg.shared == _rowpair_launch.pair_shared(cfg.hv, 3)
    groups = max(1, _cdiv(rows, block // cfg.tpr))
    assert cfg.wide == _rowpair_launch.pair_wide(rows, cols, itemsize, grad, H100_OPTIN)
    if cfg.wide:   # a block a row group (the grid-stride loop past the grid's limit)
        assert asked == [] and grid == min(groups, H100_OPTIN.max_grid_x)
        return
    assert asked == [cfg.shared]   # residency is that of the shared memory it launches with
    assert 1 <= grid <= H100_OPTIN.sm_count * per_sm
    assert grid <= groups          # no block without a row


def test_pair_wide_is_the_loss_alone_of_many_long_rows_of_measured_element_sizes():
    sms = H100_OPTIN.sm_count
    edge = _tuning.value("PAIR_WIDE_GROUPS") * sms            # row groups needed
    size = _launch.PAIR_WIDE_ITEMSIZES[0]
    cols = _tuning.value("PAIR_WIDE_ROW_BYTES") // size       # a block a row at this length
    assert _rowpair_launch.pair_team(cols, size) == _rowpair_launch.PAIR_BLOCK
    assert _rowpair_launch.pair_wide(edge, cols, size, False, H100_OPTIN)
    assert not _rowpair_launch.pair_wide(edge - 1, cols, size, False, H100_OPTIN)   # too few rows
    assert not _rowpair_launch.pair_wide(edge, cols, size, True, H100_OPTIN)        # the gradient
    assert not _rowpair_launch.pair_wide(edge, cols - 1, size, False, H100_OPTIN)   # too short
    for other in (2, 4, 8):
        if other not in _launch.PAIR_WIDE_ITEMSIZES:
            long_row = 2 * _tuning.value("PAIR_WIDE_ROW_BYTES") // other
            assert not _rowpair_launch.pair_wide(10 * edge, long_row, other, False, H100_OPTIN)


def test_pair_launch_takes_the_wide_form_at_kernelbench_99():
    # 32768 rows of 8192 float32 (the wide form was measured there): a block a row, no shared
    cfg = _rowpair_launch.pair_launch(32768, 8192, 4, 3, False, H100_OPTIN, lambda shared: 4)
    assert cfg.wide and cfg.grid == (32768,) and cfg.tpr == _rowpair_launch.PAIR_BLOCK
    assert cfg.shared == 0 and cfg.hv == 0
    grad = _rowpair_launch.pair_launch(32768, 8192, 4, 3, True, H100_OPTIN, lambda shared: 1)
    assert not grad.wide and grad.grid == (H100_OPTIN.sm_count,)


def test_pair_launch_rejects_rows_past_32_bit_indices():
    with pytest.raises(ValueError, match="exceed the 2147483647 a row may have"):
        _rowpair_launch.pair_launch(1, 2**31, 4, 3, True, H100_OPTIN, lambda shared: 2)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 2**40), vec=st.sampled_from([1, 2, 4, 8]),
       steps=st.sampled_from([_tuning.value("FLAT_STEPS_VALUE"), _tuning.value("FLAT_STEPS_GRAD")]),
       per_sm=st.integers(1, BLOCKS_PER_SM))
def test_flat_grid_grows_past_one_wave_by_steps(n, vec, steps, per_sm):
    """With steps the grid is one wave (or the work's blocks, if fewer) until a thread would
    take more than `steps` vectors, and then exactly enough blocks for that."""
    work = -(-n // vec)
    wave = _launch.flat_launch(n, vec, H100, per_sm).grid[0]
    grid = _launch.flat_launch(n, vec, H100, per_sm, steps).grid[0]
    if work <= _launch.SINGLE_BLOCK_WORK:
        assert grid == wave == 1
    else:
        assert grid == max(wave, -(-work // (BLOCK * steps)))
        assert -(-work // (grid * BLOCK)) <= max(steps, -(-work // (wave * BLOCK)))


@pytest.mark.parametrize("nvec, grid", [(1, 1), (255, 1), (256, 2), (5000, 7), (2**20 + 3, 128),
                                        (8192 * 256 + 1, 8193)])
def test_value_chunks_cover_every_vector_once(nvec, grid):
    """pointwise_flat's value-only walk: block b's threads take [b per, (b + 1) per) with per a
    multiple of the block; every vector lands in exactly one block, each block starts aligned,
    and no thread takes more than ceil(nvec / (grid * BLOCK)) vectors."""
    per = _pointwise_launch.flat_chunk(nvec, grid)
    assert per // BLOCK == -(-nvec // (grid * BLOCK))
    seen = np.zeros(nvec, np.int64)
    for b in range(grid):
        start = b * per
        assert start % BLOCK == 0
        seen[start:min(nvec, start + per)] += 1
    assert np.all(seen == 1)


def test_launch_hands_the_driver_a_well_formed_extra_array(monkeypatch):
    """cuLaunchKernel's `extra`: (BUFFER_POINTER, &params, BUFFER_SIZE, &size, END) with size
    8 * the parameter words, and the grid, block, shared memory and stream as given."""
    import array
    import ctypes
    import types

    from cupyloss._core import args as _args

    seen = {}

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        q = ctypes.c_uint64
        head = [q.from_address(extra + 8 * i).value for i in range(5)]
        size = q.from_address(head[3]).value
        seen.update(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared,
                    stream=stream, head=head, size=size,
                    params=[q.from_address(head[1] + 8 * i).value for i in range(size // 8)])

    monkeypatch.setattr(_args, "_driver", types.SimpleNamespace(launchKernel=launch_kernel))
    words = array.array("Q", [7, 2**64 - 1, 0, 12345])
    _args.launch(11, (3, 2), (256,), 64, 99, words)
    assert seen["head"][0::2] == [1, 2, 0]
    assert seen["size"] == 32 and seen["params"] == list(words)
    assert seen["grid"] == (3, 2, 1) and seen["block"] == (256, 1, 1)
    assert (seen["fn"], seen["shared"], seen["stream"]) == (11, 64, 99)


def test_every_kernel_define_names_a_macro_the_kernels_read():
    """A define of the launch table that no kernel reads (a misspelt name) would change nothing
    without a word: each must be a macro the kernels require (pointwise.cu stops with #error
    without it; test_params checks the two sets are one) and use."""
    from cupyloss._core import source as _source

    sources = "".join(p.read_text() for p in _source.kernel_dir().iterdir()
                      if p.suffix in (".cu", ".cuh"))
    for option in _tuning.kernel_defines():
        assert option.startswith("-D") and "=" in option, option
        name, value = option[2:].split("=", 1)
        assert f"!defined({name})" in sources, f"{name} is required by no kernel"
        uses = re.findall(r"\b" + name + r"\b", sources)
        assert len(uses) > 1, f"{name} is read by no kernel"
        assert int(value) >= 0, option


def test_heavy_sizes_mask_names_element_sizes_of_the_dtypes():
    """CUPYLOSS_GRAD_HEAVY_SIZES sets bit b only for b-byte elements some dtype has."""
    from cupyloss._core import dtypes as _dtypes

    mask = next(int(o.split("=")[1]) for o in _tuning.kernel_defines()
                if o.startswith("-DCUPYLOSS_GRAD_HEAVY_SIZES="))
    sizes = {b for b in range(16) if mask >> b & 1}
    assert sizes and sizes <= {dtype.itemsize for dtype in _dtypes.DTYPES}


def test_kernel_constants_match_the_launcher():
    """A kernel constant noted `(_launch.NAME)` beside it equals that launcher constant: the
    host's grid, block and shared-memory arithmetic assumes the kernel's value (rowwise.cu's
    kept tiles, for one, are laid out for blocks of ROW_BLOCK = _launch.BLOCK threads)."""
    noted = re.compile(r"constexpr int (\w+) = (\d+);[^\n]*\(_launch\.(\w+)\)")
    pairs = [(path.name, m.group(1), int(m.group(2)), m.group(3))
             for path in sorted(_source.kernel_dir().glob("*.cu*"))
             for m in noted.finditer(path.read_text())]
    assert {const for _, const, _, _ in pairs} >= {"ROW_BLOCK", "ROW_VECS", "ROW_SCRATCH",
                                                   "PAIR_BLOCK", "PAIR_STAGES"}
    # the core's shared constants, or the family's own (<family>/_launch.py)
    homes = (_launch, _pointwise_launch, _rowwise_launch, _rowpair_launch, _rowclass_launch)
    for file, const, value, name in pairs:
        have = {getattr(m, name) for m in homes if hasattr(m, name)}
        assert have == {value}, f"{file}: {const} = {value}, but _launch.{name} = {have}"


@pytest.mark.parametrize("rows, grid", [(1, 1), (45, 45), (8192, 132 * 8), (0, 1)])
def test_slice_launch_is_a_block_a_row_within_one_wave(rows, grid):
    cfg = _rowwise_launch.slice_launch(rows, H100)
    assert cfg.grid == (grid,) and cfg.block == (_launch.BLOCK,) and cfg.shared == 0


def test_plan_caches_are_bounded_and_drop_the_oldest():
    from cupyloss._core import plans as _plans
    from cupyloss.pointwise import _family as _pointwise
    from cupyloss.rowclass import _family as _rowclass
    from cupyloss.rowpair import _family as _rowpair
    from cupyloss.rowwise import _family as _rowwise

    plans = _plans.Plans(3)
    for k in range(5):
        plans[k] = str(k)
    assert list(plans) == [2, 3, 4] and plans.get(0) is None
    plans[3] = "again"                       # a key it holds: replaced, nothing dropped
    assert list(plans) == [2, 3, 4] and plans[3] == "again"
    for engine in (_pointwise, _rowclass, _rowpair, _rowwise):
        assert isinstance(engine._PLANS, _plans.Plans)
        assert engine._PLANS.size == _plans.PLANS_KEPT
