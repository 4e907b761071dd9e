"""flashlse.lse: the canonical form and the conversions from and to foreign conventions."""

import math

import pytest
import torch
from _flashlse_testing import rand

from flashlse import lse as L

NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")


def canonical(n=64, p_empty=0.25, sink=None):
    """Random canonical LSEs (float32, some -inf); with a sink, ``logaddexp(x, sink)``."""
    x = rand(n, scale=4.0)
    x[torch.rand(n) < p_empty] = NEG_INF
    x[0] = NEG_INF
    if sink is not None:
        x = torch.logaddexp(x, sink)
    return x


def _kw(convention, x, sink):
    kw = {}
    if convention == "flashmla":
        kw["sink"] = sink
    return kw


@pytest.mark.parametrize("convention", L.CONVENTIONS)
def test_round_trip(convention):
    sink = rand(64, scale=2.0)
    x = canonical(sink=sink if convention == "flashmla" else None)
    kw = _kw(convention, x, sink)
    foreign = L.from_canonical(x, convention, **kw)
    assert foreign.dtype == torch.float32
    assert not bool(torch.isnan(foreign).any())
    extra = {"empty": torch.isneginf(x)} if convention == "sdpa_efficient" else {}
    back = L.to_canonical(foreign, convention, **kw, **extra)
    assert back.dtype == torch.float32
    assert torch.equal(torch.isneginf(back), torch.isneginf(x))
    fin = torch.isfinite(x)
    if convention in ("canonical", "fa2", "fa3", "sdpa_efficient"):
        assert torch.equal(back, x)
    else:
        # base 2 and the sink removal round within a few float32 ulps of |x| (or of the sink).
        mag = torch.maximum(x[fin].abs(), sink[fin].abs() if convention == "flashmla"
                            else torch.zeros(()))
        assert bool(((back[fin] - x[fin]).abs() <= 4 * torch.finfo(torch.float32).eps
                     * mag.clamp(min=1)).all())


@pytest.mark.parametrize("convention", L.CONVENTIONS)
def test_posinf_folds_nan_stays_but_for_sigmoid_merges(convention):
    """+inf is an empty row's marker (or padding) in the foreign conventions; NaN is one only
    where a sigmoid-form merge met two empty states. Anywhere else a NaN LSE is bad data,
    and folding it to -inf would make the row look empty: a merge would drop it unseen."""
    x = rand(10)
    x[[1, 4]] = NAN
    x[[2, 7, 8]] = POS_INF
    x[9] = NEG_INF
    kw = {"empty": torch.zeros(10, dtype=torch.bool)} if convention == "sdpa_efficient" else {}
    out, count = L.to_canonical(x, convention, return_count=True, **kw)
    nan_empty = convention == "sigmoid_merge"
    assert count == (5 if nan_empty else 3)
    empty = (2, 7, 8, 9) + ((1, 4) if nan_empty else ())
    assert torch.equal(torch.isneginf(out), torch.tensor([i in empty for i in range(10)]))
    assert torch.equal(torch.isnan(out), torch.tensor([not nan_empty and i in (1, 4)
                                                       for i in range(10)]))
    assert not bool(torch.isposinf(out).any())


def test_a_nan_lse_stays_nan_through_a_merge():
    """A flash-attn 2 state whose row saw a NaN key (out and lse NaN), converted and merged
    with a clean state: the merged row is NaN, not the clean state's row."""
    import flashlse as fl

    out_a, lse_a = torch.randn(3, 4), torch.tensor([0.5, NAN, POS_INF])
    out_a[1] = NAN
    out_b, lse_b = torch.randn(3, 4), torch.randn(3)
    out, lse = fl.merge(out_a, L.to_canonical(lse_a, "fa2"), out_b, lse_b)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1])
    assert not torch.isnan(out[[0, 2]]).any() and torch.equal(out[2], out_b[2])


def test_fa2_posinf_empty():
    x = torch.tensor([POS_INF, 0.5, -3.0, POS_INF])
    out = L.to_canonical(x, "fa2")
    assert torch.equal(out, torch.tensor([NEG_INF, 0.5, -3.0, NEG_INF]))
    assert torch.equal(L.from_canonical(out, "fa2"), x)


def test_fa3_either_infinity():
    x = torch.tensor([POS_INF, NEG_INF, 1.25])
    assert torch.equal(L.to_canonical(x, "fa3"), torch.tensor([NEG_INF, NEG_INF, 1.25]))


def test_flashmla_sink_excluded():
    sink = torch.tensor([0.5, -1.0, 2.0])
    x = torch.tensor([POS_INF, 1.0, -2.0])  # FlashMLA: +inf empty, sink not included
    out = L.to_canonical(x, "flashmla", sink=sink)
    # An empty row with a sink is exactly the sink.
    assert out[0] == sink[0]
    want = torch.logaddexp(x[1:].double(), sink[1:].double())
    assert torch.allclose(out[1:].double(), want, rtol=1e-6, atol=0)
    # A row holding only the sink goes back to FlashMLA's empty marker.
    assert L.from_canonical(sink, "flashmla", sink=sink).isposinf().all()


def test_flashinfer_base2_and_sentinels():
    x = torch.tensor([3.0, -5e4, -1e30, NEG_INF, -2.0, -4.9e4])
    out = L.to_canonical(x, "flashinfer", sentinel=-5e4)
    assert torch.equal(torch.isneginf(out), torch.tensor([False, True, True, True, False,
                                                          False]))
    fin = torch.isfinite(out)
    assert torch.allclose(out[fin].double(), x[fin].double() * math.log(2), rtol=1e-6)
    # Without a sentinel, current FlashInfer (-inf) needs no threshold.
    assert torch.isneginf(L.to_canonical(torch.tensor([NEG_INF]), "flashinfer")).all()


def test_flashinfer_sentinel_count_only_changed_entries():
    x = torch.tensor([3.0, -5e4, -1e30, NEG_INF])
    _, count = L.to_canonical(x, "flashinfer", sentinel=-5e4, return_count=True)
    assert count == 2


@pytest.mark.parametrize("convention", ["log2", "flashinfer"])
def test_base2_exact_ish(convention):
    x2 = rand(1000, scale=50.0)
    out = L.to_canonical(x2, convention)
    want = x2.double() * math.log(2)
    assert bool(((out.double() - want).abs() <= want.abs() * 2 ** -23).all())
    back = L.from_canonical(out, convention)
    assert bool(((back.double() - x2.double()).abs() <= x2.double().abs() * 2 ** -22).all())


def test_sdpa_efficient_needs_key_counts_or_mask():
    x = torch.tensor([0.0, 0.0, 1.5, POS_INF])
    with pytest.raises(ValueError, match="key_counts"):
        L.to_canonical(x, "sdpa_efficient")
    counts = torch.tensor([0, 3, 2, 0])
    out, count = L.to_canonical(x, "sdpa_efficient", key_counts=counts, return_count=True)
    # Row 1 has keys and Z = 1: a genuine lse of 0 stays 0.
    assert torch.equal(out, torch.tensor([NEG_INF, 0.0, 1.5, NEG_INF]))
    assert count == 2
    out2 = L.to_canonical(x, "sdpa_efficient", empty=counts == 0)
    assert torch.equal(out2, out)


def test_empty_mask_forces_neginf_for_any_convention():
    x = torch.tensor([-5e4, 1.0])
    out = L.to_canonical(x, "fa2", empty=torch.tensor([True, False]))
    assert torch.equal(out, torch.tensor([NEG_INF, 1.0]))


def test_float64_in_float32_out_and_any_shape():
    x = rand(2, 3, 4, dtype=torch.float64)
    out = L.to_canonical(x, "canonical")
    assert out.dtype == torch.float32 and out.shape == (2, 3, 4)
    assert torch.equal(out, x.float())


def test_is_empty_and_safe_pivot():
    x = torch.tensor([NEG_INF, 0.0, -2.5, NEG_INF])
    assert torch.equal(L.is_empty(x), torch.tensor([True, False, False, True]))
    assert torch.equal(L.safe_pivot(x), torch.tensor([0.0, 0.0, -2.5, 0.0]))


def test_conversion_errors():
    with pytest.raises(ValueError, match="unknown LSE convention"):
        L.to_canonical(torch.zeros(2), "fa4")
    with pytest.raises(ValueError, match="expected one of"):
        L.from_canonical(torch.zeros(2), "sdpa")
    with pytest.raises(TypeError, match="torch.Tensor"):
        L.to_canonical([0.0], "fa2")
    with pytest.raises(TypeError, match="floating-point"):
        L.from_canonical(torch.zeros(2, dtype=torch.int32), "fa2")


@pytest.mark.parametrize("kw", [dict(convention="flashmla", sink=torch.zeros(3)),
                                dict(convention="sdpa_efficient", key_counts=torch.ones(5, 2)),
                                dict(convention="fa2", empty=torch.zeros(2, 4, 7, dtype=bool))],
                         ids=["sink", "key_counts", "empty_grows"])
def test_to_canonical_misshaped_side_inputs_say_so(kw):
    with pytest.raises(ValueError, match="must broadcast to lse"):
        L.to_canonical(torch.zeros(4, 7), **kw)


def test_from_canonical_keeps_nan_under_every_convention():
    """A NaN canonical LSE (bad data reached the row) is NaN in every foreign convention,
    never the foreign empty marker (FlashMLA's sink removal compared it with the sink and
    wrote +inf)."""
    x = torch.tensor([NAN, 0.5, NEG_INF])
    sink = torch.tensor([0.0, 0.25, NAN])
    for convention in L.CONVENTIONS:
        kw = {"sink": sink} if convention == "flashmla" else {}
        out = L.from_canonical(x, convention, **kw)
        assert torch.isnan(out[0]), convention
        if convention == "flashmla":
            assert torch.isnan(out[2])  # (a NaN sink: NaN, not an empty row)
            assert torch.isfinite(out[1])
