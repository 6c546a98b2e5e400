"""The launch table (cupyloss._core.tuning): a GPU's row takes the place of the defaults for that GPU
alone, reaches the compile options and the launch arithmetic, and keeps its cubins apart; a
row that names no knob, or a value the knob cannot take, is refused."""

import pathlib

import pytest

from cupyloss._core import launch as _launch, source as _source, tuning as _tuning
from cupyloss.pointwise import _launch as _pointwise_launch
from cupyloss._core.launch import DeviceLimits


@pytest.fixture
def table(tmp_path, monkeypatch):
    """write(rows) makes `rows` the launch table for the test."""
    path = tmp_path / "tuning.csv"

    def write(rows):
        path.write_text("gpu,knob,value\n" + "".join(f"{g},{k},{v}\n" for g, k, v in rows))
        monkeypatch.setattr(_tuning, "TABLE", path)
        _tuning._both.cache_clear()

    yield write
    _tuning._both.cache_clear()


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
                                       ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
                                       ("  Tesla T4 ", "tesla-t4")])
def test_gpu_key(name, key):
    assert _tuning.gpu_key(name) == key


def test_the_shipped_table_reads_and_every_default_is_a_candidate():
    assert _tuning.TABLE.is_file(), f"{_tuning.TABLE} is not installed with the package"
    traits = _tuning.read_traits(_tuning.TABLE)
    for gpu, row in _tuning.read_table(_tuning.TABLE).items():
        assert gpu == _tuning.gpu_key(gpu), gpu
        assert set(row) <= set(_tuning.KNOBS)
        assert set(traits.get(gpu, {})) == set(_tuning.TRAITS), gpu   # nearest_row reads them
    for knob in _tuning.KNOBS.values():
        assert not knob.candidates or knob.default in knob.candidates, knob


def test_a_row_changes_its_knob_on_its_gpu_alone(table):
    before = _tuning.values()
    table([("h200", "REDUCE_STEPS", 8), ("h200", "FLAT_STEPS_GRAD", 32)])
    mine = _tuning.values("h200")
    changed = {k for k in before if mine[k] != before[k]}
    assert changed == {"REDUCE_STEPS", "FLAT_STEPS_GRAD"}
    assert (mine["REDUCE_STEPS"], mine["FLAT_STEPS_GRAD"]) == (8, 32)
    assert _tuning.values("h100-80gb-hbm3") == before == _tuning.values()
    defines = set(_tuning.kernel_defines("h200")) ^ set(_tuning.kernel_defines())
    assert defines == {"-DCUPYLOSS_REDUCE_STEPS=8",
                       f"-DCUPYLOSS_REDUCE_STEPS={before['REDUCE_STEPS']}"}
    assert _source.options("h200") != _source.OPTIONS == _source.options("other")


@pytest.mark.parametrize("row, match", [(("h200", "REDUCE_STEP", 4), "no knob 'REDUCE_STEP'"),
                                        (("h200", "REDUCE_STEPS", 3), r"is not one of")])
def test_a_bad_row_is_refused_with_its_line(table, row, match):
    table([("h200", "REDUCE_STEPS", 8), row])
    with pytest.raises(ValueError, match=match) as err:
        _tuning.values("h200")
    assert "tuning.csv:3" in str(err.value)


def test_the_launch_arithmetic_reads_the_devices_row(table):
    """reduce_launch splits m into chunks of at least REDUCE_MIN_STEPS steps: the row's value
    on its GPU, the default elsewhere."""
    table([("h200", "REDUCE_MIN_STEPS", 32)])
    split = _pointwise_launch.split_reduced((2, 1 << 22), [(1 << 22, 1), (1, 0)], 1)
    plain = DeviceLimits(sm_count=132, max_grid_x=2**31 - 1, max_grid_y=65535,
                         max_shared_per_block=48 * 1024)
    tuned = DeviceLimits(**{**plain.__dict__, "gpu": "h200"})
    a, b = _pointwise_launch.reduce_launch(split, 4, plain), _pointwise_launch.reduce_launch(split, 4, tuned)
    assert a.nchunks == 2 * b.nchunks


def test_a_gpus_row_keeps_its_cubins_apart(table, tmp_path, monkeypatch):
    """The compile options, and so the cache key, follow the GPU's row: a GPU with its own
    values compiles its own cubin; one without shares the defaults'."""
    seen = []

    def fake_nvrtc(code, options, arch, names):
        seen.append(tuple(options))
        return b"cubin", {n: n for n in names}

    monkeypatch.setattr(_source, "_nvrtc", fake_nvrtc)
    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(tmp_path / "cache"))
    table([("h200", "FLAT_UNROLL_VALUE", 4)])
    name = "cupyloss::reduce_sum<float>"
    plain = _source.cached("reduce.cu", [name], "90")
    assert _source.cached("reduce.cu", [name], "90", "a100") == plain
    tuned = _source.cached("reduce.cu", [name], "90", "h200")
    assert tuned != plain and pathlib.Path(tuned).is_file()
    assert len(seen) == 2 and "-DCUPYLOSS_FLAT_UNROLL_VALUE=4" in seen[1]


def test_tune_keeps_a_candidate_only_past_the_margin():
    from cupyloss.tools import tune

    times = {2: {"a": 1.0, "b": 2.0}, 4: {"a": 0.99, "b": 1.98}, 8: {"a": 0.90, "b": 1.70}}
    assert tune.choose(2, times, 0.02) == 8                 # mean ratio 0.875
    assert tune.choose(2, {2: times[2], 4: times[4]}, 0.02) == 2   # 0.990: within the margin
    assert tune.choose(2, {2: times[2], 4: times[4]}, 0.005) == 4
    assert tune.choose(8, times, 0.02) == 8                 # the others are slower
    # One workload past the margin and none slower by a quarter of it: kept (the H100's
    # ROWS_TX_SUMMED 16, docs/tuning.md); one slower by more: not kept.
    one = {32: {"f": 1.441, "g": 3.070, "m": 0.1039}, 16: {"f": 1.401, "g": 3.064, "m": 0.1043}}
    assert tune.choose(32, one, 0.02) == 16
    one[16]["m"] = 0.1045                                   # 0.6% slower
    assert tune.choose(32, one, 0.02) == 32
    assert tune.choose(16, {16: one[16], 32: one[32]}, 0.02) == 16


def test_every_tunable_knob_has_workloads():
    from cupyloss.tools import tune

    have = {w.tag for w in tune._workloads(1.0)}
    for knob in _tuning.KNOBS.values():
        if knob.candidates:
            assert tune.tags(knob.name) <= have and tune.tags(knob.name), knob.name


def test_tune_writes_its_gpus_values_of_the_knobs_it_tried(tmp_path, monkeypatch):
    from cupyloss.tools import tune

    path = tmp_path / "tuning.csv"
    path.write_text("gpu,knob,value\nh200,REDUCE_STEPS,8\nh200,FLAT_STEPS_GRAD,32\n"
                    "a100,REDUCE_STEPS,2\n")
    tune.write_rows(path, "h200", {"REDUCE_STEPS": 1, "ROW_PAIR_REREAD": 1})
    # The knobs not tried keep their rows: a run of some knobs leaves the rest of the row.
    assert _tuning.read_table(path) == {
        "a100": {"REDUCE_STEPS": 2},
        "h200": {"REDUCE_STEPS": 1, "FLAT_STEPS_GRAD": 32, "ROW_PAIR_REREAD": 1}}
    # In place: the GPU's rows where they were, a new knob after them.
    assert path.read_text().splitlines() == [
        "gpu,knob,value", "h200,REDUCE_STEPS,1", "h200,FLAT_STEPS_GRAD,32",
        "h200,ROW_PAIR_REREAD,1", "a100,REDUCE_STEPS,2"]
    # A GPU that ran another's row (no row of its own) gets that row's values for the rest.
    tune.write_rows(path, "h20", {"REDUCE_STEPS": 4}, None, {"REDUCE_STEPS": 8,
                                                            "FLAT_STEPS_GRAD": 32})
    assert _tuning.read_table(path)["h20"] == {"REDUCE_STEPS": 4, "FLAT_STEPS_GRAD": 32}


def test_functors_are_math_and_their_shapes_the_tables():
    """losses.cuh's functors declare no schedule; every FUNCTOR_SHAPES entry names a functor
    template of the registry, and the source NVRTC compiles holds a specialization of each
    trait an entry sets, for every instantiation of its functor, where pointwise.cu asks."""
    import re

    from cupyloss._core import registry as _registry

    losses = re.sub(r"//[^\n]*", "", _source.expand("losses.cuh"))
    schedule = re.findall(r"static constexpr \w+ (cheap|stream_shape|shape_f32|heavy_sizes|"
                          r"flat_blocks_16|rows_blocks_16|reduce_blocks)\b", losses)
    assert not schedule, schedule
    families = {f.partition("<")[0] for f in _registry.functors()}
    assert set(_tuning.FUNCTOR_SHAPES) <= families
    code = _source.source("pointwise.cu")
    assert not re.search(r"^CUPYLOSS_FUNCTOR_SHAPES\(\)$", code, re.M)
    for functor in _registry.functors():
        shape = _tuning.FUNCTOR_SHAPES.get(functor.partition("<")[0])
        got = set(re.findall(r"template <> struct (\w+)<" + re.escape(functor) + r">", code))
        want = set()
        if shape is not None:
            want = {t for t, on in (("IsCheap", shape.cheap), ("StreamShape", shape.stream),
                                    ("OwnShape32", shape.shape_f32),
                                    ("HeavySizes", shape.heavy_sizes),
                                    ("FlatBlocks16", shape.flat_blocks_16),
                                    ("RowsBlocks16", shape.rows_blocks_16),
                                    ("ReduceBlocksHeavy", shape.reduce_blocks),
                                    ("ReduceBlocksStream", shape.reduce_blocks)) if on}
        assert got == want, functor


def test_tune_summarizes_its_measurements(tmp_path):
    """The Markdown summary gives each knob's default, the value kept and its mean time ratio
    to the default's over the workloads, with the best and worst workload, and the runner-up."""
    from cupyloss.tools import tune

    path = tmp_path / "tune.csv"
    path.write_text("gpu,knob,value,workload,ms,GB/s,chosen\n"
                    "h200,REDUCE_STEPS,4,a,1.0,1,0\nh200,REDUCE_STEPS,4,b,2.0,1,0\n"
                    "h200,REDUCE_STEPS,8,a,0.8,1,1\nh200,REDUCE_STEPS,8,b,2.2,1,1\n")
    table = tune.summarize(path).splitlines()
    assert table[2] == "| h200 | REDUCE_STEPS | 4 | 8 | 0.950 | 0.800 / 1.100 | 4 (1.000) |"


def test_tune_builds_each_compiled_candidate_with_the_values_in_force(tmp_path, monkeypatch):
    """candidate_jobs: every candidate of a compile-time knob over the pointwise kernels a tag
    loads, the values chosen so far kept (none for a run-time knob); _build compiles a job
    with exactly those values for that GPU."""
    from cupyloss.tools import tune

    kernels = {("pointwise.cu", "a"), ("pointwise.cu", "b"), ("rowwise.cu", "c")}
    jobs = tune.candidate_jobs("REDUCE_STEPS", kernels, "90", "h200", {"FLAT_UNROLL_GRAD": 4})
    cands = _tuning.KNOBS["REDUCE_STEPS"].candidates
    assert len(jobs) == 2 * len(cands) and {j[1] for j in jobs} == {"a", "b"}
    assert {j[4]["REDUCE_STEPS"] for j in jobs} == set(cands)
    assert all(j[4]["FLAT_UNROLL_GRAD"] == 4 and j[2:4] == ("90", "h200") for j in jobs)
    assert tune.candidate_jobs("FLAT_STEPS_GRAD", kernels, "90", "h200", {}) == []
    seen = []

    def fake_nvrtc(code, options, arch, names):
        seen.append(tuple(options))
        return b"cubin", {n: n for n in names}

    monkeypatch.setattr(_source, "_nvrtc", fake_nvrtc)
    monkeypatch.setenv("CUPYLOSS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_tuning, "_OVERRIDES", {})
    tune._build(jobs[0])
    assert f"-DCUPYLOSS_REDUCE_STEPS={jobs[0][4]['REDUCE_STEPS']}" in seen[0]
    assert "-DCUPYLOSS_FLAT_UNROLL_GRAD=4" in seen[0]


@pytest.mark.parametrize("name", [b"NVIDIA H200", "NVIDIA H200"])
def test_device_limits_key_the_gpu_by_its_cuda_name(monkeypatch, name):
    """device_limits reads the launch table's key from the name CUDA reports (CuPy gives bytes),
    beside the attributes the launch arithmetic uses."""
    cupy = pytest.importorskip("cupy")

    class FakeDevice:
        def __init__(self, i):
            self.attributes = {"MultiProcessorCount": 132, "MaxGridDimX": 2**31 - 1,
                               "MaxGridDimY": 65535, "MaxSharedMemoryPerBlock": 49152,
                               "MaxRegistersPerMultiprocessor": 65536,
                               "MaxThreadsPerMultiProcessor": 2048,
                               "MaxSharedMemoryPerMultiprocessor": 233472,
                               "MaxSharedMemoryPerBlockOptin": 232448}
            self.compute_capability = "90"

    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda i: {"name": name})
    _launch.device_limits.cache_clear()
    try:
        limits = _launch.device_limits(7)
    finally:
        _launch.device_limits.cache_clear()
    assert limits.gpu == "h200" and limits.sm_count == 132 and limits.clusters


# Two tuned GPUs' traits: (compute capability, SMs, DRAM GB/s), 25.4 and 36.5 GB/s an SM.
_TUNED = [("h100-80gb-hbm3", 90, 132, 3352), ("h200", 90, 132, 4814)]


def _traits(cc, sms, gbs):
    return {"compute_capability": cc, "sm_count": sms, "memory_gbs": gbs}


@pytest.fixture
def adopted(monkeypatch):
    """A clean record of adopted rows, restored after the test."""
    monkeypatch.setattr(_tuning, "_ADOPTED", {})
    monkeypatch.setattr(_tuning, "_OVERRIDES", {})
    return _tuning._ADOPTED


def _tuned_table(table, extra=()):
    rows = [r for gpu, cc, sms, gbs in _TUNED for r in (
        (gpu, "compute_capability", cc), (gpu, "sm_count", sms), (gpu, "memory_gbs", gbs))]
    table(rows + [("h100-80gb-hbm3", "REDUCE_STEPS", 4), ("h200", "REDUCE_STEPS", 8),
                  ("h200", "ROWS_TX_SUMMED", 16), *extra])


@pytest.mark.parametrize("traits, row", [
    (_traits(90, 114, 2039), "h100-80gb-hbm3"),   # an H100 PCIe: 17.9 GB/s an SM
    (_traits(90, 132, 4000), "h100-80gb-hbm3"),   # 30.3: nearer 25.4 than 36.5 by ratio
    (_traits(90, 78, 4000), "h200"),              # 51.3
    (_traits(80, 108, 2039), ""),                 # an A100: no tuned GPU of its major version
    (_traits(90, 132, 0), ""),                    # bandwidth not reported
])
def test_a_gpu_without_a_row_runs_the_nearest_tuned_gpus(table, adopted, traits, row):
    _tuned_table(table)
    assert _tuning.nearest_row(traits) == row
    assert _tuning.adopt("new-gpu", traits) == row and adopted["new-gpu"] == row
    assert _tuning.values("new-gpu") == _tuning.values(row)
    assert _tuning.kernel_defines("new-gpu") == _tuning.kernel_defines(row)


def test_a_gpus_own_row_comes_before_any_other(table, adopted):
    _tuned_table(table)
    assert _tuning.adopt("h100-80gb-hbm3", _traits(90, 132, 9999)) == "h100-80gb-hbm3"
    assert "h100-80gb-hbm3" not in adopted
    assert _tuning.value("REDUCE_STEPS", "h100-80gb-hbm3") == 4


def test_tunes_values_stand_over_the_adopted_row(table, adopted):
    """python -m cupyloss.tools.tune on a GPU without a row sets its candidates on its own key: they
    take the place of the adopted row's values for that GPU alone."""
    _tuned_table(table)
    _tuning.adopt("new-gpu", _traits(90, 78, 4000))
    _tuning._OVERRIDES["new-gpu"] = {"REDUCE_STEPS": 2}
    mine, theirs = _tuning.values("new-gpu"), _tuning.values("h200")
    assert mine["REDUCE_STEPS"] == 2 and theirs["REDUCE_STEPS"] == 8
    assert mine["ROWS_TX_SUMMED"] == theirs["ROWS_TX_SUMMED"] == 16


def test_device_limits_read_the_traits_and_adopt_a_row(table, adopted, monkeypatch):
    """device_limits reads the bandwidth from the memory clock (kHz) and bus width (bits) the
    device reports, and a GPU the table lacks runs its nearest tuned GPU's row."""
    import cupy

    _tuned_table(table)
    attrs = {"MultiProcessorCount": 114, "MaxGridDimX": 2**31 - 1, "MaxGridDimY": 65535,
             "MaxSharedMemoryPerBlock": 49152, "MaxRegistersPerMultiprocessor": 65536,
             "MaxThreadsPerMultiProcessor": 2048, "MaxSharedMemoryPerMultiprocessor": 233472,
             "MemoryClockRate": 1593000, "GlobalMemoryBusWidth": 5120}

    class FakeDevice:
        def __init__(self, device_id=0):
            self.attributes, self.compute_capability = attrs, "90"

    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties",
                        lambda d: {"name": b"NVIDIA H100 PCIe"})
    _launch.device_limits.cache_clear()
    try:
        limits = _launch.device_limits(0)
    finally:
        _launch.device_limits.cache_clear()
    assert (limits.gpu, limits.compute_capability, limits.memory_gbs) == ("h100-pcie", 90, 2039)
    assert limits.clusters and adopted == {"h100-pcie": "h100-80gb-hbm3"}
    assert _tuning.values(limits.gpu) == _tuning.values("h100-80gb-hbm3")
    del attrs["MemoryClockRate"]
    assert _launch.memory_gbs(attrs) == 0


def test_tune_writes_its_gpus_traits_with_its_knobs(tmp_path):
    from cupyloss.tools import tune

    path = tmp_path / "tuning.csv"
    tune.write_rows(path, "new-gpu", {"REDUCE_STEPS": 2}, _traits(90, 78, 4000))
    assert _tuning.read_table(path) == {"new-gpu": {"REDUCE_STEPS": 2}}
    assert _tuning.read_traits(path) == {"new-gpu": _traits(90, 78, 4000)}


def test_a_losses_own_shape_has_a_row_per_gpu(table, adopted):
    """A row "gpu,<Template>.<field>,value" changes that field of that functor's traits in the
    source NVRTC compiles for that GPU alone (so its cubins are its own), and GPUs adopting its
    row take it too; every other GPU compiles the source it compiled before."""
    import re

    plain = _source.source("pointwise.cu")
    table([("h200", "compute_capability", 90), ("h200", "sm_count", 132),
           ("h200", "memory_gbs", 4814), ("h200", "KlDivOp.rows_blocks_f32", 4),
           ("h200", "BceOp.flat_blocks_16", 2)])
    assert _source.source("pointwise.cu") == plain == _source.source("pointwise.cu", "a100")
    mine = _source.source("pointwise.cu", "h200")
    gone = set(plain.splitlines()) - set(mine.splitlines())
    came = set(mine.splitlines()) - set(plain.splitlines())
    assert gone and all(re.search(r"OwnShape32<KlDivOp<\d>>.*Shape32\{3, 2, 2, 4, ", g) or
                        re.search(r"FlatBlocks16<BceOp<\d>>.* = 3;", g) for g in gone), gone
    assert {c.replace("Shape32{4, 2, 2, 4, ", "Shape32{3, 2, 2, 4, ").replace(" = 2;", " = 3;")
            for c in came} == gone
    assert _tuning.value("KlDivOp.rows_blocks_f32", "h200") == 4
    assert _tuning.value("KlDivOp.rows_blocks_f32") == 3          # its entry's, elsewhere
    _tuning.adopt("h20", _traits(90, 78, 4000))
    assert _source.source("pointwise.cu", "h20") == mine


@pytest.mark.parametrize("row, match", [
    (("h200", "KlDivOp.rows_blocks", 2), "is not <functor template>.<field>"),
    (("h200", "klDiv.rows_blocks_f32", 2), "is not <functor template>.<field>"),
    (("h200", "MseOp.reduce_blocks", 2), "MseOp is cheap"),
    (("h200", "KlDivOp.rows_steps_f32", 3), r"is not one of \(0, 1, 2, 4\)"),
])
def test_a_bad_shape_row_is_refused_with_its_line(table, row, match):
    table([row])
    with pytest.raises(ValueError, match=match) as err:
        _tuning.values("h200")
    assert "tuning.csv:2" in str(err.value)


def test_every_shape_field_in_the_shipped_table_names_a_registered_functor():
    from cupyloss._core import registry as _registry

    families = {f.partition("<")[0] for f in _registry.functors()}
    for gpu, row in _tuning.read_table(_tuning.TABLE).items():
        for name in row:
            if "." in name:
                assert name.partition(".")[0] in families, (gpu, name)


def test_tune_takes_a_shape_field_with_its_own_workload():
    """A shape field's workload runs its loss in the kernel the field shapes, and its candidates
    are built as a compile-time knob's are."""
    from cupyloss._core import registry as _registry
    from cupyloss.tools import tune

    for knob, shapes in (("KlDivOp.rows_blocks_f32", [(8192, 4096), (4096,)]),
                         ("BceLogitsOp.reduce_blocks", [(8192, 4096), (8192, 1)]),
                         ("SigmoidFocalOp.flat_blocks_16", [(16384, 16384)] * 2)):
        (work,) = tune.functor_workloads(knob, 1.0)
        template = knob.partition(".")[0]
        spec = next(s for s in _registry.SPECS.values() if s.functor == template)
        assert work.name.startswith(spec.name + " ") and tune.tags(knob) == {work.tag}
        assert work.name.split(" ", 1)[1].startswith(" x ".join(map(str, shapes)))
        assert ("bfloat16" in work.name) == knob.endswith("_16")
        jobs = tune.candidate_jobs(knob, {("pointwise.cu", "k"), ("rowwise.cu", "r")}, "90",
                                   "h200", {})
        assert [j[4] for j in jobs] == [{knob: v} for v in _tuning.FUNCTOR_FIELDS[
            knob.partition(".")[2]]]
    with pytest.raises(ValueError, match="cheap"):
        tune.functor_workloads("HingeOp.reduce_blocks", 1.0)
