"""Paged ``attention_varlen`` calls whose sequences all have ``max_seqlen_q`` query rows (at
most 16: vLLM's decode steps and speculative verification through one varlen call with a block
table) on the split-KV decode kernel (``dispatch.PAGED_DECODE``: off by default until its GPU
A/B, on in these tests), and on the paged kernels with the route off, each against the float64
reference (``run_paged``: shuffled pages, unused slots NaN, so a read past a length fails).
Under ``TRITON_INTERPRET=1`` (CI) the tensors are on the CPU; on a GPU on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_varlen import run_paged

import flashlse as fl
from flashlse.kernels import decode, dispatch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _paged_kernels_beside(monkeypatch):
    # The other side of each A/B here is the paged kernels: the mixed calls' decode route
    # (dispatch.SMALL_DECODE, test_varlen_paged_mixed.py) off.
    monkeypatch.setattr(dispatch, "SMALL_DECODE", False)
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]

# (query rows of each sequence, keys of each sequence, keywords): uniform query rows.
UNIFORM = [
    pytest.param([1] * 5, [9, 0, 30, 1, 17], dict(hq=8, hkv=2, causal=True),
                 id="decodes_gqa4_empty_cache"),
    # Sequences with fewer keys than rows: their first rows see no key (out 0, lse -inf, or
    # the sink).
    pytest.param([4, 4, 4], [10, 2, 0], dict(causal=True, sink=True), id="sq4_sink_short"),
    pytest.param([3, 3], [20, 6], dict(hq=4, hkv=2, window=(4, 0)), id="sq3_window"),
    pytest.param([2, 2], [7, 12], dict(hq=4, hkv=1, dv=24, softcap=2.0), id="mqa_softcap_dv24"),
    pytest.param([16, 16], [40, 18], dict(hq=2, hkv=2, causal=True), id="sq16_bound"),
    pytest.param([1, 1], [5, 3], dict(), id="no_mask"),
]


@pytest.mark.parametrize("route", [True, False], ids=["decode", "paged"])
@pytest.mark.parametrize("page", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("qlens,klens,kw", UNIFORM)
def test_varlen_paged_uniform_rows_on_either_kernel(device, monkeypatch, qlens, klens, kw, page,
                                                    route):
    monkeypatch.setattr(dispatch, "PAGED_DECODE", route)
    _, lse = run_paged(device, DTYPES[0], qlens, klens, page, **kw)
    # The varlen layout (Hq, total_q), contiguous on both; which kernel ran: the decode plans.
    assert lse.shape == (kw.get("hq", 4), sum(qlens)) and lse.is_contiguous()
    assert bool(decode._PLANS) == route


@pytest.mark.parametrize("qlens,klens,kw", [
    UNIFORM[0], UNIFORM[4],
    pytest.param([3, 3], [40, 2], dict(causal=True, sink=True), id="sq3_sink_short")])
def test_varlen_paged_route_merge_kernel_writes_the_varlen_lse(device, monkeypatch, qlens,
                                                               klens, kw):
    # The split states merged by the merge kernel (the fused merge off, as calls of more
    # than decode.FUSED_MERGE_MAX_SPLITS splits run) into lse of the varlen layout.
    monkeypatch.setattr(decode, "FUSED_MERGE", False)
    monkeypatch.setattr(dispatch, "PAGED_DECODE", True)
    # (Three splits, also where a GPU's count would take one split for these few keys: some
    # then have no tile, an empty state the merge skips.)
    monkeypatch.setattr(decode, "_num_splits", lambda *a: 3)
    run_paged(device, DTYPES[0], qlens, klens, 1, **kw)
    plans = list(decode._PLANS.values())
    assert plans and all(p.merge is not None and p.fused_run is None for p in plans)


def random_call(gen, hq: int, hkv: int) -> tuple[dict, int]:
    """``(run_paged's keywords, page size)`` of a fuzzed call of these heads: head dims, sink,
    mask (causal, a window, none), softcap, page size, drawn from ``gen``."""
    kw = dict(hq=hq, hkv=hkv, d=gen.choice([16, 32]), sink=gen.random() < 0.4)
    kw["dv"] = gen.choice([kw["d"], 8])
    mask = gen.choice(["causal", "window", "none"])
    if mask == "causal":
        kw["causal"] = True
    elif mask == "window":
        kw["window"] = (gen.randint(0, 6), gen.choice([0, gen.randint(0, 3)]))
    if gen.random() < 0.3:
        kw["softcap"] = 2.5
    return kw, gen.choice([1, 3, 16])


@pytest.mark.parametrize("seed", range(24))
def test_varlen_paged_route_fuzz(device, monkeypatch, seed):
    # Random uniform calls on the route against the reference: batch, rows (1-16 packed
    # within the kernel's bound), heads (MHA / GQA / MQA), head dims, pages, lengths (0,
    # fewer than the rows, several pages), masks, softcap and sinks; the same call on the
    # paged kernels agrees with the reference too (run_paged compares both).
    import random

    gen = random.Random(seed)
    hkv = gen.choice([1, 2])
    hq = hkv * gen.choice([1, 2, 4])
    sq = gen.randint(1, 16 // (hq // hkv) if gen.random() < 0.5 else 4)
    b = gen.randint(1, 4)
    klens = [gen.choice([0, gen.randint(1, sq), gen.randint(1, 40)]) for _ in range(b)]
    kw, page = random_call(gen, hq, hkv)
    for route in (True, False):
        monkeypatch.setattr(dispatch, "PAGED_DECODE", route)
        run_paged(device, DTYPES[0], [sq] * b, klens, page, seed=seed, **kw)
        assert bool(decode._PLANS) == route, (route, sq, b)
        decode._PLANS.clear()


def test_varlen_paged_rows_not_uniform_stay_on_the_paged_kernels(device, monkeypatch):
    # Total rows below B x max_seqlen_q: the sequences differ, the decode kernel (one Sq a
    # call) cannot take them.
    monkeypatch.setattr(dispatch, "PAGED_DECODE", True)
    run_paged(device, DTYPES[0], [4, 1, 4], [9, 6, 12], 16, causal=True)
    assert not decode._PLANS


def test_varlen_paged_route_reads_only_seqused_k(device, monkeypatch):
    # The route ignores cu_seqlens_q (the rows are B x Sq by the shapes): a cu_seqlens_q that
    # a valid call cannot have (checks off) still reads inside the cache, and every row is
    # attention over its own sequence's keys.
    monkeypatch.setattr(dispatch, "PAGED_DECODE", True)
    g = torch.Generator().manual_seed(3)
    b, sq, hq, hkv, d, page = 3, 2, 4, 2, 16, 4
    kc = torch.randn(8, page, hkv, d, generator=g).to(device, DTYPES[0])
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device=device)
    used = torch.tensor([8, 3, 0], dtype=torch.int32, device=device)
    q = torch.randn(b * sq, hq, d, generator=g).to(device, DTYPES[0])
    good = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
    bad = torch.tensor([0, 5, -3, 1000], dtype=torch.int32, device=device)
    with torch.no_grad(), fl.value_checks(False):
        want = fl.attention_varlen(q, kc, kc, good, None, sq, 8, seqused_k=used,
                                   block_table=table, causal=True, return_lse=True)
        got = fl.attention_varlen(q, kc, kc, bad, None, sq, 8, seqused_k=used,
                                  block_table=table, causal=True, return_lse=True)
    assert decode._PLANS
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    # The empty cache's rows: out 0, lse -inf.
    assert bool((want[0][4:] == 0).all()) and bool((want[1][:, 4:] == float("-inf")).all())
