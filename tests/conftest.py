"""Shared test helpers: comparison against the float64 reference, seeding, gradients.

Every comparison follows docs/design.md §5: ``-inf`` patterns equal exactly, no NaN and no
+inf anywhere, finite entries within tolerance. fp32 must be within 1e-5 of the
reference's scale (issue 2), float64 tighter; fp16/bf16 within twice the error of
the same math done by torch in that dtype (the reference run in that dtype) plus a
small atol.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch

import flashlse.reference as R

# Test modules import these helpers as ``from _flashlse_testing import ...``: the bare
# name ``conftest`` is ambiguous once tests/kernels/conftest.py is loaded as well.
sys.modules["_flashlse_testing"] = sys.modules[__name__]

REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
LOWP_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LOWP = (torch.float16, torch.bfloat16)


def pytest_collection_modifyitems(config, items):
    """``FLASHLSE_TEST_SHARD=i/n`` keeps every n-th test from the i-th: GPU runs split a suite
    over processes (compute-sanitizer, within one device call)."""
    shard = os.environ.get("FLASHLSE_TEST_SHARD")
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        items[:] = [item for j, item in enumerate(items) if j % n == i]


@pytest.fixture(autouse=True)
def _seed(request):
    # A fixed seed per test (and per parametrization), independent of test order.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rand(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random normals, never zeros."""
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def _max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return 0.0
    return float((ours.detach().double()[fin] - ref.detach().double()[fin]).abs().max())


def _scale(ref: torch.Tensor) -> float:
    fin = ref[torch.isfinite(ref)]
    return max(1.0, float(fin.detach().abs().max())) if fin.numel() else 1.0


def assert_compiled_grads_match(loss, leaves, compile_fn):
    """``compile_fn(loss)(*leaves)`` and its gradients equal eager's (``loss`` returns a
    scalar), with no NaN in the compiled gradients."""
    got = compile_fn(loss)(*leaves)
    got_grads = torch.autograd.grad(got, leaves)
    want = loss(*leaves)
    want_grads = torch.autograd.grad(want, leaves)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w)


def assert_close_to_ref(ours, ref, *, tol=None, baseline=None, atol=None, dtype=None,
                        name="out"):
    """``ours`` matches the float64 ``ref``: same shape, same -inf pattern, no NaN, no +inf,
    finite entries within ``tol`` (absolute) -- by default 1e-5 x the reference's scale for
    fp32, 1e-10 for float64, and for fp16/bf16 ``2 * err(baseline) + atol`` where
    ``baseline`` is the same computation done by torch in that dtype. ``dtype`` is the
    inputs' dtype when it differs from ``ours`` (lse is float32 for fp16 inputs).
    """
    dtype = dtype or ours.dtype
    assert ours is not None, f"{name}: missing"
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {ours.shape} != {ref.shape}"
    assert not bool(torch.isnan(ref).any()), f"{name}: the reference has NaN"
    assert not bool(torch.isnan(ours).any()), f"{name}: NaN at {torch.isnan(ours).nonzero()[:5]}"
    assert not bool(torch.isposinf(ours).any()), f"{name}: +inf present"
    ni_ours, ni_ref = torch.isneginf(ours), torch.isneginf(ref)
    assert torch.equal(ni_ours, ni_ref), (
        f"{name}: -inf pattern differs at {(ni_ours != ni_ref).nonzero()[:5].tolist()}")
    err = _max_err(ours, ref)
    if tol is None:
        if dtype in LOWP:
            assert baseline is not None, f"{name}: low precision needs a same-dtype baseline"
            if atol is None:
                atol = LOWP_ATOL[dtype] * _scale(ref)
            tol = 2 * _max_err(baseline, ref) + atol
        else:
            tol = REL_TOL.get(dtype, 1e-5) * _scale(ref)
    assert err <= tol, f"{name}: max error {err:.3e} > tol {tol:.3e} (ref scale {_scale(ref):.3g})"


reference_in = R.computed_in


def _leaves(tensors: dict, dtype=None) -> dict:
    return {n: t.detach().clone().to(dtype or t.dtype).requires_grad_(t.is_floating_point())
            for n, t in tensors.items()}


def _run(fn, diff: dict, const: dict, dout, dlse):
    out, lse = fn(**diff, **const)
    names = [n for n, t in diff.items() if t.requires_grad]
    # The gradient through lse is a random dlse on its finite entries (None: a loss on out
    # alone, the backward then gets no lse gradient).
    pairs = [(out, dout.to(out.dtype))]
    if dlse is not None:
        pairs.append((lse, torch.where(torch.isfinite(lse.detach()), dlse.to(lse.dtype),
                                       torch.zeros_like(lse))))
    pairs = [(o, g) for o, g in pairs if o.requires_grad]
    inputs = [diff[n] for n in names]
    grads = [None] * len(inputs)
    if pairs:
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                    allow_unused=True)
    # An input no output depends on (zero keys) has a zero gradient.
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    return out.detach(), lse.detach(), dict(zip(names, grads))


def check_against_reference(fn, ref_fn, diff: dict, const: dict | None = None, *, grad=True,
                            tol=None, lse_grad=True):
    """Runs ``fn`` and ``ref_fn`` (keywords ``**diff, **const``; both return ``(out, lse)``)
    and compares out, lse and the gradient of every tensor in ``diff`` (of a loss on out and
    lse, or on out alone without ``lse_grad``) against the float64 reference (``ref_fn`` on
    float64 copies). Low-precision inputs are also run through ``ref_fn`` in their own
    dtype, the baseline of docs/design.md §5.

    Returns ``(out, lse, grads)`` of ``fn`` for extra checks.
    """
    const = const or {}
    with torch.no_grad():
        out0, lse0 = fn(**diff, **const)
    dout = rand(*out0.shape).to(out0.device)
    dlse = rand(*lse0.shape).to(lse0.device) if lse_grad else None
    if not grad:
        ref_out, ref_lse = ref_fn(**_leaves(diff, torch.float64), **const)
        outs = {"out": (out0, ref_out.detach()), "lse": (lse0, ref_lse.detach())}
        grads = {}
    else:
        out, lse, grads = _run(fn, _leaves(diff), const, dout, dlse)
        ref_out, ref_lse, ref_grads = _run(ref_fn, _leaves(diff, torch.float64), const, dout,
                                           dlse)
        outs = {"out": (out, ref_out), "lse": (lse, ref_lse)}
        outs.update({"d" + n: (grads[n], ref_grads[n]) for n in grads})
    base = {}
    dtype = next(iter(diff.values())).dtype
    if dtype in LOWP:
        with reference_in(dtype):
            if grad:
                b_out, b_lse, b_grads = _run(ref_fn, _leaves(diff), const, dout, dlse)
                base = {"out": b_out, "lse": b_lse, **{"d" + n: g for n, g in b_grads.items()}}
            else:
                with torch.no_grad():
                    b_out, b_lse = ref_fn(**diff, **const)
                base = {"out": b_out, "lse": b_lse}
    for name, (ours, ref) in outs.items():
        assert ours is not None, f"{name}: no gradient"
        assert_close_to_ref(ours, ref, tol=tol, baseline=base.get(name),
                            dtype=dtype if dtype in LOWP else None, name=name)
    return out0, lse0, grads


def break_plan(monkeypatch, module, planner: str, signature: tuple) -> list:
    """Makes ``module.<planner>`` (a Hopper kernel's launch planner) return a plan whose
    launch raises, as a kernel this triton cannot compile does; returns the list each launch
    attempt appends to (the dispatcher must try it once, then remember the failure)."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no Gluon here")

    monkeypatch.setattr(module, planner, lambda *a, **k: module.Plan(broken, signature))
    return calls
