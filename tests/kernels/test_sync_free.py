"""The default CUDA path of every public function runs with no host-device sync.

Each test warms the call up once outside the check (the first call compiles kernels,
which may sync), then runs it again under ``torch.cuda.set_sync_debug_mode("error")``,
where any synchronizing CUDA call raises; results are checked after leaving the mode
(reading them syncs). Inputs are made before entering the mode: a host-to-device copy
syncs too. Value checks that must read GPU tensors run only inside ``fl.value_checks()``:
the last tests check both sides of that switch. GPU only: the interpreter has no streams.
"""

from __future__ import annotations

import pytest
import torch

import flashlse as fl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16


def sync_free(fn):
    """``fn()`` once to warm up, then ``fn()`` again with every host-device sync an error;
    returns the second call's result."""
    fn()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = fn()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return result


def randn(*shape, dtype=BF16, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=requires_grad)


def assert_finite(*tensors):
    for t in tensors:
        assert bool(torch.isfinite(t).all()), f"non-finite values in a {tuple(t.shape)} tensor"


def assert_lse(lse):
    """A canonical lse: finite, or -inf for an empty row; never NaN or +inf."""
    assert not bool(torch.isnan(lse).any() or torch.isposinf(lse).any())


ATTN_CASES = ["causal", "sink", "window"]


def attn_kw(name):
    """Keywords of an attention case (made on the GPU before the check: a copy syncs)."""
    if name == "sink":
        return dict(causal=True, sink=torch.randn(8, device="cuda"))
    return dict(causal=True) if name == "causal" else dict(window=(64, 16))


@pytest.mark.parametrize("name", ATTN_CASES)
def test_attention_forward(name):
    q, k, v = randn(2, 300, 8, 128), randn(2, 400, 2, 128), randn(2, 400, 2, 128)
    kw = attn_kw(name)
    out, lse = sync_free(lambda: fl.attention(q, k, v, return_lse=True, **kw))
    assert_finite(out)
    assert_lse(lse)


@pytest.mark.parametrize("name", ATTN_CASES)
def test_attention_forward_backward(name):
    q = randn(2, 300, 8, 128, requires_grad=True)
    k, v = (randn(2, 400, 2, 128, requires_grad=True) for _ in range(2))
    dout = randn(2, 300, 8, 128)
    kw = attn_kw(name)

    def step():
        out = fl.attention(q, k, v, **kw)
        return torch.autograd.grad(out, (q, k, v), dout)

    assert_finite(*sync_free(step))


@pytest.mark.parametrize("seqused", [False, True], ids=["all_keys", "seqused_k"])
def test_attention_varlen_forward_backward(seqused):
    lens_q, lens_k = [100, 0, 300, 37], [120, 50, 300, 200]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).int().cuda()
    used = torch.tensor([120, 10, 0, 150], dtype=torch.int32).cuda() if seqused else None
    q = randn(sum(lens_q), 8, 128, requires_grad=True)
    k, v = (randn(sum(lens_k), 2, 128, requires_grad=True) for _ in range(2))
    dout = randn(sum(lens_q), 8, 128)

    def step():
        out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                       seqused_k=used, causal=True, return_lse=True)
        return (out.detach(), lse.detach()) + torch.autograd.grad(out, (q, k, v), dout)

    out, lse, *grads = sync_free(step)
    assert_finite(out, *grads)
    assert_lse(lse)


def test_attention_varlen_persistent_forward():
    """The persistent varlen forward (on an H100/H200: more row blocks x heads than SMs, so
    its block list is made on the device): no sync either."""
    lens = [100, 0, 300, 37, 700]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int().cuda()
    q = randn(sum(lens), 32, 128)
    k, v = (randn(sum(lens), 4, 128) for _ in range(2))
    out, lse = sync_free(lambda: fl.attention_varlen(q, k, v, cu, cu, max(lens), max(lens),
                                                     causal=True, return_lse=True))
    assert_finite(out)
    assert_lse(lse)


def _cache(paged, b=4, hkv=2, d=128, page=64, pages=64):
    """A bf16 cache of ``pages * page`` positions a sequence, and its block table if paged."""
    if not paged:
        k = randn(b, pages * page, hkv, d)
        return k, torch.randn_like(k), None
    k = randn(b * pages, page, hkv, d)
    table = torch.randperm(b * pages, device="cuda").view(b, pages).int()
    return k, torch.randn_like(k), table


@pytest.mark.parametrize("num_splits", [0, 4])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_attention_with_kvcache(paged, append, num_splits):
    k_cache, v_cache, table = _cache(paged)
    lens = torch.tensor([0, 100, 1000, 3000], dtype=torch.int32, device="cuda")
    q = randn(4, 1, 16, 128)
    k_new = randn(4, 1, 2, 128) if append else None
    v_new = randn(4, 1, 2, 128) if append else None
    # The append writes the same tokens at the same places each call: the warm-up and the
    # checked call see the same cache.
    out, lse = sync_free(lambda: fl.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new,
        num_splits=num_splits, return_lse=True))
    assert_finite(out)
    assert_lse(lse)
    if not append:  # sequence 0 has no key: the empty row
        assert bool(torch.isneginf(lse[0]).all()) and not bool(out[0].any())


@pytest.mark.parametrize("num_splits", [0, 4])
def test_attention_with_kvcache_whole_cache(num_splits):
    k_cache, v_cache, _ = _cache(False)
    q = randn(4, 1, 16, 128)
    out, lse = sync_free(lambda: fl.attention_with_kvcache(
        q, k_cache, v_cache, num_splits=num_splits, return_lse=True))
    assert_finite(out, lse)


def test_merge_states_and_merge():
    outs = randn(3, 4, 100, 8, 128)
    lses = torch.randn(3, 4, 100, 8, device="cuda") * 3
    lses[0, :, :10] = float("-inf")
    lses[:, 0, :5] = float("-inf")  # all three states empty: the sink alone
    sink = torch.randn(8, device="cuda")
    out, lse = sync_free(lambda: fl.merge_states(outs, lses, sink=sink))
    out2, lse2 = sync_free(lambda: fl.merge(outs[0], lses[0], outs[1], lses[1]))
    assert_finite(out, lse, out2)
    assert_lse(lse2)


def test_sparse_attention_forward_backward():
    q = randn(2, 64, 8, 128, requires_grad=True)
    k, v = (randn(2, 256, 2, 128, requires_grad=True) for _ in range(2))
    idx = torch.randint(0, 256, (2, 64, 2, 32), device="cuda", dtype=torch.int32)
    idx[..., 24:] = -1
    idx[0, 0] = -1  # a row with no key
    dout = randn(2, 64, 8, 128)
    out, lse = sync_free(lambda: fl.sparse_attention(q, k, v, idx, return_lse=True))
    assert_finite(out)
    assert_lse(lse)

    def step():
        out = fl.sparse_attention(q, k, v, idx)
        return torch.autograd.grad(out, (q, k, v), dout)

    assert_finite(*sync_free(step))


def test_lse_to_canonical():
    lse = torch.randn(4, 8, 100, device="cuda")
    lse[:, :, :7] = float("inf")  # flash-attn 2 marks empty rows +inf
    got = sync_free(lambda: fl.lse.to_canonical(lse, "fa2"))
    assert bool(torch.isneginf(got[:, :, :7]).all())
    assert_finite(got[:, :, 7:])


def _bad_lengths_call():
    # Capacity 256 a sequence; the last sequence claims far more (past the allocation).
    k_cache, v_cache = randn(2, 256, 2, 128), randn(2, 256, 2, 128)
    lens = torch.tensor([100, 256 + 1000], dtype=torch.int32, device="cuda")
    q = randn(2, 1, 16, 128)
    return lambda: fl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)


def test_value_checks_raise_on_bad_cache_seqlens():
    call = _bad_lengths_call()
    with fl.value_checks(), pytest.raises(ValueError, match="cache_seqlens"):
        call()


def test_bad_cache_seqlens_unchecked_do_not_crash():
    # Without value_checks() nothing reads the lengths on the host: no error is raised, and
    # the kernel must stay memory-safe; rows whose length is in range are still right.
    out = _bad_lengths_call()()
    torch.cuda.synchronize()
    assert_finite(out[0])
