"""Which kernel runs an attention forward or backward pass on the Triton path.

Each kernel family sits in its own module with a ``supported(...)`` predicate naming its
domain (dtypes, head dims, device capability, alignment: FA-4's ``can_implement``) and a
typed launcher; the families are peers and know nothing of each other. This module asks
them in order and calls the first that takes the call:

    forward  (attn_fwd)          fwd_sm90   Hopper Gluon       KernelOptions.sm90_fwd
                                 fwd        portable Triton    always
    backward (attn_bwd)          bwd.prepare: buffers, D and lse_log2 (shared by all)
      dK/dV                      bwd_sm90   Hopper Gluon       KernelOptions.sm90_dkdv
                                 bwd        portable Triton    always
      dQ                         bwd_sm90   Hopper Gluon       KernelOptions.sm90_dq
                                 bwd        portable Triton    always

A Gluon kernel that this triton fails to compile warns once; its signature goes into
``failures.FAILURES`` and runs the portable kernel from then on. A new kernel is a module with
``supported`` and a launcher of the same arguments as its portable peer, and one ``if`` here.

Per call this costs a few attribute lookups and calls (the eager path is timed in µs).
"""

from __future__ import annotations

from . import bwd, fwd, options
from .failures import FAILURES

try:  # Gluon's Hopper API as of triton 3.6; without it every call takes the portable kernels.
    from . import fwd_sm90
except ImportError:  # pragma: no cover - older or newer triton
    fwd_sm90 = None
try:
    from . import bwd_sm90
except ImportError:  # pragma: no cover - older or newer triton
    bwd_sm90 = None


def attn_fwd(q, k, v, *, left, right, softcap, scale, sink, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """``(out, lse)`` by the Hopper forward where it is supported, else the portable one.
    Arguments and results as ``fwd.attn_fwd`` (which documents them)."""
    out, lse = fwd.new_outputs(q, v, cu_seqlens_q)
    if options.current().sm90_fwd and fwd_sm90 is not None:
        # A compilation is named by the values of the kernel's constexpr flags.
        key = ("fwd_sm90", q.dtype, left is None, right is None, sink is None,
               cu_seqlens_q is not None, seqused_k is None, q.shape[-2] // k.shape[-2])
        if key not in FAILURES and fwd_sm90.supported(
                q, k, v, softcap=softcap, scale=scale,
                batch=q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1):
            try:
                return fwd_sm90.attn_fwd_sm90(
                    q, k, v, out, lse, left=left, right=right, scale=scale, sink=sink,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
            except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
                # Gluon is experimental in triton: if this triton cannot compile the Hopper
                # kernel, say so once and run the portable kernel for this signature from now on.
                FAILURES.add(key, e, "the Hopper forward kernel", stacklevel=2)
    return fwd.attn_fwd(q, k, v, left=left, right=right, softcap=softcap, scale=scale,
                        sink=sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        seqused_k=seqused_k, out=out, lse=lse)


def attn_bwd(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
             deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, seqused_k=None):
    """``dq, dk, dv, dsink``: the shared preprocessing (``bwd.prepare``), then dK/dV and dQ
    each by the Hopper kernel where it is supported, else the portable one. Arguments and
    results as ``bwd.attn_bwd`` (which documents them)."""
    p = bwd.prepare(dout, dlse, q, k, v, out, lse, left=left, right=right, softcap=softcap,
                    scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
    if p.empty:
        return p.grads()
    opts = p.opts
    if p.has_keys and not (
            opts.sm90_dkdv and bwd_sm90 is not None
            and bwd_sm90.supported(p.q, p.k, p.v, p.dout, p.dk, p.dv, softcap=p.softcap)
            and _gluon(("bwd_sm90 dK/dV", p.signature), "the Hopper backward dK/dV kernel",
                       bwd_sm90.attn_bwd_dkdv_sm90, p)):
        bwd.attn_bwd_dkdv(p)
    if not (opts.sm90_dq and bwd_sm90 is not None
            and bwd_sm90.supported(p.q, p.k, p.v, p.dout, p.dq, p.dq, softcap=p.softcap,
                                   dims=bwd_sm90.DQ_DIMS)
            and _gluon(("bwd_sm90 dQ", p.signature), "the Hopper backward dQ kernel",
                       bwd_sm90.attn_bwd_dq_sm90, p)):
        bwd.attn_bwd_dq(p)
    return p.grads()


def _gluon(key: tuple, what: str, launch, p) -> bool:
    """Runs the Gluon launcher ``launch(p)``; False if that signature failed to compile, now
    (warned once, as from ``attn_bwd``'s caller) or before: the caller runs the portable one."""
    if key in FAILURES:
        return False
    try:
        launch(p)
        return True
    except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
        FAILURES.add(key, e, what, stacklevel=3)
        return False
