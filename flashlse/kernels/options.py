"""Kernel options: the choices a caller may make about how the kernels run, per call or per
block of code (FlexAttention's ``kernel_options``), as one typed, frozen value.

    with flashlse.kernel_options(sm90_fwd=False):          # the portable forward only
        out = flashlse.attention(q, k, v)
    with flashlse.kernel_options(fwd_config={"BLOCK_N": 64}, poison_outputs=True):
        ...

The defaults are the measured choices (benchmarks/NOTES.md, RESULTS.md; the tiles are in
``kernels/configs.py``). Launchers read
:func:`current` when they run, so options reach the kernels through every public function,
torch.compile's custom ops and CUDA-graph capture alike; nothing module-level is switched.
An eager backward runs under the options of its forward call (:func:`captured`): autograd
runs the backward of CUDA tensors on a thread of its own, which a block around
``.backward()`` does not reach. A backward that torch.compile compiled runs its custom op
on that thread too, so it gets the defaults there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the kernels run; every field defaults to the shipped choice.

    Attributes:
        sm90_fwd: the Hopper Gluon forward (``fwd_sm90.py``) inside its domain.
        sm90_fwd_paged: its paged variant (``fwd_sm90.paged_supported``) for the long
            sequences of a paged forward (``attention_varlen`` with a block table, paged
            prefill of ``attention_with_kvcache``).
        sm90_dkdv / sm90_dq: the Hopper Gluon backward kernels inside their domains.
        sm90_mla_decode: the Hopper Gluon MLA decode (``decode_mla_sm90.py``) inside its
            domain (576 / 512 latent caches on one head).
        fwd_config: overrides of the portable forward's tiles (``configs.FWD``): a mapping
            of ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``USE_TMA``,
            ``WARP_SPECIALIZE``, ``GROUP_HEADS``, or a ``configs.TileConfig`` replacing them.
        fwd_sm90_config: overrides of the Hopper forward's (``configs.FWD_SM90``):
            ``BLOCK_N``, ``STAGES``, ``PINGPONG``, ``OVERLAP``, ``PERSISTENT`` (the
            persistent kernel where its layout and balance rules allow; on at D = 128),
            ``PERSISTENT_TABLE`` (the persistent kernel on the host's schedule where the
            round robin is uneven), ``PERSISTENT_VARLEN`` (packed varlen calls on the
            persistent varlen kernel; on at D = 128), ``GRID`` (the calls the persistent
            kernels do not take on the grid kernel, else fwd.py's; off at D = 64),
            ``CONSUMER_REGS``, or a ``TileConfig``.
        bwd_config: overrides of the portable backward's (``configs.BWD_DKDV`` /
            ``BWD_DQ``): ``"dkdv"`` / ``"dq"`` tiles (``(BLOCK_M, BLOCK_N, num_warps,
            num_stages)`` or a ``TileConfig``), ``USE_TMA``, ``EARLY_DP``, ``STATS_TMA``,
            ``HEAD_LOOP``, ``PERSISTENT`` (the Hopper dQ as a persistent kernel where it
            applies). An unknown key is an error.
        autotune_bwd: let ``triton.autotune`` pick the backward tiles (benchmarks).
        pdl: launch the split-KV merge with programmatic dependent launch (sm_90+).
        poison_outputs: fill every output and scratch buffer the launchers allocate with NaN
            before the kernels run, so that an unwritten element shows (tests).
    """

    sm90_fwd: bool = True
    sm90_fwd_paged: bool = True
    sm90_dkdv: bool = True
    sm90_dq: bool = True
    sm90_mla_decode: bool = True
    fwd_config: Mapping | None = None
    fwd_sm90_config: Mapping | None = None
    bwd_config: Mapping | None = None
    autotune_bwd: bool = False
    pdl: bool = True
    poison_outputs: bool = False

    def __post_init__(self):
        # Checked where they are written, not where a kernel first reads them (a Hopper key
        # would otherwise pass unseen off Hopper, a switch of 1 or "yes" act as True).
        from . import configs

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"kernel option {f.name} must be a bool, got "
                                f"{type(value).__name__} {value!r}")
        for name, keys in (("fwd_config", configs.FWD_KEYS),
                           ("fwd_sm90_config", configs.FWD_SM90_KEYS),
                           ("bwd_config", configs.BWD_KEYS)):
            configs.check_override(getattr(self, name), keys, name)


_DEFAULT = KernelOptions()
# None outside any kernel_options block: the defaults.
_CURRENT: contextvars.ContextVar[KernelOptions | None] = contextvars.ContextVar(
    "flashlse_kernel_options", default=None)


def current() -> KernelOptions:
    """The options in force here (the defaults outside any :func:`kernel_options` block)."""
    return _CURRENT.get() or _DEFAULT


def captured() -> KernelOptions | None:
    """The options of the enclosing :func:`kernel_options` block, None outside any: what an
    autograd Function's forward keeps for its backward (:func:`run_under`). Autograd runs the
    backward of CUDA tensors on its own device thread, which sees none of the caller's
    context variables, so a block around ``.backward()`` does not reach the kernels there;
    the backward runs under the options of its forward instead."""
    return _CURRENT.get()


def run_under(opts: KernelOptions | None, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``opts`` (from :func:`captured`), or under the options
    in force here when ``opts`` is None."""
    if opts is None:
        return fn(*args, **kwargs)
    token = _CURRENT.set(opts)
    try:
        return fn(*args, **kwargs)
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def kernel_options(options: KernelOptions | None = None, **changes):
    """Runs the block with ``options`` (default: those in force) changed by ``changes``."""
    if options is not None and not isinstance(options, KernelOptions):
        raise TypeError(f"kernel_options takes a KernelOptions, got {type(options).__name__}")
    try:
        opts = dataclasses.replace(options or current(), **changes)
    except TypeError as e:
        if "unexpected keyword" not in str(e):
            raise
        names = ", ".join(f.name for f in dataclasses.fields(KernelOptions))
        raise TypeError(f"{e}; KernelOptions fields: {names}") from None
    token = _CURRENT.set(opts)
    try:
        yield opts
    finally:
        _CURRENT.reset(token)


def empty(shape, *, dtype, device) -> torch.Tensor:
    """The launchers' allocator: ``torch.empty``, or NaN-filled under ``poison_outputs``."""
    return allocator()(shape, dtype=dtype, device=device)


def allocator(options: KernelOptions | None = None):
    """:func:`empty` as one function for a launcher's several buffers, the options read once:
    ``torch.empty``, or the NaN fill under ``poison_outputs``."""
    return _poisoned if (options or current()).poison_outputs else torch.empty


def empty_like(t: torch.Tensor, options: KernelOptions | None = None) -> torch.Tensor:
    """A fresh contiguous tensor of ``t``'s shape, dtype and device, as :func:`empty` makes it
    (NaN under ``poison_outputs``): ``torch.empty_like`` parses one tensor where
    ``torch.empty`` parses a shape, a dtype and a device (1.1 us against 2.3 a call on the
    CPU)."""
    if (options or current()).poison_outputs:
        return _poisoned(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _poisoned(shape, *, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
