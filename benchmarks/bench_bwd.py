"""Backward attention TFLOP/s: flashlse vs SDPA flash (FA-2), SDPA cuDNN and FlexAttention.

All systems run in this one process on the same GPU. bf16, B*S = 16k, H*D = 2048 (MHA at
every length, then GQA with 4 query heads a kv head at D = 128, S = 8k; peers with enable_gqa),
FLOPs = 2.5 * 4*B*H*Sq*Sk*D (halved for causal), time = median of triton.testing.do_bench
of the backward only: every system, flashlse's public ``fl.attention`` included, runs its
forward once and times ``torch.autograd.grad(..., retain_graph=True)`` (``--kernel-only``
times flashlse's launcher on a saved (out, lse) instead).
flashlse takes its native (B, S, H, D) layout, the peers their native (B, H, S, D).
Correctness is checked first (against float64 autograd of flashlse.reference, with a
random dlse, a sink, a window and softcap), then the timings; the table is printed last.

    python benchmarks/bench_bwd.py                  # D = 64, 128, 256 (< 5 min on an H200)
    python benchmarks/bench_bwd.py --quick          # D = 128 only
    python benchmarks/bench_bwd.py --autotune       # autotune the tiles, print the picks
    python benchmarks/bench_bwd.py --sweep          # tile configs at D = 128, S = 8k
    python benchmarks/bench_bwd.py --results        # also append dated rows to RESULTS.md
    python benchmarks/bench_bwd.py --quick --sm90 none   # + bwd.py's kernels alone, same run

``--sm90 PARTS`` times a second flashlse column with exactly those Hopper Gluon kernels on
(``dkdv``, ``dq``, both, or ``none``: bwd.py's kernels only) beside the defaults.

Logs go to $OUT (or --out) as bench_bwd.log and bench_bwd.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import time
from pathlib import Path

import torch
import triton
from _common import attn_flops, bf16_inputs, causal_block_mask, flex_attention_compiled, median_ms

import flashlse
import flashlse as fl
from flashlse import reference
from flashlse.kernels import bwd
from flashlse.kernels.dispatch import attn_bwd, attn_fwd

SEQS = [1024, 2048, 4096, 8192, 16384]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
LOG: list[str] = []


def _log(msg=""):
    print(msg, flush=True)
    LOG.append(msg)


def _flops(b, h, sq, sk, d, causal):
    # The backward does 2.5x the forward's matrix products.
    return 2.5 * attn_flops(b, h, sq, sk, d, causal)


# --kernel-only: time the kernels' entry dispatch.attn_bwd on a saved (out, lse), not the
# public call.
KERNEL_ONLY = False
# --deterministic: the public call with deterministic=True (the two passes, no dQ reduces).
DETERMINISTIC = False


def _ours(q, k, v, causal):
    """The backward call to time (under the kernel options in force when it runs): the
    backward of the public ``fl.attention`` through autograd, as the peers are timed
    (``torch.autograd.grad(..., retain_graph=True)``), or the launcher with --kernel-only."""
    kw = dict(left=None, right=0 if causal else None, softcap=0.0,
              scale=1.0 / math.sqrt(q.shape[-1]), sink=None)
    if not KERNEL_ONLY:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fl.attention(*leaves, causal=causal, deterministic=DETERMINISTIC)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    out, lse = attn_fwd(q, k, v, **kw)
    dout = torch.randn_like(out)
    dlse = torch.zeros_like(lse)

    return lambda: attn_bwd(dout, dlse, q, k, v, out, lse, deterministic=DETERMINISTIC, **kw)


SM90_PARTS: tuple = ()  # --sm90: a second column with exactly these Gluon kernels on


def _sm90_options(parts):
    """Exactly the Hopper Gluon kernels in ``parts`` on (dkdv, dq)."""
    return fl.kernel_options(sm90_dkdv="dkdv" in parts, sm90_dq="dq" in parts)


def _with_sm90(make, parts):
    """The call ``make()`` returns, made and run under :func:`_sm90_options`: the public
    backward runs under its forward's options (autograd's device thread does not see a
    block around the backward alone; before session 33 this column timed the defaults)."""
    with _sm90_options(parts):
        fn = make()

    def run():
        with _sm90_options(parts):
            return fn()
    return run


def _grad_fn(out, inputs):
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _sdpa(backend, qh, kh, vh, causal):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    inputs = [t.detach().requires_grad_(True) for t in (qh, kh, vh)]
    with sdpa_kernel(backend):
        out = sdpa(*inputs, is_causal=causal, enable_gqa=qh.shape[1] != kh.shape[1])
    return _grad_fn(out, inputs)


def _flex(qh, kh, vh, causal):
    bm = causal_block_mask(qh.shape[2], kh.shape[2]) if causal else None
    inputs = [t.detach().requires_grad_(True) for t in (qh, kh, vh)]
    out = flex_attention_compiled()(*inputs, block_mask=bm,
                                    enable_gqa=qh.shape[1] != kh.shape[1])
    return _grad_fn(out, inputs)


def _torch_bf16(q, k, v, causal, window, softcap, scale, sink):
    """The same attention in bf16 with materialised scores: the error yardstick."""
    with reference.computed_in(q.dtype):
        return reference.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                   scale=scale, sink=sink, return_lse=True)


def _grads(fn, inputs, dout, dlse):
    out, lse = fn(*inputs)
    fin = torch.isfinite(lse.detach())
    loss = (out * dout.to(out.dtype)).sum() + (lse[fin] * dlse.to(lse.dtype)[fin]).sum()
    need = [t for t in inputs if t is not None]
    return torch.autograd.grad(loss, need)


def check(d, causal=False, window=(None, None), softcap=0.0, sink=False, sq=1000, sk=1100):
    """flashlse's grads vs float64 autograd: err <= 2 * err(bf16 torch) + 1.6e-2 * scale."""
    from flashlse.masks import normalize_window

    b, hq, hkv = 2, 4, 2
    g = torch.Generator(device="cuda").manual_seed(d + sq)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
    q = mk(b, sq, hq, d).bfloat16()
    k, v = mk(b, sk, hkv, d).bfloat16(), mk(b, sk, hkv, d).bfloat16()
    sink_t = mk(hq) if sink else None
    scale = 1.0 / math.sqrt(d)
    left, right = normalize_window(causal, window)
    kw = dict(left=left, right=right, softcap=softcap, scale=scale, sink=sink_t)
    out, lse = attn_fwd(q, k, v, **kw)
    dout = mk(*out.shape).bfloat16()
    dlse = mk(*lse.shape).masked_fill(~torch.isfinite(lse), 0.0)
    ours = attn_bwd(dout, dlse, q, k, v, out, lse, **kw)
    leaf = lambda t, dt: None if t is None else t.detach().to(dt).requires_grad_(True)
    ref = _grads(lambda q_, k_, v_, s_: reference.attention(
        q_, k_, v_, causal=causal, window=window, softcap=softcap, scale=scale, sink=s_,
        return_lse=True), [leaf(t, torch.float64) for t in (q, k, v, sink_t)], dout, dlse)
    pt = _grads(lambda q_, k_, v_, s_: _torch_bf16(q_, k_, v_, causal, window, softcap, scale,
                                                   s_),
                [leaf(q, q.dtype), leaf(k, k.dtype), leaf(v, v.dtype), leaf(sink_t, q.dtype)],
                dout, dlse)
    worst = 0.0
    for name, a, r, p in zip(("dq", "dk", "dv", "dsink"), ours, ref, pt):
        assert not torch.isnan(a).any(), f"NaN in {name}"
        sc = max(1.0, r.abs().max().item())
        err = (a.double() - r).abs().max().item()
        pt_err = (p.double() - r).abs().max().item()
        assert err <= 2 * pt_err + 1.6e-2 * sc, (
            f"{name} D={d} causal={causal}: err {err:.3g} vs bf16 torch {pt_err:.3g}")
        worst = max(worst, err / sc)
    return worst


def checks(dims):
    t0 = time.time()
    for d in dims:
        for causal in (False, True):
            err = check(d, causal=causal)
            _log(f"check D={d} causal={causal:d}: max rel err {err:.2e}")
    err = check(128, window=(300, 0), softcap=30.0, sink=True, sq=1300, sk=900)
    _log(f"check D=128 window+softcap+sink+empty rows: max rel err {err:.2e}")
    err = check(192 if 192 in dims or 128 in dims else dims[0], causal=True, sink=True)
    _log(f"check causal+sink: max rel err {err:.2e} ({time.time() - t0:.0f} s of checks)")


def _peers_inputs(q, k, v):
    return (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous())


def _safe(name, fn):
    try:
        return median_ms(fn())
    except Exception as e:  # noqa: BLE001 - a backend may refuse a shape; record why
        _log(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")


def _row(d, seq, causal, flex_on, group=1):
    from torch.nn.attention import SDPBackend

    h, b = 2048 // d, 16384 // seq
    q, k, v = bf16_inputs(b, seq, seq, h, d, seed=seq + d)
    # GQA: h // group kv heads (the FLOPs count the query heads, as for MHA).
    k, v = k[:, :, : h // group].contiguous(), v[:, :, : h // group].contiguous()
    qh, kh, vh = _peers_inputs(q, k, v)
    fl = _flops(b, h, seq, seq, d, causal)
    r = dict(d=d, seq=seq, b=b, h=h, hkv=h // group, causal=causal)
    makers = dict(
        flashlse=lambda: _ours(q, k, v, causal),
        **({"sm90": lambda: _with_sm90(lambda: _ours(q, k, v, causal), SM90_PARTS)}
           if SM90_PARTS else {}),
        fa2=lambda: _sdpa(SDPBackend.FLASH_ATTENTION, qh, kh, vh, causal),
        cudnn=lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, qh, kh, vh, causal),
        flex=lambda: _flex(qh, kh, vh, causal),
    )
    flex_s = 0.0
    for name, make in makers.items():
        r[name] = float("nan")
        if name == "flex" and not flex_on:
            continue
        t0 = time.time()
        r[name] = fl / _safe(name, make) * 1e-9
        if name == "flex":
            flex_s = time.time() - t0
    return r, flex_s


def run_table(dims, flex_budget_s):
    rows = []
    flex_spent = 0.0
    # MHA at every length, then GQA (4 query heads a kv head) at D = 128, S = 8k.
    shapes = [(d, seq, 1) for d in dims for seq in SEQS]
    shapes += [(128, 8192, 4)] if 128 in dims else []
    for d, seq, group in shapes:
        for causal in (False, True):
            # Flex compiles per shape: past its budget its column is left empty.
            r, flex_s = _row(d, seq, causal, flex_spent < flex_budget_s, group)
            rows.append(r)
            flex_spent += flex_s
            _log(_fmt(rows[-1]))
            torch.cuda.empty_cache()
    return rows


def _heads(r):
    """``H=16`` for MHA, ``H=16/4`` (query / kv heads) for GQA."""
    return f"H={r['h']}" + (f"/{r['hkv']}" if r["hkv"] != r["h"] else "")


def _fmt(r):
    f = r["flashlse"]
    return (f"D={r['d']:3d} S={r['seq']:5d} {_heads(r)} causal={r['causal']:d} flashlse {f:6.1f} "
            f"FA2 {r['fa2']:6.1f} cuDNN {r['cudnn']:6.1f} Flex {r['flex']:6.1f} "
            f"x{f / r['fa2']:.2f} FA-2 x{f / r['cudnn']:.2f} cuDNN x{f / r['flex']:.2f} Flex"
            + (f" | sm90 {r['sm90']:6.1f} x{r['sm90'] / r['cudnn']:.2f} cuDNN" if "sm90" in r
               else ""))


def _table(rows):
    lines = ["| D | S | heads | causal | flashlse | FA-2 | cuDNN | Flex | /FA-2 | /cuDNN | /Flex |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["flashlse"]
        lines.append(
            f"| {r['d']} | {r['seq']} | {_heads(r)[2:]} | {'yes' if r['causal'] else 'no'} "
            f"| {f:.0f} "
            f"| {r['fa2']:.0f} | {r['cudnn']:.0f} | {r['flex']:.0f} "
            f"| {f / r['fa2']:.2f} | {f / r['cudnn']:.2f} | {f / r['flex']:.2f} |")
    if any("sm90" in r for r in rows):
        lines.append("")
        lines.append("| D | S | heads | causal | default | Gluon: " + ",".join(SM90_PARTS)
                     + " | / default | / cuDNN |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in rows:
            lines.append(f"| {r['d']} | {r['seq']} | {_heads(r)[2:]} | "
                         f"{'yes' if r['causal'] else 'no'} | {r['flashlse']:.0f} | "
                         f"{r['sm90']:.0f} | {r['sm90'] / r['flashlse']:.2f} | "
                         f"{r['sm90'] / r['cudnn']:.2f} |")
    lines.append("(TFLOP/s, backward = 2.5x forward FLOPs)")
    return "\n".join(lines)


def _append_results(meta, rows):
    # One section per run, as the other bench scripts write theirs.
    text = (f"\n### bench_bwd.py {meta['date']}\n\n"
            "| date | device | torch | triton | op | shape | flashlse TFLOP/s | "
            "peers TFLOP/s | ratio |\n|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        f = r["flashlse"]
        text += (
            f"| {meta['date']} | {meta['device']} | {meta['torch']} | {meta['triton']} "
            f"| bwd bf16 | D={r['d']} S={r['seq']} B={r['b']} {_heads(r)} "
            f"{'causal' if r['causal'] else 'full'} | {f:.0f} "
            f"| FA-2 {r['fa2']:.0f}, cuDNN {r['cudnn']:.0f}, Flex {r['flex']:.0f} "
            f"| x{f / r['fa2']:.2f} FA-2, x{f / r['cudnn']:.2f} cuDNN, "
            f"x{f / r['flex']:.2f} Flex |\n")
    with RESULTS.open("a") as f:
        f.write(text)


# Per head dim, each entry is KernelOptions.bwd_config for one timed run (the rest at the
# table defaults; the first entry is the defaults themselves).
SWEEP = {
    64: [{}, {"EARLY_DP": False}, {"dkdv": (128, 128, 8, 2)}, {"dq": (128, 64, 8, 3)},
         {"dq": (128, 64, 4, 3)}],
    128: [{}, {"EARLY_DP": False}, {"dkdv": (64, 128, 8, 3), "EARLY_DP": False},
          {"dkdv": (64, 64, 4, 2), "EARLY_DP": False}, {"dkdv": (32, 64, 4, 3)},
          {"dq": (64, 64, 4, 3)}, {"dq": (64, 128, 4, 2)}],
    256: [{}, {"dkdv": (32, 64, 8, 2)}, {"dq": (64, 64, 8, 2)}, {"dq": (128, 32, 8, 2)},
          {"dkdv": (32, 64, 8, 2), "dq": (64, 64, 8, 2)}],
}


def sweep(dims, seq=8192):
    """Tile and schedule variants at one shape, and the time of each kernel at the defaults."""
    for d in dims:
        h, b = 2048 // d, 16384 // seq
        q, k, v = bf16_inputs(b, seq, seq, h, d)
        for causal in (False, True):
            fl = _flops(b, h, seq, seq, d, causal)
            for cfg in SWEEP[d]:
                with flashlse.kernel_options(bwd_config=cfg):
                    ms = _safe(f"{cfg}", functools.partial(_ours, q, k, v, causal))
                _log(f"sweep D={d} S={seq} causal={causal:d} {cfg}: "
                     f"{fl / ms * 1e-9:6.1f} TFLOP/s")
            _kernel_times(_ours(q, k, v, causal), f"D={d} S={seq} causal={causal:d}")


def _kernel_times(fn, label):
    """Device time per kernel of one call (torch profiler), to see which pass dominates."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 0:
            _log(f"kernels {label}: {e.key[:60]:60s} {e.device_time_total / 5e3:8.3f} ms")


def _run(a, dims):
    t0 = time.time()
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__)
    _log(f"bench_bwd {meta}")
    checks(dims)
    if SM90_PARTS:
        # The same checks through the Gluon kernels before they are timed.
        with _sm90_options(SM90_PARTS):
            checks([128])
    rows = []
    if a.sweep:
        sweep(dims)
    else:
        rows = run_table(dims, a.flex_budget)
    if a.autotune:
        for name, kern in (("dkdv", bwd._attn_bwd_dkdv_tuned), ("dq", bwd._attn_bwd_dq_tuned)):
            for key, cfg in kern.cache.items():
                _log(f"autotune {name} {key}: {cfg}")
    with open(os.path.join(a.out, "bench_bwd.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if a.results and rows:
        _append_results(meta, rows)
    _log(f"total {time.time() - t0:.0f} s")
    if rows:
        _log("\n" + _table(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="D = 128 only")
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--autotune", action="store_true", help="triton.autotune the tiles")
    p.add_argument("--sweep", action="store_true", help="tile configs per head dim, S = 8k")
    p.add_argument("--results", action="store_true", help="append rows to benchmarks/RESULTS.md")
    p.add_argument("--flex-budget", type=float, default=120.0,
                   help="seconds of FlexAttention compile+timing before its column is skipped")
    p.add_argument("--sm90", default="",
                   help="a second column with exactly these Gluon kernels on (bwd_sm90.py): "
                        "dkdv, dq, dkdv,dq or none")
    p.add_argument("--bwd-config", default="",
                   help="a KernelOptions.bwd_config for every flashlse call, as JSON "
                        "(e.g. '{\"PERSISTENT\": true}': the persistent Hopper dQ)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--kernel-only", action="store_true",
                   help="time the launcher on a saved (out, lse) instead of the public call")
    p.add_argument("--deterministic", action="store_true",
                   help="flashlse with deterministic=True (two passes, no dQ reduces)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    global SM90_PARTS, KERNEL_ONLY, DETERMINISTIC
    KERNEL_ONLY = a.kernel_only
    DETERMINISTIC = a.deterministic
    SM90_PARTS = tuple(x for x in a.sm90.split(",") if x)
    dims = [128] if a.quick else [int(x) for x in a.dims.split(",")]
    try:
        bwd_config = json.loads(a.bwd_config) if a.bwd_config else None
        with flashlse.kernel_options(autotune_bwd=a.autotune, bwd_config=bwd_config):
            _run(a, dims)
    finally:
        # The log reaches $OUT even when a correctness check stops the run.
        with open(os.path.join(a.out, "bench_bwd.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
