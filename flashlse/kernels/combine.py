"""Merge of attention states on the GPU: the split-KV combine and ``merge_states`` / ``merge``.

Derivation. A state ``(O_s, L_s)`` stands for the partial sum ``Z_s = e^(L_s)`` and the
unnormalised output ``Z_s O_s`` (docs/design.md §1). Merging N states (and an optional sink,
one more "key" with logit ``sink`` and value 0) adds the partial sums:

    Z = sum_s e^(L_s) [+ e^sink]        O = sum_s (e^(L_s) / Z) O_s        L = log Z

Evaluated with a pivot so that nothing overflows, as the FA-3/CuTe combine does:

    m       = max(max_s L_s, sink)              raw; -inf when every state is empty
    pivot   = 0 if m == -inf else m             keeps L_s - pivot free of -inf - -inf
    w_s     = e^(L_s - pivot)                   in [0, 1]; the largest is 1
    sum     = sum_s w_s [+ e^(sink - pivot)]    >= 1 unless every state is empty
    inv_sum = 0 if sum == 0 else 1 / sum
    O       = inv_sum * sum_s w_s O_s
    L       = log(sum) + m                      log(0) + -inf = -inf for all-empty

``L`` is never a denominator, so two empty states merge to ``(0, -inf)`` and never NaN.
A state of weight ``w_s == 0`` is never read: its ``O_s`` load is masked off, so it may
hold garbage, NaN, or nothing at all (an empty split need not write its output).

Layout. The leading dims ``...`` of ``outs (N, ..., D)`` are flattened by index math, not
by copies: the launcher coalesces them, jointly for every tensor involved (outs, lses,
sink, out, lse_out), into at most three dims ``(R0, R1, R2)`` with one stride per dim
and tensor, so strided views (a transposed lse, a sink broadcast with stride 0, the
``(B, Hq, Sq)`` lse of decode written through its ``(B, Sq, Hq)`` transpose) cost
nothing. Only layouts that do not coalesce to three dims are copied.

Schedule. One program per ``[BLOCK_R rows, BLOCK_D columns]`` tile of the output, whole
rows of up to 512 columns, so that each state's piece is one contiguous run of memory. It
reads the rows' lses once for the maximum, then walks the states BLOCK_S at a time,
unrolled, so that the loads of several states are in flight together and the sum over
states stays in each thread's registers; small tiles (the split-KV combine: few rows,
many states) unroll more states per step, since each step costs one memory latency.
When ``lse_out`` aliases ``lses`` (the in-place two-state merge) a program covers all of
D, so no other program still reads the lses it overwrites.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from . import configs
from ._common import LOG2E, Launch, cdiv, contiguous_strides, positional

# constexpr globals: jit functions may read only those.


@triton.jit
def _state(base, base_b, i_s, j, N, stride_s, m_r, PAIR: tl.constexpr):
    """State ``i_s + j``'s address and which rows it has: ``base`` plus ``i_s + j`` state
    strides, or with ``PAIR`` (two states at two addresses, ``merge``'s; one step of two)
    ``base`` for state 0 and ``base_b`` for state 1."""
    if PAIR:
        return base if j == 0 else base_b, m_r
    return base + tl.cast(i_s + j, tl.int64) * stride_s, m_r & (i_s + j < N)


@triton.jit
def _merge_max_step(b_m, lses, lses_b, i_s, N, o_l, m_r, stride_ls, BLOCK_S: tl.constexpr,
                    PAIR: tl.constexpr):
    """``max(b_m, max_s L_s)`` over states ``[i_s, i_s + BLOCK_S)``."""
    for j in tl.static_range(BLOCK_S):
        p_l, m_s = _state(lses, lses_b, i_s, j, N, stride_ls, m_r, PAIR)
        # [BLOCK_R]
        b_l = tl.load(p_l + o_l, mask=m_s, other=float("-inf"))
        b_m = tl.maximum(b_m, b_l)
    return b_m


@triton.jit
def _merge_sum_step(b_acc, b_sum, outs, lses, outs_b, lses_b, i_s, N, o_l, o_o, o_d, m_r, m_d,
                    b_pivot, stride_ls, stride_os, stride_od, BLOCK_S: tl.constexpr,
                    PAIR: tl.constexpr):
    """Adds ``w_s`` and ``w_s O_s`` of states ``[i_s, i_s + BLOCK_S)``; ``w_s == 0`` is not loaded.

    The states are unrolled, not a third tensor dim: their loads are independent (all in
    flight at once) and the sum over states stays inside each thread's registers. The
    difference ``L_s - pivot`` is taken before the scale to base 2, not fused with it
    (``L_s * LOG2E - pivot * LOG2E`` is contracted to an FMA on the GPU, whose unrounded
    product leaves ~1e-7 where ``L_s == pivot``): the largest weight is exactly 1, so a
    state merged with empty ones, or a sink with empty states, keeps its lse bit for bit.
    """
    for j in tl.static_range(BLOCK_S):
        p_l, m_s = _state(lses, lses_b, i_s, j, N, stride_ls, m_r, PAIR)
        b_l = tl.load(p_l + o_l, mask=m_s, other=float("-inf"))
        # [BLOCK_R]
        b_w = tl.exp2((b_l - b_pivot) * LOG2E)
        # [BLOCK_R, BLOCK_D]
        p_s, _ = _state(outs, outs_b, i_s, j, N, stride_os, m_r, PAIR)
        p_o = p_s + o_o[:, None] + o_d[None, :] * stride_od
        b_o = tl.load(p_o, mask=(b_w > 0)[:, None] & m_d[None, :], other=0.0)
        b_acc += b_w[:, None] * b_o.to(tl.float32)
        b_sum += b_w
    return b_acc, b_sum


@triton.jit
def _merge_finish(b_acc, b_sum, b_sink, b_pivot, HAS_SINK: tl.constexpr):
    """The merge's last step: the sink's weight added to the sum, ``O = acc / sum`` (0 for an
    all-empty row: ``sum == 0``). Returns ``(O, sum)``; ``L = log(sum) + m``."""
    if HAS_SINK:
        b_sum += tl.exp2((b_sink - b_pivot) * LOG2E)
    b_inv_sum = tl.where(b_sum == 0, 0.0, 1.0 / b_sum)
    return b_acc * b_inv_sum[:, None], b_sum


@triton.jit
def _tile_rows(i_r, R, R1, R2, BLOCK_R: tl.constexpr):
    """``(o_rows, m_r)``: rows ``[i_r * BLOCK_R, (i_r + 1) * BLOCK_R)`` of the flattened
    leading dims as ``(r0, r1, r2)`` index blocks, and which rows exist (``< R``). int64, so
    that the offsets of multi-gigabyte tensors do not wrap."""
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    o_r64 = o_r.to(tl.int64)
    o_r2 = o_r64 % R2
    o_r1 = (o_r64 // R2) % R1
    o_r0 = o_r64 // (R2 * R1)
    return (o_r0, o_r1, o_r2), m_r


@triton.jit
def _row_offset(o_rows, stride):
    """``[BLOCK_R]`` offsets of the rows ``o_rows`` (``_tile_rows``) in a tensor whose leading
    dims have the strides ``stride`` (one per index)."""
    return o_rows[0] * stride[0] + o_rows[1] * stride[1] + o_rows[2] * stride[2]


@triton.jit
def _merge_states_fwd_kernel(
    outs,
    lses,
    sink,
    out,
    lse,
    outs_b,
    lses_b,
    N,
    R,
    R1,
    R2,
    stride_os, stride_o, stride_od,
    stride_ls, stride_l,
    stride_k,
    stride_y, stride_yd,
    stride_z,
    D: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    PAIR: tl.constexpr,
):
    if PDL:
        # Launched early behind the split-KV kernel (programmatic dependent launch): wait
        # here until its partial states are complete and visible.
        gdc_wait()
    i_r = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_rows, m_r = _tile_rows(i_r, R, R1, R2, BLOCK_R)
    # [BLOCK_R]
    o_l = _row_offset(o_rows, stride_l)
    o_o = _row_offset(o_rows, stride_o)

    # Pass 1: the raw maximum over the states (and the sink). Reading lse twice costs
    # 1/D of the outs traffic and keeps no per-state array in registers.
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for i_s in tl.range(0, N, BLOCK_S):
        b_m = _merge_max_step(b_m, lses, lses_b, i_s, N, o_l, m_r, stride_ls, BLOCK_S, PAIR)
    if HAS_SINK:
        b_sink = tl.load(sink + _row_offset(o_rows, stride_k), mask=m_r, other=float("-inf"))
        b_m = tl.maximum(b_m, b_sink)
    # The pivot stays finite, so L_s - pivot is never -inf - -inf.
    b_pivot = tl.where(b_m == float("-inf"), 0.0, b_m)

    # Pass 2: weights and the weighted sum; a zero-weight state's O_s is never loaded.
    b_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    # [BLOCK_R, BLOCK_D]
    b_acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for i_s in tl.range(0, N, BLOCK_S):
        b_acc, b_sum = _merge_sum_step(b_acc, b_sum, outs, lses, outs_b, lses_b, i_s, N, o_l, o_o, o_d, m_r, m_d, b_pivot, stride_ls, stride_os, stride_od, BLOCK_S, PAIR)
    if not HAS_SINK:
        b_sink = b_pivot
    b_acc, b_sum = _merge_finish(b_acc, b_sum, b_sink, b_pivot, HAS_SINK)

    p_y = out + _row_offset(o_rows, stride_y)[:, None] + o_d[None, :] * stride_yd
    tl.store(p_y, b_acc.to(p_y.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    if i_d == 0:
        # Raw m: log(0) + -inf = -inf for an all-empty row with no sink.
        b_lse = tl.log(b_sum) + b_m
        tl.store(lse + _row_offset(o_rows, stride_z), b_lse, mask=m_r)


def _coalesce(shape, strides_list):
    """Merges adjacent leading dims that every tensor walks with one stride.

    Args:
        shape: the leading shape ``(...)``.
        strides_list: per tensor, its strides over ``shape``.

    Returns:
        ``(sizes, strides_per_tensor)`` with size-1 dims dropped and mergeable dims fused.
    """
    sizes, strides = [], [[] for _ in strides_list]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        if sizes and all(st[-1] == t[i] * n for st, t in zip(strides, strides_list)):
            sizes[-1] *= n
            for st, t in zip(strides, strides_list):
                st[-1] = t[i]
            continue
        sizes.append(n)
        for st, t in zip(strides, strides_list):
            st.append(t[i])
    return sizes, strides


def _num_sms(device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    # The interpreter runs programs one after another: fewer, larger programs are faster.
    return 1


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fresh_plan(outs, lses, sink=None):
    """:func:`merge_states_fwd`'s plan for fresh contiguous outputs, from ``_PLANS`` by the
    inputs' metadata or made and kept there: a :func:`merge_plan` launch, or ``_EMPTY`` /
    ``_COPY`` (nothing to launch / contiguous copies first). ``fresh_run`` launches a launch
    plan on another call of the same metadata."""
    key = (outs.shape, outs.stride(), outs.dtype, outs.device, lses.shape, lses.stride(),
           None if sink is None else (sink.shape, sink.stride()))
    lead = tuple(outs.shape[1:-1])
    return _kept_plan(key, lambda: _states_plan(
        outs, lses, sink, lead, contiguous_strides(lead + (outs.shape[-1],)),
        contiguous_strides(lead), False))


def _kept_plan(key, make):
    """The plan kept in ``_PLANS`` under ``key``, or ``make()``'s, kept there."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = make()
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def given_plan(outs, lses, sink, out, lse_out):
    """:func:`merge_states_fwd`'s plan into the given ``out`` and ``lse_out``, from ``_PLANS``
    by every tensor's metadata (and whether lse_out aliases lses) or made and kept there: a
    repeated call (the key-split merge of every split forward, an engine's merge of each
    step) finds its launch, whose compiled kernel is kept, instead of planning one and
    launching it through Triton's JIT path (~100 µs of host time on the H200's host)."""
    alias = _shares_memory(lse_out, lses)
    key = ("given", outs.shape, outs.stride(), outs.dtype, outs.device, lses.shape,
           lses.stride(), None if sink is None else (sink.shape, sink.stride()), out.shape,
           out.stride(), out.dtype, lse_out.shape, lse_out.stride(), alias)
    return _kept_plan(key, lambda: _states_plan(outs, lses, sink, tuple(outs.shape[1:-1]),
                                                out.stride(), lse_out.stride(), alias))


def fresh_run(plan, outs, lses, out_shape: tuple, lse_shape: tuple, sink=None):
    """Allocates ``out`` and ``lse`` (the states' rows as ``out_shape`` / ``lse_shape``) and
    launches a :func:`fresh_plan` plan other than ``_COPY`` on states of the metadata it was
    made for."""
    out = torch.empty(out_shape, dtype=outs.dtype, device=outs.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=outs.device)
    if plan is not _EMPTY:
        merge_run(plan, outs, lses, sink, out, lse)
    return out, lse


def merge_states_fwd(outs, lses, *, sink=None, out=None, lse_out=None):
    """``L = log(sum_s e^(L_s) [+ e^sink])``, ``O = sum_s e^(L_s - L) O_s``, one kernel.

    Any strides are accepted (see the module header); the inputs are not modified unless
    ``out``/``lse_out`` alias them: ``out = outs[0]``, ``lse_out = lses[0]`` is the
    in-place two-state ``merge`` (each element is read before its program writes it).

    Args:
        outs: ``(N, ..., D)`` fp16, bf16 or fp32, ``D <= 512``; zero-weight states unread.
        lses: ``(N, ...)`` float32, natural log, ``lses.shape == outs.shape[:-1]``.
        sink: float32 logits broadcastable to ``lses.shape[1:]``, or None.
        out: optional ``(..., D)`` output (any float dtype, any strides).
        lse_out: optional ``(...)`` float32 output (any strides).

    Returns:
        ``(out (..., D), lse (...))``: ``out`` in ``outs.dtype`` (or ``out``'s), ``lse`` float32.
    """
    d = outs.shape[-1]
    lead = tuple(outs.shape[1:-1])
    if out is None and lse_out is None:
        # Fresh contiguous outputs: the launch plan is a function of the inputs' metadata,
        # found in _PLANS on a repeated call (the sink's view broadcast to the rows has the
        # sink's address: the kernel takes the sink itself).
        plan = fresh_plan(outs, lses, sink)
        if plan is not _COPY:
            return fresh_run(plan, outs, lses, lead + (d,), lead, sink)
        out = torch.empty(lead + (d,), dtype=outs.dtype, device=outs.device)
        lse_out = torch.empty(lead, dtype=torch.float32, device=outs.device)
    else:
        if out is None:
            out = torch.empty(lead + (d,), dtype=outs.dtype, device=outs.device)
        if lse_out is None:
            lse_out = torch.empty(lead, dtype=torch.float32, device=outs.device)
        plan = given_plan(outs, lses, sink, out, lse_out)
        if plan is _EMPTY:
            return out, lse_out
        if plan is not _COPY:
            merge_run(plan, outs, lses, sink, out, lse_out)
            return out, lse_out
    # No index math for this layout: merge contiguous copies and copy the result back.
    out_c, lse_c = merge_states_fwd(
        outs.contiguous(),
        lses.contiguous(),
        sink=None if sink is None else torch.broadcast_to(sink, lead).contiguous(),
    )
    out.copy_(out_c)
    lse_out.copy_(lse_c)
    return out, lse_out


def pair_plan(out_a, lse_a, out_b, lse_b):
    """The merge of two states ``(out_a, lse_a)`` and ``(out_b, lse_b)`` (``(..., D)`` and
    float32 ``(...)`` each) read where they are (``merge``'s: stacking them first would
    write and read both once more, 7 passes over a state's bytes instead of 3) into fresh
    contiguous outputs: its plan from ``_PLANS`` by the four tensors' metadata or made and
    kept there, a ``pair`` launch (:func:`pair_run`), ``_EMPTY``, or ``_COPY`` where the two
    states' strides or dtypes differ or the layout does not coalesce (stack them)."""
    key = ("pair", out_a.shape, out_a.stride(), out_a.dtype, out_a.device, lse_a.shape,
           lse_a.stride(), out_b.stride(), out_b.dtype, lse_b.stride(), lse_b.dtype)
    def make():
        if (out_b.stride(), out_b.dtype, lse_b.stride()) != (out_a.stride(), out_a.dtype,
                                                             lse_a.stride()):
            return _COPY
        lead = tuple(out_a.shape[:-1])
        return _states_plan(out_a.unsqueeze(0), lse_a.unsqueeze(0), None, lead,
                            contiguous_strides(lead + (out_a.shape[-1],)),
                            contiguous_strides(lead), False, pair=True)

    return _kept_plan(key, make)


def pair_run(plan, out_a, lse_a, out_b, lse_b):
    """Allocates ``out`` and ``lse`` (contiguous, as the plan writes them: ``lse_a`` is
    float32 of ``out_a.shape[:-1]``) and launches a :func:`pair_plan` plan other than
    ``_COPY`` on two states of the metadata it was made for."""
    # (empty_like costs half of torch.empty with a shape, dtype and device on the host.)
    out = torch.empty_like(out_a, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse_a, memory_format=torch.contiguous_format)
    if plan is not _EMPTY:
        merge_run(plan, out_a, lse_a, None, out, lse, out_b, lse_b)
    return out, lse


# Launch plans of merge_states_fwd by input metadata; cleared when full.
_PLANS: dict = {}
_MAX_PLANS = 4096
# Plans that launch nothing: no rows, or a layout that does not coalesce to three dims.
_EMPTY, _COPY = object(), object()


def _states_plan(outs, lses, sink, lead, st_out, st_lse, alias, pair=False):
    """merge_states_fwd's launch plan for outputs of strides ``st_out`` / ``st_lse``, or
    ``_EMPTY`` (no rows) / ``_COPY`` (the layout does not coalesce to three dims). ``pair``:
    ``outs`` / ``lses`` are the first of two states at two addresses (``(1, ..., D)``
    views), the second of the same strides (:func:`pair_plan`)."""
    r = 1
    for size in lead:
        r *= size
    if r == 0:
        return _EMPTY
    sink_b = None if sink is None else torch.broadcast_to(sink, lead)
    tensors = [outs.stride()[1:-1], lses.stride()[1:], tuple(st_out)[:-1], tuple(st_lse)]
    if sink_b is not None:
        tensors.append(sink_b.stride())
    sizes, strides = _coalesce(lead, tensors)
    if len(sizes) > 3:
        return _COPY
    pad = 3 - len(sizes)
    sizes = [1] * pad + sizes
    strides = [[0] * pad + st for st in strides]
    st_k = strides[4] if sink_b is not None else [0, 0, 0]
    return merge_plan(2 if pair else outs.shape[0], outs.shape[-1], outs.device,
                      sink is not None, pair=pair, r=r,
                      r1=sizes[1], r2=sizes[2], st_os=outs.stride(0), st_o=strides[0],
                      st_od=outs.stride(-1), st_ls=lses.stride(0), st_l=strides[1], st_k=st_k,
                      st_y=strides[2], st_yd=st_out[-1], st_z=strides[3], alias=alias)


def merge_plan(n, d, device, has_sink, *, r, r1, r2, st_os, st_o, st_od, st_ls, st_l, st_k,
               st_y, st_yd, st_z, alias=False, pdl=False, pair=False) -> Launch:
    """The merge of ``n`` states of ``d`` columns over ``r`` rows indexed ``(r0, r1, r2)``,
    one stride per index and tensor (``st_*``, three each) for outs, lses, sink, out and
    lse_out (``st_os`` / ``st_ls`` the state strides, ``st_od`` / ``st_yd`` the columns').
    ``kernels.decode`` plans it with the layout of its split partials, with ``pdl=True``
    (sm90+, not the interpreter) to launch it while the decode kernel runs. ``pair``: two
    states at two addresses of the same strides (:func:`pair_plan`; ``n == 2``, the
    state strides unused)."""
    cfg = configs.merge_config(n, r, d, alias, _num_sms(device))
    grid = (cdiv(r, cfg.block_m), cdiv(max(d, 1), cfg.block_d))
    kw = dict(
        N=n,
        R=r,
        R1=r1,
        R2=r2,
        stride_os=st_os, stride_o=tuple(st_o), stride_od=st_od,
        stride_ls=st_ls, stride_l=tuple(st_l),
        stride_k=tuple(st_k),
        stride_y=tuple(st_y), stride_yd=st_yd,
        stride_z=tuple(st_z),
        D=d,
        HAS_SINK=has_sink,
        BLOCK_S=cfg.block_n,
        BLOCK_R=cfg.block_m,
        BLOCK_D=cfg.block_d,
        PDL=pdl,
        PAIR=pair,
        **cfg.launch(),
    )
    if pdl:
        kw["launch_pdl"] = True
    return Launch(_merge_states_fwd_kernel, grid, *positional(_merge_states_fwd_kernel, 7, kw))


def merge_run(plan: Launch, outs, lses, sink, out, lse_out, outs_b=None, lses_b=None) -> None:
    """Launches a :func:`merge_plan` on these tensors (a ``pair`` plan: state 0 in ``outs`` /
    ``lses``, state 1 in ``outs_b`` / ``lses_b``); no checks."""
    plan(outs, lses, lses if sink is None else sink, out, lse_out,
         outs if outs_b is None else outs_b, lses if lses_b is None else lses_b)
