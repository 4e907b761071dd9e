"""Every Triton kernel compiles for sm_90 (H100/H200) with no GPU here, through the ptxas
that Triton's wheel carries. This catches what the interpreter accepts and the GPU
compiler rejects, before any device time is spent. (Register spills are a speed matter,
reported by benchmarks/compile_sm90.py, not asserted here.)"""

import importlib.util
import os
import pathlib

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces @triton.jit kernels", allow_module_level=True)
triton = pytest.importorskip("triton")

_path = pathlib.Path(__file__).parents[1] / "benchmarks" / "compile_sm90.py"
_spec = importlib.util.spec_from_file_location("compile_sm90", _path)
compile_sm90 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_sm90)

CASES = list(compile_sm90.cases())


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_kernel_compiles_for_sm90(case):
    _, name, fn, types, consts, warps, stages = case
    kernel = compile_sm90.compile_kernel(fn, types, consts, warps, stages)
    assert kernel.asm["cubin"], name
    assert "regs=   ?" not in compile_sm90.report(name, kernel)
