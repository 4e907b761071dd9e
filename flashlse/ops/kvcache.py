"""``attention_with_kvcache``: decode / chunked prefill against a contiguous or paged cache.

Split-KV on the PyTorch path works as the kernel does: the keys of each sequence are
cut into ``num_splits`` ranges, each range gives a partial state (an empty range gives
``(0, -inf)``), the states are merged with ``merge_states`` and the sink is added once,
after merging -- never per split.
"""

from __future__ import annotations

import torch

from .. import masks
from . import _validate as V
from ._dispatch import compute_dtype, kernel_module, on_tensor_device, use_triton
from ._paged import gather_pages
from .attention import attn_fwd_torch, sdpa_fwd_ranges
from .merge import merge_math

# The decode kernel takes up to this many query rows per sequence (speculative decoding).
DECODE_MAX_SQ = 16
# Calls of up to DECODE_WIDE_MAX rows on a contiguous cache take the decode kernel too, as
# fl.attention's short-query route does (dispatch.SHORT_Q_WIDE; the kernel packs a kv head's
# Sq x group rows into its row tiles); off, they run the prefill path (the varlen forward).
# Measured on an H100 (NOTES.md, session 50; AB_SET=kvwide benchmarks/ab_decode_switch.py
# --flag flashlse.ops.kvcache.DECODE_WIDE), 32 / 8 heads, D = 128, causal: contiguous B = 1
# Sq = 32 8k 2.0x, B = 8 Sq = 32 2k 1.46x, B = 8 Sq = 20 4k 1.59x, B = 64 Sq = 32 2k 1.62x;
# paged caches 0.78x (B = 8 Sq = 32 4k, pages of 16) and 0.87x (B = 1 Sq = 24 32k, pages of
# 64) against the Hopper paged kernel: paged calls keep the prefill path past 16 rows.
DECODE_WIDE = True
DECODE_WIDE_MAX = 32
# Paged calls of 2-16 rows stay on the decode kernel: on an H100 (session 51, that kernel
# against the Hopper paged kernel in turn; 32 / 8 heads, D = 128, causal) it ran 1.15x (B = 8
# Sq = 4 4k, pages of 16), 1.24x (Sq = 16), 1.73x (Sq = 8), 2.2x (B = 64 Sq = 8 2k) and
# 2.5x / 6.6x (B = 1 Sq = 16 / 4 32k, pages of 64) the paged kernels; paged attention_varlen
# calls of such uniform rows may take it too (dispatch.PAGED_DECODE, off until measured).


def decode_rows(paged: bool) -> int:
    """The most query rows a sequence that ``attention_with_kvcache`` runs on the decode
    kernel (``paged``: the call has a block table)."""
    return DECODE_WIDE_MAX if DECODE_WIDE and not paged else DECODE_MAX_SQ


def _gather(cache, b, n, block_table):
    if block_table is None:
        return cache[b, :n]
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[block_table[b].long()[pos // page], pos % page]


def _append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table):
    # Writes k_new[b, t] at position cache_seqlens[b] + t of sequence b, in place.
    bsz, s_new = k_new.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(s_new, device=k_new.device)[None]
    if block_table is None:
        rows = torch.arange(bsz, device=k_new.device)[:, None].expand(bsz, s_new)
        k_cache[rows, pos] = k_new
        v_cache[rows, pos] = v_new
    else:
        page = k_cache.shape[1]
        pages = torch.gather(block_table.long(), 1, pos // page)
        k_cache[pages, pos % page] = k_new
        v_cache[pages, pos % page] = v_new


def _split_fwd(qb, kb, vb, num_splits, left, right, softcap, scale, sink):
    """One sequence, keys cut into ``num_splits`` ranges, merged, then the sink once."""
    sk = kb.shape[1]
    # (Past one split a key the rest would be empty ranges: capped there, as the kernels cap
    # a forced count at one split a key tile.)
    num_splits = min(num_splits, max(sk, 1))
    bounds = torch.linspace(0, sk, num_splits + 1).round().long().tolist()
    # Partials of several ranges stay in the accumulation dtype until the merge (as the
    # kernels' do); one range is the call itself (computed as attn_fwd_torch computes q's
    # dtype: a bf16 cache is not copied to float32 where the CPU multiplies bf16).
    qc = qb if num_splits == 1 else qb.to(compute_dtype(qb.dtype))
    outs, lses = [], []
    for k0, k1 in zip(bounds, bounds[1:]):
        # A key range [k0, k1) of a sequence of sk keys: bottom-right alignment moves by
        # sk - k1, so the window shifts by that much (left may go negative: still exact).
        shift = sk - k1
        o, l = attn_fwd_torch(
            qc, kb[:, k0:k1], vb[:, k0:k1],
            left=None if left is None else left - shift,
            right=None if right is None else right + shift,
            softcap=softcap, scale=scale, sink=None)
        outs.append(o.transpose(1, 2))  # (1, Hq, Sq, Dv): lse (1, Hq, Sq) is out's shape[:-1]
        lses.append(l)
    out, lse = merge_math(torch.stack(outs), torch.stack(lses),
                          None if sink is None else sink.view(-1, 1))
    return out.transpose(1, 2).to(qb.dtype), lse


# Query rows from which a paged prefill that the Hopper paged kernel does not take gathers
# its pages and runs the dense varlen kernel: on the H200 (RESULTS.md 2026-12-01, session 8,
# sweep_paged.py: B=4 Sq=512 on 8k, page 16) gather + the Hopper forward took 0.54 ms (0.84x
# dense), the portable paged kernel 0.81-1.32 ms over nine tiles (0.32-0.52x; the portable
# dense kernel 0.76x). Shorter chunks read the pages in place: the copy of whole cache rows
# would outweigh their compute.
_GATHER_MIN_ROWS = 128
# The gather copies every sequence's whole block-table capacity (its lengths are on the
# device: reading them would sync). A table much wider than the chunk, as vLLM sizes them
# for the longest context (a 512-row chunk on a table of 128k rows), would copy mostly
# unused pages and allocate B x capacity rows, so tables of more than this many rows a query
# row read their pages in place too. The measured 0.84x is a 512-row chunk on an 8k table
# (16 rows a query row); the copy is then at most 16 x the chunk's own K/V rows.
_GATHER_MAX_TABLE_ROWS_PER_QUERY = 16


def _prefill_fwd(q, k_cache, v_cache, lens, s_new, block_table, kw, kept=None, append=None,
                 leftpad=None):
    """Queries longer than the decode kernel takes: the varlen forward kernel, one sequence
    per batch row, its keys the first ``lens[b] + s_new`` of its cache row (seqused_k). A
    paged cache is read in place by the paged kernels (``dispatch.attn_fwd_paged``), except
    for long chunks that the Hopper paged kernel does not take: their pages are gathered
    into rows first for the dense kernel, when the block table is not much wider than the
    chunk. A page out of range ends its sequence there: it and later pages hold no key.
    lse ``(B, Hq, Sq)`` is a view of the kernels' ``(Hq, B * Sq)``, copied contiguous only
    where it is returned. ``kept``: the call's key when it passed every check; the launch of
    a contiguous cache and the in-place read of a paged one are kept by it
    (``_run_kept_chunk``), with ``append`` (the append's plan, which already ran) when the
    call appends. ``leftpad``: a contiguous cache's ``cache_leftpad`` (each sequence's keys
    start there: its row offset moves up by it and its used keys down, on the device)."""
    dispatch = kernel_module("dispatch")
    b, sq, hq, d = q.shape
    used = None if lens is None else (lens + s_new if s_new else lens)
    if block_table is None:
        rows, k, v, cu_q, cu_k = _chunk_rows(q, k_cache, v_cache)
        smax = k_cache.shape[1]
        if leftpad is not None:
            # Each sequence's keys from its start: its row offset up, its used keys down, the
            # start and the end clamped into its own cache row (any value stays inside it).
            pad = leftpad.clamp(0, smax)
            cu_k = torch.cat([cu_k[:-1] + pad, cu_k[-1:]])
            end = torch.full_like(pad, smax) if used is None else used.clamp(0, smax)
            used = (end - pad).clamp(min=0).to(torch.int32)
    else:
        capacity = block_table.shape[1] * k_cache.shape[1]
        if (sq < _GATHER_MIN_ROWS or capacity > _GATHER_MAX_TABLE_ROWS_PER_QUERY * sq
                or dispatch.paged_in_place(q, k_cache, v_cache, softcap=kw["softcap"],
                                           scale=kw["scale"])):
            plans = None
            if kept is not None:  # the scalars, not this call's sink; the plans this call makes
                plans = {}
                _keep_chunk(kept, ("paged", {n: x for n, x in kw.items() if n != "sink"},
                                   plans), append)
            return _paged_chunk(q, k_cache, v_cache, block_table, used, kw, plans)
        rows = q.reshape(b * sq, hq, d)
        cu_q = kernel_module("_common").row_starts(b, sq, q.device)
        k, v, cu_k, used = gather_pages(k_cache, v_cache, block_table, used)
        smax = k.shape[0] // max(b, 1)
    out, lse, launch = dispatch.attn_fwd_launched(
        rows, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=smax,
        seqused_k=used, **kw)
    if kept is not None and block_table is None:
        _keep_chunk(kept, launch, append)
    return out.view(b, sq, hq, -1), lse.view(hq, b, sq).transpose(0, 1)


def _paged_chunk(q, k_cache, v_cache, block_table, used, kw, plans=None):
    """A chunk read in place from a paged cache (``dispatch.attn_fwd_paged``; ``plans``: the
    kept key's cache of its plans): every sequence has Sq query rows and at most the table's
    capacity of keys."""
    b, sq, hq, d = q.shape
    out, lse = kernel_module("dispatch").attn_fwd_paged(
        q.reshape(b * sq, hq, d), k_cache, v_cache, block_table,
        cu_seqlens_q=kernel_module("_common").row_starts(b, sq, q.device), max_seqlen_q=sq,
        seqused_k=used, max_seqlen_k=block_table.shape[1] * k_cache.shape[1], min_seqlen_q=sq,
        plans=plans, **kw)
    return out.view(b, sq, hq, -1), lse.view(hq, b, sq).transpose(0, 1)


def _keep_chunk(kept, launch, append):
    """Keeps a chunk's launch (a contiguous cache's forward launch, or ``("paged", kw,
    plans)``: the in-place paged read with its normalised scalars and its own cache of the
    paged kernels' plans) and its append's plan (None: no append) by the call's key."""
    if len(_CHUNK_KEPT) >= _MAX_KEPT:
        _CHUNK_KEPT.clear()
    _CHUNK_KEPT[kept] = (launch, _fwd_options(), append)


def _chunk_rows(q, k_cache, v_cache):
    """A chunk on a contiguous cache as the varlen forward takes it: q's rows ``(B * Sq,
    Hq, D)``, the caches' rows ``(B * Smax, Hkv, D)`` and both ``cu_seqlens``."""
    b, sq, smax = q.shape[0], q.shape[1], k_cache.shape[1]
    starts = kernel_module("_common").row_starts
    return (q.reshape(b * sq, *q.shape[2:]), k_cache.reshape(b * smax, *k_cache.shape[2:]),
            v_cache.reshape(b * smax, *v_cache.shape[2:]), starts(b, sq, q.device),
            starts(b, smax, q.device))


# A chunk (more query rows than the decode kernel takes) whose key (``_kept_key``) passed
# every check before: on a contiguous cache the forward's launch the dispatcher chose for
# it (``dispatch.fwd_launch``, a function of the call's metadata), launched at once on the
# cache's rows; on a paged cache read in place, the paged dispatcher with the scalars
# normalised once (whether a chunk is read in place or gathered is a function of the key
# and the options); after the kept append's launch when it appends. Value checks, grad,
# torch.compile and gathered chunks take the full path.
_CHUNK_KEPT: dict = {}


def _fwd_options():
    """The options the forward's dispatcher reads (not in ``_kept_key``, which the decode's
    plan shares): a kept chunk launch is used only under the options it was chosen under."""
    opts = kernel_module("options").current()
    return opts.sm90_fwd, opts.sm90_fwd_paged, opts.fwd_config, opts.fwd_sm90_config


def _run_kept_chunk(kept, q, k_cache, v_cache, cache_seqlens, block_table, sink, k_new=None,
                    v_new=None):
    """``(out, lse)`` of a chunk by the launch kept for ``kept`` (after the kept append's,
    with ``k_new``), or None: none kept, other forward options, value checks asked for, a
    tensor needing grad, or the Hopper kernel failed to compile (the launch dropped; the
    full path then appends the same rows again)."""
    hit = _CHUNK_KEPT.get(kept)
    if hit is None or hit[1] != _fwd_options() or V.needs_grad(q, k_cache, v_cache, sink) or \
            (cache_seqlens is not None and V.values_checkable(cache_seqlens)):
        return None
    used = cache_seqlens
    if k_new is not None:
        kernel_module("decode").run_append(hit[2], k_cache, v_cache, k_new, v_new,
                                           cache_seqlens, block_table)
        used = cache_seqlens + k_new.shape[1]
    if hit[0].__class__ is tuple:
        return _paged_chunk(q, k_cache, v_cache, block_table, used, dict(hit[0][1], sink=sink),
                            hit[0][2])
    b, sq, hq, _ = q.shape
    rows, k, v, cu_q, cu_k = _chunk_rows(q, k_cache, v_cache)
    out, lse = kernel_module("fwd").new_outputs(rows, v, cu_q)
    if not hit[0](rows, k, v, out, lse, sink, cu_q, cu_k, used):
        _CHUNK_KEPT.pop(kept, None)
        return None
    return out.view(b, sq, hq, -1), lse.view(hq, b, sq).transpose(0, 1)


def _torch_fwd(q, k_cache, v_cache, lens, s_new, block_table, k_new, v_new, num_splits, kw,
               leftpad=None):
    """The PyTorch path: CPU tensors (values checked), float64, and GPU calls with long
    queries of head dims above the prefill kernel's (this path reads lengths on the host)."""
    if k_new is not None:
        _append(k_cache, v_cache, k_new, v_new, lens, block_table)
    bsz, capacity = q.shape[0], k_cache.shape[1]
    total = [capacity] * bsz if lens is None else (lens + s_new).tolist()
    starts = [0] * bsz if leftpad is None else leftpad.clamp(0, capacity).tolist()
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if block_table is None and num_splits <= 1 and bsz > 1:
        # Sequences of other lengths (or left padding) in one call of torch's CPU kernel, the
        # ranges as a mask (a decode step of 8 padded rows on 1k keys: 2.3 -> 1.2 ms on 2 CPU
        # threads; attention.MASKED_WASTE_BYTES bounds the padding it reads).
        got = sdpa_fwd_ranges(q, k_cache, v_cache, starts, total, **kw)
        if got is not None:
            return got[0], got[1].to(lse_dtype)
    outs, lses = [], []
    for b in range(bsz):
        n, lo = total[b], starts[b]
        # Keys [lo, n): bottom-right alignment against n - lo keys is the same diagonal.
        o, l = _split_fwd(q[b:b + 1], _gather(k_cache, b, n, block_table)[None, lo:],
                          _gather(v_cache, b, n, block_table)[None, lo:], max(1, num_splits),
                          **kw)
        outs.append(o)
        lses.append(l)
    if not outs:
        return (q.new_zeros(q.shape[:3] + v_cache.shape[-1:]),
                q.new_zeros((0, q.shape[2], q.shape[1]), dtype=lse_dtype))
    return torch.cat(outs), torch.cat(lses).to(lse_dtype)


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits,
              cache_leftpad=None):
    """Checks the call (metadata checks skipped for metadata that passed them before: only
    ``num_splits`` is not metadata); returns ``(lens, s_new)``."""
    key = V.meta_key("kvcache", q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                     cache_leftpad)
    if V.passed(key):
        _check_num_splits(num_splits)
    else:
        _validate_meta(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits)
        _validate_leftpad_meta(q, cache_leftpad, block_table)
        V.remember(key)
    if cache_leftpad is not None and q.shape[0] and V.values_checkable(cache_leftpad):
        ends = (torch.full_like(cache_leftpad, k_cache.shape[1]) if cache_seqlens is None else
                cache_seqlens + (0 if k_new is None else k_new.shape[1]))
        if bool(((cache_leftpad < 0) | (cache_leftpad > ends)).any()):
            raise ValueError(
                f"cache_leftpad must lie in [0, cache_seqlens + Snew] (each sequence's first "
                f"key, at most its end), got {cache_leftpad.tolist()} for ends "
                f"{ends.tolist()}")
    if cache_seqlens is None:
        return None, 0
    lens = cache_seqlens
    s_new = 0 if k_new is None else k_new.shape[1]
    bsz = q.shape[0]
    if not bsz or not V.values_checkable(lens):
        # Values not read (a GPU without value_checks, compile, CUDA graph capture): the
        # kernels clamp lengths to the cache and treat pages out of range as holding no key.
        return lens, s_new
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi + s_new > capacity:
        raise ValueError(
            f"cache_seqlens + Snew must lie in [0, {capacity}] (the cache capacity), got "
            f"cache_seqlens in [{lo}, {hi}] with Snew = {s_new}; grow the cache or the block table")
    if paged:
        page = k_cache.shape[1]
        need = (lens.long() + s_new + page - 1) // page  # pages each sequence uses
        cols = torch.arange(block_table.shape[1], device=q.device)[None]
        used = cols < need[:, None]
        bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        if bool(bad.any()):
            raise ValueError(
                f"block_table entries for the pages in use must lie in [0, {k_cache.shape[0]}) "
                f"(the number of pages), found {block_table[bad][:4].tolist()}")
    return lens, s_new


def _validate_leftpad_meta(q, cache_leftpad, block_table):
    if cache_leftpad is None:
        return
    if block_table is not None:
        raise ValueError("cache_leftpad takes a contiguous cache (as flash-attn's); with a "
                         "block_table, start each sequence's table at its first page instead")
    V.check_int_tensor("cache_leftpad", cache_leftpad, "(B,)", q.device, 1)
    if cache_leftpad.shape[0] != q.shape[0]:
        raise ValueError(f"cache_leftpad must be (B,) = ({q.shape[0]},), got "
                         f"{tuple(cache_leftpad.shape)}")


def _check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = choose), got {num_splits!r} "
                         f"({V.type_name(num_splits)})")


def _validate_meta(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits):
    """The checks of types, dims, dtypes, devices and shapes (and ``num_splits``), in order."""
    V.check_tensor("q", q, 4, "(B, Sq, Hq, D)")
    paged = block_table is not None
    layout = "(num_pages, page_size, Hkv, D)" if paged else "(B, Smax, Hkv, D)"
    V.check_tensor("k_cache", k_cache, 4, layout)
    V.check_tensor("v_cache", v_cache, 4, layout[:-2] + "Dv)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        V.check_float(name, t)
    V.check_same({"q": q, "k_cache": k_cache, "v_cache": v_cache}, "dtype")
    V.check_same({"q": q, "k_cache": k_cache, "v_cache": v_cache}, "device")
    V.check_last_stride({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    V.check_heads(q.shape[2], k_cache.shape[2], v_cache.shape[2])
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache and v_cache must agree in their first two dims, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q and k_cache must share D, got {q.shape[-1]} and {k_cache.shape[-1]}")
    # Longer queries with head dims above the prefill kernel's run the PyTorch path.
    V.check_head_dim(q.shape[-1], v_cache.shape[-1],
                     q.is_cuda and q.shape[1] <= decode_rows(paged), V.MAX_HEAD_DIM_DECODE)
    _check_num_splits(num_splits)
    bsz = q.shape[0]
    if paged:
        V.check_int_tensor("block_table", block_table, "(B, max_pages)", q.device, 2)
        if block_table.shape[0] != bsz:
            raise ValueError(f"block_table must have B = {bsz} rows, got {block_table.shape[0]}")
    else:
        if k_cache.shape[0] != bsz:
            raise ValueError(f"a contiguous k_cache must have B = {bsz} rows, got "
                             f"{k_cache.shape[0]}; for a paged cache pass block_table")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    s_new = 0
    if k_new is not None:
        V.check_tensor("k_new", k_new, 4, "(B, Snew, Hkv, D)")
        V.check_tensor("v_new", v_new, 4, "(B, Snew, Hkv, Dv)")
        V.check_same({"q": q, "k_new": k_new, "v_new": v_new}, "dtype")
        V.check_same({"q": q, "k_new": k_new, "v_new": v_new}, "device")
        want_k = (bsz, k_new.shape[1]) + tuple(k_cache.shape[2:])
        want_v = (bsz, k_new.shape[1]) + tuple(v_cache.shape[2:])
        if tuple(k_new.shape) != want_k or tuple(v_new.shape) != want_v:
            raise ValueError(f"k_new / v_new must be {want_k} / {want_v}, got "
                             f"{tuple(k_new.shape)} / {tuple(v_new.shape)}")
        s_new = k_new.shape[1]
    if cache_seqlens is None:
        if paged:
            raise ValueError("a paged cache needs cache_seqlens (B,) int32: the valid length "
                             "of each sequence")
        if s_new:
            raise ValueError("k_new needs cache_seqlens (B,) int32: where to append")
    else:
        V.check_int_tensor("cache_seqlens", cache_seqlens, "(B,)", q.device, 1)
        if cache_seqlens.shape[0] != bsz:
            raise ValueError(f"cache_seqlens must be (B,) = ({bsz},), got "
                             f"{tuple(cache_seqlens.shape)}")


@on_tensor_device
def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, cache_leftpad=None,
                           block_table=None, k_new=None, v_new=None, num_splits=0, causal=False,
                           window=(None, None), softcap=0.0, scale=None, sink=None,
                           return_lse=False):
    """Attention of ``q`` over each sequence's cached keys (after appending ``k_new``).

    ``L_i = log(sum_j exp(S_ij) [+ exp(sink)])`` over the ``cache_seqlens[b] + Snew`` keys of
    sequence b; masks bottom-right aligned against that length. Not differentiable.

    Args:
        q: ``(B, Sq, Hq, D)``.
        k_cache / v_cache: ``(B, Smax, Hkv, D / Dv)``, or paged ``(num_pages, page_size, Hkv,
            D / Dv)`` with ``block_table (B, max_pages)`` int32 (any page size). ``v_cache``
            may be a view of ``k_cache`` (MLA: ``v = k[..., :Dv]``).
        cache_seqlens: ``(B,)`` int32 valid lengths (0 allowed); None = the whole cache.
        cache_leftpad: ``(B,)`` int32 or None: sequence b's keys start at cache row
            ``cache_leftpad[b]`` (a left-padded batch; flash-attn's ``cache_leftpad``): the rows
            before it are no keys. ``cache_seqlens`` and the masks stay absolute (k_new is
            written at ``cache_seqlens``). Contiguous caches only.
        k_new / v_new: ``(B, Snew, Hkv, D / Dv)``, written in place at ``cache_seqlens``.
        num_splits: split-KV count; 0 chooses (1 on the PyTorch path); a count past the key
            tiles is capped at one split a tile (the same answer).
        Other keywords as :func:`flashlse.attention`.

    Returns:
        ``out (B, Sq, Hq, Dv)``, and ``lse (B, Hq, Sq)`` float32 if ``return_lse``.
    """
    kept = _kept_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sink,
                     num_splits, causal, window, softcap, scale, return_lse, cache_leftpad)
    if kept is not None:
        got = _run_kept(kept, q, k_cache, v_cache, cache_seqlens, block_table, sink, k_new,
                        v_new, return_lse, cache_leftpad)
        if got is None and cache_leftpad is None:
            got = _run_kept_chunk(kept, q, k_cache, v_cache, cache_seqlens, block_table, sink,
                                  k_new, v_new)
        if got is not None:
            return (got[0], got[1].contiguous()) if return_lse else got[0]
    lens, s_new = _validate(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                            num_splits, cache_leftpad)
    V.check_bool("causal", causal)
    V.check_bool("return_lse", return_lse)
    left, right = masks.normalize_window(causal, V.check_window(window))
    softcap = V.check_softcap(softcap)
    scale = V.check_scale(scale, q.shape[-1])
    sink = V.check_sink(sink, q.shape[2], q.device)
    if V.needs_grad(q, k_cache, v_cache, sink):
        raise ValueError("attention_with_kvcache is not differentiable (serving); call it under "
                         "torch.no_grad(), or use flashlse.attention for gradients")
    if torch.compiler.is_compiling():
        # One opaque node each (the caches' lengths are data torch.compile cannot read).
        if s_new:
            _append_op(k_cache, v_cache, k_new, v_new, lens, block_table)
        out, lse = _kvcache_op(q, k_cache, v_cache, lens, s_new, block_table, num_splits, left,
                               right, softcap, scale, sink, cache_leftpad)
    else:
        out, lse = _kvcache_fwd(q, k_cache, v_cache, lens, s_new, block_table, k_new, v_new,
                                num_splits, dict(left=left, right=right, softcap=softcap,
                                                 scale=scale, sink=sink), kept, cache_leftpad)
    return (out, lse.contiguous()) if return_lse else out


# Serving repeats its calls: a decode whose metadata key (tensors' metadata, the scalars as
# passed, the options that shape the plan, v at k's address, alignment) passed every check
# before launches the kept decode plan at once (``_run_kept``), after the kept append's
# launch when it appends ``k_new``: the checks, the window and scalar normalisation and
# decode's and the append's own plan keys are functions of that key. Value checks, the
# no-grad check and torch.compile still take the full path.
_KEPT: dict = {}
_MAX_KEPT = 1024


def _kept_key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sink, num_splits,
              causal, window, softcap, scale, return_lse, cache_leftpad=None):
    """The call's key in ``_KEPT`` and ``_CHUNK_KEPT``, or None for a call that cannot take
    the kept path: torch.compile, a scalar not of its canonical type (``True`` and ``1`` hash
    alike; only the full path's checks tell them apart)."""
    if num_splits.__class__ is not int or not V.KEEP_PLANS or \
            not V.canonical_scalars(causal, window, softcap, scale, return_lse):
        return None
    key = V.meta_key("kvcache-kept", q, k_cache, v_cache, cache_seqlens, block_table, sink,
                     k_new, v_new, cache_leftpad)
    if key is None:
        return None
    opts = kernel_module("options").current()
    return (key, num_splits, causal, window, softcap, scale, opts.pdl, opts.sm90_mla_decode,
            v_cache.data_ptr() == k_cache.data_ptr(),
            (q.data_ptr() | k_cache.data_ptr()) % 16 == 0)


def _run_kept(kept, q, k_cache, v_cache, cache_seqlens, block_table, sink, k_new=None,
              v_new=None, want_lse=True, cache_leftpad=None):
    """``(out, lse)`` from the plans kept for ``kept`` (the append's first, with ``k_new``),
    or None: no plan kept, value checks asked for, a tensor needing grad, or the Hopper MLA
    kernel failed (the plan dropped; the full path then appends the same rows again).
    ``want_lse=False``: lse is kept scratch (``decode.unread_lse``), not to be returned."""
    hit = _KEPT.get(kept)
    if hit is None or (cache_seqlens is not None and V.values_checkable(cache_seqlens)) or \
            (cache_leftpad is not None and V.values_checkable(cache_leftpad)) or \
            V.needs_grad(q, k_cache, v_cache, sink):
        return None
    decode = kernel_module("decode")
    if k_new is not None:
        decode.run_append(hit[2], k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
    got = decode.run_plan(hit[1], hit[0], q, k_cache, v_cache, cache_seqlens, block_table, sink,
                          None, kernel_module("options").allocator(), want_lse=want_lse,
                          cache_leftpad=cache_leftpad)
    if got is None:
        _KEPT.pop(kept, None)
    return got


def _kvcache_fwd(q, k_cache, v_cache, lens, s_new, block_table, k_new, v_new, num_splits, kw,
                 kept=None, leftpad=None):
    """Appends ``k_new``/``v_new`` (when given) and attends, on the path the call belongs to
    (``leftpad``: the call's ``cache_leftpad``)."""
    rows = decode_rows(block_table is not None)
    if use_triton(q) and (q.shape[1] <= rows or max(
            q.shape[-1], v_cache.shape[-1]) <= V.MAX_HEAD_DIM_PREFILL):
        decode = kernel_module("decode")
        append = None
        if k_new is not None:
            append = decode.find_append_plan(k_cache, v_cache, k_new, v_new, block_table)
            decode.run_append(append, k_cache, v_cache, k_new, v_new, lens, block_table)
        if q.shape[1] <= rows:
            dkw = dict(cache_seqlens=lens, seqlen_add=s_new, block_table=block_table,
                       num_splits=num_splits, cache_leftpad=leftpad, **kw)
            if kept is not None:
                # A call that passed every check: later calls with its key launch these plans.
                dkey, plan, _ = decode.find_plan(q, k_cache, v_cache, **dkw)
                if len(_KEPT) >= _MAX_KEPT:
                    _KEPT.clear()
                _KEPT[kept] = (dkey, plan, append)
            out, lse = decode.decode_fwd(q, k_cache, v_cache, **dkw)
        else:
            # (A left-padded chunk shifts its rows on the device each call: no kept launch.)
            out, lse = _prefill_fwd(q, k_cache, v_cache, lens, s_new, block_table, kw,
                                    kept if leftpad is None else None, append, leftpad)
    else:
        out, lse = _torch_fwd(q, k_cache, v_cache, lens, s_new, block_table, k_new, v_new,
                              num_splits, kw, leftpad)
    return out, lse


@torch.library.custom_op("flashlse::kvcache_append", mutates_args=("k_cache", "v_cache"))
def _append_op(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, cache_seqlens: torch.Tensor,
               block_table: torch.Tensor | None) -> None:
    if use_triton(k_new):
        from ..kernels.decode import append_kv

        append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                  block_table=block_table)
    else:
        _append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)


@torch.library.custom_op("flashlse::kvcache_fwd", mutates_args=())
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor | None, s_new: int,
                block_table: torch.Tensor | None, num_splits: int, left: int | None,
                right: int | None, softcap: float, scale: float,
                sink: torch.Tensor | None,
                cache_leftpad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # The append already ran (_append_op): the keys are the first lens + s_new of each row.
    out, lse = _kvcache_fwd(q, k_cache, v_cache, cache_seqlens, s_new, block_table, None, None,
                            num_splits, dict(left=left, right=right, softcap=softcap,
                                             scale=scale, sink=sink), None, cache_leftpad)
    return out, lse.contiguous()


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, s_new, block_table, num_splits, left, right, softcap,
      scale, sink, cache_leftpad=None):
    b, sq, hq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(b, sq, hq, v_cache.shape[-1]), q.new_empty(b, hq, sq, dtype=lse_dtype)
