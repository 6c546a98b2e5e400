"""The pointwise engine's host path on a CPU: plans, packed words and where each output goes.

A fake device (H100 limits, kernels that resolve to a dummy function, launches recorded instead
of run) and a fake framework over NumPy arrays drive `_pointwise.evaluate` exactly as a call on
a GPU would, up to the launch.  What the kernels compute is tested on the GPU
(test_pointwise_gpu.py); here: every registered loss plans every layout, its words hold the
right pointers, options and kinds, every gradient asked for (and only those) has an output of
its argument's shape, and a cached plan is reused.
"""

import contextlib
import math
import types
import weakref

import numpy as np
import pytest

import cupyloss
from cupyloss._core import (
    args as _args, dispatch as _dispatch, engine as _engine, launch as _launch,
    registry as _registry, source as _source, tuning as _tuning)
from cupyloss.pointwise import _family as _pointwise

H100 = _launch.DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                            max_shared_per_block=49152)


class HostArray(np.ndarray):
    """A NumPy array the fake framework below claims."""


def arr(shape, value=0.5):
    return np.full(shape, value, np.float32).view(HostArray)


class FakeFrame:
    """_dispatch's frame protocol over NumPy arrays: pointers are their host addresses."""

    name = "fake"

    def operand(self, x, name):
        return _dispatch.Operand(x.ctypes.data, x.shape,
                                 tuple(s // x.itemsize for s in x.strides), x.dtype, 0, x)

    def stream(self, device):
        return 0

    def __init__(self, record=None):
        self.record = record
        # (address, bytes, weak reference) of every array it handed out; the memory itself is
        # kept (`kept`), so no later allocation takes the address of one dropped.
        self.made, self.kept = [], []

    def _made(self, base):
        a = base.view(HostArray)
        self.kept.append(base)
        self.made.append((a.ctypes.data, max(a.nbytes, 1), weakref.ref(a)))
        return a

    def check_alive(self, words):
        """Every word that points into memory this frame allocated points into an array still
        alive: one dropped before its launch is queued goes back to a real pool, which gives
        it to the next allocation while the kernel still reads or writes it."""
        for word in words:
            dropped = [at for at, size, ref in self.made if at <= word < at + size and ref() is None]
            assert not dropped, (
                f"a launch word points into an array freed before the launch ({word:#x})")

    def empty(self, shape, dtype, like):
        a = self._made(np.empty(shape, dtype))
        if self.record is not None:
            self.record.allocations.append((tuple(np.atleast_1d(shape)), np.dtype(dtype)))
            if hasattr(self.record, "likes"):
                self.record.likes.append(like)
        return a, a.ctypes.data

    def empty_like(self, a):
        b = self._made(np.empty_like(np.asarray(a)))
        if self.record is not None:
            self.record.allocations.append((a.shape, a.dtype))
        return b, b.ctypes.data

    def zeros(self, shape, dtype, like):
        a = self._made(np.zeros(shape, dtype))
        return a, a.ctypes.data

    def result(self, a):
        return a

    def scratch_allocator(self):
        return contextlib.nullcontext()


@pytest.fixture
def device(monkeypatch):
    """Record of resolved kernels and launches; the engine runs against the fake device."""
    record = types.SimpleNamespace(kernels=[], launches=[], names=[], allocations=[])
    functions = {}   # expression -> a fake function whose pointer is its index
    frame = FakeFrame(record)

    def resolve(file, expression):
        record.kernels.append(expression)
        if expression not in functions:
            functions[expression] = types.SimpleNamespace(
                attributes={"num_regs": 48},
                kernel=types.SimpleNamespace(ptr=len(functions) + 1))
        return functions[expression]

    def launch(fn, grid, block, shared, stream, words):
        name = next(e for e, f in functions.items() if f.kernel.ptr == fn)
        frame.check_alive(words)
        record.names.append(name)
        if "sum_chunks" in name:
            record.launches.append(("sum_chunks", grid, list(words)))
        else:
            record.launches.append((grid, list(words)))

    monkeypatch.setattr(_launch, "device_limits", lambda d: H100)
    monkeypatch.setattr(_source, "function", resolve)
    monkeypatch.setattr(_args, "launch", launch)
    monkeypatch.setattr(_engine, "on_device", lambda build, key, device: build(key))
    monkeypatch.setattr(_engine, "current_device", lambda: 0)
    monkeypatch.setattr(_engine, "ticket", lambda d, s: 0x7)
    monkeypatch.setattr(_engine, "col_tickets", lambda d, s: 0x70)
    # Off the hot path the operands go as they are (the fake device makes no copies).
    monkeypatch.setattr(_engine, "off_path", lambda frame, device, stream: contextlib.nullcontext())
    monkeypatch.setattr(_pointwise.FAMILY, "copies", lambda frame, stream, key, state: (key, state,
                                                                                      None))
    plans = {}
    monkeypatch.setattr(_pointwise.FAMILY, "plans", plans)
    monkeypatch.setattr(_pointwise, "_PLANS", plans)
    monkeypatch.setitem(_dispatch._FRAMES, HostArray, frame)
    return record


def _words(spec, kernel, words, name):
    """The words of parameter `name` in a launch of `kernel` ('flat', 'rows' or 'reduce')."""
    make = {"rows": _pointwise.rows_layout, "flat": _pointwise.flat_layout,
            "reduce": _pointwise.reduce_layout}[kernel]
    layout = make(len(spec.operands), spec.param_words)
    start = layout.slot[name]
    names = list(layout.slot)
    end = layout.slot[names[names.index(name) + 1]] if name != names[-1] else layout.size
    return words[start:end]


# Every pointwise kernel the project compiles (CI compiles each for sm_80 and sm_90): a plan
# that named another would fail at its first call on a GPU.
COMPILED = frozenset(dict(_source.units())["pointwise.cu"])


def _all_compiled(device):
    return {k for k in device.kernels if k.startswith("cupyloss::pointwise_")} <= COMPILED


# (input shape, target shape), each here for the kernel and gradient route it takes.
LAYOUTS = [
    ((64, 96), (64, 96)),    # flat, vectorised
    ((4099, 96), (96,)),     # rows: the target is one row; its gradient over many row blocks
    ((8, 96), (96,)),        # rows, one block: the row gradient written directly
    ((1000, 7), (1000, 1)),  # reduce: a column broadcast, its gradient summed along the rows
    ((3,), ()),              # a 0-d target: its gradient a grid sum
    ((0, 5), (5,)),          # empty: the broadcast target's gradient is zeros
]


def _arrays(spec, input_shape, target_shape):
    if spec.name == "margin_ranking_loss":
        return [arr(input_shape), arr(target_shape), arr(target_shape, 1.0)]
    arrays = [arr(input_shape), arr(target_shape)]
    if spec.name == "gaussian_nll_loss":
        arrays.append(arr(input_shape, 1.0))
    return arrays


@pytest.mark.parametrize("input_shape,target_shape", LAYOUTS)
@pytest.mark.parametrize("name", list(_registry.SPECS))
def test_every_loss_plans_every_layout(device, name, input_shape, target_shape):
    """value, backward and value_and_grad: one pointwise launch each, the pointers of every
    array in its words, one gradient per array of that array's shape."""
    spec = _registry.SPECS[name]
    arrays = _arrays(spec, input_shape, target_shape)
    extras = {e: arr(target_shape[-1:]) for e in spec.optional}
    for kw in ({}, extras):
        given = arrays + list(kw.values())
        value = getattr(cupyloss, name)(*arrays, reduction="sum", **kw)
        grads = getattr(cupyloss, name + "_backward")(1.0, *arrays, reduction="sum", **kw)
        loss, grads2 = getattr(cupyloss, name + "_value_and_grad")(*arrays, reduction="sum",
                                                                  **kw)
        assert value.shape == loss.shape == ()
        assert [g.shape for g in grads] == [g.shape for g in grads2] == [a.shape for a in given]
    main = [launch for launch in device.launches if launch[0] != "sum_chunks"]
    assert len(main) == 6
    assert _all_compiled(device)
    last = [name for name in device.names if "sum_chunks" not in name][-1]
    kernel = next(k for k in ("rows", "flat", "reduce") if f"pointwise_{k}<" in last)
    words = main[-1][1]
    pointers = _words(spec, kernel, words, "in")
    assert pointers == [a.ctypes.data for a in given] + [0] * (len(spec.operands) - len(given))


def test_kernel_choice_and_gradient_routes(device):
    """Which kernel each layout takes and where each gradient goes, on the fake H100."""
    spec = _registry.SPECS["binary_cross_entropy_with_logits"]
    x, t = arr((4099, 96)), arr((4099, 96))
    cupyloss.binary_cross_entropy_with_logits_value_and_grad(x, t, weight=arr((96,)),
                                                             pos_weight=arr(()))
    # weight (a row) and pos_weight (a scalar) are the same for every row: mask 4 + 8.
    # The row blocks add the weight's partials themselves: one launch.
    assert device.names == [
        "cupyloss::pointwise_rows<float, cupyloss::BceLogitsOp<3>, 4, true, 12>"]
    (plan,) = _pointwise._PLANS.values()
    assert plan.grads == ("g", "g", "fused", "g0")   # full, full, row, 0-d
    words = device.launches[0][1]
    assert _words(spec, "rows", words, "kind") == [_pointwise.KIND_FULL, _pointwise.KIND_FULL,
                                                   _pointwise.KIND_ROW, _pointwise.KIND_SCALAR]
    assert plan.scratch_size == 5 * np.prod(plan.main.grid)  # the loss and 4 operands' 0-d sums
    assert plan.main.grid[1] > 1 and _words(spec, "rows", words, "col_tickets") == [0x70]
    ws = _words(spec, "rows", words, "ws")
    assert ws[:2] == [0, 0] and ws[3] == 0 and ws[2] != 0    # partials for the row operand
    g = _words(spec, "rows", words, "g")
    assert g[2] != 0 and g[2] != ws[2]                       # and its own gradient array

    # A call that wants no gradient takes the value-only instantiation of the same kernel.
    cupyloss.binary_cross_entropy_with_logits(x, t, weight=arr((96,)), pos_weight=arr(()))
    assert device.kernels[-1] == (
        "cupyloss::pointwise_rows<float, cupyloss::BceLogitsOp<3>, 4, false, 12>")
    # No weight and no pos_weight: the functor without their arithmetic (modes' bits 0).
    cupyloss.binary_cross_entropy_with_logits(x.ravel(), t.ravel())
    assert device.kernels[-1] == (
        "cupyloss::pointwise_flat<float, cupyloss::BceLogitsOp<0>, 4, false>")
    cupyloss.binary_cross_entropy_with_logits(x.ravel(), t.ravel(), pos_weight=arr(()))
    assert device.kernels[-1] == (
        "cupyloss::pointwise_flat<float, cupyloss::BceLogitsOp<2>, 4, false>")


def test_absent_and_number_operands_read_their_fill(device):
    """An optional array left out reads as 1; a number var reads as itself, set per call."""
    spec = _registry.SPECS["gaussian_nll_loss"]
    x = arr((10, 7))
    cupyloss.gaussian_nll_loss(x, x, 0.25)
    cupyloss.gaussian_nll_loss(x, x, 4.0)
    assert len(_pointwise._PLANS) == 1   # one plan: the number is a per-call word
    fills = [_words(spec, "flat", words, "fill")[2] for _, words in device.launches]
    assert fills == [_args.f64_word(0.25), _args.f64_word(4.0)]
    assert [_words(spec, "flat", words, "in")[2] for _, words in device.launches] == [0, 0]
    bce = _registry.SPECS["binary_cross_entropy"]
    cupyloss.binary_cross_entropy(x, x)
    assert _words(bce, "flat", device.launches[-1][1], "fill") == [_args.f64_word(1.0)] * 3


def test_params_are_the_functors_struct(device):
    """Options land in the functor's Params words, in declaration order, 64-bit each; the
    options named in the entry's modes choose the functor's template bits instead, and option
    values named in its constants set a further bit."""
    x = arr((16, 16))
    spec = _registry.SPECS["poisson_nll_loss"]
    for log_input, full, bits in ((False, True, 2), (True, False, 1), (False, False, 0)):
        cupyloss.poisson_nll_loss(x, x, log_input=log_input, full=full, eps=0.125)
        assert _words(spec, "flat", device.launches[-1][1], "p") == [_args.f64_word(0.125)]
        assert f"cupyloss::PoissonNllOp<{bits}>," in device.names[-1]
    kl = _registry.SPECS["kl_div"]
    cupyloss.kl_div(x, x, log_target=True, log_input=False)
    assert _words(kl, "flat", device.launches[-1][1], "p") == [0]   # NoParams
    assert "cupyloss::KlDivOp<1>," in device.names[-1]
    cupyloss.mse_loss(x, x)
    mse = _registry.SPECS["mse_loss"]
    assert _words(mse, "flat", device.launches[-1][1], "p") == [0]   # NoParams
    # An option value named in `constants` sets a template bit and stays in Params.
    focal = _registry.SPECS["sigmoid_focal_loss"]
    for gamma, bits in ((2.0, 1), (2, 1), (1.5, 0), (0.0, 0)):
        cupyloss.sigmoid_focal_loss(x, x, alpha=0.5, gamma=gamma)
        assert _words(focal, "flat", device.launches[-1][1], "p") == [
            _args.f64_word(0.5), _args.f64_word(gamma)]
        assert f"cupyloss::SigmoidFocalOp<{bits}>," in device.names[-1]
    smooth = _registry.SPECS["smooth_l1_loss"]
    for beta, bits in ((1.0, 1), (1, 1), (0.5, 0), (0.0, 0)):
        cupyloss.smooth_l1_loss(x, x, beta=beta)
        assert _words(smooth, "flat", device.launches[-1][1], "p") == [_args.f64_word(beta)]
        assert f"cupyloss::SmoothL1Op<{bits}>," in device.names[-1]


def test_a_cached_plan_is_reused(device):
    x, t = arr((32, 8)), arr((8,))
    for _ in range(3):
        cupyloss.margin_ranking_loss_value_and_grad(x, x, t)
    assert len(_pointwise._PLANS) == 1 and len(device.launches) >= 3


def test_only_the_gradients_asked_for_are_allocated(device):
    x = arr((16, 16))
    g = cupyloss.binary_cross_entropy_with_logits_backward(1.0, x, x, pos_weight=arr((16,)),
                                                           wrt="pos_weight")
    assert g.shape == (16,)
    (plan,) = _pointwise._PLANS.values()
    assert plan.grads[:3] == (None, None, None) and plan.grads[3] is not None


def test_var_shapes_view_like_torch(device):
    """var one short of the input gains a trailing 1 (its gradient keeps var's shape); shapes
    torch rejects raise its ValueError before any launch."""
    x = arr((12, 5))
    _, (_, _, g_var) = cupyloss.gaussian_nll_loss_value_and_grad(x, x, arr((12,), 1.0))
    assert g_var.shape == (12,)
    launches = len(device.launches)
    with pytest.raises(ValueError, match="var is of incorrect size"):
        cupyloss.gaussian_nll_loss(x, x, arr((5,), 1.0))
    assert len(device.launches) == launches


def test_wrt_names_arguments_by_torchs_names(device):
    x = arr((4, 4))
    with pytest.raises(ValueError, match="wrt names 'input'; it takes 'input1', 'input2', "
                                         "'target'"):
        cupyloss.margin_ranking_loss_backward(1.0, x, x, x, wrt="input")
    with pytest.raises(ValueError, match="wrt names 'weight', which is not an array"):
        cupyloss.binary_cross_entropy_backward(1.0, x, x, wrt="weight")
    g_w, g_x = cupyloss.binary_cross_entropy_backward(1.0, x, x, weight=x,
                                                      wrt=("weight", "input"))
    assert g_w.shape == g_x.shape == (4, 4)


@pytest.mark.parametrize("operands", [3, 4, 5])
def test_geometry_mirror_has_one_stride_row_per_operand(operands):
    """Geometry<N> in common.cuh: ndim, MAX_DIMS divisors of four words, N x MAX_DIMS strides."""
    dims = _launch.MAX_DIMS
    dtype = _launch.geometry_dtype(operands)
    assert dtype.itemsize == 8 * (1 + 4 * dims + operands * dims)
    g = _launch.geometry((6, 7), [(7, 1)] * operands, operands)
    assert g["stride"].shape == (1, operands, dims)
    assert g["stride"][0, operands - 1, :2].tolist() == [7, 1]
    with pytest.raises(ValueError, match="do not fit Geometry<3>"):
        _launch.geometry((6,), [(1,)] * 4, 3)


# (full shape, broadcast operand shape): every pattern a broadcast gradient can take.
BROADCAST_GRADIENTS = [
    ((256, 64, 56, 56), (1, 64, 1, 1)),   # per channel: kept dim between two broadcast runs
    ((8192, 4096), (8192, 1)),            # per row: the innermost dim broadcast
    ((8192, 4096), (4096,)),              # one row down the rows (pointwise_rows)
    ((16, 300, 64), (16, 1, 64)),         # a middle dim broadcast, the innermost kept
    ((4, 5, 6, 7), (5, 1, 7)),            # several dims of each kind, alternating
    ((2, 3, 4, 5, 6), (1, 3, 1, 5, 1)),   # three broadcast dims
]


@pytest.mark.parametrize("full_shape,operand_shape", BROADCAST_GRADIENTS)
def test_broadcast_gradients_have_no_full_size_workspace(device, full_shape, operand_shape):
    """value_and_grad with both gradients: one pointwise launch (the loss, the full gradient
    and the broadcast one from one read), then at most a sum of partials no larger than the
    device's resident warps times the operand's size, and never one of the full size."""
    n = math.prod(full_shape)
    x, t = arr(operand_shape), arr(full_shape)
    loss, (gx, gt) = cupyloss.mse_loss_value_and_grad(x, t)
    assert loss.shape == () and gx.shape == operand_shape and gt.shape == full_shape
    pointwise = [name for name in device.names if "sum_chunks" not in name]
    assert len(pointwise) == 1 and "pointwise_flat" not in pointwise[0]
    assert len(device.names) - len(pointwise) <= 1
    resident = H100.sm_count * _launch.BLOCKS_PER_SM * _launch.BLOCK // _launch.WARP
    partials = [math.prod(s) for s, dtype in device.allocations if dtype == np.float64]
    assert all(size <= resident * math.prod(operand_shape) for size in partials)
    # One allocation of the full size: t's gradient.  Everything else (the loss, x's gradient,
    # the partials of the 0-d and broadcast sums) is far smaller.
    sizes = sorted(math.prod(s) for s, _ in device.allocations)
    assert sizes[-1] == n and sizes[-2] < n // 8


def test_per_channel_and_per_row_take_the_reduce_kernel(device):
    """The [M1, O, M2] and [O, M] patterns: pointwise_reduce, vectorised, compiled for the
    input read once per unit and the target streamed (mask 1), with the reduced operand's bit
    set and its split in the words."""
    spec = _registry.SPECS["mse_loss"]
    cupyloss.mse_loss_value_and_grad(arr((1, 64, 1, 1)), arr((256, 64, 56, 56)))
    # Its chunks' partials are added by the unit finishing each channel last: one launch.
    assert device.names == ["cupyloss::pointwise_reduce<float, cupyloss::MseOp, 4, 1>"]
    words = device.launches[0][1]
    assert _words(spec, "reduce", words, "reduced") == [1]
    n_o, n_m, chunk, nchunks, lanes = (_words(spec, "reduce", words, k)[0]
                                      for k in ("n_o", "n_m", "chunk", "nchunks", "lanes_m"))
    assert (n_o, n_m, lanes) == (64, 256 * 56 * 56, 32)
    assert nchunks > 1 and (nchunks - 1) * chunk < n_m <= nchunks * chunk
    (plan,) = _pointwise._PLANS.values()
    assert plan.grads == ("fused", "g") and plan.wide == ((plan.main.slot["ws"], nchunks * 64),)
    assert _words(spec, "reduce", words, "col_tickets") == [0x70]
    g, ws = _words(spec, "reduce", words, "g"), _words(spec, "reduce", words, "ws")
    assert 0 not in (g[0], ws[0]) and g[0] != ws[0] and ws[1] == 0
    device.names.clear()
    device.launches.clear()
    cupyloss.mse_loss_value_and_grad(arr((8192, 1)), arr((8192, 4096)))
    # 8192 rows fill an H100's resident warps: one chunk, the gradient written directly.
    assert device.names == ["cupyloss::pointwise_reduce<float, cupyloss::MseOp, 4, 1>"]
    (plan,) = [p for p in _pointwise._PLANS.values() if p.out_shape == (8192, 4096)]
    assert plan.grads == ("g", "g") and plan.wide == () and plan.after == ()
    # The target broadcast instead: it is read once per unit (mask 2); with a weight-free
    # bce_with_logits the absent weight and pos_weight are in the mask too (4 + 8).
    device.names.clear()
    cupyloss.mse_loss_value_and_grad(arr((8192, 4096)), arr((8192, 1)))
    assert device.names == ["cupyloss::pointwise_reduce<float, cupyloss::MseOp, 4, 2>"]
    device.names.clear()
    cupyloss.binary_cross_entropy_with_logits_value_and_grad(arr((8192, 1)), arr((8192, 4096)))
    assert device.names[0] == (
        "cupyloss::pointwise_reduce<float, cupyloss::BceLogitsOp<0>, 4, 13>")


def test_views_and_odd_sizes_take_the_scalar_steps(device):
    """A transposed full operand or an innermost run that is not a whole number of vectors
    reads one element a step."""
    t = arr((64, 30)).T                      # (30, 64), strides (1, 30)
    cupyloss.mse_loss_value_and_grad(arr((30, 1)), t)
    assert device.names[0] == "cupyloss::pointwise_reduce<float, cupyloss::MseOp, 1, 1>"
    device.names.clear()
    cupyloss.mse_loss_value_and_grad(arr((30, 1)), arr((30, 63)))
    assert device.names[0] == "cupyloss::pointwise_reduce<float, cupyloss::MseOp, 1, 1>"
    # A row of 63 (not whole vectors): the reduce kernel's scalar steps, not a rows kernel
    # (the rows kernel is compiled for whole vectors alone), the loss alone likewise.
    for fn in (cupyloss.mse_loss_value_and_grad, cupyloss.mse_loss):
        device.names.clear()
        fn(arr((63,)), arr((30, 63)))
        assert device.names[0].startswith("cupyloss::pointwise_reduce<float, cupyloss::MseOp, 1,")


def test_flat_gradients_compile_their_stride_zero_operands_in(device):
    """A 0-d operand (or an absent one) on the vector path: the gradient kernel with its mask,
    so the functor's arithmetic on it leaves the loop; the loss alone and the strided path
    read strides at run time."""
    x, t = arr((3, 8)), arr(())
    cupyloss.binary_cross_entropy_value_and_grad(t, x)       # 0-d input, no weight (bit 2)
    cupyloss.binary_cross_entropy(t, x)
    cupyloss.mse_loss_value_and_grad(arr((64, 30)).T, t)      # strided: one element a step
    assert device.names == [
        "cupyloss::pointwise_flat<float, cupyloss::BceOp<0>, 4, true, 5>",
        "cupyloss::pointwise_flat<float, cupyloss::BceOp<0>, 4, false>",
        "cupyloss::pointwise_flat<float, cupyloss::MseOp, 1, true>"]
    assert _all_compiled(device)


def test_operands_broadcast_along_different_dims_take_a_pass_each(device):
    """x per channel and t per position: the first pass computes the value and x's gradient,
    a second only t's; an operand broadcast like x (same dims) shares x's pass."""
    x, t = arr((1, 8, 1, 1)), arr((4, 1, 5, 6))
    loss, (gx, gt) = cupyloss.mse_loss_value_and_grad(x, t)
    assert gx.shape == x.shape and gt.shape == t.shape and loss.shape == ()
    (plan,) = _pointwise._PLANS.values()
    assert plan.value and plan.grads[0] is not None and plan.grads[1] is None
    assert plan.rest is not None and not plan.rest.value and not plan.rest.loss
    assert plan.rest.grads[0] is None and plan.rest.grads[1] is not None
    reduce = [n for n in device.names if "pointwise_reduce" in n]
    assert len(reduce) == 2
    spec = _registry.SPECS["binary_cross_entropy_with_logits"]
    device.launches.clear()
    w = arr((1, 8, 1, 1))
    cupyloss.binary_cross_entropy_with_logits_value_and_grad(
        arr((4, 8, 5, 6)), arr((4, 8, 5, 6)), weight=w, pos_weight=w)
    (main,) = [launch for launch in device.launches if launch[0] != "sum_chunks"]
    assert _words(spec, "reduce", main[1], "reduced") == [0b1100]   # one pass for both


@pytest.mark.parametrize("which", ["backward", "value_and_grad"])
def test_three_broadcast_patterns_chain_three_passes(device, which):
    """input (2, 2, 1), target (2, 2) and weight (2,) broadcast along three different dims: a
    pass each, chained, and every gradient reaches the caller."""
    x, t, w = arr((2, 2, 1)), arr((2, 2)), arr((2,))
    if which == "backward":
        grads = cupyloss.binary_cross_entropy_backward(1.0, x, t, weight=w, reduction="none")
    else:
        _, grads = cupyloss.binary_cross_entropy_value_and_grad(x, t, weight=w,
                                                                reduction="none")
    assert [g.shape for g in grads] == [x.shape, t.shape, w.shape]
    (plan,) = _pointwise._PLANS.values()
    assert plan.rest is not None and plan.rest.rest is not None
    assert [plan.grads[2], plan.rest.grads[2]] == [None, None]
    assert plan.rest.rest.grads[2] is not None and plan.rest.rest.rest is None
    assert sum("pointwise_reduce" in n for n in device.names) == 3


@pytest.mark.parametrize("shapes", [((8, 28), (8, 1)), ((4, 3, 5), (1, 3, 1))])
def test_the_loss_alone_takes_value_and_grads_split(device, shapes):
    """A broadcast operand splits the pass whether or not its gradient is wanted, so the 0-d
    loss is summed in one order by mse_loss and by mse_loss_value_and_grad."""
    x, t = arr(shapes[0]), arr(shapes[1])
    cupyloss.mse_loss(x, t)
    alone = device.launches[-1]
    start = len(device.launches)
    cupyloss.mse_loss_value_and_grad(x, t)
    both = device.launches[start]   # the main launch; the chunks' sums follow it
    assert "pointwise_reduce<" in device.kernels[-2] and "pointwise_reduce<" in device.kernels[-1]
    spec = _registry.SPECS["mse_loss"]
    for name in ("kept", "red", "n_o", "n_m", "chunk", "nchunks", "lanes_m"):
        assert _words(spec, "reduce", alone[1], name) == _words(spec, "reduce", both[1], name)
    assert alone[0] == both[0]


@pytest.mark.parametrize("name", ["mse_loss", "kl_div"])
def test_the_rows_loss_alone_takes_value_and_grads_split(device, name):
    """A row broadcast down the rows: the loss alone, reduced to 0-d, launches the value-only
    rows kernel on value_and_grad's grid and rows per block, so both add the loss up in one
    order; an elementwise loss keeps the value-only kernel's own (larger) grid."""
    x, t = arr((4096, 1024)), arr((1024,))
    spec = _registry.SPECS[name]
    getattr(cupyloss, name)(x, t)
    alone = device.launches[-1]
    assert "pointwise_rows<" in device.names[-1] and ", false, " in device.names[-1]
    getattr(cupyloss, name + "_value_and_grad")(x, t)
    both = next(launch for launch, kernel in zip(device.launches[::-1], device.names[::-1])
                if "pointwise_rows<" in kernel)
    for word in ("rows", "cols", "rows_per_block", "tx"):
        assert _words(spec, "rows", alone[1], word) == _words(spec, "rows", both[1], word)
    assert alone[0] == both[0]
    getattr(cupyloss, name)(x, t, reduction="none")
    assert math.prod(device.launches[-1][0]) > math.prod(both[0])


# Broadcast patterns of every operand (None: an optional array left out), for the masks the rows
# and reduce kernels are compiled for: input, target, then the optional arrays.
MASK_PATTERNS = [
    ((1, 6, 1, 1), (5, 6, 3, 4), None, None),        # per-channel input
    ((5, 6, 3, 4), (1, 6, 1, 1), (4,), ()),          # per-channel target, weight a row
    ((40, 1), (40, 36), (40, 1), (36,)),             # per-row, weight per row, pos_weight a row
    ((36,), (40, 36), (), None),                     # row input, 0-d weight
    ((40, 36), (36,), (40, 36), (40, 1)),            # row target, full weight
    ((40, 1), (1, 36), None, (40, 36)),              # outer product of two broadcasts
]


@pytest.mark.parametrize("shapes", MASK_PATTERNS)
@pytest.mark.parametrize("name", list(_registry.SPECS))
def test_every_mask_a_plan_takes_is_compiled(device, name, shapes):
    """Whatever operands stream and whichever optional arrays are given, the rows and reduce
    kernels a plan names (their mask: the operands read once per row or unit, and the absent
    ones) are among the kernels CI compiles, for the loss alone, backward and value_and_grad."""
    spec = _registry.SPECS[name]
    operands = [arr(s, 0.5) if s is not None else None for s in shapes]
    arrays = operands[:2]
    if len(spec.arrays) == 3:   # margin_ranking's target (the second input's shape), var
        arrays.append(arr(shapes[0] if name == "gaussian_nll_loss" else shapes[1], 1.0))
    kw = {o: a for o, a in zip(spec.optional, operands[2:]) if a is not None}
    getattr(cupyloss, name)(*arrays, reduction="sum", **kw)
    getattr(cupyloss, name + "_backward")(1.0, *arrays, reduction="sum", **kw)
    getattr(cupyloss, name + "_value_and_grad")(*arrays, reduction="sum", **kw)
    assert any("pointwise_reduce<" in k or "pointwise_rows<" in k for k in device.kernels)
    assert _all_compiled(device)


def test_row_gradients_summed_in_one_launch_up_to_the_column_tickets(device, monkeypatch):
    """A row operand's gradient over several row blocks: summed by the kernel's last row blocks
    while the column blocks have tickets (_engine.COL_TICKETS), by sum_chunks past that; the summing
    launches take ROWS_TX_SUMMED threads along a row, an elementwise loss alone the widest."""
    spec = _registry.SPECS["mse_loss"]
    x, t = arr((4096,)), arr((512, 4096))
    cupyloss.mse_loss_value_and_grad(x, t)
    (plan,) = _pointwise._PLANS.values()
    assert plan.grads == ("fused", "g") and len(device.launches) == 1
    words = device.launches[0][1]
    assert _words(spec, "rows", words, "tx") == [_tuning.value("ROWS_TX_SUMMED")]
    assert plan.main.grid[0] == 4096 // (4 * _tuning.value("ROWS_TX_SUMMED")) and plan.main.grid[1] > 1
    cupyloss.mse_loss(x, t, reduction="none")
    assert _words(spec, "rows", device.launches[-1][1], "tx") == [_launch.BLOCK]
    cupyloss.mse_loss(x, t)   # a 0-d loss alone: value_and_grad's split, so the same sum
    assert _words(spec, "rows", device.launches[-1][1], "tx") == [_tuning.value("ROWS_TX_SUMMED")]
    # More column blocks than tickets: the partials go to sum_chunks.
    _pointwise._PLANS.clear()
    monkeypatch.setattr(_engine, "COL_TICKETS", plan.main.grid[0] - 1)
    cupyloss.mse_loss_value_and_grad(x, t)
    (again,) = _pointwise._PLANS.values()
    assert again.main.grid == plan.main.grid and again.grads == ("chunks", "g")
    assert device.launches[-1][0] == "sum_chunks"
    assert device.launches[-1][2][1:3] == [plan.main.grid[1], 4096]   # [row blocks, cols] partials
    assert _words(spec, "rows", device.launches[-2][1], "col_tickets") == [0]
    # sum_chunks reads the main launch's partials of the input and writes the input's gradient,
    # an array of its own (no word of the main launch).
    sums, main = device.launches[-1][2], device.launches[-2][1]
    ws, g = _words(spec, "rows", main, "ws"), _words(spec, "rows", main, "g")
    slot = _pointwise.SUM_CHUNKS.slot
    assert sums[slot["ws"]] == ws[0] != 0 and ws[1] == 0 and g[0] == 0
    assert sums[slot["out"]] not in (0, ws[0], g[1])
    # The same past the tickets in pointwise_reduce (64 channels, a unit each).
    monkeypatch.setattr(_engine, "COL_TICKETS", 63)
    cupyloss.mse_loss_value_and_grad(arr((1, 64, 1, 1)), arr((256, 64, 56, 56)))
    (plan,) = [p for p in _pointwise._PLANS.values() if p.out_shape == (256, 64, 56, 56)]
    assert plan.grads == ("chunks", "g") and device.launches[-1][0] == "sum_chunks"
    assert _words(spec, "reduce", device.launches[-2][1], "col_tickets") == [0]
