"""The rowclass family without a GPU: argument checks (torch's wording, raised from metadata before
any launch), the registry entries and the layout helpers of cupyloss/rowclass/_family.py."""

import types

import numpy as np
import pytest

from cupyloss.rowclass import _family as _rowclass
from cupyloss._core.registry import all_losses

_MM, _MLM = _rowclass.SPECS["multi_margin_loss"], _rowclass.SPECS["multilabel_margin_loss"]

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)


def _op(shape, dtype=F32):
    """What the checks read of an Operand: shape and dtype."""
    return types.SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))


def _torch_message(call):
    with pytest.raises((RuntimeError, ValueError)) as info:
        call()
    return str(info.value)


@needs_torch
@pytest.mark.parametrize("x_shape, t_shape, p, w_shape", [
    ((3, 4), (2,), 1, None),          # too few targets
    ((3, 4), (1, 3), 1, None),        # a 2-d target
    ((4,), (1, 1), 1, None),          # a (C,) input with a 2-d target
    ((2, 0), (2,), 1, None),          # no classes
    ((2, 3, 4), (2,), 1, None),       # 3-d input
    ((3, 4), (3,), 3, None),          # p
    ((3, 4), (3,), 1, (3,)),          # a weight per class, of the wrong size
    ((3, 4), (3,), 1, (2, 2)),        # a 2-d weight
])
def test_multi_margin_errors_have_torchs_wording(x_shape, t_shape, p, w_shape):
    x = torch.zeros(x_shape)
    t = torch.zeros(t_shape, dtype=torch.int64)
    w = None if w_shape is None else torch.ones(w_shape)
    want = _torch_message(lambda: F.multi_margin_loss(x, t, p=p, weight=w))
    if want.startswith("inconsistent target size"):
        pytest.skip(f"torch {torch.__version__} words the target-size check as older releases "
                    f"did; cupyloss follows the current wording")
    with pytest.raises(ValueError) as info:
        _rowclass._check_multi_margin(_MM, _op(x_shape), _op(t_shape, I64), True, p,
                                      None if w is None else _op(w_shape))
    assert str(info.value) == want


def test_multi_margin_accepts_torchs_shapes():
    for x_shape, t_shape in [((3, 4), (3,)), ((4,), ()), ((4,), (1,)), ((1, 4), ()), ((), ()),
                             ((), (1,)), ((0, 4), (0,))]:
        _rowclass._check_multi_margin(_MM, _op(x_shape), _op(t_shape, I64), True, 2, None)
    with pytest.raises(TypeError, match="needs class indices \\(int32 or int64\\)"):
        _rowclass._check_multi_margin(_MM, _op((3, 4)), _op((3,)), False, 1, None)


def test_paired_checks():
    spec = _rowclass.SPECS["jsd"]
    _rowclass._check_paired(spec, _op((2, 3, 5)), _op((2, 3, 5)), False, 1, None)
    with pytest.raises(ValueError, match="0-d input"):
        _rowclass._check_paired(spec, _op(()), _op(()), False, 1, None)
    with pytest.raises(TypeError, match="floating target"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((2,), I64), True, 1, None)
    with pytest.raises(TypeError, match="input has dtype float32 but target has dtype float64"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((2, 5), np.float64), False, 1, None)
    with pytest.raises(ValueError, match="target of the input's shape \\(2, 5\\), got \\(5,\\)"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((5,)), False, 1, None)


def test_registry_entries():
    losses = all_losses()
    for name in ("multi_margin_loss", "multilabel_soft_margin_loss", "jsd"):
        spec = losses[name]
        assert spec is _rowclass.SPECS[name] and spec.arrays == ("input", "target")
        assert spec.reductions == ("none", "mean", "sum")
        assert spec.loss_shape((8, 10), "none") == (8,)
        assert spec.loss_shape((2, 3, 10), "none") == (2, 3)
        assert spec.loss_shape((10,), "none") == () == spec.loss_shape((8, 10), "mean")
    assert losses["jsd"].module_name == "JSDLoss"


@pytest.mark.parametrize("shape, strides, want", [
    ((), (), 0),
    ((5,), (1,), 0),
    ((4, 5), (5, 1), 5),
    ((4, 5), (21, 1), 21),            # a row-strided slice
    ((4, 5), (1, 4), None),           # transposed: classes not contiguous
    ((2, 3, 5), (15, 5, 1), 5),       # leading dims merge
    ((2, 3, 5), (40, 5, 1), None),    # ... or do not
    ((4, 1), (1, 7), 1),              # one class: its stride does not matter
])
def test_row_strides(shape, strides, want):
    assert _rowclass._row_strides(shape, strides) == want


def test_multilabel_margin_reference_is_torchs_on_its_own_samples():
    """The float64 reference of multilabel_margin_loss against torch's CPU kernel, on torch's
    OpInfo samples (torch's test suite, which needs expecttest) and on rows with repeated
    indices, ties, junk after the -1 and no -1 at all."""
    torch = pytest.importorskip("torch")
    import numpy as np

    import reference_rowwise as ref

    F = torch.nn.functional
    cases = []
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError:
        pass
    else:
        op = next(o for o in op_db if o.name == "nn.functional.multilabel_margin_loss")
        cases += [(s.input.detach(), s.args[0], s.kwargs.get("reduction", "mean"))
                  for s in op.sample_inputs("cpu", torch.float64)]
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.5, -0.5, 1.5, 0.25, 2.0],
                      [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
    y = torch.tensor([[1, 1, -1, 0, 0], [0, 2, -1, 4, 1], [4, 3, 2, 1, 0]])
    cases += [(x, y, r) for r in ("none", "mean", "sum")]
    assert len(cases) >= 3
    for inp, tgt, reduction in cases:
        leaf = inp.clone().requires_grad_(True)
        want = F.multilabel_margin_loss(leaf, tgt, reduction=reduction)
        up = torch.rand_like(want)
        want.backward(up)
        got = ref.multilabel_margin_loss(inp.numpy(), tgt.numpy(), reduction)
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-12)
        grads = ref.multilabel_margin_loss_grads(inp.numpy(), tgt.numpy(), reduction,
                                                 up.numpy())
        np.testing.assert_allclose(grads, leaf.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_shape, t_shape", [((3, 5), (3, 4)), ((2, 3, 5), (2, 3, 5)),
                                              ((3, 0), (3, 0)), ((1, 5), (5,)), ((5,), (4,))])
def test_multilabel_margin_errors_have_torchs_wording(x_shape, t_shape):
    torch = pytest.importorskip("torch")
    x, t = torch.zeros(x_shape), torch.zeros(t_shape, dtype=torch.long)
    want = _torch_message(lambda: torch.nn.functional.multilabel_margin_loss(x, t))
    with pytest.raises(ValueError) as got:
        _rowclass._check_multilabel_margin(_MLM, _op(x_shape), _op(t_shape, I64), True, 1, None)
    assert str(got.value) == want


def test_multilabel_margin_accepts_torchs_shapes():
    for x_shape, t_shape in (((), ()), ((), (1,)), ((5,), (5,)), ((0, 5), (0, 5)),
                             ((3, 5), (3, 5))):
        _rowclass._check_multilabel_margin(_MLM, _op(x_shape), _op(t_shape, I64), True, 1,
                                           None)
    with pytest.raises(TypeError, match="class indices"):
        _rowclass._check_multilabel_margin(_MLM, _op((3, 4)), _op((3, 4)), False, 1, None)
