"""flashlse as a HuggingFace transformers attention implementation.

    import flashlse.integrations.transformers as flt
    model = AutoModelForCausalLM.from_config(config, attn_implementation=flt.ATTN_IMPLEMENTATION)

Importing this module registers :func:`attention_forward` with transformers'
``AttentionInterface`` and :func:`attention_mask` with its ``AttentionMaskInterface`` under
:data:`ATTN_IMPLEMENTATION`. The name holds no "flash": transformers treats any name with
"flash" in it as the flash-attn package and tries to import it; and a name missing from
``AttentionMaskInterface`` gets no attention mask at all (padding silently ignored).

What transformers passes and what flashlse does with it:

* ``query (B, H, Sq, D)``, ``key``/``value (B, Hkv, Skv, D)`` (GQA native, no repeat);
  returns ``(out (B, Sq, H, Dv), None)``.
* causal when the module is (``is_causal`` keyword, else ``module.is_causal``); masks are
  bottom-right aligned, so a decode step (the query is the last token of its cache) and a
  prefill are both exact without positions.
* ``attention_mask``: the 2-D padding mask ``(B, Skv)`` (True = a real token) that
  :func:`attention_mask` produces, or None when nothing is padded. Padded batches (left or
  right padding) run ``attention_varlen`` on the real tokens only; padded query rows give 0.
  Packing them reads the mask's counts on the host (one sync), as transformers' own
  flash-attn path does.
* float32 ``query`` / ``key`` / ``value`` (PEFT keeps norms in float32, and a float32
  rotary embedding promotes what it touches) go back to the half dtype the model computes
  in, as transformers' flash-attn path does: autocast's dtype when autocast is on, else
  ``config._pre_quantization_dtype``, else the dtype of the module's first Linear weight
  (a float32 model stays float32). The output is in that dtype.
* ``sliding_window=w``: transformers keeps keys ``i - w < j <= i``, flashlse's window
  ``(w - 1, 0)``. ``softcap``, ``scaling`` and gpt-oss's ``s_aux`` (the per-head sink, with its
  gradient) map to flashlse's ``softcap``, ``scale`` and ``sink``. ``dropout > 0`` is refused.
"""

from __future__ import annotations

import torch

import flashlse as fl

ATTN_IMPLEMENTATION = "lse_exact"


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands :func:`attention_forward`: the 2-D padding mask of the last
    ``kv_length`` positions (bool, True = real token), or None when no token is padded."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _window(module, causal: bool, sliding_window):
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is None:
        return (None, None)
    if not causal:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: a sliding window on a non-causal layer is not "
                         f"supported; use attn_implementation='sdpa' or 'eager' for this model")
    return (int(sliding_window) - 1, 0)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers' attention call on flashlse: ``(out (B, Sq, H, Dv), None)``."""
    if dropout and dropout > 0:
        raise ValueError(f"{ATTN_IMPLEMENTATION} has no attention dropout (got dropout="
                         f"{dropout}); set the config's attention_dropout to 0.0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal)
    kw = dict(causal=causal, window=_window(module, causal, sliding_window),
              softcap=float(softcap or 0.0), scale=scaling,
              sink=None if s_aux is None else s_aux)
    query, key, value = _half_dtype(module, query, key, value)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, S, H, D)
    if attention_mask is None:
        return fl.attention(q, k, v, **kw), None
    if attention_mask.dim() != 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION} expects the 2-D padding mask its mask function "
                         f"makes, got shape {tuple(attention_mask.shape)}; load the model with "
                         f"attn_implementation=flashlse.integrations.transformers."
                         f"ATTN_IMPLEMENTATION after importing that module")
    return _padded(q, k, v, attention_mask.to(torch.bool), kw), None


def _half_dtype(module, *xs):
    """``xs`` in the dtype the model computes in where one is float32 (module docstring)."""
    if not any(x.dtype == torch.float32 for x in xs):
        return xs
    device = xs[0].device.type
    if torch.is_autocast_enabled(device):
        target = torch.get_autocast_dtype(device)
    elif getattr(getattr(module, "config", None), "_pre_quantization_dtype", None) is not None:
        target = module.config._pre_quantization_dtype
    else:
        target = next((m.weight.dtype for m in module.modules()
                       if isinstance(m, torch.nn.Linear)), torch.float32)
    return tuple(x.to(target) for x in xs)


def _padded(q, k, v, kv_mask, kw):
    """Padded batch: the real tokens packed, ``attention_varlen``, scattered back (0 on pads)."""
    b, sq = q.shape[:2]
    q_mask = kv_mask[:, -sq:]
    n_q, n_k = q_mask.sum(1, dtype=torch.int32), kv_mask.sum(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q, cu_k = torch.cat([zero, n_q.cumsum(0, dtype=torch.int32)]), torch.cat(
        [zero, n_k.cumsum(0, dtype=torch.int32)])
    max_q, max_k = (int(x) for x in torch.stack([n_q.max(), n_k.max()]).tolist())
    out = fl.attention_varlen(q[q_mask], k[kv_mask], v[kv_mask], cu_q, cu_k, max_q, max_k, **kw)
    full = out.new_zeros(b, sq, *out.shape[1:])
    full[q_mask] = out
    return full


def register() -> str:
    """Registers flashlse with transformers (done on import); returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)
    return ATTN_IMPLEMENTATION


register()
