"""cupyloss: loss functions and their gradients as CUDA kernels on GPU arrays.

Names and arguments follow torch.nn.functional (torchvision.ops for sigmoid_focal_loss); every
loss ``f`` has ``f``, ``f_backward`` and ``f_value_and_grad``.  CuPy, torch, JAX and other
DLPack arrays go in without copies and come back in the caller's framework.
"""

from cupyloss.pointwise import (
    binary_cross_entropy, binary_cross_entropy_backward, binary_cross_entropy_value_and_grad,
    binary_cross_entropy_with_logits, binary_cross_entropy_with_logits_backward,
    binary_cross_entropy_with_logits_value_and_grad, gaussian_nll_loss,
    gaussian_nll_loss_backward, gaussian_nll_loss_value_and_grad, hinge_embedding_loss,
    hinge_embedding_loss_backward, hinge_embedding_loss_value_and_grad, hinge_loss,
    hinge_loss_backward, hinge_loss_value_and_grad, huber_loss, huber_loss_backward,
    huber_loss_value_and_grad, kl_div, kl_div_backward, kl_div_value_and_grad, l1_loss,
    l1_loss_backward, l1_loss_value_and_grad, log_cosh_loss, log_cosh_loss_backward,
    log_cosh_loss_value_and_grad, margin_ranking_loss, margin_ranking_loss_backward,
    margin_ranking_loss_value_and_grad, mse_loss, mse_loss_backward, mse_loss_value_and_grad,
    poisson_nll_loss, poisson_nll_loss_backward, poisson_nll_loss_value_and_grad,
    sigmoid_focal_loss, sigmoid_focal_loss_backward, sigmoid_focal_loss_value_and_grad,
    smooth_l1_loss, smooth_l1_loss_backward, smooth_l1_loss_value_and_grad, soft_margin_loss,
    soft_margin_loss_backward, soft_margin_loss_value_and_grad, squared_hinge_loss,
    squared_hinge_loss_backward, squared_hinge_loss_value_and_grad,)
from cupyloss.rowclass import (
    jsd, jsd_backward, jsd_value_and_grad, multi_margin_loss, multi_margin_loss_backward,
    multi_margin_loss_value_and_grad, multilabel_soft_margin_loss,
    multilabel_soft_margin_loss_backward, multilabel_soft_margin_loss_value_and_grad,)
from cupyloss.rowpair import (
    cosine_embedding_loss, cosine_embedding_loss_backward,
    cosine_embedding_loss_value_and_grad, triplet_margin_loss, triplet_margin_loss_backward,
    triplet_margin_loss_value_and_grad,)
from cupyloss.linear import (
    linear_cross_entropy, linear_cross_entropy_backward, linear_cross_entropy_value_and_grad,)
from cupyloss.rowwise import (
    cross_entropy, cross_entropy_backward, cross_entropy_value_and_grad, nll_loss,
    nll_loss_backward, nll_loss_value_and_grad, rejected_targets,)

__version__ = "0.1.0"

__all__ = [
    "binary_cross_entropy",
    "binary_cross_entropy_backward",
    "binary_cross_entropy_value_and_grad",
    "binary_cross_entropy_with_logits",
    "binary_cross_entropy_with_logits_backward",
    "binary_cross_entropy_with_logits_value_and_grad",
    "cosine_embedding_loss",
    "cosine_embedding_loss_backward",
    "cosine_embedding_loss_value_and_grad",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_value_and_grad",
    "gaussian_nll_loss",
    "gaussian_nll_loss_backward",
    "gaussian_nll_loss_value_and_grad",
    "hinge_embedding_loss",
    "hinge_embedding_loss_backward",
    "hinge_embedding_loss_value_and_grad",
    "hinge_loss",
    "hinge_loss_backward",
    "hinge_loss_value_and_grad",
    "huber_loss",
    "huber_loss_backward",
    "huber_loss_value_and_grad",
    "jsd",
    "jsd_backward",
    "jsd_value_and_grad",
    "kl_div",
    "kl_div_backward",
    "kl_div_value_and_grad",
    "l1_loss",
    "l1_loss_backward",
    "l1_loss_value_and_grad",
    "linear_cross_entropy",
    "linear_cross_entropy_backward",
    "linear_cross_entropy_value_and_grad",
    "log_cosh_loss",
    "log_cosh_loss_backward",
    "log_cosh_loss_value_and_grad",
    "margin_ranking_loss",
    "margin_ranking_loss_backward",
    "margin_ranking_loss_value_and_grad",
    "mse_loss",
    "mse_loss_backward",
    "mse_loss_value_and_grad",
    "multi_margin_loss",
    "multi_margin_loss_backward",
    "multi_margin_loss_value_and_grad",
    "multilabel_soft_margin_loss",
    "multilabel_soft_margin_loss_backward",
    "multilabel_soft_margin_loss_value_and_grad",
    "nll_loss",
    "nll_loss_backward",
    "nll_loss_value_and_grad",
    "poisson_nll_loss",
    "poisson_nll_loss_backward",
    "poisson_nll_loss_value_and_grad",
    "rejected_targets",
    "sigmoid_focal_loss",
    "sigmoid_focal_loss_backward",
    "sigmoid_focal_loss_value_and_grad",
    "smooth_l1_loss",
    "smooth_l1_loss_backward",
    "smooth_l1_loss_value_and_grad",
    "soft_margin_loss",
    "soft_margin_loss_backward",
    "soft_margin_loss_value_and_grad",
    "squared_hinge_loss",
    "squared_hinge_loss_backward",
    "squared_hinge_loss_value_and_grad",
    "triplet_margin_loss",
    "triplet_margin_loss_backward",
    "triplet_margin_loss_value_and_grad",
]
