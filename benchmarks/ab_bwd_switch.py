"""A kernel switch's A/B through the public call: ``fl.attention`` forward + backward with a
module flag on and off, timed in turn (``_common.flag_ab_ms``), cuDNN's SDPA beside them.

    python benchmarks/ab_bwd_switch.py --flag bwd_sm90.HOST_DESC --seqs 1024,2048,4096,8192
        [--deterministic] [--one-thread] [--heads H] [--kv-heads HKV] [--dim D]

B*S = 16k, H = 16, D = 128, bf16, causal and not. The flag is a module attribute of
``flashlse.kernels`` (read when a backward plans its launches, so the plans are dropped at
each switch); TFLOP/s count the backward as 2.5 forwards.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import (  # noqa: E402
    attention_step,
    attn_flops,
    bf16_inputs,
    flag_ab_ms,
)


def _row(flag: str, s: int, causal: bool, heads: int, dim: int,
         deterministic: bool, threads: bool = True, kv_heads: int = 0) -> tuple:
    """Milliseconds of the flag on, off, and cuDNN's SDPA, at one shape (``kv_heads``: GQA,
    cuDNN on K and V repeated to every query head: the same FLOPs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b = 16384 // s
    q, k, v = bf16_inputs(b, s, s, heads, dim)
    if kv_heads and kv_heads != heads:
        k, v = (t[:, :, :kv_heads].contiguous() for t in (k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    group = heads // k.shape[2]
    heads_first = lambda t, n: (t.detach().repeat_interleave(n, dim=2).transpose(1, 2)
                                .contiguous().requires_grad_())
    qh, kh, vh = heads_first(q, 1), heads_first(k, group), heads_first(v, group)
    douth = dout.transpose(1, 2).contiguous()

    step = attention_step(q, k, v, dout, threads=threads, causal=causal,
                          deterministic=deterministic)

    def cudnn():
        qh.grad = kh.grad = vh.grad = None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa(qh, kh, vh, is_causal=causal).backward(douth)

    return b, flag_ab_ms(flag, step, [cudnn])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True, help="module.NAME in flashlse.kernels")
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="GQA: kv heads (default: --heads)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--deterministic", action="store_true", help="the two-pass backward")
    ap.add_argument("--one-thread", action="store_true",
                    help="flashlse's backward on the calling thread (autograd's device "
                         "thread off: ~half the host time, so short steps stay GPU-bound)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; {args.flag} on / off, "
          f"fwd+bwd TFLOP/s (public call), cuDNN beside")
    print(f"{'S':>6} {'causal':>6} {'on':>8} {'off':>8} {'on/off':>7} {'cuDNN':>8} {'on/cuDNN':>8}")
    for s in (int(x) for x in args.seqs.split(",")):
        for causal in (False, True):
            b, (t_on, t_off, t_cu) = _row(args.flag, s, causal, args.heads, args.dim,
                                          args.deterministic, not args.one_thread,
                                          args.kv_heads)
            flops = 3.5 * attn_flops(b, args.heads, s, s, args.dim, causal)
            tf = lambda ms, f=flops: f / ms / 1e9
            print(f"{s:>6} {str(causal):>6} {tf(t_on):8.1f} {tf(t_off):8.1f} "
                  f"{t_off / t_on:7.3f} {tf(t_cu):8.1f} {t_cu / t_on:8.3f}")


if __name__ == "__main__":
    main()
