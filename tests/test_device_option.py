"""``--device`` of every command that runs a model (issue 27): auto is cuda when PyTorch sees a GPU, else the CPU;
an explicit device the machine lacks is refused with one line before any work; results say where they ran."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loopq import devices
from loopq.commands import experiments, run
from loopq.commands.evaluate import evaluate
from loopq.devices import resolve_device
from loopq.errors import UsageError
from loopq.paths import REPO_ROOT

TEACHER = str(REPO_ROOT / "loopq/assets/tiny-ouro")


def test_auto_is_cuda_exactly_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="only 2 CUDA"):
        resolve_device("cuda:2")


@pytest.mark.parametrize(
    ("name", "match"), [("cuda", "no CUDA device"), ("tpu", "use auto"), ("meta", "runs on cpu or cuda")]
)
def test_a_device_the_machine_lacks_is_one_line(monkeypatch, name, match):
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=match) as err:
        resolve_device(name, "--device")
    assert str(err.value).startswith(f"--device {name}") and "\n" not in str(err.value)


def test_evaluate_loads_on_the_resolved_device_and_records_it(monkeypatch, tmp_path):
    seen = []
    real = __import__("loopq.commands.evaluate", fromlist=["load_artifact"]).load_artifact

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr("loopq.commands.evaluate.load_artifact", spy)
    result = evaluate(model=TEACHER, method="FP", tasks=[], ppl_windows=1, device="auto")
    assert seen == [torch.device("cpu")] and result["device"] == "cpu"
    if not torch.cuda.is_available():
        out = tmp_path / "r.json"
        with pytest.raises(UsageError, match="--device cuda"):
            evaluate(model=TEACHER, method="FP", tasks=[], ppl_windows=1, device="cuda", out=str(out))
        assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    "command",
    [
        ["loopq.generate", "--model", TEACHER, "--prompt", "a", "--device", "cuda"],
        ["loopq.evaluate", "--model", TEACHER, "--tasks", "[]", "--device", "cuda"],
        ["loopq.run", "--config", "configs/tiny.yaml", "--device", "cuda", "--trainer.default_root_dir", "{tmp}"],
    ],
    ids=["generate", "evaluate", "run"],
)
def test_commands_refuse_a_missing_cuda_in_one_line(command, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path / "run")) for a in command]
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: --device cuda: PyTorch sees no CUDA device")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_lm_eval_cli_gets_the_resolved_device_unless_given(monkeypatch):
    import loopq.commands.harness as lm_cli

    argv = []
    monkeypatch.setattr(lm_cli, "cli_evaluate", lambda: argv.append(list(sys.argv)))
    lm_cli.main(["--model", "loopq", "--tasks", "x"])
    lm_cli.main(["--model", "loopq", "--tasks", "x", "--device", "cpu:0"])
    assert argv[0][argv[0].index("--device") + 1] == str(resolve_device())
    assert argv[1].count("--device") == 1 and "cpu:0" in argv[1]


def test_loopq_run_decides_the_device_once_and_hands_it_down(monkeypatch, tmp_path):
    """``--device auto`` used to be resolved again by every evaluation stage and the export check (and once more
    at parse time, the result thrown away): now once, the evaluations and the export use that decision."""
    asked = []
    monkeypatch.setattr(run, "resolve_device", lambda name, *a: asked.append(name) or torch.device("cpu"))
    cli = run.parse(["--config", "configs/tiny.yaml", "--trainer.default_root_dir", str(tmp_path)])
    try:
        options = run.Options.of(cli.config)
        stages = run.Pipeline(cli, options).stages()
    finally:
        cli.release_lock()
    assert asked == ["auto"] and options.device == "cpu"
    assert [s.settings["device"] for s in stages if s.name.startswith("evaluate")] == ["cpu"] * 3


def test_experiments_decide_the_device_once_for_every_row(monkeypatch, tmp_path):
    asked, evaluated = [], []
    monkeypatch.setattr(experiments, "resolve_device", lambda name, *a: asked.append(name) or torch.device("cpu"))
    monkeypatch.setattr(experiments, "teacher_sha256", lambda model: "sha")
    monkeypatch.setattr(experiments, "evaluate", lambda out, **kw: evaluated.append(kw["device"]) or
                        Path(out).write_text('{"wikitext2_ppl": 1.0}'))  # fmt: skip
    experiments.table1(TEACHER, str(tmp_path), methods=["QuaRot", "Symmetric"], tasks=[])
    assert asked == ["auto"] and evaluated == ["cpu"] * 5  # FP, then two methods at two bit widths
