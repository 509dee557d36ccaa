"""Test-wide settings: offline hubs, Triton's CPU interpreter (must be set before anything imports triton)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from loopq import reproducible_cpu
from loopq.paths import data_dir, fixtures_dir

reproducible_cpu()  # the suite owns its process: the CPU paths the commands take (loopq/numerics.py)

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def fixtures():
    path = fixtures_dir()
    if not path.is_dir():
        pytest.fail(f"shared fixtures not found at {path}; set LOOPQ_SHARED to the shared folder")
    return path


@pytest.fixture(scope="session")
def data():
    path = data_dir()
    if not path.is_dir():
        pytest.fail(f"shared data not found at {path}; set LOOPQ_SHARED or LOOPQ_DATA")
    return path
