"""Device placement as a property of the code (issue 27), checked without a GPU.

:mod:`tests.device_guard` puts every run-time factory call of the project that names no device on ``meta`` - a
device the model is not on - and makes ``LightningModule.device`` lie during ``setup`` as it does on a GPU. The
whole user flow runs under it: calibration (data-dependent initialisation, SLT rounds, the mu_t update, the
training steps, checkpoints, the student), export, evaluation of the export, cached generation. Without the
guard these pass on a CPU while crashing on cuda (the first GPU run: ``init_diagonal_from_data``'s ids on cuda
with the teacher on the CPU, ``grid[errors.argmin()]`` with the grid on the CPU).
"""

import json

import pytest
import torch

from loopq.artifacts import load_artifact
from loopq.commands.export import main as export_main
from loopq.metrics.perplexity import perplexity
from loopq.models.generation import generate
from loopq.paths import REPO_ROOT
from tests.device_guard import ElsewhereFactories
from tests.helpers import run_fit

GUARDS = [
    json.dumps({"class_path": f"tests.device_guard.{name}"}) for name in ("StrictDevices", "DeviceClaimedBeforeMove")
]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    run_fit(root, *[arg for guard in GUARDS for arg in ("--trainer.callbacks+", guard)])
    return root


def _project_function(body: str):
    """A function whose code says it lives in ``loopq/`` (what the guard checks), without adding a file there."""
    namespace = {"torch": torch}
    exec(compile(f"def make(x):\n    {body}\n", str(REPO_ROOT / "loopq" / "_probe.py"), "exec"), namespace)
    return namespace["make"]


def test_guard_catches_a_factory_call_without_a_device():
    x = torch.randn(8, 4)
    with ElsewhereFactories() as mode:
        torch.zeros(3) + x[0, :3]  # this test's own call is not the project's: untouched
        _project_function("return torch.linspace(0, 1, 4, device=x.device) * x")(x)  # states its device: fine
    assert mode.redirected == []
    with ElsewhereFactories() as mode, pytest.raises(RuntimeError, match="meta"):
        _project_function("return torch.linspace(0, 1, 4) * x")(x)  # the first GPU run's crash, on a CPU
    assert mode.redirected == [f"{REPO_ROOT / 'loopq' / '_probe.py'}:2"]


def test_calibration_under_the_guard_writes_a_student(calibrated):
    meta = json.loads((calibrated / "student" / "loopq_quant.json").read_text())
    assert len(meta["promoted"]) == 2 and len(meta["mu"]) == 4


def test_export_evaluate_generate_under_the_guard(calibrated, tmp_path):
    out = tmp_path / "exported"
    with ElsewhereFactories() as mode:
        export_main(["--ckpt", str(calibrated / "student"), "--out", str(out)])
        model, _, _ = load_artifact(out, device="cpu")
        ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
        ppl = perplexity(model, ids.flatten(), seq_len=12, batch_size=2)
        cached = generate(model, ids[:1, :8], max_new_tokens=6, use_cache=True)
        rerun = generate(model, ids[:1, :8], max_new_tokens=6, use_cache=False)
    assert mode.redirected == [], mode.redirected  # no run-time tensor of the flow was made without a device
    assert torch.equal(cached, rerun)
    assert perplexity(model, ids.flatten(), seq_len=12, batch_size=2).ppl == ppl.ppl  # the guard changed nothing
