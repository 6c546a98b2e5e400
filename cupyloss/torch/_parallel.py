"""cupyloss.torch's cross entropy over several GPUs (cupyloss.parallel has the method).

Three ops carry the kernels: ``cupyloss::vocab_stats`` (each row's softmax state over this
rank's classes), ``cupyloss::vocab_rows`` (the combined per-row losses, with the gradient of
this rank's logits as its autograd formula) and ``cupyloss::vocab_grad`` (that gradient).  The
exchange between them is torch's functional collectives, and the combination plain tensor
operations, so eager calls, CUDA graphs and torch.compile(fullgraph=True) run the same code.
On CPU tensors (gloo) the ops run torch's operations with the kernels' formulas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cupyloss._core import plans as _plans, validate as _validate
from cupyloss.torch import _amp as _torch_autocast
from cupyloss import parallel

_NS = "cupyloss"
_REDUCTIONS = ("none", "mean", "sum")


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_weights(t, weight, ignore_index, classes, acc):
    """w_y of each row: 0 ignored, NaN for a class index outside [0, classes)."""
    ignored = t == ignore_index
    outside = ~ignored & ((t < 0) | (t >= classes))
    if weight is None:
        w_y = torch.ones(t.shape, dtype=acc, device=t.device)
    else:
        w_y = weight.to(acc)[torch.where(ignored | outside, 0, t)]
    return torch.where(ignored, 0.0, torch.where(outside, float("nan"), w_y))


def _stats_cpu(x, t, weight, c0, classes, ignore_index, eps, cap):
    acc = _acc(x.dtype)
    z = x.to(acc)
    if cap:
        z = cap * torch.tanh(z / cap)
    rows, cols = z.shape
    ninf = float("-inf")
    m = z.amax(1) if cols else z.new_full((rows,), ninf)
    s = torch.where(z == ninf, 0.0, torch.exp(z - m[:, None])).sum(1)
    a = b = z.new_zeros(rows)
    if eps:
        u = weight[c0:c0 + cols].to(acc) if weight is not None else z.new_ones(cols)
        a = (u * torch.where(z == ninf, float("inf"), m[:, None] - z)).sum(1)
        b = u.sum().expand(rows)
    ignored = t == ignore_index
    j = t - c0
    inside = ~ignored & (t >= 0) & (t < classes) & (j >= 0) & (j < cols)
    z_y = (z.gather(1, j.clamp(0, max(cols - 1, 0)).long()[:, None])[:, 0] if cols
           else z.new_zeros(rows))
    state = torch.stack([m, s, a, b, torch.where(inside, z_y, 0.0)], 1)
    empty = torch.tensor([ninf, 0.0, 0.0, 0.0, 0.0], dtype=acc)
    state = torch.where(ignored[:, None], empty, state)
    return torch.cat([state, parallel.claims(torch, t, inside, acc)[:, None]], 1)


def _grad_cpu(g, x, t, lse, weight, c0, classes, ignore_index, eps, zs, cap):
    acc = _acc(x.dtype)
    z = x.to(acc)
    if cap:
        z = cap * torch.tanh(z / cap)
    cols = z.shape[1]
    w_y = _row_weights(t, weight, ignore_index, classes, acc)
    w_c = weight[c0:c0 + cols].to(acc) if weight is not None else z.new_ones(cols)
    w_sum = weight.to(acc).sum() if weight is not None else float(classes)
    k = (1.0 - eps) * w_y + (eps / classes) * w_sum
    p = torch.exp(z - lse[:, None])
    at_y = torch.arange(c0, c0 + cols)[None, :] == t[:, None]
    corr = (1.0 - eps) * w_y[:, None] * at_y + (eps / classes) * w_c[None, :]
    g = g.reshape(-1, 1) if g.dim() else g
    gz = g * ((k[:, None] * p - corr) + (2.0 * zs * lse)[:, None] * p)
    if cap:
        gz = gz * (1.0 - (z / cap) ** 2)
    return torch.where((t == ignore_index)[:, None], 0.0, gz).to(x.dtype)


_ARGS = ("Tensor input, Tensor target, Tensor lse, Tensor? weight, int class_offset, int classes, "
         "int ignore_index, float label_smoothing, float lse_square_scale, float softcap")


def _stats_impl(input, target, weight, class_offset, classes, ignore_index, label_smoothing,
                softcap):
    if input.device.type == "cpu":
        return _stats_cpu(input, target, weight, class_offset, classes, ignore_index,
                          label_smoothing, softcap)
    return parallel.vocab_parallel_stats(input, target, class_offset, classes, weight,
                                         ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, softcap=softcap)


_stats_op = torch.library.custom_op(
    f"{_NS}::vocab_stats", _stats_impl, mutates_args=(),
    schema="(Tensor input, Tensor target, Tensor? weight, int class_offset, int classes, "
           "int ignore_index, float label_smoothing, float softcap) -> Tensor")


@_stats_op.register_fake
def _stats_fake(input, target, weight, *rest):
    return input.new_empty((input.shape[0], parallel.FIELDS), dtype=_acc(input.dtype))


def _grad_impl(grad_rows, input, target, lse, weight, class_offset, classes, ignore_index,
               label_smoothing, lse_square_scale, softcap):
    if input.device.type == "cpu":
        return _grad_cpu(grad_rows, input, target, lse, weight, class_offset, classes,
                         ignore_index, label_smoothing, lse_square_scale, softcap)
    return parallel.vocab_parallel_backward(
        grad_rows, input, target, lse, class_offset, classes, weight, ignore_index=ignore_index,
        label_smoothing=label_smoothing, lse_square_scale=lse_square_scale, softcap=softcap)


_grad_op = torch.library.custom_op(f"{_NS}::vocab_grad", _grad_impl, mutates_args=(),
                                   schema=f"(Tensor grad_rows, {_ARGS}) -> Tensor")


@_grad_op.register_fake
def _grad_fake(grad_rows, input, *rest):
    return torch.empty_like(input)


def _combine_impl(stats, target, weight, classes, ignore_index, label_smoothing,
                  lse_square_scale):
    return parallel.combine_stats(stats, target, classes, weight, ignore_index=ignore_index,
                                  label_smoothing=label_smoothing,
                                  lse_square_scale=lse_square_scale)


_combine_op = torch.library.custom_op(
    f"{_NS}::vocab_combine", _combine_impl, mutates_args=(),
    schema="(Tensor stats, Tensor target, Tensor? weight, int classes, int ignore_index, "
           "float label_smoothing, float lse_square_scale) -> (Tensor, Tensor, Tensor)")


@_combine_op.register_fake
def _combine_fake(stats, *rest):
    return tuple(stats.new_empty(stats.shape[1:2]) for _ in range(3))


def _rows_impl(loss, input, target, lse, weight, *rest):
    return loss.clone()


_rows_op = torch.library.custom_op(f"{_NS}::vocab_rows", _rows_impl, mutates_args=(),
                                   schema=f"(Tensor loss, {_ARGS}) -> Tensor")


@_rows_op.register_fake
def _rows_fake(loss, *rest):
    return torch.empty_like(loss)


def _rows_setup(ctx, inputs, output):
    _, x, t, lse, weight, *ctx.options = inputs
    ctx.save_for_backward(x, t, lse, weight)


def _rows_formula(ctx, grad_rows):
    x, t, lse, weight = ctx.saved_tensors
    grad = _grad_op(grad_rows.contiguous(), x, t, lse, weight, *ctx.options)
    return (None, grad) + (None,) * (3 + len(ctx.options))


_rows_op.register_autograd(_rows_formula, setup_context=_rows_setup)


# c10d's all-gather into one tensor (renamed all_gather_single after torch 2.11)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gathered(stats, group, traced):
    """(k, N, 6): every rank's states in rank order (an all-gather of N * 6 numbers a rank):
    torch's functional collective where traced, else c10d's own (less host time)."""
    if group is None:
        return stats[None]
    k = dist.get_world_size(group)
    if traced:
        from torch.distributed import _functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        return gather(stats, 0, group).reshape(k, *stats.shape)
    every = stats.new_empty((k * stats.shape[0], *stats.shape[1:]))
    _all_gather(every, stats, group=group)
    return every.view(k, *stats.shape)


class _Eager(torch.autograd.Function):
    """Eager calls: the ops' implementations without the dispatcher's Python layers.  forward
    returns each row's loss and weight w_y, or with `reduce` ('sum', 'mean') the reduced loss in
    `dtype` and None; backward forms the slice's gradient from the saved lse (a uniform upstream
    gradient, as a reduction's, read as one number).  A reduction inside the one Function leaves
    autograd one node a step instead of four (sum, division, cast): the same arithmetic, less
    host time."""

    @staticmethod
    def forward(ctx, x, t, weight, options, group, reduce=None, dtype=None, items=None):
        c0, classes, ignore_index, eps, zs, cap = options
        stats = _stats_impl(x, t, weight, c0, classes, ignore_index, eps, cap)
        loss, lse, w_y = _combine_impl(_gathered(stats, group, False), t, weight, classes,
                                       ignore_index, eps, zs)
        ctx.options, ctx.reduce = options, reduce
        if reduce is None:
            ctx.save_for_backward(x, t, lse, weight, None)
            ctx.mark_non_differentiable(w_y)
            return loss, w_y
        divisor = w_y.sum() if reduce == "mean" else None
        if items is not None:
            divisor = _divisor(items, w_y)
        ctx.save_for_backward(x, t, lse, weight, divisor)
        total = loss.sum()
        return (total if divisor is None else total / divisor).to(dtype), None

    @staticmethod
    def backward(ctx, grad_rows, _):
        x, t, lse, weight, divisor = ctx.saved_tensors
        if ctx.reduce is not None:
            grad_rows = grad_rows.to(lse.dtype)          # the cast's and division's gradients
            if divisor is not None:
                grad_rows = grad_rows / divisor
        elif grad_rows.dim() == 1 and grad_rows.stride(0) == 0 and grad_rows.numel():
            grad_rows = grad_rows[0]                     # a sum's expanded upstream gradient
        grad = _grad_impl(grad_rows.contiguous(), x, t, lse, weight, *ctx.options)
        return grad, None, None, None, None, None, None, None


def _global(total, divisor, mean_group):
    """The loss over every rank of mean_group: value sum(totals) / sum(divisors) (or the sum of
    totals without a divisor), the gradient that of this rank's share total / sum(divisors)."""
    from torch.distributed import _functional_collectives as funcol

    pair = torch.stack([total.detach(), divisor if divisor is not None else total.detach()])
    pair = funcol.all_reduce(pair, "sum", mean_group)
    if divisor is None:
        return pair[0] + (total - total.detach())
    return pair[0] / pair[1] + (total - total.detach()) / pair[1]


def _items(num_items, reduction):
    """num_items as a 0-d tensor (None without one), after the checks every path makes."""
    if num_items is None:
        return None
    _validate.check_num_items(num_items, reduction, torch.Tensor)
    return num_items if isinstance(num_items, torch.Tensor) else torch.tensor(int(num_items))


def _divisor(items, like):
    """num_items (_items') as what a loss like `like` is divided by: a CUDA tensor of its
    dtype, or a CPU count as a 0-d tensor made on its device without a copy from the host."""
    if items.device.type == "cpu":
        return torch.full((), float(items), dtype=like.dtype, device=like.device)
    return items.to(dtype=like.dtype)


def _check_options(label_smoothing, softcap, dtype):
    """The checks every path makes (CPU tensors and traced calls included) before any work."""
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    _validate.check_softcap(softcap, dtype)


def _check_slice(offset, cols, classes):
    if not 0 <= offset <= classes - cols:
        raise ValueError(f"this rank's classes {offset} .. {offset + cols - 1} lie outside the "
                         f"{classes} classes (class_offset={offset}, classes={classes})")


def check_targets_of(target, classes, ignore_index):
    """torch's IndexError for a class index outside [0, classes) that is not ignore_index (reads
    a flag back to the host: the opt-in check_targets of the fused and vocab-parallel losses)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    if bool(bad.any()):
        raise IndexError(f"Target {int(target[bad].reshape(-1)[0])} is out of bounds.")


_LAYOUTS = _plans.Plans(1024)   # (group, this rank's rows, cols, offset, classes) -> agreed


def _agreed(group, like, rows, cols, class_offset, classes):
    """(class_offset, classes) of this rank, checked with every rank of `group` by one
    all-gather of each rank's (rows, columns, offset, classes), once per local shape: ranks
    that disagree on the row count (which would hang the statistics' exchange), or give offsets
    on some ranks only, raise ValueError on every rank, naming each rank's figures; default
    offsets follow the ranks' column counts, uneven or not.  Reads the gathered numbers on the
    host, the first time a shape is seen.  Traced (torch.compile), a shape not seen eagerly
    takes equal slices, unless the offsets are given."""
    if group is None:
        return (0, cols) if class_offset is None else (int(class_offset), int(classes))
    k, rank = dist.get_world_size(group), dist.get_rank(group)
    key = (group.group_name, rows, cols, class_offset, classes)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    if torch.compiler.is_compiling():
        return (rank * cols, k * cols) if class_offset is None else (int(class_offset),
                                                                     int(classes))
    given = class_offset is not None
    mine = torch.tensor([rows, cols, int(class_offset) if given else -1,
                         int(classes) if given else -1], dtype=torch.int64, device=like.device)
    every = mine.new_empty(4 * k)
    _all_gather(every, mine, group=group)
    table = [tuple(r) for r in every.view(k, 4).tolist()]
    shown = ", ".join(f"rank {i}: {r[0]} rows x {r[1]} classes" + (
        f" from {r[2]} of {r[3]}" if r[2] >= 0 else "") for i, r in enumerate(table))
    if len({r[0] for r in table}) > 1:
        raise ValueError(f"vocab-parallel ranks must hold the same rows; got {shown}")
    if len({r[2] >= 0 for r in table}) > 1:
        raise ValueError(f"give class_offset and classes on every rank or on none; got {shown}")
    if not given:
        class_offset, classes = sum(r[1] for r in table[:rank]), sum(r[1] for r in table)
    elif len({r[3] for r in table}) > 1:
        raise ValueError(f"vocab-parallel ranks disagree on the class count; got {shown}")
    out = _LAYOUTS[key] = (int(class_offset), int(classes))
    return out


def _traced(*tensors):
    """Whether a call is traced (torch.compile, a dispatch mode, functional tensors): it then
    goes through the registered ops (cupyloss.torch's _call has the same test)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or any(
        t is not None and (type(t) is not torch.Tensor or torch._is_functional_tensor(t))
        for t in tensors)


def vocab_parallel_cross_entropy(input, target, group=None, *, class_offset=None, classes=None,
                                 weight=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0, lse_square_scale=0.0, softcap=0.0,
                                 mean_group=None, check_targets=False, num_items=None):
    """cross_entropy of logits whose classes are split over the ranks of `group`, with autograd.

    Formula: ``cross_entropy(cat([x_0, ..., x_{k-1}], -1), target, ...)`` (cupyloss.cross_entropy
    has the loss; cupyloss.parallel the method): each rank passes its slice x_i (..., C_i) of
    classes class_offset .. class_offset + C_i - 1 and gets the same loss; backward gives each
    rank its slice's gradient with no communication.  One all-gather of 20 bytes a row a rank
    (float32 statistics) in forward, never the logits; label smoothing spreads over all
    `classes`; 'mean' divides by the summed weights of the counted rows, formed on the device.

    mean_group (data parallelism): the 'mean' (or 'sum') over the rows of every rank of that
    group: the value is the global mean on every rank, the gradient that of the global mean
    with respect to this rank's logits (ranks with different numbers of counted rows weigh in
    by their rows).  torch's DistributedDataParallel averages gradients over its ranks, so with
    it multiply the loss by its world size (or reduce the gradients by their sum).

    Args:
      input: (..., C_i) this rank's logits; float16, bfloat16, float32, float64 (CUDA; CPU
        tensors take torch's operations).
      target: (...) class indices into all classes, the same on every rank of `group`.
      group: the torch.distributed process group that splits the classes, or None (one rank).
      class_offset, classes: this rank's first class and the class count of all ranks; by
        default the slices are equal and in rank order (rank * C_i, k * C_i).
      weight: None or (classes,) class weights of all classes, input's dtype.
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap: as cross_entropy.
      mean_group: the process group of a global 'mean'/'sum' over ranks, or None.
      check_targets: raise IndexError for a class index outside [0, classes) (synchronises;
        eager only); without it such a row, or one whose ranks disagree on its class, is NaN
        and counted (cupyloss.rejected_targets).
      num_items: None, or the divisor of the summed loss ('mean' and 'sum' alike): the counted
        rows of every micro-batch of a gradient-accumulation step (cupyloss.cross_entropy's),
        an int or a 0-d integer tensor; not with mean_group.

    Returns:
      The loss in the input's dtype: 0-d for 'mean'/'sum', target's shape for 'none'.

    Example:
      >>> tp = dist.new_group([0, 1])
      >>> loss = cupyloss.torch.vocab_parallel_cross_entropy(local_logits, labels, tp)
      >>> loss.backward()      # local_logits.grad: this rank's slice of the gradient
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    _check_options(label_smoothing, softcap, input.dtype)
    if mean_group is not None and reduction == "none":
        raise ValueError("mean_group needs reduction 'mean' or 'sum'")
    items = _items(num_items, reduction)
    if items is not None and mean_group is not None:
        raise ValueError("num_items is already the count over every rank and micro-batch: give "
                         "it or mean_group, not both")
    cols = input.shape[-1] if input.dim() else 0
    if input.dim() < 1 or target.shape != input.shape[:-1]:
        raise ValueError(f"target must have the input's shape without its last (class) dim "
                         f"{tuple(input.shape[:-1])}, got {tuple(target.shape)}")
    if target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"target must hold int32 or int64 class indices, got {target.dtype}")
    if (class_offset is None) != (classes is None):
        raise ValueError("give class_offset and classes together (or neither: each rank's "
                         "columns in rank order)")
    class_offset, classes = _agreed(group, input, target.numel(), cols, class_offset, classes)
    _check_slice(class_offset, cols, classes)
    if check_targets:
        check_targets_of(target, classes, ignore_index)
    x = input.reshape(target.numel(), cols)
    if cols > 1 and x.stride(1) != 1:
        x = x.contiguous()
    t = target.reshape(-1).contiguous()
    if weight is not None:
        weight = weight.contiguous()        # the kernels read the class weights contiguous
    options = (int(class_offset), int(classes), int(ignore_index), float(label_smoothing),
               float(lse_square_scale), float(softcap))
    if _traced(input, target, weight):
        stats = _stats_op(x.detach(), t, weight, options[0], options[1], options[2],
                          options[3], options[5])
        loss, lse, w_y = _combine_op(_gathered(stats, group, True), t, weight, options[1],
                                     options[2], options[3], options[4])
        loss = _rows_op(loss, x, t, lse, weight, *options)
    elif reduction != "none" and mean_group is None:
        return _Eager.apply(x, t, weight, options, group, reduction, input.dtype, items)[0]
    else:
        loss, w_y = _Eager.apply(x, t, weight, options, group)
    if reduction == "none":
        return loss.reshape(target.shape).to(input.dtype)
    total = loss.sum()
    divisor = w_y.sum() if reduction == "mean" else None
    if items is not None:
        divisor = _divisor(items, total)
    if mean_group is not None:
        return _global(total, divisor, mean_group).to(input.dtype)
    return (total if divisor is None else total / divisor).to(input.dtype)


class VocabParallelCrossEntropyLoss(torch.nn.Module):
    """vocab_parallel_cross_entropy as a module: ``forward(input, target)`` with the group and
    options given here (weight kept as a buffer).

    Example:
      >>> crit = cupyloss.torch.VocabParallelCrossEntropyLoss(tp_group, ignore_index=-100)
      >>> loss = crit(local_logits, labels)
    """

    def __init__(self, group=None, *, class_offset=None, classes=None, weight=None,
                 ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 lse_square_scale=0.0, softcap=0.0, mean_group=None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.group, self.mean_group = group, mean_group
        self.class_offset, self.classes = class_offset, classes
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.lse_square_scale = label_smoothing, lse_square_scale
        self.softcap = softcap

    def forward(self, input, target):
        return vocab_parallel_cross_entropy(
            input, target, self.group, class_offset=self.class_offset, classes=self.classes,
            weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, mean_group=self.mean_group)


# --- the fused linear cross entropy with the weight's rows split over ranks -----------------------

class _SumGrad(torch.autograd.Function):
    """Identity forward; backward adds the gradient over the ranks of `group` (the input feeds
    every rank's slice of the classes)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """Sequence parallelism's gather of the hidden states: forward stacks every rank's block of
    rows in rank order (an all-gather); backward takes this rank's block of a gradient that is
    already summed over the ranks (the op's own all-reduce, or _SumGrad's)."""

    @staticmethod
    def forward(ctx, x, group, traced):
        k, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.block = (rank * x.shape[0], (rank + 1) * x.shape[0])
        x = x.contiguous()
        if traced:
            from torch.distributed import _functional_collectives as funcol

            gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
            return gather(x, 0, group)
        every = x.new_empty((k * x.shape[0], *x.shape[1:]))
        _all_gather(every, x, group=group)
        return every

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.block
        return grad[a:b], None, None


def _linear_shard_run(hidden, weight, target, bias, class_weight, options, names, grad_output,
                      want_value, group, offset, classes, sequence_parallel=False):
    """(loss or None, {name: gradient}) of this rank's share of the fused loss on CUDA tensors
    (cupyloss.linear with a Shard): each chunk's statistics all-gathered over `group`, each
    chunk's partial hidden gradient summed over it in the logits' precision as soon as it is
    formed (overlapping the next chunks' products).  sequence_parallel: `hidden` is this
    rank's block of the rows, all-gathered first, and the hidden gradient's float32 partial
    sums are reduce-scattered back to the blocks at the end."""
    import cupy

    from cupyloss import linear

    k = dist.get_world_size(group) if group is not None else 1
    mine, target_shape = hidden, target.shape
    if sequence_parallel and group is not None:
        block = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        hidden = block.new_empty((k * block.shape[0], block.shape[1]))
        _all_gather(hidden, block, group=group)
        target = target.reshape(-1)

    def gather(stats):                      # CuPy (m, 6) on torch's stream -> (k, m, 6)
        if group is None:
            return stats[None]
        mine = torch.from_dlpack(stats)
        every = mine.new_empty((k * mine.shape[0], mine.shape[1]))
        _all_gather(every, mine, group=group)
        return cupy.from_dlpack(every.view(k, *mine.shape))

    sums = []

    def reduce(rows):                       # a chunk's float32 partial dX, summed in place
        if group is not None:
            sums.append(dist.all_reduce(torch.from_dlpack(rows), group=group, async_op=True))

    split = sequence_parallel and group is not None
    shard = linear.Shard(int(offset), int(classes), gather, k, None if split else reduce)
    loss, grads, _ = linear._run(hidden, weight, target, bias, class_weight,
                                 options["ignore_index"], options["reduction"],
                                 options["label_smoothing"], options["lse_square_scale"],
                                 options["softcap"], options["max_workspace_bytes"], want_value,
                                 names, grad_output, False, shard,
                                 compute_dtype=options.get("compute_dtype"),
                                 num_items=options.get("num_items"))
    for work in sums:                       # the stream waits; the host does not
        work.wait()
    if "hidden" in grads:
        partial = grads["hidden"]
        if split:                           # this rank's block of the sum, in float32
            partial = partial.reshape(k, -1, partial.shape[-1])
            summed = partial.new_empty(partial.shape[1:])
            dist.reduce_scatter_tensor(summed, partial.reshape(-1, partial.shape[-1]),
                                       group=group)
            partial = summed
        grads["hidden"] = partial.reshape(mine.shape).to(mine.dtype)
    if split and loss is not None and options["reduction"] == "none":
        loss = loss.reshape(target_shape)
    return loss, grads


_LINEAR_GRADS = ("hidden", "weight", "bias")


class _LinearShard(torch.autograd.Function):
    """Eager calls on CUDA tensors: with 'mean'/'sum' every gradient is formed in the forward
    pass and backward scales it by the upstream gradient; with 'none' backward forms them
    again from the per-row upstream gradient (the statistics exchanged again)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, options, group, offset,
                classes, sequence_parallel):
        names = tuple(n for n, need in zip(_LINEAR_GRADS, ctx.needs_input_grad[:3]) if need)
        shard = (group, offset, classes, sequence_parallel)
        ctx.names, ctx.options, ctx.shard = names, options, shard
        ctx.save_for_backward(hidden, weight, bias, target, class_weight)
        ctx.grads = None
        if names and options["reduction"] != "none":
            loss, grads = _linear_shard_run(hidden, weight, target, bias, class_weight, options,
                                            names, 1.0, True, *shard)
            ctx.grads = grads
            return loss
        return _linear_shard_run(hidden, weight, target, bias, class_weight, options, (), 1.0,
                                 True, *shard)[0]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, class_weight = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        if grads is not None:
            for g in grads.values():
                g.mul_(grad_loss.to(g.dtype))
        else:
            grads = _linear_shard_run(hidden, weight, target, bias, class_weight, ctx.options,
                                      ctx.names, grad_loss.contiguous(), False, *ctx.shard)[1]
        return (grads.get("hidden"), grads.get("weight"), grads.get("bias"), None, None, None,
                None, None, None, None)


def vocab_parallel_linear_cross_entropy(hidden, weight, target, group=None, *, bias=None,
                                        class_weight=None, class_offset=None, classes=None,
                                        ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, lse_square_scale=0.0,
                                        softcap=0.0, max_workspace_bytes=None,
                                        check_targets=False,
                                        sequence_parallel=False, num_items=None):
    """``F.cross_entropy(hidden @ W.T + b, target)`` with W's rows (the classes) split over the
    ranks of `group`, the logits never whole, with autograd.

    Formula: cupyloss.linear_cross_entropy's, on the classes of every rank: this rank holds
    rows class_offset .. class_offset + V_i - 1 of W (and of b).  Each chunk of rows forms its
    float32 logits, their statistics are all-gathered over `group` (20 bytes a row a rank) and
    combined into each row's loss and lse (cupyloss.parallel), and dZ of this rank's classes
    follows from that lse; dW_i = dZ^T X and db_i stay on their rank; dX = dZ W_i is summed over
    the ranks in float32 (an all-reduce of N x H floats, a chunk at a time).  The same loss on
    every rank.  Inside ``torch.autocast("cuda")`` the products run in the autocast dtype and
    the gradients come back in their arguments' dtypes, as for linear_cross_entropy.

    With sequence_parallel=True (Megatron-LM's sequence parallelism) each rank holds its own
    block of the rows of `hidden`: the blocks are all-gathered in rank order (N x H in the
    inputs' dtype), the loss is that of every rank's rows, and the hidden gradient's float32
    partial sums are reduce-scattered back to the blocks, each rank getting its own.

    Args:
      hidden: (..., H), the same on every rank of `group` (with sequence_parallel, this rank's
        block of the rows, equal blocks on every rank); float16, bfloat16, float32, float64.
      weight: (V_i, H) this rank's rows of the output layer (nn.Linear's layout).
      target: class indices into all classes, hidden's shape without its last dim (with
        sequence_parallel, every rank's rows in rank order, the same on every rank: k times
        the rows of `hidden`).
      group: the torch.distributed group that splits the classes, or None (one rank).
      bias: None or (V_i,) this rank's slice; class_weight: None or (classes,) all of them.
      class_offset, classes: as for vocab_parallel_cross_entropy (equal slices by default).
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap, max_workspace_bytes:
        as for linear_cross_entropy.
      sequence_parallel: `hidden` holds this rank's block of the rows (above).
      check_targets: as for vocab_parallel_cross_entropy.
      num_items: as for linear_cross_entropy (the count over every micro-batch, the same on
        every rank of `group`).

    Returns:
      The loss, float32 (float64 for float64 inputs): 0-d for 'mean'/'sum', else target's shape.

    Example:
      >>> loss = cupyloss.torch.vocab_parallel_linear_cross_entropy(h, head_shard.weight,
      ...                                                             labels, tp_group)
      >>> loss.backward()

    Under torch.compile (and any other tracer) the call is linear_cross_entropy's op with
    this rank's slice and the group's name: the collectives run inside it, opaque to the
    compiler.  With sequence_parallel the blocks are gathered by torch's functional
    all-gather before it, and the op's all-reduced hidden gradient is cut back to the block
    (an all-reduce where eager calls reduce-scatter).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    _check_options(label_smoothing, softcap, hidden.dtype)
    items = _items(num_items, reduction)
    if weight.dim() != 2 or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (classes of this rank, {hidden.shape[-1]}), got "
                         f"{tuple(weight.shape)}")
    k = dist.get_world_size(group) if group is not None else 1
    if (class_offset is None) != (classes is None):
        raise ValueError("give class_offset and classes together (or neither: each rank's "
                         "columns in rank order)")
    class_offset, classes = _agreed(group, hidden, hidden.numel() // max(hidden.shape[-1], 1),
                                    weight.shape[0], class_offset, classes)
    _check_slice(class_offset, weight.shape[0], classes)
    if check_targets:
        check_targets_of(target, classes, ignore_index)
    split = bool(sequence_parallel) and group is not None
    if split and target.numel() != k * (hidden.numel() // max(hidden.shape[-1], 1)):
        raise ValueError(f"sequence_parallel: target holds every rank's rows, {k} x "
                         f"{hidden.numel() // max(hidden.shape[-1], 1)} of them, got "
                         f"{tuple(target.shape)}")
    traced = _traced(hidden, weight, target, bias, class_weight)
    compute = _torch_autocast.linear_compute(hidden, weight, bias)
    if split and (traced or hidden.device.type == "cpu"):
        # the blocks gathered outside the op (CPU: outside autograd's graph of the loss); the
        # hidden gradient comes back summed over the ranks and each keeps its block
        shape = target.shape
        hidden = _GatherRows.apply(hidden.reshape(-1, hidden.shape[-1]), group, traced)
        loss = vocab_parallel_linear_cross_entropy(
            hidden, weight, target.reshape(-1), group, bias=bias, class_weight=class_weight,
            class_offset=class_offset, classes=classes, ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap,
            max_workspace_bytes=max_workspace_bytes, num_items=num_items)
        return loss.reshape(shape) if reduction == "none" else loss
    if traced:
        # linear_cross_entropy's op with this rank's slice: the statistics are exchanged and
        # the hidden gradient summed inside it, over the group named
        flags = (hidden.requires_grad, weight.requires_grad,
                 bias is not None and bias.requires_grad)
        # the op cupyloss.torch registers (the only importer of this module)
        return getattr(torch.ops, _NS).linear_cross_entropy(
            hidden, weight, target, bias, class_weight, int(ignore_index), reduction,
            float(label_smoothing), float(lse_square_scale), float(softcap),
            -1 if max_workspace_bytes is None else int(max_workspace_bytes), int(class_offset),
            int(classes), "" if group is None else group.group_name, compute or "", items,
            *flags)[0]
    options = dict(ignore_index=int(ignore_index), reduction=reduction,
                   label_smoothing=float(label_smoothing),
                   lse_square_scale=float(lse_square_scale), softcap=float(softcap),
                   max_workspace_bytes=max_workspace_bytes, compute_dtype=compute,
                   num_items=num_items)
    if hidden.device.type != "cpu":
        return _LinearShard.apply(hidden, weight, bias, target, class_weight, options, group,
                                  class_offset, classes, split)
    # CPU tensors (gloo): float32 logits and vocab_parallel_cross_entropy, torch's autograd
    h = _SumGrad.apply(hidden, group) if group is not None else hidden
    acc = _acc(hidden.dtype)
    logits = torch.nn.functional.linear(h.to(acc), weight.to(acc),
                                        None if bias is None else bias.to(acc))
    loss = vocab_parallel_cross_entropy(
        logits, target, group, class_offset=class_offset, classes=classes,
        weight=None if class_weight is None else class_weight.to(acc),
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, softcap=softcap, num_items=num_items)
    return loss


def _linear_shard_cpu(hidden, weight, target, bias, class_weight, options, names, grad_output,
                      want_value, group, offset, classes):
    """_linear_shard_run on CPU tensors (the traced op's CPU kernel, gloo): float32 logits of
    this rank's classes, the statistics exchanged and combined as on the GPU, and the gradients
    written out (autograd does not run inside an op's kernel)."""
    acc = _acc(hidden.dtype)
    x = hidden.reshape(-1, hidden.shape[-1]).to(acc)
    t = target.reshape(-1)
    z = torch.nn.functional.linear(x, weight.to(acc), None if bias is None else bias.to(acc))
    ii, eps = options["ignore_index"], options["label_smoothing"]
    zs, cap, reduction = options["lse_square_scale"], options["softcap"], options["reduction"]
    stats = _stats_cpu(z, t, class_weight, offset, classes, ii, eps, cap)
    rows, lse, w_y = parallel.combine_stats(
        _gathered(stats, group, False), t, classes,
        None if class_weight is None else class_weight.to(acc), ignore_index=ii,
        label_smoothing=eps, lse_square_scale=zs)
    divisor = w_y.sum() if reduction == "mean" else None
    if options.get("num_items") is not None:
        divisor = torch.as_tensor(options["num_items"], dtype=acc)
    loss = None
    if want_value:
        loss = (rows.reshape(target.shape) if reduction == "none"
                else rows.sum() / divisor if divisor is not None else rows.sum())
    grads = {}
    if names:
        g = torch.as_tensor(grad_output, dtype=acc)
        g = g.reshape(-1) if reduction == "none" else (g / divisor if divisor is not None else g)
        dz = _grad_cpu(g, z, t, lse, class_weight, offset, classes, ii, eps, zs, cap)
        if "hidden" in names:
            gx = dz @ weight.to(acc)
            if group is not None:
                dist.all_reduce(gx, group=group)
            grads["hidden"] = gx.reshape(hidden.shape).to(hidden.dtype)
        if "weight" in names:
            grads["weight"] = (dz.T @ x).to(weight.dtype)
        if "bias" in names:
            grads["bias"] = dz.sum(dim=0).to(bias.dtype)
    return loss, grads
