"""Launch arithmetic of rowpair.cu's kernels (triplet and cosine embedding): grids, blocks and
shared memory from the device's limits and the launch table (cupyloss._core.tuning); the shared
parts are in cupyloss._core.launch."""

from __future__ import annotations

import dataclasses

from cupyloss._core import tuning as _tuning
from cupyloss._core.launch import (
    BLOCK, PAIR_WIDE_ITEMSIZES, DeviceLimits, ROW_MAX_COLS, _cdiv, check_shared, shared_limit)


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
# form").  The element sizes compiled in the wide form: _core.launch.PAIR_WIDE_ITEMSIZES.


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
