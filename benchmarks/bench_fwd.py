"""Forward attention TFLOP/s: flashlse vs SDPA flash (FA-2), SDPA cuDNN and FlexAttention.

All systems run in this one process on the same GPU. bf16, B*S = 16k, H*D = 2048,
FLOPs = 4*B*H*Sq*Sk*D (halved for causal), time = median of triton.testing.do_bench.
flashlse takes its native (B, S, H, D) layout, the peers their native (B, H, S, D). flashlse's
time is the public ``fl.attention`` (validation and dispatch included); ``--kernel-only``
times the kernels' entry ``kernels.dispatch.attn_fwd`` (no validation) instead.

    python benchmarks/bench_fwd.py --sweep          # round 1: block shapes per head dim
    python benchmarks/bench_fwd.py --ws             # warp specialisation (own process)
    python benchmarks/bench_fwd.py --sweep2         # round 2: TMA vs pointers, WS, grouping
    python benchmarks/bench_fwd.py --sweep3         # round 3: the leaders, repeated
    python benchmarks/bench_fwd.py --full [--best sweep3.json] [--dims 128] [--merge old.json]
                                                    # the table, RESULTS.md rows, fwd.png

--best makes --full use a sweep's winners instead of the tables in kernels/fwd.py (they
were copied there); --merge adds another run's rows for the other head dims to the plot.
Outputs go to --out (default $OUT or ./bench_out): *.json, results_rows.md, fwd.png.
The rounds and what they showed: benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
from _common import attn_flops, bf16_inputs, causal_block_mask, flex_attention_compiled, median_ms

import flashlse as fl
from flashlse.kernels import configs, dispatch
from flashlse.kernels.failures import FAILURES

DATE = "2026-11-29"
SEQS = [1024, 2048, 4096, 8192, 16384]


# --kernel-only: time the kernels' entry (dispatch.attn_fwd, no validation), not the public call.
KERNEL_ONLY = False


def _ours(q, k, v, causal):
    """The call to time: ``fl.attention`` (with return_lse, as the launcher returns), or the
    launcher with --kernel-only."""
    if not KERNEL_ONLY:
        return lambda: fl.attention(q, k, v, causal=causal, return_lse=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    right = 0 if causal else None
    return lambda: dispatch.attn_fwd(q, k, v, left=None, right=right, softcap=0.0, scale=scale,
                                     sink=None)


def _ws_failures() -> int:
    """Tile shapes whose warp-specialised or Hopper forward failed to compile so far (each
    fell back to another kernel)."""
    return sum(key[0] in ("fwd warp_specialize", "fwd_sm90") for key in FAILURES)


def _sdpa(backend, qh, kh, vh, causal):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def run():
        with sdpa_kernel(backend):
            return sdpa(qh, kh, vh, is_causal=causal)

    return run


def _flex(qh, kh, vh, causal):
    fn = flex_attention_compiled()
    bm = causal_block_mask(qh.shape[2], kh.shape[2]) if causal else None
    return lambda: fn(qh, kh, vh, block_mask=bm)


def _peers_inputs(q, k, v):
    return (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous())


def _check_close(q, k, v, causal, qh, kh, vh):
    from torch.nn.attention import SDPBackend

    out, _ = _ours(q, k, v, causal)()
    ref = _sdpa(SDPBackend.FLASH_ATTENTION, qh, kh, vh, causal)().transpose(1, 2)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 3e-2 and not torch.isnan(out).any(), f"flashlse differs from FA-2 by {err}"
    return err


SWEEP = {
    128: [
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_HEADS=1),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, GROUP_HEADS=1 << 30),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, USE_TMA=False),
    ],
    64: [
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
    ],
    256: [
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2),
    ],
}


def _v(bm, bn, w, s, tma=True, ws=False, group=None):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, USE_TMA=tma,
                WARP_SPECIALIZE=ws, GROUP_HEADS=group)


# Second round: pointer vs TMA loads, warp specialisation, head grouping.
SWEEP2 = {
    128: [
        _v(128, 128, 8, 3, tma=False, group=1),
        _v(128, 128, 8, 3, tma=False, ws=True, group=1),
        _v(128, 128, 8, 3, tma=True, ws=True, group=1),
        _v(128, 128, 8, 3, tma=False, ws=True),
        _v(128, 128, 8, 3, tma=True, ws=True),
        _v(128, 64, 8, 3, tma=False, ws=True, group=1),
        _v(128, 128, 8, 2, tma=False, ws=True, group=1),
    ],
    64: [
        _v(128, 64, 4, 3, tma=False, group=1),
        _v(128, 128, 4, 3, tma=False, group=1),
        _v(128, 128, 4, 3, tma=True, ws=True, group=1),
        _v(128, 64, 4, 3, tma=True, ws=True),
    ],
    256: [
        _v(128, 64, 8, 2, tma=False, group=1),
        _v(128, 64, 8, 2, tma=True, ws=True),
        _v(128, 64, 8, 2, tma=True, group=1),
    ],
}


def _v3(tma, ws, group):
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, USE_TMA=tma,
                WARP_SPECIALIZE=ws, GROUP_HEADS=group)


# Third round at D = 128, repeated to see the noise: the two leaders of round two.
SWEEP3 = [
    _v3(False, False, 1),
    _v3(True, True, None),
]


# The Hopper forward's schedule at short lengths (issue 22: S = 1k / 2k at 0.67-0.80x cuDNN),
# as ``KernelOptions.fwd_sm90_config`` overrides of configs.FWD_SM90[128]; {} = shipped.
# Session 15: STAGES 3, BLOCK_N 64 (2 or 3 stages) and ping-pong measured, none faster
# (RESULTS.md 2026-12-02); the grid kernel against the default (persistent where balanced)
# and the persistent kernel on the host's schedule where the round robin is not.
SM90_SHORT = [{"PERSISTENT": False}, {}, {"PERSISTENT": True, "PERSISTENT_TABLE": True}]


def sweep3(out_dir, seqs=(4096, 8192), repeats=2, variants=None, tag="sweep3",
           option="fwd_config", d=128):
    """Each variant at every length, ``repeats`` passes, the variants taking turns within a
    pass (so a clock or thermal drift falls on all of them alike); the winner by mean
    TFLOP/s per causal. ``option``: the ``KernelOptions`` field the variants override
    (``fwd_sm90_config``: the Hopper kernel's). ``d``: the head dim (B*S = 16k and H*D =
    2048 as bench_fwd's tables)."""
    h = 2048 // d
    rows, best = [], {}
    inputs = {seq: bf16_inputs(16384 // seq, seq, seq, h, d) for seq in seqs}
    cfgs = variants or SWEEP3
    for causal in (False, True):
        names = [",".join(f"{key}={val}" for key, val in cfg.items()) or "shipped"
                 for cfg in cfgs]
        tfs = [[] for _ in cfgs]
        for _ in range(repeats):
            for i, cfg in enumerate(cfgs):
                if tfs[i] and tfs[i][-1] != tfs[i][-1]:
                    continue  # failed in an earlier pass
                n_failed = _ws_failures()
                try:
                    for seq in seqs:
                        q, k, v = inputs[seq]
                        with fl.kernel_options(**{option: cfg}):
                            ms = median_ms(_ours(q, k, v, causal))
                        tfs[i].append(attn_flops(16384 // seq, h, seq, seq, d, causal) / ms
                                      * 1e-9)
                except Exception as e:  # noqa: BLE001 - a config may not compile; record why
                    names[i] += f" FAILED {type(e).__name__}: {str(e)[:120]}"
                    tfs[i].append(float("nan"))
                if _ws_failures() > n_failed and "fell back" not in names[i]:
                    names[i] += " (fell back: did not compile)"
        for cfg, name, runs in zip(cfgs, names, tfs):
            mean = sum(runs) / len(runs)
            rows.append(dict(d=d, causal=causal, cfg=name, tflops=runs, mean=mean))
            print(f"{tag} causal={causal:d} mean {mean:6.1f} runs "
                  + " ".join(f"{t:.0f}" for t in runs) + f"  {name}", flush=True)
            key = f"{d},{int(causal)}"
            if mean == mean and mean > best.get(key, (0.0, None))[0]:
                best[key] = (mean, cfg)
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump(dict(rows=rows, best=best), f, indent=1)


def sweep(out_dir, seq=8192, ws=False, table=None, tag="sweep"):
    rows = []
    table = table or SWEEP
    dims = [128] if ws else list(table)
    best = {}
    for d in dims:
        h, b = 2048 // d, 16384 // seq
        q, k, v = bf16_inputs(b, seq, seq, h, d)
        variants = table[d] if not ws else [dict(SWEEP[128][0], WARP_SPECIALIZE=True)]
        for causal in (False, True):
            for cfg in variants:
                name = ",".join(f"{key}={val}" for key, val in cfg.items())
                try:
                    with fl.kernel_options(fwd_config=cfg):
                        ms = median_ms(_ours(q, k, v, causal))
                    tf = attn_flops(b, h, seq, seq, d, causal) / ms * 1e-9
                except Exception as e:  # noqa: BLE001 - a config may not fit; record why
                    ms, tf = float("nan"), float("nan")
                    name += f" FAILED {type(e).__name__}: {str(e)[:120]}"
                rows.append(dict(d=d, causal=causal, cfg=name, ms=ms, tflops=tf))
                print(f"sweep D={d} causal={causal:d} {tf:7.1f} TFLOP/s  {name}", flush=True)
                key = f"{d},{int(causal)}"
                if tf == tf and tf > best.get(key, (0.0, None))[0]:
                    best[key] = (tf, cfg)
    with open(os.path.join(out_dir, f"{tag}_ws.json" if ws else f"{tag}.json"), "w") as f:
        json.dump(dict(rows=rows, best=best), f, indent=1)
    return rows


def full(out_dir, dims=(64, 128, 256), flex_budget_s=240.0, merge=None):
    from torch.nn.attention import SDPBackend

    rows = []
    kept = []
    if merge:
        # Rows of an earlier run (same day, same machine kind) for the head dims not re-run.
        with open(merge) as f:
            kept = [r for r in json.load(f)["rows"] if r["d"] not in dims]
    flex_spent = 0.0
    for d in dims:
        h = 2048 // d
        for seq in SEQS:
            b = 16384 // seq
            q, k, v = bf16_inputs(b, seq, seq, h, d, seed=seq + d)
            qh, kh, vh = _peers_inputs(q, k, v)
            for causal in (False, True):
                err = _check_close(q, k, v, causal, qh, kh, vh)
                fl = attn_flops(b, h, seq, seq, d, causal)
                r = dict(d=d, seq=seq, b=b, h=h, causal=causal, max_err_vs_fa2=err)
                r["flashlse"] = fl / median_ms(_ours(q, k, v, causal)) * 1e-9
                for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        r[name] = fl / median_ms(_sdpa(backend, qh, kh, vh, causal)) * 1e-9
                    except Exception as e:  # noqa: BLE001 - a backend may refuse a shape
                        print(f"{name} D={d} S={seq}: {type(e).__name__}: {str(e)[:100]}")
                        r[name] = float("nan")
                r["flex"] = float("nan")
                if flex_spent < flex_budget_s:
                    t0 = time.time()
                    try:
                        r["flex"] = fl / median_ms(_flex(qh, kh, vh, causal)) * 1e-9
                    except Exception as e:  # noqa: BLE001
                        print(f"flex D={d} S={seq}: {type(e).__name__}: {str(e)[:100]}")
                    flex_spent += time.time() - t0
                rows.append(r)
                print(_fmt(r), flush=True)
            del q, k, v, qh, kh, vh
    # Empty rows cost nothing: causal Sq = 16k, Sk = 8k against the same useful work
    # (causal 8k x 8k); the first 8k rows see no key.
    h, d = 16, 128
    q, k, v = bf16_inputs(1, 16384, 8192, h, d, seed=1)
    t_empty = median_ms(_ours(q, k, v, True))
    q2 = q[:, 8192:].contiguous()
    t_same = median_ms(_ours(q2, k, v, True))
    useful = attn_flops(1, h, 8192, 8192, d, True)
    extra = dict(empty_rows_ms=t_empty, same_work_ms=t_same, ratio=t_empty / t_same,
                 empty_rows_tflops=useful / t_empty * 1e-9,
                 same_work_tflops=useful / t_same * 1e-9)
    print(f"causal Sq=16k Sk=8k: {t_empty:.3f} ms vs Sq=Sk=8k {t_same:.3f} ms "
          f"(ratio {t_empty / t_same:.3f})")
    meta = dict(date=DATE, device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__)
    with open(os.path.join(out_dir, "bench_fwd.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, empty_rows=extra), f, indent=1)
    _write_rows(out_dir, meta, rows, extra)
    _plot(out_dir, sorted(kept + rows, key=lambda r: (r["d"], r["seq"], r["causal"])))
    print("\n" + _table(rows))
    print(f"empty rows: Sq=16k/Sk=8k causal {t_empty:.3f} ms, Sq=Sk=8k {t_same:.3f} ms, "
          f"ratio {t_empty / t_same:.3f}")
    return rows


def _fmt(r):
    return (f"D={r['d']:3d} S={r['seq']:5d} causal={r['causal']:d} flashlse {r['flashlse']:6.1f} "
            f"FA2 {r['fa2']:6.1f} cuDNN {r['cudnn']:6.1f} Flex {r['flex']:6.1f} "
            f"x{r['flashlse'] / r['fa2']:.2f}/x{r['flashlse'] / r['cudnn']:.2f}/"
            f"x{r['flashlse'] / r['flex']:.2f}")


def _table(rows):
    lines = ["| D | S | causal | flashlse | FA-2 | cuDNN | Flex | /FA-2 | /cuDNN | /Flex |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['d']} | {r['seq']} | {'yes' if r['causal'] else 'no'} | {r['flashlse']:.0f} "
            f"| {r['fa2']:.0f} | {r['cudnn']:.0f} | {r['flex']:.0f} "
            f"| {r['flashlse'] / r['fa2']:.2f} | {r['flashlse'] / r['cudnn']:.2f} "
            f"| {r['flashlse'] / r['flex']:.2f} |")
    return "\n".join(lines)


def _write_rows(out_dir, meta, rows, extra):
    head = f"{meta['date']} | {meta['device']} | torch {meta['torch']} | triton {meta['triton']}"
    lines = []
    for r in rows:
        lines.append(
            f"| {head} | fwd bf16 | D={r['d']} S={r['seq']} B={r['b']} H={r['h']} "
            f"{'causal' if r['causal'] else 'full'} | {r['flashlse']:.0f} | FA-2 {r['fa2']:.0f}, "
            f"cuDNN {r['cudnn']:.0f}, Flex {r['flex']:.0f} | x{r['flashlse'] / r['fa2']:.2f} FA-2, "
            f"x{r['flashlse'] / r['cudnn']:.2f} cuDNN, x{r['flashlse'] / r['flex']:.2f} Flex |")
    lines.append(
        f"| {head} | fwd bf16 | D=128 H=16 B=1 causal Sq=16k Sk=8k (8k empty rows) "
        f"| {extra['empty_rows_tflops']:.0f} useful | same work Sq=Sk=8k "
        f"{extra['same_work_tflops']:.0f} | time x{extra['ratio']:.3f} |")
    with open(os.path.join(out_dir, "results_rows.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _plot(out_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    names = [("flashlse", "flashlse (Triton)"), ("cudnn", "SDPA cuDNN"),
             ("flex", "FlexAttention"), ("fa2", "SDPA FA-2")]
    for j, d in enumerate(dims):
        for i, causal in enumerate((False, True)):
            ax = axes[i][j]
            sel = [r for r in rows if r["d"] == d and r["causal"] == causal]
            for key, label in names:
                ax.plot([r["seq"] for r in sel], [r[key] for r in sel], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"fwd bf16 D={d} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length (B*S = 16k, H*D = 2048)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"H200, {DATE}, torch {torch.__version__}, triton {triton.__version__}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fwd.png"), dpi=90)


def peers_at(seq=8192, d=128):
    """Peers at one shape, to read the sweep against."""
    from torch.nn.attention import SDPBackend

    h, b = 2048 // d, 16384 // seq
    q, k, v = bf16_inputs(b, seq, seq, h, d)
    qh, kh, vh = _peers_inputs(q, k, v)
    for causal in (False, True):
        fl = attn_flops(b, h, seq, seq, d, causal)
        err = _check_close(q, k, v, causal, qh, kh, vh)
        fa2 = fl / median_ms(_sdpa(SDPBackend.FLASH_ATTENTION, qh, kh, vh, causal)) * 1e-9
        cud = fl / median_ms(_sdpa(SDPBackend.CUDNN_ATTENTION, qh, kh, vh, causal)) * 1e-9
        print(f"peers D={d} S={seq} causal={causal:d}: FA-2 {fa2:.1f} cuDNN {cud:.1f} "
              f"(flashlse max err vs FA-2 {err:.2e})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--ws", action="store_true")
    p.add_argument("--sweep2", action="store_true")
    p.add_argument("--sweep3", action="store_true")
    p.add_argument("--best", default=None, help="sweep json whose winners --full uses")
    p.add_argument("--merge", default=None, help="bench_fwd.json of other head dims, for the plot")
    p.add_argument("--full", action="store_true")
    p.add_argument("--sm90-short", action="store_true",
                   help="the Hopper forward's schedules (SM90_SHORT) at S = 1k-16k")
    p.add_argument("--short-dim", type=int, default=128, help="--sm90-short's head dim")
    p.add_argument("--short-variants", default=None,
                   help="--sm90-short's fwd_sm90_config overrides as a JSON list (default: "
                        "SM90_SHORT), e.g. '[{}, {\"BLOCK_N\": 64}]'")
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--flex-budget", type=float, default=240.0)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--kernel-only", action="store_true",
                   help="time the launcher instead of the public fl.attention")
    a = p.parse_args()
    global KERNEL_ONLY
    KERNEL_ONLY = a.kernel_only
    os.makedirs(a.out, exist_ok=True)
    if a.sweep:
        peers_at()
        rows = sweep(a.out)
        print("\nsweep summary (S=8k):")
        for r in rows:
            print(f"  D={r['d']:3d} causal={r['causal']:d} {r['tflops']:7.1f}  {r['cfg'][:90]}")
    if a.ws:
        sweep(a.out, ws=True)
    if a.sweep2:
        rows = sweep(a.out, table=SWEEP2, tag="sweep2")
        print("\nsweep2 summary (S=8k):")
        for r in rows:
            print(f"  D={r['d']:3d} causal={r['causal']:d} {r['tflops']:7.1f}  {r['cfg'][:100]}")
    if a.sweep3:
        sweep3(a.out)
    if a.sm90_short:
        variants = json.loads(a.short_variants) if a.short_variants else SM90_SHORT
        sweep3(a.out, seqs=(1024, 2048, 4096, 8192, 16384), variants=variants, tag="sm90_short",
               option="fwd_sm90_config", d=a.short_dim)
    if a.best:
        with open(a.best) as f:
            best = json.load(f)["best"]
        for key, (tf, cfg) in best.items():
            d, causal = (int(x) for x in key.split(","))
            table = configs.FWD_MASKED if causal else configs.FWD
            table[d] = configs.override(table.get(d) or configs.FWD[d], cfg, configs.FWD_KEYS)
            print(f"config D={d} causal={causal}: {cfg} ({tf:.1f} TFLOP/s in the sweep)")
    if a.full:
        full(a.out, dims=[int(x) for x in a.dims.split(",")], flex_budget_s=a.flex_budget,
             merge=a.merge)


if __name__ == "__main__":
    main()
