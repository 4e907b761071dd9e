"""flashlse.kernel_options: typed, nested, restored, and read by the launchers' allocator."""

import pytest
import torch

import flashlse as fl
from flashlse.kernels import options
from flashlse.kernels.options import KernelOptions, kernel_options


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


def test_tile_overrides_convert_in_one_place():
    # KernelOptions' tile dicts become a TileConfig in configs.override: a mapping sets the
    # fields it names, a TileConfig replaces the entry, an unknown key is an error.
    pytest.importorskip("triton")
    from flashlse.kernels import configs

    base = configs.FWD[128]
    cfg = configs.override(base, {"BLOCK_N": 64, "USE_TMA": True}, configs.FWD_KEYS)
    assert (cfg.block_m, cfg.block_n, cfg.use_tma, cfg.num_warps) == (128, 64, True, 8)
    assert configs.override(base, None, configs.FWD_KEYS) is base
    mine = configs.TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    assert configs.override(base, mine, configs.FWD_KEYS) is mine
    with pytest.raises(ValueError, match="BLOCK_K"):
        configs.override(base, {"BLOCK_K": 64}, configs.FWD_KEYS)
    dkdv, dq = configs.bwd_configs(128, False, False)
    change = {"dkdv": (32, 64, 4, 2), "EARLY_DP": False}
    assert configs.override(dkdv, change, configs.BWD_KEYS, part="dkdv").tile == (32, 64, 4, 2)
    dq2 = configs.override(dq, change, configs.BWD_KEYS, part="dq")
    assert dq2.tile == dq.tile and not dq2.early_dp


@pytest.mark.parametrize("changes, exc, match", [
    (dict(pdl="yes"), TypeError, "pdl must be a bool, got str"),
    (dict(sm90_fwd=1), TypeError, "sm90_fwd must be a bool, got int"),
    (dict(fwd_config="x"), TypeError, "fwd_config takes a mapping or a TileConfig"),
    (dict(fwd_config={"block_m": 64}), ValueError, r"fwd_config: unknown keys \['block_m'\]"),
    (dict(fwd_sm90_config={"BLOCK_M": 64}), ValueError, "fwd_sm90_config: unknown keys"),
    (dict(bwd_config={"dkvd": (64, 64, 4, 2)}), ValueError, "bwd_config: unknown keys"),
])
def test_options_are_checked_where_they_are_written(changes, exc, match):
    """A bad option fails at kernel_options(), on any machine: a Hopper-only key off Hopper,
    or a switch of 1 / "yes", would otherwise pass unseen."""
    with pytest.raises(exc, match=match):
        with kernel_options(**changes):
            pass
    with pytest.raises(exc, match=match):
        KernelOptions(**changes)
