"""flashlse as PyTorch SDPA's flash implementation.

    import flashlse                                   # registers "flashlse" (activates nothing)
    torch.nn.attention.activate_flash_attention_impl("flashlse")
    F.scaled_dot_product_attention(q, k, v, is_causal=True)   # SDPA's flash backend -> flashlse
    torch.nn.attention.restore_flash_attention_impl()         # back to torch's FA-2

Activation registers flashlse's launchers for the CUDA kernels of SDPA's flash backend with
the dispatcher (as torch's own FA3/FA4 providers do): ``_scaled_dot_product_flash_attention``
and its backward (the ``(B, H, S, D)`` path of ``scaled_dot_product_attention``), and
``_flash_attention_forward`` / ``_flash_attention_forward_no_dropout_inplace`` /
``_flash_attention_backward`` (dense and varlen, the path of ``torch.nn.attention.varlen``).
SDPA's semantics are kept: ``scale`` (default ``1/sqrt(D)``), ``is_causal`` (bottom-right
aligned, as torch's flash kernels: SDPA sends a causal call to them only when Sq == Sk),
``enable_gqa`` (Hq a multiple of Hkv, no repeat), FA-2's windows (-1 = unbounded). The LSE
is flashlse's: ``-inf`` for a row that sees no key, where the stock kernel writes ``+inf``.

Not routed: dropout (``dropout_p > 0``), the debug mask, ALiBi, paged ``block_table`` and
``num_splits`` of the varlen entry raise (SDPA then fails rather than silently running
another kernel, as with torch's FA4 provider). SDPA's choice of backend is torch's: a call
that SDPA sends to the memory-efficient, cuDNN or math backend does not reach flashlse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import normalize_window
from ..ops._dispatch import on_tensor_device

IMPL_NAME = "flashlse"


@dataclass
class _Handle:
    library: torch.library.Library | None

    def remove(self) -> None:
        self.library = None


def _unsupported(what: str, dropout_p: float = 0.0, **extra) -> None:
    if dropout_p:
        raise RuntimeError(f"flashlse SDPA {what}: dropout_p must be 0, got {dropout_p}")
    for name, value in extra.items():
        if value is not None and value is not False:
            raise RuntimeError(f"flashlse SDPA {what}: {name} is not supported")


def _scale(scale, d):
    return d ** -0.5 if scale is None else float(scale)


def _fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right, seqused_k):
    from ..kernels.dispatch import attn_fwd
    from ..ops.attention import (
        DENSE_LAYOUTS,
        VARLEN_LAYOUTS,
        check_dense_batch,
        validate_attention_args,
        validate_varlen_lengths,
    )

    # The checks of flashlse's own functions (torch's flash kernels check their inputs in
    # C++; these launchers replace them): metadata checks remembered per metadata, values
    # read where value checks run. A bad call raises before any kernel.
    varlen = {}
    if cu_q is not None:
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                      max_seqlen_k=int(max_k), seqused_k=seqused_k)
        left, right, _, scale, _ = validate_attention_args(
            q, k, v, None, 0.0, scale, (left, right), is_causal, 3, VARLEN_LAYOUTS)
        validate_varlen_lengths(q, k, v, **varlen)
    else:
        left, right, _, scale, _ = validate_attention_args(
            q, k, v, None, 0.0, scale, (left, right), is_causal, 4, DENSE_LAYOUTS)
        check_dense_batch(q, k, v)
    return attn_fwd(q, k, v, left=left, right=right, softcap=0.0, scale=scale, sink=None,
                    **varlen)


def _aux(q):
    return (torch.zeros((2,), dtype=torch.uint64, device=q.device),
            torch.zeros((), dtype=torch.uint64, device=q.device),
            torch.empty(0, dtype=q.dtype, device=q.device))


@on_tensor_device
def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                            is_causal, return_debug_mask, *, scale=None, window_size_left=None,
                            window_size_right=None, seqused_k=None, alibi_slopes=None,
                            out=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward``: flash layout ``(B, S, H, D)`` or varlen
    ``(total, H, D)``; returns ``(out, lse, rng_state, philox_offset, debug_mask)``."""
    _unsupported("forward", dropout_p, return_debug_mask=return_debug_mask,
                 alibi_slopes=alibi_slopes, block_table=block_table, num_splits=num_splits)
    o, lse = _fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                  window_size_left, window_size_right, seqused_k)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse, *_aux(query))


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k,
                                               max_q, max_k, dropout_p, is_causal,
                                               return_debug_mask, **kwargs):
    """``aten::_flash_attention_forward_no_dropout_inplace``: writes ``out``, returns lse."""
    return flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                   dropout_p, is_causal, return_debug_mask, out=out,
                                   **kwargs)[1]


@on_tensor_device
def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                             max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                             scale=None, window_size_left=None, window_size_right=None):
    """``aten::_flash_attention_backward``: ``(dq, dk, dv)``."""
    from ..kernels.dispatch import attn_bwd

    _unsupported("backward", dropout_p)
    left, right = normalize_window(is_causal, (window_size_left, window_size_right))
    varlen = {}
    if cum_seq_q is not None:
        varlen = dict(cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k, max_seqlen_q=int(max_q),
                      max_seqlen_k=int(max_k))
    dq, dk, dv, _ = attn_bwd(grad_out, None, query, key, value, out, logsumexp, left=left,
                             right=right, softcap=0.0, scale=_scale(scale, query.shape[-1]),
                             sink=None, **varlen)
    return dq, dk, dv


@on_tensor_device
def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention``: SDPA's ``(B, H, S, D)`` layout."""
    _unsupported("forward", dropout_p, return_debug_mask=return_debug_mask)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    o, lse = _fwd(q, k, v, None, None, None, None, is_causal, scale, None, None, None)
    return (o.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], *_aux(query))


@on_tensor_device
def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                        scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward``: ``(dq, dk, dv)`` in SDPA's
    layout."""
    go, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
    grads = flash_attention_backward(go, q, k, v, o, logsumexp, None, None, max_q, max_k,
                                     dropout_p, is_causal, philox_seed, philox_offset,
                                     scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


def register_kernels() -> _Handle:
    """What ``activate_flash_attention_impl("flashlse")`` runs: flashlse's launchers become the
    CUDA kernels of SDPA's flash backend until ``restore_flash_attention_impl()``."""
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    lib.impl("_flash_attention_forward", flash_attention_forward, "CUDA")
    lib.impl("_flash_attention_forward_no_dropout_inplace",
             flash_attention_forward_no_dropout_inplace, "CUDA")
    lib.impl("_flash_attention_backward", flash_attention_backward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention", sdpa_flash_forward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention_backward", sdpa_flash_backward, "CUDA")
    return _Handle(lib)


def register() -> bool:
    """Makes "flashlse" known to ``torch.nn.attention`` (done on ``import flashlse``); activates
    nothing. False where this torch has no flash-implementation registry."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(IMPL_NAME, register_fn=register_kernels)
    return True
