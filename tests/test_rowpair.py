"""Host-side checks of the row-pair losses (triplet_margin_loss, cosine_embedding_loss): shapes and
options are refused with torch's wording before any launch.  No GPU needed: the checks run on
metadata alone, and torch on the CPU says what its wording is."""

import re

import pytest

from cupyloss.rowpair import _family as _rowpair

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

TRIPLET, COSINE = _rowpair.SPECS["triplet_margin_loss"], _rowpair.SPECS["cosine_embedding_loss"]


def _torch_message(f, *shapes, target=None, **kw):
    arrays = [torch.zeros(s) for s in shapes]
    if target is not None:
        arrays.append(torch.ones(target))
    with pytest.raises((RuntimeError, ValueError)) as info:
        f(*arrays, **kw)
    return str(info.value)


# (anchor, positive, negative) shapes torch refuses and cupyloss too
TRIPLET_BAD = [((3, 4), (3, 4), (4,)), ((3, 4), (3, 5), (3, 4)), ((3, 4), (3, 4), (2, 4)),
               ((5,), (6,), (5,)), ((2, 3, 4), (2, 3, 4), (2, 2, 4))]


@needs_torch
@pytest.mark.parametrize("shapes", TRIPLET_BAD, ids=str)
def test_triplet_shape_errors_are_torchs(shapes):
    want = _torch_message(F.triplet_margin_loss, *shapes)
    with pytest.raises(ValueError) as info:
        TRIPLET.check(list(shapes), None)
    assert str(info.value) == want


# (input1, input2, target) shapes torch refuses
COSINE_BAD = [((3, 4), (3, 4), (3, 1)), ((3,), (3,), (3,)), ((3, 4), (3, 4), ()),
              ((3, 4), (2, 4), (3,)), ((3, 4), (3, 4), (2,)), ((3, 4), (3, 5), (3,))]


@needs_torch
@pytest.mark.parametrize("shapes", COSINE_BAD, ids=str)
def test_cosine_shape_errors_are_torchs(shapes):
    x1, x2, t = shapes
    want = _torch_message(F.cosine_embedding_loss, x1, x2, target=t)
    with pytest.raises(ValueError) as info:
        COSINE.check([x1, x2], t)
    assert str(info.value) == want


def test_shapes_torch_would_broadcast_are_refused_saying_so():
    with pytest.raises(ValueError, match=r"size of tensor a \(3\) must match the size of tensor b "
                                         r"\(1\) at non-singleton dimension 0; cupyloss does not "
                                         r"broadcast"):
        TRIPLET.check([(3, 4), (1, 4), (3, 4)], None)


@pytest.mark.parametrize("shapes", [[(4,)] * 3, [(3, 4)] * 3, [(2, 3, 4)] * 3, [(0, 4)] * 3,
                                    [(3, 0)] * 3])
def test_triplet_shapes_torch_takes(shapes):
    TRIPLET.check(shapes, None)


@pytest.mark.parametrize("shapes, target", [([(4,)] * 2, ()), ([(3, 4)] * 2, (3,)),
                                            ([(0, 4)] * 2, (0,))])
def test_cosine_shapes_torch_takes(shapes, target):
    COSINE.check(shapes, target)


@needs_torch
@pytest.mark.parametrize("margin", [0.0, -1.0])
def test_triplet_margin_must_be_positive_as_in_torch(margin):
    want = _torch_message(F.triplet_margin_loss, (2, 3), (2, 3), (2, 3), margin=margin)
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        TRIPLET.parse(margin, 2.0, 1e-6, False)


@pytest.mark.parametrize("p", [0, -1, float("inf"), float("nan")])
def test_triplet_norm_degree_must_be_finite_and_positive(p):
    with pytest.raises(ValueError, match="finite norm degree p > 0"):
        TRIPLET.parse(1.0, p, 1e-6, False)


def test_options_as_the_kernel_takes_them():
    assert TRIPLET.parse(1, 2, 1e-6, True) == (1.0, 2.0, 1e-6, True)
    assert COSINE.parse(0.25) == (0.25, 2.0, 0.0, False)


def test_loss_shapes():
    assert TRIPLET.loss_shape((5, 7), "none") == (5,)
    assert TRIPLET.loss_shape((7,), "none") == ()
    assert TRIPLET.loss_shape((2, 5, 7), "none") == (2, 5)
    assert COSINE.loss_shape((5, 7), "mean") == ()


def test_row_geometry_merges_leading_dims():
    assert _rowpair._row_geometry((7,), (3,)) == (0, 3)
    assert _rowpair._row_geometry((5, 7), (7, 1)) == (7, 1)
    assert _rowpair._row_geometry((2, 5, 7), (35, 7, 1)) == (7, 1)
    assert _rowpair._row_geometry((2, 5, 7), (70, 7, 1)) is None      # rows do not merge
    assert _rowpair._row_geometry((5, 7), (1, 5)) == (1, 5)           # transposed: any strides
