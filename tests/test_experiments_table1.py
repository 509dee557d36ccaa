"""``loopq.experiments table1``: every Table 1 row, how each is calibrated, and the resume behaviour (with the
evaluation and the calibration subprocess replaced by recorders)."""

import json
from pathlib import Path

import pytest

from loopq.commands import experiments
from loopq.errors import UsageError
from loopq.paths import ASSETS, REPO_ROOT

LABELS = ["Symmetric", "SmoothQuant", "QuaRot", "SpinQuant", "FlatQuant", "LoopQ"]

#: what configs/tiny.yaml's data section resolves to (test_experiments_table1 checks it on the real file)
TINY_DATA = experiments.CalibrationData(None, 256, 128)


@pytest.fixture
def recorded(monkeypatch):
    calls: dict[str, list] = {"evaluate": [], "calibrate": []}

    def fake_evaluate(out, **kwargs):
        calls["evaluate"].append(kwargs)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"method": kwargs["method"], "wikitext2_ppl": 1.0}))

    def fake_calibrate(calibration):
        calls["calibrate"].append((calibration.run.name, calibration.config, calibration.a_bits))
        return calibration.student

    monkeypatch.setattr(experiments, "evaluate", fake_evaluate)
    monkeypatch.setattr(experiments, "calibrate", fake_calibrate)
    monkeypatch.setattr(experiments, "calibration_settings", lambda calibration: {"args": calibration.args()})
    monkeypatch.setattr(experiments, "calibration_data", lambda model, config, extra: TINY_DATA)
    monkeypatch.setattr(experiments, "teacher_sha256", lambda model: f"sha256 of {model}")
    return calls


def test_table1_has_every_method_at_both_bit_widths(recorded, tmp_path):
    written = experiments.table1("teacher-dir", str(tmp_path), fit_config="loopq.yaml", tasks=[])
    assert [p.name for p in written] == ["fp.json"] + [
        f"{slug}-{bits}.json"
        for bits in ("w4a4", "w4a8")
        for slug in ("rtn", "smoothquant", "quarot", "spinquant", "flatquant", "loopq")
    ]
    labels = [c["method"] for c in recorded["evaluate"]]
    assert labels == ["FP", *LABELS, *LABELS]
    by_label = {(c["method"], c.get("bits")): c for c in recorded["evaluate"]}
    for label in ("Symmetric", "SmoothQuant", "QuaRot"):  # training-free: built from the teacher
        assert by_label[(label, "w4a4")]["model"] == "teacher-dir" and "student" not in by_label[(label, "w4a4")]
    assert by_label[("SpinQuant", "w4a8")]["student"] == str(tmp_path / "runs" / "spinquant-w4a8" / "student")
    assert recorded["calibrate"] == [
        (f"{slug}-{bits}", config, a_bits)
        for bits, a_bits in (("w4a4", 4), ("w4a8", 8))
        for slug, config in (
            ("spinquant", "configs/baselines/spinquant-tiny.yaml"),
            ("flatquant", "configs/baselines/flatquant-tiny.yaml"),
            ("loopq", "loopq.yaml"),
        )
    ]


def test_finished_rows_are_neither_recalibrated_nor_reevaluated(recorded, tmp_path):
    for name in ("fp.json", "quarot-w4a4.json", "spinquant-w4a4.json"):
        (tmp_path / name).write_text(json.dumps({"method": "kept", "wikitext2_ppl": 2.0}))
    experiments.table1("teacher-dir", str(tmp_path), tasks=[])
    evaluated = {(c["method"], c.get("bits")) for c in recorded["evaluate"]}
    assert ("FP", None) not in evaluated and ("QuaRot", "w4a4") not in evaluated
    assert ("SpinQuant", "w4a4") not in evaluated and ("SpinQuant", "w4a8") in evaluated
    assert "spinquant-w4a4" not in [run for run, _, _ in recorded["calibrate"]]
    assert json.loads((tmp_path / "quarot-w4a4.json").read_text())["method"] == "kept"


def test_a_fit_config_given_as_config_is_refused_not_ignored(tmp_path):
    """It was parsed as this command's options file and dropped: every row calibrated with configs/tiny.yaml."""
    with pytest.raises(UsageError, match=r"--config configs/small.yaml: a loopq.fit config; pass it as --fit_config"):
        experiments.main(["table1", "--model", "m", "--out", str(tmp_path), "--config", "configs/small.yaml"])
    assert not any(tmp_path.iterdir())


def test_methods_match_labels_and_slugs_in_any_case(recorded, tmp_path):
    """``--methods '[loopq, rtn]'`` matched no label (``LoopQ``, ``Symmetric``) and silently ran FP only."""
    written = experiments.table1("teacher-dir", str(tmp_path), tasks=[], bits=["w4a4"], methods=["loopq", "rtn"])
    assert [p.name for p in written] == ["fp.json", "rtn-w4a4.json", "loopq-w4a4.json"]
    assert [c["method"] for c in recorded["evaluate"]] == ["FP", "Symmetric", "LoopQ"]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"methods": ["loopq", "gptq"]}, r"^--methods gptq: not a Table 1 method; use any of Symmetric \(rtn\), .*"),
        ({"methods": []}, r"^--methods is empty; name at least one"),
        ({"bits": ["W4A4", "w8a8"]}, r"^--bits w8a8: not a bit width the experiments run; use one of w4a4, w4a8$"),
        ({"bits": ["4bit"]}, r"^--bits 4bit: not a bit width the experiments run; use one of w4a4, w4a8$"),
        ({"bits": []}, r"^--bits is empty"),
    ],
)
def test_bad_methods_or_bits_are_refused_before_any_row_runs(recorded, tmp_path, option, message):
    """An unknown ``--bits`` used to fail with a KeyError after FP and the training-free rows were evaluated."""
    out = tmp_path / "t1"
    with pytest.raises(UsageError, match=message):
        experiments.table1("teacher-dir", str(out), tasks=[], **option)
    assert recorded == {"evaluate": [], "calibrate": []} and not out.exists()


def test_bits_are_normalised_to_their_label(recorded, tmp_path):
    written = experiments.table1("teacher-dir", str(tmp_path), tasks=[], bits=["W4A8"], methods=["LoopQ"])
    assert [p.name for p in written] == ["fp.json", "loopq-w4a8.json"]
    assert recorded["calibrate"] == [("loopq-w4a8", "configs/tiny.yaml", 8)]


def test_cli_unknown_method_is_one_line_naming_the_option(recorded, tmp_path):
    argv = ["table1", "--model", "m", "--out", str(tmp_path / "o"), "--methods", "[loopq, nope]"]
    with pytest.raises(UsageError) as err:
        experiments.main(argv)
    assert str(err.value) == (
        "--methods nope: not a Table 1 method; use any of Symmetric (rtn), SmoothQuant (smoothquant), "
        "QuaRot (quarot), SpinQuant (spinquant), FlatQuant (flatquant), LoopQ (loopq)"
    )
    assert not recorded["evaluate"] and not (tmp_path / "o").exists()


def test_every_row_calibrates_on_the_fit_configs_data(recorded, monkeypatch, tmp_path):
    """The paper: all methods share the calibration set. The training-free rows get the fit config's sources and
    window count/length as evaluate options, SpinQuant and FlatQuant as --data overrides; LoopQ has them already."""
    pile = experiments.CalibrationData(["hf:mit-han-lab/pile-val-backup:validation:text"], 1024, 256)
    monkeypatch.setattr(experiments, "calibration_data", lambda model, config, extra: pile)
    args = {}
    monkeypatch.setattr(experiments, "calibrate", lambda c: args.setdefault(c.run.name, c.args()) and c.student)
    experiments.table1("teacher-dir", str(tmp_path), fit_config="loopq.yaml", tasks=[], bits=["w4a4"])
    by_label = {c["method"]: c for c in recorded["evaluate"]}
    for label in ("SmoothQuant", "QuaRot"):
        assert by_label[label]["calib_sources"] == pile.sources
        assert (by_label[label]["calib_samples"], by_label[label]["calib_seq_len"]) == (1024, 256)
    assert "calib_samples" not in by_label["Symmetric"]  # RTN reads no data
    overrides = ["--data.sources", '["hf:mit-han-lab/pile-val-backup:validation:text"]']
    overrides += ["--data.num_samples", "1024", "--data.seq_len", "256"]
    for slug in ("spinquant-w4a4", "flatquant-w4a4"):
        words = args[slug]
        start = words.index("--data.sources")
        assert words[start : start + 6] == overrides
    assert "--data.sources" not in args["loopq-w4a4"] and "--data.num_samples" not in args["loopq-w4a4"]


@pytest.mark.parametrize(
    ("config", "extra", "expected"),
    [
        ("configs/ouro1.4b.yaml", (), (["hf:mit-han-lab/pile-val-backup:validation:text"], 1024, 256)),
        ("configs/tiny.yaml", (), (None, 256, 128)),  # the default local prose
        ("configs/tiny.yaml", ("--data.num_samples", "64"), (None, 64, 128)),
    ],
)
def test_calibration_data_is_the_fit_configs_data_section(config, extra, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # parsing once left runs/ (the run directory's lock) in the working directory
    data = experiments.calibration_data(str(ASSETS / "tiny-ouro"), str(REPO_ROOT / config), extra)
    assert (data.sources, data.num_samples, data.seq_len) == expected
    assert list(tmp_path.iterdir()) == []
