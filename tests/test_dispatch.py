"""``kernels/dispatch.py``: which kernel each attention pass runs, and with what arguments.

Every kernel is replaced by a recorder (no GPU, no interpreter), and the Hopper kernels'
``supported`` predicates by stubs, so these tests see the decisions themselves: the Gluon
launchers get the arguments the code before the dispatcher passed (grids, buffers, flags,
tiles), the portable kernels run outside the Gluon domains or with ``KernelOptions`` off, and
a Gluon kernel that fails to compile warns once and leaves its signature to the portable one
(``failures.FAILURES``). The numbers these kernels compute are tested in tests/kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings

import pytest
import torch
import triton
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashlse import kernel_options
from flashlse.kernels import bwd, configs, dispatch, fwd
from flashlse.kernels.failures import FAILURES

fwd_sm90 = pytest.importorskip("flashlse.kernels.fwd_sm90")
bwd_sm90 = pytest.importorskip("flashlse.kernels.bwd_sm90")
attention_ops = importlib.import_module("flashlse.ops.attention")


@dataclasses.dataclass
class Launch:
    kernel: str
    grid: tuple
    args: tuple
    kwargs: dict
    named: dict


class _Kernel:
    """Stands for a ``@triton.jit`` / ``@gluon.jit`` kernel: records each launch, and raises
    (as a compiler would) while ``fails(kwargs)``."""

    def __init__(self, name, log, real, fails=None):
        self.name, self.log, self.fails = name, log, fails
        self.arg_names = real.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # Launch plans pass most arguments by position: named names them all.
            named = {**dict(zip(self.arg_names, args)), **kwargs}
            self.log.append(Launch(self.name, grid, args, kwargs, named))
            if self.fails is not None and self.fails(named):
                raise RuntimeError(f"{self.name} does not compile here")
        return launch


class Kernels:
    """The launches of one test, the ``supported`` answers, and which kernels fail."""

    def __init__(self):
        self.log: list[Launch] = []
        self.supported = {"fwd": True, "dkdv": True, "dq": True}
        self.asked: list[tuple] = []
        self.failing: set[str] = set()

    def names(self):
        return [launch.kernel for launch in self.log]

    def of(self, name):
        (launch,) = [launch for launch in self.log if launch.kernel == name]
        return launch


@pytest.fixture
def kernels(monkeypatch):
    k = Kernels()
    for mod, attr, name in ((fwd, "_attn_fwd_kernel", "fwd"),
                            (fwd_sm90, "_fwd_sm90_kernel", "fwd_sm90"),
                            (fwd_sm90, "_fwd_sm90_varlen_kernel", "fwd_sm90_varlen"),
                            (fwd_sm90, "_fwd_sm90_persistent_kernel", "fwd_sm90_persistent"),
                            (fwd_sm90, "_varlen_blocks_kernel", "varlen_blocks"),
                            (bwd, "_zero_uncovered_rows", "bwd_zero"),
                            (bwd, "_attn_bwd_preprocess_kernel", "bwd_pre"),
                            (bwd, "_attn_bwd_dkdv_kernel", "dkdv"),
                            (bwd, "_attn_bwd_dq_kernel", "dq"),
                            (bwd_sm90, "_dkdv_sm90_kernel", "dkdv_sm90"),
                            (bwd_sm90, "_dq_sm90_kernel", "dq_sm90")):
        fails = (lambda kw, n=name: n in k.failing
                 or (n == "fwd" and kw["WARP_SPECIALIZE"] and "fwd_ws" in k.failing))
        monkeypatch.setattr(mod, attr, _Kernel(name, k.log, getattr(mod, attr), fails))
    monkeypatch.setattr(triton, "set_allocator", lambda fn: None)

    def fwd_supported(*args, **kwargs):
        k.asked.append(("fwd", args, kwargs))
        return k.supported["fwd"]

    def bwd_supported(*args, softcap, dims=(128,)):
        part = "dq" if dims == bwd_sm90.DQ_DIMS else "dkdv"
        k.asked.append((part, args, dict(softcap=softcap, dims=dims)))
        return k.supported[part] and args[0].shape[-1] in dims

    monkeypatch.setattr(fwd_sm90, "supported", fwd_supported)
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)
    monkeypatch.setattr(bwd_sm90, "supported", bwd_supported)
    # Launch plans hold the kernels and the supported answers: fresh ones for each test.
    for mod, cache in ((fwd, "_PLANS"), (fwd_sm90, "_PLANS"), (bwd, "_BWD_PLANS")):
        monkeypatch.setattr(mod, cache, {})
    with FAILURES.isolated():
        yield k


def _dense(b=2, sq=300, sk=333, hq=4, hkv=2, d=128, dtype=torch.float16, sink=True):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    s = torch.randn(hq, generator=gen) if sink else None
    return q, k, v, dict(left=None, right=0, softcap=0.0, scale=d ** -0.5, sink=s)


def _varlen(hq=4, hkv=1, d=128):
    cu_q = torch.tensor([0, 100, 100, 350], dtype=torch.int32)
    cu_k = torch.tensor([0, 120, 300, 700], dtype=torch.int32)
    q = torch.randn(350, hq, d).half()
    k, v = torch.randn(700, hkv, d).half(), torch.randn(700, hkv, d).half()
    used = torch.tensor([120, 10, 400], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=250, max_seqlen_k=400,
                  seqused_k=used)
    return q, k, v, dict(left=31, right=0, softcap=0.0, scale=0.1, sink=None, **varlen)


def _strides(t, varlen=False):
    st = t.stride()
    return (0, st[0], st[1]) if varlen else st[:3]


# --- forward ---------------------------------------------------------------------------------


def test_forward_takes_the_hopper_kernel_with_its_arguments(kernels):
    q, k, v, kw = _dense()
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90"]
    assert kernels.asked == [("fwd", (q, k, v), dict(softcap=0.0, scale=kw["scale"], batch=2))]
    g = kernels.of("fwd_sm90")
    cfg = configs.FWD_SM90[128]
    assert g.grid == (3, 4, 2)  # (ceil(300 / 128) row blocks, Hq, B)
    assert g.args[:9] == (q, k, v, out, lse, kw["sink"], None, None, None)
    # Strides as one tuple a tensor: (batch, row, head), lse (batch, head).
    assert g.args[9:14] == (_strides(q), _strides(k), _strides(v), _strides(out),
                            lse.stride()[:2])
    assert g.args[14:21] == (300, 333, 0, 0, 0, 0, kw["scale"] * 1.4426950408889634)
    flags = {n: g.named[n] for n in g.named if n.isupper()}
    assert flags == dict(GROUP=2, D=128, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                         HAS_LEFT=False, HAS_RIGHT=True, HAS_SINK=True, IS_VARLEN=False,
                         HAS_SEQUSED_K=False, PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap,
                         CONSUMER_REGS=cfg.consumer_regs)
    assert g.kwargs == dict(num_warps=cfg.num_warps)
    assert out.shape == (2, 300, 4, 128) and lse.shape == (2, 4, 300)


def test_forward_varlen_asks_with_the_sequence_count(kernels):
    q, k, v, kw = _varlen()
    with kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": False}):  # the grid kernel
        out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.asked[0][2]["batch"] == 3
    g = kernels.of("fwd_sm90")
    assert g.grid == (2, 4, 3)
    assert g.args[6:9] == (kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_k"])
    assert g.args[9] == _strides(q, True) and g.args[13] == (0, lse.stride(0))
    assert g.args[14:20] == (250, 400, 350, 700, 31, 0)
    assert g.named["GROUP"] == 4 and g.named["IS_VARLEN"] and g.named["HAS_SEQUSED_K"]
    assert out.shape == (350, 4, 128) and lse.shape == (4, 350)


def test_forward_varlen_persistent_lists_the_blocks_then_walks_them(kernels, monkeypatch):
    """The persistent varlen kernel (D = 128's default): ``_varlen_blocks_kernel`` fills a
    fresh list (one program a block index: ceil(250 / 128)) that the kernel then reads, a
    program an SM (here 16, below the 24 items); the heads in one L2 section here. With as
    many SMs as items or more, the grid kernel runs (no list)."""
    q, k, v, kw = _varlen()
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 24)
    dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90"]
    kernels.log.clear()
    fwd_sm90._PLANS.clear()
    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 16)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["varlen_blocks", "fwd_sm90_varlen"]
    lst, run = kernels.of("varlen_blocks"), kernels.of("fwd_sm90_varlen")
    blocks = lst.args[3]
    # At most ceil(350 / 128) + 3 = 6 blocks (and 3 x 2), 5 ints each, the count first.
    assert blocks.dtype == torch.int32 and blocks.shape == (1 + 5 * 6, )
    assert lst.grid == (2, 1, 1)
    assert lst.args[:4] == (kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_k"], blocks)
    # No block table; its stride, the page count and rows_lo 0.
    assert lst.args[4:14] == (None, 3, 350, 700, 250, 400, 6, 0, 0, 0)
    assert lst.args[14:17] == (128, 128, True) and lst.named["PAGE_SIZE"] == 0
    assert run.grid == (16, 1, 1)  # 16 SMs, 6 blocks x 4 heads
    assert run.args[:8] == (q, k, v, out, lse, None, blocks, None)
    assert run.named["PAGE_SIZE"] == 0
    assert (run.named["stride_qs"], run.named["stride_os"], run.named["stride_lh"]) == \
        (q.stride(0), out.stride(0), lse.stride(0))
    assert (run.named["total_q"], run.named["total_k"], run.named["heads"]) == (350, 700, 4)
    assert (run.named["left"], run.named["right"]) == (31, 0)
    assert run.named["GROUP"] == 4 and run.named["HQ"] == 4 and not run.named["O_IN_Q"]
    assert out.shape == (350, 4, 128) and lse.shape == (4, 350)


def test_forward_varlen_key_splits_then_merge(kernels, monkeypatch):
    """``fwd_sm90.VARLEN_SPLIT_KV`` (on): a call of at most half
    the SMs' items (6 blocks x 4 heads = 24 on 132 SMs) takes the persistent varlen kernel
    with key splits (``_split_count``: 4 x 24 <= 132, 4 key tiles of 400 keys, a tile a
    split), whose float32 partial states ``merge_states``' kernel merges into out and lse,
    the sink once."""
    from flashlse.kernels import combine

    q, k, v, kw = _varlen()
    kw["sink"] = torch.randn(4)
    monkeypatch.setattr(fwd_sm90, "VARLEN_SPLIT_KV", True)
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(combine, "_merge_states_fwd_kernel",
                        _Kernel("merge", kernels.log, combine._merge_states_fwd_kernel))
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["varlen_blocks", "fwd_sm90_varlen", "merge"]
    run, merge = kernels.of("fwd_sm90_varlen"), kernels.of("merge")
    assert run.named["SPLITS"] == 4 and run.grid == (4 * 24, 1, 1)
    part_o, part_lse = run.args[3], run.args[4]
    assert part_o.shape == (4, 350, 4, 128) and part_o.dtype == torch.float32
    assert part_lse.shape == (4, 4, 350) and run.args[5] is None
    assert not run.named["HAS_SINK"]
    assert (run.named["stride_os"], run.named["stride_lh"]) == (4 * 128, 350)
    assert merge.named["N"] == 4 and merge.named["HAS_SINK"] and merge.named["R"] == 350 * 4
    assert merge.named["out"].data_ptr() == out.data_ptr()
    assert merge.named["lse"].data_ptr() == lse.data_ptr()
    assert fwd_sm90._PLANS and all(
        p.signature[-1] == "4 splits" for p in fwd_sm90._PLANS.values() if p is not None)

def test_dense_forward_key_splits_then_merge(kernels, monkeypatch):
    """``fwd_sm90.DENSE_SPLIT_KV`` (on since session 32): a dense call of at most
    half the SMs' items (2 batches x 3 row blocks x 4 heads = 24 on 132 SMs) runs as packed
    sequences of equal lengths on the persistent varlen kernel with key splits (4 x 24 <=
    132, 3 key tiles of 333 keys, a tile a split: at most 3, so 2): the list reads cu_seqlens
    of [0, 300, 600] and [0, 333, 666], the kernel q, k, v as rows, and the merge writes the
    dense out (B, Sq, H, D) and lse (B, H, Sq) through its transpose, the sink once. Off,
    or with keys too short to split, the dense kernels run as before."""
    from flashlse.kernels import combine

    monkeypatch.setattr(fwd_sm90, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_MIN_KEYS", 1)
    monkeypatch.setattr(combine, "_merge_states_fwd_kernel",
                        _Kernel("merge", kernels.log, combine._merge_states_fwd_kernel))
    q, k, v, kw = _dense()
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_KV", False)
    fwd_sm90._PLANS.clear()
    dispatch.attn_fwd(q, k, v, **kw)
    assert "merge" not in kernels.names()  # the flag is off
    kernels.log.clear()
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_KV", True)
    fwd_sm90._PLANS.clear()
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["varlen_blocks", "fwd_sm90_varlen", "merge"]
    blocks, run, merge = kernels.log
    assert blocks.args[0].tolist() == [0, 300, 600] and blocks.args[1].tolist() == [0, 333, 666]
    assert run.named["SPLITS"] == 2 and run.grid == (2 * 24, 1, 1)
    assert run.args[0].shape == (600, 4, 128) and run.args[0].data_ptr() == q.data_ptr()
    assert run.args[1].shape == (666, 2, 128) and run.args[1].data_ptr() == k.data_ptr()
    part_o, part_lse = run.args[3], run.args[4]
    assert part_o.shape == (2, 600, 4, 128) and part_lse.shape == (2, 4, 600)
    assert run.args[5] is None and not run.named["HAS_SINK"]
    assert (run.named["total_q"], run.named["total_k"]) == (600, 666)
    assert merge.named["N"] == 2 and merge.named["HAS_SINK"] and merge.named["R"] == 600 * 4
    assert merge.named["out"].data_ptr() == out.data_ptr() and out.shape == (2, 300, 4, 128)
    assert merge.named["lse"].data_ptr() == lse.data_ptr() and lse.shape == (2, 4, 300)
    assert all(p.signature[-1] == "dense" for p in fwd_sm90._PLANS.values() if p is not None)
    # A repeated call reads the list its plan kept: the kernel and the merge only.
    kernels.log.clear()
    out2, lse2 = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90_varlen", "merge"]
    assert kernels.log[0].args[6] is blocks.args[3]
    # ... and the merge, on this call's workspaces and outputs, the sink once.
    run2, merge2 = kernels.log
    assert merge2.args[0].data_ptr() == run2.args[3].data_ptr()
    assert merge2.args[1].data_ptr() == run2.args[4].data_ptr()
    assert merge2.args[2] is kw["sink"] and merge2.named["HAS_SINK"]
    assert merge2.args[3].data_ptr() == out2.data_ptr()
    assert merge2.args[4].data_ptr() == lse2.data_ptr()
    assert merge2.named["N"] == 2 and merge2.named["R"] == 600 * 4
    # Keys too short for two splits of SPLIT_MIN_TILES: the dense kernels.
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 4)
    fwd_sm90._PLANS.clear()
    kernels.log.clear()
    dispatch.attn_fwd(q, k, v, **kw)
    assert "merge" not in kernels.names()
    # Keys too short to earn a split's host time back (DENSE_SPLIT_MIN_KEYS): the same.
    monkeypatch.setattr(fwd_sm90, "SPLIT_MIN_TILES", 1)
    monkeypatch.setattr(fwd_sm90, "DENSE_SPLIT_MIN_KEYS", 334)
    fwd_sm90._PLANS.clear()
    kernels.log.clear()
    dispatch.attn_fwd(q, k, v, **kw)
    assert "merge" not in kernels.names()


def test_forward_d64_takes_the_persistent_kernel_or_the_portable_one(kernels):
    """D = 64 (``FWD_SM90[64].grid`` off): the dense calls the persistent kernel takes run
    it, packed varlen calls the persistent varlen kernel (its list, then the kernel), even
    with fewer items than SMs; layouts neither takes run fwd.py's kernel, never the Hopper
    grid kernel (slower than fwd.py's there). ``GRID`` on brings the grid kernel back for
    the few-item varlen call, ``PERSISTENT_VARLEN`` off sends it to fwd.py's."""
    q, k, v, kw = _dense(sq=1024, sk=1024, d=64)
    dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90_persistent"]
    assert kernels.of("fwd_sm90_persistent").named["D"] == 64
    kernels.log.clear()
    q, k, v, kw = _dense(d=64)  # S = 300: not the persistent kernel's
    dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd"]
    kernels.log.clear()
    q, k, v, kw = _varlen(d=64)
    dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["varlen_blocks", "fwd_sm90_varlen"]
    kernels.log.clear()
    with kernel_options(fwd_sm90_config={"GRID": True}):
        dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90"]
    kernels.log.clear()
    with kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": False}):
        dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd"]


@pytest.mark.parametrize("supported, on", [(False, True), (True, False)],
                         ids=["outside_domain", "option_off"])
def test_forward_portable_outside_the_domain_or_switched_off(kernels, supported, on):
    kernels.supported["fwd"] = supported
    q, k, v, kw = _dense()
    with kernel_options(sm90_fwd=on):
        out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd"]
    assert len(kernels.asked) == (1 if on else 0)
    p = kernels.of("fwd").named
    assert p["o"] is out and p["lse"] is lse and p["q"] is q and p["GROUP"] == 2


def test_forward_compile_failure_warns_once_and_falls_back(kernels):
    kernels.failing.add("fwd_sm90")
    q, k, v, kw = _dense()
    with pytest.warns(RuntimeWarning, match="Hopper forward kernel failed") as rec:
        out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert rec[0].filename == __file__  # as from the dispatcher's caller
    assert kernels.names() == ["fwd_sm90", "fwd"]
    # The portable kernel fills the buffers the failed launch was given.
    assert kernels.of("fwd").named["o"] is out is kernels.of("fwd_sm90").args[3]
    assert [key[0] for key in FAILURES] == ["fwd_sm90"]
    kernels.log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd"]
    # Another signature (no mask) is another compilation: tried again.
    kernels.log.clear()
    with pytest.warns(RuntimeWarning):
        dispatch.attn_fwd(q, k, v, **dict(kw, right=None))
    assert kernels.names() == ["fwd_sm90", "fwd"] and len(FAILURES) == 2


@pytest.mark.skipif(fwd.interpreting(), reason="no warp specialisation in the interpreter")
def test_forward_warp_specialisation_failure_falls_back_silently(kernels, monkeypatch):
    monkeypatch.setattr(fwd, "tma_ok", lambda *t: True)
    kernels.failing.add("fwd_ws")
    q, k, v, kw = _dense()
    with warnings.catch_warnings(), kernel_options(
            sm90_fwd=False, fwd_config={"WARP_SPECIALIZE": True, "num_warps": 8}):
        warnings.simplefilter("error")
        dispatch.attn_fwd(q, k, v, **kw)
        assert [launch.named["WARP_SPECIALIZE"] for launch in kernels.log] == [True, False]
        assert [key[0] for key in FAILURES] == ["fwd warp_specialize"]
        kernels.log.clear()
        dispatch.attn_fwd(q, k, v, **kw)
        assert [launch.named["WARP_SPECIALIZE"] for launch in kernels.log] == [False]


def test_forward_empty_launches_nothing(kernels):
    q, k, v, kw = _dense(sq=0)
    out, lse = dispatch.attn_fwd(q, k, v, **kw)
    assert kernels.names() == [] and out.shape == (2, 0, 4, 128) and lse.shape == (2, 4, 0)


def test_public_function_reaches_the_dispatcher(kernels, monkeypatch):
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    q, k, v, kw = _dense()
    attention_ops.attn_fwd(q, k, v, **kw)
    assert kernels.names() == ["fwd_sm90"]


def test_public_forward_keeps_its_launch(kernels, monkeypatch):
    """A repeated ``attention`` without grad launches the launch kept by its key, with fresh
    buffers and no dispatch; a kept Hopper launch that fails to compile warns once, the
    portable kernel answers and is kept in its place; another option is another key."""
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_ops, "_KEPT", {})
    asked = []
    real = dispatch.fwd_launch
    monkeypatch.setattr(dispatch, "fwd_launch", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    q, k, v, kw = _dense()
    call = dict(causal=True, sink=kw["sink"], scale=kw["scale"], return_lse=True)
    out1, _ = attention_ops.attention(q, k, v, **call)
    out2, lse2 = attention_ops.attention(q, k, v, **call)
    assert kernels.names() == ["fwd_sm90", "fwd_sm90"] and len(asked) == 1
    assert kernels.log[1].args[3] is out2 is not out1 and kernels.log[1].args[4] is lse2
    assert kernels.log[1].args[9:] == kernels.log[0].args[9:]
    kernels.log.clear()
    kernels.failing.add("fwd_sm90")
    with pytest.warns(RuntimeWarning, match="Hopper forward kernel failed"):
        out3 = attention_ops.attention(q, k, v, **call)[0]
    assert kernels.names() == ["fwd_sm90", "fwd"] and kernels.of("fwd").named["o"] is out3
    kernels.log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out4 = attention_ops.attention(q, k, v, **call)[0]
    assert kernels.names() == ["fwd"] and kernels.of("fwd").named["o"] is out4
    assert len(asked) == 2  # the first call and the failed launch's replan; none for out4
    kernels.failing.clear()
    kernels.log.clear()
    with kernel_options(sm90_fwd=False):
        attention_ops.attention(q, k, v, **call)
        attention_ops.attention(q, k, v, **call)
    assert kernels.names() == ["fwd", "fwd"] and len(asked) == 3
    assert len(attention_ops._KEPT) == 2


def test_public_training_call_keeps_its_launches(kernels, monkeypatch):
    """A repeated ``attention`` needing grad launches its kept forward launch through
    AttentionFunction (no dispatch), and its backward finds its plan under the forward's
    key (``bwd.prepare``'s short key) with the kernels chosen for it (the fused pass): no
    planning after the first step. A kept Hopper forward that fails to compile warns once,
    the portable kernel answers (the gradients still come) and is kept in its place."""
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_ops, "_KEPT", {})
    asked, planned = [], []
    real = dispatch.fwd_launch
    monkeypatch.setattr(dispatch, "fwd_launch", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    real_plan = bwd._bwd_plan
    monkeypatch.setattr(bwd, "_bwd_plan",
                        lambda *a, **kw: planned.append(1) or real_plan(*a, **kw))
    q, k, v, kw = _dense()
    q.requires_grad_()
    call = dict(causal=True, sink=kw["sink"], scale=kw["scale"])

    def step():
        kernels.log.clear()
        q.grad = None
        out = attention_ops.attention(q, k, v, **call)
        out.backward(torch.ones_like(out))
        assert q.grad is not None and q.grad.shape == q.shape
        return kernels.names()

    for _ in range(3):
        assert step() == ["fwd_sm90", "bwd_pre", "dkdv_sm90"]
    assert len(asked) == 1 and len(planned) == 1
    ((kept, launch),) = attention_ops._KEPT.items()
    (bwd_key,) = bwd._BWD_PLANS
    assert bwd_key[0] == kept  # the short key: the forward's first
    kernels.failing.add("fwd_sm90")
    with pytest.warns(RuntimeWarning, match="Hopper forward kernel failed"):
        assert step() == ["fwd_sm90", "fwd", "bwd_pre", "dkdv_sm90"]
    assert not attention_ops._KEPT  # the failed launch dropped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step() == ["fwd", "bwd_pre", "dkdv_sm90"]
        assert step() == ["fwd", "bwd_pre", "dkdv_sm90"]
    assert len(asked) == 3 and len(attention_ops._KEPT) == 1  # the replan, kept once


def test_kept_plans_off_takes_the_full_path(kernels, monkeypatch):
    """``_validate.KEEP_PLANS`` off (the benchmarks' in-process A/B): every call dispatches
    again and nothing is kept."""
    from flashlse.ops import _validate

    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(attention_ops, "_KEPT", {})
    monkeypatch.setattr(_validate, "KEEP_PLANS", False)
    asked = []
    real = dispatch.fwd_launch
    monkeypatch.setattr(dispatch, "fwd_launch", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    q, k, v, kw = _dense()
    for _ in range(3):
        attention_ops.attention(q, k, v, causal=True, scale=kw["scale"])
    assert len(asked) == 3 and not attention_ops._KEPT


def test_portable_launchers_know_no_hopper_kernel():
    for mod in (fwd, bwd):
        assert not any(name.endswith("_sm90") or "FAILED" in name for name in vars(mod)), mod


# --- backward --------------------------------------------------------------------------------


def _backward(q, k, v, kw, deterministic=True, **opts):
    """The backward with fake kernels; deterministic by default (the two passes: the fused
    one has its own test)."""
    out, lse = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype), torch.zeros(
        (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0]))
    dout = torch.ones_like(out)
    with kernel_options(**opts):
        return dout, dispatch.attn_bwd(dout, None, q, k, v, out, lse,
                                       deterministic=deterministic, **kw)


def test_backward_fused_by_default(kernels, monkeypatch):
    """Not deterministic (the default): one dK/dV launch that also adds dQ into a float32
    tensor (FUSED_DQ; its strides dq's), no dQ pass; deterministic calls, D != 128 and the
    Hopper dK/dV or dQ switched off take the two passes."""
    q, k, v, kw = _dense()
    dout, (dq, dk, dv, _) = _backward(q, k, v, kw, deterministic=False)
    assert kernels.names() == ["bwd_pre", "dkdv_sm90"]
    g = kernels.of("dkdv_sm90")
    acc = g.args[11]
    assert g.named["FUSED_DQ"] and acc.dtype == torch.float32 and acc.shape == q.shape
    assert g.named["DQ_SWIZZLE"]  # its dQ tiles staged in swizzled boxes
    # D = 128: each tile's dQ products one tile late, on per-program descriptors too (a
    # CPU tensor has no host descriptors; a patched tma_ok gives them, below).
    assert not g.named["HOST_DESC"] and g.named["DQ_LAG"]
    assert g.named["stride_dqa"] == dq.stride()[:3] and g.args[6] is dk
    assert g.grid == (3, 2, 2)  # (ceil(333 / 128) key blocks, Hkv, B)
    for opts in (dict(deterministic=True), dict(deterministic=False, sm90_dq=False)):
        kernels.log.clear()
        _backward(q, k, v, kw, **opts)
        assert kernels.names() != ["bwd_pre", "dkdv_sm90"]
    # torch's deterministic mode keeps the two passes as deterministic=True does.
    kernels.log.clear()
    torch.use_deterministic_algorithms(True)
    try:
        _backward(q, k, v, kw, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert kernels.names() != ["bwd_pre", "dkdv_sm90"] and not kernels.of("dkdv_sm90").named[
        "FUSED_DQ"] and not kernels.of("dkdv_sm90").named["DQ_SWIZZLE"] and not kernels.of(
        "dkdv_sm90").named["DQ_LAG"]
    # Host descriptors (a patched tma_ok; the plans made without them dropped): the lag at
    # D = 128, not at D = 64 (measured: no gain there).
    monkeypatch.setattr(bwd, "tma_ok", lambda *t: True)
    monkeypatch.setattr(bwd, "_BWD_PLANS", {})
    for d, lag in ((128, True), (64, False)):
        kernels.log.clear()
        _backward(*_dense(d=d), deterministic=False)
        g = kernels.of("dkdv_sm90").named
        assert g["FUSED_DQ"] and g["DQ_SWIZZLE"] and g["HOST_DESC"] and g["DQ_LAG"] == lag


def test_backward_takes_both_hopper_kernels_with_their_arguments(kernels):
    q, k, v, kw = _dense()
    dout, (dq, dk, dv, dsink) = _backward(q, k, v, kw)
    assert kernels.names() == ["bwd_pre", "dkdv_sm90", "dq_sm90"]
    assert [(part, args) for part, args, _ in kernels.asked] == [
        ("dkdv", (q, k, v, dout, dk, dv)), ("dq", (q, k, v, dout, dq, dq))]
    assert kernels.asked[1][2] == dict(softcap=0.0, dims=bwd_sm90.DQ_DIMS)
    pre = kernels.of("bwd_pre").named
    dkdv, dqk = kernels.of("dkdv_sm90"), kernels.of("dq_sm90")
    assert dkdv.grid == (3, 2, 2) and dqk.grid == (3, 4, 2)  # (blocks of 128, heads, B)
    cfg = configs.BWD_SM90_DKDV
    for name in ("lse_log2", "delta"):
        assert dkdv.named[name] is pre[name] and dqk.named[name] is pre[name]
    assert dkdv.named["dk"] is dk and dkdv.named["dv"] is dv
    # The dense dQ kernel takes descriptors made on the host over Q, K, V, dO and dQ
    # (DQ_HOST_DESC); the statistics stay pointers.
    assert bwd_sm90.DQ_HOST_DESC and dqk.named["HOST_DESC"]
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dq", dq)):
        assert isinstance(dqk.named[name], TensorDescriptor) and dqk.named[name].base is t
    assert dkdv.named["q"] is q and dkdv.named["dout"] is dout
    common = dict(seqlen_q=300, seqlen_k=333, total_q=0, total_k=0, left=0, right=0,
                  scale=kw["scale"], GROUP=2, D=128, HAS_LEFT=False, HAS_RIGHT=True,
                  IS_VARLEN=False, HAS_SEQUSED_K=False)
    for g in (dkdv, dqk):
        assert {n: g.named[n] for n in common} == common
    assert {n: dkdv.named[n] for n in ("BLOCK_M", "STAGES", "EARLY_DP", "CONSUMER_REGS",
                                        "num_warps")} == dict(
        BLOCK_M=cfg.block_m, STAGES=cfg.num_stages, EARLY_DP=cfg.early_dp,
        CONSUMER_REGS=cfg.consumer_regs, num_warps=cfg.num_warps)
    assert dqk.named["BLOCK_N"] == configs.BWD_SM90_DQ[128].block_n
    assert set(dkdv.kwargs) <= set(bwd_sm90._dkdv_sm90_kernel.arg_names) | {"num_warps"}
    assert dsink.shape == (4,)


@pytest.mark.parametrize("stats_tma, role_split", [(True, True), (True, False), (False, True)])
def test_backward_head_dim_256_role_split(kernels, monkeypatch, stats_tma, role_split):
    """D = 256's dK/dV: the Hopper kernel's role split (ROLE_SPLIT) over 64-key blocks, where
    lse and delta come by TMA (it reads them from its ring only); else bwd.py's kernel."""
    monkeypatch.setattr(bwd, "tma_ok", lambda *t: stats_tma)  # (a CPU tensor: False)
    monkeypatch.setattr(bwd_sm90, "ROLE_SPLIT", role_split)
    q, k, v, kw = _dense(d=256, sq=100, sk=90)
    _, (dq, dk, dv, _) = _backward(q, k, v, kw)
    if not (stats_tma and role_split):
        assert kernels.names() == ["bwd_pre", "dkdv", "dq_sm90"]
        assert kernels.of("dkdv").grid[1:] == (2, 2)
        return
    assert kernels.names() == ["bwd_pre", "dkdv_sm90", "dq_sm90"]
    g = kernels.of("dkdv_sm90")
    assert g.grid == (2, 2, 2)  # (ceil(90 / 64) key blocks, Hkv, B)
    assert g.named["ROLE_SPLIT"] and g.named["P_F32"] == bwd_sm90.ROLE_P_F32
    assert g.named["STATS_TMA"] and g.named["HOST_DESC"] and not g.named["FUSED_DQ"]
    # Dense: descriptors made on the host, keys in 64-row boxes, Q and dO in BLOCK_M rows.
    for name, t, rows in (("k", k, 64), ("dk", dk, 64), ("q", q, g.named["BLOCK_M"])):
        desc = g.named[name]
        assert isinstance(desc, TensorDescriptor) and desc.base is t
        assert desc.block_shape == [1, rows, 256]
    # Not deterministic: still the two passes (the fused one is D = 128's).
    kernels.log.clear()
    _backward(q, k, v, kw, deterministic=False)
    assert kernels.names() == ["bwd_pre", "dkdv_sm90", "dq_sm90"]


def test_backward_without_keys_runs_no_dkdv(kernels):
    q, k, v, kw = _dense(sk=0)
    _, (dq, dk, dv, _) = _backward(q, k, v, kw)
    assert kernels.names() == ["bwd_pre", "dq_sm90"]
    assert [part for part, _, _ in kernels.asked] == ["dq"]


@pytest.mark.parametrize("off, expected", [
    ("sm90_dkdv", ["bwd_pre", "dkdv", "dq_sm90"]),
    ("sm90_dq", ["bwd_pre", "dkdv_sm90", "dq"]),
])
def test_backward_options_switch_each_pass(kernels, off, expected):
    q, k, v, kw = _dense()
    _backward(q, k, v, kw, **{off: False})
    assert kernels.names() == expected
    portable = kernels.of(expected[1] if off == "sm90_dkdv" else expected[2])
    assert portable.grid[1:] == ((2, 2) if off == "sm90_dkdv" else (4, 2))


def test_backward_varlen_hopper_grids(kernels):
    q, k, v, kw = _varlen()
    _backward(q, k, v, kw)
    # The rows no pass writes (here the keys past seqused_k) zeroed first: dq's, dk's and
    # dv's in one launch (program row 0 dq, row 1 dk and dv); no fill of the whole gradients.
    assert kernels.names() == ["bwd_zero", "bwd_pre", "dkdv_sm90", "dq_sm90"]
    zero = kernels.log[0]
    z = zero.named
    assert z["HAS_SEQUSED"] and z["seqused_k"] is kw["seqused_k"]
    assert (z["row_q"], z["row_k"], z["row_v"]) == (q[0].numel(), k[0].numel(), v[0].numel())
    assert (z["total_q"], z["total_k"]) == (q.shape[0], k.shape[0])
    assert zero.grid[1] == 2 and zero.grid[0] == -(-max(q.shape[0], k.shape[0]) // 64)
    assert kernels.of("dkdv_sm90").grid == (4, 1, 3) and kernels.of("dq_sm90").grid == (2, 4, 3)
    g = kernels.of("dq_sm90").named
    assert (g["IS_VARLEN"], g["HAS_SEQUSED_K"], g["left"], g["seqused_k"]) == (
        True, True, 31, kw["seqused_k"])


def test_backward_compile_failure_falls_back_per_pass(kernels):
    kernels.failing.add("dkdv_sm90")
    q, k, v, kw = _dense()
    with pytest.warns(RuntimeWarning, match="Hopper backward dK/dV kernel failed") as rec:
        _, (dq, dk, dv, _) = _backward(q, k, v, kw)
    assert len(rec) == 1 and rec[0].filename == __file__
    assert kernels.names() == ["bwd_pre", "dkdv_sm90", "dkdv", "dq_sm90"]
    gluon, portable = kernels.of("dkdv_sm90").named, kernels.of("dkdv").named
    # The portable dK/dV gets the arguments the Gluon one was given (the same dict's values).
    assert all(portable[n] is gluon[n] for n in gluon
               if n not in ("BLOCK_M", "STAGES", "EARLY_DP", "STATS_TMA", "CONSUMER_REGS",
                            "num_warps", "dq_acc", "stride_dqa", "FUSED_DQ", "HOST_DESC",
                            "ROLE_SPLIT", "P_F32", "LPT", "DQ_SWIZZLE", "DQ_LAG"))
    assert portable["dk"] is dk and portable["HEAD_LOOP"] == bool(
        configs.BWD_DKDV[128].head_loop)
    assert [key[0] for key in FAILURES] == ["bwd_sm90 dK/dV"]
    kernels.log.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward(q, k, v, kw)
    assert kernels.names() == ["bwd_pre", "dkdv", "dq_sm90"]


def test_backward_empty_launches_nothing(kernels):
    q, k, v, kw = _dense(sq=0)
    _, (dq, dk, dv, dsink) = _backward(q, k, v, kw)
    assert kernels.names() == []
    assert not dk.any() and not dv.any() and torch.equal(dsink, torch.zeros(4))


def test_backward_scale_log2_reaches_both_families(kernels):
    q, k, v, kw = _dense()
    _backward(q, k, v, kw, sm90_dq=False)
    expected = kw["scale"] * math.log2(math.e)
    assert kernels.of("dkdv_sm90").named["scale_log2"] == pytest.approx(expected)
    assert kernels.of("dq").named["scale_log2"] == pytest.approx(expected)


def test_backward_host_descriptors_cover_the_whole_tensors():
    """Dense calls' Hopper dK/dV takes TMA descriptors made on the host (HOST_DESC): Q, dO,
    dQ as (B, S, H * D), K, V, dK, dV as (B, S_k, H_kv * D), lse_log2 and delta as (B * H, S)
    over their padded rows, each with the kernel's block and shared layout; varlen, seqused_k
    and heads that are not adjacent keep the per-program descriptors."""
    b, s, sk, hq, hkv, d, bm = 2, 300, 333, 4, 2, 128, configs.BWD_SM90_DKDV.block_m
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16)
               for n, h in ((s, hq), (sk, hkv), (sk, hkv)))
    dout, dk, dv = torch.randn_like(q), torch.empty_like(k), torch.empty_like(v)
    delta, lse_log2 = torch.empty(2, b, hq, 304)[..., :s].unbind(0)
    dq_acc = torch.zeros(q.shape)
    got = []
    run = bwd_sm90._HostDescs(lambda *a: got.extend(a),
                              bwd_sm90._dkdv_host_spec(q.dtype, d, bm, True), s)
    run(q, k, v, dout, lse_log2, delta, dk, dv, None, None, None, dq_acc)
    # The layouts the kernel gives its buffers (``_dkdv_sm90_kernel``), written out here.
    from triton.experimental.gluon import language as gl

    row = gl.NVMMASharedLayout.get_default_for([1, bm, d], gl.bfloat16)
    kv = gl.NVMMASharedLayout.get_default_for([1, 64, d], gl.bfloat16)
    stat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    # The fused pass's float32 dQ (DQ_SWIZZLE): 32-column boxes in the 128-byte swizzle.
    dql = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    want = [(q, [b, s, hq * d], [s * hq * d, hq * d, 1], [1, bm, d], row),
            (k, [b, sk, hkv * d], [sk * hkv * d, hkv * d, 1], [1, 64, d], kv),
            (v, [b, sk, hkv * d], [sk * hkv * d, hkv * d, 1], [1, 64, d], kv),
            (dout, [b, s, hq * d], [s * hq * d, hq * d, 1], [1, bm, d], row),
            (lse_log2, [b * hq, s], [304, 1], [1, bm], stat),
            (delta, [b * hq, s], [304, 1], [1, bm], stat),
            (dk, [b, sk, hkv * d], [sk * hkv * d, hkv * d, 1], [1, 64, d], kv),
            (dv, [b, sk, hkv * d], [sk * hkv * d, hkv * d, 1], [1, 64, d], kv)]
    for desc, (t, shape, strides, block, layout) in zip(got, want):
        # Plain ints: Triton's launcher parses the block shape from the signature's text.
        assert all(type(x) is int for x in [*desc.shape, *desc.strides, *desc.block_shape])
        assert desc.base is t and desc.padding == "zero"
        assert (list(desc.shape), list(desc.strides), desc.block_shape) == (shape, strides, block)
        assert desc.layout == layout
    assert got[8:11] == [None, None, None]
    dq = got[11]
    assert dq.base is dq_acc and dq.shape == [b, s, hq * d] and dq.block_shape == [1, bm, 32]
    assert dq.layout == dql and len(got) == 12

    # The dQ kernel's (DQ_HOST_DESC): Q, dO, dQ in 64-row boxes, K, V in BLOCK_N-row ones,
    # the statistics as pointers; run twice (the fields are kept from the first call).
    bn = configs.BWD_SM90_DQ[d].block_n
    spec = bwd_sm90._dq_host_spec(q.dtype, d, bn)
    dq = torch.empty_like(q)
    for _ in range(2):
        got.clear()
        bwd_sm90._HostDescs(lambda *a: got.extend(a), spec, s)(
            q, k, v, dout, lse_log2, delta, dq, None, None, None)
        assert got[4] is lse_log2 and got[5] is delta and got[7:] == [None] * 3
        for i, t, rows in ((0, q, 64), (1, k, bn), (2, v, bn), (3, dout, 64), (6, dq, 64)):
            assert got[i].base is t and got[i].block_shape == [1, rows, d]
            assert got[i].shape == [b, t.shape[1], t.shape[2] * d]
            assert got[i].layout == spec[i][3]

    class P:
        cu_seqlens_q = seqused_k = None

    p = P()
    p.q, p.k, p.v, p.dout, p.dk, p.dv = q, k, v, dout, dk, dv
    assert bwd_sm90._host_desc_ok(p)
    p.seqused_k = torch.zeros(b, dtype=torch.int32)
    assert not bwd_sm90._host_desc_ok(p)
    p.seqused_k = None
    p.q = torch.randn(b, hq, s, d, dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) view
    assert not bwd_sm90._host_desc_ok(p)
    p.q = q[:1].expand(b, s, hq, d)  # a broadcast batch (stride 0)
    assert not bwd_sm90._host_desc_ok(p)


def test_desc_launch_passes_the_launcher_what_tritons_wrapper_would(monkeypatch):
    """``DescLaunch``'s direct path hands Triton 3.6's C launcher the argument list Triton's
    own tensor-descriptor wrapper (``wrap_handle_tensordesc``) makes from TensorDescriptor
    objects, and encodes a descriptor again only for an address it has not seen."""
    from triton.backends.nvidia import driver as nv

    from flashlse.kernels._common import DescLaunch, Launch

    fills, launched = [], []

    class Utils:  # the driver's encoder: its arguments stand for the encoding
        @staticmethod
        def fill_tma_descriptor(*a):
            fills.append(a)
            return ("map", *[tuple(x) if isinstance(x, list) else x for x in a])

    monkeypatch.setattr(triton.runtime.driver, "_active", type("D", (), {"utils": Utils})())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 5, raising=False)
    # Signature: a descriptor, a pointer, a descriptor, an int, a constexpr.
    sig = {0: "tensordesc<bf16[1, 64, 128]>", 1: "*fp32", 2: "tensordesc<fp32[1, 16]>",
           3: "i32", 4: "constexpr"}
    metas = [dict(swizzle=128, elem_size=2, elem_type=10, block_size=[1, 64, 128],
                  fp4_padded=False),
             dict(swizzle=0, elem_size=4, elem_type=7, block_size=[1, 16], fp4_padded=False)]

    class Runner:  # CudaLauncher's attributes and call, scratch-free
        launch = staticmethod(nv.wrap_handle_tensordesc(lambda *a: launched.append(a), sig, metas))
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, False, True, None, None, *args)

    class Compiled:
        run, function, packed_metadata = Runner(), 77, (4, 1, 1)

    class Jit:  # kernel[grid](*args): the JIT path's launch of the compiled kernel
        arg_names = ["a", "b", "c", "n", "C"]

        def __getitem__(self, grid):
            def go(*args):
                Compiled.run(*grid, 5, Compiled.function, Compiled.packed_metadata, None, None,
                             None, *args)
                return Compiled
            return go

    a, b, c = torch.zeros(2, 100, 256, dtype=torch.bfloat16), torch.zeros(8), torch.zeros(4, 48)
    fields = (([2, 100, 256], [25600, 256, 1], [1, 64, 128], 128), None,
              ([4, 40], [48, 1], [1, 16], 0))

    def desc(t, shape, strides, box, layout):
        return TensorDescriptor(t, shape, strides, box, bwd_sm90.gl.NVMMASharedLayout(
            swizzle_byte_width=layout, element_bitwidth=t.element_size() * 8, rank=len(box)))

    run = DescLaunch(Launch(Jit(), (3, 2), (40, 16), {}), fields, desc)
    run(a, b, c)  # the JIT path, through Triton's wrapper
    assert run._direct  # this triton's launcher is the one the direct path knows
    run(a, b, c)  # direct: encodes its own two
    assert launched[1] == launched[0] and fills[2:] == fills[:2]
    run(a, b, c)  # direct, nothing to encode: the addresses were seen
    assert launched[2] == launched[0] and len(fills) == 4
    c2 = torch.zeros(4, 48)
    run(a, b, c2)
    assert len(fills) == 5 and fills[-1][0] == c2.data_ptr()
    run.run(*[t if f is None else desc(t, *f) for t, f in zip((a, b, c2), fields)])
    assert launched[-1] == launched[-2]
    assert launched[0][:13] == (3, 2, 1, 5, 77, False, True, None, None, (4, 1, 1), None, None,
                                None)


def test_seq_args_bounds_varlen_maxima_by_the_rows():
    """The varlen grid covers at most the packed rows: max_seqlen_q / max_seqlen_k above
    them (an upper bound, as flash-attn's callers pass one) are clamped there (no sequence
    is longer, the answer is the same); below them they are kept (rows past them are not
    written: README's bad-value table)."""
    from flashlse.kernels._common import seq_args

    q, k = torch.empty(20, 2, 8), torch.empty(33, 2, 8)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    assert seq_args(q, k, cu, 2**40, 2**31 + 7) == (2, dict(seqlen_q=20, seqlen_k=33,
                                                         total_q=20, total_k=33))
    assert seq_args(q, k, cu, 12, 5)[1]["seqlen_q"] == 12
    assert seq_args(q, k, cu, 12, 5)[1]["seqlen_k"] == 5
