"""Pieces every kernel module shares: the interpreter switch, the TMA gate, the
descriptor scratch allocator and the masked row-tile load."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl as _specialize

from .._env import interpreting  # noqa: F401 - re-exported to the kernel modules

# Base-2 constants, once: e^x = 2^(x * LOG2E) and ln(x) = log2(x) * LN2. Constexprs, so the
# kernels fold them; host code reads ``.value``.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def exp2_constants(scale: float, softcap: float) -> dict:
    """The kernels' base-2 scalars: ``scale_log2 = scale log2(e)``, and for a softcap c > 0
    (``c tanh(scale s / c)`` in base 2, math.md) ``softcap_a2 = 2 log2(e) scale / c`` and
    ``softcap_c2 = c log2(e)``."""
    log2e = LOG2E.value
    return dict(scale_log2=scale * log2e,
                softcap_a2=(2.0 * log2e * scale / softcap) if softcap > 0 else 0.0,
                softcap_c2=softcap * log2e)


def mask_args(left, right, scale: float, softcap: float) -> dict:
    """The attention kernels' mask and score arguments: window bounds as ints (None = 0 with
    its ``HAS_*`` flag off), the base-2 scalars of :func:`exp2_constants`, and the flags."""
    return dict(left=0 if left is None else int(left), right=0 if right is None else int(right),
                **exp2_constants(scale, softcap), HAS_LEFT=left is not None,
                HAS_RIGHT=right is not None, HAS_SOFTCAP=softcap > 0)


def seq_args(q, k, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None) -> tuple:
    """``(batch, args)`` of an attention launch: the sequence count, and the kernels' length
    arguments ``seqlen_q`` / ``seqlen_k`` (what the grid covers: the longest sequences when
    varlen) and ``total_q`` / ``total_k`` (the packed rows varlen offsets are clamped to; 0
    when dense). A varlen maximum above the packed rows is clamped to them (no sequence is
    longer, so the answer is the same, and the grid stays inside int32 and the launch
    limits: flash-attn's callers pass a model's longest context as an upper bound)."""
    if cu_seqlens_q is None:
        return q.shape[0], dict(seqlen_q=q.shape[1], seqlen_k=k.shape[1], total_q=0, total_k=0)
    total_q, total_k = q.shape[0], k.shape[0]
    return cu_seqlens_q.numel() - 1, dict(seqlen_q=min(int(max_seqlen_q), total_q),
                                          seqlen_k=min(int(max_seqlen_k), total_k),
                                          total_q=total_q, total_k=total_k)


def check_grid_dims(what: str, sequences: int, heads: int, heads_name: str = "heads") -> None:
    """A ValueError before any launch where a kernel would put ``sequences`` or ``heads`` on a
    CUDA grid dim that stops at 65535 (dims 1 and 2)."""
    if max(sequences, heads) > 65535:
        raise ValueError(f"{what} take at most 65535 sequences and 65535 {heads_name} per "
                         f"call, got {sequences} sequences and {heads} {heads_name}; split the "
                         f"batch into several calls")


def row_starts(b: int, step: int, device) -> torch.Tensor:
    """``[0, step, ..., b * step]`` int32: the ``cu_seqlens`` of ``b`` sequences of ``step``
    rows each, which kernels read and never write. Made on the call's stream the first time
    and kept for that stream (``_ROW_STARTS``), whose later calls run after it was written:
    a repeated chunk launches no arange. While a CUDA graph captures, a fresh one (the
    capture runs nothing, so a kept one would hold no values before a replay, and a graph
    must not read a tensor the cache may drop)."""
    device = torch.device(device)
    stream = None
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _new_row_starts(b, step, device)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (b, step, device, stream)
    got = _ROW_STARTS.get(key)
    if got is None:
        if len(_ROW_STARTS) >= 256:
            _ROW_STARTS.clear()
        got = _ROW_STARTS[key] = _new_row_starts(b, step, device)
    return got


_ROW_STARTS: dict = {}


def _new_row_starts(b: int, step: int, device) -> torch.Tensor:
    # One launch (an arange times step is two).
    if step == 0:
        return torch.zeros(b + 1, dtype=torch.int32, device=device)
    return torch.arange(0, (b + 1) * step, step, dtype=torch.int32, device=device)


def cdiv(a: int, b: int) -> int:
    # Plain ints: triton.cdiv on the host goes through the JIT's call path (~6 us a call).
    return -(-a // b)


def contiguous_strides(shape) -> tuple:
    """torch's strides of a contiguous tensor of ``shape`` (a dim of size 0 counts as 1): the
    strides of a buffer a launcher will allocate, known when its launch is planned."""
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(st))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def strides(t: torch.Tensor, varlen: bool = False) -> tuple:
    """The three leading strides of a ``(B, S, H, ...)`` tensor (or ``(B, H, S)`` lse), or
    ``(0, s0, s1)`` of a packed varlen one (``(total, H, ...)``, ``(H, total)``): varlen
    tensors have no batch stride, the sequence offset moves along the rows."""
    st = t.stride()
    return (0, st[0], st[1]) if varlen else (st[0], st[1], st[2])


def stride_args(dims: str, varlen: bool = False, **tensors: torch.Tensor) -> dict:
    """Launch keywords ``stride_<name><dim>`` of each tensor's :func:`strides`, the dims
    named by the letters of ``dims``: ``stride_args("bsh", q=q)`` gives ``stride_qb``,
    ``stride_qs``, ``stride_qh``."""
    args = {}
    for keys, t in zip(_stride_keys(dims, tuple(tensors)), tensors.values()):
        args.update(zip(keys, strides(t, varlen)))
    return args


def positional(kernel, n_tensors: int, kw: dict) -> tuple[tuple, dict]:
    """A launch's keywords as the kernel's arguments after its first ``n_tensors``, in the
    kernel's order (positional arguments are cheaper to pass and for Triton to bind), and
    the rest: the launch options (``num_warps``, ...). For launch plans built once and
    reused; a missing argument is a KeyError here, not a wrong launch."""
    rest = dict(kw)
    return tuple(map(rest.pop, kernel.arg_names[n_tensors:])), rest


class Launch:
    """One planned launch, ``kernel[grid](*tensors, *args, **options)``, everything but the
    tensors fixed when the plan is made (the tensors are the kernel's leading arguments).

    The first call goes through Triton's JIT path (binding and specialising ~60 arguments,
    finding or compiling the kernel) and keeps the compiled kernel it returns. A later call
    whose tensors have the dtypes of that call and 16-byte aligned addresses (what Triton
    specialised the kernel for; ``args`` fixes every other argument) calls the compiled
    kernel's own launcher, as Triton's ``CompiledKernel[grid](...)`` does: about 20 µs less
    host time a launch on the H200's host (``benchmarks/profile_host.py``: 34 against 14.5 µs
    for an empty kernel of 32 arguments). Other dtypes, a misaligned tensor, another current
    device, Triton's launch hooks (profilers) and the interpreter take the JIT path.
    """

    __slots__ = ("kernel", "grid", "args", "options", "_compiled", "_share")

    def __init__(self, kernel, grid: tuple, args: tuple, options: dict):
        self.kernel = kernel
        # Plain ints: a grid of tl.constexpr (``cdiv(n, 2 * HALF_M)``) would make Triton's
        # launcher multiply constexpr objects in Python on every launch.
        self.grid = tuple(int(getattr(g, "value", g)) for g in grid) + (1,) * (3 - len(grid))
        self.args = tuple(args)
        self.options = options
        # (device index, tensor dtypes, compiled kernel, raw launch or None), from the first
        # aligned call.
        self._compiled = None
        # This launch's key in _SHARED (None: not made yet; False: none, or used).
        self._share = None

    def __call__(self, *tensors) -> None:
        c = self._compiled
        if c is None and self._share is None:
            c = self._adopt(tensors)
        if c is not None and _fast_path(c[0], c[1], tensors):
            device, _, kernel, raw = c
            if raw is not None and RAW_LAUNCH:
                raw[0](*raw[1], torch._C._cuda_getCurrentRawStream(device),
                       *(_with_scratch(raw[2], raw[3]) if raw[3] else raw[2]), *tensors,
                       *self.args)
                return
            g0, g1, g2 = self.grid
            kernel.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device),
                       kernel.function, kernel.packed_metadata, None, None, None,
                       *tensors, *self.args)
            return
        self._keep(self.kernel[self.grid](*tensors, *self.args, **self.options), tensors)

    def _keep(self, kernel, tensors) -> None:
        """Keeps the compiled kernel of a JIT launch (the first aligned one), for this launch
        and in ``_SHARED`` for later launches of the same specialisation."""
        if self._compiled is None and kernel is not None and not interpreting():
            dtypes = _signature(tensors)
            if dtypes is not None:
                self._compiled = (torch.cuda.current_device(), dtypes, kernel,
                                  _raw_launch(kernel, self.grid))
                if self._share:
                    if len(_SHARED) >= _MAX_SHARED:
                        _SHARED.clear()
                    _SHARED[self._share] = kernel
                self._share = False

    def _adopt(self, tensors):
        """The first call's look in ``_SHARED``: the compiled kernel another launch of this
        kernel kept for the same specialisation (``_share_key``), adopted as this launch's
        (its ``_compiled``), so that a new plan (a cache one key longer, a new batch size)
        launches by the fast path from its first call instead of Triton's JIT path; None
        when none is kept (the key stays for ``_keep``) or sharing is off."""
        self._share = False
        if not SHARE_COMPILED or interpreting():
            return None
        key = _share_key(self, tensors)
        if key is None:
            return None
        try:
            kernel = _SHARED.get(key)
        except TypeError:  # (an argument that does not hash: no sharing)
            return None
        if kernel is None:
            self._share = key
            return None
        self._compiled = (key[1], list(key[2]), kernel, _raw_launch(kernel, self.grid))
        return self._compiled


class SizedLaunch(Launch):
    """A :class:`Launch` whose grid and some arguments change from call to call:
    ``run(grid, sized, *tensors)``, with ``sized`` the values of the arguments named at
    construction, in that order. Each of those must be one of the kernel's
    ``do_not_specialize`` arguments (checked here), so that the kernel compiled for one call
    serves every value: the paged forward's lengths (``max_seqlen_q``, ``max_seqlen_k``, the
    packed rows), which a serving engine's steps change every call, then need no new plan
    and no JIT launch."""

    __slots__ = ("slots",)

    def __init__(self, kernel, n_tensors: int, kw: dict, sized: tuple):
        params = getattr(kernel, "params", None)  # (the interpreter's kernels have none)
        for name in sized:
            if params is not None and not params[kernel.arg_names.index(name)].do_not_specialize:
                raise ValueError(f"{name} is specialised by Triton: a kernel compiled for one "
                                 f"value would run others; add it to do_not_specialize")
        args, options = positional(kernel, n_tensors, {**kw, **dict.fromkeys(sized, 0)})
        names = kernel.arg_names[n_tensors:]
        super().__init__(kernel, (1,), args, options)
        self.slots = tuple(names.index(name) for name in sized)

    def __call__(self, grid, sized, *tensors) -> None:
        args = list(self.args)
        for i, x in zip(self.slots, sized):
            args[i] = x
        grid = tuple(grid) + (1,) * (3 - len(grid))
        c = self._compiled
        if c is None and self._share is None:
            c = self._adopt(tensors)  # (its key holds the sized arguments' placeholders)
        if c is not None and _fast_path(c[0], c[1], tensors):
            device, _, kernel, raw = c
            stream = torch._C._cuda_getCurrentRawStream(device)
            if raw is not None and RAW_LAUNCH:
                # (raw[3]: the scratch bytes of one program, planned on a grid of 1.)
                raw[0](*grid, stream, *(_with_scratch(raw[2], raw[3] * grid[0] * grid[1]
                                                      * grid[2]) if raw[3] else raw[2]),
                       *tensors, *args)
                return
            kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *tensors, *args)
            return
        self._keep(self.kernel[grid](*tensors, *args, **self.options), tensors)


# Launch's raw path (off: through Triton's CudaLauncher.__call__; benchmarks' A/B).
RAW_LAUNCH = True

# Compiled kernels shared between launches of one specialisation (off: each launch's first
# call takes Triton's JIT path; benchmarks' A/B). A plan is made for each new shape (a
# growing cache's every length, transformers' first layer of each generate step); its
# launches then find the kernel Triton compiled for an earlier plan of the same classes of
# arguments here, by a key that holds what Triton's own cache key holds for them.
SHARE_COMPILED = True
_SHARED: dict = {}
_MAX_SHARED = 1024


def _share_key(launch: Launch, tensors) -> tuple | None:
    """``launch``'s key in ``_SHARED`` for a call on ``tensors``: the kernel, the current
    device, the tensors' dtypes (16-byte aligned: what Triton specialises a pointer on, and
    what the fast path checks every call), each argument as Triton's binder specialises it
    (a constexpr by its type and value; an int by its type, whether it is 1 and whether 16
    divides it, unless the kernel says not to; a float as fp32) and the launch options.
    None where that cannot be told here: an annotated argument, a tensor among the
    arguments, a host TMA descriptor among the tensors, a misaligned tensor."""
    kernel = launch.kernel
    params = getattr(kernel, "params", None)
    dtypes = _signature(tensors)
    if params is None or dtypes is None or len(params) != len(tensors) + len(launch.args) or \
            any(t is not None and t.__class__ is not torch.Tensor for t in tensors):
        return None
    spec = []
    for kp, a in zip(params[len(tensors):], launch.args):
        if kp.is_constexpr:
            a = getattr(a, "value", a)
            spec.append((a.__class__, a))  # (the type too: True, 1 and 1.0 hash alike)
        elif kp.annotation_type or isinstance(a, torch.Tensor):
            return None
        else:
            spec.append(_specialize(BaseBackend, a, kp.is_const, not kp.do_not_specialize,
                                    not kp.do_not_specialize_on_alignment))
    options = tuple(sorted(launch.options.items()))
    return (kernel, torch._C._cuda_getDevice(), tuple(dtypes), tuple(spec), options)


def _with_scratch(after: tuple, nbytes: int) -> tuple:
    """``_raw_launch``'s arguments after the stream with a fresh global scratch buffer of
    ``nbytes`` in its place (the kernels' in-kernel TMA descriptors), a buffer a launch as
    Triton's launcher allocates it."""
    return after[:3] + (alloc_scratch(nbytes, 128, None),) + after[4:]


def _raw_launch(kernel, grid: tuple):
    """Triton 3.6's C launch function of a compiled kernel that takes no host tensor
    descriptors and no profiling scratch, with the arguments its ``CudaLauncher.__call__``
    puts around the stream: ``(launch, grid, after_stream, scratch_bytes)``, where a kernel
    with global scratch (Gluon's in-kernel TMA descriptors) gets ``scratch_bytes`` from
    :func:`alloc_scratch` a launch in ``after_stream``'s fourth place, as Triton's allocator
    (the one ``dispatch`` installs) would; None for any other launcher (a Python wrapper,
    another triton)."""
    runner = getattr(kernel, "run", None)
    launch = getattr(runner, "launch", None)
    scratch = getattr(runner, "global_scratch_size", None)
    if launch is None or hasattr(launch, "__code__") or not callable(launch) or \
            scratch is None or getattr(runner, "profile_scratch_size", 1) or \
            (scratch and getattr(runner, "global_scratch_align", 1024) > 512):
        return None
    nbytes = grid[0] * grid[1] * grid[2] * getattr(runner, "num_ctas", 1) * scratch
    return (launch, tuple(grid), (kernel.function, runner.launch_cooperative_grid,
                                  runner.launch_pdl, None, None, kernel.packed_metadata,
                                  None, None, None), nbytes)


_HOOKS = triton.knobs.runtime


class DescLaunch:
    """A :class:`Launch` whose leading tensors become TMA descriptors made on the host, after
    its first call: each call then passes Triton 3.6's C launcher the descriptors' fields
    itself, where Triton's tensor-descriptor wrapper would loop in Python over every argument
    and encode each descriptor again (``make_tensordesc_arg``).

    ``fields[i]`` is None for a tensor passed as itself, else ``(shape, strides, box,
    layout)`` of the descriptor over tensor ``i``, fixed by the launch's plan. A descriptor's
    encoding (``CUtensorMap``) is a function of its base address and those fields only, so
    the encodings are kept by address (``maps``): a training loop's buffers come back at the
    same addresses step after step. The first call, other dtypes, misaligned tensors, launch
    hooks and a triton whose launcher differs take :class:`Launch`'s path with
    ``TensorDescriptor`` objects (what ``make`` gives them).
    """

    __slots__ = ("run", "fields", "make", "_direct", "maps")

    # Encodings kept a launch (128-byte objects); past this the cache starts over. One plan
    # serves every layer of a model (same shapes, other buffers): 9 descriptors x 32 layers
    # of a training step fit with room for the allocator's address drift.
    MAX_MAPS = 1024

    def __init__(self, run: Launch, fields: tuple, make):
        self.run, self.fields, self.make = run, fields, make
        # (C launcher, per-argument plan, base args, device, dtypes, fixed args, encoder), or
        # False: never.
        self._direct = None
        self.maps = {}

    def __call__(self, *tensors) -> None:
        d = self._direct
        if d and DESC_DIRECT and _fast_path(d[3], d[4], tensors):
            launcher, plan, head, device, _, tail, fill = d
            maps, args = self.maps, []
            for i, (t, p) in enumerate(zip(tensors, plan)):
                if p is None:
                    args.append(t)
                    continue
                ptr = t.data_ptr()
                m = maps.get((i, ptr))
                if m is None:
                    if len(maps) >= self.MAX_MAPS:
                        maps.clear()
                    m = maps[(i, ptr)] = fill(ptr, *p[0])
                args.append(m)
                args.extend(p[1])
            launcher(*head[:3], torch._C._cuda_getCurrentRawStream(device), *head[3:], *args,
                     *tail)
            return
        self.run(*[t if f is None else self.make(t, *f) for t, f in zip(tensors, self.fields)])
        if d is None and getattr(self.run, "_compiled", None) is not None:
            self._direct = _direct_plan(self.run, self.fields) or False


# DescLaunch's direct path (off: every call through Triton's wrapper; benchmarks' A/B).
DESC_DIRECT = True


def _direct_plan(run: Launch, fields: tuple):
    """:class:`DescLaunch`'s fast path for ``run``'s compiled kernel, or None where this
    triton's launcher is not the one it was written against (3.6: a C ``launch`` under
    ``wrap_handle_tensordesc``'s closure) or would allocate scratch."""
    device, dtypes, kernel = run._compiled[:3]
    runner = kernel.run
    wrapped = getattr(runner, "launch", None)
    code, cells = getattr(wrapped, "__code__", None), getattr(wrapped, "__closure__", None)
    if code is None or cells is None or runner.global_scratch_size or \
            runner.profile_scratch_size:
        return None
    env = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    launcher, metas = env.get("launcher"), env.get("tensordesc_meta")
    n_desc = sum(f is not None for f in fields)
    if launcher is None or not metas or len(metas) != n_desc or len(
            env.get("tensordesc_indices", ())) != n_desc:
        return None
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    plan, metas = [], iter(metas)
    for f in fields:
        if f is None:
            plan.append(None)
            continue
        meta, (shape, strides, _, _) = next(metas), f
        if meta is None or meta["fp4_padded"]:
            return None
        # fill_tma_descriptor's arguments after the address, as make_tensordesc_arg passes
        # them (padding 0: zeros), then the shape and strides the kernel reads beside it.
        plan.append(((meta["swizzle"], meta["elem_size"],
                      TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                      list(shape), list(strides), 0), (*shape, *strides)))
    g0, g1, g2 = run.grid
    head = (g0, g1, g2, kernel.function, runner.launch_cooperative_grid, runner.launch_pdl,
            None, None, kernel.packed_metadata, None, None, None)
    return (launcher, tuple(plan), head, device, dtypes, run.args,
            triton.runtime.driver.active.utils.fill_tma_descriptor)


def _fast_path(device: int, dtypes: list, tensors) -> bool:
    """Whether a launch may skip Triton's JIT path (:class:`Launch`, :class:`DescLaunch`): no
    launch hook (profilers) set, the tensors have the dtypes and 16-byte alignment the kernel
    was compiled for, and the current device is the one it was."""
    return (_no_hook(_HOOKS.launch_enter_hook) and _no_hook(_HOOKS.launch_exit_hook)
            and _signature(tensors) == dtypes and torch._C._cuda_getDevice() == device)


def _no_hook(hook) -> bool:
    # Triton 3.6's launch hooks are chains, empty unless a profiler added to them.
    return hook is None or not getattr(hook, "calls", True)


def _signature(tensors) -> list | None:
    """The tensors' dtypes (None for an absent one), or None if one is not 16-byte aligned.
    A host TMA descriptor counts as its tensor (``base``)."""
    bits, dtypes = 0, []
    for t in tensors:
        if t is None:
            dtypes.append(None)
        else:
            t = getattr(t, "base", t)
            bits |= t.data_ptr()
            dtypes.append(t.dtype)
    return None if bits % 16 else dtypes


@functools.cache
def _stride_keys(dims: str, names: tuple) -> tuple:
    # Cached: the launchers of the decode step call stride_args every step.
    return tuple(tuple(f"stride_{name}{dim}" for dim in dims) for name in names)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(t: torch.Tensor) -> tuple[int, int]:
    """Compute capability of a CUDA tensor's device, cached (torch asks the driver each time:
    tens of microseconds a public call)."""
    index = t.device.index
    return _capability(torch.cuda.current_device() if index is None else index)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs sm90+, 16-byte aligned bases and row strides, and 16-byte rows at least."""
    if not interpreting() and (not tensors[0].is_cuda or capability(tensors[0])[0] < 9):
        return False
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


def alloc_scratch(size: int, alignment: int, stream):
    # Global scratch where the kernels write their in-kernel TMA descriptors (128 B each):
    # the caching allocator's blocks are 512-byte aligned (what Triton asks is less).
    return torch.empty(size, device="cuda", dtype=torch.int8)


@triton.jit
def load_rows(ref, o_r, i_r0, stride_r, n_rows, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              N_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile ``[BLOCK_R, BLOCK_C]`` of rows ``i_r0 + o_r`` of a (rows, N_COLS) slice, zeros outside."""
    if USE_TMA:
        b_x = ref.load([i_r0, 0])
    else:
        o_c = tl.arange(0, BLOCK_C)
        p_x = ref + o_r[:, None].to(tl.int64) * stride_r + o_c[None, :]
        m_x = (o_r[:, None] < n_rows) & (o_c[None, :] < N_COLS)
        b_x = tl.load(p_x, mask=m_x, other=0.0)
    return b_x


@triton.jit
def seq_span(cu_seqlens, i_b, total, max_len):
    """``(start, length)`` of packed sequence ``i_b``, clamped so that any offsets stay inside
    the ``total`` rows: ``cu_seqlens[i_b]`` to ``[0, total]``, the end to ``[start, total]``,
    the length to ``max_len`` (what the grid covers). Valid input is unchanged."""
    s0 = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_b), 0), total)
    s1 = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_b + 1), s0), total)
    return s0.to(tl.int64), tl.minimum(s1 - s0, max_len).to(tl.int32)


@triton.jit
def seq_spans(cu_seqlens, o_b, m_b, total, max_len):
    """:func:`seq_span` of the sequences ``o_b`` at once (``m_b``: which exist): vectors of
    starts and lengths, clamped the same way; a missing sequence has length 0.
    Layout-agnostic (the Gluon paged forward calls it too)."""
    s0 = tl.minimum(tl.maximum(tl.load(cu_seqlens + o_b, mask=m_b, other=0), 0), total)
    s1 = tl.minimum(tl.maximum(tl.load(cu_seqlens + o_b + 1, mask=m_b, other=0), s0), total)
    return s0, tl.minimum(s1 - s0, max_len)


@triton.jit
def slice_ptr(x, i_b, bos, i_h, stride_b, stride_s, stride_h):
    """Row 0 of head ``i_h`` of sequence ``i_b`` in ``x`` (``strides``: a varlen tensor has
    batch stride 0 and its sequence starts at packed row ``bos``; 0 when dense). Batch and
    head indices in int64, so the offsets of multi-gigabyte tensors do not wrap."""
    return x + i_b.to(tl.int64) * stride_b + bos * stride_s + i_h.to(tl.int64) * stride_h


@triton.jit
def seq_bounds(i_b, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k, seqused_k,
               IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """``(bos, bos_k, T_q, T_k)`` of sequence ``i_b``: its first query / key row in the
    packed tensors (0 when dense) and its lengths (``seqused_k`` caps the keys).

    Varlen offsets and lengths are clamped (``seq_span``), so that any values (GPU value
    checks are opt-in) stay inside the packed tensors of ``total_q`` / ``total_k`` rows;
    ``seqused_k`` to ``[0, T_k]``."""
    if IS_VARLEN:
        bos, T_q = seq_span(cu_seqlens_q, i_b, total_q, seqlen_q)
        bos_k, T_k = seq_span(cu_seqlens_k, i_b, total_k, seqlen_k)
        if HAS_SEQUSED_K:
            T_k = tl.minimum(tl.maximum(tl.load(seqused_k + i_b), 0), T_k)
    else:
        bos = 0
        bos_k = 0
        T_q = seqlen_q
        T_k = seqlen_k
    return bos, bos_k, T_q, T_k


@triton.jit
def stats_offset(i_b, bos, i_h, stride_b, stride_h):
    """Offset of the first row of sequence ``i_b``, head ``i_h``, in the backward's per-row
    statistics (lse_log2, delta), rows contiguous. Dense: ``(B, H, S)`` and ``bos = 0``.
    Varlen: ``(H, total + 4 B)`` with ``stride_b = 4``; a sequence starts at ``4 i_b + bos``
    rounded down to a multiple of 4, a 16-byte boundary for TMA (starts grow by at least
    ``T + 1`` from one sequence to the next, so no two overlap). In int64, as ``slice_ptr``."""
    return i_b.to(tl.int64) * stride_b + i_h.to(tl.int64) * stride_h + (bos // 4) * 4


@triton.jit
def seq_block(i_b, i_x, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q, cu_seqlens_k,
              seqused_k, BLOCK: tl.constexpr, KEYS: tl.constexpr, LAST_FIRST: tl.constexpr,
              IS_VARLEN: tl.constexpr, HAS_SEQUSED_K: tl.constexpr):
    """A program's block: sequence ``i_b``'s ``seq_bounds``, then block ``i_x`` of its query
    rows (``KEYS``: of its keys), its first and last index ``[x0, x_last]`` and the masks'
    ``shift = T_k - T_q`` (bottom-right aligned). ``LAST_FIRST`` counts the block back from
    the sequence's own last one and returns that index: negative for the programs of a grid
    sized for a longer sequence. Otherwise such a program has ``x0`` past the end. Either way
    it has no rows (keys) and returns before it loads anything; the caller tests the index
    itself (the sm_90 compile of a test of ``x0 < 0`` had 9 more instructions a loop)."""
    bos, bos_k, T_q, T_k = seq_bounds(i_b, seqlen_q, seqlen_k, total_q, total_k, cu_seqlens_q,
                                      cu_seqlens_k, seqused_k, IS_VARLEN, HAS_SEQUSED_K)
    n = T_k if KEYS else T_q
    if LAST_FIRST:
        i_x = (n + BLOCK - 1) // BLOCK - 1 - i_x
    x0 = i_x * BLOCK
    x_last = tl.minimum(x0 + BLOCK, n) - 1
    shift = T_k - T_q
    return bos, bos_k, T_q, T_k, i_x, x0, x_last, shift


@triton.jit
def key_ranges(m0, m_last, T_k, shift, left, right, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles of row block ``[m0, m_last]`` (bottom-right masks, ``shift = T_k - T_q``):
    ``[n_lo, n_hi)`` is seen by some row (tiles outside it are skipped), and its full middle
    ``[n_full_lo, n_full_hi)`` (multiples of BLOCK_N) is seen whole by every row, so only
    ``[n_lo, n_full_lo)`` and ``[n_full_hi, n_hi)`` need the mask. ``n_lo == n_hi``: no key."""
    n_hi = T_k
    if HAS_RIGHT:
        n_hi = tl.minimum(n_hi, m_last + shift + right + 1)
    n_lo = 0
    if HAS_LEFT:
        n_lo = tl.maximum(m0 + shift - left, 0)
        n_lo = (n_lo // BLOCK_N) * BLOCK_N
    n_hi = tl.maximum(n_hi, n_lo)
    n_end = T_k
    if HAS_RIGHT:
        n_end = tl.minimum(n_end, m0 + shift + right + 1)
    n_full_hi = (tl.maximum(n_end, 0) // BLOCK_N) * BLOCK_N
    n_full_lo = n_lo
    if HAS_LEFT:
        n_start = tl.maximum(m_last + shift - left, 0)
        n_full_lo = tl.maximum(tl.cdiv(n_start, BLOCK_N) * BLOCK_N, n_lo)
    n_full_lo = tl.minimum(n_full_lo, n_hi)
    n_full_hi = tl.minimum(tl.maximum(n_full_hi, n_full_lo), n_hi)
    return n_lo, n_full_lo, n_full_hi, n_hi


@triton.jit
def row_ranges(n0, n_last, T_q, T_k, shift, left, right, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Row blocks of key block ``[n0, n_last]`` (the transpose of ``key_ranges``):
    ``[m_lo, m_hi)`` see some key of it, ``[m_full_lo, m_full_hi)`` (multiples of BLOCK_M)
    see all of it, so only the rest needs the mask. The ragged last key block (past T_k)
    is masked in every tile."""
    # Rows that see some key of the block: [m_lo, m_hi).
    m_lo = 0
    if HAS_RIGHT:
        m_lo = tl.maximum(n0 - shift - right, 0)
        m_lo = (m_lo // BLOCK_M) * BLOCK_M
    m_hi = T_q
    if HAS_LEFT:
        m_hi = tl.minimum(m_hi, n_last - shift + left + 1)
    m_hi = tl.maximum(m_hi, m_lo)
    # Row blocks that see the whole key block: [m_full_lo, m_full_hi).
    m_full_lo = m_lo
    if HAS_RIGHT:
        m_start = tl.maximum(n0 + BLOCK_N - 1 - shift - right, 0)
        m_full_lo = tl.maximum(tl.cdiv(m_start, BLOCK_M) * BLOCK_M, m_lo)
    m_full_hi = m_hi
    if HAS_LEFT:
        m_end = tl.maximum(n0 - shift + left + 1, 0)
        m_full_hi = tl.minimum((m_end // BLOCK_M) * BLOCK_M, m_hi)
    # The ragged last key block: every tile masks the keys past T_k.
    m_full_lo = tl.where(n0 + BLOCK_N > T_k, m_hi, m_full_lo)
    m_full_lo = tl.minimum(m_full_lo, m_hi)
    m_full_hi = tl.minimum(tl.maximum(m_full_hi, m_full_lo), m_hi)
    return m_lo, m_full_lo, m_full_hi, m_hi


@triton.jit
def final_stats(m_i, l_i, sink_nat, HAS_SINK: tl.constexpr):
    """A row's ``(o_scale, lse)`` from its base-2 online-softmax state (running max ``m_i``,
    sum ``l_i``) and, with HAS_SINK, its sink logit (natural log): out = acc * o_scale.
    ``l == 0`` exactly for a row with no visible key: out = 0 and lse = -inf, or the sink
    itself (not its round trip through base 2); a NaN propagates, and a +inf sink gives NaN
    (``2^(inf - inf)``); a -inf sink pivots on 0.
    Neither branch of a ``where`` divides by, or takes the log of, the zero sum."""
    if HAS_SINK:
        sink2 = sink_nat * LOG2E
        m_f = tl.maximum(m_i, sink2)
        piv = tl.where(m_f == float("-inf"), 0.0, m_f)
        w = tl.exp2(m_i - piv)
        l_f = l_i * w + tl.exp2(sink2 - piv)
        nonempty = l_f != 0.0
        l_safe = tl.where(nonempty, l_f, 1.0)
        o_scale = tl.where(nonempty, w / l_safe, 0.0)
        lse = tl.where(nonempty, (piv + tl.log2(l_safe)) * LN2, float("-inf"))
        # An empty row's lse is the sink itself, unless the sink is +inf (l_f = 2^(inf - inf)
        # is NaN: lse NaN, as the PyTorch path) or NaN.
        lse = tl.where((l_i == 0.0) & (l_f == l_f), sink_nat, lse)
    else:
        nonempty = l_i != 0.0
        l_safe = tl.where(nonempty, l_i, 1.0)
        o_scale = tl.where(nonempty, 1.0 / l_safe, 0.0)
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    return o_scale, lse


@triton.jit
def decode_split(cache_seqlens, i_b, i_s, seqlen_add, capacity, num_splits, left,
                 SQ: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                 HAS_SEQLENS: tl.constexpr, HAS_LEFT: tl.constexpr):
    """Split ``i_s`` of sequence ``i_b``'s keys in a split-KV decode: ``(sk, n_start, n_end)``.

    ``sk`` is the cache length plus the tokens just appended, clamped to the cache (value
    checks are opt-in: a length out of range reads no memory outside it). Keys before row 0's
    window start are seen by no row; the range starts on a tile boundary so that paged and
    contiguous caches walk the same tiles, and each split takes a multiple of TILES tiles."""
    if HAS_SEQLENS:
        sk = tl.minimum(tl.maximum(tl.load(cache_seqlens + i_b) + seqlen_add, 0), capacity)
    else:
        sk = capacity
    n_lo = 0
    if HAS_LEFT:
        n_lo = tl.maximum(sk - SQ - left, 0)
    n_lo = (n_lo // BLOCK_N) * BLOCK_N
    n_tiles = (tl.maximum(sk - n_lo, 0) + BLOCK_N - 1) // BLOCK_N
    per_split = TILES * ((n_tiles + TILES * num_splits - 1) // (TILES * num_splits))
    n_start = n_lo + i_s * per_split * BLOCK_N
    n_end = tl.minimum(sk, n_start + per_split * BLOCK_N)
    return sk, n_start, n_end


@triton.jit
def paged_keys(p_bt, T_k, num_pages, o_p, PAGE_SIZE: tl.constexpr):
    """Keys of a paged sequence: ``T_k`` ended before its first block-table entry outside
    ``[0, num_pages)`` (value checks are opt-in: that page and the later ones hold no key and
    are never read), so every page a tile loads is inside the cache. ``p_bt`` is the
    sequence's block-table row; ``o_p`` an ``arange(0, BLOCK_P)`` in the caller's layout (the
    entries looked at a step). Layout-agnostic (the Gluon paged forward calls it too)."""
    n_pages = (T_k + PAGE_SIZE - 1) // PAGE_SIZE
    first_bad = n_pages
    for p0 in range(0, n_pages, o_p.shape[0]):
        o_pp = p0 + o_p
        m_p = o_pp < n_pages
        b_page = tl.load(p_bt + o_pp, mask=m_p, other=0)
        b_bad = m_p & ((b_page < 0) | (b_page >= num_pages))
        first_bad = tl.minimum(first_bad, tl.min(tl.where(b_bad, o_pp, n_pages), 0))
    return tl.minimum(T_k, first_bad * PAGE_SIZE)


@triton.jit
def token_rows(table, token_pages, o_n, m_n, i_b, stride_tb, stride_pb, table_sk, per_batch,
               table_pages, TOKEN_PAGE: tl.constexpr):
    """Top-k lists read as a token table (sparse attention; decode.py's TOKEN_TABLE): keys
    ``o_n`` (where ``m_n``) of sequence ``i_b`` are the token positions ``j`` its row of
    ``table`` lists; ``(row, ok)``: the cache row of each (int64), ``b * Sk + j`` of batch
    ``b = i_b // per_batch`` contiguous, or through the cache's own block table
    (``token_pages``, pages of TOKEN_PAGE rows) ``token_pages[b, j // TOKEN_PAGE] * TOKEN_PAGE
    + j % TOKEN_PAGE``, and which hold a key: a position outside ``[0, Sk)`` (-1: none) or on
    a page outside ``[0, table_pages)`` is masked, and only entries of existing keys are
    read. Layout-agnostic (the Gluon kernels call it on their own layouts)."""
    b_j = tl.load(table + i_b.to(tl.int64) * stride_tb + o_n, mask=m_n, other=-1)
    m_n = m_n & (b_j >= 0) & (b_j < table_sk)
    i_bb = (i_b // per_batch).to(tl.int64)
    if TOKEN_PAGE > 0:
        b_pg = tl.load(token_pages + i_bb * stride_pb + b_j // TOKEN_PAGE, mask=m_n,
                       other=0).to(tl.int64)
        m_n = m_n & (b_pg >= 0) & (b_pg < table_pages)
        b_row = b_pg * TOKEN_PAGE + b_j % TOKEN_PAGE
    else:
        b_row = i_bb * table_sk + b_j
    return b_row, m_n
