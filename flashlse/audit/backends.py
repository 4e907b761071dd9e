"""The audit's backends: one runner per attention implementation this machine may have (and the
merges of other libraries), each returning ``(out, lse, convention)`` for a case."""

from __future__ import annotations

import math

import torch

from .cases import ATTN_CASES, MERGE_CASES, B, D, H, NoOutput, NotApplicable  # noqa: F401

# name -> (what it is, cases it runs); the order is the table's.
BACKENDS = {
    "flashlse": ("flashlse public functions (Triton kernels on CUDA)", ATTN_CASES + MERGE_CASES),
    "flashlse d128": ("the same at head dim 128, zero-padded (on sm_90: the Gluon kernel)",
                      tuple(c for c in ATTN_CASES if c != "sparse")),
    "flashlse kvcache": ("fl.attention_with_kvcache, num_splits=4, cache padded with garbage",
                         ("causal", "window", "sk0", "sink")),
    "sdpa math": ("F.scaled_dot_product_attention, SDPBackend.MATH, bool mask", ATTN_CASES),
    "sdpa flash-cpu": ("aten._scaled_dot_product_flash_attention_for_cpu, -inf float mask",
                       ATTN_CASES),
    "sdpa flash": ("aten._flash_attention_forward (FA-2 in torch)", ATTN_CASES),
    "sdpa efficient": ("aten._efficient_attention_forward (memory-efficient)", ATTN_CASES),
    "sdpa cudnn": ("aten._scaled_dot_product_cudnn_attention, -inf float bias", ATTN_CASES),
    "flex": ("flex_attention, mask_mod, return_aux lse (eager on CPU, compiled on CUDA)",
             ATTN_CASES),
    "flash-attn": ("flash_attn.flash_attn_func / flash_attn_varlen_func", ATTN_CASES),
    "flashinfer": ("flashinfer.single_prefill_with_kv_cache", ATTN_CASES),
    "merge sigmoid": ("ring-flash-attn / torch CP: out - sigmoid(lb - l)(out - ob), "
                      "l - logsigmoid(l - lb)", MERGE_CASES),
    "merge naive": ("L = logaddexp(La, Lb), O = exp(La - L) Oa + exp(Lb - L) Ob", MERGE_CASES),
}
CUDA_ONLY = ("sdpa flash", "sdpa efficient", "sdpa cudnn", "flash-attn", "flashinfer")
CPU_ONLY = ("sdpa flash-cpu",)
# Native CPU kernels: run in a child process (the others on a CPU are plain PyTorch).
NATIVE_CPU = ("sdpa flash-cpu",)
OPTIONAL = {"flash-attn": "flash_attn", "flashinfer": "flashinfer"}


def _window_kw(c):
    return dict(causal=c["causal"], window=(c["left"], c["right"]))


def _run_flashlse(c):
    import flashlse as fl

    cid = c["id"]
    if cid == "merge_empty":
        return (*fl.merge(*c["a"], *c["b"]), None)
    if cid == "merge_inf":
        # The foreign state is converted at the boundary, as every merge's is (_run_merge).
        lse_a = fl.lse.to_canonical(c["a"][1], "fa2")
        return (*fl.merge(c["a"][0], lse_a, *c["b"]), None)
    q, k, v = c["q4"], c["k4"], c["v4"]
    if cid == "varlen0":
        o, l = fl.attention_varlen(q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"],
                                   c["max_k"], return_lse=True)
        return o[None], l[None], None
    if cid == "sparse":
        return (*fl.sparse_attention(q, k, v, c["indices"], return_lse=True), None)
    return (*fl.attention(q, k, v, sink=c["sink"], return_lse=True, **_window_kw(c)), None)


def _run_flashlse_d128(c):
    """The attention cases at head dim 128, the one whose forward runs the Hopper kernel on
    sm_90: q, k, v zero-padded from D (q . k unchanged, scale kept at 1/sqrt(D)), so out's
    first D columns and the lse are the same case's."""
    import flashlse as fl

    q, k, v = (torch.nn.functional.pad(c[n], (0, 128 - D)) for n in ("q4", "k4", "v4"))
    scale = 1.0 / math.sqrt(D)
    if c["id"] == "varlen0":
        o, l = fl.attention_varlen(q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"],
                                   c["max_k"], scale=scale, return_lse=True)
        return o[None][..., :D], l[None], None
    o, l = fl.attention(q, k, v, sink=c["sink"], scale=scale, return_lse=True, **_window_kw(c))
    return o[..., :D], l, None


def _run_flashlse_kvcache(c):
    import flashlse as fl

    q, k, v = c["q4"], c["k4"], c["v4"]
    sk = k.shape[1]
    # Two garbage slots past the valid length: they must not leak into any row.
    pad = torch.full((B, 2, H, D), 7.0, dtype=k.dtype, device=k.device)
    k_cache, v_cache = torch.cat([k, pad], 1), torch.cat([v, -pad], 1)
    lens = torch.full((B,), sk, dtype=torch.int32, device=k.device)
    out, lse = fl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=4,
                                         sink=c["sink"], return_lse=True, **_window_kw(c))
    return out, lse, None


def _dense_only(c):
    if c["id"] == "varlen0":
        raise NotApplicable("no varlen")
    if c["id"] == "sparse":
        raise NotApplicable("no indices")
    if c["sink"] is not None:
        raise NotApplicable("no sink")


def _sdpa_layout(c):
    return (t.transpose(1, 2) for t in (c["q4"], c["k4"], c["v4"]))


def _neg_inf_bias(c, pad_to=1):
    vis = c["vis"]
    sq, sk = vis.shape
    width = -(-max(sk, 1) // pad_to) * pad_to
    bias = torch.zeros(B, H, sq, width, dtype=c["q4"].dtype, device=vis.device)
    bias[..., :sk].masked_fill_(~vis, -math.inf)
    return bias[..., :sk]


def _run_sdpa_math(c):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _dense_only(c)
    q, k, v = _sdpa_layout(c)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=c["vis"])
    return out.transpose(1, 2), None, None


def _run_sdpa_flash_cpu(c):
    _dense_only(c)
    q, k, v = _sdpa_layout(c)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_neg_inf_bias(c))
    return out.transpose(1, 2), lse, "sdpa_efficient"


def _varlen_lse(lse, c):
    """A varlen LSE in any of the layouts kernels use -> ``(1, H, total_q)``."""
    total = int(c["cu_q"][-1])
    if lse.dim() == 2:
        return lse[None, :, :total]
    if lse.shape[0] == 1 and lse.shape[-1] >= total:
        return lse[:, :, :total]
    cu = c["cu_q"].tolist()
    return torch.cat([lse[i, :, : cu[i + 1] - cu[i]] for i in range(len(cu) - 1)], -1)[None]


def _flash_inputs(c):
    """``q, k, v`` of a case that kernels with no sink and no index lists run (flash-attn's
    and the memory-efficient kernels: dense, or varlen0 as one packed batch)."""
    if c["sink"] is not None:
        raise NotApplicable("no sink")
    if c["id"] == "sparse":
        raise NotApplicable("no indices")
    return c["q4"], c["k4"], c["v4"]


def _fa_window(c):
    """flash-attn's ``(left, right)`` window, -1 for unbounded."""
    return (-1 if c["left"] is None else c["left"], -1 if c["right"] is None else c["right"])


def _run_sdpa_flash(c):
    q, k, v = _flash_inputs(c)
    left, right = _fa_window(c)
    win = dict(window_size_left=left, window_size_right=right)
    if c["id"] == "varlen0":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"], 0.0, False, False)
        return out[None], _varlen_lse(lse, c), "fa2"
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, c["causal"], False,
        **({} if c["causal"] else win))
    return out, lse, "fa2"


def _run_sdpa_efficient(c):
    q, k, v = _flash_inputs(c)
    if c["id"] == "varlen0":
        out, lse, *_ = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, c["cu_q"], c["cu_k"], c["max_q"], c["max_k"], 0.0, 0, True)
        return out, _varlen_lse(lse, c), "sdpa_efficient"
    # custom_mask_type 2 is causal from the bottom right; windows go through a bias.
    bias = None if c["causal"] or c["left"] is None else _neg_inf_bias(c, pad_to=16)
    out, lse, *_ = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, 2 if c["causal"] else 0, True)
    return out, lse[..., : q.shape[1]], "sdpa_efficient"


def _run_sdpa_cudnn(c):
    _dense_only(c)
    q, k, v = _sdpa_layout(c)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, _neg_inf_bias(c, pad_to=16), True, 0.0, False, False)
    if out is None or lse is None:
        raise NoOutput("returned undefined tensors (no out, no lse)")
    return out.transpose(1, 2), lse.reshape(B, H, -1), "canonical"


def _run_flex(c):
    from torch.nn.attention import flex_attention as fa

    if c["sink"] is not None:
        raise NotApplicable("no sink")
    q, k, v = _sdpa_layout(c)
    vis = c["vis"]
    mask_mod = lambda b, h, qi, ki: vis[qi, ki]
    bm = fa.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device.type)
    fn = fa.flex_attention if q.device.type == "cpu" else torch.compile(fa.flex_attention)
    if hasattr(fa, "AuxRequest"):
        out, aux = fn(q, k, v, block_mask=bm, return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, block_mask=bm, return_lse=True)
    return out.transpose(1, 2), lse, "canonical"


def _run_flash_attn(c):
    import flash_attn

    q, k, v = _flash_inputs(c)
    if c["id"] == "varlen0":
        out, lse, _ = flash_attn.flash_attn_varlen_func(
            q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"],
            return_attn_probs=True)
        return out[None], _varlen_lse(lse, c), "fa2"
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=c["causal"], window_size=_fa_window(c),
                                             return_attn_probs=True)
    return out, lse, "fa2"


def _run_flashinfer(c):
    import flashinfer

    if c["id"] not in ("causal", "sk0"):
        raise NotApplicable("not tried")
    q, k, v = c["q4"][0], c["k4"][0], c["v4"][0]
    out, lse = flashinfer.single_prefill_with_kv_cache(q, k, v, causal=c["causal"],
                                                       return_lse=True)
    return out[None], lse.transpose(0, 1)[None], "flashinfer"


def merge_sigmoid(out_a, lse_a, out_b, lse_b):
    """The sigmoid form of ring-flash-attn / torch context parallel (written from its formula):
    ``O = O_a - sigmoid(L_b - L_a) (O_a - O_b)``, ``L = L_a - logsigmoid(L_a - L_b)``."""
    out = out_a - torch.sigmoid(lse_b - lse_a).unsqueeze(-1) * (out_a - out_b)
    return out, lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)


def merge_naive(out_a, lse_a, out_b, lse_b):
    """``L = logaddexp(L_a, L_b)``, ``O = exp(L_a - L) O_a + exp(L_b - L) O_b``."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    out = w_a * out_a + w_b * out_b
    return out, lse


def _run_merge(fn):
    def run(c):
        a = c["a"]
        if c["id"] == "merge_inf":
            # Every merge gets the same boundary conversion flashlse asks of its own callers.
            from ..lse import to_canonical

            a = (a[0], to_canonical(a[1], "fa2"))
        # (The sigmoid form's NaN for two empty states is its empty marker: the convention
        # "sigmoid_merge" folds it; any other merge's NaN is a wrong result.)
        return (*fn(*a, *c["b"]), "sigmoid_merge" if fn is merge_sigmoid else "canonical")

    return run


RUNNERS = {
    "flashlse": _run_flashlse,
    "flashlse d128": _run_flashlse_d128,
    "flashlse kvcache": _run_flashlse_kvcache,
    "sdpa math": _run_sdpa_math,
    "sdpa flash-cpu": _run_sdpa_flash_cpu,
    "sdpa flash": _run_sdpa_flash,
    "sdpa efficient": _run_sdpa_efficient,
    "sdpa cudnn": _run_sdpa_cudnn,
    "flex": _run_flex,
    "flash-attn": _run_flash_attn,
    "flashinfer": _run_flashinfer,
    "merge sigmoid": _run_merge(merge_sigmoid),
    "merge naive": _run_merge(merge_naive),
}
