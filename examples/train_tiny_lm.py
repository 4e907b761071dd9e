"""Train a tiny causal LM twice -- attention by flashlse, then by SDPA -- from the same
initial weights on the same synthetic batches, and compare the loss curves.

The data is a random first-order Markov chain over a small vocabulary (a fixed random
transition table with a few likely successors per token), so the loss has a known floor
(the chain's entropy rate) that both runs should approach.

    python examples/train_tiny_lm.py --steps 300 --out benchmarks/train.png
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashlse as fl


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if self.backend == "flashlse":
            a = fl.attention(q, k, v, causal=True)
        else:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, backend: str):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, backend) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def markov_batches(steps, batch, seq, vocab, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    probs = torch.softmax(logits, dim=-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())
    data = []
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            x[:, t + 1] = torch.multinomial(probs[x[:, t]], 1, generator=g).squeeze(-1)
        data.append(x.to(device))
    return data, entropy


def train(backend, data, args, device, dtype):
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.heads, args.layers, args.seq, backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    t0 = time.perf_counter()
    for x in data:
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{backend}: non-finite loss at step {len(losses)}")
    return losses, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="plot path (png)")
    p.add_argument("--json", default=None, help="write both loss curves here")
    args = p.parse_args()
    if args.out:
        # Fail now, not after the training: the plot needs matplotlib.
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--out writes a plot with matplotlib, which is not installed: "
                    "pip install matplotlib, or drop --out")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    data, entropy = markov_batches(args.steps, args.batch, args.seq, args.vocab, device)
    curves = {}
    for backend in ("flashlse", "sdpa"):
        losses, secs = train(backend, data, args, device, dtype)
        curves[backend] = losses
        tail = sum(losses[-20:]) / 20
        print(f"{backend:9s} final loss (mean of last 20) {tail:.4f}  time {secs:.1f}s")
    diffs = [abs(a - b) for a, b in zip(curves["flashlse"], curves["sdpa"])]
    print(f"entropy floor {entropy:.4f}; max |loss difference| {max(diffs):.4f}, "
          f"mean over the last 50 steps {sum(diffs[-50:]) / 50:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(curves, entropy=entropy, args=vars(args)), f)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure(figsize=(6, 3.5))
        for name, losses in curves.items():
            plt.plot(losses, label=name, lw=1)
        plt.axhline(entropy, color="gray", ls="--", lw=0.8, label="entropy floor")
        plt.xlabel("step")
        plt.ylabel("cross-entropy")
        plt.title(f"tiny causal LM on {device.type}, bf16 autocast")
        plt.legend()
        plt.tight_layout()
        plt.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
