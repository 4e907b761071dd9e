"""Every kernel's launch configuration: one type, :class:`TileConfig`, and one table or rule
per kernel, here and nowhere else.

Each entry cites the ``benchmarks/RESULTS.md`` row that chose it (its date, the table it sits
in and the shape), and ``benchmarks/NOTES.md`` where the sweep behind the row is described;
an entry no row measured says so. These values are what the H200 tables in RESULTS.md were
measured with: change one only with a new dated row that shows why, and cite that row here.

The launchers read their tiles from here and apply the caller's overrides
(``KernelOptions.fwd_config`` / ``fwd_sm90_config`` / ``bwd_config``, decode's ``config=``)
through :func:`override`, the one place where those dicts become a ``TileConfig``. Under
``TRITON_INTERPRET=1`` the rules hand out small tiles (the interpreter is fast with them and
the tests get several tiles per row); the tables below are the GPU's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from ._common import cdiv, next_pow2


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One kernel launch's tiles and schedule switches.

    Attributes:
        block_m: rows per program, or per tile of the program's row loop: query rows (the
            attention kernels; decode: query rows x heads of the group; sparse: the group's
            heads), new keys (append), merged rows (combine).
        block_n: the tile along the reduced axis: keys (attention), states per unrolled step
            (combine); None where the kernel has none (whole rows).
        num_warps: warps per program.
        num_stages: software-pipeline depth; None leaves Triton's default (not passed).
        num_stages_paged: decode over a paged cache, when it should differ (None: num_stages).
        programs_per_sm: decode: what ``num_splits=0`` fills.
        block_d: combine: output columns per program (elsewhere the head dim decides).
        use_tma: fwd, bwd: False takes masked pointer loads even where TMA would work.
        warp_specialize: fwd: ``tl.range(..., warp_specialize=True)`` (TMA, 8 warps only).
        group_heads: fwd: (batch, head) pairs per L2 group; None sizes it from the L2.
        early_dp: bwd (both passes), bwd_sm90 dK/dV: ``dP`` issued right after ``S``.
        stats_tma: bwd / bwd_sm90 dK/dV: lse and delta by TMA.
        head_loop: bwd dK/dV: a loop over the group's heads around the row ranges.
        pingpong, overlap: fwd_sm90: FA-3's inter- / intra-warpgroup schedules.
        persistent: fwd_sm90: a program per SM walking the row blocks (dense calls whose
            layout allows it, ``fwd_sm90._persistent_ok``, in a balanced round robin).
        persistent_table: fwd_sm90: where the round robin is uneven (causal at long S), the
            persistent kernel with the host's greedy schedule (``fwd_sm90._greedy_table``).
        persistent_varlen: fwd_sm90: packed varlen calls on the persistent varlen kernel
            (its row blocks listed on the device, ``fwd_sm90._varlen_blocks_kernel``).
        grid: fwd_sm90: the calls neither persistent kernel takes run its grid kernel; False
            sends them to fwd.py's (a head dim where only the persistent kernel pays).
        consumer_regs: the Gluon kernels: registers per consumer-warpgroup thread.
        q_bufs: fwd_sm90's persistent kernel: buffers of an item's Q (2: the next item's Q
            loads during this one).
        consumers: fwd_sm90's persistent kernel: consumer warpgroups of 64 rows each, so a
            work item of ``64 * consumers`` rows (2, or 3: 160 registers a thread, the key
            tiles one after the other in each).
        varlen_consumers: the same for fwd_sm90's persistent varlen kernel (packed varlen,
            paged prefill, dense key splits), whose 192-row blocks end at their sequence's
            end.
    """

    block_m: int
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    num_stages_paged: int | None = None
    programs_per_sm: int = 1
    block_d: int | None = None
    use_tma: bool = True
    warp_specialize: bool = False
    group_heads: int | None = None
    early_dp: bool = False
    stats_tma: bool = True
    head_loop: bool = False
    pingpong: bool = False
    overlap: bool = False
    persistent: bool = False
    persistent_table: bool = False
    persistent_varlen: bool = False
    grid: bool = True
    consumer_regs: int = 240
    q_bufs: int = 1
    consumers: int = 2
    varlen_consumers: int = 2

    @property
    def tile(self) -> tuple:
        """``(block_m, block_n, num_warps, num_stages)``: ``bwd_config``'s tuple form."""
        return self.block_m, self.block_n, self.num_warps, self.num_stages

    def launch(self) -> dict:
        """``num_warps`` and, when set, ``num_stages``: the launch keywords of a kernel."""
        if self.num_stages is None:
            return dict(num_warps=self.num_warps)
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


# Override keys (the kernels' own names, as KernelOptions and the benchmarks spell them) and
# the field each sets.
_FIELDS = {
    "BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps",
    "num_stages": "num_stages", "STAGES": "num_stages", "num_stages_paged": "num_stages_paged",
    "PROGRAMS_PER_SM": "programs_per_sm", "USE_TMA": "use_tma",
    "WARP_SPECIALIZE": "warp_specialize", "GROUP_HEADS": "group_heads", "EARLY_DP": "early_dp",
    "STATS_TMA": "stats_tma", "HEAD_LOOP": "head_loop", "PINGPONG": "pingpong",
    "OVERLAP": "overlap", "PERSISTENT": "persistent", "PERSISTENT_TABLE": "persistent_table",
    "PERSISTENT_VARLEN": "persistent_varlen", "GRID": "grid",
    "CONSUMER_REGS": "consumer_regs", "Q_BUFS": "q_bufs", "CONSUMERS": "consumers",
    "VARLEN_CONSUMERS": "varlen_consumers",
}
FWD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "USE_TMA", "WARP_SPECIALIZE",
            "GROUP_HEADS")
FWD_SM90_KEYS = ("BLOCK_N", "STAGES", "PINGPONG", "OVERLAP", "PERSISTENT", "PERSISTENT_TABLE",
                 "PERSISTENT_VARLEN", "GRID", "CONSUMER_REGS", "Q_BUFS", "CONSUMERS",
                 "VARLEN_CONSUMERS")
DECODE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_stages_paged",
               "PROGRAMS_PER_SM")
# bwd_config: "dkdv" / "dq" take (BLOCK_M, BLOCK_N, num_warps, num_stages); the flags set
# both passes' configs (PERSISTENT: bwd_sm90's dQ as a persistent kernel, where it applies).
BWD_KEYS = ("dkdv", "dq", "USE_TMA", "EARLY_DP", "STATS_TMA", "HEAD_LOOP", "PERSISTENT")


def override_key(changes):
    """An override's part of a plan-cache key: None for none, a mapping's sorted items, or
    the ``TileConfig`` itself. A TypeError (from ``hash``) when its values do not hash: the
    caller then plans that call without caching it."""
    key = tuple(sorted(changes.items())) if isinstance(changes, Mapping) else changes
    hash(key)
    return key or None


def check_override(changes, keys: tuple, what: str) -> None:
    """A caller's override: None, a :class:`TileConfig`, or a mapping of ``keys`` only
    (``KernelOptions`` checks its three where they are written, :func:`override` where they
    are applied)."""
    if changes is None or isinstance(changes, TileConfig):
        return
    if not isinstance(changes, Mapping):
        raise TypeError(f"{what} takes a mapping or a TileConfig, got {type(changes).__name__}")
    unknown = sorted(set(changes) - set(keys), key=str)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; it takes {', '.join(keys)}")


def override(cfg: TileConfig, changes, keys: tuple, *, part: str | None = None,
             what: str = "config") -> TileConfig:
    """``cfg`` with a caller's ``changes``: None keeps it, a :class:`TileConfig` replaces it,
    a mapping of ``keys`` (the kernels' names: ``BLOCK_N``, ``num_stages``, ...) sets those
    fields. With ``part`` (bwd: ``"dkdv"`` / ``"dq"``) the mapping's entry of that name is
    the tile tuple ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; the others' are ignored."""
    if not changes:
        return cfg
    if isinstance(changes, TileConfig) and part is None:
        return changes
    check_override(changes, keys, what)
    fields = {}
    for key, value in changes.items():
        if key in ("dkdv", "dq"):
            if key == part and isinstance(value, TileConfig):
                cfg = value
            elif key == part and value:
                bm, bn, w, s = value
                fields.update(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        else:
            fields[_FIELDS[key]] = value
    return dataclasses.replace(cfg, **fields) if fields else cfg


# --- fwd.py: the portable forward ---------------------------------------------------------
#
# Per padded head dim (the wider of D and Dv). NOTES.md "Forward kernel" experiments #1-#7
# and "Per head dim" (S = 8k sweeps); the rows measured with these tiles: RESULTS.md,
# 2026-11-29, the first table, "fwd bf16" D=64 / D=128 / D=256 S=1024-16384 full and causal
# (D=128 rows there predate the Hopper forward, which runs D=128 on sm_90 since session 5).
FWD = {
    # Not measured (no D=32 row): D=64's tile.
    32: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=3, use_tma=False,
                   group_heads=1),
    # RESULTS.md 2026-11-29 first table, fwd bf16 D=64 S=8192 B=2 H=32 full (406 TFLOP/s):
    # 128x128/4 warps, pointer loads (NOTES #6), one head per L2 group (NOTES #5).
    64: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=3, use_tma=False,
                   group_heads=1),
    # RESULTS.md 2026-11-29 first table, fwd bf16 D=128 S=8192 B=2 H=16 full (492): NOTES #1
    # (128x128/8 warps/3 stages), #5 (one head per group non-causal), #6 (pointer loads).
    128: TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=False,
                    group_heads=1),
    # RESULTS.md 2026-11-29 first table, fwd bf16 D=256 S=8192 B=2 H=8 full / causal
    # (523 / 498): 128x64/8 warps/2 stages, TMA and warp specialisation (NOTES #7).
    256: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, warp_specialize=True),
}
# Masked (causal or window) calls where they differ; the others take FWD's entry.
FWD_MASKED = {
    # RESULTS.md 2026-11-29 first table, fwd bf16 D=64 S=8192 B=2 H=32 causal (386):
    # 128x64/4 warps (NOTES "Per head dim": causal 389), pointer loads.
    64: TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=False,
                   group_heads=1),
    # RESULTS.md 2026-11-29 first table, fwd bf16 D=128 S=8192 B=2 H=16 causal (462): TMA,
    # warp specialisation (NOTES #7), heads grouped by the L2 size (NOTES #5, "auto").
    128: TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, warp_specialize=True),
}
_FWD_INTERPRET = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def fwd_config(block_d: int, block_dv: int, masked: bool, interpret: bool) -> TileConfig:
    """The portable forward's tiles for padded head dims ``block_d`` / ``block_dv``."""
    if interpret:
        return _FWD_INTERPRET
    key = min(max(block_d, block_dv, 32), 256)
    return (FWD_MASKED if masked else FWD).get(key) or FWD[key]


def fwd_group_heads(seqlen_k: int, width: int, elsize: int) -> int:
    """Heads whose K and V together fill about a third of the H200's 50 MB L2 (NOTES.md
    forward #5, "auto": RESULTS.md 2026-11-29 first table, fwd bf16 D=128 causal rows)."""
    return max(1, (16 << 20) // max(1, seqlen_k * width * elsize))


# The paged forward (PackGQA rows, per-row K/V addresses). Its prefill tiles: BLOCK_N = 128 (the
# table above) spills at D = 128 (stack 56 B in the sm_90 compile since session 8, outside the
# loops; the contiguous kernel's 48 B), these do not; sequences
# of at most 64 packed rows (decodes, short speculative queries) take one tile of as few rows
# as tl.dot allows. Not measured yet (session 8 measures them: bench_serving.py).
FWD_PAGED = {
    64: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    128: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    256: TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
}


@functools.lru_cache(maxsize=256)
def fwd_paged_config(block_d: int, block_dv: int, rows: int, interpret: bool) -> TileConfig:
    """The paged forward's tiles for sequences of at most ``rows`` packed rows."""
    if interpret:
        return _FWD_INTERPRET
    if rows <= 64:
        return _fwd_paged_small(block_d, block_dv, max(16, next_pow2(rows)))
    return FWD_PAGED[min(max(block_d, block_dv, 64), 256)]


@functools.cache  # (a serving step's every call: one object, not a new one a call)
def _fwd_paged_small(block_d: int, block_dv: int, block_m: int) -> TileConfig:
    if max(block_d, block_dv) <= 128:
        return TileConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=4)
    return TileConfig(block_m=block_m, block_n=32, num_warps=8 if block_m == 64 else 4,
                      num_stages=2)


# --- fwd_sm90.py: the Hopper Gluon forward ------------------------------------------------
#
# block_m is the kernel's (two 64-row consumer warpgroups) and num_warps its consumers'.
# RESULTS.md 2026-11-29, session 5, the variants table ("ovfree" column, D=128 S=4096-16384
# full / causal: overlap without ping-pong, 2 stages) and the bench_fwd.py --full table
# above it (fwd bf16 D=128 S=8192 B=2 H=16 full 600, causal 547). D=64 is not in the domain:
# session 5's "Gluon kernel at D=64, not kept" rows, and RESULTS.md 2026-12-02 session 15,
# "Hopper forward at D = 64 / 256" (128x128: 0.66-0.94x of fwd.py's at S <= 2k, 0.91-1.02x
# at 4k, 1.01-1.08x at S >= 8k; softmax-bound: half D = 128's MMA work a tile, the same exps).
# persistent: RESULTS.md 2026-12-02, "Session 15, calls 3-5" (S = 1k / 2k
# / 4k, B*S = 16k, H = 16: full +23 / +12 / +6%, causal +36 / +21 / +1%); taken where the
# layout allows it and its static schedule is balanced (fwd_sm90._persistent_programs).
# persistent_table (the host's greedy schedule where the round robin is not balanced: causal
# S >= 4k there): RESULTS.md 2026-12-02, "Session 16, call 1" (causal S = 4k +17 / +18%,
# 8k +10 / -3%, 16k +2 / -2% in two passes against the grid kernel).
FWD_SM90 = {
    # RESULTS.md 2026-12-02 session 18, call 4 (bench_fwd --dims 64, fwd.py's kernel then
    # this tile, alternating, two passes): full 1k +21 / +18%, 2k +15 / +17%,
    # 4k +13 / +13%, 8k +13 / +12%, 16k +11 / +10%; causal 1k -1 / -2%, 2k +9 / +10%, 4k +10 /
    # +11%, 8k +6 / +6%, 16k +12 / +10% (0.88-1.00x cuDNN but at causal 1k, 0.76x). The grid
    # kernel lost to fwd.py's below 8k at D = 64 (session 15): dense calls with seqused_k
    # and the layouts neither persistent kernel takes stay on fwd.py's. persistent_varlen:
    # RESULTS.md 2026-12-04 session 34, call 2 (bench_varlen --dim 64, 16k causal tokens, H = 16):
    # 0.257 against fwd.py's 0.282 ms on documents of 64-4k, 0.346 / 0.403 on 4 x 4k, 0.147 /
    # 0.145 on 16 x 1k; the dense key splits it brings (bench_serving --dim 64, 8 / 2
    # heads): 1 x 512 rows on 64k keys 3.63x, 1 x 1024 on 32k 1.87x, 2 x 512 on 16k (no
    # split) 1.00x. q_bufs (two Q buffers in the persistent kernel: the next item's Q loads
    # during this one): RESULTS.md 2026-12-04 session 35, calls 3-4 (bench_fwd --sm90-short
    # --short-dim 64, H = 32, S = 1k-16k twice): full 1k +3-4% in all four passes (392 /
    # 389 -> 409 / 406, 393 / 391 -> 404 / 404 with ping-pong), mean +1%; causal +0.4%,
    # level at 1k. At D = 128 (not taken): full +2%, causal 1k -2 / -5%.
    # consumers = 3 (the persistent kernel's items 192 rows on three consumer warpgroups):
    # RESULTS.md 2026-12-04 session 38, call 3 (B*S = 16k, H = 32, in turn with two
    # consumers and cuDNN): causal 1k / 2k / 4k / 8k +3.8 / +4.7 / +8.3 / +8.2%, full +2.1 /
    # +9.5 / +12.3 / +14.1%; 0.81 / 0.99 / 1.05 / 1.05x cuDNN causal, 0.98 / 1.04 / 1.05 /
    # 1.08x full (two consumers 0.78-0.97x). Call 2's form without each part's own key
    # tiles lost 14% / 8% at causal 1k / 2k; on 64-key tiles, overlapped, it lost 2-18%.
    # varlen_consumers = 3: RESULTS.md 2026-12-05 session 42, call 1 (bench_varlen --dim 64,
    # 16k causal tokens, H = 16, in turn with two): documents of 229-3710 tokens 0.238 /
    # 0.255 ms (+7%), 4 x 4k 0.329 / 0.360 (+9%).
    64: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, pingpong=False,
                   overlap=True, persistent=True, persistent_table=True, persistent_varlen=True,
                   grid=False, consumer_regs=240, q_bufs=2, consumers=3, varlen_consumers=3),
    # persistent_varlen: RESULTS.md 2026-12-02 session 17 (bench_varlen, 16k tokens in causal
    # documents of 64-4k, same process): 0.355-0.362 ms against the grid kernel's 0.404 at
    # seed 0, 0.366-0.374 / 0.404 at seed 1, 0.346-0.355 / 0.387 at seed 3.
    128: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, pingpong=False,
                    overlap=True, persistent=True, persistent_table=True, persistent_varlen=True,
                    consumer_regs=240),
    # RESULTS.md 2026-12-02 session 15, "Hopper forward at D = 64 / 256": 1.18-1.30x fwd.py's
    # at S = 1k-16k, full and causal (529-681 TFLOP/s full, 0.87-1.02x cuDNN; causal 0.81-1.09x;
    # pass 2 of S = 8k full 0.95x). Persistent (out staged in Q's buffer) with the table:
    # "Session 16, call 1" (against the grid kernel, two passes: full 1k +6 / +9%, 2k +2 / +3%,
    # 4k +1 / -3%, 8k 0 / +4%, 16k -1 / -1%; causal 1k +24 / +26%, 2k +18 / +14%, 4k +9 / +20%,
    # 8k +10 / -4%, 16k -2 / -2%). persistent_varlen: RESULTS.md 2026-12-04 session 34, call
    # 1 (bench_varlen --dim 256, H = 16): 0.698 against the grid kernel's 0.709 ms on
    # documents of 64-4k, 0.916 / 0.975 on 4 x 4k; the dense key splits (bench_serving
    # --dim 256, 8 / 2 heads): 1 x 512 rows on 64k keys 3.59x, 1 x 1024 on 32k 1.63x.
    # 3 stages spill and need 263 KB; BLOCK_N 128 at 1 stage spills 536 bytes.
    256: TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, pingpong=False,
                    overlap=True, persistent=True, persistent_table=True, persistent_varlen=True,
                    consumer_regs=240),
}


# --- bwd.py: the portable backward --------------------------------------------------------
#
# dK/dV keeps two [block_n, D] float32 accumulators in registers, dQ one [block_m, D].
# EARLY_DP is on up to head dim 128 (RESULTS.md 2026-11-29, session 2, "bwd sweep" D=128
# S=8192 B=2 H=16: + EARLY_DP 375 / 352 against 369 / 340; D=64: EARLY_DP off 243 / 226
# against 251 / 235). HEAD_LOOP is on above 128 (RESULTS.md 2026-11-29, "More experiments",
# "D=256 group-wide loop against the head loop": G=4 flat 215 / 237, head loop 261 / 269).
BWD_DKDV = {
    # Not measured (no D=32 row): D=64's tile.
    32: TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=64 S=8192 B=2 H=32: the defaults
    # against dK/dV 128x128/8w/2st (251 / 235 against 218 / 194).
    64: TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=128 S=8192 B=2 H=16 (64x128 343 / 310
    # against the old 64x64 205 / 195), then session 3, "dK/dV stages with lse/delta by TMA"
    # D=128 S=8k / 4k: 3 stages 415 / 392, 393 / 353 against 2 stages 394 / 381, 378 / 337.
    128: TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=256 S=8192 B=2 H=8: the defaults
    # (153 / 154) against dK/dV 32x64/8w/2st (134 / 142).
    256: TileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
}
# Varlen keeps the 2-stage tile of RESULTS.md 2026-11-29, session 3, "lse/delta by masked
# pointer loads (old)" (D=128 B*S=16k H=16: 369 / 346, 359 / 315), chosen when varlen read
# lse and delta by pointer loads (a third stage then spilled: NOTES.md backward #10). Since
# session 20 their rows start 16-byte aligned and come by TMA (stats_offset); the sm_90
# compile of 3 stages then has the 2-stage stack (136 bytes with every flag), not measured.
BWD_DKDV_VARLEN = {**BWD_DKDV, 128: TileConfig(block_m=64, block_n=128, num_warps=8,
                                                 num_stages=2)}
BWD_DQ = {
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=64: "defaults (dQ 128x128/3st)" before
    # the D=64 change; D=32 keeps that tile (not measured at D=32).
    32: TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=64 S=8192 B=2 H=32: dQ 128x64/8w/3st
    # 265 / 249 against 251 / 235 ("dQ 128x64/3st kept (+6%)").
    64: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=128 S=8192 B=2 H=16: "+ dQ 128x64/3st
    # 369 / 340" (kept), and the second run's dQ 64x64 / 64x128 lost (364 / 338, 348 / 308).
    128: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    # RESULTS.md 2026-11-29, session 2, bwd sweep D=256 S=8192 B=2 H=8: dQ 128x32/8w/2st
    # 226 / 224 against 153 / 154 ("dQ 128x32 kept (+48%)").
    256: TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
}
_BWD_INTERPRET = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
# Candidates for triton.autotune under KernelOptions.autotune_bwd (bench_bwd.py --autotune
# prints the pick; the first call of each key then compiles and times every candidate).
BWD_DKDV_TUNE = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 3)]
BWD_DQ_TUNE = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 8, 2)]
# The preprocess (D and lse_log2): 32 rows keep the int64 pointer tiles of a D = 128 row
# block in registers; memory-bound either way (no RESULTS.md row measured other sizes).
BWD_PREPROCESS = TileConfig(block_m=32, num_warps=4)


@functools.lru_cache(maxsize=64)
def bwd_configs(key_d: int, varlen: bool, interpret: bool) -> tuple[TileConfig, TileConfig]:
    """``(dK/dV, dQ)`` tiles of the portable backward at padded head dim ``key_d`` (the
    wider of D and Dv), with EARLY_DP and HEAD_LOOP by the head dim (the rules above)."""
    key = min(max(key_d, 32), 256)
    if interpret:
        dkdv = dq = _BWD_INTERPRET
    else:
        dkdv = (BWD_DKDV_VARLEN if varlen else BWD_DKDV)[key]
        dq = BWD_DQ[key]
    flags = dict(early_dp=key_d <= 128)
    return (dataclasses.replace(dkdv, head_loop=key_d > 128, **flags),
            dataclasses.replace(dq, **flags))


# --- bwd_sm90.py: the Hopper Gluon dK/dV and dQ ---------------------------------------------
#
# dK/dV: block_n is the kernel's (two 64-key halves), block_m the Q/dO tile of its ring.
# RESULTS.md 2026-11-29, "bench_bwd.py 2026-11-29" session 6, the per-kernel device time
# table: "Gluon dK/dV (lse/delta by TMA)" against "(lse/delta by pointer)" (S=8k full 3.406
# against 3.851 ms), and the session-6 bwd bf16 D=128 rows measured with this config.
# EARLY_DP off here: not measured on (the compile test builds both).
BWD_SM90_DKDV = TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=2, early_dp=False,
                           stats_tma=True, consumer_regs=240)
# The dK/dV kernel's head dims (D == Dv). D = 64: RESULTS.md 2026-12-02 session 15,
# "Hopper forward at D = 64 / 256", bwd rows: 0.99-1.04x bwd.py's kernel (S = 1k-16k).
# D = 256 (the role split, bwd_sm90.ROLE_SPLIT): RESULTS.md 2026-12-04 session 33, fwd+bwd
# 1.53-1.76x bwd.py's dK/dV in turn, S = 1k-16k.
BWD_SM90_DKDV_DIMS = (64, 128, 256)
# dQ per head dim; block_m is the kernel's (two 64-row halves).
BWD_SM90_DQ = {
    # RESULTS.md 2026-11-29, session 6, per-kernel device time: "Gluon dQ BN=128" against
    # "BN=64" (S=8k full 2.138 against 2.236 ms).
    128: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, consumer_regs=240),
    # RESULTS.md 2026-11-29, "bench_bwd.py 2026-11-29 (Gluon dQ at head dims 64 and 256)":
    # D=256 Gluon / bwd.py 1.08-1.12 ("shipped Gluon"). A [64, 256] float32 dQ is 128
    # registers a thread and Q, dO take 128 KB of shared memory: the K/V ring holds 32-key
    # tiles. D=64 (0.91-1.00 there) is not in the domain.
    256: TileConfig(block_m=128, block_n=32, num_warps=4, num_stages=2, consumer_regs=240),
}


# --- decode.py: split-KV decode and the append --------------------------------------------


@functools.lru_cache(maxsize=256)
def decode_config(d1: int, d2: int, dv: int, rows: int, interpret: bool) -> TileConfig:
    """The split-KV decode kernel's tiles; they depend on head dims and rows only (never on
    paging), so that paged and contiguous caches run the same arithmetic; so do their
    pipelines since the kernel looks a paged tile's pages up one tile ahead (the sm_90 compile
    of both keeps num_stages - 1 K/V tiles in flight, NOTES.md session 10; before, the
    page-table load took stages of its own and ``num_stages_paged`` was 7 here, 3 for MLA).
    Cached: the decode step asks every call."""
    block_m = max(16, min(64, next_pow2(rows)))
    if interpret:
        return TileConfig(block_m=block_m, block_n=32, num_warps=4, num_stages=1,
                          programs_per_sm=1)
    if d1 + d2 > 256:
        # MLA-sized rows: a [64, 576] bf16 K tile is 72 KB; two stages and Q fill shared
        # memory (one program per SM), and the group's [64, 512] fp32 accumulator takes
        # 128 registers a thread over 8 warps. RESULTS.md 2026-11-29, first table, "decode
        # bf16 GB/s (latent bytes / time)" MLA B=64 Skv=8192 Hq=128 D=576 Dv=512 (1134).
        return TileConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, programs_per_sm=1)
    if d1 + d2 + dv > 256:
        # Head dims above 128 (K and V over 256 wide): 32-key tiles, four programs per SM.
        # Not measured: no RESULTS.md row has a decode at D > 128 other than MLA.
        return TileConfig(block_m=block_m, block_n=32, num_warps=4, num_stages=4,
                          programs_per_sm=4)
    # Three [64, D] K and V tiles in flight (104 KB for D = 128), two programs resident per
    # SM, and the split count fills exactly those: one full wave. RESULTS.md 2026-11-29,
    # session 2, "decode split sweep, graph-replayed GB/s" B=1 Skv=131072 (33 splits 3714,
    # 57 3397; 3 stages 33: 3744; BLOCK_N 128 33: 3719) and B=8 Skv=32768 (4: 4173, 8: 4168).
    return TileConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=4, programs_per_sm=2)


# decode_mla_sm90.py, the Hopper MLA decode: its tiles are the kernel's own (64 rows, 64 keys,
# two warpgroups); programs_per_sm sizes the split count (222 KB of shared memory a program).
# Not yet measured against other schedules.
DECODE_MLA_SM90 = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=1,
                             programs_per_sm=1)


def append_kv_config(s_new: int) -> TileConfig:
    """The k_new append: up to 16 new keys a program (a copy; no RESULTS.md row measured it)."""
    return TileConfig(block_m=min(16, next_pow2(s_new)), num_warps=4)


# --- combine.py: the merge of states (merge_states and the split-KV combine) -----------------


@functools.lru_cache(maxsize=1024)
def merge_config(n: int, r: int, d: int, alias: bool, sms: int) -> TileConfig:
    """``block_m`` rows, ``block_n`` states per unrolled step and ``block_d`` columns a
    program, ``num_warps``; cached: the decode combine asks every step.

    A program covers whole rows of up to 512 columns. Split into 128-column programs, a
    D = 512 row is read as 256-byte pieces in four separate sweeps over memory (RESULTS.md
    2026-11-29, session 2, "merge_states bf16 GB/s, whole-row tiles" N=2/4/8 D=512: 3393 /
    3584 / 3848 against the old tiles' N=4 3406, N=8 3449; D=128 3387 / 3466 / 3591). Only
    few rows (the split-KV combine) split D, down to 32 columns, and only when no output
    aliases lses: the program that writes lse must be the last reader of its rows' lses.
    Tiles of about 8192 values keep 16-32 KB of bf16 states in flight.
    """
    block_d = next_pow2(max(d, 1))
    if not alias:
        block_d = min(block_d, 512)
    block_s = min(next_pow2(max(n, 1)), 8)
    block_r = max(1, 8192 // (min(block_s, 4) * block_d))
    # Small merges (the split-KV combine of a few rows) need many programs, not big ones.
    target = 2 * sms
    while block_r > 1 and cdiv(r, block_r) < target:
        block_r //= 2
    while not alias and block_d > 32 and cdiv(r, block_r) * cdiv(d, block_d) < target:
        block_d //= 2
    num_warps = max(1, min(4, block_r * block_d // 512))
    # Each state step is one memory latency; a small tile has registers for more states
    # per step (up to 64 values a thread): 57 splits of a [1, 32] tile take two steps.
    per_state = max(1, block_r * block_d // (32 * num_warps))
    block_s = min(next_pow2(max(n, 1)), max(block_s, min(32, 64 // per_state)))
    return TileConfig(block_m=block_r, block_n=block_s, block_d=block_d, num_warps=num_warps)


# --- sparse.py: the sparse top-k backward ---------------------------------------------------


def sparse_bwd_config(group: int) -> TileConfig:
    """The group's query heads padded to 16 rows (a ``tl.dot`` needs 16), 32 listed keys a
    tile, 4 warps. No RESULTS.md row measured other tiles (the 2026-12-01 overhead table's
    sparse_attention row times the forward)."""
    return TileConfig(block_m=max(16, next_pow2(group)), block_n=32, num_warps=4)
