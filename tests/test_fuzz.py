"""tools/fuzz.py at CI size: random configurations of every public function on the CPU
path against the float64 reference, forward and backward (the full runs: 10,000 here, 2,000
in bf16 on an H200, recorded in benchmarks/RESULTS.md); tools/fuzz_ring.py likewise for the
ring on gloo."""

import pytest

from tools import fuzz


@pytest.mark.parametrize("seed", [0, 100_000], ids=["seeds_0", "seeds_100k"])
def test_fuzz_cpu_path(seed):
    counts, failures = fuzz.fuzz(300, seed=seed, verbose=False)
    assert set(counts) == {"attention", "varlen", "varlen_paged", "kvcache", "sparse", "merge"}
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])


def test_fuzz_ring_on_gloo():
    """tools/fuzz_ring.py at CI size: ring attention on 3 gloo ranks, random shardings (empty
    ranks and sequences, both layouts, lengths given or gathered), masks, GQA, sinks, softcap,
    float64 / float32, a loss on out alone or on out and lse, bad data; and merge_across_ranks
    of partial states; against the float64 reference of the whole sequence."""
    from tools import fuzz_ring

    ran, failures = fuzz_ring.fuzz(150, seed=0, world=3, verbose=False)
    assert ran == 150
    assert not failures, "\n".join(f"rank {r} {cfg}: {errs}" for r, cfg, errs in failures[:10])
