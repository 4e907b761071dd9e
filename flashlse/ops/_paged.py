"""Paged caches read as packed varlen rows, for the PyTorch path (the kernels read pages in
place: ``kernels/fwd.attn_fwd_paged``), and for
long paged prefills of ``attention_with_kvcache`` before the dense kernel (ops/kvcache.py)."""

from __future__ import annotations

import torch


def gather_pages(k_cache, v_cache, block_table, lens):
    """Sequence b's pages copied into rows ``[b * capacity, (b + 1) * capacity)``.

    Args:
        k_cache / v_cache: ``(num_pages, page_size, Hkv, D / Dv)``.
        block_table: ``(B, max_pages)`` int32; capacity = ``max_pages * page_size``.
        lens: ``(B,)`` int32 keys of each sequence.

    Returns:
        ``k (B * capacity, Hkv, D)``, ``v``, ``cu_seqlens_k (B + 1,)`` int32 and
        ``seqused_k (B,)`` int32: ``lens`` clamped to ``[0, capacity]`` and ended before the
        first block-table entry outside ``[0, num_pages)`` (value checks are opt-in on GPUs:
        such a page and every later one hold no key; nothing outside the cache is read).
        No host sync; a copy of every sequence's whole capacity.
    """
    num_pages, page = k_cache.shape[:2]
    b, max_pages = block_table.shape
    cap = max_pages * page
    valid = (block_table >= 0) & (block_table < num_pages)
    cols = torch.arange(max_pages, device=block_table.device, dtype=torch.int32)
    # The first entry outside the cache (max_pages when none is); amin needs a column.
    first_bad = (torch.where(valid, max_pages, cols[None]).amin(1) if max_pages
                 else cols.new_zeros(b))
    if num_pages == 0:
        k = k_cache.new_zeros((b * cap,) + tuple(k_cache.shape[2:]))
        v = v_cache.new_zeros((b * cap,) + tuple(v_cache.shape[2:]))
    else:
        pages = block_table.clamp(0, num_pages - 1).long()
        k, v = k_cache[pages].flatten(0, 2), v_cache[pages].flatten(0, 2)
    cu_k = torch.arange(b + 1, dtype=torch.int32, device=block_table.device) * cap
    used = torch.minimum(lens.clamp(0, cap), first_bad * page).to(torch.int32)
    return k, v, cu_k, used
