"""A kernel flag's gradients against the flag off and the float64 reference, before its A/B
(a variant's smoke check on the GPU; its full GPU tests run if it is kept).

    python benchmarks/check_flag_grads.py --flag bwd_sm90.RING3_D64 --dim 64

fwd+bwd through ``fl.attention`` (bf16, causal and not, MHA and GQA 4:1, lengths with
partial blocks); prints the largest error of dq / dk / dv against float64 for each, beside
the flag-off error, and fails on a NaN or an error above twice the flag-off one (+1e-3).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashlse as fl  # noqa: E402
from flashlse import reference  # noqa: E402
from flashlse.kernels import bwd  # noqa: E402


def _grads(q, k, v, dout, causal, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    if dtype == torch.float64:
        out = reference.attention(*leaves, causal=causal)
    else:
        out = fl.attention(*leaves, causal=causal)
    (out.to(torch.float64) * dout).sum().backward()
    return [t.grad.to(torch.float64) for t in leaves]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True, help="MODULE.NAME under flashlse.kernels")
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    mod_name, name = a.flag.rsplit(".", 1)
    mod = importlib.import_module(f"flashlse.kernels.{mod_name}")
    g = torch.Generator().manual_seed(7)
    bad = 0
    for b, sq, sk, hq, hkv in ((2, 777, 777, 8, 8), (1, 1000, 700, 8, 2), (3, 256, 300, 4, 1)):
        for causal in (False, True):
            mk = lambda s, h, b=b: torch.randn(b, s, h, a.dim, generator=g).cuda()
            q, k, v, dout = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq).double()
            want = _grads(q, k, v, dout, causal, torch.float64)
            errs = {}
            for on in (False, True):
                setattr(mod, name, on)
                bwd._BWD_PLANS.clear()
                got = _grads(q, k, v, dout, causal, torch.bfloat16)
                errs[on] = [((x - w).abs().max().item(), x.isnan().any().item())
                            for x, w in zip(got, want)]
            setattr(mod, name, False)
            ok = all(not n1 and e1 <= 2 * e0 + 1e-3
                     for (e0, _), (e1, n1) in zip(errs[False], errs[True]))
            bad += not ok
            print(f"{b}x{sq}x{sk} {hq}/{hkv} causal={causal}: on "
                  + " ".join(f"{e:.4f}" for e, _ in errs[True]) + " off "
                  + " ".join(f"{e:.4f}" for e, _ in errs[False]) + ("" if ok else "  FAIL"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
