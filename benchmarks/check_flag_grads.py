"""A kernel flag's gradients against the flag off and the float64 reference, before its A/B
(a variant's smoke check on the GPU; its full GPU tests run if it is kept).

    python benchmarks/check_flag_grads.py --flag bwd_sm90.RING3_D64 --dim 64

fwd+bwd through ``fl.attention`` (bf16, causal and not, MHA and GQA 4:1, lengths with
partial blocks); prints the largest error of dq / dk / dv against float64 for each, beside
the flag-off error, and fails on a NaN or an error above twice the flag-off one (+1e-3).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import flag_runs  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse import reference  # noqa: E402


def _grads(q, k, v, dout, causal, dtype):
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    if dtype == torch.float64:
        out = reference.attention(*leaves, causal=causal)
    else:
        out = fl.attention(*leaves, causal=causal)
    (out.to(torch.float64) * dout).sum().backward()
    return [t.grad.to(torch.float64) for t in leaves]


def _errors(q, k, v, dout, causal, want) -> list[tuple[float, bool]]:
    """(largest error against ``want``, any NaN) of dq, dk, dv in bf16."""
    return [((x - w).abs().max().item(), x.isnan().any().item())
            for x, w in zip(_grads(q, k, v, dout, causal, torch.bfloat16), want)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True, help="as _common.flag_runs takes it")
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(7)
    bad = 0
    for b, sq, sk, hq, hkv in ((2, 777, 777, 8, 8), (1, 1000, 700, 8, 2), (3, 256, 300, 4, 1)):
        for causal in (False, True):
            mk = lambda s, h, b=b: torch.randn(b, s, h, a.dim, generator=g).cuda()
            q, k, v, dout = mk(sq, hq), mk(sk, hkv), mk(sk, hkv), mk(sq, hq).double()
            want = _grads(q, k, v, dout, causal, torch.float64)
            # The flag on, off, then its value back (the plans dropped at each change).
            on, off, restore = flag_runs(a.flag, functools.partial(_errors, q, k, v, dout,
                                                                   causal, want))
            errs = {True: on(), False: off()}
            restore()
            ok = all(not n1 and e1 <= 2 * e0 + 1e-3
                     for (e0, _), (e1, n1) in zip(errs[False], errs[True]))
            bad += not ok
            print(f"{b}x{sq}x{sk} {hq}/{hkv} causal={causal}: on "
                  + " ".join(f"{e:.4f}" for e, _ in errs[True]) + " off "
                  + " ".join(f"{e:.4f}" for e, _ in errs[False]) + ("" if ok else "  FAIL"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
