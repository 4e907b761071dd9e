"""A training step through SDPA routed to flashlse, against fl.attention (issue 19's bar:
within 5%), one process: forward + backward of ``F.scaled_dot_product_attention(q, k, v,
is_causal=True)`` with ``activate_flash_attention_impl("flashlse")``, and of
``fl.attention`` on the same tensors in flashlse's layout; SDPA's stock flash (FA-2) beside.

    python benchmarks/bench_sdpa.py [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _common import median_ms  # noqa: E402

import flashlse as fl  # noqa: E402


def step(fn, leaves, dout):
    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dout)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        print("bench_sdpa: needs CUDA (SDPA's flash backend); nothing to time in --smoke")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, h, d = 4, 4096, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    # A model's layout: projections give (B, S, H, D) and SDPA gets the transposed views
    # (transformers, torchtitan); "bhsd" is SDPA called on contiguous (B, H, S, D) leaves,
    # where both SDPA backends return transposed outputs and gradients that autograd copies.
    mk = lambda: torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v, dout = mk(), mk(), mk(), mk()
    t = lambda x: x.transpose(1, 2)

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = [x.clone().requires_grad_() for x in (q, k, v)]
    bhsd = [t(x).contiguous().requires_grad_() for x in (q, k, v)]
    sdpa_model = step(lambda q, k, v: t(sdpa(t(q), t(k), t(v))), model, dout)
    sdpa_bhsd = step(sdpa, bhsd, t(dout).contiguous())
    stock, stock_bhsd = median_ms(sdpa_model), median_ms(sdpa_bhsd)
    torch.nn.attention.activate_flash_attention_impl("flashlse")
    try:
        routed, routed_bhsd = median_ms(sdpa_model), median_ms(sdpa_bhsd)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    direct = median_ms(step(lambda q, k, v: fl.attention(q, k, v, causal=True), model, dout))
    print(f"training step, causal B={b} S={s} H={h} D={d} bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"  model layout: SDPA -> flashlse {routed:.3f} ms, fl.attention {direct:.3f} ms "
          f"({routed / direct:.3f}x; bar <= 1.05), SDPA stock flash {stock:.3f} ms")
    print(f"  contiguous (B, H, S, D) leaves: SDPA -> flashlse {routed_bhsd:.3f} ms "
          f"({routed_bhsd / direct:.3f}x fl.attention), SDPA stock flash {stock_bhsd:.3f} ms")

if __name__ == "__main__":
    main()
