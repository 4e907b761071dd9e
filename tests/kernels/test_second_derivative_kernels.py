"""tests/test_second_derivative.py on the kernels: no second derivative, a clear error."""

import pytest
import torch
from test_second_derivative import NAMES, check_no_second_derivative

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16


@pytest.mark.parametrize("name", NAMES)
def test_no_second_derivative_on_the_kernels(device, name):
    check_no_second_derivative(name, device, DTYPE)
