"""The engine tests run on every device this machine has: the CPU always, CUDA when a GPU is visible."""
from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
