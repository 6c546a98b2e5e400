"""Grid, block and shared-memory arithmetic, and the index tables kernels read.

Everything here is pure Python over integers and NumPy scalars so that CI tests it without a GPU;
the only device access is `device_limits`, which reads the limits the arithmetic is clamped to.
"""

from __future__ import annotations

import dataclasses
import functools

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


# --- Shared by the row families (kernels/rows.cuh; each family's own: <family>/_launch.py) ------

ROW_SCRATCH = 64        # accumulator slots of dynamic shared memory (ROW_SCRATCH there)
ROW_MAX_COLS = 2**31 - 1    # classes a row may have (in-row indices are 32-bit)
# The cluster sizes of cross_entropy_rows compiled (only pairs: clusters of 4 are resident too
# few at once); rowwise/_launch.py says how they are chosen.
ROW_CLUSTER_SIZES = (2,)
# The element sizes of rowpair_rows' wide form compiled (rowpair/_launch.py says when it runs).
PAIR_WIDE_ITEMSIZES = (4,)


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
