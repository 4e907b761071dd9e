"""Public calls run on their tensors' CUDA device (``ops._dispatch.on_tensor_device``):
Triton launches on the *current* device, so a call on cuda:1 tensors while cuda:0 is
current (a model split over GPUs) must switch first, as torch's own CUDA ops do. Here on
the CPU with a tensor that says it lives on cuda:1; on two GPUs,
tests/kernels/test_multi_gpu.py runs the calls themselves."""

import contextlib

import pytest
import torch

import flashlse as fl
from flashlse import distributed
from flashlse.integrations import sdpa
from flashlse.ops._dispatch import on_tensor_device


class _OnCuda1(torch.Tensor):
    """A CPU tensor that answers as a cuda:1 tensor does to the guard's questions."""

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 1

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.fixture
def switches(monkeypatch):
    """cuda:0 current; records each device the guard switches to."""
    seen = []

    @contextlib.contextmanager
    def device(d):
        seen.append(("enter", d))
        yield
        seen.append(("exit", d))

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    return seen


def test_a_call_on_another_device_runs_under_that_device(switches):
    ran = []
    f = on_tensor_device(lambda q, k=None: ran.append(list(switches)) or "out")
    t = torch.Tensor._make_subclass(_OnCuda1, torch.zeros(2))
    assert f(t) == "out" and f(q=t, k=1) == "out"  # (positional and keyword alike)
    cuda1 = torch.device("cuda", 1)
    assert ran == [[("enter", cuda1)], [("enter", cuda1), ("exit", cuda1), ("enter", cuda1)]]
    assert switches[-1] == ("exit", cuda1)


def test_a_call_on_the_current_device_or_the_cpu_does_not_switch(switches, monkeypatch):
    f = on_tensor_device(lambda q: "out")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert f(torch.Tensor._make_subclass(_OnCuda1, torch.zeros(2))) == "out"
    assert f(torch.zeros(2)) == "out" and f(None) == "out"
    assert switches == []


@pytest.mark.parametrize("fn", [
    fl.attention, fl.attention_varlen, fl.attention_with_kvcache, fl.sparse_attention,
    fl.merge, fl.merge_states, distributed.ring_attention, distributed.merge_across_ranks,
    sdpa.flash_attention_forward, sdpa.flash_attention_backward, sdpa.sdpa_flash_forward,
    sdpa.sdpa_flash_backward,
], ids=lambda f: f.__name__)
def test_every_entry_point_is_guarded(fn):
    """Every function a user (or SDPA's dispatcher) calls with CUDA tensors, and nothing
    lost of its name, signature or docstring."""
    assert fn.__code__ is on_tensor_device(lambda q: q).__code__
    assert fn.__wrapped__.__doc__ == fn.__doc__ and fn.__wrapped__.__name__ == fn.__name__
