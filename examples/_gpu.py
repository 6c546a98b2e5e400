"""What the torch examples share: torch and cupyloss.torch on a CUDA GPU, or one line saying
what is missing and exit status 1.  Imported from beside them (a script's folder is first on
sys.path)."""

import sys


def torch_on_gpu():
    """(torch, cupyloss.torch) where torch sees a CUDA device; else print why and exit 1."""
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as exc:  # no torch, no driver, or no GPU
        print(f"this example needs torch with an NVIDIA GPU; none is usable here ({exc}).")
        sys.exit(1)
    import cupyloss.torch

    return torch, cupyloss.torch
