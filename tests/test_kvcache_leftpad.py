"""``attention_with_kvcache(cache_leftpad=)`` (flash-attn's ``cache_leftpad``): sequence b's keys
are cache rows ``[cache_leftpad[b], cache_seqlens[b] + Snew)``, the masks aligned to the end
as without it. The PyTorch path against the float64 reference; the checks; the compat entry.
The kernels' own tests: tests/kernels/test_kvcache_leftpad_kernels.py (same cases)."""

from __future__ import annotations

import importlib

import pytest
import torch
from _flashlse_testing import assert_close_to_ref

import flashlse as fl
from flashlse import compat
from flashlse import reference as R

# (b, sq, hq, hkv, d, smax, lens, leftpad, s_new, keywords)
CASES = [
    pytest.param(3, 1, 4, 2, 16, 40, [30, 12, 40], [5, 0, 39], 0, {}, id="decode"),
    pytest.param(3, 1, 4, 2, 16, 40, [30, 12, 35], [5, 12, 7], 2, {"causal": True},
                 id="append_causal"),
    pytest.param(2, 3, 2, 1, 16, 40, [30, 20], [10, 3], 0, {"causal": True, "sink": True},
                 id="sq3_sink"),
    pytest.param(2, 2, 2, 2, 16, 40, [30, 25], [4, 20], 0, {"window": (6, 0)}, id="window"),
    pytest.param(2, 1, 2, 1, 16, 40, [30, 8], [30, 8], 0, {"sink": True},
                 id="empty_rows_sink"),
    pytest.param(2, 1, 2, 1, 16, 40, [30, 8], [30, 2], 0, {}, id="empty_row"),
    pytest.param(2, 20, 4, 2, 16, 48, [40, 25], [7, 0], 0, {"causal": True}, id="chunk"),
    pytest.param(2, 20, 4, 2, 16, 48, [40, 25], [7, 3], 4, {"causal": True, "softcap": 2.0},
                 id="chunk_append_softcap"),
    pytest.param(2, 1, 2, 1, 16, 40, None, [3, 38], 0, {}, id="whole_cache"),
]


def make(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw, device="cpu", dtype=torch.float32,
         seed=0):
    g = torch.Generator().manual_seed(seed)
    t = dict(q=torch.randn(b, sq, hq, d, generator=g),
             k_cache=torch.randn(b, smax, hkv, d, generator=g),
             v_cache=torch.randn(b, smax, hkv, d, generator=g))
    if s_new:
        t["k_new"] = torch.randn(b, s_new, hkv, d, generator=g)
        t["v_new"] = torch.randn(b, s_new, hkv, d, generator=g)
    t = {n: x.to(device, dtype) for n, x in t.items()}
    if lens is not None:
        t["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    t["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    call = dict(kw)
    if call.pop("sink", False):
        call["sink"] = (torch.randn(hq, generator=g) * 2).to(device)
    return t, call


def run(fn, t, call):
    """``fn`` on fresh copies of the caches (an append writes them), with ``return_lse``."""
    t = {n: x.clone() for n, x in t.items()}
    return fn(t.pop("q"), t.pop("k_cache"), t.pop("v_cache"), **t, **call, return_lse=True)


def f64(t, call):
    return ({n: x.double() if x.is_floating_point() else x for n, x in t.items()},
            {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in call.items()})


@pytest.mark.parametrize("b,sq,hq,hkv,d,smax,lens,leftpad,s_new,kw", CASES)
def test_leftpad_on_the_pytorch_path(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw):
    t, call = make(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw)
    out, lse = run(fl.attention_with_kvcache, t, call)
    want, want_lse = run(R.attention_with_kvcache, *f64(t, call))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # Empty rows (a start at the end) give out 0 and lse -inf (with a sink: the sink, above).
    assert (out.transpose(1, 2)[torch.isneginf(want_lse)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b,sq,hq,hkv,d,smax,lens,leftpad,s_new,kw", CASES)
def test_leftpad_batch_one_masked_call(monkeypatch, b, sq, hq, hkv, d, smax, lens, leftpad,
                                       s_new, kw, dtype):
    # On the CPU a batch with no empty row and no softcap is one call of torch's kernel, the
    # sequences' ranges as its mask (attention.sdpa_fwd_ranges); else one call a sequence.
    # Both against the float64 reference (bf16: the house rule, the reference in bf16 as the
    # baseline).
    kv_mod = importlib.import_module("flashlse.ops.kvcache")
    ranges, taken = kv_mod.sdpa_fwd_ranges, []

    def spy(*args, **kwargs):
        taken.append(ranges(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(kv_mod, "sdpa_fwd_ranges", spy)
    t, call = make(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw, dtype=dtype)
    out, lse = run(fl.attention_with_kvcache, t, call)
    want, want_lse = run(R.attention_with_kvcache, *f64(t, call))
    base = (None, None) if dtype == torch.float32 else run(R.attention_with_kvcache, t, call)
    assert_close_to_ref(out, want, baseline=base[0], name="out")
    assert_close_to_ref(lse, want_lse, baseline=base[1], dtype=dtype, name="lse")
    # Keys a sequence sees; a row is empty when none (or, masked on the right, fewer than
    # the query rows: bottom-right alignment).
    seen = [(smax if lens is None else lens[i] + s_new) - leftpad[i] for i in range(b)]
    right = 0 if kw.get("causal") or "window" in kw else None
    empty = any(n == 0 or (right is not None and n < sq - right) for n in seen)
    assert [x is not None for x in taken] == [not empty and not kw.get("softcap")]


def test_leftpad_batch_masked_call_bounds(monkeypatch):
    # The masked call computes every row on every key: more query rows a sequence than
    # SHORT_ROWS, a mask over TILE_ELEMS, or more than MASKED_WASTE_BYTES a sequence of keys
    # outside the ranges (here 22 rows x 2 heads x 128 bytes = 5632 for 2 sequences) take a
    # call a sequence (same results).
    attn_mod = importlib.import_module("flashlse.ops.attention")
    t, call = make(2, 20, 4, 2, 16, 48, [40, 25], [7, 0], 0, {"causal": True})
    got = {}
    for name, value in (("none", None), ("SHORT_ROWS", 19), ("SHORT_ROWS", 20),
                        ("TILE_ELEMS", 2 * 20 * 40 - 1), ("TILE_ELEMS", 2 * 20 * 40),
                        ("MASKED_WASTE_BYTES", 2815), ("MASKED_WASTE_BYTES", 2816)):
        with monkeypatch.context() as m:
            if value is not None:
                m.setattr(attn_mod, name, value)
            ranges = attn_mod.sdpa_fwd_ranges(t["q"], t["k_cache"], t["v_cache"], [7, 0],
                                              [40, 25], left=None, right=0, softcap=0.0,
                                              scale=0.25, sink=None)
            declined = value in (19, 2 * 20 * 40 - 1, 2815)
            assert (ranges is None) == declined, (name, value)
            if declined:
                got[name] = run(fl.attention_with_kvcache, t, call)
    got["none"] = run(fl.attention_with_kvcache, t, call)
    for name in ("SHORT_ROWS", "TILE_ELEMS"):
        torch.testing.assert_close(got[name], got["none"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leftpad_batch_lse_contract_and_nan(monkeypatch, dtype):
    # The masked batch call's LSE contract on the CPU, against the float64 reference: a
    # sequence with no key (its start at its end) gives out 0 and lse -inf, or the sink; a
    # -inf sink is no sink; a NaN key reaches exactly the rows that see it and a NaN query
    # exactly its row, never an empty-looking row. The batch without them takes the masked
    # call, each of them a call a sequence (spied).
    kv_mod = importlib.import_module("flashlse.ops.kvcache")
    ranges, taken = kv_mod.sdpa_fwd_ranges, []

    def spy(*args, **kwargs):
        got = ranges(*args, **kwargs)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(kv_mod, "sdpa_fwd_ranges", spy)

    def check(t, call, empty=()):
        out, lse = run(fl.attention_with_kvcache, t, call)
        want, want_lse = run(R.attention_with_kvcache, *f64(t, call))
        for name, a, r in (("out", out, want), ("lse", lse, want_lse)):
            for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                               ("-inf", torch.isneginf)):
                assert torch.equal(test(a), test(r)), f"{name}: {what} pattern differs"
        ok = ~torch.isnan(want_lse)
        torch.testing.assert_close(lse[ok].double(), want_lse[ok], atol=2e-2, rtol=2e-2)
        for b in empty:
            assert (out[b] == 0).all()
            sink = call.get("sink")
            assert torch.equal(lse[b], torch.full_like(lse[b], float("-inf")) if sink is None
                               else sink.float()[:, None].expand_as(lse[b]))
        return out, lse

    t, call = make(3, 2, 4, 2, 16, 40, [30, 12, 25], [5, 0, 3], 0, {"causal": True},
                   dtype=dtype)
    out, lse = check(t, call)
    assert taken == [True]
    # A sequence of no key, with and without a sink; a -inf sink is no sink.
    t_empty = dict(t, cache_leftpad=torch.tensor([5, 12, 3], dtype=torch.int32))
    check(t_empty, call, empty=(1, ))
    sink = (torch.randn(4) * 2)
    check(t_empty, dict(call, sink=sink), empty=(1, ))
    ninf = sink.clone()
    ninf[:] = float("-inf")
    _, lse_ninf = check(t_empty, dict(call, sink=ninf), empty=(1, ))
    _, lse_none = run(fl.attention_with_kvcache, t_empty, call)
    assert torch.equal(lse_ninf, lse_none)
    # A NaN key of sequence 1 (kv head 0: query heads 0 and 1, both rows see it) and a NaN
    # query of sequence 2's row 0, head 3: exactly the reference's rows.
    bad = {n: x.clone() for n, x in t.items()}
    bad["k_cache"][1, 4, 0, 7] = float("nan")
    bad["q"][2, 0, 3, 1] = float("nan")
    out, lse = check(bad, call)
    assert torch.isnan(lse[1, :2]).all() and not torch.isnan(lse[1, 2:]).any()
    assert torch.isnan(lse[2, 3, 0]) and torch.isnan(lse[2]).sum() == 1
    assert not torch.isnan(lse[0]).any()
    assert taken == [True, False, False, False, False, False]


def test_leftpad_masks_exactly_the_rows_before_it():
    # The padded rows are never read: the same call with them NaN or inf gives the same bits
    # (a sequence a call: a NaN or inf in any slot keeps the CPU path off its one masked call
    # of torch's kernel, which would read the pads as masked keys), and the finite cache's
    # result (the masked call) up to rounding; leftpad 0 is no leftpad.
    t, call = make(2, 1, 2, 1, 16, 30, [30, 20], [6, 0], 0, {"causal": True})
    base = run(fl.attention_with_kvcache, t, call)
    got = []
    for bad in (float("nan"), float("inf")):
        poisoned = dict(t)
        poisoned["k_cache"] = t["k_cache"].clone()
        poisoned["k_cache"][0, :6] = bad
        got.append(run(fl.attention_with_kvcache, poisoned, call))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    torch.testing.assert_close(got[0][0], base[0])
    torch.testing.assert_close(got[0][1], base[1])
    zero = dict(t, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    plain = {n: x for n, x in t.items() if n != "cache_leftpad"}
    assert torch.equal(run(fl.attention_with_kvcache, zero, call)[0],
                       run(fl.attention_with_kvcache, plain, call)[0])


def test_leftpad_checks():
    t, call = make(2, 1, 2, 1, 16, 30, [30, 20], [6, 0], 0, {})
    q, k, v = t["q"], t["k_cache"], t["v_cache"]
    lens = t["cache_seqlens"]
    with pytest.raises(ValueError, match="contiguous cache"):
        fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=t["cache_leftpad"],
                                  block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_leftpad"):
        fl.attention_with_kvcache(q, k, v, cache_seqlens=lens,
                                  cache_leftpad=t["cache_leftpad"].long())
    with pytest.raises(ValueError, match=r"cache_leftpad must be \(B,\)"):
        fl.attention_with_kvcache(q, k, v, cache_seqlens=lens,
                                  cache_leftpad=torch.zeros(3, dtype=torch.int32))
    for bad in ([-1, 0], [6, 21]):
        with pytest.raises(ValueError, match="cache_leftpad must lie in"):
            fl.attention_with_kvcache(q, k, v, cache_seqlens=lens,
                                      cache_leftpad=torch.tensor(bad, dtype=torch.int32))


def test_compat_passes_cache_leftpad():
    t, call = make(2, 1, 2, 1, 16, 30, [30, 20], [6, 2], 0, {})
    out, lse = compat.flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["cache_seqlens"],
        cache_leftpad=t["cache_leftpad"], return_softmax_lse=True)
    want, want_lse = run(R.attention_with_kvcache, *f64(t, call))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        compat.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                       cache_seqlens=t["cache_seqlens"],
                                       cache_leftpad=t["cache_leftpad"],
                                       cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_leftpad_compiles_fullgraph(dynamic):
    """The starts are data: one opaque op with them (no data-dependent trace)."""
    torch._dynamo.reset()
    t, call = make(2, 3, 4, 2, 16, 12, [9, 5], [2, 5], 2, {"causal": True})

    def fn(q, kc, vc):
        return fl.attention_with_kvcache(q, kc, vc, cache_seqlens=t["cache_seqlens"],
                                         cache_leftpad=t["cache_leftpad"], k_new=t["k_new"],
                                         v_new=t["v_new"], causal=True, return_lse=True)

    kc1, vc1 = t["k_cache"].clone(), t["v_cache"].clone()
    got = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")(t["q"], kc1,
                                                                                 vc1)
    kc2, vc2 = t["k_cache"].clone(), t["v_cache"].clone()
    want = fn(t["q"], kc2, vc2)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc1, kc2)
