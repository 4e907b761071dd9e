"""Window sides near 2^31: the kernels bound a row's keys by ``row + shift + right`` in int32,
and a side of 2^31 - 2 overflowed there (a window of (4, 2^31 - 2) masked every key: out 0,
lse -inf, where it sees the keys of (4, None)). Sides of 2^30 or more are unbounded
(``masks.UNBOUNDED``); every public kernel path gives the unbounded side's
answer and the float64 reference's, forward and backward."""

from __future__ import annotations

import pytest
import torch

import flashlse as fl
from flashlse import reference

BIG = 2**31 - 2
# (window as passed, the same window with its huge sides unbounded)
WINDOWS = [((4, BIG), (4, None)), ((BIG, 0), (None, 0)), ((BIG, BIG), (None, None)),
           ((2**30, 3), (None, 3)), ((5, 2**30 - 1), (5, 2**30 - 1))]
IDS = ["right", "left", "both", "left_2^30", "right_2^30-1"]


def _inputs(device, b, sq, sk, hq=4, hkv=2, d=32, grad=False):
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    dt = torch.float16
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device, dt)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _close(got, want, atol=2e-3):
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


@pytest.mark.parametrize("window,plain", WINDOWS, ids=IDS)
def test_attention_huge_window_sides(device, window, plain):
    q, k, v = _inputs(device, 2, 24, 40, grad=True)
    out, lse = fl.attention(q, k, v, window=window, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out_p, lse_p = fl.attention(q, k, v, window=plain, return_lse=True)
    grads_p = torch.autograd.grad(out_p, (q, k, v), dout)
    ref, ref_lse = reference.attention(*(t.detach().double() for t in (q, k, v)),
                                       window=plain, return_lse=True)
    assert torch.isfinite(lse).all()
    _close(out, ref)
    _close(lse, ref_lse)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    for g, gp in zip(grads, grads_p):
        assert torch.equal(g, gp)


@pytest.mark.parametrize("window,plain", WINDOWS, ids=IDS)
def test_attention_varlen_and_kvcache_huge_window_sides(device, window, plain):
    # Three sequences of 5 / 17 / 1 query rows on 9 / 30 / 12 keys, packed.
    q, k, v = _inputs(device, 1, 23, 51)
    q, k, v = q[0], k[0], v[0]
    cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 39, 51], dtype=torch.int32, device=device)
    out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, 17, 30, window=window, return_lse=True)
    for s0, s1, t0, t1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                              cu_k[1:].tolist()):
        ref, ref_lse = reference.attention(q[None, s0:s1].double(), k[None, t0:t1].double(),
                                           v[None, t0:t1].double(), window=plain,
                                           return_lse=True)
        _close(out[s0:s1], ref[0])
        _close(lse[:, s0:s1], ref_lse[0])
    # A decode step against a cache (each row at its sequence's end): the same answer.
    qd, kc, vc = _inputs(device, 3, 1, 48)
    seqlens = torch.tensor([48, 20, 1], dtype=torch.int32, device=device)
    got, got_lse = fl.attention_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, window=window,
                                             return_lse=True)
    want, want_lse = fl.attention_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, window=plain,
                                               return_lse=True)
    assert torch.isfinite(got_lse).all()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    for i, n in enumerate(seqlens.tolist()):
        ref, ref_lse = reference.attention(qd[i:i + 1].double(), kc[i:i + 1, :n].double(),
                                           vc[i:i + 1, :n].double(), window=plain,
                                           return_lse=True)
        _close(got[i:i + 1], ref)
        _close(got_lse[i:i + 1], ref_lse)
