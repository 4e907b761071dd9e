"""tools/fuzz.py on the kernels (the interpreter in CI, float32; a GPU in float16)."""

import torch

from tools import fuzz


def test_fuzz_kernels(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    counts, failures = fuzz.fuzz(60, seed=7_000, device=device, dtype=dtype, verbose=False)
    assert sum(counts.values()) == 60
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])
