"""Launch arithmetic of rowclass.cu's streaming rows: grids, blocks and shared memory from the
device's limits and the launch table (cupyloss._core.tuning); the shared parts are in
cupyloss._core.launch."""

from __future__ import annotations

from cupyloss._core import tuning as _tuning
from cupyloss._core.launch import (
    BLOCK, DeviceLimits, ROW_MAX_COLS, ROW_SCRATCH, _cdiv, check_shared)
from cupyloss.rowwise._launch import RowLaunch, row_team


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


def set_row_shared(cols: int, acc_itemsize: int, limits: DeviceLimits) -> int:
    """Shared memory of multilabel_margin_loss's block a row: the team sums' scratch and the
    row's target set, a bit a class (48 KiB hold about 390,000 classes)."""
    if cols > ROW_MAX_COLS:
        raise ValueError(f"rows of {cols} classes exceed the {ROW_MAX_COLS} a row may have")
    return check_shared(ROW_SCRATCH * acc_itemsize + 4 * _cdiv(cols, 32), limits,
                        "multilabel_margin_loss (a bit of shared memory a class)")


def set_row_launch(rows: int, cols: int, shared: int, limits: DeviceLimits,
                   blocks_per_sm: int) -> RowLaunch:
    """Launch for multilabel_margin_loss: a block a row, of the fewest warps (one to eight) that
    give each element a thread, and a grid of at most the resident blocks of a full-size block
    (blocks_per_sm of them; smaller blocks fit that many more) with the rows going round it."""
    block = 32
    while block < min(cols, BLOCK):
        block *= 2
    resident = max(1, limits.sm_count * blocks_per_sm * (BLOCK // block))
    grid = max(1, min(rows, resident, limits.max_grid_x))
    return RowLaunch((grid,), (block,), shared, block, 1)
