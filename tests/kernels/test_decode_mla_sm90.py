"""The Hopper MLA decode (``kernels/decode_mla_sm90.py``) against ``flashlse.reference``.

Gluon does not run under TRITON_INTERPRET: these run on an sm_90 GPU only (CI compiles the
kernel for sm_90 in tests/test_kernels_compile_sm90.py). Every case checks, through
``test_decode._check``, out and lse against the float64 reference with the
torch-in-bf16 yardstick, the -inf pattern, out == 0 for empty rows and no NaN anywhere
(outputs and split partials start as NaN; cache rows past each length and spare pages are
NaN, so a read of them shows). Each case also asserts that the Gluon kernel ran (its plan),
and compares it with the portable kernel on the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_decode import _check, _make

from flashlse import kernel_options, reference
from flashlse.kernels import decode
from flashlse.masks import normalize_window

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not SM90, reason="the Hopper MLA kernel needs an sm_90 GPU")]


def _plan(q, k, v, lens, table, left, right, sink, num_splits):
    return decode._decode_plan(q, k, v, table, lens is not None, sink, left, right, 0.0,
                               1 / math.sqrt(q.shape[-1]), num_splits, 0, None, None, True,
                               mla=True)


CASES = [
    # (b, sq, hq, smax, lens, page_size, causal, window, sink, num_splits)
    pytest.param(2, 1, 128, 1024, (1024, 333), None, False, (None, None), False, 0,
                 id="contiguous"),
    pytest.param(2, 1, 128, 1024, (1024, 333), 64, False, (None, None), False, 0, id="paged64"),
    pytest.param(3, 2, 128, 1024, (1024, 65, 0), 64, True, (None, None), False, 3,
                 id="mtp_causal_paged64_splits3"),
    pytest.param(2, 2, 64, 2048, (2047, 128), 128, True, (None, None), True, 1,
                 id="mtp_causal_sink_one_split_paged128"),
    pytest.param(4, 1, 16, 512, (512, 1, 63, 64), None, False, (None, None), True, 2,
                 id="hq16_sink_short"),
    pytest.param(2, 1, 128, 4096, (4096, 1000), 256, False, (300, 0), False, 0,
                 id="window_paged256"),
    pytest.param(1, 1, 128, 8192, (8192,), None, False, (None, None), False, 0,
                 id="one_sequence_many_splits"),
    pytest.param(2, 1, 32, 640, (0, 0), 64, False, (None, None), True, 0, id="all_empty_sink"),
    # Pages smaller than a tile (one TMA box a page); 1000 keys in 63 pages of 16: the last
    # tile runs past the block table, whose entries there must not be read.
    pytest.param(2, 1, 128, 1000, (1000, 777), 16, False, (None, None), False, 0, id="paged16"),
    pytest.param(2, 2, 128, 1000, (999, 40), 8, True, (None, None), True, 3,
                 id="mtp_causal_sink_paged8_splits3"),
    pytest.param(2, 1, 64, 2048, (2048, 1500), 32, False, (200, 0), False, 2,
                 id="window_paged32"),
]


@pytest.mark.parametrize("b, sq, hq, smax, lens, page, causal, window, with_sink, num_splits",
                         CASES)
def test_mla_sm90_matches_reference(b, sq, hq, smax, lens, page, causal, window, with_sink,
                                    num_splits):
    q, k, v, lens_t, table, k_ref, v_ref = _make(
        "cuda", torch.bfloat16, b=b, sq=sq, hq=hq, hkv=1, d=576, dv=512, smax=smax, lens=lens,
        mla=True, page_size=page)
    sink = torch.randn(hq, device="cuda") if with_sink else None
    left, right = normalize_window(causal, window)
    assert _plan(q, k, v, lens_t, table, left, right, sink, num_splits).gluon is not None
    # (A compile failure would warn and fall back: pyproject makes that warning an error.)
    out, lse = _check(q, k, v, lens_t, table, k_ref, v_ref, causal=causal, window=window,
                      sink=sink, num_splits=num_splits)
    with kernel_options(sm90_mla_decode=False):
        out_p, lse_p = decode.decode_fwd(
            q, k, v, cache_seqlens=lens_t, block_table=table, left=left, right=right,
            softcap=0.0, scale=1 / math.sqrt(576), sink=sink, num_splits=num_splits)
    torch.testing.assert_close(out.float(), out_p.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(lse_p)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], lse_p[fin], atol=1e-3, rtol=1e-3)


def test_mla_sm90_nan_propagates():
    """A NaN in q, in a visible latent row, or in the sink gives NaN rows (never a clean
    output); a NaN cache row past the length is never read."""
    q, k, v, lens_t, table, _, _ = _make("cuda", torch.bfloat16, b=2, sq=1, hq=128, hkv=1,
                                         d=576, dv=512, smax=512, lens=(512, 200), mla=True,
                                         page_size=64)
    kw = dict(cache_seqlens=lens_t, block_table=table, left=None, right=None, softcap=0.0,
              scale=0.05, num_splits=2)
    q2 = q.clone()
    q2[0, 0, 5, 17] = float("nan")
    out, lse = decode.decode_fwd(q2, k, v, sink=None, **kw)
    assert torch.isnan(out[0, 0, 5]).all() and torch.isnan(lse[0, 5, 0])
    assert not torch.isnan(out[0, 0, 4]).any() and not torch.isnan(out[1]).any()
    # Key 100 of sequence 1 (visible): every head of that sequence is NaN.
    k2 = k.clone()
    page = int(table[1, 100 // 64])
    k2[page, 100 % 64, 0, 3] = float("nan")
    out, lse = decode.decode_fwd(q, k2, k2[..., :512], sink=None, **kw)
    assert torch.isnan(lse[1]).all() and not torch.isnan(lse[0]).any()
    sink = torch.zeros(128, device="cuda")
    sink[7] = float("nan")
    out, lse = decode.decode_fwd(q, k, v, sink=sink, **kw)
    assert torch.isnan(lse[:, 7]).all() and torch.isnan(out[:, 0, 7]).all()
    assert not torch.isnan(lse[:, 6]).any()


@pytest.mark.parametrize("page", [16, 64])
def test_mla_sm90_out_of_range_pages_are_no_keys(page):
    """Value checks are opt-in: a page index outside the cache holds no key and is never
    read (the kernel must stay memory-safe for any table)."""
    q, k, v, lens_t, table, _, _ = _make("cuda", torch.bfloat16, b=2, sq=1, hq=64, hkv=1,
                                         d=576, dv=512, smax=256, lens=(256, 256), mla=True,
                                         page_size=page)
    per = 64 // page  # table entries a 64-key block
    bad = table.clone()
    bad[0, per * 1: per * 2] = 10**6
    bad[1, per * 2: per * 3] = -5
    out, lse = decode.decode_fwd(q, k, v, cache_seqlens=lens_t, block_table=bad, left=None,
                                 right=None, softcap=0.0, scale=0.05, sink=None, num_splits=0)
    # The same as dropping those pages' keys: the reference on the remaining keys.
    for b, drop in ((0, 1), (1, 2)):
        keep = [j for j in range(256) if j // 64 != drop]
        kb = reference.gather_cache(k, b, 256, table)[keep]
        s = (q[b].double().transpose(0, 1) @ kb.double().transpose(0, 1).squeeze(0).T) * 0.05
        ref_lse = torch.logsumexp(s, -1)
        torch.testing.assert_close(lse[b].double(), ref_lse, atol=2e-2, rtol=0)


def _topk_call(q, cache, idx, table, kv):
    """The MLA top-k call (``v = cache[..., :512]``) and the float64 reference on the gathered
    rows ``kv``; no NaN in out or lse."""
    import flashlse as fl

    out, lse = fl.sparse_attention(q, cache, cache[..., :512], idx, block_table=table,
                                   return_lse=True)
    want_out, want_lse = reference.sparse_attention(q.double(), kv.double(),
                                                    kv[..., :512].double(), idx,
                                                    return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    return out, lse, want_out, want_lse


@pytest.mark.parametrize("paged", [None, 64], ids=["contiguous", "paged64"])
def test_mla_sm90_topk_matches_reference(paged):
    """DeepSeek-V3.2 sparse decode / prefill: each query row's own top-k list of latent rows
    (``sparse_attention``, the token-table path), gathered by cp.async. Lists hold -1, repeats
    and rows past 64-key tiles; one row's list is all -1 (empty); cache rows nobody lists are
    NaN (a read of one would show)."""
    import flashlse as fl

    g = torch.Generator(device="cuda").manual_seed(11)
    b, sq, hq, sk, topk = 2, 3, 128, 700, 200
    q = torch.randn(b, sq, hq, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, sk, 1, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, sk - 100, (b, sq, 1, topk), device="cuda", generator=g,
                        dtype=torch.int32)
    idx[0, 1, 0, ::7] = -1
    idx[1, 0, 0, 3] = idx[1, 0, 0, 4]
    idx[1, 2] = -1
    kv[:, sk - 100:] = float("nan")  # never listed
    table = None
    cache = kv
    if paged:
        pages = sk // 4 // paged + 1
        table = torch.randperm(b * pages * 2, device="cuda")[: b * pages].view(b, pages)
        table = table.to(torch.int32)
        cache = torch.full((b * pages * 2, paged, 1, 576), float("nan"), device="cuda",
                           dtype=torch.bfloat16)
        idx = idx % (pages * paged)
        idx[0, 1, 0, ::7] = -1
        idx[1, 2] = -1
        for i in range(b):
            rows = kv[i, : pages * paged].reshape(pages, paged, 1, 576)
            cache[table[i].long()] = rows
        kv = torch.stack([reference.gather_cache(cache, i, pages * paged, table)
                          for i in range(b)])
    out, lse, want_out, want_lse = _topk_call(q, cache, idx, table, kv)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert (out[1, 2] == 0).all()
    torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=2e-2, rtol=2e-2)
    with kernel_options(sm90_mla_decode=False):
        out_p, lse_p = fl.sparse_attention(q, cache, cache[..., :512], idx, block_table=table,
                                           return_lse=True)
    torch.testing.assert_close(out.float(), out_p.float(), atol=2e-2, rtol=2e-2)


def test_mla_sm90_topk_takes_the_gluon_kernel():
    """The token-table plan of an MLA top-k call is the Hopper kernel's (not decode.py's)."""
    q = torch.randn(6, 1, 128, 576, device="cuda").bfloat16()
    pages = torch.randn(1400, 1, 1, 576, device="cuda").bfloat16()
    table = torch.zeros(6, 200, dtype=torch.int32, device="cuda")
    plan = decode._decode_plan(q, pages, pages[..., :512], table, False, None, None, None, 0.0,
                               0.05, 0, 0, None, None, True, token_table=(700, 3, 1), mla=True)
    assert plan.gluon is not None


def test_mla_sm90_compile_failure_falls_back(monkeypatch, compile_failures):
    """A Gluon kernel this triton cannot compile warns once and the signature runs the portable
    kernel from then on (kernels/failures.py), with the same answer."""
    from flashlse.kernels import decode_mla_sm90

    real = decode_mla_sm90._mla_decode_kernel

    class Broken:
        arg_names = real.arg_names

        def __getitem__(self, grid):
            raise RuntimeError("injected compile failure")

    q, k, v, lens_t, table, _, _ = _make("cuda", torch.bfloat16, b=2, sq=1, hq=128, hkv=1,
                                         d=576, dv=512, smax=256, lens=(256, 100), mla=True,
                                         page_size=64)
    kw = dict(cache_seqlens=lens_t, block_table=table, left=None, right=None, softcap=0.0,
              scale=0.05, sink=None, num_splits=0)
    with kernel_options(sm90_mla_decode=False):
        want, want_lse = decode.decode_fwd(q, k, v, **kw)
    monkeypatch.setattr(decode_mla_sm90, "_mla_decode_kernel", Broken())
    monkeypatch.setattr(decode, "_PLANS", {})
    with pytest.warns(RuntimeWarning, match="MLA decode kernel failed"):
        out, lse = decode.decode_fwd(q, k, v, **kw)
    assert len(compile_failures) == 1
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    out2, _ = decode.decode_fwd(q, k, v, **kw)  # no second warning: the failure is remembered
    torch.testing.assert_close(out2, want)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_sm90_neg_inf_sink_is_no_sink(num_splits):
    """A -inf sink equals no sink (bit for bit; an empty sequence stays out = 0, lse = -inf),
    at one split (the kernel's epilogue) and three (the merge's)."""
    q, k, v, lens_t, table, _, _ = _make("cuda", torch.bfloat16, b=3, sq=1, hq=128, hkv=1,
                                         d=576, dv=512, smax=512, lens=(512, 0, 130), mla=True,
                                         page_size=64)
    kw = dict(cache_seqlens=lens_t, block_table=table, left=None, right=None, softcap=0.0,
              scale=0.05, num_splits=num_splits)
    none = decode.decode_fwd(q, k, v, sink=None, **kw)
    got = decode.decode_fwd(q, k, v, sink=torch.full((128,), float("-inf"), device="cuda"), **kw)
    for a, b in zip(got, none):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b)
    assert torch.isneginf(got[1][1]).all() and (got[0][1] == 0).all()


def test_mla_sm90_topk_nan_reaches_exactly_the_rows_that_list_it():
    """A NaN in a listed latent row gives NaN in the rows of the query rows whose lists hold
    it, and nowhere else (never a clean-looking or empty-looking row)."""
    import flashlse as fl

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 4, 128, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, 300, 1, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, 200, (1, 4, 1, 96), device="cuda", generator=g, dtype=torch.int32)
    idx[0, 2, 0, 10] = 250  # only query row 2 lists key 250
    kv[0, 250, 0, 7] = float("nan")
    out, lse = fl.sparse_attention(q, kv, kv[..., :512], idx, return_lse=True)
    assert torch.isnan(lse[0, :, 2]).all() and torch.isnan(out[0, 2]).all()
    for i in (0, 1, 3):
        assert not torch.isnan(out[0, i]).any() and torch.isfinite(lse[0, :, i]).all()


def test_mla_sm90_topk_sink_counted_once_and_neg_inf_sink_is_no_sink():
    """Top-k lists on the Hopper kernel with a sink (merged once after it): against the float64
    reference, an all -1 row's lse is the sink and its out 0, no NaN; a -inf sink gives the
    no-sink answer (within 1e-6, as tests/test_nan_propagation.py's paths; an empty row
    stays out 0, lse -inf). Not yet run on a GPU (written after session 23's last call)."""
    import flashlse as fl

    g = torch.Generator(device="cuda").manual_seed(5)
    b, sq, hq, sk, topk = 2, 2, 128, 500, 130
    q = torch.randn(b, sq, hq, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, sk, 1, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(-1, sk, (b, sq, 1, topk), device="cuda", generator=g,
                        dtype=torch.int32)
    idx[1, 0] = -1  # empty
    sink = torch.randn(hq, device="cuda", generator=g)
    call = lambda s: fl.sparse_attention(q, kv, kv[..., :512], idx, sink=s, return_lse=True)
    plan = decode._decode_plan(q.reshape(b * sq, 1, hq, 576), kv.reshape(b * sk, 1, 1, 576),
                               kv.reshape(b * sk, 1, 1, 576)[..., :512],
                               idx.reshape(b * sq, topk), False, None, None, None, 0.0, 0.05,
                               0, 0, None, torch.float32, True, token_table=(sk, sq, 1),
                               mla=True)
    assert plan.gluon is not None
    out, lse = call(sink)
    want_out, want_lse = reference.sparse_attention(q.double(), kv.double(),
                                                    kv[..., :512].double(), idx,
                                                    sink=sink.double(), return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[1, 0] == 0).all()
    torch.testing.assert_close(lse[1, :, 0].double(), sink.double())
    torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2, rtol=2e-2)
    none = call(None)
    neg = call(torch.full((hq,), float("-inf"), device="cuda"))
    for a, c in zip(neg, none):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    assert torch.isneginf(none[1][1, :, 0]).all() and (none[0][1, 0] == 0).all()


def test_mla_sm90_topk_repeated_calls_and_a_failed_kept_plan(monkeypatch, compile_failures):
    """Serving repeats a top-k call's metadata: from the second call the sparse plan launches
    its kept Gluon decode plan on the tensors themselves (fresh q and lists each call, against
    the reference). A kept plan whose kernel fails warns once, the call answers on the
    portable kernel, and the kept plans are made again."""
    import dataclasses

    from flashlse.ops import sparse as sparse_mod

    g = torch.Generator(device="cuda").manual_seed(5)
    b, hq, sk, topk, page = 3, 128, 512, 256, 64
    pages = sk // page
    cache = torch.randn(b * pages, page, 1, 576, device="cuda", generator=g).bfloat16()
    table = torch.randperm(b * pages, device="cuda", generator=g).view(b, pages).to(torch.int32)
    kv = torch.stack([reference.gather_cache(cache, i, sk, table) for i in range(b)])
    sparse_mod._PLANS.clear()

    def call_and_check():
        q = torch.randn(b, 1, hq, 576, device="cuda", generator=g).bfloat16()
        idx = torch.randint(-1, sk, (b, 1, 1, topk), device="cuda", generator=g,
                            dtype=torch.int32)
        idx[2] = -1  # an empty row
        out, lse, want_out, want_lse = _topk_call(q, cache, idx, table, kv)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
        torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse.double()[:2], want_lse[:2], atol=2e-2, rtol=2e-2)

    for _ in range(3):
        call_and_check()
    (plan,) = sparse_mod._PLANS.values()
    assert plan.direct and len(plan.decode) == 1
    (sub, (key, dplan)), = plan.decode.items()
    assert dplan.gluon is not None

    class Broken:
        def __call__(self, *tensors):
            raise RuntimeError("injected compile failure")

    plan.decode[sub] = (key, dataclasses.replace(dplan, run=Broken()))
    with pytest.warns(RuntimeWarning, match="MLA decode kernel failed"):
        call_and_check()
    assert len(compile_failures) == 1
    (sub2, (_, dplan2)), = plan.decode.items()
    assert sub2 == sub and dplan2.gluon is None  # planned again, on the portable kernel
    call_and_check()
