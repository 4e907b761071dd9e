"""The CUDA paths capture into CUDA graphs and replay to the same result: prefill
forward + backward through the custom ops, and split-KV decode with in-place append
(the case graphs exist for). GPU only: the interpreter has no graphs."""

import pytest
import torch

import flashlse as fl

pytestmark = pytest.mark.gpu


def _capture(fn):
    # Warm up on a side stream (compiles kernels, sets up allocators), then capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def test_attention_forward_backward_graph_replay():
    torch.manual_seed(0)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(8, device="cuda")
    dout = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        out, lse = fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out, lse, dq, dk, dv

    # Detached, so that no autograd graph (and none of its AccumulateGrad nodes, made on the
    # default stream) outlives the call: the capture would otherwise wait on that stream.
    eager = [t.detach() for t in step()]
    graph, static = _capture(step)
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    fresh = step()
    # Bit for bit, dq too: on an H100/H200 the default backward adds dq by TMA reduces in a
    # varying order, but Sk = 200 is two 128-key blocks, and two adds into zero commute.
    for got, want in zip(static, fresh):
        assert torch.equal(got, want)
    # causal with Sq > Sk: the first 100 rows see only the sink.
    assert torch.equal(static[1][:, :, :100], sink.view(1, 8, 1).expand(2, 8, 100))
    assert not any(torch.isnan(t).any() for t in static)
    assert not torch.equal(static[0], eager[0])


def test_attention_varlen_persistent_graph_replay():
    """The persistent varlen forward (on an H100/H200 at D = 128: its block list made on the
    device into a buffer of the call) captures, and a replay with new lengths in cu_seqlens
    lists the new blocks: the same result as an eager call on them."""
    torch.manual_seed(1)
    n = 1400
    q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, 100, 400, 437, 1137], dtype=torch.int32, device="cuda")

    def step():
        return fl.attention_varlen(q, k, v, cu, cu, 700, 700, causal=True, return_lse=True)

    graph, (out, lse) = _capture(step)
    cu.copy_(torch.tensor([0, 700, 750, 1000, 1300, 1400], dtype=torch.int32))
    graph.replay()
    want, want_lse = step()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def _replay_equals_eager(step, change):
    """Captures ``step`` (returning ``(out, lse)``), runs ``change()`` on its inputs, replays:
    the graph's outputs equal a fresh eager step's bit for bit. Returns the graph's."""
    graph, (out, lse) = _capture(step)
    with torch.no_grad():
        change()
    graph.replay()
    want_out, want_lse = step()
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    return out, lse


def _decode_inputs(paged, b, hq, hkv, d, page=64):
    """q (B, 1, Hq, D), bf16 caches of 64 pages a sequence (contiguous, or paged with a
    shuffled block table), and lengths from 0 to 3000."""
    lens = torch.tensor([0, 100, 1000, 3000][:b], dtype=torch.int32, device="cuda")
    if paged:
        k_cache = torch.randn(b * 64, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(b * 64, device="cuda").view(b, 64).int()
    else:
        k_cache = torch.randn(b, 64 * page, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = None
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    return q, k_cache, torch.randn_like(k_cache), lens, table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_with_append_graph_replay(paged):
    torch.manual_seed(1)
    b, hq, hkv, d = 4, 16, 2, 128
    q, k_cache, v_cache, lens, table = _decode_inputs(paged, b, hq, hkv, d)
    k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)

    def step():
        return fl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                         block_table=table, k_new=k_new, v_new=v_new,
                                         return_lse=True)

    def change():
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        lens.add_(1)

    out, _ = _replay_equals_eager(step, change)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_and_merge_kept_plans_graph_replay(paged):
    """A serving step without an append: after its first call ``attention_with_kvcache`` and
    ``merge_states`` launch the plans kept by their keys (ops/kvcache._KEPT, ops/merge._KEPT),
    also while a graph captures. Replayed on new q and lengths, the graph gives the eager
    call's answer, and the full path (value checks on: it reads the lengths) gives the same
    bits."""
    import importlib

    kv_mod = importlib.import_module("flashlse.ops.kvcache")
    merge_mod = importlib.import_module("flashlse.ops.merge")
    torch.manual_seed(2)
    b, hq, hkv, d = 4, 16, 2, 128
    q, k_cache, v_cache, lens, table = _decode_inputs(paged, b, hq, hkv, d)
    other = torch.randn(b, 1, hq, d, device="cuda"), torch.randn(b, hq, 1, device="cuda")

    def step():
        out, lse = fl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                             block_table=table, return_lse=True)
        return fl.merge_states(torch.stack([out.float(), other[0]]),
                               torch.stack([lse, other[1]]), layout="flash")

    kv_mod._KEPT.clear()
    merge_mod._KEPT.clear()
    step()
    assert len(kv_mod._KEPT) == 1 and len(merge_mod._KEPT) == 1

    def change():
        q.copy_(torch.randn_like(q))
        lens.add_(7)

    out, lse = _replay_equals_eager(step, change)
    with fl.value_checks():
        full_out, full_lse = step()
    torch.testing.assert_close(full_out, out, atol=0, rtol=0)
    torch.testing.assert_close(full_lse, lse, atol=0, rtol=0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def test_attention_kept_forward_graph_replay():
    """An inference forward (no grad) launches the launch kept by its key after its first
    call (ops/attention._KEPT), also while a graph captures; replayed on new inputs the graph
    gives the eager call's bits, and the full path (the kept launches dropped) the same."""
    import importlib

    attn_mod = importlib.import_module("flashlse.ops.attention")
    torch.manual_seed(3)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 200, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sink = torch.randn(8, device="cuda")

    def step():
        with torch.no_grad():
            return fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)

    attn_mod._KEPT.clear()
    step()
    assert len(attn_mod._KEPT) == 1

    def change():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))

    out, lse = _replay_equals_eager(step, change)
    attn_mod._KEPT.clear()
    full_out, full_lse = step()
    torch.testing.assert_close(full_out, out, atol=0, rtol=0)
    torch.testing.assert_close(full_lse, lse, atol=0, rtol=0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_kept_chunk_graph_replay(paged):
    """A chunk (64 query rows) launches what its first call kept (ops/kvcache._CHUNK_KEPT) on
    the row starts kept for its stream (kernels/_common.row_starts); a capture makes fresh
    ones, so that a replay after the kept ones are dropped and their memory reused still
    reads the right starts: the graph gives the eager call's bits on new q and lengths."""
    import importlib

    kv_mod = importlib.import_module("flashlse.ops.kvcache")
    common = importlib.import_module("flashlse.kernels._common")
    torch.manual_seed(4)
    b, hq, hkv, d = 4, 16, 2, 128
    q1, k_cache, v_cache, lens, table = _decode_inputs(paged, b, hq, hkv, d)
    q = torch.randn(b, 64, hq, d, device="cuda", dtype=torch.bfloat16)

    def step():
        return fl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                         block_table=table, causal=True, return_lse=True)

    kv_mod._CHUNK_KEPT.clear()
    step()
    assert len(kv_mod._CHUNK_KEPT) == 1
    graph, (out, lse) = _capture(step)
    common._ROW_STARTS.clear()
    torch.cuda.synchronize()
    junk = [torch.full((4096,), -7, dtype=torch.int32, device="cuda") for _ in range(8)]
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
        lens.add_(5)
    graph.replay()
    del junk  # (held over the replay: the dropped starts' memory is not theirs again)
    want_out, want_lse = step()
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert not torch.isnan(out).any()
