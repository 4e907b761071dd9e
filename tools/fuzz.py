"""Seeded fuzzer: random configurations of every public function against the float64 reference.

Each configuration draws shapes (zero lengths included), masks (causal, windows), GQA, Dv != D,
a sink, softcap, and per function: varlen sequences of length 0 and seqused_k; mixed serving
steps over paged caches (attention_varlen with a block table, pages of 1-128 rows, chunks of
up to 150 rows now and then); contiguous or paged caches
(page 1, 3, 16, shuffled pages) with k_new and 0-3 splits, a third of the contiguous ones
left-padded (``cache_leftpad``), the slots no row reads NaN (or, in 40%, finite); sparse
top-k lists with -1 entries and all -1 rows; merges of 1-6 states with empty ones and a
sink. Forward and, where the function is differentiable, backward (a random dout and dlse,
dlse 0 on empty rows; in half the configurations no lse gradient at all, a loss on out
alone). A
configuration passes when, for out, lse and every gradient: the -inf, +inf and NaN patterns
equal the reference's (which has no NaN or +inf on clean data), and the error is at
most ``2 * err(the reference computed in the inputs' dtype) + atol`` (docs/design.md §5; fp32:
1e-4 of the scale). One configuration in seven (not merges) carries bad data, forward only: a
NaN in one element of q or of k (or of the cache: maybe a slot no row reads), or a sink of
NaN, +inf or -inf; its NaN must reach exactly the reference's rows (docs/math.md section 7).

    python -m tools.fuzz --n 10000                          # CPU path, float32
    python -m tools.fuzz --n 2000 --device cuda --dtype bf16 # the kernels
    TRITON_INTERPRET=1 python -m tools.fuzz --n 50          # kernels under the interpreter

Prints one line per failure (its seed reproduces it: ``--seed S --n 1``) and a summary.
tests/test_fuzz.py and tests/kernels/test_fuzz_kernels.py run it at a small count in CI.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import flashlse as fl
from flashlse import reference as R

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (float64: tools/fuzz_ring.py's float64 runs, where the ring equals one process up to
# rounding.)
ATOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class Config:
    """A random draw; ``rng`` is seeded per configuration so each one replays alone."""

    def __init__(self, seed: int, gpu: bool):
        rng = random.Random(seed)
        self.seed, self.rng = seed, rng
        self.kind = rng.choice(["attention", "attention", "varlen", "varlen_paged", "kvcache",
                                "kvcache", "sparse", "merge"])
        self.hkv = rng.choice([1, 2])
        self.hq = self.hkv * rng.choice([1, 2, 4])
        dims = [32, 64, 128] if gpu else [16, 32, 59, 64]
        self.d = rng.choice(dims)
        self.dv = self.d if rng.random() < 0.7 else rng.choice(dims)
        self.causal = rng.random() < 0.5
        self.window = draw_window(rng, seed, 0.3)
        self.softcap = rng.choice([0.0, 0.0, 0.0, 2.5])
        self.sink = rng.random() < 0.4
        # Bad data, from a generator of its own (every seed's other draws stay as they were).
        bad = random.Random(seed * 7919 + 1)
        self.bad = None
        if self.kind != "merge" and bad.random() < 1 / 7:
            self.bad = bad.choice(["q", "k", "sink_nan", "sink_inf", "sink_neginf"])
            self.sink = self.sink or self.bad.startswith("sink")
        # Half the backward passes without an lse gradient (a loss on out only: dlse None,
        # the common case, which the CPU path runs on torch's own kernel), from a
        # generator of its own too.
        self.lse_grad = random.Random(seed * 104723 + 5).random() < 0.5

    def __repr__(self):
        keys = ("kind", "hq", "hkv", "d", "dv", "causal", "window", "softcap", "sink", "bad",
                "lse_grad")
        return f"seed={self.seed} " + " ".join(f"{k}={getattr(self, k)}" for k in keys)


def draw_window(rng, seed: int, p: float) -> tuple:
    """A window with probability ``p`` (else none), from ``rng``; a quarter of them with a
    side near 2^31 (the kernels' int32 row bounds; from 2^30 on a side is unbounded), from a
    generator of their own, so that ``rng``'s later draws stay as they were."""
    if rng.random() >= p:
        return (None, None)
    window = (rng.choice([None, 0, 1, 3, 8]), rng.choice([None, 0, 2, 5]))
    huge = random.Random(seed * 104729 + 3)
    if huge.random() < 0.25:
        side = huge.choice([2**30 - 1, 2**30, 2**31 - 2])
        window = (side, window[1]) if huge.random() < 0.5 else (window[0], side)
    return window


def _over(seed: int) -> tuple[int, int]:
    """How far a varlen draw's max_seqlen_q / max_seqlen_k lie above the longest sequence
    (upper bounds, as flash-attn's callers pass a model's longest context): 0 in three draws
    of four; from a generator of its own, so the other draws stay as they were."""
    over = random.Random(seed * 104729 + 7)
    if over.random() < 0.75:
        return 0, 0
    return over.choice([0, 1, 1000, 2**40]), over.choice([0, 1, 1000, 2**40])


def _randn(g, *shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def _poison(cfg, q, k, sink, g):
    """``cfg.bad`` applied in place: NaN in one random element of ``q`` or ``k``, or head
    h's sink NaN / +inf / -inf."""
    if cfg.bad in ("q", "k"):
        t = q if cfg.bad == "q" else k
        if t.numel():
            i = int(torch.randint(t.numel(), (1,), generator=g))
            t.view(-1)[i] = float("nan")
    elif cfg.bad is not None and sink is not None and sink.numel():
        h = int(torch.randint(sink.numel(), (1,), generator=g))
        sink[h] = {"sink_nan": float("nan"), "sink_inf": float("inf"),
                   "sink_neginf": float("-inf")}[cfg.bad]


def _close(name, ours, ref, base, dtype, scale=None):
    """The house rule, returning an error string or None. ``scale``: the magnitude the
    error is measured against where it is not ``max |ref|`` (a sum that cancels)."""
    if ours is None or ref is None:
        return None if ours is None and ref is None else f"{name}: missing"
    ours, ref = ours.detach().double().cpu(), ref.detach().double().cpu()
    if ours.shape != ref.shape:
        return f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(test(ours), test(ref)):
            return f"{name}: {what} pattern differs ({int(test(ours).sum())} against the " \
                   f"reference's {int(test(ref).sum())})"
    fin = torch.isfinite(ref)
    if not fin.any():
        return None
    scale = max(1.0, float(ref[fin].abs().max()), scale or 0.0)
    err = float((ours[fin] - ref[fin]).abs().max())
    tol = ATOL[dtype] * scale
    if base is not None and dtype != torch.float32:
        # The yardstick where it is finite: torch's bf16 matmul on CPUs with AMX (oneDNN's
        # brgemm, K not a multiple of 32) can leak a NaN row of P into its neighbour row of
        # P @ V, so the baseline (torch's own math in bf16) may be NaN where the float64
        # reference is not. ``ours`` is still held to every finite reference element.
        base = base.detach().double().cpu()
        usable = fin & torch.isfinite(base)
        if usable.any():
            tol += 2 * float((base[usable] - ref[usable]).abs().max())
    return None if err <= tol else f"{name}: error {err:.2e} > tol {tol:.2e}"


def _sink_grad_scale(out, lse_rows, dout, dlse_rows, sink):
    """The size of the sum behind ``dsink``: ``dsink_h = -sum_rows p_h Delta`` with
    ``p_h = e^(sink_h - L)`` and ``Delta = dout . out - dlse`` of either sign, so the sum
    cancels and its rounding error scales with ``sum |p_h Delta|``, not ``|dsink_h|`` (a sum's
    condition number). Computed from the float64 reference; ``lse_rows`` is ``out.shape[:-1]``."""
    delta = (dout * out).sum(-1) - dlse_rows
    terms = torch.exp(sink - lse_rows) * delta
    return float(terms.abs().flatten(0, -2).sum(0).max()) if terms.numel() else 0.0


def _compare(fn, ref_fn, diff, const, dtype, grad, lse_rows=lambda lse: lse.transpose(-1, -2),
             lse_grad=True):
    """Runs ``fn`` (ours), ``ref_fn`` in float64 and in ``dtype`` (the baseline); compares out,
    lse and, with ``grad``, the gradient of every tensor in ``diff`` (of a loss on out and
    lse, or on out alone without ``lse_grad``). ``lse_rows`` turns an lse into
    ``out.shape[:-1]`` (attention's ``(B, H, Sq)`` and ``(H, total)`` by default)."""
    errors = []
    runs = {}
    sink_scale = None
    for name, f, cast in (("ours", fn, None), ("ref", ref_fn, torch.float64),
                          ("base", ref_fn, dtype)):
        if name == "base" and dtype == torch.float32:
            continue
        leaves = {k: (v.to(cast) if cast is not None and v.is_floating_point() else v).detach()
                  .requires_grad_(grad and v.is_floating_point()) for k, v in diff.items()}
        c = {k: v.to(cast) if cast is not None and isinstance(v, torch.Tensor)
             and v.is_floating_point() else v for k, v in const.items()}
        if name == "base":
            with R.computed_in(dtype):
                out, lse = f(**leaves, **c)
        else:
            out, lse = f(**leaves, **c)
        grads = {}
        if grad:
            g = torch.Generator().manual_seed(7)
            dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
            dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse)
            dlse = torch.where(torch.isfinite(lse.detach()), dlse, torch.zeros_like(dlse))
            loss = (out * dout).sum()
            if lse_grad:
                loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
            else:
                dlse = torch.zeros_like(dlse)  # (for dsink's scale below)
            params = [v for v in leaves.values() if v.requires_grad]
            got = torch.autograd.grad(loss, params, allow_unused=True)
            grads = {k: gr for k, gr in zip([k for k, v in leaves.items() if v.requires_grad],
                                            got)}
            if name == "ref" and "sink" in leaves:
                sink_scale = _sink_grad_scale(out.detach(), lse_rows(lse.detach()), dout,
                                              lse_rows(dlse), leaves["sink"].detach())
        runs[name] = (out, lse, grads)
    ours, ref = runs["ours"], runs["ref"]
    base = runs.get("base", (None, None, {}))
    for i, name in enumerate(("out", "lse")):
        errors.append(_close(name, ours[i], ref[i], base[i], dtype))
    for k, got in ours[2].items():
        # An input the result does not depend on has no reference gradient: zeros.
        want = ref[2][k] if ref[2][k] is not None else torch.zeros_like(got, dtype=torch.float64)
        got = got if got is not None else torch.zeros_like(want)
        errors.append(_close(f"d{k}", got, want, base[2].get(k), dtype,
                             scale=sink_scale if k == "sink" else None))
    return [e for e in errors if e]


def run_attention(cfg, device, dtype):
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    b, sq, sk = r.choice([1, 2]), r.randint(0, 40), r.randint(0, 40)
    # On a GPU, half the draws tile-aligned at D = 128 (S_q % 64 == S_k % 128 == 0: the Hopper
    # forward's persistent form), from a generator of their own (the other draws stay).
    aligned = random.Random(cfg.seed * 104729 + 3)
    if device == "cuda" and aligned.random() < 0.5:
        sq, sk = aligned.choice([64, 128, 192, 320]), aligned.choice([128, 256, 384])
        cfg.d = cfg.dv = 128
    mk = lambda *s, scale=1.0: _randn(g, *s, device=device, dtype=dtype, scale=scale)
    diff = dict(q=mk(b, sq, cfg.hq, cfg.d), k=mk(b, sk, cfg.hkv, cfg.d),
                v=mk(b, sk, cfg.hkv, cfg.dv))
    if cfg.sink:
        diff["sink"] = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0)
    _poison(cfg, diff["q"], diff["k"], diff.get("sink"), g)
    const = dict(causal=cfg.causal, window=cfg.window, softcap=cfg.softcap, return_lse=True)
    return _compare(fl.attention, R.attention, diff, const, dtype, grad=cfg.bad is None,
                    lse_grad=cfg.lse_grad)


def run_varlen(cfg, device, dtype):
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    n = r.randint(1, 4)
    lq = [r.choice([0, r.randint(1, 20)]) for _ in range(n)]
    lk = [r.choice([0, r.randint(1, 20)]) for _ in range(n)]
    # A third of the draws repeat one sequence's lengths (the CPU path's batched runs of
    # equal sequences), from a generator of their own (the other draws stay as they were).
    runs = random.Random(cfg.seed * 15485863 + 11)
    if runs.random() < 1 / 3:
        reps = [runs.randint(1, 4) for _ in range(n)]
        lq = [x for x, m in zip(lq, reps) for _ in range(m)]
        lk = [x for x, m in zip(lk, reps) for _ in range(m)]
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()),
                                 dtype=torch.int32, device=device)
    mk = lambda *s: _randn(g, *s, device=device, dtype=dtype)
    diff = dict(q=mk(sum(lq), cfg.hq, cfg.d), k=mk(sum(lk), cfg.hkv, cfg.d),
                v=mk(sum(lk), cfg.hkv, cfg.dv))
    if cfg.sink:
        diff["sink"] = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0)
    over_q, over_k = _over(cfg.seed)
    const = dict(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=max(lq) + over_q,
                 max_seqlen_k=max(lk) + over_k, causal=cfg.causal, window=cfg.window,
                 softcap=cfg.softcap, return_lse=True)
    if r.random() < 0.4:
        const["seqused_k"] = torch.tensor([r.randint(0, x) for x in lk], dtype=torch.int32,
                                          device=device)
    _poison(cfg, diff["q"], diff["k"], diff.get("sink"), g)
    return _compare(fl.attention_varlen, R.attention_varlen, diff, const, dtype,
                    grad=cfg.bad is None, lse_grad=cfg.lse_grad)


def _paged(k_cache, v_cache, page, g):
    b, smax = k_cache.shape[:2]
    n_pages = -(-smax // page)
    total = b * n_pages + 2
    perm = torch.randperm(total, generator=g)[: b * n_pages].view(b, n_pages)
    kp = torch.full((total, page) + k_cache.shape[2:], float("nan"), dtype=k_cache.dtype)
    vp = torch.full((total, page) + v_cache.shape[2:], float("nan"), dtype=v_cache.dtype)
    for i in range(b):
        for j in range(n_pages):
            s0, s1 = j * page, min(smax, (j + 1) * page)
            kp[perm[i, j], : s1 - s0] = k_cache[i, s0:s1].cpu()
            vp[perm[i, j], : s1 - s0] = v_cache[i, s0:s1].cpu()
    dev = k_cache.device
    table = perm.to(torch.int32)
    if random.Random(g.initial_seed() * 7919 + 11).random() < 0.25:
        # A quarter of the tables are sliced from a wider one (a serving engine's persistent
        # table): the columns past the slice name a NaN page, so a kernel stepping rows by
        # the width rather than the row stride fails. (Its own generator: the other draws
        # stay as they were.)
        unused = sorted(set(range(total)) - set(perm.flatten().tolist()))[0]
        wide = torch.full((b, n_pages + 3), unused, dtype=torch.int32)
        wide[:, :n_pages] = table
        return kp.to(dev), vp.to(dev), wide.to(dev)[:, :n_pages]
    return kp.to(dev), vp.to(dev), table.to(dev)


def run_kvcache(cfg, device, dtype):
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    b, sq, smax = r.choice([1, 2, 3]), r.choice([1, 1, 2, 5, 20]), r.randint(4, 48)
    s_new = r.choice([0, 0, 1, 3])
    lens = [r.randint(0, smax - s_new) for _ in range(b)]
    mk = lambda *s: _randn(g, *s, device=device, dtype=dtype)
    t = dict(q=mk(b, sq, cfg.hq, cfg.d), k_cache=mk(b, smax, cfg.hkv, cfg.d),
             v_cache=mk(b, smax, cfg.hkv, cfg.dv),
             cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device))
    # The slots no row reads hold NaN, or in 40% of the configurations (their own generator:
    # the other draws stay) the finite random values already there, as in a reused cache:
    # what the CPU path's one masked call of a batch (attention.sdpa_fwd_ranges) reads as
    # masked keys, where a NaN sends it to a call a sequence.
    unread = float("nan") if random.Random(cfg.seed * 104729 + 9).random() >= 0.4 else None
    for i, n in enumerate(lens):
        if unread is not None:
            t["k_cache"][i, n:] = unread
            t["v_cache"][i, n:] = unread
    if s_new:
        t["k_new"], t["v_new"] = mk(b, s_new, cfg.hkv, cfg.d), mk(b, s_new, cfg.hkv, cfg.dv)
    if r.random() < 0.5:
        t["k_cache"], t["v_cache"], t["block_table"] = _paged(
            t["k_cache"], t["v_cache"], r.choice([1, 3, 16]), g)
    leftpad = random.Random(cfg.seed * 104729 + 7)  # (its own generator: the others stay)
    if "block_table" not in t and leftpad.random() < 0.35:
        # A left-padded batch (cache_leftpad): the rows before each start, read by no one,
        # as the slots past the lengths.
        starts = [leftpad.randint(0, n + s_new) for n in lens]
        t["cache_leftpad"] = torch.tensor(starts, dtype=torch.int32, device=device)
        for i, lo in enumerate(starts):
            if unread is not None:
                t["k_cache"][i, :lo] = unread
                t["v_cache"][i, :lo] = unread
    if cfg.sink:
        t["sink"] = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0)
    _poison(cfg, t["q"], t["k_cache"], t.get("sink"), g)
    splits = r.choice([0, 1, 3])
    forced = random.Random(cfg.seed * 104729 + 5)  # (its own generator: the others stay)
    if forced.random() < 0.05:
        splits = forced.choice([7, 2**40])  # past the key tiles: capped at one a tile
    kw = dict(causal=cfg.causal, window=cfg.window, softcap=cfg.softcap,
              num_splits=splits, return_lse=True)
    copy = lambda d, cast=None: {k: (v.clone().to(cast) if cast and v.is_floating_point()
                                     else v.clone()) if isinstance(v, torch.Tensor) else v
                                 for k, v in d.items()}
    with torch.no_grad():
        ours_t = copy(t)
        out, lse = fl.attention_with_kvcache(**ours_t, **kw)
        ref_t = copy(t, torch.float64)
        ref = R.attention_with_kvcache(**ref_t, **kw)
        base = (None, None)
        if dtype != torch.float32:
            with R.computed_in(dtype):
                base = R.attention_with_kvcache(**copy(t), **kw)
    errors = [_close("out", out, ref[0], base[0], dtype),
              _close("lse", lse, ref[1], base[1], dtype)]
    for name in ("k_cache", "v_cache"):
        if not torch.equal(torch.nan_to_num(ours_t[name].double(), 7.0),
                           torch.nan_to_num(ref_t[name], 7.0)):
            errors.append(f"{name}: append differs")
    return [e for e in errors if e]


def run_sparse(cfg, device, dtype):
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    b, sq, sk, topk = r.choice([1, 2]), r.randint(0, 24), r.randint(0, 40), r.randint(1, 12)
    mk = lambda *s: _randn(g, *s, device=device, dtype=dtype)
    idx = torch.randint(-1, max(sk, 1), (b, sq, cfg.hkv, topk), generator=g)
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.3, -1, idx)
    if sk == 0:
        idx.fill_(-1)
    if sq:
        idx[:, 0] = -1  # an empty row
    diff = dict(q=mk(b, sq, cfg.hq, cfg.d), k=mk(b, sk, cfg.hkv, cfg.d),
                v=mk(b, sk, cfg.hkv, cfg.dv))
    if cfg.sink:
        diff["sink"] = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0)
    _poison(cfg, diff["q"], diff["k"], diff.get("sink"), g)
    const = dict(indices=idx.to(torch.int32).to(device), return_lse=True)
    return _compare(fl.sparse_attention, R.sparse_attention, diff, const, dtype,
                    grad=cfg.bad is None, lse_grad=cfg.lse_grad)


def run_merge(cfg, device, dtype):
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    n, shape = r.randint(1, 6), (r.randint(1, 3), r.randint(1, 9), cfg.hq)
    outs = _randn(g, n, *shape, cfg.dv, device=device, dtype=dtype)
    lses = _randn(g, n, *shape, device=device, dtype=torch.float32, scale=3.0)
    lses = torch.where(torch.rand(lses.shape, generator=g).to(device) < 0.3, float("-inf"), lses)
    diff = dict(outs=outs, lses=lses)
    if cfg.sink:
        diff["sink"] = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0)
    grad = dtype == torch.float32 or device == "cpu"
    # States of shape (n, a, b, H): rows layout (lses = outs.shape[:-1]), named explicitly.
    ours = lambda **kw: fl.merge_states(**kw, layout="rows")
    return _compare(ours, R.merge_states, diff, {}, dtype, grad=grad, lse_rows=lambda lse: lse)


def run_varlen_paged(cfg, device, dtype):
    """A serving step: attention_varlen over a paged cache (forward only)."""
    r, g = cfg.rng, torch.Generator().manual_seed(cfg.seed)
    n, page = r.randint(1, 4), r.choice([1, 3, 16, 32, 64, 128])
    # Now and then chunks longer than 16 packed rows on caches of several tiles: on an H200
    # at D = 128 the Hopper paged kernel's path (pages of 16 rows and more).
    long = r.random() < 0.3
    lk = [r.randint(0, 300 if long else 40) for _ in range(n)]
    lq = [r.choice([0, 1, min(x, r.randint(1, 150 if long else 12))]) for x in lk]
    smax = max(max(lk), 1)
    k = _randn(g, n, smax, cfg.hkv, cfg.d, device=device, dtype=dtype)
    v = _randn(g, n, smax, cfg.hkv, cfg.dv, device=device, dtype=dtype)
    for i, length in enumerate(lk):  # slots past each length: NaN, never read
        k[i, length:] = float("nan")
        v[i, length:] = float("nan")
    k_cache, v_cache, table = _paged(k, v, page, g)
    q = _randn(g, sum(lq), cfg.hq, cfg.d, device=device, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    kw = dict(seqused_k=torch.tensor(lk, dtype=torch.int32, device=device), block_table=table,
              causal=cfg.causal, window=cfg.window, softcap=cfg.softcap, return_lse=True)
    sink = _randn(g, cfg.hq, device=device, dtype=torch.float32, scale=2.0) if cfg.sink else None
    _poison(cfg, q, k_cache, sink, g)
    over_q, over_k = _over(cfg.seed)
    with torch.no_grad():
        out, lse = fl.attention_varlen(q, k_cache, v_cache, cu_q, None, max(lq) + over_q,
                                       max(lk) + over_k, sink=sink, **kw)
        f64 = lambda t: t.double() if t is not None else None
        ref = R.attention_varlen(f64(q), f64(k_cache), f64(v_cache), cu_q, None, max(lq),
                                 max(lk), sink=f64(sink), **kw)
        base = (None, None)
        if dtype != torch.float32:
            with R.computed_in(dtype):
                base = R.attention_varlen(q, k_cache, v_cache, cu_q, None, max(lq), max(lk),
                                          sink=sink, **kw)
    errors = [_close("out", out, ref[0], base[0], dtype),
              _close("lse", lse, ref[1], base[1], dtype)]
    return [e for e in errors if e]


RUN = {"attention": run_attention, "varlen": run_varlen, "varlen_paged": run_varlen_paged,
       "kvcache": run_kvcache,
       "sparse": run_sparse, "merge": run_merge}


def fuzz(n: int, seed: int = 0, device: str = "cpu", dtype=torch.float32, verbose=True,
         seconds: float | None = None):
    """Runs ``n`` configurations from ``seed`` (or fewer, stopping after ``seconds``);
    returns ``(counts by kind, failures)``."""
    counts, failures = {}, []
    t0 = time.perf_counter()
    for s in range(seed, seed + n):
        if seconds is not None and time.perf_counter() - t0 > seconds:
            break
        cfg = Config(s, device == "cuda")
        counts[cfg.kind] = counts.get(cfg.kind, 0) + 1
        try:
            errors = RUN[cfg.kind](cfg, device, dtype)
        except Exception as e:  # noqa: BLE001 - a crash is a failure to report, not to stop on
            errors = [f"raised {type(e).__name__}: {str(e)[:200]}"]
        if errors:
            failures.append((cfg, errors))
            if verbose:
                print(f"FAIL {cfg}: {'; '.join(errors)}", flush=True)
    return counts, failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = ap.parse_args()
    t0 = time.perf_counter()
    counts, failures = fuzz(args.n, args.seed, args.device, DTYPES[args.dtype],
                            seconds=args.seconds)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    ran = sum(counts.values())
    last = args.seed + ran - 1
    print(f"fuzz: {ran} configurations ({kinds}) on {dev} {args.dtype}, seeds "
          f"{args.seed}..{last}: {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
