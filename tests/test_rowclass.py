"""The rowclass family without a GPU: argument checks (torch's wording, raised from metadata before
any launch), the registry entries and the layout helpers of cupyloss/rowclass/_family.py."""

import types

import numpy as np
import pytest

from cupyloss.rowclass import _family as _rowclass
from cupyloss._core.registry import all_losses

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
        _rowclass._check_multi_margin(_op(x_shape), _op(t_shape, I64), True, p,
                                      None if w is None else _op(w_shape))
    assert str(info.value) == want


def test_multi_margin_accepts_torchs_shapes():
    for x_shape, t_shape in [((3, 4), (3,)), ((4,), ()), ((4,), (1,)), ((1, 4), ()), ((), ()),
                             ((), (1,)), ((0, 4), (0,))]:
        _rowclass._check_multi_margin(_op(x_shape), _op(t_shape, I64), True, 2, None)
    with pytest.raises(TypeError, match="needs class indices \\(int32 or int64\\)"):
        _rowclass._check_multi_margin(_op((3, 4)), _op((3,)), False, 1, None)


def test_paired_checks():
    spec = _rowclass.SPECS["jsd"]
    _rowclass._check_paired(spec, _op((2, 3, 5)), _op((2, 3, 5)), False)
    with pytest.raises(ValueError, match="0-d input"):
        _rowclass._check_paired(spec, _op(()), _op(()), False)
    with pytest.raises(TypeError, match="floating target"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((2,), I64), True)
    with pytest.raises(TypeError, match="input has dtype float32 but target has dtype float64"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((2, 5), np.float64), False)
    with pytest.raises(ValueError, match="target of the input's shape \\(2, 5\\), got \\(5,\\)"):
        _rowclass._check_paired(spec, _op((2, 5)), _op((5,)), False)


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
