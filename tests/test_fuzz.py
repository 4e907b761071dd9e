"""tools/fuzz.py at CI size: random configurations of every public function on the CPU
path against the float64 reference, forward and backward (the full runs: 10,000 here, 2,000
in bf16 on an H200, recorded in benchmarks/RESULTS.md)."""

import pytest

from tools import fuzz


@pytest.mark.parametrize("seed", [0, 100_000], ids=["seeds_0", "seeds_100k"])
def test_fuzz_cpu_path(seed):
    counts, failures = fuzz.fuzz(300, seed=seed, verbose=False)
    assert set(counts) == {"attention", "varlen", "varlen_paged", "kvcache", "sparse", "merge"}
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])
