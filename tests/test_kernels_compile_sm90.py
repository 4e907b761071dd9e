"""Every Triton kernel compiles for sm_90 (H100/H200) with no GPU here, through the ptxas
that Triton's wheel carries. This catches what the interpreter accepts and the GPU
compiler rejects, before any device time is spent. (Register spills are a speed matter,
reported by tools/compile_sm90.py, not asserted here.)"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces @triton.jit kernels", allow_module_level=True)
triton = pytest.importorskip("triton")

from tools import compile_sm90  # noqa: E402

CASES = list(compile_sm90.cases())


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_kernel_compiles_for_sm90(case):
    _, name, fn, types, consts, warps, stages = case
    kernel = compile_sm90.compile_kernel(fn, types, consts, warps, stages)
    assert kernel.asm["cubin"], name
    assert "regs=   ?" not in compile_sm90.report(name, kernel)


def test_paged_forward_pipelines_like_the_contiguous_one():
    """The paged forward's K/V copies run as many tiles ahead as the contiguous kernel's at the
    same tile (same cp.async wait depths and buffers in the sm_90 TTGIR). Its page ids are
    loaded a tile ahead: loaded in the tile's own iteration they made the pipeliner wait for
    every copy at each tile, with one buffer less (benchmarks/NOTES.md, session 8)."""
    by_name = {c[1]: c for c in CASES}
    _, _, dense, types, consts, _, _ = by_name["fwd D=128 causal"]
    for page in ("page 16", "page 256"):
        _, name, fn, ptypes, pconsts, warps, stages = by_name[f"fwd paged D=128 G=4 causal {page}"]
        ref = compile_sm90.compile_kernel(
            dense, types, dict(consts, BLOCK_M=pconsts["BLOCK_M"], BLOCK_N=pconsts["BLOCK_N"]),
            warps, stages)
        paged = compile_sm90.compile_kernel(fn, ptypes, pconsts, warps, stages)
        waits, bufs = compile_sm90.pipeline(paged)
        assert (waits, bufs) == compile_sm90.pipeline(ref), name
        assert max(waits) > 0, name


def test_paged_decode_pipelines_like_the_contiguous_one():
    """The decode kernel over a paged cache, over sparse's top-k lists and over top-k lists on
    a paged cache keeps as many K/V copies in flight as over a contiguous cache (same cp.async
    wait depths and buffers). A tile's pages are looked up a tile ahead: looked up in its own
    iteration they left one buffer and waits of 0 (benchmarks/NOTES.md, session 10)."""
    by_name = {c[1]: c for c in CASES}
    _, _, fn, types, consts, warps, stages = by_name["decode GQA paged=False"]
    ref = compile_sm90.pipeline(compile_sm90.compile_kernel(fn, types, consts, warps, stages))
    assert max(ref[0]) > 0
    for name in ("decode GQA paged=True", "decode sparse token table G=8",
                 "decode sparse token table G=8 paged 64"):
        _, _, fn, types, consts, warps, stages = by_name[name]
        kernel = compile_sm90.compile_kernel(fn, types, consts, warps, stages)
        assert compile_sm90.pipeline(kernel) == ref, name
