"""torch.compile(fullgraph=True) of the merge and sparse public functions on CUDA tensors,
where they run the kernels' launchers (tests/test_compile.py covers the CPU, where the
PyTorch path runs): the compiled call traces without a graph break and equals the eager
one. Issue 15 asks every public function to trace this way."""

from __future__ import annotations

import pytest
import torch

import flashlse as fl


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _states(g, n=3):
    outs = torch.randn(n, 2, 8, 4, 64, generator=g).to("cuda", torch.bfloat16)
    lses = torch.randn(n, 2, 8, 4, generator=g).cuda() * 3
    lses[:, 0, 0] = float("-inf")  # a row empty in every state
    return outs, lses


@pytest.mark.gpu
def test_merge_states_and_merge_compile_fullgraph_on_gpu():
    g = torch.Generator().manual_seed(7)
    outs, lses = _states(g)
    with torch.no_grad():
        got = torch.compile(fl.merge_states, fullgraph=True, backend="aot_eager")(outs, lses)
        want = fl.merge_states(outs, lses)
        torch.testing.assert_close(got, want)
        pair = torch.compile(fl.merge, fullgraph=True, backend="aot_eager")
        got = pair(outs[0], lses[0], outs[1], lses[1], layout="rows")
        want = fl.merge(outs[0], lses[0], outs[1], lses[1], layout="rows")
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_sparse_attention_compiles_fullgraph_on_gpu():
    g = torch.Generator().manual_seed(8)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)
    q, k, v = mk(2, 16, 4, 64), mk(2, 40, 2, 64), mk(2, 40, 2, 64)
    idx = torch.randint(-1, 40, (2, 16, 2, 8), generator=g, dtype=torch.int32).cuda()
    with torch.no_grad():
        got = torch.compile(fl.sparse_attention, fullgraph=True, backend="aot_eager")(q, k, v,
                                                                                    idx)
        torch.testing.assert_close(got, fl.sparse_attention(q, k, v, idx))
