"""Repeated public calls launch through the compiled kernels' own launchers (``_common.Launch``)
and stay right when a later call differs in what Triton specialises on: a misaligned tensor,
another sink dtype. Counted by wrapping Triton's JIT entry (``JITFunction.run``). GPU only: the
interpreter has no compiled kernel to keep."""

from __future__ import annotations

import pytest
import torch
from _flashlse_testing import check_against_reference
from triton.runtime.jit import JITFunction

import flashlse as fl
import flashlse.reference as R

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def jit_calls(monkeypatch):
    calls = []
    real = JITFunction.run

    def run(self, *args, **kwargs):
        calls.append(getattr(self, "fn", self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", run)
    return calls


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _offset(x, elems):
    """``x``'s values in a tensor whose address is ``elems`` elements past an aligned one."""
    buf = torch.empty(x.numel() + elems, device=x.device, dtype=x.dtype)
    out = buf[elems:].view(x.shape)
    out.copy_(x)
    return out


def _check_attention(q, k, v, **kw):
    # grad=False: fl.attention gets these very tensors (their addresses), the reference copies.
    check_against_reference(lambda q, k, v: fl.attention(q, k, v, return_lse=True, **kw),
                            lambda q, k, v: R.attention(q, k, v, return_lse=True, **kw),
                            dict(q=q, k=k, v=v), grad=False)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
def test_repeated_attention_skips_the_jit_path(jit_calls, grad):
    # A length of each test's own: no plan of an earlier test is found.
    s = 301 if grad else 300
    q, k, v = (_rand(2, s, 4, 128) for _ in range(3))
    do = _rand(2, s, 4, 128)

    def call():
        qg, kg, vg = (x.detach().requires_grad_(grad) for x in (q, k, v))
        out = fl.attention(qg, kg, vg, causal=True)
        if grad:
            out.backward(do)
            return out, qg.grad, kg.grad, vg.grad
        return (out,)

    first = call()
    n_first = len(jit_calls)
    # Forward; backward: preprocess, dK/dV with dQ fused (Hopper) or dK/dV and dQ passes.
    assert n_first >= (3 if grad else 1)
    again = call()
    assert len(jit_calls) == n_first, f"JIT path taken again: {jit_calls[n_first:]}"
    for i, (a, b) in enumerate(zip(first, again)):
        # dq (index 1) of the fused backward is summed by TMA reduces in a varying order:
        # equal within a rounding of q's dtype; everything else bit for bit.
        tol = dict(rtol=1e-2, atol=1e-3) if i == 1 else dict(rtol=0, atol=0)
        torch.testing.assert_close(a, b, **tol)


def test_misaligned_then_aligned_inputs(jit_calls):
    q, k, v = (_rand(1, 257, 4, 64) for _ in range(3))
    _check_attention(q, k, v, causal=True)
    _check_attention(q, _offset(k, 1), v, causal=True)   # 2 bytes off: JIT path, no TMA
    _check_attention(q, k, _offset(v, 8), causal=True)   # 16 bytes off: aligned
    n = len(jit_calls)
    _check_attention(q, k, v, causal=True)
    assert len(jit_calls) == n


def test_decode_sink_dtype_change_recompiles():
    # Same plan key but another sink dtype: the kernel compiled for a float32 sink must not
    # read a bfloat16 one.
    q, kc = _rand(4, 1, 8, 128), _rand(4, 1000, 2, 128)
    lens = torch.tensor([1000, 3, 0, 517], dtype=torch.int32, device="cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        sink = torch.randn(8, device="cuda").to(dtype)
        kw = dict(cache_seqlens=lens, sink=sink, return_lse=True)
        check_against_reference(
            lambda q, kc, kw=kw: fl.attention_with_kvcache(q, kc, kc, **kw),
            lambda q, kc, kw=kw: R.attention_with_kvcache(q, kc, kc, **kw),
            dict(q=q, kc=kc), grad=False)


def _serving_calls():
    """The serving-side public calls, each on inputs of its own: decode (contiguous, paged
    64), merge_states, sparse_attention (flat; paged MLA top-k, the Hopper MLA kernel on an
    H100/H200)."""
    lens = torch.tensor([700, 3, 0, 517], dtype=torch.int32, device="cuda")
    q, kc = _rand(4, 1, 8, 128), _rand(4, 700, 2, 128)
    table = torch.randperm(4 * 11, device="cuda").view(4, 11).to(torch.int32)
    pages = _rand(4 * 11, 64, 2, 128)
    outs, lses = torch.randn(3, 64, 8, 128, device="cuda"), torch.randn(3, 64, 8, device="cuda")
    qs, ks = _rand(2, 5, 8, 64), _rand(2, 40, 2, 64)
    idx = torch.randint(-1, 40, (2, 5, 2, 16), device="cuda", dtype=torch.int32)
    qm, lat = _rand(3, 1, 64, 576), _rand(3 * 16, 64, 1, 576)
    lat_table = torch.randperm(3 * 16, device="cuda").view(3, 16).to(torch.int32)
    idx_m = torch.randint(-1, 1024, (3, 1, 1, 300), device="cuda", dtype=torch.int32)
    return {
        "decode": lambda: fl.attention_with_kvcache(q, kc, kc, cache_seqlens=lens,
                                                    return_lse=True),
        "decode paged": lambda: fl.attention_with_kvcache(q, pages, pages, cache_seqlens=lens,
                                                          block_table=table, return_lse=True),
        "merge_states": lambda: fl.merge_states(outs, lses),
        "sparse": lambda: fl.sparse_attention(qs, ks, ks, idx, return_lse=True),
        "sparse paged MLA": lambda: fl.sparse_attention(qm, lat, lat[..., :512], idx_m,
                                                        block_table=lat_table,
                                                        return_lse=True),
    }


@pytest.mark.parametrize("name", ["decode", "decode paged", "merge_states", "sparse",
                                  "sparse paged MLA"])
def test_repeated_serving_calls_skip_the_jit_path(jit_calls, name):
    # After its first call, a public call launches every kernel through the compiled
    # kernels' own launchers (the host time issue 15 counts), with the same answer.
    call = _serving_calls()[name]
    with torch.no_grad():
        first = call()
        n_first = len(jit_calls)
        assert n_first >= 1
        again = call()
    assert len(jit_calls) == n_first, f"JIT path taken again: {jit_calls[n_first:]}"
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_growing_cache_reuses_the_compiled_kernels(jit_calls, layout):
    # A decode row over a cache one key longer each call (transformers' generate, its first
    # layer each step; "bhsd": its (B, H, S, D) cache seen as (B, S, H, D)) makes a new plan
    # each call. Its launches find the kernels an earlier plan of the same argument classes
    # compiled (_common._SHARED: these lengths are not multiples of 16 and cut into the
    # same tiles) and take no JIT path; the answer is the reference's.
    q = _rand(1, 1, 32, 128)
    if layout == "bshd":
        buf = _rand(1, 4200, 8, 128)
        cache = lambda n: buf[:, :n]  # noqa: E731
    else:
        cache = lambda n: _rand(1, 8, n, 128).transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        _check_attention(q, cache(4097), cache(4097), causal=True)
        n = len(jit_calls)
        for length in (4098, 4099, 4101):
            k, v = cache(length), cache(length)
            _check_attention(q, k, v, causal=True)
    assert len(jit_calls) == n, f"JIT path taken for a new length: {jit_calls[n:]}"
