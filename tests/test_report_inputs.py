"""The report's inputs, as a reviewer found them mis-read: malformed result fields, undecodable run files, the
experiments manifest among the results, and an export's results named after its own directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopq.commands.report import inputs
from loopq.commands.report.inputs import ReportInputError, load_result, load_run
from loopq.commands.report.write_report import main
from tests.test_report import metrics, result, table_lines, write


def two_results(tmp_path: Path) -> list[Path]:
    d = tmp_path / "results"
    return [
        write(d / "fp.json", result("FP", "fp", 4, 15.0, metrics(0.5, 0.6, 0.4, 0.3, 0.25, 20.0, 10.0))),
        write(d / "lq.json", result("LoopQ", "w4a4", 4, 18.0, metrics(0.4, 0.5, 0.3, 0.2, 0.2, 25.0, 12.0))),
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", 5, "'model' is 5, not a string"),
        ("variant", ["a"], r"'variant' is \['a'\], not a string"),
        ("bits", 4, "'bits' is 4, not a string"),
        ("num_loops", 4.7, "'num_loops' is 4.7, not a whole number of loops"),
        ("num_loops", True, "'num_loops' is True, not a whole number of loops"),
        ("lm_eval", {"paper_metrics": {}, "n_samples": [1, 2]}, r"'lm_eval.n_samples' is \[1, 2\], not a mapping"),
    ],
)
def test_a_malformed_field_is_one_error_naming_the_file_and_key_before_anything_is_written(
    tmp_path, field, value, message
):
    """Before: ``"model": 5`` a TypeError, ``n_samples`` a list an AttributeError after the figures were written,
    ``num_loops`` 4.7 read as 4, ``bits`` 4 as "4", a list ``variant`` shown as a model name."""
    bad = write(tmp_path / "bad.json", {**result("LoopQ", "w4a4", 4, 18.0), field: value})
    with pytest.raises(ReportInputError, match=rf"^{bad}: {message}.*re-run python -m loopq\.evaluate"):
        load_result(bad)
    out = tmp_path / "report"
    with pytest.raises(ReportInputError, match=rf"^{bad}: "):
        main(["--results", *map(str, two_results(tmp_path)), str(bad), "--out", str(out)])
    assert not out.exists() or not any(out.iterdir())


def test_well_typed_fields_are_read_as_written(tmp_path):
    path = write(tmp_path / "ok.json", result("LoopQ", "W4A8", 6, 18.0, variant="mine"))
    r = load_result(path)
    assert (r.model, r.bits, r.num_loops) == ("mine", "w4a8", 6)


def run_with(tmp_path: Path, name: str, data: bytes) -> Path:
    """A calibration run whose ``name`` (under version 0) holds ``data``."""
    run = tmp_path / "run"
    sub = "csv" if name == "metrics.csv" else "lightning_logs"
    (run / sub / "version_0").mkdir(parents=True)
    (run / sub / "version_0" / name).write_bytes(data)
    return run


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("metrics.csv", b"step,mu/t0\n0,0.5\n1,caf\xe9\n", "not UTF-8 text"),
        ("metrics.csv", b'step,mu/t0\n0,"' + b"x" * 200_000 + b'"\n', "not readable CSV"),
        ("loop_errors.jsonl", b'{"step": 1, "errors": [[0.1]]}\n\xff\xfe\n', "not UTF-8 text"),
    ],
)
def test_an_undecodable_run_file_is_named(tmp_path, name, data, message):
    """Before: a UnicodeDecodeError / csv.Error that named no file."""
    run = run_with(tmp_path, name, data)
    with pytest.raises(ReportInputError, match=rf"^{run}/\w+/version_0/{name}: {message}"):
        load_run(run, "run")


def test_the_experiments_manifest_among_the_results_is_skipped_with_a_note(tmp_path):
    """``--results <experiments out>/*.json`` takes in ``pipeline.json``; before, the report refused it as a result."""
    paths = two_results(tmp_path)
    manifest = write(tmp_path / "results" / "pipeline.json", {"stages": {"fp": {"finished": 1}}})
    md = main(["--results", str(manifest), *map(str, paths), "--out", str(tmp_path / "report")]).read_text()
    assert f"- `{manifest}`: skipped, the loopq.experiments / loopq.run manifest (not a result)" in md
    assert len(table_lines(md, "Table 1")) == 4  # header, rule, FP, LoopQ
    other = write(tmp_path / "results" / "notes.json", {"stages": {}})
    with pytest.raises(ReportInputError, match=rf'^{other}: not a loopq.evaluate result \(no "method" field\)'):
        main(["--results", str(other), *map(str, paths), "--out", str(tmp_path / "report")])


def test_a_result_named_pipeline_json_is_still_read(tmp_path):
    """Only the manifest is skipped: a result that happens to be called pipeline.json is a result."""
    renamed = write(tmp_path / "pipeline.json", result("FP", "fp", 4, 15.0))
    md = main(["--results", str(renamed), "--out", str(tmp_path / "report")]).read_text()
    assert "| `pipeline.json` | tiny-ouro | FP | fp | 4 |" in md


def test_an_old_export_result_named_after_its_directory_is_grouped_under_its_teacher(tmp_path, monkeypatch):
    """Results written before the fix record ``variant`` = the export directory's own name: the report takes the
    teacher from ``loopq_export.json`` instead."""
    export = tmp_path / "exported"
    export.mkdir()
    data = result("LoopQ", "w4a4", 4, 18.0, model=str(export), variant="exported")
    path = write(tmp_path / "lq.json", data)
    exports = {str(export): {"teacher": "/models/tiny-ouro"}}  # its loopq_export.json, as read_export_meta gives it
    monkeypatch.setattr(inputs, "model_meta", lambda model: exports.get(model))
    assert load_result(path).model == "tiny-ouro"
    kept = write(tmp_path / "named.json", {**data, "variant": "my-name"})
    assert load_result(kept).model == "my-name"  # a name given with --variant is kept


def test_an_evaluated_export_is_grouped_with_its_teachers_fp_row(tmp_path):
    """``evaluate --exported DIR`` recorded ``variant`` = DIR's own name, so the report showed the export's results
    as a model called "exported" beside its teacher."""
    from loopq.commands import export
    from loopq.commands.evaluate import evaluate
    from tests.bad_inputs.test_artifact_integrity import TEACHER, write_tiny_student

    write_tiny_student(tmp_path / "student", 4, seed=0)
    export.main(["--ckpt", str(tmp_path / "student"), "--out", str(tmp_path / "exported")])
    out = tmp_path / "results" / "lq.json"
    got = evaluate(
        exported=str(tmp_path / "exported"), method="LoopQ", tasks=[], ppl_seq_len=64, ppl_windows=1, out=str(out)
    )
    assert got["variant"] == TEACHER.name == "tiny-ouro"
    fp = write(tmp_path / "results" / "fp.json", result("FP", "fp", got["num_loops"], 15.0, model=str(TEACHER)))
    md = main(["--results", str(fp), str(out), "--out", str(tmp_path / "report")]).read_text()
    rows = table_lines(md, "Table 1")[2:]
    assert [row.split(" | ")[:2] for row in rows] == [[f"| tiny-ouro (T={got['num_loops']})", "*FP*"], ["| ", "LoopQ"]]
