"""A kernel switch's A/B through the public forward: ``fl.attention`` (no grad), packed
``attention_varlen`` and a chunked prefill through ``attention_with_kvcache`` with a module
flag on and off, timed in turn (``_common.flag_ab_ms``), cuDNN's SDPA beside the dense
rows.

    python benchmarks/ab_fwd_switch.py --flag MODULE.NAME [--seqs 1024,2048,4096]

Dense rows: B*S = 16k, H = 16, D = 128, bf16, causal and not. Varlen: bench_varlen's 16k
tokens in causal documents of 64-4k tokens (seed 0), H = 16. Chunked prefill: bench_serving's
B = 4, 512 new rows on an 8k cache (Hq / Hkv = 32 / 8), contiguous and paged 16. The flag is a
module attribute of ``flashlse.kernels`` (read when a call plans its launches; the plans are
dropped at each switch, ``_common.flag_runs``). TFLOP/s count the visible keys only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import attn_flops, bf16_inputs, flag_ab_ms  # noqa: E402
from bench_serving import paged  # noqa: E402
from bench_varlen import doc_lengths  # noqa: E402

import flashlse as fl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True, help="module.NAME in flashlse.kernels")
    ap.add_argument("--seqs", default="1024,2048,4096")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; {args.flag} on / off, "
          f"forward TFLOP/s (public call), cuDNN beside the dense rows")
    print(f"{'call':<34} {'on':>8} {'off':>8} {'on/off':>7} {'cuDNN':>8} {'on/cuDNN':>8}")
    h, d = 16, 128
    with torch.no_grad():
        for s in (int(x) for x in args.seqs.split(",")):
            b = 16384 // s
            q, k, v = bf16_inputs(b, s, s, h, d)
            qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            for causal in (False, True):
                def cudnn(qh=qh, kh=kh, vh=vh, causal=causal):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        sdpa(qh, kh, vh, is_causal=causal)

                t_on, t_off, t_cu = flag_ab_ms(
                    args.flag, lambda q=q, k=k, v=v, c=causal: fl.attention(q, k, v, causal=c),
                    [cudnn])
                f = attn_flops(b, h, s, s, d, causal)
                tf = lambda ms, f=f: f / ms / 1e9
                print(f"{f'dense S={s} causal={causal}':<34} {tf(t_on):8.1f} {tf(t_off):8.1f} "
                      f"{t_off / t_on:7.3f} {tf(t_cu):8.1f} {t_cu / t_on:8.3f}")
        lens = doc_lengths(16384, 64, 4096, 0)
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *sh: torch.randn(*sh, generator=g, device="cuda", dtype=torch.bfloat16)
        q, k, v = mk(16384, h, d), mk(16384, h, d), mk(16384, h, d)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        t_on, t_off = flag_ab_ms(args.flag, lambda: fl.attention_varlen(
            q, k, v, cu, cu, max(lens), max(lens), causal=True))
        f = sum(2 * n * n * h * d for n in lens)
        print(f"{'varlen 16k tokens, docs 64-4k':<34} {f / t_on / 1e9:8.1f} "
              f"{f / t_off / 1e9:8.1f} {t_off / t_on:7.3f}")
        b, sq, sk, hq, hkv = 4, 512, 8192, 32, 8
        q = mk(b, sq, hq, d)
        k, v = mk(b, sk, hkv, d), mk(b, sk, hkv, d)
        seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        f = 4 * b * hq * sq * d * (sk - sq / 2)
        kp, table = paged(k, 16)
        vp, _ = paged(v, 16, table.flatten().long())
        for label, call in (
                ("chunked prefill contiguous", lambda: fl.attention_with_kvcache(
                    q, k, v, cache_seqlens=seqlens, causal=True)),
                ("chunked prefill paged 16", lambda: fl.attention_with_kvcache(
                    q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True))):
            t_on, t_off = flag_ab_ms(args.flag, call)
            print(f"{label:<34} {f / t_on / 1e9:8.1f} {f / t_off / 1e9:8.1f} "
                  f"{t_off / t_on:7.3f}")


if __name__ == "__main__":
    main()
