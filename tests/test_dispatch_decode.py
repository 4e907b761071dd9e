"""``kernels/decode.py``'s plan: which decode kernel an MLA call runs, and with what arguments.

As tests/test_dispatch.py does for the attention passes: the kernels are recorders (no GPU,
no interpreter) and the Hopper MLA kernel's ``supported`` a stub, so these tests see the
decisions of ``decode._decode_plan``, the one dispatch point of the decode launcher. They
check that the Gluon kernel gets every one of its arguments (a renamed parameter fails here,
not on the GPU), the flags each kind of call sets, the portable kernel when the option is off,
and the once-only fallback when the Gluon kernel fails to compile. The numbers are tested on
the H200 (tests/kernels/test_decode_mla_sm90.py).
"""

from __future__ import annotations

import pytest
import torch
import triton
from test_dispatch import Kernels, _Kernel

from flashlse import kernel_options
from flashlse.kernels import combine, decode
from flashlse.kernels.failures import FAILURES

mla = pytest.importorskip("flashlse.kernels.decode_mla_sm90")


@pytest.fixture
def kernels(monkeypatch):
    k = Kernels()
    k.supported = {"mla": True}
    for mod, attr, name in ((decode, "_decode_fwd_kernel", "decode"),
                            (mla, "_mla_decode_kernel", "mla"),
                            (combine, "_merge_states_fwd_kernel", "merge")):
        monkeypatch.setattr(mod, attr, _Kernel(name, k.log, getattr(mod, attr),
                                               lambda kw, n=name: n in k.failing))
    monkeypatch.setattr(triton, "set_allocator", lambda fn: None)

    def supported(*args, **kwargs):
        # The real predicate but its device test (these tensors are on the CPU).
        k.asked.append(("mla", args, kwargs))
        return k.supported["mla"] and fits(*args, **kwargs)

    fits = mla.fits

    monkeypatch.setattr(mla, "supported", supported)
    monkeypatch.setattr(decode, "_PLANS", {})
    with FAILURES.isolated():
        yield k


def _mla(b=2, sq=1, hq=128, smax=256, page=None, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, hq, 576, generator=gen).to(dtype)
    if page:
        cache = torch.randn(b * smax // page, page, 1, 576, generator=gen).to(dtype)
        table = torch.arange(b * smax // page, dtype=torch.int32).view(b, -1)
    else:
        cache = torch.randn(b, smax, 1, 576, generator=gen).to(dtype)
        table = None
    lens = torch.tensor([smax, smax // 3][:b], dtype=torch.int32)
    return q, cache, cache[..., :512], lens, table


def _call(q, k, v, lens, table, **kw):
    args = dict(cache_seqlens=lens, block_table=table, left=None, right=None, softcap=0.0,
                scale=0.05, sink=None, num_splits=1)
    args.update(kw)
    return decode.decode_fwd(q, k, v, **args)


def test_mla_call_takes_the_hopper_kernel_with_every_argument(kernels):
    q, k, v, lens, table = _mla()
    sink = torch.randn(128)
    _call(q, k, v, lens, table, sink=sink)
    assert kernels.names() == ["mla"]
    launch = kernels.of("mla")
    # Every parameter of the kernel is passed, by position (the plan's Launch), and the
    # launch options by name.
    assert set(launch.named) - set(launch.kwargs) == set(mla._mla_decode_kernel.arg_names)
    assert launch.kwargs == {"num_warps": 4}
    assert launch.grid == (2 * 2, 1, 1)  # B x row tiles of 64, one split
    n = launch.named
    assert (n["SQ"], n["GROUP"], n["M_TILES"], n["PAGED"], n["TOKEN_TABLE"]) == (1, 128, 2, False,
                                                                                False)
    assert n["HAS_SINK"] and n["HAS_SEQLENS"] and n["PREFETCH"] == mla.PREFETCH_TILES
    assert not n["WHOLE_TILES"]
    assert (n["PRODUCER_WARPS"], n["PRODUCER_REGS"], n["CONSUMER_REGS"]) == (1, 24, 240)
    assert n["k_rows"] == 2 * 256 and n["stride_kn"] == 576 and n["stride_qh"] == 576
    assert n["sink"] is sink and n["v"] is v


@pytest.mark.parametrize("page", [8, 16, 32, 64])
def test_mla_paged_call_sets_its_pages(kernels, page):
    q, k, v, lens, table = _mla(page=page)
    _call(q, k, v, lens, table, num_splits=3)
    assert kernels.names() == ["mla", "merge"]
    n = kernels.of("mla").named
    assert (n["PAGED"], n["PAGE_SIZE"], n["num_pages"], n["num_splits"]) == (True, page,
                                                                            512 // page, 3)
    # One whole tile at a time below 32-row pages (RESULTS.md session 12), else in parts.
    assert n["WHOLE_TILES"] == (page < mla.WHOLE_TILES_BELOW_PAGE) == (page < 32)
    assert n["block_table"] is table and kernels.of("mla").grid == (4, 3, 1)
    # Split partials in float32, the sink (none here) left to the merge.
    assert n["o"].dtype == torch.float32 and not n["HAS_SINK"]


def test_mla_few_heads_prefetch_nothing(kernels):
    # One row tile a sequence (Hq = 16): memory-bound, the L2 prefetch cost there.
    q, k, v, lens, table = _mla(hq=16)
    _call(q, k, v, lens, table)
    n = kernels.of("mla").named
    assert (n["M_TILES"], n["PREFETCH"]) == (1, 0)


def test_mla_token_table_gathers_with_the_topk_split(kernels):
    q = torch.randn(6, 1, 128, 576).half()
    pages = torch.randn(1400, 1, 1, 576).half()
    table = torch.zeros(6, 200, dtype=torch.int32)
    decode.decode_fwd(q, pages, pages[..., :512], cache_seqlens=None, block_table=table,
                      left=None, right=None, softcap=0.0, scale=0.05, sink=None, num_splits=1,
                      token_table=(700, 3, 1))
    n = kernels.of("mla").named
    assert (n["TOKEN_TABLE"], n["TOKEN_PAGE"], n["table_sk"], n["table_per_batch"]) == (
        True, 0, 700, 3)
    # The gathering producer's warps and registers and the consumers' registers: TOPK_SPLIT
    # (not the dense kernel's one producer warp of 24 registers and consumers of 240).
    assert (n["PRODUCER_WARPS"], n["PRODUCER_REGS"], n["CONSUMER_REGS"]) == (4, 48, 216)
    assert (n["PREFETCH"], n["HAS_SEQLENS"]) == (0, False)
    # One-row pages, but top-k lists are refilled in parts (their gather measured no faster
    # whole).
    assert not n["WHOLE_TILES"]


def test_mla_token_table_with_a_window_runs_the_portable_kernel(kernels):
    # The Gluon kernel masks no window on token tables: its domain leaves them out.
    q = torch.randn(6, 1, 128, 576).half()
    pages = torch.randn(1400, 1, 1, 576).half()
    table = torch.zeros(6, 200, dtype=torch.int32)
    decode.decode_fwd(q, pages, pages[..., :512], cache_seqlens=None, block_table=table,
                      left=10, right=None, softcap=0.0, scale=0.05, sink=None, num_splits=1,
                      token_table=(700, 3, 1))
    assert kernels.names() == ["decode"]


@pytest.mark.parametrize("supported, on", [(False, True), (True, False)])
def test_mla_portable_outside_the_domain_or_switched_off(kernels, supported, on):
    kernels.supported["mla"] = supported
    q, k, v, lens, table = _mla()
    with kernel_options(sm90_mla_decode=on):
        _call(q, k, v, lens, table)
    assert kernels.names() == ["decode"]


def test_mla_compile_failure_warns_once_and_falls_back(kernels):
    kernels.failing.add("mla")
    q, k, v, lens, table = _mla()
    with pytest.warns(RuntimeWarning, match="the Hopper MLA decode kernel failed"):
        _call(q, k, v, lens, table)
    assert kernels.names() == ["mla", "decode"]
    assert len(FAILURES) == 1
    _call(q, k, v, lens, table)  # remembered: no second warning, no second try
    assert kernels.names() == ["mla", "decode", "decode"]


def _fits(q, k, v, paged=False, softcap=0.0, token_table=None):
    return mla.fits(q, k, v, paged=paged, softcap=softcap, token_table=token_table)


def test_mla_domain_is_one_latent_head_with_v_its_view():
    q, k, v, _, _ = _mla()
    assert _fits(q, k, v)
    kb = k.bfloat16()
    assert _fits(q.bfloat16(), kb, kb[..., :512])
    assert not _fits(q, k, k[..., :512].clone())  # V its own tensor: not MLA's shared read
    assert not _fits(q, k, v, softcap=30.0)
    assert not _fits(q.float(), k.float(), k.float()[..., :512])
    assert not _fits(q[..., :512], k[..., :512], k[..., :448])  # other head dims
    two = torch.randn(2, 256, 2, 576).half()
    assert not _fits(q, two, two[..., :512])  # two latent heads


@pytest.mark.parametrize("page, ok", [(8, True), (16, True), (32, True), (64, True), (128, True),
                                      (192, True), (1, False), (4, False), (48, False)])
def test_mla_domain_page_sizes(page, ok):
    q, k, v, _, _ = _mla(smax=384, page=page)
    assert _fits(q, k, v, paged=True) is ok


def test_mla_domain_strides_and_alignment():
    q, k, v, _, _ = _mla(sq=2)
    assert _fits(q, k, v)
    # Two query rows whose (position, head) rows are not one stride apart: no descriptor.
    assert not _fits(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    # One query row: its stride is never read.
    q1 = torch.randn(2, 128, 1, 576).half().transpose(1, 2)
    assert q1.stride(1) != 128 * q1.stride(2) and _fits(q1, k, v)
    # Rows not 16-byte aligned (an odd offset into a buffer).
    buf = torch.randn(2 * 256 * 576 + 1).half()
    k_odd = buf[1:].view(2, 256, 1, 576)
    assert not _fits(q, k_odd, k_odd[..., :512])
    # Token tables: one-row pages of one latent head only.
    pages = torch.randn(1400, 1, 1, 576).half()
    assert _fits(q[:, :1], pages, pages[..., :512], paged=True, token_table=(700, 3, 1))
    assert not _fits(q[:, :1], pages, pages[..., :512], paged=True, token_table=(700, 3, 2))
