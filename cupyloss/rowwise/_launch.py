"""Launch arithmetic of rowwise.cu's kernels (cross_entropy_rows and _cols, the slices' and the
combine's): grids, blocks and shared memory from the device's limits and the launch table
(cupyloss._core.tuning); the shared parts are in cupyloss._core.launch."""

from __future__ import annotations

import dataclasses

from cupyloss._core import tuning as _tuning
from cupyloss._core.launch import (
    BLOCK, BLOCKS_PER_SM, DeviceLimits, Launch, ROW_CLUSTER_SIZES, ROW_MAX_COLS, ROW_SCRATCH,
    WARP, _cdiv, check_shared, merged_stride, shared_limit)


def slice_launch(rows: int, limits: DeviceLimits) -> Launch:
    """Launch of rowwise.cu's cross_entropy_slice_grad over `rows` rows: a block a row at a time,
    one wave of BLOCKS_PER_SM blocks an SM at most (the rows in a grid-stride loop)."""
    return Launch((max(1, min(rows, limits.sm_count * BLOCKS_PER_SM)),), (BLOCK,), 0)


def row_thread_launch(rows: int, limits: DeviceLimits) -> Launch:
    """Launch of a thread-a-row kernel (rowwise.cu's cross_entropy_combine): one wave of
    resident blocks at most, the rows in a grid-stride loop."""
    grid = max(1, min(_cdiv(rows, BLOCK), limits.sm_count * BLOCKS_PER_SM))
    return Launch((grid,), (BLOCK,), 0)


ROW_VECS = 8            # 16-byte vectors of a row one thread holds in registers (ROW_VECS there)


# Threads per row (a "team"), from a warp's quarter to a block.  A row of n 16-byte vectors gets
# the smallest team that holds it in registers at ROW_VECS vectors a thread, so each thread has
# ROW_VECS independent loads in flight; a row longer than a block holds is split over
# ceil(n / (BLOCK * ROW_VECS)) blocks of a cooperative launch.
ROW_TEAMS = (8, 16, 32, 64, 128, BLOCK)


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


def thread_per_row_launch(rows: int, acc_itemsize: int, limits: DeviceLimits,
                          blocks_per_sm: int = BLOCKS_PER_SM) -> Launch:
    """One thread per row (cross_entropy_cols), grid-stride past the resident blocks."""
    grid = max(1, min(_cdiv(max(rows, 1), BLOCK), limits.sm_count * blocks_per_sm,
                      limits.max_grid_x))
    shared = check_shared(ROW_SCRATCH * acc_itemsize, limits, "cross_entropy_cols")
    return Launch((grid,), (BLOCK,), shared)


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
