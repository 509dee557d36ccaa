"""The README and docs/ name code by path; a move (issue 30 moved most of the package) must not leave them pointing
at files that are gone."""

import re

from loopq.paths import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
#: a backticked repository path, e.g. `loopq/calib/mu.py` or `tests/calib/test_fit.py::test_resume`
PATH = re.compile(r"`((?:loopq|callbacks|configs|scripts|bench|tests|launch|docs)/[\w./-]+)(?:::\w+)?`")
#: written by a documented command, not tracked (.gitignore)
GENERATED = {"loopq/assets/small-ouro-stress", "loopq/assets/small-ouro-sensitive-rot"}


def named_paths(text: str) -> set[str]:
    return {m.rstrip("/.") for m in PATH.findall(text) if not any(c in m for c in "*<>{}")}


def test_the_path_pattern_on_a_hand_case():
    text = "see `loopq/calib/mu.py`, `tests/a/test_b.py::test_c`, `configs/*.yaml`, `runs/x` and `loopq/`."
    assert named_paths(text) == {"loopq/calib/mu.py", "tests/a/test_b.py"}


def test_every_path_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(REPO_ROOT)}: {path}"
        for doc in DOCS
        for path in sorted(named_paths(doc.read_text()) - GENERATED)
        if not (REPO_ROOT / path).exists()
    ]
    assert not missing, "docs name paths that do not exist (moved? update the docs):\n" + "\n".join(missing)


def test_the_readme_starts_short_with_the_two_commands():
    """Issue 40: the README answers what, the two commands and how long they take on its first screen, and stays
    short (details live in docs/, whose paths the test above keeps existing)."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120
    commands = [line for line in lines[:10] if line.startswith("python3 -m venv")]
    main, tests = [c.rsplit("&& ", 1)[1] for c in commands]
    assert main == "OMP_NUM_THREADS=1 python -m loopq.run --config configs/tiny.yaml"
    assert tests.startswith("python -m pytest")
    assert "minutes" in "\n".join(lines[:20])
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci and ci[-1] == tests  # CI ends with the README's test command, as written there
    assert any(line.startswith(main) for line in ci)  # after the README's first command (shortened)
