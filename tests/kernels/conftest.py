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
    # sparse_attention's token table included (FUSED_MERGE_TOKEN_TABLE, off by default).
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
