"""``attention`` and ``attention_varlen``: validation, autograd, and the PyTorch path.

The PyTorch path is the executable description of the kernel algorithm, on any
device and any float dtype (accumulating in float32; float64 stays float64):

* forward: queries in blocks, keys in chunks; fully masked (block, chunk) pairs
  are skipped; each chunk gives a partial state ``(O_c, L_c)`` that is merged into
  the running state with :func:`merge_math` -- the same monoid that merges splits
  and ranks. The sink is merged once, at the end. Memory grows with
  ``Sq_block x chunk``, never ``Sq x Sk``.
* backward: recomputes ``P = exp(S - L)`` chunk by chunk from ``(q, k, v, out, lse)``
  with ``D = rowsum(dO * O) - dlse`` and ``L = -inf`` replaced by 0 once per row
  (``lse.safe_pivot``), so empty rows give ``P = 0`` and zero gradients, never NaN.

On CPU tensors, a dense call with no empty row (no softcap; finite inputs; no lse gradient
in the backward) runs torch's own CPU flash attention instead
(:func:`_sdpa_parts`): the same out and natural-log lse, faster than these loops
(benchmarks/bench_cpu.py); its forwards run in bf16 / fp16 as given where the CPU multiplies
them natively (``NATIVE_CPU_DTYPES``), as the GPU kernels compute.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from .. import masks
from ..lse import safe_pivot
from . import _validate as V
from ._dispatch import compute_dtype, kernel_module, on_tensor_device, use_triton
from ._paged import gather_pages
from .merge import merge_math

# Elements of one (query block x key chunk) score tile, all heads and batches.
TILE_ELEMS = 1 << 22


# Tile sides of the CPU path: 256 x 256 scores a head stay in cache through the elementwise
# steps, and a causal mask skips most of its upper triangle (2 CPU threads, S = 2048 causal:
# forward 0.082 -> 0.057 s, forward+backward 0.252 -> 0.161 s against 1024 x 512).
Q_BLOCK = K_CHUNK = 256


def _blocks(b: int, h: int, sq: int, sk: int) -> tuple[int, int]:
    # Query blocks shrink with B * H so that a tile of >= 16 keys stays within TILE_ELEMS.
    q_block = max(1, min(sq, Q_BLOCK, TILE_ELEMS // max(1, b * h * 16)))
    k_chunk = max(16, min(max(sk, 1), K_CHUNK, TILE_ELEMS // max(1, b * h * q_block)))
    return q_block, k_chunk


def _heads(x: torch.Tensor, hkv: int, dt: torch.dtype) -> torch.Tensor:
    # (B, S, H, D) -> (B, Hkv, G, S, D): query head h is group member h % G of kv head h // G.
    b, s, h, d = x.shape
    return x.reshape(b, s, hkv, h // hkv, d).permute(0, 2, 3, 1, 4).to(dt)


def _unheads(x: torch.Tensor) -> torch.Tensor:
    # (B, Hkv, G, S, D) -> (B, S, Hkv * G, D)
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d)


def _scores(qb, kc, scale, softcap):
    """Scaled (and soft-capped) logits ``[.., QB, C]``, and the tanh for the chain rule."""
    s = qb.matmul(kc.transpose(-1, -2)) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _tile_mask(q0, q1, k0, k1, sq, sk, left, right, device):
    """The tile's visibility mask, or None when every row sees every key of it."""
    shift = sk - sq
    if ((right is None or q0 + shift + right >= k1 - 1)
            and (left is None or q1 - 1 + shift - left <= k0)):
        return None
    return masks.visible(torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device),
                         sq, sk, left, right)


def _tiles(sq, sk, q_block, k_chunk, left, right):
    """(q0, q1, k0, k1) of every tile with at least one visible key, by query block."""
    for q0 in range(0, sq, q_block):
        q1 = min(sq, q0 + q_block)
        for k0 in range(0, sk, k_chunk):
            k1 = min(sk, k0 + k_chunk)
            if not masks.block_is_empty(q0, q1, k0, k1, sq, sk, left, right):
                yield q0, q1, k0, k1


# torch's CPU flash attention (the kernel under F.scaled_dot_product_attention on the CPU:
# blocked, fused, threaded), forward and backward, on (B, H, S, D) views. It returns the
# natural-log lse and takes GQA; its causal mask is top-left aligned, which is the
# contract's bottom-right one only when Sq == Sk, and it divides by zero on a size of 0.
try:
    _SDPA_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _SDPA_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
except AttributeError:  # (a torch without them: the loops run every CPU call)
    _SDPA_CPU_FWD = _SDPA_CPU_BWD = None
# Off: every CPU call runs the loops (benchmarks/bench_cpu.py's in-process A/B).
SDPA_CPU = _SDPA_CPU_FWD is not None


class _Part(NamedTuple):
    """One call of torch's CPU flash attention: query rows ``[q0, q1)`` on keys ``[k0, k1)``,
    top-left causal or with the window's additive mask (``masked``) or neither."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    masked: bool = False


def _sdpa_parts(q, k, v, left, right, softcap, sink, tensors) -> tuple | None:
    """The parts (:class:`_Part`, in query-block order) on which torch's CPU flash attention
    computes this dense call as the contract does (a block's parts merged, then the sink),
    or None: the loops run it.

    It runs CPU tensors (one head dim: the narrower of D and Dv is padded with zeros), no
    softcap, no dimension of size 0 (the kernel divides by it), no empty row, and three forms
    of mask:
    - every row sees every key (``left >= Sk - 1`` or None, ``right >= Sq - 1`` or None: a
      decode's causal mask too): one part;
    - causal with ``Sq <= Sk``: the ``Sk - Sq`` keys every row sees, and the square causal
      block after them (top-left aligned there): two parts;
    - any other window: query blocks of 64-256 rows, each on the keys its rows see with the
      window as an additive mask (none larger than TILE_ELEMS, else the loops run it).
    And finite ``tensors``: the kernel gives a query row whose every score is NaN out 0 and
    lse 0, where the contract propagates the NaN, so inputs with a NaN or an inf take the
    loops (one sum a tensor tells: a NaN or inf element makes it NaN or inf, and so does an
    overflow, which only sends a call to the loops)."""
    sq, sk = q.shape[1], k.shape[1]
    shift = sk - sq
    lo = -(1 << 62) if left is None else -left  # row i sees keys [i + shift + lo, ...
    hi = 1 << 62 if right is None else right    # ..., i + shift + hi]
    if not (SDPA_CPU and q.device.type == "cpu" and not softcap and q.numel() > 0
            and k.numel() > 0 and shift + hi >= 0 and lo <= 0 and lo <= hi):  # (no empty row)
        return None
    no_left_cut = sk - 1 + lo <= 0  # (the last row sees key 0)
    if no_left_cut and hi >= sq - 1:  # (the first row sees the last key)
        parts = (_Part(0, sq, 0, sk), )
    elif no_left_cut and hi == 0:
        parts = (_Part(0, sq, 0, shift), ) * (shift > 0) + (_Part(0, sq, shift, sk, True), )
    else:
        width = min(sk, hi - lo + 1)
        block = max(64, min(256, 1 << (width - 1).bit_length()))
        if block * (block + width) > TILE_ELEMS:
            return None
        parts = tuple(_Part(q0, min(sq, q0 + block), max(0, q0 + shift + lo),
                            min(sk, min(sq, q0 + block) + shift + hi), masked=True)
                      for q0 in range(0, sq, block))
    if not all(_finite(t) for t in tensors if t is not None):
        return None
    return parts


def _finite(t: torch.Tensor) -> bool:
    """Whether ``t`` has no NaN or inf (or overflows its sum: the loops then run the call), by
    one reduction in its own dtype: a sum (float32 accumulation for bf16, the same range;
    a sum in float32 of a bf16 cache converted every element, 5x the time), its min and max
    in float16 (whose sum overflows at 65504)."""
    t = t.detach()
    if t.dtype == torch.float16:
        return t.numel() == 0 or all(math.isfinite(x) for x in torch.aminmax(t))
    return math.isfinite(t.sum())


def _bhsd(*xs) -> list:
    return [x.transpose(1, 2) for x in xs]


def _padded(x, width: int, dt):
    """``x`` in ``dt`` with zero columns up to ``width``: torch's kernel takes one head dim for
    q, k and v, and zero columns change neither a score (q, k) nor what is read of out and
    dout (v, out, dout; the scale is passed as given)."""
    x = x.to(dt)
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _sdpa_call(op, part, sq, sk, left, right, dt, *args, mask=None, **kw):
    """``op`` on one part: its causal flag, or its window as an additive mask (or ``mask``,
    boolean, broadcastable to ``(B, H, rows, keys)``: True where a key is visible)."""
    if mask is not None:
        mask = torch.zeros(mask.shape, dtype=dt).masked_fill_(~mask, float("-inf"))
    elif part.masked:
        ok = masks.visible(torch.arange(part.q0, part.q1), torch.arange(part.k0, part.k1),
                           sq, sk, left, right)
        mask = torch.zeros(ok.shape, dtype=dt).masked_fill_(~ok, float("-inf"))
    return op(*args, 0.0, part.causal, attn_mask=mask, **kw)


def _native_cpu_dtypes() -> frozenset:
    """The reduced dtypes in which torch's CPU flash attention runs its matrix products on
    oneDNN's native kernels on this CPU (AVX-512 for bf16; AVX-512-FP16 or AMX-FP16 for fp16):
    torch's own test of the ISA, which its kernel's GEMMs follow."""
    try:
        native = torch.ops.mkldnn
        return frozenset(dt for dt, ok in ((torch.bfloat16, native._is_mkldnn_bf16_supported),
                                           (torch.float16, native._is_mkldnn_fp16_supported))
                         if ok())
    except (AttributeError, RuntimeError):  # (a torch built without oneDNN)
        return frozenset()


# Forwards run in bf16 / fp16 as given where this CPU multiplies them natively: P is rounded
# to the dtype before P @ V (as the GPU kernels do), the softmax's statistics and the output
# accumulate in float32, lse is float32. A decode step on a 4k bf16 cache (32 / 8 heads,
# D = 128) took 16 ms through the float32 copies against 2.6 for SDPA; prefill 2.5-2.9x
# faster too (AMX). Without native products (an AVX2 CPU: emulated GEMMs) they run in
# float32 as before.
NATIVE_CPU_DTYPES = _native_cpu_dtypes()
# Backwards in bf16 there too (P and dS rounded to bf16 before their products, as the GPU
# kernels' backward rounds them) on sequences of at least NATIVE_BWD_MIN / head width rows
# and keys, without a window's mask: 1.1-1.8x faster than in float32 (at S = 2k-4k, D = 64:
# 0.96-1.03x SDPA's bf16 backward, where float32 ran at 0.58-0.62x); dK / dV errors 2.5-7x
# the float32 form's, within the contract's tolerance (docs/design.md section 5; 40,000
# fuzzed configurations). Shorter sequences and masked parts ran 1.2-2.4x slower in bf16
# (D = 64: S = 32 and 128, window 127), and fp16 backwards 5-12% slower in fp16 at every
# length: float32 there (benchmarks/RESULTS.md, 2026-12-08).
NATIVE_CPU_BWD = NATIVE_CPU_DTYPES & {torch.bfloat16}
NATIVE_BWD_MIN = 1 << 14


def _sdpa_fwd(q, k, v, parts, left, right, scale, sink, mask=None):
    """:func:`attn_fwd_torch` by torch's CPU flash attention on ``parts`` (``_sdpa_parts``),
    in q's dtype where it is in ``NATIVE_CPU_DTYPES``, else in the loops' compute dtype
    (float32; float64 stays float64). A block of several parts is merged in float32.
    ``mask``: one part's visibility as a boolean tensor (:func:`sdpa_fwd_ranges`)."""
    dt = q.dtype if q.dtype in NATIVE_CPU_DTYPES else compute_dtype(q.dtype)
    width = max(q.shape[-1], v.shape[-1])
    qt, kt, vt = _bhsd(*(_padded(x, width, dt) for x in (q, k, v)))
    sq, sk = q.shape[1], k.shape[1]
    outs, lses = [], []
    for (q0, q1), block in itertools.groupby(parts, lambda p: (p.q0, p.q1)):
        states = [_sdpa_call(_SDPA_CPU_FWD, p, sq, sk, left, right, dt, qt[:, :, q0:q1],
                             kt[:, :, p.k0:p.k1], vt[:, :, p.k0:p.k1], mask=mask, scale=scale)
                  for p in block]
        if len(states) == 1 and sink is None:
            out, lse = states[0]
        else:
            # (B, H, rows, D) and (B, H, rows) states, merged in float32.
            out, lse = merge_math(torch.stack([o for o, _ in states]),
                                  torch.stack([l for _, l in states]),
                                  None if sink is None else sink.view(-1, 1))
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))
    # out is (B, Sq, H, D) in memory; lse (B, H, Sq) is laid out (B, Sq, H).
    out = out.transpose(1, 2)[..., :v.shape[-1]]
    return out.to(q.dtype).contiguous(), lse.contiguous()


# Query rows a sequence up to which sdpa_fwd_ranges runs a batch as one masked call: decode
# steps and short chunks, where a call a sequence costs more host time than compute and the
# masked keys of a causal block are few.
SHORT_ROWS = 64
# Bytes of keys and values outside the sequences' ranges (padding, the slots past a shorter
# sequence) that the masked call may read for each call a sequence it saves. Measured on 2
# CPU threads, bf16 decode steps of 8 sequences (benchmarks/RESULTS.md, 2026-12-08): the
# masked call 1.1-4x faster up to 0.85 MB a sequence, 0.82-0.96x from 1.07 MB.
MASKED_WASTE_BYTES = 1 << 20


def sdpa_fwd_ranges(q, k, v, lo, hi, *, left, right, softcap, scale, sink):
    """``(out, lse)`` of a batch whose sequence b has the keys ``[lo[b], hi[b])`` of its row of
    ``k`` and ``v`` (Python ints; its rows bottom-right aligned on them, the window on top:
    as one dense call a sequence), by one call of torch's CPU flash attention with the
    ranges as a mask, on the keys up to the longest range's end; or None, for the caller's
    call a sequence: not a call torch's kernel takes (as :func:`_sdpa_parts`), more than
    SHORT_ROWS query rows a sequence or a mask over TILE_ELEMS elements (the masked call
    computes every row on every key: a long causal chunk's masked half too), more than
    MASKED_WASTE_BYTES a sequence of keys outside the ranges, an empty row, or a NaN or inf
    in q, the sink or those keys (a slot no row sees included)."""
    b, sq = q.shape[:2]
    n = max(hi, default=0)
    if not (SDPA_CPU and q.device.type == "cpu" and not softcap and q.numel() > 0 and n > 0
            and k.shape[-1] > 0 and v.shape[-1] > 0 and sq <= SHORT_ROWS
            and b * sq * n <= TILE_ELEMS):
        return None
    waste = (b * n - sum(max(0, h - lo_b) for lo_b, h in zip(lo, hi))) * k.shape[-2] * (
        k.shape[-1] * k.element_size() + v.shape[-1] * v.element_size())
    if waste > b * MASKED_WASTE_BYTES:
        return None
    k, v = k[:, :n], v[:, :n]
    lo_t, hi_t = (torch.tensor(x).view(b, 1) for x in (lo, hi))
    key = torch.arange(n)
    # Sequence b's keys, and its window: aligned on its end, hi[b] keys (the keys before
    # lo[b] are outside its range: the same diagonal as on its hi - lo keys).
    ok = ((key >= lo_t) & (key < hi_t))[:, None].expand(b, sq, n)
    window = masks.visible(torch.arange(sq), key, sq, hi_t, left, right)
    if window is not None:
        ok = ok & window
    if not bool(ok.any(-1).all()) or not all(_finite(t) for t in (q, k, v, sink)
                                             if t is not None):
        return None
    return _sdpa_fwd(q, k, v, (_Part(0, sq, 0, n), ), left, right, scale, sink, ok[:, None])


def _sdpa_bwd(dout, q, k, v, out, lse, parts, left, right, scale, sink):
    """:func:`attn_bwd_torch` without an lse gradient by torch's CPU flash backward on
    ``parts``: each part's P is ``exp(S - lse)`` with the call's final lse, and its delta
    ``rowsum(dout * out)`` with the final out, so the parts' gradients add up to the call's;
    dsink as the loops compute it. In q's dtype where it is in ``NATIVE_CPU_BWD`` (no masked
    part, rows and keys x head width at least NATIVE_BWD_MIN), else in the loops' compute
    dtype; several parts' gradients add up in the compute dtype."""
    acc_dt = compute_dtype(q.dtype)
    width = max(q.shape[-1], v.shape[-1])
    native = (q.dtype in NATIVE_CPU_BWD and not any(p.masked for p in parts)
              and min(q.shape[1], k.shape[1]) * width >= NATIVE_BWD_MIN)
    dt = q.dtype if native else acc_dt
    doc, qc, kc, vc, oc = (_padded(x, width, dt) for x in (dout, q, k, v, out))
    sq, sk = q.shape[1], k.shape[1]
    if parts == (_Part(0, sq, 0, sk, parts[0].causal, parts[0].masked), ):  # (all of it)
        dq, dk, dv = _bhsd(*_sdpa_call(_SDPA_CPU_BWD, parts[0], sq, sk, left, right, dt,
                                       *_bhsd(doc, qc, kc, vc, oc), lse, scale=scale))
    else:
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc_dt) for x in (qc, kc, vc))
        for p in parts:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            grads = _sdpa_call(_SDPA_CPU_BWD, p, sq, sk, left, right, dt,
                               *_bhsd(doc[:, rows], qc[:, rows], kc[:, keys], vc[:, keys],
                                      oc[:, rows]), lse[:, :, rows], scale=scale)
            for acc, idx, g in zip((dq, dk, dv), (rows, keys, keys), _bhsd(*grads)):
                acc[:, idx] += g
    dsink = None if sink is None else _dsink(
        sink, lse, (dout.to(acc_dt) * out.to(acc_dt)).sum(-1).transpose(1, 2))
    d, dv_dim = q.shape[-1], v.shape[-1]
    return (dq[..., :d].to(q.dtype).contiguous(), dk[..., :d].to(k.dtype).contiguous(),
            dv[..., :dv_dim].to(v.dtype).contiguous(), dsink)


def _dsink(sink, lse, delta):
    """``dL/dsink_h = -sum_{b,i} exp(sink_h - L_i) D_i`` (the sink is a key of value 0), from
    ``lse`` and ``D = rowsum(dO * O) - dlse``, both ``(B, Hq, S)`` in the compute dtype; an
    empty row's ``L = -inf`` pivots at 0 (a -inf sink: no sink, 0)."""
    p_sink = torch.exp(sink.to(lse.dtype).view(-1, 1) - safe_pivot(lse))
    return -(p_sink * delta).sum(dim=(0, 2)).to(sink.dtype)


def attn_fwd_torch(q, k, v, *, left, right, softcap, scale, sink):
    """PyTorch forward of one dense batch.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)``; sink ``(Hq,)``.

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q.dtype and ``lse (B, Hq, Sq)`` (float32; float64 inputs
        give float64).
    """
    parts = _sdpa_parts(q, k, v, left, right, softcap, sink, (q, k, v, sink))
    if parts is not None:
        return _sdpa_fwd(q, k, v, parts, left, right, scale, sink)
    b, sq, hq, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    dt = compute_dtype(q.dtype)
    qh, kh, vh = _heads(q, hkv, dt), _heads(k, hkv, dt), _heads(v, hkv, dt)
    g = hq // hkv
    out = torch.zeros(b, hkv, g, sq, dv, dtype=dt, device=q.device)
    lse = torch.full((b, hkv, g, sq), float("-inf"), dtype=dt, device=q.device)
    q_block, k_chunk = _blocks(b, hq, sq, sk)
    # Online softmax over the key chunks of each query block, as the kernels run it: running
    # max m (pivot 0 while a row has seen no key), sum l and unnormalised acc.
    state = None
    for q0, q1, k0, k1 in _tiles(sq, sk, q_block, k_chunk, left, right):
        if state is None or state[0] != q0:
            if state is not None:
                _finish(out, lse, *state)
            shape = (b, hkv, g, q1 - q0)
            state = (q0, q1, torch.full(shape, float("-inf"), dtype=dt, device=q.device),
                     torch.zeros(shape, dtype=dt, device=q.device),
                     torch.zeros(shape + (dv,), dtype=dt, device=q.device))
        _, _, m, l, acc = state
        s, _ = _scores(qh[..., q0:q1, :], kh[..., k0:k1, :], scale, softcap)
        ok = _tile_mask(q0, q1, k0, k1, sq, sk, left, right, q.device)
        if ok is not None:
            s.masked_fill_(~ok, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        pivot = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha = torch.exp(m - pivot)
        e = s.sub_(pivot.unsqueeze(-1)).exp_()
        l.mul_(alpha).add_(e.sum(dim=-1))
        acc.mul_(alpha.unsqueeze(-1)).add_(e.matmul(vh[..., k0:k1, :]))
        m.copy_(m_new)
    if state is not None:
        _finish(out, lse, *state)
    if sink is not None:
        out, lse = merge_math(out[None], lse[None], sink.view(hkv, g, 1))
    out = _unheads(out).to(q.dtype).contiguous()
    return out, lse.reshape(b, hq, sq).to(_lse_dtype(q.dtype))


def _finish(out, lse, q0, q1, m, l, acc):
    """Normalises one query block's online-softmax state into ``out`` and ``lse``. Empty means
    ``l == 0`` exactly (no visible key); a NaN ``l`` propagates."""
    nonempty = l != 0
    l_safe = torch.where(nonempty, l, 1.0)
    out[..., q0:q1, :] = acc * torch.where(nonempty, 1.0 / l_safe, 0.0).unsqueeze(-1)
    lse[..., q0:q1] = torch.where(nonempty, torch.log(l_safe) + m, float("-inf"))


def attn_bwd_torch(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink):
    """PyTorch backward of one dense batch, recomputing ``P`` chunk by chunk.

    ``dlse`` None: no lse gradient.

    Returns:
        ``dq, dk, dv`` in the input dtypes and ``dsink (Hq,)`` (None without a sink).
    """
    if dlse is None:
        parts = _sdpa_parts(q, k, v, left, right, softcap, sink, (q, k, v, dout, sink))
        if parts is not None:
            return _sdpa_bwd(dout, q, k, v, out, lse, parts, left, right, scale, sink)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    qh, kh, vh = _heads(q, hkv, dt), _heads(k, hkv, dt), _heads(v, hkv, dt)
    doh, oh = _heads(dout, hkv, dt), _heads(out, hkv, dt)
    lse_h = lse.reshape(b, hkv, g, sq).to(dt)
    delta = (doh * oh).sum(-1)
    if dlse is not None:
        delta = delta - dlse.reshape(b, hkv, g, sq).to(dt)
    # The once-per-row fix: an empty row's -inf becomes 0, so exp(-inf - 0) = 0 below.
    pivot = safe_pivot(lse_h).unsqueeze(-1)
    dq = torch.zeros_like(qh)
    dk = torch.zeros(b, hkv, sk, d, dtype=dt, device=q.device)
    dv = torch.zeros(b, hkv, sk, v.shape[-1], dtype=dt, device=q.device)
    q_block, k_chunk = _blocks(b, hq, sq, sk)
    for q0, q1, k0, k1 in _tiles(sq, sk, q_block, k_chunk, left, right):
        qb, kc, vc = qh[..., q0:q1, :], kh[..., k0:k1, :], vh[..., k0:k1, :]
        dob = doh[..., q0:q1, :]
        s, t = _scores(qb, kc, scale, softcap)
        ok = _tile_mask(q0, q1, k0, k1, sq, sk, left, right, q.device)
        if ok is not None:
            s = s.masked_fill(~ok, float("-inf"))
        p = torch.exp(s - pivot[..., q0:q1, :])
        dv[:, :, k0:k1] += p.transpose(-1, -2).matmul(dob).sum(2)
        ds = p * (dob.matmul(vc.transpose(-1, -2)) - delta[..., q0:q1, None])
        if t is not None:
            ds = ds * (1 - t * t)
        dq[..., q0:q1, :] += ds.matmul(kc) * scale
        dk[:, :, k0:k1] += ds.transpose(-1, -2).matmul(qb).sum(2) * scale
    dsink = None if sink is None else _dsink(sink, lse_h.reshape(b, hq, sq),
                                             delta.reshape(b, hq, sq))
    return (_unheads(dq).to(q.dtype).contiguous(), dk.transpose(1, 2).to(k.dtype).contiguous(),
            dv.transpose(1, 2).to(v.dtype).contiguous(), dsink)


# The CPU backward's runs stop at this many query rows: torch's CPU flash backward ran
# slower batched than one sequence at a time (2 threads, H = 8, D = 64: 64 x 128 rows
# 52-58 against 41-42 ms), while runs of tiny sequences still pay (256 x 32 rows: 4 a call
# 15.7 ms, 1 a call 20.5, all 25.6). The forward batches whole runs (64 x 128: 18.5 against
# 19.4 ms; 256 x 32: 6.9 against 10.4).
_BWD_RUN_ROWS = 128


def _seq_runs(cu_q, cu_k, seqused_k, max_rows: int | None = None):
    """``(q0, k0, n, lq, lk)``: runs of ``n`` consecutive sequences of ``lq`` query rows and
    ``lk`` keys each, back to back in the packed rows (from rows ``q0`` and ``k0``), so that
    a run is one batched dense call on views (of at most ``max_rows`` query rows unless one
    sequence has more); sequences without query rows are left out."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    run = None
    for i in range(len(cq) - 1):
        q0, lq, k0 = cq[i], cq[i + 1] - cq[i], ck[i]
        lk = ck[i + 1] - k0 if used is None else used[i]
        if run is not None and run[3] == lq and run[4] == lk and q0 == run[0] + run[2] * lq \
                and k0 == run[1] + run[2] * lk and (max_rows is None
                                                    or (run[2] + 1) * lq <= max_rows):
            run[2] += 1
            continue
        if run is not None:
            yield tuple(run)
        run = [q0, k0, 1, lq, lk] if lq > 0 else None
    if run is not None:
        yield tuple(run)


def _batched(x, start: int, n: int, length: int):
    """Rows ``[start, start + n * length)`` of packed ``x (T, ...)`` as ``(n, length, ...)``."""
    return x[start:start + n * length].unflatten(0, (n, length))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attn_fwd(q, k, v, *, left, right, softcap, scale, sink, **varlen):
    """Forward state ``(out, lse)`` on the path the device has: the Triton kernel on CUDA
    (and under ``TRITON_INTERPRET=1``), else the PyTorch path. ``varlen`` holds the
    ``cu_seqlens_q/k``, ``max_seqlen_q/k`` and ``seqused_k`` keywords of packed input."""
    kw = dict(left=left, right=right, softcap=softcap, scale=scale, sink=sink)
    if use_triton(q):
        return kernel_module("dispatch").attn_fwd(q, k, v, **kw, **varlen)
    if not varlen:
        return attn_fwd_torch(q, k, v, **kw)
    cu_q, cu_k, seqused_k = varlen["cu_seqlens_q"], varlen["cu_seqlens_k"], varlen["seqused_k"]
    out = q.new_zeros(q.shape[:2] + (v.shape[-1],))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device,
                     dtype=_lse_dtype(q.dtype))
    # Each run of sequences of one length is one batched call (views of the packed rows).
    for q0, k0, n, lq, lk in _seq_runs(cu_q, cu_k, seqused_k):
        o, l = attn_fwd_torch(_batched(q, q0, n, lq), _batched(k, k0, n, lk),
                              _batched(v, k0, n, lk), **kw)
        out[q0:q0 + n * lq] = o.flatten(0, 1)
        lse[:, q0:q0 + n * lq] = l.transpose(0, 1).flatten(1)
    return out, lse


def attn_bwd(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
             deterministic=False, **varlen):
    """``(dq, dk, dv, dsink)`` on the path the device has (Triton kernel or PyTorch);
    ``varlen`` as in :func:`attn_fwd`."""
    kw = dict(left=left, right=right, softcap=softcap, scale=scale, sink=sink)
    if use_triton(q):
        return kernel_module("dispatch").attn_bwd(dout, dlse, q, k, v, out, lse,
                                                  deterministic=deterministic, **kw, **varlen)
    if not varlen:
        return attn_bwd_torch(dout, dlse, q, k, v, out, lse, **kw)
    cu_q, cu_k, seqused_k = varlen["cu_seqlens_q"], varlen["cu_seqlens_k"], varlen["seqused_k"]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsink = None if sink is None else torch.zeros_like(sink)
    # (H, rows) -> (n, H, lq) for a run's lse and dlse.
    rows = lambda x, q0, n, lq: x[:, q0:q0 + n * lq].unflatten(1, (n, lq)).transpose(0, 1)
    for q0, k0, n, lq, lk in _seq_runs(cu_q, cu_k, seqused_k, _BWD_RUN_ROWS):
        g = attn_bwd_torch(_batched(dout, q0, n, lq),
                           None if dlse is None else rows(dlse, q0, n, lq),
                           _batched(q, q0, n, lq), _batched(k, k0, n, lk),
                           _batched(v, k0, n, lk), _batched(out, q0, n, lq),
                           rows(lse, q0, n, lq), **kw)
        dq[q0:q0 + n * lq] = g[0].flatten(0, 1)
        dk[k0:k0 + n * lk], dv[k0:k0 + n * lk] = g[1].flatten(0, 1), g[2].flatten(0, 1)
        if sink is not None:
            dsink += g[3]
    return dq, dk, dv, dsink


def _varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k):
    if cu_seqlens_q is None:
        return {}
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)


class _Call(NamedTuple):
    """An eager call's arguments besides the tensors autograd tracks (one argument of
    ``AttentionFunction.apply``, whose cost grows with their count): the packed lengths
    (None: dense), the normalised scalars, and its ``_KEPT`` key and kept forward launch
    (None: none; with a key and no launch the forward keeps the one it plans)."""

    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    seqused_k: torch.Tensor | None
    left: int | None
    right: int | None
    softcap: float
    scale: float
    deterministic: bool
    kept: tuple | None = None
    launch: object = None

    def varlen(self) -> dict:
        return _varlen_kw(self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q,
                          self.max_seqlen_k, self.seqused_k)

    def scalars(self) -> dict:
        return dict(left=self.left, right=self.right, softcap=self.softcap, scale=self.scale)


def _forward(q, k, v, sink, call: _Call):
    """``(out, lse)`` of an eager call: its kept launch, or the dispatcher's (kept under
    ``call.kept`` when it has one); a kept launch whose Hopper kernel failed to compile is
    dropped and the dispatcher runs the call."""
    if call.launch is not None:
        out, lse = kernel_module("fwd").new_outputs(q, v, call.cu_seqlens_q)
        if call.launch(q, k, v, out, lse, sink, call.cu_seqlens_q, call.cu_seqlens_k,
                       call.seqused_k):
            return out, lse
        _KEPT.pop(call.kept, None)
    elif call.kept is not None:
        out, lse, launch = kernel_module("dispatch").attn_fwd_launched(
            q, k, v, sink=sink, **call.scalars(), **call.varlen())
        if len(_KEPT) >= _MAX_KEPT:
            _KEPT.clear()
        _KEPT[call.kept] = (launch, (call.left, call.right, call.softcap, call.scale))
        return out, lse
    return attn_fwd(q, k, v, sink=sink, **call.scalars(), **call.varlen())


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients of a kernel backward run with ``create_graph=True``, passed through
    unchanged, on a node whose own backward raises: computed by kernels, they carry no graph,
    and a backward through them (a gradient penalty, a Hessian-vector product) would drop
    this call's second-order terms without a word where it raised on them alone."""

    @staticmethod
    def forward(ctx, name, anchor, *grads):
        ctx.name = name
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.name} has no second derivative: its backward runs fused kernels, so a "
            f"backward through its gradients (create_graph=True, e.g. a gradient penalty or a "
            f"Hessian-vector product) cannot be computed. Compute that term with "
            f"flashlse.reference (float64, differentiable twice) or torch's math attention")


def run_backward(name: str, inputs, fn, *args, **kwargs) -> tuple:
    """``fn(*args, **kwargs)``, a backward's gradients. A plain backward (grad mode off) pays
    one check. With ``create_graph=True`` (grad mode on) the kernels run under no_grad (no
    graph to build: the ring's buffers would refuse it) and the gradients come out on a
    :class:`_NoSecondDerivative` node where an input of ``inputs`` needs grad."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    with torch.no_grad():
        grads = fn(*args, **kwargs)
    anchor = next((t for t in inputs if t is not None and t.requires_grad), None)
    if anchor is None:
        return grads
    slots = [i for i, g in enumerate(grads) if g is not None]
    got = _NoSecondDerivative.apply(name, anchor, *(grads[i] for i in slots))
    out = list(grads)
    for i, g in zip(slots, got):
        out[i] = g
    return tuple(out)


# Two ways into the same attn_fwd / attn_bwd. Eager calls go through AttentionFunction (or
# straight to the forward when nothing needs a gradient): a few microseconds, where the
# dispatch of a torch custom op costs tens a call and more with autograd. While torch.compile
# traces, the calls go through the custom ops below instead, so the compiled graph holds
# one opaque node (no graph break; fake tensors give the shapes), and CUDA graphs capture
# the kernels either way.
class AttentionFunction(torch.autograd.Function):
    """Eager autograd of ``attention`` / ``attention_varlen`` (dense when cu_seqlens_q is None):
    the tensors autograd tracks, and the rest of the call as one :class:`_Call`."""

    @staticmethod
    def forward(ctx, q, k, v, sink, call):
        out, lse = _forward(q, k, v, sink, call)
        ctx.save_for_backward(q, k, v, out, lse, sink, call.cu_seqlens_q, call.cu_seqlens_k,
                              call.seqused_k)
        ctx.call = call
        # The kernel options of this call, for the backward (autograd's device thread does
        # not see the caller's kernel_options block).
        ctx.opts = kernel_module("options").captured()
        # An unused lse gets no zero-filled gradient: the kernels read dlse = None as 0.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, cu_q, cu_k, seqused_k = ctx.saved_tensors
        call = ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        varlen = _varlen_kw(cu_q, cu_k, call.max_seqlen_q, call.max_seqlen_k, seqused_k)
        if call.kept is not None:
            # A kept call's forward ran a Triton kernel: straight to the dispatcher, with the
            # key that its backward plan is kept under.
            bwd, extra = kernel_module("dispatch").attn_bwd, dict(kept=call.kept)
        else:
            bwd, extra = attn_bwd, {}
        return run_backward(
            "flashlse attention", (q, k, v, sink), kernel_module("options").run_under,
            ctx.opts, bwd, dout, dlse, q, k, v, out, lse, sink=sink,
            deterministic=call.deterministic, left=call.left, right=call.right,
            softcap=call.softcap, scale=call.scale, **varlen, **extra) + (None,)


def _attn(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
          left, right, softcap, scale, deterministic, kept=None):
    """``(out, lse)`` through the cheapest entry that keeps autograd and torch.compile right
    (a call with a ``kept`` key, dense or packed varlen, keeps its launch in ``_KEPT``)."""
    if torch.compiler.is_compiling():
        return _attn_fwd_op(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, seqused_k, left, right, softcap, scale, deterministic)
    call = _Call(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, left, right,
                 softcap, scale, deterministic, kept)
    if V.needs_grad(q, k, v, sink):
        return AttentionFunction.apply(q, k, v, sink, call)
    return _forward(q, k, v, sink, call)


# Inference and training repeat their calls: a dense or packed varlen call whose metadata
# key (the tensors' metadata, the scalars as passed, the Hopper forward's option, 16-byte
# alignment) passed every check before launches the kept forward at once (``_run_kept``,
# through AttentionFunction when a tensor needs grad): the checks, the scalars'
# normalisation and the dispatcher's choice and plan are functions of that key.
# torch.compile and forward tile overrides take the full path.
_KEPT: dict = {}
_MAX_KEPT = 1024


def _kept_key(q, k, v, sink, causal, window, softcap, scale, return_lse, deterministic):
    """The call's key in ``_KEPT``, or None for a call that cannot take the kept path: the
    PyTorch path, torch.compile, a scalar not of its canonical type, forward tile overrides
    (and anything not a tensor: the checks say what is wrong)."""
    if not (V.KEEP_PLANS and isinstance(q, torch.Tensor) and use_triton(q)
            and V.canonical_scalars(causal, window, softcap, scale, return_lse, deterministic)):
        return None
    key = V.meta_key("attention-kept", q, k, v, sink)
    if key is None:
        return None
    opts = kernel_module("options").current()
    if opts.fwd_config or opts.fwd_sm90_config:
        return None
    return (key, causal, window, softcap, scale, opts.sm90_fwd,
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0)


def _run_kept(kept, q, k, v, sink, deterministic, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, want_lse=True):
    """``(out, lse)`` by the launch kept for ``kept`` (through :class:`AttentionFunction`
    when a tensor needs grad), or None: none kept, or the Hopper kernel failed to compile
    (the launch dropped). ``want_lse=False``: the caller drops lse, which then goes to kept
    scratch (``dispatch.new_outputs``) when nothing else reads it (no autograd)."""
    hit = _KEPT.get(kept)
    if hit is None:
        return None
    launch, scalars = hit
    if V.needs_grad(q, k, v, sink):
        return AttentionFunction.apply(q, k, v, sink, _Call(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, *scalars,
            deterministic, kept, launch))
    out, lse = kernel_module("dispatch").new_outputs(q, v, cu_seqlens_q, want_lse)
    if launch(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k):
        return out, lse
    _KEPT.pop(kept, None)
    return None


@torch.library.custom_op("flashlse::attn_fwd", mutates_args=())
def _attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                 cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                 max_seqlen_q: int | None, max_seqlen_k: int | None,
                 seqused_k: torch.Tensor | None, left: int | None, right: int | None,
                 softcap: float, scale: float,
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return attn_fwd(q, k, v, left=left, right=right, softcap=softcap, scale=scale, sink=sink,
                    **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 seqused_k))


def fwd_fakes(q, v):
    """``(out, lse)`` of a forward's shapes and dtypes (custom ops' fake kernels): packed
    ``(total, H, D)`` or ``(B, S, H, D)`` q."""
    if q.dim() == 3:
        total, hq, _ = q.shape
        return (q.new_empty(total, hq, v.shape[-1]),
                q.new_empty(hq, total, dtype=_lse_dtype(q.dtype)))
    b, sq, hq, _ = q.shape
    return (q.new_empty(b, sq, hq, v.shape[-1]),
            q.new_empty(b, hq, sq, dtype=_lse_dtype(q.dtype)))


@_attn_fwd_op.register_fake
def _(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, left,
      right, softcap, scale, deterministic):
    return fwd_fakes(q, v)


def op_dsink(q, dsink):
    """A backward op's dsink output: an op returns a tensor, so an empty float32 one stands
    for None (no sink); its autograd formula turns it back into None."""
    return q.new_empty(0, dtype=torch.float32) if dsink is None else dsink


def bwd_fakes(q, k, v, sink):
    """``dq, dk, dv, dsink`` of a backward op's shapes and dtypes (fake kernels)."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), op_dsink(
        q, None if sink is None else torch.empty_like(sink))


@torch.library.custom_op("flashlse::attn_bwd", mutates_args=())
def _attn_bwd_op(dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 sink: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                 cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None,
                 max_seqlen_k: int | None, seqused_k: torch.Tensor | None, left: int | None,
                 right: int | None, softcap: float, scale: float, deterministic: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsink = attn_bwd(
        dout, dlse, q, k, v, out, lse, left=left, right=right, softcap=softcap, scale=scale,
        sink=sink, deterministic=deterministic,
        **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k))
    return dq, dk, dv, op_dsink(q, dsink)


@_attn_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sink, *args):
    return bwd_fakes(q, k, v, sink)


def _attn_setup(ctx, inputs, output):
    q, k, v, sink, cu_q, cu_k, max_q, max_k, seqused_k = inputs[:9]
    ctx.save_for_backward(q, k, v, output[0], output[1], sink, cu_q, cu_k, seqused_k)
    ctx.ints = (max_q, max_k) + tuple(inputs[9:])


def _attn_backward(ctx, dout, dlse):
    q, k, v, out, lse, sink, cu_q, cu_k, seqused_k = ctx.saved_tensors
    max_q, max_k, left, right, softcap, scale, deterministic = ctx.ints
    dq, dk, dv, dsink = _attn_bwd_op(dout, dlse, q, k, v, out, lse, sink, cu_q, cu_k, max_q,
                                     max_k, seqused_k, left, right, softcap, scale,
                                     deterministic)
    return (dq, dk, dv, None if sink is None else dsink) + (None,) * 10


_attn_fwd_op.register_autograd(_attn_backward, setup_context=_attn_setup)


def validate_attention_args(q, k, v, sink, softcap, scale, window, causal, ndim, layouts):
    # The tensor checks read metadata only: skipped for metadata that passed them before.
    key = V.meta_key(layouts, q, k, v)
    if not V.passed(key):
        _validate_tensors(q, k, v, ndim, layouts)
        V.remember(key)
    V.check_bool("causal", causal)
    left, right = masks.normalize_window(causal, V.check_window(window))
    sink = V.check_sink(sink, q.shape[-2], q.device)
    return left, right, V.check_softcap(softcap), V.check_scale(scale, q.shape[-1]), sink


def _validate_tensors(q, k, v, ndim, layouts):
    for name, t, layout in zip(("q", "k", "v"), (q, k, v), layouts):
        V.check_tensor(name, t, ndim, layout)
        V.check_float(name, t)
    V.check_same({"q": q, "k": k, "v": v}, "dtype")
    V.check_same({"q": q, "k": k, "v": v}, "device")
    V.check_last_stride({"q": q, "k": k, "v": v})
    V.check_heads(q.shape[-2], k.shape[-2], v.shape[-2])
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D, got {q.shape[-1]} and "
                         f"{k.shape[-1]}")
    V.check_head_dim(q.shape[-1], v.shape[-1], q.is_cuda, V.MAX_HEAD_DIM_PREFILL)


DENSE_LAYOUTS = ("(B, Sq, Hq, D)", "(B, Sk, Hkv, D)", "(B, Sk, Hkv, Dv)")


def check_dense_batch(q, k, v) -> None:
    if q.shape[0] != k.shape[0] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q, k, v must share the batch and k, v the sequence length: got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


@on_tensor_device
def attention(q, k, v, *, causal=False, window=(None, None), softcap=0.0, scale=None, sink=None,
              return_lse=False, deterministic=False):
    """``O_i = sum_j exp(S_ij - L_i) V_j`` with ``L_i = log(sum_j exp(S_ij) [+ exp(sink)])``.

    Empty rows give ``out = 0`` and ``lse = -inf`` (or the sink). Masks are bottom-right
    aligned (flash-attn); ``window=(left, right)``, None = unbounded.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hkv, D)``; v: ``(B, Sk, Hkv, Dv)``, ``Hq % Hkv == 0``.
        causal: ``right = 0``. window: ``(left, right)``. softcap: ``c tanh(s / c)``, 0 = off.
        scale: default ``1/sqrt(D)``. sink: ``(Hq,)`` float32 logits. return_lse: also return lse.
        deterministic: bitwise-repeatable backward. By default (False) the Hopper backward
            at D = 64 and 128 adds dq into a float32 buffer by TMA reduces from the dK/dV
            pass, in an order that varies run to run (dq within float32 rounding, 0-9%
            faster); True, or ``torch.use_deterministic_algorithms(True)``, computes dq in
            its own pass with no atomics, as every other backward path always does.

    Returns:
        ``out (B, Sq, Hq, Dv)``, and ``lse (B, Hq, Sq)`` float32 natural log if ``return_lse``.
    """
    kept = _kept_key(q, k, v, sink, causal, window, softcap, scale, return_lse, deterministic)
    if kept is not None:
        got = _run_kept(kept, q, k, v, sink, deterministic, want_lse=return_lse)
        if got is not None:
            return got if return_lse else got[0]
    left, right, softcap, scale, sink = validate_attention_args(
        q, k, v, sink, softcap, scale, window, causal, 4, DENSE_LAYOUTS)
    V.check_bool("deterministic", deterministic)
    V.check_bool("return_lse", return_lse)
    check_dense_batch(q, k, v)
    out, lse = _attn(q, k, v, sink, None, None, None, None, None, left, right, softcap, scale,
                     deterministic, kept)
    return (out, lse) if return_lse else out


# transformers hands its attention function (B, H, S, D) tensors. A short-query call's kept
# decode launch reads only their addresses (its plan holds the strides of their (B, S, H, D)
# views), so attention_heads_first launches it on the tensors as they are: three view ops
# less a call (with their frees ~5 us on a CPU host, a sixth of a kept call). Its own dict:
# a (B, H, S, D) tensor's metadata may read as another (B, S, H, D) call's in _KEPT.
_HEADS_FIRST: dict = {}


@on_tensor_device
def attention_heads_first(q, k, v, *, causal=False, window=(None, None), softcap=0.0,
                          scale=None, sink=None):
    """:func:`attention` of ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk,
    Dv)`` (transformers' layout): ``out (B, Sq, Hq, Dv)``, the same bits as ``attention`` of
    their ``transpose(1, 2)`` views, which it calls, except where that call's kept launch is
    the decode kernel's (no autograd): that launch then runs on these tensors themselves."""
    kept = None
    if not V.needs_grad(q, k, v, sink):
        kept = _kept_key(q, k, v, sink, causal, window, softcap, scale, False, False)
        launch = _HEADS_FIRST.get(kept) if kept is not None else None
        if launch is not None:
            b, hq, sq, _ = q.shape
            out, lse = kernel_module("dispatch").new_outputs(
                q, v, None, False, ((b, sq, hq, v.shape[-1]), (b, hq, sq)))
            ran = launch(q, k, v, out, lse, sink, None, None, None, plan=False)
            if ran:
                return out
            if ran is False:  # (the Hopper MLA kernel failed to compile: plan again)
                _HEADS_FIRST.pop(kept, None)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = attention(qt, kt, vt, causal=causal, window=window, softcap=softcap, scale=scale,
                    sink=sink)
    if kept is not None:
        # The decode launch the call kept for these views (not another route's: a dense
        # kernel's launch may read more than addresses), when it holds a plan for them.
        hit = _KEPT.get(_kept_key(qt, kt, vt, sink, causal, window, softcap, scale, False,
                                  False))
        if hit is not None and isinstance(hit[0], kernel_module("dispatch")._DecodeFwd):
            if len(_HEADS_FIRST) >= _MAX_KEPT:
                _HEADS_FIRST.clear()
            _HEADS_FIRST[kept] = hit[0]
    return out


@on_tensor_device
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     seqused_k=None, block_table=None, causal=False, window=(None, None),
                     softcap=0.0, scale=None, sink=None, return_lse=False, deterministic=False):
    """:func:`attention` over packed sequences: sequence ``b`` is ``q[cu_q[b]:cu_q[b+1]]``.

    Args:
        q: ``(total_q, Hq, D)``; k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)``; or, with
            ``block_table``, paged caches ``(num_pages, page_size, Hkv, D / Dv)``.
        cu_seqlens_q / cu_seqlens_k: ``(B + 1,)`` int32, non-decreasing from 0 (zero-length
            sequences allowed). With a block table ``cu_seqlens_k`` may be None when
            ``seqused_k`` gives the lengths. max_seqlen_q / max_seqlen_k: ints >= the longest
            sequence.
        seqused_k: ``(B,)`` int32, only the first ``seqused_k[b]`` keys of sequence b are used.
        block_table: ``(B, max_pages)`` int32, vLLM's / flash-attn's paged KV: key j of
            sequence b is row ``j % page_size`` of page ``block_table[b, j // page_size]``.
            One call then serves a mixed batch of prefills, chunked prefills (Sq < Sk,
            bottom-right causal) and decodes. Forward only. The kernel reads the pages in
            place, the query heads of each kv head packed into its tiles (the PyTorch path
            copies the pages that can hold the first ``max_seqlen_k`` keys first).
        Other keywords as :func:`attention`.

    Returns:
        ``out (total_q, Hq, Dv)``, and ``lse (Hq, total_q)`` if ``return_lse``.
    """
    if block_table is not None:
        return _attention_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, seqused_k, block_table, causal, window,
                                       softcap, scale, sink, return_lse, deterministic)
    kept = _varlen_kept_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k, sink, causal, window, softcap, scale, return_lse,
                            deterministic)
    if kept is not None:
        got = _run_kept(kept, q, k, v, sink, deterministic, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, seqused_k, return_lse)
        if got is not None:
            return got if return_lse else got[0]
    left, right, softcap, scale, sink = validate_attention_args(
        q, k, v, sink, softcap, scale, window, causal, 3, VARLEN_LAYOUTS)
    V.check_bool("deterministic", deterministic)
    V.check_bool("return_lse", return_lse)
    validate_varlen_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k)
    out, lse = _attn(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     seqused_k, left, right, softcap, scale, deterministic, kept)
    return (out, lse) if return_lse else out


VARLEN_LAYOUTS = ("(total_q, Hq, D)", "(total_k, Hkv, D)", "(total_k, Hkv, Dv)")


def validate_varlen_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k):
    """The packed varlen call's checks after :func:`validate_attention_args`: the tokens of
    k and v, both cu_seqlens, the max lengths and seqused_k (values read where value checks
    run)."""
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and "
                         f"{v.shape[0]}")
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    V.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    V.check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    if seqused_k is not None:
        V.check_int_tensor("seqused_k", seqused_k, "(B,)", q.device, 1)
        if seqused_k.shape[0] != cu_seqlens_k.shape[0] - 1:
            raise ValueError(f"seqused_k must be (B,) = ({cu_seqlens_k.shape[0] - 1},), got "
                             f"{tuple(seqused_k.shape)}")
        if V.values_checkable(seqused_k):
            lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            if bool(((seqused_k < 0) | (seqused_k > lens)).any()):
                raise ValueError(
                    f"seqused_k must satisfy 0 <= seqused_k[b] <= the length of key sequence b "
                    f"({lens.tolist()}), got {seqused_k.tolist()}")


def _varlen_kept_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                     sink, causal, window, softcap, scale, return_lse, deterministic):
    """A packed varlen call's key in ``_KEPT`` (:func:`_kept_key`'s, with the length tensors'
    metadata and both max lengths: the launch's grid and its plans are functions of them),
    or None for a call that cannot take the kept path, and for any call whose value checks
    run (the CPU path, ``value_checks(True)``): they read the lengths every call."""
    if max_seqlen_q.__class__ is not int or max_seqlen_k.__class__ is not int or \
            not isinstance(cu_seqlens_q, torch.Tensor) or \
            not isinstance(cu_seqlens_k, torch.Tensor):
        return None
    key = _kept_key(q, k, v, sink, causal, window, softcap, scale, return_lse, deterministic)
    if key is None or V.values_checkable(cu_seqlens_q):
        return None
    lens = V.meta_key("varlen-kept", cu_seqlens_q, cu_seqlens_k, seqused_k)
    return None if lens is None else (key, lens, max_seqlen_q, max_seqlen_k)


def _attention_varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, seqused_k, block_table, causal, window, softcap, scale,
                            sink, return_lse, deterministic):
    """``attention_varlen`` over paged caches: validation, then ``_paged_fwd``."""
    kept = _paged_kept_key(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, seqused_k, block_table, causal, window, softcap, scale,
                           sink, return_lse, deterministic)
    hit = None if kept is None else _PAGED_KEPT.get(kept)
    if hit is not None and _paged_batch_agrees(cu_seqlens_q, seqused_k, block_table):
        out, lse = _paged_fwd(q, k_cache, v_cache, block_table, cu_seqlens_q, max_seqlen_q,
                              seqused_k, max_seqlen_k, sink, *hit)
        return (out, lse) if return_lse else out
    V.check_tensor("q", q, 3, "(total_q, Hq, D)")
    layout = "(num_pages, page_size, Hkv, D)"
    V.check_tensor("k", k_cache, 4, layout)
    V.check_tensor("v", v_cache, 4, layout[:-2] + "Dv)")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"paged k and v must agree in (num_pages, page_size), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    left, right, softcap, scale, sink = validate_attention_args(
        # One page (or none) stands for the cache: a view, never a copy of the whole cache.
        q, k_cache[:1].flatten(0, 1), v_cache[:1].flatten(0, 1), sink, softcap, scale, window,
        causal, 3,
        ("(total_q, Hq, D)", layout, layout[:-2] + "Dv)"))
    V.check_bool("deterministic", deterministic)
    V.check_bool("return_lse", return_lse)
    V.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    bsz = cu_seqlens_q.numel() - 1
    V.check_int_tensor("block_table", block_table, "(B, max_pages)", q.device, 2)
    if block_table.shape[0] != bsz:
        raise ValueError(f"block_table must have B = {bsz} rows (cu_seqlens_q has B + 1 "
                         f"entries), got {block_table.shape[0]}")
    if seqused_k is not None:
        V.check_int_tensor("seqused_k", seqused_k, "(B,)", q.device, 1)
        if seqused_k.shape[0] != bsz:
            raise ValueError(f"seqused_k must be (B,) = ({bsz},), got {tuple(seqused_k.shape)}")
        lens = seqused_k
    elif cu_seqlens_k is not None:
        V.check_int_tensor("cu_seqlens_k", cu_seqlens_k, "(B + 1,)", q.device, 1)
        if cu_seqlens_k.shape[0] != bsz + 1:
            raise ValueError(f"cu_seqlens_k must have B + 1 = {bsz + 1} entries, got "
                             f"{cu_seqlens_k.shape[0]}")
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    else:
        raise ValueError("a paged attention_varlen needs the key lengths: seqused_k (B,) int32 "
                         "(or cu_seqlens_k (B + 1,) int32)")
    V.check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    V.check_max_len("max_seqlen_k", max_seqlen_k)
    capacity = block_table.shape[1] * k_cache.shape[1]
    if V.values_checkable(lens) and bsz:
        if bool(((lens < 0) | (lens > min(capacity, max_seqlen_k))).any()):
            raise ValueError(f"key lengths must lie in [0, {min(capacity, max_seqlen_k)}] "
                             f"(block_table's pages x page_size, and max_seqlen_k), got "
                             f"{lens.tolist()}")
        page = k_cache.shape[1]
        cols = torch.arange(block_table.shape[1], device=q.device)[None]
        in_use = cols < ((lens.long() + page - 1) // page)[:, None]
        bad = in_use & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"block_table entries for the pages in use must lie in "
                             f"[0, {k_cache.shape[0]}) (the number of pages), found "
                             f"{block_table[bad][:4].tolist()}")
    if V.needs_grad(q, k_cache, v_cache, sink):
        raise ValueError("attention_varlen with a block_table is forward only (serving); call it "
                         "under torch.no_grad(), or pack the keys for gradients")
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, max_seqlen_q, lens, max_seqlen_k,
            sink, left, right, softcap, scale)
    if torch.compiler.is_compiling():
        out, lse = _paged_fwd_op(*args)
    else:
        plans = None
        if kept is not None and use_triton(q):
            # Every check passed: later calls of this key (any lengths) skip them, and find
            # the kernels' plans this call makes in the entry's own cache.
            if len(_PAGED_KEPT) >= _MAX_KEPT:
                _PAGED_KEPT.clear()
            plans = {}
            _PAGED_KEPT[kept] = (left, right, softcap, scale, plans)
        out, lse = _paged_fwd(*args, plans)
    return (out, lse) if return_lse else out


# A serving engine calls the paged forward every step with other lengths: the packed query
# rows, the batch and both max lengths change, the rest does not. A call whose key (the
# tensors' metadata less those lengths, the scalars of their canonical types) passed every
# metadata check before skips them (``_paged_kept_key``): the only checks that read the
# lengths compare the batch of cu_seqlens_q, the block table and seqused_k, and the key's
# guard makes them each call. Value checks, grad, torch.compile, the PyTorch path and
# lengths given by cu_seqlens_k take the full path.
_PAGED_KEPT: dict = {}


def _paged_kept_key(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, seqused_k, block_table, causal, window, softcap, scale, sink,
                    return_lse, deterministic):
    """The call's key in ``_PAGED_KEPT``, or None for a call that cannot take the kept path:
    every tensor's metadata but the batch (q's rows, the entries of cu_seqlens_q, the table's
    rows, seqused_k's), whose agreement :func:`_paged_batch_agrees` checks on a hit. An entry
    is made only after the full checks passed (on the kernels' path), so a key of wrong dims,
    dtypes or devices never hits. Plain tensors only (a subclass takes the full path)."""
    T = torch.Tensor
    if not (V.KEEP_PLANS and cu_seqlens_k is None and not torch.compiler.is_compiling()
            and q.__class__ is T
            and k_cache.__class__ is T and v_cache.__class__ is T
            and cu_seqlens_q.__class__ is T and seqused_k.__class__ is T
            and block_table.__class__ is T and (sink is None or sink.__class__ is T)
            and max_seqlen_q.__class__ is int and max_seqlen_k.__class__ is int
            and max_seqlen_q >= 0 and max_seqlen_k >= 0  # (the full path says why not)
            and V.canonical_scalars(causal, window, softcap, scale, return_lse, deterministic)
            and not V.values_checkable(seqused_k)
            and not V.needs_grad(q, k_cache, v_cache, sink)):
        return None
    return (q.shape[1:], q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
            k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype,
            v_cache.device,
            None if sink is None else (sink.shape, sink.stride(), sink.dtype, sink.device),
            cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_q.device,
            seqused_k.stride(), seqused_k.dtype, seqused_k.device, block_table.shape[1:],
            block_table.stride(), block_table.dtype, block_table.device, causal, window,
            softcap, scale)


def _paged_batch_agrees(cu_seqlens_q, seqused_k, block_table) -> bool:
    """Whether a kept paged call's batch agrees across its tensors (B + 1 entries of
    cu_seqlens_q, B rows of the table, B of seqused_k): the full path's checks of it."""
    bsz = cu_seqlens_q.shape[0] - 1
    return bsz >= 0 and block_table.shape[0] == bsz and seqused_k.shape[0] == bsz


def _paged_fwd(q, k_cache, v_cache, block_table, cu_seqlens_q, max_seqlen_q, lens, max_seqlen_k,
               sink, left, right, softcap, scale, plans=None):
    """Paged forward on the path the device has: the kernel reads the pages in place; the
    PyTorch path first copies the pages in use into packed rows. ``plans``: the kept key's
    own cache of the kernels' plans (``dispatch.attn_fwd_paged``)."""
    kw = dict(left=left, right=right, softcap=softcap, scale=scale, sink=sink)
    if use_triton(q):
        return kernel_module("dispatch").attn_fwd_paged(
            q, k_cache, v_cache, block_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, seqused_k=lens, max_seqlen_k=max_seqlen_k, plans=plans,
            **kw)
    # Only the pages that can hold one of the first max_seqlen_k keys are copied: a serving
    # block table is often as wide as the longest sequence the engine allows.
    page = k_cache.shape[1]
    n_cols = min(block_table.shape[1], -(-max(max_seqlen_k, 0) // page))
    k, v, cu_k, used = gather_pages(k_cache, v_cache, block_table[:, :n_cols], lens)
    return attn_fwd(q, k, v, **kw, **_varlen_kw(cu_seqlens_q, cu_k, max_seqlen_q, n_cols * page,
                                                 used))


# While torch.compile traces, the paged forward is one opaque node (forward only: no backward).
@torch.library.custom_op("flashlse::attn_fwd_paged", mutates_args=())
def _paged_fwd_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                  lens: torch.Tensor, max_seqlen_k: int, sink: torch.Tensor | None,
                  left: int | None, right: int | None, softcap: float,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _paged_fwd(q, k_cache, v_cache, block_table, cu_seqlens_q, max_seqlen_q, lens,
                      max_seqlen_k, sink, left, right, softcap, scale)


@_paged_fwd_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, max_seqlen_q, lens, max_seqlen_k, sink,
      left, right, softcap, scale):
    total, hq, _ = q.shape
    return (q.new_empty(total, hq, v_cache.shape[-1]),
            q.new_empty(hq, total, dtype=_lse_dtype(q.dtype)))
