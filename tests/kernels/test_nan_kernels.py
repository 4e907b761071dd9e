"""tests/test_nan_propagation.py's checks on the kernels: the forward kernel (on an H100/H200
at D = 128 the Hopper Gluon kernel, the ``d128`` GPU cases), the split-KV decode kernel with the
combine kernel at 1-3 splits. Under ``TRITON_INTERPRET=1`` float32 on the CPU; on a GPU fp16."""

from __future__ import annotations

import pytest
import torch
from test_nan_propagation import IDS, PATHS, run_case, run_empty_blocks, run_neg_inf_sink

DTYPE = torch.float16 if torch.cuda.is_available() else torch.float32


@pytest.mark.parametrize("what", ["k", "q", "sink", "sink_inf"])
@pytest.mark.parametrize("path,num_splits", PATHS, ids=IDS)
def test_kernels_nan_reaches_exactly_the_rows_that_see_it(device, path, num_splits, what):
    run_case(device, DTYPE, path, what, num_splits)


@pytest.mark.parametrize("path,num_splits", PATHS, ids=IDS)
def test_kernels_neg_inf_sink_is_no_sink(device, path, num_splits):
    run_neg_inf_sink(device, DTYPE, path, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["k", "q", "sink"])
def test_kernels_nan_d128_hopper(device, what):
    run_case(device, DTYPE, "attention", what, d=128)


@pytest.mark.gpu
def test_kernels_neg_inf_sink_d128_hopper(device):
    run_neg_inf_sink(device, DTYPE, "attention", d=128)


@pytest.mark.parametrize("d", [16, pytest.param(128, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("sink_value", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "neginf"])
def test_kernels_sink_reaches_rows_of_whole_empty_blocks(device, sink_value, varlen, d):
    """A block of rows that sees no key is stored without a key tile (the Hopper kernel's
    ``_store_empty``, fwd.py's early store): the sink's NaN still reaches it."""
    run_empty_blocks(device, DTYPE, sink_value, d=d, varlen=varlen)
