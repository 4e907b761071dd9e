"""flash-attn drop-in signatures: same results as flashlse, honest LSE, clear refusals."""

import pytest
import torch

import flashlse
from flashlse import compat, reference


def test_flash_attn_func_empty_rows_have_neg_inf_lse():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16)
    out, lse, probs = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert probs is None
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.isneginf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    fa2 = flashlse.lse.from_canonical(lse, "fa2")
    assert torch.isposinf(fa2[:, :, :3]).all()


def test_flash_attn_varlen_func_window_size_minus_one_is_unbounded():
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    out = compat.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, window_size=(2, -1))
    ref = reference.attention_varlen(q, k, v, cu, cu, 5, 5, window=(2, None))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_flash_attn_with_kvcache_appends_and_returns_lse():
    torch.manual_seed(2)
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    k_new, v_new = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = compat.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                              causal=True, return_softmax_lse=True)
    ref_out, ref_lse = reference.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new, causal=True,
        return_lse=True)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(dropout_p=0.1), "dropout", id="dropout"),
    pytest.param(dict(alibi_slopes=torch.ones(2)), "ALiBi", id="alibi"),
])
def test_unsupported_arguments_raise(kwargs, match):
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match=match):
        compat.flash_attn_func(q, q, q, **kwargs)


def test_flash_attn_varlen_func_with_block_table():
    """vLLM's call: paged caches, block_table and seqused_k, cu_seqlens_k None."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 2, 16, generator=g)
    k_cache, v_cache = torch.randn(6, 4, 1, 16, generator=g), torch.randn(6, 4, 1, 16, generator=g)
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    used = torch.tensor([7, 3], dtype=torch.int32)
    cu_q = torch.tensor([0, 4, 5], dtype=torch.int32)
    out, lse, _ = compat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 4, 8,
                                                causal=True, return_attn_probs=True,
                                                seqused_k=used, block_table=table)
    ref_out, ref_lse = reference.attention_varlen(q, k_cache, v_cache, cu_q, None, 4, 8,
                                                  causal=True, seqused_k=used,
                                                  block_table=table, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def _last_dim_strided(t):
    """``t``'s values in a view whose last dim has stride 2 (flash-attn 2 copies such)."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def test_drop_ins_take_what_flash_attn_takes():
    """flash-attn 2 copies a q / k / v (and, with a cache, the lengths and block table)
    whose last dim is strided; flashlse's own functions refuse them (a packed tensor is
    asked for), and its drop-ins copy as flash-attn does: same results, gradients through
    the copy."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    with pytest.raises(ValueError, match="contiguous"):
        flashlse.attention(_last_dim_strided(q), k, v)
    qs = _last_dim_strided(q).requires_grad_()
    out = compat.flash_attn_func(qs, _last_dim_strided(k), _last_dim_strided(v), causal=True)
    want = compat.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    out.sum().backward()
    assert qs.grad is not None and qs.grad.shape == q.shape
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    got = compat.flash_attn_varlen_func(_last_dim_strided(q.flatten(0, 1)), k.flatten(0, 1)[:10],
                                        v.flatten(0, 1)[:10], cu, cu, 5, 5, causal=True)
    want = compat.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1)[:10],
                                         v.flatten(0, 1)[:10], cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # A paged cache: lengths and block table as strided views, a strided q.
    kc, vc = torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    qd = q[:, :1]
    got = compat.flash_attn_with_kvcache(_last_dim_strided(qd), kc, vc,
                                         cache_seqlens=_last_dim_strided(lens),
                                         block_table=_last_dim_strided(table),
                                         return_softmax_lse=True)
    want = compat.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, block_table=table,
                                          return_softmax_lse=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cache_seqlens must be contiguous"):
        flashlse.attention_with_kvcache(qd, kc, vc, cache_seqlens=_last_dim_strided(lens),
                                        block_table=table)


def test_packed_drop_ins_equal_the_unpacked_ones_with_gradients():
    """flash-attn 2's qkv- and kv-packed entry points (dense and varlen): the same out and
    lse as the unpacked call, and the gradient lands in the packed tensor."""
    torch.manual_seed(4)
    qkv = torch.randn(2, 6, 3, 4, 8, requires_grad=True)
    out, lse, _ = compat.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    q, k, v = (t.detach() for t in qkv.unbind(2))
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flashlse.attention(*leaves, causal=True).sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([t.grad for t in leaves], 2))
    kv = torch.stack([k, v], 2)
    torch.testing.assert_close(compat.flash_attn_kvpacked_func(q, kv, causal=True),
                               compat.flash_attn_func(q, k, v, causal=True))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    flat = qkv.detach().flatten(0, 1)
    got = compat.flash_attn_varlen_qkvpacked_func(flat, cu, 7, causal=True)
    fq, fk, fv = flat.unbind(1)
    torch.testing.assert_close(got, compat.flash_attn_varlen_func(fq, fk, fv, cu, cu, 7, 7,
                                                                  causal=True))
    got = compat.flash_attn_varlen_kvpacked_func(fq, torch.stack([fk, fv], 1), cu, cu, 7, 7,
                                                 window_size=(2, 0))
    torch.testing.assert_close(got, compat.flash_attn_varlen_func(fq, fk, fv, cu, cu, 7, 7,
                                                                  window_size=(2, 0)))


def test_flash_attn_with_kvcache_cache_batch_idx():
    """cache_batch_idx picks each sequence's row of a larger contiguous cache, read and
    appended to in place (a one-column block table over the cache's rows): the same out and
    lse as the reference over the picked rows, k / v written into those rows only."""
    torch.manual_seed(5)
    q = torch.randn(2, 2, 4, 8)
    k_cache, v_cache = torch.randn(5, 7, 2, 8), torch.randn(5, 7, 2, 8)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    lens = torch.tensor([2, 5], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = compat.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens,
                                              cache_batch_idx=idx, causal=True,
                                              return_softmax_lse=True)
    picked_k, picked_v = k_cache[idx.long()].clone(), v_cache[idx.long()].clone()
    ref_out, ref_lse = reference.attention_with_kvcache(
        q, picked_k, picked_v, cache_seqlens=lens, k_new=k_new, v_new=v_new, causal=True,
        return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    want_k = k_cache.clone()
    want_k[idx.long()] = picked_k  # (the reference appended into its own copy)
    assert torch.equal(kc, want_k) and not torch.equal(kc, k_cache)
    # No lengths: every picked row whole. Refusals: with a block table, int64, bad shape.
    whole = compat.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_batch_idx=idx)
    torch.testing.assert_close(whole.double(), reference.attention_with_kvcache(
        q[:, :1], k_cache[idx.long()], v_cache[idx.long()]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_table alone"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       cache_batch_idx=idx, block_table=idx.view(2, 1))
    with pytest.raises(TypeError, match="int32"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx.long())
    with pytest.raises(ValueError, match=r"\(B,\)"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx[:1])
    with pytest.raises(ValueError, match="block_table entries"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       cache_batch_idx=torch.tensor([3, 5], dtype=torch.int32))


@pytest.mark.parametrize("sink", [None, 0.7, float("-inf")], ids=["none", "finite", "neg_inf"])
def test_cache_batch_idx_lse_contract(sink):
    """cache_batch_idx's paged view (a one-column block table over the cache's rows) keeps
    the contract against the reference over the picked rows: a sequence of no key gives out
    0 and lse -inf (or the sink; a -inf sink is no sink), and a NaN key reaches exactly the
    queries that see it."""
    torch.manual_seed(6)
    q = torch.randn(2, 3, 4, 8)
    k_cache, v_cache = torch.randn(4, 6, 2, 8), torch.randn(4, 6, 2, 8)
    k_cache[2, 2, 0] = float("nan")  # picked row 2, key 2
    idx = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([0, 4], dtype=torch.int32)
    s = None if sink is None else torch.full((4,), sink)
    kw = dict(cache_seqlens=lens, causal=True, return_lse=True)
    if s is None:
        out, lse = compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                  cache_batch_idx=idx, causal=True,
                                                  return_softmax_lse=True)
    else:  # (compat takes no sink: the same table through attention_with_kvcache)
        out, lse = flashlse.attention_with_kvcache(q, k_cache, v_cache,
                                                   block_table=idx.view(2, 1), sink=s, **kw)
    ref_out, ref_lse = reference.attention_with_kvcache(
        q.double(), k_cache[idx.long()].double(), v_cache[idx.long()].double(),
        sink=None if s is None else s.double(), **kw)
    assert (out[0] == 0).all()
    assert (lse[0] == (float("-inf") if sink is None else sink)).all()
    # Sequence 1: 4 keys, 3 causal queries seeing keys 0-1, 0-2, 0-3: the NaN (kv head 0)
    # reaches queries 1 and 2 of query heads 0 and 1, nothing else.
    nan_rows = torch.zeros(3, 4, dtype=torch.bool)
    nan_rows[1:, :2] = True
    assert torch.equal(torch.isnan(out[1]).all(-1), nan_rows)
    assert torch.equal(torch.isnan(out[1]).any(-1), nan_rows)
    assert torch.equal(torch.isnan(lse[1]).t(), nan_rows)
    assert not torch.isnan(out[1, 0]).any() and not torch.isnan(out[0]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    ok = ~torch.isnan(ref_out)
    torch.testing.assert_close(out.double()[ok], ref_out[ok], atol=1e-5, rtol=1e-5)
    ok = ~torch.isnan(ref_lse)
    torch.testing.assert_close(lse.double()[ok], ref_lse[ok], atol=1e-5, rtol=1e-5)
