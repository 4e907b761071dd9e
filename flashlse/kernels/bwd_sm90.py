"""Hopper dK/dV and dQ: two consumer warpgroups and a TMA producer warp each (Gluon).

On by default inside their domain (``KernelOptions.sm90_dkdv`` / ``sm90_dq`` turn them
off); a triton that cannot compile them warns once and runs ``bwd.py``'s kernels. H200,
bf16, D = 128 (per-kernel device time, benchmarks/RESULTS.md, S = 4k / 8k): dQ 15-20%
faster than ``bwd.py``'s, dK/dV from 2% slower (8k non-causal, one run) to 7% faster; both
together 8-11%. A call that is not ``deterministic`` runs one pass instead at D = 64 and
128 (``FUSED_DQ``: dQ added by TMA reduces from the dK/dV kernel), 0-9% faster again at
D = 128, 0.5-6% at D = 64. Dense calls hand the dK/dV kernel TMA descriptors made on the
host (``HOST_DESC``; each program made ten in global memory before): fwd+bwd 3-19% faster
again, the most at S = 1k where a program has the fewest tiles. Varlen calls keep the
per-program descriptors (they clip at each sequence's end).

dQ (``_dq_sm90_kernel``) is the forward's program (fwd_sm90.py: 128 query rows in two
halves, K/V ring) with the backward's row math: ``S = Q K^T`` and ``dP = dO V^T`` issued
together, ``P = 2^(S scale_log2 - lse_log2)``, ``dS = P (dP - delta)``, ``dQ += dS K``;
lse and delta are two registers a thread there (rows, not columns). dK/dV follows.

The same math as ``bwd.py``'s ``_attn_bwd_dkdv_kernel`` (its docstring has it), the schedule of
``fwd_sm90.py``: the forward gained 15-30% on the H200 once the two warpgroups of a block
stopped meeting at a barrier every tile, and the ``tl`` dK/dV kernel has the same barrier.

A program owns a 128-key block of one (sequence, kv head), split into two 64-key halves, one
per 4-warp consumer partition holding its ``dK, dV`` (64 x 128 each, float32) in registers.
A 1-warp producer loads the K and V halves once, then ``Q_i, dO_i`` tiles (64 rows) of every
query head of the group, with their ``lse_log2`` and ``delta``, into a ring of
STAGES buffers (full / empty mbarriers; empty takes both consumers' arrivals). Per tile a
consumer issues ``S^T = K Q^T``, computes ``P^T``, issues ``dP^T = V dO^T`` and
``dV += P^T dO`` together, then ``dK += dS^T Q`` with ``P^T, dS^T`` from registers. lse and
delta are read from shared memory where they are used: in the transposed scores' layout they
are 16 registers each a thread, and holding them through a tile spilled (by pointer loads the
kernel was 15% slower).

Empty and out-of-bounds rows as in ``bwd.py``: the preprocess stores ``lse_log2 = 0`` for an
empty row (its masked logits are -inf, so P = 0). Rows past the sequence end are TMA
zero-fill in Q and dO, and in lse / delta too (or ``+inf`` / 0 with ``STATS_TMA`` off):
either way they add nothing. Masks only on boundary tiles (``row_ranges``).

At D = 256 two [64, 256] float32 accumulators a warpgroup would not fit in registers, so the
kernel splits the products by role instead (``ROLE_SPLIT``): a program owns 64 keys, one
warpgroup computes ``S^T``, the masked ``P^T`` and ``dV += P^T dO``, the other ``dP^T``, then
``dS^T = P^T (dP^T - delta)`` and ``dK += dS^T Q``, with ``P^T`` passed between them through a
two-slot float32 ring in shared memory. Each holds one accumulator (128 registers a thread),
both issue two products a tile, and neither waits on the other but for ``P^T``. H200, bf16
(RESULTS.md session 33): the public backward 1.05-1.27x cuDNN at S = 1k-16k, 1.53-1.76x the
fwd+bwd on bwd.py's dK/dV.

Domain: sm_90, fp16/bf16, D == Dv in (64, 128, 256) (dQ: 128 or 256; the fused pass: 128), no
softcap, 16-byte aligned rows (q, k, v, dout, dk, dv); every mask, GQA and varlen.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import configs, fwd_sm90
from ._common import (
    DescLaunch,
    Launch,
    alloc_scratch,
    capability,
    cdiv,
    positional,
    row_ranges,
    stats_offset,
    tma_ok,
)
from .fwd_sm90 import (
    HALF_M,
    _dense_item,
    _item_span,
    _key_ranges,
    _kv_ring,
    _persistent_buffers,
    _producer_persistent,
    _row_block,
    _seq_block,
    _slice_ptr,
    _wgmma_layout,
)
from .fwd_sm90 import _producer as _fwd_producer

if TYPE_CHECKING:
    from .bwd import BwdPass

_row_ranges = gluon.jit(row_ranges.fn)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``src`` (shared memory) added into the tensor at ``coord`` by TMA (float32 reduce,
    clipped at the tensor's bounds as a TMA store): triton's ``cp.reduce.async.bulk.tensor``,
    which this triton's Gluon Hopper ``tma`` module does not wrap. Completes as a store
    (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


_stats_offset = gluon.jit(stats_offset.fn)


@gluon.jit
def _kv_ptrs(k, v, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
             stride_vh):
    """K and V (or dK and dV: shaped as the keys) of kv head ``i_hk`` of sequence ``i_b``,
    as ``_slice_ptr`` gives them."""
    p_k = _slice_ptr(k, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh)
    p_v = _slice_ptr(v, i_b, bos_k, i_hk, stride_vb, stride_vs, stride_vh)
    return p_k, p_v

HALF_N = HALF_M  # keys (dK/dV) or query rows (dQ) per consumer warpgroup: one wgmma M


@gluon.jit
def _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M: gl.constexpr):
    """The (head, row block) after ``(i_g, m0)`` in the flat loop over the group."""
    m0 += BLOCK_M
    if m0 >= m_hi:
        i_g += 1
        m0 = m_lo
    return i_g, m0


@gluon.jit
def _q_coord(at, i_g, m0, col):
    """TMA coordinates of head ``i_g`` of the group, rows from ``m0``, column ``col`` of a
    head, in Q, dO or the float32 dQ: ``at = (b, g, c, cg)`` gives ``[b + i_g * g, m0, c +
    i_g * cg + col]`` (``_dkdv_sm90_kernel``: device descriptors ``(0, 1, 0, 0)`` over the
    group's heads, host descriptors ``(i_b, 0, i_h0 * D, D)`` over ``(B, S, H * D)``)."""
    return [at[0] + i_g * at[1], m0, at[2] + i_g * at[3] + col]


# Programs a section of the dense dK/dV grid's longest-first order (``LPT``): 256 key blocks
# of 128 keys hold the Q and dO rows of 256 * 128 rows between them (16 MB at D = 128).
LPT_PROGRAMS = gl.constexpr(256)


@gluon.jit
def _block_ids(LPT: gl.constexpr):
    """``(key block, kv head, batch)`` of this program; the grid is ``(key blocks, kv heads,
    batch)`` and programs start in the order of their linear id. ``LPT``: the ids are dealt
    in sections of about ``LPT_PROGRAMS`` programs, a few (batch, kv head) pairs each, and
    within a section key block by key block, so that a causal call starts its longest
    blocks (block 0 sees every row) first and ends on short ones, while the Q and dO rows
    the programs in flight read stay one section's (in L2)."""
    if LPT:
        n_n = gl.num_programs(0)
        n_h = gl.num_programs(1)
        pid = gl.program_id(0) + n_n * (gl.program_id(1) + n_h * gl.program_id(2))
        sec = gl.maximum(LPT_PROGRAMS // n_n, 1)  # (batch, kv head) pairs a section
        i_s = pid // (sec * n_n)
        r = pid - i_s * (sec * n_n)
        width = gl.minimum(sec, n_h * gl.num_programs(2) - i_s * sec)  # the last is short
        i_n = r // width
        pair = i_s * sec + (r - i_n * width)
        return i_n, pair % n_h, pair // n_h
    else:
        return gl.program_id(0), gl.program_id(1), gl.program_id(2)


@gluon.jit
def _coord_bases(GROUP: gl.constexpr, D: gl.constexpr, HOST_DESC: gl.constexpr,
                 LPT: gl.constexpr):
    """The program's coordinate bases ``at``: Q's four for ``_q_coord``, the stats row of the
    group's first head, K's batch and column. Host descriptors (``(B, S, H * D)``, the stats
    ``(B * H, S)``) take the batch and head from the program's ids (``_block_ids``); a
    program's own descriptors start at its sequence and group, so only the group's heads
    step (``(0, 1, 0, 0, ...)``)."""
    if HOST_DESC:
        _, i_hk, i_b = _block_ids(LPT)
        return (i_b, 0, i_hk * (GROUP * D), D, i_b * (GROUP * gl.num_programs(1)) + i_hk * GROUP,
                i_b, i_hk * D)
    else:
        return (0, 1, 0, 0, 0, 0, 0)


# The float32 dQ's staging buffers and descriptor boxes (fused pass): unswizzled rows of
# the whole tile (``DQ_SWIZZLE`` off), or 32-column boxes in the 128-byte swizzle.
DQ_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                               rank=3))
DQ_SWZ_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                   rank=3))
STAT_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                rank=2))


@gluon.constexpr_function
def _dq_cols(d):
    """dQ's columns a fused dK/dV warpgroup computes a tile: half of D's (each warpgroup its
    half of every tile), or all of D = 64's (half a 128-byte K row would cut its swizzle
    atom; the warpgroups take the tiles in turn)."""
    return d if d <= 64 else d // 2


@gluon.constexpr_function
def _dq_box(d, swizzle):
    """dQ's columns a TMA reduce adds (its staging box): a warpgroup's whole tile of
    :func:`_dq_cols`, or with ``swizzle`` 32 (128 bytes of float32, the swizzle's row; the
    unswizzled tile's 256-byte rows put each warp's 8-byte stores 8 ways on one bank)."""
    return 32 if swizzle else _dq_cols(d)


@gluon.constexpr_function
def _dq_layout(swizzle):
    return (DQ_SWZ_LAYOUT if swizzle else DQ_LAYOUT).value


@gluon.jit
def _load_descs(loads, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                STATS_TMA: gl.constexpr, HOST_DESC: gl.constexpr):
    """The producer's descriptors (Q, dO, K, V, lse_log2, delta): the launcher's with
    ``HOST_DESC``, else this program's, over its sequence and head group, made here (``loads``:
    the kernel's pointers, lengths and strides)."""
    if HOST_DESC:
        return loads
    else:
        p_q, p_do, p_k, p_v, p_lse, p_delta, T_q, T_k, sqh, sqs, sdh, sds, sks, svs, sth = loads
        dtype: gl.constexpr = p_q.dtype.element_ty
        q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, D], dtype)
        kv_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF_N, D], dtype)
        q_desc = tma.make_tensor_descriptor(p_q, [GROUP, T_q, D], [sqh, sqs, 1],
                                            [1, BLOCK_M, D], q_lay)
        do_desc = tma.make_tensor_descriptor(p_do, [GROUP, T_q, D], [sdh, sds, 1],
                                             [1, BLOCK_M, D], q_lay)
        k_desc = tma.make_tensor_descriptor(p_k, [1, T_k, D], [sks, sks, 1], [1, HALF_N, D],
                                            kv_lay)
        v_desc = tma.make_tensor_descriptor(p_v, [1, T_k, D], [svs, svs, 1], [1, HALF_N, D],
                                            kv_lay)
        if STATS_TMA:
            lse_desc = tma.make_tensor_descriptor(p_lse, [GROUP, T_q], [sth, 1], [1, BLOCK_M],
                                                  STAT_LAYOUT)
            dlt_desc = tma.make_tensor_descriptor(p_delta, [GROUP, T_q], [sth, 1],
                                                  [1, BLOCK_M], STAT_LAYOUT)
        else:
            lse_desc = q_desc
            dlt_desc = q_desc
        return q_desc, do_desc, k_desc, v_desc, lse_desc, dlt_desc


@gluon.jit
def _store_descs(stores, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                 FUSED_DQ: gl.constexpr, HOST_DESC: gl.constexpr,
                 DQ_SWIZZLE: gl.constexpr = False):
    """A consumer's descriptors (dK, dV, and the float32 dQ if ``FUSED_DQ``), as
    :func:`_load_descs` gives the producer's."""
    if HOST_DESC:
        return stores
    else:
        p_dk, p_dv, p_dq, T_q, T_k, sdks, sdvs, sdqa = stores
        dtype: gl.constexpr = p_dk.dtype.element_ty
        kv_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF_N, D], dtype)
        dk_desc = tma.make_tensor_descriptor(p_dk, [1, T_k, D], [sdks, sdks, 1],
                                             [1, HALF_N, D], kv_lay)
        dv_desc = tma.make_tensor_descriptor(p_dv, [1, T_k, D], [sdvs, sdvs, 1],
                                             [1, HALF_N, D], kv_lay)
        if FUSED_DQ:
            dq_desc = tma.make_tensor_descriptor(p_dq, [GROUP, T_q, D], [sdqa[2], sdqa[1], 1],
                                                 [1, BLOCK_M, _dq_box(D, DQ_SWIZZLE)],
                                                 _dq_layout(DQ_SWIZZLE))
        else:
            dq_desc = dk_desc
        return dk_desc, dv_desc, dq_desc


@gluon.jit
def _producer(loads, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, kv_bar, full, empty,
              n0, m_lo, m_hi, n_tiles, at, GROUP: gl.constexpr, D: gl.constexpr,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, STATS_TMA: gl.constexpr,
              HOST_DESC: gl.constexpr, KV_TILES: gl.constexpr = 2):
    """One warp: the ``KV_TILES`` 64-key tiles of K and V once, then Q and dO (and with
    ``STATS_TMA`` lse_log2 and delta) of every (head, row block). ``at``: the kernel's
    coordinate bases (Q's four for ``_q_coord``, then the stats row of the group's first
    head, K's batch and column). ``loads``: its descriptors, or what :func:`_load_descs`
    makes them from."""
    q_desc, do_desc, k_desc, v_desc, lse_desc, dlt_desc = _load_descs(
        loads, GROUP, D, BLOCK_M, STATS_TMA, HOST_DESC)
    mbarrier.expect(kv_bar, KV_TILES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(KV_TILES):
        tma.async_copy_global_to_shared(k_desc, [at[5], n0 + half * HALF_N, at[6]], kv_bar,
                                        k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [at[5], n0 + half * HALF_N, at[6]], kv_bar,
                                        v_smem.index(half))
    i_g = 0
    m0 = m_lo
    for it in range(n_tiles):
        s = it % STAGES
        # A fresh barrier counts as having completed the phase before 0.
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        if STATS_TMA:
            mbarrier.expect(full.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + lse_desc.block_type.nbytes + dlt_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(lse_desc, [at[4] + i_g, m0], full.index(s),
                                            lse_smem.index(s))
            tma.async_copy_global_to_shared(dlt_desc, [at[4] + i_g, m0], full.index(s),
                                            dlt_smem.index(s))
        else:
            mbarrier.expect(full.index(s),
                            q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, _q_coord(at, i_g, m0, 0), full.index(s),
                                        q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, _q_coord(at, i_g, m0, 0), full.index(s),
                                        do_smem.index(s))
        i_g, m0 = _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M)


@gluon.jit
def _probs_t(st, keys, rows, lse, T_k, shift, left, right, scale_log2,
             MASK: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """``P^T = 2^(S^T * scale_log2 - lse_log2)``, masked keys -> 0 on boundary tiles
    (``lse``: [1, BLOCK_M], one value a row, broadcast over the keys)."""
    if MASK:
        vis = keys[:, None] < T_k
        if HAS_RIGHT:
            vis = vis & (keys[:, None] <= rows[None, :] + shift + right)
        if HAS_LEFT:
            vis = vis & (keys[:, None] >= rows[None, :] + shift - left)
        pt = gl.exp2(gl.where(vis, st * scale_log2, float("-inf")) - lse)
    else:
        pt = gl.exp2(st * scale_log2 - lse)
    return pt


@gluon.jit
def _tile_probs(st, keys, rows, lse, T_k, shift, left, right, scale_log2, m0, m_full_lo,
                m_full_hi, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """:func:`_probs_t` of row block ``m0``, masked only outside ``[m_full_lo, m_full_hi)``
    (``row_ranges``' blocks that see every key of the block)."""
    if (m0 < m_full_lo) | (m0 >= m_full_hi):
        pt = _probs_t(st, keys, rows, lse, T_k, shift, left, right, scale_log2, True,
                      HAS_LEFT, HAS_RIGHT)
    else:
        pt = _probs_t(st, keys, rows, lse, T_k, shift, left, right, scale_log2, False,
                      HAS_LEFT, HAS_RIGHT)
    return pt


@gluon.jit
def _wait_tile(q_smem, do_smem, full, it, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
               D: gl.constexpr):
    """Ring slot ``s`` of tile ``it`` once its loads have landed, with its Q and dO tiles."""
    s = it % STAGES
    mbarrier.wait(full.index(s), (it // STAGES) & 1)
    return s, q_smem.index(s).reshape([BLOCK_M, D]), do_smem.index(s).reshape([BLOCK_M, D])


@gluon.jit
def _dq_tile(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0, k_cols1, dq_zero,
             dv_tok, dk_tok, s, b, it, at, i_g, m0, col0: gl.constexpr,
             half: gl.constexpr, scale, DQ_SWIZZLE: gl.constexpr,
             RELEASE: gl.constexpr = True):
    """A fused dK/dV warpgroup's dQ products of tile ``it`` (``_consumer``): once both dS^T
    halves are in buffer ``b``, ``dS K`` over the block's keys into dQ's columns from
    ``col0``, added into the float32 dQ by a TMA reduce a staging box (``_dq_box``); the
    dS^T buffer handed back, and with ``RELEASE`` the ring slot ``s``. Returns dV and dK,
    their products waited for."""
    mbarrier.wait(ds_full.index(b), (it // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k_cols0, dq_zero,
                           use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k_cols1, dq_tok,
                           is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
    mbarrier.arrive(ds_empty.index(b))
    if RELEASE:
        mbarrier.arrive(empty.index(s))
    # The reduce before from this buffer has read it (its issuing thread waits, the
    # warpgroup's barrier holds the others until it has): reuse it.
    tma.store_wait(0)
    gl.thread_barrier()
    dq = dq * scale
    BLOCK_M: gl.constexpr = dq.shape[0]
    BOX: gl.constexpr = dq_desc.block_type.shape[2]
    if DQ_SWIZZLE:
        # Two 32-column boxes, each in its own buffer (two views of one would be ordered by
        # a barrier between their stores): the register tile's column halves.
        lo, hi = gl.split(gl.permute(gl.reshape(dq, [BLOCK_M, 2, BOX]), (0, 2, 1)))
        dq_smem[0].index(half).reshape([BLOCK_M, BOX]).store(lo)
        dq_smem[1].index(half).reshape([BLOCK_M, BOX]).store(hi)
        fence_async_shared()
        _tma_reduce_add(dq_desc, _q_coord(at, i_g, m0, col0), dq_smem[0].index(half))
        _tma_reduce_add(dq_desc, _q_coord(at, i_g, m0, col0 + BOX), dq_smem[1].index(half))
    else:
        dq_smem.index(half).reshape([BLOCK_M, BOX]).store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, _q_coord(at, i_g, m0, col0), dq_smem.index(half))
    return dv, dk


@gluon.jit
def _dq_turn(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0, k_cols1, dq_zero,
             dv_tok, dk_tok, s, b, it, at, i_g, m0, col0: gl.constexpr, half: gl.constexpr,
             scale, DQ_SWIZZLE: gl.constexpr, DQ_COLS: gl.constexpr, D: gl.constexpr,
             RELEASE: gl.constexpr = True):
    """Tile ``it``'s dQ products (dS^T in buffer ``b``) where they are this warpgroup's:
    every tile at D = 128 (a constant branch; one condition with the turn's test would put a
    runtime branch in D = 128's code), every other one at D = 64, where the other warpgroup
    hands the buffer back at once. Ring slot ``s`` released with ``RELEASE``."""
    if DQ_COLS < D:
        dv, dk = _dq_tile(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0,
                          k_cols1, dq_zero, dv_tok, dk_tok, s, b, it, at, i_g, m0, col0, half,
                          scale, DQ_SWIZZLE, RELEASE)
    elif b == half:
        dv, dk = _dq_tile(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0,
                          k_cols1, dq_zero, dv_tok, dk_tok, s, b, it, at, i_g, m0, col0, half,
                          scale, DQ_SWIZZLE, RELEASE)
    else:
        mbarrier.arrive(ds_empty.index(b))
        dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
        if RELEASE:
            mbarrier.arrive(empty.index(s))
    return dv, dk


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, stores,
              kv_bar, full, empty, p_lse, p_delta, stride_th, half,
              n0, T_q, T_k, shift, left, right, scale, scale_log2,
              m_lo, m_full_lo, m_full_hi, m_hi, n_tiles, fused,
              GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              EARLY_DP: gl.constexpr, STATS_TMA: gl.constexpr, FUSED_DQ: gl.constexpr,
              HOST_DESC: gl.constexpr, LPT: gl.constexpr, DQ_SWIZZLE: gl.constexpr,
              DQ_LAG: gl.constexpr):
    """One warpgroup: 64 keys against every (head, row block) that sees the key block.

    ``FUSED_DQ`` (``fused``: dS's shared buffers and their barriers, dQ's staging buffers and
    the float32 dQ's descriptor): each tile's ``dS^T`` also goes to shared memory; once both
    warpgroups' halves are there this one computes dQ's columns ``[half * D/2, (half + 1) *
    D/2)`` of the tile, ``dS K`` over the block's 128 keys, and adds them into the float32
    dQ by a TMA reduce (the dQ pass's recomputation of S and dP is gone). At D = 64 (half
    a K row would cut its 128-byte swizzle atom) the warpgroups take whole tiles in turn
    instead: warpgroup ``it % 2`` computes all of tile ``it``'s dQ columns. With ``DQ_LAG``
    each iteration takes the tile before's dQ products (the last tile's after the loop)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    keys = n0 + half * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    col_arange = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
    # (The fused causal kernel: 64 bytes of stack on host descriptors, 16 on device ones,
    # sm_90 compile; it was faster all the same, RESULTS.md session 20.)
    at = _coord_bases(GROUP, D, HOST_DESC, LPT)
    # Made while the producer makes its own and loads K and V.
    dk_desc, dv_desc, dq_desc = _store_descs(stores, GROUP, D, BLOCK_M, FUSED_DQ, HOST_DESC,
                                             DQ_SWIZZLE)
    k_t = k_smem.index(half).reshape([HALF_N, D])
    v_t = v_smem.index(half).reshape([HALF_N, D])
    if FUSED_DQ:
        ds_smem, ds_full, ds_empty, dq_smem = fused
        # dQ's columns a warpgroup computes in a tile: half of them, or at D = 64 all (the
        # warpgroups take turns by tile).
        DQ_COLS: gl.constexpr = _dq_cols(D)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16])
        dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout)
        # dQ's columns of this warpgroup in each K half (a whole 128-byte swizzle atom).
        col0: gl.constexpr = half * DQ_COLS % D
        k_cols0 = k_smem.index(0).reshape([HALF_N, D]).slice(col0, DQ_COLS, dim=1)
        k_cols1 = k_smem.index(1).reshape([HALF_N, D]).slice(col0, DQ_COLS, dim=1)
    mbarrier.wait(kv_bar, 0)

    i_g = 0
    m0 = m_lo
    # The tile before's (head, row block), DQ_LAG. (Not ``= m_lo``: a name first bound to the
    # same value as ``m0`` is not carried through the loop by Triton's frontend, which then
    # reads m_lo in every iteration.)
    lag_g = 0
    lag_m0 = 0
    for it in range(n_tiles):
        s, q_t, do_t = _wait_tile(q_smem, do_smem, full, it, STAGES, BLOCK_M, D)
        rows = m0 + col_arange
        if not STATS_TMA:
            # Rows past the end: lse = +inf, so P = 0 there with no mask.
            in_seq = rows < T_q
            lse = gl.load(p_lse + i_g * stride_th + rows, mask=in_seq,
                          other=float("inf"))[None, :]
            dlt = gl.load(p_delta + i_g * stride_th + rows, mask=in_seq, other=0.0)[None, :]
        st_tok = warpgroup_mma(k_t, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if EARLY_DP:
            # dP^T runs on the tensor cores while the exponentials of S^T are computed.
            dpt_tok = warpgroup_mma(v_t, do_t.permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
        else:
            st = warpgroup_mma_wait(0, deps=(st_tok, ))
        if STATS_TMA:
            # Read from shared memory where they are used: 16 registers each a thread in
            # this layout, so they are not held across the products.
            lse = lse_smem.index(s).load(s_layout)
        pt = _tile_probs(st, keys, rows, lse, T_k, shift, left, right, scale_log2, m0,
                         m_full_lo, m_full_hi, HAS_LEFT, HAS_RIGHT)
        if not EARLY_DP:
            # dP^T is issued just before dV += P^T dO and runs with it.
            dpt_tok = warpgroup_mma(v_t, do_t.permute((1, 0)), s_zero, use_acc=False,
                                    is_async=True)
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv,
                               is_async=True)
        # Groups complete in issue order: with dP^T issued before dV, leaving one in flight
        # means dP^T is done.
        dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
        if STATS_TMA:
            dlt = dlt_smem.index(s).load(s_layout)
        dst = pt * (dpt - dlt)
        if FUSED_DQ:
            ds16 = dst.to(dtype)
            dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_t, dk, is_async=True)
            # dS^T into buffer b's half (free once both warpgroups' dQ products of tile
            # it - 2 are done), then both halves there before the dQ products.
            b = it % 2
            mbarrier.wait(ds_empty.index(b), ((it // 2) & 1) ^ 1)
            ds_smem.index(2 * b + half).store(ds16)
            fence_async_shared()
            gl.thread_barrier()  # every thread's part stored before the one arrive
            mbarrier.arrive(ds_full.index(b))
            if DQ_LAG:
                # The dQ products one tile late: the other warpgroup's half of tile it - 1
                # was stored an iteration ago, so neither waits for the other's tile it.
                if it > 0:
                    dv, dk = _dq_turn(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc,
                                      k_cols0, k_cols1, dq_zero, dv_tok, dk_tok, s, 1 - b,
                                      it - 1, at, lag_g, lag_m0, col0, half, scale,
                                      DQ_SWIZZLE, DQ_COLS, D)
                else:
                    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
                    mbarrier.arrive(empty.index(s))
                lag_g = i_g
                lag_m0 = m0
            else:
                dv, dk = _dq_turn(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0,
                                  k_cols1, dq_zero, dv_tok, dk_tok, s, b, it, at, i_g, m0,
                                  col0, half, scale, DQ_SWIZZLE, DQ_COLS, D)
        else:
            dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_t, dk,
                                   is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            mbarrier.arrive(empty.index(s))
        i_g, m0 = _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M)

    if FUSED_DQ:
        if DQ_LAG:
            if n_tiles > 0:
                dv, dk = _dq_turn(ds_smem, ds_full, ds_empty, empty, dq_smem, dq_desc, k_cols0,
                                  k_cols1, dq_zero, dv, dk, 0, (n_tiles - 1) % 2,
                                  n_tiles - 1, at, lag_g, lag_m0, col0, half, scale,
                                  DQ_SWIZZLE, DQ_COLS, D, False)
        # Both warpgroups' last dQ products read both K halves: done before K's buffers
        # stage dK below (at D = 64 the last tile's ends after the one before it).
        if n_tiles > 0:
            mbarrier.wait(ds_empty.index((n_tiles - 1) % 2), ((n_tiles - 1) // 2) & 1)

    # K and V are no longer read: stage dK, dV in their buffers for two clipped TMA stores.
    k_t.store((dk * scale).to(dtype))
    v_t.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [at[5], n0 + half * HALF_N, at[6]],
                                    k_smem.index(half))
    tma.async_copy_shared_to_global(dv_desc, [at[5], n0 + half * HALF_N, at[6]],
                                    v_smem.index(half))
    tma.store_wait(0)


@gluon.jit
def _handoff(dtype: gl.constexpr, N_BUF: gl.constexpr, BLOCK_M: gl.constexpr,
             ARRIVALS: gl.constexpr):
    """Tiles passed between the consumer warpgroups: ``N_BUF`` ``[HALF_N, BLOCK_M]`` buffers
    and two slots' full / empty barriers of ``ARRIVALS`` arrivals each."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_M], dtype)
    smem = gl.allocate_shared_memory(dtype, [N_BUF, HALF_N, BLOCK_M], layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=ARRIVALS)
        mbarrier.init(empty.index(i), count=ARRIVALS)
    return smem, full, empty


@gluon.constexpr_function
def _kv_tiles(role_split):
    """64-key tiles of K and V a dK/dV program holds."""
    return 1 if role_split else 2


@gluon.constexpr_function
def _p_dtype(f32, dtype):
    """P^T's type between the role split's warpgroups."""
    return gl.float32 if f32 else dtype


@gluon.jit
def _p_dv_consumer(q_smem, do_smem, k_smem, lse_smem, p_smem, stores, kv_bar, full, empty,
                   p_full, p_empty, n0, T_k, shift, left, right, scale_log2,
                   m_lo, m_full_lo, m_full_hi, m_hi, n_tiles,
                   GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   HOST_DESC: gl.constexpr, LPT: gl.constexpr):
    """``ROLE_SPLIT``'s first warpgroup, over the program's 64 keys: ``S^T = K Q^T``, the
    masked ``P^T`` (to the other warpgroup through ``p_smem``), ``dV += P^T dO``."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    keys = n0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    col_arange = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
    at = _coord_bases(GROUP, D, HOST_DESC, LPT)
    dk_desc, dv_desc, dq_desc = _store_descs(stores, GROUP, D, BLOCK_M, False, HOST_DESC)
    k_t = k_smem.index(0).reshape([HALF_N, D])
    mbarrier.wait(kv_bar, 0)
    i_g = 0
    m0 = m_lo
    for it in range(n_tiles):
        s, q_t, do_t = _wait_tile(q_smem, do_smem, full, it, STAGES, BLOCK_M, D)
        st_tok = warpgroup_mma(k_t, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(0, deps=(st_tok, ))
        lse = lse_smem.index(s).load(s_layout)
        pt = _tile_probs(st, keys, m0 + col_arange, lse, T_k, shift, left, right, scale_log2,
                         m0, m_full_lo, m_full_hi, HAS_LEFT, HAS_RIGHT)
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_t, dv,
                               is_async=True)
        # P^T into buffer b (free once the other warpgroup has read tile it - 2's) while
        # dV's product runs.
        b = it % 2
        mbarrier.wait(p_empty.index(b), ((it // 2) & 1) ^ 1)
        p_smem.index(b).store(pt.to(p_smem.dtype))
        gl.thread_barrier()  # every thread's part stored before the one arrive
        mbarrier.arrive(p_full.index(b))
        dv = warpgroup_mma_wait(0, deps=(dv_tok, ))
        mbarrier.arrive(empty.index(s))
        i_g, m0 = _next_tile(i_g, m0, m_lo, m_hi, BLOCK_M)
    # K is read by this warpgroup only: its buffer stages dV for a clipped TMA store.
    k_t.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dv_desc, [at[5], n0, at[6]], k_smem.index(0))
    tma.store_wait(0)


@gluon.jit
def _ds_dk_consumer(q_smem, do_smem, v_smem, dlt_smem, p_smem, stores, kv_bar, full, empty,
                    p_full, p_empty, n0, scale, n_tiles,
                    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, HOST_DESC: gl.constexpr, LPT: gl.constexpr):
    """``ROLE_SPLIT``'s second warpgroup: ``dP^T = V dO^T``, then with the first one's
    ``P^T``, ``dS^T = P^T (dP^T - delta)`` and ``dK += dS^T Q`` (masked keys and rows have
    ``P^T = 0`` there, so this side needs no mask)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    dtype: gl.constexpr = v_smem.dtype
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
    at = _coord_bases(GROUP, D, HOST_DESC, LPT)
    dk_desc, dv_desc, dq_desc = _store_descs(stores, GROUP, D, BLOCK_M, False, HOST_DESC)
    v_t = v_smem.index(0).reshape([HALF_N, D])
    mbarrier.wait(kv_bar, 0)
    for it in range(n_tiles):
        s, q_t, do_t = _wait_tile(q_smem, do_smem, full, it, STAGES, BLOCK_M, D)
        dpt_tok = warpgroup_mma(v_t, do_t.permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
        dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
        dlt = dlt_smem.index(s).load(s_layout)
        b = it % 2
        mbarrier.wait(p_full.index(b), (it // 2) & 1)
        pt = p_smem.index(b).load(s_layout).to(gl.float32)
        gl.thread_barrier()  # every thread's part read before the one arrive
        mbarrier.arrive(p_empty.index(b))
        dst = pt * (dpt - dlt)
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), op_layout), q_t, dk,
                               is_async=True)
        dk = warpgroup_mma_wait(0, deps=(dk_tok, ))
        mbarrier.arrive(empty.index(s))
    # V is read by this warpgroup only: its buffer stages dK.
    v_t.store((dk * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [at[5], n0, at[6]], v_smem.index(0))
    tma.store_wait(0)


# Lengths are not specialised (a length of 1 or divisible by 16 would recompile).
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "left", "right"])
def _dkdv_sm90_kernel(
    q, k, v, dout, lse_log2, delta, dk, dv,
    cu_seqlens_q, cu_seqlens_k, seqused_k, dq_acc,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_tb, stride_th, stride_dqa,
    seqlen_q, seqlen_k, total_q, total_k, left, right, scale, scale_log2,
    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, EARLY_DP: gl.constexpr,
    STATS_TMA: gl.constexpr, CONSUMER_REGS: gl.constexpr, FUSED_DQ: gl.constexpr = False,
    HOST_DESC: gl.constexpr = False, ROLE_SPLIT: gl.constexpr = False,
    P_F32: gl.constexpr = True, LPT: gl.constexpr = False, DQ_SWIZZLE: gl.constexpr = False,
    DQ_LAG: gl.constexpr = False,
):
    # ROLE_SPLIT (D = 256): a 64-key block, one warpgroup's products P^T and dV, the other's
    # dP^T and dK (``_p_dv_consumer``, ``_ds_dk_consumer``), so each holds one [64, D]
    # float32 accumulator; P^T passes between them in shared memory (float32 with P_F32).
    KV_TILES: gl.constexpr = _kv_tiles(ROLE_SPLIT)
    BLOCK_N: gl.constexpr = KV_TILES * HALF_N
    i_n, i_hk, i_b = _block_ids(LPT)
    bos, bos_k, T_q, T_k, i_n, n0, n_last, shift = _seq_block(
        i_b, i_n, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
        seqused_k, BLOCK_N, True, False, IS_VARLEN, HAS_SEQUSED_K)
    if n0 >= T_k:
        return
    m_lo, m_full_lo, m_full_hi, m_hi = _row_ranges(n0, n_last, T_q, T_k, shift, left, right,
                                                   BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # The flat loop over (head, row block) of the group: one trip per tile.
    n_tiles = GROUP * ((m_hi - m_lo + BLOCK_M - 1) // BLOCK_M)

    i_h0 = i_hk * GROUP
    # lse_log2 and delta of a (head, row block), by TMA beside Q and dO (the launcher starts
    # each (sequence, head) row at a 16-byte boundary, ``stats_offset``). Rows past the end
    # read 0 there: their Q and dO rows are zeros too, so P = 1 meets dO = 0 and dP - delta
    # = 0, and they add nothing.
    if HOST_DESC:
        # Dense calls: the launcher's descriptors over whole tensors (Q, dO, dQ as (B, S,
        # H * D), K, V, dK, dV as (B, S_k, H_kv * D), the stats as (B * H, S)), clipped at
        # S and S_k as the per-program ones are at T_q and T_k, so no program writes
        # descriptors: that setup (a global write and a proxy fence each, one after the
        # other, while the other warps wait) took ~20% of a program at causal S = 1k (ncu).
        loads = (q, dout, k, v, lse_log2, delta)
        if FUSED_DQ:
            stores = (dk, dv, dq_acc)
        else:
            stores = (dk, dv, dk)
        dtype: gl.constexpr = q.dtype
        row_layout: gl.constexpr = q.layout
        kv_layout: gl.constexpr = k.layout
        p_lse = lse_log2  # unused: STATS_TMA (the launcher's condition)
        p_delta = delta
    else:
        # This program's descriptors, made where they are used (``_load_descs`` in the
        # producer, ``_store_descs`` in each consumer) so the two sides make theirs at once.
        p_q = _slice_ptr(q, i_b, bos, i_h0, stride_qb, stride_qs, stride_qh)
        p_do = _slice_ptr(dout, i_b, bos, i_h0, stride_dob, stride_dos, stride_doh)
        p_k, p_v = _kv_ptrs(k, v, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh)
        p_dk, p_dv = _kv_ptrs(dk, dv, i_b, bos_k, i_hk, stride_dkb, stride_dks, stride_dkh,
                              stride_dvb, stride_dvs, stride_dvh)
        o_t = _stats_offset(i_b, bos, i_h0, stride_tb, stride_th)
        p_lse = lse_log2 + o_t
        p_delta = delta + o_t
        # Rows past a sequence's end read as zeros; the stores are clipped at T_q and T_k.
        T_q_desc = gl.maximum(T_q, 1)
        loads = (p_q, p_do, p_k, p_v, p_lse, p_delta, T_q_desc, T_k, stride_qh, stride_qs,
                 stride_doh, stride_dos, stride_ks, stride_vs, stride_th)
        if FUSED_DQ:
            p_dq = _slice_ptr(dq_acc, i_b, bos, i_h0, stride_dqa[0], stride_dqa[1],
                              stride_dqa[2])
        else:
            p_dq = dk
        stores = (p_dk, p_dv, p_dq, T_q_desc, T_k, stride_dks, stride_dvs, stride_dqa)
        dtype: gl.constexpr = q.dtype.element_ty
        row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, D],
                                                                        dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF_N, D], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, D], row_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], STAT_LAYOUT)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], STAT_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [KV_TILES, 1, HALF_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_TILES, 1, HALF_N, D], kv_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    if FUSED_DQ:
        # dS^T halves of two tiles (buffer, half), their barriers (both warpgroups arrive),
        # a float32 staging buffer a warpgroup for its dQ columns (with DQ_SWIZZLE two, one
        # a 32-column box), dQ's descriptor (rows past the sequence clipped).
        ds_smem, ds_full, ds_empty = _handoff(dtype, 4, BLOCK_M, 2)
        if DQ_SWIZZLE:
            BOX: gl.constexpr = _dq_box(D, DQ_SWIZZLE)
            dq_smem = (gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, BOX], DQ_SWZ_LAYOUT),
                       gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, BOX], DQ_SWZ_LAYOUT))
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, _dq_cols(D)],
                                                DQ_LAYOUT)
        fused = (ds_smem, ds_full, ds_empty, dq_smem)
    else:
        fused = ()

    if ROLE_SPLIT:
        p_smem, p_full, p_empty = _handoff(_p_dtype(P_F32, dtype), 2, BLOCK_M, 1)
        gl.warp_specialize([
            (_p_dv_consumer, (q_smem, do_smem, k_smem, lse_smem, p_smem, stores, kv_bar, full,
                              empty, p_full, p_empty, n0, T_k, shift, left, right, scale_log2,
                              m_lo, m_full_lo, m_full_hi, m_hi, n_tiles, GROUP, D, BLOCK_M,
                              STAGES, HAS_LEFT, HAS_RIGHT, HOST_DESC, LPT)),
            (_ds_dk_consumer, (q_smem, do_smem, v_smem, dlt_smem, p_smem, stores, kv_bar,
                               full, empty, p_full, p_empty, n0, scale, n_tiles, GROUP, D,
                               BLOCK_M, STAGES, HOST_DESC, LPT)),
            (_producer, (loads, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, kv_bar,
                         full, empty, n0, m_lo, m_hi, n_tiles,
                         _coord_bases(GROUP, D, HOST_DESC, LPT), GROUP, D, BLOCK_M, STAGES,
                         STATS_TMA, HOST_DESC, KV_TILES)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, stores, kv_bar,
                         full, empty, p_lse, p_delta, stride_th, 0, n0, T_q, T_k, shift,
                         left, right, scale, scale_log2, m_lo, m_full_lo, m_full_hi, m_hi,
                         n_tiles, fused, GROUP, D, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT,
                         EARLY_DP, STATS_TMA, FUSED_DQ, HOST_DESC, LPT, DQ_SWIZZLE,
                         DQ_LAG)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, stores, kv_bar,
                         full, empty, p_lse, p_delta, stride_th, 1, n0, T_q, T_k, shift,
                         left, right, scale, scale_log2, m_lo, m_full_lo, m_full_hi, m_hi,
                         n_tiles, fused, GROUP, D, BLOCK_M, STAGES, HAS_LEFT, HAS_RIGHT,
                         EARLY_DP, STATS_TMA, FUSED_DQ, HOST_DESC, LPT, DQ_SWIZZLE,
                         DQ_LAG)),
            (_producer, (loads, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, kv_bar,
                         full, empty, n0, m_lo, m_hi, n_tiles,
                         _coord_bases(GROUP, D, HOST_DESC, LPT), GROUP, D, BLOCK_M, STAGES,
                         STATS_TMA, HOST_DESC)),
        ], [4, 1], [CONSUMER_REGS, 24])


def supported(q, k, v, dout, dk, dv, *, softcap, dims) -> bool:
    """A kernel's domain (head dims ``dims``, D == Dv; ``dispatch.attn_bwd`` asks per pass):
    everything else runs bwd.py's."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if capability(q) != (9, 0) or softcap:
        return False
    d = q.shape[-1]
    if d not in dims or v.shape[-1] != d or min(q.numel(), k.numel()) == 0:
        return False
    return tma_ok(q, k, v, dout, dk, dv)


def dkdv_plan(p: BwdPass) -> Launch | None:
    """The dK/dV launch of a prepared backward (``bwd.prepare``), or None outside
    :func:`supported`'s domain: ``bwd.attn_bwd_dkdv``'s peer (``dispatch.attn_bwd`` picks).
    Planned once per call metadata and kept in the call's plan (``BwdPlan.launches``)."""
    run = p.plan.launches.get("sm90 dK/dV", _MISSING)
    if run is _MISSING:
        run = None
        dims = tuple(d for d in configs.BWD_SM90_DKDV_DIMS if d <= 128 or ROLE_SPLIT)
        if supported(p.q, p.k, p.v, p.dout, p.dk, p.dv, softcap=p.softcap, dims=dims):
            run = _dkdv_launch(p, 11, dq_acc=None, stride_dqa=None, FUSED_DQ=False,
                               DQ_SWIZZLE=False, DQ_LAG=False)
        p.plan.launches["sm90 dK/dV"] = run
    return run


# D = 256's dK/dV on the role split (False: bwd.py's kernel). H200, bf16, B*S = 16k, H = 8,
# S = 1k-16k (RESULTS.md 2026-12-04, session 33): the public backward 389-457 TFLOP/s full,
# 307-450 causal, 1.05-1.27x cuDNN (call 4; bwd.py's dK/dV: 206-258, 0.62-0.70x, call 1);
# fwd+bwd on / off in turn 1.53-1.76x (call 5).
ROLE_SPLIT = True
# (At D = 64, with 128-row Q / dO tiles, it lost: fwd+bwd 0.85-0.89x the two-key-half
# kernel in turn, RESULTS.md session 33 call 8.)
# It passes P^T between its warpgroups as float32 (False: q's dtype, half the shared-memory
# traffic, one more rounding in dS): fwd+bwd on / off in turn 1.00-1.13x (same session).
ROLE_P_F32 = True


def _dkdv_launch(p: BwdPass, n_tensors: int, **fused) -> Launch | _HostDescs | None:
    """The dK/dV kernel's launch at its shipped tiles (configs.BWD_SM90_DKDV) with ``fused``'s
    arguments (the float32 dQ's strides and ``FUSED_DQ``, or None / False), its first
    ``n_tensors`` arguments left to the call: as TMA descriptors made on the host for dense
    calls where :func:`_host_desc_ok` (``HOST_DESC``), else the tensors themselves."""
    args = p.plan.dkdv_kw
    cfg = configs.BWD_SM90_DKDV
    stats_tma = bool(cfg.stats_tma and args["STATS_TMA"])
    d = p.q.shape[-1]
    roles = d > 128 and not fused["FUSED_DQ"]
    if roles and not stats_tma:
        return None  # the role split reads lse and delta from the ring only
    host = HOST_DESC and stats_tma and _host_desc_ok(p)
    if fused["DQ_LAG"]:
        # Where it paid: ``_DQ_LAG_DIMS`` (benchmarks/NOTES.md, sessions 37-38).
        fused = dict(fused, DQ_LAG=d in _DQ_LAG_DIMS)
    tiles = dict(BLOCK_M=cfg.block_m, STAGES=cfg.num_stages, EARLY_DP=cfg.early_dp,
                 STATS_TMA=stats_tma, CONSUMER_REGS=cfg.consumer_regs,
                 num_warps=cfg.num_warps, HOST_DESC=host, ROLE_SPLIT=roles,
                 P_F32=ROLE_P_F32, LPT=_lpt(args), **fused)
    grid = (cdiv(p.seqlen_k, (1 if roles else 2) * HALF_N), p.hkv, p.batch)
    run = Launch(_dkdv_sm90_kernel, grid, *positional(
        _dkdv_sm90_kernel, n_tensors, _kernel_args(_dkdv_sm90_kernel, args, tiles)))
    if not host:
        return run
    spec = _dkdv_host_spec(p.q.dtype, d, cfg.block_m, fused["DQ_SWIZZLE"])
    return _HostDescs(run, spec, p.seqlen_q)


# Dense calls pass the dK/dV kernel descriptors made on the host (one per tensor a call,
# encoded by Triton's launcher) instead of each of its ~2k programs making ten in global
# memory before its first load. Session 20 (ncu's source page, causal S = 1k, B*S = 16k,
# H = 16): that setup and the warps waiting on it held ~20% of the fused kernel's samples.
HOST_DESC = True

# Causal GQA dK/dV grids start their programs longest first, section by section
# (``_block_ids``). With G query heads a kv head a program carries G x the tiles and the
# grid G x fewer programs, so a long causal block started last costs G x more. RESULTS.md
# 2026-12-04, session 34, call 5 (fwd+bwd on / off in turn, D = 128, B*S = 16k, 16 query
# heads): 4 kv heads causal 1k 1.55x (213 -> 331 TFLOP/s, 0.98x cuDNN), 2k 1.10x, 4k 1.12x;
# 8 kv heads 1k 1.01x, 4k 1.06x; 2 kv heads 2k 1.20x; non-causal 0.965-0.975x at every
# group (the sections' L2 pattern), MHA causal 0.994-0.999x (session 22): causal (a right
# bound, no left) GQA only. Session 35 (same form): on per-program descriptors (packed
# varlen, 16 / 4 heads, the block ids permute any grid) 1.11x on 8 documents of 229-3710
# tokens, 1.13x on 16 x 1k; D = 64 (32 / 8 heads) causal 1k-4k 1.03-1.05x, D = 256 (8 / 2,
# the role split) 1.07-1.10x.
LPT = True


def _lpt(args: dict) -> bool:
    """Whether a dK/dV launch (``args``: the plan's keywords) is one ``LPT``'s order pays
    for: causal GQA (a right bound and no left one, more query heads than kv heads)."""
    return LPT and args["GROUP"] > 1 and args["HAS_RIGHT"] and not args["HAS_LEFT"]


# The same for the Hopper dQ kernel (the deterministic path's second pass, and D = 256's
# dQ; five descriptors a program were made on the device). Session 21 (public fwd+bwd,
# deterministic, B*S = 16k, H = 16): +6% at S = 1k, +10% causal.
DQ_HOST_DESC = True


def _host_desc_ok(p: BwdPass, *grads: torch.Tensor) -> bool:
    """Whole-tensor descriptors clip where the per-program ones do only for dense calls (no
    varlen, no ``seqused_k``), and view Q, dO, K, V and the gradients ``grads`` (dK and dV by
    default) as ``(B, S, H * D)``: heads adjacent."""
    if p.cu_seqlens_q is not None or p.seqused_k is not None:
        return False
    # (Broadcast batch or rows, stride 0, keep the per-program descriptors too: those slice
    # the batch away.)
    return all(t.stride(-2) == t.shape[-1] and t.stride(-1) == 1 and t.stride(0) > 0
               and t.stride(1) > 0 for t in (p.q, p.k, p.v, p.dout, *(grads or (p.dk, p.dv))))


_HALF_N = int(getattr(HALF_N, "value", HALF_N))  # a plain int for the host's block shapes


def _rows_spec(dtype: torch.dtype, rows: int, d: int) -> tuple:
    """A ``(B, S, H * D)`` descriptor's entry in a ``_HostDescs`` spec: ``[1, rows, d]``
    boxes in the kernel's default swizzled layout for them."""
    el = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return ("rows", rows, d, gl.NVMMASharedLayout.get_default_for([1, rows, d], el))


def _desc(t: torch.Tensor, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    # TensorDescriptor without its __post_init__ checks (~2 us each): _host_desc_ok and the
    # launcher's tma_ok have made them for the call's plan.
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = \
        t, shape, strides, block, layout, "zero"
    return d


@functools.cache
def _dkdv_host_spec(dtype: torch.dtype, d: int, block_m: int, dq_swizzle: bool = False) -> tuple:
    """How each of the dK/dV kernel's tensor arguments (``BwdPass.dkdv_tensors`` order, then
    the float32 dQ if fused) becomes a host descriptor (``_HostDescs``), in the layouts of
    ``_dkdv_sm90_kernel``'s buffers (unswizzled float32 for the stats; the fused pass's
    float32 dQ in 32-column swizzled boxes with ``dq_swizzle``, ``DQ_SWIZZLE``)."""
    rows, keys = _rows_spec(dtype, block_m, d), _rows_spec(dtype, _HALF_N, d)
    stats = ("stats", block_m, STAT_LAYOUT.value)
    dq = ("rows", block_m, _dq_box(d, dq_swizzle), _dq_layout(dq_swizzle))
    return (rows, keys, keys, rows, stats, stats, keys, keys, None, None, None, dq)


@functools.cache
def _dq_host_spec(dtype: torch.dtype, d: int, block_n: int) -> tuple:
    """The dQ kernel's (``BwdPass.dq_tensors`` order): Q, dO, dQ in 64-row boxes, K and V in
    ``block_n``-row ones; lse_log2 and delta stay pointers there."""
    rows, keys = _rows_spec(dtype, _HALF_N, d), _rows_spec(dtype, block_n, d)
    return (rows, keys, keys, rows, None, None, rows, None, None, None)


class _HostDescs:
    """A launch whose kernel takes TMA descriptors made on the host: ``spec`` says, for each
    tensor argument in order, whether it stays a tensor (None) or becomes a descriptor over
    ``(B, S, H * D)`` (``("rows", box rows, box cols, layout)``: Q, dO, dQ, K, V, dK, dV) or
    over ``(B * H, S)`` (``("stats", box cols, layout)``: lse_log2, delta, rows padded by
    ``bwd.prepare``). Shapes and strides are the plan's (its key), so each descriptor's
    fields are worked out on the first call and only the tensors change: a
    :class:`DescLaunch` of them launches from then on."""

    __slots__ = ("run", "spec", "seqlen_q", "launch")

    def __init__(self, run: Launch, spec: tuple, seqlen_q: int):
        self.run, self.spec, self.seqlen_q = run, spec, seqlen_q
        self.launch = None

    def _fields(self, tensors) -> tuple:
        """(shape, strides, box, layout) of each descriptor, None for a plain argument."""
        out = []
        for t, sp in zip(tensors, self.spec):
            if sp is None:
                out.append(None)
            elif sp[0] == "stats":
                out.append(([t.shape[0] * t.shape[1], self.seqlen_q], [t.stride(1), 1],
                            [1, sp[1]], sp[2]))
            else:
                b, s, h, d = t.shape
                out.append(([b, s, h * d], [t.stride(0), t.stride(1), 1], [1, sp[1], sp[2]],
                            sp[3]))
        return tuple(out)

    def __call__(self, *tensors) -> None:
        launch = self.launch
        if launch is None:
            launch = self.launch = DescLaunch(self.run, self._fields(tensors), _desc)
        launch(*tensors)


# dK, dV and dQ in one pass (the dK/dV kernel adding each tile's dS K into a float32 dQ by a
# TMA reduce), where the call is not asked to be deterministic (the reduces' order varies).
# Predicted before its run: 12-20% faster at S = 1k-4k causal. Measured (H200, bf16, D = 128,
# B*S = 16k, H = 16, bench_bwd fwd+bwd through the public call, two passes each against the
# two-pass kernels in the same device call): non-causal +5% (1k) to +9% (8k), causal +0%
# (1k), +1% (2k), +5% (4k-16k), GQA 16/4 +2-6%; the packed varlen backward unchanged. So
# ``deterministic=True`` (the two passes) costs 0-9% there.
FUSED_DQ = True


class _FusedRun:
    """The fused backward's launches: the float32 dQ zeroed, the dK/dV kernel with
    ``FUSED_DQ``, then dQ converted to q's dtype (scaled in the kernel)."""

    __slots__ = ("kernel", )

    def __init__(self, kernel: Launch):
        self.kernel = kernel

    def __call__(self, p: BwdPass) -> None:
        dq_acc = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)
        self.kernel(*p.dkdv_tensors(), dq_acc)
        p.dq.copy_(dq_acc)


# D = 64 fused too: its warpgroups take dQ's tiles in turn (``_dq_cols``). RESULTS.md
# 2026-12-04, session 36 call 2 (fwd+bwd on / off in turn, B*S = 16k, 32 query heads,
# S = 1k-8k): MHA full 1.005-1.041x, causal 1.029-1.047x; GQA 32 / 8 full 1.008-1.042x,
# causal 1.040-1.062x (0.98-1.00x cuDNN). Session 33's key-split fused form (each warpgroup
# all 64 columns over its own keys: twice the reduce traffic) had lost 7-13%.
FUSED_D64 = True


# The fused pass stages each dQ tile for its TMA reduce in two 32-column boxes in the
# 128-byte swizzle (False: one unswizzled box, whose 256-byte rows make every 8-byte store
# of the accumulator layout an 8-way bank conflict: 4x the ideal wavefronts, ncu, D = 64
# and 128).
DQ_SWIZZLE = True


# The fused consumers take each tile's dQ products one tile late (``_consumer``), so the
# two warpgroups no longer meet every tile at the dS^T hand-over. RESULTS.md 2026-12-04,
# session 37 (fwd+bwd on / off in turn, B*S = 16k, three passes at S = 1k-4k): D = 128
# (16 heads) 1k 0.975-1.024x, 2k 0.993-1.013x, 4k 1.018-1.031x, 8k 1.018-1.021x; at
# D = 64 (32 heads, the warpgroups' dQ turns) full 0.970-1.007x, causal 0.997-1.036x: D = 128
# only.
DQ_LAG = True
_DQ_LAG_DIMS = (128, )


def _fused_dims() -> tuple:
    return (64, 128) if FUSED_D64 else (128, )


def fused_plan(p: BwdPass) -> _FusedRun | None:
    """The fused backward of a prepared call (``dispatch.attn_bwd`` asks when the call is
    not deterministic), or None: off (``FUSED_DQ``), no key, or outside the dK/dV and dQ
    kernels' common domain at D = Dv = 64 (``FUSED_D64``) or 128."""
    run = p.plan.launches.get("sm90 fused", _MISSING)
    if run is _MISSING:
        run = None
        if FUSED_DQ and p.has_keys and supported(p.q, p.k, p.v, p.dout, p.dk, p.dv,
                                                 softcap=p.softcap, dims=_fused_dims()):
            st = p.plan.dq_kw
            run = _FusedRun(_dkdv_launch(
                p, 12, stride_dqa=(st["stride_dqb"], st["stride_dqs"], st["stride_dqh"]),
                FUSED_DQ=True, DQ_SWIZZLE=DQ_SWIZZLE, DQ_LAG=DQ_LAG))
        p.plan.launches["sm90 fused"] = run
    return run


def attn_bwd_dkdv_sm90(p: BwdPass) -> None:
    """dK and dV of a prepared backward inside :func:`supported`'s domain (tests and
    benchmarks; ``dispatch.attn_bwd`` goes through :func:`dkdv_plan`)."""
    triton.set_allocator(alloc_scratch)
    dkdv_plan(p)(*p.dkdv_tensors())


def _kernel_args(kernel, args: dict, tiles: dict) -> dict:
    """The keywords of ``kernel`` among a portable pass's non-tensor ones (``BwdPlan``'s
    ``dkdv_kw`` / ``dq_kw``), the Hopper kernel's ``tiles`` in place of the portable ones."""
    return {**{n: args[n] for n in kernel.arg_names if n in args and n not in tiles}, **tiles}


_MISSING = object()


# --- dQ: the forward's program (fwd_sm90.py, its producer too) with the backward's row math


@gluon.jit
def _ring_tile(ring, s, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """Tile ``s`` of a K/V ring as ``[BLOCK_N, D]`` (rank-3 tiles of host descriptors
    reshaped; a rank-2 ring's as it is)."""
    if len(ring.shape) == 4:
        return ring.index(s).reshape([BLOCK_N, D])
    else:
        return ring.index(s)


@gluon.jit
def _dq_tiles(q_t, do_t, k_smem, v_smem, k_full, k_empty, v_full, v_empty, dq, s_zero, rows,
              col_arange, lse, dlt, T_k, shift, left, right, scale_log2,
              n_lo, n_full_lo, n_full_hi, n_tiles, t0,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
              HAS_RIGHT: gl.constexpr, op_layout: gl.constexpr):
    """``dq += dS K`` over the block's key tiles, the ring's ``t0``-th and on (the persistent
    kernel's earlier blocks took the ``t0`` before; 0 elsewhere)."""
    dtype: gl.constexpr = q_t.dtype
    D: gl.constexpr = q_t.shape[1]
    for it in range(n_tiles):
        s = (t0 + it) % STAGES
        ph = ((t0 + it) // STAGES) & 1
        n0 = n_lo + it * BLOCK_N
        mbarrier.wait(k_full.index(s), ph)
        s_tok = warpgroup_mma(q_t, _ring_tile(k_smem, s, BLOCK_N, D).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(s), ph)
        # dP runs on the tensor cores while the exponentials of S are computed.
        dp_tok = warpgroup_mma(do_t, _ring_tile(v_smem, s, BLOCK_N, D).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(1, deps=(s_tok, ))
        if (n0 < n_full_lo) | (n0 >= n_full_hi):
            cols = n0 + col_arange
            vis = cols[None, :] < T_k
            if HAS_RIGHT:
                vis = vis & (cols[None, :] <= rows[:, None] + shift + right)
            if HAS_LEFT:
                vis = vis & (cols[None, :] >= rows[:, None] + shift - left)
            p = gl.exp2(gl.where(vis, sc * scale_log2, float("-inf")) - lse[:, None])
        else:
            p = gl.exp2(sc * scale_log2 - lse[:, None])
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        mbarrier.arrive(v_empty.index(s))
        ds = p * (dp - dlt[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout),
                               _ring_tile(k_smem, s, BLOCK_N, D), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
        mbarrier.arrive(k_empty.index(s))
    return dq


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, dq_desc,
                 q_bar, k_full, k_empty, v_full, v_empty, p_lse, p_delta, half,
                 m0, T_q, T_k, shift, left, right, scale, scale_log2,
                 n_lo, n_full_lo, n_full_hi, n_tiles,
                 D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HOST_DESC: gl.constexpr):
    """One warpgroup: dQ of 64 query rows over every key tile the forward visits."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    r0 = m0 + half * HALF_N
    rows = r0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    col_arange = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    # Rows past the end: lse = +inf (P = 0), delta = 0; their Q, dO rows are zeros.
    lse = gl.load(p_lse + rows, mask=rows < T_q, other=float("inf"))
    dlt = gl.load(p_delta + rows, mask=rows < T_q, other=0.0)
    s_zero = gl.zeros([HALF_N, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
    q_t = q_smem.index(half).reshape([HALF_N, D])
    do_t = do_smem.index(half).reshape([HALF_N, D])
    mbarrier.wait(q_bar.index(half), 0)
    dq = _dq_tiles(q_t, do_t, k_smem, v_smem, k_full, k_empty, v_full, v_empty, dq, s_zero,
                   rows, col_arange, lse, dlt, T_k, shift, left, right, scale_log2,
                   n_lo, n_full_lo, n_full_hi, n_tiles, 0,
                   BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, op_layout)

    # Q's buffer is free now: stage dQ there for one clipped TMA store.
    q_t.store((dq * scale).to(dtype))
    fence_async_shared()
    if HOST_DESC:  # (B, S, H * D): this program's batch and head
        tma.async_copy_shared_to_global(
            dq_desc, [gl.program_id(2), r0, gl.program_id(1) * D], q_smem.index(half))
    else:
        tma.async_copy_shared_to_global(dq_desc, [r0, 0], q_t)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "left", "right"])
def _dq_sm90_kernel(
    q, k, v, dout, lse_log2, delta, dq,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_tb, stride_th,
    seqlen_q, seqlen_k, total_q, total_k, left, right, scale, scale_log2,
    GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    HOST_DESC: gl.constexpr = False,
):
    BLOCK_M: gl.constexpr = 2 * HALF_N
    i_h, i_b, i_hk, bos, bos_k, T_q, T_k, i_m, m0, m_last, shift = _row_block(
        seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k, GROUP,
        BLOCK_M, IS_VARLEN, HAS_SEQUSED_K)
    if i_m < 0:
        return
    n_lo, n_full_lo, n_full_hi, n_hi = _key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N,
                                                   HAS_LEFT, HAS_RIGHT)
    # A block that sees no key still stores its dQ = 0 (the launcher does not zero dq).
    n_tiles = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N

    o_t = _stats_offset(i_b, bos, i_h, stride_tb, stride_th)
    p_lse = lse_log2 + o_t
    p_delta = delta + o_t
    if HOST_DESC:
        # Dense calls: the launcher's descriptors over (B, S, H * D) and (B, S_k, H_kv * D),
        # as the dK/dV kernel's (``_HostDescs``).
        q_desc, do_desc, dq_desc, k_desc, v_desc = q, dout, dq, k, v
        dtype: gl.constexpr = q.dtype
    else:
        p_q = _slice_ptr(q, i_b, bos, i_h, stride_qb, stride_qs, stride_qh)
        p_do = _slice_ptr(dout, i_b, bos, i_h, stride_dob, stride_dos, stride_doh)
        p_dq = _slice_ptr(dq, i_b, bos, i_h, stride_dqb, stride_dqs, stride_dqh)
        p_k, p_v = _kv_ptrs(k, v, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh)
        dtype: gl.constexpr = q.dtype.element_ty
        q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, D], dtype)
        kv_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        T_k_desc = gl.maximum(T_k, 1)
        q_desc = tma.make_tensor_descriptor(p_q, [T_q, D], [stride_qs, 1], [HALF_N, D], q_lay)
        do_desc = tma.make_tensor_descriptor(p_do, [T_q, D], [stride_dos, 1], [HALF_N, D],
                                             q_lay)
        dq_desc = tma.make_tensor_descriptor(p_dq, [T_q, D], [stride_dqs, 1], [HALF_N, D],
                                             q_lay)
        k_desc = tma.make_tensor_descriptor(p_k, [T_k_desc, D], [stride_ks, 1], [BLOCK_N, D],
                                            kv_lay)
        v_desc = tma.make_tensor_descriptor(p_v, [T_k_desc, D], [stride_vs, 1], [BLOCK_N, D],
                                            kv_lay)
    q_layout: gl.constexpr = q_desc.layout
    kv_layout: gl.constexpr = k_desc.layout

    # Host descriptors are rank 3: their tiles carry a leading 1 (the consumers reshape).
    if HOST_DESC:
        q_smem = gl.allocate_shared_memory(dtype, [2, 1, HALF_N, D], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 1, HALF_N, D], q_layout)
    else:
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, D], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, D], q_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    k_smem, v_smem, k_full, k_empty, v_full, v_empty = _kv_ring(dtype, D, BLOCK_N, STAGES,
                                                                kv_layout, HOST_DESC)

    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, dq_desc, q_bar, k_full, k_empty,
                        v_full, v_empty, p_lse, p_delta, 0, m0, T_q, T_k, shift, left, right,
                        scale, scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles,
                        D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HOST_DESC)),
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, dq_desc, q_bar, k_full, k_empty,
                        v_full, v_empty, p_lse, p_delta, 1, m0, T_q, T_k, shift, left, right,
                        scale, scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles,
                        D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HOST_DESC)),
        (_fwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                         q_bar, k_full, k_empty, v_full, v_empty, m0, n_lo, n_tiles, (),
                         (i_b, i_h * D, i_b, i_hk * D), BLOCK_N, STAGES, True, 0, HOST_DESC)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _dq_consumer_persistent(q_smem, do_smem, dq_smem, k_smem, v_smem, dq_desc,
                            q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                            lse_log2, delta, stride_tb, stride_th, half,
                            n_items, n_m, seqlen_q, seqlen_k, left, right, scale, scale_log2,
                            sched, HQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                            HAS_RIGHT: gl.constexpr, TABLE: gl.constexpr):
    """``_dq_consumer`` over the program's work items (fwd_sm90's persistent forward, the
    backward's row math): Q and dO's buffers go back after an item's last product, dQ is
    staged in its own buffer, whose store is waited for an item later."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    q_t = q_smem.index(half)
    do_t = do_smem.index(half)
    dq_t = dq_smem.index(half)
    t = 0
    j = 0
    col_arange = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([HALF_N, BLOCK_N], gl.float32, layout=s_layout)
    lo, hi, step = _item_span(sched, n_items, TABLE)
    for pos in range(lo, hi, step):
        i_h, i_b, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles = _dense_item(
            sched, pos, n_m, HQ, seqlen_q, seqlen_k, left, right, BLOCK_N, HAS_LEFT,
            HAS_RIGHT, TABLE)
        r0 = m0 + half * HALF_N
        rows = r0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
        o_t = _stats_offset(i_b, 0, i_h, stride_tb, stride_th)
        # Rows past the end: lse = +inf (P = 0), delta = 0.
        lse = gl.load(lse_log2 + o_t + rows, mask=rows < seqlen_q, other=float("inf"))
        dlt = gl.load(delta + o_t + rows, mask=rows < seqlen_q, other=0.0)
        dq = gl.zeros([HALF_N, D], gl.float32, layout=acc_layout)
        mbarrier.wait(q_bar.index(half), j & 1)
        dq = _dq_tiles(q_t, do_t, k_smem, v_smem, k_full, k_empty, v_full, v_empty, dq,
                       s_zero, rows, col_arange, lse, dlt, seqlen_k, shift, left, right,
                       scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles, t,
                       BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, op_layout)
        mbarrier.arrive(q_empty.index(half))
        t += n_tiles
        j += 1
        # The last item's store has read the buffer (its issuing thread waits, the
        # warpgroup's barrier holds the others).
        tma.store_wait(0)
        gl.thread_barrier()
        dq_t.store((dq * scale).to(dtype))
        fence_async_shared()
        # A half past the sequence's end holds the next sequence's rows: not stored.
        if r0 < seqlen_q:
            tma.async_copy_shared_to_global(dq_desc, [i_b * seqlen_q + r0, i_h * D], dq_t)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["batch", "seqlen_q", "seqlen_k", "n_items", "left", "right"])
def _dq_sm90_persistent_kernel(
    q, k, v, dout, lse_log2, delta, dq,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_rows, stride_tb, stride_th,
    batch, seqlen_q, seqlen_k, n_items, left, right, scale, scale_log2, sched,
    GROUP: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    TABLE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """The dQ kernel as a persistent kernel, as fwd_sm90's ``_fwd_sm90_persistent_kernel``
    (the same work items, layouts and schedules; ``fwd_sm90.persistent_layout`` admits the
    call's q, k, v, dO and dQ). ``stride_rows``: those of q, k, v, dO, dQ."""
    stride_qs, stride_ks, stride_vs, stride_dos, stride_dqs = stride_rows
    dtype: gl.constexpr = q.dtype.element_ty
    n_m = (seqlen_q + 2 * HALF_N - 1) // (2 * HALF_N)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, D], dtype)
    rows_q = batch * seqlen_q
    q_desc = tma.make_tensor_descriptor(q, [rows_q, HQ * D], [stride_qs, 1], [HALF_N, D],
                                        q_layout)
    do_desc = tma.make_tensor_descriptor(dout, [rows_q, HQ * D], [stride_dos, 1], [HALF_N, D],
                                         q_layout)
    dq_desc = tma.make_tensor_descriptor(dq, [rows_q, HQ * D], [stride_dqs, 1], [HALF_N, D],
                                         q_layout)
    k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_full, k_empty, v_full, v_empty \
        = _persistent_buffers(k, v, stride_ks, stride_vs, batch * seqlen_k, HQ // GROUP, D,
                              BLOCK_N, STAGES, q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, D], q_layout)
    dq_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, D], q_layout)
    gl.warp_specialize([
        (_dq_consumer_persistent, (q_smem, do_smem, dq_smem, k_smem, v_smem, dq_desc, q_bar,
                                   q_empty, k_full, k_empty, v_full, v_empty, lse_log2, delta,
                                   stride_tb, stride_th, 0, n_items, n_m, seqlen_q, seqlen_k,
                                   left, right, scale, scale_log2, sched, HQ, D, BLOCK_N,
                                   STAGES, HAS_LEFT, HAS_RIGHT, TABLE)),
        (_dq_consumer_persistent, (q_smem, do_smem, dq_smem, k_smem, v_smem, dq_desc, q_bar,
                                   q_empty, k_full, k_empty, v_full, v_empty, lse_log2, delta,
                                   stride_tb, stride_th, 1, n_items, n_m, seqlen_q, seqlen_k,
                                   left, right, scale, scale_log2, sched, HQ, D, BLOCK_N,
                                   STAGES, HAS_LEFT, HAS_RIGHT, TABLE)),
        (_producer_persistent, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem,
                                v_smem, q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                                n_items, n_m, seqlen_q, seqlen_k, left, right, sched,
                                GROUP, HQ, D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, TABLE,
                                True)),
    ], [4, 1], [CONSUMER_REGS, 24])


# The dQ kernel's head dims: those of its tile table (configs.BWD_SM90_DQ).
DQ_DIMS = tuple(configs.BWD_SM90_DQ)


def dq_plan(p: BwdPass) -> Launch | None:
    """The dQ launch of a prepared backward, or None outside :func:`supported`'s domain with
    ``dims=DQ_DIMS``: ``bwd.attn_bwd_dq``'s peer, kept in the call's plan as :func:`dkdv_plan`."""
    run = p.plan.launches.get("sm90 dQ", _MISSING)
    if run is _MISSING:
        run = None
        if supported(p.q, p.k, p.v, p.dout, p.dq, p.dq, softcap=p.softcap, dims=DQ_DIMS):
            args = p.plan.dq_kw
            cfg = configs.BWD_SM90_DQ[p.q.shape[-1]]
            tiles = dict(BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                         CONSUMER_REGS=cfg.consumer_regs, num_warps=cfg.num_warps)
            kernel, grid = _dq_sm90_kernel, (cdiv(p.seqlen_q, 2 * HALF_N), p.hq, p.batch)
            persistent = _dq_persistent(p, args, cfg)
            host = False
            if persistent is not None:
                kernel, grid = _dq_sm90_persistent_kernel, persistent[0]
                tiles.update(persistent[1])
            else:
                host = DQ_HOST_DESC and _host_desc_ok(p, p.dq)
                tiles["HOST_DESC"] = host
            run = Launch(kernel, grid, *positional(kernel, 10, _kernel_args(kernel, args, tiles)))
            if host:
                run = _HostDescs(run, _dq_host_spec(p.q.dtype, p.q.shape[-1], cfg.block_n),
                                 p.seqlen_q)
        p.plan.launches["sm90 dQ"] = run
    return run


def _dq_persistent(p: BwdPass, args: dict, cfg) -> tuple | None:
    """The persistent dQ kernel's grid and extra arguments for a call it applies to, or
    None: asked for (``configs.BWD_SM90_DQ``'s ``persistent``, or ``bwd_config``'s
    PERSISTENT), a dense call without seqused_k whose q, k, v, dO and dQ the forward's
    persistent kernel could address, Q, dO, dQ and the ring within shared memory, and the
    forward's rule for the schedule (its round robin where balanced, else none: the host's
    table is the forward's option only)."""
    if not (cfg.persistent or p.plan.dq_cfg.persistent) or p.cu_seqlens_q is not None:
        return None
    if p.seqused_k is not None:
        return None
    shared = dict(BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, HAS_LEFT=args["HAS_LEFT"],
                  HAS_RIGHT=args["HAS_RIGHT"], left=args["left"], right=args["right"])
    if fwd_sm90._ring_bytes(p.q, shared, 3) > fwd_sm90.SMEM_BYTES:  # Q, dO, dQ
        return None
    if not fwd_sm90.persistent_layout(p.q, p.k, (p.q, p.k, p.v, p.dout, p.dq), cfg.block_n):
        return None
    programs = fwd_sm90._persistent_programs(p.seqlen_q, p.seqlen_k, p.batch * p.hq, shared,
                                             fwd_sm90._sm_count(p.q.device))
    if not programs:
        return None
    n_items = p.batch * p.hq * cdiv(p.seqlen_q, 2 * HALF_N)
    stride_rows = tuple(t.stride(1) for t in (p.q, p.k, p.v, p.dout, p.dq))
    return (programs, ), dict(stride_rows=stride_rows, batch=p.batch, n_items=n_items,
                              sched=None, HQ=p.hq, TABLE=False)


def attn_bwd_dq_sm90(p: BwdPass) -> None:
    """dQ of a prepared backward inside :func:`supported`'s domain (tests and benchmarks;
    ``dispatch.attn_bwd`` goes through :func:`dq_plan`)."""
    triton.set_allocator(alloc_scratch)
    dq_plan(p)(*p.dq_tensors())
