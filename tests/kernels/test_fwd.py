"""The Triton-path forward (``kernels.dispatch.attn_fwd``: the Hopper Gluon kernel where it is
supported, else ``kernels.fwd.attn_fwd``) against the float64 reference (out and lse, every
row).

Tolerance (docs/design.md §5): ``err(kernel) <= 2 * err(torch in the same dtype) + atol``, both
measured against ``flashlse.reference`` in float64. Empty rows must match exactly:
``-inf`` where the reference has ``-inf`` and nowhere else, ``out = 0`` there, and no NaN
anywhere; outputs are allocated pre-filled with NaN so an unwritten element fails.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from _cases import GPU_HEAD_DIM_CASES, VARLEN_CASES
from _flashlse_testing import break_plan

import flashlse as fl
from flashlse import reference
from flashlse.kernels import configs, dispatch

HAS_CUDA = torch.cuda.is_available()


def _torch_attention(q, k, v, left, right, softcap, scale, sink):
    """The same attention in q's dtype with plain torch ops: the error yardstick."""
    with reference.computed_in(q.dtype):
        out, lse = reference.attention(q, k, v, window=(left, right), softcap=softcap,
                                       scale=scale, sink=sink, return_lse=True)
    return out, lse


def _window(causal, window):
    from flashlse.masks import normalize_window

    return normalize_window(causal, window)


def _check(out, lse, ref_out, ref_lse, pt_out, pt_lse, atol):
    assert not torch.isnan(out).any(), "NaN (or unwritten element) in out"
    assert not torch.isnan(lse).any(), "NaN (or unwritten element) in lse"
    assert not torch.isposinf(lse).any(), "+inf in lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf pattern of lse"
    ref_out, ref_lse = ref_out.to(out.device), ref_lse.to(out.device)
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    pt_err = (pt_out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * pt_err + atol, f"out: err {err:.3g} vs torch {pt_err:.3g}"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (lse.double() - ref_lse)[fin].abs().max().item()
        pt_err = (pt_lse.double() - ref_lse)[fin].abs().max().item()
        assert err <= 2 * pt_err + atol, f"lse: err {err:.3g} vs torch {pt_err:.3g}"
    # Empty rows: out exactly 0.
    empty = torch.isneginf(ref_lse)
    if empty.any():
        rows = out.transpose(-3, -2) if out.dim() == 4 else out.transpose(0, 1)
        assert (rows[empty] == 0).all(), "empty rows must give out = 0"


def _atol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, causal=False, window=(None, None),
               softcap=0.0, sink=False, scale=None, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if strided:
        # A (B, Hq, Sq, D + 8) buffer viewed as (B, Sq, Hq, D): no stride is contiguous-like.
        q = torch.randn(b, hq, sq, d + 8, generator=gen).to(dtype).to(device)
        q = q.transpose(1, 2)[..., :d]
    else:
        q = torch.randn(b, sq, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(b, sk, hkv, dv, generator=gen).to(dtype).to(device)
    sink_t = (torch.randn(hq, generator=gen) * 2).to(device) if sink else None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = _window(causal, window)
    out, lse = dispatch.attn_fwd(q, k, v, left=left, right=right, softcap=softcap,
                                 scale=scale, sink=sink_t)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, window=window,
                                           softcap=softcap, scale=scale, sink=sink_t,
                                           return_lse=True)
    pt_out, pt_lse = _torch_attention(q, k, v, left, right, softcap, scale, sink_t)
    _check(out, lse, ref_out, ref_lse, pt_out, pt_lse, _atol(dtype))


# (b, sq, sk, hq, hkv, d, dv, keywords): tiny shapes, tiles of 16 under the interpreter.
DENSE_CASES = [
    pytest.param(2, 33, 47, 2, 2, 32, 32, {}, id="base"),
    pytest.param(1, 40, 17, 2, 1, 32, 32, {"causal": True}, id="causal_sq_gt_sk_empty_rows"),
    pytest.param(1, 17, 40, 2, 1, 32, 32, {"causal": True}, id="causal_sq_lt_sk"),
    pytest.param(1, 30, 10, 2, 2, 32, 32, {"window": (2, 1)}, id="window_empties_rows"),
    pytest.param(1, 20, 45, 2, 1, 32, 32, {"window": (5, 3)}, id="window_both"),
    pytest.param(1, 45, 45, 2, 1, 32, 32, {"window": (7, None)}, id="window_left_only"),
    pytest.param(1, 35, 35, 2, 1, 32, 32, {"window": (17, 0), "causal": True},
                 id="causal_sliding"),
    pytest.param(1, 20, 0, 2, 1, 32, 32, {}, id="sk0"),
    pytest.param(1, 20, 0, 2, 1, 32, 32, {"sink": True}, id="sk0_sink"),
    pytest.param(1, 25, 30, 2, 2, 32, 32, {"sink": True}, id="sink"),
    pytest.param(1, 40, 17, 2, 1, 32, 32, {"sink": True, "causal": True},
                 id="sink_empty_rows"),
    pytest.param(1, 30, 30, 2, 1, 32, 32, {"softcap": 1.5}, id="softcap"),
    pytest.param(1, 30, 20, 2, 1, 32, 32, {"softcap": 3.0, "causal": True},
                 id="softcap_causal"),
    pytest.param(1, 20, 33, 4, 2, 32, 32, {}, id="gqa"),
    pytest.param(1, 20, 33, 4, 1, 32, 32, {"causal": True}, id="mqa_causal"),
    pytest.param(1, 1, 1, 1, 1, 32, 32, {}, id="sq1_sk1"),
    pytest.param(1, 1, 63, 2, 1, 32, 32, {"causal": True}, id="decode_row"),
    pytest.param(1, 63, 113, 1, 1, 32, 32, {}, id="odd_63_113"),
    pytest.param(1, 113, 63, 1, 1, 32, 32, {"causal": True}, id="odd_113_63_causal"),
    pytest.param(1, 20, 30, 1, 1, 59, 59, {}, id="d59_pointer_loads"),
    pytest.param(1, 20, 30, 2, 1, 59, 40, {"causal": True}, id="d59_dv40"),
    pytest.param(1, 17, 20, 2, 2, 64, 64, {"window": (3, 4)}, id="d64"),
    pytest.param(1, 17, 20, 2, 1, 111, 111, {}, id="d111"),
    pytest.param(1, 9, 17, 2, 1, 192, 128, {"causal": True}, id="d192_dv128"),
    pytest.param(2, 25, 30, 4, 2, 32, 32, {"strided": True}, id="strided_q"),
    pytest.param(1, 20, 30, 2, 1, 32, 32, {"scale": -0.3}, id="negative_scale"),
]


# The interpreter's tl.dot is wrong on bf16, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", DENSE_CASES)
def test_attn_fwd_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, kw):
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, dv, **kw)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_attn_fwd_load_paths(device, kernel_opts, monkeypatch, use_tma, dtype):
    if HAS_CUDA and dtype == torch.float32:
        pytest.skip("the GPU kernels take fp16/bf16")
    # Three (batch, head) pairs per schedule group: 8 pairs leave a partial last group.
    kernel_opts(fwd_config={"USE_TMA": use_tma, "GROUP_HEADS": 3})
    _run_dense(device, dtype, 2, 37, 41, 4, 2, 32, 32, causal=True, sink=True, seed=3)
    _run_dense(device, dtype, 1, 20, 64, 2, 1, 32, 32, seed=4)


def _run_varlen(device, dtype, seqlens_q, seqlens_k, hq, hkv, d, dv, causal=False,
                window=(None, None), used=None, sink=False, softcap=0.0, seed=0, public=None,
                nan_q=None):
    """The varlen forward on fresh inputs against the float64 reference and the torch
    yardstick: the dispatcher's, or with ``public=(max_seqlen_q, max_seqlen_k)`` the public
    ``attention_varlen`` without grad (value checks off, as on a GPU by default), a NaN
    query row at ``nan_q`` (then unchecked). Returns out, lse."""
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(int(cu_k[-1]), hkv, dv, generator=gen).to(dtype).to(device)
    sink_t = torch.randn(hq, generator=gen).to(device) if sink else None
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device=device)
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    scale = 1.0 / math.sqrt(d)
    left, right = _window(causal, window)
    if public is None:
        out, lse = dispatch.attn_fwd(q, k, v, left=left, right=right, softcap=softcap,
                                     scale=scale, sink=sink_t, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, max_seqlen_q=max(seqlens_q),
                                     max_seqlen_k=max(seqlens_k), seqused_k=seqused)
    else:
        if nan_q is not None:
            q[nan_q] = float("nan")
        with torch.no_grad(), fl.value_checks(False):
            out, lse = fl.attention_varlen(q, k, v, cu_q, cu_k, *public, seqused_k=seqused,
                                           causal=causal, window=window, softcap=softcap,
                                           scale=scale, sink=sink_t, return_lse=True)
        if nan_q is not None:
            return out, lse
    assert out.shape == (q.shape[0], hq, dv) and lse.shape == (hq, q.shape[0])
    ref_out, ref_lse = reference.attention_varlen(
        q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), seqused_k=seqused, causal=causal,
        window=window, softcap=softcap, scale=scale, sink=sink_t, return_lse=True)
    pt_out, pt_lse = [], []
    for i in range(len(seqlens_q)):
        q0, q1 = int(cu_q[i]), int(cu_q[i + 1])
        k0 = int(cu_k[i])
        k1 = k0 + (used[i] if used is not None else seqlens_k[i])
        o_i, l_i = _torch_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], left,
                                    right, softcap, scale, sink_t)
        pt_out.append(o_i[0])
        pt_lse.append(l_i[0])
    _check(out, lse, ref_out, ref_lse, torch.cat(pt_out, 0), torch.cat(pt_lse, 1),
           _atol(dtype))
    return out, lse


def test_attention_varlen_repeated_calls_launch_the_kept_launch(device, monkeypatch):
    """A packed varlen forward without grad whose checks passed keeps its launch by its key
    (the dense key, the length tensors' metadata, both max lengths); later calls of that key
    launch it without the checks or the dispatcher: other sequence lengths (the same totals,
    batch and max lengths; an empty query sequence) and values each call against the float64
    reference, seqused_k and a sink; a NaN query row reaches exactly its own outputs. Another
    max_seqlen_q is another key; value checks (the CPU's default) take the full path and
    its errors."""
    import importlib

    attn_mod = importlib.import_module("flashlse.ops.attention")
    attn_mod._KEPT.clear()
    hits = []
    real = attn_mod._run_kept
    monkeypatch.setattr(attn_mod, "_run_kept",
                        lambda *a, **k: hits.append(real(*a, **k)) or hits[-1])
    lens_q = [[30, 18, 12], [12, 30, 18], [0, 30, 30]]
    lens_k = [[45, 40, 5], [5, 45, 40], [45, 20, 25]]
    used = [[40, 33, 5], [0, 45, 21], [45, 20, 1]]
    kw = dict(causal=True, sink=True)
    for seed in range(3):
        _run_varlen(device, torch.float16, lens_q[seed], lens_k[seed], 4, 2, KEPT_D, KEPT_D,
                    used=used[seed], seed=seed, public=(30, 45), **kw)
    assert len(attn_mod._KEPT) == 1
    assert hits[0] is None and all(h is not None for h in hits[1:]) and len(hits) == 3
    out, lse = _run_varlen(device, torch.float16, lens_q[1], lens_k[1], 4, 2, KEPT_D, KEPT_D,
                           used=used[1], seed=7, public=(30, 45), nan_q=(20, 3), **kw)
    assert hits[-1] is not None
    nan_out, nan_lse = torch.isnan(out), torch.isnan(lse)
    assert nan_out[20, 3].all() and nan_lse[3, 20]
    assert nan_out.sum() == out.shape[-1] and nan_lse.sum() == 1
    _run_varlen(device, torch.float16, lens_q[0], lens_k[0], 4, 2, KEPT_D, KEPT_D,
                used=used[0], seed=8, public=(31, 45), **kw)
    assert hits[-1] is None and len(attn_mod._KEPT) == 2
    if device == "cpu":  # value checks on: the full path, which reads cu_seqlens' values
        q = torch.randn(60, 4, KEPT_D, dtype=torch.float16)
        k = torch.randn(90, 2, KEPT_D, dtype=torch.float16)
        cu_k = torch.tensor([0, 45, 85, 90], dtype=torch.int32)
        bad = torch.tensor([0, 30, 20, 60], dtype=torch.int32)  # decreasing
        n_hits = len(hits)
        with torch.no_grad(), pytest.raises(ValueError, match="non-decreasing"):
            fl.attention_varlen(q, k, k, bad, cu_k, 30, 45, causal=True)
        assert len(hits) == n_hits



@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("seqlens_q,seqlens_k,kw", VARLEN_CASES)
def test_attn_fwd_varlen(device, dtype, seqlens_q, seqlens_k, kw):
    _run_varlen(device, dtype, seqlens_q, seqlens_k, 4, 2, 32, 32, **kw)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv,kw", GPU_HEAD_DIM_CASES)
def test_attn_fwd_gpu_head_dims(device, dtype, d, dv, kw):
    _run_dense(device, dtype, 2, 700, 1000, 4, 2, d, dv, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    pytest.param(dict(sq=2000, sk=900, causal=True), id="causal_sq_gt_sk"),
    pytest.param(dict(sq=1000, sk=0), id="sk0"),
    pytest.param(dict(sq=1000, sk=0, sink=True), id="sk0_sink"),
    pytest.param(dict(sq=1500, sk=700, causal=True, sink=True), id="sink_empty_rows"),
    pytest.param(dict(sq=1, sk=4097, causal=True), id="decode_row"),
    pytest.param(dict(sq=255, sk=203, window=(31, 0)), id="odd_window"),
    pytest.param(dict(sq=1024, sk=1024, strided=True), id="strided_q"),
])
@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "tl"])
def test_attn_fwd_gpu_edges(device, kernel_opts, monkeypatch, dtype, case, sm90):
    kernel_opts(sm90_fwd=sm90)
    case = dict(case)
    sq, sk = case.pop("sq"), case.pop("sk")
    _run_dense(device, dtype, 2, sq, sk, 8, 2, 128, 128, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("sm90", [True, False], ids=["sm90", "tl"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attn_fwd_gpu_varlen(device, kernel_opts, monkeypatch, causal, d, sm90):
    kernel_opts(sm90_fwd=sm90)
    _run_varlen(device, torch.bfloat16, [700, 0, 1300, 1, 129], [900, 300, 1300, 0, 129],
                8, 1, d, d, causal=causal, used=[900, 300, 1000, 0, 64], sink=True)


def test_attn_fwd_sm90_failure_falls_back(device, monkeypatch, compile_failures):
    """A Hopper kernel that does not compile with this triton warns once and the portable
    kernel answers, for that call and the next ones of the same signature."""
    from flashlse.kernels import fwd_sm90

    calls = break_plan(monkeypatch, fwd_sm90, "plan", ("fwd_sm90", "a signature"))
    dtype = torch.float16
    with pytest.warns(RuntimeWarning, match="Hopper forward kernel failed"):
        _run_dense(device, dtype, 1, 40, 17, 2, 1, 32, 32, causal=True, sink=True, seed=12)
    _run_dense(device, dtype, 1, 40, 17, 2, 1, 32, 32, causal=True, sink=True, seed=13)
    assert len(calls) == 1 and [key[0] for key in compile_failures] == ["fwd_sm90"]


def _public_fwd(device, dtype, b, sq, sk, hq, hkv, d, causal=False, window=(None, None),
                softcap=0.0, sink=False, scale=None, seed=0, nan_q=None):
    """``fl.attention`` without grad on fresh inputs (a NaN query row at ``nan_q``), against
    the float64 reference (NaN rows left out) and the torch yardstick; returns its out, lse."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dtype).to(device)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    sink_t = (torch.randn(hq, generator=gen) * 2).to(device) if sink else None
    if sink == "neginf":  # a -inf sink is no sink
        sink_t.fill_(float("-inf"))
    if nan_q is not None:
        q[nan_q] = float("nan")
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, sink=sink_t)
    with torch.no_grad():
        out, lse = fl.attention(q, k, v, return_lse=True, **kw)
    if nan_q is not None:
        return out, lse
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    left, right = _window(causal, window)
    pt_out, pt_lse = _torch_attention(q, k, v, left, right, softcap,
                                      1.0 / math.sqrt(d) if scale is None else scale, sink_t)
    _check(out, lse, ref_out, ref_lse, pt_out, pt_lse, _atol(dtype))
    return out, lse


# On an H100 / H200 at D = 128 the kept launch is the Hopper kernel's, else fwd.py's.
KEPT_D = 128 if HAS_CUDA else 32


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, sink=True),
                                dict(causal=True, sink="neginf"),
                                dict(window=(5, 3), softcap=1.5), dict(hkv=1, causal=True)],
                         ids=["plain", "causal_sink", "causal_neginf_sink", "window_softcap",
                              "mqa_causal"])
def test_attention_repeated_calls_launch_the_kept_launch(device, monkeypatch, kw):
    """A dense forward without grad that passed every check keeps its launch by its key
    (ops/attention._KEPT); later calls of that key launch it without the checks: fresh values
    each call against the float64 reference; a NaN query row reaches exactly its own outputs;
    an int where a bool goes (``causal=1``) takes the full path. A call needing grad looks its
    key up too and runs through AttentionFunction (the kept launch, or the dispatcher's,
    kept then): its outputs and gradients, twice, against the float64 reference."""
    import importlib

    attn_mod = importlib.import_module("flashlse.ops.attention")
    kw = dict(kw)
    hkv = kw.pop("hkv", 2)
    shape = (2, 40, 33, 4, hkv, KEPT_D)
    attn_mod._KEPT.clear()
    hits = []
    real = attn_mod._run_kept
    monkeypatch.setattr(attn_mod, "_run_kept",
                        lambda *a, **k: hits.append(real(*a, **k)) or hits[-1])
    for seed in range(3):
        out, lse = _public_fwd(device, torch.float16, *shape, seed=seed, **kw)
        # Causal with Sq > Sk: the first 7 rows see no key (lse -inf or the sink, out 0).
        if kw.get("causal") and kw.get("sink") in (None, "neginf"):
            assert torch.isneginf(lse[:, :, :7]).all() and (out[:, :7] == 0).all()
    assert len(attn_mod._KEPT) == 1
    assert hits[0] is None and all(h is not None for h in hits[1:]) and len(hits) == 3
    out, lse = _public_fwd(device, torch.float16, *shape, seed=5, nan_q=(1, 7, 2), **kw)
    assert hits[-1] is not None
    nan_out, nan_lse = torch.isnan(out), torch.isnan(lse)
    assert nan_out[1, 7, 2].all() and nan_lse[1, 2, 7]
    assert nan_out.sum() == out.shape[-1] and nan_lse.sum() == 1
    q = torch.randn(*shape[:2], 4, KEPT_D, device=device, dtype=torch.float16,
                    requires_grad=True)
    k = torch.randn(2, 33, hkv, KEPT_D, device=device, dtype=torch.float16)
    dout = torch.randn_like(q)
    grad_kw = {n: x for n, x in kw.items() if n != "sink"}
    q64 = q.detach().double().requires_grad_()
    ref = reference.attention(q64, k.double(), k.double(), **grad_kw)
    (ref_dq, ) = torch.autograd.grad(ref, q64, dout.double())
    for again in (False, True):
        n_hits = len(hits)
        out = fl.attention(q, k, k, **grad_kw)
        assert len(hits) == n_hits + 1 and out.grad_fn is not None
        assert hits[-1] is not None or not again  # (the second call: kept by the first)
        (dq, ) = torch.autograd.grad(out, q, dout)
        torch.testing.assert_close(out.double(), ref, atol=_atol(torch.float16), rtol=0)
        torch.testing.assert_close(dq.double(), ref_dq, atol=_atol(torch.float16), rtol=0)
    with pytest.raises(TypeError, match="causal"):
        fl.attention(q.detach(), k, k, causal=int(kw.get("causal", False)))


def test_attention_kept_launches_tell_their_scalars_apart(device):
    """Each scalar that shapes the launch is in the kept launch's key: calls of one tensor
    metadata alternating scale, causal, window, softcap and a sink (each kept once, then
    reused) all match the float64 reference."""
    import importlib

    attn_mod = importlib.import_module("flashlse.ops.attention")
    attn_mod._KEPT.clear()
    variants = [dict(), dict(scale=0.3), dict(causal=True), dict(window=(2, 1)),
                dict(softcap=1.5), dict(sink=True)]
    for rnd in range(2):
        for i, kw in enumerate(variants):
            _public_fwd(device, torch.float16, 1, 30, 20, 2, 1, KEPT_D, seed=10 * rnd + i, **kw)
    assert len(attn_mod._KEPT) == len(variants)


def _on_sm90():
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


# The Hopper warp-specialised kernel (fwd_sm90.py, D = 128): halves of a 128-row block
# cut by the sequence end, every mask edge, empty blocks and rows, GQA, sink, strides.
SM90_CASES = [
    pytest.param(2, 1000, 1000, 4, 2, 128, {}, id="base"),
    pytest.param(1, 1000, 1000, 4, 4, 128, {"causal": True}, id="causal"),
    pytest.param(2, 2000, 900, 8, 2, 128, {"causal": True}, id="causal_sq_gt_sk_empty"),
    pytest.param(1, 300, 2000, 4, 1, 128, {"causal": True}, id="causal_sq_lt_sk_mqa"),
    pytest.param(1, 1000, 0, 4, 2, 128, {}, id="sk0"),
    pytest.param(1, 1000, 0, 4, 2, 128, {"sink": True}, id="sk0_sink"),
    pytest.param(1, 1500, 700, 4, 2, 128, {"causal": True, "sink": True}, id="sink_empty"),
    pytest.param(1, 255, 203, 4, 2, 128, {"window": (31, 0)}, id="window_31_0"),
    pytest.param(1, 700, 1000, 4, 2, 128, {"window": (100, 50), "sink": True},
                 id="window_both_sink"),
    pytest.param(1, 900, 900, 4, 2, 128, {"window": (200, None)}, id="window_left_only"),
    pytest.param(1, 400, 1200, 4, 2, 128, {"window": (0, 300)}, id="window_right_only"),
    pytest.param(1, 1, 4097, 4, 1, 128, {"causal": True}, id="decode_row"),
    pytest.param(1, 65, 129, 2, 1, 128, {}, id="second_half_one_row"),
    pytest.param(1, 64, 64, 2, 1, 128, {"causal": True}, id="first_half_only"),
    pytest.param(2, 1024, 1024, 4, 2, 128, {"strided": True}, id="strided_q"),
    pytest.param(1, 2000, 2000, 4, 2, 128, {"causal": True, "window": (700, 0)},
                 id="causal_sliding"),
] + [
    # Other head dims: run where configs.FWD_SM90 has a tile for them (skipped otherwise).
    pytest.param(b, sq, sk, hq, hkv, d, kw, id=f"d{d}_{name}")
    for d in (64, 256)
    for name, (b, sq, sk, hq, hkv, kw) in {
        "base": (2, 1000, 1000, 4, 2, {}),
        "causal_sq_gt_sk_empty": (1, 1500, 700, 8, 2, {"causal": True, "sink": True}),
        "window_both_sink": (1, 700, 1000, 4, 2, {"window": (100, 50), "sink": True}),
        "sk0_sink": (1, 300, 0, 4, 2, {"sink": True}),
        "second_half_one_row": (1, 65, 129, 2, 1, {}),
    }.items()
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", SM90_CASES)
def test_attn_fwd_gpu_sm90(device, kernel_opts, monkeypatch, dtype, b, sq, sk, hq, hkv, d, kw):
    from flashlse.kernels import configs, dispatch, fwd_sm90

    if d not in configs.FWD_SM90:
        pytest.skip(f"no Hopper forward tile for D = {d} in configs.FWD_SM90")
    # (Dense calls of <= decode.MAX_SQ rows take the decode kernel by default: the Hopper
    # kernel on them with that route off; test_short_query.py tests the route.)
    monkeypatch.setattr(dispatch, "SHORT_Q_DECODE", False)
    if not configs.FWD_SM90[d].grid:
        # (D = 64: the calls the persistent kernel does not take run fwd.py's by default;
        # the grid kernel stays an option, tested here.)
        kernel_opts(fwd_sm90_config={"GRID": True})

    calls = []
    real = fwd_sm90.plan

    def plan(*a, **k):
        p = real(*a, **k)
        calls.append(p is not None)
        return p

    monkeypatch.setattr(fwd_sm90, "plan", plan)
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, d, seed=7, **kw)
    assert calls and all(calls), "the call did not take the Hopper kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
def test_attn_fwd_gpu_sm90_schedules(device, kernel_opts, monkeypatch, pingpong, overlap):

    kernel_opts(fwd_sm90_config={"PINGPONG": pingpong, "OVERLAP": overlap})
    _run_dense(device, torch.bfloat16, 2, 1500, 1500, 4, 2, 128, 128, causal=True, seed=9)
    _run_dense(device, torch.float16, 1, 1000, 1200, 4, 1, 128, 128, window=(300, 20),
               sink=True, seed=10)
    _run_dense(device, torch.bfloat16, 1, 2000, 900, 4, 2, 128, 128, causal=True, seed=11)


# The persistent form of the Hopper forward (fwd_sm90._fwd_sm90_persistent_kernel): more
# row blocks than programs (each program walks several), row-block counts with and without a
# common factor with the program count, a half block past the sequence end before the next
# sequence (S_q % 128 == 64), empty rows, windows, sink, GQA.
PERSISTENT_CASES = [
    pytest.param(4, 1024, 1024, 8, 2, {}, id="base_256_items"),
    pytest.param(2, 2048, 2048, 8, 8, {"causal": True}, id="causal_256_items"),
    pytest.param(3, 1024, 512, 8, 2, {"causal": True, "sink": True}, id="causal_sq_gt_sk_sink"),
    pytest.param(2, 1024, 384, 4, 2, {"causal": True}, id="causal_empty_rows_no_sink"),
    pytest.param(3, 320, 1024, 4, 1, {"causal": True}, id="causal_half_past_end_mqa"),
    pytest.param(2, 704, 1024, 4, 2, {"window": (100, 50), "sink": True}, id="window_sink"),
    pytest.param(2, 896, 896, 16, 2, {"window": (200, None)}, id="window_left_only"),
    pytest.param(5, 64, 128, 4, 4, {}, id="one_half_blocks"),
] + [
    # Other head dims, where configs.FWD_SM90 has a tile for them (skipped otherwise).
    pytest.param(3, 1024, 1024, 8, 2, {"causal": True, "d": 64}, id="d64_causal"),
    pytest.param(2, 320, 1024, 4, 1, {"window": (100, 50), "sink": True, "d": 64},
                 id="d64_window_half_past_end"),
    # D = 64's persistent kernel on rows that see no key (lse -inf, or the sink).
    pytest.param(3, 1024, 512, 8, 2, {"causal": True, "sink": True, "d": 64},
                 id="d64_causal_sq_gt_sk_sink"),
    pytest.param(2, 1024, 512, 4, 2, {"causal": True, "d": 64}, id="d64_causal_empty_rows"),
    pytest.param(5, 64, 128, 4, 4, {"d": 64}, id="d64_one_half_blocks"),
    # D = 256: out staged in Q's buffer (O_IN_Q).
    pytest.param(3, 1024, 1024, 8, 2, {"causal": True, "d": 256}, id="d256_causal"),
    pytest.param(2, 320, 1024, 4, 1, {"window": (100, 50), "sink": True, "d": 256},
                 id="d256_window_half_past_end"),
]


# The persistent kernel's consumer warpgroups at D = 64 (192-row items aligned to the
# sequence's end on three, the shipped form; 128-row items on two), and three on 64-key
# tiles. The other variants take D = 64's config as it is.
WG3 = {"wg3": {"CONSUMERS": 3}, "wg2": {"CONSUMERS": 2}, "wg3_n64": {"CONSUMERS": 3, "BLOCK_N": 64}}


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("variant", ["q1", "q2", *WG3])
@pytest.mark.parametrize("schedule", ["round_robin", "table"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,kw", PERSISTENT_CASES)
def test_attn_fwd_gpu_sm90_persistent(device, kernel_opts, monkeypatch, dtype, b, sq, sk, hq,
                                      hkv, kw, schedule, variant):
    """``variant``: one Q buffer or two (``q2``: the next item's Q loads during this one; at
    D = 256, where out is staged in Q's buffer, one all the same), the second in bf16
    only; at D = 64 in bf16 also three consumer warpgroups or two (``WG3``)."""
    from flashlse.kernels import configs, fwd_sm90

    kw = dict(kw)
    d = kw.pop("d", 128)
    if d not in configs.FWD_SM90:
        pytest.skip(f"no Hopper forward tile for D = {d} in configs.FWD_SM90")
    if variant != "q1" and dtype != torch.bfloat16:
        pytest.skip(f"{variant}: bf16 covers it")
    if variant in WG3 and d != 64:
        pytest.skip("the consumer warpgroups' variants: D = 64")
    table = schedule == "table"
    q_bufs = 1 if variant == "q1" else 2
    kernel_opts(fwd_sm90_config={"PERSISTENT": True, "PERSISTENT_TABLE": table,
                                 "Q_BUFS": q_bufs, **WG3.get(variant, {})})
    bufs = []
    real_bufs = fwd_sm90._q_bufs
    monkeypatch.setattr(fwd_sm90, "_q_bufs", lambda *a: bufs.append(real_bufs(*a)) or bufs[-1])
    # Whatever the balance of the round robin (_persistent_programs): always it, or never
    # it (the host's table then).
    monkeypatch.setattr(fwd_sm90, "PERSISTENT_SLACK", 0.0 if table else float("inf"))
    tables = []
    real_table = fwd_sm90._greedy_table
    monkeypatch.setattr(fwd_sm90, "_greedy_table",
                        lambda *a: tables.append(real_table(*a)) or tables[-1])
    plans = []
    real = fwd_sm90.plan

    def plan(*a, **k):
        p = real(*a, **k)
        plans.append(p)
        return p

    monkeypatch.setattr(fwd_sm90, "plan", plan)
    _run_dense(device, dtype, b, sq, sk, hq, hkv, d, d, seed=12, **kw)
    assert plans and all(p is not None and p.signature[-1] == "persistent" for p in plans)
    assert bool(tables) == table and all(tables)
    assert bufs and all(n == (1 if d == 256 else q_bufs) for n in bufs)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("schedule", ["round_robin", "table", "table_q2", *WG3])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256_out_in_q"])
def test_attn_fwd_gpu_sm90_persistent_bad_data(device, kernel_opts, monkeypatch, schedule, d):
    """The LSE contract on the persistent forward, at D = 64, 128 and at D = 256 (out staged
    in Q's buffer), with one Q buffer or two (``table_q2``) (B=2, causal, S_q = 1024 on
    S_k = 512: rows 0-511 of each sequence see no key). A sink of -inf is no sink, bit for
    bit, with empty rows (0, -inf) and NaN-free gradients; a NaN in one q row, in one key,
    or in one head's sink reaches exactly the rows that see it, in both sequences' blocks
    only where it sits, and every other row equals the clean call."""
    from flashlse.kernels import fwd_sm90

    if schedule in WG3 and d != 64:
        pytest.skip("the consumer warpgroups' variants: D = 64")
    table = schedule != "round_robin"
    kernel_opts(fwd_sm90_config={"PERSISTENT": True, "PERSISTENT_TABLE": table,
                                 "Q_BUFS": 2 if schedule == "table_q2" else 1,
                                 **WG3.get(schedule, {})})
    monkeypatch.setattr(fwd_sm90, "PERSISTENT_SLACK", 0.0 if table else float("inf"))
    plans = []
    real = fwd_sm90.plan
    monkeypatch.setattr(fwd_sm90, "plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    g = torch.Generator().manual_seed(14)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=torch.bfloat16)
    q, k, v = mk(2, 1024, 4, d), mk(2, 512, 2, d), mk(2, 512, 2, d)
    sink = torch.tensor([0.5, -1.0, 0.0, 2.0], device=device)

    def call(q, k, sink):
        return fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)

    # -inf sink == no sink; empty rows exactly (0, -inf); gradients without NaN.
    none = call(q, k, None)
    neg = call(q, k, torch.full((4,), float("-inf"), device=device))
    for a, b in zip(neg, none):
        assert torch.equal(a, b)
    assert torch.isneginf(none[1][:, :, :512]).all() and (none[0][:, :512] == 0).all()
    assert not torch.isnan(none[0]).any() and not torch.isnan(none[1]).any()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fl.attention(*leaves, causal=True, return_lse=True)
    (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
    assert all(not torch.isnan(t.grad).any() for t in leaves)
    assert all(p is not None and p.signature[-1] == "persistent" for p in plans)

    clean_out, clean_lse = call(q, k, sink)
    for what in ("q", "k", "sink"):
        q2, k2, s2 = q.clone(), k.clone(), sink.clone()
        bad = torch.zeros(2, 4, 1024, dtype=torch.bool, device=device)  # (b, head, row)
        if what == "q":
            q2[1, 700, 2, 5] = float("nan")
            bad[1, 2, 700] = True
        elif what == "k":
            k2[0, 300, 1, 7] = float("nan")  # kv head 1: query heads 2, 3
            bad[0, 2:, 512 + 300:] = True  # rows i see keys 0 .. i - 512
        else:
            s2[3] = float("nan")
            bad[:, 3] = True
        out2, lse2 = call(q2, k2, s2)
        rows_out = out2.transpose(1, 2)  # (b, head, row, d)
        assert torch.isnan(lse2[bad]).all() and torch.isnan(rows_out[bad]).all(), what
        good = ~bad
        assert torch.equal(lse2[good], clean_lse[good]), what
        assert torch.equal(rows_out[good], clean_out.transpose(1, 2)[good]), what


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
def test_attn_fwd_gpu_sm90_persistent_table_on_another_stream(kernel_opts, monkeypatch):
    """The host's table goes to the device on the planning call's stream: a call on another
    stream right after it (the first stream held back by a sleep, so the copy has not run)
    waits for the copy instead of reading the table before it lands. Against the grid
    kernel's result (outputs NaN-poisoned, so an unwritten row fails too)."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "PERSISTENT_SLACK", 0.0)  # never the round robin
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(2, 2048, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    with fl.kernel_options(fwd_sm90_config={"PERSISTENT": False}):
        want, want_lse = fl.attention(q, k, v, causal=True, return_lse=True)
    fwd_sm90._PLANS.clear()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(first):
        torch.cuda._sleep(400_000_000)  # ~0.2 s: the table's copy waits behind it
        fl.attention(q, k, v, causal=True)
    runs = [p.run for p in fwd_sm90._PLANS.values() if p.run is not None]
    assert any(isinstance(r, fwd_sm90._TableLaunch) for r in runs)
    with torch.cuda.stream(second):
        got, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_attn_fwd_sm90_table_launch_waits_only_on_another_stream(monkeypatch):
    """_TableLaunch's rule (no device needed: torch.cuda's stream calls stubbed): the call on
    the planning stream launches at once; one on another stream first waits on the event
    recorded after the table's copy; during a CUDA-graph capture it does not wait."""
    from flashlse.kernels import fwd_sm90

    state = {"stream": 7, "capturing": False}
    waits, recorded, launched = [], [], []

    class Event:
        def record(self, stream):
            recorded.append(stream.id)

    class Stream:
        def __init__(self, device):
            self.id = state["stream"]

        def wait_event(self, event):
            waits.append((self.id, event))

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: state["stream"],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    run = fwd_sm90._TableLaunch(lambda *t: launched.append(t), torch.device("cuda", 0))
    assert recorded == [7]
    run("a")
    assert waits == [] and launched == [("a",)]
    state["stream"] = 9
    run("b")
    assert waits == [(9, run.copied)] and launched[-1] == ("b",)
    state["capturing"] = True
    run("c")
    assert len(waits) == 1 and launched[-1] == ("c",)


def test_attn_fwd_sm90_tables_kept_within_their_budget(monkeypatch):
    """Device tables are never freed (a CUDA graph may replay a plan the cache dropped), so
    past MAX_KEPT_TABLE_BYTES in all no table is built (no device needed: it says no before
    any copy)."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "_TABLES", [torch.zeros(1000, dtype=torch.int32)])
    monkeypatch.setattr(fwd_sm90, "MAX_KEPT_TABLE_BYTES", 4 * 1100)
    assert fwd_sm90._device_table(list(range(101)), "cuda") is None
    assert len(fwd_sm90._TABLES) == 1


# Head dims of the persistent varlen kernel's tests, and its consumer warpgroups
# (VARLEN_CONSUMERS; 3 at D = 64: 192-row blocks, end-aligned).
_VARLEN_D_WG = [pytest.param(64, 2, id="d64"), pytest.param(64, 3, id="d64_wg3"),
                pytest.param(128, 2, id="d128"), pytest.param(256, 2, id="d256_out_in_q")]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d, wg", _VARLEN_D_WG)
@pytest.mark.parametrize("case", [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True, used=[900, 300, 1000, 0, 64, 0, 3], sink=True),
                 id="seqused_sink"),
    pytest.param(dict(window=(200, 0)), id="window"),
    pytest.param(dict(causal=True, hq=12, hkv=3, sections=True), id="head_sections"),
    pytest.param(dict(causal=True, splits=True), id="key_splits"),
    pytest.param(dict(window=(200, 0), used=[900, 300, 1000, 0, 64, 0, 3], sink=True,
                      splits=True), id="key_splits_window_seqused_sink"),
    pytest.param(dict(causal=True, hq=2, hkv=1, used=[900, 300, 1000, 0, 64, 0, 3],
                      few=True), id="fewer_items_than_sms_seqused"),
])
def test_attn_fwd_gpu_sm90_persistent_varlen(device, kernel_opts, monkeypatch, d, wg, case):
    """The persistent varlen forward (row blocks listed on the device) against the float64
    reference, outputs NaN-poisoned: lengths off the 128-row and 64-row grids (tiles and Q
    halves that reach into the next sequence, halves stored from registers), empty
    sequences, a sequence with no key, GQA 4:1; and with the heads dealt in L2 sections
    of 8 and 4 (the L2 budget made two kv heads' K/V). ``splits``: key splits
    (VARLEN_SPLIT_KV) with 2000 "SMs" and a tile a split, so that the call
    takes 8 splits (many of them empty for the short sequences), merged by merge_splits.
    ``few``: fewer items than SMs (a chunked prefill's shape): the grid kernel's where the
    config has one, else (D = 64) still the persistent varlen kernel. ``wg``: its consumer
    warpgroups (three: 192-row blocks that end at their sequence's end, so the first part
    of a sequence's first block lies before row 0)."""
    from flashlse.kernels import fwd_sm90

    kernel_opts(fwd_sm90_config={"PERSISTENT_VARLEN": True, "VARLEN_CONSUMERS": wg})
    plans = []
    real = fwd_sm90.plan
    monkeypatch.setattr(fwd_sm90, "plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    case = dict(case)
    hq, hkv = case.pop("hq", 8), case.pop("hkv", 2)
    lens_q, lens_k = [700, 0, 1300, 1, 129, 63, 65], [900, 300, 1300, 0, 129, 200, 70]
    if case.pop("sections", False):
        monkeypatch.setattr(fwd_sm90, "VARLEN_L2_BYTES", 2 * sum(lens_k) * 2 * d * 2)
    want = "persistent varlen"
    if case.pop("splits", False):
        monkeypatch.setattr(fwd_sm90, "VARLEN_SPLIT_KV", True)
        monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
        monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 2000)
        fwd_sm90._PLANS.clear()
        # 25 row blocks (the bound; 18 of 192 rows) x 8 heads x 8 <= 2000; 11 key tiles
        want = "8 splits"
    if case.pop("few", False) and configs.FWD_SM90[d].grid:
        want = None  # 25 row blocks x 2 heads <= 132 SMs: the grid kernel
    _run_varlen(device, torch.bfloat16, lens_q, lens_k, hq, hkv, d, d, **case)
    if want is None:
        assert plans and all(p.run is not None and not isinstance(p.run, fwd_sm90._VarlenLaunch)
                             for p in plans)
    else:
        assert plans and all(p.signature[-1] == want for p in plans)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d, wg", _VARLEN_D_WG)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,kw", [
    pytest.param(2, 200, 700, 8, 2, dict(causal=True, sink=True), id="causal_gqa_sink"),
    pytest.param(1, 300, 260, 4, 4, dict(causal=True), id="causal_sq_gt_sk_empty_rows"),
    pytest.param(3, 129, 1000, 4, 1, dict(window=(200, 0)), id="window_mqa"),
    pytest.param(2, 64, 513, 4, 2, dict(), id="full"),
])
def test_attn_fwd_gpu_sm90_dense_key_splits(device, kernel_opts, monkeypatch, d, wg, b, sq, sk,
                                            hq, hkv, kw):
    """The dense key splits (DENSE_SPLIT_KV): a dense call as packed sequences of
    equal lengths on the persistent varlen kernel with key splits (2000 "SMs" and a tile a
    split, so that these small calls split), merged into the dense out and lse, against the
    float64 reference: GQA and MQA, a sink, rows that see no key, a window, lengths off the
    64- and 128-row grids; ``wg`` consumer warpgroups."""
    from flashlse.kernels import fwd_sm90

    kernel_opts(fwd_sm90_config={"VARLEN_CONSUMERS": wg})
    plans = []
    real = fwd_sm90.plan
    monkeypatch.setattr(fwd_sm90, "plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_KV", True)
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_MIN_KEYS", 1)
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 2000)
    fwd_sm90._PLANS.clear()
    _run_dense(device, torch.bfloat16, b, sq, sk, hq, hkv, d, d, **kw)
    # A head dim whose config has no persistent varlen kernel (configs.FWD_SM90) leaves its
    # calls on the dense kernels (the checks below hold there too).
    splits = configs.FWD_SM90[d].persistent_varlen
    assert plans and all((p.signature[-1] == "dense") == splits for p in plans)
    # A NaN key reaches exactly the rows that see it (its batch, its kv head's query heads,
    # within the mask) and no empty-looking row; every other row equals the clean call's
    # bit for bit.
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(b, n, h, d, generator=g).to("cuda", torch.bfloat16)
               for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    left, right = _window(kw.get("causal", False), kw.get("window", (None, None)))
    call = lambda k: dispatch.attn_fwd(q, k, v, left=left, right=right, softcap=0.0,
                                       scale=d ** -0.5, sink=None)
    out, lse = call(k)
    j = sk - 1  # the last key: every row that sees any key near the end sees it
    k_nan = k.clone()
    k_nan[0, j, 0] = float("nan")
    out_n, lse_n = call(k_nan)
    i = torch.arange(sq, device="cuda")[:, None]
    sees = torch.ones(sq, 1, dtype=torch.bool, device="cuda")
    if right is not None:
        sees &= j <= i + sk - sq + right
    if left is not None:
        sees &= j >= i + sk - sq - left
    want = torch.zeros(b, hq, sq, dtype=torch.bool, device="cuda")
    want[0, : hq // hkv] = sees[:, 0]
    assert torch.equal(torch.isnan(lse_n), want)
    assert torch.equal(torch.isnan(out_n).any(-1), want.transpose(1, 2))
    assert torch.equal(lse_n[~want], lse[~want])
    assert torch.equal(out_n[~want.transpose(1, 2)], out[~want.transpose(1, 2)])


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
def test_attn_fwd_gpu_sm90_dense_key_splits_kept_list_streams_and_graphs(monkeypatch):
    """A dense split's plan keeps its row blocks' list a stream: a second stream lists its
    own, a CUDA graph captures a fresh one, and every call (repeated, on the side stream,
    the graph's replays on new inputs) equals the first call on the same inputs bit for
    bit, with its NaN-poisoned outputs filled."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_MIN_KEYS", 1)
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 2000)
    fwd_sm90._PLANS.clear()
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)
    b, sq, sk, hq, hkv, d = 2, 200, 700, 8, 2, 128
    q, k, v = mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    call = lambda: dispatch.attn_fwd(q, k, v, left=None, right=0, softcap=0.0,
                                     scale=d ** -0.5, sink=None)
    first = call()
    plan = next(p for p in fwd_sm90._PLANS.values() if p is not None)
    assert plan.signature[-1] == "dense"
    want = reference.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(first[0].double(), want[0], atol=2e-2, rtol=0)
    torch.testing.assert_close(first[1].double(), want[1], atol=1e-3, rtol=0)
    for got in (call(), call()):
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = call()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
    assert len(plan.run.lists) == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    assert len(plan.run.lists) == 2  # the capture kept nothing
    for seed in (1, 2):
        g.manual_seed(seed)
        for t in (q, k, v):
            t.copy_(mk(*t.shape))
        graph.replay()
        want_o, want_l = call()
        assert torch.equal(out, want_o) and torch.equal(lse, want_l)
        assert not torch.isnan(out).any()


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_attn_fwd_gpu_sm90_persistent_lse_contract_and_nan(d):
    """The LSE contract on the dense persistent kernel (the default at every Hopper head
    dim; causal Sq = 1024 on Sk = 512: rows 0-511 of each sequence see no key): empty rows
    are exactly (0, -inf); a -inf sink is no sink, bit for bit; a NaN key reaches exactly
    the rows that see it (its sequence, its kv head's query heads, rows from key + 512), a
    NaN sink exactly its head's rows (empty ones too), and every other row equals the clean
    call bit for bit; gradients through the clean call have no NaN."""
    from flashlse.kernels import fwd_sm90

    g = torch.Generator().manual_seed(61)
    b, sq, sk, hq, hkv = 2, 1024, 512, 16, 4
    mk = lambda *s: torch.randn(*s, generator=g).to(device="cuda", dtype=torch.bfloat16)
    q, k, v = mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    fwd_sm90._PLANS.clear()
    call = lambda q, k, v, sink=None: fl.attention(q, k, v, causal=True, sink=sink,
                                                   return_lse=True)
    none = call(q, k, v)
    assert any(p is not None and p.signature[-1] == "persistent"
               for p in fwd_sm90._PLANS.values())
    out, lse = none
    assert torch.isneginf(lse[:, :, :512]).all() and (out[:, :512] == 0).all()
    assert not torch.isinf(lse[:, :, 512:]).any() and not torch.isnan(out).any()
    for a, w in zip(call(q, k, v, torch.full((hq,), float("-inf"), device="cuda")), none):
        assert torch.equal(a, w)

    bad = torch.zeros(b, hq, sq, dtype=torch.bool, device="cuda")  # lse's (b, head, row)
    k_bad = k.clone()
    k_bad[1, 100, 2, 7] = float("nan")  # sequence 1, kv head 2 (query heads 8-11), key 100
    bad[1, 8:12, 612:] = True
    sink = torch.randn(hq, generator=g).to("cuda")
    sink_bad = sink.clone()
    sink_bad[5] = float("nan")
    bad[:, 5] = True
    clean_out, clean_lse = call(q, k, v, sink)
    out2, lse2 = call(q, k_bad, v, sink_bad)
    rows2 = out2.transpose(1, 2)  # (b, head, row, d)
    assert torch.equal(torch.isnan(lse2), bad) and torch.equal(torch.isnan(rows2).any(-1), bad)
    assert torch.equal(lse2[~bad], clean_lse[~bad])
    assert torch.equal(rows2[~bad], clean_out.transpose(1, 2)[~bad])

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = call(*leaves, sink)
    (out.float().square().sum() + lse.sum()).backward()
    assert all(not torch.isnan(t.grad).any() for t in leaves)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d, wg", _VARLEN_D_WG)
def test_attn_fwd_gpu_sm90_persistent_varlen_bad_data_stays_in_its_sequence(kernel_opts, d, wg):
    """Tiles of the persistent varlen kernel reach past their sequence's end (the
    descriptors span the packed tensors): a NaN in the first key and value rows of the
    sequence after must not reach it. Within its own sequence a NaN key reaches the rows
    that see it (all, causal: it is key 0), a NaN value row every row of its kv head's
    heads (``P V`` with ``P = 0`` is NaN, as in the reference's product), a NaN query row
    its own row. Every other row equals the grid kernel's result bit for bit (the same
    tiles in the same order). Three consumer warpgroups (``wg``) split a row's tiles by
    64-row parts, not 128-row blocks (which tiles are masked differs), so there every other
    row equals the same kernel's call on the clean inputs bit for bit."""
    from flashlse.kernels import fwd_sm90

    g = torch.Generator().manual_seed(31)
    lens = [200, 77, 300, 129, 64, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    n = sum(lens)
    mk = lambda *s: torch.randn(*s, generator=g).to(device="cuda", dtype=torch.bfloat16)
    # 16 query heads on 8 kv heads (more items than SMs: the persistent kernel's domain);
    # the bad values sit in kv heads 0 and 1, query heads 0-3.
    q, k, v = mk(n, 16, d), mk(n, 8, d), mk(n, 8, d)
    clean = q.clone(), k.clone(), v.clone()
    bad = torch.zeros(16, n, dtype=torch.bool, device="cuda")  # out's (head, row)
    bad_lse = bad.clone()
    for i in (1, 2, 3):  # the first key and value rows of sequences 1-3: NaN
        r = int(cu[i])
        k[r, 0, 3] = float("nan")
        v[r + 1, 1, 5] = float("nan")
        bad[:4, r:int(cu[i + 1])] = True  # kv head 0's key 0, kv head 1's value 1 ...
        bad_lse[:2, r:int(cu[i + 1])] = True  # ... and the key alone reaches lse
    q[int(cu[4]) + 10, 3, 0] = float("nan")
    bad[3, int(cu[4]) + 10] = bad_lse[3, int(cu[4]) + 10] = True

    def call(q=q, k=k, v=v):
        return fl.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                   return_lse=True)

    # (GRID: D = 64's config sends the calls no persistent kernel takes to fwd.py's.)
    with fl.kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": False, "GRID": True}):
        want, want_lse = call()
    kernel_opts(fwd_sm90_config={"PERSISTENT_VARLEN": True, "VARLEN_CONSUMERS": wg})
    fwd_sm90._PLANS.clear()
    got, lse = call()
    if wg == 3:
        want, want_lse = call(*clean)
    runs = [p.run for p in fwd_sm90._PLANS.values() if p is not None]
    assert any(isinstance(r, fwd_sm90._VarlenLaunch) for r in runs)
    rows = got.transpose(0, 1)  # (head, row, d)
    # (A NaN value element reaches its own column of out.)
    assert torch.equal(torch.isnan(lse), bad_lse) and torch.equal(torch.isnan(rows).any(-1), bad)
    assert torch.equal(lse[~bad_lse], want_lse[~bad_lse])
    assert torch.equal(rows[~bad], want.transpose(0, 1)[~bad])


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
@pytest.mark.parametrize("d, wg", _VARLEN_D_WG)
def test_attn_fwd_gpu_sm90_persistent_varlen_lse_contract(kernel_opts, d, wg):
    """The LSE contract on the persistent varlen forward (two sequences with no key through
    seqused_k, 16 query heads on 8 kv heads), at each head dim whose config runs it:
    empty rows are exactly (0, -inf); a -inf sink is no sink, bit for bit; a NaN sink in
    one head reaches exactly that head's rows (empty ones too: out = 0 / (0 + e^NaN)),
    every other row equals the call with a finite sink; the gradients through it have no
    NaN. ``wg``: the kernel's consumer warpgroups."""
    from flashlse.kernels import fwd_sm90

    kernel_opts(fwd_sm90_config={"PERSISTENT_VARLEN": True, "VARLEN_CONSUMERS": wg})
    g = torch.Generator().manual_seed(41)
    lens = [200, 77, 300, 129, 64, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    used = torch.tensor([200, 0, 300, 0, 64, 1], dtype=torch.int32, device="cuda")
    n = sum(lens)
    mk = lambda *s: torch.randn(*s, generator=g).to(device="cuda", dtype=torch.bfloat16)
    q, k, v = mk(n, 16, d), mk(n, 8, d), mk(n, 8, d)
    empty = torch.zeros(n, dtype=torch.bool, device="cuda")
    for i in (1, 3):
        empty[int(cu[i]):int(cu[i + 1])] = True

    def call(q, k, v, sink):
        return fl.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), seqused_k=used,
                                   causal=True, sink=sink, return_lse=True)

    fwd_sm90._PLANS.clear()
    none = call(q, k, v, None)
    runs = [p.run for p in fwd_sm90._PLANS.values() if p is not None]
    assert any(isinstance(r, fwd_sm90._VarlenLaunch) for r in runs)
    neg = call(q, k, v, torch.full((16,), float("-inf"), device="cuda"))
    for a, b in zip(neg, none):
        assert torch.equal(a, b)
    out, lse = none
    assert torch.isneginf(lse[:, empty]).all() and (out[empty] == 0).all()
    assert not torch.isinf(lse[:, ~empty]).any()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    sink = torch.randn(16, generator=g).to("cuda")
    clean_out, clean_lse = call(q, k, v, sink)
    assert torch.equal(clean_lse[:, empty], sink[:, None].expand(16, int(empty.sum())))
    bad_sink = sink.clone()
    bad_sink[5] = float("nan")
    out2, lse2 = call(q, k, v, bad_sink)
    bad = torch.zeros(16, n, dtype=torch.bool, device="cuda")
    bad[5] = True
    rows2 = out2.transpose(0, 1)
    assert torch.equal(torch.isnan(lse2), bad) and torch.equal(torch.isnan(rows2).any(-1), bad)
    assert torch.equal(lse2[~bad], clean_lse[~bad])
    assert torch.equal(rows2[~bad], clean_out.transpose(0, 1)[~bad])

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = call(*leaves, sink)
    (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
    assert all(not torch.isnan(t.grad).any() for t in leaves)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_sm90(), reason="the Hopper kernel needs sm_90")
def test_attn_fwd_gpu_sm90_persistent_varlen_empty_list(kernel_opts):
    """Packed rows but no sequence with any (``cu_seqlens_q`` all zero, max_seqlen_q > 0):
    the list is empty, the kernel's programs take no item, and its look-ahead reads stay in
    the list's buffer (under compute-sanitizer: no out-of-bounds access); a second call
    with one real sequence after it gives the reference's rows."""
    kernel_opts(fwd_sm90_config={"PERSISTENT_VARLEN": True})
    g = torch.Generator(device="cuda").manual_seed(5)
    # 64 heads: more items (4 blocks at most x 64) than SMs, the persistent kernel's domain.
    q, k, v = (torch.randn(300, 64, 128, generator=g, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    zero = torch.zeros(3, dtype=torch.int32, device="cuda")
    dispatch.attn_fwd(q, k, v, left=None, right=0, softcap=0.0, scale=0.1, sink=None,
                      cu_seqlens_q=zero, cu_seqlens_k=zero, max_seqlen_q=200, max_seqlen_k=200)
    torch.cuda.synchronize()
    _run_varlen("cuda", torch.bfloat16, [300], [300], 64, 64, 128, 128, causal=True, seed=6)


def _first_row(i, n_blk, t_q, bm, align):
    """Row block ``i``'s first row in ``_varlen_blocks_kernel``'s list: ``i * bm``, or with
    ``ALIGN_END = align`` the blocks end at ``t_q`` rounded up to ``align`` rows."""
    return i * bm if not align else -(-t_q // align) * align - (n_blk - i) * bm


@pytest.mark.parametrize("bm, align", [(4, 0), (6, 2)])
def test_attn_fwd_sm90_varlen_blocks_list(device, bm, align):
    """``_varlen_blocks_kernel`` (Triton: the interpreter runs it in CI) lists every row
    block once, the highest block index first, each index's sequences in order, each with
    its sequence's bounds and first row (from row 0, or ending at the sequence's end rounded
    up to a part: ALIGN_END), the count in front: empty sequences, lengths past
    max_seqlen (clamped, as the kernels' grid), an end past the packed rows and a
    decreasing offset (clamped as ``seq_spans``), seqused_k (clamped to ``[0, T_k]``), and
    more sequences than a program's vector (the loop over chunks). Sequences that overlap
    (bad offsets) can have more blocks than the host's bound on the buffer: past its
    ``capacity`` no block is written."""
    from flashlse.kernels import fwd_sm90

    total_q, total_k, max_q, max_k = 60, 50, 13, 9
    cu_q = [0, 5, 5, 18, 19, 30, 26, 31, 40, 41, 55, 80]  # lengths 5 0 13 1 11 0 5 9 1 14 ...
    cu_k = [0, 3, 9, 20, 20, 29, 35, 30, 44, 45, 49, 61]
    used = [3, 9, -2, 0, 100, 4, 1, 2, 0, 3, 5]
    batch = len(cu_q) - 1

    def span(cu, b, total, max_len):
        s0 = min(max(cu[b], 0), total)
        s1 = min(max(cu[b + 1], s0), total)
        return s0, min(s1 - s0, max_len)

    for with_used, short in ((False, 0), (True, 0), (True, 5)):
        seq = []
        for b in range(batch):
            bos, t_q = span(cu_q, b, total_q, max_q)
            bos_k, t_k = span(cu_k, b, total_k, max_k)
            if with_used:
                t_k = min(max(used[b], 0), t_k)
            seq.append((bos, bos_k, t_q, t_k))
        n_blk = [-(-s[2] // bm) for s in seq]
        want = [(*seq[b], _first_row(i, n_blk[b], seq[b][2], bm, align))
                for i in range(max(n_blk) - 1, -1, -1) for b in range(batch) if n_blk[b] > i]
        n = fwd_sm90.VARLEN_ITEM.value
        assert len(want) == sum(n_blk)
        cap = len(want) - short
        want = want[:cap]
        blocks = torch.full((1 + n * cap + 6, ), -7, dtype=torch.int32, device=device)
        as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
        fwd_sm90._varlen_blocks_kernel[(-(-max_q // bm), )](
            as_t(cu_q), as_t(cu_k), as_t(used) if with_used else None, blocks, None, batch,
            total_q, total_k, max_q, max_k, cap, 0, 0, 0, BLOCK_M=bm, BLOCK_B=4,
            HAS_SEQUSED_K=with_used, GROUP=1, PAGE_SIZE=0, BLOCK_P=1, ALIGN_END=align)
        got = blocks.cpu().tolist()
        assert got[0] == cap
        assert [tuple(got[1 + n * j:1 + n * j + n]) for j in range(cap)] == want
        assert got[1 + n * cap:] == [-7] * 6


@pytest.mark.parametrize("page", [1, 3, 16])
def test_attn_fwd_sm90_varlen_blocks_list_paged(device, page):
    """``_varlen_blocks_kernel`` over a paged cache (a paged call's long sequences on the
    persistent varlen kernel): a block's ``bos_k`` is its sequence's index, its ``T_k``
    seqused_k clamped to ``[0, seqlen_k]`` (the table's pages) and ended before the first
    block-table entry outside ``[0, num_pages)`` (negative, or past the cache); sequences of
    at most ``rows_lo`` packed rows (``T_q * GROUP``) have no block; table rows longer than a
    program's look (BLOCK_P entries) and more sequences than its vector (BLOCK_B)."""
    bm, group, rows_lo, num_pages = 4, 2, 4, 40
    cu_q = [0, 5, 5, 18, 20, 30, 31, 40]  # T_q 5 0 13 2 10 1 9: rows 10 0 26 4 20 2 18
    used = [70, 9, 200, -3, 33, 50, 0]
    seqlen_k = 60 // page * page  # the table's pages
    batch = len(cu_q) - 1
    cols = -(-200 // page)
    g = torch.Generator().manual_seed(page)
    table = torch.randint(0, num_pages, (batch, cols), generator=g, dtype=torch.int32)
    # Bad entries: sequence 0 at key 23's page, sequence 4 at key 0's (past the cache),
    # sequence 6 at key 25's (negative); sequence 2's bad page lies past its length.
    table[0, 23 // page] = num_pages
    table[4, 0] = -1
    table[6, 25 // page] = -5
    table[2, cols - 1] = 10**6

    seq = _check_paged_list(device, cu_q, used, table, page, num_pages, group, rows_lo,
                            seqlen_k, bm)
    assert any(t_q and not t_k for _, _, t_q, t_k in seq)  # an empty key range listed


@pytest.mark.parametrize("seed", range(4))
def test_attn_fwd_sm90_varlen_blocks_list_paged_random(device, seed):
    """The same list on random batches: lengths (zero among them) and offsets, seqused_k
    from negative to past the table, block tables whose entries are valid or not at random,
    page sizes from 1 to 16, several programs' block indices."""
    g = torch.Generator().manual_seed(1000 + seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))
    batch, page, num_pages, group = rand(1, 9), [1, 2, 5, 16][seed], rand(1, 30), rand(1, 4)
    lens = [rand(0, 20) for _ in range(batch)]
    cu_q = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cols = rand(1, 12)
    used = [rand(-5, cols * page + 20) for _ in range(batch)]
    # About one entry in six outside [0, num_pages): negative or past the cache.
    table = torch.randint(0, num_pages, (batch, cols), generator=g, dtype=torch.int32)
    bad = torch.rand(batch, cols, generator=g) < 1 / 6
    table[bad] = torch.where(torch.rand(batch, cols, generator=g) < 0.5, -1,
                             num_pages).to(torch.int32)[bad]
    seqlen_k = rand(0, cols) * page
    _check_paged_list(device, cu_q, used, table, page, num_pages, group, rand(0, 8),
                      seqlen_k, [4, 6, 4, 9][seed], block_b=[4, 2, 8, 1][seed],
                      block_p=[4, 8, 2, 16][seed], align=[0, 2, 0, 3][seed])


def _check_paged_list(device, cu_q, used, table, page, num_pages, group, rows_lo, seqlen_k,
                      bm, block_b=4, block_p=4, align=0):
    """Launch ``_varlen_blocks_kernel``'s paged form and compare its list with this model:
    ``(bos, sequence, T_q, T_k, first row)`` for the row blocks of every sequence of more
    than ``rows_lo`` packed rows, the highest block index first; returns the sequences'
    ``(bos, b, T_q, T_k)``."""
    from flashlse.kernels import fwd_sm90

    batch, total_q = len(cu_q) - 1, cu_q[-1]
    max_q = max(max(cu_q[b + 1] - cu_q[b] for b in range(batch)), 1)
    seq = []
    for b in range(batch):
        t_q = cu_q[b + 1] - cu_q[b]
        if t_q * group <= rows_lo:
            t_q = 0
        t_k = min(max(used[b], 0), seqlen_k)
        n_pages = -(-t_k // page)
        bad = [j for j in range(n_pages) if not 0 <= int(table[b, j]) < num_pages]
        if bad:
            t_k = min(t_k, bad[0] * page)
        seq.append((cu_q[b], b, t_q, t_k))
    n_blk = [-(-s[2] // bm) for s in seq]
    want = [(*seq[b], _first_row(i, n_blk[b], seq[b][2], bm, align))
            for i in range(max(n_blk) - 1, -1, -1) for b in range(batch) if n_blk[b] > i]
    n = fwd_sm90.VARLEN_ITEM.value
    cap = len(want)
    blocks = torch.full((1 + n * cap + 6, ), -7, dtype=torch.int32, device=device)
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    fwd_sm90._varlen_blocks_kernel[(-(-max_q // bm), )](
        as_t(cu_q), None, as_t(used), blocks, table.to(device), batch, total_q, 0, max_q,
        seqlen_k, cap, table.stride(0), num_pages, rows_lo, BLOCK_M=bm, BLOCK_B=block_b,
        HAS_SEQUSED_K=True, GROUP=group, PAGE_SIZE=page, BLOCK_P=block_p, ALIGN_END=align)
    got = blocks.cpu().tolist()
    assert got[0] == cap
    assert [tuple(got[1 + n * j:1 + n * j + n]) for j in range(cap)] == want
    assert got[1 + n * cap:] == [-7] * 6
    return seq


def test_attn_fwd_sm90_persistent_varlen_domain(monkeypatch):
    """Which packed varlen calls the persistent varlen kernel takes (no device needed:
    ``_varlen_ok`` reads metadata; 132 SMs): heads adjacent in q, k, v and out, a key row,
    rows in int32, more items than SMs, and its config switch."""
    from flashlse.kernels import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)

    empty = functools.partial(torch.empty, dtype=torch.bfloat16)
    on = {"PERSISTENT_VARLEN": True}

    def ok(q, k, override=on, total_k=None, batch=8, seqlen_q=4096, seqlen_k=None):
        cfg = fwd_sm90._config(q, override)
        shared = dict(BLOCK_N=cfg.block_n, STAGES=cfg.num_stages)
        lse = torch.empty(q.shape[1], q.shape[0])
        lens = dict(total_q=q.shape[0], total_k=k.shape[0] if total_k is None else total_k,
                    seqlen_q=seqlen_q, seqlen_k=seqlen_k or seqlen_q)
        return fwd_sm90._varlen_ok(q, k, k, q, lse, shared, cfg, batch, lens)

    q, k = empty(16384, 16, 128), empty(16384, 4, 128)
    assert ok(q, k) and ok(empty(16384, 16, 256), empty(16384, 4, 256))
    assert not ok(q, k, override={"PERSISTENT_VARLEN": False})
    assert not ok(q, k, override={"PERSISTENT_VARLEN": True, "PINGPONG": True})
    assert not ok(q, empty(0, 4, 128))  # no key row: the grid kernel stores the empty rows
    assert not ok(empty(16, 16384, 128).transpose(0, 1), k)  # heads not adjacent
    qkv = empty(16384, 3, 16, 128)  # a packed projection: rows 3 H D apart
    assert ok(qkv[:, 0], qkv[:, 1, :4])
    assert fwd_sm90._varlen_blocks(8, 16384, 4096) == 16384 // 128 + 8
    assert fwd_sm90._varlen_blocks(8, 16384, 100) == 8
    # At most one item an SM (8 blocks x 16 heads = 128, x 17 heads = 136): the grid kernel.
    assert not ok(q, k, seqlen_q=100)
    assert ok(empty(16384, 17, 128), empty(16384, 1, 128), seqlen_q=100)
    # ... where the config has a grid kernel: D = 64's has none (fwd.py's would run).
    assert ok(empty(16384, 16, 64), empty(16384, 4, 64), seqlen_q=100)
    assert not ok(empty(16384, 16, 64), empty(16384, 4, 64), seqlen_q=100,
                  override=dict(on, GRID=True))
    # Unless key splits split it (VARLEN_SPLIT_KV: at most half the SMs' items, at least
    # SPLIT_MIN_TILES key tiles a split): by default 32, so 8 tiles of keys stay whole ...
    monkeypatch.setattr(fwd_sm90, "VARLEN_SPLIT_KV", True)
    assert fwd_sm90.SPLIT_MIN_TILES == 32
    assert not ok(empty(16384, 8, 128), k, seqlen_q=100, seqlen_k=1024)
    assert ok(empty(16384, 8, 128), k, seqlen_q=100, seqlen_k=8192)  # 64 tiles: 2 splits
    # ... and at 4 tiles a split, 64 items on 8 tiles of keys take 2 splits.
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 4)
    assert not ok(q, k, seqlen_q=100, seqlen_k=1024)  # 128 items: more than half
    assert ok(empty(16384, 8, 128), k, seqlen_q=100, seqlen_k=1024)
    assert not ok(empty(16384, 8, 128), k, seqlen_q=100, seqlen_k=896)  # 7 tiles



def _varlen_deal(r, p, n_p, n_blocks, heads, hq):
    """``fwd_sm90._varlen_load``'s arithmetic in Python (Gluon does not run on the CPU),
    ``heads`` from ``_dealt_heads``: (valid, block, head) of program ``p``'s round ``r``,
    and the rounds of every section."""
    heads = hq if n_blocks * heads < n_p else heads
    rounds = max((n_blocks * heads + 2 * n_p - 1) // (2 * n_p) * 2, 1)
    sec, rr = divmod(r, rounds)
    p = p + (sec & 1) * (n_p - 1 - 2 * p)
    o = rr * n_p + p + (rr & 1) * (n_p - 1 - 2 * p)
    n_h = min(heads, hq - sec * heads)
    valid = n_h > 0 and o < n_blocks * n_h
    o = o if valid else 0
    return valid, o // max(n_h, 1), sec * heads + o % max(n_h, 1), rounds * -(-hq // heads)


@pytest.mark.parametrize("n_p", [1, 7, 128, 132])
def test_attn_fwd_sm90_persistent_varlen_dealing(n_p):
    """The persistent varlen kernel's dealing (a model of its arithmetic, checked on the
    GPU by the persistent varlen and paged tests): every (block, head) item dealt once, the
    sections one after another, a section's blocks in the list's order (longest first)
    round by round; no program idles while another has two more items when the items fit
    in two rounds (a 512-row chunk on a 64k context, 4 blocks x 32 heads in sections of 4
    heads, ran on 32 of 128 programs before ``_dealt_heads``); and the look-ahead past the
    last round reads block 0."""
    for n_blocks in (0, 1, 3, 4, 17, 130):
        for hq, heads in ((1, 1), (32, 4), (32, 32), (16, 5), (12, 12), (32, 8)):
            rounds = _varlen_deal(0, 0, n_p, n_blocks, heads, hq)[3]
            dealt = [[_varlen_deal(r, p, n_p, n_blocks, heads, hq)[:3] for p in range(n_p)]
                     for r in range(rounds + 1)]
            got = [(r, b, h) for r, row in enumerate(dealt[:rounds]) for v, b, h in row if v]
            assert sorted((b, h) for r, b, h in got) == [
                (b, h) for b in range(n_blocks) for h in range(hq)]
            sec = {h: h // (hq if n_blocks * heads < n_p else heads) for h in range(hq)}
            assert [(sec[h], r) for r, b, h in got] == sorted((sec[h], r) for r, b, h in got)
            for s in set(sec.values()):
                by_round = {}
                for r, b, h in got:
                    if sec[h] == s:
                        by_round.setdefault(r, []).append(b)
                spans = [by_round[r] for r in sorted(by_round)]
                assert all(max(a) <= min(b) for a, b in zip(spans, spans[1:]))
            counts = [sum(row[p][0] for row in dealt[:rounds]) for p in range(n_p)]
            if n_blocks * hq <= 2 * n_p:
                assert max(counts) - min(counts) <= 1
            assert all(not v and b == 0 for v, b, h in dealt[rounds])




def test_fwd_sm90_key_split_shares_cover_each_tile_once():
    """``_varlen_step``'s key split (a model of its arithmetic): split ``s`` of ``S`` takes
    tiles ``[n_lo + s * share, ...)``, ``share = ceil(n / S)``, clamped to the block's
    ``n`` tiles; together the splits take each tile once, in order, and the splits past the
    last tile take none (they store the empty state)."""
    for n in range(0, 41):
        for splits in (2, 4, 8, 16):
            share = (n + splits - 1) // splits
            taken = []
            for split in range(splits):
                lo = split * share
                count = min(max(n - lo, 0), share)
                taken += range(lo, lo + count)
            assert taken == list(range(n))

def _merged_splits(device, q, k, v, sink, out_dtype, bounds):
    """``fwd_sm90.merge_splits`` of the causal partial states of the key slices ``bounds``
    (computed in float64, stored as the split kernel stores them: ``split_states``' float32
    workspaces, an empty slice (0, -inf), a NaN score making its rows' state NaN), into a
    NaN-poisoned out and a row-padded lse."""
    from flashlse.kernels import fwd_sm90

    sq, h, d = q.shape
    out = torch.full((sq, h, d), float("nan"), dtype=out_dtype, device=device)
    lse = torch.full((h, sq + 3), float("nan"), device=device)[:, :sq]  # rows padded
    part_o, part_lse = fwd_sm90.split_states(len(bounds), out)
    part_o[:], part_lse[:] = _split_parts(q, k, v, bounds)
    fwd_sm90.merge_splits(part_o, part_lse, None if sink is None else sink.to(device), out,
                          lse)
    return out.cpu(), lse.cpu()


def _split_parts(q, k, v, bounds):
    """The causal partial states ``(n, Sq, H, D)``, ``(n, H, Sq)`` float32 of one sequence's
    key slices ``bounds``, computed in float64 (an empty slice (0, -inf), a NaN score making
    its rows' state NaN)."""
    sq, h, d = q.shape
    sk = k.shape[0]
    s = torch.einsum("ihd,jhd->hij", q, k) * d ** -0.5
    seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    outs, lses = [], []
    for a, b in bounds:
        cols = (torch.arange(sk) >= a) & (torch.arange(sk) < b)
        masked = s.masked_fill(~(seen & cols)[None], float("-inf"))
        part = torch.logsumexp(masked, -1)
        p = torch.exp(masked - part[..., None])
        p = torch.where(torch.isneginf(part)[..., None], 0.0, p)  # (rows of no key: 0)
        outs.append(torch.einsum("hij,jhd->ihd", p, v).float())
        lses.append(part.float())
    return torch.stack(outs), torch.stack(lses)


def test_fwd_sm90_merge_splits_into_a_dense_call_gives_the_whole_attention(device):
    """The dense key-split experiment's merge (``fwd_sm90.merge_splits`` into a dense out,
    DENSE_SPLIT_KV): partial states whose rows are two sequences' rows back to back merged
    into a dense out (B, Sq, H, D) and lse (B, H, Sq), the sink once, equal the whole causal
    attention's (float64 reference); the first ``Sq - Sk`` rows of each sequence see no key:
    exactly (0, sink). The split kernel itself runs on the GPU only."""
    from flashlse.kernels import fwd_sm90

    torch.manual_seed(1)
    b, sq, sk, h, d = 2, 37, 29, 3, 16
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64) for n in (sq, sk, sk))
    sink = torch.randn(h)
    out = torch.full((b, sq, h, d), float("nan"), dtype=torch.float16, device=device)
    lse = torch.full((b, h, sq), float("nan"), device=device)
    parts = [_split_parts(q[i], k[i], v[i], SPLIT_BOUNDS) for i in range(b)]
    part_o = torch.cat([o for o, _ in parts], 1).to(device)  # (n, B * Sq, H, D)
    part_lse = torch.cat([l for _, l in parts], 2).to(device)  # (n, H, B * Sq)
    fwd_sm90.merge_splits(part_o, part_lse, sink.to(device), out, lse)
    want, want_lse = reference.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    empty = sq - sk
    assert (out[:, :empty] == 0).all()
    assert torch.equal(lse[:, :, :empty], sink[None, :, None].expand(b, h, empty))


# Key slices of 29 keys, the last one empty.
SPLIT_BOUNDS = [(0, 8), (8, 16), (16, 24), (24, 29), (32, 29)]


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sink", ["none", "sink", "neginf_sink"])
def test_fwd_sm90_merge_splits_gives_the_whole_attention(device, out_dtype, sink):
    """The key splits' merge (``fwd_sm90.merge_splits``; PAGED_SPLIT_KV,
    VARLEN_SPLIT_KV): the splits' partial states merged into out and lse, the sink added
    once, equal the whole causal attention's (float64 reference). Rows that see no key (the
    first ``Sq - Sk``) get exactly (0, -inf), or (0, sink); a -inf sink is no sink, bit for
    bit. The split kernel itself runs on the GPU only (test_fwd_paged_sm90.py's "split"
    form, the persistent varlen test's key-split cases)."""
    torch.manual_seed(0)
    sq, sk, h, d = 37, 29, 3, 16
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for n in (sq, sk, sk))
    sink_t = {"none": None, "sink": torch.randn(h),
              "neginf_sink": torch.full((h, ), float("-inf"))}[sink]
    out, lse = _merged_splits(device, q, k, v, sink_t, out_dtype, SPLIT_BOUNDS)
    want, want_lse = reference.attention(q[None], k[None], v[None], causal=True,
                                         sink=sink_t, return_lse=True)
    torch.testing.assert_close(out.double(), want[0],
                               atol=2e-3 if out_dtype == torch.float16 else 1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse[0], atol=1e-5, rtol=0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = sq - sk
    assert (out[:empty] == 0).all()
    want_empty = (sink_t[:, None].expand(h, empty) if sink == "sink"
                  else torch.full((h, empty), float("-inf")))
    assert torch.equal(lse[:, :empty], want_empty)
    if sink == "neginf_sink":
        plain = _merged_splits(device, q, k, v, None, out_dtype, SPLIT_BOUNDS)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_fwd_sm90_merge_splits_nan_reaches_exactly_the_rows_that_see_it(device):
    """A NaN key (key 20 of head 1, in the third split) makes that split's state NaN on the
    rows that see it; the merge gives NaN out and lse on exactly those rows (rows from
    20 + Sq - Sk of head 1), as the reference, and every other row equals the clean merge
    bit for bit: the NaN is neither dropped nor spread, and no row looks empty."""
    torch.manual_seed(1)
    sq, sk, h, d = 37, 29, 3, 16
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64) for n in (sq, sk, sk))
    k_bad = k.clone()
    k_bad[20, 1, 3] = float("nan")
    clean = _merged_splits(device, q, k, v, None, torch.float32, SPLIT_BOUNDS)
    out, lse = _merged_splits(device, q, k_bad, v, None, torch.float32, SPLIT_BOUNDS)
    bad = torch.zeros(h, sq, dtype=torch.bool)
    bad[1, 20 + sq - sk:] = True
    want, want_lse = reference.attention(q[None], k_bad[None], v[None], causal=True,
                                         return_lse=True)
    assert torch.equal(torch.isnan(want_lse[0]), bad)
    assert torch.equal(torch.isnan(lse), bad)
    assert torch.equal(torch.isnan(out.transpose(0, 1)).any(-1), bad)
    assert torch.equal(lse[~bad], clean[1][~bad])
    assert torch.equal(out.transpose(0, 1)[~bad], clean[0].transpose(0, 1)[~bad])

def test_attn_fwd_sm90_persistent_domain():
    """Which calls the persistent kernel takes (no device needed: ``_persistent_ok`` reads
    metadata): dense, sequences back to back, S_q % 64 and S_k % BLOCK_N zero."""
    from flashlse.kernels import configs, fwd_sm90

    cfg = configs.FWD_SM90[128]
    shared = dict(BLOCK_N=cfg.block_n, STAGES=cfg.num_stages)
    on = {"PERSISTENT": True}
    empty = functools.partial(torch.empty, dtype=torch.bfloat16)

    def ok(q, k, override=on, **kw):
        kw = dict(dict(is_varlen=False, seqused_k=None), **kw)
        return fwd_sm90._persistent_ok(q, k, k, q, shared, fwd_sm90._config(q, override), **kw)

    q, k = empty(2, 1024, 8, 128), empty(2, 2048, 2, 128)
    assert ok(q, k)
    assert not ok(q, k, override={"PERSISTENT": False})
    assert not ok(q, k, override={"PERSISTENT": True, "PINGPONG": True})
    assert not ok(q, k, seqused_k=torch.empty(2))
    assert ok(empty(2, 320, 8, 128), k)  # S_q % 64 == 0 ...
    assert not ok(empty(2, 1000, 8, 128), k)  # ... but not 1000
    assert not ok(q, empty(2, 1000, 2, 128))  # S_k % BLOCK_N
    assert not ok(q, empty(2, 0, 2, 128))
    # Heads not adjacent, or sequences not back to back: the per-sequence kernel.
    assert not ok(empty(2, 8, 1024, 128).transpose(1, 2), k)
    assert not ok(empty(2, 2048, 8, 128)[:, :1024], k)
    # A packed qkv projection: rows 3 H D apart, heads adjacent.
    qkv = empty(2, 1024, 3, 8, 128)
    assert ok(qkv[:, :, 0], qkv[:, :, 1, :2])
    # D = 256: Q and the ring fit, out is staged in Q's buffer.
    q256, k256 = empty(2, 1024, 8, 256), empty(2, 1024, 2, 256)
    shared256 = dict(BLOCK_N=configs.FWD_SM90[256].block_n, STAGES=2)
    assert fwd_sm90._persistent_ok(q256, k256, k256, q256, shared256,
                                   fwd_sm90._config(q256, on), is_varlen=False, seqused_k=None)
    assert fwd_sm90._out_in_q(q256, shared256) and not fwd_sm90._out_in_q(q, shared)
    # Two Q buffers where they fit beside out's buffer and the ring (D = 64 and 128 at the
    # shipped tiles; not D = 256).
    two = dataclasses.replace(configs.FWD_SM90[128], q_bufs=2)
    q64 = empty(2, 1024, 8, 64)
    shared64 = dict(BLOCK_N=configs.FWD_SM90[64].block_n, STAGES=configs.FWD_SM90[64].num_stages)
    assert fwd_sm90._q_bufs(q, shared, two) == 2 and fwd_sm90._q_bufs(q64, shared64, two) == 2
    assert fwd_sm90._q_bufs(q256, shared256, two) == 1
    assert fwd_sm90._q_bufs(q, shared, configs.FWD_SM90[128]) == 1
    assert fwd_sm90._q_bufs(q, dict(shared, STAGES=3), two) == 1  # the ring's third stage


def test_attn_fwd_sm90_persistent_three_consumers():
    """D = 64's persistent items (no device needed): 192 rows on three consumer warpgroups,
    aligned to the sequence's end, so the partial block is the first, under a causal mask
    the cheapest (its cost: its own 64 rows' key tiles, plus one); only 2 or 3 consumers."""
    from flashlse.kernels import configs, fwd_sm90

    assert configs.FWD_SM90[64].consumers == 3 and configs.FWD_SM90[128].consumers == 2
    causal = dict(BLOCK_N=128, HAS_RIGHT=True, right=0, HAS_LEFT=False, left=0)
    # Rows 832-1023, 640-831, 448-639, 256-447, 64-255, 0-63: key tiles + 1.
    assert fwd_sm90._block_costs(1024, 1024, causal, 3).tolist() == [9, 8, 6, 5, 3, 2]
    assert fwd_sm90._block_costs(1024, 1024, causal, 2).tolist() == [9, 8, 7, 6, 5, 4, 3, 2]
    full = dict(causal, HAS_RIGHT=False)
    assert fwd_sm90._block_costs(320, 1024, full, 3).tolist() == [9, 9]
    q = torch.empty(2, 1024, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CONSUMERS is a persistent forward's consumer"):
        fwd_sm90._config(q, {"CONSUMERS": 4})
    assert fwd_sm90._config(q, {"CONSUMERS": 2}).consumers == 2
    with pytest.raises(ValueError, match="VARLEN_CONSUMERS is a persistent forward's"):
        fwd_sm90._config(q, {"VARLEN_CONSUMERS": 1})


def test_attn_fwd_sm90_varlen_three_consumers(monkeypatch):
    """The persistent varlen kernel on three consumer warpgroups (VARLEN_CONSUMERS = 3; no
    device needed): 192-row blocks in the host's bound on the list and in its launches'
    arguments (end-aligned list, 160 registers, the kernel's WG), packed and paged."""
    from flashlse.kernels import configs, fwd_sm90

    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)
    assert configs.FWD_SM90[64].varlen_consumers == 3  # (+7-9% on the H200, session 42)
    assert fwd_sm90._varlen_blocks(8, 16384, 4096, 3) == -(-16384 // 192) + 8
    assert fwd_sm90._varlen_blocks(8, 16384, 100, 3) == 8
    assert fwd_sm90._align_end(3) == 64 and fwd_sm90._align_end(2) == 0
    cfg = fwd_sm90._config(torch.empty(1, 1, 1, 64), {"VARLEN_CONSUMERS": 3})
    shared = fwd_sm90._shared_kw(torch.empty(1, 1, 4, 64), torch.empty(1, 1, 2, 64), None, 0,
                                 0.125, None, cfg)
    assert fwd_sm90._varlen_shared(shared, 3)["CONSUMER_REGS"] == 160
    assert fwd_sm90._varlen_shared(shared, 2)["CONSUMER_REGS"] == cfg.consumer_regs
    q = torch.empty(1000, 4, 64, dtype=torch.bfloat16)
    lse = torch.empty(4, 1000)
    lens = dict(seqlen_q=600, seqlen_k=600, total_q=1000, total_k=1000)
    plan = fwd_sm90._varlen_plan(q, q, lse, dict(stride_k=(0, 256, 64), stride_v=(0, 256, 64),
                                                 GROUP=2), shared, 3, lens, None, ("sig", ), 1, 3)
    blocks, kernel = plan.run.plan_blocks, plan.run.kernel
    names = lambda launch: dict(zip(launch.kernel.arg_names[-len(launch.args):], launch.args))
    assert plan.run.size == 1 + fwd_sm90.VARLEN_ITEM.value * fwd_sm90._varlen_blocks(3, 1000,
                                                                                     600, 3)
    assert blocks.grid[0] == 4 and names(blocks)["BLOCK_M"] == 192  # cdiv(600, 192)
    assert names(blocks)["ALIGN_END"] == 64
    assert names(kernel)["WG"] == 3 and names(kernel)["CONSUMER_REGS"] == 160


def test_attn_fwd_sm90_persistent_balance():
    """The persistent kernel only where its static schedule spreads the work (no device
    needed): every unmasked call with enough row blocks, causal B*S = 16k H = 16 at S = 1k
    and 2k, not at 4k-16k (the grid kernel's hardware scheduler does better there)."""
    from flashlse.kernels import fwd_sm90

    def programs(s, causal, heads=None, left=None):
        shared = dict(BLOCK_N=128, HAS_RIGHT=causal, right=0, HAS_LEFT=left is not None,
                      left=left or 0)
        return fwd_sm90._persistent_programs(s, s, heads or 16384 // s * 16, shared, 132)

    for s in (1024, 2048, 4096, 8192, 16384):
        assert programs(s, False) == 132
    assert programs(1024, True) and programs(2048, True)
    assert not any(programs(s, True) for s in (4096, 8192, 16384))
    assert programs(2048, True, heads=16) == 0  # 2 row blocks a program: uneven
    assert programs(128, False, heads=20) == 20  # fewer blocks than SMs: one each
    assert programs(1024, False, heads=17) == 0  # 136 blocks: 4 programs would take 2
    # A sliding window (left 256): nearly every block the same work, balanced.
    assert programs(4096, True, heads=64, left=256)


def test_attn_fwd_sm90_persistent_table():
    """The host's schedule for the persistent kernel (no device needed): every row block once,
    each program's blocks section by section (heads whose K/V fits TABLE_L2_BYTES), the
    busiest program within 3% of a perfect spread (or one block of it) where the round robin
    was 1.06-1.57x uneven (causal 4k-16k) and for a single sequence of 16 heads at 2k-16k."""
    from flashlse.kernels import fwd_sm90

    shared = dict(BLOCK_N=128, HAS_RIGHT=True, right=0, HAS_LEFT=False, left=0)
    for s, heads in ((4096, 64), (8192, 32), (16384, 16), (2048, 16), (4096, 16)):
        cost = fwd_sm90._block_costs(s, s, shared)
        n_m = cost.numel()
        assert cost.tolist() == [n_m - i + 1 for i in range(n_m)]  # tiles + 1, last first
        kv_bytes = s * 2 * 128 * 2
        table = fwd_sm90._greedy_table(cost, heads, 132, kv_bytes)
        offsets, items = table[:133], table[133:]
        assert offsets[0] == 0 and offsets[-1] == len(items) == heads * n_m
        assert sorted(items) == list(range(heads * n_m))
        section = max(1, fwd_sm90.TABLE_L2_BYTES // kv_bytes) * n_m
        loads = []
        for p in range(132):
            mine = items[offsets[p]:offsets[p + 1]]
            assert [i // section for i in mine] == sorted(i // section for i in mine)
            loads.append(sum(cost[i % n_m].item() for i in mine))
        avg = sum(loads) / 132  # (or within the cheapest block of it, for few blocks)
        assert max(loads) <= max(1.03 * avg, avg + cost.min().item()), (s, heads, loads)
    assert fwd_sm90._greedy_table(cost, fwd_sm90.MAX_TABLE_ITEMS, 132, kv_bytes) is None
