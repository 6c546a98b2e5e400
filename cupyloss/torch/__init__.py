"""torch autograd for every cupyloss loss: torch.nn.functional's signatures, nn.Module classes.

    import cupyloss.torch as CF
    loss = CF.kl_div(model(x).log_softmax(-1), q, reduction="batchmean"); loss.backward()
    crit = CF.MSELoss(); crit(pred, y).backward()
    step = torch.compile(lambda x, y: CF.mse_loss(model(x), y), fullgraph=True)

Everything here is generated from cupyloss's registry of every family
(`cupyloss._core.registry.all_losses()`: the pointwise losses and the row-wise cross_entropy and
nll_loss) and the signatures of the core functions when this module is imported, so a loss
registered later needs no code here.  A registered loss that cannot be wrapped (its entry lacks
`arrays` or `reductions`, an option's default has no torch schema type) is left out with a
RuntimeWarning and its reason in ``cupyloss.torch.SKIPPED``.  For each loss ``f``:

  ``cupyloss.torch.f``      a function with torch.nn.functional.f's signature when torch has
                            ``f`` (``size_average``/``reduce`` mapped to a reduction as torch
                            maps them; a torch argument cupyloss lacks, such as mse_loss's
                            ``weight`` in recent torch, is accepted at its default and refused
                            otherwise; cupyloss-only options such as kl_div's ``log_input`` are
                            keyword-only), else the core function's signature.
  a module class            named as torch names it (``MSELoss``, ``KLDivLoss``); for a loss
                            torch lacks, the CamelCase of its name with "Loss" appended
                            (hinge_loss -> ``HingeLoss``).
  ``torch.ops.cupyloss.f``  the forward op (-> loss, token) and ``torch.ops.cupyloss.f_backward``
                            the backward op (grad_output, token, the forward's arguments ->
                            gradients), made with torch.library.custom_op, with register_autograd
                            and register_fake: torch.compile(fullgraph=True) traces through the
                            loss without a graph break and torch.library.opcheck passes.

Which path the gradients take (the upstream gradient g is what backward receives):

  reduction      forward                             first backward               later ones
  mean, sum,     one pass: the loss and the          g * grads, in place, by a    rerun with
  batchmean      gradients of the arguments that     kernel that reads g on the   upstream 1,
                 require grad (value_and_grad)       device and returns at once   then scaled
                                                     when g == 1 (plain           alike (same
                                                     loss.backward()): no         bits as the
                                                     gradient byte is touched     first)
  none           the loss alone                      rerun: f_backward with the elementwise g

"rerun" is the gradient kernel run again on the saved arguments; "later ones" are further
backward passes through a graph kept with retain_graph=True (the in-place scaling has used up the
saved gradients).  Why 'none' reruns: g is then a tensor of the loss's shape, so every gradient
element must be read and written whatever its value; recomputing from input and target costs
the same reads and writes as scaling saved gradients and holds no gradients between forward and
backward.  The forward pass writes the gradients of a reduced loss whenever grad mode is on and an
argument requires grad, so an evaluation run with grad enabled but no backward pays for them (use
torch.no_grad()), and they occupy memory until backward.  Each trade-off can be turned off with
``gradients_in_forward = False``, which makes every reduction take the rerun path: that is also
the faster choice when g is rarely 1 (a loss scaled before backward, as AMP's GradScaler and
gradient accumulation do), since scaling saved gradients reads and writes them once more.

Eager calls run through a torch.autograd.Function that calls the same kernels and the same
backward formula as the ops: custom_op's Python layers (an autograd.Function of its own, a
redispatch, argument normalisation) cost more host time than a small loss's kernels.  Anything
that traces (torch.compile, torch.export, opcheck, fake or functional tensors) goes through the
ops, with the same paths: the forward op returns the loss and a one-byte token, and holds the
gradients it formed for that token (not as outputs: a compiled backward could only scale a
forward output into a second buffer); the backward op takes them and scales them in place (or
forms them, when the token holds none or a retained graph's first backward took them), so a
compiled training step holds one gradient buffer and touches it only when g != 1, as eager
does.  The backward takes them through ``torch.ops.cupyloss.held_gradients``, which needs none
of the loss's arguments, so a compiled graph frees those after its forward pass (as eager
frees nothing it does not need); a second backward through a retained compiled graph is refused
by name (gradients_in_forward = False makes each backward form them again).  Held gradients are
dropped with their token.  create_graph=True gives
first-order gradients through the rerun path, but differentiating them again raises: the
backward ops have no derivatives of their own.  torch.func transforms (grad, vmap) are refused
with NotImplementedError.

Speed and host time against torch eager and torch.compile: docs/performance.md ("Inside
torch.compile and autocast").

CUDA tensors take the kernels: one floating dtype (float16, bfloat16, float32, float64) on one
device; unlike torch, a mixed-dtype pair is refused, not promoted.  Under CUDA autocast the
losses torch's autocast runs in float32 (_AUTOCAST_FP32) return what torch returns: a float32
loss, gradients in the arguments' dtypes.  cross_entropy and nll_loss read 16-bit logits as they
are (float32 accumulation, the loss and grad_output in float32: no float32 copy of the
logits), eager and compiled; the others take float32 copies as torch does;
binary_cross_entropy is refused as torch refuses it; losses torch lacks run in the dtype they
are given.  ``inplace_backward=True`` (the losses whose value_and_grad writes in place:
cross_entropy, nll_loss, jsd) writes the input's gradient into the input's buffer in the forward
pass, as Liger-Kernel does: no gradient buffer at all.  The input's version counter is bumped,
so a node that saved the input raises at its backward instead of reading the gradient; a leaf
that requires grad and reduction='none' are refused; the loss has one plain backward.  Under
torch.compile it is an op declared as mutating the input, so Inductor writes into the input's
own buffer where nothing later reads it, and refuses (as eager does) where a node saved it; its
backward is grad_output times the saved input.  On CPU tensors the out-of-place path runs (the
same numbers).  CPU tensors take
torch's own operations
(cupyloss.torch._forms: torch.nn.functional's loss where torch has it, with cupyloss's extra
options formed around it, else the loss's formula; gradients by torch.autograd), so code written
with cupyloss.torch runs unchanged on a machine without a GPU, with torch's semantics there
(dtype promotion, and no target gradient for binary_cross_entropy and soft_margin_loss).
Gradients go only to the tensor arguments that require grad.  Inputs are never written.  Works under torch.cuda.graph capture once a warm-up call has run on
the device (kernels load and the engine allocates its per-device state outside the capture).
This module imports torch; ``import cupyloss`` never imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
import warnings
import weakref

try:
    import torch
except ImportError as exc:
    raise ImportError(f"cupyloss.torch needs PyTorch, which is not installed "
                      f"({exc}): pip install 'cupyloss[torch]'") from exc

import cupyloss
from cupyloss._core import (
    args as _args, dtypes as _dtypes, launch as _launch, plans as _plans,
    reduction as _reduction, source as _source, validate as _validate)
from cupyloss.torch import _amp as _torch_autocast
from cupyloss._core.registry import all_losses, unwrappable

# Compute the gradients of a reduced loss in the forward pass (see the module docstring).
gradients_in_forward = True

_NAMESPACE = "cupyloss"
_LEGACY = ("size_average", "reduce")
_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "Tensor?"}

# Every registered loss of every family (cupyloss._core.registry.all_losses).
SPECS = all_losses()


# --- the work behind the ops ------------------------------------------------------------------

class _Kernels:
    """What the ops run: cupyloss's public functions and the in-place scaling kernel."""

    def __init__(self):
        self._functions = {}     # loss name -> (f, f_value_and_grad, f_backward)

    def _core(self, name):
        functions = self._functions.get(name)
        if functions is None:
            functions = self._functions[name] = tuple(
                getattr(cupyloss, name + suffix) for suffix in ("", "_value_and_grad",
                                                                "_backward"))
        return functions

    def value(self, name, arrays, reduction, options):
        """The loss alone."""
        if "_wide" in options:
            return self._wide(name, arrays, reduction, options, (), 1.0)[0]
        return self._core(name)[0](*arrays, reduction=reduction, **options)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        """(loss, gradients of the names in wrt, in wrt's order), from one pass."""
        if "_wide" in options:
            value, gx, gt, _ = self._wide(name, arrays, reduction, options, wrt, 1.0)
            return value, tuple(gx if w == "input" else gt for w in wrt)
        return self._core(name)[1](*arrays, reduction=reduction, wrt=wrt, **options)

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        """Gradients of the names in wrt with upstream grad_output."""
        if "_wide" in options:
            _, gx, gt, _ = self._wide(name, arrays, reduction, options, wrt, grad_output,
                                      want_value=False)
            return tuple(gx if w == "input" else gt for w in wrt)
        return self._core(name)[2](grad_output, *arrays, reduction=reduction, wrt=wrt, **options)

    @staticmethod
    def _wide(name, arrays, reduction, options, wrt, grad_output, want_value=True):
        """A row-wise loss on 16-bit logits with its value (and grad_output) in float32: what
        torch's autocast returns, without its float32 copy of the logits (_autocast)."""
        from cupyloss.rowwise import _family as _rowwise

        kwargs = {k: v for k, v in options.items()
                  if k not in ("_wide", "weight", "check_targets")}
        return _rowwise.evaluate(_rowwise.SPECS[name], arrays[0], arrays[1],
                                 options.get("weight"), reduction=reduction,
                                 check=options.get("check_targets", False),
                                 want_value=want_value, wrt=wrt, grad_output=grad_output,
                                 acc_io=True, **kwargs)

    def scale(self, grad_output, grads):
        """grads[k] *= grad_output[()] in place, on the device; nothing is touched if it is 1
        (a float32 grad_output of 16-bit gradients, under autocast, rounded to theirs first)."""
        if grads and grads[0].dtype != grad_output.dtype:
            grad_output = grad_output.to(grads[0].dtype)
        for k in range(0, len(grads), 2):
            _scale(grad_output, grads[k:k + 2])


class _TorchForms:
    """What the ops run on CPU tensors: each loss in torch's own operations
    (cupyloss.torch._forms), its gradients by torch.autograd."""

    @staticmethod
    def _run(name, arrays, reduction, options, wrt, grad_output):
        from cupyloss.torch import _forms as _torch_forms

        names = SPECS[name].arrays
        leaves = [a.detach().requires_grad_(n in wrt) if a.is_floating_point() else a
                  for a, n in zip(arrays, names)]
        with torch.enable_grad():
            value = _torch_forms.loss(name, leaves, reduction, options)
            picked = [leaves[names.index(w)] for w in wrt]
            if not picked:
                return value.detach(), ()
            upstream = torch.as_tensor(grad_output, dtype=value.dtype).expand_as(value)
            grads = torch.autograd.grad(value, picked, upstream, allow_unused=True)
        return value.detach(), tuple(torch.zeros_like(p) if g is None else g
                                     for g, p in zip(grads, picked))

    def value(self, name, arrays, reduction, options):
        from cupyloss.torch import _forms as _torch_forms

        with torch.no_grad():
            return _torch_forms.loss(name, arrays, reduction, options)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        return self._run(name, arrays, reduction, options, wrt, 1.0)

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        return self._run(name, arrays, reduction, options, wrt, grad_output)[1]

    def scale(self, grad_output, grads):
        for g in grads:
            g.mul_(grad_output)


class _ByDevice:
    """The ops' engine: the kernels for CUDA tensors, torch's own operations for CPU ones (so
    code written for cupyloss.torch runs unchanged on a machine without a GPU)."""

    def __init__(self):
        self.cuda, self.cpu = _Kernels(), _TorchForms()

    def _of(self, arrays):
        return self.cpu if arrays and arrays[0].device.type == "cpu" else self.cuda

    def value(self, name, arrays, reduction, options):
        return self._of(arrays).value(name, arrays, reduction, options)

    def value_and_grad(self, name, arrays, reduction, options, wrt):
        return self._of(arrays).value_and_grad(name, arrays, reduction, options, wrt)

    def backward(self, name, grad_output, arrays, reduction, options, wrt):
        return self._of(arrays).backward(name, grad_output, arrays, reduction, options, wrt)

    def scale(self, grad_output, grads):
        self._of(grads).scale(grad_output, grads)


# Swapped by the CPU tests for an engine written in torch ops, to exercise the autograd wiring.
_engine = _ByDevice()


_SCALE_PLANS = _plans.Plans()
# scale_by_grad_output's parameters, read from its declaration in kernels/scale.cu
SCALE = _args.Layout(_source.kernel_words("scale.cu", "scale_by_grad_output"))
_TORCH_DTYPES: dict = {}


def _dtype_info(dtype):
    if not _TORCH_DTYPES:
        for info in _dtypes.DTYPES.values():
            _TORCH_DTYPES[getattr(torch, info.dtype.name)] = info
    info = _TORCH_DTYPES.get(dtype)
    if info is None:
        raise _validate.unsupported_dtype("grad_output", dtype)
    return info


def _scale_plan(device, dtype, vec, n):
    """(CUfunction, grid, block) of scale_by_grad_output for n elements; cached."""
    key = (device, dtype, vec, n)
    plan = _SCALE_PLANS.get(key)
    if plan is None:
        import cupy

        info = _dtype_info(dtype)
        with cupy.cuda.Device(device):
            function = _source.function("scale.cu", _source.scale_name(info.ctype, vec))
            cfg = _launch.flat_launch(n, vec, _launch.device_limits(device))
        plan = _SCALE_PLANS[key] = (SCALE.bind(function.kernel.ptr), cfg.grid, cfg.block)
    return plan


def scale_by_grad_output(grad_output, a, b=None):
    """Multiply gradients a and b in place by the 0-d tensor grad_output, read on the device.

    ``a *= g; b *= g`` with ``g = grad_output[()]``, in one launch on torch's current stream.
    The kernel (kernels/scale.cu) reads g first and returns when ``g == 1``, touching neither
    gradient, so the backward of a plain ``loss.backward()`` costs one launch and no memory
    traffic; the host never reads g.  Each element is scaled in the accumulator type (float32
    for 16-bit gradients) and rounded once.

    Args:
      grad_output: 0-d CUDA tensor, the upstream gradient of a 0-d loss.
      a, b: contiguous CUDA tensors of grad_output's dtype and device (b may be None); float16,
        bfloat16, float32 or float64; any shapes.

    Returns:
      None; a and b hold the scaled values.

    Example:
      >>> loss, g = cupyloss.mse_loss_value_and_grad(x, y, wrt="input")
      >>> cupyloss.torch.scale_by_grad_output(torch.tensor(0.5, device="cuda"), g)  # g *= 0.5
    """
    if not isinstance(grad_output, torch.Tensor) or grad_output.dim() != 0:
        raise ValueError(f"grad_output must be a 0-d torch.Tensor, got "
                         f"{getattr(grad_output, 'shape', type(grad_output).__name__)}")
    grads = [g for g in (a, b) if g is not None]
    for name, g in zip(("a", "b"), grads):
        if not isinstance(g, torch.Tensor) or not g.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor, got {type(g).__name__} on "
                            f"{getattr(g, 'device', 'the host')}")
        if g.dtype != grad_output.dtype:
            raise TypeError(f"{name} has dtype {g.dtype} but grad_output has dtype "
                            f"{grad_output.dtype}")
        if g.device != grad_output.device:
            raise ValueError(f"{name} is on {g.device} but grad_output is on "
                             f"{grad_output.device}")
        if not g.is_contiguous():
            raise ValueError(f"{name} of shape {tuple(g.shape)} and strides {g.stride()} is not "
                             f"contiguous")
    _dtype_info(grad_output.dtype)
    _scale(grad_output, grads)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)
_cupy = None


def _scale(grad_output, grads) -> None:
    """scale_by_grad_output for up to two checked gradients: one launch (none if all empty)."""
    global _cupy
    if _cupy is None:
        import cupy as _cupy
    a = na = b = nb = 0
    for g in grads:
        n = g.numel()
        if n:
            if na:
                b, nb = g.data_ptr(), n
            else:
                a, na = g.data_ptr(), n
    if not na:
        return
    device = grad_output.get_device()
    dtype = grad_output.dtype
    vec = _dtype_info(dtype).vec if not ((a | b) & 15) else 1
    function, grid, block = _scale_plan(device, dtype, vec, max(na, nb))
    words = SCALE.template({"go": grad_output.data_ptr(), "a": a, "na": na, "b": b, "nb": nb})
    stream = _raw_stream(device)
    if _cupy.cuda.runtime.getDevice() == device:
        _args.launch(function, grid, block, 0, stream, words)
    else:
        with _cupy.cuda.Device(device):
            _args.launch(function, grid, block, 0, stream, words)


# --- one loss: its signature and ops ------------------------------------------------------------

@dataclasses.dataclass
class _Loss:
    """Everything generated for one registered loss."""

    name: str
    arrays: tuple            # array arguments (each has a gradient), in torch's order
    options: tuple           # the core function's other arguments: (name, default) pairs
    reduction: str           # the core function's default reduction
    reductions: tuple
    params: list             # inspect.Parameters of the public function
    fixed: tuple             # torch arguments cupyloss lacks: (name, default), default only
    legacy: bool             # the public function takes size_average and reduce
    option_names: tuple = ()
    no_flags: tuple = ()     # a False per array: no gradient computed in the forward pass
    differentiable: tuple = ()  # a bool per array: whether it has a gradient (a registry
                                # entry's `differentiable` names them; every array without one)
    wrt_of: dict = dataclasses.field(default_factory=dict)  # flags -> names they pick
    inplace: bool = False    # the core value_and_grad takes inplace: the public function
                             # takes inplace_backward
    forward: object = None   # torch.ops.cupyloss.<name>.default
    backward: object = None  # torch.ops.cupyloss.<name>_backward.default
    inplace_op: object = None  # torch.ops.cupyloss.<name>_inplace.default (inplace losses)
    sequences: tuple = ()    # arrays a caller may give as Python ints or sequences of them
                             # (ctc_loss's lengths): taken as CPU int64 tensors


def _core_parameters(name):
    """(array names, [(option, default)], default reduction) from the core signature."""
    spec = SPECS[name]
    params = inspect.signature(getattr(cupyloss, name)).parameters
    options = [(p.name, p.default) for p in params.values()
               if p.name not in spec.arrays and p.name != "reduction"]
    for option, default in options:
        if type(default) not in _SCHEMA_TYPES:
            raise TypeError(f"cupyloss.torch cannot pass {name}'s option {option} (default "
                            f"{default!r} of type {type(default).__name__}) to a torch op")
    return spec.arrays, tuple(options), params["reduction"].default


def _public_parameters(name, arrays, options, reduction):
    """The public function's parameters: torch.nn.functional's when it has `name`."""
    core = [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in arrays]
    core += [inspect.Parameter(o, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
             for o, d in options]
    core.append(inspect.Parameter("reduction", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  default=reduction))
    reference = getattr(torch.nn.functional, name, None)
    if reference is None:
        order = list(inspect.signature(getattr(cupyloss, name)).parameters)
        core.sort(key=lambda p: order.index(p.name))
        return core, (), False
    theirs = [p.replace(annotation=inspect.Parameter.empty)
              for p in inspect.signature(reference).parameters.values()]
    names = {p.name for p in theirs}
    ours = {p.name for p in core}
    missing = [a for a in arrays if a not in names]
    if missing:
        raise TypeError(f"torch.nn.functional.{name} has no argument {missing[0]}; cupyloss "
                        f"cannot follow its signature")
    fixed = tuple((p.name, p.default) for p in theirs
                  if p.name not in ours and p.name not in _LEGACY)
    extra = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in core
             if p.name not in names]
    legacy = all(n in names for n in _LEGACY)
    return theirs + extra, fixed, legacy


def _schema_args(loss: _Loss) -> str:
    options = "".join(f", {_SCHEMA_TYPES[type(d)]} {o}" for o, d in loss.options)
    return f"Tensor {', Tensor '.join(loss.arrays)}, str reduction{options}"


def _flags_schema(loss: _Loss) -> str:
    return ", ".join(f"bool grad_{a}" for a in loss.arrays)


def _split_inputs(loss: _Loss, inputs, wide=False):
    """Op inputs -> (arrays, reduction, options dict, flags).  The ops' last argument, `wide`
    (16-bit logits read as they are under autocast, a float32 loss: _autocast), is passed on
    as the option "_wide" where it is set.  torch hands it over positionally, by keyword, or
    not at all when it has its default (a compiled graph's calls), so both forms are read."""
    n, k = len(loss.arrays), len(loss.options)
    options = {o: v for (o, _), v in zip(loss.options, inputs[n + 1:n + 1 + k])}
    flags = inputs[n + 1 + k:n + 1 + k + n]
    if len(inputs) > n + 1 + k + n:
        wide = inputs[n + 1 + k + n]
    if wide:
        options["_wide"] = True
    return inputs[:n], inputs[n], options, flags


# Gradients a forward op formed for its backward op, held here instead of returned.  A returned
# gradient is an output of the forward graph that the compiled backward may not change, so it
# could only be scaled by the upstream gradient into a second buffer (AOTAutograd clones a
# saved tensor that a backward op mutates; Inductor re-inplaces only graph inputs that are
# copied back).  Held, they are scaled in place by the backward op as in eager: one buffer, and
# nothing to do when the upstream gradient is 1.  The forward op returns a one-byte token whose
# address keys them; they are dropped when the token dies (the graph that saved it is freed),
# or taken by the first backward op; a later one (retain_graph) forms them again.
_HELD: dict = {}


def _hold(grads, like) -> torch.Tensor:
    """A token for `grads` (a list, None where not formed), kept in _HELD while it lives."""
    token = torch.zeros((1,), dtype=torch.uint8, device=like.device)
    key = (token.device, token.data_ptr())
    _HELD[key] = grads
    weakref.finalize(token, _HELD.pop, key, None)
    return token


def _take(token):
    """The gradients held for `token` (once), or None."""
    if token.numel() == 0:
        return None
    return _HELD.pop((token.device, token.data_ptr()), None)


def _no_token(like) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.uint8)


def _held_gradients(grad_output: torch.Tensor, held: torch.Tensor, sizes: list[int],
                    ranks: list[int], dtype: torch.dtype, wanted: list[bool]) -> list[torch.Tensor]:
    """The gradients a forward op held for `held` (a position per array argument, of `ranks`
    dims each, their sizes in a row), those `wanted`, scaled by grad_output in place.  The op
    takes no argument of the loss, so a compiled graph keeps none of them for backward."""
    grads = _take(held)
    if grads is None:
        raise RuntimeError(
            "cupyloss.torch: the gradients this compiled loss formed in its forward pass were "
            "used up by the graph's first backward; for several backward passes through one "
            "graph (retain_graph=True) set cupyloss.torch.gradients_in_forward = False before "
            "compiling, so that each backward forms them again")
    picked = [g for g, w in zip(grads, wanted) if w]
    _engine.scale(grad_output, picked)
    return picked


def _held_gradients_fake(grad_output, held, sizes, ranks, dtype, wanted):
    out, at = [], 0
    for rank, w in zip(ranks, wanted):
        if w:
            out.append(grad_output.new_empty(tuple(sizes[at:at + rank]), dtype=dtype))
        at += rank
    return out


def _forward_impl(loss: _Loss):
    def impl(*inputs, wide=False):
        arrays, reduction, options, flags = _split_inputs(loss, inputs, wide)
        wrt = tuple(a for a, f in zip(loss.arrays, flags) if f)
        if wrt and reduction != "none":
            value, grads = _engine.value_and_grad(loss.name, arrays, reduction, options, wrt)
            grads = iter(grads)
            return value, _hold([next(grads) if f else None for f in flags], arrays[0])
        # 'none': backward applies the elementwise upstream gradient through the Jacobian
        return _engine.value(loss.name, arrays, reduction, options), _no_token(arrays[0])

    impl.__name__ = loss.name
    return impl


def _backward_impl(loss: _Loss):
    def impl(grad_output, token, *inputs, wide=False):
        arrays, reduction, options, flags = _split_inputs(loss, inputs, wide)
        wrt = tuple(a for a, f in zip(loss.arrays, flags) if f)
        held = _take(token)
        if not wrt:
            got = ()
        elif held is not None and all(h is not None for h, f in zip(held, flags) if f):
            got = [h for h, f in zip(held, flags) if f]
            _engine.scale(grad_output, got)
        elif token.numel():
            # A later backward through a retained graph: formed again with upstream 1 and
            # scaled as the first was, so that every backward gives the same bits.
            got = list(_engine.backward(loss.name, 1.0, arrays, reduction, options, wrt))
            _engine.scale(grad_output, got)
        else:
            got = _engine.backward(loss.name, grad_output, arrays, reduction, options, wrt)
        got = iter(got)
        return tuple(next(got) if f else a.new_empty((0,)) for a, f in zip(arrays, flags))

    impl.__name__ = loss.name + "_backward"
    return impl


def _loss_shape(loss: _Loss, arrays, reduction):
    """Shape of the loss from metadata alone, with the core's errors (used by the fakes)."""
    return _validate.loss_shape(SPECS[loss.name], arrays, reduction,
                                lambda a: a.is_floating_point())


def _forward_fake(loss: _Loss):
    def fake(*inputs, wide=False):
        arrays, reduction, options, flags = _split_inputs(loss, inputs, wide)
        shape = _loss_shape(loss, arrays, reduction)
        held = True in flags and reduction != "none"
        dtype = torch.float32 if "_wide" in options else arrays[0].dtype
        return (arrays[0].new_empty(shape, dtype=dtype),
                arrays[0].new_empty((1 if held else 0,), dtype=torch.uint8))

    return fake


def _backward_fake(loss: _Loss):
    def fake(grad_output, token, *inputs, wide=False):
        arrays, reduction, _, flags = _split_inputs(loss, inputs, wide)
        _loss_shape(loss, arrays, reduction)
        return tuple(a.new_empty(a.shape if f else (0,)) for a, f in zip(arrays, flags))

    return fake


_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_functional = torch._is_functional_tensor
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _backward_mode(grad_output) -> str:
    """'eager': real tensors, no tracing, no create_graph; 'graph': create_graph=True on real
    tensors; 'traced': torch.compile, torch.export, functorch or another tracer."""
    if (type(grad_output) is not torch.Tensor or _dispatch_modes()
            or _is_functional(grad_output) or _is_wrapped(grad_output)):
        return "traced"
    return "graph" if torch.is_grad_enabled() else "eager"


def _traced(loss: _Loss, arrays) -> bool:
    """Whether a forward call is being traced (so it must go through the registered op);
    TypeError for an argument that is no tensor."""
    for name, a in zip(loss.arrays, arrays):
        if type(a) is not _Tensor and not isinstance(a, _Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__module__}."
                            f"{type(a).__qualname__}")
    if _compiling() or _dispatch_modes():
        return True
    for name, a in zip(loss.arrays, arrays):
        if _is_wrapped(a):
            raise NotImplementedError(
                f"cupyloss.torch.{loss.name}: {name} comes from a torch.func transform (grad, "
                f"vmap, jacrev, ...), which cupyloss's losses do not support; use torch.autograd")
        if type(a) is not _Tensor or _is_functional(a):
            return True
    return False


def _save(ctx, arrays, reduction, options, flags, grads, private, token=None) -> None:
    """What backward needs, on ctx (the op's autograd context or _Eager's).

    private: whether the gradients of the forward pass are on ctx (_Eager's), so that the first
    backward scales them there; the op's are held for its token (_HELD), which is saved last.
    """
    tensors = {o: v for o, v in options.items() if isinstance(v, torch.Tensor)}
    ctx.save_for_backward(*arrays, *tensors.values(), *(() if token is None else (token,)))
    ctx.reduction = reduction
    ctx.options = options
    ctx.tensor_options = tuple(tensors)
    ctx.private = private
    # Only a reduced loss's gradients are used: for 'none' g is elementwise and the gradient is
    # its product with the loss's Jacobian (summed over broadcast dims, or over a row), not g
    # times the gradients of upstream 1; backward reruns.
    used = True in flags and reduction != "none"
    ctx.computed = flags if used else (False,) * len(flags)
    # Held outside save_for_backward: the first eager backward scales them in place.
    ctx.grads = grads if used else None


def _gradients(loss: _Loss, ctx, grad_loss, need) -> list:
    """The backward formula of every loss: one gradient (or None) per array argument."""
    n = len(loss.arrays)
    grads, ctx.grads = ctx.grads, None
    same = need == ctx.computed    # the usual case: the forward pass computed just these
    if not same:
        need = tuple(w and d for w, d in zip(need, loss.differentiable))
    if True not in need:
        return [None] * n
    if not ctx.private:
        # The op.  Gradients the forward op held: scaled in place by an op that takes none of
        # the loss's arguments (so a compiled graph frees them after the forward pass); else
        # the backward op forms them.
        saved = ctx.saved_tensors
        if True in ctx.computed and all(c or not w for c, w in zip(ctx.computed, need)):
            got = iter(_held_op(grad_loss, saved[-1], [s for shape in ctx.shapes for s in shape],
                                [len(shape) for shape in ctx.shapes], ctx.dtype, list(need)))
            return [next(got) if w else None for w in need]
        options = dict(ctx.options)
        options.update(zip(ctx.tensor_options, saved[n:-1]))
        wide = options.pop("_wide", False)
        out = loss.backward(grad_loss, saved[-1], *saved[:n], ctx.reduction, *options.values(),
                            *need, wide)
        return [g if w else None for g, w in zip(out, need)]
    mode = _backward_mode(grad_loss)
    if (grads is not None and mode != "graph"
            and (same or all(c or not w for c, w in zip(ctx.computed, need)))):
        picked = grads if same else [g if w else None for g, w in zip(grads, need)]
        if mode == "eager":
            _engine.scale(grad_loss, [g for g in picked if g is not None])
            return picked
        return [grad_loss * g if g is not None else None for g in picked]
    if getattr(ctx, "inplace", False):
        raise RuntimeError(f"cupyloss.torch.{loss.name}(inplace_backward=True): the input holds "
                           f"its gradient since the forward pass, so the loss has one plain "
                           f"backward (no retain_graph reuse, no create_graph)")
    saved = ctx.saved_tensors
    options = dict(ctx.options)
    options.update(zip(ctx.tensor_options, saved[n:]))
    if mode == "eager":
        wrt = tuple(a for a, w in zip(loss.arrays, need) if w)
        if True in ctx.computed:
            # A later backward through a retained graph: the gradients of the forward pass again
            # (upstream 1), scaled as the first backward scaled them, so that every backward of
            # the graph gives the same bits (gradcheck's reentrancy test asks for that).
            got = _engine.backward(loss.name, 1.0, saved[:n], ctx.reduction, options, wrt)
            _engine.scale(grad_loss, list(got))
        else:
            got = _engine.backward(loss.name, grad_loss, saved[:n], ctx.reduction, options, wrt)
        got = iter(got)
        return [next(got) if w else None for w in need]
    wide = options.pop("_wide", False)
    out = loss.backward(grad_loss, _no_token(saved[0]), *saved[:n], ctx.reduction,
                        *options.values(), *need, wide)
    return [g if w else None for g, w in zip(out, need)]


def _autograd(loss: _Loss):
    """(setup_context, backward) registered on the forward op."""
    n = len(loss.arrays)
    tail = (None,) * (1 + len(loss.options) + n)

    def setup_context(ctx, inputs, output):
        arrays, reduction, options, flags = _split_inputs(loss, inputs)
        ctx.nones = tail + (None,) * (len(inputs) - n - len(tail))   # `wide` when given
        ctx.mark_non_differentiable(output[1])
        ctx.shapes, ctx.dtype = [tuple(a.shape) for a in arrays], arrays[0].dtype
        _save(ctx, arrays, reduction, options, tuple(flags), None, private=False,
              token=output[1])

    def backward(ctx, grad_loss, *unused):
        return (*_gradients(loss, ctx, grad_loss, ctx.needs_input_grad[:n]), *ctx.nones)

    return setup_context, backward


class _Eager(torch.autograd.Function):
    """The ops' forward and backward for eager calls, without the dispatcher's Python layers.

    torch.library.custom_op wraps an op's Python implementation and its autograd formula in
    several Python frames and a redispatch; for a small loss they cost more host time than the
    kernels.  Outside any tracing, the public functions call the same engine and the same
    formula (_gradients) through this Function instead; torch.compile, opcheck and other tracers
    see the registered ops.
    """

    @staticmethod
    def forward(ctx, call, *arrays):
        loss, reduction, options, flags, wide, inplace = call
        options = dict(zip(loss.option_names, options)) if options else {}
        if wide:
            options["_wide"] = True
        ctx.inplace = inplace
        if True in flags:
            wrt = loss.wrt_of.get(flags)
            if wrt is None:
                wrt = loss.wrt_of[flags] = tuple(a for a, f in zip(loss.arrays, flags) if f)
            if inplace:
                value, got = _engine.value_and_grad(loss.name, arrays, reduction,
                                                    dict(options, inplace=True), wrt)
                # The input now holds its gradient: a node that saved it for its own backward
                # raises there ("modified by an inplace operation") instead of reading it.
                torch.autograd.graph.increment_version(arrays[0])
                arrays = (arrays[0].new_empty((0,)), *arrays[1:])  # not saved: it is gone
            else:
                value, got = _engine.value_and_grad(loss.name, arrays, reduction, options, wrt)
            if len(wrt) == len(flags):
                grads = list(got)
            else:
                got = iter(got)
                grads = [next(got) if f else None for f in flags]
        else:
            value, grads = _engine.value(loss.name, arrays, reduction, options), None
        ctx.loss = loss
        _save(ctx, arrays, reduction, options, flags, grads, private=True)
        return value

    @staticmethod
    def backward(ctx, grad_loss):
        return (None, *_gradients(ctx.loss, ctx, grad_loss, ctx.needs_input_grad[1:]))


# autograd.Function.apply's C++ part.  The Python layer in front of it (Function.apply) binds
# default arguments for a setup_context that _Eager lacks and unwraps functorch's dead wrappers,
# which _traced has already refused; skipping it saves a few microseconds a call.
_apply_eager = super(torch.autograd.Function, _Eager).apply


def _register(loss: _Loss) -> None:
    args = _schema_args(loss)
    flags = _flags_schema(loss)
    grads = ", ".join("Tensor" for _ in loss.arrays)
    forward = torch.library.custom_op(
        f"{_NAMESPACE}::{loss.name}", _forward_impl(loss), mutates_args=(),
        schema=f"({args}, {flags}, bool wide=False) -> (Tensor, Tensor)")
    forward.register_fake(_forward_fake(loss))
    backward = torch.library.custom_op(
        f"{_NAMESPACE}::{loss.name}_backward", _backward_impl(loss), mutates_args=(),
        schema=f"(Tensor grad_output, Tensor held, {args}, {flags}, bool wide=False) -> "
               f"({grads})")
    backward.register_fake(_backward_fake(loss))
    setup_context, formula = _autograd(loss)
    forward.register_autograd(formula, setup_context=setup_context)
    namespace = getattr(torch.ops, _NAMESPACE)
    loss.forward = getattr(namespace, loss.name).default
    loss.backward = getattr(namespace, loss.name + "_backward").default
    if loss.inplace:
        _register_inplace(loss, args)
        loss.inplace_op = getattr(namespace, loss.name + "_inplace").default


# The traced form of inplace_backward=True: an op that writes the input's gradient (upstream 1)
# into the input and returns the loss, declared as mutating it, under _InplaceTraced's autograd
# formula (torch has none for a mutating op).  torch.compile then writes into the input's own
# buffer where nothing later reads the input (Inductor's re-inplacing; else into a copy, which
# is still correct), and the backward, grad_output times the saved input, is an ordinary
# pointwise product the compiled backward fuses with what follows.
def _register_inplace(loss: _Loss, args: str) -> None:
    first = loss.arrays[0]
    flags = (True,) + (False,) * (len(loss.arrays) - 1)
    plain = len(loss.arrays) + 1 + len(loss.options)    # the inputs before `wide`

    def split(inputs, wide):
        if len(inputs) > plain:
            inputs, wide = inputs[:plain], inputs[plain]
        return _split_inputs(loss, (*inputs, *flags, wide))

    def impl(*inputs, wide=False):
        arrays, reduction, options, _ = split(inputs, wide)
        x = arrays[0]
        if x.device.type == "cuda" and type(_engine) is _ByDevice:
            value, _ = _engine.value_and_grad(loss.name, arrays, reduction,
                                              dict(options, inplace=True), (first,))
        else:
            value, (grad,) = _engine.value_and_grad(loss.name, arrays, reduction, options,
                                                    (first,))
            x.copy_(grad)
        return value

    def fake(*inputs, wide=False):
        arrays, reduction, options, _ = split(inputs, wide)
        dtype = torch.float32 if "_wide" in options else arrays[0].dtype
        return arrays[0].new_empty(_loss_shape(loss, arrays, reduction), dtype=dtype)

    impl.__name__ = loss.name + "_inplace"
    op = torch.library.custom_op(
        f"{_NAMESPACE}::{loss.name}_inplace", impl, mutates_args=(first,),
        schema=f"({args.replace('Tensor ', 'Tensor(a!) ', 1)}, bool wide=False) -> Tensor")
    op.register_fake(fake)


class _InplaceTraced(torch.autograd.Function):
    """autograd of a traced inplace_backward=True call (_register_inplace): forward(op, input,
    *rest) runs the op, which leaves d loss / d input at upstream 1 in the input; backward is
    grad_output times it (rounded to its dtype first, as _Kernels.scale does)."""

    @staticmethod
    def forward(ctx, op, x, *rest):
        value = op(x, *rest)
        ctx.save_for_backward(x)
        ctx.rest = len(rest)
        return value

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return (None, grad_loss.to(grad.dtype) * grad, *(None,) * ctx.rest)


_held_op = torch.library.custom_op(
    f"{_NAMESPACE}::held_gradients", _held_gradients, mutates_args=(),
    schema="(Tensor grad_output, Tensor held, SymInt[] sizes, int[] ranks, ScalarType dtype, "
           "bool[] wanted) -> Tensor[]")
_held_op.register_fake(_held_gradients_fake)


# --- the public functions and modules ---------------------------------------------------------

def _call(loss: _Loss, arrays, reduction, options, legacy, fixed, inplace=False):
    """What every generated public function does: check, pick the path, run the forward.
    inplace: the public function's inplace_backward."""
    if legacy and (legacy[0] is not None or legacy[1] is not None):
        reduction = torch.nn._reduction.legacy_get_string(legacy[0], legacy[1])
    if reduction not in loss.reductions:
        _reduction.check_reduction(reduction, loss.reductions)
    if loss.sequences:
        arrays = tuple(torch.as_tensor(a, dtype=torch.int64)
                       if n in loss.sequences and not isinstance(a, _Tensor) else a
                       for n, a in zip(loss.arrays, arrays))
    for (name, default), value in zip(loss.fixed, fixed):
        if value is not default and (default is None or value != default):
            raise ValueError(f"cupyloss.torch.{loss.name} does not support {name}={value!r}; "
                             f"only the default {default!r}")
    traced = _traced(loss, arrays)
    if traced and "num_items" in loss.option_names:
        # an int count travels through the op's schema ("Tensor? num_items") as a CPU tensor
        k = loss.option_names.index("num_items")
        if isinstance(options[k], int) and not isinstance(options[k], bool):
            options = (*options[:k], torch.tensor(options[k]), *options[k + 1:])
    wide = False
    if _autocast_on("cuda") and arrays[0].device.type == "cuda":
        arrays, options, wide = _autocast(loss, arrays, options)
    if traced and arrays[0].device.type == "cpu" and type(_engine) is _ByDevice:
        # Traced on CPU tensors: torch's own operations, which the tracer differentiates (the
        # op's CPU kernel runs below autograd, where they could not be differentiated).
        from cupyloss.torch import _forms as _torch_forms

        return _torch_forms.loss(loss.name, list(arrays), reduction,
                                 dict(zip(loss.option_names, options)) if options else {})
    if gradients_in_forward and reduction != "none" and _grad_enabled():
        flags = tuple(a.requires_grad and d for a, d in zip(arrays, loss.differentiable))
    else:
        flags = loss.no_flags
    if inplace:
        inplace = _inplace(loss, arrays[0], reduction, flags, traced)
    if traced:
        if inplace:
            return _InplaceTraced.apply(loss.inplace_op, *arrays, reduction, *options, wide)
        return loss.forward(*arrays, reduction, *options, *flags, wide)[0]
    return _apply_eager((loss, reduction, options, flags, wide, inplace), *arrays)


def _inplace(loss: _Loss, x, reduction, flags, traced) -> bool:
    """Whether a call with inplace_backward=True writes the input's gradient into the input:
    refused (ValueError) where that would lose something autograd or the caller still needs;
    not done where no gradient is formed in the forward pass or on CPU tensors.  Traced, the
    op declared as mutating the input (_register_inplace) takes it where the input's gradient
    is the only one asked for; otherwise the out-of-place path runs (the same numbers)."""
    if x.is_leaf and x.requires_grad:
        raise ValueError(f"cupyloss.torch.{loss.name}(inplace_backward=True) would overwrite a "
                         f"leaf tensor that requires grad with its own gradient; pass a tensor "
                         f"computed from it (a model's logits)")
    if reduction == "none":
        raise ValueError(f"cupyloss.torch.{loss.name}(inplace_backward=True) needs a reduced "
                         f"loss: with reduction='none' backward reads the input again")
    if traced:
        on_kernels = x.device.type == "cuda" or type(_engine) is not _ByDevice
        return on_kernels and bool(flags[0]) and True not in flags[1:] and x.is_contiguous()
    return bool(flags[0]) and x.device.type == "cuda" and x.is_contiguous()


# The losses torch's CUDA autocast runs in float32 (torch.amp's op reference, "CUDA Ops that can
# autocast to float32"): under autocast their 16-bit floating arguments are taken as float32,
# the loss is float32, and the gradients come back in the arguments' own dtypes.
# binary_cross_entropy is refused there, as torch refuses it.
_AUTOCAST_FP32 = frozenset((
    "binary_cross_entropy_with_logits", "cosine_embedding_loss", "cross_entropy",
    "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "poisson_nll_loss",
    "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss"))
# Of those, the ones whose kernels read 16-bit logits as they are and return the float32 loss
# (rowwise.cu's ROW_ACC_IO; the ops' `wide` argument when traced): the float32 copy torch makes
# of the logits (4 GiB at 8192 x 128256) is never made, eager or compiled.  The others take
# float32 copies as torch does.
_AUTOCAST_DIRECT = frozenset(("cross_entropy", "nll_loss"))
_LOWER = (torch.float16, torch.bfloat16)
_autocast_on = torch.is_autocast_enabled


def _autocast(loss: _Loss, arrays, options):
    """(arrays, options, wide) of a call on CUDA tensors under CUDA autocast (see above)."""
    if loss.name == "binary_cross_entropy":
        raise RuntimeError(
            "cupyloss.torch.binary_cross_entropy, like torch's, is unsafe to autocast: a "
            "sigmoid before it loses its 16-bit range; use binary_cross_entropy_with_logits "
            "(safe under autocast), or run the loss outside the autocast region")
    if loss.name not in _AUTOCAST_FP32:
        return arrays, options, False
    floats = [a for a in (*arrays, *options) if isinstance(a, torch.Tensor)
              and a.is_floating_point()]
    if not any(a.dtype in _LOWER for a in floats):
        return arrays, options, False
    if (loss.name in _AUTOCAST_DIRECT and arrays[0].dtype in _LOWER
            and all(a.dtype == arrays[0].dtype for a in floats)):
        return arrays, options, True

    def cast(a):
        return a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOWER else a

    return tuple(map(cast, arrays)), tuple(map(cast, options)), False


_PATHS = {
    True: "the gradients of the arguments that require grad come from the forward pass and "
          "backward scales them by grad_output in place (nothing when it is 1)",
    False: "backward reruns the gradient kernel with the elementwise grad_output",
}


def _doc(loss: _Loss, what: str, example: str) -> str:
    core = inspect.getdoc(getattr(cupyloss, loss.name)) or ""
    summary, _, body = core.partition("\n")
    where = (f"torch.nn.functional.{loss.name}'s signature"
             if getattr(torch.nn.functional, loss.name, None) is not None
             else f"cupyloss.{loss.name}'s signature")
    fixed = ", ".join(n for n, _ in loss.fixed)
    limits = f" ({fixed} only at its default)" if fixed else ""
    intro = textwrap.fill(
        f"{what} for torch CUDA tensors (CPU tensors: torch's own operations), with "
        f"{where}{limits}. Gradients flow to the tensor "
        f"arguments that require grad. For a reduced loss {_PATHS[True]}; for reduction='none' "
        f"{_PATHS[False]} (cupyloss.torch's docstring has the details).", 96)
    return f"{summary}\n\n{intro}\n{body}\n\nExample (torch):\n{example}\n"


def _make_function(loss: _Loss):
    params = loss.params
    defaults = {f"_d{i}": p.default for i, p in enumerate(params)
                if p.default is not inspect.Parameter.empty}
    text, star = [], False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            text.append("*")
            star = True
        text.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}=_d{i}")
    options = "".join(f"{o}, " for o, _ in loss.options)
    legacy = "(size_average, reduce)" if loss.legacy else "()"
    fixed = "".join(f"{n}, " for n, _ in loss.fixed)
    inplace = ", inplace_backward" if loss.inplace else ""
    source = (f"def {loss.name}({', '.join(text)}):\n"
              f"    return _call(_loss, ({', '.join(loss.arrays)},), reduction, ({options}), "
              f"{legacy}, ({fixed}){inplace})\n")
    namespace = {"_call": _call, "_loss": loss, **defaults}
    exec(compile(source, f"<cupyloss.torch.{loss.name}>", "exec"), namespace)
    function = namespace[loss.name]
    function.__module__ = __name__
    function.__qualname__ = loss.name
    args = ", ".join(loss.arrays)
    function.__doc__ = _doc(loss, f"Autograd-aware cupyloss.{loss.name}",
                            f"  >>> loss = cupyloss.torch.{loss.name}({args})  # CUDA tensors\n"
                            f"  >>> loss.backward()")
    return function


def _module_name(name: str) -> str:
    """torch.nn's class name for loss `name`, else the registry entry's `module_name`, else
    CamelCase(name) + 'Loss'.

    torch.nn's class is the one whose own forward calls torch.nn.functional.<name> (BCELoss for
    binary_cross_entropy, NLLLoss for nll_loss): names do not map by spelling alone.
    """
    found = []
    for attr in dir(torch.nn.modules.loss):
        cls = getattr(torch.nn.modules.loss, attr)
        forward = getattr(cls, "__dict__", {}).get("forward")
        if (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and attr.endswith("Loss")
                and forward is not None and name in forward.__code__.co_names):
            found.append(attr)
    if len(found) == 1:
        return found[0]
    if getattr(SPECS[name], "module_name", None):
        return SPECS[name].module_name
    return "".join(part.capitalize() for part in name.split("_")).removesuffix("Loss") + "Loss"


class _LossModule(torch.nn.Module):
    """Base of the generated loss modules: keeps the options, calls the function."""

    _function = None
    _arguments: tuple = ()

    def _configure(self, values: dict) -> None:
        torch.nn.Module.__init__(self)
        if values.get("size_average") is not None or values.get("reduce") is not None:
            values["reduction"] = torch.nn._reduction.legacy_get_string(
                values.pop("size_average"), values.pop("reduce"))
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)

    def extra_repr(self) -> str:
        shown = [n for n in self._arguments if n not in _LEGACY]
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in shown
                         if not isinstance(getattr(self, n), torch.Tensor))


def _make_module(loss: _Loss, function):
    options = [p for p in loss.params if p.name not in loss.arrays]
    defaults = {f"_d{i}": p.default for i, p in enumerate(options)}
    init_args = ", ".join(f"{p.name}=_d{i}" for i, p in enumerate(options))
    keep = ", ".join(f"{p.name!r}: {p.name}" for p in options)
    call = ", ".join(f"{p.name}=self.{p.name}" for p in options if p.name not in _LEGACY)
    arrays = ", ".join(loss.arrays)
    source = (f"def __init__(self, {init_args}):\n"
              f"    self._configure({{{keep}}})\n"
              f"def forward(self, {arrays}):\n"
              f"    return _function({arrays}, {call})\n")
    namespace = {"_function": function, **defaults}
    exec(compile(source, f"<cupyloss.torch.{_module_name(loss.name)}>", "exec"), namespace)
    name = _module_name(loss.name)
    cls = type(name, (_LossModule,), {
        "__init__": namespace["__init__"], "forward": namespace["forward"],
        "_arguments": tuple(p.name for p in options), "__module__": __name__,
        "__doc__": _doc(loss, f"nn.Module form of cupyloss.torch.{loss.name}: the constructor "
                              f"takes its options, forward({arrays}) returns the loss,",
                        f"  >>> crit = cupyloss.torch.{name}()\n"
                        f"  >>> crit({arrays}).backward()  # CUDA tensors")})
    cls.__qualname__ = name
    return cls


def _describe(name: str, spec) -> _Loss:
    """The _Loss of a registry entry, or TypeError saying why it cannot be wrapped; registers
    nothing, so a refused loss leaves no op behind."""
    reason = unwrappable(name, spec, cupyloss)
    if reason is not None:
        raise TypeError(reason)
    arrays, options, reduction = _core_parameters(name)
    params, fixed, legacy = _public_parameters(name, arrays, options, reduction)
    inplace = "inplace" in inspect.signature(
        getattr(cupyloss, name + "_value_and_grad")).parameters
    if inplace:
        params = [*params, inspect.Parameter("inplace_backward", inspect.Parameter.KEYWORD_ONLY,
                                             default=False)]
    differentiable = getattr(spec, "differentiable", arrays)
    return _Loss(name, arrays, options, reduction, spec.reductions, params, fixed, legacy,
                 tuple(o for o, _ in options), (False,) * len(arrays),
                 tuple(a in differentiable for a in arrays), inplace=inplace,
                 sequences=getattr(spec, "sequences", ()))


def _build(loss: _Loss) -> tuple:
    _register(loss)
    function = _make_function(loss)
    return function, _make_module(loss, function)


LOSSES: dict = {}        # name -> the generated function
MODULES: dict = {}       # name -> the generated nn.Module class
SKIPPED: dict = {}       # name -> why a registered loss got no function, module or ops
_GENERATED: dict = {}    # name -> _Loss


def _generate(specs: dict) -> None:
    """Generate every wrappable loss of `specs`; record the others in SKIPPED, with a warning."""
    module = sys.modules[__name__]
    for name, spec in specs.items():
        try:
            loss = _describe(name, spec)
        except TypeError as exc:
            SKIPPED[name] = str(exc)
            warnings.warn(f"cupyloss.torch leaves out {name}: {exc}", RuntimeWarning,
                          stacklevel=2)
            continue
        _GENERATED[name] = loss
        LOSSES[name], MODULES[name] = _build(loss)
        setattr(module, name, LOSSES[name])
        setattr(module, MODULES[name].__name__, MODULES[name])


_generate(SPECS)


# --- the fused linear cross entropy (cupyloss.linear) ---------------------------------------------

_LINEAR_GRADS = ("hidden", "weight", "bias")


def _linear_run(hidden, weight, target, bias, class_weight, options, names, grad_output,
                want_value):
    """(loss or None, {name: gradient}) of the fused loss: the kernels on CUDA tensors, torch's
    operations on CPU ones (float32 logits, cross_entropy, and its gradient written out:
    autograd does not run inside an op's kernel).  options["shard"]: (class offset, classes,
    process group) of the weight's rows split over ranks (_torch_parallel), or None."""
    shard = options.get("shard")
    if "shard" in options:
        options = {k: v for k, v in options.items() if k != "shard"}
    if shard is not None:
        run = (_torch_parallel._linear_shard_run if hidden.device.type != "cpu"
               else _torch_parallel._linear_shard_cpu)
        return run(hidden, weight, target, bias, class_weight, options, names, grad_output,
                   want_value, shard[2], shard[0], shard[1])
    if hidden.device.type != "cpu":
        from cupyloss import linear

        if want_value and names:
            loss, grads = linear.linear_cross_entropy_value_and_grad(
                hidden, weight, target, bias, class_weight, grad_output=grad_output,
                wrt=names, **options)
            return loss, dict(zip(names, grads))
        if want_value:
            return linear.linear_cross_entropy(hidden, weight, target, bias, class_weight,
                                               **options), {}
        grads = linear.linear_cross_entropy_backward(grad_output, hidden, weight, target, bias,
                                                     class_weight, wrt=names, **options)
        return None, dict(zip(names, grads))
    from cupyloss.torch import _forms as _torch_forms

    logits, loss, kwargs = _linear_cpu(hidden, weight, target, bias, class_weight, options,
                                       want_value)
    grads = {}
    if names:
        dz = _torch_forms.cross_entropy_logits_grad(logits, target.reshape(-1), class_weight,
                                                    reduction=options["reduction"],
                                                    grad_output=grad_output, **kwargs)
        if "hidden" in names:
            grads["hidden"] = (dz @ weight.float()).reshape(hidden.shape).to(hidden.dtype)
        if "weight" in names:
            grads["weight"] = (dz.T @ hidden.reshape(-1, hidden.shape[-1]).float()).to(weight.dtype)
        if "bias" in names:
            grads["bias"] = dz.sum(dim=0).to(bias.dtype)
    return loss, grads


def _linear_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                    max_workspace_bytes, class_offset=0, classes=-1, group="", compute_dtype="",
                    num_items=None):
    """The options of one call; group: the name of the process group whose ranks split the
    weight's rows ("" for none), resolved to the group here; compute_dtype: the products'
    dtype under autocast ("" for none); num_items: None or a 0-d tensor (an int made one)."""
    shard = None
    if group:
        from torch.distributed import distributed_c10d

        shard = (class_offset, classes, distributed_c10d._resolve_process_group(group))
    return dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                lse_square_scale=lse_square_scale, softcap=softcap,
                max_workspace_bytes=None if max_workspace_bytes < 0 else max_workspace_bytes,
                shard=shard, compute_dtype=compute_dtype or None, num_items=num_items)


_LINEAR_ARGS = ("Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, "
                "int ignore_index, str reduction, float label_smoothing, float lse_square_scale, "
                "float softcap, int max_workspace_bytes, int class_offset, int classes, "
                "str group, str compute_dtype, Tensor? num_items, bool wrt_hidden, bool wrt_weight, "
                "bool wrt_bias")


def _linear_names(bias, flags):
    return tuple(n for n, f in zip(_LINEAR_GRADS, flags) if f and (n != "bias" or bias is not None))


def _linear_forward_impl(hidden, weight, target, bias, class_weight, *args):
    # args: the op's arguments after class_weight (_LINEAR_ARGS), the three wrt flags last
    names = () if args[1] == "none" else _linear_names(bias, args[-3:])
    # with 'none', backward forms the logits again with the elementwise upstream gradient
    loss, grads = _linear_run(hidden, weight, target, bias, class_weight,
                              _linear_options(*args[:-3]), names, 1.0, True)
    if not names:
        return loss, _no_token(hidden)
    return loss, _hold([grads.get(n) for n in _LINEAR_GRADS], hidden)


def _linear_forward_fake(hidden, weight, target, bias, class_weight, *args):
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    loss = hidden.new_empty(tuple(target.shape) if args[1] == "none" else (), dtype=dtype)
    names = () if args[1] == "none" else _linear_names(bias, args[-3:])
    return loss, hidden.new_empty((1 if names else 0,), dtype=torch.uint8)


def _linear_scale(grad_output, grads) -> None:
    """grads *= grad_output in place (scale_by_grad_output on the device, after rounding it to
    their dtype, as the eager path does)."""
    if grads and grads[0].device.type == "cpu":
        for g in grads:
            g.mul_(grad_output.to(g.dtype))
        return
    by_dtype = {}
    for g in grads:       # under autocast the gradients' dtypes may differ
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        for k in range(0, len(same), 2):
            scale_by_grad_output(grad_output.to(dtype).contiguous(), *same[k:k + 2])


def _linear_backward_impl(grad_output, held, hidden, weight, target, bias, class_weight, *args):
    names = _linear_names(bias, args[-3:])
    kept = _take(held)
    if kept is not None and all(kept[_LINEAR_GRADS.index(n)] is not None for n in names):
        grads = {n: kept[_LINEAR_GRADS.index(n)] for n in names}
        _linear_scale(grad_output, list(grads.values()))
    else:
        _, grads = _linear_run(hidden, weight, target, bias, class_weight,
                               _linear_options(*args[:-3]), names, grad_output.contiguous(),
                               False)
    return tuple(grads[n] if n in grads else hidden.new_empty((0,)) for n in _LINEAR_GRADS)


def _linear_backward_fake(grad_output, held, hidden, weight, target, bias, class_weight, *rest):
    names = _linear_names(bias, rest[-3:])
    like = {"hidden": hidden, "weight": weight, "bias": bias}
    return tuple(torch.empty_like(like[n]) if n in names else hidden.new_empty((0,))
                 for n in _LINEAR_GRADS)


def _linear_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    hidden, weight, target, bias, class_weight = inputs[:5]
    ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[1])
    ctx.args = inputs[5:]


def _linear_formula(ctx, grad_loss, *unused):
    # The backward op scales in place what the forward op held (_HELD), or forms the gradients.
    hidden, weight, target, bias, class_weight, held = ctx.saved_tensors
    need = ctx.needs_input_grad
    flags = (need[0], need[1], need[3] and bias is not None)
    got = torch.ops.cupyloss.linear_cross_entropy_backward(
        grad_loss, held, hidden, weight, target, bias, class_weight, *ctx.args[:-3], *flags)
    out = [g if f else None for g, f in zip(got, flags)]
    return out[0], out[1], None, out[2], *(None,) * (1 + len(ctx.args))


def _op_pair(name, forward, backward, schemas, setup_context, formula):
    """Register the fused head's ops <name> and <name>_backward: forward and backward are
    (implementation, fake) pairs, schemas their schemas; <name>'s autograd formula calls the
    backward op.  Returns the forward op."""
    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", forward[0], mutates_args=(),
                                 schema=schemas[0])
    op.register_fake(forward[1])
    op.register_autograd(formula, setup_context=setup_context)
    torch.library.custom_op(f"{_NAMESPACE}::{name}_backward", backward[0], mutates_args=(),
                            schema=schemas[1]).register_fake(backward[1])
    return op


_linear_op = _op_pair(
    "linear_cross_entropy", (_linear_forward_impl, _linear_forward_fake),
    (_linear_backward_impl, _linear_backward_fake),
    (f"({_LINEAR_ARGS}) -> (Tensor, Tensor)",
     f"(Tensor grad_output, Tensor held, {_LINEAR_ARGS}) -> (Tensor, Tensor, Tensor)"),
    _linear_setup_context, _linear_formula)


class _LinearCrossEntropy(torch.autograd.Function):
    """Eager calls on CUDA tensors: the op's forward and formula without the dispatcher's Python
    layers (as _Eager for the other losses); the gradients of a reduced loss, held by nothing but
    ctx, are scaled in place in backward (nothing when the upstream gradient is 1)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, options):
        names = tuple(n for n, need in zip(_LINEAR_GRADS, ctx.needs_input_grad[:3]) if need)
        ctx.names, ctx.options, ctx.grads = names, options, None
        ctx.save_for_backward(hidden, weight, bias, target, class_weight)
        if names and options["reduction"] != "none" and gradients_in_forward:
            loss, grads = _linear_run(hidden, weight, target, bias, class_weight, options, names,
                                      1.0, True)
            ctx.grads = tuple(grads[n] for n in names)
            return loss
        return _linear_run(hidden, weight, target, bias, class_weight, options, (), 1.0,
                           True)[0]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, target, class_weight = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None
        if grads is not None:
            _linear_scale(grad_loss, list(grads))
            grads = dict(zip(ctx.names, grads))
        else:
            grads = _linear_run(hidden, weight, target, bias, class_weight, ctx.options,
                                ctx.names, grad_loss.contiguous(), False)[1]
        return (grads.get("hidden"), grads.get("weight"), grads.get("bias"), None, None, None)


def linear_cross_entropy(hidden, weight, target, bias=None, class_weight=None,
                         ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                         lse_square_scale=0.0, softcap=0.0, max_workspace_bytes=None,
                         check_targets=False, num_items=None):
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` with autograd, the logits never whole.

    cupyloss.linear_cross_entropy (its docstring has the formula) on CUDA tensors: the logits are
    formed chunk by chunk in float32 and never rounded to 16 bits; the loss is float32 (float64
    for float64 inputs).  With 'mean' or 'sum' and a gradient wanted, the forward pass forms the
    gradients of hidden, weight and bias (those that require grad) and backward scales them by
    the upstream gradient (rounded to their dtype); with 'none' backward forms the logits again.
    Inside ``torch.autocast("cuda")`` the products run in the autocast dtype, as F.linear's
    there: float32 hidden states, weight and bias are rounded to it inside the call (the weight
    once a call; nothing kept between calls), and their gradients come back in float32, written
    by cuBLAS from the 16-bit operands (a float32 master weight's gradient is never a 16-bit
    gradient cast back).  The loss is float32.
    On CPU tensors: torch's own operations on the float32 logits.  Under torch.compile (and any
    other tracer) the call is the op ``torch.ops.cupyloss.linear_cross_entropy``, traced without
    a graph break.

    Args:
      hidden: (..., H); weight: (V, H) (an nn.Linear's); target: class indices shaped like
        hidden without its last dim; bias: None or (V,); class_weight: None or (V,).
      ignore_index, reduction, label_smoothing, lse_square_scale, softcap: as for cross_entropy.
      max_workspace_bytes: bytes a call may hold besides its results (cupyloss.linear.plan).
      check_targets: raise IndexError for a class index outside [0, V) (synchronises; eager
        only); without it such a row is NaN and counted (cupyloss.rejected_targets).
      num_items: None, or the divisor of the summed loss ('mean' and 'sum' alike): the counted
        rows of every micro-batch of a gradient-accumulation step, an int or a 0-d integer
        tensor (Hugging Face's ``num_items_in_batch``; a CUDA one is read on the device).

    Returns:
      The loss, 0-d for 'mean'/'sum', else target's shape.

    Example:
      >>> loss = cupyloss.torch.linear_cross_entropy(h, model.lm_head.weight, labels)
      >>> loss.backward()
    """
    compute = _torch_autocast.linear_compute(hidden, weight, bias)
    options = dict(ignore_index=ignore_index, reduction=reduction,
                   label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
                   softcap=softcap, max_workspace_bytes=max_workspace_bytes,
                   compute_dtype=compute, num_items=num_items)
    tensors = (hidden, weight, target, bias, class_weight)
    traced = _compiling() or _dispatch_modes() or any(
        t is not None and (type(t) is not _Tensor or _is_functional(t)) for t in tensors)
    if check_targets:
        _torch_parallel.check_targets_of(target, weight.shape[0], ignore_index)
    if traced:
        flags = (hidden.requires_grad, weight.requires_grad,
                 bias is not None and bias.requires_grad)
        return _linear_op(hidden, weight, target, bias, class_weight, ignore_index, reduction,
                          float(label_smoothing), float(lse_square_scale), float(softcap),
                          -1 if max_workspace_bytes is None else int(max_workspace_bytes),
                          0, -1, "", compute or "", _items_tensor(num_items, reduction),
                          *flags)[0]
    if hidden.device.type == "cpu":
        return _linear_cpu(hidden, weight, target, bias, class_weight, options)[1]
    return _LinearCrossEntropy.apply(hidden, weight, bias, target, class_weight, options)


def _items_tensor(num_items, reduction):
    """num_items as an op takes it (``Tensor? num_items``): None, a tensor, or an int made a CPU
    tensor, after the checks every path makes."""
    if num_items is None:
        return None
    _validate.check_num_items(num_items, reduction, torch.Tensor)
    return num_items if isinstance(num_items, torch.Tensor) else torch.tensor(int(num_items))


def _linear_cpu(hidden, weight, target, bias, class_weight, options, want_value=True):
    """The CPU path in torch's operations: (float32 logits (rows, V), the loss or None, the
    cross_entropy options); torch's autograd differentiates it outside an op."""
    from cupyloss.torch import _forms as _torch_forms

    reduction = options["reduction"]
    logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(),
                                        weight.float(), None if bias is None else bias.float())
    kwargs = {k: v for k, v in options.items()
              if k not in ("reduction", "max_workspace_bytes", "compute_dtype")}
    if not want_value:
        return logits, None, kwargs
    loss = _torch_forms.loss("cross_entropy", [logits, target.reshape(-1), class_weight],
                             reduction, kwargs)
    return logits, loss.reshape(target.shape) if reduction == "none" else loss, kwargs


class LinearCrossEntropyLoss(torch.nn.Module):
    """An LLM head's loss as a module: ``forward(hidden, weight, target, bias=None)`` is
    linear_cross_entropy with the options given here (class_weight kept as a buffer).

    Example:
      >>> head = cupyloss.torch.LinearCrossEntropyLoss(ignore_index=-100)
      >>> loss = head(hidden, model.lm_head.weight, labels)
    """

    def __init__(self, class_weight=None, ignore_index=-100, reduction="mean",
                 label_smoothing=0.0, *, lse_square_scale=0.0, softcap=0.0,
                 max_workspace_bytes=None):
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.lse_square_scale = label_smoothing, lse_square_scale
        self.softcap, self.max_workspace_bytes = softcap, max_workspace_bytes

    def forward(self, hidden, weight, target, bias=None, num_items=None):
        return linear_cross_entropy(hidden, weight, target, bias, self.class_weight,
                                    self.ignore_index, self.reduction, self.label_smoothing,
                                    lse_square_scale=self.lse_square_scale, softcap=self.softcap,
                                    max_workspace_bytes=self.max_workspace_bytes,
                                    num_items=num_items)


# --- per-token log-probabilities and entropy (cupyloss.linear.linear_log_probs) -------------------

_LOGPROB_ARGS = ("Tensor hidden, Tensor weight, Tensor target, Tensor? bias, float temperature, "
                 "int ignore_index, int max_workspace_bytes, str compute_dtype")


def _logprob_kwargs(temperature, ignore_index, max_workspace_bytes, compute_dtype):
    return dict(temperature=temperature, ignore_index=ignore_index,
                max_workspace_bytes=None if max_workspace_bytes < 0 else max_workspace_bytes,
                compute_dtype=compute_dtype or None)


def _logprob_cpu(hidden, weight, target, bias, temperature, ignore_index):
    """(logp, entropy, p, log p) in torch's operations on float32 logits / T (CPU tensors)."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(),
                                        weight.float(), None if bias is None else bias.float())
    logp_all = (logits / temperature).log_softmax(-1)
    t = target.reshape(-1)
    counted = t != ignore_index
    logp = logp_all.gather(-1, torch.where(counted, t, 0)[:, None])[:, 0]
    logp = torch.where(counted, logp, torch.zeros((), dtype=logp.dtype))
    p = logp_all.exp()
    ent = -(p * logp_all).sum(-1)
    return logp.reshape(target.shape), ent.reshape(target.shape), p, logp_all


def _logprob_forward_impl(hidden, weight, target, bias, *args):
    if hidden.device.type == "cpu":
        return tuple(a.clone() for a in _logprob_cpu(hidden, weight, target, bias, args[0],
                                                     args[1])[:2])
    from cupyloss import linear

    logp, ent = linear.linear_log_probs(hidden, weight, target, bias, return_entropy=True,
                                        **_logprob_kwargs(*args))
    return logp, ent


def _logprob_forward_fake(hidden, weight, target, *rest):
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return (hidden.new_empty(tuple(target.shape), dtype=dtype),
            hidden.new_empty(tuple(target.shape), dtype=dtype))


def _logprob_backward_impl(grad_logp, grad_ent, hidden, weight, target, bias, *args):
    names = tuple(n for n, f in zip(_LINEAR_GRADS, args[-3:])
                  if f and (n != "bias" or bias is not None))
    args = args[:-3]
    if hidden.device.type == "cpu":
        temperature, ignore_index = args[0], args[1]
        _, ent, p, logp_all = _logprob_cpu(hidden, weight, target, bias, temperature,
                                           ignore_index)
        t = target.reshape(-1)
        counted = t != ignore_index
        dz = torch.zeros_like(p)
        if grad_logp is not None:
            g = torch.where(counted, grad_logp.reshape(-1).to(p.dtype), torch.zeros(()))
            dz -= g[:, None] * p
            dz.scatter_add_(1, torch.where(counted, t, 0)[:, None], g[:, None])
        if grad_ent is not None:
            e = grad_ent.reshape(-1).to(p.dtype)
            dz -= e[:, None] * p * (logp_all + ent.reshape(-1)[:, None])
        dz = dz / temperature
        x = hidden.reshape(-1, hidden.shape[-1]).float()
        out = {"hidden": (dz @ weight.float()).reshape(hidden.shape).to(hidden.dtype),
               "weight": (dz.T @ x).to(weight.dtype),
               "bias": None if bias is None else dz.sum(0).to(bias.dtype)}
    else:
        from cupyloss import linear

        got = linear.linear_log_probs_backward(
            None if grad_logp is None else grad_logp.contiguous(), hidden, weight, target, bias,
            grad_entropy=None if grad_ent is None else grad_ent.contiguous(), wrt=names or None,
            **_logprob_kwargs(*args)) if names else ()
        got = (got,) if names and len(names) == 1 else got
        out = dict(zip(names, got))
    return tuple(out[n] if n in names else hidden.new_empty((0,)) for n in _LINEAR_GRADS)


def _logprob_backward_fake(grad_logp, grad_ent, hidden, weight, target, bias, *rest):
    names = tuple(n for n, f in zip(_LINEAR_GRADS, rest[-3:]) if f)
    like = {"hidden": hidden, "weight": weight, "bias": bias}
    return tuple(torch.empty_like(like[n]) if n in names and like[n] is not None
                 else hidden.new_empty((0,)) for n in _LINEAR_GRADS)


def _logprob_setup_context(ctx, inputs, output):
    hidden, weight, target, bias = inputs[:4]
    ctx.save_for_backward(hidden, weight, target, bias)
    ctx.args = inputs[4:]


def _logprob_formula(ctx, grad_logp, grad_ent):
    hidden, weight, target, bias = ctx.saved_tensors
    need = ctx.needs_input_grad
    flags = (need[0], need[1], need[3] and bias is not None)
    got = torch.ops.cupyloss.linear_log_probs_backward(grad_logp, grad_ent, hidden, weight,
                                                       target, bias, *ctx.args, *flags)
    out = [g if f else None for g, f in zip(got, flags)]
    return out[0], out[1], None, out[2], *(None,) * len(ctx.args)


_logprob_op = _op_pair(
    "linear_log_probs", (_logprob_forward_impl, _logprob_forward_fake),
    (_logprob_backward_impl, _logprob_backward_fake),
    (f"({_LOGPROB_ARGS}) -> (Tensor, Tensor)",
     f"(Tensor? grad_logp, Tensor? grad_ent, {_LOGPROB_ARGS}, bool wrt_hidden, "
     f"bool wrt_weight, bool wrt_bias) -> (Tensor, Tensor, Tensor)"),
    _logprob_setup_context, _logprob_formula)


class _LinearLogProbs(torch.autograd.Function):
    """Eager calls on CUDA tensors: the forward pass forms log-probabilities and entropy (one
    product a chunk); backward forms the logits again with the upstream gradients of both."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, kwargs):
        from cupyloss import linear

        ctx.kwargs = kwargs
        ctx.save_for_backward(hidden, weight, bias, target)
        return linear.linear_log_probs(hidden, weight, target, bias, return_entropy=True,
                                       **kwargs)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        from cupyloss import linear

        hidden, weight, bias, target = ctx.saved_tensors
        need = ctx.needs_input_grad
        names = tuple(n for n, f in zip(_LINEAR_GRADS, (need[0], need[1], need[2])) if f)
        if not names:
            return None, None, None, None, None
        got = linear.linear_log_probs_backward(
            None if grad_logp is None else grad_logp.contiguous(), hidden, weight, target, bias,
            grad_entropy=None if grad_ent is None else grad_ent.contiguous(), wrt=names,
            **ctx.kwargs)
        got = dict(zip(names, (got,) if len(names) == 1 else got))
        return got.get("hidden"), got.get("weight"), got.get("bias"), None, None


def linear_log_probs(hidden, weight, target, bias=None, *, temperature=1.0,
                     return_entropy=False, ignore_index=-100, max_workspace_bytes=None):
    """Per-token ``log_softmax((hidden @ weight.T + bias).float() / temperature).gather(target)``
    (and the entropy of that distribution) with autograd, the logits never whole.

    cupyloss.linear_log_probs (its docstring has the formulas) on CUDA tensors: forward forms
    the float32 logits a chunk at a time (one matrix product a chunk) and keeps nothing of them;
    backward forms them again with the upstream gradients of the log-probabilities and of the
    entropy (three products a chunk), so any objective written on them in torch (a policy
    gradient, PPO's clipped ratio, DPO's margins, an entropy bonus) is differentiated at the
    fused head's memory.  Inside ``torch.autocast("cuda")`` the products run in the autocast
    dtype, as for linear_cross_entropy.  On CPU tensors: torch's own operations.  Under
    torch.compile the call is the op ``torch.ops.cupyloss.linear_log_probs``.

    Args:
      hidden: (..., H); weight: (V, H); target: class indices shaped like hidden without its
        last dim; bias: None or (V,).
      temperature: > 0; the logits are divided by it (a sampler's temperature).
      return_entropy: also return the entropy of softmax(logits / temperature).
      ignore_index: a target whose log-probability is 0 (and has no gradient).
      max_workspace_bytes: bytes a call may hold besides its results (cupyloss.linear.plan).

    Returns:
      logp, or ``(logp, entropy)``: target's shape, float32 (float64 for float64 inputs).

    Example:
      >>> logp, ent = cupyloss.torch.linear_log_probs(h, model.lm_head.weight, tokens,
      ...                                             temperature=0.9, return_entropy=True)
      >>> loss = -(advantages * logp).mean() - 0.01 * ent.mean()
    """
    from cupyloss import linear

    temperature = linear._temperature(temperature)
    compute = _torch_autocast.linear_compute(hidden, weight, bias)
    tensors = (hidden, weight, target, bias)
    traced = _compiling() or _dispatch_modes() or any(
        t is not None and (type(t) is not _Tensor or _is_functional(t)) for t in tensors)
    if traced or hidden.device.type == "cpu":
        if hidden.device.type == "cpu" and not traced:
            logp, ent = _logprob_cpu(hidden, weight, target, bias, temperature,
                                     int(ignore_index))[:2]
        else:
            logp, ent = _logprob_op(hidden, weight, target, bias, temperature, int(ignore_index),
                                    -1 if max_workspace_bytes is None
                                    else int(max_workspace_bytes), compute or "")
    else:
        kwargs = dict(temperature=temperature, ignore_index=int(ignore_index),
                      max_workspace_bytes=max_workspace_bytes, compute_dtype=compute)
        logp, ent = _LinearLogProbs.apply(hidden, weight, bias, target, kwargs)
    return (logp, ent) if return_entropy else logp


from cupyloss.torch import (
    _parallel as _torch_parallel)  # noqa: E402  (vocab-parallel, over torch.distributed)

from cupyloss.torch import _posttrain  # noqa: E402  (on linear_log_probs above)
from cupyloss.torch._posttrain import (  # noqa: E402
    linear_cpo_loss, linear_dpo_loss, linear_grpo_loss, linear_jsd, linear_kto_loss,
    linear_orpo_loss, linear_simpo_loss)

_posttrain.use(linear_log_probs, _linear_scale)

vocab_parallel_cross_entropy = _torch_parallel.vocab_parallel_cross_entropy
vocab_parallel_linear_cross_entropy = _torch_parallel.vocab_parallel_linear_cross_entropy
VocabParallelCrossEntropyLoss = _torch_parallel.VocabParallelCrossEntropyLoss

__all__ = sorted([*LOSSES, *(cls.__name__ for cls in MODULES.values()), "LOSSES", "MODULES",
                  "SKIPPED", "gradients_in_forward", "scale_by_grad_output",
                  "linear_cross_entropy", "LinearCrossEntropyLoss", "linear_log_probs",
                  "vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy",
                  "VocabParallelCrossEntropyLoss", "linear_grpo_loss", "linear_dpo_loss",
                  "linear_orpo_loss", "linear_cpo_loss", "linear_simpo_loss",
                  "linear_kto_loss", "linear_jsd"])
