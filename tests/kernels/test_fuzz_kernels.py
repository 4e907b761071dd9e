"""benchmarks/fuzz.py on the kernels (the interpreter in CI, float32; a GPU in float16)."""

import importlib.util
import pathlib

import torch

_path = pathlib.Path(__file__).parents[2] / "benchmarks" / "fuzz.py"
_spec = importlib.util.spec_from_file_location("flashlse_fuzz", _path)
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


def test_fuzz_kernels(device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    counts, failures = fuzz.fuzz(60, seed=7_000, device=device, dtype=dtype, verbose=False)
    assert sum(counts.values()) == 60
    assert not failures, "\n".join(f"{cfg}: {errs}" for cfg, errs in failures[:10])
