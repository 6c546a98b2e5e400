"""Test configuration: GPU tests skip, saying why, on a machine without a usable CUDA device."""

import os

import pytest

# JAX takes 75% of the GPU at its first array unless told otherwise; the suite shares the GPU
# between CuPy's pool, torch's cache and JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_unavailable():
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"cupy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device: {exc}"
    return None if count > 0 else "no CUDA device found"


GPU_UNAVAILABLE = _gpu_unavailable()


def pytest_collection_modifyitems(config, items):
    if GPU_UNAVAILABLE is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {GPU_UNAVAILABLE}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
