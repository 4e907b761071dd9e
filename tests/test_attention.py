"""flashlse.attention against flashlse.reference.attention: out, lse, dq, dk, dv, dsink."""

import importlib

import pytest
import torch
from _flashlse_testing import LOWP, assert_close_to_ref, check_against_reference, rand

import flashlse as fl
from flashlse import reference as R

# flashlse.ops.attention is the function; the module it lives in holds TILE_ELEMS.
attn_mod = importlib.import_module("flashlse.ops.attention")

# (B, Sq, Sk, Hq, Hkv, D, Dv, keywords)
CASES = [
    pytest.param(2, 5, 7, 4, 4, 32, 32, {}, id="basic"),
    pytest.param(1, 1, 9, 2, 2, 16, 16, {}, id="sq1"),
    pytest.param(1, 0, 5, 2, 2, 16, 16, dict(causal=True), id="sq0"),
    pytest.param(0, 3, 5, 2, 2, 16, 16, {}, id="batch0"),
    pytest.param(1, 9, 1, 2, 2, 16, 16, {}, id="sk1"),
    pytest.param(2, 6, 11, 2, 2, 16, 16, dict(causal=True), id="causal"),
    pytest.param(1, 9, 4, 2, 2, 16, 16, dict(causal=True), id="causal_sq_gt_sk"),
    pytest.param(2, 4, 0, 2, 2, 16, 16, {}, id="sk0"),
    pytest.param(1, 4, 0, 2, 1, 16, 16, dict(causal=True), id="sk0_causal"),
    pytest.param(1, 63, 113, 1, 1, 16, 16, dict(causal=True), id="odd_63_113"),
    pytest.param(1, 1030, 40, 1, 1, 8, 8, dict(causal=True), id="two_query_blocks"),
    pytest.param(1, 203, 255, 1, 1, 8, 8, {}, id="odd_203_255"),
    pytest.param(1, 255, 203, 1, 1, 8, 8, dict(causal=True), id="odd_255_203_causal"),
    pytest.param(1, 5, 8, 6, 2, 16, 16, {}, id="gqa"),
    pytest.param(1, 5, 8, 4, 1, 16, 16, dict(causal=True), id="mqa"),
    pytest.param(1, 3, 5, 1, 1, 59, 59, {}, id="d59"),
    pytest.param(1, 3, 5, 1, 1, 111, 111, {}, id="d111"),
    pytest.param(1, 3, 5, 2, 1, 128, 128, {}, id="d128"),
    pytest.param(1, 3, 5, 1, 1, 256, 256, {}, id="d256"),
    pytest.param(1, 4, 6, 2, 2, 192, 128, dict(causal=True), id="d192_dv128"),
    pytest.param(1, 4, 6, 2, 2, 32, 59, {}, id="dv_gt_d"),
    pytest.param(1, 12, 12, 2, 2, 16, 16, dict(window=(3, 2)), id="window_3_2"),
    pytest.param(1, 12, 9, 2, 2, 16, 16, dict(window=(2, 0)), id="window_left_causal"),
    pytest.param(1, 10, 4, 2, 2, 16, 16, dict(window=(2, 1)), id="window_empties_rows"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(window=(0, 0)), id="window_diagonal"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(window=(-1, 2)), id="window_right_only"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(softcap=2.0, scale=1.0), id="softcap"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(softcap=3.0, causal=True), id="softcap_causal"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(scale=0.3), id="scale"),
    pytest.param(1, 6, 9, 2, 2, 16, 16, dict(scale=6.0, causal=True), id="large_logits"),
    pytest.param(2, 6, 9, 4, 2, 16, 16, dict(sink=True), id="sink_with_keys"),
    pytest.param(1, 4, 0, 3, 1, 16, 16, dict(sink=True), id="sink_no_keys"),
    pytest.param(1, 9, 4, 2, 2, 16, 16, dict(sink=True, causal=True), id="sink_empty_rows"),
    pytest.param(1, 10, 4, 2, 1, 16, 16, dict(sink=True, window=(2, 1), softcap=2.0),
                 id="sink_window_softcap"),
]


def make(b, sq, sk, hq, hkv, d, dv, kw, dtype):
    kw = dict(kw)
    diff = {"q": rand(b, sq, hq, d, dtype=dtype), "k": rand(b, sk, hkv, d, dtype=dtype),
            "v": rand(b, sk, hkv, dv, dtype=dtype)}
    if kw.pop("sink", False):
        diff["sink"] = rand(hq, scale=2.0)
    return diff, dict(kw, return_lse=True)


def check_empty_rows(out, lse, diff, kw, grads=None):
    """Rows with no visible key: out exactly 0, lse -inf (or exactly the sink), dq exactly 0."""
    ref_lse = R.attention(diff["q"], diff["k"], diff["v"], **{k: v for k, v in kw.items()
                                                              if k != "return_lse"},
                          return_lse=True)[1]
    empty = torch.isneginf(ref_lse)  # (B, Hq, Sq), computed without the sink
    rows = empty.transpose(1, 2)  # (B, Sq, Hq)
    assert bool((out[rows] == 0).all())
    if "sink" in diff:
        sink = diff["sink"].view(1, -1, 1).expand_as(lse)
        assert torch.equal(lse[empty], sink[empty])
    else:
        assert bool(torch.isneginf(lse[empty]).all())
    if grads is not None and "q" in grads:
        assert bool((grads["q"][rows] == 0).all())


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", CASES)
def test_attention_fp32(b, sq, sk, hq, hkv, d, dv, kw):
    diff, const = make(b, sq, sk, hq, hkv, d, dv, kw, torch.float32)
    out, lse, grads = check_against_reference(fl.attention, R.attention, diff, const)
    check_empty_rows(out, lse, diff, const, grads)


FEW = [c for c in CASES if c.id in ("basic", "causal_sq_gt_sk", "sk0", "gqa", "d192_dv128",
                                    "window_empties_rows", "softcap", "sink_with_keys",
                                    "sink_no_keys", "sink_empty_rows", "odd_63_113")]


@pytest.mark.parametrize("dtype", [torch.float64, *LOWP], ids=str)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", FEW)
def test_attention_dtypes(b, sq, sk, hq, hkv, d, dv, kw, dtype):
    diff, const = make(b, sq, sk, hq, hkv, d, dv, kw, dtype)
    out, lse, grads = check_against_reference(fl.attention, R.attention, diff, const)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check_empty_rows(out, lse, diff, const, grads)


def test_attention_without_lse_returns_out_only():
    q, k, v = rand(1, 3, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    out = fl.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert_close_to_ref(out, R.attention(q, k, v))


def test_attention_sink_no_keys_exact():
    q = rand(2, 3, 4, 16)
    k, v = rand(2, 0, 2, 16), rand(2, 0, 2, 8)
    sink = rand(4, scale=3.0)
    out, lse = fl.attention(q, k, v, sink=sink, return_lse=True)
    assert torch.equal(out, torch.zeros(2, 3, 4, 8))
    assert torch.equal(lse, sink.view(1, 4, 1).expand(2, 4, 3))


def test_attention_empty_row_grads_zero_with_dlse_everywhere():
    # A random dlse on the empty rows too (where lse = -inf) must not leak into any gradient.
    q, k, v = (rand(1, 9, 2, 16).requires_grad_(), rand(1, 4, 2, 16).requires_grad_(),
               rand(1, 4, 2, 16).requires_grad_())
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    dout, dlse = rand(*out.shape), rand(*lse.shape)
    g_all = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    dl = torch.where(torch.isneginf(lse), torch.zeros_like(dlse), dlse)
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    g_fin = torch.autograd.grad([out, lse], [q, k, v], [dout, dl])
    for a, b in zip(g_all, g_fin):
        assert not bool(torch.isnan(a).any())
        assert torch.equal(a, b)
    assert bool((g_all[0][:, :5] == 0).all())


def test_attention_strided_views():
    # q, k, v as non-contiguous views (SDPA layout transposed, a slice of a fused qkv).
    b, s, h, d = 2, 7, 4, 16
    qkv = rand(b, s, 3, h, d + 5).requires_grad_()
    q, k, v = qkv[:, :, 0, :, :d], qkv[:, :, 1, :, :d], qkv[:, :, 2, :, :d]
    assert not q.is_contiguous()
    sink = rand(h)
    out, lse = fl.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    q2, k2, v2 = (x.detach().contiguous().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = R.attention(q2, k2, v2, causal=True, sink=sink, return_lse=True)
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse, name="lse")
    dout = rand(*out.shape)
    (g,) = torch.autograd.grad(out, [qkv], dout)
    ref_g = torch.autograd.grad(ref_out, [q2, k2, v2], dout.double())
    for i, rg in enumerate(ref_g):
        assert_close_to_ref(g[:, :, i, :, :d], rg, name=f"d{'qkv'[i]}")
    assert bool((g[..., d:] == 0).all())

    # SDPA-layout tensors transposed into the flash layout.
    qs, ks, vs = rand(b, h, s, d), rand(b, h, s + 2, d), rand(b, h, s + 2, d)
    out = fl.attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2))
    assert_close_to_ref(out, R.attention(qs.transpose(1, 2), ks.transpose(1, 2),
                                         vs.transpose(1, 2)))


def test_attention_chunked_matches_single_tile(monkeypatch):
    # Many query blocks and key chunks (tiny tiles) give the same result as one tile.
    diff, const = make(2, 37, 150, 4, 2, 16, 24, dict(causal=True, sink=True,
                                                      window=(40, 3)), torch.float32)
    q, k, v, sink = diff["q"], diff["k"], diff["v"], diff["sink"]
    one = fl.attention(q, k, v, sink=sink, **const)
    tiles = []
    real = attn_mod._scores

    def spy(qb, kc, scale, softcap):
        tiles.append(qb.shape[-2] * kc.shape[-2] * qb.shape[0] * qb.shape[1] * qb.shape[2])
        return real(qb, kc, scale, softcap)

    monkeypatch.setattr(attn_mod, "TILE_ELEMS", 2 * 4 * 37 * 16)
    monkeypatch.setattr(attn_mod, "_scores", spy)
    check_against_reference(fl.attention, R.attention, diff, const)
    many = fl.attention(q, k, v, sink=sink, **const)
    assert len(tiles) > 4
    assert max(tiles) <= attn_mod.TILE_ELEMS
    assert_close_to_ref(many[0], one[0].double(), name="out")
    assert_close_to_ref(many[1], one[1].double(), name="lse")


def test_attention_64k_keys_bounded_tiles(monkeypatch):
    # 64k keys: the tile stays within TILE_ELEMS, and the result matches the reference,
    # built by merging float64 reference states over 8 partitions of the keys.
    sq, sk, d = 16, 1 << 16, 16
    q, k, v = rand(1, sq, 1, d), rand(1, sk, 1, d), rand(1, sk, 1, d)
    tiles = []
    real = attn_mod._scores

    def spy(qb, kc, scale, softcap):
        tiles.append(qb.shape[-2] * kc.shape[-2])
        return real(qb, kc, scale, softcap)

    monkeypatch.setattr(attn_mod, "_scores", spy)
    monkeypatch.setattr(attn_mod, "SDPA_CPU", False)  # (the loops' tiles)
    out, lse = fl.attention(q, k, v, causal=True, return_lse=True)
    assert max(tiles) <= attn_mod.TILE_ELEMS
    parts = torch.arange(0, sk + 1, sk // 8).tolist()
    outs, lses = [], []
    for k0, k1 in zip(parts, parts[1:]):
        # The causal mask of the last 16 rows only touches the last partition.
        causal = k1 == sk
        o, l = R.attention(q, k[:, k0:k1], v[:, k0:k1], causal=causal,
                           scale=d ** -0.5, return_lse=True)
        outs.append(o)
        lses.append(l.transpose(1, 2))
    ref_out, ref_lse = R.merge_states(torch.stack(outs), torch.stack(lses))
    assert_close_to_ref(out, ref_out)
    assert_close_to_ref(lse, ref_lse.transpose(1, 2), name="lse")

    # Forced into many small tiles: unchanged within rounding.
    tiles.clear()
    monkeypatch.setattr(attn_mod, "TILE_ELEMS", 16 * 4096)
    monkeypatch.setattr(attn_mod, "K_CHUNK", 1 << 16)  # the tile budget alone sets the chunk
    out2, lse2 = fl.attention(q, k, v, causal=True, return_lse=True)
    assert len(tiles) == 16 and max(tiles) <= 16 * 4096
    assert_close_to_ref(out2, ref_out)
    assert_close_to_ref(lse2, ref_lse.transpose(1, 2), name="lse")

    # The backward walks the same bounded tiles; 16 x 64k float64 is small enough to
    # differentiate the full reference once.
    tiles.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fl.attention(*leaves, causal=True, return_lse=True)
    dout, dlse = rand(*out.shape), rand(*lse.shape)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    assert len(tiles) == 32 and max(tiles) <= 16 * 4096
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    r_out, r_lse = R.attention(*ref_leaves, causal=True, return_lse=True)
    ref_grads = torch.autograd.grad([r_out, r_lse], ref_leaves, [dout.double(), dlse.double()])
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_to_ref(g, rg, name=name)


def test_attention_deterministic_backward_bitwise():
    diff, const = make(1, 9, 13, 4, 2, 16, 16, dict(causal=True, sink=True), torch.float32)
    leaves = [t.clone().requires_grad_() for t in diff.values()]
    res = []
    for _ in range(2):
        out, lse = fl.attention(*leaves[:3], sink=leaves[3], deterministic=True, **const)
        res.append(torch.autograd.grad(out.sum() + lse.sum(), leaves))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_huge_window_is_unbounded():
    """A window side of 2^31 or more sees every key: it equals no bound on that side."""
    q, k, v = rand(2, 5, 4, 16), rand(2, 7, 2, 16), rand(2, 7, 2, 16)
    torch.testing.assert_close(fl.attention(q, k, v, window=(10**20, 0)),
                               fl.attention(q, k, v, causal=True))


@pytest.mark.parametrize("window,plain", [((3, 2**31 - 2), (3, None)), ((2**30, 0), (None, 0)),
                                          ((2**30 - 1, 0), (2**30 - 1, 0)), ((-1, 2**40), None)])
def test_window_sides_of_2_to_the_30_are_unbounded(window, plain):
    """Sides of 2^30 or more see every key of any sequence under 2^30 tokens, and become None
    before any kernel runs (the kernels' int32 row bounds overflowed near 2^31: the kernel
    tests' test_window_bounds.py); the CPU path gives the unbounded answer too."""
    from flashlse.ops import _validate as V

    assert V.check_window(window) == (plain or (None, None))
    q, k, v = (torch.randn(1, s, 2, 16, dtype=torch.float64) for s in (6, 11, 11))
    out, lse = fl.attention(q, k, v, window=window, return_lse=True)
    want, want_lse = fl.attention(q, k, v, window=plain, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
