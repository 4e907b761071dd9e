"""The audit's cases: eight situations in which a query row sees no key (or a merge meets an
empty state), their inputs, float64 reference states, and what flashlse must give on them."""

from __future__ import annotations

import math

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

B, H, D = 1, 2, 32


class NotApplicable(Exception):
    """The backend cannot express the case; the message is the cell text after ``n/a:``."""


class NoOutput(RuntimeError):
    """A peer returned undefined tensors instead of out and lse."""


def _visible(sq, sk, left, right):
    from .. import masks

    ok = masks.visible(torch.arange(sq), torch.arange(sk), sq, sk, left, right)
    return torch.ones(sq, sk, dtype=torch.bool) if ok is None else ok


def make_case(case_id: str, device: str) -> dict:
    """Inputs, float64 reference state and empty-row mask of one case.

    Attention cases are kept in a 4-d form ``q4 (B, Sq, H, D)``, a dense visibility mask
    ``vis (Sq, Sk)`` that every mask-based backend uses (varlen: a document mask over the
    packed tokens, B = 1), and the reference state ``out (B, H, Sq, D)``, ``lse (B, H, Sq)``.
    Merge cases hold two states ``(H, R, D)`` / ``(H, R)``.
    """
    from .. import reference

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


def expected(case_id: str) -> tuple[str, str]:
    if case_id == "sink":
        return "0", "sink"
    if case_id == "merge_inf":
        return "fin", "fin"
    return "0", "-inf"
