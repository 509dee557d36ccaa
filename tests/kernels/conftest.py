"""Device of the Triton-kernel tests: CPU under the interpreter (CI), CUDA when run with TRITON_INTERPRET=0 on a
GPU machine - the same tests then verify the compiled kernels. ``LOOPQ_KERNEL_DEVICE=cuda`` (set by ``python -m
loopq.gpu_check``) turns a run that cannot reach the compiled kernels on CUDA into errors instead of a CPU run."""

import os

import pytest
import torch

from tests.kernels.cases import ON_CUDA


@pytest.fixture(scope="session")
def device() -> torch.device:
    if os.environ.get("LOOPQ_KERNEL_DEVICE") == "cuda" and not ON_CUDA:
        pytest.fail(
            f"LOOPQ_KERNEL_DEVICE=cuda, but the compiled kernels cannot run here (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
        )
    return torch.device("cuda" if ON_CUDA else "cpu")
