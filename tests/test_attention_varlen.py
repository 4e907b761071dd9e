"""flashlse.attention_varlen against flashlse.reference.attention_varlen (packed sequences)."""

import pytest
import torch
from _flashlse_testing import LOWP, assert_close_to_ref, check_against_reference, rand

import flashlse as fl
from flashlse import reference as R


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# (q lens, k lens, Hq, Hkv, D, Dv, keywords)
CASES = [
    pytest.param([3, 5], [4, 6], 2, 2, 16, 16, {}, id="basic"),
    pytest.param([7], [7], 2, 1, 16, 16, dict(causal=True), id="one_seq_causal"),
    pytest.param([0, 4, 2], [3, 5, 1], 2, 2, 16, 16, {}, id="zero_len_q"),
    pytest.param([3, 2], [0, 4], 2, 2, 16, 16, {}, id="zero_len_k"),
    pytest.param([0, 3, 0, 2], [0, 2, 4, 0], 2, 2, 16, 16, dict(causal=True),
                 id="zero_len_q_and_k"),
    pytest.param([2, 3], [0, 0], 2, 1, 16, 16, {}, id="all_k_empty"),
    pytest.param([0, 0], [3, 2], 2, 1, 16, 16, {}, id="all_q_empty"),
    pytest.param([6, 2], [2, 5], 2, 2, 16, 16, dict(causal=True), id="causal_sq_gt_sk"),
    pytest.param([4, 5], [5, 7], 2, 2, 16, 16, dict(seqused_k=[2, 0]), id="seqused_k"),
    pytest.param([4, 5], [5, 7], 2, 2, 16, 16, dict(seqused_k=[5, 3], causal=True),
                 id="seqused_k_causal"),
    pytest.param([5, 3], [6, 4], 6, 2, 16, 16, {}, id="gqa"),
    pytest.param([5, 3], [6, 4], 4, 1, 16, 16, dict(causal=True), id="mqa"),
    pytest.param([3, 4], [5, 2], 2, 2, 59, 111, {}, id="d59_dv111"),
    pytest.param([3, 4], [5, 2], 1, 1, 192, 128, dict(causal=True), id="d192_dv128"),
    pytest.param([9, 6], [9, 3], 2, 2, 16, 16, dict(window=(2, 1)), id="window_empties_rows"),
    pytest.param([5, 4], [6, 4], 2, 2, 16, 16, dict(softcap=2.0, scale=1.0), id="softcap"),
    pytest.param([4, 3, 2], [5, 0, 3], 4, 2, 16, 16, dict(sink=True), id="sink_zero_len_k"),
    pytest.param([6, 3], [2, 4], 2, 2, 16, 16, dict(sink=True, causal=True, seqused_k=[1, 4]),
                 id="sink_causal_seqused"),
    pytest.param([1, 63, 1], [113, 1, 0], 1, 1, 16, 16, dict(causal=True), id="odd_1_63_113"),
]


def make(qlens, klens, hq, hkv, d, dv, kw, dtype):
    kw = dict(kw)
    tq, tk = sum(qlens), sum(klens)
    diff = {"q": rand(tq, hq, d, dtype=dtype), "k": rand(tk, hkv, d, dtype=dtype),
            "v": rand(tk, hkv, dv, dtype=dtype)}
    if kw.pop("sink", False):
        diff["sink"] = rand(hq, scale=2.0)
    const = dict(kw, cu_seqlens_q=cu(qlens), cu_seqlens_k=cu(klens),
                 max_seqlen_q=max(qlens), max_seqlen_k=max(klens), return_lse=True)
    if "seqused_k" in kw:
        used = kw["seqused_k"]
        const["seqused_k"] = torch.tensor(used, dtype=torch.int32)
        # Poison the keys past seqused_k: they must never be read.
        cuk = cu(klens).tolist()
        for b, u in enumerate(used):
            diff["k"][cuk[b] + u:cuk[b + 1]] = float("nan")
            diff["v"][cuk[b] + u:cuk[b + 1]] = float("nan")
    return diff, const


def check_empty_rows(out, lse, grads, diff, const):
    kw = {k: v for k, v in const.items() if k != "return_lse"}
    ref_lse = R.attention_varlen(diff["q"], diff["k"], diff["v"], **kw, return_lse=True)[1]
    empty = torch.isneginf(ref_lse)  # (Hq, total_q), without the sink
    rows = empty.t()
    assert bool((out[rows] == 0).all())
    if "sink" in diff:
        sink = diff["sink"].view(-1, 1).expand_as(lse)
        assert torch.equal(lse[empty], sink[empty])
    else:
        assert bool(torch.isneginf(lse[empty]).all())
    if grads:
        assert bool((grads["q"][rows] == 0).all())
        for name in ("k", "v"):
            assert not bool(torch.isnan(grads[name]).any())


@pytest.mark.parametrize("qlens,klens,hq,hkv,d,dv,kw", CASES)
def test_attention_varlen_fp32(qlens, klens, hq, hkv, d, dv, kw):
    diff, const = make(qlens, klens, hq, hkv, d, dv, kw, torch.float32)
    out, lse, grads = check_against_reference(fl.attention_varlen, R.attention_varlen, diff,
                                              const)
    assert lse.shape == (hq, sum(qlens))
    check_empty_rows(out, lse, grads, diff, const)
    if "seqused_k" in const:
        # The unused keys get exactly zero gradient.
        for name in ("k", "v"):
            assert bool((grads[name][torch.isnan(diff[name])] == 0).all())


FEW = [c for c in CASES if c.id in ("basic", "zero_len_q_and_k", "seqused_k", "gqa",
                                    "d192_dv128", "sink_zero_len_k", "window_empties_rows")]


@pytest.mark.parametrize("dtype", [torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("qlens,klens,hq,hkv,d,dv,kw", FEW)
def test_attention_varlen_dtypes(qlens, klens, hq, hkv, d, dv, kw, dtype):
    diff, const = make(qlens, klens, hq, hkv, d, dv, kw, dtype)
    out, lse, grads = check_against_reference(fl.attention_varlen, R.attention_varlen, diff,
                                              const)
    assert out.dtype == dtype
    check_empty_rows(out, lse, grads, diff, const)


def test_attention_varlen_equals_dense_per_sequence():
    qlens, klens = [4, 0, 6], [5, 3, 2]
    diff, const = make(qlens, klens, 4, 2, 16, 16, dict(causal=True, sink=True), torch.float32)
    out, lse = fl.attention_varlen(diff["q"], diff["k"], diff["v"], sink=diff["sink"],
                                   **{k: v for k, v in const.items() if k != "return_lse"},
                                   return_lse=True)
    cq, ck = cu(qlens).tolist(), cu(klens).tolist()
    for b in range(3):
        o, l = fl.attention(diff["q"][None, cq[b]:cq[b + 1]], diff["k"][None, ck[b]:ck[b + 1]],
                            diff["v"][None, ck[b]:ck[b + 1]], causal=True, sink=diff["sink"],
                            return_lse=True)
        assert_close_to_ref(out[cq[b]:cq[b + 1]], o[0].double())
        assert_close_to_ref(lse[:, cq[b]:cq[b + 1]], l[0].double(), name="lse")


def test_attention_varlen_max_seqlen_larger_is_fine():
    diff, const = make([3, 5], [4, 6], 2, 2, 16, 16, {}, torch.float32)
    const.update(max_seqlen_q=64, max_seqlen_k=64)
    check_against_reference(fl.attention_varlen, R.attention_varlen, diff, const)


def test_attention_varlen_strided_views():
    # q, k, v sliced out of wider packed tensors (heads and head dim), with gradients.
    qlens, klens = [2, 0, 3], [3, 2, 1]
    qf, kf, vf = (rand(5, 4, 24).requires_grad_(), rand(6, 3, 16).requires_grad_(),
                  rand(6, 3, 20).requires_grad_())
    q, k, v = qf[:, 1:3, :16], kf[:, :1], vf[:, 2:, 4:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    kw = dict(cu_seqlens_q=cu(qlens), cu_seqlens_k=cu(klens), max_seqlen_q=3,
              max_seqlen_k=3, causal=True, return_lse=True)
    out, lse = fl.attention_varlen(q, k, v, **kw)
    leaves = [x.detach().contiguous().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = R.attention_varlen(*leaves, **kw)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    dout = rand(*out.shape)
    grads = torch.autograd.grad(out, [qf, kf, vf], dout)
    ref = torch.autograd.grad(ref_out, leaves, dout.double())
    assert_close_to_ref(grads[0][:, 1:3, :16], ref[0], name="dq")
    assert_close_to_ref(grads[1][:, :1], ref[1], name="dk")
    assert_close_to_ref(grads[2][:, 2:, 4:], ref[2], name="dv")


def run_paged(device, dtype, qlens, klens, page, hq=4, hkv=2, d=16, dv=16, sink=False,
              seed=0, **kw):
    """attention_varlen over a paged cache (shuffled pages, unused slots NaN) against the
    reference over the same pages; lengths through seqused_k. Returns (out, lse)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)
    n_pages = [max(1, -(-n // page)) for n in klens]
    total = sum(n_pages) + 2
    perm = torch.randperm(total, generator=g)
    k_cache = torch.full((total, page, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, page, hkv, dv), float("nan"), dtype=dtype)
    table = torch.full((len(klens), max(n_pages)), -1, dtype=torch.int32)
    j = 0
    for b, n in enumerate(klens):
        for p in range(n_pages[b]):
            table[b, p] = perm[j]
            rows = min(page, n - p * page)
            if rows > 0:
                k_cache[perm[j], :rows] = mk(rows, hkv, d)
                v_cache[perm[j], :rows] = mk(rows, hkv, dv)
            j += 1
    # Columns past a sequence's pages point at a real page: never read (seqused_k ends first);
    # three more than any sequence needs, as a serving engine's table is wider than its batch.
    table = torch.cat([table, torch.full((len(klens), 3), -1, dtype=torch.int32)], 1)
    table = torch.where(table < 0, perm[0].to(torch.int32), table)
    q = mk(sum(qlens), hq, d)
    s = mk(hq).float() * 2 if sink else None
    t = dict(cu_seqlens_q=cu(qlens).to(device), cu_seqlens_k=None, max_seqlen_q=max(qlens),
             max_seqlen_k=max(klens), seqused_k=torch.tensor(klens, dtype=torch.int32,
                                                             device=device),
             block_table=table.to(device), return_lse=True, **kw)
    with torch.no_grad():
        out, lse = fl.attention_varlen(q.to(device), k_cache.to(device), v_cache.to(device),
                                       sink=None if s is None else s.to(device), **t)
    ref_t = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    ref_out, ref_lse = R.attention_varlen(q.double(), k_cache.double(), v_cache.double(),
                                          sink=s, **ref_t)
    base = {}
    if dtype in LOWP:
        with R.computed_in(dtype):
            base = dict(zip(("out", "lse"), R.attention_varlen(q, k_cache, v_cache, sink=s,
                                                               **ref_t)))
    low = dtype if dtype in LOWP else None
    assert_close_to_ref(out.cpu(), ref_out, baseline=base.get("out"), dtype=low)
    assert_close_to_ref(lse.cpu(), ref_lse, baseline=base.get("lse"), dtype=low, name="lse")
    return out, lse


# A mixed serving step: prefill, chunked prefill, decodes, a zero-length query, an empty cache.
PAGED = [
    pytest.param([5, 3, 1, 1, 0, 2], [5, 9, 12, 1, 4, 0], dict(causal=True), id="mixed_step"),
    pytest.param([4, 1], [10, 7], dict(causal=True, sink=True), id="sink"),
    pytest.param([6, 2], [6, 11], dict(causal=True, window=(3, 0)), id="window"),
    pytest.param([3, 1], [8, 5], dict(hq=6, hkv=2, dv=8), id="gqa_dv8"),
    # GQA 4:1 packs 4 heads a query into the kernel's rows: 17 queries take several row tiles
    # (and more than 16 rows: the decodes and the 3-query sequence get a launch of their own).
    pytest.param([17, 1, 1, 0, 3], [20, 7, 0, 5, 3], dict(hq=8, hkv=2, causal=True),
                 id="gqa4_prefill_decodes"),
    pytest.param([4, 1, 2], [9, 6, 0], dict(hq=4, hkv=1, dv=24, softcap=2.0, sink=True),
                 id="mqa_softcap_sink_dv24"),
    pytest.param([7, 1], [10, 4], dict(hq=4, hkv=2, window=(2, 1)), id="window_left_right"),
]


@pytest.mark.parametrize("page", [1, 3, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("qlens,klens,kw", PAGED)
def test_attention_varlen_paged(qlens, klens, kw, page):
    run_paged("cpu", torch.float32, qlens, klens, page, **kw)


def test_attention_varlen_paged_is_forward_only_and_needs_lengths():
    q = torch.randn(3, 2, 16, requires_grad=True)
    kc = torch.randn(4, 2, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    cu_q = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="forward only"):
        fl.attention_varlen(q, kc, kc, cu_q, None, 3, 4, block_table=table,
                            seqused_k=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="needs the key lengths"):
        fl.attention_varlen(q.detach(), kc, kc, cu_q, None, 3, 4, block_table=table)
