"""The LSE contract: the canonical form, and conversions from and to foreign conventions.

Canonical form (every path inside flashlse): natural log, float32,

    lse_i = log sum_j exp(S_ij)          (plus the sink logit, when a sink is given)

and an empty row (no visible key, Z_i = 0) has ``lse_i = -inf`` -- never +inf, NaN,
0 or a finite sentinel. ``-inf`` is the identity of ``logaddexp``, so partial states
merge with no special case (see ``docs/math.md``).

Foreign conventions are converted here, at the boundary, and nowhere else:

============== ====== ================= ===========================================
convention     base   empty row         where it comes from
============== ====== ================= ===========================================
fa2            e      +inf              flash-attn 2 ``softmax_lse`` (and torch's
                                        aten ``_flash_attention_forward``): the
                                        backward computes exp(S - L) with L = +inf
                                        so P = 0 without a branch.
fa3            e      -inf or +inf      flash-attn 3: the kernel writes -inf; the
                                        host path for ``seqlen_k == 0`` fills +inf.
flashmla       e      +inf, no sink     FlashMLA: +inf for empty rows, and the LSE
                                        it returns *excludes* the ``attn_sink``
                                        (flashlse's includes it), so converting
                                        needs the sink.
flashinfer     2      -inf (finite      FlashInfer keeps its LSE in base 2; older
                      sentinels before) releases wrote finite sentinels such as
                                        -5e4 or -1e30: pass ``sentinel=`` to fold
                                        every value at or below it.
sdpa_efficient e      0 (+inf padding)  torch's memory-efficient SDPA kernel: a row
                                        with no key reports 0, indistinguishable
                                        from a row whose Z is 1 -- the row's key
                                        count (``key_counts=``) or an ``empty=``
                                        mask is needed to tell them apart.
sigmoid_merge  e      NaN               the sigmoid-form merge of ring-flash-attn and
                                        torch context parallel: two empty states
                                        merge to NaN (its out is NaN too).
log2           2      -inf              base-2 canonical form (kernel internals).
canonical      e      -inf              identity, but +inf is folded.
============== ====== ================= ===========================================

In every ``to_canonical`` conversion +inf folds to -inf. NaN folds only under
``sigmoid_merge``, whose NaN is an empty row: under every other convention a NaN LSE is
bad data (a NaN in q, a key or a value reached the row) and stays NaN, so a merge of it
stays NaN too. ``return_count=True`` also returns how many entries were folded.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
NEG_INF = float("-inf")

CONVENTIONS = ("canonical", "fa2", "fa3", "flashmla", "flashinfer", "sdpa_efficient",
               "sigmoid_merge", "log2")


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"unknown LSE convention {convention!r}; expected one of {', '.join(CONVENTIONS)}"
        )


def _check_lse(lse: torch.Tensor) -> None:
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if not lse.is_floating_point():
        raise TypeError(f"lse must be a floating-point tensor, got dtype {lse.dtype}")


def is_empty(lse: torch.Tensor) -> torch.Tensor:
    """True where a canonical LSE marks an empty row (``lse == -inf``)."""
    return torch.isneginf(lse)


def safe_pivot(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0: a finite pivot, so ``exp(S - pivot)`` is 0 on empty rows.

    This is the once-per-row fix of the backward preprocess (docs/design.md §1).
    """
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _as_broadcast(name: str, value, lse: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor on lse's device that broadcasts to ``lse``, or a clear error."""
    t = torch.as_tensor(value, device=lse.device)
    try:
        torch.broadcast_shapes(t.shape, lse.shape)
    except RuntimeError:
        raise ValueError(
            f"{name} {tuple(t.shape)} must broadcast to lse {tuple(lse.shape)} by torch rules "
            f"(one value per row: its shape, or trailing dims of it, with 1s where shared)"
        ) from None
    if torch.broadcast_shapes(t.shape, lse.shape) != lse.shape:
        raise ValueError(f"{name} {tuple(t.shape)} would grow lse {tuple(lse.shape)}: it must "
                         f"broadcast to lse's shape, not beyond it")
    return t


def _empty_from_counts(lse, key_counts, empty):
    if empty is not None:
        return _as_broadcast("empty", empty, lse).to(torch.bool).expand_as(lse)
    if key_counts is not None:
        return (_as_broadcast("key_counts", key_counts, lse) == 0).expand_as(lse)
    raise ValueError(
        "convention 'sdpa_efficient' writes lse = 0 for a row with no key, the same value as a "
        "row whose Z is 1; pass key_counts= (visible keys per row, broadcastable to lse) or "
        "empty= (a bool mask of empty rows) so the two can be told apart"
    )


def to_canonical(
    lse: torch.Tensor,
    convention: str,
    *,
    sink: torch.Tensor | None = None,
    key_counts: torch.Tensor | None = None,
    empty: torch.Tensor | None = None,
    sentinel: float | None = None,
    return_count: bool = False,
):
    """Foreign LSE -> canonical (natural log, -inf for empty rows, sink included).

    Args:
        lse: the foreign LSE, any shape.
        convention: one of ``CONVENTIONS``.
        sink: per-row sink logits broadcastable to ``lse`` (``flashmla`` only: its LSE
            excludes the sink, the canonical one includes it).
        key_counts / empty: visible keys per row, or a bool mask of empty rows
            (required for ``sdpa_efficient``; for any other convention an ``empty``
            mask forces those rows to -inf too).
        sentinel: fold every value ``<= sentinel`` (in the foreign units) to -inf
            (older FlashInfer releases: -5e4, -1e30).
        return_count: also return how many entries were folded to the empty marker.

    Returns:
        ``lse`` float32 canonical, or ``(lse, n_folded)``.
    """
    _check_lse(lse)
    _check_convention(convention)
    x = lse.float()
    folded = torch.isposinf(x)
    if convention == "sigmoid_merge":
        folded |= torch.isnan(x)
    if sentinel is not None:
        folded |= (x <= sentinel) & ~torch.isneginf(x)
    if convention == "sdpa_efficient" or empty is not None or key_counts is not None:
        folded |= _empty_from_counts(x, key_counts, empty) & ~torch.isneginf(x)
    if convention in ("flashinfer", "log2"):
        x = x * LN2
    out = torch.where(folded, torch.full_like(x, NEG_INF), x)
    if convention == "flashmla" and sink is not None:
        out = torch.logaddexp(out, _as_broadcast("sink", sink, x).float())
    if return_count:
        return out, int(folded.sum())
    return out


def from_canonical(
    lse: torch.Tensor,
    convention: str,
    *,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Canonical LSE -> a foreign convention (for handing states to other libraries).

    Args:
        lse: canonical LSE (natural log, -inf empty), any shape.
        convention: one of ``CONVENTIONS``.
        sink: for ``flashmla``, the sink logits the canonical LSE includes; they are
            removed, ``log(exp(lse) - exp(sink))``.

    Returns:
        float32 LSE in the foreign convention.
    """
    _check_lse(lse)
    _check_convention(convention)
    x = lse.float()
    if convention == "flashmla" and sink is not None:
        s = torch.as_tensor(sink, device=x.device).float()
        # log(e^L - e^s) = L + log1p(-e^(s - L)); a row with only the sink gives -inf, a NaN
        # (bad data, or a NaN sink) stays NaN.
        x = torch.where(x > s, x + torch.log1p(-torch.exp(s - x)),
                        torch.where(torch.isnan(x) | torch.isnan(s), x + s,
                                    torch.full_like(x, NEG_INF)))
    if convention in ("fa2", "flashmla"):
        return torch.where(torch.isneginf(x), torch.full_like(x, float("inf")), x)
    if convention == "sdpa_efficient":
        return torch.where(torch.isneginf(x), torch.zeros_like(x), x)
    if convention in ("flashinfer", "log2"):
        return x * LOG2E
    return x
