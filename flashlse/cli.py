"""``flashlse`` / ``python -m flashlse``: the empty-row audit, a merge demo, the benchmarks.

``audit`` runs eight cases in which a query row sees no key (or a merge meets an empty
state) on every backend this machine has, and prints backend x case: what ``out`` and
``lse`` were on the empty rows, and whether ``flashlse.merge`` of that state -- after
``flashlse.lse.to_canonical`` with the backend's convention -- against a state that is
non-empty on some rows and empty on others equals the float64 reference merge.
flashlse's own cells are judged strictly: no conversion, ``out = 0`` and ``lse = -inf``
(or the sink) on the empty rows, merge exact; the exit code is 1 only when one fails.

Each backend runs in a child process (``python -m flashlse _worker``), so a peer kernel
that dies (torch's CPU flash kernel raises SIGFPE for Sk = 0) or poisons the CUDA
context costs one cell, not the audit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

CASES = (
    ("causal", "causal Sq>Sk", "causal mask with Sq=5 > Sk=3: rows 0-1 see no key"),
    ("window", "window", "window (1, 1) with Sq=6, Sk=3, bottom-right: rows 0-1 see no key"),
    ("sk0", "Sk=0", "seqlen_k == 0: every row is empty"),
    ("varlen0", "varlen len0", "varlen, key lengths (0, 2, 3), query lengths (2, 0, 3)"),
    ("sparse", "sparse -1", "sparse top-2 indices, row 0 all -1"),
    ("sink", "sink no key", "sink logits, causal Sq=4 > Sk=2: rows 0-1 see only the sink"),
    ("merge_empty", "merge 2 empty", "merge of two empty states (0, -inf) + (0, -inf)"),
    ("merge_inf", "merge +inf", "merge of an fa2-style empty state (0, +inf) with a non-empty one"),
)
ATTN_CASES = tuple(c[0] for c in CASES[:6])
MERGE_CASES = tuple(c[0] for c in CASES[6:])

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
# Short names of the conversions shown after a check mark.
CONV_SHORT = {"fa2": "fa2", "fa3": "fa3", "sdpa_efficient": "eff", "flashinfer": "fi"}

B, H, D = 1, 2, 32
WORKER_MARK = "@@cell "


class NotApplicable(Exception):
    """The backend cannot express the case; the message is the cell text after ``n/a:``."""


class NoOutput(RuntimeError):
    """A peer returned undefined tensors instead of out and lse."""


def _visible(sq, sk, left, right):
    from . import masks

    ok = masks.visible(torch.arange(sq), torch.arange(sk), sq, sk, left, right)
    return torch.ones(sq, sk, dtype=torch.bool) if ok is None else ok


def make_case(case_id: str, device: str) -> dict:
    """Inputs, float64 reference state and empty-row mask of one case.

    Attention cases are kept in a 4-d form ``q4 (B, Sq, H, D)``, a dense visibility mask
    ``vis (Sq, Sk)`` that every mask-based backend uses (varlen: a document mask over the
    packed tokens, B = 1), and the reference state ``out (B, H, Sq, D)``, ``lse (B, H, Sq)``.
    Merge cases hold two states ``(H, R, D)`` / ``(H, R)``.
    """
    from . import reference

    g = torch.Generator().manual_seed(sum(map(ord, case_id)))
    dtype = torch.float32 if device == "cpu" else torch.float16
    rnd = lambda *s: torch.randn(*s, generator=g)
    c = {"id": case_id, "device": device, "dtype": dtype, "sink": None, "left": None,
         "right": None, "causal": False}
    if case_id in MERGE_CASES:
        r = 3
        if case_id == "merge_empty":
            a = (torch.zeros(H, r, D), torch.full((H, r), -math.inf))
            b = (torch.zeros(H, r, D), torch.full((H, r), -math.inf))
        else:
            a = (torch.zeros(H, r, D), torch.full((H, r), math.inf))
            b = (rnd(H, r, D), rnd(H, r))
        c["a"] = tuple(t.to(device) for t in a)
        c["b"] = tuple(t.to(device) for t in b)
        # The true inputs: a is empty in both cases (+inf is fa2's spelling of -inf).
        ref = reference.merge(a[0], torch.full((H, r), -math.inf), b[0], b[1])
        c["ref"] = tuple(t.to(device) for t in ref)
        c["empty"] = torch.ones(H, r, dtype=torch.bool, device=device)
        c["counts"] = None
        return c
    sq, sk = {"causal": (5, 3), "window": (6, 3), "sk0": (3, 0), "sparse": (3, 4),
              "sink": (4, 2), "varlen0": (5, 5)}[case_id]
    if case_id in ("causal", "sink"):
        c.update(causal=True, right=0)
    if case_id == "window":
        c.update(left=1, right=1)
    q, k, v = rnd(B, sq, H, D), rnd(B, sk, H, D), rnd(B, sk, H, D)
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    c.update(q4=q, k4=k, v4=v)
    if case_id == "varlen0":
        lq, lk = (2, 0, 3), (0, 2, 3)
        cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
        c.update(cu_q=cu(lq).to(device), cu_k=cu(lk).to(device), max_q=max(lq), max_k=max(lk))
        doc_q = torch.repeat_interleave(torch.arange(3), torch.tensor(lq))
        doc_k = torch.repeat_interleave(torch.arange(3), torch.tensor(lk))
        vis = doc_q[:, None] == doc_k[None, :]
        o, l = reference.attention_varlen(q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"],
                                          c["max_k"], return_lse=True)
        o, l = o[None], l[None]
    elif case_id == "sparse":
        idx = torch.stack([torch.randperm(sk, generator=g)[:2] for _ in range(sq * H)])
        idx = idx.view(B, sq, H, 2).to(torch.int32)
        idx[:, 0] = -1
        vis = torch.zeros(sq, sk, dtype=torch.bool)
        for i in range(sq):
            # The mask-based backends see one key set per row: make both heads share it.
            idx[0, i, 1] = idx[0, i, 0]
            for j in idx[0, i, 0].tolist():
                if j >= 0:
                    vis[i, j] = True
        c["indices"] = idx.to(device)
        o, l = reference.sparse_attention(q, k, v, c["indices"], return_lse=True)
    else:
        if case_id == "sink":
            c["sink"] = rnd(H).to(device)
        vis = _visible(sq, sk, c["left"], c["right"])
        o, l = reference.attention(q, k, v, causal=c["causal"], window=(c["left"], c["right"]),
                                   sink=c["sink"], return_lse=True)
    c["vis"] = vis.to(device)
    c["ref"] = (o.transpose(1, 2), l)
    counts = vis.sum(-1).to(device)
    c["counts"] = counts.view(1, 1, -1).expand(B, H, -1)
    c["empty"] = (counts == 0).view(1, 1, -1).expand(B, H, -1)
    return c


# Backends: each returns (out, lse or None, convention); attention outs are (B, Sq, H, Dv)
# with lse (B, H, Sq); merge outs are (H, R, D) with lse (H, R).


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


def _run_sdpa_flash(c):
    if c["sink"] is not None:
        raise NotApplicable("no sink")
    if c["id"] == "sparse":
        raise NotApplicable("no indices")
    q, k, v = c["q4"], c["k4"], c["v4"]
    left = -1 if c["left"] is None else c["left"]
    right = -1 if c["right"] is None else c["right"]
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
    if c["sink"] is not None:
        raise NotApplicable("no sink")
    if c["id"] == "sparse":
        raise NotApplicable("no indices")
    q, k, v = c["q4"], c["k4"], c["v4"]
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

    if c["sink"] is not None:
        raise NotApplicable("no sink")
    if c["id"] == "sparse":
        raise NotApplicable("no indices")
    q, k, v = c["q4"], c["k4"], c["v4"]
    if c["id"] == "varlen0":
        out, lse, _ = flash_attn.flash_attn_varlen_func(
            q[0], k[0], v[0], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"],
            return_attn_probs=True)
        return out[None], _varlen_lse(lse, c), "fa2"
    win = (-1 if c["left"] is None else c["left"], -1 if c["right"] is None else c["right"])
    out, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=c["causal"], window_size=win,
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
            from .lse import to_canonical

            a = (a[0], to_canonical(a[1], "fa2"))
        return (*fn(*a, *c["b"]), "canonical")

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


def _kind_out(o: torch.Tensor) -> str:
    if o.numel() == 0:
        return "none"
    if bool(torch.isnan(o).any()):
        return "NaN"
    if bool(torch.isinf(o).any()):
        return "inf"
    return "0" if bool((o == 0).all()) else "fin"


def _kind_lse(l: torch.Tensor, sink: torch.Tensor | None) -> str:
    if l.numel() == 0:
        return "none"
    if bool(torch.isnan(l).any()):
        return "NaN"
    for name, hit in (("-inf", torch.isneginf(l)), ("+inf", torch.isposinf(l)), ("0", l == 0)):
        if bool(hit.all()):
            return name
    if not bool(torch.isfinite(l).all()):
        return "mixed"
    if sink is not None and bool(torch.allclose(l, sink, atol=1e-3, rtol=0)):
        return "sink"
    return "fin"


def _tolerance(dtype):
    return (2e-5, 1e-4) if dtype in (torch.float32, torch.float64) else (2e-2, 2e-2)


def _other_state(ref_out, device):
    """A state non-empty on even rows and empty (0, -inf) on odd rows, shaped like ``ref``."""
    g = torch.Generator().manual_seed(1)
    shape = ref_out.shape
    out = torch.randn(shape, generator=g, dtype=torch.float64)
    lse = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    odd = (torch.arange(lse.numel()) % 2 == 1).view(lse.shape)
    lse = lse.masked_fill(odd, -math.inf)
    out = out.masked_fill(odd.unsqueeze(-1), 0.0)
    return out.to(device), lse.to(device)


def _merge_exact(c, out_s, lse_c):
    """flashlse.merge(state, other) == reference.merge(true state, other)."""
    from . import reference
    from .ops import merge

    ref_out, ref_lse = c["ref"]
    o_out, o_lse = _other_state(ref_out, out_s.device)
    try:
        got_out, got_lse = merge(out_s.float(), lse_c.float(), o_out.float(), o_lse.float())
    except ValueError:
        # flashlse refuses a non-canonical state (+inf / NaN LSE): not mergeable as is.
        return False
    want_out, want_lse = reference.merge(ref_out, ref_lse, o_out, o_lse)
    atol, rtol = _tolerance(c["dtype"])
    if bool(torch.isnan(got_out).any() or torch.isnan(got_lse).any()):
        return False
    if not torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse)):
        return False
    fin = torch.isfinite(want_lse)
    if not bool(torch.isfinite(got_lse[fin]).all()):
        return False
    ok_lse = torch.allclose(got_lse[fin].double(), want_lse[fin], atol=atol, rtol=rtol)
    ok_out = torch.allclose(got_out.double(), want_out, atol=atol, rtol=rtol)
    return bool(ok_lse and ok_out)


def _why_wrong(c, lse_c, e) -> str:
    ref = c["ref"][1]
    rows = ~e & torch.isfinite(ref)
    if not bool(rows.any()):
        return "the state differs from the reference (the merge result is wrong)"
    d = (lse_c[rows].double() - ref[rows]).abs().max().item()
    return (f"non-empty rows: max |lse - reference| = {d:.3g}" +
            (" (the mask was not applied as asked)" if d > 1e-2 else ""))


def judge(backend: str, c: dict, out, lse, convention) -> dict:
    """Classifies the empty rows of one result and runs the merge check."""
    from .lse import to_canonical

    if c["id"] in MERGE_CASES:
        out_s = out
    else:
        out_s = out.transpose(1, 2)
        if out_s.shape[:-1] != c["empty"].shape:
            raise RuntimeError(f"out has shape {tuple(out.shape)}, expected rows "
                               f"{tuple(c['empty'].shape)}")
    e = c["empty"]
    sink = None
    if c["sink"] is not None:
        sink = c["sink"].float().view(1, H, 1).expand_as(e)[e]
    cell = {"status": "ok", "out": _kind_out(out_s[e]), "lse": "n/a", "merge": None,
            "conv": None, "verdict": None}
    if lse is None:
        cell["text"] = f"{cell['out']}/(no lse)"
        cell["detail"] = "the backend returns no LSE"
        return cell
    lse = lse.reshape(e.shape)
    cell["lse"] = _kind_lse(lse[e].float(), sink)
    strict = convention is None
    if strict:
        lse_c, n_fold = lse, 0
    else:
        kw = {"key_counts": c["counts"]} if convention == "sdpa_efficient" else {}
        lse_c, n_fold = to_canonical(lse, convention, return_count=True, **kw)
    cell["merge"] = _merge_exact(c, out_s, lse_c)
    if not cell["merge"]:
        cell["detail"] = _why_wrong(c, lse_c, e)
    # NaN is never a pass: a NaN out on the rows judged is wrong whatever its lse says.
    if cell["out"] == "NaN":
        cell["merge"] = False
        cell["detail"] = "NaN in out on the rows judged"
    cell["verdict"] = "pass" if cell["merge"] else "fail"
    mark = "✓" if cell["merge"] else "✗"
    if cell["merge"] and c["id"] == "merge_inf":
        cell["conv"] = "fa2"  # the input state's conversion, the same for every merge
    elif cell["merge"] and not strict and convention != "canonical":
        cell["conv"] = CONV_SHORT.get(convention, convention)
    elif cell["merge"] and n_fold:
        cell["conv"] = "fold"
    if cell["conv"]:
        mark += f"({cell['conv']})"
    cell["text"] = f"{cell['out']}/{cell['lse']} {mark}"
    return cell


def expected(case_id: str) -> tuple[str, str]:
    if case_id == "sink":
        return "0", "sink"
    if case_id == "merge_inf":
        return "fin", "fin"
    return "0", "-inf"


def run_cell(backend: str, case_id: str, device: str) -> dict:
    try:
        c = make_case(case_id, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, lse, conv = RUNNERS[backend](c)
        return judge(backend, c, out, lse, conv)
    except NotApplicable as err:
        return {"status": "na", "text": f"n/a: {err}", "detail": str(err)}
    except ImportError as err:
        return {"status": "na", "text": "n/a: no kernel" if backend.startswith("flashlse")
                else "n/a: missing", "detail": f"{type(err).__name__}: {err}"}
    except Exception as err:  # a peer's failure is a finding, reported in its cell
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        short = "no output" if isinstance(err, NoOutput) else type(err).__name__
        return {"status": "error", "text": f"err: {short}"[:24],
                "detail": f"{type(err).__name__}: {msg}"[:300]}


def _worker(argv):
    backend, device, cases = argv[0], argv[1], argv[2].split(",")
    torch.manual_seed(0)
    for case_id in cases:
        cell = run_cell(backend, case_id, device)
        cell.update(backend=backend, case=case_id)
        print(WORKER_MARK + json.dumps(cell), flush=True)
    return 0


def _death(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"rc {rc}"


def _run_isolated(backend: str, device: str, cases: list[str], timeout: float) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    cells, remaining = {}, list(cases)
    deadline = time.monotonic() + timeout
    while remaining:
        cmd = [sys.executable, "-m", "flashlse", "_worker", backend, device, ",".join(remaining)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=root)
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            timed_out = True
        for line in stdout.splitlines():
            if line.startswith(WORKER_MARK):
                cell = json.loads(line[len(WORKER_MARK):])
                cells[cell["case"]] = cell
        remaining = [r for r in remaining if r not in cells]
        if not remaining:
            break
        last = (stderr.strip().splitlines() or [""])[-1][:300]
        if timed_out:
            for r in remaining:
                cells[r] = {"status": "error", "text": "err: timeout",
                            "detail": f"no result within {timeout:.0f} s"}
            break
        # The child died on the first case it did not report.
        why = _death(proc.returncode)
        cells[remaining.pop(0)] = {"status": "crash", "text": f"crash: {why}",
                                   "detail": f"the process died ({why}) {last}".strip()}
    return cells


def _plan(device: str) -> tuple[list[str], list[str]]:
    rows, missing = [], []
    for name in BACKENDS:
        if name in OPTIONAL and importlib.util.find_spec(OPTIONAL[name]) is None:
            missing.append(name)
            continue
        rows.append(name)
    return rows, missing


def audit(device: str = "cpu", isolate: bool = True, timeout: float | None = None,
          backends=None) -> dict:
    """Runs every (backend, case) cell (of the ``backends`` named, default all);
    returns the JSON-able report."""
    t0 = time.perf_counter()
    rows, missing = _plan(device)
    if backends is not None:
        rows = [r for r in rows if r in backends]
    timeout = timeout or (50.0 if device == "cpu" else 240.0)
    cells: dict[tuple[str, str], dict] = {}
    jobs = []
    for name in rows:
        runs = BACKENDS[name][1]
        for case_id, _, _ in CASES:
            if case_id not in runs:
                cells[name, case_id] = {"status": "skip", "text": "·",
                                        "detail": "not a case of this function"}
            elif device == "cpu" and name in CUDA_ONLY:
                cells[name, case_id] = {"status": "na", "text": "n/a: needs CUDA",
                                        "detail": "a CUDA-only kernel"}
            elif device != "cpu" and name in CPU_ONLY:
                cells[name, case_id] = {"status": "na", "text": "n/a: CPU only",
                                        "detail": "a CPU-only kernel"}
        todo = [c for c in runs if (name, c) not in cells]
        if todo:
            jobs.append((name, todo))
    # Pure-PyTorch paths cannot kill the process on a CPU; native kernels (and anything on
    # CUDA, where one illegal access poisons the context) run in child processes, in
    # threads, while the pure-PyTorch cells run here.
    apart = [j for j in jobs if isolate and (device != "cpu" or j[0] in NATIVE_CPU)]
    here = [j for j in jobs if j not in apart]
    workers = max(1, min(len(apart), os.cpu_count() or 1, 6))
    with ThreadPoolExecutor(workers) as pool:
        futures = [(name, pool.submit(_run_isolated, name, device, todo, timeout))
                   for name, todo in apart]
        for name, todo in here:
            for case_id in todo:
                cells[name, case_id] = run_cell(name, case_id, device)
        for name, fut in futures:
            for case_id, cell in fut.result().items():
                cells[name, case_id] = cell
    violations = []
    for (name, case_id), cell in cells.items():
        cell.setdefault("backend", name)
        cell.setdefault("case", case_id)
        if not name.startswith("flashlse") or cell["status"] in ("skip", "na"):
            continue
        want = expected(case_id)
        if cell["status"] != "ok" or (cell["out"], cell["lse"]) != want or not cell["merge"]:
            violations.append(f"{name} / {case_id}: {cell['text']} ({cell.get('detail', '')})")
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [{"id": i, "title": t, "what": w} for i, t, w in CASES],
        "backends": [{"name": n, "what": BACKENDS[n][0]} for n in rows],
        "not_installed": missing,
        "cells": [cells[n, c] for n in rows for c, _, _ in CASES],
        "violations": violations,
        "fields": JSON_FIELDS,
        "seconds": round(time.perf_counter() - t0, 1),
    }


JSON_FIELDS = {
    "cells[].status": "how the backend ran: ok (it returned a result), na (it cannot run this "
                      "case), skip (not this kind of function), error (it raised), crash (its "
                      "process died)",
    "cells[].out / lse": "what out and lse were on the rows that see no key (merges: the "
                         "whole result): 0, NaN, fin, inf / -inf, +inf, 0, fin, NaN, sink",
    "cells[].merge": "true when flashlse.merge of this state (after conversion) with a "
                     "half-empty state equals the float64 reference merge and out has no NaN",
    "cells[].verdict": "pass / fail: the ✓ / ✗ of the table (null when there is no lse)",
    "cells[].conv": "the conversion that made it pass (fa2, eff, fi, fold), null for none",
    "violations": "flashlse cells that break the contract (0/-inf or 0/sink on empty rows, "
                  "merge exact, no conversion): the exit code is 1 when there is one",
}


LEGEND = """\
cell = out/lse on the rows that see no key (merges: the whole result), then the merge check
  out: 0 | NaN | fin (finite, non-zero) | inf      lse: -inf | +inf | 0 | fin | NaN | sink
  ✓  flashlse.merge of the state with one that is non-empty on some rows and empty on
     others equals the float64 reference merge (-inf where it should be, no NaN, close)
  ✓(fa2) ✓(eff) ✓(fi) ✓(fold)  ... only after lse.to_canonical(lse, convention): fa2 = +inf
     empty; eff = sdpa_efficient, 0 for empty rows, needs the key counts; fi = FlashInfer
     base 2; fold = NaN / +inf folded to -inf
  ✗  the merge is wrong even after conversion, or out holds NaN (NaN never passes)
  (no lse): none returned;   · not this function
  merge +inf: every merge gets the input converted from fa2's +inf first (✓(fa2))
  flashlse cells are judged without conversion: contract = 0/-inf (0/sink) ✓; a flashlse
  cell that breaks it is listed under CONTRACT VIOLATIONS and the exit code is 1"""


def format_table(report: dict) -> str:
    titles = [c["title"] for c in report["cases"]]
    names = [b["name"] for b in report["backends"]]
    by = {(c["backend"], c["case"]): c for c in report["cells"]}
    ids = [c["id"] for c in report["cases"]]
    widths = [max(len(titles[j]), *(len(by[n, ids[j]]["text"]) for n in names))
              for j in range(len(ids))]
    w0 = max(len("backend"), *map(len, names))
    line = lambda first, cols: "  ".join([first.ljust(w0)] + [s.ljust(w) for s, w in
                                                                zip(cols, widths)]).rstrip()
    out = [f"flashlse audit: empty rows on {report['device']}, torch {report['torch']} "
           f"({report['seconds']} s)", "",
           line("backend", titles), line("-" * w0, ["-" * w for w in widths])]
    for n in names:
        out.append(line(n, [by[n, i]["text"] for i in ids]))
    out += ["", LEGEND, "", "cases:"]
    out += [f"  {c['title']:<14} {c['what']}" for c in report["cases"]]
    notes = [c for c in report["cells"] if c["status"] in ("error", "crash")
             or (c["status"] == "ok" and c["merge"] is False and c["case"] in ATTN_CASES)]
    if notes:
        out += ["", "notes:"]
        out += [f"  {c['backend']} / {c['case']}: {c['detail'][:110]}" for c in notes]
    if report["not_installed"]:
        out += ["", "not installed: " + ", ".join(report["not_installed"])]
    if report["violations"]:
        out += ["", "CONTRACT VIOLATIONS (flashlse):"] + [f"  {v}" for v in report["violations"]]
    return "\n".join(out)


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flashlse audit: --device cuda but torch.cuda.is_available() is False")
    return name


def demo() -> int:
    """Two empty states merged: flashlse's identity vs the sigmoid form's NaN."""
    import flashlse as fl

    out = torch.zeros(1, 4)
    lse = torch.full((1,), -math.inf)
    print("two empty states: out = 0, lse = -inf (the identity of the merge)")
    o, l = fl.merge(out, lse, out, lse)
    print(f"  flashlse.merge      -> out {o[0].tolist()}, lse {l.item()}")
    o, l = merge_sigmoid(out, lse, out, lse)
    print(f"  sigmoid-form merge  -> out {o[0].tolist()}, lse {l.item()}")
    other = (torch.ones(1, 4), torch.zeros(1))
    o, l = fl.merge(*fl.merge(out, lse, out, lse), *other)
    print(f"  flashlse, then merged with (1, 0)  -> out {o[0].tolist()}, lse {l.item()}")
    o, l = merge_sigmoid(*merge_sigmoid(out, lse, out, lse), *other)
    print(f"  sigmoid, then merged with (1, 0)   -> out {o[0].tolist()}, lse {l.item()}")
    return 0


def bench() -> int:
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(root.glob("bench_*.py"))
    if not scripts:
        print(f"no benchmark scripts yet under {root}")
        return 0
    print("benchmarks (run on a CUDA machine; results go to benchmarks/RESULTS.md):")
    for s in scripts:
        print(f"  python {s}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(
        prog="flashlse",
        description="flashlse: exact attention whose log-sum-exp means the same on every path. "
                    "Commands: audit (how every attention backend here treats rows that see "
                    "no key), demo (merge two empty states), bench (where the benchmarks are).")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"flashlse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "audit", help="how every backend here treats rows that see no key",
        description="Runs eight cases in which a query row sees no key (or a merge meets an "
                    "empty state) on every attention backend this machine has, and prints "
                    "backend x case: out and lse on the empty rows, and whether flashlse.merge "
                    "of that state (after converting the backend's convention) equals the "
                    "float64 reference. flashlse's own cells are judged with no conversion; "
                    "the exit code is 1 when one breaks the contract.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--backend", action="append", choices=tuple(BACKENDS),
                   help="only this backend (repeatable); default: all")
    p.add_argument("--no-isolate", action="store_true",
                   help="run native kernels in this process too (a crashing peer ends the audit)")
    sub.add_parser("demo", help="merge two empty states: flashlse vs the sigmoid form")
    sub.add_parser("bench", help="where the benchmark scripts are")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    if args.command == "bench":
        return bench()
    report = audit(_resolve_device(args.device), isolate=not args.no_isolate,
                   backends=args.backend)
    print(json.dumps(report, indent=1, ensure_ascii=False) if args.json else format_table(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
