"""flashlse.distributed on gloo: ring attention and merge_across_ranks equal one process.

Every case runs in one spawned group per world size (2 and 3 ranks): the workers run all
cases, send back one traceback or None per case and rank, and each parametrized test checks
its own entry. Inputs are float64 so a wrong mask or a lost block shows as a large error,
not rounding; every gradient is compared (dq dk dv dsink), against single-process
``flashlse.attention`` and the float64 reference.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import itertools
import math
import queue as queue_module
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashlse as fl
from flashlse import distributed as fld
from flashlse import masks, reference

F64 = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)

# id: world size, shard lengths (None = even split of s), layout, causal, window, sink, extra.
RING_CASES = [
    dict(id="w2-contiguous-full", world=2, s=14, layout="contiguous"),
    dict(id="w2-contiguous-causal", world=2, s=14, layout="contiguous", causal=True),
    dict(id="w2-zigzag-causal", world=2, s=16, layout="zigzag", causal=True),
    dict(id="w2-zigzag-causal-odd", world=2, s=13, layout="zigzag", causal=True, sink=True),
    dict(id="w2-zero-token-rank-causal-sink", world=2, lengths=[0, 9], layout="contiguous",
         causal=True, sink=True),
    dict(id="w2-zero-token-rank-zigzag", world=2, lengths=[7, 0], layout="zigzag",
         causal=True, sink=True),
    dict(id="w3-contiguous-causal-gqa-sink", world=3, s=21, layout="contiguous", causal=True,
         sink=True, hkv=1),
    dict(id="w3-zigzag-causal-sink", world=3, s=24, layout="zigzag", causal=True, sink=True),
    dict(id="w3-zigzag-full-softcap", world=3, s=17, layout="zigzag", softcap=2.0, scale=0.3),
    # left 3 with 8-token shards: rank 2 sees nothing of rank 0, rank 1 only 3 of its keys.
    dict(id="w3-window-empties-blocks", world=3, s=24, layout="contiguous", window=(3, 0)),
    dict(id="w3-window-zigzag-two-sided", world=3, s=24, layout="zigzag", window=(4, 2)),
    dict(id="w3-right-window-only", world=3, s=20, layout="contiguous", window=(None, 3)),
    dict(id="w3-zero-token-rank-unequal", world=3, lengths=[5, 0, 8], layout="zigzag",
         causal=True, window=(6, 0), sink=True),
    dict(id="w3-float32", world=3, s=18, layout="zigzag", causal=True, dtype=torch.float32),
    # A loss on out alone: the ring's backward passes no lse gradient to its steps.
    dict(id="w3-out-only-contiguous-causal-sink", world=3, s=21, layout="contiguous",
         causal=True, sink=True, out_only=True),
    dict(id="w3-out-only-zigzag-window-float32", world=3, s=24, layout="zigzag",
         window=(5, 1), dtype=torch.float32, out_only=True),
    dict(id="w2-out-only-compiled-causal-sink", world=2, s=13, layout="zigzag", causal=True,
         sink=True, out_only=True, compile=True),
    # A group that is not the world: ring neighbours are global ranks 1 and 2.
    dict(id="w3-subgroup-ranks-1-2", world=3, group=[1, 2], s=11, layout="zigzag",
         causal=True, sink=True),
    # torch.compile(fullgraph=True): the ring as its two custom ops (given and gathered shard
    # lengths, dynamic shapes, a subgroup found again by its name).
    dict(id="w2-compiled-zigzag-causal-sink", world=2, s=13, layout="zigzag", causal=True,
         sink=True, compile=False),
    dict(id="w3-compiled-dynamic-contiguous-gqa-sink", world=3, s=21, layout="contiguous",
         causal=True, sink=True, hkv=1, compile=True),
    dict(id="w3-compiled-subgroup-window", world=3, group=[1, 2], s=11, layout="zigzag",
         window=(4, 2), compile=False),
]

MERGE_CASES = [
    dict(id="w2-merge-replicated-sink", world=2, lengths=[6, 5], sink=True),
    dict(id="w2-merge-sum-grads", world=2, lengths=[4, 7], replicated=False),
    dict(id="w3-merge-empty-split-causal", world=3, lengths=[5, 0, 6], causal=True, sink=True),
    dict(id="w3-merge-sum-grads-empty-rows", world=3, lengths=[0, 3, 4], causal=True,
         replicated=False),
    dict(id="w2-merge-all-empty", world=2, lengths=[0, 0], sink=False),
]

# The LSE contract through the ring, eager and compiled: a NaN key at global position
# ``nan_at`` reaches exactly the rows that see it, a -inf sink is no sink (every gradient,
# dsink 0), a rank with no tokens.
CONTRACT_CASES = [
    dict(id="w2-contract-nan-key-zigzag", world=2, s=16, layout="zigzag", nan_at=5),
    dict(id="w3-contract-nan-key-compiled", world=3, s=18, layout="contiguous", nan_at=8,
         compile=True),
    dict(id="w2-contract-zero-token-rank-compiled", world=2, lengths=[9, 0],
         layout="contiguous", nan_at=4, compile=True),
    # A loss on out alone (no lse gradient: the CPU steps' backwards on torch's kernel).
    dict(id="w3-contract-nan-key-out-only", world=3, s=18, layout="zigzag", nan_at=7,
         out_only=True),
]

# Context parallel under DDP over the CP ranks (torchtitan folds them into FSDP's reduction).
DDP_CASES = [
    dict(id="w2-ddp-sink-default-local", world=2, layout="zigzag"),
    dict(id="w3-ddp-sink-default-local", world=3, layout="contiguous"),
]


class _CPBlock(torch.nn.Module):
    """q/k/v from one replicated projection, a learnable sink, causal attention."""

    def __init__(self, width=16, hq=2, hkv=1, d=8):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.qkv = torch.nn.Linear(width, (hq + 2 * hkv) * d, bias=False, dtype=F64)
        self.sink = torch.nn.Parameter(torch.randn(hq, dtype=F64))

    def forward(self, x, ring=None):
        q, k, v = self.qkv(x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.unflatten(-1, (self.hq, self.d))
        k, v = (t.unflatten(-1, (self.hkv, self.d)) for t in (k, v))
        if ring is None:
            return fl.attention(q, k, v, causal=True, sink=self.sink)
        return fld.ring_attention(q, k, v, causal=True, sink=self.sink, **ring)


def _ddp_case(c, rank, world):
    """Under DDP over the CP ranks every replicated parameter's gradient is the ranks' average
    of their own parts; with the default sink_grad ("local") the sink's is too, so each
    gradient times the world size equals one process's over the whole sequence."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(zlib.crc32(c["id"].encode()))
    s = 7 * world
    x, g_out = torch.randn(1, s, 16, dtype=F64), torch.randn(1, s, 2, 8, dtype=F64)
    single = _CPBlock()
    (single(x) * g_out).sum().backward()
    block = _CPBlock()
    block.load_state_dict(single.state_dict())
    ddp = DistributedDataParallel(block)
    lengths = fld._even_lengths(s, world, c["layout"])
    shard = lambda t: fld.split_sequence(t, lengths, layout=c["layout"], dim=1)[rank]
    out = ddp(shard(x), ring=dict(layout=c["layout"], shard_lengths=lengths))
    (out * shard(g_out)).sum().backward()
    for name, p in block.named_parameters():
        _close(f"{name}.grad x world", p.grad * world, dict(single.named_parameters())[name].grad)


def _close(name, got, want, tol=TOL):
    want = want.to(got.dtype)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}", **tol)


def _ring_case(c, rank, world):
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    group = None
    if "group" in c:
        # new_group is collective over the world; ranks outside it have nothing to do.
        group = dist.new_group(c["group"])
        if rank not in c["group"]:
            return
        rank, world = c["group"].index(rank), len(c["group"])
    dtype = c.get("dtype", F64)
    tol = TOL if dtype == F64 else dict(rtol=2e-5, atol=2e-6)
    lengths = c.get("lengths") or fld._even_lengths(c["s"], world, c["layout"])
    s, b, hq, hkv, d = sum(lengths), 2, 2, c.get("hkv", 2), 8
    q = torch.randn(b, s, hq, d, dtype=dtype)
    k = torch.randn(b, s, hkv, d, dtype=dtype)
    v = torch.randn(b, s, hkv, d + 2, dtype=dtype)
    sink = torch.randn(hq, dtype=dtype) if c.get("sink") else None
    g_out, g_lse = torch.randn(b, s, hq, d + 2, dtype=dtype), torch.randn(b, hq, s, dtype=dtype)
    kw = dict(causal=c.get("causal", False), window=c.get("window", (None, None)),
              softcap=c.get("softcap", 0.0), scale=c.get("scale"))

    # Single process over the whole sequence: flashlse.attention and the float64 reference.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_1 = None if sink is None else sink.clone().requires_grad_()
    out_1, lse_1 = fl.attention(*leaves, sink=sink_1, return_lse=True, **kw)
    # out_only: a loss on out alone (no lse gradient: the steps' backwards take no dlse).
    w_lse = 0 if c.get("out_only") else 1
    ((out_1 * g_out).sum() + w_lse * (lse_1 * g_lse).sum()).backward()
    out_ref, lse_ref = reference.attention(q, k, v, sink=sink, return_lse=True, **kw)

    shard = lambda x, dim=1: fld.split_sequence(x, lengths, layout=c["layout"], dim=dim)[rank]
    mine = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    sink_r = None if sink is None else sink.clone().requires_grad_()
    # Zigzag cases name the shard lengths (no all-gather of them); contiguous ones gather.
    given = list(lengths) if c["layout"] == "zigzag" else None
    # sink_grad="sum": dsink is the whole sequence's on every rank, as one process's.
    ring = functools.partial(fld.ring_attention, return_lse=True, layout=c["layout"],
                             group=group, shard_lengths=given, sink_grad="sum", **kw)
    if "compile" in c:  # its value: dynamic shapes
        ring = torch.compile(ring, fullgraph=True, dynamic=c["compile"], backend="aot_eager")
    out, lse = ring(*mine, sink=sink_r)
    loss = (out * shard(g_out)).sum()
    # With no lse gradient the steps' backwards run torch's CPU flash backward (counted).
    ops = importlib.import_module("flashlse.ops.attention")
    routed, sdpa_bwd = [], ops._sdpa_bwd
    ops._sdpa_bwd = lambda *a, **kw: routed.append(1) or sdpa_bwd(*a, **kw)
    try:
        (loss if w_lse == 0 else loss + (lse * shard(g_lse, 2)).sum()).backward()
    finally:
        ops._sdpa_bwd = sdpa_bwd
    # (Compiled, AOTAutograd hands the ring_bwd op a zero lse gradient: the loops run it.)
    assert bool(routed) == (w_lse == 0 and lengths[rank] > 0 and "compile" not in c), routed

    assert out.shape == (b, lengths[rank], hq, d + 2) and lse.shape == (b, hq, lengths[rank])
    _close("out vs reference", out, shard(out_ref), tol)
    _close("lse vs reference", lse, shard(lse_ref, 2), tol)
    _close("out", out, shard(out_1), tol)
    _close("lse", lse, shard(lse_1, 2), tol)
    for name, mine_t, whole in zip(("dq", "dk", "dv"), mine, leaves):
        _close(name, mine_t.grad, shard(whole.grad), tol)
    if sink is not None:
        _close("dsink", sink_r.grad, sink_1.grad, tol)


def _contract_case(c, rank, world):
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    lengths = c.get("lengths") or fld._even_lengths(c["s"], world, c["layout"])
    s, b, hq, hkv, d = sum(lengths), 1, 2, 1, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=F64) for h in (hq, hkv, hkv))
    shard = lambda x, dim=1: fld.split_sequence(x, lengths, layout=c["layout"],
                                                dim=dim)[rank]
    ring = functools.partial(fld.ring_attention, causal=True, return_lse=True,
                             layout=c["layout"], shard_lengths=list(lengths))
    if c.get("compile"):
        ring = torch.compile(ring, fullgraph=True, backend="aot_eager")

    def run(k_in, sink):
        mine = [shard(t).clone().requires_grad_() for t in (q, k_in, v)]
        sink_r = None if sink is None else sink.clone().requires_grad_()
        out, lse = ring(*mine, sink=sink_r)
        loss = out.sum()
        (loss if c.get("out_only") else loss + lse.masked_fill(torch.isneginf(lse), 0).sum()
         ).backward()
        return out.detach(), lse.detach(), [t.grad for t in mine], sink_r

    # A NaN key: causal row i sees it iff i >= nan_at; the others equal the clean call's.
    k_bad = k.clone()
    k_bad[0, c["nan_at"], 0, 0] = math.nan
    out, lse, _, _ = run(k, None)
    out_b, lse_b, _, _ = run(k_bad, None)
    sees = shard(torch.arange(s), 0) >= c["nan_at"]  # this rank's rows, in its layout
    assert out_b[:, sees].isnan().all() and lse_b[:, :, sees].isnan().all()
    assert not out_b[:, ~sees].isnan().any() and not lse_b[:, :, ~sees].isnan().any()
    _close("rows that do not see the NaN key", out_b[:, ~sees], out[:, ~sees])
    # A -inf sink is no sink: the same out, lse and gradients, dsink 0, no NaN.
    clean = run(k, None)
    sunk = run(k, torch.full((hq,), -math.inf, dtype=F64))
    assert torch.equal(sunk[0], clean[0]) and torch.equal(sunk[1], clean[1])
    for name, a, w in zip(("dq", "dk", "dv"), sunk[2], clean[2]):
        assert not a.isnan().any() and not w.isnan().any(), name
        _close(name, a, w)
    assert torch.equal(sunk[3].grad, torch.zeros(hq, dtype=F64))
    if not c.get("compile"):
        # No second derivative (the backward is a ring of kernels): a backward through the
        # gradients raises on every rank, never drops the ring's second-order terms.
        mine = [shard(t).clone().requires_grad_() for t in (q, k, v)]
        out2, _ = ring(*mine, sink=None)
        (g_q,) = torch.autograd.grad(out2.sum(), mine[0], create_graph=True)
        with pytest.raises(RuntimeError, match="has no second derivative"):
            g_q.square().sum().backward()


def _merge_case(c, rank, world):
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    lengths, causal = c["lengths"], c.get("causal", False)
    replicated = c.get("replicated", True)
    b, sq, h, d, sk = 1, 5, 2, 8, sum(c["lengths"])
    q = torch.randn(b, sq, h, d, dtype=F64)
    k, v = torch.randn(b, sk, h, d, dtype=F64), torch.randn(b, sk, h, d, dtype=F64)
    sink = torch.randn(h, dtype=F64) if c.get("sink") else None
    # Replicated: one loss on every rank; otherwise rank r's own loss, the total their sum.
    g_outs = torch.randn(world, b, sq, h, d, dtype=F64)
    g_lses = torch.randn(world, b, sq, h, dtype=F64)
    if replicated:
        g_outs[:], g_lses[:] = g_outs[0].clone(), g_lses[0].clone()
    # Single process: row i of the causal mask sees keys 0..i + sk - sq (bottom-right).
    left, right = masks.normalize_window(causal, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_1 = None if sink is None else sink.clone().requires_grad_()
    if sk:
        out_1, lse_1 = fl.attention(*leaves, sink=sink_1, causal=causal, return_lse=True)
    else:
        out_1 = torch.zeros(b, sq, h, d, dtype=F64) + 0 * leaves[0].sum()
        lse_1 = torch.full((b, h, sq), -math.inf, dtype=F64)
    lse_1t = lse_1.transpose(1, 2)
    loss_1 = sum((out_1 * g_outs[r]).sum() + (lse_1t * g_lses[r]).sum() for r in
                 range(world if not replicated else 1))
    if loss_1.requires_grad:
        loss_1.backward()

    # Rank r: q against its key range [k0, k1) with the global mask, as one partial state.
    k0 = sum(lengths[:rank])
    k1 = k0 + lengths[rank]
    mq, mk, mv = (t.clone().requires_grad_() for t in (q, k[:, k0:k1], v[:, k0:k1]))
    sink_r = None if sink is None else sink.clone().requires_grad_()
    if k1 > k0:
        ok = masks.visible(torch.arange(sq), torch.arange(k0, k1), sq, sk, left, right)
        s = torch.einsum("bqhd,bkhd->bhqk", mq, mk) / math.sqrt(d)
        if ok is not None:
            s = s.masked_fill(~ok, -math.inf)
        p, lse_p = reference.softmax_weights(s)
        out_p = torch.einsum("bhqk,bkhd->bqhd", p, mv)
        lse_p = lse_p.transpose(1, 2)
    else:
        out_p = torch.zeros(b, sq, h, d, dtype=F64) + 0 * (mq.sum() + mv.sum() + mk.sum())
        lse_p = torch.full((b, sq, h), -math.inf, dtype=F64)
    out, lse = fld.merge_across_ranks(out_p, lse_p, sink=sink_r, replicated_grad=replicated)
    ((out * g_outs[rank]).sum() + (lse * g_lses[rank]).sum()).backward()
    _close("out", out, out_1)
    _close("lse", lse, lse_1t)
    # q is replicated: each rank holds the part of dq through its own keys.
    dq = mq.grad.clone()
    dist.all_reduce(dq)
    want_dq = leaves[0].grad if leaves[0].grad is not None else torch.zeros_like(q)
    _close("dq (summed over ranks)", dq, want_dq)
    if k1 > k0:
        _close("dk", mk.grad, leaves[1].grad[:, k0:k1])
        _close("dv", mv.grad, leaves[2].grad[:, k0:k1])
    if sink is not None:
        _close("dsink", sink_r.grad, sink_1.grad)


def _worker(rank, world, init, cases, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # Nobody tears down before every rank has connected.
    dist.barrier()
    results = {}
    for c in cases:
        try:
            run = (_ring_case if c["id"] in _RING_IDS else
                   _ddp_case if c["id"] in _DDP_IDS else
                   _contract_case if c["id"] in _CONTRACT_IDS else _merge_case)
            run(c, rank, world)
            results[c["id"]] = None
        except Exception:
            results[c["id"]] = traceback.format_exc()
        # Keep the ranks in step even when one of them failed a check.
        dist.barrier()
    dist.barrier()
    queue.put((rank, results))
    dist.destroy_process_group()


_RING_IDS = {c["id"] for c in RING_CASES}
_DDP_IDS = {c["id"] for c in DDP_CASES}
_CONTRACT_IDS = {c["id"] for c in CONTRACT_CASES}
ALL_CASES = RING_CASES + MERGE_CASES + DDP_CASES + CONTRACT_CASES


def _run_group(world, tmp_path):
    cases = [c for c in ALL_CASES if c["world"] == world]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / f'rendezvous-{world}'}"
    procs = [ctx.Process(target=_worker, args=(r, world, init, cases, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 180
    try:
        while len(got) < world:
            try:
                rank, results = queue.get(timeout=1)
                got[rank] = results
            except queue_module.Empty:
                # A worker that died before reporting (import error, crash) fails fast.
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank exited with code {dead[0]} before reporting"
                assert time.monotonic() < deadline, f"ranks reported {sorted(got)} of {world}"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _run_group(world, tmp_path_factory.mktemp(f"w{world}"))
        return cache[world]

    return get


@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"])
                                  for c in ALL_CASES])
def test_distributed(case, group_results):
    got = group_results(case["world"])
    errors = [f"rank {r}:\n{got[r][case['id']]}" for r in sorted(got) if got[r][case["id"]]]
    assert not errors, "\n".join(errors)


def _sigmoid_merge(out, lse, out_b, lse_b):
    """ring-flash-attn ``_update_out_and_lse`` / torch context parallel ``_SDPAMerger``."""
    out = out - torch.sigmoid(lse_b - lse)[..., None] * (out - out_b)
    lse = lse - torch.nn.functional.logsigmoid(lse - lse_b)
    return out, lse


def test_sigmoid_merge_is_nan_on_two_empty_states():
    out = torch.zeros(2, 3, 4)
    lse = torch.full((2, 3), -math.inf)
    bad_out, bad_lse = _sigmoid_merge(out, lse, out.clone(), lse.clone())
    assert torch.isnan(bad_out).all() and torch.isnan(bad_lse).all()
    good_out, good_lse = fl.merge(out, lse, out.clone(), lse.clone())
    assert torch.equal(good_out, torch.zeros_like(out))
    assert torch.isneginf(good_lse).all()


@pytest.mark.parametrize("layout", fld.LAYOUTS)
@pytest.mark.parametrize("lengths", [[4, 4], [5, 0, 3], [0, 0, 7, 1], [3, 6, 2, 5]],
                         ids=["even", "zero-middle", "zeros-first", "unequal"])
def test_split_gather_roundtrip(lengths, layout):
    x = torch.randn(2, sum(lengths), 3)
    shards = fld.split_sequence(x, lengths, layout=layout)
    assert [s.shape[1] for s in shards] == lengths
    assert torch.equal(fld.gather_sequence(shards, layout=layout), x)
    segs = fld.shard_segments(lengths, layout)
    covered = sorted(g + i for seg in segs for _, g, n in seg for i in range(n))
    assert covered == list(range(sum(lengths)))


def test_zigzag_even_split_is_chunks_r_and_2R_minus_1_minus_r():
    x = torch.arange(16)[None]
    shards = fld.split_sequence(x, 4, layout="zigzag")
    assert shards[1].tolist() == [[2, 3, 12, 13]]
    assert shards[3].tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("layout", fld.LAYOUTS)
def test_plan_step_covers_exactly_the_global_mask(layout):
    # Every visible (row, key) pair appears in exactly one call, with the call's own
    # bottom-right window reproducing the global mask; nothing invisible is let in.
    windows = [(None, None), (None, 0), (3, 0), (0, 0), (4, 2), (None, 3), (2, None), (9, 1)]
    for lengths, (left, right) in itertools.product(
            [[5, 5], [4, 0, 7], [3, 8, 1], [6, 6, 6]], windows):
        segs = fld.shard_segments(lengths, layout)
        pos = [[g + i for _, g, n in seg for i in range(n)] for seg in segs]
        for r, o in itertools.product(range(len(lengths)), repeat=2):
            rows, keys = pos[r], pos[o]
            want = {(i, j) for i in rows for j in keys
                    if (left is None or j >= i - left) and (right is None or j <= i + right)}
            got = []
            for q0, q1, k0, k1, lw, rw in fld.plan_step(segs[r], segs[o], left, right):
                assert lw is None or lw >= 0
                assert rw is None or rw >= 0
                sq, sk = q1 - q0, k1 - k0
                for a, bb in itertools.product(range(sq), range(sk)):
                    lo, hi = masks.key_range(a, sq, sk, lw, rw)
                    if lo <= bb < hi:
                        got.append((rows[q0 + a], keys[k0 + bb]))
            assert len(got) == len(set(got)), (lengths, left, right, r, o)
            assert set(got) == want, (lengths, left, right, r, o, layout)


def test_zigzag_causal_plan_is_balanced():
    segs = fld.shard_segments([8] * 4, "zigzag")
    for r in range(4):
        work = sum((q1 - q0) * (k1 - k0) for o in range(4)
                   for q0, q1, k0, k1, *_ in fld.plan_step(segs[r], segs[o], None, 0))
        # Full blocks 4x4 each step but the diagonal one; the same on every rank.
        assert work == 4 * 4 * 2 * 3 + 8 * 8
        calls = [fld.plan_step(segs[r], segs[o], None, 0) for o in range(4)]
        assert all(len(c) == 1 for c in calls)


def test_needs_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fld.ring_attention(q, q, q)


def test_bench_cp_runs_on_gloo(tmp_path):
    # The NCCL benchmark's own CPU mode, so that the script cannot rot between GPU sessions:
    # its correctness check and the empty-shard + sink run must pass.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", os.path.join(root, "benchmarks", "bench_cp.py"),
           "--device", "cpu", "--seqlens", "256", "--heads", "2", "--head-dim", "16",
           "--warmup", "0", "--iters", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.count("check pass") == 2, res.stdout
    assert "no NaN" in res.stdout, res.stdout
