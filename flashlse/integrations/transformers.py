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
  :func:`attention_mask` produces, or None when nothing is padded. With a static cache
  (``cache_implementation="static"``) the keys are the whole preallocated cache and the
  mask covers the slots written so far: the keys past it are never read. Padded batches
  (left or right padding) run ``attention_varlen`` on the real tokens only; padded query
  rows give 0. Packing them reads the mask's counts on the host (one sync a forward and
  mask; under torch.compile, which keeps nothing between steps, one a layer), as
  transformers' own flash-attn path does. A bidirectional layer (an encoder's
  self-attention, a decoder's cross-attention on a padded encoder batch) computes every
  query row over the real keys, as eager does.
* a padding-free batch (one row of sequences back to back: ``position_ids`` that restart,
  or the collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k``) runs ``attention_varlen`` over
  its sequences, as transformers' flash-attn path does; each token sees its own sequence
  only.
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
from flashlse.ops import kvcache as _kvcache
from flashlse.ops.attention import attention_heads_first

ATTN_IMPLEMENTATION = "lse_exact"


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask=None, **kwargs):
    """The mask transformers hands :func:`attention_forward`: the 2-D padding mask of the last
    ``kv_length`` positions (bool, True = real token), or None when no token is padded.

    A static cache (``cache_implementation="static"``) hands the attention its whole
    preallocated cache, ``kv_length`` slots of which only the first ``q_offset + q_length -
    kv_offset`` are written: the mask then says so (a mask of the written slots, shorter
    than ``kv_length``), padded or not. Its offset is a tensor there: reading it costs a host
    read a forward on a GPU."""
    if attention_mask is None:
        if "allow_is_bidirectional_skip" in kwargs or \
                "bidirectional" in getattr(mask_function, "__name__", ""):
            return None  # (an encoder's or a cross-attention's keys: no cache slots)
        written = int(q_offset) + q_length - int(kv_offset)
        if written >= kv_length:
            return None
        return torch.ones(batch_size, max(written, 0), dtype=torch.bool,
                          device=kwargs.get("device") or getattr(q_offset, "device", None))
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    # (A static cache's mask is shorter than kv_length: kept even without padding, it says
    # which of the cache's slots are written.)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


def _module_attr(module, name: str, default):
    """``getattr(module, name, default)`` for a plain attribute, without the raise inside
    ``nn.Module.__getattr__`` when the module has none (about 1 us a layer call): the
    instance's own attributes, then its class's."""
    found = module.__dict__.get(name, _MISSING)
    if found is not _MISSING:
        return found
    return getattr(module, name) if hasattr(type(module), name) else default


_MISSING = object()


def _window(module, causal: bool, sliding_window):
    if sliding_window is None:
        sliding_window = _module_attr(module, "sliding_window", None)
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
    causal = bool(is_causal if is_causal is not None else
                  _module_attr(module, "is_causal", True))
    kw = dict(causal=causal, window=_window(module, causal, sliding_window),
              softcap=float(softcap or 0.0), scale=scaling, sink=s_aux)
    f32 = torch.float32
    if query.dtype is f32 or key.dtype is f32 or value.dtype is f32:
        query, key, value = _half_dtype(module, query, key, value)
    if attention_mask is None:
        packed = _packed_sequences(query, key, kwargs)
        if packed is None:
            # (On the tensors as they are: a kept decode launch reads them in place.)
            return attention_heads_first(query, key, value, **kw), None
        return fl.attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                   value[0].transpose(0, 1), *packed, **kw)[None], None
    # (B, S, H, D) views
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask.dim() != 2:
        raise ValueError(f"{ATTN_IMPLEMENTATION} expects the 2-D padding mask its mask function "
                         f"makes, got shape {tuple(attention_mask.shape)}; load the model with "
                         f"attn_implementation=flashlse.integrations.transformers."
                         f"ATTN_IMPLEMENTATION after importing that module")
    if k.shape[1] > attention_mask.shape[1]:
        # A static cache: its keys are the whole preallocated cache, the mask covers the
        # slots written so far (the first ones); the rest must not be read. (transformers'
        # mask function keeps the mask for that reason, padded or not.)
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
    kv_mask = attention_mask.to(torch.bool)
    # (Up to the decode kernel's query rows; longer ones are packed by _padded.)
    if causal and q.shape[1] <= _kvcache.decode_rows(False) and not (
            torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                            for x in (q, k, v, s_aux))):
        # A decode step of a left-padded batch (generate's padding): each row's keys read in
        # place from its first real token (cache_leftpad), no rows gathered.
        starts = _leftpad(kv_mask, q.shape[1])
        if starts is not None:
            return fl.attention_with_kvcache(q, k, v, cache_leftpad=starts, **kw), None
    return _padded(q, k, v, kv_mask, kw), None


def _packed_sequences(query, key, kwargs):
    """``(cu_q, cu_k, max_q, max_k)`` of a padding-free batch (one row holding several
    sequences back to back, transformers' ``DataCollatorWithFlattening``), or None: the
    collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``
    where it passes them, else ``position_ids`` that restart (a sequence starts at each 0),
    as transformers' flash-attn path reads them. Without this every token would attend to
    the sequences packed before its own."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        if query.shape[0] != 1:
            raise ValueError(f"{ATTN_IMPLEMENTATION}: cu_seq_lens_q describes one packed row "
                             f"(batch 1), got a batch of {query.shape[0]}")
        return (cu_q.to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                int(kwargs["max_length_q"]), int(kwargs["max_length_k"]))
    pos = kwargs.get("position_ids")
    sq = query.shape[2]  # ((B, H, S, D) tensors)
    if pos is None or query.shape[0] != 1 or sq < 2 or key.shape[2] != sq or pos.numel() != sq:
        return None
    return _lengths_from_positions(pos)


# What the layers of one forward read again and again from the same tensor (the padding
# mask: one a layer type; position_ids), each a host read (a sync on a GPU): kept by the
# tensor's identity and version (another tensor at the same address, or one written since,
# is read again) and the reading's own key, the last four. One tuple, read and replaced
# whole: a thread never pairs one tensor with another's reading. Nothing is kept while
# torch.compile traces: the identity and version tests would be decided once, at trace
# time, and the kept tensors baked into the graph as constants, served to every later step
# (generate's compiled decode steps on a static cache went wrong from the second one).
_KEPT: tuple = ()


def _once_a_forward(t, key, read):
    """``read()``, a function of ``t``'s values and ``key``, kept as the comment above says."""
    global _KEPT
    if torch.compiler.is_compiling():
        return read()
    for kept, version, kept_key, got in _KEPT:
        if kept is t and version == t._version and kept_key == key:
            return got
    got = read()
    _KEPT = ((t, t._version, key, got),) + _KEPT[:3]
    return got


def _lengths_from_positions(pos):
    return _once_a_forward(pos, "positions", lambda: _read_positions(pos))


def _read_positions(pos):
    flat = pos.reshape(-1)
    lengths = None
    if bool((flat[1:] < flat[:-1]).any()):  # (restarts: packed; else one sequence)
        starts = (flat == 0).nonzero().flatten().tolist()
        cuts = sorted(set([0] + starts)) + [flat.numel()]
        cu = torch.tensor(cuts, dtype=torch.int32, device=pos.device)
        longest = max(b - a for a, b in zip(cuts, cuts[1:]))
        lengths = (cu, cu, longest, longest)
    return lengths


def _half_dtype(module, *xs):
    """``xs`` (one of them float32) in the dtype the model computes in (module docstring)."""
    device = xs[0].device.type
    if torch.is_autocast_enabled(device):
        target = torch.get_autocast_dtype(device)
    elif getattr(getattr(module, "config", None), "_pre_quantization_dtype", None) is not None:
        target = module.config._pre_quantization_dtype
    else:
        target = next((m.weight.dtype for m in module.modules()
                       if isinstance(m, torch.nn.Linear)), torch.float32)
    return tuple(x.to(target) for x in xs)


def _leftpad(kv_mask, sq):
    """``(B,)`` int32: where each row's keys start, when every row of the padding mask is pads
    then real tokens (left padding) and its last ``sq`` tokens (the queries) are real; else
    None (once a forward and mask: one host read)."""
    return _once_a_forward(kv_mask, ("leftpad", sq), lambda: _read_leftpad(kv_mask, sq))


def _read_leftpad(kv_mask, sq):
    n = kv_mask.shape[1]
    counts = kv_mask.sum(1, dtype=torch.int32)
    starts = n - counts
    left = torch.arange(n, device=kv_mask.device)[None] >= starts[:, None]
    if bool((left != kv_mask).any() | (counts < sq).any()):
        return None
    return starts


def _padded(q, k, v, kv_mask, kw):
    """Padded batch: the real tokens packed, ``attention_varlen``, scattered back (0 on pads).
    Each tensor's real rows are gathered by their (batch, position) pairs in one indexing:
    transformers' (B, H, S, D) tensors seen as (B, S, H, D) cannot merge B and S, so a flat
    row index would first copy the whole tensor (the K/V cache, every layer)."""
    b, sq = q.shape[:2]
    q_at, k_at, cu_q, cu_k, max_q, max_k = _packing(kv_mask, sq, kw["causal"])
    out = fl.attention_varlen(q[q_at], k[k_at], v[k_at], cu_q, cu_k, max_q, max_k, **kw)
    full = out.new_zeros(b, sq, *out.shape[1:])
    full[q_at] = out
    return full


def _packing(kv_mask, sq, causal):
    """``(q_at, k_at, cu_q, cu_k, max_q, max_k)``: the real tokens' (batch, position) index
    pairs, the packed sequences' offsets and their longest lengths (once a forward and
    mask)."""
    return _once_a_forward(kv_mask, (sq, causal), lambda: _pack(kv_mask, sq, causal))


def _pack(kv_mask, sq, causal):
    # A causal layer's queries are the last sq of its keys (self-attention over a cache):
    # their rows of the mask say which are real. A bidirectional one's (an encoder's
    # self-attention, a decoder's cross-attention on the encoder's keys) are all computed,
    # each over the real keys, as eager does; their rows are not the keys' (cross-attention).
    q_mask = kv_mask[:, -sq:] if causal else kv_mask.new_ones(kv_mask.shape[0], sq)
    n_q, n_k = q_mask.sum(1, dtype=torch.int32), kv_mask.sum(1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=kv_mask.device)
    cu_q, cu_k = torch.cat([zero, n_q.cumsum(0, dtype=torch.int32)]), torch.cat(
        [zero, n_k.cumsum(0, dtype=torch.int32)])
    max_q, max_k = (int(x) for x in torch.stack([n_q.max(), n_k.max()]).tolist())
    return (q_mask.nonzero(as_tuple=True), kv_mask.nonzero(as_tuple=True), cu_q, cu_k, max_q,
            max_k)


def register() -> str:
    """Registers flashlse with transformers (done on import); returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)
    return ATTN_IMPLEMENTATION


register()
