"""``attention_with_kvcache(cache_leftpad=)`` on the kernels: the split-KV decode kernel
(``HAS_LEFTPAD``: keys below each sequence's start masked, the tiles wholly below it not
read) and, for longer queries, the varlen kernel over the cache rows shifted on the device;
against the float64 reference (outputs pre-filled with NaN), every split form, the kept
launch with other start values each call, a NaN in the padding that reaches nothing, and
out-of-range starts without value checks (clamped: no read outside the cache)."""

from __future__ import annotations

import pytest
import torch
from test_decode import _dtypes

import flashlse as fl
from flashlse import reference as R

test_leftpad = pytest.importorskip("test_kvcache_leftpad")
CASES, make, run, f64 = test_leftpad.CASES, test_leftpad.make, test_leftpad.run, test_leftpad.f64


def _tol(dtype):
    return dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("b,sq,hq,hkv,d,smax,lens,leftpad,s_new,kw", CASES)
def test_leftpad_on_the_kernels(device, kernel_opts, b, sq, hq, hkv, d, smax, lens, leftpad,
                                s_new, kw, num_splits):
    kernel_opts(poison_outputs=True)
    dtype = _dtypes()[0]
    t, call = make(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw, device, dtype)
    out, lse = run(fl.attention_with_kvcache, t, dict(call, num_splits=num_splits))
    want, want_lse = run(R.attention_with_kvcache, *f64(t, call))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(want_lse).cpu())
    torch.testing.assert_close(out.double(), want, **_tol(dtype))
    torch.testing.assert_close(lse.double(), want_lse, **_tol(dtype))
    assert (out.transpose(1, 2)[torch.isneginf(want_lse)] == 0).all()


def test_leftpad_kept_launch_each_calls_starts(device):
    # A repeated decode takes its kept plan (the key holds the metadata, not the values):
    # each call's own starts, a NaN in a padded row read by none, and starts past the
    # lengths or below 0 (no value checks) clamped, never read outside the cache.
    dtype = _dtypes()[0]
    t, call = make(3, 1, 4, 2, 16, 70, [70, 40, 12], [0, 0, 0], 0, {"causal": True},
                   device, dtype)
    t["k_cache"][1, :5] = float("nan")
    with fl.value_checks(False):
        for starts in ([5, 5, 0], [64, 9, 11], [0, 3, 7], [5, 40, 12], [-3, 100, 2**30]):
            t["cache_leftpad"] = torch.tensor(starts, dtype=torch.int32, device=device)
            out, lse = run(fl.attention_with_kvcache, t, call)
            ref_t, ref_call = f64(t, call)
            # (The reference reads every row it is given: the NaN row only where it is used.)
            ends = ref_t["cache_seqlens"].long()
            ref_t["cache_leftpad"] = torch.minimum(ref_t["cache_leftpad"].long().clamp(min=0),
                                                   ends).int()
            want, want_lse = run(R.attention_with_kvcache, ref_t, ref_call)
            # The NaN rows reach sequence 1 exactly when its start is below them: then every
            # head of it (the rows are NaN in both kv heads), and nothing else.
            used_nan = starts[1] < 5
            assert bool(torch.isnan(out[1]).all()) == used_nan
            assert bool(torch.isnan(lse[1]).all()) == used_nan
            assert not torch.isnan(out[0]).any() and not torch.isnan(out[2]).any()
            assert used_nan or not torch.isnan(out[1]).any()
            ok = torch.ones(3, dtype=torch.bool)
            ok[1] = not used_nan
            torch.testing.assert_close(out[ok].double(), want[ok.to(want.device)],
                                       **_tol(dtype))
            torch.testing.assert_close(lse[ok].double(), want_lse[ok.to(want.device)],
                                       **_tol(dtype))


def test_leftpad_chunk_with_lengths_past_the_cache(device):
    # Longer queries (the varlen path) without value checks: a length past the cache is
    # clamped to it before the start is taken off, so a sequence never reads the next one's
    # cache row (its offset moved up by its start).
    dtype = _dtypes()[0]
    t, call = make(2, 20, 4, 2, 16, 48, [60, 25], [7, 3], 0, {"causal": True}, device, dtype)
    with fl.value_checks(False):
        out, lse = run(fl.attention_with_kvcache, t, call)
    ref_t, ref_call = f64(t, call)
    ref_t["cache_seqlens"] = ref_t["cache_seqlens"].clamp(max=48)
    want, want_lse = run(R.attention_with_kvcache, ref_t, ref_call)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), want, **_tol(dtype))
    torch.testing.assert_close(lse.double(), want_lse, **_tol(dtype))
