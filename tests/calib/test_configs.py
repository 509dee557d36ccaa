"""Every YAML in configs/ parses against the real CLI schema; bad keys get a one-line error naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from loopq.calib.module import LoopQCalibration
from loopq.commands.fit import TRAINER_DEFAULTS, LoopQCLI
from loopq.data.calibration import CalibrationDataModule
from loopq.paths import REPO_ROOT

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
BASELINE_CONFIGS = sorted((REPO_ROOT / "configs" / "baselines").glob("*.yaml"))


class ParseOnly(LoopQCLI):
    """The real parser and schema, without building the model (the big teachers are not on this machine)."""

    def instantiate_classes(self) -> None:
        pass


def parse(*args: str):
    cli = ParseOnly(
        LoopQCalibration, CalibrationDataModule, run=False, args=list(args), trainer_defaults=TRAINER_DEFAULTS
    )
    return cli.config


def test_there_are_configs_for_every_paper_model():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "ouro1.4b", "ouro2.6b", "loopformer3x8", "parcae370m"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_with_paper_hyperparameters(path: Path):
    config = parse("--config", str(path))
    quant = config.model.quant
    assert (quant.w_bits, quant.group_size, config.model.lam, config.model.topk) == (4, 32, 0.1, 1000)
    assert config.trainer.gradient_clip_val == 1.0 and config.data.tokenizer == config.model.teacher
    if path.stem not in ("tiny", "small"):  # the embedded teachers' recipes are scaled to a CPU
        assert (config.data.num_samples, config.data.seq_len, quant.cta_rank) == (1024, 256, 8)
    budgets = {"ouro1.4b": 4, "ouro2.6b": 8, "loopformer3x8": 1, "parcae370m": 1, "small": 6}
    if path.stem in budgets:
        assert quant.slt_budget == budgets[path.stem]


def test_there_are_configs_for_the_trained_baselines():
    assert {p.stem for p in BASELINE_CONFIGS} == {"spinquant-tiny", "flatquant-tiny"}


@pytest.mark.parametrize("path", BASELINE_CONFIGS, ids=lambda p: p.stem)
def test_baseline_config_parses_as_a_static_configuration(path: Path):
    """One configuration for all loops (no LAS/SLT/CTA), the tiny budget of configs/tiny.yaml, the method's loss."""
    config = parse("--config", str(path))
    quant, tiny = config.model.quant, parse("--config", str(REPO_ROOT / "configs" / "tiny.yaml"))
    method = path.stem.removesuffix("-tiny")
    assert quant.method == method and (quant.las, quant.slt_budget, quant.cta) == (False, 0, False)
    assert (quant.w_bits, quant.a_bits, quant.group_size) == (4, 4, 32)
    assert config.data == tiny.data and config.trainer.max_steps == tiny.trainer.max_steps
    assert config.model.teacher == tiny.model.teacher and config.trainer.gradient_clip_val == 1.0
    objective, lam = {"spinquant": ("trajectory", 0.0), "flatquant": ("layerwise", 0.0)}[method]
    assert (config.model.objective, config.model.lam) == (objective, lam)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "pretrain").glob("*.yaml")), ids=lambda p: p.stem)
def test_pretrain_configs_parse(path):
    from loopq.commands.pretrain import PretrainCLI, PretrainDataModule, pretrainer_class

    class Parse(PretrainCLI):
        def instantiate_classes(self) -> None:
            pass

    args = ["--config", str(path)]
    cli = Parse(pretrainer_class(args), PretrainDataModule, run=False, args=args)
    assert cli.config.model.vocab_size == cli.config.data.vocab_size == 2048
    assert cli.config.architecture == path.stem.removeprefix("tiny-").removeprefix("small-").split("-")[0]


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "stress").glob("*.yaml")), ids=lambda p: p.stem)
def test_stress_configs_parse(path):
    from loopq.commands.pretrain import PretrainDataModule
    from loopq.commands.stress import StressCLI, StressFinetuner

    class Parse(StressCLI):
        def before_instantiate_classes(self) -> None:
            pass

        def instantiate_classes(self) -> None:
            pass

    cli = Parse(StressFinetuner, PretrainDataModule, run=False, args=["--config", str(path)])
    assert cli.config.data.tokenizer == cli.config.model.teacher  # linked: the teacher's own tokenizer


def test_unknown_key_is_named(capsys):
    with pytest.raises(SystemExit):
        parse("--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--model.quant.w_bit", "4")
    assert "w_bit" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["loopq.fit", "loopq.pretrain", "loopq.testbed"])
def test_cli_help(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0 and "usage" in out.stdout.lower()
