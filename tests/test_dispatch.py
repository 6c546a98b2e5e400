"""The dispatch edge without a GPU: which arguments are refused, how, and before any launch.

Every error here is raised from an argument's type and metadata alone, so on a machine without a
CUDA device (CI) a wrong argument gives its TypeError or ValueError naming the argument, never a
CUDA error.  What needs a device (zero-copy exchange, streams, allocators) is in
test_dispatch_gpu.py.
"""

import functools
import subprocess
import sys

import numpy as np
import pytest

import cupyloss
from cupyloss.parallel import vocab_parallel_stats

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _calls(x, t):
    """(name, function, args, first) of every public entry point of cupyloss with x as its first
    array argument (named `first`: input, or input1) and t as every other required one."""
    from cupyloss._core.registry import all_losses

    for loss, spec in all_losses().items():
        arrays = (x,) + (t,) * (len(spec.arrays) - 1)
        first = spec.arrays[0]
        yield loss, getattr(cupyloss, loss), arrays, first
        yield loss + "_backward", getattr(cupyloss, loss + "_backward"), (1.0, *arrays), first
        yield (loss + "_value_and_grad", getattr(cupyloss, loss + "_value_and_grad"), arrays,
               first)
    # The fused linear cross entropy: hidden, weight, target.
    arrays = (x, t, t)
    yield "linear_cross_entropy", cupyloss.linear_cross_entropy, arrays, "hidden"
    yield ("linear_cross_entropy_backward", cupyloss.linear_cross_entropy_backward,
           (1.0, *arrays), "hidden")
    yield ("linear_cross_entropy_value_and_grad", cupyloss.linear_cross_entropy_value_and_grad,
           arrays, "hidden")
    yield "linear_log_probs", cupyloss.linear_log_probs, arrays, "hidden"
    yield ("linear_log_probs_backward", cupyloss.linear_log_probs_backward, (1.0, *arrays),
           "hidden")
    yield ("linear_log_probs_value_and_grad", cupyloss.linear_log_probs_value_and_grad, arrays,
           "hidden")
    # The post-training objectives: GRPO's (hidden, weight, target, advantages) and the
    # distillation's (student_hidden, student_weight, teacher_hidden, teacher_weight).
    yield "linear_grpo_loss", cupyloss.linear_grpo_loss, (x, t, t, t), "hidden"
    yield ("linear_grpo_loss_value_and_grad", cupyloss.linear_grpo_loss_value_and_grad,
           (x, t, t, t), "hidden")
    yield ("linear_preference_loss", functools.partial(cupyloss.linear_preference_loss, "dpo"),
           arrays, "hidden")
    yield ("linear_preference_loss_value_and_grad",
           functools.partial(cupyloss.linear_preference_loss_value_and_grad, "kto"), arrays,
           "hidden")
    yield "linear_jsd", cupyloss.linear_jsd, (x, t, t, t), "student_hidden"
    yield ("linear_jsd_value_and_grad", cupyloss.linear_jsd_value_and_grad, (x, t, t, t),
           "student_hidden")


def test_every_public_function_is_covered():
    names = {name for name, *_ in _calls(None, None)}
    assert names == set(cupyloss.__all__) - {"rejected_targets"}   # a counter, not a loss


def test_import_cupyloss_imports_no_framework():
    """The core never imports torch or JAX (nor CuPy until a call needs it)."""
    code = ("import sys, cupyloss, cupyloss.pointwise, cupyloss._core.dispatch; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


HOST_INPUTS = [
    pytest.param(lambda: (np.ones(3, np.float32), np.ones(3, np.float32)), id="numpy"),
    pytest.param(lambda: (np.float32(1.0), np.float32(1.0)), id="numpy-scalar"),
    pytest.param(lambda: ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]), id="list"),
    pytest.param(lambda: (1.0, 1.0), id="python-float"),
]


@pytest.mark.parametrize("make", HOST_INPUTS)
def test_host_arrays_are_rejected_with_a_hint(make):
    x, t = make()
    for name, function, args, first in _calls(x, t):
        with pytest.raises(TypeError, match=rf"^{first} is a .* in host memory") as info:
            function(*args)
        assert f"cupy.asarray({first})" in str(info.value), name


class _FakeDlpack:
    """An object that speaks DLPack from a given device type (1 = CPU, 2 = CUDA)."""

    def __init__(self, device_type):
        self.device_type = device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("dispatch must refuse this object before reading it")

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_dlpack_from_the_host_is_rejected():
    for name, function, args, first in _calls(_FakeDlpack(1), _FakeDlpack(1)):
        with pytest.raises(TypeError, match=rf"{first} is a .*_FakeDlpack in DLPack device "
                                            rf"type 1"):
            function(*args)


def test_objects_that_are_no_arrays_are_rejected():
    with pytest.raises(TypeError, match=r"target must be an array on a CUDA device.*object"):
        cupyloss.mse_loss(_FakeDlpack(2), object())


@needs_torch
def test_cpu_tensors_are_rejected_naming_the_argument():
    x = torch.ones(3)
    for name, function, args, first in _calls(x, x):
        with pytest.raises(TypeError, match=rf"^{first} is a torch.Tensor on cpu.*"
                                            rf"{first}\.cuda\(\)"):
            function(*args)


@needs_torch
def test_cpu_tensor_target_is_named():
    pytest.importorskip("cupy")
    # input from another framework: the frameworks differ before any device is touched.
    with pytest.raises(TypeError, match=r"input is a .*_FakeDlpack but target is a "
                                        r"torch\.Tensor; pass arrays of one framework"):
        cupyloss.mse_loss(_FakeDlpack(2), torch.ones(3))


@needs_torch
@pytest.mark.parametrize("call", [
    lambda a, b: cupyloss.cross_entropy(a, b),
    lambda a, b: cupyloss.multi_margin_loss(a, b),
    lambda a, b: cupyloss.jsd(a, b),
    lambda a, b: cupyloss.triplet_margin_loss(a, b, b),
    lambda a, b: cupyloss.linear_cross_entropy(a, b, b),
    lambda a, b: vocab_parallel_stats(a, b, 0, 3),
], ids=["rowwise", "rowclass", "rowclass-jsd", "rowpair", "linear", "parallel"])
def test_every_family_names_a_second_framework_before_reading(call):
    """Each family compares the arguments' frameworks before it reads any of them."""
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match=r" is a .*_FakeDlpack but \w+ is a torch\.Tensor; pass "
                                        r"arrays of one framework"):
        call(_FakeDlpack(2), torch.ones(3, dtype=torch.int64))


@needs_torch
def test_torch_without_cuda_is_refused_before_any_launch():
    """requires_grad, bf16, odd strides: on the CPU each is still refused by device, not read."""
    x = torch.ones(4, 3, dtype=torch.bfloat16, requires_grad=True).t()
    with pytest.raises(TypeError, match="on cpu"):
        cupyloss.mse_loss_value_and_grad(x, x)


def test_operands_on_two_devices_are_refused_naming_both():
    from cupyloss._core import dispatch as _dispatch, validate as _validate

    a = _dispatch.Operand(0, (3,), (1,), np.dtype(np.float32), 0, None)
    b = _dispatch.Operand(0, (3,), (1,), np.dtype(np.float32), 1, None)
    with pytest.raises(ValueError, match="input is on CUDA device 0 but target is on CUDA "
                                         "device 1"):
        _validate.check_same_device(a, b, "input", "target")
    _validate.check_same_device(a, a, "input", "target")


def test_unsupported_dtype_names_the_argument_and_the_supported_ones():
    from cupyloss._core import validate as _validate

    err = _validate.unsupported_dtype("target", "int64")
    assert isinstance(err, TypeError)
    assert str(err).startswith("target has dtype int64; cupyloss supports float16")


def test_given_region_hands_out_results_in_declared_order_then_scratch():
    """A Region (how cupyloss.jax fills XLA's buffers): each result takes the first unclaimed
    buffer of its shape and dtype; pieces of scratch start on ALIGN-byte boundaries."""
    from cupyloss._core import dispatch as _dispatch

    f32 = np.dtype(np.float32)
    outs = [np.empty((), f32), np.empty((4, 5), f32), np.empty((4, 5), f32)]
    region = _dispatch.Region(outs, base=4096, size=1000, device=0)
    assert region.take((4, 5), f32) is outs[1]
    assert region.take((), np.dtype(np.float64)) is None          # a dtype of none of them
    assert region.take((4, 5), f32) is outs[2]
    assert region.take((4, 5), f32) is None                       # both taken
    assert region.take((), f32) is outs[0]
    align = _dispatch.ALIGN
    assert _dispatch.carve(0, 10) == (0, 10)
    assert _dispatch.carve(10, 5) == (align, align + 5)
    assert _dispatch.carve(align, 0) == (align, align)
    assert _dispatch.carve(align + 1, 8) == (2 * align, 2 * align + 8)
