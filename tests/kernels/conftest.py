"""Device of the Triton-kernel tests: CPU under the interpreter (CI), CUDA when run with TRITON_INTERPRET=0 on a
GPU machine - the same tests then verify the compiled kernels."""

import pytest
import torch

from loopq.kernels import triton_interpreted


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not triton_interpreted() else "cpu")
