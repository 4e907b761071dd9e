"""sparse_attention's forward on the kernels (ops/sparse.sparse_fwd_kernel: the split-KV decode
kernel with one page per listed (token, kv head) row), forward and backward against the
float64 reference with tests/test_sparse_attention.py's cases: unlisted K/V rows are NaN (never
read), all -1 rows empty, repeated indices counted each time, a sink merged once. Under
``TRITON_INTERPRET=1`` float32/float16 on the CPU; on a GPU float16/bfloat16, plus an MLA row
(``v = k[..., :512]``, 64 heads on one latent head)."""

from __future__ import annotations

import pytest
import torch
from _flashlse_testing import check_against_reference
from test_sparse_attention import CASES, check_empty_rows, make, make_indices, run_sparse_paged

import flashlse as fl
from flashlse import reference as R

sparse_mod = __import__("flashlse.ops.sparse", fromlist=["sparse"])
DTYPES = [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float32,
                                                                               torch.float16]


def _to(t, device):
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in t.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,topk,kw", CASES)
def test_sparse_attention_on_kernels(device, b, sq, sk, hq, hkv, d, dv, topk, kw, dtype,
                                     monkeypatch):
    calls = []
    real = sparse_mod.sparse_fwd_kernel
    monkeypatch.setattr(sparse_mod, "sparse_fwd_kernel",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    diff, const = make(b, sq, sk, hq, hkv, d, dv, topk, kw, dtype)
    diff, const = _to(diff, device), _to(const, device)
    out, lse, grads = check_against_reference(fl.sparse_attention, R.sparse_attention, diff,
                                              const)
    check_empty_rows(out.cpu(), lse.cpu(), {n: g.cpu() for n, g in grads.items()},
                     _to(diff, "cpu"), _to(const, "cpu"))
    # The forward ran on the kernel wherever it takes the call (not for topk 0 or Sk 0).
    assert calls or topk == 0 or sq == 0 or sk == 0


@pytest.mark.parametrize("b,hkv", [(1, 1), (2, 3)])
def test_out_of_range_indices_are_no_key(device, b, hkv):
    # The kernel reads the indices themselves (sequence (b, i, h) -> row (b * Sk + j) * Hkv
    # + h): out-of-range positions are masked per batch and head, never read elsewhere.
    g = torch.Generator().manual_seed(2)
    dt = torch.float16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(b, 3, 2 * hkv, 16, generator=g).to(device, dt),
               torch.randn(b, 5, hkv, 16, generator=g).to(device, dt),
               torch.randn(b, 5, hkv, 16, generator=g).to(device, dt))
    idx = torch.randint(-3, 9, (b, 3, hkv, 4), generator=g, dtype=torch.int32)
    idx[0, 0, 0] = torch.tensor([0, 4, 9, 5])
    idx = idx.to(device)
    with fl.value_checks(False):
        out, lse = fl.sparse_attention(q, k, v, idx, return_lse=True)
    clean = torch.where((idx >= 0) & (idx < 5), idx, -1)
    want_out, want_lse = R.sparse_attention(q.double(), k.double(), v.double(), clean,
                                            return_lse=True)
    tol = 2e-3 if dt == torch.float16 else 1e-5
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_sparse_mla_view_on_kernels():
    """DeepSeek's sparse MLA: one latent head of 576, v its first 512 columns, 64 heads."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 64, 576, generator=g).cuda().bfloat16()
    kv = torch.randn(1, 300, 1, 576, generator=g).cuda().bfloat16()
    idx = make_indices(1, 8, 1, 96, 300).cuda()
    out, lse = fl.sparse_attention(q, kv, kv[..., :512], idx, return_lse=True)
    want_out, want_lse = R.sparse_attention(q.double(), kv.double(), kv[..., :512].double(),
                                            idx, return_lse=True)
    torch.testing.assert_close(out.double(), want_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=3e-2, rtol=3e-2)


def test_deterministic_mode_takes_the_repeatable_path(device, monkeypatch):
    """The backward kernel scatters dK/dV with atomics; torch's deterministic mode runs the
    PyTorch path instead, with the same gradients."""
    kernels_sparse = __import__("flashlse.kernels.sparse", fromlist=["sparse"])
    calls = []
    real = kernels_sparse.sparse_bwd
    monkeypatch.setattr(kernels_sparse, "sparse_bwd",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    diff, const = make(1, 4, 9, 4, 2, 16, 16, 5, {}, DTYPES[0])
    diff, const = _to(diff, device), _to(const, device)
    grads = []
    for deterministic in (False, True):
        leaves = {n: t.clone().requires_grad_() for n, t in diff.items()}
        torch.use_deterministic_algorithms(deterministic)
        try:
            out, lse = fl.sparse_attention(**leaves, **const)
            out.float().square().sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
        grads.append([leaves[n].grad for n in ("q", "k", "v")])
    assert len(calls) == 1  # the kernel only outside deterministic mode
    for a, b in zip(*grads):
        torch.testing.assert_close(torch.nan_to_num(a.float()), torch.nan_to_num(b.float()),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla_view"])
@pytest.mark.parametrize("page", [1, 3, 16], ids=lambda p: f"page{p}")
def test_sparse_attention_paged_on_kernels(device, mla, page, monkeypatch):
    """DeepSeek-style sparse attention over a paged serving cache, on the decode kernel
    (the listed rows read in place, no gather)."""
    calls = []
    real = sparse_mod.sparse_fwd_kernel
    monkeypatch.setattr(sparse_mod, "sparse_fwd_kernel",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    run_sparse_paged(device, DTYPES[0], mla=mla, page=page)
    assert calls


@pytest.mark.parametrize("page", [1, 4], ids=lambda p: f"page{p}")
def test_sparse_paged_pages_outside_the_cache_are_no_key(device, page):
    # With the value checks off, a block-table entry outside [0, num_pages) holds no key:
    # the kernel masks it (never reads it); the answer is the reference without those keys.
    g = torch.Generator().manual_seed(3)
    dt = torch.float16 if device == "cuda" else torch.float32
    b, sq, hq, hkv, d, n_pages = 2, 3, 4, 2, 16, 3
    total = b * n_pages
    k_cache = torch.randn(total, page, hkv, d, generator=g)
    v_cache = torch.randn(total, page, hkv, d, generator=g)
    table = torch.randperm(total, generator=g).view(b, n_pages).to(torch.int32)
    table[0, 1], table[1, 2] = total + 5, -7
    idx = torch.randint(-1, n_pages * page, (b, sq, hkv, 6), generator=g, dtype=torch.int32)
    q = torch.randn(b, sq, hq, d, generator=g)
    with torch.no_grad(), fl.value_checks(False):
        out, lse = fl.sparse_attention(q.to(device, dt), k_cache.to(device, dt),
                                       v_cache.to(device, dt), idx.to(device),
                                       block_table=table.to(device), return_lse=True)
    bad = (table[torch.arange(b).view(b, 1, 1, 1), (idx.clamp(min=0) // page).long()] < 0) | (
        table[torch.arange(b).view(b, 1, 1, 1), (idx.clamp(min=0) // page).long()] >= total)
    clean = torch.where(bad, -1, idx)
    good_table = torch.where((table >= 0) & (table < total), table, 0)
    want_out, want_lse = R.sparse_attention(q.double(), k_cache.double(), v_cache.double(),
                                            clean, block_table=good_table, return_lse=True)
    tol = 2e-3 if dt == torch.float16 else 1e-5
    torch.testing.assert_close(out.double().cpu(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
def test_sparse_plan_takes_v_from_each_call(device, paged):
    """The forward keeps its plan by the call's metadata; whether v is a view of k's storage
    (MLA: the latent rows read once) or its own tensor of the same shape and strides is
    decided a call, by address: three calls of one plan, v a view, then its own rows
    (different values), then a view again, each against the float64 reference."""
    g = torch.Generator().manual_seed(7)
    dt = DTYPES[0]
    b, sq, hq, d, dv, page, n_pages = 2, 3, 4, 48, 32, 4, 3
    total = b * n_pages
    shape = (total, page, 1, d) if paged else (b, n_pages * page, 1, d)
    k_cache = torch.randn(*shape, generator=g)
    v_full = torch.randn(*shape, generator=g)
    v_own = v_full[..., :dv]  # k's strides, other rows
    table = torch.randperm(total, generator=g).view(b, n_pages).to(torch.int32)
    idx = torch.randint(-1, n_pages * page, (b, sq, 1, 6), generator=g, dtype=torch.int32)
    idx[1, 2] = -1  # an empty row: out 0, lse -inf (the reference's), no NaN
    q = torch.randn(b, sq, hq, d, generator=g)
    k_dev = k_cache.to(device, dt)
    v_dev_own = v_full.to(device, dt)[..., :dv]  # sliced after the move: .to() packs a slice
    assert v_dev_own.stride() == k_dev[..., :dv].stride()
    kw = dict(block_table=table) if paged else {}
    sparse_mod._PLANS.clear()
    for v_kind in ("view", "own", "view"):
        v_dev = k_dev[..., :dv] if v_kind == "view" else v_dev_own
        v_ref = k_cache[..., :dv] if v_kind == "view" else v_own
        with torch.no_grad():
            out, lse = fl.sparse_attention(q.to(device, dt), k_dev, v_dev, idx.to(device),
                                           return_lse=True,
                                           **{n: t.to(device) for n, t in kw.items()})
        want_out, want_lse = R.sparse_attention(q.double(), k_cache.double(), v_ref.double(),
                                                idx, return_lse=True, **kw)
        tol = 1e-5 if dt == torch.float32 else 2e-2
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out[1, 2] == 0).all() and torch.isneginf(lse[1, :, 2]).all()
        torch.testing.assert_close(out.double().cpu(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double().cpu(), want_lse, atol=tol, rtol=tol)
    # v a view or its own tensor: the same metadata, one key, its plan made once and kept.
    assert len(sparse_mod._PLANS) == 1


@pytest.mark.parametrize("paged", [False, True], ids=["flat", "paged"])
@pytest.mark.parametrize("sq,hkv,head_slice", [(1, 1, False), (2, 2, False), (2, 2, True)],
                         ids=["sq1", "sq2", "sq2-q-a-head-slice"])
def test_sparse_repeated_calls_launch_the_kept_decode_plan(device, paged, sq, hkv, head_slice):
    """After a call's first launch its decode plan is kept in the sparse plan, and calls of the
    same metadata launch it on the tensors themselves (no views, no decode key): fresh values
    each call, NaN-poisoned unlisted rows, against the float64 reference. A q the kernel's row
    view cannot alias (q's heads a slice of more heads: its rows do not merge) keeps the
    views."""
    g = torch.Generator().manual_seed(11)
    dt = DTYPES[0]
    b, hq, d, dv, page, n_pages, topk = 2, 4, 32, 16, 4, 3, 5
    total = b * n_pages
    shape = (total, page, hkv, d) if paged else (b, n_pages * page, hkv, d)
    table = torch.randperm(total, generator=g).view(b, n_pages).to(torch.int32)
    kw = dict(block_table=table) if paged else {}
    sparse_mod._PLANS.clear()
    for _ in range(3):
        k_cache = torch.randn(*shape, generator=g)
        v_cache = torch.randn(*shape[:-1], dv, generator=g)
        idx = torch.randint(-1, n_pages * page, (b, sq, hkv, topk), generator=g,
                            dtype=torch.int32)
        idx[0, -1] = -1  # an empty row
        listed = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
        for bi in range(b):
            for j in idx[bi].flatten().tolist():
                if j >= 0:
                    pos = (table[bi, j // page], j % page) if paged else (bi, j)
                    listed[pos] = True
        k_dev, v_dev = (t.masked_fill(~listed[..., None, None], float("nan")).to(device, dt)
                        for t in (k_cache, v_cache))
        wide = torch.randn(b, sq, 2 * hq if head_slice else hq, d, generator=g)
        q = wide[:, :, :hq]
        with torch.no_grad():
            out, lse = fl.sparse_attention(wide.to(device, dt)[:, :, :hq], k_dev, v_dev,
                                           idx.to(device), return_lse=True,
                                           **{n: t.to(device) for n, t in kw.items()})
        want_out, want_lse = R.sparse_attention(q.double(), k_cache.double(), v_cache.double(),
                                                idx, return_lse=True, **kw)
        tol = 1e-5 if dt == torch.float32 else 2e-3
        assert lse.is_contiguous()  # (B, Hq, Sq) as returned (the kernel writes (B, Sq, Hq))
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out[0, -1] == 0).all() and torch.isneginf(lse[0, :, -1]).all()
        torch.testing.assert_close(out.double().cpu(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double().cpu(), want_lse, atol=tol, rtol=tol)
    # A NaN in a listed key row reaches exactly the rows that list it, through the kept plan
    # too (the last call's inputs, that row NaN).
    j = int(idx[1][idx[1] >= 0][0])
    pos = (table[1, j // page], j % page) if paged else (1, j)
    k_nan = k_cache.clone()
    k_nan[pos] = float("nan")
    with torch.no_grad():
        out_n, lse_n = fl.sparse_attention(wide.to(device, dt)[:, :, :hq], k_nan.to(device, dt),
                                           v_dev, idx.to(device), return_lse=True,
                                           **{n: t.to(device) for n, t in kw.items()})
    lists = (idx == j).any(-1)  # (B, Sq, Hkv)
    lists[0] = False  # batch 0's lists name its own rows
    want_nan = lists.repeat_interleave(hq // hkv, dim=2)  # (B, Sq, Hq)
    assert torch.equal(torch.isnan(out_n).all(-1).cpu(), want_nan)
    assert torch.equal(torch.isnan(lse_n).cpu(), want_nan.transpose(1, 2))
    assert not torch.isnan(out_n.cpu()[~want_nan]).any()
    (plan,) = sparse_mod._PLANS.values()
    # The row view merges (B, Sq, Hkv): q's heads sliced from more heads merge only at one
    # kv head.
    assert plan.direct == (not head_slice or hkv == 1)
    assert len(plan.decode) == (1 if plan.direct else 0)


def test_sparse_kept_decode_plans_tell_scales_apart(device):
    """The scale is in the key of the decode plan a sparse plan keeps: calls of one metadata
    alternating two scales (each plan kept once, then reused) match the float64 reference."""
    g = torch.Generator().manual_seed(13)
    dt = DTYPES[0]
    b, sq, hq, d, sk, topk = 2, 1, 4, 32, 12, 5
    sparse_mod._PLANS.clear()
    for _ in range(2):
        for scale in (0.1, 0.4):
            q = torch.randn(b, sq, hq, d, generator=g)
            k = torch.randn(b, sk, 1, d, generator=g)
            v = torch.randn(b, sk, 1, d, generator=g)
            idx = torch.randint(-1, sk, (b, sq, 1, topk), generator=g, dtype=torch.int32)
            with torch.no_grad():
                out, lse = fl.sparse_attention(q.to(device, dt), k.to(device, dt),
                                               v.to(device, dt), idx.to(device), scale=scale,
                                               return_lse=True)
            want_out, want_lse = R.sparse_attention(q.double(), k.double(), v.double(), idx,
                                                    scale=scale, return_lse=True)
            tol = 1e-5 if dt == torch.float32 else 2e-3
            torch.testing.assert_close(out.double().cpu(), want_out, atol=tol, rtol=tol)
            torch.testing.assert_close(lse.double().cpu(), want_lse, atol=tol, rtol=tol)
    (plan,) = sparse_mod._PLANS.values()
    assert len(plan.decode) == 2
