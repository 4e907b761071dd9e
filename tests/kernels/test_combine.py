"""``kernels.combine.merge_states_fwd`` against ``flashlse.reference.merge_states``.

Every case mixes finite and empty (``-inf``) states, writes NaN into the outputs of
zero-weight states (the kernel must never read them) and into the preallocated outputs
(so an unwritten element fails), and checks: the ``-inf`` pattern of lse equals the
reference's, no NaN and no +inf anywhere, all-empty rows give ``out == 0``, and
``err <= 2 * err(torch in the same dtype) + atol`` against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from flashlse import reference
from flashlse.kernels._common import contiguous_strides
from flashlse.kernels.combine import merge_states_fwd
from flashlse.kernels.configs import merge_config

HAS_CUDA = torch.cuda.is_available()
ATOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _dtypes():
    return [torch.bfloat16, torch.float16, torch.float32] if HAS_CUDA else [torch.float32,
                                                                           torch.float16]


def _states(n, lead, d, dtype, device, empty_frac=0.3):
    """Random states; some states empty (lse = -inf, out NaN), some rows empty in every state."""
    outs = torch.randn(n, *lead, d, device=device).to(dtype)
    lses = torch.randn(n, *lead, device=device) * 3
    lses[torch.rand(n, *lead, device=device) < empty_frac] = float("-inf")
    if len(lead) and lead[0] > 1:
        # Rows empty in every state: the merge must give (0, -inf) there.
        lses[:, 1] = float("-inf")
    return outs, lses


def _poison_zero_weight(outs, lses):
    """NaN into every out whose state has zero weight; returns the clean copy for the reference."""
    clean = outs.clone()
    outs[torch.isneginf(lses)] = float("nan")
    return clean


def _torch_merge(outs, lses, sink):
    """The merge in outs' dtype with plain torch ops: the error yardstick."""
    l = lses.movedim(0, -1)
    if sink is not None:
        l = torch.cat([l, torch.broadcast_to(sink, l.shape[:-1]).unsqueeze(-1)], -1)
    m = l.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(l - m)
    tot = w.sum(-1, keepdim=True)
    p = torch.where(tot > 0, w / tot.clamp_min(1e-38), torch.zeros_like(w))[..., : lses.shape[0]]
    out = (p.movedim(-1, 0).unsqueeze(-1).to(outs.dtype) * outs).sum(0)
    return out, (torch.log(tot) + m).squeeze(-1)


def _check(outs, lses, *, sink=None, out=None, lse_out=None, dtype=None):
    clean = _poison_zero_weight(outs, lses)
    ref_out, ref_lse = reference.merge_states(clean, lses, sink=sink)
    pt_out, pt_lse = _torch_merge(clean, lses, sink)
    if out is not None:
        pt_out = pt_out.to(out.dtype)
    got_out, got_lse = merge_states_fwd(outs, lses, sink=sink, out=out, lse_out=lse_out)
    if out is not None:
        assert got_out is out
    if lse_out is not None:
        assert got_lse is lse_out
    assert got_out.shape == ref_out.shape and got_lse.shape == ref_lse.shape
    assert got_lse.dtype == torch.float32
    assert not torch.isnan(got_out).any(), "NaN (or unwritten element) in out"
    assert not torch.isinf(got_out).any(), "inf in out"
    assert not torch.isnan(got_lse).any(), "NaN (or unwritten element) in lse"
    assert not torch.isposinf(got_lse).any(), "+inf in lse"
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(ref_lse)), "-inf pattern of lse"
    atol = ATOL[dtype or outs.dtype]
    err = (got_out.double() - ref_out).abs().max().item()
    pt_err = (pt_out.double() - ref_out).abs().max().item()
    assert err <= 2 * pt_err + atol, f"out: err {err:.3g} vs torch {pt_err:.3g}"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (got_lse.double() - ref_lse)[fin].abs().max().item()
        pt_err = (pt_lse.double() - ref_lse)[fin].abs().max().item()
        assert err <= 2 * pt_err + 1e-6, f"lse: err {err:.3g} vs torch {pt_err:.3g}"
    assert (got_out[torch.isneginf(ref_lse)] == 0).all(), "empty rows must have out == 0"
    return got_out, got_lse


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("dtype_i", [0, 1])
def test_merge_matches_reference(device, n, dtype_i):
    outs, lses = _states(n, (3, 5, 4), 64, _dtypes()[dtype_i], device)
    _check(outs, lses)


def test_merge_all_empty(device):
    outs, lses = _states(3, (4, 6), 32, _dtypes()[0], device, empty_frac=1.0)
    out, lse = _check(outs, lses)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_merge_two_empty_states_with_sink(device):
    outs, lses = _states(2, (3, 4), 16, _dtypes()[0], device, empty_frac=1.0)
    # (Logits up to ~30: where sink * log2(e) rounds, a fused base-2 pivot missed the sink.)
    sink = torch.randn(4, device=device) * 10
    _, lse = _check(outs, lses, sink=sink)
    # No key at all: lse is exactly the sink.
    assert torch.equal(lse, sink.expand(3, 4))


def test_merge_one_state_among_empty_keeps_it_bit_for_bit(device):
    """A row whose states are all empty but one gets that state's (out, lse) exactly: its
    weight is exactly 1 (the key-split merge relies on it: a split that holds all of a row's
    keys, the rest empty, must give the unsplit kernel's result)."""
    n, lead, d = 4, (6, 5), 32
    outs = torch.randn(n, *lead, d, device=device)
    lses = torch.randn(n, *lead, device=device) * 10
    keep = torch.randint(0, n, lead, device=device)
    lses[torch.arange(n, device=device)[:, None, None] != keep] = float("-inf")
    out, lse = _check(outs, lses)
    assert torch.equal(lse, lses.gather(0, keep[None])[0])
    assert torch.equal(out, outs.gather(0, keep[None, ..., None].expand(1, *lead, d))[0])


@pytest.mark.parametrize("sink_shape", [pytest.param((4,), id="per_head_last"),
                                        pytest.param((3, 1), id="per_head_middle"),
                                        pytest.param((), id="scalar")])
def test_merge_sink(device, sink_shape):
    # lse (N, B, H, Sq) = (5, 2, 3, 4): a (3, 1) sink is per head, a (4,) sink per last dim.
    outs, lses = _states(5, (2, 3, 4), 32, _dtypes()[0], device)
    sink = torch.randn(sink_shape, device=device)
    _check(outs, lses, sink=sink)


def test_merge_d512(device):
    outs, lses = _states(3, (5, 2), 512, _dtypes()[0], device)
    _check(outs, lses)


def test_merge_many_states_few_rows(device):
    # The split-KV combine's shape: 57 float32 partials of a few rows, many states a step.
    outs, lses = _states(57, (3, 2), 96, torch.float32, device)
    out = torch.full((3, 2, 96), float("nan"), device=device, dtype=_dtypes()[0])
    _check(outs, lses, sink=torch.randn(2, device=device), out=out, dtype=_dtypes()[0])


@pytest.mark.parametrize(
    "n, r, d, alias, want_block_d",
    [pytest.param(4, 65536, 512, False, 512, id="d512_whole_rows"),
     pytest.param(8, 131072, 128, False, 128, id="d128_whole_rows"),
     pytest.param(57, 32, 128, False, 32, id="few_rows_split_d"),
     pytest.param(2, 32, 512, True, 512, id="in_place_never_splits_d")])
def test_merge_config_tiles(n, r, d, alias, want_block_d):
    cfg = merge_config(n, r, d, alias, 132)
    # block_m rows, block_n states per step, block_d columns a program.
    block_s, block_r, block_d = cfg.block_n, cfg.block_m, cfg.block_d
    assert block_d == want_block_d
    # Every state of a step is in flight at once: a few rows of many states take 2 steps.
    assert block_s <= max(8, n) and block_r * block_d <= 8192
    if n == 57:
        assert block_s == 32


def test_merge_transposed_lse_view(device):
    # lse stored (N, B, H, Sq) and passed as the (N, B, Sq, H) view, outs (N, B, Sq, H, D).
    n, b, h, sq, d = 4, 2, 3, 5, 32
    outs, _ = _states(n, (b, sq, h), d, _dtypes()[0], device)
    lse_bhs = torch.randn(n, b, h, sq, device=device) * 2
    lse_bhs[torch.rand(n, b, h, sq, device=device) < 0.3] = float("-inf")
    lses = lse_bhs.transpose(2, 3)
    assert not lses.is_contiguous()
    lse_out = torch.full((b, h, sq), float("nan"), device=device).transpose(1, 2)
    _check(outs, lses, lse_out=lse_out)


def test_merge_strided_fallback(device):
    # Four leading dims that no stride pattern fuses: the launcher copies, the result stands.
    outs, lses = _states(2, (2, 3, 2, 3), 16, _dtypes()[0], device)
    outs_p = outs.permute(0, 3, 1, 4, 2, 5).contiguous().permute(0, 2, 4, 1, 3, 5)
    lses_p = lses.permute(0, 2, 4, 1, 3).contiguous().permute(0, 3, 1, 4, 2)
    _check(outs_p, lses_p)


def test_merge_in_place_two_states(device):
    dtype = _dtypes()[0]
    outs, lses = _states(2, (6, 7), 128, dtype, device)
    clean = _poison_zero_weight(outs, lses)
    ref_out, ref_lse = reference.merge_states(clean, lses)
    out, lse = merge_states_fwd(outs, lses, out=outs[0], lse_out=lses[0])
    assert out.data_ptr() == outs.data_ptr() and lse.data_ptr() == lses.data_ptr()
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL[dtype] * 10, rtol=0)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=0)


def test_merge_preallocated_lowp_out(device):
    # float32 partial states written into a half-precision output (the split-KV combine).
    outs, lses = _states(4, (3, 8), 64, torch.float32, device)
    out = torch.full((3, 8, 64), float("nan"), device=device, dtype=torch.float16)
    _check(outs, lses, out=out, dtype=torch.float16)


@pytest.mark.parametrize("shape", [(), (3,), (1, 5), (2, 1, 4), (0, 3), (3, 0, 2), (1, 1, 1),
                                   (4, 3, 2, 8)])
def test_contiguous_strides(shape):
    # The launch plans take the strides of fresh outputs from their shapes.
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_merge_plan_repeated_calls(device):
    # Same outs / lses metadata (fresh values each call: _check poisons outs), the sink's
    # layout changed between calls (a plan key part): each call matches the reference.
    for sink_shape in [(4,), (3, 1), None, (4,)]:
        outs, lses = _states(5, (2, 3, 4), 32, _dtypes()[0], device)
        sink = None if sink_shape is None else torch.randn(sink_shape, device=device)
        _check(outs, lses, sink=sink)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 8, 64])
def test_merge_real_size(n):
    outs, lses = _states(n, (16, 8, 32), 128, torch.bfloat16, "cuda")
    sink = torch.randn(32, device="cuda")
    _check(outs, lses, sink=sink)


def _check_public(out, lse, want_out, want_lse, dtype, flash):
    """A public merge's result (the flash layout's lse ``(B, H, Sq)``) against the float64
    reference's rows-layout one."""
    if flash:
        assert lse.shape == want_lse.shape[:-2] + want_lse.shape[-2:][::-1]
        lse = lse.transpose(-1, -2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(out.double(), want_out, atol=ATOL[dtype], rtol=ATOL[dtype])
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=1e-5, rtol=1e-5)


def _check_nan_row(out, lse, flash):
    """Row (0, 0, 0) of a merge whose first state's lse is NaN there: NaN in that row's lse
    and whole out row, nowhere else."""
    lse = lse.transpose(-1, -2) if flash else lse
    nan_row = torch.zeros(lse.shape, dtype=torch.bool, device=lse.device)
    nan_row[0, 0, 0] = True
    assert torch.equal(torch.isnan(lse), nan_row)
    assert torch.equal(torch.isnan(out).all(-1), nan_row) and not torch.isnan(
        out[~nan_row]).any()


@pytest.mark.parametrize("layout", ["rows", "flash", None])
def test_merge_states_repeated_calls_launch_the_kept_plan(device, layout):
    """``fl.merge_states`` keeps the merge plan of a sink-free call that passed every check
    (ops/merge._KEPT); later calls of that metadata launch it at once (value checks off, as on
    a GPU by default): fresh values each call, zero-weight outs NaN, against the float64
    reference; the flash layout's lse comes back (B, H, Sq). Value checks (a +inf lse) and
    grad still take the full path."""
    import importlib

    import flashlse as fl

    merge_mod = importlib.import_module("flashlse.ops.merge")  # (flashlse.ops.merge: a function)
    merge_mod._KEPT.clear()
    n, b, sq, h, d = 3, 2, 3, 4, 32
    flash = layout == "flash"
    for _ in range(3):
        outs, lses = _states(n, (b, sq, h), d, _dtypes()[0], device)  # rows: (N, B, Sq, H)
        clean = _poison_zero_weight(outs, lses)
        want_out, want_lse = reference.merge_states(clean, lses)
        arg = lses.transpose(-1, -2) if flash else lses  # flash: (N, B, H, Sq), a view
        with fl.value_checks(False):
            out, lse = fl.merge_states(outs, arg, layout=layout)
        _check_public(out, lse, want_out, want_lse, outs.dtype, flash)
    assert len(merge_mod._KEPT) == 1
    # A NaN lse (value checks off) reaches exactly its row on the kept path too.
    lses_nan = lses.clone()
    lses_nan[0, 0, 0, 0] = float("nan")
    with fl.value_checks(False):
        out_n, lse_n = fl.merge_states(outs, lses_nan.transpose(-1, -2) if flash else lses_nan,
                                       layout=layout)
    _check_nan_row(out_n, lse_n, flash)
    bad = arg.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"holds 1 \+inf entries"), fl.value_checks():
        fl.merge_states(outs, bad, layout=layout)
    g = outs.float().clone().requires_grad_()
    with fl.value_checks(False):
        out_g, _ = fl.merge_states(g, arg, layout=layout)
    assert out_g.requires_grad


@pytest.mark.parametrize("layout", ["rows", "flash"])
def test_merge_of_two_states_reads_them_in_place_and_keeps_its_plan(device, layout,
                                                                    monkeypatch):
    """``fl.merge`` of two states launches the pair kernel on the states where they are
    (``combine.pair_plan``: no stacked copy) and keeps its plan (ops/merge._PAIR_KEPT)
    for later calls of that metadata (value checks off, as on a GPU by default): fresh
    values each call, empty rows in both states, a zero-weight state's out NaN, against the
    float64 reference; the flash layout's lse comes back (B, H, Sq). A NaN lse reaches
    exactly its row; value checks (a +inf lse) and grad take the full path; states of
    different strides are merged stacked."""
    import importlib

    import flashlse as fl

    merge_mod = importlib.import_module("flashlse.ops.merge")
    merge_mod._PAIR_KEPT.clear()
    b, sq, h, d = 2, 3, 4, 32
    flash = layout == "flash"
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacked.append(1) or real_stack(*a, **k))
    for _ in range(3):
        outs, lses = _states(2, (b, sq, h), d, _dtypes()[0], device)  # rows: (2, B, Sq, H)
        clean = _poison_zero_weight(outs, lses)
        want_out, want_lse = reference.merge_states(clean, lses)
        args = [lses[i].transpose(-1, -2) if flash else lses[i] for i in (0, 1)]
        with fl.value_checks(False):
            out, lse = fl.merge(outs[0], args[0], outs[1], args[1], layout=layout)
        _check_public(out, lse, want_out, want_lse, outs.dtype, flash)
    assert not stacked and len(merge_mod._PAIR_KEPT) == 1
    lse_nan = lses[0].clone()
    lse_nan[0, 0, 0] = float("nan")
    with fl.value_checks(False):
        out_n, lse_n = fl.merge(outs[0], lse_nan.transpose(-1, -2) if flash else lse_nan,
                                outs[1], args[1], layout=layout)
    _check_nan_row(out_n, lse_n, flash)
    bad = args[0].clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"holds 1 \+inf entries"), fl.value_checks():
        fl.merge(outs[0], bad, outs[1], args[1], layout=layout)
    g = outs[0].float().clone().requires_grad_()
    with fl.value_checks(False):
        out_g, _ = fl.merge(g, args[0], outs[1].float(), args[1], layout=layout)
    assert out_g.requires_grad
    # The kept key's own metadata, but a state that needs grad: the full path (autograd).
    with fl.value_checks(False):
        out_g, _ = fl.merge(outs[0].clone().requires_grad_(), args[0], outs[1], args[1],
                            layout=layout)
    assert out_g.requires_grad
    # State b in another memory order (its lse a contiguous copy of a transposed view, or
    # the other way round): the strides differ, the states are stacked, the result the same.
    other = args[1].contiguous() if flash else args[1].transpose(-1, -2).contiguous(
    ).transpose(-1, -2)
    assert other.stride() != args[1].stride()
    stacked.clear()
    with fl.value_checks(False):
        out_s, lse_s = fl.merge(outs[0], args[0], outs[1], other, layout=layout)
    assert stacked
    lse_s = lse_s.transpose(-1, -2) if flash else lse_s
    clean_last = outs.clone()
    clean_last[torch.isneginf(lses)] = 0
    ref_out, ref_lse = reference.merge_states(clean_last, lses)
    atol = ATOL[outs.dtype]
    torch.testing.assert_close(out_s.double(), ref_out, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse_s), torch.isneginf(ref_lse))
