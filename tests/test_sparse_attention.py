"""flashlse.sparse_attention against flashlse.reference.sparse_attention (top-k indices)."""

import importlib

import pytest
import torch
from _flashlse_testing import LOWP, assert_close_to_ref, check_against_reference, rand

import flashlse as fl
from flashlse import reference as R

sparse_mod = importlib.import_module("flashlse.ops.sparse")


def make_indices(b, sq, hkv, topk, sk, p_none=0.2, empty_rows=(), unique=True):
    """Random key positions in [0, sk), about ``p_none`` of them -1, listed rows all -1."""
    if unique and sk >= topk:
        idx = torch.stack([torch.randperm(sk)[:topk] for _ in range(b * sq * hkv)])
    else:
        idx = torch.randint(0, max(sk, 1), (b * sq * hkv, topk))
    idx = idx.view(b, sq, hkv, topk).to(torch.int32)
    if sk == 0:
        idx.fill_(-1)
    idx[torch.rand(idx.shape) < p_none] = -1
    for r in empty_rows:
        idx[:, r] = -1
    return idx


# (B, Sq, Sk, Hq, Hkv, D, Dv, topk, keywords)
CASES = [
    pytest.param(2, 5, 9, 4, 2, 16, 16, 4, {}, id="basic"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, 5, dict(empty_rows=(0, 3)), id="all_minus_one_rows"),
    pytest.param(1, 4, 0, 2, 1, 16, 16, 3, {}, id="sk0"),
    pytest.param(1, 4, 7, 2, 1, 16, 16, 0, {}, id="topk0"),
    pytest.param(1, 4, 7, 2, 2, 16, 16, 1, dict(p_none=0.0), id="topk1"),
    pytest.param(1, 5, 6, 2, 2, 16, 16, 9, dict(unique=False), id="repeated_indices"),
    pytest.param(2, 5, 9, 4, 1, 16, 16, 4, {}, id="mqa"),
    pytest.param(1, 3, 8, 2, 1, 59, 111, 4, {}, id="d59_dv111"),
    pytest.param(1, 3, 8, 2, 1, 192, 128, 4, {}, id="d192_dv128"),
    pytest.param(1, 3, 63, 2, 1, 32, 32, 63, dict(p_none=0.5), id="topk63"),
    pytest.param(2, 5, 9, 4, 2, 16, 16, 4, dict(sink=True), id="sink_with_keys"),
    pytest.param(1, 6, 9, 4, 2, 16, 16, 4, dict(sink=True, empty_rows=(1, 5)),
                 id="sink_empty_rows"),
    pytest.param(1, 4, 0, 2, 1, 16, 16, 2, dict(sink=True), id="sink_no_keys"),
    pytest.param(1, 5, 9, 2, 2, 16, 16, 4, dict(scale=0.7), id="scale"),
]


def make(b, sq, sk, hq, hkv, d, dv, topk, kw, dtype):
    kw = dict(kw)
    sink = kw.pop("sink", False)
    scale = kw.pop("scale", None)
    diff = {"q": rand(b, sq, hq, d, dtype=dtype), "k": rand(b, sk, hkv, d, dtype=dtype),
            "v": rand(b, sk, hkv, dv, dtype=dtype)}
    if sink:
        diff["sink"] = rand(hq, scale=2.0)
    idx = make_indices(b, sq, hkv, topk, sk, **kw)
    # Poison the keys no row lists: they must never be read (nor get a gradient).
    listed = torch.zeros(b, sk, hkv, dtype=torch.bool)
    for i in range(b):
        for h in range(hkv):
            cols = idx[i, :, h].flatten()
            listed[i, cols[cols >= 0].long(), h] = True
    diff["k"][~listed] = float("nan")
    diff["v"][~listed] = float("nan")
    const = dict(indices=idx, scale=scale, return_lse=True)
    return diff, const


def check_empty_rows(out, lse, grads, diff, const):
    hq = diff["q"].shape[2]
    none = (const["indices"] < 0).all(-1)  # (B, Sq, Hkv)
    rows = none.repeat_interleave(hq // none.shape[-1], dim=-1)  # (B, Sq, Hq)
    assert bool((out[rows] == 0).all())
    lse_rows = lse.transpose(1, 2)[rows]
    if "sink" in diff:
        sink = diff["sink"].view(1, 1, -1).expand_as(rows)
        assert torch.equal(lse_rows, sink[rows])
    else:
        assert bool(torch.isneginf(lse_rows).all())
    if grads:
        assert bool((grads["q"][rows] == 0).all())


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,topk,kw", CASES)
def test_sparse_attention_fp32(b, sq, sk, hq, hkv, d, dv, topk, kw):
    diff, const = make(b, sq, sk, hq, hkv, d, dv, topk, kw, torch.float32)
    out, lse, grads = check_against_reference(fl.sparse_attention, R.sparse_attention, diff,
                                              const)
    check_empty_rows(out, lse, grads, diff, const)
    for name in ("k", "v"):
        assert bool((grads[name][torch.isnan(diff[name])] == 0).all())


FEW = [c for c in CASES if c.id in ("basic", "all_minus_one_rows", "repeated_indices",
                                    "d192_dv128", "sink_empty_rows")]


@pytest.mark.parametrize("dtype", [torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,topk,kw", FEW)
def test_sparse_attention_dtypes(b, sq, sk, hq, hkv, d, dv, topk, kw, dtype):
    diff, const = make(b, sq, sk, hq, hkv, d, dv, topk, kw, dtype)
    out, lse, grads = check_against_reference(fl.sparse_attention, R.sparse_attention, diff,
                                              const)
    assert out.dtype == dtype
    check_empty_rows(out, lse, grads, diff, const)


def test_sparse_equals_dense_when_all_keys_listed():
    q, k, v = rand(2, 5, 4, 16), rand(2, 7, 2, 16), rand(2, 7, 2, 24)
    sink = rand(4)
    idx = torch.arange(7, dtype=torch.int32).flip(0).expand(2, 5, 2, 7).contiguous()
    o_s, l_s = fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
    o_d, l_d = R.attention(q, k, v, sink=sink, return_lse=True)
    assert_close_to_ref(o_s, o_d)
    assert_close_to_ref(l_s, l_d, name="lse")


def test_sparse_without_grad_skips_autograd_function(monkeypatch):
    """A call with nothing to differentiate runs the forward itself (no autograd.Function
    between: its host cost); its results equal the differentiable call's bit for bit, and
    a call needing grad still goes through the Function."""
    q, k, v = rand(1, 6, 4, 16), rand(1, 9, 2, 16), rand(1, 9, 2, 16)
    idx = torch.randint(-1, 9, (1, 6, 2, 5), dtype=torch.int32)
    sink = rand(4)
    o_g, l_g = fl.sparse_attention(q.requires_grad_(), k, v, idx, sink=sink, return_lse=True)
    assert o_g.grad_fn is not None
    applied = []
    real = sparse_mod.SparseAttentionFunction.apply
    monkeypatch.setattr(sparse_mod.SparseAttentionFunction, "apply",
                        lambda *a: applied.append(1) or real(*a))
    with torch.no_grad():
        o, l = fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
    assert not applied and torch.equal(o, o_g.detach()) and torch.equal(l, l_g.detach())
    fl.sparse_attention(q, k, v, idx, sink=sink)
    assert applied


def test_sparse_chunked_topk(monkeypatch):
    # Tiny tiles: the top-k list is walked in many chunks; result unchanged.
    diff, const = make(1, 4, 40, 4, 2, 16, 16, 33, dict(sink=True, empty_rows=(2,)),
                       torch.float32)
    monkeypatch.setattr(sparse_mod, "TILE_ELEMS", 4 * 2 * 16 * 3)
    check_against_reference(fl.sparse_attention, R.sparse_attention, diff, const)


def test_sparse_unlisted_keys_are_never_read():
    q, k, v = rand(1, 3, 2, 16), rand(1, 6, 1, 16), rand(1, 6, 1, 16)
    idx = torch.tensor([[[[1, 2, -1]], [[5, -1, -1]], [[-1, -1, -1]]]], dtype=torch.int32)
    ref_out, ref_lse = R.sparse_attention(q, k, v, idx, return_lse=True)
    # Keys 0, 3 and 4 are listed nowhere: poisoned, they must not change anything.
    for j in (0, 3, 4):
        k[0, j], v[0, j] = float("nan"), float("nan")
    out, lse = fl.sparse_attention(q, k, v, idx, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")


@pytest.mark.parametrize("fn", [fl.sparse_attention, R.sparse_attention],
                         ids=["flashlse", "reference"])
@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
def test_sparse_attention_sk0(fn, with_sink):
    q, k, v = rand(1, 4, 2, 16), rand(1, 0, 1, 16), rand(1, 0, 1, 8)
    sink = rand(2) if with_sink else None
    idx = torch.full((1, 4, 1, 3), -1, dtype=torch.int32)
    out, lse = fn(q, k, v, idx, sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 4, 2, 8, dtype=out.dtype))
    want = torch.full((1, 2, 4), float("-inf")) if sink is None else sink.view(1, 2, 1)
    assert torch.equal(lse.float(), want.expand(1, 2, 4))


def test_sparse_attention_sk0_topk0():
    q, k, v = rand(1, 4, 2, 16), rand(1, 0, 1, 16), rand(1, 0, 1, 8)
    sink = rand(2)
    idx = torch.zeros((1, 4, 1, 0), dtype=torch.int32)
    out, lse = fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 4, 2, 8))
    assert torch.equal(lse, sink.view(1, 2, 1).expand(1, 2, 4))


def test_sparse_attention_strided_views():
    qf, kf = rand(2, 5, 6, 24).requires_grad_(), rand(2, 9, 4, 16).requires_grad_()
    q, k, v = qf[:, :, 2:6, :16], kf[:, :, :2], kf[:, :, 2:, :8]
    idx = make_indices(2, 5, 2, 4, 9, empty_rows=(1,))
    sink = rand(4)
    out, lse = fl.sparse_attention(q, k, v, idx, sink=sink, return_lse=True)
    leaves = [x.detach().contiguous().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = R.sparse_attention(*leaves, idx, sink=sink, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    dout = rand(*out.shape)
    dq, dkv = torch.autograd.grad(out, [qf, kf], dout)
    ref = torch.autograd.grad(ref_out, leaves, dout.double())
    assert_close_to_ref(dq[:, :, 2:6, :16], ref[0], name="dq")
    assert_close_to_ref(dkv[:, :, :2], ref[1], name="dk")
    assert_close_to_ref(dkv[:, :, 2:, :8], ref[2], name="dv")
    assert bool((dkv[:, :, 2:, 8:] == 0).all())


def run_sparse_paged(device, dtype, mla=False, page=3, seed=0):
    """sparse_attention over a paged cache (shuffled pages, unused slots NaN) against the
    reference over the same pages; indices are token positions of each sequence."""
    g = torch.Generator().manual_seed(seed)
    b, sq, hq, hkv, d, dv, lens, topk = 2, 4, 4, 1 if mla else 2, 48 if mla else 16, \
        32 if mla else 16, [10, 7], 5
    n_pages = [-(-n // page) for n in lens]
    total = sum(n_pages) + 2
    perm = torch.randperm(total, generator=g)
    k_cache = torch.full((total, page, hkv, d), float("nan"))
    v_cache = torch.full((total, page, hkv, dv), float("nan"))
    table = torch.full((b, max(n_pages)), int(perm[-1]), dtype=torch.int32)
    j = 0
    for i, n in enumerate(lens):
        for p in range(n_pages[i]):
            rows = min(page, n - p * page)
            k_cache[perm[j], :rows] = torch.randn(rows, hkv, d, generator=g)
            v_cache[perm[j], :rows] = torch.randn(rows, hkv, dv, generator=g)
            table[i, p] = perm[j]
            j += 1
    if mla:
        v_cache = k_cache[..., :dv]
    idx = torch.stack([torch.randint(0, n, (sq, hkv, topk), generator=g) for n in lens])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    idx[:, 1] = -1  # an empty row
    idx = idx.to(torch.int32)
    q = torch.randn(b, sq, hq, d, generator=g)
    sink = torch.randn(hq, generator=g)
    cast = lambda t: t.to(device=device, dtype=dtype)
    with torch.no_grad():
        k_dev = cast(k_cache)
        v_dev = k_dev[..., :dv] if mla else cast(v_cache)
        out, lse = fl.sparse_attention(cast(q), k_dev, v_dev, idx.to(device),
                                       block_table=table.to(device), sink=sink.to(device),
                                       return_lse=True)
    ref_out, ref_lse = R.sparse_attention(q.double(), k_cache.double(), v_cache.double(), idx,
                                          block_table=table, sink=sink.double(),
                                          return_lse=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla_view"])
@pytest.mark.parametrize("page", [1, 3, 16], ids=lambda p: f"page{p}")
def test_sparse_attention_paged(mla, page):
    run_sparse_paged("cpu", torch.float32, mla=mla, page=page)


def test_sparse_paged_page_outside_the_cache():
    """A listed key on a block-table entry outside [0, num_pages): a clear error with the value
    checks (always on the CPU), and no key without them -- never a read outside the cache."""
    q, k_cache = torch.randn(1, 2, 2, 16), torch.randn(3, 4, 1, 16)
    table = torch.tensor([[2, 99]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 6]], [[0, -1]]]], dtype=torch.int32)  # key 6 sits on page 99
    with torch.no_grad():
        with pytest.raises(ValueError, match="block_table entries of listed keys"):
            fl.sparse_attention(q, k_cache, k_cache, idx, block_table=table)
        with fl.value_checks(False):
            out, lse = fl.sparse_attention(q, k_cache, k_cache, idx, block_table=table,
                                           return_lse=True)
    clean = torch.where(idx == 6, -1, idx)
    ref_out, ref_lse = R.sparse_attention(q.double(), k_cache.double(), k_cache.double(), clean,
                                          block_table=torch.tensor([[2, 0]], dtype=torch.int32),
                                          return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
