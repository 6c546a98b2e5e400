"""num_items on CPU tensors (torch's operations) and its checks, which every path makes before
any launch: the loss is the summed loss over num_items, for 'mean' and 'sum' alike."""

import pytest

torch = pytest.importorskip("torch")
import cupyloss.torch as T  # noqa: E402

F = torch.nn.functional


def _data():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(12, 6, dtype=torch.float64, generator=gen)
    w = torch.randn(9, 6, dtype=torch.float64, generator=gen)
    t = torch.randint(0, 9, (12,), generator=gen)
    t[::4] = -100
    return h, w, t


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("items", [30, "tensor"])
def test_cpu_losses_divide_the_sum_by_num_items(reduction, items):
    h, w, t = _data()
    n = 30 if items == 30 else torch.tensor(30)
    z = (h @ w.T).requires_grad_()
    want = F.cross_entropy(z, t, reduction="sum") / 30
    got = T.cross_entropy(z, t, reduction=reduction, num_items=n)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    nll = T.nll_loss(z.log_softmax(1), t, reduction=reduction, num_items=n)
    torch.testing.assert_close(nll, want, rtol=1e-14, atol=0)
    (g,) = torch.autograd.grad(got, z)
    (g_want,) = torch.autograd.grad(want, z)
    torch.testing.assert_close(g, g_want, rtol=1e-15, atol=0)
    par = T.vocab_parallel_cross_entropy(z, t, reduction=reduction, num_items=n)
    torch.testing.assert_close(par, want, rtol=1e-14, atol=0)


def test_cpu_fused_head_takes_num_items_eager_and_compiled():
    h, w, t = _data()
    want = F.cross_entropy((h.float() @ w.float().T), t, reduction="sum") / 30
    got = T.linear_cross_entropy(h, w, t, num_items=30)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    compiled = torch.compile(lambda a, b, c: T.linear_cross_entropy(a, b, c, num_items=30))
    torch.testing.assert_close(compiled(h, w, t), want, rtol=1e-6, atol=0)
    par = T.vocab_parallel_linear_cross_entropy(h, w, t, num_items=torch.tensor(30))
    torch.testing.assert_close(par, want.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("items, error, match", [
    (30.0, TypeError, "must be an int"), (True, TypeError, "must be an int"),
    (-3, ValueError, "0 or more"), ("30", TypeError, "must be an int"),
    (torch.tensor(3.0), TypeError, "must be an int")])
def test_num_items_of_the_wrong_kind_is_refused(items, error, match):
    h, w, t = _data()
    z = h @ w.T
    for call in (lambda: T.cross_entropy(z, t, num_items=items),
                 lambda: T.linear_cross_entropy(h, w, t, num_items=items),
                 lambda: T.vocab_parallel_cross_entropy(z, t, num_items=items)):
        with pytest.raises(error, match=match):
            call()
    with pytest.raises(ValueError, match="reduction='none'"):
        T.cross_entropy(z, t, reduction="none", num_items=4)
