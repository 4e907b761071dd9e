"""transformers end to end: a Llama-shaped model with random weights (no download) under
``attn_implementation`` flashlse (``flashlse.integrations.transformers``) and torch's
``"sdpa"``, in one process, timed in turn: what a transformers user sees.

    python benchmarks/bench_transformers.py            # GPU, bf16, ~1.2B parameters
    python benchmarks/bench_transformers.py --tiny     # CPU smoke run (checks the script)
    python benchmarks/bench_transformers.py --cpu      # CPU, bf16, a ~0.1B-parameter model

Rows:
  * generate B = 1: a 512-token prompt, 128 new tokens, greedy, the dynamic cache (each step
    a dense ``fl.attention`` of one query row on the whole cache: the short-query route);
  * generate B = 8, left-padded prompts of 128-512 tokens, 64 new tokens (the padded path:
    ``attention_varlen`` on the real rows a layer);
  * a training step, B = 4, S = 2048: forward, loss, backward (attention fwd+bwd a layer).
Printed: milliseconds a call (median of ``--rounds`` in turn), tokens / s for generate, and
flashlse / sdpa. Same greedy tokens are reported (bf16: they may part after many steps).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashlse.integrations.transformers as flt  # noqa: E402


def _models(size: str, device: str, dtype: torch.dtype):
    import transformers

    if size == "tiny":
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=4096)
    elif size == "cpu":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024,
                                       intermediate_size=2816, num_hidden_layers=4,
                                       num_attention_heads=16, num_key_value_heads=4,
                                       max_position_embeddings=8192)
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048,
                                       intermediate_size=5632, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(device, dtype)
    state = base.state_dict()
    models = {}
    for impl in (flt.ATTN_IMPLEMENTATION, "sdpa"):
        # Each model its own config: _from_config writes the implementation into the config
        # it is given (with one config the second model's "sdpa" was both models' until
        # session 49).
        m = transformers.LlamaForCausalLM._from_config(
            copy.deepcopy(cfg), attn_implementation=impl).to(device, dtype)
        m.load_state_dict(state)
        models[impl] = m.eval()
    for impl, m in models.items():
        if m.config._attn_implementation != impl:
            raise RuntimeError(f"the {impl} model runs {m.config._attn_implementation}")
    return cfg, models


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, model, device) -> tuple:
    """Milliseconds of ``fn(model)`` (synchronized) and what it returned."""
    _sync(device)
    t = time.perf_counter()
    got = fn(model)
    _sync(device)
    return (time.perf_counter() - t) * 1e3, got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="the CPU path in bf16: 4 layers, 16 / 4 heads, D = 64; a 1k-token "
                         "prompt + 32 new tokens, B = 8 + 16, a training step B = 1 S = 1k")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attn-host", action="store_true",
                    help="host us of each attention call inside generate B=1, both "
                         "implementations (decode steps and the prefill apart)")
    ap.add_argument("--attn-profile", action="store_true",
                    help="with --attn-host: cProfile of flashlse's attention calls alone "
                         "inside generate B=1 (own time, then cumulative)")
    args = ap.parse_args()
    device = "cpu" if args.tiny or args.cpu else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    import transformers

    size = "tiny" if args.tiny else "cpu" if args.cpu else "gpu"
    cfg, models = _models(size, device, dtype)
    prompt, new, b8_new = {"tiny": (16, 8, 4), "cpu": (1024, 32, 16), "gpu": (512, 128, 64)}[size]
    g = torch.Generator().manual_seed(1)
    ids1 = torch.randint(3, cfg.vocab_size, (1, prompt), generator=g).to(device)
    lens = torch.randint(prompt // 4, prompt + 1, (8,), generator=g)
    ids8 = torch.randint(3, cfg.vocab_size, (8, prompt), generator=g)
    mask8 = torch.arange(prompt)[None] >= (prompt - lens)[:, None]  # left padding
    ids8 = torch.where(mask8, ids8, 0).to(device)
    mask8 = mask8.long().to(device)
    seq, tb = {"tiny": (64, 2), "cpu": (1024, 1), "gpu": (2048, 4)}[size]
    train_ids = torch.randint(3, cfg.vocab_size, (tb, seq), generator=g).to(device)

    def gen1(m):
        with torch.no_grad():
            return m.generate(ids1, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def gen8(m):
        with torch.no_grad():
            return m.generate(ids8, attention_mask=mask8, max_new_tokens=b8_new,
                              min_new_tokens=b8_new, do_sample=False, pad_token_id=0)

    def train(m):
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        m.eval()
        return loss.detach()

    if args.attn_host:
        _attn_host(models, gen1, device, args.attn_profile)
        return
    rows = [(f"generate B=1, {prompt} + {new} tokens", gen1, new),
            (f"generate B=8 left-padded, + {b8_new} tokens", gen8, 8 * b8_new),
            (f"train step B={tb} S={seq}", train, None)]
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}  torch "
          f"{torch.__version__}  transformers {transformers.__version__}; Llama "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} / "
          f"{cfg.num_key_value_heads} heads, D = {cfg.hidden_size // cfg.num_attention_heads}")
    print("| call | flashlse ms | sdpa ms | flashlse / sdpa | tokens/s flashlse | sdpa | "
          "same output |")
    print("|---|---|---|---|---|---|---|")
    for label, fn, tokens in rows:
        for m in models.values():  # warm-up (compiles, plans)
            fn(m)
        times = {impl: [] for impl in models}
        outs = {}
        for r in range(1 if args.tiny else args.rounds):
            order = list(models.items()) if r % 2 == 0 else list(models.items())[::-1]
            for impl, m in order:
                ms, outs[impl] = _timed(fn, m, device)
                times[impl].append(ms)
        ours, sdpa = (statistics.median(times[i]) for i in models)
        a, b = outs.values()
        same = torch.equal(a, b) if tokens is not None else \
            f"loss diff {abs(float(a) - float(b)):.1e}"
        tps = (f"{tokens / ours * 1e3:.0f} | {tokens / sdpa * 1e3:.0f}" if tokens else "- | -")
        print(f"| {label} | {ours:.1f} | {sdpa:.1f} | {ours / sdpa:.3f} | {tps} | {same} |")


def _attn_host(models, gen1, device, profile=False) -> None:
    """Host us a call of the attention function transformers calls a layer (the registered
    one, wrapped by a timer), during generate B = 1, per implementation: where a host-bound
    decode step spends its attention time, against the model's whole step. ``profile``: a
    cProfile of flashlse's calls alone (the profiler on inside each call only)."""
    import cProfile
    import pstats

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as table

    spent = {}
    prof = cProfile.Profile() if profile else None

    def timed(impl, fn):
        def call(module, query, *a, **k):
            t = time.perf_counter()
            if prof is not None and impl != "sdpa":
                prof.enable()
                out = fn(module, query, *a, **k)
                prof.disable()
            else:
                out = fn(module, query, *a, **k)
            spent.setdefault((impl, query.shape[2] == 1), []).append(time.perf_counter() - t)
            return out
        return call

    for impl, m in models.items():
        fn = table[impl]
        table._global_mapping[impl] = timed(impl, fn)
        try:
            gen1(m)  # warm-up
            spent.clear()
            ms, _ = _timed(gen1, m, device)
        finally:
            table._global_mapping[impl] = fn
        for (name, decode), ts in sorted(spent.items()):
            if name == impl:
                ts = sorted(ts)
                print(f"{impl:<10} {'decode' if decode else 'prefill'}: {len(ts)} calls, host "
                      f"median {ts[len(ts) // 2] * 1e6:.1f} us, mean {sum(ts) / len(ts) * 1e6:.1f}"
                      f", p99 {ts[int(len(ts) * 0.99)] * 1e6:.1f}, sum {sum(ts) * 1e3:.1f} ms "
                      f"of the generate's {ms:.1f} ms")
            if prof is not None and impl != "sdpa":
                for order, top in (("tottime", 40), ("cumulative", 25)):
                    print(f"--- cProfile of {impl}'s calls (warm-up and timed), by {order}")
                    pstats.Stats(prof).sort_stats(order).print_stats(top)


if __name__ == "__main__":
    main()
