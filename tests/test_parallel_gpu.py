"""Vocab-parallel cross entropy on several GPUs (NCCL): each rank's slice against the single-GPU
cross_entropy of the whole logits on that rank's GPU, the same loss on every rank, eager, under
torch.compile(fullgraph=True) and replayed from a CUDA graph.  One GPU: the kernels' statistics
and slice gradients against the rows kernel, without a collective."""

import datetime
import sys
import time
import traceback

import pytest

from ranks import run_ranks

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

ROWS, CLASSES = 300, 5000
SPLITS = {2: [0, 1900, 5000], 4: [0, 1250, 1251, 3000, 5000]}   # uneven, one of one class
CASES = [dict(reduction="mean"),
         dict(reduction="sum", label_smoothing=0.1, weight=True),
         dict(reduction="none", softcap=20.0, lse_square_scale=1e-3),
         dict(reduction="mean", label_smoothing=0.2, weight=True, lse_square_scale=1e-4)]
# the loss and gradient are float32 sums in a different order than the rows kernel's, rounded
# to the dtype once: one rounding of the dtype apart at most
RTOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _inputs(dtype, case, device):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(ROWS, CLASSES, generator=g) * 4).to(dtype)
    t = torch.randint(0, CLASSES, (ROWS,), generator=g)
    t[::9] = -100
    w = (torch.rand(CLASSES, generator=g) + 0.5).to(dtype) if case.get("weight") else None
    return x.to(device), t.to(device), None if w is None else w.to(device)


def _single(x, t, w, reduction, opts, go):
    import cupyloss.torch as CF

    xg = x.clone().requires_grad_()
    loss = CF.cross_entropy(xg, t, w, reduction=reduction, **opts)
    loss.backward(go)
    return loss.detach(), xg.grad


def _progress(rank, what, start=time.monotonic()):
    """A line on stderr as each rank passes a stage (seen with pytest -s): where a stuck run
    stopped."""
    print(f"rank {rank} {time.monotonic() - start:7.1f} s: {what}", file=sys.stderr, flush=True)


def _worker(rank, world, path, results):
    import torch.distributed as dist

    import cupyloss.torch as CF

    failures, graph = [], None
    _progress(rank, "started")
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank),
                                timeout=datetime.timedelta(seconds=120))
        a, b = SPLITS[world][rank], SPLITS[world][rank + 1]
        group = dist.group.WORLD
        for dtype in (torch.float32, torch.bfloat16):
            for case in CASES:
                case = dict(case)
                reduction = case.pop("reduction")
                x, t, w = _inputs(dtype, case, "cuda")
                opts = {k: v for k, v in case.items() if k != "weight"}
                go = (torch.rand(ROWS, generator=torch.Generator().manual_seed(2)).to(dtype)
                      .cuda() if reduction == "none" else torch.tensor(0.7, dtype=dtype).cuda())
                want, want_grad = _single(x, t, w, reduction, opts, go)

                def call(v, y, reduction=reduction, opts=opts, w=w):
                    return CF.vocab_parallel_cross_entropy(
                        v, y, group, class_offset=a, classes=CLASSES, weight=w,
                        reduction=reduction, **opts)

                _progress(rank, f"{dtype} {reduction} {case}")
                # compiled: one case a dtype (each is an Inductor compile in every process)
                for mode in ("eager", "compiled") if case.get("weight") else ("eager",):
                    f = call if mode == "eager" else torch.compile(call, fullgraph=True)
                    mine = x[:, a:b].clone().requires_grad_()
                    loss = f(mine, t)
                    loss.backward(go)
                    tag = f"{dtype} {reduction} {case} {mode}"
                    every = [torch.empty_like(loss) for _ in range(world)]
                    dist.all_gather(every, loss.detach())
                    if not all(torch.equal(e, every[0]) for e in every):
                        failures.append(f"{tag}: ranks differ")
                    rtol = RTOL[dtype]
                    if not torch.allclose(loss.float(), want.float(), rtol=rtol, atol=1e-6):
                        err = (loss.float() - want.float()).abs().max().item()
                        failures.append(f"{tag}: loss off by {err}")
                    ref = want_grad[:, a:b].float()
                    err = (mine.grad.float() - ref).abs().max().item() if b > a else 0.0
                    if err > rtol * max(ref.abs().max().item(), 1e-30) + 1e-12:
                        failures.append(f"{tag}: gradient off by {err}")
        failures += _mean_group_case(rank, world, group)
        _progress(rank, "fused linear")
        failures += _linear_case(rank, world, a, b, group)
        _progress(rank, "CUDA graph")
        # a training step captured in a CUDA graph replays as eager
        x, t, _ = _inputs(torch.bfloat16, {}, "cuda")
        mine = x[:, a:b].clone().requires_grad_()

        def step():
            mine.grad = None
            loss = CF.vocab_parallel_cross_entropy(mine, t, group, class_offset=a,
                                                   classes=CLASSES, label_smoothing=0.1)
            loss.backward()
            return loss

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                want = step().detach().clone()
        torch.cuda.current_stream().wait_stream(stream)
        want_grad = mine.grad.clone()
        graph = torch.cuda.CUDAGraph()
        mine.grad = None
        with torch.cuda.graph(graph):
            got = step()
        with torch.no_grad():
            mine.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        if not (torch.equal(got, want) and torch.equal(mine.grad, want_grad)):
            failures.append("CUDA graph replay differs from eager")
    except Exception:
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    finally:
        _progress(rank, f"reporting {len(failures)} failures")
        results.put((rank, failures))
        if graph is not None:
            graph.reset()           # the captured collectives go before their communicator
        if dist.is_initialized():
            dist.destroy_process_group()
        _progress(rank, "done")


def _mean_group_case(rank, world, group):
    """Data parallelism: each rank its own rows of the whole vocabulary, different numbers of
    them ignored; mean_group gives the mean over every rank's counted rows and its gradient."""
    import cupyloss.torch as CF

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        xs, ts = [], []
        for r in range(world):
            x, t, _ = _inputs(dtype, {}, "cuda")
            x = x.roll(r, 0)
            t = t.roll(r, 0).clone()
            t[: 3 * (r + 1)] = -100
            xs.append(x)
            ts.append(t)
        want, want_grad = _single(torch.cat(xs), torch.cat(ts), None, "mean", {},
                                  torch.tensor(1.0, dtype=dtype, device="cuda"))
        mine = xs[rank].clone().requires_grad_()
        loss = CF.vocab_parallel_cross_entropy(mine, ts[rank], mean_group=group)
        loss.backward()
        rtol = RTOL[dtype]
        if not torch.allclose(loss.float(), want.float(), rtol=rtol, atol=1e-6):
            failures.append(f"rank {rank} mean_group {dtype}: loss {float(loss)} vs {float(want)}")
        ref = want_grad[rank * ROWS:(rank + 1) * ROWS].float()
        err = (mine.grad.float() - ref).abs().max().item()
        if err > rtol * ref.abs().max().item() + 1e-12:
            failures.append(f"rank {rank} mean_group {dtype}: gradient off by {err}")
    return failures


# the fused linear form: float32 logits from the same operands, so its loss matches to float32
# sums; gradients as test_linear_gpu's TOL_GRAD (16-bit dZ rounded once)
LINEAR_TOL = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (2e-6, 1.6e-2)}


def _linear_inputs(dtype, device, classes=CLASSES, rows=ROWS, width=64):
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(rows, width, generator=g) * 0.5).to(dtype).to(device)
    w = (torch.randn(classes, width, generator=g) * 0.5).to(dtype).to(device)
    b = (torch.randn(classes, generator=g) * 0.1).to(dtype).to(device)
    cw = (torch.rand(classes, generator=g) + 0.5).to(dtype).to(device)
    t = torch.randint(0, classes, (rows,), generator=g).to(device)
    t[::7] = -100
    return h, w, b, cw, t


def _linear_compare(got, want, dtype, tag):
    """got, want: (loss, grads...); the failures."""
    out = []
    tol_loss, tol_grad = LINEAR_TOL[dtype]
    if not torch.allclose(got[0], want[0], rtol=tol_loss, atol=1e-6):
        out.append(f"{tag}: loss {float(got[0])} vs {float(want[0])}")
    for name, g, w in zip(("hidden", "weight", "bias"), got[1:], want[1:]):
        err = (g.float() - w.float()).abs().max().item() if w.numel() else 0.0
        if err > tol_grad * max(w.float().abs().max().item(), 1e-30):
            out.append(f"{tag}: {name} gradient off by {err}")
    return out


def _linear_run(f, h, w, b, t):
    hl, wl, bl = (v.clone().requires_grad_() for v in (h, w, b))
    loss = f(hl, wl, bl, t)
    loss.backward()
    return loss.detach(), hl.grad, wl.grad, bl.grad


def _linear_case(rank, world, a, e, group):
    import cupyloss.torch as CF

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for budget in (None, 300_000):            # the default plan, and class slices
            h, w, b, cw, t = _linear_inputs(dtype, "cuda")
            opts = dict(label_smoothing=0.1, lse_square_scale=1e-4, max_workspace_bytes=budget)
            want = _linear_run(lambda *v: CF.linear_cross_entropy(
                v[0], v[1], v[3], v[2], cw, **opts), h, w, b, t)
            want = (want[0], want[1], want[2][a:e], want[3][a:e])

            def call(*v, opts=opts, cw=cw):
                return CF.vocab_parallel_linear_cross_entropy(
                    v[0], v[1], v[3], group, bias=v[2], class_weight=cw, class_offset=a,
                    classes=CLASSES, **opts)

            # compiled: linear_cross_entropy's op with the rank's slice (the default budget)
            for mode in ("eager", "compiled") if budget is None else ("eager",):
                f = call if mode == "eager" else torch.compile(call, fullgraph=True)
                got = _linear_run(f, h, w[a:e], b[a:e], t)
                failures += _linear_compare(
                    got, want, dtype, f"rank {rank}/{world} linear {dtype} budget {budget} "
                    f"{mode}")
    # sequence parallelism: this rank's block of the rows, the loss of all of them (a float32
    # reduce-scatter of the hidden gradient eager, the op's all-reduce cut to the block compiled)
    per = ROWS // world
    block = slice(rank * per, (rank + 1) * per)
    for dtype in (torch.float32, torch.bfloat16):
        h, w, b, cw, t = _linear_inputs(dtype, "cuda")
        opts = dict(label_smoothing=0.1, lse_square_scale=1e-4)
        want = _linear_run(lambda *v: CF.linear_cross_entropy(
            v[0], v[1], v[3], v[2], cw, **opts), h, w, b, t)
        want = (want[0], want[1][block], want[2][a:e], want[3][a:e])

        def split(*v, opts=opts, cw=cw):
            return CF.vocab_parallel_linear_cross_entropy(
                v[0], v[1], v[3], group, bias=v[2], class_weight=cw, class_offset=a,
                classes=CLASSES, sequence_parallel=True, **opts)

        for mode in ("eager", "compiled"):
            f = split if mode == "eager" else torch.compile(split, fullgraph=True)
            got = _linear_run(f, h[block], w[a:e], b[a:e], t)
            failures += _linear_compare(got, want, dtype,
                                        f"rank {rank}/{world} sequence-parallel {dtype} {mode}")
    return failures


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_over_nccl_match_one_gpu_cross_entropy(world):
    """On `world` GPUs: every rank gets the single-GPU loss of the whole logits (the same bits
    on every rank) and its slice of the single-GPU gradient, float32 and bfloat16, every option,
    eager (and compiled, for the cases with class weights); mean_group gives the global mean of
    ranks that count different numbers of rows; the fused linear form (also sequence
    parallel); a captured step replays bitwise as eager."""
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpus()}")
    failures = run_ranks(_worker, world, timeout=300)
    assert not failures, "\n".join(failures)



def test_slice_statistics_merge_to_the_rows_kernels_lse_on_one_gpu():
    """cross_entropy_slice_stats over uneven slices (an empty one among them), combined, give
    the rows kernel's per-row loss and lse; the slice gradients from that lse its gradient."""
    import cupy
    import numpy as np

    import cupyloss
    from cupyloss import parallel

    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((64, 3000)) * 3, np.float32)
    t = cupy.asarray(rng.integers(0, 3000, 64))
    t[::5] = -100
    w = cupy.asarray(rng.random(3000) + 0.5, np.float32)
    opts = dict(label_smoothing=0.1, softcap=15.0)
    loss, gx, lse = cupyloss.cross_entropy_value_and_grad(x, t, w, reduction="none",
                                                          return_lse=True, **opts)
    edges = [0, 700, 700, 2999, 3000]
    stats = cupy.stack([parallel.vocab_parallel_stats(cupy.ascontiguousarray(x[:, p:q]), t, p,
                                                      3000, w, **opts)
                        for p, q in zip(edges, edges[1:])])
    got, got_lse, _ = parallel.combine_stats(stats, t, 3000, w, label_smoothing=0.1)
    counted = cupy.asnumpy(t != -100)
    np.testing.assert_allclose(cupy.asnumpy(got), cupy.asnumpy(loss), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(cupy.asnumpy(got_lse)[counted], cupy.asnumpy(lse)[counted],
                               rtol=1e-6)
    ones = cupy.ones(64, np.float32)
    parts = [parallel.vocab_parallel_backward(ones, cupy.ascontiguousarray(x[:, p:q]), t,
                                              got_lse, p, 3000, w, **opts)
             for p, q in zip(edges, edges[1:])]
    np.testing.assert_allclose(cupy.asnumpy(cupy.concatenate(parts, 1)), cupy.asnumpy(gx),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_linear_shard_path_on_one_gpu_is_the_fused_loss(dtype):
    """vocab_parallel_linear_cross_entropy without a group (the statistics, their combination
    and the slice gradient in every chunk) gives linear_cross_entropy's loss and gradients,
    with every plan's chunks and slices."""
    import cupyloss.torch as CF

    failures = []
    for budget in (None, 300_000, 1):
        h, w, b, cw, t = _linear_inputs(dtype, "cuda")
        opts = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0,
                    max_workspace_bytes=budget)
        want = _linear_run(lambda *v: CF.linear_cross_entropy(v[0], v[1], v[3], v[2], cw,
                                                              **opts), h, w, b, t)
        got = _linear_run(lambda *v: CF.vocab_parallel_linear_cross_entropy(
            v[0], v[1], v[3], None, bias=v[2], class_weight=cw, **opts), h, w, b, t)
        failures += _linear_compare(got, want, dtype, f"budget {budget}")
    assert not failures, "\n".join(failures)
