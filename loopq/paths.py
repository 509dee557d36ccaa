"""Where LoopQ finds things that are not in the package: the shared data/fixtures folder and the assets.

``LOOPQ_SHARED`` overrides the shared folder; otherwise it is ``../shared`` beside the repository root.
``LOOPQ_RUNS_DIR`` moves the run directories of ``loopq.fit`` / ``loopq.run``: a relative (or unset)
``trainer.default_root_dir`` is taken under it instead of the working directory (the test suite sets it to a
temporary folder, so no test reads or writes the clone's ``runs/``).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
RUNS_DIR_ENV = "LOOPQ_RUNS_DIR"


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


def run_root(root: str | os.PathLike[str] | None) -> str | None:
    """``trainer.default_root_dir`` as a command uses it: an absolute path as given; a relative one (``runs/tiny``)
    under ``$LOOPQ_RUNS_DIR`` when that is set, else as given (relative to the working directory); None (Lightning:
    the working directory) becomes ``$LOOPQ_RUNS_DIR`` itself when set."""
    base = os.environ.get(RUNS_DIR_ENV)
    if not base:
        return None if root is None else str(root)
    if root is None:
        return str(Path(base).expanduser())
    path = Path(root).expanduser()
    return str(path if path.is_absolute() else Path(base).expanduser() / path)
