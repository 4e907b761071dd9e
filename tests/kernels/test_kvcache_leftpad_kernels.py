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
from test_fwd import _atol
from test_fwd import _check as check_house_rule

import flashlse as fl
from flashlse import reference as R

test_leftpad = pytest.importorskip("test_kvcache_leftpad")
CASES, make, run, f64 = test_leftpad.CASES, test_leftpad.make, test_leftpad.run, test_leftpad.f64


def _check(got, want, ref_t, ref_call, dtype, rows=None):
    """test_fwd's house rule on ``got = (out, lse)`` against the float64 reference ``want``,
    the yardstick the reference computed in ``dtype`` on the same inputs (``rows``: the
    batch rows to compare)."""
    low = ({n: x.to(dtype) if x.is_floating_point() else x for n, x in ref_t.items()},
           {n: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for n, x in ref_call.items()})
    with R.computed_in(dtype):
        base = run(R.attention_with_kvcache, *low)
    tensors = (*got, *want, *base)
    if rows is not None:
        tensors = tuple(x[rows.to(x.device)] for x in tensors)
    check_house_rule(*tensors, _atol(dtype))


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("b,sq,hq,hkv,d,smax,lens,leftpad,s_new,kw", CASES)
def test_leftpad_on_the_kernels(device, kernel_opts, b, sq, hq, hkv, d, smax, lens, leftpad,
                                s_new, kw, num_splits):
    kernel_opts(poison_outputs=True)
    dtype = _dtypes()[0]
    t, call = make(b, sq, hq, hkv, d, smax, lens, leftpad, s_new, kw, device, dtype)
    out, lse = run(fl.attention_with_kvcache, t, dict(call, num_splits=num_splits))
    ref_t, ref_call = f64(t, call)
    want, want_lse = run(R.attention_with_kvcache, ref_t, ref_call)
    _check((out, lse), (want, want_lse), ref_t, ref_call, dtype)


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
            _check((out, lse), (want, want_lse), ref_t, ref_call, dtype, rows=ok)


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
    _check((out, lse), (want, want_lse), ref_t, ref_call, dtype)
