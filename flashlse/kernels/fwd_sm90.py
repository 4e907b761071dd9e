"""Hopper forward: two consumer warpgroups and a TMA producer warp (Gluon, warp-specialised).

Same math and contract as ``fwd.py`` (its docstring has the derivation): base-2 online
softmax, ``inv_sum = 0`` for a row that saw no key, so out = 0 and lse = -inf (or the sink).
What changes is the schedule, which ``tl`` cannot express (benchmarks/NOTES.md, forward #8,
#12, #13): in the ``tl`` kernel both warpgroups of a 128-row block meet at a barrier every key
tile, so the exponentials of one tile never run under the matrix products of another.

Here a program owns 128 query rows of one (sequence, head) and splits them into two 64-row
halves, each owned by one warpgroup (``gl.warp_specialize``):

- one producer warp loads the two Q halves once, then K and V tiles into a ring of STAGES
  buffers, each guarded by a *full* barrier (TMA bytes arrived) and an *empty* barrier (both
  warpgroups are done with it: two arrivals);
- each consumer warpgroup runs, per key tile, ``S = Q_half K^T`` (wgmma from shared memory),
  the online softmax in registers, ``acc += P V`` with P from registers, and releases K as
  soon as S is complete and V as soon as the product is. With OVERLAP (FA-3's
  intra-warpgroup pipelining) ``S_{j+1}`` and ``P_j V_j`` are issued together and the
  softmax of tile j + 1 runs while ``P_j V_j`` is in flight.
- PINGPONG (FA-3's inter-warpgroup schedule: the warpgroups take turns to issue products
  through two barriers) is kept as an option; measured on an H200 it did not pay once the
  warpgroups run free of each other (NOTES #15, #17).

The persistent form (``_fwd_sm90_persistent_kernel``, dense calls whose tensors are
``(B * S, H * D)`` matrices with ``S_q % 64 == S_k % BLOCK_N == 0``) runs the same consumers
and producer over a list of row blocks per program, one program per SM: the ring and the Q
buffers carry on from block to block, so a block's prologue and epilogue (~3 key tiles' time
at S = 1k) overlap its neighbours' work. At D = 64 its blocks are 192 rows on three consumer
warpgroups (FA-3's tile there), aligned to the sequence's end, each warpgroup on its own
rows' key tiles, one after the other. Each program takes every P-th block in the grid's
order (``_persistent_programs`` picks P, or declines when that spreads unequal causal blocks
badly), or its list of the host's greedy schedule (``_greedy_table``, PERSISTENT_TABLE).

Packed varlen calls run a persistent form too (``_fwd_sm90_varlen_kernel``,
PERSISTENT_VARLEN): the host cannot read ``cu_seqlens`` without a sync, so a small Triton
kernel (``_varlen_blocks_kernel``) lists the row blocks on the device, longest first, each
with its sequence's bounds, and the programs deal them out in sections of heads whose K/V
fits in L2 (``_varlen_load``). Its descriptors span the packed tensors whole (none is made per
sequence), so a tile can reach into the next sequence: Q's rows there are computed and not
stored, K's columns are masked, V's rows are zeroed in shared memory before the product
(``_zero_rows``: ``P V`` with ``P = 0`` is NaN where V is, and another sequence's bad data
must not reach this one), and a Q half that ends past its sequence is stored from registers.

Paged caches (``_fwd_sm90_paged_kernel``: ``attention_varlen`` with a block table, the paged
prefill of ``attention_with_kvcache``) run the same program and consumers; only the producer
differs, two warps (K; V) instead of one. Each copies a key tile page by page, one TMA box a
page for pages of 16, 32 or 64 rows (row slices of the swizzled tile) or one box a tile for
pages of a multiple of BLOCK_N, through a descriptor over the kv head's whole cache, the
tile's block-table entries read a tile ahead (``_paged_tiles``). A box that reaches the
sequence's length comes from a second descriptor, the last page's rows up to the length, so
the cache rows past it (any bits, NaN included) read as zeros. The grid covers the row
blocks of the sequences of more than 16 packed rows only (``_long_block``): the decodes of a
mixed step run fwd.py's paged kernel, which packs the query heads of a kv head into a tile
(PackGQA).

Fast path only: sm_90, fp16/bf16, D == Dv with a tile in ``configs.FWD_SM90`` (64 and 128,
and 256 with 64-key tiles; the paged kernel 128 only), scale > 0, no softcap, 16-byte aligned
rows, at most 65535 sequences and heads (grid y/z); every mask, GQA, sink, varlen and seqused_k
are handled. Everything else goes to ``fwd.py``, and at D = 64 so do the calls neither
persistent kernel takes (``TileConfig.grid`` off: the grid kernel measured slower than fwd.py's
there below 8k, NOTES #18; the persistent kernel 10-20% faster, session 18). Gluon does not
run under TRITON_INTERPRET: CI compiles this kernel for sm_90
(tests/test_kernels_compile_sm90.py) and tests fwd.py's kernel, the same math; the H200 runs
tests/kernels/test_fwd.py's ``sm90`` cases.
"""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import combine, configs, options
from ._common import (
    LOG2E,
    Launch,
    SizedLaunch,
    alloc_scratch,
    capability,
    cdiv,
    final_stats,
    key_ranges,
    next_pow2,
    paged_keys,
    positional,
    row_starts,
    seq_args,
    seq_block,
    seq_spans,
    slice_ptr,
    strides,
    tma_ok,
)

# The shared scalar helpers (_common: sequence block, key-tile ranges, slice pointers),
# compiled as Gluon functions.
_seq_block = gluon.jit(seq_block.fn)
_key_ranges = gluon.jit(key_ranges.fn)
_slice_ptr = gluon.jit(slice_ptr.fn)
_final_stats = gluon.jit(final_stats.fn)
_paged_keys = gluon.jit(paged_keys.fn)
_seq_spans = gluon.jit(seq_spans.fn)

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
# The consumer loops' register-lean form (FA-3's order) up to these head dims: the masks as
# row bounds against immediates (``_visible``), and P converted to the product's operand as
# soon as its float32 form dies (``_consumer_loop_overlap``). H200, session 43, both on: D =
# 128 +0.5-6.5% on every row of the forward table, D = 64 level to +8% (causal S = 1k);
# D = 256 1-3.5% slower, so it keeps the plain form (which of the two cost it: not measured).
ROW_BOUNDS_MAX_D = gl.constexpr(128)
EARLY_P_MAX_D = gl.constexpr(128)
# Ints a row block of the persistent varlen kernel's list: bos, bos_k, T_q, T_k, first row.
VARLEN_ITEM = gl.constexpr(5)


@gluon.jit
def _row_block(seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k,
               GROUP: gl.constexpr, BLOCK_M: gl.constexpr, IS_VARLEN: gl.constexpr,
               HAS_SEQUSED_K: gl.constexpr):
    """The program's query head ``i_h`` (kv head ``i_hk``), sequence ``i_b`` and its
    ``_seq_block`` (the forward's and the backward dQ's grid: row block, head, sequence). The
    last row block runs first: under a causal mask it has the most keys. ``i_m < 0``: the
    block is past its sequence's end and the caller returns. The caller computes the key
    tiles after that test: computed in here, before it, they moved in the sm_90 PTX and changed
    the SASS of the every-flag forward."""
    i_m_rev = gl.program_id(0)
    i_h = gl.program_id(1)
    i_b = gl.program_id(2)
    i_hk = i_h // GROUP
    bos, bos_k, T_q, T_k, i_m, m0, m_last, shift = _seq_block(
        i_b, i_m_rev, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
        seqused_k, BLOCK_M, False, True, IS_VARLEN, HAS_SEQUSED_K)
    return i_h, i_b, i_hk, bos, bos_k, T_q, T_k, i_m, m0, m_last, shift


@gluon.jit
def _tile_coord(at, i: gl.constexpr, row, RANK3: gl.constexpr):
    """TMA coordinates of row ``row``: ``[row, 0]`` in a program's own rank-2 descriptor, or
    ``[at[i], row, at[i + 1]]`` in a rank-3 one over ``(B, S, H * D)`` (batch, column)."""
    if RANK3:
        return [at[i], row, at[i + 1]]
    else:
        return [row, 0]


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
              q_bar, k_full, k_empty, v_full, v_empty,
              m0, n_lo, n_tiles, paged_args, at,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_DO: gl.constexpr,
              PAGE_SIZE: gl.constexpr, RANK3: gl.constexpr = False):
    """One warp: both Q halves (and dO's, for the backward's dQ: HAS_DO) once, then K_j and
    V_j into the ring, each when it is free (of a paged cache when PAGE_SIZE > 0:
    ``_paged_tiles``, ``paged_args`` its sources). ``RANK3`` (the backward dQ on host
    descriptors, no pages): ``at`` holds Q's batch and column, then K's (``_tile_coord``);
    ``()`` otherwise."""
    for half in gl.static_range(2):
        row = _tile_coord(at, 0, m0 + half * HALF_M, RANK3)
        if HAS_DO:
            mbarrier.expect(q_bar.index(half),
                            q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, row, q_bar.index(half),
                                            do_smem.index(half))
        else:
            mbarrier.expect(q_bar.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, row, q_bar.index(half), q_smem.index(half))
    if PAGE_SIZE == 0:
        for it in range(n_tiles):
            s = it % STAGES
            # A fresh barrier counts as having completed the phase before 0, so the first
            # pass over the ring does not wait.
            ph = ((it // STAGES) & 1) ^ 1
            n0 = n_lo + it * BLOCK_N
            key = _tile_coord(at, 2, n0, RANK3)
            mbarrier.wait(k_empty.index(s), ph)
            mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, key, k_full.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph)
            mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, key, v_full.index(s), v_smem.index(s))
    else:
        _paged_tiles(k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty, n_lo,
                     n_tiles, paged_args, BLOCK_N, STAGES, PAGE_SIZE, True, False)


@gluon.jit
def _paged_tiles(k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty, n_lo,
                 n_tiles, paged_args, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, DO_K: gl.constexpr, DO_V: gl.constexpr, t0=0, col=0,
                 TAIL: gl.constexpr = True):
    """The K tiles (DO_K: ``_producer``) or the V tiles (DO_V: the paged kernel's second
    producer warp, this function itself as its partition) of a paged cache (``paged_args``:
    the tail descriptors of K and V, the block-table row, the length, the last page's first
    key), page by page (``_paged_copy``), into the ring from its ``t0``-th buffer (the
    persistent kernel's count runs across items), at column ``col`` of the descriptors. A
    tile's block-table entries are loaded together, a tile ahead (``_tile_pages``): the warp
    waits for a free buffer while they arrive, instead of on each entry's load between two
    copies. ``TAIL``: see ``_paged_copy``."""
    k_tail, v_tail, p_bt, T_k, last_start = paged_args
    pages = _tile_pages(p_bt, n_lo, T_k, PAGE_SIZE, BLOCK_N, TAIL)
    for it in range(n_tiles):
        s = (t0 + it) % STAGES
        ph = (((t0 + it) // STAGES) & 1) ^ 1
        n0 = n_lo + it * BLOCK_N
        if DO_K:
            mbarrier.wait(k_empty.index(s), ph)
            _paged_copy(k_desc, k_tail, k_full.index(s), k_smem.index(s), pages, n0, T_k,
                        last_start, col, PAGE_SIZE, BLOCK_N, TAIL)
        later = _tile_pages(p_bt, n0 + BLOCK_N, T_k, PAGE_SIZE, BLOCK_N, TAIL)
        if DO_V:
            mbarrier.wait(v_empty.index(s), ph)
            _paged_copy(v_desc, v_tail, v_full.index(s), v_smem.index(s), pages, n0, T_k,
                        last_start, col, PAGE_SIZE, BLOCK_N, TAIL)
        pages = later


@gluon.constexpr_function
def _wgmma_layout(n):
    """The accumulator layout of a consumer warpgroup's ``[64, n]`` products."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _q_buffers(dtype: gl.constexpr, D: gl.constexpr, q_layout: gl.constexpr,
               BUFS: gl.constexpr = 1, WG: gl.constexpr = 2):
    """``BUFS`` buffers of the ``WG`` Q parts of a row block, one a consumer warpgroup (slot
    ``WG * buffer + part``), and two single-arrival barriers a slot: Q's *full* (the
    producer's expect, completed by the TMA bytes) and a second one the caller names (the
    ping-pong turns; the persistent kernel's Q *empty*)."""
    q_smem = gl.allocate_shared_memory(dtype, [WG * BUFS, HALF_M, D], q_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [WG * BUFS, 1], bar_layout)
    other = gl.allocate_shared_memory(gl.int64, [WG * BUFS, 1], bar_layout)
    for i in gl.static_range(WG * BUFS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(other.index(i), count=1)
    return q_smem, q_bar, other


@gluon.jit
def _kv_ring(dtype: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, kv_layout: gl.constexpr, LEAD: gl.constexpr = False,
             WG: gl.constexpr = 2):
    """The ring ``_producer`` loads K and V tiles into (the forward's and the backward dQ's):
    STAGES buffers of each, a *full* barrier a buffer (the producer's expect, completed by
    the TMA bytes) and an *empty* one (``WG`` arrivals: one from each consumer warpgroup).
    ``kv_layout`` is the caller's, that of its K/V descriptors: TMA copies need the same
    (``LEAD``: tiles ``[1, BLOCK_N, D]``, the box of a rank-3 descriptor)."""
    if LEAD:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, D], kv_layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=WG)
        mbarrier.init(v_empty.index(i), count=WG)
    return k_smem, v_smem, k_full, k_empty, v_full, v_empty


@gluon.jit
def _visible(n0, rows, T_k, shift, left, right, HAS_LEFT: gl.constexpr,
             HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
             ROW_BOUNDS: gl.constexpr):
    """Which scores of key tile ``[n0, n0 + BLOCK_N)`` rows ``rows`` see: keys below ``T_k``
    within the window (``shift``: the bottom-right alignment's offset)."""
    if ROW_BOUNDS:
        # Each row's bounds relative to the tile and to this thread's own column offset
        # (``own``: in the wgmma accumulator a thread's columns are 2 (lane % 4) plus
        # constants), compared with those constants: immediates, where the columns
        # themselves would be ~32 registers kept live across the loop (FA-3's form).
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        own = cols & 6
        rel = (cols - own)[None, :]
        hi = gl.zeros_like(rows) + (T_k - n0)
        if HAS_RIGHT:
            hi = gl.minimum(hi, rows + (shift + right + 1 - n0))
        vis = rel < hi[:, None] - own[None, :]
        if HAS_LEFT:
            vis = vis & (rel >= (rows + (shift - left - n0))[:, None] - own[None, :])
    else:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = cols[None, :] < T_k
        if HAS_RIGHT:
            vis = vis & (cols[None, :] <= rows[:, None] + shift + right)
        if HAS_LEFT:
            vis = vis & (cols[None, :] >= rows[:, None] + shift - left)
    return vis


@gluon.jit
def _softmax_tile(s_acc, m_i, l_i, n0, rows, T_k, shift, left, right, scale_log2,
                  MASK: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                  ROW_BOUNDS: gl.constexpr = False):
    """Online-softmax step for raw scores ``s_acc`` of key tile ``[n0, n0 + BLOCK_N)``:
    returns the probabilities (unnormalised, base 2), the rescale factor and the new state.
    ``ROW_BOUNDS``: the mask's register-lean form (``_visible``)."""
    if MASK:
        vis = _visible(n0, rows, T_k, shift, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                       s_layout, ROW_BOUNDS)
        t = gl.where(vis, s_acc * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(t, 1))
        # A row with no visible key yet keeps m = -inf; pivot on 0 so 2^(-inf - 0) = 0.
        piv = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(t - piv[:, None])
    else:
        # Every score finite: the new max is finite, the scale folds into one FMA.
        m_new = gl.maximum(m_i, gl.max(s_acc, 1) * scale_log2)
        piv = m_new
        p = gl.exp2(s_acc * scale_log2 - piv[:, None])
    alpha = gl.exp2(m_i - piv)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _softmax_any(s_acc, m_i, l_i, n0, rows, T_k, shift, left, right, scale_log2,
                 n_full_lo, n_full_hi, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                 ROW_BOUNDS: gl.constexpr = False):
    """``_softmax_tile`` with the mask only on tiles outside the full middle."""
    if (n0 < n_full_lo) | (n0 >= n_full_hi):
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, n0, rows, T_k, shift, left, right,
                                           scale_log2, True, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                                           s_layout, ROW_BOUNDS)
    else:
        p, alpha, m_i, l_i = _softmax_tile(s_acc, m_i, l_i, n0, rows, T_k, shift, left, right,
                                           scale_log2, False, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                                           s_layout, ROW_BOUNDS)
    return p, alpha, m_i, l_i


@gluon.jit
def _zero_rows(tile, n_valid, BLOCK_N: gl.constexpr):
    """Zero the rows ``[n_valid, BLOCK_N)`` of a K/V ring buffer the TMA has filled, in
    32-row slices, before a product reads it: ``P V`` with ``P = 0`` on those keys is still
    NaN where V is (another sequence's bad data must not reach this one). Every consumer
    warpgroup that reads the buffer runs it: each writes back the values it read, zeros past
    ``n_valid``, so none can see another's write as anything but a zero it also writes,
    and each fences its own writes before its product."""
    if n_valid < BLOCK_N:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        for c in gl.static_range(BLOCK_N // 32):
            if (c + 1) * 32 > n_valid:
                part = tile.slice(c * 32, 32)
                x = part.load(layout)
                rows = c * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
                part.store(gl.where(rows[:, None] < n_valid, x, gl.zeros_like(x)))
        fence_async_shared()


@gluon.jit
def _consumer_loop_overlap(q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, half,
                           acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
                           n_lo, n_full_lo, n_full_hi, n_tiles, t0,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           PINGPONG: gl.constexpr, s_layout: gl.constexpr,
                           o_layout: gl.constexpr, p_layout: gl.constexpr,
                           V_TAIL: gl.constexpr = False):
    """FA-3's intra-warpgroup overlap: ``S_{j+1} = Q K_{j+1}^T`` and ``acc += P_j V_j`` are
    issued together, and the softmax of tile j + 1 runs while ``P_j V_j`` is in flight.
    The block's tiles are the ring's ``t0``-th and on (the persistent kernel's earlier
    blocks took the ``t0`` before; 0 elsewhere). ``V_TAIL`` (the persistent varlen kernel,
    whose tiles come from descriptors over the whole packed tensor): the last V tile's rows
    from ``T_k`` on, the next sequence's, are zeroed before its product (``_zero_rows``).
    Up to ``EARLY_P_MAX_D``, P becomes the product's operand as soon as nothing else needs its
    registers (after the softmax, after the O wait in the loop): the loop carries it in q's
    dtype, not float32 (FA-3's order; 32 registers a thread less across the back edge)."""
    dtype: gl.constexpr = q_tile.dtype
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    ROW_BOUNDS: gl.constexpr = acc.shape[1] <= ROW_BOUNDS_MAX_D
    EARLY_P: gl.constexpr = acc.shape[1] <= EARLY_P_MAX_D
    if n_tiles > 0:
        mbarrier.wait(k_full.index(t0 % STAGES), (t0 // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(half), 0)
        s_tok = warpgroup_mma(q_tile, k_smem.index(t0 % STAGES).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - half))
        s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(t0 % STAGES))
        p, alpha, m_i, l_i = _softmax_any(s_acc, m_i, l_i, n_lo, rows, T_k, shift, left, right,
                                          scale_log2, n_full_lo, n_full_hi,
                                          HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout, ROW_BOUNDS)
        if EARLY_P:
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        for it in range(n_tiles - 1):
            s = (t0 + it) % STAGES
            s1 = (t0 + it + 1) % STAGES
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            if not EARLY_P:
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(k_full.index(s1), ((t0 + it + 1) // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(half), (it + 1) & 1)
            s_tok = warpgroup_mma(q_tile, k_smem.index(s1).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_full.index(s), ((t0 + it) // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - half))
            s_acc = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(s1))
            p, alpha, m_i, l_i = _softmax_any(s_acc, m_i, l_i, n_lo + (it + 1) * BLOCK_N, rows,
                                              T_k, shift, left, right, scale_log2,
                                              n_full_lo, n_full_hi,
                                              HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout,
                                              ROW_BOUNDS)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_empty.index(s))
            if EARLY_P:
                p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = t0 + n_tiles - 1
        s = last % STAGES
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        if not EARLY_P:
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_full.index(s), (last // STAGES) & 1)
        if V_TAIL:
            _zero_rows(v_smem.index(s), T_k - n_lo - (n_tiles - 1) * BLOCK_N, BLOCK_N)
        if PINGPONG:
            mbarrier.wait(turn.index(half), n_tiles & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - half))
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(s))
    return acc, m_i, l_i


@gluon.jit
def _consumer_loop_plain(q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, half,
                         acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
                         n_lo, n_full_lo, n_full_hi, n_tiles, t0,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         PINGPONG: gl.constexpr, s_layout: gl.constexpr,
                         o_layout: gl.constexpr, p_layout: gl.constexpr,
                         V_TAIL: gl.constexpr = False):
    """The key tiles one after the other: ``S = Q K^T``, the softmax, ``acc += P V``, each
    waiting for the one before (no overlap inside the warpgroup; with three consumer
    warpgroups the others' products run meanwhile). Tiles from the ring's ``t0``-th;
    ``V_TAIL`` as ``_consumer_loop_overlap``'s (the tile that holds ``T_k`` zeroed past it);
    the mask as row bounds up to ``ROW_BOUNDS_MAX_D``, as there."""
    dtype: gl.constexpr = q_tile.dtype
    ROW_BOUNDS: gl.constexpr = acc.shape[1] <= ROW_BOUNDS_MAX_D
    for it in range(n_tiles):
        s = (t0 + it) % STAGES
        ph = ((t0 + it) // STAGES) & 1
        n0 = n_lo + it * BLOCK_N
        mbarrier.wait(k_full.index(s), ph)
        if PINGPONG:
            # My turn to issue products; the other warpgroup's softmax runs meanwhile.
            mbarrier.wait(turn.index(half), it & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        s_acc = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s))
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - half))
        p, alpha, m_i, l_i = _softmax_any(s_acc, m_i, l_i, n0, rows, T_k, shift, left, right,
                                          scale_log2, n_full_lo, n_full_hi,
                                          HAS_LEFT, HAS_RIGHT, BLOCK_N, s_layout, ROW_BOUNDS)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_full.index(s), ph)
        if V_TAIL:
            _zero_rows(v_smem.index(s), T_k - n0, BLOCK_N)
        o_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(s))
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, o_desc,
              q_bar, k_full, k_empty, v_full, v_empty, turn,
              p_lse, sink, i_h, half,
              m0, T_q, T_k, shift, left, right, scale_log2,
              n_lo, n_full_lo, n_full_hi, n_tiles,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
              PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
    """One warpgroup: 64 query rows against every key tile of the block, then the epilogue."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    r0 = m0 + half * HALF_M
    rows = r0 + gl.arange(0, HALF_M, layout=row_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    acc = gl.zeros([HALF_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q_tile = q_smem.index(half)
    mbarrier.wait(q_bar.index(half), 0)

    if OVERLAP:
        acc, m_i, l_i = _consumer_loop_overlap(
            q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, half,
            acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
            n_lo, n_full_lo, n_full_hi, n_tiles, 0,
            BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, s_layout, o_layout, p_layout)
    else:
        acc, m_i, l_i = _consumer_loop_plain(
            q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turn, half,
            acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
            n_lo, n_full_lo, n_full_hi, n_tiles, 0,
            BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, PINGPONG, s_layout, o_layout, p_layout)

    # Epilogue (fwd.py's _attn_fwd_store): out = 0 and lse = -inf (or the sink) for a row
    # with no visible key, a NaN propagates.
    sink_nat = 0.0
    if HAS_SINK:
        sink_nat = gl.load(sink + i_h).to(gl.float32)
    o_scale, lse = _final_stats(m_i, l_i, sink_nat, HAS_SINK)
    gl.store(p_lse + rows, lse, mask=rows < T_q)
    out = acc * gl.convert_layout(o_scale, gl.SliceLayout(1, o_layout))[:, None]
    # Q's buffer is free now: stage out there for one TMA store, clipped at the sequence end.
    q_tile.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [r0, 0], q_tile)
    tma.store_wait(0)


@gluon.jit
def _attend(p_q, p_o, p_k, p_v, p_lse, sink, kv_args, i_h, m0, T_q, T_k, shift, left, right,
            scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles, stride_qs, stride_os,
            D: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
            HAS_SINK: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
            CONSUMER_REGS: gl.constexpr):
    """A block with keys to see (``n_tiles > 0``), after its kernel's prologue: the TMA
    descriptors, the shared memory (the Q halves, the K/V ring, their barriers) and the three
    partitions (two consumer warpgroups, the producer). ``p_k`` / ``p_v`` are the kv head's
    slice of the sequence (dense, PAGE_SIZE 0; ``kv_args`` the row strides) or of the whole
    paged cache (``kv_args``: the block-table row, the page count, the page and row strides):
    the two kernels differ only in the K/V descriptors and how the producer reads a tile."""
    dtype: gl.constexpr = p_q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    # One descriptor per (sequence, head) slice: rows past its end read as zeros and the
    # store of out is clipped there.
    q_desc = tma.make_tensor_descriptor(p_q, [T_q, D], [stride_qs, 1], [HALF_M, D], q_layout)
    o_desc = tma.make_tensor_descriptor(p_o, [T_q, D], [stride_os, 1], [HALF_M, D], q_layout)
    if PAGE_SIZE == 0:
        stride_ks, stride_vs = kv_args
        # (No tile is loaded when T_k == 0; the extent stays >= 1 for a valid descriptor.)
        T_k_desc = gl.maximum(T_k, 1)
        k_desc = tma.make_tensor_descriptor(p_k, [T_k_desc, D], [stride_ks, 1], [BLOCK_N, D],
                                            kv_layout)
        v_desc = tma.make_tensor_descriptor(p_v, [T_k_desc, D], [stride_vs, 1], [BLOCK_N, D],
                                            kv_layout)
        producer_args = ()
    else:
        p_bt, num_pages, stride_kp, stride_ks, stride_vp, stride_vs = kv_args
        BOX: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
        # The whole cache of this kv head as rows (pages are contiguous: stride_kp =
        # PAGE_SIZE rows), and the last page's rows up to the length: see _paged_copy.
        last_start = (T_k - 1) // PAGE_SIZE * PAGE_SIZE
        last_page = gl.load(p_bt + last_start // PAGE_SIZE).to(gl.int64)
        k_desc = tma.make_tensor_descriptor(p_k, [num_pages * PAGE_SIZE, D], [stride_ks, 1],
                                            [BOX, D], kv_layout)
        v_desc = tma.make_tensor_descriptor(p_v, [num_pages * PAGE_SIZE, D], [stride_vs, 1],
                                            [BOX, D], kv_layout)
        k_tail = tma.make_tensor_descriptor(p_k + last_page * stride_kp, [T_k - last_start, D],
                                            [stride_ks, 1], [BOX, D], kv_layout)
        v_tail = tma.make_tensor_descriptor(p_v + last_page * stride_vp, [T_k - last_start, D],
                                            [stride_vs, 1], [BOX, D], kv_layout)
        producer_args = (k_tail, v_tail, p_bt, T_k, last_start)

    q_smem, q_bar, turn = _q_buffers(dtype, D, q_layout)
    k_smem, v_smem, k_full, k_empty, v_full, v_empty = _kv_ring(dtype, D, BLOCK_N, STAGES,
                                                                kv_layout)
    # Warpgroup 0 issues first.
    mbarrier.arrive(turn.index(0))

    if PAGE_SIZE == 0:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_full, k_empty, v_full, v_empty,
                         turn, p_lse, sink, i_h, 0, m0, T_q, T_k, shift, left, right, scale_log2,
                         n_lo, n_full_lo, n_full_hi, n_tiles, D, BLOCK_N, STAGES, HAS_LEFT,
                         HAS_RIGHT, HAS_SINK, PINGPONG, OVERLAP)),
            (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_full, k_empty, v_full, v_empty,
                         turn, p_lse, sink, i_h, 1, m0, T_q, T_k, shift, left, right, scale_log2,
                         n_lo, n_full_lo, n_full_hi, n_tiles, D, BLOCK_N, STAGES, HAS_LEFT,
                         HAS_RIGHT, HAS_SINK, PINGPONG, OVERLAP)),
            (_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_bar,
                         k_full, k_empty, v_full, v_empty, m0, n_lo, n_tiles, producer_args,
                         (), BLOCK_N, STAGES, False, PAGE_SIZE)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        # A second producer warp for V's page boxes (RESULTS.md, session 16: page 16 0.78x ->
        # 0.94x the dense kernel): two warps wait on block-table loads and issue boxes.
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_full, k_empty, v_full, v_empty,
                         turn, p_lse, sink, i_h, 0, m0, T_q, T_k, shift, left, right, scale_log2,
                         n_lo, n_full_lo, n_full_hi, n_tiles, D, BLOCK_N, STAGES, HAS_LEFT,
                         HAS_RIGHT, HAS_SINK, PINGPONG, OVERLAP)),
            (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_full, k_empty, v_full, v_empty,
                         turn, p_lse, sink, i_h, 1, m0, T_q, T_k, shift, left, right, scale_log2,
                         n_lo, n_full_lo, n_full_hi, n_tiles, D, BLOCK_N, STAGES, HAS_LEFT,
                         HAS_RIGHT, HAS_SINK, PINGPONG, OVERLAP)),
            (_producer, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_bar,
                         k_full, k_empty, v_full, v_empty, m0, n_lo, n_tiles, producer_args,
                         (), BLOCK_N, STAGES, False, PAGE_SIZE)),
            (_paged_tiles, (k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                            n_lo, n_tiles, producer_args, BLOCK_N, STAGES, PAGE_SIZE, False,
                            True)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, 24])


@gluon.jit
def _store_empty(p_o, p_lse, sink, i_h, stride_os, m0, T_q, dtype: gl.constexpr,
                 D: gl.constexpr, BLOCK_M: gl.constexpr, HAS_SINK: gl.constexpr):
    """The empty state (``_final_stats`` of no key) for rows ``[m0, m0 + BLOCK_M)`` below
    ``T_q``: out = 0 and lse = -inf, or the sink; a NaN or +inf sink makes out NaN, as on
    every other path (0 / (0 + e^sink))."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    sink_nat = 0.0
    if HAS_SINK:
        sink_nat = gl.load(sink + i_h).to(gl.float32)
    o_scale, lse = _final_stats(gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout),
                                gl.zeros([BLOCK_M], gl.float32, row_layout), sink_nat, HAS_SINK)
    out = gl.zeros([BLOCK_M, D], gl.float32, layout=layout) * o_scale[:, None]
    p_out = p_o + rows[:, None].to(gl.int64) * stride_os + cols[None, :]
    gl.store(p_out, out.to(dtype), mask=rows[:, None] < T_q)
    gl.store(p_lse + rows, lse, mask=rows < T_q)


# Lengths and window bounds change per call; specialising on them only recompiles.
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "total_q", "total_k", "left", "right"])
def _fwd_sm90_kernel(
    q, k, v, o, lse, sink,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_q, stride_k, stride_v, stride_o, stride_l,
    seqlen_q, seqlen_k, total_q, total_k, left, right, scale_log2,
    GROUP: gl.constexpr, D: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
    IS_VARLEN: gl.constexpr, HAS_SEQUSED_K: gl.constexpr, PINGPONG: gl.constexpr,
    OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """The dense and varlen forward. Strides come as tuples (``_common.strides``): q, k, v and
    o (batch, row, head), lse (batch, head); varlen tensors have batch stride 0."""
    stride_qb, stride_qs, stride_qh = stride_q
    stride_kb, stride_ks, stride_kh = stride_k
    stride_vb, stride_vs, stride_vh = stride_v
    stride_ob, stride_os, stride_oh = stride_o
    stride_lb, stride_lh = stride_l
    BLOCK_M: gl.constexpr = 2 * HALF_M
    i_h, i_b, i_hk, bos, bos_k, T_q, T_k, i_m, m0, m_last, shift = _row_block(
        seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k, GROUP,
        BLOCK_M, IS_VARLEN, HAS_SEQUSED_K)
    if i_m < 0:
        return

    # Key tiles some row sees [n_lo, n_hi), and the full middle [n_full_lo, n_full_hi).
    n_lo, n_full_lo, n_full_hi, n_hi = _key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N,
                                                   HAS_LEFT, HAS_RIGHT)
    n_tiles = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N

    p_q = _slice_ptr(q, i_b, bos, i_h, stride_qb, stride_qs, stride_qh)
    p_k = _slice_ptr(k, i_b, bos_k, i_hk, stride_kb, stride_ks, stride_kh)
    p_v = _slice_ptr(v, i_b, bos_k, i_hk, stride_vb, stride_vs, stride_vh)
    p_o = _slice_ptr(o, i_b, bos, i_h, stride_ob, stride_os, stride_oh)
    p_lse = lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + bos

    dtype: gl.constexpr = q.dtype.element_ty
    if n_tiles == 0:
        # No row of the block sees a key: store the empty state, build and load nothing.
        _store_empty(p_o, p_lse, sink, i_h, stride_os, m0, T_q, dtype, D, BLOCK_M, HAS_SINK)
        return
    _attend(p_q, p_o, p_k, p_v, p_lse, sink, (stride_ks, stride_vs), i_h, m0, T_q, T_k, shift,
            left, right, scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles, stride_qs, stride_os,
            D, 0, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, PINGPONG, OVERLAP,
            CONSUMER_REGS)


@gluon.jit
def _dense_item(sched, pos, n_m, hq, seqlen_q, seqlen_k, left, right, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, TABLE: gl.constexpr,
                WG: gl.constexpr = 2):
    """The persistent kernel's work item at position ``pos`` of ``_item_span``'s loop (the
    position itself, or ``TABLE``: the host schedule's entry): an index in the grid's order
    (row block of ``WG * 64`` rows fastest, the last first, then head, then sequence). Its
    head, sequence, first row, the masks' shift and the key tiles of ``_key_ranges``. With
    three parts (``WG = 3``) the blocks end at the sequence's end, so the partial one is the
    first (under a causal mask the cheapest) and its first row may be negative (its parts
    there compute nothing); with two they start at row 0."""
    item = pos
    if TABLE:
        item = gl.load(sched + gl.num_programs(0) + 1 + pos)
    i_m = n_m - 1 - item % n_m
    rest = item // n_m
    i_h = rest % hq
    i_b = rest // hq
    if WG == 3:
        m0 = seqlen_q - (n_m - i_m) * (WG * HALF_M)
        m_first = gl.maximum(m0, 0)
    else:
        m0 = i_m * (WG * HALF_M)
        m_first = m0
    m_last = gl.minimum(m0 + WG * HALF_M, seqlen_q) - 1
    shift = seqlen_k - seqlen_q
    n_lo, n_full_lo, n_full_hi, n_hi = _key_ranges(m_first, m_last, seqlen_k, shift, left,
                                                   right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    n_tiles = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N
    return i_h, i_b, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles


@gluon.jit
def _item_span(sched, n_items, TABLE: gl.constexpr):
    """The program's work items as a loop ``range(lo, hi, step)`` of positions: the round
    robin ``program_id, program_id + num_programs, ...`` (items are positions), or its span
    of the host's schedule (``TABLE``: ``sched`` holds ``num_programs + 1`` offsets, then the
    items, ``_dense_item``)."""
    if TABLE:
        lo = gl.load(sched + gl.program_id(0))
        hi = gl.load(sched + gl.program_id(0) + 1)
        step = 1
    else:
        lo = gl.program_id(0)
        hi = n_items
        step = gl.num_programs(0)
    return lo, hi, step


@gluon.jit
def _producer_persistent(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                         q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                         n_items, n_m, seqlen_q, seqlen_k, left, right, sched,
                         GROUP: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         TABLE: gl.constexpr, HAS_DO: gl.constexpr, Q_BUFS: gl.constexpr = 1,
                         WG: gl.constexpr = 2):
    """``_producer`` over the program's work items: each item's ``WG`` Q parts (and dO's,
    for the backward's dQ: HAS_DO) once their consumers are done with the ones ``Q_BUFS``
    items before (``q_empty``), its K/V tiles into the one ring whose count ``t`` runs on
    across items, so the next item's first tiles load during this item's last products and
    epilogue. Coordinates are rows of ``(B * S, H * D)``."""
    t = 0
    j = 0
    lo, hi, step = _item_span(sched, n_items, TABLE)
    for pos in range(lo, hi, step):
        i_h, i_b, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles = _dense_item(
            sched, pos, n_m, HQ, seqlen_q, seqlen_k, left, right, BLOCK_N, HAS_LEFT,
            HAS_RIGHT, TABLE, WG)
        row_q = i_b * seqlen_q + m0
        row_k = i_b * seqlen_k + n_lo
        t = _item_loads(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        q_bar, q_empty, k_full, k_empty, v_full, v_empty, row_q, row_k,
                        (i_h // GROUP) * D, i_h, n_tiles, t, j, D, BLOCK_N, STAGES, HAS_DO,
                        Q_BUFS, WG, i_b * seqlen_q)
        j += 1


@gluon.jit
def _item_loads(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                q_bar, q_empty, k_full, k_empty, v_full, v_empty, row_q, row_k, col_k, i_h,
                n_tiles, t, j, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                HAS_DO: gl.constexpr, Q_BUFS: gl.constexpr = 1, WG: gl.constexpr = 2,
                row_0=0):
    """A persistent producer's loads of its ``j``-th item: head ``i_h``'s ``WG`` Q parts
    (and dO's) at rows ``row_q`` into slots ``WG * (j % Q_BUFS) + part`` once their
    consumers are done with the item's there before, then its ``n_tiles`` K/V tiles from
    row ``row_k`` into the ring, whose count ``t`` runs on across items (the new count is
    returned). A part before ``row_0`` (the sequence's first row: ``_dense_item``'s
    three-part blocks) loads nothing; its barrier completes with one arrival."""
    for half in gl.static_range(WG):
        slot = WG * (j % Q_BUFS) + half
        mbarrier.wait(q_empty.index(slot), ((j // Q_BUFS) & 1) ^ 1)
        if WG == 3:
            if row_q + half * HALF_M < row_0:
                mbarrier.arrive(q_bar.index(slot))
            else:
                mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [row_q + half * HALF_M, i_h * D],
                                                q_bar.index(slot), q_smem.index(slot))
        else:
            if HAS_DO:
                mbarrier.expect(q_bar.index(slot),
                                q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(do_desc, [row_q + half * HALF_M, i_h * D],
                                                q_bar.index(slot), do_smem.index(slot))
            else:
                mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row_q + half * HALF_M, i_h * D],
                                            q_bar.index(slot), q_smem.index(slot))
    for it in range(n_tiles):
        s = t % STAGES
        ph = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), ph)
        mbarrier.expect(k_full.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_k + it * BLOCK_N, col_k],
                                        k_full.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph)
        mbarrier.expect(v_full.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k + it * BLOCK_N, col_k],
                                        v_full.index(s), v_smem.index(s))
        t += 1
    return t


@gluon.jit
def _consumer_part(q_smem, o_tile, k_smem, v_smem, o_desc, q_bar, q_empty, k_full, k_empty,
                   v_full, v_empty, lse, stride_lb, stride_lh, sink, half, slot, phase, i_h,
                   i_b, r0, shift, n_lo, n_full_lo, n_full_hi, n_tiles, t, seqlen_q, seqlen_k,
                   left, right, scale_log2, s_zero, D: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                   HAS_SINK: gl.constexpr, O_IN_Q: gl.constexpr, WG: gl.constexpr):
    """``_consumer_persistent``'s work on one item: rows ``r0`` to ``r0 + 63`` of head
    ``i_h`` of sequence ``i_b`` against the item's ``n_tiles`` key tiles from ring position
    ``t`` (Q in ``slot``, whose full barrier completes in ``phase``), then lse and the out
    tile's TMA store."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    rows = r0 + gl.arange(0, HALF_M, layout=row_layout)
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
    acc = gl.zeros([HALF_M, D], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar.index(slot), phase)
    if WG == 2:
        acc, m_i, l_i = _consumer_loop_overlap(
            q_smem.index(slot), k_smem, v_smem, k_full, k_empty, v_full, v_empty, q_bar, half,
            acc, m_i, l_i, s_zero, rows, seqlen_k, shift, left, right, scale_log2,
            n_lo, n_full_lo, n_full_hi, n_tiles, t,
            BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, False, s_layout, o_layout, p_layout)
    else:
        # This part's own key tiles (its rows' ranges: under a causal mask the block's last
        # tiles can lie above its diagonal, and its own full middle needs no mask); the
        # block's other tiles are released unread. (``_part_tiles`` less its clamps, which a
        # dense part, inside its sequence and its item's tiles, never needs; written out so
        # that the GPU-tested kernel's code stays as it was: fold it in with a device run.)
        part_lo, n_full_lo, n_full_hi, part_hi = _key_ranges(
            r0, r0 + HALF_M - 1, seqlen_k, shift, left, right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        skip = (part_lo - n_lo) // BLOCK_N
        part_tiles = (part_hi - part_lo + BLOCK_N - 1) // BLOCK_N
        _drain_tiles(k_full, k_empty, v_full, v_empty, skip, t, STAGES)
        acc, m_i, l_i = _consumer_loop_plain(
            q_smem.index(slot), k_smem, v_smem, k_full, k_empty, v_full, v_empty, q_bar, half,
            acc, m_i, l_i, s_zero, rows, seqlen_k, shift, left, right, scale_log2,
            part_lo, n_full_lo, n_full_hi, part_tiles, t + skip,
            BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, False, s_layout, o_layout, p_layout)
    if not O_IN_Q:
        mbarrier.arrive(q_empty.index(slot))
    sink_nat = 0.0
    if HAS_SINK:
        sink_nat = gl.load(sink + i_h).to(gl.float32)
    o_scale, lse_row = _final_stats(m_i, l_i, sink_nat, HAS_SINK)
    p_lse = lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
    gl.store(p_lse + rows, lse_row, mask=rows < seqlen_q)
    out = acc * gl.convert_layout(o_scale, gl.SliceLayout(1, o_layout))[:, None]
    if not O_IN_Q:
        # The last item's store has read the buffer: its issuing thread waits, the
        # warpgroup's barrier holds the others until it has.
        tma.store_wait(0)
        gl.thread_barrier()
    o_tile.store(out.to(dtype))
    fence_async_shared()
    # A half past the sequence's end (two parts, seqlen_q % 128 == 64) holds the next
    # sequence's rows: not stored.
    if r0 < seqlen_q:
        tma.async_copy_shared_to_global(o_desc, [i_b * seqlen_q + r0, i_h * D], o_tile)
    if O_IN_Q:
        # Q's buffer goes back to the producer once the store has read it.
        tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(half))
    if WG == 3:
        # The block's tiles past this part's (after the epilogue, which so runs under the
        # other parts' products).
        _drain_tiles(k_full, k_empty, v_full, v_empty, n_tiles - skip - part_tiles,
                     t + skip + part_tiles, STAGES)


@gluon.jit
def _consumer_persistent(q_smem, o_smem, k_smem, v_smem, o_desc,
                         q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                         lse, stride_lb, stride_lh, sink, half,
                         n_items, n_m, seqlen_q, seqlen_k, left, right, scale_log2, sched,
                         HQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
                         TABLE: gl.constexpr, O_IN_Q: gl.constexpr, Q_BUFS: gl.constexpr,
                         WG: gl.constexpr = 2):
    """``_consumer`` over the program's work items, on rows ``half * 64`` to
    ``half * 64 + 63`` of each item's ``WG * 64`` (``_consumer_part``). Q's buffer is handed
    back right after the item's last product (with ``Q_BUFS`` = 2 the next item's Q has
    loaded into the other during this one); out goes through its own buffer, whose previous
    TMA store is waited for only when the next item's epilogue needs it. With ``O_IN_Q`` (no
    room for that buffer: D = 256; one Q buffer) out is staged in Q's, handed back once its
    store has read it. Two parts run the overlapped schedule; three (``WG = 3``) take their
    key tiles one after the other (``_consumer_loop_plain``: the overlapped loop needs more
    than their 160 registers at 128-key tiles), each only its own rows' tiles of the
    block's, and a part before the sequence's first row computes nothing
    (``_drain_tiles``)."""
    gl.static_assert(Q_BUFS == 1 or not O_IN_Q)
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_tile = o_smem.index(half)
    t = 0
    j = 0
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    lo, hi, step = _item_span(sched, n_items, TABLE)
    for pos in range(lo, hi, step):
        i_h, i_b, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles = _dense_item(
            sched, pos, n_m, HQ, seqlen_q, seqlen_k, left, right, BLOCK_N, HAS_LEFT,
            HAS_RIGHT, TABLE, WG)
        r0 = m0 + half * HALF_M
        slot = WG * (j % Q_BUFS) + half
        if WG == 3 and r0 < 0:
            # Before the sequence's start (``_dense_item``'s three-part blocks): nothing to
            # compute.
            mbarrier.wait(q_bar.index(slot), (j // Q_BUFS) & 1)
            _drain_tiles(k_full, k_empty, v_full, v_empty, n_tiles, t, STAGES)
            mbarrier.arrive(q_empty.index(slot))
        else:
            _consumer_part(q_smem, o_tile, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                           k_empty, v_full, v_empty, lse, stride_lb, stride_lh, sink, half,
                           slot, (j // Q_BUFS) & 1, i_h, i_b, r0, shift, n_lo, n_full_lo,
                           n_full_hi, n_tiles, t, seqlen_q, seqlen_k, left, right,
                           scale_log2, s_zero, D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT,
                           HAS_SINK, O_IN_Q, WG)
        t += n_tiles
        j += 1
    tma.store_wait(0)


@gluon.jit
def _part_tiles(r0, T_q, T_k, shift, left, right, n_lo, n_tiles, BLOCK_N: gl.constexpr,
                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """A consumer part's share of an item's ``n_tiles`` key tiles from key ``n_lo`` (a
    block's, or its key split's): the tiles before its own (released unread), its own
    (those of ``_key_ranges`` of its rows ``r0`` to ``min(r0 + 63, T_q - 1)``, within the
    item's), and its rows' full middle. Under a causal mask the block's last tiles can lie
    above a lower part's diagonal, and a part's own middle needs no mask."""
    part_lo, n_full_lo, n_full_hi, part_hi = _key_ranges(
        r0, gl.minimum(r0 + HALF_M, T_q) - 1, T_k, shift, left, right, BLOCK_N, HAS_LEFT,
        HAS_RIGHT)
    first = gl.maximum(part_lo, n_lo)
    skip = gl.minimum((first - n_lo) // BLOCK_N, n_tiles)
    end = gl.minimum((gl.maximum(part_hi, first) - n_lo + BLOCK_N - 1) // BLOCK_N, n_tiles)
    return skip, gl.maximum(end - skip, 0), n_full_lo, n_full_hi


@gluon.jit
def _drain_tiles(k_full, k_empty, v_full, v_empty, n_tiles, t0, STAGES: gl.constexpr):
    """A consumer's share of ``n_tiles`` ring tiles from the ``t0``-th, released as they
    land and not read: each arrival waits for its tile, so none runs a phase ahead of the
    other consumers' (the producer refills a buffer once all of them have arrived)."""
    for it in range(n_tiles):
        s = (t0 + it) % STAGES
        ph = ((t0 + it) // STAGES) & 1
        mbarrier.wait(k_full.index(s), ph)
        mbarrier.arrive(k_empty.index(s))
        mbarrier.wait(v_full.index(s), ph)
        mbarrier.arrive(v_empty.index(s))


@gluon.jit
def _persistent_buffers(k, v, stride_ks, stride_vs, rows_k, HKV: gl.constexpr, D: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, q_layout: gl.constexpr,
                        BOX: gl.constexpr = 0, Q_BUFS: gl.constexpr = 1, WG: gl.constexpr = 2):
    """The persistent kernels' (the forward's, bwd_sm90's dQ) K and V descriptors over
    ``(B * S_k, H_kv * D)`` (boxes of ``BOX`` rows, a page's over a paged cache; 0: a tile's),
    ``Q_BUFS`` buffers of the ``WG`` Q parts with their full / empty barriers, and the K/V
    ring (``_kv_ring``)."""
    dtype: gl.constexpr = k.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    ROWS: gl.constexpr = BOX if BOX > 0 else BLOCK_N
    k_desc = tma.make_tensor_descriptor(k, [rows_k, HKV * D], [stride_ks, 1], [ROWS, D],
                                        kv_layout)
    v_desc = tma.make_tensor_descriptor(v, [rows_k, HKV * D], [stride_vs, 1], [ROWS, D],
                                        kv_layout)
    q_smem, q_bar, q_empty = _q_buffers(dtype, D, q_layout, Q_BUFS, WG)
    k_smem, v_smem, k_full, k_empty, v_full, v_empty = _kv_ring(dtype, D, BLOCK_N, STAGES,
                                                                kv_layout, WG=WG)
    return k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_full, k_empty, v_full, \
        v_empty


# Lengths change per call; specialising on them only recompiles.
@gluon.jit(do_not_specialize=["batch", "seqlen_q", "seqlen_k", "n_items", "left", "right"])
def _fwd_sm90_persistent_kernel(
    q, k, v, o, lse, sink,
    cu_seqlens_q, cu_seqlens_k, seqused_k,
    stride_q, stride_k, stride_v, stride_o, stride_l,
    batch, seqlen_q, seqlen_k, n_items, left, right, scale_log2, sched,
    GROUP: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
    TABLE: gl.constexpr, O_IN_Q: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    Q_BUFS: gl.constexpr, WG: gl.constexpr = 2,
):
    """The dense forward as a persistent kernel: a program per SM (at most) walks work items
    ``program_id, program_id + num_programs, ...`` (``_dense_item``), or with ``TABLE`` its
    list in ``sched``, the host's schedule (``_greedy_table``), so one item's
    epilogue and the next one's Q and first K/V loads overlap, and the prologue (barriers,
    descriptors) is paid once a program, not once a 128-row block. For the layouts
    ``_persistent_ok`` admits: q, k, v, out as ``(B * S, H * D)`` matrices (row stride
    ``stride(1)``, heads adjacent), ``seqlen_q % 64 == 0`` and ``seqlen_k % BLOCK_N == 0``,
    so a K/V tile never reads past its sequence and a stored half never crosses one (the
    descriptors span the batch). (``cu_seqlens_*`` and ``seqused_k`` are never set here.)
    ``WG``: consumer warpgroups, 64 rows each, so an item is ``WG * 64`` rows (3 at D = 64,
    FA-3's 192-row tile: three softmax streams, so the tensor cores wait less on any one)."""
    stride_qb, stride_qs, stride_qh = stride_q
    stride_kb, stride_ks, stride_kh = stride_k
    stride_vb, stride_vs, stride_vh = stride_v
    stride_ob, stride_os, stride_oh = stride_o
    stride_lb, stride_lh = stride_l
    dtype: gl.constexpr = q.dtype.element_ty
    n_m = (seqlen_q + WG * HALF_M - 1) // (WG * HALF_M)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, D], dtype)
    q_desc = tma.make_tensor_descriptor(q, [batch * seqlen_q, HQ * D], [stride_qs, 1],
                                        [HALF_M, D], q_layout)
    o_desc = tma.make_tensor_descriptor(o, [batch * seqlen_q, HQ * D], [stride_os, 1],
                                        [HALF_M, D], q_layout)
    k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_full, k_empty, v_full, v_empty \
        = _persistent_buffers(k, v, stride_ks, stride_vs, batch * seqlen_k, HQ // GROUP, D,
                              BLOCK_N, STAGES, q_layout, Q_BUFS=Q_BUFS, WG=WG)
    if O_IN_Q:
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [WG, HALF_M, D], q_layout)
    # (The partitions' argument lists written out: the frontend builds no tuple of them.)
    if WG == 3:
        gl.warp_specialize([
            (_consumer_persistent, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty,
                                    k_full, k_empty, v_full, v_empty, lse, stride_lb,
                                    stride_lh, sink, 0, n_items, n_m, seqlen_q, seqlen_k,
                                    left, right, scale_log2, sched, HQ, D, BLOCK_N, STAGES,
                                    HAS_LEFT, HAS_RIGHT, HAS_SINK, TABLE, O_IN_Q, Q_BUFS,
                                    WG)),
            (_consumer_persistent, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty,
                                    k_full, k_empty, v_full, v_empty, lse, stride_lb,
                                    stride_lh, sink, 1, n_items, n_m, seqlen_q, seqlen_k,
                                    left, right, scale_log2, sched, HQ, D, BLOCK_N, STAGES,
                                    HAS_LEFT, HAS_RIGHT, HAS_SINK, TABLE, O_IN_Q, Q_BUFS,
                                    WG)),
            (_consumer_persistent, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty,
                                    k_full, k_empty, v_full, v_empty, lse, stride_lb,
                                    stride_lh, sink, 2, n_items, n_m, seqlen_q, seqlen_k,
                                    left, right, scale_log2, sched, HQ, D, BLOCK_N, STAGES,
                                    HAS_LEFT, HAS_RIGHT, HAS_SINK, TABLE, O_IN_Q, Q_BUFS,
                                    WG)),
            (_producer_persistent, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem,
                                    v_smem, q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                                    n_items, n_m, seqlen_q, seqlen_k, left, right, sched,
                                    GROUP, HQ, D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, TABLE,
                                    False, Q_BUFS, WG)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer_persistent, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty,
                                    k_full, k_empty, v_full, v_empty, lse, stride_lb,
                                    stride_lh, sink, 0, n_items, n_m, seqlen_q, seqlen_k,
                                    left, right, scale_log2, sched, HQ, D, BLOCK_N, STAGES,
                                    HAS_LEFT, HAS_RIGHT, HAS_SINK, TABLE, O_IN_Q, Q_BUFS,
                                    WG)),
            (_consumer_persistent, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty,
                                    k_full, k_empty, v_full, v_empty, lse, stride_lb,
                                    stride_lh, sink, 1, n_items, n_m, seqlen_q, seqlen_k,
                                    left, right, scale_log2, sched, HQ, D, BLOCK_N, STAGES,
                                    HAS_LEFT, HAS_RIGHT, HAS_SINK, TABLE, O_IN_Q, Q_BUFS,
                                    WG)),
            (_producer_persistent, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem,
                                    v_smem, q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                                    n_items, n_m, seqlen_q, seqlen_k, left, right, sched,
                                    GROUP, HQ, D, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, TABLE,
                                    False, Q_BUFS, WG)),
        ], [4, 1], [CONSUMER_REGS, 24])


# (Lengths change per call: the paged plan passes them without a new plan, SizedLaunch.)
@triton.jit(do_not_specialize=["batch", "total_q", "total_k", "seqlen_q", "seqlen_k", "capacity",
                               "num_pages", "rows_lo"])
def _varlen_blocks_kernel(cu_seqlens_q, cu_seqlens_k, seqused_k, blocks, block_table,
                          batch, total_q, total_k, seqlen_q, seqlen_k, capacity,
                          stride_tb, num_pages, rows_lo,
                          BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                          HAS_SEQUSED_K: tl.constexpr, GROUP: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
                          ALIGN_END: tl.constexpr):
    """The persistent varlen kernel's row blocks, listed on the device (the host cannot read
    ``cu_seqlens_q`` without a sync): ``blocks[0]`` their count, then ``VARLEN_ITEM`` ints a
    block: its sequence's ``seq_bounds`` (``bos, bos_k, T_q, T_k``) and its first row, so
    the kernel reads an item with one round of independent loads. The blocks of index
    ``L - 1`` (the longest sequences' last) come first, down to index 0, each index's
    sequences in order: under a causal mask on equal lengths a block of index ``i`` has
    ``i + 1`` key tiles, so this is longest first, the order the kernel's programs deal
    out. Program ``i`` writes index ``i``'s blocks: they start after the
    ``sum_b max(0, n_b - 1 - i)`` blocks of the indices above (``n_b`` sequence ``b``'s
    count), ranked by a prefix sum. Offsets and lengths clamped as ``seq_spans`` (any values
    stay in bounds); the list holds at most ``capacity`` blocks (the buffer's: only bad
    offsets, sequences that overlap, have more, and the blocks past it are left out).

    Over a paged cache (``PAGE_SIZE > 0``: ``block_table``, no ``cu_seqlens_k``) a block's
    ``bos_k`` is its sequence's index (its block-table row) and ``T_k`` its keys:
    ``seqused_k`` clamped to ``[0, seqlen_k]`` (the table's pages) and ended before the
    first entry outside ``[0, num_pages)`` (``_paged_lens``); sequences of at most
    ``rows_lo`` packed rows (``T_q * GROUP``, decodes: another launch's) have no block.

    ``ALIGN_END`` > 0 (192-row blocks of three 64-row consumer parts: 64): a sequence's
    blocks end at its length rounded up to a multiple of ``ALIGN_END``, so its partial
    block is its first, whose first row is then negative (the parts before row 0 compute
    nothing) and, under a causal mask, whose rows are the cheapest; with 0 block ``i``
    starts at row ``i * BLOCK_M``.
    Triton, not Gluon: CI runs it under the interpreter."""
    i = tl.program_id(0)
    o_b = tl.arange(0, BLOCK_B)
    start = 0
    for b0 in range(0, batch, BLOCK_B):
        m_b = b0 + o_b < batch
        _, T_q = seq_spans(cu_seqlens_q, b0 + o_b, m_b, total_q, seqlen_q)
        if PAGE_SIZE > 0:
            T_q = tl.where(T_q * GROUP > rows_lo, T_q, 0)
        start += tl.sum(tl.maximum((T_q + BLOCK_M - 1) // BLOCK_M - 1 - i, 0), 0)
    for b0 in range(0, batch, BLOCK_B):
        m_b = b0 + o_b < batch
        bos, T_q = seq_spans(cu_seqlens_q, b0 + o_b, m_b, total_q, seqlen_q)
        if PAGE_SIZE > 0:
            T_q = tl.where(T_q * GROUP > rows_lo, T_q, 0)
        has = ((T_q + BLOCK_M - 1) // BLOCK_M > i).to(tl.int32)
        if PAGE_SIZE > 0:
            bos_k = b0 + o_b
            T_k = tl.minimum(tl.maximum(tl.load(seqused_k + b0 + o_b, mask=m_b, other=0), 0),
                             seqlen_k)
            T_k = _paged_lens(block_table, stride_tb, num_pages, b0 + o_b, has != 0, T_k,
                              PAGE_SIZE, BLOCK_P)
        else:
            bos_k, T_k = seq_spans(cu_seqlens_k, b0 + o_b, m_b, total_k, seqlen_k)
            if HAS_SEQUSED_K:
                T_k = tl.minimum(tl.maximum(tl.load(seqused_k + b0 + o_b, mask=m_b, other=0),
                                            0), T_k)
        pos = start + tl.cumsum(has, 0) - 1
        listed = (has != 0) & (pos < capacity)
        p = blocks + 1 + VARLEN_ITEM * pos
        tl.store(p, bos, mask=listed)
        tl.store(p + 1, bos_k, mask=listed)
        tl.store(p + 2, T_q, mask=listed)
        tl.store(p + 3, T_k, mask=listed)
        if ALIGN_END > 0:
            m0 = ((T_q + ALIGN_END - 1) // ALIGN_END * ALIGN_END
                  - ((T_q + BLOCK_M - 1) // BLOCK_M - i) * BLOCK_M)
        else:
            m0 = tl.full([BLOCK_B], 0, tl.int32) + i * BLOCK_M
        tl.store(p + 4, m0, mask=listed)
        start += tl.sum(has, 0)
    if i == 0:
        tl.store(blocks, tl.minimum(start, capacity))


@triton.jit
def _paged_lens(block_table, stride_tb, num_pages, o_b, m_b, T_k, PAGE_SIZE: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """``paged_keys`` of the sequences ``o_b`` at once (``m_b``: which to look at; the others
    keep ``T_k``): each length ended before its row's first block-table entry outside
    ``[0, num_pages)``, looking at ``BLOCK_P`` entries of every row a step."""
    n_pages = tl.where(m_b, (T_k + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    first_bad = n_pages
    rows = block_table + o_b.to(tl.int64)[:, None] * stride_tb
    o_p = tl.arange(0, BLOCK_P)
    for p0 in range(0, tl.max(n_pages, 0), BLOCK_P):
        cols = p0 + o_p[None, :]
        m_p = cols < n_pages[:, None]
        page = tl.load(rows + cols, mask=m_p, other=0)
        bad = m_p & ((page < 0) | (page >= num_pages))
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, cols, n_pages[:, None]), 1))
    return tl.minimum(T_k, first_bad * PAGE_SIZE)


@gluon.jit
def _varlen_load(blocks, r, n_blocks, heads, HQ: gl.constexpr, ITEM: gl.constexpr,
                 SPLITS: gl.constexpr):
    """The persistent varlen kernel's item of round ``r``. The items are the blocks of
    ``_varlen_blocks_kernel``'s list (longest first) times the query heads, in sections of
    ``heads`` heads (the last may have fewer) whose K/V the host sized to stay in L2, as its
    table does for the dense kernel. A section's items are dealt back and forth: position
    ``rr * P + p`` in its even rounds, ``P - 1 - p`` in odd ones (program ``p`` of ``P``),
    so that a program dealt a costly item in one round is dealt a cheap one in the next; its
    rounds are padded to an even count (``valid`` false: the program moves on), and every
    other section deals from the other end, so no program is the first of each round pair.
    The head and the block's ints: one round of independent loads, which the partitions
    issue an item ahead (past the list, and past the last section, they read block 0's
    slots, inside the buffer whatever the list holds)."""
    n_p = gl.num_programs(0)
    # (At least one round: with no block the loads below still read block 0's slots.)
    rounds = gl.maximum(_section_rounds(n_blocks, heads), 1)
    sec = r // rounds
    rr = r % rounds
    p = gl.program_id(0)
    p = p + (sec & 1) * (n_p - 1 - 2 * p)
    o = rr * n_p + p + (rr & 1) * (n_p - 1 - 2 * p)
    h0 = sec * heads
    n_h = gl.minimum(heads, HQ - h0)  # none past the last section (the last prefetch)
    valid = (n_h > 0) & (o < n_blocks * n_h)
    n_h = gl.maximum(n_h, 1)
    o = gl.where(valid, o, 0)
    # With SPLITS key splits, ``n_blocks`` counts (block, split) pairs, a block's together.
    split = 0
    if SPLITS > 1:
        split = o // n_h % SPLITS
    item = blocks + 1 + ITEM * (o // n_h // SPLITS)
    return (valid, h0 + o % n_h, gl.load(item), gl.load(item + 1), gl.load(item + 2),
            gl.load(item + 3), gl.load(item + 4), split)


@gluon.jit
def _dealt_heads(n_blocks, heads, HQ: gl.constexpr):
    """The heads of ``_varlen_load``'s sections: the host's ``heads`` (K/V in L2), or every
    head when a section would hold fewer items than there are programs. Such sections go
    each to the first (or last) programs of one round; with many of them a few programs do
    all the work (a 512-row chunk on a 64k context: 8 sections of 16 items, 32 of 128
    programs busy, 0.27x the dense kernel), and their K/V is all in flight at once anyway."""
    return gl.where(n_blocks * heads < gl.num_programs(0), HQ, heads)


@gluon.jit
def _section_rounds(n_blocks, heads):
    """The rounds of one section of ``_varlen_load``'s dealing, an even count."""
    n_p = gl.num_programs(0)
    return (n_blocks * heads + 2 * n_p - 1) // (2 * n_p) * 2


@gluon.jit
def _varlen_ranges(valid, T_q, T_k, m0, left, right, BLOCK_N: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, WG: gl.constexpr = 2):
    """An item's masks' shift and key tiles (``_key_ranges`` of its ``WG * 64`` rows from
    ``m0``, those in ``[0, T_q)``; none past the list)."""
    m_last = gl.minimum(m0 + WG * HALF_M, T_q) - 1
    m_first = m0
    if WG == 3:
        m_first = gl.maximum(m0, 0)
    shift = T_k - T_q
    n_lo, n_full_lo, n_full_hi, n_hi = _key_ranges(m_first, m_last, T_k, shift, left, right,
                                                   BLOCK_N, HAS_LEFT, HAS_RIGHT)
    n_tiles = gl.where(valid, (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N, 0)
    return shift, n_lo, n_full_lo, n_full_hi, n_tiles


@gluon.jit
def _varlen_step(blocks, r, n_blocks, heads, ahead, left, right, HQ: gl.constexpr,
                 ITEM: gl.constexpr, BLOCK_N: gl.constexpr, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, SPLITS: gl.constexpr, WG: gl.constexpr = 2):
    """Round ``r``'s item from ``ahead`` (its ``_varlen_load``, issued a round before) with
    its ``_varlen_ranges``, and the next round's loads issued. With key splits, the item's
    tiles are its split's share of the block's (``ceil(n / SPLITS)`` each, the last ones
    fewer or none); the masks read absolute key positions, so they hold in any share."""
    valid, i_h, bos, bos_k, T_q, T_k, m0, split = ahead
    ahead = _varlen_load(blocks, r + 1, n_blocks, heads, HQ, ITEM, SPLITS)
    shift, n_lo, n_full_lo, n_full_hi, n_tiles = _varlen_ranges(valid, T_q, T_k, m0, left,
                                                                right, BLOCK_N, HAS_LEFT,
                                                                HAS_RIGHT, WG)
    if SPLITS > 1:
        share = (n_tiles + SPLITS - 1) // SPLITS
        n_lo = n_lo + split * share * BLOCK_N
        n_tiles = gl.minimum(gl.maximum(n_tiles - split * share, 0), share)
    return ahead, (valid, i_h, bos, bos_k, T_q, T_k, m0, shift, n_lo, n_full_lo, n_full_hi,
                   n_tiles, split)


@gluon.jit
def _varlen_rounds(n_blocks, heads, HQ: gl.constexpr):
    """The rounds of ``_varlen_load``'s dealing: every section's."""
    return (HQ + heads - 1) // heads * _section_rounds(n_blocks, heads)


@gluon.jit
def _producer_varlen(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem,
                     q_bar, q_empty, k_full, k_empty, v_full, v_empty, blocks, heads,
                     left, right, block_table, stride_tb, GROUP: gl.constexpr,
                     HQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     ITEM: gl.constexpr, PAGE_SIZE: gl.constexpr, DO_K: gl.constexpr,
                     DO_V: gl.constexpr, SPLITS: gl.constexpr, WG: gl.constexpr = 2):
    """``_producer_persistent`` over ``_varlen_load``'s items (an item with no key tile
    loads nothing). Coordinates are rows of the packed ``(total, H * D)`` matrices: a tile
    may reach into the next sequence, whose rows the consumers mask (K, Q) or zero (V).

    Over a paged cache (``PAGE_SIZE > 0``; an item's ``bos_k`` is its block-table row) the
    K tiles with the Q halves (DO_K) and the V tiles (DO_V) are two warps' work, as in the
    paged grid kernel (two warps wait on block-table loads and issue page boxes): each
    item's tiles by ``_paged_tiles`` with no tail descriptor (boxes past the item's length
    read page 0, whose keys the consumers mask and whose V rows they zero). Of three Q parts
    (``WG = 3``) those before the sequence's first row load nothing."""
    t = 0
    j = 0
    n_blocks = gl.load(blocks) * SPLITS  # (block, key split) pairs
    heads = _dealt_heads(n_blocks, heads, HQ)
    ahead = _varlen_load(blocks, 0, n_blocks, heads, HQ, ITEM, SPLITS)
    for r in range(_varlen_rounds(n_blocks, heads, HQ)):
        ahead, item = _varlen_step(blocks, r, n_blocks, heads, ahead, left, right, HQ, ITEM,
                                   BLOCK_N, HAS_LEFT, HAS_RIGHT, SPLITS, WG)
        valid, i_h, bos, bos_k, T_q, T_k, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles, \
            split = item
        if n_tiles > 0:
            col = (i_h // GROUP) * D
            if PAGE_SIZE == 0:
                t = _item_loads(q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem,
                                q_bar, q_empty, k_full, k_empty, v_full, v_empty, bos + m0,
                                bos_k + n_lo, col, i_h, n_tiles, t, j, D, BLOCK_N, STAGES,
                                False, 1, WG, bos)
            else:
                if DO_K:  # the Q halves (no tile)
                    _item_loads(q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem,
                                q_bar, q_empty, k_full, k_empty, v_full, v_empty, bos + m0, 0,
                                col, i_h, 0, t, j, D, BLOCK_N, STAGES, False, 1, WG, bos)
                p_bt = block_table + bos_k.to(gl.int64) * stride_tb
                _paged_tiles(k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                             n_lo, n_tiles, (k_desc, v_desc, p_bt, T_k, 0), BLOCK_N, STAGES,
                             PAGE_SIZE, DO_K, DO_V, t, col, False)
                t += n_tiles
            j += 1


@gluon.jit
def _consumer_varlen(q_smem, o_smem, k_smem, v_smem, o_desc,
                     q_bar, q_empty, k_full, k_empty, v_full, v_empty,
                     o, stride_os, lse, stride_lh, sink, half, blocks, heads, left, right,
                     scale_log2, total_q,
                     HQ: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                     HAS_SINK: gl.constexpr, O_IN_Q: gl.constexpr, ITEM: gl.constexpr,
                     SPLITS: gl.constexpr, WG: gl.constexpr = 2):
    """``_consumer_persistent`` over ``_varlen_load``'s items. Rows of a Q half past its
    sequence's end hold the next sequence's rows (or zeros): each row's result is its own,
    and only rows below ``T_q`` are stored. A half wholly inside its sequence is stored by
    TMA (as ``_consumer_persistent``), a half that ends past it (and an item with no key:
    the empty state) from registers, masked. V's last tile is cut at ``T_k``
    (``_consumer_loop_overlap``'s V_TAIL); K's columns past it are masked as anywhere.

    With key splits (``SPLITS > 1``) every item's state is a partial one, stored from
    registers in float32 to split ``split``'s slice of ``o`` (``(SPLITS * total_q, H * D)``)
    and ``lse`` (``(SPLITS * H, total_q)``), the empty state where the split has no key;
    the host merges the splits (``merge_states``' kernel, the sink there).

    Three parts (``WG = 3``, the list's blocks end-aligned) run as the dense kernel's: each
    takes its own rows' key tiles of the item's (``_part_tiles``) one after the other, and
    releases the others unread; a part before the sequence's first row computes and stores
    nothing."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_tile = q_smem.index(half)
    o_tile = o_smem.index(half)
    o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    t = 0
    j = 0
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    n_blocks = gl.load(blocks) * SPLITS  # (block, key split) pairs
    heads = _dealt_heads(n_blocks, heads, HQ)
    ahead = _varlen_load(blocks, 0, n_blocks, heads, HQ, ITEM, SPLITS)
    for r in range(_varlen_rounds(n_blocks, heads, HQ)):
        ahead, item = _varlen_step(blocks, r, n_blocks, heads, ahead, left, right, HQ, ITEM,
                                   BLOCK_N, HAS_LEFT, HAS_RIGHT, SPLITS, WG)
        valid, i_h, bos, bos_k, T_q, T_k, m0, shift, n_lo, n_full_lo, n_full_hi, n_tiles, \
            split = item
        r0 = m0 + half * HALF_M
        rows = r0 + gl.arange(0, HALF_M, layout=row_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
        acc = gl.zeros([HALF_M, D], gl.float32, layout=o_layout)
        # (WG = 3: the item's tiles this part releases unread before and after its own.)
        skip = 0
        own = 0
        t_item = t
        if n_tiles > 0:
            mbarrier.wait(q_bar.index(half), j & 1)
            if WG == 2:
                acc, m_i, l_i = _consumer_loop_overlap(
                    q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, q_bar, half,
                    acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
                    n_lo, n_full_lo, n_full_hi, n_tiles, t,
                    BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, False, s_layout, o_layout, p_layout,
                    True)
            else:
                skip, own, n_full_lo, n_full_hi = _part_tiles(
                    r0, T_q, T_k, shift, left, right, n_lo, n_tiles, BLOCK_N, HAS_LEFT,
                    HAS_RIGHT)
                if r0 < 0:
                    skip = n_tiles
                    own = 0
                _drain_tiles(k_full, k_empty, v_full, v_empty, skip, t, STAGES)
                acc, m_i, l_i = _consumer_loop_plain(
                    q_tile, k_smem, v_smem, k_full, k_empty, v_full, v_empty, q_bar, half,
                    acc, m_i, l_i, s_zero, rows, T_k, shift, left, right, scale_log2,
                    n_lo + skip * BLOCK_N, n_full_lo, n_full_hi, own, t + skip,
                    BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, False, s_layout, o_layout, p_layout,
                    True)
            if not O_IN_Q:
                mbarrier.arrive(q_empty.index(half))
            t += n_tiles
            j += 1
        stored = valid & (r0 < T_q)
        if WG == 3:
            stored = stored & (r0 >= 0)
        if SPLITS > 1:
            if stored:
                o_scale, lse_row = _final_stats(m_i, l_i, 0.0, False)
                gl.store(lse + (split * HQ + i_h).to(gl.int64) * stride_lh + bos + rows,
                         lse_row, mask=rows < T_q)
                out = acc * gl.convert_layout(o_scale, gl.SliceLayout(1, o_layout))[:, None]
                o_rows = r0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
                p_o = o + (split.to(gl.int64) * total_q + bos + o_rows)[:, None] * stride_os \
                    + i_h.to(gl.int64) * D + o_cols[None, :]
                gl.store(p_o, out, mask=o_rows[:, None] < T_q)
        elif stored:
            sink_nat = 0.0
            if HAS_SINK:
                sink_nat = gl.load(sink + i_h).to(gl.float32)
            o_scale, lse_row = _final_stats(m_i, l_i, sink_nat, HAS_SINK)
            gl.store(lse + i_h.to(gl.int64) * stride_lh + bos + rows, lse_row, mask=rows < T_q)
            out = acc * gl.convert_layout(o_scale, gl.SliceLayout(1, o_layout))[:, None]
            if (n_tiles > 0) & (r0 + HALF_M <= T_q):
                if not O_IN_Q:
                    # The last item's store has read the buffer: its issuing thread waits,
                    # the warpgroup's barrier holds the others until it has.
                    tma.store_wait(0)
                    gl.thread_barrier()
                o_tile.store(out.to(dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [bos + r0, i_h * D], o_tile)
                if O_IN_Q:
                    tma.store_wait(0)
                    gl.thread_barrier()
            else:
                o_rows = r0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
                p_o = o + (bos + o_rows)[:, None].to(gl.int64) * stride_os \
                    + i_h.to(gl.int64) * D + o_cols[None, :]
                gl.store(p_o, out.to(dtype), mask=o_rows[:, None] < T_q)
        if O_IN_Q:
            # Q's buffer goes back to the producer once nothing reads it (its products, the
            # store of out staged in it).
            if n_tiles > 0:
                mbarrier.arrive(q_empty.index(half))
        if WG == 3:
            # The item's tiles past this part's (after the epilogue, which so runs under the
            # other parts' products).
            _drain_tiles(k_full, k_empty, v_full, v_empty, n_tiles - skip - own,
                         t_item + skip + own, STAGES)
    tma.store_wait(0)


# Lengths change per call; specialising on them only recompiles.
@gluon.jit(do_not_specialize=["stride_lh", "total_q", "total_k", "heads", "left", "right"])
def _fwd_sm90_varlen_kernel(
    q, k, v, o, lse, sink, blocks, block_table,
    stride_qs, stride_ks, stride_vs, stride_os, stride_lh, stride_tb,
    total_q, total_k, heads, left, right, scale_log2,
    GROUP: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
    O_IN_Q: gl.constexpr, CONSUMER_REGS: gl.constexpr, PAGE_SIZE: gl.constexpr,
    SPLITS: gl.constexpr = 1, WG: gl.constexpr = 2,
):
    """The packed varlen forward as a persistent kernel: a program per SM walks the row
    blocks that ``_varlen_blocks_kernel`` listed in ``blocks`` (dealt by ``_varlen_load``),
    the consumers and producer of the dense persistent kernel with each item's sequence
    bounds. q, k, v, out are ``(total, H * D)`` matrices (heads adjacent); the descriptors
    span them whole, so no descriptor is made per sequence and a tile may cross into the
    next sequence: ``_consumer_varlen`` says how its rows are kept out. lse is
    ``(H, total_q)``.

    Over paged caches (``PAGE_SIZE > 0``): k and v are the caches as ``(num_pages *
    PAGE_SIZE, H_kv * D)`` matrices (``total_k`` rows), a block's key tiles are read page by
    page through ``block_table`` (``_producer_varlen``: a producer warp for K, one for V), and the consumers are the same (a key past the length is masked, its V row zeroed).

    ``SPLITS > 1``: each block's key tiles in that many shares, an item each, whose partial
    states go to ``o`` / ``lse`` as float32 workspaces (``_consumer_varlen``).

    ``WG``: consumer warpgroups of 64 rows each (3: 192-row blocks, listed end-aligned by
    ``_varlen_blocks_kernel``'s ``ALIGN_END``), as the dense persistent kernel's."""
    dtype: gl.constexpr = q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, D], dtype)
    q_desc = tma.make_tensor_descriptor(q, [total_q, HQ * D], [stride_qs, 1], [HALF_M, D],
                                        q_layout)
    # The rows a split's partial states are apart (0 without splits, where the consumers
    # never read it: a constant keeps the shipped kernels' code as it was).
    split_rows = 0
    if SPLITS > 1:  # (partial states are stored from registers: no descriptor of o)
        o_desc = q_desc
        split_rows = total_q
    else:
        o_desc = tma.make_tensor_descriptor(o, [total_q, HQ * D], [stride_os, 1],
                                            [HALF_M, D], q_layout)
    BOX: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N  # (0: a tile)
    k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_full, k_empty, v_full, v_empty \
        = _persistent_buffers(k, v, stride_ks, stride_vs, total_k, HQ // GROUP, D, BLOCK_N,
                              STAGES, q_layout, BOX, WG=WG)
    if O_IN_Q:
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [WG, HALF_M, D], q_layout)
    # (The partitions' argument lists written out: the frontend builds no tuple of them.)
    if WG == 3 and PAGE_SIZE == 0:
        gl.warp_specialize([
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                0, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                1, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                2, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, 0, True, True, SPLITS, WG)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    elif WG == 3:
        gl.warp_specialize([
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                0, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                1, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                2, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS, WG)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, PAGE_SIZE, True, False,
                                SPLITS, WG)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, PAGE_SIZE, False, True,
                                SPLITS, WG)),
        ], [4, 4, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, 24, 24])
    elif PAGE_SIZE == 0:
        gl.warp_specialize([
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                0, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                1, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, 0, True, True, SPLITS)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                0, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS)),
            (_consumer_varlen, (q_smem, o_smem, k_smem, v_smem, o_desc, q_bar, q_empty, k_full,
                                k_empty, v_full, v_empty, o, stride_os, lse, stride_lh, sink,
                                1, blocks, heads, left, right, scale_log2, split_rows, HQ, D,
                                BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, O_IN_Q,
                                VARLEN_ITEM, SPLITS)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, PAGE_SIZE, True, False,
                                SPLITS)),
            (_producer_varlen, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                                k_full, k_empty, v_full, v_empty, blocks, heads, left, right,
                                block_table, stride_tb, GROUP, HQ, D, BLOCK_N, STAGES,
                                HAS_LEFT, HAS_RIGHT, VARLEN_ITEM, PAGE_SIZE, False, True,
                                SPLITS)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, 24])


@gluon.jit
def _tile_pages(p_bt, n0, T_k, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                TAIL: gl.constexpr):
    """The block-table entries of key tile ``[n0, n0 + BLOCK_N)``'s boxes (see
    ``_paged_copy``), a tuple: 0 for a box past the length, whose entry is not read (the row
    holds the length's pages only), and (TAIL) for the box the tail descriptor copies."""
    BOX: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
    pages = ()
    for i in gl.static_range(BLOCK_N // BOX):
        n_i = n0 + i * BOX
        if TAIL:
            inside = n_i + BOX <= T_k
        else:
            inside = n_i < T_k
        pages = pages + (gl.load(p_bt + n_i // PAGE_SIZE, mask=inside, other=0),)
    return pages


@gluon.jit
def _paged_copy(desc, tail, bar, dst, pages, n0, T_k, last_start, col, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, TAIL: gl.constexpr):
    """Key tile ``[n0, n0 + BLOCK_N)`` of a paged sequence into ``dst`` (column ``col`` of
    the descriptors), one TMA box a page (or a BLOCK_N-row box of a page holding several
    tiles; ``pages`` their block-table entries, ``_tile_pages``), all arriving on ``bar``.
    TAIL (the grid kernel): a box whose keys reach ``T_k`` comes from ``tail``, the
    descriptor of the last page's first ``T_k - last_start`` rows: the rows past the length
    (cache memory, NaN possible) and boxes past the last page read as zeros, so a masked
    key has P = 0 and V = 0. Without (the persistent kernel, whose consumers mask those keys
    and zero their V rows) every box comes from its page, page 0 past the length."""
    BOX: gl.constexpr = PAGE_SIZE if PAGE_SIZE < BLOCK_N else BLOCK_N
    mbarrier.expect(bar, (BLOCK_N // BOX) * desc.block_type.nbytes)
    for i in gl.static_range(BLOCK_N // BOX):
        n_i = n0 + i * BOX
        if BOX < BLOCK_N:
            # Row offsets are multiples of 8, the 128-byte swizzle's period.
            box = dst.slice(i * BOX, BOX, 0)
        else:
            box = dst
        if TAIL and n_i + BOX > T_k:
            tma.async_copy_global_to_shared(tail, [n_i - last_start, col], bar, box)
        else:
            tma.async_copy_global_to_shared(desc, [pages[i] * PAGE_SIZE + n_i % PAGE_SIZE,
                                                   col], bar, box)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _long_block(cu_seqlens_q, i_x, batch, total_q, seqlen_q, rows_lo, GROUP: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_B: gl.constexpr):
    """Row block ``i_x`` of a compact grid over the row blocks of the sequences of more than
    ``rows_lo`` packed rows only: ``(i_b, bos, T_q, i_m)``, block ``i_m`` of sequence ``i_b``
    (its last block first), or ``i_b == batch`` past the last block. One vector pass over
    ``cu_seqlens_q`` (clamped as ``seq_span``): a grid over every (block, sequence) pair
    would start a 160 KB program, one an SM, for each decode of a mixed step, only to exit."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_B // (32 * gl.num_warps())], [32],
                                            [gl.num_warps()], [0])
    o_b = gl.arange(0, BLOCK_B, layout=layout)
    m_b = o_b < batch
    s0, T_q = _seq_spans(cu_seqlens_q, o_b, m_b, total_q, seqlen_q)
    n_blk = gl.where(m_b & (T_q * GROUP > rows_lo), (T_q + BLOCK_M - 1) // BLOCK_M, 0)
    ends = gl.associative_scan(n_blk, 0, _add)
    i_b = gl.sum(gl.where(ends <= i_x, 1, 0), 0)
    this = o_b == i_b
    i_m = gl.sum(gl.where(this, ends, 0), 0) - 1 - i_x
    bos = gl.sum(gl.where(this, s0, 0), 0).to(gl.int64)
    return i_b, bos, gl.sum(gl.where(this, T_q, 0), 0), i_m


# (Every length and the lse stride, total_q, vary call to call: _PagedRun passes them.)
@gluon.jit(do_not_specialize=["stride_lh", "seqlen_q", "total_q", "batch", "capacity",
                              "num_pages", "rows_lo", "left", "right"])
def _fwd_sm90_paged_kernel(
    q, k, v, o, lse, sink,
    cu_seqlens_q, seqused_k, block_table,
    stride_q, stride_k, stride_v, stride_o, stride_lh, stride_tb,
    seqlen_q, total_q, batch, capacity, num_pages, rows_lo, left, right, scale_log2,
    GROUP: gl.constexpr, D: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_B: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
    PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """The Hopper forward over paged K/V (``attention_varlen`` with a block table, paged
    prefill of ``attention_with_kvcache``): the dense kernel's program and consumers, a
    producer that loads each key tile page by page. The grid is (row block, head) over the
    row blocks of the sequences of more than ``rows_lo`` packed rows (``T_q * GROUP``) only:
    the others (decodes) are another launch's. Strides come as tuples: ``stride_q`` /
    ``stride_o`` (row, head), ``stride_k`` / ``stride_v`` (page, row, head)."""
    stride_qs, stride_qh = stride_q
    stride_os, stride_oh = stride_o
    stride_kp, stride_ks, stride_kh = stride_k
    stride_vp, stride_vs, stride_vh = stride_v
    BLOCK_M: gl.constexpr = 2 * HALF_M
    i_h = gl.program_id(1)
    i_hk = i_h // GROUP
    i_b, bos, T_q, i_m = _long_block(cu_seqlens_q, gl.program_id(0), batch, total_q, seqlen_q,
                                     rows_lo, GROUP, BLOCK_M, BLOCK_B)
    if i_b >= batch:
        return
    m0 = i_m * BLOCK_M
    m_last = gl.minimum(m0 + BLOCK_M, T_q) - 1
    p_bt = block_table + i_b.to(gl.int64) * stride_tb
    # Keys: seqused_k clamped to the table's pages, ended before a page outside the cache.
    T_k = gl.minimum(gl.maximum(gl.load(seqused_k + i_b), 0), capacity)
    T_k = _paged_keys(p_bt, T_k, num_pages,
                      gl.arange(0, 256, layout=gl.BlockedLayout([2], [32], [gl.num_warps()],
                                                                [0])),
                      PAGE_SIZE)
    shift = T_k - T_q
    n_lo, n_full_lo, n_full_hi, n_hi = _key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N,
                                                   HAS_LEFT, HAS_RIGHT)
    n_tiles = (n_hi - n_lo + BLOCK_N - 1) // BLOCK_N

    p_q = q + bos * stride_qs + i_h.to(gl.int64) * stride_qh
    p_o = o + bos * stride_os + i_h.to(gl.int64) * stride_oh
    p_lse = lse + i_h.to(gl.int64) * stride_lh + bos
    dtype: gl.constexpr = q.dtype.element_ty
    if n_tiles == 0:
        _store_empty(p_o, p_lse, sink, i_h, stride_os, m0, T_q, dtype, D, BLOCK_M, HAS_SINK)
        return
    _attend(p_q, p_o, k + i_hk.to(gl.int64) * stride_kh, v + i_hk.to(gl.int64) * stride_vh, p_lse,
            sink, (p_bt, num_pages, stride_kp, stride_ks, stride_vp, stride_vs), i_h, m0, T_q,
            T_k, shift, left, right, scale_log2, n_lo, n_full_lo, n_full_hi, n_tiles, stride_qs,
            stride_os, D, PAGE_SIZE, BLOCK_N, STAGES, HAS_LEFT, HAS_RIGHT, HAS_SINK, PINGPONG,
            OVERLAP, CONSUMER_REGS)


def supported(q, k, v, *, softcap, scale, batch) -> bool:
    """The fast path's domain (``dispatch.attn_fwd`` asks): everything else runs fwd.py's."""
    d = q.shape[-1]
    if batch > 65535 or q.shape[-2] > 65535:
        return False
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if capability(q) != (9, 0):
        return False
    if d not in configs.FWD_SM90 or v.shape[-1] != d or softcap or not scale > 0:
        return False
    return tma_ok(q, k, v)


def plan(q, k, v, out, lse, *, softcap, left, right, scale, sink, cu_seqlens_q=None,
         cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """The Hopper forward's :class:`Plan` of a call (``fwd.new_outputs``'s ``out`` and
    ``lse``, arguments as ``fwd.attn_fwd``'s), or None outside :func:`supported`'s domain
    (and where the grid kernel would run for a config without ``grid``).

    A function of the call's metadata (shapes, strides, dtypes, device, whether the TMA
    operands are 16-byte aligned, which optional tensors there are, the scalars): a repeated
    call finds it in ``_PLANS``, and its :class:`~flashlse.kernels._common.Launch` calls the
    compiled kernel directly (``dispatch.attn_fwd`` times it in µs)."""
    override = options.current().fwd_sm90_config
    # The override is part of the key: a plan made under one (the persistent kernel's
    # schedule, say) is found again under the same one.
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), v.shape,
               v.stride(), out.stride(), lse.stride(),
               (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0,
               None if cu_seqlens_q is None else (cu_seqlens_q.shape, max_seqlen_q,
                                                  max_seqlen_k),
               seqused_k is None, sink is None, left, right, softcap, scale,
               configs.override_key(override))
    except TypeError:  # an override that does not hash: planned every call
        key = None
    found = _MISSING if key is None else _PLANS.get(key, _MISSING)
    if found is not _MISSING:
        return found
    batch, lens = seq_args(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    result = None
    if supported(q, k, v, softcap=softcap, scale=scale, batch=batch):
        result = _plan(q, k, v, out, lse, left=left, right=right, scale=scale, sink=sink,
                       is_varlen=cu_seqlens_q is not None, batch=batch, lens=lens,
                       seqused_k=seqused_k, override=override)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = result
    return result


class _TableLaunch:
    """The persistent kernel's launch on the host's table, whose copy to the device went on
    the planning call's stream: a later call on another stream first waits for that copy (an
    event), so its kernel never reads the table before it lands. Not while a CUDA graph is
    captured (a wait on an event from outside the capture is not allowed there;
    ``torch.cuda.graph`` synchronizes the device before it captures)."""

    __slots__ = ("launch", "device", "stream", "copied")

    def __init__(self, launch: Launch, device: torch.device):
        self.launch = launch
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch._C._cuda_getCurrentRawStream(self.device)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(self.device))

    def __call__(self, *tensors) -> None:
        if (torch._C._cuda_getCurrentRawStream(self.device) != self.stream
                and not torch.cuda.is_current_stream_capturing()):
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        self.launch(*tensors)


class Plan(NamedTuple):
    """A supported call's launch (None: no row, nothing to launch; a :class:`_TableLaunch`
    for the persistent kernel on the host's table) and the compilation's name for
    ``failures.FAILURES`` (the values of the kernel's constexpr flags)."""

    run: Launch | _TableLaunch | _VarlenLaunch | None
    signature: tuple


_PLANS: dict = {}
_MAX_PLANS = 4096
_MISSING = object()


def _config(q, override) -> configs.TileConfig:
    """``configs.FWD_SM90``'s tile for q's head dim with ``KernelOptions.fwd_sm90_config``'s
    overrides."""
    cfg = configs.override(configs.FWD_SM90[q.shape[-1]], override, configs.FWD_SM90_KEYS,
                           what="fwd_sm90_config")
    for key, n in (("CONSUMERS", cfg.consumers), ("VARLEN_CONSUMERS", cfg.varlen_consumers)):
        if n not in (2, 3):
            raise ValueError(f"fwd_sm90_config: {key} is a persistent forward's consumer "
                             f"warpgroups, 2 or 3; got {n}")
    return cfg


def _shared_kw(q, k, left, right, scale, sink, cfg) -> dict:
    """The launch keywords both Hopper forwards take alike: window bounds (None = 0 with its
    flag off), the base-2 scale, the GQA group and head dim, the sink flag, and the tiles and
    schedule of ``cfg`` (:func:`_config`)."""
    return dict(left=0 if left is None else int(left), right=0 if right is None else int(right),
                scale_log2=float(scale) * LOG2E.value, GROUP=q.shape[-2] // k.shape[-2],
                D=q.shape[-1], BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                HAS_LEFT=left is not None, HAS_RIGHT=right is not None,
                HAS_SINK=sink is not None, PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap,
                CONSUMER_REGS=cfg.consumer_regs, num_warps=cfg.num_warps)


def _plan(q, k, v, out, lse, *, left, right, scale, sink, is_varlen, batch, lens, seqused_k,
          override) -> Plan:
    hq, hkv = q.shape[-2], k.shape[-2]
    signature = ("fwd_sm90", q.dtype, left is None, right is None, sink is None, is_varlen,
                 seqused_k is None, hq // hkv)
    seqlen_q = lens["seqlen_q"]
    if q.shape[0] == 0 or hq == 0 or batch == 0 or seqlen_q == 0:
        return Plan(None, signature)  # no row (q.shape[0] is B or total_q)
    # (batch, row, head) strides; lse: (batch, head).
    sq, sk, sv, so = (strides(t, is_varlen) for t in (q, k, v, out))
    sl = strides(lse, is_varlen)[:2]
    cfg = _config(q, override)
    shared = _shared_kw(q, k, left, right, scale, sink, cfg)
    kw = dict(stride_q=sq, stride_k=sk, stride_v=sv, stride_o=so, stride_l=sl, **shared)
    if DENSE_SPLIT_KV and not is_varlen and seqused_k is None:
        dense = _dense_split_plan(q, k, v, out, lse, shared, cfg, batch, lens, signature)
        if dense is not None:
            return dense
    programs, sched = 0, None
    wg = cfg.consumers
    n_items = batch * hq * cdiv(seqlen_q, wg * HALF_M.value)
    if _persistent_ok(q, k, v, out, shared, cfg, is_varlen=is_varlen, seqused_k=seqused_k):
        n_sm = _sm_count(q.device)
        programs = _persistent_programs(seqlen_q, lens["seqlen_k"], batch * hq, shared, n_sm,
                                        wg)
        # (Not while a CUDA graph is captured: its replays would read the pinned buffer.)
        if (not programs and cfg.persistent_table
                and not torch.cuda.is_current_stream_capturing()):
            table = _greedy_table(_block_costs(seqlen_q, lens["seqlen_k"], shared, wg),
                                  batch * hq, n_sm,
                                  lens["seqlen_k"] * 2 * q.shape[-1] * q.element_size())
            sched = None if table is None else _device_table(table, q.device)
            if sched is not None:
                programs = min(n_sm, n_items)
    if programs:
        kw.update(batch=batch, seqlen_q=seqlen_q, seqlen_k=lens["seqlen_k"], n_items=n_items,
                  HQ=hq, sched=sched, TABLE=sched is not None,
                  O_IN_Q=_out_in_q(q, shared, wg), Q_BUFS=_q_bufs(q, shared, cfg), WG=wg)
        kw["CONSUMER_REGS"] = _consumer_regs(kw["CONSUMER_REGS"], wg)
        for name in ("PINGPONG", "OVERLAP"):
            kw.pop(name)
        run = Launch(_fwd_sm90_persistent_kernel, (programs, ),
                     *positional(_fwd_sm90_persistent_kernel, 9, kw))
        if sched is not None:
            run = _TableLaunch(run, q.device)
        return Plan(run, (*signature, "persistent"))
    if is_varlen and _varlen_ok(q, k, v, out, lse, shared, cfg, batch, lens):
        wg = cfg.varlen_consumers
        splits = _varlen_splits(_varlen_blocks(batch, lens["total_q"], seqlen_q, wg) * hq,
                                lens, shared, q.device)
        return _varlen_plan(q, out, lse, kw, shared, batch, lens, seqused_k, signature, splits,
                            wg)
    if not cfg.grid:
        return None  # fwd.py's kernel
    kw.update(**lens, IS_VARLEN=is_varlen, HAS_SEQUSED_K=seqused_k is not None)
    grid = (cdiv(seqlen_q, 2 * HALF_M), hq, batch)
    return Plan(Launch(_fwd_sm90_kernel, grid, *positional(_fwd_sm90_kernel, 9, kw)), signature)


def _persistent_ok(q, k, v, out, shared, cfg, *, is_varlen, seqused_k) -> bool:
    """Whether a call takes the persistent kernel: its config asks for it (the overlapped
    schedule, no ping-pong), a dense call without seqused_k whose q, k, v and out are
    ``(B * S, H * D)`` matrices (heads adjacent, sequences back to back), ``S_q`` a multiple
    of 64 and ``S_k`` of BLOCK_N (no tile crosses a sequence), and Q and the ring fit in
    shared memory (out beside them, or staged in Q's buffer: :func:`_out_in_q`)."""
    if not cfg.persistent or cfg.pingpong or not cfg.overlap or is_varlen:
        return False
    if seqused_k is not None or _ring_bytes(q, shared, 1, cfg.consumers) > SMEM_BYTES:
        return False
    return persistent_layout(q, k, (q, k, v, out), shared["BLOCK_N"])


def _varlen_ok(q, k, v, out, lse, shared, cfg, batch, lens) -> bool:
    """Whether a packed varlen call takes the persistent varlen kernel: its config asks for
    it (and the overlapped schedule), there can be more items (row blocks x heads) than SMs
    (with at most one a program it would only add its list's launch to the grid kernel's
    work; where the config has no grid kernel, D = 64, the alternative is fwd.py's, and the
    call stays here), q, k, v and out are ``(total, H * D)`` matrices (heads adjacent), lse
    ``(H, total_q)`` with rows contiguous, there is a key row, the row and item counts stay
    in int32, and Q and the ring fit in shared memory."""
    if not cfg.persistent_varlen or cfg.pingpong or not cfg.overlap:
        return False
    total_q, total_k, d = lens["total_q"], lens["total_k"], q.shape[-1]
    if total_k == 0 or max(total_q, total_k) >= 2**31 or lse.stride(1) != 1:
        return False
    wg = cfg.varlen_consumers
    items = _varlen_blocks(batch, total_q, lens["seqlen_q"], wg) * q.shape[-2]
    if items >= 2**31:
        return False
    if (cfg.grid and items <= _sm_count(q.device)
            and _varlen_splits(items, lens, shared, q.device) == 1):
        return False
    if _ring_bytes(q, shared, 1, wg) > SMEM_BYTES:
        return False
    return all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v, out))


# The persistent varlen kernel deals its items in sections of query heads whose K/V fits in
# about this many bytes (most of the H100/H200's 50 MB L2; smaller sections deal less evenly:
# each one's rounds are padded to an even count).
VARLEN_L2_BYTES = 32 << 20


def _section_heads(hq, group, kv_head_bytes) -> int:
    """The query heads of one of the persistent varlen kernel's sections: whole groups whose
    K/V (``kv_head_bytes`` a kv head, every sequence's) fits in VARLEN_L2_BYTES."""
    return min(hq, max(1, VARLEN_L2_BYTES // max(kv_head_bytes, 1)) * group)


def _table_keys(block_table, max_seqlen_k, page) -> int:
    """The keys a paged call's sequences can have: those of the table's pages that can hold
    one of the first ``max_seqlen_k`` keys (only those entries are looked at)."""
    return min(block_table.shape[1], cdiv(max(int(max_seqlen_k), 0), page)) * page


def _varlen_blocks(batch, total_q, seqlen_q, wg: int = 2) -> int:
    """The most row blocks of ``wg * 64`` rows a varlen call can have: one partial block a
    sequence beyond ``total_q``'s full ones, and at most ``batch x cdiv(seqlen_q, wg * 64)``."""
    block_m = wg * HALF_M.value
    return min(cdiv(total_q, block_m) + batch, batch * cdiv(seqlen_q, block_m))


def _varlen_splits(items, lens, shared, device) -> int:
    """The key splits of a packed varlen call of ``items`` (row blocks x heads, the host's
    bound): ``_split_count``'s with VARLEN_SPLIT_KV on, else 1."""
    if not VARLEN_SPLIT_KV:
        return 1
    return _split_count(items, cdiv(lens["seqlen_k"], shared["BLOCK_N"]), _sm_count(device))


class _VarlenLaunch:
    """The persistent varlen kernel's two launches: ``_varlen_blocks_kernel`` lists the row
    blocks into a fresh buffer on the call's stream (the caching allocator keeps it for the
    stream, so calls on several streams never share one), then the kernel walks them. With
    key splits (``splits > 1``) the kernel writes the splits' partial states to float32
    workspaces and ``merge_splits`` merges them into out and lse (every row: the list holds
    every sequence's blocks)."""

    __slots__ = ("plan_blocks", "kernel", "size", "splits")

    def __init__(self, plan_blocks: Launch, kernel: Launch, size: int, splits: int = 1):
        self.plan_blocks = plan_blocks
        self.kernel = kernel
        self.size = size
        self.splits = splits

    def __call__(self, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k) -> None:
        if self.splits == 1:
            blocks = self._blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, q.device)
            self.kernel(q, k, v, out, lse, sink, blocks, None)
            return
        blocks = self._blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, q.device)
        part_o, part_lse = split_states(self.splits, out)
        self.kernel(q, k, v, part_o, part_lse, None, blocks, None)
        merge_splits(part_o, part_lse, sink, out, lse)

    def _blocks(self, cu_seqlens_q, cu_seqlens_k, seqused_k, device):
        blocks = torch.empty(self.size, dtype=torch.int32, device=device)
        self.plan_blocks(cu_seqlens_q, cu_seqlens_k, seqused_k, blocks, None)
        return blocks


class _DenseSplit:
    """A dense call on the persistent varlen kernel with key splits (DENSE_SPLIT_KV): q, k,
    v and out read as the packed rows of ``batch`` sequences of equal lengths (views), the
    splits' partial states merged into the dense out ``(B, Sq, H, Dv)`` and lse ``(B, H,
    Sq)``, the sink once. The row blocks' list is a function of the plan alone: listed once
    a stream and kept (``_blocks``), so a call launches the kernel and the merge only."""

    __slots__ = ("varlen", "batch", "seqlen_q", "seqlen_k", "lists")

    def __init__(self, varlen: _VarlenLaunch, batch: int, seqlen_q: int, seqlen_k: int):
        self.varlen, self.batch, self.seqlen_q, self.seqlen_k = varlen, batch, seqlen_q, seqlen_k
        self.lists = {}

    def __call__(self, q, k, v, out, lse, sink, *_) -> None:
        rows = [_rows(t) for t in (q, k, v, out)]
        part_o, part_lse = split_states(self.varlen.splits, rows[3])
        self.varlen.kernel(*rows[:3], part_o, part_lse, None, self._blocks(q.device), None)
        merge_splits(part_o, part_lse, sink, out, lse)

    def _blocks(self, device) -> torch.Tensor:
        """The row blocks' list, read (never written) by the kernel: listed on the call's
        stream the first time and kept for that stream, whose later calls run after the
        listing. While a CUDA graph captures, a fresh list (the capture runs nothing, so a
        kept one would hold no values before a replay)."""
        stream = None
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return self._list(device)
            stream = torch.cuda.current_stream(device).cuda_stream
        blocks = self.lists.get(stream)
        if blocks is None:
            if len(self.lists) >= 64:
                self.lists.clear()
            blocks = self.lists[stream] = self._list(device)
        return blocks

    def _list(self, device) -> torch.Tensor:
        starts = [row_starts(self.batch, n, device) for n in (self.seqlen_q, self.seqlen_k)]
        return self.varlen._blocks(*starts, None, device)


def _rows(t):
    """A dense ``(B, S, H, D)`` tensor whose sequences lie back to back as ``(B * S, H, D)``
    rows (a view: :func:`_dense_split_plan` checked the strides)."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def _dense_split_plan(q, k, v, out, lse, shared, cfg, batch, lens, signature) -> Plan | None:
    """A dense call of at most half the SMs' items (row blocks x heads) on keys long enough to
    split (``_split_count``) as packed varlen sequences of equal lengths on the persistent
    varlen kernel with key splits (DENSE_SPLIT_KV), or None: its config does not run that
    kernel, the layout does not pack (heads adjacent, sequences back to back, Dv = D), or
    the call would not split."""
    sq, sk, hq, d = lens["seqlen_q"], lens["seqlen_k"], q.shape[2], q.shape[3]
    if not cfg.persistent_varlen or cfg.pingpong or not cfg.overlap or sk < DENSE_SPLIT_MIN_KEYS:
        return None
    wg = cfg.varlen_consumers
    if max(batch * sq, batch * sk) >= 2**31 or _ring_bytes(q, shared, 1, wg) > SMEM_BYTES:
        return None
    if not all(t.shape[3] == d and t.stride(3) == 1 and t.stride(2) == d
               and (t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1))
               for t in (q, k, v, out)):
        return None
    splits = _split_count(batch * cdiv(sq, wg * HALF_M.value) * hq,
                          cdiv(sk, shared["BLOCK_N"]), _sm_count(q.device))
    if splits == 1:
        return None
    rows = dict(seqlen_q=sq, seqlen_k=sk, total_q=batch * sq, total_k=batch * sk)
    kw = dict(stride_k=strides(k), stride_v=strides(v), **shared)
    varlen = _varlen_plan(_rows(q), _rows(out), lse, kw, shared, batch, rows, None,
                          signature, splits, wg)
    return Plan(_DenseSplit(varlen.run, batch, sq, sk), (*varlen.signature, "dense"))


def _varlen_plan(q, out, lse, kw, shared, batch, lens, seqused_k, signature,
                 splits: int, wg: int) -> Plan:
    """The persistent varlen kernel's plan (``_varlen_ok`` admitted the call; ``kw`` the grid
    kernel's launch keywords, ``shared`` the ``_shared_kw`` among them) with ``splits`` key
    splits (1: none) on ``wg`` consumer warpgroups."""
    hq = q.shape[-2]
    seqlen_q, total_q = lens["seqlen_q"], lens["total_q"]
    n_blocks = _varlen_blocks(batch, total_q, seqlen_q, wg)
    block_b = min(max(next_pow2(batch), 128), 1024)
    plan_blocks = Launch(_varlen_blocks_kernel, (cdiv(seqlen_q, wg * HALF_M.value), ),
                         *positional(_varlen_blocks_kernel, 5, dict(
                             batch=batch, total_q=total_q, total_k=lens["total_k"],
                             seqlen_q=seqlen_q, seqlen_k=lens["seqlen_k"], capacity=n_blocks,
                             stride_tb=0, num_pages=0, rows_lo=0, BLOCK_M=wg * HALF_M.value,
                             BLOCK_B=block_b, HAS_SEQUSED_K=seqused_k is not None, GROUP=1,
                             PAGE_SIZE=0, BLOCK_P=1, ALIGN_END=_align_end(wg), num_warps=4)))
    heads = _section_heads(hq, kw["GROUP"], lens["total_k"] * 2 * q.shape[-1] * q.element_size())
    args = dict(stride_qs=q.stride(0), stride_ks=kw["stride_k"][1], stride_vs=kw["stride_v"][1],
                stride_os=out.stride(0), stride_lh=lse.stride(0), total_q=total_q,
                total_k=lens["total_k"], heads=heads, HQ=hq, O_IN_Q=_out_in_q(q, shared, wg),
                WG=wg, **_varlen_shared(shared, wg))
    if splits > 1:
        # Partial states to float32 workspaces (rows H * D apart, lse rows total_q); the
        # sink is added by the merge.
        args.update(stride_os=hq * out.shape[-1], stride_lh=total_q, HAS_SINK=False)
    programs = min(_sm_count(q.device), n_blocks * splits * hq)
    kernel = Launch(_fwd_sm90_varlen_kernel, (programs, ),
                    *positional(_fwd_sm90_varlen_kernel, 8, dict(args, stride_tb=0, PAGE_SIZE=0,
                                                                 SPLITS=splits)))
    return Plan(_VarlenLaunch(plan_blocks, kernel, 1 + VARLEN_ITEM.value * n_blocks, splits),
                (*signature, "persistent varlen") + ((f"{splits} splits", ) if splits > 1
                                                      else ()))


def _align_end(wg) -> int:
    """``_varlen_blocks_kernel``'s ``ALIGN_END`` for ``wg`` consumer warpgroups: three
    parts' blocks end at the sequence's end (rounded up to a part), two start at row 0."""
    return HALF_M.value if wg == 3 else 0


def _varlen_shared(shared, wg) -> dict:
    """``_shared_kw``'s keywords that the persistent varlen kernel takes, its consumers'
    registers capped for ``wg`` of them (:func:`_consumer_regs`)."""
    kw = {k: v for k, v in shared.items() if k not in ("PINGPONG", "OVERLAP")}
    kw["CONSUMER_REGS"] = _consumer_regs(kw["CONSUMER_REGS"], wg)
    return kw


def _consumer_regs(regs, wg) -> int:
    """A persistent forward's consumer registers a thread: the config's, and with three
    consumer warpgroups at most 160. Four warpgroups share the register file: the default
    partition's 168 a thread, the two other consumers' 160, the producer's 24
    (128 x (168 + 160 + 160 + 24) = 65,536)."""
    return min(regs, 160) if wg == 3 else regs


def _ring_bytes(q, shared, row_buffers, wg: int = 2) -> int:
    """Shared memory of the persistent kernels' K/V ring and ``row_buffers`` buffers of
    ``wg`` 64-row parts (Q; out or dO, dQ)."""
    d = q.shape[-1]
    return (row_buffers * wg * HALF_M.value * d
            + 2 * shared["STAGES"] * shared["BLOCK_N"] * d) * q.element_size()


def _out_in_q(q, shared, wg: int = 2) -> bool:
    """Whether the persistent forward stages out in Q's buffer (no room for its own)."""
    return _ring_bytes(q, shared, 2, wg) > SMEM_BYTES


def _q_bufs(q, shared, cfg) -> int:
    """The persistent forward's Q buffers: ``cfg.q_bufs`` (2: the next item's Q loads
    during this one) where they fit in shared memory beside out's own buffer, else 1."""
    if (cfg.q_bufs > 1
            and _ring_bytes(q, shared, 1 + cfg.q_bufs, cfg.consumers) <= SMEM_BYTES):
        return cfg.q_bufs
    return 1


def persistent_layout(q, k, tensors, block_n) -> bool:
    """Whether the persistent kernels (this forward, bwd_sm90's dQ) can address a dense call:
    ``S_q % 64 == 0``, ``S_k`` a positive multiple of ``block_n``, rows in int32, and each of
    ``tensors`` a ``(B * S, H * D)`` matrix (heads adjacent, sequences back to back)."""
    b, s_q, s_k, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
    if s_q % HALF_M.value or s_k == 0 or s_k % block_n or b * max(s_q, s_k) >= 2**31:
        return False
    return all(t.stride(2) == t.shape[-1] == d and t.stride(0) == t.shape[1] * t.stride(1)
               for t in tensors)


# Shared memory the persistent kernels plan for: sm_90's 227 KB a block, less 1 KB for their
# barriers (the forward at D = 128 with out's own buffer: 196,968 bytes; the dQ: 229,768).
SMEM_BYTES = 227 * 1024 - 1024


# The persistent kernel's static schedule is taken when its busiest program has at most this
# much more work than a perfect spread over every SM (the grid kernel's hardware scheduler
# balances unequal row blocks by itself).
PERSISTENT_SLACK = 1.05


def _persistent_programs(s_q, s_k, heads, shared, n_sm, wg: int = 2) -> int:
    """The persistent kernel's program count for a dense call of ``heads`` (batch x query
    heads) sequences, or 0 when its static round robin (program ``p`` takes items ``p,
    p + P, ...``, row block fastest) would leave the SMs unevenly loaded. A row block costs
    its key tiles plus one (the epilogue and the pipeline's ramp); among ``P`` = the SM count
    and the 8 below it, the one whose busiest program costs least, if that is within
    ``PERSISTENT_SLACK`` of the total over every SM (or of the largest block). Causal S = 4k-16k
    at B*S = 16k, H = 16 has no such ``P`` (1.06-1.57x); S = 1k / 2k have (P = 131), and so
    does every call without a mask."""
    cost = _block_costs(s_q, s_k, shared, wg)
    n_m = cost.numel()
    n_items = heads * n_m
    floor = max(float(cost.sum()) * heads / n_sm, float(cost.max()))
    best, best_p = None, 0
    items = torch.arange(n_items, dtype=torch.int32)
    weights = cost.double().repeat(heads)  # item i costs cost[i % n_m]
    for p in range(min(n_sm, n_items), max(min(n_sm, n_items) - 9, 0), -1):
        busiest = float(torch.bincount(items % p, weights=weights).max())
        if best is None or busiest < best:
            best, best_p = busiest, p
        if n_items <= n_sm or not (shared["HAS_LEFT"] or shared["HAS_RIGHT"]):
            break  # equal blocks: fewer programs never balance better
    return best_p if best <= PERSISTENT_SLACK * floor else 0


def _block_costs(s_q, s_k, shared, wg: int = 2) -> torch.Tensor:
    """A head's row blocks (``wg * 64`` rows) in the persistent kernel's item order (the last
    first): each one's key tiles (``_key_ranges``' count) plus one, for its epilogue and the
    pipeline's ramp."""
    bm, bn = wg * HALF_M.value, shared["BLOCK_N"]
    if wg == 3:  # blocks aligned to the end (``_dense_item``): the first one's m0 < 0
        m0 = s_q - torch.arange(1, cdiv(s_q, bm) + 1) * bm
    else:
        m0 = torch.arange(cdiv(s_q, bm) - 1, -1, -1) * bm
    m_last = torch.clamp(m0 + bm, max=s_q) - 1
    m0 = torch.clamp(m0, min=0)
    shift = s_k - s_q
    n_hi = torch.full_like(m0, s_k)
    if shared["HAS_RIGHT"]:
        n_hi = torch.clamp(m_last + shift + shared["right"] + 1, max=s_k)
    n_lo = torch.zeros_like(m0)
    if shared["HAS_LEFT"]:
        n_lo = torch.clamp(m0 + shift - shared["left"], min=0) // bn * bn
    return (torch.maximum(n_hi, n_lo) - n_lo + bn - 1) // bn + 1


# The host's schedule is built for calls of at most this many row blocks (a heap push and
# pop each, once per call metadata: ~1 us a block).
MAX_TABLE_ITEMS = 65536


# The host's schedule keeps the K/V of the heads in flight within about this many bytes
# (a third of the H100/H200's 50 MB L2: two sections can overlap).
TABLE_L2_BYTES = 16 << 20


def _greedy_table(cost: torch.Tensor, heads: int, n_sm: int,
                  kv_bytes: int) -> list[int] | None:
    """The persistent kernel's ``TABLE`` schedule: the heads in sections whose K/V
    (``kv_bytes`` a head) fit ``TABLE_L2_BYTES``, a section's row blocks longest first, dealt
    as the GPU's block scheduler would deal a grid's, each to the program that frees up first
    under ``cost`` (``_block_costs``). Causal B*S = 16k, H = 16 at S = 1k-16k: the busiest
    program 1.00-1.02x a perfect spread (1.005-1.07x in the grid's own order, 1.06-1.57x
    for the round robin). ``n_sm + 1`` offsets, then each program's items; None past
    ``MAX_TABLE_ITEMS``."""
    n_m = cost.numel()
    n_items = heads * n_m
    if n_items > MAX_TABLE_ITEMS:
        return None
    costs = cost.tolist()
    section = max(1, TABLE_L2_BYTES // max(kv_bytes, 1)) * n_m
    order = sorted(range(n_items), key=lambda i: (i // section, -costs[i % n_m], i))
    programs = min(n_sm, n_items)
    free = [(0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for item in order:
        t, p = heapq.heappop(free)
        lists[p].append(item)
        heapq.heappush(free, (t + costs[item % n_m], p))
    offsets = [0]
    for items in lists:
        offsets.append(offsets[-1] + len(items))
    return offsets + [i for items in lists for i in items]


# The host's tables on the device, kept for the process's life: a CUDA graph that captured a
# table plan replays its kernel after the plan cache has dropped the plan (it is cleared when
# full), so no table is ever freed. Past MAX_KEPT_TABLE_BYTES in all, no more tables are
# built (those calls run the grid kernel); a table is 4 bytes a row block (8 KB at causal
# B*S = 16k, H = 16, S = 4k).
_TABLES: list = []
MAX_KEPT_TABLE_BYTES = 64 << 20


def _device_table(table: list[int], device) -> torch.Tensor | None:
    """``table`` (``_greedy_table``'s) on ``device``, or None past MAX_KEPT_TABLE_BYTES.
    Copied from pinned memory without a host wait (torch keeps the pinned block until the
    copy is done) on this call's stream (``_TableLaunch`` orders the other streams)."""
    if 4 * (len(table) + sum(t.numel() for t in _TABLES)) > MAX_KEPT_TABLE_BYTES:
        return None
    sched = torch.tensor(table, dtype=torch.int32).pin_memory().to(device, non_blocking=True)
    _TABLES.append(sched)
    return sched


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Page sizes smaller than a key tile that the paged kernel takes, one TMA box a page (row
# offsets in the swizzled tile are multiples of 8); larger pages must be a multiple of the
# tile. B=4 Sq=512 on 8k (benchmarks/RESULTS.md, session 16, call 6): with two producer
# warps (K; V) reading a tile's block-table entries a tile ahead, page 16 runs at 0.94x the
# dense kernel (0.70x with one warp waiting on each entry's load), above gathering the pages
# for the dense kernel (0.80x), so attention_with_kvcache reads every page size of the
# domain in place. Pages of 8 rows (32 boxes a K tile, not measured) run fwd.py's paged
# kernel; their rows copied by cp.async instead ran at 0.38x (session 14) and were removed.
PAGE_SIZES = (16, 32, 64)
MAX_PAGED_BATCH = 4096
# D = 64 pages on the Gluon kernels (the head dims whose paged forms the GPU tests run: 64 and
# 128); off, D = 64 paged calls run fwd.py's paged kernel (the A/B of bench_serving --dim 64).
PAGED_D64 = True
# D = 256 pages on the Gluon kernels (the persistent varlen kernel's paged form, O staged in
# Q's buffer, 64-key tiles; the grid kernel for other layouts): compiled for sm_90 (stack
# 72-96 bytes, as the shipped D = 256 varlen kernel's 80); off, D = 256 paged calls run
# fwd.py's paged kernel.
PAGED_D256 = False


def paged_supported(q, k_cache, v_cache, *, softcap, scale, batch=0) -> bool:
    """The paged kernel's domain: :func:`supported`'s at D = Dv = 128, or 64 (sm_90,
    fp16/bf16, no softcap, TMA-aligned; the head dims its GPU tests run), pages of 16, 32 or
    64 rows or a multiple of BLOCK_N, copied by TMA, each page's rows contiguous in the cache
    (``stride(0) == page_size * stride(1)``), and cache rows addressable in int32. Other page
    sizes (1, 3, 8, 48, ...) run fwd.py's paged kernel (``attention_with_kvcache`` gathers
    the pages of long chunks for the dense kernel)."""
    d = q.shape[-1]
    if not (d == 128 or (d == 64 and PAGED_D64) or (d == 256 and PAGED_D256)):
        return False
    num_pages, page = k_cache.shape[:2]
    block_n = configs.FWD_SM90[d].block_n
    # _long_block reads every sequence's lengths in one vector: up to 4096 sequences it
    # compiles without a spill (16384: 1216 bytes of stack).
    if batch > MAX_PAGED_BATCH:
        return False
    if page not in PAGE_SIZES and (page == 0 or page % block_n):
        return False
    if num_pages * page >= 2**31:
        return False
    if any(t.stride(0) != page * t.stride(1) for t in (k_cache, v_cache)):
        return False
    return supported(q, k_cache, v_cache, softcap=softcap, scale=scale, batch=batch)


def paged_plan(q, k_cache, v_cache, block_table, out, lse, *, cu_seqlens_q, max_seqlen_q,
               seqused_k, max_seqlen_k, left, right, softcap, scale, sink, rows_lo, plans=None):
    """The paged kernel's :class:`Plan` for the sequences of more than ``rows_lo`` packed rows
    (``T_q * Hq / Hkv``) of a paged call (arguments as ``fwd.attn_fwd_paged``'s, ``out`` /
    ``lse`` its outputs), or None outside :func:`paged_supported`'s domain. Cached by the
    call's metadata, as :func:`plan`; ``plans``: a cache the caller keeps for calls of one
    metadata but the lengths and alignment (a public call's kept key), where the plan is
    found by those alone."""
    override = options.current().fwd_sm90_config
    key = None
    batch = cu_seqlens_q.numel() - 1
    cache = _PLANS
    if not override:
        # Not the lengths a serving step changes (q's rows, lse's stride, the batch up to its
        # power of two, max_seqlen_q / k): the plan's launch takes them each call.
        key = ((q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0,
               next_pow2(max(batch, 1)), rows_lo)
        if plans is None:
            key = ("paged", q.shape[1:], q.stride(), q.dtype, q.device, k_cache.shape,
                   k_cache.stride(), v_cache.shape, v_cache.stride(), block_table.stride(),
                   out.stride(), sink is None, left, right, softcap, scale, *key)
        else:
            key, cache = ("sm90", *key), plans
        found = cache.get(key, _MISSING)
        if found is not _MISSING:
            return found
    result = None
    if paged_supported(q, k_cache, v_cache, softcap=softcap, scale=scale, batch=batch):
        result = _paged_plan(q, k_cache, v_cache, block_table, out, lse, batch=batch, left=left,
                             right=right, scale=scale, sink=sink, rows_lo=rows_lo,
                             override=override)
    if key is not None:
        if len(cache) >= _MAX_PLANS:
            cache.clear()
        cache[key] = result
    return result


def _paged_plan(q, k_cache, v_cache, block_table, out, lse, *, batch, left, right, scale, sink,
                rows_lo, override) -> Plan:
    hq = q.shape[1]
    num_pages, page, hkv = k_cache.shape[:3]
    signature = ("fwd_sm90 paged", q.dtype, left is None, right is None, sink is None,
                 hq // hkv, min(page, 128))
    if hq == 0:
        return Plan(None, signature)
    cfg = _config(q, override)
    shared = _shared_kw(q, k_cache, left, right, scale, sink, cfg)
    if PAGED_PERSISTENT and _paged_varlen_ok(q, k_cache, v_cache, out, lse, shared, cfg):
        return Plan(_paged_varlen_run(q, k_cache, v_cache, block_table, out, shared,
                                      rows_lo, batch, cfg.varlen_consumers),
                    (*signature, "persistent"))
    kw = dict(stride_q=q.stride()[:2], stride_k=k_cache.stride()[:3],
              stride_v=v_cache.stride()[:3], stride_o=out.stride()[:2],
              stride_tb=block_table.stride(0), num_pages=num_pages, rows_lo=rows_lo,
              PAGE_SIZE=page, **shared)
    kw["BLOCK_B"] = max(next_pow2(batch), 32 * kw["num_warps"])
    launch = SizedLaunch(_fwd_sm90_paged_kernel, 9, kw, _PAGED_SIZED)
    return Plan(_PagedRun(launch, hq, page), signature)


# A paged call's long sequences on the persistent varlen kernel (its PAGE_SIZE form) where
# the layouts allow, else on the paged grid kernel (a program a row block and head).
PAGED_PERSISTENT = True


def _paged_varlen_ok(q, k_cache, v_cache, out, lse, shared, cfg) -> bool:
    """Whether a paged call's long sequences take the persistent varlen kernel: its config
    asks for it (the overlapped schedule), q and out are ``(total, H * D)`` matrices and each
    cache page's rows ``(page_size, H_kv * D)`` ones (heads adjacent), lse's rows are
    contiguous, and Q and the ring fit in shared memory."""
    if not cfg.persistent_varlen or cfg.pingpong or not cfg.overlap:
        return False
    if lse.stride(-1) != 1 or _ring_bytes(q, shared, 1, cfg.varlen_consumers) > SMEM_BYTES:
        return False
    d = q.shape[-1]
    return (all(t.stride(-1) == 1 and t.stride(-2) == d for t in (q, out, k_cache, v_cache))
            and q.shape[0] < 2**31)


def _paged_varlen_run(q, k_cache, v_cache, block_table, out, shared, rows_lo, batch, wg):
    """:class:`_PagedVarlenRun` of a call that :func:`_paged_varlen_ok` admitted (``batch``:
    the plan's; its power of two is in the plan's key), on ``wg`` consumer warpgroups."""
    hq = q.shape[1]
    num_pages, page, hkv, d = k_cache.shape
    group = hq // hkv
    # The list reads (sequences x table entries) tiles of PAGED_LIST_TILE: the fewer the
    # sequences, the more entries a step (a long context's row in few steps).
    block_b = min(max(next_pow2(batch), 16), 128)
    # (Sized per call: batch, total_q, max_seqlen_q, the keys' capacity, the list's.)
    blocks_kw = dict(total_k=0, stride_tb=block_table.stride(0), num_pages=num_pages,
                     rows_lo=rows_lo, BLOCK_M=wg * HALF_M.value, BLOCK_B=block_b,
                     HAS_SEQUSED_K=True, GROUP=group, PAGE_SIZE=page,
                     BLOCK_P=PAGED_LIST_TILE // block_b, ALIGN_END=_align_end(wg),
                     num_warps=4)
    plan_blocks = SizedLaunch(_varlen_blocks_kernel, 5, blocks_kw, _BLOCKS_SIZED)
    args = dict(stride_qs=q.stride(0), stride_ks=k_cache.stride(1), stride_vs=v_cache.stride(1),
                stride_os=out.stride(0), stride_tb=block_table.stride(0),
                total_k=num_pages * page, HQ=hq, O_IN_Q=_out_in_q(q, shared, wg), PAGE_SIZE=page,
                SPLITS=1, WG=wg, **_varlen_shared(shared, wg))
    kernel = SizedLaunch(_fwd_sm90_varlen_kernel, 8, args, _VARLEN_SIZED)
    # Key splits (PAGED_SPLIT_KV): partial states in float32 workspaces whose rows are
    # ``H * D`` apart, no sink in the kernel (the merge adds it), a launch per split count.
    split_args = dict(args, stride_os=hq * d, HAS_SINK=False)
    splits = {n: SizedLaunch(_fwd_sm90_varlen_kernel, 8, dict(split_args, SPLITS=n),
                             _VARLEN_SIZED) for n in _SPLIT_COUNTS} if PAGED_SPLIT_KV else {}
    return _PagedVarlenRun(plan_blocks, kernel, hq, page, group,
                           2 * d * k_cache.element_size(), _sm_count(q.device), splits,
                           shared["BLOCK_N"], wg)


# Block-table entries the paged list reads a step (``_paged_lens``), over its sequences.
PAGED_LIST_TILE = 4096

# Key splits (on since session 31, NOTES.md): a paged call whose row blocks x heads fill at
# most half the SMs (a long context's chunk on few heads, as one GPU of a tensor-parallel
# model holds) splits each block's key tiles into 2-16 shares, an item each, and merges the
# partial states (``_PagedVarlenRun``). H200, 512 rows on a 64k cache, 8 / 2 heads: the
# kernel 0.74 -> 0.21 ms (4 splits) plus a 4 us merge.
PAGED_SPLIT_KV = True
# The same for packed varlen calls (attention_varlen, attention_with_kvcache's contiguous
# chunked prefill), which then take the persistent varlen kernel with at most as many items
# as SMs (``_varlen_ok``).
VARLEN_SPLIT_KV = True
# The same for dense calls (``_dense_split_plan``; on since session 32), whose few items
# (512 rows on 64k keys at 8 heads: 32) leave the persistent kernel at ~185 TFLOP/s on 132
# SMs: fl.attention there 0.767 -> 0.222 ms (RESULTS.md, session 32, call 2). D = 256's
# config does not take the persistent varlen kernel, so it stays unsplit.
DENSE_SPLIT_KV = True
# A dense split needs this many keys: its call costs ~80-95 us more host time than the
# unsplit one on the H200's hosts (RESULTS.md, session 32, calls 4 and 7), which 128 rows on 8k
# keys at 8 heads (2 splits: the kernel 100 -> 55 us) do not earn back (public call 0.104 ->
# 0.222 ms) and 256 rows on 16k (4 splits) do (0.195 -> 0.120 ms).
DENSE_SPLIT_MIN_KEYS = 16384
_SPLIT_COUNTS = (2, 4, 8, 16)
# A split takes at least this many key tiles (4k keys at BLOCK_N = 128): a split costs the
# call two workspaces and the merge's launch (~45-60 us of host, measured on the dense
# split, and 2-4 us of GPU time on the H200's hosts: RESULTS.md, session 32, calls 9-10),
# which a shorter split would not earn back (B=1, 128 rows on a 4k cache split 8 ways: 0.43
# against 0.35 ms a host-bound public call, session 31).
SPLIT_MIN_TILES = 32


def _split_count(items: int, key_tiles: int, n_sm: int) -> int:
    """The key splits of a call of ``items`` (row blocks x heads, the host's bound) whose
    sequences have at most ``key_tiles`` key tiles: the largest of ``_SPLIT_COUNTS``
    that keeps ``items x splits`` within the SMs and ``SPLIT_MIN_TILES`` tiles a split, or 1
    (no split) when the items fill more than half the SMs."""
    best = 1
    for n in _SPLIT_COUNTS:
        if items * n <= n_sm and key_tiles >= n * SPLIT_MIN_TILES:
            best = n
    return best


# The arguments of the list and of the persistent varlen kernel that change per paged call.
_BLOCKS_SIZED = ("batch", "total_q", "seqlen_q", "seqlen_k", "capacity")
_VARLEN_SIZED = ("stride_lh", "total_q", "heads")


class _PagedVarlenRun:
    """A paged call's launches on the persistent varlen kernel: ``_varlen_blocks_kernel``
    lists the long sequences' row blocks (their lengths, the table's bad pages, a program a
    block index) into a fresh buffer, then the kernel walks them, a program an SM, in
    sections of heads whose K/V fits in L2 (as :func:`_varlen_plan`). Each call's lengths give
    the grids and the sized arguments; a call with no row launches nothing."""

    __slots__ = ("plan_blocks", "kernel", "hq", "page", "group", "kv_row_bytes", "n_sm",
                 "splits", "block_n", "wg")

    def __init__(self, plan_blocks, kernel, hq, page, group, kv_row_bytes, n_sm, splits,
                 block_n, wg):
        self.plan_blocks, self.kernel, self.hq, self.page = plan_blocks, kernel, hq, page
        self.group, self.kv_row_bytes, self.n_sm = group, kv_row_bytes, n_sm
        # (splits: the launch of each split count, PAGED_SPLIT_KV; empty when off)
        self.splits, self.block_n = splits, block_n
        self.wg = wg  # consumer warpgroups: row blocks of wg * 64

    def __call__(self, q, k_cache, v_cache, out, lse, sink, cu_seqlens_q, seqused_k,
                 block_table, max_seqlen_q, max_seqlen_k) -> None:
        total_q, batch, seqlen_q = q.shape[0], cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)
        if total_q == 0 or batch == 0 or seqlen_q == 0:
            return
        keys = _table_keys(block_table, max_seqlen_k, self.page)
        n_blocks = _varlen_blocks(batch, total_q, seqlen_q, self.wg)
        blocks = torch.empty(1 + VARLEN_ITEM.value * n_blocks, dtype=torch.int32,
                             device=q.device)
        self.plan_blocks((cdiv(seqlen_q, self.wg * HALF_M.value), ),
                         (batch, total_q, seqlen_q, keys, n_blocks),
                         cu_seqlens_q, None, seqused_k, blocks, block_table)
        heads = _section_heads(self.hq, self.group, batch * keys * self.kv_row_bytes)
        n = (_split_count(n_blocks * self.hq, cdiv(keys, self.block_n), self.n_sm)
             if self.splits else 1)
        if n == 1:
            self.kernel((min(self.n_sm, n_blocks * self.hq), ), (lse.stride(0), total_q, heads),
                        q, k_cache, v_cache, out, lse, sink, blocks, block_table)
            return
        # Each split's partial state, then their merge into every row of out / lse: the rows
        # of sequences the list leaves out (decodes) are written after, by fwd.py's kernel.
        part_o, part_lse = split_states(n, out)
        self.splits[n]((min(self.n_sm, n_blocks * n * self.hq), ), (total_q, total_q, heads),
                       q, k_cache, v_cache, part_o, part_lse, None, blocks, block_table)
        merge_splits(part_o, part_lse, sink, out, lse)


def split_states(n: int, out):
    """The float32 workspaces of ``n`` key splits' partial states for a varlen ``out
    (total_q, H, D)``: ``(n, total_q, H, D)`` and ``(n, H, total_q)``, as the persistent
    varlen kernel stores them with ``SPLITS = n`` (and :func:`merge_splits` reads them)."""
    total_q, hq, d = out.shape
    return (torch.empty((n, total_q, hq, d), dtype=torch.float32, device=out.device),
            torch.empty((n, hq, total_q), dtype=torch.float32, device=out.device))


def merge_splits(part_o, part_lse, sink, out, lse) -> None:
    """Merges key splits' partial states (``part_o (S, total_q, H, D)``, ``part_lse (S, H,
    total_q)``, float32) into a varlen ``out (total_q, H, D)`` and ``lse (H, total_q)`` (any
    row stride), or a dense call's ``out (B, Sq, H, D)`` and ``lse (B, H, Sq)`` whose
    sequences' rows lie back to back in the partial states' (DENSE_SPLIT_KV), adding the
    sink once: ``merge_states``' kernel, through views of lse."""
    if out.dim() == 3:  # varlen: one "batch" of total_q rows
        out, lse = out[None], lse[None]
    n, b, sq, hq = part_o.shape[0], out.shape[0], out.shape[1], out.shape[2]
    combine.merge_states_fwd(part_o.view(n, b, sq, hq, part_o.shape[-1]),
                             part_lse.view(n, hq, b, sq).permute(0, 2, 3, 1),
                             sink=None if sink is None else sink.float(), out=out,
                             lse_out=lse.transpose(1, 2))


# The paged kernel's arguments that change from call to call (SizedLaunch).
_PAGED_SIZED = ("stride_lh", "seqlen_q", "total_q", "batch", "capacity")


class _PagedRun:
    """:func:`paged_plan`'s launch: each call's lengths (q's rows, the batch, max_seqlen_q /
    max_seqlen_k) give the kernel's grid and its sized arguments; a call with no row
    launches nothing."""

    __slots__ = ("launch", "hq", "page")

    def __init__(self, launch: SizedLaunch, hq: int, page: int):
        self.launch, self.hq, self.page = launch, hq, page

    def __call__(self, q, k_cache, v_cache, out, lse, sink, cu_seqlens_q, seqused_k,
                 block_table, max_seqlen_q, max_seqlen_k) -> None:
        total_q, batch, seqlen_q = q.shape[0], cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)
        if total_q == 0 or batch == 0 or seqlen_q == 0:
            return
        blocks = _varlen_blocks(batch, total_q, seqlen_q)
        self.launch((blocks, self.hq), (lse.stride(0), seqlen_q, total_q, batch,
                                        _table_keys(block_table, max_seqlen_k, self.page)),
                    q, k_cache, v_cache, out, lse, sink, cu_seqlens_q, seqused_k, block_table)


def attn_fwd_sm90(q, k, v, out, lse, *, left, right, scale, sink, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """Fill and return ``out`` and ``lse`` (``fwd.new_outputs``'s, the shapes and meaning of
    ``fwd.attn_fwd``'s) for a call inside :func:`supported`'s domain (tests and benchmarks
    call it directly; ``dispatch.attn_fwd`` goes through :func:`plan`)."""
    p = plan(q, k, v, out, lse, softcap=0.0, left=left, right=right, scale=scale, sink=sink,
             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
             max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    if p is None:
        raise ValueError("attn_fwd_sm90: the call is outside the Hopper forward's domain "
                         "(fwd_sm90.supported, and at a head dim whose config has no grid "
                         "kernel the persistent kernels' layouts); call dispatch.attn_fwd")
    if p.run is not None:
        triton.set_allocator(alloc_scratch)
        p.run(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k)
    return out, lse
