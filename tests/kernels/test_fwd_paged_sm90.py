"""The Hopper paged forward (``fwd_sm90.paged_plan``, reached through
``dispatch.attn_fwd_paged``) against ``flashlse.reference``, through the public entry points.

The kernel reads K/V pages in place: key j of sequence b is row ``j % page_size`` of page
``block_table[b, j // page_size]``. The caches here hold fresh random keys in pages of random
order; every slot past a sequence's length (in its last page and in pages no sequence owns) is
NaN, and so are the pages the table's spare columns point at, so a read of any of them fails.
Every case compares out and lse with the float64 reference by the project's rule
(``err(ours) <= 2 * err(torch in the same dtype) + atol``, both against float64), checks empty
rows exactly (out 0, lse -inf or the sink) and asserts that the Gluon plan was made and
launched (pages of 32 rows and more; pages of 8 and 16, outside its domain, are checked on
the paths that take them, and that it did not run). Sequences of at most 16 packed rows
(``T_q * Hq / Hkv``, decodes) never run it (the decode kernel's packed form takes them,
``dispatch.SMALL_DECODE``): in mixed batches their rows are also checked on their own.

Gluon does not run under TRITON_INTERPRET: these run on an sm_90 GPU only.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from _flashlse_testing import assert_close_to_ref, break_plan
from test_attention_varlen import cu
from test_attention_with_kvcache import make, run_both, to_paged
from test_kvcache_kernels import _to

import flashlse as fl
from flashlse import kernel_options
from flashlse import reference as R
from flashlse.masks import normalize_window, visible

SM90 = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        and os.environ.get("TRITON_INTERPRET", "0") != "1")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not SM90, reason="the Hopper paged kernel needs an sm_90 GPU")]

DEVICE = "cuda"
NAN = float("nan")
D = 128
# Packed rows (T_q * Hq / Hkv) up to which a sequence runs the decode kernel's packed form.
DECODE_ROWS = 16
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture(autouse=True, params=["persistent", "grid", "split"])
def paged_form(request, monkeypatch):
    """Every case on each form of the Hopper paged forward: the persistent varlen kernel
    over the pages (``fwd_sm90.PAGED_PERSISTENT``, the default), the paged grid kernel
    (layouts the persistent one does not take), and the persistent kernel with key splits
    (``PAGED_SPLIT_KV``, on by default; here from one key tile a split, so
    that the tests' small calls split: empty splits, the diagonal in any split, decode rows
    written after the merge). Plans and kept launches are dropped: their keys leave the
    flags out."""
    import importlib

    from flashlse.kernels import fwd_sm90

    # (flashlse.ops re-exports functions of these modules' names.)
    attention_ops = importlib.import_module("flashlse.ops.attention")
    kvcache_ops = importlib.import_module("flashlse.ops.kvcache")
    monkeypatch.setattr(fwd_sm90, "PAGED_PERSISTENT", request.param != "grid")
    monkeypatch.setattr(fwd_sm90, "PAGED_SPLIT_KV", request.param == "split")
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    for plans in (fwd_sm90._PLANS, attention_ops._KEPT, attention_ops._PAGED_KEPT,
                  kvcache_ops._KEPT, kvcache_ops._CHUNK_KEPT):
        plans.clear()
    return request.param


@pytest.fixture
def gluon_paged(monkeypatch):
    """Counts the Gluon paged plans ``fwd_sm90.paged_plan`` returns with a launch
    (``planned``) and the launches the dispatcher makes of them (``launched``)."""
    from flashlse.kernels import fwd_sm90

    real = fwd_sm90.paged_plan
    seen = SimpleNamespace(planned=0, launched=0)

    def counted(run):
        def launch(*args, **kwargs):
            seen.launched += 1
            return run(*args, **kwargs)
        return launch

    def paged_plan(*args, **kwargs):
        p = real(*args, **kwargs)
        if p is not None and p.run is not None:
            seen.planned += 1
            p = p._replace(run=counted(p.run))
        return p

    monkeypatch.setattr(fwd_sm90, "paged_plan", paged_plan)
    return seen


def _assert_gluon_ran(seen, page):
    """The Gluon kernel ran for its page sizes (16, 32, 64, multiples of 128); pages of 8
    rows (outside ``paged_supported``) ran no Gluon paged launch."""
    from flashlse.kernels import fwd_sm90

    if page in fwd_sm90.PAGE_SIZES or page % 128 == 0:
        assert seen.planned, "fwd_sm90.paged_plan gave no plan with a launch"
        assert seen.launched, "the Gluon paged plan was not launched"
    else:
        assert not seen.launched, f"the Gluon paged kernel ran at page {page}"


def _paged_batch(dtype, qlens, klens, page, hq, hkv, *, sink=False, seed=0, spare_pages=2,
                 d=D):
    """q and paged caches (head dim ``d``) of fresh random data on the GPU, pages shuffled.

    Slots past each length, ``spare_pages`` pages nobody owns, and the pages the table's three
    spare columns point at (one of the spare pages) are NaN. Returns the call's arguments.
    """
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)
    n_pages = [-(-n // page) for n in klens]
    owned = sum(n_pages)
    perm = torch.randperm(owned + spare_pages, generator=g)
    k_cache = torch.full((owned + spare_pages, page, hkv, d), NAN, dtype=dtype)
    v_cache = torch.full_like(k_cache, NAN)
    # A serving table is wider than its batch: columns past a sequence's pages are never read.
    table = torch.full((len(klens), max(n_pages) + 3), int(perm[owned]), dtype=torch.int32)
    j = 0
    for b, (n, m) in enumerate(zip(klens, n_pages)):
        ids = perm[j:j + m]
        j += m
        table[b, :m] = ids.to(torch.int32)
        for cache in (k_cache, v_cache):
            rows = torch.full((m * page, hkv, d), NAN, dtype=dtype)
            rows[:n] = mk(n, hkv, d)
            cache[ids] = rows.view(m, page, hkv, d)
    q = mk(sum(qlens), hq, d)
    sink_t = torch.randn(hq, generator=g) * 2 if sink else None
    return dict(q=q.to(DEVICE), k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE),
                block_table=table.to(DEVICE), cu_seqlens_q=cu(qlens).to(DEVICE),
                seqused_k=torch.tensor(klens, dtype=torch.int32, device=DEVICE),
                max_seqlen_q=max(qlens), max_seqlen_k=max(klens),
                sink=None if sink_t is None else sink_t.to(DEVICE))


def _run(t, **mask):
    """``fl.attention_varlen`` over the paged batch ``t``: ``(out, lse)``."""
    with torch.no_grad():
        return fl.attention_varlen(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], None,
                                   t["max_seqlen_q"], t["max_seqlen_k"], seqused_k=t["seqused_k"],
                                   block_table=t["block_table"], sink=t["sink"],
                                   return_lse=True, **mask)


def _reference(t, klens, **mask):
    """(float64 reference, torch in q's dtype) over the first ``klens[b]`` keys of each
    sequence, each an ``(out, lse)``."""
    kw = dict(seqused_k=torch.tensor(klens, dtype=torch.int32, device=DEVICE),
              block_table=t["block_table"], sink=t["sink"], return_lse=True, **mask)
    args = (t["cu_seqlens_q"], None, t["max_seqlen_q"], t["max_seqlen_k"])
    ref = R.attention_varlen(t["q"].double(), t["k_cache"].double(), t["v_cache"].double(),
                             *args, **kw)
    with R.computed_in(t["q"].dtype):
        base = R.attention_varlen(t["q"], t["k_cache"], t["v_cache"], *args, **kw)
    return ref, base


def _empty_rows(qlens, klens, causal=False, window=(None, None)):
    """``(total_q,)`` bool: the query rows that see no key (by structure)."""
    left, right = normalize_window(causal, window)
    rows = []
    for sq, sk in zip(qlens, klens):
        ok = visible(torch.arange(sq), torch.arange(sk), sq, sk, left, right)
        rows.append(torch.full((sq,), sk == 0) if ok is None else ~ok.any(-1))
    return torch.cat(rows).to(DEVICE)


def _check(got, ref, base, t, empty, rows=None):
    """out and lse against the reference (the tolerance rule), on ``rows`` (all if None);
    empty rows exactly out 0 and lse -inf (or the sink)."""
    (out, lse), (ref_out, ref_lse), (base_out, base_lse) = got, ref, base
    dtype = t["q"].dtype
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    if rows is not None:
        out, ref_out, base_out, empty = out[rows], ref_out[rows], base_out[rows], empty[rows]
        lse, ref_lse, base_lse = lse[:, rows], ref_lse[:, rows], base_lse[:, rows]
    assert_close_to_ref(out, ref_out, baseline=base_out, dtype=dtype)
    assert_close_to_ref(lse, ref_lse, baseline=base_lse, dtype=dtype, name="lse")
    assert bool((out[empty] == 0).all()), "rows that see no key must give out = 0"
    if t["sink"] is None:
        assert bool(torch.isneginf(lse[:, empty]).all()), "rows that see no key: lse -inf"
    else:
        want = t["sink"].float().view(-1, 1).expand_as(lse)
        assert torch.equal(lse[:, empty], want[:, empty]), "rows that see no key: lse = sink"


def _decode_rows(qlens, group):
    """``(total_q,)`` bool: the rows of sequences the Hopper kernel leaves (<= 16 packed)."""
    return torch.cat([torch.full((n,), 0 < n * group <= DECODE_ROWS) for n in qlens]).to(DEVICE)


def _check_case(got, t, qlens, klens, mask):
    ref, base = _reference(t, klens, **mask)
    empty = _empty_rows(qlens, klens, **mask)
    _check(got, ref, base, t, empty)
    small = _decode_rows(qlens, t["q"].shape[1] // t["k_cache"].shape[2])
    if small.any():
        # The decode kernel's sequences of the same call, on their own error scale.
        _check(got, ref, base, t, empty, rows=small)
    return ref


PAGE_SIZES = [8, 16, 32, 64, 128, 256]

# (q lens, k lens, Hq, Hkv, page size, keywords)
CASES = [
    # Chunked prefill against longer caches, causal; lengths neither multiples of the page
    # size nor of 128 (1003 = 7 * 128 + 107, 451 = 3 * 128 + 67).
    *[pytest.param([300, 130], [1003, 451], 8, 2, page, dict(causal=True),
                   id=f"chunked_causal_page{page}") for page in PAGE_SIZES],
    pytest.param([130, 300, 64], [2900, 1500, 64], 16, 4, 64, dict(causal=True),
                 id="long_caches_gqa4_page64"),
    # A serving step: prefills, decodes, a query of 0 rows, a prefill of 40 rows and a decode
    # with no key; 4 rows x 4 heads (16 packed, portable) and 5 rows (20 packed, Gluon).
    pytest.param([200, 1, 0, 40, 1, 4, 5, 1, 77], [700, 300, 50, 0, 1, 99, 123, 0, 77], 8, 2,
                 32, dict(causal=True), id="mixed_step_page32"),
    pytest.param([33, 1, 1, 0, 150, 1], [40, 513, 0, 7, 1000, 129], 4, 1, 16,
                 dict(sink=True, window=(128, 0)), id="mixed_step_mqa_sink_window_page16"),
    pytest.param([150, 33], [900, 40], 16, 2, 128, dict(causal=True), id="gqa8_page128"),
    # MHA: 17 rows (Gluon) and 16 rows (the portable kernel) in one call.
    pytest.param([100, 70, 17, 16], [500, 64, 255, 203], 4, 4, 16, {}, id="mha_full_page16"),
    pytest.param([90, 20], [600, 0], 8, 2, 64, dict(causal=True, sink=True),
                 id="sink_causal_no_keys_page64"),
    pytest.param([300], [1200], 8, 2, 32, dict(window=(100, 0)), id="window_left_page32"),
    pytest.param([200, 50], [700, 45], 8, 2, 16, dict(window=(64, 31), sink=True),
                 id="window_left_right_sink_page16"),
    # Rows 0..199 see no key (bottom-right diagonal below key 0, right = 0).
    pytest.param([300], [100], 4, 2, 8, dict(window=(10, 0)), id="window_empties_rows_page8"),
    pytest.param([400, 129], [250, 17], 8, 2, 256, dict(causal=True),
                 id="causal_sq_gt_sk_page256"),
    pytest.param([400, 129], [250, 17], 8, 2, 64, dict(causal=True, sink=True),
                 id="causal_sq_gt_sk_sink_page64"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qlens, klens, hq, hkv, page, kw", CASES)
def test_fwd_paged_sm90_matches_reference(gluon_paged, dtype, qlens, klens, hq, hkv, page, kw):
    kw = dict(kw)
    t = _paged_batch(dtype, qlens, klens, page, hq, hkv, sink=kw.pop("sink", False), seed=1)
    got = _run(t, **kw)
    _assert_gluon_ran(gluon_paged, page)
    _check_case(got, t, qlens, klens, kw)


@pytest.mark.parametrize("d, wg", [(64, 2), (64, 3), (256, 2)],
                         ids=["d64-wg2", "d64-wg3", "d256-wg2"])
@pytest.mark.parametrize("qlens, klens, hq, hkv, page, kw", [
    pytest.param([300, 130, 1, 64], [1003, 451, 300, 64], 8, 2, 64, dict(causal=True),
                 id="chunked_causal_page64"),
    pytest.param([200, 1, 0, 40, 193], [700, 300, 50, 0, 250], 8, 2, 16,
                 dict(window=(100, 0), sink=True), id="mixed_window_sink_page16"),
    pytest.param([130, 17], [400, 129], 16, 4, 128, {}, id="gqa4_full_page128"),
])
def test_fwd_paged_sm90_head_dims(gluon_paged, kernel_opts, monkeypatch, d, wg, qlens, klens,
                                   hq, hkv, page, kw):
    """D = 64 over pages on two and three consumer warpgroups (VARLEN_CONSUMERS: 192-row
    blocks ending at each sequence's end, a part before row 0 loads and stores nothing, each
    part its own key tiles), and D = 256 (``fwd_sm90.PAGED_D256``: O staged in Q's buffer,
    64-key tiles, a page of 16 four boxes a tile): lengths off the tile grid, a decode row, a
    sequence with no key, a window whose parts see different key tiles, with a sink, a page
    of more than one tile."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "PAGED_D256", True)
    kernel_opts(fwd_sm90_config={"VARLEN_CONSUMERS": wg})
    kw = dict(kw)
    t = _paged_batch(torch.bfloat16, qlens, klens, page, hq, hkv, sink=kw.pop("sink", False),
                     seed=4, d=d)
    got = _run(t, **kw)
    _assert_gluon_ran(gluon_paged, page)
    _check_case(got, t, qlens, klens, kw)


# (B, Sq, Hq, Hkv, Smax, cache_seqlens, Snew, page size, keywords); Sq > 16: the prefill path.
KVCACHE_CASES = [
    pytest.param(2, 40, 8, 2, 700, [600, 3], 40, 64, dict(causal=True), id="chunk40_page64"),
    # 200 rows at page 16 on a table of 75 pages (at most 16 rows a query row): read in place
    # by the Gluon kernel, which every page size of its domain is.
    pytest.param(2, 200, 8, 1, 1200, [777, 0], 200, 16, dict(causal=True, sink=True),
                 id="chunk200_page16_sink_empty_cache"),
    pytest.param(1, 17, 4, 4, 300, [100], 17, 256, dict(causal=True), id="mha_sq17_page256"),
    pytest.param(2, 64, 16, 2, 1024, [1000, 500], 0, 128, dict(causal=True, window=(256, 0)),
                 id="no_new_keys_window_page128"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, sq, hq, hkv, smax, lens, snew, page, kw", KVCACHE_CASES)
def test_fwd_paged_sm90_kvcache_prefill(gluon_paged, dtype, b, sq, hq, hkv, smax, lens, snew,
                                        page, kw):
    """attention_with_kvcache over a paged cache, k_new/v_new appended first (run_both also
    checks the caches after the append against the reference's)."""
    kw = dict(kw)
    t = make(b, sq, hq, hkv, D, D, smax, lens, snew, dtype, sink=kw.pop("sink", False))
    with torch.no_grad():
        run_both(_to(to_paged(t, page), DEVICE), **kw)
    _assert_gluon_ran(gluon_paged, page)


@pytest.mark.parametrize("page, col, bad", [
    pytest.param(16, 20, "past_end", id="page16_past_end"),
    pytest.param(128, 3, "negative", id="page128_negative"),
    pytest.param(64, 0, "past_end", id="page64_first_page_no_keys"),
])
@pytest.mark.parametrize("d", [128, 64, 256], ids=["d128", "d64", "d256"])
def test_fwd_paged_sm90_bad_page_ends_sequence(gluon_paged, monkeypatch, page, col, bad, d):
    """With the value checks off, a block-table entry outside [0, num_pages) among the pages
    in use ends that sequence's keys before that page (masks bottom-right aligned to the
    shorter length); the other sequences, a decode among them, are exact. Every head dim of
    the paged kernel's domain (D = 256 with PAGED_D256)."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "PAGED_D256", True)
    qlens, klens = [150, 1, 60], [900, 333, 500]
    t = _paged_batch(torch.bfloat16, qlens, klens, page, 8, 2, seed=2, d=d)
    num_pages = t["k_cache"].shape[0]
    t["block_table"][0, col] = -5 if bad == "negative" else num_pages + 7
    with fl.value_checks(False):
        got = _run(t, causal=True)
    _assert_gluon_ran(gluon_paged, page)
    _check_case(got, t, qlens, [col * page, *klens[1:]], dict(causal=True))
    with pytest.raises(ValueError, match="block_table"), fl.value_checks():
        _run(t, causal=True)


@pytest.mark.parametrize("key", [480, 599], ids=lambda k: f"key{k}")
@pytest.mark.parametrize("d", [128, 64, 256], ids=["d128", "d64", "d256"])
def test_fwd_paged_sm90_nan_key_reaches_exactly_the_rows_that_see_it(gluon_paged, monkeypatch,
                                                                      key, d):
    """A NaN in key ``key`` of sequence 0 (kv head 1): NaN out and lse on the rows of query
    heads 2, 3 that see it (causal, 200 rows on 600 keys: rows ``key - 400`` on), the clean
    result elsewhere. Key 599 is the last one, in a partial last page. Every head dim of the
    paged kernel's domain (D = 256 with PAGED_D256)."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "PAGED_D256", True)
    qlens, klens, page, hq, hkv = [200, 150], [600, 150], 64, 4, 2
    t = _paged_batch(torch.float16, qlens, klens, page, hq, hkv, seed=3, d=d)
    clean = _run(t, causal=True)
    _assert_gluon_ran(gluon_paged, page)
    _check_case(clean, t, qlens, klens, dict(causal=True))
    pg = int(t["block_table"][0, key // page])
    t["k_cache"][pg, key % page, 1, 5] = NAN
    out, lse = _run(t, causal=True)
    bad = torch.zeros(hq, sum(qlens), dtype=torch.bool, device=DEVICE)
    bad[2:4, key - (klens[0] - qlens[0]):qlens[0]] = True
    out = out.transpose(0, 1).float()  # (Hq, total_q, Dv), as lse's (Hq, total_q)
    assert bool(torch.isnan(lse[bad]).all()), "lse not NaN on rows that see the NaN key"
    assert bool(torch.isnan(out[bad]).all()), "out not NaN on rows that see the NaN key"
    good = ~bad
    assert not bool(torch.isnan(lse[good]).any()) and not bool(torch.isnan(out[good]).any())
    clean_out, clean_lse = clean[0].transpose(0, 1).float(), clean[1]
    torch.testing.assert_close(out[good], clean_out[good], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[good], clean_lse[good], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page", [16, 32, 64], ids=lambda p: f"page{p}")
def test_fwd_paged_sm90_sink_and_nan_query_edges(gluon_paged, page):
    """The contract's edges on the Gluon paged path (math.md section 7): a ``-inf`` sink is
    no sink (out and lse equal to the no-sink call, empty rows 0 / -inf); a NaN sink makes
    every row of its head NaN, empty rows included; a NaN in one query row makes that row's
    out and lse NaN for its head and leaves every other row clean."""
    qlens, klens, hq, hkv = [300, 1, 40], [200, 9, 0], 4, 2  # causal: rows 0-99 of seq 0 empty
    t = _paged_batch(torch.bfloat16, qlens, klens, page, hq, hkv, seed=6)
    none = _run(t, causal=True)
    _assert_gluon_ran(gluon_paged, page)
    _check_case(none, t, qlens, klens, dict(causal=True))
    t["sink"] = torch.full((hq,), float("-inf"), device=DEVICE)
    neg = _run(t, causal=True)
    assert torch.equal(neg[0], none[0]) and torch.equal(neg[1], none[1]), "-inf sink != none"
    t["sink"] = torch.tensor([0.5, NAN, -1.0, 2.0], device=DEVICE)
    out, lse = _run(t, causal=True)
    assert bool(torch.isnan(lse[1]).all()) and bool(torch.isnan(out[:, 1]).all())
    rest = [0, 2, 3]
    assert not bool(torch.isnan(lse[rest]).any()) and not bool(torch.isnan(out[:, rest]).any())
    t["sink"] = None
    row = 250  # sequence 0, sees keys
    t["q"][row, 2, 7] = NAN
    out, lse = _run(t, causal=True)
    assert bool(torch.isnan(lse[2, row])) and bool(torch.isnan(out[row, 2]).all())
    keep = torch.ones(hq, sum(qlens), dtype=torch.bool, device=DEVICE)
    keep[2, row] = False
    assert not bool(torch.isnan(lse[keep]).any())
    assert not bool(torch.isnan(out.transpose(0, 1)[keep]).any())


def _assert_close_to(got, want):
    """Two kernels' results on the same inputs: same -inf pattern, close values."""
    (out, lse), (out_w, lse_w) = got, want
    torch.testing.assert_close(out.float(), out_w.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(lse_w)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], lse_w[fin], atol=1e-3, rtol=1e-3)


MIXED = dict(qlens=[200, 1, 0, 40, 1, 5], klens=[700, 300, 50, 0, 1, 123], page=32, hq=8, hkv=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_paged_sm90_option_off_runs_portable(gluon_paged, kernel_opts, dtype):
    """``KernelOptions.sm90_fwd_paged=False``: no Gluon launch, the portable paged kernel's
    result, as correct and close to the Gluon kernel's."""
    qlens, klens = MIXED["qlens"], MIXED["klens"]
    t = _paged_batch(dtype, qlens, klens, MIXED["page"], MIXED["hq"], MIXED["hkv"], sink=True,
                     seed=4)
    gluon = _run(t, causal=True)
    _assert_gluon_ran(gluon_paged, MIXED["page"])
    launched = gluon_paged.launched
    kernel_opts(sm90_fwd_paged=False)
    portable = _run(t, causal=True)
    assert gluon_paged.launched == launched, "the Gluon paged plan ran with the option off"
    for got in (gluon, portable):
        _check_case(got, t, qlens, klens, dict(causal=True))
    _assert_close_to(gluon, portable)


def test_fwd_paged_sm90_failure_falls_back(monkeypatch, compile_failures):
    """A Gluon paged kernel that this triton fails to compile warns once; the portable kernel
    answers that call and the next ones of the same signature without trying it again."""
    from flashlse.kernels import fwd_sm90

    calls = break_plan(monkeypatch, fwd_sm90, "paged_plan", ("fwd_sm90 paged", "a signature"))
    qlens, klens = MIXED["qlens"], MIXED["klens"]
    t = _paged_batch(torch.bfloat16, qlens, klens, MIXED["page"], MIXED["hq"], MIXED["hkv"],
                     seed=5)
    with pytest.warns(RuntimeWarning, match="failed") as caught:
        first = _run(t, causal=True)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    _check_case(first, t, qlens, klens, dict(causal=True))
    # A second warning would be an error (pyproject's filterwarnings).
    second = _run(t, causal=True)
    assert len(calls) == 1 and len(compile_failures) == 1
    with kernel_options(sm90_fwd_paged=False):
        portable = _run(t, causal=True)
    for got in (first, second):
        _assert_close_to(got, portable)


def test_fwd_paged_sm90_serving_steps_share_one_plan(gluon_paged, monkeypatch):
    """A serving engine's steps over one cache: the packed rows, the batch (within one power
    of two) and both max lengths change every call. One Gluon paged plan and one portable
    plan serve them all, kept in the call's kept entry (ops/attention._PAGED_KEPT, whose key
    leaves those out, as the plans' own keys there do; each launch gets its call's grid and
    lengths), and every step matches the reference."""
    import importlib

    from flashlse.kernels import fwd, fwd_sm90

    attention_ops = importlib.import_module("flashlse.ops.attention")
    monkeypatch.setattr(fwd_sm90, "_PLANS", {})
    monkeypatch.setattr(fwd, "_PLANS", {})
    monkeypatch.setattr(attention_ops, "_PAGED_KEPT", {})
    dtype = torch.bfloat16
    full = [1500, 900, 700, 400]
    cache = _paged_batch(dtype, [1] * 4, full, 64, 8, 2, seed=3)
    g = torch.Generator().manual_seed(4)
    steps = [([300, 1, 1], [1400, 77, 700]), ([1, 130, 1, 40], [900, 600, 1, 400]),
             ([17, 1, 200], [17, 900, 650]), ([64, 1, 1, 1], [1500, 2, 300, 399])]
    for qlens, klens in steps:
        b = len(qlens)
        t = dict(cache, q=torch.randn(sum(qlens), 8, D, generator=g).to(dtype).to(DEVICE),
                 cu_seqlens_q=cu(qlens).to(DEVICE), block_table=cache["block_table"][:b],
                 seqused_k=torch.tensor(klens, dtype=torch.int32, device=DEVICE),
                 max_seqlen_q=max(qlens), max_seqlen_k=max(klens))
        _check_case(_run(t, causal=True), t, qlens, klens, dict(causal=True))
    assert gluon_paged.launched == len(steps)
    (entry, ) = attention_ops._PAGED_KEPT.values()
    assert sorted(key[0] for key in entry[-1]) == ["portable", "sm90"], entry[-1]
    assert not [k for plans in (fwd_sm90._PLANS, fwd._PLANS) for k in plans if k[0] == "paged"]
