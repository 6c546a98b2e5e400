"""Gradient accumulation with num_items: micro-batches whose losses divide by the count of every
micro-batch's counted rows give, added up, the gradient of the whole batch's 'mean'.

Bitwise in float64: the rows' gradients are formed by the same kernels with the same scale
(1 / count), and the fused head's weight gradient is summed over its row chunks in the order the
micro-batches' gradients are added when a micro-batch is one chunk.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

N, C, MICRO = 512, 3000, 4


def _batch(seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    x = cupy.asarray(rng.standard_normal((N, C)))
    t = rng.integers(0, C, N)
    t[rng.random(N) < 0.2] = -100
    return x, cupy.asarray(t)


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("items", ["int", "int64", "int32"])
def test_micro_batches_add_up_to_the_batch_bitwise(loss, items):
    import cupy

    import cupyloss

    x, t = _batch()
    fn = getattr(cupyloss, loss + "_value_and_grad")
    whole, g_whole = fn(x, t)
    count = int((t != -100).sum())
    n = {"int": count, "int64": cupy.asarray(count, cupy.int64),
         "int32": cupy.asarray(count, cupy.int32)}[items]
    m = N // MICRO
    parts = [fn(x[i:i + m], t[i:i + m], num_items=n) for i in range(0, N, m)]
    g = cupy.concatenate([p[1] for p in parts])
    assert cupy.array_equal(g, g_whole)
    total = sum(float(p[0]) for p in parts)
    assert total == pytest.approx(float(whole), rel=1e-14)
    # 'sum' takes it the same way, and the loss alone too
    assert float(getattr(cupyloss, loss)(x[:m], t[:m], reduction="sum", num_items=n)) == \
        float(parts[0][0])


@pytest.mark.parametrize("items", ["int", "device"])
def test_fused_head_micro_batches_add_up_to_the_batch_bitwise(items):
    import cupy

    import cupyloss
    from cupyloss import linear

    rng = np.random.default_rng(1)
    rows, h, v = 4 * 256, 64, 2000
    x = cupy.asarray(rng.standard_normal((rows, h)) * 0.5)
    w = cupy.asarray(rng.standard_normal((v, h)) * 0.5)
    t = rng.integers(0, v, rows)
    t[::5] = -100
    t = cupy.asarray(t)
    chunk = 256
    budget = chunk * v * 8       # float64 logits of 256-row chunks
    assert linear.plan(rows, v, h, 8, budget).rows == chunk
    whole, (gx, gw) = cupyloss.linear_cross_entropy_value_and_grad(
        x, w, t, max_workspace_bytes=budget)
    count = int((t != -100).sum())
    n = count if items == "int" else cupy.asarray(count)
    gxs, acc = [], None
    for i in range(0, rows, chunk):
        _, (gxi, gwi) = cupyloss.linear_cross_entropy_value_and_grad(
            x[i:i + chunk], w, t[i:i + chunk], num_items=n, max_workspace_bytes=budget)
        gxs.append(gxi)
        acc = gwi if acc is None else acc + gwi
    assert cupy.array_equal(cupy.concatenate(gxs), gx)
    assert cupy.array_equal(acc, gw)


def test_torch_accumulation_matches_one_batch():
    """cupyloss.torch with autograd: four backward passes into .grad equal one batch's."""
    torch = pytest.importorskip("torch")
    import cupyloss.torch as T

    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, 64, device="cuda", dtype=torch.float64, generator=gen)
    w = torch.randn(C, 64, device="cuda", dtype=torch.float64, generator=gen)
    t = torch.randint(0, C, (N,), device="cuda", generator=gen)
    t[::3] = -100
    logits = (h @ w.T).requires_grad_()
    T.cross_entropy(logits, t).backward()
    whole = logits.grad.clone()
    logits.grad = None
    count = (t != -100).sum()                      # a CUDA tensor: never read back
    m = N // MICRO
    for i in range(0, N, m):
        T.cross_entropy(logits[i:i + m], t[i:i + m], num_items=count).backward()
    assert torch.equal(logits.grad, whole)
