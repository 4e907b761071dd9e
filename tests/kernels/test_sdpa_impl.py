"""flashlse as SDPA's flash implementation (flashlse/integrations/sdpa.py).

Everywhere: "flashlse" is registered on import, activates and restores. On the kernels (the
interpreter in CI, a GPU): the dispatcher entry points called directly against the float64
reference, empty rows -inf. On a GPU (``gpu``): F.scaled_dot_product_attention routed to
flashlse equals the stock flash backend, forward and backward, and restore brings it back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashlse  # noqa: F401 - registers "flashlse"
from flashlse import reference as R
from flashlse.integrations import sdpa

HAS_CUDA = torch.cuda.is_available()
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16
attention_api = torch.nn.attention
needs_registry = pytest.mark.skipif(not hasattr(attention_api, "register_flash_attention_impl"),
                                    reason="this torch has no flash-implementation registry")


@needs_registry
def test_registered_on_import_activates_and_restores():
    assert "flashlse" in attention_api.list_flash_attention_impls()
    attention_api.activate_flash_attention_impl("flashlse")
    try:
        assert attention_api.current_flash_attention_impl() == "flashlse"
    finally:
        attention_api.restore_flash_attention_impl()
    assert attention_api.current_flash_attention_impl() is None


def _close(got, want, atol=2e-2):
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=atol)


@pytest.mark.parametrize("sq,sk,hq,hkv,causal", [(20, 20, 4, 2, True), (7, 5, 2, 2, True),
                                                  (9, 13, 2, 1, False)],
                         ids=["causal_gqa", "causal_sq_gt_sk", "full_mqa"])
def test_entry_points_against_reference(device, sq, sk, hq, hkv, causal):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=DTYPE)
    q, k, v = mk(2, hq, sq, 32), mk(2, hkv, sk, 32), mk(2, hkv, sk, 32)
    out, lse, *_ = sdpa.sdpa_flash_forward(q, k, v, 0.0, causal)
    ref_out, ref_lse = R.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal,
                                   return_lse=True)
    _close(out, ref_out.transpose(1, 2))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))  # empty rows: -inf
    fin = torch.isfinite(ref_lse)
    _close(lse[fin], ref_lse[fin])
    dout = mk(2, hq, sq, 32)
    dq, dk, dv = sdpa.sdpa_flash_backward(dout, q, k, v, out, lse, None, None, sq, sk, 0.0,
                                          causal, None, None)
    leaves = [t.transpose(1, 2).double().requires_grad_() for t in (q, k, v)]
    R.attention(*leaves, causal=causal).backward(dout.transpose(1, 2).double())
    for got, leaf in zip((dq, dk, dv), leaves):
        _close(got, leaf.grad.transpose(1, 2), atol=5e-2)


def test_varlen_entry_and_unsupported(device):
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=DTYPE)
    q, k, v = mk(9, 2, 32), mk(7, 2, 32), mk(7, 2, 32)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 0, 7], dtype=torch.int32, device=device)
    out, lse, *_ = sdpa.flash_attention_forward(q, k, v, cu_q, cu_k, 5, 7, 0.0, True, False)
    ref_out, ref_lse = R.attention_varlen(q, k, v, cu_q, cu_k, 5, 7, causal=True,
                                          return_lse=True)
    _close(out, ref_out)
    assert torch.isneginf(lse[:, :4]).all() and (out[:4] == 0).all()  # no keys: (0, -inf)
    with pytest.raises(RuntimeError, match="dropout_p must be 0"):
        sdpa.sdpa_flash_forward(q[None], k[None], v[None], 0.1)


@pytest.mark.gpu
@needs_registry
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_routed_to_flashlse_matches_stock_flash(causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v, dout = mk(2, 8, 256, 128), mk(2, 2, 256, 128), mk(2, 2, 256, 128), mk(2, 8, 256, 128)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
        out.backward(dout)
        return [out] + [t.grad for t in leaves]

    stock = run()
    attention_api.activate_flash_attention_impl("flashlse")
    try:
        ours = run()
        # A row with no key (causal, Sq > Sk, through the varlen entry): lse -inf, not +inf.
        lse = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2)[:, :8], k.transpose(1, 2)[:, :4], v.transpose(1, 2)[:, :4],
            None, None, 8, 4, 0.0, True, False)[1]
    finally:
        attention_api.restore_flash_attention_impl()
    for a, b in zip(ours, stock):
        _close(a, b, atol=3e-2)
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()
    assert torch.equal(run()[0], stock[0])  # restored: the stock kernel again
