"""The Triton-path backward (``kernels.dispatch.attn_bwd``: ``kernels/bwd.py``, with the Hopper
Gluon dK/dV and dQ where supported) against float64 autograd of ``flashlse.reference`` (dq,
dk, dv, dsink).

The loss is ``sum(out * dout) + sum(lse * dlse)`` with random ``dout`` and a random ``dlse`` on
the finite LSE entries, so the gradient through the LSE (``D = rowsum(dO * O) - dlse``) is
tested with every other term. The forward ``(out, lse)`` comes from the PyTorch path
(``attn_fwd_torch``), so these tests do not depend on the forward kernel.

Tolerance (docs/design.md §5): ``err(kernel) <= 2 * err(torch autograd in the same dtype) + atol``,
errors measured against the float64 gradients, atol relative to the gradient's scale. Empty
rows must give ``dq = 0`` exactly, and no gradient may hold a NaN; dense gradients are
allocated pre-filled with NaN so an unwritten element fails.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from _cases import GPU_HEAD_DIM_CASES, VARLEN_CASES

from flashlse import reference
from flashlse.kernels import bwd, configs, dispatch
from flashlse.masks import normalize_window
from flashlse.ops.attention import attn_fwd_torch

HAS_CUDA = torch.cuda.is_available()


def _atol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _torch_attention(q, k, v, left, right, softcap, scale, sink):
    """The same attention in q's dtype with plain torch ops: the error yardstick."""
    with reference.computed_in(q.dtype):
        out, lse = reference.attention(q, k, v, window=(left, right), softcap=softcap,
                                       scale=scale, sink=sink, return_lse=True)
    return out, lse


def _grads(fn, inputs, dout, dlse):
    """Gradients of ``sum(out * dout) + sum(lse * dlse)`` (finite lse only) w.r.t. inputs,
    with ``dout`` handed to autograd as out's gradient as it is (its strides too)."""
    out, lse = fn(*inputs)
    fin = torch.isfinite(lse.detach())
    need = [t for t in inputs if t is not None]
    outs, grads = [out], [dout.to(out.dtype)]
    lse_term = (lse[fin] * dlse.to(lse.dtype)[fin]).sum()
    if lse_term.requires_grad:  # (not where no row has a key: lse is then a constant)
        outs.append(lse_term)
        grads.append(None)
    gs = torch.autograd.grad(outs, need, grads, allow_unused=True)
    gs = [torch.zeros_like(t) if g is None else g for t, g in zip(need, gs)]
    return gs + [None] * (4 - len(gs))


def _leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)


def _check(name, ours, ref, pt, dtype):
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    assert not torch.isnan(ours).any(), f"{name}: NaN (or unwritten element)"
    if ours.numel() == 0:
        return
    ref = ref.to(ours.device)
    scale = max(1.0, ref.abs().max().item())
    err = (ours.double() - ref).abs().max().item()
    pt_err = (pt.double().to(ours.device) - ref).abs().max().item()
    assert err <= 2 * pt_err + _atol(dtype) * scale, (
        f"{name}: err {err:.3g} vs torch {dtype} {pt_err:.3g} (scale {scale:.3g})")


def _check_empty_rows(dq, lse, varlen):
    # dq (B, Sq, Hq, D) / (total_q, Hq, D); lse (B, Hq, Sq) / (Hq, total_q).
    empty = torch.isneginf(lse)
    if empty.any():
        rows = dq.transpose(0, 1) if varlen else dq.transpose(1, 2)
        assert (rows[empty.to(dq.device)] == 0).all(), "empty rows must give dq = 0"


def _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, causal=False, window=(None, None),
               softcap=0.0, sink=False, seed=0, deterministic=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hkv, dv, generator=gen).to(dtype)
    sink_t = (torch.randn(hq, generator=gen) * 2) if sink else None
    scale = 1.0 / math.sqrt(d)
    left, right = normalize_window(causal, window)
    kw = dict(left=left, right=right, softcap=softcap, scale=scale, sink=sink_t)
    out, lse = attn_fwd_torch(q, k, v, **kw)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen).masked_fill(~torch.isfinite(lse), 0.0)

    on = [None if t is None else t.to(device) for t in (dout, dlse, q, k, v, out, lse, sink_t)]
    dq, dk, dv_, dsink = dispatch.attn_bwd(*on[:7], left=left, right=right, softcap=softcap,
                                           scale=scale, sink=on[7], deterministic=deterministic)
    assert dq.dtype == dtype and dk.dtype == dtype and dv_.dtype == dtype

    def ref_fn(q_, k_, v_, s_):
        return reference.attention(q_, k_, v_, causal=causal, window=window, softcap=softcap,
                                   scale=scale, sink=s_, return_lse=True)

    f64 = torch.float64
    ref = _grads(ref_fn, [_leaf(q, f64), _leaf(k, f64), _leaf(v, f64), _leaf(sink_t, f64)],
                 dout, dlse)
    pt = _grads(lambda q_, k_, v_, s_: _torch_attention(q_, k_, v_, left, right, softcap, scale,
                                                        s_),
                [_leaf(q), _leaf(k), _leaf(v), _leaf(sink_t, dtype)], dout, dlse)
    for name, ours, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref, pt):
        _check(name, ours, r, p, dtype)
    if sink:
        assert dsink.dtype == torch.float32 and dsink.shape == (hq,)
        _check("dsink", dsink, ref[3], pt[3], dtype)
    else:
        assert dsink is None
    _check_empty_rows(dq, lse, varlen=False)
    return dq, dk, dv_, dsink


# (b, sq, sk, hq, hkv, d, dv, keywords): tiny shapes, tiles of 16 under the interpreter.
DENSE_CASES = [
    pytest.param(2, 33, 47, 2, 2, 32, 32, {}, id="base"),
    pytest.param(1, 40, 17, 2, 1, 32, 32, {"causal": True}, id="causal_sq_gt_sk_empty_rows"),
    pytest.param(1, 17, 40, 2, 1, 32, 32, {"causal": True}, id="causal_sq_lt_sk"),
    pytest.param(1, 30, 10, 2, 2, 32, 32, {"window": (2, 1)}, id="window_empties_rows"),
    pytest.param(1, 20, 45, 2, 1, 32, 32, {"window": (5, 3)}, id="window_both"),
    pytest.param(1, 45, 45, 2, 1, 32, 32, {"window": (7, None)}, id="window_left_only"),
    pytest.param(1, 20, 0, 2, 1, 32, 32, {}, id="sk0"),
    pytest.param(1, 20, 0, 2, 1, 32, 32, {"sink": True}, id="sk0_sink"),
    pytest.param(1, 25, 30, 2, 2, 32, 32, {"sink": True}, id="sink"),
    pytest.param(1, 40, 17, 2, 1, 32, 32, {"sink": True, "causal": True},
                 id="sink_empty_rows"),
    pytest.param(1, 30, 30, 2, 1, 32, 32, {"softcap": 1.5}, id="softcap"),
    pytest.param(1, 30, 20, 2, 1, 32, 32, {"softcap": 3.0, "causal": True},
                 id="softcap_causal"),
    pytest.param(1, 20, 33, 4, 2, 32, 32, {}, id="gqa"),
    pytest.param(1, 20, 33, 4, 1, 32, 32, {"causal": True, "sink": True}, id="mqa_causal_sink"),
    pytest.param(1, 1, 1, 1, 1, 32, 32, {}, id="sq1_sk1"),
    pytest.param(1, 1, 63, 2, 1, 32, 32, {"causal": True}, id="decode_row"),
    pytest.param(1, 63, 113, 1, 1, 32, 32, {"causal": True}, id="odd_63_113"),
    pytest.param(1, 20, 30, 2, 1, 59, 40, {"causal": True}, id="d59_dv40"),
    pytest.param(1, 17, 20, 2, 2, 64, 64, {"window": (3, 4)}, id="d64"),
]

# The interpreter's tl.dot is wrong on bf16, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", DENSE_CASES)
def test_attn_bwd_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, kw):
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, **kw)


@pytest.mark.parametrize("mode", [
    pytest.param({"USE_TMA": False}, id="pointers"),
    pytest.param({"EARLY_DP": False}, id="late_dp"),
    pytest.param({"HEAD_LOOP": True}, id="head_loop"),
])
def test_attn_bwd_paths(device, kernel_opts, monkeypatch, mode):
    dtype = torch.float16 if HAS_CUDA else torch.float32
    kernel_opts(bwd_config=mode)
    _run_dense(device, dtype, 1, 37, 41, 4, 2, 32, 32, causal=True, sink=True, seed=3)


def test_attn_bwd_grids_split_heads_and_batch(device, monkeypatch):
    # CUDA caps grid dims 1 and 2 at 65535, and batch x heads in one dim passes that with
    # a few thousand varlen sequences: every launch gives heads and batch a dim each.
    grids = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel
            self.arg_names = kernel.arg_names  # launch plans bind arguments by position

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    for name in ("_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        monkeypatch.setattr(bwd, name, Spy(getattr(bwd, name)))
    dtype = torch.float16 if HAS_CUDA else torch.float32
    _run_dense(device, dtype, 2, 40, 33, 4, 2, 32, 32, causal=True, sink=True, seed=6)
    # preprocess and dQ over the 4 query heads, dK/dV over the 2 kv heads; batch 2.
    assert sorted(g[1:] for g in grids) == [(2, 2), (4, 2), (4, 2)], grids


def test_attn_bwd_rejects_more_sequences_than_the_grid_holds():
    # Caught before any kernel runs, with what to do about it.
    q = torch.zeros(70000, 1, 16)
    cu = torch.arange(70001, dtype=torch.int32)
    lse = torch.zeros(1, 70000)
    with pytest.raises(ValueError, match="65535"):
        dispatch.attn_bwd(q, None, q, q, q, q, lse, left=None, right=None, softcap=0.0,
                     scale=1.0, sink=None, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                     max_seqlen_k=1)


def _run_varlen(device, dtype, seqlens_q, seqlens_k, hq, hkv, d, dv, causal=False,
                window=(None, None), used=None, sink=False, softcap=0.0, seed=0,
                deterministic=False):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=gen).to(dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=gen).to(dtype)
    v = torch.randn(int(cu_k[-1]), hkv, dv, generator=gen).to(dtype)
    sink_t = torch.randn(hq, generator=gen) if sink else None
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    left, right = normalize_window(causal, window)
    kw = dict(left=left, right=right, softcap=softcap, scale=scale)
    bounds = []
    for i in range(len(seqlens_q)):
        k0 = int(cu_k[i])
        bounds.append((int(cu_q[i]), int(cu_q[i + 1]), k0,
                       k0 + (used[i] if used is not None else seqlens_k[i])))

    def per_seq(fn, q_, k_, v_, s_):
        outs, lses = [], []
        for q0, q1, k0, k1 in bounds:
            o, l = fn(q_[None, q0:q1], k_[None, k0:k1], v_[None, k0:k1], s_)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs, 0), torch.cat(lses, 1)

    out, lse = per_seq(lambda *a: attn_fwd_torch(*a[:3], sink=a[3], **kw), q, k, v, sink_t)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen).masked_fill(~torch.isfinite(lse), 0.0)

    on = [None if t is None else t.to(device)
          for t in (dout, dlse, q, k, v, out, lse, sink_t, cu_q, cu_k, seqused)]
    dq, dk, dv_, dsink = dispatch.attn_bwd(
        *on[:7], sink=on[7], deterministic=deterministic, cu_seqlens_q=on[8],
        cu_seqlens_k=on[9], max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
        seqused_k=on[10], **kw)

    def ref_fn(q_, k_, v_, s_):
        return reference.attention_varlen(q_, k_, v_, cu_q, cu_k, max(seqlens_q), max(seqlens_k),
                                          seqused_k=seqused, causal=causal, window=window,
                                          softcap=softcap, scale=scale, sink=s_, return_lse=True)

    f64 = torch.float64
    ref = _grads(ref_fn, [_leaf(q, f64), _leaf(k, f64), _leaf(v, f64), _leaf(sink_t, f64)],
                 dout, dlse)
    pt = _grads(lambda *a: per_seq(lambda q_, k_, v_, s_: _torch_attention(
        q_, k_, v_, left, right, softcap, scale, s_), *a),
        [_leaf(q), _leaf(k), _leaf(v), _leaf(sink_t, dtype)], dout, dlse)
    for name, ours, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref, pt):
        _check(name, ours, r, p, dtype)
    if sink:
        _check("dsink", dsink, ref[3], pt[3], dtype)
    _check_empty_rows(dq, lse, varlen=True)
    return dq, dk, dv_, dsink



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("seqlens_q,seqlens_k,kw", VARLEN_CASES)
def test_attn_bwd_varlen(device, dtype, seqlens_q, seqlens_k, kw):
    _run_varlen(device, dtype, seqlens_q, seqlens_k, 4, 2, 32, 32, **kw)



@pytest.mark.parametrize("case", [
    pytest.param(dict(causal=True, sink=True), id="causal_sink"),
    pytest.param(dict(window=(5, 3), hkv=1, d=64), id="window_mqa_d64"),
    pytest.param(dict(varlen=True, causal=True, sink=True), id="varlen_seqused_sink"),
])
def test_public_training_repeats_take_the_kept_path(device, case):
    """``fl.attention`` / ``attention_varlen`` forward and backward three times with the same
    metadata on fresh values: the first call plans and keeps its forward launch, the next
    ones run it through AttentionFunction and find the backward's plan under the forward's
    key (``bwd.prepare``'s short key); the third hands a dO that is not contiguous (another
    plan). Every call's gradients (through out and lse, dsink too) against the float64
    reference."""
    import importlib

    import flashlse as fl

    attn_mod = importlib.import_module("flashlse.ops.attention")
    case = dict(case)
    varlen, hkv, d = case.pop("varlen", False), case.pop("hkv", 2), case.pop("d", 32)
    sink = case.pop("sink", False)
    mask = dict(causal=case.pop("causal", False), window=case.pop("window", (None, None)))
    dtype, f64, hq = DTYPES[0], torch.float64, 4
    lens_q, lens_k, used = [9, 0, 17], [12, 5, 20], [12, 3, 20]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))
    used_t = torch.tensor(used, dtype=torch.int32)
    lengths = (cu_q, cu_k, max(lens_q), max(lens_k))

    def ours(q_, k_, v_, s_):
        if varlen:
            return fl.attention_varlen(q_, k_, v_, *(t.to(device) for t in lengths[:2]),
                                       *lengths[2:], seqused_k=used_t.to(device), sink=s_,
                                       return_lse=True, **mask)
        return fl.attention(q_, k_, v_, sink=s_, return_lse=True, **mask)

    def ref_fn(q_, k_, v_, s_):
        if varlen:
            return reference.attention_varlen(q_, k_, v_, *lengths, seqused_k=used_t, sink=s_,
                                              return_lse=True, **mask)
        return reference.attention(q_, k_, v_, sink=s_, return_lse=True, **mask)

    def yardstick(q_, k_, v_, s_):  # the same in q's dtype with torch ops
        with reference.computed_in(dtype):
            return ref_fn(q_, k_, v_, s_)

    q_shape, kv_shape = ((26, hq, d), (37, hkv, d)) if varlen else ((2, 24, hq, d),
                                                                   (2, 30, hkv, d))
    lse_shape = (hq, 26) if varlen else (2, hq, 24)
    gen = torch.Generator().manual_seed(21)
    attn_mod._KEPT.clear()
    bwd._BWD_PLANS.clear()
    for step in range(3):
        mk = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
        leaves = [mk(*q_shape), mk(*kv_shape), mk(*kv_shape),
                  torch.randn(hq, generator=gen) if sink else None]
        dout = mk(*q_shape)
        if step == 2:  # a dO with a gap between its heads' rows: not contiguous
            dout = mk(*q_shape[:-2], 2 * hq, d)[..., ::2, :]
        dlse = torch.randn(lse_shape, generator=gen)
        on = [None if t is None else t.to(device).requires_grad_() for t in leaves]
        # (A packed call whose lengths' values are checked, as a CPU tensor's are by default,
        # takes the full path every call: the checks read them.)
        with fl.value_checks(False):
            got = _grads(ours, on, dout.to(device), dlse.to(device))
        ref = _grads(ref_fn, [_leaf(t, f64) for t in leaves], dout, dlse)
        pt = _grads(yardstick, [_leaf(t) for t in leaves], dout, dlse)
        for name, g, r, p in zip(("dq", "dk", "dv", "dsink"), got, ref, pt):
            if r is not None:
                _check(f"step {step} {name}", g, r, p, dtype)
        assert attn_mod._KEPT, "the first call keeps its forward launch"
        if step >= 1:
            kept = set(attn_mod._KEPT)
            assert any(isinstance(key[0], tuple) and key[0] in kept for key in bwd._BWD_PLANS)


def test_public_training_kept_path_lse_contract(device):
    """The LSE contract on repeated training calls (the kept path after the first): causal
    with Sq > Sk, so rows 0-11 see no key. Empty rows are exactly (out 0, lse -inf), or lse
    = the sink; a -inf sink is no sink, bit for bit; the gradients (through out and lse)
    have no NaN and match the float64 reference; a NaN key reaches exactly the rows that see
    it (its batch, its kv head's query heads, rows from the key's on), never an
    empty-looking row, and every other row equals the clean call bit for bit."""
    import importlib

    import flashlse as fl

    attn_mod = importlib.import_module("flashlse.ops.attention")
    dtype, f64 = DTYPES[0], torch.float64
    b, sq, sk, hq, hkv, d = 2, 30, 18, 4, 2, 32
    gen = torch.Generator().manual_seed(33)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)
    q, k, v = mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    dout, dlse = mk(b, sq, hq, d), torch.randn(b, hq, sq, generator=gen)
    attn_mod._KEPT.clear()

    def call(k_, sink):
        leaves = [t.clone().requires_grad_() for t in (q, k_, v)]
        out, lse = fl.attention(*leaves, causal=True, sink=sink, return_lse=True)
        return out, lse, leaves

    empty = torch.arange(sq, device=device) < sq - sk  # (causal, bottom-right)
    for sink in (None, torch.full((hq, ), float("-inf"), device=device),
                 torch.randn(hq, generator=gen).to(device)):
        first = None
        for _ in range(2):  # the second call takes the kept launch
            out, lse, leaves = call(k, sink)
            assert (out[:, empty] == 0).all()
            if sink is None or torch.isneginf(sink).all():
                assert torch.isneginf(lse[:, :, empty]).all()
            else:
                want = sink[None, :, None].expand(b, hq, int(empty.sum())).to(lse.dtype)
                assert torch.equal(lse[:, :, empty], want)
            assert not torch.isinf(lse[:, :, ~empty]).any() and not out.isnan().any()
            fin = torch.isfinite(lse.detach())
            grads = torch.autograd.grad([out, (lse[fin] * dlse.to(device)[fin]).sum()],
                                        leaves, [dout, None])
            assert not any(g.isnan().any() for g in grads)
            if first is None:
                first = (out, lse, grads)
            else:  # the kept call equals the full path's bit for bit
                assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
                assert all(torch.equal(x, y) for x, y in zip(grads, first[2]))
        assert attn_mod._KEPT
        if sink is None:
            none = first
        elif torch.isneginf(sink).all():
            assert torch.equal(first[0], none[0]) and torch.equal(first[1], none[1])
    ref = reference.attention(*(t.detach().to(f64).requires_grad_() for t in (q, k, v)),
                              causal=True, return_lse=True)
    torch.testing.assert_close(none[0].to(f64).cpu(), ref[0].detach().cpu(),
                               atol=_atol(dtype), rtol=0)
    # A NaN key: batch 1, kv head 1 (query heads 2, 3), key 5 (rows 17 and on see it).
    k_bad = k.clone()
    k_bad[1, 5, 1, 3] = float("nan")
    out, lse, _ = call(k_bad, None)
    bad = torch.zeros(b, hq, sq, dtype=torch.bool, device=device)
    bad[1, 2:4, 5 + sq - sk:] = True
    rows = out.transpose(1, 2)  # (b, head, row, d)
    assert torch.equal(torch.isnan(lse), bad) and torch.equal(torch.isnan(rows).any(-1), bad)
    assert torch.equal(lse[~bad], none[1][~bad])
    assert torch.equal(rows[~bad], none[0].transpose(1, 2)[~bad])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv,kw", GPU_HEAD_DIM_CASES)
def test_attn_bwd_gpu_head_dims(device, dtype, d, dv, kw):
    _run_dense(device, dtype, 2, 300, 457, 4, 2, d, dv, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    pytest.param(dict(sq=1000, sk=400, causal=True), id="causal_sq_gt_sk"),
    pytest.param(dict(sq=500, sk=0, sink=True), id="sk0_sink"),
    pytest.param(dict(sq=700, sk=300, causal=True, sink=True), id="sink_empty_rows"),
    pytest.param(dict(sq=1, sk=1025, causal=True), id="decode_row"),
    pytest.param(dict(sq=255, sk=203, window=(31, 0)), id="odd_window"),
    pytest.param(dict(sq=513, sk=513, softcap=30.0), id="softcap"),
])
def test_attn_bwd_gpu_edges(device, case):
    case = dict(case)
    sq, sk = case.pop("sq"), case.pop("sk")
    _run_dense(device, torch.bfloat16, 2, sq, sk, 8, 2, 128, 128, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attn_bwd_gpu_varlen(device, causal):
    _run_varlen(device, torch.bfloat16, [300, 0, 600, 1, 129], [400, 300, 600, 0, 129],
                8, 1, 128, 128, causal=causal, used=[400, 300, 500, 0, 64], sink=True)


@pytest.mark.gpu
def test_attn_bwd_gpu_deterministic(device):
    gen = torch.Generator().manual_seed(7)
    b, sq, sk, hq, hkv, d = 2, 1000, 1000, 8, 2, 128
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16).to(device)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    sink = torch.randn(hq, generator=gen).to(device)
    kw = dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=sink)
    out, lse = attn_fwd_torch(q, k, v, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    runs = [dispatch.attn_bwd(dout, dlse, q, k, v, out, lse, deterministic=True, **kw)
            for _ in range(3)]
    for other in runs[1:]:
        for name, a, c in zip(("dq", "dk", "dv", "dsink"), runs[0], other):
            assert torch.equal(a, c), f"{name} differs between runs with deterministic=True"


def test_attn_bwd_dlse_none_expanded_dout(device):
    # What autograd may hand over: no lse gradient, and a broadcast (stride-0) dout.
    from flashlse.ops.attention import attn_bwd_torch

    dtype = torch.float16 if HAS_CUDA else torch.float32
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 21, 2, 32, generator=gen).to(dtype).to(device)
    k, v = (torch.randn(1, 26, 1, 32, generator=gen).to(dtype).to(device) for _ in range(2))
    kw = dict(left=None, right=0, softcap=0.0, scale=0.2, sink=None)
    out, lse = attn_fwd_torch(q, k, v, **kw)
    dout = torch.ones(1, 1, 1, 1, dtype=dtype, device=device).expand_as(out)
    ours = dispatch.attn_bwd(dout, None, q, k, v, out, lse, **kw)
    ref = attn_bwd_torch(dout, torch.zeros_like(lse), q, k, v, out, lse, **kw)
    for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, r, atol=_atol(dtype) * 4, rtol=1e-2, msg=name)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_attn_bwd_shipped_tiles(device, kernel_opts, monkeypatch, d):
    # The GPU tile table itself (the interpreter otherwise runs 16 x 16 tiles): every head
    # dim's dK/dV and dQ tiles, with the masks' boundary tiles and empty rows.
    if device == "cuda":
        pytest.skip("the GPU runs these tiles in every other test")
    kernel_opts(bwd_config={"dkdv": configs.BWD_DKDV[d].tile, "dq": configs.BWD_DQ[d].tile})
    _run_dense(device, torch.float32, 1, 150, 131, 2, 1, d, d, causal=True, sink=True)


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The Hopper Gluon dK/dV and dQ kernels (bwd_sm90.py, D = 128), and bwd.py's kernels on the
# same cases with the Gluon ones switched off.
SM90_CASES = [
    pytest.param(dict(b=2, sq=700, sk=900, hq=4, hkv=2), id="base_gqa"),
    pytest.param(dict(b=1, sq=1000, sk=1000, hq=4, hkv=4, causal=True), id="causal"),
    pytest.param(dict(b=2, sq=1000, sk=400, hq=8, hkv=2, causal=True, sink=True),
                 id="causal_sq_gt_sk_sink"),
    pytest.param(dict(b=1, sq=300, sk=1300, hq=4, hkv=1, causal=True), id="causal_sq_lt_sk_mqa"),
    pytest.param(dict(b=1, sq=255, sk=203, hq=4, hkv=2, window=(31, 0)), id="window_31_0"),
    pytest.param(dict(b=1, sq=700, sk=1000, hq=4, hkv=2, window=(100, 50)), id="window_both"),
    pytest.param(dict(b=1, sq=900, sk=900, hq=2, hkv=1, window=(200, None)), id="left_only"),
    pytest.param(dict(b=1, sq=1, sk=1025, hq=4, hkv=1, causal=True), id="decode_row"),
    pytest.param(dict(b=1, sq=65, sk=63, hq=2, hkv=1), id="one_half_block"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("path", ["fused", "sm90", "tl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", SM90_CASES)
def test_attn_bwd_gpu_sm90(device, kernel_opts, monkeypatch, dtype, case, path):
    """fused: the default (dQ added in the dK/dV pass); sm90: the two Hopper passes
    (deterministic calls); tl: bwd.py's kernels."""
    from flashlse.kernels import bwd_sm90

    calls = []

    def counted(part, real):
        def plan(p):
            run = real(p)
            if run is not None:  # the dispatcher launches it
                calls.append(part)
            return run
        return plan

    for part in ("dkdv", "dq", "fused"):
        name = f"{part}_plan"
        if part != "fused":
            kernel_opts(**{f"sm90_{part}": path != "tl"})
        monkeypatch.setattr(bwd_sm90, name, counted(part, getattr(bwd_sm90, name)))
    case = dict(case)
    b, sq, sk, hq, hkv = (case.pop(n) for n in ("b", "sq", "sk", "hq", "hkv"))
    _run_dense(device, dtype, b, sq, sk, hq, hkv, 128, 128, seed=5,
               deterministic=path == "sm90", **case)
    assert sorted(calls) == {"fused": ["fused"], "sm90": ["dkdv", "dq"], "tl": []}[path], calls


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("case", [
    pytest.param(dict(b=4, sq=1024, sk=1024, hq=16, hkv=16, causal=True), id="causal_1k"),
    pytest.param(dict(b=2, sq=2048, sk=2048, hq=8, hkv=2), id="full_gqa_2k"),
    pytest.param(dict(b=2, sq=1000, sk=700, hq=8, hkv=1, window=(300, 0)), id="window_mqa"),
])
@pytest.mark.parametrize("d", [64, 128])
def test_attn_bwd_gpu_sm90_fused_matches_two_passes(case, d):
    """The fused backward (dQ added by TMA reduces, in an order that varies) against the two
    Hopper passes (deterministic): dK and dV computed by the same products in the same
    order, equal bit for bit; dQ's float32 sums in another order, within one bf16 rounding.
    D = 64: the warpgroups take dQ's tiles in turn (D = 128: each its half of the columns)."""
    g = torch.Generator().manual_seed(51)
    case = dict(case)
    b, sq, sk, hq, hkv = (case.pop(n) for n in ("b", "sq", "sk", "hq", "hkv"))
    mk = lambda s, h: torch.randn(b, s, h, d, generator=g).to("cuda", torch.bfloat16)
    q, k, v, dout = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq)
    left, right = normalize_window(case.pop("causal", False), case.pop("window", (None, None)))
    kw = dict(left=left, right=right, softcap=0.0, scale=d ** -0.5, sink=None)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    from flashlse.kernels import bwd_sm90

    runs = []
    real = bwd_sm90.fused_plan
    with pytest.MonkeyPatch.context() as mp:
        # (A kept plan keeps its kernels' choice: fresh plans ask fused_plan.)
        mp.setattr(bwd, "_BWD_PLANS", {})
        mp.setattr(bwd_sm90, "fused_plan", lambda p: runs.append(real(p)) or runs[-1])
        fused = dispatch.attn_bwd(dout, None, q, k, v, out, lse, **kw)
    assert runs and all(runs)  # the fused pass ran
    two = dispatch.attn_bwd(dout, None, q, k, v, out, lse, deterministic=True, **kw)
    assert torch.equal(fused[1], two[1]) and torch.equal(fused[2], two[2])
    assert not fused[0].isnan().any()
    torch.testing.assert_close(fused[0].float(), two[0].float(), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("wide", [False, True], ids=["d128", "d256"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two_pass", "default"])
def test_attn_bwd_varlen_neg_inf_sink_is_no_sink(device, deterministic, wide):
    """The varlen backward's statistics start each sequence at a 16-byte boundary
    (``stats_offset``): with sequences whose starts are not multiples of 4, one with no key
    and some rows that see none (causal, Sq > Sk), a -inf sink gives what no sink gives:
    empty rows out 0 and lse -inf (the float64 reference's), no NaN anywhere, equal
    gradients (bit for bit where deterministic), a zero dsink. On an H100 / H200 at D = 128
    the Hopper kernels (fused by default, two passes when deterministic), at D = 256 the
    role split and the Hopper dQ; elsewhere bwd.py's."""
    import flashlse as fl

    if wide and device != "cuda":
        pytest.skip("D = 256: the Hopper role split (the interpreter runs D = 32)")
    dtype, d = (torch.bfloat16, 256 if wide else 128) if device == "cuda" else (torch.float32,
                                                                                32)
    lens_q, lens_k = [5, 3, 7, 0, 6, 9], [4, 0, 9, 2, 3, 9]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device=device) for n in (lens_q, lens_k))
    g = torch.Generator().manual_seed(71)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(device, dtype)
    q, k, v = mk(sum(lens_q), 4), mk(sum(lens_k), 2), mk(sum(lens_k), 2)

    def run(sink):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s = None if sink is None else sink.clone().requires_grad_()
        out, lse = fl.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                       causal=True, sink=s, return_lse=True,
                                       deterministic=deterministic)
        (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
        return out, lse, [t.grad for t in leaves], s

    out, lse, grads, s = run(torch.full((4,), float("-inf"), device=device))
    out0, lse0, grads0, _ = run(None)

    def ref(dt):  # the reference's out, lse and gradients of the same loss, in dtype dt
        leaves = [t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = reference.attention_varlen(*leaves, cu_q.cpu(), cu_k.cpu(), max(lens_q),
                                          max(lens_k), causal=True, return_lse=True)
        (o.float().square().sum() + l.masked_fill(torch.isneginf(l), 0).sum()).backward()
        return o.detach(), l.detach(), [t.grad for t in leaves]

    want_out, want_lse, want_grads = ref(torch.float64)
    for name, ours, r, p in zip(("dq", "dk", "dv"), grads, want_grads, ref(dtype)[2]):
        _check(name, ours, r, p, dtype)  # every sequence's rows where its own layout puts them
    empty = torch.isneginf(want_lse)
    assert empty.any() and (~empty).any()
    assert torch.isneginf(lse.cpu()[empty]).all() and not torch.isnan(lse).any()
    assert (out.transpose(0, 1).cpu()[empty] == 0).all()
    torch.testing.assert_close(out.cpu().double(), want_out, atol=_atol(dtype) * 4, rtol=0)
    for a, b in zip(grads, grads0):
        assert not torch.isnan(a).any()
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=_atol(dtype), rtol=0)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    assert torch.equal(s.grad, torch.zeros_like(s.grad))


def _lpt_ids(pid, n_n, n_h, n_b, programs=256):
    """``bwd_sm90._block_ids``'s LPT arithmetic in Python (Gluon does not run on the CPU):
    ``(key block, kv head, batch)`` of the program with linear id ``pid``."""
    sec = max(programs // n_n, 1)
    i_s, r = divmod(pid, sec * n_n)
    width = min(sec, n_h * n_b - i_s * sec)
    i_n = r // width
    pair = i_s * sec + (r - i_n * width)
    return i_n, pair % n_h, pair // n_h


@pytest.mark.parametrize("n_n,n_h,n_b", [(1, 1, 1), (4, 2, 40), (8, 4, 16), (64, 4, 2),
                                         (300, 1, 1), (3, 5, 7), (256, 16, 1), (7, 3, 100)])
def test_attn_bwd_sm90_lpt_order_is_a_permutation(n_n, n_h, n_b):
    """The longest-first order (a model of ``_block_ids``'s arithmetic, checked on the GPU by
    ``test_attn_bwd_gpu_sm90_lpt_order_covers_every_block``) deals every (key block, kv
    head, batch) exactly once, grids from one program to more key blocks than a section,
    and a short last section; within a section the key blocks go in order (block 0, the
    longest of a causal call, first) and each section's programs cover whole pairs."""
    from flashlse.kernels import bwd_sm90

    programs = int(getattr(bwd_sm90.LPT_PROGRAMS, "value", bwd_sm90.LPT_PROGRAMS))
    ids = [_lpt_ids(p, n_n, n_h, n_b, programs) for p in range(n_n * n_h * n_b)]
    assert sorted(ids) == [(i, h, b) for i in range(n_n) for h in range(n_h)
                           for b in range(n_b)]
    sec = max(programs // n_n, 1) * n_n
    for start in range(0, len(ids), sec):
        blocks = [i for i, _, _ in ids[start:start + sec]]
        assert blocks == sorted(blocks)
        pairs = {(h, b) for _, h, b in ids[start:start + sec]}
        assert len(pairs) * n_n == len(blocks)


def test_attn_bwd_sm90_fused_dq_forms(monkeypatch):
    """The fused dK/dV kernel's dQ forms (no GPU needed): at D = 128 each warpgroup takes half
    of dQ's columns every tile, at D = 64 (half a K row would cut its 128-byte swizzle atom)
    whole tiles in turn; the float32 dQ's host descriptor boxes match. D = 64 is in the fused
    pass's domain by ``FUSED_D64`` (measured 1.005-1.062x the two passes, session 36)."""
    bwd_sm90 = pytest.importorskip("flashlse.kernels.bwd_sm90")

    assert bwd_sm90._dq_cols(128) == 64 and bwd_sm90._dq_cols(64) == 64
    for d, block_m in ((64, 64), (128, 64)):
        dq_box = bwd_sm90._dkdv_host_spec(torch.bfloat16, d, block_m)[-1]
        assert dq_box[:3] == ("rows", block_m, 64) and dq_box[3].swizzle_byte_width == 0
        # Swizzled staging (DQ_SWIZZLE): a tile's columns in 32-column (128-byte) boxes.
        dq_box = bwd_sm90._dkdv_host_spec(torch.bfloat16, d, block_m, True)[-1]
        assert dq_box[:3] == ("rows", block_m, 32) and dq_box[3].swizzle_byte_width == 128
    assert bwd_sm90.DQ_SWIZZLE
    assert bwd_sm90._fused_dims() == (64, 128)
    monkeypatch.setattr(bwd_sm90, "FUSED_D64", False)
    assert bwd_sm90._fused_dims() == (128, )


def test_attn_bwd_sm90_lpt_rule(monkeypatch):
    """The longest-first dK/dV order (``bwd_sm90.LPT``) is taken by causal GQA calls only (a
    right bound and no left one, more query heads than kv heads), at every head dim:
    measured to pay there and to cost 2.5-3.5% on non-causal calls (no metadata beyond the
    plan's keywords needed)."""
    from flashlse.kernels import bwd_sm90

    rule = lambda group, left, right, d=128: bwd_sm90._lpt(dict(
        GROUP=group, HAS_LEFT=left, HAS_RIGHT=right, D=d))
    assert rule(4, False, True) and rule(2, False, True)
    assert not rule(1, False, True)  # MHA
    assert not rule(4, False, False)  # non-causal
    assert not rule(4, True, True)  # a window with both bounds
    assert rule(4, False, True, d=64) and rule(4, False, True, d=256)
    monkeypatch.setattr(bwd_sm90, "LPT", False)
    assert not rule(4, False, True)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64_wide", "d128", "d256_roles_wide"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two_pass", "fused"])
def test_attn_bwd_gpu_sm90_lpt_order_covers_every_block(monkeypatch, deterministic, d):
    """The dK/dV grid in longest-first sections (``bwd_sm90.LPT``: causal GQA) over several
    sections and a short last one (80 (batch, kv head) pairs of 4 key blocks: sections of
    64 pairs), GQA 2:1: the two-pass gradients equal the grid order's bit for bit, the
    fused pass's (dQ by float32 reduce-adds, in any order) the float64 reference's within
    bf16 tolerance as the grid order's do; outputs start NaN-poisoned, so a block no
    program took shows. D = 64 and 256 (the role split's 64-key programs) too."""
    from flashlse import kernel_options
    from flashlse.kernels import bwd_sm90

    g = torch.Generator().manual_seed(62)
    b, s, hq, hkv = 40, 400, 4, 2
    q, dout = (torch.randn(b, s, hq, d, generator=g).to("cuda", torch.bfloat16)
               for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    kw = dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=None)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    taken = []
    real = bwd_sm90._lpt
    monkeypatch.setattr(bwd_sm90, "_lpt", lambda args: taken.append(real(args)) or taken[-1])

    def grads(lpt):
        monkeypatch.setattr(bwd_sm90, "LPT", lpt)
        bwd._BWD_PLANS.clear()
        with kernel_options(poison_outputs=True):
            return dispatch.attn_bwd(dout, None, q, k, v, out, lse,
                                     deterministic=deterministic, **kw)[:3]

    on = grads(True)
    assert taken and all(taken)  # causal GQA: the rule takes the order
    off = grads(False)
    bwd._BWD_PLANS.clear()
    for x, y in zip(on, off):
        assert not x.isnan().any()
        if deterministic:
            assert torch.equal(x, y)
    dlse = torch.zeros(b, hq, s, device="cuda")
    ref = _grads(lambda *t: reference.attention(*t, causal=True, return_lse=True),
                 [_leaf(t, torch.float64) for t in (q, k, v)], dout, dlse)
    pt = _grads(lambda *t: _torch_attention(*t, None, 0, 0.0, d ** -0.5, None),
                [_leaf(t) for t in (q, k, v)], dout, dlse)
    for name, x, r, y in zip(("dq", "dk", "dv"), on, ref, pt):
        _check(name, x, r, y, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("heads", ["adjacent", "head_major"])
def test_attn_bwd_gpu_sm90_host_descriptors_equal_per_program_ones(monkeypatch, heads):
    """Dense Hopper backward on TMA descriptors made on the host (HOST_DESC; DQ_HOST_DESC
    for the dQ pass) against the per-program descriptors: deterministic, so the same products
    in the same order, equal bit for bit, at lengths that are no multiple of a tile, GQA and
    three sequences (batch and head offsets in every coordinate). A head-major view (heads
    not adjacent) takes the per-program path both times."""
    from flashlse.kernels import bwd, bwd_sm90

    g = torch.Generator().manual_seed(61)
    b, sq, sk, hq, hkv, d = 3, 333, 400, 8, 2, 128

    def mk(s, h):
        if heads == "head_major":
            return torch.randn(b, h, s, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
        return torch.randn(b, s, h, d, generator=g).to("cuda", torch.bfloat16)

    q, k, v, dout = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq)
    kw = dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=None)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)

    launched = []
    real_call = bwd_sm90._HostDescs.__call__
    monkeypatch.setattr(bwd_sm90._HostDescs, "__call__",
                        lambda self, *t: launched.append(len(t)) or real_call(self, *t))

    def grads(host):
        monkeypatch.setattr(bwd_sm90, "HOST_DESC", host)
        monkeypatch.setattr(bwd_sm90, "DQ_HOST_DESC", host)
        bwd._BWD_PLANS.clear()
        return dispatch.attn_bwd(dout, None, q, k, v, out, lse, deterministic=True, **kw)[:3]

    on = grads(True)
    # Both passes on host descriptors (dK/dV's 11 arguments, dQ's 10), or neither.
    assert launched == ([11, 10] if heads == "adjacent" else [])
    # Later calls of the plan launch through DescLaunch's direct path (descriptors encoded
    # by address, handed to Triton's C launcher): the same inputs again, then copies at new
    # addresses (and the fused pass, dK and dV bit for bit, dQ to float32 rounding).
    def again(fresh, deterministic=True):
        ts = [torch.empty_like(t).copy_(t) if fresh else t for t in (dout, q, k, v, out, lse)]
        return dispatch.attn_bwd(ts[0], None, *ts[1:], deterministic=deterministic, **kw)[:3]

    for x, y in zip(on, again(False)):
        assert torch.equal(x, y)
    for x, y in zip(on, again(True)):
        assert torch.equal(x, y)
    for _ in range(2):  # the fused pass's first call (JIT path), then its direct one
        fused = again(True, deterministic=False)
        assert torch.equal(fused[1], on[1]) and torch.equal(fused[2], on[2])
        # The same products summed in another order: a bf16 ulp apart at most.
        torch.testing.assert_close(fused[0], on[0], rtol=1e-2,
                                   atol=1e-2 * on[0].abs().max().item())
    if heads == "adjacent":  # the direct path was taken (this triton's launcher known)
        runs = [r.kernel if isinstance(r, bwd_sm90._FusedRun) else r
                for plan in bwd._BWD_PLANS.values() for r in plan.launches.values()
                if isinstance(r, (bwd_sm90._HostDescs, bwd_sm90._FusedRun))]
        assert len(runs) == 3 and all(r.launch._direct for r in runs)
    n_host = len(launched)
    off = grads(False)
    bwd._BWD_PLANS.clear()
    assert len(launched) == n_host
    for x, y in zip(on, off):
        assert not x.isnan().any() and torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("order", ["grid", "lpt"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two_pass", "fused"])
def test_attn_bwd_gpu_sm90_direct_launch_keeps_the_lse_contract(monkeypatch, deterministic, d,
                                                                 order):
    """The dense Hopper backward's later calls of a plan launch through ``DescLaunch``'s
    direct path (host descriptors handed to Triton's C launcher, encodings kept by address).
    Each case runs three times and checks the third: causal with Sq > Sk (rows 0-99 see no
    key): out 0 and lse -inf there, gradients against the float64 reference, empty rows' dq
    zero, no NaN; a -inf sink gives what no sink gives (bit for bit where deterministic)
    and a zero dsink. A NaN in one key of batch 0, kv head 0: out and lse NaN in exactly the
    rows that see it (rows 250-299 of query heads 0 and 1), the rest as the clean call's;
    the gradients NaN in those rows' dq and in that kv head's dK / dV (a masked 0 times the
    NaN key inside a tile may reach more of its rows: IEEE), never outside batch 0's kv head
    0, where they equal the clean call's. D = 256: the role split (two passes either way).
    ``order``: the dK/dV grid in id order, or longest first (``bwd_sm90.LPT``: causal GQA,
    here 2:1)."""
    import flashlse as fl
    from flashlse.kernels import bwd, bwd_sm90

    monkeypatch.setattr(bwd_sm90, "LPT", order == "lpt")
    taken = []
    real = bwd_sm90._lpt
    monkeypatch.setattr(bwd_sm90, "_lpt", lambda args: taken.append(real(args)) or taken[-1])
    g = torch.Generator().manual_seed(73)
    b, sq, sk, hq, hkv, dtype = 2, 300, 200, 4, 2, torch.bfloat16
    mk = lambda s, h: torch.randn(b, s, h, d, generator=g).to("cuda", dtype)
    q, k, v, dout = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq)
    bwd._BWD_PLANS.clear()

    def run(k_in, sink):
        for _ in range(3):  # the first call plans and compiles; the later ones go direct
            leaves = [t.clone().requires_grad_() for t in (q, k_in, v)]
            s = None if sink is None else sink.clone().requires_grad_()
            out, lse = fl.attention(*leaves, causal=True, sink=s, return_lse=True,
                                    deterministic=deterministic)
            (out.float() * dout.float()).sum().backward()
        return out.detach(), lse.detach(), [t.grad for t in leaves], s

    out, lse, grads, _ = run(k, None)
    runs = [r.kernel if isinstance(r, bwd_sm90._FusedRun) else r
            for plan in bwd._BWD_PLANS.values() for r in plan.launches.values()
            if isinstance(r, (bwd_sm90._HostDescs, bwd_sm90._FusedRun))]
    assert runs and all(r.launch._direct for r in runs)  # the direct path ran
    assert taken and all(x == (order == "lpt") for x in taken)

    leaves = [_leaf(t, torch.float64) for t in (q, k, v)]
    want_out, want_lse = reference.attention(*leaves, causal=True, return_lse=True)
    (want_out * dout.double()).sum().backward()
    same = [_leaf(t) for t in (q, k, v)]  # the error yardstick: torch in bf16
    (_torch_attention(*same, None, 0, 0.0, d ** -0.5, None)[0].float()
     * dout.float()).sum().backward()
    for name, ours, r, y in zip(("dq", "dk", "dv"), grads, leaves, same):
        _check(name, ours, r.grad, y.grad, dtype)
    empty = torch.isneginf(want_lse)  # (B, Hq, Sq): rows 0-99
    assert empty[:, :, :100].all() and not empty[:, :, 100:].any()
    assert torch.isneginf(lse[empty]).all() and not lse.isnan().any()
    assert (out[:, :100] == 0).all() and (grads[0][:, :100] == 0).all()

    sunk = run(k, torch.full((hq,), float("-inf"), device="cuda"))
    assert torch.equal(sunk[0], out) and torch.equal(sunk[1], lse)
    for a, b_ in zip(sunk[2], grads):
        assert not a.isnan().any()
        if deterministic:
            assert torch.equal(a, b_)
        else:
            torch.testing.assert_close(a, b_, atol=_atol(dtype), rtol=0)
    assert torch.equal(sunk[3].grad, torch.zeros_like(sunk[3].grad))

    k_bad = k.clone()
    k_bad[0, 150, 0, 5] = float("nan")
    out_b, lse_b, bad, _ = run(k_bad, None)
    bwd._BWD_PLANS.clear()  # (their keys leave the order out)
    sees = torch.zeros(b, sq, hq, dtype=torch.bool, device="cuda")
    sees[0, 250:, :2] = True  # row i sees keys <= i - 100
    assert torch.equal(out_b.isnan().any(-1), sees) and out_b[sees].isnan().all()
    assert torch.equal(lse_b.isnan(), sees.transpose(1, 2))
    assert torch.equal(out_b[~sees], out[~sees])
    assert bad[0][sees].isnan().all()
    # Outside batch 0's kv head 0 (query heads 0, 1) nothing moves.
    for a, b_, heads in zip(bad, grads, (slice(2, 4), slice(1, 2), slice(1, 2))):
        for x, y in ((a[1], b_[1]), (a[0, :, heads], b_[0, :, heads])):
            assert not x.isnan().any()
            if deterministic:
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(x, y, atol=_atol(dtype), rtol=0)
    assert bad[1][0, :, 0].isnan().any() and bad[2][0, :, 0].isnan().any()


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("path", ["sm90", "tl", "sm90_lpt"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attn_bwd_gpu_sm90_varlen(device, kernel_opts, monkeypatch, causal, d, path):
    # D = 256: the dK/dV kernel's role split, on per-program descriptors (varlen).
    # sm90 / sm90_lpt: the dK/dV grid in id order / longest first (bwd_sm90.LPT; causal GQA).
    from flashlse.kernels import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "LPT", path == "sm90_lpt")
    bwd._BWD_PLANS.clear()
    kernel_opts(sm90_dkdv=path != "tl")
    kernel_opts(sm90_dq=path != "tl")
    _run_varlen(device, torch.bfloat16, [300, 0, 600, 1, 129], [400, 300, 600, 0, 129],
                8, 2, d, d, causal=causal, used=[400, 300, 500, 0, 64], sink=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("order", ["grid", "lpt"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_attn_bwd_gpu_sm90_varlen_bad_data_stays_in_its_sequence(monkeypatch, d, order):
    """A packed varlen backward where one document is bad (a NaN query row and NaN rows of
    dO: its lse_log2 and delta rows are NaN) and others good: the bad document's gradients
    are NaN where the data reaches (nothing hides it), and the documents before and after
    it get exactly the gradients of the same call without it (their tiles read past their
    own end as zeros, never the next document's rows). Hopper dK/dV and dQ, causal, GQA;
    the dK/dV grid in id order or longest first (``bwd_sm90.LPT``, causal GQA's default)."""
    from flashlse.kernels import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "LPT", order == "lpt")
    bwd._BWD_PLANS.clear()
    g = torch.Generator().manual_seed(41)
    dev, dtype, hq, hkv = "cuda", torch.bfloat16, 8, 2
    lens = [300, 200, 333, 129]
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(device=dev, dtype=dtype)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,
                                 device=dev)
    n = sum(lens)
    q, k, v, dout = mk(n, hq), mk(n, hkv), mk(n, hkv), mk(n, hq)
    b0, b1 = 300, 500  # document 1's rows
    q[b0 + 7, 2] = float("nan")
    dout[b0:b1] = float("nan")
    keep = torch.cat([torch.arange(0, b0), torch.arange(b1, n)]).to(dev)

    def grads(q, k, v, dout, lens):
        kw = dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=None,
                  cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens), max_seqlen_q=max(lens),
                  max_seqlen_k=max(lens))
        out, lse = dispatch.attn_fwd(q, k, v, **kw)
        return dispatch.attn_bwd(dout, None, q, k, v, out, lse, **kw)[:3]

    got = grads(q, k, v, dout, lens)
    want = grads(q[keep], k[keep], v[keep], dout[keep], lens[:1] + lens[2:])
    for i, (x, w) in enumerate(zip(got, want)):
        assert x[b0:b1].isnan().any()
        # dQ by the fused pass: float32 sums in a varying order (within one bf16 rounding).
        tol = dict(rtol=1.6e-2, atol=1e-3) if i == 0 else dict(rtol=0, atol=0)
        torch.testing.assert_close(x[keep].float(), w.float(), **tol)


# The Gluon kernels at their other head dims: dQ at D = 256, dK/dV at D = 256 (the role
# split) and D = 64 (two passes, deterministic: its dQ is bwd.py's there;
# configs.BWD_SM90_DKDV_DIMS), and D = 64's fused pass (the default: dQ's tiles taken by
# the warpgroups in turn, bwd_sm90.FUSED_D64).
# window_31_0 has rows that see no key and no sink (lse = -inf, dq = 0).
@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("path", ["sm90", "tl"])
@pytest.mark.parametrize("part,d,dtype", [("dq", 256, torch.bfloat16),
                                          ("dkdv", 256, torch.bfloat16),
                                          ("dkdv", 256, torch.float16),
                                          ("dkdv", 64, torch.bfloat16),
                                          ("dkdv", 64, torch.float16),
                                          ("fused", 64, torch.bfloat16),
                                          ("fused", 64, torch.float16)],
                         ids=["dq_d256", "dkdv_d256_bf16", "dkdv_d256_fp16", "dkdv_d64_bf16",
                              "dkdv_d64_fp16", "fused_d64_bf16", "fused_d64_fp16"])
@pytest.mark.parametrize("case", SM90_CASES)
def test_attn_bwd_gpu_sm90_other_dims(device, kernel_opts, monkeypatch, case, part, d, dtype,
                                      path):
    from flashlse.kernels import bwd_sm90

    # (Fresh plan caches each test, conftest's _fresh_plans: dq_d256's plan of the same
    # metadata, which plans dK/dV too, is not found here.)
    calls = []
    real = getattr(bwd_sm90, f"{part}_plan")
    for name in ("dkdv", "dq") if part == "fused" else (part, ):
        kernel_opts(**{f"sm90_{name}": path == "sm90"})
    monkeypatch.setattr(bwd_sm90, f"{part}_plan", lambda p: calls.append(real(p)) or calls[-1])
    case = dict(case)
    b, sq, sk, hq, hkv = (case.pop(n) for n in ("b", "sq", "sk", "hq", "hkv"))
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, d, seed=6,
               deterministic=part != "fused", **case)
    assert len(calls) == (1 if path == "sm90" else 0) and all(calls)


# The persistent dQ kernel (bwd_config PERSISTENT): more row blocks than programs, a half
# block past the sequence end before the next one, empty rows, windows, sink, GQA.
@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    pytest.param(dict(b=4, sq=1024, sk=1024, hq=8, hkv=2), id="base_256_items"),
    pytest.param(dict(b=2, sq=2048, sk=2048, hq=8, hkv=8, causal=True), id="causal_256_items"),
    pytest.param(dict(b=3, sq=1024, sk=512, hq=8, hkv=2, causal=True, sink=True),
                 id="causal_sq_gt_sk_sink"),
    pytest.param(dict(b=2, sq=1024, sk=384, hq=4, hkv=2, causal=True),
                 id="causal_empty_rows_no_sink"),
    pytest.param(dict(b=3, sq=320, sk=1024, hq=4, hkv=1, causal=True),
                 id="causal_half_past_end_mqa"),
    pytest.param(dict(b=2, sq=704, sk=1024, hq=4, hkv=2, window=(100, 50)), id="window"),
])
def test_attn_bwd_gpu_sm90_dq_persistent(device, kernel_opts, monkeypatch, dtype, case):
    from flashlse.kernels import bwd_sm90, fwd_sm90

    kernel_opts(bwd_config={"PERSISTENT": True})
    monkeypatch.setattr(fwd_sm90, "PERSISTENT_SLACK", float("inf"))
    kernels = []
    real = bwd_sm90.dq_plan
    monkeypatch.setattr(bwd, "_BWD_PLANS", {})  # (fresh plans ask dq_plan)
    monkeypatch.setattr(bwd_sm90, "dq_plan",
                        lambda p: kernels.append(real(p)) or kernels[-1])
    case = dict(case)
    b, sq, sk, hq, hkv = (case.pop(n) for n in ("b", "sq", "sk", "hq", "hkv"))
    _run_dense(device, dtype, b, sq, sk, hq, hkv, 128, 128, seed=13, deterministic=True,
               **case)
    assert kernels and all(r.kernel is bwd_sm90._dq_sm90_persistent_kernel for r in kernels)


def test_attn_bwd_sm90_failure_falls_back(device, kernel_opts, monkeypatch, compile_failures):
    """A Hopper backward kernel that does not compile with this triton warns once and the
    portable kernel answers, for that call and the next ones of the same signature."""
    from flashlse.kernels import bwd_sm90

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no Gluon here")

    # (Fresh plans: a kept one keeps the kernels it chose before.)
    monkeypatch.setattr(bwd, "_BWD_PLANS", {})
    monkeypatch.setattr(bwd_sm90, "dkdv_plan", lambda p: broken)
    monkeypatch.setattr(bwd_sm90, "dq_plan", lambda p: broken)
    kernel_opts(sm90_dkdv=True)
    kernel_opts(sm90_dq=True)
    dtype = torch.float16
    with pytest.warns(RuntimeWarning, match="Hopper backward (dK/dV|dQ) kernel failed"):
        _run_dense(device, dtype, 1, 40, 17, 2, 1, 32, 32, causal=True, sink=True, seed=12)
    _run_dense(device, dtype, 1, 40, 17, 2, 1, 32, 32, causal=True, sink=True, seed=13)
    assert len(calls) == 2
    assert sorted(key[0] for key in compile_failures) == ["bwd_sm90 dK/dV", "bwd_sm90 dQ"]


@pytest.mark.parametrize("d", [16, pytest.param(128, marks=pytest.mark.gpu)],
                         ids=["d16", "d128_hopper"])
@pytest.mark.parametrize("n_seq", [3, 40], ids=["3_seqs", "40_seqs"])
def test_attn_bwd_varlen_uncovered_rows_are_zero(device, n_seq, d):
    """The gradients are allocated unfilled: rows after ``cu_seqlens[-1]`` (q and k longer
    than their sequences) and keys past ``seqused_k`` (some lengths past their sequence:
    clamped) get zeros from ``bwd._zero_uncovered_rows``, and every covered row equals the
    call on exactly the sequences' rows. 40 sequences: more spans than one vector of them.
    At D = 128 on an H100/H200 the Hopper dK/dV and dQ kernels write the covered rows."""
    gen = torch.Generator().manual_seed(n_seq)
    lens_q = torch.randint(0, 7, (n_seq,), generator=gen).tolist()
    lens_k = torch.randint(0, 7, (n_seq,), generator=gen).tolist()
    used = [max(0, n + i % 3 - 1) for i, n in enumerate(lens_k)]
    hq, hkv, dtype = 2, 1, DTYPES[0]
    tq, tk = sum(lens_q), sum(lens_k)
    mk = lambda n, h: torch.randn(n, h, d, generator=gen).to(dtype).to(device)
    q, k, v, dout = mk(tq + 5, hq), mk(tk + 7, hkv), mk(tk + 7, hkv), mk(tq + 5, hq)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,
                                 device=device)
    kw = dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=None,
              cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k),
              seqused_k=torch.tensor(used, dtype=torch.int32, device=device))

    def grads(q, k, v, dout):
        out, lse = dispatch.attn_fwd(q, k, v, **kw)
        # (Deterministic: the bitwise comparison below; the fused pass's dQ sums vary.)
        return dispatch.attn_bwd(dout, None, q, k, v, out, lse, deterministic=True, **kw)[:3]

    dq, dk, dv = grads(q, k, v, dout)
    want = grads(q[:tq], k[:tk], v[:tk], dout[:tq])
    past = torch.zeros(tk + 7, dtype=torch.bool)
    past[tk:] = True
    for i, (n, u) in enumerate(zip(lens_k, used)):
        past[sum(lens_k[:i]) + min(n, u):sum(lens_k[:i]) + n] = True
    assert not (dq[tq:] != 0).any() and not (dk[past] != 0).any() and not (dv[past] != 0).any()
    torch.testing.assert_close(dq[:tq], want[0], rtol=0, atol=0)
    torch.testing.assert_close(dk[:tk], want[1], rtol=0, atol=0)
    torch.testing.assert_close(dv[:tk], want[2], rtol=0, atol=0)


def test_attn_bwd_varlen_no_key_rows(device):
    """Varlen with no key row at all (every sequence's keys empty; k and v of 0 rows): dq is
    0 (every row empty), dk and dv are empty, and planning the zeroing of their rows does
    not index a row that is not there."""
    dtype = DTYPES[0]
    q = torch.randn(5, 2, 16).to(dtype).to(device)
    k = v = torch.zeros(0, 1, 16, dtype=dtype, device=device)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    cu_k = torch.zeros(3, dtype=torch.int32, device=device)
    kw = dict(left=None, right=None, softcap=0.0, scale=0.25, sink=None, cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=0)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    dq, dk, dv, _ = dispatch.attn_bwd(torch.randn_like(out), None, q, k, v, out, lse, **kw)
    assert dk.shape == (0, 1, 16) and dv.shape == (0, 1, 16)
    assert not (dq != 0).any()


def test_attn_bwd_sm90_dq_persistent_domain(monkeypatch):
    """Which backward calls the persistent dQ kernel takes (no device needed:
    ``bwd_sm90._dq_persistent`` reads metadata): asked for, dense, without seqused_k, the
    forward's layout rule, and a balanced round robin."""
    import types

    from flashlse.kernels import bwd_sm90, configs, fwd_sm90

    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)
    cfg = configs.BWD_SM90_DQ[128]
    empty = functools.partial(torch.empty, dtype=torch.bfloat16)
    args = dict(HAS_LEFT=False, HAS_RIGHT=True, left=0, right=0)

    def call(b=8, s=2048, h=16, persistent=True, **kw):
        q, k = empty(b, s, h, 128), empty(b, s, h, 128)
        p = types.SimpleNamespace(q=q, k=k, v=k, dout=q, dq=empty(b, s, h, 128),
                                  cu_seqlens_q=None, seqused_k=None, seqlen_q=s, seqlen_k=s,
                                  batch=b, hq=h, plan=types.SimpleNamespace(
                                      dq_cfg=dataclasses.replace(cfg, persistent=persistent)))
        for name, value in kw.items():
            setattr(p, name, value)
        return bwd_sm90._dq_persistent(p, args, cfg)

    grid, extra = call()
    assert grid == (131, ) and extra["n_items"] == 8 * 16 * 16 and not extra["TABLE"]
    assert extra["stride_rows"] == (16 * 128, ) * 5
    assert call(persistent=False) is None  # off unless asked
    assert call(seqused_k=torch.zeros(8, dtype=torch.int32)) is None
    assert call(cu_seqlens_q=torch.zeros(9, dtype=torch.int32)) is None
    assert call(s=1000) is None  # S % 64
    assert call(b=1, s=16384) is None  # causal 16k: the round robin is uneven
    assert call(dout=empty(8, 16, 2048, 128).transpose(1, 2)) is None  # heads not adjacent


@pytest.mark.parametrize("fn", ["attention", "sparse_attention", "ring_attention"])
def test_backward_runs_under_its_forwards_kernel_options(device, monkeypatch, fn):
    """Autograd runs the backward of CUDA tensors on a device thread of its own, which sees
    none of the caller's context: a kernel_options block around a training step would not
    reach the backward's kernels (bench_bwd's --sm90 column timed the defaults that way). The
    backward takes its forward's options. A fresh thread stands for the device thread; the
    ring runs on one rank (its own block, no exchange)."""
    import threading

    import torch.distributed as dist

    import flashlse as fl
    from flashlse import distributed
    from flashlse.kernels import options, sparse

    mod, name = (sparse, "sparse_bwd") if fn == "sparse_attention" else (dispatch, "attn_bwd")
    seen, real = [], getattr(mod, name)
    monkeypatch.setattr(mod, name,
                        lambda *a, **kw: seen.append(options.current()) or real(*a, **kw))
    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 20, 2, 32, generator=gen).to(device, dtype).requires_grad_()
               for _ in range(3))
    idx = torch.arange(8, device=device, dtype=torch.int32).expand(1, 20, 2, 8).contiguous()
    forward = {
        "attention": lambda: fl.attention(q, k, v, causal=True),
        "sparse_attention": lambda: fl.sparse_attention(q, k, v, idx),
        "ring_attention": lambda: distributed.ring_attention(q, k, v, causal=True,
                                                             shard_lengths=[20]),
    }[fn]

    def backward_on_a_fresh_thread(out):
        errors = []

        def run():
            try:
                out.float().sum().backward()
            except Exception as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        if errors:
            raise errors[0]

    ring = fn == "ring_attention"
    if ring:
        if dist.is_initialized():
            pytest.skip("a process group is already initialised")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with fl.kernel_options(poison_outputs=True, sm90_dkdv=False) as opts:
            out = forward()
        backward_on_a_fresh_thread(out)
        assert seen == [opts]
        grads = [t.grad.clone() for t in (q, k, v)]
        seen.clear()
        for t in (q, k, v):
            t.grad = None
        base = options.current()  # this test's own (the suite poisons the outputs)
        out = forward()
        with fl.kernel_options(sm90_dq=False):
            backward_on_a_fresh_thread(out)  # a block around the backward changes nothing
        assert seen == [base]
        for a, b in zip(grads, (q.grad, k.grad, v.grad)):
            assert not a.isnan().any()
            torch.testing.assert_close(a, b)
    finally:
        if ring:
            dist.destroy_process_group()
