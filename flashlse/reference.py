"""Float64 references for every public function: docs/design.md §1-2 as executable code.

Plain and slow on purpose: the whole score matrix is built, in float64, and every
function is differentiable through ordinary torch autograd (the gradients of empty
rows are 0, not NaN, because no division or log ever sees a zero that autograd
would differentiate). Tests compare every path against these. Outputs are float64:
``out`` in the input layout, ``lse`` natural log with -inf for empty rows.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .masks import normalize_window, visible

# The precision every reference computes in; float64 except inside `computed_in`.
_F64 = torch.float64


@contextlib.contextmanager
def computed_in(dtype: torch.dtype):
    """Runs the references in ``dtype`` instead of float64: the same plain math at the
    precision of the code under test, which is the yardstick of the tests' relative
    tolerance (``err(ours) <= 2 err(torch in that dtype) + atol``)."""
    global _F64
    saved, _F64 = _F64, dtype
    try:
        yield
    finally:
        _F64 = saved


def softmax_weights(scores: torch.Tensor, sink: torch.Tensor | None = None):
    """``(P, L)`` of one row set: ``L = log(sum_j e^S_j [+ e^sink])`` and ``P_j = e^(S_j - L)``.

    The sink is an extra key of value 0, so it enters ``L`` and leaves no column in ``P``;
    ``out = P @ V``. An empty row gives ``P = 0`` and ``L = -inf`` (or ``L = sink``).

    Args:
        scores: ``(..., Sk)`` logits, -inf for masked keys.
        sink: logits broadcastable to ``scores.shape[:-1]``.

    Returns:
        ``(P (..., Sk), L (...))``.
    """
    sk = scores.shape[-1]
    if sink is not None:
        sink_col = torch.broadcast_to(sink.to(scores.dtype), scores.shape[:-1]).unsqueeze(-1)
        scores = torch.cat([scores, sink_col], dim=-1)
    if scores.shape[-1] == 0:
        return scores, scores.new_full(scores.shape[:-1], float("-inf"))
    # The pivot is only a shift; detaching it keeps autograd from splitting ties.
    m = scores.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m)
    z = e.sum(dim=-1, keepdim=True)
    # Empty only when no key is visible (z exactly 0): a NaN z is data and propagates.
    nonempty = z != 0
    # Neither branch of a where may divide by or log a zero: autograd differentiates both.
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    inv_sum = torch.where(nonempty, 1.0 / z_safe, torch.zeros_like(z))
    lse = torch.where(nonempty, torch.log(z_safe) + m, torch.full_like(z, float("-inf")))
    return (e * inv_sum)[..., :sk], lse.squeeze(-1)


def _scores(q, k, scale, softcap):
    s = q.matmul(k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    # (B, Sk, Hkv, D) -> (B, Hq, Sk, D): query head h reads kv head h // (Hq // Hkv).
    return x.transpose(1, 2).repeat_interleave(hq // x.shape[2], dim=1)


def attention(q, k, v, *, causal=False, window=(None, None), softcap=0.0, scale=None,
              sink=None, return_lse=False):
    """Reference of :func:`flashlse.attention`.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)``.
        sink: ``(Hq,)`` per-head logits or None.

    Returns:
        ``out (B, Sq, Hq, Dv)`` float64, and ``lse (B, Hq, Sq)`` float64 if ``return_lse``.
    """
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qh = q.to(_F64).transpose(1, 2)
    kh, vh = _expand_kv(k.to(_F64), hq), _expand_kv(v.to(_F64), hq)
    s = _scores(qh, kh, scale, softcap)
    left, right = normalize_window(causal, window)
    ok = visible(torch.arange(sq, device=q.device), torch.arange(sk, device=q.device),
                 sq, sk, left, right)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    p, lse = softmax_weights(s, None if sink is None else sink.to(_F64).view(1, hq, 1))
    out = p.matmul(vh)
    # Over zero keys the product is an empty sum, but out = sum / e^L still: a NaN L (a NaN
    # or +inf sink) makes out NaN there too, as on every other row of the head.
    out = torch.where(torch.isnan(lse).unsqueeze(-1), float("nan"), out).transpose(1, 2)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     seqused_k=None, block_table=None, causal=False, window=(None, None),
                     softcap=0.0, scale=None, sink=None, return_lse=False):
    """Reference of :func:`flashlse.attention_varlen`: each sequence is its own ``attention``.

    Args:
        q: ``(total_q, Hq, D)``; k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)``, or
            paged caches ``(num_pages, page_size, Hkv, D / Dv)`` with ``block_table``.
        cu_seqlens_q / cu_seqlens_k: ``(B + 1,)`` int32 offsets (cu_seqlens_k may be None
            with a block table and seqused_k).
        seqused_k: ``(B,)`` int32, keys actually used per sequence (a prefix).
        block_table: ``(B, max_pages)`` int32: sequence b's key j is row ``j % page_size`` of
            page ``block_table[b, j // page_size]``.

    Returns:
        ``out (total_q, Hq, Dv)`` float64, and ``lse (Hq, total_q)`` if ``return_lse``.
    """
    hq = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if block_table is not None:
            n = int(seqused_k[b]) if seqused_k is not None else int(
                cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            kb, vb = gather_cache(k, b, n, block_table), gather_cache(v, b, n, block_table)
        else:
            k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            if seqused_k is not None:
                k1 = k0 + int(seqused_k[b])
            kb, vb = k[k0:k1], v[k0:k1]
        o, l = attention(q[None, q0:q1], kb[None], vb[None], causal=causal,
                         window=window, softcap=softcap, scale=scale, sink=sink,
                         return_lse=True)
        outs.append(o[0])
        lses.append(l[0])
    out = torch.cat(outs, 0) if outs else q.new_zeros((0, hq, v.shape[-1]), dtype=_F64)
    lse = torch.cat(lses, 1) if lses else q.new_zeros((hq, 0), dtype=_F64)
    return (out, lse) if return_lse else out


def gather_cache(cache, b, n, block_table=None):
    """The first ``n`` positions of sequence ``b`` from a contiguous or paged cache."""
    if block_table is None:
        return cache[b, :n]
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    pages = block_table[b].long()[pos // page]
    return cache[pages, pos % page]


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, cache_leftpad=None,
                           block_table=None, k_new=None, v_new=None, num_splits=0, causal=False,
                           window=(None, None), softcap=0.0, scale=None, sink=None,
                           return_lse=False):
    """Reference of :func:`flashlse.attention_with_kvcache`.

    ``k_new``/``v_new`` are written into the caches in place at ``cache_seqlens``
    (so the caches change, as with flash-attn), then each sequence attends to its
    ``cache_seqlens[b] + Snew`` keys, masks bottom-right aligned. ``num_splits`` does
    not change the result.

    Args:
        q: ``(B, Sq, Hq, D)``; caches ``(B, Smax, Hkv, D)`` or paged
            ``(num_pages, page_size, Hkv, D)`` with ``block_table (B, max_pages)``.
        cache_seqlens: ``(B,)`` int32; None means the whole (contiguous) cache.
        cache_leftpad: ``(B,)`` int32 or None: sequence b's keys are cache rows
            ``[cache_leftpad[b], cache_seqlens[b] + Snew)``; the masks stay aligned to the end.

    Returns:
        ``out (B, Sq, Hq, Dv)`` float64, and ``lse (B, Hq, Sq)`` if ``return_lse``.
    """
    del num_splits
    bsz = q.shape[0]
    if cache_seqlens is None:
        cache_seqlens = torch.full((bsz,), k_cache.shape[1], dtype=torch.int32)
    s_new = 0 if k_new is None else k_new.shape[1]
    if k_new is not None:
        page = k_cache.shape[1]
        for b in range(bsz):
            pos = int(cache_seqlens[b]) + torch.arange(s_new)
            if block_table is None:
                k_cache[b, pos], v_cache[b, pos] = k_new[b], v_new[b]
            else:
                pages = block_table[b].long()[pos // page]
                k_cache[pages, pos % page] = k_new[b]
                v_cache[pages, pos % page] = v_new[b]
    outs, lses = [], []
    for b in range(bsz):
        n = int(cache_seqlens[b]) + s_new
        lo = 0 if cache_leftpad is None else int(cache_leftpad[b])
        kb = gather_cache(k_cache, b, n, block_table)[lo:]
        vb = gather_cache(v_cache, b, n, block_table)[lo:]
        o, l = attention(q[b:b + 1], kb[None], vb[None], causal=causal, window=window,
                         softcap=softcap, scale=scale, sink=sink, return_lse=True)
        outs.append(o)
        lses.append(l)
    out, lse = torch.cat(outs, 0), torch.cat(lses, 0)
    return (out, lse) if return_lse else out


def _pad_key(x):
    return torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)


def sparse_attention(q, k, v, indices, *, block_table=None, scale=None, sink=None,
                     return_lse=False):
    """Reference of :func:`flashlse.sparse_attention`: each row attends to its listed keys.

    Every non-negative entry of ``indices`` is one key term (a repeated index counts
    each time); ``-1`` is no key, and a row of all ``-1`` is empty.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)``, or paged
            caches ``(num_pages, page_size, Hkv, D / Dv)`` with ``block_table (B, max_pages)``
            (indices are token positions of each sequence).
        indices: ``(B, Sq, Hkv, topk)`` int32 key positions, -1 for none.

    Returns:
        ``out (B, Sq, Hq, Dv)`` float64, and ``lse (B, Hq, Sq)`` if ``return_lse``.
    """
    if block_table is not None:
        cap = block_table.shape[1] * k.shape[1]
        k = torch.stack([gather_cache(k, i, cap, block_table) for i in range(q.shape[0])])
        v = torch.stack([gather_cache(v, i, cap, block_table) for i in range(q.shape[0])])
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    idx = indices.long()
    valid = idx >= 0
    bi = torch.arange(b, device=q.device).view(b, 1, 1, 1)
    hi = torch.arange(hkv, device=q.device).view(1, 1, hkv, 1)
    # A -1 entry uses no key: gather from a copy with one zero key appended, at its index.
    safe = torch.where(valid, idx, k.shape[1])
    kg = _pad_key(k.to(_F64))[bi, safe, hi]  # (B, Sq, Hkv, topk, D)
    vg = _pad_key(v.to(_F64))[bi, safe, hi]
    qg = q.to(_F64).view(b, sq, hkv, g, d)
    s = torch.einsum("bqhgd,bqhtd->bqhgt", qg, kg) * scale
    s = s.masked_fill(~valid.unsqueeze(3), float("-inf"))
    p, lse = softmax_weights(s, None if sink is None else sink.to(_F64).view(1, 1, hkv, g))
    out = torch.einsum("bqhgt,bqhtd->bqhgd", p, vg).reshape(b, sq, hq, v.shape[-1])
    lse = lse.reshape(b, sq, hq).transpose(1, 2)
    return (out, lse) if return_lse else out


def merge_states(outs, lses, *, sink=None):
    """Reference of :func:`flashlse.merge_states`.

    ``L = log sum_s e^(L_s) [+ e^sink]``, ``O = sum_s e^(L_s - L) O_s``; all-empty gives
    ``(0, -inf)`` (or ``(0, sink)``).

    Args:
        outs: ``(N, ..., D)``; lses: ``(N, ...)``; sink broadcastable to ``lses[0]``.

    Returns:
        ``(out (..., D), lse (...))`` float64.
    """
    o = outs.to(_F64).movedim(0, -2)  # (..., N, D)
    l = lses.to(_F64).movedim(0, -1)  # (..., N)
    shape = torch.broadcast_shapes(l.shape[:-1], o.shape[:-2])
    l = l.expand(shape + l.shape[-1:])
    o = o.expand(shape + o.shape[-2:])
    p, lse = softmax_weights(l, None if sink is None else sink.to(_F64))
    return p.unsqueeze(-2).matmul(o).squeeze(-2), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Reference of :func:`flashlse.merge`: :func:`merge_states` of two states."""
    return merge_states(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))
