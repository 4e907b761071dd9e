"""The LSE contract (docs/design.md §1) as properties: attention states form a commutative monoid
under merge with identity (0, -inf), and attention over K is the merge of attention over
any partition of K (empty parts included), the sink added once at the merge."""

import pytest
import torch
from _flashlse_testing import assert_close_to_ref
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlse as fl
from flashlse import reference as R

NEG_INF = float("-inf")
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).float()


def random_state(g, shape, d, p_empty, lse_scale):
    out = _randn(g, *shape, d)
    lse = _randn(g, *shape, scale=lse_scale)
    lse[torch.rand(shape, generator=g) < p_empty] = NEG_INF
    return out, lse


state_args = dict(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    d=st.sampled_from([1, 3, 8, 16]),
    p_empty=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    lse_scale=st.sampled_from([0.1, 3.0, 40.0]),
)


@PROPERTY
@given(**state_args)
def test_merge_identity(seed, rows, d, p_empty, lse_scale):
    out, lse = random_state(_gen(seed), (rows,), d, p_empty, lse_scale)
    # An empty row's out is 0 in a canonical state.
    out[torch.isneginf(lse)] = 0
    zero, none = torch.zeros_like(out), torch.full_like(lse, NEG_INF)
    for o, l in (fl.merge(out, lse, zero, none), fl.merge(zero, none, out, lse)):
        assert torch.equal(l, lse)
        assert torch.equal(o, out)


@PROPERTY
@given(**state_args)
def test_merge_commutative(seed, rows, d, p_empty, lse_scale):
    g = _gen(seed)
    a = random_state(g, (rows,), d, p_empty, lse_scale)
    b = random_state(g, (rows,), d, p_empty, lse_scale)
    o_ab, l_ab = fl.merge(*a, *b)
    o_ba, l_ba = fl.merge(*b, *a)
    assert torch.equal(l_ab, l_ba)
    assert torch.equal(o_ab, o_ba)
    assert not bool(torch.isnan(o_ab).any() or torch.isnan(l_ab).any())


@PROPERTY
@given(**state_args)
def test_merge_associative(seed, rows, d, p_empty, lse_scale):
    g = _gen(seed)
    a, b, c = (random_state(g, (rows,), d, p_empty, lse_scale) for _ in range(3))
    left = fl.merge(*fl.merge(*a, *b), *c)
    right = fl.merge(*a, *fl.merge(*b, *c))
    ref_out, ref_lse = R.merge_states(torch.stack([a[0], b[0], c[0]]),
                                      torch.stack([a[1], b[1], c[1]]))
    for o, l in (left, right):
        assert_close_to_ref(o, ref_out)
        assert_close_to_ref(l, ref_lse, name="lse")
    assert torch.equal(torch.isneginf(left[1]), torch.isneginf(right[1]))


@PROPERTY
@given(n=st.integers(1, 6), sink=st.booleans(), **state_args)
def test_merge_states_is_a_fold_of_merge(n, sink, seed, rows, d, p_empty, lse_scale):
    g = _gen(seed)
    outs, lses = zip(*(random_state(g, (rows,), d, p_empty, lse_scale) for _ in range(n)))
    s = _randn(g, rows, scale=2.0) if sink else None
    out, lse = fl.merge_states(torch.stack(outs), torch.stack(lses), sink=s)
    acc = (torch.zeros_like(outs[0]), torch.full_like(lses[0], NEG_INF))
    for o, l in zip(outs, lses):
        acc = fl.merge(*acc, o, l)
    if sink:
        acc = fl.merge(*acc, torch.zeros_like(outs[0]), s)
    ref_out, ref_lse = R.merge_states(torch.stack(outs), torch.stack(lses), sink=s)
    for o, l in ((out, lse), acc):
        assert_close_to_ref(o, ref_out)
        assert_close_to_ref(l, ref_lse, name="lse")


def _partition(sk, cuts):
    """Sorted cut points in [0, sk] (repeats give empty parts) -> [(k0, k1), ...]."""
    points = [0, *sorted(c % (sk + 1) for c in cuts), sk]
    return list(zip(points, points[1:]))


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), sq=st.integers(1, 7), sk=st.integers(0, 40),
       heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]), d=st.sampled_from([4, 16]),
       cuts=st.lists(st.integers(0, 1000), max_size=5), sink=st.booleans(),
       softcap=st.sampled_from([0.0, 2.0]))
def test_attention_chunk_invariance(seed, sq, sk, heads, d, cuts, sink, softcap):
    g = _gen(seed)
    hq, hkv = heads
    q, k, v = _randn(g, 1, sq, hq, d), _randn(g, 1, sk, hkv, d), _randn(g, 1, sk, hkv, d + 1)
    s = _randn(g, hq, scale=2.0) if sink else None
    out, lse = fl.attention(q, k, v, softcap=softcap, sink=s, return_lse=True)
    outs, lses = [], []
    for k0, k1 in _partition(sk, cuts):
        o, l = fl.attention(q, k[:, k0:k1], v[:, k0:k1], softcap=softcap, return_lse=True)
        outs.append(o)
        lses.append(l.transpose(1, 2))  # (1, Sq, Hq): out's shape without D
    # The sink is added once, at the merge, never per part.
    m_out, m_lse = fl.merge_states(torch.stack(outs), torch.stack(lses), sink=s, layout="rows")
    ref_out, ref_lse = R.attention(q, k, v, softcap=softcap, sink=s, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    assert_close_to_ref(m_out, ref_out, name="merged out")
    assert_close_to_ref(m_lse.transpose(1, 2), ref_lse, name="merged lse")


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), sq=st.integers(1, 5), sk=st.integers(1, 20),
       topk=st.integers(0, 12), cuts=st.lists(st.integers(0, 1000), max_size=4),
       p_none=st.sampled_from([0.0, 0.5, 1.0]), sink=st.booleans())
def test_sparse_chunk_invariance(seed, sq, sk, topk, cuts, p_none, sink):
    g = _gen(seed)
    q, k, v = _randn(g, 1, sq, 2, 8), _randn(g, 1, sk, 1, 8), _randn(g, 1, sk, 1, 8)
    idx = torch.randint(0, sk, (1, sq, 1, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < p_none] = -1
    s = _randn(g, 2, scale=2.0) if sink else None
    outs, lses = [], []
    for t0, t1 in _partition(topk, cuts):
        o, l = fl.sparse_attention(q, k, v, idx[..., t0:t1].contiguous(), return_lse=True)
        outs.append(o)
        lses.append(l.transpose(1, 2))
    m_out, m_lse = fl.merge_states(torch.stack(outs), torch.stack(lses), sink=s, layout="rows")
    ref_out, ref_lse = R.sparse_attention(q, k, v, idx, sink=s, return_lse=True)
    assert_close_to_ref(m_out, ref_out)
    assert_close_to_ref(m_lse.transpose(1, 2), ref_lse, name="lse")


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), lens=st.lists(st.integers(0, 12), min_size=1,
                                                      max_size=3),
       sq=st.integers(1, 4), num_splits=st.integers(1, 20), sink=st.booleans(),
       causal=st.booleans())
def test_kvcache_split_invariance(seed, lens, sq, num_splits, sink, causal):
    g = _gen(seed)
    b = len(lens)
    q, k, v = _randn(g, b, sq, 2, 8), _randn(g, b, 12, 1, 8), _randn(g, b, 12, 1, 8)
    s = _randn(g, 2, scale=2.0) if sink else None
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out, lse = fl.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits,
                                         causal=causal, sink=s, return_lse=True)
    ref_out, ref_lse = R.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal,
                                                sink=s, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")


def _empty_cases():
    q = torch.randn(1, 3, 2, 8)
    k0, v0 = torch.randn(1, 0, 2, 8), torch.randn(1, 0, 2, 8)
    k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    cu0 = torch.tensor([0, 0, 4], dtype=torch.int32)
    cuq = torch.tensor([0, 3, 3], dtype=torch.int32)
    idx = torch.full((1, 3, 2, 3), -1, dtype=torch.int32)
    lens = torch.zeros(1, dtype=torch.int32)
    return {
        "attention_sk0": lambda s: fl.attention(q, k0, v0, sink=s, return_lse=True),
        "attention_causal_sq_gt_sk": lambda s: fl.attention(
            torch.randn(1, 7, 2, 8), k, v, causal=True, sink=s, return_lse=True),
        "varlen_zero_len_k": lambda s: fl.attention_varlen(
            q[0], k[0], v[0], cuq, cu0, 3, 4, sink=s, return_lse=True),
        "kvcache_seqlen0": lambda s: fl.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, num_splits=3, sink=s, return_lse=True),
        "sparse_all_minus_one": lambda s: fl.sparse_attention(q, k, v, idx, sink=s,
                                                               return_lse=True),
    }


@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
@pytest.mark.parametrize("case", list(_empty_cases()))
def test_empty_rows_on_every_path(case, with_sink):
    # An empty row: out exactly 0, lse exactly -inf (or the sink logit), nothing else.
    torch.manual_seed(0)
    sink = torch.tensor([0.75, -1.5]) if with_sink else None
    out, lse = _empty_cases()[case](sink)
    if lse.dim() == 2:  # varlen (Hq, total_q)
        lse = lse[None]
        out = out[None]
    if case == "attention_causal_sq_gt_sk":
        out, lse = out[:, :3], lse[..., :3]
    assert bool((out == 0).all())
    if with_sink:
        assert torch.equal(lse, sink.view(1, 2, 1).expand_as(lse))
    else:
        assert bool(torch.isneginf(lse).all())
