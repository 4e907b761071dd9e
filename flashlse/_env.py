"""Process-wide facts read once: Triton decides at import whether its kernels run in the
interpreter (``TRITON_INTERPRET=1``, how CI runs them on CPU tensors), so flashlse does too."""

from __future__ import annotations

import os

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the Triton kernels run in the interpreter (read once, at import)."""
    return _INTERPRET
