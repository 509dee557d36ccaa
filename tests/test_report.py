"""``python -m loopq.report`` on synthetic result JSONs and a fake calibration run (no model is run)."""

from __future__ import annotations

import json
import math
import runpy
import sys
import warnings
from pathlib import Path

import matplotlib.image
import pytest

from loopq.commands.report.figures import slt_matrix
from loopq.commands.report.inputs import ReportInputError, load_result, load_run, read_loop_errors
from loopq.commands.report.output import report_files
from loopq.commands.report.write_report import main
from loopq.errors import GuardError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def result(method, bits, loops, ppl, metrics=None, model="models/tiny-ouro", per_loop=None, **extra):
    data = {
        "method": method,
        "bits": bits,
        "model": model,
        "num_loops": loops,
        "wikitext2_ppl": ppl,
        "wikitext2_per_loop_ppl": per_loop or [],
        "wikitext2_windows": 12,
    }
    if metrics is not None:
        sizes = {"loopq_hellaswag": 100, "loopq_winogrande": 100}
        data["lm_eval"] = {"paper_metrics": metrics, "limit": 100, "n_samples": sizes}
    return {**data, **extra}


def metrics(hs, wg, lb, ac, mm, wt2, op):
    found = {"HS": hs, "WG": wg, "LB": lb, "AC": ac, "MM": mm, "WT2": wt2, "OP": op}
    return {k: v for k, v in found.items() if v is not None}


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture
def results(tmp_path) -> list[Path]:
    """Two models; tiny-ouro has FP, RTN and LoopQ at both bit widths plus a LoopQ loop sweep."""
    d = tmp_path / "results"
    return [
        write(d / "fp.json", result("FP", "fp", 4, 15.0, metrics(0.5, 0.6, 0.4, 0.3, 0.25, 20.0, 10.0))),
        write(d / "rtn44.json", result("RTN", "w4a4", 4, 60.0, metrics(0.3, 0.52, 0.1, 0.22, 0.24, 80.0, 90.0))),
        write(
            d / "loopq44.json",
            result(
                "LoopQ",
                "w4a4",
                4,
                18.25,
                metrics(0.45, 0.5, 0.35, 0.28, 0.24, 25.0, 12.5),
                per_loop=[40.0, 30.0, 20.0, 18.25],
            ),
        ),
        write(d / "rtn48.json", result("RTN", "w4a8", 4, 30.0, metrics(0.4, 0.55, 0.2, 0.25, 0.26, 40.0, 30.0))),
        write(d / "loopq48.json", result("LoopQ", "w4a8", 4, 16.0, metrics(0.48, 0.58, 0.38, 0.29, None, 22.0, 11.0))),
        write(d / "loopq44_T2.json", result("LoopQ", "w4a4", 2, 25.0)),
        write(d / "loopq44_T6.json", result("LoopQ", "w4a4", 6, 21.0)),
        write(d / "other_fp.json", result("FP", "fp", 2, 9.0, {"HS": 0.5}, model="x/y", variant="other-model")),
        write(d / "other_lq.json", result("LoopQ", "w4a4", 2, 12.0, {"HS": 0.4}, model="x/y", variant="other-model")),
    ]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A resumed calibration run: two CSV/diagnostics versions, two promoted groups, 3 shared layers x 4 loops."""
    run = tmp_path / "runs" / "tiny"
    meta = {
        "format": "loopq-student-v1",
        "teacher": "/somewhere/tiny-ouro",
        "arch": "ouro",
        "quant": {"w_bits": 4, "a_bits": 4},
        "promoted": ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.qkv_proj"],
        "calibrated_loops": 4,
        "mu": [0.9, 0.6, 0.3, 0.0],
    }
    write(run / "student" / "loopq_quant.json", meta)
    header = "step,train/kl,mu/t0,mu/t1,mu/t2,mu/t3,slt/num_selected\n"
    write(run / "csv" / "version_0" / "metrics.csv", header + "".join(f"{s},0.1,0.9,0.5,0.2,0.0,\n" for s in range(4)))
    write(run / "csv" / "version_1" / "metrics.csv", header + "2,0.1,,,,,1\n2,,0.8,0.6,0.3,0.0,\n3,,0.8,0.7,0.3,0.0,\n")
    errors = [[0.1 * (t + 1) + 0.01 * layer for layer in range(3)] for t in range(4)]
    write(run / "lightning_logs" / "version_0" / "loop_errors.jsonl", json.dumps({"step": 1, "errors": errors}) + "\n")
    lines = [json.dumps({"step": 1, "errors": errors}), json.dumps({"step": 9, "errors": errors}), '{"step": 1']
    write(run / "lightning_logs" / "version_1" / "loop_errors.jsonl", "\n".join(lines) + "\n")
    return run


def table_lines(md: str, heading: str) -> list[str]:
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def test_table1_rows_columns_and_bolding(results, tmp_path, capsys):
    report = main(["--results", *map(str, results), "--out", str(tmp_path / "report")])
    assert capsys.readouterr().out == f"report written to {report}\n"
    rows = table_lines(report.read_text(), "Table 1")
    cols = ["HS", "WG", "LB", "AC", "MM", "WT2", "OP", "WT2-PTQ"]
    header = ["Model", "Method"] + [f"{b} {c}" for b in ("W4A4", "W4A8") for c in cols]
    assert rows[0] == "| " + " | ".join(header) + " |"
    fp = "*50.0* | *60.0* | *40.0* | *30.0* | *25.0* | *20.00* | *10.00* | *15.00*"
    other_fp = "*50.0* | – | – | – | – | – | – | *9.00*"
    assert rows[2:] == [
        # FP in both blocks, italic, never bold
        f"| tiny-ouro (T=4) | *FP* | {fp} | {fp} |",
        # WG 52 > 50 and the MM tie 24 = 24 bold for both; W4A8 MM: only RTN has it -> not bold
        "|  | RTN | 30.0 | **52.0** | 10.0 | 22.0 | **24.0** | 80.00 | 90.00 | 60.00 "
        "| 40.0 | 55.0 | 20.0 | 25.0 | 26.0 | 40.00 | 30.00 | 30.00 |",
        # perplexities: lower is better
        "|  | LoopQ | **45.0** | 50.0 | **35.0** | **28.0** | **24.0** | **25.00** | **12.50** | **18.25** "
        "| **48.0** | **58.0** | **38.0** | **29.0** | – | **22.00** | **11.00** | **16.00** |",
        # a single quantized method: nothing to compare, nothing bold
        f"| other-model (T=2) | *FP* | {other_fp} | {other_fp} |",
        "|  | LoopQ | 40.0 | – | – | – | – | – | – | 12.00 | – | – | – | – | – | – | – | – |",
    ]


def test_per_loop_and_subset_tables(results, tmp_path):
    md = main(["--results", *map(str, results), "--out", str(tmp_path / "report")]).read_text()
    per_loop = table_lines(md, "WikiText-2 perplexity per loop")
    assert per_loop[0] == "| Model | Method | Bits | t=1 | t=2 | t=3 | t=4 |"
    assert "| tiny-ouro | LoopQ | w4a4 | 40.00 | 30.00 | 20.00 | 18.25 |" in per_loop
    subsets = table_lines(md, "Evaluation subsets")
    assert "| `fp.json` | tiny-ouro | FP | fp | 4 | 100 | hellaswag 100, winogrande 100 | 12 |" in subsets
    assert "| `loopq44_T2.json` | tiny-ouro | LoopQ | w4a4 | 2 | not run | – | 12 |" in subsets


def test_figures_and_empty_sweep_notes(results, run_dir, tmp_path):
    out = tmp_path / "report"
    md = main(["--results", *map(str, results), "--runs", str(run_dir), "--out", str(out)]).read_text()
    for name in ("fig2_loop_errors_tiny.png", "fig3_slt_selection_tiny.png", "fig5_ppl_vs_loops.png", "mu_tiny.png"):
        assert_png(out / name)
        assert f"]({name})" in md
    assert not (out / "fig4_ppl_vs_slt_budget.png").exists()
    assert "Fig. 4 skipped: no sweep results" in md and "Fig. 6 skipped: no sweep results" in md
    assert (
        "| `tiny` | tiny-ouro | ouro | 4 | 1. `model.layers.1.mlp.down_proj`, 2. `model.layers.0.self_attn.qkv_proj`"
        in md
    )


def test_sweep_figures(results, tmp_path):
    sweeps = [
        write(tmp_path / "sweeps" / f"slt{b}.json", result("LoopQ", "w4a4", 4, 20.0 - b, slt_budget=b, num_samples=64))
        for b in (0, 2, 4)
    ]
    out = tmp_path / "report"
    md = main(["--results", *map(str, results), "--sweeps", *map(str, sweeps), "--out", str(out)]).read_text()
    assert_png(out / "fig4_ppl_vs_slt_budget.png")
    # every budget point has the same num_samples: no calibration-size sweep
    assert not (out / "fig6_ppl_vs_num_samples.png").exists()
    assert "Fig. 6 skipped" in md and "Fig. 4 skipped" not in md
    # an unmatched glob (as a shell leaves it) is no sweep, not an error
    md = main(["--results", *map(str, results), "--sweeps", str(tmp_path / "none" / "*.json"), "--out", str(out)])
    assert "Fig. 4 skipped" in md.read_text()


def test_run_reading(run_dir):
    run = load_run(run_dir, "tiny")
    assert run.errors_step == 9  # last complete line of the newest version; the torn line is skipped
    assert run.mu_steps == [0, 1, 2, 3]  # version_1 replaces the steps it logged again
    assert run.mu[1] == [0.9, 0.5, 0.2, 0.0] and run.mu[3] == [0.8, 0.7, 0.3, 0.0]
    matrix, kinds, unplaced = slt_matrix(run)
    assert kinds == ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate", "mlp.down_proj"] and not unplaced
    assert matrix.shape == (3, 4) and matrix[1, 3] == 1 and matrix[0, 0] == 2
    assert sum(math.isfinite(v) for v in matrix.flat) == 2


def test_a_student_outside_the_run_directory_is_read_where_it_is(run_dir, tmp_path):
    """``--model.output_dir``: the student is not ``<run>/student``; the loader is given its directory (a review found
    the calibration called unfinished and Fig. 3 dropped)."""
    elsewhere = tmp_path / "students" / "tiny"
    elsewhere.parent.mkdir()
    (run_dir / "student").rename(elsewhere)
    run = load_run(run_dir, "tiny", elsewhere)
    assert run.promoted == ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.qkv_proj"]
    assert not any("calibration unfinished" in note for note in run.notes)
    missing = load_run(run_dir, "tiny")
    assert "run `tiny`: no `student/loopq_quant.json` (calibration unfinished?)" in missing.notes


def test_student_result_is_grouped_under_its_teacher(run_dir, tmp_path):
    path = write(tmp_path / "lq.json", result("LoopQ", "w4a8", 4, 20.0, model=str(run_dir / "student")))
    r = load_result(path)
    assert (r.model, r.bits, r.calibrated_loops) == ("tiny-ouro", "w4a4", 4)  # bits from the student's config


@pytest.mark.parametrize(
    ("content", "reason"),
    [('{"method": "FP", ', "not valid JSON"), ('{"bits": "w4a4"}', 'no "method" field'), ("[1, 2]", "no")],
)
def test_bad_results_file_is_named(results, tmp_path, content, reason):
    bad = write(tmp_path / "broken" / "bad-result.json", content)
    with pytest.raises(ReportInputError, match=rf"bad-result\.json: .*{reason}"):
        main(["--results", *map(str, results), str(bad), "--out", str(tmp_path / "report")])


def test_missing_run_dir_is_named(results, tmp_path):
    with pytest.raises(ReportInputError, match="no-such-run"):
        main(["--results", *map(str, results), "--runs", str(tmp_path / "no-such-run"), "--out", str(tmp_path)])


def test_cli_prints_one_line_error(tmp_path, monkeypatch, capsys):
    bad = write(tmp_path / "bad.json", "not json")
    monkeypatch.setattr(sys, "argv", ["loopq.report", "--results", str(bad), "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as exc, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported
        runpy.run_module("loopq.report", run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: not valid JSON")


def test_read_loop_errors_rejects_ragged_matrix(tmp_path):
    path = write(tmp_path / "loop_errors.jsonl", json.dumps({"step": 1, "errors": [[0.1, 0.2], [0.1]]}) + "\n")
    with pytest.raises(ReportInputError, match=r"loop_errors\.jsonl: .errors. is not"):
        read_loop_errors(path)


def test_notes_for_results_left_out_of_table1(results, run_dir, tmp_path):
    extra = [
        write(tmp_path / "w3a3.json", result("RTN", "w3a3", 4, 500.0)),
        write(tmp_path / "rtn_T8.json", result("QuaRot", "w4a4", 8, 50.0)),
        write(tmp_path / "student.json", result("LoopQ", "w4a8", 4, 20.0, model=str(run_dir / "student"))),
    ]
    md = main(["--results", *map(str, results), *map(str, extra), "--out", str(tmp_path / "r")]).read_text()
    assert "results at w3a3 are not in Table 1" in md
    assert "tiny-ouro: QuaRot w4a4 is not in Table 1 (no result at T=4 loops)" in md
    assert "recorded bits 'w4a8', but its student is w4a4" in md
    assert "(same model, method, bits and loops)" in md  # student.json replaces loopq44.json
    md = main(["--results", *map(str, results), "--loops", "6", "--out", str(tmp_path / "r")]).read_text()
    w4a4, w4a8 = " | ".join(["–"] * 7 + ["21.00"]), " | ".join(["–"] * 8)
    assert table_lines(md, "Table 1")[2:] == [f"| tiny-ouro (T=6) | LoopQ | {w4a4} | {w4a8} |"]
    assert "other-model: LoopQ w4a4 is not in Table 1 (no result at T=6 loops)" in md


def test_validation_curves_table_and_figure(results, run_dir, tmp_path):
    """val/<set>/<metric> columns (loopq.calib.validation) become a table (first -> last, step of the lowest KL) and
    a figure; a resumed version replaces the validation rows it logged again."""
    cols = ["kl_full", "ppl_loop1", "ppl_loop2", "fp_ppl_loop1", "fp_ppl_loop2"]
    header = "step," + ",".join(f"val/{s}/{c}" for s in ("heldout", "extra") for c in cols) + "\n"
    rows = {9: (0.30, 0.50), 19: (0.10, 0.40), 29: (0.20, 0.30)}  # step -> (heldout KL, extra KL)
    lines = [f"{step},{h},40,31,38,30,{e},45,35,41,33\n" for step, (h, e) in rows.items()]
    write(run_dir / "csv" / "version_2" / "metrics.csv", header + "".join(lines))
    run = load_run(run_dir, "tiny")
    # the global steps of the passes (the CSV's step + 1): those of the checkpoints and of provenance.selected
    assert run.val_steps == [10, 20, 30] and run.val["val/extra/kl_full"] == [0.5, 0.4, 0.3]
    out = tmp_path / "report"
    md = main(["--results", *map(str, results), "--runs", str(run_dir), "--out", str(out)]).read_text()
    assert table_lines(md, "Held-out validation")[2:] == [
        "| `tiny` | heldout | 10-30 | 0.3000 -> 0.2000 | 20 | 31.00 -> 31.00 (30.00) |",
        "| `tiny` | extra | 10-30 | 0.5000 -> 0.3000 | 30 | 35.00 -> 35.00 (33.00) |",
    ]
    # a resumed segment that ran no validation pass (its CSV: mu columns only) keeps the earlier passes (a review
    # found the table emptied and the figure blank: the last file's columns were applied to every row)
    write(run_dir / "csv" / "version_3" / "metrics.csv", "step,mu/t0,mu/t1,mu/t2,mu/t3\n31,0.8,0.7,0.3,0.0\n")
    resumed = load_run(run_dir, "tiny")
    assert resumed.val_steps == [10, 20, 30] and resumed.val == run.val
    assert_png(out / "validation_tiny.png")
    # every file written is one the report's guard knows: a foreign file of that name elsewhere is not overwritten
    assert {p.name for p in out.iterdir()} <= set(report_files(["tiny"]))
    foreign = tmp_path / "theirs"
    write(foreign / "validation_tiny.png", "a user's own figure")
    with pytest.raises(GuardError, match=r"validation_tiny\.png"):
        main(["--results", *map(str, results), "--runs", str(run_dir), "--out", str(foreign)])
    assert (foreign / "validation_tiny.png").read_text() == "a user's own figure"


def test_a_held_out_set_without_the_columns_the_report_reads_is_a_note(results, run_dir, tmp_path):
    """A set whose KL or per-loop perplexity columns are missing is left out with a note naming them, not a KeyError
    halfway through writing the figures."""
    header = "step,val/heldout/kl,val/heldout/ppl_loop1,val/heldout/fp_ppl_loop1\n"
    write(run_dir / "csv" / "version_2" / "metrics.csv", header + "9,0.1,40,38\n19,0.1,39,38\n")
    out = tmp_path / "report"
    md = main(["--results", *map(str, results), "--runs", str(run_dir), "--out", str(out)]).read_text()
    assert "held-out set `heldout` not reported: no val/heldout/kl_full column" in md
    assert "## Held-out validation" not in md and not (out / "validation_tiny.png").exists()
