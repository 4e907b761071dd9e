"""Generate with a transformers model whose attention is flashlse's.

    python examples/hf_generate.py [--model llama|gpt_oss] [--device cpu|cuda]

Builds a small random model from a config (no download: this machine reaches no model hub;
with real weights, ``from_pretrained(name, attn_implementation=...)`` is the same call), runs
greedy generation on a left-padded batch with attention "eager" and with flashlse, and prints
both continuations and whether they agree token for token.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_oss", choices=("llama", "gpt_oss"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args()
    if importlib.util.find_spec("transformers") is None:
        ap.error("this example needs transformers: pip install 'flashlse[transformers]'")
    import torch
    import transformers

    import flashlse.integrations.transformers as flt  # registers the implementation

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if args.model == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        config = transformers.GptOssConfig(**common, head_dim=32, num_local_experts=2,
                                           num_experts_per_tok=1, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"])
        cls = transformers.GptOssForCausalLM
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    # Each model its own config: _from_config writes the implementation into its config.
    eager = cls._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=dtype)
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=flt.ATTN_IMPLEMENTATION,
                            dtype=dtype)
    assert eager.config._attn_implementation == "eager"
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(1, 256, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second prompt is 4 tokens shorter, left-padded
    kw = dict(attention_mask=mask.to(args.device), max_new_tokens=args.new_tokens,
              do_sample=False, pad_token_id=0)
    outs = {}
    for name, model in (("eager", eager), (flt.ATTN_IMPLEMENTATION, ours)):
        with torch.no_grad():
            outs[name] = model.to(args.device).eval().generate(ids.to(args.device), **kw)
        print(f"{name:>10}: {outs[name][:, ids.shape[1]:].tolist()}")
    same = torch.equal(*outs.values())
    print("token for token equal" if same else "the continuations differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
