"""Split-KV decode kernel: ``attention_with_kvcache`` against contiguous or paged caches.

Math (docs/design.md §1). For query row i of sequence b, with ``sk = cache_seqlens[b]`` keys
and scores ``s_j = scale * q_i . k_j`` (or the soft-capped ``c * tanh(s_j / c)``),

    lse_i = log(sum_j e^{s_j} [+ e^{sink}])          out_i = sum_j e^{s_j - lse_i} v_j

over the visible keys: bottom-right aligned against the sequence's own cache length,
row i (of Sq) sees key j iff ``i + sk - Sq - left <= j <= i + sk - Sq + right``, j < sk.

Split-KV. Decode has few query rows and long key ranges, so a grid of one program per
(sequence, KV head) leaves most of the GPU idle. The visible key range ``[n_lo, sk)``
(``n_lo`` from the left window, rounded down to a tile) is cut into ``num_splits``
ranges of whole tiles; each program computes the partial state of its range,

    L_s = log sum_{j in range s} e^{s_j}        O_s = sum_{j in range s} e^{s_j - L_s} v_j

in base 2 internally (``2^t`` with ``t = s * log2 e`` is one ``ex2``; ``L = ln 2 * L_log2``),
and the merge kernel of ``combine.py`` (launched by ``merge_launch``) merges the partial states,
``L = log sum_s e^{L_s}``, ``O = sum_s e^{L_s - L} O_s``, which is exact because the
ranges partition the keys. With ``FUSED_MERGE`` (calls of at most ``FUSED_MERGE_MAX_SPLITS``
splits) the split program of each row tile that finishes last merges them instead, with the
merge kernel's steps (``_merge_if_last``): one launch less a call. The partial states are
scratch kept per stream (``_scratch``). A split with no visible key writes ``L_s = -inf``
(and ``O_s = 0``), the merge's identity; it may be a split past the last tile (more splits
than tiles) or a range the window masks. The sink is a key of value 0 that belongs to no
range: it is added once, in the merge (or, with one split, in this kernel's epilogue, which
is the same formula with one state), never per split.

Online softmax inside a range keeps per row the running maximum ``m`` (base 2), the sum
``l = sum_j 2^{t_j - m}`` and ``acc = sum_j 2^{t_j - m} v_j``. A row that has seen only
masked keys has ``m = -inf``; the exponentials then use the pivot 0
(``tl.where(m == -inf, 0, m)``), so ``2^{-inf - 0} = 0`` and never NaN. At the end
``l == 0`` exactly when the row saw no key: the epilogue (``_common.final_stats``, shared
with the forward kernels) scales out by 0 and writes ``lse = -inf`` (or the sink) for it.

Schedule. One program per (sequence, KV head, row tile, split). The rows of a program
are all ``Sq * (Hq / Hkv)`` query rows that share the KV head, row ``r = i * GROUP + g``
for query position i and head ``g`` of the group, so every K/V tile is loaded once and
multiplies the whole group (an ``[BLOCK_M, BLOCK_N]`` product, not ``GROUP`` vector
products). Groups larger than ``BLOCK_M`` rows (MLA: 16-128 heads on one latent head)
take several row tiles; they are the fastest-varying program id, so the row tiles of one
(sequence, split) run side by side and the second read of each K tile hits L2.

Paged caches. ``block_table[b, j // page_size]`` is the page of key j, and key j sits at
row ``j % page_size`` of that page. The kernel computes one address per key row (a K
row is ``D`` contiguous elements, loaded as 16-byte vectors either way), so any page
size works, pages smaller than a tile included, and the tile arithmetic is the same as
for a contiguous cache: paged and contiguous results are equal bit for bit. A tile's pages
(and sparse attention's top-k rows, which are read the same way) are looked up one tile
ahead and carried through the loop, so its K/V addresses depend on no load of its own
iteration and the software pipeliner keeps as many K/V tiles in flight as for a contiguous
cache (looked up in the same iteration, the page ids serialised every tile's copies).

MLA (one latent head, ``v = k[..., :Dv]``). When ``v_cache`` is a view of ``k_cache``
(same storage and strides, ``Dv <= D``), K is loaded as two column blocks ``[0, Dv)``
and ``[Dv, D)``; the scores add both products and the first block is V itself, so the
latent cache is read once per split, not twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from . import configs, options
from ._common import (
    Launch,
    SizedLaunch,
    alloc_scratch,
    capability,
    cdiv,
    check_grid_dims,
    contiguous_strides,
    decode_split,
    final_stats,
    interpreting,
    mask_args,
    next_pow2,
    positional,
    seq_span,
    stride_args,
    token_rows,
)
from .combine import (
    _merge_finish,
    _merge_max_step,
    _merge_sum_step,
    _num_sms,
    merge_plan,
    merge_run,
)
from .failures import FAILURES

try:  # Gluon's Hopper API as of triton 3.6; without it MLA decodes run the kernel below.
    from . import decode_mla_sm90
except ImportError:  # pragma: no cover - older or newer triton
    decode_mla_sm90 = None


def _pdl_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and capability(t)[0] >= 9


@triton.jit
def _decode_tile_pages(
    block_table, token_pages, n0, n_end, i_b, num_pages, table_sk, table_per_batch, table_hkv,
    table_num_pages, stride_tb, stride_pb,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, TOKEN_TABLE: tl.constexpr,
    TOKEN_PAGE: tl.constexpr,
):
    """Where the keys ``[n0, n0 + BLOCK_N)`` of a paged sequence lie: ``(b_page, m_n)``, the
    page of each key (int64 ``[BLOCK_N]``) and which keys exist (below ``n_end``, on a page
    inside the cache). Only table entries of existing keys are read, so the kernel can look
    one tile ahead: these loads then leave the K/V addresses of a tile depending on no load
    of its own iteration, and the software pipeliner keeps K/V copies in flight as for a
    contiguous cache (NOTES.md, session 10)."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < n_end
    if TOKEN_TABLE:
        # The table lists token positions j (sparse attention's top-k; pages are single
        # (token, kv head) rows): sequence i_b is kv head h = i_b % table_hkv of batch
        # i_b // table_per_batch, and key j its row r in the cache (token_rows), page
        # r * Hkv + h.
        b_row, m_n = token_rows(block_table, token_pages, o_n, m_n, i_b, stride_tb, stride_pb,
                                table_sk, table_per_batch, table_num_pages, TOKEN_PAGE)
        b_page = b_row * table_hkv + i_b % table_hkv
    else:
        # One page lookup per key row: any page size, pages smaller than a tile included.
        b_page = tl.load(block_table + i_b.to(tl.int64) * stride_tb + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
        # A page index outside the cache (value checks are opt-in) is no key, never read.
        m_n = m_n & (b_page >= 0) & (b_page < num_pages)
    return b_page, m_n


@triton.jit
def _decode_fwd_tile(
    b_acc, b_m, b_l, b_q1, b_q2,
    k, v, b_page, m_n,
    n0, n_end, n_floor, i_b, i_hkv, o_diag,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    left, right, scale_log2, softcap_a2, softcap_c2,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, TOKEN_TABLE: tl.constexpr,
    SHARED_KV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
):
    """One key tile ``[n0, n0 + BLOCK_N)`` of the online softmax; keys ``>= n_end`` are masked,
    and with ``HAS_LEFTPAD`` keys ``< n_floor`` (the sequence's ``cache_leftpad``).
    Paged (and token tables): ``b_page`` and ``m_n`` are the tile's ``_decode_tile_pages``."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    if TOKEN_TABLE:
        o_k = b_page * stride_kb + i_hkv.to(tl.int64) * stride_kh
        o_v = b_page * stride_vb + i_hkv.to(tl.int64) * stride_vh
    elif PAGED:
        o_row = (o_n % PAGE_SIZE).to(tl.int64)
        o_k = b_page * stride_kb + o_row * stride_kn + i_hkv.to(tl.int64) * stride_kh
        o_v = b_page * stride_vb + o_row * stride_vn + i_hkv.to(tl.int64) * stride_vh
    else:
        m_n = o_n < n_end
        o_k = i_b.to(tl.int64) * stride_kb + o_n.to(tl.int64) * stride_kn + i_hkv.to(tl.int64) * stride_kh
        o_v = i_b.to(tl.int64) * stride_vb + o_n.to(tl.int64) * stride_vn + i_hkv.to(tl.int64) * stride_vh
    if HAS_LEFTPAD:
        m_n = m_n & (o_n >= n_floor)

    o_d1 = tl.arange(0, BLOCK_D1)
    # [BLOCK_N, BLOCK_D1]
    b_k1 = tl.load(k + o_k[:, None] + o_d1[None, :], mask=m_n[:, None] & (o_d1 < D1)[None, :], other=0.0)
    # [BLOCK_M, BLOCK_N]
    b_s = tl.dot(b_q1, tl.trans(b_k1))
    if D2 > 0:
        o_d2 = tl.arange(0, BLOCK_D2)
        # [BLOCK_N, BLOCK_D2]
        b_k2 = tl.load(k + o_k[:, None] + D1 + o_d2[None, :], mask=m_n[:, None] & (o_d2 < D2)[None, :], other=0.0)
        b_s += tl.dot(b_q2, tl.trans(b_k2))
    if SHARED_KV:
        # v is k[..., :DV]: the block already in registers is V (DV == D1, BLOCK_DV == BLOCK_D1).
        b_v = b_k1
    else:
        o_dv = tl.arange(0, BLOCK_DV)
        # [BLOCK_N, BLOCK_DV]
        b_v = tl.load(v + o_v[:, None] + o_dv[None, :], mask=m_n[:, None] & (o_dv < DV)[None, :], other=0.0)

    if HAS_SOFTCAP:
        # c * tanh(x) = c * (1 - 2 / (e^{2x} + 1)), in base 2: e^{2x} = 2^{s * softcap_a2},
        # and the result times log2 e is softcap_c2 * (...). e^{2x} = inf gives exactly c.
        b_t = softcap_c2 * (1.0 - 2.0 / (tl.exp2(b_s * softcap_a2) + 1.0))
    else:
        b_t = b_s * scale_log2
    m_vis = m_n[None, :]
    if HAS_LEFT:
        m_vis = m_vis & (o_n[None, :] >= (o_diag - left)[:, None])
    if HAS_RIGHT:
        m_vis = m_vis & (o_n[None, :] <= (o_diag + right)[:, None])
    b_t = tl.where(m_vis, b_t, float("-inf"))

    b_m_new = tl.maximum(b_m, tl.max(b_t, axis=1))
    # A row with no visible key so far keeps m = -inf; pivot 0 keeps 2^(t - pivot) = 0.
    b_pivot = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_t - b_pivot[:, None])
    b_alpha = tl.exp2(b_m - b_pivot)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_acc, b_m_new, b_l


@triton.jit(do_not_specialize=["stride_zh", "total_q"])
def _decode_fwd_kernel(
    q,
    k,
    v,
    cache_seqlens,
    block_table,
    sink,
    o,
    lse,
    token_pages,
    out_f,
    lse_f,
    counter,
    cache_leftpad,
    cu_seqlens_q,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_tb,
    stride_pb,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lq, stride_lh,
    stride_yb, stride_yq, stride_yh,
    stride_zb, stride_zq, stride_zh,
    HKV,
    num_splits,
    capacity,
    total_q,
    num_pages,
    table_sk,
    table_per_batch,
    table_hkv,
    table_num_pages,
    seqlen_add,
    left,
    right,
    scale_log2,
    softcap_a2,
    softcap_c2,
    SQ: tl.constexpr,
    GROUP: tl.constexpr,
    M_TILES: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    TOKEN_TABLE: tl.constexpr,
    TOKEN_PAGE: tl.constexpr,
    SHARED_KV: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    PACKED_Q: tl.constexpr,
    PDL: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_SINK: tl.constexpr,
    MERGE_BLOCK_S: tl.constexpr,
):
    if PDL:
        # Let the merge kernel launch now (it waits for this grid to finish before reading):
        # its launch then overlaps this kernel instead of following it.
        gdc_launch_dependents()
    i_bhm, i_s = tl.program_id(0), tl.program_id(1)
    # Row tiles vary fastest: the tiles of one (sequence, KV head, split) run together.
    i_m = i_bhm % M_TILES
    i_bh = i_bhm // M_TILES
    i_b, i_hkv = i_bh // HKV, i_bh % HKV

    sk, n_start, n_end = decode_split(cache_seqlens, i_b, i_s, seqlen_add, capacity, num_splits,
                                      left, SQ, BLOCK_N, 1, HAS_SEQLENS, HAS_LEFT)
    # Packed queries (PACKED_Q: a paged varlen call's short sequences): sequence i_b's rows
    # start at row q_start of q, out and the final lse, and number sq (clamped inside the
    # total_q rows: seq_span); a sequence of no row or of more than SQ is another launch's and
    # reads no key here. (Row 0's window start from SQ is at or below this sequence's:
    # decode_split's range covers its rows.)
    q_start = 0
    sq = SQ
    if PACKED_Q:
        q_start, sq = seq_span(cu_seqlens_q, i_b, total_q, SQ + 1)
        n_end = tl.where((sq > 0) & (sq <= SQ), n_end, n_start)
    # A left-padded sequence (cache_leftpad): keys below its start are no keys; the tiles
    # wholly below it are not read (a split of those only writes an empty state).
    n_floor = 0
    if HAS_LEFTPAD:
        n_floor = tl.load(cache_leftpad + i_b)
        n_start = tl.maximum(n_start, (tl.maximum(n_floor, 0) // BLOCK_N) * BLOCK_N)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Row r is query position r // GROUP of head i_hkv * GROUP + r % GROUP.
    o_i = o_m // GROUP
    o_h = i_hkv * GROUP + o_m % GROUP
    m_m = o_m < SQ * GROUP
    if PACKED_Q:
        m_m = m_m & (o_i < sq) & (sq <= SQ)
    # Key position of each row's diagonal (bottom-right aligned).
    o_diag = o_i + sk - sq
    # The row of q and of the final out / lse (the partial states' rows are o_i).
    o_iq = q_start + o_i

    o_q = i_b.to(tl.int64) * stride_qb + o_iq.to(tl.int64) * stride_qs + o_h.to(tl.int64) * stride_qh
    o_d1 = tl.arange(0, BLOCK_D1)
    # [BLOCK_M, BLOCK_D1]
    b_q1 = tl.load(q + o_q[:, None] + o_d1[None, :], mask=m_m[:, None] & (o_d1 < D1)[None, :], other=0.0)
    if D2 > 0:
        o_d2 = tl.arange(0, BLOCK_D2)
        # [BLOCK_M, BLOCK_D2]
        b_q2 = tl.load(q + o_q[:, None] + D1 + o_d2[None, :], mask=m_m[:, None] & (o_d2 < D2)[None, :], other=0.0)
    else:
        b_q2 = b_q1

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    # [BLOCK_M, BLOCK_DV]
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Paged: a tile's pages are looked up one iteration ahead and carried (_decode_tile_pages).
    b_page = 0
    m_n = 0
    if PAGED:
        b_page, m_n = _decode_tile_pages(
            block_table, token_pages, n_start, n_end, i_b, num_pages, table_sk, table_per_batch,
            table_hkv, table_num_pages, stride_tb, stride_pb,
            BLOCK_N, PAGE_SIZE, TOKEN_TABLE, TOKEN_PAGE)
    for n0 in range(n_start, n_end, BLOCK_N):
        b_page_next = b_page
        m_n_next = m_n
        if PAGED:
            b_page_next, m_n_next = _decode_tile_pages(
                block_table, token_pages, n0 + BLOCK_N, n_end, i_b, num_pages, table_sk,
                table_per_batch, table_hkv, table_num_pages, stride_tb, stride_pb,
                BLOCK_N, PAGE_SIZE, TOKEN_TABLE, TOKEN_PAGE)
        b_acc, b_m, b_l = _decode_fwd_tile(
            b_acc, b_m, b_l, b_q1, b_q2, k, v, b_page, m_n, n0, n_end, n_floor, i_b, i_hkv,
            o_diag, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
            left, right, scale_log2, softcap_a2, softcap_c2,
            D1, D2, DV, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV,
            PAGE_SIZE, PAGED, TOKEN_TABLE, SHARED_KV, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            HAS_LEFTPAD,
        )
        b_page = b_page_next
        m_n = m_n_next

    # The epilogue (_common.final_stats): out = 0 and lse = -inf for a row with no visible key,
    # the sink (only with one split, else the merge adds it) counted once, a NaN propagates.
    b_sink_nat = 0.0
    if HAS_SINK:
        b_sink_nat = tl.load(sink + o_h, mask=m_m, other=0.0)
    b_scale, b_lse = final_stats(b_m, b_l, b_sink_nat, HAS_SINK)

    o_dv = tl.arange(0, BLOCK_DV)
    o_o = i_s.to(tl.int64) * stride_os + i_b.to(tl.int64) * stride_ob + o_i.to(tl.int64) * stride_oq + o_h.to(tl.int64) * stride_oh
    p_o = o + o_o[:, None] + o_dv[None, :]
    tl.store(p_o, (b_acc * b_scale[:, None]).to(p_o.dtype.element_ty), mask=m_m[:, None] & (o_dv < DV)[None, :])
    o_l = i_s.to(tl.int64) * stride_ls + i_b.to(tl.int64) * stride_lb + o_i.to(tl.int64) * stride_lq + o_h.to(tl.int64) * stride_lh
    tl.store(lse + o_l, b_lse, mask=m_m)
    if FUSED_MERGE:
        _merge_if_last(o, lse, sink, out_f, lse_f, counter, i_bhm, i_b, o_i, o_iq, o_h, m_m,
                       num_splits, stride_os, stride_ob, stride_oq, stride_oh,
                       stride_ls, stride_lb, stride_lq, stride_lh,
                       stride_yb, stride_yq, stride_yh, stride_zb, stride_zq, stride_zh,
                       DV, BLOCK_M, BLOCK_DV, MERGE_SINK, MERGE_BLOCK_S)


@triton.jit
def _merge_if_last(o, lse, sink, out_f, lse_f, counter, i_bhm, i_b, o_i, o_iq, o_h, m_m,
                   num_splits,
                   stride_os, stride_ob, stride_oq, stride_oh,
                   stride_ls, stride_lb, stride_lq, stride_lh,
                   stride_yb, stride_yq, stride_yh, stride_zb, stride_zq, stride_zh,
                   DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr):
    """The split-KV merge done by the last split of a row tile to finish (``FUSED_MERGE``),
    in place of the merge kernel: one launch less a decode call. ``o_i``: the rows of the
    partial states, ``o_iq``: those of ``out_f`` and ``lse_f`` (packed queries' rows).

    Each split program counts itself done in ``counter[i_bhm]`` after its partial state is
    written; the program that counts last has every split's state and merges them with the
    merge kernel's own steps (``combine._merge_max_step`` / ``_merge_sum_step``, the same
    order of operations), then puts the counter back to 0 for the next launch on the
    stream. Ordering (CUTLASS's semaphore pattern): the CTA barrier puts every thread's
    partial stores before the one thread's ``acq_rel`` atomic at GPU scope, whose release
    the last program's acquire (and the barrier Triton broadcasts the result through) makes
    visible to all of its threads."""
    # Every thread's stores of this program's partial state, before the count.
    tl.debug_barrier()
    n_before = tl.atomic_add(counter + i_bhm, 1, sem="acq_rel", scope="gpu")
    if n_before == num_splits - 1:
        tl.store(counter + i_bhm, 0)
        o_l = i_b.to(tl.int64) * stride_lb + o_i.to(tl.int64) * stride_lq + o_h.to(tl.int64) * stride_lh
        o_o = i_b.to(tl.int64) * stride_ob + o_i.to(tl.int64) * stride_oq + o_h.to(tl.int64) * stride_oh
        o_d = tl.arange(0, BLOCK_DV)
        m_d = o_d < DV
        b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for i_s in tl.range(0, num_splits, BLOCK_S):
            b_m = _merge_max_step(b_m, lse, lse, i_s, num_splits, o_l, m_m, stride_ls, BLOCK_S,
                                  False)
        if HAS_SINK:
            b_sink = tl.load(sink + o_h, mask=m_m, other=float("-inf"))
            b_m = tl.maximum(b_m, b_sink)
        b_pivot = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        # [BLOCK_M, BLOCK_DV]
        b_acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for i_s in tl.range(0, num_splits, BLOCK_S):
            b_acc, b_sum = _merge_sum_step(b_acc, b_sum, o, lse, o, lse, i_s, num_splits, o_l,
                                           o_o, o_d, m_m, m_d, b_pivot, stride_ls, stride_os, 1,
                                           BLOCK_S, False)
        if not HAS_SINK:
            b_sink = b_pivot
        b_acc, b_sum = _merge_finish(b_acc, b_sum, b_sink, b_pivot, HAS_SINK)
        o_y = i_b.to(tl.int64) * stride_yb + o_iq.to(tl.int64) * stride_yq + o_h.to(tl.int64) * stride_yh
        p_y = out_f + o_y[:, None] + o_d[None, :]
        tl.store(p_y, b_acc.to(p_y.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
        o_z = i_b.to(tl.int64) * stride_zb + o_iq.to(tl.int64) * stride_zq + o_h.to(tl.int64) * stride_zh
        tl.store(lse_f + o_z, tl.log(b_sum) + b_m, mask=m_m)


@functools.lru_cache(maxsize=1024)
def _num_splits(programs: int, n_tiles: int, slots: int, min_tiles: int = 1) -> int:
    """Split count that fills ``slots`` concurrent programs with little wave quantization.

    Efficiency of S splits is ``P S / (ceil(P S / slots) slots)``; take the smallest S
    within 95% of the best, with at least ``min_tiles`` key tiles a split (1: at most one
    split a tile). (flash-attn takes 85%; on the H200 at B=1, Skv=128k, 24 / 33 / 48 / 57
    splits of 8 programs ran at 3358 / 3714 / 3140 / 3397 GB/s: a wave that is 73% full
    costs more than the few extra splits.)
    Cached: this host loop must cost less than the decode step it sizes.
    """
    if programs >= 0.8 * slots or n_tiles <= 1:
        return 1
    max_splits = max(1, min(n_tiles // max(min_tiles, 1), 128))
    effs = []
    for s in range(1, max_splits + 1):
        waves = cdiv(programs * s, slots)
        effs.append(programs * s / (waves * slots))
    best = max(effs)
    for s, eff in enumerate(effs, start=1):
        if eff >= 0.95 * best:
            return s
    return 1


# The query rows a sequence that decode_fwd takes (speculative decoding's few); the ops
# layer's bound for attention_with_kvcache is the same (ops.kvcache.DECODE_MAX_SQ; with
# ops.kvcache.DECODE_WIDE, its DECODE_WIDE_MAX as the dispatcher's route).
MAX_SQ = 16


def decode_fwd(q, k_cache, v_cache, *, cache_seqlens, block_table, left, right, softcap, scale,
               sink, num_splits, seqlen_add=0, config=None, out_dtype=None, token_table=None,
               token_pages=None, cache_leftpad=None, lse_heads_first=False):
    """``out = softmax(scale * q k^T [masked]) v`` over each sequence's cache, split over keys.

    Inputs are assumed valid (ops/ validates, and appends k_new/v_new before this runs).
    The last dim of q and of the caches must have stride 1.

    Args:
        q: ``(B, Sq, Hq, D)``, ``Sq`` in 1..``MAX_SQ`` (the callers' bound; the kernel
            packs the ``Sq * G`` rows of a kv head into row tiles; the dispatcher's
            short-query route sends it up to ``SHORT_Q_WIDE_MAX`` and the kernel takes 64).
        k_cache: ``(B, Smax, Hkv, D)``, or paged ``(num_pages, page_size, Hkv, D)``.
        v_cache: ``(B, Smax, Hkv, Dv)`` or ``(num_pages, page_size, Hkv, Dv)``; may be the
            view ``k_cache[..., :Dv]`` (MLA), which is then read once.
        cache_seqlens: ``(B,)`` int32 valid keys per sequence (0 allowed), or None for the
            whole cache (contiguous only); ``seqlen_add`` (an int) is added to each. Lengths
            are clamped to ``[0, capacity]`` in the kernel.
        block_table: ``(B, max_pages)`` int32 page indices, or None for contiguous caches;
            a page outside ``[0, num_pages)`` holds no key (it is never read).
        left, right: window bounds (int >= 0) or None; causal is ``right=0``.
        softcap: ``c > 0`` applies ``c * tanh(s / c)``; 0 is off.
        scale: multiplies ``q . k``.
        sink: ``(Hq,)`` float32 logits or None; counted once, after the splits merge.
        num_splits: 0 picks from batch, heads, cache size and SM count; ``> 0`` forces it.
        config: optional dict overriding ``configs.decode_config``'s tiles (benchmarks sweep
            tiles with it), or a ``TileConfig`` replacing them.
        out_dtype: ``out``'s dtype (default q's); float32 for a caller that merges further.
        token_table: ``(Sk, per_batch, Hkv)`` when the caches are single-row pages of a
            ``(B, Sk, Hkv, *)`` cache (page ``(b * Sk + j) * Hkv + h``) and ``block_table``
            lists token positions ``j`` instead of pages: sequence ``i`` is kv head
            ``i % Hkv`` of batch ``i // per_batch``; a position outside ``[0, Sk)`` is no
            key (sparse attention's top-k lists, read without building a page table).
        token_pages: with ``token_table``, the block table ``(B, max_pages)`` of a paged
            cache ``(num_pages, page_size, Hkv, *)`` whose rows are the single-row pages:
            position j of batch b is row ``token_pages[b, j // page_size] * page_size
            + j % page_size``, ``Sk = max_pages * page_size``; a page outside the cache is
            no key.
        cache_leftpad: ``(B,)`` int32 or None: a contiguous cache's sequence ``b`` starts at
            key ``cache_leftpad[b]`` (the keys before it are no keys; any value is safe).
        lse_heads_first: lse as ``(Hq, B * Sq)`` (the packed varlen layout: the paged
            ``attention_varlen`` of uniform short sequences runs here, ``dispatch``).

    Returns:
        ``out (B, Sq, Hq, Dv)`` in ``out_dtype`` and ``lse (B, Hq, Sq)`` float32 natural log
        (``(Hq, B * Sq)`` with ``lse_heads_first``); empty rows give ``out = 0``,
        ``lse = -inf`` (or the sink).
    """
    # Host time matters here: at B = 1 the kernel reads 0.5 GB in ~130 us, about what two
    # launches plus Python took before (on the host alone). Everything but the tensors'
    # addresses is a function of the call's metadata, so a repeated call finds its launch
    # plan (tiles, split count, grids, the scalar and constexpr arguments of both kernels)
    # in _PLANS and only allocates and launches.
    if q.stride(-1) != 1:
        q = q.contiguous()
    key, plan, empty = find_plan(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                 block_table=block_table, left=left, right=right,
                                 softcap=softcap, scale=scale, sink=sink,
                                 num_splits=num_splits, seqlen_add=seqlen_add, config=config,
                                 out_dtype=out_dtype, token_table=token_table,
                                 token_pages=token_pages, cache_leftpad=cache_leftpad,
                                 lse_heads_first=lse_heads_first)
    got = run_plan(plan, key, q, k_cache, v_cache, cache_seqlens, block_table, sink,
                   token_pages, empty, cache_leftpad=cache_leftpad)
    if got is None:
        # The Hopper MLA kernel failed to compile (recorded): this signature is planned on
        # the portable kernel from now on.
        return decode_fwd(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                          block_table=block_table, left=left, right=right, softcap=softcap,
                          scale=scale, sink=sink, num_splits=num_splits,
                          seqlen_add=seqlen_add, config=config, out_dtype=out_dtype,
                          token_table=token_table, token_pages=token_pages,
                          cache_leftpad=cache_leftpad, lse_heads_first=lse_heads_first)
    return got


def find_plan(q, k_cache, v_cache, *, cache_seqlens, block_table, left, right, softcap, scale,
              sink, num_splits, seqlen_add=0, config=None, out_dtype=None, token_table=None,
              token_pages=None, cache_leftpad=None, lse_heads_first=False):
    """:func:`decode_fwd`'s launch plan for these arguments (q's last dim of stride 1):
    ``(key, plan, empty)``, the plan from ``_PLANS`` by ``key`` (the call's metadata) or made
    and kept there (``key`` None with a tile override ``config``), ``empty`` the options'
    allocator."""
    opts = options.current()
    empty = options.allocator(opts)
    key = plan = None
    if not config:
        # What the plan reads: shapes, strides, dtypes and device of the tensors, whether v is
        # k's storage (MLA), which optional tensors are there, the scalars, the options.
        key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
               v_cache.shape, v_cache.stride(), v_cache.data_ptr() == k_cache.data_ptr(),
               None if block_table is None else (block_table.shape, block_table.stride()),
               cache_seqlens is None, sink is None, left, right, softcap, scale, num_splits,
               seqlen_add, out_dtype, opts.pdl, opts.sm90_mla_decode, token_table,
               None if token_pages is None else (token_pages.shape, token_pages.stride()),
               (q.data_ptr() | k_cache.data_ptr()) % 16 == 0, cache_leftpad is None,
               lse_heads_first)
        plan = _PLANS.get(key)
    if plan is None:
        plan = _decode_plan(q, k_cache, v_cache, block_table, cache_seqlens is not None, sink,
                            left, right, softcap, scale, num_splits, seqlen_add, config,
                            out_dtype, opts.pdl, token_table, token_pages,
                            mla=opts.sm90_mla_decode, leftpad=cache_leftpad is not None,
                            lse_heads_first=lse_heads_first)
        if not config:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return key, plan, empty


def packed_fwd(q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, out, lse, *,
               max_rows, left, right, softcap, scale, sink, plans=None) -> None:
    """Fills the rows of a paged varlen forward's sequences of at most ``max_rows`` query rows
    (a mixed serving step's decodes; ``fwd.attn_fwd_paged``'s arguments) on the split-KV
    kernel, into ``out (total_q, Hq, Dv)`` and ``lse (Hq, total_q)``; the other sequences'
    rows are not written. Each program reads its sequence's rows from ``cu_seqlens_q`` (a
    sequence of no row or of more than ``max_rows`` reads no key), its keys from
    ``seqused_k`` (clamped to the table's capacity); a page out of range holds no key. The
    fused merge writes the packed rows, so at most ``FUSED_MERGE_MAX_SPLITS`` splits, and a
    CUDA graph captures fresh zero counters. The plan is a function of the metadata, the
    batch and ``max_rows``, not of ``total_q``; ``plans``: the caller's cache for calls of
    one metadata but the lengths and the batch (``fwd.attn_fwd_paged``'s), where it is found
    by those two."""
    batch = cu_seqlens_q.shape[0] - 1
    opts = options.current()
    if plans is None:
        key, cache = ("packed", batch, max_rows, q.shape[1:], q.stride(), q.dtype, q.device,
                      k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
                      v_cache.data_ptr() == k_cache.data_ptr(), block_table.shape,
                      block_table.stride(), out.stride(), lse.stride(1), sink is None, left,
                      right, softcap, scale), _PLANS
    else:
        key, cache = ("decode packed", batch, max_rows), plans
    plan = cache.get(key)
    if plan is None:
        plan = _decode_plan(q, k_cache, v_cache, block_table, True, sink, left, right, softcap,
                            scale, 0, 0, None, out.dtype, opts.pdl,
                            packed=(batch, max_rows, out))
        if len(cache) >= _MAX_PLANS:
            cache.clear()
        cache[key] = plan
    if plan.grid is None:
        return
    empty = options.allocator(opts)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # (Kept scratch is not for a CUDA graph; the graph replays the counters' zeroing.)
        counters = torch.zeros(plan.programs, dtype=torch.int32, device=q.device)
        o_buf, lse_buf = _fresh_states(q.device, plan.o_buf_shape, empty)
    else:
        counters, o_buf, lse_buf = _scratch(q.device, plan.programs, plan.o_buf_shape, empty)
    plan.fused_run(plan.grid, (lse.stride(0), q.shape[0]), q, k_cache, v_cache, seqused_k,
                   block_table, lse_buf if sink is None else sink, o_buf, lse_buf, None, out,
                   lse, counters, None, cu_seqlens_q)


def run_plan(plan, key, q, k_cache, v_cache, cache_seqlens, block_table, sink, token_pages,
             empty, out_shape=None, lse_shape=None, want_lse=True, out=None, lse=None,
             cache_leftpad=None):
    """Allocates ``out`` and ``lse`` and launches a :func:`decode_fwd` plan (``key``: its key
    in ``_PLANS``) on these tensors, which need only the addresses, dtypes and alignment of
    the tensors the plan was made from (a caller may pass a tensor of which those were
    views). ``out_shape`` / ``lse_shape``: other shapes of the same contiguous outputs.
    ``want_lse=False``: the caller drops ``lse`` (``unread_lse`` then holds it). ``out``
    and ``lse``: the caller's own (contiguous, of the plan's shapes and dtypes) to fill
    instead. ``cache_leftpad``: the call's, when its plan was made with one. Returns
    ``(out, lse)``, or None when the Hopper MLA kernel failed to compile: then the failure is
    recorded (warned once) and the plan dropped, and the caller plans again."""
    dev = q.device
    if out is None:
        out = empty(out_shape or plan.out_shape, dtype=plan.out_dtype, device=dev)
    lse_shape = lse_shape or plan.lse_shape
    # (Kept scratch is not for a CUDA graph: it takes fresh tensors from the graph's pool.)
    capturing = (not want_lse or plan.merge is not None) and q.is_cuda and \
        torch.cuda.is_current_stream_capturing()
    if lse is None:
        lse = empty(lse_shape, dtype=torch.float32, device=dev) if want_lse else \
            unread_lse(dev, lse_shape, empty, capturing)
    if plan.grid is None:
        return out, lse
    if plan.merge is None:
        o_buf, lse_buf = out, lse
    elif capturing:
        # A CUDA graph gets partial states of its own (from its pool) and the merge kernel:
        # kept scratch would be shared with eager calls, and the counters' zeros would not
        # be the graph's to rely on.
        o_buf, lse_buf = _fresh_states(dev, plan.o_buf_shape, empty)
    else:
        # Partial states in float32, laid out so that (B, Sq, Hq) is the merge's row set, on
        # the stream's kept scratch: they live from the split kernel to the merge (kernel or
        # fused), and the stream runs the next call's split kernel only after that.
        counters, o_buf, lse_buf = _scratch(dev, plan.programs, plan.o_buf_shape, empty)
        if plan.fused_run is not None:
            # The split kernel merges its own splits.
            plan.fused_run(q, k_cache, v_cache, cache_seqlens, block_table,
                           lse_buf if sink is None else sink, o_buf, lse_buf, token_pages, out,
                           lse, counters, cache_leftpad, None)
            return out, lse
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, lse_buf if sink is None else sink,
               o_buf, lse_buf, token_pages)
    if plan.gluon is None:
        # (out, lse and counters are the fused merge's; unread here.)
        plan.run(*tensors, out, lse, lse, cache_leftpad, None)
    else:
        try:
            triton.set_allocator(alloc_scratch)  # the kernel's in-kernel TMA descriptors
            plan.run(*tensors)
        except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
            # Gluon is experimental in triton: if this triton cannot compile the MLA kernel,
            # say so once and plan this signature on the portable kernel from now on.
            FAILURES.add(plan.gluon, e, "the Hopper MLA decode kernel", stacklevel=3)
            _PLANS.pop(key, None)
            return None
    if plan.merge is not None:
        # Rows (b, i, h) of the partials, of out (B, Sq, Hq, Dv) and of lse (B, Hq, Sq): the
        # layout is known, so the merge launches without merge_states_fwd's layout analysis.
        merge_run(plan.merge, o_buf, lse_buf, sink, out, lse)
    return out, lse


# Launch plans of decode_fwd by call metadata; cleared when full (a server's shapes repeat).
_PLANS: dict = {}
_MAX_PLANS = 4096

# At least SPLIT_MIN_TILES key tiles a split (session 48's experiment, on since session 49). A
# short cache at B = 1 was cut into ~32 splits of 2 tiles (4k keys: 0.90x cuDNN on an H100, the
# split and merge launches' fixed cost over 8-16 MB of keys); 8 splits of 8 tiles take the
# fused merge (one launch). Measured on an H100 (NOTES.md, session 49; ab_decode_switch.py
# --flag decode.SPLIT_FLOOR): B = 1 4k 0.0209 -> 0.0186 ms through fl.attention (cuDNN 0.0191),
# 0.0236 -> 0.0190 through attention_with_kvcache; 32k / 128k and B = 8 level (0.99-1.00).
SPLIT_FLOOR = True
SPLIT_MIN_TILES = 8

# The split kernel's last program of each row tile merges the splits (``_merge_if_last``)
# instead of a merge kernel after it: one launch less a split call (read when a plan is made),
# where the call has at most FUSED_MERGE_MAX_SPLITS splits. H100 (NOTES.md, session 46):
# host -24 us a 4-split decode call, device time level (0.993-1.002) at 4 splits; at 32
# splits (B = 1) device +2.4-3.3% (+4.6-5.8 us, the same with 16 states a step and the
# maximum in one load), so those keep the merge kernel.
FUSED_MERGE = True
FUSED_MERGE_MAX_SPLITS = 8
# The same for sparse_attention's token table (its rows gathered a token at a time), on since
# session 49: device time level on an H100 (1.000-1.005 on / off, four top-k rows), host
# -1.3 to -13.9 us a call (NOTES.md, session 49).
FUSED_MERGE_TOKEN_TABLE = True
# States the fused merge loads per unrolled step (each step is one L2 latency; the merge
# kernel takes up to 32 on its small tiles, which hold fewer values a thread).
FUSED_MERGE_STATES = 8
# _decode_fwd_kernel's tensors: the nine the Hopper MLA kernel shares, then out, lse and the
# fused merge's counters, cache_leftpad and cu_seqlens_q (packed queries).
N_TENSORS = 14
# A split call's scratch by (device, stream, thread): the partial states, which live from the split
# kernel to the merge (the merge kernel's, or the fused merge's inside one launch), and the
# fused merge's counters (zeros, each put back to 0 by the program that merges). Launches of
# one stream run one after another and share them; two streams' launches may run at once and
# have their own. Keyed by thread too: two threads on one stream could interleave one call's
# split kernel and merge kernel with the other's. A split call then allocates only its
# outputs (two allocations less). Dropped when full (freeing is stream-ordered: safe).
_SCRATCH: dict = {}
# Partial states kept a stream, in float32 values: a call that needs more allocates its own.
SCRATCH_MAX_VALUES = 16 << 20
_MAX_SCRATCH = 64


class _Scratch:
    __slots__ = ("counters", "buf", "unread", "views")

    def __init__(self, device: torch.device):
        self.counters = torch.zeros(1024, dtype=torch.int32, device=device)
        self.buf = None
        self.unread = None  # (the lses no caller reads: unread_lse)
        self.views = {}


def _stream_scratch(device: torch.device) -> _Scratch:
    """The current stream's (and thread's) :class:`_Scratch` on ``device``."""
    # (A tensor's device has its index; a bare torch.device("cuda") means the current one.)
    stream = 0 if device.type != "cuda" else torch._C._cuda_getCurrentRawStream(
        torch.cuda.current_device() if device.index is None else device.index)
    key = (device, stream, threading.get_ident())
    sc = _SCRATCH.get(key)
    if sc is None:
        if len(_SCRATCH) >= _MAX_SCRATCH:
            _SCRATCH.clear()
        sc = _SCRATCH[key] = _Scratch(device)
    return sc


def unread_lse(device: torch.device, shape: tuple, empty, capturing: bool) -> torch.Tensor:
    """A float32 ``shape`` lse for a call whose caller drops it (``attention_with_kvcache``,
    ``attention`` and ``attention_varlen`` without ``return_lse`` and without autograd): the
    kernels write it and nothing reads it, so a view of the stream's kept buffer serves every
    such call, one allocation less a call. Fresh from ``empty`` where that is not
    ``torch.empty`` (``poison_outputs``), while a CUDA graph captures (``capturing``: a graph
    would keep the address of a buffer that may be freed and reused) and past
    ``SCRATCH_MAX_VALUES``."""
    if capturing or empty is not torch.empty or math.prod(shape) > SCRATCH_MAX_VALUES:
        return empty(shape, dtype=torch.float32, device=device)
    sc = _stream_scratch(device)
    view = sc.views.get(("unread", shape))
    if view is None:
        n = math.prod(shape)
        if sc.unread is None or sc.unread.numel() < n:
            sc.unread = torch.empty(max(n, 2 * (0 if sc.unread is None else sc.unread.numel())),
                                    dtype=torch.float32, device=device)
            sc.views.clear()
        if len(sc.views) >= 256:
            sc.views.clear()
        view = sc.views[("unread", shape)] = sc.unread[:n].view(shape)
    return view


def _fresh_states(device: torch.device, o_shape: tuple, empty) -> tuple:
    """``(o_buf, lse_buf)``: partial states of ``o_shape`` and ``o_shape[:-1]`` float32, fresh
    from ``empty`` (not the stream's kept scratch)."""
    return (empty(o_shape, dtype=torch.float32, device=device),
            empty(o_shape[:-1], dtype=torch.float32, device=device))


def _scratch(device: torch.device, programs: int, o_shape: tuple, empty):
    """``(counters, o_buf, lse_buf)`` for a split launch on the current stream of ``device``:
    at least ``programs`` zero counters, and the partial states ``o_buf (o_shape)`` and
    ``lse_buf (o_shape[:-1])`` float32, views of the stream's kept buffer (fresh from
    ``empty`` under ``poison_outputs``, whose NaN shows an unwritten partial, or past
    ``SCRATCH_MAX_VALUES``)."""
    sc = _stream_scratch(device)
    if sc.counters.numel() < programs:
        sc.counters = torch.zeros(2 * programs, dtype=torch.int32, device=device)
    views = sc.views.get(o_shape)
    if views is None or empty is not torch.empty:
        n_o = math.prod(o_shape)
        # lse_buf 16-byte aligned after o_buf (the launches' fast path asks it).
        n_o16 = -(-n_o // 4) * 4
        need = n_o16 + n_o // max(o_shape[-1], 1)
        if empty is not torch.empty or need > SCRATCH_MAX_VALUES:
            return (sc.counters, *_fresh_states(device, o_shape, empty))
        if len(sc.views) >= 256:  # (a server's batch sizes: one pair of views each)
            sc.views.clear()
        if sc.buf is None or sc.buf.numel() < need:
            sc.buf = torch.empty(max(need, 2 * (0 if sc.buf is None else sc.buf.numel())),
                                 dtype=torch.float32, device=device)
            sc.views.clear()
        views = sc.views[o_shape] = (sc.buf[:n_o].view(o_shape),
                                     sc.buf[n_o16:need].view(o_shape[:-1]))
    return (sc.counters, *views)


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    out_shape: tuple
    out_dtype: torch.dtype
    lse_shape: tuple
    # None: nothing to compute (empty outputs).
    grid: tuple | None = None
    o_buf_shape: tuple | None = None
    # The decode kernel's launch.
    run: Launch | None = None
    # The split-KV merge's plan (combine.merge_plan), None with one split.
    merge: object = None
    # The Hopper MLA kernel's FAILURES key when it runs the split kernel, else None.
    gluon: tuple | None = None
    # The split kernel with the merge fused (FUSED_MERGE), run outside CUDA-graph capture,
    # and its count of row tiles (programs of grid dim 0: the counters it needs).
    fused_run: Launch | None = None
    programs: int = 0


def _decode_plan(q, k_cache, v_cache, block_table, has_seqlens, sink, left, right, softcap,
                 scale, num_splits, seqlen_add, config, out_dtype, pdl_opt, token_table=None,
                 token_pages=None, mla=False, leftpad=False, lse_heads_first=False,
                 packed=None):
    """Everything decode_fwd passes the kernels but the tensors, from the call's metadata;
    ``mla``: the Hopper MLA kernel (``decode_mla_sm90``) inside its domain; ``leftpad``: the
    call has a ``cache_leftpad`` (decode.py's kernel only); ``lse_heads_first``: lse
    ``(Hq, B * Sq)``; ``packed``: ``(B, Sq, out)`` for :func:`packed_fwd`'s packed ``q``
    (``(total_q, Hq, D)``, sequences of at most Sq rows) and its ``out``."""
    if packed:
        (batch, sq, out_p), (hq, d) = packed, q.shape[1:]
    else:
        batch, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    group = hq // hkv
    out_shape = (batch, sq, hq, dv)
    lse_shape = (hq, batch * sq) if lse_heads_first else (batch, hq, sq)
    out_dtype = out_dtype or q.dtype
    if batch * sq * hq * dv == 0 and batch * hq * sq == 0:
        return _DecodePlan(out_shape, out_dtype, lse_shape)
    st_q, st_k, st_v = q.stride(), k_cache.stride(), v_cache.stride()
    if packed:
        st_q = (0, *st_q[:2])  # (a sequence's rows from cu_seqlens_q)
    paged = block_table is not None
    shared_kv = dv <= d and st_v == st_k and v_cache.data_ptr() == k_cache.data_ptr()
    # K's columns as two power-of-two-padded pieces: V's columns and the rest when V is a view
    # of K (MLA's 512 + 64), else at most 256 columns padded (576 -> 512 + 64, not 1024).
    d1 = dv if shared_kv else (d if d <= 256 else 1 << (d.bit_length() - 1))
    d2 = d - d1
    rows = sq * group
    interpret = interpreting()
    gluon = None
    if mla and not config and not interpret and not leftpad and decode_mla_sm90 is not None and \
            decode_mla_sm90.supported(q, k_cache, v_cache, paged=paged, softcap=softcap,
                                      token_table=token_table,
                                      window=left is not None or right is not None):
        gluon = ("decode_mla_sm90", q.dtype, paged, has_seqlens, left is None, right is None,
                 sink is None, sq * hq, token_table is None, token_pages is None)
        if gluon in FAILURES:
            gluon = None
    cfg = configs.decode_config(d1, d2, dv, rows, interpret)
    if gluon is not None:
        cfg = configs.DECODE_MLA_SM90
    if config:
        cfg = configs.override(cfg, config, configs.DECODE_KEYS, what="decode config")
    block_m, block_n = cfg.block_m, cfg.block_n
    m_tiles = cdiv(rows, block_m)
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    n_tiles = cdiv(capacity, block_n)
    programs = batch * hkv * m_tiles
    if num_splits > 0:
        # A forced count past the key tiles only adds empty splits (and their workspace):
        # capped at one split a tile, the same answer, and at 65535 (the grid's dim 1).
        splits = min(int(num_splits), max(1, n_tiles), 65535)
    elif q.is_cuda:
        splits = _num_splits(programs, n_tiles, _num_sms(q.device) * cfg.programs_per_sm,
                             SPLIT_MIN_TILES if SPLIT_FLOOR else 1)
    else:
        splits = min(4, max(1, n_tiles))
    if packed:
        # The fused merge writes the packed rows (the merge kernel addresses rows by strides
        # alone), even of one split.
        splits = min(splits, FUSED_MERGE_MAX_SPLITS)

    # out and lse are fresh contiguous tensors: their strides follow from their shapes. st_lse
    # is lse's (B, Hq, Sq) strides in either layout.
    st_out = contiguous_strides(out_shape)
    st_lse = (sq, batch * sq, 1) if lse_heads_first else contiguous_strides(lse_shape)
    if packed:
        # out (total_q, Hq, Dv) and lse (Hq, total_q), whose head stride is total_q: passed
        # each call (SizedLaunch).
        st_out, st_lse = (0, *out_p.stride()[:2]), (0, 0, 1)
    o_buf_shape = None
    if splits == 1 and not packed:
        st_o = (0, st_out[0], st_out[1], st_out[2])
        st_l = (0, st_lse[0], st_lse[2], st_lse[1])
    else:
        o_buf_shape = (splits, batch, sq, hq, dv)
        st_o = (batch * sq * hq * dv, sq * hq * dv, hq * dv, dv)
        st_l = (batch * sq * hq, sq * hq, hq, 1)
    softcap = float(softcap or 0.0)
    scale = float(scale)
    # Programmatic dependent launch of the merge behind the split kernel (sm90+);
    # KernelOptions.pdl=False measures what it saves.
    pdl = splits > 1 and pdl_opt and not interpret and _pdl_ok(q)
    # The split kernel's last program of each row tile merges (``_merge_if_last``): one
    # launch less a call. Not for the Hopper MLA kernel, whose splits the merge kernel joins.
    fused = 1 < splits <= FUSED_MERGE_MAX_SPLITS and FUSED_MERGE and gluon is None and \
        (token_table is None or FUSED_MERGE_TOKEN_TABLE)
    kw = dict(
        stride_qb=st_q[0], stride_qs=st_q[1], stride_qh=st_q[2],
        stride_kb=st_k[0], stride_kn=st_k[1], stride_kh=st_k[2],
        stride_vb=st_v[0], stride_vn=st_v[1], stride_vh=st_v[2],
        stride_tb=block_table.stride(0) if paged else 0,
        stride_pb=0 if token_pages is None else token_pages.stride(0),
        stride_os=st_o[0], stride_ob=st_o[1], stride_oq=st_o[2], stride_oh=st_o[3],
        stride_ls=st_l[0], stride_lb=st_l[1], stride_lq=st_l[2], stride_lh=st_l[3],
        # out (B, Sq, Hq, Dv) and lse (B, Hq, Sq), which the fused merge writes.
        stride_yb=st_out[0], stride_yq=st_out[1], stride_yh=st_out[2],
        stride_zb=st_lse[0], stride_zq=st_lse[2], stride_zh=st_lse[1],
        HKV=hkv,
        num_splits=splits,
        capacity=capacity,
        total_q=0,
        num_pages=k_cache.shape[0],
        table_sk=token_table[0] if token_table else 0,
        table_per_batch=token_table[1] if token_table else 1,
        table_hkv=token_table[2] if token_table else 1,
        table_num_pages=token_table[3] if token_pages is not None else 0,
        seqlen_add=int(seqlen_add),
        **mask_args(left, right, scale, softcap),
        SQ=sq,
        GROUP=group,
        M_TILES=m_tiles,
        D1=d1,
        D2=d2,
        DV=dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D1=max(16, next_pow2(d1)),
        BLOCK_D2=max(16, next_pow2(max(d2, 1))),
        BLOCK_DV=max(16, next_pow2(dv)),
        PAGE_SIZE=page_size if paged else 1,
        PAGED=paged,
        TOKEN_TABLE=token_table is not None,
        TOKEN_PAGE=token_table[4] if token_pages is not None else 0,
        SHARED_KV=shared_kv,
        HAS_SEQLENS=has_seqlens,
        HAS_SINK=sink is not None and splits == 1 and not packed,
        HAS_LEFTPAD=leftpad,
        PACKED_Q=False,
        PDL=pdl,
        FUSED_MERGE=False,
        MERGE_SINK=sink is not None,
        MERGE_BLOCK_S=min(next_pow2(splits), FUSED_MERGE_STATES),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages_paged if paged and cfg.num_stages_paged else cfg.num_stages,
    )
    if packed:
        fused_run = SizedLaunch(_decode_fwd_kernel, N_TENSORS, {
            **kw, "FUSED_MERGE": True, "PDL": False, "PACKED_Q": True}, ("stride_zh", "total_q"))
        return _DecodePlan(None, out_dtype, None, (programs, splits), o_buf_shape, None,
                           fused_run=fused_run, programs=programs)
    merge = None
    if splits > 1:
        merge = merge_plan(splits, dv, q.device, sink is not None, r=batch * sq * hq, r1=sq,
                           r2=hq, st_os=st_o[0], st_o=st_o[1:], st_od=1, st_ls=st_l[0],
                           st_l=st_l[1:], st_k=(0, 0, 1), st_y=st_o[1:], st_yd=1,
                           st_z=(st_lse[0], st_lse[2], st_lse[1]), pdl=pdl)
    grid = (programs, splits)
    fused_run = None
    if fused:
        fused_run = Launch(_decode_fwd_kernel, grid, *positional(
            _decode_fwd_kernel, N_TENSORS, {**kw, "FUSED_MERGE": True, "PDL": False}))
    if gluon is not None:
        kernel = decode_mla_sm90._mla_decode_kernel
        run = Launch(kernel, grid, *positional(
            kernel, 9, decode_mla_sm90.kernel_args(kw, q, k_cache, token_table=token_table)))
    else:
        run = Launch(_decode_fwd_kernel, grid, *positional(_decode_fwd_kernel, N_TENSORS, kw))
    return _DecodePlan(out_shape, out_dtype, lse_shape, grid, o_buf_shape, run, merge, gluon,
                       fused_run, programs)


@triton.jit
def _append_kv_kernel(
    k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    stride_tb,
    s_new, capacity, num_pages,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
):
    """Writes ``k_new[b, t]`` / ``v_new[b, t]`` at key position ``cache_seqlens[b] + t``."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BLOCK_S + tl.arange(0, BLOCK_S)
    o_pos = tl.load(cache_seqlens + i_b) + o_t
    # Positions outside the cache (value checks are opt-in) are dropped, never written.
    m_t = (o_t < s_new) & (o_pos >= 0) & (o_pos < capacity)
    if PAGED:
        b_page = tl.load(block_table + i_b.to(tl.int64) * stride_tb + o_pos // PAGE_SIZE, mask=m_t, other=0).to(tl.int64)
        m_t = m_t & (b_page >= 0) & (b_page < num_pages)
        o_row = (o_pos % PAGE_SIZE).to(tl.int64)
        o_k = b_page * stride_kb + o_row * stride_kn
        o_v = b_page * stride_vb + o_row * stride_vn
    else:
        o_k = i_b.to(tl.int64) * stride_kb + o_pos.to(tl.int64) * stride_kn
        o_v = i_b.to(tl.int64) * stride_vb + o_pos.to(tl.int64) * stride_vn
    o_k += i_h.to(tl.int64) * stride_kh
    o_v += i_h.to(tl.int64) * stride_vh
    o_kn = i_b.to(tl.int64) * stride_knb + o_t.to(tl.int64) * stride_kns + i_h.to(tl.int64) * stride_knh
    o_vn = i_b.to(tl.int64) * stride_vnb + o_t.to(tl.int64) * stride_vns + i_h.to(tl.int64) * stride_vnh
    o_d = tl.arange(0, BLOCK_D)
    m_k = m_t[:, None] & (o_d < D)[None, :]
    # [BLOCK_S, BLOCK_D]
    b_k = tl.load(k_new + o_kn[:, None] + o_d[None, :], mask=m_k)
    tl.store(k_cache + o_k[:, None] + o_d[None, :], b_k, mask=m_k)
    o_dv = tl.arange(0, BLOCK_DV)
    m_v = m_t[:, None] & (o_dv < DV)[None, :]
    # [BLOCK_S, BLOCK_DV]
    b_v = tl.load(v_new + o_vn[:, None] + o_dv[None, :], mask=m_v)
    tl.store(v_cache + o_v[:, None] + o_dv[None, :], b_v, mask=m_v)


def append_kv(k_cache, v_cache, k_new, v_new, *, cache_seqlens, block_table):
    """Writes ``k_new``/``v_new`` ``(B, Snew, Hkv, D / Dv)`` into the caches at positions
    ``cache_seqlens[b] + t``, in place, one launch. Positions past the cache, and pages
    outside ``[0, num_pages)``, are dropped (value checks are opt-in); the last dims of all
    four tensors must have stride 1."""
    run_append(find_append_plan(k_cache, v_cache, k_new, v_new, block_table), k_cache,
               v_cache, k_new, v_new, cache_seqlens, block_table)


def find_append_plan(k_cache, v_cache, k_new, v_new, block_table):
    """:func:`append_kv`'s plan, by metadata as decode_fwd's (the append runs before every
    decode step that adds keys): a function of the tensors' metadata, which ``ops.kvcache``
    keeps beside the decode's plan for repeated calls."""
    key = (k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(), k_new.shape,
           k_new.stride(), v_new.shape, v_new.stride(),
           None if block_table is None else (block_table.shape, block_table.stride()))
    plan = _APPEND_PLANS.get(key)
    if plan is None:
        plan = _append_plan(k_cache, v_cache, k_new, v_new, block_table)
        if len(_APPEND_PLANS) >= _MAX_PLANS:
            _APPEND_PLANS.clear()
        _APPEND_PLANS[key] = plan
    return plan


def run_append(plan, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) -> None:
    """Launches a :func:`find_append_plan` plan on these tensors."""
    if plan is not _NOTHING:
        plan(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)


_APPEND_PLANS: dict = {}
_NOTHING = ()


def _append_plan(k_cache, v_cache, k_new, v_new, block_table):
    """The launch of an append, or ``_NOTHING`` when there is nothing to write."""
    batch, s_new, hkv, d = k_new.shape
    dv = v_new.shape[-1]
    if batch == 0 or s_new == 0 or hkv == 0:
        return _NOTHING
    check_grid_dims("the cache append kernel", batch, hkv, "kv heads")
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    cfg = configs.append_kv_config(s_new)
    kw = dict(
        **stride_args("bnh", k=k_cache, v=v_cache),
        **stride_args("bsh", kn=k_new, vn=v_new),
        stride_tb=block_table.stride(0) if paged else 0,
        s_new=s_new,
        capacity=capacity,
        num_pages=k_cache.shape[0],
        D=d,
        DV=dv,
        BLOCK_S=cfg.block_m,
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_DV=max(16, next_pow2(dv)),
        PAGE_SIZE=k_cache.shape[1] if paged else 1,
        PAGED=paged,
        **cfg.launch(),
    )
    return Launch(_append_kv_kernel, (cdiv(s_new, cfg.block_m), hkv, batch),
                  *positional(_append_kv_kernel, 6, kw))
