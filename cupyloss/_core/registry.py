"""The registry of pointwise losses: one entry per loss, next to the host mirror of its options.

Each entry names the loss's functor in kernels/losses.cuh, its array arguments in torch's order
(required ones; then optional ones, which default to None and then read as `fill` everywhere),
the reductions it takes, and `params`: the loss's options, each a C ``double`` (F64) or ``long
long`` (I64, also for bools).  The options named in `modes` (booleans that choose between
formulas) are template arguments of the functor, bit i for modes[i] (``KlDivOp<2>``), so each
combination is a kernel holding only its own formula; `modes` may also name optional arrays (the
bit is set when the array is given: an absent weight is then the constant 1 in the kernel, which
holds no weight arithmetic).  `constants` names option values that calls usually give and that a
kernel computes far more cheaply when it knows them (sigmoid_focal_loss's gamma = 2: a square,
where any other gamma takes powf behind a branch that keeps every element's other work in the
loop): bit len(modes) + i is set when the call's option equals constants[i]'s value, and the
option stays in Params for the general formula.  The other options are the host mirror of the
functor's Params struct, its fields in declaration order, so the kernel parameter is a run of
64-bit words.  A functor without such options has NoParams (one unused word).  `views` maps an
array argument to the shape torch views it as before broadcasting (gaussian_nll_loss's var).
Adding a pointwise loss: its functor, one entry here, a reference in tests/reference.py, and the
public functions in pointwise.py.
"""

from __future__ import annotations

import dataclasses
import importlib

from cupyloss._core import args as _args

F64 = "f64"
I64 = "i64"


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered pointwise loss (see the module docstring)."""

    name: str
    functor: str
    arrays: tuple = ("input", "target")
    optional: tuple = ()
    params: tuple = ()          # ((option, F64 | I64), ...): the options, in order
    modes: tuple = ()           # options (of params) and optional arrays (set: given) that
                                # are the functor's template bits
    constants: tuple = ()       # ((option, value), ...): further template bits, set when the
                                # option equals the value (the option stays in Params)
    reductions: tuple = ("none", "mean", "sum")
    fill: float = 1.0           # what an optional array left out reads as
    views: tuple = ()           # ((array, view(input_shape, shape) -> shape), ...)
    numbers: tuple = ()         # array arguments that may also be a Python number
    # Derived: every array argument, required then optional (the kernel's operands in order);
    # whether every call gives all of them as arrays; the want_grads of no gradient and of all.
    operands: tuple = dataclasses.field(init=False)
    fixed: bool = dataclasses.field(init=False)
    no_grads: tuple = dataclasses.field(init=False)
    all_grads: tuple = dataclasses.field(init=False)

    def __post_init__(self):
        operands = self.arrays + self.optional
        object.__setattr__(self, "operands", operands)
        object.__setattr__(self, "fixed", not self.optional and not self.numbers)
        object.__setattr__(self, "no_grads", (False,) * len(operands))
        object.__setattr__(self, "all_grads", (True,) * len(operands))

    @property
    def param_words(self) -> int:
        """Words of the functor's Params struct (NoParams is one)."""
        return max(1, sum(name not in self.modes for name, _ in self.params))

    def _check(self, values: tuple) -> None:
        if len(values) != len(self.params):
            raise ValueError(f"{self.name} takes {len(self.params)} options "
                             f"{[f for f, _ in self.params]}, got {len(values)}")

    def pack(self, values: tuple) -> list[int]:
        """The Params struct's words for option values given in `params` order (the modes are
        left out: they are template arguments)."""
        self._check(values)
        words = [_args.f64_word(v) if kind == F64 else _args.i64_word(int(v))
                 for (name, kind), v in zip(self.params, values) if name not in self.modes]
        return words or [0]

    @property
    def template_bits(self) -> int:
        """How many template bits the functor takes: one per mode and per constant."""
        return len(self.modes) + len(self.constants)

    def instance(self, values: tuple, arrays: tuple = ()) -> str:
        """The functor a call with these option values and these array arguments given (names)
        runs: ``functor<bits>`` where the entry has modes or constants (bit i set when option
        modes[i] is true, or when array modes[i] is given; bit len(modes) + j when option
        constants[j] has its value), else the functor."""
        if not self.template_bits:
            return self.functor
        self._check(values)
        given = dict(zip((name for name, _ in self.params), values))
        bits = sum(1 << i for i, mode in enumerate(self.modes)
                   if (given[mode] if mode in given else mode in arrays))
        bits += sum(1 << (len(self.modes) + j) for j, (name, value) in enumerate(self.constants)
                    if given[name] == value)
        return f"{self.functor}<{bits}>"

    def reduce_masks(self, instance: str) -> tuple:
        """The CONST masks pointwise_rows, pointwise_reduce and pointwise_flat's gradient
        instantiation are compiled for with functor `instance`: the operands that stay the same
        across a thread's rows, a unit or the whole call (bit k: operand k), every one of which is
        a row, a scalar, broadcast along all the reduced dims, or absent.  A nonempty set of
        operands the instance takes (the lead operand is always among them) but not all of them
        (the reduced dims come from one that streams), with every one it leaves out."""
        bits = int(instance.partition("<")[2].rstrip(">") or 0)
        absent = sum(1 << self.operands.index(mode) for i, mode in enumerate(self.modes)
                     if mode in self.optional and not (bits >> i) & 1)
        taken = (1 << len(self.operands)) - 1 - absent
        return tuple(absent | m for m in range(1, taken) if m & taken == m)

    def instances(self) -> tuple:
        """Every functor instance calls of this loss can run."""
        if not self.template_bits:
            return (self.functor,)
        return tuple(f"{self.functor}<{bits}>" for bits in range(1 << self.template_bits))


def gaussian_var_view(input_shape: tuple, var_shape: tuple) -> tuple:
    """The shape torch's gaussian_nll_loss gives var, or ValueError as torch raises it.

    The input's shape: kept.  The input's shape without its last dim: a trailing 1 is added.
    Same number of dims with exactly one mismatched dim, where var has size 1: kept.
    """
    input_shape, var_shape = tuple(input_shape), tuple(var_shape)
    if var_shape == input_shape:
        return var_shape
    if input_shape[:-1] == var_shape:
        return var_shape + (1,)
    if (len(input_shape) == len(var_shape)
            and sum(v for i, v in zip(input_shape, var_shape) if i != v) == 1):
        return var_shape
    raise ValueError("var is of incorrect size")


_MARGIN = (("margin", F64),)

# The registry: one entry per pointwise loss, in the order the public functions are listed.
SPECS = {spec.name: spec for spec in (
    LossSpec("mse_loss", "MseOp"),
    LossSpec("kl_div", "KlDivOp", params=(("log_target", I64), ("log_input", I64)),
             modes=("log_target", "log_input"), reductions=("none", "mean", "sum", "batchmean")),
    LossSpec("hinge_loss", "HingeOp", params=_MARGIN),
    LossSpec("l1_loss", "L1Op"),
    LossSpec("smooth_l1_loss", "SmoothL1Op", params=(("beta", F64),),
             constants=(("beta", 1.0),)),
    LossSpec("huber_loss", "HuberOp", params=(("delta", F64),)),
    LossSpec("binary_cross_entropy", "BceOp", optional=("weight",), modes=("weight",)),
    LossSpec("binary_cross_entropy_with_logits", "BceLogitsOp",
             optional=("weight", "pos_weight"), modes=("weight", "pos_weight")),
    LossSpec("soft_margin_loss", "SoftMarginOp"),
    LossSpec("hinge_embedding_loss", "HingeEmbeddingOp", params=_MARGIN),
    LossSpec("margin_ranking_loss", "MarginRankingOp", arrays=("input1", "input2", "target"),
             params=_MARGIN),
    LossSpec("poisson_nll_loss", "PoissonNllOp",
             params=(("log_input", I64), ("full", I64), ("eps", F64)),
             modes=("log_input", "full")),
    LossSpec("gaussian_nll_loss", "GaussianNllOp", arrays=("input", "target", "var"),
             params=(("full", I64), ("eps", F64)), views=(("var", gaussian_var_view),),
             numbers=("var",)),
    LossSpec("squared_hinge_loss", "SquaredHingeOp", params=_MARGIN),
    LossSpec("sigmoid_focal_loss", "SigmoidFocalOp", params=(("alpha", F64), ("gamma", F64)),
             constants=(("gamma", 2.0),)),
    LossSpec("log_cosh_loss", "LogCoshOp"),
)}


def functors() -> tuple:
    """Every registered functor instance, once each, in registration order."""
    return tuple(dict.fromkeys(f for spec in SPECS.values() for f in spec.instances()))


def reduce_masks(instance: str) -> tuple:
    """LossSpec.reduce_masks of the entry whose functor `instance` is."""
    spec = next(s for s in SPECS.values() if instance in s.instances())
    return spec.reduce_masks(instance)


# The modules holding a family's registry (a SPECS dict, name -> entry with at least `arrays` and
# `reductions`; optionally `loss_shape(input_shape, reduction)` and `module_name`, the torch
# adapter's nn.Module name for a loss torch lacks), in the order the adapters list their losses.  The core never imports an adapter
# or a framework; the adapters read every family from here.
FAMILIES = ("cupyloss.pointwise._family", "cupyloss.rowwise._family", "cupyloss.rowclass._family",
            "cupyloss.rowpair._family", "cupyloss.ctc._family")


def all_losses() -> dict:
    """Every registered loss of every family: name -> its registry entry.

    Pointwise losses come first (this module's SPECS), then each family in FAMILIES that
    imports (a family module that is absent is left out); a name registered by two families
    raises ValueError.
    """
    losses = dict(SPECS)
    for module_name in FAMILIES[1:]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        for name, spec in module.SPECS.items():
            if name in losses:
                raise ValueError(f"loss {name!r} is registered by {module_name} and by another "
                                 f"family")
            losses[name] = spec
    return losses


def unwrappable(name: str, spec, functions) -> str | None:
    """Why an adapter cannot wrap registered loss `name` (its entry lacks arrays or reductions,
    or `functions`, the cupyloss package, lacks one of its three public forms), or None."""
    for field in ("arrays", "reductions"):
        if not hasattr(spec, field):
            return f"its registry entry ({type(spec).__name__}) has no {field!r}"
    for suffix in ("", "_backward", "_value_and_grad"):
        if not callable(getattr(functions, name + suffix, None)):
            return f"cupyloss has no function {name + suffix}"
    return None
