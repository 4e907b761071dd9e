"""Calls on cuda:1 tensors while cuda:0 is current (a model split over two GPUs) give the
same bits as with cuda:1 current, on the full path and the kept one, and leave cuda:0
current. Needs two GPUs (``gpu``); the guard's logic is tested on the CPU in
tests/test_device_guard.py."""

from __future__ import annotations

import pytest
import torch

import flashlse as fl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]


def _calls(dev):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)
    q, k, v = mk(2, 256, 8, 128), mk(2, 256, 2, 128), mk(2, 256, 2, 128)
    lens = torch.tensor([100, 256], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 256, 512], dtype=torch.int32, device=dev)
    table = torch.arange(32, dtype=torch.int32, device=dev).view(2, 16)
    pages = k.reshape(32, 16, 2, 128)
    idx = torch.randint(-1, 256, (2, 4, 2, 64), generator=g).to(dev, torch.int32)
    lse = torch.randn(3, 2, 8, 64, generator=g).to(dev)
    outs = torch.randn(3, 2, 8, 64, 128, generator=g).to(dev)

    def train():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fl.attention(*leaves, causal=True, deterministic=True)  # (bits to compare)
        out.float().square().sum().backward()
        return [out] + [t.grad for t in leaves]

    return {
        "attention": lambda: fl.attention(q, k, v, causal=True, return_lse=True),
        "attention fwd+bwd": train,
        "attention_varlen": lambda: fl.attention_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 256, 256, causal=True,
            return_lse=True),
        "kvcache decode": lambda: fl.attention_with_kvcache(q[:, -1:], k, v,
                                                            cache_seqlens=lens,
                                                            return_lse=True),
        "kvcache paged chunk": lambda: fl.attention_with_kvcache(
            q[:, :32], pages, pages, cache_seqlens=lens, block_table=table, causal=True,
            return_lse=True),
        "sparse": lambda: fl.sparse_attention(q[:, :4], k, v, idx, return_lse=True),
        "merge_states": lambda: fl.merge_states(outs, lse),
        "merge": lambda: fl.merge(outs[0], lse[0], outs[1], lse[1]),
    }


@pytest.mark.parametrize("name", list(_calls("cpu")))
def test_calls_on_the_second_gpu_with_the_first_current(name):
    with torch.cuda.device(1):
        want = _calls("cuda:1")[name]()
        torch.cuda.synchronize()
    call = _calls("cuda:1")[name]
    torch.cuda.set_device(0)
    for _ in range(2):  # (the second: the kept plan)
        got = call()
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)
        for a, b in zip(got if isinstance(got, (tuple, list)) else [got],
                        want if isinstance(want, (tuple, list)) else [want]):
            assert a.device == torch.device("cuda", 1)
            assert torch.equal(a, b), name
