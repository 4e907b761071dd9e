"""torch.compile(fullgraph=True) of the public functions where they run the kernels' launchers
(CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; tests/test_compile.py covers the
PyTorch path): the compiled call traces with no graph break, with static shapes and with
dynamic=True, and equals the eager one, for the forward and, where there is one, the
backward. The launchers read addresses and keep plans,
which the tracer cannot follow: each kernel sits behind a torch custom op. Issue 15 asks every
public function to trace this way."""

from __future__ import annotations

import pytest
import torch
from _flashlse_testing import assert_compiled_grads_match

import flashlse as fl
from flashlse import reference


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=[False, True], ids=["static", "dynamic"])
def _compiled(request):
    """torch.compile(fullgraph=True) with static shapes, and with dynamic=True (symbolic
    shapes through the custom ops' fake kernels)."""
    return lambda fn: torch.compile(fn, fullgraph=True, dynamic=request.param,
                                    backend="aot_eager")


def _rand(g, device, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=g).to(device, dtype)


def test_merge_states_and_merge_compile_fullgraph(device, _compiled):
    g = torch.Generator().manual_seed(7)
    outs = _rand(g, device, 3, 2, 8, 4, 64)
    lses = (torch.randn(3, 2, 8, 4, generator=g) * 3).to(device)
    lses[:, 0, 0] = float("-inf")  # a row empty in every state
    lses[1, 1, 2] = float("-inf")  # a row empty in one state
    with torch.no_grad():
        got = _compiled(fl.merge_states)(outs, lses)
        want = fl.merge_states(outs, lses)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (got[0][0, 0] == 0).all() and torch.isneginf(got[1][0, 0]).all()
        ref = reference.merge_states(outs, lses)
        torch.testing.assert_close(got[0].double(), ref[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(got[1].double(), ref[1], atol=1e-5, rtol=0)
        # A sink over dim 1: -inf at 0 (no sink: rows [0, 0] stay (0, -inf)), finite at 5,
        # where rows [1, 5] see no state and take (0, sink).
        sink = torch.randn(8, 1, generator=g).to(device)
        sink[0] = float("-inf")
        lses_s = lses.clone()
        lses_s[:, 1, 5] = float("-inf")
        got = _compiled(fl.merge_states)(outs, lses_s, sink=sink)
        torch.testing.assert_close(got, fl.merge_states(outs, lses_s, sink=sink), rtol=0,
                                   atol=0)
        assert (got[0][0, 0] == 0).all() and torch.isneginf(got[1][0, 0]).all()
        assert (got[0][1, 5] == 0).all() and (got[1][1, 5] == sink[5, 0]).all()
        # A NaN lse reaches exactly its row, not an empty-looking one.
        lses_nan = lses.clone()
        lses_nan[2, 1, 3, 1] = float("nan")
        got = _compiled(fl.merge_states)(outs, lses_nan)
        nan = torch.zeros(2, 8, 4, dtype=torch.bool, device=device)
        nan[1, 3, 1] = True
        assert torch.equal(torch.isnan(got[1]), nan)
        assert torch.equal(torch.isnan(got[0]).all(-1), nan)
        assert not torch.isnan(got[0][~nan]).any()
        pair = _compiled(fl.merge)
        for layout, lse_a, lse_b in (("rows", lses[0], lses[1]),
                                     ("flash", lses[0].transpose(-1, -2),
                                      lses[1].transpose(-1, -2))):
            got = pair(outs[0], lse_a, outs[1], lse_b, layout=layout)
            want = fl.merge(outs[0], lse_a, outs[1], lse_b, layout=layout)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sparse_attention_compiles_fullgraph_forward_and_backward(device, _compiled):
    g = torch.Generator().manual_seed(8)
    q, k, v = (_rand(g, device, *s) for s in ((2, 16, 4, 64), (2, 40, 2, 64), (2, 40, 2, 64)))
    sink = torch.randn(4, generator=g).to(device)
    idx = torch.randint(-1, 40, (2, 16, 2, 8), generator=g, dtype=torch.int32).to(device)
    idx[0, 0] = -1  # rows that see no key: lse = sink there
    with torch.no_grad():
        got = _compiled(fl.sparse_attention)(q, k, v, idx, sink=sink, return_lse=True)
        torch.testing.assert_close(got, fl.sparse_attention(q, k, v, idx, sink=sink,
                                                            return_lse=True))
        ref = reference.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
        torch.testing.assert_close(got[0].double(), ref[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(got[1].double(), ref[1], atol=1e-3, rtol=0)
        assert (got[0][0, 0] == 0).all() and torch.equal(got[1][0, :, 0], sink)
        # A NaN key reaches exactly the rows whose lists hold it (kv head 0's query heads).
        k_nan = k.clone()
        k_nan[1, 5, 0] = float("nan")
        out_n, lse_n = _compiled(fl.sparse_attention)(q, k_nan, v, idx, sink=sink,
                                                       return_lse=True)
        sees = (idx[1, :, 0] == 5).any(-1)  # (Sq,)
        want = torch.zeros(2, 4, 16, dtype=torch.bool, device=device)
        want[1, :2] = sees
        assert torch.equal(torch.isnan(lse_n), want)
        assert torch.equal(torch.isnan(out_n).any(-1), want.transpose(1, 2))
    # The backward: the op's registered autograd against eager's autograd.Function.
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]

    def loss(q, k, v, sink):
        out, lse = fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
        return (out * out).sum() + lse.sum()

    assert_compiled_grads_match(loss, leaves, _compiled)


def test_paged_sparse_attention_compiles_fullgraph(device, _compiled):
    g = torch.Generator().manual_seed(9)
    q = _rand(g, device, 2, 4, 4, 64)
    k_cache, v_cache = (_rand(g, device, 6, 16, 2, 64) for _ in range(2))
    block_table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32, device=device)
    idx = torch.randint(-1, 48, (2, 4, 2, 8), generator=g, dtype=torch.int32).to(device)
    with torch.no_grad():
        call = lambda *a: fl.sparse_attention(*a, block_table=block_table, return_lse=True)
        torch.testing.assert_close(_compiled(call)(q, k_cache, v_cache, idx),
                                   call(q, k_cache, v_cache, idx))


def test_attention_with_kvcache_compiles_fullgraph(device, _compiled):
    g = torch.Generator().manual_seed(10)
    q = _rand(g, device, 2, 3, 4, 64)
    k_cache, v_cache = (_rand(g, device, 2, 40, 2, 64) for _ in range(2))
    lens = torch.tensor([0, 29], dtype=torch.int32, device=device)  # sequence 0 sees no key
    with torch.no_grad():
        call = lambda q, k, v: fl.attention_with_kvcache(q, k, v, cache_seqlens=lens,
                                                         causal=True, return_lse=True)
        got = _compiled(call)(q, k_cache, v_cache)
        want = call(q, k_cache, v_cache)
        torch.testing.assert_close(got, want)
        assert torch.isneginf(got[1][0]).all() and (got[0][0] == 0).all()
        ref = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                               causal=True, return_lse=True)
        torch.testing.assert_close(got[0].double(), ref[0], atol=2e-3, rtol=0)
        torch.testing.assert_close(got[1].double(), ref[1], atol=1e-3, rtol=0)
