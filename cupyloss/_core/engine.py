"""The one engine every family runs on: `execute` (the hot path of every call), `run` (a plan's
allocations and launches) and `run_slow` (calls off the hot path), written once, and what the
families share below them (the current device, plans built on it, the copies made off the hot
path, the last-block tickets, class-index targets, launches and scratch).

A family (pointwise, rowwise, rowclass, rowpair; the fused head runs rowwise's) declares only
what differs.  Its `evaluate` takes a call's arguments, checks them (everything raised before any
launch) and ends in `execute(FAMILY, key, device, frame, stream, state)`: the plan key (a tuple
in the order of the family's `Key` record of fields), the device, the caller's framework and
stream, and state: (operands, grad_output, its value).  Its `Family` holds its plan cache and two
hooks:
  build(key) -> Plan | None
      the plan of a key, on the key's device: its launches (kernels, launch shapes, packed words)
      and the tables `run` fills a call's words from; None when an operand's layout needs a copy
      first;
  copies(frame, stream, key, state) -> (key, state, keep)
      off the hot path: contiguous copies of the operands that need them (kept alive in `keep`
      until the launch is queued) and the key they give.
`run` (one for every family) allocates a plan's outputs, fills the pointer words and launches.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import threading

import numpy

from cupyloss._core import args as _args, dispatch as _dispatch

INDEX_DTYPES = (numpy.dtype(numpy.int32), numpy.dtype(numpy.int64))
_F32 = numpy.dtype(numpy.float32)
_F64 = numpy.dtype(numpy.float64)


@dataclasses.dataclass
class Launched:
    """One kernel of a plan: CUfunction, launch shape, packed words (pointers left
    zero) and their slots by parameter name, whether it is a cooperative launch."""

    function: int
    grid: tuple
    block: tuple
    shared: int
    words: array.array
    slot: dict
    cooperative: bool = False

    @classmethod
    def of(cls, layout, source: str, name: str, cfg, words, cooperative: bool = False):
        """Kernel `name` of kernels/`source` bound to `layout` (an _args.Layout), launched with
        cfg's grid, block and shared memory and the packed `words`."""
        from cupyloss._core import source as _source

        function = layout.bind(_source.function(source, name).kernel.ptr)
        return cls(function, cfg.grid, cfg.block, cfg.shared, words, layout.slot, cooperative)


def small_reduction(layout, source: str, name: str, rows: int, words, limits,
                    scratch: "Regions", partials: str) -> Launched:
    """A one-thread-a-row reduction over `rows` launched ahead of the main one
    (class_weight_sum, rowclass_count): its launch, its result in scratch region "denom" and
    its blocks' partials in region `partials` where it takes more than one block (wire it with
    `before_main`)."""
    from cupyloss._core import launch as _launch

    launched = Launched.of(layout, source, name, _launch.flat_launch(rows, 1, limits), words)
    scratch.add("denom", 1)
    if launched.grid[0] > 1:
        scratch.add(partials, launched.grid[0])
    return launched


@dataclasses.dataclass
class Family:
    """A family's hooks into the engine (see the module docstring) and its plan cache."""

    plans: object        # a _plans.Plans: key -> Plan
    build: object
    copies: object


def execute(family: Family, key, device: int, frame, stream: int, state):
    """The rest of every call once its family's `evaluate` has checked it: the cached plan of
    its key (built on the first call with that key) and one run; off the hot path (an operand
    that needs a copy first, a plan that says so, another current device) `run_slow`."""
    plan = family.plans.get(key)
    if plan is None:
        plan = on_device(family.build, key, device)
        if plan is None:
            return run_slow(family, key, device, frame, stream, state)
        family.plans[key] = plan
    if plan.slow or current_device() != device:
        return run_slow(family, key, device, frame, stream, state)
    return run(plan, frame, stream, state)


def run_slow(family: Family, key, device: int, frame, stream: int, state):
    """A call off the hot path: `device` current, CuPy on the caller's stream with the caller's
    allocator, the family's copies made, a plan built for them (not cached: the copies' layout
    is the next call's only by chance), one run."""
    with off_path(frame, device, stream):
        key, state, keep = family.copies(frame, stream, key, state)
        result = run(family.build(key), frame, stream, state)
        del keep
        return result


@dataclasses.dataclass
class Plan:
    """A plan: its launches and what a call fills in, ready for `run`.  Operands are a call's
    state[0], in the family's order."""

    slow = False         # run off the hot path (run_slow), for a family's copies
    main: Launched
    inputs: tuple        # (word of main, operand): the operands' pointers (a None one skipped)
    outputs: tuple       # per result: None, or (word of main or -1, shape, dtype, how): how is
                         # "empty", "zeros", ("like", k) (new, like contiguous operand k) or an
                         # operand k whose array is the result (in place, grad_into)
    acc: numpy.dtype
    scratch: dict        # acc-typed scratch regions: name -> (offset, size)
    scratch_size: int
    ticket: bool         # the launches count on the stream's last-block ticket
    main_regions: tuple = ()   # (word of main, region): more scratch the main launch reads
    counters: tuple = ()       # (word of main, n): n zeroed 32-bit counters (cooperative groups)
    before: tuple = ()         # (Launched, inputs, regions, ticket word or -1): launched first
    after: tuple = ()          # (Launched, ((its word, word of main), ...), ((its word, result),
                               # ...)): launched after, pointers from main's words and results
    numbers: tuple = ()        # (word of main, operand): an operand given as a number (float)
    wide: tuple = ()           # (word of main, n): n float64 partials of the main launch
    col_tickets: int = -1      # word of main taking the stream's column tickets, -1 for none
    ticket_slots: tuple = ("partials", "ticket")   # main's words of the "partials" region and
                                                   # the ticket
    rest: "Plan | None" = None  # a later plan whose results fill those this one leaves None

    def __post_init__(self):
        # What run does per call, precomputed: the outputs made (result index, word, shape,
        # dtype, how as a code: _EMPTY, _LIKE or _ZEROS with no operand, _OWN with its operand),
        # grad_output's words, whether any scratch, counters or other launches are there at
        # all, and the offsets of the float64 partials (each on a 16-byte boundary).
        made = []
        for i, out in enumerate(self.outputs):
            if out is not None:
                word, shape, dtype, how = out
                code, k = ((_OWN, how) if how.__class__ is int else (_LIKE, how[1])
                           if how.__class__ is tuple else (_CODES[how], 0))
                made.append((i, word, shape, dtype, code, k))
        self.made = tuple(made)
        self.results = tuple(i for i, *_ in made)
        self.loose = any(word < 0 for _, word, *_ in made)
        self.nresults = len(self.outputs)
        self.go_words = ((self.main.slot["go"], self.main.slot["go_value"])
                         if self.main is not None else None)
        self.extra = bool(self.scratch_size or self.ticket or self.main_regions or self.counters
                          or self.before or self.wide)
        offsets, size = [], 0
        for word, n in self.wide:
            offsets.append((word, size))
            size += n + (n & 1)
        self.wide_offsets, self.wide_size = tuple(offsets), size


_EMPTY, _LIKE, _ZEROS, _OWN = range(4)
_CODES = {"empty": _EMPTY, "zeros": _ZEROS}


class Regions(dict):
    """A row plan's accumulator-typed scratch regions, name -> (offset, size), laid out in the
    order they are added; `size` is their total."""

    size = 0

    def add(self, name: str, n: int) -> None:
        self[name] = (self.size, n)
        self.size += n


def before_main(launched: Launched, inputs: tuple, scratch: dict, out: str, partials: str):
    """A Plan's `before` entry for a small reduction launched ahead of the main one
    (class_weight_sum, rowclass_count): its operands, its result into scratch region `out`, and
    its blocks' partials into region `partials` with the stream's ticket where the plan has
    that region."""
    slot = launched.slot
    regions = ((slot["out"], out),)
    ticket_word = -1
    if partials in scratch:
        regions += ((slot["partials"], partials),)
        ticket_word = slot["ticket"]
    return launched, inputs, regions, ticket_word


def run(plan: Plan, frame, stream: int, state):
    """Allocate a plan's outputs, fill the pointer words, launch.  state: (operands,
    grad_output, its value, and what the family's copies want besides).  Returns the results in
    plan.outputs' order, in the caller's framework.  The hot path of every call."""
    ops = state[0]
    main = plan.main
    words = array.array("Q", main.words)
    for word, k in plan.inputs:
        op = ops[k]
        if op is not None:
            words[word] = op.ptr
    if plan.numbers:
        for word, k in plan.numbers:
            if ops[k] is not None:
                words[word] = _args.f64_word(ops[k])
    go = state[1]
    if go is not None:
        words[plan.go_words[0]] = go.ptr
    elif state[2] != 1.0:
        words[plan.go_words[1]] = _args.f64_word(state[2])
    first = ops[0]
    like = first.array
    results = [None] * plan.nresults
    loose = {} if plan.loose else None
    for i, word, shape, dtype, how, k in plan.made:
        if how == _EMPTY:
            results[i], ptr = frame.empty(shape, dtype, like)
        elif how == _LIKE:
            results[i], ptr = frame.empty_like(ops[k].array)
        elif how == _OWN:
            op = ops[k]
            results[i], ptr = op.array, op.ptr
        else:
            results[i], ptr = frame.zeros(shape, dtype, like)
        if word >= 0:
            words[word] = ptr
        else:
            loose[i] = ptr
    held = counters = wide = None
    if plan.extra:
        held, base, ticket_ptr = scratch(frame, plan, like, first.device, stream, words,
                                         main.slot)
        step = plan.acc.itemsize
        for word, region in plan.main_regions:
            words[word] = base + step * plan.scratch[region][0]
        if plan.counters:
            counters = [frame.zeros((n,), _F32, like) for _, n in plan.counters]
            for (word, _), (_, ptr) in zip(plan.counters, counters):
                words[word] = ptr
        if plan.wide:
            wide, wbase = frame.empty((plan.wide_size,), _F64, like)
            for word, offset in plan.wide_offsets:
                words[word] = wbase + 8 * offset
            if plan.col_tickets >= 0:
                words[plan.col_tickets] = col_tickets(first.device, stream)
        for launched, inputs, regions, ticket_word in plan.before:
            pre = array.array("Q", launched.words)
            for word, k in inputs:
                if ops[k] is not None:
                    pre[word] = ops[k].ptr
            for word, region in regions:
                pre[word] = base + step * plan.scratch[region][0]
            if ticket_word >= 0:
                pre[ticket_word] = ticket_ptr
            _args.launch(launched.function, launched.grid, launched.block, launched.shared,
                         stream, pre)
    if main.cooperative:
        _args.launch_cooperative(main.function, main.grid, main.block, main.shared, stream,
                                 words)
    else:
        _args.launch(main.function, main.grid, main.block, main.shared, stream, words)
    for launched, wires, outs in plan.after:
        post = array.array("Q", launched.words)
        for word, from_main in wires:
            post[word] = words[from_main]
        for word, i in outs:
            post[word] = loose[i]
        _args.launch(launched.function, launched.grid, launched.block, launched.shared, stream,
                     post)
    del held, counters, wide
    result = frame.result
    for i in plan.results:
        results[i] = result(results[i])
    if plan.rest is not None:
        for i, value in enumerate(run(plan.rest, frame, stream, state)):
            if value is not None:
                results[i] = value
    return results


def on_device(build, key, device: int):
    """build(key) with `device` current: a plan holds the kernels of its device (the miss path
    of a plan cache)."""
    import cupy

    with cupy.cuda.Device(device):
        return build(key)


@contextlib.contextmanager
def off_path(frame, device: int, stream: int):
    """Where a call off the hot path runs (another current device, or operands that need
    contiguous copies): `device` current, CuPy on the caller's stream, and CuPy's allocations
    (the copies, the slow paths' own arrays) made by the caller's allocator."""
    import cupy

    with cupy.cuda.Device(device), cupy.cuda.Stream.from_external(_dispatch.RawStream(stream)), \
            frame.scratch_allocator():
        yield


def scratch(frame, plan, like, device: int, stream: int, words, slot) -> tuple[object, int, int]:
    """A row launch's scratch and ticket: (the scratch array, None for none: the caller keeps it
    until its launch is queued, or its memory goes back to the pool for the next allocation to
    take; its base pointer, plan.scratch_size accumulators of plan.acc, 0 for none; the stream's
    ticket, 0 where the plan takes none), the main launch's partials and ticket words
    (plan.ticket_slots) filled where plan.scratch has "partials"."""
    mine = ticket(device, stream) if plan.ticket else 0
    held, base = frame.empty((plan.scratch_size,), plan.acc, like) if plan.scratch_size \
        else (None, 0)
    if "partials" in plan.scratch:
        partials, ticket_slot = plan.ticket_slots
        words[slot[partials]] = base + plan.acc.itemsize * plan.scratch["partials"][0]
        words[slot[ticket_slot]] = mine
    return held, base, mine


def current_device() -> int:
    """The current CUDA device (CuPy's runtime call, bound here at the first call so that later
    calls cost one lookup)."""
    import cupy

    global current_device
    current_device = cupy.cuda.runtime.getDevice
    return current_device()


TICKETS: dict = {}          # device -> {stream: (its ticket, its COL_TICKETS column tickets)}
_CHUNKS: dict = {}          # device -> [base pointer of each chunk of TICKET_SLOTS slots]
_TICKETS_LOCK = threading.Lock()
TICKET_SLOTS = 1024         # streams a chunk of tickets serves; another chunk for the next
COL_TICKETS = 256           # column blocks of pointwise_rows, or groups of o of pointwise_reduce,
                            # whose partials a launch adds up itself


def ticket(device: int, stream: int) -> int:
    """A zeroed uint32 on `device` for the last-block ticket of launches on `stream`.

    Each kernel that uses it leaves it zero again (atomicInc wraps it), so launches on one
    stream share one slot, and no two streams ever do: the slots come in chunks of
    TICKET_SLOTS (each slot with COL_TICKETS more behind the chunk's tickets, `col_tickets`),
    a new chunk allocated and zeroed for the stream past the last.  A stream's first call
    takes its slot under a lock (warm up before capturing a CUDA graph); later calls read it
    from a dict.
    """
    slots = TICKETS.get(device)
    mine = slots.get(stream) if slots is not None else None
    return (mine or _new_slot(device, stream))[0]


def col_tickets(device: int, stream: int) -> int:
    """COL_TICKETS zeroed uint32 on `device` for the column blocks of a pointwise_rows launch or
    the groups of o of a pointwise_reduce launch on `stream` (one each; the kernel leaves them
    zero, as `ticket`)."""
    slots = TICKETS.get(device)
    mine = slots.get(stream) if slots is not None else None
    return (mine or _new_slot(device, stream))[1]


def _new_slot(device: int, stream: int) -> tuple[int, int]:
    """`stream`'s (ticket, column tickets) on `device`, taken the first time it asks."""
    with _TICKETS_LOCK:
        slots = TICKETS.setdefault(device, {})
        mine = slots.get(stream)
        if mine is None:
            chunk, k = divmod(len(slots), TICKET_SLOTS)
            chunks = _CHUNKS.setdefault(device, [])
            if chunk == len(chunks):
                chunks.append(_zeroed(device, 4 * TICKET_SLOTS * (1 + COL_TICKETS)))
            base = chunks[chunk]
            mine = slots[stream] = (base + 4 * k,
                                    base + 4 * TICKET_SLOTS + 4 * COL_TICKETS * k)
        return mine


def _zeroed(device: int, size: int) -> int:
    """`size` zeroed bytes on `device`, never freed (the tickets of the streams that use it)."""
    import cupy

    with cupy.cuda.Device(device):
        base = cupy.cuda.runtime.malloc(size)
        cupy.cuda.runtime.memset(base, 0, size)
    return base


def target_operand(frame, target):
    """(Operand, is_index) of a target: int32/int64 class indices, or a floating array."""
    if frame.name in ("torch", "torch-dlpack"):
        import torch

        index = {torch.int32: INDEX_DTYPES[0], torch.int64: INDEX_DTYPES[1]}.get(target.dtype)
        if index is None:
            return frame.operand(target, "target"), False
        if not target.is_cuda:
            raise TypeError(f"target is a torch.Tensor on {target.device}; cupyloss runs on "
                            f"CUDA devices: move it with target.cuda()")
        return _dispatch.Operand(target.data_ptr(), tuple(target.shape), target.stride(), index,
                                 target.get_device(), target), True
    if frame.name == "cupy":
        view = target
    else:  # JAX and other DLPack producers: a CuPy view, as their frame makes one
        if getattr(target, "dtype", None) is not None and \
                numpy.dtype(target.dtype) not in INDEX_DTYPES:
            return frame.operand(target, "target"), False
        import cupy

        try:
            device_type, _ = target.__dlpack_device__()
        except Exception as exc:
            raise TypeError(f"target ({type(target).__name__}) does not say where its memory "
                            f"is (__dlpack_device__ failed: {exc})") from None
        if device_type not in (_dispatch._KDLCUDA, _dispatch._KDLCUDA_MANAGED):
            raise TypeError(f"target is in DLPack device type {device_type}, not on a CUDA "
                            f"device; move it to the GPU first")
        view = cupy.from_dlpack(target)
    if view.dtype not in INDEX_DTYPES:
        return frame.operand(target, "target"), False
    itemsize = view.dtype.itemsize
    return _dispatch.Operand(view.data.ptr, view.shape,
                             _dispatch.element_strides(view.strides, itemsize, "target"),
                             view.dtype, view.data.device_id, view), True


def contiguous(frame, op, name):
    """A C-contiguous copy of `op` (a CuPy array from the caller's allocator) as an Operand."""
    import cupy

    copy = cupy.ascontiguousarray(frame.cupy_view(op))
    itemsize = copy.dtype.itemsize
    return _dispatch.Operand(copy.data.ptr, copy.shape, tuple(s // itemsize for s in copy.strides),
                             copy.dtype, op.device, copy)


def contiguous_input(frame, op, name):
    """(a contiguous copy of `op` whose results are still allocated like the caller's array,
    the copy's array): keep the second alive until the launch that reads it is queued."""
    copy = contiguous(frame, op, name)
    copy.array, kept = op.array, copy.array
    return copy, kept
