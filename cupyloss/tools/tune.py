"""Tune the launch table on this GPU.

    python -m cupyloss.tools.tune [--knobs A,B] [--reps 10] [--margin 0.02] [--scale 1]
                            [--max-seconds S] [--write]

The knobs of cupyloss._core.tuning (launch choices that are not the losses' math) are tried one at a
time, in the table's order: each candidate value is set for this GPU in this process, the
kernels it changes compiled (all of a knob's candidates at once, in a process a core: the
kernels recorded from one call of each workload), and the workloads that run those kernels
timed (device time, cupyloss.bench._timing, medians of --reps; a knob's workloads are made once, after
the previous knob's are freed and the device has settled, and kept over its candidates).  A
candidate takes a knob's place only where its mean time ratio to the value in force beats
1 - --margin (default 2%, about the spread of one run), or where one workload's does and none
is slower by a quarter of the margin; the knobs after it are tried with it.

Workloads (value_and_grad unless marked; float32 unless marked), each tagged with the kernels
it runs:
  flat value    mse_loss 32768^2 (forward), kl_div 16384^2 (forward)
  flat grad     mse_loss 32768^2, mse_loss 16384^2 bfloat16
  flat heavy    kl_div 16384^2, binary_cross_entropy_with_logits 16384^2 bfloat16
  rows          hinge_loss 32768^2 with a (32768,) target (forward and value_and_grad),
                mse_loss with a (4096,) row input over (8192, 4096)
  reduce        mse_loss with a per-channel (1, 64, 1, 1), a per-row (8192, 1) and a 0-d
                input over its target
  row           cross_entropy 8192 x 16384, 40000, 65536, 128256, 152064 and 180224
                bfloat16 (one block a row with one and two kept tiles, a pair, a pair with
                one and two tiles read again), 32768 x 4096 (forward and value_and_grad),
                jsd 8192 x 32768 bfloat16
  pair          triplet_margin_loss 3 x 32768 x 8192 (forward)

A loss's own shape (_tuning.FUNCTOR_SHAPES) is tuned by naming its fields in --knobs,
"<functor template>.<field>" ("KlDivOp.reduce_blocks_f32"; the fields: _tuning.FUNCTOR_FIELDS),
never by default: that loss's value_and_grad in the kernel the field shapes (functor_workloads)
is the workload, and the row written is that GPU's alone.

Prints this GPU's rows of the knobs tried; --write puts them into cupyloss/_core/tuning.csv in place
of this GPU's values of those knobs there (its other rows stay; a GPU without a row of its own
gets the values it ran, those of the row it adopted, for the rest).  --summarize CSV prints a
measurements file as the Markdown table docs/tuning.md quotes.  --max-seconds stops before a
knob that would start past that time, with the rows of the knobs done (a run split over
several calls: name the rest with --knobs).  Every measurement goes to --out (default
benchmarks/results/tune-<gpu>.csv) as data: gpu, knob, value, workload, ms, GB/s, chosen.
Never a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import math
import multiprocessing
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

__all__ = ["choose", "tags", "functor_workloads", "summarize", "record", "candidate_jobs",
           "main"]


def tags(knob: str) -> set[str]:
    """The workload tags whose kernels knob `knob` changes (a loss's shape field: that loss's
    own workloads, functor_workloads)."""
    if "." in knob:
        return {f"functor {knob}"}
    if knob.startswith("ROW_"):
        return {"row"}
    if knob.startswith("PAIR_"):
        return {"pair"}
    if knob.startswith("REDUCE"):
        return {"reduce"}
    if knob.startswith("ROWS"):
        return {"rows"}
    if knob in ("FLAT_UNROLL_VALUE", "FLAT_UNROLL_VALUE_CHEAP", "FLAT_STEPS_VALUE"):
        return {"flat value"}
    if knob.startswith("FLAT") and knob.endswith("HEAVY"):
        return {"flat heavy"}
    if knob == "FLAT_STEPS_GRAD":
        return {"flat grad", "flat heavy"}
    return {"flat grad"}


def choose(current: int, times: dict[int, dict[str, float]], margin: float) -> int:
    """The value to keep from `times` ({value: {workload: ms}}, the current value among them):
    of the values whose mean ratio of time to the current value's over the workloads is below
    1 - margin, or that take one workload below 1 - margin and none above 1 + margin / 4 (a gain
    only one workload can show, the others unharmed), the one with the least mean ratio; else
    `current`."""
    base = times[current]
    best, best_ratio = current, 1.0
    for v, row in times.items():
        ratios = [row[w] / base[w] for w in base]
        mean = statistics.fmean(ratios)
        gains = mean < 1.0 - margin or (min(ratios) < 1.0 - margin and
                                        max(ratios) < 1.0 + margin / 4)
        if v != current and gains and mean < best_ratio:
            best, best_ratio = v, mean
    return best


@dataclasses.dataclass
class Workload:
    name: str
    tag: str
    nbytes: int                # bytes read + written, for GB/s
    make: Callable             # () -> the call, its arrays held in its closure


def _workloads(scale: float) -> list[Workload]:
    import cupy
    import ml_dtypes
    import numpy as np

    import cupyloss

    big, mid = int(32768 * scale), int(16384 * scale)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def normal(shape, dtype=cupy.float32, seed=0):
        v = cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32)
        return v if dtype == cupy.float32 else v.astype(dtype)

    def probs(n, seed):
        p = cupy.random.default_rng(seed).random((n, n), dtype=cupy.float32) + 1e-3
        return p / p.sum(-1, keepdims=True)

    def pair(f, a_shape, b_shape, dtype=cupy.float32, **kw):
        def make():
            a, b = normal(a_shape, dtype, 1), normal(b_shape, dtype, 2)
            return lambda: f(a, b, **kw)
        return make

    def kl(vag):
        def make():
            p, q = probs(mid, 1), probs(mid, 2)
            f = cupyloss.kl_div_value_and_grad if vag else cupyloss.kl_div
            return lambda: f(p, q, "batchmean", log_input=False)
        return make

    def hinge(vag):
        def make():
            s = normal((big, big))
            t = cupy.sign(normal((big,), seed=3))
            f = cupyloss.hinge_loss_value_and_grad if vag else cupyloss.hinge_loss
            return lambda: f(s, t)
        return make

    def bce():
        def make():
            x = normal((mid, mid), bf16, 1)
            t = (cupy.random.default_rng(2).random((mid, mid)) < 0.5).astype(bf16)
            return lambda: cupyloss.binary_cross_entropy_with_logits_value_and_grad(x, t)
        return make

    def cross_entropy(rows, cols, dtype, vag):
        def make():
            x = normal((rows, cols), dtype, 1)
            t = cupy.random.default_rng(2).integers(0, cols, rows)
            f = cupyloss.cross_entropy_value_and_grad if vag else cupyloss.cross_entropy
            return lambda: f(x, t)
        return make

    def jsd():
        def make():
            s, t = (normal((8192, 32768), cupy.float32, seed) for seed in (1, 2))
            s, t = ((v - cupy.log(cupy.exp(v).sum(-1, keepdims=True))).astype(bf16)
                    for v in (s, t))
            return lambda: cupyloss.jsd_value_and_grad(s, t)
        return make

    def triplet():
        def make():
            a, p, n = (normal((big, 8192), cupy.float32, seed) for seed in (1, 2, 3))
            return lambda: cupyloss.triplet_margin_loss(a, p, n)
        return make

    f4 = 4
    n2, m2 = big * big, mid * mid
    vag = cupyloss.mse_loss_value_and_grad
    return [
        Workload("mse_loss 32768^2 forward", "flat value", 2 * n2 * f4,
                 pair(cupyloss.mse_loss, (big, big), (big, big))),
        Workload("kl_div 16384^2 forward", "flat value", 2 * m2 * f4, kl(False)),
        Workload("mse_loss 32768^2", "flat grad", 3 * n2 * f4, pair(vag, (big, big), (big, big))),
        Workload("mse_loss 16384^2 bfloat16", "flat grad", 3 * m2 * 2,
                 pair(vag, (mid, mid), (mid, mid), bf16)),
        Workload("kl_div 16384^2", "flat heavy", 3 * m2 * f4, kl(True)),
        Workload("bce_with_logits 16384^2 bfloat16", "flat heavy", 3 * m2 * 2, bce()),
        Workload("hinge_loss 32768^2, (32768,) target, forward", "rows", n2 * f4, hinge(False)),
        Workload("hinge_loss 32768^2, (32768,) target", "rows", 2 * n2 * f4, hinge(True)),
        Workload("mse_loss (4096,) over (8192, 4096)", "rows", 8192 * 4096 * f4,
                 pair(vag, (4096,), (8192, 4096))),
        Workload("mse_loss (1, 64, 1, 1) over (256, 64, 56, 56)", "reduce",
                 256 * 64 * 56 * 56 * f4, pair(vag, (1, 64, 1, 1), (256, 64, 56, 56))),
        Workload("mse_loss (8192, 1) over (8192, 4096)", "reduce", 8192 * 4096 * f4,
                 pair(vag, (8192, 1), (8192, 4096))),
        Workload("mse_loss () over (8192, 4096)", "flat grad", 8192 * 4096 * f4,
                 pair(vag, (), (8192, 4096))),
        Workload("cross_entropy 8192 x 128256 bfloat16", "row", 2 * 8192 * 128256 * 2,
                 cross_entropy(8192, 128256, bf16, True)),
        Workload("cross_entropy 32768 x 4096, forward", "row", 32768 * 4096 * f4,
                 cross_entropy(32768, 4096, cupy.float32, False)),
        Workload("cross_entropy 32768 x 4096", "row", 2 * 32768 * 4096 * f4,
                 cross_entropy(32768, 4096, cupy.float32, True)),
        Workload("cross_entropy 8192 x 16384 bfloat16", "row", 2 * 8192 * 16384 * 2,
                 cross_entropy(8192, 16384, bf16, True)),
        Workload("cross_entropy 8192 x 40000 bfloat16", "row", 2 * 8192 * 40000 * 2,
                 cross_entropy(8192, 40000, bf16, True)),
        Workload("cross_entropy 8192 x 65536 bfloat16", "row", 2 * 8192 * 65536 * 2,
                 cross_entropy(8192, 65536, bf16, True)),
        Workload("cross_entropy 8192 x 152064 bfloat16", "row", 2 * 8192 * 152064 * 2,
                 cross_entropy(8192, 152064, bf16, True)),
        Workload("cross_entropy 8192 x 180224 bfloat16", "row", 2 * 8192 * 180224 * 2,
                 cross_entropy(8192, 180224, bf16, True)),
        Workload("jsd 8192 x 32768 bfloat16", "row", 3 * 8192 * 32768 * 2, jsd()),
        Workload("triplet_margin_loss 3 x 32768 x 8192, forward", "pair", 3 * big * 8192 * f4,
                 triplet()),
    ]


def functor_workloads(knob: str, scale: float) -> list[Workload]:
    """The workloads of a loss's shape field "<Template>.<field>" (_tuning.functor_knob): the
    first registered loss with that functor template, value_and_grad, in the kernel the field
    shapes: its target a (4096,) row over (8192, 4096) for the rows fields, an (8192, 1) column
    for the reduce ones, every operand 16384^2 for flat_blocks_16; bfloat16 for the _16 fields,
    else float32.  Values uniform in (0.05, 0.95): within every loss's domain."""
    import cupy
    import ml_dtypes
    import numpy as np

    import cupyloss
    from cupyloss._core import registry as _registry, tuning as _tuning

    _tuning.functor_knob(knob)   # refuses what is not one
    template, _, field = knob.partition(".")
    spec = next(s for s in _registry.SPECS.values() if s.functor == template)
    n, rows, cols = int(16384 * scale), int(8192 * scale), int(4096 * scale)
    if field == "flat_blocks_16":
        full, target = (n, n), (n, n)
    elif field.startswith("rows"):
        full, target = (rows, cols), (cols,)
    else:
        full, target = (rows, cols), (rows, 1)
    dtype = np.dtype(ml_dtypes.bfloat16) if field.endswith("_16") else np.dtype(np.float32)
    shapes = [target if a == "target" else full for a in spec.arrays]
    f = getattr(cupyloss, f"{spec.name}_value_and_grad")

    def make():
        rng = cupy.random.default_rng(1)
        arrays = [(rng.random(shape, dtype=cupy.float32) * 0.9 + 0.05).astype(dtype)
                  for shape in shapes]
        return lambda: f(*arrays)

    nbytes = 2 * sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    return [Workload(f"{spec.name} {' x '.join(map(str, shapes))} {dtype.name}",
                     f"functor {knob}", nbytes, make)]


def _reset() -> None:
    """Forget every kernel and plan built with the knobs in force before."""
    from cupyloss.pointwise import _family as _pointwise
    from cupyloss.rowclass import _family as _rowclass
    from cupyloss.rowpair import _family as _rowpair
    from cupyloss.rowwise import _family as _rowwise
    from cupyloss._core import source as _source

    _source._function.cache_clear()
    _source._resident.cache_clear()
    for engine in (_pointwise, _rowwise, _rowclass, _rowpair):
        engine._PLANS.clear()


def record(work: list[Workload]) -> dict[str, set[tuple[str, str]]]:
    """{tag: {(file, name expression)}}: the kernels each tag's workloads load, from one call of
    each with the knobs in force (what a candidate of a compile-time knob must build)."""
    import cupy

    from cupyloss._core import source as _source

    seen: dict[str, set[tuple[str, str]]] = {}
    real = _source.function

    def spy(file, expression):
        seen[tag].add((file, expression))
        return real(file, expression)

    _source.function = spy
    try:
        for w in work:
            tag = w.tag
            seen.setdefault(tag, set())
            call = w.make()
            call()
            del call
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        _source.function = real
    return seen


def _build(job) -> None:
    """Worker: one kernel (file, name, arch, gpu, {knob: value}) into the cache, with those
    values of the knobs for that GPU."""
    from cupyloss._core import source as _source, tuning as _tuning

    file, name, arch, gpu, values = job
    _tuning._OVERRIDES[gpu] = dict(values)
    _source.cached(file, [name], arch, gpu)


def candidate_jobs(knob: str, kernels: set, arch: str, gpu: str, values: dict) -> list:
    """The _build jobs of a compile-time knob's candidates: `kernels` ({(file, name)}) of
    pointwise.cu with the values in force (`values`) and the knob at each candidate."""
    from cupyloss._core import tuning as _tuning

    spec = _tuning.knob(knob)
    if not spec.compiled:
        return []
    return [(file, name, arch, gpu, {**values, knob: v}) for v in spec.candidates
            for file, name in sorted(kernels) if file == "pointwise.cu"]


class _Live:
    """The calls of the workloads being timed, their arrays kept between candidates.

    Memory given back to the driver slows the kernels of the next few milliseconds (_timing.
    SETTLE_S): made and freed per candidate, one workload timed 0.119 ms where it takes 0.104
    (H100), and whichever value was timed there looked slower.  So a knob's workloads are made
    once, kept while the next knob uses them, and freed then, with a settle after.
    """

    def __init__(self):
        self.calls: dict[str, Callable] = {}

    def keep(self, work: list[Workload]) -> dict[str, Callable]:
        import cupy

        from cupyloss.bench import _timing

        names = {w.name for w in work}
        if set(self.calls) - names:
            self.calls = {k: v for k, v in self.calls.items() if k in names}
            cupy.get_default_memory_pool().free_all_blocks()
        fresh = [w for w in work if w.name not in self.calls]
        for w in fresh:
            self.calls[w.name] = w.make()
        if fresh:
            time.sleep(_timing.SETTLE_S)
        return self.calls


def _measure(calls: dict[str, Callable], reps: int) -> dict[str, float]:
    """{workload: ms} of `calls` with the knobs in force."""
    from cupyloss.bench import _timing

    return {name: _timing.gpu_ms(call, reps) for name, call in calls.items()}


def summarize(path: pathlib.Path) -> str:
    """A Markdown table of a measurements file (--out): per GPU and knob, the default, the value
    chosen, its mean time ratio to the default's over the knob's workloads, the best and worst
    workload ratios, and the next best value with its mean ratio (how near the choice was;
    docs/tuning.md quotes it)."""
    from cupyloss._core import tuning as _tuning

    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    ms: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    chosen: dict[tuple[str, str], int] = {}
    for row in rows:
        key = (row["gpu"], row["knob"])
        ms.setdefault(key, {}).setdefault(int(row["value"]), {})[row["workload"]] = float(row["ms"])
        if row["chosen"] == "1":
            chosen[key] = int(row["value"])
    lines = ["| GPU | knob | default | chosen | mean time ratio | workloads, best / worst | "
             "next best |", "|---|---|---|---|---|---|---|"]
    for (gpu, knob), times in ms.items():
        default = _tuning.knob(knob).default
        pick = chosen.get((gpu, knob), default)
        if default not in times or pick not in times:
            continue

        def ratios(v):
            return [times[v][w] / times[default][w] for w in times[default]]

        mine = ratios(pick)
        rivals = sorted((statistics.fmean(ratios(v)), v) for v in times if v != pick)
        rival = f"{rivals[0][1]} ({rivals[0][0]:.3f})" if rivals else "-"
        lines.append(f"| {gpu} | {knob} | {default} | {pick} | {statistics.fmean(mine):.3f} | "
                     f"{min(mine):.3f} / {max(mine):.3f} | {rival} |")
    return "\n".join(lines)


def write_rows(path: pathlib.Path, gpu: str, chosen: dict[str, int],
               traits: dict[str, int] | None = None,
               base: dict[str, int] | None = None) -> None:
    """Put `chosen` ({knob: value}) and the GPU's `traits` ({trait: value}, _tuning.TRAITS) in
    the table file at `path` as GPU `gpu`'s values of them; its rows of knobs not in `chosen`
    stay (a run of some knobs leaves the others as they were), or with `base` (the row a GPU
    without one of its own ran: _tuning.adopt) they come from there.  Other GPUs' rows stay as
    they were."""
    new = {k: str(v) for k, v in {**(base or {}), **(traits or {}), **chosen}.items()}
    rows: list[dict[str, str]] = []
    if path.is_file():
        with path.open(newline="") as fh:
            for r in csv.DictReader(fh):
                if r["gpu"] == gpu:
                    if base is not None and r["knob"] not in new:
                        continue
                    r = {**r, "value": new.pop(r["knob"], r["value"])}
                rows.append(r)
    # The GPU's new knobs after its last row (its rows stay where they were: a small diff).
    at = max((i + 1 for i, r in enumerate(rows) if r["gpu"] == gpu), default=len(rows))
    rows[at:at] = [{"gpu": gpu, "knob": k, "value": v} for k, v in new.items()]
    with path.open("w", newline="") as fh:
        out = csv.DictWriter(fh, ["gpu", "knob", "value"], lineterminator="\n")
        out.writeheader()
        out.writerows(rows)


def main(argv=None) -> dict[str, int]:
    from cupyloss._core import launch as _launch, tuning as _tuning

    parser = argparse.ArgumentParser(prog="python -m cupyloss.tools.tune",
                                     description=__doc__.splitlines()[0])
    tunable = [k.name for k in _tuning.KNOBS.values() if k.candidates]
    parser.add_argument("--knobs", help=f"comma-separated knobs (default: all of "
                        f"{', '.join(tunable)}); a loss's shape field as "
                        f"<functor template>.<field>, for example KlDivOp.reduce_blocks_f32")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--scale", type=float, default=1.0, help="side lengths x this")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no knob past this many seconds (0: no limit)")
    parser.add_argument("--write", action="store_true",
                        help=f"put this GPU's rows into {_tuning.TABLE}")
    parser.add_argument("--out", help="measurements CSV (default "
                        "benchmarks/results/tune-<gpu>.csv)")
    parser.add_argument("--summarize", metavar="CSV", help="print a Markdown table of a "
                        "measurements file and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(pathlib.Path(args.summarize)))
        return {}
    from cupyloss.bench import _timing

    _timing.need(parser.prog)
    knobs = args.knobs.split(",") if args.knobs else tunable
    unknown = []
    for k in knobs:
        if k in tunable:
            continue
        try:
            _tuning.functor_knob(k)
        except ValueError:
            unknown.append(k)
    if unknown:
        parser.error(f"no tunable knobs {', '.join(unknown)}; choose from {', '.join(tunable)}, "
                     f"or a loss's shape field <functor template>.<field> of "
                     f"{', '.join(_tuning.FUNCTOR_FIELDS)}")
    import cupy

    device = cupy.cuda.Device()
    limits = _launch.device_limits(device.id)
    gpu = limits.gpu
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    ran = _tuning.adopt(gpu, limits.traits)
    name = name.decode() if isinstance(name, bytes) else name
    print(f"{name} (table key {gpu}, {limits.traits}); knobs in force: the row of "
          f"{ran or 'none (the defaults)'} in {_tuning.TABLE.name}", flush=True)
    work = _workloads(args.scale) + [w for k in knobs if "." in k
                                     for w in functor_workloads(k, args.scale)]
    # Each candidate's kernels are compiled ahead of its timing, all at once in a pool of
    # processes (one at a time on first use they would take most of the run).
    kernels = record([w for w in work if any(w.tag in tags(k) for k in knobs)])
    pool = concurrent.futures.ProcessPoolExecutor(
        max(1, len(os.sched_getaffinity(0))), mp_context=multiprocessing.get_context("spawn"))
    out = pathlib.Path(args.out or f"benchmarks/results/tune-{gpu}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = {}
    live = _Live()
    start = time.perf_counter()
    with out.open("w", newline="") as fh:
        log = csv.writer(fh, lineterminator="\n")
        log.writerow(["gpu", "knob", "value", "workload", "ms", "GB/s", "chosen"])
        for n, knob in enumerate(knobs):
            if args.max_seconds and time.perf_counter() - start > args.max_seconds:
                print(f"stopped at {args.max_seconds:.0f} s; not tried: "
                      f"{','.join(knobs[n:])}", flush=True)
                break
            mine = [w for w in work if w.tag in tags(knob)]
            current = _tuning.value(knob, gpu)
            used = set().union(*(kernels.get(tag, set()) for tag in tags(knob)))
            in_force = dict(_tuning._OVERRIDES.get(gpu, {}))
            list(pool.map(_build, candidate_jobs(knob, used, device.compute_capability, gpu,
                                                  in_force), chunksize=2))
            calls = live.keep(mine)
            times = {}
            for v in _tuning.knob(knob).candidates:
                _tuning._OVERRIDES.setdefault(gpu, {})[knob] = v
                _reset()
                times[v] = _measure(calls, args.reps)
            best = choose(current, times, args.margin)
            _tuning._OVERRIDES[gpu][knob] = chosen[knob] = best
            _reset()
            for v, row in times.items():
                for w in mine:
                    log.writerow([gpu, knob, v, w.name, f"{row[w.name]:.4f}",
                                  f"{w.nbytes / row[w.name] / 1e6:.0f}", int(v == best)])
            fh.flush()
            ratios = {v: statistics.fmean(times[v][w.name] / times[current][w.name]
                                          for w in mine) for v in times}
            summary = ", ".join(f"{v}: {r:.3f}" for v, r in ratios.items())
            print(f"{knob}: {current} -> {best}  (mean time ratio {summary}; "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)
    pool.shutdown()
    print("\n" + "\n".join(f"{gpu},{k},{v}" for k, v in chosen.items()))
    if args.write:
        write_rows(_tuning.TABLE, gpu, chosen, limits.traits,
                   None if ran == gpu else _tuning.values(ran))
        print(f"written to {_tuning.TABLE}")
    print(f"measurements: {out}")
    return chosen


if __name__ == "__main__":
    main()
    sys.exit(0)
