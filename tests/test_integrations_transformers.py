"""flashlse as a transformers attention implementation: tiny random models of transformers' own
classes (Llama; gpt-oss with sliding and full layers and learnable sinks) against "eager" --
logits of a left-padded batch, greedy generation token for token, sink gradients."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
flt = pytest.importorskip("flashlse.integrations.transformers")


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return cfg, transformers.LlamaForCausalLM


def _gpt_oss():
    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"],
                                    max_position_embeddings=64)
    return cfg, transformers.GptOssForCausalLM


def _pair(make):
    """The same random weights under eager and under flashlse."""
    cfg, cls = make()
    torch.manual_seed(0)
    # Each model its own config: _from_config writes the implementation into the config it
    # is given, so one shared config would make the "eager" model run flashlse too.
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=flt.ATTN_IMPLEMENTATION).eval()
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == flt.ATTN_IMPLEMENTATION
    ours.load_state_dict(eager.state_dict())
    for name, p in eager.named_parameters():
        if name.endswith("sinks"):  # random sinks, so that they matter
            with torch.no_grad():
                p.copy_(torch.randn_like(p))
                dict(ours.named_parameters())[name].copy_(p)
    return eager, ours


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :6] = 0
    return ids, mask


@pytest.mark.parametrize("make", [_llama, _gpt_oss], ids=["llama", "gpt_oss"])
def test_left_padded_logits_match_eager(make):
    eager, ours = _pair(make)
    ids, mask = _batch()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)
    # Unpadded too (the mask function returns None: the dense kernel path).
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids[:1]).logits,
                                   eager(input_ids=ids[:1]).logits, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make", [_llama, _gpt_oss], ids=["llama", "gpt_oss"])
def test_greedy_generation_matches_eager_token_for_token(make):
    eager, ours = _pair(make)
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert torch.equal(got, want)


def test_gpt_oss_sink_gradients_match_eager():
    eager, ours = _pair(_gpt_oss)
    ids, mask = _batch()
    grads = []
    for model in (eager, ours):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if n.endswith("sinks")})
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[1][name].abs().sum() > 0
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


def test_dropout_is_refused():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="no attention dropout"):
        flt.attention_forward(module, q, q, q, None, dropout=0.1)


def test_name_holds_no_flash_and_is_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert "flash" not in flt.ATTN_IMPLEMENTATION
    assert AttentionInterface._global_mapping[flt.ATTN_IMPLEMENTATION] is flt.attention_forward
    assert AttentionMaskInterface._global_mapping[flt.ATTN_IMPLEMENTATION] is flt.attention_mask


def test_float32_inputs_return_to_the_models_half_dtype():
    """As transformers' flash-attn path: float32 q / k / v (PEFT's float32 norms) are cast to
    autocast's dtype, else to the module's Linear dtype; a float32 model stays float32."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    module.proj = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
    out, _ = flt.attention_forward(module, q, k.bfloat16(), k, None)
    assert out.dtype == torch.bfloat16
    want = flt.attention_forward(module, q.bfloat16(), k.bfloat16(), k.bfloat16(), None)[0]
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    module.proj = torch.nn.Linear(16, 16)  # a float32 model: no cast
    assert flt.attention_forward(module, q, k, k, None)[0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flt.attention_forward(module, q, k, k, None)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("make", [_llama, _gpt_oss], ids=["llama", "gpt_oss"])
@pytest.mark.parametrize("given", ["position_ids", "cu_seq_lens"])
def test_padding_free_batch_matches_each_sequence_alone(make, given):
    """A padding-free batch (DataCollatorWithFlattening: one row of sequences back to back,
    position_ids restarting at 0, or its cu_seq_lens kwargs): each sequence's logits equal
    eager's on that sequence alone (gpt-oss: a sliding layer's window inside each sequence),
    and so do the gradients of a loss on the packed logits."""
    eager, ours = _pair(make)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 97, (1, n), generator=g) for n in (5, 1, 7)]
    ids = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]
    kw = dict(position_ids=pos)
    if given == "cu_seq_lens":
        cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    want = torch.cat([eager(input_ids=s, use_cache=False).logits for s in seqs], 1)
    got = ours(input_ids=ids, use_cache=False, **kw).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    grads = []
    for model, logits in ((eager, want), (ours, got)):
        model.zero_grad()
        logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("make, masks", [(_llama, 1), (_gpt_oss, 2)], ids=["llama", "gpt_oss"])
def test_a_padded_forward_packs_its_mask_once(monkeypatch, make, masks):
    """The padding mask's rows and lengths (host reads: syncs on a GPU) are found once a
    forward for each mask (one a layer type), not once a layer: 4 layers here."""
    cfg, cls = make()
    cfg.num_hidden_layers = 4
    if make is _gpt_oss:
        cfg.layer_types = ["sliding_attention", "full_attention"] * 2
    model = cls._from_config(cfg, attn_implementation=flt.ATTN_IMPLEMENTATION).eval()
    packed = []
    real = flt._pack
    monkeypatch.setattr(flt, "_pack", lambda *a: packed.append(a[0]) or real(*a))
    ids, mask = _batch()
    for _ in range(2):  # (the second forward: a new mask, packed again)
        packed.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert len(packed) == masks and len({id(m) for m in packed}) == masks


def _bart():
    cfg = transformers.BartConfig(vocab_size=97, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2,
                                  forced_eos_token_id=None)
    return cfg, transformers.BartForConditionalGeneration


def test_encoder_decoder_padded_matches_eager():
    """BART: an encoder's bidirectional self-attention and the decoder's cross-attention on
    a padded encoder batch (the queries of a cross-attention are not the last rows of the
    encoder's mask; before, they were taken as such and the logits were off by ~4e-3), the
    decoder's causal self-attention; logits, every gradient and greedy generation."""
    eager, ours = _pair(_bart)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 97, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    ids[1, 6:] = 1
    dec = torch.randint(3, 97, (2, 5), generator=g)
    outs = []
    for model in (eager, ours):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-4)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, atol=1e-5, rtol=1e-4)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


def test_fuzz_transformers_at_ci_size():
    """tools/fuzz_transformers.py (decoders and BART, padding, static caches, generation)
    at a small count: every configuration agrees with eager."""
    from tools import fuzz_transformers

    assert fuzz_transformers.main(["--n", "12", "--seed", "44000"]) == 0


@pytest.mark.parametrize("make, compiled", [(_llama, False), (_gpt_oss, False), (_llama, True)],
                         ids=["llama", "gpt_oss", "llama_compiled"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_static_cache_generation_matches_eager(make, compiled, padded):
    """cache_implementation="static": the keys are the whole preallocated cache, of which
    only the first slots are written; the mask says which (transformers' padding mask, or
    one the mask function makes from the cache's offsets when nothing is padded) and the
    slots past it are never read (they were, before: other continuations). Compiled:
    generate's compiled decode steps (dynamo, eager backend); the integration keeps no
    memory while torch.compile traces (with it, the trace baked one step's packing into
    the graph and the continuation went wrong from the second compiled step)."""
    from tools.fuzz_transformers import _compile_config

    eager, ours = _pair(make)
    ids, mask = _batch()
    if not padded:
        mask = torch.ones_like(mask)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        if compiled:
            torch._dynamo.reset()
            kw["compile_config"] = _compile_config()
        assert torch.equal(ours.generate(ids, **kw), want)


def test_window_and_causal_read_from_the_module():
    """Without the keywords, ``sliding_window`` and ``is_causal`` come from the module (an
    instance attribute, or its class's), as the keyword would give them; a module with
    neither is causal with no window."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 4, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)

    class Windowed(torch.nn.Module):
        sliding_window = 3

    bare, inst, cls = torch.nn.Module(), torch.nn.Module(), Windowed()
    inst.sliding_window, inst.is_causal = 3, False
    want_window = flt.attention_forward(bare, q, k, k, None, sliding_window=3)[0]
    want_full = flt.attention_forward(bare, q, k, k, None, is_causal=True)[0]
    assert not torch.equal(want_window, want_full)
    torch.testing.assert_close(flt.attention_forward(cls, q, k, k, None)[0], want_window,
                               atol=0, rtol=0)
    torch.testing.assert_close(flt.attention_forward(bare, q, k, k, None)[0], want_full,
                               atol=0, rtol=0)
    # An instance's is_causal False with a window: refused, as the keyword is.
    with pytest.raises(ValueError, match="non-causal"):
        flt.attention_forward(inst, q, k, k, None)
