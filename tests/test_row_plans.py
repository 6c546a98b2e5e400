"""The row-wise families' host path on a CPU: which kernel runs and what each of its words holds.

A fake device (H100 limits, kernels that resolve to a dummy function, launches recorded instead
of run) and the fake framework of test_pointwise_plans over NumPy arrays drive
`_rowwise.evaluate`, `_rowclass.evaluate` and `_rowpair.evaluate` as a call on a GPU would, up
to the launch.  The words are read by the kernels' own parameter names (the layouts are built
from kernels/, tests/test_params.py), so a pointer or option packed into its neighbour's word
fails here.  What the kernels compute is tested on the GPU.
"""

import contextlib
import types

import numpy as np
import pytest

from cupyloss._core import (
    args as _args, dispatch as _dispatch, engine as _engine, launch as _launch,
    source as _source)
from cupyloss.rowclass import _family as _rowclass
from cupyloss.rowpair import _family as _rowpair
from cupyloss.rowwise import _family as _rowwise
from test_pointwise_plans import H100, FakeFrame, HostArray

# H100 limits with clusters, as the rows kernel plans on sm_90
LIMITS = _launch.DeviceLimits(sm_count=H100.sm_count, max_grid_x=H100.max_grid_x,
                              max_grid_y=H100.max_grid_y,
                              max_shared_per_block=H100.max_shared_per_block,
                              max_shared_optin=227 * 1024, clusters=True)


@pytest.fixture
def device(monkeypatch):
    """Launches recorded as (kernel expression, {parameter name: word or words}); the families
    run against the fake device."""
    record = types.SimpleNamespace(launches=[], allocations=[], copies=[], likes=[])
    functions = {}
    frame = FakeFrame(record)

    def resolve(file, expression):
        if expression not in functions:
            functions[expression] = types.SimpleNamespace(
                attributes={"num_regs": 64}, kernel=types.SimpleNamespace(ptr=len(functions) + 1))
        return functions[expression]

    layouts = {}

    def launch(fn, grid, block, shared, stream, words):
        name = next(e for e, f in functions.items() if f.kernel.ptr == fn)
        frame.check_alive(words)
        record.launches.append((name, list(words)))

    def cooperative(fn, grid, block, shared, stream, words):
        launch(fn, grid, block, shared, stream, words)

    def target_operand(frame, target):
        return frame.operand(target, "target"), target.dtype.kind in "iu"

    def contiguous(frame, op, name):
        copy = np.ascontiguousarray(op.array).view(HostArray)
        record.copies.append(copy)
        return frame.operand(copy, name)

    monkeypatch.setattr(_launch, "device_limits", lambda d: LIMITS)
    monkeypatch.setattr(_source, "function", resolve)
    monkeypatch.setattr(_source, "resident", lambda *a, **k: 2)
    monkeypatch.setattr(_args, "launch", launch)
    monkeypatch.setattr(_args, "launch_cooperative", cooperative)
    monkeypatch.setattr(_engine, "on_device", lambda build, key, device: build(key))
    for module in (_rowwise, _rowclass, _rowpair):
        plans = {}
        monkeypatch.setattr(module.FAMILY, "plans", plans)
        monkeypatch.setattr(module, "_PLANS", plans)
    monkeypatch.setattr(_engine, "current_device", lambda: 0)
    monkeypatch.setattr(_engine, "ticket", lambda d, s: 0x7)
    monkeypatch.setattr(_engine, "target_operand", target_operand)
    monkeypatch.setattr(_engine, "contiguous", contiguous)
    monkeypatch.setattr(_engine, "off_path", lambda frame, device, stream: contextlib.nullcontext())
    monkeypatch.setitem(_dispatch._FRAMES, HostArray, frame)
    record.layouts = layouts
    return record


def _named(expression, words):
    """{parameter name: word} of a recorded launch, by the kernel's own parameter list."""
    source, kernel = next((s, k) for s, k in (
        ("rowwise.cu", "cross_entropy_rows"), ("rowwise.cu", "cross_entropy_cols"),
        ("rowwise.cu", "class_weight_sum"), ("rowclass.cu", "rowclass_rows"),
        ("rowclass.cu", "rowclass_count"), ("rowpair.cu", "rowpair_rows"),
        ("rowpair.cu", "rowpair_finish")) if f"::{k}<" in expression)
    names = [n for _, n in _source.kernel_params(source, kernel)]
    assert len(names) == len(words), expression
    return dict(zip(names, words))


def _host(a):
    return np.ascontiguousarray(a).view(HostArray)


def _ptr(a):
    return a.ctypes.data


def test_cross_entropy_rows_words(device):
    x = _host(np.random.default_rng(0).standard_normal((6, 300)).astype(np.float32))
    t = _host(np.arange(6, dtype=np.int64))
    w = _host(np.linspace(0.5, 1.5, 300).astype(np.float32))
    loss, gx, _, _ = _rowwise.evaluate(
        _rowwise.SPECS["cross_entropy"], x, t, w, reduction="mean", ignore_index=-7,
        label_smoothing=0.25, lse_square_scale=1e-3, softcap=0.0, wrt=("input",),
        grad_output=0.5)
    (wname, wsum), (name, main) = [(e, _named(e, words)) for e, words in device.launches]
    assert "class_weight_sum" in wname and "cross_entropy_rows" in name
    assert main["x"] == _ptr(x) and main["tgt"] == _ptr(t) and main["weight"] == _ptr(w)
    assert main["rows"] == 6 and main["cols"] == 300 and main["x_rs"] == 300
    assert main["ignore_index"] == _args.i64_word(-7)
    assert main["smoothing"] == _args.f64_word(0.25)
    assert main["zscale"] == _args.f64_word(1e-3) and main["softcap"] == _args.f64_word(0.0)
    assert main["go_value"] == _args.f64_word(0.5)
    assert main["value"] == _ptr(loss) and main["gx"] == _ptr(gx) and main["loss"] == 0
    assert main["denom"] == wsum["out"] != 0          # the summed weights the mean divides by
    assert wsum["tgt"] == _ptr(t) and wsum["weight"] == _ptr(w)
    assert wsum["ignore_index"] == _args.i64_word(-7) and wsum["rows"] == 6


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_num_items_from_the_host_is_the_divisor_and_its_reciprocal(device, reduction):
    """num_items as an int: no count launch, the divisor and the gradient's scale filled per
    call (two counts share one plan), and the 'mean' over this call's rows not asked for."""
    x = _host(np.zeros((6, 300), np.float32))
    t = _host(np.arange(6, dtype=np.int64))
    for count in (24, 7):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, reduction=reduction,
                          wrt=("input",), num_items=count)
    assert [name for name, _ in device.launches] == [device.launches[0][0]] * 2
    first, second = (_named(name, words) for name, words in device.launches)
    assert "cross_entropy_rows" in device.launches[0][0]
    assert first["divisor"] == _args.f64_word(24.0)
    assert first["grad_scale"] == _args.f64_word(1 / 24)
    assert second["divisor"] == _args.f64_word(7.0)
    assert second["grad_scale"] == _args.f64_word(1 / 7)
    assert first["denom"] == 0 and not first["flags"] & _rowwise.FLAG_MEAN_W
    assert len(_rowwise.FAMILY.plans) == 1


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_num_items_on_the_device_is_read_into_the_divisor(device, dtype):
    """num_items as a 0-d device array: class_weight_sum reads it (as its dtype says) into the
    region the main launch divides the value and the gradient by; no targets are summed."""
    x = _host(np.zeros((6, 300), np.float32))
    t = _host(np.arange(6, dtype=np.int64))
    items = np.array(40, dtype).view(HostArray)
    _rowwise.evaluate(_rowwise.SPECS["nll_loss"], x, t, reduction="mean", wrt=("input",),
                      num_items=items)
    (wname, wsum), (name, main) = [(e, _named(e, words)) for e, words in device.launches]
    assert "class_weight_sum" in wname
    assert wsum["items"] == _ptr(items) and wsum["rows"] == 0
    assert bool(wsum["flags"] & _rowwise.FLAG_ITEMS32) == (dtype == np.int32)
    assert main["denom"] == wsum["out"] != 0
    assert main["divisor"] == main["grad_scale"] == _args.f64_word(1.0)


@pytest.mark.parametrize("items, error, match", [
    (3.0, TypeError, "must be an int"), (True, TypeError, "must be an int"),
    (-1, ValueError, "0 or more"), ("4", TypeError, "must be an int")])
def test_num_items_of_the_wrong_kind_is_refused_before_any_launch(device, items, error, match):
    x = _host(np.zeros((6, 30), np.float32))
    t = _host(np.arange(6, dtype=np.int64))
    with pytest.raises(error, match=match):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, num_items=items)
    with pytest.raises(ValueError, match="reduction='none'"):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, reduction="none",
                          num_items=4)
    bad = _host(np.array([4, 4], np.int64))
    with pytest.raises(ValueError, match="0-d"):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, num_items=bad)
    with pytest.raises(TypeError, match="int32/int64"):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t,
                          num_items=np.array(4.0, np.float32).view(HostArray))
    assert device.launches == []


def test_cross_entropy_cols_words(device):
    """Classes not contiguous (N, C, d): the thread-per-row kernel and its strides."""
    x = _host(np.zeros((4, 5, 3), np.float32))
    t = _host(np.zeros((4, 3), np.int64))
    loss, _, _, _ = _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, reduction="none",
                                      softcap=2.0)
    ((name, words),) = device.launches
    cols = _named(name, words)
    assert "cross_entropy_cols" in name
    assert (cols["xn"], cols["xc"], cols["xd"]) == (15, 3, 1)
    assert (cols["tn"], cols["td"]) == (3, 1) and cols["inner"] == 3
    assert cols["x"] == _ptr(x) and cols["tgt"] == _ptr(t) and cols["loss"] == _ptr(loss)
    assert cols["softcap"] == _args.f64_word(2.0) and cols["weight"] == 0


def test_rowclass_words(device):
    x = _host(np.zeros((4, 9), np.float32))
    t = _host(np.array([1, 2, 3, 4], np.int64))
    w = _host(np.ones(9, np.float32))
    loss, _, _ = _rowclass.evaluate(_rowclass.SPECS["multi_margin_loss"], x, t, w,
                                    reduction="sum", margin=0.75)[:3]
    ((name, words),) = device.launches
    rows = _named(name, words)
    assert rows["x"] == _ptr(x) and rows["tgt"] == _ptr(t) and rows["weight"] == _ptr(w)
    assert rows["option"] == _args.f64_word(0.75) and rows["value"] == _ptr(loss)


def test_multilabel_margin_words(device):
    """multilabel_margin_loss: its rowclass_rows instance, int64 targets by row stride, the
    gradient's 1/N, 'mean' over no rows made 0; a block a row of a warp for 9 classes."""
    x = _host(np.zeros((4, 9), np.float32))
    t = _host(np.zeros((4, 16), np.int32))[:, :9]
    _, gx, _ = _rowclass.evaluate(_rowclass.SPECS["multilabel_margin_loss"], x, t,
                                  reduction="mean", wrt=("input",))
    ((name, words),) = device.launches
    rows = _named(name, words)
    assert name == _source.rowclass_name("rowclass_rows", "float",
                                         _rowclass.LOSS_MULTILABEL_MARGIN)
    assert rows["x"] == _ptr(x) and rows["tgt"] == _ptr(t) and rows["gx"] == _ptr(gx)
    assert (rows["rows"], rows["cols"], rows["x_rs"], rows["t_rs"]) == (4, 9, 9, 16)
    assert rows["flags"] & _rowclass.FLAG_ZERO_EMPTY and not rows["flags"] & _rowclass.FLAG_INDEX64
    assert rows["grad_scale"] == _args.f64_word(0.25) and rows["tpr"] == 32


def test_rowclass_count_words(device):
    """jsd's 'mean' over shift labels: the count kernel first, its out the main kernel's denom."""
    s = _host(np.zeros((4, 9), np.float32))
    labels = _host(np.array([1, -100, 3, 4], np.int64))
    _rowclass.evaluate(_rowclass.SPECS["jsd"], s, s.copy().view(HostArray),
                       shift_labels=labels, reduction="mean", ignore_index=-100,
                       wrt=("input",))
    (cname, cwords), (name, words) = device.launches
    count, rows = _named(cname, cwords), _named(name, words)
    assert "rowclass_count" in cname
    assert count["labels"] == rows["labels"] == _ptr(labels)
    assert count["ignore_index"] == rows["ignore_index"] == _args.i64_word(-100)
    assert count["out"] == rows["denom"] != 0


def test_rowpair_words(device):
    a, p, n = (_host(np.full((5, 7), v, np.float32)) for v in (0.0, 1.0, 2.0))
    _rowpair.evaluate(_rowpair.SPECS["triplet_margin_loss"], (a, p, n),
                      (1.5, 2.0, 1e-6, False), reduction="mean",
                      wrt=("anchor",))
    name, words = device.launches[0]
    rows = _named(name, words)
    assert (rows["x0"], rows["x1"], rows["x2"]) == (_ptr(a), _ptr(p), _ptr(n))
    assert rows["margin"] == _args.f64_word(1.5) and rows["p"] == _args.f64_word(2.0)
    assert rows["rows"] == 5 and rows["cols"] == 7 and rows["g0"] != 0 and rows["g1"] == 0


def test_rowpair_wide_form_is_finished_by_a_second_launch(device, monkeypatch):
    """The wide form (a block a row, the loss alone) writes the rows' losses into the scratch's
    partials, takes no ticket, and rowpair_finish reads those partials into the 0-d value."""
    from cupyloss.rowpair import _launch as _rowpair_launch

    monkeypatch.setattr(_rowpair_launch, "pair_wide", lambda *a: True)
    a, p, n = (_host(np.full((6, 8), v, np.float32)) for v in (0.0, 1.0, 2.0))
    value, *_ = _rowpair.evaluate(_rowpair.SPECS["triplet_margin_loss"], (a, p, n),
                                  (1.0, 2.0, 1e-6, False), reduction="sum")
    (name, words), (fname, fwords) = device.launches
    rows, done = _named(name, words), _named(fname, fwords)
    assert "rowpair_rows" in name and "true>" in name and "rowpair_finish" in fname
    assert rows["partials"] != 0 and rows["ticket"] == 0 and rows["value"] == _ptr(value)
    assert done["partials"] == rows["partials"] and done["value"] == rows["value"]
    assert done["rows"] == 6


class _CupyLike(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr`, as the fused loss hands slice_grad its arrays."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def test_slice_grad_words(device):
    def arr(a):
        return np.ascontiguousarray(a).view(_CupyLike)

    z = arr(np.zeros((4, 128), np.float32))
    t, lse = arr(np.arange(4, dtype=np.int64)), arr(np.zeros(4, np.float32))
    out = arr(np.zeros((4, 128), np.float32))
    w, wsum = arr(np.ones(1000, np.float32)), arr(np.ones((), np.float32))
    _rowwise.slice_grad(z, t, lse, out, 256, 1000, w, wsum, 0.5, ignore_index=-3,
                        label_smoothing=0.1, lse_square_scale=0.0, softcap=0.0, stream=0,
                        device=0)
    ((name, words),) = device.launches
    names = [n for _, n in _source.kernel_params("rowwise.cu", "cross_entropy_slice_grad")]
    s = dict(zip(names, words))
    assert "cross_entropy_slice_grad" in name
    assert (s["x"], s["tgt"], s["weight"], s["wsum"], s["lse"], s["gx"]) == tuple(
        a.ctypes.data for a in (z, t, w, wsum, lse, out))
    assert (s["rows"], s["cols"], s["c0"], s["classes"]) == (4, 128, 256, 1000)
    assert s["ignore_index"] == _args.i64_word(-3) and s["smoothing"] == _args.f64_word(0.1)
    assert s["go_value"] == _args.f64_word(0.5) and s["go"] == 0


def test_slice_stats_and_combine_words(device):
    """Vocab-parallel cross entropy's two kernels get their arrays and options in the words
    their declarations name."""
    def arr(a):
        return np.ascontiguousarray(a).view(_CupyLike)

    z = arr(np.zeros((4, 128), np.float32))
    t = arr(np.arange(4, dtype=np.int32))
    w = arr(np.ones(1000, np.float32))
    stats = arr(np.zeros((3, 4, 6), np.float32))
    rows = [arr(np.zeros(4, np.float32)) for _ in range(3)]
    _rowwise.slice_stats(z, t, stats[1], 256, 1000, w, ignore_index=-3, label_smoothing=0.1,
                         softcap=30.0, stream=0, device=0)
    _rowwise.combine(stats, t, w, *rows, 1000, ignore_index=-3, label_smoothing=0.1,
                     lse_square_scale=1e-4, ctype="float", stream=0, device=0)
    (sname, swords), (cname, cwords) = device.launches
    s = dict(zip([n for _, n in _source.kernel_params("rowwise.cu", "cross_entropy_slice_stats")],
                 swords))
    c = dict(zip([n for _, n in _source.kernel_params("rowwise.cu", "cross_entropy_combine")],
                 cwords))
    assert "cross_entropy_slice_stats<float>" in sname and "cross_entropy_combine<float>" in cname
    assert (s["x"], s["tgt"], s["weight"], s["stats"]) == (
        z.ctypes.data, t.ctypes.data, w.ctypes.data,
        stats.ctypes.data + 4 * _rowwise.SLICE_FIELDS * 4)
    assert (s["rows"], s["cols"], s["c0"], s["classes"], s["x_rs"], s["flags"]) == (
        4, 128, 256, 1000, 128, 0)
    assert s["ignore_index"] == _args.i64_word(-3) and s["smoothing"] == _args.f64_word(0.1)
    assert s["softcap"] == _args.f64_word(30.0)
    assert (c["stats"], c["tgt"], c["weight"], c["loss"], c["lse"], c["wy"]) == (
        stats.ctypes.data, t.ctypes.data, w.ctypes.data, *(r.ctypes.data for r in rows))
    assert (c["k"], c["rows"], c["classes"]) == (3, 4, 1000)
    assert c["zscale"] == _args.f64_word(1e-4) and c["smoothing"] == _args.f64_word(0.1)


def test_vocab_parallel_steps_launch_with_the_arrays_own_pointers(device, monkeypatch):
    """cupyloss.parallel's three steps hand the kernels their arrays' pointers, strides and
    options (read by the kernels' own parameter names), without CuPy arrays."""
    import contextlib

    from cupyloss import parallel

    monkeypatch.setattr(parallel, "_target_operand", lambda frame, t: frame.operand(t, "t"))
    monkeypatch.setattr(parallel, "_on", lambda d: contextlib.nullcontext())
    x = np.zeros((6, 40), np.float32).view(HostArray)[:, :32]    # rows 40 apart
    t = _host(np.arange(6, dtype=np.int32))
    w = _host(np.ones(100, np.float32))
    stats = parallel.vocab_parallel_stats(x, t, 64, 100, w, ignore_index=-5, softcap=2.0)
    every = _host(np.zeros((2, 6, 6), np.float32))
    loss, lse, wy = parallel._combine_kernel(every, t, 100, w, -5, 0.1, 1e-3)
    go = _host(np.zeros(6, np.float32))
    grad = parallel.vocab_parallel_backward(go, x, t, lse, 64, 100, w, ignore_index=-5,
                                            lse_square_scale=1e-3)
    (sname, swords), (cname, cwords), (gname, gwords) = device.launches

    def named(kernel, words):
        return dict(zip([n for _, n in _source.kernel_params("rowwise.cu", kernel)], words))

    s = named("cross_entropy_slice_stats", swords)
    c = named("cross_entropy_combine", cwords)
    g = named("cross_entropy_slice_grad", gwords)
    assert (s["x"], s["tgt"], s["weight"], s["stats"]) == tuple(map(_ptr, (x, t, w, stats)))
    assert (s["rows"], s["cols"], s["c0"], s["classes"], s["x_rs"]) == (6, 32, 64, 100, 40)
    assert s["softcap"] == _args.f64_word(2.0) and s["ignore_index"] == _args.i64_word(-5)
    assert (c["stats"], c["tgt"], c["weight"], c["loss"], c["lse"], c["wy"]) == tuple(
        map(_ptr, (every, t, w, loss, lse, wy)))
    assert (c["k"], c["rows"], c["classes"]) == (2, 6, 100)
    assert c["smoothing"] == _args.f64_word(0.1) and c["zscale"] == _args.f64_word(1e-3)
    assert (g["x"], g["tgt"], g["lse"], g["go"], g["gx"], g["weight"]) == tuple(
        map(_ptr, (x, t, lse, go, grad, w)))
    assert (g["rows"], g["cols"], g["c0"], g["classes"], g["x_rs"], g["g_rs"]) == (
        6, 32, 64, 100, 40, 32)
    assert g["flags"] == _rowwise.FLAG_GO_ROWS and g["wsum"] == 0
    assert grad.shape == (6, 32) and stats.shape == (6, 6) and lse.shape == (6,)


def _row_call(family, go):
    """One value_and_grad-like call of each row family with grad_output `go`; its main launch."""
    if family == "rowwise":
        x = _host(np.zeros((4, 9), np.float32))
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, _host(np.arange(4)),
                          reduction="sum", wrt=("input",), grad_output=go)
    elif family == "rowclass":
        x = _host(np.zeros((4, 9), np.float32))
        _rowclass.evaluate(_rowclass.SPECS["multi_margin_loss"], x, _host(np.arange(4)),
                           reduction="sum", wrt=("input",), grad_output=go)
    else:
        a, p, n = (_host(np.full((5, 7), v, np.float32)) for v in (0.0, 1.0, 2.0))
        _rowpair.evaluate(_rowpair.SPECS["triplet_margin_loss"], (a, p, n),
                          (1.0, 2.0, 1e-6, False), reduction="sum", wrt=("anchor",),
                          grad_output=go)


@pytest.mark.parametrize("family", ["rowwise", "rowclass", "rowpair"])
def test_row_grad_output_words(device, family):
    """grad_output reaches each row family's launch as the kernel reads it: a number other than 1
    in go_value (no pointer), a 0-d device array as go's pointer (go_value left at 1)."""
    _row_call(family, 0.25)
    words = _named(*device.launches[-1])
    assert words["go_value"] == _args.f64_word(0.25) and words["go"] == 0
    g = np.array(3.0, np.float32).view(HostArray)
    _row_call(family, g)
    words = _named(*device.launches[-1])
    assert words["go"] == _ptr(g) and words["go_value"] == _args.f64_word(1.0)


def test_slow_paths_launch_contiguous_copies(device):
    """Operands the row kernels cannot stride through go off the hot path (_engine.off_path) as
    contiguous copies: each family launches on the copy, the copy holds the caller's values, and
    the results are still allocated like the caller's array (its framework and allocator)."""
    rng = np.random.default_rng(1)
    # rowwise: (N, C, d1, d2) whose d1 and d2 do not merge into one stride
    x = rng.standard_normal((2, 5, 4, 4)).astype(np.float32).view(HostArray)[:, :, ::2, :]
    t = _host(rng.integers(0, 5, (2, 2, 4)))
    _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, reduction="sum", wrt=("input",))
    copy = device.copies[0]
    assert np.array_equal(copy, x) and copy.flags.c_contiguous
    words = _named(*device.launches[-1])
    assert words["x"] == _ptr(copy) != _ptr(x)
    assert device.likes and all(like is x for like in device.likes)
    # rowclass: a transposed input, rows not at one stride of whole rows
    xc = rng.standard_normal((9, 4)).astype(np.float32).view(HostArray).T
    _rowclass.evaluate(_rowclass.SPECS["multi_margin_loss"], xc, _host(np.arange(4)),
                       reduction="sum", wrt=("input",))
    words = _named(*device.launches[-1])
    assert words["x"] == _ptr(device.copies[-1]) and np.array_equal(device.copies[-1], xc)
    assert words["x_rs"] == 9 and device.likes[-1] is xc
    # rowpair: one of three inputs whose leading dims do not merge
    a = rng.standard_normal((3, 4, 7)).astype(np.float32).view(HostArray)[:, :2, :]
    p, n = (_host(rng.standard_normal((3, 2, 7)).astype(np.float32)) for _ in range(2))
    _rowpair.evaluate(_rowpair.SPECS["triplet_margin_loss"], (a, p, n), (1.0, 2.0, 1e-6, False),
                      reduction="sum", wrt=("anchor",))
    words = _named(*device.launches[-1])
    assert words["x0"] == _ptr(device.copies[-1]) and np.array_equal(device.copies[-1], a)
    assert (words["x1"], words["x2"]) == (_ptr(p), _ptr(n)) and device.likes[-1] is a


@pytest.mark.parametrize("family", ["rowwise", "rowclass"])
def test_row_partials_and_ticket_words(device, family):
    """A 0-d loss over many blocks: the launch's partials point into the call's scratch and its
    ticket is the stream's (_engine.ticket, 0x7 here)."""
    x = _host(np.zeros((4096, 64), np.float32))
    t = _host(np.arange(4096) % 64)
    if family == "rowwise":
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, t, reduction="sum",
                          wrt=("input",))
    else:
        _rowclass.evaluate(_rowclass.SPECS["multi_margin_loss"], x, t, reduction="sum",
                           wrt=("input",))
    words = _named(*device.launches[-1])
    assert words["ticket"] == 0x7 and words["partials"] not in (0, 0x7)
    assert words["partials"] not in (words["x"], words["value"], words["gx"])


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), 1e-40])
def test_a_bad_softcap_is_refused_before_any_launch(device, softcap):
    x = _host(np.zeros((4, 9), np.float32))
    with pytest.raises(ValueError, match="softcap must be 0"):
        _rowwise.evaluate(_rowwise.SPECS["cross_entropy"], x, _host(np.arange(4)),
                          softcap=softcap)
    assert device.launches == []
