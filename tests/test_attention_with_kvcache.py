"""flashlse.attention_with_kvcache against flashlse.reference.attention_with_kvcache.

Contiguous and paged caches (page sizes 1, 3, 16, shuffled block tables), cache_seqlens
including 0, k_new/v_new appended in place, split-KV with the sink counted once, MLA's
v as a view of k. Cache slots past each sequence's length are poisoned with NaN.
"""

import pytest
import torch
from _flashlse_testing import LOWP, assert_close_to_ref, rand, reference_in

import flashlse as fl
from flashlse import reference as R

NAN = float("nan")


def make(b, sq, hq, hkv, d, dv, smax, seqlens, snew, dtype=torch.float32, *, sink=False,
         mla=False):
    """q, a contiguous (B, Smax, Hkv, D) cache poisoned past ``seqlens``, k_new/v_new."""
    q = rand(b, sq, hq, d, dtype=dtype)
    if mla:
        k_cache = rand(b, smax, hkv, d, dtype=dtype)
        v_cache = k_cache[..., :dv]
    else:
        k_cache, v_cache = rand(b, smax, hkv, d, dtype=dtype), rand(b, smax, hkv, dv, dtype=dtype)
    for i, n in enumerate(seqlens):
        k_cache[i, n:] = NAN
        v_cache[i, n:] = NAN
    t = dict(q=q, k_cache=k_cache, v_cache=v_cache,
             cache_seqlens=torch.tensor(seqlens, dtype=torch.int32))
    if snew:
        t["k_new"] = rand(b, snew, hkv, d, dtype=dtype)
        t["v_new"] = t["k_new"][..., :dv].clone() if mla else rand(b, snew, hkv, dv, dtype=dtype)
    if sink:
        t["sink"] = rand(hq, scale=2.0)
    return t


def to_paged(t, page, extra_pages=3):
    """The same data as a paged cache: shuffled block table, unused pages and slots NaN."""
    k, v = t["k_cache"], t["v_cache"]
    b, smax = k.shape[:2]
    n_pages = -(-smax // page)
    total = b * n_pages + extra_pages
    perm = torch.randperm(total)[: b * n_pages].view(b, n_pages).to(torch.int32)
    kp = torch.full((total, page) + k.shape[2:], NAN, dtype=k.dtype)
    vp = torch.full((total, page) + v.shape[2:], NAN, dtype=v.dtype)
    for i in range(b):
        for j in range(n_pages):
            s0, s1 = j * page, min(smax, (j + 1) * page)
            kp[perm[i, j], : s1 - s0] = k[i, s0:s1]
            vp[perm[i, j], : s1 - s0] = v[i, s0:s1]
    return dict(t, k_cache=kp, v_cache=vp, block_table=perm)


def clone(t):
    c = {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    if t["v_cache"].data_ptr() == t["k_cache"].data_ptr():
        c["v_cache"] = c["k_cache"][..., : t["v_cache"].shape[-1]]
    return c


def run_both(t, **kw):
    """Ours on a copy, the float64 reference on a float64 copy; compares out, lse and the
    caches after the append. Returns ours (out, lse, tensors)."""
    ours = clone(t)
    out, lse = fl.attention_with_kvcache(**ours, **kw, return_lse=True)
    assert lse.is_contiguous()  # (B, Hq, Sq) as returned, whatever the kernels wrote
    ref_t = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
             for n, x in clone(t).items()}
    ref_out, ref_lse = R.attention_with_kvcache(**ref_t, **kw, return_lse=True)
    baseline = {}
    if t["q"].dtype in LOWP:
        with reference_in(t["q"].dtype):
            baseline = dict(zip(("out", "lse"), R.attention_with_kvcache(
                **clone(t), **kw, return_lse=True)))
    dtype = t["q"].dtype if t["q"].dtype in LOWP else None
    assert_close_to_ref(out, ref_out, baseline=baseline.get("out"), dtype=dtype)
    assert_close_to_ref(lse, ref_lse, baseline=baseline.get("lse"), dtype=dtype, name="lse")
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(ours[name].double(), ref_t[name], rtol=0, atol=0,
                                   equal_nan=True)
    return out, lse, ours


# (B, Sq, Hq, Hkv, D, Dv, Smax, cache_seqlens, Snew, keywords)
CASES = [
    pytest.param(2, 1, 4, 2, 16, 16, 12, [7, 12], 0, {}, id="decode"),
    pytest.param(3, 1, 4, 1, 16, 16, 9, [0, 4, 9], 0, {}, id="seqlen0_mqa"),
    pytest.param(2, 1, 2, 2, 16, 16, 6, [0, 0], 0, {}, id="all_seqlen0"),
    pytest.param(2, 1, 2, 2, 16, 16, 6, [0, 0], 0, dict(sink=True), id="sink_no_keys"),
    pytest.param(3, 4, 4, 2, 16, 16, 12, [5, 2, 0], 0, dict(causal=True),
                 id="sq4_causal_vs_cache_len"),
    pytest.param(2, 3, 4, 2, 16, 16, 12, [5, 0], 2, dict(causal=True), id="k_new_causal"),
    pytest.param(2, 1, 2, 1, 16, 16, 10, [3, 8], 2, {}, id="k_new_fills_cache"),
    pytest.param(2, 2, 4, 2, 16, 16, 14, [9, 13], 1, dict(sink=True, causal=True),
                 id="sink_k_new"),
    pytest.param(2, 3, 2, 2, 16, 16, 14, [9, 1], 0, dict(window=(3, 0)), id="window"),
    pytest.param(2, 5, 2, 2, 16, 16, 14, [2, 9], 0, dict(window=(1, 1)),
                 id="window_empties_rows"),
    pytest.param(2, 1, 2, 2, 16, 16, 8, [5, 8], 0, dict(softcap=2.0, scale=1.0), id="softcap"),
    pytest.param(1, 2, 2, 1, 192, 128, 7, [6], 1, {}, id="d192_dv128"),
    pytest.param(2, 1, 4, 1, 64, 48, 9, [4, 6], 2, dict(mla=True, sink=True), id="mla_view"),
    pytest.param(1, 1, 1, 1, 16, 16, 255, [203], 0, {}, id="odd_203_of_255"),
]


def _split(kw):
    kw = dict(kw)
    return {n: kw.pop(n) for n in ("sink", "mla") if n in kw}, kw


@pytest.mark.parametrize("num_splits", [1, 3, 40], ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("b,sq,hq,hkv,d,dv,smax,lens,snew,kw", CASES)
def test_kvcache_contiguous(b, sq, hq, hkv, d, dv, smax, lens, snew, kw, num_splits):
    mk, kw = _split(kw)
    t = make(b, sq, hq, hkv, d, dv, smax, lens, snew, **mk)
    out, lse, _ = run_both(t, num_splits=num_splits, **kw)
    if mk.get("sink"):
        # A sequence with no key at all: out 0, lse exactly the sink (counted once).
        for i, n in enumerate(lens):
            if n + snew == 0:
                assert bool((out[i] == 0).all())
                assert torch.equal(lse[i], t["sink"].view(-1, 1).expand(hq, sq))


@pytest.mark.parametrize("page", [1, 3, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("b,sq,hq,hkv,d,dv,smax,lens,snew,kw",
                         [c for c in CASES if c.id not in ("odd_203_of_255",)])
def test_kvcache_paged_equals_contiguous(b, sq, hq, hkv, d, dv, smax, lens, snew, kw, page):
    mk, kw = _split(kw)
    t = make(b, sq, hq, hkv, d, dv, smax, lens, snew, **mk)
    if mk.get("mla"):
        pytest.skip("a paged v view of k is covered by test_kvcache_paged_mla_view")
    out_c, lse_c, after_c = run_both(t, **kw)
    tp = to_paged(t, page)
    out_p, lse_p, after_p = run_both(tp, **kw)
    # Same data, same math: bit for bit.
    assert torch.equal(out_p, out_c)
    assert torch.equal(lse_p, lse_c)
    # The appended keys landed at the logical positions of the contiguous cache.
    for name in ("k_cache", "v_cache"):
        for i, n in enumerate(lens):
            logical = R.gather_cache(after_p[name], i, n + snew, tp["block_table"])
            assert torch.equal(logical, after_c[name][i, : n + snew])


def test_kvcache_paged_mla_view():
    t = make(2, 1, 4, 1, 64, 48, 9, [4, 6], 2, sink=True, mla=True)
    tp = to_paged(t, 3)
    tp["v_cache"] = tp["k_cache"][..., :48]
    out_p, lse_p, _ = run_both(tp)
    out_c, lse_c, _ = run_both(t)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_append_in_place_only_touches_new_slots(paged):
    lens, snew = [3, 0, 5], 2
    t = make(3, 1, 2, 2, 16, 16, 8, lens, snew)
    # Random data everywhere (no NaN), so "nothing else changed" is a bitwise check.
    t["k_cache"].copy_(rand(*t["k_cache"].shape))
    t["v_cache"].copy_(rand(*t["v_cache"].shape))
    if paged:
        t = to_paged(t, 3)
        t["k_cache"].copy_(rand(*t["k_cache"].shape))
        t["v_cache"].copy_(rand(*t["v_cache"].shape))
    want_k, want_v = t["k_cache"].clone(), t["v_cache"].clone()
    for i, n in enumerate(lens):
        for j in range(snew):
            pos = n + j
            if paged:
                pg, slot = int(t["block_table"][i, pos // 3]), pos % 3
                want_k[pg, slot], want_v[pg, slot] = t["k_new"][i, j], t["v_new"][i, j]
            else:
                want_k[i, pos], want_v[i, pos] = t["k_new"][i, j], t["v_new"][i, j]
    k_ptr = t["k_cache"].data_ptr()
    fl.attention_with_kvcache(**t)
    assert t["k_cache"].data_ptr() == k_ptr
    assert torch.equal(t["k_cache"], want_k)
    assert torch.equal(t["v_cache"], want_v)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 2**40])
def test_kvcache_sink_counted_once_for_every_split_count(num_splits):
    t = make(2, 3, 4, 2, 16, 16, 10, [6, 1], 0, sink=True)
    out, lse, _ = run_both(t, num_splits=num_splits, causal=True)
    out1, lse1, _ = run_both(t, num_splits=1, causal=True)
    assert_close_to_ref(out, out1.double())
    assert_close_to_ref(lse, lse1.double(), name="lse")


@pytest.mark.parametrize("dtype", [torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_dtypes(dtype, num_splits):
    t = make(3, 2, 4, 2, 32, 32, 20, [17, 0, 9], 1, dtype, sink=True)
    out, lse, _ = run_both(t, num_splits=num_splits, causal=True)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tp = to_paged(t, 16)
    out_p, lse_p, _ = run_both(tp, num_splits=num_splits, causal=True)
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse)


def test_kvcache_whole_cache_when_no_seqlens():
    q, k, v = rand(2, 3, 4, 16), rand(2, 6, 2, 16), rand(2, 6, 2, 8)
    out, lse = fl.attention_with_kvcache(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = R.attention(q, k, v, causal=True, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")


def test_kvcache_strided_q_and_cache():
    # q and caches as non-contiguous views (heads sliced out of wider tensors).
    q_full, k_full, v_full = rand(2, 1, 6, 16), rand(2, 9, 3, 16), rand(2, 9, 3, 16)
    q, k, v = q_full[:, :, 2:6], k_full[:, :, 1:3], v_full[:, :, :2]
    assert not k.is_contiguous()
    lens = torch.tensor([4, 9], dtype=torch.int32)
    out, lse = fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=3,
                                         return_lse=True)
    ref_out, ref_lse = R.attention_with_kvcache(q.contiguous(), k.contiguous(), v.contiguous(),
                                                cache_seqlens=lens, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
