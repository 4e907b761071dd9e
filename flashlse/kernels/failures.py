"""The one memory of kernels that failed to compile here, so that each is tried once.

Gluon and Triton's Hopper warp specialisation are young: a triton release may reject a kernel
that another compiles. The launchers then warn once and take the fallback (the portable kernel
for a Gluon one, the same kernel without warp specialisation), and remember the signature in
:data:`FAILURES`, so that later calls of that signature go to the fallback at once. Besides the
launch plans (caches of what a call's metadata determines, docs/design.md §3), it is the only
state the kernels keep between calls; no module-level switch steers a kernel (choices are
``KernelOptions``).

Keys are tuples whose first item names the kernel (``"fwd_sm90"``, ``"bwd_sm90 dK/dV"``,
``"bwd_sm90 dQ"``, ``"fwd warp_specialize"``), the rest its compile signature (the values
its constexpr flags come from). Tests start from an empty memory with
``with FAILURES.isolated():`` (the ``compile_failures`` fixture) or :meth:`CompileFailures.clear`.
"""

from __future__ import annotations

import contextlib
import warnings


class CompileFailures:
    """Signatures whose kernel failed to compile in this process (a set of key tuples)."""

    __slots__ = ("_keys",)

    def __init__(self):
        self._keys: set = set()

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(tuple(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key, error: BaseException | None = None, what: str | None = None,
            stacklevel: int = 2) -> None:
        """Remembers ``key``; with ``what`` (``"the Hopper forward kernel"``) warns once, naming
        ``error``, that the portable Triton kernel runs instead (``stacklevel`` as
        :func:`warnings.warn`'s, counted from the caller of ``add``)."""
        self._keys.add(key)
        if what is not None:
            warnings.warn(f"flashlse: {what} failed ({type(error).__name__}: "
                          f"{str(error)[:200]}); using the portable Triton kernel instead",
                          RuntimeWarning, stacklevel=stacklevel + 1)

    def clear(self) -> None:
        """Forgets every failure: the next call of each signature tries its kernel again."""
        self._keys.clear()

    @contextlib.contextmanager
    def isolated(self):
        """Runs the block on an empty memory and restores the one before it (tests)."""
        saved = set(self._keys)
        self._keys.clear()
        try:
            yield self
        finally:
            self._keys.clear()
            self._keys.update(saved)


# The process's memory (kernels/dispatch.py and fwd.py's warp specialisation record here).
FAILURES = CompileFailures()
