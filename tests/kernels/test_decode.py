"""``kernels.decode.decode_fwd`` against ``flashlse.reference.attention_with_kvcache``.

Tolerance (docs/design.md §5): ``err(kernel) <= 2 * err(torch in the same dtype) + atol``, both
against the float64 reference, for out and lse. The ``-inf`` pattern of lse equals the
reference's exactly, empty rows have ``out == 0``, and no NaN or +inf appears anywhere;
every buffer the launcher allocates (out, lse, the split partials) starts as NaN, so an
unwritten element fails. Under ``TRITON_INTERPRET=1`` (CI) shapes are small and dtypes
fp32/fp16 (the interpreter's bf16 ``tl.dot`` is wrong in triton 3.6); ``gpu`` tests run
real sizes in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashlse import reference
from flashlse.kernels import decode
from flashlse.masks import normalize_window, visible

HAS_CUDA = torch.cuda.is_available()
LOWP_ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _torch_decode(q, k_cache, v_cache, lens, block_table, left, right, softcap, scale, sink):
    """The same attention in q's dtype with plain torch ops: the error yardstick."""
    outs, lses = [], []
    hq = q.shape[2]
    for b in range(q.shape[0]):
        n = int(lens[b])
        kb = reference.gather_cache(k_cache, b, n, block_table)
        vb = reference.gather_cache(v_cache, b, n, block_table)
        g = hq // kb.shape[1]
        qh = q[b].transpose(0, 1)
        kh = kb.transpose(0, 1).repeat_interleave(g, 0)
        vh = vb.transpose(0, 1).repeat_interleave(g, 0)
        s = qh.matmul(kh.transpose(-1, -2)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        sq = q.shape[1]
        ok = visible(torch.arange(sq, device=q.device), torch.arange(n, device=q.device),
                     sq, n, left, right)
        if ok is not None:
            s = s.masked_fill(~ok, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.to(s.dtype).view(hq, 1, 1).expand(hq, sq, 1)], -1)
        s32 = s.float()
        lse = torch.logsumexp(s32, -1) if s.shape[-1] else s32.new_full((hq, sq), float("-inf"))
        piv = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s32 - piv[..., None])[..., :n].to(q.dtype)
        outs.append(p.matmul(vh).transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _make(device, dtype, b=2, sq=1, hq=4, hkv=2, d=32, dv=32, smax=100, lens=(37, 100),
          mla=False, page_size=None):
    """q and caches of fresh random data; with ``page_size`` the same keys in shuffled pages.

    Returns ``(q, k_cache, v_cache, lens, block_table, k_contig, v_contig)``.
    """
    q = torch.randn(b, sq, hq, d, device=device).to(dtype)
    k = torch.randn(b, smax, hkv, d, device=device).to(dtype)
    v = k[..., :dv] if mla else torch.randn(b, smax, hkv, dv, device=device).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    # Keys past each sequence's length are NaN: reading one would poison the result.
    for i, n in enumerate(lens):
        k[i, n:] = float("nan")
        if not mla:
            v[i, n:] = float("nan")
    if page_size is None:
        return q, k, v, lens_t, None, k, v
    pages = math.ceil(smax / page_size)
    # Two spare pages nobody points at, filled with NaN: a read of them would show.
    perm = torch.randperm(b * pages + 2, device=device)[: b * pages]
    table = perm.view(b, pages).to(torch.int32)
    kp = torch.full((b * pages + 2, page_size, hkv, d), float("nan"), device=device, dtype=dtype)
    pad = pages * page_size - smax
    k_full = torch.cat([k, k.new_full((b, pad, hkv, d), float("nan"))], 1)
    kp[perm.long()] = k_full.reshape(b * pages, page_size, hkv, d)
    if mla:
        vp = kp[..., :dv]
    else:
        vp = torch.full((b * pages + 2, page_size, hkv, dv), float("nan"), device=device,
                        dtype=dtype)
        v_full = torch.cat([v, v.new_full((b, pad, hkv, dv), float("nan"))], 1)
        vp[perm.long()] = v_full.reshape(b * pages, page_size, hkv, dv)
    return q, kp, vp, lens_t, table, k, v


def _check(q, k, v, lens, table, k_ref, v_ref, *, causal=False, window=(None, None), softcap=0.0,
           sink=None, num_splits=0):
    left, right = normalize_window(causal, window)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = decode.decode_fwd(q, k, v, cache_seqlens=lens, block_table=table, left=left,
                                 right=right, softcap=softcap, scale=scale, sink=sink,
                                 num_splits=num_splits)
    ref_out, ref_lse = reference.attention_with_kvcache(
        q, k_ref, v_ref, cache_seqlens=lens, causal=causal, window=window, softcap=softcap,
        scale=scale, sink=sink, return_lse=True)
    pt_out, pt_lse = _torch_decode(q, k, v, lens, table, left, right, softcap, scale, sink)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN (or unwritten element) in out"
    assert not torch.isnan(lse).any(), "NaN (or unwritten element) in lse"
    assert not torch.isinf(out).any(), "inf in out"
    assert not torch.isposinf(lse).any(), "+inf in lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf pattern of lse"
    atol = LOWP_ATOL[q.dtype]
    err = (out.double() - ref_out).abs().max().item()
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    assert err <= 2 * pt_err + atol, f"out: err {err:.3g} vs torch {pt_err:.3g}"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (lse.double() - ref_lse)[fin].abs().max().item()
        pt_err = (pt_lse.double() - ref_lse)[fin].abs().max().item()
        assert err <= 2 * pt_err + atol, f"lse: err {err:.3g} vs torch {pt_err:.3g}"
    empty = torch.isneginf(ref_lse).transpose(1, 2)
    assert (out[empty] == 0).all(), "empty rows must have out == 0"
    return out, lse


def _dtypes():
    return [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32, torch.float16]


CASES = [
    pytest.param(dict(), dict(num_splits=1), id="splits1"),
    pytest.param(dict(), dict(num_splits=3), id="splits3"),
    # 100 keys are 4 tiles of 32 (interpreter) or 2 of 64: most of the 9 splits are empty.
    pytest.param(dict(), dict(num_splits=9), id="splits_more_than_tiles"),
    pytest.param(dict(), dict(num_splits=0), id="splits_auto"),
    # Many splits, most of them empty: the combine merges 57 states, several per step.
    pytest.param(dict(sq=2), dict(num_splits=57, causal=True), id="splits57"),
    pytest.param(dict(lens=(0, 0)), dict(num_splits=3), id="empty_caches"),
    pytest.param(dict(lens=(0, 5)), dict(num_splits=1), id="one_empty_cache_splits1"),
    pytest.param(dict(sq=4, lens=(2, 61)), dict(causal=True, num_splits=2),
                 id="sq4_causal_sq_gt_sk"),
    pytest.param(dict(sq=16, hq=2, hkv=1, lens=(40, 77)), dict(causal=True, num_splits=3),
                 id="sq16_causal"),
    pytest.param(dict(sq=3, lens=(50, 97)), dict(window=(20, 1), num_splits=3), id="window"),
    pytest.param(dict(sq=2), dict(window=(0, 0), num_splits=2), id="window_00"),
    pytest.param(dict(), dict(softcap=1.5, num_splits=2), id="softcap"),
    pytest.param(dict(hq=8, hkv=2), dict(num_splits=2), id="gqa4"),
    pytest.param(dict(hq=6, hkv=1, sq=2), dict(causal=True, num_splits=2), id="mqa6_sq2"),
    pytest.param(dict(d=59, dv=40), dict(num_splits=2), id="odd_head_dims"),
    pytest.param(dict(hq=8, hkv=1, d=64, dv=32, mla=True), dict(num_splits=3), id="mla_like"),
    pytest.param(dict(hq=8, hkv=1, d=64, dv=32, mla=True, page_size=16), dict(num_splits=2),
                 id="mla_like_paged16"),
    pytest.param(dict(page_size=16), dict(num_splits=3), id="paged16"),
    pytest.param(dict(page_size=64, lens=(0, 100)), dict(num_splits=2, causal=True), id="paged64"),
    pytest.param(dict(page_size=48, lens=(47, 96)), dict(num_splits=2), id="paged48"),
]


@pytest.mark.parametrize("make_kw, call_kw", CASES)
def test_decode_matches_reference(device, make_kw, call_kw):
    dtype = _dtypes()[1 if "page_size" in make_kw else 0]
    q, k, v, lens, table, k_ref, v_ref = _make(device, dtype, **make_kw)
    _check(q, k, v, lens, table, k_ref, v_ref, **call_kw)


@pytest.mark.parametrize("num_splits", [1, 2, 9])
@pytest.mark.parametrize("lens", [pytest.param((0, 63), id="with_empty"),
                                  pytest.param((17, 100), id="full")])
def test_decode_sink_counted_once(device, num_splits, lens):
    q, k, v, lens_t, table, _, _ = _make(device, _dtypes()[0], lens=lens)
    sink = torch.randn(q.shape[2], device=device) + 2.0
    _, lse = _check(q, k, v, lens_t, table, k, v, sink=sink, num_splits=num_splits)
    if lens[0] == 0:
        # A sink with no keys: lse is the sink (up to the base-2 round trip of one split).
        torch.testing.assert_close(lse[0], sink[:, None].expand_as(lse[0]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_paged_equals_contiguous(device, page_size, num_splits):
    dtype = _dtypes()[0]
    q, kp, vp, lens, table, k, v = _make(device, dtype, sq=2, lens=(70, 100), page_size=page_size)
    kw = dict(cache_seqlens=lens, left=None, right=0, softcap=0.0, scale=0.125, sink=None,
              num_splits=num_splits)
    out_p, lse_p = decode.decode_fwd(q, kp, vp, block_table=table, **kw)
    out_c, lse_c = decode.decode_fwd(q, k, v, block_table=None, **kw)
    assert torch.equal(out_p, out_c)
    assert torch.equal(lse_p, lse_c)


def test_decode_split_count_does_not_change_result(device):
    q, k, v, lens, table, _, _ = _make(device, torch.float32 if not HAS_CUDA else torch.float16)
    kw = dict(cache_seqlens=lens, block_table=None, left=None, right=None, softcap=0.0,
              scale=0.2, sink=None)
    out1, lse1 = decode.decode_fwd(q, k, v, num_splits=1, **kw)
    out5, lse5 = decode.decode_fwd(q, k, v, num_splits=5, **kw)
    torch.testing.assert_close(out5.float(), out1.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(lse5, lse1, atol=1e-5, rtol=0)


def test_decode_plan_keyed_on_storage_sharing(device):
    # The launch plan is cached by metadata: a v with k's strides but its own storage after
    # the MLA view (v = k[..., :Dv], read once) must not reuse the view's plan.
    dtype = _dtypes()[0]
    q, k, v, lens, table, _, _ = _make(device, dtype, hq=8, hkv=1, d=64, dv=32, mla=True)
    _check(q, k, v, lens, table, k, v, num_splits=2)
    v_own = torch.empty_strided(v.shape, v.stride(), dtype=dtype, device=device)
    v_own.copy_(torch.randn(v.shape, device=device).to(dtype))
    assert v_own.stride() == v.stride() and v_own.data_ptr() != k.data_ptr()
    _check(q, k, v_own, lens, table, k, v_own, num_splits=2)


def test_decode_plan_repeated_calls(device):
    # Same metadata, other values (lengths, data) and a sink toggled: nothing but metadata
    # may come from the cached plan.
    dtype = _dtypes()[0]
    for lens, sink in (((37, 100), None), ((5, 64), None), ((5, 64), True), ((0, 100), None)):
        q, k, v, lens_t, table, _, _ = _make(device, dtype, lens=lens)
        s = torch.randn(q.shape[2], device=device) if sink else None
        for num_splits in (0, 3):
            _check(q, k, v, lens_t, table, k, v, sink=s, num_splits=num_splits, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 7])
@pytest.mark.parametrize("paged", [None, 16, 256])
def test_decode_real_size_gqa(num_splits, paged):
    q, k, v, lens, table, k_ref, v_ref = _make(
        "cuda", torch.bfloat16, b=4, sq=1, hq=32, hkv=8, d=128, dv=128, smax=4096,
        lens=(4096, 1, 0, 3000), page_size=paged)
    sink = torch.randn(32, device="cuda")
    _check(q, k, v, lens, table, k_ref, v_ref, sink=sink, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [None, 64])
def test_decode_real_size_mla(paged):
    q, k, v, lens, table, k_ref, v_ref = _make(
        "cuda", torch.bfloat16, b=2, sq=2, hq=128, hkv=1, d=576, dv=512, smax=1024,
        lens=(1024, 333), mla=True, page_size=paged)
    _check(q, k, v, lens, table, k_ref, v_ref, causal=True, num_splits=0)


@pytest.mark.gpu
def test_decode_real_size_spec_window_softcap():
    q, k, v, lens, table, k_ref, v_ref = _make(
        "cuda", torch.bfloat16, b=3, sq=8, hq=16, hkv=2, d=128, dv=128, smax=2048,
        lens=(2048, 5, 1500), page_size=16)
    _check(q, k, v, lens, table, k_ref, v_ref, window=(256, 0), softcap=30.0, num_splits=0)


@pytest.mark.gpu
def test_decode_real_size_paged_bitwise():
    q, kp, vp, lens, table, k, v = _make("cuda", torch.bfloat16, b=4, sq=4, hq=32, hkv=8, d=128,
                                         dv=128, smax=4096, lens=(4096, 1, 0, 3000), page_size=16)
    kw = dict(cache_seqlens=lens, left=None, right=0, softcap=0.0, scale=0.1, sink=None,
              num_splits=0)
    out_p, lse_p = decode.decode_fwd(q, kp, vp, block_table=table, **kw)
    out_c, lse_c = decode.decode_fwd(q, k, v, block_table=None, **kw)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)


@pytest.mark.parametrize("programs, want", [(8, 32), (64, 4), (512, 1), (1024, 1)])
def test_num_splits_fills_one_wave(programs, want):
    # H200, D = 128 decode: 132 SMs x 2 resident programs. B=1 (8 kv heads) and B=8 fill
    # one wave to >= 95% (32 x 8 = 256 and 4 x 64 = 256 of 264); large batches need no split.
    assert decode._num_splits(programs, 2048, 264) == want
    assert decode._num_splits(8, 3, 264) == 3  # at most one split per key tile


def test_num_splits_floor_of_key_tiles():
    # (decode.SPLIT_FLOOR) B = 1, 8 programs over 4k keys (64 tiles): 32 splits of 2 tiles,
    # or at most 8 of 8 tiles (the fused merge's range); long caches are under the cap.
    assert decode._num_splits(8, 64, 264) == 32
    assert decode._num_splits(8, 64, 264, 8) == 8
    assert decode._num_splits(8, 512, 264, 8) == decode._num_splits(8, 512, 264) == 32
    assert decode._num_splits(8, 5, 264, 8) == 1  # fewer tiles than the floor: one split


def kept_unread_lse(want_lse):
    """The stream's kept buffer of unread lses (``decode.unread_lse``), checked to be the
    only one and to hold ``want_lse`` (what the last call without ``return_lse`` wrote)."""
    unread = [sc.unread for sc in decode._SCRATCH.values() if sc.unread is not None]
    assert len(unread) == 1 and unread[0].numel() >= want_lse.numel()
    assert torch.equal(unread[0][:want_lse.numel()].view_as(want_lse), want_lse)
    return unread[0]
