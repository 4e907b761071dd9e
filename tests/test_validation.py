"""Bad inputs raise ValueError/TypeError that say what was expected and what came,
before any computation (the compute entry points are patched to fail if reached)."""

import importlib

import pytest
import torch

import flashlse as fl

attn_mod = importlib.import_module("flashlse.ops.attention")
kv_mod = importlib.import_module("flashlse.ops.kvcache")
sparse_mod = importlib.import_module("flashlse.ops.sparse")
merge_mod = importlib.import_module("flashlse.ops.merge")

I32 = torch.int32


def column(t):
    """``t``'s values as a view with stride 2 in its last dim (column 1 of a wider table):
    what ``lens[:, 0]`` of a (B, 2) table gives. The kernels read lengths, tables and sinks
    as packed; such a view is refused (flash-attn's rule), never read wrongly."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    wide[..., 1] = t
    return wide[..., 1]


@pytest.fixture(autouse=True)
def no_compute(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("computation started before validation finished")

    for mod, names in ((attn_mod, ("attn_fwd_torch", "attn_bwd_torch")),
                       (kv_mod, ("attn_fwd_torch", "sdpa_fwd_ranges", "_append", "_split_fwd")),
                       (sparse_mod, ("sparse_fwd_torch",)),
                       (merge_mod, ("merge_math",))):
        for name in names:
            monkeypatch.setattr(mod, name, boom)


def qkv(b=2, sq=3, sk=5, hq=4, hkv=2, d=16, dv=16, dtype=torch.float32):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, dv, dtype=dtype))


def attn(**over):
    q, k, v = qkv()
    kw = dict(q=q, k=k, v=v)
    kw.update(over)
    return lambda: fl.attention(**kw)


ATTENTION = [
    pytest.param(attn(q=torch.randn(3, 4, 16)), ValueError, "must have 4 dims", id="q_rank"),
    pytest.param(attn(k=torch.randn(2, 5, 2, 16, 1)), ValueError, "must have 4 dims",
                 id="k_rank"),
    pytest.param(attn(q=[1.0]), TypeError, "torch.Tensor", id="q_not_tensor"),
    pytest.param(attn(q=None), TypeError, "torch.Tensor", id="q_none"),
    pytest.param(attn(v=[1.0]), TypeError, "torch.Tensor", id="v_not_tensor"),
    pytest.param(attn(q=torch.ones(2, 3, 4, 16, dtype=torch.int64)), TypeError,
                 "floating-point", id="q_int"),
    pytest.param(attn(k=torch.randn(2, 5, 2, 16, dtype=torch.float64)), ValueError,
                 "share a dtype", id="dtype_mismatch"),
    pytest.param(attn(k=torch.randn(2, 5, 3, 16), v=torch.randn(2, 5, 3, 16)), ValueError,
                 "multiple of key/value heads", id="gqa_indivisible"),
    pytest.param(attn(v=torch.randn(2, 5, 1, 16)), ValueError, "same number of heads",
                 id="kv_heads_differ"),
    pytest.param(attn(k=torch.randn(2, 5, 2, 8)), ValueError, "head dim", id="d_mismatch"),
    pytest.param(attn(v=torch.randn(2, 6, 2, 16)), ValueError, "sequence length",
                 id="kv_len_mismatch"),
    pytest.param(attn(k=torch.randn(1, 5, 2, 16), v=torch.randn(1, 5, 2, 16)), ValueError,
                 "batch", id="batch_mismatch"),
    pytest.param(attn(q=torch.randn(2, 3, 4, 32)[..., ::2]), ValueError, "contiguous",
                 id="last_dim_strided"),
    pytest.param(attn(sink=torch.zeros(2)), ValueError, r"shape \(4,\)", id="sink_shape"),
    pytest.param(attn(sink=torch.zeros(4, 1)), ValueError, "one logit per query head",
                 id="sink_rank"),
    pytest.param(attn(sink=[0.0] * 4), TypeError, "sink", id="sink_not_tensor"),
    pytest.param(attn(sink=torch.zeros(4, dtype=torch.int32)), TypeError, "floating",
                 id="sink_int"),
    pytest.param(attn(sink=column(torch.zeros(4))), ValueError, "sink must be contiguous",
                 id="sink_strided"),
    pytest.param(attn(sink=torch.zeros(1).expand(4)), ValueError, "sink must be contiguous",
                 id="sink_expanded"),
    pytest.param(attn(window=5), ValueError, "pair", id="window_not_pair"),
    pytest.param(attn(window=(1, 2, 3)), ValueError, "pair", id="window_triple"),
    pytest.param(attn(window=(1.5, 0)), TypeError, "int or None", id="window_float"),
    pytest.param(attn(softcap=-1.0), ValueError, ">= 0", id="softcap_negative"),
    pytest.param(attn(softcap=float("inf")), ValueError, "finite", id="softcap_inf"),
    pytest.param(attn(softcap="1"), TypeError, "softcap", id="softcap_str"),
    pytest.param(attn(scale=float("nan")), ValueError, "finite", id="scale_nan"),
    pytest.param(attn(scale="0.1"), TypeError, "scale", id="scale_str"),
    pytest.param(attn(causal=1), TypeError, "bool", id="causal_int"),
    pytest.param(attn(deterministic="yes"), TypeError, "bool", id="deterministic_str"),
    pytest.param(attn(return_lse="no"), TypeError, "return_lse must be a bool",
                 id="return_lse_str"),
    pytest.param(attn(window=(-3, 0)), ValueError, "None / -1 for unbounded",
                 id="window_negative"),
]


def varlen(qlens=(3, 2), klens=(4, 5), **over):
    tq, tk = sum(qlens), sum(klens)
    cq = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=I32)
    ck = torch.tensor([0, *torch.tensor(klens).cumsum(0).tolist()], dtype=I32)
    kw = dict(q=torch.randn(tq, 4, 16), k=torch.randn(tk, 2, 16), v=torch.randn(tk, 2, 16),
              cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(qlens),
              max_seqlen_k=max(klens))
    kw.update(over)
    return lambda: fl.attention_varlen(**kw)


VARLEN = [
    pytest.param(varlen(q=torch.randn(1, 5, 4, 16)), ValueError, "must have 3 dims",
                 id="q_rank"),
    pytest.param(varlen(cu_seqlens_q=torch.tensor([0, 3, 5])), TypeError, "int32",
                 id="cu_not_int32"),
    pytest.param(varlen(cu_seqlens_k=torch.tensor([0, 5, 4, 9], dtype=I32)), ValueError,
                 "non-decreasing", id="cu_not_monotone"),
    pytest.param(varlen(cu_seqlens_k=torch.tensor([0, 4, 10], dtype=I32)), ValueError,
                 "number of tokens", id="cu_past_end"),
    pytest.param(varlen(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=I32)), ValueError,
                 "start at 0", id="cu_not_from_0"),
    pytest.param(varlen(cu_seqlens_q=torch.tensor([[0, 3, 5]], dtype=I32)), ValueError,
                 r"\(B \+ 1,\)", id="cu_rank"),
    pytest.param(varlen(cu_seqlens_q=torch.tensor([0, 2, 3, 5], dtype=I32)), ValueError,
                 "B \\+ 1 entries", id="cu_batch_mismatch"),
    pytest.param(varlen(max_seqlen_q=2), ValueError, "smaller than the longest",
                 id="max_seqlen_q_small"),
    pytest.param(varlen(max_seqlen_k=4), ValueError, "smaller than the longest",
                 id="max_seqlen_k_small"),
    pytest.param(varlen(max_seqlen_k=5.0), TypeError, "int", id="max_seqlen_float"),
    pytest.param(varlen(seqused_k=torch.tensor([5, 5], dtype=I32)), ValueError,
                 "seqused_k", id="seqused_k_too_big"),
    pytest.param(varlen(seqused_k=torch.tensor([-1, 2], dtype=I32)), ValueError,
                 "seqused_k", id="seqused_k_negative"),
    pytest.param(varlen(seqused_k=torch.tensor([1, 2, 3], dtype=I32)), ValueError,
                 "seqused_k", id="seqused_k_shape"),
    pytest.param(varlen(seqused_k=torch.tensor([1, 2])), TypeError, "int32",
                 id="seqused_k_int64"),
    pytest.param(varlen(cu_seqlens_q=column(torch.tensor([0, 3, 5], dtype=I32))), ValueError,
                 "cu_seqlens_q must be contiguous", id="cu_q_strided"),
    pytest.param(varlen(cu_seqlens_k=column(torch.tensor([0, 4, 9], dtype=I32))), ValueError,
                 "cu_seqlens_k must be contiguous", id="cu_k_strided"),
    pytest.param(varlen(seqused_k=column(torch.tensor([1, 2], dtype=I32))), ValueError,
                 "seqused_k must be contiguous", id="seqused_k_strided"),
    pytest.param(varlen(sink=column(torch.zeros(4))), ValueError, "sink must be contiguous",
                 id="sink_strided"),
    pytest.param(varlen(v=torch.randn(8, 2, 16)), ValueError, "same number of tokens",
                 id="kv_tokens_differ"),
    pytest.param(varlen(k=torch.randn(9, 3, 16), v=torch.randn(9, 3, 16)), ValueError,
                 "multiple", id="gqa_indivisible"),
    pytest.param(varlen(sink=torch.zeros(3)), ValueError, "sink", id="sink_shape"),
    pytest.param(varlen(window=(None,)), ValueError, "pair", id="window_malformed"),
    pytest.param(varlen(softcap=-0.5), ValueError, ">= 0", id="softcap_negative"),
]


def kvcache(paged=False, **over):
    q = torch.randn(2, 1, 4, 16)
    if paged:
        kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
        extra = dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32))
    else:
        kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
        extra = {}
    kw = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=torch.tensor([3, 5], dtype=I32),
              **extra)
    kw.update(over)
    return lambda: fl.attention_with_kvcache(**kw)


KNEW = dict(k_new=torch.randn(2, 4, 2, 16), v_new=torch.randn(2, 4, 2, 16))

KVCACHE = [
    pytest.param(kvcache(q=torch.randn(2, 20, 4, 0), k_cache=torch.randn(2, 8, 2, 0)),
                 ValueError, "head dims must be >= 1", id="d0_long_q"),
    pytest.param(kvcache(return_lse=1), TypeError, "return_lse", id="return_lse_int"),
    pytest.param(kvcache(q=torch.randn(2, 4, 16)), ValueError, "4 dims", id="q_rank"),
    pytest.param(kvcache(k_cache=torch.randn(2, 8, 3, 16), v_cache=torch.randn(2, 8, 3, 16)),
                 ValueError, "multiple", id="gqa_indivisible"),
    pytest.param(kvcache(k_cache=torch.randn(2, 8, 2, 8)), ValueError, "share D",
                 id="d_mismatch"),
    pytest.param(kvcache(v_cache=torch.randn(2, 7, 2, 16)), ValueError, "first two dims",
                 id="v_cache_len"),
    pytest.param(kvcache(k_cache=torch.randn(3, 8, 2, 16), v_cache=torch.randn(3, 8, 2, 16)),
                 ValueError, "block_table", id="contiguous_batch"),
    pytest.param(kvcache(q=torch.randn(2, 1, 4, 16, dtype=torch.float64)), ValueError,
                 "dtype", id="dtype_mismatch"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([3, 5])), TypeError, "int32",
                 id="seqlens_int64"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([3], dtype=I32)), ValueError,
                 r"\(B,\)", id="seqlens_shape"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([3, 9], dtype=I32)), ValueError,
                 "capacity", id="seqlens_past_cache"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([-1, 2], dtype=I32)), ValueError,
                 "capacity", id="seqlens_negative"),
    pytest.param(kvcache(**KNEW), ValueError, "capacity", id="cache_too_small_for_k_new"),
    pytest.param(kvcache(k_new=KNEW["k_new"]), ValueError, "both k_new and v_new",
                 id="k_new_without_v_new"),
    pytest.param(kvcache(k_new=torch.randn(2, 1, 2, 8), v_new=torch.randn(2, 1, 2, 16)),
                 ValueError, "k_new / v_new", id="k_new_shape"),
    pytest.param(kvcache(k_new=torch.randn(2, 1, 2, 16, dtype=torch.float64),
                         v_new=torch.randn(2, 1, 2, 16, dtype=torch.float64)), ValueError,
                 "dtype", id="k_new_dtype"),
    pytest.param(kvcache(cache_seqlens=None, **KNEW), ValueError, "cache_seqlens",
                 id="k_new_without_seqlens"),
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[0, 1], [2, 6]], dtype=I32)),
                 ValueError, r"\[0, 6\)", id="block_table_past_pages"),
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[-1, 1], [2, 3]], dtype=I32)),
                 ValueError, "block_table", id="block_table_negative"),
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[0, 1], [2, 3]])), TypeError,
                 "int32", id="block_table_int64"),
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[0, 1]], dtype=I32)),
                 ValueError, "B = 2 rows", id="block_table_rows"),
    pytest.param(kvcache(paged=True, cache_seqlens=torch.tensor([3, 9], dtype=I32)),
                 ValueError, "capacity", id="paged_seqlens_past_table"),
    pytest.param(kvcache(paged=True, cache_seqlens=None), ValueError, "cache_seqlens",
                 id="paged_without_seqlens"),
    pytest.param(kvcache(cache_seqlens=column(torch.tensor([3, 5], dtype=I32))), ValueError,
                 "cache_seqlens must be contiguous", id="seqlens_strided"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([3], dtype=I32).expand(2)), ValueError,
                 "cache_seqlens must be contiguous", id="seqlens_expanded"),
    pytest.param(kvcache(paged=True, block_table=column(torch.tensor([[0, 1], [2, 3]],
                                                                     dtype=I32))),
                 ValueError, "block_table must be contiguous", id="block_table_strided"),
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[0, 2], [1, 3]], dtype=I32).t()),
                 ValueError, "block_table must be contiguous", id="block_table_transposed"),
    pytest.param(kvcache(sink=column(torch.zeros(4))), ValueError, "sink must be contiguous",
                 id="sink_strided"),
    pytest.param(kvcache(num_splits=-1), ValueError, "num_splits", id="num_splits_negative"),
    pytest.param(kvcache(num_splits=2.0), ValueError, "num_splits", id="num_splits_float"),
    pytest.param(kvcache(sink=torch.zeros(2)), ValueError, "sink", id="sink_shape"),
    pytest.param(kvcache(window=[1]), ValueError, "pair", id="window_malformed"),
    pytest.param(kvcache(softcap=-2.0), ValueError, ">= 0", id="softcap_negative"),
    pytest.param(kvcache(causal="no"), TypeError, "bool", id="causal_str"),
]


def sparse(**over):
    q, k, v = qkv()
    kw = dict(q=q, k=k, v=v, indices=torch.zeros(2, 3, 2, 4, dtype=I32))
    kw.update(over)
    return lambda: fl.sparse_attention(**kw)


SPARSE = [
    pytest.param(sparse(q=torch.randn(2, 3, 4, 0), k=torch.randn(2, 5, 2, 0)), ValueError,
                 "head dims must be >= 1", id="d0"),
    pytest.param(sparse(v=torch.randn(2, 5, 2, 0)), ValueError, "head dims must be >= 1",
                 id="dv0"),
    pytest.param(sparse(q=torch.randn(2, 3, 16)), ValueError, "4 dims", id="q_rank"),
    pytest.param(sparse(indices=torch.full((2, 3, 2, 4), 5, dtype=I32)), ValueError,
                 r"\[0, 5\)", id="indices_past_sk"),
    pytest.param(sparse(indices=torch.full((2, 3, 2, 4), -2, dtype=I32)), ValueError,
                 "-1", id="indices_below_minus_one"),
    pytest.param(sparse(sink=column(torch.zeros(4))), ValueError, "sink must be contiguous",
                 id="sink_strided"),
    pytest.param(sparse(indices=torch.zeros(2, 3, 2, 4, dtype=torch.int64)), TypeError,
                 "int32", id="indices_int64"),
    pytest.param(sparse(indices=torch.zeros(2, 3, 4, 4, dtype=I32)), ValueError,
                 "Hkv", id="indices_heads"),
    pytest.param(sparse(indices=torch.zeros(2, 3, 2, dtype=I32)), ValueError,
                 "topk", id="indices_rank"),
    pytest.param(sparse(k=torch.randn(2, 5, 3, 16), v=torch.randn(2, 5, 3, 16)), ValueError,
                 "multiple", id="gqa_indivisible"),
    pytest.param(sparse(k=torch.randn(2, 5, 2, 8)), ValueError, "share D", id="d_mismatch"),
    pytest.param(sparse(v=torch.randn(2, 5, 2, 16, dtype=torch.float64)), ValueError,
                 "dtype", id="dtype_mismatch"),
    pytest.param(sparse(sink=torch.zeros(4, 2)), ValueError, "sink", id="sink_shape"),
    pytest.param(sparse(scale=float("inf")), ValueError, "finite", id="scale_inf"),
]


def ms(**over):
    kw = dict(outs=torch.randn(3, 2, 4, 5, 8), lses=torch.randn(3, 2, 4, 5))
    kw.update(over)
    return lambda: fl.merge_states(**kw)


def mg(**over):
    kw = dict(out_a=torch.randn(4, 8), lse_a=torch.randn(4), out_b=torch.randn(4, 8),
              lse_b=torch.randn(4))
    kw.update(over)
    return lambda: fl.merge(**kw)


MERGE = [
    pytest.param(ms(lses=torch.randn(3, 2, 5, 5)), ValueError, "shape of outs without",
                 id="lse_shape_mismatch"),
    pytest.param(ms(outs=torch.randn(3, 2, 4, 4, 8), lses=torch.randn(3, 2, 4, 4)), ValueError,
                 "fit both layouts", id="sq_equals_h_ambiguous"),
    pytest.param(ms(layout="heads"), ValueError, "layout must be", id="layout_name"),
    pytest.param(ms(lses=torch.randn(3, 2, 4)), ValueError, "shape of outs without",
                 id="lse_rank_mismatch"),
    pytest.param(ms(outs=torch.randn(3)), ValueError, "at least 2 dims", id="outs_rank"),
    pytest.param(ms(outs=torch.randn(0, 2, 8), lses=torch.randn(0, 2)), ValueError, "N >= 1",
                 id="no_states"),
    pytest.param(ms(lses=torch.zeros(3, 2, 4, 5, dtype=torch.int32)), TypeError,
                 "floating point", id="lses_int"),
    pytest.param(ms(outs=[1.0]), TypeError, "torch.Tensor", id="outs_not_tensor"),
    pytest.param(ms(sink=torch.zeros(3)), ValueError, "broadcast", id="sink_not_broadcast"),
    pytest.param(ms(sink=[0.0]), TypeError, "sink", id="sink_not_tensor"),
    pytest.param(mg(lse_b=torch.randn(5)), ValueError, "equal shapes", id="merge_shapes"),
    pytest.param(mg(out_b=torch.randn(4, 8, dtype=torch.float64)), ValueError, "dtype",
                 id="merge_dtypes"),
    pytest.param(mg(lse_a=0.0), TypeError, "torch.Tensor", id="merge_not_tensor"),
]


@pytest.mark.parametrize("call,exc,match", ATTENTION)
def test_attention_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", VARLEN)
def test_attention_varlen_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", KVCACHE)
def test_attention_with_kvcache_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", SPARSE)
def test_sparse_attention_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", MERGE)
def test_merge_validation(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_messages_say_expected_and_got():
    with pytest.raises(ValueError, match=r"got shape \(3, 4, 16\).*transpose\(1, 2\)"):
        attn(q=torch.randn(3, 4, 16))()
    with pytest.raises(ValueError) as e:
        attn(k=torch.randn(2, 5, 3, 16), v=torch.randn(2, 5, 3, 16))()
    assert "(4)" in str(e.value) and "(3)" in str(e.value)
    with pytest.raises(ValueError) as e:
        varlen(cu_seqlens_k=torch.tensor([0, 5, 4, 9], dtype=I32))()
    assert "[0, 5, 4, 9]" in str(e.value)
    with pytest.raises(ValueError) as e:
        kvcache(**KNEW)()
    msg = str(e.value)
    assert "[0, 8]" in msg and "Snew = 4" in msg and "grow" in msg


def test_failed_validation_leaves_the_cache_untouched():
    kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    k0, v0 = kc.clone(), vc.clone()
    bad = torch.tensor([[0, 1], [2, 7]], dtype=I32)
    with pytest.raises(ValueError):
        fl.attention_with_kvcache(torch.randn(2, 1, 4, 16), kc, vc,
                                  cache_seqlens=torch.tensor([3, 5], dtype=I32),
                                  block_table=bad, k_new=torch.randn(2, 1, 2, 16),
                                  v_new=torch.randn(2, 1, 2, 16))
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


@pytest.mark.parametrize("call", [
    pytest.param(attn(window=(-1, -1)), id="attention_window_minus_one"),
    pytest.param(attn(window=None, softcap=0, scale=1), id="attention_int_scale_softcap"),
    pytest.param(varlen(qlens=(0, 5), klens=(0, 9)), id="varlen_zero_len"),
    pytest.param(kvcache(cache_seqlens=torch.tensor([0, 8], dtype=I32)), id="kvcache_bounds"),
    pytest.param(kvcache(paged=True, cache_seqlens=torch.tensor([0, 8], dtype=I32),
                         block_table=torch.tensor([[-1, -1], [2, 3]], dtype=I32)),
                 id="paged_unused_pages_unchecked"),
    pytest.param(sparse(indices=torch.full((2, 3, 2, 4), -1, dtype=I32)), id="sparse_all_none"),
    pytest.param(ms(sink=torch.zeros(4, 1)), id="merge_states_sink_h1"),
    # The kernels take a block table's row stride: a table sliced from a wider one (a serving
    # engine's persistent table, ``table[:, :pages]``) is valid; so are strided top-k
    # indices (the sparse plan copies them when it must), and a length-1 view of any stride.
    pytest.param(kvcache(paged=True, block_table=torch.tensor([[0, 1, 9], [2, 3, 9]],
                                                              dtype=I32)[:, :2]),
                 id="block_table_row_sliced"),
    pytest.param(sparse(indices=column(torch.zeros(2, 3, 2, 4, dtype=I32))),
                 id="sparse_indices_strided"),
    pytest.param(kvcache(q=torch.randn(1, 1, 4, 16), k_cache=torch.randn(1, 8, 2, 16),
                         v_cache=torch.randn(1, 8, 2, 16),
                         cache_seqlens=column(torch.tensor([3], dtype=I32))),
                 id="kvcache_one_length_any_stride"),
])
def test_valid_edge_inputs_pass_validation(call):
    # Valid inputs reach the (patched) computation.
    with pytest.raises(AssertionError, match="before validation finished"):
        call()



@pytest.mark.parametrize("call,exc,match", ATTENTION + VARLEN + KVCACHE + SPARSE + MERGE)
def test_errors_unchanged_after_valid_calls(call, exc, match):
    # The metadata checks are skipped for metadata that passed them before (ops/_validate.py
    # remembers it): after valid calls of every function, and a second time, each bad call
    # still raises its own error.
    for valid in (attn(), kvcache(), kvcache(paged=True), sparse(), ms(), mg()):
        with pytest.raises(AssertionError, match="before validation finished"):
            valid()
    for _ in range(2):
        with pytest.raises(exc, match=match):
            call()


def test_sparse_paged_errors_after_valid_paged_calls():
    # The paged sparse call keeps its checks' pass and its forward plan by the metadata
    # key: a call with other metadata is checked again and raises its own error.
    q = torch.randn(2, 3, 4, 16)
    k = torch.randn(6, 4, 2, 16)
    table = torch.arange(6, dtype=I32).view(2, 3)
    idx = torch.zeros(2, 3, 2, 5, dtype=I32)
    call = lambda **kw: fl.sparse_attention(**{**dict(q=q, k=k, v=k, indices=idx,
                                                      block_table=table), **kw})
    for _ in range(2):
        with pytest.raises(AssertionError, match="before validation finished"):
            call()
    with pytest.raises(TypeError, match="int32"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match="B = 2 rows"):
        call(block_table=table[:1])
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        call(indices=torch.full((2, 3, 2, 5), 12, dtype=I32))
    with pytest.raises(AssertionError, match="before validation finished"):
        call()


def test_remembered_metadata_still_checks_the_rest():
    # Same tensors as a valid call: what is not metadata (num_splits, flags, scalars, values
    # on CPU) is checked every call.
    q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    lens = torch.tensor([3, 5], dtype=I32)
    call = lambda **kw: fl.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
    with pytest.raises(AssertionError, match="before validation finished"):
        call()
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=-1)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=True)
    with pytest.raises(TypeError, match="causal"):
        call(causal=1)
    with pytest.raises(ValueError, match="cache capacity"):
        fl.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 9], dtype=I32))
    # Another stride of the same shapes is other metadata: checked again.
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        fl.attention_with_kvcache(q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc,
                                  cache_seqlens=lens)
    q2, k2, v2 = qkv()
    with pytest.raises(AssertionError, match="before validation finished"):
        fl.attention(q2, k2, v2)
    with pytest.raises(ValueError, match="window"):
        fl.attention(q2, k2, v2, window=(-2, 0))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        fl.attention(q2, k2.transpose(-1, -2).contiguous().transpose(-1, -2), v2)


def sdpa_varlen(**over):
    """flashlse's launcher for ``aten::_flash_attention_forward`` (what
    ``torch.nn.attention.varlen`` calls once flashlse is activated), packed sequences."""
    from flashlse.integrations import sdpa as sdpa_impl

    cu = torch.tensor([0, 3, 5], dtype=I32)
    kw = dict(query=torch.randn(5, 4, 16), key=torch.randn(5, 2, 16), value=torch.randn(5, 2, 16),
              cum_seq_q=cu, cum_seq_k=cu, max_q=3, max_k=3, dropout_p=0.0, is_causal=True,
              return_debug_mask=False)
    kw.update(over)
    return lambda: sdpa_impl.flash_attention_forward(**kw)


def sdpa_dense(**over):
    """The same launcher with the flash layout ``(B, S, H, D)`` (no cum_seq)."""
    q, k, v = qkv()
    return sdpa_varlen(**{**dict(query=q, key=k, value=v, cum_seq_q=None, cum_seq_k=None,
                                 max_q=3, max_k=5), **over})


SDPA_IMPL = [
    pytest.param(sdpa_varlen(cum_seq_q=torch.tensor([0, 3, 5])), TypeError, "int32",
                 id="cu_int64"),
    pytest.param(sdpa_varlen(cum_seq_k=column(torch.tensor([0, 3, 5], dtype=I32))), ValueError,
                 "cu_seqlens_k must be contiguous", id="cu_strided"),
    pytest.param(sdpa_varlen(cum_seq_q=torch.tensor([0, 3, 9], dtype=I32)), ValueError,
                 "number of tokens", id="cu_past_end"),
    pytest.param(sdpa_varlen(max_q=2), ValueError, "smaller than the longest", id="max_q_small"),
    pytest.param(sdpa_varlen(seqused_k=torch.tensor([1, 2])), TypeError, "int32",
                 id="seqused_int64"),
    pytest.param(sdpa_varlen(query=torch.randn(5, 3, 16)), ValueError, "multiple",
                 id="heads_indivisible"),
    pytest.param(sdpa_varlen(key=torch.randn(5, 2, 8)), ValueError, "head dim", id="d_mismatch"),
    pytest.param(sdpa_varlen(value=torch.randn(6, 2, 16)), ValueError, "same number of tokens",
                 id="kv_tokens_differ"),
    pytest.param(sdpa_varlen(query=torch.randn(5, 4, 32)[..., ::2]), ValueError, "contiguous",
                 id="q_last_dim_strided"),
    pytest.param(sdpa_varlen(key=torch.randn(5, 2, 16, dtype=torch.float64)), ValueError,
                 "share a dtype", id="dtype_mismatch"),
    pytest.param(sdpa_varlen(scale=float("nan")), ValueError, "finite", id="scale_nan"),
    pytest.param(sdpa_varlen(window_size_left=-5, window_size_right=0), ValueError, "-1",
                 id="window_negative"),
    pytest.param(sdpa_dense(key=torch.randn(1, 5, 2, 16), value=torch.randn(1, 5, 2, 16)),
                 ValueError, "share the batch", id="dense_batch_mismatch"),
    pytest.param(sdpa_dense(value=torch.randn(2, 4, 2, 16)), ValueError, "share the batch",
                 id="dense_kv_len_mismatch"),
]


@pytest.mark.parametrize("call,exc,match", SDPA_IMPL)
def test_sdpa_impl_validation(monkeypatch, call, exc, match):
    """flashlse's SDPA launchers replace torch's flash kernels, whose C++ checks their inputs:
    they check them as flashlse's own functions do, before any kernel (a batch that k lacks
    would be read past its storage)."""
    from flashlse.kernels import dispatch

    monkeypatch.setattr(dispatch, "attn_fwd", lambda *a, **k: pytest.fail("kernel reached"))
    with pytest.raises(exc, match=match):
        call()


def test_sdpa_impl_valid_calls_reach_the_kernel(monkeypatch):
    from flashlse.kernels import dispatch

    reached = []
    monkeypatch.setattr(dispatch, "attn_fwd", lambda *a, **k: reached.append(k) or (a[0], None))
    sdpa_varlen(window_size_left=-1, window_size_right=-1)()
    sdpa_dense(scale=0.5)()
    assert [r["scale"] for r in reached] == [0.25, 0.5]
    assert (reached[0]["left"], reached[0]["right"]) == (None, 0)
    assert reached[0]["max_seqlen_q"] == 3 and "max_seqlen_q" not in reached[1]


@pytest.mark.parametrize("call,match", [
    pytest.param(attn(scale=torch.tensor(0.5)), r"got torch\.Tensor; pass float\(scale\) "
                 r"\(a host float: reading a GPU tensor's value would sync\)", id="scale_tensor"),
    pytest.param(attn(softcap=torch.tensor(2.0)), r"pass float\(softcap\)", id="softcap_tensor"),
    pytest.param(attn(causal=torch.tensor(True)), r"got torch\.Tensor; pass bool\(causal\)",
                 id="causal_tensor"),
    pytest.param(attn(window=(torch.tensor(3), 0)), r"\(torch\.Tensor\); pass Python ints",
                 id="window_tensor"),
    pytest.param(varlen(max_seqlen_q=torch.tensor(3)), r"pass int\(max_seqlen_q\)",
                 id="max_seqlen_tensor"),
    pytest.param(varlen(max_seqlen_k=5.0), r"got float; pass int\(max_seqlen_k\)",
                 id="max_seqlen_float"),
])
def test_host_scalars_of_other_types_say_the_fix(call, match):
    """A host scalar given as a tensor (or a float for an int) names its type and the
    conversion that fixes it."""
    with pytest.raises(TypeError, match=match):
        call()


def test_numpy_scalars_are_named_as_numpy():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.bool_?; pass bool"):
        attn(causal=np.bool_(True))()
    with pytest.raises(TypeError, match=r"got numpy\.int64; pass int\(max_seqlen_q\)"):
        varlen(max_seqlen_q=np.int64(3))()
    with pytest.raises(TypeError, match=r"\(numpy\.int64\); pass Python ints"):
        attn(window=(np.int64(2), 0))()
