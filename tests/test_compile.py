"""Every kernel compiles with NVRTC for sm_80 and sm_90, on a machine without a GPU.

CuPy compiles kernels/ at a user's first call, so a template that fails for one dtype or arch
would otherwise surface only there.  These tests drive libnvrtc through ctypes with what
`_source.cached` gives it: the source (`_source.source`: expanded, functor shapes in), the options
(`_source.OPTIONS`) and the name expressions (`_source.units`), plus -arch and the directory of
cuda_fp16.h / cuda_bf16.h.  libnvrtc and the headers come from the nvidia-cuda-nvrtc and
nvidia-cuda-runtime wheels (the `test` extra), else from the toolkit under $CUDA_PATH,
$CUDA_HOME or next to nvcc.  Without them the compile tests skip, saying why, unless
CUPYLOSS_REQUIRE_NVRTC=1 (set by .ci/run) makes that a failure.

Two passes keep the guarantee at a tenth of the cost of building every kernel as a call does:
- every name expression of every file, for each architecture, with NVRTC's fast-compile mode
  (-Ofc=max): the same front end, so every instantiation is type-checked, instantiated, lowered
  to PTX (checked for float atomics and for the parameter block the host packs) and assembled
  to SASS; only the optimiser's effort differs;
- with the runtime's own options, every instantiation of the row files and, of the others,
  the most general instantiation of each kernel template and dtype (its last name expression:
  the largest mask), so the optimised build a call runs is proven for every template, dtype and
  architecture too.

Compiles run in a pool of processes (threads of one process serialise inside libnvrtc).
"""

import concurrent.futures
import ctypes
import functools
import importlib.util
import json
import multiprocessing
import os
import pathlib
import re
import shutil

import pytest

from cupyloss._core import dtypes as _dtypes, source as _source

ARCHS = ("sm_80", "sm_90")  # A100 and H100: the GPUs the suite runs on
UNITS = _source.units()
NAMES_PER_PROGRAM = 16  # ~0.1 s front end a program; small enough to keep every core busy
FAST = ("-Ofc=max",)    # NVRTC's fast-compile mode: the first pass

NVRTC_SUCCESS = 0
# Types an atom/red instruction adds in floating point (PTX ISA "atom", "red").
FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f64"}


def _toolkit_roots():
    """Folders that may hold lib/libnvrtc.so* and include/cuda_fp16.h, wheels first."""
    roots = []
    spec = importlib.util.find_spec("nvidia")  # namespace package of NVIDIA's CUDA wheels
    for location in (spec.submodule_search_locations or []) if spec else []:
        # CUDA 13 wheels share nvidia/cu13; CUDA 12 ones use nvidia/cuda_nvrtc, cuda_runtime.
        roots += sorted(p for p in pathlib.Path(location).iterdir() if p.is_dir())
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(variable):
            roots.append(pathlib.Path(os.environ[variable]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(pathlib.Path(nvcc).resolve().parent.parent)
    return roots


@functools.lru_cache(maxsize=None)
def _toolchain():
    """(libnvrtc path, include dir) or (None, why not)."""
    roots = _toolkit_roots()
    libs = [lib for root in roots for sub in ("lib", "lib64")
            for lib in sorted((root / sub).glob("libnvrtc.so*"))]
    includes = [root / "include" for root in roots if (root / "include/cuda_fp16.h").is_file()]
    if not libs or not includes:
        missing = " and ".join(what for what, found in (("libnvrtc.so", libs),
                                                        ("cuda_fp16.h", includes)) if not found)
        return None, (f"{missing} not found in the nvidia wheels, $CUDA_PATH, $CUDA_HOME or "
                      f"beside nvcc (looked in {', '.join(map(str, roots)) or 'nothing'}); "
                      f"pip install nvidia-cuda-nvrtc nvidia-cuda-runtime")
    try:
        ctypes.CDLL(str(libs[0]))
    except OSError as exc:
        return None, f"{libs[0]} does not load: {exc}"
    return str(libs[0]), str(includes[0])


def _need_toolchain():
    """(libnvrtc path, include dir), else skip (or fail under CUPYLOSS_REQUIRE_NVRTC=1)."""
    lib, detail = _toolchain()
    if lib is None:
        if os.environ.get("CUPYLOSS_REQUIRE_NVRTC") == "1":
            pytest.fail(f"CUPYLOSS_REQUIRE_NVRTC=1 but {detail}")
        pytest.skip(detail)
    return lib, detail


def _read(size_fn, read_fn, program):
    """A string NVRTC hands out as a size query and a copy (the log, the PTX)."""
    size = ctypes.c_size_t()
    size_fn(program, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    read_fn(program, buffer)
    return buffer.value.decode(errors="replace")


def _param_bytes(ptx: str) -> dict:
    """{entry: bytes of its parameter block} from the PTX .entry declarations (each parameter
    placed at its alignment, as the launch's packed buffer must match)."""
    out = {}
    for entry in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        total = 0
        for param in re.finditer(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.[a-z]+(\d+)\s+\w+"
                                 r"(?:\[(\d+)\])?", entry.group(2)):
            align, bits, count = param.groups()
            size = int(bits) // 8
            step = int(align) if align else size
            total = -(-total // step) * step + size * int(count or 1)
        out[entry.group(1)] = total
    return out


def _compile(lib, include, file, source, names, arch, extra=(), options=None):
    """Compile `names` of `source` for `arch` (options `extra` added to `options`, default
    _source.OPTIONS): (status, log, {name: lowered}, float atomics, {lowered: parameter
    bytes})."""
    nvrtc = ctypes.CDLL(lib)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    program = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), file.encode(),
                                      0, None, None)
    if status != NVRTC_SUCCESS:
        return nvrtc.nvrtcGetErrorString(status).decode(), "", {}, [], {}
    try:
        for name in names:
            nvrtc.nvrtcAddNameExpression(program, name.encode())
        options = [*(_source.OPTIONS if options is None else options), *extra, f"-arch={arch}",
                   f"-I{include}"]
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        status = nvrtc.nvrtcCompileProgram(program, len(options), argv)
        log = _read(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, program)
        if status != NVRTC_SUCCESS:
            return nvrtc.nvrtcGetErrorString(status).decode(), log, {}, [], {}
        lowered = {}
        for name in names:
            out = ctypes.c_char_p()
            found = nvrtc.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(out))
            lowered[name] = out.value.decode() if found == NVRTC_SUCCESS and out.value else ""
        ptx = _read(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, program)
        atomics = sorted({op for op in re.findall(r"\b(?:atom|red)\.[\w.:]+", ptx)
                          if "add" in op.split(".") and FLOAT_TYPES & set(op.split("."))})
        return "", log, lowered, atomics, _param_bytes(ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


ROW_FILES = ("rowwise.cu", "rowclass.cu", "rowpair.cu")  # a few dozen names: all optimised


def general(file: str, names: list[str]) -> list[str]:
    """What the second pass compiles with the runtime's own options: every name expression of
    the row files, and of the others the last of each kernel template and first template
    argument (dtype), its most general instantiation (largest mask)."""
    if file in ROW_FILES:
        return list(names)
    last = {}
    for name in names:
        last[name.partition("<")[0], name.partition("<")[2].split(",")[0]] = name
    return list(last.values())


def _jobs(pool, lib, include, file, arch):
    """Futures of both passes over `file` for `arch` (the row files' second pass compiles every
    name with the runtime's options: their first pass would repeat it)."""
    source = _source.source(file)
    names = dict(UNITS)[file]
    fast = [] if file in ROW_FILES else [
        pool.submit(_compile, lib, include, file, source, names[i:i + NAMES_PER_PROGRAM], arch,
                    FAST) for i in range(0, len(names), NAMES_PER_PROGRAM)]
    full = [pool.submit(_compile, lib, include, file, source, [name], arch)
            for name in general(file, names)]
    return fast + full


def _pool():
    """A process pool of up to 16 workers forked from a fresh server process (forkserver, this
    module preloaded there), not from this one: JAX, which other test modules import, runs
    threads here that a fork would copy mid-lock."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return concurrent.futures.ProcessPoolExecutor(max(1, min(len(os.sched_getaffinity(0)), 16)),
                                                  mp_context=context)


@pytest.fixture(scope="module")
def compiled(request):
    """{(file, arch): [futures of _compile]} for the selected tests, all submitted at once."""
    lib, include = _need_toolchain()
    selected = {(item.callspec.params["file"], item.callspec.params["arch"])
                for item in request.session.items
                if getattr(item, "originalname", None) == "test_kernels_compile"
                and item.module.__name__ == __name__}
    with _pool() as pool:
        # The slow optimised builds first, so the pool ends on short jobs.
        jobs = {key: _jobs(pool, lib, include, *key)
                for key in sorted(selected, key=lambda key: key[0] != "rowwise.cu")}
        yield jobs
        for futures in jobs.values():
            for future in futures:
                future.cancel()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file, names", UNITS, ids=[file for file, _ in UNITS])
def test_kernels_compile(compiled, file, names, arch):
    lowered, atomics, params = {}, [], {}
    for future in compiled[file, arch]:
        error, log, got, float_atomics, param_bytes = future.result()
        assert not error and not re.search(r"\berror( #\S+)?:", log), (
            f"{file} for {arch}: {error}\n{log}")
        lowered.update(got)
        atomics += float_atomics
        params.update(param_bytes)
    missing = [name for name in names if not lowered.get(name)]
    assert not missing, f"{file} for {arch}: no lowered name for {missing}"
    assert not atomics, f"{file} for {arch}: float atomic adds {atomics} are non-deterministic"
    # The host packs each launch's parameters as 64-bit words (cupyloss/_core/args.py): a buffer of
    # another size than the kernel's parameter block fails every launch on the device.
    wrong = [(name, params.get(lowered[name]), 8 * words) for name in names
             for words in [_host_words(name)] if words is not None
             and params.get(lowered[name]) != 8 * words]
    assert not wrong, f"{file} for {arch}: (kernel, PTX parameter bytes, host bytes) {wrong}"


def test_general_covers_every_template_and_dtype():
    for file, names in UNITS:
        picked = general(file, names)
        templates = {(n.partition("<")[0], n.partition("<")[2].split(",")[0]) for n in names}
        assert set(picked) <= set(names) and len(picked) >= len(templates)
        assert {(n.partition("<")[0], n.partition("<")[2].split(",")[0]) for n in picked} == \
            templates
    pointwise = general("pointwise.cu", dict(UNITS)["pointwise.cu"])
    assert len(pointwise) == 3 * len(_dtypes.DTYPES)      # flat, rows, reduce a dtype


def _host_words(name: str):
    """Words of the host Layout that launches kernel `name` (None: not launched from a Layout)."""
    from cupyloss.pointwise import _family as _pointwise
    from cupyloss._core import registry as _registry
    from cupyloss.rowclass import _family as _rowclass
    from cupyloss.rowpair import _family as _rowpair
    from cupyloss.rowwise import _family as _rowwise
    from cupyloss import linear, posttrain

    kernel, _, args = name.partition("<")
    kernel = kernel.removeprefix("cupyloss::")
    layouts = {"sum_chunks": _pointwise.SUM_CHUNKS, "cross_entropy_rows": _rowwise.ROWS,
               "cross_entropy_cols": _rowwise.COLS, "class_weight_sum": _rowwise.WSUM,
               "rowclass_rows": _rowclass.ROWS, "rowclass_count": _rowclass.COUNT,
               "cross_entropy_rows_cluster": _rowwise.ROWS,
               "rowpair_rows": _rowpair.LAYOUT, "rowpair_finish": _rowpair.FINISH_LAYOUT,
               "narrow": linear.NARROW, "cross_entropy_slice_grad": _rowwise.SLICE,
               "logprob_stats": linear.STATS, "logprob_grad": linear.GRAD,
               "grpo_tokens": posttrain.TOKENS, "split_add": linear.SPLIT_ADD,
               "split_finish": linear.SPLIT_FINISH,
               "distill_stats": posttrain.DISTILL_STATS, "distill_grad": posttrain.DISTILL_GRAD}
    if kernel in layouts:
        return layouts[kernel].size
    if kernel.startswith("pointwise_"):
        functor = args.split(",")[1].strip().removeprefix("cupyloss::")
        spec = next(s for s in _registry.SPECS.values() if functor in s.instances())
        make = {"pointwise_flat": _pointwise.flat_layout, "pointwise_rows": _pointwise.rows_layout,
                "pointwise_reduce": _pointwise.reduce_layout}[kernel]
        return make(len(spec.operands), spec.param_words).size
    return None   # scale_by_grad_output: five words packed by cupyloss.torch._scale


def _code(file):
    """The expanded source of `file` with comments blanked (line numbers kept)."""
    text = _source.expand(file)
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("file", [file for file, _ in UNITS])
def test_no_atomic_add(file):
    # Determinism is a project rule: sums go through fixed-order block and grid reductions.
    lines = [f"{n}: {line.strip()}" for n, line in enumerate(_code(file).splitlines(), 1)
             if re.search(r"\batomicAdd\w*\s*\(", line)]
    assert not lines, f"{file} (expanded) calls atomicAdd:\n" + "\n".join(lines)


def test_units_cover_every_source_file():
    files = {path.name for path in _source.kernel_dir().glob("*.cu")}
    assert files == {file for file, _ in UNITS}


def test_runtime_compile_path_keeps_subnormals(monkeypatch, tmp_path):
    """What the runtime compiles with (_source.cached): OPTIONS with CuPy's include folders and
    no -ftz=true (RawModule's own compile adds it), one cubin an instantiation, whose mapping
    names its mangled symbol; a second request finds the entry and compiles nothing."""
    _need_toolchain()
    options = _source._nvrtc_options()
    assert not any(o.startswith(("-ftz", "--ftz", "-use_fast_math", "--use_fast_math"))
                   for o in options)
    assert set(_source.OPTIONS) <= set(options)
    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(tmp_path))
    name = "cupyloss::scale_by_grad_output<float, 4>"
    cubin = _source.cached("scale.cu", [name], "90")   # no GPU here: the arch is named
    assert cubin.parent == tmp_path and cubin.read_bytes()[:4] == b"\x7fELF"
    mangled = json.loads(cubin.with_suffix(".json").read_text())["names"]
    assert list(mangled) == [name] and mangled[name].startswith("_Z")
    calls = []
    monkeypatch.setattr(_source, "_nvrtc",
                        lambda *args: calls.append(args[2]) or (b"\x7fELF", {name: "_Z"}))
    assert _source.cached("scale.cu", [name], "90") == cubin and not calls
    assert _source.cached("scale.cu", [name], "80") != cubin and calls == ["80"]  # a key an arch


def test_a_cache_folder_that_cannot_be_written_is_read_and_passed_over(monkeypatch, tmp_path):
    """Kernels found in the cache folder load from it; a kernel it lacks, when it cannot be
    written (a read-only folder an image was built with), goes to the private folder."""
    _need_toolchain()
    shared, private = tmp_path / "shared", tmp_path / "private"
    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(shared))
    monkeypatch.setattr(_source, "private_dir", lambda: private)
    first, second = ("cupyloss::scale_by_grad_output<float, 1>",
                     "cupyloss::scale_by_grad_output<float, 4>")
    found = _source.cached("scale.cu", [first], "90")
    assert found.parent == shared
    real_replace = os.replace

    def replace(src, dst):
        if pathlib.Path(dst).parent == shared:
            raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert _source.cached("scale.cu", [first], "90") == found
    made = _source.cached("scale.cu", [second], "90")
    assert made.parent == private and made.with_suffix(".json").is_file()
    assert _source.cached("scale.cu", [second], "90") == made


def test_every_kernel_is_reachable_from_a_loss():
    """precompile builds what the losses reach: every instantiation but the benchmark's."""
    from cupyloss.tools import precompile

    reached = {(file, name) for file, name, _ in precompile.jobs(archs=["90"])}
    every = {(file, name) for file, names in UNITS for name in names if file != "bench.cu"}
    assert reached == every


def test_precompile_command(monkeypatch, tmp_path, capsys):
    """python -m cupyloss.tools.precompile for named losses, dtypes and architectures, without a
    GPU: one cache entry per kernel and architecture; a second run finds them all."""
    _need_toolchain()
    from cupyloss._core import source as _source
    from cupyloss.tools import precompile

    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(tmp_path))
    # a loss of few kernels (the command's work is the same for every loss)
    argv = ["--losses", "linear_log_probs", "--dtypes", "float64", "--arch", "80,sm_90", "-j",
            "2"]
    assert precompile.main(argv) == 0
    expected = {name for _, name in _source.reachable("linear_log_probs", "float64")}
    entries = sorted(tmp_path.glob("*.json"))
    assert len(entries) == 2 * len(expected)
    assert {name for e in entries for name in json.loads(e.read_text())["names"]} == expected
    stamps = {e: e.stat().st_mtime_ns for e in tmp_path.iterdir()}
    assert precompile.main(argv) == 0
    assert {e: e.stat().st_mtime_ns for e in tmp_path.iterdir()} == stamps
    assert f"{2 * len(expected)} kernels in {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--losses", "mse,cross_entropy"], "unknown losses mse"),
    (["--dtypes", "int8"], "unknown dtypes int8"),
])
def test_precompile_refuses_unknown_names(argv, message, capsys):
    from cupyloss.tools import precompile

    with pytest.raises(SystemExit):
        precompile.main(argv)
    assert message in capsys.readouterr().err


# The functors and dtypes whose pointwise kernels the knobs' candidates are compiled for: a
# cheap one, one with its own 4-byte shape, one heavy and streaming with 16-bit bounds.
TUNED_FUNCTORS = ("MseOp", "KlDivOp<0>", "BceOp<0>")
TUNED_DTYPES = ("float32", "bfloat16")


def _candidate_jobs(pool, lib, include):
    """{(knob, value): futures} of the most general pointwise kernels (with and without
    gradients) of TUNED_FUNCTORS x TUNED_DTYPES for sm_90 with each compile-time knob at each
    candidate value (fast mode)."""
    from cupyloss._core import tuning as _tuning

    infos = [info for info in _dtypes.DTYPES.values() if str(info.dtype) in TUNED_DTYPES]
    names = []
    for functor in TUNED_FUNCTORS:
        every = [n for info in infos for n in _source.pointwise_names(functor, info)]
        values = [n for n in every if ", false" in n]      # the value-only kernels' knobs too
        names += general("pointwise.cu", every) + general("pointwise.cu", values)
    source = _source.source("pointwise.cu")
    jobs = {}
    for knob in _tuning.KNOBS.values():
        if not knob.compiled:
            continue
        for v in knob.candidates:
            if v == knob.default:
                continue
            _tuning._OVERRIDES["candidate"] = {knob.name: v}
            options = _source.options("candidate")
            jobs[knob.name, v] = [
                pool.submit(_compile, lib, include, "pointwise.cu", source,
                            names[i:i + NAMES_PER_PROGRAM], "sm_90", FAST, options)
                for i in range(0, len(names), NAMES_PER_PROGRAM)]
    _tuning._OVERRIDES.pop("candidate", None)
    return jobs


def test_every_knob_candidate_compiles():
    """python -m cupyloss.tools.tune compiles the kernels with each compile-time knob at each of its
    candidate values: every one of them builds (NVRTC, sm_90, the most general instantiation of
    each pointwise kernel of a cheap, an own-shape and a heavy streaming functor)."""
    lib, include = _need_toolchain()
    with _pool() as pool:
        jobs = _candidate_jobs(pool, lib, include)
        failed = []
        for (knob, v), futures in jobs.items():
            for future in futures:
                error, log, *_ = future.result()
                if error or re.search(r"\berror( #\S+)?:", log):
                    failed.append(f"{knob}={v}: {error}\n{log[-2000:]}")
    assert jobs and not failed, "\n".join(failed)
