"""The method cannot be switched off by accident: the calibration module installs LoopQ's schedules itself."""

import json

import pytest

from loopq.calib.diagnostics import PerLoopDiagnostics
from loopq.calib.module import LoopQCalibration, method_callbacks
from loopq.calib.mu import AdaptiveMu, mu_update_due
from loopq.calib.reselection import SharingGapReselection, round_due
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


def test_probing_in_chunks_gives_the_scores_of_one_pass():
    """``probe_groups`` bounds the probe step's memory (loopq.planning.memory); the per-loop gradients, hence S_l, are
    the same whichever groups share the pass (all 8 looped groups at once, or 3 + 3 + 2)."""
    import torch

    from loopq.calib.slt import sharing_gap_scores
    from loopq.calib.targets import compute_targets

    module = LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=2))
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    module.targets = compute_targets(module.teacher, ids, 1000, module.num_loops)
    batches = [[torch.arange(2), ids]]
    whole = sharing_gap_scores(module, batches)
    chunked = sharing_gap_scores(module, batches, chunk=3)
    assert len(whole) == 8 and chunked.keys() == whole.keys()
    assert list(chunked.values()) == pytest.approx(list(whole.values()), rel=1e-4)
    with pytest.raises(ValueError, match="probe_groups"):
        SharingGapReselection(probe_groups=-1)


def test_a_probe_that_runs_out_of_memory_halves_its_chunk_and_keeps_the_scores(capsys):
    """The first GPU run of the 2.6B config ran out of memory in the SLT probe (24 groups per pass). Here a pass of
    more than 3 probed groups "runs out of memory": 8 -> 4 -> 2 groups per pass, same scores as one pass, and the
    callback keeps the size that fit for its later rounds."""
    import torch

    from loopq.calib.slt import ProbeMemoryError, probe_scores, sharing_gap_scores
    from loopq.calib.targets import compute_targets
    from loopq.quant import looped_quant_groups

    module = LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=2))
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    module.targets = compute_targets(module.teacher, ids, 1000, module.num_loops)
    batches = [[torch.arange(2), ids]]
    whole = sharing_gap_scores(module, batches)
    real = module.compute_loss

    def limited(batch, limit=3):
        if sum(g.perturbation is not None for g in looped_quant_groups(module.student).values()) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch)

    module.compute_loss = limited
    found = probe_scores(module, batches)
    assert found.fitted == 2 and "probing 4 at a time" in capsys.readouterr().out
    assert list(found.scores.values()) == pytest.approx(list(whole.values()), rel=1e-4)
    assert all(g.perturbation is None for g in looped_quant_groups(module.student).values())  # nothing left set
    callback = SharingGapReselection(probe_groups=8)
    trainer = type("T", (), {"world_size": 1})()
    assert callback.score(trainer, module, batches).keys() == whole.keys() and callback.probe_groups == 2
    module.compute_loss = lambda batch: limited(batch, limit=0)
    with pytest.raises(ProbeMemoryError, match="one group per pass"):
        probe_scores(module, batches)
    with pytest.raises(ProbeMemoryError, match="slt_probe_groups"):
        probe_scores(module, batches, reduce=lambda flat: flat, chunk=4)
