"""The tree guard: no test may add, change or remove a file of the repository (a user's clone holds their runs,
results and docs). A pytest plugin, loaded by ``tests/conftest.py``.

Two checks over the same snapshot (every file's size and mtime, every directory, under the rootdir, build folders
left out - :data:`IGNORED`):

* after each test, against the snapshot taken before it: the test that touched the tree fails at teardown and
  names the paths (under ``pytest-xdist`` another worker's test running at the same time may be the writer; the
  message says so);
* for the whole session, in the process that started it (the xdist controller, or the only process): the snapshot
  at the end against the one taken before any test ran; a difference prints the paths and fails the run even if the
  per-test check was skipped.

Both compare metadata only (no file is read), about 5 ms for this repository. ``LOOPQ_TREE_GUARD=0`` turns both off
(a developer regenerating committed files through a test, on purpose).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

#: folders nothing of the user's lives in: caches, builds, VCS metadata, the virtual environment
IGNORED = frozenset({".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "build", "dist"})
ENV = "LOOPQ_TREE_GUARD"

Snapshot = dict[str, tuple[int, int] | None]


def ignored(name: str) -> bool:
    return name in IGNORED or name.endswith(".egg-info")


def snapshot(root: Path) -> Snapshot:
    """``relative path -> (size, mtime_ns)`` of every file (and symlink), ``-> None`` for every directory, under
    ``root``; :func:`ignored` folders are not entered."""
    found: Snapshot = {}
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):  # removed while walking: the next snapshot sees it
            continue
        for entry in entries:
            if ignored(entry.name):
                continue
            rel = os.path.relpath(entry.path, root)
            try:
                if entry.is_dir(follow_symlinks=False):
                    found[rel] = None
                    stack.append(Path(entry.path))
                else:
                    st = entry.stat(follow_symlinks=False)
                    found[rel] = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                continue
    return found


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """``added x`` / ``removed x`` / ``changed x`` lines, sorted by path."""
    lines = [f"added {p}" for p in after.keys() - before.keys()]
    lines += [f"removed {p}" for p in before.keys() - after.keys()]
    lines += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(lines, key=lambda line: line.split(" ", 1)[1])


def enabled(config: pytest.Config) -> bool:
    return os.environ.get(ENV, "1") != "0"


def describe(lines: list[str], limit: int = 20) -> str:
    shown = lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])
    return "; ".join(shown)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if enabled(config) and not hasattr(config, "workerinput"):  # the controller (or the only process)
        config.stash[SESSION_KEY] = snapshot(config.rootpath)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Compare with the snapshot of :func:`pytest_sessionstart`; a difference fails the run (exit status 1)."""
    config = session.config
    before = config.stash.get(SESSION_KEY, None)
    if before is None:
        return
    lines = differences(before, snapshot(config.rootpath))
    if lines:
        config.stash[CHANGED_KEY] = lines
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    lines = config.stash.get(CHANGED_KEY, None)
    if lines:
        terminalreporter.section("tree guard", red=True, bold=True)
        terminalreporter.write_line(f"the tests changed the repository {config.rootpath}: {describe(lines, 50)}")


SESSION_KEY = pytest.StashKey[Snapshot]()
CHANGED_KEY = pytest.StashKey[list[str]]()
LAST_KEY = pytest.StashKey[Snapshot]()


@pytest.fixture(autouse=True)
def tree_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test (at teardown) if the repository tree changed while it ran."""
    config = request.config
    if not enabled(config):
        yield
        return
    before = config.stash.get(LAST_KEY, None) or snapshot(config.rootpath)
    yield
    after = snapshot(config.rootpath)
    config.stash[LAST_KEY] = after
    lines = differences(before, after)
    if lines:
        shared = (
            " (pytest-xdist: a test on another worker may have written it)" if hasattr(config, "workerinput") else ""
        )
        pytest.fail(
            f"tree guard: the repository changed while this test ran{shared}: {describe(lines)}; write under "
            "tmp_path (run directories: $LOOPQ_RUNS_DIR, see docs/testing.md)",
            pytrace=False,
        )
