"""Where a report may be written: ``--out`` gets the guard every other command's output gets.

A report directory is usually a folder of the user's (``docs/``, ``results/``) that holds other files, so it may
hold anything - but the report replaces only files LoopQ proves it wrote (:mod:`loopq.artifacts.ownership`): those
listed by the sealed manifest :data:`REPORT_META` of an earlier report there, or by the journal of a report that was
interrupted writing there. A user's ``report.md`` (or a figure of the same name) is never overwritten, and a model
directory (teacher, student, export) or a folder inside one is refused before anything is read: a report written
into a teacher's directory would sit among its files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from loopq.artifacts.layout import check_owned, model_kind
from loopq.artifacts.ownership import is_bookkeeping, journal_files, listed_files
from loopq.artifacts.seal import FILES, manifest, seal
from loopq.commands.report.figures import figure_files
from loopq.errors import GuardError, article
from loopq.files import StagedFiles

REPORT = "report.md"
REPORT_META = "loopq_report.json"
REPORT_FORMAT = "loopq-report-v1"
#: the kind a report's write journal records
KIND = "report"


def report_files(run_names: Sequence[str]) -> list[str]:
    """Every file a report of runs named ``run_names`` may write (the manifest included)."""
    return [REPORT, REPORT_META, *figure_files(run_names)]


def check_report_dir(out: str | Path, run_names: Sequence[str], key: str = "--out") -> Path:
    """Refuse ``out`` if it is a file, a model directory or inside one, or holds a file the report would write that
    no sealed manifest or journal of an earlier report there lists; returns ``out``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GuardError(f"{key} {out}: is a file, not a directory; pass a directory to write the report into")
    for directory in (out, out.parent):
        kind = model_kind(directory)
        if kind is not None:
            where = "is" if directory == out else "lies inside"
            raise GuardError(
                f"{key} {out}: {where} {article(kind)} directory ({directory}); write the report elsewhere"
            )
    check_owned(out, report_files(run_names), owned_files(out), key)
    return out


def owned_files(out: Path) -> list[str]:
    """The files of ``out`` an earlier report there proves it wrote (its sealed manifest, or its journal)."""
    return [*listed_files(out / REPORT_META, REPORT_FORMAT), *journal_files(out, KIND)]


def remove_stale(out: Path, previous: Iterable[str], written: Iterable[str]) -> None:
    """Remove the files an earlier report wrote that this one did not (a figure of a sweep no longer reported):
    they would sit beside the new report, listed by no manifest, and block the next report that writes them."""
    for name in set(previous) - {*written, REPORT_META}:
        if not (is_bookkeeping(name) or name.endswith(".tmp")):  # the journal and its leftovers: finish() removes them
            (out / name).unlink(missing_ok=True)


def write_manifest(staged: StagedFiles) -> list[str]:
    """Stage the sealed manifest of the files staged so far (the proof that lets the next report replace them), to be
    renamed into place after them; returns their names."""
    files = {final.name: tmp for tmp, final in staged.pending}
    record = seal({"format": REPORT_FORMAT, FILES: manifest(staged.directory, files)})
    staged.write(REPORT_META, lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
    return list(files)
