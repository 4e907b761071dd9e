"""Mask rules shared by the reference, the CPU path and the kernel launchers.

Masks are bottom-right aligned, as in flash-attn: with ``Sq`` queries and ``Sk``
keys, query row ``i`` sits at key position ``i + Sk - Sq`` and sees key ``j`` iff

    i + Sk - Sq - left <= j <= i + Sk - Sq + right

``causal=True`` sets ``right = 0``. ``None``, a negative number or a side of at least
``UNBOUNDED`` means unbounded.
With ``causal`` and ``Sq > Sk`` the first ``Sq - Sk`` rows see no key: they are
empty rows (out = 0, lse = -inf), a real case and not an error.
"""

from __future__ import annotations

import torch

Window = tuple[int | None, int | None]

# A window side from here on is unbounded: exact for every sequence of at most 2^30 tokens
# (a side of 2^30 reaches all of its keys; a billion-token sequence is past any call here).
# The kernels bound a row's keys by ``row + shift + right`` in int32, which a side near 2^31
# overflowed: a window of (4, 2^31 - 2) masked every key (out 0, lse -inf) where it sees the
# same keys as (4, None).
UNBOUNDED = 2**30


def normalize_window(causal: bool, window: Window | None) -> tuple[int | None, int | None]:
    """Returns ``(left, right)`` with ``None`` for unbounded; ``causal`` caps ``right`` at 0."""
    left, right = (None, None) if window is None else window
    left = None if left is None or left < 0 or left >= UNBOUNDED else int(left)
    right = None if right is None or right < 0 or right >= UNBOUNDED else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def key_range(i: int, sq: int, sk: int, left: int | None, right: int | None) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys visible to query row ``i`` (may be empty)."""
    diag = i + sk - sq
    lo = 0 if left is None else max(0, diag - left)
    hi = sk if right is None else min(sk, diag + right + 1)
    return lo, max(lo, hi)


def visible(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    sq: int,
    sk: int,
    left: int | None,
    right: int | None,
) -> torch.Tensor | None:
    """Boolean mask ``[len(q_idx), len(k_idx)]``: True where the key is visible. ``sk`` may
    be a tensor of key counts shaped ``(B, 1)`` (a batch of sequences, each aligned on its own
    end): the mask is then ``[B, len(q_idx), len(k_idx)]``.

    Returns ``None`` when nothing is masked (no window), so callers skip the work.
    """
    if left is None and right is None:
        return None
    diag = (q_idx + (sk - sq)).unsqueeze(-1)
    k = k_idx.unsqueeze(0)
    ok = torch.ones(torch.broadcast_shapes(diag.shape, k.shape), dtype=torch.bool,
                    device=q_idx.device)
    if left is not None:
        ok &= k >= diag - left
    if right is not None:
        ok &= k <= diag + right
    return ok


def block_is_empty(
    q_lo: int, q_hi: int, k_lo: int, k_hi: int, sq: int, sk: int,
    left: int | None, right: int | None,
) -> bool:
    """True when no query in ``[q_lo, q_hi)`` sees any key in ``[k_lo, k_hi)``."""
    if q_hi <= q_lo or k_hi <= k_lo:
        return True
    shift = sk - sq
    # Row i sees keys up to i + shift + right, so the block's last row sees the most.
    if right is not None and k_lo > (q_hi - 1) + shift + right:
        return True
    # Row i sees keys from i + shift - left, so the block's first row sees the earliest.
    if left is not None and k_hi - 1 < q_lo + shift - left:
        return True
    return False
