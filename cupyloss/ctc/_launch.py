"""Launch arithmetic of ctc_loss (kernels/ctc.cu): a block a sequence whose threads hold its
extended-label positions, the shared memory of those positions, the gradient's grid."""

from __future__ import annotations

import dataclasses

from cupyloss._core import source as _source

KMAX, BLOCK, GRAD_BLOCK, FINISH_BLOCK, GROUP_HEAD = _source.constants(
    "ctc.cu", "CTC_KMAX", "CTC_BLOCK", "CTC_GRAD_BLOCK", "CTC_FINISH_BLOCK", "CTC_GROUP_HEAD")
_STATIC = 2048            # bytes of static shared memory a kernel holds besides (red, part)
_GRAD_BLOCKS_PER_SM = 16  # ctc_grad's resident blocks an SM takes (8 warps each: 128 warps)


@dataclasses.dataclass(frozen=True)
class CtcLaunch:
    """One sequence's block: threads, and the dynamic shared bytes of ctc_alpha and ctc_beta."""

    block: int
    shared: int


def round_positions(positions: int) -> int:
    """Positions rounded up to a whole warp (so sequences of near lengths share a plan)."""
    return max(32, -(-positions // 32) * 32)


def _shared(lcap: int, acc_size: int) -> int:
    """Dynamic shared bytes of ctc_alpha and ctc_beta for `lcap` positions: two steps of the
    recursion and the extended labels."""
    return 2 * lcap * acc_size + 4 * lcap


def max_positions(dtype, limits) -> int:
    """The most extended-label positions (2 S + 1) a sequence may have: KMAX a thread of the
    largest block, and their shared memory within the device's per-block limit."""
    acc_size = 8 if dtype.itemsize == 8 else 4
    budget = (limits.max_shared_optin or limits.max_shared_per_block) - _STATIC
    by_shared = budget // (2 * acc_size + 4) // 32 * 32
    return min(KMAX * BLOCK, by_shared)


def ctc_launch(lcap: int, acc_size: int, limits) -> CtcLaunch:
    """The block of a sequence of at most `lcap` positions (a multiple of 32, at most
    max_positions): one thread a position up to BLOCK, then up to KMAX positions a thread."""
    return CtcLaunch(min(BLOCK, lcap), _shared(lcap, acc_size))


def grad_grid(rows: int, limits) -> int:
    """ctc_grad's blocks: a warp a (t, n) row, at most what the GPU holds at once."""
    warps = GRAD_BLOCK // 32
    return max(1, min(-(-rows // warps), limits.sm_count * _GRAD_BLOCKS_PER_SM))


def group_ints(batch: int, lcap: int) -> int:
    """ints of the label groups ctc_beta writes for ctc_grad: a header and three rows of lcap
    a sequence."""
    return batch * (3 * lcap + GROUP_HEAD)
