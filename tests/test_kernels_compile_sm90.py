"""Every Triton kernel compiles for sm_90 (H100/H200) with no GPU here, through the ptxas
that Triton's wheel carries. This catches what the interpreter accepts and the GPU
compiler rejects, before any device time is spent. (Register spills are a speed matter,
reported by tools/compile_sm90.py, and asserted here only where a kernel's structure exists to
avoid them: the MLA decode's step loops.)"""

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


def _step_loop_loads(name, **consts):
    """The local loads of each MLA step loop (a loop of one step's 44 wgmma: scores over nine
    pieces and the two P V products) of compile case ``name``."""
    by_name = {c[1]: c for c in CASES}
    _, _, fn, types, base, warps, stages = by_name[name]
    kernel = compile_sm90.compile_kernel(fn, types, dict(base, **consts), warps, stages)
    return [ldl for _, n, ldl, wgmma in compile_sm90.loop_spills(kernel)
            if 40 <= wgmma <= 48 and n <= 1800]


@pytest.mark.parametrize("name", ["contiguous sink", "paged 64 splits", "top-k paged 64"])
def test_mla_decode_step_loops_reload_nothing(name):
    """The MLA decode rebuilds its key buffers' wgmma descriptors in the loop
    (``REBUILD_DESCRIPTORS``): hoisted out of it, warpgroup 0 spilled them and reloaded them
    before every product, 34 local loads a step at paged 64 and 2.0-6.4% of its speed
    (benchmarks/NOTES.md, session 27). The hoisted form is checked to fail this."""
    loads = _step_loop_loads(f"decode MLA sm90 (Gluon) {name}")
    assert loads and max(loads) <= 4, loads
    if name == "paged 64 splits":
        hoisted = _step_loop_loads(f"decode MLA sm90 (Gluon) {name}", REBUILD=False)
        assert max(hoisted) > 20, hoisted


def test_fused_backward_lagged_dq_reduces_read_the_carried_row():
    """The D = 128 fused backward takes each tile's dQ products one tile late (``DQ_LAG``):
    every dQ reduce must add at the row block carried through the consumer loop (the tile
    before's). Session 37's first form bound that variable to ``m_lo`` before the loop, and
    Triton's frontend then did not carry it: every lagged reduce went to row block
    ``m_lo`` (22 GPU tests failed, benchmarks/NOTES.md)."""
    import re

    by_name = {c[1]: c for c in CASES}
    _, _, fn, types, consts, warps, stages = by_name[
        "bwd dK/dV+dQ fused sm90 (Gluon) D=128 causal host desc"]
    assert consts["DQ_LAG"] and consts["DQ_SWIZZLE"]
    ir = compile_sm90.compile_kernel(fn, types, consts, warps, stages).asm["ttgir"]
    loops = re.findall(r"scf\.for %it = .*?iter_args\((.*?)\)", ir)
    consumer = [args for args in loops if "%lag_m0 =" in args]
    assert len(consumer) == 2  # one consumer partition a warpgroup
    rows = re.findall(r"ttng\.async_tma_reduce add, %\w+\[%\w+, (%[\w#]+), %[\w#]+\]", ir)
    # Two boxes a tile, in the loop and after it, in each partition.
    assert len(rows) == 8
    # In the loop the carried %lag_m0; after it the loop's result (the last tile's).
    assert all(r == "%lag_m0" or "#" in r for r in rows), rows


@pytest.mark.parametrize("name", ["fwd sm90 (Gluon) D=128 causal",
                                  "fwd sm90 persistent (Gluon) D=128 causal table",
                                  "fwd sm90 persistent varlen (Gluon) D=128 window"])
def test_fwd_sm90_lean_loops_spill_nothing(name):
    """Up to ``fwd_sm90.ROW_BOUNDS_MAX_D`` / ``EARLY_P_MAX_D`` the consumer loops take the
    register-lean form (masks as row bounds, P carried in q's dtype): no stack frame and no
    local load in any tile loop.
    The earlier form spilled 8-88 bytes here and reloaded them in the grid kernel's loops
    (benchmarks/NOTES.md, session 43)."""
    by_name = {c[1]: c for c in CASES}
    _, _, fn, types, consts, warps, stages = by_name[name]
    kernel = compile_sm90.compile_kernel(fn, types, consts, warps, stages)
    assert " stack=   0 " in compile_sm90.report(name, kernel)
    assert all(ldl == 0 for _, _, ldl, _ in compile_sm90.loop_spills(kernel))
