"""Seeded fuzzer of the transformers integration against transformers' "eager".

Each configuration draws a tiny random model of transformers' own classes (Llama; gpt-oss
with a sliding and a full layer and learnable sinks; BART, encoder-decoder), a batch of 1-4
rows of 1-12 tokens, and its padding: none (half of those with no mask given at all), left
(decoders) or right (BART's encoder; a decoder's logits only). Decoders generate greedily,
on the default cache or on a static one (``cache_implementation="static"``) in two of five
draws, half of those with generate's compiled decode steps (dynamo's eager backend); the
tokens must equal eager's. Every configuration first compares the logits of a
forward (a decoder's real tokens; BART's on random decoder inputs) within 1e-4 (float32).

    python -m tools.fuzz_transformers --n 200 --seed 0

Prints one line per failure (``--seed S --n 1`` replays it) and a summary; exit 1 on any
failure. tests/test_integrations_transformers.py runs it at a small count in CI.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time

import torch


def _model(kind: str):
    import transformers

    import flashlse.integrations.transformers as flt

    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64)
        cls = transformers.LlamaForCausalLM
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16,
                                        num_local_experts=2, num_experts_per_tok=1,
                                        sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        max_position_embeddings=64)
        cls = transformers.GptOssForCausalLM
    else:
        cfg = transformers.BartConfig(vocab_size=97, d_model=64, encoder_layers=2,
                                      decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=64,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                      decoder_start_token_id=2, forced_eos_token_id=None)
        cls = transformers.BartForConditionalGeneration
    # Each model its own config: _from_config writes the implementation into it.
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=flt.ATTN_IMPLEMENTATION)
    ours.load_state_dict(eager.state_dict())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("sinks"):  # random sinks, so that they matter
                p.copy_(torch.randn_like(p))
                dict(eager.named_parameters())[name].copy_(p)
    return eager, ours.eval()


def _compile_config():
    """generate's compile settings on any device (transformers compiles only on
    accelerators by default), with dynamo's eager backend."""
    from transformers import CompileConfig

    cfg = CompileConfig(backend="eager")
    cfg._compile_all_devices = True
    return cfg


def run_one(seed: int) -> str | None:
    """One configuration; None when it agrees with eager, else what differed."""
    r = random.Random(seed)
    kind = r.choice(["llama", "gpt_oss", "bart"])
    torch.manual_seed(seed)
    eager, ours = _model(kind)
    b, s = r.randint(1, 4), r.randint(1, 12)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    side = r.choice(["none", "right"] if kind == "bart" else ["none", "left", "right"])
    for i in range(b):
        n = r.randint(0, s - 1) if side != "none" else 0
        if side == "left":
            mask[i, :n] = 0
        elif n:
            mask[i, s - n:] = 0
    if kind == "bart":
        ids[mask == 0] = 1  # BART's pad token
    # Half the unpadded batches pass no mask at all (transformers' mask functions then get
    # none either).
    given = None if side == "none" and r.random() < 0.5 else mask
    kw = dict(attention_mask=given, max_new_tokens=r.randint(1, 5), do_sample=False,
              pad_token_id=1 if kind == "bart" else 0)
    if kind != "bart" and r.random() < 0.4:
        kw["cache_implementation"] = "static"
        if r.random() < 0.5:  # generate's compiled decode steps (dynamo only: quick)
            kw["compile_config"] = _compile_config()
    what = (f"{kind} B={b} S={s} {side}-padded {kw.get('cache_implementation', 'dynamic')}"
            + (" compiled" if "compile_config" in kw else ""))
    with torch.no_grad():
        # Logits first (a tiny random model's greedy tokens often agree where the logits do
        # not): a decoder's on its real tokens, BART's on random decoder inputs.
        fwd = dict(input_ids=ids, attention_mask=given)
        real = mask.bool()
        if kind == "bart":
            fwd["decoder_input_ids"] = torch.randint(3, 97, (b, r.randint(1, 6)), generator=g)
            real = slice(None)
        want, got = eager(**fwd).logits[real], ours(**fwd).logits[real]
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-3):
            return f"{what}: logits off by {(got - want).abs().max():.3g}"
        if side == "right" and kind != "bart":
            return None  # (generation continues the last column: a right-padded batch's pads)
        want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    return None if torch.equal(got, want) else f"{what}: tokens {got.tolist()} != {want.tolist()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import transformers  # noqa: F401 - a clear ImportError where it is missing

    t0, failures = time.time(), 0
    for seed in range(a.seed, a.seed + a.n):
        try:
            why = run_one(seed)
        except Exception as e:  # noqa: BLE001 - a crash is a failure, reported with its seed
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            failures += 1
            print(f"FAIL --seed {seed}: {why}")
    print(f"fuzz_transformers: {a.n} configurations, seeds {a.seed}..{a.seed + a.n - 1}: "
          f"{failures} failures, {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
