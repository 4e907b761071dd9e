"""flashlse: exact attention whose log-sum-exp means the same thing on every path.

An empty row (no visible key) gives ``out = 0`` and ``lse = -inf`` (or the sink logit);
attention states ``(out, lse)`` merge as a monoid with identity ``(0, -inf)``.
"""

from . import compat, distributed, lse, masks, reference
from .integrations import sdpa as _sdpa
from .kernels.options import KernelOptions, kernel_options
from .ops import (
    attention,
    attention_varlen,
    attention_with_kvcache,
    merge,
    merge_states,
    sparse_attention,
    value_checks,
)

__version__ = "0.1.0"

# "flashlse" becomes a PyTorch SDPA flash implementation to activate (nothing is activated):
# torch.nn.attention.activate_flash_attention_impl("flashlse").
_sdpa.register()

__all__ = [
    "KernelOptions",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "compat",
    "distributed",
    "kernel_options",
    "lse",
    "masks",
    "merge",
    "merge_states",
    "reference",
    "sparse_attention",
    "value_checks",
]
