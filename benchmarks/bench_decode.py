"""Decode bandwidth: flashlse's split-KV kernel against SDPA flash, SDPA cuDNN and
FlexAttention, all in one process, with the device-copy bandwidth as the ceiling.

Effective bandwidth = bytes of K and V the problem must read / time (for MLA the latent
cache, read once: ``B * Skv * 576 * 2`` bytes). Times are ``triton.testing.do_bench``
medians of the public call ``flashlse.attention_with_kvcache`` (validation included;
``--kernel-only`` times the launcher ``kernels.decode.decode_fwd`` instead, and tile sweeps
always do); ``graph`` replays the same call from a CUDA graph (device time alone: where it
beats the eager time, the host's Python and launches are what the GPU waits for), and
``host_us`` is the timed call's host time.
Copy bandwidth counts bytes read plus bytes written of a 2 GiB device-to-device copy.

    python benchmarks/bench_decode.py [--out DIR] [--sweep] [--kernel-only]

Writes ``decode.json``, ``results_rows.md`` (rows for benchmarks/RESULTS.md) and
``decode.png`` into ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch
import triton

# The repo root last: a PYTHONPATH tree (h200_session.sh in_turn's .before) comes first.
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))

from _common import graph_replay, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse.kernels import combine, configs, decode  # noqa: E402

GQA_SHAPES = [(1, 131072), (8, 32768), (64, 8192), (128, 2048)]
HQ, HKV, D = 32, 8, 128
MLA = dict(b=64, skv=8192, hq=128, d=576, dv=512)
# --smoke: tiny shapes on the CPU under TRITON_INTERPRET=1, to check the script itself.
SMOKE = "--smoke" in sys.argv
# Median milliseconds (one host-timed call under --smoke).
bench = functools.partial(median_ms, smoke=SMOKE, rep=150)
DEV = "cpu" if SMOKE else "cuda"
# --quick: the split-path shapes only, peers without compilation (no FlexAttention), no MLA.
QUICK = "--quick" in sys.argv
# --kernel-only: time the launcher (no validation) instead of the public function.
KERNEL_ONLY = "--kernel-only" in sys.argv
if QUICK:
    GQA_SHAPES = GQA_SHAPES[:2]
if SMOKE:
    GQA_SHAPES = [(1, 512), (2, 256)]
    MLA = dict(b=2, skv=128, hq=16, d=64, dv=32)


def copy_bandwidth() -> float:
    n = 2**20 if SMOKE else 2**30
    x = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * 2 * n / ms / 1e6


def graph_ms(fn):
    """Median milliseconds of ``fn`` replayed from a CUDA graph (no host launch cost)."""
    if SMOKE:
        return None
    return bench(graph_replay(fn))


def host_us(fn, n=50):
    """Host microseconds a call: launches are asynchronous, so the loop measures Python and
    launch cost while the GPU queue absorbs the work."""
    if SMOKE:
        return None
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def paged_copy(k, page_size, table=None):
    """The same keys in shuffled pages: ``(num_pages, page_size, H, D)`` and a block table."""
    b, s = k.shape[:2]
    pages = s // page_size
    if table is None:
        table = torch.randperm(b * pages, device=k.device).view(b, pages).to(torch.int32)
    kp = torch.empty((b * pages, page_size) + tuple(k.shape[2:]), device=k.device, dtype=k.dtype)
    kp[table.view(-1).long()] = k.reshape((b * pages, page_size) + tuple(k.shape[2:]))
    return kp, table


def run_decode(q, k, v, lens, table, scale, config=None, num_splits=0):
    if config is None and not KERNEL_ONLY:
        return lambda: fl.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                                 scale=scale, num_splits=num_splits)
    return lambda: decode.decode_fwd(q, k, v, cache_seqlens=lens, block_table=table, left=None,
                                     right=None, softcap=0.0, scale=scale, sink=None,
                                     num_splits=num_splits, config=config)


def peers(q, k, v, scale):
    """SDPA flash / cuDNN and compiled FlexAttention on the (B, H, S, D) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    res = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def f(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, scale=scale, enable_gqa=True)
        try:
            ref = f()
            res[name] = (bench(f), ref)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run the shape is reported
            res[name] = (None, repr(e)[:120])
    try:
        if SMOKE or QUICK:
            raise RuntimeError("flex skipped in --smoke/--quick")
        flex = torch.compile(flex_attention, dynamic=False)
        def g():
            return flex(qt, kt, vt, scale=scale, enable_gqa=True)
        ref = g()
        res["flex"] = (bench(g), ref)
    except Exception as e:  # noqa: BLE001
        res["flex"] = (None, repr(e)[:120])
    return res


def sweep_configs(d_total):
    if d_total > 256:
        return [dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)]
    return [dict(BLOCK_N=64, num_warps=4, num_stages=3),
            dict(BLOCK_N=64, num_warps=4, num_stages=5),
            dict(BLOCK_N=32, num_warps=4, num_stages=6),
            dict(BLOCK_N=128, num_warps=8, num_stages=3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kernel-only", action="store_true")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    dev = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    dtype = torch.float32 if SMOKE else torch.bfloat16
    info = dict(date=time.strftime("%Y-%m-%d"), device=dev, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda)
    copy_gbs = copy_bandwidth()
    rows, sweeps = [], []
    for b, skv in GQA_SHAPES:
        scale = 1 / math.sqrt(D)
        q = torch.randn(b, 1, HQ, D, device=DEV, dtype=dtype)
        k = torch.randn(b, skv, HKV, D, device=DEV, dtype=dtype)
        v = torch.randn(b, skv, HKV, D, device=DEV, dtype=dtype)
        lens = torch.full((b,), skv, dtype=torch.int32, device=DEV)
        nbytes = k.numel() * k.element_size() * 2
        row = dict(shape=f"B={b} Skv={skv}", bytes=nbytes)
        out, _ = decode.decode_fwd(q, k, v, cache_seqlens=lens, block_table=None, left=None,
                                   right=None, softcap=0.0, scale=scale, sink=None, num_splits=0)
        row["ours_ms"] = bench(run_decode(q, k, v, lens, None, scale))
        row["graph_ms"] = graph_ms(run_decode(q, k, v, lens, None, scale))
        row["host_us"] = host_us(run_decode(q, k, v, lens, None, scale))
        for ps in (16, 256):
            kp, table = paged_copy(k, ps)
            vp, _ = paged_copy(v, ps, table)
            out_p, _ = decode.decode_fwd(q, kp, vp, cache_seqlens=lens, block_table=table,
                                         left=None, right=None, softcap=0.0, scale=scale,
                                         sink=None, num_splits=0)
            row[f"paged{ps}_bitwise"] = bool(torch.equal(out_p, out))
            row[f"paged{ps}_ms"] = bench(run_decode(q, kp, vp, lens, table, scale))
            del kp, vp
        for name, (ms, ref) in peers(q, k, v, scale).items():
            row[f"{name}_ms"] = ms
            if ms is None:
                row[f"{name}_err"] = ref
            else:
                diff = ref.transpose(1, 2).float() - out.float()
                row[f"{name}_maxdiff"] = float(diff.abs().max())
        if args.sweep and b <= 8:
            # Where the split path runs: split counts forced, and the combine alone.
            for ns in (8, 16, 33, 66, 132):
                ms = bench(run_decode(q, k, v, lens, None, scale, num_splits=ns))
                sweeps.append(dict(shape=row["shape"], cfg=dict(num_splits=ns), ms=ms,
                                   gbs=nbytes / ms / 1e6))
            cfg0 = configs.decode_config(D, 0, D, HQ // HKV, SMOKE)
            n_split = decode._num_splits(
                b * HKV, triton.cdiv(skv, cfg0.block_n),
                (2 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count)
                * cfg0.programs_per_sm)
            o_part = torch.randn(n_split, b, 1, HQ, D, device=DEV)
            l_part = torch.randn(n_split, b, 1, HQ, device=DEV)
            out_m = torch.empty(b, 1, HQ, D, device=DEV, dtype=dtype)
            lse_m = torch.empty(b, HQ, 1, device=DEV)
            row["default_splits"] = n_split
            row["combine_only_us"] = 1e3 * bench(lambda o_part=o_part, l_part=l_part, out_m=out_m,
                                                 lse_m=lse_m: combine.merge_states_fwd(
                o_part, l_part, out=out_m, lse_out=lse_m.permute(0, 2, 1)))
        if args.sweep:
            for cfg in sweep_configs(2 * D):
                try:
                    ms = bench(run_decode(q, k, v, lens, None, scale, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
                    ms = None
                    print("sweep fail", cfg, repr(e)[:100])
                sweeps.append(dict(shape=row["shape"], cfg=cfg, ms=ms,
                                   gbs=None if ms is None else nbytes / ms / 1e6))
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()

    if not QUICK:
        rows.append(run_mla(args, sweeps))
    finish(args, info, copy_gbs, rows, sweeps, dev)


def run_mla(args, sweeps):
    """MLA: one latent head, v = k[..., :512], 128 query heads."""
    dtype = torch.float32 if SMOKE else torch.bfloat16
    m = MLA
    q = torch.randn(m["b"], 1, m["hq"], m["d"], device=DEV, dtype=dtype)
    kv = torch.randn(m["b"], m["skv"], 1, m["d"], device=DEV, dtype=dtype)
    lens = torch.full((m["b"],), m["skv"], dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(m["d"])
    nbytes = kv.numel() * kv.element_size()
    row = dict(shape=f"MLA B={m['b']} Skv={m['skv']} Hq={m['hq']}", bytes=nbytes)
    out, _ = decode.decode_fwd(q, kv, kv[..., :m["dv"]], cache_seqlens=lens, block_table=None,
                               left=None, right=None, softcap=0.0, scale=scale, sink=None,
                               num_splits=0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:4].transpose(1, 2).float(), kv[:4].transpose(1, 2).float(),
        kv[:4, ..., :m["dv"]].transpose(1, 2).float(), scale=scale, enable_gqa=True)
    row["mla_check_maxdiff"] = float((ref.transpose(1, 2) - out[:4].float()).abs().max())
    row["ours_ms"] = bench(run_decode(q, kv, kv[..., :m["dv"]], lens, None, scale))
    for ps in (64,):
        kp, table = paged_copy(kv, ps)
        row[f"paged{ps}_ms"] = bench(run_decode(q, kp, kp[..., :m["dv"]], lens, table, scale))
        del kp
    if args.sweep:
        for cfg in sweep_configs(m["d"]):
            try:
                ms = bench(run_decode(q, kv, kv[..., :m["dv"]], lens, None, scale, cfg))
            except Exception as e:  # noqa: BLE001
                ms = None
                print("sweep fail", cfg, repr(e)[:100])
            sweeps.append(dict(shape=row["shape"], cfg=cfg, ms=ms,
                               gbs=None if ms is None else nbytes / ms / 1e6))
    return row


def finish(args, info, copy_gbs, rows, sweeps, dev):
    for r in rows:
        for key in list(r):
            if key.endswith("_ms") and r[key] is not None:
                r[key.replace("_ms", "_gbs")] = r["bytes"] / r[key] / 1e6
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(dict(info=info, copy_gbs=copy_gbs, rows=rows, sweeps=sweeps), f, indent=1)

    def fmt(x):
        return "n/a" if x is None else f"{x:.0f}"

    def ratio(a, b):
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    md = []
    for r in rows:
        ours = r["ours_gbs"]
        md.append(
            f"| {info['date']} | decode | {r['shape']} | {dev} | torch {info['torch']}, triton "
            f"{info['triton']} | ours {fmt(ours)} GB/s ({ratio(ours, copy_gbs)}x copy "
            f"{copy_gbs:.0f}), graph-replayed {fmt(r.get('graph_gbs'))}; paged16 "
            f"{fmt(r.get('paged16_gbs'))}, paged64 "
            f"{fmt(r.get('paged64_gbs'))}, paged256 {fmt(r.get('paged256_gbs'))}; sdpa flash "
            f"{fmt(r.get('sdpa_flash_gbs'))}, cuDNN {fmt(r.get('sdpa_cudnn_gbs'))} "
            f"({ratio(ours, r.get('sdpa_cudnn_gbs'))}x), flex {fmt(r.get('flex_gbs'))} |")
    with open(os.path.join(args.out, "results_rows.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    try:
        plot(rows, copy_gbs, os.path.join(args.out, "decode.png"), info)
    except Exception as e:  # noqa: BLE001 - the table matters more than the plot
        print("plot failed:", e)

    print()
    for s in sweeps:
        print(f"sweep {s['shape']:<32} {s['cfg']} {fmt(s['gbs'])} GB/s")
    print(f"\n{dev}  torch {info['torch']}  triton {info['triton']}  copy {copy_gbs:.0f} GB/s")
    hdr = ["shape", "ours", "xcopy", "graph", "p16", "p256", "p64", "flash", "cudnn", "xcudnn",
           "flex"]
    print(" | ".join(f"{h:>9}" for h in hdr))
    for r in rows:
        vals = [r["shape"][:30], fmt(r["ours_gbs"]), ratio(r["ours_gbs"], copy_gbs),
                fmt(r.get("graph_gbs")), fmt(r.get("paged16_gbs")), fmt(r.get("paged256_gbs")),
                fmt(r.get("paged64_gbs")),
                fmt(r.get("sdpa_flash_gbs")), fmt(r.get("sdpa_cudnn_gbs")),
                ratio(r["ours_gbs"], r.get("sdpa_cudnn_gbs")), fmt(r.get("flex_gbs"))]
        print(" | ".join(f"{x:>9}" for x in vals))
    for r in rows:
        extra = {k: v for k, v in r.items()
                 if k.endswith(("bitwise", "maxdiff", "_err", "splits", "_us"))}
        print(r["shape"], extra)


def plot(rows, copy_gbs, path, info):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["ours", "paged16", "paged256", "sdpa_flash", "sdpa_cudnn", "flex"]
    labels = ["flashlse", "flashlse paged 16", "flashlse paged 256", "SDPA flash", "SDPA cuDNN",
              "FlexAttention"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.13
    for i, (n, lab) in enumerate(zip(names, labels)):
        vals = [r.get(f"{n}_gbs") or 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=lab)
    ax.axhline(copy_gbs, color="k", ls="--", lw=1, label=f"device copy {copy_gbs:.0f} GB/s")
    ax.set_xticks([j + 2.5 * width for j in range(len(rows))])
    ax.set_xticklabels([r["shape"].replace(" Hq=128", "") for r in rows], fontsize=8)
    ax.set_ylabel("effective K/V bandwidth (GB/s)")
    ax.set_title(f"bf16 decode, {info['device']}, torch {info['torch']}, {info['date']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
