"""Paged ``attention_varlen`` calls of mixed sequences (a serving step: prefill chunks beside
decodes) whose sequences of at most ``fwd.SMALL_ROWS`` packed rows run the split-KV decode
kernel in its packed form (``dispatch.SMALL_DECODE``, ``decode.packed_fwd``: each program
reads its sequence's rows from ``cu_seqlens_q``), the longer ones the paged kernels; and the
same calls with the route off, each against the float64 reference (``run_paged``: shuffled
pages, unused slots NaN, so a read past a length fails). Under ``TRITON_INTERPRET=1`` (CI) the
tensors are on the CPU; on a GPU on CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_attention_varlen import PAGED, run_paged
from test_cuda_graphs import _capture
from test_varlen_paged_decode import random_call

import flashlse as fl
from flashlse import reference as R
from flashlse.kernels import decode, dispatch, fwd

HAS_CUDA = torch.cuda.is_available()
DTYPE = torch.float16 if HAS_CUDA else torch.float32


# (batch, max_rows) of each decode.packed_fwd call: which kernel took the short sequences.
CALLS: list = []


def _packed_calls() -> list:
    return list(CALLS)


@pytest.fixture(autouse=True)
def _spy(monkeypatch):
    real = decode.packed_fwd

    def spy(q, k_cache, v_cache, block_table, cu_seqlens_q, *args, **kw):
        CALLS.append((cu_seqlens_q.shape[0] - 1, kw["max_rows"]))
        return real(q, k_cache, v_cache, block_table, cu_seqlens_q, *args, **kw)

    CALLS.clear()
    monkeypatch.setattr(decode, "packed_fwd", spy)


@pytest.mark.parametrize("route", [True, False], ids=["decode", "paged"])
@pytest.mark.parametrize("page", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("qlens,klens,kw", PAGED)
def test_varlen_paged_mixed_on_either_kernel(device, monkeypatch, qlens, klens, kw, page, route):
    monkeypatch.setattr(dispatch, "SMALL_DECODE", route)
    monkeypatch.setattr(dispatch, "PAGED_DECODE", False)
    run_paged(device, DTYPE, qlens, klens, page, **kw)
    group = kw.get("hq", 4) // kw.get("hkv", 2)
    # Which kernel took the short sequences: a packed decode plan, with the route only.
    assert bool(_packed_calls()) == (route and min(qlens) * group <= fwd.SMALL_ROWS)


@pytest.mark.parametrize("override", [False, True], ids=["", "fwd_config"])
@pytest.mark.parametrize("wide", [True, False], ids=["wide", "narrow"])
@pytest.mark.parametrize("hq,hkv", [(24, 1), (64, 2)], ids=["g24", "g32"])
def test_varlen_paged_mixed_wide_groups(device, monkeypatch, kernel_opts, hq, hkv, wide,
                                        override):
    # Groups of more than SMALL_ROWS heads (MQA): with SMALL_DECODE_WIDE a sequence of one
    # query row (G packed rows) runs the packed decode form, sequences of 2+ rows the long
    # kernels (rows_lo = G on both sides), empty and zero-row sequences among them; without
    # it, or under a forward tile override (no decode kernel then: the threshold stays the
    # portable kernel's, on the Hopper kernel too), every sequence takes the long kernels.
    # Against the reference, causal with a sink.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    monkeypatch.setattr(dispatch, "SMALL_DECODE_WIDE", wide)
    monkeypatch.setattr(dispatch, "PAGED_DECODE", False)
    if override:
        kernel_opts(fwd_config={"BLOCK_N": 32})
    run_paged(device, DTYPE, [3, 1, 0, 1, 2, 1], [40, 33, 7, 0, 2, 18], 8, hq=hq, hkv=hkv,
              causal=True, sink=True)
    assert _packed_calls() == ([(6, 1)] if wide and not override else [])


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_varlen_paged_mixed_split_counts(device, monkeypatch, splits):
    # The fused merge writes the packed rows at every split count the route plans (one
    # included: the merge of one state, the sink added there once).
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    real = decode._decode_plan

    made = []

    def forced(*args, **kw):
        if kw.get("packed"):
            args = list(args)
            args[10] = splits  # num_splits
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(decode, "_decode_plan", forced)
    # (600 keys: at least 8 tiles, so that the forced count is not cut to the tiles.)
    run_paged(device, DTYPE, [6, 1, 2, 1, 0], [40, 600, 9, 0, 5], 4, hq=4, hkv=2, causal=True,
              sink=True)
    assert CALLS and made and all(p.grid[1] == splits for p in made)


@pytest.mark.parametrize("seed", range(16))
def test_varlen_paged_mixed_fuzz(device, monkeypatch, seed):
    # Random mixed calls (long and short sequences, zero-row sequences, empty caches, masks,
    # softcap, sinks, GQA / MQA / MHA, pages) on both routes against the reference.
    gen = random.Random(seed)
    hkv = gen.choice([1, 2])
    group = gen.choice([1, 2, 4])
    b = gen.randint(1, 5)
    qlens = [gen.choice([0, 1, 1, 2, gen.randint(1, 24)]) for _ in range(b)]
    klens = [gen.choice([0, gen.randint(1, 8), gen.randint(8, 50)]) for _ in range(b)]
    kw, page = random_call(gen, hkv * group, hkv)
    if max(qlens) == 0:
        qlens[0] = 1
    for route in (True, False):
        monkeypatch.setattr(dispatch, "SMALL_DECODE", route)
        run_paged(device, DTYPE, qlens, klens, page, seed=seed, **kw)


def test_varlen_paged_mixed_bad_cu_seqlens_stay_inside(device, monkeypatch):
    # With the value checks off, cu_seqlens_q out of order or out of range: each launch clamps
    # a sequence's rows inside the packed rows (seq_span); nothing is read or written outside
    # q / out (poisoned tails of a larger buffer stay NaN), nothing crashes.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, page = 4, 2, 16, 4
    kc = torch.randn(8, page, hkv, d, generator=g).to(device, DTYPE)
    table = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32, device=device)
    used = torch.tensor([8, 3, 0, 5], dtype=torch.int32, device=device)
    q = torch.randn(7, hq, d, generator=g).to(device, DTYPE)
    for bad in ([0, 5, -3, 1000, 7], [0, 7, 6, 6, 1 << 30], [-9, 1, 2, 3, 4]):
        cu = torch.tensor(bad, dtype=torch.int32, device=device)
        with torch.no_grad(), fl.value_checks(False):
            out, lse = fl.attention_varlen(q, kc, kc, cu, None, 4, 8, seqused_k=used,
                                           block_table=table, causal=True, return_lse=True)
        assert out.shape == (7, hq, d) and lse.shape == (hq, 7)
    assert _packed_calls()


def test_varlen_paged_mixed_plan_is_free_of_total_q(device, monkeypatch):
    # A serving engine's steps change the packed rows every call: one plan serves them (the
    # head stride of lse and the row count are passed to each launch), kept in the public
    # call's plans, and without those in decode._PLANS.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    monkeypatch.setattr(decode, "_PLANS", {})
    made = []
    real = decode._decode_plan
    monkeypatch.setattr(decode, "_decode_plan", lambda *a, **k: made.append(k) or real(*a, **k))
    for qlens in ([9, 1, 1], [12, 1, 1], [10, 2, 1]):
        run_paged(device, DTYPE, qlens, [20, 30, 7], 4, causal=True)
    assert CALLS == [(3, 8)] * 3 and len(made) == 1  # max_rows: min(16 // 2, max_seqlen_q)
    q = torch.randn(14, 4, 16, device=device)
    kc = torch.randn(4, 4, 2, 16, device=device)
    table = torch.tensor([[0], [1], [2]], dtype=torch.int32, device=device)
    used = torch.tensor([4, 3, 2], dtype=torch.int32, device=device)
    before = len(decode._PLANS)  # (a public call's first, full path keeps its plan there)
    for rows in ([0, 12, 13, 14], [0, 10, 11, 12]):
        cu = torch.tensor(rows, dtype=torch.int32, device=device)
        out, lse = fwd.new_outputs(q[:rows[-1]], kc, cu)
        decode.packed_fwd(q[:rows[-1]], kc, kc, table, cu, used, out, lse, max_rows=1,
                          left=None, right=0, softcap=0.0, scale=0.25, sink=None)
    assert len(made) == 2 and len(decode._PLANS) == before + 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_paged_mixed_real_size(monkeypatch, dtype):
    # A serving step at real sizes (32 / 8 heads, D = 128, pages of 64): a 200-row chunk
    # beside decodes and a 3-row verification on thousands of keys (several splits a decode),
    # on the Hopper paged kernel where it runs, against the reference.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    run_paged("cuda", dtype, [200, 1, 1, 3, 1], [3000, 5000, 700, 4100, 0], 64, hq=32, hkv=8,
              d=128, dv=128, causal=True, sink=True)
    assert _packed_calls()


@pytest.mark.gpu
def test_varlen_paged_mixed_graph_replay_and_sync_free(monkeypatch):
    # Captured into a CUDA graph (fresh zero counters and partial states of its own) and
    # replayed on new queries and lengths: the eager call's bits; and no host sync eagerly.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    torch.manual_seed(6)
    hq, hkv, d, page = 16, 4, 128, 16
    kc = torch.randn(64, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(64, device="cuda", dtype=torch.int32).view(4, 16)
    used = torch.tensor([200, 31, 250, 7], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 40, 41, 43, 44], dtype=torch.int32, device="cuda")
    q = torch.randn(44, hq, d, device="cuda", dtype=torch.bfloat16)

    def step():
        return fl.attention_varlen(q, kc, vc, cu, None, 40, 256, seqused_k=used,
                                   block_table=table, causal=True, return_lse=True)

    graph, (out, lse) = _capture(step)
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
        used.sub_(3)
    graph.replay()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        want_out, want_lse = step()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert _packed_calls()


def test_varlen_paged_mixed_empty_rows_and_neg_inf_sink(device, monkeypatch):
    # The LSE contract on the packed route: a decode on an empty cache and rows before their
    # diagonal (3 rows on 1 key) see no key: out 0 and lse -inf, or lse == the sink; a -inf
    # sink is no sink (bit for bit the call without one), no NaN anywhere.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, page = 4, 2, 16, 4
    kc = torch.randn(12, page, hkv, d, generator=g).to(device, DTYPE)
    vc = torch.randn(12, page, hkv, d, generator=g).to(device, DTYPE)
    table = torch.arange(12, dtype=torch.int32, device=device).view(3, 4)
    used = torch.tensor([13, 0, 1], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 9, 10, 13], dtype=torch.int32, device=device)
    q = torch.randn(13, hq, d, generator=g).to(device, DTYPE)
    sink = torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0], device=device)

    def call(s):
        with torch.no_grad(), fl.value_checks(False):
            return fl.attention_varlen(q, kc, vc, cu, None, 9, 16, seqused_k=used,
                                       block_table=table, causal=True, sink=s, return_lse=True)

    out0, lse0 = call(None)
    out, lse = call(sink)
    assert CALLS and not torch.isnan(out).any() and not torch.isnan(lse).any()
    # Empty rows: the decode on no key (row 9), the 3-row sequence's first two (rows 10, 11).
    for r in (9, 10, 11):
        assert bool((out0[r] == 0).all()) and bool(torch.isneginf(lse0[:, r]).all())
        assert bool((out[r] == 0).all())
        torch.testing.assert_close(lse[:, r], torch.where(torch.isneginf(sink), lse0[:, r],
                                                           sink), rtol=0, atol=0)
    # Heads with a -inf sink: the no-sink call's bits; the row with keys agrees with the
    # float64 reference.
    for h in (0, 2):
        torch.testing.assert_close(out[:, h], out0[:, h], rtol=0, atol=0)
        torch.testing.assert_close(lse[h], lse0[h], rtol=0, atol=0)
    ref_out, ref_lse = R.attention_varlen(
        q.cpu().double(), kc.cpu().double(), vc.cpu().double(), cu.cpu(), None, 9, 16,
        seqused_k=used.cpu(), block_table=table.cpu(), causal=True, sink=sink.cpu().double(),
        return_lse=True)
    torch.testing.assert_close(out[9:].cpu().double(), ref_out[9:], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse[:, 9:].cpu().double(), ref_lse[:, 9:], atol=2e-3, rtol=2e-3)


def test_varlen_paged_mixed_wide_lse_contract_and_nan(device, monkeypatch):
    # SMALL_DECODE_WIDE's route (G = 24: one-row decodes on the packed form, a 3-row sequence
    # on the long kernels): a decode on an empty cache gives out 0 and lse -inf, or the sink,
    # a -inf sink bit for bit no sink; the rows with keys agree with the float64 reference;
    # a NaN key reaches exactly its decode's rows (every head: one kv head), a NaN query
    # exactly its head's row, and nothing else moves.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", True)
    monkeypatch.setattr(dispatch, "SMALL_DECODE_WIDE", True)
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, page = 24, 1, 16, 4
    kc = torch.randn(6, page, hkv, d, generator=g).to(device, DTYPE)
    vc = torch.randn(6, page, hkv, d, generator=g).to(device, DTYPE)
    table = torch.tensor([[0, 1], [2, 5], [3, 4]], dtype=torch.int32, device=device)
    used = torch.tensor([8, 0, 6], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 3, 4, 5], dtype=torch.int32, device=device)
    q = torch.randn(5, hq, d, generator=g).to(device, DTYPE)
    sink = torch.randn(hq, generator=g).to(device)
    sink[::3] = float("-inf")

    def call(q, kc, s):
        with torch.no_grad(), fl.value_checks(False):
            return fl.attention_varlen(q, kc, vc, cu, None, 3, 8, seqused_k=used,
                                       block_table=table, causal=True, sink=s, return_lse=True)

    out0, lse0 = call(q, kc, None)
    out, lse = call(q, kc, sink)
    assert _packed_calls() and not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert bool((out0[3] == 0).all()) and bool(torch.isneginf(lse0[:, 3]).all())
    assert bool((out[3] == 0).all())
    torch.testing.assert_close(lse[:, 3], torch.where(torch.isneginf(sink), lse0[:, 3], sink),
                               rtol=0, atol=0)
    torch.testing.assert_close(out[:, ::3], out0[:, ::3], rtol=0, atol=0)
    torch.testing.assert_close(lse[::3], lse0[::3], rtol=0, atol=0)
    ref_out, ref_lse = R.attention_varlen(
        q.cpu().double(), kc.cpu().double(), vc.cpu().double(), cu.cpu(), None, 3, 8,
        seqused_k=used.cpu(), block_table=table.cpu(), causal=True, sink=sink.cpu().double(),
        return_lse=True)
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-3, rtol=2e-3)
    # A NaN in key 5 of the last decode (page 4, row 1): its row, every head; the rest as
    # before, bit for bit.
    bad_k = kc.clone()
    bad_k[4, 1, 0, 3] = float("nan")
    out_k, lse_k = call(q, bad_k, sink)
    assert bool(torch.isnan(out_k[4]).all()) and bool(torch.isnan(lse_k[:, 4]).all())
    torch.testing.assert_close(out_k[:4], out[:4], rtol=0, atol=0)
    torch.testing.assert_close(lse_k[:, :4], lse[:, :4], rtol=0, atol=0)
    # A NaN in head 5 of that decode's query: that head's row alone.
    bad_q = q.clone()
    bad_q[4, 5, 0] = float("nan")
    out_q, lse_q = call(bad_q, kc, sink)
    nan_rows = torch.isnan(lse_q)
    assert nan_rows.sum() == 1 and bool(nan_rows[5, 4]) and bool(torch.isnan(out_q[4, 5]).all())
    assert not torch.isnan(out_q[4, torch.arange(hq) != 5]).any()
    torch.testing.assert_close(out_q[:4], out[:4], rtol=0, atol=0)
