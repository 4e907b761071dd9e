"""attention, attention_varlen and sparse_attention have no second derivative (their
backwards run fused kernels, or torch's CPU flash backward): with ``create_graph=True`` the
first-order gradients are those of a plain backward, and a backward through them raises a
clear error, also where other terms of the loss have a second derivative (a gradient
penalty over a whole model would otherwise drop attention's terms without a word).
``merge`` / ``merge_states`` are differentiable twice (torch ops): checked against the
float64 reference. tests/kernels/test_second_derivative_kernels.py runs the same on the
kernels."""

import pytest
import torch

import flashlse as fl
from flashlse import reference as R

I32 = torch.int32


def _calls(device, dtype):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    q, k, v = mk(2, 6, 4, 16), mk(2, 6, 2, 16), mk(2, 6, 2, 16)
    cu = torch.tensor([0, 6, 12], dtype=I32, device=device)
    idx = torch.randint(-1, 6, (2, 6, 2, 3), generator=g).to(device, I32)
    return {
        "attention": (lambda q, k, v: fl.attention(q, k, v, causal=True), (q, k, v)),
        "attention softcap": (lambda q, k, v: fl.attention(q, k, v, softcap=5.0), (q, k, v)),
        # Causal with Sq = 6 > Sk = 4: rows 0 and 1 see no key (out 0, lse -inf).
        "attention empty rows": (lambda q, k, v: fl.attention(q, k[:, :4], v[:, :4],
                                                              causal=True), (q, k, v)),
        "attention_varlen": (lambda q, k, v: fl.attention_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6, causal=True),
            (q, k, v)),
        "sparse_attention": (lambda q, k, v: fl.sparse_attention(q, k, v, idx), (q, k, v)),
    }


NAMES = list(_calls("cpu", torch.float32))


def test_empty_rows_keep_the_contract_under_create_graph():
    """The empty rows' (0, -inf) against the reference, and gradients of a create_graph
    backward equal to a plain one's with no NaN (rows that see no key get zero gradients)."""
    import flashlse.reference as R

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in
               ((1, 6, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fl.attention(*leaves, causal=True, return_lse=True)
    ref_out, ref_lse = R.attention(q, k, v, causal=True, return_lse=True)
    assert (out[:, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grads = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    assert not any(torch.isnan(gr).any() for gr in grads)
    assert (grads[0][:, :2] == 0).all()


def check_no_second_derivative(name, device, dtype):
    fn, inputs = _calls(device, dtype)[name]
    leaves = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(fn(*leaves).float().square().sum(), leaves)
    got = torch.autograd.grad(fn(*leaves).float().square().sum(), leaves, create_graph=True)
    # (Bit for bit but on a GPU, whose default backward adds dq in a varying order.)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    for a, b in zip(got, want):
        assert a.requires_grad and not torch.isnan(a).any()
        torch.testing.assert_close(a, b, **exact)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        sum(g.float().square().sum() for g in got).backward()
    # Beside a term that has one (a gradient penalty over a larger model): still an error.
    scale = torch.ones((), device=device, dtype=dtype, requires_grad=True)
    loss = fn(*(t * scale for t in leaves)).float().square().sum() + scale.square()
    (g_scale,) = torch.autograd.grad(loss, scale, create_graph=True)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        g_scale.backward()


@pytest.mark.parametrize("name", NAMES)
def test_no_second_derivative_on_the_cpu_path(name):
    check_no_second_derivative(name, "cpu", torch.float32)


def test_merge_is_differentiable_twice():
    g = torch.Generator().manual_seed(1)
    states = [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 4), (3,)) * 2]
    states[3][1] = float("-inf")  # an empty state in one row

    def second(fn):
        xs = [t.clone().requires_grad_() for t in states]
        out, lse = fn(*xs)
        grads = torch.autograd.grad(out.square().sum() + lse.masked_fill(
            torch.isneginf(lse), 0).sin().sum(), xs, create_graph=True)
        return torch.autograd.grad(sum(gr.square().sum() for gr in grads), xs)

    ref = second(lambda oa, la, ob, lb: R.merge_states(torch.stack([oa, ob]),
                                                       torch.stack([la, lb])))
    for a, b in zip(second(fl.merge), ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
