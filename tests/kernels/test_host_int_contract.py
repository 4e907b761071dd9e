"""The LSE contract on the paths session 43 bounded (a window side near 2^31, a varlen
max_seqlen far above the rows, a forced num_splits far past the key tiles): an empty row
gives out 0 and lse -inf (the sink with one; a -inf sink is no sink) as the float64
reference does, no NaN in outputs or gradients; and a NaN key reaches exactly the rows that
see it, never an empty-looking row."""

from __future__ import annotations

import pytest
import torch

import flashlse as fl
from flashlse import masks
from flashlse import reference as R

BIG = 2**31 - 2
NAN_KEY = 5


def _randn(*shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, torch.float16)


def _sink(kind, device):
    return {"none": None, "finite": torch.tensor([0.5, -1.0, 2.0, 0.0], device=device),
            "-inf": torch.full((4,), float("-inf"), device=device)}[kind]


def _check(out, lse, ref_out, ref_lse, empty, sink):
    """Against the reference, NaN where it is NaN; ``empty`` rows (a bool over the rows of
    ``out``'s first dim) out 0 and lse the sink or -inf."""
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=2e-3, equal_nan=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=2e-3, equal_nan=True)
    assert (out[empty] == 0).all()
    want = torch.full_like(lse[..., empty], float("-inf")) if sink is None else \
        sink.view(-1, 1).expand_as(lse[..., empty])
    assert torch.equal(lse[..., empty], want.to(lse.dtype))


@pytest.mark.parametrize("sink_kind", ["none", "finite", "-inf"])
@pytest.mark.parametrize("nan_key", [False, True], ids=["clean", "nan_key"])
@pytest.mark.parametrize("causal,window,key", [(True, (BIG, 0), NAN_KEY), (False, (3, BIG), 0)],
                         ids=["causal_huge_left", "huge_right"])
def test_attention_huge_window_contract(device, sink_kind, nan_key, causal, window, key):
    """12 rows on 8 keys: causal with a left side of 2^31 - 2 (rows 0-3 see no key), and a
    right side of 2^31 - 2 with a left of 3 (the side that overflowed: every row masked)."""
    q = _randn(1, 12, 4, 32, device=device, seed=1).requires_grad_()
    k = _randn(1, 8, 2, 32, device=device, seed=2)
    v = _randn(1, 8, 2, 32, device=device, seed=3)
    if nan_key:
        k[:, key] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    sink = _sink(sink_kind, device)
    out, lse = fl.attention(q, k, v, causal=causal, window=window, sink=sink, return_lse=True)
    left, right = masks.normalize_window(causal, window)
    ref_out, ref_lse = R.attention(*(t.detach().double() for t in (q, k, v)), causal=causal,
                                   window=(left, right), return_lse=True,
                                   sink=None if sink is None else sink.double())
    ranges = [masks.key_range(i, 12, 8, left, right) for i in range(12)]
    empty = torch.tensor([lo == hi for lo, hi in ranges], device=device)
    assert empty.any() == causal
    _check(out[0], lse[0], ref_out[0], ref_lse[0], empty, sink)
    if nan_key:
        sees_nan = torch.tensor([lo <= key < hi for lo, hi in ranges], device=device)
        assert sees_nan.any() and not sees_nan.all()
        assert torch.isnan(out[0, sees_nan]).all()
        assert not torch.isnan(out[0, ~sees_nan]).any()
        return
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not any(torch.isnan(gr).any() for gr in grads)
    assert (grads[0][0, empty] == 0).all()


@pytest.mark.parametrize("nan_key", [False, True], ids=["clean", "nan_key"])
def test_varlen_huge_max_seqlen_contract(device, nan_key):
    """Three sequences (8, 12 and 5 rows on 9, 12 and 0 keys) with max_seqlen 2^16 above
    the rows: the third sequence's rows are empty, a NaN key of the second reaches its rows
    that see it and no other sequence's."""
    lq, lk = [8, 12, 5], [9, 12, 0]
    q = _randn(25, 4, 32, device=device, seed=4).requires_grad_()
    k = _randn(21, 2, 32, device=device, seed=5)
    v = _randn(21, 2, 32, device=device, seed=6)
    if nan_key:
        k[9 + NAN_KEY] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    cu_q = torch.tensor([0, 8, 20, 25], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 21, 21], dtype=torch.int32, device=device)
    with fl.value_checks(False):
        out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, 2**16, 2**16, causal=True,
                                       return_lse=True)
    ref_out, ref_lse = R.attention_varlen(*(t.detach().double() for t in (q, k, v)), cu_q,
                                          cu_k, max(lq), max(lk), causal=True,
                                          return_lse=True)
    empty = torch.arange(25, device=device) >= 20
    _check(out, lse, ref_out, ref_lse, empty, None)
    if nan_key:  # sequence 1's row i (of 12, on 12 keys) sees keys <= i
        sees_nan = torch.zeros(25, dtype=torch.bool, device=device)
        sees_nan[8 + NAN_KEY:20] = True
        assert torch.isnan(out[sees_nan]).all() and not torch.isnan(out[~sees_nan]).any()
        return
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not any(torch.isnan(gr).any() for gr in grads)
    assert (grads[0][empty] == 0).all()


@pytest.mark.parametrize("nan_key", [False, True], ids=["clean", "nan_key"])
@pytest.mark.parametrize("page", [None, 16], ids=lambda p: f"page{p}")
def test_kvcache_forced_splits_contract(device, nan_key, page):
    """A decode of three sequences with num_splits = 2^40: the one with no cached key is
    empty, a NaN key of another reaches only its rows."""
    q = _randn(3, 1, 4, 32, device=device, seed=7)
    kc = _randn(3, 64, 2, 32, device=device, seed=8)
    vc = _randn(3, 64, 2, 32, device=device, seed=9)
    lens = torch.tensor([40, 0, 64], dtype=torch.int32, device=device)
    if nan_key:
        kc[2, NAN_KEY] = float("nan")
    ref_out, ref_lse = R.attention_with_kvcache(q.double(), kc.double(), vc.double(),
                                                cache_seqlens=lens, return_lse=True)
    table = None
    if page is not None:
        kc, vc = kc.reshape(12, page, 2, 32), vc.reshape(12, page, 2, 32)
        table = torch.arange(12, dtype=torch.int32, device=device).view(3, 4)
    out, lse = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         num_splits=2**40, return_lse=True)
    empty = torch.tensor([False, True, False], device=device)
    _check(out[:, 0], lse[:, :, 0].T, ref_out[:, 0], ref_lse[:, :, 0].T, empty, None)
    nan_rows = torch.isnan(out[:, 0]).flatten(1).any(1)
    assert nan_rows.tolist() == [False, False, nan_key]
