"""The documentation builds and stays whole: the API reference from the docstrings (pdoc, the
test extra's), every public name in it, and every relative link of README.md and docs/ resolving."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_api_reference_builds_with_every_public_name(tmp_path):
    pytest.importorskip("pdoc")
    pytest.importorskip("torch")
    import cupyloss

    done = subprocess.run([sys.executable, "-m", "pdoc", "-o", str(tmp_path), "cupyloss",
                           "cupyloss.torch", "cupyloss.tools.precompile"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "cupyloss.html").read_text()
    missing = [name for name in cupyloss.__all__ if f'id="{name}"' not in page]
    assert not missing, f"public names without an entry in the API reference: {missing}"
    assert (tmp_path / "cupyloss" / "torch.html").is_file()


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                      for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(page):
    path = ROOT / page
    if not path.is_file():
        pytest.skip(f"{page} is not in this copy (an installed package)")
    links = re.findall(r"\]\(([^)#]+)\)", path.read_text())
    broken = [link for link in links if "://" not in link
              and not (path.parent / link).exists()]
    assert not broken, f"{page} links to missing files: {broken}"


def _env_finding_cupyloss() -> dict:
    """The environment with the folder this process imports cupyloss from on PYTHONPATH, so a
    child process finds the same copy (a checkout run with PYTHONPATH=., or the installed one)."""
    import os

    import cupyloss

    here = str(pathlib.Path(cupyloss.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=here + (os.pathsep + path if path else ""))


def _readme_blocks() -> list[str]:
    path = ROOT / "README.md"
    if not path.is_file():
        return []
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_readme_code_runs(index, tmp_path):
    """Each Python block of the README runs as it stands in a new process: the torch one on any
    machine with torch (CPU tensors without a GPU), the CuPy one where there is a GPU."""
    from conftest import GPU_UNAVAILABLE

    code = _readme_blocks()[index]
    if "import torch" in code:
        pytest.importorskip("torch")
    elif GPU_UNAVAILABLE is not None:
        pytest.skip(f"needs a GPU: {GPU_UNAVAILABLE}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=_env_finding_cupyloss())
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("example", ["quickstart.py", "torch_training.py", "jax_roundtrip.py",
                                     "lm_head_training.py", "vocab_parallel_training.py",
                                     "gpt_autocast_training.py", "ctc_training.py",
                                     "policy_gradient.py", "grpo_step.py", "dpo_step.py",
                                     "distill_step.py"])
def test_example_runs(example):
    """examples/ run to a zero exit status on a GPU (each checks its own results)."""
    path = ROOT / "examples" / example
    if not path.is_file():
        pytest.skip(f"examples/{example} is not in this copy (an installed package)")
    pytest.importorskip({"quickstart.py": "cupy", "torch_training.py": "torch",
                         "jax_roundtrip.py": "jax", "lm_head_training.py": "torch",
                         "vocab_parallel_training.py": "torch",
                         "gpt_autocast_training.py": "torch", "ctc_training.py": "torch",
                         "policy_gradient.py": "torch", "grpo_step.py": "torch",
                         "dpo_step.py": "torch", "distill_step.py": "torch"}[example])
    # The tensor-parallel example's ranks run on the CPU over gloo on a one-GPU machine: 20 of
    # its 100 steps (155 s for 100 on an H200's host) check the same agreement.
    extra = {"vocab_parallel_training.py": ["--steps", "20"]}.get(example, [])
    done = subprocess.run([sys.executable, str(path), *extra], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=_env_finding_cupyloss())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


# The three in one process (torch imported once): each script run as __main__ from its folder,
# its exit status and output kept.
_RUN_EXAMPLES = """
import contextlib, io, runpy, sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    out = io.StringIO()
    sys.argv = [name, "--steps", "10"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f"{sys.path[0]}/{name}", run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(f"== {name} exit {code}")
    print(out.getvalue())
"""


def test_posttrain_examples_run_on_the_cpu():
    """The post-training examples (GRPO, DPO, distillation) run through torch's CPU path with
    no GPU visible: 10 steps each, the loss curves and gradients against the unfused formula's,
    as on a GPU."""
    pytest.importorskip("torch")
    names = ["grpo_step.py", "dpo_step.py", "distill_step.py"]
    if not all((ROOT / "examples" / n).is_file() for n in names):
        pytest.skip("examples/ is not in this copy (an installed package)")
    env = dict(_env_finding_cupyloss(), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _RUN_EXAMPLES, str(ROOT / "examples"), *names],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for name in names:
        assert f"== {name} exit 0" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("cpu: largest gap") == 3, done.stdout[-3000:]
