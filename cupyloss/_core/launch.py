"""Grid, block and shared-memory arithmetic, and the index tables kernels read.

Everything here is pure Python over integers and NumPy scalars so that CI tests it without a GPU;
the only device access is `device_limits`, which reads the limits the arithmetic is clamped to.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from cupyloss._core import tuning as _tuning

MAX_DIMS = 8            # CUPYLOSS_MAX_DIMS in kernels/common.cuh
BLOCK = 256             # threads per block of every kernel (their __launch_bounds__)
BLOCKS_PER_SM = 8       # 8 x 256 = 2048 resident threads per SM on sm_80 and sm_90
WARP = 32
# Work items (vectors of `vec` elements) up to which a launch is one block: it then writes its
# 0-d results itself, with no partials, no ticket and no scratch allocation.  8 items per
# thread keeps a one-block launch within a few microseconds of device time while small calls
# (kilobytes) pay a single launch and a single allocation of host time.
SINGLE_BLOCK_WORK = BLOCK * 8


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """The device properties launch arithmetic depends on."""

    sm_count: int
    max_grid_x: int
    max_grid_y: int
    max_shared_per_block: int
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    shared_per_sm: int = 228 * 1024
    max_shared_optin: int = 0       # what a block may have once its kernel opts in (0: the default)
    clusters: bool = False          # thread block clusters (compute capability 9.0 and later)
    gpu: str = ""                   # its key in the launch table (_tuning.gpu_key; "": none)
    compute_capability: int = 0     # 90 for 9.0
    memory_gbs: int = 0             # DRAM GB/s: 2 x memory clock x bus width (0: unknown)

    @property
    def traits(self) -> dict[str, int]:
        """Its traits as the launch table names them (_tuning.TRAITS)."""
        return {"compute_capability": self.compute_capability, "sm_count": self.sm_count,
                "memory_gbs": self.memory_gbs}


def memory_gbs(attrs) -> int:
    """DRAM bandwidth in GB/s from a device's attributes: 2 transfers a clock (kHz) of the bus's
    width (bits); 0 where either is not reported."""
    return 2 * attrs.get("MemoryClockRate", 0) * attrs.get("GlobalMemoryBusWidth", 0) // 8_000_000


@functools.lru_cache(maxsize=None)
def device_limits(device_id: int) -> DeviceLimits:
    """Read the limits of CUDA device `device_id` once; a GPU without a row of the launch table
    adopts the nearest tuned GPU's (_tuning.adopt)."""
    import cupy

    device = cupy.cuda.Device(device_id)
    attrs = device.attributes
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    cc = int(device.compute_capability)
    limits = DeviceLimits(
        sm_count=attrs["MultiProcessorCount"],
        max_grid_x=attrs["MaxGridDimX"],
        max_grid_y=attrs["MaxGridDimY"],
        max_shared_per_block=attrs["MaxSharedMemoryPerBlock"],
        regs_per_sm=attrs["MaxRegistersPerMultiprocessor"],
        threads_per_sm=attrs["MaxThreadsPerMultiProcessor"],
        shared_per_sm=attrs["MaxSharedMemoryPerMultiprocessor"],
        max_shared_optin=attrs.get("MaxSharedMemoryPerBlockOptin", 0),
        clusters=cc >= 90,
        gpu=_tuning.gpu_key(name.decode() if isinstance(name, bytes) else name),
        compute_capability=cc,
        memory_gbs=memory_gbs(attrs),
    )
    _tuning.adopt(limits.gpu, limits.traits)
    return limits


def resident_blocks(regs_per_thread: int, shared: int, limits: DeviceLimits,
                    block: int = BLOCK) -> int:
    """Blocks of `block` threads one SM holds at once, given the kernel's registers and smem.

    Registers are allocated per warp in units of 256; each block also reserves 1 KiB of shared
    memory (sm_80 and later).  Grids are sized to this so that a grid-stride kernel runs in
    exactly one wave instead of leaving a partial second one.
    """
    by_threads = limits.threads_per_sm // block
    regs_per_warp = -(-max(regs_per_thread, 1) * WARP // 256) * 256
    by_regs = limits.regs_per_sm // (regs_per_warp * (block // WARP))
    by_shared = limits.shared_per_sm // (shared + 1024)
    return max(1, min(by_threads, by_regs, by_shared, BLOCKS_PER_SM))


def check_shared(nbytes: int, limits: DeviceLimits, kernel: str, optin: bool = False) -> int:
    """Return `nbytes` if a block of `kernel` may have that much shared memory, else raise.
    optin: the kernel raises its limit to the device's opt-in maximum (`shared_limit`)."""
    allowed = shared_limit(limits, optin)
    if nbytes > allowed:
        raise ValueError(
            f"{kernel} needs {nbytes} bytes of shared memory per block but the device allows "
            f"{allowed}")
    return nbytes


def shared_limit(limits: DeviceLimits, optin: bool) -> int:
    """Shared memory a block may have: the default limit, or with optin the larger of it and the
    device's opt-in maximum (a kernel must set its max dynamic shared size to go past 48 KiB)."""
    return max(limits.max_shared_per_block, limits.max_shared_optin) if optin \
        else limits.max_shared_per_block


# --- 64-bit division by a run-time constant (IntDiv in kernels/common.cuh) -------------------

def divider(d: int) -> tuple[int, int, int]:
    """Magic (m, s1, s2) with floor(n / d) = (t + ((n - t) >> s1)) >> s2, t = mulhi64(m, n).

    Valid for 1 <= d < 2**63 and 0 <= n < 2**63 (Granlund & Montgomery 1994, fig. 4.1).
    """
    if not 1 <= d < 2**63:
        raise ValueError(f"divisor {d} is outside [1, 2**63)")
    l = (d - 1).bit_length()  # ceil(log2 d)
    m = (2**64 * (2**l - d)) // d + 1
    return m & (2**64 - 1), min(l, 1), max(l - 1, 0)


def divide(n: int, magic: tuple[int, int, int]) -> int:
    """What the device computes for floor(n / d) with `magic` from `divider` (for tests)."""
    m, s1, s2 = magic
    t = (m * n) >> 64
    return (t + ((n - t) >> s1)) >> s2


# --- Broadcast geometry ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def geometry_dtype(operands: int) -> numpy.dtype:
    """The host mirror of kernels/common.cuh's Geometry<operands>: every field 64-bit."""
    return numpy.dtype([
        ("ndim", "<i8"),
        ("dim", [("magic", "<u8"), ("shift1", "<i8"), ("shift2", "<i8"), ("divisor", "<i8")],
         (MAX_DIMS,)),
        ("stride", "<i8", (operands, MAX_DIMS)),
    ])


GEOMETRY_DTYPE = geometry_dtype(3)  # input, target and grad_output


def broadcast_strides(shape: tuple, strides: tuple, out_shape: tuple) -> tuple:
    """Element strides of an operand of `shape`/`strides` read at `out_shape` (0 = broadcast)."""
    pad = len(out_shape) - len(shape)
    result = [0] * pad
    for size, stride in zip(shape, strides):
        result.append(0 if size == 1 else stride)
    return tuple(result)


def coalesce(shape: tuple, strides: list[tuple]) -> tuple[tuple, list[tuple]]:
    """Drop size-1 dims and merge neighbours every operand walks as one; shape () -> (1,).

    Dims d (outer) and d + 1 merge when stride[d] == stride[d + 1] * shape[d + 1] for every
    operand, so flat index order and every operand's offsets are unchanged.
    """
    dims = [(size, [s[d] for s in strides]) for d, size in enumerate(shape) if size != 1]
    merged: list = []
    for size, st in dims:
        if merged:
            psize, pst = merged[-1]
            if all(p == q * size for p, q in zip(pst, st)):
                merged[-1] = (psize * size, st)
                continue
        merged.append((size, st))
    if not merged:
        merged = [(1, [0] * len(strides))]
    out_shape = tuple(size for size, _ in merged)
    out_strides = [tuple(st[k] for _, st in merged) for k in range(len(strides))]
    return out_shape, out_strides


def geometry(shape: tuple, strides: list[tuple], operands: int = 3) -> numpy.ndarray:
    """Pack a coalesced shape and up to `operands` operands' strides into Geometry<operands>."""
    ndim = len(shape)
    if ndim > MAX_DIMS:
        raise ValueError(f"geometry of {ndim} dims exceeds {MAX_DIMS}")
    if len(strides) > operands:
        raise ValueError(f"{len(strides)} operands' strides do not fit Geometry<{operands}>")
    g = numpy.zeros(1, geometry_dtype(operands))
    g["ndim"] = ndim
    for d, size in enumerate(shape):
        m, s1, s2 = divider(max(size, 1))
        g["dim"][0, d] = (m, s1, s2, size)
    for k, st in enumerate(strides):
        g["stride"][0, k, :ndim] = st
    return g


def offsets(i: int, shape: tuple, strides: list[tuple]) -> list[int]:
    """The element offsets Geometry.offsets gives for flat index i (for tests)."""
    off = [0] * len(strides)
    rest = i
    for d in range(len(shape) - 1, -1, -1):
        q = divide(rest, divider(shape[d])) if d > 0 else 0
        r = rest - q * shape[d]
        for k, st in enumerate(strides):
            off[k] += r * st[d]
        rest = q
    return off


# --- Launch configurations ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: grid, block, dynamic shared memory and layout parameters."""

    grid: tuple
    block: tuple
    shared: int
    tx: int = 0
    rows_per_block: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_launch(n: int, vec: int, limits: DeviceLimits,
                blocks_per_sm: int = BLOCKS_PER_SM, steps: int = 0) -> Launch:
    """Launch over ceil(n / vec) work items: one wave of blocks_per_sm per SM, or with `steps`,
    as many more blocks as give each thread at most `steps` items (pointwise_flat: the launch
    table's FLAT_STEPS_*).  No dynamic shared memory: the block sums' scratch is static
    (common.cuh)."""
    work = _cdiv(n, vec)
    if work <= SINGLE_BLOCK_WORK:
        grid = 1
    else:
        grid = min(_cdiv(work, BLOCK), limits.sm_count * blocks_per_sm)
        if steps:
            grid = max(grid, _cdiv(work, BLOCK * steps))
        grid = max(1, min(grid, limits.max_grid_x))
    return Launch((grid,), (BLOCK,), 0)


def slice_launch(rows: int, limits: DeviceLimits) -> Launch:
    """Launch of rowwise.cu's cross_entropy_slice_grad over `rows` rows: a block a row at a time,
    one wave of BLOCKS_PER_SM blocks an SM at most (the rows in a grid-stride loop)."""
    return Launch((max(1, min(rows, limits.sm_count * BLOCKS_PER_SM)),), (BLOCK,), 0)


def row_thread_launch(rows: int, limits: DeviceLimits) -> Launch:
    """Launch of a thread-a-row kernel (rowwise.cu's cross_entropy_combine): one wave of
    resident blocks at most, the rows in a grid-stride loop."""
    grid = max(1, min(_cdiv(rows, BLOCK), limits.sm_count * BLOCKS_PER_SM))
    return Launch((grid,), (BLOCK,), 0)


ROW_SUM_BYTES = 8   # pointwise_rows sums a row gradient across its lanes in double


def rows_shared(vec: int) -> int:
    """Dynamic shared memory of pointwise_rows: a double per thread and vector element."""
    return BLOCK * vec * ROW_SUM_BYTES


# pointwise_rows' value-only grid of an elementwise ('none') loss takes ROWS_WAVES_VALUE waves
# of resident blocks (whole waves leave no half-empty last one); a loss reduced to 0-d takes the
# gradient kernel's one-wave split so that it adds up in value_and_grad's order.  Where
# something is summed down the rows (a row operand's gradient, a 0-d loss) a block is
# ROWS_TX_SUMMED threads along a row: narrower column blocks leave each column fewer row
# blocks' partials to add.  Both are knobs of the launch table (_tuning); the runs:
# docs/tuning.md, "pointwise_rows' waves" and "pointwise_rows' column blocks".


def rows_launch(rows: int, cols: int, vec: int, limits: DeviceLimits,
                blocks_per_sm: int = BLOCKS_PER_SM, waves: int = 1,
                max_tx: int = BLOCK) -> Launch:
    """Launch for pointwise_rows over [rows, cols] with tx threads along a row.

    tx is the power of two in [32, max_tx] closest above cols / vec, so narrow rows still fill
    a warp; ty = BLOCK / tx threads go down the rows.  Column blocks cover cols; row blocks
    are added until the grid holds `waves` times blocks_per_sm blocks per SM (at most 65535 of
    them, and never fewer than ty rows each).  Shared memory: `rows_shared`, where the lanes'
    row-gradient sums meet (whatever the accumulator type).
    """
    lanes = _cdiv(cols, vec)
    tx = min(BLOCK, max_tx, max(WARP, 1 << max(lanes - 1, 0).bit_length()))
    ty = BLOCK // tx
    col_blocks = _cdiv(lanes, tx)
    if col_blocks > limits.max_grid_x:
        raise ValueError(f"rows of {cols} elements need {col_blocks} column blocks, more than "
                         f"the device's {limits.max_grid_x}")
    want = max(1, (limits.sm_count * blocks_per_sm * waves) // col_blocks)
    if col_blocks == 1 and rows * min(lanes, BLOCK) <= SINGLE_BLOCK_WORK:
        want = 1  # small: one block, which also writes the row gradient itself
    row_blocks = max(1, min(want, _cdiv(rows, ty), limits.max_grid_y))
    rows_per_block = max(1, _cdiv(rows, row_blocks))
    row_blocks = max(1, _cdiv(rows, rows_per_block))
    shared = check_shared(rows_shared(vec), limits, "pointwise_rows")
    return Launch((col_blocks, row_blocks), (BLOCK,), shared, tx, rows_per_block)


def sum_chunks_launch(cols: int, limits: DeviceLimits) -> Launch:
    """One warp per column of [chunks, cols] partials, grid-stride past the resident warps."""
    grid = max(1, min(_cdiv(cols, BLOCK // WARP), limits.sm_count * BLOCKS_PER_SM,
                      limits.max_grid_x))
    return Launch((grid,), (BLOCK,), 0)


# --- Gradients of broadcast operands (pointwise_reduce) ----------------------------------------

@dataclasses.dataclass(frozen=True)
class ReduceSplit:
    """A coalesced broadcast shape split for the operands reduced in one launch: the dims they
    keep (their own shape, C order) and the dims they are broadcast along, each with every
    operand's strides (as `coalesce` gives them)."""

    kept: tuple
    kept_strides: list
    red: tuple
    red_strides: list
    inner_reduced: bool     # whether the innermost dim is one the operands are broadcast along

    @property
    def n_o(self) -> int:
        return math.prod(self.kept)

    @property
    def n_m(self) -> int:
        return math.prod(self.red)

    @property
    def inner(self) -> int:
        """Length of the innermost run of reduced elements (1 when the innermost dim is kept)."""
        return self.red[-1] if self.inner_reduced else 1


def broadcast_pattern(shape: tuple, strides: tuple) -> tuple:
    """Which dims of a coalesced `shape` an operand with `strides` is broadcast along."""
    return tuple(size != 1 and stride == 0 for size, stride in zip(shape, strides))


def split_reduced(shape: tuple, strides: list[tuple], operand: int) -> ReduceSplit:
    """Split a coalesced `shape` (every operand's `strides`) into the dims `operand` keeps and
    the dims it is broadcast along.  Kept and broadcast dims never merge in `coalesce` (their
    strides are nonzero and zero), so each group is a list of whole coalesced dims."""
    pattern = broadcast_pattern(shape, strides[operand])
    kept = [d for d, b in enumerate(pattern) if not b]
    red = [d for d, b in enumerate(pattern) if b]
    if not kept or not red:
        raise ValueError(f"operand {operand} with strides {strides[operand]} over {shape} is not "
                         f"broadcast along some but not all dims")
    return ReduceSplit(tuple(shape[d] for d in kept), [tuple(st[d] for d in kept) for st in strides],
                       tuple(shape[d] for d in red), [tuple(st[d] for d in red) for st in strides],
                       pattern[-1])


# How pointwise_reduce splits the work (one table; _launch.reduce_launch reads it):
#   a unit is a warp; it takes lanes_o = 32 / lanes_m output elements o and a chunk of their
#   broadcast elements m.
#   lanes_m: innermost dim reduced -> enough lanes to cover its run in VEC vectors (up to 32),
#            so a warp reads along contiguous memory; more when there are fewer than 32 / lanes_m
#            outputs (the spare lanes split m).  Innermost dim kept -> one lane per o: 32
#            neighbouring o, contiguous in memory, each lane summing its own o.
#   chunks:  one wave of resident warps spread over the output elements, so a handful of
#            outputs (a per-channel parameter) still fills the device, but no more: partials are
#            [chunks, n_o] with chunks <= resident warps / units, bounded by the device.
#   REDUCE_MIN_STEPS: each lane makes at least this many VEC steps per unit; below it the
#            unit's butterfly and partial write cost more than they save.
#
# Every other choice of the pointwise kernels' schedule is a knob of the launch table
# (_tuning.KNOBS: one value per GPU, the defaults measured on an H100): pointwise_reduce's steps
# of loads in flight and the blocks per SM its registers are bounded for, the same for the
# gradient instantiations of pointwise_rows and pointwise_flat, for functors marked cheap
# (losses.cuh), heavy ones (a log, an exp or a division a value: bound by latency, so fewer
# registers and more resident warps) and streaming ones (heavy on 4-byte elements with their
# broadcast arithmetic out of the loop: bound by loads in flight again); pointwise_flat's steps
# at once and the vectors a thread takes at most.  Compile-time knobs reach the kernels as -D
# macros (_tuning.kernel_defines).  Why each default: docs/tuning.md ("pointwise_reduce's
# bound", "Gradient shapes", "16-bit rows gradients", "Streaming shapes", "Software pipelining
# and heavy element sizes", "pointwise_flat's steps", "pointwise_flat's grid").


def flat_chunk(nvec: int, grid: int, block: int = BLOCK) -> int:
    """Vectors per block of pointwise_flat's value-only walk (the kernel's `per`): block b
    takes [b per, (b + 1) per), per a whole number of blocks' worth so each chunk starts
    aligned (for tests)."""
    return _cdiv(nvec, grid * block) * block


@dataclasses.dataclass(frozen=True)
class ReduceLaunch:
    """A launch of pointwise_reduce: grid and block, lanes per output element, chunking of m."""

    grid: tuple
    block: tuple
    shared: int
    lanes_m: int
    chunk: int
    nchunks: int


def reduce_lanes(n_o: int, inner: int, inner_reduced: bool, vec: int) -> int:
    """Lanes per output element (a power of two in 1..32): see the table above."""
    if not inner_reduced:
        return WARP // min(WARP, 1 << max(n_o - 1, 0).bit_length())
    lanes = 1 << max(_cdiv(inner, vec) - 1, 0).bit_length()
    spare = WARP // min(WARP, 1 << max(n_o - 1, 0).bit_length())
    return min(WARP, max(lanes, spare))


def reduce_launch(split: ReduceSplit, vec: int, limits: DeviceLimits,
                  blocks_per_sm: int = BLOCKS_PER_SM) -> ReduceLaunch:
    """Launch for pointwise_reduce over `split` with VEC-element steps (see the table above)."""
    n_o, n_m = split.n_o, split.n_m
    lanes_m = reduce_lanes(n_o, split.inner, split.inner_reduced, vec)
    units_o = _cdiv(n_o, WARP // lanes_m)
    resident = limits.sm_count * blocks_per_sm * (BLOCK // WARP)
    step = lanes_m * vec
    knob = _tuning.values(limits.gpu)
    least = knob["REDUCE_MIN_STEPS"]
    nchunks = max(1, min(resident // units_o, _cdiv(n_m, step * least)))
    chunk = _cdiv(_cdiv(n_m, nchunks), step) * step
    nchunks = _cdiv(n_m, chunk)
    grid = max(1, min(_cdiv(units_o * nchunks, BLOCK // WARP), limits.sm_count * blocks_per_sm,
                      limits.max_grid_x))
    return ReduceLaunch((grid,), (BLOCK,), 0, lanes_m, chunk, nchunks)   # static scratch only


# --- Row-wise launches (kernels/rowwise.cu) ------------------------------------------------------

ROW_VECS = 8            # 16-byte vectors of a row one thread holds in registers (ROW_VECS there)
ROW_SCRATCH = 64        # accumulator slots of dynamic shared memory (ROW_SCRATCH there)
# Threads per row (a "team"), from a warp's quarter to a block.  A row of n 16-byte vectors gets
# the smallest team that holds it in registers at ROW_VECS vectors a thread, so each thread has
# ROW_VECS independent loads in flight; a row longer than a block holds is split over
# ceil(n / (BLOCK * ROW_VECS)) blocks of a cooperative launch.
ROW_TEAMS = (8, 16, 32, 64, 128, BLOCK)
ROW_MAX_COLS = 2**31 - 1    # classes a row may have (in-row indices are 32-bit)
# The launch table's knobs of cross_entropy_rows (_tuning; why each default: docs/tuning.md,
# "cross_entropy_rows"): blocks sharing a row wait for each other once a row, so at most
# ROW_MAX_SPLIT of them share one (past that the waits cost more than a block streaming its
# share twice).  With a gradient, the tiles of a block's share past its registers' one
# (BLOCK * ROW_VECS 16-byte vectors, 32 KiB) are kept in dynamic shared memory, at most
# ROW_STASH_TILES, so the gradient needs no second read of the logits; the fewest blocks a row
# that hold it this way are taken.  With ROW_CLUSTERS, k blocks sharing a row form a thread block
# cluster where the device has them (sm_90 and later) and k is one of ROW_CLUSTER_SIZES: they
# exchange their row states through distributed shared memory with one cluster barrier a row,
# instead of through global memory and a counter each waits on; bitwise the same results.
# A pair's blocks keep fewer tiles each, so more of them are resident (96 KiB of kept tiles
# leave room for two blocks an SM, 32 KiB for three, the registers' limit), and a pair exchanges
# its states through one cluster barrier, where more blocks of a cooperative launch wait on
# global memory: so a row a block would hold with more than ROW_ALONE_STASH kept tiles goes to
# a pair, and a pair that would read ROW_PAIR_REREAD tiles again still beats a wider split.
# Without a gradient nothing is held, and a team of ROW_FORWARD_TEAM threads a row reads fastest
# when there are rows for a quarter of the resident teams at least.  With a gradient and a row
# one block holds, ROW_GRAD_TILES tiles a thread: a team 1 / ROW_GRAD_TILES the size (a warp at
# least) keeps one tile in registers and reads the others again from L2, which spreads a row's
# fixed cost (its target, merges and barriers) over more elements a thread.
# The cluster sizes compiled (only pairs: clusters of 4 are resident too few at once).
ROW_CLUSTER_SIZES = (2,)


@dataclasses.dataclass(frozen=True)
class RowLaunch:
    """A launch of cross_entropy_rows: tpr threads per row, k blocks per row (k > 1: grid =
    groups * k, a cluster of k blocks per group when `cluster`, else a cooperative launch with
    every block resident), `stash` tiles a block keeps in shared memory (counted in `shared`)."""

    grid: tuple
    block: tuple
    shared: int
    tpr: int
    k: int
    stash: int = 0
    cluster: bool = False

    @property
    def cooperative(self) -> bool:
        return self.k > 1 and not self.cluster


def row_team(cols: int, itemsize: int, tiles: int = 1) -> tuple[int, int]:
    """(threads per row, blocks per row) that hold a row of `cols` elements in registers; with
    tiles > 1, where one block holds the row, the smallest team (a warp at least, or the holding
    team where that is smaller) that takes it in `tiles` tiles a thread."""
    vectors = max(1, cols // (16 // itemsize))
    for tpr in ROW_TEAMS:
        if tpr * ROW_VECS >= vectors:
            taken = next(t for t in ROW_TEAMS if t * ROW_VECS * tiles >= vectors)
            return max(taken, min(tpr, WARP)), 1
    return BLOCK, _cdiv(vectors, BLOCK * ROW_VECS)


def row_hold(cols: int, itemsize: int, acc_itemsize: int, limits: DeviceLimits) -> tuple[int, int]:
    """(blocks per row, stash tiles a block) that hold a row too long for one block's registers:
    the fewest blocks (at most ROW_MAX_SPLIT) whose registers and up to ROW_STASH_TILES tiles of
    shared memory each (as many as the device's opt-in limit allows) hold it; at ROW_MAX_SPLIT
    blocks with the most tiles, what is left over streams twice.  Where a cluster of two blocks
    may take a row (`pair`), one block keeps at most ROW_ALONE_STASH tiles before the row goes to
    a pair, and a pair whose blocks would read at most ROW_PAIR_REREAD tiles again takes the row
    rather than more blocks of a cooperative launch."""
    knob = _tuning.values(limits.gpu)
    tile = BLOCK * ROW_VECS
    vectors = max(1, cols // (16 // itemsize))
    room = shared_limit(limits, True) - ROW_SCRATCH * acc_itemsize
    most = max(0, min(knob["ROW_STASH_TILES"], room // (16 * tile)))
    pair = (limits.clusters and bool(knob["ROW_CLUSTERS"]) and 2 in ROW_CLUSTER_SIZES
            and knob["ROW_MAX_SPLIT"] >= 2)
    for k in range(1, knob["ROW_MAX_SPLIT"] + 1):
        tiles = _cdiv(_cdiv(vectors, k), tile)
        keep = min(most, knob["ROW_ALONE_STASH"]) if k == 1 and pair else most
        if tiles - 1 <= keep:
            return k, tiles - 1
        if k == 2 and pair and tiles - 1 - most <= knob["ROW_PAIR_REREAD"]:
            return 2, most
    return knob["ROW_MAX_SPLIT"], most


def row_launch(rows: int, cols: int, itemsize: int, acc_itemsize: int, grad: bool,
               light: bool, limits: DeviceLimits, occupancy) -> RowLaunch:
    """Launch for cross_entropy_rows over [rows, cols]; occupancy(shared bytes, cluster size)
    gives the resident blocks per SM of its kernel (cluster size 1: the plain one) with that much
    dynamic shared memory.

    grad: the gradient is written, so a row is held on chip: the team from `row_team`, and past a
    block's registers the blocks and shared-memory tiles from `row_hold`.  Without a gradient a
    row streams through once: a warp per row when rows are plenty (ROW_FORWARD_TEAM), k > 1 only
    when there are too few rows to give every resident block one.  light: nothing but one element
    per row is read (nll_loss), so the smallest team, or with a gradient the team row_team gives
    and never more than a block a row.  Grids never exceed the resident blocks:
    the rows go round in a grid-stride loop.
    """
    if cols > ROW_MAX_COLS:
        raise ValueError(f"rows of {cols} classes exceed the {ROW_MAX_COLS} a row may have")
    knob = _tuning.values(limits.gpu)
    tiles = knob["ROW_GRAD_TILES"] if grad and not light else 1
    tpr, k = (ROW_TEAMS[0], 1) if light and not grad else row_team(cols, itemsize, tiles)
    if light:
        k = 1   # no row state: a team of a block writes a gradient row of any length
    stash = 0
    if grad and k > 1:
        k, stash = row_hold(cols, itemsize, acc_itemsize, limits)
    shared = check_shared(ROW_SCRATCH * acc_itemsize + stash * 16 * BLOCK * ROW_VECS, limits,
                          "cross_entropy_rows", optin=True)
    # A row split over a cluster's blocks runs the cluster kernel: its occupancy is asked, so a
    # call compiles only the kernel it launches.
    cluster = (grad and k > 1 and limits.clusters and bool(knob["ROW_CLUSTERS"])
               and k in ROW_CLUSTER_SIZES)
    resident = max(1, limits.sm_count * occupancy(shared, k if cluster else 1))
    if grad:
        k = min(k, resident)
    else:
        if k > 1:
            k = max(1, min(k, resident // max(rows, 1)))
        team = knob["ROW_FORWARD_TEAM"]
        if k == 1 and 4 * rows >= resident * (BLOCK // team):
            tpr = min(tpr, team)
    if k > 1:
        groups = max(1, min(rows, resident // k))
        return RowLaunch((groups * k,), (BLOCK,), shared, BLOCK, k, stash,
                         cluster and k in ROW_CLUSTER_SIZES)
    blocks = _cdiv(max(rows, 1), BLOCK // tpr)
    return RowLaunch((max(1, min(blocks, resident, limits.max_grid_x)),), (BLOCK,), shared, tpr,
                     1, stash)


# --- Row-pair launches (kernels/rowpair.cu) --------------------------------------------------------

PAIR_BLOCK = BLOCK      # threads a block (PAIR_BLOCK there)
PAIR_VECS = 8           # 16-byte chunks of each array a thread holds a unit, at most
PAIR_STAGES = 2         # units in shared memory at once: one computed on, one streaming in
                        # (PAIR_STAGES there)
PAIR_CHUNK = 16         # bytes of a chunk
# Static shared memory of rowpair_rows, at most (the team sums and grid_sum_out's scratch: 1040
# bytes for double), kept free beside the stages.
PAIR_STATIC_SHARED = 2048
# Threads per row (a team), as ROW_TEAMS: the smallest team that holds a row's chunks at
# PAIR_VECS a thread; past a block, the block streams the row in tiles.  The loss alone takes the
# same team: each thread then adds the same elements in the same order, so a row's loss is
# bitwise the one value_and_grad gives.
PAIR_TEAMS = (8, 16, 32, 64, 128, PAIR_BLOCK)
# The loss alone of rows of at least PAIR_WIDE_ROW_BYTES bytes of an element size in
# PAIR_WIDE_ITEMSIZES, over at least PAIR_WIDE_GROUPS row groups a multiprocessor (both knobs of
# the launch table, _tuning), takes the wide form: a block a row (rowpair_rows<..., WIDE>: more
# loads of a tile in flight, fewer blocks an SM), the blocks handed out as SMs free up rather
# than a persistent grid's fixed share of rows each; rowpair_finish then adds the rows' losses
# (about 3 us, so the form wins from about 32 rows an SM; docs/tuning.md, "rowpair_rows' wide
# form").  The element sizes compiled in the wide form:
PAIR_WIDE_ITEMSIZES = (4,)
PAIR_FINISH_BLOCK = 1024   # threads of rowpair_finish (PAIR_FINISH_BLOCK there)


@dataclasses.dataclass(frozen=True)
class PairLaunch:
    """A launch of rowpair_rows: tpr threads per row, PAIR_BLOCK // tpr rows a block at a time;
    with the gradient, hv chunks of each array a thread a unit in `shared` bytes of dynamic
    shared memory (the stages), else hv = 0 and no dynamic shared memory (the loss alone
    streams through registers)."""

    grid: tuple
    block: tuple
    shared: int
    tpr: int
    hv: int
    wide: bool = False


def pair_team(cols: int, itemsize: int) -> int:
    """Threads per row that hold a row of `cols` elements (the block, streaming, past that)."""
    chunks = max(1, cols // (PAIR_CHUNK // itemsize))
    for tpr in PAIR_TEAMS:
        if tpr * PAIR_VECS >= chunks:
            return tpr
    return PAIR_BLOCK


def pair_shared(hv: int, narrays: int) -> int:
    """Dynamic shared memory of rowpair_rows: PAIR_STAGES stages of hv chunks of each of
    `narrays` arrays for every thread of the block."""
    return PAIR_STAGES * PAIR_BLOCK * hv * narrays * PAIR_CHUNK


def pair_vecs(cols: int, itemsize: int, narrays: int, grad: bool, limits: DeviceLimits) -> int:
    """Chunks of each array a thread holds a unit.  With the gradient: as many as its team needs
    to hold the row (at most PAIR_VECS), fewer where the device's shared memory per block
    (limits, opt-in included) has no room for PAIR_STAGES stages of them (the row then streams
    twice); raises if not even one chunk a thread fits.  The loss alone: 0 (it holds nothing)."""
    if not grad:
        return 0
    tpr = pair_team(cols, itemsize)
    need = min(PAIR_VECS, max(1, _cdiv(cols // (PAIR_CHUNK // itemsize), tpr)))
    room = (shared_limit(limits, True) - PAIR_STATIC_SHARED) // pair_shared(1, narrays)
    if room < 1:
        check_shared(pair_shared(1, narrays) + PAIR_STATIC_SHARED, limits, "rowpair_rows",
                     optin=True)
    return min(need, room)


def pair_wide(rows: int, cols: int, itemsize: int, grad: bool, limits: DeviceLimits) -> bool:
    """Whether rowpair_rows takes its wide form: the loss alone, rows of PAIR_WIDE_ROW_BYTES or
    more of an element size in PAIR_WIDE_ITEMSIZES, at least PAIR_WIDE_GROUPS row groups an SM."""
    knob = _tuning.values(limits.gpu)
    groups = _cdiv(max(rows, 1), PAIR_BLOCK // pair_team(cols, itemsize))
    return (not grad and itemsize in PAIR_WIDE_ITEMSIZES
            and cols * itemsize >= knob["PAIR_WIDE_ROW_BYTES"]
            and groups >= knob["PAIR_WIDE_GROUPS"] * limits.sm_count)


def pair_launch(rows: int, cols: int, itemsize: int, narrays: int, grad: bool,
                limits: DeviceLimits, occupancy) -> PairLaunch:
    """Launch for rowpair_rows over [rows, cols] of `narrays` arrays, with the gradient or not;
    occupancy(shared bytes) gives its resident blocks per SM with that much dynamic shared memory.

    The team from `pair_team`, the unit from `pair_vecs`.  The wide form (`pair_wide`) takes a
    block a row group; otherwise the grid never exceeds the resident blocks, and rows go round in
    a grid-stride loop.
    """
    if cols > ROW_MAX_COLS:
        raise ValueError(f"rows of {cols} elements exceed the {ROW_MAX_COLS} a row may have")
    tpr = pair_team(cols, itemsize)
    hv = pair_vecs(cols, itemsize, narrays, grad, limits)
    shared = pair_shared(hv, narrays)
    blocks = _cdiv(max(rows, 1), PAIR_BLOCK // tpr)
    if pair_wide(rows, cols, itemsize, grad, limits):
        return PairLaunch((min(blocks, limits.max_grid_x),), (PAIR_BLOCK,), 0, tpr, 0, True)
    resident = max(1, limits.sm_count * occupancy(shared))
    grid = max(1, min(blocks, resident, limits.max_grid_x))
    return PairLaunch((grid,), (PAIR_BLOCK,), shared, tpr, hv)


def thread_per_row_launch(rows: int, acc_itemsize: int, limits: DeviceLimits,
                          blocks_per_sm: int = BLOCKS_PER_SM) -> Launch:
    """One thread per row (cross_entropy_cols), grid-stride past the resident blocks."""
    grid = max(1, min(_cdiv(max(rows, 1), BLOCK), limits.sm_count * blocks_per_sm,
                      limits.max_grid_x))
    shared = check_shared(ROW_SCRATCH * acc_itemsize, limits, "cross_entropy_cols")
    return Launch((grid,), (BLOCK,), shared)


def merged_stride(shape: tuple, strides: tuple):
    """The element stride of dims `shape` walked as one C-order index, or None if they do not
    merge (size-1 dims are skipped; no dims, or all of size 1, give 0)."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return 0
    inner = dims[-1][1]
    expect = inner * dims[-1][0]
    for n, s in reversed(dims[:-1]):
        if s != expect:
            return None
        expect = s * n
    return inner


@dataclasses.dataclass(frozen=True)
class ClassGeometry:
    """An input with the class axis at dim 1 viewed as [N, C, inner] (rows = N * inner), and
    each operand's element strides along (n, c, d); None for an operand that is absent."""

    rows: int
    cols: int
    inner: int
    batch_shape: tuple      # the shape of a reduction='none' loss
    x: tuple                # (xn, xc, xd)
    t: tuple                # (tn, tc, td); tc = 0 for class indices

    @property
    def contiguous_classes(self) -> bool:
        """Whether cross_entropy_rows applies: one position per row, classes at stride 1."""
        return self.inner == 1 and self.x[1] == 1 and self.t[1] in (0, 1)


def class_geometry(x_shape: tuple, x_strides: tuple, t_shape: tuple, t_strides: tuple,
                   prob: bool):
    """The ClassGeometry of input (C,) or (N, C, d1, ...) and its target, whose shape the caller
    has checked: () / (N, d1, ...) class indices, or the input's shape with `prob`.  None when
    an operand's d1, ... dims do not merge into one stride (make it contiguous first)."""
    if len(x_shape) == 1:
        n, c, inner_shape = 1, x_shape[0], ()
        xn, xc, x_inner = 0, x_strides[0], ()
    else:
        n, c, inner_shape = x_shape[0], x_shape[1], tuple(x_shape[2:])
        xn, xc, x_inner = x_strides[0], x_strides[1], tuple(x_strides[2:])
    inner = 1
    for size in inner_shape:
        inner *= size
    xd = merged_stride(inner_shape, x_inner)
    if prob:
        tn, tc = (0, t_strides[0]) if len(x_shape) == 1 else (t_strides[0], t_strides[1])
        td = merged_stride(inner_shape, tuple(t_strides[2:]))
    else:
        tc = 0
        tn = 0 if len(x_shape) == 1 else t_strides[0]
        td = merged_stride(inner_shape, tuple(t_strides[1:])) if len(x_shape) > 1 else 0
    if xd is None or td is None:
        return None
    batch = () if len(x_shape) == 1 else (n, *inner_shape)
    if n == 1:
        xn = tn = 0
    if inner == 1:
        xd = td = 0
    if c == 1:
        xc, tc = 1, (1 if prob else 0)
    return ClassGeometry(n * inner, c, inner, batch, (xn, xc, xd), (tn, tc, td))


# --- Streaming row-wise launches (kernels/rowclass.cu) -------------------------------------------

def stream_row_launch(rows: int, cols: int, itemsize: int, acc_itemsize: int,
                      limits: DeviceLimits, blocks_per_sm: int) -> RowLaunch:
    """Launch for rowclass_rows over [rows, cols] (blocks_per_sm: its resident blocks).

    Nothing of a row is held on chip (each element's gradient needs only that element), so this
    is cross_entropy's forward rule: the team `row_team` gives for the row length (its k ignored:
    a long row is streamed by a whole block), a warp per row when there are rows for a quarter of
    the resident warps (ROW_FORWARD_TEAM), and a grid of at most the resident blocks with the rows
    going round it.
    """
    if cols > ROW_MAX_COLS:
        raise ValueError(f"rows of {cols} classes exceed the {ROW_MAX_COLS} a row may have")
    resident = max(1, limits.sm_count * blocks_per_sm)
    tpr, _ = row_team(cols, itemsize)
    team = _tuning.value("ROW_FORWARD_TEAM", limits.gpu)
    if 4 * rows >= resident * (BLOCK // team):
        tpr = min(tpr, team)
    shared = check_shared(ROW_SCRATCH * acc_itemsize, limits, "rowclass_rows")
    blocks = _cdiv(max(rows, 1), BLOCK // tpr)
    return RowLaunch((max(1, min(blocks, resident, limits.max_grid_x)),), (BLOCK,), shared, tpr, 1)
