"""Bad data propagates; it is never "empty" (docs/math.md, "Non-finite inputs").

A row is empty only by structure (no visible key). A NaN in q, in a key a row sees, or in a
sink reaches exactly the rows that see it -- NaN out and NaN lse -- on every path and at every
split count; the other rows equal attention on clean data. A sink of -inf is no sink. (A NaN
in v reaches every row of the tile that multiplies it, seen or not -- ``0 * NaN`` in P V, as
in flash-attn's kernels; not tested here.)

The same checks run on the kernels (tests/kernels/test_nan_kernels.py imports ``run_case``).
"""

from __future__ import annotations

import pytest
import torch

import flashlse as fl
from flashlse import reference as R

NAN = float("nan")
# q (1, 6, 2, 16), k/v (1, 8, 1, 16), causal bottom-right: row i sees keys 0 .. i + 2.
SQ, SK, HQ, D = 6, 8, 2, 16


def _inputs(device, dtype, d=D):
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    return mk(1, SQ, HQ, d), mk(1, SK, 1, d), mk(1, SK, 1, d)


def _assert_bad_rows(out, lse, bad, want_out, want_lse, tol):
    """``bad (Hq, Sq)``: NaN out (every column) and NaN lse there; elsewhere the clean result."""
    out, lse = out[0].transpose(0, 1).float(), lse[0].float()  # (Hq, Sq, Dv), (Hq, Sq)
    want_out, want_lse = want_out[0].transpose(0, 1).float(), want_lse[0].float()
    assert torch.isnan(lse[bad]).all(), f"lse not NaN on rows that see bad data: {lse[bad]}"
    assert torch.isnan(out[bad]).all(), "out not NaN on rows that see bad data"
    good = ~bad
    assert not torch.isnan(lse[good]).any() and not torch.isnan(out[good]).any()
    torch.testing.assert_close(lse[good], want_lse[good], atol=tol, rtol=tol)
    torch.testing.assert_close(out[good], want_out[good], atol=tol, rtol=tol)


def _causal_indices(sq, sk, device):
    """Top-k lists equal to the bottom-right causal mask: row i lists keys 0 .. i + Sk - Sq."""
    j = torch.arange(sk, device=device)
    rows = torch.arange(sq, device=device)[:, None] + sk - sq
    return torch.where(j[None] <= rows, j[None], -1).to(torch.int32)


def _paged(x, page):
    """(1, S, H, D) as a paged cache of shuffled-free pages and its block table."""
    n = -(-x.shape[1] // page)
    pages = x.new_zeros(n + 1, page, *x.shape[2:])
    pages[1:].flatten(0, 1)[: x.shape[1]] = x[0]
    return pages, torch.arange(1, n + 1, dtype=torch.int32, device=x.device)[None]


def _call(path, q, k, v, sink, num_splits):
    """The same causal attention through each path: dense, decode (num_splits), sparse with
    causal top-k lists, paged varlen, paged sparse."""
    if path == "attention":
        return fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    if path in ("sparse", "sparse_paged"):
        idx = _causal_indices(q.shape[1], k.shape[1], q.device)[None, :, None].contiguous()
        with torch.no_grad(), fl.value_checks(False):
            if path == "sparse":
                return fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
            (kp, table), (vp, _) = _paged(k, 3), _paged(v, 3)
            return fl.sparse_attention(q, kp, vp, idx, block_table=table, sink=sink,
                                       return_lse=True)
    if path in ("varlen_paged", "varlen_paged_kernels", "varlen_paged_mixed"):
        # One sequence of SQ <= 16 rows: on the kernels the decode kernel
        # (dispatch.PAGED_DECODE); "varlen_paged_kernels": the paged kernels (the routes off);
        # "varlen_paged_mixed": behind a sequence of 9 ones-rows (more than 16 packed rows) on
        # the same pages, a mixed step whose short sequence takes the decode kernel's packed
        # form (dispatch.SMALL_DECODE).
        (kp, table), (vp, _) = _paged(k, 3), _paged(v, 3)
        sq, sk = q.shape[1], k.shape[1]
        front = 9 if path == "varlen_paged_mixed" else 0
        rows = torch.cat([q.new_ones(front, *q.shape[2:]), q[0]])
        cu_q = torch.tensor([0, front, front + sq] if front else [0, sq], dtype=torch.int32,
                            device=q.device)
        used = torch.full((cu_q.shape[0] - 1, ), sk, dtype=torch.int32, device=q.device)
        from flashlse.kernels import dispatch

        routes = dispatch.PAGED_DECODE, dispatch.SMALL_DECODE
        dispatch.PAGED_DECODE = path == "varlen_paged"
        dispatch.SMALL_DECODE = path == "varlen_paged_mixed"
        try:
            with torch.no_grad(), fl.value_checks(False):
                out, lse = fl.attention_varlen(rows, kp, vp, cu_q, None, max(sq, front), sk,
                                               seqused_k=used,
                                               block_table=table.repeat(len(used), 1),
                                               causal=True, sink=sink, return_lse=True)
        finally:
            dispatch.PAGED_DECODE, dispatch.SMALL_DECODE = routes
        return out[None, front:], lse[None, :, front:]
    lens = torch.full((1,), SK, dtype=torch.int32, device=q.device)
    if path in LONG_ROWS:
        # A paged chunk of LONG_ROWS[path] queries: the paged kernel below 128 rows, pages
        # gathered for the varlen kernel from 128, in place again on a table wider than 16
        # rows a query row ("wide": columns past the sequence's pages point at page 0).
        # Causal is bottom-right aligned, so the last Sq rows are the same attention as the
        # other paths'; the first n - Sk see no key.
        sq = q.shape[1]
        front = torch.ones(1, LONG_ROWS[path] - sq, *q.shape[2:], dtype=q.dtype, device=q.device)
        (kp, table), (vp, _) = _paged(k, 3), _paged(v, 3)
        if path == "kvcache_paged_wide":
            table = torch.cat([table, table.new_zeros(1, 16 * LONG_ROWS[path] // 3)], 1)
        with torch.no_grad(), fl.value_checks(False):
            out, lse = fl.attention_with_kvcache(torch.cat([front, q], 1), kp, vp,
                                                 cache_seqlens=lens, block_table=table,
                                                 causal=True, sink=sink, return_lse=True)
        return out[:, -sq:], lse[..., -sq:]
    if path == "kvcache_paged":
        # The split-KV decode kernel over pages of 3 rows: a tile spans several pages, and
        # at 3 splits some split has no tile.
        (k, table), (v, _) = _paged(k, 3), _paged(v, 3)
    else:
        table = None
    with torch.no_grad(), fl.value_checks(False):
        return fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         causal=True, sink=sink, num_splits=num_splits,
                                         return_lse=True)


# attention_with_kvcache over a paged cache with long queries: the rows of each call.
LONG_ROWS = {"kvcache_paged_chunk": 40, "kvcache_paged_long": 130, "kvcache_paged_wide": 130}


def run_case(device, dtype, path, what, num_splits=1, d=D):
    q, k, v = _inputs(device, dtype, d)
    sink = torch.tensor([0.5, -1.0], device=device)
    clean = _call(path, q, k, v, sink, num_splits)
    bad = torch.zeros(HQ, SQ, dtype=torch.bool)
    if what == "k":
        k[0, 5, 0, 3] = NAN
        bad[:, 3:] = True  # rows 3.. see key 5
    elif what == "q":
        q[0, 1, 1, 0] = NAN
        bad[1, 1] = True
    elif what == "sink":
        sink[1] = NAN
        bad[1] = True
    elif what == "sink_inf":
        # An infinitely heavy key of value 0: exp(inf - inf) is NaN, as IEEE gives it.
        sink[1] = float("inf")
        bad[1] = True
    out, lse = _call(path, q, k, v, sink, num_splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _assert_bad_rows(out, lse, bad, *clean, tol)


def run_neg_inf_sink(device, dtype, path, num_splits=1, d=D):
    """sink = -inf equals no sink: empty rows (0, -inf), the rest bit-for-bit the no-sink
    call's; with grad, equal gradients and a zero dsink."""
    q, k, v = _inputs(device, dtype, d)
    q = torch.cat([q, q], 1)  # Sq = 12 > Sk = 8: rows 0-3 see no key
    none = _call(path, q, k, v, None, num_splits)
    sink = torch.tensor([float("-inf"), float("-inf")], device=device)
    got = _call(path, q, k, v, sink, num_splits)
    for a, b in zip(got, none):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.isneginf(got[1][0, :, :4]).all() and (got[0][0, :4] == 0).all()
    if path != "attention":
        return
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = sink.clone().requires_grad_()
    out, lse = fl.attention(*leaves, causal=True, sink=s, return_lse=True)
    (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_r, lse_r = fl.attention(*ref, causal=True, return_lse=True)
    (out_r.float().square().sum() + lse_r.masked_fill(torch.isneginf(lse_r), 0).sum()).backward()
    for a, b in zip(leaves, ref):
        assert not torch.isnan(a.grad).any()
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(s.grad, torch.zeros_like(s.grad))


def run_empty_blocks(device, dtype, sink_value, d=D, varlen=False):
    """Whole row blocks that see no key (causal, 300 rows on 100 keys: rows 0-199 empty, so
    the first 128-row block launches no key tile; with ``varlen`` a second sequence of 40
    rows on 0 keys too). Head 1's sink is ``sink_value``: NaN or +inf makes every row of head
    1 NaN (0 / (0 + e^sink)), empty or not; -inf is no sink. Head 0 (sink 0.5) and every
    other row equal the float64 reference."""
    g = torch.Generator().manual_seed(5)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    q, k, v = mk(1, 340, HQ, d), mk(1, 100, 1, d), mk(1, 100, 1, d)
    sink = torch.tensor([0.5, sink_value], device=device)
    if varlen:
        cu_q = torch.tensor([0, 300, 340], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 100, 100], dtype=torch.int32, device=device)
        out, lse = fl.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 300, 100, causal=True,
                                       sink=sink, return_lse=True)
        out, lse = out[None], lse[None]
    else:
        q = q[:, :300]
        out, lse = fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    rows = out.shape[1]
    want_out, want_lse = R.attention(q[:, :300].cpu(), k.cpu(), v.cpu(), causal=True,
                                     sink=sink.cpu().masked_fill(sink.cpu().isnan(), 0),
                                     return_lse=True)
    if varlen:  # the 40 rows on no key: out 0, lse the sink
        want_out = torch.cat([want_out, want_out.new_zeros(1, 40, HQ, d)], 1)
        want_lse = torch.cat([want_lse, sink.cpu().double().view(1, HQ, 1).expand(1, HQ, 40)], 2)
    bad = torch.zeros(HQ, rows, dtype=torch.bool)
    if sink_value != float("-inf"):
        bad[1] = True
    else:
        want = R.attention(q[:, :300].cpu(), k.cpu(), v.cpu(), causal=True, return_lse=True)
        want_out[:, :300, 1], want_lse[:, 1, :300] = want[0][:, :, 1], want[1][:, 1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _assert_bad_rows(out.cpu(), lse.cpu(), bad, want_out, want_lse, tol)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("sink_value", [NAN, float("inf"), float("-inf")],
                         ids=["nan", "inf", "neginf"])
def test_sink_reaches_rows_of_whole_empty_blocks(sink_value, varlen):
    run_empty_blocks("cpu", torch.float32, sink_value, varlen=varlen)


# Every path, (path, num_splits) with its test id.
PATHS = [("attention", 1), ("kvcache", 1), ("kvcache", 2), ("kvcache", 3),
         ("kvcache_paged", 1), ("kvcache_paged", 3), ("sparse", 1),
         ("sparse_paged", 1), ("varlen_paged", 1), ("varlen_paged_kernels", 1),
         ("varlen_paged_mixed", 1),
         ("kvcache_paged_chunk", 1), ("kvcache_paged_long", 1), ("kvcache_paged_wide", 1)]
IDS = ["attention", "kv_splits1", "kv_splits2", "kv_splits3", "kv_paged_splits1",
       "kv_paged_splits3", "sparse", "sparse_paged",
       "varlen_paged", "varlen_paged_kernels", "varlen_paged_mixed", "kv_paged_chunk",
       "kv_paged_long", "kv_paged_wide"]


@pytest.mark.parametrize("what", ["k", "q", "sink", "sink_inf"])
@pytest.mark.parametrize("path,num_splits", PATHS, ids=IDS)
def test_nan_reaches_exactly_the_rows_that_see_it(path, num_splits, what):
    run_case("cpu", torch.float32, path, what, num_splits)


@pytest.mark.parametrize("path,num_splits", PATHS, ids=IDS)
def test_neg_inf_sink_is_no_sink(path, num_splits):
    run_neg_inf_sink("cpu", torch.float32, path, num_splits)


def test_reference_treats_nan_as_data_not_empty():
    q, k, v = _inputs("cpu", torch.float64)
    k[0, 5, 0, 0] = NAN
    out, lse = R.attention(q, k, v, causal=True, return_lse=True)
    assert torch.isnan(lse[0, :, 3:]).all() and not torch.isnan(lse[0, :, :3]).any()


@pytest.mark.parametrize("sink_value", [NAN, float("inf")], ids=["nan", "inf"])
def test_reference_sink_nan_over_zero_keys(sink_value):
    """Zero keys: out is an empty sum divided by e^L, so a NaN L (NaN or +inf sink) makes it
    NaN, in the reference as on the paths (the matmul alone would give 0)."""
    q, k, v = _inputs("cpu", torch.float64)
    sink = torch.tensor([0.5, sink_value], dtype=torch.float64)
    out, lse = R.attention(q, k[:, :0], v[:, :0], sink=sink, return_lse=True)
    assert torch.isnan(out[:, :, 1]).all() and torch.isnan(lse[:, 1]).all()
    assert (out[:, :, 0] == 0).all() and (lse[:, 0] == 0.5).all()
    ours = fl.attention(q.float(), k[:, :0].float(), v[:, :0].float(), sink=sink.float(),
                        return_lse=True)
    assert torch.equal(torch.isnan(ours[0]), torch.isnan(out))
    assert torch.equal(torch.isnan(ours[1]), torch.isnan(lse))
