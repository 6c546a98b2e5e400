"""cupyloss: loss functions and their gradients as CUDA kernels on CuPy arrays.

Names and arguments follow torch.nn.functional; every loss ``f`` has ``f``, ``f_backward`` and
``f_value_and_grad``.  Torch tensors cross over without copies through cupyloss.interop.
"""

from cupyloss.pointwise import (
    hinge_loss,
    hinge_loss_backward,
    hinge_loss_value_and_grad,
    kl_div,
    kl_div_backward,
    kl_div_value_and_grad,
    mse_loss,
    mse_loss_backward,
    mse_loss_value_and_grad,
)
from cupyloss.rowwise import (
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_value_and_grad,
    nll_loss,
    nll_loss_backward,
    nll_loss_value_and_grad,
)

__version__ = "0.1.0"

__all__ = [
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_value_and_grad",
    "hinge_loss",
    "hinge_loss_backward",
    "hinge_loss_value_and_grad",
    "kl_div",
    "kl_div_backward",
    "kl_div_value_and_grad",
    "mse_loss",
    "mse_loss_backward",
    "mse_loss_value_and_grad",
    "nll_loss",
    "nll_loss_backward",
    "nll_loss_value_and_grad",
]
