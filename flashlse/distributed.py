"""Context parallel on torch.distributed: ring attention, and merging states across ranks.

Both functions rest on the merge monoid of docs/design.md §1: attention over a sequence is the
merge of the partial states ``(O_s, L_s)`` of its key blocks, in any order, with
``(0, -inf)`` for a block a row cannot see; the sink is one more state ``(0, sink)``,
merged once at the end. Nothing here uses the LSE as a denominator, so empty shards,
fully masked blocks and rows that see no key give ``(0, -inf)``, never NaN.

Layouts. One sequence of ``S`` tokens is sharded over the ``R`` ranks of a group; rank r
holds ``n_r`` tokens (any ``n_r >= 0``), every rank learns all ``n_r`` by one all-gather.
``contiguous``: rank r holds positions ``[sum_{s<r} n_s, ... + n_r)``. ``zigzag`` (the
load-balanced causal layout): the sequence is cut into 2R chunks, rank r holds chunk r
(its first ``ceil(n_r / 2)`` tokens) and chunk ``2R-1-r`` (the rest), so under a causal
mask every rank does the same work. :func:`split_sequence` / :func:`gather_sequence`
produce and invert both layouts.

Masks use GLOBAL positions: the whole sequence has ``Sq == Sk``, so row i sees key j iff
``i - left <= j <= i + right``. A (query piece, key piece) pair of a step is handed to the
dense bottom-right aligned op after trimming both pieces to the rows and keys that can
meet: for queries ``[q_lo, q_hi)`` and keys ``[k_lo, k_hi)`` the local windows
``left' = left + k_hi - q_hi`` and ``right' = right + q_hi - k_hi`` describe the same mask,
and trimming keys to ``k_hi <= q_hi + right`` and queries to ``q_hi <= k_hi + left`` keeps
both ``>= 0`` (the ops' window convention: negative means unbounded). Pairs with nothing
visible are skipped: no compute, the ring still moves.

Forward ring (R steps): at step t rank r holds the K/V block of rank ``r - t``; it posts the
send of that block to ``r + 1`` and the receive of block ``r - t - 1`` from ``r - 1``
(``batch_isend_irecv``), computes its queries against the block it holds, merges the
partial state into the running one, then waits. K and V travel packed in one buffer.

Backward ring. With the final ``L`` and ``D_i = rowsum(dO_i * O_i) - dL_i`` every block's
gradient is local to the block: ``P = exp(S - L)``, ``dS = P * (dO V^T - D)``,
``dQ += dS K``, ``dK_block += dS^T Q``, ``dV_block += P^T dO``. K/V travel as in the
forward; each block's dK/dV accumulator (float32) travels one hop behind it: received
from ``r - 1`` (which added its part one step earlier), increased by rank r's part, sent on
to ``r + 1``. After R hops it is home. ``dsink_h = -sum_i exp(sink_h - L_i) D_i`` over the
local rows, summed over the group.

Gradient of the merge across ranks. ``L = log(sum_s e^{L_s} [+ e^{sink}])``,
``O = sum_s w_s O_s`` with ``w_s = exp(L_s - L)``. Then

    dO_s = w_s dO        dL_s = w_s (dL + <dO, O_s - O>)      dsink = w_sink (dL - <dO, O>)

which needs only the rank's own state, the merged state and the merged gradient: no
communication when every rank holds the same merged gradient. ``w_s = 0`` (an empty state,
or everything empty) gives zero gradients; ``exp(L_s - L)`` uses ``L = -inf -> 0`` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import options
from .lse import safe_pivot
from .ops._dispatch import compute_dtype, on_tensor_device, use_triton
from .ops.attention import (
    _dsink,
    attn_bwd,
    attn_fwd,
    bwd_fakes,
    fwd_fakes,
    op_dsink,
    run_backward,
    validate_attention_args,
)
from .ops.merge import merge_states_unchecked, validate_states

LAYOUTS = ("contiguous", "zigzag")
SINK_GRADS = ("sum", "local")

# A piece of the sequence held by one rank: (local start, global start, length).
Segment = tuple[int, int, int]
# One dense call of a step: local query rows [q0, q1), visiting keys [k0, k1), windows.
Call = tuple[int, int, int, int, "int | None", "int | None"]


def shard_segments(lengths: Sequence[int], layout: str = "contiguous") -> list[list[Segment]]:
    """Where every rank's tokens sit in the sequence.

    Args:
        lengths: ``n_r`` for each rank of the group, in rank order (0 allowed).
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        For each rank, its pieces as ``(local_start, global_start, length)``, empty pieces
        left out; a rank's local tokens are its pieces in this order.
    """
    _check_layout(layout)
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"shard lengths must be >= 0, got {lengths}")
    if layout == "contiguous":
        starts = [sum(lengths[:r]) for r in range(len(lengths))]
        return [[(0, g, n)] if n else [] for g, n in zip(starts, lengths)]
    first = [(n + 1) // 2 for n in lengths]
    second = [n - a for n, a in zip(lengths, first)]
    segs = []
    for r in range(len(lengths)):
        g_first = sum(first[:r])
        # Chunk 2R-1-r: after all first pieces and the second pieces of the ranks above r.
        g_second = sum(first) + sum(second[r + 1:])
        pieces = [(0, g_first, first[r]), (first[r], g_second, second[r])]
        segs.append([p for p in pieces if p[2] > 0])
    return segs


def _even_lengths(total: int, world_size: int, layout: str) -> list[int]:
    if layout == "contiguous":
        return [len(c) for c in torch.arange(total).tensor_split(world_size)]
    chunks = [len(c) for c in torch.arange(total).tensor_split(2 * world_size)]
    return [chunks[r] + chunks[2 * world_size - 1 - r] for r in range(world_size)]


def split_sequence(x: torch.Tensor, sizes: int | Sequence[int], *, layout: str = "contiguous",
                   dim: int = 1) -> list[torch.Tensor]:
    """Cuts one sequence into the shards of :func:`ring_attention`.

    Args:
        x: a tensor with the sequence along ``dim``, e.g. ``(B, S, H, D)``.
        sizes: the world size (as even a split as possible), or every rank's ``n_r``.
        layout: ``"contiguous"`` or ``"zigzag"``.

    Returns:
        One shard per rank, ``x`` with ``n_r`` tokens along ``dim``.
    """
    total = x.shape[dim]
    lengths = _even_lengths(total, sizes, layout) if isinstance(sizes, int) else list(sizes)
    if sum(lengths) != total:
        raise ValueError(f"shard lengths {lengths} sum to {sum(lengths)}, the sequence has "
                         f"{total} tokens along dim {dim}")
    return [torch.cat([x.narrow(dim, g, n) for _, g, n in segs], dim) if segs
            else x.narrow(dim, 0, 0)
            for segs in shard_segments(lengths, layout)]


def gather_sequence(shards: Sequence[torch.Tensor], *, layout: str = "contiguous",
                    dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: the shards of all ranks -> the whole sequence."""
    segs = shard_segments([s.shape[dim] for s in shards], layout)
    pieces = sorted((g, shard.narrow(dim, lo, n)) for shard, seg in zip(shards, segs)
                    for lo, g, n in seg)
    if not pieces:
        return shards[0]
    return torch.cat([p for _, p in pieces], dim)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}; 'zigzag' balances "
                         f"causal work (rank r holds chunks r and 2R-1-r of 2R)")


def _pair(qs: Segment, ks: Segment, left, right) -> Call | None:
    """The trimmed dense call of local query piece ``qs`` against visiting key piece ``ks``."""
    lq, gq, nq = qs
    lk, gk, nk = ks
    k_lo, k_hi, q_lo, q_hi = gk, gk + nk, gq, gq + nq
    if right is not None:
        k_hi = min(k_hi, q_hi + right)
    if left is not None:
        k_lo = max(k_lo, q_lo - left)
    if right is not None:
        q_lo = max(q_lo, k_lo - right)
    if left is not None:
        q_hi = min(q_hi, k_hi + left)
    if q_hi <= q_lo or k_hi <= k_lo:
        return None
    # A side whose bound no (row, key) of the rectangle reaches needs no mask.
    lw = None if left is None or q_hi - 1 - left <= k_lo else left + k_hi - q_hi
    rw = None if right is None or k_hi - 1 <= q_lo + right else right + q_hi - k_hi
    return (lq + q_lo - gq, lq + q_hi - gq, lk + k_lo - gk, lk + k_hi - gk, lw, rw)


def _coalesce(calls: list[Call]) -> list[Call]:
    """Joins unmasked calls that share their rows (or keys) and touch in the local buffers."""
    calls = list(calls)
    while True:
        for i, a in enumerate(calls):
            for j, b in enumerate(calls):
                if i == j or a[4:] != (None, None) or b[4:] != (None, None):
                    continue
                if a[:2] == b[:2] and a[3] == b[2]:
                    c = (a[0], a[1], a[2], b[3], None, None)
                elif a[2:4] == b[2:4] and a[1] == b[0]:
                    c = (a[0], b[1], a[2], a[3], None, None)
                else:
                    continue
                calls = [x for t, x in enumerate(calls) if t not in (i, j)] + [c]
                break
            else:
                continue
            break
        else:
            return sorted(calls)


def plan_step(q_segs: list[Segment], k_segs: list[Segment], left, right) -> list[Call]:
    """The dense calls of one ring step: ``(q0, q1, k0, k1, left, right)`` in local indices."""
    n_q = sum(s[2] for s in q_segs)
    if q_segs == k_segs and n_q and left is None and right == 0:
        # Own block, causal: local order is global order, so it is one causal call.
        return [(0, n_q, 0, n_q, None, 0)]
    calls = [c for qs in q_segs for ks in k_segs if (c := _pair(qs, ks, left, right))]
    return _coalesce(calls)


@dataclass
class _Ring:
    group: object
    rank: int
    world: int
    prev: int
    next: int
    lengths: list[int]
    plans: list[list[Call]]
    softcap: float
    scale: float
    sink_grad: str


def _group_ranks(group):
    g = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    return (rank, world, dist.get_global_rank(g, (rank - 1) % world),
            dist.get_global_rank(g, (rank + 1) % world))


def _exchange(send: torch.Tensor | None, recv: torch.Tensor | None, ring: _Ring):
    """Posts one send to the next rank and one receive from the previous one."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, ring.next, ring.group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, ring.prev, ring.group))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def _ring_steps(held: torch.Tensor, ring: _Ring, per_token: int):
    """Yields ``(t, src, nxt, block)`` for each ring step: ``block`` holds rank ``src``'s
    K/V, and the transfer of the next block (rank ``nxt``'s) is already posted, so it
    overlaps whatever the caller does with this one before asking for the next step."""
    for t in range(ring.world):
        src = (ring.rank - t) % ring.world
        nxt = (ring.rank - t - 1) % ring.world
        reqs, incoming = [], None
        if t < ring.world - 1:
            if ring.lengths[nxt]:
                incoming = held.new_empty(ring.lengths[nxt] * per_token)
            reqs = _exchange(held if ring.lengths[src] else None, incoming, ring)
        yield t, src, nxt, held
        _wait(reqs)
        if incoming is not None:
            held = incoming


def _unpack(buf: torch.Tensor, b: int, n: int, hkv: int, d: int, dv: int):
    nk = b * n * hkv * d
    return buf[:nk].view(b, n, hkv, d), buf[nk:].view(b, n, hkv, dv)


def _ring_fwd(q, k, v, sink, ring: _Ring):
    b, n, hq, _ = q.shape
    hkv, d, dv = k.shape[2], k.shape[3], v.shape[3]
    dt = compute_dtype(q.dtype)
    acc_out = torch.zeros(b, n, hq, dv, dtype=dt, device=q.device)
    acc_lse = torch.full((b, n, hq), float("-inf"), dtype=dt, device=q.device)
    own = torch.cat([k.reshape(-1), v.reshape(-1)])
    for _, src, _, held in _ring_steps(own, ring, b * hkv * (d + dv)):
        if ring.plans[src]:
            kb, vb = _unpack(held, b, ring.lengths[src], hkv, d, dv)
        for q0, q1, k0, k1, lw, rw in ring.plans[src]:
            o, l = attn_fwd(q[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1], left=lw, right=rw,
                            softcap=ring.softcap, scale=ring.scale, sink=None)
            merged = merge_states_unchecked(torch.stack([acc_out[:, q0:q1], o.to(dt)]),
                                  torch.stack([acc_lse[:, q0:q1], l.transpose(1, 2).to(dt)]))
            acc_out[:, q0:q1], acc_lse[:, q0:q1] = merged
    if sink is not None:
        acc_out, acc_lse = merge_states_unchecked(acc_out[None], acc_lse[None], sink=sink)
    return acc_out.to(q.dtype), acc_lse.transpose(1, 2).contiguous().to(dt)


def _ring_bwd(dout, dlse, q, k, v, out, lse, sink, ring: _Ring):
    b, n, hq, _ = q.shape
    hkv, d, dv = k.shape[2], k.shape[3], v.shape[3]
    dt = compute_dtype(q.dtype)
    # The PyTorch backward computes in dt anyway, so casting once keeps every partial in dt;
    # the Triton backward takes the input dtype and accumulates in float32 itself.
    cast = (lambda x: x) if use_triton(q) else (lambda x: x.to(dt))
    qc, doc, oc = cast(q), cast(dout), cast(out)
    # dlse None: no lse gradient (a loss on out alone), so the steps' backwards take the
    # fast forms that have none (the CPU path's torch kernel; the kernels skip its load).
    dlse = None if dlse is None else dlse.to(dt)
    dq = torch.zeros(b, n, hq, d, dtype=dt, device=q.device)
    own = torch.cat([k.reshape(-1), v.reshape(-1)])
    acc, acc_reqs = None, []
    for t, src, nxt, held in _ring_steps(own, ring, b * hkv * (d + dv)):
        part = None
        if ring.plans[src]:
            m = ring.lengths[src]
            kb, vb = (cast(x) for x in _unpack(held, b, m, hkv, d, dv))
            part = torch.zeros(b * m * hkv * (d + dv), dtype=dt, device=q.device)
            dkb, dvb = _unpack(part, b, m, hkv, d, dv)
        for q0, q1, k0, k1, lw, rw in ring.plans[src]:
            dq_c, dk_c, dv_c, _ = attn_bwd(
                doc[:, q0:q1], None if dlse is None else dlse[:, :, q0:q1], qc[:, q0:q1],
                kb[:, k0:k1], vb[:, k0:k1], oc[:, q0:q1], lse[:, :, q0:q1], left=lw,
                right=rw, softcap=ring.softcap, scale=ring.scale, sink=None)
            dq[:, q0:q1] += dq_c
            dkb[:, k0:k1] += dk_c
            dvb[:, k0:k1] += dv_c
        # The own block's accumulator starts here; any other arrived one hop behind its
        # block (received into `home` last step).
        _wait(acc_reqs)
        if ring.lengths[src]:
            if t == 0:
                acc = part if part is not None else torch.zeros(
                    b * ring.lengths[src] * hkv * (d + dv), dtype=dt, device=q.device)
            elif part is not None:
                acc += part
        home = None
        if ring.world > 1 and ring.lengths[nxt]:
            home = torch.empty(b * ring.lengths[nxt] * hkv * (d + dv), dtype=dt,
                               device=q.device)
        acc_reqs = _exchange(acc if ring.lengths[src] else None, home,
                             ring) if ring.world > 1 else []
        acc = home if ring.world > 1 else acc
    _wait(acc_reqs)
    if n:
        dk, dvv = _unpack(acc, b, n, hkv, d, dv)
    else:
        dk, dvv = k.new_zeros(k.shape, dtype=dt), v.new_zeros(v.shape, dtype=dt)
    dsink = None
    if sink is not None:
        delta = (doc * oc).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta = delta - dlse
        # (In dt until after the all-reduce: _dsink returns the dtype of the sink it gets.)
        dsink = _dsink(sink.to(dt), lse.to(dt), delta)
        if ring.sink_grad == "sum" and ring.world > 1:
            dist.all_reduce(dsink, group=ring.group)
        dsink = dsink.to(sink.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dsink


def _make_ring(group, n_local: int, device, layout: str, left, right, softcap: float,
               scale: float, sink_grad: str, shard_lengths) -> _Ring:
    """The ring of a call: this rank and its neighbours in ``group``, every shard length
    (``shard_lengths``, checked, or gathered from the ranks: one small all-gather and a
    host-device sync) and each step's attention calls."""
    rank, world, prev, nxt = _group_ranks(group)
    # Every rank needs every shard length (unequal or empty shards); one small all-gather.
    if shard_lengths is None:
        mine = torch.tensor([n_local], dtype=torch.int64, device=device)
        lengths = torch.empty(world, dtype=torch.int64, device=device)
        _all_gather_flat(lengths, mine, group)
        lengths = lengths.tolist()
    else:
        lengths = [int(n) for n in shard_lengths]
        if len(lengths) != world or lengths[rank] != n_local or min(lengths) < 0:
            raise ValueError(f"shard_lengths must hold every rank's n_r ({world} ints >= 0, "
                             f"this rank's = {n_local}), got {list(shard_lengths)}")
    segs = shard_segments(lengths, layout)
    plans = [plan_step(segs[rank], segs[s], left, right) for s in range(world)]
    return _Ring(group, rank, world, prev, nxt, lengths, plans, softcap, scale, sink_grad)


def _group_name(group) -> str:
    """The process group's name, by which the ring's ops find it again (traceable)."""
    return (group if group is not None else dist.group.WORLD).group_name


def _named_ring(group_name: str, q, layout, left, right, softcap, scale, sink_grad,
                shard_lengths) -> _Ring:
    """:func:`_make_ring` of the group named ``group_name`` (the ring's ops)."""
    return _make_ring(dist.distributed_c10d._resolve_process_group(group_name), q.shape[1],
                      q.device, layout, left, right, softcap, scale, sink_grad, shard_lengths)


# torch.compile sees the ring as two ops, forward and backward (fake kernels give the shapes):
# the transfers, the shard-length gather and the planning happen inside them.
@torch.library.custom_op("flashlse::ring_fwd", mutates_args=())
def _ring_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                 group_name: str, shard_lengths: list[int] | None, layout: str,
                 left: int | None, right: int | None, softcap: float, scale: float,
                 sink_grad: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_fwd(q, k, v, sink, _named_ring(group_name, q, layout, left, right, softcap,
                                                scale, sink_grad, shard_lengths))


@_ring_fwd_op.register_fake
def _(q, k, v, sink, group_name, shard_lengths, layout, left, right, softcap, scale,
      sink_grad):
    return fwd_fakes(q, v)


@torch.library.custom_op("flashlse::ring_bwd", mutates_args=())
def _ring_bwd_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 sink: torch.Tensor | None, group_name: str, shard_lengths: list[int] | None,
                 layout: str, left: int | None, right: int | None, softcap: float,
                 scale: float, sink_grad: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = _named_ring(group_name, q, layout, left, right, softcap, scale, sink_grad,
                       shard_lengths)
    dq, dk, dv, dsink = _ring_bwd(dout, dlse, q, k, v, out, lse, sink, ring)
    # dK and dV are views of one buffer (they travel the ring together); an op's outputs may
    # not alias one another.
    return dq, dk, dv.clone(), op_dsink(q, dsink)


@_ring_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sink, group_name, shard_lengths, layout, left, right,
      softcap, scale, sink_grad):
    return bwd_fakes(q, k, v, sink)


def _ring_setup(ctx, inputs, output):
    q, k, v, sink, *scalars = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], sink)
    ctx.scalars = scalars


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse, sink = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsink = _ring_bwd_op(dout, dlse, q, k, v, out, lse, sink, *ctx.scalars)
    return (dq, dk, dv, None if sink is None else dsink) + (None,) * len(ctx.scalars)


_ring_fwd_op.register_autograd(_ring_backward, setup_context=_ring_setup)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention over the ranks of a group; forward and backward each one ring."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring):
        out, lse = _ring_fwd(q, k, v, sink, ring)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.ring = ring
        # This call's kernel options, for the backward (autograd's device thread does not
        # see the caller's kernel_options block; as AttentionFunction's).
        ctx.opts = options.captured()
        # An unused lse gets no zero-filled gradient (None: the steps take no lse gradient).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        return run_backward("flashlse.distributed.ring_attention", (q, k, v, sink),
                            options.run_under, ctx.opts, _ring_bwd, dout, dlse, q, k, v, out,
                            lse, sink, ctx.ring) + (None,)


def _check_group():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashlse.distributed needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group (torchrun sets the env) first")


@on_tensor_device
def ring_attention(q, k, v, *, group=None, causal=False, window=(None, None), sink=None,
                   scale=None, softcap=0.0, return_lse=False, layout="contiguous",
                   sink_grad="local", shard_lengths=None):
    """:func:`flashlse.attention` over one sequence sharded on the ranks of ``group``.

    ``O_i = sum_j exp(S_ij - L_i) V_j`` over all keys of the whole sequence (``Sq == Sk``,
    row i sees key j iff ``i - left <= j <= i + right`` in global positions); K/V travel
    around the ring, the per-block states merge with :func:`flashlse.merge` rules, the sink
    is added once. Equal to the single-process result up to rounding. Under
    ``torch.compile(fullgraph=True)`` (``dynamic=True`` too) the ring is two custom ops,
    ``flashlse::ring_fwd`` and ``ring_bwd``: the transfers, the gather and the planning run
    inside them, the group found again by its name.

    Args:
        q: ``(B, n_r, Hq, D)``; k: ``(B, n_r, Hkv, D)``; v: ``(B, n_r, Hkv, Dv)``: this
            rank's tokens (``n_r`` may differ per rank and may be 0); B, H, D equal on all ranks.
        group: the process group (default: the world).
        causal, window, scale, softcap, sink, return_lse: as :func:`flashlse.attention`;
            ``sink`` ``(Hq,)`` must be equal on every rank.
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`split_sequence`).
        sink_grad: ``"local"`` (default): ``sink.grad`` holds this rank's rows' part, like
            the gradient of every replicated weight that produced q, k, v, so the reduction
            FSDP/DDP run over the context-parallel ranks (torchtitan's ``dp_shard_cp``) treats
            the sink like every other parameter. ``"sum"``: all-reduced over the group, the
            whole sequence's gradient on every rank, as one process would give (for loops
            that do not reduce replicated gradients over these ranks).
        shard_lengths: every rank's ``n_r`` in rank order (ints, equal on all ranks), as
            :func:`split_sequence` cut them. None gathers them from the ranks, which costs
            one small all-gather and a host-device sync a call; passing them costs neither.
            Pass them on every rank or on none (the gather is a collective).

    Returns:
        ``out (B, n_r, Hq, Dv)``, and ``lse (B, Hq, n_r)`` float32 if ``return_lse``.
    """
    _check_group()
    left, right, softcap, scale, sink = validate_attention_args(
        q, k, v, sink, softcap, scale, window, causal, 4,
        ("(B, n_r, Hq, D)", "(B, n_r, Hkv, D)", "(B, n_r, Hkv, Dv)"))
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k, v must be the same tokens of the sequence (equal batch and "
                         f"n_r): got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_layout(layout)
    if sink_grad not in SINK_GRADS:
        raise ValueError(f"sink_grad must be one of {SINK_GRADS}, got {sink_grad!r}")
    args = (q.contiguous(), k.contiguous(), v.contiguous(), sink)
    if torch.compiler.is_compiling():
        # One opaque op a direction (no graph break at the transfers; fakes give the shapes),
        # the group by its name, the ring planned inside.
        lengths = None if shard_lengths is None else [int(n) for n in shard_lengths]
        out, lse = _ring_fwd_op(*args, _group_name(group), lengths, layout, left, right,
                                softcap, scale, sink_grad)
    else:
        ring = _make_ring(group, q.shape[1], q.device, layout, left, right, softcap, scale,
                          sink_grad, shard_lengths)
        out, lse = RingAttentionFunction.apply(*args, ring)
    return (out, lse) if return_lse else out


class MergeAcrossRanksFunction(torch.autograd.Function):
    """All-gather of the ranks' states, then the merge; backward local (see module header)."""

    @staticmethod
    def forward(ctx, out, lse, sink, group, replicated_grad):
        world = dist.get_world_size(group)
        out, lse = out.contiguous(), lse.contiguous()
        # Flat buffers: gloo wants the gathered tensor as a concatenation along dim 0.
        outs = out.new_empty(world * out.numel())
        lses = lse.new_empty(world * lse.numel())
        _all_gather_flat(outs, out.reshape(-1), group)
        _all_gather_flat(lses, lse.reshape(-1), group)
        outs, lses = outs.view((world,) + out.shape), lses.view((world,) + lse.shape)
        merged_out, merged_lse = merge_states_unchecked(outs, lses, sink=sink)
        ctx.save_for_backward(out, lse, merged_out, merged_lse, sink)
        ctx.group, ctx.replicated_grad = group, replicated_grad
        return merged_out, merged_lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, m_out, m_lse, sink = ctx.saved_tensors
        dt = compute_dtype(out.dtype)
        dout, dlse = dout.to(dt), dlse.to(dt)
        if not ctx.replicated_grad:
            # Summed in place below: never into the tensors autograd handed in.
            dout, dlse = dout.clone(), dlse.clone()
            dist.all_reduce(dout, group=ctx.group)
            dist.all_reduce(dlse, group=ctx.group)
        pivot = safe_pivot(m_lse.to(dt))
        w = torch.exp(lse.to(dt) - pivot)
        used = w > 0
        zero = torch.zeros((), dtype=dt, device=out.device)
        o_s, o_m = out.to(dt), m_out.to(dt)
        # A zero-weight state is never read (its out may be unwritten), as in the forward.
        dot = torch.where(used, (dout * (torch.where(used[..., None], o_s, zero) - o_m)).sum(-1),
                          zero)
        d_out = torch.where(used[..., None], w[..., None] * dout, zero)
        d_lse = torch.where(used, w * (dlse + dot), zero)
        dsink = None
        if sink is not None:
            w_sink = torch.exp(sink.to(dt) - pivot)
            dsink = (w_sink * (dlse - (dout * o_m).sum(-1))).sum_to_size(sink.shape)
            dsink = dsink.to(sink.dtype)
        return d_out.to(out.dtype), d_lse.to(lse.dtype), dsink, None, None


@on_tensor_device
def merge_across_ranks(out, lse, *, group=None, sink=None, replicated_grad=True):
    """``L = log(sum_r e^{L_r} [+ e^{sink}])``, ``O = sum_r e^{L_r - L} O_r`` over the ranks.

    Every rank passes its partial state for the same queries (e.g. attention over its
    part of the keys) and gets the merged state; empty states are ``(0, -inf)`` and two
    of them merge to ``(0, -inf)``, never NaN. Differentiable.

    Args:
        out: ``(..., Dv)``, the same shape and dtype on every rank.
        lse: ``out.shape[:-1]`` canonical LSE (as :func:`flashlse.merge_states`; for the
            ``(B, H, Sq)`` lse of :func:`flashlse.attention` pass ``lse.transpose(1, 2)``
            and ``out``'s ``(B, Sq, H, Dv)``).
        group: the process group (default: the world).
        sink: optional logits broadcastable to ``lse`` (``(H,)`` for lse ``(..., H)``),
            equal on every rank, added once.
        replicated_grad: True (default): every rank uses the merged state the same way
            (the same loss on the same tensor), so the merged gradient is the same on every
            rank and the backward needs no communication. False: the ranks' gradients
            differ; the backward sums them over the group first (two all-reduces).

    Returns:
        ``(out (..., Dv) in out.dtype, lse (...) float32)``, equal on every rank.
    """
    _check_group()
    validate_states(out[None] if isinstance(out, torch.Tensor) else out,
                     lse[None] if isinstance(lse, torch.Tensor) else lse, sink)
    if not isinstance(replicated_grad, bool):
        raise TypeError(f"replicated_grad must be a bool, got {type(replicated_grad).__name__}")
    return MergeAcrossRanksFunction.apply(out, lse, sink, group, replicated_grad)


__all__ = [
    "gather_sequence",
    "merge_across_ranks",
    "plan_step",
    "ring_attention",
    "shard_segments",
    "split_sequence",
]
