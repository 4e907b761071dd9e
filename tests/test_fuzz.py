"""tools/fuzz.py at CI size: random configurations of every public function on the CPU
path against the float64 reference, forward and backward (the full runs: 10,000 here, 2,000
in bf16 on an H200, recorded in benchmarks/RESULTS.md); tools/fuzz_ring.py likewise for the
ring on gloo."""

import pytest
import torch

from tools import fuzz


@pytest.mark.parametrize("seed", [0, 100_000], ids=["seeds_0", "seeds_100k"])
def test_fuzz_cpu_path(seed):
    counts, failures = fuzz.fuzz(300, seed=seed, verbose=False)
    assert set(counts) == {"attention", "varlen", "varlen_paged", "kvcache", "sparse", "merge"}
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])


def test_fuzz_cpu_path_bf16():
    """bf16 inputs on the CPU path (computed in float32), the baseline in bf16."""
    counts, failures = fuzz.fuzz(150, seed=200_000, dtype=torch.bfloat16, verbose=False)
    assert sum(counts.values()) == 150
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])


def test_close_yardstick_ignores_a_non_finite_baseline():
    """The bf16 baseline may be NaN where the float64 reference is finite (torch's bf16
    matmul on AMX CPUs leaks a NaN row into its neighbour): the tolerance comes from its
    finite elements, and ours is still compared at every finite reference element."""
    ref = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")], [3.0, 4.0]], dtype=torch.float64)
    base = ref.clone()
    base[0] = float("nan")  # the leak: a row the reference has finite
    base[2, 0] += 0.01
    good = ref.clone()
    good[2, 1] += 0.01
    assert fuzz._close("out", good, ref, base, torch.bfloat16) is None
    bad = ref.clone()
    bad[0, 0] += 0.5  # wrong in the row where only the baseline was NaN
    assert "error" in fuzz._close("out", bad, ref, base, torch.bfloat16)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert "NaN pattern" in fuzz._close("out", nan, ref, base, torch.bfloat16)


def test_fuzz_ring_on_gloo():
    """tools/fuzz_ring.py at CI size: ring attention on 3 gloo ranks, random shardings (empty
    ranks and sequences, both layouts, lengths given or gathered), masks, GQA, sinks, softcap,
    float64 / float32, a loss on out alone or on out and lse, bad data; and merge_across_ranks
    of partial states; against the float64 reference of the whole sequence."""
    from tools import fuzz_ring

    ran, failures = fuzz_ring.fuzz(150, seed=0, world=3, verbose=False)
    assert ran == 150
    assert not failures, "\n".join(f"rank {r} {cfg}: {errs}" for r, cfg, errs in failures[:10])
