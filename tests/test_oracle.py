"""moet.kernels.oracle: the backend of a forward and the layout a layer's weights are converted to."""

from __future__ import annotations

import pytest
import torch

from moet.kernels.oracle import MoeBackend, convert_to_moe_kernel_format, select_moe_backend
from moet.testing.random_stacked import random_stored


def test_cpu_layers_keep_the_stored_tensors_and_run_the_cpu_backend() -> None:
    w13, w2 = random_stored(2, 32, 128, "mx32", seed=1), random_stored(2, 128, 16, "mx32", seed=2)
    assert convert_to_moe_kernel_format(w13, w2, torch.device("cpu"), fp4=True) == (w13, w2, [])
    assert select_moe_backend(torch.device("cpu"), 1) == select_moe_backend(torch.device("cpu"), 8192) == MoeBackend.CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_backend_by_token_count() -> None:
    from moet.kernels import cuda

    device = torch.device("cuda", torch.cuda.current_device())
    assert select_moe_backend(device, cuda.MAX_TOKENS + 1) == MoeBackend.TRITON
    decode = MoeBackend.CUDA_DECODE if cuda.available(device.index) else MoeBackend.TRITON
    assert select_moe_backend(device, 1) == decode
