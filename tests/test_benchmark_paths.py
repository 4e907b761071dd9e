"""Benchmark scripts put the repository root last on ``sys.path``, never first: an A/B run
in turns (``benchmarks/h200_session.sh``'s ``in_turn``) selects the earlier tree's package
with ``PYTHONPATH=.before``, which a root inserted at the front would override, so both
sides would time this tree (session 25's first call did, through bench_overhead.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# sys.path.insert(0, <the folder above the script's>): "..", parents[1], dirname(dirname(..)).
_ROOT_FIRST = re.compile(r"sys\.path\.insert\(\s*0\s*,[^\n]*(\"\.\.\"|parents\[1\]|"
                         r"dirname\(os\.path\.dirname\()")


def _bench_common():
    """``benchmarks/_common.py`` as the scripts import it (their folder on the path)."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("_common")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_benchmarks_put_the_repo_root_last():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert scripts
    bad = [f"{p.name}: {m.group(0)}" for p in scripts
           for m in _ROOT_FIRST.finditer(p.read_text())]
    assert not bad, "insert the repo root with sys.path.append, not at the front:\n" + \
        "\n".join(bad)


def test_flag_runs_switch_the_flag_and_drop_every_plan_it_shapes():
    """``_common.flag_runs`` (the in-process A/Bs: ab_bwd_switch, ab_fwd_switch, profile_host
    --ab): each side sets its value and, when the value changes, drops the plans a flag can
    shape (the backward's, the Hopper forward's, the decode's, the launches the public calls
    keep), so neither side runs a plan the other made, and returns what the timed function
    returns; ``restore`` puts the original back."""
    import importlib

    pytest.importorskip("flashlse.kernels.fwd_sm90")
    bwd_sm90 = pytest.importorskip("flashlse.kernels.bwd_sm90")
    common = _bench_common()
    from flashlse.kernels import bwd, decode, fwd_sm90

    ops = importlib.import_module("flashlse.ops.attention")
    kv_ops = importlib.import_module("flashlse.ops.kvcache")
    sparse_ops = importlib.import_module("flashlse.ops.sparse")
    caches = (bwd._BWD_PLANS, fwd_sm90._PLANS, decode._PLANS, ops._KEPT, ops._PAGED_KEPT,
              kv_ops._KEPT, kv_ops._CHUNK_KEPT, sparse_ops._PLANS)
    original = bwd_sm90.FUSED_DQ
    assert original is True  # (the test's sides: on leaves it, off changes it)
    seen = []
    on, off, restore = common.flag_runs("bwd_sm90.FUSED_DQ",
                                         lambda: seen.append(bwd_sm90.FUSED_DQ))
    try:
        for value, side in ((False, off), (True, on)):
            for cache in caches:
                cache["planned before"] = None
            assert side() is None and seen[-1] is value and not any(caches)
        for cache in caches:
            cache["planned before"] = None
        on()  # no change: the plans stay
        assert seen[-1] is True and all("planned before" in c for c in caches)
    finally:
        restore()
        for cache in caches:
            cache.pop("planned before", None)
    assert bwd_sm90.FUSED_DQ == original


def test_flag_ab_ms_times_on_off_and_peers_and_puts_the_flag_back():
    """``_common.flag_ab_ms`` (the A/B scripts' timing): the flag on, then off, then each
    peer, timed in turn; the original value back afterwards, also when a side raises."""

    bwd_sm90 = pytest.importorskip("flashlse.kernels.bwd_sm90")
    common = _bench_common()
    seen = []
    times = common.flag_ab_ms("bwd_sm90.FUSED_DQ", lambda: seen.append(bwd_sm90.FUSED_DQ),
                              [lambda: seen.append("peer")], smoke=True)
    assert len(times) == 3 and seen == [True, False, "peer"] and bwd_sm90.FUSED_DQ is True

    def boom():  # the off side fails, with the flag switched
        if not bwd_sm90.FUSED_DQ:
            raise RuntimeError("side failed")

    with pytest.raises(RuntimeError):
        common.flag_ab_ms("bwd_sm90.FUSED_DQ", boom, smoke=True)
    assert bwd_sm90.FUSED_DQ is True


def test_sweep3_runs_the_variants_in_turns_and_reports_each(tmp_path, monkeypatch):
    """``bench_fwd.sweep3`` (the A/B sweeps of ``--sm90-short``): within each pass every
    variant takes its turn before the next pass starts (a drift falls on all alike), each
    variant's line carries its own runs in order, and a variant that raises is reported
    failed and not retried."""
    import importlib
    import json
    import sys

    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench_fwd = importlib.import_module("bench_fwd")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    order, clock = [], iter(range(1, 1000))
    monkeypatch.setattr(bench_fwd, "bf16_inputs", lambda b, sq, sk, h, d: (sq, sk, h))
    monkeypatch.setattr(bench_fwd, "attn_flops", lambda *a: 1e9)

    def ours(q, k, v, causal):
        from flashlse.kernels.options import current

        cfg = current().fwd_sm90_config
        if cfg.get("OVERLAP"):
            raise RuntimeError("does not compile")
        order.append((cfg.get("STAGES"), q))
        return None

    monkeypatch.setattr(bench_fwd, "_ours", ours)
    monkeypatch.setattr(bench_fwd, "median_ms", lambda fn: next(clock))
    bench_fwd.sweep3(str(tmp_path), seqs=(64, 128), repeats=2, option="fwd_sm90_config",
                     variants=[{}, {"STAGES": 1}, {"OVERLAP": True}], tag="t", d=64)
    # Per causal: pass 1 (shipped 64, 128; STAGES 64, 128), then pass 2 in the same order.
    one_pass = [(None, 64), (None, 128), (1, 64), (1, 128)]
    assert order == one_pass * 4
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    shipped, x, bad = rows[:3]
    assert shipped["cfg"] == "shipped" and x["cfg"] == "STAGES=1" and "FAILED" in bad["cfg"]
    # Timings 1, 2 went to shipped, 3, 4 to STAGES=1, then 5, 6 / 7, 8 in pass 2.
    assert shipped["tflops"] == [1e9 / ms * 1e-9 for ms in (1, 2, 5, 6)]
    assert x["tflops"] == [1e9 / ms * 1e-9 for ms in (3, 4, 7, 8)]
    assert len(bad["tflops"]) == 1 and bad["mean"] != bad["mean"]
