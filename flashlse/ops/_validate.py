"""Input validation for the public functions: every error says what was expected,
what came, and how to fix it, and is raised before any kernel runs."""

from __future__ import annotations

import contextlib
import contextvars
import math
import os

import torch

from ..masks import UNBOUNDED

GPU_DTYPES = (torch.float16, torch.bfloat16)

# Checks that read tensor values (lengths, offsets, pages, indices, lse values) on a GPU cost
# a host-device sync each, longer than a decode step: there they run only when asked for, by
# FLASHLSE_VALUE_CHECKS=1 or inside ``value_checks()``. CPU tensors are always checked.
# None (the default): CPU tensors checked, GPU tensors not; True / False: all or none.
_VALUE_CHECKS = contextvars.ContextVar(
    "flashlse_value_checks",
    default=True if os.environ.get("FLASHLSE_VALUE_CHECKS", "0") == "1" else None)


@contextlib.contextmanager
def value_checks(enabled: bool = True):
    """Runs the checks that read GPU tensor values (and so sync) inside the block.

    Without them every kernel is still memory-safe for any values; docs/design.md lists
    what each out-of-range value produces. ``value_checks(False)`` turns them off, the CPU
    path's included (tests use it to feed bad values to the kernels)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"value_checks takes a bool, got {type(enabled).__name__}")
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def values_checkable(t: torch.Tensor) -> bool:
    """Whether checks that read tensor values run: always for CPU tensors (unless turned off
    by ``value_checks(False)``), on a GPU only when asked for; never while torch.compile
    traces (the values are unknown) nor while a CUDA graph captures (a read would sync)."""
    if torch.compiler.is_compiling():
        return False
    asked = _VALUE_CHECKS.get()
    if t.device.type == "cpu":
        return asked is not False
    return asked is True and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


# Metadata checks (types, dims, dtypes, devices, shapes, strides) are a function of the
# tensors' metadata: a call whose metadata passed them before passes again, so the public
# functions remember the keys that passed and skip the checks for them. Only passes are
# remembered: a failing call runs the checks and raises as before. Value checks are not
# metadata and run every call.
_PASSED: set = set()
_MAX_PASSED = 4096


def meta_key(tag, *tensors) -> tuple | None:
    """What the metadata checks of call site ``tag`` read of ``tensors`` (each a tensor or
    None): shape, strides, dtype and device; None when one is neither (the checks then say
    what is wrong) or has no strides (a sparse tensor), and while torch.compile traces (no
    cache there)."""
    if torch.compiler.is_compiling():
        return None
    key = [tag]
    try:
        for t in tensors:
            if t is None:
                key.append(None)
            elif isinstance(t, torch.Tensor):
                key.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                return None
    except RuntimeError:
        return None
    return tuple(key)


# The public calls' kept plans (ops/attention, kvcache, merge ``_KEPT``, attention's
# ``_PAGED_KEPT``, sparse's kept decode plan): off, every call takes the full path (the
# benchmarks' in-process A/B, ``profile_host.py --ab flashlse.ops._validate.KEEP_PLANS``).
KEEP_PLANS = True


def needs_grad(*tensors) -> bool:
    """Whether autograd records this call: grad mode on and a tensor (None: absent) that
    requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def canonical_scalars(causal, window, softcap, scale, *flags) -> bool:
    """Whether a call's scalars are of the types a kept plan's key may hold them as (a bool
    ``causal`` and ``flags``, a float ``softcap``, a float or None ``scale``, a tuple of two
    ints or None ``window``): ``True`` and ``1`` hash alike, and only the full path's checks
    tell them apart."""
    return (causal.__class__ is bool and softcap.__class__ is float
            and (scale is None or scale.__class__ is float) and window.__class__ is tuple
            and len(window) == 2 and (window[0] is None or window[0].__class__ is int)
            and (window[1] is None or window[1].__class__ is int)
            and all(f.__class__ is bool for f in flags))


def passed(key) -> bool:
    """Whether the checks passed for this key before (a None key never did, nor one that
    does not hash: symbolic sizes outside torch.compile)."""
    if key is None:
        return False
    try:
        return key in _PASSED
    except TypeError:
        return False


def remember(key) -> None:
    """Records that the checks passed for ``key`` (None: not recorded)."""
    if key is None:
        return
    if len(_PASSED) >= _MAX_PASSED:
        _PASSED.clear()
    try:
        _PASSED.add(key)
    except TypeError:
        pass


# Head dims the CUDA kernels compile for: prefill (forward/backward) and decode (MLA's 576).
MAX_HEAD_DIM_PREFILL = 256
MAX_HEAD_DIM_DECODE = 576


def type_name(x) -> str:
    """``x``'s type as a message names it: ``int``, ``numpy.int64``, ``torch.Tensor`` (a
    numpy bool is not "bool")."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else \
        f"{t.__module__.split('.')[0]}.{t.__name__}"


def _host(name: str, kind: str, x) -> str:
    """The fix for a host scalar of another type: ``kind(name)``; for a tensor, that reading
    a GPU tensor's value syncs."""
    fix = f"; pass {kind}({name})"
    if isinstance(x, torch.Tensor):
        fix += f" (a host {kind}: reading a GPU tensor's value would sync)"
    return fix


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dims {layout}, got shape {_shape(t)}; "
            f"flashlse uses the flash-attn layout (sequence before heads), not SDPA's "
            f"(B, H, S, D): pass x.transpose(1, 2) if your tensor is in SDPA's layout"
        )


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.is_cuda and t.dtype not in GPU_DTYPES:
        raise TypeError(
            f"{name} on CUDA must be float16 or bfloat16, got {t.dtype}; cast with "
            f"{name}.to(torch.bfloat16), or run on the CPU path for other dtypes"
        )


def check_same(tensors: dict[str, torch.Tensor], what: str = "dtype") -> None:
    items = list(tensors.items())
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if getattr(t, what) != getattr(ref, what):
            raise ValueError(
                f"{name} and {ref_name} must share a {what}: {ref_name} has "
                f"{getattr(ref, what)}, {name} has {getattr(t, what)}; move or cast one of them"
            )


def check_last_stride(tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride 1), got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous()"
            )


def check_heads(hq: int, hkv: int, hkv_v: int) -> None:
    if hkv != hkv_v:
        raise ValueError(f"k and v must have the same number of heads, got {hkv} and {hkv_v}")
    if hkv == 0:
        raise ValueError(f"k and v need at least one head (Hkv >= 1), got Hkv = 0 (Hq = {hq})")
    if hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for MHA/GQA/MQA; "
            f"choose Hkv among the divisors of {hq}"
        )


def check_head_dim(d: int, dv: int, on_cuda: bool, limit: int) -> None:
    if d < 1 or dv < 1:
        raise ValueError(f"head dims must be >= 1, got D={d}, Dv={dv}")
    if on_cuda and (d > limit or dv > limit):
        raise ValueError(
            f"the CUDA kernels for this function support head dims up to {limit}, got "
            f"D={d}, Dv={dv}; split the heads, or run on CPU tensors (any head dim)"
        )


def check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type_name(scale)}"
                        f"{_host('scale', 'float', scale)}")
    # Comparisons, not math.isfinite: torch.compile cannot trace math.isfinite on a float.
    if not -math.inf < scale < math.inf:
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type_name(softcap)}"
                        f"{_host('softcap', 'float', softcap)}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be finite and >= 0 (0.0 = off), got {softcap}")
    return float(softcap)


def check_window(window) -> tuple[int | None, int | None]:
    """``(left, right)`` with None for unbounded: None, flash-attn's -1, or a side of at
    least 2^30 (``masks.UNBOUNDED``: the same keys). Other negative values are errors."""
    if window is None or (window.__class__ is tuple and len(window) == 2
                          and window[0] is None and window[1] is None):
        return (None, None)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window must be a pair (left, right) of ints or None, got {window!r}; "
            f"use (None, None) for no window, (w, 0) for causal sliding window"
        )
    sides = []
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, int)):
            raise TypeError(f"window entries must be int or None, got {window!r} "
                            f"({type_name(side)}); pass Python ints")
        if side is not None and side < -1:
            raise ValueError(f"window entries must be >= 0, or None / -1 for unbounded, got "
                             f"{window!r}")
        sides.append(None if side is None or side == -1 or side >= UNBOUNDED else side)
    return (sides[0], sides[1])


def check_sink(sink, hq: int, device: torch.device):
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"sink must be a float32 tensor ({hq},), got {type(sink).__name__}")
    if sink.shape != (hq,):
        raise ValueError(
            f"sink must have shape ({hq},) (one logit per query head), got {_shape(sink)}"
        )
    if not sink.is_floating_point():
        raise TypeError(f"sink must be a floating-point tensor, got {sink.dtype}")
    if sink.device != device:
        raise ValueError(f"sink is on {sink.device} but q is on {device}; move it with .to()")
    check_unit_stride("sink", sink)
    return sink


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)}"
                        f"{_host(name, 'bool', value)}")
    return value


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The kernels read a length, page or sink tensor's last dim as packed: a view with
    another stride there (``lens[:, 0]`` of a wider table, ``x[::2]``, ``expand``) would be
    read wrongly, or past its storage. flash-attn asks the same of its lengths and tables."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides "
                         f"{tuple(t.stride())}; pass {name}.contiguous()")


def check_int_tensor(name: str, t, shape_desc: str, device: torch.device, ndim: int,
                     unit_stride: bool = True) -> None:
    """An int32 tensor argument; ``unit_stride=False`` for a call that copies a strided one
    itself (the sparse plan's indices and block table)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor {shape_desc}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 {shape_desc}, got {t.dtype}; pass "
                        f"{name}.to(torch.int32)")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {shape_desc}, got shape {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with .to()")
    if unit_stride:
        check_unit_stride(name, t)


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> None:
    check_int_tensor(name, cu, "(B + 1,)", device, 1)
    if cu.numel() < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries, got 0")
    if not values_checkable(cu):
        return
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must be non-decreasing (zero-length sequences are allowed), "
                         f"got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of tokens ({total}), got {vals[-1]}")


def check_max_len(name: str, max_seqlen) -> None:
    """A max_seqlen argument: an int >= 0 (a host value: no sync)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{name} must be an int, got {type_name(max_seqlen)}"
                        f"{_host(name, 'int', max_seqlen)}")
    if max_seqlen < 0:
        raise ValueError(f"{name} must be >= 0 (the longest sequence's length, or more), got "
                         f"{max_seqlen}")


def check_max_seqlen(name: str, max_seqlen, cu: torch.Tensor) -> None:
    check_max_len(name, max_seqlen)
    if not values_checkable(cu):
        return
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if max_seqlen < longest:
        raise ValueError(f"{name} ({max_seqlen}) is smaller than the longest sequence "
                         f"({longest}); pass the true maximum")
