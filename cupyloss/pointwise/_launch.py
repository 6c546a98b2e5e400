"""Launch arithmetic of pointwise.cu's rows and reduce kernels (the flat kernel's is
_core.launch.flat_launch): grids, blocks and shared memory from the device's limits and the
launch table (cupyloss._core.tuning); the shared parts are in cupyloss._core.launch."""

from __future__ import annotations

import dataclasses
import math

from cupyloss._core import tuning as _tuning
from cupyloss._core.launch import (
    BLOCK, BLOCKS_PER_SM, DeviceLimits, Launch, SINGLE_BLOCK_WORK, WARP, _cdiv, check_shared)


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
