"""``attention_with_kvcache`` on the kernels: queries longer than the decode kernel takes (the
varlen forward kernel, contiguous and paged caches), k_new appended by the append kernel, and
out-of-range values with the value checks off (memory-safe, documented results).

Inputs, poisoning and the comparison are those of tests/test_attention_with_kvcache.py (its
helpers are imported): cache slots past each length are NaN, so a read past a length fails.
Under ``TRITON_INTERPRET=1`` (CI) the tensors are on the CPU; on a GPU they move to CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_varlen import PAGED, run_paged
from test_attention_with_kvcache import make, run_both, to_paged

import flashlse as fl
from flashlse import kernel_options
from flashlse import reference as R
from flashlse.kernels import dispatch

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


def _to(t, device):
    out = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    if t["v_cache"].data_ptr() == t["k_cache"].data_ptr():
        out["v_cache"] = out["k_cache"][..., : t["v_cache"].shape[-1]]
    return out


# (B, Sq, Hq, Hkv, D, Dv, Smax, cache_seqlens, Snew, keywords): Sq > 16, the prefill kernel.
CASES = [
    pytest.param(2, 20, 4, 2, 32, 32, 60, [37, 60], 0, dict(causal=True), id="chunk_causal"),
    pytest.param(3, 17, 4, 1, 32, 32, 48, [0, 9, 30], 0, dict(causal=True),
                 id="empty_cache_and_sq_gt_sk"),
    pytest.param(2, 18, 4, 2, 32, 16, 64, [20, 3], 5, dict(causal=True, sink=True),
                 id="k_new_sink_dv16"),
    pytest.param(2, 24, 2, 2, 32, 32, 50, [40, 26], 0, dict(window=(7, 0)), id="window"),
    pytest.param(1, 19, 2, 1, 64, 48, 40, [33], 2, dict(mla=True), id="mla_view_k_new"),
    pytest.param(2, 20, 2, 2, 32, 32, 40, [30, 21], 0, dict(softcap=3.0), id="softcap"),
    # 128 rows or more: a paged cache is gathered for the dense kernel (ops/kvcache.py).
    pytest.param(1, 130, 2, 1, 32, 32, 160, [25], 3, dict(causal=True, sink=True),
                 id="long_chunk_gathered"),
    # D = 64 on an H100 / H200: fewer row blocks x heads than SMs, on the persistent varlen
    # kernel (D = 64 has no Hopper grid kernel), a cache of 3 keys among them.
    pytest.param(2, 130, 4, 1, 64, 64, 300, [250, 3], 0, dict(causal=True, sink=True),
                 id="d64_chunk_few_items"),
]


def _split(kw):
    kw = dict(kw)
    return {n: kw.pop(n) for n in ("sink", "mla", "append") if n in kw}, kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page", [None, 1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("b,sq,hq,hkv,d,dv,smax,lens,snew,kw", CASES)
def test_kvcache_long_queries_on_kernels(device, b, sq, hq, hkv, d, dv, smax, lens, snew, kw,
                                         page, dtype):
    make_kw, call_kw = _split(kw)
    t = make(b, sq, hq, hkv, d, dv, smax, lens, snew, dtype, **make_kw)
    if page is not None:
        t = to_paged(t, page)
    run_both(_to(t, device), **call_kw)


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "prefill"])
@pytest.mark.parametrize("page", [None, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("b,sq,hq,hkv,d,dv,smax,lens,snew,kw",
                         [c for c in CASES if c.values[1] <= 32])
def test_kvcache_up_to_32_rows_on_the_decode_kernel(device, monkeypatch, b, sq, hq, hkv, d, dv,
                                                    smax, lens, snew, kw, page, wide):
    # ops.kvcache.DECODE_WIDE: the 17-32-row cases above on the decode kernel (the query
    # heads of a kv head packed into its row tiles) on a contiguous cache, against the
    # reference; off, and on a paged cache (the Hopper paged kernel is faster there), on the
    # prefill path. Which kernel ran: the decode plans made.
    from flashlse.kernels import decode
    from flashlse.ops import kvcache

    monkeypatch.setattr(kvcache, "DECODE_WIDE", wide)
    make_kw, call_kw = _split(kw)
    t = make(b, sq, hq, hkv, d, dv, smax, lens, snew, DTYPES[0], **make_kw)
    if page is not None:
        t = to_paged(t, page)
    run_both(_to(t, device), **call_kw)
    assert bool(decode._PLANS) == (wide and page is None)


def test_kvcache_wide_rows_nan_key_reaches_only_its_rows(device):
    # 20 query rows on the decode kernel (contiguous, DECODE_WIDE): a NaN key reaches exactly
    # the rows that see it (its sequence, its kv head's query heads, the causal rows whose
    # range holds it), never an empty-looking row; an empty cache gives out 0, lse -inf.
    from flashlse.kernels import decode

    t = _to(make(3, 20, 4, 2, 32, 32, 40, [30, 12, 0], 0, DTYPES[0]), device)
    t["k_cache"][0, 15, 1, 3] = float("nan")  # sequence 0, kv head 1 (query heads 2-3)
    with fl.value_checks(False):
        out, lse = fl.attention_with_kvcache(**t, causal=True, return_lse=True)
    assert decode._PLANS  # (the decode kernel ran)
    # Sequence 0's row i sees keys up to 10 + i: rows 5.. see key 15.
    nan_rows = torch.zeros(3, 20, 4, dtype=torch.bool)
    nan_rows[0, 5:, 2:] = True
    assert torch.equal(out.isnan().any(-1).cpu(), nan_rows)
    assert torch.equal(lse.isnan().cpu(), nan_rows.permute(0, 2, 1))
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    ok = ~nan_rows.permute(0, 2, 1)
    ref_t = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
             for n, x in t.items() if n not in ("k_new", "v_new")}
    ref_out, ref_lse = R.attention_with_kvcache(**ref_t, causal=True, return_lse=True)
    assert torch.equal(ref_lse.isnan().cpu(), nan_rows.permute(0, 2, 1))
    torch.testing.assert_close(lse.double()[ok.to(lse.device)], ref_lse[ok.to(lse.device)],
                               atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("table_rows, gathered", [(160, True), (2100, False)],
                         ids=["tight_table_gathered", "wide_table_in_place"])
def test_kvcache_long_chunk_wide_table_reads_pages_in_place(device, monkeypatch, table_rows,
                                                            gathered):
    """A chunk of 130 rows on short sequences: a block table of at most 16 rows a query row
    is gathered for the dense kernel; a wider one (vLLM sizes tables for the longest context)
    reads its pages in place, so the copy and its allocation do not grow with the table."""
    from flashlse.ops import kvcache

    calls = []
    real = kvcache.gather_pages
    monkeypatch.setattr(kvcache, "gather_pages", lambda *a: calls.append(1) or real(*a))
    t = to_paged(make(2, 130, 2, 1, 32, 32, table_rows, [25, 40], 3, torch.float16,
                      sink=True), 16, extra_pages=0)
    run_both(_to(t, device), causal=True)
    assert bool(calls) == gathered


def _full_cache(device, sq, page):
    """Three sequences of ``sq`` query rows on a full 24-row cache of random keys (every slot
    set, so a read past a length shows), 2 new tokens each; pages of ``page`` rows or none."""
    t = make(3, sq, 4, 2, 32, 32, 24, [24, 24, 0], 2, torch.float16)
    t["k_cache"][:] = torch.randn_like(t["k_cache"])
    t["v_cache"][:] = torch.randn_like(t["v_cache"])
    if page is not None:
        t = to_paged(t, page, extra_pages=0)
    return _to(t, device)


def _close_to_cache_ref(out, lse, t):
    """``out`` / ``lse`` against the float64 reference of the causal call ``t`` (no append)."""
    ref_t = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
             for n, x in t.items() if n not in ("k_new", "v_new")}
    ref_out, ref_lse = R.attention_with_kvcache(**ref_t, causal=True, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=2e-3)


# 20 query rows on the decode kernel (ops.kvcache.DECODE_WIDE) beside the prefill path's 20.
WIDE = "20 wide"


def _sq_id(sq):
    return f"sq{sq}".replace(" ", "_")


def _wide(monkeypatch, sq):
    from flashlse.ops import kvcache

    monkeypatch.setattr(kvcache, "DECODE_WIDE", sq == WIDE)
    return 20 if sq == WIDE else sq


@pytest.mark.parametrize("page", [None, 3], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("sq", [1, 20, WIDE], ids=_sq_id)
def test_kvcache_lengths_out_of_range_are_clamped(device, monkeypatch, sq, page):
    """With the value checks off a length past the cache reads the whole cache, a negative
    one no key, and k_new past the end is dropped: nothing outside the caches is touched."""
    sq = _wide(monkeypatch, sq)
    t = _full_cache(device, sq, page)
    bad = dict(t, cache_seqlens=torch.tensor([30, 23, -5], dtype=torch.int32, device=device))
    k_before = t["k_cache"].clone()
    with fl.value_checks(False):
        out, lse = fl.attention_with_kvcache(**bad, causal=True, return_lse=True)
    # What the clamps mean: lengths [24, 24, 0] of the (already full) cache, after writing
    # the one new token that fits (sequence 1, slot 23) and dropping the rest.
    cap = dict(t, cache_seqlens=torch.tensor([24, 24, 0], dtype=torch.int32, device=device))
    cap["k_cache"], cap["v_cache"] = bad["k_cache"], bad["v_cache"]
    _close_to_cache_ref(out, lse, cap)
    changed = (bad["k_cache"] != k_before).flatten(1).any(1)
    if page is None:
        # Only sequence 1's slot 23 was written.
        assert changed.tolist() == [False, True, False]
        assert torch.equal(bad["k_cache"][1, 23], t["k_new"][1, 0])


@pytest.mark.parametrize("page", [None, 3], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("sq", [1, 20, WIDE], ids=_sq_id)
def test_kvcache_lengths_near_int32_max(device, monkeypatch, sq, page):
    """With the value checks off, ``cache_seqlens + Snew`` past 2^31 - 1 wraps (int32) and
    counts as below 0: no key (README's table); one just under it is clamped to the cache.
    Nothing is written: every new token's position wraps or lies past the end."""
    sq = _wide(monkeypatch, sq)
    t = _full_cache(device, sq, page)
    lens = [2**31 - 1, 2**31 - 3, -2**31]  # + 2 new tokens: wraps, 2^31 - 1, -2^31 + 2
    bad = dict(t, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device))
    k_before = t["k_cache"].clone()
    with fl.value_checks(False):
        out, lse = fl.attention_with_kvcache(**bad, causal=True, return_lse=True)
    assert torch.equal(bad["k_cache"], k_before)
    assert not torch.isnan(out).any()
    empty = torch.tensor([True, False, True], device=device)
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()
    cap = dict(t, cache_seqlens=torch.tensor([0, 24, 0], dtype=torch.int32, device=device))
    _close_to_cache_ref(out, lse, cap)


@pytest.mark.parametrize("sq", [1, 20, WIDE], ids=_sq_id)
def test_kvcache_pages_out_of_range_are_not_read(device, monkeypatch, sq):
    """A block-table entry outside [0, num_pages) holds no key (decode) or ends the sequence
    (longer queries); a valid call on the same data before it is unaffected."""
    sq = _wide(monkeypatch, sq)
    t = to_paged(make(2, sq, 2, 1, 32, 32, 12, [12, 12], 0, torch.float16), 4, extra_pages=0)
    t = _to(t, device)
    good = fl.attention_with_kvcache(**t)
    bt = t["block_table"].clone()
    bt[1, 2] = 10_000  # sequence 1's last page (keys 8..11)
    with fl.value_checks(False):
        out = fl.attention_with_kvcache(**dict(t, block_table=bt))
    torch.testing.assert_close(out[0], good[0])
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block_table"), fl.value_checks():
        fl.attention_with_kvcache(**dict(t, block_table=bt))


def test_kvcache_grad_is_refused(device):
    t = _to(make(1, 1, 2, 1, 16, 16, 8, [5], 0, torch.float16), device)
    t["q"].requires_grad_()
    with pytest.raises(ValueError, match="not differentiable"):
        fl.attention_with_kvcache(**t)


def test_varlen_bad_offsets_are_clamped(device):
    """cu_seqlens past the tokens or decreasing, with the value checks off: the kernels read
    and write inside the packed tensors only, and a valid sequence whose rows no bad one
    overlaps is exact (decreasing query offsets may make two sequences share rows)."""
    dtype = DTYPES[0]
    q = torch.randn(24, 2, 32, device=device).to(dtype)
    k = torch.randn(20, 2, 32, device=device).to(dtype)
    v = torch.randn(20, 2, 32, device=device).to(dtype)
    cu_q = torch.tensor([0, 10, 12, 1000], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 12, 5, 1000], dtype=torch.int32, device=device)
    with fl.value_checks(False):
        out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, 16, 16, causal=True,
                                       return_lse=True)
    ref_out, ref_lse = R.attention(q[None, :10].double(), k[None, :12].double(),
                                   v[None, :12].double(), causal=True, return_lse=True)
    torch.testing.assert_close(out[:10].double(), ref_out[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[:, :10].double(), ref_lse[0], atol=2e-3, rtol=2e-3)
    assert not torch.isnan(out[12:]).any()
    with pytest.raises(ValueError, match="cu_seqlens"), fl.value_checks():
        fl.attention_varlen(q, k, v, cu_q, cu_k, 16, 16, causal=True)


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_varlen_max_seqlen_above_the_rows(device, paged):
    """max_seqlen_q / max_seqlen_k are upper bounds (flash-attn's callers pass a model's
    longest context): a value above the packed rows or the table's keys, up to 2^40, gives
    the exact maxima's answer (forward, and backward when packed); the grid is sized by
    the rows (2^40 / 128 programs would pass the launch limits). A negative one is a
    ValueError before any kernel runs."""
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(20, 4, 32, generator=g).to(device, dtype)
    cu_q = torch.tensor([0, 8, 20], dtype=torch.int32, device=device)
    if paged:
        k = torch.randn(6, 4, 2, 32, generator=g).to(device, dtype)  # 6 pages of 4 rows
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
        used = torch.tensor([9, 12], dtype=torch.int32, device=device)
        kw = dict(seqused_k=used, block_table=table)
        cu_k, exact = None, (12, 12)
    else:
        q.requires_grad_()
        k = torch.randn(21, 2, 32, generator=g).to(device, dtype).requires_grad_()
        cu_k, exact, kw = torch.tensor([0, 9, 21], dtype=torch.int32, device=device), (12, 12), {}
    v = k.detach().clone().requires_grad_(k.requires_grad)

    def call(mq, mk):
        out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True,
                                       return_lse=True, **kw)
        if paged:
            return out, lse
        return out, lse, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    want = call(*exact)
    # (Under the interpreter 2^16: a grid sized by 2^40 would run for hours there if the
    # clamp regressed; test_dispatch's seq_args test holds the bound itself.)
    big = 2**40 if q.is_cuda else 2**16
    for mq, mk in ((big, 12), (12, big), (big, big + 7)):
        with fl.value_checks(False):
            got = call(mq, mk)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (mq, mk)
    for bad in ((-1, 12), (12, -3)):  # (after kept calls: a kept path checks them too)
        with pytest.raises(ValueError, match="must be >= 0"), fl.value_checks(False):
            call(*bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page", [1, 3, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("qlens,klens,kw", PAGED)
def test_attention_varlen_paged_on_kernels(device, qlens, klens, kw, page, dtype):
    """vLLM's mixed step (prefill, chunked prefill, decodes, empty query and cache) through
    attention_varlen with a block table, on the varlen forward kernel."""
    run_paged(device, dtype, qlens, klens, page, **kw)


@pytest.mark.parametrize("bad", [-5, "past_end"], ids=str)
def test_attention_varlen_paged_page_out_of_range(device, bad):
    """With the value checks off a block-table entry outside [0, num_pages) in use ends a
    long sequence (more than 16 packed rows: the paged kernels) before that page, is no key
    for a short one (the decode kernel's packed form, dispatch.SMALL_DECODE, as in every
    decode), nothing outside the cache is read, and the other sequences are exact (PackGQA
    with a decode in the batch)."""
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    k_cache, v_cache = mk(8, 3, 1, 16), mk(8, 3, 1, 16)
    table = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32, device=device)
    bad_table = table.clone()
    bad_table[0, 2] = -5 if bad == -5 else 8 + 3
    bad_table[1, 1] = -5 if bad == -5 else 8 + 3
    q = mk(6, 4, 16)
    cu_q = torch.tensor([0, 5, 6], dtype=torch.int32, device=device)
    call = dict(cu_seqlens_k=None, max_seqlen_q=5, max_seqlen_k=12, causal=True,
                return_lse=True)
    with fl.value_checks(False):
        out, lse = fl.attention_varlen(q, k_cache, v_cache, cu_q, block_table=bad_table,
                                       seqused_k=torch.tensor([10, 11], dtype=torch.int32,
                                                              device=device), **call)
    # Sequence 0 (5 rows x 4 heads): its keys end at its third page: 6 keys, bottom-right
    # causal against 6.
    ref_out, ref_lse = R.attention_varlen(
        q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), cu_q.cpu(),
        block_table=table.cpu(), seqused_k=torch.tensor([6, 11], dtype=torch.int32), **call)
    torch.testing.assert_close(out[:5].cpu().double(), ref_out[:5], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[:, :5].cpu().double(), ref_lse[:, :5], atol=2e-3, rtol=2e-3)
    # Sequence 1 (a decode): 11 keys but those of its second page (keys 3-5), no keys.
    keep = torch.tensor([0, 1, 2, 6, 7, 8, 9, 10])
    rows = torch.stack([table[1, j // 3].cpu() * 3 + j % 3 for j in keep.tolist()])
    k1 = k_cache.cpu().double().flatten(0, 1)[rows][None]
    v1 = v_cache.cpu().double().flatten(0, 1)[rows][None]
    want_out, want_lse = R.attention(q[5:].cpu().double()[None], k1, v1, return_lse=True)
    torch.testing.assert_close(out[5:].cpu().double(), want_out[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[:, 5:].cpu().double(), want_lse[0], atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="block_table"), fl.value_checks():
        fl.attention_varlen(q, k_cache, v_cache, cu_q, block_table=bad_table,
                            seqused_k=torch.tensor([10, 11], dtype=torch.int32, device=device),
                            **call)


@pytest.mark.parametrize("page", [3, 4, 16], ids=lambda p: f"page{p}")
def test_attention_varlen_paged_bad_page_at_tile_boundary(device, page):
    """The paged kernel loads a tile's page ids one tile ahead: with a block-table entry
    outside the cache right at a key-tile boundary (the tile size is 16 in the interpreter,
    so page 16 takes the one-id-a-tile path, page 4 the fixed rows-in-page path, page 3 the
    general one), the sequence ends there, exact, and no K/V row outside the keys in use is
    read: every other page of the cache is NaN."""
    dtype = DTYPES[0]
    g = torch.Generator().manual_seed(5)
    n_pages, h, d = 48, 1, 16
    k_cache = torch.full((n_pages, page, h, d), float("nan"), dtype=dtype)
    v_cache = torch.full((n_pages, page, h, d), float("nan"), dtype=dtype)
    lens = [64, 50]
    cut = 32 if page != 3 else 33  # the first key of the bad page, a tile boundary (page 3: 33)
    cols = max(-(-n // page) for n in lens) + 1
    table = torch.zeros((2, cols), dtype=torch.int32)
    pages = torch.randperm(n_pages, generator=g).tolist()
    used = {0: cut, 1: lens[1]}
    for b in range(2):
        for c in range(cols):
            table[b, c] = pages.pop()
            if c * page < used[b]:
                n = min(page, used[b] - c * page)
                k_cache[table[b, c], :n] = torch.randn(n, h, d, generator=g).to(dtype)
                v_cache[table[b, c], :n] = torch.randn(n, h, d, generator=g).to(dtype)
    bad_table = table.clone()
    bad_table[0, cut // page] = n_pages + 7
    q = torch.randn(20 + 1, 4 * h, d, generator=g).to(dtype)
    cu_q = torch.tensor([0, 20, 21], dtype=torch.int32)
    call = dict(cu_seqlens_k=None, max_seqlen_q=20, max_seqlen_k=max(lens), causal=True,
                return_lse=True)
    with fl.value_checks(False):
        out, lse = fl.attention_varlen(q.to(device), k_cache.to(device), v_cache.to(device),
                                       cu_q.to(device), block_table=bad_table.to(device),
                                       seqused_k=torch.tensor(lens, dtype=torch.int32,
                                                              device=device), **call)
    ref_out, ref_lse = R.attention_varlen(
        q.double(), k_cache.double(), v_cache.double(), cu_q, block_table=table,
        seqused_k=torch.tensor([cut, lens[1]], dtype=torch.int32), **call)
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kw", [dict(), dict(sink=True, causal=True), dict(window=(3, 0)),
                                dict(mla=True, softcap=2.0), dict(append=2, causal=True),
                                dict(append=1, mla=True, sink=True)],
                         ids=["plain", "sink_causal", "window", "mla_softcap", "append",
                              "append_mla_sink"])
@pytest.mark.parametrize("page", [None, 4], ids=lambda p: f"page{p}")
def test_kvcache_repeated_calls_launch_the_kept_plan(device, kw, page):
    """A decode call that passed every check keeps its plan by its key (ops/kvcache._KEPT),
    with its append's when it appends ``k_new``; later calls of that key launch them without
    the checks (values off, as on a GPU by default): fresh values each call against the
    float64 reference (NaN past each length; the caches after the append compared too),
    then a call needing grad, an int where a bool goes (``causal=1``), and value checks
    still take the full path and its errors."""
    from flashlse.ops import kvcache as kv_mod

    make_kw, call_kw = _split(kw)
    snew = make_kw.pop("append", 0)
    kv_mod._KEPT.clear()
    dtype = DTYPES[0]
    for lens in ([7, 12, 0], [12, 1, 5], [3, 3, 12]):
        lens = [min(n, 12 - snew) for n in lens]
        t = make(3, 1, 4, 2, 32, 16 if make_kw.get("mla") else 32, 12, lens, snew, dtype,
                 **make_kw)
        if page is not None:
            t = to_paged(t, page)
        with fl.value_checks(False):
            run_both(_to(t, device), **call_kw)
    assert len(kv_mod._KEPT) == 1
    hits = []
    real = kv_mod._run_kept
    kv_mod._run_kept = lambda *a: hits.append(real(*a)) or hits[-1]
    try:
        t = _to(t, device)
        with fl.value_checks(False), torch.no_grad():
            fl.attention_with_kvcache(**t, **call_kw)
        assert len(hits) == 1 and hits[0] is not None  # launched the kept plan
        # A NaN query reaches exactly its own sequence's rows on the kept path too.
        t_nan = dict(t, q=t["q"].clone())
        t_nan["q"][1] = float("nan")
        with fl.value_checks(False), torch.no_grad():
            out_n, lse_n = fl.attention_with_kvcache(**t_nan, **call_kw, return_lse=True)
        assert hits[-1] is not None
        assert torch.isnan(out_n[1]).all() and torch.isnan(lse_n[1]).all()
        assert not torch.isnan(out_n[[0, 2]]).any() and not torch.isnan(lse_n[[0, 2]]).any()
        q = t["q"].clone().requires_grad_()
        with pytest.raises(ValueError, match="not differentiable"), fl.value_checks(False):
            fl.attention_with_kvcache(**dict(t, q=q), **call_kw)
        with pytest.raises(TypeError, match="causal"), fl.value_checks(False):
            fl.attention_with_kvcache(**t, **dict(call_kw, causal=int(call_kw.get("causal",
                                                                                  False))))
        bad = dict(t, cache_seqlens=t["cache_seqlens"] + 100)
        with pytest.raises(ValueError, match="cache_seqlens"), fl.value_checks():
            fl.attention_with_kvcache(**bad, **call_kw)
    finally:
        kv_mod._run_kept = real


@pytest.mark.parametrize("snew", [0, 3], ids=lambda n: f"append{n}")
@pytest.mark.parametrize("page", [None, 4], ids=lambda p: f"page{p}")
def test_kvcache_repeated_chunks_launch_the_kept_launch(device, monkeypatch, page, snew):
    """A chunk (more query rows than the decode kernel takes) that passed every check keeps
    its launch by its key (ops/kvcache._CHUNK_KEPT): on a contiguous cache the forward's
    launch, on a paged one (read in place) the paged dispatcher with the scalars normalised
    once. Later chunks of that key run it without the checks (value checks off, as on a GPU
    by default): fresh lengths, values, block tables and sinks each call against the float64
    reference (a kept sink would fail it), causal rows that see no key, appends of ``k_new``
    (the caches after them compared too); a NaN query reaches only its own sequence; other
    forward options, and value checks, take the full path (and its errors)."""
    from flashlse.ops import kvcache as kv_mod

    # (20-row chunks: on a contiguous cache DECODE_WIDE would send them to the decode kernel)
    monkeypatch.setattr(kv_mod, "DECODE_WIDE", False)
    kv_mod._CHUNK_KEPT.clear()
    hits = []
    real = kv_mod._run_kept_chunk
    monkeypatch.setattr(kv_mod, "_run_kept_chunk", lambda *a: hits.append(real(*a)) or hits[-1])
    call_kw = dict(causal=True)
    for lens in ([30, 12, 0], [12, 40, 25], [40, 3, 40]):
        lens = [min(n, 40 - snew) for n in lens]
        t = make(3, 20, 4, 2, 32, 32, 40, lens, snew, DTYPES[0], sink=True)
        if page is not None:
            t = to_paged(t, page)
        with fl.value_checks(False):
            run_both(_to(t, device), **call_kw)
    assert len(kv_mod._CHUNK_KEPT) == 1
    assert hits[0] is None and all(h is not None for h in hits[1:]) and len(hits) == 3
    t = _to(t, device)
    t_nan = dict(t, q=t["q"].clone())
    t_nan["q"][0] = float("nan")  # (sequence 0 has 40 keys: every row sees one)
    with fl.value_checks(False), torch.no_grad():
        out_n, lse_n = fl.attention_with_kvcache(**t_nan, **call_kw, return_lse=True)
    assert hits[-1] is not None and lse_n.is_contiguous()
    assert torch.isnan(out_n[0]).all() and torch.isnan(lse_n[0]).all()
    assert not torch.isnan(out_n[1:]).any() and not torch.isnan(lse_n[1:]).any()
    # A -inf sink is no sink on the kept path too: sequence 1's causal rows past its keys
    # see nothing, out 0 and lse -inf (run_both: against the reference, NaN-free).
    t_inf = dict(t, sink=torch.full_like(t["sink"], float("-inf")))
    n_hits = len(hits)
    with fl.value_checks(False):
        out_i, lse_i, _ = run_both(t_inf, **call_kw)
    assert hits[n_hits:] and hits[-1] is not None
    empty = torch.isneginf(lse_i)
    assert empty[1].any() and not empty[0].any()
    assert (out_i.transpose(1, 2)[empty] == 0).all() and not torch.isnan(out_i).any()
    off = dict(sm90_fwd=False) if page is None else dict(sm90_fwd_paged=False)
    with fl.value_checks(False), kernel_options(**off):
        run_both(t, **call_kw)
    assert hits[-1] is None  # other forward options: the full path
    bad = dict(t, cache_seqlens=t["cache_seqlens"] + 100)
    n_hits = len(hits)
    with pytest.raises(ValueError, match="cache_seqlens"), fl.value_checks():
        fl.attention_with_kvcache(**bad, **call_kw)
    assert hits[n_hits:] == [None]


def test_kvcache_kept_plans_tell_their_scalars_apart(device):
    """Each scalar that shapes the launch is in the kept plan's key: calls of one tensor
    metadata alternating scale, causal, window, softcap and num_splits (each kept once, then
    reused) all match the float64 reference."""
    from flashlse.ops import kvcache as kv_mod

    kv_mod._KEPT.clear()
    variants = [dict(), dict(scale=0.3), dict(causal=True), dict(window=(2, 1)),
                dict(softcap=1.5), dict(num_splits=3)]
    for _ in range(2):
        for kw in variants:
            t = make(2, 2, 4, 2, 32, 32, 12, [12, 5], 0, DTYPES[0])
            with fl.value_checks(False):
                run_both(_to(t, device), **kw)
    assert len(kv_mod._KEPT) == len(variants)


def test_attention_varlen_paged_steps_share_one_plan(device, monkeypatch):
    """A serving engine's steps change the batch, the packed rows and both max lengths
    every call: the portable paged kernel's plan is a function of the rest, kept in the
    kept entry's own cache (not fwd._PLANS) from the first step on, its SizedLaunch passes
    each call's lengths and grid, and every step matches the float64
    reference over one cache, its pages drawn anew each step. The checks run on the first
    step only (ops/attention._PAGED_KEPT); a later call with a bad tensor, a batch that
    disagrees, grad or value checks still meets them."""
    import importlib

    from flashlse.kernels import fwd
    from flashlse.ops import _validate

    attn_mod = importlib.import_module("flashlse.ops.attention")
    attn_mod._PAGED_KEPT.clear()
    # The portable kernel's plans: the decode kernel's routes off (their plans' sharing:
    # test_varlen_paged_mixed.py).
    monkeypatch.setattr(dispatch, "PAGED_DECODE", False)
    monkeypatch.setattr(dispatch, "SMALL_DECODE", False)
    checked = []
    real_check = _validate.check_tensor
    monkeypatch.setattr(_validate, "check_tensor", lambda *a: checked.append(a[0]) or
                        real_check(*a))

    g = torch.Generator().manual_seed(7)
    page, n_pages, hq, hkv, d = 3, 30, 4, 2, 16
    k_cache = torch.randn(n_pages, page, hkv, d, generator=g).half()
    v_cache = torch.randn(n_pages, page, hkv, d, generator=g).half()
    table_w = 8
    # The fourth step has empty rows: a cache of no key, and 3 queries on 2 keys (causal,
    # bottom-right: the first sees none).
    steps = [([1, 1, 1], [5, 9, 2]), ([3, 1], [7, 10]), ([1, 2, 1, 1], [11, 4, 1, 24]),
             ([3, 1, 2], [2, 0, 13]), ([1, 1, 1, 1, 1], [3, 6, 9, 12, 15])]
    n_empty = 0
    with kernel_options(sm90_fwd_paged=False):
        fwd._PLANS.clear()
        for qlens, klens in steps:
            q = torch.randn(sum(qlens), hq, d, generator=g).half()
            table = torch.randint(0, n_pages, (len(qlens), table_w), generator=g,
                                  dtype=torch.int32)
            cu_q = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
            lens = torch.tensor(klens, dtype=torch.int32)
            kw = dict(cu_seqlens_k=None, max_seqlen_q=max(qlens), max_seqlen_k=max(klens),
                      seqused_k=lens, block_table=table, causal=True, return_lse=True)
            with torch.no_grad(), fl.value_checks(False):
                out, lse = fl.attention_varlen(
                    q.to(device), k_cache.to(device), v_cache.to(device), cu_q.to(device),
                    **{n: x.to(device) if isinstance(x, torch.Tensor) else x
                       for n, x in kw.items()})
            ref_out, ref_lse = R.attention_varlen(q.double(), k_cache.double(),
                                                  v_cache.double(), cu_q, **kw)
            torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-3, rtol=2e-3)
            empty = torch.isneginf(ref_lse[0])
            n_empty += int(empty.sum())
            assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
            assert (out.cpu()[empty] == 0).all() and not torch.isnan(out).any()
            assert not torch.isnan(lse).any()
        assert n_empty == 2  # the fourth step's: its first query and its keyless sequence
        assert not [key for key in fwd._PLANS if key[0] == "paged"]
        assert len(attn_mod._PAGED_KEPT) == 1 and checked == ["q", "k", "v", "q", "k", "v"]
        plans = next(iter(attn_mod._PAGED_KEPT.values()))[-1]
        # Every step here has at most 16 packed rows: one launch of 16-row tiles, one plan.
        assert [key[0] for key in plans] == ["portable"], plans
        dev = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        args = (q.to(device), k_cache.to(device), v_cache.to(device), cu_q.to(device))
        with torch.no_grad(), fl.value_checks(False):
            with pytest.raises(ValueError, match="block_table must have B"):
                fl.attention_varlen(*args, **dict(dev, block_table=dev["block_table"][:1]))
            with pytest.raises(ValueError, match="seqused_k must be"):
                fl.attention_varlen(*args, **dict(dev, seqused_k=dev["seqused_k"][:1]))
            with pytest.raises(TypeError, match="seqused_k must be int32"):
                fl.attention_varlen(*args, **dict(dev, seqused_k=dev["seqused_k"].long()))
            with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
                fl.attention_varlen(*args, **dict(dev, max_seqlen_q=2.0))
        with pytest.raises(ValueError, match="forward only"), fl.value_checks(False):
            fl.attention_varlen(args[0].clone().requires_grad_(), *args[1:], **dev)
        with pytest.raises(ValueError, match="key lengths must lie"), fl.value_checks():
            fl.attention_varlen(*args, **dict(dev, seqused_k=dev["seqused_k"] + 1000))
        # A NaN query row (the kept path) reaches exactly its own outputs.
        q_nan = args[0].clone()
        q_nan[2] = float("nan")
        with torch.no_grad(), fl.value_checks(False):
            out, lse = fl.attention_varlen(q_nan, *args[1:], **dev)
        assert torch.isnan(out[2]).all() and torch.isnan(lse[:, 2]).all()
        assert torch.isnan(out).sum() == out[2].numel() and torch.isnan(lse).sum() == hq


@pytest.mark.parametrize("page", [None, 16], ids=lambda p: f"page{p}")
def test_kvcache_forced_splits_past_the_tiles(device, page):
    """A forced num_splits past the cache's key tiles (up to 2^40) is capped at one split a
    tile: the same launch as that count, so the same bits (2^40 splits' workspaces would not
    fit in any memory)."""
    t = make(2, 1, 4, 2, 32, 32, 64, [40, 64], 0, torch.float16)
    if page is not None:
        t = to_paged(t, page, extra_pages=0)
    t = {n: x for n, x in _to(t, device).items() if n not in ("k_new", "v_new")}
    want = fl.attention_with_kvcache(**t, return_lse=True, num_splits=64)
    for n in (65, 1000, 2**40):
        got = fl.attention_with_kvcache(**t, return_lse=True, num_splits=n)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n


def test_more_than_65535_sequences_is_a_clear_error(device, monkeypatch):
    """The cache append and the portable paged kernel put sequences on a grid dim, which CUDA
    stops at 65535: 65536 sequences a call are a ValueError before any kernel runs (as the
    backward's), not a launch failure, and the cache is untouched."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    def ran(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", ran)
    monkeypatch.setattr(InterpretedFunction, "run", ran)
    n = 65536
    q = torch.zeros(n, 1, 1, 16, device=device, dtype=torch.float16)
    kc = torch.zeros(n, 2, 1, 16, device=device, dtype=torch.float16)
    new = torch.ones(n, 1, 1, 16, device=device, dtype=torch.float16)
    lens = torch.zeros(n, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        fl.attention_with_kvcache(q, kc, kc, k_new=new, v_new=new, cache_seqlens=lens)
    assert not kc.any()
    pages = torch.zeros(1, 4, 1, 16, device=device, dtype=torch.float16)
    table = torch.zeros(n, 1, dtype=torch.int32, device=device)
    # (The first sequence of two rows: not B x max_seqlen_q rows, the paged kernels' call.)
    one = torch.arange(n + 1, dtype=torch.int32, device=device)
    cu = torch.cat([one[:1], one[1:] + 1])
    q2 = torch.zeros(n + 1, 1, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        fl.attention_varlen(q2, pages, pages, cu, None, 2, 4, seqused_k=lens + 1,
                            block_table=table)
    # One row each on the decode kernel (dispatch.PAGED_DECODE), which puts the sequences on
    # grid dim 0 (2^31 - 1): it launches.
    from flashlse.kernels import dispatch

    monkeypatch.setattr(dispatch, "PAGED_DECODE", True)
    with pytest.raises(AssertionError, match="a kernel ran"):
        fl.attention_varlen(q[:, 0], pages, pages, one, None, 1, 4, seqused_k=lens + 1,
                            block_table=table)


@pytest.mark.parametrize("sq", [1, 20], ids=lambda s: f"sq{s}")
def test_block_table_sliced_from_a_wider_table(device, sq):
    """A serving engine keeps one wide block table and passes ``table[:, :pages]``: the
    kernels step rows by the table's own row stride. The columns past the slice point at a
    page of NaN (a read of them fails the comparison). A view that is not packed along its
    last dim, a length or a sink included, is refused before any kernel (it would be read
    as packed), on the kept paths too."""
    t = to_paged(make(3, sq, 4, 2, 32, 32, 24, [24, 7, 0], 0, torch.float16), 4, extra_pages=1)
    nan_page = t["k_cache"].shape[0] - 1  # (to_paged leaves the last pages unused, NaN)
    t["k_cache"][nan_page] = float("nan")
    t["v_cache"][nan_page] = float("nan")
    table = t["block_table"]
    wide = torch.full((3, table.shape[1] + 5), nan_page, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    t = _to(dict(t, block_table=wide), device)  # (sliced there: .to() would pack a slice)
    t["block_table"] = t["block_table"][:, :table.shape[1]]
    assert not t["block_table"].is_contiguous()
    kw = dict(causal=True, return_lse=True)
    call = {n: x for n, x in t.items()}
    for _ in range(2):  # (the second call: the kept plan)
        with fl.value_checks(False):
            out, lse = fl.attention_with_kvcache(**call, **kw)
        _close_to_cache_ref(out.cpu(), lse.cpu(), {n: x.cpu() if isinstance(x, torch.Tensor)
                                                   else x for n, x in call.items()})
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    lens = call["cache_seqlens"]
    for name, bad in (("cache_seqlens", torch.stack([lens, lens], 1)[:, 0]),
                      ("block_table", call["block_table"].t().contiguous().t()),
                      ("sink", torch.zeros(4, 2, device=device)[:, 0])):
        with pytest.raises(ValueError, match=f"{name} must be contiguous in its last dim"), \
                fl.value_checks(False):
            fl.attention_with_kvcache(**dict(call, **{name: bad}), **kw)
    # The same pages through attention_varlen (vLLM's call), then its kept path's guards.
    q = call["q"].reshape(3 * sq, 4, 32)
    cu_q = torch.arange(0, 3 * sq + 1, sq, dtype=torch.int32, device=device)
    vkw = dict(cu_seqlens_k=None, max_seqlen_q=sq, max_seqlen_k=24, causal=True,
               return_lse=True)
    with torch.no_grad(), fl.value_checks(False):
        out_v, lse_v = fl.attention_varlen(q, call["k_cache"], call["v_cache"], cu_q,
                                           seqused_k=lens, block_table=call["block_table"],
                                           **vkw)
        out_d, lse_d = fl.attention_with_kvcache(**call, **kw)
    torch.testing.assert_close(out_v.reshape(out_d.shape), out_d, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse_v.reshape(4, 3, sq).transpose(0, 1), lse_d, atol=2e-3,
                               rtol=2e-3)
    for name, bad in (("cu_seqlens_q", torch.stack([cu_q, cu_q], 1)[:, 0]),
                      ("seqused_k", torch.stack([lens, lens], 1)[:, 0])):
        args = dict(seqused_k=lens, block_table=call["block_table"], **vkw)
        cu = bad if name == "cu_seqlens_q" else cu_q
        args.update({name: bad} if name == "seqused_k" else {})
        with pytest.raises(ValueError, match=f"{name} must be contiguous in its last dim"), \
                torch.no_grad(), fl.value_checks(False):
            fl.attention_varlen(q, call["k_cache"], call["v_cache"], cu, **args)
