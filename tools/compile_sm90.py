"""Compile every flashlse kernel for sm_90 on a machine with no GPU, and report resources.

Triton's wheel carries ptxas and cuobjdump, so a kernel edit can be checked for compile
errors, register spills (``stack`` > 0), shared memory and whether the matrix products
became wgmma, at no device time:

    python -m tools.compile_sm90            # every kernel, a few flag sets each
    python -m tools.compile_sm90 fwd dq     # only those
    python -m tools.compile_sm90 --loops dkdv   # and the instruction mix of each loop
    python -m tools.compile_sm90 --pipeline fwd # and the cp.async pipeline (TTGIR)
    python -m tools.compile_sm90 --spills mla   # and the local loads inside each loop

``--loops`` reads the SASS: for every backward branch (a loop) of 50 or more instructions it
prints the instruction count and the most frequent opcodes, which is how the notes count
the softmax, address and load instructions a tile costs (benchmarks/NOTES.md).

``--pipeline`` reads the TTGIR: the depth of every ``cp.async`` wait (``async_wait {num = N}``:
the copy groups still in flight when a tile is used; 0 means the tile's load was not overlapped
with the compute before it) and the multi-buffered shared allocations of the pipelined loads
(``3x64x128`` is three K or V tiles in flight), which is how NOTES.md session 8 found the paged
forward's loads unpipelined.

Not a test of correctness or speed: the interpreter tests and the H200 runs are.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashlse.kernels import (  # noqa: E402
    bwd,
    bwd_sm90,
    combine,
    configs,
    decode,
    decode_mla_sm90,
    fwd,
    fwd_sm90,
    sparse,
)

TARGET = GPUTarget("cuda", 90, 32)
BF16, F32, I32 = "*bf16", "*fp32", "*i32"


def compile_kernel(fn, types: dict, consts: dict, num_warps: int, num_stages: int):
    """Arguments not in ``types`` or ``consts`` are i32 scalars; a tuple of types is a tuple
    argument (a strides tuple). Pointers and strides (each element of a strides tuple) get
    16-byte divisibility, as the launcher's real arguments do."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {}
    for i, n in enumerate(names):
        if n in consts:
            continue
        if isinstance(sig[n], tuple):
            if n.startswith("stride"):
                attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(sig[n]))})
        elif sig[n].startswith("*") or n.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    src = source(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps,
                                                           num_stages=num_stages))


def report(name: str, k) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    # STACK is the per-thread stack frame: register spills land there.
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = (m.group(1), m.group(2)) if m else ("?", "?")
    wgmma = k.asm["ttgir"].count("warp_group_dot")
    return (f"{name:44s} regs={regs:>4s} stack={stack:>4s} shared={k.metadata.shared:>7d} "
            f"wgmma={wgmma}")


def _loops(k, min_instructions: int) -> list[tuple[int, list[str]]]:
    """``(first address, opcodes)`` of every loop (a backward branch) of the kernel's SASS
    of at least ``min_instructions``, predicates dropped."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    # (address, opcode with modifiers) of every instruction, predicates dropped.
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
                     r"([^;]*);", sass)
    where = {int(a, 16): i for i, (a, _, _) in enumerate(ins)}
    loops = []
    for i, (a, op, rest) in enumerate(ins):
        m = re.match(r"\s*0x([0-9a-f]+)", rest) if op == "BRA" else None
        target = int(m.group(1), 16) if m else None
        if target is not None and target < int(a, 16) and target in where:
            body = [o for _, o, _ in ins[where[target]:i + 1]]
            if len(body) >= min_instructions:
                loops.append((target, body))
    return loops


def loop_mix(k, top: int = 14) -> list[str]:
    """One line per loop of the kernel's SASS: first address, instruction count, opcodes."""
    return [f"  loop at {target:#06x}: {len(body)} instructions: "
            + ", ".join(f"{o} {n}" for o, n in Counter(body).most_common(top))
            for target, body in _loops(k, 50)]


def loop_spills(k, min_instructions: int = 150) -> list[tuple[int, int, int, int]]:
    """``(first address, instructions, local loads, wgmma)`` of every loop of the kernel's SASS
    of at least ``min_instructions``: a spilled value reloaded inside a loop costs every
    iteration (benchmarks/NOTES.md, session 27: the MLA decode's wgmma descriptors)."""
    return [(target, len(body), sum(o.startswith("LDL") for o in body),
             sum(o.startswith("HGMMA") for o in body))
            for target, body in _loops(k, min_instructions)]


def pipeline(k) -> tuple[list[int], dict[str, int]]:
    """The cp.async pipeline of a kernel's TTGIR: the sorted depths of its waits and the
    shapes (``stages x rows x cols``) of its shared buffers, with their counts."""
    ttgir = k.asm["ttgir"]
    waits = sorted(int(n) for n in re.findall(r"ttg\.async_wait[^{\n]*\{num = (\d+)", ttgir))
    bufs = Counter(re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<([0-9x]+)x", ttgir))
    return waits, dict(sorted(bufs.items()))


def host_descs(spec: tuple, names: tuple) -> dict:
    """Signature types of a kernel's host descriptors (a ``bwd_sm90._HostDescs`` spec, the
    kernel's argument names in its order): bf16 rows, float32 stats and float32 dQ."""
    from triton.runtime.jit import mangle_type

    out = {}
    for n, sp in zip(names, spec):
        if sp is None:
            continue
        if sp[0] == "stats":
            t = torch.empty(2, 64, dtype=torch.float32)
            desc = bwd_sm90._desc(t, [2, 64], [64, 1], [1, sp[1]], sp[2])
        else:
            dt = torch.float32 if n == "dq_acc" else torch.bfloat16
            t = torch.empty(1, 64, 2, sp[2], dtype=dt)
            desc = bwd_sm90._desc(t, [1, 64, 2 * sp[2]], [1, 1, 1], [1, sp[1], sp[2]], sp[3])
        out[n] = mangle_type(desc)
    return out


def _dkdv_host_descs(d: int, dq_swizzle: bool = False) -> dict:
    """The dK/dV kernel's host descriptor types at head dim ``d`` (bf16, the shipped tile;
    the fused pass's float32 dQ boxes swizzled with ``dq_swizzle``)."""
    return host_descs(bwd_sm90._dkdv_host_spec(torch.bfloat16, d, configs.BWD_SM90_DKDV.block_m,
                                               dq_swizzle),
                      ("q", "k", "v", "dout", "lse_log2", "delta", "dk", "dv", None, None,
                       None, "dq_acc"))


def cases():
    flags = dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, IS_VARLEN=False,
                 HAS_SEQUSED_K=False)
    every = dict(flags, HAS_LEFT=True, HAS_SOFTCAP=True, IS_VARLEN=True, HAS_SEQUSED_K=True)
    fwd_types = dict(q=BF16, k=BF16, v=BF16, o=BF16, lse=F32, sink=F32, cu_seqlens_q=I32,
                     cu_seqlens_k=I32, seqused_k=I32, scale_log2="fp32", softcap_a2="fp32",
                     softcap_c2="fp32")
    for label, f, tma in (("causal", flags, False), ("every flag", every, False),
                          ("causal tma", flags, True)):
        consts = dict(f, HQ=16, GROUP=2, D=128, DV=128, BLOCK_M=128, BLOCK_N=128, BLOCK_D=128,
                      BLOCK_DV=128, HAS_SINK=True, NEG_SCALE=False, USE_TMA=tma,
                      WARP_SPECIALIZE=False)
        yield "fwd", f"fwd D=128 {label}", fwd._attn_fwd_kernel, fwd_types, consts, 8, 3
    # The paged forward (PackGQA): the mixed step's prefill tiles at page 16 (a page id per
    # key row) and 256 (one per tile), and the small tiles of a batch of decodes.
    paged_types = dict(q=BF16, k=BF16, v=BF16, o=BF16, lse=F32, sink=F32, cu_seqlens_q=I32,
                       seqused_k=I32, block_table=I32, scale_log2="fp32", softcap_a2="fp32",
                       softcap_c2="fp32")
    for label, page, block_m, block_n, warps, stages in (("page 16", 16, 128, 64, 8, 3),
                                                         ("page 256", 256, 128, 64, 8, 3),
                                                         ("decode rows", 16, 16, 64, 4, 4)):
        consts = dict(GROUP=4, D=128, DV=128, PAGE_SIZE=page, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_D=128, BLOCK_DV=128, BLOCK_P=128, HAS_LEFT=False, HAS_RIGHT=True,
                      HAS_SOFTCAP=False, HAS_SINK=True, NEG_SCALE=False)
        yield "fwd", f"fwd paged D=128 G=4 causal {label}", fwd._attn_fwd_paged_kernel, \
            paged_types, consts, warps, stages
    # The Hopper Gluon forward (fwd_sm90.py): the shipped schedule and the optional one.
    sm90_types = dict(q=BF16, k=BF16, v=BF16, o=BF16, lse=F32, sink=F32, cu_seqlens_q=I32,
                      cu_seqlens_k=I32, seqused_k=I32, scale_log2="fp32",
                      **{f"stride_{t}": ("i32",) * 3 for t in "qkvo"}, stride_l=("i32",) * 2)
    for label, f, pingpong, overlap in (("causal", flags, False, True),
                                        ("every flag", every, False, True),
                                        ("ping-pong serial", flags, True, False)):
        consts = dict(GROUP=2, D=128, BLOCK_N=128, STAGES=2, HAS_LEFT=f["HAS_LEFT"],
                      HAS_RIGHT=True, HAS_SINK=True, IS_VARLEN=f["IS_VARLEN"],
                      HAS_SEQUSED_K=f["HAS_SEQUSED_K"], PINGPONG=pingpong, OVERLAP=overlap,
                      CONSUMER_REGS=240)
        yield "fwd", f"fwd sm90 (Gluon) D=128 {label}", fwd_sm90._fwd_sm90_kernel, \
            sm90_types, consts, 4, 1
        if label == "causal":
            yield "fwd", "fwd sm90 (Gluon) D=256 causal", fwd_sm90._fwd_sm90_kernel, \
                sm90_types, dict(consts, D=256, BLOCK_N=configs.FWD_SM90[256].block_n), 4, 1
    # Its persistent form (dense calls): masks, a sink; the round robin and the host's table.
    for label, f, table in (("causal", flags, False), ("window", dict(flags, HAS_LEFT=True), False),
                            ("causal table", flags, True)):
        consts = dict(GROUP=2, HQ=16, D=128, BLOCK_N=128, STAGES=2, HAS_LEFT=f["HAS_LEFT"],
                      HAS_RIGHT=True, HAS_SINK=True, TABLE=table, O_IN_Q=False,
                      CONSUMER_REGS=240, Q_BUFS=1, WG=2)
        if not table:
            consts["sched"] = None
        yield "fwd", f"fwd sm90 persistent (Gluon) D=128 {label}", \
            fwd_sm90._fwd_sm90_persistent_kernel, dict(sm90_types, sched=I32), consts, 4, 1
        if label == "causal":
            # D = 256: out staged in Q's buffer.
            yield "fwd", "fwd sm90 persistent (Gluon) D=256 causal", \
                fwd_sm90._fwd_sm90_persistent_kernel, dict(sm90_types, sched=I32), \
                dict(consts, D=256, BLOCK_N=configs.FWD_SM90[256].block_n, O_IN_Q=True), 4, 1
        if label == "causal table":
            yield "fwd", "fwd sm90 persistent (Gluon) D=64 causal table", \
                fwd_sm90._fwd_sm90_persistent_kernel, dict(sm90_types, sched=I32), \
                dict(consts, D=64, BLOCK_N=configs.FWD_SM90[64].block_n), 4, 1
            # Two Q buffers (the next item's Q loads during this one: Q_BUFS).
            for d in (64, 128):
                yield "fwd", f"fwd sm90 persistent (Gluon) D={d} causal table Q_BUFS=2", \
                    fwd_sm90._fwd_sm90_persistent_kernel, dict(sm90_types, sched=I32), \
                    dict(consts, D=d, BLOCK_N=configs.FWD_SM90[d].block_n, Q_BUFS=2), 4, 1
            # Three consumer warpgroups (192-row items: configs CONSUMERS = 3), D = 64.
            for q_bufs in (1, 2):
                yield "fwd", f"fwd sm90 persistent (Gluon) D=64 causal table WG=3 " \
                    f"Q_BUFS={q_bufs}", fwd_sm90._fwd_sm90_persistent_kernel, \
                    dict(sm90_types, sched=I32), \
                    dict(consts, D=64, BLOCK_N=configs.FWD_SM90[64].block_n, Q_BUFS=q_bufs,
                         WG=3, CONSUMER_REGS=160), 4, 1
            yield "fwd", "fwd sm90 persistent (Gluon) D=64 window WG=3", \
                fwd_sm90._fwd_sm90_persistent_kernel, dict(sm90_types, sched=I32), \
                dict(consts, D=64, BLOCK_N=configs.FWD_SM90[64].block_n, Q_BUFS=2, WG=3,
                     CONSUMER_REGS=160, HAS_LEFT=True), 4, 1
    # Its persistent varlen form (packed sequences, row blocks listed on the device).
    varlen_types = dict(q=BF16, k=BF16, v=BF16, o=BF16, lse=F32, sink=F32, blocks=I32,
                        block_table=I32, scale_log2="fp32")
    # (WG = 3: three consumer warpgroups, 192-row blocks: configs VARLEN_CONSUMERS = 3.)
    for label, window, d, splits, wg in (("causal", False, 128, 1, 2), ("window", True, 128, 1, 2),
                                         ("causal", False, 256, 1, 2), ("causal", False, 256, 4, 2),
                                         ("causal", False, 64, 1, 2), ("causal", False, 64, 4, 2),
                                         ("causal", False, 64, 1, 3), ("window", True, 64, 1, 3),
                                         ("causal", False, 64, 4, 3)):
        consts = dict(GROUP=2, HQ=16, D=d, BLOCK_N=configs.FWD_SM90[d].block_n, STAGES=2,
                      HAS_LEFT=window, HAS_RIGHT=True, HAS_SINK=splits == 1,
                      O_IN_Q=d == 256, CONSUMER_REGS=240 if wg == 2 else 160, PAGE_SIZE=0,
                      block_table=None, SPLITS=splits, WG=wg)
        # Key splits: partial states in float32 workspaces.
        types = dict(varlen_types, o=F32) if splits > 1 else varlen_types
        yield "fwd", f"fwd sm90 persistent varlen (Gluon) D={d} {label}" + (
            f" {splits} splits" if splits > 1 else "") + (" WG=3" if wg == 3 else ""), \
            fwd_sm90._fwd_sm90_varlen_kernel, types, consts, 4, 1
    # The same kernel over paged caches (a paged call's long sequences).
    # (D = 256: fwd_sm90.PAGED_D256, O staged in Q's buffer.)
    for d, page, splits, wg in ((128, 16, 1, 2), (128, 64, 1, 2), (128, 256, 1, 2),
                                (128, 16, 4, 2), (64, 16, 1, 3), (64, 256, 4, 3),
                                (256, 16, 1, 2), (256, 64, 4, 2)):
        consts = dict(GROUP=4, HQ=32, D=d, BLOCK_N=configs.FWD_SM90[d].block_n, STAGES=2,
                      HAS_LEFT=False, HAS_RIGHT=True, HAS_SINK=False, O_IN_Q=d == 256,
                      CONSUMER_REGS=240 if wg == 2 else 160, PAGE_SIZE=page, SPLITS=splits,
                      WG=wg)
        # Key splits: partial states in float32 workspaces.
        types = dict(varlen_types, o=F32) if splits > 1 else varlen_types
        yield "fwd", f"fwd sm90 persistent paged (Gluon) D={d} page {page} causal" + (
            f" {splits} splits" if splits > 1 else "") + (" WG=3" if wg == 3 else ""), \
            fwd_sm90._fwd_sm90_varlen_kernel, types, consts, 4, 1
    yield "fwd", "fwd sm90 varlen blocks (list)", fwd_sm90._varlen_blocks_kernel, \
        dict(cu_seqlens_q=I32, cu_seqlens_k=I32, seqused_k=I32, blocks=I32), \
        dict(BLOCK_M=128, BLOCK_B=128, HAS_SEQUSED_K=True, block_table=None, GROUP=1,
             PAGE_SIZE=0, BLOCK_P=1, ALIGN_END=0), 4, 1
    yield "fwd", "fwd sm90 varlen blocks (list, end-aligned)", fwd_sm90._varlen_blocks_kernel, \
        dict(cu_seqlens_q=I32, cu_seqlens_k=I32, seqused_k=I32, blocks=I32), \
        dict(BLOCK_M=192, BLOCK_B=128, HAS_SEQUSED_K=True, block_table=None, GROUP=1,
             PAGE_SIZE=0, BLOCK_P=1, ALIGN_END=64), 4, 1
    yield "fwd", "fwd sm90 varlen blocks (paged list)", fwd_sm90._varlen_blocks_kernel, \
        dict(cu_seqlens_q=I32, seqused_k=I32, blocks=I32, block_table=I32), \
        dict(BLOCK_M=128, BLOCK_B=16, HAS_SEQUSED_K=True, cu_seqlens_k=None, GROUP=4,
             PAGE_SIZE=16, BLOCK_P=256, ALIGN_END=0), 4, 1
    # Its paged variant: pages smaller than a tile (a TMA box a page), of a tile, and larger.
    paged_sm90 = dict(q=BF16, k=BF16, v=BF16, o=BF16, lse=F32, sink=F32, cu_seqlens_q=I32,
                      seqused_k=I32, block_table=I32, scale_log2="fp32", stride_q=("i32",) * 2,
                      stride_k=("i32",) * 3, stride_v=("i32",) * 3, stride_o=("i32",) * 2)
    for label, page, window in (("page 16 causal", 16, False), ("page 32 causal", 32, False),
                                ("page 64 window", 64, True),
                                ("page 256 causal", 256, False)):
        consts = dict(GROUP=4, D=128, PAGE_SIZE=page, BLOCK_B=256, BLOCK_N=128, STAGES=2,
                      HAS_LEFT=window,
                      HAS_RIGHT=True, HAS_SINK=True, PINGPONG=False, OVERLAP=True,
                      CONSUMER_REGS=240)
        yield "fwd", f"fwd sm90 paged (Gluon) D=128 {label}", fwd_sm90._fwd_sm90_paged_kernel, \
            paged_sm90, consts, 4, 1
    # D = 256 (fwd_sm90.PAGED_D256): 64-key tiles, a page of 16 four boxes a tile.
    yield "fwd", "fwd sm90 paged (Gluon) D=256 page 16 causal", fwd_sm90._fwd_sm90_paged_kernel, \
        paged_sm90, dict(consts, D=256, PAGE_SIZE=16, BLOCK_N=configs.FWD_SM90[256].block_n,
                         HAS_LEFT=False), 4, 1
    bwd_types = dict(q=BF16, k=BF16, v=BF16, dout=BF16, dq=BF16, dk=BF16, dv=BF16,
                     lse_log2=F32, delta=F32, cu_seqlens_q=I32, cu_seqlens_k=I32,
                     seqused_k=I32)
    for label, f in (("causal", flags), ("every flag", every)):
        consts = dict(f, GROUP=2, D=128, DV=128, BLOCK_M=64, BLOCK_N=128, BLOCK_D=128,
                      BLOCK_DV=128, USE_TMA=True, EARLY_DP=True,
                      STATS_TMA=True, HEAD_LOOP=False)
        # The shipped stages: varlen keeps 2 (configs.BWD_DKDV_VARLEN).
        yield "dkdv", f"bwd dK/dV D=128 {label}", bwd._attn_bwd_dkdv_kernel, bwd_types, \
            consts, 8, 2 if f["IS_VARLEN"] else 3
        if f["IS_VARLEN"]:
            yield "dkdv", f"bwd dK/dV D=128 {label} 3 stages", bwd._attn_bwd_dkdv_kernel, \
                bwd_types, consts, 8, 3
        if label == "causal":
            # Head dims above 128 loop over the heads around the row ranges (HEAD_LOOP).
            yield "dkdv", "bwd dK/dV D=256 G=4 causal", bwd._attn_bwd_dkdv_kernel, \
                bwd_types, dict(consts, GROUP=4, D=256, DV=256, BLOCK_M=64,
                                BLOCK_N=64, BLOCK_D=256, BLOCK_DV=256, EARLY_DP=False,
                                HEAD_LOOP=True), 8, 2
        # The Hopper Gluon dK/dV and dQ (bwd_sm90.py), at their shipped tiles.
        consts = dict(GROUP=2, D=128, BLOCK_M=64, STAGES=2, HAS_LEFT=f["HAS_LEFT"],
                      HAS_RIGHT=True, IS_VARLEN=f["IS_VARLEN"],
                      HAS_SEQUSED_K=f["HAS_SEQUSED_K"], EARLY_DP=False,
                      STATS_TMA=True, CONSUMER_REGS=240, dq_acc=None,
                      stride_dqa=None, FUSED_DQ=False, HOST_DESC=False, ROLE_SPLIT=False,
                      P_F32=True, LPT=False, DQ_SWIZZLE=False, DQ_LAG=False)
        sm90_bwd = dict(bwd_types, scale="fp32", scale_log2="fp32")
        # dK, dV and dQ in one pass (FUSED_DQ: dQ added into a float32 tensor by TMA).
        # The lag of the dQ products (bwd_sm90.DQ_LAG): every fused D = 128 launch.
        fused = {**{n: c for n, c in consts.items() if n not in ("dq_acc", "stride_dqa")},
                 "FUSED_DQ": True, "DQ_SWIZZLE": bwd_sm90.DQ_SWIZZLE,
                 "DQ_LAG": bwd_sm90.DQ_LAG}
        fused_types = dict(sm90_bwd, dq_acc=F32, stride_dqa=("i32",) * 3)
        yield "dkdv", f"bwd dK/dV sm90 (Gluon) D=128 {label}", bwd_sm90._dkdv_sm90_kernel, \
            sm90_bwd, consts, 4, 1
        if f["IS_VARLEN"]:
            # The grid longest first on per-program descriptors (bwd_sm90.LPT), G = 4.
            yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=128 G=4 {label} LPT", \
                bwd_sm90._dkdv_sm90_kernel, fused_types, dict(fused, GROUP=4, LPT=True), 4, 1
        yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=128 {label}", \
            bwd_sm90._dkdv_sm90_kernel, fused_types, fused, 4, 1
        if not f["IS_VARLEN"]:
            # Dense calls: descriptors made on the host (HOST_DESC), two-pass and fused.
            hd = _dkdv_host_descs(128)
            yield "dkdv", f"bwd dK/dV sm90 (Gluon) D=128 {label} host desc", \
                bwd_sm90._dkdv_sm90_kernel, dict(sm90_bwd, **hd), \
                dict(consts, HOST_DESC=True), 4, 1
            hd_fused = dict(sm90_bwd, **_dkdv_host_descs(128, bwd_sm90.DQ_SWIZZLE),
                            stride_dqa=("i32",) * 3)
            yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=128 {label} host desc", \
                bwd_sm90._dkdv_sm90_kernel, hd_fused, dict(fused, HOST_DESC=True), 4, 1
            # The grid longest first (bwd_sm90.LPT), GQA's group of 4.
            yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=128 G=4 {label} host desc LPT", \
                bwd_sm90._dkdv_sm90_kernel, hd_fused, \
                dict(fused, HOST_DESC=True, GROUP=4, LPT=True), 4, 1
            # D = 256: the role split (one warpgroup P^T and dV, the other dP^T and dK).
            hd256 = _dkdv_host_descs(256)
            yield "dkdv", f"bwd dK/dV sm90 (Gluon) D=256 {label} roles host desc", \
                bwd_sm90._dkdv_sm90_kernel, dict(sm90_bwd, **hd256), \
                dict(consts, D=256, HOST_DESC=True, ROLE_SPLIT=True), 4, 1
            if label == "causal":
                # The longest-first order on the role split (bwd_sm90.LPT), G = 4.
                yield "dkdv", "bwd dK/dV sm90 (Gluon) D=256 G=4 causal roles host desc LPT", \
                    bwd_sm90._dkdv_sm90_kernel, dict(sm90_bwd, **hd256), \
                    dict(consts, D=256, GROUP=4, HOST_DESC=True, ROLE_SPLIT=True, LPT=True), \
                    4, 1
        yield "dkdv", f"bwd dK/dV sm90 (Gluon) D=256 {label} roles", \
            bwd_sm90._dkdv_sm90_kernel, sm90_bwd, dict(consts, D=256, ROLE_SPLIT=True), 4, 1
        if label == "causal":
            yield "dkdv", "bwd dK/dV sm90 (Gluon) D=256 causal roles P bf16", \
                bwd_sm90._dkdv_sm90_kernel, sm90_bwd, \
                dict(consts, D=256, ROLE_SPLIT=True, P_F32=False), 4, 1
            yield "dkdv", "bwd dK/dV sm90 (Gluon) D=64 causal", bwd_sm90._dkdv_sm90_kernel, \
                sm90_bwd, dict(consts, D=64), 4, 1
        # D = 64 fused: the warpgroups take dQ's tiles in turn (whole rows of 64 columns).
        yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=64 {label}", \
            bwd_sm90._dkdv_sm90_kernel, fused_types, dict(fused, D=64, DQ_LAG=False), 4, 1
        if not f["IS_VARLEN"]:
            hd64 = _dkdv_host_descs(64, bwd_sm90.DQ_SWIZZLE)
            yield "dkdv", f"bwd dK/dV+dQ fused sm90 (Gluon) D=64 {label} host desc", \
                bwd_sm90._dkdv_sm90_kernel, dict(sm90_bwd, **hd64, stride_dqa=("i32",) * 3), \
                dict(fused, D=64, HOST_DESC=True, GROUP=4, LPT=True, DQ_LAG=False), 4, 1
            yield "dkdv", "bwd dK/dV sm90 (Gluon) D=128 causal EARLY_DP", \
                bwd_sm90._dkdv_sm90_kernel, sm90_bwd, dict(consts, EARLY_DP=True), 4, 1
        consts = dict(GROUP=2, D=128, BLOCK_N=128, STAGES=2, HAS_LEFT=f["HAS_LEFT"],
                      HAS_RIGHT=True, IS_VARLEN=f["IS_VARLEN"],
                      HAS_SEQUSED_K=f["HAS_SEQUSED_K"], CONSUMER_REGS=240, HOST_DESC=False)
        yield "dq", f"bwd dQ sm90 (Gluon) D=128 {label}", bwd_sm90._dq_sm90_kernel, \
            dict(bwd_types, scale="fp32", scale_log2="fp32"), consts, 4, 1
        if not f["IS_VARLEN"]:
            yield "dq", f"bwd dQ sm90 (Gluon) D=128 {label} host desc", \
                bwd_sm90._dq_sm90_kernel, \
                dict(bwd_types, scale="fp32", scale_log2="fp32", **host_descs(
                    bwd_sm90._dq_host_spec(torch.bfloat16, 128, configs.BWD_SM90_DQ[128].block_n),
                    ("q", "k", "v", "dout", "lse_log2", "delta", "dq"))), \
                dict(consts, HOST_DESC=True), 4, 1
        if label == "causal":
            yield "dq", "bwd dQ sm90 (Gluon) D=256 causal", bwd_sm90._dq_sm90_kernel, \
                dict(bwd_types, scale="fp32", scale_log2="fp32"), \
                dict(consts, D=256, BLOCK_N=configs.BWD_SM90_DQ[256].block_n), 4, 1
            # Its persistent form (dense calls; bwd_config PERSISTENT).
            yield "dq", "bwd dQ sm90 persistent (Gluon) D=128 causal", \
                bwd_sm90._dq_sm90_persistent_kernel, \
                dict(bwd_types, scale="fp32", scale_log2="fp32", stride_rows=("i32",) * 5), \
                dict(GROUP=2, HQ=16, D=128, BLOCK_N=128, STAGES=2, HAS_LEFT=False,
                     HAS_RIGHT=True, TABLE=False, sched=None, CONSUMER_REGS=240), 4, 1
        consts = dict(f, GROUP=2, D=128, DV=128, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128,
                      BLOCK_DV=128, USE_TMA=True, EARLY_DP=True)
        yield "dq", f"bwd dQ D=128 {label}", bwd._attn_bwd_dq_kernel, bwd_types, consts, 8, 3
    # Varlen: the rows of dQ, dK and dV that no pass writes, zeroed (seqused_k).
    yield "dq", "bwd varlen zero uncovered rows dQ+dK+dV", bwd._zero_uncovered_rows, \
        dict(dq=BF16, dk=BF16, dv=BF16, cu_seqlens_q=I32, cu_seqlens_k=I32, seqused_k=I32), \
        dict(HAS_SEQUSED=True, BLOCK_R=64, BLOCK_B=32, BLOCK_C=64), 4, 3
    dec_types = dict(q=BF16, k=BF16, v=BF16, cache_seqlens=I32, block_table=I32, sink=F32,
                     o=F32, lse=F32, token_pages=I32, out_f=BF16, lse_f=F32, counter=I32,
                     cache_leftpad=I32, cu_seqlens_q=I32, scale_log2="fp32", softcap_a2="fp32",
                     softcap_c2="fp32")
    merge_flags = dict(FUSED_MERGE=False, MERGE_SINK=False, MERGE_BLOCK_S=8)
    for paged in (False, True):
        consts = dict(SQ=1, GROUP=4, M_TILES=1, D1=128, D2=0, DV=128, BLOCK_M=16, BLOCK_N=64,
                      BLOCK_D1=128, BLOCK_D2=16, BLOCK_DV=128, PAGE_SIZE=16 if paged else 1,
                      PAGED=paged, TOKEN_TABLE=False, TOKEN_PAGE=0, SHARED_KV=False,
                      HAS_LEFT=False,
                      HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_SINK=True, HAS_SEQLENS=True,
                      HAS_LEFTPAD=False, PACKED_Q=False, PDL=True, **merge_flags)
        yield "decode", f"decode GQA paged={paged}", decode._decode_fwd_kernel, dec_types, \
            consts, 4, 3
        # The split kernel that merges its splits itself (decode.FUSED_MERGE).
        yield "decode", f"decode GQA paged={paged} fused merge", decode._decode_fwd_kernel, \
            dec_types, dict(consts, HAS_SINK=False, PDL=False, FUSED_MERGE=True,
                            MERGE_SINK=True), 4, 3
    # A dense call of a few query rows (dispatch.SHORT_Q_DECODE): the whole cache (no
    # lengths), fused merge; and v the same tensor as k (V read from K's tiles, D2 = 0).
    short = dict(consts, SQ=4, PAGE_SIZE=1, PAGED=False, HAS_SEQLENS=False, HAS_SINK=False,
                 PDL=False, FUSED_MERGE=True, MERGE_SINK=False)
    yield "decode", "decode short-query dense Sq=4 fused merge", decode._decode_fwd_kernel, \
        dec_types, short, 4, 3
    yield "decode", "decode short-query dense v is k", decode._decode_fwd_kernel, dec_types, \
        dict(short, SHARED_KV=True), 4, 3
    # A left-padded contiguous cache (attention_with_kvcache's cache_leftpad).
    yield "decode", "decode GQA cache_leftpad fused merge", decode._decode_fwd_kernel, \
        dec_types, dict(short, SQ=1, HAS_SEQLENS=True, HAS_LEFTPAD=True), 4, 3
    # A paged varlen call's short sequences (dispatch.SMALL_DECODE): packed queries, their
    # rows from cu_seqlens_q, the fused merge writing the packed rows.
    yield "decode", "decode packed queries paged 16 fused merge", decode._decode_fwd_kernel, \
        dec_types, dict(consts, SQ=4, PAGED=True, PAGE_SIZE=16, HAS_SINK=False, PDL=False,
                        FUSED_MERGE=True, MERGE_SINK=True, PACKED_Q=True), 4, 3
    # sparse_attention's forward: the top-k lists read as the table (one-row pages).
    consts = dict(consts, GROUP=8, BLOCK_M=16, PAGE_SIZE=1, PAGED=True, TOKEN_TABLE=True,
                  HAS_RIGHT=False, HAS_SINK=False, HAS_SEQLENS=False)
    yield "decode", "decode sparse token table G=8", decode._decode_fwd_kernel, dec_types, \
        consts, 4, 3
    yield "decode", "decode sparse token table G=8 paged 64", decode._decode_fwd_kernel, \
        dec_types, dict(consts, TOKEN_PAGE=64), 4, 3
    # The Hopper MLA decode (decode_mla_sm90.py): contiguous one-split with a sink, paged
    # split-KV, and two query rows (multi-token prediction) under a causal mask.
    mla_types = dict(dec_types, o=F32)
    for label, paged, page, sq, flags_ in (
            ("contiguous sink", False, 1, 1, dict(HAS_SINK=True)),
            ("paged 64 splits", True, 64, 1, dict(PDL=True)),
            ("Sq=2 causal paged 256", True, 256, 2, dict(HAS_RIGHT=True)),
            ("paged 16 (four pages a tile)", True, 16, 1, dict(WHOLE_TILES=True)),
            ("paged 8 (two producer warps)", True, 8, 1, dict(WHOLE_TILES=True)),
            # Sparse top-k lists (token table) over a paged cache of 64-row pages.
            ("top-k paged 64", True, 1, 1, dict(
                TOKEN_TABLE=True, TOKEN_PAGE=64, HAS_SEQLENS=False, PREFETCH=0,
                **dict(zip(("PRODUCER_WARPS", "PRODUCER_REGS", "CONSUMER_REGS"),
                           decode_mla_sm90.TOPK_SPLIT))))):
        consts = dict(SQ=sq, GROUP=128, M_TILES=2 * sq, PAGE_SIZE=page, PAGED=paged,
                      TOKEN_TABLE=False, TOKEN_PAGE=0, HAS_SEQLENS=True, HAS_LEFT=False,
                      HAS_RIGHT=False, HAS_SINK=False, PDL=False, PREFETCH=2, WHOLE_TILES=False,
                      REBUILD=True, PRODUCER_WARPS=1, PRODUCER_REGS=24, CONSUMER_REGS=240)
        consts.update(flags_)
        yield "mla", f"decode MLA sm90 (Gluon) {label}", decode_mla_sm90._mla_decode_kernel, \
            mla_types, consts, 4, 1
    consts = dict(D=512, HAS_SINK=True, BLOCK_S=1, BLOCK_R=1, BLOCK_D=512, PDL=True, PAIR=False)
    yield "combine", "combine D=512 sink", combine._merge_states_fwd_kernel, \
        dict(outs=F32, lses=F32, sink=F32, out=BF16, lse=F32, outs_b=F32, lses_b=F32,
             **{f"stride_{t}": ("i32",) * 3 for t in "olkyz"}), consts, 1, 3
    # merge's two states at two addresses (combine.pair_plan).
    consts = dict(D=128, HAS_SINK=False, BLOCK_S=2, BLOCK_R=16, BLOCK_D=128, PDL=False,
                  PAIR=True)
    yield "combine", "combine pair D=128", combine._merge_states_fwd_kernel, \
        dict(outs=BF16, lses=F32, sink=F32, out=BF16, lse=F32, outs_b=BF16, lses_b=F32,
             **{f"stride_{t}": ("i32",) * 3 for t in "olkyz"}), consts, 4, 3
    # The sparse top-k backward (kernels/sparse.py) at issue 17's GQA shape: 8 heads a kv head.
    yield "sparse", "sparse bwd D=128 G=8", sparse._sparse_bwd_kernel, \
        dict(q=BF16, k=BF16, v=BF16, dout=BF16, indices=I32, lse_log2=F32, delta=F32, dq=BF16,
             dk=F32, dv=F32, scale="fp32", scale_log2="fp32"), \
        dict(HKV=4, GROUP=8, D=128, DV=128, BLOCK_H=16, BLOCK_N=32, BLOCK_D=128,
             BLOCK_DV=128), 4, 3


def main(argv=None):
    want = set(argv if argv is not None else sys.argv[1:])
    loops, pipe, spills = "--loops" in want, "--pipeline" in want, "--spills" in want
    want -= {"--loops", "--pipeline", "--spills"}
    for key, name, fn, types, consts, warps, stages in cases():
        if want and key not in want:
            continue
        try:
            k = compile_kernel(fn, types, consts, warps, stages)
            print(report(name, k), flush=True)
            if pipe:
                waits, bufs = pipeline(k)
                print(f"  cp.async waits {waits}, buffers {bufs}", flush=True)
            if loops:
                print("\n".join(loop_mix(k)), flush=True)
            if spills:
                for target, n, ldl, wgmma in loop_spills(k):
                    print(f"  loop at {target:#06x}: {n} instructions, {ldl} local loads, "
                          f"{wgmma} wgmma", flush=True)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            msg = str(e) if os.environ.get("VERBOSE") else str(e).splitlines()[0][:120]
            print(f"{name:44s} FAILED: {type(e).__name__}: {msg}")
            want.add("__failed__")
    return 1 if "__failed__" in want else 0


if __name__ == "__main__":
    sys.exit(main())
