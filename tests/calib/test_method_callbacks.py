"""The method cannot be switched off by accident: the calibration module installs LoopQ's schedules itself."""

import json

import pytest

from loopq.calib.diagnostics import PerLoopDiagnostics
from loopq.calib.module import LoopQCalibration, method_callbacks
from loopq.calib.mu import AdaptiveMu, mu_update_due
from loopq.calib.reselection import SharingGapReselection, recording_due, round_due
from loopq.paths import ASSETS
from loopq.quant import QuantConfig
from tests.helpers import read_student, run_fit

TEACHER = str(ASSETS / "tiny-ouro")


@pytest.fixture(scope="module")
def module():
    return LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=2), mu_every_n_steps=7, slt_every_n_steps=9)


def kinds(callbacks):
    return [type(c) for c in callbacks]


def test_an_empty_callback_list_gets_the_whole_method(module):
    mu, slt = method_callbacks(module, [PerLoopDiagnostics()])
    assert isinstance(mu, AdaptiveMu) and mu.every_n_steps == 7
    assert isinstance(slt, SharingGapReselection) and slt.every_n_steps == 9 and slt._budget(module) == 2


def test_explicit_callbacks_override_the_modules_schedule(module):
    assert kinds(method_callbacks(module, [AdaptiveMu(every_n_steps=3)])) == [SharingGapReselection]
    assert kinds(method_callbacks(module, [SharingGapReselection(every_n_steps=5)])) == [AdaptiveMu]


def test_components_are_switched_off_only_by_explicit_config():
    off = LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=0), adaptive_mu=False)
    assert method_callbacks(off, []) == []
    layerwise = LoopQCalibration(TEACHER, quant=QuantConfig.flatquant(4, 4), objective="layerwise")
    assert kinds(method_callbacks(layerwise, [])) == []  # FlatQuant: no trajectory, no SLT budget


def test_mu_update_schedule_by_hand():
    assert [s for s in range(12) if mu_update_due(s, 5)] == [0, 5, 10]
    assert not mu_update_due(-1, 5)  # before the first step finished


def test_reselection_schedule_by_hand():
    due = [s for s in range(40) if round_due(s, selected=0, budget=4, start_step=3, every_n_steps=10)]
    assert due == [3, 13, 23, 33]
    assert not round_due(13, selected=4, budget=4, start_step=3, every_n_steps=10)  # budget spent


def test_a_config_without_callbacks_still_runs_loopq(tmp_path):
    """Issue acceptance: `--trainer.callbacks '[]'` promotes the budgeted groups and ends with non-zero mu_t."""
    run_fit(
        tmp_path, "--trainer.callbacks", "[]", "--trainer.max_steps", "60", "--model.slt_every_n_steps", "25",
        "--model.mu_every_n_steps", "50",
    )  # fmt: skip
    _, meta = read_student(tmp_path)
    assert len(meta["promoted"]) == 2  # quant.slt_budget of configs/tiny.yaml
    assert len(meta["mu"]) == 4 and all(0 < m < 1 for m in meta["mu"][:-1])  # mu_T = 0: H_T is the final state
    config = meta["provenance"]["config"]
    assert config["model.adaptive_mu"] is True and config["model.quant.slt_budget"] == 2
    assert json.dumps(config["trainer.callbacks"]) == "[]"


def test_recording_window_by_hand():
    """The gradients of the ``probe_batches`` steps ending at a due round are scored (at most ``every_n_steps``)."""
    rec = [s for s in range(30) if recording_due(s, 0, 4, start_step=3, every_n_steps=10, window=2)]
    assert rec == [2, 3, 12, 13, 22, 23]
    assert [s for s in range(8) if recording_due(s, 0, 4, 0, every_n_steps=3, window=9)] == list(range(8))
    assert not recording_due(12, selected=4, budget=4, start_step=3, every_n_steps=10, window=2)
