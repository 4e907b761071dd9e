"""Sparse top-k attention backward: one program per (batch, query row, kv head).

Math (docs/math.md §4). Query row i of kv head h lists keys ``I = indices[b, i, h, :]`` (-1 or
an index outside ``[0, Sk)`` is no key; a repeated index counts each time). For the group's
query heads g, with ``P[g, t] = exp(S[g, t] - L[g])`` over the listed keys (``L = -inf``
replaced by 0 once per row, so an empty row has ``P = 0``) and
``Delta[g] = rowsum(dO[g] O[g]) - dL[g]``:

    dS[g, t] = P[g, t] (dO[g] . V[I_t] - Delta[g])
    dQ[g]    = scale sum_t dS[g, t] K[I_t]
    dK[I_t] += scale sum_g dS[g, t] Q[g]          dV[I_t] += sum_g P[g, t] dO[g]

The group's heads are the rows of one tile (padded to 16), so each gathered K/V row serves
all of them; dQ stays in registers and is stored once; dK and dV are scattered with float32
atomic adds (rows that several query rows list are summed in no fixed order: the result is
not bitwise repeatable, and the PyTorch path runs instead when torch's deterministic
algorithms are on). Exponentials are base 2 (``scale_log2``, ``lse_log2``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lse import safe_pivot
from . import configs
from ._common import LOG2E, next_pow2, stride_args


@triton.jit
def _sparse_bwd_kernel(
    q, k, v, dout, indices, lse_log2, delta, dq, dk, dv,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih,
    sq, sk, topk, scale, scale_log2,
    HKV: tl.constexpr, GROUP: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    i_r = tl.program_id(0)
    i_hk = i_r % HKV
    i_s = (i_r // HKV) % sq
    i_b = i_r // (HKV * sq)
    o_g = tl.arange(0, BLOCK_H)
    m_g = o_g < GROUP
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    # The group's query heads: rows of q (any strides).
    o_row = (i_b.to(tl.int64) * stride_qb + i_s.to(tl.int64) * stride_qs
             + (i_hk * GROUP + o_g).to(tl.int64) * stride_qh)
    # [BLOCK_H, BLOCK_D], [BLOCK_H, BLOCK_DV]
    b_q = tl.load(q + o_row[:, None] + o_d[None, :], mask=m_g[:, None] & (o_d < D)[None, :],
                  other=0.0)
    # Row statistics (lse in base 2 with -inf already 0, and Delta), dout and dq: contiguous
    # (B, Sq, Hq, *), so one row index serves them.
    o_stat = (i_b.to(tl.int64) * sq + i_s) * (HKV * GROUP) + i_hk * GROUP + o_g
    b_do = tl.load(dout + o_stat[:, None] * DV + o_dv[None, :],
                   mask=m_g[:, None] & (o_dv < DV)[None, :], other=0.0)
    b_lse = tl.load(lse_log2 + o_stat, mask=m_g, other=0.0)
    b_delta = tl.load(delta + o_stat, mask=m_g, other=0.0)
    b_dq = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    p_idx = indices + i_b.to(tl.int64) * stride_ib + i_s.to(tl.int64) * stride_is \
        + i_hk.to(tl.int64) * stride_ih
    for t0 in tl.range(0, topk, BLOCK_N):
        o_t = t0 + tl.arange(0, BLOCK_N)
        b_idx = tl.load(p_idx + o_t, mask=o_t < topk, other=-1)
        # An index outside [0, Sk) is no key: never read, never written.
        m_n = (o_t < topk) & (b_idx >= 0) & (b_idx < sk)
        b_key = tl.where(m_n, b_idx, 0).to(tl.int64)
        o_k = i_b.to(tl.int64) * stride_kb + b_key * stride_ks + i_hk.to(tl.int64) * stride_kh
        o_v = i_b.to(tl.int64) * stride_vb + b_key * stride_vs + i_hk.to(tl.int64) * stride_vh
        # [BLOCK_N, BLOCK_D], [BLOCK_N, BLOCK_DV]
        b_k = tl.load(k + o_k[:, None] + o_d[None, :], mask=m_n[:, None] & (o_d < D)[None, :],
                      other=0.0)
        b_v = tl.load(v + o_v[:, None] + o_dv[None, :],
                      mask=m_n[:, None] & (o_dv < DV)[None, :], other=0.0)
        # [BLOCK_H, BLOCK_N]
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse[:, None])
        b_dp = tl.dot(b_do, tl.trans(b_v))
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
        # [BLOCK_N, BLOCK_DV], [BLOCK_N, BLOCK_D]: scattered to the listed rows.
        b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q) * scale
        o_kf = ((i_b.to(tl.int64) * sk + b_key) * HKV + i_hk) * D
        o_vf = ((i_b.to(tl.int64) * sk + b_key) * HKV + i_hk) * DV
        # Relaxed: nothing in the kernel reads dK/dV, so the default acq_rel ordering (a fence
        # around every atom.global...acq_rel.add.v4.f32) buys nothing; the launch boundary
        # orders the sums for the caller.
        tl.atomic_add(dk + o_kf[:, None] + o_d[None, :], b_dk,
                      mask=m_n[:, None] & (o_d < D)[None, :], sem="relaxed")
        tl.atomic_add(dv + o_vf[:, None] + o_dv[None, :], b_dv,
                      mask=m_n[:, None] & (o_dv < DV)[None, :], sem="relaxed")
    tl.store(dq + o_stat[:, None] * D + o_d[None, :], (b_dq * scale).to(dq.dtype.element_ty),
             mask=m_g[:, None] & (o_d < D)[None, :])


def sparse_bwd(dout, dlse, q, k, v, indices, out, lse, *, scale, sink):
    """``dq, dk, dv, dsink`` of ``(out, lse) = sparse_attention(q, k, v, indices)``.

    Args:
        dout: ``(B, Sq, Hq, Dv)``; dlse: ``(B, Hq, Sq)`` or None.
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)`` (last dims
            stride 1); indices: ``(B, Sq, Hkv, topk)`` int32.
        out, lse: the forward's, lse ``(B, Hq, Sq)`` natural log with the sink.
        scale: multiplies ``q . k``. sink: ``(Hq,)`` or None.

    Returns:
        ``dq, dk, dv`` shaped and typed as ``q, k, v``; ``dsink (Hq,)`` or None.
    """
    b, sq, hq, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group, topk = hq // hkv, indices.shape[-1]
    # Row statistics in (B, Sq, Hq) order: Delta = rowsum(dO O) - dL, and lse in base 2
    # with an empty row's -inf replaced by 0 once (P = exp2(-inf - 0) = 0 there).
    lse_rows = lse.transpose(1, 2).float()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.transpose(1, 2).float()
    pivot = safe_pivot(lse_rows)
    lse_log2 = (pivot * LOG2E.value).contiguous()
    delta = delta.contiguous()
    dq = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(b, sk, hkv, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, sk, hkv, dv_dim, dtype=torch.float32, device=q.device)
    dsink = None
    if sink is not None:
        # dL/dsink_h = -sum_rows exp(sink_h - L) Delta (the sink is a key of value 0).
        dsink = -(torch.exp(sink.float() - pivot) * delta).sum((0, 1)).to(sink.dtype)
    if b * sq * hkv and topk:
        cfg = configs.sparse_bwd_config(group)
        _sparse_bwd_kernel[(b * sq * hkv,)](
            q=q,
            k=k,
            v=v,
            dout=dout.contiguous(),
            indices=indices,
            lse_log2=lse_log2,
            delta=delta,
            dq=dq,
            dk=dk,
            dv=dv,
            **stride_args("bsh", q=q, k=k, v=v, i=indices),
            sq=sq,
            sk=sk,
            topk=topk,
            scale=float(scale),
            scale_log2=float(scale) * LOG2E.value,
            HKV=hkv,
            GROUP=group,
            D=d,
            DV=dv_dim,
            BLOCK_H=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=max(16, next_pow2(d)),
            BLOCK_DV=max(16, next_pow2(dv_dim)),
            **cfg.launch(),
        )
    else:
        dq.zero_()
    return dq, dk.to(k.dtype), dv.to(v.dtype), dsink
