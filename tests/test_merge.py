"""flashlse.merge / merge_states against the float64 reference: out, lse and gradients."""

import pytest
import torch
from _flashlse_testing import LOWP, assert_close_to_ref, check_against_reference, rand

import flashlse as fl
from flashlse import reference as R

NEG_INF = float("-inf")


def states(n, shape, d, dtype=torch.float32, p_empty=0.3, lse_scale=3.0):
    """N random states; about ``p_empty`` of the lse entries -inf (their outs stay random)."""
    outs = rand(n, *shape, d, dtype=dtype)
    lses = rand(n, *shape, scale=lse_scale)
    lses[torch.rand(lses.shape) < p_empty] = NEG_INF
    return outs, lses


# (N, state shape, D, p_empty, sink shape or None)
CASES = [
    pytest.param(2, (3, 5), 16, 0.0, None, id="two_dense"),
    pytest.param(4, (2, 3, 7), 8, 0.3, None, id="four_some_empty"),
    pytest.param(1, (4, 6), 8, 0.3, None, id="n1"),
    pytest.param(3, (5,), 32, 1.0, None, id="all_empty"),
    pytest.param(3, (2, 4, 5), 8, 0.4, (4, 1), id="sink_h1_for_b_h_sq"),
    pytest.param(3, (5, 4), 8, 0.4, (4,), id="sink_h_for_s_h"),
    pytest.param(2, (6,), 8, 1.0, (6,), id="sink_all_empty"),
    pytest.param(5, (1, 63), 111, 0.2, None, id="odd_sizes"),
    pytest.param(2, (3, 4), 16, 0.0, None, dict(lse_scale=60.0), id="large_lse"),
]


def _case(n, shape, d, p_empty, sink_shape, dtype, extra=None):
    outs, lses = states(n, shape, d, dtype, p_empty, **(extra or {}))
    diff = {"outs": outs, "lses": lses}
    if sink_shape is not None:
        diff["sink"] = rand(*sink_shape, scale=2.0)
    return diff


def _merge_states_case_args(c):
    vals = list(c.values)
    return vals + [None] * (6 - len(vals))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("n,shape,d,p_empty,sink_shape,extra",
                         [pytest.param(*_merge_states_case_args(c), id=c.id) for c in CASES])
def test_merge_states(n, shape, d, p_empty, sink_shape, extra, dtype):
    diff = _case(n, shape, d, p_empty, sink_shape, dtype, extra)
    out, lse, grads = check_against_reference(fl.merge_states, R.merge_states, diff)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    empty = torch.isneginf(diff["lses"]).all(0)
    assert bool((out[empty] == 0).all())
    if "sink" not in diff:
        assert bool(torch.isneginf(lse[empty]).all())
        assert bool((grads["lses"][:, empty] == 0).all())
    for g in grads.values():
        assert not bool(torch.isnan(g).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("p_empty", [0.0, 0.5, 1.0], ids=["dense", "half_empty", "all_empty"])
def test_merge(p_empty, dtype):
    outs, lses = states(2, (3, 4, 5), 16, dtype, p_empty)
    diff = {"out_a": outs[0], "lse_a": lses[0], "out_b": outs[1], "lse_b": lses[1]}
    check_against_reference(fl.merge, R.merge, diff)


def test_merge_two_empty_states_is_identity_not_nan():
    out_a, out_b = rand(3, 8).requires_grad_(), rand(3, 8).requires_grad_()
    lse_a = torch.full((3,), NEG_INF, requires_grad=True)
    lse_b = torch.full((3,), NEG_INF, requires_grad=True)
    out, lse = fl.merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, torch.zeros(3, 8))
    assert bool(torch.isneginf(lse).all())
    grads = torch.autograd.grad([out], [out_a, lse_a, out_b, lse_b], [rand(3, 8)])
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_merge_identity_exact():
    out, lse = rand(4, 5, 16), rand(4, 5)
    zero, none = torch.zeros_like(out), torch.full_like(lse, NEG_INF)
    for o, l in (fl.merge(out, lse, zero, none), fl.merge(zero, none, out, lse)):
        assert torch.equal(l, lse)
        assert torch.equal(o, out)


def test_merge_zero_weight_state_with_nan_out_stays_clean():
    # A state with lse = -inf is never read: its out may be unwritten (NaN), as in split-KV.
    outs, lses = states(3, (4, 5), 8, p_empty=0.0)
    outs[1] = float("nan")
    lses[1] = NEG_INF
    sink = rand(4, 1)
    for s in (None, sink):
        out, lse = fl.merge_states(outs, lses, sink=s)
        keep = torch.tensor([0, 2])
        ref_out, ref_lse = R.merge_states(outs[keep], lses[keep], sink=s)
        assert_close_to_ref(out, ref_out)
        assert_close_to_ref(lse, ref_lse, name="lse")
    out, lse = fl.merge(outs[0], lses[0], outs[1], lses[1])
    assert torch.equal(lse, lses[0])
    assert_close_to_ref(out, outs[0].double())


def test_merge_zero_weight_state_with_nan_out_clean_gradients():
    outs, lses = states(2, (4,), 8, p_empty=0.0)
    outs[1] = float("nan")
    lses[1] = NEG_INF
    outs.requires_grad_()
    lses.requires_grad_()
    out, lse = fl.merge_states(outs, lses)
    d_outs, d_lses = torch.autograd.grad([out, lse], [outs, lses], [rand(4, 8), rand(4)])
    assert not bool(torch.isnan(d_lses).any())
    assert not bool(torch.isnan(d_outs[0]).any())


def test_merge_states_sink_added_once():
    # Merging with the sink equals merging with one extra state (0, sink).
    outs, lses = states(3, (2, 4, 5), 8)
    sink = rand(4, 1, scale=2.0)
    out, lse = fl.merge_states(outs, lses, sink=sink)
    s = sink.expand(2, 4, 5)
    out2, lse2 = fl.merge_states(torch.cat([outs, torch.zeros(1, 2, 4, 5, 8)]),
                                 torch.cat([lses, s[None]]))
    assert_close_to_ref(out, out2.double())
    assert_close_to_ref(lse, lse2.double(), name="lse")


def test_merge_states_flash_layout_states_from_attention():
    # Partial attention states (out (B, Sq, H, D), lse (B, H, Sq)) merge after the transpose.
    q, k, v = rand(1, 5, 2, 16), rand(1, 12, 2, 16), rand(1, 12, 2, 16)
    parts = [(0, 4), (4, 4), (4, 12)]
    outs, lses = [], []
    for k0, k1 in parts:
        o, l = fl.attention(q, k[:, k0:k1], v[:, k0:k1], return_lse=True)
        outs.append(o)
        lses.append(l.transpose(1, 2))
    out, lse = fl.merge_states(torch.stack(outs), torch.stack(lses))
    ref_out, ref_lse = R.attention(q, k, v, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse.transpose(1, 2), ref_lse, name="lse")


def test_merge_states_strided_views():
    # States as views: lse transposed from attention's (B, H, Sq), outs a slice of a wider D.
    outs_full = rand(3, 2, 5, 4, 12).requires_grad_()
    lses_t = rand(3, 2, 4, 5).requires_grad_()
    outs, lses = outs_full[..., 2:10], lses_t.transpose(-1, -2)
    sink = rand(4)
    out, lse = fl.merge_states(outs, lses, sink=sink)
    leaves = [x.detach().contiguous().double().requires_grad_() for x in (outs, lses)]
    ref_out, ref_lse = R.merge_states(*leaves, sink=sink)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    dout, dlse = rand(*out.shape), rand(*lse.shape)
    g_o, g_l = torch.autograd.grad([out, lse], [outs_full, lses_t], [dout, dlse])
    r_o, r_l = torch.autograd.grad([ref_out, ref_lse], leaves, [dout.double(), dlse.double()])
    assert_close_to_ref(g_o[..., 2:10], r_o, name="douts")
    assert_close_to_ref(g_l.transpose(-1, -2), r_l, name="dlses")


@pytest.mark.parametrize("sq,hq", [(4, 4), (5, 2)], ids=["sq_eq_hq", "sq_ne_hq"])
def test_merge_of_attention_halves_in_flash_layout(sq, hq):
    """attention's own (out (B, Sq, H, D), lse (B, H, Sq)) merge as they come, with
    layout='flash'; when Sq == H the shapes fit both layouts and layout=None refuses."""
    q, k, v = rand(1, sq, hq, 16), rand(1, 10, hq, 16), rand(1, 10, hq, 16)
    a = fl.attention(q, k[:, :4], v[:, :4], return_lse=True)
    b = fl.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
    out, lse = fl.merge(*a, *b, layout="flash")
    ref_out, ref_lse = R.attention(q, k, v, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    if sq == hq:
        with pytest.raises(ValueError, match="fit both layouts"):
            fl.merge(*a, *b)
    else:
        torch.testing.assert_close(fl.merge(*a, *b), (out, lse))


def test_merge_nan_state_propagates_to_its_row_only():
    """A NaN (or +inf) lse is data, not an empty state: its row comes out NaN, the other rows
    are exact (with the value checks off: on the CPU the +inf would raise first; a NaN lse is
    canonical, bad data upstream, and propagates with the checks on as well)."""
    outs, lses = states(2, (3, 4), 8, p_empty=0.0)
    lses[0, 1, 2] = float("nan")
    lses[1, 2, 0] = float("inf")
    with fl.value_checks(False):
        out, lse = fl.merge_states(outs, lses)
    bad = torch.zeros(3, 4, dtype=torch.bool)
    bad[1, 2] = bad[2, 0] = True
    assert torch.isnan(lse[bad]).all() and torch.isnan(out[bad]).all()
    ref_out, ref_lse = R.merge_states(outs.double(), lses.double().masked_fill(bad, 0.0))
    torch.testing.assert_close(out[~bad].double(), ref_out[~bad], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[~bad].double(), ref_lse[~bad], atol=1e-5, rtol=1e-5)
    lses[1, 2, 0] = 0.5
    out_c, lse_c = fl.merge_states(outs, lses)  # (checks on: NaN is not refused)
    assert torch.isnan(lse_c[1, 2]) and torch.isnan(out_c[1, 2]).all()
    assert torch.isnan(lse_c).sum() == 1


def test_merge_states_flash_layout_with_sink():
    """attention's (out, lse) per key part, merged in the flash layout with the sink (H, 1)
    added once, equals attention with the sink over all keys."""
    q, k, v = rand(2, 5, 4, 16), rand(2, 12, 2, 16), rand(2, 12, 2, 8)
    sink = rand(4, scale=2.0)
    parts = [fl.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 7), (7, 12))]
    out, lse = fl.merge_states(torch.stack([p[0] for p in parts]),
                               torch.stack([p[1] for p in parts]), sink=sink.view(4, 1),
                               layout="flash")
    ref_out, ref_lse = R.attention(q, k, v, sink=sink, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
