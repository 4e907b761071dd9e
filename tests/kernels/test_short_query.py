"""Dense calls of at most ``dispatch.SHORT_Q_WIDE_MAX`` query rows
(``dispatch.SHORT_Q_DECODE``): the split-KV decode kernel over k and v as a whole cache,
against the float64 reference (out and lse, empty rows, outputs pre-filled with NaN), and the
same calls on the dense kernels (the route off); the route taken up to its bound and not past
it; a kept launch planned on ``v = k`` (the kernel then reads V from K's tiles) given another
v; gradients through it."""

from __future__ import annotations

import pytest
import torch
from test_decode import kept_unread_lse
from test_fwd import DTYPES, _run_dense

import flashlse as fl
from flashlse import reference
from flashlse.kernels import decode, dispatch


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode kernel's plan runs (``decode.run_plan``) of the test, counted."""
    calls = []
    real = decode.run_plan
    monkeypatch.setattr(decode, "run_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# (b, sq, sk, hq, hkv, d, dv, keywords), as test_fwd's DENSE_CASES.
SHORT_CASES = [
    pytest.param(2, 1, 47, 4, 2, 32, 32, {}, id="decode_row_gqa"),
    pytest.param(1, 1, 63, 2, 1, 32, 32, {"causal": True}, id="decode_row_causal"),
    pytest.param(1, 5, 3, 2, 1, 32, 32, {"causal": True}, id="causal_sq_gt_sk_empty_rows"),
    pytest.param(1, 16, 40, 4, 1, 32, 32, {"causal": True, "sink": True}, id="sq16_sink"),
    pytest.param(1, 3, 0, 2, 1, 32, 32, {"sink": True}, id="sk0_sink"),
    pytest.param(1, 2, 0, 2, 1, 32, 32, {}, id="sk0"),
    pytest.param(1, 4, 30, 2, 1, 32, 32, {"window": (5, 0)}, id="sliding"),
    pytest.param(1, 2, 30, 2, 2, 32, 32, {"window": (3, 4)}, id="window_both"),
    pytest.param(1, 8, 20, 2, 1, 32, 32, {"softcap": 2.0, "causal": True}, id="softcap"),
    pytest.param(1, 3, 30, 2, 1, 59, 40, {}, id="d59_dv40"),
    pytest.param(2, 7, 25, 4, 2, 32, 32, {"strided": True}, id="strided_q"),
    pytest.param(1, 16, 70, 8, 1, 32, 32, {}, id="rows128_two_row_tiles"),
    pytest.param(1, 2, 30, 2, 1, 32, 32, {"scale": -0.3}, id="negative_scale"),
]


@pytest.mark.parametrize("route", [True, False], ids=["decode", "dense"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", SHORT_CASES)
def test_short_query_dense_call(device, monkeypatch, decode_calls, route, dtype, b, sq, sk, hq,
                                hkv, d, dv, kw):
    monkeypatch.setattr(dispatch, "SHORT_Q_DECODE", route)
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, **kw)
    assert bool(decode_calls) == route


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
@pytest.mark.parametrize("past", [0, 1], ids=["at_bound", "past_bound"])
def test_short_query_bound(device, monkeypatch, decode_calls, wide, past):
    # The route takes up to SHORT_Q_WIDE_MAX rows (decode.MAX_SQ with SHORT_Q_WIDE off).
    monkeypatch.setattr(dispatch, "SHORT_Q_WIDE", wide)
    sq = (dispatch.SHORT_Q_WIDE_MAX if wide else decode.MAX_SQ) + past
    q = torch.randn(1, sq, 2, 32, device=device, dtype=DTYPES[0])
    k = torch.randn(1, 40, 1, 32, device=device, dtype=DTYPES[0])
    fl.attention(q, k, k, causal=True)
    assert bool(decode_calls) == (not past)


@pytest.mark.parametrize("override", ["fwd_config", "fwd_sm90_config"])
def test_short_query_tile_override_runs_the_dense_kernels(device, kernel_opts, decode_calls,
                                                          override):
    # A forward tile override is a request for the dense kernels (fwd_sm90_config: the
    # Hopper one, where it takes the call): the route steps aside.
    kernel_opts(**{override: {"BLOCK_M": 64} if override == "fwd_config" else {"GRID": True}})
    q, k, v = _qkv(device, 4, 1, 2, 30, 4, 2)
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    assert not decode_calls
    want, want_lse = _ref(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=2e-3)


WIDE_CASES = [
    pytest.param(1, 32, 70, 4, 1, 32, 32, {"causal": True}, id="sq32_causal_mqa4"),
    pytest.param(2, 64, 90, 4, 2, 32, 32, {"causal": True, "sink": True}, id="sq64_sink"),
    pytest.param(1, 40, 30, 2, 1, 32, 32, {"causal": True}, id="sq40_gt_sk_empty_rows"),
    pytest.param(1, 64, 50, 2, 2, 32, 32, {"window": (7, 3)}, id="sq64_window"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", WIDE_CASES)
def test_short_query_wide_route(device, monkeypatch, decode_calls, dtype, b, sq, sk, hq, hkv, d,
                                dv, kw):
    # (dispatch.SHORT_Q_WIDE: the route up to SHORT_Q_WIDE_MAX rows; the kernel takes 64.)
    monkeypatch.setattr(dispatch, "SHORT_Q_WIDE", True)
    monkeypatch.setattr(dispatch, "SHORT_Q_WIDE_MAX", 64)
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, **kw)
    assert decode_calls


def test_short_query_wide_route_lse_contract(device, monkeypatch, decode_calls):
    # The wide route (40 rows, 30 keys, causal: rows 0-9 see no key): empty rows (0, -inf),
    # a -inf sink is no sink, a NaN key reaches exactly the rows that see it.
    monkeypatch.setattr(dispatch, "SHORT_Q_WIDE", True)
    monkeypatch.setattr(dispatch, "SHORT_Q_WIDE_MAX", 64)
    q, k, v = _qkv(device, 12, 2, 40, 30, 4, 2)
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    neg = fl.attention(q, k, v, causal=True, return_lse=True,
                       sink=torch.full((4,), float("-inf"), device=device))
    assert torch.equal(out, neg[0]) and torch.equal(lse, neg[1])
    assert torch.isneginf(lse[:, :, :10]).all() and (out[:, :10] == 0).all()
    assert torch.isfinite(lse[:, :, 10:]).all()
    bad = k.clone()
    bad[1, 25, 0, 3] = float("nan")  # key 25 of batch 1, kv head 0: rows 35-39 see it
    out, lse = fl.attention(q, bad, v, causal=True, return_lse=True)
    nan_rows = torch.zeros(2, 40, 4, dtype=torch.bool)
    nan_rows[1, 35:, :2] = True
    assert torch.equal(out.isnan().any(-1).cpu(), nan_rows)
    assert torch.equal(lse.isnan().cpu(), nan_rows.permute(0, 2, 1))
    # Gradients through the empty rows: zero for their q, never NaN anywhere.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fl.attention(qg, kg, vg, causal=True).sum().backward()
    for t in (qg, kg, vg):
        assert not torch.isnan(t.grad).any()
    assert (qg.grad[:, :10] == 0).all()
    assert decode_calls


def _ref(q, k, v, **kw):
    return reference.attention(q.double(), k.double(), v.double(), return_lse=True, **kw)


def _qkv(device, seed, b, sq, sk, hq, hkv, d=32):
    """Fresh q, k, v of DTYPES[0] on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(device, DTYPES[0])
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_short_query_kept_launch_reads_each_calls_v(device, decode_calls):
    # A launch kept for a call with v = k (the decode kernel then reads V from K's tiles) and
    # a later call of the same metadata with its own v: each gets its own v's answer.
    q, k, v = _qkv(device, 3, 1, 2, 30, 4, 2)
    for vv in (k, v, k, v):
        out, lse = fl.attention(q, k, vv, causal=True, return_lse=True)
        want, want_lse = _ref(q, k, vv, causal=True)
        torch.testing.assert_close(out.double().cpu(), want.cpu(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), atol=2e-3, rtol=2e-3)
    assert len(decode_calls) == 4


@pytest.mark.parametrize("sq", [1, 40], ids=["route", "dense"])
def test_unread_lse_on_kept_scratch(device, monkeypatch, kernel_opts, sq):
    # fl.attention without return_lse and without autograd writes its lse to the stream's
    # kept buffer (one allocation less a call): out equal to the return_lse call's, on the
    # route and on the dense kernels; with return_lse the lse is the call's own tensor; a
    # call autograd records keeps its own lse: a later call of the same metadata writing
    # the kept buffer leaves its backward unchanged (bit for bit: deterministic).
    kernel_opts(poison_outputs=False)
    monkeypatch.setattr(decode, "_SCRATCH", {})
    q, k, v = _qkv(device, 21, 1, sq, 50, 4, 2)
    kw = dict(causal=True, deterministic=True)
    want, want_lse = fl.attention(q, k, v, return_lse=True, **kw)
    for _ in range(3):  # (the first call plans, the rest take the kept launch)
        assert torch.equal(fl.attention(q, k, v, **kw), want)
    unread = kept_unread_lse(want_lse)
    got, lse = fl.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert lse.untyped_storage().data_ptr() != unread.untyped_storage().data_ptr()
    dout = torch.randn_like(want)
    grads = []
    for other in (False, True):
        qg = q.clone().requires_grad_()
        out = fl.attention(qg, k, v, **kw)
        if other:
            with torch.no_grad():
                fl.attention(_qkv(device, 22, 1, sq, 50, 4, 2)[0], k, v, **kw)
        out.backward(dout)
        grads.append(qg.grad)
    assert not torch.isnan(grads[0]).any() and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("sq", [1, 4, 40], ids=["row", "rows4", "dense"])
def test_attention_heads_first(device, decode_calls, sq):
    # transformers' (B, H, S, D) tensors: the same bits as fl.attention on their (B, S, H, D)
    # views, call after call; on the route the kept decode launch runs on the tensors
    # themselves (no new plan, no views: ops.attention._HEADS_FIRST), with v = k (read from
    # K's tiles) and its own v in turns (each its own answer), and a NaN key reaching only
    # the rows that see it; past the route (a dense kernel's launch) nothing is kept there
    # and every call goes through the views; with autograd, gradients as through the views.
    import importlib

    attention_ops = importlib.import_module("flashlse.ops.attention")
    g = torch.Generator().manual_seed(31)
    dt = DTYPES[0]
    q, k, v = (torch.randn(2, h, s, 32, generator=g).to(device, dt)
               for h, s in ((4, sq), (2, 50), (2, 50)))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    kw = dict(causal=True, scale=0.2)
    bad = k.clone()
    bad[1, 0, 45, 3] = float("nan")  # batch 1, kv head 0: its query heads 0-1
    for kk, vv in ((k, k), (k, v), (k, k), (k, v), (bad, v)):
        got = attention_ops.attention_heads_first(q, kk, vv, **kw)
        want = fl.attention(t(q), t(kk), t(vv), **kw)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        ref = reference.attention(t(q).double(), t(kk).double(), t(vv).double(), **kw)
        torch.testing.assert_close(got.double().nan_to_num(), ref.nan_to_num(), atol=2e-3,
                                   rtol=2e-3)
        assert torch.equal(got.isnan(), ref.isnan())
    assert got.isnan().any()  # (the last call's NaN key reached its rows)
    assert bool(attention_ops._HEADS_FIRST) == (sq <= dispatch.SHORT_Q_WIDE_MAX)
    assert bool(decode_calls) == (sq <= dispatch.SHORT_Q_WIDE_MAX)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    attention_ops.attention_heads_first(qg, kg, vg, **kw).sum().backward()
    qw, kw2, vw = (x.clone().requires_grad_() for x in (q, k, v))
    fl.attention(t(qw), t(kw2), t(vw), **kw).sum().backward()
    for a, b in ((qg, qw), (kg, kw2), (vg, vw)):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("unread", [True, False], ids=["unread_lse", "fresh_lse"])
def test_attention_heads_first_empty_rows(device, monkeypatch, decode_calls, unread):
    # The LSE contract on the (B, H, S, D) entry, its kept launch included (three calls):
    # causal Sq = 5 > Sk = 3, so rows 0-1 see no key: out 0 there, no NaN; a -inf sink is no
    # sink, a finite one is the reference's; gradients through the empty rows are zero for
    # their q, never NaN. With the kept lse off (dispatch.UNREAD_LSE) too: the outputs' shapes
    # are the entry's, not its tensors' layout.
    import importlib

    attention_ops = importlib.import_module("flashlse.ops.attention")
    monkeypatch.setattr(dispatch, "UNREAD_LSE", unread)
    g = torch.Generator().manual_seed(41)
    dt = DTYPES[0]
    q, k, v = (torch.randn(2, h, s, 32, generator=g).to(device, dt)
               for h, s in ((4, 5), (2, 3), (2, 3)))  # (Sq != Hq: a layout mix-up shows)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    sink = torch.randn(4, generator=g).to(device)
    for s_ in (None, torch.full((4,), float("-inf"), device=device), sink):
        want = reference.attention(t(q).double(), t(k).double(), t(v).double(), causal=True,
                                   sink=None if s_ is None else s_.double())
        for _ in range(3):
            got = attention_ops.attention_heads_first(q, k, v, causal=True, sink=s_)
            assert got.shape == (2, 5, 4, 32) and not got.isnan().any()
            torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
            assert (got[:, :2] == 0).all()
    assert attention_ops._HEADS_FIRST and decode_calls
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    attention_ops.attention_heads_first(qg, kg, vg, causal=True).sum().backward()
    for x in (qg, kg, vg):
        assert not x.grad.isnan().any()
    assert (qg.grad[:, :, :2] == 0).all()


def test_short_query_gradients(device, decode_calls):
    # The forward on the decode kernel, the backward on the kernels' backward from its lse.
    g = torch.Generator().manual_seed(5)
    dt = DTYPES[0]
    q, k, v = (torch.randn(2, s, h, 32, generator=g).to(device, dt).requires_grad_()
               for s, h in ((3, 4), (20, 2), (20, 2)))
    sink = torch.randn(4, generator=g).to(device).requires_grad_()
    out, lse = fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert decode_calls
    refs = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    r_out, r_lse = reference.attention(*refs[:3], causal=True, sink=refs[3], return_lse=True)
    torch.autograd.backward((r_out, r_lse), (dout.double(), dlse.double()))
    tol = dict(atol=5e-3, rtol=5e-3) if dt == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double(), r_out.detach(), **tol)
    for got, want in zip((q, k, v, sink), refs):
        assert not torch.isnan(got.grad).any()
        torch.testing.assert_close(got.grad.double(), want.grad, **tol)
    assert torch.isfinite(lse.detach()).all()


def test_short_query_lse_contract(device, decode_calls):
    # On the route: a -inf sink is no sink (empty rows (0, -inf) either way), a NaN key
    # reaches exactly the rows that see it (its batch, its kv head's query heads, the rows
    # whose causal range holds it), and gradients through empty rows are zero, never NaN.
    q, k, v = _qkv(device, 11, 2, 4, 3, 4, 2)
    none = fl.attention(q, k, v, causal=True, return_lse=True)
    neg = fl.attention(q, k, v, causal=True, return_lse=True,
                       sink=torch.full((4,), float("-inf"), device=device))
    assert torch.equal(none[0], neg[0]) and torch.equal(none[1], neg[1])
    # Causal, Sq = 4 > Sk = 3: row 0 sees no key.
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), causal=True,
                                         return_lse=True)
    assert torch.equal(torch.isneginf(none[1]), torch.isneginf(want_lse))
    assert torch.isneginf(none[1][:, :, 0]).all() and (none[0][:, 0] == 0).all()
    bad = k.clone()
    bad[1, 2, 0, 5] = float("nan")  # key 2 of batch 1, kv head 0: rows 3 (sees keys 0-2)
    out, lse = fl.attention(q, bad, v, causal=True, return_lse=True)
    nan_rows = torch.zeros(2, 4, 4, dtype=torch.bool)
    nan_rows[1, 3, :2] = True
    assert torch.equal(out.isnan().any(-1).cpu(), nan_rows)
    assert torch.equal(lse.isnan().cpu(), nan_rows.permute(0, 2, 1))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fl.attention(qg, kg, vg, causal=True).sum().backward()
    assert decode_calls
    for t in (qg, kg, vg):
        assert not torch.isnan(t.grad).any()
    assert (qg.grad[:, 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("b,sq,sk", [(1, 1, 40000), (4, 5, 3000)])
def test_short_query_sync_free_and_graph_replay(decode_calls, b, sq, sk):
    # The route on the GPU (bf16, 32 / 8 heads, D = 128, split keys): no host-device sync
    # (sync-debug "error"), the reference within bf16 tolerance, and a CUDA graph of the call
    # replayed on new inputs giving the eager call's bits.
    from test_cuda_graphs import _replay_equals_eager
    from test_sync_free import sync_free

    torch.manual_seed(7)
    q = torch.randn(b, sq, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sink = torch.randn(32, device="cuda")

    def step():
        with torch.no_grad():
            return fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)

    out, lse = sync_free(step)
    assert decode_calls
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), causal=True,
                                         sink=sink.double(), return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2, rtol=2e-2)

    def change():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))

    out, lse = _replay_equals_eager(step, change)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
