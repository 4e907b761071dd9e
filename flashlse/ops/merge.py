"""``merge`` and ``merge_states``: the attention-state monoid (docs/design.md §1, docs/math.md).

    m = max_s L_s (0 when m = -inf)     w_s = exp(L_s - m)     sum = Σ_s w_s
    inv_sum = 0 if sum == 0 else 1/sum  O = Σ_s w_s inv_sum O_s   L = log(sum) + m (raw m)

The identity is ``(0, -inf)``; two empty states merge to ``(0, -inf)``, never NaN.
The LSE is never a denominator. A sink is one more state ``(0, sink)``, merged once.
"""

from __future__ import annotations

import torch

from . import _validate as V
from ._dispatch import compute_dtype, kernel_module, on_tensor_device, use_triton


def merge_math(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None = None):
    """The merge in plain torch, differentiable, computed in float32 (float64 stays float64).

    Args:
        outs: ``(N, ..., D)``; lses: ``(N, ...)``; sink: broadcastable to ``lses.shape[1:]``.

    Returns:
        ``(out (..., D) in the compute dtype, lse (...))``.
    """
    dt = compute_dtype(outs.dtype)
    lse = lses.to(dt)
    m = lse.detach().amax(dim=0)
    if sink is not None:
        sink = sink.to(dt)
        m = torch.maximum(m, sink.detach())
    pivot = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - pivot)
    total = w.sum(dim=0)
    if sink is not None:
        total = total + torch.exp(sink - pivot)
    # Empty only when nothing was seen (total exactly 0); a NaN total is data, not empty.
    nonempty = total != 0
    # Neither branch of a where may divide by or log a zero: autograd differentiates both.
    total_safe = torch.where(nonempty, total, torch.ones_like(total))
    inv_sum = torch.where(nonempty, 1.0 / total_safe, torch.zeros_like(total))
    scale = (w * inv_sum).unsqueeze(-1)
    # A zero-weight state is never read: its out may be unwritten (NaN), as in split-KV.
    # Masking outs (not the product) keeps NaN out of d(scale) = grad * outs as well.
    outs = torch.where(scale > 0, outs.to(dt), torch.zeros((), dtype=dt, device=outs.device))
    out = (scale * outs).sum(0)
    lse_out = torch.where(nonempty, torch.log(total_safe) + pivot,
                          torch.full_like(total, float("-inf")))
    return out, lse_out


def validate_states(outs, lses, sink):
    # Metadata only: skipped for metadata that passed before.
    key = V.meta_key("merge_states", outs, lses, sink)
    if not V.passed(key):
        _validate_states_meta(outs, lses, sink)
        V.remember(key)


def _validate_states_meta(outs, lses, sink):
    V.check_tensor("outs", outs, outs.dim() if isinstance(outs, torch.Tensor) else 2,
                   "(N, ..., D)")
    V.check_tensor("lses", lses, lses.dim() if isinstance(lses, torch.Tensor) else 1, "(N, ...)")
    if outs.dim() < 2:
        raise ValueError(f"outs must be (N, ..., D) with at least 2 dims, got {tuple(outs.shape)}")
    if not outs.is_floating_point() or not lses.is_floating_point():
        raise TypeError(f"outs and lses must be floating point, got {outs.dtype} and {lses.dtype}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(
            f"lses must have the shape of outs without its last dim: outs {tuple(outs.shape)} "
            f"needs lses {tuple(outs.shape[:-1])}, got {tuple(lses.shape)}; for flash-layout "
            f"states (out (..., S, H, D), lse (..., H, S)) pass lse.transpose(-1, -2)"
        )
    if outs.device != lses.device:
        raise ValueError(f"outs is on {outs.device}, lses on {lses.device}; put both on one device")
    if outs.shape[0] < 1:
        raise ValueError("merge_states needs at least one state (N >= 1), got N = 0")
    if sink is not None:
        _check_sink(sink, lses)


def _check_sink(sink, lses):
    """``sink`` broadcasts against one state's lse ``lses.shape[1:]``, on lses' device."""
    if not isinstance(sink, torch.Tensor) or not sink.is_floating_point():
        raise TypeError(f"sink must be a floating-point tensor, got {type(sink).__name__}")
    try:
        torch.broadcast_shapes(sink.shape, lses.shape[1:])
    except RuntimeError:
        raise ValueError(
            f"sink {tuple(sink.shape)} must broadcast against one state's lse "
            f"{tuple(lses.shape[1:])} by torch rules: (H,) for lse (..., H), "
            f"(H, 1) for lse (B, H, Sq)"
        ) from None
    if sink.device != lses.device:
        raise ValueError(f"sink is on {sink.device}, lses on {lses.device}")


LAYOUTS = ("rows", "flash")


def _resolve_layout(outs, lses, layout):
    """``"rows"`` (lses.shape == outs.shape[:-1]) or ``"flash"`` (attention's own outputs:
    outs ``(N, B, Sq, H, D)``, lses ``(N, B, H, Sq)``). None infers it from the shapes and
    raises when both fit (Sq == H), so no shape coincidence can pick the wrong axis."""
    if layout is not None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'rows', 'flash' or None, got {layout!r}")
        return layout
    if not (isinstance(outs, torch.Tensor) and isinstance(lses, torch.Tensor)):
        return "rows"
    rows = tuple(lses.shape) == tuple(outs.shape[:-1])
    flash = (outs.dim() == 5 and lses.dim() == 4 and tuple(lses.shape) == (
        outs.shape[0], outs.shape[1], outs.shape[3], outs.shape[2]))
    # Sq == H == 1: the two layouts are the same memory order, either reading is right.
    if rows and flash and outs.shape[2] > 1:
        raise ValueError(
            f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} fit both layouts (Sq == H = "
            f"{outs.shape[2]}): pass layout='flash' for attention's outputs (out (B, Sq, H, D), "
            f"lse (B, H, Sq)), or layout='rows' for lse = out.shape[:-1]")
    return "flash" if flash and not rows else "rows"


@on_tensor_device
def merge_states(outs: torch.Tensor, lses: torch.Tensor, *, sink: torch.Tensor | None = None,
                 layout: str | None = None):
    """Merges N attention states: ``L = log Σ_s e^(L_s) [+ e^sink]``, ``O = Σ_s e^(L_s - L) O_s``.

    Args:
        outs: ``(N, ..., D)`` partial outputs, any float dtype.
        lses: ``(N, ...)`` their canonical LSEs (natural log, -inf = empty).
        sink: optional logits broadcastable to one state's lse (``(H, 1)`` for the flash
            layout's ``(B, H, Sq)``), added once.
        layout: ``"rows"``: ``lses.shape == outs.shape[:-1]``. ``"flash"``: states as
            ``attention`` returns them, outs ``(N, B, Sq, H, D)``, lses ``(N, B, H, Sq)``.
            None (default) infers it, and raises if both fit (Sq == H).

    Returns:
        ``(out (..., D) in outs.dtype, lse (...) float32)`` (float64 for float64 inputs), lse
        in the layout given (``(B, H, Sq)`` for ``"flash"``). All-empty rows give
        ``(0, -inf)``, or ``(0, sink)`` with a sink. A +inf or NaN lse makes its row NaN.
    """
    kept = _KEPT.get(key) if (key := _kept_key(outs, lses, sink, layout)) is not None else None
    if kept is not None and not V.values_checkable(lses) and not V.needs_grad(outs, lses):
        plan, out_shape, lse_shape, flash = kept
        out, lse = kernel_module("combine").fresh_run(plan, outs, lses, out_shape, lse_shape)
        return (out, lse.transpose(-1, -2)) if flash else (out, lse)
    flash = _resolve_layout(outs, lses, layout) == "flash"
    if flash:
        # The rows layout of the same states: lse (B, Sq, H), the sink broadcast against the
        # flash-layout lse first, then transposed with it (a view either way).
        if sink is not None:
            _check_sink(sink, lses)
            sink = torch.broadcast_to(sink, lses.shape[1:]).transpose(-1, -2)
        lses = lses.transpose(-1, -2)
    validate_states(outs, lses, sink)
    _check_canonical(lses)
    out, lse = merge_states_unchecked(outs, lses, sink=sink)
    if key is not None and use_triton(outs) and lses.dtype == torch.float32 and \
            not V.needs_grad(outs, lses):
        # Every check passed: later calls with this key launch the plan at once.
        plan = kernel_module("combine").fresh_plan(outs, lses)
        if callable(plan):  # a launch (not nothing to do, nor contiguous copies first)
            if len(_KEPT) >= _MAX_KEPT:
                _KEPT.clear()
            _KEPT[key] = (plan, tuple(out.shape), tuple(lses.shape[1:]), flash)
    return (out, lse.transpose(-1, -2)) if flash else (out, lse)


# A decode step merges the same shapes every layer: a call without a sink whose metadata key
# (outs', lses' metadata and the layout argument) passed every check before launches the
# merge plan kept for it (``combine.fresh_plan``) at once. Value checks and grad take the
# full path.
_KEPT: dict = {}
_MAX_KEPT = 1024
# ``merge``'s: a call whose key (``_pair_key``) passed every check before launches its
# kept pair plan (``combine.pair_plan``) at once.
_PAIR_KEPT: dict = {}


def _kept_key(outs, lses, sink, layout):
    if sink is not None or not (layout is None or layout.__class__ is str) or not V.KEEP_PLANS:
        return None
    key = V.meta_key("merge-kept", outs, lses)
    return None if key is None else (key, layout)


def _check_canonical(lses: torch.Tensor) -> None:
    # +inf is a foreign empty state (flash-attn 2, FlashMLA), never a canonical LSE: merged
    # as it is, its row would come out NaN. A NaN lse is canonical (bad data reached that
    # row: attention's contract) and propagates as in attention.
    if not V.values_checkable(lses):
        return
    bad = torch.isposinf(lses)
    if bool(bad.any()):
        raise ValueError(
            f"lses holds {int(bad.sum())} +inf entries, which are not canonical LSEs (an "
            f"empty state has lse = -inf); convert foreign states first, e.g. "
            f"flashlse.lse.to_canonical(lse, 'fa2') for flash-attn 2's +inf"
        )


def merge_states_unchecked(outs, lses, *, sink=None):
    """:func:`merge_states` without validation: for internal callers (split-KV, the ring)."""
    if use_triton(outs) and not V.needs_grad(outs, lses, sink):
        sink = None if sink is None else sink.float()
        if torch.compiler.is_compiling():
            return _merge_states_op(outs, lses.float(), sink)
        return kernel_module("combine").merge_states_fwd(outs, lses.float(), sink=sink)
    out, lse = merge_math(outs, lses, sink)
    return out.to(outs.dtype), lse if outs.dtype == torch.float64 else lse.float()


# torch.compile sees the merge kernel as an op (its launcher reads addresses, keeps plans).
@torch.library.custom_op("flashlse::merge_states", mutates_args=())
def _merge_states_op(outs: torch.Tensor, lses: torch.Tensor,
                     sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel_module("combine").merge_states_fwd(outs, lses, sink=sink)


@_merge_states_op.register_fake
def _(outs, lses, sink):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


@on_tensor_device
def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
          *, layout: str | None = None):
    """Merges two attention states; ``(0, -inf)`` is the identity.

    Args:
        out_a, out_b: ``(..., D)``; lse_a, lse_b: ``(...)`` canonical LSEs, either
            ``lse.shape == out.shape[:-1]`` or attention's own ``out (B, Sq, H, D)`` with
            ``lse (B, H, Sq)``; ``layout`` as :func:`merge_states`.

    Returns:
        ``(out (..., D), lse (...))`` as :func:`merge_states`.
    """
    kept = _pair_key(out_a, lse_a, out_b, lse_b, layout)
    if kept is not None and (hit := _PAIR_KEPT.get(kept)) is not None and \
            not V.values_checkable(lse_a) and not V.needs_grad(out_a, lse_a, out_b, lse_b):
        plan, flash = hit
        if flash:  # (lses of out's rows: the views the plan was made for)
            lse_a, lse_b = lse_a.transpose(-1, -2), lse_b.transpose(-1, -2)
        out, lse = kernel_module("combine").pair_run(plan, out_a, lse_a, out_b, lse_b)
        return (out, lse.transpose(-1, -2)) if flash else (out, lse)
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"the two states must have equal shapes, got out {tuple(out_a.shape)} vs "
            f"{tuple(out_b.shape)} and lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if out_a.dtype != out_b.dtype:
        raise ValueError(f"out_a and out_b must share a dtype, got {out_a.dtype} and {out_b.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) > 1:
        raise ValueError(f"the two states must be on one device, got {sorted(map(str, devices))}")
    if not use_triton(out_a) or V.needs_grad(out_a, lse_a, out_b, lse_b) or \
            torch.compiler.is_compiling():
        return merge_states(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]),
                            layout=layout)
    # The kernel reads both states where they are (no stacked copy): merge_states' checks
    # on each, through (1, ..., D) views.
    a, b = (out_a.unsqueeze(0), lse_a.unsqueeze(0)), (out_b.unsqueeze(0), lse_b.unsqueeze(0))
    flash = _resolve_layout(*a, layout) == "flash"
    if flash:
        lse_a, lse_b = lse_a.transpose(-1, -2), lse_b.transpose(-1, -2)
        a, b = (a[0], lse_a.unsqueeze(0)), (b[0], lse_b.unsqueeze(0))
    for outs, lses in (a, b):
        validate_states(outs, lses, None)
        _check_canonical(lses)
    combine = kernel_module("combine")
    # (Kept only for float32 lses: a hit's key then says the plan reads them as they are.)
    keep = kept is not None and lse_a.dtype == torch.float32 and lse_b.dtype == torch.float32
    lse_a, lse_b = lse_a.float(), lse_b.float()
    plan = combine.pair_plan(out_a, lse_a, out_b, lse_b)
    if plan is combine._COPY:
        out, lse = combine.merge_states_fwd(torch.stack([out_a, out_b]),
                                            torch.stack([lse_a, lse_b]))
    else:
        out, lse = combine.pair_run(plan, out_a, lse_a, out_b, lse_b)
        if keep:
            # Every check passed: later calls of this key launch the plan at once.
            if len(_PAIR_KEPT) >= _MAX_KEPT:
                _PAIR_KEPT.clear()
            _PAIR_KEPT[kept] = (plan, flash)
    return (out, lse.transpose(-1, -2)) if flash else (out, lse)


def _pair_key(out_a, lse_a, out_b, lse_b, layout):
    """``merge``'s key in ``_PAIR_KEPT`` (the four tensors' metadata and the layout
    argument), or None: kept plans off, a layout argument not a str, an argument not a
    tensor, torch.compile. Only the pair kernel's calls keep a plan (Triton's path, no grad,
    float32 lses); a hit still takes the full path under value checks or grad."""
    if not V.KEEP_PLANS or not (layout is None or layout.__class__ is str):
        return None
    key = V.meta_key("merge-pair", out_a, lse_a, out_b, lse_b)
    return None if key is None else (key, layout)
