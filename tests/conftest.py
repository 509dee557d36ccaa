"""Test-wide settings: offline hubs, Triton's CPU interpreter (must be set before anything imports triton), and the
rules that keep the suite hermetic (docs/testing.md):

* every test runs with ``LOOPQ_RUNS_DIR`` set to a fresh temporary folder (:func:`runs_dir`), so a ``loopq.fit`` /
  ``loopq.run`` that a test starts without ``--trainer.default_root_dir`` (``configs/tiny.yaml``: ``runs/tiny``)
  writes and reads there, never in the clone's ``runs/``; subprocesses inherit it with ``os.environ``;
* the tree guard (``tests/tree_guard.py``) fails a test that added, changed or removed a file of the repository;
* the order is shuffled by a printed seed (``tests/shuffle.py``; ``--shuffle-seed N`` reproduces it).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from loopq import reproducible_cpu
from loopq.paths import RUNS_DIR_ENV, data_dir, fixtures_dir

reproducible_cpu()  # the suite owns its process: the CPU paths the commands take (loopq/numerics.py)

pytest_plugins = ("tests.tree_guard", "tests.shuffle")

#: one torch thread per test process, and for the commands the tests start, however the suite is run (``pytest -n 2``
#: on two cores: no oversubscription; a single file run alone: the same numerics as in CI). Fake quantization turns
#: the summation order of a multi-threaded matmul, which depends on the batch shape, into flipped codes: tests that
#: compare a batched pass with a direct one to 1e-5 hold at one thread (tests/calib/test_validation.py failed alone)
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


@pytest.fixture(autouse=True, scope="session")
def session_runs_dir(tmp_path_factory):
    """``LOOPQ_RUNS_DIR`` for session- and module-scoped fixtures (set up before any function-scoped fixture)."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("session-runs")
        patch.setenv(RUNS_DIR_ENV, str(path))
        yield path


@pytest.fixture(autouse=True)
def runs_dir(session_runs_dir, tmp_path_factory, monkeypatch):
    """This test's own ``LOOPQ_RUNS_DIR`` (empty): where a command it starts puts a relative run directory, e.g.
    ``runs_dir / "runs" / "tiny"`` for ``--config configs/tiny.yaml``. Not ``tmp_path`` itself, whose contents
    tests list."""
    path = tmp_path_factory.mktemp("runs")
    monkeypatch.setenv(RUNS_DIR_ENV, str(path))
    return path


def shared_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A folder every process of this pytest run sees: the run's base temp dir, or under ``pytest-xdist`` its parent
    (shared by the workers of one run, never by two runs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


@pytest.fixture(scope="session")
def tiny_calibration(request, tmp_path_factory):
    """One few-step calibration for the whole run, read-only (its files are made read-only): ``python -m loopq.fit
    --config configs/tiny.yaml --config tests/configs/fit-test.yaml`` with no ``--trainer.default_root_dir``, so
    it lands in ``$LOOPQ_RUNS_DIR/runs/tiny`` - the layout the README's first command leaves in a clone. Under
    pytest-xdist the first worker to ask calibrates, the others wait on a file lock and reuse it. Returns the run
    directory; copy it (``shutil.copytree``) to change anything."""
    from filelock import FileLock

    from tests.helpers import run_fit

    base = shared_dir(request, tmp_path_factory) / "tiny-calibration"
    run = base / "runs" / "tiny"
    with FileLock(str(base) + ".lock"):
        if not (run / "student" / "loopq_quant.json").is_file():
            base.mkdir(exist_ok=True)
            run_fit(None, env={RUNS_DIR_ENV: str(base)})
            for path in run.rglob("*"):
                if path.is_file():
                    path.chmod(0o444)
    return run
