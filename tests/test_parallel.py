"""Vocab-parallel cross entropy without a GPU: the combination arithmetic of cupyloss.parallel
against torch's cross_entropy on the whole logits (float64), on NumPy and torch arrays, and the
torch adapter over several gloo processes (uneven slices, every option, a data-parallel global
mean, torch.compile).  The kernels' side is tests/test_parallel_gpu.py."""

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cupyloss.torch as CF  # noqa: E402
from cupyloss.torch import _parallel as TP  # noqa: E402
from cupyloss import parallel  # noqa: E402
from ranks import run_ranks  # noqa: E402

F = torch.nn.functional
ROWS, CLASSES = 9, 13


def _case(seed, options):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, CLASSES, dtype=torch.float64, generator=g) * 3
    x[1, 4] = float("-inf")
    t = torch.randint(0, CLASSES, (ROWS,), generator=g)
    t[2] = -100
    if options.get("outside"):
        t[5] = CLASSES + 2
    w = torch.rand(CLASSES, dtype=torch.float64, generator=g) + 0.5
    return x, t, (w if options.get("weight") else None)


def _torch_loss(x, t, w, eps, zs, cap, reduction):
    """cross_entropy on the whole logits with torch's own operations (z-loss and softcap
    spelled out), differentiable."""
    z = cap * torch.tanh(x / cap) if cap else x
    safe = torch.where((t >= 0) & (t < CLASSES), t, -100)
    loss = F.cross_entropy(z, safe, weight=w, label_smoothing=eps, reduction="none")
    counted = t != -100
    lse = torch.logsumexp(z, 1)
    loss = torch.where(counted, loss + zs * lse * lse, 0.0)
    loss = torch.where(counted & (safe == -100), float("nan"), loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    w_y = (w[safe.clamp(0)] if w is not None else torch.ones(ROWS, dtype=x.dtype))
    w_y = torch.where(counted, torch.where(safe == -100, float("nan"), w_y), 0.0)
    return loss.sum() / w_y.sum()


OPTIONS = st.fixed_dictionaries({
    "weight": st.booleans(), "outside": st.booleans(),
    "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
    "lse_square_scale": st.sampled_from([0.0, 1e-2]),
    "softcap": st.sampled_from([0.0, 4.0])})


@settings(max_examples=60, deadline=None)
@given(options=OPTIONS, cuts=st.lists(st.integers(0, CLASSES), max_size=4),
       seed=st.integers(0, 2**16), numpy_arrays=st.booleans())
def test_combined_slices_give_cross_entropy_of_the_whole_logits(options, cuts, seed,
                                                                numpy_arrays):
    """The states of any split of the classes (empty slices included) combine to the whole
    logits' per-row loss and lse, and each slice's gradient from that lse is the slice of the
    whole gradient (a class index outside the classes: a NaN row, as cross_entropy's kernel);
    on torch tensors and on NumPy arrays alike."""
    x, t, w = _case(seed, options)
    eps, zs, cap = (options["label_smoothing"], options["lse_square_scale"],
                    options["softcap"])
    edges = [0, *sorted(cuts), CLASSES]
    stats = torch.stack([TP._stats_cpu(x[:, a:b], t, w, a, CLASSES, -100, eps, cap)
                         for a, b in zip(edges, edges[1:])])
    if numpy_arrays:
        loss, lse, w_y = map(torch.from_numpy, parallel.combine_stats(
            stats.numpy(), t.numpy(), CLASSES, None if w is None else w.numpy(),
            label_smoothing=eps, lse_square_scale=zs))
    else:
        loss, lse, w_y = parallel.combine_stats(stats, t, CLASSES, w, label_smoothing=eps,
                                                lse_square_scale=zs)
    xg = x.clone().requires_grad_()
    want = _torch_loss(xg, t, w, eps, zs, cap, "none")
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12, equal_nan=True)
    counted = (t != -100) & (t < CLASSES)
    z = cap * torch.tanh(x / cap) if cap else x
    torch.testing.assert_close(lse[counted], torch.logsumexp(z, 1)[counted], rtol=1e-13,
                               atol=0)
    assert torch.equal(w_y == 0, t == -100)
    g = torch.rand(ROWS, dtype=torch.float64)
    want.backward(g)
    got = torch.cat([TP._grad_cpu(g, x[:, a:b], t, lse, w, a, CLASSES, -100, eps, zs, cap)
                     for a, b in zip(edges, edges[1:])], 1)
    expect = torch.where(((t < -100) | (t >= CLASSES))[:, None], float("nan"), xg.grad)
    torch.testing.assert_close(got, expect, rtol=1e-11, atol=1e-13, equal_nan=True)


def test_a_state_from_a_slice_without_the_target_holds_no_target_logit():
    x, t, _ = _case(0, {})
    y = int(t[0])
    inside = TP._stats_cpu(x[:, y:y + 1], t, None, y, CLASSES, -100, 0.0, 0.0)
    outside = TP._stats_cpu(x[:, :y], t, None, 0, CLASSES, -100, 0.0, 0.0)
    assert inside[0, 4] == x[0, y] and outside[0, 4] == 0
    assert inside[2, :5].tolist() == [float("-inf"), 0, 0, 0, 0]      # ignored: not read


# --- over processes (gloo) ---------------------------------------------------------------------

SPLITS = {2: [0, 6, 13], 3: [0, 4, 4, 13]}     # uneven, one rank with no classes
CASES = [dict(reduction="mean"), dict(reduction="sum", label_smoothing=0.1, weight=True),
         dict(reduction="none", softcap=4.0, lse_square_scale=1e-2),
         dict(reduction="mean", label_smoothing=0.2, weight=True, lse_square_scale=1e-3)]


def _worker(rank, world, path, results, compiled=False):
    import datetime
    import traceback

    import torch.distributed as dist

    failures = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        edges = SPLITS[world]
        a, b = edges[rank], edges[rank + 1]
        for case in CASES:
            case = dict(case)
            reduction = case.pop("reduction")
            x, t, w = _case(7, case)
            opts = dict(label_smoothing=case.get("label_smoothing", 0.0),
                        lse_square_scale=case.get("lse_square_scale", 0.0),
                        softcap=case.get("softcap", 0.0))
            mine = x[:, a:b].clone().requires_grad_()

            def call(v, y):
                return CF.vocab_parallel_cross_entropy(
                    v, y, dist.group.WORLD, class_offset=a, classes=CLASSES, weight=w,
                    reduction=reduction, **opts)

            if compiled:
                call = torch.compile(call, backend="aot_eager", fullgraph=True)
            loss = call(mine, t)
            xg = x.clone().requires_grad_()
            want = _torch_loss(xg, t, w, opts["label_smoothing"], opts["lse_square_scale"],
                               opts["softcap"], reduction)
            torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
            g = torch.rand(want.shape, dtype=torch.float64, generator=torch.Generator()
                           .manual_seed(3))
            loss.backward(g)
            want.backward(g)
            torch.testing.assert_close(mine.grad, xg.grad[:, a:b], rtol=1e-11, atol=1e-13)
        # data parallel: each rank its own rows, the whole vocabulary; the global mean
        x, t, _ = _case(11 + rank, {})
        t[: rank + 1] = -100                          # ranks count different numbers of rows
        mine = x.clone().requires_grad_()
        loss = CF.vocab_parallel_cross_entropy(mine, t, mean_group=dist.group.WORLD)
        xs, ts, _ = zip(*(_case(11 + r, {}) for r in range(world)))
        ts = [u.clone() for u in ts]
        for r, u in enumerate(ts):
            u[: r + 1] = -100
        xg = torch.cat(xs).requires_grad_()
        want = F.cross_entropy(xg, torch.cat(ts))
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
        loss.backward()
        want.backward()
        torch.testing.assert_close(mine.grad, xg.grad[rank * ROWS:(rank + 1) * ROWS],
                                   rtol=1e-12, atol=1e-15)
        _linear_case(rank, world, dist.group.WORLD, compiled)
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    finally:
        results.put((rank, failures))
        if dist.is_initialized():
            dist.destroy_process_group()


def _linear_case(rank, world, group, compiled=False):
    """The fused linear form: this rank's rows of W and b; the whole hidden gradient on every
    rank, its slices of the weight's and bias's, for a reduced loss (its gradients formed in
    forward) and 'none' (formed in backward from the rows' upstream gradient); compiled:
    linear_cross_entropy's op with the rank's slice, the collectives inside it."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(ROWS, 6, dtype=torch.float64, generator=g)
    w = torch.randn(CLASSES, 6, dtype=torch.float64, generator=g)
    b = torch.randn(CLASSES, dtype=torch.float64, generator=g)
    cw = torch.rand(CLASSES, dtype=torch.float64, generator=g) + 0.5
    t = torch.randint(0, CLASSES, (ROWS,), generator=g)
    t[3] = -100
    up = torch.rand(ROWS, dtype=torch.float64, generator=g)
    a, e = SPLITS[world][rank], SPLITS[world][rank + 1]
    for reduction in ("mean", "none"):
        mine = [h.clone().requires_grad_(), w[a:e].clone().requires_grad_(),
                b[a:e].clone().requires_grad_()]

        def call(hv, wv, bv, reduction=reduction):
            return CF.vocab_parallel_linear_cross_entropy(
                hv, wv, t, group, bias=bv, class_weight=cw, class_offset=a, classes=CLASSES,
                label_smoothing=0.1, lse_square_scale=1e-3, reduction=reduction)

        if compiled:
            call = torch.compile(call, backend="aot_eager", fullgraph=True)
        loss = call(*mine)
        whole = [v.clone().requires_grad_() for v in (h, w, b)]
        want = _torch_loss(F.linear(*whole), t, cw, 0.1, 1e-3, 0.0, reduction)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-15)
        upstream = up if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
        loss.backward(upstream)
        want.backward(upstream)
        torch.testing.assert_close(mine[0].grad, whole[0].grad, rtol=1e-11, atol=1e-14)
        torch.testing.assert_close(mine[1].grad, whole[1].grad[a:e], rtol=1e-11, atol=1e-14)
        torch.testing.assert_close(mine[2].grad, whole[2].grad[a:e], rtol=1e-11, atol=1e-14)
    # sequence parallelism: this rank's block of the rows; the loss of every rank's rows, the
    # block of their hidden gradient
    per = ROWS // world
    rows, mine_rows = per * world, slice(rank * per, (rank + 1) * per)
    for reduction in ("mean", "none"):
        mine = [h[mine_rows].clone().requires_grad_(), w[a:e].clone().requires_grad_()]

        def call(hv, wv, reduction=reduction):
            return CF.vocab_parallel_linear_cross_entropy(
                hv, wv, t[:rows].reshape(world, per), group, class_weight=cw, class_offset=a,
                classes=CLASSES, label_smoothing=0.1, reduction=reduction,
                sequence_parallel=True)

        if compiled:
            call = torch.compile(call, backend="aot_eager", fullgraph=True)
        loss = call(*mine)
        whole = [h[:rows].clone().requires_grad_(), w.clone().requires_grad_()]
        want = _torch_loss(F.linear(*whole), t[:rows], cw, 0.1, 0.0, 0.0, reduction)
        if reduction == "none":
            want = want.reshape(world, per)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-15)
        upstream = (up[:rows].reshape(world, per) if reduction == "none"
                    else torch.tensor(0.7, dtype=torch.float64))
        loss.backward(upstream)
        want.backward(upstream)
        torch.testing.assert_close(mine[0].grad, whole[0].grad[mine_rows], rtol=1e-11,
                                   atol=1e-14)
        torch.testing.assert_close(mine[1].grad, whole[1].grad[a:e], rtol=1e-11, atol=1e-14)
    with pytest.raises(ValueError, match="sequence_parallel: target holds every rank's rows"):
        CF.vocab_parallel_linear_cross_entropy(h[mine_rows], w[a:e], t[:rows - 1], group,
                                               class_offset=a, classes=CLASSES,
                                               sequence_parallel=True)


def _compiled_worker(rank, world, path, results):
    _worker(rank, world, path, results, compiled=True)


@pytest.mark.parametrize("world, compiled", [(2, False), (3, False), (2, True)],
                         ids=["2-ranks", "3-ranks", "2-ranks-compiled"])
def test_ranks_over_gloo_get_the_whole_logits_loss_and_their_gradient_slices(world, compiled):
    """Each rank's slice (uneven; one rank with none) gives the loss of the whole logits on
    every rank and its slice of the whole gradient, for every option and reduction, eager and
    under torch.compile(fullgraph=True); mean_group gives the global mean over ranks that count
    different numbers of rows; the fused linear form gives the whole hidden gradient and the
    rank's slices of the weight's and bias's, and with sequence_parallel the rank's block of
    the hidden gradient of every rank's rows."""
    failures = run_ranks(_compiled_worker if compiled else _worker, world, timeout=300)
    assert not failures, "\n".join(failures)


def test_bad_arguments_are_refused_before_any_work():
    x = torch.randn(4, 5)
    t = torch.randint(0, 5, (4,))
    with pytest.raises(ValueError, match="shape without its last"):
        CF.vocab_parallel_cross_entropy(x, t[:3])
    with pytest.raises(TypeError, match="int32 or int64"):
        CF.vocab_parallel_cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="together"):
        CF.vocab_parallel_cross_entropy(x, t, class_offset=5)
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        CF.vocab_parallel_cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="softcap must be 0"):
        CF.vocab_parallel_cross_entropy(x, t, softcap=-3.0)
    with pytest.raises(ValueError, match="label_smoothing must be between"):
        CF.vocab_parallel_cross_entropy(x, t, label_smoothing=2.0)
    with pytest.raises(ValueError, match="softcap must be 0"):
        CF.vocab_parallel_linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), t,
                                               softcap=float("nan"))
    with pytest.raises(ValueError, match="needs reduction"):
        CF.vocab_parallel_cross_entropy(x, t, reduction="none", mean_group=object())
    with pytest.raises(ValueError, match="lie outside the 8 classes"):
        CF.vocab_parallel_cross_entropy(x, t, class_offset=4, classes=8)
    with pytest.raises(ValueError, match="lie outside the 8 classes"):
        CF.vocab_parallel_linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), t,
                                               class_offset=-1, classes=8)


def test_one_rank_is_cross_entropy():
    x, t, w = _case(5, {"weight": True})
    xg = x.clone().requires_grad_()
    got = CF.vocab_parallel_cross_entropy(xg, t, weight=w, label_smoothing=0.1)
    np.testing.assert_allclose(got.item(), F.cross_entropy(x, t, weight=w,
                                                           label_smoothing=0.1).item(),
                               rtol=1e-13)


def _silent_worker(rank, world, path, results):
    if rank == 0:
        results.put((rank, ["rank 0: wrong"]))


def _stuck_worker(rank, world, path, results):
    if rank == 0:
        results.put((rank, []))
    else:
        time.sleep(600)


def test_the_rank_harness_reports_failures_and_silent_ranks_without_hanging():
    started = time.monotonic()
    failures = run_ranks(_silent_worker, 2, timeout=120)
    assert failures[0] == "rank 0: wrong" and "ranks [1] reported nothing" in failures[1]
    assert time.monotonic() - started < 100    # an exited rank is found without the limit
    started = time.monotonic()
    failures = run_ranks(_stuck_worker, 2, timeout=3)
    # rank 1 never reports; under load rank 0 may not have started within the limit either
    assert len(failures) == 1, failures
    assert re.match(r"ranks \[(0, )?1\] reported nothing", failures[0]), failures
    assert time.monotonic() - started < 60     # the stuck rank is killed, not waited for


# --- ranks that disagree (gloo) ----------------------------------------------------------------

def _disagree_worker(rank, world, path, results):
    """Two ranks given what a misconfigured job gives them: each must get NaN or an error on
    every rank, never a wrong loss, and never hang."""
    import datetime
    import traceback

    import torch.distributed as dist

    failures = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
        x, t, _ = _case(21, {})
        # (b) uneven slices and default offsets: the offsets follow the ranks' widths
        cut = 9
        a, b = (0, cut) if rank == 0 else (cut, CLASSES)
        mine = x[:, a:b].clone().requires_grad_()
        loss = CF.vocab_parallel_cross_entropy(mine, t, group)
        xg = x.clone().requires_grad_()
        want = F.cross_entropy(xg, t)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        loss.backward()
        want.backward()
        torch.testing.assert_close(mine.grad, xg.grad[:, a:b], rtol=1e-11, atol=1e-13)
        # (a) different targets on the two ranks: those rows NaN on both, the others right
        u = t.clone()
        if rank == 1:
            u[0] = (t[0] + 1) % CLASSES           # another class, in either slice
            u[3] = -100                          # ignored here only
        rows = CF.vocab_parallel_cross_entropy(x[:, a:b], u, group, reduction="none")
        want = F.cross_entropy(x, t, reduction="none")
        bad = torch.zeros(ROWS, dtype=torch.bool)
        bad[[0, 3]] = True
        assert torch.isnan(rows[bad]).all(), rows
        torch.testing.assert_close(rows[~bad], want[~bad], rtol=1e-12, atol=1e-12)
        assert torch.isnan(CF.vocab_parallel_cross_entropy(x[:, a:b], u, group))
        # overlapping slices (offsets given, both ranks hold class 8): its rows NaN
        lo, hi = (0, 9) if rank == 0 else (8, CLASSES)
        v = torch.full((ROWS,), 8)
        v[1] = 0
        rows = CF.vocab_parallel_cross_entropy(x[:, lo:hi], v, group, class_offset=lo,
                                               classes=CLASSES, reduction="none")
        assert torch.isnan(rows[[0, 2, 3]]).all() and not torch.isnan(rows[1])
        # (c) different row counts: an error on every rank, naming both, instead of a hang
        # (each rank's first call with its shape: a shape a rank has agreed on is not checked
        # again, _torch_parallel._agreed)
        n = ROWS - 1 if rank == 0 else ROWS - 2
        for call in (lambda: CF.vocab_parallel_cross_entropy(x[:n, a:b], t[:n], group),
                     lambda: CF.vocab_parallel_linear_cross_entropy(
                         torch.randn(n, 3, dtype=torch.float64),
                         torch.randn(b - a, 3, dtype=torch.float64), t[:n], group)):
            try:
                call()
            except ValueError as exc:
                assert "same rows" in str(exc) and f"{ROWS - 1} rows" in str(exc) and \
                    f"{ROWS - 2} rows" in str(exc), exc
            else:
                raise AssertionError("ranks with different row counts were not refused")
        # offsets given on one rank only: an error on both
        try:
            kw = dict(class_offset=a, classes=CLASSES) if rank == 0 else {}
            CF.vocab_parallel_cross_entropy(x[:5, a:b], t[:5], group, **kw)
        except ValueError as exc:
            assert "every rank or on none" in str(exc), exc
        else:
            raise AssertionError("offsets on one rank only were not refused")
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    finally:
        results.put((rank, failures))
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def test_ranks_that_disagree_get_nan_or_an_error_never_a_wrong_loss_or_a_hang():
    """(a) different targets, or a class two slices hold: NaN rows; (b) uneven slices with
    default offsets: the whole loss; (c) different row counts, offsets on one rank: ValueError
    on every rank."""
    failures = run_ranks(_disagree_worker, 2, timeout=240)
    assert not failures, "\n".join(failures)
