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
    mk = lambda: torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v, dout = mk(), mk(), mk(), mk()
    sdpa_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours_leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    stock = median_ms(step(sdpa, sdpa_leaves, dout))
    torch.nn.attention.activate_flash_attention_impl("flashlse")
    try:
        routed = median_ms(step(sdpa, sdpa_leaves, dout))
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    direct = median_ms(step(lambda q, k, v: fl.attention(q, k, v, causal=True), ours_leaves,
                            dout.transpose(1, 2).contiguous()))
    print(f"training step, causal B={b} S={s} H={h} D={d} bf16, {torch.cuda.get_device_name()}, "
          f"{time.strftime('%Y-%m-%d')}: SDPA -> flashlse {routed:.3f} ms, fl.attention "
          f"{direct:.3f} ms ({routed / direct:.3f}x; bar <= 1.05), SDPA stock flash "
          f"{stock:.3f} ms")


if __name__ == "__main__":
    main()
