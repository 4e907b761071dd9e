"""Validation, autograd and the public functions; the PyTorch path for CPU tensors."""

from ._validate import value_checks
from .attention import attention, attention_varlen
from .kvcache import attention_with_kvcache
from .merge import merge, merge_states
from .sparse import sparse_attention

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "merge",
    "merge_states",
    "sparse_attention",
    "value_checks",
]
