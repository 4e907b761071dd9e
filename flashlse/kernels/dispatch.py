"""Which kernel runs an attention forward or backward pass on the Triton path.

Each kernel family sits in its own module with a ``supported(...)`` predicate naming its
domain (dtypes, head dims, device capability, alignment: FA-4's ``can_implement``) and a
typed launcher; the families are peers and know nothing of each other. This module asks
them in order and calls the first that takes the call:

    forward  (attn_fwd)          decode     split-KV decode    dense, Sq <= SHORT_Q_WIDE_MAX
                                                               (SHORT_Q_DECODE), no
                                                               forward tile override
                                 fwd_sm90   Hopper Gluon       KernelOptions.sm90_fwd
                                 fwd        portable Triton    always
    paged forward (attn_fwd_paged)  decode   split-KV decode    every sequence max_seqlen_q
                                                               <= decode.MAX_SQ rows (total
                                                               = B x max_seqlen_q), PAGED_DECODE
                                 sequences of more than fwd.SMALL_ROWS packed rows:
                                 fwd_sm90   Hopper Gluon paged KernelOptions.sm90_fwd_paged
                                 fwd        portable Triton    always
                                 the others (a mixed step's decodes):
                                 decode     packed split-KV    G <= fwd.SMALL_ROWS,
                                                               SMALL_DECODE (one row of
                                                               a larger G:
                                                               SMALL_DECODE_WIDE)
                                 fwd        portable Triton    always
    backward (attn_bwd)          bwd.prepare: buffers, D and lse_log2 (shared by all)
      dK/dV                      bwd_sm90   Hopper Gluon       KernelOptions.sm90_dkdv
                                 bwd        portable Triton    always
      dQ                         bwd_sm90   Hopper Gluon       KernelOptions.sm90_dq
                                 bwd        portable Triton    always

A Gluon kernel that this triton fails to compile warns once; its signature goes into
``failures.FAILURES`` and runs the portable kernel from then on. A new kernel is a module with
``supported`` and a launcher of the same arguments as its portable peer, and one ``if`` here.

Per call this costs a few attribute lookups and calls (the eager path is timed in µs).
"""

from __future__ import annotations

import functools

import torch
import triton

from . import bwd, decode, fwd, options
from ._common import alloc_scratch, check_grid_dims
from .failures import FAILURES

try:  # Gluon's Hopper API as of triton 3.6; without it every call takes the portable kernels.
    from . import fwd_sm90
except ImportError:  # pragma: no cover - older or newer triton
    fwd_sm90 = None
try:
    from . import bwd_sm90
except ImportError:  # pragma: no cover - older or newer triton
    bwd_sm90 = None


def attn_fwd(q, k, v, *, left, right, softcap, scale, sink, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """``(out, lse)`` by the Hopper forward where it is supported, else the portable one.
    Arguments and results as ``fwd.attn_fwd`` (which documents them)."""
    return attn_fwd_launched(q, k, v, left=left, right=right, softcap=softcap, scale=scale,
                             sink=sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             seqused_k=seqused_k)[:2]


def attn_fwd_launched(q, k, v, **kw):
    """:func:`attn_fwd`'s ``(out, lse)`` and the :func:`fwd_launch` that filled them."""
    out, lse = fwd.new_outputs(q, v, kw.get("cu_seqlens_q"))
    tensors = (q, k, v, out, lse, kw["sink"], kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"),
               kw.get("seqused_k"))
    launch = fwd_launch(q, k, v, out, lse, **kw)
    if not launch(*tensors):
        # The Hopper kernel failed to compile (warned; its signature is in FAILURES now): the
        # portable kernel fills the same buffers.
        launch = fwd_launch(q, k, v, out, lse, **kw)
        launch(*tensors)
    return out, lse, launch


def fwd_launch(q, k, v, out, lse, *, left, right, softcap, scale, sink, cu_seqlens_q=None,
               cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
    """The forward's launch for this call (``fwd.new_outputs``'s ``out`` and ``lse``; the
    other arguments as ``fwd.attn_fwd``'s): a function of ``(q, k, v, out, lse, sink,
    cu_seqlens_q, cu_seqlens_k, seqused_k)`` that fills ``out`` and ``lse`` and returns True,
    or False when the Hopper kernel failed to compile (warned once; ask again for the
    portable one). A function of the call's metadata and the options, like the plans it
    holds: ``ops.attention`` keeps it for repeated calls."""
    opts = options.current()
    # (A forward tile override asks for the dense kernels: they run with it.)
    if SHORT_Q_DECODE and cu_seqlens_q is None and \
            q.shape[1] <= (SHORT_Q_WIDE_MAX if SHORT_Q_WIDE else decode.MAX_SQ) and \
            not (opts.fwd_config or opts.fwd_sm90_config):
        return _DecodeFwd(left, right, softcap, scale)
    if opts.sm90_fwd and fwd_sm90 is not None:
        plan = fwd_sm90.plan(q, k, v, out, lse, softcap=softcap, left=left, right=right,
                             scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, seqused_k=seqused_k)
        if plan is not None and plan.signature not in FAILURES:
            return _Sm90Fwd(plan)
    return functools.partial(fwd.run_plan, fwd.find_plan(
        q, k, v, out, lse, left=left, right=right, softcap=softcap, scale=scale, sink=sink,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k))


# Dense calls of at most SHORT_Q_WIDE_MAX query rows a sequence (a model's decode step through
# fl.attention, transformers' generate, speculative verification) run the split-KV decode
# kernel over k and v as a whole cache: the query heads of a kv head packed into its row
# tiles and the keys split over the SMs, where the dense kernels run a 128-row tile of one
# head with a few rows in it and no split. Same contract (bottom-right masks, windows,
# softcap, sink, lse (B, Hq, Sq)); attention_with_kvcache takes the same kernel for these
# rows. Off: the dense kernels (the A/B: AB_SET=short benchmarks/ab_decode_switch.py).
SHORT_Q_DECODE = True
# The route up to SHORT_Q_WIDE_MAX rows (session 48's experiment, on since session 49). On an
# H100 the route was 1.5x the dense kernels at 16 rows (B = 8, 2k keys): their 128-row tiles
# stay mostly empty past 16 rows, and each query head reads the keys again where the decode
# kernel packs a kv head's query heads. Measured (NOTES.md, session 49; AB_SET=wide
# benchmarks/ab_decode_switch.py --flag dispatch.SHORT_Q_WIDE): Sq = 32 2.8x (B = 1, 8k keys)
# and 1.5x (B = 8, 2k); Sq = 64 1.4x (B = 1, 16k), 1.8x (D = 256) but 0.94x at B = 8 4k keys,
# so the bound is 32 (the kernel takes up to 64 rows: the tests run it there).
SHORT_Q_WIDE = True
SHORT_Q_WIDE_MAX = 32

# Paged varlen calls whose sequences all have max_seqlen_q <= decode.MAX_SQ query rows (the
# packed rows are B x max_seqlen_q: vLLM's decode steps and speculative verification through
# flash_attn_varlen_func with a block table) run the split-KV decode kernel: the portable
# paged kernel has no key split (one program a kv head and 16-row tile: 8 programs for a
# B = 1 decode at 32 / 8 heads), the decode kernel splits the keys over the SMs. Off: the
# paged kernels (the A/B: AB_SET=varlenpaged benchmarks/ab_decode_switch.py). Measured on an
# H100 (NOTES.md, session 52; 32 / 8 heads, D = 128, bf16, causal): B = 1 on 32k keys 0.461
# -> 0.070 ms (6.6x; Sq = 1 and 4), B = 8 on 8k 1.33x, B = 64 Sq = 8 on 2k 2.4x, B = 64 on
# 4k and B = 128 on 2k level (0.99 / 0.97 on / off); host us level (45.5 / 45.3). With the
# value checks off the route reads cu_seqlens_q as B x max_seqlen_q rows (never reading it)
# and each seqused_k[b] up to the table's capacity; a page out of range holds no key.
PAGED_DECODE = True


# The sequences of a paged varlen call of at most fwd.SMALL_ROWS packed rows (query heads of
# a kv head times query rows: a mixed serving step's decodes beside its prefill chunks) run
# the split-KV decode kernel in its packed form (decode.packed_fwd: each program reads its
# sequence's rows from cu_seqlens_q); off: the portable paged kernel's launch of 16-row
# tiles, one program a kv head and sequence, no key split (at one 512-row chunk and two
# decodes on 64k keys: 16 programs over 64k keys each). Measured on an H100 (NOTES.md,
# session 52; benchmarks/bench_serving.py --mixed ... --flag dispatch.SMALL_DECODE, 32 / 8
# heads, pages of 16): one 512-row chunk on 64k keys + 2 decodes 1.976 -> 1.091 ms (1.81x;
# the separate calls 1.033), one 2k chunk on 32k + 4 decodes 2.163 -> 1.817 ms (1.19x),
# 4 chunks of 2k + 128 decodes on 4k 1.367 -> 1.351 ms; host us level (83.2 / 83.6). With the
# value checks off a page out of range holds no key for these sequences (the paged kernels
# end a sequence's keys there), and each seqused_k[b] is clamped to the table's capacity.
SMALL_DECODE = True

# With SMALL_DECODE, groups of more than fwd.SMALL_ROWS query heads a kv head (MQA, e.g.
# 32 / 1) up to WIDE_MAX_GROUP: a sequence of one query row (G packed rows) runs the packed
# decode form too, not a 128-row tile of the Hopper paged kernel of its own (off: those).
SMALL_DECODE_WIDE = False
WIDE_MAX_GROUP = 64


# new_outputs' kept lse (off: a fresh one every call; the A/B: profile_host.py --ab
# flashlse.kernels.dispatch.UNREAD_LSE --rows "decode row").
UNREAD_LSE = True


def new_outputs(q, v, cu_seqlens_q, want_lse, shapes=None):
    """``fwd.new_outputs``, except that the lse of a call whose caller drops it (``want_lse``
    False: no ``return_lse``, and no autograd saving it) is ``decode.unread_lse``'s: a view
    of the stream's kept buffer, one allocation less a call (a transformers decode step's
    attention reads out only). ``shapes``: ``(out_shape, lse_shape)`` where ``q`` and
    ``v`` are not in the forward's layout (``ops.attention.attention_heads_first``)."""
    out_shape, lse_shape = shapes or fwd.output_shapes(q, v, cu_seqlens_q)
    empty = options.allocator()
    out = empty(out_shape, dtype=q.dtype, device=q.device)
    if want_lse or not UNREAD_LSE:
        return out, empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, decode.unread_lse(q.device, lse_shape, empty,
                                  q.is_cuda and torch.cuda.is_current_stream_capturing())


class _DecodeFwd:
    """:func:`fwd_launch` of a short-query dense call: ``decode.run_plan`` into the caller's
    ``out`` and ``lse``, on the plan of the call's metadata, whether v is k's storage (the
    kernel then reads V from K's tiles: a kept launch must not assume it of another call's
    tensors) and the options the decode plan reads (``pdl``; the attention's kept key does
    not hold them), planned on first use of each."""

    __slots__ = ("scalars", "plans")

    def __init__(self, left, right, softcap, scale):
        self.scalars = dict(left=left, right=right, softcap=softcap, scale=scale)
        self.plans = {}

    def __call__(self, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 plan=True) -> bool | None:
        """Fills ``out`` and ``lse``: True, or False where the Hopper MLA kernel failed to
        compile; ``plan=False``: None instead of planning a new case (the tensors may be
        views of what a plan would read: only an existing plan runs on them)."""
        opts = options.current()
        which = (v.data_ptr() == k.data_ptr(), opts.pdl)
        kp = self.plans.get(which)
        if kp is None:
            if not plan:
                return None
            kp = self.plans[which] = decode.find_plan(
                q, k, v, cache_seqlens=None, block_table=None, sink=sink, num_splits=0,
                **self.scalars)[:2]
        return decode.run_plan(kp[1], kp[0], q, k, v, None, None, sink, None,
                               options.allocator(opts), out=out, lse=lse) is not None


class _Sm90Fwd:
    """:func:`fwd_launch` of a call in the Hopper forward's domain: its ``fwd_sm90.Plan``."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k) -> bool:
        plan = self.plan
        if plan.run is None:
            return True
        try:
            triton.set_allocator(alloc_scratch)
            plan.run(q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_k)
            return True
        except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
            # Gluon is experimental in triton: if this triton cannot compile the Hopper
            # kernel, say so once and run the portable kernel for this signature from now on.
            FAILURES.add(plan.signature, e, "the Hopper forward kernel", stacklevel=4)
            return False


def attn_fwd_paged(q, k_cache, v_cache, block_table, *, cu_seqlens_q, max_seqlen_q, seqused_k,
                   max_seqlen_k, left, right, softcap, scale, sink, min_seqlen_q=0, plans=None):
    """``(out, lse)`` of a varlen forward over paged caches (arguments and results as
    ``fwd.attn_fwd_paged``'s). A call of B sequences of ``max_seqlen_q <= decode.MAX_SQ``
    rows each (``q`` has B x max_seqlen_q rows) runs the split-KV decode kernel
    (``PAGED_DECODE``; the lengths from ``seqused_k``, clamped to the table's capacity).
    Otherwise the sequences of more than ``fwd.SMALL_ROWS`` packed rows
    (prefills, chunked prefills) run the Hopper paged kernel where it is supported, else the
    portable one, and the rest (decodes) the split-KV decode kernel's packed form
    (``SMALL_DECODE``, ``decode.packed_fwd``), else the portable kernel's 16-row tiles; each
    launch sees every sequence and skips the other's, so nothing reads the lengths on the host.
    ``min_seqlen_q``: a bound below every sequence's query rows that the caller knows on the
    host (``attention_with_kvcache``: each has Sq); when it leaves no sequence of at most
    ``fwd.SMALL_ROWS`` packed rows, no launch of 16-row tiles is made. ``plans``: a dict the
    caller keeps for calls of one metadata but the lengths (a public call's kept key), where
    both kernels' plans are found by what that key leaves out."""
    batch, sq = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)
    opts = options.current()
    if PAGED_DECODE and 0 < sq <= decode.MAX_SQ and q.shape[0] == batch * sq and \
            not opts.fwd_config:
        # Every sequence has sq query rows (cu_seqlens_q is then 0, sq, 2 sq, ...: a decode
        # step, speculative verification): the split-KV decode kernel over the pages, which
        # reads the lengths from seqused_k alone (memory-safe whatever cu_seqlens_q holds).
        out, lse = decode.decode_fwd(
            q.unflatten(0, (batch, sq)), k_cache, v_cache, cache_seqlens=seqused_k,
            block_table=block_table, left=left, right=right, softcap=softcap, scale=scale,
            sink=sink, num_splits=0, lse_heads_first=True)
        return out.flatten(0, 1), lse
    # (The portable paged kernel puts both on grid dims.)
    check_grid_dims("the paged forward kernels", batch, k_cache.shape[-2], "kv heads")
    out, lse = fwd.new_outputs(q, v_cache, cu_seqlens_q)
    # Maxima above the packed rows / the table's keys clamped to them (``seq_args``).
    max_seqlen_q = min(int(max_seqlen_q), q.shape[0])
    max_seqlen_k = min(int(max_seqlen_k), block_table.shape[1] * k_cache.shape[1])
    kw = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
              max_seqlen_k=max_seqlen_k, left=left, right=right, softcap=softcap, scale=scale,
              sink=sink)
    group = q.shape[-2] // max(k_cache.shape[-2], 1)
    # Packed rows (T_q * G) up to which a sequence is a decode (SMALL_DECODE's packed form or
    # the portable kernel's 16-row tiles), above which the long kernels take it.
    # (A forward tile override keeps every sequence off the decode kernel: the threshold
    # stays the portable kernel's.)
    small = fwd.SMALL_ROWS
    if SMALL_DECODE and SMALL_DECODE_WIDE and small < group <= WIDE_MAX_GROUP and \
            not opts.fwd_config:
        small = group
    only_small = False
    if opts.sm90_fwd_paged and fwd_sm90 is not None and max_seqlen_q * group > small:
        plan = fwd_sm90.paged_plan(q, k_cache, v_cache, block_table, out, lse,
                                   rows_lo=small, plans=plans, **kw)
        if plan is not None and plan.signature not in FAILURES:
            try:
                if plan.run is not None:
                    triton.set_allocator(alloc_scratch)
                    plan.run(q, k_cache, v_cache, out, lse, sink, cu_seqlens_q, seqused_k,
                             block_table, max_seqlen_q, max_seqlen_k)
                only_small = True
            except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
                FAILURES.add(plan.signature, e, "the Hopper paged forward kernel", stacklevel=2)
    if int(min_seqlen_q) * group > small:
        if only_small:
            return out, lse  # every sequence ran on the Hopper kernel
    elif SMALL_DECODE and 0 < group <= small and not opts.fwd_config:
        # The sequences of at most `small` packed rows (a mixed step's decodes) on the
        # split-KV decode kernel, the longer ones on the paged kernels (unless the Hopper
        # kernel ran them): each launch skips the other's sequences on the device.
        if not only_small:
            fwd.attn_fwd_paged(q, k_cache, v_cache, block_table, **kw, out=out, lse=lse,
                               plans=plans, skip_rows=small)
        decode.packed_fwd(q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k, out, lse,
                          max_rows=min(small // group, max_seqlen_q), left=left,
                          right=right, softcap=softcap, scale=scale, sink=sink, plans=plans)
        return out, lse
    return fwd.attn_fwd_paged(q, k_cache, v_cache, block_table, **kw, out=out, lse=lse,
                              only_small=only_small, min_seqlen_q=min_seqlen_q, plans=plans)


def paged_in_place(q, k_cache, v_cache, *, softcap, scale) -> bool:
    """Whether a paged call's long sequences run a kernel that reads the pages in place at
    about the dense kernel's speed (the Hopper paged kernel, at every page size of its
    domain): ``attention_with_kvcache`` gathers the pages of long chunks for the dense kernel
    otherwise."""
    return bool(options.current().sm90_fwd_paged and fwd_sm90 is not None
                and fwd_sm90.paged_supported(q, k_cache, v_cache, softcap=softcap, scale=scale,
                                             batch=q.shape[0]))


def attn_bwd(dout, dlse, q, k, v, out, lse, *, left, right, softcap, scale, sink,
             deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None, seqused_k=None, kept=None):
    """``dq, dk, dv, dsink``: the shared preprocessing (``bwd.prepare``), then dK/dV and dQ
    each by the Hopper kernel where it is supported, else the portable one. Arguments and
    results as ``bwd.attn_bwd`` (which documents them); ``kept``: the forward's kept key
    (``bwd.prepare``'s short plan key).

    Which kernels run is a function of the call's plan and the options that choose them: a
    repeated call finds its choice in the plan (``_ROUTE``) and launches at once."""
    p = bwd.prepare(dout, dlse, q, k, v, out, lse, left=left, right=right, softcap=softcap,
                    scale=scale, sink=sink, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, kept=kept)
    if p.empty:
        return p.grads()
    opts = p.opts
    # One pass (dQ by TMA reduces, in a varying order) unless asked to be repeatable.
    fused = (not deterministic and opts.sm90_dkdv and opts.sm90_dq and bwd_sm90 is not None
             and not torch.are_deterministic_algorithms_enabled())
    key = (_ROUTE, fused, opts.sm90_dkdv, opts.sm90_dq)
    route = p.plan.launches.get(key)
    if route is not None:
        try:
            for run in route:
                run(p)
            return p.grads()
        except Exception:  # noqa: BLE001 - not after a success; the full path says what failed
            del p.plan.launches[key]
    p.plan.launches[key] = _routed(p, fused, opts)
    return p.grads()


_ROUTE = "route"  # (the tag of a plan's kept choices of kernels, BwdPlan.launches)


def _routed(p, fused: bool, opts) -> tuple:
    """Runs ``p``'s dK/dV and dQ passes on the kernels chosen for it (the Hopper ones where
    they are supported and have compiled, else the portable ones) and returns that choice,
    a function of ``p`` for each launch."""
    if fused and (run := _try(p, "fused")) is not None:
        return (run, )
    route = []
    if p.has_keys:
        route.append((opts.sm90_dkdv and _try(p, "dkdv")) or _portable(p, bwd.attn_bwd_dkdv))
    route.append((opts.sm90_dq and _try(p, "dq")) or _portable(p, bwd.attn_bwd_dq))
    return tuple(route)


def _fused_args(p) -> tuple:
    return (p, )


# A backward pass's Gluon kernel: its FAILURES key, its name in the warning, its plan, and
# its launch's arguments from the prepared pass (the fused run takes the pass itself).
_PASSES = {"fused": ("bwd_sm90 fused", "the Hopper fused backward kernel", "fused_plan",
                     _fused_args),
           "dkdv": ("bwd_sm90 dK/dV", "the Hopper backward dK/dV kernel", "dkdv_plan",
                    bwd.BwdPass.dkdv_tensors),
           "dq": ("bwd_sm90 dQ", "the Hopper backward dQ kernel", "dq_plan",
                  bwd.BwdPass.dq_tensors)}


def _try(p, part: str):
    """The Hopper kernel of pass ``part`` run on ``p`` (``_gluon``) as a kept
    :class:`_GluonRun`, or None: the portable kernel runs that pass."""
    if bwd_sm90 is None:
        return None
    name, what, plan, args = _PASSES[part]
    run = _gluon((name, p.signature), what, getattr(bwd_sm90, plan), p, args)
    return None if run is None else _GluonRun(run, args)


def _portable(p, run):
    """``run(p)``, a portable pass (``bwd.attn_bwd_dkdv`` / ``attn_bwd_dq``), kept as is."""
    run(p)
    return run


class _GluonRun:
    """A kept Gluon launch of a backward pass: ``run(*args(p))``."""

    __slots__ = ("run", "args")

    def __init__(self, run, args):
        self.run, self.args = run, args

    def __call__(self, p) -> None:
        triton.set_allocator(alloc_scratch)
        self.run(*self.args(p))


def _gluon(key: tuple, what: str, plan, p, args):
    """Runs the Gluon launch ``plan(p)`` (None outside its kernel's domain) on ``args(p)``
    and returns it; None if there is none or that signature failed to compile, now (warned
    once, as from ``attn_bwd``'s caller) or before: the caller runs the portable kernel."""
    if key in FAILURES:
        return None
    try:
        run = plan(p)
        if run is None:
            return None
        triton.set_allocator(alloc_scratch)
        run(*args(p))
        return run
    except Exception as e:  # noqa: BLE001 - a compiler failure: the portable kernel runs
        FAILURES.add(key, e, what, stacklevel=5)
        return None
