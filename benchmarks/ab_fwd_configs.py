"""Hopper forward tile configs against each other through the public ``fl.attention`` (no
grad): each ``KernelOptions.fwd_sm90_config`` variant and cuDNN's SDPA timed in turn
(``_common.interleaved_ms``), each variant's output first checked against the first's.

    python benchmarks/ab_fwd_configs.py [--dim 64] [--seqs 1024,2048,4096,8192]
        [--variants '[{}, {"CONSUMERS": 2}]']

B*S = 16k, H*D = 2048, bf16, causal and not. Prints TFLOP/s per variant and cuDNN, then each
variant over cuDNN. (Session 38 measured the D = 64 persistent forward on three consumer
warpgroups against two with it: ``--variants '[{}, {"CONSUMERS": 2}]'``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import attn_flops, bf16_inputs, interleaved_ms  # noqa: E402

import flashlse as fl  # noqa: E402


def _calls(q, k, v, causal, variants):
    """One public call per variant, and cuDNN's SDPA on the (B, H, S, D) views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def ours(cfg):
        def call():
            with fl.kernel_options(fwd_sm90_config=cfg):
                return fl.attention(q, k, v, causal=causal)
        return call

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, is_causal=causal)

    return [ours(cfg) for cfg in variants], cudnn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--variants", default='[{}, {"CONSUMERS": 2}]',
                    help="fwd_sm90_config overrides as a JSON list; the first is the reference")
    args = ap.parse_args()
    variants = json.loads(args.variants)
    d, h = args.dim, 2048 // args.dim
    names = [",".join(f"{key}={val}" for key, val in cfg.items()) or "shipped"
             for cfg in variants]
    print(f"D={d} H={h} B*S=16k bf16, TFLOP/s: {' | '.join(names)} | cuDNN")
    for causal in (True, False):
        for s in (int(x) for x in args.seqs.split(",")):
            b = 16384 // s
            q, k, v = bf16_inputs(b, s, s, h, d)
            ours, cudnn = _calls(q, k, v, causal, variants)
            ref = ours[0]().float()
            for name, call in zip(names[1:], ours[1:]):
                err = (call().float() - ref).abs().max().item()
                if not err < 2e-2:  # NaN fails too
                    print(f"  MISMATCH {name} causal={causal:d} S={s}: max |diff| {err}")
            ms = interleaved_ms([*ours, cudnn])
            tf = [attn_flops(b, h, s, s, d, causal) / m * 1e-9 for m in ms]
            print(f"causal={causal:d} S={s:5d} " + " ".join(f"{t:6.1f}" for t in tf)
                  + "  /cuDNN " + " ".join(f"{t / tf[-1]:.3f}" for t in tf[:-1]), flush=True)


if __name__ == "__main__":
    main()
