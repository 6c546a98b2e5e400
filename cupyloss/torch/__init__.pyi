"""Type stub of cupyloss.torch (written by python -m cupyloss.tools.stubs; do not edit:
the functions and classes are built from the loss registry at import)."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    'BCELoss',
    'BCEWithLogitsLoss',
    'CTCLoss',
    'CosineEmbeddingLoss',
    'CrossEntropyLoss',
    'GaussianNLLLoss',
    'HingeEmbeddingLoss',
    'HingeLoss',
    'HuberLoss',
    'JSDLoss',
    'KLDivLoss',
    'L1Loss',
    'LOSSES',
    'LinearCrossEntropyLoss',
    'LogCoshLoss',
    'MODULES',
    'MSELoss',
    'MarginRankingLoss',
    'MultiLabelMarginLoss',
    'MultiLabelSoftMarginLoss',
    'MultiMarginLoss',
    'NLLLoss',
    'PoissonNLLLoss',
    'SKIPPED',
    'SigmoidFocalLoss',
    'SmoothL1Loss',
    'SoftMarginLoss',
    'SquaredHingeLoss',
    'TripletMarginLoss',
    'VocabParallelCrossEntropyLoss',
    'binary_cross_entropy',
    'binary_cross_entropy_with_logits',
    'cosine_embedding_loss',
    'cross_entropy',
    'ctc_loss',
    'gaussian_nll_loss',
    'gradients_in_forward',
    'hinge_embedding_loss',
    'hinge_loss',
    'huber_loss',
    'jsd',
    'kl_div',
    'l1_loss',
    'linear_cpo_loss',
    'linear_cross_entropy',
    'linear_dpo_loss',
    'linear_grpo_loss',
    'linear_jsd',
    'linear_kto_loss',
    'linear_log_probs',
    'linear_orpo_loss',
    'linear_simpo_loss',
    'log_cosh_loss',
    'margin_ranking_loss',
    'mse_loss',
    'multi_margin_loss',
    'multilabel_margin_loss',
    'multilabel_soft_margin_loss',
    'nll_loss',
    'poisson_nll_loss',
    'scale_by_grad_output',
    'sigmoid_focal_loss',
    'smooth_l1_loss',
    'soft_margin_loss',
    'squared_hinge_loss',
    'triplet_margin_loss',
    'vocab_parallel_cross_entropy',
    'vocab_parallel_linear_cross_entropy',
]

class BCELoss(torch.nn.Module):
    def __init__(
        self, weight: Tensor | None = None, size_average: bool | None = None,
        reduce: bool | None = None, reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class BCEWithLogitsLoss(torch.nn.Module):
    def __init__(
        self, weight: Tensor | None = None, size_average: bool | None = None,
        reduce: bool | None = None, reduction: str = 'mean', pos_weight: Tensor | None = None,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class CTCLoss(torch.nn.Module):
    def __init__(
        self, blank: int = 0, reduction: str = 'mean', zero_infinity: bool = False,
    ) -> None: ...
    def forward(
        self, log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
    ) -> Tensor: ...

class CosineEmbeddingLoss(torch.nn.Module):
    def __init__(
        self, margin: float = 0, size_average: bool | None = None, reduce: bool | None = None,
        reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input1: Tensor, input2: Tensor, target: Tensor) -> Tensor: ...

class CrossEntropyLoss(torch.nn.Module):
    def __init__(
        self, weight: Tensor | None = None, size_average: bool | None = None,
        ignore_index: int = -100, reduce: bool | None = None, reduction: str = 'mean',
        label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float = 0.0,
        check_targets: bool = False, num_items: Tensor | int | None = None,
        inplace_backward: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class GaussianNLLLoss(torch.nn.Module):
    def __init__(
        self, full: bool = False, eps: float = 1e-06, reduction: str = 'mean',
        check_var: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor, var: Tensor) -> Tensor: ...

class HingeEmbeddingLoss(torch.nn.Module):
    def __init__(
        self, margin: float = 1.0, size_average: bool | None = None, reduce: bool | None = None,
        reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class HingeLoss(torch.nn.Module):
    def __init__(self, margin: float = 1.0, reduction: str = 'mean') -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class HuberLoss(torch.nn.Module):
    def __init__(
        self, reduction: str = 'mean', delta: float = 1.0, weight: Tensor | None = None,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class JSDLoss(torch.nn.Module):
    def __init__(
        self, beta: float = 0.5, shift_labels: Tensor | None = None, ignore_index: int = -100,
        reduction: str = 'mean', inplace_backward: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class KLDivLoss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        log_target: bool = False, log_input: bool = True,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class L1Loss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        weight: Tensor | None = None,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

LOSSES: dict[str, Callable[..., Tensor]]

class LinearCrossEntropyLoss(torch.nn.Module):
    def __init__(
        self, class_weight: Tensor | None = None, ignore_index: int = -100, reduction: str = 'mean',
        label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0, softcap: float = 0.0,
        max_workspace_bytes: int | None = None,
    ) -> None: ...
    def forward(
        self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
        num_items: Tensor | int | None = None,
    ) -> Tensor: ...

class LogCoshLoss(torch.nn.Module):
    def __init__(self, reduction: str = 'mean') -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

MODULES: dict[str, type[torch.nn.Module]]

class MSELoss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        weight: Tensor | None = None,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class MarginRankingLoss(torch.nn.Module):
    def __init__(
        self, margin: float = 0, size_average: bool | None = None, reduce: bool | None = None,
        reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input1: Tensor, input2: Tensor, target: Tensor) -> Tensor: ...

class MultiLabelMarginLoss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        check_targets: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class MultiLabelSoftMarginLoss(torch.nn.Module):
    def __init__(
        self, weight: Tensor | None = None, size_average: bool | None = None,
        reduce: bool | None = None, reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class MultiMarginLoss(torch.nn.Module):
    def __init__(
        self, p: float = 1, margin: float = 1.0, weight: Tensor | None = None,
        size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        check_targets: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class NLLLoss(torch.nn.Module):
    def __init__(
        self, weight: Tensor | None = None, size_average: bool | None = None,
        ignore_index: int = -100, reduce: bool | None = None, reduction: str = 'mean',
        check_targets: bool = False, num_items: Tensor | int | None = None,
        inplace_backward: bool = False,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class PoissonNLLLoss(torch.nn.Module):
    def __init__(
        self, log_input: bool = True, full: bool = False, size_average: bool | None = None,
        eps: float = 1e-08, reduce: bool | None = None, reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

SKIPPED: dict[str, str]

class SigmoidFocalLoss(torch.nn.Module):
    def __init__(
        self, alpha: float = 0.25, gamma: float = 2.0, reduction: str = 'none',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class SmoothL1Loss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
        beta: float = 1.0,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class SoftMarginLoss(torch.nn.Module):
    def __init__(
        self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class SquaredHingeLoss(torch.nn.Module):
    def __init__(self, margin: float = 1.0, reduction: str = 'mean') -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

class TripletMarginLoss(torch.nn.Module):
    def __init__(
        self, margin: float = 1.0, p: float = 2, eps: float = 1e-06, swap: bool = False,
        size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
    ) -> None: ...
    def forward(self, anchor: Tensor, positive: Tensor, negative: Tensor) -> Tensor: ...

class VocabParallelCrossEntropyLoss(torch.nn.Module):
    def __init__(
        self, group: Any = None, *, class_offset: int | None = None, classes: int | None = None,
        weight: Tensor | None = None, ignore_index: int = -100, reduction: str = 'mean',
        label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float = 0.0,
        mean_group: Any = None,
    ) -> None: ...
    def forward(self, input: Tensor, target: Tensor) -> Tensor: ...

def binary_cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def binary_cross_entropy_with_logits(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = 'mean', pos_weight: Tensor | None = None,
) -> Tensor: ...

def cosine_embedding_loss(
    input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0,
    size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    ignore_index: int = -100, reduce: bool | None = None, reduction: str = 'mean',
    label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0, softcap: float = 0.0,
    check_targets: bool = False, num_items: Tensor | int | None = None,
    inplace_backward: bool = False,
) -> Tensor: ...

def ctc_loss(
    log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
    blank: int = 0, reduction: str = 'mean', zero_infinity: bool = False,
) -> Tensor: ...

def gaussian_nll_loss(
    input: Tensor, target: Tensor, var: Tensor, full: bool = False, eps: float = 1e-06,
    reduction: str = 'mean', *, check_var: bool = False,
) -> Tensor: ...

gradients_in_forward: bool

def hinge_embedding_loss(
    input: Tensor, target: Tensor, margin: float = 1.0, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def hinge_loss(
    input: Tensor, target: Tensor, margin: float = 1.0, reduction: str = 'mean',
) -> Tensor: ...

def huber_loss(
    input: Tensor, target: Tensor, reduction: str = 'mean', delta: float = 1.0,
    weight: Tensor | None = None,
) -> Tensor: ...

def jsd(
    input: Tensor, target: Tensor, beta: float = 0.5, shift_labels: Tensor | None = None,
    ignore_index: int = -100, reduction: str = 'mean', *, inplace_backward: bool = False,
) -> Tensor: ...

def kl_div(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean', log_target: bool = False, *, log_input: bool = True,
) -> Tensor: ...

def l1_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean', weight: Tensor | None = None,
) -> Tensor: ...

def linear_cpo_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
    beta: float = 0.1, alpha: float = 1.0, loss_type: str = 'sigmoid', label_smoothing: float = 0.0,
    ignore_index: int = -100, max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
    class_weight: Tensor | None = None, ignore_index: int = -100, reduction: str = 'mean',
    label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0, softcap: float = 0.0,
    max_workspace_bytes: int | None = None, check_targets: bool = False,
    num_items: Tensor | int | None = None,
) -> Tensor: ...

def linear_dpo_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
    ref_log_probs: Tensor | None = None, ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None, ref_bias: Tensor | None = None, beta: float = 0.1,
    loss_type: str = 'sigmoid', label_smoothing: float = 0.0, ignore_index: int = -100,
    max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_grpo_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, advantages: Tensor, bias: Tensor | None = None,
    *, mask: Tensor | None = None, old_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None, loss_type: str = 'dapo', epsilon_low: float = 0.2,
    epsilon_high: float | None = None, beta: float = 0.0, entropy_weight: float = 0.0,
    temperature: float = 1.0, max_completion_length: int | None = None,
    num_items: Tensor | int | None = None, ignore_index: int = -100,
    max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_jsd(
    student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
    target: Tensor | None = None, *, student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
    hard_weight: float = 0.0, ignore_index: int = -100, max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_kto_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, desirable: Tensor, bias: Tensor | None = None,
    *, ref_log_probs: Tensor | None = None, ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None, ref_bias: Tensor | None = None, kl: Tensor | None = None,
    beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
    ignore_index: int = -100, max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_log_probs(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
    temperature: float = 1.0, return_entropy: bool = False, ignore_index: int = -100,
    max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_orpo_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
    beta: float = 0.1, ignore_index: int = -100, max_workspace_bytes: int | None = None,
) -> Tensor: ...

def linear_simpo_loss(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
    beta: float = 0.1, gamma: float = 0.5, alpha: float = 0.0, label_smoothing: float = 0.0,
    ignore_index: int = -100, max_workspace_bytes: int | None = None,
) -> Tensor: ...

def log_cosh_loss(input: Tensor, target: Tensor, reduction: str = 'mean') -> Tensor: ...

def margin_ranking_loss(
    input1: Tensor, input2: Tensor, target: Tensor, margin: float = 0,
    size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def mse_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean', weight: Tensor | None = None,
) -> Tensor: ...

def multi_margin_loss(
    input: Tensor, target: Tensor, p: float = 1, margin: float = 1.0, weight: Tensor | None = None,
    size_average: bool | None = None, reduce: bool | None = None, reduction: str = 'mean', *,
    check_targets: bool = False,
) -> Tensor: ...

def multilabel_margin_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean', *, check_targets: bool = False,
) -> Tensor: ...

def multilabel_soft_margin_loss(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def nll_loss(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    ignore_index: int = -100, reduce: bool | None = None, reduction: str = 'mean', *,
    check_targets: bool = False, num_items: Tensor | int | None = None,
    inplace_backward: bool = False,
) -> Tensor: ...

def poisson_nll_loss(
    input: Tensor, target: Tensor, log_input: bool = True, full: bool = False,
    size_average: bool | None = None, eps: float = 1e-08, reduce: bool | None = None,
    reduction: str = 'mean',
) -> Tensor: ...

def scale_by_grad_output(grad_output: Tensor, a: Tensor, b: Tensor | None = None) -> None: ...

def sigmoid_focal_loss(
    input: Tensor, target: Tensor, alpha: float = 0.25, gamma: float = 2.0, reduction: str = 'none',
) -> Tensor: ...

def smooth_l1_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean', beta: float = 1.0,
) -> Tensor: ...

def soft_margin_loss(
    input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
    reduction: str = 'mean',
) -> Tensor: ...

def squared_hinge_loss(
    input: Tensor, target: Tensor, margin: float = 1.0, reduction: str = 'mean',
) -> Tensor: ...

def triplet_margin_loss(
    anchor: Tensor, positive: Tensor, negative: Tensor, margin: float = 1.0, p: float = 2,
    eps: float = 1e-06, swap: bool = False, size_average: bool | None = None,
    reduce: bool | None = None, reduction: str = 'mean',
) -> Tensor: ...

def vocab_parallel_cross_entropy(
    input: Tensor, target: Tensor, group: Any = None, *, class_offset: int | None = None,
    classes: int | None = None, weight: Tensor | None = None, ignore_index: int = -100,
    reduction: str = 'mean', label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
    softcap: float = 0.0, mean_group: Any = None, check_targets: bool = False,
    num_items: Tensor | int | None = None,
) -> Tensor: ...

def vocab_parallel_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, group: Any = None, *,
    bias: Tensor | None = None, class_weight: Tensor | None = None, class_offset: int | None = None,
    classes: int | None = None, ignore_index: int = -100, reduction: str = 'mean',
    label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float = 0.0,
    max_workspace_bytes: int | None = None, check_targets: bool = False,
    sequence_parallel: bool = False, num_items: Tensor | int | None = None,
) -> Tensor: ...
