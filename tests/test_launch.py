"""``kernels._common.Launch``: a planned launch calls the compiled kernel's own launcher only
for tensors of the dtypes and alignment the kernel was compiled for, and Triton's JIT path
otherwise. Fakes stand in for the kernel, the device and the stream (no GPU here); the GPU
tests (tests/kernels/test_launch_fast_path.py) run the real thing."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from flashlse.kernels import _common


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("fast", args))


class _Kernel:
    """``kernel[grid](*args, **options)`` as Triton's JIT path: logs, returns its kernel."""

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return self.compiled
        return launch


@pytest.fixture
def fake_device(monkeypatch):
    dev = {"index": 0}
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: dev["index"])
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: dev["index"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i, raising=False)
    return dev


def _aligned(n, dtype=torch.float32, offset=0):
    return torch.zeros(n + 8, dtype=dtype)[offset:offset + n]


def test_first_call_jit_then_compiled_launcher(fake_device):
    k = _Kernel()
    run = _common.Launch(k, (4, 2), (7, 3.5, True), {"num_warps": 4})
    a, b = _aligned(16), _aligned(16, torch.int32)
    run(a, None, b)
    run(a, None, b)
    assert k.log[0] == ("jit", (4, 2, 1), (a, None, b, 7, 3.5, True), {"num_warps": 4})
    assert k.log[1] == ("fast", (4, 2, 1, 1000, "fn", "meta", None, None, None,
                                 a, None, b, 7, 3.5, True))
    assert len(k.log) == 2


def test_grid_of_constexprs_becomes_ints():
    import triton.language as tl
    run = _common.Launch(_Kernel(), (tl.constexpr(3), 2 * tl.constexpr(4)), (), {})
    assert run.grid == (3, 8, 1) and all(type(g) is int for g in run.grid)


@pytest.mark.parametrize("change", ["dtype", "misaligned", "none_slot", "device", "hook",
                                    "hook_chain"])
def test_other_specialisations_take_the_jit_path(fake_device, monkeypatch, change):
    k = _Kernel()
    run = _common.Launch(k, (1,), (), {})
    a, b = _aligned(16), _aligned(16)
    run(a, b)
    if change == "dtype":
        b = _aligned(16, torch.bfloat16)
    elif change == "misaligned":
        b = _aligned(16, offset=1)  # 4 bytes off
    elif change == "none_slot":
        b = None
    elif change == "device":
        fake_device["index"] = 1
    elif change == "hook":  # a plain function set as the hook
        monkeypatch.setattr(_common._HOOKS, "launch_exit_hook", lambda *a: None)
    else:  # a profiler's hook (proton adds to the chain)
        chain = _common._HOOKS.launch_enter_hook
        chain.add(print)
        try:
            run(a, b)
        finally:
            chain.remove(print)
        assert [e[0] for e in k.log] == ["jit", "jit"]
        return
    run(a, b)
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_a_misaligned_first_call_compiles_nothing_to_reuse(fake_device):
    k = _Kernel()
    run = _common.Launch(k, (1,), (), {})
    run(_aligned(16, offset=1))
    run(_aligned(16))  # the first aligned call compiles (JIT), the next one reuses
    run(_aligned(16))
    assert [e[0] for e in k.log] == ["jit", "jit", "fast"]


def test_interpreter_never_keeps_a_kernel(fake_device, monkeypatch):
    monkeypatch.setattr(_common, "interpreting", lambda: True)
    k = _Kernel()
    run = _common.Launch(k, (1,), (), {})
    run(_aligned(16))
    run(_aligned(16))
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_triton_specialises_tensors_on_dtype_and_alignment_only():
    """Launch reuses a compiled kernel for tensors of the same dtypes and 16-byte alignment:
    Triton's own specialisation of a tensor argument (what its JIT path keys the compiled
    kernel on) must be a function of exactly those two, whatever the shape, strides or
    address. A Triton that specialises on more fails here before a kernel meets a tensor it
    was not compiled for."""
    specialize = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    cuda = pytest.importorskip("triton.backends.nvidia.compiler").CUDABackend
    gen = torch.Generator().manual_seed(0)
    seen, back = {}, {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32):
        for _ in range(50):
            shape = tuple(int(x) for x in torch.randint(1, 9, (3,), generator=gen))
            base = torch.empty(2000, dtype=dtype)
            offset = int(torch.randint(0, 40, (), generator=gen))
            n = shape[0] * shape[1] * shape[2]
            t = base[offset:offset + n].view(shape)
            if torch.rand((), generator=gen) < 0.5:
                t = t.transpose(0, 2)
            for tensors in ((t,), (t, None)):
                ours = _common._signature(tensors)
                theirs = tuple(specialize(cuda, x, False, True, True) for x in tensors)
                key = None if ours is None else tuple(ours)
                # Same dtypes, all aligned: the same compiled kernel (a misaligned call,
                # key None, is never reused); and a kernel never serves two keys.
                if key is not None:
                    assert seen.setdefault(key, theirs) == theirs, (key, theirs)
                assert back.setdefault(theirs, key) == key, (theirs, key)
    # Aligned and misaligned met for each dtype, with and without the None slot.
    assert len(back) == 4 * 2 * 2 and len(seen) == 4 * 2


class _CLaunch:
    """Triton's C ``launch`` (a builtin: no ``__code__``): logs its arguments."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(("raw", args))


class _Runner:
    """A compiled kernel's ``run``: Triton 3.6's ``CudaLauncher`` fields around a C launch."""

    num_ctas, launch_cooperative_grid, launch_pdl = 1, False, True

    def __init__(self, log, scratch=0, profile=None):
        self.launch = _CLaunch(log)
        self.global_scratch_size = scratch
        self.profile_scratch_size = scratch if profile is None else profile
        self.global_scratch_align = self.profile_scratch_align = 128

    def __call__(self, *args):
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher.__call__(self, *args)


@pytest.mark.parametrize("scratch", [0, 96], ids=["no_scratch", "scratch"])
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "through_triton"])
def test_raw_launch_passes_what_triton_launcher_passes(fake_device, monkeypatch, raw, scratch):
    """After the first call a kernel is launched by Triton's C ``launch`` itself, with the
    arguments Triton's ``CudaLauncher.__call__`` gives it (that method runs here on the same
    fake launch, as the reference): a kernel with global scratch (Gluon's in-kernel TMA
    descriptors) gets a fresh buffer of grid x scratch bytes a launch from ``alloc_scratch``,
    the allocator the dispatcher installs for Triton."""
    pytest.importorskip("triton.backends.nvidia.driver")
    from triton.runtime import _allocation

    monkeypatch.setattr(_common, "RAW_LAUNCH", raw)
    buffers = []

    def alloc(size, alignment, stream):
        buffers.append(("buffer", size, len(buffers)))
        return buffers[-1]

    monkeypatch.setattr(_common, "alloc_scratch", alloc)
    k = _Kernel()
    k.compiled.run = _Runner(k.log, scratch=scratch, profile=0)
    run = _common.Launch(k, (4, 2), (7, 3.5, True), {"num_warps": 4})
    a, b = _aligned(16), _aligned(16, torch.int32)
    token = _allocation._allocator.set(alloc)  # Triton's allocator, as dispatch sets it
    try:
        for _ in range(3):
            run(a, None, b)
    finally:
        _allocation._allocator.reset(token)
    g = (4, 2, 1, 1000, "fn")
    for i, call in enumerate(k.log[1:]):
        held = ("buffer", 8 * scratch, i) if scratch else None
        assert call == ("raw", g + (False, True, held, None, "meta", None, None, None, a, None,
                                    b, 7, 3.5, True))
    assert k.log[0][0] == "jit" and len(k.log) == 3 and len(buffers) == (2 if scratch else 0)


def test_raw_launch_only_for_triton_36_launchers():
    """A Python ``launch`` (host tensor descriptors: Triton unwraps them) and profiling
    scratch are Triton's launcher's: no raw launch for them."""
    def kernel(runner):
        return type("K", (), {"run": runner, "function": "fn", "packed_metadata": "meta"})()

    log = []
    assert _common._raw_launch(kernel(_Runner(log)), (1, 1, 1)) is not None
    assert _common._raw_launch(kernel(_Runner(log, scratch=128, profile=0)), (2, 1, 1))[3] == 256
    assert _common._raw_launch(kernel(_Runner(log, scratch=128)), (1, 1, 1)) is None
    wrapped = _Runner(log)
    wrapped.launch = lambda *args: None
    assert _common._raw_launch(kernel(wrapped), (1, 1, 1)) is None


def test_sized_launch_passes_each_call_its_grid_and_lengths(fake_device, monkeypatch):
    """A SizedLaunch (the paged forward's) takes Triton's JIT path once, then launches the
    compiled kernel with each call's grid and sized arguments in their places among the
    fixed ones (raw, as Triton's launcher would; and through ``run`` with RAW_LAUNCH off)."""
    pytest.importorskip("triton.backends.nvidia.driver")
    k = _Kernel()
    k.arg_names = ["x", "y", "a", "n", "b", "m", "C"]
    k.compiled.run = _Runner(k.log)
    run = _common.SizedLaunch(k, 2, dict(a=7, b=2.5, C=True, n=None, m=None, num_warps=4),
                              ("m", "n"))
    x, y = _aligned(16), _aligned(8, torch.int32)
    run((3, 2), (40, 9), x, y)
    run((5,), (11, 1), x, y)
    monkeypatch.setattr(_common, "RAW_LAUNCH", False)
    run((1, 1, 7), (0, 2), x, y)
    assert k.log[0] == ("jit", (3, 2, 1), (x, y, 7, 9, 2.5, 40, True), {"num_warps": 4})
    head = ("fn", False, True, None, None, "meta", None, None, None)
    assert k.log[1] == ("raw", (5, 1, 1, 1000) + head + (x, y, 7, 1, 2.5, 11, True))
    assert k.log[2] == ("raw", (1, 1, 7, 1000) + head + (x, y, 7, 2, 2.5, 0, True))
    assert len(k.log) == 3


def test_sized_launch_refuses_a_specialised_argument():
    """Triton specialises an int argument on its value (1, multiples of 16) unless it is in
    the kernel's ``do_not_specialize``: a compiled kernel could not serve other values of
    it, so a SizedLaunch refuses to size it."""
    from flashlse.kernels import fwd

    fwd_sm90 = pytest.importorskip("flashlse.kernels.fwd_sm90")
    if not hasattr(fwd._attn_fwd_paged_kernel, "params"):
        pytest.skip("the interpreter's kernels carry no specialisation")
    for kernel, sized, fixed in ((fwd._attn_fwd_paged_kernel, fwd._PAGED_SIZED, "stride_qs"),
                                 (fwd_sm90._fwd_sm90_paged_kernel, fwd_sm90._PAGED_SIZED,
                                  "stride_tb")):
        kw = {name: 0 for name in kernel.arg_names[9:]}
        with pytest.raises(ValueError, match=f"{fixed} is specialised"):
            _common.SizedLaunch(kernel, 9, kw, (fixed,))
        run = _common.SizedLaunch(kernel, 9, kw, sized)
        assert [kernel.arg_names[9 + i] for i in run.slots] == list(sized)


@triton.jit(do_not_specialize=["m"])
def _spec_probe(x, y, n, m, f, flag, C: tl.constexpr, FLAG: tl.constexpr):
    pass


def test_share_key_is_tritons_specialisation():
    """``_share_key`` (the compiled kernels shared between launches) tells two launches apart
    exactly where Triton's own binder does (its JIT path's cache key: each argument's
    specialisation and the options): on random arguments, equal keys give equal
    specialisations (a kernel never serves arguments it was not compiled for) and the
    converse (no needless compile)."""
    from triton.runtime.jit import create_function_from_signature

    cuda = pytest.importorskip("triton.backends.nvidia.compiler").CUDABackend
    binder = create_function_from_signature(_spec_probe.signature, _spec_probe.params, cuda)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -16, -1]
    consts = [0, 1, True, False, 1.0, 16, None, 2.5, 64]
    gen = random.Random(0)
    x, y = _aligned(16, torch.bfloat16), _aligned(8, torch.int32)
    ours_of, theirs_of = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        for _ in range(4000):
            args = (gen.choice(ints), gen.choice(ints), gen.choice([0.5, 2.0]),
                    gen.choice([True, False]), gen.choice(consts), gen.choice(consts))
            opts = gen.choice([{"num_warps": 4}, {"num_warps": 8},
                               {"num_warps": 4, "num_stages": 2}])
            ours = _common._share_key(_common.Launch(_spec_probe, (1,), args, opts), (x, y))
            _, spec, options = binder(x, y, *args, **opts)
            theirs = str(spec) + str(options)
            assert ours is not None
            assert ours_of.setdefault(theirs, ours) == ours, (args, opts)
            assert theirs_of.setdefault(ours, theirs) == theirs, (args, opts)
    assert len(theirs_of) > 500  # (the classes met: not a few keys by chance)


def test_a_new_launch_adopts_the_kernel_kept_for_its_specialisation(fake_device, monkeypatch):
    """A launch's first call finds the kernel compiled for an earlier launch of the same
    kernel, argument classes, options and tensor dtypes (``_SHARED``) and launches it by the
    fast path on its own grid; other classes, options or dtypes, or sharing off, take
    Triton's JIT path."""
    monkeypatch.setattr(_common, "_SHARED", {})
    k = _Kernel()
    k.params = _spec_probe.params  # (a fake kernel with the probe's parameters)

    plain = (_aligned(16), _aligned(8))

    def launch(n, grid=(4,), warps=4, share=True, tensors=plain):
        monkeypatch.setattr(_common, "SHARE_COMPILED", share)
        _common.Launch(k, grid, (n, 5, 0.5, True, 64, False), {"num_warps": warps})(*tensors)

    launch(32)            # compiled (JIT), kept
    launch(48, grid=(5,))  # same classes: adopted
    launch(17)            # not a multiple of 16: JIT
    launch(33, grid=(6,))  # the class of 17: adopted
    launch(32, warps=8)   # other options: JIT
    launch(32, tensors=(_aligned(16, torch.float16), _aligned(8)))  # other dtypes: JIT
    launch(64, share=False)  # sharing off: JIT
    assert [e[0] for e in k.log] == ["jit", "fast", "jit", "fast", "jit", "jit", "jit"]
    assert k.log[1][1][:3] == (5, 1, 1) and k.log[3][1][:3] == (6, 1, 1)


def test_row_starts_kept_per_stream_fresh_while_capturing(monkeypatch):
    """``row_starts`` makes ``[0, step, ..., b * step]`` once per (shape, device, stream) and
    hands the same tensor to later calls on that stream; another stream gets its own (its
    calls are not ordered after the first stream's arange); while a CUDA graph captures, a
    fresh one each call, kept nowhere (the capture runs nothing, and a graph must not read a
    tensor the cache may drop). No GPU needed: the CUDA stream calls are faked."""
    state = {"stream": 7, "capturing": False}

    class Stream:
        def __init__(self, device):
            self.cuda_stream = state["stream"]

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    made = []
    monkeypatch.setattr(_common, "_new_row_starts", lambda b, step, device: made.append(
        (b, step)) or torch.arange(0, (b + 1) * step, step, dtype=torch.int32))
    monkeypatch.setattr(_common, "_ROW_STARTS", {})
    first = _common.row_starts(3, 64, "cuda")
    assert first.tolist() == [0, 64, 128, 192]
    assert _common.row_starts(3, 64, "cuda") is first and made == [(3, 64)]
    assert _common.row_starts(2, 64, "cuda") is not first and len(made) == 2
    state["stream"] = 9
    assert _common.row_starts(3, 64, "cuda") is not first and len(made) == 3
    state["capturing"] = True
    kept = dict(_common._ROW_STARTS)
    a, b = _common.row_starts(3, 64, "cuda"), _common.row_starts(3, 64, "cuda")
    assert a is not b and len(made) == 5 and _common._ROW_STARTS == kept
    monkeypatch.undo()
    assert _common.row_starts(2, 0, "cpu").tolist() == [0, 0, 0]
    assert _common.row_starts(2, 5, torch.device("cpu")).tolist() == [0, 5, 10]
