"""attention / attention_varlen are torch custom ops: torch.compile(fullgraph=True) traces
through them with no graph break, and opcheck finds their fake kernels and autograd sound."""

import pytest
import torch
from _flashlse_testing import assert_compiled_grads_match

import flashlse as fl


def _dense(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 7, 4, 16, generator=g).requires_grad_()
    k = torch.randn(2, 5, 2, 16, generator=g).requires_grad_()
    v = torch.randn(2, 5, 2, 8, generator=g).requires_grad_()
    sink = torch.randn(4, generator=g).requires_grad_()
    return q, k, v, sink


def _loss(q, k, v, sink):
    # causal with Sq > Sk: the first two rows are empty (lse = sink there).
    out, lse = fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    return (out * out).sum() + lse.sum()


def test_attention_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    assert_compiled_grads_match(_loss, _dense(0), lambda fn: torch.compile(
        fn, fullgraph=True, backend="aot_eager"))


def test_attention_has_no_graph_break():
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_loss)(*_dense(1))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def test_attention_varlen_compiles_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4, 10], dtype=torch.int32)
    q = torch.randn(9, 4, 16, generator=g).requires_grad_()
    k = torch.randn(10, 2, 16, generator=g).requires_grad_()
    v = torch.randn(10, 2, 16, generator=g).requires_grad_()

    def loss(q, k, v):
        out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, 6, 6, causal=True, return_lse=True)
        return out.sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()

    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, loss(q, k, v))
    assert torch.autograd.grad(got, [q])[0][:3].abs().sum() == 0  # sequence 0 has no keys


def test_attention_varlen_paged_compiles_fullgraph():
    """The paged forward is one opaque op (flashlse::attn_fwd_paged) with a sound fake."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(8)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    used = torch.tensor([5, 7], dtype=torch.int32)
    table = torch.tensor([[3, 0, 2], [1, 4, 5]], dtype=torch.int32)
    q = torch.randn(4, 4, 16, generator=g)
    kc, vc = torch.randn(6, 3, 1, 16, generator=g), torch.randn(6, 3, 1, 8, generator=g)

    def call(q, kc, vc):
        return fl.attention_varlen(q, kc, vc, cu_q, None, 3, 7, seqused_k=used,
                                   block_table=table, causal=True, return_lse=True)

    with torch.no_grad():
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, kc, vc)
        torch.testing.assert_close(got, call(q, kc, vc))
    args = (q, kc, vc, table, cu_q, 3, used, 7, None, None, 0, 0.0, 0.25)
    torch.library.opcheck(torch.ops.flashlse.attn_fwd_paged.default, args)


@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_opcheck_attn_fwd(with_sink):
    q, k, v, sink = _dense(3)
    args = (q, k, v, sink if with_sink else None, None, None, None, None, None, None, 0, 0.0,
            0.25, False)
    torch.library.opcheck(torch.ops.flashlse.attn_fwd.default, args)


def test_attention_compiles_with_dynamic_shapes():
    torch._dynamo.reset()
    args = _dense(4)
    got = torch.compile(_loss, fullgraph=True, dynamic=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, _loss(*args))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_compiles_fullgraph_with_append(dynamic, paged):
    """Lengths are data: the call is two opaque ops (append, attend), no data-dependent trace."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 12, 2, 16, generator=g), torch.randn(2, 12, 2, 8, generator=g)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 2, 2, 16, generator=g), torch.randn(2, 2, 2, 8, generator=g)
    extra = {}
    if paged:
        k_cache, v_cache = k_cache.view(6, 4, 2, 16), v_cache.view(6, 4, 2, 8)
        extra = dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32))

    def call(q, kc, vc):
        return fl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                         causal=True, return_lse=True, **extra)

    kc1, vc1 = k_cache.clone(), v_cache.clone()
    got = torch.compile(call, fullgraph=True, dynamic=dynamic, backend="aot_eager")(q, kc1, vc1)
    want = call(q, k_cache, v_cache)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc1, k_cache) and torch.equal(vc1, v_cache)  # appended in both


def test_merge_and_sparse_compile_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    outs, lses = torch.randn(3, 2, 4, 16, generator=g), torch.randn(3, 2, 4, generator=g)
    lses[:, 0] = float("-inf")
    merged = torch.compile(fl.merge_states, fullgraph=True, dynamic=True,
                           backend="aot_eager")(outs, lses)
    torch.testing.assert_close(merged, fl.merge_states(outs, lses))
    q, k, v, _ = _dense(7)
    idx = torch.randint(-1, 5, (2, 7, 2, 3), generator=g, dtype=torch.int32)
    sparse = torch.compile(fl.sparse_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(sparse(q, k, v, idx), fl.sparse_attention(q, k, v, idx))
