"""``sparse_attention``: each query row attends to the keys its ``indices`` list.

The PyTorch path walks the top-k list in chunks (gathering ``chunk`` keys per row),
merging chunk states as the dense path does; the backward recomputes each chunk and
scatters ``dk``/``dv`` back with ``index_add_``. An index of -1 is no key; a row of all
-1 is empty: ``out = 0``, ``lse = -inf`` (or the sink). A repeated index counts once
per occurrence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import options
from ..lse import safe_pivot
from . import _validate as V
from ._dispatch import compute_dtype, on_tensor_device, use_triton
from .attention import TILE_ELEMS, bwd_fakes, fwd_fakes, op_dsink, run_backward
from .merge import merge_math


def _chunks(indices, d, sk):
    b, sq, hkv, topk = indices.shape
    t = max(1, min(topk, TILE_ELEMS // max(1, b * sq * hkv * d)))
    for t0 in range(0, topk, t):
        idx = indices[..., t0:t0 + t].long()
        # An index outside [0, Sk) is no key, like -1 (GPU value checks are opt-in): the
        # gather never reads outside k and v.
        yield torch.where(idx < sk, idx, -1)


def _gather(x, idx, dt):
    """x ``(B, Sk, Hkv, D)``, idx ``(B, Sq, Hkv, T)`` -> ``(B, Sq, Hkv, T, D)``; -1 gives zeros.

    An unlisted key is never used: a -1 entry reads row 0 of a zero-padded copy of
    nothing -- it is zero-filled after the gather, so NaN in unlisted keys cannot leak.
    """
    b, hkv = x.shape[0], x.shape[2]
    if x.shape[1] == 0:
        return x.new_zeros(idx.shape + x.shape[-1:], dtype=dt)
    bi = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    hi = torch.arange(hkv, device=x.device).view(1, 1, hkv, 1)
    g = x[bi, idx.clamp(min=0), hi].to(dt)
    return g.masked_fill((idx < 0).unsqueeze(-1), 0.0)


def _logits(qg, kg, idx, scale):
    s = torch.einsum("bqhgd,bqhtd->bqhgt", qg, kg) * scale
    return s.masked_fill((idx < 0).unsqueeze(3), float("-inf"))


def sparse_fwd_torch(q, k, v, indices, *, scale, sink):
    b, sq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    qg = q.reshape(b, sq, hkv, g, d).to(dt)
    out = torch.zeros(b, sq, hkv, g, dv, dtype=dt, device=q.device)
    lse = torch.full((b, sq, hkv, g), float("-inf"), dtype=dt, device=q.device)
    for idx in _chunks(indices, max(d, dv), k.shape[1]):
        s = _logits(qg, _gather(k, idx, dt), idx, scale)
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
        z = e.sum(dim=-1, keepdim=True)
        o_c = torch.einsum("bqhgt,bqhtd->bqhgd", e, _gather(v, idx, dt))
        o_c = o_c * torch.where(z != 0, 1.0 / z, torch.zeros_like(z))
        out, lse = merge_math(torch.stack([out, o_c]),
                              torch.stack([lse, (torch.log(z) + m).squeeze(-1)]))
    if sink is not None:
        out, lse = merge_math(out[None], lse[None], sink.view(hkv, g))
    lse_dt = torch.float64 if dt == torch.float64 else torch.float32
    return out.reshape(b, sq, hq, dv).to(q.dtype), lse.reshape(b, sq, hq).transpose(1, 2).to(
        lse_dt).contiguous()


def _scatter_add(dst, idx, src):
    # dst (B * Sk * Hkv, D) += src (B, Sq, Hkv, T, D) at rows (b, idx, h); -1 entries add 0.
    b, sq, hkv, t = idx.shape
    if dst.shape[0] == 0:
        return
    sk = dst.shape[0] // (b * hkv)
    bi = torch.arange(b, device=idx.device).view(b, 1, 1, 1)
    hi = torch.arange(hkv, device=idx.device).view(1, 1, hkv, 1)
    rows = (bi * sk + idx.clamp(min=0)) * hkv + hi
    dst.index_add_(0, rows.reshape(-1), src.reshape(-1, src.shape[-1]))


def sparse_bwd_torch(dout, dlse, q, k, v, indices, out, lse, *, scale, sink):
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    qg = q.reshape(b, sq, hkv, g, d).to(dt)
    dog = dout.reshape(b, sq, hkv, g, dv).to(dt)
    lse_g = lse.transpose(1, 2).reshape(b, sq, hkv, g).to(dt)
    delta = (dog * out.reshape(b, sq, hkv, g, dv).to(dt)).sum(-1) - dlse.transpose(1, 2).reshape(
        b, sq, hkv, g).to(dt)
    pivot = safe_pivot(lse_g).unsqueeze(-1)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(b * sk * hkv, d, dtype=dt, device=q.device)
    dv_ = torch.zeros(b * sk * hkv, dv, dtype=dt, device=q.device)
    for idx in _chunks(indices, max(d, dv), k.shape[1]):
        kg, vg = _gather(k, idx, dt), _gather(v, idx, dt)
        p = torch.exp(_logits(qg, kg, idx, scale) - pivot)
        _scatter_add(dv_, idx, torch.einsum("bqhgt,bqhgd->bqhtd", p, dog))
        ds = p * (torch.einsum("bqhgd,bqhtd->bqhgt", dog, vg) - delta.unsqueeze(-1))
        dq += torch.einsum("bqhgt,bqhtd->bqhgd", ds, kg) * scale
        _scatter_add(dk, idx, torch.einsum("bqhgt,bqhgd->bqhtd", ds, qg) * scale)
    dsink = None
    if sink is not None:
        p_sink = torch.exp(sink.to(dt).view(hkv, g) - pivot.squeeze(-1))
        dsink = -(p_sink * delta).sum(dim=(0, 1)).reshape(hq).to(sink.dtype)
    return (dq.reshape(b, sq, hq, d).to(q.dtype), dk.view(b, sk, hkv, d).to(k.dtype),
            dv_.view(b, sk, hkv, dv).to(v.dtype), dsink)


def _listed_ok(indices, k, block_table):
    """Which listed keys of a paged cache hold a key: False for -1, an index past the
    sequence's pages, or one on a page outside ``[0, num_pages)`` -- the rule the decode
    kernel applies in place (``token_pages``), for the value check and the PyTorch path."""
    idx = indices.long()
    page_size = k.shape[1]
    ok = (idx >= 0) & (idx < block_table.shape[1] * page_size)
    slot = torch.where(ok, idx, 0)
    page = torch.gather(block_table.long(), 1, (slot // page_size).flatten(1)).view_as(idx)
    return ok & (page >= 0) & (page < k.shape[0])


class _FwdPlan(NamedTuple):
    """What :func:`sparse_fwd_kernel` derives from the call's metadata (shapes, strides,
    dtypes, device): whether the kernel takes it, the views it passes the decode kernel, the
    token table's sizes. Kept in ``_PLANS`` by the public call's metadata key. A call the
    kernel does not take has only ``kernel_ok = False``."""

    kernel_ok: bool
    pages_k: tuple = None  # k as single-row pages (n_rows * Hkv, 1, 1, D)
    pages_v: tuple = None  # v likewise, when it is not k's storage
    dv: int = None
    same_strides: bool = None  # v may be a view of k's storage (MLA): its address tells
    rows: tuple = None  # the sequences' q (B * Sq * Hkv, 1, G, D)
    table: tuple = None  # their lists (B * Sq * Hkv, topk)
    table_copy: bool = None  # the indices' view has strides the kernel cannot take
    pages_copy: bool = None  # the block table's likewise
    out: tuple = None  # out (B, Sq, Hq, Dv) and lse (B, Sq, Hq) of the kernel's results
    lse: tuple = None
    token_table: tuple = None
    # q, the indices and the block table reach the kernel as views of themselves (the
    # reshapes above are views): a repeated call passes the tensors as they are.
    direct: bool = False
    # decode_fwd's (key, plan) by (scale, v at k's address, 16-byte aligned, the options'
    # pdl and sm90_mla_decode): a direct call launches it without views or decode's key.
    decode: dict = None


_PLANS: dict = {}
_MAX_PLANS = 1024


def _fwd_plan(q, k, v, indices, block_table, key=None) -> _FwdPlan:
    """The call's :class:`_FwdPlan`, from ``_PLANS`` when ``key`` (its metadata key) has one."""
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan
    if not _kernel_ok(q, k, v, indices):
        plan = _FwdPlan(False)
    else:
        plan = _kernel_plan(q, k, v, indices, block_table)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _kernel_plan(q, k, v, indices, block_table) -> _FwdPlan:
    """The :class:`_FwdPlan` of a call the kernel takes (``_kernel_ok``)."""
    b, sq, hq, d = q.shape
    n0, n1, hkv = k.shape[:3]
    dv, topk = v.shape[-1], indices.shape[-1]
    rows = b * sq * hkv
    table = (rows, topk)
    if block_table is None:
        token_table = (n1, sq * hkv, hkv)
    else:
        token_table = (block_table.shape[1] * n1, sq * hkv, hkv, n0, n1)
    q_rows = (rows, 1, hq // hkv, d)
    table_copy = indices.reshape(table).stride(-1) != 1
    pages_copy = block_table is not None and block_table.stride(-1) != 1
    return _FwdPlan(
        kernel_ok=True, pages_k=(n0 * n1 * hkv, 1, 1, d), pages_v=(n0 * n1 * hkv, 1, 1, dv),
        dv=dv, same_strides=v.stride() == k.stride() and dv <= d, rows=q_rows,
        table=table, table_copy=table_copy, pages_copy=pages_copy,
        out=(b, sq, hq, dv), lse=(b, sq, hq), token_table=token_table,
        direct=(q.stride(-1) == 1 and _is_view(q, q_rows) and _is_view(indices, table)
                and not table_copy and not pages_copy),
        decode={})


def _is_view(t, shape) -> bool:
    """``t.reshape(shape)`` is a view (a function of t's shape and strides)."""
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


def sparse_fwd_kernel(q, k, v, indices, *, scale, sink, block_table=None, plan=None,
                      lse_contiguous=True):
    """The forward on the split-KV decode kernel (``kernels/decode.py``), no new kernel: each
    (batch, query row, kv head) is one "sequence" whose keys are its top-k list, read by the
    kernel as a table of one-row pages (``decode_fwd(token_table=...)``; through the cache's
    ``block_table`` when paged), and its query heads are the decode kernel's head group, so
    each gathered K/V row is read once for the whole group (MLA: 128 heads on one latent row,
    and ``v = k[..., :Dv]`` read once). An index outside the sequence's keys, -1, or on a
    page outside the cache is no key, never read. The sink is merged once afterwards.
    ``plan``: the call's :func:`_fwd_plan` (made here when None). ``lse_contiguous=False``
    (a caller that drops lse): lse is a transposed view of the kernel's ``(B, Sq, Hq)``, not
    a copy.

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q's dtype and ``lse (B, Hq, Sq)`` float32.
    """
    from ..kernels import decode as D
    from ..kernels import options

    plan = plan or _kernel_plan(q, k, v, indices, block_table)
    alias = v.data_ptr() == k.data_ptr()
    keep = plan.direct and sink is None and V.KEEP_PLANS
    if keep:
        # A repeated call: decode's plan for this call's metadata is kept in ours, and the
        # kernel needs only the tensors' addresses, which the views below would share.
        opts = options.current()
        sub = (scale, alias, (q.data_ptr() | k.data_ptr()) % 16 == 0, opts.pdl,
               opts.sm90_mla_decode)
        hit = plan.decode.get(sub)
        if hit is not None:
            # The kernel writes lse as (B, Sq, Hq); with one query row that memory is already
            # the (B, Hq, 1) we return, so it is allocated in that shape.
            b, sq, hq, _ = plan.out
            got = D.run_plan(hit[1], hit[0], q, k, v, None, indices, None, block_table,
                             options.allocator(opts), plan.out,
                             (b, hq, 1) if sq == 1 else plan.lse)
            if got is not None:
                out, lse = got
                return out, (lse if sq == 1 else _lse_rows(lse, lse_contiguous))
            plan.decode.clear()  # the Hopper kernel failed to compile (warned): plan again
    # The decode kernel's pages are single (token, kv head) rows: row r of kv head h is page
    # r * Hkv + h, r = b * Sk + j contiguous, or (page * page_size + j % page_size) paged.
    pages_k = k.reshape(plan.pages_k)
    # MLA (v = k[..., :Dv]) keeps v a view of the same pages, so the kernel reads the latent
    # row once; a reshape would give the size-1 dims other strides and hide that.
    if plan.same_strides and alias:
        pages_v = pages_k[..., :plan.dv]
    else:
        pages_v = v.reshape(plan.pages_v)
    # The kernel reads the indices themselves as its table: sequence (b, i, h) of the rows is
    # kv head h of batch b, key j its cache row r (b * Sk + j contiguous; through the block
    # table when paged), page r * Hkv + h; a position outside the sequence's keys, or on a
    # page outside the cache, is no key. No table is built, no length either (each list is
    # topk long).
    table = indices.reshape(plan.table)
    if plan.table_copy:
        table = table.contiguous()
    if block_table is not None and plan.pages_copy:
        block_table = block_table.contiguous()
    rows = q.reshape(plan.rows)
    kw = dict(cache_seqlens=None, block_table=table, token_table=plan.token_table,
              token_pages=block_table, left=None, right=None, softcap=0.0, scale=scale,
              sink=None, num_splits=0, out_dtype=torch.float32 if sink is not None else None)
    if keep:
        key, dplan, _ = D.find_plan(rows, pages_k, pages_v, **kw)
        if len(plan.decode) < 16:
            plan.decode[sub] = (key, dplan)
    out, lse = D.decode_fwd(rows, pages_k, pages_v, **kw)
    out = out.view(plan.out)
    lse = lse.view(plan.lse)
    if sink is not None:
        from .merge import merge_states_unchecked

        # Merged from float32 and rounded once (a second rounding doubled out's error).
        out, lse = merge_states_unchecked(out[None], lse[None], sink=sink)
        out = out.to(q.dtype)
    return out, _lse_rows(lse, lse_contiguous)


def _lse_rows(lse, contiguous):
    """The kernel's lse ``(B, Sq, Hq)`` as ``(B, Hq, Sq)``: a copy when ``contiguous``."""
    lse = lse.transpose(1, 2)
    return lse.contiguous() if contiguous else lse


def _kernel_ok(q, k, v, indices) -> bool:
    """The decode kernel takes the call: Triton device, head dims within its limit, page ids
    within int32, and K/V rows that flatten into pages without a copy (contiguous
    ``(B, Sk, Hkv, *)`` or paged ``(num_pages, page_size, Hkv, *)``: the same test)."""
    n0, n1, hkv = k.shape[:3]
    return (use_triton(q) and max(q.shape[-1], v.shape[-1]) <= V.MAX_HEAD_DIM_DECODE
            and 0 < n0 * n1 * hkv < 2**31 and indices.shape[-1] > 0 and q.numel() > 0
            and k.stride(1) == hkv * k.stride(2) and v.stride(1) == hkv * v.stride(2)
            and k.stride(0) == n1 * k.stride(1) and v.stride(0) == n1 * v.stride(1))


def _sparse_fwd(q, k, v, indices, sink, scale, key=None, lse_contiguous=True):
    """``(out, lse)`` of a dense-cache call on the path its plan chose. ``key``: the call's
    metadata key, which keeps its forward plan (None: made here); ``lse_contiguous``: as
    :func:`sparse_fwd_kernel`'s."""
    plan = _fwd_plan(q, k, v, indices, None, key)
    if plan.kernel_ok:
        return sparse_fwd_kernel(q, k, v, indices, scale=scale, sink=sink, plan=plan,
                                 lse_contiguous=lse_contiguous)
    return sparse_fwd_torch(q, k, v, indices, scale=scale, sink=sink)


def _sparse_bwd(dout, dlse, q, k, v, indices, out, lse, sink, scale):
    """``dq, dk, dv, dsink`` on the kernel or, in deterministic mode (the kernel scatters
    dK/dV with atomics: not bitwise repeatable) and above its head dims, the PyTorch path."""
    if (use_triton(q) and not torch.are_deterministic_algorithms_enabled()
            and max(q.shape[-1], v.shape[-1]) <= V.MAX_HEAD_DIM_PREFILL):
        from ..kernels.sparse import sparse_bwd

        return sparse_bwd(dout, dlse, q, k, v, indices, out, lse, scale=scale, sink=sink)
    return sparse_bwd_torch(dout, dlse, q, k, v, indices, out, lse, scale=scale, sink=sink)


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, sink, scale, key=None):
        out, lse = _sparse_fwd(q, k, v, indices, sink, scale, key)
        ctx.save_for_backward(q, k, v, indices, out, lse, sink)
        ctx.scale = scale
        ctx.mark_non_differentiable(indices)
        # This call's kernel options, for the backward (as AttentionFunction's).
        ctx.opts = options.captured()
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = run_backward("flashlse.sparse_attention", (q, k, v, sink),
                                         options.run_under, ctx.opts, _sparse_bwd, dout, dlse,
                                         q, k, v, indices, out, lse, sink, ctx.scale)
        return dq, dk, dv, None, dsink, None, None


# torch.compile sees the forward and backward as ops (fake kernels give their shapes).
@torch.library.custom_op("flashlse::sparse_fwd", mutates_args=())
def _sparse_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                   sink: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _sparse_fwd(q, k, v, indices, sink, scale)


@_sparse_fwd_op.register_fake
def _(q, k, v, indices, sink, scale):
    return fwd_fakes(q, v)


@torch.library.custom_op("flashlse::sparse_bwd", mutates_args=())
def _sparse_bwd_op(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   sink: torch.Tensor | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsink = _sparse_bwd(dout, dlse, q, k, v, indices, out, lse, sink, scale)
    return dq, dk, dv, op_dsink(q, dsink)


@_sparse_bwd_op.register_fake
def _(dout, dlse, q, k, v, indices, out, lse, sink, scale):
    return bwd_fakes(q, k, v, sink)


def _sparse_setup(ctx, inputs, output):
    q, k, v, indices, sink, scale = inputs
    ctx.save_for_backward(q, k, v, indices, output[0], output[1], sink)
    ctx.scale = scale


def _sparse_backward(ctx, dout, dlse):
    q, k, v, indices, out, lse, sink = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv, dsink = _sparse_bwd_op(dout, dlse, q, k, v, indices, out, lse, sink, ctx.scale)
    return dq, dk, dv, None, None if sink is None else dsink, None


_sparse_fwd_op.register_autograd(_sparse_backward, setup_context=_sparse_setup)


def _check_meta(q, k, v, indices, block_table):
    """:func:`sparse_attention`'s checks of types, dims, dtypes, devices and shapes."""
    for name, t, layout in (("q", q, "(B, Sq, Hq, D)"), ("k", k, "(B, Sk, Hkv, D)"),
                            ("v", v, "(B, Sk, Hkv, Dv)")):
        V.check_tensor(name, t, 4, layout)
        V.check_float(name, t)
    V.check_same({"q": q, "k": k, "v": v}, "dtype")
    V.check_same({"q": q, "k": k, "v": v}, "device")
    V.check_heads(q.shape[2], k.shape[2], v.shape[2])
    V.check_head_dim(q.shape[-1], v.shape[-1], False, 0)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share D, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in their first two dims, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if block_table is None and q.shape[0] != k.shape[0]:
        raise ValueError(f"q, k, v must share B: got q {tuple(q.shape)}, k {tuple(k.shape)}; "
                         f"for a paged cache pass block_table")
    V.check_int_tensor("indices", indices, "(B, Sq, Hkv, topk)", q.device, 4,
                       unit_stride=False)
    want = tuple(q.shape[:2]) + (k.shape[2],)
    if tuple(indices.shape[:3]) != want:
        raise ValueError(f"indices must be (B, Sq, Hkv, topk) with (B, Sq, Hkv) = {want}, got "
                         f"{tuple(indices.shape)}")
    if block_table is not None:
        V.check_int_tensor("block_table", block_table, "(B, max_pages)", q.device, 2,
                           unit_stride=False)
        if block_table.shape[0] != q.shape[0]:
            raise ValueError(f"block_table must have B = {q.shape[0]} rows, got "
                             f"{block_table.shape[0]}")


@on_tensor_device
def sparse_attention(q, k, v, indices, *, block_table=None, scale=None, sink=None,
                     return_lse=False):
    """``O_i = sum_{j in I_i} exp(S_ij - L_i) V_j``, ``L_i = log sum_{j in I_i} e^S_ij [+ e^sink]``.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)``.
        indices: ``(B, Sq, Hkv, topk)`` int32 key positions in ``[0, Sk)``, -1 = no key;
            the query heads of a kv head share its list. A repeated index counts each time.
        block_table: ``(B, max_pages)`` int32 with paged caches k ``(num_pages, page_size,
            Hkv, D)``, v ``(num_pages, page_size, Hkv, Dv)`` (vLLM's layout; v may be a view of
            k, MLA): indices are token positions of each sequence, key j of sequence b is row
            ``j % page_size`` of page ``block_table[b, j // page_size]``. Forward only
            (DeepSeek sparse decode and prefill over a serving cache).
        scale: default ``1/sqrt(D)``. sink: ``(Hq,)`` logits. return_lse: also return lse.

    Returns:
        ``out (B, Sq, Hq, Dv)``, and ``lse (B, Hq, Sq)`` float32 if ``return_lse``.
    """
    # Metadata checks: skipped for metadata that passed before (V.meta_key).
    key = V.meta_key("sparse", q, k, v, indices, block_table, sink)
    if not V.passed(key):
        _check_meta(q, k, v, indices, block_table)
        V.check_sink(sink, q.shape[2], q.device)
        V.remember(key)
    V.check_bool("return_lse", return_lse)
    if indices.numel() and V.values_checkable(indices):
        length = k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]
        if bool(((indices < -1) | (indices >= length)).any()):
            raise ValueError(f"indices must lie in [0, {length}) (the keys of a sequence) or "
                             f"be -1 (no key), got values in [{int(indices.min())}, "
                             f"{int(indices.max())}]")
    scale = V.check_scale(scale, q.shape[-1])
    if block_table is not None:
        return _sparse_paged(q, k, v, indices, block_table, scale, sink, return_lse, key)
    if torch.compiler.is_compiling():
        # An opaque op to the tracer (the launchers read addresses and keep plans), with its
        # backward registered.
        out, lse = _sparse_fwd_op(q, k, v, indices, sink, scale)
    elif V.needs_grad(q, k, v, sink):
        out, lse = SparseAttentionFunction.apply(q, k, v, indices, sink, scale, key)
    else:
        # Nothing to differentiate: the forward itself, without autograd.Function's cost
        # (and lse's copy to (B, Hq, Sq) only when it is returned).
        out, lse = _sparse_fwd(q, k, v, indices, sink, scale, key, lse_contiguous=return_lse)
    return (out, lse) if return_lse else out


def _sparse_paged(q, k_cache, v_cache, indices, block_table, scale, sink, return_lse, key=None):
    """Sparse attention over paged caches: the kernel reads the listed rows in place; the
    PyTorch path gathers each sequence's capacity first. Forward only. ``key``: the call's
    metadata key (its plan is kept by it)."""
    if V.needs_grad(q, k_cache, v_cache, sink):
        raise ValueError("sparse_attention with a block_table is forward only (serving); call "
                         "it under torch.no_grad()")
    if torch.compiler.is_compiling():
        out, lse = _sparse_paged_op(q, k_cache, v_cache, indices, block_table, sink, scale)
    else:
        out, lse = _paged_fwd(q, k_cache, v_cache, indices, block_table, scale, sink,
                              return_lse, key)
    return (out, lse) if return_lse else out


def _paged_fwd(q, k_cache, v_cache, indices, block_table, scale, sink, lse_contiguous=True,
               key=None):
    """``(out, lse)`` of a paged call (its metadata checked) on the path its plan chose,
    with the block table's values checked where they can be."""
    checked = V.values_checkable(block_table) and indices.numel()
    plan = _fwd_plan(q, k_cache, v_cache, indices, block_table, key)
    kernel = plan.kernel_ok
    if checked or not kernel:
        ok = _listed_ok(indices, k_cache, block_table)
    if checked:
        # The indices lie in [0, capacity) or are -1 (checked): a listed key that is not ok
        # sits on a page outside the cache.
        bad = (indices >= 0) & ~ok
        if bool(bad.any()):
            page_size = k_cache.shape[1]
            cols = indices[bad].long() // page_size
            rows_b = bad.nonzero()[:, 0]
            raise ValueError(f"block_table entries of listed keys must lie in "
                             f"[0, {k_cache.shape[0]}) (the number of pages), found "
                             f"{block_table[rows_b, cols][:4].tolist()}")
    if kernel:
        out, lse = sparse_fwd_kernel(q, k_cache, v_cache, indices, scale=scale, sink=sink,
                                     block_table=block_table, plan=plan,
                                     lse_contiguous=lse_contiguous)
    else:
        from ._paged import gather_pages

        b = q.shape[0]
        cap = block_table.shape[1] * k_cache.shape[1]
        lens = torch.full((b,), cap, dtype=torch.int32, device=q.device)
        k, v, _, _ = gather_pages(k_cache, v_cache, block_table, lens)
        k, v = k.view(b, cap, *k.shape[1:]), v.view(b, cap, *v.shape[1:])
        # A listed key on a page outside the cache is no key here too (checks off).
        out, lse = sparse_fwd_torch(q, k, v, torch.where(ok, indices, -1), scale=scale,
                                    sink=sink)
    return out, lse


@torch.library.custom_op("flashlse::sparse_fwd_paged", mutates_args=())
def _sparse_paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     indices: torch.Tensor, block_table: torch.Tensor, sink: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _paged_fwd(q, k_cache, v_cache, indices, block_table, scale, sink)


@_sparse_paged_op.register_fake
def _(q, k_cache, v_cache, indices, block_table, sink, scale):
    return fwd_fakes(q, v_cache)
