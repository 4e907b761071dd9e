"""Hopper MLA decode: 64 query heads a program against one latent head (Gluon, warp-specialised).

MLA (DeepSeek, Kimi) decodes 16-128 query heads (x 1-2 query rows) against one latent head of
``D = 576`` columns whose first ``Dv = 512`` are also V. At serving batch sizes that is
compute-bound (B=64, Skv=8k, Hq=128: 146 GFLOP a step against 0.6 GB of cache), and the
portable split-KV kernel (``decode.py``) runs its products as ``tl.dot`` with both warpgroups
meeting every key tile. Same math and contract as ``decode.py`` (its docstring derives them):
base-2 online softmax, partial states ``(O_s, L_s)`` per split merged by ``combine.py``, an
empty row gives out = 0 and lse = -inf, the sink counted once (here with one split, else in
the merge).

Schedule (FlashMLA's published design). A program owns 64 rows (query position x head) of
one sequence and split; its accumulator ``[64, 512]`` float32 does not fit one warpgroup, so

- warpgroup w owns output columns ``[256 w, 256 w + 256)``;
- one producer warp loads Q ``[64, 576]`` once and the key tiles ``[64, 576]`` into two
  buffers, each as nine 64-column TMA pieces with a barrier each, so ``S = Q K^T`` starts as
  the first piece lands;
- the tiles come in pairs: warpgroup 0 computes S of the pair's first tile, warpgroup 1 of the
  second, at the same time. They swap their row maxima through shared memory, so both
  rescale by one running max ``m`` (the two halves of a row must share it), and each writes
  its probabilities P (bf16, ``[64, 64]``) over its tile's last piece (the rope columns
  ``[512, 576)``, no longer needed once S is computed). Each warpgroup then adds
  ``P_own V_own`` (P from registers) and ``P_other V_other`` (P from shared memory) to its
  half of the accumulator; its partial row sum ``l_w`` covers its own tiles, and
  ``l = l_0 + l_1`` at the end (both were rescaled by the same factors).
- a buffer is freed in two parts, each by the warpgroup whose V half it holds, as soon as
  that warpgroup's product with it is done (the rope piece, holding P, with the other
  warpgroup's part), and the producer refills the parts in the order they free, so half of
  the next pair is in flight before the pair's last product (+5 to +12% over freeing whole
  buffers; FlashMLA's seesaw order on top of it measured 0 to -7%: benchmarks/NOTES.md,
  session 12). Pages below 32 rows keep one whole tile a producer iteration
  (WHOLE_TILES_BELOW_PAGE).
- shared memory: Q 72 KB + two tiles 144 KB; one program per SM.

Tiles past a sequence's end. A contiguous cache is read through one descriptor over its
``B * Smax`` rows, a paged one over its ``num_pages * page_size`` rows (page sizes multiple
of 64: a tile is one page's rows; pages of 8, 16 or 32 rows: one TMA box a page, ``SUB``
rows). The rows of the last tile past the sequence's length are cache memory (any bits,
NaN included), so the owning warpgroup overwrites them with zeros before S is computed: a
masked key then has P = 0 and V = 0, never ``0 * NaN``. A page outside ``[0, num_pages)`` is
no key: its tile is read from past the descriptor's end (zeros) and masked. With two or more
row tiles a sequence, the producer also asks L2 for the tile two ahead of the one it loads.

Top-k lists (``sparse_attention``'s token table: DeepSeek-V3.2's sparse decode and prefill).
Hopper has no TMA gather: producer warps (TOPK_SPLIT) copy a tile's 64 listed rows with
cp.async into the same swizzled pieces, each thread arriving on a piece's barrier when its
copies land; a row of no key (-1, outside the cache) is zero-filled and masked. The producer
also writes which listed keys exist into shared memory with the tile's rope piece, so the
consumers mask without reading the lists themselves (two dependent global loads a tile,
and their registers, on the consumers' critical path before).

Domain (``supported``): sm_90, fp16/bf16, ``v`` the view ``k[..., :512]`` of a ``(.., 1, 576)``
cache, Sq * Hq rows of one latent head, no softcap, contiguous or paged (page size 8, 16, 32
or a multiple of 64) caches, windows and sink, or a token table. Everything else runs
``decode.py``. Gluon does not run under TRITON_INTERPRET: CI compiles this kernel for sm_90
(tests/test_kernels_compile_sm90.py); the H200 runs tests/kernels/test_decode_mla_sm90.py.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._common import capability, decode_split, final_stats, token_rows

ROWS = gl.constexpr(64)  # query rows (position x head) a program: one wgmma M
KEYS = gl.constexpr(64)  # keys a tile
PIECE = gl.constexpr(64)  # columns a TMA piece (128-byte swizzle)
D_K = gl.constexpr(576)
D_V = gl.constexpr(512)
NP = gl.constexpr(9)  # pieces of a K row: eight of V's columns, one of the rope's
HALF = gl.constexpr(256)  # output columns a warpgroup
# Tiles the producer asks L2 for ahead of the tile it loads, when a sequence has two or more
# row tiles (compute-bound); none with one (Hq = 16: memory-bound, where it cost). RESULTS.md
# 2026-12-01, session 11's schedules table, call 3: 2 tiles ahead +1.8-2.9% at Hq = 128
# against none, 4 and 8 below none; Hq = 16 0.80x copy without, 0.62x with.
PREFETCH_TILES = 2
# Buffers are refilled in two parts as they free (_producer); one tile at a time, whole, for
# pages smaller than this, where the pair loop's unrolled copies (four or eight boxes a piece)
# made ptxas spill in consumer warpgroup 1 (90 local accesses at page 16, none at 32).
# RESULTS.md 2026-12-02, session 12, B=64 Skv=8k Hq=128, TFLOP/s, session 11's one-tile loop
# against two parts: page 8 202 / 184, 16 380 / 287, 32 452 / 486, 64 500 / 530.
WHOLE_TILES_BELOW_PAGE = 32
# Whole tiles of pages smaller than this: two producer warps, a buffer each (even and odd
# tiles). RESULTS.md 2026-12-02, session 18, call 3 (B=64 Skv=8k Hq=128, TFLOP/s, one / two
# producers, two passes): page 8 199, 200 / 238, 236; page 16 378, 380 / 271, 268.
TWO_PRODUCERS_BELOW_PAGE = gl.constexpr(16)
# Top-k lists: (producer warps, their registers, the consumers' registers). The producer
# gathers each tile's rows with cp.async (addresses in registers); setmaxnreg's budget (64K
# registers) is shared with the two consumer warpgroups, and the default one gets the rest.
# (2, 56, 240) left it 208 and spilling; four producer warps of 48 leave the producer
# unspilled, consumer 1 at 216 (3 spilled loads) and the default one at 240. RESULTS.md
# 2026-12-03, session 23, TFLOP/s B=64 Skv=8k / B=128 Skv=4k topk=2048 (CUDA graphs):
# (2, 56, 240) 260 / 277, (4, 48, 224) 344 / 374, (4, 48, 216) 379 / 419, (4, 56, 216)
# 363 / 399, (4, 40, 232) 327 / 348.
TOPK_SPLIT = (4, 48, 216)
# (Not done for top-k lists: the producer asking L2 for the listed rows of the next pairs,
# one bulk prefetch a row. With (4, 48, 224), 2 / 4 tiles ahead: 317 / 303 and 338 / 326
# against none 344 / 374; in git history, commit 6ee0ea3.)
# The wgmma descriptors of a key buffer's pieces rebuilt in the loop from a value the compiler
# cannot see through (_buffer), not hoisted out of it: hoisted, they outgrew warpgroup 0's
# registers (sm_90 compile, paged 64: 160 bytes of stack, 34 local loads a step in its loop;
# rebuilt: 16 bytes, 2). RESULTS.md 2026-12-03, session 27, call 6 (public calls in turns,
# same bits): +2.0 to +6.4% on every MLA row, B=128 Skv=4k 490 -> 521 TFLOP/s.
REBUILD_DESCRIPTORS = True
# The shared scalar helpers (_common), compiled as Gluon functions.
_decode_split = gluon.jit(decode_split.fn)
_final_stats = gluon.jit(final_stats.fn)
_token_rows = gluon.jit(token_rows.fn)


@gluon.jit
def _piece(nope, rope, p: gl.constexpr):
    """Columns ``[64 p, 64 p + 64)`` of a row block held as V's 512 columns and the rope's 64."""
    if p < NP - 1:
        return nope.slice(p * PIECE, PIECE, 1)
    else:
        return rope


@gluon.jit
def _tile_row(keys, i_b, n0, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr):
    """``(row, ok)``: the cache row of key ``n0`` (a tile's first) in the K descriptor, and
    whether the tile's page is inside the cache (a page outside is read past the descriptor's
    end, which gives zeros, and its keys are masked). ``keys``: the kernel's key-table
    arguments (block table, token pages, their strides, page count, capacity, token-table
    sizes)."""
    block_table, _, stride_tb, _, num_pages, capacity, _, _, _ = keys
    if PAGED:
        page = gl.load(block_table + i_b.to(gl.int64) * stride_tb + n0 // PAGE_SIZE)
        ok = (page >= 0) & (page < num_pages)
        row = gl.where(ok, page, num_pages) * PAGE_SIZE + n0 % PAGE_SIZE
    else:
        ok = n0 >= 0
        row = i_b * capacity + n0
    return row, ok


@gluon.jit
def _listed_rows(keys, i_b, n0, n_end, TOKEN_PAGE: gl.constexpr, layout: gl.constexpr):
    """Top-k lists (a token table, decode.py's TOKEN_TABLE): ``(row, ok)`` of keys
    ``[n0, n0 + KEYS)``, the cache row (int64) of each listed token position and whether it
    holds a key: a position below ``n_end``, inside ``[0, Sk)`` (-1: none) and, through the
    cache's block table (TOKEN_PAGE rows a page), on a page inside the cache. Only entries of
    existing keys are read; one latent head, so a row is page ``b * Sk + j`` itself."""
    table, token_pages, stride_tb, stride_pb, _, _, table_sk, per_batch, table_pages = keys
    o_n = n0 + gl.arange(0, KEYS, layout=layout)
    row, ok = _token_rows(table, token_pages, o_n, o_n < n_end, i_b, stride_tb, stride_pb,
                          table_sk, per_batch, table_pages, TOKEN_PAGE)
    return row, ok


@gluon.jit
def _page_ok(keys, i_b, n0, n_end, PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
    """Pages smaller than a tile: ``(page, ok)`` of each key of ``[n0, n0 + KEYS)``, its page
    and whether it is inside the cache (table entries read only below ``n_end``)."""
    block_table, _, stride_tb, _, num_pages, _, _, _, _ = keys
    o_n = n0 + gl.arange(0, KEYS, layout=layout)
    ok = o_n < n_end
    page = gl.load(block_table + i_b.to(gl.int64) * stride_tb + o_n // PAGE_SIZE, mask=ok,
                   other=-1)
    return page, ok & (page >= 0) & (page < num_pages)


@gluon.jit
def _prefetch_l2(k, keys, i_b, stride_kn, n0, n_end, PAGE_SIZE: gl.constexpr,
                 PAGED: gl.constexpr):
    """Asks L2 for the rows of the tile at key ``n0`` below ``n_end`` (one bulk prefetch from
    lane 0; a page outside the cache is not touched): the tile's TMA copies, issued when a
    buffer frees, then read L2 instead of waiting on memory."""
    SUB: gl.constexpr = PAGE_SIZE if PAGED and PAGE_SIZE < 64 else 64
    # (A tile past the end has no table entry to read: look up the last key's instead.)
    row, ok = _tile_row(keys, i_b, gl.minimum(n0, n_end - 1), PAGE_SIZE, PAGED)
    if ok & (n0 < n_end):
        nbytes = gl.minimum(n_end - n0, SUB) * stride_kn * (k.dtype.element_ty.primitive_bitwidth // 8)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [k + row.to(gl.int64) * stride_kn, nbytes], dtype=gl.int32,
            is_pure=False, pack=1)


@gluon.jit
def _prefetch_ahead(k, keys, i_b, stride_kn, n0, n_end, TILES: gl.constexpr,
                    PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, PREFETCH: gl.constexpr):
    """The TILES tiles PREFETCH tiles after the one at key ``n0`` into L2, while the producer
    waits for buffers (a box a page when pages are smaller than a tile)."""
    if PREFETCH > 0:
        SUB: gl.constexpr = PAGE_SIZE if PAGED and PAGE_SIZE < 64 else 64
        for i in gl.static_range(TILES * KEYS // SUB):
            _prefetch_l2(k, keys, i_b, stride_kn, n0 + PREFETCH * KEYS + i * SUB, n_end,
                         PAGE_SIZE, PAGED)


@gluon.jit
def _tma_piece(k_desc, k_smem, k_rope, k_full, s, p: gl.constexpr, row, i: gl.constexpr,
               SUB: gl.constexpr):
    """Rows ``[i SUB, i SUB + SUB)`` of piece p of buffer s from cache row ``row`` by TMA."""
    dst = _piece(k_smem.index(s), k_rope.index(s), p)
    if SUB < KEYS:
        dst = dst.slice(i * SUB, SUB, 0)
    tma.async_copy_global_to_shared(k_desc, [row, p * PIECE], k_full.index(s * NP + p), dst)


@gluon.jit
def _gather_piece(k_smem, k_rope, k_full, s, p: gl.constexpr, src, ok):
    """Piece p of buffer s gathered row by row (cp.async); this thread arrives on the piece's
    barrier when its copies have landed (rows of no key are zero-filled)."""
    async_copy.async_copy_global_to_shared(_piece(k_smem.index(s), k_rope.index(s), p),
                                           src + p * PIECE, mask=ok[:, None])
    async_copy.mbarrier_arrive(k_full.index(s * NP + p), increment_count=False)


@gluon.jit
def _tile_src(keys, i_b, n0, n_end, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr,
              TOKEN_TABLE: gl.constexpr, TOKEN_PAGE: gl.constexpr):
    """Where the producer reads the tile at key ``n0`` from, looked up once a tile (its two
    parts are issued at different times): ``(row, ok)``, the first cache row and whether the
    page is in the cache (a tile of one page); for pages smaller than a tile, ``n0`` itself
    (``_load_part`` looks each page up); for top-k lists each key's row and whether it holds
    a key. Table entries are read only for keys below ``n_end``."""
    SUB: gl.constexpr = PAGE_SIZE if PAGED and PAGE_SIZE < 64 else 64
    if TOKEN_TABLE:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        row, ok = _listed_rows(keys, i_b, n0, n_end, TOKEN_PAGE, gl.SliceLayout(1, layout))
        # (Rows of the descriptor's extent, below 2^31 (fits): half the registers.)
        row = row.to(gl.int32)
    elif SUB < KEYS:
        # Scalars looked up in _load_part: a vector of the pages measured slower.
        row, ok = n0, True
    else:
        # (A tile past the end, the odd pair's second, reads no table entry.)
        row, ok = _tile_row(keys, i_b, gl.minimum(n0, n_end - 1), PAGE_SIZE, PAGED)
    return row, ok


@gluon.jit
def _load_part(k_desc, k_smem, k_rope, k_full, ok_smem, k, keys, i_b, n_end, stride_kn, row, ok,
               s, LO: gl.constexpr, HI: gl.constexpr, ROPE: gl.constexpr,
               PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr):
    """Pieces ``[LO, HI)`` (and the rope piece if ROPE) of a tile into buffer s from where
    :func:`_tile_src` says: by TMA (one box a piece, or a page when pages are smaller than a
    tile), or gathered row by row for top-k lists. With the rope piece of a top-k tile goes
    its key mask (``ok_smem[s]``, which listed keys exist), released by the rope piece's
    barrier: the consumer then reads no list itself."""
    SUB: gl.constexpr = PAGE_SIZE if PAGED and PAGE_SIZE < 64 else 64
    if TOKEN_TABLE:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        cols = gl.arange(0, PIECE, layout=gl.SliceLayout(0, layout))
        src = k + row.to(gl.int64)[:, None] * stride_kn + cols[None, :]
        for p in gl.static_range(LO, HI):
            _gather_piece(k_smem, k_rope, k_full, s, p, src, ok)
        if ROPE:
            _gather_piece(k_smem, k_rope, k_full, s, NP - 1, src, ok)
        if ROPE or HI == NP:
            # The buffer's consumer read its previous mask before it wrote the P that the
            # rope piece held, so before this part was freed.
            ok_smem.index(s).store(ok.to(gl.int32))
            gl.thread_barrier()
            mbarrier.arrive(k_full.index(s * NP + NP - 1))
    else:
        nbytes: gl.constexpr = (KEYS // SUB) * k_desc.block_type.nbytes
        for p in gl.static_range(LO, HI):
            mbarrier.expect(k_full.index(s * NP + p), nbytes)
        if ROPE:
            mbarrier.expect(k_full.index(s * NP + NP - 1), nbytes)
        for i in gl.static_range(KEYS // SUB):
            row_i = row
            if SUB < KEYS:
                # row is the tile's first key: page i's first row, or the row past the
                # descriptor's end (zeros) for a page past n_end (it has no table entry) or
                # outside the cache.
                n_i = row + i * SUB
                row_i, _ = _tile_row(keys, i_b, gl.where(n_i < n_end, n_i, row), PAGE_SIZE,
                                     PAGED)
                row_i = gl.where(n_i < n_end, row_i, keys[4] * PAGE_SIZE)
            for p in gl.static_range(LO, HI):
                _tma_piece(k_desc, k_smem, k_rope, k_full, s, p, row_i, i, SUB)
            if ROPE:
                _tma_piece(k_desc, k_smem, k_rope, k_full, s, NP - 1, row_i, i, SUB)


@gluon.jit
def _refill(k_desc, k_smem, k_rope, k_full, k_empty, ok_smem, k, keys, i_b, n_end, stride_kn, ph,
            row, ok, I, PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr,
            WHOLE_TILES: gl.constexpr):
    """Refill I (a constexpr) of a pair, into buffer ``S = I % 2`` once it is free: warpgroup
    ``W = S ^ (I // 2)``'s part of it (pieces ``[4 W, 4 W + 4)``, and the rope piece when W is
    not the buffer's own warpgroup); with WHOLE_TILES the whole tile into buffer I (0 or 1,
    at run time) once both its parts are."""
    if WHOLE_TILES:
        mbarrier.wait(k_empty.index(2 * I), ph)
        mbarrier.wait(k_empty.index(2 * I + 1), ph)
        _load_part(k_desc, k_smem, k_rope, k_full, ok_smem, k, keys, i_b, n_end, stride_kn, row,
                   ok, I, 0, NP, False, PAGE_SIZE, PAGED, TOKEN_TABLE)
    else:
        S: gl.constexpr = I % 2
        W: gl.constexpr = S ^ (I // 2)
        mbarrier.wait(k_empty.index(2 * S + W), ph)
        _load_part(k_desc, k_smem, k_rope, k_full, ok_smem, k, keys, i_b, n_end, stride_kn, row,
                   ok, S, 4 * W, 4 * W + 4, W != S, PAGE_SIZE, PAGED, TOKEN_TABLE)


@gluon.jit
def _producer(q_desc, k_desc, q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty, ok_smem, k,
              keys, i_b, stride_kn, q_row0, n_start, n_end, n_tiles, PAGE_SIZE: gl.constexpr,
              PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr, TOKEN_PAGE: gl.constexpr,
              PREFETCH: gl.constexpr, WHOLE_TILES: gl.constexpr, FIRST: gl.constexpr = 0,
              STEP: gl.constexpr = 1):
    """Q's nine pieces once, then the tiles in pairs (tile 2j into buffer 0, 2j + 1 into
    buffer 1), each buffer in two parts as the warpgroups free them: the columns of
    warpgroup w's V half are free when w's product with them is done (``k_empty[2 s + w]``),
    and the rope piece (holding the P of the buffer's own warpgroup) goes with the other
    warpgroup's part. In the order they free: buffer 0's pieces 0-3, buffer 1's 4-7,
    buffer 0's 4-8, buffer 1's 0-3 and 8 (warpgroup 1 computes its scores in that order).
    WHOLE_TILES: one tile at a time, each buffer refilled in one pass when both its parts are
    free (session 11's loop; pages smaller than 32 rows, where the pair loop's unrolled copies
    cost the consumers registers: see WHOLE_TILES_BELOW_PAGE). With ``STEP = 2`` (whole
    tiles: two producer warps, each issuing a page's nine boxes after its table lookup) this
    warp takes the tiles ``FIRST, FIRST + 2, ...``, buffer FIRST's; the first one loads Q."""
    if FIRST == 0:
        mbarrier.expect(q_bar.index(0), NP * q_desc.block_type.nbytes)
        for p in gl.static_range(NP):
            tma.async_copy_global_to_shared(q_desc, [q_row0, p * PIECE], q_bar.index(0),
                                            _piece(q_smem, q_rope, p))
    if WHOLE_TILES:
        # One tile an iteration (buffer t % 2): a loop body of one tile's copies.
        for t in range(FIRST, n_tiles, STEP):
            n0 = n_start + t * KEYS
            _prefetch_ahead(k, keys, i_b, stride_kn, n0, n_end, 1, PAGE_SIZE, PAGED, PREFETCH)
            row, ok = _tile_src(keys, i_b, n0, n_end, PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE)
            _refill(k_desc, k_smem, k_rope, k_full, k_empty, ok_smem, k, keys, i_b, n_end,
                    stride_kn, ((t // 2) & 1) ^ 1, row, ok, t % 2, PAGE_SIZE, PAGED, TOKEN_TABLE,
                    True)
    else:
        for j in range((n_tiles + 1) // 2):
            n0 = n_start + 2 * j * KEYS
            has1 = 2 * j + 1 < n_tiles
            _prefetch_ahead(k, keys, i_b, stride_kn, n0, n_end, 2, PAGE_SIZE, PAGED, PREFETCH)
            # Both tiles' rows while the buffers are still in use.
            row0, ok0 = _tile_src(keys, i_b, n0, n_end, PAGE_SIZE, PAGED, TOKEN_TABLE,
                                  TOKEN_PAGE)
            row1, ok1 = _tile_src(keys, i_b, n0 + KEYS, n_end, PAGE_SIZE, PAGED, TOKEN_TABLE,
                                  TOKEN_PAGE)
            # A fresh barrier counts as having completed the phase before 0.
            ph = (j & 1) ^ 1
            for i in gl.static_range(4):
                if i % 2 == 0:
                    _refill(k_desc, k_smem, k_rope, k_full, k_empty, ok_smem, k, keys, i_b,
                            n_end, stride_kn, ph, row0, ok0, i, PAGE_SIZE, PAGED, TOKEN_TABLE,
                            False)
                elif has1:
                    _refill(k_desc, k_smem, k_rope, k_full, k_empty, ok_smem, k, keys, i_b,
                            n_end, stride_kn, ph, row1, ok1, i, PAGE_SIZE, PAGED, TOKEN_TABLE,
                            False)


@gluon.jit
def _zero_tail(buf, rope, n_valid):
    """Zeros rows ``[n_valid, KEYS)`` of a landed tile (cache memory past the sequence)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, KEYS, layout=gl.SliceLayout(1, layout))
    for p in gl.static_range(NP):
        piece = _piece(buf, rope, p)
        x = piece.load(layout)
        piece.store(gl.where(rows[:, None] < n_valid, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _qk_piece(q_smem, q_rope, buf, rope, k_full, w: gl.constexpr, ph, p: gl.constexpr, tok):
    """Adds piece p's product to the scores ``tok`` when the piece has landed."""
    mbarrier.wait(k_full.index(w * NP + p), ph)
    return warpgroup_mma(_piece(q_smem, q_rope, p), _piece(buf, rope, p).permute((1, 0)), tok,
                         is_async=True)


@gluon.jit
def _scores(q_smem, q_rope, buf, rope, k_full, w: gl.constexpr, ph, n0, n_end, tile_ok, diag,
            left, right, scale_log2, n_safe_lo, n_safe_hi,
            HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, TOKEN_TABLE: gl.constexpr,
            PAGE_OK_VEC: gl.constexpr, s_layout: gl.constexpr):
    """Base-2 scores ``t = scale log2(e) Q K^T`` of the tile in ``buf`` (warpgroup w's), masked
    keys at -inf; the product is issued piece by piece as the pieces land. ``tile_ok``: the
    tile's page is in the cache, or (TOKEN_TABLE) the shared buffer where the producer put
    which of its listed keys exist (released with the rope piece, waited for below)."""
    if (not TOKEN_TABLE) and (n0 + KEYS > n_end):
        # The sequence's last tile: wait for all of it and zero the rows past the end.
        for p in gl.static_range(NP):
            mbarrier.wait(k_full.index(w * NP + p), ph)
        _zero_tail(buf, rope, n_end - n0)
    # Pieces in the order they arrive: 0-8 for warpgroup 0's buffer, 4-7, 0-3, 8 for
    # warpgroup 1's (see _producer).
    P0: gl.constexpr = 4 * w
    mbarrier.wait(k_full.index(w * NP + P0), ph)
    s_zero = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout)
    tok = warpgroup_mma(_piece(q_smem, q_rope, P0), _piece(buf, rope, P0).permute((1, 0)),
                        s_zero, use_acc=False, is_async=True)
    for i in gl.static_range(1, NP - 1):
        tok = _qk_piece(q_smem, q_rope, buf, rope, k_full, w, ph, (i + P0) % (NP - 1), tok)
    tok = _qk_piece(q_smem, q_rope, buf, rope, k_full, w, ph, NP - 1, tok)
    s = warpgroup_mma_wait(0, deps=(tok, ))
    t = s * scale_log2
    if TOKEN_TABLE:
        ok = tile_ok.load(gl.SliceLayout(0, s_layout)) != 0
        t = gl.where(ok[None, :], t, float("-inf"))
    elif PAGE_OK_VEC:
        # Pages smaller than a tile: each key has its page's answer; every tile is masked.
        t = _mask(t, n0, n_end, tile_ok[None, :], diag, left, right, HAS_LEFT, HAS_RIGHT,
                  s_layout)
    else:
        masked = (n0 + KEYS > n_safe_hi) | (not tile_ok)
        if HAS_LEFT:
            masked = masked | (n0 < n_safe_lo)
        if masked:
            t = _mask(t, n0, n_end, tile_ok, diag, left, right, HAS_LEFT, HAS_RIGHT, s_layout)
    return t


@gluon.jit
def _mask(t, n0, n_end, ok, diag, left, right, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
          s_layout: gl.constexpr):
    """``t`` with -inf at the keys of ``[n0, n0 + KEYS)`` a row does not see: past ``n_end``,
    not ``ok`` (their page), or outside the row's window around its diagonal key."""
    cols = n0 + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    vis = (cols[None, :] < n_end) & ok
    if HAS_RIGHT:
        vis = vis & (cols[None, :] <= diag[:, None] + right)
    if HAS_LEFT:
        vis = vis & (cols[None, :] >= diag[:, None] - left)
    return gl.where(vis, t, float("-inf"))


@gluon.jit
def _tile_scores(q_smem, q_rope, k_smem, k_rope, k_full, ok_smem, keys, i_b, n0, n_end, ph, diag,
                 left, right, scale_log2, n_safe_lo, n_safe_hi, w: gl.constexpr,
                 PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr,
                 TOKEN_PAGE: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                 s_layout: gl.constexpr, REBUILD: gl.constexpr):
    """Warpgroup w's scores of the tile at key ``n0`` in buffer w, with its keys' mask."""
    PAGE_OK_VEC: gl.constexpr = PAGED and (not TOKEN_TABLE) and PAGE_SIZE < KEYS
    if TOKEN_TABLE:
        tile_ok = ok_smem.index(w)
    elif PAGE_OK_VEC:
        _, tile_ok = _page_ok(keys, i_b, n0, n_end, PAGE_SIZE, gl.SliceLayout(0, s_layout))
    else:
        _, tile_ok = _tile_row(keys, i_b, n0, PAGE_SIZE, PAGED)
    wb = _buffer(w, n0, REBUILD)
    return _scores(q_smem, q_rope, k_smem.index(wb), k_rope.index(wb), k_full, w, ph, n0, n_end,
                   tile_ok, diag, left, right, scale_log2, n_safe_lo, n_safe_hi, HAS_LEFT,
                   HAS_RIGHT, TOKEN_TABLE, PAGE_OK_VEC, s_layout)


@gluon.jit
def _buffer(s: gl.constexpr, j, REBUILD: gl.constexpr):
    """Buffer ``s``'s index for a product in the loop over ``j``. REBUILD: as a value the
    compiler cannot see is ``s`` (``j & 0`` in inline PTX), so the wgmma descriptors of the
    buffer's pieces are rebuilt each iteration from its base (a few integer instructions)
    instead of hoisted out of the loop, where 18-odd 64-bit descriptors outgrew warpgroup
    0's registers and were spilled, then reloaded before every product (REBUILD_DESCRIPTORS)."""
    if REBUILD:
        return s + gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [j],
                                             dtype=gl.int32, is_pure=True, pack=1)
    else:
        return s


@gluon.jit
def _pivot(m):
    """The exponent's pivot for running max ``m``: 0 for a row with no visible key yet (m =
    -inf), so that 2^(-inf - 0) = 0 (never -inf - -inf)."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _rows_scale(acc, f, o_layout: gl.constexpr):
    return acc * gl.convert_layout(f, gl.SliceLayout(1, o_layout))[:, None]


@gluon.jit
def _step(q_smem, q_rope, k_smem, k_rope, k_full, k_empty, mx_smem, mx_bar, p_bar, ok_smem, keys,
          i_b, j, n_start, n_end, acc, m_i, l_i, diag, left, right, scale_log2, n_safe_lo,
          n_safe_hi, w: gl.constexpr, HAS1: gl.constexpr, PAGE_SIZE: gl.constexpr,
          PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr, TOKEN_PAGE: gl.constexpr,
          HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, s_layout: gl.constexpr,
          o_layout: gl.constexpr, REBUILD: gl.constexpr):
    """Tiles ``2j`` (warpgroup 0's) and ``2j + 1`` (warpgroup 1's; absent unless HAS1) for
    warpgroup w: its scores, the shared max (both maxima swapped), its P to the other, its
    product with its own tile (then that part of its buffer is free), then with the other's
    (then that part of the other buffer)."""
    dtype: gl.constexpr = q_smem.dtype
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    OWN: gl.constexpr = (w == 0) or HAS1
    OTHER: gl.constexpr = (w == 1) or HAS1
    ph = j & 1
    if OWN:
        t = _tile_scores(q_smem, q_rope, k_smem, k_rope, k_full, ok_smem, keys, i_b,
                         n_start + (2 * j + w) * KEYS, n_end, ph, diag, left, right, scale_log2,
                         n_safe_lo, n_safe_hi, w, PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE,
                         HAS_LEFT, HAS_RIGHT, s_layout, REBUILD)
        m_own = gl.max(t, 1)
    else:
        m_own = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    mx_smem.index(w).store(m_own)
    gl.thread_barrier()
    mbarrier.arrive(mx_bar.index(w))
    mbarrier.wait(mx_bar.index(1 - w), ph)
    m_new = gl.maximum(m_i, gl.maximum(m_own, mx_smem.index(1 - w).load(row_layout)))
    piv = _pivot(m_new)
    alpha = gl.exp2(m_i - piv)
    l_i = l_i * alpha
    acc = _rows_scale(acc, alpha, o_layout)
    if OWN:
        p = gl.exp2(t - piv[:, None])
        l_i = l_i + gl.sum(p, 1)
        p16 = p.to(dtype)
        # P over the tile's rope piece (read by S only), for the other warpgroup's half.
        k_rope.index(w).store(p16)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_bar.index(w))
        tok = warpgroup_mma(gl.convert_layout(p16, p_layout),
                            k_smem.index(_buffer(w, j, REBUILD)).slice(w * HALF, HALF, 1),
                            acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(tok, ))
        mbarrier.arrive(k_empty.index(2 * w + w))
    if OTHER:
        mbarrier.wait(p_bar.index(1 - w), ph)
        o = _buffer(1 - w, j, REBUILD)
        tok = warpgroup_mma(k_rope.index(o), k_smem.index(o).slice(w * HALF, HALF, 1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(tok, ))
        mbarrier.arrive(k_empty.index(2 * (1 - w) + w))
    return acc, m_new, l_i


@gluon.jit
def _consumer(smem, keys, outs, span, w: gl.constexpr, SQ: gl.constexpr, GROUP: gl.constexpr,
              PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr,
              TOKEN_PAGE: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
              HAS_SINK: gl.constexpr, REBUILD: gl.constexpr):
    """Warpgroup w: output columns ``[256 w, 256 w + 256)`` of the program's 64 rows.
    ``smem``: the shared buffers and barriers, ``outs``: the outputs and their strides,
    ``span``: the program's sequence, split, rows, keys and mask scalars (the kernel's
    tuples; the constexprs are passed one by one)."""
    (q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty, mx_smem, mx_bar, p_bar, l_smem,
     l_bar, ok_smem) = smem
    sink, o, lse, stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lq, \
        stride_lh = outs
    i_b, i_s, r0, sk, n_start, n_end, n_tiles, left, right, scale_log2 = span
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = r0 + gl.arange(0, ROWS, layout=row_layout)
    # Each row's diagonal key (bottom-right aligned): row r is query position r // GROUP.
    diag = rows // GROUP + sk - SQ
    # Tiles past n_safe_hi / before n_safe_lo have keys some row does not see.
    n_safe_hi = sk
    if HAS_RIGHT:
        n_safe_hi = gl.minimum(sk, sk - SQ + 1 + right)
    n_safe_lo = sk - 1 - left
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, HALF], gl.float32, layout=o_layout)
    mbarrier.wait(q_bar.index(0), 0)
    for j in range(n_tiles // 2):
        acc, m_i, l_i = _step(q_smem, q_rope, k_smem, k_rope, k_full, k_empty, mx_smem, mx_bar,
                              p_bar, ok_smem, keys, i_b, j, n_start, n_end, acc, m_i, l_i, diag,
                              left, right, scale_log2, n_safe_lo, n_safe_hi, w, True, PAGE_SIZE,
                              PAGED, TOKEN_TABLE, TOKEN_PAGE, HAS_LEFT, HAS_RIGHT, s_layout,
                              o_layout, REBUILD)
    if n_tiles % 2 == 1:
        acc, m_i, l_i = _step(q_smem, q_rope, k_smem, k_rope, k_full, k_empty, mx_smem, mx_bar,
                              p_bar, ok_smem, keys, i_b, n_tiles // 2, n_start, n_end, acc, m_i,
                              l_i, diag, left, right, scale_log2, n_safe_lo, n_safe_hi, w, False,
                              PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE, HAS_LEFT, HAS_RIGHT,
                              s_layout, o_layout, REBUILD)
    # l = l_0 + l_1: each warpgroup summed its own tiles' probabilities.
    l_smem.index(w).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(l_bar.index(w))
    mbarrier.wait(l_bar.index(1 - w), 0)
    l_i = l_i + l_smem.index(1 - w).load(row_layout)

    # Epilogue: out = 0 and lse = -inf (or the sink) for a row with no visible key; a NaN
    # propagates.
    heads = rows % GROUP
    m_r = rows < SQ * GROUP
    sink_nat = 0.0
    if HAS_SINK:
        sink_nat = gl.load(sink + heads, mask=m_r, other=0.0).to(gl.float32)
    o_scale, lse_v = _final_stats(m_i, l_i, sink_nat, HAS_SINK)
    pos = rows // GROUP
    if w == 0:
        o_l = (i_s.to(gl.int64) * stride_ls + i_b.to(gl.int64) * stride_lb
               + pos.to(gl.int64) * stride_lq + heads.to(gl.int64) * stride_lh)
        gl.store(lse + o_l, lse_v, mask=m_r)
    out = acc * gl.convert_layout(o_scale, gl.SliceLayout(1, o_layout))[:, None]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_o = gl.convert_layout(rows, o_rows)
    o_r = (i_s.to(gl.int64) * stride_os + i_b.to(gl.int64) * stride_ob
           + (rows_o // GROUP).to(gl.int64) * stride_oq + (rows_o % GROUP).to(gl.int64) * stride_oh)
    cols = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    gl.store(o + o_r[:, None] + cols[None, :], out.to(o.dtype.element_ty),
             mask=(rows_o < SQ * GROUP)[:, None])


# Lengths and window bounds change per call; specialising on them only recompiles.
@gluon.jit(do_not_specialize=["num_splits", "capacity", "num_pages", "k_rows", "seqlen_add",
                              "left", "right"])
def _mla_decode_kernel(
    q, k, v, cache_seqlens, block_table, sink, o, lse, token_pages,
    stride_qb, stride_qh, stride_kn, stride_tb, stride_pb,
    stride_os, stride_ob, stride_oq, stride_oh,
    stride_ls, stride_lb, stride_lq, stride_lh,
    num_splits, capacity, num_pages, k_rows, table_sk, table_per_batch, table_num_pages,
    seqlen_add, left, right, scale_log2,
    SQ: gl.constexpr, GROUP: gl.constexpr, M_TILES: gl.constexpr,
    PAGE_SIZE: gl.constexpr, PAGED: gl.constexpr, TOKEN_TABLE: gl.constexpr,
    TOKEN_PAGE: gl.constexpr, HAS_SEQLENS: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
    PDL: gl.constexpr, PREFETCH: gl.constexpr, WHOLE_TILES: gl.constexpr, REBUILD: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    if PDL:
        # Let the merge kernel launch now (it waits for this grid before reading).
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    i_bm, i_s = gl.program_id(0), gl.program_id(1)
    # Row tiles vary fastest: the tiles of one (sequence, split) read each K tile once from
    # memory and again from L2.
    i_m = i_bm % M_TILES
    i_b = i_bm // M_TILES
    # decode.py's key range, whole tiles a split, an even count (the warpgroups take them in
    # pairs).
    sk, n_start, n_end = _decode_split(cache_seqlens, i_b, i_s, seqlen_add, capacity, num_splits,
                                       left, SQ, KEYS, 2, HAS_SEQLENS, HAS_LEFT)
    n_tiles = (gl.maximum(n_end - n_start, 0) + KEYS - 1) // KEYS

    dtype: gl.constexpr = q.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, PIECE], dtype)
    r0 = i_m * ROWS
    # Q's rows (position, head) of sequence i_b are contiguous (the launcher checks):
    # rows past Sq * Hq read as zeros.
    q_desc = tma.make_tensor_descriptor(q + i_b.to(gl.int64) * stride_qb, [SQ * GROUP, D_K],
                                        [stride_qh, 1], [ROWS, PIECE], layout)
    SUB: gl.constexpr = PAGE_SIZE if PAGED and PAGE_SIZE < 64 else 64
    k_desc = tma.make_tensor_descriptor(k, [k_rows, D_K], [stride_kn, 1], [SUB, PIECE], layout)
    # Shapes are powers of two: the 512 V columns and the 64 rope columns apart.
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, D_V], layout)
    q_rope = gl.allocate_shared_memory(dtype, [ROWS, PIECE], layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, KEYS, D_V], layout)
    k_rope = gl.allocate_shared_memory(dtype, [2, KEYS, PIECE], layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)
    k_full = gl.allocate_shared_memory(gl.int64, [2 * NP, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
    mx_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    mx_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS], vec_layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS], vec_layout)
    if TOKEN_TABLE:
        # Each buffer's key mask (which listed keys exist), written by the producer.
        ok_smem = gl.allocate_shared_memory(gl.int32, [2, KEYS], vec_layout)
    else:
        ok_smem = l_smem  # (not used)
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(2 * NP):
        # TMA: the producer's expect; gathered: one arrival from each producer thread, and on
        # the rope piece one more for the key mask (_load_part).
        if TOKEN_TABLE:
            mbarrier.init(k_full.index(i), count=32 * PRODUCER_WARPS + (i % NP == NP - 1))
        else:
            mbarrier.init(k_full.index(i), count=1)
    for i in gl.static_range(4):
        # Buffer s's part freed by warpgroup w: k_empty[2 s + w] (_producer).
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(mx_bar.index(i), count=1)
        mbarrier.init(p_bar.index(i), count=1)
        mbarrier.init(l_bar.index(i), count=1)

    # The key-table arguments, passed as one tuple (_tile_row, _listed_rows).
    keys = (block_table, token_pages, stride_tb, stride_pb, num_pages, capacity, table_sk,
            table_per_batch, table_num_pages)
    smem = (q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty, mx_smem, mx_bar, p_bar,
            l_smem, l_bar, ok_smem)
    outs = (sink, o, lse, stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb,
            stride_lq, stride_lh)
    span = (i_b, i_s, r0, sk, n_start, n_end, n_tiles, left, right, scale_log2)
    if WHOLE_TILES and PAGE_SIZE < TWO_PRODUCERS_BELOW_PAGE:
        # Pages of 8 rows: a producer warp a buffer (even tiles; odd tiles), each waiting on
        # its own table lookups and issuing its own boxes (72 a tile): the paged forward's
        # lesson (session 16: one warp's issue was its limit). At page 16 it lost 29%.
        gl.warp_specialize([
            (_consumer, (smem, keys, outs, span, 0, SQ, GROUP, PAGE_SIZE, PAGED, TOKEN_TABLE,
                         TOKEN_PAGE, HAS_LEFT, HAS_RIGHT, HAS_SINK, REBUILD)),
            (_consumer, (smem, keys, outs, span, 1, SQ, GROUP, PAGE_SIZE, PAGED, TOKEN_TABLE,
                         TOKEN_PAGE, HAS_LEFT, HAS_RIGHT, HAS_SINK, REBUILD)),
            (_producer, (q_desc, k_desc, q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty,
                         ok_smem, k, keys, i_b, stride_kn, r0, n_start, n_end, n_tiles,
                         PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE, PREFETCH, WHOLE_TILES, 0, 2)),
            (_producer, (q_desc, k_desc, q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty,
                         ok_smem, k, keys, i_b, stride_kn, r0, n_start, n_end, n_tiles,
                         PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE, PREFETCH, WHOLE_TILES, 1, 2)),
        ], [4, PRODUCER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (smem, keys, outs, span, 0, SQ, GROUP, PAGE_SIZE, PAGED, TOKEN_TABLE,
                         TOKEN_PAGE, HAS_LEFT, HAS_RIGHT, HAS_SINK, REBUILD)),
            (_consumer, (smem, keys, outs, span, 1, SQ, GROUP, PAGE_SIZE, PAGED, TOKEN_TABLE,
                         TOKEN_PAGE, HAS_LEFT, HAS_RIGHT, HAS_SINK, REBUILD)),
            (_producer, (q_desc, k_desc, q_smem, q_rope, k_smem, k_rope, q_bar, k_full, k_empty,
                         ok_smem, k, keys, i_b, stride_kn, r0, n_start, n_end, n_tiles,
                         PAGE_SIZE, PAGED, TOKEN_TABLE, TOKEN_PAGE, PREFETCH, WHOLE_TILES)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def supported(q, k_cache, v_cache, *, paged: bool, softcap, token_table, window) -> bool:
    """The Hopper MLA decode's domain (``decode._decode_plan`` asks); the rest runs decode.py.

    MLA: one latent head of 576 columns, V its first 512 (the same storage), fp16/bf16, no
    softcap; Q's (position, head) rows and the cache's rows evenly strided (one TMA
    descriptor each), 16-byte aligned; page sizes 8, 16, 32 or a multiple of 64, or a token table
    (sparse attention's top-k lists over one-row pages: ``(Sk, per_batch, 1[, pages,
    page size])``, no window: ``window`` says the call has one)."""
    if not q.is_cuda or capability(q) != (9, 0):
        return False
    return fits(q, k_cache, v_cache, paged=paged, softcap=softcap, token_table=token_table,
                window=window)


def fits(q, k_cache, v_cache, *, paged: bool, softcap, token_table, window=False) -> bool:
    """:func:`supported` but the device: the call's shapes, strides, dtypes and alignment are
    the kernel's (tests/test_dispatch_decode.py asks it on CPU tensors)."""
    if not (q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype) or softcap:
        return False
    b, sq, hq, d = q.shape
    if d != D_K or k_cache.shape[-1] != D_K or v_cache.shape[-1] != D_V or k_cache.shape[2] != 1:
        return False
    if v_cache.data_ptr() != k_cache.data_ptr() or v_cache.stride() != k_cache.stride():
        return False
    # (One query row: its stride is never used, the rows are the heads.)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or (sq > 1 and q.stride(1) != hq * q.stride(2)):
        return False
    n, rows = k_cache.shape[0], k_cache.shape[1]
    if token_table is not None:
        # The kernel masks no window on top-k lists (sparse attention has none).
        if rows != 1 or token_table[2] != 1 or window:
            return False
    elif paged and rows % 64 and rows not in (8, 16, 32):
        return False
    if k_cache.stride(0) != rows * k_cache.stride(1) or n * rows >= 2 ** 31:
        return False
    es = q.element_size()
    return (q.data_ptr() % 16 == 0 and k_cache.data_ptr() % 16 == 0
            and (q.stride(0) * es) % 16 == 0 and (q.stride(2) * es) % 16 == 0
            and (k_cache.stride(1) * es) % 16 == 0 and sq * hq < 2 ** 31)


def kernel_args(kw: dict, q, k_cache, *, token_table) -> dict:
    """The launch keywords of :func:`_mla_decode_kernel` after its nine tensors: those it
    shares with ``decode.py``'s kernel taken from that kernel's keywords ``kw`` (the plan's:
    output strides, splits, lengths, mask scalars, table sizes, flags), and its own."""
    sq, hq = q.shape[1], q.shape[2]
    args = {name: kw[name] for name in _mla_decode_kernel.arg_names[9:] if name in kw}
    args.update(
        # One-row pages of a token table: the row stride is the page stride.
        stride_kn=k_cache.stride(0 if token_table else 1),
        k_rows=k_cache.shape[0] * k_cache.shape[1],
        PREFETCH=PREFETCH_TILES if sq * hq > ROWS and token_table is None else 0,
        REBUILD=REBUILD_DESCRIPTORS,
        WHOLE_TILES=(bool(kw["PAGED"]) and kw["PAGE_SIZE"] < WHOLE_TILES_BELOW_PAGE
                     and token_table is None),
        # Gathered rows: producer warps of cp.async (TOPK_SPLIT).
        PRODUCER_WARPS=TOPK_SPLIT[0] if token_table else 1,
        PRODUCER_REGS=TOPK_SPLIT[1] if token_table else 24,
        CONSUMER_REGS=TOPK_SPLIT[2] if token_table else 240, num_warps=4)
    return args
