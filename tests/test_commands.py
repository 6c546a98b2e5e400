"""The `python -m cupyloss.*` commands and the adapters at their edges: --help anywhere, one
line when the GPU or the framework is missing, an ImportError that names the extra."""

import subprocess
import sys

import pytest

COMMANDS = ("bench", "bench.accuracy", "bench.bandwidth", "bench.broadcast", "bench.firstcall",
            "bench.rowwise", "bench.torch_adapter", "bench.jax_adapter", "bench.linear",
            "bench.train", "tools.precompile", "tools.tune")
# Runs a module as `python -m` would, with the named top-level packages made unimportable.
_BLOCKED = ("import runpy, sys\n"
            "for name in sys.argv[2].split(','):\n"
            "    sys.modules[name] = None\n"
            "sys.argv = [sys.argv[1]] + sys.argv[3:]\n"
            "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def _run(module, *args, blocked=""):
    return subprocess.run([sys.executable, "-c", _BLOCKED, module, blocked or "_none_", *args],
                          capture_output=True, text=True, timeout=120)


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize("command", COMMANDS)
def test_help_works_without_torch_or_gpu(command):
    done = _run(f"cupyloss.{command}", "--help", blocked="torch,jax")
    assert done.returncode == 0, done.stderr
    assert f"python -m cupyloss.{command}" in done.stdout


def test_help_names_the_workloads():
    assert all(name in _run("cupyloss.bench", "--help").stdout
               for name in ("mse", "kl", "hinge", "smooth_l1"))
    assert all(name in _run("cupyloss.bench.rowwise", "--help").stdout
               for name in ("kb95", "llm", "jsd", "kb99"))


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "tools.precompile"])
def test_benchmarks_say_what_is_missing_in_one_line(command):
    if _gpu():
        if command in ("bench", "bench.bandwidth", "bench.firstcall", "bench.jax_adapter",
                       "tools.tune"):
            pytest.skip(f"cupyloss.{command} runs without torch where there is a GPU")
        done = _run(f"cupyloss.{command}", blocked="torch")
        want = "needs PyTorch: pip install 'cupyloss[torch]'"
    else:
        done = _run(f"cupyloss.{command}")
        want = "needs an NVIDIA GPU with CUDA; none is usable here"
    assert done.returncode == 1
    assert want in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("adapter, framework", [("torch", "torch"), ("jax", "jax")])
def test_adapter_without_its_framework_names_the_extra(adapter, framework):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import cupyloss.{adapter}\n"
            f"except ImportError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert f"pip install 'cupyloss[{framework}]'" in done.stdout, done.stdout + done.stderr


def test_benchmarks_save_their_results_as_json(tmp_path):
    import json

    from cupyloss.bench import _timing

    rows = [{"case": "mse", "ms": 1.5}]
    assert _timing.save(None, rows) is rows and not list(tmp_path.iterdir())
    path = tmp_path / "out.json"
    assert _timing.save(str(path), rows) is rows
    assert json.loads(path.read_text()) == rows


def test_bandwidth_schedules_cover_the_arrays():
    """bench.bandwidth's one-pass grid gives every vector a thread in one pass; its grid-stride
    grid holds at most GRID_WAVES waves of resident blocks, and one pass where that is fewer."""
    from cupyloss._core import launch as _launch
    from cupyloss.bench import bandwidth as bw

    tile = _launch.BLOCK * bw.STEPS
    for n_vec in (1, tile - 1, tile, tile + 1, 8192 * 4096 // 4, 16384 * 16384 // 4):
        grids = bw.schedules(n_vec, 132)
        assert (grids["one pass"] - 1) * tile < n_vec <= grids["one pass"] * tile
        assert grids["grid-stride"] == min(grids["one pass"],
                                           132 * _launch.BLOCKS_PER_SM * bw.GRID_WAVES)
    assert bw.schedules(16384 * 16384 // 4, 132)["grid-stride"] == 16896
