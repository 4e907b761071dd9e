"""attention / attention_varlen are torch custom ops: torch.compile(fullgraph=True) traces
through them with no graph break, and opcheck finds their fake kernels and autograd sound."""

import pytest
import torch

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
    args = _dense(0)
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    grads = torch.autograd.grad(got, args)
    want = _loss(*args)
    want_grads = torch.autograd.grad(want, args)
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, want_grads):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w)


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


@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_opcheck_attn_fwd(with_sink):
    q, k, v, sink = _dense(3)
    args = (q, k, v, sink if with_sink else None, None, None, None, None, None, None, 0, 0.0,
            0.25, False)
    torch.library.opcheck(torch.ops.flashlse.attn_fwd.default, args)
