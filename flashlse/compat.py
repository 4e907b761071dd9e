"""flash-attn drop-in signatures over flashlse, with an honest LSE.

``flash_attn_func`` & co. take flash-attn 2's arguments and return what it returns, except
that ``softmax_lse`` follows flashlse's contract: an empty row has ``-inf`` where flash-attn 2
writes ``+inf``. Code that needs the old value can call
``flashlse.lse.from_canonical(lse, "fa2")``. Dropout and ALiBi are not supported and raise.
"""

from __future__ import annotations

import torch

from . import ops


def _window(window_size):
    left, right = window_size
    return (None if left < 0 else left, None if right < 0 else right)


def _unsupported(dropout_p, alibi_slopes):
    if dropout_p:
        raise ValueError(f"flashlse does not implement attention dropout, got dropout_p = "
                         f"{dropout_p}; pass 0.0 (dropout is usually off at inference)")
    if alibi_slopes is not None:
        raise ValueError("flashlse does not implement ALiBi; pass alibi_slopes=None")


def _packed(x):
    """flash-attn 2 copies a tensor whose last dim is strided (its ``maybe_contiguous``)
    where flashlse's own functions ask for the copy: the drop-ins take what flash-attn
    takes."""
    return x.contiguous() if x is not None and x.dim() and x.stride(-1) != 1 else x


def _ret(out, lse, return_attn_probs):
    # flash-attn returns (out, softmax_lse, S_dmask); S_dmask only exists with dropout.
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2 ``flash_attn_func``: q ``(B, Sq, Hq, D)`` -> out, or (out, lse, None)."""
    _unsupported(dropout_p, alibi_slopes)
    q, k, v = _packed(q), _packed(k), _packed(v)
    out, lse = ops.attention(q, k, v, causal=causal, window=_window(window_size),
                             softcap=softcap, scale=softmax_scale,
                             deterministic=deterministic, return_lse=True)
    return _ret(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, seqused_k=None, block_table=None):
    """flash-attn 2 ``flash_attn_varlen_func``: q ``(total_q, Hq, D)``, lse ``(Hq, total_q)``.
    With ``block_table`` (vLLM's call) k and v are paged caches
    ``(num_pages, page_size, Hkv, D)`` and ``seqused_k`` (or ``cu_seqlens_k``) the lengths."""
    _unsupported(dropout_p, alibi_slopes)
    # (As in flash-attn 2, the lengths and the block table must be packed already.)
    out, lse = ops.attention_varlen(_packed(q), _packed(k), _packed(v), cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    seqused_k=seqused_k, block_table=block_table, causal=causal,
                                    window=_window(window_size), softcap=softcap,
                                    scale=softmax_scale, deterministic=deterministic,
                                    return_lse=True)
    return _ret(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_qkvpacked_func``: qkv ``(B, S, 3, H, D)`` (views, no copy;
    the gradient flows into qkv)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_kvpacked_func``: kv ``(B, Sk, 2, Hkv, D)``."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2 ``flash_attn_varlen_qkvpacked_func``: qkv ``(total, 3, H, D)``."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash-attn 2 ``flash_attn_varlen_kvpacked_func``: kv ``(total_k, 2, Hkv, D)``."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def _batch_idx_as_table(q, k_cache, cache_batch_idx, block_table, cache_seqlens):
    """``cache_batch_idx`` as a one-column block table over the cache's rows, and the
    lengths (the whole row where none are given)."""
    if block_table is not None:
        raise ValueError("cache_batch_idx picks rows of a contiguous cache; with a block_table "
                         "(a paged cache) pass block_table alone, as flash-attn asks")
    if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32:
        raise TypeError(f"cache_batch_idx must be an int32 tensor (B,), got "
                        f"{getattr(cache_batch_idx, 'dtype', type(cache_batch_idx).__name__)}"
                        f"; pass cache_batch_idx.to(torch.int32)")
    if cache_batch_idx.shape != (q.shape[0],):
        raise ValueError(f"cache_batch_idx must be (B,) = ({q.shape[0]},), got "
                         f"{tuple(cache_batch_idx.shape)}")
    if cache_seqlens is None:
        cache_seqlens = torch.full((q.shape[0],), k_cache.shape[1], dtype=torch.int32,
                                   device=q.device)
    return _packed(cache_batch_idx).view(-1, 1), cache_seqlens


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn 2 ``flash_attn_with_kvcache``; ``k``/``v`` are appended in place.

    ``cache_batch_idx`` (B,) int32 picks each sequence's row of a contiguous cache ``(B_cache,
    Smax, Hkv, D)``: the cache is read (and appended to) in place as a paged cache of
    B_cache pages of Smax rows, with ``cache_batch_idx`` as a one-column block table. An
    index outside ``[0, B_cache)`` is a ValueError where value checks run, else a sequence
    of no key (as a bad page). ``cache_leftpad`` (B,) int32: sequence b's keys start at
    cache row ``cache_leftpad[b]`` (contiguous caches, not with ``cache_batch_idx``)."""
    _unsupported(0.0, alibi_slopes)
    for name, arg in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if arg is not None:
            raise ValueError(f"flashlse.compat.flash_attn_with_kvcache does not support {name}; "
                             f"apply it before the call and pass {name}=None")
    if cache_leftpad is not None and cache_batch_idx is not None:
        raise ValueError("flashlse.compat.flash_attn_with_kvcache takes cache_leftpad or "
                         "cache_batch_idx, not both (cache_batch_idx reads the cache as pages, "
                         "cache_leftpad needs a contiguous one)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    if cache_batch_idx is not None:
        block_table, cache_seqlens = _batch_idx_as_table(q, k_cache, cache_batch_idx,
                                                         block_table, cache_seqlens)
    out, lse = ops.attention_with_kvcache(_packed(q), k_cache, v_cache,
                                          cache_seqlens=_packed(cache_seqlens),
                                          cache_leftpad=_packed(cache_leftpad),
                                          block_table=_packed(block_table), k_new=_packed(k),
                                          v_new=_packed(v),
                                          num_splits=num_splits, causal=causal,
                                          window=_window(window_size), softcap=softcap,
                                          scale=softmax_scale, return_lse=True)
    return (out, lse) if return_softmax_lse else out
