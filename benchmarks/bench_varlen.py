"""Packed varlen training through the public ``attention_varlen`` (issue 16's third bar), beside
the dense kernel on the same tokens, one process.

16k tokens packed in causal documents of 64-4k tokens (seeded random lengths), H=16, D=128,
bf16; forward and forward+backward of ``fl.attention_varlen``, and ``fl.attention`` at B=4,
S=4k (the same tokens as four documents of 4k) as the yardstick: the bar is forward >= 0.9x and
backward >= 0.85x its TFLOP/s. FLOPs are counted per document (``2 L^2 H D`` a causal forward,
2.5x that for the backward), so short documents are not credited with the masked work.

It also prints how the forward grid is used: a varlen launch covers (row blocks of the longest
document) x heads x documents, and the programs of a short document's missing blocks start
and exit. Against the real row blocks that count says whether those starts can matter.

    python benchmarks/bench_varlen.py [--seed S] [--dim D] [--varlen-l2-mb 16,32] [--smoke]
    python benchmarks/bench_varlen.py --dim 64 --fwd-variants '[{}, {"VARLEN_CONSUMERS": 2}]'
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _common import attention_step, flag_ab_ms, interleaved_ms, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402
from flashlse.kernels import configs  # noqa: E402


def doc_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Random document lengths in ``[lo, hi]`` that sum to ``total`` (the last one clipped,
    topped up to ``lo`` from the one before when it would be shorter)."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    if len(lens) > 1 and lens[-1] < lo:
        lens[-2] -= lo - lens[-1]
        lens[-1] = lo
    return lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=128, help="head dim (the bar's is 128)")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="documents all of this length, against the dense kernel at S = it "
                         "(the varlen path's own cost, apart from the mix of lengths)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, one call a row")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="GQA: kv heads for the 16 query heads (default 16: MHA)")
    ap.add_argument("--model", action="store_true",
                    help="also the dense forward at each document's length (B * L = the same "
                         "16k tokens): the varlen forward against that per-length model")
    ap.add_argument("--flag", default=None,
                    help="MODULE.NAME of flashlse.kernels: the varlen fwd+bwd with it on and "
                         "off in turn, beside the dense step (an A/B in one process)")
    ap.add_argument("--flex", action="store_true",
                    help="also FlexAttention (torch.compile'd, a document-causal block mask) "
                         "on the same packed tokens: forward and step, in turn with varlen")
    ap.add_argument("--fwd-variants", type=json.loads, default=[],
                    help="a JSON list of fwd_sm90_config overrides: the varlen forward under "
                         "each, timed in turn with the dense forward (an A/B in one process)")
    ap.add_argument("--varlen-l2-mb", type=lambda x: [int(v) for v in x.split(",")], default=[],
                    help="time the persistent varlen forward at these L2 section budgets (MB)")
    args = ap.parse_args()
    smoke = args.smoke
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    total, lo, hi, h, d, dense_s = ((256, 8, 64, 2, 32, 64) if smoke
                                    else (16384, 64, 4096, 16, args.dim, 4096))
    if args.doc_len:
        dense_s = args.doc_len
        lens = [dense_s] * (total // dense_s)
    else:
        lens = doc_lengths(total, lo, hi, args.seed)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    mk = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=dt, requires_grad=True)
    hkv = min(args.kv_heads or h, h)
    q, k, v = mk(total, h, d), mk(total, hkv, d), mk(total, hkv, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    dout = torch.randn(total, h, d, generator=g, device=dev, dtype=dt)
    fwd_flops = sum(2 * n * n * h * d for n in lens)
    vl = lambda: fl.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def vl_step():
        q.grad = k.grad = v.grad = None
        vl().backward(dout)

    b = total // dense_s
    qd, kd, vd = mk(b, dense_s, h, d), mk(b, dense_s, hkv, d), mk(b, dense_s, hkv, d)
    dout_d = torch.randn(b, dense_s, h, d, generator=g, device=dev, dtype=dt)
    dense_flops = b * 2 * dense_s * dense_s * h * d
    dn = lambda: fl.attention(qd, kd, vd, causal=True)

    def dn_step():
        qd.grad = kd.grad = vd.grad = None
        dn().backward(dout_d)

    # Each pair timed in turn, three rounds (the bars are their ratios: same clocks).
    with torch.no_grad():
        t_vl, t_dn = interleaved_ms([vl, dn], smoke)
    s_vl, s_dn = interleaved_ms([vl_step, dn_step], smoke)
    # Backward alone: the step minus the forward (both through the public call).
    b_vl, b_dn = max(s_vl - t_vl, 1e-9), max(s_dn - t_dn, 1e-9)
    tf = lambda flops, ms: flops / ms / 1e9
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"\npacked varlen: {name} torch {torch.__version__}; {len(lens)} causal documents of "
          f"{min(lens)}-{max(lens)} tokens ({total} in all), H={h}/{hkv} D={d}, seed {args.seed}")
    print(f"{'call':<44} {'fwd ms':>8} {'TFLOP/s':>8} {'bwd ms':>8} {'TFLOP/s':>8}")
    print(f"{'attention_varlen (packed documents)':<44} {t_vl:8.3f} {tf(fwd_flops, t_vl):8.1f} "
          f"{b_vl:8.3f} {tf(2.5 * fwd_flops, b_vl):8.1f}")
    print(f"{f'attention B={b} S={dense_s} (dense kernel)':<44} {t_dn:8.3f} "
          f"{tf(dense_flops, t_dn):8.1f} {b_dn:8.3f} {tf(2.5 * dense_flops, b_dn):8.1f}")
    fwd_ratio = tf(fwd_flops, t_vl) / tf(dense_flops, t_dn)
    bwd_ratio = tf(2.5 * fwd_flops, b_vl) / tf(2.5 * dense_flops, b_dn)
    print(f"ratio: forward {fwd_ratio:.2f}x (bar 0.90), backward {bwd_ratio:.2f}x (bar 0.85)")
    if args.model:
        # What the dense kernel does on each document's length alone (B * L of the same 16k
        # tokens, causal): sum of each document's time at its length's rate, forward and
        # backward (the step minus the forward). The varlen calls against it are the varlen
        # path's own efficiency, the short lengths' lower rate taken out.
        fwd_ms = bwd_ms = 0.0
        for n in sorted(set(lens)):
            bn = max(1, total // n)
            qm, km, vm = (mk(bn, n, h, d) for _ in range(3))
            dom = torch.randn(bn, n, h, d, generator=g, device=dev, dtype=dt)

            def fwd_m(a=qm, b=km, c=vm):
                with torch.no_grad():
                    fl.attention(a, b, c, causal=True)

            step_m = attention_step(qm, km, vm, dom, causal=True)
            t_f, t_s = (median_ms(fn, smoke) for fn in (fwd_m, step_m))
            fwd_ms += t_f * lens.count(n) / bn
            bwd_ms += max(t_s - t_f, 0.0) * lens.count(n) / bn
            del qm, km, vm, dom
        for what, m_ms, v_ms, f, ref in (("forward", fwd_ms, t_vl, fwd_flops, t_dn),
                                         ("backward", bwd_ms, b_vl, 2.5 * fwd_flops, b_dn)):
            dense_f = dense_flops * (2.5 if what == "backward" else 1)
            print(f"{f'dense model, {what} (each length alone)':<44} {m_ms:8.3f} "
                  f"{tf(f, m_ms):8.1f}  varlen / model {m_ms / v_ms:.2f}x, model / dense "
                  f"S={dense_s} {tf(f, m_ms) / tf(dense_f, ref):.2f}x")
    if args.flex and not smoke:
        flex_peer(q, k, v, dout, lens, vl, vl_step, fwd_flops, t_dn, dense_flops, tf)
    if args.flag:
        s_on, s_off, s_dn2 = flag_ab_ms(args.flag, vl_step, [dn_step], smoke)
        b_dn2 = max(s_dn2 - t_dn, 1e-9)
        for label, s_x in (("on", s_on), ("off", s_off)):
            b_x = max(s_x - t_vl, 1e-9)
            ratio = tf(2.5 * fwd_flops, b_x) / tf(2.5 * dense_flops, b_dn2)
            print(f"{f'  backward, {args.flag} {label}':<44} {'':8} {'':8} {b_x:8.3f} "
                  f"{tf(2.5 * fwd_flops, b_x):8.1f}  ({ratio:.2f}x)")
    if not smoke and d in configs.FWD_SM90:
        # The other Hopper varlen forward in the same process (the persistent kernel over
        # row blocks listed on the device, or the grid kernel), for the A/B.
        other = not configs.FWD_SM90[d].persistent_varlen
        with torch.no_grad(), fl.kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": other}):
            t_other = median_ms(vl, smoke)
        ratio = tf(fwd_flops, t_other) / tf(dense_flops, t_dn)
        print(f"{f'  forward, PERSISTENT_VARLEN={other}':<44} {t_other:8.3f} "
              f"{tf(fwd_flops, t_other):8.1f}  ({ratio:.2f}x)")
    if args.fwd_variants:
        def under(cfg, fn):
            def run():
                with fl.kernel_options(fwd_sm90_config=cfg):
                    fn()
            return run

        with torch.no_grad():
            times = interleaved_ms([under(c, vl) for c in args.fwd_variants] + [dn], smoke)
        for cfg, t_x in zip(args.fwd_variants, times):
            ratio = tf(fwd_flops, t_x) / tf(dense_flops, times[-1])
            print(f"{f'  forward, {json.dumps(cfg)}':<44} {t_x:8.3f} {tf(fwd_flops, t_x):8.1f}  "
                  f"({ratio:.2f}x dense {times[-1]:.3f} ms)")
    for mb in args.varlen_l2_mb:
        # The persistent varlen kernel with its heads dealt in sections of this L2 budget.
        from flashlse.kernels import fwd_sm90

        keep = fwd_sm90.VARLEN_L2_BYTES
        fwd_sm90.VARLEN_L2_BYTES = mb << 20
        fwd_sm90._PLANS.clear()
        with torch.no_grad(), fl.kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": True}):
            t_l2 = median_ms(vl, smoke)
        fwd_sm90.VARLEN_L2_BYTES = keep
        fwd_sm90._PLANS.clear()
        print(f"{f'  forward, persistent, L2 sections {mb} MB':<44} {t_l2:8.3f} "
              f"{tf(fwd_flops, t_l2):8.1f}  ({tf(fwd_flops, t_l2) / tf(dense_flops, t_dn):.2f}x)")
    blocks = sum(-(-n // 128) for n in lens) * h
    grid = -(-max(lens) // 128) * h * len(lens)
    print(f"forward grid (128-row blocks): {grid} programs for {blocks} row blocks "
          f"({grid - blocks} start and exit)")


def flex_peer(q, k, v, dout, lens, vl, vl_step, fwd_flops, t_dn, dense_flops, tf):
    """FlexAttention on the same packed documents (one sequence of ``total`` tokens, a
    block mask that keeps each query in its document and causal), compiled once, timed in
    turn with the varlen call: the peer a FlexAttention user would compare with."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device),
                                  torch.tensor(lens, device=q.device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    flex = torch.compile(flex_attention)
    as_bhsd = lambda x: x.transpose(0, 1).unsqueeze(0)
    fx = lambda: flex(as_bhsd(q), as_bhsd(k), as_bhsd(v), block_mask=mask)

    def fx_step():
        q.grad = k.grad = v.grad = None
        fx().backward(as_bhsd(dout))

    with torch.no_grad():
        err = float((fx()[0].transpose(0, 1).float() - vl().float()).abs().max())
        t_vl, t_fx = interleaved_ms([vl, fx], False)
    s_vl, s_fx = interleaved_ms([vl_step, fx_step], False)
    for label, t, st in (("attention_varlen (in turn with flex)", t_vl, s_vl),
                         ("FlexAttention, document-causal mask", t_fx, s_fx)):
        b_ms = max(st - t, 1e-9)
        print(f"{label:<44} {t:8.3f} {tf(fwd_flops, t):8.1f} {b_ms:8.3f} "
              f"{tf(2.5 * fwd_flops, b_ms):8.1f}")
    print(f"  flex max diff against varlen {err:.1e}; varlen / flex: forward {t_fx / t_vl:.2f}x, "
          f"backward {(s_fx - t_fx) / max(s_vl - t_vl, 1e-9):.2f}x")


if __name__ == "__main__":
    main()
