"""Kernel tests run on a CUDA GPU, or on CPU tensors under ``TRITON_INTERPRET=1`` (CI)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from flashlse import kernel_options

_HERE = Path(__file__).parent
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if os.environ.get("FLASHLSE_TEST_FUSED_MERGE") == "1":
    # Every split decode test on the split kernel that merges its own splits
    # (decode.FUSED_MERGE, on by default up to FUSED_MERGE_MAX_SPLITS splits): at any count,
    # sparse_attention's token table included (FUSED_MERGE_TOKEN_TABLE).
    from flashlse.kernels import decode

    decode.FUSED_MERGE_MAX_SPLITS = 1 << 30
    decode.FUSED_MERGE_TOKEN_TABLE = True


def pytest_collection_modifyitems(config, items):
    no_kernels = pytest.mark.skip(reason="needs a CUDA GPU or TRITON_INTERPRET=1")
    no_gpu = pytest.mark.skip(reason="real-size kernel test: needs a CUDA GPU")
    for item in items:
        if _HERE not in Path(item.path).parents:
            continue
        if not (HAS_CUDA or INTERPRET):
            item.add_marker(no_kernels)
        elif "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


# Every cache of plans and kept launches (module, names): fresh for each test.
_PLAN_CACHES = (
    ("flashlse.kernels.fwd", ("_PLANS", )),
    ("flashlse.kernels.fwd_sm90", ("_PLANS", )),
    ("flashlse.kernels.bwd", ("_BWD_PLANS", )),
    ("flashlse.kernels.decode", ("_PLANS", "_APPEND_PLANS")),
    ("flashlse.kernels.combine", ("_PLANS", )),
    ("flashlse.ops.attention", ("_KEPT", "_PAGED_KEPT", "_HEADS_FIRST")),
    ("flashlse.ops.kvcache", ("_KEPT", "_CHUNK_KEPT")),
    ("flashlse.ops.merge", ("_KEPT", )),
    ("flashlse.ops.sparse", ("_PLANS", )),
)


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    """Each test plans its own launches (and gets its caches back after): a plan kept by an
    earlier test of the same metadata would launch without the planning a test counts or
    steers with options and flags (session 48: a Hopper backward test found its dK/dV plan
    made by the test before it and never planned)."""
    import importlib

    for module, names in _PLAN_CACHES:
        mod = importlib.import_module(module)
        for name in names:
            monkeypatch.setattr(mod, name, type(getattr(mod, name))())
    yield


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every buffer a launcher allocates starts as NaN, so an unwritten element fails."""
    with kernel_options(poison_outputs=True):
        yield


@pytest.fixture
def kernel_opts():
    """``kernel_opts(sm90_fwd=False, ...)`` sets flashlse.kernel_options for the rest of the
    test (on top of the poisoned outputs)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(kernel_options(**changes))


@pytest.fixture
def compile_failures():
    """The kernels' memory of compile failures (``kernels/failures.py``), empty for this test and
    restored after it: a test that makes a kernel fail does not steer the ones after it."""
    from flashlse.kernels.failures import FAILURES

    with FAILURES.isolated():
        yield FAILURES
