"""Which path runs: the Triton kernels on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``, which is how CI tests them), the PyTorch path otherwise."""

from __future__ import annotations

import functools
import importlib
import inspect

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


def on_tensor_device(fn):
    """``fn`` (a public function) run with the current CUDA device set to its first
    argument's (``q``, ``outs``, ``out_a``) where the two differ. Triton launches a kernel on
    the current device, in its context and on its stream: without this, a call on cuda:1
    tensors while cuda:0 is current (a model split over GPUs, transformers' ``device_map``)
    would run on cuda:0 over cuda:1's memory. torch's own CUDA ops guard the same way. One
    comparison a call where they agree; torch.compile's graphs set their device themselves,
    and autograd runs a backward on its device's thread."""
    name = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = args[0] if args else kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.is_cuda and not torch.compiler.is_compiling() \
                and t.get_device() != torch._C._cuda_getDevice():
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run
