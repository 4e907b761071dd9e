"""Backward attention kernels: dq, dk, dv, dsink, with a differentiable LSE and honest empty rows.

Math (docs/math.md §4). With ``P_ij = exp(S_ij - L_i)``, ``dP_ij = dO_i . V_j`` and the
gradient ``dL_i`` of the returned LSE,

    D_i   = rowsum(dO_i * O_i) - dL_i           dS_ij = P_ij (dP_ij - D_i)
    dV_j  = sum_i P_ij dO_i                     dK_j  = scale sum_i dS_ij Q_i
    dQ_i  = scale sum_j dS_ij K_j               dsink_h = -sum_{b,i} exp(sink_h - L_i) D_i

``-dL_i`` enters ``D_i`` because ``dL_i / dS_ij = P_ij``; the sink is a key of value 0, so
its ``dS`` is its whole gradient. With softcap ``c`` the logits are ``S = c tanh(scale x / c)``
of the raw ``x = q . k``, so ``dx = scale dS (1 - tanh^2)``: the factor ``1 - t^2`` multiplies
``dS`` and the ``scale`` is applied once to the finished ``dK`` and ``dQ``.

Base 2, as the forward: the preprocess stores ``lse_log2 = L * log2(e)`` and the kernels
compute ``P = 2^(x * scale_log2 - lse_log2)`` (one FMA and one ex2 per element; with
softcap ``P = 2^(c log2(e) t - lse_log2)``).

Empty rows (``L = -inf``): the preprocess replaces ``lse_log2 = -inf`` by 0 once per row,
so ``P = 2^(-inf - 0) = 0`` on every (masked) element of that row with no per-element
branch; the stored LSE stays -inf. Such a row has ``dQ = 0`` and adds nothing to dK, dV.
A row only ever meets its masked keys in a *boundary* tile (a full tile is one every row of
the block sees whole), so the -inf logits that make P = 0 are always there.

Out-of-bounds rows (a tile past the end of a sequence) are not empty rows: they do not
exist. Their ``lse_log2`` is loaded as ``+inf`` (``D`` as 0), so ``P = 2^(x - inf) = 0``
for any finite or -inf logit, ``dS = 0`` and they add nothing, without a mask in full
tiles. This +inf lives in registers only. Out-of-bounds keys are masked to -inf in the
ragged last key block (all its tiles take the boundary path) and never stored.

Schedule (FA-2 / Triton tutorial 06 split, deterministic by construction):

1. ``_attn_bwd_preprocess_kernel``, one program per (row block, batch x query head):
   ``D``, ``lse_log2`` and, with a sink, one partial sum of ``-2^(sink_log2 - lse_log2) D``
   per program; torch sums the partials in a fixed order, so dsink is deterministic.
2. ``_attn_bwd_dkdv_kernel``, one program per (key block, batch x kv head): keeps
   ``K_j, V_j`` and the ``dK_j, dV_j`` accumulators in registers and loops over the G query
   heads of its group and, for each, over only the query blocks that see the key block:
   with ``shift = Sk - Sq`` row i sees ``[i + shift - left, i + shift + right]``, so key
   block ``[n0, n_last]`` is seen by rows ``[n0 - shift - right, n_last - shift + left]``.
   Row blocks inside ``[n_last - shift - right, n0 - shift + left]`` see the whole key
   block (full tiles, no mask); the ones between the two ranges pay for the mask. GQA sums
   in registers, so dk/dv are written once, with no atomics and no per-head buffer. The
   ranges are the same for every head of the group, so each range is one loop over
   (head, row block) through references that span the group (3-D Q/dO and 2-D lse/delta
   descriptors): a head loop around the three row loops carried the accumulators across
   them and spilled (H200, 8k: causal GQA +19-23%, non-causal +4-9%, MHA +0-2%). Above
   head dim 128 the head loop stays (``HEAD_LOOP``): there the single loop measured slower.
3. ``_attn_bwd_dq_kernel``, one program per (row block, batch x query head), over the
   key tiles the forward visits (same three ranges). No atomics anywhere, so every
   gradient is bitwise repeatable. (dQ by float32 atomics inside the dK/dV kernel, five
   products per tile pair instead of seven, measured slower on the H200 with pointer
   atomics and with TMA reduce-adds alike: benchmarks/NOTES.md.)

On Hopper at head dim 128 (fp16/bf16, no softcap, aligned rows) the dispatcher
(``dispatch.py``) runs steps 2 and 3 by the Gluon kernels of ``bwd_sm90.py`` instead (this module
exposes the steps, :func:`prepare`, :func:`attn_bwd_dkdv` and :func:`attn_bwd_dq`, and knows
nothing of those kernels): the same math and loops, with a TMA producer warp and two
consumer warpgroups that do not meet at a barrier every tile (8-11% faster on the H200); at
head dim 256 step 3 does (8-12%).

The dK/dV tile issues ``V dO^T`` right after ``K Q^T`` (``EARLY_DP``), so the second
product runs on the tensor cores while the exponentials of the first are computed.

Memory: on Hopper, with 16-byte aligned bases and row strides, Q/dO/K/V tiles move
through in-kernel TMA descriptors over one (sequence, head) slice, which zero-fill rows
past the sequence end and columns past the head dim (59 -> 64); otherwise masked pointer
loads. Gradients are stored with masked pointer stores (once per program).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import triton
import triton.language as tl

from . import configs, options
from ._common import (
    LOG2E,
    Launch,
    alloc_scratch,
    cdiv,
    check_grid_dims,
    contiguous_strides,
    interpreting,
    key_ranges,
    load_rows,
    mask_args,
    next_pow2,
    positional,
    row_ranges,
    seq_args,
    seq_block,
    seq_bounds,
    seq_spans,
    slice_ptr,
    stats_offset,
    stride_args,
    tma_ok,
)


@triton.jit
def _store_rows(p_base, b_x, o_r, stride_r, n_rows, BLOCK_C: tl.constexpr, N_COLS: tl.constexpr):
    o_c = tl.arange(0, BLOCK_C)
    p_x = p_base + o_r[:, None].to(tl.int64) * stride_r + o_c[None, :]
    m_x = (o_r[:, None] < n_rows) & (o_c[None, :] < N_COLS)
    tl.store(p_x, b_x.to(p_x.dtype.element_ty), mask=m_x)


@triton.jit
def _zero_rows_of(x, y, cu_seqlens, seqused, batch, total, max_len, row_x, row_y,
                  HAS_Y: tl.constexpr, HAS_SEQUSED: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zeros this program's block of the packed rows (``total`` rows of ``row_x`` /
    ``row_y`` contiguous elements of ``x`` and, with HAS_Y, ``y``) that no sequence's first
    ``T`` rows cover: those of ``seq_span(cu_seqlens, b, total, max_len)``, with HAS_SEQUSED
    capped at ``seqused[b]``, exactly the rows the dQ (or dK/dV) kernels write
    (``seq_spans``; a missing sequence and a masked ``seqused`` cover nothing). Every
    sequence's span read in vectors of BLOCK_B."""
    r0 = tl.program_id(0) * BLOCK_R
    if r0 >= total:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    covered = tl.zeros([BLOCK_R], dtype=tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < batch
        s0, n = seq_spans(cu_seqlens, o_b, m_b, total, max_len)
        if HAS_SEQUSED:
            n = tl.minimum(tl.maximum(tl.load(seqused + o_b, mask=m_b, other=0), 0), n)
        inside = (rows[:, None] >= s0[None, :]) & (rows[:, None] < s0[None, :] + n[None, :])
        covered = tl.maximum(covered, tl.max(inside.to(tl.int32), 1))
    zero = (covered == 0) & (rows < total)
    if tl.max(zero.to(tl.int32), 0) == 0:
        return
    o_r = rows.to(tl.int64)[:, None]
    for c0 in range(0, row_x, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        tl.store(x + o_r * row_x + cols[None, :],
                 tl.zeros([BLOCK_R, BLOCK_C], x.dtype.element_ty),
                 mask=zero[:, None] & (cols[None, :] < row_x))
    if HAS_Y:
        for c0 in range(0, row_y, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            tl.store(y + o_r * row_y + cols[None, :],
                     tl.zeros([BLOCK_R, BLOCK_C], y.dtype.element_ty),
                     mask=zero[:, None] & (cols[None, :] < row_y))


# Counts not specialised, as the lengths of the kernels below.
@triton.jit(do_not_specialize=["batch", "total_q", "total_k", "max_len_q", "max_len_k"])
def _zero_uncovered_rows(
    dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k, batch, total_q, total_k, max_len_q,
    max_len_k, row_q, row_k, row_v,
    HAS_SEQUSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The rows of a varlen backward's gradients that no pass writes, zeroed in one launch:
    program row 0 those of ``dq`` (outside every query span), row 1 those of ``dk`` and
    ``dv`` (outside every key span capped at ``seqused_k``), by :func:`_zero_rows_of`. So
    the backward allocates its gradients unfilled and writes only the rest: the rows after
    ``cu_seqlens[-1]`` and the keys past ``seqused_k`` (none, in packed training)."""
    if tl.program_id(1) == 0:
        _zero_rows_of(dq, dq, cu_seqlens_q, cu_seqlens_q, batch, total_q, max_len_q, row_q, 0,
                      False, False, BLOCK_R, BLOCK_B, BLOCK_C)
    else:
        _zero_rows_of(dk, dv, cu_seqlens_k, seqused_k, batch, total_k, max_len_k, row_k, row_v,
                      True, HAS_SEQUSED, BLOCK_R, BLOCK_B, BLOCK_C)


# Lengths are not specialised: a length of 1 would become a constexpr, and lengths
# divisible by 16 would compile a kernel of their own.
@triton.jit(do_not_specialize=["seqlen_q", "total_q"])
def _attn_bwd_preprocess_kernel(
    out, dout, lse, dlse, delta, lse_log2, sink, dsink_part,
    cu_seqlens_q,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls,
    stride_dlb, stride_dlh, stride_dls,
    stride_tb, stride_th,
    seqlen_q, total_q, n_m, n_part,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # Grid (row block, head, batch): dims 1 and 2 stop at 65535 each.
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    # The rows seq_bounds gives the other kernels (the same clamps, no keys needed).
    bos, _, T_q, _ = seq_bounds(i_b, seqlen_q, 0, total_q, 0, cu_seqlens_q, cu_seqlens_q, None,
                                IS_VARLEN, False)
    m0 = i_m * BLOCK_M
    if m0 >= T_q:
        return
    o_m = m0 + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_m = o_m < T_q
    # Token index in int64: token * row stride overflows int32 past 2^31 elements.
    o_tok = bos + o_m.to(tl.int64)
    p_o = (out + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
           + o_tok[:, None] * stride_os + o_dv[None, :])
    p_do = (dout + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh
            + o_tok[:, None] * stride_dos + o_dv[None, :])
    m_x = m_m[:, None] & (o_dv[None, :] < DV)
    # [BLOCK_M, BLOCK_DV]
    b_o = tl.load(p_o, mask=m_x, other=0.0).to(tl.float32)
    b_do = tl.load(p_do, mask=m_x, other=0.0).to(tl.float32)
    # [BLOCK_M]
    b_lse = tl.load(lse + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh
                    + o_tok * stride_ls, mask=m_m, other=0.0)
    b_delta = tl.sum(b_o * b_do, 1)
    if dlse is not None:  # None: lse has no gradient (unused, so autograd passes none)
        b_delta -= tl.load(dlse + i_b.to(tl.int64) * stride_dlb + i_h.to(tl.int64) * stride_dlh
                           + o_tok * stride_dls, mask=m_m, other=0.0)
    # The once-per-row fix: an empty row's -inf becomes 0, so 2^(-inf - 0) = 0 downstream.
    b_lse_log2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)
    o_t = stats_offset(i_b, bos, i_h, stride_tb, stride_th) + o_m
    tl.store(delta + o_t, b_delta, mask=m_m)
    tl.store(lse_log2 + o_t, b_lse_log2, mask=m_m)
    if HAS_SINK:
        b_sink_log2 = tl.load(sink + i_h).to(tl.float32) * LOG2E
        # With a sink every L_i >= sink_h is finite, so the weight is at most 1.
        b_w = tl.where(m_m, tl.math.exp2(b_sink_log2 - b_lse_log2), 0.0)
        # One slot per program, summed by the launcher in a fixed order (deterministic).
        tl.store(dsink_part + i_h.to(tl.int64) * n_part + i_b * n_m + i_m,
                 -tl.sum(b_w * b_delta, 0))


@triton.jit
def _dkdv_mask(o_n, o_m, T_k, shift, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """``[BLOCK_N, BLOCK_M]`` visibility of key ``o_n`` to row ``o_m`` (keys past T_k hidden)."""
    m_s = o_n[:, None] < T_k
    if HAS_RIGHT:
        m_s = m_s & (o_n[:, None] <= o_m[None, :] + shift + right)
    if HAS_LEFT:
        m_s = m_s & (o_n[:, None] >= o_m[None, :] + shift - left)
    return m_s


@triton.jit
def _attn_bwd_dkdv_tile(
    b_dk, b_dv, b_k, b_v,
    q_ref, do_ref, p_lse, p_delta,
    stride_qs, stride_dos, stride_qh, stride_doh, stride_th,
    i_g, m0, o_n, T_q, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    STATS_TMA: tl.constexpr,
):
    """Rows ``[m0, m0 + BLOCK_M)`` of query head ``i_g`` of the kv head's group against the
    program's key block (the references span the group)."""
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_m = o_m < T_q
    # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV]
    if USE_TMA:
        b_q = q_ref.load([i_g, m0, 0]).reshape(BLOCK_M, BLOCK_D)
        b_do = do_ref.load([i_g, m0, 0]).reshape(BLOCK_M, BLOCK_DV)
    else:
        b_q = load_rows(q_ref + i_g.to(tl.int64) * stride_qh, o_m, m0, stride_qs, T_q,
                        BLOCK_M, BLOCK_D, D, False)
        b_do = load_rows(do_ref + i_g.to(tl.int64) * stride_doh, o_m, m0, stride_dos, T_q,
                         BLOCK_M, BLOCK_DV, DV, False)
    # [BLOCK_M]
    if STATS_TMA:
        # One TMA copy each instead of a masked load per thread and column (the scores'
        # layout replicates every row's value over many threads). Rows past the end read
        # 0: their q and dO rows are zeros too, so P = 1 there meets dO = 0 and
        # dP - delta = 0, and they add exactly nothing.
        b_lse = p_lse.load([i_g, m0]).reshape(BLOCK_M)
        b_delta = p_delta.load([i_g, m0]).reshape(BLOCK_M)
    else:
        o_t = o_m + i_g * stride_th
        # Rows past the end get +inf, so their P is 0 with no mask.
        b_lse = tl.load(p_lse + o_t, mask=m_m, other=float("inf"))
        b_delta = tl.load(p_delta + o_t, mask=m_m, other=0.0)
    # [BLOCK_N, BLOCK_M]: the transposed scores, so dK and dV come out row-major.
    b_st = tl.dot(b_k, tl.trans(b_q))
    if EARLY_DP:
        b_dpt = tl.dot(b_v, tl.trans(b_do))
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)): exact at both infinities, no NaN.
        b_t = 1.0 - 2.0 / (1.0 + tl.math.exp2(b_st * softcap_a2))
        b_st = softcap_c2 * b_t
        if MASK:
            b_st = tl.where(_dkdv_mask(o_n, o_m, T_k, shift, left, right, HAS_LEFT, HAS_RIGHT),
                            b_st, float("-inf"))
        b_pt = tl.math.exp2(b_st - b_lse[None, :])
    elif MASK:
        b_st = tl.where(_dkdv_mask(o_n, o_m, T_k, shift, left, right, HAS_LEFT, HAS_RIGHT),
                        b_st * scale_log2, float("-inf"))
        b_pt = tl.math.exp2(b_st - b_lse[None, :])
    else:
        b_pt = tl.math.exp2(b_st * scale_log2 - b_lse[None, :])
    # [BLOCK_N, BLOCK_DV]
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
    # [BLOCK_N, BLOCK_M]
    if not EARLY_DP:
        b_dpt = tl.dot(b_v, tl.trans(b_do))
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    if HAS_SOFTCAP:
        b_dst = b_dst * (1.0 - b_t * b_t)
    b_dst = b_dst.to(b_q.dtype)
    # [BLOCK_N, BLOCK_D]
    b_dk += tl.dot(b_dst, b_q)
    return b_dk, b_dv


@triton.jit
def _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M: tl.constexpr):
    """The (head, row block) after ``(i_g, m0)``: the next row block, or the next head's
    first one past ``m_hi`` (no division per tile, which would cost ~26 instructions)."""
    m0 += BLOCK_M
    wrap = m0 >= m_hi
    return i_g + wrap.to(tl.int32), tl.where(wrap, m_lo, m0)


@triton.jit
def _attn_bwd_dkdv_inner(
    b_dk, b_dv, b_k, b_v,
    q_ref, do_ref, p_lse, p_delta,
    stride_qs, stride_dos, stride_qh, stride_doh, stride_th,
    i_g0, m_lo, m_hi, o_n, T_q, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    STATS_TMA: tl.constexpr, N_HEADS: tl.constexpr,
):
    """Row blocks ``[m_lo, m_hi)`` (``m_lo`` a multiple of BLOCK_M), masked or all full, of
    the group's heads ``[i_g0, i_g0 + N_HEADS)``: one loop over (head, row block), so the
    accumulators live in a single loop; head and row block advance together."""
    n_tiles = N_HEADS * tl.cdiv(m_hi - m_lo, BLOCK_M)
    i_g = i_g0
    m0 = m_lo
    for _ in tl.range(0, n_tiles):
        m0 = tl.multiple_of(m0, BLOCK_M)
        b_dk, b_dv = _attn_bwd_dkdv_tile(
            b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
            stride_qs, stride_dos, stride_qh, stride_doh, stride_th, i_g, m0, o_n, T_q,
            T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2, D, DV, BLOCK_M,
            BLOCK_D, BLOCK_DV, MASK, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA, EARLY_DP,
            STATS_TMA,
        )
        i_g, m0 = _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M)
    return b_dk, b_dv


@triton.jit
def _attn_bwd_dkdv_ranges(
    b_dk, b_dv, b_k, b_v,
    q_ref, do_ref, p_lse, p_delta,
    stride_qs, stride_dos, stride_qh, stride_doh, stride_th,
    i_g0, m_lo, m_full_lo, m_full_hi, m_hi, o_n, T_q, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
    STATS_TMA: tl.constexpr, N_HEADS: tl.constexpr,
):
    """The three row ranges of heads ``[i_g0, i_g0 + N_HEADS)``: masked, full, masked."""
    b_dk, b_dv = _attn_bwd_dkdv_inner(
        b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
        stride_qs, stride_dos, stride_qh, stride_doh, stride_th, i_g0, m_lo, m_full_lo, o_n,
        T_q, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2, D, DV, BLOCK_M,
        BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA, EARLY_DP,
        STATS_TMA, N_HEADS,
    )
    b_dk, b_dv = _attn_bwd_dkdv_inner(
        b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
        stride_qs, stride_dos, stride_qh, stride_doh, stride_th, i_g0, m_full_lo, m_full_hi,
        o_n, T_q, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2, D, DV, BLOCK_M,
        BLOCK_D, BLOCK_DV, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA, EARLY_DP,
        STATS_TMA, N_HEADS,
    )
    if HAS_LEFT:
        b_dk, b_dv = _attn_bwd_dkdv_inner(
            b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
            stride_qs, stride_dos, stride_qh, stride_doh, stride_th, i_g0, m_full_hi, m_hi,
            o_n, T_q, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2, D, DV,
            BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA,
            EARLY_DP, STATS_TMA, N_HEADS,
        )
    return b_dk, b_dv


# Lengths are not specialised: a length of 1 would become a constexpr, and lengths
# divisible by 16 would compile a kernel of their own.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_bwd_dkdv_kernel(
    q, k, v, dout, lse_log2, delta, dk, dv,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_tb, stride_th,
    seqlen_q, seqlen_k, total_q, total_k,
    left, right,
    scale, scale_log2, softcap_a2, softcap_c2,
    GROUP: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr, STATS_TMA: tl.constexpr,
    HEAD_LOOP: tl.constexpr,
):
    # Key block 0 is seen by the most rows under a causal mask: the longest work starts first.
    # Grid (key block, kv head, batch): dims 1 and 2 stop at 65535 each.
    i_n = tl.program_id(0)
    i_hk = tl.program_id(1)
    i_b = tl.program_id(2)
    # seq_block's order (n_last and shift before the return) spilled more here in the sm_90
    # compile (96 -> 104 bytes at D = 128, 40 -> 96 at D = 256): the same steps, after it.
    bos, bos_k, T_q, T_k = seq_bounds(i_b, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
                                       seqused_k, IS_VARLEN, HAS_SEQUSED_K)
    n0 = i_n * BLOCK_N
    if n0 >= T_k:
        return
    n_last = tl.minimum(n0 + BLOCK_N, T_k) - 1
    shift = T_k - T_q
    o_n = n0 + tl.arange(0, BLOCK_N)

    p_k = slice_ptr(k, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh)
    p_v = slice_ptr(v, i_b, bos_k, i_hk, stride_vb, stride_vs, stride_vh)
    if USE_TMA:
        k_ref = tl.make_tensor_descriptor(p_k, shape=[tl.maximum(T_k, 1), D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_ref = tl.make_tensor_descriptor(p_v, shape=[tl.maximum(T_k, 1), DV], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_ref = p_k
        v_ref = p_v
    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    b_k = load_rows(k_ref, o_n, n0, stride_ks, T_k, BLOCK_N, BLOCK_D, D, USE_TMA)
    b_v = load_rows(v_ref, o_n, n0, stride_vs, T_k, BLOCK_N, BLOCK_DV, DV, USE_TMA)

    m_lo, m_full_lo, m_full_hi, m_hi = row_ranges(n0, n_last, T_q, T_k, shift, left, right,
                                                  BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # GQA: the G query heads of this kv head accumulate into the same registers. Every
    # reference spans the group (heads i_hk * G ... i_hk * G + G - 1), and each mask range
    # is one loop over (head, row block): a loop over the heads around the three row loops
    # carried the accumulators across them and spilled (sm_90 compile, benchmarks/NOTES.md).
    i_h0 = i_hk * GROUP
    p_q = slice_ptr(q, i_b, bos, i_h0, stride_qb, stride_qs, stride_qh)
    p_do = slice_ptr(dout, i_b, bos, i_h0, stride_dob, stride_dos, stride_doh)
    o_t = stats_offset(i_b, bos, i_h0, stride_tb, stride_th)
    p_lse = lse_log2 + o_t
    p_delta = delta + o_t
    if STATS_TMA:
        # The launcher starts each (sequence, head) row of lse_log2 and delta at a 16-byte
        # boundary, as TMA needs (``stats_offset``).
        p_lse = tl.make_tensor_descriptor(p_lse, shape=[GROUP, tl.maximum(T_q, 1)],
                                          strides=[stride_th, 1], block_shape=[1, BLOCK_M])
        p_delta = tl.make_tensor_descriptor(p_delta, shape=[GROUP, tl.maximum(T_q, 1)],
                                            strides=[stride_th, 1], block_shape=[1, BLOCK_M])
    if USE_TMA:
        q_ref = tl.make_tensor_descriptor(p_q, shape=[GROUP, tl.maximum(T_q, 1), D],
                                          strides=[stride_qh, stride_qs, 1],
                                          block_shape=[1, BLOCK_M, BLOCK_D])
        do_ref = tl.make_tensor_descriptor(p_do, shape=[GROUP, tl.maximum(T_q, 1), DV],
                                           strides=[stride_doh, stride_dos, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_DV])
    else:
        q_ref = p_q
        do_ref = p_do
    if HEAD_LOOP:
        # A loop over the heads around the three ranges: at head dims above 128 the tile
        # sits at the register cap and this allocates better (H200, D = 256, G = 4: the
        # group-wide loop ran 12-18% slower, benchmarks/NOTES.md).
        for i_g in range(GROUP):
            b_dk, b_dv = _attn_bwd_dkdv_ranges(
                b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
                stride_qs, stride_dos, stride_qh, stride_doh, stride_th, i_g, m_lo, m_full_lo,
                m_full_hi, m_hi, o_n, T_q, T_k, shift, left, right, scale_log2, softcap_a2,
                softcap_c2, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT,
                HAS_SOFTCAP, USE_TMA, EARLY_DP, STATS_TMA, 1,
            )
    else:
        b_dk, b_dv = _attn_bwd_dkdv_ranges(
            b_dk, b_dv, b_k, b_v, q_ref, do_ref, p_lse, p_delta,
            stride_qs, stride_dos, stride_qh, stride_doh, stride_th, 0, m_lo, m_full_lo,
            m_full_hi, m_hi, o_n, T_q, T_k, shift, left, right, scale_log2, softcap_a2,
            softcap_c2, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            USE_TMA, EARLY_DP, STATS_TMA, GROUP,
        )

    p_dk = slice_ptr(dk, i_b, bos_k, i_hk, stride_dkb, stride_dks, stride_dkh)
    p_dv = slice_ptr(dv, i_b, bos_k, i_hk, stride_dvb, stride_dvs, stride_dvh)
    _store_rows(p_dk, b_dk * scale, o_n, stride_dks, T_k, BLOCK_D, D)
    _store_rows(p_dv, b_dv, o_n, stride_dvs, T_k, BLOCK_DV, DV)


@triton.jit
def _attn_bwd_dq_tile(
    b_dq, b_q, b_do, b_lse, b_delta,
    k_ref, v_ref, stride_ks, stride_vs,
    n0, o_m, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
):
    """One key tile ``[n0, n0 + BLOCK_N)`` of the program's row block."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
    b_k = load_rows(k_ref, o_n, n0, stride_ks, T_k, BLOCK_N, BLOCK_D, D, USE_TMA)
    b_v = load_rows(v_ref, o_n, n0, stride_vs, T_k, BLOCK_N, BLOCK_DV, DV, USE_TMA)
    # [BLOCK_M, BLOCK_N]
    b_s = tl.dot(b_q, tl.trans(b_k))
    if EARLY_DP:
        b_dp = tl.dot(b_do, tl.trans(b_v))
    if MASK:
        m_s = o_n[None, :] < T_k
        if HAS_RIGHT:
            m_s = m_s & (o_n[None, :] <= o_m[:, None] + shift + right)
        if HAS_LEFT:
            m_s = m_s & (o_n[None, :] >= o_m[:, None] + shift - left)
    if HAS_SOFTCAP:
        b_t = 1.0 - 2.0 / (1.0 + tl.math.exp2(b_s * softcap_a2))
        b_s = softcap_c2 * b_t
        if MASK:
            b_s = tl.where(m_s, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
    elif MASK:
        b_s = tl.where(m_s, b_s * scale_log2, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
    else:
        b_p = tl.math.exp2(b_s * scale_log2 - b_lse[:, None])
    # [BLOCK_M, BLOCK_N]
    if not EARLY_DP:
        b_dp = tl.dot(b_do, tl.trans(b_v))
    b_ds = b_p * (b_dp - b_delta[:, None])
    if HAS_SOFTCAP:
        b_ds = b_ds * (1.0 - b_t * b_t)
    # [BLOCK_M, BLOCK_D]
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
    return b_dq


@triton.jit
def _attn_bwd_dq_inner(
    b_dq, b_q, b_do, b_lse, b_delta,
    k_ref, v_ref, stride_ks, stride_vs,
    n_lo, n_hi, o_m, T_k, shift, left, right,
    scale_log2, softcap_a2, softcap_c2,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
):
    """Key tiles ``[n_lo, n_hi)`` (``n_lo`` a multiple of BLOCK_N), masked or all full."""
    for n0 in tl.range(n_lo, n_hi, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        b_dq = _attn_bwd_dq_tile(
            b_dq, b_q, b_do, b_lse, b_delta, k_ref, v_ref, stride_ks, stride_vs,
            n0, o_m, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2,
            D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, MASK, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            USE_TMA, EARLY_DP,
        )
    return b_dq


# Lengths are not specialised: a length of 1 would become a constexpr, and lengths
# divisible by 16 would compile a kernel of their own.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k"])
def _attn_bwd_dq_kernel(
    q, k, v, dout, lse_log2, delta, dq,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_tb, stride_th,
    seqlen_q, seqlen_k, total_q, total_k,
    left, right,
    scale, scale_log2, softcap_a2, softcap_c2,
    GROUP: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    USE_TMA: tl.constexpr, EARLY_DP: tl.constexpr,
):
    # Last row block first: under a causal mask it sees the most keys.
    # Grid (row block, query head, batch): dims 1 and 2 stop at 65535 each.
    i_m = tl.cdiv(seqlen_q, BLOCK_M) - 1 - tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    i_hk = i_h // GROUP
    bos, bos_k, T_q, T_k, i_m, m0, m_last, shift = seq_block(
        i_b, i_m, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k,
        BLOCK_M, False, False, IS_VARLEN, HAS_SEQUSED_K)
    if m0 >= T_q:
        return
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_m = o_m < T_q

    p_q = slice_ptr(q, i_b, bos, i_h, stride_qb, stride_qs, stride_qh)
    p_do = slice_ptr(dout, i_b, bos, i_h, stride_dob, stride_dos, stride_doh)
    p_k = slice_ptr(k, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh)
    p_v = slice_ptr(v, i_b, bos_k, i_hk, stride_vb, stride_vs, stride_vh)
    if USE_TMA:
        q_ref = tl.make_tensor_descriptor(p_q, shape=[tl.maximum(T_q, 1), D], strides=[stride_qs, 1],
                                          block_shape=[BLOCK_M, BLOCK_D])
        do_ref = tl.make_tensor_descriptor(p_do, shape=[tl.maximum(T_q, 1), DV], strides=[stride_dos, 1],
                                           block_shape=[BLOCK_M, BLOCK_DV])
        k_ref = tl.make_tensor_descriptor(p_k, shape=[tl.maximum(T_k, 1), D], strides=[stride_ks, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_ref = tl.make_tensor_descriptor(p_v, shape=[tl.maximum(T_k, 1), DV], strides=[stride_vs, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        q_ref = p_q
        do_ref = p_do
        k_ref = p_k
        v_ref = p_v

    # Key tiles seen by some row of the block, and their full middle, as in the forward.
    n_lo, n_full_lo, n_full_hi, n_hi = key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N,
                                                  HAS_LEFT, HAS_RIGHT)

    # [BLOCK_M, BLOCK_D], [BLOCK_M, BLOCK_DV]
    b_q = load_rows(q_ref, o_m, m0, stride_qs, T_q, BLOCK_M, BLOCK_D, D, USE_TMA)
    b_do = load_rows(do_ref, o_m, m0, stride_dos, T_q, BLOCK_M, BLOCK_DV, DV, USE_TMA)
    o_t = stats_offset(i_b, bos, i_h, stride_tb, stride_th) + o_m
    # [BLOCK_M]; rows past the end get +inf, so their P is 0.
    b_lse = tl.load(lse_log2 + o_t, mask=m_m, other=float("inf"))
    b_delta = tl.load(delta + o_t, mask=m_m, other=0.0)
    # [BLOCK_M, BLOCK_D]
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_LEFT:
        b_dq = _attn_bwd_dq_inner(
            b_dq, b_q, b_do, b_lse, b_delta, k_ref, v_ref, stride_ks, stride_vs,
            n_lo, n_full_lo, o_m, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2,
            D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA,
            EARLY_DP,
        )
    b_dq = _attn_bwd_dq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, k_ref, v_ref, stride_ks, stride_vs,
        n_full_lo, n_full_hi, o_m, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA,
        EARLY_DP,
    )
    b_dq = _attn_bwd_dq_inner(
        b_dq, b_q, b_do, b_lse, b_delta, k_ref, v_ref, stride_ks, stride_vs,
        n_full_hi, n_hi, o_m, T_k, shift, left, right, scale_log2, softcap_a2, softcap_c2,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, USE_TMA,
        EARLY_DP,
    )
    p_dq = slice_ptr(dq, i_b, bos, i_h, stride_dqb, stride_dqs, stride_dqh)
    _store_rows(p_dq, b_dq * scale, o_m, stride_dqs, T_q, BLOCK_D, D)


def _tune_prune(configs, named_args, **kwargs):
    # Drop tiles whose K/V (or Q/dO) stages alone exceed the H200's 227 KB of shared memory.
    bd, bdv = named_args.get("BLOCK_D", kwargs.get("BLOCK_D")), named_args.get(
        "BLOCK_DV", kwargs.get("BLOCK_DV"))
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        smem = 2 * (bd + bdv) * (c.num_stages * min(bm, bn) + max(bm, bn))
        if smem <= 200 * 1024:
            keep.append(c)
    return keep or configs[:1]


def _tuned(kernel, candidates):
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
               for bm, bn, w, s in candidates]
    return triton.autotune(
        configs=configs,
        key=["BLOCK_D", "BLOCK_DV", "HAS_LEFT", "HAS_RIGHT", "HAS_SOFTCAP", "GROUP"],
        prune_configs_by={"early_config_prune": _tune_prune},
    )(kernel)


_attn_bwd_dkdv_tuned = _tuned(_attn_bwd_dkdv_kernel, configs.BWD_DKDV_TUNE)
_attn_bwd_dq_tuned = _tuned(_attn_bwd_dq_kernel, configs.BWD_DQ_TUNE)


def _launch(kernel, tuned, cfg, n, block, n_heads, batch, args):
    """One program per ``block`` rows of ``n``, per head and per sequence: grid (blocks,
    heads, batch), blocks fastest; with the tiles of ``cfg`` (a ``TileConfig``), or
    autotuned when ``cfg`` is None. Heads and batch get a grid dim each (CUDA stops dims
    1 and 2 at 65535; batch x heads in one dim passed that with a few thousand sequences)."""
    if cfg is None:
        tuned[lambda meta: (triton.cdiv(n, meta[block]), n_heads, batch)](**args)
        return
    kernel[(cdiv(n, cfg.block_m if block == "BLOCK_M" else cfg.block_n), n_heads, batch)](
        **args,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **cfg.launch(),
    )


@dataclasses.dataclass(slots=True)
class BwdPass:
    """One backward call after :func:`prepare`: the gradients' buffers, ``delta`` and
    ``lse_log2`` written by the preprocess kernel, the tensors every dK/dV and dQ launcher
    takes (this module's and ``bwd_sm90``'s; ``dispatch.attn_bwd`` picks) and the call's
    launch plan (:class:`BwdPlan`: everything else, from the call's metadata).

    ``empty``: no row to compute (the gradients are zeros, nothing else is set).
    ``dkdv_args`` / ``dq_args``: the kernels' keyword arguments (``dkdv_args`` None when
    there is no key). ``signature``: the values the kernels' constexpr flags come from
    (dtype, masks, varlen, seqused_k, GQA group), which names a compilation."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    sink: torch.Tensor | None
    dsink_part: torch.Tensor | None
    empty: bool = False
    opts: options.KernelOptions | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    dout: torch.Tensor | None = None
    lse_log2: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    plan: BwdPlan | None = None

    def grads(self):
        """``dq, dk, dv, dsink`` once the dK/dV and dQ launchers have run (dsink: the
        preprocess kernel's partial sums, summed in a fixed order)."""
        if self.sink is None:
            return self.dq, self.dk, self.dv, None
        if self.empty:
            return self.dq, self.dk, self.dv, torch.zeros_like(self.sink, dtype=torch.float32)
        return self.dq, self.dk, self.dv, self.dsink_part.sum(1)

    def _tensors(self):
        return dict(q=self.q, k=self.k, v=self.v, dout=self.dout, lse_log2=self.lse_log2,
                    delta=self.delta, cu_seqlens_q=self.cu_seqlens_q,
                    cu_seqlens_k=self.cu_seqlens_k, seqused_k=self.seqused_k)

    def dkdv_tensors(self) -> tuple:
        """The dK/dV kernels' tensor arguments, in their order (this module's and bwd_sm90's)."""
        return (self.q, self.k, self.v, self.dout, self.lse_log2, self.delta, self.dk, self.dv,
                self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k)

    def dq_tensors(self) -> tuple:
        """The dQ kernels' tensor arguments, in their order."""
        return (self.q, self.k, self.v, self.dout, self.lse_log2, self.delta, self.dq,
                self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k)

    @property
    def has_keys(self) -> bool:
        """A dK/dV pass to run (some sequence has keys): ``dkdv_args`` without building it."""
        return self.plan.dkdv_kw is not None

    @property
    def dkdv_args(self) -> dict | None:
        if self.plan.dkdv_kw is None:
            return None
        return {**self._tensors(), "dk": self.dk, "dv": self.dv, **self.plan.dkdv_kw}

    @property
    def dq_args(self) -> dict:
        return {**self._tensors(), "dq": self.dq, **self.plan.dq_kw}


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """Everything of a backward call but its tensors, from the call's metadata."""

    empty: bool
    padded: tuple
    n_last: int
    n_part: int
    softcap: float = 0.0
    batch: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0
    hq: int = 0
    hkv: int = 0
    signature: tuple = ()
    dkdv_cfg: configs.TileConfig | None = None
    dq_cfg: configs.TileConfig | None = None
    tune: bool = False
    set_allocator: bool = False
    # The preprocess kernel's launch.
    pre_run: Launch | None = None
    # The dK/dV and dQ kernels' non-tensor keywords (dkdv_kw None: no key), and their
    # portable launches (None: autotuned).
    dkdv_kw: dict | None = None
    dq_kw: dict | None = None
    dkdv_run: Launch | None = None
    dq_run: Launch | None = None
    # Varlen: the launch that zeros the rows of dq, dk and dv no pass writes.
    zero_run: Launch | None = None
    # Launches other kernel modules plan for this call (bwd_sm90's), by name, kept with it.
    launches: dict = dataclasses.field(default_factory=dict, compare=False)


# The properties of a prepared call that its plan holds.
for _name in ("softcap", "batch", "seqlen_q", "seqlen_k", "hq", "hkv", "signature", "dkdv_cfg",
              "dq_cfg", "tune"):
    setattr(BwdPass, _name, property(operator.attrgetter(f"plan.{_name}")))

# Launch plans of prepare by call metadata; cleared when full.
_BWD_PLANS: dict = {}
_MAX_PLANS = 4096


def prepare(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, kept=None) -> BwdPass:
    """The backward up to dK/dV and dQ: the gradients' buffers, the preprocess kernel (``D``,
    ``lse_log2``, dsink's partial sums) and the arguments of the two passes, with their tiles
    (configs.py and ``KernelOptions.bwd_config``). Arguments as :func:`attn_bwd`.

    Everything but the tensors' addresses is a function of the call's metadata: a repeated
    call finds its :class:`BwdPlan` in ``_BWD_PLANS`` and only allocates and launches.
    ``kept``: the forward's key in ``ops.attention._KEPT``, a function of every input's
    metadata, the scalars and the forward's outputs' layout, so that the plan's key needs
    only the gradients' metadata beside it."""
    device = q.device
    # Autograd may hand over an expanded gradient (stride 0), which TMA cannot describe.
    st = dout.stride()
    if st[-1] != 1 or 0 in st:
        dout = dout.contiguous()
        st = dout.stride()
    opts = options.current()
    # Shapes, strides, dtypes, device; whether the TMA operands are 16-byte aligned; which
    # optional tensors there are; the scalars and the options the plan reads (a bwd_config
    # override too: a plan made under one is found again under the same one).
    try:
        if kept is not None:
            key = (kept, dout.shape, st, dout.dtype,
                   None if dlse is None else dlse.stride(), dout.data_ptr() % 16 == 0,
                   opts.autotune_bwd, configs.override_key(opts.bwd_config))
        else:
            key = (q.shape, q.stride(), q.dtype, device, k.shape, k.stride(), k.dtype,
                   v.shape, v.stride(), v.dtype, dout.shape, st, dout.dtype,
                   out.stride(), lse.shape, lse.stride(),
                   None if dlse is None else dlse.stride(),
                   (q.data_ptr() | k.data_ptr() | v.data_ptr() | dout.data_ptr()) % 16 == 0,
                   None if cu_seqlens_q is None else (cu_seqlens_q.shape, max_seqlen_q,
                                                      max_seqlen_k),
                   seqused_k is None, sink is None, left, right, softcap, scale,
                   opts.autotune_bwd, configs.override_key(opts.bwd_config))
    except TypeError:  # an override that does not hash: planned every call
        key = None
    plan = None if key is None else _BWD_PLANS.get(key)
    if plan is None:
        plan = _bwd_plan(dout, dlse, q, k, v, out, lse, left=left, right=right,
                         softcap=softcap, scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, opts=opts)
        if key is not None:
            if len(_BWD_PLANS) >= _MAX_PLANS:
                _BWD_PLANS.clear()
            _BWD_PLANS[key] = plan
    # Varlen: rows outside every sequence (and keys past seqused_k) get zero gradients, from
    # the zeroing launch below (not a fill of the whole tensors: 4% of a 16k-token step).
    dq = options.empty_like(q, opts)
    dk = options.empty_like(k, opts)
    dv = options.empty_like(v, opts)
    # D and lse_log2 in the layout of a contiguous lse, each row padded to 16 bytes so
    # that the dK/dV kernel can fetch a row block of them by TMA.
    # One allocation for both (one allocator call less a backward).
    stats = torch.empty((2, *plan.padded), dtype=torch.float32, device=device)
    if plan.n_last != plan.padded[-1]:
        stats = stats[..., :plan.n_last]
    delta, lse_log2 = stats.unbind(0)
    dsink_part = (torch.zeros((q.shape[-2], plan.n_part), dtype=torch.float32, device=device)
                  if sink is not None else None)
    if plan.empty:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return BwdPass(dq, dk, dv, sink, dsink_part, empty=True)
    if plan.zero_run is not None:
        plan.zero_run(dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k)
    if plan.set_allocator:
        triton.set_allocator(alloc_scratch)
    plan.pre_run(out, dout, lse, dlse, delta, lse_log2, sink, dsink_part, cu_seqlens_q)
    return BwdPass(dq, dk, dv, sink, dsink_part, False, opts, q, k, v, dout, lse_log2, delta,
                   cu_seqlens_q, cu_seqlens_k, seqused_k, plan)


def _bwd_plan(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
              cu_seqlens_q, max_seqlen_q, max_seqlen_k, seqused_k, opts) -> BwdPlan:
    """:func:`prepare`'s plan: everything it and the two passes' launchers pass the kernels
    but the tensors (whose strides it reads: dq, dk, dv are fresh contiguous tensors shaped
    as q, k, v; delta and lse_log2 as planned here)."""
    is_varlen = cu_seqlens_q is not None
    n_seq = cu_seqlens_q.numel() - 1 if is_varlen else q.shape[0]
    check_grid_dims("the backward kernels", n_seq, q.shape[-2])
    d, dv_dim = q.shape[-1], v.shape[-1]
    hq, hkv = q.shape[-2], k.shape[-2]
    override = opts.bwd_config or {}
    batch, lens = seq_args(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    seqlen_q, seqlen_k = lens["seqlen_q"], lens["seqlen_k"]
    # delta and lse_log2: rows padded to 16 bytes; varlen rows hold each sequence from a
    # 16-byte boundary (``stats_offset``), 4 elements of room a sequence.
    n_last = lse.shape[-1] + (4 * batch if is_varlen else 0)
    padded = (*lse.shape[:-1], (n_last + 3) // 4 * 4)
    st_pad = contiguous_strides(padded)
    st_b, st_h = (4, st_pad[0]) if is_varlen else (st_pad[0], st_pad[1])

    n_m_pre = cdiv(max(seqlen_q, 1), configs.BWD_PREPROCESS.block_m)
    n_part = batch * n_m_pre
    if q.shape[0] == 0 or batch == 0 or seqlen_q == 0:
        return BwdPlan(True, padded, n_last, n_part)  # no row (q.shape[0] is B or total_q)

    scale = float(scale)
    softcap = float(softcap or 0.0)
    block_d = max(next_pow2(d), 16)
    block_dv = max(next_pow2(dv_dim), 16)
    key_d = max(block_d, block_dv)
    interpret = interpreting()
    # The tiles and switches of both passes (configs.py), with KernelOptions.bwd_config's.
    dkdv_cfg, dq_cfg = configs.bwd_configs(key_d, is_varlen, interpret)
    dkdv_cfg = configs.override(dkdv_cfg, override, configs.BWD_KEYS, part="dkdv",
                                what="bwd_config")
    dq_cfg = configs.override(dq_cfg, override, configs.BWD_KEYS, part="dq", what="bwd_config")
    # No descriptor over an empty tensor (its base address may be null).
    use_tma = (dq_cfg.use_tma and min(q.numel(), k.numel(), v.numel()) > 0
               and tma_ok(q, k, v, dout))

    pre_run = Launch(_attn_bwd_preprocess_kernel, (n_m_pre, hq, batch),
                     *positional(_attn_bwd_preprocess_kernel, 9, dict(
        **stride_args("bsh", is_varlen, o=out, do=dout),
        # No dlse: its strides are not read (lse's stand in).
        **stride_args("bhs", is_varlen, l=lse, dl=lse if dlse is None else dlse),
        stride_tb=st_b,
        stride_th=st_h,
        seqlen_q=seqlen_q,
        total_q=lens["total_q"],
        n_m=n_m_pre,
        n_part=n_part,
        DV=dv_dim,
        BLOCK_M=configs.BWD_PREPROCESS.block_m,
        BLOCK_DV=block_dv,
        HAS_SINK=sink is not None,
        IS_VARLEN=is_varlen,
        **configs.BWD_PREPROCESS.launch(),
    )))

    # dq, dk, dv: fresh tensors shaped as q, k, v (contiguous strides).
    st_dq, st_dk, st_dv = (contiguous_strides(t.shape) for t in (q, k, v))
    lead = (lambda st: (0, st[0], st[1])) if is_varlen else (lambda st: st[:3])
    common = dict(
        **stride_args("bsh", is_varlen, q=q, k=k, v=v, do=dout),
        stride_tb=st_b,
        stride_th=st_h,
        **lens,
        scale=scale,
        **mask_args(left, right, scale, softcap),
        GROUP=hq // hkv,
        D=d,
        DV=dv_dim,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        IS_VARLEN=is_varlen,
        HAS_SEQUSED_K=seqused_k is not None,
        USE_TMA=use_tma,
        EARLY_DP=bool(dq_cfg.early_dp),
    )
    tune = (opts.autotune_bwd and not interpret and "dkdv" not in override
            and "dq" not in override)
    dkdv_kw = dkdv_run = None
    if seqlen_k > 0:
        dkdv_kw = dict(
            **dict(zip(("stride_dkb", "stride_dks", "stride_dkh"), lead(st_dk))),
            **dict(zip(("stride_dvb", "stride_dvs", "stride_dvh"), lead(st_dv))),
            # lse_log2 and delta by TMA (each sequence's rows start 16-byte aligned).
            STATS_TMA=bool(use_tma and dkdv_cfg.stats_tma),
            # One loop per range over the whole group up to head dim 128; a head loop above.
            HEAD_LOOP=bool(dkdv_cfg.head_loop),
            **common,
        )
        if not tune:
            dkdv_run = _portable(_attn_bwd_dkdv_kernel, 11, dkdv_kw, dkdv_cfg,
                                    (cdiv(seqlen_k, dkdv_cfg.block_n), hkv, batch))
    dq_kw = dict(**dict(zip(("stride_dqb", "stride_dqs", "stride_dqh"), lead(st_dq))),
                 **common)
    dq_run = None
    if not tune:
        dq_run = _portable(_attn_bwd_dq_kernel, 10, dq_kw, dq_cfg,
                              (cdiv(seqlen_q, dq_cfg.block_m), hq, batch))
    return BwdPlan(
        False, padded, n_last, n_part, softcap=softcap, batch=batch, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, hq=hq, hkv=hkv,
        signature=(q.dtype, left is None, right is None, is_varlen, seqused_k is None,
                   hq // hkv),
        dkdv_cfg=dkdv_cfg, dq_cfg=dq_cfg, tune=tune,
        set_allocator=use_tma and not interpret,
        pre_run=pre_run, dkdv_kw=dkdv_kw, dq_kw=dq_kw, dkdv_run=dkdv_run, dq_run=dq_run,
        zero_run=(_zero_launch(q, k, v, batch, seqlen_q, seqlen_k, seqused_k is not None)
                  if is_varlen else None))


def _zero_launch(q, k, v, batch, max_len_q, max_len_k, has_seqused) -> Launch:
    """The launch of :func:`_zero_uncovered_rows` over gradients shaped as packed ``q``,
    ``k``, ``v``, contiguous: tensors ``(dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
    seqused_k)``."""
    row_q, row_k, row_v = (math.prod(t.shape[1:]) for t in (q, k, v))
    block_c = min(next_pow2(max(row_q, row_k, row_v, 16)), 64)
    return Launch(_zero_uncovered_rows, (cdiv(max(q.shape[0], k.shape[0], 1), 64), 2),
                  *positional(_zero_uncovered_rows, 6, dict(
                      batch=batch, total_q=q.shape[0], total_k=k.shape[0], max_len_q=max_len_q,
                      max_len_k=max_len_k, row_q=row_q, row_k=row_k, row_v=row_v,
                      HAS_SEQUSED=has_seqused, BLOCK_R=64, BLOCK_B=32, BLOCK_C=block_c,
                      num_warps=4)))


def _portable(kernel, n_tensors, kw, cfg, grid) -> Launch:
    """The launch of a portable pass with the tiles of ``cfg`` (as :func:`_launch` runs it)."""
    return Launch(kernel, grid, *positional(kernel, n_tensors, dict(
        **kw, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **cfg.launch())))


def attn_bwd_dkdv(p: BwdPass) -> None:
    """dK and dV by this module's kernel (``p.has_keys``: there are keys)."""
    if p.plan.dkdv_run is None:
        _launch(_attn_bwd_dkdv_kernel, _attn_bwd_dkdv_tuned, None, p.seqlen_k, "BLOCK_N",
                p.hkv, p.batch, p.dkdv_args)
        return
    p.plan.dkdv_run(*p.dkdv_tensors())


def attn_bwd_dq(p: BwdPass) -> None:
    """dQ by this module's kernel."""
    if p.plan.dq_run is None:
        _launch(_attn_bwd_dq_kernel, _attn_bwd_dq_tuned, None, p.seqlen_q, "BLOCK_M", p.hq,
                p.batch, p.dq_args)
        return
    p.plan.dq_run(*p.dq_tensors())


def attn_bwd(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
             deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, seqused_k=None):
    """``dq, dk, dv, dsink`` of ``(out, lse) = attention(q, k, v)`` given ``dout`` and ``dlse``,
    by this module's kernels (``dispatch.attn_bwd`` picks them or the Hopper ones per pass).

    ``dS = P (dO V^T - D)`` with ``P = exp(S - lse)`` and ``D = rowsum(dO * O) - dlse``.
    Inputs are assumed valid (ops/ validates); any strides with the last one 1.

    Args:
        dout: ``(B, Sq, Hq, Dv)`` (varlen ``(total_q, Hq, Dv)``), the gradient of out.
        dlse: ``(B, Hq, Sq)`` (varlen ``(Hq, total_q)``) float32, the gradient of lse, or None.
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)`` (varlen: no B).
        out: ``(B, Sq, Hq, Dv)`` and lse: ``(B, Hq, Sq)`` float32 natural log (with the sink,
            -inf on empty rows), as the forward returned them.
        left, right: window bounds (int >= 0) or None for unbounded; causal is ``right=0``.
        softcap: ``c > 0`` for ``c * tanh(s / c)``; 0 is off. scale: multiplies ``q . k``.
        sink: ``(Hq,)`` float32 logits or None.
        deterministic: accepted for the API; the kernels use no atomics, so the
            gradients are bitwise repeatable either way.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 (varlen); max_seqlen_q, max_seqlen_k:
            ints; seqused_k: ``(B,)`` int32 or None.

    Returns:
        ``dq, dk, dv`` shaped and typed as ``q, k, v``, and ``dsink (Hq,)`` float32 or None.
    """
    p = prepare(dout, dlse, q, k, v, out, lse, left=left, right=right, softcap=softcap,
                scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    if not p.empty:
        if p.has_keys:
            attn_bwd_dkdv(p)
        attn_bwd_dq(p)
    return p.grads()
