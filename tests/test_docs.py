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
                           "cupyloss.torch", "cupyloss.precompile"],
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
