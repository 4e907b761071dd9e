"""The split-KV decode with the merge done by each row tile's last split
(``kernels.decode.FUSED_MERGE``, ``_merge_if_last``) against the merge kernel after the splits.

Both run the same merge steps in the same order, so their outputs are equal bit for bit.
Here: the fused form against the float64 reference and equal to the two-kernel form on
fresh data (NaN inputs included), the counters put back to 0 after every call, and on a
GPU the memory ordering under many calls, two streams at once and CUDA-graph capture
(which takes the merge kernel)."""

from __future__ import annotations

import math

import pytest
import torch
from test_decode import _check, _dtypes, _make, kept_unread_lse

import flashlse as fl
from flashlse import kernel_options
from flashlse.kernels import decode

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _fused_at_any_split_count(monkeypatch):
    # The fused form at every split count here (the default takes it up to
    # FUSED_MERGE_MAX_SPLITS: test_fused_merge_split_limit).
    monkeypatch.setattr(decode, "FUSED_MERGE_MAX_SPLITS", 1 << 30)


def _run(monkeypatch, fused: bool, q, k, v, lens, table, **kw):
    monkeypatch.setattr(decode, "FUSED_MERGE", fused)
    monkeypatch.setattr(decode, "_PLANS", {})
    kw.setdefault("left", None)
    kw.setdefault("right", None)
    kw.setdefault("sink", None)
    return decode.decode_fwd(q, k, v, cache_seqlens=lens, block_table=table, softcap=0.0,
                             scale=1.0 / math.sqrt(q.shape[-1]), **kw)


def _counters_zero(device) -> bool:
    return all(int(sc.counters.abs().sum()) == 0 for key, sc in decode._SCRATCH.items()
               if key[0].type == torch.device(device).type)


CASES = [
    pytest.param(dict(), dict(num_splits=3), id="splits3"),
    pytest.param(dict(sq=2), dict(num_splits=57, right=0), id="splits57_causal"),
    pytest.param(dict(lens=(0, 0)), dict(num_splits=3), id="empty_caches"),
    pytest.param(dict(sq=3, lens=(50, 97)), dict(left=20, right=1, num_splits=3), id="window"),
    pytest.param(dict(hq=8, hkv=2, d=59, dv=40), dict(num_splits=2), id="gqa_odd_dims"),
    pytest.param(dict(sq=16, hq=4, hkv=1, lens=(40, 77)), dict(num_splits=3, right=0),
                 id="row_tiles"),
    pytest.param(dict(page_size=16, lens=(0, 100)), dict(num_splits=4), id="paged16"),
    pytest.param(dict(hq=8, hkv=1, d=64, dv=32, mla=True), dict(num_splits=3), id="mla_like"),
]


@pytest.mark.parametrize("make_kw, call_kw", CASES)
@pytest.mark.parametrize("sink", [False, True])
def test_fused_merge_equals_merge_kernel(device, monkeypatch, make_kw, call_kw, sink):
    dtype = _dtypes()[1 if "page_size" in make_kw else 0]
    q, k, v, lens, table, _, _ = _make(device, dtype, **make_kw)
    s = torch.randn(q.shape[2], device=device) if sink else None
    fused = _run(monkeypatch, True, q, k, v, lens, table, sink=s, **call_kw)
    plain = _run(monkeypatch, False, q, k, v, lens, table, sink=s, **call_kw)
    assert not torch.isnan(fused[0]).any() and not torch.isnan(fused[1]).any()
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert _counters_zero(device), "a counter was not put back to 0"


@pytest.mark.parametrize("sink_kind", ["random", "neg_inf"])
def test_fused_merge_matches_reference(device, monkeypatch, sink_kind):
    # The fused form against the float64 reference: a sink (a -inf sink is no sink: the
    # empty cache's rows then give out 0, lse -inf), empty and full caches, more splits than
    # tiles; _check asserts the -inf pattern, out == 0 on empty rows and no NaN.
    monkeypatch.setattr(decode, "FUSED_MERGE", True)
    monkeypatch.setattr(decode, "_PLANS", {})
    q, k, v, lens, table, k_ref, v_ref = _make(device, _dtypes()[0], sq=2, lens=(0, 100))
    plan = decode.find_plan(q, k, v, cache_seqlens=lens, block_table=None, left=None, right=0,
                            softcap=0.0, scale=0.1, sink=None, num_splits=9)[1]
    assert plan.fused_run is not None
    sink = (torch.randn(q.shape[2], device=device) if sink_kind == "random" else
            torch.full((q.shape[2],), float("-inf"), device=device))
    _, lse = _check(q, k, v, lens, table, k_ref, v_ref, causal=True, num_splits=9, sink=sink)
    if sink_kind == "neg_inf":
        assert torch.isneginf(lse[0]).all()


def test_fused_merge_nan_reaches_its_rows_only(device, monkeypatch):
    # A NaN key of sequence 1 in one split: NaN in exactly sequence 1's rows (every head of
    # the kv head that reads it), as the merge kernel gives; sequence 0 stays finite.
    q, k, v, lens, table, _, _ = _make(device, _dtypes()[0], b=2, hq=4, hkv=2, lens=(60, 100))
    k[1, 70, 0, 3] = float("nan")
    fused = _run(monkeypatch, True, q, k, v, lens, table, num_splits=4)
    plain = _run(monkeypatch, False, q, k, v, lens, table, num_splits=4)
    assert torch.isnan(fused[0][1, :, :2]).all() and torch.isnan(fused[1][1, :2]).all()
    assert torch.isfinite(fused[0][0]).all() and torch.isfinite(fused[1][1, 2:]).all()
    assert torch.equal(torch.isnan(fused[0]), torch.isnan(plain[0]))
    assert torch.equal(torch.isnan(fused[1]), torch.isnan(plain[1]))
    assert torch.equal(torch.nan_to_num(fused[0]), torch.nan_to_num(plain[0]))
    assert _counters_zero(device)


def test_fused_merge_one_split_and_mla_kernel_take_no_counters(device, monkeypatch):
    monkeypatch.setattr(decode, "FUSED_MERGE", True)
    monkeypatch.setattr(decode, "_PLANS", {})
    q, k, v, lens, _, _, _ = _make(device, _dtypes()[0])
    kw = dict(cache_seqlens=lens, block_table=None, left=None, right=None, softcap=0.0,
              scale=0.1, sink=None)
    assert decode.find_plan(q, k, v, num_splits=1, **kw)[1].fused_run is None
    assert decode.find_plan(q, k, v, num_splits=2, **kw)[1].fused_run is not None


def test_fused_merge_split_limit(device, monkeypatch):
    # By default the fused form takes calls of 2 to FUSED_MERGE_MAX_SPLITS splits (above, the
    # merge kernel: the fused merge cost device time at 32 splits, NOTES.md session 46); never
    # sparse_attention's token-table form when FUSED_MERGE_TOKEN_TABLE is off.
    monkeypatch.setattr(decode, "FUSED_MERGE_MAX_SPLITS", 8)
    monkeypatch.setattr(decode, "FUSED_MERGE_TOKEN_TABLE", False)
    # (Without the split floor: 128 listed keys are one split of 8 tiles with it.)
    monkeypatch.setattr(decode, "SPLIT_FLOOR", False)
    monkeypatch.setattr(decode, "_PLANS", {})
    q, k, v, lens, _, _, _ = _make(device, _dtypes()[0], smax=640, lens=(300, 640))
    kw = dict(cache_seqlens=lens, block_table=None, left=None, right=None, softcap=0.0,
              scale=0.1, sink=None)
    assert decode.FUSED_MERGE
    assert decode.find_plan(q, k, v, num_splits=8, **kw)[1].fused_run is not None
    plan = decode.find_plan(q, k, v, num_splits=9, **kw)[1]
    assert plan.fused_run is None and plan.merge is not None
    # sparse_attention's top-k lists (the decode kernel's token table), 128 keys listed: split.
    monkeypatch.setattr(decode, "_PLANS", {})
    qs = torch.randn(1, 1, 4, 32, device=device, dtype=_dtypes()[0])
    ks = torch.randn(1, 200, 1, 32, device=device, dtype=_dtypes()[0])
    idx = torch.randperm(200, device=device)[:128].to(torch.int32).view(1, 1, 1, 128)
    fl.sparse_attention(qs, ks, ks, idx)
    plans = list(decode._PLANS.values())
    assert plans and all(p.fused_run is None for p in plans)
    assert any(p.merge is not None for p in plans)


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged4"])
@pytest.mark.parametrize("sink", [False, True])
def test_fused_merge_token_table(device, monkeypatch, paged, sink):
    # sparse_attention's top-k lists on the fused form (FUSED_MERGE_TOKEN_TABLE): equal bit
    # for bit to the merge kernel's, against the float64 reference, with an all -1 row
    # (empty: out 0, lse -inf or the sink), a NaN key listed by exactly one row (NaN there
    # only), and the counters back at 0.
    import importlib

    from flashlse import reference as R

    sparse_ops = importlib.import_module("flashlse.ops.sparse")
    g = torch.Generator().manual_seed(47)
    dt = _dtypes()[0]
    b, sq, hq, hkv, d, sk, topk = 2, 2, 4, 2, 32, 300, 160
    q = torch.randn(b, sq, hq, d, generator=g).to(device, dt)
    k = torch.randn(b, sk, hkv, d, generator=g).to(device, dt)
    v = torch.randn(b, sk, hkv, d, generator=g).to(device, dt)
    idx = torch.stack([torch.randperm(sk - 1, generator=g)[:topk]
                       for _ in range(b * sq * hkv)]).view(b, sq, hkv, topk).to(torch.int32)
    idx[0, 1, 0] = -1  # an empty row
    idx[1, 0, 1, 7] = sk - 1  # the only listing of key sk - 1
    k[1, sk - 1, 1, 5] = float("nan")
    idx = idx.to(device)
    s = torch.randn(hq, generator=g).to(device) if sink else None
    kw = dict(scale=0.1, sink=s, return_lse=True)
    if paged:  # pages of 4 rows in a shuffled table
        pages = sk // 4
        perm = torch.randperm(b * pages, generator=g)
        kp = torch.empty(b * pages, 4, hkv, d, dtype=dt, device=device)
        vp = torch.empty_like(kp)
        kp[perm] = k.reshape(b * pages, 4, hkv, d)
        vp[perm] = v.reshape(b * pages, 4, hkv, d)
        args = (q, kp, vp, idx)
        kw["block_table"] = perm.view(b, pages).to(device, torch.int32)
    else:
        args = (q, k, v, idx)
    monkeypatch.setattr(decode, "FUSED_MERGE_MAX_SPLITS", 8)
    # (Without the split floor: 160 listed keys are one split of 8 tiles with it, and these
    # tests are of the splits' merge.)
    monkeypatch.setattr(decode, "SPLIT_FLOOR", False)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(decode, "FUSED_MERGE_TOKEN_TABLE", fused)
        monkeypatch.setattr(decode, "_PLANS", {})
        monkeypatch.setattr(sparse_ops, "_PLANS", {})  # (its kept decode plans)
        with fl.value_checks(False):
            got[fused] = fl.sparse_attention(*args, **kw)
        plans = list(decode._PLANS.values())
        assert plans and all((p.fused_run is not None) == fused for p in plans), fused
        assert any(p.merge is not None for p in plans)
    (out, lse), (out0, lse0) = got[True], got[False]
    assert torch.equal(out.isnan(), out0.isnan()) and torch.equal(lse.isnan(), lse0.isnan())
    assert torch.equal(out.nan_to_num(), out0.nan_to_num())
    assert torch.equal(lse.nan_to_num(), lse0.nan_to_num())
    assert _counters_zero(device)
    # NaN exactly where the NaN key is listed: sequence 1, query row 0, kv head 1's heads.
    nan_rows = torch.zeros(b, sq, hq, dtype=torch.bool)
    nan_rows[1, 0, 2:] = True
    assert torch.equal(out.isnan().any(-1).cpu(), nan_rows)
    assert torch.equal(lse.isnan().cpu(), nan_rows.permute(0, 2, 1))
    k_ref = k.double()
    want, want_lse = R.sparse_attention(q.double(), k_ref, v.double(), idx, scale=0.1,
                                        sink=None if s is None else s.double(),
                                        return_lse=True)
    ok = ~nan_rows.to(device)
    tol = 2e-3 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(out[ok].double(), want[ok], atol=tol, rtol=tol)
    torch.testing.assert_close(lse.permute(0, 2, 1)[ok].double(),
                               want_lse.permute(0, 2, 1)[ok], atol=tol, rtol=tol)
    if not sink:  # the empty row: out 0, lse -inf
        assert (out[0, 1, :2] == 0).all() and torch.isneginf(lse[0, :2, 1]).all()


@pytest.mark.parametrize("splits", [1, 3, 12])
def test_unread_lse_on_kept_scratch(device, monkeypatch, kernel_opts, splits):
    # A kept decode without return_lse writes its lse to the stream's kept buffer (one
    # allocation less): out equal to the return_lse call's, every split form (one split, the
    # fused merge, the merge kernel); with return_lse each call's lse is its own tensor.
    # (Value checks off: on the CPU they read the lengths, which takes the full path.)
    kernel_opts(poison_outputs=False)
    monkeypatch.setattr(decode, "FUSED_MERGE_MAX_SPLITS", 8)
    monkeypatch.setattr(decode, "_SCRATCH", {})
    q, k, v, lens, _, _, _ = _make(device, _dtypes()[0], smax=640, lens=(300, 640))
    kw = dict(cache_seqlens=lens, num_splits=splits, causal=True)
    with fl.value_checks(False):
        want, want_lse = fl.attention_with_kvcache(q, k, v, return_lse=True, **kw)
        for _ in range(3):  # (the first call plans, the rest take the kept plan)
            out = fl.attention_with_kvcache(q, k, v, **kw)
            assert torch.equal(out, want)
        unread = kept_unread_lse(want_lse)
        got, lse = fl.attention_with_kvcache(q, k, v, return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert lse.untyped_storage().data_ptr() != unread.untyped_storage().data_ptr()


def test_scratch_grows_and_counters_stay_zero(device, monkeypatch):
    # A call with more row tiles than the counters hold, or more partial state than the
    # kept buffer, gets larger ones (counters zeroed); the views are the buffer's, 16-byte
    # aligned; under poison_outputs the partial states are fresh (NaN) tensors.
    monkeypatch.setattr(decode, "_SCRATCH", {})
    dev = torch.device(device)
    c1, o1, l1 = decode._scratch(dev, 8, (3, 1, 1, 5, 33), torch.empty)
    assert int(c1.abs().sum()) == 0 and c1.dtype == torch.int32 and c1.numel() >= 8
    assert o1.shape == (3, 1, 1, 5, 33) and l1.shape == (3, 1, 1, 5)
    assert l1.data_ptr() % 16 == 0 and o1.untyped_storage().data_ptr() == \
        l1.untyped_storage().data_ptr()
    c2, o2, l2 = decode._scratch(dev, c1.numel() + 1, (3, 1, 1, 5, 33), torch.empty)
    assert c2.numel() > c1.numel() and int(c2.abs().sum()) == 0 and o2 is o1
    c3, o3, _ = decode._scratch(dev, 8, (4, 2, 1, 8, 64), torch.empty)
    assert c3 is c2 and o3.untyped_storage().data_ptr() != o1.untyped_storage().data_ptr()
    monkeypatch.setattr(decode, "SCRATCH_MAX_VALUES", 16)
    _, o4, _ = decode._scratch(dev, 8, (2, 1, 1, 4, 64), torch.empty)
    assert o4.untyped_storage().data_ptr() != o3.untyped_storage().data_ptr()
    _, o5, _ = decode._scratch(dev, 8, (3, 1, 1, 5, 33), lambda *a, **k: torch.full(
        *a, float("nan"), **k))
    assert torch.isnan(o5).all()


def test_scratch_is_per_thread(device, monkeypatch):
    # Two threads on one stream could interleave one call's split and merge launches with the
    # other's: each thread has its own partial states (and counters).
    import threading

    monkeypatch.setattr(decode, "_SCRATCH", {})
    dev = torch.device(device)
    mine = decode._scratch(dev, 8, (2, 1, 1, 4, 32), torch.empty)
    got = []
    t = threading.Thread(target=lambda: got.append(decode._scratch(dev, 8, (2, 1, 1, 4, 32),
                                                                   torch.empty)))
    t.start()
    t.join()
    assert got[0][1].data_ptr() != mine[1].data_ptr() and got[0][0] is not mine[0]
    assert decode._scratch(dev, 8, (2, 1, 1, 4, 32), torch.empty)[1] is mine[1]


def test_kept_scratch_calls_in_a_row(device, monkeypatch, kernel_opts):
    # Without poisoned outputs a split call's partial states are the stream's kept buffer,
    # left as the previous call wrote it: calls of several shapes and lengths in a row, fused
    # and with the merge kernel, each equal the merge kernel's on fresh NaN-filled partials.
    kernel_opts(poison_outputs=False)
    monkeypatch.setattr(decode, "_SCRATCH", {})
    draws = [dict(lens=(37, 100)), dict(lens=(0, 5)), dict(sq=2, lens=(100, 1)),
             dict(hq=8, hkv=2, lens=(64, 64)), dict(lens=(37, 100))]
    for i, make_kw in enumerate(draws):
        q, k, v, lens, table, _, _ = _make(device, _dtypes()[0], **make_kw)
        kw = dict(num_splits=3 + i % 2, right=0 if i % 2 else None)
        with kernel_options(poison_outputs=True):
            want = _run(monkeypatch, False, q, k, v, lens, table, **kw)
        for fused in (True, False):
            got = _run(monkeypatch, fused, q, k, v, lens, table, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (make_kw, fused)
    assert len(decode._SCRATCH) == 1 and decode._SCRATCH[next(iter(decode._SCRATCH))].buf \
        is not None
    assert _counters_zero(device)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_kept_scratch_many_calls_and_two_streams(monkeypatch, kernel_opts, fused):
    # Memory ordering on the GPU, on the kept scratch (no poisoned outputs): hundreds of
    # split calls back to back (the fused merge reads partial states other programs wrote
    # moments before; the merge kernel reads the buffer the next call's split kernel
    # writes), then two streams at once with their own scratch; every result equals the
    # merge kernel's on fresh partials.
    torch.manual_seed(0)
    dev = "cuda"
    b, hq, hkv, d, smax = 4, 32, 8, 128, 8192
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, smax, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, smax, hkv, d, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor([8192, 1, 0, 5000], dtype=torch.int32, device=dev)
    want = _run(monkeypatch, False, q, k, v, lens, None, num_splits=0)
    kernel_opts(poison_outputs=False)
    monkeypatch.setattr(decode, "FUSED_MERGE", fused)
    monkeypatch.setattr(decode, "_PLANS", {})
    kw = dict(cache_seqlens=lens, block_table=None, left=None, right=None, softcap=0.0,
              scale=1.0 / math.sqrt(d), sink=None, num_splits=0)
    plan = decode.find_plan(q, k, v, **kw)[1]
    assert plan.merge is not None and (plan.fused_run is not None) == fused
    outs = [decode.decode_fwd(q, k, v, **kw) for _ in range(300)]
    for out, lse in outs:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    streams = [torch.cuda.Stream() for _ in range(2)]
    got = [[], []]
    for _ in range(50):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(decode.decode_fwd(q, k, v, **kw))
    torch.cuda.synchronize()
    for out, lse in got[0] + got[1]:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert _counters_zero(dev)


@pytest.mark.gpu
def test_fused_merge_graph_capture(monkeypatch, kernel_opts):
    # Under capture the merge kernel runs on partials of the graph's own (kept scratch would
    # be shared with eager calls); the replays equal the eager fused calls on kept scratch.
    kernel_opts(poison_outputs=False)
    monkeypatch.setattr(decode, "FUSED_MERGE", True)
    monkeypatch.setattr(decode, "_PLANS", {})
    dev = "cuda"
    q = torch.randn(2, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(2, 4096, 8, 128, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor([4096, 333], dtype=torch.int32, device=dev)
    kw = dict(cache_seqlens=lens, block_table=None, left=None, right=None, softcap=0.0,
              scale=0.088, sink=None, num_splits=0)
    eager = decode.decode_fwd(q, k, k, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode.decode_fwd(q, k, k, **kw)
    torch.cuda.current_stream().wait_stream(s)
    before = dict(decode._SCRATCH)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = decode.decode_fwd(q, k, k, **kw)
    assert decode._SCRATCH.keys() == before.keys()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed[0], eager[0]) and torch.equal(graphed[1], eager[1])
