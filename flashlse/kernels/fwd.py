"""Forward attention kernel: dense and varlen, every mask, sink, softcap, GQA, honest LSE.

Math (docs/design.md §1). For one query row with scores ``s_j = scale * q . k_j`` (or the
soft-capped ``c * tanh(s_j / c)``), masked keys removed, the kernel returns

    lse = log(sum_j e^{s_j} [+ e^{sink}])          out = sum_j e^{s_j - lse} v_j

It works in base 2 so that each exponential is one ``ex2`` instruction: with
``t_j = s_j * log2(e)`` we have ``e^{s_j} = 2^{t_j}`` and ``lse = ln(2) * lse_log2``.
Without softcap ``t_j = (scale * log2 e) * (q . k_j)``: the scale is folded into the
constant ``scale_log2`` and, inside full tiles, into one fused multiply-add
``2^(x * scale_log2 - m)``.

Online softmax over key tiles keeps, per row, the running maximum ``m`` (base 2), the
running sum ``l = sum_j 2^(t_j - m)`` and the unnormalised output ``acc``. A new tile
with row maximum ``m'`` = max(m, max_j t_j) rescales by ``alpha = 2^(m - m')``. A row that
has seen only masked keys has ``m = -inf``; the pivot used in the exponentials is then
replaced by 0 (``tl.where(m == -inf, 0, m)``) so that ``2^(-inf - 0) = 0`` and never
``2^(-inf + inf) = NaN``. In full tiles every score is finite, so ``m'`` is finite and
no ``where`` is needed there.

Epilogue: ``l == 0`` exactly when the row saw no key (a visible key contributes
``2^0 = 1`` at the maximum), so ``inv_sum = 0 if l == 0 else 1 / l`` gives ``out = 0``
and ``lse_log2 = -inf`` with no division by zero. A sink ``t_s = sink * log2 e`` is one
more key of value 0, added once here: ``m_f = max(m, t_s)``,
``l_f = l * 2^(m - m_f) + 2^(t_s - m_f)`` (>= 1 for a finite sink) and
``out = acc * 2^(m - m_f) / l_f``, ``lse_log2 = m_f + log2(l_f)``; a sink of -inf is no sink
(the pivot is 0 when ``m_f = -inf``, so an empty row stays ``(0, -inf)``). Empty means
``l == 0`` exactly: a NaN score makes ``l`` NaN, and that row's out and lse NaN.

Masks, bottom-right aligned (masks.py): with ``shift = Sk - Sq`` row i sees key j iff
``i + shift - left <= j <= i + shift + right``. For a row block ``[m0, m_last]`` the
visible keys lie in ``[m0 + shift - left, m_last + shift + right]``, so key tiles
outside it are never loaded. A tile is *full* (no element masked) when it lies inside
``[m_last + shift - left, m0 + shift + right]`` and before ``Sk``; only the tiles between
the two ranges pay for the mask. The loop runs in three ranges: masked left edge (only
with a left window), full middle, masked right edge (causal diagonal and the ragged end
of the keys).

Schedule: one program per (batch, query head, row block), on a 1-D grid handed out head
group by head group (so that a group's K/V stays in L2) and, inside a group, last row block
first: under a causal mask the last block has the most keys, so the longest work starts
first and short blocks fill the tail. A block that sees no key at all (causal with Sq > Sk,
a window past the keys, Sk = 0) stores the empty state and loads nothing. GQA maps query
head h to key/value head ``h // (Hq / Hkv)``.

Memory: tiles move either through TMA tensor descriptors built inside the kernel over exactly
one (sequence, head) slice (the copy engine zero-fills rows past the sequence end and columns
past the head dim, 59 -> 64, and clips the store of out, so varlen neighbours stay
untouched), or through masked pointer loads. TMA needs sm90 and 16-byte aligned bases and
row strides; where it is allowed the per-head-dim table picks the faster of the two, as
measured on an H200 (benchmarks/NOTES.md), and warp specialisation goes with TMA only.

Paged caches (``attn_fwd_paged``: serving, forward only). K/V are ``(num_pages, page_size,
Hkv, D)`` and key j of sequence b is row ``j % page_size`` of page ``block_table[b, j //
page_size]``: the K/V loader computes one address per key row (one page id per tile when
a page holds whole tiles), so any page size works and the tile arithmetic is the varlen
kernel's. A tile's page ids are loaded one tile ahead and carried through the loop, so that
the K/V copies pipeline as the contiguous loop's do (NOTES.md, session 8). The query heads of a kv head are packed into the rows (PackGQA: row r is query
``r // G`` of head ``r % G`` of the group), one program per (row tile, kv head, sequence):
a decode fills G rows of a tile instead of one, every K/V tile is read once per kv head,
and sequences of at most 16 packed rows (decodes) run on 16-row tiles: the whole call when
no query is longer, else a second launch beside the large tiles (each launch skips the
other's sequences, so no length is read on the host). The masks
take each row's query position, so they are unchanged. A sequence's keys end before the
first block-table entry outside ``[0, num_pages)`` (value checks are opt-in), so no tile
loads a page outside the cache.

On Hopper (sm_90) the dispatcher (``dispatch.py``) sends the calls in ``fwd_sm90.supported``'s
domain (fp16/bf16, D = Dv with a tile in ``configs.FWD_SM90``, no softcap; at D = 64 only the
calls its persistent kernels take) to ``fwd_sm90.py`` instead: the same math in Gluon,
with the two warpgroups of a block freed from the per-tile barrier this kernel cannot avoid
(1.15-1.3x faster there). This module knows nothing of that kernel.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import configs, options
from ._common import (
    Launch,
    SizedLaunch,
    alloc_scratch,
    cdiv,
    final_stats,
    interpreting,
    key_ranges,
    load_rows,
    mask_args,
    next_pow2,
    paged_keys,
    positional,
    seq_args,
    seq_block,
    seq_span,
    slice_ptr,
    stride_args,
    strides,
    tma_ok,
)
from .failures import FAILURES


@triton.jit
def _paged_tile_pages(p_bt, n0, T_k, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Page ids of key tile ``[n0, n0 + BLOCK_N)`` from the block-table row ``p_bt``: one
    (a scalar) when a page holds whole tiles, else one per key row (``[BLOCK_N]``, any page
    size). Entries of keys from ``T_k`` on are not read (0): they may lie past the row or
    hold an invalid page, and no tile loads those keys."""
    if PAGE_SIZE % BLOCK_N == 0:
        b_page = tl.load(p_bt + n0 // PAGE_SIZE, mask=n0 < T_k, other=0)
    else:
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_page = tl.load(p_bt + o_n // PAGE_SIZE, mask=o_n < T_k, other=0)
    return b_page


@triton.jit
def _attn_fwd_load_kv(ref, o_n, n0, stride_s, T_k, b_page, stride_p,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, N_COLS: tl.constexpr,
                      USE_TMA: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """K or V tile ``[BLOCK_N, BLOCK_C]`` of keys ``o_n = n0 + arange``, zeros from ``T_k`` on:
    rows of one contiguous slice (``PAGE_SIZE == 0``), or of a paged cache, key j at row
    ``j % PAGE_SIZE`` of its page (pages ``stride_p`` apart), the tile's page ids ``b_page``
    given (``_paged_tile_pages``, loaded a tile ahead by ``_attn_fwd_ranges``)."""
    if PAGE_SIZE == 0:
        b_x = load_rows(ref, o_n, n0, stride_s, T_k, BLOCK_N, BLOCK_C, N_COLS, USE_TMA)
    else:
        m_n = o_n < T_k
        if PAGE_SIZE % BLOCK_N == 0:
            # The tile is BLOCK_N consecutive rows of one page (n0 < T_k: its entry is in use).
            p_x = ref + (b_page.to(tl.int64) * stride_p + (n0 % PAGE_SIZE).to(tl.int64) * stride_s)
            o_row = tl.arange(0, BLOCK_N).to(tl.int64) * stride_s
        else:
            p_x = ref
            if BLOCK_N % PAGE_SIZE == 0:
                # n0 is a multiple of the page size: the rows inside the pages are the same
                # every tile, and their offsets are hoisted out of the loop.
                o_in = tl.arange(0, BLOCK_N) % PAGE_SIZE
            else:
                o_in = o_n % PAGE_SIZE
            o_row = b_page.to(tl.int64) * stride_p + o_in.to(tl.int64) * stride_s
        o_c = tl.arange(0, BLOCK_C)
        # [BLOCK_N, BLOCK_C]; a row is N_COLS contiguous elements either way.
        b_x = tl.load(p_x + o_row[:, None] + o_c[None, :],
                      mask=m_n[:, None] & (o_c < N_COLS)[None, :], other=0.0)
    return b_x


@triton.jit
def _attn_fwd_qk(b_q, k_ref, stride_ks, n0, T_k, b_page, stride_kp, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, D: tl.constexpr, USE_TMA: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """Raw scores ``q . k`` of key tile ``[n0, n0 + BLOCK_N)``: ``[BLOCK_M, BLOCK_N]``."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    # [BLOCK_N, BLOCK_D]
    b_k = _attn_fwd_load_kv(k_ref, o_n, n0, stride_ks, T_k, b_page, stride_kp,
                            BLOCK_N, BLOCK_D, D, USE_TMA, PAGE_SIZE)
    return tl.dot(b_q, tl.trans(b_k))


@triton.jit
def _attn_fwd_softmax_pv(
    b_acc, b_m, b_l, b_s,
    v_ref, stride_vs, b_page, stride_vp,
    n0, o_m, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, NEG_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Online-softmax update with the raw scores ``b_s`` of key tile ``[n0, n0 + BLOCK_N)``;
    ``o_m`` is each row's query position (the masks' row index)."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    if HAS_SOFTCAP:
        # c * tanh(scale * s / c) in base 2: tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)),
        # exact at both infinities (2^inf -> 1, 2^-inf -> -1), no NaN.
        b_s = softcap_c2 * (1.0 - 2.0 / (1.0 + tl.math.exp2(b_s * softcap_a2)))
    if MASK or HAS_SOFTCAP:
        if not HAS_SOFTCAP:
            b_s = b_s * scale_log2
        if MASK:
            m_s = o_n[None, :] < T_k
            if HAS_RIGHT:
                m_s = m_s & (o_n[None, :] <= o_m[:, None] + shift + right)
            if HAS_LEFT:
                m_s = m_s & (o_n[None, :] >= o_m[:, None] + shift - left)
            b_s = tl.where(m_s, b_s, float("-inf"))
        # [BLOCK_M]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        # A row with no visible key yet keeps m = -inf; pivot on 0 so 2^(-inf - 0) = 0.
        b_piv = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_piv[:, None])
    else:
        # Full tile, no softcap: every score is finite, so the new max is finite and the
        # scale folds into one multiply-add per element.
        if NEG_SCALE:
            b_m_new = tl.maximum(b_m, tl.min(b_s, 1) * scale_log2)
        else:
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * scale_log2)
        b_piv = b_m_new
        b_p = tl.math.exp2(b_s * scale_log2 - b_piv[:, None])
    # [BLOCK_M]; m = -inf before the first visible key gives alpha = 0 on a zero acc.
    b_alpha = tl.math.exp2(b_m - b_piv)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    # [BLOCK_N, BLOCK_DV]
    b_v = _attn_fwd_load_kv(v_ref, o_n, n0, stride_vs, T_k, b_page, stride_vp,
                            BLOCK_N, BLOCK_DV, DV, USE_TMA, PAGE_SIZE)
    # [BLOCK_M, BLOCK_DV]
    b_acc = b_acc * b_alpha[:, None]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
    return b_acc, b_m_new, b_l


@triton.jit
def _attn_fwd_ranges(
    b_acc, b_m, b_l, b_q,
    k_ref, v_ref,
    stride_ks, stride_vs,
    p_bt, stride_kp, stride_vp,
    n_lo, n_full_lo, n_full_hi, n_hi,
    o_m, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, NEG_SCALE: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """The key tiles of a row block (``key_ranges``) as three loops: masked left edge (only
    with a left window), full middle, masked right edge (causal diagonal, ragged end of the
    keys); each range starts at a multiple of BLOCK_N. K/V contiguous (``PAGE_SIZE == 0``) or
    paged through the block-table row ``p_bt``."""
    for part in tl.static_range(3):
        if part == 0:
            lo, hi = n_lo, n_full_lo
        elif part == 1:
            lo, hi = n_full_lo, n_full_hi
        else:
            lo, hi = n_full_hi, n_hi
        if part != 0 or HAS_LEFT:
            # Paged: a tile's page ids are loaded one iteration ahead and carried, so the K/V
            # addresses depend on no load of their own iteration and the software pipeliner
            # issues the K/V copies num_stages - 1 tiles ahead as in the contiguous loop
            # (loaded in the same iteration, the ids made it wait for every copy at each
            # tile: NOTES.md, session 8).
            b_page = 0
            if PAGE_SIZE != 0:
                b_page = _paged_tile_pages(p_bt, lo, T_k, BLOCK_N, PAGE_SIZE)
            for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                n0 = tl.multiple_of(n0, BLOCK_N)
                b_page_next = b_page
                if PAGE_SIZE != 0:
                    b_page_next = _paged_tile_pages(p_bt, n0 + BLOCK_N, T_k, BLOCK_N, PAGE_SIZE)
                b_s = _attn_fwd_qk(b_q, k_ref, stride_ks, n0, T_k, b_page, stride_kp,
                                   BLOCK_N, BLOCK_D, D, USE_TMA, PAGE_SIZE)
                # The edges mask, the full middle does not.
                b_acc, b_m, b_l = _attn_fwd_softmax_pv(
                    b_acc, b_m, b_l, b_s, v_ref, stride_vs, b_page, stride_vp,
                    n0, o_m, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2,
                    DV, BLOCK_N, BLOCK_DV,
                    part != 1, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, NEG_SCALE, USE_TMA, PAGE_SIZE,
                )
                b_page = b_page_next
    return b_acc, b_m, b_l


@triton.jit
def _attn_fwd_finish(b_acc, b_m, b_l, b_sink_nat, HAS_SINK: tl.constexpr):
    """Epilogue math: normalise and add the sink (natural-log logit, a scalar or one per row)
    once (``_common.final_stats``, the Hopper kernels' too); returns ``out [BLOCK_M, BLOCK_DV]``
    (float32) and the natural-log ``lse [BLOCK_M]``."""
    b_scale, b_lse = final_stats(b_m, b_l, b_sink_nat, HAS_SINK)
    # [BLOCK_M, BLOCK_DV]
    return b_acc * b_scale[:, None], b_lse


@triton.jit
def _attn_fwd_start(m0, m_last, T_k, shift, left, right, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr):
    """A row block's empty softmax state (running max -inf, sum 0, accumulator 0) and its key
    tiles (``key_ranges``): those some row sees (the rest are skipped entirely) and the full
    middle, where no mask is applied."""
    # [BLOCK_M]
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    # [BLOCK_M, BLOCK_DV]
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n_lo, n_full_lo, n_full_hi, n_hi = key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N,
                                                  HAS_LEFT, HAS_RIGHT)
    return b_acc, b_m, b_l, n_lo, n_full_lo, n_full_hi, n_hi


@triton.jit
def _attn_fwd_store(
    b_acc, b_m, b_l, o_m, m0, T_q,
    p_o, stride_os, p_lse, sink, i_h,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Epilogue of one (sequence, head) row block: out and the natural-log lse."""
    if HAS_SINK:
        b_sink_nat = tl.load(sink + i_h).to(tl.float32)
    else:
        b_sink_nat = 0.0
    b_o, b_lse = _attn_fwd_finish(b_acc, b_m, b_l, b_sink_nat, HAS_SINK)
    tl.store(p_lse + o_m, b_lse, mask=o_m < T_q)
    if USE_TMA:
        o_ref = tl.make_tensor_descriptor(p_o, shape=[T_q, DV], strides=[stride_os, 1],
                                          block_shape=[BLOCK_M, BLOCK_DV])
        o_ref.store([m0, 0], b_o.to(p_o.dtype.element_ty))
    else:
        o_dv = tl.arange(0, BLOCK_DV)
        p_out = p_o + o_m[:, None].to(tl.int64) * stride_os + o_dv[None, :]
        m_out = (o_m[:, None] < T_q) & (o_dv[None, :] < DV)
        tl.store(p_out, b_o.to(p_out.dtype.element_ty), mask=m_out)


# Lengths, window bounds and grid sizes change per call; specialising on them only recompiles.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "n_bh", "group_heads", "left", "right"])
def _attn_fwd_kernel(
    q, k, v, o, lse, sink,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, total_q, total_k, n_bh, group_heads,
    left, right,
    scale_log2, softcap_a2, softcap_c2,
    HQ: tl.constexpr, GROUP: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, NEG_SCALE: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # Row blocks are handed out head group by head group (GROUP_HEADS (batch, head) pairs at a
    # time, so their K/V stay in L2), and inside a group last block first: under a causal
    # mask the last block has the most keys, so the longest work starts first.
    i_pid = tl.program_id(0)
    n_m = tl.cdiv(seqlen_q, BLOCK_M)
    n_per_group = n_m * group_heads
    i_group = i_pid // n_per_group
    heads = tl.minimum(group_heads, n_bh - i_group * group_heads)
    i_r = i_pid - i_group * n_per_group
    i_m = n_m - 1 - i_r // heads
    i_bh = i_group * group_heads + i_r % heads
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    i_hk = i_h // GROUP
    bos, bos_k, T_q, T_k, i_m, m0, m_last, shift = seq_block(
        i_b, i_m, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k,
        BLOCK_M, False, False, IS_VARLEN, HAS_SEQUSED_K)
    if m0 >= T_q:
        return

    o_m = m0 + tl.arange(0, BLOCK_M)
    p_o = slice_ptr(o, i_b, bos, i_h, stride_ob, stride_os, stride_oh)
    p_lse = lse + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + bos
    b_acc, b_m, b_l, n_lo, n_full_lo, n_full_hi, n_hi = _attn_fwd_start(
        m0, m_last, T_k, shift, left, right, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_LEFT, HAS_RIGHT)
    if n_hi == n_lo:
        # No row of the block sees a key: write the empty state, load nothing.
        _attn_fwd_store(b_acc, b_m, b_l, o_m, m0, T_q, p_o, stride_os, p_lse, sink, i_h,
                        DV, BLOCK_M, BLOCK_DV, HAS_SINK, USE_TMA)
        return

    p_q = slice_ptr(q, i_b, bos, i_h, stride_qb, stride_qs, stride_qh)
    p_k = slice_ptr(k, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh)
    p_v = slice_ptr(v, i_b, bos_k, i_hk, stride_vb, stride_vs, stride_vh)
    if USE_TMA:
        # One descriptor per (sequence, head) slice: rows past its end read as zeros and
        # the store of out is clipped there, so neighbours in a varlen batch stay untouched.
        q_ref = tl.make_tensor_descriptor(p_q, shape=[T_q, D], strides=[stride_qs, 1],
                                          block_shape=[BLOCK_M, BLOCK_D])
        k_ref = tl.make_tensor_descriptor(p_k, shape=[T_k, D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_ref = tl.make_tensor_descriptor(p_v, shape=[T_k, DV], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        q_ref = p_q
        k_ref = p_k
        v_ref = p_v

    # [BLOCK_M, BLOCK_D]
    b_q = load_rows(q_ref, o_m, m0, stride_qs, T_q, BLOCK_M, BLOCK_D, D, USE_TMA)
    b_acc, b_m, b_l = _attn_fwd_ranges(
        b_acc, b_m, b_l, b_q, k_ref, v_ref, stride_ks, stride_vs, None, 0, 0,
        n_lo, n_full_lo, n_full_hi, n_hi, o_m, T_k, shift, left, right,
        scale_log2, softcap_a2, softcap_c2,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, NEG_SCALE, USE_TMA, WARP_SPECIALIZE, 0,
    )
    _attn_fwd_store(b_acc, b_m, b_l, o_m, m0, T_q, p_o, stride_os, p_lse, sink, i_h,
                    DV, BLOCK_M, BLOCK_DV, HAS_SINK, USE_TMA)


@triton.jit
def _attn_fwd_paged_store(b_acc, b_m, b_l, o_i, o_h, m_r, bos, o, lse, sink,
                          stride_os, stride_oh, stride_lh,
                          DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINK: tl.constexpr):
    """Epilogue of a packed row tile: row r is query ``bos + o_i[r]`` of head ``o_h[r]``."""
    if HAS_SINK:
        b_sink_nat = tl.load(sink + o_h, mask=m_r, other=0.0).to(tl.float32)
    else:
        b_sink_nat = 0.0
    b_o, b_lse = _attn_fwd_finish(b_acc, b_m, b_l, b_sink_nat, HAS_SINK)
    o_q = bos + o_i.to(tl.int64)
    tl.store(lse + o_h.to(tl.int64) * stride_lh + o_q, b_lse, mask=m_r)
    o_dv = tl.arange(0, BLOCK_DV)
    p_out = o + (o_q * stride_os + o_h.to(tl.int64) * stride_oh)[:, None] + o_dv[None, :]
    tl.store(p_out, b_o.to(p_out.dtype.element_ty), mask=m_r[:, None] & (o_dv < DV)[None, :])


# (Every length and the lse stride, total_q, vary call to call: SizedLaunch passes them.)
@triton.jit(do_not_specialize=["stride_lh", "seqlen_q", "total_q", "capacity", "num_pages",
                               "rows_lo", "rows_hi", "left", "right"])
def _attn_fwd_paged_kernel(
    q, k, v, o, lse, sink,
    cu_seqlens_q, seqused_k, block_table,
    stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_os, stride_oh, stride_lh, stride_tb,
    seqlen_q, total_q, capacity, num_pages, rows_lo, rows_hi,
    left, right,
    scale_log2, softcap_a2, softcap_c2,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, NEG_SCALE: tl.constexpr,
):
    """Varlen forward over paged K/V with the query heads of a kv head packed into the rows
    (PackGQA): one program per (row tile, kv head, sequence), row r of a sequence's
    ``T_q * GROUP`` packed rows is query ``r // GROUP`` of head ``kv head * GROUP + r % GROUP``.
    A decode (one query) fills GROUP rows of a tile, and each K/V tile is read once per kv
    head for the whole group. Last row tile first (the most keys under a causal mask)."""
    i_t = tl.num_programs(0) - 1 - tl.program_id(0)
    i_hk = tl.program_id(1)
    i_b = tl.program_id(2)
    bos, T_q = seq_span(cu_seqlens_q, i_b, total_q, seqlen_q)
    n_rows = T_q * GROUP
    r0 = i_t * BLOCK_M
    # Sequences of (rows_lo, rows_hi] packed rows are this launch's; the rest are another's.
    if (r0 >= n_rows) | (n_rows <= rows_lo) | (n_rows > rows_hi):
        return
    p_bt = block_table + i_b.to(tl.int64) * stride_tb
    # Keys: seqused_k clamped to the pages the table holds, ended before a page out of range.
    T_k = tl.minimum(tl.maximum(tl.load(seqused_k + i_b), 0), capacity)
    T_k = paged_keys(p_bt, T_k, num_pages, tl.arange(0, BLOCK_P), PAGE_SIZE)
    # Query positions [m0, m_last] of the tile, for the (bottom-right) masks.
    m0 = r0 // GROUP
    m_last = (tl.minimum(r0 + BLOCK_M, n_rows) - 1) // GROUP
    shift = T_k - T_q

    o_r = r0 + tl.arange(0, BLOCK_M)
    m_r = o_r < n_rows
    # [BLOCK_M] query position and head of each row
    o_i = o_r // GROUP
    o_h = i_hk * GROUP + o_r % GROUP
    b_acc, b_m, b_l, n_lo, n_full_lo, n_full_hi, n_hi = _attn_fwd_start(
        m0, m_last, T_k, shift, left, right, BLOCK_M, BLOCK_N, BLOCK_DV, HAS_LEFT, HAS_RIGHT)
    if n_hi == n_lo:
        # No row of the tile sees a key: write the empty state, load nothing.
        _attn_fwd_paged_store(b_acc, b_m, b_l, o_i, o_h, m_r, bos, o, lse, sink,
                              stride_os, stride_oh, stride_lh, DV, BLOCK_DV, HAS_SINK)
        return

    o_d = tl.arange(0, BLOCK_D)
    p_q = q + ((bos + o_i.to(tl.int64)) * stride_qs + o_h.to(tl.int64) * stride_qh)[:, None] + o_d[None, :]
    # [BLOCK_M, BLOCK_D]
    b_q = tl.load(p_q, mask=m_r[:, None] & (o_d < D)[None, :], other=0.0)
    b_acc, b_m, b_l = _attn_fwd_ranges(
        b_acc, b_m, b_l, b_q, k + i_hk.to(tl.int64) * stride_kh, v + i_hk.to(tl.int64) * stride_vh,
        stride_ks, stride_vs, p_bt, stride_kp, stride_vp,
        n_lo, n_full_lo, n_full_hi, n_hi, o_i, T_k, shift, left, right,
        scale_log2, softcap_a2, softcap_c2,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, NEG_SCALE, False, False, PAGE_SIZE,
    )
    _attn_fwd_paged_store(b_acc, b_m, b_l, o_i, o_h, m_r, bos, o, lse, sink,
                          stride_os, stride_oh, stride_lh, DV, BLOCK_DV, HAS_SINK)


def _pick_paged_config(block_d: int, block_dv: int, rows: int) -> configs.TileConfig:
    """``configs.fwd_paged_config``'s tiles for sequences of at most ``rows`` packed rows, with
    ``KernelOptions.fwd_config``'s overrides."""
    cfg = configs.fwd_paged_config(block_d, block_dv, rows, interpreting())
    return configs.override(cfg, options.current().fwd_config, configs.FWD_KEYS,
                            what="fwd_config")


def output_shapes(q, v, cu_seqlens_q=None) -> tuple:
    """``(out_shape, lse_shape)`` of a forward: ``(B, Sq, Hq, Dv)`` and ``(B, Hq, Sq)``, or
    varlen ``(total_q, Hq, Dv)`` and ``(Hq, total_q)``."""
    hq, dv = q.shape[-2], v.shape[-1]
    if cu_seqlens_q is not None:
        return (q.shape[0], hq, dv), (hq, q.shape[0])
    return (q.shape[0], q.shape[1], hq, dv), (q.shape[0], hq, q.shape[1])


def new_outputs(q, v, cu_seqlens_q=None):
    """``out`` (``q.dtype``) and ``lse`` (float32) of a forward, of :func:`output_shapes`,
    unwritten (NaN under ``poison_outputs``). Every forward launcher (this module's,
    ``fwd_sm90``'s) fills these."""
    out_shape, lse_shape = output_shapes(q, v, cu_seqlens_q)
    empty = options.allocator()
    return (empty(out_shape, dtype=q.dtype, device=q.device),
            empty(lse_shape, dtype=torch.float32, device=q.device))


def attn_fwd(q, k, v, *, left, right, softcap, scale, sink,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             seqused_k=None, out=None, lse=None):
    """``out = softmax(scale * q k^T [masked]) v`` and ``lse = log sum exp`` (+ sink), rowwise,
    by the portable Triton kernel (``dispatch.attn_fwd`` picks between it and the Hopper one).

    Inputs are assumed valid (ops/ validates). Any strides with the last one 1.

    Args:
        q: ``(B, Sq, Hq, D)``, or ``(total_q, Hq, D)`` with ``cu_seqlens_q``.
        k: ``(B, Sk, Hkv, D)``, or ``(total_k, Hkv, D)``.
        v: ``(B, Sk, Hkv, Dv)``, or ``(total_k, Hkv, Dv)``.
        left, right: window bounds (int >= 0) or None for unbounded; causal is ``right=0``.
        softcap: ``c > 0`` applies ``c * tanh(s / c)`` before masking; 0 is off.
        scale: multiplies ``q . k``.
        sink: ``(Hq,)`` float32 per-head logits or None.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 offsets (varlen).
        max_seqlen_q, max_seqlen_k: ints (varlen).
        seqused_k: ``(B,)`` int32 keys used per sequence, or None.
        out, lse: :func:`new_outputs`'s buffers to fill, or None to allocate them here.

    Returns:
        ``out (B, Sq, Hq, Dv)`` in ``q.dtype`` and ``lse (B, Hq, Sq)`` float32 natural log;
        varlen: ``out (total_q, Hq, Dv)``, ``lse (Hq, total_q)``.
    """
    if out is None:
        out, lse = new_outputs(q, v, cu_seqlens_q)
    plan = find_plan(q, k, v, out, lse, left=left, right=right, softcap=softcap, scale=scale,
                     sink=sink, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    run_plan(plan, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k)
    return out, lse


def find_plan(q, k, v, out, lse, *, left, right, softcap, scale, sink, cu_seqlens_q=None,
              max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """:func:`attn_fwd`'s launch plan of a call (arguments as its), for :func:`run_plan`."""
    # Everything but the tensors' addresses is a function of the call's metadata: a repeated
    # call finds its launch plan (tiles, grid, scalar and constexpr arguments) in _PLANS and
    # only launches (as kernels.decode). The key: shapes, strides, dtypes and device of the
    # tensors, whether their addresses are 16-byte aligned (TMA), which optional tensors are
    # there, the scalars and the options; a fwd_config override is planned afresh each call.
    opts = options.current()
    plan = key = None
    if not opts.fwd_config:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
               v.shape, v.stride(), v.dtype, out.stride(), lse.stride(),
               (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) % 16 == 0,
               None if cu_seqlens_q is None else (cu_seqlens_q.shape, max_seqlen_q,
                                                  max_seqlen_k),
               seqused_k is None, sink is None, left, right, softcap, scale)
        plan = _PLANS.get(key)
    if plan is None:
        plan = _fwd_plan(q, k, v, out, lse, left=left, right=right, softcap=softcap,
                         scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, fwd_config=opts.fwd_config)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def run_plan(plan, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k) -> bool:
    """Launches :func:`find_plan`'s ``plan`` on the call's tensors (those it was planned for,
    or any with the same metadata), filling ``out`` and ``lse``; True (it always runs: a
    warp-specialised kernel that fails to compile falls back to the plain one)."""
    if plan.grid is None:
        return True
    if plan.set_allocator:
        triton.set_allocator(alloc_scratch)
    if plan.ws_run is not None and plan.ws_key not in FAILURES:
        try:
            plan.ws_run(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k)
            return True
        except Exception:  # noqa: BLE001 - compiler failure: the plain kernel is the fallback
            # Warp specialisation is young in Triton 3.6: if its passes reject a kernel,
            # run the same kernel without it rather than fail the call (no warning, as before).
            FAILURES.add(plan.ws_key)
    plan.run(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k)
    return True


# Launch plans of attn_fwd by call metadata; cleared when full (a model's shapes repeat).
_PLANS: dict = {}
_MAX_PLANS = 4096


@dataclasses.dataclass(frozen=True)
class _FwdPlan:
    # None: no row, nothing to launch.
    grid: tuple | None = None
    # The kernel's launch without and with warp specialisation (ws_run None: not tried).
    run: Launch | None = None
    ws_run: Launch | None = None
    ws_key: tuple = ()
    set_allocator: bool = False


def _fwd_plan(q, k, v, out, lse, *, left, right, softcap, scale, sink, cu_seqlens_q,
              max_seqlen_q, max_seqlen_k, seqused_k, fwd_config):
    """Everything attn_fwd passes the kernel but the tensors, from the call's metadata."""
    is_varlen = cu_seqlens_q is not None
    d, dv = q.shape[-1], v.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    batch, lens = seq_args(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    seqlen_q, seqlen_k = lens["seqlen_q"], lens["seqlen_k"]
    if q.shape[0] == 0 or hq == 0 or batch == 0 or seqlen_q == 0:
        return _FwdPlan()  # no row (q.shape[0] is B or total_q)

    block_d = max(next_pow2(d), 16)
    block_dv = max(next_pow2(dv), 16)
    masked = right is not None or left is not None
    cfg = configs.override(configs.fwd_config(block_d, block_dv, masked, interpreting()),
                           fwd_config, configs.FWD_KEYS, what="fwd_config")
    use_tma = cfg.use_tma and tma_ok(q, k, v, out)
    # Triton 3.6's Hopper warp specialisation compiled here only with TMA loads and 8 warps
    # (4 warps hit an assertion in its TaskIdPropagation pass).
    ws = cfg.warp_specialize and use_tma and cfg.num_warps >= 8 and not interpreting()
    scale = float(scale)
    softcap = float(softcap or 0.0)
    n_bh = batch * hq
    group_heads = cfg.group_heads or configs.fwd_group_heads(seqlen_k, d + dv, q.element_size())
    # lse is (B, H, S) or varlen (H, total): its batch and head strides.
    stride_lb, stride_lh = strides(lse, is_varlen)[:2]
    kw = dict(
        **stride_args("bsh", is_varlen, q=q, k=k, v=v, o=out),
        stride_lb=stride_lb,
        stride_lh=stride_lh,
        **lens,
        n_bh=n_bh,
        group_heads=min(group_heads, n_bh),
        **mask_args(left, right, scale, softcap),
        HQ=hq,
        GROUP=hq // hkv,
        D=d,
        DV=dv,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        HAS_SINK=sink is not None,
        NEG_SCALE=scale < 0,
        IS_VARLEN=is_varlen,
        HAS_SEQUSED_K=seqused_k is not None,
        USE_TMA=use_tma,
        WARP_SPECIALIZE=False,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (n_bh * cdiv(seqlen_q, cfg.block_m),)
    ws_run = None
    if ws:
        ws_run = Launch(_attn_fwd_kernel, grid,
                        *positional(_attn_fwd_kernel, 9, {**kw, "WARP_SPECIALIZE": True}))
    return _FwdPlan(
        grid=grid, run=Launch(_attn_fwd_kernel, grid, *positional(_attn_fwd_kernel, 9, kw)),
        ws_run=ws_run,
        ws_key=("fwd warp_specialize", block_d, block_dv, cfg.block_m, cfg.block_n,
                cfg.num_warps, q.dtype),
        set_allocator=use_tma and not interpreting())


# Packed rows (T_q * Hq / Hkv) up to which a paged sequence (a decode of up to 16 heads a
# group) takes the launch of 16-row tiles, not a 128-row tile of its own.
SMALL_ROWS = 16


def attn_fwd_paged(q, k_cache, v_cache, block_table, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                   max_seqlen_k, left, right, softcap, scale, sink, out=None, lse=None,
                   only_small=False, min_seqlen_q=0, plans=None, skip_rows=0):
    """:func:`attn_fwd` over paged K/V caches, read in place (no gather), the query heads of
    each kv head packed into the rows of a tile.

    Inputs are assumed valid (ops/ validates); any values are memory-safe: lengths are clamped
    to the table's pages, and a sequence's keys end before a block-table entry outside
    ``[0, num_pages)``. No host sync.

    Args:
        q: ``(total_q, Hq, D)`` with ``cu_seqlens_q (B + 1,)`` int32 and ``max_seqlen_q``.
        k_cache / v_cache: ``(num_pages, page_size, Hkv, D / Dv)``, any page size.
        block_table: ``(B, max_pages)`` int32: key j of sequence b is row ``j % page_size`` of
            page ``block_table[b, j // page_size]``.
        seqused_k: ``(B,)`` int32 keys of each sequence.
        max_seqlen_k: int; only the table's pages that can hold the first ``max_seqlen_k``
            keys are looked at.
        left, right, softcap, scale, sink: as :func:`attn_fwd`.
        out, lse: the outputs to fill (``new_outputs``'s; allocated when None).
        only_small: only the sequences of at most ``SMALL_ROWS`` packed rows (``T_q * Hq /
            Hkv``: decodes); the dispatcher runs the longer ones on the Hopper paged kernel.
        min_seqlen_q: a bound below every sequence's query rows known on the host: when it
            leaves no sequence of at most ``SMALL_ROWS`` packed rows, one launch of the
            large tiles covers them all.
        plans: a cache the caller keeps for calls of one metadata but the lengths (a public
            call's kept key): the launches are found there by their tiles alone.
        skip_rows: when > 0, only the sequences of more than ``skip_rows`` packed rows,
            where ``max_seqlen_q`` has some: the dispatcher runs the others on the split-KV
            decode kernel (``SMALL_ROWS``, or a group larger than that: one query row).

    Returns:
        ``out (total_q, Hq, Dv)`` in ``q.dtype`` and ``lse (Hq, total_q)`` float32.
    """
    total_q, hq, d = q.shape
    num_pages, page, hkv, dv = v_cache.shape
    batch = cu_seqlens_q.numel() - 1
    if out is None:
        out, lse = new_outputs(q, v_cache, cu_seqlens_q)
    group = hq // hkv
    rows = int(max_seqlen_q) * group
    if only_small:
        rows = min(rows, SMALL_ROWS)
    # Packed rows up to which a sequence is a decode (this launch's or the decode kernel's).
    small = skip_rows or SMALL_ROWS
    if total_q == 0 or batch == 0 or rows == 0 or rows <= skip_rows:
        return out, lse
    block_d = max(next_pow2(d), 16)
    block_dv = max(next_pow2(dv), 16)
    # A cache of empty pages (page_size 0) holds no key.
    n_cols = min(block_table.shape[1], cdiv(max(int(max_seqlen_k), 0), page)) if page else 0
    # The sequences of (rows_lo, rows_hi] packed rows a launch; the others exit at once. A
    # mixed step: the sequences of up to SMALL_ROWS packed rows (decodes, G <= 16) take a
    # launch of 16-row tiles of their own instead of a 128-row tile each; both launches see
    # every sequence and skip the other's (no host sync on the lengths). With ``skip_rows``
    # the dispatcher runs those on the decode kernel (dispatch.SMALL_DECODE): no such launch.
    spans = ([(0, rows)] if rows <= small or int(min_seqlen_q) * group > small
             else [(small, rows), (0, small)][:1 if skip_rows else 2])
    cfgs = tuple(_pick_paged_config(block_d, block_dv, hi) for _, hi in spans)
    # The plan is a function of the call's metadata but the lengths (total_q, max_seqlen_q,
    # max_seqlen_k: a serving engine's every step changes them), which each launch passes
    # the compiled kernel afresh (SizedLaunch); a fwd_config override is planned each call.
    key = runs = None
    cache = _PLANS
    if not options.current().fwd_config:
        if plans is None:
            key = ("paged", q.shape[1:], q.stride(), q.dtype, q.device, k_cache.shape,
                   k_cache.stride(), v_cache.shape, v_cache.stride(), out.stride(),
                   block_table.stride(), sink is None, left, right, softcap, scale, cfgs)
        else:
            key, cache = ("portable", cfgs), plans
        runs = cache.get(key)
    if runs is None:
        runs = tuple(_paged_launch(q, k_cache, v_cache, block_table, out, lse, sink, cfg,
                                   left=left, right=right, softcap=softcap, scale=scale)
                     for cfg in cfgs)
        if key is not None:
            if len(cache) >= _MAX_PLANS:
                cache.clear()
            cache[key] = runs
    for run, cfg, (lo, hi) in zip(runs, cfgs, spans):
        run((cdiv(hi, cfg.block_m), hkv, batch),
            (lse.stride(0), int(max_seqlen_q), total_q, n_cols * page, lo, hi),
            q, k_cache, v_cache, out, lse, sink, cu_seqlens_q, seqused_k, block_table)
    return out, lse


# The paged kernel's arguments that change from call to call (SizedLaunch).
_PAGED_SIZED = ("stride_lh", "seqlen_q", "total_q", "capacity", "rows_lo", "rows_hi")


def _paged_launch(q, k_cache, v_cache, block_table, out, lse, sink, cfg, *, left, right,
                  softcap, scale) -> SizedLaunch:
    """The paged kernel's launch of tiles ``cfg`` for :func:`attn_fwd_paged`: everything but
    the tensors and ``_PAGED_SIZED``, from the call's metadata."""
    d, dv = q.shape[-1], v_cache.shape[-1]
    num_pages, page, hkv = v_cache.shape[:3]
    scale = float(scale)
    softcap = float(softcap or 0.0)
    kw = dict(
        stride_qs=q.stride(0),
        stride_qh=q.stride(1),
        **stride_args("psh", k=k_cache, v=v_cache),
        stride_os=out.stride(0),
        stride_oh=out.stride(1),
        stride_tb=block_table.stride(0),
        num_pages=num_pages,
        **mask_args(left, right, scale, softcap),
        GROUP=q.shape[1] // hkv,
        D=d,
        DV=dv,
        PAGE_SIZE=max(page, 1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(next_pow2(d), 16),
        BLOCK_DV=max(next_pow2(dv), 16),
        BLOCK_P=128,
        HAS_SINK=sink is not None,
        NEG_SCALE=scale < 0,
        **cfg.launch(),
    )
    return SizedLaunch(_attn_fwd_paged_kernel, 9, kw, _PAGED_SIZED)
