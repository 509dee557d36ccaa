"""The method cannot be switched off by accident: the calibration module installs LoopQ's schedules itself."""

import inspect
import json

import pytest

from loopq.calib.diagnostics import PerLoopDiagnostics
from loopq.calib.module import LoopQCalibration, method_callbacks
from loopq.calib.mu import AdaptiveMu, mu_update_due
from loopq.calib.reselection import SharingGapReselection, recording_due, round_due
from loopq.commands.fit import MOVED_KEYS, check_moved_keys
from loopq.errors import UsageError
from loopq.paths import ASSETS
from loopq.quant import QuantConfig
from tests.helpers import read_student, run_fit

TEACHER = str(ASSETS / "tiny-ouro")


@pytest.fixture(scope="module")
def module():
    return LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=2))


def kinds(callbacks):
    return [type(c) for c in callbacks]


def test_an_empty_callback_list_gets_the_whole_method_with_the_callbacks_own_schedules(module):
    mu, slt = method_callbacks(module, [PerLoopDiagnostics()])
    assert isinstance(mu, AdaptiveMu) and mu.every_n_steps == AdaptiveMu().every_n_steps == 100  # the paper's
    assert isinstance(slt, SharingGapReselection) and slt._budget(module) == 2
    assert (slt.start_step, slt.every_n_steps, slt.per_round) == (0, 50, 1)


def test_the_schedules_have_one_home():
    """Issue 40: the mu_t and SLT schedules are the callbacks' arguments only; the module has none of them."""
    assert not [k for k in inspect.signature(LoopQCalibration).parameters if k.startswith(("slt_", "mu_"))]


@pytest.mark.parametrize("key", sorted(MOVED_KEYS))
def test_a_moved_schedule_key_is_refused_naming_its_callback(tmp_path, key):
    config = tmp_path / "old.yaml"
    config.write_text(f"model:\n  {key.removeprefix('model.')}: 5\n")
    callback = MOVED_KEYS[key].split("'")[0].rsplit(".", 1)[1]
    for argv in (["--config", str(config)], [f"--config={config}"], [f"--{key}", "5"], [f"--{key}=5"]):
        with pytest.raises(UsageError, match=f"{key}.*moved to trainer.callbacks, set .*{callback}'s"):
            check_moved_keys(["--config", "configs/tiny.yaml", *argv])
    check_moved_keys(["--config", "configs/tiny.yaml", "--model.lam", "0.2"])  # anything else: the parser's


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
        tmp_path, "--trainer.callbacks", "[]", "--trainer.max_steps", "60"
    )  # fmt: skip  # SharingGapReselection's default rounds at steps 0 and 50
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


def test_a_listed_adaptive_mu_keeps_mu_at_zero_when_the_module_turns_it_off():
    """Every shipped config lists AdaptiveMu; ``model.adaptive_mu: false`` must still keep mu = 0 (a review found the
    listed callback updating mu regardless, so a "without adaptive mu" run was the full method)."""
    from types import SimpleNamespace

    import torch

    from loopq.calib.module import Trajectory

    teacher = [torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(t)) for t in range(4)]
    trainer = SimpleNamespace(global_step=1, strategy=SimpleNamespace(reduce=lambda x, reduce_op: x))
    for on in (True, False):
        module = LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=0), adaptive_mu=on)
        module.last_trajectory = Trajectory(teacher, [s + 0.1 for s in teacher])
        module.log_dict = lambda *a, **k: None  # no trainer attached
        AdaptiveMu(every_n_steps=1).on_train_batch_end(trainer, module, None, None, 0)
        assert bool(module.mu[:-1].gt(0).all()) is on, on


def test_plain_ddp_is_refused_only_when_slt_slots_exist():
    """Plain DDP rejects the unpromoted groups' gradient-less per-loop slots; without an SLT budget there are none, so
    the listed callback must not refuse the run (it did, even for the "without SLT" ablation)."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # the strategy's wrapper, as isinstance sees it
    ddp.find_unused_parameters = False
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp))
    SharingGapReselection().on_fit_start(trainer, LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=0)))
    with pytest.raises(UsageError, match=r"plain DDP rejects; use --trainer\.strategy ddp_find_unused_parameters_true"):
        SharingGapReselection().on_fit_start(trainer, LoopQCalibration(TEACHER, quant=QuantConfig(slt_budget=2)))


@pytest.mark.parametrize("dropped", ["loop_transforms", "slt_"])
def test_a_checkpoint_of_the_old_slt_layout_is_told_to_start_again(module, dropped):
    """A checkpoint written before the fixed SLT layout lacks the per-loop slots (and the SLT state): resuming from
    it names the cause and the fix, not a bare KeyError (which it gave when only the SLT state was recognised)."""
    state = {k: v for k, v in module.state_dict().items() if dropped not in k}
    assert len(state) < len(module.state_dict())
    with pytest.raises(UsageError, match=r"written before the fixed SLT layout; start the calibration again"):
        module.load_state_dict(state)
    with pytest.raises(KeyError, match="is it a LoopQ calibration checkpoint"):
        module.load_state_dict({k: v for k, v in state.items() if "act_clip" not in k or "loop_" in k})
