"""The CPU path's use of torch's CPU flash attention (``ops.attention._sdpa_parts``): the calls
it takes (no empty row: full, causal, windows, sinks) give the reference's out, lse and
gradients, in as many calls of torch's kernel as planned; every other call (empty rows,
softcap, zero sizes, an lse gradient, NaN or inf inputs, a NaN dout) takes the loops, and
NaN propagates as the contract says."""

import importlib

import pytest
import torch
from _flashlse_testing import assert_close_to_ref, check_against_reference, rand

import flashlse as fl
from flashlse import reference as R

attn_mod = importlib.import_module("flashlse.ops.attention")


@pytest.fixture
def routed(monkeypatch):
    """Counts the forward and backward calls of torch's CPU flash attention."""
    calls = {"fwd": 0, "bwd": 0}

    def counted(name, op):
        def run(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        return run

    monkeypatch.setattr(attn_mod, "_SDPA_CPU_FWD", counted("fwd", attn_mod._SDPA_CPU_FWD))
    monkeypatch.setattr(attn_mod, "_SDPA_CPU_BWD", counted("bwd", attn_mod._SDPA_CPU_BWD))
    return calls


def _check(q, k, v, kw, sink=None):
    """Ours against the float64 reference (and, in fp16 / bf16, the reference in that dtype
    as the baseline): out, lse, dq, dk, dv and dsink of a loss on out alone (the backward
    gets no lse gradient), and the outputs' layouts."""
    diff = dict(q=q, k=k, v=v) if sink is None else dict(q=q, k=k, v=v, sink=sink)
    out, lse, grads = check_against_reference(fl.attention, R.attention, diff,
                                              dict(kw, return_lse=True), lse_grad=False)
    assert out.is_contiguous() and lse.is_contiguous()
    assert all(g.is_contiguous() for g in grads.values())


# (B, Sq, Sk, Hq, Hkv, D, keywords (and dv), calls of torch's kernel a pass)
C = dict(causal=True)
TAKEN = [
    pytest.param(2, 37, 37, 4, 4, 32, {}, 1, id="full"),
    pytest.param(2, 37, 37, 4, 2, 32, C, 1, id="causal_gqa"),
    pytest.param(1, 9, 70, 4, 1, 59, {}, 1, id="full_sq_lt_sk_mqa_d59"),
    pytest.param(1, 70, 9, 2, 2, 16, {}, 1, id="full_sq_gt_sk"),
    pytest.param(1, 300, 300, 2, 1, 64, C, 1, id="causal_two_blocks"),
    pytest.param(1, 1, 1, 1, 1, 128, C, 1, id="one_row"),
    pytest.param(2, 1, 45, 8, 2, 64, C, 1, id="decode_causal_sees_all"),
    pytest.param(1, 4, 45, 2, 1, 32, dict(window=(44, 3)), 1, id="window_covers_all"),
    # Causal with Sq < Sk: the keys every row sees, then the causal square.
    pytest.param(2, 19, 50, 4, 2, 32, C, 2, id="causal_sq_lt_sk"),
    pytest.param(1, 33, 33, 4, 2, 32, dict(C, sink=True), 1, id="causal_sink"),
    pytest.param(1, 7, 40, 2, 2, 64, dict(C, sink=True), 2, id="causal_sq_lt_sk_sink"),
    # Windows: query blocks of 64-256 rows, each with its additive mask.
    pytest.param(1, 300, 300, 4, 2, 32, dict(window=(127, 0)), 3, id="window_127_three_blocks"),
    pytest.param(1, 12, 12, 2, 2, 16, dict(window=(3, 2)), 1, id="window_3_2"),
    pytest.param(1, 12, 12, 2, 2, 16, dict(C, window=(3, None)), 1, id="causal_window_3"),
    pytest.param(1, 12, 12, 2, 2, 16, dict(window=(None, 2)), 1, id="window_right_2"),
    pytest.param(1, 4, 45, 2, 1, 32, dict(window=(43, 3)), 1, id="window_cuts_one_key"),
    pytest.param(1, 4, 45, 2, 1, 32, dict(window=(44, 2)), 1, id="window_cuts_one_key_right"),
    pytest.param(2, 100, 300, 4, 1, 32, dict(window=(50, 0), sink=True), 2,
                 id="chunk_window_sink"),
    # Dv != D: the narrower padded with zero columns (MLA's prefill shape, and the other way).
    pytest.param(1, 40, 40, 4, 2, 48, dict(C, dv=32), 1, id="d48_dv32_causal"),
    pytest.param(1, 20, 30, 2, 2, 16, dict(window=(6, 0), dv=24, sink=True), 1,
                 id="d16_dv24_window_sink"),
    # One block on the last keys only (a sliding-window layer's decode or short chunk).
    pytest.param(1, 4, 45, 2, 1, 32, dict(window=(3, 0)), 1, id="window_last_keys"),
    pytest.param(2, 1, 300, 8, 2, 64, dict(window=(127, 0)), 1, id="window_decode"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64], ids=str)
@pytest.mark.parametrize("route", [True, False], ids=["sdpa", "loops"])
@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, kw, n", TAKEN)
def test_sdpa_cpu_taken_matches_reference(routed, monkeypatch, b, sq, sk, hq, hkv, d, kw, n,
                                          dtype, route):
    # The loops (SDPA_CPU off) must stay exact on the calls the route takes from them.
    monkeypatch.setattr(attn_mod, "SDPA_CPU", route)
    kw = dict(kw)
    dv = kw.pop("dv", d)
    q, k, v = (rand(b, s, h, dim, dtype=dtype)
               for s, h, dim in ((sq, hq, d), (sk, hkv, d), (sk, hkv, dv)))
    sink = rand(hq, dtype=torch.float64 if dtype == torch.float64 else torch.float32) \
        if kw.pop("sink", False) else None
    _check(q, k, v, kw, sink)
    n = n if route else 0
    assert routed == {"fwd": 2 * n, "bwd": n}  # (the check runs the forward twice)


# (case: whether its parts carry a window's mask, whose backwards run float32)
NATIVE_CASES = {"decode_causal_sees_all": False, "causal_sq_lt_sk": False,
                "window_127_three_blocks": True, "chunk_window_sink": True,
                "d48_dv32_causal": False, "causal_sink": False}


@pytest.mark.parametrize("native", [True, False], ids=["native", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, kw, n, masked",
                         [pytest.param(*c.values, NATIVE_CASES[c.id], id=c.id)
                          for c in TAKEN if c.id in NATIVE_CASES])
def test_sdpa_cpu_compute_dtype(monkeypatch, b, sq, sk, hq, hkv, d, kw, n, masked, dtype,
                                native):
    # bf16 / fp16 forwards (and bf16 backwards of unmasked parts) run torch's kernel in the
    # dtype where the CPU multiplies it natively (NATIVE_CPU_DTYPES, NATIVE_CPU_BWD; forced
    # both ways here, fp16 backwards too: emulated products are slow, not wrong), else in
    # float32; both forms, merges and sums of several parts and a sink included, match the
    # reference.
    seen = []

    def spy(op):
        def run(q, *args, **kwargs):
            seen.append(q.dtype)
            return op(q, *args, **kwargs)
        return run

    monkeypatch.setattr(attn_mod, "NATIVE_CPU_DTYPES", frozenset({dtype} if native else ()))
    monkeypatch.setattr(attn_mod, "NATIVE_CPU_BWD", frozenset({dtype} if native else ()))
    monkeypatch.setattr(attn_mod, "NATIVE_BWD_MIN", 0)  # (these shapes are below it)
    monkeypatch.setattr(attn_mod, "_SDPA_CPU_FWD", spy(attn_mod._SDPA_CPU_FWD))
    monkeypatch.setattr(attn_mod, "_SDPA_CPU_BWD", spy(attn_mod._SDPA_CPU_BWD))
    kw = dict(kw)
    dv = kw.pop("dv", d)
    q, k, v = (rand(b, s, h, dim, dtype=dtype)
               for s, h, dim in ((sq, hq, d), (sk, hkv, d), (sk, hkv, dv)))
    sink = rand(hq) if kw.pop("sink", False) else None
    _check(q, k, v, kw, sink)
    run_dtype = dtype if native else torch.float32
    bwd_dtype = torch.float32 if masked else run_dtype
    assert seen == [run_dtype] * (2 * n) + [bwd_dtype] * n


@pytest.mark.parametrize("s, d, native", [(128, 64, False), (256, 64, True), (64, 128, False),
                                          (128, 128, True)])
def test_sdpa_cpu_native_backward_lengths(monkeypatch, s, d, native):
    # bf16 backwards in bf16 from NATIVE_BWD_MIN rows and keys x head width (D = 64: 256 rows;
    # shorter ones ran 1.5-2.4x slower in bf16 than in float32).
    seen = []
    op = attn_mod._SDPA_CPU_BWD

    def spy(*args, **kwargs):
        seen.append(args[1].dtype)
        return op(*args, **kwargs)

    monkeypatch.setattr(attn_mod, "NATIVE_CPU_BWD", frozenset({torch.bfloat16}))
    monkeypatch.setattr(attn_mod, "_SDPA_CPU_BWD", spy)
    q, k, v = (rand(1, s, 2, d, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    fl.attention(q, k, v, causal=True).sum().backward()
    assert seen == [torch.bfloat16 if native else torch.float32]


def test_sdpa_cpu_finite_check():
    # The route's test of its inputs: any NaN or inf sends a call to the loops, in every
    # dtype; a finite fp16 tensor whose sum overflows float16 does not (min and max there).
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.full((4096, 8), 60000.0, dtype=dtype)
        assert attn_mod._finite(x), dtype
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[1234, 5] = bad
            assert not attn_mod._finite(y), (dtype, bad)
            assert not attn_mod._finite(y[1000:2000]), (dtype, bad)
    assert attn_mod._finite(torch.empty(0, 8, dtype=torch.float16))


def test_sdpa_cpu_window_masks_bounded(routed, monkeypatch):
    # A window's blocks carry masks of block x (block + width) elements: past TILE_ELEMS the
    # loops run the call.
    q, k, v = rand(1, 300, 2, 32), rand(1, 300, 2, 32), rand(1, 300, 2, 32)
    monkeypatch.setattr(attn_mod, "TILE_ELEMS", 128 * 255)
    _check(q, k, v, dict(window=(127, 0)))  # 128 x 256 elements: over
    assert routed == {"fwd": 0, "bwd": 0}
    monkeypatch.setattr(attn_mod, "TILE_ELEMS", 128 * 256)
    _check(q, k, v, dict(window=(127, 0)))
    assert routed == {"fwd": 6, "bwd": 3}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_cpu_varlen_sequences_taken(routed, causal):
    # attention_varlen's CPU path runs each sequence as a dense call: the non-empty ones
    # take the route (forward, and backward with lse slices of the packed lse), a sequence
    # without keys does not.
    cu_q = torch.tensor([0, 5, 5, 17, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 21, 21], dtype=torch.int32)
    inputs = (rand(20, 4, 32), rand(21, 2, 32), rand(21, 2, 32))
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, lse = fl.attention_varlen(*leaves, cu_q, cu_k, 12, 12, causal=causal, return_lse=True)
    dout = rand(*out.shape)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    ref_out, ref_lse = R.attention_varlen(*ref_leaves, cu_q, cu_k, 12, 12, causal=causal,
                                          return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert routed == {"fwd": 2, "bwd": 2}  # sequences 0 and 2 (1 has no rows, 3 no keys)
    for name, a, r in (("out", out, ref_out), ("lse", lse, ref_lse),
                       *zip(("dq", "dk", "dv"), grads, ref_grads)):
        assert_close_to_ref(a, r.detach(), name=name)
    assert torch.isneginf(lse[:, 17:]).all() and (out[17:] == 0).all()


@pytest.mark.parametrize("lse_grad", [False, True], ids=["out_loss", "lse_loss"])
@pytest.mark.parametrize("route", [True, False], ids=["sdpa", "loops"])
def test_varlen_cpu_runs_of_equal_sequences(routed, monkeypatch, route, lse_grad):
    # The CPU path runs consecutive sequences of equal lengths, back to back in the packed
    # rows, as one batched call (ops.attention._seq_runs; the backward's runs of at most
    # _BWD_RUN_ROWS rows): three of 8 rows (the backward: two runs of 8 rows at a cap of 16,
    # then one), one of 5 after a sequence with no rows, two whose keys are cut by seqused_k
    # (not back to back), then two more of 8; a sink; against the float64 reference.
    monkeypatch.setattr(attn_mod, "SDPA_CPU", route)
    monkeypatch.setattr(attn_mod, "_BWD_RUN_ROWS", 16)
    lq = [8, 8, 8, 0, 5, 6, 6, 8, 8]
    lk = [8, 8, 8, 3, 5, 9, 9, 8, 8]
    used = [8, 8, 8, 3, 5, 7, 7, 8, 8]
    cu_q = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0).to(torch.int32)
    seqused = torch.tensor(used, dtype=torch.int32)
    inputs = (rand(sum(lq), 4, 16), rand(sum(lk), 2, 16), rand(sum(lk), 2, 24),
              rand(4, dtype=torch.float32))
    runs = list(attn_mod._seq_runs(cu_q, cu_k, seqused))
    assert [r[2] for r in runs] == [3, 1, 1, 1, 2]
    kw = dict(causal=True, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out, lse = fl.attention_varlen(*leaves[:3], cu_q, cu_k, 8, 9, seqused_k=seqused,
                                   sink=leaves[3], **kw)
    dout, dlse = rand(*out.shape), rand(*lse.shape)
    loss = (out * dout).sum() + ((lse * dlse).sum() if lse_grad else 0)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    ref_out, ref_lse = R.attention_varlen(*ref_leaves[:3], cu_q, cu_k, 8, 9,
                                          seqused_k=seqused, sink=ref_leaves[3], **kw)
    ref_loss = (ref_out * dout.double()).sum() + (
        (ref_lse * dlse.double()).sum() if lse_grad else 0)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)
    for name, a, r in (("out", out, ref_out), ("lse", lse, ref_lse),
                       *zip(("dq", "dk", "dv", "dsink"), grads, ref_grads)):
        assert_close_to_ref(a, r.detach(), name=name)
    # Forward: 5 runs, 7 calls (the 6-row sequences' causal mask on 7 keys is two parts);
    # backward (a loss on out alone takes the route): 8 (the first run cut at 16 rows).
    assert routed == {"fwd": 7 * route, "bwd": 8 * (route and not lse_grad)}


@pytest.mark.parametrize("route", [True, False], ids=["sdpa", "loops"])
def test_varlen_cpu_runs_lse_contract(monkeypatch, route):
    # The LSE contract through batched runs: a run of sequences without keys gives out 0 and
    # lse == sink (a -inf sink: -inf, and no NaN in any gradient); a NaN key in the middle
    # sequence of a run of three reaches exactly the rows that see it, the run's other
    # sequences as in the clean call.
    monkeypatch.setattr(attn_mod, "SDPA_CPU", route)
    lq, lk = [4, 4, 4, 3, 3], [6, 6, 6, 0, 0]
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    q, k, v = rand(sum(lq), 2, 16), rand(sum(lk), 2, 16), rand(sum(lk), 2, 16)
    assert [r[2] for r in attn_mod._seq_runs(cu_q, cu_k, None)] == [3, 2]
    for sink in (rand(2, dtype=torch.float32), torch.full((2,), float("-inf"))):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        out, lse = fl.attention_varlen(*leaves[:3], cu_q, cu_k, 4, 6, causal=True,
                                       sink=leaves[3], return_lse=True)
        ref_out, ref_lse = R.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                              4, 6, causal=True, sink=sink.double(),
                                              return_lse=True)
        assert_close_to_ref(out, ref_out, name="out")
        assert_close_to_ref(lse, ref_lse, name="lse")
        assert (out[12:] == 0).all() and torch.equal(lse[:, 12:],
                                                     sink[:, None].expand(2, 6).float())
        grads = torch.autograd.grad(out.sum(), leaves)
        assert not any(g.isnan().any() for g in grads)
    # Sequence 1's key 2 (rows 1..3 of that sequence see it, causal bottom-right on 6 keys).
    k_bad = k.clone()
    k_bad[6 + 2, 0, 0] = float("nan")
    clean = fl.attention_varlen(q, k, v, cu_q, cu_k, 4, 6, causal=True, return_lse=True)
    bad = fl.attention_varlen(q, k_bad, v, cu_q, cu_k, 4, 6, causal=True, return_lse=True)
    ref = R.attention_varlen(q.double(), k_bad.double(), v.double(), cu_q, cu_k, 4, 6,
                             causal=True, return_lse=True)
    for got, want in zip(bad, ref):
        assert torch.equal(got.isnan(), want.isnan())
    rows = torch.zeros(sum(lq), dtype=torch.bool)
    rows[4:8] = True  # sequence 1's rows: row 0 sees keys 0..2 (shift 2), so all four
    assert bad[0][rows, 0].isnan().all() and bad[1][0, rows].isnan().all()  # (kv head 0)
    assert not bad[0][rows, 1].isnan().any() and not bad[0][~rows].isnan().any()
    # (The NaN sends the run to the loops, so the clean rows match the reference, not the
    # clean call's bits.)
    assert_close_to_ref(bad[0][~rows], ref[0][~rows], name="rows that do not see the NaN")
    assert_close_to_ref(bad[0][~rows], clean[0][~rows].double(), name="against the clean call")


DECLINED = [
    pytest.param(1, 13, 9, 2, 2, 16, 16, dict(causal=True), id="causal_empties_rows"),
    pytest.param(1, 12, 9, 2, 2, 16, 16, dict(window=(2, 0)), id="window_empties_rows"),
    pytest.param(1, 12, 12, 2, 2, 16, 16, dict(softcap=2.5), id="softcap"),
    pytest.param(1, 12, 0, 2, 2, 16, 16, {}, id="no_keys"),
    pytest.param(1, 0, 12, 2, 2, 16, 16, {}, id="no_rows"),
    pytest.param(0, 12, 12, 2, 2, 16, 16, {}, id="no_batch"),
]


@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, dv, kw", DECLINED)
def test_sdpa_cpu_declined_matches_reference(routed, b, sq, sk, hq, hkv, d, dv, kw):
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    kw = dict(kw)
    if kw.pop("sink", False):
        kw["sink"] = rand(hq)
        out, lse = fl.attention(q, k, v, return_lse=True, **kw)
        ref_out, ref_lse = R.attention(q.double(), k.double(), v.double(), return_lse=True,
                                       **{**kw, "sink": kw["sink"].double()})
        assert_close_to_ref(out, ref_out, name="out")
        assert_close_to_ref(lse, ref_lse, name="lse")
    else:
        _check(q, k, v, kw)
    assert routed == {"fwd": 0, "bwd": 0}


def test_sdpa_cpu_lse_gradient_takes_the_loops(routed):
    # torch's backward has no lse gradient: with one, the loops run the backward.
    q, k, v = (rand(1, 20, 2, 32).requires_grad_() for _ in range(3))
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    dout, dlse = rand(*out.shape), rand(*lse.shape)
    grads = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    assert routed == {"fwd": 1, "bwd": 0}
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = R.attention(*leaves, causal=True, return_lse=True)
    ref = torch.autograd.grad([r_out, r_lse], leaves, [dout.double(), dlse.double()])
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close_to_ref(a, r, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["q", "k", "k_first", "v", "q_inf", "k_inf"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_cpu_bad_data_propagates(routed, where, causal, dtype):
    # torch's kernel gives a row whose every score is NaN (a NaN in q; in causal row 0, a NaN
    # in key 0) out 0 and lse 0, and its bf16 products may carry a NaN row of P into the next
    # (oneDNN on AMX): such inputs must take the loops, whose NaN reaches exactly the
    # reference's rows.
    x = {n: rand(1, 10, 4 if n == "q" else 2, 16, dtype=dtype) for n in "qkv"}
    name = where[0]
    row = 0 if where == "k_first" else 5
    x[name][0, row, 1, 3] = float("inf") if where.endswith("inf") else float("nan")
    out, lse = fl.attention(x["q"], x["k"], x["v"], causal=causal, return_lse=True)
    ref_out, ref_lse = R.attention(*(x[n].double() for n in "qkv"), causal=causal,
                                   return_lse=True)
    assert routed["fwd"] == 0
    for label, a, r in (("out", out, ref_out), ("lse", lse, ref_lse)):
        for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                           ("-inf", torch.isneginf)):
            assert torch.equal(test(a), test(r)), f"{label}: {what} pattern differs"
    assert torch.isnan(out).any(), "the bad element reaches no output"


def test_sdpa_cpu_nan_dout_takes_the_loops(routed):
    # The loops' NaN reaches every row of the reference's, and more: a masked key's
    # gradient is 0 * NaN there (docs/math.md section 7's known limit, as for v).
    q, k, v = (rand(1, 12, 2, 16).requires_grad_() for _ in range(3))
    out = fl.attention(q, k, v, causal=True)
    dout = rand(*out.shape)
    dout[0, 4, 1, 2] = float("nan")
    grads = torch.autograd.grad(out, [q, k, v], dout)
    assert routed == {"fwd": 1, "bwd": 0}
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(R.attention(*leaves, causal=True), leaves, dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.isnan(a)[torch.isnan(r)].all(), f"{name}: a NaN of the reference is gone"
        assert torch.isnan(a).any(-1).sum() < a.shape[1] * a.shape[2], f"{name}: all NaN"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sdpa_cpu_lse_contract_empty_rows_and_sinks(routed, dtype):
    # Empty rows (causal, Sq > Sk) with a sink: out 0 and lse == the sink, against the
    # reference, on the loops; a -inf sink is no sink (and, not finite, takes the loops); a
    # finite sink on rows that all see keys takes the route (bf16: in bf16 where the CPU
    # multiplies it natively). No NaN in outputs or gradients.
    q, k, v = (rand(1, s, h, 16, dtype=dtype) for s, h in ((13, 4), (9, 2), (9, 2)))
    sink = rand(4)
    out, lse, _ = check_against_reference(fl.attention, R.attention,
                                          dict(q=q, k=k, v=v, sink=sink),
                                          dict(causal=True, return_lse=True), lse_grad=False)
    assert (out[0, :4] == 0).all() and torch.equal(lse[0, :, :4], sink[:, None].expand(4, 4))
    assert routed == {"fwd": 0, "bwd": 0}
    sink_ninf = sink.clone()
    sink_ninf[1] = float("-inf")
    q = rand(1, 9, 4, 16, dtype=dtype)
    out, lse, _ = check_against_reference(fl.attention, R.attention,
                                          dict(q=q, k=k, v=v, sink=sink_ninf),
                                          dict(causal=True, return_lse=True), lse_grad=False)
    assert routed == {"fwd": 0, "bwd": 0}
    no_sink = fl.attention(q, k, v, causal=True, return_lse=True)[1]  # (the route: 1 call)
    torch.testing.assert_close(lse[:, 1], no_sink[:, 1])
    check_against_reference(fl.attention, R.attention, dict(q=q, k=k, v=v, sink=sink),
                            dict(causal=True, return_lse=True), lse_grad=False)
    assert routed == {"fwd": 3, "bwd": 1}
