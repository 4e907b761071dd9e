"""The attention launchers' launch plans against a fresh computation: every kernel launch of
a random sequence of public forward+backward calls is recorded (launches stubbed, CPU tensors
under the interpreter), once with the plan caches kept and once with them cleared before each
call; the two logs must be equal.

Also a script, to compare two trees' launches (run in a fresh process each):

    PYTHONPATH=/tmp/old python tests/kernels/test_launch_plans.py --n 1000 --out /tmp/old.log
    PYTHONPATH=.        python tests/kernels/test_launch_plans.py --n 1000 --out /tmp/new.log
    cmp /tmp/old.log /tmp/new.log

A launch is recorded as the kernel's name, its grid and every argument by name (positional
and keyword alike, launch options included), tensors as (shape, strides, dtype, which tensor
of the call by data pointer, data pointer mod 16); ``triton.set_allocator`` calls too. The
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


def _norm(x):
    if isinstance(x, torch.Tensor):
        p = x.data_ptr()
        idx = _PTRS.setdefault(p, len(_PTRS))
        return ("T", tuple(x.shape), x.stride(), str(x.dtype), idx, p % 16)
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
        for mod, fn in ((dispatch.fwd_sm90, _fwd_domain), (dispatch.bwd_sm90, _bwd_domain)):
            if mod is not None:
                self.saved.append((mod, "supported", mod.supported))
                mod.supported = fn
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


def set_sm90(mode):
    # The Hopper domains are functions of the call's metadata on one device, kept in the
    # plans: a change of the forced domain is a change of device.
    if mode != _MODE[0]:
        clear_plans()
        _MODE[0] = mode
    for mod, fn in ((dispatch.fwd_sm90, _fwd_domain), (dispatch.bwd_sm90, _bwd_domain)):
        if mod is not None:
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
    d = rng.choice(_DIMS)
    hkv = rng.choice((1, 2))
    t = dict(
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
        return {"sm90_fwd": rng.random() < 0.5, "sm90_dkdv": rng.random() < 0.5,
                "sm90_dq": rng.random() < 0.5}
    if pick == "poison":
        return {"poison_outputs": True}
    return {"autotune_bwd": True}


def _call(rng, t):
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
    res = fn(*args, **kw)
    if t["bwd"]:
        outs = res if isinstance(res, tuple) else (res,)
        grads = [_tensor(rng, tuple(o.shape), o.dtype, kind=kd) for o in outs]
        torch.autograd.backward(outs, grads)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def clear_plans():
    """Empties every launch-plan cache of the attention launchers (those that have one) and
    the launches ``attention`` keeps for its repeated calls."""
    import importlib

    from flashlse.kernels import bwd, bwd_sm90, fwd, fwd_sm90
    attention_ops = importlib.import_module("flashlse.ops.attention")
    for mod in (fwd, bwd, fwd_sm90, bwd_sm90, dispatch, attention_ops):
        for name in ("_PLANS", "_BWD_PLANS", "_SM90_PLANS", "_KEPT"):
            cache = getattr(mod, name, None)
            if cache is not None:
                cache.clear()


def trace(n, seed=0, fresh=False):
    """The launch log of ``n`` random public calls (a pool of call metadata, drawn again
    with new tensors: repeated and new metadata, other addresses and alignments)."""
    global _LOG
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = [_template(rng) for _ in range(max(8, n // 4))]
    log = []
    with _Stubs(), fl.value_checks(False):
        for i in range(n):
            t = rng.choice(pool)
            set_sm90(t["sm90"])
            if fresh:
                clear_plans()
            _PTRS.clear()
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
def test_plans_match_fresh_computation():
    cached = trace(300, seed=1)
    fresh = trace(300, seed=1, fresh=True)
    launches = sum(e[0] == "launch" for e in cached)
    assert launches > 500
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
