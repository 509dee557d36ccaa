"""A report that fails leaves the earlier report in ``--out`` whole: inputs are checked before anything is written,
and the figures, ``report.md`` and the manifest are staged and renamed into place together (a reviewer found the
figures replaced in place before ``report.md`` and the manifest were written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopq.artifacts.ownership import JOURNAL
from loopq.commands.report import build
from loopq.commands.report.inputs import ReportInputError
from loopq.commands.report.write_report import main
from tests.test_report import result, write


def loop_sweep(d: Path, ppl: float) -> list[str]:
    """FP and LoopQ at two loop counts (Table 1 and Fig. 5); ``ppl`` moves every LoopQ number."""
    return [
        str(write(d / "fp.json", result("FP", "fp", 4, 15.0, {"HS": 0.5}))),
        str(write(d / "lq4.json", result("LoopQ", "w4a4", 4, ppl, {"HS": 0.4}))),
        str(write(d / "lq2.json", result("LoopQ", "w4a4", 2, 2 * ppl))),
    ]


def contents(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def fail_writing_the_manifest(*args, **kwargs):
    raise OSError("No space left on device")


@pytest.mark.parametrize("failure", ["while writing", "bad input"])
def test_a_failed_report_leaves_every_file_of_the_earlier_one_byte_identical(tmp_path, monkeypatch, failure):
    out = tmp_path / "report"
    main(["--results", *loop_sweep(tmp_path / "first", 18.0), "--out", str(out)])
    before = contents(out)
    assert {"report.md", "fig5_ppl_vs_loops.png", "loopq_report.json"} <= set(before)
    second = loop_sweep(tmp_path / "second", 30.0)
    if failure == "while writing":  # after the figures and report.md were made: the last step of the report
        monkeypatch.setattr(build, "write_manifest", fail_writing_the_manifest)
        with pytest.raises(OSError, match="No space left"):
            main(["--results", *second, "--out", str(out)])
    else:  # read and checked before anything is written
        bad = write(tmp_path / "second" / "bad.json", {**result("RTN", "w4a4", 4, 60.0), "num_loops": 4.5})
        with pytest.raises(ReportInputError, match=r"bad\.json: 'num_loops' is 4\.5"):
            main(["--results", *second, str(bad), "--out", str(out)])
    after = contents(out)
    after.pop(JOURNAL, None)  # an interrupted report's journal: its rerun recognises its own files by it
    assert after == before
    monkeypatch.undo()
    main(["--results", *second, "--out", str(out)])  # the rerun replaces the earlier report
    assert "30.00" in (out / "report.md").read_text() and JOURNAL not in contents(out)
    assert not [name for name in contents(out) if name.endswith(".tmp")]
