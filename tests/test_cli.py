"""``python -m flashlse audit`` on the CPU: flashlse's cells meet the contract, and the
audit can tell a broken merge from a correct one."""

import contextlib
import io
import json
import math

import pytest
import torch

from flashlse import audit, cli
from flashlse.audit import report as audit_report

# The pure-PyTorch rows run in this process; the native kernels' child processes are
# tested once below (each child pays for importing torch).
ROWS = ("flashlse", "flashlse kvcache", "sdpa math", "merge sigmoid", "merge naive")


@pytest.fixture(scope="module")
def report():
    buf = io.StringIO()
    argv = ["audit", "--json", "--device", "cpu"]
    for row in ROWS:
        argv += ["--backend", row]
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    rep = json.loads(buf.getvalue())
    rep["rc"] = rc
    return rep


def _cells(rep, backend):
    return {c["case"]: c for c in rep["cells"] if c["backend"] == backend}


def test_audit_exit_code_and_shape(report):
    assert report["rc"] == 0, report["violations"]
    assert report["violations"] == []
    names = [b["name"] for b in report["backends"]]
    assert names == list(ROWS)
    assert len(report["cells"]) == len(names) * len(audit.CASES)


@pytest.mark.parametrize("backend", ["flashlse", "flashlse kvcache"])
def test_flashlse_cells_meet_the_contract(report, backend):
    for case_id, cell in _cells(report, backend).items():
        if cell["status"] == "skip":
            continue
        assert cell["status"] == "ok", cell
        assert (cell["out"], cell["lse"]) == audit.expected(case_id), cell
        # merge +inf: the input state is converted from fa2 first, as for every merge.
        want_conv = "fa2" if case_id == "merge_inf" else None
        assert cell["merge"] is True and cell["conv"] == want_conv, cell


def test_flashlse_covers_every_case(report):
    assert {c for c, cell in _cells(report, "flashlse").items()
            if cell["status"] == "ok"} == {c[0] for c in audit.CASES}


def test_sigmoid_merge_of_two_empty_states_is_nan(report):
    cell = _cells(report, "merge sigmoid")["merge_empty"]
    assert (cell["out"], cell["lse"]) == ("NaN", "NaN"), cell
    # An fa2 +inf state swallows the non-empty one: the merge check must fail.
    assert _cells(report, "merge sigmoid")["merge_inf"]["merge"] is False
    # The naive merge is exact once its input is converted, the same conversion flashlse gets.
    naive = _cells(report, "merge naive")
    assert naive["merge_inf"]["merge"] is True and naive["merge_inf"]["conv"] == "fa2"
    # Its two empty states give NaN out: NaN never passes.
    assert naive["merge_empty"]["out"] == "NaN" and naive["merge_empty"]["verdict"] == "fail"


def test_nan_never_passes_and_verdict_matches_the_mark(report):
    for cell in report["cells"]:
        if cell["status"] != "ok" or cell.get("verdict") is None:
            continue
        assert cell["verdict"] == ("pass" if "✓" in cell["text"] else "fail"), cell
        if "NaN" in (cell["out"],):
            assert cell["verdict"] == "fail", cell
    assert "violations" in report["fields"] and "cells[].verdict" in report["fields"]


def test_table_renders(report):
    text = audit.format_table(report)
    assert "flashlse" in text and "0/-inf ✓" in text and "NaN/NaN" in text
    assert "cell = out/lse" in text


def test_judge_rejects_foreign_empty_rows_without_conversion():
    c = audit.make_case("causal", "cpu")
    out, lse = c["ref"][0].transpose(1, 2).float(), c["ref"][1].float()
    for bad, kind in ((0.0, "0"), (math.inf, "+inf")):
        cell = audit.judge("x", c, out, lse.masked_fill(c["empty"], bad), None)
        assert cell["lse"] == kind and cell["merge"] is False
        fixed = audit.judge("x", c, out, lse.masked_fill(c["empty"], bad),
                          "sdpa_efficient" if bad == 0 else "fa2")
        assert fixed["merge"] is True and fixed["conv"] in ("eff", "fa2")
    nan_out = out.masked_fill(c["empty"].transpose(1, 2).unsqueeze(-1), math.nan)
    assert audit.judge("x", c, nan_out, lse, None)["out"] == "NaN"


def test_broken_flashlse_is_a_violation(monkeypatch):
    def broken(c):
        if c["id"] != "merge_empty":
            raise audit.NotApplicable("skipped in this test")
        return (*audit.merge_sigmoid(*c["a"], *c["b"]), None)

    monkeypatch.setitem(audit.RUNNERS, "flashlse", broken)
    rep = audit.audit("cpu", backends=["flashlse"])
    assert [v.split(":")[0] for v in rep["violations"]] == ["flashlse / merge_empty"]


def test_demo_and_bench_run(capsys):
    assert cli.main(["demo"]) == 0
    assert cli.main(["bench"]) == 0
    text = capsys.readouterr().out
    assert "nan" in text and "-inf" in text


def test_worker_reports_cells(capsys):
    assert cli.main(["_worker", "merge naive", "cpu", "merge_empty"]) == 0
    line = capsys.readouterr().out.strip()
    cell = json.loads(line[len(audit.WORKER_MARK):])
    assert cell["out"] == "NaN" and cell["lse"] == "-inf"
    assert torch.isnan(audit.merge_naive(torch.zeros(1, 2), torch.tensor([-math.inf]),
                                       torch.zeros(1, 2), torch.tensor([-math.inf]))[0]).all()


def test_a_crashing_peer_costs_one_cell():
    # torch's CPU flash kernel dies with SIGFPE on Sk = 0 (torch 2.13): the cell says so.
    cells = audit_report._run_isolated("sdpa flash-cpu", "cpu", ["causal", "sk0"], timeout=50)
    assert cells["causal"]["text"] == "0/0 ✓(eff)"
    assert cells["sk0"]["status"] in ("crash", "ok", "error")


def test_help_is_plain_text_and_version_prints(capsys):
    for argv in (["--help"], ["audit", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        assert "``" not in text and len(text.split()) > 20, text
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("flashlse ")
