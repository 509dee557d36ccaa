"""Where LoopQ finds things that are not in the package: the shared data/fixtures folder and the assets.

``LOOPQ_SHARED`` overrides the shared folder; otherwise it is ``../shared`` beside the repository root.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"


def shared_dir() -> Path:
    """The folder holding ``data/``, ``fixtures/`` and ``paper/`` (env ``LOOPQ_SHARED`` or ``../shared``)."""
    env = os.environ.get("LOOPQ_SHARED")
    return Path(env).expanduser().resolve() if env else (REPO_ROOT.parent / "shared").resolve()


def data_dir() -> Path:
    """Benchmark and calibration data (env ``LOOPQ_DATA`` or ``<shared>/data``)."""
    env = os.environ.get("LOOPQ_DATA")
    return Path(env).expanduser().resolve() if env else shared_dir() / "data"


def fixtures_dir() -> Path:
    return shared_dir() / "fixtures"
