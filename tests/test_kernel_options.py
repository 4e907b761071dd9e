"""flashlse.kernel_options: typed, nested, restored, and read by the launchers' allocator."""

import pytest
import torch

import flashlse as fl
from flashlse.kernels import options


def test_defaults_nesting_and_restore():
    assert options.current() == fl.KernelOptions()
    with fl.kernel_options(sm90_fwd=False) as outer:
        assert outer.sm90_fwd is False and options.current() is outer
        with fl.kernel_options(fwd_config={"BLOCK_N": 64}) as inner:
            # Changes stack on the options in force.
            assert inner.sm90_fwd is False and inner.fwd_config == {"BLOCK_N": 64}
        assert options.current() is outer
    assert options.current() == fl.KernelOptions()


def test_unknown_field_and_wrong_type_say_so():
    with pytest.raises(TypeError, match="KernelOptions fields: sm90_fwd"):
        with fl.kernel_options(use_sm90=False):
            pass
    with pytest.raises(TypeError, match="takes a KernelOptions"):
        with fl.kernel_options({"sm90_fwd": False}):
            pass
    with pytest.raises(AttributeError):
        fl.KernelOptions().pdl = False  # frozen


def test_poison_outputs_fills_the_launchers_buffers_with_nan():
    with fl.kernel_options(poison_outputs=True):
        assert torch.isnan(options.empty((4,), dtype=torch.float32, device="cpu")).all()
