"""Attention backends, a layer below the model: `--attention-backend torch|triton` (default: triton on CUDA when it
imports, torch otherwise). A backend builds its per-forward state from the step's metadata (`prepare`), attends
(`forward`: writes the step's K/V, then reads the paged cache) and says which block-table widths a FULL step's
groups read (`full_layout`)."""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_unfit(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype not in (torch.float32, torch.bfloat16, torch.float16) or head_dim < 16 or \
        bool(head_dim & (head_dim - 1))


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    return name


def make_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int):
    """The backend `name` resolves to, after checking it can run this model: errors name the flag; `auto` takes
    the torch backend for what the Triton one cannot run."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton" and name == "auto" and _triton_unfit(dtype, head_dim):
        resolved = "torch"
    if resolved == "torch":
        from pdserve.attention.torch_backend import TorchBackend
        return TorchBackend(device)
    if not _triton_available():
        raise ValueError("--attention-backend triton: triton is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton needs a CUDA device, or TRITON_INTERPRET=1 (Triton's CPU "
                         "interpreter: slow, for tests)")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"--attention-backend triton: dtype {str(dtype).removeprefix('torch.')} is not supported "
                         "(float32, bfloat16, float16); use --attention-backend torch")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"--attention-backend triton needs a power-of-two head_dim >= 16, the model has {head_dim}")
    from pdserve.attention.triton_backend import TritonBackend
    return TritonBackend(device)
