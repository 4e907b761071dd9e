"""``dispatch.attn_fwd_paged``: which kernels a paged forward launches, with what arguments.

As in tests/test_dispatch.py the kernels are recorders (no GPU, no interpreter) and the Hopper
domain predicate a stub, so these tests see the decisions: the sequences of more than 16
packed rows (``T_q * Hq / Hkv``) go to the Gluon paged kernel (one launch over their row
blocks) and the rest to the portable kernel's launch of small tiles; without the Gluon kernel
(option off, outside its domain, a compile failure) the portable kernel takes both. The
numbers are tested in tests/kernels/test_fwd_paged_sm90.py (H200) and test_kvcache_kernels.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
from test_dispatch import _Kernel

from flashlse import kernel_options
from flashlse.kernels import configs, decode, dispatch, fwd
from flashlse.kernels.failures import FAILURES

fwd_sm90 = pytest.importorskip("flashlse.kernels.fwd_sm90")


@pytest.fixture
def log(monkeypatch):
    launches = []
    monkeypatch.setattr(fwd_sm90, "_fwd_sm90_paged_kernel",
                        _Kernel("gluon", launches, fwd_sm90._fwd_sm90_paged_kernel,
                                lambda kw: "gluon" in FAILING))
    monkeypatch.setattr(fwd, "_attn_fwd_paged_kernel",
                        _Kernel("portable", launches, fwd._attn_fwd_paged_kernel))
    monkeypatch.setattr(fwd_sm90, "_varlen_blocks_kernel",
                        _Kernel("blocks", launches, fwd_sm90._varlen_blocks_kernel))
    monkeypatch.setattr(fwd_sm90, "_fwd_sm90_varlen_kernel",
                        _Kernel("persistent", launches, fwd_sm90._fwd_sm90_varlen_kernel,
                                lambda kw: "persistent" in FAILING))
    monkeypatch.setattr(decode, "_decode_fwd_kernel",
                        _Kernel("decode", launches, decode._decode_fwd_kernel))
    monkeypatch.setattr(decode, "_PLANS", {})
    # The paged kernels' decisions here; the decode kernel's routes in the tests that say so.
    monkeypatch.setattr(dispatch, "PAGED_DECODE", False)
    monkeypatch.setattr(dispatch, "SMALL_DECODE", False)
    monkeypatch.setattr(fwd_sm90, "supported", lambda *a, **k: True)
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)
    # The paged grid kernel here; the persistent varlen form in the tests that say so.
    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", False)
    # Launch plans hold the kernels: fresh ones for each test.
    monkeypatch.setattr(fwd_sm90, "_PLANS", {})
    monkeypatch.setattr(fwd, "_PLANS", {})
    monkeypatch.setattr(triton, "set_allocator", lambda fn: None)
    FAILING.clear()
    with FAILURES.isolated():
        yield launches


FAILING: set[str] = set()


def _call(qlens, page=64, hq=8, hkv=2, d=128, pages=40, max_seqlen_k=512, min_seqlen_q=0):
    """A paged forward of sequences of ``qlens`` query rows (CPU tensors: nothing runs)."""
    total = sum(qlens)
    q = torch.zeros(total, hq, d, dtype=torch.bfloat16)
    cache = torch.zeros(pages, page, hkv, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.full((len(qlens),), 300, dtype=torch.int32)
    table = torch.zeros(len(qlens), 8, dtype=torch.int32)
    return dispatch.attn_fwd_paged(q, cache, cache, table, cu_seqlens_q=cu,
                                   max_seqlen_q=max(qlens), seqused_k=lens,
                                   max_seqlen_k=max_seqlen_k,
                                   left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=None,
                                   min_seqlen_q=min_seqlen_q)


def test_no_portable_launch_when_every_sequence_is_long(log):
    """``min_seqlen_q`` (attention_with_kvcache's chunks: every sequence has Sq rows): when
    its packed rows exceed SMALL_ROWS, every sequence runs on the Hopper kernel and the
    portable kernel is not launched; a bound that leaves small sequences possible, or the
    Hopper kernel failing, launches it (once, its large tiles, when the bound leaves no
    sequence to 16-row tiles)."""
    _call([300, 40, 100], min_seqlen_q=40)
    assert [x.kernel for x in log] == ["gluon"]
    log.clear()
    _call([300, 2, 100], min_seqlen_q=2)  # 2 rows x 4 heads a kv head: 8 <= 16
    assert [x.kernel for x in log] == ["gluon", "portable"]
    log.clear()
    FAILING.add("gluon")
    with pytest.warns(RuntimeWarning, match="Hopper paged forward kernel failed"):
        _call([300, 40, 100], min_seqlen_q=40)
    # One launch of the large tiles: min_seqlen_q leaves no sequence to 16-row tiles.
    assert [x.kernel for x in log] == ["gluon", "portable"]


def test_long_sequences_on_gluon_decodes_on_the_portable_kernel(log):
    """A mixed step: one Gluon launch over the row blocks of the long sequences (grid: the
    bound of row blocks, heads; the decodes' rows skipped by ``rows_lo``), one portable launch
    of small tiles for the sequences of at most 16 packed rows."""
    out, lse = _call([300, 1, 1, 0, 20, 1])
    assert [x.kernel for x in log] == ["gluon", "portable"]
    gluon, portable = log
    total, batch = 324, 6
    assert gluon.grid == (min(-(-total // 128) + batch, batch * 3), 8, 1)
    assert gluon.named["rows_lo"] == fwd.SMALL_ROWS and gluon.named["batch"] == batch
    cfg = configs.FWD_SM90[128]
    flags = {n: gluon.named[n] for n in gluon.named if n.isupper()}
    assert flags == dict(GROUP=4, D=128, PAGE_SIZE=64, BLOCK_B=flags["BLOCK_B"],
                         BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, HAS_LEFT=False,
                         HAS_RIGHT=True, HAS_SINK=False, PINGPONG=cfg.pingpong,
                         OVERLAP=cfg.overlap, CONSUMER_REGS=cfg.consumer_regs)
    assert (gluon.named["left"], gluon.named["right"]) == (0, 0)
    assert gluon.named["scale_log2"] == pytest.approx(128 ** -0.5 * 1.4426950408889634)
    assert gluon.kwargs == dict(num_warps=cfg.num_warps)
    assert gluon.named["BLOCK_B"] >= batch and gluon.named["capacity"] == 8 * 64
    assert gluon.named["stride_k"] == (64 * 2 * 128, 2 * 128, 128)
    assert gluon.named["o"] is out and gluon.named["lse"] is lse
    assert (portable.named["rows_lo"], portable.named["rows_hi"]) == (0, fwd.SMALL_ROWS)
    assert portable.named["o"] is out and portable.named["lse"] is lse


def test_only_decodes_never_ask_the_gluon_kernel(log):
    _call([1, 1, 4])
    assert [(x.kernel, x.named["rows_lo"], x.named["rows_hi"]) for x in log] == [
        ("portable", 0, 16)]


@pytest.mark.parametrize("how", ["option_off", "page8", "page48"])
def test_without_the_gluon_kernel_the_portable_one_takes_every_sequence(log, how):
    """The option off, or a page size outside the Gluon kernel's domain (8 rows: not
    measured; 48: neither a box a page nor a multiple of the tile; fwd_sm90.PAGE_SIZES): the
    portable kernel's two launches, as before."""
    if how == "option_off":
        with kernel_options(sm90_fwd_paged=False):
            _call([300, 1, 20])
    else:
        _call([300, 1, 20], page=int(how.removeprefix("page")))
    assert [(x.kernel, x.named["rows_lo"], x.named["rows_hi"]) for x in log] == [
        ("portable", 16, 1200), ("portable", 0, 16)]


def test_a_compile_failure_warns_once_and_runs_the_portable_kernel(log):
    FAILING.add("gluon")
    with pytest.warns(RuntimeWarning, match="Hopper paged forward"):
        _call([300, 1])
    assert [x.kernel for x in log] == ["gluon", "portable", "portable"]
    log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call([300, 1])
    assert [x.kernel for x in log] == ["portable", "portable"]
    assert [key[0] for key in FAILURES] == ["fwd_sm90 paged"]


@pytest.mark.parametrize("page, ok", [(8, False), (16, True), (32, True), (64, True),
                                      (96, False), (128, True), (256, True)])
def test_paged_domain_page_sizes(monkeypatch, page, ok):
    monkeypatch.setattr(fwd_sm90, "supported", lambda *a, **k: True)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(3, page, 2, 128, dtype=torch.bfloat16)
    assert fwd_sm90.paged_supported(q, cache, cache, softcap=0.0, scale=0.1) is ok
    # More sequences than _long_block's one vector holds: the portable kernel.
    assert not fwd_sm90.paged_supported(q, cache, cache, softcap=0.0, scale=0.1,
                                        batch=fwd_sm90.MAX_PAGED_BATCH + 1)
    # Pages that are not page_size rows apart (a slice of larger pages): no descriptor over
    # the cache's rows addresses them.
    gapped = torch.zeros(3, page + 8, 2, 128, dtype=torch.bfloat16)[:, :page]
    assert not fwd_sm90.paged_supported(q, gapped, gapped, softcap=0.0, scale=0.1)


def test_paged_in_place_follows_the_domain_and_option(monkeypatch):
    monkeypatch.setattr(fwd_sm90, "supported", lambda *a, **k: True)
    q = torch.zeros(2, 5, 8, 128, dtype=torch.bfloat16)
    # Every page size of the Gluon kernel's domain is read in place (page 16 too: 0.94x the
    # dense kernel there, above gathering the pages); pages of 8 are outside it.
    for page, ok in ((8, False), (16, True), (32, True), (64, True)):
        cache = torch.zeros(3, page, 2, 128, dtype=torch.bfloat16)
        assert dispatch.paged_in_place(q, cache, cache, softcap=0.0, scale=0.1) is ok
        with kernel_options(sm90_fwd_paged=False):
            assert not dispatch.paged_in_place(q, cache, cache, softcap=0.0, scale=0.1)


def test_serving_steps_share_the_plans_and_pass_their_lengths(log):
    """A serving engine's steps change the packed rows, the batch (here within one power of
    two) and both max lengths every call: the Gluon and the portable plans are made once
    (their keys leave those out) and each launch gets its call's grid and lengths."""
    steps = [([300, 1, 1], 512), ([120, 1, 40, 1], 200), ([17, 1, 1], 64)]
    for qlens, max_k in steps:
        log.clear()
        out, lse = _call(qlens, max_seqlen_k=max_k)
        gluon, portable = log
        total, batch, max_q = sum(qlens), len(qlens), max(qlens)
        assert gluon.grid == (min(-(-total // 128) + batch, batch * -(-max_q // 128)), 8, 1)
        capacity = min(8, -(-max_k // 64)) * 64
        for launch in (gluon, portable):
            assert (launch.named["total_q"], launch.named["seqlen_q"],
                    launch.named["capacity"]) == (total, max_q, capacity)
            assert launch.named["stride_lh"] == lse.stride(0) == total
            assert launch.named["o"] is out and launch.named["lse"] is lse
        assert gluon.named["batch"] == batch
        assert portable.grid == (1, 2, batch)  # 16-row tiles of the decodes, kv heads, batch
    assert len(fwd_sm90._PLANS) == 1 and len([k for k in fwd._PLANS if k[0] == "paged"]) == 1


def test_persistent_paged_lists_the_long_sequences_then_walks_them(log, monkeypatch):
    """``fwd_sm90.PAGED_PERSISTENT``: a mixed step's long sequences on the persistent varlen
    kernel over the pages. ``_varlen_blocks_kernel`` lists their row blocks (a program a block
    index; the decodes left out by ``rows_lo``, lengths and bad pages read on the device),
    then the kernel walks them, a program an SM (here fewer items than SMs), over the cache
    as ``(pages * page, H_kv * D)`` rows; the decodes go to the portable kernel as before.
    The serving steps' lengths reach both launches without a new plan."""
    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", True)
    steps = [([300, 1, 0, 20], 512), ([120, 1, 40, 1], 200), ([17, 1, 1], 64)]
    for qlens, max_k in steps:
        log.clear()
        out, lse = _call(qlens, max_seqlen_k=max_k)
        assert [x.kernel for x in log] == ["blocks", "persistent", "portable"]
        blocks, run, portable = log
        total, batch, max_q = sum(qlens), len(qlens), max(qlens)
        n_blocks = min(-(-total // 128) + batch, batch * -(-max_q // 128))
        keys = min(8, -(-max_k // 64)) * 64
        assert blocks.grid == (-(-max_q // 128), 1, 1)
        lst = blocks.named["blocks"]
        assert lst.dtype == torch.int32 and lst.shape == (1 + 5 * n_blocks, )
        assert blocks.named["block_table"] is run.named["block_table"]
        assert blocks.named["cu_seqlens_k"] is None
        assert (blocks.named["batch"], blocks.named["total_q"], blocks.named["seqlen_q"],
                blocks.named["seqlen_k"], blocks.named["capacity"]) == (
                    batch, total, max_q, keys, n_blocks)
        assert (blocks.named["num_pages"], blocks.named["rows_lo"], blocks.named["GROUP"],
                blocks.named["PAGE_SIZE"]) == (40, fwd.SMALL_ROWS, 4, 64)
        # Few sequences: 16 a step, 256 of their block-table entries each.
        assert (blocks.named["BLOCK_B"], blocks.named["BLOCK_P"]) == (16, 256)
        assert run.grid == (min(132, n_blocks * 8), 1, 1)
        assert run.named["blocks"] is lst
        assert run.named["o"] is out and run.named["lse"] is lse
        assert run.named["stride_lh"] == lse.stride(0) == total
        assert run.named["total_q"] == total and run.named["total_k"] == 40 * 64
        assert run.named["stride_ks"] == 2 * 128 and run.named["PAGE_SIZE"] == 64
        # One L2 section of 8 heads: the K/V of batch x keys rows of a kv head fit.
        assert run.named["heads"] == 8
        assert (portable.named["rows_lo"], portable.named["rows_hi"]) == (0, fwd.SMALL_ROWS)
    assert len(fwd_sm90._PLANS) == 1
    # A kv head's K/V over the L2 budget (4 x 512 keys x 512 bytes = 1 MB here): sections
    # of one kv head's group.
    monkeypatch.setattr(fwd_sm90, "VARLEN_L2_BYTES", 1 << 20)
    log.clear()
    _call([300, 1, 0, 20], max_seqlen_k=512)
    assert log[1].named["heads"] == 4


def test_persistent_paged_takes_only_heads_adjacent_layouts(log, monkeypatch):
    """A cache whose heads are not adjacent in a page row (a view of a wider cache) runs the
    paged grid kernel, which reads each head through its own pointer."""
    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", True)
    q = torch.zeros(300, 8, 128, dtype=torch.bfloat16)
    wide = torch.zeros(40, 64, 2, 256, dtype=torch.bfloat16)[..., :128]
    cu = torch.tensor([0, 300], dtype=torch.int32)
    dispatch.attn_fwd_paged(q, wide, wide, torch.zeros(1, 8, dtype=torch.int32),
                            cu_seqlens_q=cu, max_seqlen_q=300,
                            seqused_k=torch.tensor([300], dtype=torch.int32), max_seqlen_k=512,
                            left=None, right=0, softcap=0.0, scale=0.1, sink=None)
    assert [x.kernel for x in log] == ["gluon", "portable"]


def test_persistent_paged_compile_failure_runs_the_portable_kernel(log, monkeypatch):
    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", True)
    FAILING.add("persistent")
    with pytest.warns(RuntimeWarning, match="Hopper paged forward"):
        _call([300, 1])
    assert [x.kernel for x in log] == ["blocks", "persistent", "portable", "portable"]
    assert [key[0] for key in FAILURES] == ["fwd_sm90 paged"]


def test_persistent_paged_key_splits_then_merge(log, monkeypatch):
    """``fwd_sm90.PAGED_SPLIT_KV`` (on): a call whose row blocks x
    heads fill at most half the SMs splits each block's key tiles (``_split_count``), the
    kernel writes float32 partial states of every split to workspaces (no sink: the merge
    adds it), ``merge_states``' kernel merges them into out / lse (lse through its
    transpose), then the portable kernel writes the decodes' rows over the merge's."""
    from flashlse.kernels import combine

    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", True)
    monkeypatch.setattr(fwd_sm90, "PAGED_SPLIT_KV", True)
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(combine, "_merge_states_fwd_kernel",
                        _Kernel("merge", log, combine._merge_states_fwd_kernel))
    # 300 + 1 rows: the host's bound of 5 row blocks x 8 heads = 40 items; 512 keys = 4 tiles.
    out, lse = _call([300, 1], max_seqlen_k=512)
    assert [x.kernel for x in log] == ["blocks", "persistent", "merge", "portable"]
    _, run, merge, portable = log
    n = 2  # the most of (2, 4, 8, 16) with 40 x n <= 132 SMs and a tile a split
    assert run.named["SPLITS"] == n and run.named["HAS_SINK"] is False
    assert run.grid == (40 * n, 1, 1)
    part_o, part_lse = run.named["o"], run.named["lse"]
    assert part_o.shape == (n, 301, 8, 128) and part_o.dtype == torch.float32
    assert part_lse.shape == (n, 8, 301) and run.named["stride_lh"] == 301
    assert run.named["total_q"] == 301 and run.named["stride_os"] == 8 * 128
    assert merge.named["N"] == n and merge.named["D"] == 128 and merge.named["R"] == 301 * 8
    assert merge.named["out"].data_ptr() == out.data_ptr()
    assert merge.named["lse"].data_ptr() == lse.data_ptr()
    assert (portable.named["rows_lo"], portable.named["rows_hi"]) == (0, fwd.SMALL_ROWS)
    # Items that fill more than half the SMs: no split, the kernel writes out itself.
    assert [fwd_sm90._split_count(items, 64, 132) for items in (67, 66, 34, 33, 8)] == [
        1, 2, 2, 4, 16]
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 4)
    assert [fwd_sm90._split_count(8, tiles, 132) for tiles in (7, 8, 64)] == [1, 2, 16]


def test_mixed_step_decodes_on_the_packed_decode_kernel(log, monkeypatch):
    """``SMALL_DECODE``: a mixed step's sequences of at most 16 packed rows run one launch of
    the decode kernel's packed form (its rows from cu_seqlens_q, the fused merge, lse's head
    stride and the packed rows passed each call) in place of the portable kernel's 16-row
    tiles; the long ones stay on the Hopper kernel. Without the Hopper kernel the portable
    kernel takes only the long ones (its large tiles)."""
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    _call([300, 1, 1, 3])
    assert [x.kernel for x in log] == ["gluon", "decode"]
    dec = log[1].named
    assert dec["PACKED_Q"] and dec["FUSED_MERGE"] and dec["SQ"] == 4  # 16 // 4 heads a kv head
    assert dec["total_q"] == 305 and dec["stride_zh"] == 305 and dec["stride_qb"] == 0
    assert log[1].grid[1] <= decode.FUSED_MERGE_MAX_SPLITS
    log.clear()
    with kernel_options(sm90_fwd_paged=False):
        _call([300, 1, 1, 3])
    assert [x.kernel for x in log] == ["portable", "decode"]
    assert log[0].named["rows_lo"] == fwd.SMALL_ROWS
    log.clear()
    # A group of more than 16 heads: no sequence of at most 16 packed rows for the decode
    # kernel's bound (the portable launch of small tiles stays, as before the route).
    _call([300, 1], hq=32, hkv=1)
    assert [x.kernel for x in log] == ["gluon", "portable"]


def test_uniform_short_rows_on_the_decode_kernel(log, monkeypatch):
    """``PAGED_DECODE``: B sequences of max_seqlen_q <= 16 rows each (q holds B x
    max_seqlen_q rows) run the split-KV decode kernel alone; rows that are not uniform do
    not."""
    monkeypatch.setattr(dispatch, "PAGED_DECODE", True)
    _call([2, 2, 2])
    assert [x.kernel for x in log] == ["decode"] and not log[0].named["PACKED_Q"]
    log.clear()
    _call([2, 1, 2])
    assert "decode" not in [x.kernel for x in log]
