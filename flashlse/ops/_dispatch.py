"""Which path runs: the Triton kernels on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``, which is how CI tests them), the PyTorch path otherwise."""

from __future__ import annotations

import functools
import importlib

import torch

from .._env import interpreting


def use_triton(t: torch.Tensor) -> bool:
    # tl.dot has no float64 accumulator: float64 always takes the PyTorch path.
    on_device = t.is_cuda or (interpreting() and t.device.type == "cpu")
    return on_device and t.dtype != torch.float64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the PyTorch path: float64 stays float64, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def kernel_module(name: str):
    """``flashlse.kernels.<name>``, imported on first use (the kernel modules import Triton)
    and then held: a per-step call pays one cache lookup, not the import machinery."""
    return importlib.import_module(f"flashlse.kernels.{name}")
