"""Context-parallel ring attention over NCCL: correctness against one GPU, time per token.

    torchrun --nproc-per-node 8 benchmarks/bench_cp.py --seqlens 32768 131072 [--results]
    torchrun --nproc-per-node 1 benchmarks/bench_cp.py --seqlens 8192          # smoke run
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --device cpu --seqlens 512 \
        --heads 2 --head-dim 32 --iters 1                                       # gloo, CPU

bf16, D=128, H=16, causal, both layouts. For each total length S and layout it
(1) checks out, lse, dq, dk, dv against single-GPU flashlse on the whole sequence (where it
fits; ``--check-max-seqlen``) by the tests' rule ``err(ring) <= 2 err(one GPU) + atol``,
both errors against a float32 PyTorch-path result; (2) times forward and backward (max over
ranks) against one GPU, per token and as TFLOP/s per GPU (``4 B H S^2 D``, halved for
causal, backward 2.5x); (3) estimates the fraction of communication hidden behind compute,
``(t_compute + t_comm - t_ring) / t_comm`` with the compute (the same ring with each
message replaced by a local copy: attention calls, merges and accumulators, no network)
and the communication (the same messages, no compute) timed alone (up to
``--hidden-max-seqlen``). Then one run with an empty shard and a sink checks for NaN.
``--results`` appends dated rows to benchmarks/RESULTS.md.
"""

import os

# NVLink multicast stays off on the lent machines (issue 7), before torch or NCCL load.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# Runnable from a checkout that is not pip-installed (the lent machines get a copy).
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse import distributed as fld  # noqa: E402
from flashlse.ops.attention import attn_bwd_torch, attn_fwd_torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"],
                   choices=fld.LAYOUTS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--check-max-seqlen", type=int, default=131072,
                   help="compare with one GPU (and the float32 path) up to this length")
    p.add_argument("--hidden-max-seqlen", type=int, default=1 << 20,
                   help="estimate the hidden communication up to this length (above it the "
                        "compute-alone and comm-alone runs would double a long run's time)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kind", default="", help="machine label for RESULTS.md, e.g. nvidia-h200-x8")
    p.add_argument("--results", action="store_true", help="append rows to benchmarks/RESULTS.md")
    return p.parse_args()


def setup(args):
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    # The first collective sets up the communicators; keep it out of every timing.
    dist.barrier()
    return device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, iters):
    """Seconds per call, the slowest rank's (the ring finishes with its slowest member)."""
    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def inputs(s, args, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (args.batch, s, args.heads, args.head_dim)
    mk = lambda: torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    return mk(), mk(), mk(), mk()


def max_err(a, b):
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = (a.float() - b.float()).abs().masked_fill(both_inf, 0)
    return d.max().item() if d.numel() else 0.0


def all_max(x, device):
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fp32_state(q, k, v, dout, causal):
    """Float32 forward and backward of the PyTorch path, chunked: the accuracy yardstick."""
    left, right = (None, 0) if causal else (None, None)
    kw = dict(left=left, right=right, softcap=0.0, scale=1 / math.sqrt(q.shape[-1]))
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, dout))
    out, lse = attn_fwd_torch(q32, k32, v32, sink=None, **kw)
    dq, dk, dv, _ = attn_bwd_torch(do32, torch.zeros_like(lse), q32, k32, v32, out, lse,
                                   sink=None, **kw)
    return out, lse, dq, dk, dv


def one_gpu(q, k, v, dout, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fl.attention(*leaves, causal=causal, return_lse=True)
    out.backward(dout)
    return out.detach(), lse, leaves[0].grad, leaves[1].grad, leaves[2].grad


def ring(q, k, v, dout, causal, layout, sink=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fld.ring_attention(*leaves, causal=causal, layout=layout, sink=sink,
                                  return_lse=True)
    out.backward(dout)
    return out.detach(), lse, leaves[0].grad, leaves[1].grad, leaves[2].grad


def whole_sequence(s, args, device):
    """Inputs, the float32 yardstick and the one-GPU result for the whole sequence."""
    causal = not args.no_causal
    q, k, v, dout = inputs(s, args, device)
    return (q, k, v, dout), fp32_state(q, k, v, dout, causal), one_gpu(q, k, v, dout, causal)


def check(whole, layout, args, device, rank, world):
    """Max errors of the ring and of one GPU against float32, and whether the ring passes."""
    causal = not args.no_causal
    (q, k, v, dout), ref_whole, one_whole = whole
    shard = lambda x, dim=1: fld.split_sequence(x, world, layout=layout, dim=dim)[rank]
    ref = [shard(t, 2 if i == 1 else 1) for i, t in enumerate(ref_whole)]
    one = [shard(t, 2 if i == 1 else 1) for i, t in enumerate(one_whole)]
    mine = ring(*(shard(t) for t in (q, k, v, dout)), causal, layout)
    names = ("out", "lse", "dq", "dk", "dv")
    rows, ok = {}, True
    for name, r, o, m in zip(names, ref, one, mine):
        e_ring, e_one = all_max(max_err(m, r), device), all_max(max_err(o, r), device)
        nan = all_max(float(torch.isnan(m).any()), device)
        passed = nan == 0 and e_ring <= 2 * e_one + 1e-3
        rows[name] = (e_ring, e_one, passed)
        ok &= passed
    return rows, ok


def without_messages(fn):
    """Runs ``fn`` with every ring transfer replaced by a local copy of the same buffer: the
    ring's own work (attention calls, merges, the dK/dV accumulators) with no network."""
    real = fld._exchange

    def local(send, recv, ring):
        if send is not None and recv is not None and recv.numel() == send.numel():
            recv.copy_(send)
        return []

    fld._exchange = local
    try:
        return fn()
    finally:
        fld._exchange = real


def comm_alone(s, layout, args, device, rank, world, bwd):
    """Seconds of the ring's messages alone: the same K/V (and, backward, float32 dK/dV)
    transfers, no compute."""
    lengths = fld._even_lengths(s, world, layout)
    n = lengths[rank]
    kv = torch.empty(2 * args.batch * n * args.heads * args.head_dim, dtype=torch.bfloat16,
                     device=device)
    dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=device)
    rk = fld._Ring(None, *fld._group_ranks(None), lengths, [], 0.0, 1.0, "sum")

    def comm():
        for t in range(world):
            if t < world - 1:
                fld._wait(fld._exchange(kv, torch.empty_like(kv), rk))
            if bwd and world > 1:
                fld._wait(fld._exchange(dkv, torch.empty_like(dkv), rk))

    return timed(comm, device, args.warmup, args.iters)


def bench(s, layout, args, device, rank, world):
    causal = not args.no_causal
    lengths = fld._even_lengths(s, world, layout)
    q, k, v, dout = inputs(lengths[rank], args, device, seed=rank)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd = lambda: fld.ring_attention(*leaves, causal=causal, layout=layout)

    def fwd_bwd():
        fwd().backward(dout)

    t_fwd = timed(lambda: fwd().detach(), device, args.warmup, args.iters)
    t_bwd = timed(fwd_bwd, device, args.warmup, args.iters) - t_fwd
    nan = float("nan")
    if s > args.hidden_max_seqlen:
        return dict(t_fwd=t_fwd, t_bwd=t_bwd, hid_fwd=nan, hid_bwd=nan, comm_fwd=nan,
                    comm_bwd=nan)
    # The same ring with local copies for messages: everything but the network.
    c_fwd = timed(lambda: without_messages(lambda: fwd().detach()), device, args.warmup,
                  args.iters)
    c_bwd = timed(lambda: without_messages(fwd_bwd), device, args.warmup, args.iters) - c_fwd
    m_fwd = comm_alone(s, layout, args, device, rank, world, False)
    m_bwd = comm_alone(s, layout, args, device, rank, world, True)
    # With one rank there is nothing to hide; report nan rather than timer noise.
    hidden = (lambda t, c, m: max(0.0, min(1.0, (c + m - t) / m))) if world > 1 else (
        lambda t, c, m: nan)
    return dict(t_fwd=t_fwd, t_bwd=t_bwd, hid_fwd=hidden(t_fwd, c_fwd, m_fwd),
                hid_bwd=hidden(t_bwd, c_bwd, m_bwd), comm_fwd=m_fwd, comm_bwd=m_bwd)


def bench_one_gpu(s, args, device):
    """Forward and backward seconds of flashlse on one GPU for the whole sequence, or None."""
    causal = not args.no_causal
    try:
        q, k, v, dout = inputs(s, args, device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fwd = lambda: fl.attention(*leaves, causal=causal)
        t_fwd = timed(lambda: fwd().detach(), device, args.warmup, args.iters)
        t_all = timed(lambda: fwd().backward(dout), device, args.warmup, args.iters)
        return t_fwd, t_all - t_fwd
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def empty_shard_with_sink(args, device, rank, world):
    """Rank 0 holds no token, a sink is on: no NaN anywhere, and the ring equals one GPU."""
    s = 4096 if device.type == "cuda" else 256
    lengths = [0] + [len(c) for c in torch.arange(s).tensor_split(max(world - 1, 1))]
    lengths = lengths[:world] if world > 1 else [0]
    s = sum(lengths)
    q, k, v, dout = inputs(s, args, device, seed=7)
    g = torch.Generator(device=device).manual_seed(8)
    # The sink is a replicated parameter: the same logits on every rank.
    sink = torch.randn(args.heads, generator=g, device=device).requires_grad_()
    shard = lambda x: fld.split_sequence(x, lengths, layout="zigzag")[rank]
    leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out, lse = fld.ring_attention(*leaves, causal=True, layout="zigzag", sink=sink, sink_grad="sum",
                                  return_lse=True)
    (out.float() * shard(dout).float()).sum().backward()
    tensors = [out, lse, sink.grad] + [t.grad for t in leaves]
    nan = all_max(float(any(torch.isnan(t).any().item() for t in tensors)), device)
    err = 0.0
    if s:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        sink_1 = sink.detach().clone().requires_grad_()
        out_1 = fl.attention(*whole, causal=True, sink=sink_1)
        (out_1.float() * dout.float()).sum().backward()
        err = all_max(max_err(out, shard(out_1)), device)
        err = max(err, max_err(sink.grad, sink_1.grad))
    return lengths, nan == 0, err


def append_results(rows, args, device, world):
    date = datetime.date.today().isoformat()
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nccl = "-"
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    # One section per run, as the other bench scripts write theirs.
    text = (f"\n### bench_cp.py {date}\n\n"
            "| date | device | kind | N | NCCL | torch | S | layout | fwd us/tok | "
            "bwd us/tok | 1-GPU fwd/bwd us/tok | speedup fwd/bwd | TFLOP/s/GPU fwd/bwd | "
            "comm hidden fwd/bwd | check |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        text += (f"| {date} | {dev} | {args.kind or '-'} | {world} | {nccl} | "
                 f"{torch.__version__} | {r['s']} | {r['layout']} | {r['fwd_tok']:.3f} | "
                 f"{r['bwd_tok']:.3f} | {r['one']} | {r['speedup']} | {r['tflops']} | "
                 f"{r['hidden']} | {r['check']} |\n")
    with RESULTS.open("a") as f:
        f.write(text)


def main():
    args = parse_args()
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    causal = not args.no_causal
    say = lambda *a: print(*a, flush=True) if rank == 0 else None
    say(f"ring attention: N={world} {args.device} B={args.batch} H={args.heads} "
        f"D={args.head_dim} bf16 causal={causal}")
    rows = []
    for s in args.seqlens:
        one = bench_one_gpu(s, args, device) if s <= args.check_max_seqlen else None
        whole = whole_sequence(s, args, device) if s <= args.check_max_seqlen else None
        for layout in args.layouts:
            check_txt = "-"
            if whole is not None:
                errs, ok = check(whole, layout, args, device, rank, world)
                check_txt = ("pass" if ok else "FAIL") + " " + " ".join(
                    f"{n}={e[0]:.2e}/{e[1]:.2e}" for n, e in errs.items())
            r = bench(s, layout, args, device, rank, world)
            flops = 4 * args.batch * args.heads * s * s * args.head_dim * (0.5 if causal else 1)
            row = dict(s=s, layout=layout, fwd_tok=r["t_fwd"] / s * 1e6,
                       bwd_tok=r["t_bwd"] / s * 1e6, check=check_txt,
                       tflops=f"{flops / r['t_fwd'] / world / 1e12:.1f}/"
                              f"{2.5 * flops / r['t_bwd'] / world / 1e12:.1f}",
                       hidden=f"{r['hid_fwd']:.2f}/{r['hid_bwd']:.2f}")
            if one:
                row["one"] = f"{one[0] / s * 1e6:.3f}/{one[1] / s * 1e6:.3f}"
                row["speedup"] = f"{one[0] / r['t_fwd']:.2f}/{one[1] / r['t_bwd']:.2f}"
            else:
                row["one"] = row["speedup"] = "-"
            rows.append(row)
            say(f"S={s:>7} {layout:<10} fwd {row['fwd_tok']:.3f} us/tok  bwd "
                f"{row['bwd_tok']:.3f} us/tok  1-GPU {row['one']}  speedup {row['speedup']}  "
                f"TFLOP/s/GPU {row['tflops']}  comm hidden {row['hidden']}  "
                f"(comm alone {r['comm_fwd'] * 1e3:.2f}/{r['comm_bwd'] * 1e3:.2f} ms)  "
                f"check {check_txt}" + (
                    f"  peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                    if args.device == "cuda" else ""))
        del whole
    lengths, no_nan, err = empty_shard_with_sink(args, device, rank, world)
    say(f"empty shard + sink, lengths {lengths}: "
        f"{'no NaN' if no_nan else 'NaN FOUND'}, max err vs one GPU {err:.2e}")
    if args.results and rank == 0:
        rows.append(dict(s=sum(lengths), layout="zigzag, empty shard + sink", fwd_tok=0.0,
                         bwd_tok=0.0, one="-", speedup="-", tflops="-", hidden="-",
                         check=f"{'no NaN' if no_nan else 'NaN'}, err {err:.1e}"))
        append_results(rows, args, device, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
