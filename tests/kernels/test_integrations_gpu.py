"""The transformers backend in bf16 on a GPU (issue 19's H200 half): tiny random Llama and
gpt-oss (sliding and full layers, sinks) against "eager" in the same dtype -- logits of a
left-padded batch within bf16 rounding, greedy generation token for token, sink gradients."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_integrations_transformers import _batch, _gpt_oss, _llama, _pair  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_pair(make):
    eager, ours = _pair(make)
    return eager.cuda().to(torch.bfloat16), ours.cuda().to(torch.bfloat16)


@pytest.mark.parametrize("make", [_llama, _gpt_oss], ids=["llama", "gpt_oss"])
def test_bf16_logits_and_generation_match_eager(make):
    eager, ours = _cuda_pair(make)
    ids, mask = (t.cuda() for t in _batch())
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits.float()
        got = ours(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=5e-2, rtol=5e-2)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


def test_bf16_gpt_oss_sink_gradients_match_eager():
    eager, ours = _cuda_pair(_gpt_oss)
    ids, mask = (t.cuda() for t in _batch())
    grads = []
    for model in (eager, ours):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()
                      if n.endswith("sinks")})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=5e-2, rtol=5e-2)
