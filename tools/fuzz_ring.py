"""Seeded fuzzer of ring attention on gloo: random shardings against the float64 reference.

Every rank of a spawned group draws the same configuration from its seed: shard lengths (0
allowed, the whole sequence empty now and then), the layout (contiguous or zigzag), shard
lengths given or gathered, B, GQA, D and Dv, causal, windows, softcap, scale, a sink, and
float64 or float32 inputs. Each rank runs ``flashlse.distributed.ring_attention`` on its
shard (``sink_grad="sum"``), forward and backward (a loss on out and lse, or on out alone
in half the configurations), and compares its shard of out, lse, dq, dk, dv and the whole
dsink with the float64 reference of the whole sequence, by ``tools.fuzz``'s rule: the
-inf, +inf and NaN patterns equal, the error at most ``ATOL * scale`` (float64: 1e-9, the
ring equals one process up to rounding). One configuration in seven carries bad data,
forward only: a NaN in one element of q or k, or a sink of NaN, +inf or -inf; its NaN must
reach exactly the reference's rows.

One configuration in three fuzzes ``merge_across_ranks`` instead (split-KV over ranks): each
rank's partial state is the queries against its contiguous key range under the global mask
(computed in the configuration's dtype), merged with a sink or none, one loss on every rank
(``replicated_grad=True``) or each rank its own; out, lse, dq summed over the ranks, dk, dv
and dsink against the float64 reference over all keys.

    python -m tools.fuzz_ring --n 500 --world 3 --seed 0
    python -m tools.fuzz_ring --n 100 --compile     # the ring under torch.compile

Prints one line per failure (``--seed S --n 1`` with the same ``--world`` replays it) and a
summary; exit 1 on any failure. tests/test_fuzz.py runs it at a small count in CI.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_module
import random
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlse import distributed as fld
from flashlse import masks
from flashlse import reference as R
from tools.fuzz import _close, _poison, _sink_grad_scale, draw_window


class RingConfig:
    """A random draw for a group of ``world`` ranks (the same on every rank)."""

    def __init__(self, seed: int, world: int):
        rng = random.Random(seed)
        self.seed = seed
        # merge: merge_across_ranks of partial states over each rank's keys (split-KV).
        self.kind = rng.choice(["ring", "ring", "merge"])
        self.sq = rng.randint(0, 7)
        self.replicated = rng.random() < 0.5
        self.layout = rng.choice(["contiguous", "zigzag"])
        top = rng.choice([3, 8, 16])
        self.lengths = [rng.randint(0, top) for _ in range(world)]
        if rng.random() < 0.05:
            self.lengths = [0] * world
        self.given = rng.random() < 0.5
        self.b = rng.choice([1, 2])
        self.hkv = rng.choice([1, 2])
        self.hq = self.hkv * rng.choice([1, 2, 4])
        self.d = rng.choice([8, 16, 32])
        self.dv = self.d if rng.random() < 0.7 else rng.choice([8, 16, 32])
        self.causal = rng.random() < 0.5
        self.window = draw_window(rng, seed, 0.35)
        self.softcap = rng.choice([0.0, 0.0, 0.0, 2.5])
        self.scale = rng.choice([None, None, 0.3])
        self.sink = rng.random() < 0.4
        self.dtype = rng.choice([torch.float64, torch.float32])
        self.lse_grad = rng.random() < 0.5
        bad = random.Random(seed * 7919 + 1)
        self.bad = None
        if bad.random() < 1 / 7:
            self.bad = bad.choice(["q", "k", "sink_nan", "sink_inf", "sink_neginf"])
            self.sink = self.sink or self.bad.startswith("sink")

    def __repr__(self):
        keys = ("kind", "lengths", "sq", "replicated", "layout", "given", "b", "hq", "hkv",
                "d", "dv", "causal", "window", "softcap", "scale", "sink", "dtype", "bad",
                "lse_grad")
        return f"seed={self.seed} " + " ".join(f"{k}={getattr(self, k)}" for k in keys)


def _inputs(cfg: RingConfig):
    """The whole sequence's q, k, v, sink (float64) and the loss weights, from the seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    s = sum(cfg.lengths)
    mk = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    q, k = mk(cfg.b, s, cfg.hq, cfg.d), mk(cfg.b, s, cfg.hkv, cfg.d)
    v = mk(cfg.b, s, cfg.hkv, cfg.dv)
    sink = mk(cfg.hq, scale=2.0) if cfg.sink else None
    dout, dlse = mk(cfg.b, s, cfg.hq, cfg.dv), mk(cfg.b, cfg.hq, s)
    _poison(cfg, q, k, sink, g)
    return q, k, v, sink, dout, dlse


def _loss(out, lse, dout, dlse, lse_grad: bool):
    """``sum(out * dout)``, plus ``sum(lse * dlse)`` over lse's finite entries with
    ``lse_grad`` (else a loss on out alone: the backward gets no lse gradient)."""
    loss = (out * dout.to(out.dtype)).sum()
    if lse_grad:
        fin = torch.isfinite(lse.detach())
        loss = loss + (torch.where(fin, lse, 0) * torch.where(fin, dlse.to(lse.dtype), 0)).sum()
    return loss


def _run(fn, q, k, v, sink, dout, dlse, cfg, grad: bool):
    """``(out, lse, grads of q k v sink)`` of ``fn`` on leaves made from the given tensors."""
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    s = None if sink is None else sink.clone().requires_grad_(grad)
    out, lse = fn(*leaves, s)
    grads = [None] * 4
    if grad:
        loss = _loss(out, lse, dout, dlse, cfg.lse_grad)
        grads = list(torch.autograd.grad(loss, leaves + ([s] if s is not None else []),
                                         allow_unused=True)) + [None] * (s is None)
    return out, lse, grads


def check(cfg: RingConfig, rank: int, world: int) -> list[str]:
    """This rank's errors for ``cfg`` (every rank calls it: the ring is collective)."""
    q, k, v, sink, dout, dlse = _inputs(cfg)
    kw = dict(causal=cfg.causal, window=cfg.window, softcap=cfg.softcap, scale=cfg.scale)
    grad = cfg.bad is None
    ref = _run(lambda q, k, v, s: R.attention(q, k, v, sink=s, return_lse=True, **kw),
               q, k, v, sink, dout, dlse, cfg, grad)
    shard = lambda x, dim=1: fld.split_sequence(x, cfg.lengths, layout=cfg.layout, dim=dim)[rank]
    given = list(cfg.lengths) if cfg.given else None
    dt = cfg.dtype
    fn = _compiled_ring() if COMPILE else fld.ring_attention
    ring = lambda q, k, v, s: fn(q, k, v, sink=s, return_lse=True, layout=cfg.layout,
                                 shard_lengths=given, sink_grad="sum", **kw)
    ours = _run(ring, *(shard(t).to(dt) for t in (q, k, v)),
                None if sink is None else sink.to(torch.float32 if dt != torch.float64 else dt),
                shard(dout).to(dt), shard(dlse, 2).to(dt), cfg, grad)
    errors = []
    close = lambda name, a, b, scale=None: _close(name, a, b, None, dt, scale)
    errors.append(close("out", ours[0], shard(ref[0].detach())))
    errors.append(close("lse", ours[1], shard(ref[1].detach(), 2)))
    if grad:
        for name, mine, whole in zip(("dq", "dk", "dv"), ours[2], ref[2]):
            want = torch.zeros_like(shard(q)) if whole is None else shard(whole)
            errors.append(close(name, torch.zeros_like(want) if mine is None else mine, want))
        if sink is not None:
            dl = dlse if cfg.lse_grad else torch.zeros_like(dlse)
            dl = torch.where(torch.isfinite(ref[1].detach()), dl, 0)
            scale = _sink_grad_scale(ref[0].detach(), ref[1].detach().transpose(-1, -2), dout,
                                     dl.transpose(-1, -2), sink)
            want = ref[2][3] if ref[2][3] is not None else torch.zeros_like(sink)
            errors.append(close("dsink", ours[2][3], want, scale))
    return [e for e in errors if e]


# --compile: the ring under torch.compile(fullgraph=True, dynamic=True) (its two custom ops,
# flashlse::ring_fwd and ring_bwd), compiled once a process and recompiled per scalars.
COMPILE = False
_COMPILED = []


def _compiled_ring():
    if not _COMPILED:
        # (Each configuration's scalars are a recompile: no limit stops a long run.)
        torch._dynamo.config.recompile_limit = 1 << 20
        torch._dynamo.config.accumulated_recompile_limit = 1 << 20
        _COMPILED.append(torch.compile(fld.ring_attention, fullgraph=True, dynamic=True,
                                       backend="aot_eager"))
    return _COMPILED[0]


def check_merge(cfg: RingConfig, rank: int, world: int) -> list[str]:
    """merge_across_ranks of each rank's partial state (the queries against its contiguous
    key range, the global mask, float64 or float32) against the float64 reference of all
    keys: out, lse, dq (summed over the ranks: q is replicated), dk, dv, dsink. Replicated:
    one loss on every rank; otherwise each rank's own, the total their sum. (Heads ``hq``
    for q, k and v, no softcap: the merge is under test, not the partials.)"""
    g = torch.Generator().manual_seed(cfg.seed)
    mk = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    sk, sq, dt = sum(cfg.lengths), cfg.sq, cfg.dtype
    q, k = mk(cfg.b, sq, cfg.hq, cfg.d), mk(cfg.b, sk, cfg.hq, cfg.d)
    v = mk(cfg.b, sk, cfg.hq, cfg.dv)
    sink = mk(cfg.hq, scale=2.0) if cfg.sink else None
    d_outs, d_lses = mk(world, cfg.b, sq, cfg.hq, cfg.dv), mk(world, cfg.b, sq, cfg.hq)
    if cfg.replicated:
        d_outs[:], d_lses[:] = d_outs[0].clone(), d_lses[0].clone()
    _poison(cfg, q, k, sink, g)
    grad = cfg.bad is None
    scale = cfg.scale if cfg.scale is not None else cfg.d ** -0.5
    left, right = masks.normalize_window(cfg.causal, cfg.window)

    loss_of = lambda out, lse, ranks: sum(_loss(out, lse, d_outs[r], d_lses[r], cfg.lse_grad)
                                          for r in ranks)

    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    sink_1 = None if sink is None else sink.clone().requires_grad_(grad)
    out_1, lse_1 = R.attention(*leaves, sink=sink_1, causal=cfg.causal, window=cfg.window,
                               scale=scale, return_lse=True)
    lse_1 = lse_1.transpose(1, 2)
    ref_grads = [None] * 4
    if grad:
        loss = loss_of(out_1, lse_1, range(1 if cfg.replicated else world))
        wrt = leaves + ([sink_1] if sink_1 is not None else [])
        ref_grads = list(torch.autograd.grad(loss, wrt, allow_unused=True)) + [None] * (
            sink is None)

    k0 = sum(cfg.lengths[:rank])
    k1 = k0 + cfg.lengths[rank]
    mq, mk_, mv = (t.to(dt).clone().requires_grad_(grad) for t in (q, k[:, k0:k1], v[:, k0:k1]))
    sink_r = None if sink is None else sink.to(dt).clone().requires_grad_(grad)
    s = torch.einsum("bqhd,bkhd->bhqk", mq, mk_) * scale
    ok = masks.visible(torch.arange(sq), torch.arange(k0, k1), sq, sk, left, right)
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    p, lse_p = R.softmax_weights(s)
    out_p = torch.einsum("bhqk,bkhd->bqhd", p, mv)
    out, lse = fld.merge_across_ranks(out_p, lse_p.transpose(1, 2), sink=sink_r,
                                      replicated_grad=cfg.replicated)
    errors = [_close("out", out, out_1.detach(), None, dt),
              _close("lse", lse, lse_1.detach(), None, dt)]
    if grad:
        params = [mq, mk_, mv] + ([sink_r] if sink_r is not None else [])
        got = list(torch.autograd.grad(loss_of(out, lse, [rank]), params, allow_unused=True))
        got = [torch.zeros_like(t) if x is None else x for x, t in zip(got, params)]
        dist.all_reduce(got[0])  # (q is replicated: each rank holds the part through its keys)
        whole = leaves + ([sink_1] if sink_1 is not None else [])
        want = [torch.zeros_like(t) if w is None else w for w, t in zip(ref_grads, whole)]
        want[1], want[2] = want[1][:, k0:k1], want[2][:, k0:k1]
        for name, a, w in zip(("dq (summed)", "dk", "dv", "dsink"), got, want):
            errors.append(_close(name, a, w, None, dt))
    return [e for e in errors if e]


def _worker(rank, world, port, seed, n, seconds, results, compile_ring=False):
    global COMPILE
    COMPILE = compile_ring
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    failures, ran, t0 = [], 0, time.perf_counter()
    try:
        for s in range(seed, seed + n):
            # Every rank stops at the same seed (rank 0's clock decides).
            stop = torch.tensor([seconds is not None and time.perf_counter() - t0 > seconds])
            dist.broadcast(stop, 0)
            if bool(stop):
                break
            cfg = RingConfig(s, world)
            try:
                errors = (check if cfg.kind == "ring" else check_merge)(cfg, rank, world)
            except Exception as e:  # noqa: BLE001 - a crash is a failure to report
                errors = [f"raised {type(e).__name__}: {str(e)[:200]}"]
            if errors:
                failures.append((repr(cfg), errors))
            ran += 1
    except Exception:  # noqa: BLE001 - a broken group (a hang's timeout): report, then stop
        failures.append(("group", [traceback.format_exc(limit=3)]))
    results.put((rank, ran, failures))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fuzz(n: int, seed: int = 0, world: int = 3, seconds: float | None = None,
         verbose: bool = True, compile_ring: bool = False):
    """Runs ``n`` configurations from ``seed`` on a spawned gloo group of ``world`` ranks
    (fewer if ``seconds`` runs out); returns ``(configurations run, failures)``, a failure
    ``(rank, config, errors)``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, seed, n, seconds, results,
                                               compile_ring))
             for port in [_free_port()] for r in range(world)]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + (seconds or 10 * n) + 300
    while len(got) < world and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=5))
        except queue_module.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    failures = [(r, c, e) for r, _, fs in got for c, e in fs]
    if len(got) < world:
        failures.append((-1, "group", [f"{world - len(got)} ranks gave no result"]))
    if verbose:
        for r, c, e in failures:
            print(f"FAIL rank {r} {c}: {'; '.join(e)}", flush=True)
    return (max((ran for _, ran, _ in got), default=0), failures)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    ap.add_argument("--compile", action="store_true",
                    help="the ring under torch.compile (fullgraph, dynamic, aot_eager)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ran, failures = fuzz(args.n, args.seed, args.world, args.seconds, compile_ring=args.compile)
    print(f"fuzz_ring: {ran} configurations on {args.world} gloo ranks, seeds "
          f"{args.seed}..{args.seed + ran - 1}: {len(failures)} failures, "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
