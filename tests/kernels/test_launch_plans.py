"""The launchers' launch plans and the public calls' kept paths against a fresh computation:
every kernel launch of a random sequence of public calls (``attention`` and
``attention_varlen`` forward+backward, ``attention_with_kvcache`` decodes, chunks and appends
on contiguous and paged caches, paged ``attention_varlen`` steps, ``merge_states``) is
recorded (launches stubbed, CPU tensors under the interpreter), once with the plan caches and
kept launches kept and once with them cleared before each call; the two logs must be equal.

Also a script, to compare two trees' launches (run in a fresh process each):

    PYTHONPATH=/tmp/old python tests/kernels/test_launch_plans.py --n 1000 --out /tmp/old.log
    PYTHONPATH=.        python tests/kernels/test_launch_plans.py --n 1000 --out /tmp/new.log
    cmp /tmp/old.log /tmp/new.log

A launch is recorded as the kernel's name, its grid and every argument by name (positional
and keyword alike, launch options included), tensors as what a launch passes of them (dtype,
which tensor of the call by data pointer, data pointer mod 16: the call's own tensors are
numbered first, so that a tensor kept from an earlier call shows), host TMA descriptors
with their shapes, strides and boxes; ``triton.set_allocator`` calls too. The
Hopper launchers run under a forced ``supported`` (their domain without the device checks,
or never), since no Gluon kernel runs here.
"""

from __future__ import annotations

import os
import random
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

import flashlse as fl
from flashlse.kernels import configs, dispatch

_LOG: list | None = None
_PTRS: dict = {}
# The tensors a call's launches saw, held to its end: a temporary freed within the call
# cannot hand its address, and so its number, to a later allocation.
_ALIVE: list = []


def _norm(x):
    if isinstance(x, torch.Tensor):
        p = x.data_ptr()
        _ALIVE.append(x)
        idx = _PTRS.setdefault(p, len(_PTRS))
        # What a launch passes of a tensor: its address (a kept launch may pass a view of
        # another shape at the same address, as merge_states' does) and dtype.
        return ("T", str(x.dtype), idx, p % 16)
    if isinstance(x, (tuple, list)):
        return tuple(_norm(y) for y in x)
    if type(x).__name__ == "TensorDescriptor":  # a host TMA descriptor: its tensor and box
        return ("D", _norm(x.base), _norm(x.shape), _norm(x.strides), _norm(x.block_shape),
                repr(x.layout), x.padding)
    if type(x).__name__ == "constexpr":
        return ("c", _norm(x.value))
    if isinstance(x, float):
        return ("f", x.hex() if x == x else "nan")
    if callable(x):
        return ("fn", getattr(x, "__name__", type(x).__name__))
    return x


def _inputs(*tensors):
    """Numbers the call's own tensors first, in order: a tensor kept from an earlier call
    (a stale sink, say) then gets another number than the fresh run's."""
    for x in tensors:
        if isinstance(x, torch.Tensor):
            _PTRS.setdefault(x.data_ptr(), len(_PTRS))


def _recorder(kernel, grid):
    names = kernel.arg_names
    name = getattr(kernel, "fn", kernel).__name__

    def launch(*args, **kwargs):
        if _LOG is None:
            return None
        bound = dict(zip(names, args))
        assert not set(bound) & set(kwargs), name
        bound.update(kwargs)
        g = tuple(grid(bound) if callable(grid) else grid)
        _LOG.append(("launch", name, _norm(g + (1,) * (3 - len(g))),
                     tuple(sorted((k, _norm(v)) for k, v in bound.items()))))
        return None

    return launch


def _set_allocator(fn):
    if _LOG is not None:
        _LOG.append(("set_allocator", _norm(fn)))


def _fwd_domain(q, k, v, *, softcap, scale, batch):
    # fwd_sm90.supported without its device checks.
    from flashlse.kernels._common import tma_ok
    return (batch <= 65535 and q.shape[-2] <= 65535
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in configs.FWD_SM90
            and v.shape[-1] == q.shape[-1] and not softcap and scale > 0 and tma_ok(q, k, v))


def _bwd_domain(q, k, v, dout, dk, dv, *, softcap, dims):
    from flashlse.kernels._common import tma_ok
    return (q.dtype in (torch.float16, torch.bfloat16) and not softcap
            and q.shape[-1] in dims and v.shape[-1] == q.shape[-1]
            and min(q.numel(), k.numel()) > 0 and tma_ok(q, k, v, dout, dk, dv))


def _domains():
    """``(module, the domain without the device checks)`` of each Hopper launcher the
    dispatchers ask (the paged forward's ``paged_supported`` asks ``fwd_sm90.supported``;
    the Hopper MLA decode is never asked under the interpreter)."""
    mods = ((dispatch.fwd_sm90, _fwd_domain), (dispatch.bwd_sm90, _bwd_domain))
    return [(mod, fn) for mod, fn in mods if mod is not None]


class _Stubs:
    """Launches recorded, ``supported`` forced: ``sm90`` is "domain" or "never"."""

    def __enter__(self):
        import triton
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import KernelInterface
        self.saved = [(InterpretedFunction, "__getitem__", InterpretedFunction.__dict__.get(
                          "__getitem__")),
                      (KernelInterface, "__getitem__", KernelInterface.__dict__["__getitem__"]),
                      (triton, "set_allocator", triton.set_allocator)]
        for mod, fn in _domains():
            self.saved.append((mod, "supported", mod.supported))
            mod.supported = fn
        if dispatch.fwd_sm90 is not None:  # an H100 / H200's 132 SMs, not a device query
            self.saved.append((dispatch.fwd_sm90, "_sm_count", dispatch.fwd_sm90._sm_count))
            dispatch.fwd_sm90._sm_count = lambda device: 132
        InterpretedFunction.__getitem__ = _recorder
        KernelInterface.__getitem__ = _recorder
        triton.set_allocator = _set_allocator
        return self

    def __exit__(self, *exc):
        for obj, name, val in reversed(self.saved):
            if val is None:
                delattr(obj, name)
            else:
                setattr(obj, name, val)


_MODE = [None]
_STASHED: dict = {}


def set_sm90(mode):
    # The Hopper domains are functions of the call's metadata on one device, kept in the
    # plans: a change of the forced domain is a change of device, each with its own plans
    # (stashed while the other mode runs, so that repeats of either find theirs).
    if mode != _MODE[0]:
        caches = _caches()
        _STASHED[_MODE[0]] = [dict(c) for c in caches]
        for cache, kept in zip(caches, _STASHED.pop(mode, [{}] * len(caches))):
            cache.clear()
            cache.update(kept)
        _MODE[0] = mode
    for mod, fn in _domains():
        mod.supported = fn if mode == "domain" else (lambda *a, **k: False)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DIMS = (32, 59, 64, 128, 256)


def _tensor(rng, shape, dtype, *, kind):
    """A tensor of ``shape``, contiguous or not: padded last dim, permuted rows/heads, or an
    offset base (the offset drawn each call: the same strides at other alignments)."""
    if kind == "pad":
        big = torch.randn(*shape[:-1], shape[-1] + rng.choice((1, 8)), dtype=dtype)
        return big[..., :shape[-1]]
    if kind == "perm" and len(shape) == 4:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, dtype=dtype).transpose(1, 2)
    if kind == "offset":
        n = 1
        for x in shape:
            n *= x
        off = rng.choice((0, 1, 2, 4, 8))
        return torch.randn(n + off, dtype=dtype)[off:].view(shape)
    return torch.randn(*shape, dtype=dtype)


def _template(rng):
    """Call metadata: everything but the tensors' values and addresses."""
    api = rng.choice(("attention",) * 6 + ("kvcache",) * 2 + ("paged", "merge", "sparse"))
    if api != "attention":
        return dict(api=api, sm90=rng.choice(("domain", "domain", "never")),
                    opts=_options(rng), **_SERVING[api](rng))
    d = rng.choice(_DIMS)
    hkv = rng.choice((1, 2))
    t = dict(
        api=api,
        varlen=rng.random() < 0.4,
        dtype=rng.choice(_DTYPES),
        d=d,
        dv=d if rng.random() < 0.85 else rng.choice(_DIMS),
        hkv=hkv,
        hq=hkv * rng.choice((1, 2, 3)),
        b=rng.choice((0, 1, 2, 3)) if rng.random() < 0.1 else rng.choice((1, 2, 3)),
        sq=rng.choice((0, 1, 5, 16, 33, 70)[rng.random() >= 0.15:]),
        sk=rng.choice((0, 1, 7, 16, 40, 90)[rng.random() >= 0.15:]),
        causal=rng.random() < 0.4,
        window=rng.choice(((None, None),) * 3 + ((3, None), (None, 2), (5, 0), (0, 0))),
        softcap=rng.choice((0.0, 0.0, 0.0, 5.0)),
        scale=rng.choice((None, None, 0.3, -0.2, 1.0)),
        sink=rng.random() < 0.25,
        seqused=rng.random() < 0.3,
        kinds=tuple(rng.choice(("plain", "pad", "perm", "offset", "offset"))
                    if rng.random() < 0.4 else "plain" for _ in range(4)),
        lse=rng.random() < 0.3,
        bwd=rng.random() < 0.85,
        sm90=rng.choice(("domain", "domain", "never")),
        opts=_options(rng),
    )
    if t["causal"]:
        t["window"] = (None, None)
    return t


def _scalars(rng):
    causal = rng.random() < 0.4
    return dict(causal=causal,
                window=(None, None) if causal else rng.choice(
                    ((None, None),) * 3 + ((3, None), (None, 2), (5, 0))),
                softcap=rng.choice((0.0, 0.0, 0.0, 5.0)),
                scale=rng.choice((None, None, 0.3, -0.2)),
                sink=rng.random() < 0.25, lse=rng.random() < 0.4,
                kinds=tuple(rng.choice(("plain", "offset", "perm")) if rng.random() < 0.3
                            else "plain" for _ in range(2)))


def _kvcache_template(rng):
    """A serving call on a cache: decodes (Sq <= 16) and chunks, contiguous or paged
    (pages of 1 to 64 rows), MLA (576 / 512, v a view of k) or not, appends, splits."""
    mla = rng.random() < 0.2
    hkv = 1 if mla else rng.choice((1, 2))
    d = 576 if mla else rng.choice((64, 128))
    return dict(mla=mla, hkv=hkv, hq=hkv * rng.choice((1, 4, 16)), d=d, dv=512 if mla else d,
                dtype=rng.choice((torch.bfloat16, torch.float16, torch.float32)),
                b=rng.choice((1, 2, 3)), sq=rng.choice((1, 1, 2, 16, 20, 130)),
                smax=rng.choice((64, 256)), page=rng.choice((None, None, 1, 8, 16, 64)),
                lens=rng.random() < 0.85, snew=rng.choice((0, 0, 0, 1, 3)),
                splits=rng.choice((0, 0, 1, 3)), **_scalars(rng))


def _paged_template(rng):
    """A paged ``attention_varlen`` step: decodes and prefills of a batch whose lengths
    change every call."""
    hkv = rng.choice((1, 2))
    return dict(hkv=hkv, hq=hkv * rng.choice((1, 4, 8)), d=rng.choice((64, 128)),
                dtype=rng.choice((torch.bfloat16, torch.float16)), b=rng.choice((1, 2, 4)),
                sq=rng.choice((1, 4, 40, 200)), page=rng.choice((8, 16, 64)), pages=8,
                **_scalars(rng))


def _merge_template(rng):
    layout = rng.choice(("rows", "flash"))
    return dict(n=rng.choice((2, 3, 8)), layout=layout, d=rng.choice((64, 128, 512)),
                dtype=rng.choice((torch.float32, torch.bfloat16)), rows=rng.choice((1, 7, 64)),
                sink=rng.random() < 0.25, kinds=(rng.choice(("plain", "offset")), "plain"))


def _sparse_template(rng):
    """A top-k call: dense or paged keys (MLA 576 / 512 with v a view of k, or not), decode or
    prefill rows, lists with -1 entries, forward and (dense) backward."""
    mla = rng.random() < 0.4
    hkv = 1 if mla else rng.choice((1, 2))
    d = 576 if mla else rng.choice((64, 128))
    return dict(mla=mla, hkv=hkv, hq=hkv * rng.choice((1, 8, 16)), d=d, dv=512 if mla else d,
                dtype=rng.choice((torch.bfloat16, torch.float16, torch.float32)),
                b=rng.choice((1, 2)), sq=rng.choice((1, 2, 40)), sk=rng.choice((64, 300)),
                topk=rng.choice((16, 64, 100)), page=rng.choice((None, None, 1, 64)),
                sink=rng.random() < 0.25, lse=rng.random() < 0.4,
                scale=rng.choice((None, None, 0.3)), bwd=rng.random() < 0.3,
                kinds=(rng.choice(("plain", "offset")), "plain"))


_SERVING = {"kvcache": _kvcache_template, "paged": _paged_template, "merge": _merge_template,
            "sparse": _sparse_template}


def _options(rng):
    r = rng.random()
    if r < 0.6:
        return {}
    pick = rng.choice(("fwd", "bwd", "flags", "poison", "tune"))
    if pick == "fwd":
        return {"fwd_config": rng.choice(({"BLOCK_N": 32}, {"BLOCK_M": 32, "num_warps": 2},
                                          {"USE_TMA": False}, {"GROUP_HEADS": 2},
                                          {"WARP_SPECIALIZE": True, "USE_TMA": True}))}
    if pick == "bwd":
        return {"bwd_config": rng.choice(({"dkdv": (32, 32, 4, 1)}, {"dq": (16, 32, 4, 2)},
                                          {"USE_TMA": False}, {"EARLY_DP": True},
                                          {"STATS_TMA": False}, {"HEAD_LOOP": True}))}
    if pick == "flags":
        return {name: rng.random() < 0.5 for name in (
            "sm90_fwd", "sm90_fwd_paged", "sm90_dkdv", "sm90_dq", "pdl")}
    if pick == "poison":
        return {"poison_outputs": True}
    return {"autotune_bwd": True}


def _serving_kw(t, hq):
    kw = dict(causal=t["causal"], window=t["window"], softcap=t["softcap"], scale=t["scale"],
              return_lse=t["lse"])
    if t["sink"]:
        kw["sink"] = torch.randn(hq, dtype=torch.float32)
    return kw


def _call_kvcache(rng, t):
    dt, b, sq, smax, hkv = t["dtype"], t["b"], t["sq"], t["smax"], t["hkv"]
    kw = _serving_kw(t, t["hq"])
    q = _tensor(rng, (b, sq, t["hq"], t["d"]), dt, kind=t["kinds"][0])
    page = t["page"]
    rows = (b * smax // page + 3, page) if page else (b, smax)
    k = _tensor(rng, (*rows, hkv, t["d"]), dt, kind=t["kinds"][1])
    v = k[..., :t["dv"]] if t["mla"] else torch.randn(*rows, hkv, t["dv"], dtype=dt)
    if page:
        kw["block_table"] = torch.randperm(rows[0])[:b * smax // page].view(b, -1).int()
    if t["lens"] or page or t["snew"]:  # (a paged cache and an append need them)
        kw["cache_seqlens"] = torch.tensor([rng.randint(0, smax - t["snew"]) for _ in range(b)],
                                           dtype=torch.int32)
    if t["snew"]:
        kw["k_new"] = torch.randn(b, t["snew"], hkv, t["d"], dtype=dt)
        kw["v_new"] = torch.randn(b, t["snew"], hkv, t["dv"], dtype=dt)
    _inputs(q, k, v, *kw.values())
    with torch.no_grad():
        fl.attention_with_kvcache(q, k, v, num_splits=t["splits"], **kw)


def _call_paged(rng, t):
    dt, b, page, hkv = t["dtype"], t["b"], t["page"], t["hkv"]
    kw = _serving_kw(t, t["hq"])
    lq = [rng.randint(1, t["sq"]) for _ in range(b)]
    lk = [rng.randint(0, t["pages"] * page) for _ in range(b)]
    q = _tensor(rng, (sum(lq), t["hq"], t["d"]), dt, kind=t["kinds"][0])
    n_pages = b * t["pages"] + 2
    k = torch.randn(n_pages, page, hkv, t["d"], dtype=dt)
    table = torch.randperm(n_pages)[:b * t["pages"]].view(b, -1).int()
    cq = torch.tensor([0, *_cumsum(lq)], dtype=torch.int32)
    used = torch.tensor(lk, dtype=torch.int32)
    _inputs(q, k, cq, table, used, *kw.values())
    with torch.no_grad():
        fl.attention_varlen(q, k, k, cq, None, max(lq), max(lk), block_table=table,
                            seqused_k=used, **kw)


def _call_merge(rng, t):
    n, rows, d = t["n"], t["rows"], t["d"]
    if t["layout"] == "flash":
        shape, lse_shape, h = (n, 2, rows, 4, d), (n, 2, 4, rows), 4
    else:
        shape, lse_shape, h = (n, rows, 3, d), (n, rows, 3), 3
    outs = _tensor(rng, shape, t["dtype"], kind=t["kinds"][0])
    lses = torch.randn(*lse_shape)
    sink = None
    if t["sink"]:
        sink = torch.randn(h, 1) if t["layout"] == "flash" else torch.randn(h)
    _inputs(outs, lses, sink)
    fl.merge_states(outs, lses, sink=sink, layout=t["layout"])


def _call_sparse(rng, t):
    dt, b, sk, hkv, page = t["dtype"], t["b"], t["sk"], t["hkv"], t["page"]
    q = _tensor(rng, (b, t["sq"], t["hq"], t["d"]), dt, kind=t["kinds"][0])
    per = -(-sk // page) if page else 0  # pages a sequence
    rows = (b * per + 2, page) if page else (b, sk)
    k = torch.randn(*rows, hkv, t["d"], dtype=dt)
    v = k[..., :t["dv"]] if t["mla"] else torch.randn(*rows, hkv, t["dv"], dtype=dt)
    idx = torch.randint(-1, sk, (b, t["sq"], hkv, t["topk"]), dtype=torch.int32)
    kw = dict(scale=t["scale"], return_lse=t["lse"])
    if t["sink"]:
        kw["sink"] = torch.randn(t["hq"], dtype=torch.float32)
    if page:
        kw["block_table"] = torch.randperm(rows[0])[:b * per].view(b, per).int()
    grad = t["bwd"] and not page
    for x in (q, k, v) if grad and not t["mla"] else ():
        x.requires_grad_()
    _inputs(q, k, v, idx, *kw.values())
    res = fl.sparse_attention(q, k, v, idx, **kw)
    if grad and not t["mla"]:
        outs = res if isinstance(res, tuple) else (res,)
        grads = [torch.randn(o.shape, dtype=o.dtype) for o in outs]
        _inputs(*grads)
        torch.autograd.backward(outs, grads)


def _call(rng, t):
    if t["api"] != "attention":
        return {"kvcache": _call_kvcache, "paged": _call_paged, "merge": _call_merge,
                "sparse": _call_sparse}[t["api"]](rng, t)
    dt, d, dv = t["dtype"], t["d"], t["dv"]
    hq, hkv, b, sq, sk = t["hq"], t["hkv"], t["b"], t["sq"], t["sk"]
    kq, kk, kv, kd = t["kinds"]
    kw = dict(causal=t["causal"], window=t["window"], softcap=t["softcap"], scale=t["scale"],
              return_lse=t["lse"])
    if t["sink"]:
        kw["sink"] = torch.randn(hq, dtype=torch.float32)
    if t["varlen"]:
        lq = [rng.randint(0, max(sq, 1)) for _ in range(b)]
        lk = [rng.randint(0, max(sk, 1)) for _ in range(b)]
        cq = torch.tensor([0] + list(_cumsum(lq)), dtype=torch.int32)
        ck = torch.tensor([0] + list(_cumsum(lk)), dtype=torch.int32)
        q = _tensor(rng, (sum(lq), hq, d), dt, kind=kq)
        k = _tensor(rng, (sum(lk), hkv, d), dt, kind=kk)
        v = _tensor(rng, (sum(lk), hkv, dv), dt, kind=kv)
        if t["seqused"]:
            kw["seqused_k"] = torch.tensor(lk, dtype=torch.int32)
        args = (q, k, v, cq, ck, max(lq + [0]), max(lk + [0]))
        fn = fl.attention_varlen
    else:
        q = _tensor(rng, (b, sq, hq, d), dt, kind=kq)
        k = _tensor(rng, (b, sk, hkv, d), dt, kind=kk)
        v = _tensor(rng, (b, sk, hkv, dv), dt, kind=kv)
        args = (q, k, v)
        fn = fl.attention
    for x in (q, k, v):
        x.requires_grad_(t["bwd"])
    _inputs(*args, *kw.values())
    res = fn(*args, **kw)
    if t["bwd"]:
        outs = res if isinstance(res, tuple) else (res,)
        grads = [_tensor(rng, tuple(o.shape), o.dtype, kind=kd) for o in outs]
        _inputs(*grads)
        torch.autograd.backward(outs, grads)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _caches():
    """Every launch-plan cache of the launchers (those that have one) and the launches and
    plans the public calls keep for their repeats."""
    import importlib

    from flashlse.kernels import bwd, bwd_sm90, combine, decode, fwd, fwd_sm90
    ops = [importlib.import_module(f"flashlse.ops.{m}")
           for m in ("attention", "kvcache", "merge", "sparse")]
    return [getattr(mod, name) for mod in (fwd, bwd, fwd_sm90, bwd_sm90, dispatch, decode,
                                           combine, *ops)
            for name in ("_PLANS", "_BWD_PLANS", "_SM90_PLANS", "_KEPT", "_CHUNK_KEPT",
                         "_PAGED_KEPT", "_PAIR_KEPT", "_APPEND_PLANS")
            if mod is not None and getattr(mod, name, None) is not None]


def clear_plans():
    """Empties every cache of :func:`_caches`."""
    for cache in _caches():
        cache.clear()


def _sibling(rng, t):
    """``t`` with one thing drawn anew to another value: mostly one kernel option flipped,
    or a scalar beside the tensors; a field a kept key leaves out then shows as another
    launch in the fresh log (called right after ``t``, whose launch is kept)."""
    r = rng.random()
    if r < 0.4:
        flag = rng.choice(_FLAGS)
        on = t["opts"].get(flag, getattr(fl.KernelOptions(), flag))
        return dict(t, opts=dict(t["opts"], **{flag: not on}))
    fields = sorted(set(t) - {"api"})
    if r < 0.8:
        fields = [f for f in fields if f in _SCALAR_FIELDS]
    field = rng.choice(fields)
    for _ in range(20):
        other = _template(rng)
        if other["api"] == t["api"] and repr(other[field]) != repr(t[field]):
            new = dict(t, **{field: other[field]})
            if new.get("causal"):
                new["window"] = (None, None)
            return new
    return t


# The KernelOptions flags a sibling call flips.
_FLAGS = ("sm90_fwd", "sm90_fwd_paged", "sm90_dkdv", "sm90_dq", "sm90_mla_decode", "pdl",
          "poison_outputs", "autotune_bwd")
_SCALAR_FIELDS = {"causal", "window", "softcap", "scale", "sink", "lse", "bwd", "opts", "sm90",
                  "kinds", "splits", "layout", "seqused"}


def trace(n, seed=0, fresh=False):
    """The launch log of ``n`` random public calls (a pool of call metadata, drawn again
    with new tensors: repeated and new metadata, other addresses and alignments)."""
    global _LOG
    clear_plans()  # (and nothing kept from an earlier trace in this process)
    _STASHED.clear()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = [_template(rng) for _ in range(max(8, n // 6))]
    log = []
    with _Stubs(), fl.value_checks(False):
        t = None
        for i in range(n):
            if t is not None and rng.random() < 0.35:
                t = _sibling(rng, t)
                pool.append(t)
            else:
                t = rng.choice(pool)
            set_sm90(t["sm90"])
            if fresh:
                clear_plans()
            _PTRS.clear()
            _ALIVE.clear()
            _LOG = log
            log.append(("call", i))
            try:
                with fl.kernel_options(**t["opts"]):
                    _call(rng, t)
            except Exception as e:  # noqa: BLE001 - a rejected call is part of the log
                log.append(("error", type(e).__name__, str(e)[:200]))
            finally:
                _LOG = None
    return log


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors reach the launchers under TRITON_INTERPRET=1 only")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_plans_match_fresh_computation(seed):
    """4000 calls a seed: a kept key that leaves out a scalar, a sink or a kernel option
    (each tried by hand: the kvcache decode's softcap, the paged chunk's sink, attention's
    sm90_fwd) shows in at least one of the three seeds."""
    cached = trace(4000, seed=seed)
    fresh = trace(4000, seed=seed, fresh=True)
    launches = sum(e[0] == "launch" for e in cached)
    assert launches > 6000
    assert sum(e[0] == "error" for e in cached) < 80
    assert len(cached) == len(fresh)
    for a, b in zip(cached, fresh):
        assert repr(a) == repr(b)


if __name__ == "__main__":
    import argparse
    import warnings

    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    log = trace(a.n, a.seed, a.fresh)
    with open(a.out, "w") as f:
        for e in log:
            f.write(repr(e) + "\n")
    kinds = {}
    for e in log:
        what = e[1] if e[0] == "launch" else e[0]
        kinds[what] = kinds.get(what, 0) + 1
    print(fl.__file__, kinds, file=sys.stderr)
