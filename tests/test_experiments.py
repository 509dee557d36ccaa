"""Sweep orchestration of ``loopq.experiments`` with calibration and evaluation replaced by recorders."""

import json
from pathlib import Path

import pytest
import torch

from loopq.artifacts.layout import STUDENT_FORMAT, STUDENT_META, STUDENT_WEIGHTS
from loopq.artifacts.seal import seal
from loopq.commands import experiments

#: what configs/tiny.yaml's data section resolves to (test_experiments_table1 checks it on the real file)
TINY_DATA = experiments.CalibrationData(None, 256, 128)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    calls = {"calibrate": [], "evaluate": []}

    def calibrate(calibration):
        calls["calibrate"].append((calibration.run.name, calibration.a_bits, list(calibration.extra)))
        student = calibration.student
        student.mkdir(parents=True, exist_ok=True)
        (student / STUDENT_META).write_text(json.dumps(seal({"format": STUDENT_FORMAT, "calibrated_loops": 4})))
        (student / STUDENT_WEIGHTS).write_bytes(b"not read")
        return student

    def evaluate(out, **kwargs):
        calls["evaluate"].append(kwargs)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        data = {"wikitext2_ppl": 100.0, "method": kwargs.get("method"), "bits": kwargs.get("bits", "fp")}
        Path(out).write_text(json.dumps(data))

    monkeypatch.setattr(experiments, "calibrate", calibrate)
    monkeypatch.setattr(experiments, "evaluate", evaluate)
    fake_inputs(monkeypatch)
    return calls


def fake_inputs(monkeypatch):
    """What made a row's model, without parsing loopq.fit's CLI or hashing a teacher: the options and the name."""
    monkeypatch.setattr(experiments, "calibration_settings", lambda calibration: {"args": calibration.args()})
    monkeypatch.setattr(experiments, "calibration_data", lambda model, config, extra: TINY_DATA)
    monkeypatch.setattr(experiments, "teacher_sha256", lambda model: f"sha256 of {model}")


def test_slt_sweep_calibrates_each_budget_and_tags_its_json(recorded, tmp_path):
    paths = experiments.slt_budget("teacher", str(tmp_path / "slt"), budgets=[0, 2, 4])
    assert [c[2] for c in recorded["calibrate"]] == [["--model.quant.slt_budget", str(b)] for b in (0, 2, 4)]
    assert [json.loads(p.read_text())["slt_budget"] for p in paths] == [0, 2, 4]
    assert all(call["tasks"] == [] and call["bits"] == "w4a4" for call in recorded["evaluate"])
    # a re-run resumes: finished rows are neither recalibrated nor re-evaluated
    experiments.slt_budget("teacher", str(tmp_path / "slt"), budgets=[0, 2, 4, 8])
    assert [c[0] for c in recorded["calibrate"]] == ["slt-0", "slt-2", "slt-4", "slt-8"]
    assert len(recorded["evaluate"]) == 4


def test_a_sweep_at_another_width_keeps_the_w4a4_rows(recorded, tmp_path):
    """One folder holds the SLT and sample-size sweeps at W4A4 and W4A8 side by side: the W4A8 rows are their own
    rows (``slt-0-w4a8``), they neither overwrite nor recalibrate the W4A4 ones (a review found ``slt-0`` shared)."""
    out = str(tmp_path / "slt")
    w4a4 = experiments.slt_budget("teacher", out, budgets=[0])
    w4a8 = experiments.slt_budget("teacher", out, budgets=[0], bits="w4a8")
    assert [p.name for p in w4a4 + w4a8] == ["slt-0.json", "slt-0-w4a8.json"]
    assert [c[0] for c in recorded["calibrate"]] == ["slt-0", "slt-0-w4a8"]
    experiments.slt_budget("teacher", out, budgets=[0])  # still done
    experiments.num_samples("teacher", out, sizes=[32])
    experiments.num_samples("teacher", out, sizes=[32], bits="w4a8")
    assert [c[0] for c in recorded["calibrate"]] == ["slt-0", "slt-0-w4a8", "samples-32", "samples-32-w4a8"]
    assert {p.name for p in Path(out).glob("*.json")} >= {"slt-0.json", "slt-0-w4a8.json", "samples-32-w4a8.json"}


def test_num_samples_sweep_sets_the_data_size(recorded, tmp_path):
    paths = experiments.num_samples("teacher", str(tmp_path / "n"), sizes=[32, 1024], bits="w4a8")
    assert [c[1:] for c in recorded["calibrate"]] == [
        (8, ["--data.num_samples", "32"]),
        (8, ["--data.num_samples", "1024"]),
    ]
    assert [json.loads(p.read_text())["num_samples"] for p in paths] == [32, 1024]


def test_loop_sweep_evaluates_fp_rtn_and_student_once_at_2t(recorded, tmp_path, monkeypatch):
    student = tmp_path / "student"
    student.mkdir()
    (student / STUDENT_META).write_text(json.dumps(seal({"format": STUDENT_FORMAT, "calibrated_loops": 3})))
    (student / STUDENT_WEIGHTS).write_bytes(b"not read: evaluate is replaced below")

    def evaluate(out, **kwargs):
        recorded["evaluate"].append(kwargs)
        per_loop = [100.0 * 0.9**i for i in range(kwargs["num_loops"])]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(
            json.dumps(
                {
                    "wikitext2_ppl": per_loop[-1],
                    "wikitext2_per_loop_ppl": per_loop,
                    "num_loops": kwargs["num_loops"],
                    "method": kwargs["method"],
                }
            )
        )

    monkeypatch.setattr(experiments, "evaluate", evaluate)
    paths = experiments.loops("teacher", str(tmp_path / "loops"), student=str(student))
    assert [(c["method"], c["num_loops"]) for c in recorded["evaluate"]] == [("FP", 6), ("Symmetric", 6), ("LoopQ", 6)]
    assert len(paths) == 12 and not recorded["calibrate"]
    by_name = {p.name: json.loads(p.read_text()) for p in paths}
    for n in range(3, 7):
        row = by_name[f"rtn-w4a4-loops{n}.json"]
        assert row["num_loops"] == n and row["wikitext2_ppl"] == pytest.approx(100.0 * 0.9 ** (n - 1))
        assert len(row["wikitext2_per_loop_ppl"]) == n
    # with lm-eval tasks every loop count is its own evaluation
    recorded["evaluate"].clear()
    experiments.loops("teacher", str(tmp_path / "tasks"), student=str(student), tasks=["lambada_openai"])
    assert [c["num_loops"] for c in recorded["evaluate"]] == [3, 4, 5, 6] * 3
    # a baseline's student sweeps under its own name, beside the shared FP and RTN rows (kept, not re-run)
    recorded["evaluate"].clear()
    paths = experiments.loops("teacher", str(tmp_path / "loops"), student=str(student), method="FlatQuant", seed=2)
    assert [c["method"] for c in recorded["evaluate"]] == ["FlatQuant"]
    row = json.loads((tmp_path / "loops" / "flatquant-w4a4-s2-loops4.json").read_text())
    assert (row["method"], row["seed"], row["loop_sweep"]) == ("FlatQuant", 2, 6)
    with pytest.raises(experiments.UsageError, match="--method Symmetric"):
        experiments.loops("teacher", str(tmp_path / "loops"), student=str(student), method="Symmetric")


def test_seeds_calibrate_every_trained_row_per_seed_and_training_free_rows_once(recorded, tmp_path):
    out = tmp_path / "t1"
    extra = ["--trainer.max_steps", "5"]
    experiments.table1("teacher", str(out), seeds=[0, 1], bits=["w4a4"], extra=extra)
    runs = {c[0]: c[2] for c in recorded["calibrate"]}
    assert sorted(runs) == [f"{m}-w4a4-s{s}" for m in ("flatquant", "loopq", "spinquant") for s in (0, 1)]
    assert runs["loopq-w4a4-s1"] == [*experiments.seed_args(1), "--trainer.max_steps", "5"]
    assert experiments.seed_args(1) == ["--seed_everything", "1", "--model.quant.seed", "1", "--data.seed", "1"]
    assert json.loads((out / "loopq-w4a4-s1.json").read_text())["seed"] == 1
    assert (out / "rtn-w4a4.json").is_file() and not (out / "rtn-w4a4-s0.json").exists()
    experiments.table1("teacher", str(out), seeds=[0, 1, 2], bits=["w4a4"], methods=["LoopQ"], extra=extra)  # resumes
    assert [c[0] for c in recorded["calibrate"][6:]] == ["loopq-w4a4-s2"]


def test_summary_reports_mean_std_recovery_and_separation(tmp_path):
    rows = [("FP", "fp", 100.0), ("Symmetric", "w4a4", 400.0)]
    rows += [("LoopQ", "w4a4", v) for v in (199.0, 200.0, 201.0)]
    rows += [("QuaRot", "w4a4", v) for v in (240.0, 241.0, 239.0)]  # far away: separated
    rows += [("SpinQuant", "w4a4", v) for v in (201.0, 203.0, 199.0)]  # within the spread
    for i, (method, bits, ppl) in enumerate(rows):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"method": method, "bits": bits, "wikitext2_ppl": ppl}))
    (tmp_path / "sweep.json").write_text(json.dumps({"method": "LoopQ", "bits": "w4a4", "wikitext2_ppl": 1.0,
                                                     "slt_budget": 0}))  # fmt: skip
    text = experiments.summary(str(tmp_path))
    table = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 3 | 200.00 ± 1.00 | 0.50 |" in table["LoopQ"]  # R = ln(400/200) / ln(400/100)
    assert table["QuaRot"].endswith("+40.00 ** |") and table["SpinQuant"].endswith("+1.00 |")
    assert (tmp_path / "summary.md").read_text() == text


def test_summary_counts_a_seeded_twin_of_the_default_run_once(tmp_path):
    """``loopq-w4a4`` (the config's seed, 0) and ``loopq-w4a4-s0`` are one calibration: n = 3 over seeds 0, 1, 2,
    not 4 with seed 0 twice (which biases the mean and shrinks the std)."""
    rows = {"fp": ("FP", None, 100.0), "loopq-w4a4": ("LoopQ", 0, 210.0), "loopq-w4a4-s0": ("LoopQ", 0, 210.0)}
    rows |= {"loopq-w4a4-s1": ("LoopQ", 1, 200.0), "loopq-w4a4-s2": ("LoopQ", 2, 190.0)}
    for name, (method, seed, ppl) in rows.items():
        data = {"method": method, "bits": "fp" if seed is None else "w4a4", "wikitext2_ppl": ppl}
        if seed is not None:
            data["provenance"] = {"config": {"seed_everything": seed}}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    table = {line.split(" | ")[0].strip("| "): line for line in experiments.summary(str(tmp_path)).splitlines()}
    assert "| 3 | 200.00 ± 10.00 |" in table["LoopQ"]


def test_ablations_evaluate_on_the_requested_windows(recorded, tmp_path):
    """``--ppl_windows`` used to be accepted and dropped here: a small-ouro ablation row was evaluated on all 1771
    windows and compared with table rows on 256."""
    paths = experiments.ablations("teacher", str(tmp_path), seeds=[0], tasks=[], ppl_windows=256)
    assert [p.name for p in paths] == ["loopq-wo-las-s0.json", "loopq-wo-slt-s0.json", "loopq-wo-cta-s0.json"]
    assert [c["ppl_windows"] for c in recorded["evaluate"]] == [256, 256, 256]
    assert [c["method"] for c in recorded["evaluate"]] == list(experiments.ABLATIONS)


def test_slt_sweep_records_the_promoted_groups_and_their_sharing_gap(recorded, tmp_path, monkeypatch):
    """Fig. 4 asks which groups a budget promotes: each sweep JSON carries them (from the student) with the
    re-selection rounds' S_l (from the run's last checkpoint), and ``summary`` tabulates them over seeds."""

    def calibrate(calibration):
        run_dir, extra = calibration.run, calibration.extra
        seed = int(extra[extra.index("--seed_everything") + 1])
        promoted = ["model.layers.5.mlp.down_proj"] + (["model.layers.2.mlp.down_proj"] if seed == 0 else [])
        student = run_dir / "student"
        student.mkdir(parents=True)
        meta = {"format": STUDENT_FORMAT, "calibrated_loops": 4, "promoted": promoted}
        (student / STUDENT_META).write_text(json.dumps(seal(meta)))
        (student / STUDENT_WEIGHTS).write_bytes(b"not read")
        scores = {"model.layers.5.mlp.down_proj": 1400.0 + seed, "model.layers.2.mlp.down_proj": 1000.0}
        scores |= {f"model.layers.{i}.self_attn.o_proj": 300.0 for i in range(3)}
        history = [{"step": 0, "selected": promoted, "scores": scores}]
        (run_dir / "checkpoints").mkdir()
        torch.save({"callbacks": {"SharingGapReselection{'every': 40}": {"history": history}}},
                   run_dir / "checkpoints" / "last.ckpt")  # fmt: skip
        return student

    monkeypatch.setattr(experiments, "calibrate", calibrate)
    out = tmp_path / "slt"
    paths = experiments.slt_budget("teacher", str(out), budgets=[2], seeds=[0, 1], ppl_windows=64)
    first = json.loads(paths[0].read_text())
    assert first["promoted"] == ["model.layers.5.mlp.down_proj", "model.layers.2.mlp.down_proj"]
    assert first["slt_rounds"] == [
        {
            "step": 0,
            "selected": {"model.layers.5.mlp.down_proj": 1400.0, "model.layers.2.mlp.down_proj": 1000.0},
            "median_S": 300.0,  # median of 1400, 1000, 300, 300, 300
        }
    ]
    assert [c["ppl_windows"] for c in recorded["evaluate"]] == [64, 64]
    text = experiments.summary(str(out))
    row = next(line for line in text.splitlines() if line.startswith("| 2 | w4a4 |"))
    assert "5.mlp.down_proj (2/2, S 1400 vs 300); 2.mlp.down_proj (1/2, S 1000 vs 300)" in row


def test_loop_sweep_per_seed_rows_stay_out_of_table1(recorded, tmp_path, monkeypatch):
    """The loop sweep's FP row at 2T used to be read by ``summary`` as the FP row of Table 1 when both share a
    folder; now every loop-sweep JSON is tagged and tabulated on its own, one LoopQ row per seed."""
    student = tmp_path / "student"
    student.mkdir()
    (student / STUDENT_META).write_text(json.dumps(seal({"format": STUDENT_FORMAT, "calibrated_loops": 2})))
    (student / STUDENT_WEIGHTS).write_bytes(b"not read: evaluate is replaced below")

    def evaluate(out, **kwargs):
        recorded["evaluate"].append(kwargs)
        base = {"FP": 50.0, "Symmetric": 60.0, "LoopQ": 55.0}[kwargs["method"]]
        per_loop = [base + i for i in range(kwargs["num_loops"])]
        data = {"wikitext2_ppl": per_loop[-1], "wikitext2_per_loop_ppl": per_loop, "num_loops": kwargs["num_loops"]}
        data |= {"method": kwargs["method"], "bits": kwargs.get("bits", "fp")}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(data))

    monkeypatch.setattr(experiments, "evaluate", evaluate)
    out = tmp_path / "t"
    out.mkdir()
    (out / "fp.json").write_text(json.dumps({"method": "FP", "bits": "fp", "wikitext2_ppl": 50.0, "num_loops": 2}))
    experiments.loops("teacher", str(out), student=str(student), seed=0, ppl_windows=32)
    experiments.loops("teacher", str(out), student=str(student), seed=1, ppl_windows=32)
    # FP and RTN are shared by the seeds: evaluated once; the student once per seed
    assert [c["method"] for c in recorded["evaluate"]] == ["FP", "Symmetric", "LoopQ", "LoopQ"]
    assert {c["ppl_windows"] for c in recorded["evaluate"]} == {32}
    assert json.loads((out / "loopq-w4a4-s1-loops3.json").read_text())["seed"] == 1
    text = experiments.summary(str(out))
    table1 = [line for line in text.splitlines() if line.startswith("| FP | fp |")]
    assert table1 == ["| FP | fp | 1 | 50.00 |  |  |"]  # the 2T FP row (53.00) is not mixed in
    assert "| 4 | 53.00 | 58.00 ± 0.00 | 63.00 |" in text  # loops | FP fp | LoopQ w4a4 | Symmetric w4a4


REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p.parent.relative_to(REPO) for p in (REPO / "results").glob("**/summary.md"))


@pytest.mark.parametrize("results_dir", COMMITTED, ids=str)
def test_committed_summary_is_what_its_result_jsons_give(results_dir, tmp_path, monkeypatch, capsys):
    """docs/results.md quotes the committed ``summary.md`` tables; a result JSON added or re-run without
    regenerating the summary would leave the docs quoting numbers no row holds."""
    copy = tmp_path / results_dir
    copy.mkdir(parents=True)
    for path in (REPO / results_dir).glob("*.json"):
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.chdir(tmp_path)  # the summary's header names its directory, relative as when it was written
    text = experiments.summary(str(results_dir))
    capsys.readouterr()
    fix = f"regenerate it: python -m loopq.experiments summary --out {results_dir}"
    assert text == (REPO / results_dir / "summary.md").read_text(), fix


def test_extra_fit_options_read_as_yaml_reach_the_calibration_as_words():
    """``--extra '[--trainer.max_steps, 100]'`` (the help's own example): YAML reads 100 and true as a number and a
    boolean; the calibration's loopq.fit arguments get them back as the words typed."""
    from loopq.commands.cli import prepare_argv

    parser = experiments.build_parser()
    argv = [
        "table1",
        "--model",
        "m",
        "--out",
        "o",
        "--extra",
        "[--trainer.max_steps, 100, --model.cta, true, --x, 0.5]",
    ]
    config = parser.parse_args(prepare_argv(argv, parser, {}))
    extra = config.table1.extra
    assert extra == ["--trainer.max_steps", 100, "--model.cta", True, "--x", 0.5]
    args = experiments.Calibration("m", Path("r"), "c.yaml", 4, tuple(extra)).args()
    assert args[-6:] == ["--trainer.max_steps", "100", "--model.cta", "True", "--x", "0.5"]


@pytest.mark.parametrize(
    ("sweep", "option", "message"),
    [
        ("slt_budget", {"bits": "W4A4"}, None),  # normalised: the default row, slt-0
        ("slt_budget", {"bits": "w8a8"}, r"^--bits w8a8: not a bit width the experiments run; use one of w4a4, w4a8$"),
        ("num_samples", {"bits": "w8a8"}, r"^--bits w8a8: not a bit width the experiments run"),
        ("slt_budget", {"budgets": []}, r"^--budgets is empty; name at least one, or leave --budgets out"),
        ("num_samples", {"sizes": []}, r"^--sizes is empty; name at least one, or leave --sizes out"),
    ],
)
def test_sweep_options_are_checked_before_any_row_runs(recorded, tmp_path, sweep, option, message):
    """``--bits W4A4`` / ``w8a8`` failed with a KeyError, an explicit empty list read as every default value."""
    out = tmp_path / "sweep"
    values = {"budgets": [0]} if sweep == "slt_budget" else {"sizes": [32]}
    if message is None:
        paths = getattr(experiments, sweep)("teacher", str(out), **{**values, **option})
        assert [p.name for p in paths] == ["slt-0.json"] and recorded["calibrate"][0][1] == 4
        return
    with pytest.raises(experiments.UsageError, match=message):
        getattr(experiments, sweep)("teacher", str(out), **{**values, **option})
    assert recorded == {"calibrate": [], "evaluate": []} and not out.exists()


def fake_student(directory, calibrated_loops):
    directory.mkdir()
    meta = {"format": STUDENT_FORMAT, "calibrated_loops": calibrated_loops}
    (directory / STUDENT_META).write_text(json.dumps(seal(meta)))
    (directory / STUDENT_WEIGHTS).write_bytes(b"not read")
    return str(directory)


@pytest.mark.parametrize("max_loops", [0, 2, 3])
def test_loop_sweep_max_loops_below_the_calibrated_count_is_refused(recorded, tmp_path, max_loops):
    """``--max_loops 0`` became 2T (``max_loops or 2T``) and ``2`` below T = 4 gave one 2-loop row, no sweep."""
    student = fake_student(tmp_path / "student", 4)
    with pytest.raises(experiments.UsageError, match=rf"^--max_loops {max_loops}: below the student's calibrated 4 "):
        experiments.loops("teacher", str(tmp_path / "loops"), student=student, max_loops=max_loops)
    assert not recorded["evaluate"] and not (tmp_path / "loops").exists()


def test_loop_sweep_at_the_calibrated_count_is_one_row_per_method(recorded, tmp_path):
    student = fake_student(tmp_path / "student", 4)
    paths = experiments.loops("teacher", str(tmp_path / "loops"), student=student, max_loops=4, tasks=["t"])
    assert [p.name for p in paths] == ["fp-loops4.json", "rtn-w4a4-loops4.json", "loopq-w4a4-loops4.json"]
    assert [c["num_loops"] for c in recorded["evaluate"]] == [4, 4, 4]


def write_result(path, ppl, seed, **fields):
    data = {"method": "LoopQ", "bits": "w4a4", "wikitext2_ppl": ppl, **fields}
    path.write_text(json.dumps(data | {"provenance": {"config": {"seed_everything": seed}}}))


def test_summary_counts_a_seeded_twin_once_in_the_slt_and_loop_sweeps(tmp_path):
    """Both sweep tables counted ``slt-0`` (seed 0) and ``slt-0-s0`` twice: n = 3, 31.33 ± 2.31 over 30, 30, 34;
    one calibration per seed gives n = 2, 32.00 ± 2.83 (the std of 30 and 34)."""
    for name, ppl, seed in (("slt-0", 30.0, 0), ("slt-0-s0", 30.0, 0), ("slt-0-s1", 34.0, 1)):
        write_result(tmp_path / f"{name}.json", ppl, seed, slt_budget=0)
    for name, ppl, seed in (("loopq-w4a4", 30.0, 0), ("loopq-w4a4-s0", 30.0, 0), ("loopq-w4a4-s1", 34.0, 1)):
        write_result(tmp_path / f"{name}-loops4.json", ppl, seed, loop_sweep=8, num_loops=4)
        write_result(tmp_path / f"{name}-loops5.json", ppl + 1, seed, loop_sweep=8, num_loops=5)
    text = experiments.summary(str(tmp_path))
    assert "| 0 | w4a4 | 2 | 32.00 ± 2.83 |" in text
    assert "| 4 | 32.00 ± 2.83 |" in text and "| 5 | 33.00 ± 2.83 |" in text
